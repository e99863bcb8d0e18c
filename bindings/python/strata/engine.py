"""The `strata` engine from Python: a thin, complete wrapper of the C API.

Memory crosses as an address and a size: pass any object with the buffer
protocol (bytearray, memoryview, array, numpy), a torch tensor (contiguous,
on the CPU for the *_host calls), or an `(address, nbytes)` pair.
"""
import ctypes
import dataclasses
import json
import os
import threading

from . import _capi
from . import errors

_lib = _capi.lib
_DTYPE_NAMES = {_capi.DTYPE_F32: "f32", _capi.DTYPE_BF16: "bf16", _capi.DTYPE_F16: "f16"}
_DTYPE_CODES = {"f32": _capi.DTYPE_F32, "fp32": _capi.DTYPE_F32, "float32": _capi.DTYPE_F32,
                "bf16": _capi.DTYPE_BF16, "bfloat16": _capi.DTYPE_BF16,
                "f16": _capi.DTYPE_F16, "fp16": _capi.DTYPE_F16, "float16": _capi.DTYPE_F16}
_DEVICE_NAMES = {_capi.DEVICE_HOST: "host", _capi.DEVICE_CUDA: "cuda"}
DTYPE_SIZE = {"f32": 4, "bf16": 2, "f16": 2}


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return _capi.LIBRARY_VERSION


def library_path():
    """The libstrata.so this package loaded."""
    return _capi.path


def _raise(status, what=None):
    name = _lib.strata_status_name(status).decode()
    message = _lib.strata_last_error().decode(errors="replace")
    if what:
        message = f"{what}: {message}"
    cls = errors.BY_CODE.get(status, errors.Error)
    raise cls(message, status=name, code=status)


def check(status, what=None):
    """Raises the strata.Error subclass of a non-OK C status."""
    if status != 0:
        _raise(status, what)


def _b(s):
    return None if s is None else s.encode()


def _config_text(config):
    """A config given as a dict, a JSON string or a path to a JSON file."""
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if text.lstrip().startswith("{"):
            return text
        with open(text) as f:
            return f.read()
    raise TypeError(f"strata: config must be a dict, a JSON string or a path, not {type(config).__name__}")


def _options(total_num_steps, hidden_size, strict, world_size=None):
    """strata_config_options: what the program knows that the config may leave
    to it ("auto"), and the ranks DeepSpeed's train_batch_size counts. None or
    0: not given."""
    o = _capi.new(_capi.ConfigOptions)
    for name, value in (("total_num_steps", total_num_steps), ("hidden_size", hidden_size),
                        ("world_size", world_size)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"strata: {name} must be an int, not {type(value).__name__}")
        setattr(o, name, value)  # a negative value is the C API's INVALID_ARGUMENT
    o.strict = 1 if strict else 0
    return o


def _store_callbacks(store, raised):
    """strata_ranks' store_set and store_get over a key-value store object with
    torch.distributed.Store's methods: set(key, value), get(key) (waiting for
    the key up to the store's own timeout) and, where it has one,
    wait(keys, timedelta). A failure returns nonzero (the C API names the key);
    what interrupted a callback (Ctrl-C: KeyboardInterrupt, SystemExit) goes
    into `raised`, for the caller to raise once the C call has returned."""
    import datetime

    def guarded(fn):
        try:
            fn()
            return 0
        except Exception:  # noqa: BLE001 (a callback must not raise into C)
            return 1
        except BaseException as e:  # noqa: BLE001
            raised.append(e)
            return 1

    def set_(user, key, value, length):
        return guarded(lambda: store.set(key.decode(), ctypes.string_at(value, length)))

    longer = {}  # a value longer than the room given, until the call that gives room for it

    def get(user, key, buf, cap, length, timeout_ms):
        def fetch():
            k = key.decode()
            value = longer.pop(k, None)
            if value is None:
                if hasattr(store, "wait"):
                    store.wait([k], datetime.timedelta(milliseconds=timeout_ms))
                value = bytes(store.get(k))
            length[0] = len(value)
            if len(value) <= cap:
                ctypes.memmove(buf, value, len(value))
            else:
                longer[k] = value
        return guarded(fetch)

    return _capi.STORE_SET_FN(set_), _capi.STORE_GET_FN(get)


