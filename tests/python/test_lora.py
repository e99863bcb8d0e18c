"""LoRA (strata.torch.lora) through strata: the adapters train as torch's
AdamW trains them on the same LoRA model (the oracle), the frozen base
stays as it was and is never written (the swap paths' wear counters; its
gradients never come down), the adapters export under
PEFT's names and load into a fresh plain-torch model that computes the same
logits, and the merged export equals the base plus the adapters' product;
with `peft` importable, its own model trains through the adapter."""
import json
import os

import pytest
import torch

import helpers
import strata.errors
import strata.torch
from strata.torch import lora
from strata.torch import safetensors as st

STEPS, GAS, LR, WD, R, ALPHA = 12, 2, 1e-2, 0.0, 4, 8


_BASE = {}


def base_llama():
    """The tiny Llama after 30 steps of full training with torch (LoRA adapts a
    trained base: on a random one the adapters barely move the loss)."""
    if not _BASE:
        model = helpers.tiny_llama(seed=0)
        helpers.train_torch(model, helpers.batches(30, seed=5), 30, 1, lr=1e-2, weight_decay=0.0)
        _BASE.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    model = helpers.tiny_llama(seed=0)
    model.load_state_dict(_BASE)
    return model


def lora_llama(seed=0):
    model = base_llama()
    torch.manual_seed(seed + 1)  # the adapters' draws
    lora.apply(model, r=R, alpha=ALPHA)
    return model


def test_apply_freezes_the_base_and_changes_nothing_until_trained():
    plain, model = base_llama(), lora_llama(seed=0)
    b = helpers.batches(1)[0]
    # lora_B starts at zero: the model computes exactly as without adapters.
    assert torch.equal(plain(b, labels=b)[0], model(b, labels=b)[0])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Every projection of every layer: 7 targets x 2 layers x (A, B).
    assert len(trainable) == 7 * 2 * 2
    with pytest.raises(ValueError, match="adapters already"):
        lora.apply(model, r=R)
    with pytest.raises(ValueError, match="no nn.Linear matches"):
        lora.apply(helpers.tiny_llama(), r=R, targets=("query",))
    with pytest.raises(ValueError, match="rank must be"):
        lora.apply(helpers.tiny_llama(), r=0)


@pytest.fixture(scope="module")
def oracle():
    """torch AdamW on the adapters of the same LoRA model."""
    model = lora_llama()
    losses, _ = helpers.train_torch(model, helpers.batches(STEPS * GAS), STEPS, GAS, lr=LR, weight_decay=WD)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", ["optimizer_cpu", "params_nvme", "base_nvme"])
def test_adapters_train_as_torch_adamw_trains_them_and_the_base_is_never_written(oracle, placement, swap_dir):
    want_losses, want = oracle
    assert want_losses[-1] < 0.9 * want_losses[0], "the adapters must learn for the test to mean anything"
    model = lora_llama()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    cfg = helpers.config(swap_dir, "params_nvme" if placement == "base_nvme" else placement, "fp32", gas=GAS, lr=LR,
                         weight_decay=WD)
    if placement == "base_nvme":  # the compute copies on the swap paths, the optimizer state in pinned memory
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    engine = strata.torch.initialize(model, cfg)
    stats = []
    losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS,
                                  on_step=lambda s, st_: stats.append(st_))
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(exp, rel=1e-5), f"step {step + 1}: loss {got} vs torch {exp}"
    got = engine.state_dict()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    for name, w in base.items():
        assert torch.equal(got[name], w), f"{name}: the frozen base changed"
    adapters = engine.state_dict(trainable_only=True)
    assert set(adapters) == {n for n, p in model.named_parameters() if p.requires_grad}
    # Only the adapters move in a step: their gradients down (the frozen base has none) and, with the
    # compute copies on the swap paths, their new copies written there, never a byte of the base
    # (the wear counters). Each adapter is a whole number of 64-element alignment units here.
    trainable_bytes = sum(t.numel() for t in adapters.values()) * 4
    frozen_bytes = sum(t.numel() for t in base.values()) * 4
    assert frozen_bytes > 4 * trainable_bytes
    assert all(st_.bytes_d2h == GAS * trainable_bytes for st_ in stats), [st_.bytes_d2h for st_ in stats]
    if placement == "base_nvme":
        assert all(st_.bytes_nvme_write == trainable_bytes for st_ in stats[1:]), [st_.bytes_nvme_write
                                                                                  for st_ in stats]
    engine.close()


