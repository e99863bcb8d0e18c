"""Lion and Adagrad against torch: torch.optim.Adagrad, and Lion written from
its paper's update in a few lines of torch, as the oracles. The same Llama
model, data and hyperparameters in fp32 (20 steps, clipping that fires, 2
micro-batches per step) through strata in five placements (the optimizer on
the device, in pinned memory, on nvme; the compute copies too); and bf16 runs
bit-identical across placements."""
import pytest
import torch

import helpers
import strata.torch

STEPS, GAS, CLIP = 20, 2, 0.5
PLACEMENTS = list(helpers.PLACEMENTS)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Program 1) with decoupled weight decay, as its
    torch implementations write it."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_((m * b1 + p.grad * (1 - b1)).sign_(), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


OPTIMIZERS = {
    # name: (strata's optimizer section, torch's optimizer for the parameters)
    "Lion": ({"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01}},
             lambda params: Lion(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)),
    "Adagrad": ({"type": "Adagrad", "params": {"lr": 3e-2, "eps": 1e-10, "weight_decay": 0.01}},
                lambda params: torch.optim.Adagrad(params, lr=3e-2, eps=1e-10, weight_decay=0.01)),
}


def train_torch(model, make_optimizer):
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses, clipped = [], 0
    it = iter(helpers.batches(STEPS * GAS))
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for _ in range(GAS):
            b = next(it)
            loss, _ = model(b, labels=b)
            (loss / GAS).backward()
            total += loss.item()
        clipped += int(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item() > CLIP)
        opt.step()
        losses.append(total / GAS)
    return losses, clipped


def config(swap_dir, placement, precision, name):
    cfg = helpers.config(swap_dir, placement, precision, gas=GAS, clip=CLIP)
    cfg["optimizer"] = OPTIMIZERS[name][0]
    return cfg


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def oracle(request):
    model = helpers.tiny_llama(seed=0)
    losses, clipped = train_torch(model, OPTIMIZERS[request.param][1])
    return request.param, losses, clipped, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_fp32_matches_torch(oracle, placement, swap_dir):
    name, want_losses, clipped, want = oracle
    assert clipped >= STEPS // 2, "the clipping threshold must fire for the test to mean anything"
    assert want_losses[-1] < 0.95 * want_losses[0], f"{name}: the model must learn for the test to mean anything"
    model = helpers.tiny_llama(seed=0)
    engine = strata.torch.initialize(model, config(swap_dir, placement, "fp32", name))
    losses = helpers.train_strata(engine, model, helpers.batches(STEPS * GAS), STEPS, GAS)
    for step, (got, exp) in enumerate(zip(losses, want_losses)):
        assert got == pytest.approx(exp, rel=1e-5), f"{name}, step {step + 1}: loss {got} vs torch {exp}"
    got_w = engine.state_dict()
    off, total = 0, 0
    for n, w in want.items():
        if name == "Adagrad":
            torch.testing.assert_close(got_w[n], w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {n}: {m}")
            continue
        # Lion's sign() turns a last-bit difference of an interpolation near 0
        # into a step of lr the other way: such elements differ by a few lr,
        # and they are few; the rest agree as Adagrad's do.
        diff = (got_w[n] - w).abs()
        assert diff.max().item() <= 2 * 1e-3 * STEPS, f"{name} {n}: {diff.max().item()}"
        off += int((diff > 1e-5 + 1e-4 * w.abs()).sum())
        total += w.numel()
    assert off <= total // 100, f"{name}: {off} of {total} elements differ from torch's"
    engine.close()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_bit_identical_across_placements(name, tmp_path):
    results = {}
    for placement in PLACEMENTS:
        swap = tmp_path / placement
        swap.mkdir()
        model = helpers.tiny_llama(seed=0)
        engine = strata.torch.initialize(model, config(str(swap), placement, "bf16", name))
        losses = helpers.train_strata(engine, model, helpers.batches(8 * GAS), 8, GAS)
        results[placement] = (losses, engine.state_dict())
        engine.close()
    base_losses, base_w = results[PLACEMENTS[0]]
    assert base_losses[-1] < base_losses[0]
    for placement, (losses, w) in results.items():
        assert losses == base_losses, placement
        helpers.assert_same_bits(w, base_w, placement)
