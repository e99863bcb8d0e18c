"""The `strata` package: the C API from Python (ctypes), its errors and the
library lookup."""
import array
import os
import subprocess
import sys

import pytest
import torch
import torch.utils.dlpack

import helpers
import strata


def test_version_and_library():
    assert strata.version().startswith("0.")
    assert os.path.exists(strata.library_path())


def test_config_check_and_resolve(swap_dir):
    assert strata.config_check(helpers.config(swap_dir)) == 0
    cfg = helpers.config(swap_dir)
    cfg["no_such_key"] = 1
    assert strata.config_check(cfg) == 1  # an unknown DeepSpeed-level key is a warning
    cfg = helpers.config(swap_dir)
    cfg["strata"]["no_such_key"] = 1  # in strata's own section: an error
    with pytest.raises(strata.InvalidArgument, match=r"strata\.no_such_key: unknown key in strata's own section"):
        strata.config_check(cfg)
    cfg = helpers.config(swap_dir)
    cfg["gradient_cliping"] = 1.0  # a misspelling: an error naming the key it resembles
    with pytest.raises(strata.InvalidArgument, match=r'gradient_cliping: unknown key; did you mean "gradient_clipping"'):
        strata.config_check(cfg)
    resolved = strata.config_resolve(helpers.config(swap_dir))
    assert resolved["strata"]["device"] == "host"
    assert resolved["optimizer"]["params"]["betas"] == [0.9, 0.999]
    with pytest.raises(strata.InvalidArgument, match=r"gradient_clipping") as info:
        strata.config_check({"train_batch_size": 1, "gradient_clipping": "high"})
    assert info.value.status == "INVALID_ARGUMENT" and info.value.code == 1
    assert isinstance(info.value, ValueError)


def test_total_num_steps_and_strict_reach_the_config_when_passed(swap_dir):
    cfg = helpers.config(swap_dir)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": "auto"}}
    with pytest.raises(strata.InvalidArgument, match=r"total_num_steps: \"auto\" cannot be resolved"):
        strata.Engine(cfg)
    with pytest.raises(strata.InvalidArgument, match=r"total_num_steps="):
        strata.config_check(cfg)
    assert strata.config_resolve(cfg, total_num_steps=77)["scheduler"]["params"]["total_num_steps"] == 77
    with strata.Engine(cfg, total_num_steps=77):
        pass
    unknown = helpers.config(swap_dir)
    unknown["no_such_key"] = 1
    assert strata.config_check(unknown) == 1
    with strata.Engine(unknown):
        pass
    with pytest.raises(strata.InvalidArgument, match=r"no_such_key"):
        strata.config_check(unknown, strict=True)
    with pytest.raises(strata.InvalidArgument, match=r"no_such_key"):
        strata.Engine(unknown, strict=True)
    buckets = {"train_batch_size": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    assert strata.config_resolve(buckets, hidden_size=8)["zero_optimization"]["reduce_bucket_size"] == 64
    with pytest.raises(strata.InvalidArgument, match=r"options->total_num_steps is -3"):
        strata.config_check(cfg, total_num_steps=-3)
    with pytest.raises(TypeError, match=r"total_num_steps must be an int"):
        strata.Engine(cfg, total_num_steps=7.5)
    # DeepSpeed's batch over ranks: 16 sequences on 2 ranks of 4 is 2 micro-batches each.
    batch = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}
    assert strata.config_resolve(batch, world_size=2)["gradient_accumulation_steps"] == 2
    assert strata.config_resolve(batch)["gradient_accumulation_steps"] == 4
    with pytest.raises(strata.InvalidArgument, match=r"x the world size \(3\)"):
        strata.config_check(batch, world_size=3)


def test_library_lookup_names_what_it_tried(tmp_path):
    missing = str(tmp_path / "nope" / "libstrata.so")
    env = dict(os.environ, STRATA_LIBRARY=missing)
    r = subprocess.run([sys.executable, "-c", "import strata"], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__))))
    assert r.returncode != 0
    assert "libstrata.so not found" in r.stderr and missing in r.stderr


