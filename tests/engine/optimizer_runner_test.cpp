// The optimizer runner (engine/step/optimizer_runner.h): jobs in order on
// its thread, per-group marks the next step waits on, the sticky error, the
// early jobs' gates and verdicts, and the finished jobs' totals. Job bodies
// here are small functions; the engine's is tested end to end.
#include "engine/step/optimizer_runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <vector>

namespace strata::engine {
namespace {

std::unique_ptr<OptimizerJob> job(std::int64_t step, JobKind kind = JobKind::kOrdinary) {
  auto j = std::make_unique<OptimizerJob>();
  j->step = step;
  j->kind = kind;
  return j;
}

TEST(OptimizerRunner, RunsJobsInOrderOnItsThreadAndCountsTheirTotals) {
  std::vector<std::int64_t> ran;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> on_caller{false};
  OptimizerRunner r(2, /*threaded=*/true, [&](OptimizerJob& j) {
    ran.push_back(j.step);
    if (std::this_thread::get_id() == caller) on_caller = true;
    j.bytes.nvme_read = 100;
    j.seconds = 0.5;
    return core::Status();
  });
  std::vector<std::int64_t> ids;
  for (std::int64_t s = 1; s <= 5; ++s) {
    auto id = r.submit(job(s));
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  EXPECT_EQ(ids, (std::vector<std::int64_t>{1, 2, 3, 4, 5}));
  ASSERT_TRUE(r.wait_all("test").ok());
  EXPECT_EQ(ran, (std::vector<std::int64_t>{1, 2, 3, 4, 5}));
  EXPECT_FALSE(on_caller);
  EXPECT_EQ(r.decided(), 5);
  const OptimizerRunner::Totals t = r.take_totals();
  EXPECT_EQ(t.bytes.nvme_read, 500u);
  EXPECT_DOUBLE_EQ(t.seconds, 2.5);
  EXPECT_EQ(r.take_totals().bytes.nvme_read, 0u);
}

TEST(OptimizerRunner, AGroupsMarkReleasesItsWaitersBeforeTheJobEnds) {
  std::promise<void> marked, finish;
  std::shared_future<void> go = finish.get_future().share();
  OptimizerRunner* self = nullptr;
  OptimizerRunner r(2, true, [&](OptimizerJob& j) {
    self->mark_done(0, j.id);
    marked.set_value();
    go.wait();  // group 1 is not done until the job is told to finish
    self->mark_done(1, j.id);
    return core::Status();
  });
  self = &r;
  ASSERT_TRUE(r.submit(job(1)).ok());
  marked.get_future().wait();
  EXPECT_TRUE(r.wait_group(0, "fetch").ok());  // returns while the job still runs
  auto waiter = std::async(std::launch::async, [&] { return r.wait_group(1, "fetch"); });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  finish.set_value();
  EXPECT_TRUE(waiter.get().ok());
  // A mark for a given job: the gradient pass of "delayed".
  EXPECT_TRUE(r.wait_group_job(1, 1, "the gradient pass").ok());
}

TEST(OptimizerRunner, TheFirstErrorIsStickyAndNamesTheStep) {
  OptimizerRunner r(1, true, [](OptimizerJob& j) {
    if (j.step == 2) return core::Status::io_error("disk gone");
    if (j.step == 3) return core::Status::internal("later");
    return core::Status();
  });
  for (std::int64_t s = 1; s <= 3; ++s) ASSERT_TRUE(r.submit(job(s)).ok());
  const core::Status s = r.wait_all("step_end");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), core::StatusCode::kIoError);
  EXPECT_NE(s.message().find("step_end: the engine cannot go on after its optimizer failed"), std::string::npos) << s;
  EXPECT_NE(s.message().find("the optimizer of step 2"), std::string::npos) << s;
  EXPECT_NE(s.message().find("disk gone"), std::string::npos) << s;
  EXPECT_EQ(r.wait_group(0, "fetch").code(), core::StatusCode::kIoError);
  EXPECT_EQ(r.error("read_state").code(), core::StatusCode::kIoError);
}

TEST(OptimizerRunner, WithoutAThreadSubmitRunsTheJobToTheEnd) {
  int runs = 0;
  OptimizerRunner r(1, /*threaded=*/false, [&](OptimizerJob& j) {
    ++runs;
    return j.step == 2 ? core::Status::io_error("full") : core::Status();
  });
  ASSERT_TRUE(r.submit(job(1)).ok());
  EXPECT_EQ(runs, 1);
  auto failed = r.submit(job(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("the optimizer of step 2"), std::string::npos);
  EXPECT_FALSE(r.wait_all("x").ok());
}

TEST(OptimizerRunner, AnEarlyJobGoesAsItsGradientsArriveAndCountsOnlyOnceApplied) {
  std::promise<std::vector<OptimizerRunner::Gate>> gates;
  OptimizerRunner* self = nullptr;
  OptimizerRunner r(2, true, [&](OptimizerJob& j) {
    if (!j.early()) {
      self->mark_done(0, j.id);
      self->mark_done(1, j.id);
      return core::Status();
    }
    std::vector<OptimizerRunner::Gate> seen;
    seen.push_back(self->gate(j.id, 1, OptimizerRunner::Until::kGradientsIn));  // after group 1's gradients
    seen.push_back(self->gate(j.id, 0, OptimizerRunner::Until::kVerdict));  // waits for the verdict
    gates.set_value(seen);
    self->mark_done(0, j.id);
    self->mark_done(1, j.id);
    return core::Status();
  });
  self = &r;
  ASSERT_TRUE(r.submit(job(1)).ok());  // a decided job before it
  ASSERT_TRUE(r.wait_all("x").ok());
  auto early = r.submit(job(2, JobKind::kSpeculative));
  ASSERT_TRUE(early.ok());
  EXPECT_EQ(r.decided(), 1);  // not what waits wait for before its verdict
  r.note_grads_in(1, *early);
  auto f = gates.get_future();
  EXPECT_EQ(f.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  ASSERT_TRUE(r.settle(*early, OptimizerRunner::Settle::kApply).ok());
  EXPECT_EQ(r.decided(), *early);
  const auto seen = f.get();
  EXPECT_EQ(seen[0], OptimizerRunner::Gate::kGo);
  EXPECT_EQ(seen[1], OptimizerRunner::Gate::kGoDecided);
  EXPECT_TRUE(r.wait_group(1, "fetch").ok());
}

TEST(OptimizerRunner, AnEarlyJobsGroupsAreListedInTheOrderTheirGradientsCameIn) {
  // The order several ranks gather an early job's groups in: each job's own,
  // kept until the job finished.
  std::promise<std::vector<std::size_t>> listed;
  std::promise<void> go;
  std::shared_future<void> gone = go.get_future().share();
  OptimizerRunner* self = nullptr;
  OptimizerRunner r(3, true, [&](OptimizerJob& j) {
    gone.wait();
    std::vector<std::size_t> order;
    for (std::size_t k = 0; k < 4; ++k) order.push_back(self->arrival(j.id, k));
    listed.set_value(order);
    for (std::size_t g = 0; g < 3; ++g) self->mark_done(g, j.id);
    return core::Status();
  });
  self = &r;
  auto early = r.submit(job(1, JobKind::kCertainEarly));
  ASSERT_TRUE(early.ok());
  EXPECT_EQ(r.arrival(*early, 0), SIZE_MAX);
  r.note_grads_in(2, *early);
  r.note_grads_in(0, *early);
  r.note_grads_in(1, *early);
  r.note_grads_in(1, *early + 1);  // the next job's: a list of its own
  EXPECT_EQ(r.arrival(*early + 1, 0), 1u);
  go.set_value();
  ASSERT_TRUE(r.settle(*early, OptimizerRunner::Settle::kApply).ok());
  EXPECT_EQ(listed.get_future().get(), (std::vector<std::size_t>{2, 0, 1, SIZE_MAX}));
  ASSERT_TRUE(r.wait_all("x").ok());
  EXPECT_EQ(r.arrival(*early, 0), SIZE_MAX);  // gone with the job
  EXPECT_EQ(r.arrival(*early + 1, 0), 1u);
}

TEST(OptimizerRunner, AStoppedEarlyJobIsWaitedForUntilItIsQuiet) {
  std::atomic<bool> quiet{false};
  OptimizerRunner* self = nullptr;
  OptimizerRunner r(1, true, [&](OptimizerJob& j) {
    if (self->gate(j.id, SIZE_MAX, OptimizerRunner::Until::kVerdict) == OptimizerRunner::Gate::kStop) {
      quiet = true;
      self->note_quiet(j.id);
      self->note_reads_done(j.id);
      j.discarded_elems = 42;
    }
    return core::Status();
  });
  self = &r;
  auto early = r.submit(job(1, JobKind::kSpeculative));
  ASSERT_TRUE(early.ok());
  ASSERT_TRUE(r.settle(*early, OptimizerRunner::Settle::kStopWithReads).ok());
  EXPECT_TRUE(quiet);  // settle returned only after the job said so
  EXPECT_EQ(r.decided(), 0);
  ASSERT_TRUE(r.wait_all("x").ok());  // no decided job: nothing to wait for
  r.stop();                           // the job has ended
  EXPECT_EQ(r.take_totals().discarded_elems, 42);
}

TEST(OptimizerRunner, StopRunsQueuedJobsAndStopsAnEarlyJobWithoutAVerdict) {
  std::vector<std::int64_t> ran;
  std::vector<OptimizerRunner::Gate> gate;
  OptimizerRunner* self = nullptr;
  {
    OptimizerRunner r(1, true, [&](OptimizerJob& j) {
      if (j.early()) gate.push_back(self->gate(j.id, SIZE_MAX, OptimizerRunner::Until::kVerdict));
      ran.push_back(j.step);
      return core::Status();
    });
    self = &r;
    ASSERT_TRUE(r.submit(job(1)).ok());
    ASSERT_TRUE(r.submit(job(2)).ok());
    ASSERT_TRUE(r.submit(job(3, JobKind::kSpeculative)).ok());
    r.stop();
  }
  EXPECT_EQ(ran, (std::vector<std::int64_t>{1, 2, 3}));
  ASSERT_EQ(gate.size(), 1u);
  EXPECT_EQ(gate[0], OptimizerRunner::Gate::kStop);
}

TEST(OptimizerRunner, DeferredVerdictsComeBackInOrder) {
  OptimizerRunner r(1, true, [](OptimizerJob& j) {
    j.verdict = {.norm_step = j.step, .grad_norm = 1.0, .lr = 0.1, .skipped = j.step == 2};
    return core::Status();
  });
  for (std::int64_t s = 1; s <= 3; ++s) {
    auto j = job(s, JobKind::kDelayed);
    j->deferred_verdict = DeferredVerdict{};
    ASSERT_TRUE(r.submit(std::move(j)).ok());
  }
  ASSERT_TRUE(r.wait_all("x").ok());
  const auto v = r.take_verdicts();
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].norm_step, 1);
  EXPECT_TRUE(v[1].skipped);
  EXPECT_EQ(v[2].norm_step, 3);
  EXPECT_TRUE(r.take_verdicts().empty());
}

}  // namespace
}  // namespace strata::engine
