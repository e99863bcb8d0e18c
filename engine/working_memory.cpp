#include "engine/working_memory.h"

#include <algorithm>

#include "core/aligned_buffer.h"

namespace strata::engine {

PinnedWorking pinned_working_bytes(const Layout& layout, bool threaded, bool early_jobs) {
  const auto cb = static_cast<std::uint64_t>(layout.compute_bytes);
  std::uint64_t wire = 0, packed = 0, nvme_compute = 0, unpinned_compute = 0, state = 0, device_chunk = 0;
  std::uint64_t ranks_gradient = 0, ranks_compute = 0, read_gather = 0;
  for (const GroupPlace& gp : layout.groups) {
    const std::uint64_t compute = static_cast<std::uint64_t>(gp.compute_elems) * cb;
    const std::uint64_t staged = core::align_up(layout.home_bytes(gp), core::kDirectIoAlignment);  // ComputeHomes::load
    if (gp.trainable_elems > 0 && layout.share.ranks > 1 && layout.share.device_collectives) {
      // The rank's shard of the sum comes down in fp32 and is passed as it is
      // (GradientPath::sum_down).
      wire = std::max(wire, static_cast<std::uint64_t>(gp.shard_elems) * static_cast<std::uint64_t>(layout.share.sum_bytes));
    } else if (gp.trainable_elems > 0) {
      // The gradients' copy down: the group's gradient buffer (GradientPath::copy_down).
      wire = std::max(wire, static_cast<std::uint64_t>(gp.gradient_elems()) * cb);
      packed = std::max(packed, static_cast<std::uint64_t>(gp.trainable_elems) * cb);
      if (layout.share.ranks > 1) {
        ranks_gradient = std::max(ranks_gradient, static_cast<std::uint64_t>(gp.trainable_elems + gp.shard_elems) * 4);
      }
    }
    if (gp.trainable_elems > 0 && layout.share.ranks > 1 && !layout.compute_sharded) {
      ranks_compute = std::max(ranks_compute, static_cast<std::uint64_t>(gp.trainable_elems) * cb);
    }
    if (layout.compute_sharded) {
      // A fetch gathers every rank's home and unpacks them whole
      // (ComputeHomes::gather), and so do read_compute and export, on the
      // host also where the fetches gather on the device.
      std::uint64_t& gather = layout.share.device_collectives ? read_gather : ranks_compute;
      gather = std::max(gather, gather_payload_bytes(static_cast<std::uint64_t>(layout.share.ranks),
                                                     layout.home_bytes(gp)) +
                                    core::align_up(compute, core::kDirectIoAlignment));
    }
    if (gp.compute_tier == Tier::kNvme) nvme_compute = std::max(nvme_compute, staged);
    if (gp.compute_tier != Tier::kPinned) unpinned_compute = std::max(unpinned_compute, staged);
  }
  for (const ChunkRun& r : layout.chunk_runs) {
    const std::uint64_t bytes = layout.state_bytes(r);
    if (r.state_tier != Tier::kPinned) state = std::max(state, bytes);
    if (r.state_tier == Tier::kDevice)
      device_chunk = std::max(device_chunk, static_cast<std::uint64_t>(r.elems) * cb);
  }
  return pinned_working({.wire_bytes = wire,
                         .packed_bytes = packed,
                         .nvme_compute_bytes = nvme_compute,
                         .unpinned_compute_bytes = unpinned_compute,
                         .unpinned_state_bytes = state,
                         .device_chunk_compute_bytes = device_chunk,
                         .ranks_gradient_bytes = ranks_gradient,
                         .ranks_compute_bytes = ranks_compute,
                         .read_gather_bytes = read_gather},
                        threaded, early_jobs);
}

std::uint64_t device_sums_bytes(const Layout& layout, std::uint64_t align) {
  if (layout.share.ranks <= 1 || !layout.share.device_collectives) return 0;
  std::int64_t largest = 0;
  for (const GroupPlace& gp : layout.groups) largest = std::max(largest, gp.trainable_elems);
  return largest > 0 ? core::align_up(static_cast<std::uint64_t>(largest) * static_cast<std::uint64_t>(layout.share.sum_bytes), align)
                     : 0;
}

RingShape ring_shape(const Layout& layout) {
  RingShape r;
  for (const ChunkRun& run : layout.chunk_runs) {
    if (run.state_tier != Tier::kNvme) continue;
    r.slot_bytes = std::max(r.slot_bytes, ring_slot_bytes(layout.optimizer, run.elems));
    r.nvme_chunks += run.count;
  }
  return r;
}

}  // namespace strata::engine
