// The Communicator's conformance suite: every backend this build has, the
// ranks as threads of this process (Gloo meeting through a file store in a
// fresh directory), N = 1, 2, 3.
#include "partition/communicator.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/numerics.h"
#include "core/str.h"
#include "tests/partition/temp_dir.h"

namespace strata::partition {
namespace {

using core::StatusCode;
namespace nx = core::numerics;

using testing_util::TempDir;

CommunicatorOptions opts(std::string backend, int rank, int size, std::string store_dir = {}) {
  CommunicatorOptions o;
  o.backend = std::move(backend);
  o.rank = rank;
  o.size = size;
  o.store_dir = std::move(store_dir);
  return o;
}

struct World {
  std::string backend;
  int size;
};

std::string world_name(const testing::TestParamInfo<World>& info) {
  return info.param.backend + std::to_string(info.param.size);
}

class CommunicatorTest : public testing::TestWithParam<World> {
 protected:
  void SetUp() override {
    if (!has_backend(GetParam().backend)) GTEST_SKIP() << "this build has no " << GetParam().backend << " backend";
  }

  CommunicatorOptions options(int rank, std::chrono::milliseconds timeout = std::chrono::seconds(30)) const {
    CommunicatorOptions o;
    o.backend = GetParam().backend;
    o.rank = rank;
    o.size = GetParam().size;
    o.store_dir = store_.path();
    o.timeout = timeout;
    return o;
  }

  // Runs body(rank, communicator) on every rank, one thread each.
  // Each call meets under a prefix of its own (a store's keys are written once).
  void on_every_rank(const std::function<void(int, Communicator&)>& body) {
    const std::string prefix = "world" + std::to_string(worlds_++);
    std::vector<std::thread> threads;
    for (int r = 0; r < GetParam().size; ++r) {
      threads.emplace_back([&, r] {
        CommunicatorOptions o = options(r);
        o.prefix = prefix;
        auto c = make_communicator(o);
        ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status().to_string();
        EXPECT_EQ((*c)->rank(), r);
        EXPECT_EQ((*c)->size(), GetParam().size);
        body(r, **c);
      });
    }
    for (std::thread& t : threads) t.join();
  }

  TempDir store_;
  int worlds_ = 0;
};

// Values whose fp32 sum depends on the order: rank 0 large, the others small.
float value(int rank, std::size_t i) {
  const float big = 1.0e8f * static_cast<float>(1 + i % 3);
  return rank == 0 ? big : (rank % 2 == 1 ? 3.0f + static_cast<float>(i % 7) * 0.25f : -big);
}

float sum_in_rank_order(int ranks, std::size_t i) {
  float acc = value(0, i);
  for (int r = 1; r < ranks; ++r) acc = nx::add_f32(acc, value(r, i));
  return acc;
}

TEST_P(CommunicatorTest, AllReduceSumsInRankOrderAndEveryRankHasTheSameBits) {
  const int n = GetParam().size;
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{4096}}) {
    on_every_rank([&](int r, Communicator& c) {
      std::vector<float> x(count);
      for (std::size_t i = 0; i < count; ++i) x[i] = value(r, i);
      ASSERT_TRUE(c.all_reduce(x.data(), count, DType::kF32, ReduceOp::kSum).ok());
      for (std::size_t i = 0; i < count; ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(x[i]), std::bit_cast<std::uint32_t>(sum_in_rank_order(n, i)))
            << "rank " << r << ", element " << i << " of " << count;
      }
    });
  }
}

TEST_P(CommunicatorTest, AllReduceOfEachTypeAndMax) {
  const int n = GetParam().size;
  on_every_rank([&](int r, Communicator& c) {
    std::vector<double> d = {0.1 * (r + 1), -2.0 * r};
    ASSERT_TRUE(c.all_reduce(d.data(), d.size(), DType::kF64, ReduceOp::kSum).ok());
    double want0 = 0.1, want1 = 0.0;
    for (int q = 1; q < n; ++q) want0 += 0.1 * (q + 1), want1 += -2.0 * q;
    EXPECT_EQ(d[0], want0);
    EXPECT_EQ(d[1], want1);

    std::vector<std::int64_t> k = {std::int64_t{1} << 40, r};
    ASSERT_TRUE(c.all_reduce(k.data(), k.size(), DType::kI64, ReduceOp::kSum).ok());
    EXPECT_EQ(k[0], (std::int64_t{1} << 40) * n);
    EXPECT_EQ(k[1], static_cast<std::int64_t>(n) * (n - 1) / 2);

    // bf16: summed in fp32 in rank order, rounded once.
    std::vector<std::uint16_t> h = {nx::fp32_to_bf16_bits(1.0f + r), nx::fp32_to_bf16_bits(0.00390625f)};
    ASSERT_TRUE(c.all_reduce(h.data(), h.size(), DType::kBf16, ReduceOp::kSum).ok());
    float s0 = 1.0f, s1 = 0.00390625f;
    for (int q = 1; q < n; ++q) s0 += 1.0f + q, s1 += 0.00390625f;
    EXPECT_EQ(h[0], nx::fp32_to_bf16_bits(s0));
    EXPECT_EQ(h[1], nx::fp32_to_bf16_bits(s1));

    // max, with a NaN on the last rank: the flag every rank must agree on.
    std::vector<float> m = {static_cast<float>(r), r == n - 1 ? std::nanf("") : -1.0f};
    ASSERT_TRUE(c.all_reduce(m.data(), m.size(), DType::kF32, ReduceOp::kMax).ok());
    EXPECT_EQ(m[0], static_cast<float>(n - 1));
    EXPECT_TRUE(std::isnan(m[1]));
  });
}

