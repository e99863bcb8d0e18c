// Logging: level, sink and the message object.
#include "core/logging.h"

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "core/check.h"
#include "core/mutex.h"

namespace strata::core {
namespace {

LogLevel initial_level() {
  LogLevel level = LogLevel::kInfo;
  if (const char* env = std::getenv("STRATA_LOG_LEVEL")) {
    if (!parse_log_level(env, &level)) {
      std::fprintf(stderr, "strata: ignoring STRATA_LOG_LEVEL=%s (expected trace, debug, info, warn, error or off)\n", env);
      level = LogLevel::kInfo;
    }
  }
  return level;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(initial_level())};
  return level;
}

struct SinkState {
  Mutex mu;
  LogSink sink STRATA_GUARDED_BY(mu);
};
SinkState& sink_state() {
  static SinkState* state = new SinkState();  // never destroyed: usable during exit
  return *state;
}

}  // namespace

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

bool parse_log_level(std::string_view text, LogLevel* out) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (int i = 0; i <= static_cast<int>(LogLevel::kOff); ++i) {
    if (lower == log_level_name(static_cast<LogLevel>(i))) {
      *out = static_cast<LogLevel>(i);
      return true;
    }
  }
  if (lower == "warning") {
    *out = LogLevel::kWarn;
    return true;
  }
  return false;
}

void set_log_level(LogLevel level) { level_storage().store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(level_storage().load(std::memory_order_relaxed)); }

void set_log_sink(LogSink sink) {
  SinkState& state = sink_state();
  MutexLock lock(state.mu);
  state.sink = std::move(sink);
}

LogMessage::LogMessage(LogLevel level, const char*, int) : level_(level) {}

LogMessage::~LogMessage() {
  const std::string text = out_.str();
  SinkState& state = sink_state();
  LogSink sink;
  {
    MutexLock lock(state.mu);
    sink = state.sink;
  }
  if (sink) {
    sink(level_, text);
    return;
  }
  std::string line = "strata [";
  line += log_level_name(level_);
  line += "] ";
  line += text;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

CheckFailure::CheckFailure(const char* file, int line, const char* condition)
    : file_(file), line_(line), condition_(condition) {}

CheckFailure::~CheckFailure() {
  std::fprintf(stderr, "strata: internal check failed at %s:%d: %s %s\n", file_, line_, condition_,
               message_.str().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata::core
