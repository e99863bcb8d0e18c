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
import subprocess
import sys
import tempfile

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


def run_sharded(jobs, extra):
    ids = collect()
    if ids is None:
        print("pytest-summary: 0 passed, 1 failed, 0 skipped (the tests could not be collected)")
        return 1
    shards = [ids[k::jobs] for k in range(min(jobs, len(ids)))]
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    worst = 0
    with tempfile.TemporaryDirectory(prefix="strata-pytest-") as tmp:
        procs = []
        for k, shard in enumerate(shards):
            log = open(os.path.join(tmp, f"shard{k}.log"), "w+")
            cmd = [sys.executable, os.path.abspath(__file__), *shard, *extra,
                   "--basetemp", os.path.join(tmp, f"base{k}")]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, len(shard)))
        for k, (p, log, n) in enumerate(procs):
            rc = p.wait()
            worst = max(worst, rc)
            log.seek(0)
            text = log.read()
            log.close()
            print(f"--- shard {k + 1} of {len(procs)}: {n} tests, exit {rc}")
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
