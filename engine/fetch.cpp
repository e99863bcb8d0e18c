// The engine's fetch calls: fetch, release and lend_view, the device
// buffers they take (allocate_working), and the glue to the fetch rooms
// (engine/fetch/: the learned sequence, resident copies, prefetches).
#include <vector>

#include "core/logging.h"
#include "core/str.h"
#include "engine/engine.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/engine_util.h"
#include "engine/internal/group_state.h"
#include "engine/internal/view_holds.h"
#include "engine/state/compute_homes.h"
#include "engine/state/copy_lane.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

core::Result<gpu::DeviceSpan> Engine::fetch(std::string_view group, gpu::Stream* stream) {
  STRATA_ENGINE_ENTRY("fetch");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "fetch"));
  const StageTimer timer(step_.times.fetch_s);
  TraceScope t(trace_, TraceTrack::kStep, str_cat("fetch ", group));
  GroupState& gs = groups_[g];
  if (gs.fetched) {
    return Status::failed_precondition(str_cat("fetch('", group, "'): already fetched; release it first"));
  }
  if (early_.applying_in_place && gs.grads_micro_step == step_.micro_step) {
    return Status::failed_precondition(str_cat(
        "fetch('", group, "'): its gradients of the step's last micro-batch are in, and the optimizer is updating it "
        "in place (strata.overlap \"", schedule_.name(),
        "\" with no clipping, no loss scaler and strata.nonfinite \"apply\"); fetch it again after step_end"));
  }
  // The last step's optimizer may still be writing this group's copies
  // (under "delayed" it writes them elsewhere, and the step uses the old).
  if (waits_for_optimizer(g)) {
    STRATA_RETURN_IF_ERROR(runner_->wait_group(g, "fetch"));
  } else {
    STRATA_RETURN_IF_ERROR(runner_->error("fetch"));  // its error, if any
  }
  copies_.trace.note_fetch(g);
  const GroupPlace& gp = layout_.groups[g];
  if (gp.compute_tier == Tier::kDevice) {
    gs.fetched = true;
    return homes_->device_home(g).span();
  }
  if (std::optional<ResidentSet::Taken> kept = copies_.resident->take(g)) {  // still on the device since its release
    gs.working = std::move(kept->buffer);
    ++step_.resident;
    step_.resident_bytes += gs.working.size_bytes();
    // Read again after the release's fence: the fetch's queued copy into it
    // ended before the framework's work that the fence follows.
    STRATA_RETURN_IF_ERROR(order_after_copy(gs, std::move(kept->fence), stream));
    gs.fetched = true;
    issue_prefetches();
    return gs.working.span();
  }
  std::optional<Prefetcher::Taken> prefetched;
  if (copies_.prefetcher != nullptr) {
    STRATA_ASSIGN_OR_RETURN(prefetched, copies_.prefetcher->take(g, step_.bytes));
  }
  if (prefetched) {
    gs.working = std::move(prefetched->buffer);
    ++step_.prefetched;
    STRATA_RETURN_IF_ERROR(order_after_copy(gs, std::move(prefetched->landed), stream));
    gs.fetched = true;
    issue_prefetches();
    return gs.working.span();
  }
  const std::uint64_t bytes = static_cast<std::uint64_t>(gp.compute_elems) * static_cast<std::uint64_t>(layout_.compute_bytes);
  // Room within stage3_max_live_parameters first, as a prefetch makes it:
  // resident copies used again latest go back to the cache, whose buffer
  // the allocation below then takes.
  copies_.resident->make_room(live_bytes(), bytes, SIZE_MAX, copies_.trace);
  STRATA_ASSIGN_OR_RETURN(gs.working, allocate_working(bytes, str_cat("fetched group '", gp.name, "'")));
  core::Result<std::shared_ptr<gpu::Event>> landed = queue_fetch_copy(g, gs.working.span(), step_lane());
  if (!landed.ok()) {
    device_cache_->put(std::move(gs.working));
    gs.working = {};
    return std::move(landed).status();
  }
  STRATA_RETURN_IF_ERROR(order_after_copy(gs, std::move(*landed), stream));
  gs.fetched = true;
  issue_prefetches();
  return gs.working.span();
}

