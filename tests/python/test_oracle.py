"""torch's own AdamW as the oracle: the same Llama model, data and
hyperparameters in fp32 (20 steps, clipping that fires, 2 micro-batches per
step), trained with torch.optim.AdamW + clip_grad_norm_ and through strata in
five placements; and bf16 runs bit-identical across placements. Adam's
moments stored as bf16 or 8-bit blockwise (strata.optimizer_state) against
torch AdamW with its moments stored alike after each step."""
import pytest
import torch

import helpers
import strata.torch

STEPS, GAS, CLIP, LR, WD = 20, 2, 0.5, 3e-3, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8


@pytest.fixture(scope="module")
def oracle():
    """Losses per step, clipping events and final weights of plain PyTorch."""
    model = helpers.tiny_llama(seed=0)
    losses, clipped = helpers.train_torch(model, helpers.batches(STEPS * GAS), STEPS, GAS, lr=LR, weight_decay=WD,
                                          clip=CLIP, betas=BETAS, eps=EPS)
    return losses, clipped, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", list(helpers.PLACEMENTS))
def test_fp32_matches_torch_adamw(oracle, placement, swap_dir):
    want_losses, clipped, want = oracle
    assert clipped >= STEPS // 2, "the clipping threshold must fire for the test to mean anything"
    assert want_losses[-1] < 0.9 * want_losses[0], "the model must learn for the test to mean anything"
    model = helpers.tiny_llama(seed=0)
    cfg = helpers.config(swap_dir, placement, "fp32", gas=GAS, clip=CLIP, lr=LR, weight_decay=WD, betas=BETAS,
                         eps=EPS)
    engine = strata.torch.initialize(model, cfg)
    norms = []
    losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS,
                                  on_step=lambda s, st: norms.append(st.grad_norm))
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(exp, rel=1e-5), f"step {step + 1}: loss {got} vs torch {exp}"
    got_w = engine.state_dict()
    for name, w in want.items():
        # Tolerance: strata's AdamW (DeepSpeed's formula order) and torch's round
        # differently in the last bits; 20 steps of Adam amplify that to ~1e-6.
        torch.testing.assert_close(got_w[name], w, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    assert sum(n > CLIP for n in norms) == clipped
    engine.close()


@pytest.mark.parametrize("state", [{"format": "fp32"}, {"format": "bf16"},
                                   {"format": "bf16", "rounding": "stochastic"}, {"format": "int8_blockwise"}],
                         ids=["fp32_moments", "bf16_moments", "bf16_moments_stochastic", "int8_moments"])
def test_bf16_bit_identical_across_placements(tmp_path, state):
    results = {}
    for placement in helpers.PLACEMENTS:
        swap = tmp_path / placement
        swap.mkdir()
        model = helpers.tiny_llama(seed=0)
        cfg = helpers.config(str(swap), placement, "bf16", gas=GAS, clip=CLIP, lr=LR, weight_decay=WD,
                             optimizer_state=state)
        engine = strata.torch.initialize(model, cfg)
        losses = helpers.train_strata(engine, model, helpers.batches(10 * GAS), 10, GAS)
        results[placement] = (losses, engine.state_dict())
        engine.close()
    base_losses, base_w = results["optimizer_device"]
    assert base_losses[-1] < base_losses[0]
    for placement, (losses, w) in results.items():
        assert losses == base_losses, placement
        helpers.assert_same_bits(w, base_w, placement)


@pytest.fixture(scope="module", params=["bf16", "int8_blockwise"])
def oracle_stored_moments(request):
    """torch's AdamW with its moments stored as strata's format stores them
    (rounded to bf16, or quantized per block of 256) after every step."""
    model = helpers.tiny_llama(seed=0)
    losses, clipped = helpers.train_torch(model, helpers.batches(STEPS * GAS), STEPS, GAS, lr=LR, weight_decay=WD,
                                          clip=CLIP, betas=BETAS, eps=EPS, moments=request.param)
    return request.param, losses, clipped, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", ["optimizer_device", "optimizer_cpu", "optimizer_nvme"])
def test_stored_moments_match_torch_adamw_with_its_moments_stored_alike(oracle, oracle_stored_moments, placement,
                                                                        swap_dir):
    """strata.optimizer_state bf16 (int8_blockwise) against torch AdamW whose
    moments are cast to bf16 and back (quantized per block of 256 with
    strata's code tables, helpers.quantize_int8_blockwise) after each step:
    the same rounding of the same moments.
    The two AdamW formulas differ in their last bits (see the fp32 test), and
    a moment that lands near a bf16 rounding midpoint then rounds the other way
    in one of them (a relative step of 2^-8 in that element's update): a few
    elements part by ~lr/256 a step, and the model spreads that. So the
    bounds: losses within 1e-4, the mean distance of the weights to the cast
    oracle under 1/8 of the cast oracle's own distance to the uncast one
    (measured: 1/16 after 20 steps, 1/140 after 10), and the worst element
    nearer to the cast oracle than the uncast oracle is."""
    state_format, want_losses, _, want = oracle_stored_moments
    fp32_losses, _, fp32_w = oracle
    model = helpers.tiny_llama(seed=0)
    cfg = helpers.config(swap_dir, placement, "fp32", gas=GAS, clip=CLIP, lr=LR, weight_decay=WD, betas=BETAS,
                         eps=EPS, optimizer_state={"format": state_format})
    engine = strata.torch.initialize(model, cfg)
    losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS)
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(exp, rel=1e-4), f"step {step + 1}: loss {got} vs torch {exp}"
    got_w = engine.state_dict()
    count = sum(w.numel() for w in want.values())

    def mean_distance(a):
        return float(sum((a[n] - w).abs().sum() for n, w in want.items())) / count

    def worst_distance(a):
        return max(float((a[n] - w).abs().max()) for n, w in want.items())

    assert mean_distance(fp32_w) > 0, "casting the moments must change torch's run for the test to mean anything"
    assert mean_distance(got_w) < mean_distance(fp32_w) / 8, (mean_distance(got_w), mean_distance(fp32_w))
    assert worst_distance(got_w) < worst_distance(fp32_w), (worst_distance(got_w), worst_distance(fp32_w))
    engine.close()


