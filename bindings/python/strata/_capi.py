"""ctypes declarations of strata's C API (bindings/c/include/strata/strata.h)
and the search for libstrata.so.

The library is looked up, in order: the path in the STRATA_LIBRARY
environment variable; next to this package (a copy placed there, or the
library directory recorded by `meson install`); the build trees of a source
checkout (build-release/, build/). The first one found must be ABI-compatible
with the headers this module was written for, or loading fails naming both
versions.
"""
import ctypes
import os

# The C header's version this module was written against.
HEADER_MAJOR = 0
HEADER_MINOR = 5

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIB_NAMES = ("libstrata.so", "libstrata.so.0")


def _candidates():
    env = os.environ.get("STRATA_LIBRARY")
    if env:
        yield env
        return
    for name in _LIB_NAMES:
        yield os.path.join(_HERE, name)
    try:
        from . import _install_paths  # written by meson install
        for name in _LIB_NAMES:
            yield os.path.join(_install_paths.LIBDIR, name)
    except ImportError:
        pass
    # A source checkout: bindings/python/strata -> the repository root.
    root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    for build in ("build-release", "build"):
        yield os.path.join(root, build, "bindings", "c", "libstrata.so")


class LibraryNotFound(ImportError):
    pass


def _load():
    tried = []
    for path in _candidates():
        tried.append(path)
        if os.path.exists(path) or (path == os.environ.get("STRATA_LIBRARY") and os.sep not in path):
            try:  # a path, or a bare soname the dynamic linker finds (STRATA_LIBRARY=libstrata.so.0)
                return ctypes.CDLL(path), path
            except OSError as e:
                raise LibraryNotFound(f"strata: cannot load {path}: {e}") from e
    raise LibraryNotFound(
        "strata: libstrata.so not found; build strata (scripts/run.sh or meson) or set STRATA_LIBRARY. "
        "Looked in: " + ", ".join(tried))


# --- C types -------------------------------------------------------------------------------------
c_status = ctypes.c_int
c_engine_p = ctypes.c_void_p
INIT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64,
                           ctypes.c_void_p)


class ConfigOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("strict", ctypes.c_int32), ("total_num_steps", ctypes.c_int64),
                ("hidden_size", ctypes.c_int64), ("world_size", ctypes.c_int32)]


STORE_SET_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)
STORE_GET_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_int64)


