"""A strata config's "auto" values filled from a Hugging Face Trainer's
TrainingArguments, the way transformers fills a DeepSpeed config's
(transformers' integrations/deepspeed.py), plus what strata.hf adds: an
optimizer section written from the arguments when the config has none.

Pure Python on purpose: no transformers import, so that the mapping is
tested wherever strata is (tests/python/test_hf_auto.py), with any object
that has TrainingArguments' attributes."""
import copy
import inspect
import math

from .. import errors

# transformers' schedules whose step() takes an evaluation metric (the Trainer
# steps them after evaluating); strata sets each step's learning rate before
# the step, from a schedule that steps on its own.
_METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")

# The AdamW variants of TrainingArguments.optim that strata's AdamW is (the
# fused, torch and apex kernels of one algorithm); others have no strata
# equivalent and are refused when the config names no optimizer.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla",
                "adamw_torch_npu_fused")


def _optim_name(args):
    optim = getattr(args, "optim", "adamw_torch")
    return getattr(optim, "value", optim)  # an OptimizerNames enum member, or its string


def warmup_steps(args, num_training_steps):
    """TrainingArguments.get_warmup_steps where the arguments have it, else its
    rule: warmup_steps >= 1 is a count, below 1 a fraction of the run (rounded
    up); warmup_ratio where only that is set (older transformers)."""
    if hasattr(args, "get_warmup_steps"):
        return int(args.get_warmup_steps(num_training_steps))
    steps = getattr(args, "warmup_steps", 0) or 0
    if steps >= 1:
        return int(steps)
    if steps > 0:
        return math.ceil(num_training_steps * steps)
    ratio = getattr(args, "warmup_ratio", 0.0) or 0.0
    return math.ceil(num_training_steps * ratio)


class _Filler:
    """Fills "auto" at a key path and records, for a value already written,
    where it disagrees with the arguments (every disagreement is reported at
    once, as transformers does for DeepSpeed's)."""

    def __init__(self, config):
        self.config = config
        self.filled = []      # (key path, value, source)
        self.mismatches = []  # (key path, config's value, source, argument's value)

    def _node(self, path):
        """The dict holding path's last key, and that key (None: a section on the way is missing)."""
        *parents, leaf = path.split(".")
        node = self.config
        for p in parents:
            if not isinstance(node.get(p), dict):
                return None, leaf
            node = node[p]
        return node, leaf

    def match(self, path, value, source, must_match=True):
        node, leaf = self._node(path)
        if node is None or leaf not in node:
            return
        if node[leaf] == "auto":
            node[leaf] = value
            self.filled.append((path, value, source))
        elif must_match and not _same(node[leaf], value):
            self.mismatches.append((path, node[leaf], source, value))


