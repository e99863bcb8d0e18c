// libFuzzer target: the config parser (engine::parse_config) on arbitrary text. Any input must give a
// Config or an error, never a crash, hang or unbounded memory; a config it accepts must parse again
// from its own to_json to the same Config (warnings aside).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/check.h"
#include "core/logging.h"
#include "engine/config.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Warnings go through the formatting code but not to stderr (millions of runs).
  strata::core::set_log_sink([](strata::core::LogLevel, std::string_view) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using strata::engine::Config;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = strata::engine::parse_config(text);
  if (!parsed.ok()) {
    STRATA_CHECK(!parsed.status().message().empty()) << "an error without a message";
    return 0;
  }
  const std::string json = strata::engine::to_json(*parsed);
  STRATA_CHECK(!json.empty());
  auto again = strata::engine::parse_config(json);
  STRATA_CHECK(again.ok()) << "to_json of an accepted config does not parse: " << again.status() << "\n" << json;
  Config a = *std::move(parsed), b = *std::move(again);
  a.warnings.clear();
  b.warnings.clear();
  STRATA_CHECK(a == b) << "to_json then parse_config changed the config:\n" << json;
  return 0;
}
