// Fetcher: fetch, wait_fetched, release, the working buffers they take, and
// the device copies besides the fetched ones (engine/fetch/fetcher.h).
#include "engine/fetch/fetcher.h"

#include <cstdint>
#include <utility>

#include "core/logging.h"
#include "core/mutex.h"
#include "core/str.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/done_latch.h"
#include "engine/internal/engine_util.h"
#include "engine/state/compute_homes.h"
#include "engine/step/gradient_path.h"
#include "engine/step/optimizer_runner.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

// A prefetch gather issued (Fetcher::issue_gathers): this rank's room for
// the group (`buffer`, empty: it declines), its turn among the launches on
// the device, and the outcome, written on the prefetch thread.
struct Fetcher::Gathered {
  gpu::DeviceBuffer buffer;
  std::shared_ptr<gpu::Event> fence;  // the framework's last work on `buffer` (null: none)
  std::uint64_t bytes = 0;            // the group's compute copies
  std::unique_ptr<LaunchOrder::Turn> turn;
  DoneLatch done;
  // Written by the prefetch thread, read after done: every rank gathered it.
  bool gathered = false;
  std::shared_ptr<gpu::Event> landed;
  StepBytes traffic;
};

core::Result<std::unique_ptr<Fetcher>> Fetcher::create(const Parts& parts) {
  std::unique_ptr<Fetcher> f(new Fetcher(parts));
  // A sharded group's copy is gathered over the ranks, in an order every
  // rank shares: prefetched on a thread of its own that gathers the groups
  // the learned sequence names (issue_gathers), fetched on the caller's.
  if (!parts.schedule.threaded()) return f;
  if (parts.layout.compute_sharded) {
    if (parts.prefetch_ranks == nullptr) return f;
    STRATA_ASSIGN_OR_RETURN(f->gather_stream_, parts.device.create_stream("prefetch gathers"));
    f->gather_queue_ = std::make_unique<SerialQueue>();
    return f;
  }
  const auto cb = static_cast<std::uint64_t>(parts.layout.compute_bytes);
  Fetcher* self = f.get();
  STRATA_ASSIGN_OR_RETURN(
      f->prefetcher_,
      Prefetcher::create(parts.device, parts.layout,
                         static_cast<std::uint64_t>(parts.config.zero.stage3_prefetch_bucket_size) * cb,
                         parts.device_cache,
                         [self](std::size_t g, gpu::DeviceSpan dst, gpu::Event* fence,
                                CopyLane lane) -> core::Result<std::shared_ptr<gpu::Event>> {
                           const Parts& p = self->parts_;
                           // A prefetch never copies a stale compute copy.
                           Status s = self->waits_for_optimizer(g) ? p.runner.wait_group(g, "prefetch") : Status();
                           if (s.ok() && fence != nullptr) s = p.device.wait(*lane.stream, *fence);
                           if (!s.ok()) return s;
                           TraceScope t(p.trace, TraceTrack::kPrefetch, str_cat("prefetch ", p.layout.groups[g].name),
                                        dst.size_bytes());
                           return self->queue_copy(g, dst, lane);
                         }));
  return f;
}

Fetcher::Fetcher(const Parts& parts) : parts_(parts), groups_(parts.layout.groups.size()) {
  const auto cb = static_cast<std::uint64_t>(parts.layout.compute_bytes);
  resident_ = std::make_unique<ResidentSet>(parts.layout, parts.config.zero.stage3_param_persistence_threshold,
                                            static_cast<std::uint64_t>(parts.config.zero.stage3_max_live_parameters) * cb,
                                            parts.device_cache);
}

Fetcher::~Fetcher() {
  stop();
  for (Fetched& f : groups_) {  // a fetch's copy may still be writing it
    parts_.device_cache.put(std::move(f.working), f.landed);
    f.working.reset();
  }
}

void Fetcher::stop() {
  prefetcher_.reset();
  if (gather_queue_ != nullptr) {
    stopping_ = true;
    gather_queue_->drain().ignore_error();  // the gathers end (their collectives on every rank)
    drop_gathered(DropCopies::kAll);
    gather_queue_.reset();
  }
  resident_.reset();
}

