#!/usr/bin/env bash
# The test command: installs what is missing, builds strata twice (normal with
# CUDA compiled when nvcc exists; AddressSanitizer + UndefinedBehaviorSanitizer
# without CUDA), runs every test except the `slow` suite in both, runs clang's
# thread-safety analysis, prints the time of each stage and ends with one line:
# "N passed, N failed, N skipped".
# The thread-safety stage (scripts/thread_safety_check.py) configures build-tsa/
# with clang++ but builds nothing: it runs `clang++ -fsyntax-only -Wthread-safety
# -Werror=thread-safety` over the compile database's sources in core/, gpu/,
# nvme/, cpu_adam/, engine/, bindings/c/ and their unit tests that include
# core/mutex.h or core/thread_annotations.h (CUDA sources are not in it), minus
# the script's EXCLUDED list. It counts as one test case (skipped without clang++).
# Usage: scripts/test.sh        (from anywhere; builds under build/, build-asan/, build-tsa/)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

stage_names=()
stage_secs=()
failed_stage=""
run_stage() {
  local name=$1
  shift
  local start=$SECONDS
  echo "=== $name"
  "$@"
  local rc=$?
  stage_names+=("$name")
  stage_secs+=($((SECONDS - start)))
  echo "=== $name: $((SECONDS - start)) s (exit $rc)"
  if [[ $rc -ne 0 && -z "$failed_stage" ]]; then failed_stage=$name; fi
  return $rc
}

run_stage "install dependencies" bash scripts/install-deps.sh || {
  echo "0 passed, 1 failed"
  exit 1
}
source scripts/common.sh

jobs=$(nproc)
# Sanitizers: stop at the first UBSan report (it only prints by default).
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# allocator_may_return_null: an impossible allocation returns NULL as in a
# normal build, so out-of-memory paths are tested instead of aborting.
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:allocator_may_return_null=1
export LSAN_OPTIONS=suppressions=$root/scripts/lsan.supp

run_stage "configure (normal)" meson_setup build $cuda_option
run_stage "build (normal)" ninja -C build -j"$jobs"
rm -f build/meson-logs/testlog.json
run_stage "test (normal)" meson test -C build --no-suite slow --print-errorlogs --num-processes "$jobs"
rm -f build-tsa/thread-safety-log.json
run_stage "thread-safety (clang)" /usr/bin/python3 scripts/thread_safety_check.py \
  --build-dir build-tsa --log build-tsa/thread-safety-log.json -j "$jobs"
run_stage "configure (asan+ubsan)" meson_setup build-asan -Dcuda=disabled \
  -Db_sanitize=address,undefined -Db_lundef=false
run_stage "build (asan+ubsan)" ninja -C build-asan -j"$jobs"
rm -f build-asan/meson-logs/testlog.json
run_stage "test (asan+ubsan)" meson test -C build-asan --no-suite slow --print-errorlogs \
  --num-processes "$jobs" --timeout-multiplier 3

echo
echo "stage times:"
for i in "${!stage_names[@]}"; do
  printf '  %-26s %5d s\n' "${stage_names[$i]}" "${stage_secs[$i]}"
done
printf '  %-26s %5d s\n' "total" "$SECONDS"
[[ -n "$failed_stage" ]] && echo "first failing stage: $failed_stage"

# Counts every gtest case (and every non-gtest test) of both builds, and the
# thread-safety check as one; a build or check that left no log counts as one failure.
extra_failed=0
[[ -f build/meson-logs/testlog.json ]] || extra_failed=$((extra_failed + 1))
[[ -f build-asan/meson-logs/testlog.json ]] || extra_failed=$((extra_failed + 1))
[[ -f build-tsa/thread-safety-log.json ]] || extra_failed=$((extra_failed + 1))
/usr/bin/python3 scripts/test_summary.py --extra-failed "$extra_failed" \
  build/meson-logs/testlog.json build-asan/meson-logs/testlog.json build-tsa/thread-safety-log.json
