#!/usr/bin/python3
"""A swap path with too little free space for the default reserve: strata-train
(the native example's config) fails at finalize naming strata.budgets.disk and
the smallest budget that fits; that budget trains on the same small file
system, and one byte less is refused. The small file system is a 100 MiB
tmpfs mounted in a private mount namespace (unshare); where that is not
allowed, the test skips (exit 77).
Usage: disk_space_test.py STRATA_TRAIN SOURCE_ROOT"""
import json
import os
import re
import subprocess
import sys
import tempfile

SIZE = "100M"  # below the default example's 123 MiB reserve, above its 55.5 MiB of state


def train(exe, config, cwd):
    return subprocess.run([exe, "--config", config, "--steps", "2", "--quiet"], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def inside(exe, root, tmp):
    swap = os.path.join(tmp, "swap")
    base = json.load(open(os.path.join(root, "examples/configs/strata_default.json")))
    base["strata"]["io"]["paths"] = [swap]

    def config(disk):
        c = json.loads(json.dumps(base))
        if disk is not None:
            c["strata"]["budgets"]["disk"] = disk
        path = os.path.join(tmp, f"config_{disk}.json")
        json.dump(c, open(path, "w"))
        return path

    failures = []
    r = train(exe, config(None), tmp)
    out = r.stdout + r.stderr
    m = re.search(r"strata\.budgets\.disk >= (\d+)", out)
    if r.returncode == 0 or "too little free space" not in out or m is None or "disk_bytes" in out:
        return [f"the default reserve on a {SIZE} file system: exit {r.returncode}, expected the free-space "
                f"error naming strata.budgets.disk >= N:\n{out[-3000:]}"]
    least = int(m.group(1))
    print(f"default reserve refused: {out.strip().splitlines()[-1]}")
    r = train(exe, config(least), tmp)
    if r.returncode != 0:
        failures.append(f"strata.budgets.disk = {least} (the stated smallest) failed:\n{(r.stdout + r.stderr)[-3000:]}")
    else:
        print(f"strata.budgets.disk = {least} trains on the {SIZE} file system")
    r = train(exe, config(least - 1), tmp)
    out = r.stdout + r.stderr
    if r.returncode == 0 or f"strata.budgets.disk >= {least}" not in out:
        failures.append(f"strata.budgets.disk = {least - 1}: exit {r.returncode}, expected a refusal naming "
                        f">= {least}:\n{out[-3000:]}")
    return failures


def main():
    exe, root = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    if os.environ.get("STRATA_DISK_SPACE_TEST_INSIDE"):
        tmp = sys.argv[3]
        os.mkdir(os.path.join(tmp, "swap"))
        m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", os.path.join(tmp, "swap")],
                           capture_output=True, text=True)
        if m.returncode != 0:
            print(f"skip: cannot mount a tmpfs in a private mount namespace: {m.stderr.strip()}")
            return 77
        failures = inside(exe, root, tmp)
        for f in failures:
            print("FAILED " + f)
        return 1 if failures else 0
    with tempfile.TemporaryDirectory(prefix="strata_disk_space_") as tmp:
        env = dict(os.environ, STRATA_DISK_SPACE_TEST_INSIDE="1")
        try:
            r = subprocess.run(["unshare", "-rm", sys.executable, os.path.abspath(__file__), exe, root, tmp], env=env,
                               capture_output=True, text=True, timeout=1200)
        except FileNotFoundError:
            print("skip: no unshare")
            return 77
        print(r.stdout, end="")
        if r.returncode not in (0, 1, 77):
            if "unshare" in r.stderr and ("Operation not permitted" in r.stderr or "failed" in r.stderr):
                print(f"skip: no private mount namespace here: {r.stderr.strip()}")
                return 77
            print(r.stderr)
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
