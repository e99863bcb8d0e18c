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
    examples/python/train_llama.py --init-from out --lora 16 --export adapter [--export-merged merged]
                                                     # LoRA: the base frozen, the adapters trained and
                                                     # exported as PEFT writes them
    examples/python/train_llama.py --checkpoint ckpt --save-every 50 [--resume]
    examples/python/train_llama.py --hf              # transformers.LlamaForCausalLM, same adapter

SIGINT / SIGTERM (Ctrl-C, kill): the first one lets the step in flight finish,
starts no checkpoint, closes the engine (its swap files removed unless
strata.io.keep_files) and exits 130 / 143 after a line saying at which step; a
checkpoint already being saved completes (saves become `latest` only by an
atomic rename; saves and exports run on a worker thread, so that signals are
handled during them). A second signal ends the process at once (by that
signal), even in the middle of a save, leaving the swap files and the save's
temporary folder for the next run in that directory to reclaim. The strata library
installs no signal handler: the program does.

Bad input is refused before anything is built, in one line naming the flag or
the file, with exit status 2 (as strata-train does): a number out of its range
or not written in digits, a flag given twice, a --config that is missing, a
directory, unreadable or not a valid config, a swap directory of an explicit
--config that does not exist (the default config's ./strata_swap is created),
a --checkpoint (when saving) or --export folder that cannot be created or
written, or --resume with --steps below the checkpoint's step. Once the
engine holds its swap files (made at full size), the outputs on each file
system (one checkpoint, the export) must fit together in what is free there,
else exit 2 naming their flags and the swap paths on it; a save or export that
fails during the run names its flag (exit 1). An error from
strata (strata.errors) prints one line too: exit 2 for the input's errors
(config, budgets, paths), 1 for faults (I/O, data loss, internal); --debug
shows its traceback instead. Exit status: 0 done, 1 a run-time error, 2 bad
input, 130 / 143 stopped by SIGINT / SIGTERM.
"""
import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
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


PROG = "train_llama.py"
DEFAULT_CONFIG = os.path.join(ROOT, "examples", "configs", "llama_default.json")
INT_MAX = 2**31 - 1


class UsageError(Exception):
    """Bad input found after the flags were parsed: main prints it as one line
    (train_llama.py: <message>) and exits 2."""


class OutputError(Exception):
    """A save or an export that failed during the run (a full disk, an I/O
    error): main prints it as one line naming the flag to change, exit 1."""


class Parser(argparse.ArgumentParser):
    """argparse, strict: one line on stderr and exit 2 on any error, no
    abbreviated flags, and a flag given twice is an error (argparse would
    take the last)."""

    def __init__(self, **kw):
        super().__init__(prog=PROG, allow_abbrev=False, **kw)

    def error(self, message):
        self.exit(2, f"{PROG}: {message} ({PROG} --help lists the flags)\n")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        flags = {s for a in self._actions for s in a.option_strings}
        seen = set()
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if name in flags:
                if name in seen:
                    self.error(f"{name} given twice: give each flag once")
                seen.add(name)
        return super().parse_args(args, namespace)


def int_in(lo, hi):
    """An argparse type: a whole decimal number in [lo, hi], written in digits
    (not 1e3, 0x10, 1_000 or " 5"), as strata-train reads its numbers."""
    def parse(text):
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise argparse.ArgumentTypeError(
                f"'{text}' is not a whole number (write it out in digits, e.g. 1000, not 1e3)")
        if len(text.lstrip("+-0")) > 20 or not lo <= int(text) <= hi:
            raise argparse.ArgumentTypeError(f"'{text}' is out of range: give a whole number in [{lo}, {hi}]")
        return int(text)
    parse.__name__ = f"whole number in [{lo}, {hi}]"
    return parse


def positive_float(text):
    """An argparse type: a finite number above zero (a learning rate)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number above zero")
    return x


def parse_args(argv=None):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="strata config (JSON; DeepSpeed's keys accepted; default: "
                                     "examples/configs/llama_default.json, its swap directory ./strata_swap "
                                     "created when missing)")
    ap.add_argument("--size", default="small", choices=sorted(llama.SIZES), help="model size preset")
    ap.add_argument("--layers", type=int_in(1, 1 << 16), help="override the preset's layer count")
    ap.add_argument("--seq-len", type=int_in(2, 1 << 20), default=128, help="tokens per sequence (128)")
    ap.add_argument("--steps", type=int_in(0, INT_MAX), default=120,
                    help="train until step N, counted from the start of the run (120; with --resume the "
                         "checkpoint's step counts, and N below it is an error)")
    ap.add_argument("--eval-every", type=int_in(0, INT_MAX), default=40,
                    help="held-out loss every N steps (0: only at the end)")
    ap.add_argument("--eval-batches", type=int_in(1, 1 << 16), default=4, help="held-out batches per evaluation")
    ap.add_argument("--checkpoint", help="checkpoint directory (created and checked before training when saving)")
    ap.add_argument("--save-every", type=int_in(0, INT_MAX), default=0,
                    help="save a checkpoint every N steps (0: never)")
    ap.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    ap.add_argument("--export", help="write the final weights (safetensors, Hugging Face names) here")
    ap.add_argument("--init-from", help="fine-tune: take the initial weights from this safetensors directory "
                                        "(built on the meta device: the host never holds the whole model)")
    ap.add_argument("--lora", type=int_in(1, 1 << 16), metavar="RANK",
                    help="LoRA: adapters of this rank on the attention and MLP projections (strata.torch.lora), "
                         "the base frozen (compute copies only, no optimizer state); --export then writes the "
                         "adapters alone, as PEFT does (adapter_model.safetensors, adapter_config.json)")
    ap.add_argument("--lora-alpha", type=positive_float, metavar="ALPHA",
                    help="with --lora: the adapters' scale is ALPHA / RANK (default: 2 x RANK)")
    ap.add_argument("--lora-targets", metavar="NAMES",
                    help="with --lora: the Linear layers (by name) that get adapters, comma-separated (default: "
                         f"{','.join(strata.torch.lora.DEFAULT_TARGETS)})")
    ap.add_argument("--export-merged", metavar="DIR",
                    help="with --lora: also write the model with the adapters merged into the base (safetensors, "
                         "Hugging Face names), loadable without strata or peft")
    ap.add_argument("--hf", action="store_true", help="train transformers.LlamaForCausalLM built from a config")
    ap.add_argument("--tie", action="store_true", help="tie the output projection to the embedding")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of each layer")
    ap.add_argument("--corpus", help="a directory of text files (default: the fortunes collection)")
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    ap.add_argument("--lr", type=positive_float, metavar="LR",
                    help="the peak learning rate, in place of the config's: optimizer.params.lr and, for "
                         "WarmupLR and WarmupDecayLR, scheduler.params.warmup_max_lr (the example configs' 3e-3 "
                         "suits the small presets; wide models need less, e.g. 1e-4 for 7b)")
    ap.add_argument("--sample", type=int_in(0, 1 << 16), default=120, help="bytes to generate at the end (0: none)")
    ap.add_argument("--no-progress", action="store_true", help="one line per eval instead of a progress bar")
    ap.add_argument("--log-every", type=int_in(1, INT_MAX), help="with --no-progress: a line every N steps (default: --eval-every, "
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
    ap.add_argument("--debug", action="store_true",
                    help="an error from strata shows its Python traceback instead of one line")
    args = ap.parse_args(argv)
    if (args.resume or args.save_every) and not args.checkpoint:
        ap.error("--resume and --save-every need --checkpoint DIR")
    if args.lora is None and (args.lora_alpha is not None or args.lora_targets is not None or args.export_merged):
        ap.error("--lora-alpha, --lora-targets and --export-merged need --lora RANK")
    if args.export_merged and not args.export:
        ap.error("--export-merged needs --export DIR (where the adapters go)")
    names = args.lora_targets if args.lora_targets is not None else ",".join(strata.torch.lora.DEFAULT_TARGETS)
    args.lora_targets = tuple(t for t in names.split(",") if t)
    if not args.lora_targets:
        ap.error("--lora-targets: give at least one layer name")
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
        try:  # best effort: stderr may be a pipe whose reader the same signal ended
            print(f"\ntrain_llama: {signal.Signals(signum).name}: stopping after the step in flight "
                  "(a second signal exits at once)", file=sys.stderr, flush=True)
        except OSError:
            pass

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        return False


def while_signals_act(fn, *args, **kwargs):
    """Runs fn (a long call into the library: a save, an export) on a worker
    thread while this one waits, so that a signal's handler runs during it:
    Python runs handlers only on the main thread, between bytecodes, never
    inside a foreign call. The first signal is recorded (the save completes);
    the second finds the default action and ends the process at once. Returns
    fn's result or raises its exception."""
    out = {}

    def work():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            out["error"] = e

    worker = threading.Thread(target=work, name="strata-save", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    finally:
        # Whatever this thread raised meanwhile, the call finishes before the
        # caller goes on (and closes the engine the call is using).
        while worker.is_alive():
            try:
                worker.join()
            except BaseException:  # noqa: B036 (a further interrupt: keep waiting)
                continue
    if "error" in out:
        raise out["error"]
    return out.get("value")


def save(engine, args, stream, step):
    """A checkpoint of `step` under --checkpoint (signals acted on during it);
    a failure raises OutputError naming the flag."""
    try:
        while_signals_act(engine.save_checkpoint, args.checkpoint, client_state={"data": stream.state(), "step": step})
    except strata.errors.Error as e:
        if args.debug:
            raise
        raise OutputError(f"--checkpoint {args.checkpoint}: the save of step {step} failed: {e}; the checkpoint "
                          f"`latest` names is intact: free space there or point --checkpoint elsewhere, then "
                          f"--resume") from None


def export(engine, args, model=None):
    """The weights as safetensors under --export (with --lora the adapters
    alone, as PEFT writes them, and with --export-merged the merged model
    too); a failure raises OutputError naming the flag."""
    dtype = torch.bfloat16 if engine.dtype == torch.bfloat16 else torch.float32
    if args.lora:
        flag = "--export"
        try:
            # The adapters' fp32 masters (small), as PEFT keeps its adapters.
            adapters = engine.state_dict(trainable_only=True)
            while_signals_act(strata.torch.lora.save_adapter, args.export, model, adapters)
            if args.export_merged:
                # The whole model in host memory (the frozen base's copies are exact in `dtype`; each
                # adapter is folded in fp32): about 2-3 bytes per parameter in bf16, one file.
                flag = "--export-merged"
                weights = engine.state_dict(dtype=dtype)
                weights.update(adapters)
                merged = strata.torch.lora.merged_state_dict(model, weights)
                os.makedirs(args.export_merged, exist_ok=True)
                while_signals_act(strata.torch.safetensors.save_file, merged,
                                  os.path.join(args.export_merged, "model.safetensors"), {"format": "pt"})
        except (strata.errors.Error, OSError) as e:
            if args.debug:
                raise
            raise OutputError(f"{flag}: the export failed: {e}: free space there or point {flag} elsewhere") from None
        return
    try:
        while_signals_act(engine.export, args.export, dtype="bf16" if engine.dtype == torch.bfloat16 else "f32")
    except strata.errors.Error as e:
        if args.debug:
            raise
        raise OutputError(f"--export {args.export}: the export failed: {e}: free space there or point --export "
                          f"elsewhere") from None


def on_meta(args):
    """The model is built on the meta device (nothing drawn): its values come
    from --init-from's files, or with --resume (and no --lora, whose frozen
    base has them before the load) from the checkpoint."""
    return bool(args.init_from) or (args.resume and not args.lora)


def build_device(args, cfg):
    """Where the model is built (--build-device): "cpu" or "cuda"."""
    if on_meta(args) or args.build_device == "cpu":
        return "cpu"  # on the meta device: nothing to draw
    if args.build_device == "cuda":
        return "cuda"  # (parse_args refused it without a CUDA device)
    if not torch.cuda.is_available():
        return "cpu"
    free, _ = torch.cuda.mem_get_info()
    bytes_built = cfg.param_count() * (2 if args.build_dtype == "bf16" else 4)
    return "cuda" if bytes_built + (1 << 30) <= free else "cpu"


def build_model(args, cfg, device):
    """The model, its parameters on the CPU (or the meta device: on_meta), drawn on `device`."""
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
        if on_meta(args):
            with strata.torch.meta_init():
                return transformers.LlamaForCausalLM(hf_cfg)
        return transformers.LlamaForCausalLM(hf_cfg)
    if on_meta(args):
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


def check_corpus(args, stream, micro):
    """The corpus is long enough for --seq-len windows and --eval-batches
    held-out batches of `micro` windows each (data.TokenStream's splits)."""
    n = args.seq_len
    spacing = max(1, (len(stream.val) - n - 1) // max(1, micro * args.eval_batches))
    if len(stream.train) < n + 2 or (args.eval_batches - 1) * micro * spacing + n > len(stream.val):
        raise UsageError(f"the corpus ({len(stream.train)} bytes to train on, {len(stream.val)} held out) is too "
                         f"short for --seq-len {n} with --eval-batches {args.eval_batches} of {micro}: give a "
                         f"shorter --seq-len, fewer --eval-batches or a larger --corpus")


def evaluate(model, batches, hf, engine):
    model.eval()
    total = 0.0
    with torch.no_grad(), engine.resident():
        for b in batches:
            total += loss_of(model, b.to(engine.torch_device), hf).item()
    model.train()
    return total / len(batches)


# strata's errors that come from the input (the config, the budgets it sets,
# the paths and files named): exit 2. The rest (I/O faults, data loss,
# internal errors, memory the system would not give) are run-time errors: exit 1.
INPUT_ERRORS = (strata.errors.InvalidArgument, strata.errors.NotFound, strata.errors.AlreadyExists,
                strata.errors.PermissionDenied, strata.errors.ResourceExhausted, strata.errors.FailedPrecondition,
                strata.errors.OutOfRange, strata.errors.Unimplemented)


def main(argv=None):
    args = parse_args(argv)
    try:
        with StopSignals() as stop:
            return run(args, stop)
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        if args.debug:
            raise
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except strata.errors.Error as e:
        # NotFetched is the adapter's report of a program bug: its traceback stays.
        if args.debug or isinstance(e, strata.errors.NotFetched):
            raise
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2 if isinstance(e, INPUT_ERRORS) else 1


def read_config(args):
    """The config as a dict, checked by strata's own bounded reader
    (strata.engine.config_resolve: syntax, nesting, every key) before
    anything is built; raises UsageError naming the file."""
    path = args.config or DEFAULT_CONFIG
    if os.path.isdir(path):
        raise UsageError(f"--config {path}: is a directory, not a config file")
    if not os.path.exists(path):
        raise UsageError(f"--config {path}: no such file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--config {path}: not UTF-8 text (byte {e.start})") from None
    if not text.lstrip().startswith("{"):
        raise UsageError(f"--config {path}: not a JSON object (a config is one: {{...}})")
    try:
        resolved = strata.engine.config_resolve(text)
    except strata.errors.Error as e:
        raise UsageError(f"--config {path}: {e}") from None
    config = json.loads(text)  # the text passed the bounded reader: its depth is bounded
    if args.lr is not None:
        config = with_peak_lr(config, resolved, args.lr)
        try:
            resolved = strata.engine.config_resolve(json.dumps(config))
        except strata.errors.Error as e:
            raise UsageError(f"--lr {args.lr:g} with --config {path}: {e}") from None
    return config, resolved


# The schedules whose peak is a key of their own (WarmupCosineLR's peak is the optimizer's lr).
PEAK_KEYS = {"WarmupLR": "warmup_max_lr", "WarmupDecayLR": "warmup_max_lr"}


def with_peak_lr(config, resolved, lr):
    """The config with its peak learning rate set to lr (--lr): the
    optimizer's lr (the section is added, of the resolved type, when the config
    has none) and the schedule's own peak key where it has one."""
    config = json.loads(json.dumps(config))
    optimizer = config.setdefault("optimizer", {"type": resolved["optimizer"]["type"]})
    optimizer.setdefault("params", {})["lr"] = lr
    schedule = config.get("scheduler")
    key = PEAK_KEYS.get(resolved.get("scheduler", {}).get("type"))
    if isinstance(schedule, dict) and key:
        schedule.setdefault("params", {})[key] = lr
    return config


def swap_paths(config, resolved):
    """(config key, path) of each swap directory the engine will open: none
    when nothing lives on nvme; else strata.io.paths, or the nvme placements'
    nvme_path (docs/config.md, "Precedence")."""
    zero = resolved.get("zero_optimization", {})
    placements = [k for k in ("offload_optimizer", "offload_param") if zero.get(k, {}).get("device") == "nvme"]
    if not placements:
        return []
    paths = config.get("strata", {}).get("io", {}).get("paths")
    if isinstance(paths, str):
        return [("strata.io.paths", paths)]
    if paths:
        return [(f"strata.io.paths[{i}]", p) for i, p in enumerate(paths)]
    out = []
    for k in placements:
        p = config.get("zero_optimization", {}).get(k, {}).get("nvme_path") or "/local_nvme"
        if p not in [q for _, q in out]:
            out.append((f"zero_optimization.{k}.nvme_path", p))
    return out


def check_swap_paths(args, config, resolved):
    """The default config's swap directory is created (one level, as
    strata-train and scripts/run.sh make ./strata_swap); an explicit config's
    must exist: a missing one is a UsageError naming the key and the path."""
    for key, path in swap_paths(config, resolved):
        if os.path.isdir(path):
            continue
        if args.config is None and not os.path.exists(path):
            try:
                os.mkdir(path)
            except OSError as e:
                sys.exit(f"{PROG}: cannot create the default config's swap directory {path}: {e.strerror}")
            continue
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise UsageError(f"--config {args.config or DEFAULT_CONFIG}: {key} {path} {what}: create the directory "
                         f"or point {key} at one")


def check_output_dir(flag, path):
    """As strata-train checks its output folders: creates `path` (and its
    parents) when missing and checks that a file can be created in it; raises
    UsageError naming `flag`. The room is checked once the engine holds its
    swap files (check_output_space)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the directory: {e.strerror}") from None
    try:  # a file made and removed: also right for root, whom os.access(W_OK) waves through
        fd, probe = tempfile.mkstemp(prefix=".train_llama-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write into the directory: {e.strerror}") from None


def outputs(args, n, resolved):
    """What the run writes besides its swap files: (flag, folder, bytes, what)
    for one checkpoint (up to 4 bytes per parameter for the compute copy plus
    12 for the fp32 master and two moments, docs/checkpoints.md) and the
    export (2 bytes per parameter in bf16, else 4)."""
    out = []
    if args.checkpoint and args.save_every:
        out.append(("--checkpoint", args.checkpoint, 16 * n, f"one checkpoint of {n} parameters (up to 16 bytes each)"))
    if args.export:
        per = 2 if resolved.get("bf16", {}).get("enabled") else 4
        # (With --lora the adapters alone go there: far less, counted as the whole model all the same.)
        out.append(("--export", args.export, per * n, f"the export of {n} parameters ({per} bytes each)"))
    if args.export_merged:
        per = 2 if resolved.get("bf16", {}).get("enabled") else 4
        out.append(("--export-merged", args.export_merged, per * n,
                    f"the merged export of {n} parameters ({per} bytes each)"))
    return out


def check_outputs(args, cfg, resolved):
    """--checkpoint (when saving) and --export, before the model is built:
    each folder, and each output's room on its own (together with the swap
    files once they are made: check_output_space)."""
    for out in outputs(args, cfg.param_count(), resolved):
        check_output_dir(out[0], out[1])
        check_output_space([out], [])


def check_output_space(outs, swap_paths):
    """The outputs `outs` (as outputs() gives them) on each file system fit
    together in what is free there; called again once the engine holds its
    swap files (made at full size at finalize, so the free space counts
    them). Raises UsageError naming the flags, and the swap paths that share
    the file system."""
    by_fs = {}
    for flag, path, need, what in outs:
        by_fs.setdefault(os.stat(path).st_dev, []).append((flag, path, need, what))
    for dev, outs in by_fs.items():
        st = os.statvfs(outs[0][1])
        free = st.f_bavail * st.f_frsize
        need = sum(o[2] for o in outs)
        if free >= need:
            continue
        flags = " and ".join(f"{flag} {path}" for flag, path, _, _ in outs)
        whats = " and ".join(f"{what} ({fmt_bytes(b)})" for _, _, b, what in outs)
        swaps = [p for p in swap_paths if os.path.isdir(p) and os.stat(p).st_dev == dev]
        swap_text = (f", after the swap files in {', '.join(swaps)} on the same file system (strata.io.paths)"
                     if swaps else "")
        share = " (one file system)" if len(outs) > 1 else ""
        raise UsageError(f"{flags}{share}: {fmt_bytes(free)} free ({free} bytes){swap_text}, but {whats} need{'s' if len(outs) == 1 else ''} "
                         f"{fmt_bytes(need)} ({need} bytes): free some space, or point "
                         f"{' or '.join(o[0] for o in outs)}{' or strata.io.paths' if swaps else ''} elsewhere")


def checkpoint_step(root):
    """The step that root/latest names ("step-<N> <crc>"), or None when it
    cannot be read so, or when latest is missing but step-<N> folders are there
    (the engine's load then takes the newest complete one, or says why)."""
    latest = os.path.join(root, "latest")
    if not os.path.lexists(latest):
        try:
            names = os.listdir(root)
        except OSError:
            names = []
        if any(re.fullmatch(r"step-[0-9]{1,18}", n) for n in names):
            return None
        raise UsageError(f"--resume: {root} holds no checkpoint ({latest} does not exist)")
    try:
        with open(latest, "rb") as f:
            m = re.match(rb"step-([0-9]{1,18})[ \n]", f.read(4096))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def check_resume_steps(args, step, where):
    if args.steps < step:
        raise UsageError(f"--steps {args.steps} is below the checkpoint's step {step} ({where}): --steps is the "
                         f"step the run ends at, counted from its start; give --steps {step} or more")


def run(args, stop):
    torch.manual_seed(args.seed)
    config, resolved = read_config(args)
    check_swap_paths(args, config, resolved)
    micro = int(config.get("train_micro_batch_size_per_gpu", 8))
    cfg = llama.config_for(args.size, vocab_size=data.VOCAB_SIZE, tie_word_embeddings=args.tie,
                           max_position_embeddings=max(2048, args.seq_len))
    if args.layers:
        cfg.num_hidden_layers = args.layers
    if args.resume:  # before check_outputs, which writes a probe file into --checkpoint
        step = checkpoint_step(args.checkpoint)
        if step is not None:
            check_resume_steps(args, step, os.path.join(args.checkpoint, "latest"))
    check_outputs(args, cfg, resolved)
    try:
        text = data.load_corpus(args.corpus)
    except FileNotFoundError as e:
        raise UsageError(f"--corpus: {e}") from None
    stream = data.TokenStream(text, args.seq_len, seed=args.seed)
    check_corpus(args, stream, micro)

    t0 = time.perf_counter()
    device = build_device(args, cfg)
    model = build_model(args, cfg, device)
    if args.lora:
        try:  # strata.torch.lora: adapters on the projections, everything else frozen
            wrapped = strata.torch.lora.apply(model, args.lora, args.lora_alpha, args.lora_targets)
        except ValueError as e:
            raise UsageError(f"--lora-targets: {e}") from None
        print(f"lora: rank {args.lora}, alpha {args.lora_alpha or 2 * args.lora:g}, {len(wrapped)} layers "
              f"({', '.join(args.lora_targets)}); "
              f"{sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.3f}M trainable of "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    t1 = time.perf_counter()
    # strata: hand the model to the engine (parameters, gradients, optimizer).
    # With --resume the checkpoint's values are loaded as the engine is built
    # (the trained blocks' initial values are neither read nor written).
    engine = strata.torch.initialize(model, config, param_groups=no_decay_groups(model), weights=args.init_from,
                                     resume_from=args.checkpoint if args.resume else None)
    built = "on the meta device" if on_meta(args) else f"drawn on {device}"
    print(f"setup: model built in {t1 - t0:.1f} s ({built}), strata.torch.initialize "
          f"{time.perf_counter() - t1:.1f} s", flush=True)
    try:
        check_output_space(outputs(args, cfg.param_count(), resolved), [s.path for s in engine.swap_stats()])
        return train(args, cfg, text, stream, model, engine, micro, stop)
    finally:
        engine.close()  # strata: swap files removed (unless strata.io.keep_files)


def train(args, cfg, text, stream, model, engine, micro, stop):
    gas = engine.gradient_accumulation_steps
    held_out = stream.held_out_batches(micro, args.eval_batches)
    first_step = 0
    if args.resume:
        state = engine.client_state  # strata: the whole state loaded by initialize, any placement
        stream.restore(state["data"])
        first_step = state["step"]
        check_resume_steps(args, first_step, args.checkpoint)  # (nothing saved yet: the folder is unchanged)
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
    file_read = 0  # a frozen base read from its safetensors files (strata.frozen_base)
    seconds = dict.fromkeys(("fwd_bwd", "step", "fetch", "grads", "optimizer", "adapter"), 0.0)
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
        t1 = time.perf_counter()
        stats = engine.step()           # strata: instead of optimizer.step()
        nvme_written += stats.bytes_nvme_write
        file_read += stats.bytes_file_read
        for s in engine.swap_stats():   # strata: the step's writes per swap path
            swap_step_bytes[s.path] = swap_step_bytes.get(s.path, 0) + s.bytes_written
        if engine.torch_device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        seconds["fwd_bwd"] += t1 - t0
        seconds["step"] += t0 + dt - t1
        for k in ("fetch", "grads", "optimizer", "adapter"):
            seconds[k] += getattr(stats, f"{k}_seconds")
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
                "nvme": f"{fmt_bytes(stats.bytes_nvme_read)}/{fmt_bytes(stats.bytes_nvme_write)}",
                "lr": f"{stats.lr:.3g}"}
        if stats.bytes_file_read:
            info["files"] = fmt_bytes(stats.bytes_file_read)
        if val is not None:
            info["val"] = f"{val:.3f}"
        if bar is not None:
            bar.set_postfix(info, refresh=False)
            bar.update(1)
        elif (step + 1) % (args.log_every or args.eval_every or 10) == 0 or step == first_step:
            print(f"step {step + 1:5d}  " + "  ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        # No checkpoint is started after a stop signal.
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0 and not stop.signum:
            save(engine, args, stream, step + 1)
    if bar is not None:
        bar.close()
    def print_times():
        # Where a step's time goes (means over the steps run): the framework's forward and backward
        # (the loss read back), engine.step(); and the engine's own parts, inside either.
        per = {k: v / steps_run for k, v in seconds.items()}
        print(f"time per step: forward+backward {per['fwd_bwd']:.3f} s, step() {per['step']:.3f} s; of them "
              f"fetch {per['fetch']:.3f} s, gradients {per['grads']:.3f} s, optimizer {per['optimizer']:.3f} s, "
              f"adapter {per['adapter']:.3f} s", flush=True)

    if stop.signum:
        if steps_run:
            print_times()  # a run stopped at a limit still says where its steps' time went
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
        print_times()
        # Where the CPU optimizer's threads ran (strata.cpu_adam.bind), as finalize chose them.
        print(f"cpu_adam: {engine.stats().cpu_adam_binding}")
        print_swap_wear(engine.swap_stats(), swap_step_bytes, nvme_written, steps_run)
        if file_read:
            print(f"frozen base: read from its safetensors files, {fmt_bytes(file_read / steps_run)} per step "
                  f"(no copy on the swap paths, nothing written; strata.frozen_base)")
    if args.sample and not args.hf:
        prompt = torch.tensor([data.encode("The ")], device=engine.torch_device)
        with engine.resident():  # strata: groups stay fetched through the generation
            out = model.generate(prompt, args.sample, temperature=0.8,
                                 generator=torch.Generator(device=engine.torch_device).manual_seed(args.seed))
        print("sample: " + repr(data.decode(out[0].tolist())))
    # The last step's checkpoint, unless the loop just saved it (a resumed run
    # that ran no step has nothing new), and the export; a signal that came
    # after the last step starts neither (one under way completes).
    def interrupted(when):
        print(f"train_llama: interrupted by {signal.Signals(stop.signum).name} {when}", flush=True)
        return 128 + stop.signum

    if stop.signum:
        return interrupted("after the last step: no final save, no export")
    if args.checkpoint and args.save_every and steps_run and args.steps % args.save_every != 0:
        save(engine, args, stream, args.steps)
    if args.export:
        if stop.signum:
            return interrupted("during the final save, which completed: no export")
        export(engine, args, model)
        if args.lora:
            print(f"exported the adapters to {args.export} (PEFT's adapter_model.safetensors, adapter_config.json)"
                  + (f", the merged model to {args.export_merged}" if args.export_merged else ""))
        else:
            print(f"exported to {args.export}")
    if stop.signum:
        return interrupted("during the final save or the export, which completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
