// The fetch rooms (engine/fetch/): the learned fetch sequence and its cursor,
// and the resident set's room and Belady eviction, on the host device. The
// prefetcher's copies are exercised end to end (tests/e2e/placement_test.cpp:
// traffic, StepStats::prefetched, the same bits); here its bounds.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/memory_budget.h"
#include "engine/fetch/fetch_trace.h"
#include "engine/fetch/prefetcher.h"
#include "engine/fetch/resident_set.h"
#include "gpu/host_device.h"

namespace strata::engine {
namespace {

using Seq = std::vector<std::size_t>;

// Fetches `seq`; the backward begins at index `backward` (its grad_buffer).
void run_step(FetchTrace& t, const Seq& seq, std::size_t backward) {
  for (std::size_t i = 0; i < seq.size(); ++i) {
    t.note_fetch(seq[i]);
    if (i == backward) t.note_backward(seq[i]);
  }
}

// A forward over 0..n-1, then a backward n-1..0 (the last forward group is
// kept: its backward fetch is the forward's last one).
Seq train_step(std::size_t n) {
  Seq s;
  for (std::size_t g = 0; g < n; ++g) s.push_back(g);
  for (std::size_t g = n - 1; g-- > 0;) s.push_back(g);
  return s;
}

TEST(FetchTrace, LearnsTheFirstStepAndFollowsItWithTheCursor) {
  FetchTrace t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.next_use(0), SIZE_MAX);
  run_step(t, train_step(3), 2);  // 0 1 2 | 1 0
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kFirst);  // learned, not relearned
  EXPECT_EQ(t.learned(), (Seq{0, 1, 2, 1, 0}));
  EXPECT_EQ(t.cursor(), 0u);
  t.note_fetch(0);
  EXPECT_EQ(t.cursor(), 1u);
  EXPECT_EQ(t.next_use(0), 4u);  // again in the backward
  EXPECT_EQ(t.next_use(1), 1u);
  t.note_fetch(1);
  t.note_fetch(2);
  EXPECT_EQ(t.next_use(1), 3u);
  EXPECT_EQ(t.next_use(2), SIZE_MAX);  // not again in this step
}

TEST(FetchTrace, RelearnsWhenTheSequenceChanges) {
  FetchTrace t;
  run_step(t, train_step(3), 2);
  t.learn();
  run_step(t, train_step(3), 2);
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kUnchanged);  // the same: nothing changes
  run_step(t, train_step(4), 3);
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kNew);
  EXPECT_EQ(t.learned(), (Seq{0, 1, 2, 3, 2, 1, 0}));
  // A step without fetches keeps the learned sequence.
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kUnchanged);
  EXPECT_EQ(t.learned().size(), 7u);
  EXPECT_EQ(t.sequences_learned(), 2u);
}

TEST(FetchTrace, AlternatingSequencesAreNewOnlyTheFirstTime) {
  FetchTrace t;
  run_step(t, train_step(3), 2);
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kFirst);
  run_step(t, train_step(4), 3);
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kNew);
  for (int i = 0; i < 10; ++i) {  // a model whose control flow alternates between the two
    run_step(t, train_step(3), 2);
    EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kSeen);
    EXPECT_EQ(t.learned(), (Seq{0, 1, 2, 1, 0}));
    run_step(t, train_step(4), 3);
    EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kSeen);
  }
  EXPECT_EQ(t.sequences_learned(), 2u);
  // The same groups with the backward elsewhere is another sequence.
  run_step(t, train_step(3), 3);
  EXPECT_EQ(t.learn(), FetchTrace::LearnOutcome::kNew);
  EXPECT_EQ(t.sequences_learned(), 3u);
}

TEST(FetchTrace, EvaluationPassesBeforeTheForwardAreNotLearned) {
  FetchTrace t;
  // Two evaluation forwards, then the training step, whose backward fetches
  // every group again (its first grad_buffer follows the fetch at index 9).
  Seq s = {0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 1, 0};
  run_step(t, s, 9);
  t.learn();
  EXPECT_EQ(t.learned(), (Seq{0, 1, 2, 2, 1, 0}));
  // Not a repetition: everything is the step's.
  FetchTrace u;
  run_step(u, {0, 1, 0, 2, 2, 1, 0}, 4);
  u.learn();
  EXPECT_EQ(u.learned(), (Seq{0, 1, 0, 2, 2, 1, 0}));
}

