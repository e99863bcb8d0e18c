#include "engine/state/copy_lane.h"

namespace strata::engine {

core::Status lane_h2d(gpu::Device& device, Trace& trace, const CopyLane& lane, gpu::DeviceSpan dst,
                      std::span<const std::byte> src) {
  TraceScope t(trace, lane.track, "h2d", src.size());
  STRATA_RETURN_IF_ERROR(device.copy_h2d(*lane.stream, dst, src));
  lane.bytes->h2d += src.size();
  return device.synchronize(*lane.stream);
}

core::Result<std::shared_ptr<gpu::Event>> lane_h2d_queued(gpu::Device& device, Trace& trace, const CopyLane& lane,
                                                          gpu::DeviceSpan dst, std::span<const std::byte> src) {
  TraceScope t(trace, lane.track, "h2d", src.size());  // (the queueing: the copy runs after)
  STRATA_ASSIGN_OR_RETURN(gpu::Event landed, device.create_event());
  STRATA_RETURN_IF_ERROR(device.copy_h2d(*lane.stream, dst, src));
  lane.bytes->h2d += src.size();
  STRATA_RETURN_IF_ERROR(device.record(landed, *lane.stream));
  return std::make_shared<gpu::Event>(std::move(landed));
}

core::Status lane_d2h(gpu::Device& device, Trace& trace, const CopyLane& lane, std::span<std::byte> dst,
                      gpu::DeviceSpan src) {
  TraceScope t(trace, lane.track, "d2h", dst.size());
  STRATA_RETURN_IF_ERROR(device.copy_d2h(*lane.stream, dst, src));
  lane.bytes->d2h += dst.size();
  return device.synchronize(*lane.stream);
}

}  // namespace strata::engine
