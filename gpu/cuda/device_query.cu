// device_query through the CUDA runtime: the first CUDA translation unit.
#include <cuda_runtime.h>

#include "core/str.h"
#include "gpu/device_query.h"

namespace strata::gpu {
namespace {

core::Status cuda_error(cudaError_t err, const char* call) {
  return core::Status::unavailable(core::str_cat(call, " failed: ", cudaGetErrorName(err), " (",
                                                 cudaGetErrorString(err), ")"));
}

}  // namespace

bool cuda_built() { return true; }

core::Result<int> cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later calls
    return cuda_error(err, "cudaGetDeviceCount");
  }
  if (count == 0) return core::Status::unavailable("no CUDA device is visible");
  return count;
}

core::Result<std::vector<GpuInfo>> query_cuda_devices() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error for later calls
    return cuda_error(err, "cudaGetDeviceCount");
  }
  if (count == 0) return core::Status::unavailable("no CUDA device is visible");
  std::vector<GpuInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) return cuda_error(err, "cudaGetDeviceProperties");
    GpuInfo info;
    info.ordinal = i;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    info.compute_capability_major = prop.major;
    info.compute_capability_minor = prop.minor;
    info.multiprocessor_count = prop.multiProcessorCount;
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(i) == cudaSuccess) {
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) info.free_bytes = free_bytes;
      cudaSetDevice(previous);
    }
    devices.push_back(std::move(info));
  }
  return devices;
}

}  // namespace strata::gpu
