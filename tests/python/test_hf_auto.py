"""strata.hf.trainer_config: a config's "auto" values filled from a Hugging
Face Trainer's arguments as transformers fills a DeepSpeed config's (any
object with TrainingArguments' attributes: this test needs no transformers),
checked through strata's own config resolution."""
import math
from types import SimpleNamespace

import pytest

import strata
import strata.hf


def training_args(**over):
    a = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-4,
             adam_beta1=0.85, adam_beta2=0.98, adam_epsilon=1e-7, weight_decay=0.05, warmup_steps=0.1,
             fp16=False, bf16=True, fp16_full_eval=False, bf16_full_eval=False, optim="adamw_torch")
    a.update(over)
    return SimpleNamespace(**a)


def auto_config(swap):
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "strata": {"device": "host", "io": {"paths": [str(swap)]}},
    }


def test_every_auto_key_takes_the_arguments_value_and_strata_resolves_them(tmp_path):
    cfg, filled = strata.hf.trainer_config(auto_config(tmp_path), training_args(), num_training_steps=95,
                                           world_size=2)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == 16  # ranks x micro x accumulation
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.85, 0.98], "eps": 1e-7, "weight_decay": 0.05}
    sched = cfg["scheduler"]["params"]
    # warmup_steps below 1 is a fraction of the run, rounded up (TrainingArguments.get_warmup_steps).
    assert sched == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": math.ceil(95 * 0.1),
                     "total_num_steps": 95}
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert {k for k, _, _ in filled} >= {"train_batch_size", "optimizer.params.betas", "scheduler.params.total_num_steps"}
    # strata takes the filled config as written: nothing left "auto", the values kept.
    r = strata.config_resolve(cfg, world_size=2)
    assert r["train_batch_size"] == 16 and r["gradient_accumulation_steps"] == 2
    assert r["optimizer"]["params"]["lr"] == pytest.approx(3e-4)
    assert r["scheduler"]["params"]["warmup_num_steps"] == 10
    assert r["bf16"]["enabled"] is True


def test_the_callers_config_is_not_changed(tmp_path):
    cfg = auto_config(tmp_path)
    strata.hf.trainer_config(cfg, training_args(), num_training_steps=10)
    assert cfg["optimizer"]["params"]["lr"] == "auto" and cfg["train_batch_size"] == "auto"


def test_values_written_in_the_config_that_the_arguments_contradict_are_all_named_at_once(tmp_path):
    cfg = auto_config(tmp_path)
    cfg["optimizer"]["params"]["lr"] = 1e-3
    cfg["gradient_accumulation_steps"] = 4
    cfg["scheduler"]["params"]["warmup_min_lr"] = 1e-6  # never checked, as transformers does
    with pytest.raises(strata.InvalidArgument) as e:
        strata.hf.trainer_config(cfg, training_args(), num_training_steps=10)
    msg = str(e.value)
    assert "optimizer.params.lr: the config says 0.001, learning_rate says 0.0003" in msg
    assert "gradient_accumulation_steps: the config says 4" in msg
    assert "warmup_min_lr" not in msg
    # Values that agree are fine.
    cfg = auto_config(tmp_path)
    cfg["optimizer"]["params"]["lr"] = 3e-4
    cfg["optimizer"]["params"]["betas"] = [0.85, 0.98]
    got, _ = strata.hf.trainer_config(cfg, training_args(), num_training_steps=10)
    assert got["optimizer"]["params"]["lr"] == 3e-4


def test_without_the_run_length_the_step_counts_stay_auto_and_strata_asks_for_them(tmp_path):
    cfg, _ = strata.hf.trainer_config(auto_config(tmp_path), training_args())
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"
    with pytest.raises(strata.Error, match="total_num_steps"):
        strata.config_resolve(cfg)
    assert strata.config_resolve(cfg, total_num_steps=40)["scheduler"]["params"]["total_num_steps"] == 40


def test_an_optimizer_section_is_written_from_the_arguments_when_the_config_has_none(tmp_path):
    cfg = auto_config(tmp_path)
    del cfg["optimizer"]
    got, filled = strata.hf.trainer_config(cfg, training_args(optim="adamw_torch_fused"), num_training_steps=10)
    assert got["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.85, 0.98], "eps": 1e-7,
                                                            "weight_decay": 0.05}}
    assert ("optimizer.type", "AdamW", "optim (adamw_torch_fused)") in filled
    with pytest.raises(strata.Unimplemented, match="'adafactor' has no strata optimizer"):
        strata.hf.trainer_config(cfg, training_args(optim="adafactor"), num_training_steps=10)
    # With an optimizer section of its own, the arguments' optim does not matter.
    strata.hf.trainer_config(auto_config(tmp_path), training_args(optim="adafactor"), num_training_steps=10)


