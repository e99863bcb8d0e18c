#!/usr/bin/python3
"""Runs strata's pytest suite (tests/python) for meson and ends with one line
that scripts/test_summary.py counts:
"pytest-summary: N passed, N failed, N skipped".
Exit 77 (a skipped test for meson) when torch or pytest is not installed.

--jobs N (first argument) runs the suite as N pytest processes side by side:
the tests are collected once and dealt out round-robin, each process gets its
own --basetemp, and their outputs are printed one after another with one
summary line over all of them (the GPU check's machine runs the suite in a
quarter of the time; most tests start a Python with torch). The other
arguments go to pytest as they are."""
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(extra):
    import pytest

    counts = {"passed": 0, "failed": 0, "skipped": 0}

    class Count:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or \
                    (report.when == "teardown" and report.outcome == "failed"):
                counts[report.outcome if report.outcome in counts else "failed"] += 1

    targets = [a for a in extra if not a.startswith("-") and "::" in a]
    options = [a for a in extra if a not in targets]
    args = ["-q", "-rfEs", "-p", "no:cacheprovider"] + (targets or [HERE]) + options
    rc = pytest.main(args, plugins=[Count()])
    print(f"pytest-summary: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if rc != 0 and counts["failed"] == 0:
        print(f"pytest-summary: pytest exited {rc} without a failed test (a collection error, or no tests)")
        return 1
    return 0 if rc == 0 and counts["failed"] == 0 else 1


def collect():
    """The suite's test ids, in file order (pytest --collect-only -q)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", HERE],
                         cwd=os.path.dirname(os.path.dirname(HERE)), capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode != 0 or not ids:
        sys.stdout.write(out.stdout + out.stderr)
        return None
    root = os.path.dirname(os.path.dirname(HERE))
    return [os.path.join(root, i) for i in ids]


def _die_with_parent():
    """In a shard's process before it runs: SIGKILL when the runner dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_sharded(jobs, extra):
    ids = collect()
    if ids is None:
        print("pytest-summary: 0 passed, 1 failed, 0 skipped (the tests could not be collected)")
        return 1
    shards = [ids[k::jobs] for k in range(min(jobs, len(ids)))]
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0

    def report(k, n, rc, text):
        """Prints shard k's output (its summary line folded into the totals)."""
        nonlocal worst
        worst = max(worst, 1 if rc is None else rc)
        print(f"--- shard {k + 1} of {len(shards)}: {n} tests, " + ("stopped" if rc is None else f"exit {rc}"))
        seen = False
        for line in text.splitlines():
            if line.startswith("pytest-summary: ") and line[16:17].isdigit():
                parts = line[16:].split(",")
                for part, key in zip(parts, ("passed", "failed", "skipped")):
                    totals[key] += int(part.split()[0])
                seen = True
            else:
                print(line)
        if not seen:
            totals["failed"] += 1
            print(f"(shard {k + 1} ended without its summary line: counted as one failure)")
        sys.stdout.flush()

    # A SIGTERM (the GPU check's stage limit) stops the shards and still prints
    # what each had done, with the summary line.
    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="strata-pytest-") as tmp:
        procs = {}
        for k, shard in enumerate(shards):
            log = open(os.path.join(tmp, f"shard{k}.log"), "w+")
            # -v (with run_one's -q: a line per file) and --durations: where the time goes.
            cmd = [sys.executable, os.path.abspath(__file__), *shard, *extra, "-v", "--durations=5",
                   "--basetemp", os.path.join(tmp, f"base{k}")]
            # Unbuffered: a shard killed at the limit has still written where it was.
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            # A session of its own: a stop kills the shard's whole process group (the
            # torchrun launchers, ranks and example scripts its tests start), not only pytest;
            # and the shard dies with this runner, should it be killed outright.
            procs[k] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent), log, len(shard))
        try:
            while procs:  # each shard's output as it ends
                for k in sorted(procs):
                    p, log, n = procs[k]
                    rc = p.poll()
                    if rc is None:
                        continue
                    log.seek(0)
                    report(k, n, rc, log.read())
                    log.close()
                    del procs[k]
                time.sleep(0.2)
        except KeyboardInterrupt:
            for p, _, _ in procs.values():
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for k in sorted(procs):
                p, log, n = procs[k]
                p.wait()
                log.seek(0)
                report(k, n, None, log.read())
                log.close()
            print(f"pytest-summary: {totals['passed']} passed, {totals['failed']} failed, "
                  f"{totals['skipped']} skipped (stopped: {len(procs)} shard(s) still running)")
            return 1
    print(f"pytest-summary: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 0 if worst == 0 and totals["failed"] == 0 else 1


def main(argv):
    try:
        import pytest  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        print(f"pytest-summary: 0 passed, 0 failed, 1 skipped ({e}; install python3-torch python3-pytest)")
        return 77
    if argv[:1] == ["--jobs"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            print("run_pytest: --jobs needs a whole number >= 1", file=sys.stderr)
            return 2
        jobs, extra = int(argv[1]), argv[2:]
        if jobs > 1:
            return run_sharded(jobs, extra)
        argv = extra
    return run_one(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