def _ranks(ranks):
    """strata_ranks from Engine's `ranks` argument: "launcher" (the launcher's
    environment: torchrun, mpirun, srun; one rank without one), or a dict with
    rank, size, store_dir (or store: a key-value store object with
    torch.distributed.Store's set, get and wait, such as torch.distributed's
    default store, which ranks on machines without a shared file system meet
    through) and optionally run_id, backend, timeout_s, local_rank and
    local_size (this rank among its machine's: its GPU and its share of the
    cores; not given: every rank on this machine). Returns (the struct, what
    keeps its strings and callbacks alive, and the list a store callback
    puts what interrupted it in)."""
    r = _capi.new(_capi.Ranks)
    keep, raised = [], []
    if ranks == "launcher":
        return r, keep, raised
    if not isinstance(ranks, dict):
        raise TypeError(f"strata: ranks must be \"launcher\" or a dict, not {type(ranks).__name__}")
    unknown = set(ranks) - {"rank", "size", "store_dir", "store", "run_id", "backend", "timeout_s", "local_rank",
                            "local_size"}
    if unknown:
        raise TypeError(f"strata: ranks has unknown keys {sorted(unknown)} (rank, size, store_dir, store, run_id, "
                        f"backend, timeout_s, local_rank, local_size)")
    for key in ("rank", "size"):
        if key not in ranks:
            raise TypeError(f"strata: ranks needs '{key}'")
        setattr(r, key, int(ranks[key]))
    for key in ("store_dir", "run_id", "backend"):
        if ranks.get(key) is not None:
            keep.append(str(ranks[key]).encode())
            setattr(r, key, keep[-1])
    if ranks.get("store") is not None:
        store = ranks["store"]
        if not (callable(getattr(store, "set", None)) and callable(getattr(store, "get", None))):
            raise TypeError(f"strata: ranks' store must have set(key, value) and get(key) (a torch.distributed "
                            f"Store), not {type(store).__name__}")
        keep.extend(_store_callbacks(store, raised))
        r.store_set, r.store_get = keep[-2], keep[-1]
    if ranks.get("timeout_s") is not None:
        r.timeout_ms = int(round(float(ranks["timeout_s"]) * 1000))
    if (ranks.get("local_rank") is None) != (ranks.get("local_size") is None):
        raise TypeError("strata: ranks needs both 'local_rank' and 'local_size', or neither")
    if ranks.get("local_size") is not None:
        r.local_size = int(ranks["local_size"])
        r.local_rank = int(ranks["local_rank"])
    return r, keep, raised


def config_check(config, *, total_num_steps=None, hidden_size=None, strict=False, world_size=None):
    """Checks a config without creating an engine; returns its warning count.
    total_num_steps resolves "auto" in scheduler.params.total_num_steps,
    hidden_size the "auto" bucket sizes, strict makes unknown keys errors
    (docs/config.md, "auto"), and world_size is the data-parallel ranks
    train_batch_size counts (DeepSpeed's rule; default one). Raises
    InvalidArgument naming the key path."""
    warnings = ctypes.c_uint32(0)
    o = _options(total_num_steps, hidden_size, strict, world_size)
    check(_lib.strata_config_check_ex(_config_text(config).encode(), ctypes.byref(o), ctypes.byref(warnings)))
    return warnings.value


def config_resolve(config, *, total_num_steps=None, hidden_size=None, strict=False, world_size=None):
    """The resolved config (every key, defaults filled in) as a dict; the
    keyword arguments as config_check's."""
    out = ctypes.c_void_p()
    o = _options(total_num_steps, hidden_size, strict, world_size)
    check(_lib.strata_config_resolve_ex(_config_text(config).encode(), ctypes.byref(o), ctypes.byref(out)))
    try:
        return json.loads(ctypes.string_at(out.value).decode())
    finally:
        _lib.strata_string_free(out)


