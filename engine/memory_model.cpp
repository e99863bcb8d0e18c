#include "engine/memory_model.h"

#include <algorithm>
#include <limits>

#include "core/aligned_buffer.h"

namespace strata::engine {

std::uint64_t ring_slot_bytes(std::int64_t chunk_elems, std::uint64_t state_bytes_per_elem) {
  const std::uint64_t elems = chunk_elems > 0 ? static_cast<std::uint64_t>(chunk_elems) : 0;
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(elems, state_bytes_per_elem, &bytes)) bytes = std::numeric_limits<std::uint64_t>::max();
  return core::align_up(bytes, core::kDirectIoAlignment);
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

}  // namespace strata::engine