def linear_engine(swap_dir, placement="optimizer_cpu"):
    e = strata.Engine(helpers.config(swap_dir, placement, lr=0.1, weight_decay=0.0))
    g1 = e.add_optimizer_group("no_decay", weight_decay=0.0, lr_scale=0.5)
    assert g1 == 1

    def init(name, out):
        for i in range(len(out)):
            out[i] = 0.01 * (i % 7) + (0.5 if name == "b" else 0.0)

    e.register("w", (4, 8), group="layer", init=init)
    e.register("b", (4,), group="layer", optimizer_group=g1, init=init)
    e.register("frozen", (3,), group="other", frozen=True, init=init)
    e.finalize()
    return e


def test_the_step_through_the_host_calls(swap_dir):
    with linear_engine(swap_dir) as e:
        info = e.group_info("layer")
        assert info.dtype == "f32" and info.device == "host" and info.param_count == 2 and info.trainable
        assert info.device_index == 0
        assert not e.group_info("other").trainable
        off_w, group = e.param_offset("w")
        off_b, _ = e.param_offset("b")
        assert group == "layer" and off_w != off_b
        weights = torch.empty(info.numel)
        e.fetch_host("layer", weights)
        assert weights[off_w + 1].item() == pytest.approx(0.01)
        grads = torch.zeros(info.numel)
        grads[off_w:off_w + 32] = 1.0
        e.grads_host("layer", grads)
        e.release("layer")
        stats = e.step_end()
        assert stats.step == 1 and not stats.skipped
        assert stats.grad_norm == pytest.approx(32 ** 0.5)
        master = torch.empty(32)
        e.read_master("w", master)
        assert master[0].item() == pytest.approx(-0.1, rel=1e-4)  # Adam's first step moves by lr
        b = array.array("f", [0.0] * 4)
        e.read_master("b", b)
        assert list(b) == pytest.approx([0.5, 0.51, 0.52, 0.53])  # no gradient, no decay: unchanged
        assert e.stats().step == 1
        # read_weights: the masters of trainable parameters, a frozen one's compute copies, in one call.
        w, b2, frozen = torch.full((32,), float("nan")), torch.full((4,), float("nan")), torch.full((3,), float("nan"))
        e.read_weights([("w", w), ("b", b2), ("frozen", frozen)])
        assert torch.equal(w, master) and torch.equal(b2, torch.tensor(list(b)))
        assert torch.equal(frozen, torch.tensor([0.0, 0.01, 0.02]))  # its initial values (fp32 compute copies)
        with pytest.raises(strata.InvalidArgument, match=r"read_weights\('w'\): 32 elements, buffer of 31"):
            e.read_weights([("b", b2), ("w", torch.empty(31))])
        with pytest.raises(strata.NotFound, match="no parameter named 'nope'"):
            e.read_weights([("nope", torch.empty(1))])
        e.read_weights([])  # nothing asked, nothing read


