// The engine from several threads (engine.h's thread-safety note): gradients
// handed back from a backward thread while the training thread fetches the
// next group give the same bits as one thread doing everything; concurrent
// calls are serialized, never torn; a call made while finalize runs (from an
// init callback, or from another thread) fails instead of deadlocking.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary

// A one-thread worker running posted jobs in order (a framework's backward
// thread).
class Worker {
 public:
  Worker() : thread_([this] { run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> l(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }
  // Waits until every posted job has run.
  void drain() {
    std::unique_lock<std::mutex> l(mu_);
    idle_.wait(l, [this] { return jobs_.empty() && !busy_; });
  }

 private:
  void run() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      l.unlock();
      job();
      l.lock();
      busy_ = false;
      idle_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

class Threads : public MlpTest {
 protected:
  // Optimizer state on nvme, compute copies pinned: every stage does real work.
  Config config() const {
    Config c = base();
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_param.device = OffloadDevice::kCpu;
    return c;
  }
};

// The training thread fetches each group for backward and moves on to the
// next one at once; a backward thread computes nothing new (the gradients
// come from the forward's activations, as in the harness) but hands each
// group's gradients to the engine while the next fetch runs.
TEST_F(Threads, GradientsFromABackwardThreadGiveTheSameBits) {
  constexpr int kRunSteps = 8;
  std::vector<double> losses_one, losses_two;
  std::map<std::string, std::vector<float>> masters_one, masters_two;
  {
    auto e = make_mlp_engine(config());
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < kRunSteps; ++s) losses_one.push_back(train_one_step(*e, f, s));
    masters_one = read_masters(*e);
  }
  {
    auto e = make_mlp_engine(config());
    ASSERT_NE(e, nullptr);
    Framework f, back;  // the backward thread has its own stream
    f.cb = back.cb = e->layout().compute_bytes;
    f.precision = back.precision = e->config().precision;
    back.stream(*e);
    Worker worker;
    for (int s = 0; s < kRunSteps; ++s) {
      f.batch(s * 16);
      f.load(*e, "l1");
      f.load(*e, "l2");
      losses_two.push_back(f.forward());
      const auto& g = f.backward(static_cast<float>(e->loss_scale()));
      for (const char* group : {"l2", "l1"}) {
        f.load(*e, group);  // fetch + release for backward, on this thread
        worker.post([&, group, g] { back.give_grads(*e, group, g); });
      }
      worker.drain();  // step_end after every grads_ready has returned
      auto st = e->step_end();
      ASSERT_TRUE(st.ok()) << st.status();
    }
    masters_two = read_masters(*e);
  }
  ASSERT_EQ(losses_one.size(), losses_two.size());
  for (std::size_t i = 0; i < losses_one.size(); ++i) EXPECT_EQ(losses_one[i], losses_two[i]) << "step " << i;
  for (const auto& [name, v] : masters_one) EXPECT_TRUE(bits_equal(v, masters_two[name])) << name;
}

// Two threads hammer the engine between steps (reads, evaluation fetches of
// different groups); every call either succeeds or is refused by the
// protocol, and training afterwards is unchanged.
TEST_F(Threads, ConcurrentCallsAreSerialized) {
  auto e = make_mlp_engine(config());
  ASSERT_NE(e, nullptr);
  Framework f;
  train_one_step(*e, f, 0);
  const auto before = read_masters(*e);
  std::atomic<int> failures{0};
  auto hammer = [&](const char* group, const char* param, std::size_t numel) {
    std::vector<float> v(numel);
    for (int i = 0; i < 50; ++i) {
      auto span = e->fetch(group);
      if (!span.ok() || !e->release(group).ok()) ++failures;
      if (!e->read_master(param, v).ok()) ++failures;
      if (!(e->loss_scale() > 0.0)) ++failures;
    }
  };
  std::thread a(hammer, "l1", "l1.w", static_cast<std::size_t>(kHidden) * kIn);
  std::thread b(hammer, "l2", "l2.w", static_cast<std::size_t>(kOut) * kHidden);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
  const auto after = read_masters(*e);
  for (const auto& [name, v] : before) EXPECT_TRUE(bits_equal(v, after.at(name))) << name;
  // The same group fetched from two threads at once: one of them is refused.
  auto first = e->fetch("l1");
  ASSERT_TRUE(first.ok());
  core::Status second;
  std::thread c([&] { second = e->fetch("l1").status(); });
  c.join();
  EXPECT_EQ(second.code(), core::StatusCode::kFailedPrecondition) << second;
  EXPECT_TRUE(e->release("l1").ok());
  train_one_step(*e, f, 1);
}

// An init callback that calls into its engine, on its own thread or through
// another one it waits for, gets FAILED_PRECONDITION (no deadlock), and
// finalize still succeeds.
TEST_F(Threads, CallsWhileFinalizeRunsFailInsteadOfDeadlocking) {
  auto created = Engine::create(config());
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& e = **created;
  core::Status same_thread, other_thread;
  for (const Tensor& t : kTensors) {
    const bool probe = t.name == "l1.w";
    ASSERT_TRUE(e.register_param({t.name, t.shape, t.group, true, 0}, [&, t, probe](std::span<float> out) {
                   init_values(t, out);
                   if (probe) {
                     same_thread = e.fetch("l2").status();
                     std::thread other([&] { other_thread = e.set_lr(1e-3); });
                     other.join();
                   }
                   return core::Status();
                 }).ok());
  }
  ASSERT_TRUE(e.finalize().ok());
  EXPECT_EQ(same_thread.code(), core::StatusCode::kFailedPrecondition) << same_thread;
  EXPECT_NE(same_thread.message().find("while finalize runs"), std::string::npos) << same_thread;
  EXPECT_EQ(other_thread.code(), core::StatusCode::kFailedPrecondition) << other_thread;
  Framework f;
  train_one_step(e, f, 0);
}

}  // namespace
}  // namespace strata::engine