TEST_P(CommunicatorTest, ReduceScatterGivesEachRankItsShardOfTheSum) {
  const int n = GetParam().size;
  const std::size_t shard = 300;
  on_every_rank([&](int r, Communicator& c) {
    std::vector<float> send(shard * static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = value(r, i);
    std::vector<float> recv(shard, -7.0f);
    ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), shard, DType::kF32, ReduceOp::kSum).ok());
    for (std::size_t i = 0; i < shard; ++i) {
      const std::size_t global = static_cast<std::size_t>(r) * shard + i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(recv[i]), std::bit_cast<std::uint32_t>(sum_in_rank_order(n, global)))
          << "rank " << r << ", element " << i;
    }
  });
}

TEST_P(CommunicatorTest, AllGatherPutsEachRanksBlockInItsPlaceAlsoInPlace) {
  const int n = GetParam().size;
  const std::size_t count = 129;
  on_every_rank([&](int r, Communicator& c) {
    std::vector<std::int32_t> mine(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = r * 100000 + static_cast<std::int32_t>(i);
    std::vector<std::int32_t> all(count * static_cast<std::size_t>(n), -1);
    ASSERT_TRUE(c.all_gather(mine.data(), all.data(), count, DType::kI32).ok());
    std::vector<std::int32_t> in_place(count * static_cast<std::size_t>(n), -1);
    std::memcpy(in_place.data() + static_cast<std::size_t>(r) * count, mine.data(), count * 4);
    ASSERT_TRUE(c.all_gather(in_place.data() + static_cast<std::size_t>(r) * count, in_place.data(), count,
                             DType::kI32)
                    .ok());
    for (int q = 0; q < n; ++q) {
      for (std::size_t i = 0; i < count; ++i) {
        const std::size_t at = static_cast<std::size_t>(q) * count + i;
        ASSERT_EQ(all[at], q * 100000 + static_cast<std::int32_t>(i)) << "rank " << r << " block " << q;
        ASSERT_EQ(in_place[at], all[at]);
      }
    }
  });
}

TEST_P(CommunicatorTest, BroadcastFromEveryRootAndBarrier) {
  const int n = GetParam().size;
  on_every_rank([&](int r, Communicator& c) {
    for (int root = 0; root < n; ++root) {
      std::vector<std::uint8_t> b(333, static_cast<std::uint8_t>(r == root ? 200 + root : 1));
      ASSERT_TRUE(c.broadcast(b.data(), b.size(), DType::kU8, root).ok());
      for (std::uint8_t x : b) ASSERT_EQ(x, 200 + root) << "rank " << r << ", root " << root;
      ASSERT_TRUE(c.barrier().ok());
    }
  });
}

TEST_P(CommunicatorTest, ARefusedCallIsNamedAndBreaksTheCommunicator) {
  // Refused before any rank waits; the communicator is broken after it, since
  // the others' matching call would pair with the wrong one.
  auto refused = [&](const std::function<core::Status(Communicator&)>& call, std::string_view fragment) {
    on_every_rank([&](int r, Communicator& c) {
      const core::Status s = call(c);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find(fragment), std::string_view::npos) << s.to_string();
      const core::Status after = c.barrier();
      EXPECT_EQ(after.code(), StatusCode::kFailedPrecondition) << "rank " << r << ": " << after.to_string();
      EXPECT_NE(after.message().find("broke at an earlier call"), std::string_view::npos) << after.to_string();
    });
  };
  float x = 1.0f;
  int stream = 0;
  refused([&](Communicator& c) { return c.all_reduce(&x, 1, DType::kF32, ReduceOp::kSum, &stream); }, "stream");
  refused([&](Communicator& c) { return c.all_reduce(nullptr, 4, DType::kF32, ReduceOp::kSum); }, "null buffer");
  refused([&](Communicator& c) { return c.broadcast(&x, 1, DType::kF32, GetParam().size); }, "root");
  refused([&](Communicator& c) { return c.all_reduce(&x, 1, DType::kF32, static_cast<ReduceOp>(7)); },
          "unknown reduce op");
  refused([&](Communicator& c) { return c.all_gather(&x, &x, std::size_t{1} << 62, DType::kF64); }, "overflow");
}

