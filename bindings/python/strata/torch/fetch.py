"""Fetch and release: a group's compute copies lent as the .data of its
parameters (a DLPack view of the engine's buffer, or a host copy), counted
acquisitions, and the contexts that keep groups fetched (resident(),
gathered())."""
import contextlib
import ctypes

import torch
import torch.utils.dlpack

from .. import errors
from .placeholders import _as_internal, _guard_class


def _storage_address(t):
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


class Fetching:
    """The Engine's part that fetches and releases groups. Owns `_by_storage`
    (the fetched buffers by storage address, for hooks.py's saved tensors),
    `_resident_depth` and `_zero_copy`; each group's `refs` and `flat`."""

    def _stream(self):
        """The framework's stream for the C API: torch's current one. Its default
        stream is handle 0, which strata would read as "no stream, the work is
        done": pass cudaStreamLegacy (1) instead, which orders after it."""
        if self.device != "cuda":
            return None
        handle = torch.cuda.current_stream(self.torch_device).cuda_stream
        return ctypes.c_void_p(handle if handle else 1)

    def _acquire(self, g):
        if g.refs > 0 or g.flat is not None:
            g.refs += 1
            return
        e = self._engine
        if self._zero_copy:
            self._fetch_making_room(g)
            try:
                flat = torch.utils.dlpack.from_dlpack(e.dlpack(g.name, "compute"))
            except errors.Unimplemented:  # a library built without DLPack: copy (host device only)
                if self.device == "cuda":
                    raise
                self._zero_copy = False
                flat = torch.empty(g.numel, dtype=self.dtype)
                e.release(g.name)
                e.fetch_host(g.name, flat)
        else:
            flat = torch.empty(g.numel, dtype=self.dtype)
            e.fetch_host(g.name, flat)
        g.flat = flat
        g.refs += 1
        self._by_storage[_storage_address(flat)] = g
        with _as_internal():
            for rec in g.params:
                rec.p.data = flat[rec.offset:rec.offset + rec.numel].view(rec.shape)
                rec.p.__class__ = rec.cls

    def _fetch_making_room(self, g):
        """Fetches g's buffer. Under resident(), groups kept but not in use
        give way when the device budget has no room for it: they are released
        and the fetch tried again (the context keeps what the budget holds)."""
        try:
            self._engine.fetch(g.name, self._stream())
            return
        except errors.ResourceExhausted:
            idle = [h for h in self._group_list if h.refs == 0 and h.flat is not None]
            if self._resident_depth == 0 or not idle:
                raise
        for h in idle:
            self._drop(h)
        self._engine.fetch(g.name, self._stream())

    def _release(self, g):
        if g.refs <= 0:
            raise errors.Internal(f"strata.torch: group '{g.name}' released more often than fetched",
                                  status="INTERNAL")
        g.refs -= 1
        if g.refs > 0 or self._resident_depth > 0:
            return
        self._drop(g)

    def _drop(self, g):
        with _as_internal():
            for rec in g.params:
                rec.p.data = self._placeholder(rec)
                rec.p.__class__ = _guard_class(rec.cls)
        self._by_storage.pop(_storage_address(g.flat), None)
        g.flat = None
        self._engine.release(g.name, self._stream())

    @contextlib.contextmanager
    def _resident(self):
        """Engine.resident(): groups fetched inside stay fetched until the
        context ends, as far as the device budget holds them."""
        self._resident_depth += 1
        try:
            yield self
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0:
                for g in self._group_list:
                    if g.refs == 0 and g.flat is not None:
                        self._drop(g)

    @contextlib.contextmanager
    def _gathered(self):
        """Engine.gathered(): every group fetched inside; at the end,
        write_check.py's check that no parameter was written."""
        with self.resident():
            for g in self._group_list:
                self._acquire(g)
            try:
                before = self._fingerprints()
                try:
                    yield self
                except BaseException:
                    self._undo_writes(before)  # and the error goes on, unmasked
                    raise
                # (No step or checkpoint load rewrites them inside: both refuse fetched groups.)
                self._check_unwritten(before)
            finally:
                for g in self._group_list:
                    self._release(g)
