// The engine's per-group state (engine.cpp, prefetch.cpp). Private to engine/.
#pragma once

#include <cstdint>
#include <string>

#include "engine/engine.h"
#include "gpu/device.h"

namespace strata::engine {

// A fetch group's compute copies and its transient device buffers.
struct Engine::GroupState {
  gpu::DeviceBuffer device_home;  // compute home on the device
  gpu::PinnedBuffer pinned_home;  // compute home in pinned memory
  std::string block_id;           // compute home on nvme
  gpu::DeviceBuffer working;      // device copy while fetched (home elsewhere)
  bool fetched = false;
  gpu::DeviceBuffer grad;         // gradients, between grad_buffer and grads_ready
  int grads_micro_step = -1;      // the micro-batch whose gradients arrived
  std::int64_t grad_copies_posted = 0;  // copies down handed to the gradient thread (see grad_copies_done_)
  // overlap "delayed": the new compute copies the last step's optimizer
  // wrote (its first `pending_bytes`), home at the next step_end.
  gpu::PinnedBuffer pending;
  std::uint64_t pending_bytes = 0;
};

}  // namespace strata::engine