TEST_P(CommunicatorTest, Fp16SumsInFp32AndRoundsOnce) {
  const int n = GetParam().size;
  on_every_rank([&](int, Communicator& c) {
    std::vector<std::uint16_t> h = {nx::fp32_to_fp16_bits(1.0f), nx::fp32_to_fp16_bits(0.0009765625f)};
    ASSERT_TRUE(c.all_reduce(h.data(), h.size(), DType::kF16, ReduceOp::kSum).ok());
    float s0 = 1.0f, s1 = 0.0009765625f;
    for (int q = 1; q < n; ++q) s0 += 1.0f, s1 += 0.0009765625f;
    EXPECT_EQ(h[0], nx::fp32_to_fp16_bits(s0));
    EXPECT_EQ(h[1], nx::fp32_to_fp16_bits(s1));
    EXPECT_TRUE(c.synchronize().ok());  // nothing queued on a host backend
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, CommunicatorTest,
                         testing::Values(World{"self", 1}, World{"gloo", 1}, World{"gloo", 2}, World{"gloo", 3}),
                         world_name);

// --- failures --------------------------------------------------------------------------

TEST(CommunicatorFailure, ARankThatDoesNotTakePartFailsTheOthersWithinTheTimeout) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  TempDir store;
  std::atomic<bool> done{false};
  core::Status first, after;
  double seconds = 0.0;
  std::thread idle([&] {
    CommunicatorOptions o = opts("gloo", 1, 2, store.path());
    o.timeout = std::chrono::milliseconds(800);
    o.connect_timeout = std::chrono::seconds(60);
    auto c = make_communicator(o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // alive, never calling
  });
  {
    CommunicatorOptions o = opts("gloo", 0, 2, store.path());
    o.timeout = std::chrono::milliseconds(800);
    o.connect_timeout = std::chrono::seconds(60);
    auto c = make_communicator(o);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    std::vector<float> x(64, 1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    first = (*c)->all_reduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    after = (*c)->barrier();
  }
  done = true;
  idle.join();
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.code(), StatusCode::kUnavailable) << first.to_string();
  EXPECT_NE(first.message().find("all_reduce on rank 0 of 2 (gloo)"), std::string_view::npos) << first.to_string();
  EXPECT_NE(first.message().find("800 ms timeout"), std::string_view::npos) << first.to_string();
  // With two ranks the one that did not take part can only be the other.
  EXPECT_NE(first.message().find("rank 1 did not take part"), std::string_view::npos) << first.to_string();
  EXPECT_LT(seconds, 60.0);  // it ended; a hang would have run into the test's limit
  EXPECT_EQ(after.code(), StatusCode::kFailedPrecondition) << after.to_string();
  EXPECT_NE(after.message().find("broke at an earlier call"), std::string_view::npos) << after.to_string();
}

// A rank whose connections close (its communicator destroyed, as while its
// process exits: the sockets close a moment before the process is seen to
// have ended) fails the other's call at once, naming it as failed, not late.
// Either rank leaves, three times each: Gloo names the peer's address in
// its error only on one side of a pair (which side connected depends on the
// ports drawn), and the other side is the case this is about.
TEST(CommunicatorFailure, ARankWhoseConnectionsCloseIsNamedAsFailedNotLate) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  for (int round = 0; round < 6; ++round) {
    const int leaver = round % 2;
    TempDir store;
    const int stayer = 1 - leaver;
    core::Status got;
    double seconds = 0.0;
    std::thread leaving([&] {
      CommunicatorOptions o = opts("gloo", leaver, 2, store.path());
      o.timeout = std::chrono::seconds(20);
      auto c = make_communicator(o);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      ASSERT_TRUE((*c)->barrier().ok());
    });  // its communicator is destroyed here: the sockets close
    {
      CommunicatorOptions o = opts("gloo", stayer, 2, store.path());
      o.timeout = std::chrono::seconds(20);
      auto c = make_communicator(o);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      ASSERT_TRUE((*c)->barrier().ok());
      leaving.join();
      std::vector<float> x(1024, 1.0f);
      const auto t0 = std::chrono::steady_clock::now();
      got = (*c)->all_reduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    ASSERT_FALSE(got.ok()) << "rank " << stayer;
    EXPECT_EQ(got.code(), StatusCode::kUnavailable) << got.to_string();
    EXPECT_NE(got.message().find(core::str_cat("rank ", leaver, " failed or left")), std::string_view::npos)
        << "rank " << stayer << ": " << got.to_string();
    EXPECT_LT(seconds, 10.0) << "rank " << stayer << ": it waited out the timeout: " << got.to_string();
  }
}

// A store of the caller's in memory, shared by ranks that are threads (a
// framework's TCP store stands there in a run over several machines).
class MemoryStore final : public RendezvousStore {
 public:
  core::Status set(const std::string& key, const std::vector<char>& value) override {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!values_.emplace(key, value).second) return core::Status::already_exists(key);
    ++sets_;
    cv_.notify_all();
    return core::Status();
  }
  core::Result<std::vector<char>> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return values_.contains(key); })) {
      return core::Status::unavailable(core::str_cat("no key '", key, "'"));
    }
    return values_.at(key);
  }
  int sets() {
    const std::lock_guard<std::mutex> lock(mu_);
    return sets_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<char>> values_;
  int sets_ = 0;
};

