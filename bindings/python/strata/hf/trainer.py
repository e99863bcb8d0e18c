"""strata.hf.Trainer: transformers.Trainer with strata owning the model's
weights, gradients, optimizer and schedule (the contract: docs/python.md,
"The Hugging Face Trainer").

How it hooks into the Trainer (transformers 5.x; the DeepSpeed integration's
pattern, where the engine steps inside the backward and the optimizer and
scheduler the loop holds are shims):
- The model is never moved or wrapped by the Trainer or accelerate:
  `_move_model_to_device` does nothing and `_wrap_model` returns a thin
  module around the model (so `accelerator.prepare` sees no model of its
  own: no device move, no DataParallel, no autocast wrapper).
- `create_scheduler` (called once the loop knows its step count) makes the
  engine: the config's "auto" values filled from the arguments (auto.py),
  `strata.torch.initialize` with the model's hidden size and the run's
  steps. `create_optimizer` returns a shim the loop may call step() on.
- `training_step`: forward (the Trainer's `compute_loss`), `engine.backward`
  and `engine.step()` (which ends the step after the last micro-batch; an
  epoch's last step, shorter, with step(partial=True)). The loss handed to
  strata is scaled so that strata's sum over gradient_accumulation_steps is
  the Trainer's (token-weighted, or the mean of the step's micro-batches);
  the loss returned is the one the Trainer logs, scaled as it scales it.
- Clipping is strata's (`gradient_clipping` from max_grad_norm): the
  Trainer's own is turned off in the arguments it holds, and the logs carry
  strata's gradient norm.
- The schedule: the config's "scheduler" when it has one (run by strata),
  else the Trainer's (`lr_scheduler_type`, warmup) computed over a stand-in
  optimizer and handed to strata with set_lr before each step.
- Checkpoints: the Trainer's checkpoint-N folder holds strata's checkpoint
  (strata/, every rank's state, the schedule in its client_state) beside
  trainer_state.json and the RNG states; resuming loads it. save_model
  exports the weights (safetensors, the model's names) with the config.
"""
import copy
import json
import math
import os
import warnings
import weakref

import torch
import transformers

from .. import errors
from .. import torch as strata_torch
from ..engine import _config_text
from .auto import check_arguments, signature_gaps, trainer_config

_CHECKPOINT_DIR = "strata"  # inside the Trainer's checkpoint-N folder

# The Trainer's methods this module replaces: a transformers that renamed one
# would silently run its own (an empty optimizer state saved, the model moved).
_REPLACED = ("_move_model_to_device", "_wrap_model", "create_optimizer", "create_scheduler", "training_step",
             "prediction_step", "save_model", "_save_optimizer_and_scheduler",
             "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_best_model", "log")
_missing = [m for m in _REPLACED if not hasattr(transformers.Trainer, m)]
if _missing:
    raise ImportError(f"strata.hf: this transformers ({transformers.__version__}) has no Trainer.{', '.join(_missing)}; "
                      f"strata.hf.Trainer is written for transformers 5.x")


