#!/usr/bin/python3
"""Runs strata's pytest suite (tests/python) for meson and ends with one line
that scripts/test_summary.py counts:
"pytest-summary: N passed, N failed, N skipped".
Exit 77 (a skipped test for meson) when torch or pytest is not installed."""
import os
import sys


def main():
    try:
        import pytest
        import torch  # noqa: F401
    except ImportError as e:
        print(f"pytest-summary: 0 passed, 0 failed, 1 skipped ({e}; install python3-torch python3-pytest)")
        return 77

    counts = {"passed": 0, "failed": 0, "skipped": 0}

    class Count:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed") or \
                    (report.when == "teardown" and report.outcome == "failed"):
                counts[report.outcome if report.outcome in counts else "failed"] += 1

    here = os.path.dirname(os.path.abspath(__file__))
    args = ["-q", "-rfEs", "-p", "no:cacheprovider", here] + sys.argv[1:]
    rc = pytest.main(args, plugins=[Count()])
    print(f"pytest-summary: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if rc != 0 and counts["failed"] == 0:
        print(f"pytest-summary: pytest exited {rc} without a failed test (a collection error, or no tests)")
        return 1
    return 0 if rc == 0 and counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
