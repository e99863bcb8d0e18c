#!/usr/bin/python3
"""The strata command end to end: exit codes, the 40B answer, and errors that
name what was wrong. Usage: cli_test.py STRATA_EXE SOURCE_ROOT"""
import json
import subprocess
import sys
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
        self.assertEqual(strata("frobnicate").returncode, 2)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
