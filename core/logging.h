// Leveled logging to stderr (or an injected sink, for tests and embedders).
// Thread-safe. The level starts from the environment variable STRATA_LOG_LEVEL
// (trace, debug, info, warn, error, off; default info).
#pragma once

#include <functional>
#include <sstream>
#include <string_view>

namespace strata::core {

enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 5 };

std::string_view log_level_name(LogLevel level);
// Parses "trace".."off" (case-insensitive); false when unknown.
bool parse_log_level(std::string_view text, LogLevel* out);

void set_log_level(LogLevel level);
LogLevel log_level();
inline bool log_enabled(LogLevel level) { return level >= log_level() && level != LogLevel::kOff; }

// Receives every emitted message. Called on the logging thread, with no strata
// lock held. An empty function restores the default (stderr).
using LogSink = std::function<void(LogLevel level, std::string_view message)>;
void set_log_sink(LogSink sink);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  ~LogMessage();
  std::ostream& stream() { return out_; }

 private:
  LogLevel level_;
  std::ostringstream out_;
};

}  // namespace strata::core

// STRATA_LOG(kWarn) << "message";  The stream is not evaluated below the level.
#define STRATA_LOG(level)                                                       \
  if (!::strata::core::log_enabled(::strata::core::LogLevel::level)) {          \
  } else                                                                        \
    ::strata::core::LogMessage(::strata::core::LogLevel::level, __FILE__, __LINE__).stream()
