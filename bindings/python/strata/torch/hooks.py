"""The forward hooks and backward markers: a unit's groups acquired before
its forward and released after it, acquired again before its backward
(_PreBackward on its outputs) and released after it (_PostBackward on its
inputs); activation checkpointing's recomputations; and the saved-tensor
hooks that save a view of a group's buffer as a place in the group."""
import copy
import dataclasses
import weakref

import torch

from .. import errors
from .fetch import _storage_address
from .records import _timed

_MARK_IN_FORWARD = object()  # _forward_pre's kwargs when _ForwardWrapper marks the inputs


def _inert_hook(*args, **kwargs):
    """What a copy of a model (copy.deepcopy) has in place of the adapter's hooks."""
    return None


class _Hook:
    """One of the adapter's forward hooks on a module. copy.deepcopy of the
    module gives the copy an inert hook: a copy (an EMA or teacher model) is a
    plain module of its own, which the engine neither fetches for nor trains."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _inert_hook


class _MarkingForward:
    """A unit's forward under _ForwardWrapper: marks the inputs, then calls the
    module's own forward. Its deepcopy (that of a copy of the module) is what
    the module's own forward deep-copies to: the copy's."""
    __slots__ = ("unit", "inner")

    def __init__(self, unit, inner):
        self.unit, self.inner = unit, inner

    def __call__(self, *args, **kwargs):
        u = self.unit()
        if u is not None and getattr(u, "mark_inputs", False):
            u.mark_inputs = False
            args, kwargs = _map_tensors((args, kwargs), lambda ts: _PostBackward.apply(u, *ts))
        return self.inner(*args, **kwargs)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self.inner, memo)


class _ForwardWrapper:
    """Wraps a unit's forward (torch < 2.0, whose pre-hooks see no keyword
    inputs) to put the _PostBackward marker on positional and keyword inputs
    alike. remove() restores the module's own forward."""

    def __init__(self, unit):
        self.module = unit.module
        self.module.forward = _MarkingForward(weakref.ref(unit), self.module.forward)

    def remove(self):
        self.module.__dict__.pop("forward", None)


class _SavedView:
    """A saved tensor that lived in a group's buffer (see Hooks._pack)."""
    __slots__ = ("group", "offset", "size", "stride")

    def __init__(self, group, offset, size, stride):
        self.group, self.offset, self.size, self.stride = group, offset, size, stride


def _has_kwargs_hooks():
    import inspect
    try:
        return "with_kwargs" in inspect.signature(torch.nn.Module.register_forward_pre_hook).parameters
    except (TypeError, ValueError):
        return False


def _call(unit_ref, method, *args):
    """A hook's call into its engine; nothing once the engine is gone."""
    unit = unit_ref()
    if unit is None:
        return None
    return getattr(unit.engine, method)(unit, *args)


def _call_engine(engine_ref, method):
    engine = engine_ref()
    if engine is not None:
        getattr(engine, method)()


def _backward_marker(name, doc, event):
    """An identity autograd Function whose backward calls
    `unit.engine.<event>(unit)`: on a unit's outputs it fires before the
    unit's backward (_PreBackward), on its inputs after it (_PostBackward)."""

    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tuple(t.detach() for t in tensors)

    def backward(ctx, *grads):
        getattr(ctx.unit.engine, event)(ctx.unit)
        return (None,) + grads

    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "forward": staticmethod(forward), "backward": staticmethod(backward)})


_PreBackward = _backward_marker("_PreBackward", "Fetches a unit's groups before its backward.", "_pre_backward")
_PostBackward = _backward_marker("_PostBackward", "Releases a unit's groups after its backward.", "_post_backward")


def _map_tensors(obj, fn):
    """Applies fn to the list of tensors that require grad inside obj (tuples,
    lists, dicts, and objects with __dict__-free mapping like ModelOutput) and
    rebuilds obj with the results."""
    found = []

    def collect(o):
        if isinstance(o, torch.Tensor):
            if o.requires_grad:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                collect(x)
        elif isinstance(o, dict):
            for x in o.values():
                collect(x)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                collect(getattr(o, f.name))

    collect(obj)
    if not found:
        return obj
    replaced = fn(found)
    mapping = {id(a): b for a, b in zip(found, replaced)}

    def rebuild(o):
        if isinstance(o, torch.Tensor):
            return mapping.get(id(o), o)
        if isinstance(o, tuple) and hasattr(o, "_fields"):  # namedtuple
            return type(o)(*[rebuild(x) for x in o])
        if isinstance(o, (list, tuple)):
            return type(o)(rebuild(x) for x in o)
        if isinstance(o, dict):
            new = {k: rebuild(v) for k, v in o.items()}
            try:
                out = type(o)(**new) if type(o) is not dict else new
            except TypeError:
                out = type(o)(new)
            return out
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.replace(o, **{f.name: rebuild(getattr(o, f.name)) for f in dataclasses.fields(o)
                                             if f.init})
        return o

    return rebuild(obj)


