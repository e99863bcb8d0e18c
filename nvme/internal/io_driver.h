// IoDriver: what a kernel I/O interface (io_uring, libaio, pread/pwrite) must
// do for IoBackend. A driver only moves requests to the kernel and results
// back; it never interprets a result: retries and errors live in io_backend.cpp.
// Owner-thread-only: each driver belongs to one I/O thread, except
// register_file/register_buffers, which IoBackend calls with no I/O in flight
// on that file or buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/status.h"
#include "nvme/io_backend.h"

namespace strata::nvme::internal {

// One transfer handed to a driver. `tag` comes back with the completion.
struct DriverOp {
  IoOp op = IoOp::kRead;
  int file_index = -1;      // slot in the backend's file table
  int fd = -1;              // the descriptor in that slot
  std::uint64_t offset = 0;
  std::byte* data = nullptr;
  std::uint64_t length = 0;
  int buffer_index = -1;    // registered buffer holding [data, data + length), or -1
  void* tag = nullptr;
};

struct DriverCompletion {
  void* tag = nullptr;
  std::int64_t result = 0;  // bytes transferred (>= 0) or -errno
};

class IoDriver {
 public:
  virtual ~IoDriver() = default;

  // Most ops the driver holds at once (prepared + in the kernel).
  virtual unsigned capacity() const = 0;

  // Queues one op (capacity permitting). Errors mean the driver is broken.
  virtual core::Status prepare(const DriverOp& op) = 0;
  // Hands queued ops to the kernel. Never loses one: an op the kernel refuses
  // comes back from the next reap() with result -errno (EAGAIN and EINTR are
  // then retried by IoBackend).
  virtual void submit() = 0;
  // Appends completions; blocks until at least `min_complete` are there
  // (0: never blocks). Only called with ops in flight when min_complete > 0.
  virtual core::Status reap(unsigned min_complete, std::vector<DriverCompletion>& out) = 0;

  // (optional) default: nothing to do. Installs `fd` in slot `index` (-1: clear).
  virtual core::Status register_file(int /*index*/, int /*fd*/) { return core::Status(); }
  // (optional) default: nothing to do. Replaces the registered buffers.
  virtual core::Status register_buffers(std::span<const std::span<std::byte>> /*buffers*/) {
    return core::Status();
  }
  // True when ops may carry buffer_index (io_uring fixed buffers).
  virtual bool uses_registered_buffers() const { return false; }
};

// Driver factories. Each returns kUnimplemented when its library was not built
// in and kUnavailable (with the errno and the call) when the kernel refuses.
core::Result<std::unique_ptr<IoDriver>> make_uring_driver(const IoBackendOptions& options);
core::Result<std::unique_ptr<IoDriver>> make_aio_driver(const IoBackendOptions& options);
core::Result<std::unique_ptr<IoDriver>> make_psync_driver();
// Wraps `inner` so that `injector` decides faults per op (fault_injection.cpp).
std::unique_ptr<IoDriver> make_fault_injecting_driver(std::unique_ptr<IoDriver> inner,
                                                      FaultInjector& injector);

}  // namespace strata::nvme::internal