def test_a_mixed_groups_gradients_begin_at_its_first_trainable_slot(swap_dir):
    """A group of a frozen "base" and a trainable "lora" (a LoRA block's shape): its gradient buffer,
    a GRADS tensor and grads_host's shorter form begin at grad_offset_bytes; the whole layout works too."""
    masters = []
    for how in ("dlpack", "whole", "part"):
        e = strata.Engine(helpers.config(swap_dir, "optimizer_cpu", lr=0.1, weight_decay=0.0))
        e.register("base", (64, 64), group="m", frozen=True, init=lambda name, out: None)
        e.register("lora", (4, 8), group="m", init=lambda name, out: None)
        e.finalize()
        with e:
            info = e.group_info("m")
            off_base, _ = e.param_offset("base")
            off_lora, _ = e.param_offset("lora")
            assert off_base == 0 and 64 * 64 <= info.grad_offset <= off_lora < info.numel
            assert info.grad_offset_bytes == info.grad_offset * 4
            grads = torch.full((info.numel,), float("nan"))  # the frozen slots: never read
            grads[off_lora:off_lora + 32] = torch.arange(32, dtype=torch.float32) / 32
            grads[info.grad_offset:off_lora] = 0.0
            grads[off_lora + 32:] = 0.0
            if how == "dlpack":
                view = e.grad_buffer("m")
                assert view.offset_bytes == info.grad_offset_bytes
                assert view.size_bytes == info.size_bytes - info.grad_offset_bytes
                t = torch.utils.dlpack.from_dlpack(e.dlpack("m", "grads"))
                assert t.numel() == info.numel - info.grad_offset
                t.copy_(grads[info.grad_offset:])
                del t
                e.grads_ready("m")
            else:
                e.grads_host("m", grads if how == "whole" else grads[info.grad_offset:].clone())
            assert not e.step_end().skipped
            with pytest.raises(strata.InvalidArgument, match=r"gradients' part of it"):
                e.grads_host("m", grads[1:].clone())
            master = torch.empty(32)
            e.read_master("lora", master)
            masters.append(master)
    assert torch.equal(masters[0], masters[1]) and torch.equal(masters[1], masters[2])
    assert master[1].item() == pytest.approx(-0.1, rel=1e-4)  # trained: Adam's first step moves by lr


def test_swap_stats_split_the_steps_nvme_bytes_over_the_paths(tmp_path):
    paths = [str(tmp_path / "p0"), str(tmp_path / "p1")]
    for p in paths:
        os.mkdir(p)
    cfg = helpers.config(paths[0], "params_nvme", lr=0.1, weight_decay=0.0)
    cfg["strata"]["io"]["paths"] = paths
    cfg["strata"]["io"]["stripe_bytes"] = 4096  # every block over 4 KiB is striped over both
    cfg["strata"]["overlap"] = "none"  # step_end runs the step's optimizer to the end
    e = strata.Engine(cfg)
    with e:
        assert e.swap_stats() == []  # before finalize
        def init(name, out):
            for i in range(len(out)):
                out[i] = 0.001 * (i % 11)

        e.register("w", (64, 256), group="layer", init=init)
        e.finalize()
        first = e.swap_stats()
        assert [s.path for s in first] == paths
        assert all(s.bytes_written_total > 0 and s.bytes_written == 0 for s in first)  # finalize's first contents
        info = e.group_info("layer")
        for step in range(2):
            weights = torch.empty(info.numel)
            e.fetch_host("layer", weights)
            e.grads_host("layer", torch.full((info.numel,), 0.01))
            e.release("layer")
            before = e.swap_stats()
            stats = e.step_end()
            after = e.swap_stats()
            assert stats.bytes_nvme_write > 0
            assert sum(s.bytes_written for s in after) == stats.bytes_nvme_write
            assert sum(s.bytes_read for s in after) == stats.bytes_nvme_read
            assert all(s.bytes_written > 0 for s in after)
            assert stats.bytes_nvme_write_total == sum(s.bytes_written_total for s in after)
            assert stats.bytes_nvme_read_total == sum(s.bytes_read_total for s in after)
            # Every write of the step happens in step_end (the fetch only reads): what
            # each path's swap file was written meanwhile is the step's share of it.
            for b, a in zip(before, after):
                assert a.bytes_written_total - b.bytes_written_total == a.bytes_written
        assert e.stats().bytes_nvme_write_total == stats.bytes_nvme_write_total


