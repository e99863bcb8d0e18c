"""Gradients: each trainable parameter's gradient moved into its group's
buffer (a hook on its AccumulateGrad node), a group's buffer handed to the
engine once its backward is done, and the backward's end (what is left handed
over, a failed backward completed with NaN gradients or abandoned)."""
import torch
import torch.utils.dlpack

from .. import errors
from .placeholders import _as_internal
from .records import _timed


class Gradients:
    """The Engine's part for the backward. Owns `_in_backward`, `_micro` and
    `_failed`; each group's `grads`, `got` and `sent`. Releases the
    backward's fetches (hooks.py's `backward_refs`, `handover`,
    `_recomputing`) when it ends."""

    def _make_grad_hook(self, rec):
        def hook(grad_inputs, grad_outputs):
            p = rec.p
            with _as_internal():
                grad = p.grad
                p.grad = None
            if grad is None:
                return
            self._add_grad(rec, grad)
        return hook

    @_timed
    def _add_grad(self, rec, grad):
        g = rec.group
        if not self._in_backward:
            raise errors.FailedPrecondition(
                f"strata.torch: a gradient of '{rec.name}' arrived outside engine.backward(): call "
                f"engine.backward(loss) instead of loss.backward() (the engine scales the loss and hands the "
                f"gradients over)", status="FAILED_PRECONDITION")
        if g.sent:
            raise errors.FailedPrecondition(
                f"strata.torch: a gradient of '{rec.name}' arrived after the gradients of its group '{g.name}' "
                f"were handed to the engine (is it used outside the modules of its group?)",
                status="FAILED_PRECONDITION")
        if g.grads is None:
            g.grads = self._grad_buffer(g)
            g.got = set()
        slot = self._grad_slot(g, rec).view(rec.shape)
        with torch.no_grad():
            if id(rec) in g.got:
                slot.add_(grad.to(self.dtype))
            else:
                slot.copy_(grad)
                g.got.add(id(rec))

    @staticmethod
    def _grad_slot(g, rec):
        """rec's elements of g's gradient buffer, which begins at the group's first trainable slot."""
        at = rec.offset - g.grad_begin
        return g.grads[at:at + rec.numel]

    def _grad_buffer(self, g):
        if self._zero_copy:
            return torch.utils.dlpack.from_dlpack(self._engine.dlpack(g.name, "grads"))
        return torch.empty(g.numel - g.grad_begin, dtype=self.dtype)

    def _send(self, g):
        if g.grads is None:
            g.grads = self._grad_buffer(g)
            g.got = set()
        absent = []
        with torch.no_grad():
            for rec in g.params:  # trainable parameters without a gradient this micro-batch: zeros
                if rec.trainable and id(rec) not in g.got:
                    self._grad_slot(g, rec).zero_()
                    absent.append(self._name_prefix + rec.name)
        if absent:
            # Said to the engine: under strata.no_grad "skip" one without a gradient in every
            # micro-batch of the step is left as it is, as torch's optimizers skip a None grad.
            self._engine.no_grads(g.name, absent)
        if self._zero_copy:
            # End the view first: a view still alive at grads_ready makes the
            # engine set the buffer aside (and take a new one for the next group).
            g.grads = g.got = None
            self._engine.grads_ready(g.name, self._stream())
        else:
            self._engine.grads_host(g.name, g.grads)
        g.grads = g.got = None
        g.sent = True

    # --- the backward -----------------------------------------------------------------------------
    def _backward(self, loss, retain_graph):
        """Engine.backward(): the checks, the loss scaled, loss.backward(), and
        the micro-batch closed (a backward that raised part-way too, with NaN
        gradients, where the engine skips non-finite steps)."""
        if self._failed:
            raise errors.FailedPrecondition(
                f"strata.torch: an earlier backward failed part-way ({self._failed}); some of that micro-batch's "
                f"gradients reached the engine and cannot be taken back, and strata.nonfinite is not \"skip\" "
                f"(which would have skipped the step): this step cannot be completed; start a new engine from "
                f"the last checkpoint", status="FAILED_PRECONDITION")
        if self._micro >= self.gradient_accumulation_steps:
            raise errors.FailedPrecondition(
                f"strata.torch: backward called {self._micro + 1} times before step(); the config's "
                f"gradient_accumulation_steps is {self.gradient_accumulation_steps}", status="FAILED_PRECONDITION")
        self._end_saving()  # a forward that raised may have left the hooks on
        scale = self._engine.loss_scale
        if scale != 1.0:
            loss = loss * scale
        self._in_backward = True
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException as e:
            self._in_backward = False
            if not self._nonfinite_skips():
                self._abandon_backward()
                self._failed = f"{type(e).__name__}: {e}"
                raise
            # Complete the micro-batch with NaN gradients: the engine skips the
            # step (strata.nonfinite "skip", or the fp16 scaler), so no weight
            # or moment takes the partial gradients.
            self._end_backward(poison=True)
            self._close_micro_batch()
            raise
        self._in_backward = False
        self._end_backward()
        self._close_micro_batch()

    def _pad_step(self):
        """step(partial=True): the step's missing micro-batches, empty (every
        trainable group's gradients zero, its parameters counted as without
        one), each closed as a backward closes its own."""
        if self._micro == 0:
            raise errors.FailedPrecondition(
                "strata.torch: step(partial=True) with no backward in the step: a step needs at least one "
                "micro-batch's gradients", status="FAILED_PRECONDITION")
        if self._in_backward:
            raise errors.FailedPrecondition("strata.torch: step() inside a backward", status="FAILED_PRECONDITION")
        if self._failed:
            raise errors.FailedPrecondition(
                f"strata.torch: an earlier backward failed part-way ({self._failed}); this step cannot be "
                f"completed", status="FAILED_PRECONDITION")
        try:
            while self._micro < self.gradient_accumulation_steps:
                self._end_backward()
                self._close_micro_batch()
        except BaseException as e:
            # Part of a micro-batch may have reached the engine: not to be sent again.
            self._abandon_backward()
            self._failed = f"step(partial=True): {type(e).__name__}: {e}"
            raise

    def _close_micro_batch(self):
        self._micro += 1
        if self._micro < self.gradient_accumulation_steps:
            self._engine.micro_step_end()

    def _release_backward_fetches(self):
        for unit in self._recomputing:  # recomputations torch stopped early
            for g in unit.groups:
                self._release(g)
        self._recomputing = []
        for g in self._group_list:
            while g.handover > 0:
                g.handover -= 1
                self._release(g)
            while g.backward_refs > 0:
                g.backward_refs -= 1
                self._release(g)

    def _abandon_backward(self):
        self._release_backward_fetches()
        for g in self._group_list:
            g.grads = g.got = None
            g.sent = False
            g.outstanding = 0

    def _nonfinite_skips(self):
        return bool(self.config.get("fp16", {}).get("enabled")) or \
            self.config.get("strata", {}).get("nonfinite", "skip") == "skip"

    @_timed
    def _end_backward(self, poison=False):
        self._release_backward_fetches()
        for g in self._group_list:
            if g.trainable and not g.sent:
                if poison:
                    if g.grads is None:
                        g.grads = self._grad_buffer(g)
                    g.grads.fill_(float("nan"))
                    g.got = {id(rec) for rec in g.params}
                self._send(g)
        for g in self._group_list:
            g.sent = False
            g.outstanding = 0
