"""strata.hf: the Hugging Face Trainer on strata (docs/python.md, "The Hugging
Face Trainer").

    trainer = strata.hf.Trainer(model=model, args=training_args, train_dataset=ds,
                                strata_config="strata.json")

    Trainer           transformers.Trainer with strata owning the weights,
                      gradients, optimizer and schedule (trainer.py)
    from_pretrained   a transformers model on the meta device, its weights
                      streamed from its safetensors by strata (trainer.py)
    trainer_config    a config's "auto" values filled from TrainingArguments
                      (auto.py; needs no transformers)
    check_arguments   what the Trainer refuses, named (auto.py; likewise)
    signature_gaps    the replaced Trainer methods whose arguments differ
                      from the installed transformers' (auto.py; likewise)

Trainer and from_pretrained import transformers when first used; without it
they raise ImportError saying so."""
from .auto import check_arguments, signature_gaps, trainer_config, warmup_steps  # noqa: F401


def __getattr__(name):
    if name in ("Trainer", "from_pretrained"):
        try:
            from . import trainer
        except ModuleNotFoundError as e:
            if e.name != "transformers":
                raise
            raise ImportError(f"strata.hf.{name} needs transformers (pip install transformers); "
                              f"this Python has none") from e
        return getattr(trainer, name)
    raise AttributeError(f"module 'strata.hf' has no attribute {name!r}")
