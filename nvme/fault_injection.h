// FaultInjector: decides, per I/O request, whether to fail it (EIO, ENOSPC,
// EINTR, EAGAIN), shorten it, delay it or flip a bit in its data. Set
// IoBackendOptions::fault_injector and every driver of that backend is wrapped
// in a decorator that asks it, below the backend's retry logic, so tests walk
// every error and retry path with real files. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/mutex.h"
#include "nvme/io_backend.h"

namespace strata::nvme {

enum class FaultKind : std::uint8_t {
  kEio,            // the op completes with -EIO (nothing transferred)
  kEnospc,         // the op completes with -ENOSPC
  kEintr,          // the op completes with -EINTR (retried by the backend)
  kEagain,         // the op completes with -EAGAIN (retried by the backend)
  kShortTransfer,  // the op moves only `short_bytes` (the backend issues the rest)
  kDelay,          // the op starts `delay_ms` late
  kFlipBit,        // reads: bit flipped in the buffer after the read; writes: in
                   // a copy of the data, so the file gets it (the caller's buffer is untouched)
};

enum class FaultOps : std::uint8_t { kAny, kReads, kWrites };

// When a rule fires. Ops are counted as the drivers see them: a retry or the
// rest of a short transfer is a new op.
struct FaultRule {
  FaultKind kind = FaultKind::kEio;
  FaultOps ops = FaultOps::kAny;  // which ops count and can be hit; default any
  std::uint64_t skip = 0;         // matching ops let through before the first hit; default 0
  std::int64_t times = 1;         // hits in all; -1: every matching op after `skip`; default 1
  // kShortTransfer: bytes the op moves; 0 (default) means half the op rounded
  // down to 4096 (ops of 4096 bytes or less are let through and not counted as hits).
  std::uint64_t short_bytes = 0;
  std::uint32_t delay_ms = 0;  // kDelay: milliseconds; default 0
  std::uint64_t bit = 0;       // kFlipBit: bit index in the op's data (modulo its size); default 0
};

class FaultInjector {
 public:
  // Adds a rule; returns its index (for hits()). The first rule that fires wins.
  std::size_t add(const FaultRule& rule) STRATA_EXCLUDES(mu_);
  void clear() STRATA_EXCLUDES(mu_);
  // How often rule `index` fired.
  std::uint64_t hits(std::size_t index) const STRATA_EXCLUDES(mu_);
  std::uint64_t total_hits() const STRATA_EXCLUDES(mu_);
  // Ops seen (all kinds) since construction or clear().
  std::uint64_t ops_seen() const STRATA_EXCLUDES(mu_);

  // For the decorator: the rule that fires for an op of `op` kind and `length`
  // bytes, if any (its hit is counted).
  std::optional<FaultRule> decide(IoOp op, std::uint64_t length) STRATA_EXCLUDES(mu_);

 private:
  struct Entry {
    FaultRule rule;
    std::uint64_t matched = 0;
    std::uint64_t hits = 0;
  };
  mutable core::Mutex mu_;
  std::vector<Entry> rules_ STRATA_GUARDED_BY(mu_);
  std::uint64_t ops_seen_ STRATA_GUARDED_BY(mu_) = 0;
};

}  // namespace strata::nvme
