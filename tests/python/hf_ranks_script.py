"""One rank of test_hf_trainer.py's two-rank run, launched by torchrun on the
CPU (Gloo): transformers.Trainer with torch's AdamW under DDP (the oracle),
then strata.hf.Trainer with strata's ranks on the host device, on the same
data (accelerate gives each rank its share), arguments and model. Rank 0
writes both runs' logged losses and gradient norms and the two models'
weights to <out>/result.pt.

usage: hf_ranks_script.py OUT SWAP_DIR"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for sub in ("bindings/python", "tests/python"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import torch  # noqa: E402
import transformers  # noqa: E402

import strata  # noqa: E402
import strata.hf  # noqa: E402
from test_hf_trainer import GAS, MICRO, STEPS, Tokens, args, llama, losses, strata_config  # noqa: E402


def main():
    out, swap = sys.argv[1], sys.argv[2]
    world = int(os.environ["WORLD_SIZE"])
    data = Tokens(MICRO * GAS * STEPS * world, masked=True)
    oracle = transformers.Trainer(model=llama(), args=args(os.path.join(out, "oracle"), use_cpu=True),
                                  train_dataset=data)
    oracle.train()
    cfg = strata_config(swap)
    cfg["strata"]["device"] = "host"  # the ranks share no GPU: each its host device
    ours = strata.hf.Trainer(model=llama(), args=args(os.path.join(out, "ours"), use_cpu=True), train_dataset=data,
                             strata_config=cfg)
    try:
        ours.train()
    except strata.Unimplemented as e:  # a libstrata built without Gloo: the test skips, saying so
        if "gloo" not in str(e).lower():
            raise
        if int(os.environ["RANK"]) == 0:
            with open(os.path.join(out, "skip"), "w") as f:
                f.write(str(e))
    else:
        assert ours.strata.world_size == world, ours.strata.world_size
        mine = ours.strata.state_dict()  # every rank calls it: the masters gathered
        if int(os.environ["RANK"]) == 0:
            theirs = {n: p.detach().float().cpu() for n, p in oracle.model.named_parameters()}
            torch.save({"oracle_losses": losses(oracle), "losses": losses(ours),
                        "oracle_norms": losses(oracle, "grad_norm"), "norms": losses(ours, "grad_norm"),
                        "oracle": theirs, "ours": mine}, os.path.join(out, "result.pt"))
        ours.strata.close()
    # Every rank ends the process group (torch's Gloo group left alive at exit can abort the process).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
