"""The PyTorch adapter (its contract: docs/python.md): the facade, `Engine`
and `initialize`. The work is in the rooms beside this file (README.md lists
them); `Engine` is made of their parts and holds the public calls.

How it works, in one place:
- Every parameter of the module is registered with the engine under its name
  in `named_parameters()` (setup.py); the Parameter objects stay (only `.data`
  changes): a view of the fetched group while it is fetched (fetch.py), else a
  placeholder of the right shape, dtype and device that holds no memory and
  raises NotFetched (naming the parameter and its group) when an operation
  reads it (placeholders.py).
- Fetch groups: one per repeated block (the children of every ModuleList, or
  the `blocks` given), the other parameters grouped by the module that owns
  them. A "unit" is a module whose forward needs some groups: each block, and
  each module outside the blocks that owns parameters (a tied parameter makes
  its user fetch the owner's group too).
- Forward (hooks.py): a unit's pre-hook acquires its groups (fetch on the
  first acquire: fetches are counted), its post-hook releases them. With grad
  enabled the unit's outputs pass through _PreBackward (its backward acquires
  the groups again before the unit's backward runs) and its inputs through
  _PostBackward (its backward fires after the unit's backward: release).
- Gradients (gradients.py): a post-hook on each trainable parameter's
  AccumulateGrad node moves `p.grad` into the group's gradient buffer (adding
  when it arrives twice in a micro-step) and clears it. A group's gradients
  are handed to the engine when every grad-enabled forward call of the units
  using it has had its backward; what is left is handed over when `backward`
  ends (groups whose inputs did not need gradients, groups that got none:
  zeros).
- The engine owns accumulation, clipping, loss scaling and the optimizer:
  `backward` scales the loss (fp16), `step` is `step_end` once every
  micro-batch of the step is in.
- Outside the step: gathered() fetches every group and, at its end, checks
  that no parameter was written (a write cannot reach the master weights;
  ParameterWritten, write_check.py). copy.deepcopy of the model gives plain
  modules: the hooks deep-copy to inert ones, a parameter that is not fetched
  to a plain one holding its compute copy. state_dict, export and
  checkpoints: checkpoints.py.
"""
import os
import shutil
import tempfile
import threading
import uuid

import torch

from .. import errors
from .. import engine as _engine
from .checkpoints import Checkpoints
from .fetch import Fetching
from .gradients import Gradients
from .hooks import Hooks
from .placeholders import Placeholders, _owner_of_param
from .setup import Setup
from .write_check import WriteCheck


def _torch_distributed_ranks():
    """The ranks of torch.distributed's default process group, or 0 when none is initialised."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_world_size()


def _default_store():
    """torch.distributed's default store (the TCP store of init_process_group's
    rendezvous, which every rank reaches), or None where this torch has none to give."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (an API of torch's own: fall back to a folder)
        return None


def _ranks_from_torch_distributed():
    """strata's ranks from an initialised torch.distributed process group: its
    rank and size, and where they meet: torch.distributed's own store (the
    ranks reach it wherever they run, no shared file system needed) under a
    run id rank 0 draws, or, with STRATA_RENDEZVOUS_DIR set or where torch
    gives no store, a folder rank 0 makes (under STRATA_RENDEZVOUS_DIR, else
    the temporary directory: the ranks must share that file system). Rank 0
    broadcasts what it made over the group; a folder rank 0 cannot make fails
    every rank, naming it. Returns (ranks, rendezvous), rendezvous to pass to
    _end_rendezvous once the engine is made."""
    dist = torch.distributed
    rank, size = dist.get_rank(), dist.get_world_size()
    parent = os.environ.get("STRATA_RENDEZVOUS_DIR") or None
    # Rank 0 decides (its environment, its torch); the others follow what it broadcasts.
    store = _default_store() if rank != 0 or not parent else None
    made = [None, None]
    if rank == 0:
        if store is not None:
            made = ["", uuid.uuid4().hex]
        else:
            try:
                made = [tempfile.mkdtemp(prefix="strata-torch-rendezvous-", dir=parent), uuid.uuid4().hex]
            except OSError as e:  # every rank hears of it, none waits for a folder
                made = [None, f"rank 0 could not make a rendezvous folder under {parent or tempfile.gettempdir()}: {e}"]
    # broadcast_object_list sends through the group's backend (with NCCL, from
    # this rank's current CUDA device, which the caller has set).
    dist.broadcast_object_list(made, src=0)
    store_dir, run_id = made
    if store_dir is None:
        raise errors.Unavailable(f"strata.torch: meeting the other ranks over torch.distributed: {run_id} "
                                 f"(STRATA_RENDEZVOUS_DIR names the folder's parent)", status="UNAVAILABLE")
    # This rank among its machine's (its GPU, its share of the cores) comes
    # from the launcher's environment, read by the library (strata_ranks).
    if store_dir == "":
        if store is None:  # rank 0's torch gave one and this rank's none: the ranks' torch differ
            raise errors.Unavailable("strata.torch: rank 0 meets the others through torch.distributed's store and "
                                     "this rank's torch has none to give; set STRATA_RENDEZVOUS_DIR on rank 0 (a "
                                     "folder every rank sees) to meet there instead", status="UNAVAILABLE")
        return ({"rank": rank, "size": size, "store": store, "run_id": f"strata-torch-{run_id}"},
                (rank, None))
    return {"rank": rank, "size": size, "store_dir": store_dir, "run_id": run_id}, (rank, store_dir)


