// CopyLane: where a copy between host and device goes (a stream), whose
// bytes it counts (a step's, a job's, a prefetch's), and which trace track
// shows it. The framework's calls use the engine's lane, the gradient path,
// the optimizer and the prefetcher their own, so their copies run side by
// side. The copies block until done. A lane is used by one thread at a time
// (its stream's owner); the functions are thread-safe. Private to engine/.
#pragma once

#include <cstddef>
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
core::Status lane_d2h(gpu::Device& device, Trace& trace, const CopyLane& lane, std::span<std::byte> dst,
                      gpu::DeviceSpan src);

}  // namespace strata::engine
