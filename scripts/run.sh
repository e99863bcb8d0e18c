#!/usr/bin/env bash
# The main job: installs what is missing, builds strata (release), and trains a
# Llama-architecture model from PyTorch through strata.torch
# (examples/python/train_llama.py: English text from the Debian fortunes
# collection, a byte-level tokenizer) on the embedded default configuration
# (examples/configs/llama_default.json: the emulated host device, compute
# copies in pinned memory, optimizer state on NVMe under ./strata_swap), with a
# progress bar (loss, tokens/s, bytes per tier), held-out loss and a summary.
#
# Usage: scripts/run.sh [train_llama.py flags...]  (e.g. --steps 300 --size base, --export out, --init-from out)
#        scripts/run.sh --native [strata-train flags...]  (the C API example: a residual MLP, examples/train)
#        scripts/run.sh plan [strata plan flags...] (the memory planner, e.g. --params 40e9 --layers 48;
#                                                   without --config, the native example's config)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
source scripts/common.sh
# The main job needs neither the tests nor the benchmarks: leave them out of this build.
meson_setup build-release --buildtype=release -Dtests=disabled -Dbenchmarks=disabled $cuda_option
if ! ninja -C build-release > build-release/ninja.log 2>&1; then
  tail -n 40 build-release/ninja.log
  echo "run.sh: the build failed; the whole log is build-release/ninja.log" >&2
  exit 1
fi
# The native example's config unless the flags give one ("--config FILE" once, never twice).
default_config=(--config examples/configs/strata_default.json)
for arg in "$@"; do
  if [[ "$arg" == --config || "$arg" == --config=* ]]; then
    default_config=()
  fi
done
if [[ "${1:-}" == "plan" ]]; then
  shift
  if [[ $# -eq 0 ]]; then
    set -- --layers 24 --hidden 2048 --vocab 50304 --seq 2048
  fi
  # Without --config, strata_default.json's strata.budgets cap the plan's tiers: pass a config
  # without budgets to plan for a whole machine given by --gpu-memory/--ram.
  exec build-release/bindings/cli/strata plan "${default_config[@]}" "$@"
fi
mkdir -p strata_swap  # the default configs' swap directory (swap files are removed at exit)
if [[ "${1:-}" == "--native" ]]; then
  shift
  if [[ ! -x build-release/examples/train/strata-train ]]; then
    echo "run.sh: build-release/examples/train/strata-train was not built (OpenBLAS missing?)" >&2
    exit 1
  fi
  # strata-train takes examples/configs/strata_default.json unless the flags give --config.
  exec build-release/examples/train/strata-train "$@"
fi
export STRATA_LIBRARY=$PWD/build-release/bindings/c/libstrata.so
exec /usr/bin/python3 examples/python/train_llama.py "$@"
