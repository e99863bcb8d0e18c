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

}  // namespace strata::gpu
