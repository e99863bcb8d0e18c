// AlignedBuffer: one owner of a block of host memory with a chosen alignment
// (64 B for SIMD, 4 KiB for O_DIRECT). Move-only; thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/result.h"

namespace strata::core {

inline constexpr std::size_t kCacheLineBytes = 64;
inline constexpr std::size_t kDirectIoAlignment = 4096;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  // Allocates `size_bytes` (may be 0: an empty buffer) aligned to `alignment`,
  // a power of two >= sizeof(void*). Memory is not initialised.
  // Errors: kInvalidArgument for a bad alignment, kOutOfMemory when the
  // allocator fails (the message gives the size).
  static Result<AlignedBuffer> allocate(std::size_t size_bytes,
                                        std::size_t alignment = kCacheLineBytes);

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  std::size_t alignment() const { return alignment_; }
  bool empty() const { return size_bytes_ == 0; }
  std::span<std::byte> bytes() const { return {data_, size_bytes_}; }
  // Views the memory as elements of T (size_bytes / sizeof(T) of them).
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), size_bytes_ / sizeof(T)};
  }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  std::size_t alignment_ = 0;
};

// True when `p` is a multiple of `alignment` (a power of two).
inline bool is_aligned(const void* p, std::size_t alignment) {
  return (reinterpret_cast<std::uintptr_t>(p) & (alignment - 1)) == 0;
}
// Rounds `n` up to a multiple of `alignment` (a power of two).
constexpr std::uint64_t align_up(std::uint64_t n, std::uint64_t alignment) {
  return (n + alignment - 1) & ~(alignment - 1);
}

}  // namespace strata::core
