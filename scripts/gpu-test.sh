#!/usr/bin/env bash
# Builds and runs the gpu conformance suite and the bandwidth benchmark on a
# machine with an NVIDIA GPU (CUDA toolkit at /usr/local/cuda; meson and ninja
# from pip; no apt). Debian libraries the build needs come from .debs/ in the
# repository root when present (prepared elsewhere by ../shared/tools/device-debs)
# and are unpacked into /opt/debs.
#
# Usage: scripts/gpu-test.sh [--no-bench] [--allow-skip] [--no-python] [--llama-size SIZE]
#   --no-bench    skip benchmarks/gpu_bench
#   --allow-skip  do not fail when the CUDA cases skip (no usable GPU)
#   --no-python   skip the PyTorch adapter's tests and the Llama fine-tune
#   --llama-size  the example Llama's size preset for the fine-tune (default 1b)
# Writes build-gpu/, and copies logs and gpu_bench.json to $OUT when it is set.
# Exit status: 0 when every test passed and (unless --allow-skip) the CUDA
# cases ran; non-zero otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

bench=1
allow_skip=0
python=1
llama_size=1b
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --allow-skip) allow_skip=1 ;;
    --no-python) python=0 ;;
    --llama-size) llama_size=$2; shift ;;
    *) echo "usage: $0 [--no-bench] [--allow-skip] [--no-python] [--llama-size SIZE]" >&2; exit 2 ;;
  esac
  shift
done

out=${OUT:-}
log() { echo "=== $*"; }

# --- toolchain and libraries -------------------------------------------------
export PATH=/usr/local/cuda/bin:$PATH
if compgen -G ".debs/*.deb" >/dev/null; then
  log "unpacking $(ls .debs/*.deb | wc -l) packages from .debs/ into /opt/debs"
  mkdir -p /opt/debs
  for f in .debs/*.deb; do dpkg -x "$f" /opt/debs || exit 1; done
  export PATH=/opt/debs/usr/bin:$PATH
  export LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PKG_CONFIG=/opt/debs/usr/bin/pkgconf PKG_CONFIG_SYSROOT_DIR=/opt/debs
  export PKG_CONFIG_LIBDIR=/opt/debs/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/debs/usr/share/pkgconfig
  export CPATH=/opt/debs/usr/include LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu
fi
for tool in nvcc meson ninja; do
  if ! command -v "$tool" >/dev/null; then
    echo "gpu-test: $tool not found on PATH (nvcc from /usr/local/cuda/bin; meson and ninja from pip)" >&2
    exit 1
  fi
done
log "nvcc: $(nvcc --version | tail -1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# --- build (only what the gpu suite and the benchmark need) -------------------
jobs=$(nproc)
setup_log=$(mktemp --suffix=.log /tmp/gpu-test-setup.XXXXXX)
if [[ -f build-gpu/build.ninja ]]; then
  meson setup --reconfigure build-gpu -Dcuda=enabled -Dtests=enabled -Dbenchmarks=enabled >"$setup_log" 2>&1
else
  meson setup build-gpu -Dcuda=enabled -Dtests=enabled -Dbenchmarks=enabled >"$setup_log" 2>&1
fi
rc=$?
if [[ $rc -ne 0 ]]; then
  tail -30 "$setup_log"
  echo "gpu-test: meson setup failed ($setup_log)" >&2
  exit 1
fi
log "build"
ninja -C build-gpu -j"$jobs" tests/gpu/gpu_device_conformance_test tests/gpu/gpu_host_timing_test \
  benchmarks/gpu_bench bindings/c/libstrata.so || { echo "gpu-test: build failed" >&2; exit 1; }

# --- tests -------------------------------------------------------------------
log "meson test --suite gpu"
meson test -C build-gpu --suite gpu --no-rebuild --print-errorlogs
test_rc=$?

# The CUDA cases must have run, not skipped (unless asked otherwise).
log "CUDA cases"
cuda_log=build-gpu/gpu-cuda-cases.log
build-gpu/tests/gpu/gpu_device_conformance_test --gtest_filter='*/cuda' >"$cuda_log" 2>&1
cuda_rc=$?
grep -E '^\[(==========|  PASSED  |  SKIPPED |  FAILED  )\] [0-9]+ test' "$cuda_log"
# Cases that need a strict device skip on CUDA by design; count only the
# skips for want of a GPU.
skipped=$(grep -c 'no usable CUDA device' "$cuda_log" || true)
if [[ $cuda_rc -ne 0 ]]; then
  echo "gpu-test: CUDA cases failed (see $cuda_log)" >&2
elif [[ $skipped -gt 0 ]]; then
  grep -m1 'no usable CUDA device' "$cuda_log"
  if [[ $allow_skip -eq 0 ]]; then
    echo "gpu-test: $skipped CUDA cases skipped: no usable GPU here (pass --allow-skip to accept)" >&2
    cuda_rc=1
  fi
fi

# --- benchmark ---------------------------------------------------------------
bench_rc=0
if [[ $bench -eq 1 ]]; then
  log "gpu_bench"
  build-gpu/benchmarks/gpu_bench --sizes 1MiB,16MiB,256MiB,1GiB --reps 5 --json build-gpu/gpu_bench.json
  bench_rc=$?
fi

# --- the PyTorch adapter: its tests on CUDA, the Hugging Face Llama fine-tune --------
py_rc=0
if [[ $python -eq 1 ]]; then
  export STRATA_LIBRARY=$PWD/build-gpu/bindings/c/libstrata.so
  log "pytest (tests/python; the CUDA and transformers cases run here)"
  python3 tests/python/run_pytest.py -rs >build-gpu/pytest.log 2>&1
  py_rc=$?
  tail -25 build-gpu/pytest.log
  log "Llama fine-tune: transformers.LlamaForCausalLM ($llama_size), optimizer state on the CPU"
  mkdir -p strata_swap
  python3 examples/python/train_llama.py --hf --size "$llama_size" --seq-len 1024 --steps 12 --eval-every 0 \
    --no-progress --sample 0 --config examples/configs/llama_cuda.json >build-gpu/llama_hf.log 2>&1
  [[ $? -eq 0 ]] || py_rc=1
  tail -8 build-gpu/llama_hf.log
fi

if [[ -n "$out" ]]; then
  mkdir -p "$out"
  cp -f build-gpu/pytest.log build-gpu/llama_hf.log "$out/" 2>/dev/null
  cp -f build-gpu/meson-logs/testlog.txt "$out/" 2>/dev/null
  cp -f "$cuda_log" build-gpu/gpu_bench.json "$out/" 2>/dev/null
fi

if [[ $test_rc -ne 0 || $cuda_rc -ne 0 || $bench_rc -ne 0 || $py_rc -ne 0 ]]; then
  echo "gpu-test: FAILED (tests $test_rc, cuda cases $cuda_rc, bench $bench_rc, python $py_rc)"
  exit 1
fi
echo "gpu-test: OK"
