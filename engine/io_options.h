// The nvme engine's options from the config (strata.io.*), in one place for
// every part of the engine that opens a backend or a direct file.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "engine/config.h"
#include "core/aligned_buffer.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {

inline nvme::BackendKind backend_kind_of(IoBackend b) {
  switch (b) {
    case IoBackend::kAuto:
      return nvme::BackendKind::kAuto;
    case IoBackend::kIoUring:
      return nvme::BackendKind::kIoUring;
    case IoBackend::kLibaio:
      return nvme::BackendKind::kLibaio;
    case IoBackend::kPsync:
      return nvme::BackendKind::kPsync;
  }
  return nvme::BackendKind::kAuto;
}

// strata.io.backend, queue_depth, rings and sqpoll (and the test hook
// IoConfig::fault_injector).
inline nvme::IoBackendOptions io_backend_options(const IoConfig& io) {
  nvme::IoBackendOptions o;
  o.kind = backend_kind_of(io.backend);
  o.queue_depth = static_cast<unsigned>(io.queue_depth);
  o.rings = static_cast<unsigned>(io.rings);
  o.sqpoll = io.sqpoll;
  o.fault_injector = io.fault_injector;
  return o;
}

// Checkpoint and export files: requests of strata.io.block_bytes, and enough
// 4 MiB staging buffers to keep strata.io.queue_depth requests in flight
// (at most 64 MiB of them, at least two buffers).
inline nvme::DirectFileOptions direct_file_options(const IoConfig& io) {
  constexpr std::uint64_t kBufferBytes = 4ull << 20;
  constexpr std::uint64_t kMaxInFlightBytes = 64ull << 20;
  nvme::DirectFileOptions o;
  o.buffer_bytes = kBufferBytes;
  o.request_bytes = static_cast<std::size_t>(
      std::clamp<std::uint64_t>(core::align_up(io.block_bytes, core::kDirectIoAlignment), core::kDirectIoAlignment,
                                kBufferBytes));
  const std::uint64_t in_flight =
      std::min(static_cast<std::uint64_t>(std::max<std::int64_t>(io.queue_depth, 1)) * o.request_bytes,
               kMaxInFlightBytes);
  o.buffer_count = static_cast<std::size_t>(std::max<std::uint64_t>(2, (in_flight + kBufferBytes - 1) / kBufferBytes + 1));
  return o;
}

}  // namespace strata::engine
