#!/usr/bin/env python3
"""The parts of scripts/gpu-test.sh that a shell does badly: which targets to
build, what the machine is, how large a Llama fits, and the summary.

  gpu_check.py targets BUILD_DIR SUITE...      ninja targets of those suites' tests, plus
                                               libstrata, strata, gpu_bench and step_bench
  gpu_check.py machine OUT_JSON                GPU (nvidia-smi), nvcc, CPUs, RAM, torch and, on a
                                               CUDA device, torch's bf16 matmul TFLOP/s
  gpu_check.py llama-plan --strata EXE --config CFG --size S --layers N|auto ... OUT_JSON
                                               the Llama run: layers that fit the RAM (strata plan's
                                               CPU bytes + the framework's bf16 copy + headroom),
                                               activation checkpointing when the activations would
                                               not fit beside the engine's device budget; prints
                                               shell assignments
  gpu_check.py summary --work DIR [--out DIR] [--allow-skip]
                                               reads DIR/stages.tsv and the stages' logs and JSON,
                                               writes summary.md and summary.json (into --out too);
                                               exit 1 when a stage failed or timed out, or (without
                                               --allow-skip) when a GPU stage was skipped

Standard library only (the GPU machine's Python and Debian's); `machine` and
`llama-plan` import torch when the interpreter has it.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import test_summary  # noqa: E402  (meson testlog.json counting, shared with scripts/test.sh)

GIB = 1 << 30
# What a test prints when it skips for want of a GPU: the C++ suites' GTEST_SKIP
# and the e2e Python test's SKIP line.
NO_GPU = re.compile(r"no usable CUDA device[^\n]*")
# pytest's -rs lines for the CUDA cases skipped without a GPU.
PYTEST_NO_GPU = re.compile(r"^SKIPPED \[(\d+)\] [^\n]*no CUDA device visible to torch", re.M)
PYTEST_SKIP = re.compile(r"^SKIPPED \[(\d+)\] ([^\n]*)", re.M)
PYTEST_SUMMARY = re.compile(r"^pytest-summary: (\d+) passed, (\d+) failed, (\d+) skipped", re.M)
TIMEOUT_RCS = ("124", "137")


# --- targets -------------------------------------------------------------------------------------

def introspect(build, what):
    out = subprocess.run(["meson", "introspect", build, what], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def cmd_targets(args):
    tests = introspect(args.build, "--tests")
    targets = {t["id"]: t for t in introspect(args.build, "--targets")}
    want = set(args.suites)
    files = set()
    for t in tests:
        if want & {s.split(":")[-1] for s in t["suite"]}:
            for dep in t.get("depends", []):
                files.update(targets[dep]["filename"])
    for t in targets.values():
        if (t["name"], t["type"]) in {("strata", "shared library"), ("strata", "executable"),
                                      ("gpu_bench", "executable"), ("step_bench", "executable"),
                                      ("cpu_adam_bench", "executable"), ("scale_bench", "executable")}:
            files.update(t["filename"])
    build = os.path.abspath(args.build)
    print("\n".join(sorted(os.path.relpath(f, build) for f in files)))
    return 0


# --- machine -------------------------------------------------------------------------------------

def run_text(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    return (out.stdout if out.returncode == 0 else None), (out.stderr or out.stdout).strip()


def meminfo():
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return info


def cpu_probe():
    """The CPU's model name, family and model number (/proc/cpuinfo), and the
    NUMA nodes: cpu_adam's yardsticks differ by vendor and generation."""
    r = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" not in line:
                    if r:
                        break  # the first processor's block is enough
                    continue
                k, v = (x.strip() for x in line.split(":", 1))
                if k == "model name":
                    r["cpu_model_name"] = v
                elif k == "cpu family":
                    r["cpu_family"] = int(v)
                elif k == "model":
                    r["cpu_model"] = int(v)
                elif k == "flags":
                    r["avx512"] = "avx512f" in v.split()
    except (OSError, ValueError):
        pass
    try:
        r["numa_nodes"] = len([d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)])
    except OSError:
        pass
    return r


