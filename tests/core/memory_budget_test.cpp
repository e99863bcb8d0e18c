// MemoryBudget: hard limits, errors that name the budget, concurrent charges.
#include "core/memory_budget.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

namespace strata::core {
namespace {

TEST(MemoryBudget, ChargesAndReleasesOnDestruction) {
  MemoryBudget budget("pinned host memory", 1000, "strata.budgets.pinned");
  {
    Result<BudgetCharge> a = budget.charge(600, "staging");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(budget.used_bytes(), 600u);
    EXPECT_EQ(budget.available_bytes(), 400u);
  }
  EXPECT_EQ(budget.used_bytes(), 0u);
  EXPECT_EQ(budget.peak_bytes(), 600u);
}

TEST(MemoryBudget, RefusesBeyondTheLimitNamingBudgetKeyAndSizes) {
  MemoryBudget budget("pinned host memory", 1024, "strata.budgets.pinned");
  Result<BudgetCharge> a = budget.charge(1000, "gradients");
  ASSERT_TRUE(a.ok());
  Result<BudgetCharge> b = budget.charge(100, "nvme staging buffer");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  const std::string msg(b.status().message());
  EXPECT_NE(msg.find("pinned host memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("strata.budgets.pinned"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nvme staging buffer needs 100 B"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1000 B in use"), std::string::npos) << msg;
  // What would get past this charge: in use plus the request, under its key.
  EXPECT_NE(msg.find("strata.budgets.pinned >= 1100 "), std::string::npos) << msg;
  EXPECT_EQ(budget.used_bytes(), 1000u);  // the failed charge took nothing
  {
    MemoryBudget bigger("pinned host memory", 1100, "strata.budgets.pinned");
    Result<BudgetCharge> first = bigger.charge(1000, "gradients");
    ASSERT_TRUE(first.ok());
    EXPECT_TRUE(bigger.charge(100, "nvme staging buffer").ok()) << "the stated budget gets past it";
  }
  EXPECT_TRUE(budget.charge(24, "exact fit").ok());
}

TEST(MemoryBudget, HugeRequestsDoNotOverflow) {
  MemoryBudget budget("device", 1 << 20);
  Result<BudgetCharge> a = budget.charge(10, "x");
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(budget.charge(~0ull, "overflow").ok());
  EXPECT_FALSE(budget.charge(~0ull - 5, "overflow").ok());
}

TEST(MemoryBudget, MovedChargeReleasesOnce) {
  MemoryBudget budget("device", 100);
  Result<BudgetCharge> a = budget.charge(40, "x");
  ASSERT_TRUE(a.ok());
  BudgetCharge moved = std::move(a).value();
  EXPECT_EQ(moved.bytes(), 40u);
  moved.release();
  moved.release();
  EXPECT_EQ(budget.used_bytes(), 0u);
}

TEST(MemoryBudget, ConcurrentChargesNeverExceedTheLimit) {
  constexpr std::uint64_t kLimit = 1000;
  MemoryBudget budget("staging", kLimit);
  std::vector<std::thread> threads;
  std::atomic<bool> exceeded{false};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        Result<BudgetCharge> c = budget.charge(300, "x");
        if (budget.used_bytes() > kLimit) exceeded = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(exceeded.load());
  EXPECT_LE(budget.peak_bytes(), kLimit);
  EXPECT_EQ(budget.used_bytes(), 0u);
}

TEST(MemoryBudgetDeathTest, DestroyingWithOutstandingChargesIsABug) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto* budget = new MemoryBudget("leaky", 100);
        Result<BudgetCharge> c = budget->charge(10, "x");
        BudgetCharge held = std::move(c).value();
        delete budget;
        held.release();
      },
      "still charged");
}

}  // namespace
}  // namespace strata::core
