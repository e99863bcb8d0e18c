"""Set-up: the model's parameters registered with the engine under their
names, the fetch groups and units found, torch-style parameter groups made
optimizer groups, the initial values (from the parameters or safetensors
files), and the parameters handed to the engine (placeholders, grad hooks,
forward hooks)."""
import warnings
import weakref

import torch

from . import lora
from . import safetensors as sf
from .placeholders import _NAMES_ATTR, _as_internal, _guard_class, _guard_classes, _owner_of_param
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


def _block_of(module_name, block_modules):
    """The name of the block that holds the module `module_name`, or None."""
    parts = module_name.split(".") if module_name else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in block_modules:
            return prefix
    return None


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


class Setup:
    """The Engine's part that builds it (called once, by Engine.__init__).
    Sets `_params`, `_groups`, `_group_list`, `_units`, `_order`,
    `_name_prefix`, `device`, `dtype`, `torch_device` and
    `_placeholder_base`."""

    def _setup(self, model, blocks, param_groups, weights, weights_prefix, name_prefix, resume_from=None):
        """Returns the checkpoint's framework blob with `resume_from`, else None."""
        block_modules = dict(self._block_list(model, blocks))
        order = self._collect_params(model)
        self._make_groups(model, block_modules)
        opt_of = self._optimizer_groups(param_groups)
        raw = self._register(order, opt_of, weights, weights_prefix, name_prefix, resume_from)
        self._place(model)
        self._take_params(model, order)
        self._install_hooks(model)
        return raw

    def _block_list(self, model, blocks):
        """(name, module) of each block: `blocks`, or the default ones."""
        if blocks is None:
            return _default_blocks(model)
        names = {id(m): n for n, m in model.named_modules()}
        block_list = []
        for b in blocks:
            if id(b) not in names:
                raise ValueError("strata.torch: a module in `blocks` is not part of the model")
            block_list.append((names[id(b)], b))
        return block_list

    def _collect_params(self, model):
        """The parameters, in named_parameters() order (the first name of a
        tied parameter), in `_params`; refuses a model that has none, a
        parameter of another engine and buffers on the meta device."""
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
        return order

    def _make_groups(self, model, block_modules):
        """Groups: the owner module of each parameter (first in
        named_modules order), or its block; units: each block, and each
        module outside the blocks that owns parameters."""
        self._groups = {}
        units = {}               # id(module) -> _Unit
        for mname, module in model.named_modules():
            b = _block_of(mname, block_modules)
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

    def _optimizer_groups(self, param_groups):
        """Torch-style parameter groups as the engine's optimizer groups:
        {id(parameter): optimizer group index}."""
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
            index = self._engine.add_optimizer_group(pg.get("name", f"param_groups[{i}]"), wd, lr_scale or 1.0)
            for p in pg["params"]:
                if id(p) not in self._params:
                    raise ValueError(f"strata.torch: param_groups[{i}] holds a tensor that is not a parameter "
                                     f"of the model")
                if id(p) in opt_of:
                    raise ValueError(f"strata.torch: parameter '{self._params[id(p)].name}' is in two of "
                                     f"param_groups")
                opt_of[id(p)] = index
        return opt_of

    def _register(self, order, opt_of, weights, weights_prefix, name_prefix, resume_from=None):
        """Registration, the initial values (each parameter's own, or the
        safetensors files' under `weights`), and finalize; with `resume_from`,
        finalize_from_checkpoint, whose blob it returns (the values of blocks
        whose parameters all train are the checkpoint's alone)."""
        e = self._engine
        # With resume_from, a block whose parameters all train takes nothing
        # from the model: it may be on the meta device without files.
        frozen_in = {rec.group.name for rec in order if not rec.trainable}
        on_meta = [rec for rec in order if rec.p.device.type == "meta"
                   and (resume_from is None or rec.group.name in frozen_in)]
        if on_meta and weights is None:
            if resume_from is not None:
                raise ValueError(f"strata.torch: parameter '{on_meta[0].name}' is on the meta device in a block "
                                 f"with frozen parameters, whose values initialize writes before the checkpoint "
                                 f"loads; pass weights=DIR (safetensors) to take them from files")
            raise ValueError("strata.torch: the model's parameters are on the meta device; pass weights=DIR "
                             "(safetensors) to take their values from files")
        self._name_prefix = name_prefix
        # With `weights`, a parameter the files do not hold keeps its own
        # values when it has them and may: LoRA's adapters (marked by
        # lora.apply), or any with weights_missing="keep"; the others are
        # left to the files, whose reading names what they lack.
        adapters = {id(rec.p) for rec in order if getattr(rec.p, lora.OWN_VALUES_ATTR, False)}
        may_keep = [] if weights is None else [rec for rec in order if rec.p.device.type != "meta" and (
            id(rec.p) in adapters or self._weights_missing == "keep")]
        in_files = set()
        if may_keep:  # the files' headers, to see which of them they lack
            try:
                in_files = sf.tensor_names(weights)
            except (OSError, ValueError, KeyError):
                pass  # the engine's reading of the files says what is wrong with them
        keeps = {id(rec.p) for rec in may_keep if weights_prefix + name_prefix + rec.name not in in_files}
        sources = {}
        kept = []
        for rec in order:
            init = None
            own = id(rec.p) in keeps
            if own and id(rec.p) not in adapters:
                kept.append(rec.name)
            if weights is None or own:
                sources[rec.name] = rec.p
                init = self._init_from_tensor
            e.register(name_prefix + rec.name, rec.shape, group=rec.group.name, frozen=not rec.trainable,
                       optimizer_group=opt_of.get(id(rec.p), 0), init=init)
        self._sources = sources
        if kept:
            warnings.warn(f"strata.torch: {len(kept)} parameter(s) not in the weights files keep their own values "
                          f"(weights_missing=\"keep\"): {', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''}",
                          stacklevel=4)
        if weights is not None:
            e.init_from_safetensors(weights, weights_prefix)
        raw = None
        if resume_from is None:
            e.finalize()
        else:
            raw = e.finalize_from_checkpoint(resume_from)
        self._sources = None
        return raw

    def _init_from_tensor(self, name, out):
        # One copy_ straight into the engine's buffer (torch's threads; from
        # a GPU tensor one transfer, the dtype converted on the way), not a
        # CPU fp32 copy of the parameter and then a memmove on one thread.
        src = self._sources.pop(name[len(self._name_prefix):])
        with _as_internal(), torch.no_grad():
            torch.frombuffer(out, dtype=torch.float32).copy_(src.detach().reshape(-1))

    def _place(self, model):
        """The layout read back (each group's size), the compute device and
        dtype, the placeholders' NaN, and the model's buffers moved to the
        compute device."""
        for g in self._group_list:
            g.info = self._engine.group_info(g.name)
            g.numel = g.info.numel
            g.trainable = g.info.trainable
            g.grad_begin = g.info.grad_offset
        self.device = self._group_list[0].info.device
        self.dtype = _TORCH_DTYPES[self._group_list[0].info.dtype]
        if self.device == "cuda":
            if self._copy_views:
                raise ValueError("strata.torch: copy_views is for the host device; on CUDA the adapter uses "
                                 "DLPack views of the engine's device memory")
            index = self._group_list[0].info.device_index
            before = getattr(self, "_torch_cuda_device", None)
            if before is not None and before != index:
                raise ValueError(f"strata.torch: the engine runs on CUDA device {index} (its local rank's), but "
                                 f"torch's current device was {before}; call torch.cuda.set_device({index}) "
                                 f"(with several ranks: the LOCAL_RANK the launcher gives) before initialize")
            torch.cuda.set_device(index)
            self.torch_device = torch.device("cuda", index)
        else:
            self.torch_device = torch.device("cpu")
        # NaN, not zero: a value read from a parameter that is not fetched is loud.
        self._placeholder_base = torch.full((1,), float("nan"), dtype=self.dtype, device=self.torch_device)
        # Buffers go where the compute is (rotary tables and the like); parameters are the engine's.
        for module in model.modules():
            for k, b in list(module._buffers.items()):
                if b is not None and b.device != self.torch_device:
                    module._buffers[k] = b.to(self.torch_device)

    def _take_params(self, model, order):
        """Each parameter's offset in its group, its placeholder and guard
        class, its owner, and (trainable) the hook on its AccumulateGrad node."""
        for rec in order:
            rec.offset, _ = self._engine.param_offset(self._name_prefix + rec.name)
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

    def _params_by_name(self):
        cache = getattr(self, "_by_name", None)
        if cache is None:
            cache = self._by_name = {rec.name: rec for rec in self._params.values()}
        return cache