def test_stochastically_rounded_bf16_moments_track_torch_adamw(oracle, swap_dir):
    """Stochastic rounding has no torch counterpart: its losses stay within
    1% of torch's fp32 AdamW at every step and its weights near torch's."""
    want_losses, _, want = oracle
    model = helpers.tiny_llama(seed=0)
    cfg = helpers.config(swap_dir, "optimizer_cpu", "fp32", gas=GAS, clip=CLIP, lr=LR, weight_decay=WD, betas=BETAS,
                         eps=EPS, optimizer_state={"format": "bf16", "rounding": "stochastic"})
    engine = strata.torch.initialize(model, cfg)
    losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS)
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(exp, rel=1e-2), f"step {step + 1}: loss {got} vs torch {exp}"
    got_w = engine.state_dict()
    for name, w in want.items():
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=1e-2, msg=lambda m: f"{name}: {m}")
    engine.close()


@pytest.mark.parametrize("overlap", ["none", "exact", "speculative"])
def test_a_step_ended_short_is_torchs_step_over_its_micro_batches(overlap, swap_dir):
    # step(partial=True): an epoch's last step of one micro-batch of three, its loss scaled
    # by 3 / 1, is torch's step over that micro-batch alone (its mean: loss / 1); the steps
    # around it take all three. The embeddings of tokens only the missing micro-batches would
    # have seen are updated by weight decay, as torch's (their gradients are zero, not absent).
    # ("delayed" computes each step with the weights of the step before last: not torch's.)
    gas, steps = 3, 5
    data = helpers.batches(steps * gas)
    windows = [gas, gas, 1, gas, 2]  # micro-batches per step
    torch_model = helpers.tiny_llama(seed=0)
    opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    it = iter(data)
    want_norms = []
    for k in windows:
        opt.zero_grad()
        for _ in range(k):
            b = next(it)
            loss, _ = torch_model(b, labels=b)
            (loss / k).backward()
        want_norms.append(torch.nn.utils.clip_grad_norm_(torch_model.parameters(), CLIP).item())
        opt.step()
    model = helpers.tiny_llama(seed=0)
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "optimizer_cpu", "fp32", gas=gas, clip=CLIP,
                                                           lr=LR, weight_decay=WD, betas=BETAS, eps=EPS,
                                                           overlap=overlap))
    it = iter(data)
    norms = []
    for k in windows:
        for i in range(k):
            b = next(it)
            loss, _ = model(b, labels=b)
            engine.backward(loss * (gas / k))
            stats = engine.step(partial=i + 1 == k)
        assert stats is not None
        norms.append(stats.grad_norm)
    assert norms == pytest.approx(want_norms, rel=1e-5)
    got = engine.state_dict()
    for name, w in torch_model.named_parameters():
        torch.testing.assert_close(got[name], w.detach(), rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    # A step with no backward in it cannot be ended short.
    with pytest.raises(strata.FailedPrecondition, match="no backward in the step"):
        engine.step(partial=True)
    engine.close()