_launcher_engines = [0, threading.Lock()]  # engines made meeting through torchrun's store, and its lock


def _launcher_store():
    """torchrun's own store, where its agent keeps one at MASTER_ADDR:MASTER_PORT
    for its workers (TORCHELASTIC_USE_AGENT_STORE) and the run allows no
    restarts (TORCHELASTIC_MAX_RESTARTS 0, torchrun's default: a restart's
    count is each machine's own, and the store may keep an earlier attempt's
    keys): a client of it; None where there is no such store (the same on
    every rank: the launcher's variables). One that cannot be reached raises,
    naming it, rather than leave the other ranks waiting for this one."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" or env.get("TORCHELASTIC_MAX_RESTARTS") != "0" \
            or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT", "").isdigit():
        return None
    import datetime
    try:
        wait = min(60.0, float(env.get("STRATA_TIMEOUT_S") or 60.0))  # the meeting's timeout, at most a minute
    except ValueError:
        wait = 60.0  # (the library names a bad STRATA_TIMEOUT_S)
    try:
        return torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False,
                                          datetime.timedelta(seconds=max(wait, 0.001)))
    except Exception as e:  # noqa: BLE001
        raise errors.Unavailable(
            f"strata.torch: torchrun's store at {env['MASTER_ADDR']}:{env['MASTER_PORT']}, where the ranks meet, "
            f"cannot be reached: {e} (set STRATA_RENDEZVOUS_DIR to meet in a folder every rank sees)",
            status="UNAVAILABLE") from e


def _ranks_from_torchrun_store():
    """Under torchrun without an initialised torch.distributed group: strata's
    ranks meeting through torchrun's agent store (no shared file system
    needed across machines), unless STRATA_RENDEZVOUS_DIR says to meet in a
    folder; "launcher" (the library reads the environment and meets in a
    folder) where there is no such store. The run id: torchrun's run and
    port, and this process's count of such engines (every rank makes its
    engines in the same order)."""
    env = os.environ
    if env.get("STRATA_RENDEZVOUS_DIR") or not env.get("WORLD_SIZE", "").isdigit() or int(env["WORLD_SIZE"]) < 2 \
            or not env.get("RANK", "").isdigit():
        return "launcher"
    store = _launcher_store()
    if store is None:
        return "launcher"
    with _launcher_engines[1]:
        _launcher_engines[0] += 1
        count = _launcher_engines[0]
    run = f"strata-torchrun-{env.get('TORCHELASTIC_RUN_ID', 'none')}-{env['MASTER_PORT']}-{count}"
    return {"rank": int(env["RANK"]), "size": int(env["WORLD_SIZE"]), "store": store, "run_id": run}


def _end_rendezvous(rendezvous):
    """Once every rank's engine is made (or failed), rank 0 removes the rendezvous folder."""
    rank, store_dir = rendezvous
    if store_dir is None:  # torch.distributed's store: its keys go with it
        return
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(store_dir, ignore_errors=True)


