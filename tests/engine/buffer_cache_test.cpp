// BufferCache over a fake allocator (a real MemoryBudget behind it) and fake
// fences, then over the host device: reuse by exact size, fences waited for
// or handed out, the retry that empties the cache, clear(), and the divert.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/memory_budget.h"
#include "core/status.h"
#include "engine/internal/buffer_cache.h"
#include "gpu/host_device.h"

namespace strata::engine {
namespace {

// A stand-in for gpu::DeviceBuffer: move-only, an id unique per allocation,
// a size, and a charge against the allocator's budget held while it lives.
class FakeBuffer {
 public:
  FakeBuffer() = default;
  FakeBuffer(std::uint64_t id, std::uint64_t bytes, core::BudgetCharge charge)
      : id_(id), bytes_(bytes), charge_(std::move(charge)) {}
  FakeBuffer(FakeBuffer&& other) noexcept
      : id_(std::exchange(other.id_, 0)), bytes_(std::exchange(other.bytes_, 0)), charge_(std::move(other.charge_)) {}
  FakeBuffer& operator=(FakeBuffer&& other) noexcept {
    id_ = std::exchange(other.id_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
    charge_ = std::move(other.charge_);
    return *this;
  }

  bool empty() const { return bytes_ == 0; }
  std::uint64_t size_bytes() const { return bytes_; }
  std::uint64_t id() const { return id_; }

 private:
  std::uint64_t id_ = 0;
  std::uint64_t bytes_ = 0;
  core::BudgetCharge charge_;
};

using Cache = BufferCache<FakeBuffer>;

// Allocates FakeBuffers under a budget of kLimitBytes (kResourceExhausted
// over it, as gpu::Device::allocate does), or fails with `fail_with` when set.
// Records every request. Thread-safe.
class FakeAllocator {
 public:
  static constexpr std::uint64_t kLimitBytes = 1000;

  Cache::Allocate fn() {
    return [this](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd) -> core::Result<FakeBuffer> {
      const std::lock_guard<std::mutex> lock(mu_);
      requests_.push_back(bytes);
      whats_.push_back(what);
      if (!fail_with_.ok()) return fail_with_;
      core::Result<core::BudgetCharge> charge = budget_.charge(bytes, what);
      if (!charge.ok()) return charge.status();
      return FakeBuffer(next_id_++, bytes, std::move(charge).value());
    };
  }
  void fail_with(core::Status s) {
    const std::lock_guard<std::mutex> lock(mu_);
    fail_with_ = std::move(s);
  }
  std::vector<std::uint64_t> requests() {
    const std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  std::vector<std::string> whats() {
    const std::lock_guard<std::mutex> lock(mu_);
    return whats_;
  }
  std::uint64_t used_bytes() const { return budget_.used_bytes(); }

 private:
  core::MemoryBudget budget_{"fake device memory", kLimitBytes, "test.budget"};
  std::mutex mu_;
  std::vector<std::uint64_t> requests_;
  std::vector<std::string> whats_;
  core::Status fail_with_;
  std::uint64_t next_id_ = 1;
};

// Fences as the cache sees them: each a gpu::Event (never recorded; only its
// address matters here) with a flag saying whether its work is done. wait()
// records the call, marks the fence done and returns its set result; query()
// records the call and returns the flag. Keeps every fence alive so that
// addresses stay unique. Thread-safe.
class FakeFences {
 public:
  std::shared_ptr<gpu::Event> make(bool passed) {
    auto fence = std::make_shared<gpu::Event>();
    const std::lock_guard<std::mutex> lock(mu_);
    passed_[fence.get()] = passed;
    all_.push_back(fence);
    return fence;
  }
  void set_wait_result(const std::shared_ptr<gpu::Event>& fence, core::Status s) {
    const std::lock_guard<std::mutex> lock(mu_);
    wait_results_[fence.get()] = std::move(s);
  }
  Cache::Wait wait_fn() {
    return [this](gpu::Event& fence) {
      const std::lock_guard<std::mutex> lock(mu_);
      waited_.push_back(&fence);
      passed_[&fence] = true;
      auto it = wait_results_.find(&fence);
      return it == wait_results_.end() ? core::Status() : it->second;
    };
  }
  Cache::Query query_fn() {
    return [this](gpu::Event& fence) -> core::Result<bool> {
      const std::lock_guard<std::mutex> lock(mu_);
      queried_.push_back(&fence);
      return passed_.at(&fence);
    };
  }
  std::vector<const gpu::Event*> waited() {
    const std::lock_guard<std::mutex> lock(mu_);
    return waited_;
  }
  std::vector<const gpu::Event*> queried() {
    const std::lock_guard<std::mutex> lock(mu_);
    return queried_;
  }