core::Result<std::shared_ptr<gpu::Event>> Engine::queue_fetch_copy(std::size_t g, gpu::DeviceSpan dst,
                                                                   const Lane& lane) {
  gpu::PinnedBuffer staging;  // compute copies whose home is not pinned pass through it
  core::Result<std::span<std::byte>> host = homes_->load(g, staging, lane);
  if (!host.ok()) {
    pinned_cache_->put(std::move(staging));
    return std::move(host).status();
  }
  core::Result<std::shared_ptr<gpu::Event>> landed = lane_h2d_queued(dev(), trace_, lane, dst, *host);
  if (!landed.ok()) {
    dev().synchronize(*lane.stream).ignore_error();  // nothing may still read the staging
    pinned_cache_->put(std::move(staging));
    return landed;
  }
  pinned_cache_->put(std::move(staging), *landed);  // reused once the copy has read it
  return landed;
}

core::Status Engine::order_after_copy(GroupState& gs, std::shared_ptr<gpu::Event> landed, gpu::Stream* stream) {
  if (landed == nullptr) return Status();
  Status s = stream == nullptr ? dev().synchronize(*landed) : dev().wait(*stream, *landed);
  if (!s.ok()) {
    // Not fetched: the buffer goes back once the copy into it has ended.
    device_cache_->put(std::move(gs.working), landed);
    gs.working = {};
    return s;
  }
  if (stream == nullptr) return Status();  // the blocking fetch
  gs.landed = landed;
  // Copies that have ended need no settling (an evaluation loop never reaches step_end).
  std::erase_if(unsettled_copies_, [this](const std::shared_ptr<gpu::Event>& e) {
    const core::Result<bool> done = dev().query(*e);
    return done.ok() && *done;
  });
  unsettled_copies_.push_back(std::move(landed));
  return Status();
}

core::Status Engine::wait_fetched(std::string_view group) {
  STRATA_ENGINE_ENTRY("wait_fetched");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "wait_fetched"));
  GroupState& gs = groups_[g];
  if (!gs.fetched) {
    return Status::failed_precondition(str_cat("wait_fetched('", group, "'): the group is not fetched"));
  }
  if (gs.landed == nullptr) return Status();
  STRATA_RETURN_IF_ERROR(dev().synchronize(*gs.landed));
  gs.landed.reset();
  return Status();
}

core::Status Engine::settle_fetch_copies() {
  Status first;
  for (const std::shared_ptr<gpu::Event>& e : unsettled_copies_) {
    Status s = dev().synchronize(*e);
    if (first.ok()) first = std::move(s);
  }
  unsettled_copies_.clear();
  return first;
}

core::Status Engine::release(std::string_view group, gpu::Stream* used_on) {
  STRATA_ENGINE_ENTRY("release");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "release"));
  GroupState& gs = groups_[g];
  if (!gs.fetched) return Status::failed_precondition(str_cat("release('", group, "'): the group is not fetched"));
  // The framework's work on the view so far: the buffer is written again
  // only once it has passed.
  std::shared_ptr<gpu::Event> fence;
  if (used_on != nullptr && !gs.working.empty()) {
    STRATA_ASSIGN_OR_RETURN(gpu::Event ev, dev().create_event());
    // A stream other than the fetch's is ordered after the fetch's copy too,
    // so the fence covers it (nothing to wait for on the same stream).
    if (gs.landed != nullptr) STRATA_RETURN_IF_ERROR(dev().wait(*used_on, *gs.landed));
    STRATA_RETURN_IF_ERROR(dev().record(ev, *used_on));
    fence = std::make_shared<gpu::Event>(std::move(ev));
  } else if (gs.landed != nullptr) {
    // No stream: the framework's work is done, and so must the copy be that it
    // waited for (a resident copy is read again without a wait).
    STRATA_RETURN_IF_ERROR(dev().synchronize(*gs.landed));
  }
  gs.landed.reset();
  if (schedule_.threaded() && layout_.groups[g].compute_tier != Tier::kDevice) {
    // The threaded schedules keep it while current, within the room.
    copies_.resident->keep(g, std::move(gs.working), std::move(fence));
    gs.working = {};
    copies_.resident->make_room(live_bytes(), 0, SIZE_MAX, copies_.trace);
  } else {
    device_cache_->put(std::move(gs.working), std::move(fence));
  }
  gs.working = {};
  gs.fetched = false;
  return Status();
}

