// Engine: the orchestrator of DESIGN.md section 3, in C++ (the C API wraps
// it). strata.overlap picks the schedule: "exact" (the default: gradient
// passes, the optimizer and prefetches on their own threads and streams),
// "speculative" (also nvme optimizer state updated during the backward),
// "delayed" (the one-step delayed update: step N's optimizer runs during
// step N+1, which computes with the weights from before it) or "none"
// (every call does its work before it returns). Without clipping, a loss
// scaler or a non-finite check (strata.nonfinite "apply"), "exact" and
// "speculative" update every group in place as its gradients arrive, during
// the backward; until step_end, calls that would see the step half applied
// (fetch of such a group, read_state, read_compute, set_lr, checkpoints)
// are kFailedPrecondition. Results are bit-identical for every placement
// and for every schedule but "delayed", whose trajectory differs by design
// (DESIGN.md section 6); engine/README.md describes the step.
//
// Call order (anything else is kFailedPrecondition, never a hang):
//   create -> add_optimizer_group* -> register_param+ -> finalize ->
//   per micro-batch: { fetch(g) [ ... forward ... ] release(g) }*,
//                    { fetch(g), grad_buffer(g) [ ... backward writes it ... ],
//                      grads_ready(g), release(g) }* for every trainable group,
//                    micro_step_end()  (or step_end() after the last one)
// Thread-safety: every member function is thread-safe: calls are serialized
// by the engine's lock, so they may come from several threads. The protocol
// above still holds across threads: e.g. a backward thread may call
// grad_buffer/grads_ready for a group while the thread that fetched it goes
// on fetching the next one, but step_end must come after every grads_ready
// of the step has returned (the framework orders those two). Init callbacks
// run without the lock; any call made while finalize runs (from a callback
// or from another thread) is kFailedPrecondition.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/config.h"
#include "engine/internal/launch_order.h"
#include "engine/internal/view_holds.h"
#include "engine/state/copy_lane.h"
#include "core/clock.h"
#include "core/memory_budget.h"
#include "core/mutex.h"
#include "core/numerics.h"
#include "core/result.h"
#include "engine/layout.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/schedule/schedule.h"
#include "engine/step_stats.h"
#include "engine/trace.h"
#include "gpu/device.h"
#include "partition/communicator.h"

namespace strata::adam {
class CpuAdam;
}
namespace strata::nvme {
class SwapStore;
}

namespace strata::engine {

class StateStore;
class ComputeHomes;
class FrozenFiles;
struct ChunkState;
struct CheckpointManifest;
struct SharedDevice;
class ViewHolds;
class Fetcher;
class GradientPath;
class Optimizer;
class OptimizerRunner;
class Step;
class PretrainedWeights;
class SerialQueue;
class CpuTurns;
template <typename Buffer>
class BufferCache;

// Fills a parameter's initial fp32 values (out.size() == numel). Called once
// per parameter at finalize, group by group, on the thread calling finalize,
// without the engine's lock held (calls into the engine fail meanwhile).
using InitFn = std::function<core::Status(std::span<float> out)>;

// A lease on device memory lent to the framework (Engine::lend_view; the C
// API's DLPack tensors). While it lives, the engine neither frees that
// memory nor hands it to anything else: not after release or grads_ready,
// not after the engine is destroyed (the lease then keeps the device and
// the memory alive, and frees it when it ends, after the framework's work
// queued on it by release(group, used_on)). It does not keep the contents:
// a compute copy whose home is the device is that home, which the
// optimizer and load_checkpoint rewrite in place. Destroy it on any thread,
// at any time. Thread-safe.
class ViewLease {
 public:
  ~ViewLease();
  ViewLease(const ViewLease&) = delete;
  ViewLease& operator=(const ViewLease&) = delete;

