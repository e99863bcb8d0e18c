"""One rank of a data-parallel run for tests/python/test_ranks.py, launched by
torchrun: the tiny Llama trained through strata.torch with the ranks taken
from torchrun's environment, one micro-batch per rank per step (rank r's of
step s is batch s * world + r). Writes this rank's result to
<out>/rank<r>.pt: its state_dict(shard=True) (other ranks' elements NaN),
its state_dict() (gathered from every rank), the norm of every step, its losses; then every rank saves a checkpoint into
<out>/ckpt and exports into <out>/export.

With a sixth argument "torch_distributed" the script initialises
torch.distributed's process group (Gloo, from torchrun's environment) first,
and strata.torch takes the ranks from it; "torch_distributed_no_folder" does
that where the rendezvous folder cannot be made, and writes each rank's error;
"torch_distributed_store" meets through torch.distributed's store (no
STRATA_RENDEZVOUS_DIR); store_sets counts the keys strata set in torch's
stores (torch.distributed's, or torchrun's agent store without one);
"no_grad" trains test_no_grad.py's model instead (no_grad_run).

usage: ranks_script.py OUT SWAP_DIR PRECISION STEPS CLIP [torch_distributed[_no_folder|_store] | no_grad]"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for sub in ("bindings/python", "examples/python", "tests/python"):
    sys.path.insert(0, os.path.join(ROOT, sub))

import torch  # noqa: E402

import helpers  # noqa: E402
import strata  # noqa: E402
import strata.torch  # noqa: E402


def main():
    out, swap, precision, steps, clip = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    mode = sys.argv[6] if len(sys.argv) > 6 else ""
    if mode.startswith("torch_distributed"):
        torch.distributed.init_process_group("gloo")
    if mode == "no_grad":
        return no_grad_run(out, swap, precision, clip)
    model = helpers.tiny_llama(seed=0)
    cfg = helpers.config(swap, "optimizer_cpu", precision, gas=1, clip=clip, lr=3e-3, weight_decay=0.01)
    if mode == "torch_distributed_no_folder":
        # STRATA_RENDEZVOUS_DIR names a folder that is not there: every rank raises.
        try:
            strata.torch.initialize(model, cfg)
            error = None
        except strata.Unavailable as e:
            error = str(e)
        torch.save({"error": error}, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))
        return 0
    # torch.distributed's store and torchrun's, each wrapped to count the keys strata sets there.
    store_sets = []
    import strata.torch.adapter as adapter

    def counting(make):
        def made():
            store = make()
            if store is None:
                return None

            class Counting:
                def set(self, key, value):
                    store_sets.append(key)
                    return store.set(key, value)

                def get(self, key):
                    return store.get(key)

                def wait(self, keys, timeout):
                    return store.wait(keys, timeout)
            return Counting()
        return made
    adapter._default_store = counting(adapter._default_store)
    adapter._launcher_store = counting(adapter._launcher_store)
    try:
        engine = strata.torch.initialize(model, cfg)
    except strata.Unimplemented as e:
        if "gloo" in str(e).lower():
            with open(os.path.join(out, "skip"), "w") as f:
                f.write(str(e))
            return 0
        raise
    rank, world = engine.rank, engine.world_size
    assert world == int(os.environ["WORLD_SIZE"]) and rank == int(os.environ["RANK"]), (rank, world)
    data = helpers.batches(steps * world)
    norms = []
    losses = helpers.train_strata(engine, model, [data[s * world + rank] for s in range(steps)], steps,
                                  on_step=lambda s, st: norms.append(st.grad_norm))
    # state_dict() on every rank: the masters gathered from both shards.
    torch.save({"state": engine.state_dict(shard=True), "gathered": engine.state_dict(), "norms": norms,
                "losses": losses, "store_sets": len(store_sets),
                # whether torchrun keeps a store for its workers here (its version and rendezvous say)
                "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
                and os.environ.get("TORCHELASTIC_MAX_RESTARTS") == "0"}, os.path.join(out, f"rank{rank}.pt"))
    # Every rank saves its shard into one checkpoint (with its own
    # client_state and RNG states) and exports: the whole model, gathered, written by rank 0.
    torch.manual_seed(100 + rank)  # each rank's RNG its own
    rng = torch.get_rng_state()
    engine.save_checkpoint(os.path.join(out, "ckpt"), client_state={"rank": rank})
    # Loaded by as many ranks, each gets its own blob back: its client_state and its RNG.
    torch.rand(3)
    assert engine.load_checkpoint(os.path.join(out, "ckpt")) == {"rank": rank}, rank
    assert torch.equal(torch.get_rng_state(), rng), f"rank {rank}: the RNG state is not the one it saved"
    engine.export(os.path.join(out, "export"), dtype="fp32")
    # A write inside gathered() on every rank: raised, and since only a rank's
    # own shard can be undone, every rank's next step refuses (none reaches
    # the collectives of a step the others would not join).
    try:
        with engine.gathered():
            next(model.parameters()).data.mul_(0)
        raise AssertionError("a write inside gathered() must raise")
    except strata.ParameterWritten:
        pass
    loss, _ = model(data[0], labels=data[0])
    engine.backward(loss)
    try:
        engine.step()
        raise AssertionError("step() after a write with several ranks must refuse")
    except strata.FailedPrecondition as e:
        assert "differ from the other ranks'" in str(e), str(e)
    engine.close()
    return 0


def no_grad_run(out, swap, precision, clip):
    """test_no_grad.py's branchy model, rank r taking micro-batch r of each
    step: some parameters get a gradient from no rank in a step (skipped,
    strata.no_grad "skip"), one from rank 0 alone in step 3 (not skipped)."""
    import test_no_grad as ng
    model = ng.Branchy()
    cfg = helpers.config(swap, "optimizer_cpu", precision, gas=1, clip=clip, lr=ng.LR, weight_decay=ng.WD,
                         no_grad="skip")
    engine = strata.torch.initialize(model, cfg, blocks=[model.inp, model.mixed, model.branch, model.out])
    rank = engine.rank
    assert engine.world_size == ng.GAS, (engine.world_size, ng.GAS)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    data = ng.data()
    for step in range(ng.STEPS):
        engine.backward(ng.loss_of(model, data[step * ng.GAS + rank], step, rank, dtype))
        engine.step()
    torch.save({"state": engine.state_dict(shard=True)}, os.path.join(out, f"rank{rank}.pt"))
    engine.close()
    return 0


def run():
    """main(), then, where this script initialised torch.distributed, a barrier
    and destroy_process_group: a process that exits with its group alive can
    abort in torch's teardown ("terminate called without an active
    exception" from rank 0, which hosts the group's store) while the others
    still use it."""
    code = main()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(run())