class Ranks(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("size", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("backend", ctypes.c_char_p), ("store_dir", ctypes.c_char_p), ("run_id", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int64), ("local_size", ctypes.c_int32), ("local_rank", ctypes.c_int32),
                ("store_user", ctypes.c_void_p), ("store_set", STORE_SET_FN), ("store_get", STORE_GET_FN)]


class OptimizerGroupDesc(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("name", ctypes.c_char_p), ("weight_decay", ctypes.c_double),
                ("lr_scale", ctypes.c_double)]


class ParamDesc(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("name", ctypes.c_char_p),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("ndim", ctypes.c_int32), ("group", ctypes.c_char_p),
                ("frozen", ctypes.c_int32), ("optimizer_group", ctypes.c_int32)]


class GroupInfo(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("size_bytes", ctypes.c_uint64), ("dtype", ctypes.c_int),
                ("device", ctypes.c_int), ("param_count", ctypes.c_int32), ("trainable", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("grad_offset_bytes", ctypes.c_uint64)]


class GroupView(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("data", ctypes.c_void_p), ("size_bytes", ctypes.c_uint64),
                ("dtype", ctypes.c_int), ("device", ctypes.c_int), ("offset_bytes", ctypes.c_uint64)]


class StepStatsC(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("skipped", ctypes.c_int32), ("step", ctypes.c_int64),
                ("skipped_total", ctypes.c_int64), ("grad_norm", ctypes.c_double), ("lr", ctypes.c_double),
                ("loss_scale", ctypes.c_double), ("bytes_h2d", ctypes.c_uint64), ("bytes_d2h", ctypes.c_uint64),
                ("bytes_nvme_read", ctypes.c_uint64), ("bytes_nvme_write", ctypes.c_uint64),
                ("fetch_seconds", ctypes.c_double), ("grads_seconds", ctypes.c_double),
                ("optimizer_seconds", ctypes.c_double), ("prefetched", ctypes.c_int64),
                ("speculative_discarded", ctypes.c_int64), ("resident", ctypes.c_int64),
                ("resident_bytes", ctypes.c_uint64), ("norm_step", ctypes.c_int64),
                ("bytes_nvme_read_total", ctypes.c_uint64), ("bytes_nvme_write_total", ctypes.c_uint64),
                ("cpu_adam_binding", ctypes.c_char_p), ("cpu_adam_threads", ctypes.c_int32),
                ("cpu_adam_pinned", ctypes.c_int32), ("cpu_adam_numa_node", ctypes.c_int32),
                ("pinned_memory_numa_node", ctypes.c_int32),
                ("bytes_file_read", ctypes.c_uint64), ("resident_nvme_bytes", ctypes.c_uint64)]


class SwapStatsC(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("path", ctypes.c_char_p), ("bytes_read", ctypes.c_uint64),
                ("bytes_written", ctypes.c_uint64), ("bytes_read_total", ctypes.c_uint64),
                ("bytes_written_total", ctypes.c_uint64)]


def _sized(cls):
    s = cls()
    s.struct_size = ctypes.sizeof(cls)
    return s


def new(cls):
    """An instance of a versioned struct with struct_size set (its STRATA_*_INIT)."""
    return _sized(cls)


_P = ctypes.POINTER
_u = ctypes.c_void_p
_s = ctypes.c_char_p
# name: (restype, argtypes)
_PROTOTYPES = {
    "strata_version": (ctypes.c_char_p, []),
    "strata_abi_compatible": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "strata_status_name": (ctypes.c_char_p, [c_status]),
    "strata_last_error": (ctypes.c_char_p, []),
    "strata_config_check": (c_status, [_s, _P(ctypes.c_uint32)]),
    "strata_config_resolve": (c_status, [_s, _P(ctypes.c_void_p)]),
    "strata_string_free": (None, [ctypes.c_void_p]),
    "strata_engine_create": (c_status, [_s, _P(c_engine_p)]),
    "strata_engine_destroy": (None, [c_engine_p]),
    "strata_optimizer_group_add": (c_status, [c_engine_p, _P(OptimizerGroupDesc), _P(ctypes.c_int32)]),
    "strata_param_register": (c_status, [c_engine_p, _P(ParamDesc), INIT_FN, _u]),
    "strata_engine_finalize": (c_status, [c_engine_p]),
    "strata_engine_finalize_from_checkpoint": (c_status, [c_engine_p, _s]),
    "strata_group_info_get": (c_status, [c_engine_p, _s, _P(GroupInfo)]),
    "strata_param_offset": (c_status, [c_engine_p, _s, _P(ctypes.c_int64), _P(ctypes.c_char_p)]),
    "strata_group_fetch": (c_status, [c_engine_p, _s, _u, _P(GroupView)]),
    "strata_group_wait": (c_status, [c_engine_p, _s]),
    "strata_group_fetch_host": (c_status, [c_engine_p, _s, _u, ctypes.c_size_t]),
    "strata_group_release": (c_status, [c_engine_p, _s]),
    "strata_group_release_on": (c_status, [c_engine_p, _s, _u]),
    "strata_group_grad_buffer": (c_status, [c_engine_p, _s, _P(GroupView)]),
    "strata_group_grads_ready": (c_status, [c_engine_p, _s, _u]),
    "strata_group_grads_host": (c_status, [c_engine_p, _s, _u, ctypes.c_size_t]),
    "strata_group_no_grads": (c_status, [c_engine_p, _s, _P(ctypes.c_char_p), ctypes.c_size_t]),
    "strata_micro_step_end": (c_status, [c_engine_p]),
    "strata_step_end": (c_status, [c_engine_p, _P(StepStatsC)]),
    "strata_stats": (c_status, [c_engine_p, _P(StepStatsC)]),
    "strata_loss_scale": (c_status, [c_engine_p, _P(ctypes.c_double)]),
    "strata_lr_set": (c_status, [c_engine_p, ctypes.c_double]),
    "strata_param_read_master": (c_status, [c_engine_p, _s, _P(ctypes.c_float), ctypes.c_int64]),
    "strata_checkpoint_save": (c_status, [c_engine_p, _s, _u, ctypes.c_size_t]),
    "strata_checkpoint_load": (c_status, [c_engine_p, _s]),
    "strata_checkpoint_blob": (c_status, [c_engine_p, _P(ctypes.c_void_p), _P(ctypes.c_size_t)]),
    "strata_export_safetensors": (c_status, [c_engine_p, _s, ctypes.c_int, ctypes.c_uint64]),
    # 0.2
    "strata_group_dlpack": (c_status, [c_engine_p, _s, ctypes.c_int, _P(ctypes.c_void_p)]),
    "strata_init_from_safetensors": (c_status, [c_engine_p, _s, _s]),
    # 0.3
    "strata_config_check_ex": (c_status, [_s, _P(ConfigOptions), _P(ctypes.c_uint32)]),
    "strata_config_resolve_ex": (c_status, [_s, _P(ConfigOptions), _P(ctypes.c_void_p)]),
    "strata_engine_create_ex": (c_status, [_s, _P(ConfigOptions), _P(c_engine_p)]),
    # 0.4
    "strata_swap_path_count": (c_status, [c_engine_p, _P(ctypes.c_uint32)]),
    "strata_swap_stats_get": (c_status, [c_engine_p, ctypes.c_uint32, _P(SwapStatsC)]),
    # 0.5
    "strata_engine_create_ranked": (c_status, [_s, _P(ConfigOptions), _P(Ranks), _P(c_engine_p)]),
    "strata_engine_rank": (c_status, [c_engine_p, _P(ctypes.c_int32), _P(ctypes.c_int32)]),
    "strata_params_read_weights": (c_status, [c_engine_p, _P(ctypes.c_char_p), _P(_P(ctypes.c_float)),
                                              _P(ctypes.c_int64), ctypes.c_size_t]),
}


class VersionMismatch(ImportError):
    pass


def _bind(lib):
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    return missing


lib, path = _load()
if not hasattr(lib, "strata_abi_compatible") or not hasattr(lib, "strata_version"):
    raise VersionMismatch(f"strata: {path} is not a strata library (no strata_version / strata_abi_compatible)")
_bind_missing = _bind(lib)
LIBRARY_VERSION = lib.strata_version().decode()
if not lib.strata_abi_compatible(HEADER_MAJOR, HEADER_MINOR):
    raise VersionMismatch(
        f"strata: {path} is version {LIBRARY_VERSION}, which cannot serve this Python package "
        f"(written for the C API {HEADER_MAJOR}.{HEADER_MINOR}); rebuild strata or point STRATA_LIBRARY "
        f"at a matching libstrata.so")
if _bind_missing:
    raise VersionMismatch(f"strata: {path} (version {LIBRARY_VERSION}) lacks {', '.join(_bind_missing)}")

DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
DEVICE_HOST, DEVICE_CUDA = 0, 1
VIEW_COMPUTE, VIEW_GRADS, VIEW_GRAD_BUFFER = 0, 1, 2
