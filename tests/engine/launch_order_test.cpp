// LaunchOrder: launches go in the order their tickets were taken, whatever
// thread reaches them first; a ticket given up (its Turn destroyed unused)
// lets the next go; a turn that never comes is an error within the timeout;
// run_device_collective runs them in that order on the device too.
#include "engine/internal/launch_order.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/memory_budget.h"
#include "engine/internal/device_collective.h"
#include "gpu/host_device.h"

namespace strata::engine {
namespace {

using namespace std::chrono_literals;

TEST(LaunchOrder, LaunchesGoInTicketOrderWhateverThreadArrivesFirst) {
  LaunchOrder order(10s);
  constexpr int kTurns = 6;
  std::vector<std::shared_ptr<LaunchOrder::Turn>> turns;
  for (int i = 0; i < kTurns; ++i) turns.push_back(std::make_shared<LaunchOrder::Turn>(&order));
  std::mutex mu;
  std::vector<int> launched;
  std::vector<std::thread> threads;
  for (int i = kTurns - 1; i >= 0; --i) {  // the last ticket's thread starts first
    threads.emplace_back([&, i] {
      ASSERT_TRUE(turns[static_cast<std::size_t>(i)]->wait().ok());
      {
        const std::lock_guard<std::mutex> lock(mu);
        launched.push_back(i);
      }
      turns[static_cast<std::size_t>(i)]->done();
    });
    std::this_thread::sleep_for(2ms);
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(launched, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(LaunchOrder, ATicketGivenUpLetsTheNextGo) {
  LaunchOrder order(10s);
  auto first = std::make_unique<LaunchOrder::Turn>(&order);
  LaunchOrder::Turn second(&order);
  std::atomic<bool> went{false};
  std::thread t([&] {
    EXPECT_TRUE(second.wait().ok());
    went = true;
  });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(went.load());  // the first has neither launched nor been given up
  first.reset();              // given up (a copy that never ran)
  t.join();
  EXPECT_TRUE(went.load());
}

TEST(LaunchOrder, ATurnThatNeverComesFailsWithinTheTimeout) {
  LaunchOrder order(50ms);
  LaunchOrder::Turn held(&order);
  LaunchOrder::Turn waiting(&order);
  const auto start = std::chrono::steady_clock::now();
  const core::Status s = waiting.wait();
  EXPECT_EQ(s.code(), core::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("1 launched before it"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

// Two collectives on two streams, the first ticket's held back on its
// stream by earlier work: the second, launched after it, still runs after it
// on the device (its stream waits for the first's), as NCCL's kernels of two
// communicators must when they might not fit on the GPU side by side.
TEST(LaunchOrder, TheDeviceRunsCollectivesInTicketOrderNotOnlyLaunchesThem) {
  core::MemoryBudget device_budget{"device", core::MemoryBudget::kUnlimited, "test"};
  core::MemoryBudget pinned_budget{"pinned", core::MemoryBudget::kUnlimited, "test"};
  gpu::HostDeviceOptions options;
  options.budgets = {&device_budget, &pinned_budget};
  auto made = gpu::make_host_device(options);
  ASSERT_TRUE(made.ok()) << made.status();
  gpu::Device& device = **made;
  auto a = device.create_stream("first");
  auto b = device.create_stream("second");
  ASSERT_TRUE(a.ok() && b.ok());
  partition::CommunicatorOptions self;
  self.backend = "self";
  auto comm = partition::make_communicator(self);
  ASSERT_TRUE(comm.ok()) << comm.status();
  LaunchOrder order(10s);
  LaunchOrder::Turn first(&order), second(&order), third(&order);
  std::mutex mu;
  std::vector<int> ran;
  const auto note = [&](int i) {
    const std::lock_guard<std::mutex> lock(mu);
    ran.push_back(i);
  };
  // The first stream is busy for a while before the first collective.
  std::atomic<bool> release{false};
  ASSERT_TRUE(device.run_on_stream(*a, {}, [&](void*, std::span<void* const>) {
    while (!release) std::this_thread::sleep_for(1ms);
    return core::Status();
  }).ok());
  core::Status first_status, second_status;
  std::thread t1([&] {
    first_status = run_device_collective(device, *a, {}, **comm, first, [&](void*, std::span<void* const>) {
      note(1);
      return core::Status();
    });
  });
  std::thread t2([&] {
    second_status = run_device_collective(device, *b, {}, **comm, second, [&](void*, std::span<void* const>) {
      note(2);
      return core::Status();
    });
  });
  ASSERT_TRUE(third.wait().ok());  // both launched by now; the second's stream is free
  std::this_thread::sleep_for(20ms);  // time for the second to run, were it not held
  {
    const std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(ran.empty()) << "the second collective ran before the first";
  }
  release = true;
  t1.join();
  t2.join();
  EXPECT_TRUE(first_status.ok()) << first_status;
  EXPECT_TRUE(second_status.ok()) << second_status;
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
}

TEST(LaunchOrder, NoOrderIsNoWait) {
  LaunchOrder::Turn none(nullptr);
  EXPECT_TRUE(none.wait().ok());
  none.done();
}

}  // namespace
}  // namespace strata::engine
