#!/usr/bin/python3
"""Runs every libFuzzer target of fuzz/ (fuzz/<name>_fuzzer.cpp, built as
<build-dir>/fuzz/<name>_fuzzer) for a fixed time on its seed corpus fuzz/corpus/<name>/ (read only:
new inputs go to <build-dir>/fuzz-corpus/<name>/, crash, leak, timeout and out-of-memory inputs to
<build-dir>/fuzz-artifacts/<name>/). Writes one meson-testlog-style line per target to --log
("fuzz <name>", OK, FAIL or SKIP) so that scripts/test_summary.py counts each target as one test.
Without clang++ every target is a SKIP; a target whose binary is missing (the build failed) is a FAIL.
Usage: fuzz/run_fuzzers.py [--build-dir build-fuzz] [--seconds 25] [--log FILE] [NAME ...]
Exit status 1 when a target failed."""
import argparse
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


def run(name, build_dir, seconds, log):
    binary = os.path.join(build_dir, "fuzz", f"{name}_fuzzer")
    seeds = os.path.join(FUZZ, "corpus", name)
    if not os.path.isfile(binary):
        msg = f"{binary} is missing (the fuzz build failed?)"
        print(f"  fuzz {name}: FAIL: {msg}")
        log_line(log, name, "FAIL", msg, 0.0)
        return False
    if not os.path.isdir(seeds):
        msg = f"no seed corpus {seeds}"
        print(f"  fuzz {name}: FAIL: {msg}")
        log_line(log, name, "FAIL", msg, 0.0)
        return False
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
    print(f"  fuzz {name}: {'OK' if ok else 'FAIL'} ({runs} runs in {secs:.0f} s)")
    if not ok:
        print("\n".join(out.splitlines()[-60:]))
        print(f"  inputs that failed are in {artifacts}/; reproduce with {binary} FILE")
    log_line(log, name, "OK" if ok else "FAIL", out[-20000:], secs)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-fuzz"))
    ap.add_argument("--seconds", type=int, default=25)
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
    failed = [n for n in names if not run(n, os.path.abspath(args.build_dir), args.seconds, args.log)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
