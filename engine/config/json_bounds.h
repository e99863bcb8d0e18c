// Bounds on every JSON document strata reads (the config, checkpoint
// manifests, safetensors headers and indexes): nesting depth refused while
// parsing, and previews of values for messages cut to a fixed length.
// Header-only; behind the nlohmann firewall (engine/config*, and the
// safetensors and checkpoint readers: tests/layering_test.py).
#pragma once

#include <cstddef>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/status.h"
#include "core/str.h"

namespace strata::engine::json_bounds {

// Objects and arrays nested deeper than this are refused while parsing.
inline constexpr std::size_t kMaxJsonDepth = 64;
// Previews of values (names, keys) in messages are cut to this many characters,
// the parser's own messages (which quote the last token read) to kMaxParserMessageChars.
inline constexpr std::size_t kMaxPreviewChars = 80;
inline constexpr std::size_t kMaxParserMessageChars = 240;

// Thrown by DepthLimit when a document nests deeper than its limit; parsing
// stops there, before a deep document costs memory or anything recurses over
// it (dump, comparisons, destruction).
struct TooDeep {};

// Counts nesting in a parser callback (nlohmann's parse_event_t is the same
// type for every basic_json). Thread-compatible; one per parse.
class DepthLimit {
 public:
  explicit DepthLimit(std::size_t max_depth = kMaxJsonDepth) : max_depth_(max_depth) {}
  // Throws TooDeep on an object or array that opens beyond the limit.
  void on(nlohmann::json::parse_event_t event) {
    switch (event) {
      case nlohmann::json::parse_event_t::object_start:
      case nlohmann::json::parse_event_t::array_start:
        if (depth_ >= max_depth_) throw TooDeep{};
        ++depth_;
        break;
      case nlohmann::json::parse_event_t::object_end:
      case nlohmann::json::parse_event_t::array_end:
        if (depth_ > 0) --depth_;
        break;
      default:
        break;
    }
  }
  std::size_t depth() const { return depth_; }

 private:
  std::size_t max_depth_;
  std::size_t depth_ = 0;
};

// `s` for a message: at most `max_chars` characters (longer ones cut to
// max_chars - 3 and "..."), control characters and bytes outside ASCII shown
// as '?', so that neither a huge nor a binary value reaches a message whole.
inline std::string preview(std::string_view s, std::size_t max_chars = kMaxPreviewChars) {
  std::string out;
  const std::size_t n = s.size() > max_chars ? max_chars - 3 : s.size();
  out.reserve(n + 3);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    out.push_back(c < 0x20 || c >= 0x7f ? '?' : static_cast<char>(c));
  }
  if (n < s.size()) out += "...";
  return out;
}

// Parses `text` (strict JSON: no comments) into `out` with nesting bounded by
// kMaxJsonDepth. Errors are kInvalidArgument, their message one of
//   invalid JSON (byte N): <the parser's message, cut to a preview>
//   invalid JSON: nested deeper than 64 levels
// (the caller names the file and picks the status). Memory: the parsed
// document, a small multiple of the text's size for any text.
template <typename BasicJson>
core::Status parse_bounded(std::string_view text, BasicJson* out) {
  DepthLimit limit;
  try {
    *out = BasicJson::parse(
        text.begin(), text.end(),
        [&limit](int /*depth*/, typename BasicJson::parse_event_t event, BasicJson& /*parsed*/) {
          limit.on(event);
          return true;
        },
        /*allow_exceptions=*/true);
  } catch (const TooDeep&) {
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON: nested deeper than ", kMaxJsonDepth, " levels"));
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = e.what();
    const std::size_t at = what.find("parse error");
    if (at != std::string::npos) what = what.substr(at);
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON (byte ", e.byte, "): ", preview(what, kMaxParserMessageChars)));
  } catch (const nlohmann::json::exception& e) {
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON: ", preview(e.what(), kMaxParserMessageChars)));
  } catch (const std::bad_alloc&) {
    return core::Status::out_of_memory(core::str_cat("parsing a JSON document of ", text.size(), " bytes"));
  }
  return core::Status();
}

}  // namespace strata::engine::json_bounds