 private:
  friend class Engine;
  ViewLease(std::shared_ptr<ViewHolds> holds, std::uint64_t buffer_id);
  std::shared_ptr<ViewHolds> holds_;
  std::uint64_t buffer_id_;
};

// What lend_view lends: which of a group's buffers.
enum class ViewKind {
  kCompute,  // the fetched compute copies (fetch's view)
  kGrads,    // the gradient buffer (grad_buffer's)
};
struct LentView {
  gpu::DeviceSpan span;              // as fetch / grad_buffer return it
  std::unique_ptr<ViewLease> lease;  // keeps span's memory (see ViewLease)
};

class Engine {
 public:
  // Errors: the device's or the config's (a budget that cannot be met).
  // Test hook: config.strata.io.fault_injector (C++ only, no config key)
  // sends every I/O of the engine (swap, checkpoints, export, safetensors
  // import, manifests and `latest`) through that fault injector
  // (nvme/fault_injection.h; tests/e2e/fault_test.cpp).
  static core::Result<std::unique_ptr<Engine>> create(const Config& config);
  // One of `ranks.size` data-parallel ranks (DESIGN.md section 10), each an
  // engine in its own process or thread driving the same model on its own
  // micro-batches, with the same config and the same calls in the same
  // order. `ranks` says how they meet (partition/communicator.h: the backend,
  // this rank, the rendezvous); create meets the others (one communicator
  // for the gradient path's host collectives, one for the optimizer's
  // compute copies, and one for the gradients' sums on the device), so every
  // rank must call it. Each rank keeps and updates the optimizer
  // state of its shard of every group (Layout's RankShare) and holds the
  // host gradients of its shards only (zero_optimization.stage 1 and 2
  // alike); a step's
  // gradient is the mean over every rank's micro-batches, as with
  // gradient accumulation (each micro-batch's fp32 gradients summed over
  // the ranks in rank order and reduce-scattered, each rank accumulating its
  // shard only: with one micro-batch per rank, bit for bit what one rank
  // accumulating them in that order forms); the norm is the sum of the block partials
  // in block order, so every rank clips and skips alike; the new compute
  // copies are all-gathered so that every rank holds them whole; at
  // zero_optimization.stage 3 each rank keeps only its shard of them
  // instead, and each fetch gathers the group (layout.h; read_compute is
  // then a call every rank makes). Swap files go under <swap path>/rank-<r>
  // (created). Not yet with several ranks: strata.overlap "speculative"
  // (kUnimplemented). read_state reads this rank's shard: other ranks'
  // elements are NaN; read_compute under "delayed" reads pending copies
  // without committing them. Every rank must register the same parameters with the same
  // initial values (finalize compares their CRC64: kFailedPrecondition
  // naming the rank that differs) and call grads_ready for the same groups
  // in the same order: a step whose sums were paired across groups fails on
  // every rank (kFailedPrecondition) before anything is applied. The ranks
  // meet over the "gloo" backend (kUnimplemented for another with several);
  // each micro-batch's gradients are summed on the device over a third
  // communicator (NCCL on CUDA, Gloo on the host device;
  // strata.device_collectives), only the rank's shard coming down; ranks
  // that would sum in different places fail here (kFailedPrecondition).
  // A rank that fails or leaves makes the others' collectives fail within
  // `ranks.timeout`, naming the collective. ranks.size 1 is create(config).
  static core::Result<std::unique_ptr<Engine>> create(const Config& config,
                                                      const partition::CommunicatorOptions& ranks);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Optimizer groups (per-group weight decay and lr scale); group 0 exists
  // already with the optimizer's weight decay. Returns the new group's index.
  core::Result<int> add_optimizer_group(const OptimizerGroupDesc& group);
  // `init` may be empty: the parameter then takes its initial values from
  // the safetensors files of init_from_safetensors (given before or after).
  // Once they are given, such a parameter is checked here: kNotFound when
  // they hold no tensor for it, kInvalidArgument when its shape differs
  // (nothing is registered then). kFailedPrecondition after finalize.
  core::Status register_param(const ParamDesc& desc, InitFn init);
  // Initial values from safetensors files, before finalize (pretrained
  // weights: the fine-tuning case): every parameter registered without an
  // InitFn takes them from the tensor named `name_prefix` + its name (F32,
  // BF16 or F16, converted exactly to fp32; parameters with an InitFn keep
  // it). `path`: a directory holding model.safetensors.index.json (shards)
  // or model.safetensors, or one safetensors file. Reads the headers now and
  // checks the parameters registered so far (as register_param does);
  // finalize checks that every tensor is some registered parameter's before
  // it allocates anything, then streams the values in group by group through
  // the nvme engine (direct reads; a file is open only while groups still
  // need it). Errors: kFailedPrecondition after finalize or when a source
  // was given already; the files' (kNotFound, kDataLoss, kUnimplemented for
  // another dtype, naming the file); a registered parameter's (nothing
  // changes then).
  core::Status init_from_safetensors(const std::string& path, const std::string& name_prefix);
  // Lays out every state, allocates it in its home tier under the budgets,
  // and writes the initial values (master weights and compute copies).
  // Before anything is allocated: kFailedPrecondition naming a parameter
  // without InitFn when there are no safetensors files; with them,
  // kInvalidArgument naming a tensor that is no parameter's (extra) and its
  // file, and each parameter's check. Once per engine: a failed finalize
  // releases what it built (the swap files and the swap paths' locks, the
  // state) before it returns, and another finalize is kFailedPrecondition
  // naming the first failure (create a new engine); after a successful one,
  // kFailedPrecondition too.
  core::Status finalize();
  // finalize, then load_checkpoint(root), without the initial values the
  // checkpoint replaces: the init callbacks and pretrained files of every
  // group whose parameters all train are neither called nor read, and its
  // state and compute copies are written once, by the load (a resume of a
  // model on nvme writes it once, not twice). Groups with a frozen
  // parameter get their initial values as finalize writes them (a
  // checkpoint may leave out a frozen base, which must then be this
  // engine's). Returns the framework's blob, as load_checkpoint.
  // Before anything is built, on every rank (they agree): the checkpoint is
  // found and its manifest checked (kNotFound, kDataLoss naming the file)
  // and it holds this engine's parameters and compute dtype
  // (kFailedPrecondition naming the first difference; also when the ranks
  // found different checkpoints, or one called finalize). These and
  // finalize's errors are a failed finalize's (create a new engine; look
  // for the checkpoint first to start fresh without one). The load's errors
  // (a damaged state file, another base): the engine stays finalized
  // without values, and every step, fetch, read, save, export and set_lr
  // call is kFailedPrecondition saying so until a load_checkpoint succeeds.
  core::Result<std::vector<std::byte>> finalize_from_checkpoint(const std::string& root);

