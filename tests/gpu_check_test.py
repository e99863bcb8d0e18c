#!/usr/bin/python3
"""scripts/gpu_check.py summary reads what the tools really write: a short
step_bench run's JSON and a tiny train_llama.py run's lines (on the host
device), beside stages that were skipped for want of a GPU, timed out, or had
no time left. Checks the figures it took against the tools' own output and
each stage's verdict; --allow-skip turns only the skips into passes.

Usage: gpu_check_test.py SOURCE_ROOT STEP_BENCH LIBSTRATA_SO CPU_ADAM_BENCH"""
import json
import os
import re
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def main():
    root, step_bench, lib, cpu_adam_bench = (os.path.abspath(a) for a in sys.argv[1:5])
    script = os.path.join(root, "scripts", "gpu_check.py")
    with tempfile.TemporaryDirectory(prefix="gpu_check_test.") as work:
        stages = []
        # step_bench: a real run's JSON, as the GPU check names it.
        sb_log = os.path.join(work, "step_bench_cpu_clip.log")
        with open(sb_log, "w") as log:
            rc = subprocess.run([step_bench, "--small", "--reps", "1", "--steps", "2", "--scenarios", "cpu_clip",
                                 "--dir", work, "--json", os.path.join(work, "step_bench_cpu_clip.json")],
                                stdout=log, stderr=subprocess.STDOUT).returncode
        check(rc == 0, f"step_bench exited {rc}")
        stages.append(("step_bench_cpu_clip", "0", sb_log))
        # cpu_adam_bench --headline: a tiny real run's JSON (the roofline kernels need AVX-512).
        ca_rows = None
        with open("/proc/cpuinfo") as f:
            has_avx512 = "avx512f" in f.read().split()
        if has_avx512:
            ca_log = os.path.join(work, "cpu_adam.log")
            with open(ca_log, "w") as log:
                rc = subprocess.run([cpu_adam_bench, "--sizes", "1M", "--threads", "1", "--reps", "1", "--kernels",
                                     "avx512", "--headline", "--json", os.path.join(work, "cpu_adam_bench.json")],
                                    stdout=log, stderr=subprocess.STDOUT).returncode
            check(rc == 0, f"cpu_adam_bench exited {rc}")
            stages.append(("cpu_adam", "0", ca_log))
            with open(os.path.join(work, "cpu_adam_bench.json")) as f:
                ca_rows = json.load(f)["rows"]
        # train_llama.py: a tiny run's lines, when torch is here.
        llama = None
        try:
            import torch  # noqa: F401
            llama = os.path.join(work, "llama.log")
            corpus = os.path.join(work, "corpus")
            os.mkdir(corpus)
            with open(os.path.join(corpus, "text"), "w") as f:
                f.write("\n%\n".join(f"The quick brown fox {i} jumps over the lazy dog." for i in range(200)))
            run = os.path.join(work, "run")
            os.makedirs(os.path.join(run, "strata_swap"))
            def tiny_run(path, *flags):  # train_llama.py's tiny model, 3 steps, its lines into path
                with open(path, "w") as log:
                    return subprocess.run(
                        [sys.executable, os.path.join(root, "examples/python/train_llama.py"), "--size", "tiny",
                         "--layers", "1", "--seq-len", "16", "--steps", "3", "--eval-every", "0", "--eval-batches",
                         "1", "--no-progress", "--log-every", "1", "--sample", "0", "--lr", "0.002", "--corpus",
                         corpus, *flags], cwd=run, stdout=log, stderr=subprocess.STDOUT,
                        env=dict(os.environ, STRATA_LIBRARY=lib)).returncode

            rc = tiny_run(llama, "--build-dtype", "bf16")
            check(rc == 0, f"train_llama.py exited {rc}")
            stages.append(("llama", "0", llama))
            # The lora stage: the same run with --lora 4, read by the same parser.
            lora_log = os.path.join(work, "lora.log")
            rc = tiny_run(lora_log, "--lora", "4")
            check(rc == 0, f"train_llama.py --lora exited {rc}")
            stages.append(("lora", "0", lora_log))
        except ImportError:
            print("torch is not installed: the train_llama.py part is left out")
        # scale_bench --ranks 2: its JSON's bound per rank (the layout scale_bench --json writes).
        rb_log = os.path.join(work, "ranks_bound_2.log")
        open(rb_log, "w").close()
        rb_ranks = [{"step_s": 4.64, "bound_s": 4.1, "ratio_to_bound": 1.132},
                    {"step_s": 4.65, "bound_s": 4.2, "ratio_to_bound": 1.107}]
        with open(os.path.join(work, "ranks_bound_2.json"), "w") as f:
            json.dump({"ranks": 2, "bound": {"step_s": 4.64, "bound_s": 4.1, "ratio_to_bound": 1.132,
                                             "collectives_s": 0.62, "ranks": rb_ranks}}, f)
        stages.append(("ranks_bound_2", "0", rb_log))
        # A benchmark that refused the device, a stage stopped at its limit, one with no time left.
        refused = os.path.join(work, "gpu_bench.log")
        with open(refused, "w") as f:
            f.write("CUDA device: not measured (UNAVAILABLE: cudaGetDeviceCount failed: no driver)\n")
        stages += [("gpu_bench", "1", refused), ("pytest", "timeout", ""), ("e2e", "deadline", "")]
        with open(os.path.join(work, "stages.tsv"), "w") as f:
            for name, rc, log in stages:
                f.write(f"{name}\t{rc}\t1\t60\t{log}\t\n")

        out = subprocess.run([sys.executable, script, "summary", "--work", work], capture_output=True, text=True)
        check(out.returncode == 1, f"summary exited {out.returncode} with a stage timed out: {out.stderr}")
        with open(os.path.join(work, "summary.json")) as f:
            doc = json.load(f)
        with open(os.path.join(work, "summary.md")) as f:
            md = f.read()
        by = {s["stage"]: s for s in doc["stages"]}
        check(by["gpu_bench"]["status"] == "skip" and "no driver" in by["gpu_bench"].get("why", ""),
              f"gpu_bench: {by['gpu_bench']}")
        check(by["pytest"]["status"] == "timeout", f"pytest: {by['pytest']['status']}")
        check(by["e2e"]["status"] == "not run", f"e2e: {by['e2e']['status']}")
        check(set(doc["failed_stages"]) == {"gpu_bench", "pytest", "e2e"}, f"failed: {doc['failed_stages']}")

        with open(os.path.join(work, "step_bench_cpu_clip.json")) as f:
            sb = json.load(f)
        want = [(sc["scenario"], r["schedule"], r["ratio_to_bound"]) for sc in sb["scenarios"] for r in sc["schedules"]]
        got = [(r["scenario"], r["schedule"], r["ratio_to_bound"]) for r in by["step_bench_cpu_clip"].get("rows", [])]
        check(got == want and len(got) == 2, f"step_bench rows {got}, the JSON has {want}")
        check(by["step_bench_cpu_clip"]["status"] == "pass", f"step_bench: {by['step_bench_cpu_clip']['status']}")
        check("## step_bench --device host" in md, "no step_bench table in summary.md")
        if ca_rows is not None:
            got = [(r["kernel"], r["threads"], r["params_per_s"], r["fraction_of_roofline"])
                   for r in by["cpu_adam"].get("rows", [])]
            want = [(r["kernel"], r["threads"], r["params_per_s"], r["fraction_of_roofline"]) for r in ca_rows]
            check(got == want and len(got) == 2, f"cpu_adam rows {got}, the JSON has {want}")
            check("## cpu_adam_bench --headline" in md, "no cpu_adam table in summary.md")
        got = [(r["rank"], r["ratio_to_bound"]) for r in by["ranks_bound_2"].get("rows", [])]
        check(got == [(0, 1.132), (1, 1.107)], f"ranks_bound rows {got}")
        check("## scale_bench --ranks N" in md and "| 2 | 1 | 4.650 | 4.200 | 1.107 | 0.620 |" in md,
              f"no ranks_bound table in summary.md:\n{md}")
        # The machine stage's CPU probe.
        probe = subprocess.run([sys.executable, script, "machine", os.path.join(work, "machine_probe.json")],
                               capture_output=True, text=True)
        check(probe.returncode == 0, f"gpu_check.py machine exited {probe.returncode}: {probe.stderr}")
        with open(os.path.join(work, "machine_probe.json")) as f:
            machine = json.load(f)
        with open("/proc/cpuinfo") as f:
            name = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
        check(name is None or machine.get("cpu_model_name") == name.group(1).strip(),
              f"machine: cpu_model_name {machine.get('cpu_model_name')!r}")
        check(isinstance(machine.get("cpu_family"), int) and machine.get("numa_nodes", 0) >= 1,
              f"machine: family {machine.get('cpu_family')}, NUMA nodes {machine.get('numa_nodes')}")

        if llama:
            with open(llama) as f:
                text = f.read()
            ll = by["llama"]
            steps = re.findall(r"^step +\d+ +loss ([0-9.]+) +tok/s (\d+)", text, re.M)
            summary = re.search(r"^summary: (\d+) steps in .* (\d+) tokens/s, .*loss ([0-9.]+) -> ([0-9.]+);", text,
                                re.M)
            check(len(steps) == 3 and summary is not None, f"train_llama.py printed {len(steps)} step lines:\n{text}")
            check(len(ll.get("steps", [])) == 3, f"llama: {len(ll.get('steps', []))} steps read")
            if summary:
                check(ll.get("steps_run") == 3 and ll.get("tokens_per_s") == int(summary.group(2)),
                      f"llama: {ll.get('steps_run')} steps, {ll.get('tokens_per_s')} tokens/s; the run said "
                      f"{summary.group(0)}")
                check(ll.get("loss_first") == float(summary.group(3)) and
                      ll.get("loss_last") == float(summary.group(4)), f"llama: losses {ll.get('loss_first')} -> "
                      f"{ll.get('loss_last')}")
            lrs = [float(x) for x in re.findall(r"^step .* lr (\S+)$", text, re.M)]
            check(len(lrs) == 3 and [st.get("lr") for st in ll.get("steps", [])] == lrs and 0 < max(lrs) <= 0.002,
                  f"llama: the step lines' lr {lrs}, read {[st.get('lr') for st in ll.get('steps', [])]} (--lr 0.002)")
            times = re.search(r"^time per step: forward\+backward ([0-9.]+) s, step\(\) ([0-9.]+) s; .* optimizer "
                              r"([0-9.]+) s", text, re.M)
            got = ll.get("seconds_per_step", {})
            check(times is not None and got.get("forward_backward") == float(times.group(1)) and
                  got.get("step") == float(times.group(2)) and got.get("optimizer") == float(times.group(3)) and
                  "seconds per step: forward+backward" in md, f"llama: seconds per step {got}; the run said "
                  f"{times.group(0) if times else None}")
            check(ll.get("bytes_per_step", {}).get("h2d", 0) > 0, f"llama: bytes per step {ll.get('bytes_per_step')}")
            setup = re.search(r"^setup: model built in ([0-9.]+) s \(drawn on cpu\)", text, re.M)
            check(setup is not None and ll.get("setup", {}).get("build_s") == float(setup.group(1)) and
                  ll["setup"].get("drawn_on") == "cpu", f"llama: setup {ll.get('setup')}; the run said "
                  f"{setup.group(0) if setup else None}")
            check("tokens/s" in md and "## Llama fine-tune" in md, "no Llama section in summary.md")
            lo = by.get("lora", {})
            check(len(lo.get("steps", [])) == 3 and "## LoRA r=16" in md,
                  f"lora: {len(lo.get('steps', []))} steps read; LoRA section {'## LoRA r=16' in md}")
            # Only the adapters' gradients come down: far fewer bytes than the full run's.
            check(0 < lo.get("bytes_per_step", {}).get("d2h", 0) < ll.get("bytes_per_step", {}).get("d2h", 0),
                  f"lora: d2h {lo.get('bytes_per_step')} vs the full run's {ll.get('bytes_per_step')}")

        # --allow-skip: the refusal passes; the timeout and the missing stage still fail.
        out = subprocess.run([sys.executable, script, "summary", "--work", work, "--allow-skip"],
                             capture_output=True, text=True)
        with open(os.path.join(work, "summary.json")) as f:
            doc = json.load(f)
        check(out.returncode == 1 and set(doc["failed_stages"]) == {"pytest", "e2e"},
              f"--allow-skip: exit {out.returncode}, failed {doc['failed_stages']}")
    print(f"gpu_check_test: step_bench{', train_llama.py' if llama else ''} read back; {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
