"""strata.torch: an existing PyTorch training loop offloads to strata.

    engine = strata.torch.initialize(model, config)
    for batch in loader:
        loss = model(batch)
        engine.backward(loss)
        engine.step()

strata keeps the parameters' storage (fetched group by group around each
module's forward and backward), the gradients, the optimizer state and the
optimizer; the model, the data and the loop stay the user's. docs/python.md
is the contract and the guide. The modules, one concern each (README.md
beside this file has the table):

    adapter.py       the facade: Engine, initialize
    setup.py         parameters, groups and units, param_groups, registration
    records.py       the records of parameters, groups, units; _timed
    placeholders.py  parameters that are not fetched (NotFetched), deepcopy
    fetch.py         fetch and release, resident(), gathered()
    hooks.py         forward hooks, backward markers, saved tensors
    gradients.py     gradients to the engine, backward
    write_check.py   ParameterWritten (writes inside gathered())
    checkpoints.py   state_dict, export, save/load_checkpoint
    meta.py          meta_init
    safetensors.py   load_file, load_dir, save_file, tensor_names
    lora.py          LoRA adapters in plain torch, saved and loaded under PEFT's names
"""
from . import lora
from .adapter import Engine, initialize
from .meta import meta_init
from .safetensors import load_dir, load_file, save_file

__all__ = ["Engine", "initialize", "meta_init", "load_file", "load_dir", "save_file", "lora"]