  // The group's compute copies on the device (compute dtype, the layout's
  // offsets), valid until release(group). `stream`: the framework's stream
  // that will read them; the copy is queued and the stream waits for it (an
  // event), the host does not (it still waits for the optimizer's last job on
  // the group, and reads compute copies whose home is nvme). Null: blocking,
  // the copy is complete when fetch returns.
  core::Result<gpu::DeviceSpan> fetch(std::string_view group, gpu::Stream* stream = nullptr);
  // Blocks until the fetched group's copy is complete (after a fetch with a
  // stream, for a reader on the host). kFailedPrecondition when the group is
  // not fetched.
  core::Status wait_fetched(std::string_view group);
  // `used_on`: the stream the framework's work on the view was queued on;
  // the engine writes the buffer again only after that work (an event).
  // Null: that work is done when this is called.
  core::Status release(std::string_view group, gpu::Stream* used_on = nullptr);
  // A device buffer for the group's gradients, laid out like its compute
  // copies from the group's first trainable slot on (GroupPlace::
  // trainable_compute_begin: the frozen parameters, first in a group, have
  // no slots), gradient_elems() elements; valid until grads_ready.
  core::Result<gpu::DeviceSpan> grad_buffer(std::string_view group);
  // The framework has written the group's gradients (scaled by loss_scale()).
  // `written_on`: the stream the framework wrote them on; the engine's copy
  // waits for that stream's work so far (an event: the host does not block).
  // Null: the writes are complete when this is called.
  core::Status grads_ready(std::string_view group, gpu::Stream* written_on = nullptr);
  // Trainable parameters `params` (names) of `group` got no gradient in the
  // micro-batch under way; their slots in the gradient buffer hold zeros.
  // Called before the group's grads_ready of that micro-batch (again adds to
  // the list). With strata.no_grad "skip" (the default), a parameter without
  // a gradient in every micro-batch of a step is left as it is by that step:
  // its weights, optimizer state and step count (its bias correction counts
  // the steps that updated it), as torch's optimizers skip a parameter whose
  // grad is None; "zero" updates it with the zero gradient. With several
  // ranks a parameter's gradient is the ranks' sum: it is skipped when no
  // rank gave it one (every rank skips the same). Errors:
  // kFailedPrecondition before finalize or once the group's gradients of the
  // micro-batch arrived; kInvalidArgument naming a parameter that is not a
  // trainable one of the group; kNotFound.
  core::Status no_grads(std::string_view group, std::span<const std::string_view> params);
  // The group's compute copies (kCompute: the group must be fetched; the
  // view fetch returned) or its gradient buffer (kGrads: what grad_buffer
  // does, with its errors), lent with a lease (see ViewLease). Errors:
  // kFailedPrecondition naming the group when it is not fetched (kCompute);
  // grad_buffer's (kGrads); kNotFound.
  core::Result<LentView> lend_view(std::string_view group, ViewKind kind);
  core::Status micro_step_end();
  // Ends the step: loss scaling, clipping, the optimizer, new compute copies.
  // kFailedPrecondition while a group is still fetched (the optimizer
  // rewrites compute copies) or gradients are missing.
  core::Result<StepStats> step_end();

