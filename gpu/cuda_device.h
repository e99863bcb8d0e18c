// The CUDA device: a gpu::Device on one NVIDIA GPU through the CUDA runtime.
// Device memory comes from one arena reserved up front (no cudaMalloc after
// creation); pinned memory from cudaHostAlloc and cudaHostRegister. Every
// CUDA call is checked; an error names the call and CUDA's error name.
// In a build without CUDA, make_cuda_device returns kUnimplemented.
#pragma once

#include <cstdint>
#include <memory>

#include "core/result.h"
#include "gpu/device.h"

namespace strata::gpu {

struct CudaDeviceOptions {
  DeviceBudgets budgets;       // both required; borrowed, must outlive the device
  int ordinal = 0;             // CUDA device index; default 0
  // Bytes of the device-memory arena, reserved with one cudaMalloc at
  // creation. 0 (default): the device budget's limit when it is finite, else
  // the device's free memory less 1 GiB of headroom for the CUDA context and
  // the framework.
  std::uint64_t arena_bytes = 0;
  // More headroom besides that 1 GiB when the arena is derived: memory
  // another library allocates for itself later (NCCL's buffers, for
  // several ranks' collectives on the device).
  std::uint64_t extra_headroom_bytes = 0;
};

// Errors: kUnimplemented without CUDA in the build; kUnavailable with no driver
// or no device (CUDA's error name, e.g. cudaErrorInsufficientDriver);
// kInvalidArgument for a bad ordinal or a missing budget; kOutOfMemory when
// the arena cannot be reserved.
core::Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& options);

}  // namespace strata::gpu
