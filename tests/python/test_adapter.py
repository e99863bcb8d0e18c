"""The adapter's contract (docs/python.md) and the pitfalls of ZeRO-3
style offload: tied weights, a module called twice, activation checkpointing,
a frozen base, evaluation and generation between steps, checkpoints, export
and import, a parameter used outside its group, bad configs."""
import dataclasses
import os
import re

import pytest
import torch
from torch import nn

import helpers
import llama
import strata
import strata.torch

STEPS, GAS = 6, 2


def torch_run(model, data, steps, gas, lr=1e-3, wd=0.01, params=None):
    return helpers.train_torch(model, data, steps, gas, lr=lr, weight_decay=wd, params=params)[0]


def close_losses(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=1e-5), f"step {i + 1}: {a} vs {b}"


def test_parameters_keep_their_identity_and_names(swap_dir):
    model = helpers.tiny_llama(tie=True)
    before = {n: p for n, p in model.named_parameters()}
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    after = {n: p for n, p in model.named_parameters()}
    assert before.keys() == after.keys()
    assert all(before[n] is after[n] for n in before)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Shape, dtype and device stay readable while not fetched; no memory is held.
    w = model.model.layers[0].mlp.up_proj.weight
    assert tuple(w.shape) == (64, 32) and w.dtype == torch.float32 and w.device.type == "cpu"
    assert w.data.storage().size() == 1
    assert engine.groups == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert engine.group_of(model.lm_head.weight) == "model.embed_tokens"
    engine.close()


def test_initialize_passes_total_num_steps_for_auto(swap_dir):
    cfg = helpers.config(swap_dir)
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}}
    with pytest.raises(strata.InvalidArgument, match=r"total_num_steps"):
        strata.torch.initialize(helpers.tiny_llama(), cfg)
    engine = strata.torch.initialize(helpers.tiny_llama(), cfg, total_num_steps=40)
    assert engine.config["scheduler"]["params"]["total_num_steps"] == 40
    engine.close()


def test_tied_embedding_and_output_weights_match_torch(swap_dir):
    data = helpers.batches(STEPS * GAS)
    ref = helpers.tiny_llama(tie=True)
    want = torch_run(ref, data, STEPS, GAS)
    model = helpers.tiny_llama(tie=True)
    engine = strata.torch.initialize(model, helpers.config(swap_dir, gas=GAS))
    got = helpers.train_strata(engine, model, data, STEPS, GAS)
    close_losses(got, want)
    w = engine.state_dict()
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    torch.testing.assert_close(w["model.embed_tokens.weight"], ref.model.embed_tokens.weight.detach(),
                               rtol=1e-4, atol=2e-6)
    engine.close()