  double loss_scale() const;
  // Overrides the schedule's learning rate from the next step on.
  // kFailedPrecondition (nothing changed) while a certain step updates in
  // place (see the top of this file): call it between steps.
  core::Status set_lr(double lr);

  // --- checkpoints (engine/save_load.cpp; format in docs/checkpoints.md) ---
  // Saves the whole training state between steps into <root>/step-<N>/ and
  // then points <root>/latest at it; a save interrupted anywhere leaves the
  // previous checkpoint loadable. First removes the .step-<N>.tmp folders of
  // interrupted saves; last applies strata.checkpoint's retention (logged at
  // info level; a failure there is a warning, the save stands). `blob` is the
  // framework's own state (data loader, RNG), returned by load_checkpoint.
  // Placement-independent: values are stored per parameter, not per chunk or tier.
  // A frozen base read from its safetensors files (strata.frozen_base) is left
  // out, unless strata.checkpoint.keep_base: the manifest names its groups,
  // files and CRC64 (docs/checkpoints.md).
  // Errors: kFailedPrecondition mid-step; I/O errors naming the file.
  core::Status save_checkpoint(const std::string& root, std::span<const std::byte> blob);
  // Loads <root>/latest (or <root> itself when it is a step directory) into
  // this finalized engine, whatever its placement; returns the framework's
  // blob. Every file is checked before anything changes: `latest` and
  // manifest.json carry their own CRC64, the manifest those of the other two.
  // A version-1 checkpoint (no checksum on manifest and pointer) loads with a
  // warning. Errors: kNotFound; kDataLoss naming the file for any flipped bit,
  // truncation or damage in any of them; kFailedPrecondition for a newer
  // format version or a parameter set that differs (naming the first difference),
  // or a checkpoint that left its frozen base out loaded over another base
  // (naming the group, the files and both CRC64s).
  core::Result<std::vector<std::byte>> load_checkpoint(const std::string& root);
  // Writes the current weights (the fp32 masters of trainable parameters,
  // the compute copies of frozen ones) as safetensors in `dtype` into `dir`:
  // one file "model.safetensors", or shards of at most `max_shard_bytes`
  // with model.safetensors.index.json when the weights are larger.
  core::Status export_safetensors(const std::string& dir, Precision dtype, std::uint64_t max_shard_bytes);

  // The layout, device and config never change after finalize (the layout
  // is empty before it): reading them needs no lock.
  const Layout& layout() const { return layout_; }
  gpu::Device& device() { return dev(); }
  const Config& config() const { return config_; }
  // This engine's rank and the run's ranks (create's; never changes).
  RankShare rank_share() const { return ranks_.share; }
  // Where the CPU optimizer's threads run, as finalize chose them (empty
  // before; fixed after, like the layout).
  const CpuThreads& cpu_threads() const { return cpu_threads_; }
  bool finalized() const { return finalized_.load(std::memory_order_acquire); }
  // The budgets this engine charges (use and peak, for reports and tests):
  // device memory, pinned memory, and the disk pipeline's staging ring.
  const core::MemoryBudget& device_budget() const { return shared_device_->device_budget; }
  const core::MemoryBudget& pinned_budget() const { return shared_device_->pinned_budget; }
  const core::MemoryBudget& staging_budget() const { return shared_device_->staging_budget; }
  // Slots in the disk pipeline's staging ring (0 when no state lives on nvme).
  std::size_t staging_slots() const;
  // Writes the timeline so far to strata.trace (also done when the engine is destroyed).
  core::Status flush_trace() const { return trace_.write(); }

