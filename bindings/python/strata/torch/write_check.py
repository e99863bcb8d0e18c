"""ParameterWritten: gathered() lends the compute copies to be read; each
parameter's bits are summed at its entry and exit, and a written parameter is
named in the error after its compute copy is put back from its master."""
import torch

from .. import errors

_FINGERPRINT_CHUNK = 1 << 22  # elements summed at once by WriteCheck._fingerprints
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _names(recs, most=5):
    """'a', 'b' and 3 more: parameter names for a message."""
    shown = ", ".join(f"'{rec.name}'" for rec in recs[:most])
    return shown + (f" and {len(recs) - most} more" if len(recs) > most else "")


class WriteCheck:
    """The Engine's part that finds writes inside gathered() (fetch.py's
    `_gathered` calls it, every group fetched). Owns `_fingerprint_weights`;
    reads `_order` and each group's `flat`, and the masters through the C
    API's read_master."""

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
                    flat = rec.group.flat[rec.offset:rec.offset + rec.numel]
                    # Rounded to nearest even, as the engine rounds its masters to compute copies.
                    # With several ranks this rank holds its shard's masters only (the rest NaN).
                    own = ~torch.isnan(master.view(-1))
                    flat[own] = master.view(-1)[own].to(flat.dtype)
        if self._engine.world_size > 1:
            # The rest of a write stays, and ranks that could undo all of theirs would go on
            # without the others: every rank that saw a write refuses its next step.
            self._diverged = (f"{_names(written)} {'was' if len(written) == 1 else 'were'} written inside "
                              f"engine.gathered() on rank {self._engine.rank} of {self._engine.world_size}, where "
                              f"only the rank's own shard of a trainable parameter can be undone")
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