TEST(FetchTrace, AForwardThatStartsAgainFollowsTheTraceFromItsStart) {
  FetchTrace t;
  run_step(t, train_step(3), 2);
  t.learn();
  t.note_fetch(0);
  t.note_fetch(1);  // an evaluation pass stops here; the training forward starts again
  t.note_fetch(0);
  EXPECT_EQ(t.cursor(), 1u);  // at the forward's 0, not the backward's
  t.note_fetch(1);
  t.note_fetch(2);
  t.note_backward(2);
  t.note_fetch(1);
  EXPECT_EQ(t.cursor(), 4u);
  t.note_fetch(0);  // the backward's 0
  EXPECT_EQ(t.cursor(), 5u);
}

TEST(FetchTrace, OrdersForTheOptimizer) {
  FetchTrace t;
  EXPECT_EQ(t.forward_order(3), (Seq{0, 1, 2}));  // nothing learned: by index
  Seq groups = {0, 1, 2};
  t.sort_in_backward_order(groups);
  EXPECT_EQ(groups, (Seq{2, 1, 0}));  // backwards by index before one is learned
  run_step(t, {2, 0, 0}, 1);  // group 1 never fetched
  t.learn();
  EXPECT_EQ(t.forward_order(3), (Seq{2, 0, 1}));
  groups = {0, 1, 2};
  t.sort_in_backward_order(groups);
  EXPECT_EQ(groups, (Seq{2, 0, 1}));  // by last use; never fetched last
}

// A layout of `n` groups of `elems` compute elements (bf16), trainable
// unless listed in `frozen`.
Layout layout_of(std::size_t n, std::int64_t elems, const std::vector<std::size_t>& frozen = {}) {
  Layout l;
  l.compute_bytes = 2;
  l.groups.resize(n);
  for (std::size_t g = 0; g < n; ++g) {
    l.groups[g].name = "g" + std::to_string(g);
    l.groups[g].compute_elems = elems;
    l.groups[g].compute_tier = Tier::kPinned;
    l.groups[g].chunk_count = 1;
  }
  for (std::size_t g : frozen) l.groups[g].chunk_count = 0;
  return l;
}

class ResidentSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu::HostDeviceOptions o;
    o.budgets = {&device_budget_, &pinned_budget_};
    auto d = gpu::make_host_device(o);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(d).value();
    gpu::Device* dev = device_.get();
    cache_ = std::make_unique<BufferCache<gpu::DeviceBuffer>>(
        [dev](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) { return dev->allocate(bytes, what, end); });
  }
  gpu::DeviceBuffer buffer(std::uint64_t bytes) {
    auto b = device_->allocate(bytes, "test");
    EXPECT_TRUE(b.ok());
    return std::move(b).value();
  }

  core::MemoryBudget device_budget_{"device", core::MemoryBudget::kUnlimited, "test"};
  core::MemoryBudget pinned_budget_{"pinned", core::MemoryBudget::kUnlimited, "test"};
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<BufferCache<gpu::DeviceBuffer>> cache_;
};

TEST_F(ResidentSetTest, KeepsAndHandsBackACopy) {
  const Layout l = layout_of(2, 1024);
  ResidentSet r(l, /*persistence_threshold=*/0, /*max_live_bytes=*/1 << 20, *cache_);
  r.keep(1, buffer(2048), nullptr);
  EXPECT_TRUE(r.contains(1));
  EXPECT_EQ(r.live_bytes(), 2048u);
  EXPECT_FALSE(r.take(0).has_value());
  std::optional<ResidentSet::Taken> b = r.take(1);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->buffer.size_bytes(), 2048u);
  EXPECT_EQ(b->fence, nullptr);
  EXPECT_TRUE(r.empty());
}

// Room for two of four groups: the copy used again farthest ahead goes first,
// and a copy used before the one that wants the room stays.
TEST_F(ResidentSetTest, EvictsTheCopyUsedAgainFarthestAheadFirst) {
  const Layout l = layout_of(4, 1024);  // 2048 B each
  FetchTrace t;
  run_step(t, {0, 1, 2, 3, 2, 1, 0}, 3);
  t.learn();
  for (std::size_t g : {0, 1, 2, 3}) t.note_fetch(g);  // cursor at the backward's 2 (index 4)
  ResidentSet r(l, 0, 2 * 2048, *cache_);
  r.keep(0, buffer(2048), nullptr);  // next use 6
  r.keep(1, buffer(2048), nullptr);  // next use 5
  r.keep(2, buffer(2048), nullptr);  // next use 4
  std::uint64_t live = r.make_room(r.live_bytes(), 0, SIZE_MAX, t);
  EXPECT_EQ(live, 2 * 2048u);
  EXPECT_FALSE(r.contains(0));  // farthest ahead
  EXPECT_TRUE(r.contains(1));
  EXPECT_TRUE(r.contains(2));
  // A prefetch of the group at position 5 (group 1) wanting room does not
  // evict group 2 (used at 4, before it); there is none left to evict.
  live = r.make_room(r.live_bytes(), 2048, 5, t);
  EXPECT_TRUE(r.contains(2));
  EXPECT_EQ(live, 2 * 2048u);
}

