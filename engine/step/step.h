// Step: the training step's control. It implements the framework's step
// calls (grad_buffer, grads_ready, micro_step_end, step_end) and owns what
// they decide and drive: the verdict (engine/step/verdict.h), the step under
// way (micro-batches, markers, its traffic), the early job, each group's
// gradient buffer, and the step's rooms: the gradient path, the optimizer
// (the job body) and its runner. The facade (engine/engine.h) checks the
// call order and delegates; the calls that read or write the state between
// steps ask it first (wait_optimizer, abandon_speculation,
// refuse_while_applying, flush_delayed). What differs per overlap mode is
// the schedule's (engine/schedule/); Step asks it.
//
// Created with the engine (the verdict answers loss_scale and set_lr before
// finalize); finalize hands it the rooms (start). Thread-compatible: every
// call comes under the engine's lock; the rooms' threads work without it on
// what the protocol leaves them (engine/step/README.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/numerics.h"
#include "core/result.h"
#include "engine/config.h"
#include "engine/layout.h"
#include "engine/schedule/schedule.h"
#include "engine/state/copy_lane.h"
#include "engine/step/gradient_path.h"
#include "engine/step/optimizer.h"
#include "engine/step/optimizer_job.h"
#include "engine/step/optimizer_runner.h"
#include "engine/step/verdict.h"
#include "engine/step_stats.h"
#include "engine/trace.h"
#include "gpu/device.h"

namespace strata::nvme {
class SwapStore;
}

namespace strata::engine {

class ComputeHomes;
class Fetcher;
class StateStore;
template <typename Buffer>
class BufferCache;

// Each swap path's traffic since the swap store was created (empty without one).
std::vector<SwapPathBytes> swap_traffic_of(const nvme::SwapStore* swap);

class Step {
 public:
  // What it works with from creation, borrowed (the engine owns them).
  struct Parts {
    const Layout& layout;  // filled by finalize, before start
    const Config& config;
    const Schedule& schedule;
    gpu::Device& device;
    Trace& trace;
    gpu::Stream& stream;  // the framework's calls' copies (the engine's stream)
  };
  Step(const Parts& parts, Verdict verdict);
  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

  // The rooms finalize built (owned from here on) and the engine's rooms
  // the step works with (borrowed).
  struct Rooms {
    std::unique_ptr<GradientPath> gradients;
    std::unique_ptr<Optimizer> optimizer;
    std::unique_ptr<OptimizerRunner> runner;
    Fetcher& fetcher;
    ComputeHomes& homes;
    StateStore& state;
    const nvme::SwapStore* swap;  // null: nothing on nvme
  };
  void start(Rooms rooms);
  bool started() const { return runner_ != nullptr; }

  // --- the framework's step calls (group g; the facade found it) ---
  core::Result<gpu::DeviceSpan> grad_buffer(std::size_t g);
  core::Status grads_ready(std::size_t g, gpu::Stream* written_on);
  // Trainable parameters `params` of group g got no gradient in the
  // micro-batch under way (their slots in its gradient buffer hold zeros):
  // before g's grads_ready of that micro-batch (Engine::no_grads).
  core::Status no_grads(std::size_t g, std::span<const std::size_t> params);
  core::Status micro_step_end();
  core::Result<StepStats> step_end();
  // kFailedPrecondition when group g may not be fetched now: its gradients
  // of the step's last micro-batch are in and the optimizer updates it in
  // place.
  core::Status may_fetch(std::size_t g) const;
  // The group's gradient buffer (lend_view; empty outside grad_buffer to grads_ready).
  const gpu::DeviceBuffer& gradient_buffer(std::size_t g) const { return grads_[g].grad; }
  // No micro-batch under way on the step's side: no gradients pending.
  bool between_steps() const;

  // --- for the calls that read or write the state between steps ---
  // Waits until every decided job finished (none before start); folds the
  // deferred verdicts they took into the step counts; the sticky error.
  core::Status wait_optimizer(const char* op);
  // Stops the early job started ahead (at step_end, for the next step)
  // before a call reads the optimizer state it may be reading (read_state,
  // checkpoints, export, set_lr): the next grads_ready starts another. `op`
  // names the caller in the error when the job cannot be stopped: it is
  // certain and has been handed gradients (its updates are in place).
  core::Status abandon_speculation(const char* op);
  // kFailedPrecondition naming `op` while the step's certain job updates in
  // place (from the first gradients of the step's last micro-batch to
  // step_end): the state and compute copies are part new, part old.
  core::Status refuse_while_applying(const char* op) const;
  // overlap "delayed", between steps, for calls that read the compute copies
  // (read_compute, save_checkpoint): the last step's update becomes visible
  // at once instead of at the next step_end.
  core::Status flush_delayed(const char* op);

