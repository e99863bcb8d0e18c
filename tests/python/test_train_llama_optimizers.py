"""examples/python/train_llama.py with each optimizer the engine offers: the
Llama example's own config (llama_default.json: optimizer state on nvme) with
optimizer.type set to Lion or Adagrad (DeepSpeed's keys, each with only the
params it takes), trained for 20 steps on a small corpus: the run ends
cleanly, its step lines report nvme traffic of the optimizer's own size
(Lion and Adagrad keep two fp32 arrays per parameter where AdamW keeps three),
and the training and held-out losses fall. (The update itself is held to
torch's in test_optimizers_oracle.py.)"""
import json
import os
import re

import pytest

from llama_script import ROOT, corpus, run_script, tiny

TINY = tiny(10) + ["--steps", "20"]
OPTIMIZERS = {
    "AdamW": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    "Lion": {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1},
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
}
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def bytes_of(text):
    number, unit = text.split()
    return float(number) * UNITS[unit]


def train(tmp_path, kind):
    with open(os.path.join(ROOT, "examples", "configs", "llama_default.json")) as f:
        config = json.load(f)
    config["optimizer"] = {"type": kind, "params": OPTIMIZERS[kind]}
    run_dir = tmp_path / kind
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(config))
    for path in config["strata"]["io"]["paths"]:  # the config's relative swap paths, inside the run's folder
        (run_dir / path).mkdir(parents=True, exist_ok=True)
    r = run_script([*TINY, "--corpus", corpus(tmp_path), "--config", str(run_dir / "config.json")], cwd=run_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def steady_nvme_read(out):
    """The nvme bytes read on the last step (the optimizer state's whole walk)."""
    reads = re.findall(r"^step +\d+ .* nvme (\d+(?:\.\d+)? (?:B|KiB|MiB|GiB))/", out, re.M)
    assert reads, out
    return bytes_of(reads[-1])


@pytest.mark.parametrize("kind", ["Lion", "Adagrad"])
def test_llama_example_trains_with(tmp_path, kind):
    out = train(tmp_path, kind)
    m = re.search(r"^summary: 20 steps .* loss (\d+\.\d+) -> (\d+\.\d+); held-out loss (\d+\.\d+)", out, re.M)
    assert m, out
    first, last, held_out = (float(g) for g in m.groups())
    assert last < 0.5 * first, out
    vals = [float(v) for v in re.findall(r" val (\d+\.\d+)", out)]
    assert len(vals) >= 2 and vals[-1] < vals[0], out
    # Two fp32 arrays per parameter where AdamW keeps three: the state read
    # from nvme each step is 2/3 of AdamW's (the config keeps it all on nvme).
    adamw = steady_nvme_read(train(tmp_path, "AdamW"))
    assert steady_nvme_read(out) == pytest.approx(adamw * 2 / 3, rel=0.02), out
