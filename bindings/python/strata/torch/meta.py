"""Building a model without memory for its parameters."""
import contextlib

import torch


@contextlib.contextmanager
def meta_init():
    """Inside this context, every nn.Parameter a module registers is created
    on the meta device (no memory), while buffers stay where the module puts
    them. A model built here takes its weights from safetensors files through
    strata.torch.initialize(model, config, weights=DIR), so the host never
    holds the whole model.

        with strata.torch.meta_init():
            model = Llama(cfg)
    """
    original = torch.nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            kind = type(param)
            param = kind(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original
