#!/usr/bin/env python3
"""The planner held to a measured run, in CI: scale_bench trains a small model
(4M parameters, 64 MiB of training state, 64 layers) for three steps under three
placements (everything on nvme, the optimizer and the compute copies in pinned
memory, everything in device memory) with AdamW (and on nvme with
offload_param.max_in_cpu keeping a quarter of the layers' compute copies in
pinned memory, and "auto" under a pinned budget; two micro-batches a step,
with and without), and with Lion (nvme, device)
and Adagrad (pinned), and AdamW on nvme with each optimizer state format
(--optimizer-state fp32,bf16,bf16_stochastic,int8_blockwise in one run), and this test reads its JSON: every
tier's planned bytes within 5% of the measured peak, the planned bytes moved
per step equal to those counted on every steady step, and the loss falling at
every step. With data-parallel ranks (--ranks 1, 2, 4: threads over Gloo, a
16M-parameter model of 32 layers of 8 norm blocks, so every rank's shard is
real elements): every rank's tiers and bytes per step against the plan of one
rank of N (device memory: with the compute copies sharded, a rank's peak may
stay up to one gradient buffer under the plan, drained while a fetch's gather
waits for the others), each rank's disk writes 1/N of one rank's (its shard
of the state and, stage 3, of the compute copies) and its device->host bytes
the fp32 shard of the gradients summed on the device (2/N of one rank's bf16
gradients), and with 2 ranks each
rank's bound measured. The numbers are recomputed here from the planned and measured
bytes, not taken from the tool's verdict. Also: a run that would not fit the
disk limit is refused with a message naming the limit, a bad flag names itself.
Asserts no timings.

    scale_bench_plan_test.py SCALE_BENCH
"""
import json
import os
import subprocess
import sys
import tempfile

TOLERANCE = 0.05
# (placement, optimizer): AdamW in the three placements; Lion and Adagrad, which
# keep two fp32 arrays where AdamW keeps three, in one placement each tier.
RUNS = [("nvme", "AdamW"), ("cpu", "AdamW"), ("device", "AdamW"), ("nvme", "Lion"), ("cpu", "Adagrad"),
        ("device", "Lion")]
TIERS = ["device memory", "pinned memory", "staging (of pinned)", "disk (swap files)"]
LINKS = ["moved host->device", "moved device->host", "moved disk read", "moved disk write"]


def check(cond, what):
    if not cond:
        print(f"scale_bench_plan_test: FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def run(bench, tmp, placement, optimizer, extra=()):
    out = os.path.join(tmp, f"{placement}_{optimizer}{'_'.join(('',) + tuple(extra))}.json")
    # A slow declared device (0.2 TFLOP/s: 2.7 ms per layer's backward) keeps
    # the framework ahead of it, as an asynchronous framework is (the
    # gradient buffers fill their room), and the optimizer's updates behind
    # the backward (with the compute copies on the device, every group's
    # new copies wait for step_end).
    cmd = [bench, "--params", "4M", "--layers", "64", "--steps", "3", "--placement", placement, "--tflops", "0.2",
           "--dir", tmp, "--json", out, "--optimizer", optimizer, *extra]
    if placement != "nvme" or optimizer != "AdamW" or extra:
        cmd.append("--no-bound")  # the bound's measurements once (nvme) are enough
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout)
    check(proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}")
    with open(out) as f:
        return json.load(f)


def check_run(doc, placement, optimizer, bound, state="fp32"):
    """Every check of one run's JSON (module docstring); `bound`: the run measured its bound."""
    name = f"{placement} ({optimizer}, {state} state)"
    check(doc["placement"] == placement, f"{name}: placement {doc['placement']}")
    check(doc["optimizer"] == optimizer, f"{name}: optimizer {doc['optimizer']}")
    check(8 << 20 <= doc["training_state_bytes"] <= 80 << 20,  # (72 MiB with --accum: fp32 host gradients)
          f"{name}: training state {doc['training_state_bytes']} B is not 8-80 MiB")
    checks = {c["what"]: c for c in doc["checks"]}
    check(sorted(checks) == sorted(TIERS + LINKS), f"{name}: checks {sorted(checks)}")
    for what in TIERS:
        c = checks[what]
        planned, measured = c["planned"], c["measured"]
        ok = planned == measured if measured == 0 else abs(planned - measured) <= TOLERANCE * measured
        check(ok, f"{name}: {what}: planned {planned} B, measured peak {measured} B (more than 5% apart)")
    steps = doc["steps"]
    check(len(steps) == 3, f"{name}: {len(steps)} steps")
    for what, key in zip(LINKS, ["h2d", "d2h", "nvme_read", "nvme_write"]):
        planned = checks[what]["planned"]
        for k, s in enumerate(steps[1:], start=2):
            check(s["bytes"][key] == planned,
                  f"{name}: step {k} moved {s['bytes'][key]} B {what[6:]}, the plan {planned} B")
    # Something moves in every placement: the gradients come down.
    check(checks["moved device->host"]["planned"] > 0, f"{name}: no gradients moved")
    check((checks["disk (swap files)"]["measured"] > 0) == (placement == "nvme"),
          f"{name}: swap files {checks['disk (swap files)']['measured']} B")
    losses = [s["loss"] for s in steps]
    check(all(b < a for a, b in zip(losses, losses[1:])), f"{name}: loss does not fall: {losses}")
    check(doc["loss_falls"], f"{name}: the tool says the loss does not fall")
    check(doc.get("optimizer_state") == state, f"{name}: optimizer_state {doc.get('optimizer_state')}")
    if not bound:
        check("no_bound" in doc, f"{name}: a bound with --no-bound")
    else:
        check(doc["bound"]["bound_s"] > 0 and doc["bound"]["step_s"] > 0, f"{name}: no bound")
        iso = doc["bound"]["isolated"]
        check(iso["cpu_copy_s"] > 0, f"{name}: the host device's copies are not in the CPU's time")