TEST(CommunicatorStore, RanksMeetThroughTheCallersStoreWithoutADirectory) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  constexpr int kRanks = 3;
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::vector<float>> got(kRanks);
  std::vector<core::Status> status(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      CommunicatorOptions o = opts("gloo", r, kRanks);  // no store_dir
      o.store = store;
      o.prefix = "run-a";
      auto c = make_communicator(o);
      if (!c.ok()) {
        status[r] = c.status();
        return;
      }
      got[r].assign(8, static_cast<float>(r + 1));
      status[r] = (*c)->all_reduce(got[r].data(), got[r].size(), DType::kF32, ReduceOp::kSum);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].to_string();
    EXPECT_EQ(got[r], std::vector<float>(8, 6.0f)) << "rank " << r;
  }
  EXPECT_GT(store->sets(), 0);  // they met there
}

TEST(CommunicatorStore, ARankAloneInTheStoreFailsNamingIt) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  CommunicatorOptions o = opts("gloo", 0, 2);
  o.store = std::make_shared<MemoryStore>();
  o.connect_timeout = std::chrono::milliseconds(300);
  auto c = make_communicator(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
  EXPECT_NE(c.status().message().find("rank 0 of 2 could not meet the others through the caller's store"),
            std::string_view::npos)
      << c.status().to_string();
  // Neither a directory nor a store: named.
  CommunicatorOptions none = opts("gloo", 0, 2);
  auto refused = make_communicator(none);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no store_dir"), std::string_view::npos) << refused.status().to_string();
}

TEST(CommunicatorFailure, ARankThatNeverArrivesFailsTheRendezvousNamingTheStore) {
  if (!has_backend("gloo")) GTEST_SKIP() << "this build has no gloo backend";
  TempDir store;
  CommunicatorOptions o = opts("gloo", 0, 2, store.path());
  o.connect_timeout = std::chrono::milliseconds(500);
  auto c = make_communicator(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
  EXPECT_NE(c.status().message().find("rank 0 of 2 could not meet the others through '" + store.path()),
            std::string_view::npos)
      << c.status().to_string();
}

TEST(CommunicatorFailure, BadOptionsNameWhatIsWrong) {
  auto bad = [](CommunicatorOptions o, StatusCode code, std::string_view fragment) {
    auto c = make_communicator(o);
    ASSERT_FALSE(c.ok()) << o.backend;
    EXPECT_EQ(c.status().code(), code) << c.status().to_string();
    EXPECT_NE(c.status().message().find(fragment), std::string_view::npos) << c.status().to_string();
  };
  bad(opts("self", 2, 2), StatusCode::kInvalidArgument, "rank 2 of size 2");
  bad(opts("self", 0, 2), StatusCode::kInvalidArgument, "\"self\" has one rank");
  bad(opts("mpi", 0, 1), StatusCode::kInvalidArgument, "unknown backend \"mpi\"");
  if (!has_backend("nccl")) bad(opts("nccl", 0, 1), StatusCode::kUnimplemented, "this build has no NCCL");
  if (has_backend("gloo")) {
    bad(opts("gloo", 0, 1), StatusCode::kInvalidArgument, "no store_dir");
    bad(opts("gloo", 0, 1, "/nonexistent/strata"), StatusCode::kNotFound,
        "is not a directory");
  } else {
    bad(opts("gloo", 0, 1), StatusCode::kUnimplemented, "libgloo-dev");
  }
}

}  // namespace
}  // namespace strata::partition
