// Optimizer: the body of one optimizer job (engine/step/optimizer_job.h), run
// by the OptimizerRunner on its thread (or inside step_end under "none").
// For each group in job.order, chunk by chunk: host chunks by cpu_adam in
// slices of 2M elements, each a background turn (a waiting gradient pass goes
// first), nvme chunks through the disk pipeline (reads ahead, writes behind);
// device chunks by the device's AdamW on the optimizer's stream. Each group's
// new compute copies are written into a host view of its compute copies and
// go home (or, under "delayed", wait as pending) when its last chunk is done,
// and the group is marked done. The job's kind (OptimizerJob::kind) changes
// only that: early jobs pass the runner's gate before each group and commit
// nothing undoable before their verdict; a delayed job holds its compute
// copies pending and may take its verdict here once the step's gradients are
// in.
//
// Exactness: chunks are independent and every formula is core/numerics.h's,
// so neither the order chunks are updated in nor what runs beside them
// changes a bit. The job works without the engine's lock on what the step
// protocol leaves it: the chunks, the host gradients and the compute homes of
// the groups it has not marked done. One job at a time (the runner's
// thread, or step_end's under "none"): thread-compatible. Private to engine/.
#pragma once

#include <cstddef>
#include <memory>

#include "core/memory_budget.h"
#include "core/result.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/cpu_turns.h"
#include "engine/layout.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "engine/step/disk_pipeline.h"
#include "engine/step/gradient_path.h"
#include "engine/step/optimizer_job.h"
#include "engine/step/optimizer_runner.h"
#include "engine/trace.h"
#include "gpu/device.h"
#include "partition/communicator.h"

namespace strata::engine {

class Optimizer {
 public:
  // What a job works with (borrowed; they outlive the optimizer).
  struct Parts {
    const Layout& layout;
    const Config& config;
    gpu::Device& device;
    adam::CpuAdam& cpu_adam;
    CpuTurns& turns;
    StateStore& state;
    ComputeHomes& homes;
    GradientPath& gradients;  // the host gradients, and markers
    BufferCache<gpu::DeviceBuffer>& device_cache;
    BufferCache<gpu::PinnedBuffer>& pinned_cache;
    Trace& trace;
    core::MemoryBudget& staging_budget;  // the disk pipeline's ring
    std::uint64_t pinned_room;           // for a derived ring (DiskPipeline::create)
    // Several data-parallel ranks: the communicator the jobs alone use (null:
    // one rank). Each rank updates its shard of a group, then the group's new
    // compute copies are gathered from every rank before they go home.
    partition::Communicator* ranks = nullptr;
  };
  // Its stream and the disk pipeline's ring (`ring_depth` slots unless
  // strata.budgets.staging says otherwise).
  static core::Result<std::unique_ptr<Optimizer>> create(const Parts& parts, std::int64_t ring_depth);
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // The runner whose marks, gates and verdicts the jobs use (set once,
  // before the first job).
  void set_runner(OptimizerRunner& runner) { runner_ = &runner; }
  // Slots in the disk pipeline's staging ring (0 without nvme state).
  std::size_t ring_slots() const { return pipeline_->slots(); }
  // Runs one job to its end.
  core::Status run(OptimizerJob& job);

  // Per parameter, the applied steps that left it as it was (no gradient in
  // the step, strata.no_grad "skip"): its own step count is the steps
  // applied less these. Read and restored between steps (checkpoints).
  const std::vector<std::int64_t>& missed_steps() const { return missed_; }
  void restore_missed_steps(std::vector<std::int64_t> missed) { missed_ = std::move(missed); }

 private:
  // One job's walk through its chunks, and the state its steps share
  // (optimizer.cpp).
  class JobRun;

  explicit Optimizer(const Parts& parts) : parts_(parts), missed_(parts.layout.params.size(), 0) {}
  // A deferred verdict (a delayed job's): waits for the job's gradient
  // marker, decides as step_end would have (Verdict::decide_deferred) and
  // fills in the job's constants; false when the step is skipped.
  core::Result<bool> take_verdict(OptimizerJob& job);
  // Where an update's first element sits in the trainable space and which
  // optimizer step it applies: what bf16 moments' stochastic rounding draws
  // from, so its bits never depend on chunking, placement or slicing.
  struct UpdateAt {
    std::int64_t index = 0;
    std::int64_t step = 0;
  };
  // The layout's optimizer (OptimizerSpec) on elements [off, off + n) of a
  // host chunk: cpu_adam's step (or step_bf16_moments), lion_step or adagrad_step.
  core::Status update_on_cpu(const UpdateConstants& k, const ChunkState& st, std::size_t off, std::size_t n,
                             UpdateAt at, const adam::ConstTypedSpan& grad, const adam::TypedSpan& copy_out);
  // The same on a device chunk's views, on the optimizer's stream (Device's
  // adam_step or adam_step_bf16_moments, lion_step or adagrad_step); `state2`
  // is unused but by Adam.
  // A device chunk's views of elements [off, off + n): the master, the
  // optimizer's arrays and, blockwise, their scales (the blocks of the range).
  struct DeviceViews {
    gpu::DeviceSpan master, state1, state2, scales1, scales2;
  };
  core::Status update_on_device(const UpdateConstants& k, const DeviceViews& v, UpdateAt at,
                                const gpu::DeviceTypedSpan& grad, const gpu::DeviceTypedSpan& copy_out);

  const Parts parts_;
  OptimizerRunner* runner_ = nullptr;
  gpu::Stream stream_;
  std::unique_ptr<DiskPipeline> pipeline_;
  std::vector<std::int64_t> missed_;  // see missed_steps (the runner's thread, or between steps)
};

}  // namespace strata::engine
