// Which CUDA devices this process can use, and how much memory each has.
// The planner (`strata plan`) and the engine's device choice use it. Works in
// every build: without CUDA it reports kUnimplemented ("built without CUDA").
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"

namespace strata::gpu {

struct GpuInfo {
  int ordinal = 0;                   // CUDA device index
  std::string name;                  // "NVIDIA H100 80GB HBM3"
  std::uint64_t total_bytes = 0;     // device memory
  std::uint64_t free_bytes = 0;      // free when queried
  int compute_capability_major = 0;  // 9 for sm_90
  int compute_capability_minor = 0;
  int multiprocessor_count = 0;
};

// True when this build has the CUDA backend.
bool cuda_built();

// The visible CUDA devices. Errors: kUnimplemented without CUDA in the build;
// kUnavailable when there is no driver or no device (the message gives CUDA's
// error name and text, e.g. cudaErrorInsufficientDriver).
core::Result<std::vector<GpuInfo>> query_cuda_devices();

// How many CUDA devices are visible, without touching any of them (no
// context is made, unlike query_cuda_devices). Errors as query_cuda_devices'.
core::Result<int> cuda_device_count();

// The CUDA device that local rank `local_rank` of the `local_ranks` ranks on
// this machine drives, among the `visible` devices: the local rank's own
// (torchrun's and DeepSpeed's rule), or, with one device visible, that one
// (each rank's process given its GPU through CUDA_VISIBLE_DEVICES, as Slurm's
// --gpus-per-task does). Errors: kUnavailable with no device visible;
// kInvalidArgument when the machine's ranks outnumber its visible devices
// (two ranks would share a GPU), or for a local rank outside [0, local_ranks).
core::Result<int> device_for_local_rank(int local_rank, int local_ranks, int visible);

}  // namespace strata::gpu