TEST_F(ResidentSetTest, PersistentGroupsStayAndDoNotCount) {
  Layout l = layout_of(3, 1024);
  l.groups[0].compute_elems = 16;  // small: persistent
  FetchTrace t;
  ResidentSet r(l, /*persistence_threshold=*/64, 2048, *cache_);
  EXPECT_TRUE(r.persistent(0));
  EXPECT_FALSE(r.persistent(1));
  r.keep(0, buffer(32), nullptr);
  r.keep(1, buffer(2048), nullptr);
  r.keep(2, buffer(2048), nullptr);
  EXPECT_EQ(r.live_bytes(), 4096u);
  r.make_room(r.live_bytes(), 0, SIZE_MAX, t);
  EXPECT_TRUE(r.contains(0));
  EXPECT_EQ(r.live_bytes(), 2048u);
}

TEST_F(ResidentSetTest, DropUpdatedKeepsFrozenGroupsAndReturnsBuffersToTheCache) {
  const Layout l = layout_of(3, 1024, /*frozen=*/{1});
  ResidentSet r(l, 0, 1 << 20, *cache_);
  for (std::size_t g : {0, 1, 2}) r.keep(g, buffer(2048), nullptr);
  const std::uint64_t before = device_budget_.used_bytes();
  r.drop(DropCopies::kUpdated);
  EXPECT_FALSE(r.contains(0));
  EXPECT_TRUE(r.contains(1));  // frozen: no optimizer rewrites it
  EXPECT_FALSE(r.contains(2));
  EXPECT_EQ(device_budget_.used_bytes(), before);  // cached, still charged
  auto again = cache_->get(2048, "reuse");  // served from the cache: no new charge
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(device_budget_.used_bytes(), before);
  r.drop(DropCopies::kAll);
  EXPECT_TRUE(r.empty());
}

TEST_F(ResidentSetTest, PrefetcherStaysWithinTheBucketAndTheRoom) {
  const Layout l = layout_of(4, 1024);  // 2048 B each
  FetchTrace t;
  run_step(t, {0, 1, 2, 3, 2, 1, 0}, 3);
  t.learn();
  t.note_fetch(0);  // cursor 1
  ResidentSet r(l, 0, /*max_live=*/3 * 2048, *cache_);
  std::vector<std::size_t> copied;
  auto p = Prefetcher::create(*device_, l, /*bucket=*/2 * 2048, *cache_,
                              [&](std::size_t g, gpu::DeviceSpan, gpu::Event*,
                                  CopyLane lane) -> core::Result<std::shared_ptr<gpu::Event>> {
                                copied.push_back(g);
                                lane.bytes->h2d += 2048;
                                return std::shared_ptr<gpu::Event>();  // complete already
                              });
  ASSERT_TRUE(p.ok()) << p.status();
  Prefetcher& pf = **p;
  // Group 0 is fetched (2048 B live): the bucket allows groups 1 and 2.
  pf.issue(t, r, 2048, [](std::size_t g) { return g == 0; });
  pf.drain();
  EXPECT_EQ(copied, (Seq{1, 2}));
  EXPECT_EQ(pf.bytes(), 2 * 2048u);
  StepBytes bytes;
  auto one = pf.take(1, bytes);
  ASSERT_TRUE(one.ok());
  ASSERT_TRUE(one->has_value());
  EXPECT_EQ(bytes.h2d, 2048u);  // counted when taken
  auto none = pf.take(3, bytes);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // The room: 0 and 1 fetched (4096 B), 2 prefetched: nothing more fits.
  t.note_fetch(1);
  pf.issue(t, r, 2 * 2048, [](std::size_t g) { return g <= 1; });
  pf.drain();
  EXPECT_EQ(copied, (Seq{1, 2}));
  pf.drop(DropCopies::kAll);
  EXPECT_TRUE(pf.empty());
}

}  // namespace
}  // namespace strata::engine