bool Fetcher::waits_for_optimizer(std::size_t g) const {
  return parts_.schedule.fetch_waits_for_optimizer(parts_.layout.groups[g].compute_tier);
}

core::Result<gpu::DeviceSpan> Fetcher::fetch(std::size_t g, gpu::Stream* stream) {
  const StageTimer timer(totals_.fetch_s);
  const GroupPlace& gp = parts_.layout.groups[g];
  TraceScope t(parts_.trace, TraceTrack::kStep, str_cat("fetch ", gp.name));
  if (parts_.layout.compute_sharded) return fetch_gathered(g, stream);
  if (groups_[g].fetched) {
    return Status::failed_precondition(str_cat("fetch('", gp.name, "'): already fetched; release it first"));
  }
  // The last step's optimizer may still be writing this group's copies
  // (under "delayed" it writes them elsewhere, and the step uses the old).
  if (waits_for_optimizer(g)) {
    STRATA_RETURN_IF_ERROR(parts_.runner.wait_group(g, "fetch"));
  } else {
    STRATA_RETURN_IF_ERROR(parts_.runner.error("fetch"));  // its error, if any
  }
  sequence_.note_fetch(g);
  if (parts_.layout.fetched_in_place(gp)) {
    groups_[g].fetched = true;
    return parts_.homes.device_home(g).span();
  }
  if (std::optional<ResidentSet::Taken> kept = resident_->take(g)) {  // still on the device since its release
    count_resident(gp, kept->buffer.size_bytes());
    // Read again after the release's fence: the fetch's queued copy into it
    // ended before the framework's work that the fence follows.
    return hand_over(g, std::move(kept->buffer), std::move(kept->fence), stream);
  }
  std::optional<Prefetcher::Taken> prefetched;
  if (prefetcher_ != nullptr) {
    STRATA_ASSIGN_OR_RETURN(prefetched, prefetcher_->take(g, totals_.bytes));
  }
  if (prefetched) {
    ++totals_.prefetched;
    return hand_over(g, std::move(prefetched->buffer), std::move(prefetched->landed), stream);
  }
  const std::uint64_t bytes =
      static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(parts_.layout.compute_bytes);
  // Room within stage3_max_live_parameters first, as a prefetch makes it:
  // resident copies used again latest go back to the cache, whose buffer
  // the allocation below then takes.
  resident_->make_room(live_bytes(), bytes, SIZE_MAX, sequence_);
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceBuffer buffer, allocate_working(bytes, str_cat("fetched group '", gp.name, "'")));
  core::Result<std::shared_ptr<gpu::Event>> landed = queue_copy(g, buffer.span(), lane());
  if (!landed.ok()) {
    parts_.device_cache.put(std::move(buffer));
    return std::move(landed).status();
  }
  return hand_over(g, std::move(buffer), std::move(*landed), stream);
}

