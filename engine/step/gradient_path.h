// GradientPath: a group's gradients from the device buffer the framework
// wrote to the host gradients the optimizer reads. For each grads_ready:
//   copy down  (device -> pinned staging, compute dtype, compute layout)
//   packing    (into the trainable layout: frozen parameters' slots dropped)
//   pass       (cpu_adam's gradient pass: into the host gradients, kept in
//               the compute dtype with one micro-batch per step, accumulated
//               in fp32 otherwise; each norm block's partial; the inf/NaN flag)
//   ranks      (several data-parallel ranks, every micro-batch: the
//               group's fp32 gradients are summed over the ranks, rank r's
//               shard to rank r (reduce-scatter, rank order on the host
//               libraries), and passed into the rank's host gradients, which
//               hold its shards only (accumulated over the micro-batches);
//               after the last one the shard's block partials and flag, then
//               every rank's gathered, so that each holds the whole group's.
//               Summed on the device (RankShare::device_collectives): the copy
//               packs the trainable part into fp32 in a device buffer kept
//               for it, reduce-scatters it there and copies the rank's shard
//               down (4 x shard bytes instead of the part in compute bytes);
//               else the pass writes the group's fp32 gradients into staging
//               and they are summed on the host)
// Threaded (every schedule but "none"), the copy runs on the gradient thread
// and its own stream and posts the pass to the pass thread, so the next
// group's copy overlaps this group's pass; submit() returns at once and
// wait() waits for both. A pass takes cpu_adam as an urgent turn (CpuTurns):
// the backward waits for it, the optimizer's Adam slices do not. The first
// failure is sticky: later copies and passes are skipped, and every wait
// reports it. Markers (deferred verdicts, overlap "delayed") ride behind the
// passes submitted before them and take the norm and the flag when those
// are done. Thread-safe. Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "core/result.h"
#include "cpu_adam/cpu_adam.h"
#include "engine/config.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/cpu_turns.h"
#include "engine/internal/launch_order.h"
#include "engine/internal/serial_queue.h"
#include "engine/layout.h"
#include "engine/state/copy_lane.h"
#include "gpu/device.h"
#include "partition/communicator.h"

namespace strata::engine {

class GradientPath {
 public:
  // What the path works with (borrowed; they outlive it).
  struct Parts {
    const Layout& layout;
    Precision precision;
    gpu::Device& device;
    adam::CpuAdam& cpu_adam;
    CpuTurns& turns;
    BufferCache<gpu::DeviceBuffer>& device_cache;  // gradient buffers go back here
    BufferCache<gpu::PinnedBuffer>& pinned_cache;
    Trace& trace;
    CopyLane inline_lane;  // unthreaded: the copies' lane (the step's)
    // Several data-parallel ranks: the communicator this path alone uses
    // (null: one rank), and the micro-batches per step, after the last of
    // which each group's gradients are summed over the ranks.
    partition::Communicator* ranks = nullptr;
    std::int64_t micro_steps = 1;
    // With layout.share.sums_on_device: the communicator of device buffers
    // (NCCL on CUDA, Gloo on the host device) the copies sum over.
    partition::Communicator* device_ranks = nullptr;
    // With device_ranks: the order the rank's collectives on the device are
    // launched in (a sum takes its ticket in submit, in the framework's
    // call order).
    LaunchOrder* launch_order = nullptr;
  };
  static core::Result<std::unique_ptr<GradientPath>> create(const Parts& parts, bool threaded);
  ~GradientPath();  // waits for the copies and passes posted
  GradientPath(const GradientPath&) = delete;
  GradientPath& operator=(const GradientPath&) = delete;

  bool threaded() const { return grads_queue_ != nullptr; }
  // The host gradients: the trainable layout, layout.grad_bytes each; with
  // several ranks only the rank's shards, one after another (shard_grads).
  std::byte* host_grads() { return grads_.data(); }
  // Where group g's shard (GroupPlace::shard_begin; the whole group with one
  // rank) starts in the host gradients.
  std::byte* shard_grads(std::size_t g) {
    return grads_.data() + shard_at_[g] * static_cast<std::int64_t>(parts_.layout.grad_bytes);
  }

