// AlignedBuffer: aligned_alloc with an owner.
#include "core/aligned_buffer.h"

#include <cstdlib>
#include <utility>

#include "core/str.h"

namespace strata::core {

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      alignment_(std::exchange(other.alignment_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    alignment_ = std::exchange(other.alignment_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

Result<AlignedBuffer> AlignedBuffer::allocate(std::size_t size_bytes, std::size_t alignment) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
    return Status::invalid_argument(
        str_cat("alignment ", alignment, " is not a power of two >= ", sizeof(void*)));
  }
  AlignedBuffer buffer;
  buffer.alignment_ = alignment;
  if (size_bytes == 0) return buffer;
  const std::size_t rounded = static_cast<std::size_t>(align_up(size_bytes, alignment));
  if (rounded < size_bytes) {
    return Status::out_of_memory(str_cat("cannot allocate ", size_bytes, " bytes: size overflows"));
  }
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    return Status::out_of_memory(str_cat("cannot allocate ", format_bytes(size_bytes),
                                         " of host memory aligned to ", alignment));
  }
  buffer.data_ = static_cast<std::byte*>(p);
  buffer.size_bytes_ = size_bytes;
  return buffer;
}

}  // namespace strata::core