 private:
  std::mutex mu_;
  std::map<const gpu::Event*, bool> passed_;
  std::map<const gpu::Event*, core::Status> wait_results_;
  std::vector<std::shared_ptr<gpu::Event>> all_;
  std::vector<const gpu::Event*> waited_;
  std::vector<const gpu::Event*> queried_;
};

class BufferCacheTest : public ::testing::Test {
 protected:
  // A buffer straight from the allocator, as a caller would have got it.
  FakeBuffer fresh(std::uint64_t bytes) {
    core::Result<FakeBuffer> b = alloc_.fn()(bytes, "fresh", gpu::ArenaEnd::kLow);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(b).value() : FakeBuffer();
  }

  FakeAllocator alloc_;
  FakeFences fences_;
};

TEST_F(BufferCacheTest, GetReusesAPutBufferOfTheSameSize) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  core::Result<FakeBuffer> first = cache.get(100, "grads");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::uint64_t id = first->id();
  cache.put(std::move(first).value());

  core::Result<FakeBuffer> again = cache.get(100, "grads");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id(), id);
  EXPECT_EQ(again->size_bytes(), 100u);
  EXPECT_EQ(alloc_.requests(), std::vector<std::uint64_t>{100});
  EXPECT_EQ(alloc_.whats(), std::vector<std::string>{"grads"});
  // The cached buffer stayed charged; handed out, it is still the only charge.
  EXPECT_EQ(alloc_.used_bytes(), 100u);
}

TEST_F(BufferCacheTest, GetAllocatesWhenOnlyOtherSizesAreCached) {
  Cache cache(alloc_.fn());
  FakeBuffer big = fresh(300);
  FakeBuffer small = fresh(100);
  const std::uint64_t big_id = big.id();
  const std::uint64_t small_id = small.id();
  cache.put(std::move(big));
  cache.put(std::move(small));

  // Neither a bigger nor a smaller buffer serves a request: sizes match exactly.
  core::Result<FakeBuffer> mid = cache.get(200, "mid");
  ASSERT_TRUE(mid.ok()) << mid.status();
  EXPECT_NE(mid->id(), big_id);
  EXPECT_NE(mid->id(), small_id);
  EXPECT_EQ(mid->size_bytes(), 200u);

  core::Result<FakeBuffer> s = cache.get(100, "small");
  core::Result<FakeBuffer> b = cache.get(300, "big");
  ASSERT_TRUE(s.ok() && b.ok());
  EXPECT_EQ(s->id(), small_id);
  EXPECT_EQ(b->id(), big_id);
  // fresh() twice, then only the 200-byte request reached the allocator.
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{300, 100, 200}));
}

TEST_F(BufferCacheTest, PutDropsAnEmptyBufferWithoutCallingTheDivert) {
  int diverted = 0;
  Cache cache(alloc_.fn(), nullptr, nullptr, [&](FakeBuffer&, std::shared_ptr<gpu::Event>&) {
    ++diverted;
    return false;
  });
  cache.put(FakeBuffer());
  cache.put_returned(FakeBuffer());
  EXPECT_EQ(diverted, 0);
  // Nothing was kept: a request of the empty buffer's size goes to the allocator.
  core::Result<FakeBuffer> b = cache.get(0, "zero");
  EXPECT_EQ(alloc_.requests(), std::vector<std::uint64_t>{0});
}

