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
