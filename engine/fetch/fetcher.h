// Fetcher: the framework's fetch, wait_fetched and release of a group's
// compute copies, and every device copy of them besides the fetched ones:
// the learned fetch sequence, the copies kept since a release (resident) and
// the copies started ahead of a fetch (prefetched). The engine's facade
// checks the call order and delegates here under its lock; the step room
// (engine/step/) asks it for working buffers, the learned sequence (the
// optimizer's orders) and to drop stale copies. Private to engine/.
//
// Stream order (DESIGN.md section 3): fetch with a stream queues the copy on
// the engine's stream and makes the framework's stream wait for it (an
// event); the host returns at once and waits only for the optimizer's last
// job on the group (and reads a home on nvme). Such copies are "unsettled"
// until settle_copies, which whoever writes the compute copies' homes calls
// first (step_end, load_checkpoint, delayed's commit).
//
// Thread-compatible: every call comes under the engine's lock; the
// prefetcher's copies run on its own thread and stream.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/config.h"
#include "engine/fetch/fetch_trace.h"
#include "engine/fetch/prefetcher.h"
#include "engine/fetch/resident_set.h"
#include "engine/internal/launch_order.h"
#include "engine/internal/serial_queue.h"
#include "engine/layout.h"
#include "engine/schedule/schedule.h"
#include "engine/state/copy_lane.h"
#include "engine/step_stats.h"
#include "engine/trace.h"
#include "gpu/device.h"
#include "partition/communicator.h"

namespace strata::engine {

class ComputeHomes;
class GradientPath;
class OptimizerRunner;
template <typename Buffer>
class BufferCache;

class Fetcher {
 public:
  // What it works with, borrowed (the engine owns them and outlives it).
  struct Parts {
    const Layout& layout;
    const Config& config;  // zero.stage3_*: the prefetch bucket, the live room, persistence
    const Schedule& schedule;
    gpu::Device& device;
    ComputeHomes& homes;
    OptimizerRunner& runner;    // fetch and prefetch wait for its mark on the group
    GradientPath& gradients;    // passes in flight hold device buffers (allocate_working)
    BufferCache<gpu::DeviceBuffer>& device_cache;
    BufferCache<gpu::PinnedBuffer>& pinned_cache;
    Trace& trace;
    gpu::Stream& stream;  // the framework's calls' copies (the engine's stream)
    // Stage 3 over ranks with the collectives on the device: the
    // communicator of device buffers the fetches gather over (the
    // framework's thread's); null: they gather in host memory.
    partition::Communicator* device_ranks = nullptr;
    LaunchOrder* launch_order = nullptr;  // with device_ranks: the rank's launches' order
    // Stage 3 over ranks, threaded schedules: the communicators the
    // prefetches gather over, on a thread of their own (host; device, with
    // device_ranks); null: no prefetch at stage 3 over ranks.
    partition::Communicator* prefetch_ranks = nullptr;
    partition::Communicator* device_prefetch_ranks = nullptr;
  };
  // The prefetcher only under a threaded schedule (its thread and stream).
  static core::Result<std::unique_ptr<Fetcher>> create(const Parts& parts);
  // Puts the fetched buffers back into the device cache (fenced by the copy
  // into them); call stop() first.
  ~Fetcher();
  Fetcher(const Fetcher&) = delete;
  Fetcher& operator=(const Fetcher&) = delete;

  // What the framework's fetches did since the last take_totals: their
  // traffic and seconds, and how many a prefetched or a resident copy served.
  struct Totals {
    StepBytes bytes;
    double fetch_s = 0.0;
    std::int64_t prefetched = 0;
    std::int64_t resident = 0;
    std::uint64_t resident_bytes = 0;
    std::uint64_t resident_nvme_bytes = 0;
  };
  Totals take_totals() { return std::exchange(totals_, {}); }

