#!/usr/bin/python3
"""Runs every libFuzzer target of fuzz/ (fuzz/<name>_fuzzer.cpp, built as
<build-dir>/fuzz/<name>_fuzzer) for a fixed time on its seed corpus fuzz/corpus/<name>/ (read only:
new inputs go to <build-dir>/fuzz-corpus/<name>/, crash, leak, timeout and out-of-memory inputs to
<build-dir>/fuzz-artifacts/<name>/). Writes one meson-testlog-style line per target to --log
("fuzz <name>", OK, FAIL or SKIP) so that scripts/test_summary.py counts each target as one test.
Without clang++ every target is a SKIP; a target whose binary is missing (the build failed) is a FAIL.
--jobs N runs N targets side by side (each is one libFuzzer process on one core); their reports
are printed and logged in target order.
Usage: fuzz/run_fuzzers.py [--build-dir build-fuzz] [--seconds 25] [--jobs 1] [--log FILE] [NAME ...]
Exit status 1 when a target failed."""
import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "fuzz")


def targets():
    return sorted(f[: -len("_fuzzer.cpp")] for f in os.listdir(FUZZ) if f.endswith("_fuzzer.cpp"))


def log_line(log, name, result, text, seconds):
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"name": f"fuzz {name}", "result": result, "duration": seconds,
                                "stdout": text}) + "\n")


def run(name, build_dir, seconds):
    """Runs one target: (passed, what to print, (result, log text, seconds))."""
    binary = os.path.join(build_dir, "fuzz", f"{name}_fuzzer")
    seeds = os.path.join(FUZZ, "corpus", name)
    if not os.path.isfile(binary):
        msg = f"{binary} is missing (the fuzz build failed?)"
        return False, f"  fuzz {name}: FAIL: {msg}", ("FAIL", msg, 0.0)
    if not os.path.isdir(seeds):
        msg = f"no seed corpus {seeds}"
        return False, f"  fuzz {name}: FAIL: {msg}", ("FAIL", msg, 0.0)
    work = os.path.join(build_dir, "fuzz-corpus", name)
    artifacts = os.path.join(build_dir, "fuzz-artifacts", name)
    os.makedirs(work, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    cmd = [binary, f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
           "-print_final_stats=1", f"-artifact_prefix={artifacts}/"]
    dictionary = os.path.join(FUZZ, f"{name}.dict")
    if os.path.isfile(dictionary):
        cmd.append(f"-dict={dictionary}")
    cmd += [work, seeds]
    env = dict(os.environ)
    env.setdefault("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    start = time.monotonic()
    # A hang inside the target is caught by -timeout; the outer limit only guards the runner.
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", env=env, timeout=seconds + 120)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or "") if isinstance(e.stdout, str) else "", -1
        out += f"\nrunner: {name}_fuzzer did not stop after {seconds + 120} s"
    secs = time.monotonic() - start
    stats = [l for l in out.splitlines() if l.startswith("stat::number_of_executed_units")]
    runs = stats[-1].split(":")[-1].strip() if stats else "?"
    ok = rc == 0
    text = [f"  fuzz {name}: {'OK' if ok else 'FAIL'} ({runs} runs in {secs:.0f} s)"]
    if not ok:
        text += out.splitlines()[-60:]
        text.append(f"  inputs that failed are in {artifacts}/; reproduce with {binary} FILE")
    return ok, "\n".join(text), ("OK" if ok else "FAIL", out[-20000:], secs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-fuzz"))
    ap.add_argument("--seconds", type=int, default=25)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--log", default="")
    ap.add_argument("names", nargs="*")
    args = ap.parse_args()
    names = args.names or targets()
    if args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
        if os.path.exists(args.log):
            os.remove(args.log)
    if shutil.which("clang++") is None:
        for name in names:
            print(f"  fuzz {name}: SKIP (no clang++)")
            log_line(args.log, name, "SKIP", "no clang++ on PATH", 0.0)
        return 0
    build_dir = os.path.abspath(args.build_dir)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = [pool.submit(run, n, build_dir, args.seconds) for n in names]
        failed = 0
        for name, done in zip(names, runs):
            ok, text, (result, logged, secs) = done.result()
            print(text, flush=True)
            log_line(args.log, name, result, logged, secs)
            failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
