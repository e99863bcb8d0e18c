#!/usr/bin/env bash
# The main job: installs what is missing, builds strata (release), and runs it
# on the embedded default: `strata plan` for the example configuration (host
# device, a local swap directory) and a 1.3B-parameter decoder on this machine.
# Extra arguments go to `strata plan` (e.g. --params 40e9 --layers 48 --gpu-memory 80GiB).
# Usage: scripts/run.sh [strata plan flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
source scripts/common.sh
meson_setup build-release --buildtype=release $cuda_option
ninja -C build-release >/dev/null
echo "built build-release/bindings/cli/strata"
if [[ $# -eq 0 ]]; then
  set -- --layers 24 --hidden 2048 --vocab 50304 --seq 2048
fi
exec build-release/bindings/cli/strata plan --config examples/configs/strata_default.json "$@"
