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

# meson_setup DIR [options...]: configures DIR, or sets the options of an
# existing one (`meson configure`: Meson 1.0's `setup --reconfigure` keeps the
# old c_args and cpp_args whatever it is given; ninja regenerates).
meson_setup() {
  local dir=$1
  shift
  if [[ -f "$dir/build.ninja" ]]; then
    meson configure "$dir" "$@" >/dev/null
  else
    meson setup "$dir" "$@" >/dev/null
  fi
}
