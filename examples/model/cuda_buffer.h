// Device memory on a CUDA GPU for callers of CudaModelRunner that have no
// device allocator of their own (the tests; a framework uses its own, and
// strata_train the engine's buffers): one cudaMalloc, blocking copies.
// In a build without the CUDA runner, create() returns UNIMPLEMENTED.
#pragma once

#include <cstddef>
#include <span>

#include "core/result.h"
#include "core/status.h"

namespace strata::examples {

// Move-only owner of one device allocation, freed (cudaFree) when destroyed.
// Thread-compatible.
class CudaBuffer {
 public:
  // `size_bytes` (> 0, else INVALID_ARGUMENT) of device memory on
  // `device_ordinal`, contents undefined. Errors: UNIMPLEMENTED without the
  // CUDA runner in the build; UNAVAILABLE with no driver or device;
  // OUT_OF_MEMORY; each names the CUDA call that failed.
  static core::Result<CudaBuffer> create(std::size_t size_bytes, int device_ordinal = 0);

  CudaBuffer() = default;
  CudaBuffer(CudaBuffer&& other) noexcept;
  CudaBuffer& operator=(CudaBuffer&& other) noexcept;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer();

  void* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }

  // Copies `src` to [offset_bytes, offset_bytes + src.size()) of the buffer,
  // or that range of the buffer to `dst`; blocking (synchronous cudaMemcpy).
  // OUT_OF_RANGE when the range passes the end of the buffer.
  core::Status upload(std::span<const std::byte> src, std::size_t offset_bytes = 0);
  core::Status download(std::span<std::byte> dst, std::size_t offset_bytes = 0) const;

 private:
  void reset() noexcept;

  void* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  int device_ordinal_ = 0;
};

}  // namespace strata::examples