def test_adapter_export_loads_into_a_fresh_model_with_the_same_logits(tmp_path, swap_dir):
    model = lora_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "params_cpu", "fp32", lr=LR))
    helpers.train_strata(engine, model, helpers.batches(6), 6)
    b = helpers.batches(1, seed=7)[0]
    with torch.no_grad(), engine.resident():
        want = model(b).detach().clone()
    out = tmp_path / "adapter"
    lora.save_adapter(str(out), model, engine.state_dict(trainable_only=True), base_model_name_or_path="tiny")
    weights = engine.state_dict()
    engine.close()

    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == ("LORA", R, ALPHA,
                                                                                               "tiny")
    assert cfg["target_modules"] == sorted(lora.DEFAULT_TARGETS)
    names = st.tensor_names(str(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert all(n.startswith("base_model.model.") and (".lora_A." in n or ".lora_B." in n) for n in names)

    # A fresh plain-torch model: the base's weights (what the base checkpoint holds), then the adapters.
    fresh = base_llama()
    lora.load_adapter(fresh, str(out))
    with torch.no_grad():
        torch.testing.assert_close(fresh(b), want, rtol=1e-5, atol=1e-6)

    # The merged weights: a plain model without adapters computes the same.
    merged = lora.merged_state_dict(model, weights)
    assert not any(".lora_" in n for n in merged)
    plain = helpers.tiny_llama(seed=5)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(b), want, rtol=1e-4, atol=1e-5)


def test_base_from_safetensors_and_adapters_of_their_own(tmp_path, swap_dir):
    """The base streamed from its files (the model built on the meta device), the
    adapters taking their own draws: the files need not hold them."""
    donor = base_llama()
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    st.save_file(dict(donor.state_dict()), str(base_dir / "model.safetensors"))
    with strata.torch.meta_init():
        model = helpers.tiny_llama(seed=0)
    torch.manual_seed(11)
    lora.apply(model, r=R, alpha=ALPHA)
    drawn = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "params_nvme", "fp32", lr=LR),
                                     weights=str(base_dir))
    got = engine.state_dict()
    for n, p in donor.state_dict().items():
        assert torch.equal(got[n], p), n
    for n, p in drawn.items():
        assert torch.equal(got[n], p), n
    losses = helpers.train_strata(engine, model, helpers.batches(8), 8)
    assert losses[-1] < losses[0]
    engine.close()


def _base_files(tmp_path, dtype=torch.float32, name="base"):
    donor = base_llama()
    base_dir = tmp_path / name
    base_dir.mkdir()
    st.save_file({k: v.to(dtype) for k, v in donor.state_dict().items()}, str(base_dir / "model.safetensors"))
    return base_dir


def _lora_from_files(base_dir, swap_dir, precision="fp32", frozen_base="auto", placement="base_nvme", max_in_cpu=None,
                     **strata_keys):
    with strata.torch.meta_init():
        model = helpers.tiny_llama(seed=0)
    torch.manual_seed(11)
    lora.apply(model, r=R, alpha=ALPHA)
    cfg = helpers.config(swap_dir, "params_nvme" if placement == "base_nvme" else placement, precision, gas=GAS,
                         lr=LR, weight_decay=WD, frozen_base=frozen_base, **strata_keys)
    if placement == "base_nvme":
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    if max_in_cpu is not None:
        cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    return model, strata.torch.initialize(model, cfg, weights=str(base_dir))


