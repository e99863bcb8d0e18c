"""What the adapter knows of each parameter, fetch group and unit (the
records every room of strata.torch reads and writes), and the timer of the
adapter's own work in the step (StepStats.adapter_seconds)."""
import time


class _Param:
    """One parameter of the model (tied aliases share one record)."""
    __slots__ = ("name", "p", "cls", "group", "offset", "numel", "shape", "trainable", "acc", "aliases")

    def __init__(self, name, p):
        self.name, self.p, self.cls = name, p, type(p)
        self.shape = tuple(p.shape)
        self.numel = p.numel()
        self.trainable = bool(p.requires_grad)
        self.group = None
        self.offset = 0
        self.acc = None
        self.aliases = [name]


class _Group:
    """One fetch group: its parameters, its fetched copy (fetch.py) and this
    micro-batch's gradients (gradients.py)."""
    __slots__ = ("name", "params", "info", "refs", "flat", "grads", "got", "sent", "outstanding", "backward_refs",
                 "handover", "trainable", "numel", "grad_begin")

    def __init__(self, name):
        self.name = name
        self.params = []
        self.info = None
        self.refs = 0              # acquisitions (fetches are counted)
        self.flat = None           # the fetched compute copies (a flat tensor)
        self.grads = None          # this micro-batch's gradient buffer (flat), or None
        self.got = None            # ids of the _Params whose gradient is in it
        self.sent = False          # this micro-batch's gradients handed to the engine
        self.outstanding = 0       # grad-enabled forward calls whose backward has not ended
        self.backward_refs = 0     # acquisitions made by _PreBackward, not yet released
        self.handover = 0          # fetches of a recomputation that its backward's _PreBackward takes over
        self.trainable = False
        self.numel = 0
        self.grad_begin = 0        # where the gradient buffer begins in the layout (its first trainable slot)


class _Unit:
    """A module whose forward needs some groups."""
    __slots__ = ("module", "name", "groups", "engine", "saving", "mark_inputs", "__weakref__")

    def __init__(self, module, name, engine):
        self.module, self.name, self.groups, self.engine = module, name, [], engine
        self.saving = False
        self.mark_inputs = False


def _timed(fn):
    """Adds the method's wall time to self.adapter_seconds (the adapter's own
    work in the step: hooks, fetches and copies, gradient moves)."""
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.adapter_seconds += time.perf_counter() - t0
    wrapper.__name__ = fn.__name__
    return wrapper
