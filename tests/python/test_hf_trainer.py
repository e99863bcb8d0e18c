"""strata.hf.Trainer against its oracle, transformers.Trainer with torch's
AdamW: the same tiny Llama, data order, schedule, weight-decay split and
clipping give the same losses and weights; resuming from a checkpoint the
Trainer saved gives the uninterrupted run's weights bit for bit; save_model
writes a folder from_pretrained loads; strata.hf.from_pretrained streams the
weights from a checkpoint's safetensors. Runs where transformers is
importable (the GPU machine); skipped elsewhere (test_hf_auto.py tests the
"auto" mapping everywhere)."""
import os
import signal
import subprocess

import pytest
import torch

import strata
import strata.hf
from llama_script import corpus

try:
    import transformers
except ImportError:
    transformers = None

# Every test marked (not a module-level skip), so each counts in the run's summary.
pytestmark = pytest.mark.skipif(transformers is None, reason="transformers is not installed (pip install transformers)")

SEQ, VOCAB, MICRO, GAS, STEPS = 16, 64, 2, 2, 6


def _kill_tree(pid):
    """SIGKILL to pid and every process under it (torchrun's ranks, an example's workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for c in children:
        _kill_tree(c)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_logged(cmd, timeout, **kw):
    """subprocess.run with its output captured; one that runs past `timeout`
    is killed with everything it started and fails the test with what it had
    printed (the GPU check's stage limit would otherwise stop it with nothing)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... ran past {timeout} s:\n{(out or '')[-4000:]}\n"
                    f"{(err or '')[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """n sequences of SEQ tokens; with masked, about a third of the labels
    are -100 (ignored), so micro-batches count different numbers of tokens."""

    def __init__(self, n, seed=1, masked=False):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.y = self.x.clone()
        if masked:
            self.y[torch.rand((n, SEQ), generator=g) < 0.33] = -100

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def args(out, **over):
    a = dict(output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=GAS,
             max_steps=STEPS, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=2,
             lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to="none", seed=0,
             disable_tqdm=True, use_cpu=not torch.cuda.is_available(), optim="adamw_torch")
    a.update(over)
    return transformers.TrainingArguments(**a)


def strata_config(swap):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "strata": {"io": {"paths": [str(swap)]}}}


def losses(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture
def swap(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    return d


def test_the_installed_trainer_calls_every_replaced_method_as_strata_hf_takes_it():
    """Each Trainer method strata.hf.Trainer replaces takes the arguments the
    installed transformers' loop passes (a gap is a TypeError in the loop,
    maybe only on some paths); trainer.py warns at import, this names them."""
    from strata.hf import trainer
    assert strata.hf.signature_gaps(transformers.Trainer, strata.hf.Trainer, trainer._REPLACED) == [], \
        transformers.__version__


@pytest.mark.parametrize("loss", ["tokens", "mean"])
def test_the_trainer_matches_transformers_trainer_with_torch_adamw(tmp_path, swap, loss):
    # "tokens": the model takes num_items_in_batch (each micro-batch's loss a share of the step's
    # token sum, the Trainer's default for causal LMs); "mean": each micro-batch's own mean,
    # divided by the accumulation steps. Labels partly ignored: the two differ.
    data = Tokens(MICRO * GAS * STEPS, masked=True)
    oracle = transformers.Trainer(model=llama(), args=args(tmp_path / "oracle"), train_dataset=data)
    model = llama()
    ours = strata.hf.Trainer(model=model, args=args(tmp_path / "ours"), train_dataset=data,
                             strata_config=strata_config(swap))
    if loss == "mean":
        oracle.model_accepts_loss_kwargs = ours.model_accepts_loss_kwargs = False
    oracle.train()
    ours.train()
    want, got = losses(oracle), losses(ours)
    assert len(got) == STEPS and got == pytest.approx(want, rel=1e-3)
    # The gradients' scale too (Adam's update hardly sees it): strata's norm, before clipping,
    # is the one the Trainer's clip_grad_norm_ returns.
    assert losses(ours, "grad_norm") == pytest.approx(losses(oracle, "grad_norm"), rel=1e-3)
    theirs = {n: p.detach().float().cpu() for n, p in oracle.model.named_parameters()}
    mine = ours.strata.state_dict()
    for name, w in theirs.items():
        torch.testing.assert_close(mine[name], w, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # The logs carry strata's view: its gradient norm (it clips) and learning rate.
    last = [h for h in ours.state.log_history if "loss" in h][-1]
    assert last["grad_norm"] > 0 and last["learning_rate"] == pytest.approx(
        [h for h in oracle.state.log_history if "loss" in h][-1]["learning_rate"], rel=1e-6)
    ours.strata.close()


def test_resuming_from_a_checkpoint_gives_the_uninterrupted_run_bit_for_bit(tmp_path, swap):
    data = Tokens(MICRO * GAS * STEPS)
    whole = strata.hf.Trainer(model=llama(), args=args(tmp_path / "whole", save_strategy="steps", save_steps=3),
                              train_dataset=data, strata_config=strata_config(swap))
    whole.train()
    want = whole.strata.state_dict()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "strata").is_dir() and (checkpoint / "trainer_state.json").exists()
    whole.strata.close()
    resumed = strata.hf.Trainer(model=llama(seed=5), args=args(tmp_path / "resumed"), train_dataset=data,
                                strata_config=strata_config(swap))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # The engine was built from the checkpoint (strata.torch.initialize's resume_from).
    assert resumed.strata.client_state is not None and "scheduler" in resumed.strata.client_state
    got = resumed.strata.state_dict()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    # The Trainer's log history comes back with its state (trainer_state.json): the first three
    # steps as logged before the save, the last three as the resumed run logged them.
    assert losses(resumed) == losses(whole)
    resumed.strata.close()


def test_save_model_writes_a_folder_from_pretrained_loads(tmp_path, swap):
    trainer = strata.hf.Trainer(model=llama(), args=args(tmp_path / "run", max_steps=2),
                                train_dataset=Tokens(MICRO * GAS * 2), strata_config=strata_config(swap))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    mine = trainer.strata.state_dict()
    for name, w in loaded.state_dict().items():
        assert torch.equal(w.float(), mine[name]), name
    trainer.strata.close()


def test_from_pretrained_streams_the_weights_from_the_checkpoint(tmp_path, swap):
    base = llama()
    base.save_pretrained(str(tmp_path / "base"))
    data = Tokens(MICRO * GAS * 2)
    plain = strata.hf.Trainer(model=llama(), args=args(tmp_path / "a", max_steps=2), train_dataset=data,
                              strata_config=strata_config(swap))
    plain.train()
    plain.strata.close()
    model = strata.hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "base")
    assert all(p.device.type == "meta" for p in model.parameters())
    streamed = strata.hf.Trainer(model=model, args=args(tmp_path / "b", max_steps=2), train_dataset=data,
                                 strata_config=strata_config(swap))
    streamed.train()
    assert losses(streamed) == losses(plain)
    streamed.strata.close()


def test_an_epoch_that_ends_with_a_short_step_trains_as_transformers_trainer(tmp_path, swap):
    # 5 micro-batches an epoch, 2 a step: each epoch ends with a step of one (the Trainer does
    # not drop it); strata ends it with step(partial=True), the loss scaled for the step's mean.
    data = Tokens(MICRO * 5, masked=True)
    over = dict(max_steps=-1, num_train_epochs=2)
    oracle = transformers.Trainer(model=llama(), args=args(tmp_path / "oracle", **over), train_dataset=data)
    ours = strata.hf.Trainer(model=llama(), args=args(tmp_path / "ours", **over), train_dataset=data,
                             strata_config=strata_config(swap))
    oracle.model_accepts_loss_kwargs = ours.model_accepts_loss_kwargs = False  # each micro-batch's mean
    oracle.train()
    ours.train()
    assert len(losses(ours)) == 6 and losses(ours) == pytest.approx(losses(oracle), rel=1e-3)
    assert losses(ours, "grad_norm") == pytest.approx(losses(oracle, "grad_norm"), rel=1e-3)
    mine = ours.strata.state_dict()
    for name, w in oracle.model.named_parameters():
        torch.testing.assert_close(mine[name], w.detach().float().cpu(), rtol=1e-3, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    ours.strata.close()


class Stream(torch.utils.data.IterableDataset):
    """Tokens without a length: the Trainer cannot know an epoch's steps."""

    def __init__(self, n):
        self.data = Tokens(n)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def test_an_epoch_that_ends_inside_a_step_is_named(tmp_path, swap):
    # A dataset without a length of 5 micro-batches, 2 a step: the first epoch runs out one
    # micro-batch into its third step, which strata cannot carry into the next epoch (the Trainer
    # would); the error says so when the epoch ends, and what to do.
    trainer = strata.hf.Trainer(model=llama(), args=args(tmp_path / "run", max_steps=4), train_dataset=Stream(MICRO * 5),
                                strata_config=strata_config(swap))
    with pytest.raises(strata.FailedPrecondition, match=r"the epoch ended 1 micro-batches into an optimizer step "
                                                        r"of 2 .*repeat it endlessly and set max_steps"):
        trainer.train()
    trainer.strata.close()