class Hooks:
    """The Engine's part that the model's forward and backward call. Owns
    `_hooks`, `_saving`, `_root_saving` and `_recomputing`; each group's
    `outstanding`, `backward_refs` and `handover`. Fetches through fetch.py,
    hands gradients over through gradients.py's `_send`."""

    def _install_hooks(self, model):
        """Each unit's forward pre- and post-hook (and, on torch < 2.0, the
        wrapper of its forward), and the model's own, which turn the
        saved-tensor hooks on for its forward."""
        kwargs_hooks = _has_kwargs_hooks()
        for unit in self._units:
            ref = weakref.ref(unit)
            if kwargs_hooks:
                self._hooks.append(unit.module.register_forward_pre_hook(_Hook(
                    lambda m, args, kwargs, ref=ref: _call(ref, "_forward_pre", args, kwargs)), with_kwargs=True))
            else:
                # torch < 2.0: the pre-hook sees no keyword inputs; the marker goes
                # on in a wrapper of the module's forward, over args and kwargs.
                self._hooks.append(unit.module.register_forward_pre_hook(_Hook(
                    lambda m, args, ref=ref: _call(ref, "_forward_pre", args, _MARK_IN_FORWARD))))
                self._hooks.append(_ForwardWrapper(unit))
            self._hooks.append(unit.module.register_forward_hook(_Hook(
                lambda m, args, output, ref=ref: _call(ref, "_forward_post", output))))
        me = weakref.ref(self)
        self._hooks.append(model.register_forward_pre_hook(_Hook(lambda m, args: _call_engine(me, "_root_pre"))))
        self._hooks.append(model.register_forward_hook(_Hook(lambda m, args, out: _call_engine(me, "_root_post"))))

    # --- saved tensors ----------------------------------------------------------------------------
    def _pack(self, t):
        """Saved-tensor pack hook: a tensor saved for the backward that lives in
        a fetched group's buffer (a parameter, or a view of one such as
        Linear's weight.t()) is saved as (group, offset, size, stride), so the
        forward's buffer is released at once; the backward rebuilds it from the
        buffer its own fetch brings."""
        if not self._by_storage:
            return t
        g = self._by_storage.get(_storage_address(t))
        if g is None or g.flat is None:
            return t
        return _SavedView(g, t.storage_offset() - g.flat.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, x):
        if not isinstance(x, _SavedView):
            return x
        g = x.group
        if g.flat is None:
            # Its unit's _PreBackward did not fetch it (it was not reached):
            # fetch now; the unit's _PostBackward or the end of the backward releases it.
            self._acquire(g)
            g.backward_refs += 1
        return g.flat.as_strided(x.size, x.stride, g.flat.storage_offset() + x.offset)

    def _begin_saving(self):
        if self._saving is None and torch.is_grad_enabled() and not self._in_backward:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving.__enter__()
            return True
        return False

    def _end_saving(self):
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)

    # --- the model's forward ----------------------------------------------------------------------
    def _root_pre(self):
        if self._closed:
            return
        if not self._in_backward and self._resident_depth == 0:
            self._recover_from_failed_forward()
        self._root_saving = self._begin_saving()

    def _recover_from_failed_forward(self):
        """A forward that raised left its groups fetched (its post-hooks never
        ran): release them before the next forward of the model."""
        self._end_saving()
        for g in self._group_list:
            if g.refs > 0 and g.backward_refs == 0:
                g.refs = 0
                self._drop(g)

    def _root_post(self):
        if not self._closed and self._root_saving:
            self._root_saving = False
            self._end_saving()

    # --- a unit's forward and backward ------------------------------------------------------------
    @_timed
    def _forward_pre(self, unit, args, kwargs=None):
        if self._closed:
            return None
        for g in unit.groups:
            self._acquire(g)
        unit.saving = self._begin_saving()  # the unit is called outside the model's forward
        if not torch.is_grad_enabled():
            return None
        if self._in_backward:
            # A recomputation (activation checkpointing): balanced by its
            # _forward_post, or at the end of the backward when torch stops it early.
            self._recomputing.append(unit)
        # Frozen groups too: their backward (gradients of the inputs) fetches
        # them, and _PostBackward releases them as soon as it is done.
        for g in unit.groups:
            if g.trainable:
                g.outstanding += 1
        if kwargs is _MARK_IN_FORWARD:
            unit.mark_inputs = True  # _ForwardWrapper marks them
            return None
        if kwargs is None:
            return _map_tensors(args, lambda ts: _PostBackward.apply(unit, *ts))
        return _map_tensors((args, kwargs), lambda ts: _PostBackward.apply(unit, *ts))

    @_timed
    def _forward_post(self, unit, output):
        if self._closed:
            return None
        if unit.saving:
            unit.saving = False
            self._end_saving()
        if torch.is_grad_enabled():
            marked = []
            output = _map_tensors(output, lambda ts: marked.extend(ts) or _PreBackward.apply(unit, *ts))
            if not marked and any(g.trainable for g in unit.groups):
                raise errors.Unimplemented(
                    f"strata.torch: module '{unit.name}' returned {type(output).__name__}, in which the adapter "
                    f"finds no tensor that requires grad; return tensors, or tuples, lists, dicts or dataclasses "
                    f"of them, so that its backward can fetch its parameters", status="UNIMPLEMENTED")
        if self._in_backward and unit in self._recomputing:
            last = len(self._recomputing) - 1 - self._recomputing[::-1].index(unit)
            del self._recomputing[last]
            for g in unit.groups:
                if g.backward_refs == 0:
                    # Reentrant checkpointing: the recomputed graph's backward
                    # comes next and its _PreBackward takes this fetch over
                    # (rather than fetching the group a second time).
                    g.handover += 1
                else:  # recomputed inside the group's own backward (non-reentrant): it stays fetched anyway
                    self._release(g)
            return output
        for g in unit.groups:
            self._release(g)
        return output

    @_timed
    def _pre_backward(self, unit):
        for g in unit.groups:
            if g.handover > 0:
                g.handover -= 1  # the fetch of its recomputation
            else:
                self._acquire(g)
            g.backward_refs += 1

    @_timed
    def _post_backward(self, unit):
        for g in unit.groups:
            if g.backward_refs > 0:
                g.backward_refs -= 1
                self._release(g)
            if not g.trainable:
                continue
            g.outstanding -= 1
            if g.outstanding == 0 and not g.sent:
                self._send(g)