def test_step_stats_say_where_the_cpu_optimizer_threads_run(swap_dir):
    def half(name, out):
        for i in range(len(out)):
            out[i] = 0.5

    cfg = helpers.config(swap_dir, "optimizer_cpu", cpu_adam={"bind": "none", "threads": 2})
    with strata.Engine(cfg) as e:
        assert e.stats().cpu_adam_binding == "" and e.stats().cpu_adam_threads == 0  # before finalize
        e.register("w", (4, 8), group="layer", init=half)
        e.finalize()
        before = e.stats()
        assert before.cpu_adam_threads == 2 and not before.cpu_adam_pinned
        assert before.cpu_adam_binding == "2 threads, not pinned (bind none)"
        assert before.pinned_memory_numa_node == -1  # bind none: the pinned memory is not placed
        info = e.group_info("layer")
        e.fetch_host("layer", torch.empty(info.numel))
        e.grads_host("layer", torch.full((info.numel,), 0.01))
        e.release("layer")
        stats = e.step_end()
        assert (stats.cpu_adam_binding, stats.cpu_adam_threads, stats.cpu_adam_numa_node) == (
            before.cpu_adam_binding, 2, before.cpu_adam_numa_node)
    # The default (bind "auto"): one thread per physical core of the memory's node, pinned when more than one.
    with strata.Engine(helpers.config(swap_dir, "optimizer_cpu")) as e:
        e.register("w", (4, 8), group="layer", init=half)
        e.finalize()
        s = e.stats()
        assert s.cpu_adam_threads >= 1 and s.cpu_adam_pinned == (s.cpu_adam_threads > 1)
        assert s.cpu_adam_numa_node >= 0
        assert f"NUMA node {s.cpu_adam_numa_node}" in s.cpu_adam_binding


def test_errors_carry_the_status_and_message(swap_dir):
    with linear_engine(swap_dir) as e:
        with pytest.raises(strata.FailedPrecondition, match="layer") as info:
            e.release("layer")
        assert info.value.status == "FAILED_PRECONDITION"
        with pytest.raises(strata.NotFound):
            e.group_info("nope")
        with pytest.raises(strata.InvalidArgument, match="size"):
            e.fetch_host("layer", torch.empty(3))
        with pytest.raises(strata.FailedPrecondition):
            e.step_end()  # the trainable group's gradients are missing
        with pytest.raises(strata.FailedPrecondition, match="frozen"):
            e.read_master("frozen", torch.empty(3))
        with pytest.raises(strata.InvalidArgument, match="float32, not torch.bfloat16"):
            e.read_master("w", torch.empty(64, dtype=torch.bfloat16))
        with pytest.raises(strata.InvalidArgument, match="contiguous"):
            e.fetch_host("layer", torch.empty(2 * e.group_info("layer").numel)[::2])
        with pytest.raises(strata.InvalidArgument, match="read-only"):
            e.read_master("w", bytes(128))


def test_an_init_function_that_raises_fails_finalize(swap_dir):
    e = strata.Engine(helpers.config(swap_dir))

    def bad(name, out):
        raise KeyError("no values for " + name)

    e.register("w", (2, 2), init=bad)
    with pytest.raises(strata.Error, match="no values for w") as info:
        e.finalize()
    assert isinstance(info.value.__cause__, KeyError)
    e.close()


def test_dlpack_views_on_the_host_device(swap_dir):
    with linear_engine(swap_dir) as e:
        with pytest.raises(strata.FailedPrecondition, match="layer"):
            e.dlpack("layer", "compute")  # not fetched
        e.fetch("layer")
        view = torch.utils.dlpack.from_dlpack(e.dlpack("layer", "compute"))
        copy = torch.empty(e.group_info("layer").numel)
        assert view.dtype == torch.float32 and view.numel() == copy.numel()
        grads = torch.utils.dlpack.from_dlpack(e.dlpack("layer", "grads"))
        grads.zero_()
        e.grads_ready("layer")
        e.release("layer")
        e.fetch_host("layer", copy)
        e.release("layer")
        e.step_end()
        with pytest.raises(ValueError, match="compute"):
            e.dlpack("layer", "weights")