TEST_F(BufferCacheTest, GetWaitsForTheFenceOfACachedBuffer) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  FakeBuffer b = fresh(100);
  const std::uint64_t id = b.id();
  std::shared_ptr<gpu::Event> fence = fences_.make(/*passed=*/false);
  cache.put(std::move(b), fence);
  EXPECT_TRUE(fences_.waited().empty());  // put() never waits

  core::Result<FakeBuffer> got = cache.get(100, "x");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id(), id);
  EXPECT_EQ(fences_.waited(), std::vector<const gpu::Event*>{fence.get()});
}

// Of two cached buffers of one size, get() takes one whose fence has passed
// (asking query(), which never blocks) before waiting for another's.
TEST_F(BufferCacheTest, GetPrefersABufferWhoseFenceHasPassed) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  FakeBuffer busy = fresh(100), free = fresh(100);
  const std::uint64_t free_id = free.id();
  cache.put(std::move(busy), fences_.make(/*passed=*/false));
  cache.put(std::move(free), fences_.make(/*passed=*/true));
  core::Result<FakeBuffer> got = cache.get(100, "x");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id(), free_id);
  EXPECT_TRUE(fences_.waited().empty()) << "get() waited although a passed buffer was there";
}

TEST_F(BufferCacheTest, GetReturnsTheErrorOfTheWaitOnAFence) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  std::shared_ptr<gpu::Event> fence = fences_.make(/*passed=*/false);
  fences_.set_wait_result(fence, core::Status::io_error("stream 'engine' failed"));
  cache.put(fresh(100), fence);

  core::Result<FakeBuffer> got = cache.get(100, "x");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), core::StatusCode::kIoError);
  EXPECT_EQ(got.status().message(), "stream 'engine' failed");
  EXPECT_EQ(fences_.waited().size(), 1u);
}

TEST_F(BufferCacheTest, GetWithoutAWaitFunctionHandsOutAFencedBuffer) {
  Cache cache(alloc_.fn());
  FakeBuffer b = fresh(100);
  const std::uint64_t id = b.id();
  cache.put(std::move(b), fences_.make(/*passed=*/false));
  core::Result<FakeBuffer> got = cache.get(100, "x");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->id(), id);
}

TEST_F(BufferCacheTest, GetFencedPrefersABufferWhoseFenceHasPassed) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  FakeBuffer pending_buf = fresh(100);
  FakeBuffer passed_buf = fresh(100);
  const std::uint64_t pending_id = pending_buf.id();
  const std::uint64_t passed_id = passed_buf.id();
  std::shared_ptr<gpu::Event> pending = fences_.make(/*passed=*/false);
  std::shared_ptr<gpu::Event> passed = fences_.make(/*passed=*/true);
  cache.put(std::move(pending_buf), pending);  // older, still pending
  cache.put(std::move(passed_buf), passed);

  core::Result<Cache::Fenced> first = cache.get_fenced(100, "x");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->buffer.id(), passed_id);
  EXPECT_EQ(first->fence, nullptr);  // passed: free to write now
  EXPECT_EQ(fences_.queried(), (std::vector<const gpu::Event*>{pending.get(), passed.get()}));

  // Only the pending one is left: handed out at once, with its fence.
  core::Result<Cache::Fenced> second = cache.get_fenced(100, "x");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->buffer.id(), pending_id);
  EXPECT_EQ(second->fence, pending);
  EXPECT_TRUE(fences_.waited().empty());
  EXPECT_EQ(alloc_.requests().size(), 2u);  // only fresh()
}

TEST_F(BufferCacheTest, GetFencedHandsOutTheOldestWhenNoFenceHasPassed) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  FakeBuffer older = fresh(100);
  const std::uint64_t older_id = older.id();
  std::shared_ptr<gpu::Event> older_fence = fences_.make(/*passed=*/false);
  cache.put(std::move(older), older_fence);
  cache.put(fresh(100), fences_.make(/*passed=*/false));

  core::Result<Cache::Fenced> got = cache.get_fenced(100, "x");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->buffer.id(), older_id);
  EXPECT_EQ(got->fence, older_fence);
  EXPECT_TRUE(fences_.waited().empty());
}

