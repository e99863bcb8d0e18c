// CudaBuffer (cuda_buffer.h): one cudaMalloc, blocking copies.
#include "examples/model/cuda_buffer.h"

#include <cuda_runtime.h>

#include <utility>

#include "core/str.h"
#include "examples/model/cuda/cuda_check.h"

namespace strata::examples {
namespace {

core::Status check_range(std::size_t offset_bytes, std::size_t size_bytes, std::size_t buffer_bytes,
                         const char* what) {
  if (offset_bytes > buffer_bytes || size_bytes > buffer_bytes - offset_bytes) {
    return core::Status::out_of_range(core::str_cat("CudaBuffer::", what, ": [", offset_bytes, ", +", size_bytes,
                                                    ") passes the end of the ", buffer_bytes, "-byte buffer"));
  }
  return core::Status();
}

}  // namespace

core::Result<CudaBuffer> CudaBuffer::create(std::size_t size_bytes, int device_ordinal) {
  if (size_bytes == 0) return core::Status::invalid_argument("CudaBuffer::create: 0 bytes");
  STRATA_RETURN_IF_ERROR(cuda::cuda_check(cudaSetDevice(device_ordinal), "cudaSetDevice"));
  CudaBuffer b;
  STRATA_RETURN_IF_ERROR(cuda::cuda_check(cudaMalloc(&b.data_, size_bytes), "cudaMalloc"));
  b.size_bytes_ = size_bytes;
  b.device_ordinal_ = device_ordinal;
  return b;
}

CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      device_ordinal_(other.device_ordinal_) {}

CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    device_ordinal_ = other.device_ordinal_;
  }
  return *this;
}

CudaBuffer::~CudaBuffer() { reset(); }

void CudaBuffer::reset() noexcept {
  if (data_ == nullptr) return;
  cuda::log_cuda_error(cudaSetDevice(device_ordinal_), "cudaSetDevice");
  cuda::log_cuda_error(cudaFree(data_), "cudaFree");
  data_ = nullptr;
  size_bytes_ = 0;
}

core::Status CudaBuffer::upload(std::span<const std::byte> src, std::size_t offset_bytes) {
  STRATA_RETURN_IF_ERROR(check_range(offset_bytes, src.size(), size_bytes_, "upload"));
  if (src.empty()) return core::Status();
  STRATA_RETURN_IF_ERROR(cuda::cuda_check(cudaSetDevice(device_ordinal_), "cudaSetDevice"));
  return cuda::cuda_check(
      cudaMemcpy(static_cast<std::byte*>(data_) + offset_bytes, src.data(), src.size(), cudaMemcpyHostToDevice),
      "cudaMemcpy");
}

core::Status CudaBuffer::download(std::span<std::byte> dst, std::size_t offset_bytes) const {
  STRATA_RETURN_IF_ERROR(check_range(offset_bytes, dst.size(), size_bytes_, "download"));
  if (dst.empty()) return core::Status();
  STRATA_RETURN_IF_ERROR(cuda::cuda_check(cudaSetDevice(device_ordinal_), "cudaSetDevice"));
  return cuda::cuda_check(
      cudaMemcpy(dst.data(), static_cast<const std::byte*>(data_) + offset_bytes, dst.size(), cudaMemcpyDeviceToHost),
      "cudaMemcpy");
}

}  // namespace strata::examples