def _same(a, b):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def trainer_config(config, args, *, num_training_steps=None, hidden_size=None, world_size=1):
    """Returns (config, filled): a copy of `config` (a dict: DeepSpeed's keys
    and strata's) with its "auto" values filled from `args` (TrainingArguments,
    or any object with its attributes), and the list of (key, value, source)
    filled. A value written in the config that the arguments contradict (a
    learning rate, a batch size, the precision) raises strata.InvalidArgument
    listing every such key with both values: one source of truth per run,
    as transformers insists for DeepSpeed's configs.

    The keys and their sources (transformers' DeepSpeed integration, the same
    names and rules):
      train_micro_batch_size_per_gpu   per_device_train_batch_size
      gradient_accumulation_steps      gradient_accumulation_steps
      train_batch_size                 world_size x per_device x accumulation
      gradient_clipping                max_grad_norm
      optimizer.params.lr              learning_rate
      optimizer.params.betas           [adam_beta1, adam_beta2]
      optimizer.params.eps             adam_epsilon
      optimizer.params.weight_decay    weight_decay
      scheduler.params.warmup_min_lr   0 (never checked)
      scheduler.params.warmup_max_lr   learning_rate
      scheduler.params.warmup_num_steps   args.get_warmup_steps(num_training_steps)
      scheduler.params.total_num_steps    num_training_steps
      fp16.enabled                     fp16 (or fp16_full_eval)
      bf16.enabled                     bf16 (or bf16_full_eval)
      strata.device                    device (cuda: "cuda", cpu: "host")
    The Trainer puts each batch on args.device (cuda:0 where a GPU is usable,
    unless use_cpu), so strata's device follows it: "auto" or absent takes it,
    and a device written in the config that differs is a disagreement as
    above (weights on one device and batches on the other would fail in the
    model's first layer). Arguments without a device leave it as written.
    With num_training_steps None the two step counts stay "auto" (strata
    then resolves them or says what to write). hidden_size is passed on to
    strata for the bucket sizes (strata.torch.initialize(hidden_size=)).

    Without an "optimizer" section one is written from the arguments: AdamW
    (for TrainingArguments.optim's AdamW variants; another optim raises
    strata.Unimplemented naming it) with learning_rate, the betas, epsilon
    and weight_decay, as the Trainer would build torch's."""
    if not isinstance(config, dict):
        raise TypeError(f"strata.hf: the config must be a dict here, not {type(config).__name__}")
    config = copy.deepcopy(config)
    f = _Filler(config)
    micro = int(args.per_device_train_batch_size)
    gas = int(args.gradient_accumulation_steps)
    f.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.match("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    f.match("train_batch_size", world_size * micro * gas,
            f"world_size ({world_size}) x per_device_train_batch_size x gradient_accumulation_steps")
    f.match("gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    if "optimizer" not in config:
        optim = _optim_name(args)
        if optim not in ADAMW_OPTIMS:
            raise errors.Unimplemented(
                f"strata.hf: TrainingArguments.optim = {optim!r} has no strata optimizer; use an AdamW one "
                f"({', '.join(ADAMW_OPTIMS[:2])}) or write an \"optimizer\" section in the strata config "
                f"(docs/config.md: Adam, AdamW, Lion, Adagrad)", status="UNIMPLEMENTED")
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}}
        f.filled.append(("optimizer.type", "AdamW", f"optim ({optim})"))
    f.match("optimizer.params.lr", float(args.learning_rate), "learning_rate")
    f.match("optimizer.params.betas", [float(args.adam_beta1), float(args.adam_beta2)], "adam_beta1, adam_beta2")
    f.match("optimizer.params.eps", float(args.adam_epsilon), "adam_epsilon")
    f.match("optimizer.params.weight_decay", float(args.weight_decay), "weight_decay")
    f.match("scheduler.params.warmup_min_lr", 0.0, "0", must_match=False)
    f.match("scheduler.params.warmup_max_lr", float(args.learning_rate), "learning_rate")
    if num_training_steps is not None:
        f.match("scheduler.params.total_num_steps", int(num_training_steps), "the run's optimizer steps")
        f.match("scheduler.params.warmup_num_steps", warmup_steps(args, num_training_steps),
                "warmup_steps (TrainingArguments.get_warmup_steps)")
    fp16 = bool(getattr(args, "fp16", False) or getattr(args, "fp16_full_eval", False))
    bf16 = bool(getattr(args, "bf16", False) or getattr(args, "bf16_full_eval", False))
    f.match("fp16.enabled", fp16, "fp16")
    f.match("bf16.enabled", bf16, "bf16")
    _match_device(config, args, f)
    if f.mismatches:
        lines = "\n".join(f"  {path}: the config says {mine!r}, {source} says {theirs!r}"
                          for path, mine, source, theirs in f.mismatches)
        raise errors.InvalidArgument(
            f"strata.hf: the strata config and the TrainingArguments disagree (write \"auto\" in the config "
            f"or change the argument):\n{lines}", status="INVALID_ARGUMENT")
    return config, f.filled


def _match_device(config, args, f):
    """strata.device from the Trainer's device (trainer_config's docstring)."""
    device = getattr(args, "device", None)
    kind = getattr(device, "type", device)  # a torch.device, or its name
    if kind is None:
        return
    kind = str(kind).split(":")[0]
    want = {"cuda": "cuda", "cpu": "host"}.get(kind)
    if want is None:
        raise errors.Unimplemented(
            f"strata.hf: the Trainer's device is {str(device)!r}; strata trains on a CUDA GPU or on the CPU "
            f"(its host device)", status="UNIMPLEMENTED")
    section = config.setdefault("strata", {})
    if not isinstance(section, dict):
        return  # strata's own config check names it
    section.setdefault("device", "auto")  # absent is "auto"
    f.match("strata.device", want,
            f"the Trainer's device ({device}{', use_cpu' if getattr(args, 'use_cpu', False) else ''})")


