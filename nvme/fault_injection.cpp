// FaultInjector and the fault-injecting driver decorator.
#include "nvme/fault_injection.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/str.h"
#include "nvme/internal/io_driver.h"

namespace strata::nvme {

std::size_t FaultInjector::add(const FaultRule& rule) {
  core::MutexLock lock(mu_);
  rules_.push_back(Entry{rule});
  return rules_.size() - 1;
}

void FaultInjector::clear() {
  core::MutexLock lock(mu_);
  rules_.clear();
  ops_seen_ = 0;
}

std::uint64_t FaultInjector::hits(std::size_t index) const {
  core::MutexLock lock(mu_);
  return index < rules_.size() ? rules_[index].hits : 0;
}

std::uint64_t FaultInjector::total_hits() const {
  core::MutexLock lock(mu_);
  std::uint64_t n = 0;
  for (const Entry& e : rules_) n += e.hits;
  return n;
}

std::uint64_t FaultInjector::ops_seen() const {
  core::MutexLock lock(mu_);
  return ops_seen_;
}

namespace {
std::uint64_t short_length(const FaultRule& rule, std::uint64_t length) {
  if (rule.short_bytes != 0) return rule.short_bytes < length ? rule.short_bytes : 0;
  return (length / 2) & ~std::uint64_t{4095};
}
}  // namespace

std::optional<FaultRule> FaultInjector::decide(IoOp op, std::uint64_t length) {
  core::MutexLock lock(mu_);
  ++ops_seen_;
  for (Entry& e : rules_) {
    if ((e.rule.ops == FaultOps::kReads && op != IoOp::kRead) ||
        (e.rule.ops == FaultOps::kWrites && op != IoOp::kWrite)) {
      continue;
    }
    const std::uint64_t index = e.matched++;
    if (index < e.rule.skip) continue;
    if (e.rule.times >= 0 && e.hits >= static_cast<std::uint64_t>(e.rule.times)) continue;
    if (e.rule.kind == FaultKind::kShortTransfer && short_length(e.rule, length) == 0) continue;
    ++e.hits;
    return e.rule;
  }
  return std::nullopt;
}

namespace internal {
namespace {

class FaultInjectingDriver final : public IoDriver {
 public:
  FaultInjectingDriver(std::unique_ptr<IoDriver> inner, FaultInjector& injector)
      : inner_(std::move(inner)), injector_(injector) {}

  unsigned capacity() const override { return inner_->capacity(); }

  core::Status prepare(const DriverOp& op) override {
    std::optional<FaultRule> rule = injector_.decide(op.op, op.length);
    if (!rule) return forward(op);
    switch (rule->kind) {
      case FaultKind::kEio: synthetic_.push_back({op.tag, -EIO}); return core::Status();
      case FaultKind::kEnospc: synthetic_.push_back({op.tag, -ENOSPC}); return core::Status();
      case FaultKind::kEintr: synthetic_.push_back({op.tag, -EINTR}); return core::Status();
      case FaultKind::kEagain: synthetic_.push_back({op.tag, -EAGAIN}); return core::Status();
      case FaultKind::kDelay:
        std::this_thread::sleep_for(std::chrono::milliseconds(rule->delay_ms));
        return forward(op);
      case FaultKind::kShortTransfer: {
        DriverOp shorter = op;
        shorter.length = short_length(*rule, op.length);
        return forward(shorter);
      }
      case FaultKind::kFlipBit: {
        const std::uint64_t bit = rule->bit % (op.length * 8);
        if (op.op == IoOp::kRead) {
          pending_flips_[op.tag] = {op.data, bit};
          return forward(op);
        }
        // Corrupt a copy, so the file holds the flipped bit and the caller's
        // buffer stays as it was (another thread may be reading it).
        auto copy = core::AlignedBuffer::allocate(op.length, core::kDirectIoAlignment);
        if (!copy.ok()) return std::move(copy).status();
        std::memcpy(copy->data(), op.data, op.length);
        copy->data()[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
        DriverOp corrupted = op;
        corrupted.data = copy->data();
        corrupted.buffer_index = -1;
        bounces_[op.tag] = std::move(copy).value();
        return forward(corrupted);
      }
    }
    return forward(op);
  }

  void submit() override { inner_->submit(); }

  core::Status reap(unsigned min_complete, std::vector<DriverCompletion>& out) override {
    const std::size_t start = out.size();
    out.insert(out.end(), synthetic_.begin(), synthetic_.end());
    synthetic_.clear();
    const std::size_t have = out.size() - start;
    if (forwarded_ > 0) {
      const unsigned need = have >= min_complete ? 0 : static_cast<unsigned>(min_complete - have);
      const std::size_t before = out.size();
      STRATA_RETURN_IF_ERROR(inner_->reap(need, out));
      for (std::size_t i = before; i < out.size(); ++i) {
        --forwarded_;
        DriverCompletion& c = out[i];
        if (auto it = pending_flips_.find(c.tag); it != pending_flips_.end()) {
          if (c.result > 0) {
            const std::uint64_t bit = it->second.bit % (static_cast<std::uint64_t>(c.result) * 8);
            it->second.data[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
          }
          pending_flips_.erase(it);
        }
        bounces_.erase(c.tag);
      }
    }
    return core::Status();
  }

  core::Status register_file(int index, int fd) override { return inner_->register_file(index, fd); }
  core::Status register_buffers(std::span<const std::span<std::byte>> buffers) override {
    return inner_->register_buffers(buffers);
  }
  bool uses_registered_buffers() const override { return inner_->uses_registered_buffers(); }

 private:
  core::Status forward(const DriverOp& op) {
    STRATA_RETURN_IF_ERROR(inner_->prepare(op));
    ++forwarded_;
    return core::Status();
  }

  struct Flip {
    std::byte* data;
    std::uint64_t bit;
  };
  std::unique_ptr<IoDriver> inner_;
  FaultInjector& injector_;
  std::vector<DriverCompletion> synthetic_;  // faults that never reached the kernel
  unsigned forwarded_ = 0;                   // ops handed to inner_ and not yet reaped
  std::unordered_map<void*, Flip> pending_flips_;
  std::unordered_map<void*, core::AlignedBuffer> bounces_;  // corrupted copies of written data
};

}  // namespace

std::unique_ptr<IoDriver> make_fault_injecting_driver(std::unique_ptr<IoDriver> inner, FaultInjector& injector) {
  return std::make_unique<FaultInjectingDriver>(std::move(inner), injector);
}

}  // namespace internal
}  // namespace strata::nvme