  // Test and checkpoint access: the fp32 master weights of a trainable
  // parameter, and its compute copy (as fp32), wherever they live.
  core::Status read_master(std::string_view param, std::span<float> out) { return read_state(param, 0, out); }
  // One of a trainable parameter's optimizer arrays: 0 master, then the
  // optimizer's in OptimizerSpec's order (AdamW: 1 exp_avg, 2 exp_avg_sq;
  // Lion: 1 exp_avg; Adagrad: 1 exp_avg_sq), as fp32 (bf16 moments widened, exactly).
  core::Status read_state(std::string_view param, int which, std::span<float> out);
  // At zero_optimization.stage 3 with several ranks read_compute is a call
  // every rank makes, for the same parameters in the same order (each rank
  // keeps a shard of the compute copies: the group's are gathered).
  core::Status read_compute(std::string_view param, std::span<float> out);
  // The weights of several parameters as a state_dict holds them: a
  // trainable one's fp32 masters, a frozen one's compute copies (as fp32).
  // With several ranks a call every rank makes with the same parameters in
  // the same order: the masters are gathered from the ranks' shards, each
  // fetch group's once (its fp32 trainable part in memory at a time), and a
  // failure on one rank (a name not found, a buffer of another size, other
  // parameters than the others asked for) fails every rank's call, naming
  // it. One rank: read_master and read_compute, parameter by parameter.
  struct WeightRead {
    std::string_view param;
    std::span<float> out;
  };
  core::Status read_weights(std::span<const WeightRead> reads);
  // The learned fetch sequence (group names; empty before the first step_end).
  std::vector<std::string> fetch_sequence() const;
  // The swap directories (Config::swap_paths(); empty before finalize and when
  // nothing lives on nvme): the order of StepBytes::nvme_paths and
  // StepStats::nvme_total.
  std::vector<std::string> swap_paths() const;
  // Bytes moved to and from each swap path since the engine was created
  // (what StepStats::nvme_total counts), now: I/O still in flight (an
  // optimizer job running) adds to it. Empty without a swap store.
  std::vector<SwapPathBytes> swap_traffic() const;

 private:
  explicit Engine(const Config& config);

  // The error for a call made while finalize runs.
  static core::Status finalize_running(const char* op);
  // The *_locked functions are the public ones' bodies, called with mu_ held.
  core::Status read_state_locked(std::string_view param, int which, std::span<float> out);
  // `ready`: the caller's status so far; at stage 3 over several ranks a
  // failure is carried into the gather every rank takes part in.
  core::Status read_compute_locked(std::string_view param, std::span<float> out, core::Status ready = {})
      STRATA_REQUIRES(mu_);

