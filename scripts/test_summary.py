#!/usr/bin/python3
"""Sums test results from meson testlog.json files into one closing line:
"N passed, N failed, N skipped". gtest binaries and the pytest suite count per
test case (parsed from the run's own output, so a stale report cannot leak in); other tests count
once. A test that failed without a gtest failure count (crash, timeout) counts
as one failure. Exit status 1 when anything failed."""
import argparse
import json
import os
import re
import sys

PASSED = re.compile(r"^\[  PASSED  \] (\d+) tests?\.", re.M)
SKIPPED = re.compile(r"^\[  SKIPPED \] (\d+) tests?,", re.M)
FAILED = re.compile(r"^\[  FAILED  \] (\d+) tests?,", re.M)
PYTEST = re.compile(r"^pytest-summary: (\d+) passed, (\d+) failed, (\d+) skipped", re.M)


def count(path):
    passed = failed = skipped = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)
            out = t.get("stdout") or ""
            result = t.get("result")
            py = PYTEST.findall(out)
            if py:
                p, fl, s = (int(x) for x in py[-1])
                if result not in ("OK", "SKIP", "EXPECTEDFAIL") and fl == 0:
                    fl = 1
                    print(f"  {t['name']}: {result} without a pytest failure (crash or timeout)")
                passed, skipped, failed = passed + p, skipped + s, failed + fl
            elif "[==========]" in out:
                p = sum(int(x) for x in PASSED.findall(out))
                s = sum(int(x) for x in SKIPPED.findall(out))
                fl = sum(int(x) for x in FAILED.findall(out))
                if result not in ("OK", "SKIP", "EXPECTEDFAIL") and fl == 0:
                    fl = 1
                    print(f"  {t['name']}: {result} without a gtest failure (crash or timeout)")
                passed, skipped, failed = passed + p, skipped + s, failed + fl
            elif result == "SKIP":
                skipped += 1
            elif result in ("OK", "EXPECTEDFAIL"):
                passed += 1
            else:
                failed += 1
            if result not in ("OK", "SKIP", "EXPECTEDFAIL"):
                print(f"  failed: {t['name']} ({result})")
    return passed, failed, skipped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--extra-failed", type=int, default=0)
    args = ap.parse_args()
    passed = skipped = 0
    failed = args.extra_failed
    for path in args.logs:
        if os.path.exists(path):
            p, f, s = count(path)
            passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
