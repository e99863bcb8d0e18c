// Bulk memory work of finalize on the CPU optimizer's threads: zero-fills
// (the first touch of pinned memory, gpu::Device::allocate_pinned's fill) and
// the initial values' copies and conversions. One thread brings fresh pages in
// at about 1.5-2.5 GB/s (the kernel zeroes each page as it faults it in), so a
// 7B model's 72 GiB of optimizer state took 38 s on one thread; the
// optimizer's threads also place the pages near themselves. Finalize only:
// cpu_adam runs one call at a time (CpuTurns), and nothing else calls it
// before the first step. Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "cpu_adam/cpu_adam.h"
#include "gpu/device.h"

namespace strata::engine {

// Each runs in cpu_adam's tiles counted in bytes (the default tile: 256 KiB).

// Zero-fills `bytes` on `adam`'s threads.
inline void parallel_zero(adam::CpuAdam& adam, std::span<std::byte> bytes) {
  adam.for_each_tile(static_cast<std::int64_t>(bytes.size()), [&](std::int64_t lo, std::int64_t len) {
    std::memset(bytes.data() + lo, 0, static_cast<std::size_t>(len));
  });
}

// Copies `bytes` bytes from `src` to `dst` (not overlapping) on `adam`'s threads.
inline void parallel_copy(adam::CpuAdam& adam, std::byte* dst, const std::byte* src, std::size_t bytes) {
  adam.for_each_tile(static_cast<std::int64_t>(bytes), [&](std::int64_t lo, std::int64_t len) {
    std::memcpy(dst + lo, src + lo, static_cast<std::size_t>(len));
  });
}

// allocate_pinned's fill for memory that must start zeroed.
inline gpu::Device::PinnedFill zero_fill(adam::CpuAdam& adam) {
  return [&adam](std::span<std::byte> bytes) { parallel_zero(adam, bytes); };
}

}  // namespace strata::engine