ViewLease::ViewLease(std::shared_ptr<ViewHolds> holds, std::uint64_t buffer_id)
    : holds_(std::move(holds)), buffer_id_(buffer_id) {
  holds_->hold(buffer_id_);
}

ViewLease::~ViewLease() { holds_->end(buffer_id_); }

core::Result<LentView> Engine::lend_view(std::string_view group, ViewKind kind) {
  STRATA_ENGINE_ENTRY("lend_view");
  STRATA_ASSIGN_OR_RETURN(const std::size_t g, group_index(group, "lend_view"));
  GroupState& gs = groups_[g];
  const gpu::DeviceBuffer* lent = &gs.grad;
  if (kind == ViewKind::kCompute) {
    if (!gs.fetched) {
      return Status::failed_precondition(
          str_cat("lend_view('", group, "'): the group is not fetched; its compute copies are lent while fetched"));
    }
    lent = layout_.groups[g].compute_tier == Tier::kDevice ? &homes_->device_home(g) : &gs.working;
  } else {
    STRATA_RETURN_IF_ERROR(grad_buffer_locked(g).status());
  }
  STRATA_CHECK(!lent->empty()) << "lend_view('" << group << "'): no buffer";
  return LentView{lent->span(), std::unique_ptr<ViewLease>(new ViewLease(holds_, lent->id()))};
}

core::Result<gpu::DeviceBuffer> Engine::allocate_working(std::uint64_t bytes, const std::string& what) {
  core::Result<gpu::DeviceBuffer> b = device_cache_->get(bytes, what);
  if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  if (!copies_.resident->empty()) {  // resident copies give their memory back first
    copies_.resident->drop(DropCopies::kAll);
    b = device_cache_->get(bytes, what);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (schedule_.threaded()) {
    // Gradient passes in flight hold device buffers: let them finish, then try again.
    STRATA_RETURN_IF_ERROR(gradients_->wait(what.c_str()));
    b = device_cache_->get(bytes, what);
    if (b.ok() || b.status().code() != core::StatusCode::kResourceExhausted) return b;
  }
  if (copies_.prefetcher == nullptr || copies_.prefetcher->empty()) return b;
  // Prefetched copies only save a later copy: they give their memory back
  // last, to what is needed now (a fetch, a gradient buffer).
  copies_.prefetcher->drop(DropCopies::kAll);
  return device_cache_->get(bytes, what);
}

void Engine::issue_prefetches() {
  if (copies_.prefetcher == nullptr) return;
  copies_.prefetcher->issue(copies_.trace, *copies_.resident, fetched_bytes(), [this](std::size_t g) {
    return groups_[g].fetched || layout_.groups[g].compute_tier == Tier::kDevice;
  });
}

void Engine::settle_prefetches() {
  if (copies_.prefetcher != nullptr) copies_.prefetcher->drain();
}

void Engine::drop_device_copies(DropCopies which) {
  if (copies_.prefetcher != nullptr) copies_.prefetcher->drop(which);
  if (copies_.resident != nullptr) copies_.resident->drop(which);
}

std::uint64_t Engine::fetched_bytes() const {
  std::uint64_t bytes = 0;
  for (const GroupState& gs : groups_) bytes += gs.working.size_bytes();
  return bytes;
}

std::uint64_t Engine::live_bytes() const {
  return fetched_bytes() + (copies_.prefetcher != nullptr ? copies_.prefetcher->bytes() : 0) + copies_.resident->live_bytes();
}

void Engine::learn_fetch_trace() {
  if (copies_.trace.learn()) {
    STRATA_LOG(kInfo) << "the fetch sequence changed; prefetch and the optimizer follow the new one";
  }
}

std::vector<std::string> Engine::fetch_sequence() const {
  const core::MutexLock lock(mu_);
  std::vector<std::string> names;
  for (std::size_t g : copies_.trace.learned()) names.push_back(layout_.groups[g].name);
  return names;
}

}  // namespace strata::engine