TEST_F(BufferCacheTest, GetFencedAllocatesWithoutAFenceWhenNothingIsCached) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  cache.put(fresh(300), fences_.make(/*passed=*/false));
  core::Result<Cache::Fenced> got = cache.get_fenced(100, "staging");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->buffer.size_bytes(), 100u);
  EXPECT_EQ(got->fence, nullptr);
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{300, 100}));
  EXPECT_EQ(alloc_.whats().back(), "staging");
  EXPECT_TRUE(fences_.waited().empty());
}

TEST_F(BufferCacheTest, RefusedAllocationEmptiesTheCacheAndRetriesOnce) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  std::shared_ptr<gpu::Event> fence = fences_.make(/*passed=*/false);
  cache.put(fresh(600), fence);
  cache.put(fresh(300));
  ASSERT_EQ(alloc_.used_bytes(), 900u);

  // 900 cached + 500 is over the 1000-byte budget: refused, then the cache
  // gives back both buffers (waiting for the fence first) and the retry fits.
  core::Result<FakeBuffer> got = cache.get(500, "params");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->size_bytes(), 500u);
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{600, 300, 500, 500}));
  EXPECT_EQ(fences_.waited(), std::vector<const gpu::Event*>{fence.get()});
  EXPECT_EQ(alloc_.used_bytes(), 500u);

  // The cache is empty now: a 300-byte request allocates.
  core::Result<FakeBuffer> again = cache.get(300, "params");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(alloc_.requests().size(), 5u);
}

TEST_F(BufferCacheTest, RefusedRetryReturnsResourceExhausted) {
  Cache cache(alloc_.fn());
  cache.put(fresh(100));
  core::Result<FakeBuffer> got = cache.get(FakeAllocator::kLimitBytes + 1, "too big");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), core::StatusCode::kResourceExhausted);
  // One try, one retry after clearing, no more.
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{100, 1001, 1001}));
  EXPECT_EQ(alloc_.used_bytes(), 0u);
}

TEST_F(BufferCacheTest, OtherAllocationErrorsKeepTheCacheAndDoNotRetry) {
  Cache cache(alloc_.fn());
  FakeBuffer b = fresh(100);
  const std::uint64_t id = b.id();
  cache.put(std::move(b));
  alloc_.fail_with(core::Status::out_of_memory("the backend's memory failed"));

  core::Result<FakeBuffer> got = cache.get(200, "x");
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), core::StatusCode::kOutOfMemory);
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{100, 200}));
  // The cached buffer is still there.
  EXPECT_EQ(alloc_.used_bytes(), 100u);
  core::Result<FakeBuffer> cached = cache.get(100, "x");
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(cached->id(), id);
}

TEST_F(BufferCacheTest, ClearWaitsForEveryFenceAndReturnsTheFirstError) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  std::shared_ptr<gpu::Event> ok_fence = fences_.make(/*passed=*/false);
  std::shared_ptr<gpu::Event> bad_a = fences_.make(/*passed=*/false);
  std::shared_ptr<gpu::Event> bad_b = fences_.make(/*passed=*/false);
  fences_.set_wait_result(bad_a, core::Status::io_error("first"));
  fences_.set_wait_result(bad_b, core::Status::internal("second"));
  // The cache walks its buffers by size: 100, 200, 300.
  cache.put(fresh(300), bad_b);
  cache.put(fresh(200), bad_a);
  cache.put(fresh(100), ok_fence);
  cache.put(fresh(50));

  core::Status s = cache.clear();
  EXPECT_EQ(s.code(), core::StatusCode::kIoError);
  EXPECT_EQ(s.message(), "first");
  EXPECT_EQ(fences_.waited(), (std::vector<const gpu::Event*>{ok_fence.get(), bad_a.get(), bad_b.get()}));
  // Every buffer was freed, the ones whose wait failed too.
  EXPECT_EQ(alloc_.used_bytes(), 0u);
  EXPECT_TRUE(cache.clear().ok());  // nothing left to wait for
}

