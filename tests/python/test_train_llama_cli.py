"""examples/python/train_llama.py refuses bad input as strata-train does: one
line naming the flag or the file, exit 2, before anything is built (numbers
out of range or not in digits, a flag given twice, a bad --config, a missing
swap directory, an output folder it cannot write, --resume with --steps below
the checkpoint's step), and strata's errors print one line (--debug: the
traceback). A resumed run's losses equal an uninterrupted run's."""
import json
import os
import re
import sys

import pytest

from llama_script import DEFAULT_CONFIG, ROOT, corpus, run_script, tiny

TINY = tiny(1)



def run(tmp_path, *args, tiny=True):
    """train_llama.py with `args` (after the tiny model's flags unless tiny is False), in tmp_path."""
    base = [*TINY] if tiny else []
    return run_script([*base, "--corpus", corpus(tmp_path), *args], cwd=tmp_path)


def assert_refused(r, *parts, code=2):
    """Exit `code`, stderr one line holding every part, nothing built, no traceback."""
    assert r.returncode == code, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if not line.startswith("strata [")]  # the library's log
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("train_llama.py: "), r.stderr
    for p in parts:
        assert p in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert "setup:" not in r.stdout, r.stdout  # refused before the model was built


@pytest.mark.parametrize("flag,value,allowed", [
    ("--steps", "-1", "[0, 2147483647]"),
    ("--steps", "99999999999999999999999", "[0, 2147483647]"),
    ("--steps", "1e3", "not a whole number"),
    ("--steps", "3abc", "not a whole number"),
    ("--layers", "0", "[1, 65536]"),
    ("--layers", "-1", "[1, 65536]"),
    ("--seq-len", "0", "[2, 1048576]"),
    ("--save-every", "-1", "[0, 2147483647]"),
    ("--eval-batches", "0", "[1, 65536]"),
    ("--eval-every", "-1", "[0, 2147483647]"),
    ("--sample", "-1", "[0, 65536]"),
    ("--seed", "-1", "[0, 9223372036854775807]"),
    ("--log-every", "0", "[1, 2147483647]"),
])
def test_number_out_of_range_is_refused_when_given(tmp_path, flag, value, allowed):
    r = run(tmp_path, flag, value, tiny=False)
    assert_refused(r, f"argument {flag}: '{value}'", allowed)


@pytest.mark.parametrize("flag,args", [("--steps", ["--steps", "2", "--steps", "3"]),
                                       ("--steps", ["--steps=2", "--steps", "3"]),
                                       ("--resume", ["--resume", "--resume"])])
def test_flag_is_refused_when_given_twice(tmp_path, flag, args):
    r = run(tmp_path, *args, tiny=False)
    assert_refused(r, f"{flag} given twice")


def test_abbreviated_flag_is_refused(tmp_path):
    assert_refused(run(tmp_path, "--step", "2", tiny=False), "unrecognized arguments: --step")


def write_configs(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "truncated.json").write_text('{"train_micro_batch_size_per_gpu": ')
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "deep_object.json").write_text('{"a":' * 100000 + "1" + "}" * 100000)
    (tmp_path / "array.json").write_text("[1, 2]")
    (tmp_path / "binary.json").write_bytes(b"{\xff\xfe}")
    (tmp_path / "unknown.json").write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 9}}')


@pytest.mark.parametrize("name,message", [
    ("missing.json", "no such file"),
    ("folder", "is a directory"),
    ("truncated.json", "invalid JSON"),
    ("deep.json", "not a JSON object"),
    ("deep_object.json", "nested deeper than 64 levels"),
    ("array.json", "not a JSON object"),
    ("binary.json", "not UTF-8"),
    ("unknown.json", "zero_optimization.stage"),
])
def test_config_is_refused_in_one_line_when_bad(tmp_path, name, message):
    write_configs(tmp_path)
    r = run(tmp_path, "--steps", "1", "--config", name)
    assert_refused(r, f"--config {name}: ", message)


