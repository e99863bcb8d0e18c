// LaunchOrder: the order a rank launches its collectives on the device in.
// Several threads launch them (the gradient path's copy thread its sums, the
// framework's thread its fetches' gathers), each over a communicator of its
// own; NCCL asks that every rank launch the operations of its communicators
// in one order, or kernels waiting for each other on different GPUs may
// hang. Each launch takes a ticket where the framework's calls reach it
// (grads_ready, fetch: the same order on every rank), and waits for its turn
// (every earlier ticket launched, or given up) before it launches. Launching
// in order is not running in order: the streams' own waits (a fence, a
// write) can hold one collective back on one GPU while a later one runs, and
// NCCL's kernels of two communicators are safe side by side only while they
// fit on the GPU together. So each launch's stream also waits for the last
// launched collective (`previous`, an event recorded after it: `launched`),
// and the device runs them in ticket order too (run_device_collective):
//
//   auto turn = std::make_shared<LaunchOrder::Turn>(order);   // in call order
//   ... later, on any thread:
//   STRATA_RETURN_IF_ERROR(turn->wait());   // earlier tickets launched
//   stream waits for turn->previous(); launch ...; turn->launched(event after it);
//   turn->done();                           // (the destructor too: given up)
//
// Thread-safe. Private to engine/.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <utility>

#include "core/mutex.h"
#include "core/status.h"
#include "core/str.h"
#include "gpu/device.h"

namespace strata::engine {

class LaunchOrder {
 public:
  // `timeout`: the longest a launch waits for its turn (the collectives'
  // own): a turn that never comes is an error, not a hang.
  explicit LaunchOrder(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  // Lets go of the last launched collective's event (its device closes, or
  // every launch has run: the owner's destructor).
  void forget_last() STRATA_EXCLUDES(mu_) { set_last(nullptr); }

  class Turn {
   public:
    explicit Turn(LaunchOrder* order) : order_(order), ticket_(order != nullptr ? order->take() : 0) {}
    ~Turn() { done(); }
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;
    // Waits until every earlier ticket is launched or given up.
    core::Status wait() { return order_ != nullptr ? order_->wait_turn(ticket_) : core::Status(); }
    // The last launched collective (null: none yet), and this one's, which
    // the next launches wait for; while this turn is held (after wait()).
    std::shared_ptr<gpu::Event> previous() const { return order_ != nullptr ? order_->last() : nullptr; }
    void launched(std::shared_ptr<gpu::Event> after) {
      if (order_ != nullptr) order_->set_last(std::move(after));
    }
    // Launched (or given up): the next ticket's turn.
    void done() {
      if (order_ != nullptr) order_->finish(ticket_);
      order_ = nullptr;
    }

   private:
    LaunchOrder* order_;
    std::uint64_t ticket_;
  };

 private:
  std::uint64_t take() STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    return next_++;
  }
  core::Status wait_turn(std::uint64_t ticket) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    if (!cv_.wait_for(mu_, timeout_, [&]() STRATA_REQUIRES(mu_) { return turn_ == ticket; })) {
      return core::Status::unavailable(core::str_cat(
          "a collective on the device waited ", timeout_.count(), " ms for ", ticket - turn_,
          " launched before it (the framework's earlier calls) to be launched"));
    }
    return core::Status();
  }
  void finish(std::uint64_t ticket) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    finished_.insert(ticket);
    while (finished_.erase(turn_) > 0) ++turn_;
    cv_.notify_all();
  }

  std::shared_ptr<gpu::Event> last() const STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    return last_;
  }
  void set_last(std::shared_ptr<gpu::Event> after) STRATA_EXCLUDES(mu_) {
    const core::MutexLock lock(mu_);
    last_ = std::move(after);
  }

  const std::chrono::milliseconds timeout_;
  mutable core::Mutex mu_;
  core::CondVar cv_;
  std::uint64_t next_ STRATA_GUARDED_BY(mu_) = 0;   // the next ticket taken
  std::uint64_t turn_ STRATA_GUARDED_BY(mu_) = 0;   // the ticket whose launch is next
  std::set<std::uint64_t> finished_ STRATA_GUARDED_BY(mu_);  // finished out of turn
  std::shared_ptr<gpu::Event> last_ STRATA_GUARDED_BY(mu_);  // after the last launched collective
};

}  // namespace strata::engine
