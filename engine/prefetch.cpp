// Traced prefetch (Engine members declared in engine/engine.h). The first
// training step records the sequence of fetches; later fetches follow it and
// start the copies of the groups that come next on the prefetch thread and
// stream, within DeepSpeed's stage3_prefetch_bucket_size (elements ahead,
// not yet fetched) and stage3_max_live_parameters (elements on the device,
// fetched or prefetched). A fetch whose copy is in flight waits for that copy
// only. A sequence that changes is learned again at step_end. A prefetch
// waits for the optimizer's mark on its group, so it never copies a stale
// compute copy; prefetches into the next step start only at step_end, once
// that step's optimizer job exists. Traffic is counted when a fetch takes the
// copy, so every step's statistics stay what the memory model says.
#include <algorithm>
#include <memory>

#include "core/logging.h"
#include "core/str.h"
#include "engine/engine.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/group_state.h"
#include "engine/internal/prefetch.h"
#include "engine/internal/serial_queue.h"

namespace strata::engine {

using core::Status;
using core::str_cat;


namespace {

// The fetches of a training step without the evaluation passes that came
// before its forward: when the fetches before the first backward fetch are
// one sequence repeated (an evaluation pass, or several, then the training
// forward: the same groups in the same order), only the last repetition is
// the step's. `backward` is the index of the first backward fetch (the
// sequence's size when the step had no backward).
struct Learned {
  std::vector<std::size_t> sequence;
  std::size_t backward;  // index of its first backward fetch (its size without one)
};
Learned without_evaluation_passes(const std::vector<std::size_t>& seq, std::size_t backward) {
  backward = std::min(backward, seq.size());
  for (std::size_t period = 1; period < backward; ++period) {
    if (backward % period != 0) continue;
    bool repeats = true;
    for (std::size_t i = period; i < backward && repeats; ++i) repeats = seq[i] == seq[i - period];
    if (repeats) return {{seq.begin() + static_cast<std::ptrdiff_t>(backward - period), seq.end()}, period};
  }
  return {seq, backward};
}

}  // namespace

void Engine::learn_fetch_trace() {
  Learned learned = without_evaluation_passes(step_sequence_, backward_start_);
  if (!learned.sequence.empty() && learned.sequence != fetch_trace_) {
    if (!fetch_trace_.empty()) {
      STRATA_LOG(kInfo) << "the fetch sequence changed; prefetch and the optimizer follow the new one";
    }
    fetch_trace_ = std::move(learned.sequence);
    trace_backward_ = learned.backward;
  }
  step_sequence_.clear();
  backward_start_ = SIZE_MAX;
  trace_cursor_ = 0;
}

void Engine::note_backward(std::size_t g) {
  if (backward_start_ != SIZE_MAX) return;
  const auto it = std::find(step_sequence_.rbegin(), step_sequence_.rend(), g);
  if (it != step_sequence_.rend()) backward_start_ = static_cast<std::size_t>(step_sequence_.rend() - it) - 1;
}

std::vector<std::string> Engine::fetch_sequence() const {
  const core::MutexLock lock(mu_);
  std::vector<std::string> names;
  for (std::size_t g : fetch_trace_) names.push_back(layout_.groups[g].name);
  return names;
}

void Engine::note_fetch(std::size_t g) {
  step_sequence_.push_back(g);
  if (fetch_trace_.empty()) return;
  // The next occurrence of g from the cursor on (wrapping: an evaluation pass
  // between steps starts the forward again).
  const auto from = fetch_trace_.begin() + static_cast<std::ptrdiff_t>(std::min(trace_cursor_, fetch_trace_.size()));
  auto it = std::find(from, fetch_trace_.end(), g);
  if (it == fetch_trace_.end()) it = std::find(fetch_trace_.begin(), from, g);
  // Before this step's backward, the trace's first group starts a forward
  // again (an evaluation pass, or the training forward after one): follow the
  // trace from its start, not from that group's place in the backward.
  // (Only while the cursor has not followed the trace into its backward: a
  // backward fetch may come before the grad_buffer that marks the backward.)
  if (backward_start_ == SIZE_MAX && g == fetch_trace_.front() && trace_cursor_ <= trace_backward_ &&
      static_cast<std::size_t>(it - fetch_trace_.begin()) >= trace_backward_) {
    it = fetch_trace_.begin();
  }
  if (it != fetch_trace_.end()) trace_cursor_ = static_cast<std::size_t>(it - fetch_trace_.begin()) + 1;
}

bool Engine::persistent(std::size_t g) const {
  return layout_.groups[g].compute_elems <= config_.zero.stage3_param_persistence_threshold;
}

std::uint64_t Engine::live_bytes() const {
  std::uint64_t live = 0;
  for (const auto& [g, p] : prefetched_) live += p->buffer.size_bytes();
  for (const GroupState& gs : groups_) live += gs.working.size_bytes();
  for (const auto& [g, r] : resident_) {
    if (!persistent(g)) live += r.buffer.size_bytes();
  }
  return live;
}

std::size_t Engine::next_use(std::size_t g) const {
  for (std::size_t i = trace_cursor_; i < fetch_trace_.size(); ++i) {
    if (fetch_trace_[i] == g) return i;
  }
  return SIZE_MAX;
}

std::uint64_t Engine::make_room(std::uint64_t bytes, std::size_t before) {
  const std::uint64_t max_live = static_cast<std::uint64_t>(config_.zero.stage3_max_live_parameters) *
                                 static_cast<std::uint64_t>(layout_.compute_bytes);
  std::uint64_t live = live_bytes();
  while (live + bytes > max_live) {
    auto victim = resident_.end();
    std::size_t victim_use = 0;
    for (auto it = resident_.begin(); it != resident_.end(); ++it) {
      if (persistent(it->first)) continue;
      const std::size_t use = next_use(it->first);
      if (victim == resident_.end() || use > victim_use) {
        victim = it;
        victim_use = use;
      }
    }
    // Keep a copy used again before the one that wants the room.
    if (victim == resident_.end() || (before != SIZE_MAX && victim_use <= before)) break;
    live -= victim->second.buffer.size_bytes();
    device_cache_->put(std::move(victim->second.buffer), std::move(victim->second.fence));
    resident_.erase(victim);
  }
  return live;
}

void Engine::keep_resident(std::size_t g, gpu::DeviceBuffer buffer, std::shared_ptr<gpu::Event> fence) {
  resident_[g] = Resident{std::move(buffer), std::move(fence)};
  make_room(0, SIZE_MAX);
}

void Engine::drop_resident(Drop which) {
  for (auto it = resident_.begin(); it != resident_.end();) {
    if (which == Drop::kUpdated && layout_.groups[it->first].chunk_count == 0) {
      ++it;  // frozen: its copy stays what the compute copies hold
      continue;
    }
    device_cache_->put(std::move(it->second.buffer), std::move(it->second.fence));
    it = resident_.erase(it);
  }
}

void Engine::issue_prefetches() {
  if (prefetch_queue_ == nullptr || fetch_trace_.empty()) return;
  const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
  const std::uint64_t bucket = static_cast<std::uint64_t>(config_.zero.stage3_prefetch_bucket_size) * cb;
  const std::uint64_t max_live = static_cast<std::uint64_t>(config_.zero.stage3_max_live_parameters) * cb;
  std::uint64_t ahead = 0;
  for (const auto& [g, p] : prefetched_) ahead += p->buffer.size_bytes();
  for (std::size_t i = trace_cursor_; i < fetch_trace_.size(); ++i) {
    const std::size_t g = fetch_trace_[i];
    const GroupPlace& gp = layout_.groups[g];
    if (gp.compute_tier == Tier::kDevice || groups_[g].fetched || prefetched_.contains(g) || resident_.contains(g)) {
      continue;
    }
    const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * cb;
    if (ahead + bytes > bucket) break;
    // Room on the device: resident copies used again later than this one go.
    if (make_room(bytes, i) + bytes > max_live) break;
    // A buffer the framework may still be reading (its release's fence):
    // the copy waits for that on the prefetch stream, not the caller here.
    core::Result<BufferCache<gpu::DeviceBuffer>::Fenced> buffer =
        device_cache_->get_fenced(bytes, str_cat("prefetch of group '", gp.name, "'"));
    if (!buffer.ok()) break;  // the device budget is short: fetch will copy it in line
    auto p = std::make_unique<Prefetch>();
    p->buffer = std::move(buffer->buffer);
    std::shared_ptr<gpu::Event> fence = std::move(buffer->fence);
    Prefetch* raw = p.get();
    const gpu::DeviceSpan dst = raw->buffer.span();
    prefetched_[g] = std::move(p);
    ahead += bytes;
    prefetch_queue_->post([this, g, dst, raw, fence] {
      Status s = waits_for_optimizer(g) ? wait_optimizer_group(g, "prefetch") : Status();
      if (s.ok() && fence != nullptr) s = device_->wait(prefetch_stream_, *fence);
      if (s.ok()) {
        TraceScope t(trace_, TraceTrack::kPrefetch, str_cat("prefetch ", layout_.groups[g].name), dst.size_bytes());
        const Lane lane{&prefetch_stream_, &raw->bytes};
        gpu::PinnedBuffer staging;
        core::Result<std::span<std::byte>> host = load_compute(g, staging, lane);
        s = host.ok() ? copy_h2d(dst, *host, lane) : host.status();
        pinned_cache_->put(std::move(staging));
      }
      raw->finish(std::move(s));
      return Status();  // a failed prefetch fails its fetch, not the queue
    });
  }
}

core::Result<bool> Engine::take_prefetch(std::size_t g) {
  auto it = prefetched_.find(g);
  if (it == prefetched_.end()) return false;
  std::unique_ptr<Prefetch> p = std::move(it->second);
  prefetched_.erase(it);
  Status s = p->wait();
  if (!s.ok()) return std::move(s).annotate(str_cat("prefetch of group '", layout_.groups[g].name, "'"));
  bytes_ += p->bytes;
  groups_[g].working = std::move(p->buffer);
  return true;
}

void Engine::drop_prefetches(Drop which) {
  for (auto it = prefetched_.begin(); it != prefetched_.end();) {
    if (which == Drop::kUpdated && layout_.groups[it->first].chunk_count == 0) {
      ++it;  // frozen: no optimizer writes its copies
      continue;
    }
    it->second->wait().ignore_error();  // the copy must end before its buffer goes
    device_cache_->put(std::move(it->second->buffer));
    it = prefetched_.erase(it);
  }
}

}  // namespace strata::engine