def check_arguments(args, config, *, model_given=True, optimizers=None, optimizer_cls_and_kwargs=None):
    """What strata.hf.Trainer refuses, as one error naming the first thing it
    cannot honour: no model (model_init), an optimizer of the caller's,
    evaluation in another precision (*_full_eval), arguments that change the
    model or the batch under strata's feet (auto_find_batch_size,
    torch_compile), a best-model load from checkpoints without strata's state
    (load_best_model_at_end with save_only_model), DeepSpeed or FSDP in the
    arguments (they would take the model), several GPUs in one process
    (DataParallel: one process per GPU is how strata runs ranks), and a schedule
    that steps on evaluation metrics, which strata cannot step
    (reduce_lr_on_plateau, greedy; without a "scheduler" in the config). `args` is any object with TrainingArguments' attributes;
    `config` the strata config as a dict."""
    if not model_given:
        raise errors.Unimplemented("strata.hf.Trainer: model_init is not supported; pass the model",
                                   status="UNIMPLEMENTED")
    if any(o is not None for o in optimizers or ()) or optimizer_cls_and_kwargs:
        raise errors.InvalidArgument(
            "strata.hf.Trainer: the optimizer and schedule are strata's (the config's \"optimizer\" and "
            "\"scheduler\", or TrainingArguments' values): do not pass optimizers= or "
            "optimizer_cls_and_kwargs=", status="INVALID_ARGUMENT")
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            raise errors.InvalidArgument(
                f"strata.hf.Trainer: {flag} casts and moves the model for evaluation; strata keeps its "
                f"compute copies in the config's precision (bf16.enabled / fp16.enabled): leave {flag} off",
                status="INVALID_ARGUMENT")
    refused = {
        "auto_find_batch_size": "strata's engine keeps the micro-batch size it was made with; set "
                                "per_device_train_batch_size",
        "torch_compile": "strata's hooks run on the model's modules as they are (torch.compile of the hooked "
                         "modules is not supported)",
    }
    for flag, why in refused.items():
        if getattr(args, flag, False):
            raise errors.InvalidArgument(f"strata.hf.Trainer: {flag} is not supported: {why}",
                                         status="INVALID_ARGUMENT")
    if getattr(args, "load_best_model_at_end", False) and getattr(args, "save_only_model", False):
        raise errors.InvalidArgument(
            "strata.hf.Trainer: load_best_model_at_end loads the best checkpoint's strata state, which "
            "save_only_model=True does not save; drop one of them", status="INVALID_ARGUMENT")
    for flag, what in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP")):
        if getattr(args, flag, None):
            raise errors.InvalidArgument(
                f"strata.hf.Trainer: TrainingArguments.{flag} hands the model to {what}, and strata trains it: "
                f"pass the config as strata_config= (DeepSpeed's keys are accepted) and leave {flag} unset",
                status="INVALID_ARGUMENT")
    accel = getattr(args, "accelerator_config", None)
    even = accel.get("even_batches", True) if isinstance(accel, dict) else getattr(accel, "even_batches", True)
    if getattr(args, "world_size", 1) > 1 and even is False:
        raise errors.InvalidArgument(
            "strata.hf.Trainer: accelerator_config even_batches=False gives the ranks different numbers of batches; "
            "strata's steps (and at stage 3 every forward's fetches) are collectives every rank takes part in: "
            "leave even_batches on", status="INVALID_ARGUMENT")
    n_gpu = getattr(args, "n_gpu", 1)
    if n_gpu > 1:
        raise errors.InvalidArgument(
            f"strata.hf.Trainer: this process sees {n_gpu} GPUs and the Trainer would split batches over "
            f"them with DataParallel; strata trains on one GPU per process (set CUDA_VISIBLE_DEVICES, or "
            f"launch a process per GPU)", status="INVALID_ARGUMENT")
    schedule = getattr(args, "lr_scheduler_type", "linear")
    schedule = getattr(schedule, "value", schedule)  # a SchedulerType enum member, or its string
    if schedule in _METRIC_SCHEDULES and "scheduler" not in config:
        raise errors.Unimplemented(
            f"strata.hf.Trainer: lr_scheduler_type {schedule} is not supported (it steps on "
            f"evaluation metrics); choose another, or a \"scheduler\" in the strata config",
            status="UNIMPLEMENTED")


def signature_gaps(base, ours, names):
    """The methods of `names` whose signature in `ours` (strata.hf.Trainer)
    cannot be called as the one in `base` (the installed transformers.Trainer)
    can: every argument of theirs passed positionally, then each by keyword
    (the Trainer's loop calls them as its own are written, so a transformers
    that added an argument would fail there with a TypeError), and their *args
    or **kwargs taken. One line each, naming both signatures; a signature that
    cannot be read is one too."""
    gaps = []
    for name in names:
        try:
            theirs = inspect.signature(getattr(base, name))
            mine = inspect.signature(getattr(ours, name))
        except (TypeError, ValueError) as e:
            gaps.append(f"{name}: its signature cannot be read ({e})")
            continue
        params = [p for p in theirs.parameters.values() if p.name != "self"]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword_only = {p.name: None for p in params if p.kind == p.KEYWORD_ONLY}
        by_keyword = {p.name: None for p in positional if p.kind == p.POSITIONAL_OR_KEYWORD}
        only_positional = [None for p in positional if p.kind == p.POSITIONAL_ONLY]
        calls = (("called positionally", [None] * len(positional), keyword_only),
                 ("called by keyword", only_positional, dict(by_keyword, **keyword_only)))
        reasons = []
        for how, args, kwargs in calls:
            try:
                mine.bind(None, *args, **kwargs)
            except TypeError as e:
                reasons.append(f"{how}: {e}")
        # A positional call binds an argument by place: the same place must hold the same name.
        mine_positional = [p.name for p in mine.parameters.values()
                           if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        reasons += [f"argument {i + 1} is '{p.name}' there, '{mine_positional[i]}' here"
                    for i, p in enumerate(positional) if i < len(mine_positional) and mine_positional[i] != p.name]
        kinds = {p.kind for p in mine.parameters.values()}
        reasons += [f"takes no {p}" for p in params
                    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.kind not in kinds]
        if reasons:
            gaps.append(f"{name}{theirs} against strata.hf's {name}{mine}: {'; '.join(reasons)}")
    return gaps