  // --- the framework's calls (group g; the facade checked the call order) ---
  // Group g's compute copies on the device: its device home, or a working
  // buffer filled from a resident copy, a prefetched one or a copy queued
  // now. `stream` (null: blocking) as Engine::fetch.
  core::Result<gpu::DeviceSpan> fetch(std::size_t g, gpu::Stream* stream);
  core::Status wait_fetched(std::size_t g);
  core::Status release(std::size_t g, gpu::Stream* used_on);
  bool fetched(std::size_t g) const { return groups_[g].fetched; }
  bool any_fetched() const;
  // The buffer lend_view lends for a fetched group (its device home, or the
  // working copy). kFailedPrecondition naming the group when not fetched.
  core::Result<const gpu::DeviceBuffer*> fetched_buffer(std::size_t g) const;

  // --- for the step and the facade ---
  // A fetch's or gradients' device buffer; when the device budget is short,
  // drops resident copies, waits for the gradient passes in flight (which
  // hold such buffers) and, last, drops the prefetched copies, trying again
  // after each. Fetched copies come from the arena's low end, gradients from
  // its high end (gpu::ArenaEnd).
  core::Result<gpu::DeviceBuffer> allocate_working(std::uint64_t bytes, const std::string& what,
                                                   gpu::ArenaEnd end = gpu::ArenaEnd::kLow);
  // Waits for every copy fetch queued for a framework's stream since the
  // last call: before the compute copies' homes are written (step_end,
  // load_checkpoint, delayed's commit), nothing may still read them.
  core::Status settle_copies();
  // The prefetcher starts the copies the learned sequence says come next.
  void issue_prefetches();
  // Waits for the prefetches in flight (their copies stay): a call that
  // reads the homes itself (read_compute, save_checkpoint) would otherwise
  // find an nvme home's swap block busy, or make that prefetch fail.
  void settle_prefetches();
  // Drops prefetched and resident copies: all (load_checkpoint), or those of
  // groups an optimizer job updates (a copy taken before it is stale).
  void drop_copies(DropCopies which);
  // The fetch sequence: noted by fetch and grad_buffer, learned at step_end
  // (logged when it changed), read for the optimizer's orders.
  FetchTrace& sequence() { return sequence_; }
  const FetchTrace& sequence() const { return sequence_; }
  // Logs a change at info level the first time each of the first
  // kSequencesLoggedAtInfo different sequences is learned, else at debug.
  void learn_sequence();
  static constexpr std::size_t kSequencesLoggedAtInfo = 8;
  // Stops the prefetcher and empties the resident set (the engine's
  // destructor, before the optimizer the prefetches may wait for stops).
  void stop();

