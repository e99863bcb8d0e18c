"""strata.torch: an existing PyTorch training loop offloads to strata.

    engine = strata.torch.initialize(model, config)
    for batch in loader:
        loss = model(batch)
        engine.backward(loss)
        engine.step()

strata keeps the parameters' storage (fetched group by group around each
module's forward and backward), the gradients, the optimizer state and the
optimizer; the model, the data and the loop stay the user's. docs/python.md
is the contract and the guide.
"""
from .adapter import Engine, initialize
from .meta import meta_init
from .safetensors import load_file, load_dir

__all__ = ["Engine", "initialize", "meta_init", "load_file", "load_dir"]
