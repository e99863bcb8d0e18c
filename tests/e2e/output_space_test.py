#!/usr/bin/python3
"""What a run writes, counted per file system: strata-train and
examples/python/train_llama.py check, once the engine holds its swap files,
that the outputs on each file system (one checkpoint, the export) fit together
in what is free there, and refuse before the first step (exit 2) naming the
flags and the swap paths on it:
  - swap files and --checkpoint on one file system, each fitting alone;
  - --checkpoint and --export on one file system, each fitting alone;
and a save that fails during the run (a second checkpoint where there is room
for one) ends in one line naming --checkpoint (exit 1), `latest` still naming
the first. The file systems are tmpfs mounts in a private mount namespace
(unshare); where that is not allowed, the test skips (exit 77). The Python
half runs when torch and LIBSTRATA_SO load (not in a sanitizer build).
Usage: output_space_test.py STRATA_TRAIN SOURCE_ROOT LIBSTRATA_SO [--no-python]"""
import json
import os
import re
import subprocess
import sys
import tempfile

PAGE = 4096


def pages(n):
    return (n + PAGE - 1) // PAGE * PAGE


class Runner:
    """One trainer: its command line, its config (swap in `swap`, with a
    strata.budgets.disk), and the small model's flags."""

    def __init__(self, name, argv, base_config, model_flags, tmp, env=None):
        self.name, self.argv, self.base, self.flags, self.tmp, self.env = name, argv, base_config, model_flags, tmp, env
        self.count = 0

    def config(self, swap, disk):
        c = json.loads(json.dumps(self.base))
        c["strata"]["io"]["paths"] = [swap]
        c["strata"].setdefault("budgets", {})["disk"] = disk
        self.count += 1
        path = os.path.join(self.tmp, f"{self.name}-{self.count}.json")
        json.dump(c, open(path, "w"))
        return path

    def run(self, swap, disk, *extra, steps=2):
        cmd = self.argv + ["--config", self.config(swap, disk), "--steps", str(steps), *self.flags, *extra]
        return subprocess.run(cmd, cwd=self.tmp, capture_output=True, text=True, timeout=600, env=self.env)


def mount(tmp, name, size):
    d = os.path.join(tmp, name)
    os.mkdir(d)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d], capture_output=True, text=True)
    if m.returncode != 0:
        raise OSError(m.stderr.strip())
    return d