def _address(buf, writable):
    """(address, nbytes, keepalive) of a buffer-like object."""
    if isinstance(buf, tuple) and len(buf) == 2:
        return int(buf[0]), int(buf[1]), None
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # a torch tensor
        if not buf.is_contiguous():
            raise errors.InvalidArgument("strata: the tensor must be contiguous", status="INVALID_ARGUMENT")
        if buf.device.type != "cpu":
            raise errors.InvalidArgument(f"strata: the tensor must be in host memory, not on {buf.device}",
                                         status="INVALID_ARGUMENT")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise errors.InvalidArgument("strata: the buffer is read-only", status="INVALID_ARGUMENT")
    if not mv.c_contiguous:
        raise errors.InvalidArgument("strata: the buffer must be C-contiguous", status="INVALID_ARGUMENT")
    if mv.readonly:
        arr = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv)  # read-only: a copy
    else:
        arr = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(arr), mv.nbytes, (arr, mv)


@dataclasses.dataclass
class GroupInfo:
    size_bytes: int
    dtype: str          # "f32", "bf16", "f16"
    device: str         # "host", "cuda"
    param_count: int
    trainable: bool
    device_index: int = 0  # the CUDA device's ordinal (0 on the host device)
    # Where its gradient buffer begins in its layout: the first trainable slot (frozen
    # parameters come first and have none; size_bytes when none trains).
    grad_offset_bytes: int = 0

    @property
    def numel(self):
        return self.size_bytes // DTYPE_SIZE[self.dtype]

    @property
    def grad_offset(self):
        """grad_offset_bytes in elements: parameter p's gradient is at its offset less this."""
        return self.grad_offset_bytes // DTYPE_SIZE[self.dtype]


@dataclasses.dataclass
class View:
    """Device memory handed out by the engine: valid until release (compute
    copies) or grads_ready (gradient buffer)."""
    data: int
    size_bytes: int
    dtype: str
    device: str
    offset_bytes: int = 0  # where data sits in the group's layout (a gradient buffer's grad_offset_bytes)


@dataclasses.dataclass
class StepStats:
    skipped: bool = False
    step: int = 0
    skipped_total: int = 0
    grad_norm: float = 0.0
    lr: float = 0.0
    loss_scale: float = 1.0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_nvme_read: int = 0
    bytes_nvme_write: int = 0
    fetch_seconds: float = 0.0
    grads_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    prefetched: int = 0
    speculative_discarded: int = 0
    resident: int = 0
    resident_bytes: int = 0
    norm_step: int = 0
    bytes_nvme_read_total: int = 0   # all swap paths, since the engine was created (as of this step_end)
    bytes_nvme_write_total: int = 0
    # Where the CPU optimizer's threads run (strata.cpu_adam.bind), as finalize chose them: one line
    # (threads, pinned or not and why, NUMA node, CPUs), the thread count, pinned, the node (-1: none).
    cpu_adam_binding: str = ""
    cpu_adam_threads: int = 0
    cpu_adam_pinned: bool = False
    cpu_adam_numa_node: int = -1
    # The NUMA node the pinned memory was placed on (this rank's GPU's, several ranks on a machine of
    # several nodes, or strata.cpu_adam.numa_node); -1: where first touched.
    pinned_memory_numa_node: int = -1
    # Bytes of a frozen base read from its safetensors files this step (strata.frozen_base), in
    # none of the bytes_nvme_* figures (the swap paths').
    bytes_file_read: int = 0
    # The swap reads the resident fetches did not make (their groups' homes on nvme; see strata.h).
    resident_nvme_bytes: int = 0
    adapter_seconds: float = 0.0  # strata.torch: its own time in the step (hooks, copies); not from the C API

    @classmethod
    def _from_c(cls, s):
        c_fields = {name for name, _ in s._fields_}
        values = {f.name: getattr(s, f.name) for f in dataclasses.fields(cls) if f.name in c_fields}
        values["skipped"] = bool(values["skipped"])
        values["cpu_adam_binding"] = (values["cpu_adam_binding"] or b"").decode()
        values["cpu_adam_pinned"] = bool(values["cpu_adam_pinned"])
        return cls(**values)


