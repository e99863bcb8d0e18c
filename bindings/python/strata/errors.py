"""strata's errors: one exception class per C status (strata_status)."""


class Error(Exception):
    """A strata call failed. `status` is the C status name ("INVALID_ARGUMENT"),
    `code` its number, and str() the library's message (strata_last_error)."""

    status = "UNKNOWN"
    code = -1

    def __init__(self, message, status=None, code=None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class InvalidArgument(Error, ValueError):
    status, code = "INVALID_ARGUMENT", 1


class NotFound(Error, LookupError):
    status, code = "NOT_FOUND", 2


class AlreadyExists(Error):
    status, code = "ALREADY_EXISTS", 3


class PermissionDenied(Error, PermissionError):
    status, code = "PERMISSION_DENIED", 4


class OutOfMemory(Error, MemoryError):
    status, code = "OUT_OF_MEMORY", 5


class ResourceExhausted(Error):
    status, code = "RESOURCE_EXHAUSTED", 6


class FailedPrecondition(Error, RuntimeError):
    status, code = "FAILED_PRECONDITION", 7


class OutOfRange(Error, IndexError):
    status, code = "OUT_OF_RANGE", 8


class Unimplemented(Error, NotImplementedError):
    status, code = "UNIMPLEMENTED", 9


class Unavailable(Error):
    status, code = "UNAVAILABLE", 10


class IOError_(Error, OSError):
    status, code = "IO_ERROR", 11


class DataLoss(Error):
    status, code = "DATA_LOSS", 12


class Cancelled(Error):
    status, code = "CANCELLED", 13


class Internal(Error):
    status, code = "INTERNAL", 14


IOError_.__name__ = IOError_.__qualname__ = "IOError"

BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, PermissionDenied, OutOfMemory,
                                      ResourceExhausted, FailedPrecondition, OutOfRange, Unimplemented, Unavailable,
                                      IOError_, DataLoss, Cancelled, Internal)}


class NotFetched(FailedPrecondition):
    """A parameter was used while its fetch group is not on the device (the
    adapter raises it, not the library)."""


class ParameterWritten(FailedPrecondition):
    """A parameter was written inside engine.gathered(), whose compute copies
    are lent to be read: the write cannot reach the fp32 master weights the
    engine trains (the adapter raises it, not the library)."""
