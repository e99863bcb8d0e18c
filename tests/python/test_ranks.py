"""Data-parallel ranks from Python: two ranks launched with torchrun
(--nproc_per_node 2; strata.torch takes the ranks from its environment and
meets the other over Gloo) train the tiny Llama, one micro-batch each per
step, and give the result of one rank accumulating the same two micro-batches
per step: bf16 bit for bit (the fp32 host gradients are summed in rank order,
the order the single rank accumulates in; engine/engine.h), and fp32 within
the oracle tolerance of torch's AdamW on those micro-batches."""
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import helpers
import llama
import strata.torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, CLIP, WORLD = 8, 0.5, 2
START = time.time()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path, precision, *extra, env_extra=None):
    """Runs ranks_script.py on WORLD ranks; returns every rank's result."""
    out = tmp_path / "out"
    out.mkdir()
    swap = tmp_path / "swap_ranks"
    swap.mkdir()
    # --redirects 1 --tee 1: Debian's torch 1.13 on Python 3.11 cannot parse the
    # default "0" (its Std flag enum lost NONE from iteration); 1 tees stdout.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "--redirects", "1", "--tee", "1", "--log_dir",
           str(tmp_path / "logs"), os.path.join(HERE, "ranks_script.py"), str(out), str(swap), precision,
           str(STEPS), str(CLIP), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    if (out / "skip").exists():
        pytest.skip((out / "skip").read_text())
    return [torch.load(out / f"rank{k}.pt") for k in range(WORLD)]


def assert_no_rendezvous_left():
    """No rendezvous folder of this test's runs stays in the temporary directory
    (the launcher's default one and strata.torch's are removed once the ranks met)."""
    tmp = tempfile.gettempdir()
    left = [n for n in os.listdir(tmp) if n.startswith(("strata-rendezvous-", "strata-torch-rendezvous-"))
            and os.path.getmtime(os.path.join(tmp, n)) >= START]
    assert not left, f"rendezvous folders left in {tmp}: {left}"


def merged(results):
    """Each element from the rank whose shard holds it (the others are NaN
    there); every element held by exactly one rank."""
    state = {}
    for name in results[0]["state"]:
        parts = [r["state"][name] for r in results]
        held = sum((~torch.isnan(p)).int() for p in parts)
        assert torch.all(held == 1), f"{name}: elements held by {held.min().item()}..{held.max().item()} ranks"
        state[name] = torch.stack(parts).nan_to_num(0.0).sum(0) if parts[0].is_floating_point() else parts[0]
    return state


def one_rank(swap_dir, precision):
    """The single rank accumulating both ranks' micro-batches, in rank order."""
    model = helpers.tiny_llama(seed=0)
    cfg = helpers.config(swap_dir, "optimizer_cpu", precision, gas=WORLD, clip=CLIP, lr=3e-3, weight_decay=0.01)
    engine = strata.torch.initialize(model, cfg, ranks=None)
    norms = []
    helpers.train_strata(engine, model, helpers.batches(STEPS * WORLD), STEPS, WORLD,
                         on_step=lambda s, st: norms.append(st.grad_norm))
    state = engine.state_dict()
    engine.close()
    return state, norms


def test_two_ranks_bf16_are_one_rank_accumulating_bit_for_bit(tmp_path, swap_dir):
    results = torchrun(tmp_path, "bf16")
    assert_no_rendezvous_left()
    # No torch.distributed group: the ranks met through torchrun's own store
    # (its agent's, at MASTER_ADDR:MASTER_PORT; no folder, across machines too)
    # where this torchrun keeps one for its workers, else in a folder.
    for k, r in enumerate(results):
        if r["agent_store"]:
            assert r["store_sets"] > 0, f"rank {k} set no key in torchrun's store"
        else:
            assert r["store_sets"] == 0, f"rank {k} set keys in a store torchrun does not keep"
    want, want_norms = one_rank(swap_dir, "bf16")
    assert sum(n > CLIP for n in want_norms) >= STEPS // 2, "clipping must fire for the test to mean anything"
    for k, r in enumerate(results):
        assert r["norms"] == want_norms, f"rank {k}: norms {r['norms']} vs one rank {want_norms}"
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    got = merged(results)
    # Buffers (the rotary tables) are whole on every rank; masters merge.
    helpers.assert_same_bits(got, want, "two ranks vs one rank accumulating")
    # state_dict() gathers them: every rank's is the whole model, in the model's order.
    for k, r in enumerate(results):
        assert list(r["gathered"]) == list(want), f"rank {k}: state_dict()'s keys or order"
        helpers.assert_same_bits(r["gathered"], want, f"rank {k}'s gathered state_dict vs one rank accumulating")
    # The two ranks' checkpoint loads into one rank, every master where it was;
    # their export is the whole model.
    model = helpers.tiny_llama(seed=1)
    engine = strata.torch.initialize(model, helpers.config(swap_dir, "optimizer_cpu", "bf16", gas=WORLD, clip=CLIP,
                                                           lr=3e-3, weight_decay=0.01), ranks=None)
    assert engine.load_checkpoint(str(tmp_path / "out" / "ckpt")) == {"rank": 0}
    helpers.assert_same_bits(engine.state_dict(), want, "two ranks' checkpoint loaded by one rank")
    engine.close()
    # And resumed by one rank as its engine is built (a model on the meta device; each rank's
    # state file read once, its CRC64 taken as it goes).
    with strata.torch.meta_init():
        meta = llama.LlamaForCausalLM(helpers.tiny_llama().config)
    engine = strata.torch.initialize(meta, helpers.config(swap_dir, "optimizer_cpu", "bf16", gas=WORLD, clip=CLIP,
                                                          lr=3e-3, weight_decay=0.01), ranks=None,
                                     resume_from=str(tmp_path / "out" / "ckpt"))
    assert engine.client_state == {"rank": 0}
    helpers.assert_same_bits(engine.state_dict(), want, "two ranks' checkpoint resumed by one rank")
    engine.close()
    exported = strata.torch.load_file(str(tmp_path / "out" / "export" / "model.safetensors"))
    assert exported
    for name, w in exported.items():
        assert torch.equal(w, want[name]), f"{name}: the export differs from the masters"


