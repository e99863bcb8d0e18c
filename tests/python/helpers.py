"""Configs, models and data shared by the Python tests."""
import torch

import llama

# Where each state lives: (offload_optimizer.device, offload_param.device).
PLACEMENTS = {
    "optimizer_device": ("none", "none"),
    "optimizer_cpu": ("cpu", "none"),
    "optimizer_nvme": ("nvme", "none"),
    "params_cpu": ("cpu", "cpu"),
    "params_nvme": ("nvme", "nvme"),
}


def config(swap_dir, placement="optimizer_cpu", precision="fp32", gas=1, clip=0.0, lr=1e-3, weight_decay=0.01,
           micro=4, betas=(0.9, 0.999), eps=1e-8, scheduler=None, **strata_keys):
    opt_dev, param_dev = PLACEMENTS[placement]
    zero = {"stage": 3}
    if opt_dev != "none":
        zero["offload_optimizer"] = {"device": opt_dev}
    if param_dev != "none":
        zero["offload_param"] = {"device": param_dev}
    c = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                   "weight_decay": weight_decay}},
        "zero_optimization": zero,
        "strata": {"device": "host", "seed": 1, "chunk_bytes": 262144,
                   "io": {"backend": "auto", "paths": [swap_dir]}},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    elif precision == "fp16":
        c["fp16"] = {"enabled": True}
    if scheduler:
        c["scheduler"] = scheduler
    c["strata"].update(strata_keys)
    return c


def tiny_llama(seed=0, tie=False, layers=2, **kw):
    torch.manual_seed(seed)
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, **kw)
    return llama.LlamaForCausalLM(cfg)


def batches(count, micro=4, seq=12, vocab=64, seed=123):
    """Learnable sequences: each row counts up from a random start by a random
    stride (mod vocab), so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    pos = torch.arange(seq)
    for _ in range(count):
        start = torch.randint(0, vocab, (micro, 1), generator=g)
        stride = torch.randint(1, 4, (micro, 1), generator=g)
        out.append((start + stride * pos) % vocab)
    return out


def _dynamic_tree(width):
    """strata's 8-bit code table (core/numerics.h): the values of the codes
    of a `width`-bit magnitude field and the thresholds between them, both
    computed in double and rounded to float32, the last threshold +inf."""
    values = [0.0]
    for r in range(1, 1 << width):
        z = width - r.bit_length()
        k = width - 1 - z
        f = r & ((1 << k) - 1)
        values.append([1.0, 0.1, 0.01, 0.001, 0.0001, 0.00001, 0.000001, 0.0000001][z] * (0.1 + 0.9 * (f + 1) / (1 << k)))
    v32 = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    wide = v32.to(torch.float64)
    mids = ((wide[:-1] + wide[1:]) / 2).to(torch.float32)
    return v32, torch.cat([mids, torch.tensor([float("inf")])])


def quantize_int8_blockwise(x, signed):
    """x (a moment, any shape) as strata's int8_blockwise format stores it,
    read back as float32: per block of 256 consecutive elements, the codes of
    |x| / absmax (the number of thresholds below it), dequantized with the
    block's absmax."""
    values, thresholds = _dynamic_tree(7 if signed else 8)
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = -(-n // 256)
    padded = torch.zeros(blocks * 256, dtype=torch.float32)
    padded[:n] = flat
    padded = padded.view(blocks, 256)
    a = padded.abs()
    absmax = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a).amax(dim=1, keepdim=True)
    scale = torch.where(torch.isfinite(absmax), absmax, torch.full_like(absmax, float("nan")))
    usable = torch.isfinite(scale) & (scale > 0)
    xn = torch.where(usable, a / torch.where(usable, scale, torch.ones_like(scale)), torch.zeros_like(a))
    r = torch.searchsorted(thresholds, xn.contiguous(), right=False)  # thresholds below xn
    r = torch.where(usable, r, torch.zeros_like(r))
    out = values[r] * scale
    if signed:
        out = torch.where((padded < 0) & (r > 0), -out, out)
    return out.reshape(-1)[:n].reshape(x.shape)


def train_torch(model, data, steps, gas=1, lr=1e-3, weight_decay=0.01, clip=0.0, betas=(0.9, 0.999), eps=1e-8,
                params=None, moments="fp32"):
    """The oracle: plain PyTorch with torch.optim.AdamW (and clip_grad_norm_
    when clip > 0), `steps` steps of `gas` micro-batches from `data`. With
    moments "bf16" or "int8_blockwise", after each step the moments are
    stored as strata stores them (bf16: rounded to nearest even, torch's cast;
    int8: quantize_int8_blockwise) and kept as fp32 holding those values: what
    the next step reads is what strata's moments hold. Returns the mean loss
    of each step and how many steps clipping fired."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses, clipped = [], 0
    it = iter(data)
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for _ in range(gas):
            b = next(it)
            loss, _ = model(b, labels=b)
            (loss / gas).backward()
            total += loss.item()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            clipped += int(norm.item() > clip)
        opt.step()
        if moments != "fp32":
            for state in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if moments == "bf16":
                        state[key].copy_(state[key].to(torch.bfloat16).float())
                    else:
                        state[key].copy_(quantize_int8_blockwise(state[key], signed=key == "exp_avg"))
        losses.append(total / gas)
    return losses, clipped


def train_strata(engine, model, data, steps, gas=1, on_step=None):
    """Runs `steps` steps of `gas` micro-batches from `data`; returns the mean
    loss of each step."""
    losses = []
    it = iter(data)
    for s in range(steps):
        total = 0.0
        for _ in range(gas):
            b = next(it)
            loss, _ = model(b, labels=b)
            engine.backward(loss)
            total += loss.item()
        stats = engine.step()
        assert stats is not None
        losses.append(total / gas)
        if on_step:
            on_step(s, stats)
    return losses


def train_hf(engine, model, data):
    """One step per batch of `data` for a Hugging Face causal LM (its loss from
    labels); returns the losses."""
    losses = []
    for b in data:
        loss = model(input_ids=b, labels=b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_same_bits(a, b, what=""):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |diff| {(a[k] - b[k]).abs().max().item()})"


def watch_fetches(engine):
    """The names of the groups an adapter engine fetches from now on, in order."""
    fetches = []
    fetch = engine.engine.fetch
    engine.engine.fetch = lambda group, stream=None: fetches.append(group) or fetch(group, stream)
    return fetches


def watch_fetched_at_once(engine):
    """After each acquisition from now on, how many groups are fetched."""
    counts = []
    acquire = engine._acquire

    def counting(g):
        acquire(g)
        counts.append(sum(x.flat is not None for x in engine._group_list))
    engine._acquire = counting
    return counts
