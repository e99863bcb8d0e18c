// MemoryBudget: a hard limit on one kind of memory (device, pinned, staging,
// ...) that several modules charge. Every allocation takes a BudgetCharge
// first and fails, naming the budget and its config key, before it would go
// over. MemoryBudget is thread-safe; BudgetCharge is move-only and returns
// its bytes when destroyed. A budget must outlive its charges.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "core/result.h"

namespace strata::core {

class MemoryBudget;

class BudgetCharge {
 public:
  BudgetCharge() = default;
  BudgetCharge(BudgetCharge&& other) noexcept;
  BudgetCharge& operator=(BudgetCharge&& other) noexcept;
  BudgetCharge(const BudgetCharge&) = delete;
  BudgetCharge& operator=(const BudgetCharge&) = delete;
  ~BudgetCharge() { release(); }

  std::uint64_t bytes() const { return bytes_; }
  // Returns the bytes to the budget now (idempotent).
  void release();

 private:
  friend class MemoryBudget;
  BudgetCharge(MemoryBudget* budget, std::uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  MemoryBudget* budget_ = nullptr;
  std::uint64_t bytes_ = 0;
};

class MemoryBudget {
 public:
  static constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();

  // `name` is what the memory is ("pinned host memory"); `config_key` is the
  // key that sets the limit ("strata.budgets.pinned"), named in errors.
  MemoryBudget(std::string name, std::uint64_t limit_bytes, std::string config_key = {});
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;
  // Checks that every charge was returned.
  ~MemoryBudget();

  // Reserves `bytes` for `what` (e.g. "nvme staging buffer"). Errors:
  // kResourceExhausted naming the budget, the key, the request, what is in use
  // and the limit. A charge of 0 bytes always succeeds.
  Result<BudgetCharge> charge(std::uint64_t bytes, std::string_view what);

  const std::string& name() const { return name_; }
  const std::string& config_key() const { return config_key_; }
  std::uint64_t limit_bytes() const { return limit_bytes_; }
  std::uint64_t used_bytes() const { return used_.load(std::memory_order_acquire); }
  std::uint64_t peak_bytes() const { return peak_.load(std::memory_order_acquire); }
  std::uint64_t available_bytes() const {
    const std::uint64_t used = used_bytes();
    return used >= limit_bytes_ ? 0 : limit_bytes_ - used;
  }

 private:
  friend class BudgetCharge;
  void give_back(std::uint64_t bytes);

  const std::string name_;
  const std::string config_key_;
  const std::uint64_t limit_bytes_;
  std::atomic<std::uint64_t> used_{0};
  std::atomic<std::uint64_t> peak_{0};
};

}  // namespace strata::core
