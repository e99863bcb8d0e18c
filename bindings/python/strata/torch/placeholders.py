"""Parameters that are not fetched: their placeholders (the right shape,
dtype and device, no memory, NaN if read), the guard classes whose operations
raise NotFetched naming the parameter and its group, which engine owns each
parameter, and copy.deepcopy of a parameter that is not fetched (a plain
parameter holding its compute copy; the hooks of a copied model are
hooks.py's, which deep-copy to inert ones)."""
import contextlib
import threading

import torch

from .. import errors

_tls = threading.local()


def _internal():
    return getattr(_tls, "internal", 0) > 0


@contextlib.contextmanager
def _as_internal():
    """Inside, the adapter's own operations on a guarded parameter pass (its
    .data swapped, its gradient taken)."""
    _tls.internal = getattr(_tls, "internal", 0) + 1
    try:
        yield
    finally:
        _tls.internal -= 1


# Attributes that read no values: always allowed on a parameter that is not fetched.
_ALLOWED_ATTRS = frozenset({
    "data", "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout",
    "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_version", "_base", "is_mkldnn", "is_nested",
    "output_nr", "_backward_hooks", "_grad", "_grad_fn", "_cdata", "__dict__", "__class__", "itemsize", "nbytes",
})
_ALLOWED_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "get_device",
    "ndimension", "is_contiguous", "__hash__", "register_hook", "_is_view", "__len__",
})
_guard_classes = {}
# id(Parameter) -> (its _Param, a weakref to its Engine), while the engine is
# open. A parameter also carries its names (_NAMES_ATTR: parameter, group)
# for the messages after close().
_owner_of_param = {}
_NAMES_ATTR = "_strata_names"


def _not_fetched(t, what):
    """The NotFetched error for a use (`what`) of parameter t that is not fetched."""
    owner = _owner_of_param.get(id(t))
    if owner is not None and owner[1]() is not None:
        rec = owner[0]
        return errors.NotFetched(
            f"strata: parameter '{rec.name}' is used ({what}) while its fetch group '{rec.group.name}' is not "
            f"fetched: use it inside the forward of a module that owns it, or inside `with engine.gathered():` "
            f"(every parameter fetched)", status="FAILED_PRECONDITION")
    name, group = getattr(t, _NAMES_ATTR, ("?", "?"))
    return errors.NotFetched(
        f"strata: parameter '{name}' (fetch group '{group}') is used ({what}) after its engine was closed, "
        f"which took its values along: take the weights before engine.close() (engine.state_dict(), "
        f"engine.export(), or copy.deepcopy(model) for a plain PyTorch copy)", status="FAILED_PRECONDITION")


def _deepcopy_unfetched(self, memo):
    """copy.deepcopy of a parameter that is not fetched: a plain parameter of
    the model's class holding its compute copy (what the model computes with),
    on the model's device, of its own (the engine does not know it)."""
    if id(self) in memo:
        return memo[id(self)]
    owner = _owner_of_param.get(id(self))
    engine = owner[1]() if owner is not None else None
    if engine is None:
        raise _not_fetched(self, "copy.deepcopy")
    rec = owner[0]
    result = rec.cls(engine._compute_copy_of(rec, memo), self.requires_grad)
    memo[id(self)] = result
    return result


def _guard_class(cls):
    """A subclass of `cls` whose operations raise NotFetched."""
    guarded = _guard_classes.get(cls)
    if guarded is None:
        def __torch_function__(kind, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            attr = getattr(getattr(func, "__self__", None), "__name__", None)
            allowed = _internal() or name in _ALLOWED_METHODS or (
                name in ("__get__", "__set__", "__delete__") and attr in _ALLOWED_ATTRS)
            if not allowed:
                for a in list(args) + list(kwargs.values()):
                    for t in (a if isinstance(a, (list, tuple)) else (a,)):
                        if isinstance(t, torch.Tensor) and type(t) in _guard_classes.values():
                            raise _not_fetched(t, attr if name in ("__get__", "__set__") else name)
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)

        guarded = type(f"Unfetched{cls.__name__}", (cls,),
                       {"__torch_function__": classmethod(__torch_function__), "__deepcopy__": _deepcopy_unfetched,
                        "__module__": __name__})
        _guard_classes[cls] = guarded
    return guarded


class Placeholders:
    """The Engine's part for parameters that are not fetched. Reads
    `_placeholder_base` (set up by setup.py), `_params`, and fetches through
    fetch.py's `_acquire`/`_release`."""

    def _placeholder(self, rec):
        return self._placeholder_base.expand(rec.shape) if rec.shape else self._placeholder_base[0]

    def _replace_meta(self, model, rec):
        """A meta parameter cannot take real data (set_data refuses): put a new
        Parameter in its place, in every module that holds it."""
        new = torch.nn.Parameter(self._placeholder(rec), requires_grad=rec.trainable)
        old = rec.p
        for module in model.modules():
            for k, v in list(module._parameters.items()):
                if v is old:
                    module._parameters[k] = new
        del self._params[id(old)]
        rec.p, rec.cls = new, type(new)
        self._params[id(new)] = rec

    def _compute_copy_of(self, rec, memo):
        """A copy of rec's compute copy on the model's device, for
        copy.deepcopy (`memo`: its memo, which keeps the last group read, so
        that a group is fetched once for all its parameters)."""
        key = ("strata.torch.deepcopy", id(self))
        held = memo.get(key)
        if held is None or held[0] is not rec.group:
            g = rec.group
            self._acquire(g)
            try:
                held = memo[key] = (g, g.flat.detach().clone())
            finally:
                self._release(g)
        return held[1][rec.offset:rec.offset + rec.numel].view(rec.shape).clone()
