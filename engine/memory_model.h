// The memory model Engine::finalize and `strata plan` share: the formulas for
// bytes a tier holds that both the engine (its budgets, its messages, the
// disk pipeline's ring) and the planner count, so that the two compute them
// once. The swap files' reserve (swap_files_bytes) and the disk pipeline's
// staging ring (ring_slot_bytes, ring_slots) live here; the placement rule
// is tier.h's, the pinned working memory working_memory.h's, each schedule's
// extra memory schedule/'s. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/memory_budget.h"

namespace strata::engine {

// The swap files' size for `blocks` bytes of swap blocks (nvme state and
// compute homes): the blocks, 1/16 of them and 64 MiB of room for the
// allocator, rounded up to 1 MiB. Engine::finalize asks the swap store for
// it (unless strata.budgets.disk is set) and `strata plan` counts it.
inline std::uint64_t swap_files_bytes(std::uint64_t blocks) {
  constexpr std::uint64_t kMiB = 1ull << 20;
  return (blocks + blocks / 16 + 64 * kMiB + kMiB - 1) / kMiB * kMiB;
}

// One slot of the disk pipeline's staging ring for a chunk of `chunk_elems`
// trainable elements whose optimizer state takes `state_bytes_per_elem`
// each (OptimizerSpec::bytes_per_elem: the master and the moments), rounded
// up to the direct-I/O alignment (4096). Saturates instead of wrapping.
std::uint64_t ring_slot_bytes(std::int64_t chunk_elems, std::uint64_t state_bytes_per_elem);

// The shape of the ring for a layout's nvme chunks: one slot holds the
// largest nvme chunk's state (ring_slot_bytes); (0, 0) without optimizer
// state on nvme. The engine's is working_memory.h's ring_shape(layout);
// the planner's comes from its estimate of the layout.
struct RingShape {
  std::uint64_t slot_bytes = 0;
  std::size_t nvme_chunks = 0;  // chunks whose state lives on nvme: the ring never has more slots
};

// A derived ring's room without a pinned budget (MemoryBudget::kUnlimited).
inline constexpr std::uint64_t kNoRoomLimit = core::MemoryBudget::kUnlimited;

// What sizes the ring besides its shape.
struct RingInputs {
  RingShape shape;
  // strata.budgets.staging in bytes; 0: unset, the ring is derived.
  std::uint64_t staging_bytes = 0;
  // For a derived ring: the pinned bytes it may take (the engine: what the
  // pinned budget leaves beyond the state, the schedule's extra memory and
  // the step's working memory); kNoRoomLimit: no pinned budget.
  std::uint64_t pinned_room_bytes = kNoRoomLimit;
  // For a derived ring: the slots it has when room allows
  // (Schedule::ring_depth), >= 1.
  std::uint64_t depth = 1;
};

// The ring the disk pipeline allocates (DiskPipeline::create).
struct RingSlots {
  std::uint64_t slot_bytes = 0;
  // The slots: staging_bytes / slot when the staging budget is set, else
  // `depth`, fewer when pinned_room_bytes holds fewer slots (at least one);
  // never more than the nvme chunks. 0 without nvme chunks, and when the
  // staging budget is below one slot (then staging_below_slot).
  std::uint64_t slots = 0;
  // strata.budgets.staging is set and below one slot: the engine refuses it.
  bool staging_below_slot = false;

  std::uint64_t bytes() const { return slot_bytes * slots; }
};
RingSlots ring_slots(const RingInputs& in);

}  // namespace strata::engine
