// device_query for builds without CUDA.
#include "gpu/device_query.h"

namespace strata::gpu {

bool cuda_built() { return false; }

core::Result<std::vector<GpuInfo>> query_cuda_devices() {
  return core::Status::unimplemented(
      "this strata was built without CUDA (configure with nvcc on PATH and -Dcuda=enabled)");
}

core::Result<int> cuda_device_count() { return query_cuda_devices().status(); }

}  // namespace strata::gpu