@dataclasses.dataclass
class SwapStats:
    """One swap path's traffic (strata_swap_stats): the last step's bytes on it
    (its share of StepStats.bytes_nvme_read / bytes_nvme_write) and the totals
    since the engine was created, as the I/O layer counted them (every step's,
    plus finalize's first contents, checkpoints, export and read_master)."""
    path: str
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_read_total: int = 0
    bytes_written_total: int = 0


class Engine:
    """One strata engine (strata_engine*). Call order as the C API's:
    add_optimizer_group* -> register+ -> [init_from_safetensors] -> finalize ->
    per micro-batch fetch/release, grads, micro_step_end -> step_end. Every
    failure raises a strata.Error subclass with the C status name and message.
    Use as a context manager, or call close(). total_num_steps, hidden_size
    and strict as config_check's (strata_engine_create_ex). ranks: one of
    several data-parallel ranks (strata_engine_create_ranked; docs/distributed.md):
    "launcher" takes them from torchrun's, mpirun's or srun's environment (one
    rank without a launcher), a dict gives rank, size and store_dir or store
    (and optionally run_id, backend, timeout_s, local_rank, local_size:
    _ranks says more); None: an engine of its own."""

    def __init__(self, config, *, total_num_steps=None, hidden_size=None, strict=False, ranks=None):
        handle = ctypes.c_void_p()
        o = _options(total_num_steps, hidden_size, strict)
        if ranks is None:
            check(_lib.strata_engine_create_ex(_config_text(config).encode(), ctypes.byref(o), ctypes.byref(handle)))
        else:
            r, keep, raised = _ranks(ranks)
            status = _lib.strata_engine_create_ranked(_config_text(config).encode(), ctypes.byref(o), ctypes.byref(r),
                                                      ctypes.byref(handle))
            if raised:
                if handle:
                    _lib.strata_engine_destroy(handle)
                raise raised[0]  # a Ctrl-C while the ranks met, as if it came here
            check(status)
            del keep
        self._h = handle
        self._inits = []          # (INIT_FN, callable) kept alive until finalize returns
        self._init_error = None   # the first exception an init callable raised
        self._lock = threading.Lock()

    # --- life ---------------------------------------------------------------------------------
    @property
    def handle(self):
        if not self._h:
            raise errors.FailedPrecondition("strata: the engine is closed", status="FAILED_PRECONDITION")
        return self._h

    @property
    def rank(self):
        """This engine's rank among the data-parallel ranks (0 alone)."""
        return self._rank_and_size()[0]

    @property
    def world_size(self):
        """The number of data-parallel ranks (1 alone)."""
        return self._rank_and_size()[1]

    def _rank_and_size(self):
        rank, size = ctypes.c_int32(), ctypes.c_int32()
        check(_lib.strata_engine_rank(self.handle, ctypes.byref(rank), ctypes.byref(size)))
        return rank.value, size.value

    def close(self):
        """Destroys the engine (its swap files too, unless strata.io.keep_files)."""
        h, self._h = getattr(self, "_h", None), None
        if h:
            _lib.strata_engine_destroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # --- set-up -------------------------------------------------------------------------------
    def add_optimizer_group(self, name="", weight_decay=0.0, lr_scale=1.0):
        """An optimizer group with its own weight decay and lr scale; returns its index."""
        d = _capi.new(_capi.OptimizerGroupDesc)
        d.name, d.weight_decay, d.lr_scale = _b(name), float(weight_decay), float(lr_scale)
        index = ctypes.c_int32()
        check(_lib.strata_optimizer_group_add(self.handle, ctypes.byref(d), ctypes.byref(index)))
        return index.value

    def register(self, name, shape, group=None, frozen=False, optimizer_group=0, init=None):
        """Registers a parameter. `init(name, out)` fills `out`, a ctypes float
        array of numel elements, with the initial fp32 values (called during
        finalize); None takes them from init_from_safetensors."""
        d = _capi.new(_capi.ParamDesc)
        dims = (ctypes.c_int64 * max(1, len(shape)))(*[int(x) for x in shape])
        d.name, d.group = _b(name), _b(group)
        d.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)) if len(shape) else None
        d.ndim = len(shape)
        d.frozen = 1 if frozen else 0
        d.optimizer_group = int(optimizer_group)
        if init is None:
            fn = _capi.INIT_FN()
        else:
            fn = _capi.INIT_FN(self._init_trampoline(init))
            self._inits.append(fn)
        check(_lib.strata_param_register(self.handle, ctypes.byref(d), fn, None))

    def _init_trampoline(self, init):
        def call(name, out, numel, user_data):
            try:
                init(name.decode(), ctypes.cast(out, ctypes.POINTER(ctypes.c_float * numel)).contents)
                return 0
            except BaseException as e:  # noqa: BLE001 - carried to finalize
                if self._init_error is None:
                    self._init_error = e
                return errors.Internal.code
        return call

    def init_from_safetensors(self, path, name_prefix=""):
        """Initial values of the parameters registered without `init` come from
        safetensors files: a directory (model.safetensors, or shards with
        model.safetensors.index.json) or one file. Tensor name = prefix + name."""
        check(_lib.strata_init_from_safetensors(self.handle, os.fspath(path).encode(), _b(name_prefix)))

    def finalize(self):
        """Lays out and places every state and writes the initial values."""
        self._finalize(lambda: _lib.strata_engine_finalize(self.handle))

    def finalize_from_checkpoint(self, root):
        """finalize() then load_checkpoint(root), without the initial values the
        checkpoint replaces: the init functions and safetensors files of every
        group whose parameters all train are not called or read, and their
        state is written once, by the load. Returns the framework blob. A
        missing checkpoint or another model's raises as a failed finalize does
        (nothing is built; make a new engine); a damaged state file leaves the
        engine refusing everything but load_checkpoint until one succeeds."""
        root = os.fspath(root).encode()
        self._finalize(lambda: _lib.strata_engine_finalize_from_checkpoint(self.handle, root))
        return self._checkpoint_blob()

    def _finalize(self, call):
        self._init_error = None
        try:
            status = call()
            if status != 0 and self._init_error is not None:
                err = self._init_error
                raise errors.BY_CODE.get(status, errors.Error)(
                    f"{_lib.strata_last_error().decode()} (the init function raised {type(err).__name__}: {err})",
                    status=_lib.strata_status_name(status).decode(), code=status) from err
            check(status)
        finally:
            self._inits.clear()

    # --- layout ---------------------------------------------------------------------------------
    def group_info(self, group):
        out = _capi.new(_capi.GroupInfo)
        check(_lib.strata_group_info_get(self.handle, group.encode(), ctypes.byref(out)))
        return GroupInfo(out.size_bytes, _DTYPE_NAMES[out.dtype], _DEVICE_NAMES[out.device], out.param_count,
                         bool(out.trainable), out.device_index, out.grad_offset_bytes)

    def param_offset(self, name):
        """(offset in elements of the group's dtype, group name) of a parameter."""
        off = ctypes.c_int64()
        group = ctypes.c_char_p()
        check(_lib.strata_param_offset(self.handle, name.encode(), ctypes.byref(off), ctypes.byref(group)))
        return off.value, group.value.decode()

    # --- the step -------------------------------------------------------------------------------
    def fetch(self, group, stream=None):
        """The group's compute copies on the device (a View valid until release)."""
        v = _capi.new(_capi.GroupView)
        check(_lib.strata_group_fetch(self.handle, group.encode(), stream, ctypes.byref(v)))
        return View(v.data, v.size_bytes, _DTYPE_NAMES[v.dtype], _DEVICE_NAMES[v.device])

    def wait(self, group):
        check(_lib.strata_group_wait(self.handle, group.encode()))

    def fetch_host(self, group, dst):
        """Fetches a group and copies its compute copies into dst (exactly the
        group's size_bytes); the group stays fetched until release."""
        addr, nbytes, _keep = _address(dst, writable=True)
        check(_lib.strata_group_fetch_host(self.handle, group.encode(), addr, nbytes))

    def release(self, group, stream=None):
        if stream is None:
            check(_lib.strata_group_release(self.handle, group.encode()))
        else:
            check(_lib.strata_group_release_on(self.handle, group.encode(), stream))

    def grad_buffer(self, group):
        v = _capi.new(_capi.GroupView)
        check(_lib.strata_group_grad_buffer(self.handle, group.encode(), ctypes.byref(v)))
        return View(v.data, v.size_bytes, _DTYPE_NAMES[v.dtype], _DEVICE_NAMES[v.device], v.offset_bytes)

    def grads_ready(self, group, stream=None):
        check(_lib.strata_group_grads_ready(self.handle, group.encode(), stream))

    def no_grads(self, group, params):
        """`params` (names) of `group` got no gradient in the micro-batch under
        way (their slots hold zeros): before its grads_ready of that
        micro-batch. Under strata.no_grad "skip" a parameter without one in
        every micro-batch of a step keeps its weights, moments and step count."""
        names = [p.encode() for p in params]
        arr = (ctypes.c_char_p * max(1, len(names)))(*names)
        check(_lib.strata_group_no_grads(self.handle, group.encode(), arr, len(names)))

    def grads_host(self, group, src):
        """Copies a group's gradients (its dtype, times loss_scale) in and hands
        them over: src laid out like the group (size_bytes), or like its
        gradient buffer (from grad_offset_bytes on)."""
        addr, nbytes, _keep = _address(src, writable=False)
        check(_lib.strata_group_grads_host(self.handle, group.encode(), addr, nbytes))

    def dlpack(self, group, kind="compute"):
        """A DLPack capsule ("dltensor") over the fetched group's compute copies
        (kind "compute") or its gradient buffer (kind "grads", as grad_buffer):
        1-D, the group's dtype, zero-copy. The memory stays the tensor's while
        it lives."""
        code = {"compute": _capi.VIEW_COMPUTE, "grads": _capi.VIEW_GRAD_BUFFER}.get(kind)
        if code is None:
            raise ValueError(f"strata: dlpack kind must be 'compute' or 'grads', not {kind!r}")
        managed = ctypes.c_void_p()
        check(_lib.strata_group_dlpack(self.handle, group.encode(), code, ctypes.byref(managed)))
        return _dlpack_capsule(managed.value)

    def micro_step_end(self):
        check(_lib.strata_micro_step_end(self.handle))

    def step_end(self):
        s = _capi.new(_capi.StepStatsC)
        check(_lib.strata_step_end(self.handle, ctypes.byref(s)))
        return StepStats._from_c(s)

    def stats(self):
        s = _capi.new(_capi.StepStatsC)
        check(_lib.strata_stats(self.handle, ctypes.byref(s)))
        return StepStats._from_c(s)

    def swap_stats(self):
        """Each swap path's traffic (SwapStats), in the order of strata.io.paths
        (else the placements' nvme_path); empty before finalize and when no
        state lives on nvme. The totals are taken now: an optimizer job still
        running adds to them."""
        count = ctypes.c_uint32()
        check(_lib.strata_swap_path_count(self.handle, ctypes.byref(count)))
        out = []
        for i in range(count.value):
            s = _capi.new(_capi.SwapStatsC)
            check(_lib.strata_swap_stats_get(self.handle, i, ctypes.byref(s)))
            out.append(SwapStats(path=s.path.decode(errors="replace"), bytes_read=s.bytes_read,
                                 bytes_written=s.bytes_written, bytes_read_total=s.bytes_read_total,
                                 bytes_written_total=s.bytes_written_total))
        return out

    @property
    def loss_scale(self):
        out = ctypes.c_double()
        check(_lib.strata_loss_scale(self.handle, ctypes.byref(out)))
        return out.value

    def set_lr(self, lr):
        check(_lib.strata_lr_set(self.handle, float(lr)))

    def read_master(self, name, out):
        """Copies a trainable parameter's fp32 master weights into out (a
        writable buffer of numel floats)."""
        if hasattr(out, "dtype") and str(out.dtype) not in ("torch.float32", "float32"):
            raise errors.InvalidArgument(f"strata: read_master writes float32, not {out.dtype}",
                                         status="INVALID_ARGUMENT")
        addr, nbytes, _keep = _address(out, writable=True)
        check(_lib.strata_param_read_master(self.handle, name.encode(),
                                            ctypes.cast(addr, ctypes.POINTER(ctypes.c_float)), nbytes // 4))

    def read_weights(self, reads):
        """The weights of several parameters as a state_dict holds them:
        `reads` is a list of (name, out) pairs, out a writable float32 buffer
        of the parameter's numel; a trainable parameter's fp32 masters, a
        frozen one's compute copies. With several ranks every rank calls it
        with the same names in the same order: the masters are gathered from
        the ranks' shards."""
        n = len(reads)
        names = (ctypes.c_char_p * n)()
        outs = (ctypes.POINTER(ctypes.c_float) * n)()
        numels = (ctypes.c_int64 * n)()
        keep = []
        for i, (name, out) in enumerate(reads):
            if hasattr(out, "dtype") and str(out.dtype) not in ("torch.float32", "float32"):
                raise errors.InvalidArgument(f"strata: read_weights writes float32, not {out.dtype} ('{name}')",
                                             status="INVALID_ARGUMENT")
            addr, nbytes, k = _address(out, writable=True)
            keep.append(k)
            names[i] = name.encode()
            outs[i] = ctypes.cast(addr, ctypes.POINTER(ctypes.c_float))
            numels[i] = nbytes // 4
        check(_lib.strata_params_read_weights(self.handle, names, outs, numels, n))

    # --- checkpoints and export -------------------------------------------------------------------
    def save_checkpoint(self, root, blob=b""):
        blob = bytes(blob)
        check(_lib.strata_checkpoint_save(self.handle, os.fspath(root).encode(), blob or None, len(blob)))

    def load_checkpoint(self, root):
        """Loads a checkpoint; returns the framework blob saved with it."""
        check(_lib.strata_checkpoint_load(self.handle, os.fspath(root).encode()))
        return self._checkpoint_blob()

    def _checkpoint_blob(self):
        """The framework blob of the checkpoint the engine loaded last."""
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        check(_lib.strata_checkpoint_blob(self.handle, ctypes.byref(data), ctypes.byref(size)))
        return ctypes.string_at(data.value, size.value) if size.value else b""

    def export_safetensors(self, directory, dtype="bf16", max_shard_bytes=0):
        code = _DTYPE_CODES.get(str(dtype).lower())
        if code is None:
            raise ValueError(f"strata: export dtype must be f32, bf16 or f16, not {dtype!r}")
        check(_lib.strata_export_safetensors(self.handle, os.fspath(directory).encode(), code,
                                             int(max_shard_bytes)))


# --- DLPack capsules ------------------------------------------------------------------------------
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The destructor gets the dying capsule as a raw pointer: call the C functions on it
# without making a Python reference to it.
_IsValidRaw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_GetPointerRaw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# DLManagedTensor: {DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*)}
# DLTensor: data, device{int32 type, int32 id}, int32 ndim, DLDataType{u8,u8,u16}, shape*, strides*, u64 offset
_DLTENSOR_BYTES = 8 + 8 + 4 + 4 + 8 + 8 + 8
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule_ptr):
    # A capsule never consumed (renamed "used_dltensor" by the consumer) still
    # owns its tensor: call the tensor's deleter.
    if _IsValidRaw(capsule_ptr, b"dltensor"):
        managed = _GetPointerRaw(capsule_ptr, b"dltensor")
        if managed:
            deleter = ctypes.c_void_p.from_address(managed + _DLTENSOR_BYTES + 8).value
            if deleter:
                _DELETER(deleter)(managed)


def _dlpack_capsule(managed):
    return _PyCapsule_New(managed, b"dltensor", ctypes.cast(_capsule_destructor, ctypes.c_void_p))
