#!/usr/bin/python3
"""strata.torch against plain PyTorch on the same machine, model and data.

The Llama example (examples/python/llama.py) trains for a few steps with
torch.optim.AdamW (plain PyTorch, the model in memory) and through the adapter
(strata.torch, optimizer state on the CPU, compute copies on the device), in
interleaved blocks; the table gives medians per step:
  - tokens/s of each, and their ratio;
  - forward+backward (the model's own work plus, for strata, its hooks and
    copies) and the optimizer step (torch's AdamW vs strata's step_end: CPU
    Adam and the compute copies home);
  - the adapter's own time (hooks, fetches and copies, gradient moves;
    StepStats.adapter_seconds) as a share of strata's step, and what strata's
    forward+backward adds to plain PyTorch's step.
Prints a table and writes JSON (--json). Performance is a ratio taken in one
run: never compare absolute times across machines or runs.

    /usr/bin/python3 benchmarks/torch_adapter_bench.py --size small --json docs/results/torch_adapter_small.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

import llama  # noqa: E402
import strata  # noqa: E402
import strata.torch  # noqa: E402

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.95), 1e-8


def strata_config(precision, swap, optimizer, threads, overlap="exact"):
    c = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": optimizer}},
        "strata": {"device": "host", "io": {"paths": [swap]}, "cpu_adam": {"threads": threads}, "overlap": overlap},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(llama.SIZES))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8, help="sequences per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--reps", type=int, default=3, help="interleaved blocks of each")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: strata's bf16 compute copies vs torch.autocast(bf16) over fp32 weights")
    ap.add_argument("--optimizer", default="cpu", choices=["cpu", "nvme"], help="where strata keeps Adam's state")
    ap.add_argument("--threads", type=int, default=0, help="strata.cpu_adam.threads (0: all cores)")
    ap.add_argument("--overlap", default="exact", choices=["none", "exact", "speculative", "delayed"],
                    help="strata.overlap: exact runs Adam during the backward, none after it")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    cfg = llama.config_for(args.size, vocab_size=260)
    torch.manual_seed(0)
    plain = llama.LlamaForCausalLM(cfg)
    adapted = llama.LlamaForCausalLM(cfg)
    adapted.load_state_dict(plain.state_dict())
    swap = tempfile.mkdtemp(prefix="strata_bench_")
    engine = strata.torch.initialize(adapted, strata_config(args.precision, swap, args.optimizer, args.threads,
                                                                 args.overlap))
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (args.micro, args.seq_len), generator=g) for _ in range(4)]
    tokens = args.micro * args.seq_len

    def torch_step(batch):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if args.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = plain(batch, labels=batch)[0]
        else:
            loss = plain(batch, labels=batch)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1, "loss": loss.item()}

    def strata_step(batch):
        t0 = time.perf_counter()
        loss = adapted(batch, labels=batch)[0]
        engine.backward(loss)
        t1 = time.perf_counter()
        stats = engine.step()
        t2 = time.perf_counter()
        return {"step": t2 - t0, "fwd_bwd": t1 - t0, "optimizer": t2 - t1, "adapter": stats.adapter_seconds,
                "loss": loss.item()}

    runs = {"torch": [], "strata": []}
    for fn, name in ((torch_step, "torch"), (strata_step, "strata")):  # warm-up: allocators, the learned order
        for i in range(2):
            fn(data[i % len(data)])
    for rep in range(args.reps):
        for fn, name in ((torch_step, "torch"), (strata_step, "strata")) if rep % 2 == 0 else \
                ((strata_step, "strata"), (torch_step, "torch")):
            for i in range(args.steps):
                runs[name].append(fn(data[i % len(data)]))
    engine.close()

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    t, s = {k: med("torch", k) for k in ("step", "fwd_bwd", "optimizer")}, \
        {k: med("strata", k) for k in ("step", "fwd_bwd", "optimizer", "adapter")}
    res = {
        "size": args.size, "params": cfg.param_count(), "precision": args.precision, "optimizer": args.optimizer,
        "overlap": args.overlap,
        "tokens_per_step": tokens, "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        "torch": t, "strata": s,
        "tokens_per_s": {"torch": tokens / t["step"], "strata": tokens / s["step"]},
        "speedup": t["step"] / s["step"],
        "optimizer_speedup": t["optimizer"] / s["optimizer"],
        "adapter_share_of_strata_step": s["adapter"] / s["step"],
        "fwd_bwd_added_over_torch_step": (s["fwd_bwd"] - t["fwd_bwd"]) / t["step"],
        "final_loss": {"torch": runs["torch"][-1]["loss"], "strata": runs["strata"][-1]["loss"]},
        "command": "/usr/bin/python3 benchmarks/torch_adapter_bench.py " + " ".join(sys.argv[1:]),
    }
    print(f"Llama {args.size} ({cfg.param_count() / 1e6:.1f}M parameters), {args.precision}, {tokens} tokens per "
          f"step, strata optimizer on {args.optimizer}, overlap {args.overlap}; medians of {args.reps} x {args.steps} interleaved steps")
    print(f"| | step (ms) | fwd+bwd (ms) | optimizer (ms) | tokens/s |")
    print(f"| --- | --- | --- | --- | --- |")
    print(f"| PyTorch + torch.optim.AdamW | {t['step'] * 1e3:.1f} | {t['fwd_bwd'] * 1e3:.1f} | "
          f"{t['optimizer'] * 1e3:.1f} | {tokens / t['step']:.0f} |")
    print(f"| strata.torch | {s['step'] * 1e3:.1f} | {s['fwd_bwd'] * 1e3:.1f} | {s['optimizer'] * 1e3:.1f} | "
          f"{tokens / s['step']:.0f} |")
    print(f"speedup (torch step / strata step): {res['speedup']:.2f}; optimizer: {res['optimizer_speedup']:.2f}x; "
          f"adapter's own time: {s['adapter'] * 1e3:.1f} ms = {100 * res['adapter_share_of_strata_step']:.1f}% of "
          f"strata's step; strata's fwd+bwd adds {100 * res['fwd_bwd_added_over_torch_step']:+.1f}% of torch's step")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