def bytes_in(pattern, text):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def check_trainer(t, tmp):
    failures = []
    plain = os.path.join(tmp, f"{t.name}-swap")
    os.mkdir(plain)
    # The swap files' size: the least disk budget (the files are made at that size).
    r = t.run(plain, 4096)
    swap_bytes = bytes_in(r"strata\.budgets\.disk >= (\d+)", r.stdout + r.stderr)
    if swap_bytes is None:
        return [f"{t.name}: a 4 KiB disk budget was not refused naming the least:\n{r.stdout}{r.stderr}"]
    # What one checkpoint and the export need, as the refusal on a 64 KiB file system says.
    small = mount(tmp, f"{t.name}-small", "64k")
    r = t.run(plain, swap_bytes, "--checkpoint", os.path.join(small, "ck"), "--save-every", "1")
    ck_bytes = bytes_in(r"needs? [^(]*\((\d+) bytes\)", r.stderr)
    r2 = t.run(plain, swap_bytes, "--export", os.path.join(small, "ex"))
    ex_bytes = bytes_in(r"needs? [^(]*\((\d+) bytes\)", r2.stderr)
    if r.returncode != 2 or r2.returncode != 2 or ck_bytes is None or ex_bytes is None:
        return [f"{t.name}: outputs on a 64 KiB file system were not refused with their sizes:\n"
                f"{r.stdout}{r.stderr}\n{r2.stdout}{r2.stderr}"]
    print(f"{t.name}: swap files {swap_bytes} B, one checkpoint up to {ck_bytes} B, the export {ex_bytes} B")

    # Swap files and the checkpoint on one file system: each fits alone.
    shared = mount(tmp, f"{t.name}-swap-ck", pages(swap_bytes + ck_bytes // 2))
    os.mkdir(os.path.join(shared, "swap"))
    ck = os.path.join(shared, "ck")
    r = t.run(os.path.join(shared, "swap"), swap_bytes, "--checkpoint", ck, "--save-every", "1")
    out = r.stdout + r.stderr
    if (r.returncode != 2 or "--checkpoint " + ck not in r.stderr or "strata.io.paths" not in r.stderr
            or "after the swap files in " + os.path.join(shared, "swap") not in r.stderr
            or re.search(r"^step +1\b", r.stdout, re.M) or any(n.startswith("step-") for n in os.listdir(ck))):
        failures.append(f"{t.name}: swap files and --checkpoint on one file system that holds each alone: want "
                        f"exit 2 before any step naming --checkpoint and strata.io.paths; got exit {r.returncode}:\n"
                        f"{out[-3000:]}")
    else:
        print(f"{t.name}: swap + checkpoint refused: {r.stderr.strip().splitlines()[-1]}")
    r = t.run(plain, swap_bytes, "--checkpoint", ck, "--save-every", "2")
    if r.returncode != 0 or sorted(n for n in os.listdir(ck) if n.startswith("step-")) != ["step-2"]:
        failures.append(f"{t.name}: the checkpoint alone on that file system should train and save step-2 once:\n"
                        f"{(r.stdout + r.stderr)[-3000:]}")

    # The checkpoint and the export on one file system: each fits alone.
    both = mount(tmp, f"{t.name}-ck-ex", pages(ck_bytes + ex_bytes // 2))
    r = t.run(plain, swap_bytes, "--checkpoint", os.path.join(both, "ck"), "--save-every", "1",
              "--export", os.path.join(both, "ex"))
    if (r.returncode != 2 or "--checkpoint " + os.path.join(both, "ck") not in r.stderr
            or "--export " + os.path.join(both, "ex") not in r.stderr or "(one file system)" not in r.stderr
            or "strata.io.paths" in r.stderr):
        failures.append(f"{t.name}: --checkpoint and --export on one file system that holds each alone: want exit "
                        f"2 naming both; got exit {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    else:
        print(f"{t.name}: checkpoint + export refused: {r.stderr.strip().splitlines()[-1]}")

    # Room for one checkpoint, not two: the second save fails, naming the flag.
    one = mount(tmp, f"{t.name}-one-ck", pages(ck_bytes + ck_bytes // 2))
    ck = os.path.join(one, "ck")
    r = t.run(plain, swap_bytes, "--checkpoint", ck, "--save-every", "1", steps=3)
    lines = r.stderr.strip().splitlines()
    latest = open(os.path.join(ck, "latest")).read().split()[0] if os.path.exists(os.path.join(ck, "latest")) else None
    if (r.returncode != 1 or not lines or f"--checkpoint {ck}: the save of step 2 failed" not in lines[-1]
            or "Traceback" in r.stderr or latest != "step-1"):
        failures.append(f"{t.name}: a second checkpoint where one fits: want exit 1, a last line naming --checkpoint "
                        f"and step 2, latest = step-1; got exit {r.returncode}, latest {latest}:\n"
                        f"{(r.stdout + r.stderr)[-3000:]}")
    else:
        print(f"{t.name}: failed save: {lines[-1]}")
    return failures


def inside(exe, root, lib, python, tmp):
    failures = []
    native = json.load(open(os.path.join(root, "examples/configs/strata_default.json")))
    trainers = [Runner("strata-train", [exe], native, ["--width", "128", "--depth", "4", "--quiet"], tmp)]
    if python:
        llama = json.load(open(os.path.join(root, "examples/configs/llama_default.json")))
        flags = ["--size", "tiny", "--layers", "1", "--seq-len", "16", "--eval-every", "1", "--eval-batches", "1",
                 "--sample", "0", "--no-progress"]
        env = dict(os.environ, STRATA_LIBRARY=lib)
        trainers.append(Runner("train_llama", [sys.executable, os.path.join(root, "examples/python/train_llama.py")],
                               llama, flags, tmp, env))
    else:
        print("train_llama.py: not run here (--no-python: a sanitizer build's library)")
    for t in trainers:
        failures += check_trainer(t, tmp)
    return failures


def main():
    exe, root, lib = (os.path.abspath(a) for a in sys.argv[1:4])
    python = "--no-python" not in sys.argv[4:]
    if python:
        try:
            import torch  # noqa: F401
        except ImportError:
            python = False
    if os.environ.get("STRATA_OUTPUT_SPACE_TEST_INSIDE"):
        tmp = os.environ["STRATA_OUTPUT_SPACE_TEST_INSIDE"]
        try:
            failures = inside(exe, root, lib, python, tmp)
        except OSError as e:
            print(f"skip: cannot mount a tmpfs in a private mount namespace: {e}")
            return 77
        for f in failures:
            print("FAILED " + f)
        return 1 if failures else 0
    # Whether a private mount namespace can be had here at all (unshare exits
    # 1 when it cannot, as the test does when it fails: ask first).
    try:
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        print("skip: no unshare")
        return 77
    if probe.returncode != 0:
        print(f"skip: no private mount namespace here: {probe.stderr.strip()}")
        return 77
    with tempfile.TemporaryDirectory(prefix="strata_output_space_") as tmp:
        env = dict(os.environ, STRATA_OUTPUT_SPACE_TEST_INSIDE=tmp)
        try:  # under meson's 900 s
            r = subprocess.run(["unshare", "-rm", sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env,
                               capture_output=True, text=True, timeout=840)
        except subprocess.TimeoutExpired as e:
            text = "".join(t.decode(errors="replace") if isinstance(t, bytes) else (t or "")
                           for t in (e.stdout, e.stderr))
            print(f"FAILED: still running after {e.timeout} s:\n{text}")
            return 1
        print(r.stdout, end="")
        if r.returncode != 0:
            print(r.stderr)
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
