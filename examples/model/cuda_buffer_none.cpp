// CudaBuffer in a build without the CUDA runner (no CUDA or no cuBLAS):
// create() reports why; no buffer can exist, so the rest is never reached.
#include "examples/model/cuda_buffer.h"

#include <utility>

namespace strata::examples {

core::Result<CudaBuffer> CudaBuffer::create(std::size_t /*size_bytes*/, int /*device_ordinal*/) {
  return core::Status::unimplemented(
      "CudaBuffer: this build has no CUDA example runner (CUDA or cuBLAS was not found at meson setup)");
}

CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      device_ordinal_(other.device_ordinal_) {}

CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  size_bytes_ = std::exchange(other.size_bytes_, 0);
  device_ordinal_ = other.device_ordinal_;
  return *this;
}

CudaBuffer::~CudaBuffer() = default;

void CudaBuffer::reset() noexcept {}

core::Status CudaBuffer::upload(std::span<const std::byte> /*src*/, std::size_t /*offset_bytes*/) {
  return core::Status::failed_precondition("CudaBuffer::upload: no buffer (no CUDA example runner in this build)");
}

core::Status CudaBuffer::download(std::span<std::byte> /*dst*/, std::size_t /*offset_bytes*/) const {
  return core::Status::failed_precondition("CudaBuffer::download: no buffer (no CUDA example runner in this build)");
}

}  // namespace strata::examples