  core::Result<std::size_t> group_index(std::string_view name, const char* op) const;
  gpu::Device& dev() const { return *shared_device_->device; }
  core::Status check_finalized(const char* op) const;
  // kFailedPrecondition naming `op` after a load that failed part-way (torn_load_).
  core::Status check_not_torn(const char* op) const;
  // With several ranks, each rank's outcome of one phase of a call every
  // rank makes (save_checkpoint, load_checkpoint, export_safetensors),
  // gathered on the caller's thread over ranks_.weights (the optimizer's
  // jobs are done by then): every rank calls it after every phase, whatever
  // its own outcome, so none is left waiting. Returns `local` when it
  // failed, else the first failing rank's code with a message naming the
  // rank and `phase`, else OK, with every rank's `payload` in `*payloads`
  // (rank order) when given. With one rank: `local`.
  core::Status agree(const char* op, const char* phase, core::Status local, std::uint64_t payload = 0,
                     std::vector<std::uint64_t>* payloads = nullptr);
  // save_checkpoint's, load_checkpoint's and export_safetensors' parts (engine/save_load.cpp).
  core::Status ready_between_steps(const char* op) STRATA_REQUIRES(mu_);
  core::Status write_state_file(const std::string& path, std::uint64_t* crc);
  core::Status publish_save(const std::string& root, const std::string& name, const std::string& tmp,
                            std::span<const std::uint64_t> state_crcs, std::span<const std::uint64_t> blob_crcs);
  struct CheckpointToLoad;
  core::Status check_checkpoint(const std::string& root, CheckpointToLoad& ck);
  core::Status check_frozen_base(const std::string& dir, const CheckpointManifest& m, CheckpointToLoad& ck);
  // Stage 3 over several ranks: the frozen bases check_frozen_base left for
  // later, each group gathered (a collective every rank takes part in, in
  // the manifest's order) and its base's CRC64 compared.
  core::Status compare_sharded_base(const CheckpointToLoad& ck) STRATA_REQUIRES(mu_);
  core::Status apply_checkpoint(CheckpointToLoad& ck);
  // `into_unwritten`: the state holds no values yet (finalize_from_checkpoint).
  core::Result<std::vector<std::byte>> load_checkpoint_locked(const std::string& root, bool into_unwritten = false)
      STRATA_REQUIRES(mu_);
  // CheckpointToLoad::verify_as_read: each state file's CRC64, taken as the
  // load read it (the rest read now), against the manifest's (kDataLoss);
  // after `first` failed, the files opened so far, a damaged one named as
  // the cause (with `first`), else `first`.
  core::Status check_files_as_read(CheckpointToLoad& ck, core::Status first = core::Status());
  // With several ranks, the first vote of finalize (no `checkpoint`) and of
  // finalize_from_checkpoint (`checkpoint`: the fingerprint of the one it
  // found): every rank started the same way, from the same checkpoint, or
  // kFailedPrecondition naming the ranks; `local` fails every rank.
  core::Status agree_on_start(const char* op, core::Status local, std::optional<std::uint64_t> checkpoint);
  // finalize_from_checkpoint: group g's initial values are left to the
  // checkpoint (every parameter of it trains).
  bool values_left_to_checkpoint(std::size_t g) const;
  // Group g's fp32 masters gathered from every rank's shard (its trainable
  // part, padding included); a failure reading this rank's own goes to
  // `local` (zeros sent instead), the collective's is returned.
  core::Status gather_masters(const char* op, std::size_t g, std::vector<float>& out, core::Status& local);
  // Stage 3 over several ranks: group g's compute copies whole (each rank's
  // pending copy where one waits) in `staging`, `whole` viewing them; a
  // failure in `local` is carried into the gather every rank takes part in,
  // and one there becomes `local` (`whole` then empty).
  void gather_compute(std::size_t g, gpu::PinnedBuffer& staging, std::span<std::byte>& whole, core::Status& local)
      STRATA_REQUIRES(mu_);
  // True when no micro-batch is under way: nothing fetched, no gradients pending.
  bool between_steps() const STRATA_REQUIRES(mu_);
  // Where device copies go and whose bytes they count (engine/state/copy_lane.h):
  // the framework's calls use the step's lane (stream_, the step's bytes);
  // the gradient path, the optimizer's jobs and the prefetcher have their
  // own, so they run side by side.
  using Lane = CopyLane;
  // The framework's calls' lane: the engine's stream, the step's bytes.
  Lane step_lane();
  // finalize's parts: every parameter without an init callback has a tensor
  // in the safetensors files (and every tensor a parameter); the budgets
  // checked against what the layout and the schedule need (the numbers in
  // the errors); the swap store for what lives on nvme; every parameter's
  // initial values, group by group; last,
  // the step's rooms (the optimizer with the disk pipeline, its runner) and
  // the fetcher, handed to the step (`ring_room`: the pinned memory the
  // staging ring may take).
  struct Needs {
    TierBytes tiers;            // state per tier, with the schedule's extra memory
    std::string nvme_why;       // " (with ...)": the schedule's extra on nvme, for messages
    std::uint64_t ring_room = 0;  // pinned memory left to the staging ring
    // What strata.budgets.pinned leaves beyond everything above with the
    // ring at its depth: what offload_param.max_in_cpu "auto" fills.
    std::uint64_t pinned_spare = 0;
  };
  // finalize's body; on failure finalize releases what it built.
  core::Status finalize_locked() STRATA_REQUIRES(mu_);
  // What finalize builds before the initial values, and where its time went.
  struct Prepared {
    Needs needs;
    std::unique_ptr<GradientPath> gradients;
    double planned_s = 0.0, state_s = 0.0, zero_s = 0.0, homes_t0 = 0.0;
  };
  core::Status finalize_prepare(const core::Stopwatch& total, Prepared& out) STRATA_REQUIRES(mu_);
  void release_after_failed_finalize() STRATA_REQUIRES(mu_);
  core::Status check_initial_values() const STRATA_REQUIRES(mu_);
  core::Result<Needs> check_budgets() const STRATA_REQUIRES(mu_);
  core::Status open_swap_store(const Needs& needs) STRATA_REQUIRES(mu_);
  // *sources_s: the seconds spent in the init callbacks and reading pretrained files.
  // *fingerprint: with several ranks, the CRC64 of every parameter's initial
  // fp32 values in group order (check_same_start compares it across ranks).
  core::Status write_initial_values(double* sources_s, std::uint64_t* fingerprint) STRATA_REQUIRES(mu_);
  // `written`: this rank's write_initial_values' outcome, or a failure of what
  // comes before them, every rank agreeing on it first.
  core::Status check_same_start(core::Status written, std::uint64_t fingerprint) STRATA_REQUIRES(mu_);
  // The step's rooms built (build_step: the optimizer with its ring, its
  // runner, the fetcher), every rank's `ready` (the initial values' outcome)
  // and theirs voted on with the fingerprint (check_same_start), then handed
  // to the step.
  core::Status start_step(std::unique_ptr<GradientPath> gradients, std::uint64_t ring_room, core::Status ready,
                          std::uint64_t fingerprint) STRATA_REQUIRES(mu_);
  core::Status build_step(GradientPath& gradients, std::uint64_t ring_room, std::unique_ptr<Optimizer>& optimizer,
                          std::unique_ptr<OptimizerRunner>& runner, std::unique_ptr<Fetcher>& fetcher)
      STRATA_REQUIRES(mu_);
  // Blocking copies on a lane (the step's by default).
  core::Status copy_h2d(gpu::DeviceSpan dst, std::span<const std::byte> src, const Lane& lane) {
    return lane_h2d(dev(), trace_, lane, dst, src);
  }
  core::Status copy_d2h(std::span<std::byte> dst, gpu::DeviceSpan src, const Lane& lane) {
    return lane_d2h(dev(), trace_, lane, dst, src);
  }
  core::Status copy_h2d(gpu::DeviceSpan dst, std::span<const std::byte> src) { return copy_h2d(dst, src, step_lane()); }
  core::Status copy_d2h(std::span<std::byte> dst, gpu::DeviceSpan src) { return copy_d2h(dst, src, step_lane()); }