def test_warmup_counts_and_fractions():
    assert strata.hf.warmup_steps(SimpleNamespace(warmup_steps=7), 100) == 7
    assert strata.hf.warmup_steps(SimpleNamespace(warmup_steps=0.25), 10) == 3
    assert strata.hf.warmup_steps(SimpleNamespace(warmup_steps=0, warmup_ratio=0.05), 30) == 2
    # TrainingArguments' own rule wins where the arguments have it.
    assert strata.hf.warmup_steps(SimpleNamespace(get_warmup_steps=lambda n: n // 3), 30) == 10


def test_fp16_from_the_arguments_and_no_clipping(tmp_path):
    cfg = auto_config(tmp_path)
    got, _ = strata.hf.trainer_config(cfg, training_args(fp16=True, bf16=False, max_grad_norm=None),
                                      num_training_steps=5)
    assert got["fp16"]["enabled"] is True and got["bf16"]["enabled"] is False
    assert got["gradient_clipping"] == 0.0


def test_strata_device_follows_the_trainers_device(tmp_path):
    """The Trainer puts the batches on args.device: strata's weights go there too."""
    import torch
    for device, want in ((torch.device("cpu"), "host"), (torch.device("cuda", 0), "cuda"), ("cuda:1", "cuda")):
        cfg = auto_config(tmp_path)
        cfg["strata"]["device"] = "auto"
        got, filled = strata.hf.trainer_config(cfg, training_args(device=device), num_training_steps=5)
        assert got["strata"]["device"] == want
        assert [v for k, v, _ in filled if k == "strata.device"] == [want]
        # Absent is "auto"; a config without a strata section gets one.
        del cfg["strata"]
        got, _ = strata.hf.trainer_config(cfg, training_args(device=device), num_training_steps=5)
        assert got["strata"] == {"device": want}
    # Written and agreeing: kept; written and differing: named with both values.
    got, _ = strata.hf.trainer_config(auto_config(tmp_path), training_args(device=torch.device("cpu")),
                                      num_training_steps=5)
    assert got["strata"]["device"] == "host"
    with pytest.raises(strata.InvalidArgument) as e:
        strata.hf.trainer_config(auto_config(tmp_path), training_args(device=torch.device("cuda", 0), use_cpu=False),
                                 num_training_steps=5)
    assert "strata.device: the config says 'host', the Trainer's device (cuda:0) says 'cuda'" in str(e.value)
    with pytest.raises(strata.Unimplemented, match="the Trainer's device is 'mps'"):
        strata.hf.trainer_config(auto_config(tmp_path), training_args(device=torch.device("mps")),
                                 num_training_steps=5)
    # Arguments without a device (older objects, these tests' own) leave the config's.
    got, _ = strata.hf.trainer_config(auto_config(tmp_path), training_args(), num_training_steps=5)
    assert got["strata"]["device"] == "host"


def test_the_trainer_says_it_needs_transformers_where_there_is_none():
    try:
        import transformers  # noqa: F401
        pytest.skip("transformers is installed here: test_hf_trainer.py runs the Trainer")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="strata.hf.Trainer needs transformers"):
        strata.hf.Trainer


def test_what_the_trainer_refuses_is_named():
    """strata.hf.check_arguments, which strata.hf.Trainer runs before anything else: each argument strata
    cannot honour refused with an error naming it and what to do; the arguments it can, accepted."""
    ok = training_args(lr_scheduler_type="linear", n_gpu=1)
    strata.hf.check_arguments(ok, {})  # nothing to refuse
    cases = [
        (dict(), dict(model_given=False), strata.Unimplemented, r"model_init is not supported; pass the model"),
        (dict(), dict(optimizers=(object(), None)), strata.InvalidArgument, r"do not pass optimizers="),
        (dict(), dict(optimizer_cls_and_kwargs=(object, {})), strata.InvalidArgument, r"optimizer_cls_and_kwargs="),
        (dict(fp16_full_eval=True), {}, strata.InvalidArgument, r"fp16_full_eval casts and moves the model"),
        (dict(bf16_full_eval=True), {}, strata.InvalidArgument, r"leave bf16_full_eval off"),
        (dict(auto_find_batch_size=True), {}, strata.InvalidArgument,
         r"auto_find_batch_size is not supported: .*set per_device_train_batch_size"),
        (dict(torch_compile=True), {}, strata.InvalidArgument, r"torch_compile is not supported"),
        (dict(load_best_model_at_end=True, save_only_model=True), {}, strata.InvalidArgument,
         r"save_only_model=True does not save; drop one of them"),
        (dict(n_gpu=2), {}, strata.InvalidArgument, r"sees 2 GPUs .*DataParallel.*CUDA_VISIBLE_DEVICES"),
        (dict(world_size=2, accelerator_config={"even_batches": False}), {}, strata.InvalidArgument,
         r"even_batches=False gives the ranks different numbers of batches"),
        (dict(lr_scheduler_type="reduce_lr_on_plateau"), {}, strata.Unimplemented,
         r"reduce_lr_on_plateau is not supported .*a \"scheduler\" in the strata config"),
        (dict(lr_scheduler_type="greedy"), {}, strata.Unimplemented,
         r"greedy is not supported \(it steps on evaluation metrics\)"),
    ]
    for over, kw, error, message in cases:
        args = training_args(**dict(dict(lr_scheduler_type="linear", n_gpu=1), **over))
        with pytest.raises(error, match=message):
            strata.hf.check_arguments(args, {}, **kw)
    # Each alone is what is refused: the same arguments with it undone pass; a plateau schedule with the
    # config's own scheduler is strata's to run; optimizers=(None, None) is the Trainer's default.
    for schedule in ("reduce_lr_on_plateau", "greedy"):
        strata.hf.check_arguments(training_args(lr_scheduler_type=schedule, n_gpu=1),
                                  {"scheduler": {"type": "WarmupLR"}})
    strata.hf.check_arguments(ok, {}, optimizers=(None, None))
    strata.hf.check_arguments(training_args(load_best_model_at_end=True, save_only_model=False, n_gpu=1), {})
    strata.hf.check_arguments(training_args(n_gpu=1, accelerator_config={"even_batches": False}), {})  # one rank
    strata.hf.check_arguments(training_args(n_gpu=1, world_size=2, accelerator_config={"even_batches": True}), {})

    class Schedule:  # transformers' SchedulerType: an enum whose value is the name
        value = "reduce_lr_on_plateau"
    with pytest.raises(strata.Unimplemented, match="reduce_lr_on_plateau"):
        strata.hf.check_arguments(training_args(lr_scheduler_type=Schedule(), n_gpu=1), {})


def test_deepspeed_or_fsdp_in_the_arguments_is_refused():
    """TrainingArguments(deepspeed=...) or fsdp would hand the model to DeepSpeed or FSDP: strata.hf.Trainer
    refuses them, saying to pass the DeepSpeed config as strata_config."""
    for flag, value, what in (("deepspeed", "ds.json", "DeepSpeed"), ("fsdp", "full_shard", "FSDP")):
        args = training_args(lr_scheduler_type="linear", n_gpu=1, **{flag: value})
        with pytest.raises(strata.InvalidArgument, match=rf"TrainingArguments\.{flag} hands the model to {what}.*"
                                                         rf"strata_config="):
            strata.hf.check_arguments(args, {})
        strata.hf.check_arguments(training_args(lr_scheduler_type="linear", n_gpu=1, **{flag: None}), {})
    strata.hf.check_arguments(training_args(lr_scheduler_type="linear", n_gpu=1, fsdp=[]), {})  # 5.x: a list


def test_signature_gaps_name_each_call_a_replaced_method_does_not_take():
    """strata.hf.Trainer replaces Trainer methods the loop calls as transformers
    writes them: a transformers that passes one another argument is named at
    import (trainer.py warns; test_hf_trainer asserts none with the installed
    one). Each method is called with every argument of the base's,
    positionally and by keyword."""
    class Base:
        def same(self, a, b=None):
            pass

        def added(self, model, inputs, num_items_in_batch=None):
            pass

        def keyword(self, a, *, start_time=None):
            pass

        def log(self, logs, start_time=None):
            pass

        def spread(self, *args, **kwargs):
            pass

        def needs(self, a):
            pass

        def order(self, model, inputs, num_items_in_batch=None):
            pass

    class Ours:
        def same(self, a, b=None):
            pass

        def added(self, model, inputs):
            pass

        def keyword(self, a, **kwargs):
            pass

        def log(self, logs, *args, **kwargs):  # strata.hf's own: takes start_time either way
            pass

        def spread(self, a=None):
            pass

        def needs(self, a, extra):
            pass

        def order(self, inputs, model, num_items_in_batch=None):  # binds, but by place to the wrong names
            pass

    names = ["same", "added", "keyword", "log", "spread", "needs", "order"]
    gaps = strata.hf.signature_gaps(Base, Ours, names)
    assert len(gaps) == 4, gaps
    assert gaps[0].startswith("added(self, model, inputs, num_items_in_batch=None) against strata.hf's "
                              "added(self, model, inputs): called positionally: too many positional arguments; "
                              "called by keyword: got an unexpected keyword argument 'num_items_in_batch'"), gaps[0]
    assert gaps[1].startswith("spread(self, *args, **kwargs) against"), gaps[1]
    assert gaps[1].endswith("takes no *args; takes no **kwargs"), gaps[1]
    assert "needs(self, a, extra): called positionally: missing a required argument: 'extra'" in gaps[2], gaps[2]
    assert gaps[3].endswith(": argument 1 is 'model' there, 'inputs' here; argument 2 is 'inputs' there, "
                            "'model' here"), gaps[3]
    assert strata.hf.signature_gaps(Base, Base, names) == []

    class Unreadable:
        log = print  # a builtin: inspect.signature may not read it
    try:
        import inspect
        inspect.signature(print)
    except ValueError:
        assert strata.hf.signature_gaps(Base, Unreadable, ["log"])[0].startswith("log: its signature cannot be read")