def _saved_checkpoint(tmp_path, swap_dir, base_dir, **lora_keys):
    """Two steps of a LoRA run over base_dir, a checkpoint saved under tmp_path/ck: (model, the
    engine's state_dict, the manifest, the step folder)."""
    model, engine = _lora_from_files(base_dir, swap_dir, **lora_keys)
    helpers.train_strata(engine, model, helpers.batches(2 * GAS), 2, GAS)
    engine.save_checkpoint(str(tmp_path / "ck"))
    saved = engine.state_dict()
    engine.close()
    step = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().split()[0]
    return model, saved, json.loads((step / "manifest.json").read_text()), step


@pytest.mark.parametrize("precision,file_dtype,overlap", [
    ("fp32", torch.float32, "exact"), ("bf16", torch.bfloat16, "exact"), ("bf16", torch.float32, "exact"),
    ("bf16", torch.bfloat16, "delayed"), ("fp32", torch.float32, "speculative")])
def test_base_read_from_its_files_is_never_copied_or_written(tmp_path, swap_dir, precision, file_dtype, overlap):
    """strata.frozen_base "files": the base's home is the safetensors files it was
    imported from (no copy on the swap paths, not a byte written there for it,
    at initialize or in a step; the wear counters), read on every fetch, and the
    run is bit for bit the run with a copy on the swap drive ("swap")."""
    base_dir = _base_files(tmp_path, file_dtype)
    runs = {}
    for mode in ("swap", "files"):
        model, engine = _lora_from_files(base_dir, swap_dir, precision, mode, overlap=overlap)
        written_at_init = sum(s.bytes_written_total for s in engine.swap_stats())
        stats = []
        losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS,
                                      on_step=lambda s, st_: stats.append(st_))
        runs[mode] = (losses, engine.state_dict(), written_at_init, stats,
                      {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad})
        engine.close()
    (l_swap, w_swap, init_swap, st_swap, frozen), (l_files, w_files, init_files, st_files, _) = runs["swap"], runs["files"]
    assert l_files == l_swap
    assert l_files[-1] < l_files[0]
    for name, w in w_swap.items():
        assert torch.equal(w_files[name], w), name
    cb = 4 if precision == "fp32" else 2
    frozen_bytes = sum(frozen.values()) * cb
    # The base is the run's bulk: "swap" writes it once at initialize, "files" never.
    assert init_swap - init_files >= frozen_bytes, (init_swap, init_files, frozen_bytes)
    assert [s.bytes_nvme_write for s in st_files] == [s.bytes_nvme_write for s in st_swap]
    # Each fetch of a group not kept on the device reads its base from the files (the first step all
    # of it), as "swap" reads its copy; "swap" reads nothing from the files.
    file_bytes = frozen_bytes * (4 if file_dtype == torch.float32 else 2) // cb
    assert st_files[0].bytes_file_read >= file_bytes, (st_files[0].bytes_file_read, file_bytes)
    assert all(s.bytes_file_read > 0 for s in st_files)
    assert all(s.bytes_file_read == 0 for s in st_swap)
    for f, s in zip(st_files, st_swap):
        assert f.resident == s.resident
        assert s.resident_nvme_bytes == s.resident_bytes  # every group's copies live on nvme
        assert f.bytes_nvme_read + f.bytes_file_read * cb // (4 if file_dtype == torch.float32 else 2) <= s.bytes_nvme_read
        assert f.bytes_nvme_read < s.bytes_nvme_read