TEST_F(BufferCacheTest, ClearEmptiesTheCache) {
  Cache cache(alloc_.fn());
  cache.put(fresh(100));
  cache.put(fresh(100));
  EXPECT_EQ(alloc_.used_bytes(), 200u);
  EXPECT_TRUE(cache.clear().ok());
  EXPECT_EQ(alloc_.used_bytes(), 0u);
  core::Result<FakeBuffer> got = cache.get(100, "x");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(alloc_.requests().size(), 3u);  // allocated anew
}

TEST_F(BufferCacheTest, DivertTakesBuffersUntilTheyArePutReturned) {
  struct Parked {
    FakeBuffer buffer;
    std::shared_ptr<gpu::Event> fence;
  };
  std::vector<Parked> parked;
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn(),
              [&](FakeBuffer& b, std::shared_ptr<gpu::Event>& fence) {
                if (b.size_bytes() != 100) return false;  // leaves others to the cache
                parked.push_back({std::move(b), std::move(fence)});
                return true;
              });
  FakeBuffer lent = fresh(100);
  const std::uint64_t lent_id = lent.id();
  std::shared_ptr<gpu::Event> fence = fences_.make(/*passed=*/false);
  cache.put(std::move(lent), fence);
  FakeBuffer kept = fresh(200);
  const std::uint64_t kept_id = kept.id();
  cache.put(std::move(kept));

  ASSERT_EQ(parked.size(), 1u);
  EXPECT_EQ(parked[0].buffer.id(), lent_id);
  EXPECT_EQ(parked[0].fence, fence);
  core::Result<FakeBuffer> other = cache.get(200, "x");
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->id(), kept_id);

  // While parked, the diverted buffer is not the cache's to hand out.
  core::Result<FakeBuffer> meanwhile = cache.get(100, "x");
  ASSERT_TRUE(meanwhile.ok());
  EXPECT_NE(meanwhile->id(), lent_id);

  // Handed back (past the divert), it is reused after its fence.
  cache.put_returned(std::move(parked[0].buffer), std::move(parked[0].fence));
  EXPECT_EQ(parked.size(), 1u);  // not diverted again
  core::Result<FakeBuffer> back = cache.get(100, "x");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->id(), lent_id);
  EXPECT_EQ(fences_.waited(), std::vector<const gpu::Event*>{fence.get()});
}

// Under a tight budget (the headroom: the memory in use leaves no more room
// than the buffer asked for and the largest one allocated), a get() gives
// back its end's cached buffers first, waiting for a fence that has not
// passed, and places its buffer afresh, a (low-end) hit too. With room to
// spare, the cache keeps them and hands a hit out.
TEST_F(BufferCacheTest, UnderATightBudgetGetGivesBackTheCacheAndPlacesAfresh) {
  Cache cache(alloc_.fn(), fences_.wait_fn(), fences_.query_fn());
  cache.set_headroom([this] { return FakeAllocator::kLimitBytes - alloc_.used_bytes(); });
  for (std::uint64_t bytes : {100, 150, 200}) {
    core::Result<FakeBuffer> b = cache.get(bytes, "x");
    ASSERT_TRUE(b.ok()) << b.status();
    cache.put(std::move(b).value(), bytes == 150 ? fences_.make(/*passed=*/false) : nullptr);
  }
  core::Result<FakeBuffer> held = cache.get(300, "held");  // in use throughout: 700 of room left
  ASSERT_TRUE(held.ok()) << held.status();
  // 250 and the largest (300) fit in 700 with room to spare: the cache is kept.
  core::Result<FakeBuffer> roomy = cache.get(250, "roomy");
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  EXPECT_EQ(alloc_.used_bytes(), 1000u);
  cache.put(std::move(roomy).value());
  core::Result<FakeBuffer> hit = cache.get(200, "hit");
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(alloc_.requests().size(), 5u) << "a hit with room to spare";
  cache.put(std::move(hit).value());
  EXPECT_TRUE(fences_.waited().empty());
  // 450 and the largest leave no room: all four cached go first, the fenced 150 after its
  // fence, and the new one is allocated with no refusal (cleared by a refusal, it would be
  // asked for twice).
  core::Result<FakeBuffer> tight = cache.get(450, "tight");
  ASSERT_TRUE(tight.ok()) << tight.status();
  EXPECT_EQ(alloc_.used_bytes(), 300u + 450u);
  EXPECT_EQ(fences_.waited().size(), 1u);
  EXPECT_EQ(alloc_.requests(), (std::vector<std::uint64_t>{100, 150, 200, 300, 250, 450}));
  // A hit under the tight budget is placed afresh: a new buffer, not the cached one.
  const std::uint64_t cached_id = tight->id();
  cache.put(std::move(tight).value());
  core::Result<FakeBuffer> again = cache.get(450, "again");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->id(), cached_id);
  EXPECT_EQ(alloc_.used_bytes(), 300u + 450u);
}

