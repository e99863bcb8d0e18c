#!/usr/bin/python3
"""The example model trained through the C API (strata-train) for 20 steps under
every placement in examples/configs/: the fp32 master weights are bit-identical
across placements, the loss halves, and each placement moves bytes where its
name says (nvme traffic only when something lives on nvme, compute copies
cross the link only when they live off the device).
With STRATA_TEST_DEVICE=cuda (scripts/gpu-test.sh) each config runs with
strata.device "cuda" and a 1 GiB device budget (the suites share the GPU), the
model on the CUDA runner; without a usable CUDA device the test is skipped
(exit 77), saying why.
Usage: example_placements_test.py STRATA_TRAIN SOURCE_ROOT"""
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

STEPS = 20
CONFIGS = [
    "placement_device.json",
    "placement_cpu_optimizer.json",
    "placement_cpu_all.json",
    "placement_nvme_optimizer.json",
    "placement_nvme_all.json",
    "placement_cpu_nvme_split.json",
    "placement_nvme_max_in_cpu.json",
]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
SKIP = 77  # meson: the test was skipped
# strata-train's error when the engine cannot be made on CUDA for want of a GPU
# (UNAVAILABLE) or of CUDA in the build (UNIMPLEMENTED).
NO_CUDA = re.compile(r"create the engine: (UNAVAILABLE|UNIMPLEMENTED): .*")


def test_device():
    """The engine's device for these runs: STRATA_TEST_DEVICE, host when unset."""
    device = os.environ.get("STRATA_TEST_DEVICE", "") or "host"
    if device not in ("host", "cuda"):
        sys.exit(f"STRATA_TEST_DEVICE is {device!r}; it takes host or cuda (unset: host)")
    return device


def config_on(root, name, device, tmp):
    """The path of config `name`, rewritten for `device` into `tmp` when that
    is not the host device."""
    path = os.path.join(root, "examples/configs", name)
    if device == "host":
        return path
    with open(path) as f:
        cfg = json.load(f)
    cfg["strata"]["device"] = device
    cfg["strata"].setdefault("budgets", {})["device"] = "1GiB"
    out = os.path.join(tmp, name)
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


def size(text):
    num, unit = text.split()
    return float(num) * UNITS[unit]


def main():
    exe, root = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    device = test_device()
    digests, failures = {}, []
    for name in CONFIGS:
        with tempfile.TemporaryDirectory(prefix="strata_example_") as tmp:
            os.mkdir(os.path.join(tmp, "strata_swap"))
            dump = os.path.join(tmp, "masters.bin")
            cmd = [exe, "--config", config_on(root, name, device, tmp), "--steps", str(STEPS),
                   "--width", "128", "--depth", "4", "--quiet", "--dump-masters", dump]
            run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=600)
            absent = NO_CUDA.search(run.stderr) if device == "cuda" and run.returncode != 0 else None
            if absent:
                print(f"SKIP: STRATA_TEST_DEVICE=cuda: no usable CUDA device: {absent.group(0)}")
                return SKIP
            if run.returncode != 0:
                failures.append(f"{name}: exit {run.returncode}\n{run.stdout}\n{run.stderr}")
                continue
            leftover = os.listdir(os.path.join(tmp, "strata_swap"))
            if leftover:  # swap files and the lock file go at a clean close
                failures.append(f"{name}: swap or lock files left behind: {leftover}")
            with open(dump, "rb") as f:
                digests[name] = hashlib.sha256(f.read()).hexdigest()
            m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", run.stdout)
            first, last = float(m.group(1)), float(m.group(2))
            t = re.search(r"per step: h2d (.+?), d2h (.+?), nvme read (.+?), nvme write (.+?);", run.stdout)
            h2d, d2h, rd, wr = (size(x) for x in t.groups())
            cfg = json.load(open(os.path.join(root, "examples/configs", name)))
            zero = cfg["zero_optimization"]
            on_nvme = any(zero.get(k, {}).get("device") == "nvme" for k in ("offload_optimizer", "offload_param"))
            params_off = zero.get("offload_param", {}).get("device") in ("cpu", "nvme")
            print(f"{name:32s} loss {first:.4f} -> {last:.4f}  h2d {h2d/2**20:.1f} MiB  d2h {d2h/2**20:.1f} MiB  "
                  f"nvme {rd/2**20:.1f}/{wr/2**20:.1f} MiB  masters {digests[name][:16]}")
            if not last <= 0.5 * first:
                failures.append(f"{name}: the loss went {first} -> {last}, not halved in {STEPS} steps")
            if on_nvme != (rd > 0 and wr > 0):
                failures.append(f"{name}: nvme traffic {rd}/{wr} does not match the placement")
            if d2h <= 0:
                failures.append(f"{name}: no gradients came down")
            if params_off and h2d <= 0:
                failures.append(f"{name}: compute copies live off the device but nothing went up")
    if len(set(digests.values())) > 1:
        failures.append("master weights differ between placements: " + json.dumps(digests, indent=1))
    for f in failures:
        print("FAIL:", f)
    print(f"example placements on the {device} device: {len(CONFIGS)} configs, {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