def torch_probe():
    """torch's version, whether it sees a CUDA device, and on one the bf16
    matmul rate (8192^3, 3 warm-ups, median of 10): a yardstick for the Llama's
    model TFLOP/s."""
    try:
        import torch
    except ImportError as e:
        return {"torch": None, "torch_why": str(e)}
    r = {"torch": torch.__version__, "cuda_available": bool(torch.cuda.is_available())}
    try:
        import transformers
        r["transformers"] = transformers.__version__
    except ImportError:
        r["transformers"] = None
    if not r["cuda_available"]:
        return r
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    r["bf16_matmul_tflops"] = 2.0 * n ** 3 / times[len(times) // 2] / 1e12
    r["device_name"] = torch.cuda.get_device_name(0)
    return r


def cmd_machine(args):
    m = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "cpus": os.cpu_count()}
    mem = meminfo()
    m["ram_bytes"] = mem.get("MemTotal")
    m["ram_available_bytes"] = mem.get("MemAvailable")
    out, why = run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap",
                         "--format=csv,noheader,nounits"])
    if out:
        name, mib, driver, cap = [x.strip() for x in out.splitlines()[0].split(",")]
        m["gpu"] = {"name": name, "memory_bytes": int(float(mib)) << 20, "driver": driver,
                    "compute_capability": cap}
    else:
        m["gpu"] = None
        m["gpu_why"] = why or "nvidia-smi printed nothing"
    out, why = run_text(["nvcc", "--version"])
    m["nvcc"] = out.strip().splitlines()[-1] if out else f"not found ({why})"
    out, _ = run_text(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"])
    m["commit"] = out.strip() if out else None
    m.update(cpu_probe())
    m.update(torch_probe())
    with open(args.out, "w") as f:
        json.dump(m, f, indent=1)
    gpu = m["gpu"]
    print(f"machine: {m['cpus']} CPUs ({m.get('cpu_model_name', '?')}, family {m.get('cpu_family', '?')} model "
          f"{m.get('cpu_model', '?')}, {m.get('numa_nodes', '?')} NUMA node(s)), {fmt_gib(m['ram_bytes'])} RAM ({fmt_gib(m['ram_available_bytes'])} "
          f"available); GPU {gpu['name'] + ', ' + fmt_gib(gpu['memory_bytes']) if gpu else 'none: ' + m['gpu_why']}; "
          f"{m['nvcc']}; torch {m.get('torch')}"
          + (f"; bf16 matmul {m['bf16_matmul_tflops']:.0f} TFLOP/s" if "bf16_matmul_tflops" in m else ""))
    return 0


# --- llama-plan ----------------------------------------------------------------------------------

def parse_size(text):
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in units:
        raise ValueError(f"not a size: {text!r} (e.g. 12GiB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def planned_cpu_bytes(strata, config, params, layers):
    """strata plan's CPU RAM bytes for the configured placement (the planner is
    what the engine's finalize checks against)."""
    cmd = [strata, "plan", "--config", config, "--params", str(params), "--layers", str(layers),
           "--gpu-memory", "80GiB", "--ram", "1TiB", "--disk", "1TiB", "--no-checkpoint", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if not out.stdout.strip().startswith("{"):
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
    plan = json.loads(out.stdout)
    return plan["configured"]["tiers"]["cpu"]["needed_bytes"], plan["configured"]["tiers"]["gpu"]["needed_bytes"]


def cmd_llama_plan(args):
    sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
    import llama  # noqa: E402  (imports torch)
    with open(args.config) as f:
        config = json.load(f)
    micro = int(config.get("train_micro_batch_size_per_gpu", 8))
    budgets = config.get("strata", {}).get("budgets", {})
    device_budget = parse_size(budgets["device"]) if "device" in budgets else 0
    available = args.ram_bytes if args.ram_bytes else meminfo().get("MemAvailable", 0)
    headroom = parse_size(args.headroom)
    cfg = llama.config_for(args.size, vocab_size=260)
    max_layers = cfg.num_hidden_layers
    candidates = [int(args.layers)] if args.layers != "auto" else list(range(max_layers, 0, -1))
    plan = None
    for layers in candidates:
        cfg.num_hidden_layers = layers
        params = cfg.param_count()
        cpu, gpu = planned_cpu_bytes(args.strata, args.config, params, layers)
        framework = 2 * params  # the model built in bf16 (--build-dtype bf16) until strata takes it
        need = cpu + framework + headroom
        plan = {"size": args.size, "layers": layers, "preset_layers": max_layers, "params": params,
                "engine_cpu_bytes": cpu, "engine_gpu_bytes": gpu, "framework_bytes": framework,
                "headroom_bytes": headroom, "needed_bytes": need, "available_bytes": available,
                "fits": need <= available}
        if plan["fits"]:
            break
    # Activations of the HF Llama in bf16 without recomputation: about 34 bytes
    # per token and hidden unit per layer (attention by SDPA, no s^2 term),
    # against what the engine's device budget leaves of the GPU.
    tokens = micro * args.seq_len
    activations = 34 * tokens * cfg.hidden_size * plan["layers"]
    room = args.gpu_bytes - device_budget - 2 * GIB if args.gpu_bytes else 0
    plan.update({"seq_len": args.seq_len, "micro_batch": micro, "activation_bytes": activations,
                 "gpu_bytes": args.gpu_bytes, "device_budget_bytes": device_budget,
                 "checkpointing": bool(args.gpu_bytes) and 1.25 * activations > room})
    plan["why"] = (f"{args.size} with {plan['layers']} of {max_layers} layers ({plan['params'] / 1e9:.2f}B "
                   f"parameters): engine {fmt_gib(plan['engine_cpu_bytes'])} of CPU memory (strata plan) + "
                   f"the bf16 model {fmt_gib(plan['framework_bytes'])} + headroom {fmt_gib(headroom)} = "
                   f"{fmt_gib(plan['needed_bytes'])} {'<=' if plan['fits'] else '>'} "
                   f"{fmt_gib(available)} available; activations about {fmt_gib(activations)} "
                   + ("> what the device budget leaves of the GPU: activation checkpointing"
                      if plan["checkpointing"] else "fit beside the device budget"))
    with open(args.out, "w") as f:
        json.dump(plan, f, indent=1)
    print(f"llama_fits={1 if plan['fits'] else 0}")
    print(f"llama_layers={plan['layers']}")
    print(f"llama_checkpointing={1 if plan['checkpointing'] else 0}")
    print(f"llama_why={shell_quote(plan['why'])}")
    return 0


def shell_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


# --- summary -------------------------------------------------------------------------------------

def fmt_gib(n):
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def fmt_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def read(path, limit=None):
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:] if limit else text


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_stages(work):
    stages = []
    for line in read(os.path.join(work, "stages.tsv")).splitlines():
        name, rc, seconds, limit, log, note = (line.split("\t") + [""] * 6)[:6]
        stages.append({"stage": name, "rc": rc, "seconds": float(seconds or 0), "timeout_s": int(limit or 0),
                       "log": log, "note": note})
    return stages


def testlog_stage(st, work):
    """A meson test stage: gtest cases counted from its testlog, and the cases
    that skipped for want of a GPU."""
    path = os.path.join(work, f"testlog-{st['stage']}.json")
    if not os.path.exists(path):
        return
    p, f, s = test_summary.count(path)
    st["tests"] = {"passed": p, "failed": f, "skipped": s}
    no_gpu, failed = 0, []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                t = json.loads(line)
                found = NO_GPU.findall(t.get("stdout") or "")
                no_gpu += len(found)
                if found and "why" not in st:
                    st["why"] = found[0]
                if t.get("result") not in ("OK", "SKIP", "EXPECTEDFAIL"):
                    failed.append(f"{t['name']} ({t.get('result')})")
    st["no_gpu_skips"] = no_gpu
    if failed:
        st["failed_tests"] = failed


def pytest_stage(st):
    log = read(st["log"])
    m = PYTEST_SUMMARY.findall(log)
    if m:
        p, f, s = (int(x) for x in m[-1])
        st["tests"] = {"passed": p, "failed": f, "skipped": s}
    st["no_gpu_skips"] = sum(int(n) for n in PYTEST_NO_GPU.findall(log))
    if st["no_gpu_skips"]:
        st["why"] = "no CUDA device visible to torch"
    other = {}
    for n, why in PYTEST_SKIP.findall(log):
        if "no CUDA device visible" not in why:
            reason = why.split(": ", 1)[-1]
            other[reason] = other.get(reason, 0) + int(n)
    if other:
        st["other_skips"] = [f"{n} x {reason}" for reason, n in other.items()]


def gpu_bench_stage(st, work):
    doc = load_json(os.path.join(work, "gpu_bench.json"))
    log = read(st["log"])
    m = re.search(r"CUDA device: not measured \((.*)\)", log)
    if m:
        st["why"] = m.group(1)
    if doc:
        rows = [r for r in doc.get("rows", []) if r.get("device") == "cuda"]
        if rows:
            top = max(r["bytes"] for r in rows)
            st["links"] = [{"direction": r["direction"], "memory": r["memory"], "bytes": r["bytes"],
                            "gb_per_s": r["gb_per_s"]} for r in rows if r["bytes"] == top]
        m = re.search(r"CUDA device: (.*) \(sm_(\d+)\)", log)
        if m:
            st["device"] = m.group(1)


def step_bench_stage(st, work):
    doc = load_json(os.path.join(work, st["stage"] + ".json"))
    m = re.search(r"step_bench: [^:]+: ((UNAVAILABLE|UNIMPLEMENTED): .*)", read(st["log"]))
    if m:
        st["why"] = m.group(1)
    if doc:
        st["device"] = doc.get("device")
        st["rows"] = [{"scenario": sc["scenario"], "schedule": r["schedule"], "step_s": r["step_s"],
                       "bound_s": r["bound_s"], "ratio_to_bound": r["ratio_to_bound"], "busiest": r["busiest"],
                       "second": r["second"], "h2d_gbps": gbps(r, "h2d"), "d2h_gbps": gbps(r, "d2h")}
                      for sc in doc.get("scenarios", []) for r in sc.get("schedules", [])]


def cpu_adam_stage(st, work):
    """cpu_adam_bench --headline on the GPU machine's CPU: each row's params/s
    and fraction of its in-run roofline."""
    doc = load_json(os.path.join(work, "cpu_adam_bench.json"))
    if doc:
        st["rows"] = [{k: r.get(k) for k in ("kernel", "threads", "n", "moments", "params_per_s", "gbps",
                                             "roofline_gbps", "fraction_of_roofline")}
                      for r in doc.get("rows", [])]


def ranks_bound_stage(st, work):
    """scale_bench --ranks N on the host device with this machine's cores:
    each rank's steady step against its bound."""
    doc = load_json(os.path.join(work, st["stage"] + ".json"))
    if doc and doc.get("bound"):
        st["ranks"] = doc.get("ranks")
        st["rows"] = [{"rank": k, "step_s": r["step_s"], "bound_s": r["bound_s"], "ratio_to_bound": r["ratio_to_bound"]}
                      for k, r in enumerate(doc["bound"].get("ranks", []))]
        st["collectives_s"] = doc["bound"].get("collectives_s")


def gbps(row, link):
    """A link's rate in the step's isolated measurement (bytes / seconds)."""
    iso = row.get("isolated", {})
    b, s = iso.get("bytes", {}).get(link, 0), iso.get(f"{link}_s", 0)
    return b / s / 1e9 if s else None


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
STEP_LINE = re.compile(r"^step +(\d+) +loss ([0-9.naif]+) +tok/s (\d+) +h2d ([0-9.]+ \w+) +d2h ([0-9.]+ \w+) +"
                       r"nvme ([0-9.]+ \w+)/([0-9.]+ \w+)(?: +lr ([0-9.e+-]+))?", re.M)
LLAMA_TIMES = re.compile(r"^time per step: forward\+backward ([0-9.]+) s, step\(\) ([0-9.]+) s; of them fetch ([0-9.]+) s, "
                         r"gradients ([0-9.]+) s, optimizer ([0-9.]+) s, adapter ([0-9.]+) s", re.M)
LLAMA_SUMMARY = re.compile(r"^summary: (\d+) steps in ([0-9.]+) s, (\d+) tokens/s, ([0-9.]+) model TFLOPS; "
                           r"loss ([0-9.]+) -> ([0-9.]+); held-out loss ([0-9.]+)", re.M)


def size_bytes(text):
    num, unit = text.split()
    return int(float(num) * UNITS[unit])


def llama_stage(st, work):
    plan = load_json(os.path.join(work, "llama_plan.json"))
    if plan:
        st["plan"] = plan
    log = read(st["log"])
    m = re.search(r"^model: (.*)$", log, re.M)
    if m:
        st["model"] = m.group(1)
    m = re.search(r"^setup: model built in ([0-9.]+) s \(drawn on (\w+)\), strata.torch.initialize ([0-9.]+) s$",
                  log, re.M)
    if m:
        st["setup"] = {"build_s": float(m.group(1)), "drawn_on": m.group(2), "initialize_s": float(m.group(3))}
    steps = [{"step": int(a), "loss": float(b), "tokens_per_s": int(c), "h2d": size_bytes(d), "d2h": size_bytes(e),
              "nvme_read": size_bytes(f), "nvme_write": size_bytes(g), **({"lr": float(h)} if h else {})}
             for a, b, c, d, e, f, g, h in STEP_LINE.findall(log)]
    if steps:
        st["steps"] = steps
        later = sorted(s["tokens_per_s"] for s in steps[1:]) or [steps[0]["tokens_per_s"]]
        st["tokens_per_s_median_after_first"] = later[len(later) // 2]
        st["bytes_per_step"] = {k: steps[-1][k] for k in ("h2d", "d2h", "nvme_read", "nvme_write")}
        st["loss_first"], st["loss_last"] = steps[0]["loss"], steps[-1]["loss"]
    m = LLAMA_TIMES.findall(log)
    if m:
        st["seconds_per_step"] = dict(zip(("forward_backward", "step", "fetch", "gradients", "optimizer", "adapter"),
                                          map(float, m[-1])))
    m = LLAMA_SUMMARY.findall(log)
    if m:
        n, secs, tps, tflops, first, last, held = m[-1]
        st.update({"steps_run": int(n), "seconds_training": float(secs), "tokens_per_s": int(tps),
                   "model_tflops": float(tflops), "loss_first": float(first), "loss_last": float(last),
                   "held_out_loss": float(held)})


def judge(st, allow_skip):
    """Sets st["status"] (pass, fail, skip, timeout, not run); returns whether
    the stage fails the check. rc "-": left out; "skip": not run for want of a
    GPU (the note says why); "timeout": stopped at its limit; "deadline": not
    run for want of time (fails: the check is incomplete)."""
    rc = st["rc"]
    if rc == "-":
        st["status"] = "not run"
        return False
    if rc == "deadline":
        st["status"] = "not run"
        return True
    if rc == "skip":
        st["status"], st["why"] = "skip", st.get("why") or st["note"]
        return not allow_skip
    if rc == "timeout":
        st["status"] = "timeout"
        return True
    tests = st.get("tests")
    if rc != "0" and st.get("why") and st["stage"].startswith(("gpu_bench", "step_bench")):
        st["status"] = "skip"  # the benchmark refused for want of a GPU, saying why
    elif rc != "0" or (tests and tests["failed"] > 0):
        st["status"] = "fail"
        return True
    elif st.get("no_gpu_skips"):
        st["status"] = "skip"
    else:
        st["status"] = "pass"
    return st["status"] == "skip" and not allow_skip


def bytes_line(b, d2h_note=""):
    """A train_llama stage's bytes of its last step, one summary line."""
    return (f"- bytes per step (the last): host->device {fmt_bytes(b['h2d'])}, device->host {fmt_bytes(b['d2h'])}"
            f"{d2h_note}, nvme read {fmt_bytes(b['nvme_read'])}, write {fmt_bytes(b['nvme_write'])}")


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def render(doc):
    m = doc["machine"] or {}
    gpu = m.get("gpu")
    lines = [f"# GPU check: {doc['result']}", ""]
    lines.append(f"- machine: {gpu['name'] + ' (' + fmt_gib(gpu['memory_bytes']) + ', driver ' + gpu['driver'] + ')' if gpu else 'no GPU (' + m.get('gpu_why', '?') + ')'}"
                 f", {m.get('cpus')} CPUs ({m.get('cpu_model_name', '?')}, family {m.get('cpu_family', '?')} model "
                 f"{m.get('cpu_model', '?')}, {m.get('numa_nodes', '?')} NUMA node(s)), {fmt_gib(m.get('ram_bytes'))} RAM; "
                 f"{m.get('nvcc')}; torch {m.get('torch')}"
                 f", transformers {m.get('transformers')}")
    lines.append(f"- run: {m.get('date')}, commit {m.get('commit') or '(no git)'}, `{doc['command']}`, "
                 f"{doc['wall_s']:.0f} s in all")
    if "bf16_matmul_tflops" in m:
        lines.append(f"- torch bf16 matmul (8192^3, median of 10): {m['bf16_matmul_tflops']:.0f} TFLOP/s")
    lines += ["", "## Stages", ""]
    rows = []
    for st in doc["stages"]:
        t = st.get("tests")
        notes = []
        if st.get("why") and st["status"] in ("skip", "fail"):
            notes.append(st["why"])
        if st.get("no_gpu_skips"):
            notes.append(f"{st['no_gpu_skips']} cases skipped for want of a GPU")
        if st.get("failed_tests"):
            notes.append("failed: " + ", ".join(st["failed_tests"][:6]))
        if st.get("other_skips"):
            notes.append("also skipped: " + ", ".join(st["other_skips"]))
        if st.get("note") and st["note"] != st.get("why"):
            notes.append(st["note"])
        if st["status"] == "timeout":
            notes.append(f"stopped at its {st['timeout_s']} s limit")
        rows.append([st["stage"], st["status"], f"{st['seconds']:.0f} s",
                     f"{t['passed']} / {t['failed']} / {t['skipped']}" if t else "-",
                     "; ".join(notes).replace("|", "/")])
    lines.append(md_table(["stage", "status", "time", "tests passed / failed / skipped", "notes"], rows))
    by = {st["stage"]: st for st in doc["stages"]}
    gb = by.get("gpu_bench", {})
    if gb.get("links"):
        lines += ["", f"## Links (gpu_bench, CUDA device, {gb['links'][0]['bytes'] >> 20} MiB copies)", ""]
        lines.append(md_table(["direction", "host memory", "GB/s"],
                              [[r["direction"], r["memory"], f"{r['gb_per_s']:.2f}"] for r in gb["links"]]))
    sb = {"rows": [r for st in doc["stages"] if st["stage"].startswith("step_bench") for r in st.get("rows", [])],
          "device": next((st["device"] for st in doc["stages"] if st.get("device") and
                          st["stage"].startswith("step_bench")), None)}
    if sb["rows"]:
        lines += ["", f"## step_bench --device {sb['device']} (h2d / d2h: the links in isolation)", ""]
        lines.append(md_table(["scenario", "schedule", "step s", "bound s", "ratio", "busiest", "second",
                               "h2d GB/s", "d2h GB/s"],
                              [[r["scenario"], r["schedule"], fmt(r["step_s"], ".3f"), fmt(r["bound_s"], ".3f"),
                                fmt(r["ratio_to_bound"], ".3f"), r["busiest"], r["second"], fmt(r["h2d_gbps"]),
                                fmt(r["d2h_gbps"])] for r in sb["rows"]]))
    ll = by.get("llama", {})
    if ll.get("plan") or ll.get("steps"):
        lines += ["", "## Llama fine-tune", ""]
        if ll.get("plan"):
            lines.append(f"- size: {ll['plan']['why']}")
        if ll.get("model"):
            lines.append(f"- {ll['model']}")
        if ll.get("setup"):
            su = ll["setup"]
            lines.append(f"- setup: the model built in {su['build_s']:.1f} s (its weights drawn on {su['drawn_on']}), "
                         f"strata.torch.initialize {su['initialize_s']:.1f} s")
        if "tokens_per_s" in ll:
            lines.append(f"- {ll['steps_run']} steps in {ll['seconds_training']:.1f} s: {ll['tokens_per_s']} tokens/s "
                         f"({ll.get('tokens_per_s_median_after_first', '-')} per step after the first, median), "
                         f"{ll['model_tflops']:.1f} model TFLOP/s; loss {ll['loss_first']:.3f} -> "
                         f"{ll['loss_last']:.3f}, held-out {ll['held_out_loss']:.3f}")
        elif ll.get("steps"):
            lines.append(f"- {len(ll['steps'])} steps logged before the stage ended: "
                         f"{ll['tokens_per_s_median_after_first']} tokens/s (median after the first), loss "
                         f"{ll['loss_first']:.3f} -> {ll['loss_last']:.3f}")
        if ll.get("seconds_per_step"):
            t = ll["seconds_per_step"]
            lines.append(f"- seconds per step: forward+backward {t['forward_backward']:.3f}, step() {t['step']:.3f}; "
                         f"of them fetch {t['fetch']:.3f}, gradients {t['gradients']:.3f}, optimizer "
                         f"{t['optimizer']:.3f}, adapter {t['adapter']:.3f}")
        if ll.get("steps") and ll["loss_last"] > ll["loss_first"]:
            lr = ll["steps"][-1].get("lr")
            lines.append("- the loss rose over the steps logged" + (f" (the last step's lr {lr:g})" if lr else "")
                         + ": a learning rate too high for this width (train_llama --lr) or a wrong gradient")
        if ll.get("bytes_per_step"):
            b = ll["bytes_per_step"]
            lines.append(bytes_line(b))
    lo = by.get("lora", {})
    if lo.get("steps"):
        lines += ["", "## LoRA r=16 on the same model (train_llama.py --lora 16)", ""]
        if lo.get("model"):
            lines.append(f"- {lo['model']}")
        if "tokens_per_s" in lo:
            lines.append(f"- {lo['steps_run']} steps in {lo['seconds_training']:.1f} s: {lo['tokens_per_s']} tokens/s "
                         f"({lo.get('tokens_per_s_median_after_first', '-')} per step after the first, median); "
                         f"loss {lo['loss_first']:.3f} -> {lo['loss_last']:.3f}")
        b = lo["bytes_per_step"]
        lines.append(bytes_line(b, " (the adapters' gradients)"))
    ca = by.get("cpu_adam", {})
    if ca.get("rows"):
        lines += ["", "## cpu_adam_bench --headline (this machine's CPU)", ""]
        lines.append(md_table(["kernel", "threads", "N", "moments", "params/s", "GB/s", "roof GB/s", "fraction"],
                              [[r["kernel"], r["threads"], f"{r['n'] >> 20}M", r["moments"],
                                f"{r['params_per_s']:.3e}", fmt(r["gbps"]), fmt(r["roofline_gbps"]),
                                fmt(r["fraction_of_roofline"], ".3f")] for r in ca["rows"]]))
    rb = [st for st in doc["stages"] if st["stage"].startswith("ranks_bound") and st.get("rows")]
    if rb:
        lines += ["", "## scale_bench --ranks N (the host device on this machine's cores; goal: each ratio <= 1.15)", ""]
        lines.append(md_table(["N", "rank", "step s", "bound s", "step / bound", "collectives s"],
                              [[st["ranks"], r["rank"], fmt(r["step_s"], ".3f"), fmt(r["bound_s"], ".3f"),
                                fmt(r["ratio_to_bound"], ".3f"), fmt(st.get("collectives_s"), ".3f")]
                               for st in rb for r in st["rows"]]))
    lines.append("")
    return "\n".join(lines)


def cmd_summary(args):
    work = args.work
    stages = read_stages(work)
    for st in stages:
        if st["stage"] in ("gpu", "e2e"):
            testlog_stage(st, work)
        elif st["stage"] == "pytest":
            pytest_stage(st)
        elif st["stage"] == "gpu_bench":
            gpu_bench_stage(st, work)
        elif st["stage"].startswith("step_bench"):
            step_bench_stage(st, work)
        elif st["stage"] in ("llama", "lora"):
            llama_stage(st, work)
        elif st["stage"] == "cpu_adam":
            cpu_adam_stage(st, work)
        elif st["stage"].startswith("ranks_bound"):
            ranks_bound_stage(st, work)
    bad = [st["stage"] for st in stages if judge(st, args.allow_skip)]
    skipped = [st["stage"] for st in stages if st["status"] == "skip"]
    result = "FAIL (" + ", ".join(bad) + ")" if bad else ("PASS, GPU stages skipped: " + ", ".join(skipped)
                                                           if skipped else "PASS")
    doc = {"result": result, "failed_stages": bad, "skipped_stages": skipped, "command": args.command,
           "wall_s": args.wall_s, "machine": load_json(os.path.join(work, "machine.json")), "stages": stages}
    text = render(doc)
    for d in [work] + ([args.out] if args.out else []):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(d, "summary.md"), "w") as f:
            f.write(text)
    if args.print:
        print(text)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("targets")
    p.add_argument("build")
    p.add_argument("suites", nargs="+")
    p = sub.add_parser("machine")
    p.add_argument("out")
    p = sub.add_parser("llama-plan")
    p.add_argument("--strata", required=True, help="the strata command (for strata plan)")
    p.add_argument("--config", required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--layers", default="auto", help="a layer count, or auto: the most that fit")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--headroom", default="12GiB", help="RAM left beside the engine and the model")
    p.add_argument("--ram-bytes", type=int, default=0, help="RAM available (default: MemAvailable)")
    p.add_argument("--gpu-bytes", type=int, default=0, help="GPU memory (0: no GPU, no checkpointing decision)")
    p.add_argument("out")
    p = sub.add_parser("summary")
    p.add_argument("--work", required=True)
    p.add_argument("--out")
    p.add_argument("--allow-skip", action="store_true")
    p.add_argument("--command", default="scripts/gpu-test.sh")
    p.add_argument("--wall-s", type=float, default=0.0)
    p.add_argument("--print", action="store_true")
    args = ap.parse_args()
    if args.cmd == "llama-plan" and args.layers != "auto" and not args.layers.isdigit():
        ap.error(f"--layers is a count or auto, not {args.layers!r}")
    return {"targets": cmd_targets, "machine": cmd_machine, "llama-plan": cmd_llama_plan,
            "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
