#!/usr/bin/env bash
# The whole check of a lent GPU machine in one command that fits one 10-minute call
# of the device tool: builds build-gpu/ with CUDA (only what the stages run), then
#   machine      the GPU, CPUs, RAM, nvcc, torch; torch's bf16 matmul TFLOP/s
#   gpu          meson test --suite gpu (device conformance: host and CUDA cases, CUDA model runner)
#   gpu_bench    pinned and pageable host<->device bandwidth, 1 MiB to 1 GiB
#   e2e          meson test --suite e2e with STRATA_TEST_DEVICE=cuda (the engine on the CUDA device)
#   pytest       tests/python: the adapter, its CUDA and transformers cases (in --jobs processes side
#                by side, at most 8: one at a time it takes about 230 s on the H200 machine)
#   llama        examples/python/train_llama.py --hf: transformers' Llama at the largest size whose
#                state fits the RAM (scripts/gpu_check.py llama-plan asks strata plan), a few steps at a
#                peak learning rate for its width (--llama-lr)
#   lora         the same model with LoRA of rank 16 (train_llama.py --lora 16): the base frozen, the
#                adapters trained; tokens/s and bytes per step beside the llama stage's
#   cpu_adam     cpu_adam_bench --headline on this machine's CPU (256M elements, 1 thread and all):
#                the fused step against its roofline on another CPU kind (the machine stage names it)
#   step_bench_* step_bench --device cuda (6 layers of 16M parameters), one stage per scenario
#   ranks_bound_* scale_bench --ranks 2 and 4 on the host device with this machine's cores (268M
#                parameters on nvme, delayed): each rank's step against its bound (last: it runs
#                when time is left, or in a call of its own with the other stages --skip'ped)
# and writes one summary (stages with pass/fail/skip and test counts, GB/s per link, TFLOP/s,
# step_bench rows, tokens/s, loss, bytes per link) after every stage, so that a call cut short
# still returns one. Each stage runs under its own limit inside a deadline for the whole run.
#
# Where it runs: from the repository root of the GPU machine (CUDA at /usr/local/cuda; meson,
# ninja, torch and transformers from its Python; no package registry). The Debian libraries come
# from .debs/ in the repository root, prepared here with
#   ../shared/tools/device-debs libcli11-dev libgfortran5 libquadmath0 libudev1 fortunes-min fortunes libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200
# and carried with the call; they are unpacked into /opt/debs (DEBS_ROOT). docs/benchmarks.md
# ("GPU check") has the device tool's call. Without a GPU (--allow-skip) the same run builds with
# CUDA when nvcc is there, runs what needs no GPU and marks the GPU stages skipped, saying why.
#
# Usage: scripts/gpu-test.sh [--allow-skip] [--skip STAGES] [--no-bench] [--no-python]
#          [--llama-size SIZE] [--llama-layers N|auto] [--llama-steps N] [--llama-lr LR]
#          [--step-bench-scenarios LIST] [--deadline SECONDS] [--build-dir DIR] [--jobs N]
#   --allow-skip     a GPU stage skipped for want of a GPU does not fail the run (the local run)
#   --skip STAGES    leave out these stages (comma separated names from the list above;
#                    step_bench leaves out every step_bench_* stage, ranks_bound every ranks_bound_*)
#   --no-bench       --skip gpu_bench,cpu_adam,step_bench,ranks_bound;  --no-python: --skip pytest,llama,lora
#   --llama-size     train_llama.py's preset (default 7b); --llama-layers: its layer count, or auto
#                    (default: the most that fit the RAM); --llama-steps: steps (default 6); --llama-lr:
#                    train_llama's --lr (default 1e-4: the example config's 3e-3 suits the small presets
#                    and made the 7B's loss climb from 6.5 to 21 by step 4 on the H200)
#   --step-bench-scenarios  default cpu_cpu,h2d_device,nvme_disk
#   --deadline       seconds for the whole run, summary included (default 560)
#   --build-dir      default build-gpu;  --jobs: build and test processes (default: nproc)
# Output: $OUT/summary.md, $OUT/summary.json and $OUT/logs.tar.gz when OUT is set (the device
# tool's folder), and always build-gpu/gpu-check/ (summary, logs, JSON). Environment: PYTHON (the
# interpreter with torch; default the first of python3, /usr/bin/python3 that imports torch),
# DEBS_ROOT (default /opt/debs).
# Exit status: 0 when every stage run passed (a skip for want of a GPU passes only with
# --allow-skip), 1 otherwise, 2 on a bad command line.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$SECONDS

