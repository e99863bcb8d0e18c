#!/usr/bin/python3
"""The strata command end to end: exit codes, the 40B answer, and errors that
name what was wrong. Usage: cli_test.py STRATA_EXE SOURCE_ROOT"""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

EXE, ROOT = sys.argv[1], sys.argv[2]
NVME = f"{ROOT}/examples/configs/deepspeed_zero3_nvme.json"
BIG = ["--params", "40e9", "--layers", "48", "--gpu-memory", "80GiB", "--ram", "128GiB", "--disk", "2TB"]


def strata(*args):
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=60)


class Cli(unittest.TestCase):
    def test_plan_40b_fits_on_nvme(self):
        r = strata("plan", "--config", NVME, *BIG)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("params nvme, optimizer nvme (cpu fraction 0): FITS", r.stdout)

    def test_plan_json_is_parseable_and_says_why_cpu_does_not_fit(self):
        r = strata("plan", "--config", NVME, *BIG, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        plan = json.loads(r.stdout)
        text = json.dumps(plan)
        self.assertIn("fits", text)
        self.assertIn("CPU RAM needs", text)

    def test_placement_that_does_not_fit_exits_1(self):
        cpu = f"{ROOT}/examples/configs/deepspeed_zero_offload_cpu.json"
        r = strata("plan", "--config", cpu, *BIG)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("recommended", r.stdout)

    def test_bad_flag_exits_2_naming_it(self):
        r = strata("plan", "--config", NVME, *BIG, "--colour", "red")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--colour", r.stderr)

    def test_bad_size_names_the_flag(self):
        r = strata("plan", "--config", NVME, "--params", "40e9", "--layers", "48", "--gpu-memory", "lots")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--gpu-memory", r.stderr)

    def test_missing_config_file_is_named(self):
        r = strata("plan", "--config", "/nonexistent/ds.json", *BIG)
        self.assertEqual(r.returncode, 2)
        self.assertIn("/nonexistent/ds.json", r.stderr)

    def test_no_gpu_and_no_override_says_what_to_set(self):
        r = strata("plan", "--config", NVME, "--params", "1e9", "--layers", "8")
        if r.returncode == 0:
            self.skipTest("a GPU is visible here")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--gpu-memory", r.stderr)

    def test_main_job_default_plan_fits(self):
        # scripts/run.sh's main job: the embedded default must fit its own budgets.
        r = strata("plan", "--config", f"{ROOT}/examples/configs/strata_default.json",
                   "--layers", "24", "--hidden", "2048", "--vocab", "50304", "--seq", "2048")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("FITS", r.stdout)

    def test_version_and_help(self):
        self.assertEqual(strata("version").returncode, 0)
        r = strata("help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("plan", r.stdout)
        self.assertIn("config", r.stdout)
        self.assertEqual(strata("frobnicate").returncode, 2)
        for cmd in (["--help"], ["plan", "--help"], ["config", "--help"]):
            r = strata(*cmd)
            self.assertEqual(r.returncode, 0, cmd)
            self.assertIn("usage", r.stdout.lower(), cmd)
        r = strata("version", "--colour")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--colour", r.stderr)

    def test_plan_flag_given_twice_or_without_value_is_named(self):
        r = strata("plan", "--config", NVME, *BIG, "--layers", "12")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--layers is given twice", r.stderr)
        r = strata("plan", "--config", NVME, *BIG, "--seq")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--seq", r.stderr)

    # strata plan --drive-*: the SSD wear estimate, its arithmetic redone here
    # from the plan's own bytes written per step.
    def plan_json(self, *args):
        r = strata("plan", *args, "--json")
        self.assertIn(r.returncode, (0, 1), r.stderr)  # (1: the configured placement does not fit)
        return json.loads(r.stdout)

    def check_wear(self, wear, placement_plan, rated, step_seconds):
        """A PlacementWear against the plan's bytes per step for that placement."""
        written = placement_plan["bytes_per_step"]["disk_write_bytes"]
        self.assertEqual(wear["write_bytes_per_step"], written)
        paths = [p for d in wear["drives"] for p in d["paths"]]
        self.assertGreater(len(paths), 0)
        steps = []
        for d in wear["drives"]:
            # the swap store stripes evenly: each path takes 1/N of the writes (the remainder to the first ones)
            share = sum(written // len(paths) + (1 if paths.index(p) < written % len(paths) else 0)
                        for p in d["paths"])
            self.assertEqual(d["write_bytes_per_step"], share)
            self.assertEqual(d["steps"], math.floor(rated / share))
            steps.append(d["steps"])
            if step_seconds is None:
                self.assertIsNone(d["days"])
            else:
                self.assertAlmostEqual(d["days"], d["steps"] * step_seconds / 86400, places=6)
        self.assertEqual(wear["steps"], min(steps))

    def test_plan_drive_tbw_counts_steps_and_days_from_the_plans_writes(self):
        plan = self.plan_json("--config", NVME, *BIG, "--drive-tbw", "600", "--step-seconds", "90")
        wear = plan["wear"]
        self.assertEqual(wear["rated_bytes_per_drive"], 600e12)
        self.assertEqual(wear["step_seconds"], 90)
        self.check_wear(wear["configured"], plan["configured"], 600e12, 90)
        self.assertEqual([d["paths"] for d in wear["configured"]["drives"]], [["/local_nvme"]])
        # Every placement listed writes less, fitting ones first; the raised cpu fraction is the
        # recommended placement, whose bytes the search computed on its own.
        alternatives = wear["alternatives"]
        self.assertGreater(len(alternatives), 0)
        configured_writes = wear["configured"]["write_bytes_per_step"]
        for a in alternatives:
            self.assertLess(a["write_bytes_per_step"], configured_writes)
            self.assertTrue(a["changes"])
            self.assertEqual(a["fits"], not a["reasons"])
        fits = [a["fits"] for a in alternatives]
        self.assertEqual(fits, sorted(fits, reverse=True))
        best = alternatives[0]
        self.assertTrue(best["fits"])
        self.assertEqual(best["optimizer_cpu_fraction"], plan["recommended"]["optimizer_cpu_fraction"])
        self.check_wear(best, plan["recommended"], 600e12, 90)
        # The table says the same.
        r = strata("plan", "--config", NVME, *BIG, "--drive-tbw", "600", "--step-seconds", "90")
        self.assertEqual(r.returncode, 0, r.stderr)
        days = wear["configured"]["days"]
        self.assertIn(f"the drives last {wear['configured']['steps']:,} steps, {days:.2f} days at 90 s per step",
                      r.stdout)
        self.assertIn("writes least while fitting: strata.optimizer_cpu_fraction = "
                      f"{best['optimizer_cpu_fraction']:g}", r.stdout)
        # Without a rating there is no wear section.
        self.assertIsNone(self.plan_json("--config", NVME, *BIG)["wear"])

    def test_plan_drive_dwpd_rates_over_the_warranty(self):
        plan = self.plan_json("--config", NVME, *BIG, "--drive-dwpd", "0.3", "--drive-capacity", "3.84TB",
                              "--warranty-years", "3")
        rated = 0.3 * 3.84e12 * 365 * 3
        self.assertAlmostEqual(plan["wear"]["rated_bytes_per_drive"], rated, delta=1e-9 * rated)
        self.check_wear(plan["wear"]["configured"], plan["configured"], rated, None)
        plan = self.plan_json("--config", NVME, *BIG, "--drive-dwpd", "1", "--drive-capacity", "3.84TB")
        self.assertAlmostEqual(plan["wear"]["rated_bytes_per_drive"], 3.84e12 * 365 * 5, delta=1)  # 5 years

    def test_plan_wear_splits_the_writes_over_the_swap_paths(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(NVME) as f:
                config = json.load(f)
            paths = [os.path.join(tmp, "nvme0"), os.path.join(tmp, "nvme1")]
            config.setdefault("strata", {})["io"] = {"paths": paths}
            path = os.path.join(tmp, "c.json")
            with open(path, "w") as f:
                json.dump(config, f)
            # Given --disk, the paths are not probed: each is a drive of its own.
            plan = self.plan_json("--config", path, *BIG, "--drive-tbw", "600")
            drives = plan["wear"]["configured"]["drives"]
            self.assertEqual([d["paths"] for d in drives], [[p] for p in paths])
            self.check_wear(plan["wear"]["configured"], plan["configured"], 600e12, None)
            # Probed: both lie on one file system, one drive takes all the writes.
            small = ["--params", "1e9", "--layers", "8", "--gpu-memory", "80GiB", "--ram", "128GiB"]
            plan = self.plan_json("--config", path, *small, "--drive-tbw", "600")
            drives = plan["wear"]["configured"]["drives"]
            self.assertEqual([d["paths"] for d in drives], [paths])
            self.check_wear(plan["wear"]["configured"], plan["configured"], 600e12, None)

    def test_plan_drive_flag_errors_name_the_flag(self):
        cases = [
            (["--drive-tbw", "-600"], "--drive-tbw: must be positive"),
            (["--drive-tbw", "0"], "--drive-tbw: must be positive"),
            (["--drive-tbw", "lots"], "--drive-tbw: cannot parse 'lots'"),
            (["--drive-tbw", "inf"], "--drive-tbw: cannot parse 'inf'"),
            (["--drive-dwpd", "-1", "--drive-capacity", "4TB"], "--drive-dwpd: must be positive"),
            (["--drive-dwpd", "one", "--drive-capacity", "4TB"], "--drive-dwpd: cannot parse 'one'"),
            (["--drive-dwpd", "1", "--drive-capacity", "0"], "--drive-capacity: must be positive"),
            (["--drive-dwpd", "1", "--drive-capacity", "4TB", "--warranty-years", "0"],
             "--warranty-years: must be positive"),
            (["--drive-tbw", "600", "--drive-dwpd", "1", "--drive-capacity", "4TB"], "give one"),
            (["--drive-dwpd", "1"], "--drive-capacity"),
            (["--drive-capacity", "4TB"], "--drive-capacity needs --drive-dwpd"),
            (["--drive-tbw", "600", "--warranty-years", "3"], "--warranty-years goes with --drive-dwpd"),
            (["--step-seconds", "30"], "--step-seconds sets the SSD wear estimate's days"),
            (["--drive-tbw", "600", "--step-seconds", "-3"], "--step-seconds: must be positive"),
            (["--drive-tbw", "600", "--step-seconds", "fast"], "--step-seconds: cannot parse 'fast'"),
        ]
        for extra, needle in cases:
            r = strata("plan", "--config", NVME, *BIG, *extra)
            self.assertEqual(r.returncode, 2, extra)
            self.assertIn(needle, r.stderr, extra)
            self.assertEqual(r.stdout, "", extra)

    # strata config FILE: the resolved configuration and its warnings.
    def test_config_prints_every_key_resolved(self):
        r = strata("config", f"{ROOT}/examples/configs/strata_default.json")
        self.assertEqual(r.returncode, 0, r.stderr)
        cfg = json.loads(r.stdout)
        # Defaults the file does not set are filled in.
        self.assertIn("keep_files", cfg["strata"]["io"])
        self.assertIn("train_batch_size", cfg)
        self.assertEqual(cfg["optimizer"]["params"]["lr"], 0.001)
        self.assertIn("0 warning(s)", r.stderr)

    def test_config_prints_warnings(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.json")
            with open(path, "w") as f:
                f.write('{"train_micro_batch_size_per_gpu": 2, "colour": "red"}')
            r = strata("config", path)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(json.loads(r.stdout)["train_micro_batch_size_per_gpu"], 2)
            self.assertIn("warning: colour", r.stderr)
            r = strata("config", path, "--strict")
            self.assertEqual(r.returncode, 1)
            self.assertIn("colour", r.stderr)

    def test_config_errors_name_the_key_or_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.json")
            with open(path, "w") as f:
                f.write('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}}')
            r = strata("config", path)
            self.assertEqual(r.returncode, 1)
            self.assertEqual(r.stdout, "")
            self.assertIn("zero_optimization.offload_optimizer.device", r.stderr)
            r = strata("config", tmp)  # a directory
            self.assertEqual(r.returncode, 1)
            self.assertIn(tmp, r.stderr)
            self.assertNotIn("invalid JSON", r.stderr)
        r = strata("config", "/nonexistent/ds.json")
        self.assertEqual(r.returncode, 1)
        self.assertIn("/nonexistent/ds.json", r.stderr)
        r = strata("config")
        self.assertEqual(r.returncode, 2)
        self.assertIn("FILE", r.stderr)

    def test_inspect_names_what_is_wrong(self):
        r = strata("inspect", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--verify", r.stdout)
        with tempfile.TemporaryDirectory() as tmp:
            r = strata("inspect", tmp)  # no checkpoint there
            self.assertEqual(r.returncode, 2)
            self.assertIn(tmp, r.stderr)
            step = os.path.join(tmp, "step-3")
            os.mkdir(step)
            with open(os.path.join(step, "manifest.json"), "w") as f:
                f.write('{"format": "strata-checkpoint", "version": 2, "step": 3}')  # no checksum of its own
            r = strata("inspect", step)
            self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
            self.assertIn("manifest.json", r.stderr)
        r = strata("inspect")
        self.assertEqual(r.returncode, 2)
        self.assertIn("CKPT", r.stderr)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
