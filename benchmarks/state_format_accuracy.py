#!/usr/bin/env python3
"""The optimizer state formats' accuracy on the main job: the Llama example
(examples/python/train_llama.py) is trained from scratch and exported, then
fine-tuned from that export (other batches: --seed 1) for the same steps on
the same data once per format of strata.optimizer_state (fp32 moments, bf16
rounded to nearest even, bf16 rounded stochastically, 8-bit blockwise). Writes each run's training loss per step and
held-out loss per evaluation, and the final figures against fp32's:

- final training loss: the mean over the last --tail steps (one batch's loss
  is noisy; every run sees the same batches);
- final held-out loss: train_llama's own evaluation after the last step.

    /usr/bin/python3 benchmarks/state_format_accuracy.py --json OUT.json [--png OUT.png]
        [--size small] [--pretrain-steps 200] [--steps 300] [--eval-every 25] [--tail 50] [--work DIR]
    /usr/bin/python3 benchmarks/state_format_accuracy.py --json OUT.json --png OUT.png --replot

The runs use examples/configs/llama_default.json (state on NVMe under the
work directory) with strata.optimizer_state set per run and a constant
learning rate after a short warmup (the fine-tune's scheduler). --png needs
matplotlib (Debian: python3-matplotlib); the runs themselves do not.
--replot draws --png from an existing --json without running anything.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "python", "train_llama.py")
FORMATS = [
    ("fp32", {"format": "fp32"}),
    ("bf16", {"format": "bf16"}),
    ("bf16 stochastic", {"format": "bf16", "rounding": "stochastic"}),
    ("int8 blockwise", {"format": "int8_blockwise"}),
]
STEP = re.compile(r"^step\s+(\d+)\s+loss (\S+).*?(?:val (\S+))?$")
SUMMARY = re.compile(r"held-out loss (\S+)")


def config(work, name, state, steps, lr):
    with open(os.path.join(ROOT, "examples", "configs", "llama_default.json")) as f:
        cfg = json.load(f)
    cfg["strata"]["io"]["paths"] = [os.path.join(work, "swap-" + name.replace(" ", "-"))]
    os.makedirs(cfg["strata"]["io"]["paths"][0], exist_ok=True)
    cfg["strata"]["optimizer_state"] = state
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": lr,
                                                       "warmup_num_steps": max(1, steps // 20),
                                                       "warmup_type": "linear"}}
    path = os.path.join(work, "config-" + name.replace(" ", "-") + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def run(argv, log, eval_every=0):
    """Runs train_llama.py; returns its per-step losses, its evaluations
    (step, held-out loss: every eval_every steps; a step line repeats the last
    one), its final held-out loss and its wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.run([sys.executable, TRAIN, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=ROOT)
        out.write(p.stdout)
    if p.returncode != 0:
        sys.exit(f"state_format_accuracy: train_llama.py {' '.join(argv)} failed ({p.returncode}); see {log}")
    losses, evals, final = [], [], None
    for line in p.stdout.splitlines():
        m = STEP.match(line.strip())
        if m:
            losses.append(float(m.group(2)))
            if m.group(3) is not None and eval_every and int(m.group(1)) % eval_every == 0:
                evals.append((int(m.group(1)), float(m.group(3))))
        s = SUMMARY.search(line)
        if s:
            final = float(s.group(1))
    return losses, evals, final, time.perf_counter() - t0


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    tail = doc["tail"]
    for r in doc["runs"]:
        losses = r["train_loss"]
        smooth = [sum(losses[max(0, i - tail + 1):i + 1]) / len(losses[max(0, i - tail + 1):i + 1])
                  for i in range(len(losses))]
        ax1.plot(range(1, len(losses) + 1), smooth, label=r["name"])
        ax2.plot([s for s, _ in r["held_out"]], [v for _, v in r["held_out"]], marker="o", label=r["name"])
    ax1.set_title(f"training loss (mean of the last {tail} steps)")
    ax2.set_title("held-out loss")
    for ax in (ax1, ax2):
        ax.set_xlabel("fine-tuning step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Llama {doc['size']} fine-tuned from an export: optimizer state formats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--size", default="small")
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--tail", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3, help="the fine-tune's learning rate")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--replot", action="store_true", help="only draw --png from the --json of an earlier run")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.png:
            ap.error("--replot needs --png")
        with open(args.json) as f:
            plot(json.load(f), args.png)
        return 0
    work = args.work or tempfile.mkdtemp(prefix="strata-accuracy-")
    os.makedirs(work, exist_ok=True)
    base = os.path.join(work, "base")
    common = ["--size", args.size, "--no-progress", "--sample", "0"]
    if not os.path.exists(os.path.join(base, "model.safetensors")):
        pre = config(work, "pretrain", {"format": "fp32"}, args.pretrain_steps, 3e-3)
        print(f"pretraining {args.size} for {args.pretrain_steps} steps -> {base}", flush=True)
        run([*common, "--config", pre, "--steps", str(args.pretrain_steps), "--eval-every", "0",
             "--log-every", str(args.pretrain_steps), "--export", base], os.path.join(work, "pretrain.log"))
    doc = {"size": args.size, "pretrain_steps": args.pretrain_steps, "steps": args.steps, "tail": args.tail,
           "lr": args.lr, "command": "benchmarks/state_format_accuracy.py " + " ".join(argv or sys.argv[1:]),
           "runs": []}
    for name, state in FORMATS:
        cfg = config(work, name, state, args.steps, args.lr)
        print(f"fine-tuning with {name} moments for {args.steps} steps", flush=True)
        losses, evals, final, seconds = run(
            [*common, "--config", cfg, "--init-from", base, "--steps", str(args.steps), "--eval-every",
             str(args.eval_every), "--log-every", "1", "--seed", "1"], os.path.join(work, f"{name.replace(' ', '-')}.log"),
            args.eval_every)
        if len(losses) != args.steps or final is None:
            sys.exit(f"state_format_accuracy: {name}: {len(losses)} step lines, final held-out {final}")
        doc["runs"].append({"name": name, "optimizer_state": state, "train_loss": losses, "held_out": evals,
                            "final_train_loss": sum(losses[-args.tail:]) / args.tail,
                            "final_held_out_loss": final, "seconds": seconds})
    ref = doc["runs"][0]
    for r in doc["runs"]:
        r["train_vs_fp32"] = r["final_train_loss"] / ref["final_train_loss"] - 1
        r["held_out_vs_fp32"] = r["final_held_out_loss"] / ref["final_held_out_loss"] - 1
        print(f"{r['name']:16s} final training loss {r['final_train_loss']:.4f} ({100 * r['train_vs_fp32']:+.2f}%), "
              f"held-out {r['final_held_out_loss']:.4f} ({100 * r['held_out_vs_fp32']:+.2f}%), {r['seconds']:.0f} s")
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    if args.png:
        plot(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
