#!/usr/bin/python3
"""Pre-train or fine-tune a Llama-architecture model through strata.

The PyTorch loop is an ordinary one; the lines that hand the model to strata
are marked "strata:". By default it pre-trains a small model (examples/python/
llama.py) on English text (the Debian `fortunes` collection) with a byte-level
tokenizer, on the embedded default config (the emulated host device, compute
copies in pinned memory, optimizer state on NVMe under ./strata_swap).

    scripts/run.sh                                   # the README's main job
    examples/python/train_llama.py --steps 300 --size base
    examples/python/train_llama.py --export out      # then fine-tune from it:
    examples/python/train_llama.py --init-from out --steps 50
    examples/python/train_llama.py --checkpoint ckpt --save-every 50 [--resume]
    examples/python/train_llama.py --hf              # transformers.LlamaForCausalLM, same adapter

SIGINT / SIGTERM (Ctrl-C, kill): the first one lets the step in flight finish,
starts no checkpoint, closes the engine (its swap files removed unless
strata.io.keep_files) and exits 130 / 143 after a line saying at which step; a
checkpoint already being saved completes (saves become `latest` only by an
atomic rename). A second signal ends the process at once (by that signal),
leaving the swap files for the next run in that directory to reclaim. The strata library
installs no signal handler: the program does.
"""
import argparse
import json
import math
import os
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

