#!/usr/bin/python3
"""The Hugging Face Trainer on strata: transformers.LlamaForCausalLM trained on
the example's English text (data.py) by strata.hf.Trainer, the one-line change
from transformers.Trainer (docs/python.md, "The Hugging Face Trainer").
Needs transformers (pip install transformers; the GPU machine has it).

    examples/python/hf_trainer.py --steps 50 --out /tmp/hf_run
    examples/python/hf_trainer.py --init-from /tmp/hf_run/final --steps 20 --out /tmp/hf_more

--init-from takes a folder save_model (or transformers' save_pretrained) wrote:
the model is built on the meta device and its weights streamed from the
folder's safetensors (strata.hf.from_pretrained). The strata config is
--config (DeepSpeed's keys and strata's; "auto" values come from the
arguments), by default the one below.
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))

import data  # noqa: E402
import llama  # noqa: E402

try:
    import transformers
except ImportError:
    sys.exit("hf_trainer.py needs transformers (pip install transformers)")

import strata.hf  # noqa: E402

# Optimizer state in pinned memory, compute copies on the device (the GPU
# where there is one, else the CPU-emulated host device); the rest from the
# TrainingArguments ("auto").
DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "strata": {"io": {"paths": ["./strata_swap"]}},
}


class Windows(torch.utils.data.Dataset):
    """`count` fixed windows of `seq_len` tokens of the corpus (input ids = labels)."""

    def __init__(self, count, seq_len, corpus=None, seed=0):
        stream = data.TokenStream(data.load_corpus(corpus), seq_len, seed=seed)
        self.x = torch.cat([stream.batch(64) for _ in range((count + 63) // 64)])[:count]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hf_trainer_out", help="the Trainer's output_dir")
    ap.add_argument("--size", default="tiny", choices=sorted(llama.SIZES))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro", type=int, default=8, help="per_device_train_batch_size")
    ap.add_argument("--gas", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--config", help="a strata config (JSON); default: the one in this file")
    ap.add_argument("--corpus", help="a folder of text files to train on (default: the Debian fortunes)")
    ap.add_argument("--init-from", help="a folder of safetensors and config.json to start from")
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint-N folder every N steps (0: none)")
    ap.add_argument("--resume", help="a checkpoint-N folder to resume from")
    args = ap.parse_args()

    if args.init_from:
        model = strata.hf.from_pretrained(transformers.LlamaForCausalLM, args.init_from)
    else:
        c = llama.config_for(args.size, vocab_size=data.VOCAB_SIZE)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, max_position_embeddings=args.seq_len,
            bos_token_id=data.BOS, eos_token_id=data.EOS, pad_token_id=data.PAD, tie_word_embeddings=False))
    config = DEFAULT_CONFIG
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    os.makedirs(os.path.join(args.out, "strata_swap"), exist_ok=True)
    config = json.loads(json.dumps(config).replace("./strata_swap", os.path.join(args.out, "strata_swap")))
    training_args = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.gas, learning_rate=args.lr, weight_decay=0.01, warmup_steps=5,
        lr_scheduler_type="cosine", max_grad_norm=1.0, bf16=args.bf16, logging_steps=max(1, args.steps // 10),
        report_to="none",
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    dataset = Windows(args.steps * args.micro * args.gas, args.seq_len, args.corpus)
    trainer = strata.hf.Trainer(model=model, args=training_args, train_dataset=dataset,   # the one line
                                strata_config=config)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(os.path.join(args.out, "final"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"steps": trainer.state.global_step, "first_loss": losses[0] if losses else None,
                      "last_loss": losses[-1] if losses else None, "saved": os.path.join(args.out, "final")}))
    trainer.strata.close()


if __name__ == "__main__":
    main()
