#!/usr/bin/python3
"""The strata command end to end: exit codes, the 40B answer, and errors that
name what was wrong. Usage: cli_test.py STRATA_EXE SOURCE_ROOT"""
import json
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
