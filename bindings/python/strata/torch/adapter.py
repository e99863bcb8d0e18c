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
import weakref

import torch
import torch.utils.dlpack

from .. import engine as _engine
from .checkpoints import Checkpoints
from .fetch import Fetching
from .gradients import Gradients
from .hooks import Hooks
from .placeholders import (_NAMES_ATTR, Placeholders, _as_internal, _guard_class, _guard_classes,
                           _owner_of_param)
from .records import _Group, _Param, _Unit
from .write_check import WriteCheck

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


class Engine(Hooks, Fetching, Gradients, Placeholders, WriteCheck, Checkpoints):
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

    def state_dict(self, dtype=torch.float32):
        """The model's weights under its own names (every alias of a tied weight,
        and buffers, as module.state_dict()): the fp32 masters of trainable
        parameters, the compute copies of frozen ones, in `dtype` on the CPU."""
        return self._state_dict(dtype)

    def export(self, directory, dtype="bf16", max_shard_bytes=0):
        """Writes the weights as safetensors under the model's parameter names
        (Hugging Face layout: model.safetensors, or shards of at most
        max_shard_bytes with model.safetensors.index.json)."""
        self._export(directory, dtype, max_shard_bytes)

    # --- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, root, client_state=None, save_rng=True):
        """Saves the whole training state between steps under root (atomically:
        docs/checkpoints.md), with `client_state` (anything torch.save takes:
        the data position, ...) and, by default, torch's and Python's RNG
        states, restored by load_checkpoint."""
        self._save_checkpoint(root, client_state, save_rng)

    def load_checkpoint(self, root, load_rng=True):
        """Loads a checkpoint (from any placement) and returns its client_state."""
        return self._load_checkpoint(root, load_rng)

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