def test_ranks_with_a_local_rank(swap_dir):
    """One rank said outright, the second of its machine's two (on CUDA it would
    drive device 1); a local rank without its count, or outside it, is refused."""
    cfg = helpers.config(swap_dir)
    with strata.Engine(cfg, ranks={"rank": 0, "size": 1, "local_rank": 1, "local_size": 2}) as e:
        assert e.rank == 0 and e.world_size == 1
    with pytest.raises(TypeError, match="both 'local_rank' and 'local_size'"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 1, "local_rank": 1})
    with pytest.raises(strata.InvalidArgument, match="local_rank is 2 and ranks->local_size 2"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 1, "local_rank": 2, "local_size": 2})


def test_ranks_meeting_through_a_store_object(swap_dir):
    """A ranks dict's store (an object with torch.distributed.Store's set, get
    and wait) goes to the C API as callbacks: a rank alone in it fails to meet
    the other within its timeout, naming the store, having written its keys
    there; a Ctrl-C inside a callback comes out as KeyboardInterrupt; an object
    without set and get is refused."""
    cfg = helpers.config(swap_dir)

    class Alone:
        def __init__(self, interrupt=False):
            self.keys, self.interrupt = [], interrupt

        def set(self, key, value):
            if self.interrupt:
                raise KeyboardInterrupt
            self.keys.append(key)

        def get(self, key):
            raise RuntimeError(f"no key {key}")

        def wait(self, keys, timeout):
            raise RuntimeError(f"no keys {keys} within {timeout}")

    store = Alone()
    with pytest.raises(strata.Unavailable, match="could not meet the others through the caller's store"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": store, "run_id": "run-a", "timeout_s": 0.3})
    assert store.keys and all(k.startswith("run-a") for k in store.keys), store.keys
    with pytest.raises(KeyboardInterrupt):
        strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": Alone(interrupt=True), "run_id": "run-b",
                                  "timeout_s": 0.3})
    with pytest.raises(strata.InvalidArgument, match="a store and no run_id"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": Alone(), "timeout_s": 0.3})
    with pytest.raises(TypeError, match="set\\(key, value\\) and get\\(key\\)"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": object(), "run_id": "run-c"})


def test_strata_timeout_s_sets_the_collectives_timeout(swap_dir, monkeypatch):
    """Ranks taken from a launcher or from torch.distributed give no timeout of
    their own: STRATA_TIMEOUT_S sets it (a rank alone fails to meet within it,
    which names it); a value that is not a positive number is refused, named."""
    import time
    cfg = helpers.config(swap_dir)

    class Empty:
        def set(self, key, value):
            pass

        def get(self, key):
            raise RuntimeError(key)

    monkeypatch.setenv("STRATA_TIMEOUT_S", "0.25")
    start = time.monotonic()
    with pytest.raises(strata.Unavailable, match="within the 250 ms timeout"):
        strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": Empty(), "run_id": "t"})
    assert time.monotonic() - start < 60
    for bad in ("soon", "0.0001", "nan", "-1"):
        monkeypatch.setenv("STRATA_TIMEOUT_S", bad)
        with pytest.raises(strata.InvalidArgument, match=f"STRATA_TIMEOUT_S is '{bad}'"):
            strata.Engine(cfg, ranks={"rank": 0, "size": 2, "store": Empty(), "run_id": "t"})


def test_torchruns_store_that_cannot_be_reached_is_named(monkeypatch):
    """Under torchrun with its agent's store (and no restarts), a rank that
    cannot reach the store raises at once, naming it, instead of meeting
    elsewhere while the others wait for it; without those variables (another
    launcher, an elastic run) the ranks meet in a folder as before."""
    import socket
    import strata.torch.adapter as adapter
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2", "STRATA_TIMEOUT_S": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("STRATA_RENDEZVOUS_DIR", raising=False)
    with pytest.raises(strata.Unavailable, match=f"torchrun's store at 127.0.0.1:{port}"):
        adapter._ranks_from_torchrun_store()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert adapter._ranks_from_torchrun_store() == "launcher"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("STRATA_RENDEZVOUS_DIR", "/tmp")
    assert adapter._ranks_from_torchrun_store() == "launcher"