  // Runs on the pass thread right before group g's pass (its error fails the
  // pass: e.g. waiting for the optimizer's job that still reads g's host
  // gradients), and right after a pass that succeeded.
  using BeforePass = std::function<core::Status()>;
  using AfterPass = std::function<void()>;
  // grads_ready: group g's gradients in `grad`, written by the framework's
  // work before `written` (null: done). Unthreaded, all of it here; threaded,
  // posted (the buffer goes back to the device cache after its copy).
  core::Status submit(std::size_t g, gpu::DeviceBuffer grad, std::shared_ptr<gpu::Event> written, int micro_step,
                      BeforePass before, AfterPass after);
  // Waits for every copy and pass submitted so far: their first error,
  // annotated with `op`.
  core::Status wait(const char* op);
  // grad_buffer(g): waits until every copy of g's gradients submitted so far
  // is down (so the framework runs at most one step ahead, with one gradient
  // buffer per group), and until the gradients still on their way to the
  // host gradients (submitted, their pass not done) leave room for g's
  // within `room_elems` elements of compute copies
  // (zero_optimization.reduce_bucket_size; one other group's always fits):
  // with equal groups the device then holds at most max(2, room_elems /
  // group) gradient buffers, and the host as many groups' staging besides
  // the one packed for its pass. The path's error, naming `group`.
  core::Status wait_down(std::size_t g, std::string_view group,
                         std::int64_t room_elems = std::numeric_limits<std::int64_t>::max());

  // The framework's word that `params` of group g got no gradient in
  // micro-batch `micro_step` (Engine::no_grads; their slots hold zeros),
  // called for every micro-batch of every trainable group (an empty list:
  // each had one), where that micro-batch's pass starts: on the pass thread
  // once the last job's update of g is done, or inline (unthreaded). The
  // counts start again at micro-batch 0. With several ranks a parameter's
  // gradient is the sum over every rank's: it got none only if no rank gave
  // it one, which the last micro-batch's gather of the norm partials settles
  // (reduce_over_ranks), so that every rank skips the same parameters.
  void note_absent(std::size_t g, int micro_step, std::span<const std::size_t> params);
  // Whether `param` got no gradient in any micro-batch of the step whose
  // gradients the host gradients hold: read by the optimizer's job for that
  // step, after the group's gradients are in.
  bool no_gradient(std::size_t param) const {
    return absent_[param] >= parts_.micro_steps && parts_.micro_steps > 0;
  }

  // After wait(): the step's raw norm (the square root of the block
  // partials' sum, in block order) and its inf/NaN flag, which is cleared.
  double raw_norm() const;
  bool take_nonfinite();
  // After wait(): the copies' traffic and the copies' and passes' seconds
  // since the last take (not those collected by markers).
  struct Totals {
    StepBytes bytes;
    double seconds = 0.0;
  };
  Totals take_totals();

  // Deferred verdicts: marker `seq` (increasing) goes behind every copy and
  // pass submitted so far; once they ran it takes the norm and the flag
  // (clearing it) and collects their totals (take_late_totals).
  void post_marker(std::int64_t seq);
  struct Marker {
    double raw_norm = 0.0;
    bool nonfinite = false;
  };
  // Waits for marker `seq`: the path's error (naming `norm_step`), or
  // kCancelled once the path is closed before it passed.
  core::Result<Marker> wait_marker(std::int64_t seq, std::int64_t norm_step);
  Totals take_late_totals();
  // No marker will pass any more: wakes their waiters (the engine closing).
  void close();
  // Runs what was posted, stops both threads and closes: the engine's
  // destructor, before the optimizer's jobs (which read the host gradients
  // and may wait for markers) stop. Submitting afterwards is a bug.
  void shutdown();

