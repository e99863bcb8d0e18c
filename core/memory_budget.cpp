// MemoryBudget: lock-free charge and release.
#include "core/memory_budget.h"

#include <cstdint>
#include <utility>

#include "core/check.h"
#include "core/str.h"

namespace strata::core {

BudgetCharge::BudgetCharge(BudgetCharge&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

BudgetCharge& BudgetCharge::operator=(BudgetCharge&& other) noexcept {
  if (this != &other) {
    release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void BudgetCharge::release() {
  if (budget_ != nullptr && bytes_ != 0) budget_->give_back(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

MemoryBudget::MemoryBudget(std::string name, std::uint64_t limit_bytes, std::string config_key)
    : name_(std::move(name)), config_key_(std::move(config_key)), limit_bytes_(limit_bytes) {}

MemoryBudget::~MemoryBudget() {
  STRATA_CHECK(used_.load() == 0) << "budget '" << name_ << "' destroyed with "
                                  << used_.load() << " bytes still charged";
}

Result<BudgetCharge> MemoryBudget::charge(std::uint64_t bytes, std::string_view what) {
  if (bytes == 0) return BudgetCharge(this, 0);
  std::uint64_t used = used_.load(std::memory_order_relaxed);
  for (;;) {
    if (bytes > limit_bytes_ || used > limit_bytes_ - bytes) {
      std::string key = config_key_.empty() ? std::string() : str_cat(" (", config_key_, ")");
      // What would get past this charge (later ones may need more): in use plus this one.
      const std::uint64_t past = used > UINT64_MAX - bytes ? UINT64_MAX : used + bytes;
      std::string hint = config_key_.empty()
                             ? std::string()
                             : str_cat("; ", config_key_, " >= ", past, " (", format_bytes(past),
                                       ") gets past this allocation, later ones may need more");
      return Status::resource_exhausted(str_cat(
          "budget '", name_, "'", key, " exceeded: ", what, " needs ", format_bytes(bytes),
          " but ", format_bytes(used >= limit_bytes_ ? 0 : limit_bytes_ - used), " of ",
          format_bytes(limit_bytes_), " is free (", format_bytes(used), " in use)", hint));
    }
    if (used_.compare_exchange_weak(used, used + bytes, std::memory_order_acq_rel)) break;
  }
  const std::uint64_t now = used + bytes;
  std::uint64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  return BudgetCharge(this, bytes);
}

void MemoryBudget::give_back(std::uint64_t bytes) {
  const std::uint64_t before = used_.fetch_sub(bytes, std::memory_order_acq_rel);
  STRATA_CHECK(before >= bytes) << "budget '" << name_ << "' released more than it held";
}

}  // namespace strata::core
