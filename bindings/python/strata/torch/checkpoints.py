"""The weights and the training state out and back: state_dict() (the fp32
masters, read through the C API's read_master, and the frozen parameters'
compute copies), export() to safetensors, save_checkpoint() and
load_checkpoint() with the model's persistent buffers, the RNG states and the
caller's client_state."""
import io
import os
import random

import torch

from .. import errors


class Checkpoints:
    """The Engine's part for state_dict, export and checkpoints. Reads the
    model (`module`) and the groups; resets `_micro` and `_failed` (gradients.py)
    on load."""

    def _state_dict(self, dtype, gather=False, trainable_only=False):
        """Engine.state_dict(): the masters of trainable parameters, the compute
        copies of frozen ones, and the buffers, in model.state_dict()'s order.
        `gather`: the masters gathered from every rank's shard in one call
        every rank makes (read_weights), else read_master's (with several
        ranks, this rank's shard only)."""
        out = {}
        masters = []
        for g in self._group_list:
            flat = None
            for rec in g.params:
                if rec.trainable:
                    t = torch.empty(rec.shape, dtype=torch.float32)
                    if gather:
                        masters.append((self._name_prefix + rec.name, t))
                    else:
                        self._engine.read_master(self._name_prefix + rec.name, t)
                elif trainable_only:
                    continue
                else:
                    if flat is None:
                        flat = self._host_copy(g)
                    t = flat[rec.offset:rec.offset + rec.numel].view(rec.shape).clone()
                for alias in rec.aliases:
                    out[alias] = t
        if gather:
            self._engine.read_weights(masters)
        out = {k: v.to(dtype) for k, v in out.items()}
        if not trainable_only:
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

    def _export(self, directory, dtype, max_shard_bytes):
        os.makedirs(directory, exist_ok=True)
        self._engine.export_safetensors(directory, dtype, max_shard_bytes)

    def _save_checkpoint(self, root, client_state, save_rng):
        """Engine.save_checkpoint(): the engine's state, with a blob of the
        persistent buffers, the client_state and the RNG states."""
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

    def _load_checkpoint(self, root, load_rng):
        """Engine.load_checkpoint(): the engine's state, then the blob's buffers
        and RNG states; returns its client_state."""
        raw = self._engine.load_checkpoint(root)
        self._micro = 0
        self._failed = None
        return self._restore_blob(raw, load_rng)

    def _restore_blob(self, raw, load_rng):
        """The framework blob of a checkpoint the engine loaded: the model's
        buffers and (with load_rng) the RNG states back; returns its
        client_state."""
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