def test_config_is_refused_when_unreadable(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    p = tmp_path / "secret.json"
    p.write_text(open(DEFAULT_CONFIG).read())
    p.chmod(0)
    assert_refused(run(tmp_path, "--steps", "1", "--config", "secret.json"), "--config secret.json: cannot read it")


def config_with(tmp_path, name, **strata_keys):
    with open(DEFAULT_CONFIG) as f:
        c = json.load(f)
    c["strata"].update(strata_keys)
    (tmp_path / name).write_text(json.dumps(c))
    return name


def test_default_config_swap_directory_is_created_when_missing(tmp_path):
    assert not (tmp_path / "strata_swap").exists()
    r = run(tmp_path, "--steps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "strata_swap").is_dir()


def test_explicit_config_swap_directory_is_refused_when_missing(tmp_path):
    name = config_with(tmp_path, "missing_swap.json", io={"backend": "auto", "paths": ["./strata_swap", "./gone"]})
    (tmp_path / "strata_swap").mkdir()
    r = run(tmp_path, "--steps", "1", "--config", name)
    assert_refused(r, f"--config {name}: strata.io.paths[1] ./gone does not exist")
    assert not (tmp_path / "gone").exists()


def test_deepspeed_nvme_path_is_named_when_missing(tmp_path):
    with open(os.path.join(ROOT, "examples", "configs", "deepspeed_zero3_nvme.json")) as f:
        c = json.load(f)
    c["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    c["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "ds.json").write_text(json.dumps(c))
    r = run(tmp_path, "--steps", "1", "--config", "ds.json")
    assert_refused(r, f"zero_optimization.offload_optimizer.nvme_path {tmp_path / 'nvme'} does not exist")


@pytest.mark.parametrize("args,message", [
    (["--export", "a_file/out"], "--export a_file/out: cannot create the directory"),
    (["--export", "a_file"], "--export a_file: exists and is not a directory"),
    (["--checkpoint", "a_file/ck", "--save-every", "1"], "--checkpoint a_file/ck: cannot create the directory"),
    (["--checkpoint", "a_file/ck", "--resume"], "--resume: a_file/ck holds no checkpoint"),
])
def test_output_folder_is_refused_before_the_model_is_built(tmp_path, args, message):
    (tmp_path / "strata_swap").mkdir()
    (tmp_path / "a_file").write_text("a regular file")
    assert_refused(run(tmp_path, "--steps", "1", *args), message)


def test_resume_without_latest_takes_the_newest_complete_checkpoint(tmp_path):
    """A save killed before it wrote `latest`: --resume loads the newest complete step-<N> folder, and the
    library's warning names it."""
    (tmp_path / "strata_swap").mkdir()
    ck = tmp_path / "ck"
    r = run(tmp_path, "--steps", "4", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    (ck / "latest").unlink()
    r = run(tmp_path, "--steps", "4", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2", "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from ck at step 4" in r.stdout, r.stdout
    assert "ck/latest is missing" in r.stderr and "loading ck/step-4" in r.stderr, r.stderr


def test_read_only_output_folder_is_refused(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (tmp_path / "strata_swap").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    assert_refused(run(tmp_path, "--steps", "1", "--export", "ro"), "--export ro: cannot write into the directory")


def test_strata_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    (tmp_path / "strata_swap").mkdir()
    name = config_with(tmp_path, "small_budget.json", budgets={"pinned": 4096})
    r = run(tmp_path, "--steps", "1", "--config", name)
    assert r.returncode == 2, r.stdout + r.stderr  # a budget: the input's error
    ours = [line for line in r.stderr.splitlines() if line.startswith("train_llama.py: ")]
    assert len(ours) == 1 and "RESOURCE_EXHAUSTED" in ours[0] and "strata.budgets.pinned" in ours[0], r.stderr
    assert "Traceback" not in r.stderr
    r = run(tmp_path, "--steps", "1", "--config", name, "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ResourceExhausted" in r.stderr, r.stderr


def step_lines(out):
    """{step: (loss, val)} of the --no-progress step lines."""
    return {int(m.group(1)): (m.group(2), m.group(3))
            for m in re.finditer(r"^step +(\d+)  loss (\S+) .* val (\S+)$", out, re.M)}


def snapshot(d):
    files = sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)
    return files, {f: (d / f).read_bytes() for f in files}


def test_resume_is_refused_below_the_checkpoint_step_and_continues_above_it(tmp_path):
    (tmp_path / "strata_swap").mkdir()
    ck = tmp_path / "ck"
    r = run(tmp_path, "--steps", "4", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (ck / "latest").read_text().startswith("step-4 ")
    before, mtime = snapshot(ck), os.stat(ck).st_mtime_ns

    r = run(tmp_path, "--steps", "2", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2", "--resume")
    assert_refused(r, "--steps 2 is below the checkpoint's step 4", "give --steps 4 or more")
    # Refused before anything is written there, not even the writability probe.
    assert snapshot(ck) == before and os.stat(ck).st_mtime_ns == mtime

    # At the checkpoint's step (as strata-train): nothing to train, nothing saved.
    r = run(tmp_path, "--steps", "4", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2", "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from ck at step 4" in r.stdout and not step_lines(r.stdout), r.stdout
    assert snapshot(ck) == before

    resumed = run(tmp_path, "--steps", "6", "--log-every", "1", "--checkpoint", "ck", "--save-every", "2",
                  "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (ck / "latest").read_text().startswith("step-6 ")
    whole = run(tmp_path, "--steps", "6", "--log-every", "1")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    got, want = step_lines(resumed.stdout), step_lines(whole.stdout)
    assert sorted(got) == [5, 6] and len(want) == 6, resumed.stdout + whole.stdout
    assert got == {s: want[s] for s in (5, 6)}, (got, want)


@pytest.mark.parametrize("config,want_optimizer_type,peak_key", [
    ({"train_micro_batch_size_per_gpu": 1}, "AdamW", None),
    ({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "total_num_steps": 10}}},
     "Lion", "warmup_max_lr"),
    ({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}}, "Adam",
     None),
])
def test_lr_sets_the_optimizers_lr_and_the_schedules_peak(config, want_optimizer_type, peak_key):
    import strata.engine
    import train_llama

    before = json.dumps(config)
    resolved = strata.engine.config_resolve(before)
    out = train_llama.with_peak_lr(config, resolved, 3e-5)
    assert json.dumps(config) == before, "the caller's dict was changed"
    again = strata.engine.config_resolve(json.dumps(out))
    assert again["optimizer"]["type"] == want_optimizer_type
    assert again["optimizer"]["params"]["lr"] == 3e-5
    if peak_key:
        assert again["scheduler"]["params"][peak_key] == 3e-5


def test_lora_fine_tunes_a_base_and_exports_the_adapters_and_the_merged_model(tmp_path):
    """--lora over a base exported by an earlier run: the adapters (PEFT's files) and the merged
    model; a plain model given the base and the adapters computes what the merged model does."""
    torch = pytest.importorskip("torch")
    r = run(tmp_path, "--steps", "4", "--export", "base")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(tmp_path, "--init-from", "base", "--lora", "4", "--lora-targets", "q_proj,v_proj,down_proj", "--steps",
            "4", "--lr", "0.01", "--export", "adapter", "--export-merged", "merged")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"lora: rank 4, alpha 8, 3 layers \(q_proj, v_proj, down_proj\)", r.stdout), r.stdout
    assert "exported the adapters to adapter" in r.stdout
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (4, 8.0, ["down_proj", "q_proj", "v_proj"])

    sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
    import data  # noqa: E402
    import llama  # noqa: E402
    from strata.torch import lora, safetensors  # noqa: E402
    cfg_model = llama.config_for("tiny", vocab_size=data.VOCAB_SIZE, max_position_embeddings=2048)
    cfg_model.num_hidden_layers = 1
    with_adapters = llama.LlamaForCausalLM(cfg_model)
    with_adapters.load_state_dict(safetensors.load_dir(str(tmp_path / "base")))
    lora.load_adapter(with_adapters, str(tmp_path / "adapter"))
    assert any(p.abs().sum() > 0 for n, p in with_adapters.named_parameters() if ".lora_B." in n), "adapters trained"
    merged = llama.LlamaForCausalLM(cfg_model)
    merged.load_state_dict(safetensors.load_dir(str(tmp_path / "merged")))
    batch = torch.tensor([data.encode("The quick brown fox")])
    with torch.no_grad():
        torch.testing.assert_close(merged(batch).float(), with_adapters(batch).float(), rtol=2e-2, atol=2e-2)


def test_lora_flags_need_lora(tmp_path):
    assert_refused(run(tmp_path, "--lora-alpha", "8"), "need --lora RANK")
    assert_refused(run(tmp_path, "--lora", "4", "--export-merged", "m"), "--export-merged needs --export")