def test_ranks_taken_from_an_initialised_torch_distributed_group(tmp_path, swap_dir):
    # The script initialises torch.distributed (Gloo) first: strata.torch takes
    # rank, size and a rendezvous folder broadcast over it, and trains as with
    # the launcher's environment: bit for bit one rank accumulating.
    meet = tmp_path / "meet"  # STRATA_RENDEZVOUS_DIR: the folder's parent
    meet.mkdir()
    results = torchrun(tmp_path, "bf16", "torch_distributed", env_extra={"STRATA_RENDEZVOUS_DIR": str(meet)})
    assert list(meet.iterdir()) == [], f"left in STRATA_RENDEZVOUS_DIR: {list(meet.iterdir())}"
    assert [r["store_sets"] for r in results] == [0] * WORLD  # the folder, not torch's store
    want, want_norms = one_rank(swap_dir, "bf16")
    for k, r in enumerate(results):
        assert r["norms"] == want_norms, f"rank {k}: norms {r['norms']} vs one rank {want_norms}"
    helpers.assert_same_bits(merged(results), want, "two ranks from torch.distributed vs one rank accumulating")
    assert_no_rendezvous_left()


def test_ranks_of_a_torch_distributed_group_meet_through_its_store(tmp_path, swap_dir):
    # Without STRATA_RENDEZVOUS_DIR the ranks meet through torch.distributed's
    # own (TCP) store, which ranks on machines without a shared file system
    # reach: no folder is made anywhere (TMPDIR an empty folder of the test's).
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    results = torchrun(tmp_path, "bf16", "torch_distributed_store", env_extra={"TMPDIR": str(tmp)})
    for k, r in enumerate(results):
        assert r["store_sets"] > 0, f"rank {k} set no key in torch.distributed's store"
    assert not [n for n in os.listdir(tmp) if "rendezvous" in n], f"rendezvous folders in {tmp}: {os.listdir(tmp)}"
    want, want_norms = one_rank(swap_dir, "bf16")
    for k, r in enumerate(results):
        assert r["norms"] == want_norms, f"rank {k}: norms {r['norms']} vs one rank {want_norms}"
    helpers.assert_same_bits(merged(results), want, "two ranks meeting through torch's store vs one rank accumulating")


def test_a_rendezvous_folder_rank_0_cannot_make_fails_every_rank(tmp_path):
    # Not a wait in the broadcast until torch's timeout: rank 0 sends the error.
    gone = tmp_path / "not-there"
    results = torchrun(tmp_path, "bf16", "torch_distributed_no_folder", env_extra={"STRATA_RENDEZVOUS_DIR": str(gone)})
    for k, r in enumerate(results):
        assert r["error"] and "could not make a rendezvous folder" in r["error"] and str(gone) in r["error"], \
            f"rank {k}: {r['error']}"


def test_two_ranks_fp32_match_torch_adamw(tmp_path):
    # With STRATA_RENDEZVOUS_DIR (and a run id) the ranks meet in that folder,
    # as the library reads the launcher's environment, not in torchrun's store.
    meet = tmp_path / "meet"
    meet.mkdir()
    results = torchrun(tmp_path, "fp32", env_extra={"STRATA_RENDEZVOUS_DIR": str(meet), "STRATA_RUN_ID": "fp32"})
    assert [r["store_sets"] for r in results] == [0] * WORLD
    assert any(meet.iterdir()), "the ranks did not meet in STRATA_RENDEZVOUS_DIR"
    model = helpers.tiny_llama(seed=0)
    helpers.train_torch(model, helpers.batches(STEPS * WORLD), STEPS, WORLD, lr=3e-3, weight_decay=0.01, clip=CLIP)
    got = merged(results)
    for name, w in model.state_dict().items():
        # The oracle's tolerance (test_oracle.py): the formula order differs in the last bits.
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")
    assert all(math.isfinite(n) for n in results[0]["norms"])


def test_a_parameter_is_skipped_only_when_no_rank_gave_it_a_gradient(tmp_path, swap_dir):
    # strata.no_grad "skip" with ranks: rank r takes micro-batch r of each step of
    # test_no_grad.py's model (a branch used every other step; `mixed.v` used by rank 0
    # alone in step 3): two ranks give, bit for bit, the one rank accumulating both
    # micro-batches, which test_no_grad.py checks against torch's AdamW. A rank that
    # skipped its shard of `mixed.v` in step 3 (it had no gradient of its own) would not.
    import test_no_grad as ng
    results = torchrun(tmp_path, "bf16", "no_grad")
    want = ng.train_strata(swap_dir, "optimizer_cpu", "skip", precision="bf16", clip=CLIP)
    helpers.assert_same_bits(merged(results), want, "two ranks vs one rank accumulating, parameters without gradients")