void Fetcher::issue_gathers() {
  const FetchTrace& trace = sequence_;
  if (gather_queue_ == nullptr || trace.empty()) return;
  // Gathers of groups the step will not fetch again (the fetches left the
  // sequence behind them) go: they would hold their memory and the bucket.
  // The sequence and its cursor are every rank's alike, and so is this.
  drop_gathered_if([&](std::size_t g) { return trace.next_use(g) == SIZE_MAX; });
  const auto cb = static_cast<std::uint64_t>(parts_.layout.compute_bytes);
  const std::uint64_t bucket = static_cast<std::uint64_t>(parts_.config.zero.stage3_prefetch_bucket_size) * cb;
  // Which groups: the sequence's next ones within the bucket, counted from
  // what every rank issued alike (not from what each still holds).
  std::uint64_t ahead = 0;
  for (const auto& [g, c] : gathering_) ahead += c->bytes;
  const std::vector<std::size_t>& seq = trace.learned();
  for (std::size_t i = trace.cursor(); i < seq.size(); ++i) {
    const std::size_t g = seq[i];
    const GroupPlace& gp = parts_.layout.groups[g];
    if (groups_[g].fetched || gathering_.contains(g)) continue;
    const std::uint64_t size = static_cast<std::uint64_t>(gp.compute_elems) * cb;
    if (ahead + size > bucket) break;
    ahead += size;
    auto c = std::make_unique<Gathered>();
    c->bytes = size;
    c->turn = std::make_unique<LaunchOrder::Turn>(parts_.device_prefetch_ranks != nullptr ? parts_.launch_order
                                                                                          : nullptr);
    // This rank's room: within stage3_max_live_parameters (resident copies
    // used again later make room) and the device budget; a rank that keeps
    // the group's copy since its release declines too (its fetch takes it
    // back when every rank kept one).
    if (!resident_->contains(g) &&
        resident_->make_room(live_bytes(), size, i, sequence_) + size <= resident_->max_live_bytes()) {
      core::Result<BufferCache<gpu::DeviceBuffer>::Fenced> b =
          parts_.device_cache.get_fenced(size, str_cat("prefetch of group '", gp.name, "'"));
      if (b.ok()) {
        c->buffer = std::move(b->buffer);
        c->fence = std::move(b->fence);
      }
    }
    Gathered* raw = c.get();
    gathering_[g] = std::move(c);
    gather_queue_->post([this, g, raw] {
      run_gather(g, *raw);
      return Status();  // a failed prefetch fails its fetch, not the queue
    });
  }
}

void Fetcher::run_gather(std::size_t g, Gathered& c) {
  const Parts& p = parts_;
  const GroupPlace& gp = p.layout.groups[g];
  if (stopping_.load()) {
    // The engine closes: no rank's fetch will take it (the others stop too,
    // or their gathers end at their timeout).
    c.turn->done();
    c.done.finish(Status::cancelled("the engine closed before the prefetch gather"));
    return;
  }
  const CopyLane lane{&gather_stream_, &c.traffic, TraceTrack::kPrefetch};
  // A prefetch never gathers a stale compute copy; its writes follow the
  // framework's last work on the buffer.
  Status ready = waits_for_optimizer(g) ? p.runner.wait_group(g, "prefetch") : Status();
  if (ready.ok() && c.fence != nullptr) ready = p.device.wait(gather_stream_, *c.fence);
  TraceScope t(p.trace, TraceTrack::kPrefetch, str_cat("prefetch gather ", gp.name), c.bytes);
  ComputeHomes::FetchVote vote;
  vote.declines = c.buffer.empty();
  vote.may_decline = true;
  vote.host = p.prefetch_ranks;
  vote.gathers = &prefetch_gathers_;
  vote.device = p.device_prefetch_ranks;
  vote.turn = c.turn.get();
  gpu::DeviceBuffer payload;
  if (vote.device != nullptr && !vote.declines) {
    // Every rank's part beside the buffer; without room for it this rank
    // declines (before the tags: a prefetch is not worth failing the fetch).
    const std::uint64_t parts = p.homes.bytes(g) * static_cast<std::uint64_t>(p.layout.share.ranks);
    core::Result<gpu::DeviceBuffer> made =
        p.device_cache.get(parts, str_cat("the ranks' parts of group '", gp.name, "'"));
    if (made.ok()) {
      payload = std::move(made).value();
      vote.dst = c.buffer.span();
      vote.payload = payload.span();
    } else {
      vote.declines = true;
    }
  }
  gpu::PinnedBuffer staging;
  core::Result<std::span<std::byte>> host = p.homes.gather(g, staging, lane, /*pending=*/false, std::move(ready), &vote);
  c.turn->done();  // launched, or given up: the next launch's turn
  Status s;
  if (!host.ok()) {
    // Failed on every rank alike (the gather carries each rank's failure to
    // the others): nothing gathered, and the fetch gathers it itself (and
    // fails, named, should the cause remain).
    STRATA_LOG(kInfo) << "the prefetch gather of group '" << gp.name << "' failed; its fetch gathers it: "
                      << host.status();
  } else if (!vote.declined && !vote.all_kept) {
    if (vote.device != nullptr) {
      c.landed = std::move(vote.landed);
      p.device_cache.put(std::move(payload), c.landed);  // the unpack reads it until the group has landed
    } else {
      core::Result<std::shared_ptr<gpu::Event>> landed = queue_host(*host, std::move(staging), c.buffer.span(), lane);
      if (landed.ok()) c.landed = std::move(*landed);
      else s = std::move(landed).status();
    }
    c.gathered = s.ok();
  }
  p.device_cache.put(std::move(payload));
  c.done.finish(std::move(s));
}