import data  # noqa: E402
import llama  # noqa: E402
import strata  # noqa: E402
import strata.torch  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the script runs without a progress bar
    tqdm = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "configs", "llama_default.json"),
                    help="strata config (JSON; DeepSpeed's keys accepted)")
    ap.add_argument("--size", default="small", choices=sorted(llama.SIZES), help="model size preset")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=40, help="held-out loss every N steps (0: only at the end)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--checkpoint", help="checkpoint directory")
    ap.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps")
    ap.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    ap.add_argument("--export", help="write the final weights (safetensors, Hugging Face names) here")
    ap.add_argument("--init-from", help="fine-tune: take the initial weights from this safetensors directory "
                                        "(built on the meta device: the host never holds the whole model)")
    ap.add_argument("--hf", action="store_true", help="train transformers.LlamaForCausalLM built from a config")
    ap.add_argument("--tie", action="store_true", help="tie the output projection to the embedding")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    ap.add_argument("--corpus", help="a directory of text files (default: the fortunes collection)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=120, help="bytes to generate at the end (0: none)")
    ap.add_argument("--no-progress", action="store_true", help="one line per eval instead of a progress bar")
    ap.add_argument("--log-every", type=int, help="with --no-progress: a line every N steps (default: --eval-every, "
                                                   "else 10; the first step always has one)")
    ap.add_argument("--build-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the dtype of the parameters the model is built with before strata takes them: bf16 "
                         "halves the framework's initial copy in host memory, for the largest models (the "
                         "engine's master weights start from those bf16 values)")
    ap.add_argument("--build-device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the model's random initial weights are made before strata takes them (on the "
                         "CPU): cuda makes them on the GPU and moves them down, minutes faster for billions of "
                         "parameters (torch draws normal_ on one CPU thread); auto: cuda when torch sees a GPU "
                         "with room for the built model, else cpu. The weights drawn differ between the two "
                         "(each device's own random stream); --init-from needs neither")
    args = ap.parse_args(argv)
    if args.log_every is not None and args.log_every < 1:
        ap.error(f"--log-every must be >= 1, not {args.log_every}")
    if (args.resume or args.save_every) and not args.checkpoint:
        ap.error("--resume and --save-every need --checkpoint DIR")
    if args.build_device == "cuda" and not torch.cuda.is_available():
        ap.error("--build-device cuda: torch sees no CUDA device")
    return args


class StopSignals:
    """SIGINT / SIGTERM handlers for the training loop: the first signal is
    recorded (`signum`) and the loop stops after the step in flight; the
    handlers then go back to the default action, so a second signal ends the
    process at once, even inside a long call into the library (it dies by that
    signal: the shell shows 130 / 143). Restores the previous handlers on exit."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def _handle(self, signum, frame):
        self.signum = signum
        for s in self._previous:
            signal.signal(s, signal.SIG_DFL)
        print(f"\ntrain_llama: {signal.Signals(signum).name}: stopping after the step in flight "
              "(a second signal exits at once)", file=sys.stderr, flush=True)

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        return False


def build_device(args, cfg):
    """Where the model is built (--build-device): "cpu" or "cuda"."""
    if args.init_from or args.build_device == "cpu":
        return "cpu"  # --init-from builds on the meta device: nothing to draw
    if args.build_device == "cuda":
        return "cuda"  # (parse_args refused it without a CUDA device)
    if not torch.cuda.is_available():
        return "cpu"
    free, _ = torch.cuda.mem_get_info()
    bytes_built = cfg.param_count() * (2 if args.build_dtype == "bf16" else 4)
    return "cuda" if bytes_built + (1 << 30) <= free else "cpu"


def build_model(args, cfg, device):
    """The model, its parameters on the CPU (or the meta device with --init-from), drawn on `device`."""
    if device == "cpu":
        return _build_model_in(args, cfg)
    with torch.device(device):  # the initial draws on the GPU, then down to the host for strata
        model = _build_model_in(args, cfg)
    model.to("cpu")
    torch.cuda.empty_cache()
    return model


def _build_model_in(args, cfg):
    if args.build_dtype == "fp32":
        return _build_model(args, cfg)
    # bf16: built so (the default dtype while the modules are made), and any
    # parameter made otherwise converted after, each in turn.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = _build_model(args, cfg)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type != "meta" and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
    return model


def _build_model(args, cfg):
    if args.hf:
        import transformers  # only where installed (the GPU machine)
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=data.BOS, eos_token_id=data.EOS, pad_token_id=data.PAD)
        if args.init_from:
            with strata.torch.meta_init():
                return transformers.LlamaForCausalLM(hf_cfg)
        return transformers.LlamaForCausalLM(hf_cfg)
    if args.init_from:
        with strata.torch.meta_init():
            return llama.LlamaForCausalLM(cfg)
    return llama.LlamaForCausalLM(cfg)


def loss_of(model, batch, hf):
    if hf:
        return model(input_ids=batch, labels=batch).loss
    return model(batch, labels=batch)[0]


def no_decay_groups(model):
    """Torch-style parameter groups: no weight decay on norms (1-D weights)."""
    flat = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": flat, "weight_decay": 0.0, "name": "norms"}] if flat else []


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def print_swap_wear(swaps, step_bytes, nvme_written, steps):
    """The SSD wear figures: bytes written to the swap paths since the engine
    was created (the swap files' first contents included) and per step."""
    if not swaps:
        print("swap (SSD wear): nothing lives on nvme, no swap writes")
        return
    print(f"swap (SSD wear): wrote {fmt_bytes(sum(s.bytes_written_total for s in swaps))} to {len(swaps)} path(s) "
          f"since the engine was created, {fmt_bytes(nvme_written / steps)} per step on average; "
          f"read {fmt_bytes(sum(s.bytes_read_total for s in swaps))}")
    for s in swaps:
        print(f"  {s.path}: wrote {fmt_bytes(s.bytes_written_total)}, "
              f"{fmt_bytes(step_bytes.get(s.path, 0) / steps)} per step; read {fmt_bytes(s.bytes_read_total)}")


def evaluate(model, batches, hf, engine):
    model.eval()
    total = 0.0
    with torch.no_grad(), engine.resident():
        for b in batches:
            total += loss_of(model, b.to(engine.torch_device), hf).item()
    model.train()
    return total / len(batches)


def main(argv=None):
    args = parse_args(argv)
    with StopSignals() as stop:
        return run(args, stop)


def run(args, stop):
    torch.manual_seed(args.seed)
    with open(args.config) as f:
        config = json.load(f)
    micro = int(config.get("train_micro_batch_size_per_gpu", 8))
    cfg = llama.config_for(args.size, vocab_size=data.VOCAB_SIZE, tie_word_embeddings=args.tie,
                           max_position_embeddings=max(2048, args.seq_len))
    if args.layers:
        cfg.num_hidden_layers = args.layers
    text = data.load_corpus(args.corpus)
    stream = data.TokenStream(text, args.seq_len, seed=args.seed)

    t0 = time.perf_counter()
    device = build_device(args, cfg)
    model = build_model(args, cfg, device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    t1 = time.perf_counter()
    # strata: hand the model to the engine (parameters, gradients, optimizer).
    engine = strata.torch.initialize(model, config, param_groups=no_decay_groups(model), weights=args.init_from)
    print(f"setup: model built in {t1 - t0:.1f} s (drawn on {device}), strata.torch.initialize "
          f"{time.perf_counter() - t1:.1f} s", flush=True)
    try:
        return train(args, cfg, text, stream, model, engine, micro, stop)
    finally:
        engine.close()  # strata: swap files removed (unless strata.io.keep_files)


def train(args, cfg, text, stream, model, engine, micro, stop):
    gas = engine.gradient_accumulation_steps
    held_out = stream.held_out_batches(micro, args.eval_batches)
    first_step = 0
    if args.resume:
        state = engine.load_checkpoint(args.checkpoint)  # strata: the whole state, any placement
        stream.restore(state["data"])
        first_step = state["step"]
        print(f"resumed from {args.checkpoint} at step {first_step}")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {cfg.num_hidden_layers} "
          f"layers, hidden {cfg.hidden_size}; {len(engine.groups)} fetch groups on the {engine.device} device "
          f"({str(engine.dtype).replace('torch.', '')}); batch {micro} x {gas} x {args.seq_len} tokens; "
          f"corpus {len(text) / 1e6:.1f} MB")

    tokens_per_step = micro * gas * args.seq_len
    flops_per_step = cfg.flops_per_token(args.seq_len) * tokens_per_step
    first_loss = last_loss = None
    val = None
    bar = None
    if tqdm is not None and not args.no_progress:
        bar = tqdm(total=args.steps, initial=first_step, unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    steps_run = 0
    done = first_step  # the last step completed
    swap_step_bytes = {}  # swap path -> bytes written by the steps run (the SSD wear figures)
    nvme_written = 0
    for step in range(first_step, args.steps):
        if stop.signum:
            break
        t0 = time.perf_counter()
        loss_sum = 0.0
        for _ in range(gas):
            batch = stream.batch(micro).to(engine.torch_device)
            loss = loss_of(model, batch, args.hf)
            engine.backward(loss)       # strata: instead of loss.backward()
            loss_sum += loss.item()
        stats = engine.step()           # strata: instead of optimizer.step()
        nvme_written += stats.bytes_nvme_write
        for s in engine.swap_stats():   # strata: the step's writes per swap path
            swap_step_bytes[s.path] = swap_step_bytes.get(s.path, 0) + s.bytes_written
        if engine.torch_device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        steps_run += 1
        done = step + 1
        last_loss = loss_sum / gas
        first_loss = last_loss if first_loss is None else first_loss
        if not math.isfinite(last_loss):
            sys.exit(f"train_llama: the loss is {last_loss} at step {step + 1}")
        if args.eval_every and (step + 1) % args.eval_every == 0:
            val = evaluate(model, held_out, args.hf, engine)
        info = {"loss": f"{last_loss:.3f}", "tok/s": f"{tokens_per_step / dt:.0f}",
                "h2d": fmt_bytes(stats.bytes_h2d), "d2h": fmt_bytes(stats.bytes_d2h),
                "nvme": f"{fmt_bytes(stats.bytes_nvme_read)}/{fmt_bytes(stats.bytes_nvme_write)}"}
        if val is not None:
            info["val"] = f"{val:.3f}"
        if bar is not None:
            bar.set_postfix(info, refresh=False)
            bar.update(1)
        elif (step + 1) % (args.log_every or args.eval_every or 10) == 0 or step == first_step:
            print(f"step {step + 1:5d}  " + "  ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        # No checkpoint is started after a stop signal.
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0 and not stop.signum:
            engine.save_checkpoint(args.checkpoint, client_state={"data": stream.state(), "step": step + 1})
    if bar is not None:
        bar.close()
    if stop.signum:
        print(f"train_llama: interrupted by {signal.Signals(stop.signum).name} at step {done}; "
              + ("the checkpoint named by `latest` is the last complete one (--resume continues)"
                 if args.save_every else "nothing saved"), flush=True)
        return 128 + stop.signum
    elapsed = time.perf_counter() - t_start
    val = evaluate(model, held_out, args.hf, engine)
    if steps_run:
        tps = steps_run * tokens_per_step / elapsed
        print(f"summary: {steps_run} steps in {elapsed:.1f} s, {tps:.0f} tokens/s, "
              f"{flops_per_step * steps_run / elapsed / 1e12:.3f} model TFLOPS; "
              f"loss {first_loss:.3f} -> {last_loss:.3f}; held-out loss {val:.3f}")
        print_swap_wear(engine.swap_stats(), swap_step_bytes, nvme_written, steps_run)
    if args.sample and not args.hf:
        prompt = torch.tensor([data.encode("The ")], device=engine.torch_device)
        with engine.resident():  # strata: groups stay fetched through the generation
            out = model.generate(prompt, args.sample, temperature=0.8,
                                 generator=torch.Generator(device=engine.torch_device).manual_seed(args.seed))
        print("sample: " + repr(data.decode(out[0].tolist())))
    if args.checkpoint and args.save_every:
        engine.save_checkpoint(args.checkpoint, client_state={"data": stream.state(), "step": args.steps})
    if args.export:
        engine.export(args.export, dtype="bf16" if engine.dtype == torch.bfloat16 else "f32")
        print(f"exported to {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
