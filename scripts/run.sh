#!/usr/bin/env bash
# The main job: installs what is missing, builds strata (release), and trains
# the example model (examples/model, a residual MLP on a teacher-student task)
# through the C API on the embedded default configuration
# (examples/configs/strata_default.json: the emulated host device, compute
# copies in pinned memory, optimizer state on NVMe under ./strata_swap).
# It prints each step (loss, samples/s, bytes per tier) and a summary.
#
# Usage: scripts/run.sh [strata-train flags...]   (e.g. --steps 100 --config examples/configs/placement_cpu_all.json)
#        scripts/run.sh plan [strata plan flags...] (the memory planner, e.g. --params 40e9 --layers 48)
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
if [[ "${1:-}" == "plan" ]]; then
  shift
  if [[ $# -eq 0 ]]; then
    set -- --layers 24 --hidden 2048 --vocab 50304 --seq 2048
  fi
  exec build-release/bindings/cli/strata plan --config examples/configs/strata_default.json "$@"
fi
if [[ ! -x build-release/examples/train/strata-train ]]; then
  echo "run.sh: build-release/examples/train/strata-train was not built (OpenBLAS missing?)" >&2
  exit 1
fi
mkdir -p strata_swap  # the default config's swap directory (swap files are removed at exit)
exec build-release/examples/train/strata-train --config examples/configs/strata_default.json "$@"
