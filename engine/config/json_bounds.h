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

#include "core/result.h"
#include "core/status.h"
#include "core/str.h"

namespace strata::engine::json_bounds {

// Objects and arrays nested deeper than this are refused while parsing.
inline constexpr std::size_t kMaxJsonDepth = 64;
// Previews of values (names, keys) in messages are cut to this many characters,
// the parser's own messages (which quote the last token read) to kMaxParserMessageChars.
inline constexpr std::size_t kMaxPreviewChars = 80;
inline constexpr std::size_t kMaxParserMessageChars = 240;

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

// The first pass of a bounded parse: a SAX handler that checks the syntax and
// the nesting and builds nothing (so it costs no memory and is linear in the
// text; nlohmann's callback parser is not: its end_object scans the parent
// container, quadratic in an array of objects). Subclasses add checks through
// the hooks (the config's duplicate keys). Thread-compatible; one per pass.
class CheckingSax : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit CheckingSax(std::size_t max_depth = kMaxJsonDepth) : max_depth_(max_depth) {}

  bool null() override { return true; }
  bool boolean(bool /*val*/) override { return true; }
  bool number_integer(number_integer_t /*val*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*val*/) override { return true; }
  bool number_float(number_float_t /*val*/, const string_t& /*s*/) override { return true; }
  bool string(string_t& /*val*/) override { return true; }
  bool binary(binary_t& /*val*/) override { return true; }
  bool start_object(std::size_t /*elements*/) override { return enter(/*is_object=*/true); }
  bool key(string_t& val) override { return on_key(val); }
  bool end_object() override { return leave(); }
  bool start_array(std::size_t /*elements*/) override { return enter(/*is_object=*/false); }
  bool end_array() override { return leave(); }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) override {
    std::string what = ex.what();
    const std::size_t at = what.find("parse error");
    if (at != std::string::npos) what = what.substr(at);
    error_byte_ = position;
    error_ = preview(what, kMaxParserMessageChars);
    return false;
  }

  bool too_deep() const { return too_deep_; }
  // The parser's message (cut to a preview) and its byte; empty when none.
  const std::string& error() const { return error_; }
  std::size_t error_byte() const { return error_byte_; }

 protected:
  // (optional) default: nothing. Called for each object (is_object) or array
  // opened within the depth limit, and each closed; return false to stop.
  virtual bool on_enter(bool /*is_object*/) { return true; }
  virtual void on_leave() {}
  // (optional) default: accept. Each key of an object.
  virtual bool on_key(const std::string& /*key*/) { return true; }

 private:
  bool enter(bool is_object) {
    if (depth_ >= max_depth_) {
      too_deep_ = true;
      return false;
    }
    ++depth_;
    return on_enter(is_object);
  }
  bool leave() {
    if (depth_ > 0) --depth_;
    on_leave();
    return true;
  }

  std::size_t max_depth_;
  std::size_t depth_ = 0;
  bool too_deep_ = false;
  std::string error_;
  std::size_t error_byte_ = 0;
};

// Runs `sax` over `text` (comments allowed with `ignore_comments`). Errors are
// kInvalidArgument, their message one of
//   invalid JSON (byte N): <the parser's message, cut to a preview>
//   invalid JSON: nested deeper than 64 levels
// (the caller names the file and picks the status; sax->too_deep() tells which).
inline core::Status check_json(std::string_view text, CheckingSax* sax, bool ignore_comments = false) {
  try {
    const bool ok =
        nlohmann::json::sax_parse(text.begin(), text.end(), sax, nlohmann::json::input_format_t::json,
                                  /*strict=*/true, ignore_comments);
    if (ok) return core::Status();
  } catch (const std::bad_alloc&) {
    return core::Status::out_of_memory(core::str_cat("checking a JSON document of ", text.size(), " bytes"));
  }
  if (sax->too_deep()) {
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON: nested deeper than ", kMaxJsonDepth, " levels"));
  }
  if (!sax->error().empty()) {
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON (byte ", sax->error_byte(), "): ", sax->error()));
  }
  return core::Status::invalid_argument("invalid JSON");  // a hook stopped the pass
}

// Parses `text` into `out` with nesting bounded by kMaxJsonDepth: check_json
// first (nothing is built for a document it refuses), then nlohmann's plain
// parser. Errors as check_json. Time linear in the text; memory the parsed
// document (nlohmann's DOM: up to some tens of bytes per value, so a few tens
// of times the text for a document of tiny values such as [{},{},...]).
template <typename BasicJson>
core::Status parse_bounded(std::string_view text, BasicJson* out, bool ignore_comments = false) {
  CheckingSax sax;
  STRATA_RETURN_IF_ERROR(check_json(text, &sax, ignore_comments));
  try {
    *out = BasicJson::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/true, ignore_comments);
  } catch (const nlohmann::json::exception& e) {  // the check passed: not expected
    return core::Status::invalid_argument(
        core::str_cat("invalid JSON: ", preview(e.what(), kMaxParserMessageChars)));
  } catch (const std::bad_alloc&) {
    return core::Status::out_of_memory(core::str_cat("parsing a JSON document of ", text.size(), " bytes"));
  }
  return core::Status();
}

}  // namespace strata::engine::json_bounds
