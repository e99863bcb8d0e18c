// The memory model Engine::finalize and `strata plan` share: the formulas for
// bytes a tier holds that both the engine (its budgets, its messages, the
// disk pipeline's ring) and the planner count, so that the two compute them
// once. The swap files' reserve (swap_files_bytes), the step's pinned working
// memory (pinned_working), the disk pipeline's staging ring (ring_slot_bytes,
// ring_slots), the pinned room a derived ring takes (ring_room_bytes) and the
// least pinned budget (pinned_least) live here; the placement rule is
// tier.h's, each schedule's extra memory schedule/'s (extra_bytes). Inputs are plain sizes: the engine takes them from its Layout
// (working_memory.h), the planner from its estimate of it. Pure functions;
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/memory_budget.h"
#include "engine/optimizer_spec.h"

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
// trainable elements: its optimizer state (OptimizerSpec::state_bytes: the
// master and the optimizer's arrays), rounded up to the direct-I/O alignment
// (4096). Saturates instead of wrapping.
std::uint64_t ring_slot_bytes(const OptimizerSpec& spec, std::int64_t chunk_elems);

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

// Gradient copies down (device -> pinned) a threaded gradient path holds at
// once: one being passed into the host gradients, one landing.
inline constexpr int kGradientCopiesInFlight = 2;

// Stage 3 over several ranks: each rank's tag in a fetch's gather (the
// group, the gather's number, its bytes, the rank's status and whether it
// kept the group's copy since its release, which the ranks compare before
// the payload: ComputeHomes::gather), on the heap; and the trailer of each
// rank's block of the payload (its status after the tags).
inline constexpr std::uint64_t kGatherTagBytes = 40;
inline constexpr std::uint64_t kGatherTrailerBytes = 8;
// A gather's payload on the host: every rank's home of `home_bytes` with
// its trailer (ComputeHomes::gather). Saturates instead of wrapping.
std::uint64_t gather_payload_bytes(std::uint64_t ranks, std::uint64_t home_bytes);

// The largest buffers the step's pinned working memory is sized by, in bytes
// (0 where the layout has none). The engine's come from its layout
// (working_memory.h's pinned_working_bytes), the planner's from its estimate.
struct WorkingShape {
  // A trainable group's trainable range of its compute copies (the wire
  // buffer a gradient copy down lands in: the whole group unless it has
  // frozen parameters too), the largest.
  std::uint64_t wire_bytes = 0;
  // A trainable group's trainable elements in compute bytes (the packed
  // gradient pass), the largest.
  std::uint64_t packed_bytes = 0;
  // A group's compute copies whose home is nvme, rounded up to the direct-I/O
  // alignment (ComputeHomes::load), the largest.
  std::uint64_t nvme_compute_bytes = 0;
  // The same for every home but pinned memory (device or nvme).
  std::uint64_t unpinned_compute_bytes = 0;
  // A chunk's optimizer state outside pinned memory, the largest.
  std::uint64_t unpinned_state_bytes = 0;
  // A device-resident chunk's compute copies, the largest.
  std::uint64_t device_chunk_compute_bytes = 0;
  // Several data-parallel ranks: a trainable group's fp32 gradients to sum
  // plus the rank's summed shard (the pass), and its compute copies of every
  // rank gathered (the optimizer; at stage 3 a fetch, with each rank's tag
  // and the group unpacked whole), the largest; 0 with one rank.
  std::uint64_t ranks_gradient_bytes = 0;
  std::uint64_t ranks_compute_bytes = 0;
  // Stage 3 over ranks with the fetches gathered on the device: a group
  // gathered on the host all the same by read_compute and export (every
  // rank's home with its status, the group unpacked), outside the step's
  // work; 0 otherwise (then in ranks_compute_bytes).
  std::uint64_t read_gather_bytes = 0;
};

// The pinned memory a step works in beyond the placement's state (Layout::bytes)
// and its schedule's extra copies (Schedule::extra_memory). Engine::finalize
// reserves it before the disk pipeline's ring takes what is left, so the
// smallest strata.budgets.pinned that works is state + extra + total() + one
// ring slot (when optimizer state lives on nvme). Each figure is an upper
// bound the engine keeps to (GradientPath holds at most
// kGradientCopiesInFlight copies down at once).
struct PinnedWorking {
  std::uint64_t gradient_staging = 0;  // copies down and the packed gradient pass
  std::uint64_t compute_staging = 0;   // non-pinned compute homes read for a fetch, a prefetch, the optimizer
  std::uint64_t optimizer_copies = 0;  // early jobs' new compute copies of device-resident chunks; with ranks, a group's gathered copies
  std::uint64_t between_steps = 0;     // one chunk's state and one group's compute copies (checkpoints), or a read's gather
  std::uint64_t step() const { return gradient_staging + compute_staging + optimizer_copies; }
  std::uint64_t total() const { return step() > between_steps ? step() : between_steps; }
};

// `threaded`: Schedule::threaded (copies, passes, prefetches and the
// optimizer on their own threads); `early_jobs`: the schedule's early jobs
// may be uncertain (speculative), holding shadow copies.
PinnedWorking pinned_working(const WorkingShape& shape, bool threaded, bool early_jobs);

// The pinned bytes a derived ring may take (RingInputs::pinned_room_bytes):
// what a pinned budget of `pinned_limit_bytes` leaves beyond `held_bytes` (the
// placement's pinned state, host gradients and pinned compute homes, with the
// schedule's extra pinned memory) and the step's working memory; 0 when
// nothing is left; kNoRoomLimit when pinned_limit_bytes is kNoRoomLimit (no
// pinned budget).
std::uint64_t ring_room_bytes(std::uint64_t pinned_limit_bytes, std::uint64_t held_bytes,
                              const PinnedWorking& working);

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

// The smallest strata.budgets.pinned that Engine::finalize accepts (it refuses
// any below): `held_bytes` (the placement's pinned state, host gradients and
// pinned compute homes, with the schedule's extra pinned memory), the step's
// working memory, and the least ring: ring_slots with no pinned room (one
// slot, or the slots strata.budgets.staging asks for; none without nvme
// state). `ring.pinned_room_bytes` is not read.
struct PinnedLeast {
  std::uint64_t ring_bytes = 0;  // the least ring
  std::uint64_t bytes = 0;       // held + working.total() + ring_bytes
};
PinnedLeast pinned_least(std::uint64_t held_bytes, const PinnedWorking& working, const RingInputs& ring);

}  // namespace strata::engine
