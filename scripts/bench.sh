#!/usr/bin/env bash
# Builds one benchmark in a release tree of its own (build-bench/: benchmarks
# on, tests off) and runs it with the remaining arguments; docs/benchmarks.md
# has each benchmark's command and figures.
#
# Usage: scripts/bench.sh NAME [flags...]   (e.g. step_bench --scenarios cpu_cpu --reps 2)
#        scripts/bench.sh --list            (the benchmarks: the executables of benchmarks/meson.build)
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t names < <(sed -n "s/^[a-z_]* *= *executable('\([a-z_0-9]*\)'.*/\1/p; s/^executable('\([a-z_0-9]*\)'.*/\1/p" \
  benchmarks/meson.build)
usage() { echo "usage: scripts/bench.sh NAME [flags...] | --list   (NAME: ${names[*]})" >&2; }
if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${names[@]}"
  exit 0
fi
name=${1:-}
if [[ -z "$name" || " ${names[*]} " != *" $name "* ]]; then
  usage
  exit 2
fi
shift
# nvme_bench runs fio on the same file as its yardstick.
bash scripts/install-deps.sh $([[ "$name" == nvme_bench ]] && echo --with-tools)
source scripts/common.sh
meson_setup build-bench --buildtype=release -Dtests=disabled -Dbenchmarks=enabled $cuda_option
if ! ninja -C build-bench "benchmarks/$name" > build-bench/ninja.log 2>&1; then
  tail -n 40 build-bench/ninja.log
  echo "bench.sh: the build failed; the whole log is build-bench/ninja.log" >&2
  exit 1
fi
exec "build-bench/benchmarks/$name" "$@"
