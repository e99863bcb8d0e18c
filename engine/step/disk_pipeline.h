// DiskPipeline: the optimizer's way through chunks whose state lives on nvme.
// A ring of K pinned staging slots (each the largest nvme chunk's master and
// moments, 4096-aligned), charged to strata.budgets.staging (derived: the
// schedule's ring depth, fewer when pinned memory is tight). A job walks its
// chunks in order through a Pass: reads run up to `read_ahead` chunks ahead
// of the one cpu_adam works on, and writes run behind it; a slot is free
// again when its write has completed. With K slots, K - 1 reads and writes
// are in flight around the chunk in Adam (read i+2, Adam i+1, write i for
// K = 3). Chunks not on nvme pass through without a slot. One pass at a time
// (the optimizer thread); thread-compatible. Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "core/memory_budget.h"
#include "core/result.h"
#include "engine/state/state_store.h"
#include "engine/step_stats.h"
#include "engine/trace.h"
#include "gpu/device.h"
#include "nvme/swap_store.h"

namespace strata::engine {

class DiskPipeline {
 public:
  // The ring for `state`'s nvme chunks (none: no slots), sized by
  // memory_model.h's ring_slots, as finalize counted it. Derived (staging
  // unlimited): `ring_depth` slots, fewer when `pinned_room` (the pinned
  // bytes left to it beyond the state and the step's working memory,
  // engine/working_memory.h; kUnlimited: no limit) holds fewer, and at least
  // one (finalize has checked that one fits). Errors: the staging budget
  // below one slot, naming the key to raise and the chunk size.
  static core::Result<std::unique_ptr<DiskPipeline>> create(StateStore& state, gpu::Device& device,
                                                            core::MemoryBudget& staging, std::uint64_t pinned_room,
                                                            std::int64_t ring_depth);
  std::size_t slots() const { return ring_.size(); }

  // One job's walk through `chunks` (in order, the caller may reorder the
  // ones not yet read: from next_read() on). Traffic goes to `bytes`.
  class Pass {
   public:
    Pass(DiskPipeline& pipeline, const std::vector<std::size_t>& chunks, std::size_t read_ahead,
         bool write_behind, StepBytes& bytes, Trace& trace);
    ~Pass();  // waits for what is in flight (errors were reported by the calls)
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

    // Before chunk i: writes that are done give their slots back, then the
    // reads up to i + read_ahead start while slots are free.
    core::Status advance(std::size_t i);
    // Chunk i's staged state (an nvme chunk): waits for its read, first
    // finishing writes when no slot was free to read it.
    core::Result<ChunkState> take(std::size_t i);
    // Writes chunk i's staged state back (`version`); waited for at once
    // without write-behind.
    core::Status store(std::size_t i, StateStore::Version version);
    // Waits for every write; the first error.
    core::Status drain_writes();
    // Waits for the reads in flight and drops them (a job that stops).
    void abandon_reads();
    // The first chunk index whose read has not started.
    std::size_t next_read() const { return next_read_; }

   private:
    struct Flight {
      std::size_t item, slot;
      nvme::SwapIo io;
      std::int64_t begin_ns;
    };
    core::Status finish_write();
    bool on_nvme(std::size_t i) const;

    DiskPipeline& p_;
    const std::vector<std::size_t>& chunks_;
    const std::size_t read_ahead_;
    const bool write_behind_;
    StepBytes& bytes_;
    Trace& trace_;
    std::deque<std::size_t> free_;
    std::deque<Flight> reads_, writes_;
    std::size_t next_read_ = 0;
    std::size_t staged_item_ = SIZE_MAX, staged_slot_ = SIZE_MAX;  // take()'s chunk, until store()
  };

 private:
  DiskPipeline(StateStore& state) : state_(state) {}
  StateStore& state_;
  core::BudgetCharge charge_;
  std::vector<gpu::PinnedBuffer> ring_;
};

}  // namespace strata::engine
