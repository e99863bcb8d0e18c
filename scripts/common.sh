# Shared by the build scripts: finds the CUDA toolkit and sets meson options.
# Source it; it sets cuda_option (-Dcuda=enabled when nvcc exists, else auto).
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
if command -v nvcc >/dev/null; then
  cuda_option=-Dcuda=enabled
else
  cuda_option=-Dcuda=auto
  echo "note: no nvcc found (looked on PATH and in /usr/local/cuda/bin): building without the CUDA backend"
fi

# meson_setup DIR [options...]: configures DIR, or reconfigures it when it exists.
meson_setup() {
  local dir=$1
  shift
  if [[ -f "$dir/build.ninja" ]]; then
    meson setup --reconfigure "$dir" "$@" >/dev/null
  else
    meson setup "$dir" "$@" >/dev/null
  fi
}
