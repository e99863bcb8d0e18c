// Monotonic time for measurements and timeouts (never the wall clock).
#pragma once

#include <cstdint>
#include <ctime>

namespace strata::core {

// Nanoseconds from CLOCK_MONOTONIC; only differences are meaningful.
inline std::int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Measures elapsed time from construction or the last restart(). Thread-compatible.
class Stopwatch {
 public:
  Stopwatch() : start_ns_(monotonic_ns()) {}
  void restart() { start_ns_ = monotonic_ns(); }
  std::int64_t elapsed_ns() const { return monotonic_ns() - start_ns_; }
  double elapsed_s() const { return static_cast<double>(elapsed_ns()) * 1e-9; }

 private:
  std::int64_t start_ns_;
};

}  // namespace strata::core