class TwiceModel(nn.Module):
    """A block called twice in one forward (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU()), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 64)

    def forward(self, x, labels=None):
        h = self.embed(x)
        h = h + self.blocks[0](h)
        h = h + self.blocks[1](h)
        h = h + self.blocks[0](h)  # again
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1))
        return loss, logits


def test_module_called_twice_in_one_forward(swap_dir):
    data = helpers.batches(STEPS * GAS)
    ref = TwiceModel()
    want = torch_run(ref, data, STEPS, GAS)
    model = TwiceModel()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, gas=GAS))
    got = helpers.train_strata(engine, model, data, STEPS, GAS)
    close_losses(got, want)
    w = engine.state_dict()
    torch.testing.assert_close(w["blocks.0.0.weight"], ref.blocks[0][0].weight.detach(), rtol=1e-4, atol=2e-6)
    engine.close()


@pytest.mark.parametrize("placement,reentrant", [("optimizer_cpu", True), ("params_nvme", True),
                                                  ("optimizer_cpu", False), ("params_nvme", False)])
def test_activation_checkpointing_is_bit_identical(placement, reentrant, tmp_path):
    runs = []
    for ckpt in (False, True):
        swap = tmp_path / f"swap{ckpt}"
        swap.mkdir()
        model = helpers.tiny_llama()
        if ckpt:
            model.gradient_checkpointing_enable(use_reentrant=reentrant)
        engine = strata.torch.initialize(model, helpers.config(str(swap), placement, gas=GAS))
        fetches = helpers.watch_fetches(engine)
        losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS)
        runs.append((losses, engine.state_dict(), sorted(fetches)))
        assert all(g.refs == 0 and g.flat is None for g in engine._group_list), "nothing left fetched"
        engine.close()
    assert runs[0][0] == runs[1][0]
    helpers.assert_same_bits(runs[0][1], runs[1][1], "checkpointing")
    # The recomputation's fetch serves its backward: no block is fetched twice.
    assert runs[1][2] == runs[0][2]


def test_frozen_base_with_some_layers_trained(swap_dir):
    data = helpers.batches(STEPS * GAS)

    def frozen(seed=0):
        m = helpers.tiny_llama(seed=seed, layers=3)
        for n, p in m.named_parameters():
            p.requires_grad = n.startswith("model.layers.2.") or n.startswith("lm_head")
        return m

    ref = frozen()
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    want = torch_run(ref, data, STEPS, GAS)
    model = frozen()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, gas=GAS))
    got = helpers.train_strata(engine, model, data, STEPS, GAS)
    close_losses(got, want)
    w = engine.state_dict()
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert not torch.equal(w[n], start[n]), f"{n} should have trained"
            torch.testing.assert_close(w[n], p.detach(), rtol=1e-4, atol=2e-6)
        else:
            assert torch.equal(w[n], start[n]), f"{n} is frozen and must not change"
    engine.close()


def test_evaluation_between_steps_leaves_the_trajectory_bit_identical(tmp_path):
    runs = []
    for with_eval in (False, True):
        swap = tmp_path / f"s{with_eval}"
        swap.mkdir()
        model = helpers.tiny_llama()
        engine = strata.torch.initialize(model, helpers.config(str(swap), "params_nvme", "bf16", gas=GAS))
        evals = []

        def on_step(s, stats):
            if with_eval:
                model.eval()
                with torch.no_grad():
                    b = helpers.batches(1, seed=9)[0]
                    evals.append(model(b, labels=b)[0].item())
                model.train()
        losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS, on_step=on_step)
        runs.append((losses, engine.state_dict()))
        if with_eval:
            assert len(evals) == STEPS and evals[-1] < evals[0]
        engine.close()
    assert runs[0][0] == runs[1][0]
    helpers.assert_same_bits(runs[0][1], runs[1][1], "eval between steps")


def test_generation_in_the_resident_context(swap_dir):
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, lr=3e-3))
    helpers.train_strata(engine, model, helpers.batches(4), 4)
    plain = helpers.tiny_llama()
    plain.load_state_dict(engine.state_dict())
    prompt = torch.tensor([[1, 2, 3]])
    fetches = helpers.watch_fetches(engine)
    with engine.resident():
        got = model.generate(prompt, 8)
        assert all(g.flat is not None for g in engine._group_list)
    assert sorted(fetches) == sorted(engine.groups), "each group fetched once for the 8 tokens"
    assert all(g.flat is None for g in engine._group_list), "groups are released when the context ends"
    fetches.clear()
    model.generate(prompt, 2)
    assert len(fetches) == 2 * len(engine.groups), "outside the context: fetched per call"
    assert torch.equal(got, plain.generate(prompt, 8))
    engine.close()


def test_the_least_device_budget_finalize_names_trains_and_evaluates(tmp_path):
    """The device budget the refusal names trains (a backward holds a group's
    compute copies with its gradients) and evaluates in the resident context,
    whose kept groups give way when the budget has no room; the same bits as
    an unlimited budget."""
    data = helpers.batches(4)
    held_out = helpers.batches(2, seed=9)
    runs = []
    for i, budget in enumerate((None, 4096, "least")):
        swap = tmp_path / f"swap-{i}"
        swap.mkdir()
        keys = {} if budget is None else {"budgets": {"device": least if budget == "least" else budget}}
        cfg = helpers.config(str(swap), placement="params_cpu", **keys)
        model = helpers.tiny_llama(tie=True)
        if budget == 4096:
            with pytest.raises(strata.ResourceExhausted, match=r"strata\.budgets\.device >= \d+") as refused:
                strata.torch.initialize(model, cfg)
            least = int(re.search(r"strata\.budgets\.device >= (\d+)", str(refused.value)).group(1))
            assert least > 4096
            continue
        engine = strata.torch.initialize(model, cfg)
        losses = helpers.train_strata(engine, model, data, 4)
        fetches = helpers.watch_fetches(engine)
        with torch.no_grad(), engine.resident():
            evals = [model(b, labels=b)[0].item() for b in held_out for _ in range(2)]
        runs.append((losses, evals, len(fetches), engine.state_dict()))
        engine.close()
    (losses, evals, fetched, weights), (least_losses, least_evals, least_fetched, least_weights) = runs
    assert least_losses == losses and least_evals == evals
    helpers.assert_same_bits(weights, least_weights, "the least device budget")
    assert fetched == len(engine.groups), "an unlimited budget keeps every group: one fetch each"
    assert least_fetched > fetched, "the least budget cannot keep them: the kept groups gave way"


def test_save_and_resume_continue_bit_identically(tmp_path):
    data = helpers.batches(10)
    # The uninterrupted run.
    (tmp_path / "a").mkdir()
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(str(tmp_path / "a"), "optimizer_nvme", "bf16"))
    full = helpers.train_strata(engine, model, data, 10)
    want = engine.state_dict()
    engine.close()
    # Five steps, save (with client state), then a new engine in another placement resumes.
    (tmp_path / "b").mkdir()
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(str(tmp_path / "b"), "optimizer_nvme", "bf16"))
    first = helpers.train_strata(engine, model, data[:5], 5)
    torch.manual_seed(77)
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"position": 5, "note": "x"})
    expected_rng = torch.rand(3)
    engine.close()
    (tmp_path / "c").mkdir()
    model = helpers.tiny_llama(seed=5)  # other initial values: the checkpoint overrides them
    engine = strata.torch.initialize(model, helpers.config(str(tmp_path / "c"), "params_nvme", "bf16"))
    torch.manual_seed(0)
    state = engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert state == {"position": 5, "note": "x"}
    assert torch.equal(torch.rand(3), expected_rng), "the RNG state is restored"
    rest = helpers.train_strata(engine, model, data[state["position"]:], 5)
    assert first + rest == full
    helpers.assert_same_bits(engine.state_dict(), want, "resumed")
    engine.close()


def test_resume_from_starts_a_meta_model_at_the_checkpoint_bit_identically(tmp_path):
    """initialize(resume_from=) is initialize then load_checkpoint, without the
    initial values: a model on the meta device (no weights files) resumes, the
    client state and RNG come back, and it trains on as the run that saved."""
    data = helpers.batches(8)
    (tmp_path / "a").mkdir()
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(str(tmp_path / "a"), "optimizer_nvme", "bf16"))
    first = helpers.train_strata(engine, model, data[:4], 4)
    torch.manual_seed(77)
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"position": 4})
    expected_rng = torch.rand(3)
    rest_want = helpers.train_strata(engine, model, data[4:], 4)
    want = engine.state_dict()
    engine.close()
    for placement in ("optimizer_nvme", "params_nvme"):
        swap = tmp_path / placement
        swap.mkdir()
        with strata.torch.meta_init():
            meta = llama.LlamaForCausalLM(helpers.tiny_llama().config)
        torch.manual_seed(0)
        engine = strata.torch.initialize(meta, helpers.config(str(swap), placement, "bf16"),
                                         resume_from=str(tmp_path / "ckpt"))
        assert engine.client_state == {"position": 4}
        assert torch.equal(torch.rand(3), expected_rng), "the RNG state is restored"
        assert all(p.device.type != "meta" for p in meta.parameters())
        rest = helpers.train_strata(engine, meta, data[engine.client_state["position"]:], 4)
        assert rest == rest_want, placement
        helpers.assert_same_bits(engine.state_dict(), want, f"resumed into {placement}")
        engine.close()
    assert first  # (the saving run trained)
    # A block with a frozen parameter gets its values before the load: on the
    # meta device without weights it is named; no checkpoint is strata's NotFound.
    with strata.torch.meta_init():
        meta = llama.LlamaForCausalLM(helpers.tiny_llama().config)
    meta.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="'model.layers.0.*meta device in a block with frozen parameters"):
        strata.torch.initialize(meta, helpers.config(str(tmp_path / "d")), resume_from=str(tmp_path / "ckpt"))
    with pytest.raises(strata.NotFound):
        strata.torch.initialize(helpers.tiny_llama(), helpers.config(str(tmp_path / "d")),
                                resume_from=str(tmp_path / "none"))


def test_export_round_trips_through_load_state_dict(swap_dir, tmp_path):
    model = helpers.tiny_llama(tie=True)
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    helpers.train_strata(engine, model, helpers.batches(3), 3)
    out = tmp_path / "export"
    engine.export(str(out), dtype="f32", max_shard_bytes=40000)
    assert os.path.exists(out / "model.safetensors.index.json")
    loaded = strata.torch.load_dir(str(out))
    # Hugging Face's layout: a tied weight is stored once, under its first name.
    assert "lm_head.weight" not in loaded
    plain = helpers.tiny_llama(tie=True, seed=9)
    missing, unexpected = plain.load_state_dict(loaded, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    helpers.assert_same_bits({n: p.detach() for n, p in plain.named_parameters()},
                             {n: v for n, v in engine.state_dict().items() if n != "lm_head.weight"}, "export")
    # bf16 export: the weights rounded to bf16.
    engine.export(str(tmp_path / "bf16"), dtype="bf16")
    b = strata.torch.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert b["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(b["model.norm.weight"], engine.state_dict()["model.norm.weight"].to(torch.bfloat16))
    engine.close()


def test_meta_device_model_streams_its_weights_from_safetensors(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(str(tmp_path / "a")))
    helpers.train_strata(engine, model, helpers.batches(2), 2)
    engine.export(str(tmp_path / "w"), dtype="f32", max_shard_bytes=30000)
    want = engine.state_dict()
    engine.close()
    with strata.torch.meta_init():
        meta = llama.LlamaForCausalLM(helpers.tiny_llama().config)
    assert all(p.device.type == "meta" for p in meta.parameters())
    engine = strata.torch.initialize(meta, helpers.config(str(tmp_path / "b")), weights=str(tmp_path / "w"))
    assert all(p.device.type == "cpu" for p in meta.parameters())
    helpers.assert_same_bits(engine.state_dict(), want, "imported")
    # It trains from there.
    losses = helpers.train_strata(engine, meta, helpers.batches(3), 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    engine.close()


def test_meta_device_model_without_weights_is_an_error(swap_dir):
    with strata.torch.meta_init():
        meta = llama.LlamaForCausalLM(helpers.tiny_llama().config)
    with pytest.raises(ValueError, match="meta device"):
        strata.torch.initialize(meta, helpers.config(swap_dir))


def test_parameter_used_outside_its_group_is_a_named_error(swap_dir):
    ref = helpers.tiny_llama()
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    w = model.model.layers[1].mlp.up_proj.weight
    with pytest.raises(strata.NotFetched, match=r"'model.layers.1.mlp.up_proj.weight'.*'model.layers.1'") as info:
        w.sum()
    with pytest.raises(strata.NotFetched, match="lm_head.weight"):
        torch.nn.functional.linear(torch.ones(1, 32), model.lm_head.weight)
    # The context the message names is the one that works (resident() only
    # keeps what a forward fetches).
    assert "`with engine.gathered():`" in str(info.value) and "resident" not in str(info.value)
    with engine.resident(), pytest.raises(strata.NotFetched):
        w.sum()
    with engine.gathered():
        assert torch.equal(w.sum(), ref.model.layers[1].mlp.up_proj.weight.detach().sum())
        assert torch.equal(model.lm_head(torch.ones(1, 32)), ref.lm_head(torch.ones(1, 32)))
    engine.close()
    # After close() the message still names the parameter and its group.
    with pytest.raises(strata.NotFetched, match=r"'model.layers.1.mlp.up_proj.weight' \(fetch group "
                                                r"'model.layers.1'\).*after its engine was closed") as info:
        w.sum()
    assert "'?'" not in str(info.value)


def _logits(model, batch):
    with torch.no_grad():
        return model(batch, labels=batch)[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepcopy_of_a_model_under_strata_is_a_plain_copy_of_its_own(precision, swap_dir):
    """copy.deepcopy (an EMA or teacher model) gives plain modules holding the
    compute copies, which the engine neither fetches for nor trains."""
    import copy
    data = helpers.batches(4)
    batch = helpers.batches(1, seed=9)[0]
    model = helpers.tiny_llama(tie=True)
    engine = strata.torch.initialize(model, helpers.config(swap_dir, precision=precision, lr=3e-3))
    helpers.train_strata(engine, model, data[:2], 2)
    want = _logits(model, batch)
    fetches = helpers.watch_fetches(engine)
    twin = copy.deepcopy(model)
    assert sorted(fetches) == sorted(engine.groups), "the copy reads each group once"
    assert all(type(p) is nn.Parameter and p.dtype == engine.dtype for p in twin.parameters())
    assert twin.lm_head.weight is twin.model.embed_tokens.weight, "tied weights stay tied in the copy"
    assert all(torch.isfinite(p).all() for p in twin.parameters())
    fetches.clear()
    assert torch.equal(_logits(twin, batch), want)
    if precision == "fp32":  # torch as the oracle: a plain model with the engine's weights
        plain = helpers.tiny_llama(tie=True)
        plain.load_state_dict(engine.state_dict())
        assert torch.equal(_logits(twin, batch), _logits(plain, batch))
    # The copy trains on its own (torch.optim), without the engine.
    loss, _ = twin(batch, labels=batch)
    loss.backward()
    assert all(p.grad is not None for p in twin.parameters())
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    assert fetches == [], "the copy's forward and backward fetch nothing"
    assert torch.equal(_logits(model, batch), want), "the original is untouched by the copy's training"
    # The original trains on; the copy keeps its weights.
    frozen_copy = {n: p.detach().clone() for n, p in twin.named_parameters()}
    helpers.train_strata(engine, model, data[2:], 2)
    assert all(torch.equal(p, frozen_copy[n]) for n, p in twin.named_parameters())
    # Inside gathered() (the parameters fetched) deepcopy gives the same copy,
    # and an EMA update reads the model's weights there.
    want = _logits(model, batch)
    ema = copy.deepcopy(model)
    assert torch.equal(_logits(ema, batch), want)
    with engine.gathered():
        ema_in = copy.deepcopy(model)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)
    assert torch.equal(_logits(ema_in, batch), want)
    assert torch.equal(_logits(ema, batch), want), "the average of equal weights is those weights"
    # A block alone copies too.
    block = copy.deepcopy(model.model.layers[1])
    with engine.gathered():
        assert all(torch.equal(a, b) for a, b in zip(block.parameters(), model.model.layers[1].parameters()))
    engine.close()
    with pytest.raises(strata.NotFetched, match=r"'model.norm.weight'.*after its engine was closed"):
        copy.deepcopy(model.model.norm)


@pytest.mark.parametrize("placement,precision", [("optimizer_cpu", "fp32"), ("params_nvme", "bf16"),
                                                  ("optimizer_device", "bf16")])
def test_write_inside_gathered_is_a_named_error_and_undone(placement, precision, tmp_path):
    """A write to a parameter inside gathered() cannot reach the fp32 master
    weights: the context's end raises ParameterWritten naming it and puts the
    compute copy back; training then goes on as if it had not happened."""
    data = helpers.batches(6)
    batch = helpers.batches(1, seed=9)[0]
    runs = []
    for write in (False, True):
        swap = tmp_path / f"swap{write}"
        swap.mkdir()
        model = helpers.tiny_llama()
        engine = strata.torch.initialize(model, helpers.config(str(swap), placement, precision))
        losses = helpers.train_strata(engine, model, data[:3], 3)
        before, want = engine.state_dict(), _logits(model, batch)
        with engine.gathered():  # reading, evaluating: no error
            model.model.layers[0].mlp.up_proj.weight.sum()
            _logits(model, batch)
        if write:
            w = model.model.layers[0].mlp.up_proj.weight
            with pytest.raises(strata.ParameterWritten, match=r"'model.layers.0.mlp.up_proj.weight' was written "
                                                              r"inside engine.gathered\(\).*undone"):
                with engine.gathered():
                    w.data.mul_(0)
                    assert _logits(model, batch).abs().sum() >= 0
            helpers.assert_same_bits(engine.state_dict(), before, "masters after the write")
            assert torch.equal(_logits(model, batch), want), "the compute copy is back"
            # Other writes: in-place under no_grad, a permutation, two parameters.
            with pytest.raises(strata.ParameterWritten, match=r"'model.layers.1.self_attn.q_proj.weight', "
                                                              r"'model.norm.weight' were written"):
                with engine.gathered(), torch.no_grad():
                    q = model.model.layers[1].self_attn.q_proj.weight
                    q.copy_(q.flip(0))
                    nn.init.ones_(model.model.norm.weight)
            assert torch.equal(_logits(model, batch), want)
            # An error inside the context is not masked.
            with pytest.raises(KeyError):
                with engine.gathered():
                    w.data.zero_()
                    raise KeyError("mine")
            with engine.gathered():
                pass
        losses += helpers.train_strata(engine, model, data[3:], 3)
        runs.append((losses, engine.state_dict()))
        engine.close()
    assert runs[0][0] == runs[1][0]
    helpers.assert_same_bits(runs[0][1], runs[1][1], "a run with undone writes")


def test_write_to_a_frozen_parameter_inside_gathered_is_a_named_error(swap_dir):
    model = helpers.tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    with pytest.raises(strata.ParameterWritten, match=r"'model.embed_tokens.weight' was written.*"
                                                      r"'model.embed_tokens.weight' is frozen") as info:
        with engine.gathered():
            model.model.embed_tokens.weight.data.fill_(1.0)
    assert isinstance(info.value, strata.FailedPrecondition) and "undone" not in str(info.value)
    engine.close()


def test_bad_config_key_names_the_key_path(swap_dir):
    cfg = helpers.config(swap_dir)
    cfg["optimizer"]["params"]["lr"] = "fast"
    with pytest.raises(strata.InvalidArgument, match=r"optimizer\.params\.lr") as info:
        strata.torch.initialize(helpers.tiny_llama(), cfg)
    assert info.value.status == "INVALID_ARGUMENT"
    cfg = helpers.config(swap_dir, strict=True)
    cfg["zero_optimization"]["offload_optimizer"]["devcie"] = "cpu"
    with pytest.raises(strata.InvalidArgument, match=r"zero_optimization\.offload_optimizer\.devcie"):
        strata.torch.initialize(helpers.tiny_llama(), cfg)


def test_param_groups_map_to_optimizer_groups(swap_dir):
    data = helpers.batches(STEPS)
    ref = helpers.tiny_llama()
    norms = [p for n, p in ref.named_parameters() if p.ndim < 2]
    rest = [p for n, p in ref.named_parameters() if p.ndim >= 2]
    want = torch_run(ref, data, STEPS, 1, wd=0.1,
                     params=[{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": 5e-4}])
    model = helpers.tiny_llama()
    groups = [{"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-4}]
    engine = strata.torch.initialize(model, helpers.config(swap_dir, weight_decay=0.1), param_groups=groups)
    got = helpers.train_strata(engine, model, data, STEPS)
    close_losses(got, want)
    w = engine.state_dict()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(w[n], p.detach(), rtol=1e-4, atol=2e-6, msg=lambda m: f"{n}: {m}")
    engine.close()


class Fp32Linear(nn.Linear):
    """fp16 parameters, fp32 products (torch 1.13 has no fp16 matmul on the CPU)."""

    def forward(self, x):
        return nn.functional.linear(x.float(), self.weight.float(), self.bias.float())


class Fp32Compute(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([Fp32Linear(32, 32) for _ in range(2)])
        self.head = Fp32Linear(32, 64)

    def forward(self, x, labels=None):
        h = self.embed(x).float()
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), logits


def test_fp16_scales_the_loss(swap_dir):
    model = Fp32Compute()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, precision="fp16", lr=1e-2))
    assert engine.loss_scale == 2.0 ** 16
    assert model.layers[0].weight.dtype == torch.float16
    norms = []
    losses = helpers.train_strata(engine, model, helpers.batches(12), 12,
                                  on_step=lambda s, st: norms.append((st.grad_norm, st.skipped)))
    assert losses[-1] < losses[0]
    # The engine unscales: the norms it reports are those of the loss's own
    # gradients (order 1), not of the scaled ones (order 2^16).
    applied = [n for n, skipped in norms if not skipped]
    assert applied and max(applied) < 100
    engine.close()


def test_backward_more_often_than_the_accumulation_steps_is_an_error(swap_dir):
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, gas=1))
    b = helpers.batches(1)[0]
    engine.backward(model(b, labels=b)[0])
    with pytest.raises(strata.FailedPrecondition, match="gradient_accumulation_steps is 1"):
        engine.backward(model(b, labels=b)[0])
    assert engine.step() is not None
    engine.close()


@pytest.mark.parametrize("freeze", [False, True])
def test_the_backward_holds_few_groups_at_once(freeze, swap_dir):
    """Each block is released as soon as its backward is done (frozen blocks
    too), so the device holds a few groups, not the model."""
    model = helpers.tiny_llama(layers=6)
    if freeze:  # frozen blocks between trained ones: the backward runs through them
        for n, p in model.named_parameters():
            p.requires_grad = not n.startswith("model.layers.") or n.startswith("model.layers.5.")
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    peak = helpers.watch_fetched_at_once(engine)
    helpers.train_strata(engine, model, helpers.batches(2), 2)
    assert max(peak) <= 3, f"up to {max(peak)} of {len(engine.groups)} groups fetched at once"
    engine.close()


def test_the_forward_releases_its_buffers_at_once(tmp_path):
    """Saved tensors that view a group's buffer (Linear saves weight.t()) do not
    keep it: the device holds a few layers in the forward, not all of them; and
    in the backward, prefetched copies give way to the gradient buffers."""
    model = helpers.tiny_llama(layers=8)
    cfg = helpers.config(str(tmp_path), "params_cpu")
    cfg["strata"]["budgets"] = {"device": 160 * 1024}  # about half of the 8 layers (37 KiB each in fp32)
    engine = strata.torch.initialize(model, cfg)
    losses = helpers.train_strata(engine, model, helpers.batches(4), 4)
    assert losses[-1] < losses[0]
    engine.close()


@dataclasses.dataclass
class BlockOut:
    hidden: torch.Tensor
    aux: int = 0


class DataclassBlocks(nn.Module):
    def __init__(self, wrap=BlockOut):
        super().__init__()
        torch.manual_seed(5)
        self.wrap = wrap
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([DataclassBlock(wrap) for _ in range(2)])
        self.head = nn.Linear(32, 64)

    def forward(self, x, labels=None):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h).hidden
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), logits


class DataclassBlock(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.wrap = wrap
        self.norm = nn.LayerNorm(32)  # saves its weight itself: wrong without a fetch in the backward
        self.lin = nn.Linear(32, 32)

    def forward(self, h):
        return self.wrap(h + self.lin(self.norm(h)))


def test_blocks_returning_dataclasses_match_torch(swap_dir):
    data = helpers.batches(STEPS)
    ref = DataclassBlocks()
    want = torch_run(ref, data, STEPS, 1)
    model = DataclassBlocks()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    close_losses(helpers.train_strata(engine, model, data, STEPS), want)
    engine.close()


class Opaque:
    def __init__(self, hidden):
        self.hidden = hidden


def test_an_output_the_adapter_cannot_see_is_an_error(swap_dir):
    model = DataclassBlocks(wrap=Opaque)
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    b = helpers.batches(1)[0]
    with pytest.raises(strata.Unimplemented, match=r"'blocks.0' returned Opaque"):
        model(b, labels=b)
    engine.close()


def test_loss_backward_instead_of_engine_backward_is_a_named_error(swap_dir):
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    b = helpers.batches(1)[0]
    with pytest.raises(strata.FailedPrecondition, match=r"engine.backward\(loss\) instead of loss.backward"):
        model(b, labels=b)[0].backward()
    engine.close()


def test_a_parameter_group_without_a_learning_rate_is_refused(swap_dir):
    model = helpers.tiny_llama()
    with pytest.raises(ValueError, match="must be > 0"):
        strata.torch.initialize(model, helpers.config(swap_dir), param_groups=[{"params": [model.lm_head.weight],
                                                                                "lr": 0.0}])
    model = helpers.tiny_llama()
    with pytest.raises(ValueError, match="in two of param_groups"):
        strata.torch.initialize(model, helpers.config(swap_dir),
                                param_groups=[{"params": [model.lm_head.weight]}, {"params": [model.lm_head.weight]}])


def test_an_unfetched_parameter_reads_as_nan(swap_dir):
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    assert torch.isnan(model.lm_head.weight.data).all()
    engine.close()


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in the backward")


def test_a_backward_that_fails_part_way_skips_the_step(swap_dir):
    model = helpers.tiny_llama(layers=3)
    engine = strata.torch.initialize(model, helpers.config(swap_dir, lr=3e-3))
    data = helpers.batches(6)
    helpers.train_strata(engine, model, data[:2], 2)
    before = engine.state_dict()
    hook = model.model.layers[1].register_forward_hook(lambda m, args, out: Boom.apply(out))
    b = data[2]
    with pytest.raises(RuntimeError, match="boom in the backward"):
        engine.backward(model(b, labels=b)[0])  # layer 2 and the head sent their gradients already
    hook.remove()
    stats = engine.step()
    assert stats.skipped, "the partial gradients must not be applied"
    helpers.assert_same_bits(engine.state_dict(), before, "after the skipped step")
    losses = helpers.train_strata(engine, model, data[3:], 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not engine.stats().skipped
    engine.close()


def test_a_forward_that_fails_leaves_nothing_fetched(swap_dir):
    model = helpers.tiny_llama()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))

    def fail(m, args, out):
        raise KeyError("boom in the forward")
    hook = model.model.layers[1].mlp.register_forward_hook(fail)
    b = helpers.batches(1)[0]
    with pytest.raises(KeyError):
        model(b, labels=b)
    hook.remove()
    losses = helpers.train_strata(engine, model, helpers.batches(2), 2)
    assert all(torch.isfinite(torch.tensor(losses)))
    engine.close()


class WithRunningStats(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.BatchNorm1d(32)  # running_mean/var: persistent buffers
        self.head = nn.Linear(32, 64)

    def forward(self, x, labels=None):
        h = self.norm(self.embed(x).transpose(1, 2)).transpose(1, 2)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)), logits


def test_checkpoints_carry_persistent_buffers(swap_dir, tmp_path):
    model = WithRunningStats()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    helpers.train_strata(engine, model, helpers.batches(3), 3)
    saved = model.norm.running_mean.clone()
    assert saved.abs().sum() > 0
    engine.save_checkpoint(str(tmp_path / "ck"))
    helpers.train_strata(engine, model, helpers.batches(2, seed=5), 2)
    assert not torch.equal(model.norm.running_mean, saved)
    engine.load_checkpoint(str(tmp_path / "ck"))
    assert torch.equal(model.norm.running_mean, saved)
    engine.close()


class KeywordBlocks(nn.Module):
    """Blocks called with keyword inputs (as `layer(hidden_states=h)`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([KeywordBlock() for _ in range(6)])
        self.head = nn.Linear(32, 64)

    def forward(self, x, labels=None):
        h = self.embed(x)
        for b in self.blocks:
            h = b(hidden=h, scale=0.5)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), logits


class KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, hidden, scale=1.0):
        return hidden + scale * torch.tanh(self.lin(hidden))


def test_keyword_inputs_are_marked(swap_dir):
    data = helpers.batches(STEPS)
    want = torch_run(KeywordBlocks(), data, STEPS, 1)
    model = KeywordBlocks()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    peak = helpers.watch_fetched_at_once(engine)
    close_losses(helpers.train_strata(engine, model, data, STEPS), want)
    assert max(peak) <= 3, f"up to {max(peak)} of {len(engine.groups)} groups fetched at once"
    engine.close()
    assert "forward" not in model.blocks[0].__dict__, "close() restores the modules' own forward"


class SkippingBlocks(nn.Module):
    """Blocks a step may skip (`skip`, a set of indices): control flow that
    changes the fetch sequence from step to step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(6)])
        self.head = nn.Linear(32, 64)
        self.skip = set()

    def forward(self, x, labels=None):
        h = self.embed(x)
        for i, b in enumerate(self.blocks):
            if i not in self.skip:
                h = h + torch.tanh(b(h))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1)), logits


def test_alternating_control_flow_logs_each_new_fetch_sequence_once(swap_dir, capfd):
    level = os.environ.get("STRATA_LOG_LEVEL", "info").lower()
    if level not in ("trace", "debug", "info"):
        pytest.skip(f"STRATA_LOG_LEVEL={level} hides the info lines this test counts")
    model = SkippingBlocks()
    engine = strata.torch.initialize(model, helpers.config(swap_dir))
    data = iter(helpers.batches(60))

    def steps(patterns, count):
        capfd.readouterr()
        for s in range(count):
            model.skip = patterns[s % len(patterns)]
            b = next(data)
            loss, _ = model(b, labels=b)
            engine.backward(loss)
            engine.step()
        lines = capfd.readouterr().err.splitlines()
        return [line for line in lines if "[info]" in line and "the fetch sequence changed" in line]

    # Every other step skips block 2: two sequences, the second told once.
    told = steps([set(), {2}], 16)
    assert len(told) == 1 and "not seen before (2 different so far)" in told[0]
    # A third sequence is told when it first comes, and nothing more after.
    assert len(steps([set(), {1}], 6)) == 1
    assert steps([set(), {1}, {2}], 9) == []
    # Control flow that keeps changing: told for the first 8 sequences, the
    # last of those lines saying that further changes go to debug level.
    told = steps([{0}, {3}, {4}, {5}, {0, 1}, {1, 2}, {2, 3}, {3, 4}], 8)
    assert len(told) == 5
    assert "further changes are logged at debug level" in told[-1]
    assert "(8 different so far)" in told[-1]
    assert steps([{0}, {3}, {4}, {5}, {0, 1}, {1, 2}, {2, 3}, {3, 4}, set()], 9) == []
    engine.close()
