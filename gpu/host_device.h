// The emulated device: a gpu::Device on the CPU with CUDA's semantics, for
// machines without a GPU (CI) and for measuring pipelines against a modeled
// GPU. Device memory is host memory under the device budget; each stream is a
// worker thread that runs its work in order; events behave like CUDA's.
//
// It is strict where CUDA is lenient or undefined: waiting on an event that
// was never recorded, using a buffer after it was freed (also when it is
// freed while work that uses it is still queued: that work's stream fails),
// copying past a buffer's end, or handing device memory to a copy as host
// memory are errors. Under AddressSanitizer, device memory is poisoned
// except while the device's own copies and kernels touch it, so host code
// that dereferences a DeviceSpan directly (which would fault on a GPU) is
// caught.
#pragma once

#include <memory>
#include <string>

#include "core/result.h"
#include "gpu/device.h"

namespace strata::gpu {

// How long work takes on the modeled GPU. Every rate 0 (the default) means
// "not modeled": the work takes only the CPU time it needs. With a rate set,
// an operation never completes before its modeled duration has passed; the
// device waits by sleeping, never by spinning. Three resources are modeled,
// each busy with one operation at a time (operations on different streams
// queue for it, like DMA engines and the SMs): the host->device link, the
// device->host link, and the device itself (kernels, device->device copies,
// declared compute). Different resources overlap freely.
struct TimingModel {
  double h2d_gb_per_s = 0.0;            // host->device copies, GB/s (1e9 bytes/s); default 0
  double d2h_gb_per_s = 0.0;            // device->host copies, GB/s; default 0
  double device_memory_gb_per_s = 0.0;  // kernels and d2d copies: bytes read + written per second / 1e9; default 0
  double compute_tflops = 0.0;          // declare_compute(): 1e12 FLOP/s; default 0 (declared ops take no time)

  bool enabled() const {
    return h2d_gb_per_s > 0 || d2h_gb_per_s > 0 || device_memory_gb_per_s > 0 || compute_tflops > 0;
  }
};

struct HostDeviceOptions {
  DeviceBudgets budgets;  // both required; borrowed, must outlive the device
  TimingModel timing;     // default: not modeled
  // Each allocation also takes a range of an arena as large as the device
  // budget, as the CUDA device's do (gpu/arena.h): a budget fragmented on
  // CUDA is fragmented here too, so every test of the host device meets what
  // a CUDA run meets (the least device budget the planner names trains on
  // both: the engine places its buffers from the arena's two ends, and under
  // a tight budget afresh; engine/internal/buffer_cache.h). An unlimited
  // device budget has none (nothing to fragment).
  bool arena = true;
};

// Errors: kInvalidArgument for a missing budget or a negative or non-finite rate.
core::Result<std::unique_ptr<Device>> make_host_device(const HostDeviceOptions& options);

}  // namespace strata::gpu