  // Host views of a pinned or nvme chunk's state; `stage` receives the staging
  // copy an nvme chunk needs (pass it to StateStore::store to write back).
  core::Result<ChunkState> load_host_chunk(std::size_t c, gpu::PinnedBuffer& stage);
  // Runs fn over every chunk of group g with host views of its state (device
  // chunks through a host copy); with WriteBack::kYes, the views are written
  // home afterwards. WriteBack::kWhole: fn writes every element of every
  // chunk (a checkpoint's load), so nothing is read: the views start zeroed
  // (padding stays zero, as finalize leaves it; a pinned chunk's own memory
  // as it is), then they are written home.
  enum class WriteBack { kNo, kYes, kWhole };
  core::Status visit_group_state(std::size_t g, WriteBack write_back,
                                 const std::function<core::Status(const ChunkPlace&, ChunkState&)>& fn);

  // What the engine is (never changes after finalize; read without the lock).
  Config config_;
  // The data-parallel ranks (create): this rank's share, and with several
  // the communicators of the gradient path (its pass thread) and of the
  // optimizer's jobs, which outlive the rooms that use them.
  struct Ranks {
    RankShare share;
    int local_rank = 0, local_ranks = 1;  // among this machine's ranks (the CPU optimizer's cores are split)
    std::unique_ptr<partition::Communicator> grads, weights;
    // The collectives on the device (strata.device_collectives; null: on the
    // host): the gradients' sums (the gradient path's copy thread's) and, at
    // stage 3, the fetches' gathers (the framework's thread's).
    std::unique_ptr<partition::Communicator> device, device_fetches;
    // Stage 3 under a threaded schedule: the prefetch gathers' (their
    // thread's; on the host, and with the collectives on the device there).
    std::unique_ptr<partition::Communicator> prefetches, device_prefetches;
    // With them: the order their collectives are launched in, every rank's alike.
    std::unique_ptr<LaunchOrder> launch_order;
  };
  Ranks ranks_;
  // Set (with mu_ held) when a load_checkpoint failed after it began
  // replacing the state, on this rank or another: the state is part old,
  // part new (and with ranks may differ between them), so training, saving
  // and exporting are refused until a load succeeds.
  std::string torn_load_;
  // strata.overlap: what the step does in its mode (engine/schedule/).
  const Schedule& schedule_;
  // What was registered before finalize.
  struct Registry {
    std::vector<ParamDesc> params;
    std::vector<InitFn> inits;  // empty: from `pretrained`
    std::unique_ptr<PretrainedWeights> pretrained;  // init_from_safetensors' files (null: none)
    std::vector<OptimizerGroupDesc> optimizer_groups;
  };
  Registry registry_ STRATA_GUARDED_BY(mu_);
  Layout layout_;
  CpuThreads cpu_threads_;  // set by finalize with cpu_adam_
  std::atomic<bool> finalized_{false};

