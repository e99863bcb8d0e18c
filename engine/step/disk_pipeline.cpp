#include "engine/step/disk_pipeline.h"

#include <algorithm>

#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/str.h"
#include "engine/working_memory.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

core::Result<std::unique_ptr<DiskPipeline>> DiskPipeline::create(StateStore& state, gpu::Device& device,
                                                                 core::MemoryBudget& staging,
                                                                 std::uint64_t pinned_room,
                                                                 std::int64_t ring_depth) {
  std::unique_ptr<DiskPipeline> p(new DiskPipeline(state));
  // The slots as finalize counted them for the pinned budget (memory_model.h).
  const std::uint64_t limit = staging.limit_bytes();
  const RingSlots ring = ring_slots({.shape = ring_shape(state.layout()),
                                     .staging_bytes = limit == core::MemoryBudget::kUnlimited ? 0 : limit,
                                     .pinned_room_bytes = pinned_room,
                                     .depth = static_cast<std::uint64_t>(ring_depth)});
  const std::uint64_t slot = ring.slot_bytes;
  const std::uint64_t slots = ring.slots;
  if (ring.staging_below_slot) {
    return Status::resource_exhausted(str_cat(
        "the disk pipeline needs at least one chunk's optimizer state in staging memory (",
        core::format_bytes(slot), "); strata.budgets.staging allows ", core::format_bytes(limit),
        ". strata.budgets.staging >= ", slot, " (one chunk) works, three chunks or more (", 3 * slot,
        ") let reads, Adam and writes overlap; or lower strata.chunk_bytes"));
  }
  if (slots == 0) return p;  // no optimizer state on nvme
  STRATA_ASSIGN_OR_RETURN(p->charge_, staging.charge(slots * slot, "the disk pipeline's staging ring"));
  for (std::uint64_t i = 0; i < slots; ++i) {
    STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer b, device.allocate_pinned(slot, "the disk pipeline's staging ring"));
    p->ring_.push_back(std::move(b));
  }
  return p;
}

DiskPipeline::Pass::Pass(DiskPipeline& pipeline, const std::vector<std::size_t>& chunks, std::size_t read_ahead,
                         bool write_behind, StepBytes& bytes, Trace& trace)
    : p_(pipeline), chunks_(chunks), read_ahead_(read_ahead), write_behind_(write_behind), bytes_(bytes),
      trace_(trace) {
  for (std::size_t i = 0; i < p_.ring_.size(); ++i) free_.push_back(i);
}

DiskPipeline::Pass::~Pass() {
  abandon_reads();
  drain_writes().ignore_error();  // the caller's drain_writes reported any error already
}

bool DiskPipeline::Pass::on_nvme(std::size_t i) const { return p_.state_.tier(chunks_[i]) == Tier::kNvme; }

core::Status DiskPipeline::Pass::finish_write() {
  Flight f = std::move(writes_.front());
  writes_.pop_front();
  const Status s = f.io.wait();
  const std::size_t c = chunks_[f.item];
  trace_.span(TraceTrack::kSwapWrite, str_cat("write chunk ", c), f.begin_ns, core::monotonic_ns(),
              p_.state_.staging_bytes(c));
  free_.push_back(f.slot);
  return s;
}

core::Status DiskPipeline::Pass::advance(std::size_t i) {
  while (!writes_.empty() && writes_.front().io.ready()) STRATA_RETURN_IF_ERROR(finish_write());
  while (next_read_ < chunks_.size() && next_read_ <= i + read_ahead_) {
    if (!on_nvme(next_read_)) {
      ++next_read_;
      continue;
    }
    if (free_.empty()) break;
    const std::size_t slot = free_.front();
    const std::size_t c = chunks_[next_read_];
    STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, p_.state_.start_load(c, p_.ring_[slot].bytes()));
    free_.pop_front();
    bytes_.add_nvme_read(io.path_bytes());
    reads_.push_back({next_read_, slot, std::move(io), core::monotonic_ns()});
    ++next_read_;
  }
  return Status();
}

core::Result<ChunkState> DiskPipeline::Pass::take(std::size_t i) {
  const std::size_t c = chunks_[i];
  // No slot was free for this chunk's read: wait for the oldest write.
  while (reads_.empty() || reads_.front().item != i) {
    if (writes_.empty()) return Status::internal(str_cat("disk pipeline: no read in flight for chunk ", c));
    STRATA_RETURN_IF_ERROR(finish_write());
    STRATA_RETURN_IF_ERROR(advance(i));
  }
  Flight f = std::move(reads_.front());
  reads_.pop_front();
  STRATA_RETURN_IF_ERROR(f.io.wait());
  trace_.span(TraceTrack::kSwapRead, str_cat("read chunk ", c), f.begin_ns, core::monotonic_ns(),
              p_.state_.staging_bytes(c));
  staged_item_ = i;
  staged_slot_ = f.slot;
  return p_.state_.staged_views(c, p_.ring_[f.slot].bytes());
}

core::Status DiskPipeline::Pass::store(std::size_t i, StateStore::Version version) {
  if (staged_item_ != i) return Status::internal(str_cat("disk pipeline: chunk ", chunks_[i], " was not taken"));
  const std::size_t c = chunks_[i];
  const std::size_t slot = std::exchange(staged_slot_, SIZE_MAX);
  staged_item_ = SIZE_MAX;
  STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, p_.state_.start_store(c, p_.ring_[slot].bytes(), version));
  bytes_.add_nvme_write(io.path_bytes());
  writes_.push_back({i, slot, std::move(io), core::monotonic_ns()});
  if (!write_behind_) STRATA_RETURN_IF_ERROR(finish_write());
  return Status();
}

core::Status DiskPipeline::Pass::drain_writes() {
  Status first;
  while (!writes_.empty()) {
    Status s = finish_write();
    if (first.ok()) first = std::move(s);
  }
  return first;
}

void DiskPipeline::Pass::abandon_reads() {
  while (!reads_.empty()) {
    reads_.front().io.wait().ignore_error();  // dropped: the reader stopped
    free_.push_back(reads_.front().slot);
    reads_.pop_front();
  }
}

}  // namespace strata::engine