@pytest.mark.parametrize("max_in_cpu,budget", [(10**9, None), ("auto", "64MiB")])
def test_a_base_kept_in_cpu_memory_reads_no_file_and_is_left_out_of_checkpoints(tmp_path, swap_dir, max_in_cpu,
                                                                                   budget):
    """zero_optimization.offload_param.max_in_cpu (a number, or "auto" under a pinned budget) keeping
    every group's compute copies in pinned memory: the run is bit for bit the run reading the base
    from its files, reads nothing from the files or the swap drive in a step, and its checkpoint
    leaves the base out as that run's does (the files named), loading into a run that reads them."""
    base_dir = _base_files(tmp_path)
    runs = {}
    for name, keys in (("files", {}), ("kept", {"max_in_cpu": max_in_cpu})):
        if name == "kept" and budget is not None:
            keys["budgets"] = {"pinned": budget}
        model, engine = _lora_from_files(base_dir, swap_dir, **keys)
        stats = []
        losses = helpers.train_strata(engine, model, helpers.batches(4 * GAS), 4, GAS,
                                      on_step=lambda s, st_: stats.append(st_))
        if name == "kept":
            engine.save_checkpoint(str(tmp_path / "ck"))
        runs[name] = (losses, engine.state_dict(), stats)
        engine.close()
    (l_files, w_files, st_files), (l_kept, w_kept, st_kept) = runs["files"], runs["kept"]
    assert l_kept == l_files and l_kept[-1] < l_kept[0]
    for name, w in w_files.items():
        assert torch.equal(w_kept[name], w), name
    assert all(s.bytes_file_read > 0 for s in st_files)
    assert all(s.bytes_file_read == 0 and s.bytes_nvme_read == 0 and s.bytes_nvme_write == 0 for s in st_kept)
    step = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().split()[0]
    manifest = json.loads((step / "manifest.json").read_text())
    groups = {p["group"] for p in manifest["params"] if not p["trainable"]}
    assert {b["group"] for b in manifest["frozen_base"]} == groups
    assert all(b["files"] == [str(base_dir / "model.safetensors")] for b in manifest["frozen_base"])
    model, engine = _lora_from_files(base_dir, swap_dir)
    engine.load_checkpoint(str(tmp_path / "ck"))
    assert all(torch.equal(engine.state_dict()[n], w) for n, w in w_kept.items())
    engine.close()


def test_a_base_file_changed_during_the_run_is_data_loss_naming_it(tmp_path, swap_dir):
    base_dir = _base_files(tmp_path)
    model, engine = _lora_from_files(base_dir, swap_dir, frozen_base="files")
    helpers.train_strata(engine, model, helpers.batches(GAS), 1, GAS)
    path = base_dir / "model.safetensors"
    # Every tensor's values, in place (groups kept on the device between steps are not read again).
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size
        f.seek(8 + header)
        f.write(b"\x3f" * (size - 8 - header))
        f.flush()
        os.fsync(f.fileno())
    with pytest.raises(strata.errors.DataLoss, match=r"model\.safetensors: tensor '[^']+' \(frozen parameter .*changed during the run"):
        helpers.train_strata(engine, model, helpers.batches(GAS), 1, GAS)
    engine.close()


def test_files_mode_names_what_stands_in_its_way(tmp_path, swap_dir):
    base_dir = _base_files(tmp_path)
    with pytest.raises(strata.errors.FailedPrecondition, match=r"frozen_base \"files\".*not on nvme"):
        _lora_from_files(base_dir, swap_dir, frozen_base="files", placement="params_cpu")
    model = lora_llama()  # values of its own: nothing imported
    with pytest.raises(strata.errors.FailedPrecondition, match=r"frozen_base \"files\".*no safetensors files"):
        strata.torch.initialize(model, helpers.config(swap_dir, "params_nvme", frozen_base="files"))