class _Model(torch.nn.Module):
    """The model as the Trainer's loop holds it: forward is the model's. It is
    not the model, so the Trainer does not hand the model to accelerate
    (which would move it, wrap it in DataParallel or DDP, or autocast it)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Optimizer:
    """What the Trainer's loop holds as its optimizer: strata steps inside
    training_step, so step() and zero_grad() do nothing. param_groups shows
    the learning rate of the last step (the Trainer reads it for
    ReduceLROnPlateau only)."""

    def __init__(self, trainer):
        self._trainer = trainer
        self.defaults = {}
        self.state = {}

    @property
    def param_groups(self):
        return [{"lr": self._trainer._strata_lr(), "params": []}]

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none=True):
        return None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


class _Scheduler:
    """The schedule the Trainer's loop steps after each optimizer step. With
    the config's own "scheduler" strata runs it: step() does nothing and the
    learning rate shown is the last step's. Without one, the Trainer's
    schedule (get_scheduler over a stand-in optimizer) gives each step's
    learning rate, set in the engine before the step runs; a step strata
    skipped (fp16 overflow, strata.nonfinite "skip") does not advance it."""

    def __init__(self, trainer, inner):
        self._trainer = trainer
        self._inner = inner
        if inner is not None:
            trainer._strata.set_lr(inner.get_last_lr()[0])

    def step(self, *args, **kwargs):
        stats = self._trainer._strata_stats
        if self._inner is None or stats is None or stats.skipped:
            return
        self._inner.step()
        self._trainer._strata.set_lr(self._inner.get_last_lr()[0])

    def get_last_lr(self):
        if self._inner is not None:
            return self._inner.get_last_lr()
        return [self._trainer._strata_lr()]

    def state_dict(self):
        return self._inner.state_dict() if self._inner is not None else {}

    def load_state_dict(self, state):
        if self._inner is not None and state:
            self._inner.load_state_dict(state)
            self._trainer._strata.set_lr(self._inner.get_last_lr()[0])


class _StepBegins(transformers.TrainerCallback):
    """Tells the Trainer (held weakly) where the loop begins an optimizer
    step (on_step_begin: its first micro-batch), so that a step the loop
    broke off part-way is found there, not merged into the next."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_step_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer._strata_step_starts = True

    def on_epoch_end(self, args, state, control, **kwargs):
        # An epoch that ends inside an optimizer step: a dataset without a
        # length that ran out mid-step (the Trainer would carry those
        # gradients into the next epoch's first step, or drop them at the
        # end), or a callback that stopped the epoch. strata's step cannot be
        # merged into another: said here, where it happens.
        trainer = self._trainer()
        engine = trainer._strata if trainer is not None else None
        if engine is not None and engine.micro_batches != 0:
            raise errors.FailedPrecondition(
                f"strata.hf.Trainer: the epoch ended {engine.micro_batches} micro-batches into an optimizer step "
                f"of {args.gradient_accumulation_steps} (a dataset without a length that ran out mid-step, or a "
                f"callback that stopped the epoch); give the dataset a length, make its batches per epoch a "
                f"multiple of gradient_accumulation_steps, or repeat it endlessly and set max_steps",
                status="FAILED_PRECONDITION")


def _hidden_size(model):
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        h = getattr(c, "hidden_size", None) or max(getattr(c, "hidden_sizes", None) or [0]) or None
        if h:
            return int(h)
    return None


def from_pretrained(model_class, path, **config_kwargs):
    """A transformers model built on the meta device (no memory) from the
    checkpoint folder `path` (config.json and safetensors), its weights to be
    streamed from those files, group by group, when strata.hf.Trainer hands
    it to strata: the host never holds the whole model. model_class is a
    model class (LlamaForCausalLM) or an Auto class (AutoModelForCausalLM)."""
    config_class = getattr(model_class, "config_class", None) or transformers.AutoConfig
    config = config_class.from_pretrained(path, **config_kwargs)
    with strata_torch.meta_init():
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config)
        else:
            model = model_class(config)
    model._strata_weights = os.fspath(path)
    return model


