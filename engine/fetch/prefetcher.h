// Prefetcher: traced prefetch. After a fetch (and at step_end) it starts the
// copies of the groups the learned fetch sequence says come next, on its own
// thread and stream, within DeepSpeed's stage3_prefetch_bucket_size (bytes
// ahead, not yet fetched) and stage3_max_live_parameters (device copies of
// compute copies in all: fetched, prefetched, resident; resident copies used
// again later than the one being prefetched make room). A prefetch takes a
// cached device buffer without waiting for its release's fence (one whose
// fence has passed first): the prefetch stream waits for it. The copies are
// queued on the prefetch stream and followed by an event (`landed`): a fetch
// whose copy is not yet queued waits for the queueing only, and hands the
// event on (the framework's stream waits for it, or the host does); the
// copy's traffic counts when the fetch takes it. The copy itself (waiting for
// the optimizer's mark on the group first) is the engine's, handed in as
// CopyIn. Thread-compatible:
// its calls come under the engine's lock; the copies run on the prefetch
// thread and touch only their own Copy until done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "core/result.h"
#include "engine/fetch/fetch_trace.h"
#include "engine/fetch/resident_set.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/serial_queue.h"
#include "engine/layout.h"
#include "engine/state/copy_lane.h"
#include "gpu/device.h"

namespace strata::engine {

class Prefetcher {
 public:
  // Queues the copy of group g's compute copies into `dst` on `lane` (the
  // prefetch stream, the prefetch's bytes), once the optimizer is done with g
  // and, on the lane's stream, after `fence` (null: none), the framework's
  // last work on the buffer. Returns an event recorded on the lane's stream
  // after the copy (null: the copy is complete already).
  using CopyIn = std::function<core::Result<std::shared_ptr<gpu::Event>>(std::size_t g, gpu::DeviceSpan dst,
                                                                         gpu::Event* fence, CopyLane lane)>;
  // A prefetched copy handed to a fetch: the buffer, and the event after its
  // copy (null: complete), which whoever reads the buffer must wait for.
  struct Taken {
    gpu::DeviceBuffer buffer;
    std::shared_ptr<gpu::Event> landed;
  };
  // `bucket_bytes`: stage3_prefetch_bucket_size in bytes of the compute dtype.
  static core::Result<std::unique_ptr<Prefetcher>> create(gpu::Device& device, const Layout& layout,
                                                          std::uint64_t bucket_bytes,
                                                          BufferCache<gpu::DeviceBuffer>& cache,
                                                          CopyIn copy_in);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Starts the copies of the groups after the trace's cursor that are not on
  // the device already (`on_device(g)`: fetched, or a device home) nor
  // resident; `fetched_bytes`: the fetched groups' device copies.
  void issue(const FetchTrace& trace, ResidentSet& resident, std::uint64_t fetched_bytes,
             const std::function<bool(std::size_t)>& on_device);
  // Group g's prefetched copy, once its copy is queued (nullopt: none was
  // started); its traffic is added to `bytes`. A failed copy's error.
  core::Result<std::optional<Taken>> take(std::size_t g, StepBytes& bytes);
  bool empty() const { return inflight_.empty(); }
  // Bytes of the prefetched copies (landed or in flight).
  std::uint64_t bytes() const;
  // Drops prefetched copies into the cache once their copies have ended (the
  // host waits: a dropped copy may read a home the optimizer writes next).
  void drop(DropCopies which);
  // Waits for every copy posted (the engine's destructor, before the
  // optimizer they may wait for stops).
  void drain();

 private:
  struct Copy;
  Prefetcher(gpu::Device& device, const Layout& layout, std::uint64_t bucket_bytes,
             BufferCache<gpu::DeviceBuffer>& cache, CopyIn copy_in, gpu::Stream stream);

  gpu::Device& device_;
  const Layout& layout_;
  const std::uint64_t bucket_;
  BufferCache<gpu::DeviceBuffer>& cache_;
  CopyIn copy_in_;
  gpu::Stream stream_;
  std::map<std::size_t, std::unique_ptr<Copy>> inflight_;  // landed or in flight, not yet taken
  std::unique_ptr<SerialQueue> queue_;  // last: its thread stops first
};

}  // namespace strata::engine
