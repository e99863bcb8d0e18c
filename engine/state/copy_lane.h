// CopyLane: where a copy between host and device goes (a stream), whose
// bytes it counts (a step's, a job's, a prefetch's), and which trace track
// shows it. The framework's calls use the engine's lane, the gradient path,
// the optimizer and the prefetcher their own, so their copies run side by
// side. lane_h2d and lane_d2h block until done; lane_h2d_queued queues the
// copy and returns an event after it. A lane is used by one thread at a time
// (its stream's owner); the functions are thread-safe. Private to engine/.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "core/status.h"
#include "engine/step_stats.h"
#include "engine/trace.h"
#include "gpu/device.h"

namespace strata::engine {

struct CopyLane {
  gpu::Stream* stream = nullptr;
  StepBytes* bytes = nullptr;
  TraceTrack track = TraceTrack::kDevice;
};

core::Status lane_h2d(gpu::Device& device, Trace& trace, const CopyLane& lane, gpu::DeviceSpan dst,
                      std::span<const std::byte> src);
// Queues the copy on the lane's stream and returns an event recorded after
// it: the caller keeps `src` unchanged, and `dst` unread, until it passes.
core::Result<std::shared_ptr<gpu::Event>> lane_h2d_queued(gpu::Device& device, Trace& trace, const CopyLane& lane,
                                                          gpu::DeviceSpan dst, std::span<const std::byte> src);
core::Status lane_d2h(gpu::Device& device, Trace& trace, const CopyLane& lane, std::span<std::byte> dst,
                      gpu::DeviceSpan src);

}  // namespace strata::engine
