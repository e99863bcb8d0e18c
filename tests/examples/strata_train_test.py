#!/usr/bin/python3
"""strata-train's command line and its stops: strict flags (every bad number,
unknown flag and bad combination exits 2 naming the flag; --help exits 0), the
output folders checked before training, the default config found from any
directory, and SIGINT / SIGTERM (exit 130 / 143, swap files removed, `latest`
a complete checkpoint that resumes; a second signal exits at once).
Usage: strata_train_test.py STRATA_TRAIN SOURCE_ROOT"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

EXE, ROOT = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
CONFIG = os.path.join(ROOT, "examples/configs/strata_default.json")
SMALL = ["--width", "64", "--depth", "2", "--batch", "16"]


def train(*args, cwd=None, timeout=300):
    if cwd is not None:
        os.makedirs(os.path.join(cwd, "strata_swap"), exist_ok=True)
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def swap_files(tmp):
    d = os.path.join(tmp, "strata_swap")
    return [f for f in os.listdir(d) if not f.endswith("lock")] if os.path.isdir(d) else []


class Flags(unittest.TestCase):
    def assert_bad(self, args, *needles):
        r = train("--config", CONFIG, *args, timeout=60)
        self.assertEqual(r.returncode, 2, f"{args}: {r.stdout}{r.stderr}")
        self.assertNotIn("summary", r.stdout, args)  # nothing trained
        for n in needles:
            self.assertIn(n, r.stderr, args)

    def test_bad_numbers_name_the_flag(self):
        for bad in ["1e3", "3abc", "4294967298", "99999999999999999999", "-1", "0x10", "", "2.5"]:
            self.assert_bad(["--steps", bad], "--steps")
        for flag in ["--width", "--depth", "--batch", "--save-every"]:
            self.assert_bad([flag, "0", "--checkpoint", "ck"], flag)
        self.assert_bad(["--steps", "1e3"], "not a whole number")
        self.assert_bad(["--steps", "4294967298"], "out of range")

    def test_unknown_flags_and_combinations(self):
        self.assert_bad(["--colour", "red"], "--colour")
        self.assert_bad(["--steps"], "--steps")
        self.assert_bad(["--steps", "2", "--steps", "3"], "--steps")
        self.assert_bad(["--resume"], "--resume requires --checkpoint")
        self.assert_bad(["--save-every", "5"], "--save-every requires --checkpoint")
        self.assert_bad(["--model-device", "gpu"], "--model-device")
        self.assert_bad(["stray"], "stray")

    def test_help_exits_0(self):
        for h in ("--help", "-h"):
            r = train(h, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("--steps", r.stdout)
            self.assertIn("--checkpoint", r.stdout)

    def test_config_directory_or_missing_file_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            r = train("--config", tmp, timeout=60)
            self.assertEqual(r.returncode, 2)
            self.assertIn(f"--config {tmp}: is a directory", r.stderr)
            self.assertNotIn("invalid JSON", r.stderr)
            r = train("--config", os.path.join(tmp, "none.json"), timeout=60)
            self.assertEqual(r.returncode, 2)
            self.assertIn("none.json: no such file", r.stderr)


class Outputs(unittest.TestCase):
    def test_output_under_a_regular_file_fails_before_training(self):
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "plain")
            open(plain, "w").close()
            for flags in (["--export", plain + "/x"], ["--checkpoint", plain + "/ck", "--save-every", "1"],
                          ["--export", plain]):
                r = train("--config", CONFIG, *SMALL, "--steps", "3", *flags, cwd=tmp)
                self.assertEqual(r.returncode, 2, f"{flags}: {r.stdout}{r.stderr}")
                self.assertIn(flags[0] + " " + flags[1], r.stderr)
                self.assertNotIn("summary", r.stdout)

    @unittest.skipIf(os.geteuid() == 0, "root writes into a read-only directory (the regular-file case covers root)")
    def test_read_only_export_fails_before_training(self):
        with tempfile.TemporaryDirectory() as tmp:
            ro = os.path.join(tmp, "ro")
            os.mkdir(ro, 0o555)
            r = train("--config", CONFIG, *SMALL, "--steps", "3", "--export", ro + "/out", cwd=tmp)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn("--export " + ro + "/out", r.stderr)
            self.assertNotIn("summary", r.stdout)

    def test_missing_output_folders_are_created(self):
        with tempfile.TemporaryDirectory() as tmp:
            out, ck = os.path.join(tmp, "a/b/out"), os.path.join(tmp, "c/ck")
            r = train("--config", CONFIG, *SMALL, "--steps", "2", "--quiet", "--export", out, "--checkpoint", ck,
                      "--save-every", "2", cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(os.path.isfile(os.path.join(out, "model.safetensors")))
            self.assertTrue(os.path.isfile(os.path.join(ck, "latest")))

    def test_dump_masters_into_a_missing_folder_fails_before_training(self):
        with tempfile.TemporaryDirectory() as tmp:
            r = train("--config", CONFIG, *SMALL, "--steps", "2", "--dump-masters", tmp + "/miss/x/y.dump", cwd=tmp)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn(f"--dump-masters {tmp}/miss/x/y.dump: its folder {tmp}/miss/x does not exist", r.stderr)
            self.assertNotIn("summary", r.stdout)
            r = train("--config", CONFIG, *SMALL, "--steps", "2", "--dump-masters", tmp, cwd=tmp)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn(f"--dump-masters {tmp}: is a directory", r.stderr)

    def test_too_little_space_says_the_numbers(self):
        # 2^47 parameters: no disk here holds their export (the model is only described, never allocated).
        with tempfile.TemporaryDirectory() as tmp:
            r = train("--config", CONFIG, "--width", "65536", "--depth", "4096", "--export", tmp + "/out",
                      cwd=tmp, timeout=120)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertRegex(r.stderr, r"--export .*/out: .* free \(\d+ bytes\), but the export of \d+ parameters "
                                       r".* needs .* \(\d+ bytes\)")

    def test_resume_below_the_checkpoint_step_is_an_error(self):
        with tempfile.TemporaryDirectory() as tmp:
            ck = os.path.join(tmp, "ck")
            r = train("--config", CONFIG, *SMALL, "--steps", "4", "--quiet", "--checkpoint", ck, "--save-every", "4",
                      cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            r = train("--config", CONFIG, *SMALL, "--steps", "3", "--checkpoint", ck, "--resume", cwd=tmp)
            self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
            self.assertIn("--steps 3 is below the checkpoint's step 4", r.stderr)
            self.assertNotIn("summary", r.stdout)
            r = train("--config", CONFIG, *SMALL, "--steps", "5", "--quiet", "--checkpoint", ck, "--resume", cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("summary: 1 steps", r.stdout)


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size_of(text):
    """A size as strata-train prints it ("3.1 MiB") and half its last digit: (bytes, rounding)."""
    number, unit = text.split()
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * UNITS[unit], 0.5 * 10 ** -decimals * UNITS[unit]


class SwapWear(unittest.TestCase):
    """The summary's SSD wear figures: bytes written to each swap path, in all
    and per step, checked against the step lines' nvme writes."""

    def test_summary_shows_swap_writes_per_path(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(ROOT, "examples/configs/placement_nvme_all.json")) as f:
                config = json.load(f)
            paths = [os.path.join(tmp, "nvme0"), os.path.join(tmp, "nvme1")]
            for p in paths:
                os.makedirs(p)
            config["strata"]["io"]["paths"] = paths
            config["strata"]["io"]["stripe_bytes"] = 65536  # the blocks are striped over both
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f)
            steps = 4
            r = train("--config", os.path.join(tmp, "config.json"), *SMALL, "--steps", str(steps), cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            size = r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB))"
            step_writes = [size_of(m.group(1)) for m in
                           re.finditer(r"^\s+\d+\s+\S+\s+\S+\s+\S+ \S+\s+\S+ \S+\s+\S+ \S+\s+" + size,
                                       r.stdout, re.M)]
            self.assertEqual(len(step_writes), steps, r.stdout)
            m = re.search(r"swap \(SSD wear\): wrote " + size + r" to 2 path\(s\) since the engine was created, "
                          + size + r" per step on average; read " + size, r.stdout)
            self.assertIsNotNone(m, r.stdout)
            (total, total_err), (per_step, per_step_err) = size_of(m.group(1)), size_of(m.group(2))
            # The average is the step lines' writes over the steps (each figure rounded to its last digit).
            self.assertAlmostEqual(per_step, sum(w for w, _ in step_writes) / steps,
                                   delta=per_step_err + sum(e for _, e in step_writes) / steps)
            # In all: every step's writes and the swap files' first contents at finalize.
            self.assertGreater(total, sum(w for w, _ in step_writes))
            per_path = []
            for p in paths:
                m = re.search(re.escape(p) + r": wrote " + size + ", " + size + " per step; read " + size, r.stdout)
                self.assertIsNotNone(m, p + "\n" + r.stdout)
                per_path.append((size_of(m.group(1)), size_of(m.group(2))))
            self.assertAlmostEqual(sum(t for (t, _), _ in per_path), total,
                                   delta=total_err + sum(e for (_, e), _ in per_path))
            self.assertAlmostEqual(sum(s for _, (s, _) in per_path), per_step,
                                   delta=per_step_err + sum(e for _, (_, e) in per_path))
            for _, (s, _) in per_path:  # striped: both drives take a share
                self.assertGreater(s, 0.25 * per_step)

    def test_summary_says_when_nothing_is_on_nvme(self):
        with tempfile.TemporaryDirectory() as tmp:
            r = train("--config", os.path.join(ROOT, "examples/configs/placement_cpu_all.json"), *SMALL,
                      "--steps", "1", "--quiet", cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("swap (SSD wear): nothing lives on nvme, no swap writes", r.stdout)
            # Where the CPU optimizer's threads ran (strata.cpu_adam.bind, "auto" by default).
            self.assertRegex(r.stdout, r"(?m)^ +cpu_adam: \d+ threads?( pinned one per physical core of NUMA node \d+"
                                       r"|, not pinned \()")


class DefaultConfig(unittest.TestCase):
    def test_found_from_another_directory(self):
        with tempfile.TemporaryDirectory() as tmp:
            # Not made by train(): with the default config strata-train makes ./strata_swap itself.
            r = subprocess.run([EXE, *SMALL, "--steps", "1", "--quiet"], capture_output=True, text=True,
                               timeout=300, cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            m = re.search(r"strata-train: config (\S+)", r.stdout)
            self.assertIsNotNone(m, r.stdout)
            self.assertTrue(os.path.samefile(m.group(1), CONFIG))
            self.assertIn("summary: 1 steps", r.stdout)


class Signals(unittest.TestCase):
    def start(self, tmp, *extra):
        os.makedirs(os.path.join(tmp, "strata_swap"), exist_ok=True)
        return subprocess.Popen([EXE, "--config", CONFIG, *SMALL, "--steps", "100000", *extra], cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for_steps(self, proc, n=1):
        """Reads stdout until n step lines came; returns what was read."""
        seen, text = 0, ""
        deadline = time.monotonic() + 120
        while seen < n and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            text += line
            if re.match(r"\s+\d+\s+\d", line):
                seen += 1
        self.assertEqual(seen, n, text)
        return text

    def stop(self, sig, checkpoint):
        with tempfile.TemporaryDirectory() as tmp:
            ck = os.path.join(tmp, "ck")
            extra = ["--checkpoint", ck, "--save-every", "1"] if checkpoint else []
            proc = self.start(tmp, *extra)
            head = self.wait_for_steps(proc, 2)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=120)
            out = head + out
            self.assertEqual(proc.returncode, 128 + sig, out + err)
            m = re.search(r"interrupted by (SIG\w+) at step (\d+)", out)
            self.assertIsNotNone(m, out + err)
            self.assertEqual(m.group(1), signal.Signals(sig).name)
            self.assertIn(f"{signal.Signals(sig).name}: stopping after the step in flight", err)
            self.assertNotIn("exported", out)
            self.assertEqual(swap_files(tmp), [], "swap files left behind")
            if not checkpoint:
                return
            with open(os.path.join(ck, "latest")) as f:
                latest = f.read().split()[0]  # "step-<N> <crc64>"
            self.assertTrue(os.path.isfile(os.path.join(ck, latest, "manifest.json")), latest)
            step = int(latest.split("-")[1])
            self.assertLessEqual(step, int(m.group(2)))
            r = train("--config", CONFIG, *SMALL, "--steps", str(step + 1), "--quiet", "--checkpoint", ck,
                      "--resume", cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn(f"at step {step}", r.stdout)
            self.assertIn("summary: 1 steps", r.stdout)

    def test_sigint_stops_cleanly_with_130(self):
        self.stop(signal.SIGINT, checkpoint=True)

    def test_sigterm_stops_cleanly_with_143(self):
        self.stop(signal.SIGTERM, checkpoint=True)

    def test_sigint_without_checkpoint(self):
        self.stop(signal.SIGINT, checkpoint=False)

    def test_second_signal_exits_at_once(self):
        with tempfile.TemporaryDirectory() as tmp:
            # The default model with 1024 samples per micro-batch: a step takes a second or more
            # here. The first signal comes a third into the second step (timed by the first), the
            # second as soon as the first has been taken, while that step is still running.
            os.makedirs(os.path.join(tmp, "strata_swap"), exist_ok=True)
            proc = subprocess.Popen([EXE, "--config", CONFIG, "--batch", "1024", "--steps", "100000"], cwd=tmp,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            first = self.wait_for_steps(proc, 1).splitlines()[-1].split()
            samples_per_s = float(first[2])
            time.sleep(1024 / samples_per_s / 3)
            proc.send_signal(signal.SIGINT)
            err = ""
            while "stopping after the step in flight" not in err:
                line = proc.stderr.readline()
                self.assertTrue(line, err)
                err += line
            proc.send_signal(signal.SIGTERM)  # the second: _exit(128 + SIGTERM) in the handler
            out, rest = proc.communicate(timeout=120)
            err += rest
            self.assertEqual(proc.returncode, 128 + signal.SIGTERM, out + err)
            self.assertIn("second signal", err)
            self.assertNotIn("interrupted by", out)
            # The next run in that directory reclaims what was left.
            r = train("--config", CONFIG, *SMALL, "--steps", "1", "--quiet", cwd=tmp)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertEqual(swap_files(tmp), [])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
