"""The PyTorch adapter (its contract: docs/python.md).

How it works, in one place:
- Every parameter of the module is registered with the engine under its name
  in `named_parameters()`; the Parameter objects stay (only `.data` changes):
  a view of the fetched group while it is fetched, else a placeholder of the
  right shape, dtype and device that holds no memory and raises NotFetched
  (naming the parameter and its group) when an operation reads it.
- Fetch groups: one per repeated block (the children of every ModuleList, or
  the `blocks` given), the other parameters grouped by the module that owns
  them. A "unit" is a module whose forward needs some groups: each block, and
  each module outside the blocks that owns parameters (a tied parameter makes
  its user fetch the owner's group too).
- Forward: a unit's pre-hook acquires its groups (fetch on the first
  acquire: fetches are counted), its post-hook releases them. With grad
  enabled the unit's outputs pass through _PreBackward (its backward acquires
  the groups again before the unit's backward runs) and its inputs through
  _PostBackward (its backward fires after the unit's backward: release).
- Gradients: a post-hook on each trainable parameter's AccumulateGrad node
  moves `p.grad` into the group's gradient buffer (adding when it arrives
  twice in a micro-step) and clears it. A group's gradients are handed to the
  engine when every grad-enabled forward call of the units using it has had
  its backward; what is left is handed over when `backward` ends (groups
  whose inputs did not need gradients, groups that got none: zeros).
- The engine owns accumulation, clipping, loss scaling and the optimizer:
  `backward` scales the loss (fp16), `step` is `step_end` once every
  micro-batch of the step is in.
- Outside the step: gathered() fetches every group and, at its end, checks
  that no parameter was written (a write cannot reach the master weights;
  ParameterWritten). copy.deepcopy of the model gives plain modules: the
  hooks deep-copy to inert ones, a parameter that is not fetched to a plain
  one holding its compute copy.
"""
import ctypes
import io
import os
import random
import weakref

import torch
import torch.utils.dlpack

from .. import engine as _engine
from .. import errors
from .fetch import Fetching
from .gradients import Gradients
from .hooks import Hooks
from .placeholders import (_NAMES_ATTR, Placeholders, _as_internal, _guard_class, _guard_classes,
                           _owner_of_param)
from .records import _Group, _Param, _Unit

_TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _default_blocks(model):
    """(name, module) of every child of every outermost ModuleList that owns parameters."""
    blocks = []

    def visit(module, prefix):
        for name, child in module.named_children():
            full = prefix + name
            if isinstance(child, torch.nn.ModuleList):
                for i, b in enumerate(child):
                    if any(True for _ in b.parameters()):
                        blocks.append((f"{full}.{i}", b))
            else:
                visit(child, full + ".")

    visit(model, "")
    return blocks