 private:
  explicit Fetcher(const Parts& parts);
  // A group's fetched device copy.
  struct Fetched {
    gpu::DeviceBuffer working;           // device copy while fetched (home elsewhere)
    bool fetched = false;
    std::shared_ptr<gpu::Event> landed;  // after the queued copy into `working` (null: complete)
  };
  CopyLane lane() { return {&parts_.stream, &totals_.bytes, TraceTrack::kDevice}; }
  // Whether fetch (and prefetch) of group g waits for the last step's job
  // on it (Schedule::fetch_waits_for_optimizer).
  bool waits_for_optimizer(std::size_t g) const;
  // A fetch of group gp served by a copy kept on the device: counted.
  void count_resident(const GroupPlace& gp, std::uint64_t bytes) {
    ++totals_.resident;
    totals_.resident_bytes += bytes;
    // (What the fetch would have read from the swap drive: the home less a
    // frozen part read from its files.)
    if (gp.compute_tier == Tier::kNvme) totals_.resident_nvme_bytes += parts_.layout.tier_home_bytes(gp);
  }
  // Hands `buffer` to group g as its fetched copy, ordered after `landed`.
  core::Result<gpu::DeviceSpan> hand_over(std::size_t g, gpu::DeviceBuffer buffer,
                                          std::shared_ptr<gpu::Event> landed, gpu::Stream* stream);
  // The copy of group g's compute copies into `dst`, queued on `lane` (a
  // staging buffer, when the home is not pinned, goes back to the cache
  // fenced by the copy); the event after it. Used by fetch and the prefetcher.
  core::Result<std::shared_ptr<gpu::Event>> queue_copy(std::size_t g, gpu::DeviceSpan dst, const CopyLane& lane);
  // The copy of `host` (in `staging`, which goes back to the cache fenced
  // by it) into `dst`, queued on `lane`; the event after it.
  core::Result<std::shared_ptr<gpu::Event>> queue_host(std::span<const std::byte> host, gpu::PinnedBuffer staging,
                                                       gpu::DeviceSpan dst, const CopyLane& lane);
  // fetch at stage 3 over several ranks (Layout::compute_sharded):
  // ComputeHomes::gather with this rank's vote on whether it kept the
  // group's copy since its release (on every fetch whatever the schedule);
  // when every rank did, the kept copy; else the group's shards gathered
  // from every rank into a working buffer (made after the tags); a failure
  // on this rank (the group already fetched, the optimizer's error, no
  // device memory, reading its home) is carried into the gather, so every
  // rank's fetch fails alike.
  core::Result<gpu::DeviceSpan> fetch_gathered(std::size_t g, gpu::Stream* stream);
  // After the copy into f.working (`landed`; null: complete): the framework's
  // `stream` waits for it, noted in `f` and among the unsettled copies; with
  // no stream the host waits. On failure the buffer goes back (fenced).
  core::Status order_after_copy(Fetched& f, std::shared_ptr<gpu::Event> landed, gpu::Stream* stream);
  // Device copies of compute copies now: fetched, prefetched, resident
  // (non-persistent): what stage3_max_live_parameters bounds.
  std::uint64_t fetched_bytes() const;
  std::uint64_t live_bytes() const;

  // Stage 3 over ranks: prefetches gathered over the ranks. Every rank must
  // gather the same groups in the same order, so which groups are gathered
  // follows the learned sequence and the prefetch bucket alone (issued at
  // the same calls on every rank); whether a rank has room is its own, and
  // one without declines in the gather's tags, so that none gathers it (each
  // rank's fetch gathers it then). A gathered copy is kept until its fetch
  // takes it, or drop_copies drops it (calls every rank makes).
  struct Gathered;
  void issue_gathers();
  // The prefetch gather of group g, on the prefetch thread.
  void run_gather(std::size_t g, Gathered& c);
  // Group g's prefetch gather, if one was issued (null: none): waits for
  // it; its error, which every rank's has (the gather fails alike).
  core::Result<std::unique_ptr<Gathered>> take_gathered(std::size_t g);
  void drop_gathered(DropCopies which);
  // Drops the gathers of the groups `drop` names, once each has ended.
  void drop_gathered_if(const std::function<bool(std::size_t)>& drop);

  Parts parts_;
  std::vector<Fetched> groups_;
  FetchTrace sequence_;
  // fetch's copies queued for a framework's stream not yet waited for.
  std::vector<std::shared_ptr<gpu::Event>> unsettled_;
  Totals totals_;
  std::unique_ptr<ResidentSet> resident_;
  std::unique_ptr<Prefetcher> prefetcher_;  // threaded schedules only
  // Stage 3 over ranks (prefetch_ranks): the gathers issued and not yet
  // taken (by group), their thread's stream, its count of gathers, and the
  // thread (last: it stops first).
  std::map<std::size_t, std::unique_ptr<Gathered>> gathering_;
  gpu::Stream gather_stream_;
  std::uint64_t prefetch_gathers_ = 0;
  std::atomic<bool> stopping_{false};  // stop(): the gathers still queued are skipped
  std::unique_ptr<SerialQueue> gather_queue_;
};

}  // namespace strata::engine