  Verdict& verdict() { return verdict_; }
  // Per parameter, the applied steps that left it as it was
  // (Optimizer::missed_steps); between steps.
  const std::vector<std::int64_t>& missed_steps() const { return optimizer_->missed_steps(); }
  void restore_missed_steps(std::vector<std::int64_t> missed) { optimizer_->restore_missed_steps(std::move(missed)); }
  const Verdict& verdict() const { return verdict_; }
  // The framework's calls' lane: the engine's stream, the step's bytes.
  CopyLane lane() { return {&parts_.stream, &state_.bytes, TraceTrack::kDevice}; }
  // Traffic that is not a step's (initial values, a checkpoint's load).
  void forget_traffic() { state_.bytes = {}; }
  // While one lives, the step's traffic stays as it was: copies made
  // meanwhile on the step's lane (inspection, a checkpoint's, an export's) are not a step's.
  class TrafficPause {
   public:
    explicit TrafficPause(Step& step) : step_(step), saved_(step.state_.bytes) {}
    ~TrafficPause() { step_.state_.bytes = saved_; }
    TrafficPause(const TrafficPause&) = delete;
    TrafficPause& operator=(const TrafficPause&) = delete;

   private:
    Step& step_;
    StepBytes saved_;
  };
  OptimizerRunner& runner() { return *runner_; }
  // Slots in the disk pipeline's staging ring (0 when no state lives on nvme).
  std::size_t ring_slots() const { return optimizer_ != nullptr ? optimizer_->ring_slots() : 0; }

  // --- teardown, in the engine's order ---
  void shutdown_gradients();  // drains the gradient copies and passes
  void stop_runner();         // its queued jobs run first
  // The gradient buffers back into the device cache.
  void put_back_buffers(BufferCache<gpu::DeviceBuffer>& cache);

 private:
  // The step under way: micro-batches ended, deferred verdicts' gradient
  // markers posted, its traffic and seconds so far (the fetches' are the
  // fetcher's, the optimizer's and the gradient path's their own).
  struct StepState {
    int micro_step = 0;
    std::int64_t markers = 0;
    StepBytes bytes;
    double grads_s = 0.0;
  };
  // The step's early job (Schedule::early_jobs): its id (0: none yet),
  // whether it is certain and has gradients (updates in place), its constants.
  struct EarlyJob {
    std::int64_t job = 0;
    bool applying_in_place = false;
    std::vector<UpdateConstants> constants;
  };
  // A group's gradient buffer while the framework writes it, and the
  // micro-batch whose gradients arrived.
  struct GroupGradients {
    gpu::DeviceBuffer grad;
    int micro_step = -1;
    // Its trainable parameters without a gradient in the micro-batch under
    // way (no_grads), handed to the gradient path with its grads_ready.
    std::vector<std::size_t> absent;
  };

  StepRules rules() const { return StepRules::of(parts_.config); }
  // Schedule::defers_verdicts: step_end does not wait for the step's last
  // gradients; the step's job takes the verdict behind a gradient marker.
  bool deferred_verdicts() const { return parts_.schedule.defers_verdicts(rules()); }
  // With several ranks too: the job gathers the groups' compute copies in
  // the layout's order whatever order it updates them in (Optimizer::JobRun).
  bool early_jobs() const { return parts_.schedule.early_jobs(rules()); }
  // step_end's checks: the gradients of every trainable group for the last
  // micro-batch, nothing fetched, the last micro-batch.
  core::Status check_step_end() const;
  // The step's verdict and job: taken now (decide), or deferred to the job.
  core::Result<std::unique_ptr<OptimizerJob>> decide(StepStats& stats, bool& applied);
  std::unique_ptr<OptimizerJob> deferred_job(StepStats& stats);
  // The optimizer's traffic and time since the last step_end (and, with
  // deferred verdicts, the last step's gradient path's).
  void take_optimizer_stats(StepStats& stats);
  // The step's own traffic and counts; resets the step under way.
  void finish_stats(StepStats& stats, bool defer);
  // A step's job: the next forward's order (or the backward's, per the
  // schedule), the disk pipeline's depth.
  std::unique_ptr<OptimizerJob> make_job(std::vector<UpdateConstants> constants, std::int64_t step) const;
  // Starts the step's early job (from grads_ready, the first of the step's
  // last micro-batch, or from the last step_end), with the constants of a
  // step that is applied and not clipped. step_end's verdict applies it when
  // the step's constants are exactly those, else stops it.
  core::Status start_early_job();
  // overlap "delayed": the new compute copies the last step's job left go
  // home (after it finished), and device copies of the old ones are dropped.
  core::Status commit_pending(const char* op);

  Parts parts_;
  Verdict verdict_;
  StepState state_;
  EarlyJob early_;
  std::vector<GroupGradients> grads_;
  // Borrowed at start.
  Fetcher* fetcher_ = nullptr;
  ComputeHomes* homes_ = nullptr;
  StateStore* chunks_ = nullptr;
  const nvme::SwapStore* swap_ = nullptr;
  // The step's rooms. The runner's thread works without the engine's lock
  // on what the protocol leaves it: the chunks, the host gradients and the
  // compute homes of groups it has not marked done; fetch, grad_buffer and
  // grads_ready of a group wait for that mark.
  std::unique_ptr<GradientPath> gradients_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<OptimizerRunner> runner_;
};

}  // namespace strata::engine