  // Serializes every public call (see the thread-safety note at the top).
  // finalize lets go of it around each init callback, with finalizing_ set.
  mutable core::Mutex mu_;
  bool finalizing_ STRATA_GUARDED_BY(mu_) = false;
  // A failed finalize's message (empty: none failed); another finalize is refused.
  std::string finalize_failure_ STRATA_GUARDED_BY(mu_);
  // Set by finalize_from_checkpoint: the initial values of the groups whose
  // parameters all train are the checkpoint's to write.
  bool values_from_checkpoint_ = false;
  // Destruction order: everything holding device memory or swap blocks
  // before the device, the swap store and the budgets. The device and its
  // two budgets live in shared_device_, shared with the leases of lent views
  // (holds_), which may outlive the engine.
  std::shared_ptr<SharedDevice> shared_device_;
  std::shared_ptr<ViewHolds> holds_;  // leases of lent views (engine/internal/view_holds.h)
  std::unique_ptr<nvme::SwapStore> swap_;
  // The rank-<r> swap folders finalize created (several ranks), removed
  // with the engine when empty.
  std::vector<std::string> made_swap_dirs_;
  std::unique_ptr<adam::CpuAdam> cpu_adam_;
  // cpu_adam is one call at a time: gradient passes first, Adam in slices
  // between them (engine/internal/cpu_turns.h).
  std::unique_ptr<CpuTurns> cpu_turns_;
  gpu::Stream stream_;  // the framework's calls' copies
  // Buffers the step asks for again and again, kept for reuse (their
  // budgets still count them; a refused allocation empties the caches).
  std::unique_ptr<BufferCache<gpu::DeviceBuffer>> device_cache_;
  std::unique_ptr<BufferCache<gpu::PinnedBuffer>> pinned_cache_;
  // The state in its tiers (engine/state/): each chunk's master and
  // moments, each group's compute copies.
  std::unique_ptr<StateStore> state_;
  // The frozen parameters read from their safetensors files (null: none;
  // strata.frozen_base), which homes_ borrows.
  std::unique_ptr<FrozenFiles> frozen_files_;
  std::unique_ptr<ComputeHomes> homes_;
  // The training step (engine/step/step.h): the verdict, the step under
  // way, the early job, each group's gradient buffer, and the step's rooms
  // (the gradient path, the optimizer with the disk pipeline, its runner).
  // Created with the engine; finalize hands it the rooms.
  std::unique_ptr<Step> step_;
  // fetch, release and the device copies of compute copies (engine/fetch/):
  // the learned fetch sequence, resident and prefetched copies.
  std::unique_ptr<Fetcher> fetcher_;
  Trace trace_;
};

}  // namespace strata::engine
