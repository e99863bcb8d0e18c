// LaunchOrder: launches go in the order their tickets were taken, whatever
// thread reaches them first; a ticket given up (its Turn destroyed unused)
// lets the next go; a turn that never comes is an error within the timeout.
#include "engine/internal/launch_order.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

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

TEST(LaunchOrder, NoOrderIsNoWait) {
  LaunchOrder::Turn none(nullptr);
  EXPECT_TRUE(none.wait().ok());
  none.done();
}

}  // namespace
}  // namespace strata::engine