def main():
    bench = sys.argv[1]
    # The ranks' runs need the Gloo communicator (meson passes whether the build has it).
    gloo = len(sys.argv) < 3 or sys.argv[2] != "no-gloo"
    with tempfile.TemporaryDirectory(prefix="scale_bench_plan.") as tmp:
        docs = {}
        for placement, optimizer in RUNS:
            doc = run(bench, tmp, placement, optimizer)
            check_run(doc, placement, optimizer, bound=placement == "nvme" and optimizer == "AdamW")
            docs[placement, optimizer] = doc
        # offload_param.max_in_cpu keeping 16 of the 64 layers' compute copies
        # (65,536 elements each) in pinned memory: the plan holds, and against
        # the plain nvme run a steady step reads their two fetches and writes
        # their new copies no more (the kept ones are the first layers, the
        # copies kept on the device since the forward the last).
        kept = run(bench, tmp, "nvme", "AdamW", ("--max-in-cpu", str(16 * 65536)))
        check_run(kept, "nvme", "AdamW", bound=False)
        plain = docs["nvme", "AdamW"]
        for key, less in (("nvme_read", 16 * 2 * 65536 * 2), ("nvme_write", 16 * 65536 * 2)):
            got = plain["steps"][-1]["bytes"][key] - kept["steps"][-1]["bytes"][key]
            check(got == less, f"--max-in-cpu: {key} {got} B less than without it, not {less} B")
        pinned = {d: {c["what"]: c["measured"] for c in docs_["checks"]}["pinned memory"]
                  for d, docs_ in (("plain", plain), ("kept", kept))}
        check(pinned["kept"] > pinned["plain"], f"--max-in-cpu: pinned memory {pinned}")
        # Two micro-batches a step (copies kept on the device since a
        # backward serve the next forward's first fetches), with and without
        # layers kept in pinned memory: the plan holds either way.
        for extra in ((), ("--max-in-cpu", str(16 * 65536))):
            check_run(run(bench, tmp, "nvme", "AdamW", ("--accum", "2") + extra), "nvme", "AdamW", bound=False)
        # "auto" under a 15 MiB pinned budget: the engine keeps what the budget
        # leaves beside the rest (the ring at its depth), and the planner
        # resolves it alike (the plan's disk reads and pinned bytes hold).
        auto = run(bench, tmp, "nvme", "AdamW", ("--max-in-cpu", "auto", "--pinned-budget", "15MiB"))
        check_run(auto, "nvme", "AdamW", bound=False)
        read_less = plain["steps"][-1]["bytes"]["nvme_read"] - auto["steps"][-1]["bytes"]["nvme_read"]
        check(read_less > 0 and read_less % (2 * 65536 * 2) == 0,
              f"--max-in-cpu auto: {read_less} B less read, not a whole number of layers' two fetches")
        # Compressed moments: each run's plan holds as fp32's does, and a
        # steady step reads and writes less by what the format saves.
        out = os.path.join(tmp, "formats.json")
        cmd = [bench, "--params", "4M", "--layers", "64", "--steps", "3", "--placement", "nvme", "--tflops", "0.2",
               "--dir", tmp, "--json", out, "--no-bound", "--optimizer-state",
               "fp32,bf16,bf16_stochastic,int8_blockwise"]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(proc.stdout)
        check(proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}")
        with open(out) as f:
            formats = json.load(f)
        check([r["optimizer_state"] for r in formats["runs"]] == ["fp32", "bf16", "bf16_stochastic", "int8_blockwise"],
              f"runs {[r['optimizer_state'] for r in formats['runs']]}")
        for r in formats["runs"]:
            check_run(r, "nvme", "AdamW", False, r["optimizer_state"])
        rows = formats["comparison"]
        params = formats["runs"][0]["params"]
        check([r["state_bytes_per_param"] for r in rows] == [16, 12, 12, 10], f"state bytes {rows}")
        # Less per parameter each way: bf16 4 B; int8 6 B less 8 B of scales per 256.
        for r, less in zip(rows[1:], [4 * params, 4 * params, 6 * params - 8 * (params // 256)]):
            for key in ("disk_read_bytes", "disk_write_bytes"):
                check(rows[0][key] - r[key] == less,
                      f"{r['optimizer_state']}: {key} {r[key]} B, fp32's {rows[0][key]} B: not {less} B less")
        # Ranks: every rank's checks hold; the state's disk traffic shrinks as 1/N.
        per_rank = {}
        for n in (1, 2, 4) if gloo else ():
            out = os.path.join(tmp, f"ranks{n}.json")
            cmd = [bench, "--params", "16M", "--layers", "32", "--steps", "3", "--placement", "nvme", "--tflops",
                   "0.2", "--dir", tmp, "--json", out, "--ranks", str(n), "--sample-params", "4M"]
            if n != 2:
                cmd.append("--no-bound")  # the ranks' bound measured once
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(proc.stdout)
            check(proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}")
            with open(out) as f:
                doc = json.load(f)
            check(doc["ranks"] == n, f"--ranks {n}: the JSON says {doc['ranks']}")
            if n == 2:
                # Each rank's bound (its isolated resources measured with the other's at once).
                bounds = doc["bound"]["ranks"]
                check(len(bounds) == 2 and all(b["bound_s"] > 0 and b["step_s"] > 0 for b in bounds),
                      f"--ranks 2: the ranks' bounds {bounds}")
                check(doc["bound"]["collectives_s"] > 0, f"--ranks 2: collectives {doc['bound']['collectives_s']} s")
            checks = {c["what"]: c for c in doc["checks"]}
            names = TIERS + LINKS if n == 1 else [f"rank {r}: {w}" for r in range(n) for w in TIERS + LINKS]
            check(sorted(checks) == sorted(names), f"--ranks {n}: checks {sorted(checks)}")
            for what, c in checks.items():
                planned, measured = c["planned"], c["measured"]
                if what.endswith(tuple(LINKS)):
                    ok = planned == measured
                elif measured and measured < planned and c["below"]:
                    # A bound the run may stay under (device memory at stage 3: one gradient buffer).
                    ok = planned - measured <= c["below"] + TOLERANCE * measured
                else:
                    ok = planned == measured if measured == 0 else abs(planned - measured) <= TOLERANCE * measured
                check(ok, f"--ranks {n}: {what}: planned {planned} B, measured {measured} B")
            key = (lambda w: w if n == 1 else f"rank 0: {w}")
            per_rank[n] = {w: checks[key(w)]["measured"] for w in ("moved disk write", "moved device->host")}
        if not gloo:
            print("the ranks' runs left out: this build has no Gloo (libgloo-dev)")
        for n in (2, 4) if gloo else ():
            one = per_rank[1]
            # Writes: the rank's shard of the state once, and (stage 3) its shard of
            # the compute copies sent home to nvme: 1/N of one rank's (every shard is
            # real elements here).
            written = per_rank[n]["moved disk write"]
            check(written * n == one["moved disk write"],
                  f"--ranks {n}: {written} B written, not 1/{n} of {one['moved disk write']} B")
            # Summed on the device, only the rank's fp32 shard of the gradients comes
            # down: 4 B x T / N where one rank's bf16 gradients are 2 B x T.
            check(per_rank[n]["moved device->host"] * n == 2 * one["moved device->host"],
                  f"--ranks {n}: device->host {per_rank[n]['moved device->host']} B, one rank's "
                  f"{one['moved device->host']} B")
        # A run over the disk limit is refused before anything is written.
        proc = subprocess.run([bench, "--params", "4M", "--layers", "64", "--max-disk", "1MiB", "--dir", tmp],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        check(proc.returncode == 1, f"--max-disk 1MiB exited with {proc.returncode}")
        check("--max-disk" in proc.stderr, f"the refusal does not name --max-disk: {proc.stderr}")
        proc = subprocess.run([bench, "--placement", "gpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        check(proc.returncode == 2 and "--placement" in proc.stderr, f"a bad --placement: {proc.stderr}")
        proc = subprocess.run([bench, "--optimizer-state", "fp32,int4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        check(proc.returncode == 2 and "--optimizer-state" in proc.stderr, f"a bad --optimizer-state: {proc.stderr}")
        left = sorted(f for f in os.listdir(tmp) if not f.endswith(".json"))
        check(left == [], f"left behind: {left}")
    print("scale_bench_plan_test: OK")


if __name__ == "__main__":
    main()
