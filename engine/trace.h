// Trace: a timeline of the engine's work in Chrome trace-event JSON (opens in
// Perfetto and chrome://tracing). One track per kind of worker: the step's
// own calls, the device stream, swap I/O, the CPU optimizer. Events are
// complete ("ph": "X") spans in microseconds since the trace began.
// Thread-safe. Disabled (every call a no-op) when the path is empty.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/clock.h"
#include "core/mutex.h"
#include "core/status.h"

namespace strata::engine {

enum class TraceTrack : int {
  kStep = 1,        // the framework's calls
  kDevice = 2,      // the framework-side device stream (fetches, gradients)
  kSwap = 3,        // swap reads and writes waited for in line
  kCpuAdam = 4,     // cpu_adam: gradient passes and Adam
  kOptimizer = 5,   // the optimizer thread: one span per group of a step
  kSwapRead = 6,    // the disk pipeline's reads, issue to completion (several in flight)
  kSwapWrite = 7,   // the disk pipeline's writes, likewise
  kOptDevice = 8,   // the optimizer's device stream
  kGradDevice = 9,  // the gradient path's device stream (copies down)
  kPrefetch = 10,   // traced prefetch: copies of the groups the trace says come next
  kRanks = 11,      // collectives among data-parallel ranks (gradients, compute copies)
};
inline constexpr TraceTrack kAllTraceTracks[] = {TraceTrack::kStep,      TraceTrack::kDevice,   TraceTrack::kSwap,
                                                 TraceTrack::kCpuAdam,   TraceTrack::kOptimizer, TraceTrack::kSwapRead,
                                                 TraceTrack::kSwapWrite, TraceTrack::kOptDevice, TraceTrack::kGradDevice,
                                                 TraceTrack::kPrefetch,  TraceTrack::kRanks};
std::string_view to_string(TraceTrack t);  // the track's name in the viewer

class Trace {
 public:
  explicit Trace(std::string path) : path_(std::move(path)), origin_ns_(core::monotonic_ns()) {}
  bool enabled() const { return !path_.empty(); }

  // Records [begin_ns, end_ns) (core::monotonic_ns times) on `track`.
  void span(TraceTrack track, std::string_view name, std::int64_t begin_ns, std::int64_t end_ns,
            std::uint64_t bytes = 0) STRATA_EXCLUDES(mu_);

  // Writes every event so far to the path (write aside, rename). Errors name the file.
  core::Status write() const STRATA_EXCLUDES(mu_);

  std::size_t event_count() const STRATA_EXCLUDES(mu_);

 private:
  struct Event {
    TraceTrack track;
    std::string name;
    std::int64_t begin_ns, end_ns;
    std::uint64_t bytes;
  };
  std::string path_;
  std::int64_t origin_ns_;
  mutable core::Mutex mu_;
  std::vector<Event> events_ STRATA_GUARDED_BY(mu_);
};

// Records a span from construction to destruction.
class TraceScope {
 public:
  TraceScope(Trace& trace, TraceTrack track, std::string name, std::uint64_t bytes = 0)
      : trace_(trace),
        track_(track),
        name_(std::move(name)),
        bytes_(bytes),
        begin_ns_(trace.enabled() ? core::monotonic_ns() : 0) {}
  ~TraceScope() {
    if (trace_.enabled()) trace_.span(track_, name_, begin_ns_, core::monotonic_ns(), bytes_);
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace& trace_;
  TraceTrack track_;
  std::string name_;
  std::uint64_t bytes_;
  std::int64_t begin_ns_;
};

}  // namespace strata::engine
