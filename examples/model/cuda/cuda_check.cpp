// CUDA runtime and cuBLAS results as core::Status (cuda_check.h).
#include "examples/model/cuda/cuda_check.h"

#include <string>
#include <utility>

#include "core/logging.h"
#include "core/str.h"

namespace strata::examples::cuda {

core::Status cuda_check(cudaError_t err, std::string_view call) {
  if (err == cudaSuccess) return core::Status();
  (void)cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
  std::string msg = core::str_cat(call, " failed: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation: return core::Status::out_of_memory(std::move(msg));
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch: return core::Status::unavailable(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer: return core::Status::invalid_argument(std::move(msg));
    default: return core::Status::internal(std::move(msg));
  }
}

core::Status cublas_check(cublasStatus_t status, std::string_view call) {
  if (status == CUBLAS_STATUS_SUCCESS) return core::Status();
  std::string msg =
      core::str_cat(call, " failed: ", cublasGetStatusName(status), " (", cublasGetStatusString(status), ")");
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED: return core::Status::out_of_memory(std::move(msg));
    case CUBLAS_STATUS_NOT_INITIALIZED: return core::Status::unavailable(std::move(msg));
    case CUBLAS_STATUS_INVALID_VALUE: return core::Status::invalid_argument(std::move(msg));
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED: return core::Status::unimplemented(std::move(msg));
    default: return core::Status::internal(std::move(msg));
  }
}

void log_cuda_error(cudaError_t err, std::string_view call) noexcept {
  if (err != cudaSuccess) {
    STRATA_LOG(kWarn) << cuda_check(err, call);
  }
}

void log_cublas_error(cublasStatus_t status, std::string_view call) noexcept {
  if (status != CUBLAS_STATUS_SUCCESS) {
    STRATA_LOG(kWarn) << cublas_check(status, call);
  }
}

}  // namespace strata::examples::cuda
