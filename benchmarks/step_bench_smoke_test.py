#!/usr/bin/env python3
"""Smoke test of step_bench: two tiny steps per block of two scenarios (one
with clipping, one fp16 on nvme with an overflow), then checks that the JSON
has every field the docs describe. Asserts no timings.

    step_bench_smoke_test.py STEP_BENCH
"""
import json
import os
import subprocess
import sys
import tempfile

SCHEDULE_FIELDS = [
    "schedule", "overlap", "step_s", "bound_s", "ratio_to_bound", "step_s_mean", "bound_s_mean",
    "ratio_to_bound_mean", "bound_tiled_s", "ratio_to_bound_tiled", "busiest", "busiest_s", "second", "second_s",
    "second_to_busiest", "balanced",
    "device_idle", "resources", "bytes", "steps_timed", "skipped_fraction", "clipped_fraction",
    "engine_stage_s", "step_s_all", "bound_s_all", "isolated", "isolated_reps",
]
RESOURCES = ["device_s", "h2d_s", "d2h_s", "disk_s", "cpu_s"]
ISOLATED_FIELDS = ["device_s", "h2d_s", "d2h_s", "disk_s", "disk_read_gbps", "disk_write_gbps", "cpu_s",
                   "grad_pass_s", "adam_s", "crc_s", "cpu_copy_s", "host_h2d_s", "host_d2h_s", "host_kernel_s",
                   "cpu_tiled_s", "copy_s", "adam_params_per_s", "adam_gbps", "host_h2d_gbps", "host_d2h_gbps"]


def check(cond, what):
    if not cond:
        print(f"step_bench_smoke_test: FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    bench = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="step_bench_smoke.") as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [bench, "--small", "--reps", "1", "--steps", "3", "--scenarios", "cpu_clip,nvme_fp16",
               "--dir", tmp, "--json", out]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(proc.stdout)
        check(proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}")
        with open(out) as f:
            doc = json.load(f)
        check(os.listdir(tmp) == ["out.json"], f"swap directories left behind: {os.listdir(tmp)}")
    check(doc.get("device") == "host", f"device {doc.get('device')!r}, expected 'host' (the default)")
    bad = subprocess.run([bench, "--device", "gpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    check(bad.returncode == 2 and "--device is host or cuda" in bad.stdout,
          f"--device gpu: exit {bad.returncode}, {bad.stdout!r}")
    scenarios = {s["scenario"]: s for s in doc["scenarios"]}
    check(set(scenarios) == {"cpu_clip", "nvme_fp16"}, f"scenarios {sorted(scenarios)}")
    for name, sc in scenarios.items():
        for key in ["placement", "precision", "params", "timing_model", "calibration", "schedules", "overlap",
                    "balance_target"]:
            check(key in sc, f"{name}: no '{key}'")
        schedules = {s["schedule"]: s for s in sc["schedules"]}
        # The overlapped schedule is the scenario's own: speculative for the nvme ones.
        overlapped = "speculative" if sc["overlap"] == "speculative" else "overlapped"
        check(sc["overlap"] == ("speculative" if name == "nvme_fp16" else "exact"), f"{name}: overlap {sc['overlap']}")
        check(set(schedules) == {overlapped, "sequential"}, f"{name}: schedules {sorted(schedules)}")
        for sname, s in schedules.items():
            for key in SCHEDULE_FIELDS:
                check(key in s, f"{name}/{sname}: no '{key}'")
            for key in RESOURCES:
                check(key in s["resources"], f"{name}/{sname}: no resources.{key}")
            for key in ISOLATED_FIELDS:
                check(key in s["isolated"], f"{name}/{sname}: no isolated.{key}")
            check(s["steps_timed"] == 3, f"{name}/{sname}: {s['steps_timed']} timed steps, expected 3")
            check(s["step_s"] > 0 and s["bound_s"] > 0, f"{name}/{sname}: step or bound not positive")
            check(s["busiest"] != s["second"], f"{name}/{sname}: busiest == second")
            # The bound's CPU is its work plus the host device's copies and kernels, each measured.
            iso = s["isolated"]
            check(iso["host_h2d_s"] > 0 and iso["host_d2h_s"] > 0 and iso["host_kernel_s"] > 0,
                  f"{name}/{sname}: the host device's copies were not measured")
            parts = iso["grad_pass_s"] + iso["adam_s"] + iso["crc_s"] + iso["cpu_copy_s"]
            check(abs(iso["cpu_s"] - parts) <= 1e-5 * max(1.0, parts), f"{name}/{sname}: cpu_s {iso['cpu_s']} != {parts}")
            check(abs(iso["cpu_copy_s"] - iso["host_h2d_s"] - iso["host_d2h_s"] - iso["host_kernel_s"]) <= 1e-5,
                  f"{name}/{sname}: cpu_copy_s is not its parts")
            check(s["bound_tiled_s"] > 0, f"{name}/{sname}: no bound with the CPU counted as before")
            check("resident" in s["engine_stage_s"], f"{name}/{sname}: no engine_stage_s.resident")
    # The gradient plans are deterministic: clipping fires on timed steps 0 and
    # 2 of 3; the fp16 scenario overflows (and skips) on timed step 2.
    for s in scenarios["cpu_clip"]["schedules"]:
        check(abs(s["clipped_fraction"] - 2 / 3) < 1e-6, f"cpu_clip: clipped_fraction {s['clipped_fraction']}")
    for s in scenarios["nvme_fp16"]["schedules"]:
        check(abs(s["skipped_fraction"] - 1 / 3) < 1e-6, f"nvme_fp16: skipped_fraction {s['skipped_fraction']}")
        check(s["isolated"]["disk_s"] > 0, "nvme_fp16: no isolated disk time")
    print("step_bench_smoke_test: OK")


if __name__ == "__main__":
    main()
