// run_device_collective: one collective over device memory, as the engine's
// collectives on the device all run. It launches in `turn` (the rank's
// launch order: launch_order.h), its stream waiting for the last launched
// collective first (the device runs them in that order too), through gpu::Device::run_on_stream on
// `stream` (`fn` gets the native stream and the spans' addresses and calls
// `comm`), then waits for it: a stream with NCCL's work through the
// communicator, within its timeout and aborting it past that (a stream
// carrying NCCL work is not to be synchronized by other means); the host
// device's through the stream, whose thread ran the collective. Returns the
// first failure. Private to engine/.
#pragma once

#include <span>
#include <utility>

#include "core/status.h"
#include "engine/internal/launch_order.h"
#include "gpu/device.h"
#include "partition/communicator.h"

namespace strata::engine {

inline core::Status run_device_collective(gpu::Device& device, gpu::Stream& stream,
                                          std::span<const gpu::DeviceSpan> spans, partition::Communicator& comm,
                                          LaunchOrder::Turn& turn, gpu::Device::StreamWork fn) {
  core::Status s = turn.wait();
  // Run after the last launched collective too, not only launched after it.
  if (const std::shared_ptr<gpu::Event> previous = s.ok() ? turn.previous() : nullptr; previous != nullptr) {
    s = device.wait(stream, *previous);
  }
  if (s.ok()) s = device.run_on_stream(stream, spans, std::move(fn));
  if (s.ok()) {
    core::Result<gpu::Event> after = device.create_event();
    if (after.ok()) s = device.record(*after, stream);
    else s = std::move(after).status();
    if (s.ok()) turn.launched(std::make_shared<gpu::Event>(std::move(after).value()));
  }
  turn.done();  // launched, or given up: the next launch's turn
  void* native = stream.native_handle();
  if (s.ok()) s = native != nullptr ? comm.synchronize(native) : device.synchronize(stream);
  return s;
}

}  // namespace strata::engine