 private:
  GradientPath(const Parts& parts, gpu::PinnedBuffer grads, std::size_t blocks);
  bool sums_on_device() const { return parts_.device_ranks != nullptr; }
  core::Result<gpu::PinnedBuffer> copy_down(std::size_t g, const gpu::DeviceBuffer& grad, const CopyLane& lane,
                                            LaunchOrder::Turn& turn);
  // Summed on the device: the trainable part of `grad` packed into fp32 in
  // sums_, reduce-scattered there (launched in `turn`), the rank's shard of
  // the sum copied down.
  core::Result<gpu::PinnedBuffer> sum_down(std::size_t g, const gpu::DeviceBuffer& grad, const CopyLane& lane,
                                           LaunchOrder::Turn& turn);
  core::Status pass(std::size_t g, gpu::PinnedBuffer wire, int micro_step);
  // Several ranks, summed on the host: the group's fp32 gradients of this
  // micro-batch in `local` (the trainable layout) summed over the ranks into
  // the rank's shard, then pass_sum.
  core::Status reduce_over_ranks(std::size_t g, const std::byte* local, int micro_step);
  // Several ranks: the rank's shard of this micro-batch's sum over the
  // ranks (fp32, or bf16: communication_data_type) passed into its host gradients (accumulated after the first
  // micro-batch), and after the last one every rank's partials and flag
  // gathered.
  core::Status pass_sum(std::size_t g, const std::byte* sum, adam::ElemType sum_type, int micro_step);
  void fail(const core::Status& s);
  // A submitted group's gradients are through their pass (or given up).
  void passed(std::int64_t elems);

  Parts parts_;
  gpu::PinnedBuffer grads_;            // host gradients (see host_grads)
  std::vector<std::int64_t> shard_at_;  // per group: its shard's first element in grads_
  // Summed on the device: the largest group's trainable part in fp32 (the
  // copies', one group at a time), reduce-scattered in place.
  gpu::DeviceBuffer sums_;
  // Several ranks: FNV-1a of the (group, micro-batch) sums so far (pass thread).
  std::uint64_t sequence_hash_ = 0xcbf29ce484222325ull;
  std::vector<double> norm_partials_;  // per norm block of the trainable space
  // Per parameter: the step's micro-batches without its gradient (note_absent).
  std::vector<std::int64_t> absent_;
  bool nonfinite_ = false;             // the passes' (pass thread, or after wait)
  // Threaded: the two threads and the copies' stream; the copies' traffic
  // and both threads' seconds, read after wait() or by a marker.
  std::unique_ptr<SerialQueue> grads_queue_;
  std::unique_ptr<SerialQueue> pass_queue_;
  gpu::Stream stream_;
  StepBytes bytes_;
  double copy_seconds_ = 0.0;
  double pass_seconds_ = 0.0;

  core::Mutex mu_;
  core::CondVar cv_;
  std::vector<std::int64_t> posted_ STRATA_GUARDED_BY(mu_);  // per group: copies submitted
  std::vector<std::int64_t> down_ STRATA_GUARDED_BY(mu_);    // per group: copies done (or given up)
  // Groups' gradients submitted whose pass is not done: how many, and their elements.
  std::int64_t in_flight_ STRATA_GUARDED_BY(mu_) = 0;
  std::int64_t in_flight_elems_ STRATA_GUARDED_BY(mu_) = 0;
  int copies_in_flight_ STRATA_GUARDED_BY(mu_) = 0;          // copies down whose buffer is held
  core::Status error_ STRATA_GUARDED_BY(mu_);                // the first failure
  std::int64_t marker_done_ STRATA_GUARDED_BY(mu_) = 0;
  Marker marker_ STRATA_GUARDED_BY(mu_);
  Totals late_ STRATA_GUARDED_BY(mu_);
  bool closed_ STRATA_GUARDED_BY(mu_) = false;
};

}  // namespace strata::engine
