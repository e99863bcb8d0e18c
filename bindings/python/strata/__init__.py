"""strata: train models far larger than one GPU's memory.

The `strata` package wraps strata's C API (libstrata.so, through ctypes: no
compiled extension) and `strata.torch` adapts a PyTorch training loop to it:

    import strata.torch
    engine = strata.torch.initialize(model, "config.json")
    for batch in data:
        loss = model(batch)
        engine.backward(loss)
        engine.step()

docs/python.md is the guide.
"""
from .errors import (AlreadyExists, Cancelled, DataLoss, Error, FailedPrecondition, Internal, InvalidArgument,
                     NotFetched, NotFound, OutOfMemory, OutOfRange, ParameterWritten, PermissionDenied,
                     ResourceExhausted, Unavailable, Unimplemented)
from .errors import IOError_ as IOError  # noqa: A001 - strata.IOError is the C status IO_ERROR
from .engine import (Engine, GroupInfo, StepStats, SwapStats, View, check, config_check, config_resolve,
                     library_path, version)

__version__ = version()
__all__ = [
    "Engine", "GroupInfo", "StepStats", "SwapStats", "View", "check", "config_check", "config_resolve", "library_path",
    "version", "Error", "InvalidArgument", "NotFound", "AlreadyExists", "PermissionDenied", "OutOfMemory",
    "ResourceExhausted", "FailedPrecondition", "OutOfRange", "Unimplemented", "Unavailable", "IOError", "DataLoss",
    "Cancelled", "Internal", "NotFetched", "ParameterWritten",
]
