"""LoRA (low-rank adapters) in plain torch, saved and loaded under PEFT's
names, so that what trains here loads with `peft` and what `peft` saved
loads here.

A target nn.Linear keeps its weight (frozen, under its own name: a
pretrained base loads by its usual names) and gains two children, `lora_A`
(in -> r) and `lora_B` (r -> out, zero at first), whose product is added to
its output scaled by alpha / r: y = W x + (alpha / r) B(A(dropout(x))).
Every other parameter of the model is frozen, as `peft.get_peft_model`
does. Under strata the frozen base holds compute copies only (no master
weights, no moments, never written back) and the adapters train.

    model = build_model()                       # plain torch, or on the meta device
    lora.apply(model, r=16, alpha=32)           # before strata.torch.initialize
    engine = strata.torch.initialize(model, config, weights=base_dir)
    ...train...
    lora.save_adapter(out_dir, model, engine.state_dict(trainable_only=True))
    lora.load_adapter(fresh_model, out_dir)     # plain torch, no strata needed
"""
import json
import math
import os
import re

import torch
from torch import nn

from . import safetensors as st

# The projections of a Llama (attention and MLP), PEFT's usual targets.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's prefix of the adapter's tensor names in adapter_model.safetensors.
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_ATTR = "_strata_lora"
# Set on the adapters' parameters: under strata.torch.initialize(weights=...)
# they keep their own draws when the base's files do not hold them.
OWN_VALUES_ATTR = "_strata_own_values"


class _Adapter:
    """What apply() keeps on a target Linear: its settings and the hook."""

    def __init__(self, r, alpha, dropout, handle):
        self.r = r
        self.alpha = alpha
        self.scale = alpha / r
        self.dropout = dropout
        self.handle = handle


def _add_adapter(module, inputs, output):
    """The forward hook of a target: the base's output plus the adapter's."""
    a = getattr(module, _ATTR)
    x = inputs[0]
    if module.training and a.dropout > 0:
        x = nn.functional.dropout(x, p=a.dropout)
    return output + module.lora_B(module.lora_A(x)) * a.scale


def _matcher(targets):
    """PEFT's rule for target_modules: a string is a regular expression the
    whole module path must match; a list names modules by their path or by a
    dotted suffix of it ("q_proj", "self_attn.q_proj")."""
    if isinstance(targets, str):
        if targets == "all-linear":
            raise ValueError('lora: target_modules "all-linear" is not supported here; list the layers')
        pattern = re.compile(targets)
        return lambda path: pattern.fullmatch(path) is not None
    names = list(targets)
    return lambda path: any(path == t or path.endswith("." + t) for t in names)


def targets_of(model):
    """{module path: module} of the Linears apply() gave adapters."""
    return {n: m for n, m in model.named_modules() if hasattr(m, _ATTR)}


def apply(model, r, alpha=None, targets=DEFAULT_TARGETS, dropout=0.0, freeze=True):
    """Gives every nn.Linear that `targets` names (as PEFT's target_modules:
    names matching a path or its dotted suffix, or one string, a regular
    expression the whole path matches) an adapter of rank r (lora_A drawn as nn.Linear draws its
    weight, lora_B zero, so the model computes as before), on the CPU (or the
    base weight's device when it is not the meta device) in the base weight's
    dtype; with `freeze`, every other parameter stops requiring gradients.
    alpha: the scale's numerator (default 2 r). Returns the targets' paths.
    Raises ValueError for a bad rank, no target found, or a model that has
    adapters already."""
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"lora.apply: r = {r!r}; the rank must be an integer >= 1")
    alpha = 2 * r if alpha is None else alpha
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"lora.apply: alpha = {alpha!r}; it must be a finite number > 0")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.apply: dropout = {dropout!r}; it must be in [0, 1)")
    if targets_of(model):
        raise ValueError("lora.apply: the model has adapters already")
    match = _matcher(targets)
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and match(n)]
    if not found:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"lora.apply: no nn.Linear matches {targets!r} in the model (its Linears: {names})")
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    for _, m in found:
        w = m.weight
        device = "cpu" if w.device.type == "meta" else w.device
        kw = {"device": device, "dtype": w.dtype}
        m.lora_A = nn.Linear(m.in_features, r, bias=False, **kw)
        m.lora_B = nn.Linear(r, m.out_features, bias=False, **kw)
        with torch.no_grad():
            m.lora_B.weight.zero_()
        for p in (m.lora_A.weight, m.lora_B.weight):
            setattr(p, OWN_VALUES_ATTR, True)
        handle = m.register_forward_hook(_add_adapter)
        setattr(m, _ATTR, _Adapter(r, float(alpha), float(dropout), handle))
    return [n for n, _ in found]


