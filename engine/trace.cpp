#include "engine/trace.h"

#include <cerrno>
#include <cstdio>

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

namespace {
// Names are engine-chosen identifiers and group names; escape what JSON needs.
std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}
}  // namespace

core::Status Trace::write() const {
  if (!enabled()) return core::Status();
  std::string text = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  for (TraceTrack t : kAllTraceTracks) {
    text += core::str_cat("{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": 1, \"tid\": ", static_cast<int>(t),
                          ", \"args\": {\"name\": ", json_string(to_string(t)), "}},\n");
  }
  {
    core::MutexLock lock(mu_);
    for (const Event& e : events_) {
      char buf[160];
      std::snprintf(buf, sizeof buf, ", \"pid\": 1, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, \"args\": {\"bytes\": %llu}},\n",
                    static_cast<int>(e.track), static_cast<double>(e.begin_ns - origin_ns_) * 1e-3,
                    static_cast<double>(e.end_ns - e.begin_ns) * 1e-3, static_cast<unsigned long long>(e.bytes));
      text += "{\"ph\": \"X\", \"name\": " + json_string(e.name) + buf;
    }
  }
  text += "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": 1, \"args\": {\"name\": \"strata\"}}\n]}\n";
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
