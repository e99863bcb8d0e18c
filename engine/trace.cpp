// The trace's spans, kept in memory and written as one Chrome trace-event JSON
// document (nlohmann::ordered_json).
#include "engine/trace.h"

#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/str.h"

namespace strata::engine {

std::string_view to_string(TraceTrack t) {
  switch (t) {
    case TraceTrack::kStep:
      return "step (framework calls)";
    case TraceTrack::kDevice:
      return "device stream";
    case TraceTrack::kSwap:
      return "swap I/O";
    case TraceTrack::kCpuAdam:
      return "cpu_adam";
    case TraceTrack::kOptimizer:
      return "optimizer (groups)";
    case TraceTrack::kSwapRead:
      return "disk pipeline reads";
    case TraceTrack::kSwapWrite:
      return "disk pipeline writes";
    case TraceTrack::kOptDevice:
      return "optimizer device stream";
    case TraceTrack::kGradDevice:
      return "gradient device stream";
    case TraceTrack::kPrefetch:
      return "prefetch";
    case TraceTrack::kRanks:
      return "collectives";
  }
  return "?";
}

void Trace::span(TraceTrack track, std::string_view name, std::int64_t begin_ns, std::int64_t end_ns,
                 std::uint64_t bytes) {
  if (!enabled()) return;
  core::MutexLock lock(mu_);
  events_.push_back({track, std::string(name), begin_ns, end_ns, bytes});
}

std::size_t Trace::event_count() const {
  core::MutexLock lock(mu_);
  return events_.size();
}

core::Status Trace::write() const {
  if (!enabled()) return core::Status();
  using Json = nlohmann::ordered_json;
  Json events = Json::array();
  for (TraceTrack t : kAllTraceTracks) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", static_cast<int>(t)},
                      {"args", {{"name", std::string(to_string(t))}}}});
  }
  {
    core::MutexLock lock(mu_);
    for (const Event& e : events_) {
      // Microseconds, exact to the nanosecond: n / 1e3 is the double nearest n/1000.
      events.push_back({{"ph", "X"},
                        {"name", e.name},
                        {"pid", 1},
                        {"tid", static_cast<int>(e.track)},
                        {"ts", static_cast<double>(e.begin_ns - origin_ns_) / 1e3},
                        {"dur", static_cast<double>(e.end_ns - e.begin_ns) / 1e3},
                        {"args", {{"bytes", e.bytes}}}});
    }
  }
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", 1}, {"args", {{"name", "strata"}}}});
  Json doc = Json::object();
  doc["displayTimeUnit"] = "ms";
  doc["traceEvents"] = std::move(events);
  // Names are engine-chosen identifiers and group names; bytes that are not
  // UTF-8 become U+FFFD rather than an exception.
  const std::string text = doc.dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
  const std::string tmp = path_ + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return core::Status::from_errno(errno, core::str_cat("create trace file ", tmp));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !ok) return core::Status::from_errno(ok ? errno : err, core::str_cat("write ", tmp));
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    return core::Status::from_errno(errno, core::str_cat("rename ", tmp, " to ", path_));
  }
  return core::Status();
}

}  // namespace strata::engine