core::Result<std::unique_ptr<Fetcher::Gathered>> Fetcher::take_gathered(std::size_t g) {
  auto it = gathering_.find(g);
  if (it == gathering_.end()) return std::unique_ptr<Gathered>();
  std::unique_ptr<Gathered> c = std::move(it->second);
  gathering_.erase(it);
  Status s = c->done.wait();
  if (!s.ok() || !c->gathered) {
    // Its buffer goes back once nothing writes it.
    if (c->landed != nullptr) parts_.device.synchronize(*c->landed).ignore_error();
    if (!s.ok()) parts_.device.synchronize(gather_stream_).ignore_error();
    parts_.device_cache.put(std::move(c->buffer), std::move(c->fence));
    if (!s.ok()) return std::move(s).annotate(str_cat("prefetch of group '", parts_.layout.groups[g].name, "'"));
  }
  return c;
}

void Fetcher::drop_gathered(DropCopies which) {
  drop_gathered_if([&](std::size_t g) {
    return which != DropCopies::kUpdated || parts_.layout.groups[g].chunk_count > 0;  // frozen: no optimizer writes it
  });
}

void Fetcher::drop_gathered_if(const std::function<bool(std::size_t)>& drop) {
  for (auto it = gathering_.begin(); it != gathering_.end();) {
    if (!drop(it->first)) {
      ++it;
      continue;
    }
    Gathered& c = *it->second;
    c.done.wait().ignore_error();  // its gather (a collective) ends on every rank; then nothing writes the buffer
    if (c.landed != nullptr) parts_.device.synchronize(*c.landed).ignore_error();
    parts_.device.synchronize(gather_stream_).ignore_error();
    parts_.device_cache.put(std::move(c.buffer), std::move(c.fence));
    it = gathering_.erase(it);
  }
}