def config_of(model, base_model_name_or_path=None):
    """PEFT's adapter_config.json for the model's adapters (one rank and
    alpha for all, as apply() gives them)."""
    found = targets_of(model)
    if not found:
        raise ValueError("lora: the model has no adapters (lora.apply first)")
    a = getattr(next(iter(found.values())), _ATTR)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": a.r,
        "lora_alpha": a.alpha,
        "lora_dropout": a.dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in found}),  # each a path's last part
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def adapter_state_dict(model, weights=None):
    """{PEFT name: tensor} of the adapters: from `weights` (a state dict under
    the model's names, e.g. engine.state_dict(trainable_only=True)), else
    from the model's own parameters (plain torch)."""
    found = targets_of(model)
    if not found:
        raise ValueError("lora: the model has no adapters (lora.apply first)")
    out = {}
    for path, m in found.items():
        for part in ("lora_A", "lora_B"):
            name = f"{path}.{part}.weight"
            if weights is not None:
                if name not in weights:
                    raise KeyError(f"lora: {name} is not in the weights given")
                t = weights[name]
            else:
                t = getattr(m, part).weight
            out[PEFT_PREFIX + name] = t.detach().to("cpu").contiguous()
    return out


def save_adapter(directory, model, weights=None, dtype=None, base_model_name_or_path=None):
    """Writes the adapters as PEFT does: directory/adapter_model.safetensors
    (base_model.model.<path>.lora_A.weight, ...) and adapter_config.json.
    weights: as adapter_state_dict takes; dtype: convert to it (default: as
    given)."""
    tensors = adapter_state_dict(model, weights)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    os.makedirs(directory, exist_ok=True)
    st.save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config_of(model, base_model_name_or_path), f, indent=2)
        f.write("\n")


def load_adapter(model, directory):
    """Gives `model` (plain torch, its base weights in place) the adapters
    saved in `directory` (by save_adapter or by peft): apply() with the
    config's rank, alpha, dropout and targets, then the saved values. Returns
    the targets' paths. Raises ValueError for a config this module cannot
    honour (another PEFT type, bias adapters, per-module ranks, DoRA), KeyError
    for a tensor missing or left over."""
    with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"lora.load_adapter: {directory}: peft_type {cfg.get('peft_type')!r}, not LORA")
    for key, plain in (("bias", "none"), ("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, plain) != plain:
            raise ValueError(f"lora.load_adapter: {directory}: {key} = {cfg[key]!r} is not supported here")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"lora.load_adapter: {directory}: per-module ranks or alphas are not supported here")
    targets = cfg["target_modules"]  # a regex (str) or names, as PEFT reads them
    paths = apply(model, int(cfg["r"]), float(cfg["lora_alpha"]), targets, float(cfg.get("lora_dropout", 0.0)),
                  freeze=False)
    saved = st.load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    mods = targets_of(model)
    with torch.no_grad():
        for path in paths:
            for part in ("lora_A", "lora_B"):
                name = f"{PEFT_PREFIX}{path}.{part}.weight"
                if name not in saved:
                    raise KeyError(f"lora.load_adapter: {directory}: no tensor {name}")
                w = getattr(mods[path], part).weight
                w.copy_(saved.pop(name).to(w.dtype))
    if saved:
        raise KeyError(f"lora.load_adapter: {directory}: tensors for no adapter of this model: {sorted(saved)[:4]}")
    return paths


def merged_state_dict(model, weights):
    """`weights` (the model's state dict, adapters included: e.g.
    engine.state_dict()) with each adapter folded into its base weight,
    W + (alpha / r) B A computed in fp32 and stored in W's dtype, and the
    adapters' tensors left out: a plain model of the base's architecture
    loads it."""
    out = dict(weights)
    for path, m in targets_of(model).items():
        a = getattr(m, _ATTR)
        A = out.pop(f"{path}.lora_A.weight").float()
        B = out.pop(f"{path}.lora_B.weight").float()
        w = out[f"{path}.weight"]
        out[f"{path}.weight"] = (w.float() + a.scale * (B @ A)).to(w.dtype)
    return out