usage() {
  sed -n '/^# Usage:/,/^# Exit status/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

allow_skip=0
skip_list=","
llama_size=7b
llama_layers=auto
llama_steps=6
llama_lr=1e-4
step_scenarios=cpu_cpu,h2d_device,nvme_disk
deadline=560
build=build-gpu
jobs=$(nproc)
command_line="scripts/gpu-test.sh $*"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --allow-skip) allow_skip=1 ;;
    --skip) [[ $# -ge 2 ]] || usage; skip_list+="$2,"; shift ;;
    --no-bench) skip_list+="gpu_bench,cpu_adam,step_bench,ranks_bound," ;;
    --no-python) skip_list+="pytest,llama,lora," ;;
    --llama-size) [[ $# -ge 2 ]] || usage; llama_size=$2; shift ;;
    --llama-layers) [[ $# -ge 2 && ( $2 == auto || $2 =~ ^[1-9][0-9]*$ ) ]] || usage; llama_layers=$2; shift ;;
    --llama-steps) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || usage; llama_steps=$2; shift ;;
    --llama-lr) [[ $# -ge 2 && $2 =~ ^[0-9.]+(e-?[0-9]+)?$ ]] || usage; llama_lr=$2; shift ;;
    --step-bench-scenarios) [[ $# -ge 2 ]] || usage; step_scenarios=$2; shift ;;
    --deadline) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || usage; deadline=$2; shift ;;
    --build-dir) [[ $# -ge 2 ]] || usage; build=$2; shift ;;
    --jobs) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || usage; jobs=$2; shift ;;
    -h|--help) usage ;;
    *) echo "gpu-test: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done

out=${OUT:-}
work=$build/gpu-check   # every stage's log and JSON, and the summary
debs_root=${DEBS_ROOT:-/opt/debs}
reserve=15              # seconds kept for the last summary
export PYTHONUNBUFFERED=1
rm -rf "$work"
mkdir -p "$work" || exit 1
: >"$work/stages.tsv"

# --- the stages' bookkeeping --------------------------------------------------------------------
left_out() {  # NAME: true when --skip names it (or its family: step_bench for step_bench_cpu_cpu)
  [[ $skip_list == *",$1,"* || ( $1 == step_bench_* && $skip_list == *",step_bench,"* ) ||
     ( $1 == ranks_bound_* && $skip_list == *",ranks_bound,"* ) ]]
}
# record NAME RC SECONDS LIMIT LOG NOTE: one line of stages.tsv (RC "-": left out; "skip": not run
# for want of a GPU, NOTE says why; "timeout": stopped at its limit; "deadline": not run, no time left).
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6//$'\t'/ }" >>"$work/stages.tsv"
}
# The summary so far, into $work and $OUT (with the logs), so that a call cut short returns one.
summarize() {
  local final=${1:-}
  "$py" scripts/gpu_check.py summary --work "$work" ${out:+--out "$out"} \
    $([[ $allow_skip -eq 1 ]] && echo --allow-skip) --command "$command_line" \
    --wall-s $((SECONDS - start)) ${final:+--print}
  local rc=$?
  if [[ -n "$out" ]]; then
    tar -czf "$out/logs.tar.gz" -C "$build" gpu-check 2>/dev/null
  fi
  return $rc
}
# run_stage NAME LIMIT_S CMD...: CMD under `timeout` with the lesser of LIMIT_S and what the
# deadline leaves; output into $work/NAME.log. Records the stage; does not summarize.
run_stage() {
  local name=$1 limit=$2
  shift 2
  local log=$work/$name.log
  if left_out "$name"; then
    record "$name" - 0 0 "" "left out (--skip)"
    return 0
  fi
  local left=$((deadline - (SECONDS - start) - reserve))
  if ((left < 10)); then
    record "$name" deadline 0 0 "" "not run: the $deadline s deadline was reached"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit $limit s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  local rc=$? secs=$((SECONDS - t0))
  if [[ $rc -eq 124 || ($rc -eq 137 && $secs -ge $limit) ]]; then rc=timeout; fi
  tail -n 4 "$log" | cut -c1-200
  echo "=== $name: exit $rc, $secs s"
  record "$name" "$rc" "$secs" "$limit" "$log" ""
  [[ $rc == 0 ]]
}