class Engine(Setup, Hooks, Fetching, Gradients, Placeholders, WriteCheck, Checkpoints):
    """A PyTorch module trained through strata. Made by initialize()."""

    def __init__(self, model, config, *, blocks=None, param_groups=None, weights=None, weights_prefix="",
                 name_prefix="", copy_views=False, total_num_steps=None, hidden_size=None, strict=False,
                 ranks="launcher", weights_missing="error", resume_from=None):
        if weights_missing not in ("error", "keep"):
            raise ValueError(f"strata.torch: weights_missing = {weights_missing!r}; it is \"error\" or \"keep\"")
        self._weights_missing = weights_missing
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.torch: model must be a torch.nn.Module, not {type(model).__name__}")
        self.module = model
        text = _engine._config_text(config)  # a path is read once
        known = dict(total_num_steps=total_num_steps, hidden_size=hidden_size, strict=strict)
        rendezvous = None
        # torch's CUDA device, when torch has chosen one: the engine's must be
        # it (making the engine sets the thread's current device to its own).
        self._torch_cuda_device = (torch.cuda.current_device()
                                   if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        if ranks == "launcher" and _torch_distributed_ranks() > 1:
            ranks, rendezvous = _ranks_from_torch_distributed()
        elif ranks == "launcher":
            ranks = _ranks_from_torchrun_store()
        try:
            self._engine = _engine.Engine(text, ranks=ranks, **known)
        except BaseException:
            if rendezvous is not None:
                _end_rendezvous(rendezvous)
            raise
        if rendezvous is not None:
            try:
                _end_rendezvous(rendezvous)
            except BaseException:
                self._engine.close()
                raise
        # Resolved for the engine's ranks: train_batch_size counts every rank's micro-batches.
        try:
            self.config = _engine.config_resolve(text, world_size=self._engine.world_size, **known)
        except BaseException:
            self._engine.close()
            raise
        self._closed = False
        self._units = []             # setup.py's (with _params, _groups, _group_list, _order, set there)
        # hooks.py
        self._hooks = []
        self._saving = None          # the saved-tensor hooks context while a forward runs (see _pack)
        self._root_saving = False    # the model's own forward turned it on
        self._recomputing = []       # units whose forward runs inside the backward (recomputation)
        # fetch.py
        self._resident_depth = 0
        # DLPack views of the engine's buffers (zero-copy); False: the *_host copies.
        self._zero_copy = not copy_views
        self._copy_views = copy_views
        self._by_storage = {}        # storage address of a fetched group's buffer -> the group
        # gradients.py
        self._failed = None          # why a backward failed part-way (the step cannot be completed)
        self._diverged = None        # several ranks: why this rank's weights differ from the others' (write_check.py)
        self._in_backward = False
        self._micro = 0
        # write_check.py
        self._fingerprint_weights = None  # see _fingerprints
        # the step (step() here, _timed in records.py)
        self.adapter_seconds = 0.0  # the adapter's own time since the last step() (see records._timed)
        self.gradient_accumulation_steps = int(self.config.get("gradient_accumulation_steps", 1))
        # The client_state of the checkpoint `resume_from` named, else None.
        self.client_state = None
        try:
            raw = self._setup(model, blocks, param_groups, weights, weights_prefix, name_prefix, resume_from)
            if resume_from is not None:
                self.client_state = self._restore_blob(raw, load_rng=True)
        except BaseException:
            self.close()
            raise

    # --- the step -----------------------------------------------------------------------------------
    def backward(self, loss, retain_graph=False):
        """Back-propagates loss (times the loss scale under fp16) and hands every
        trainable group's gradients to the engine. Call step() after it."""
        self._backward(loss, retain_graph)

    def step(self, partial=False):
        """Ends the step once gradient_accumulation_steps backward passes are in
        (strata_step_end) and returns its StepStats; before that returns None
        (call it after every backward, as with DeepSpeed, or once per step).

        partial=True ends it now, after k >= 1 backward passes of the
        gradient_accumulation_steps G (an epoch's last step, under a loop
        that does not drop it): the G - k missing micro-batches are empty
        (zero gradients, no parameter counted as having one, so strata.no_grad
        "skip" skips only a parameter none of the k gave a gradient). The
        gradients are, as in every step, the micro-batches' sum divided by G:
        scale the k losses by G / k for their mean. With several ranks every
        rank ends the step after the same k (the ranks sum each micro-batch's
        gradients group by group, in one order)."""
        if partial and self._micro < self.gradient_accumulation_steps:
            self._pad_step()
        if self._micro < self.gradient_accumulation_steps:
            return None
        if self._diverged:
            raise errors.FailedPrecondition(
                f"strata.torch: {self._diverged}: its compute copies differ from the other ranks', so the "
                f"ranks no longer train one model; start again with new engines", status="FAILED_PRECONDITION")
        self._micro = 0
        stats = self._engine.step_end()
        stats.adapter_seconds, self.adapter_seconds = self.adapter_seconds, 0.0
        return stats

    @property
    def micro_batches(self):
        """Backward passes of the step under way (0 between steps)."""
        return self._micro

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

    @property
    def rank(self):
        """This process's rank among the data-parallel ranks (0 alone)."""
        return self._engine.rank

    @property
    def world_size(self):
        """The number of data-parallel ranks (1 alone)."""
        return self._engine.world_size

    def state_dict(self, dtype=torch.float32, shard=False, trainable_only=False):
        """The model's weights under its own names (every alias of a tied weight,
        and buffers, as module.state_dict()): the fp32 masters of trainable
        parameters, the compute copies of frozen ones, in `dtype` on the CPU.
        With several ranks every rank calls it (the masters are gathered from
        the ranks' shards, each block's once); shard=True gives this rank's
        own masters instead, without the others (their elements NaN). At
        zero_optimization.stage 3 with several ranks every rank calls it
        either way: the frozen parameters' compute copies are gathered.
        trainable_only=True: the trainable parameters' masters alone (no
        frozen weight is read, no buffer): LoRA's adapters without the base."""
        return self._state_dict(dtype, gather=self.world_size > 1 and not shard, trainable_only=trainable_only)

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


def initialize(model, config, *, blocks=None, param_groups=None, weights=None, weights_prefix="", name_prefix="",
               copy_views=False, total_num_steps=None, hidden_size=None, strict=False, ranks="launcher",
               weights_missing="error", resume_from=None):
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
        A parameter the files lack is an error, except LoRA's adapters
        (strata.torch.lora.apply), which keep their own draws; with
        weights_missing="keep", every parameter that has real values (not on
        the meta device) and that the files lack keeps them (a PEFT model's
        adapters over a base checkpoint), each named in a warning.
    name_prefix: prepended to every parameter name in the engine (checkpoints,
        export).
    copy_views: on the host device, copy compute copies and gradients through
        the *_host calls instead of DLPack views of the engine's memory.
    total_num_steps: the run's optimizer steps, for "auto" in
        scheduler.params.total_num_steps; hidden_size: the model's hidden size,
        for the "auto" bucket sizes; strict: unknown keys are errors
        (docs/config.md, "auto").
    ranks: data-parallel ranks (docs/distributed.md). "launcher" (the default):
        torch.distributed's default process group when one is initialised (its
        rank and size; the rendezvous folder broadcast over it), else the
        launcher's environment (torchrun or DeepSpeed's launcher, mpirun,
        srun), one rank without one; a dict (rank, size, store_dir, ...) as
        strata.Engine takes; None: this process alone, whatever launched it.
        Every rank runs the same model and calls on its own micro-batches; the
        gradients are averaged over all of them.
    resume_from: a checkpoint root (or step folder) to start from, as
        load_checkpoint(resume_from) right after initialize would, but without
        the initial values it replaces: the model's values (or the `weights`
        files) are not read for blocks whose parameters all train, and their
        state crosses the swap drive once. Such blocks may be on the meta
        device without `weights`. The checkpoint's client_state is
        engine.client_state; the RNG states and buffers are restored.
    Returns a strata.torch.Engine: engine.backward(loss), engine.step().
    """
    return Engine(model, config, blocks=blocks, param_groups=param_groups, weights=weights,
                  weights_prefix=weights_prefix, name_prefix=name_prefix, copy_views=copy_views,
                  total_num_steps=total_num_steps, hidden_size=hidden_size, strict=strict, ranks=ranks,
                  weights_missing=weights_missing, resume_from=resume_from)
