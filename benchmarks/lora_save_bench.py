#!/usr/bin/python3
"""What a checkpoint save of a LoRA run costs when its base is read from its
safetensors files (strata.frozen_base "auto"): the bytes the process reads
from storage during save_checkpoint (/proc/self/io read_bytes: the direct
reads of the base's files and of the swap blocks) and the save's time.

The Llama example (examples/python/llama.py) of --size, its bf16 weights
written to WORKDIR/base/model.safetensors, LoRA of --rank on its projections
(strata.torch.lora), examples/configs/llama_lora.json (compute copies on the
swap drive, optimizer state in pinned memory), two steps, then --saves saves
one after the other. The first save also waits for what the last step left
running (the next step's prefetches read the base): the later ones are the
save's own. Prints one JSON line (and writes it with --json).

    STRATA_LIBRARY=build-release/bindings/c/libstrata.so /usr/bin/python3 benchmarks/lora_save_bench.py /tmp/lora_save
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

import llama  # noqa: E402
import strata  # noqa: E402
import strata.torch  # noqa: E402
from strata.torch import lora  # noqa: E402


def read_bytes():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes (a kernel without task I/O accounting)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir")
    ap.add_argument("--size", default="base", choices=sorted(llama.SIZES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    base_dir = os.path.join(a.workdir, "base")
    if not os.path.exists(os.path.join(base_dir, "model.safetensors")):
        os.makedirs(base_dir, exist_ok=True)
        torch.manual_seed(0)
        donor = llama.LlamaForCausalLM(llama.config_for(a.size))
        strata.torch.save_file({k: v.to(torch.bfloat16) for k, v in donor.state_dict().items()},
                               os.path.join(base_dir, "model.safetensors"))
    with open(os.path.join(ROOT, "examples", "configs", "llama_lora.json")) as f:
        cfg = json.load(f)
    swap = os.path.join(a.workdir, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg["strata"]["io"]["paths"] = [swap]
    cfg["train_micro_batch_size_per_gpu"] = 4
    with strata.torch.meta_init():
        model = llama.LlamaForCausalLM(llama.config_for(a.size))
    torch.manual_seed(1)
    lora.apply(model, r=a.rank, alpha=2 * a.rank)
    engine = strata.torch.initialize(model, cfg, weights=base_dir)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        b = torch.randint(0, 260, (4, 128), generator=g)
        loss, _ = model(b, labels=b)
        engine.backward(loss)
        engine.step()
    saves = []
    for k in range(a.saves):
        r0, t0 = read_bytes(), time.perf_counter()
        engine.save_checkpoint(os.path.join(a.workdir, f"ck{k}"))
        t1, r1 = time.perf_counter(), read_bytes()
        saves.append({"read_bytes": r1 - r0, "seconds": round(t1 - t0, 4)})
    engine.close()
    out = {"size": a.size, "lora_rank": a.rank, "frozen_params": frozen, "trainable_params": trainable,
           "base_bf16_bytes": frozen * 2, "library": strata.library_path(), "saves": saves}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