# --- the Python with torch (the GPU machine's python3; Debian's /usr/bin/python3 here) ------------
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import torch' 2>/dev/null; then py=$p; break; fi
  done
  py=${py:-python3}
fi

# --- setup: the carried Debian libraries, the toolchain ------------------------------------------
setup() {
  export PATH=/usr/local/cuda/bin:$PATH
  if compgen -G ".debs/*.deb" >/dev/null; then
    echo "unpacking $(ls .debs/*.deb | wc -l) packages from .debs/ into $debs_root"
    mkdir -p "$debs_root" || return 1
    for f in .debs/*.deb; do dpkg -x "$f" "$debs_root" || return 1; done
    local lib=$debs_root/usr/lib/x86_64-linux-gnu
    export PATH=$debs_root/usr/bin:$PATH
    # Gloo's library sits in /usr/lib, not in the multiarch folder.
    export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$debs_root/usr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PKG_CONFIG=$debs_root/usr/bin/pkgconf PKG_CONFIG_SYSROOT_DIR=$debs_root
    # openblas.pc sits in its own folder (Debian's alternatives link it elsewhere; dpkg -x does not).
    export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$debs_root/usr/share/pkgconfig:$lib/openblas-pthread/pkgconfig
    # Headers as system headers (C_INCLUDE_PATH, CPLUS_INCLUDE_PATH: -isystem), as /usr/include is:
    # with CPATH (-I) liburing's io_uring.h fails the build's -Wpedantic -Werror.
    export C_INCLUDE_PATH=$debs_root/usr/include CPLUS_INCLUDE_PATH=$debs_root/usr/include
    export LIBRARY_PATH=$lib:$lib/openblas-pthread:$debs_root/usr/lib
    # The text corpus of the Llama example and of the docs' commands.
    if [[ ! -e /usr/share/games/fortunes && -d $debs_root/usr/share/games/fortunes && -w /usr/share ]]; then
      mkdir -p /usr/share/games && ln -s "$debs_root/usr/share/games/fortunes" /usr/share/games/fortunes
    fi
  else
    echo "no .debs/: the Debian libraries must be installed (scripts/install-deps.sh)"
  fi
  local missing=0
  for tool in nvcc meson ninja "$py"; do
    if command -v "$tool" >/dev/null; then
      echo "$tool: $(command -v "$tool")"
    else
      echo "$tool not found on PATH (nvcc from /usr/local/cuda/bin; meson, ninja and python3 from the machine's Python)"
      missing=1
    fi
  done
  return $missing
}
echo "=== setup"
setup_t0=$SECONDS
setup >"$work/setup.log" 2>&1
setup_rc=$?
cat "$work/setup.log"
record setup $setup_rc $((SECONDS - setup_t0)) 0 "$work/setup.log" ""

run_stage machine 90 "$py" scripts/gpu_check.py machine "$work/machine.json"
gpu_bytes=$("$py" -c 'import json,sys; g=json.load(open(sys.argv[1])).get("gpu"); print(g["memory_bytes"] if g else 0)' \
  "$work/machine.json" 2>/dev/null || echo 0)
archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
archs=${archs:-90}   # the lent machines are Hopper (sm_90); nvcc 13 needs sm_75 or newer
summarize

# --- configure and build (only the targets the stages run) ---------------------------------------
configure() {
  # -Dwerror=false: the lent machine's compiler (GCC 13 at /opt/gcc) is not the one CI holds the
  # warnings to; a warning there must not cost the call. build.log keeps them to mend here.
  local opts=(-Dcuda=enabled -Dopenblas=enabled -Dtests=enabled -Dbenchmarks=enabled -Dwerror=false
              "-Dgpu_archs=$archs")
  if [[ -f $build/build.ninja ]]; then
    meson setup --reconfigure "$build" "${opts[@]}"
  else
    meson setup "$build" "${opts[@]}"
  fi
}
export -f configure
export build archs
if [[ $setup_rc -ne 0 ]]; then
  record configure - 0 0 "" "not run: setup failed"
elif run_stage configure 120 bash -c configure; then
  targets=$("$py" scripts/gpu_check.py targets "$build" gpu e2e)
  echo "building $(echo "$targets" | wc -l) targets"
  run_stage build 300 ninja -C "$build" -j"$jobs" $targets
fi
summarize
built=0
grep -q $'^build\t0\t' "$work/stages.tsv" && built=1

# --- tests ---------------------------------------------------------------------------------------
testlog() {  # STAGE: keeps meson's testlog.json of that stage's run
  cp -f "$build/meson-logs/testlog.json" "$work/testlog-$1.json" 2>/dev/null
  rm -f "$build/meson-logs/testlog.json"
}
if [[ $built -eq 1 ]]; then
  rm -f "$build/meson-logs/testlog.json"
  run_stage gpu 150 meson test -C "$build" --suite gpu --no-rebuild --print-errorlogs --num-processes "$jobs"
  testlog gpu
  summarize
  run_stage gpu_bench 90 "$build/benchmarks/gpu_bench" --device cuda --sizes 1MiB,64MiB,1GiB --reps 5 \
    --json "$work/gpu_bench.json"
  summarize
  run_stage e2e 240 env STRATA_TEST_DEVICE=cuda meson test -C "$build" --suite e2e --no-rebuild \
    --print-errorlogs --num-processes "$jobs"
  testlog e2e
  summarize
  run_stage pytest 150 env STRATA_LIBRARY="$(cd "$build" && pwd)/bindings/c/libstrata.so" "$py" \
    tests/python/run_pytest.py --jobs $((jobs < 8 ? jobs : 8)) -rs
  summarize
else
  for s in gpu gpu_bench e2e pytest; do record "$s" - 0 0 "" "not run: no build"; done
fi

# --- the Llama fine-tune -------------------------------------------------------------------------
llama_config=$root/examples/configs/llama_cuda.json
corpus=/usr/share/games/fortunes
[[ -d $corpus ]] || corpus=$debs_root/usr/share/games/fortunes
if left_out llama; then
  record llama - 0 0 "" "left out (--skip)"
elif [[ $built -ne 1 ]]; then
  record llama - 0 0 "" "not run: no build"
else
  echo "=== llama: plan"
  plan_out=$("$py" scripts/gpu_check.py llama-plan --strata "$build/bindings/cli/strata" --config "$llama_config" \
    --size "$llama_size" --layers "$llama_layers" --seq-len 1024 --gpu-bytes "${gpu_bytes:-0}" \
    "$work/llama_plan.json" 2>"$work/llama_plan.err")
  if [[ $? -ne 0 ]]; then
    cat "$work/llama_plan.err"
    record llama 1 0 0 "$work/llama_plan.err" "the size could not be planned"
  else
    eval "$plan_out"   # llama_fits, llama_layers (the count chosen), llama_checkpointing, llama_why
    echo "$llama_why"
    if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      record llama skip 0 0 "" "no CUDA device visible to torch ($py)"
    elif [[ $llama_fits -ne 1 ]]; then
      record llama 1 0 0 "" "does not fit: $llama_why"
    else
      hf=(--hf)
      "$py" -c 'import transformers' 2>/dev/null || hf=()   # the example's own Llama then
      ckpt=()
      [[ $llama_checkpointing -eq 1 ]] && ckpt=(--checkpointing)
      mkdir -p "$work/llama_run/strata_swap"
      run_stage llama 240 env -C "$work/llama_run" STRATA_LIBRARY="$(cd "$build" && pwd)/bindings/c/libstrata.so" \
        "$py" "$root/examples/python/train_llama.py" "${hf[@]}" \
        --size "$llama_size" --layers "$llama_layers" --build-dtype bf16 --seq-len 1024 --steps "$llama_steps" \
        --lr "$llama_lr" \
        --eval-every 0 --eval-batches 1 --no-progress --log-every 1 --sample 0 --config "$llama_config" \
        --corpus "$corpus" "${ckpt[@]}"
      rm -rf "$work/llama_run"
      # LoRA of rank 16 on the same model: the base frozen (compute copies only), the adapters trained;
      # its bytes per step beside the full run's (the gradients and writes of the adapters alone).
      if left_out lora; then
        record lora - 0 0 "" "left out (--skip)"
      else
        mkdir -p "$work/lora_run/strata_swap"
        run_stage lora 180 env -C "$work/lora_run" STRATA_LIBRARY="$(cd "$build" && pwd)/bindings/c/libstrata.so" \
          "$py" "$root/examples/python/train_llama.py" "${hf[@]}" \
          --size "$llama_size" --layers "$llama_layers" --build-dtype bf16 --seq-len 1024 --steps "$llama_steps" \
          --lr 1e-3 --lora 16 \
          --eval-every 0 --eval-batches 1 --no-progress --log-every 1 --sample 0 --config "$llama_config" \
          --corpus "$corpus" "${ckpt[@]}"
        rm -rf "$work/lora_run"
      fi
    fi
  fi
fi

summarize

# --- cpu_adam_bench on this machine's CPU (another CPU kind than the CI machines') ----------------
if [[ $built -eq 1 ]] && ! grep -qw avx512f /proc/cpuinfo; then
  record cpu_adam - 0 0 "" "left out: the CPU lacks AVX-512 (the roofline kernels need it)"
elif [[ $built -eq 1 ]]; then
  run_stage cpu_adam 120 "$build/benchmarks/cpu_adam_bench" --sizes 256M --threads "1,$jobs" --reps 3 \
    --kernels avx512,avx512_bf16 --headline --json "$work/cpu_adam_bench.json"
  summarize
fi

# --- step_bench on the real device, one stage per scenario (last: each is cheap to lose) ---------
if [[ $built -eq 1 ]]; then
  # Swap files on the disk of the repository (a /tmp in memory would hide the disk).
  swap=$build/step_bench_swap
  mkdir -p "$swap"
  for sc in ${step_scenarios//,/ }; do
    run_stage "step_bench_$sc" 90 "$build/benchmarks/step_bench" --device cuda --scenarios "$sc" --layers 6 \
      --reps 2 --steps 2 --dir "$swap" --json "$work/step_bench_$sc.json"
    summarize
  done
  rm -rf "$swap"
fi

# --- each rank against its bound on this machine's cores (the CI machine has 2 for all ranks) ----
if [[ $built -eq 1 ]]; then
  swap=$build/ranks_bound_swap
  mkdir -p "$swap"
  for n in 2 4; do
    run_stage "ranks_bound_$n" 150 "$build/benchmarks/scale_bench" --params 256M --layers 32 --steps 5 \
      --placement nvme --overlap delayed --tflops 4 --ranks "$n" --sample-params 64M --dir "$swap" \
      --json "$work/ranks_bound_$n.json"
    summarize
  done
  rm -rf "$swap"
fi

echo
summarize final