def test_checkpoint_of_a_base_read_from_files_leaves_it_out_resumes_and_refuses_another_base(tmp_path, swap_dir):
    """A checkpoint of a run whose base is read from its files holds the adapters and their
    optimizer state, not the base: the manifest names the files and the CRC64 of the base's values
    (format version 4), and a load takes the base from the run's own files (or its copy on the
    swap drive), refusing any other base before anything changes."""
    def same(got, want):
        return all(torch.equal(got[n], w) for n, w in want.items())

    def trains_on(engine, model):
        losses = helpers.train_strata(engine, model, helpers.batches(GAS), 1, GAS)
        assert losses and all(l == l for l in losses)

    base_dir = _base_files(tmp_path)
    model, saved, manifest, step = _saved_checkpoint(tmp_path, swap_dir, base_dir)
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}
    assert manifest["version"] == 4
    groups = {p["group"] for p in manifest["params"] if not p["trainable"]}
    assert {b["group"] for b in manifest["frozen_base"]} == groups
    assert all(b["files"] == [str(base_dir / "model.safetensors")] for b in manifest["frozen_base"])
    state = step / "state.safetensors"
    names = set(st.tensor_names(str(state)))
    assert not any(f"{n}.compute" in names for n in frozen)
    assert all(f"{n}.compute" in names for n, p in model.named_parameters() if p.requires_grad)
    assert state.stat().st_size < sum(frozen.values()) * 4, "the base (fp32) is not in the state file"

    # Over the same base: read from its files, or from its copy on the swap drive; in the middle of a
    # run (a step taken first, a prefetch maybe in flight).
    for mode in ("auto", "swap"):
        model, engine = _lora_from_files(base_dir, swap_dir, frozen_base=mode)
        helpers.train_strata(engine, model, helpers.batches(GAS, seed=3), 1, GAS)
        engine.load_checkpoint(str(tmp_path / "ck"))
        assert same(engine.state_dict(), saved), mode
        trains_on(engine, model)
        engine.close()

    # Another base (the same shapes): the checkpoint was not trained on it, and holds no base of its
    # own to put in its place, so the load is refused before anything changes, either way.
    other = {k: v + 0.5 for k, v in base_llama().state_dict().items()}
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    st.save_file(other, str(other_dir / "model.safetensors"))
    for mode in ("auto", "swap"):
        model, engine = _lora_from_files(other_dir, swap_dir, frozen_base=mode)
        before = engine.state_dict()
        with pytest.raises(strata.errors.FailedPrecondition,
                           match=r"does not hold the compute copies of the frozen parameters of group .*"
                                 r"model\.safetensors.*load it over the base it was trained on"):
            engine.load_checkpoint(str(tmp_path / "ck"))
        assert same(engine.state_dict(), before), mode
        trains_on(engine, model)
        engine.close()

    # A checkpoint that holds its base (saved with a copy on the swap drive) loads into a run that
    # reads the base from its files only when the values are those files' (a base read from its
    # files is never written).
    model, engine = _lora_from_files(base_dir, swap_dir, frozen_base="swap")
    helpers.train_strata(engine, model, helpers.batches(GAS), 1, GAS)
    engine.save_checkpoint(str(tmp_path / "ck_swap"))
    saved_swap = engine.state_dict()
    engine.close()
    model, engine = _lora_from_files(other_dir, swap_dir)
    with pytest.raises(strata.errors.FailedPrecondition, match=r"differ from those files' values.*\"swap\""):
        engine.load_checkpoint(str(tmp_path / "ck_swap"))
    engine.close()
    model, engine = _lora_from_files(base_dir, swap_dir)
    engine.load_checkpoint(str(tmp_path / "ck_swap"))
    assert same(engine.state_dict(), saved_swap)
    engine.close()