core::Result<gpu::DeviceSpan> Fetcher::fetch_gathered(std::size_t g, gpu::Stream* stream) {
  const GroupPlace& gp = parts_.layout.groups[g];
  // A prefetch gather of the group: taken when every rank gathered it (its
  // tags said so, the same on every rank), with no further collective.
  if (!groups_[g].fetched) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Gathered> pre, take_gathered(g));
    if (pre != nullptr && pre->gathered) {
      if (Status s = parts_.runner.error("fetch"); !s.ok()) {  // the optimizer's failure, as fetch reports it
        if (pre->landed != nullptr) parts_.device.synchronize(*pre->landed).ignore_error();
        parts_.device_cache.put(std::move(pre->buffer));
        return s;
      }
      if (std::optional<ResidentSet::Taken> kept = resident_->take(g)) {
        parts_.device_cache.put(std::move(kept->buffer), std::move(kept->fence));
      }
      ++totals_.prefetched;
      totals_.bytes += pre->traffic;
      sequence_.note_fetch(g);
      return hand_over(g, std::move(pre->buffer), std::move(pre->landed), stream);
    }
  }
  // Whatever fails on this rank before the gather is carried into it, so
  // that the others' fetches fail at once too, naming this rank (and a
  // kResourceExhausted reaches every rank alike: a framework that makes
  // room and fetches again does so on every rank).
  Status ready;
  if (groups_[g].fetched) {
    ready = Status::failed_precondition(str_cat("fetch('", gp.name, "'): already fetched; release it first"));
  } else if (waits_for_optimizer(g)) {
    ready = parts_.runner.wait_group(g, "fetch");
  } else {
    ready = parts_.runner.error("fetch");
  }
  // A copy kept since its release (the threaded schedules keep them) is
  // taken back when every rank kept its own (the gather's tags say so): no
  // read of the homes, no payload. Else it goes (its memory to this fetch),
  // and the working buffer is made after the tags: a failure then travels
  // with this rank's part of the payload.
  ComputeHomes::FetchVote vote;
  vote.kept = ready.ok() && resident_->contains(g);
  vote.device = parts_.device_ranks;
  vote.order = parts_.launch_order;
  gpu::DeviceBuffer buffer, payload;
  vote.prepare = [&]() -> Status {
    if (std::optional<ResidentSet::Taken> kept = resident_->take(g)) {
      parts_.device_cache.put(std::move(kept->buffer), std::move(kept->fence));
    }
    const std::uint64_t bytes =
        static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(parts_.layout.compute_bytes);
    // Room within stage3_max_live_parameters first, as fetch makes it.
    resident_->make_room(live_bytes(), bytes, SIZE_MAX, sequence_);
    STRATA_ASSIGN_OR_RETURN(buffer, allocate_working(bytes, str_cat("fetched group '", gp.name, "'")));
    if (vote.device != nullptr) {
      // Every rank's home, gathered on the device, then unpacked into the buffer.
      const std::uint64_t parts = parts_.homes.bytes(g) * static_cast<std::uint64_t>(parts_.layout.share.ranks);
      STRATA_ASSIGN_OR_RETURN(payload, allocate_working(parts, str_cat("the ranks' parts of group '", gp.name, "'")));
      vote.dst = buffer.span();
      vote.payload = payload.span();
    }
    return Status();
  };
  gpu::PinnedBuffer staging;
  core::Result<std::span<std::byte>> host =
      parts_.homes.gather(g, staging, lane(), /*pending=*/false, std::move(ready), &vote);
  if (!host.ok()) {
    parts_.device_cache.put(std::move(buffer));
    parts_.device_cache.put(std::move(payload));
    return std::move(host).status();
  }
  if (vote.all_kept) {
    std::optional<ResidentSet::Taken> kept = resident_->take(g);
    STRATA_CHECK(kept.has_value()) << "fetch('" << gp.name << "'): every rank kept it, this one has no copy";
    count_resident(gp, kept->buffer.size_bytes());
    sequence_.note_fetch(g);
    return hand_over(g, std::move(kept->buffer), std::move(kept->fence), stream);
  }
  sequence_.note_fetch(g);
  if (vote.device != nullptr) {
    // The unpack reads the payload until the group has landed.
    parts_.device_cache.put(std::move(payload), vote.landed);
    return hand_over(g, std::move(buffer), std::move(vote.landed), stream);
  }
  core::Result<std::shared_ptr<gpu::Event>> landed = queue_host(*host, std::move(staging), buffer.span(), lane());
  if (!landed.ok()) {
    parts_.device_cache.put(std::move(buffer));
    return std::move(landed).status();
  }
  return hand_over(g, std::move(buffer), std::move(*landed), stream);
}

core::Result<gpu::DeviceSpan> Fetcher::hand_over(std::size_t g, gpu::DeviceBuffer buffer,
                                                 std::shared_ptr<gpu::Event> landed, gpu::Stream* stream) {
  Fetched& f = groups_[g];
  f.working = std::move(buffer);
  STRATA_RETURN_IF_ERROR(order_after_copy(f, std::move(landed), stream));
  f.fetched = true;
  issue_prefetches();
  return f.working.span();
}

core::Result<std::shared_ptr<gpu::Event>> Fetcher::queue_copy(std::size_t g, gpu::DeviceSpan dst,
                                                              const CopyLane& lane) {
  gpu::PinnedBuffer staging;  // compute copies whose home is not pinned pass through it
  core::Result<std::span<std::byte>> host = parts_.homes.load(g, staging, lane);
  if (!host.ok()) {
    parts_.pinned_cache.put(std::move(staging));
    return std::move(host).status();
  }
  return queue_host(*host, std::move(staging), dst, lane);
}