class Engine(Hooks, Fetching, Gradients, Placeholders):
    """A PyTorch module trained through strata. Made by initialize()."""

    def __init__(self, model, config, *, blocks=None, param_groups=None, weights=None, weights_prefix="",
                 name_prefix="", copy_views=False, total_num_steps=None, hidden_size=None, strict=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.torch: model must be a torch.nn.Module, not {type(model).__name__}")
        self.module = model
        text = _engine._config_text(config)  # a path is read once
        known = dict(total_num_steps=total_num_steps, hidden_size=hidden_size, strict=strict)
        self.config = _engine.config_resolve(text, **known)
        self._engine = _engine.Engine(text, **known)
        self._closed = False
        self._hooks = []
        self._units = []
        self._resident_depth = 0
        # DLPack views of the engine's buffers (zero-copy); False: the *_host copies.
        self._zero_copy = not copy_views
        self._copy_views = copy_views
        self._saving = None          # the saved-tensor hooks context while a forward runs (see _pack)
        self._root_saving = False    # the model's own forward turned it on
        self._by_storage = {}        # storage address of a fetched group's buffer -> the group
        self._recomputing = []       # units whose forward runs inside the backward (recomputation)
        self._failed = None          # why a backward failed part-way (the step cannot be completed)
        self._fingerprint_weights = None  # see _fingerprints
        self._in_backward = False
        self._micro = 0
        self.adapter_seconds = 0.0  # the adapter's own time since the last step() (see records._timed)
        self.gradient_accumulation_steps = int(self.config.get("gradient_accumulation_steps", 1))
        try:
            self._setup(model, blocks, param_groups, weights, weights_prefix, name_prefix)
        except BaseException:
            self.close()
            raise

    # --- set-up ---------------------------------------------------------------------------------
    def _setup(self, model, blocks, param_groups, weights, weights_prefix, name_prefix):
        e = self._engine
        names = {id(m): n for n, m in model.named_modules()}
        if blocks is None:
            block_list = _default_blocks(model)
        else:
            block_list = []
            for b in blocks:
                if id(b) not in names:
                    raise ValueError("strata.torch: a module in `blocks` is not part of the model")
                block_list.append((names[id(b)], b))
        block_modules = dict(block_list)

        def block_of(module_name):
            parts = module_name.split(".") if module_name else []
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in block_modules:
                    return prefix
            return None

        # Parameters, in named_parameters() order (the first name of a tied parameter).
        self._params = {}        # id(p) -> _Param
        order = []
        for n, p in model.named_parameters(remove_duplicate=False) if _has_remove_duplicate() else \
                _named_parameters_all(model):
            if id(p) in self._params:
                self._params[id(p)].aliases.append(n)
                continue
            rec = _Param(n, p)
            self._params[id(p)] = rec
            order.append(rec)
        if not order:
            raise ValueError("strata.torch: the model has no parameters")
        for rec in order:
            if id(rec.p) in _owner_of_param or type(rec.p) in _guard_classes.values():
                raise ValueError(f"strata.torch: parameter '{rec.name}' belongs to another strata engine already "
                                 f"(its values are the engine's); build a new model, or take the weights with "
                                 f"engine.state_dict() before closing it")
        for n, b in model.named_buffers():
            if b.device.type == "meta":
                raise ValueError(f"strata.torch: buffer '{n}' is on the meta device; build buffers on a real "
                                 f"device (strata.torch.meta_init() puts only parameters on meta)")

        # Groups: owner module of each parameter (first in named_modules order).
        self._groups = {}
        units = {}               # id(module) -> _Unit
        for mname, module in model.named_modules():
            b = block_of(mname)
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                rec = self._params[id(p)]
                if rec.group is None:
                    gname = b if b is not None else (mname or "<root>")
                    g = self._groups.setdefault(gname, _Group(gname))
                    rec.group = g
                    g.params.append(rec)
                unit_module = block_modules[b] if b is not None else module
                unit_name = b if b is not None else (mname or "<root>")
                unit = units.get(id(unit_module))
                if unit is None:
                    unit = units[id(unit_module)] = _Unit(unit_module, unit_name, self)
                if rec.group not in unit.groups:
                    unit.groups.append(rec.group)
        self._units = list(units.values())
        self._group_list = list(self._groups.values())

        # Optimizer groups (torch-style parameter groups).
        opt_of = {}
        base_lr = float(self.config.get("optimizer", {}).get("params", {}).get("lr", 0.0) or 0.0)
        for i, pg in enumerate(param_groups or []):
            if "params" not in pg:
                raise ValueError(f"strata.torch: param_groups[{i}] has no 'params'")
            lr_scale = pg.get("lr_scale")
            if lr_scale is None and "lr" in pg:
                if base_lr <= 0:
                    raise ValueError(f"strata.torch: param_groups[{i}] sets 'lr' but the config's optimizer lr is "
                                     f"{base_lr}; give 'lr_scale' instead")
                lr_scale = float(pg["lr"]) / base_lr
            wd = pg.get("weight_decay",
                        float(self.config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)))
            if lr_scale is not None and not lr_scale > 0:
                raise ValueError(f"strata.torch: param_groups[{i}] has a learning rate of {lr_scale} times the "
                                 f"config's; it must be > 0 (freeze parameters with requires_grad=False instead)")
            index = e.add_optimizer_group(pg.get("name", f"param_groups[{i}]"), wd, lr_scale or 1.0)
            for p in pg["params"]:
                if id(p) not in self._params:
                    raise ValueError(f"strata.torch: param_groups[{i}] holds a tensor that is not a parameter "
                                     f"of the model")
                if id(p) in opt_of:
                    raise ValueError(f"strata.torch: parameter '{self._params[id(p)].name}' is in two of "
                                     f"param_groups")
                opt_of[id(p)] = index

        # Registration and initial values.
        on_meta = any(rec.p.device.type == "meta" for rec in order)
        if on_meta and weights is None:
            raise ValueError("strata.torch: the model's parameters are on the meta device; pass weights=DIR "
                             "(safetensors) to take their values from files")
        self._name_prefix = name_prefix
        sources = {}
        for rec in order:
            init = None
            if weights is None:
                sources[rec.name] = rec.p
                init = self._init_from_tensor
            e.register(name_prefix + rec.name, rec.shape, group=rec.group.name, frozen=not rec.trainable,
                       optimizer_group=opt_of.get(id(rec.p), 0), init=init)
        self._sources = sources
        if weights is not None:
            e.init_from_safetensors(weights, weights_prefix)
        e.finalize()
        self._sources = None

        # Layout, placeholders, hooks.
        for g in self._group_list:
            g.info = e.group_info(g.name)
            g.numel = g.info.numel
            g.trainable = g.info.trainable
        self.device = self._group_list[0].info.device
        self.dtype = _TORCH_DTYPES[self._group_list[0].info.dtype]
        if self.device == "cuda":
            if self._copy_views:
                raise ValueError("strata.torch: copy_views is for the host device; on CUDA the adapter uses "
                                 "DLPack views of the engine's device memory")
            if torch.cuda.current_device() != 0:
                raise ValueError(f"strata.torch: the engine runs on CUDA device 0, but torch's current device is "
                                 f"{torch.cuda.current_device()}; call torch.cuda.set_device(0) (or set "
                                 f"CUDA_VISIBLE_DEVICES) before initialize")
            self.torch_device = torch.device("cuda", 0)
        else:
            self.torch_device = torch.device("cpu")
        # NaN, not zero: a value read from a parameter that is not fetched is loud.
        self._placeholder_base = torch.full((1,), float("nan"), dtype=self.dtype, device=self.torch_device)
        # Buffers go where the compute is (rotary tables and the like); parameters are the engine's.
        for module in model.modules():
            for k, b in list(module._buffers.items()):
                if b is not None and b.device != self.torch_device:
                    module._buffers[k] = b.to(self.torch_device)
        for rec in order:
            rec.offset, _ = e.param_offset(name_prefix + rec.name)
            if rec.p.device.type == "meta":
                self._replace_meta(model, rec)
            with _as_internal():
                rec.p.data = self._placeholder(rec)
            _owner_of_param[id(rec.p)] = (rec, weakref.ref(self))
            setattr(rec.p, _NAMES_ATTR, (rec.name, rec.group.name))
            rec.p.__class__ = _guard_class(rec.cls)
            if rec.trainable:
                with _as_internal(), torch.enable_grad():
                    rec.acc = rec.p.expand_as(rec.p).grad_fn.next_functions[0][0]
                rec.acc.register_hook(self._make_grad_hook(rec))
        self._order = order
        self._install_hooks(model)

    def _init_from_tensor(self, name, out):
        src = self._sources.pop(name[len(self._name_prefix):])
        with _as_internal(), torch.no_grad():
            t = src.detach().to(device="cpu", dtype=torch.float32).contiguous()
        ctypes.memmove(out, t.data_ptr(), t.numel() * 4)

    def _params_by_name(self):
        cache = getattr(self, "_by_name", None)
        if cache is None:
            cache = self._by_name = {rec.name: rec for rec in self._params.values()}
        return cache

    # --- the step -----------------------------------------------------------------------------------
    def backward(self, loss, retain_graph=False):
        """Back-propagates loss (times the loss scale under fp16) and hands every
        trainable group's gradients to the engine. Call step() after it."""
        self._backward(loss, retain_graph)

    def step(self):
        """Ends the step once gradient_accumulation_steps backward passes are in
        (strata_step_end) and returns its StepStats; before that returns None
        (call it after every backward, as with DeepSpeed, or once per step)."""
        if self._micro < self.gradient_accumulation_steps:
            return None
        self._micro = 0
        stats = self._engine.step_end()
        stats.adapter_seconds, self.adapter_seconds = self.adapter_seconds, 0.0
        return stats

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the engine owns the gradients (kept for loops that call it)."""

    @property
    def loss_scale(self):
        return self._engine.loss_scale

    def set_lr(self, lr):
        self._engine.set_lr(lr)

    def stats(self):
        return self._engine.stats()

    def swap_stats(self):
        """Each swap path's traffic (strata.SwapStats): the last step's bytes and the totals."""
        return self._engine.swap_stats()

    @property
    def engine(self):
        """The underlying strata.Engine (the C API)."""
        return self._engine

    @property
    def groups(self):
        """The fetch groups' names, in registration order."""
        return [g.name for g in self._group_list]

    def group_of(self, param):
        """The fetch group's name of a parameter (the object, or its name)."""
        rec = self._params_by_name().get(param) if isinstance(param, str) else self._params.get(id(param))
        if rec is None:
            raise KeyError(f"strata.torch: {param!r} is not a parameter of the model")
        return rec.group.name

    # --- weights --------------------------------------------------------------------------------------
    def resident(self):
        """Groups fetched inside stay fetched until the context ends (evaluation,
        generation: no fetch per call), as far as strata.budgets.device holds
        them: when a fetch finds no room, the kept groups not in use are
        released first. gathered() fetches every group."""
        return self._resident()

    def gathered(self):
        """Every parameter holds its full compute copy inside (all groups fetched
        and resident), to be read: the engine trains the fp32 master weights,
        which a write to a compute copy cannot reach. A context that ends with
        a parameter written raises strata.ParameterWritten naming it (each
        parameter's bits are summed at entry and exit), after putting the
        compute copies of trainable ones back from their masters (which a
        context left by an exception does too, raising that exception)."""
        return self._gathered()

    def _fingerprints(self):
        """(parameters, 2) int64 on the device: each parameter's fetched compute
        copy summed as integers, plainly and weighted by position (a write, a
        permutation too, changes them but for a collision chance)."""
        weights = self._fingerprint_weights
        if weights is None:
            gen = torch.Generator().manual_seed(0x5742)
            size = min(_FINGERPRINT_CHUNK, max(rec.numel for rec in self._order))
            weights = torch.randint(1, 1 << 16, (size,), generator=gen, dtype=torch.int64)
            weights = self._fingerprint_weights = weights.to(self.torch_device)
        out = torch.zeros((len(self._order), 2), dtype=torch.int64, device=self.torch_device)
        with torch.no_grad():
            for i, rec in enumerate(self._order):
                flat = rec.group.flat
                bits = flat[rec.offset:rec.offset + rec.numel].view(_INT_OF[flat.dtype])
                for k, start in enumerate(range(0, rec.numel, _FINGERPRINT_CHUNK)):
                    chunk = bits[start:start + _FINGERPRINT_CHUNK].to(torch.int64)
                    out[i, 0] += chunk.sum()
                    out[i, 1] += (chunk * weights[:chunk.numel()]).sum() * (k + 1)
        return out

    def _undo_writes(self, before):
        """The parameters written since `before` (_fingerprints); the compute
        copies of trainable ones are put back from their masters."""
        after = self._fingerprints()
        if torch.equal(before, after):
            return []
        written = [rec for rec, a, b in zip(self._order, before, after) if not torch.equal(a, b)]
        with torch.no_grad():
            for rec in written:
                if rec.trainable:
                    master = torch.empty(rec.shape, dtype=torch.float32)
                    self._engine.read_master(self._name_prefix + rec.name, master)
                    # Rounded to nearest even, as the engine rounds its masters to compute copies.
                    rec.group.flat[rec.offset:rec.offset + rec.numel].copy_(master.view(-1))
        return written

    def _check_unwritten(self, before):
        written = self._undo_writes(before)
        if not written:
            return
        trainable = [rec for rec in written if rec.trainable]
        frozen = [rec for rec in written if not rec.trainable]
        parts = []
        if trainable:
            parts.append(f"The write {'' if not frozen else f'to {_names(trainable)} '}is undone: the compute "
                         f"copies are put back from the masters (the next step would have overwritten them)")
        if frozen:
            parts.append(f"{_names(frozen)} {'is' if len(frozen) == 1 else 'are'} frozen (no master weights): "
                         f"the compute copy is the only copy, and whether the write lasts depends on where it lives")
        raise errors.ParameterWritten(
            f"strata.torch: {_names(written)} {'was' if len(written) == 1 else 'were'} written inside "
            f"engine.gathered(), which lends the compute copies to be read: the engine trains the fp32 master "
            f"weights, which such a write does not reach. {'. '.join(parts)}. To change weights, change them "
            f"before strata.torch.initialize, or start a new engine from the weights you want "
            f"(initialize(model, config, weights=DIR), or engine.state_dict() edited and loaded into a new "
            f"model)", status="FAILED_PRECONDITION")

    def state_dict(self, dtype=torch.float32):
        """The model's weights under its own names (every alias of a tied weight,
        and buffers, as module.state_dict()): the fp32 masters of trainable
        parameters, the compute copies of frozen ones, in `dtype` on the CPU."""
        out = {}
        for g in self._group_list:
            flat = None
            for rec in g.params:
                if rec.trainable:
                    t = torch.empty(rec.shape, dtype=torch.float32)
                    self._engine.read_master(self._name_prefix + rec.name, t)
                else:
                    if flat is None:
                        flat = self._host_copy(g)
                    t = flat[rec.offset:rec.offset + rec.numel].view(rec.shape).clone()
                for alias in rec.aliases:
                    out[alias] = t.to(dtype)
        for name, b in self.module.named_buffers():
            out[name] = b.detach().to("cpu")
        order = self.module.state_dict(keep_vars=True).keys()
        return {k: out[k] for k in order if k in out}

    def _host_copy(self, g):
        """A copy of the group's compute copies in host memory (fetched for it
        when the group is not fetched)."""
        self._acquire(g)
        try:
            return g.flat.detach().to("cpu", copy=True)
        finally:
            self._release(g)

    def export(self, directory, dtype="bf16", max_shard_bytes=0):
        """Writes the weights as safetensors under the model's parameter names
        (Hugging Face layout: model.safetensors, or shards of at most
        max_shard_bytes with model.safetensors.index.json)."""
        os.makedirs(directory, exist_ok=True)
        self._engine.export_safetensors(directory, dtype, max_shard_bytes)

    # --- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, root, client_state=None, save_rng=True):
        """Saves the whole training state between steps under root (atomically:
        docs/checkpoints.md), with `client_state` (anything torch.save takes:
        the data position, ...) and, by default, torch's and Python's RNG
        states, restored by load_checkpoint."""
        if self._micro != 0:
            raise errors.FailedPrecondition(
                f"strata.torch: save_checkpoint in the middle of a step ({self._micro} of "
                f"{self.gradient_accumulation_steps} micro-batches in); call it after step()",
                status="FAILED_PRECONDITION")
        # Persistent buffers (running statistics and the like) are the model's
        # state too: the blob carries them (the engine holds the parameters).
        persistent = {k for k, v in self.module.state_dict(keep_vars=True).items()
                      if not isinstance(v, torch.nn.Parameter)}
        buffers = {n: b.detach().to("cpu").clone() for n, b in self.module.named_buffers() if n in persistent}
        blob = {"client_state": client_state, "format": 1, "buffers": buffers}
        if save_rng:
            blob["rng"] = {"torch": torch.get_rng_state(), "python": random.getstate()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                blob["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        buf = io.BytesIO()
        torch.save(blob, buf)
        self._engine.save_checkpoint(root, buf.getvalue())

    def load_checkpoint(self, root, load_rng=True):
        """Loads a checkpoint (from any placement) and returns its client_state."""
        raw = self._engine.load_checkpoint(root)
        self._micro = 0
        self._failed = None
        if not raw:
            return None
        # The blob is this engine's own (torch.save above): trusted like the checkpoint itself.
        try:
            blob = torch.load(io.BytesIO(raw), weights_only=False)
        except TypeError:  # torch < 1.13 has no weights_only
            blob = torch.load(io.BytesIO(raw))
        if blob.get("buffers"):
            current = dict(self.module.named_buffers())
            missing = sorted(set(blob["buffers"]) - set(current))
            if missing:
                raise errors.FailedPrecondition(
                    f"strata.torch: the checkpoint has buffers the model lacks: {', '.join(missing)}",
                    status="FAILED_PRECONDITION")
            with torch.no_grad():
                for n, b in blob["buffers"].items():
                    current[n].copy_(b)
        rng = blob.get("rng")
        if load_rng and rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return blob.get("client_state")

    # --- life -----------------------------------------------------------------------------------------
    def close(self):
        """Removes the hooks, frees the engine (its swap files too). The model's
        parameters keep their placeholders: gather what you need first."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for rec in getattr(self, "_order", []):
            _owner_of_param.pop(id(rec.p), None)
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_FINGERPRINT_CHUNK = 1 << 22  # elements summed at once by Engine._fingerprints
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _names(recs, most=5):
    """'a', 'b' and 3 more: parameter names for a message."""
    shown = ", ".join(f"'{rec.name}'" for rec in recs[:most])
    return shown + (f" and {len(recs) - most} more" if len(recs) > most else "")


def _has_remove_duplicate():
    import inspect
    try:
        return "remove_duplicate" in inspect.signature(torch.nn.Module.named_parameters).parameters
    except (TypeError, ValueError):
        return False


def _named_parameters_all(model):
    """named_parameters() with every alias of a shared parameter (torch < 2.0)."""
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                yield (f"{mname}.{pname}" if mname else pname), p


def initialize(model, config, *, blocks=None, param_groups=None, weights=None, weights_prefix="", name_prefix="",
               copy_views=False, total_num_steps=None, hidden_size=None, strict=False):
    """Hands `model`'s parameters, gradients and optimizer to strata.

    model: an nn.Module (its parameters on the CPU, the GPU, or the meta device
        with `weights`).
    config: a dict, a JSON string or a path (DeepSpeed's keys and strata's;
        docs/config.md). Errors name the key path.
    blocks: the repeated blocks, one fetch group each (default: the children of
        every ModuleList).
    param_groups: torch-style groups, [{"params": [...], "weight_decay": x,
        "lr": y or "lr_scale": s}, ...]; the rest use the config's optimizer.
    weights: a directory (or file) of safetensors to take the initial weights
        from, streamed group by group (tensor name = weights_prefix + name).
    name_prefix: prepended to every parameter name in the engine (checkpoints,
        export).
    copy_views: on the host device, copy compute copies and gradients through
        the *_host calls instead of DLPack views of the engine's memory.
    total_num_steps: the run's optimizer steps, for "auto" in
        scheduler.params.total_num_steps; hidden_size: the model's hidden size,
        for the "auto" bucket sizes; strict: unknown keys are errors
        (docs/config.md, "auto").
    Returns a strata.torch.Engine: engine.backward(loss), engine.step().
    """
    return Engine(model, config, blocks=blocks, param_groups=param_groups, weights=weights,
                  weights_prefix=weights_prefix, name_prefix=name_prefix, copy_views=copy_views,
                  total_num_steps=total_num_steps, hidden_size=hidden_size, strict=strict)