class Trainer(transformers.Trainer):
    """transformers.Trainer trained by strata: `strata_config` is a strata
    config (dict, JSON text or path; DeepSpeed's keys and strata's), its
    "auto" values filled from `args` as the Trainer's DeepSpeed integration
    fills them. Everything else is the Trainer's: datasets, collators,
    callbacks, evaluation, logging, save and resume. strata_kwargs go to
    strata.torch.initialize (blocks, param_groups, ...). A model made by
    strata.hf.from_pretrained takes its weights from its files."""

    def __init__(self, model=None, args=None, *pos, strata_config=None, strata_kwargs=None, **kwargs):
        if strata_config is None:
            raise errors.InvalidArgument("strata.hf.Trainer: strata_config is required (a dict, JSON text or a "
                                         "path: docs/config.md)", status="INVALID_ARGUMENT")
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        text = _config_text(strata_config)
        self._strata_config_dict = json.loads(text)
        check_arguments(args, self._strata_config_dict, model_given=model is not None,
                        optimizers=kwargs.get("optimizers"),
                        optimizer_cls_and_kwargs=kwargs.get("optimizer_cls_and_kwargs"))
        self._strata_kwargs = dict(strata_kwargs or {})
        self._strata = None
        self._strata_stats = None
        # train(resume_from_checkpoint=): the checkpoint the engine is built from
        # (_load_from_checkpoint names it before the engine is made), and the
        # one it was built from.
        self._strata_resume = None
        self._strata_resumed = None
        self._strata_step_starts = True  # the next training_step begins an optimizer step (_StepBegins)
        self._strata_max_grad_norm = args.max_grad_norm
        # The Trainer's own clipping off (strata clips, from max_grad_norm in
        # the config); a copy, so the caller's arguments stay as written (and
        # are the ones saved as training_args.bin).
        self._strata_user_args = args
        args = copy.copy(args)
        args.max_grad_norm = 0.0
        super().__init__(model, args, *pos, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise errors.InvalidArgument(
                "strata.hf.Trainer: accelerate is set up for DeepSpeed or FSDP (accelerate config, or an "
                "ACCELERATE_USE_* variable), which would take the model strata trains: launch without it",
                status="INVALID_ARGUMENT")
        self.add_callback(_StepBegins(self))

    # --- the engine -------------------------------------------------------------------------------------
    @property
    def strata(self):
        """The strata.torch engine (None before training or evaluation starts)."""
        return self._strata

    def train(self, *args, **kwargs):
        """transformers.Trainer.train; a checkpoint it was to resume from is
        forgotten when it returns or fails (the engine is built from it once)."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._strata_resume = None

    def _strata_make(self, num_training_steps, resume=None):
        """The engine, made once: from the checkpoint `resume` (a folder the
        Trainer saved) when given."""
        if self._strata is not None:
            return self._strata
        args = copy.copy(self.args)
        args.max_grad_norm = self._strata_max_grad_norm
        hidden = _hidden_size(self.model)
        # Several ranks (torchrun, accelerate launch): the batch is the ranks' (train_batch_size
        # "auto" counts them) and strata.torch takes the ranks from torch.distributed, which
        # accelerate has set up by now.
        world = max(int(getattr(args, "world_size", 1)), 1)
        config, _ = trainer_config(self._strata_config_dict, args, world_size=world, num_training_steps=num_training_steps,
                                   hidden_size=hidden)
        kwargs = dict(self._strata_kwargs)
        if "optimizer" not in self._strata_config_dict and "param_groups" not in kwargs:
            groups = self._strata_decay_groups(args)
            if groups:
                kwargs["param_groups"] = groups
        weights = getattr(self.model, "_strata_weights", None)
        if weights is not None and "weights" not in kwargs:
            kwargs["weights"] = weights
        if resume is not None and "resume_from" not in kwargs:
            kwargs["resume_from"] = os.path.join(resume, _CHECKPOINT_DIR)
        self._strata = strata_torch.initialize(self.model, config, total_num_steps=num_training_steps,
                                               hidden_size=hidden, **kwargs)
        self._strata_resumed = resume if "resume_from" not in self._strata_kwargs else None
        return self._strata

    def _strata_decay_groups(self, args):
        """The Trainer's weight-decay split (no decay for biases and norm
        weights: get_decay_parameter_names) as strata.torch param_groups; None
        when every trainable parameter decays alike."""
        if not args.weight_decay:
            return None
        decay = set(self.get_decay_parameter_names(self.model))
        no_decay = [p for n, p in self.model.named_parameters() if p.requires_grad and n not in decay]
        return [{"params": no_decay, "weight_decay": 0.0}] if no_decay else None

    def _strata_base_lr(self):
        """The optimizer's learning rate as configured (the schedule's base)."""
        lr = self._strata_config_dict.get("optimizer", {}).get("params", {}).get("lr", "auto")
        return float(self.args.learning_rate if lr == "auto" else lr)

    def _strata_lr(self):
        """The learning rate of the last step (the configured one before any)."""
        return self._strata_stats.lr if self._strata_stats is not None else self._strata_base_lr()

    def _strata_planned_steps(self):
        """The optimizer steps train() will run, as the Trainer counts them
        (max_steps, else the epochs over the training data's steps);
        None when that cannot be known (no dataset, or one without a length)."""
        if self.args.max_steps > 0:
            return self.args.max_steps
        if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
            return None
        n, gas = len(self.get_train_dataloader()), self.args.gradient_accumulation_steps
        per_epoch = max(n // gas + int(n % gas > 0), 1)  # an epoch's last step may be short
        return math.ceil(self.args.num_train_epochs * per_epoch)

    def _move_model_to_device(self, model, device):
        """strata places the model's weights (its compute copies on its device)."""

    def _wrap_model(self, model, training=True, dataloader=None):
        if self._strata is None and not training:
            # evaluate() before train(): the engine is made with the step count
            # training will have (in training create_scheduler makes it).
            self._strata_make(self._strata_planned_steps())
        if isinstance(model, _Model):
            return model
        return _Model(self.model)

    def create_optimizer(self, model=None):  # (transformers 5.3+ passes the model on some paths)
        if self.optimizer is None:
            self.optimizer = _Optimizer(self)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        # train(resume_from_checkpoint=): the engine is built from it (once).
        resume, self._strata_resume = self._strata_resume, None
        self._strata_make(num_training_steps, resume)
        if self.lr_scheduler is None or not isinstance(self.lr_scheduler, _Scheduler):
            inner = None
            if "scheduler" not in self._strata_config_dict:
                # The Trainer's schedule over a stand-in optimizer holding the learning rate alone.
                stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self._strata_base_lr())
                inner = transformers.get_scheduler(
                    self.args.lr_scheduler_type, optimizer=stand_in,
                    num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                    num_training_steps=num_training_steps,
                    scheduler_specific_kwargs=getattr(self.args, "lr_scheduler_kwargs", None) or {})
            self.lr_scheduler = _Scheduler(self, inner)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # --- the step ---------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        gas = self.args.gradient_accumulation_steps
        # The micro-batches of this optimizer step: gas, or fewer in an
        # epoch's last step (the Trainer does not drop it).
        current = min(getattr(self, "current_gradient_accumulation_steps", gas), gas)
        if self._strata_step_starts and self._strata.micro_batches != 0:
            raise errors.FailedPrecondition(
                f"strata.hf.Trainer: an optimizer step begins with {self._strata.micro_batches} backward passes of an "
                f"earlier one still in strata's step (the Trainer broke that step off part-way: a dataset without a "
                f"length that ran out mid-step, or a callback that stopped the epoch or the training mid-step)",
                status="FAILED_PRECONDITION")
        self._strata_step_starts = False
        # The model itself to compute_loss (its class decides the label
        # smoother's shift, PEFT's handling), not the loop's wrapper.
        model = model.module if isinstance(model, _Model) else model
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:  # as the Trainer's training_step
            from accelerate.utils.memory import clear_device_cache
            clear_device_cache()
        token_scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
            self.compute_loss_func is not None
        # strata divides the step's sum of gradients by
        # gradient_accumulation_steps: a loss already divided by the step's
        # token count (num_items_in_batch) is that micro-batch's share of the
        # sum, so it goes in times gas; a micro-batch's own mean goes in
        # times gas / current, the mean of the step's micro-batches. The step
        # ends with step(partial=True): a short one (an epoch's last) with its
        # missing micro-batches empty.
        scale = gas if token_scaled else gas / current
        # The loop's own flag says which micro-batch ends its optimizer step
        # (accelerate's sync_gradients, set before each training_step).
        last = bool(getattr(self.accelerator, "sync_gradients", True))
        self._strata.backward(loss * scale if scale != 1 else loss)
        stats = self._strata.step(partial=last)
        if last != (stats is not None):
            raise errors.FailedPrecondition(
                f"strata.hf.Trainer: the Trainer {'ends' if last else 'goes on with'} its optimizer step after "
                f"this micro-batch and strata {'does not' if last else 'ended its'} ({self._strata.micro_batches} "
                f"backward passes in strata's step): a step the Trainer broke off part-way (a callback that stopped "
                f"the epoch or the training mid-step) cannot be carried into the next", status="FAILED_PRECONDITION")
        if stats is not None:
            self._strata_stats = stats
        logged = loss.detach()
        return logged if token_scaled else logged / current

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        model = model.module if isinstance(model, _Model) else model
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def log(self, logs, *args, **kwargs):
        """The Trainer's logs with strata's view of the last step: its gradient
        norm (strata clips) and, under fp16, its loss scale. The learning rate
        is the Trainer's reading of the scheduler's get_last_lr, taken before
        it steps the schedule: the learning rate of the step just taken."""
        if "loss" in logs and self._strata_stats is not None:
            s = self._strata_stats
            logs["grad_norm"] = s.grad_norm
            if self.args.fp16:
                logs["loss_scale"] = s.loss_scale
        return super().log(logs, *args, **kwargs)

    # --- save and resume --------------------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call=False):
        """The trained weights as a Hugging Face folder: safetensors under the
        model's names (strata's export: every rank calls it, rank 0 writes),
        config.json, the tokenizer or processor, the training arguments. A
        PEFT model saves its adapters alone, as PEFT does."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._strata is None:
            return super().save_model(output_dir, _internal_call)
        os.makedirs(output_dir, exist_ok=True)
        if hasattr(self.model, "peft_config"):
            state = self._strata.state_dict(trainable_only=True)
            if self.args.should_save:
                self.model.save_pretrained(output_dir, state_dict=state)
        else:
            dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self._strata.dtype, "fp32")
            self._strata.export(output_dir, dtype=dtype)
            if self.args.should_save:
                if getattr(self.model, "config", None) is not None:
                    config = copy.deepcopy(self.model.config)
                    config.architectures = [type(self.model).__name__]
                    # The dtype the files hold (from_pretrained(dtype="auto") reads it), as save_pretrained says.
                    config.dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, "float32")
                    config.save_pretrained(output_dir)
                gen = getattr(self.model, "generation_config", None)
                if gen is not None and hasattr(gen, "save_pretrained"):
                    gen.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            elif getattr(self.data_collator, "tokenizer", None) is not None:  # as the Trainer's _save
                self.data_collator.tokenizer.save_pretrained(output_dir)
            torch.save(self._strata_user_args, os.path.join(output_dir, "training_args.bin"))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    def _save_optimizer_and_scheduler(self, output_dir):
        """strata's checkpoint (weights, optimizer state, step, loss scale:
        every rank's) under output_dir/strata, the Trainer's schedule in its
        client_state; the Trainer writes trainer_state.json and the RNG
        states beside it."""
        client = {"scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else {}}
        self._strata.save_checkpoint(os.path.join(output_dir, _CHECKPOINT_DIR), client_state=client,
                                     save_rng=False)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The weights come back with strata's checkpoint, once the engine is
        made (_load_optimizer_and_scheduler); a folder without one is an
        error naming it."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, _CHECKPOINT_DIR)):
            raise errors.NotFound(
                f"strata.hf.Trainer: {resume_from_checkpoint} holds no strata checkpoint ({_CHECKPOINT_DIR}/); "
                f"resume from a checkpoint strata.hf.Trainer saved", status="NOT_FOUND")
        # An engine not made yet is built from it (strata.torch.initialize's
        # resume_from: the initial values it replaces are not written).
        if self._strata is None:
            self._strata_resume = resume_from_checkpoint

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        if self._strata is None:
            raise errors.FailedPrecondition("strata.hf.Trainer: the Trainer loads a checkpoint before its "
                                            "scheduler (and strata's engine) is made; this transformers' order is "
                                            "not the one strata.hf was written for", status="FAILED_PRECONDITION")
        resumed, self._strata_resumed = self._strata_resumed, None  # (once)
        if resumed is not None and resumed == checkpoint:
            client = self._strata.client_state  # the engine was built from it
        else:
            client = self._strata.load_checkpoint(os.path.join(checkpoint, _CHECKPOINT_DIR), load_rng=False)
        if isinstance(client, dict) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(client.get("scheduler") or {})

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if not best:
            return
        root = os.path.join(best, _CHECKPOINT_DIR)
        if not os.path.isdir(root):
            raise errors.NotFound(f"strata.hf.Trainer: the best checkpoint {best} holds no strata checkpoint "
                                  f"({_CHECKPOINT_DIR}/) to load", status="NOT_FOUND")
        self._strata.load_checkpoint(root, load_rng=False)


# Written against transformers 5.2-5.6's Trainer: one whose loop calls a method
# strata.hf replaces with another argument is said at import, naming it (the
# call would fail with a TypeError, or only on the paths that pass it).
try:
    _gaps = signature_gaps(transformers.Trainer, Trainer, _REPLACED)
except Exception as e:  # noqa: BLE001 - a diagnostic, never a reason the import fails
    _gaps = [f"the signatures could not be compared ({type(e).__name__}: {e})"]
if _gaps:
    warnings.warn(f"strata.hf: transformers {transformers.__version__}'s Trainer may call methods strata.hf.Trainer "
                  f"replaces with other arguments: {' | '.join(_gaps)}", stacklevel=2)