core::Result<std::shared_ptr<gpu::Event>> Fetcher::queue_host(std::span<const std::byte> host,
                                                              gpu::PinnedBuffer staging, gpu::DeviceSpan dst,
                                                              const CopyLane& lane) {
  core::Result<std::shared_ptr<gpu::Event>> landed = lane_h2d_queued(parts_.device, parts_.trace, lane, dst, host);
  if (!landed.ok()) {
    parts_.device.synchronize(*lane.stream).ignore_error();  // nothing may still read the staging
    parts_.pinned_cache.put(std::move(staging));
    return landed;
  }
  parts_.pinned_cache.put(std::move(staging), *landed);  // reused once the copy has read it
  return landed;
}

core::Status Fetcher::order_after_copy(Fetched& f, std::shared_ptr<gpu::Event> landed, gpu::Stream* stream) {
  if (landed == nullptr) return Status();
  gpu::Device& dev = parts_.device;
  Status s = stream == nullptr ? dev.synchronize(*landed) : dev.wait(*stream, *landed);
  if (!s.ok()) {
    // Not fetched: the buffer goes back once the copy into it has ended.
    parts_.device_cache.put(std::move(f.working), landed);
    f.working = {};
    return s;
  }
  if (stream == nullptr) return Status();  // the blocking fetch
  f.landed = landed;
  // Copies that have ended need no settling (an evaluation loop never reaches step_end).
  std::erase_if(unsettled_, [&dev](const std::shared_ptr<gpu::Event>& e) {
    const core::Result<bool> done = dev.query(*e);
    return done.ok() && *done;
  });
  unsettled_.push_back(std::move(landed));
  return Status();
}

core::Status Fetcher::wait_fetched(std::size_t g) {
  Fetched& f = groups_[g];
  if (!f.fetched) {
    return Status::failed_precondition(
        str_cat("wait_fetched('", parts_.layout.groups[g].name, "'): the group is not fetched"));
  }
  if (f.landed == nullptr) return Status();
  STRATA_RETURN_IF_ERROR(parts_.device.synchronize(*f.landed));
  f.landed.reset();
  return Status();
}

core::Status Fetcher::settle_copies() {
  Status first;
  for (const std::shared_ptr<gpu::Event>& e : unsettled_) {
    Status s = parts_.device.synchronize(*e);
    if (first.ok()) first = std::move(s);
  }
  unsettled_.clear();
  return first;
}

core::Status Fetcher::release(std::size_t g, gpu::Stream* used_on) {
  Fetched& f = groups_[g];
  if (!f.fetched) {
    return Status::failed_precondition(str_cat("release('", parts_.layout.groups[g].name, "'): the group is not fetched"));
  }
  gpu::Device& dev = parts_.device;
  // The framework's work on the view so far: the buffer is written again
  // only once it has passed.
  std::shared_ptr<gpu::Event> fence;
  if (used_on != nullptr && !f.working.empty()) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, dev.create_event());
    // A stream other than the fetch's is ordered after the fetch's copy too,
    // so the fence covers it (nothing to wait for on the same stream).
    if (f.landed != nullptr) STRATA_RETURN_IF_ERROR(dev.wait(*used_on, *f.landed));
    STRATA_RETURN_IF_ERROR(dev.record(ev, *used_on));
    fence = std::make_shared<gpu::Event>(std::move(ev));
  } else if (f.landed != nullptr) {
    // No stream: the framework's work is done, and so must the copy be that it
    // waited for (a resident copy is read again without a wait).
    STRATA_RETURN_IF_ERROR(dev.synchronize(*f.landed));
  }
  f.landed.reset();
  const GroupPlace& gp = parts_.layout.groups[g];
  if (parts_.schedule.threaded() && !parts_.layout.fetched_in_place(gp)) {
    // The threaded schedules keep it while current, within the room. (A
    // sharded group's too: whether a copy is still kept depends on the
    // device budget's state, which can differ between the ranks, so its next
    // fetch takes it back only when every rank kept its own: fetch_gathered.)
    resident_->keep(g, std::move(f.working), std::move(fence));
    f.working = {};
    resident_->make_room(live_bytes(), 0, SIZE_MAX, sequence_);
  } else {
    parts_.device_cache.put(std::move(f.working), std::move(fence));
  }
  f.working = {};
  f.fetched = false;
  return Status();
}

