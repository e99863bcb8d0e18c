#!/usr/bin/env bash
# Installs the Debian 12 packages strata needs that are missing (apt, as root
# or through sudo). Safe to run again: it installs nothing when all are there.
# Usage: scripts/install-deps.sh [--with-tools]   (tools: fio, hwloc-nox)
set -euo pipefail

packages=(
  g++ meson ninja-build pkg-config python3
  clang  # the test command's thread-safety analysis (scripts/thread_safety_check.py)
  # libFuzzer and clang's sanitizer runtimes for fuzz/ (only recommended by clang, so
  # --no-install-recommends would leave them out).
  libclang-rt-14-dev
  liburing-dev libaio-dev libhwloc-dev libtbb-dev libisal-dev
  libgtest-dev libgmock-dev nlohmann-json3-dev libopenblas-dev libdlpack-dev
  libcli11-dev  # the command lines of strata and strata-train
  libgloo-dev  # host collectives for several ranks (partition/)
  # The Python side: strata.torch, its tests, the Llama example and its text
  # (the fortunes collection: English quotations and literature, never committed).
  python3-torch python3-numpy python3-pytest python3-tqdm fortunes-min fortunes
  # pip install . and the wheel (pyproject.toml on meson-python), and its test's venv.
  python3-mesonpy python3-build python3-venv
  patchelf  # meson-python needs it for a wheel with a compiled library (only recommended)
)
if [[ "${1:-}" == "--with-tools" ]]; then
  packages+=(fio hwloc-nox)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
if [[ $(id -u) -eq 0 ]]; then
  sudo=()
elif command -v sudo >/dev/null; then
  sudo=(sudo)
else
  echo "install-deps: not root and no sudo; install these packages: ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
