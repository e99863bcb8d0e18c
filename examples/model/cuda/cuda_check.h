// CUDA runtime and cuBLAS results as core::Status, naming the call (private
// to the example model's CUDA runner).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string_view>

#include "core/status.h"

namespace strata::examples::cuda {

// OK for cudaSuccess. Otherwise "<call> failed: <error name> (<text>)" with a
// code that follows the error: UNAVAILABLE for no driver or no device,
// OUT_OF_MEMORY, INVALID_ARGUMENT for a bad value or device, INTERNAL for the
// rest. Clears the runtime's last (non-sticky) error.
core::Status cuda_check(cudaError_t err, std::string_view call);

// OK for CUBLAS_STATUS_SUCCESS; otherwise as cuda_check, with cuBLAS's status
// name and text (NOT_INITIALIZED, which cublasCreate returns without a
// usable driver, is UNAVAILABLE).
core::Status cublas_check(cublasStatus_t status, std::string_view call);

// For paths that cannot return a Status (destructors): logs a failure as a warning.
void log_cuda_error(cudaError_t err, std::string_view call) noexcept;
void log_cublas_error(cublasStatus_t status, std::string_view call) noexcept;

}  // namespace strata::examples::cuda
