#include "engine/fetch/prefetcher.h"

#include "core/str.h"
#include "engine/internal/done_latch.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

// One prefetched group: its device buffer and the copy's outcome.
struct Prefetcher::Copy {
  gpu::DeviceBuffer buffer;
  DoneLatch done;
  StepBytes bytes;                      // written by the copy, read after done
  std::shared_ptr<gpu::Event> landed;   // after the queued copy; written by the copy, read after done
  void finish(core::Result<std::shared_ptr<gpu::Event>> r) {
    if (r.ok()) landed = std::move(*r);
    done.finish(r.status());
  }
  core::Status wait() { return done.wait(); }
};

core::Result<std::unique_ptr<Prefetcher>> Prefetcher::create(gpu::Device& device, const Layout& layout,
                                                             std::uint64_t bucket_bytes,
                                                             BufferCache<gpu::DeviceBuffer>& cache, CopyIn copy_in) {
  STRATA_ASSIGN_OR_RETURN(gpu::Stream stream, device.create_stream("prefetch"));
  return std::unique_ptr<Prefetcher>(
      new Prefetcher(device, layout, bucket_bytes, cache, std::move(copy_in), std::move(stream)));
}

Prefetcher::Prefetcher(gpu::Device& device, const Layout& layout, std::uint64_t bucket_bytes,
                       BufferCache<gpu::DeviceBuffer>& cache, CopyIn copy_in, gpu::Stream stream)
    : device_(device),
      layout_(layout),
      bucket_(bucket_bytes),
      cache_(cache),
      copy_in_(std::move(copy_in)),
      stream_(std::move(stream)),
      queue_(std::make_unique<SerialQueue>()) {}

Prefetcher::~Prefetcher() {
  queue_.reset();  // the copies end before their buffers go
  drop(DropCopies::kAll);
}

void Prefetcher::drain() { queue_->drain().ignore_error(); }  // a failed copy fails its fetch, not the queue

std::uint64_t Prefetcher::bytes() const {
  std::uint64_t b = 0;
  for (const auto& [g, c] : inflight_) b += c->buffer.size_bytes();
  return b;
}

void Prefetcher::issue(const FetchTrace& trace, ResidentSet& resident, std::uint64_t fetched_bytes,
                       const std::function<bool(std::size_t)>& on_device) {
  if (trace.empty()) return;
  const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
  std::uint64_t ahead = bytes();
  const std::vector<std::size_t>& seq = trace.learned();
  for (std::size_t i = trace.cursor(); i < seq.size(); ++i) {
    const std::size_t g = seq[i];
    const GroupPlace& gp = layout_.groups[g];
    if (on_device(g) || inflight_.contains(g) || resident.contains(g)) continue;
    const std::uint64_t size = static_cast<std::uint64_t>(gp.compute_elems) * cb;
    if (ahead + size > bucket_) break;
    // Room on the device: resident copies used again later than this one go.
    const std::uint64_t live = fetched_bytes + bytes() + resident.live_bytes();
    if (resident.make_room(live, size, i, trace) + size > resident.max_live_bytes()) break;
    // A buffer the framework may still be reading (its release's fence):
    // the copy waits for that on the prefetch stream, not the caller here.
    core::Result<BufferCache<gpu::DeviceBuffer>::Fenced> buffer =
        cache_.get_fenced(size, str_cat("prefetch of group '", gp.name, "'"));
    if (!buffer.ok()) break;  // the device budget is short: fetch will copy it in line
    auto copy = std::make_unique<Copy>();
    copy->buffer = std::move(buffer->buffer);
    std::shared_ptr<gpu::Event> fence = std::move(buffer->fence);
    Copy* raw = copy.get();
    const gpu::DeviceSpan dst = raw->buffer.span();
    inflight_[g] = std::move(copy);
    ahead += size;
    queue_->post([this, g, dst, raw, fence] {
      // (Its copies show on the optimizer's device track, as they always have.)
      raw->finish(copy_in_(g, dst, fence.get(), CopyLane{&stream_, &raw->bytes, TraceTrack::kOptDevice}));
      return Status();  // a failed prefetch fails its fetch, not the queue
    });
  }
}

core::Result<std::optional<Prefetcher::Taken>> Prefetcher::take(std::size_t g, StepBytes& bytes) {
  auto it = inflight_.find(g);
  if (it == inflight_.end()) return std::optional<Taken>();
  std::unique_ptr<Copy> c = std::move(it->second);
  inflight_.erase(it);
  Status s = c->wait();
  if (!s.ok()) return std::move(s).annotate(str_cat("prefetch of group '", layout_.groups[g].name, "'"));
  bytes += c->bytes;
  return std::optional<Taken>(Taken{std::move(c->buffer), std::move(c->landed)});
}

void Prefetcher::drop(DropCopies which) {
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (which == DropCopies::kUpdated && layout_.groups[it->first].chunk_count == 0) {
      ++it;  // frozen: no optimizer writes its copies
      continue;
    }
    it->second->wait().ignore_error();  // the copy must be queued, then end, before its buffer goes
    if (it->second->landed) device_.synchronize(*it->second->landed).ignore_error();
    cache_.put(std::move(it->second->buffer));
    it = inflight_.erase(it);
  }
}

}  // namespace strata::engine