bool Fetcher::any_fetched() const {
  for (const Fetched& f : groups_) {
    if (f.fetched) return true;
  }
  return false;
}

core::Result<const gpu::DeviceBuffer*> Fetcher::fetched_buffer(std::size_t g) const {
  const GroupPlace& gp = parts_.layout.groups[g];
  if (!groups_[g].fetched) {
    return Status::failed_precondition(
        str_cat("lend_view('", gp.name, "'): the group is not fetched; its compute copies are lent while fetched"));
  }
  return parts_.layout.fetched_in_place(gp) ? &parts_.homes.device_home(g) : &groups_[g].working;
}

core::Result<gpu::DeviceBuffer> Fetcher::allocate_working(std::uint64_t bytes, const std::string& what,
                                                          gpu::ArenaEnd end) {
  BufferCache<gpu::DeviceBuffer>& cache = parts_.device_cache;
  core::Result<gpu::DeviceBuffer> b = cache.get(bytes, what, end);
  if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  if (!resident_->empty()) {  // resident copies give their memory back first
    resident_->drop(DropCopies::kAll);
    b = cache.get(bytes, what, end);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (parts_.schedule.threaded()) {
    // Gradient passes in flight hold device buffers: let them finish, then try again.
    STRATA_RETURN_IF_ERROR(parts_.gradients.wait(what.c_str()));
    b = cache.get(bytes, what, end);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (prefetcher_ == nullptr || prefetcher_->empty()) return b;
  // Prefetched copies only save a later copy: they give their memory back
  // last, to what is needed now (a fetch, a gradient buffer).
  prefetcher_->drop(DropCopies::kAll);
  return cache.get(bytes, what, end);
}

void Fetcher::issue_prefetches() {
  issue_gathers();
  if (prefetcher_ == nullptr) return;
  prefetcher_->issue(sequence_, *resident_, fetched_bytes(), [this](std::size_t g) {
    return groups_[g].fetched || parts_.layout.fetched_in_place(parts_.layout.groups[g]);
  });
}

void Fetcher::settle_prefetches() {
  if (prefetcher_ != nullptr) prefetcher_->drain();
  if (gather_queue_ != nullptr) gather_queue_->drain().ignore_error();  // a failed gather fails its fetch
}

void Fetcher::drop_copies(DropCopies which) {
  if (prefetcher_ != nullptr) prefetcher_->drop(which);
  drop_gathered(which);
  if (resident_ != nullptr) resident_->drop(which);
}

std::uint64_t Fetcher::fetched_bytes() const {
  std::uint64_t bytes = 0;
  for (const Fetched& f : groups_) bytes += f.working.size_bytes();
  return bytes;
}

std::uint64_t Fetcher::live_bytes() const {
  std::uint64_t gathered = 0;
  for (const auto& [g, c] : gathering_) gathered += c->buffer.size_bytes();
  return fetched_bytes() + (prefetcher_ != nullptr ? prefetcher_->bytes() : 0) + gathered + resident_->live_bytes();
}

void Fetcher::learn_sequence() {
  // Told once per sequence: a model whose control flow alternates between a
  // few sequences says so when each first appears, then only at debug level.
  const FetchTrace::LearnOutcome outcome = sequence_.learn();
  if (outcome != FetchTrace::LearnOutcome::kNew && outcome != FetchTrace::LearnOutcome::kSeen) return;
  const std::size_t n = sequence_.sequences_learned();
  if (outcome == FetchTrace::LearnOutcome::kNew && n <= kSequencesLoggedAtInfo) {
    STRATA_LOG(kInfo) << "the fetch sequence changed to one not seen before (" << n
                      << " different so far); prefetch and the optimizer follow the new one"
                      << (n == kSequencesLoggedAtInfo ? "; further changes are logged at debug level" : "");
    return;
  }
  STRATA_LOG(kDebug) << "the fetch sequence changed to "
                     << (outcome == FetchTrace::LearnOutcome::kNew ? "one not seen before" : "one seen before")
                     << " (" << n << " different so far); prefetch and the optimizer follow it";
}

}  // namespace strata::engine