def test_a_save_reads_nothing_of_a_base_it_leaves_out(tmp_path, swap_dir):
    """A checkpoint that leaves out a base read from its files reads none of it: the
    adapters' compute copies come from their own part of each group's home. Shown by
    changing the base's values in the file before the save (a read would be data loss);
    put back, the checkpoint resumes a fresh run to the saved state."""
    base_dir = _base_files(tmp_path)
    path = base_dir / "model.safetensors"
    original = path.read_bytes()
    model, engine = _lora_from_files(base_dir, swap_dir, frozen_base="files")
    helpers.train_strata(engine, model, helpers.batches(2 * GAS), 2, GAS)
    saved = engine.state_dict(trainable_only=True)
    with open(path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        f.write(b"\x3f" * (len(original) - 8 - header))
        f.flush()
        os.fsync(f.fileno())
    engine.save_checkpoint(str(tmp_path / "ck"))
    engine.close()
    path.write_bytes(original)
    model, engine = _lora_from_files(base_dir, swap_dir, frozen_base="files")
    engine.load_checkpoint(str(tmp_path / "ck"))
    got = engine.state_dict(trainable_only=True)
    assert set(got) == set(saved)
    for name, w in saved.items():
        assert torch.equal(got[name], w), name
    losses = helpers.train_strata(engine, model, helpers.batches(GAS, seed=3), 1, GAS)
    assert losses and losses[0] == losses[0]
    engine.close()


def test_keep_base_saves_the_base_read_from_its_files_in_the_checkpoint(tmp_path, swap_dir):
    """strata.checkpoint.keep_base: the checkpoint holds the base's compute copies (no
    "frozen_base" in the manifest, version 2), so it resumes a run whose base lives on the
    swap drive with no file of the base left."""
    base_dir = _base_files(tmp_path)
    model, saved, manifest, step = _saved_checkpoint(tmp_path, swap_dir, base_dir, frozen_base="files",
                                                     checkpoint={"keep_base": True})
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert "frozen_base" not in manifest and manifest["version"] == 2
    names = set(st.tensor_names(str(step / "state.safetensors")))
    assert all(f"{n}.compute" in names for n in frozen)
    # Another base on the swap drive (the files' values + 0.5): the checkpoint's base replaces it.
    other = {k: v + 0.5 for k, v in base_llama().state_dict().items()}
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    st.save_file(other, str(other_dir / "model.safetensors"))
    model, engine = _lora_from_files(other_dir, swap_dir, frozen_base="swap")
    engine.load_checkpoint(str(tmp_path / "ck"))
    got = engine.state_dict()
    for name, w in saved.items():
        assert torch.equal(got[name], w), name
    engine.close()


def test_peft_model_trains_through_the_adapter(swap_dir):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"]))
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "optimizer_cpu", "fp32", lr=LR))
    losses = helpers.train_hf(engine, model, helpers.batches(8))
    assert losses[-1] < losses[0]
    trained = engine.state_dict(trainable_only=True)
    assert trained and all("lora_" in n for n in trained)
    engine.close()


def test_a_parameter_the_files_lack_is_an_error_unless_it_is_an_adapter_or_kept(tmp_path, swap_dir):
    """Only LoRA's adapters keep their own draws silently; any other parameter the
    weights files lack is refused (a full fine-tune from a checkpoint missing a
    tensor must not train from a random init), unless weights_missing="keep",
    which names each one in a warning."""
    donor = base_llama()
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    partial = {k: v for k, v in donor.state_dict().items() if k != "lm_head.weight"}
    st.save_file(partial, str(base_dir / "model.safetensors"))
    with pytest.raises(strata.errors.NotFound, match="lm_head.weight"):
        strata.torch.initialize(helpers.tiny_llama(seed=0), helpers.config(swap_dir), weights=str(base_dir))
    model = helpers.tiny_llama(seed=0)
    own = model.lm_head.weight.detach().clone()
    with pytest.warns(UserWarning, match="lm_head.weight"):
        engine = strata.torch.initialize(model, helpers.config(swap_dir), weights=str(base_dir),
                                         weights_missing="keep")
    got = engine.state_dict()
    assert torch.equal(got["lm_head.weight"], own)
    assert torch.equal(got["model.embed_tokens.weight"], donor.state_dict()["model.embed_tokens.weight"])
    engine.close()
    with pytest.raises(ValueError, match="weights_missing"):
        strata.torch.initialize(helpers.tiny_llama(seed=0), helpers.config(swap_dir), weights_missing="maybe")


def test_targets_follow_peft_rules():
    model = helpers.tiny_llama()
    paths = lora.apply(model, r=2, targets=["self_attn.q_proj", "down_proj"])
    assert paths == [f"model.layers.{i}.{t}" for i in range(2) for t in ("self_attn.q_proj", "mlp.down_proj")]
    model = helpers.tiny_llama()
    assert lora.apply(model, r=2, targets=r".*layers\.1\.self_attn\.(q|v)_proj") == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    with pytest.raises(ValueError, match="all-linear"):
        lora.apply(helpers.tiny_llama(), r=2, targets="all-linear")
