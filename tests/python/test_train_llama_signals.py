"""examples/python/train_llama.py stopped by SIGINT / SIGTERM: exit 130 / 143
after a line naming the step, the engine closed (no swap files left), `latest`
a complete checkpoint that --resume continues from; a second signal ends the
process at once. And --resume / --save-every without --checkpoint are errors."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from llama_script import DEFAULT_CONFIG, SCRIPT, corpus, run_script, tiny

TINY = tiny(1)


def script_args(tmp_path, *extra):
    (tmp_path / "strata_swap").mkdir(exist_ok=True)  # the default config's swap directory
    return [*TINY, "--corpus", corpus(tmp_path), *extra]


def command(tmp_path, *extra):
    """A process of its own, for the tests that signal it."""
    return [sys.executable, SCRIPT, *script_args(tmp_path, *extra)]


def swap_files(tmp_path):
    d = tmp_path / "strata_swap"
    return [f for f in os.listdir(d) if not f.endswith("lock")] if d.is_dir() else []


def start_and_wait(tmp_path, steps_seen, *extra):
    proc = subprocess.Popen(command(tmp_path, "--steps", "100000", *extra), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head, seen = "", 0
    while seen < steps_seen:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            pytest.fail("train_llama.py ended before its first steps: " + head + proc.stderr.read())
        head += line
        if line.startswith("step "):
            seen += 1
    return proc, head


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly_and_resumes(tmp_path, sig):
    ck = str(tmp_path / "ck")
    proc, head = start_and_wait(tmp_path, 2, "--checkpoint", ck, "--save-every", "1")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    out = head + out
    assert proc.returncode == 128 + sig, out + err
    m = re.search(r"interrupted by (SIG\w+) at step (\d+)", out)
    assert m and m.group(1) == signal.Signals(sig).name, out + err
    assert "summary" not in out and "Traceback" not in err
    # Where the steps run spent their time, said before the stop (a run cut at a limit still says it).
    assert re.search(r"^time per step: forward\+backward [0-9.]+ s, step\(\) [0-9.]+ s; of them fetch", out,
                     re.M), out
    assert out.index("time per step:") < out.index("interrupted by")
    assert swap_files(tmp_path) == []
    latest = open(os.path.join(ck, "latest")).read().split()[0]  # "step-<N> <crc64>"
    assert os.path.isfile(os.path.join(ck, latest, "manifest.json"))
    step = int(latest.split("-")[1])
    assert step <= int(m.group(2))
    r = run_script(script_args(tmp_path, "--steps", str(step + 1), "--checkpoint", ck, "--resume"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from {ck} at step {step}" in r.stdout
    assert "summary: 1 steps" in r.stdout


def test_second_signal_ends_the_process_at_once(tmp_path):
    proc, _ = start_and_wait(tmp_path, 1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    # The first signal restored the default action: the second one kills the
    # process (or, when the first stop was already done, it exited 130).
    assert proc.returncode in (-signal.SIGINT, 130), out + err
    assert "Traceback" not in err


def wait_for_line(stream, pred, timeout):
    """The first line of `stream` for which pred holds (read on a thread, so
    that the wait ends after `timeout` seconds whatever the child does), or
    None at the end of the stream or the timeout."""
    found = queue.Queue()

    def read():
        for line in stream:
            if pred(line):
                found.put(line)
                return
        found.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=timeout)
    except queue.Empty:
        return None


def test_second_signal_during_a_save_ends_the_process_at_once(tmp_path):
    """A save is one long call into the library, inside which Python runs no
    signal handler; the script runs it on a worker thread, so the first signal
    is handled during the save (which goes on) and the second ends the process
    at once. The save is made slow on purpose: every state on the host device,
    whose device-to-host copies run at 0.5 MB/s (step 1's save takes about 10 s,
    the signals come within a second of its start)."""
    cfg = json.load(open(DEFAULT_CONFIG))
    cfg["zero_optimization"] = {"stage": 3}
    cfg["strata"]["host_device"] = {"d2h_gbps": 0.0005}
    (tmp_path / "slow.json").write_text(json.dumps(cfg))
    ck = tmp_path / "ck"
    proc = subprocess.Popen(command(tmp_path, "--config", str(tmp_path / "slow.json"), "--steps", "100000",
                                    "--checkpoint", str(ck), "--save-every", "1"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = wait_for_line(proc.stdout, lambda s: s.startswith("step "), 240)
        assert line, "train_llama.py did not print its first step"
        saving = ck / ".step-1.tmp"  # step 1's save, after its line
        deadline = time.monotonic() + 60
        while not saving.is_dir() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert saving.is_dir(), "step 1's save did not start"
        proc.send_signal(signal.SIGTERM)
        ack = wait_for_line(proc.stderr, lambda s: "stopping after the step in flight" in s, 30)
        assert ack, "the first signal was not acknowledged"
        assert saving.is_dir(), "the first signal was handled during the save"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert not (ck / "latest").exists()


@pytest.mark.parametrize("flags", [["--resume"], ["--save-every", "5"]])
def test_resume_or_save_every_without_checkpoint_is_an_error(tmp_path, flags):
    r = run_script(script_args(tmp_path, *flags), cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    assert "need --checkpoint" in r.stderr