TEST_F(BufferCacheTest, ConcurrentGetAndPutNeverHandOutABufferTwice) {
  Cache cache(alloc_.fn());
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::mutex mu;
  std::map<std::uint64_t, int> holders;  // buffer id -> threads holding it
  std::atomic<int> twice{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const std::uint64_t bytes = 10 + 10 * ((t + i) % 3);
        core::Result<FakeBuffer> b = cache.get(bytes, "x");
        if (!b.ok()) {
          ADD_FAILURE() << b.status();
          return;
        }
        {
          const std::lock_guard<std::mutex> lock(mu);
          if (++holders[b->id()] > 1) ++twice;
        }
        {
          const std::lock_guard<std::mutex> lock(mu);
          --holders[b->id()];
        }
        cache.put(std::move(b).value());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(twice.load(), 0);
  // At most one buffer per thread and size was ever needed.
  EXPECT_LE(alloc_.requests().size(), static_cast<std::size_t>(kThreads * 3));
}

// The same over the host device: its budget refuses, the cache gives back
// what it holds, and a fence recorded on a stream is waited for.
// The device's allocate, each request's size appended to `requests`.
BufferCache<gpu::DeviceBuffer>::Allocate recording_allocator(gpu::Device& d, std::vector<std::uint64_t>& requests) {
  return [&d, &requests](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) {
    requests.push_back(bytes);
    return d.allocate(bytes, what, end);
  };
}

// A fence recorded on `stream` behind `ms` of work still running: it has not
// passed when the caller goes on. Null (with a test failure) on an error.
std::shared_ptr<gpu::Event> fence_behind_work(gpu::Device& d, gpu::Stream& stream, int ms) {
  auto fence = d.create_event();
  if (!fence.ok()) {
    ADD_FAILURE() << fence.status();
    return nullptr;
  }
  const core::Status queued =
      d.host_callback(stream, [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  const core::Status recorded = queued.ok() ? d.record(*fence, stream) : queued;
  if (!recorded.ok()) {
    ADD_FAILURE() << recorded;
    return nullptr;
  }
  return std::make_shared<gpu::Event>(std::move(fence).value());
}

TEST(BufferCacheHostDevice, RetriesUnderTheDeviceBudgetAndWaitsForRecordedFences) {
  core::MemoryBudget device_budget{"device memory", 1 << 20, "strata.budgets.device"};
  core::MemoryBudget pinned_budget{"pinned host memory", 1 << 20, "strata.budgets.pinned"};
  auto device_or = gpu::make_host_device({{&device_budget, &pinned_budget}, {}});
  ASSERT_TRUE(device_or.ok()) << device_or.status();
  gpu::Device* d = device_or->get();
  auto stream = d->create_stream("test");
  ASSERT_TRUE(stream.ok()) << stream.status();

  int waits = 0;
  std::vector<std::uint64_t> requests;
  BufferCache<gpu::DeviceBuffer> cache(
      recording_allocator(*d, requests),
      [&](gpu::Event& fence) {
        ++waits;
        return d->synchronize(fence);
      },
      [d](gpu::Event& fence) { return d->query(fence); });

  constexpr std::uint64_t kBig = 768 << 10;
  constexpr std::uint64_t kSmall = 512 << 10;
  core::Result<gpu::DeviceBuffer> big = cache.get(kBig, "big");
  ASSERT_TRUE(big.ok()) << big.status();
  const std::uint64_t big_id = big->id();
  // Work still running when get() comes (a fence that has passed is not waited for).
  std::shared_ptr<gpu::Event> fence = fence_behind_work(*d, *stream, 200);
  ASSERT_NE(fence, nullptr);
  cache.put(std::move(big).value(), std::move(fence));

  core::Result<gpu::DeviceBuffer> again = cache.get(kBig, "big");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id(), big_id);
  EXPECT_EQ(waits, 1);
  cache.put(std::move(again).value());

  // 768 KiB cached + 512 KiB is over the 1 MiB budget: refused once, then it fits.
  core::Result<gpu::DeviceBuffer> small = cache.get(kSmall, "small");
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(requests, (std::vector<std::uint64_t>{kBig, kSmall, kSmall}));
  EXPECT_EQ(device_budget.used_bytes(), kSmall);
  small->reset();
  ASSERT_TRUE(d->synchronize(*stream).ok());
}

// Within the budget but with the arena fragmented by cached buffers (a run on
// the CUDA device at the least budget the planner names met this): the cache
// gives them back and the allocation fits.
TEST(BufferCacheHostDevice, AFragmentedArenaIsAnsweredByGivingTheCacheBack) {
  core::MemoryBudget device_budget{"device memory", 1 << 20, "strata.budgets.device"};
  core::MemoryBudget pinned_budget{"pinned host memory", 1 << 20, "strata.budgets.pinned"};
  auto device_or = gpu::make_host_device({{&device_budget, &pinned_budget}, {}, /*arena=*/true});
  ASSERT_TRUE(device_or.ok()) << device_or.status();
  gpu::Device* d = device_or->get();
  std::vector<std::uint64_t> requests;
  BufferCache<gpu::DeviceBuffer> cache(recording_allocator(*d, requests));
  constexpr std::uint64_t kQuarter = 256 << 10;
  std::vector<gpu::DeviceBuffer> held;
  for (int i = 0; i < 4; ++i) {
    core::Result<gpu::DeviceBuffer> b = cache.get(kQuarter, "quarter");
    ASSERT_TRUE(b.ok()) << b.status();
    held.push_back(std::move(b).value());
  }
  // The first cached, the second and fourth freed, the third in use: half the budget is free,
  // but the arena's free ranges are two quarters apart.
  cache.put(std::move(held[0]));
  held[1].reset();
  held[3].reset();
  EXPECT_EQ(device_budget.used_bytes(), 2 * kQuarter);
  requests.clear();
  core::Result<gpu::DeviceBuffer> half = cache.get(2 * kQuarter, "half");
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(requests, (std::vector<std::uint64_t>{2 * kQuarter, 2 * kQuarter}));  // refused once, then it fits
  EXPECT_EQ(device_budget.used_bytes(), 3 * kQuarter);
}

// An unlimited device budget (strata.device "auto" falling back to the host
// device with no strata.budgets.device) keeps no arena: both ends allocate,
// the cache with its headroom is never tight.
TEST(BufferCacheHostDevice, AnUnlimitedBudgetAllocatesFromBothEnds) {
  core::MemoryBudget device_budget{"device memory", core::MemoryBudget::kUnlimited, "strata.budgets.device"};
  core::MemoryBudget pinned_budget{"pinned host memory", 1 << 20, "strata.budgets.pinned"};
  auto device_or = gpu::make_host_device({{&device_budget, &pinned_budget}, {}});
  ASSERT_TRUE(device_or.ok()) << device_or.status();
  gpu::Device* d = device_or->get();
  std::vector<std::uint64_t> requests;
  BufferCache<gpu::DeviceBuffer> cache(recording_allocator(*d, requests));
  cache.set_headroom([&] { return device_budget.available_bytes(); });
  for (gpu::ArenaEnd end : {gpu::ArenaEnd::kHigh, gpu::ArenaEnd::kLow, gpu::ArenaEnd::kHigh}) {
    core::Result<gpu::DeviceBuffer> b = cache.get(64 << 10, "gradients", end);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->arena_end(), end);
    cache.put(std::move(b).value());
  }
  EXPECT_EQ(requests.size(), 2u) << "one buffer per end, the second high one a hit";
}

// The least device budget of a step (tests/python/test_adapter.py's): one
// group's fetched copies with its gradients, no byte to spare. A smaller
// group's copies, cached at the bottom, would push the large group's copies
// up, and once given back leave a range too small for its gradients. With
// the headroom, the large group's fetch for the backward is placed afresh
// once the small one is given back (after its fence: the framework still
// reads it); the gradients come from the high end, away from the fetched
// copies.
TEST(BufferCacheHostDevice, TheLeastBudgetFitsAGroupsCopiesAndItsGradients) {
  constexpr std::uint64_t kSmall = 8 << 10, kLarge = 36 << 10;
  core::MemoryBudget device_budget{"device memory", 2 * kLarge, "strata.budgets.device"};
  core::MemoryBudget pinned_budget{"pinned host memory", 1 << 20, "strata.budgets.pinned"};
  auto device_or = gpu::make_host_device({{&device_budget, &pinned_budget}, {}, /*arena=*/true});
  ASSERT_TRUE(device_or.ok()) << device_or.status();
  gpu::Device* d = device_or->get();
  auto stream = d->create_stream("framework");
  ASSERT_TRUE(stream.ok()) << stream.status();
  BufferCache<gpu::DeviceBuffer> cache(
      [&](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) { return d->allocate(bytes, what, end); },
      [d](gpu::Event& fence) { return d->synchronize(fence); }, [d](gpu::Event& fence) { return d->query(fence); });
  cache.set_headroom([&] { return device_budget.available_bytes(); });
  // One step: the forward (the small group, released with a fence the framework's stream has
  // not reached yet, then the large one), the backward (the large group fetched again, then its
  // gradients). The status of the gradients' allocation.
  const auto step = [&](BufferCache<gpu::DeviceBuffer>& c) -> core::Status {
    core::Result<gpu::DeviceBuffer> embed = c.get(kSmall, "fetched group 'embed'");
    if (!embed.ok()) return embed.status();
    std::shared_ptr<gpu::Event> fence = fence_behind_work(*d, *stream, 50);
    if (fence == nullptr) return core::Status::internal("no fence");
    c.put(std::move(embed).value(), std::move(fence));
    core::Result<gpu::DeviceBuffer> forward = c.get(kLarge, "fetched group 'layer'");
    if (!forward.ok()) return forward.status();
    c.put(std::move(forward).value());
    core::Result<gpu::DeviceBuffer> layer = c.get(kLarge, "fetched group 'layer'");
    if (!layer.ok()) return layer.status();
    core::Result<gpu::DeviceBuffer> grads = c.get(kLarge, "gradients of group 'layer'", gpu::ArenaEnd::kHigh);
    if (!grads.ok()) return grads.status();
    EXPECT_EQ(grads->arena_end(), gpu::ArenaEnd::kHigh);
    c.put(std::move(grads).value());
    c.put(std::move(layer).value());
    return core::Status();
  };
  for (int i = 0; i < 3; ++i) {
    const core::Status s = step(cache);
    ASSERT_TRUE(s.ok()) << "step " << i << ": " << s;
  }
  // Without the headroom the same step fails: the small buffer stays below the large one.
  ASSERT_TRUE(cache.clear().ok());
  BufferCache<gpu::DeviceBuffer> plain([&](std::uint64_t bytes, const std::string& what, gpu::ArenaEnd end) {
    return d->allocate(bytes, what, end);
  });
  const core::Status s = step(plain);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no free range"), std::string_view::npos) << s;
  ASSERT_TRUE(d->synchronize(*stream).ok());
  ASSERT_TRUE(plain.clear().ok());
}

}  // namespace
}  // namespace strata::engine
