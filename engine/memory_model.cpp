#include "engine/memory_model.h"

#include <algorithm>
#include <limits>

#include "core/aligned_buffer.h"

namespace strata::engine {

std::uint64_t ring_slot_bytes(const OptimizerSpec& spec, std::int64_t chunk_elems) {
  const std::int64_t elems = std::max<std::int64_t>(chunk_elems, 0);
  if (elems >= (std::int64_t{1} << 58)) return std::numeric_limits<std::uint64_t>::max();
  return core::align_up(spec.state_bytes(elems), core::kDirectIoAlignment);
}

std::uint64_t gather_payload_bytes(std::uint64_t ranks, std::uint64_t home_bytes) {
  std::uint64_t block = 0, all = 0;
  if (__builtin_add_overflow(home_bytes, kGatherTrailerBytes, &block) || __builtin_mul_overflow(ranks, block, &all)) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return all;
}

PinnedWorking pinned_working(const WorkingShape& shape, bool threaded, bool early_jobs) {
  PinnedWorking w;
  // A copy down lands in a wire buffer; the pass packs it into the trainable
  // layout. Threaded, the next copies land while one is passed.
  w.gradient_staging =
      (threaded ? kGradientCopiesInFlight : 1) * shape.wire_bytes + shape.packed_bytes + shape.ranks_gradient_bytes;
  // A fetch (and, threaded, the prefetch thread) reads nvme homes through a
  // staging copy; the optimizer opens one group's non-pinned compute copies
  // at a time.
  w.compute_staging = (threaded ? 2 : 1) * shape.nvme_compute_bytes + shape.unpinned_compute_bytes;
  // An uncertain early job brings a device chunk's new compute copies back.
  if (early_jobs) w.optimizer_copies = shape.device_chunk_compute_bytes;
  w.optimizer_copies += shape.ranks_compute_bytes;  // the gathered compute copies
  w.between_steps = std::max(shape.unpinned_state_bytes + shape.unpinned_compute_bytes, shape.read_gather_bytes);
  return w;
}

std::uint64_t ring_room_bytes(std::uint64_t pinned_limit_bytes, std::uint64_t held_bytes,
                              const PinnedWorking& working) {
  if (pinned_limit_bytes == kNoRoomLimit) return kNoRoomLimit;
  const std::uint64_t taken = held_bytes + working.total();
  return pinned_limit_bytes > taken ? pinned_limit_bytes - taken : 0;
}

RingSlots ring_slots(const RingInputs& in) {
  RingSlots r;
  r.slot_bytes = in.shape.slot_bytes;
  const std::uint64_t slot = in.shape.slot_bytes;
  const auto chunks = static_cast<std::uint64_t>(in.shape.nvme_chunks);
  if (chunks == 0 || slot == 0) return r;
  if (in.staging_bytes > 0) {
    r.slots = std::min<std::uint64_t>(in.staging_bytes / slot, chunks);
    r.staging_below_slot = r.slots == 0;
    return r;
  }
  std::uint64_t slots = in.depth;
  if (in.pinned_room_bytes != kNoRoomLimit) slots = std::clamp<std::uint64_t>(in.pinned_room_bytes / slot, 1, in.depth);
  r.slots = std::min(slots, chunks);
  return r;
}

PinnedLeast pinned_least(std::uint64_t held_bytes, const PinnedWorking& working, const RingInputs& ring) {
  RingInputs none = ring;
  none.pinned_room_bytes = 0;
  PinnedLeast least;
  least.ring_bytes = ring_slots(none).bytes();
  least.bytes = held_bytes + working.total() + least.ring_bytes;
  return least;
}

}  // namespace strata::engine
