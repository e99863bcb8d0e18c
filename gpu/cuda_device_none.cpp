// make_cuda_device for builds without CUDA.
#include "gpu/cuda_device.h"

namespace strata::gpu {

core::Result<std::unique_ptr<Device>> make_cuda_device(const CudaDeviceOptions& /*options*/) {
  return core::Status::unimplemented(
      "this strata was built without CUDA (configure with nvcc on PATH and -Dcuda=enabled)");
}

}  // namespace strata::gpu
