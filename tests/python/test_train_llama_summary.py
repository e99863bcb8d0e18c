"""examples/python/train_llama.py's summary: the SSD wear figures (bytes
written to each swap path since the engine was created, and per step), checked
against the step lines' nvme writes, on a config with two swap paths; and the
line saying where the CPU optimizer's threads ran."""
import json
import os
import re

import pytest

from llama_script import ROOT, corpus, run_script, tiny

TINY = tiny(1)
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
SIZE = r"(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))"


def size_of(text):
    """A size as train_llama.py prints it ("3.1 MiB") and half its last digit: (bytes, rounding)."""
    number, unit = text.split()
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number) * UNITS[unit], 0.5 * 10 ** -decimals * UNITS[unit]


def run(tmp_path, paths, steps):
    with open(os.path.join(ROOT, "examples", "configs", "llama_default.json")) as f:
        config = json.load(f)
    config["strata"]["io"]["paths"] = paths
    config["strata"]["io"]["stripe_bytes"] = 65536  # the optimizer state's blocks are striped over both
    (tmp_path / "config.json").write_text(json.dumps(config))
    return run_script([*TINY, "--corpus", corpus(tmp_path), "--steps", str(steps), "--config",
                       str(tmp_path / "config.json")], cwd=tmp_path)


def test_summary_shows_swap_writes_per_path(tmp_path):
    paths = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    for p in paths:
        os.mkdir(p)
    steps = 3
    r = run(tmp_path, paths, steps)
    assert r.returncode == 0, r.stdout + r.stderr
    step_writes = [size_of(m.group(2)) for m in re.finditer(r"^step +\d+ .* nvme " + SIZE + "/" + SIZE, r.stdout,
                                                            re.M)]
    assert len(step_writes) == steps, r.stdout
    m = re.search(r"^swap \(SSD wear\): wrote " + SIZE + r" to 2 path\(s\) since the engine was created, " + SIZE
                  + r" per step on average; read " + SIZE, r.stdout, re.M)
    assert m, r.stdout
    (total, total_err), (per_step, per_step_err) = size_of(m.group(1)), size_of(m.group(2))
    mean = sum(w for w, _ in step_writes) / steps
    assert abs(per_step - mean) <= per_step_err + sum(e for _, e in step_writes) / steps, r.stdout
    assert total > sum(w for w, _ in step_writes)  # plus the swap files' first contents at finalize
    per_path = []
    for p in paths:
        m = re.search("^  " + re.escape(p) + ": wrote " + SIZE + ", " + SIZE + " per step; read " + SIZE, r.stdout,
                      re.M)
        assert m, p + "\n" + r.stdout
        per_path.append((size_of(m.group(1)), size_of(m.group(2))))
    assert abs(sum(t for (t, _), _ in per_path) - total) <= total_err + sum(e for (_, e), _ in per_path)
    assert abs(sum(s for _, (s, _) in per_path) - per_step) <= per_step_err + sum(e for _, (_, e) in per_path)
    assert all(s > 0.25 * per_step for _, (s, _) in per_path), r.stdout  # striped: both drives take a share
    # Where the CPU optimizer's threads ran (strata.cpu_adam.bind, "auto" in the config).
    assert re.search(r"^cpu_adam: \d+ threads?( pinned one per physical core of NUMA node \d+|, not pinned \()",
                     r.stdout, re.M), r.stdout


def test_build_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the flag is valid where torch sees a GPU")
    proc = run_script([*TINY, "--build-device", "cuda"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--build-device cuda: torch sees no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr

