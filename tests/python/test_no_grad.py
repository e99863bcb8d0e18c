"""A parameter without a gradient in a step, against torch.optim.AdamW, which
skips a parameter whose grad is None: it keeps its weights, its moments and
its step count (its bias correction counts only the steps that updated it).
strata.no_grad "skip" (the default) does the same; "zero" updates it with a
zero gradient (its moments decay, weight decay applies), as DeepSpeed does.

The model has a branch used every other step (a module of its own, so a
whole fetch group gets no gradient) and, in a module whose other parameter
always trains, a parameter used in even steps and in the first micro-batch of
step 4 (a step with a gradient in one micro-batch of two is not skipped)."""
import pytest
import torch

import helpers
import strata.torch

STEPS, GAS, LR, WD = 9, 2, 1e-2, 0.1


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.u = torch.nn.Parameter(torch.randn(16, 16) * 0.2)
        self.v = torch.nn.Parameter(torch.randn(16, 16) * 0.2)

    def forward(self, h, use_v):
        h = h + torch.tanh(h @ self.u)
        return h + torch.tanh(h @ self.v) if use_v else h


class Branchy(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(8, 16)
        self.mixed = Mixed()
        self.branch = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x, step, micro):
        h = torch.tanh(self.inp(x))
        h = self.mixed(h, use_v=step % 2 == 0 or (step == 3 and micro == 0))
        if step % 2 == 0:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS * GAS)]


def loss_of(model, batch, step, micro, dtype=torch.float32):
    x, y = batch
    return ((model(x.to(dtype), step, micro).float() - y) ** 2).mean()


def train_torch(clip=0.0):
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    batches = iter(data())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)  # grads None: a parameter the step does not use is skipped
        for micro in range(GAS):
            (loss_of(model, next(batches), step, micro) / GAS).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_strata(swap_dir, placement, no_grad, watch=None, precision="fp32", steps=(0, STEPS), save=None,
                 load=None, clip=0.0, **strata_keys):
    """Steps [steps[0], steps[1]); `load`: a checkpoint to start from, `save`: (step, path), a
    checkpoint written after that many steps (the run goes on)."""
    model = Branchy()
    cfg = helpers.config(swap_dir, placement, precision, gas=GAS, lr=LR, weight_decay=WD, clip=clip, no_grad=no_grad,
                         **strata_keys)
    engine = strata.torch.initialize(model, cfg, blocks=[model.inp, model.mixed, model.branch, model.out])
    if load:
        engine.load_checkpoint(load)
    batches = iter(data()[steps[0] * GAS:])
    for step in range(*steps):
        for micro in range(GAS):
            engine.backward(loss_of(model, next(batches), step, micro,
                                    torch.bfloat16 if precision == "bf16" else torch.float32))
        before = engine.state_dict() if watch is not None else None
        engine.step()
        if watch is not None:
            watch(step, before, engine.state_dict())
        if save and step + 1 == save[0]:
            engine.save_checkpoint(save[1])
    got = engine.state_dict()
    engine.close()
    return got


@pytest.fixture(scope="module")
def oracle():
    return train_torch()


@pytest.mark.parametrize("placement", ["optimizer_device", "optimizer_cpu", "params_nvme"])
def test_skipped_as_torch_adamw_skips_a_parameter_without_grad(oracle, placement, swap_dir):
    left = []

    def watch(step, before, after):
        if step % 2 == 1:  # no gradient in the step: left exactly as it was
            names = ("branch.weight", "branch.bias") + (("mixed.v",) if step != 3 else ())
            for name in names:
                assert torch.equal(after[name], before[name]), f"step {step + 1}: {name} changed"
            left.append(step)
            if step == 3:  # a gradient in one micro-batch of two: updated
                assert not torch.equal(after["mixed.v"], before["mixed.v"])

    got = train_strata(swap_dir, placement, "skip", watch)
    assert left == list(range(1, STEPS, 2))
    for name, w in oracle.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_zero_updates_it_with_a_zero_gradient(oracle, swap_dir):
    got = train_strata(swap_dir, "optimizer_cpu", "zero")
    # The parameters a step skips do not follow torch's: their moments decayed and weight
    # decay applied in the steps without a gradient.
    for name in ("branch.weight", "mixed.v"):
        assert not torch.allclose(got[name], oracle[name], rtol=1e-3, atol=1e-4), name
    skip = train_strata(swap_dir, "optimizer_cpu", "skip")
    assert not torch.equal(skip["branch.weight"], got["branch.weight"])


def test_bf16_skips_alike_in_every_placement(swap_dir):
    # The skipped parameters' new compute copies are their masters' (rounded on the host, or by the
    # device's conversion): every placement gives the same bits.
    runs = {p: train_strata(swap_dir, p, "skip", precision="bf16")
            for p in ("optimizer_device", "optimizer_cpu", "params_nvme")}
    first = runs["optimizer_device"]
    for p, got in runs.items():
        helpers.assert_same_bits(got, first, f"bf16 {p} vs optimizer_device")


@pytest.mark.parametrize("overlap", ["exact", "delayed"])
def test_a_resumed_run_keeps_each_parameters_step_count(tmp_path, swap_dir, overlap):
    # Four steps (the branch skipped in two: its own count is 2), saved, loaded into a new engine
    # and trained on: the same bits as the run that never stopped (the branch's bias correction
    # at step 5 counts 3 steps, not 5). Under "delayed" the job takes its own verdict (and a save
    # applies the update it holds: the run that saved goes on from there as the resumed one does).
    ck = str(tmp_path / "ck")
    whole = train_strata(swap_dir, "optimizer_cpu", "skip", save=(4, ck), clip=0.05, overlap=overlap)
    resumed = train_strata(swap_dir, "optimizer_cpu", "skip", steps=(4, STEPS), load=ck, clip=0.05, overlap=overlap)
    helpers.assert_same_bits(resumed, whole, "resumed vs uninterrupted")


@pytest.mark.parametrize("overlap", ["none", "speculative"])
def test_every_schedule_with_clipping_skips_as_torch_does(overlap, swap_dir):
    # The state on nvme, clipping that fires: the skipped parameters' later updates take their
    # own step counts from constants made where the schedule makes them (step_end, an early job;
    # "delayed" applies each update a step late, so torch is no oracle for it: the resumed run
    # below holds it to itself).
    want = train_torch(clip=0.05)
    got = train_strata(swap_dir, "optimizer_nvme", "skip", clip=0.05, overlap=overlap)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{overlap} {name}: {m}")


def test_a_step_ended_short_skips_what_its_micro_batches_did_not_use(swap_dir):
    # step(partial=True) after one micro-batch of two: the empty one gives no parameter a
    # gradient, so a step is skipped for a parameter only where its one real micro-batch did not
    # use it (mixed.v in step 5: skipped; in step 3 its micro-batch 0 used it: updated), as
    # torch's AdamW over that micro-batch alone skips a None grad. Loss x 2 / 1: the mean of one.
    windows = [2, 2, 2, 1, 2, 1, 2, 2, 2]
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    batches = iter(data())
    for step, k in enumerate(windows):
        opt.zero_grad(set_to_none=True)
        for micro in range(k):
            (loss_of(model, next(batches), step, micro) / k).backward()
        opt.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = Branchy()
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "optimizer_cpu", "fp32", gas=GAS, lr=LR,
                                                           weight_decay=WD, no_grad="skip"),
                                     blocks=[model.inp, model.mixed, model.branch, model.out])
    batches = iter(data())
    for step, k in enumerate(windows):
        before = engine.state_dict()
        for micro in range(k):
            engine.backward(loss_of(model, next(batches), step, micro) * (GAS / k))
        assert engine.step(partial=True) is not None
        after = engine.state_dict()
        if step == 5:
            for name in ("mixed.v", "branch.weight", "branch.bias"):
                assert torch.equal(after[name], before[name]), f"step {step + 1}: {name} changed"
        if step == 3:
            assert not torch.equal(after["mixed.v"], before["mixed.v"])
    got = engine.state_dict()
    engine.close()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