def test_save_model_says_the_dtype_the_files_hold_and_saves_the_collators_tokenizer(tmp_path, swap):
    # bf16 weights under a config that said float32: config.json says bfloat16, as save_pretrained
    # would; a tokenizer given only to the collator is saved beside them, as the Trainer's _save does.
    class Tok:
        def save_pretrained(self, d):
            open(os.path.join(d, "tok.json"), "w").write("{}")

    class Collator:
        tokenizer = Tok()

        def __call__(self, rows):
            return torch.utils.data.default_collate(rows)

    model = llama()
    model.config.dtype = "float32"
    trainer = strata.hf.Trainer(model=model, args=args(tmp_path / "run", max_steps=1, bf16=True),
                                train_dataset=Tokens(MICRO * GAS), data_collator=Collator(),
                                strata_config=strata_config(swap))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    import json
    assert json.load(open(tmp_path / "saved" / "config.json"))["dtype"] == "bfloat16"
    assert (tmp_path / "saved" / "tok.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype="auto")
    assert next(loaded.parameters()).dtype == torch.bfloat16
    trainer.strata.close()


def test_an_optimizer_given_to_the_trainer_is_refused(tmp_path, swap):
    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(strata.InvalidArgument, match="do not pass optimizers="):
        strata.hf.Trainer(model=model, args=args(tmp_path / "run"), train_dataset=Tokens(8),
                          strata_config=strata_config(swap), optimizers=(opt, None))


def test_two_ranks_under_torchrun_train_as_transformers_trainer_with_ddp(tmp_path, swap):
    # hf_ranks_script.py on two ranks (torchrun, the CPU, Gloo): transformers.Trainer with torch AdamW
    # under DDP, and strata.hf.Trainer with strata's ranks (its batch counts both ranks: each micro-batch
    # a share of the step's tokens over the two, as DDP averages), on the same data and arguments.
    import socket
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_ranks_script.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), script, str(out), str(swap)]
    r = run_logged(cmd, 300, env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    if (out / "skip").exists():
        pytest.skip((out / "skip").read_text())
    got = torch.load(out / "result.pt")
    assert len(got["losses"]) == STEPS and got["losses"] == pytest.approx(got["oracle_losses"], rel=1e-3)
    assert got["norms"] == pytest.approx(got["oracle_norms"], rel=1e-3)
    for name, w in got["oracle"].items():
        torch.testing.assert_close(got["ours"][name], w, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_example_trains_saves_and_fine_tunes_from_its_save(tmp_path):
    # examples/python/hf_trainer.py: the Trainer on the example text, its save_model folder
    # the start of a second run (strata.hf.from_pretrained streams it).
    import json
    import sys
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "examples", "python", "hf_trainer.py")
    small = ["--micro", "2", "--gas", "2", "--seq-len", "32", "--corpus", corpus(tmp_path)]
    first = run_logged([sys.executable, script, "--steps", "10", "--out", str(tmp_path / "a")] + small, 180)
    assert first.returncode == 0, first.stderr[-3000:]
    got = json.loads(first.stdout.strip().splitlines()[-1])
    assert got["steps"] == 10 and got["last_loss"] < got["first_loss"], got
    final = tmp_path / "a" / "final"
    assert (final / "model.safetensors").exists() and (final / "config.json").exists()
    second = run_logged([sys.executable, script, "--init-from", str(final), "--steps", "2", "--out",
                         str(tmp_path / "b")] + small, 180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(second.stdout.strip().splitlines()[-1])["steps"] == 2
