// The generic JSON reader under the config parser: objects read key by key
// with their key paths ("zero_optimization.offload_param.device"), unknown
// keys reported with a "did you mean", duplicate keys rejected, and values
// quoted in messages. Private to engine/config*; nothing here knows a key.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "core/str.h"
#include "engine/config.h"
#include "engine/config/json_bounds.h"

namespace strata::engine::config_internal {

using Json = nlohmann::json;

inline constexpr std::int64_t kMaxI64 = std::numeric_limits<std::int64_t>::max();

// --- enum names ---------------------------------------------------------------

// One spelling of an enum value in the JSON document.
template <typename E>
struct EnumName {
  std::string_view name;
  E value;
};

// The spelling of `value`, or "unknown" when `names` lacks it.
template <typename E>
std::string_view name_of(std::span<const EnumName<E>> names, E value) {
  for (const EnumName<E>& n : names) {
    if (n.value == value) return n.name;
  }
  return "unknown";
}

// "a, b, c": the spellings, for messages.
template <typename E>
std::string join_names(std::span<const EnumName<E>> names) {
  std::string out;
  for (const EnumName<E>& n : names) {
    if (!out.empty()) out += ", ";
    out += n.name;
  }
  return out;
}

// ASCII lower case.
std::string lower(std::string_view s);

// --- message helpers ------------------------------------------------------------

// A JSON value as it appears in messages: "gpu" keeps its quotes; values
// longer than 80 characters are cut to 77 and "...".
std::string show(const Json& v);

// A number in messages: integral values without a fraction ("1", not "1.0").
std::string show_double(double v);

// A list of paths as a JSON array, as show() writes it.
std::string show_paths(const std::vector<std::string>& paths);

// Inclusive/exclusive bounds of a floating-point key.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;

  bool contains(double v) const {
    const bool above = lo_open ? v > lo : v >= lo;
    const bool below = hi_open ? v < hi : v <= hi;
    return above && below;
  }
  // ">= 0", "> 0", "in [0, 1)", for messages.
  std::string describe() const;
};

inline Range at_least(double lo) { return Range{.lo = lo}; }
inline Range above(double lo) { return Range{.lo = lo, .lo_open = true}; }
inline Range closed(double lo, double hi) { return Range{.lo = lo, .hi = hi}; }
inline Range open_closed(double lo, double hi) {
  return Range{.lo = lo, .hi = hi, .lo_open = true};
}
inline Range closed_open(double lo, double hi) {
  return Range{.lo = lo, .hi = hi, .hi_open = true};
}

// Edit distance (insertions, deletions, substitutions), for "did you mean".
std::size_t edit_distance(std::string_view a, std::string_view b);

// --- parse context ----------------------------------------------------------------

// State of one parse: options, every problem found, the warnings so far.
// Thread-compatible; one per parse_config call. A section (the config's top-
// level readers, one after another) stops at its first wrong value (ok()
// turns false until next_section()), since what follows may depend on it;
// the next section is read all the same, so one run names a problem in each.
// An unknown key is independent of every value: each one is recorded and
// reading goes on.
// The config's warnings and info lines are logged once per process (a
// program reads its config more than once); this forgets the lines logged so
// far, so that they are logged again (tests that capture the log).
void forget_logged_lines();

class Context {
 public:
  Context(const ParseOptions& options, bool strict) : options_(options), strict_(strict) {}

  // No wrong value in the current section.
  bool ok() const { return !section_failed_; }
  // Every problem so far as one kInvalidArgument ("<path>: <message>"; with
  // more than one, "N problems: (1) ...; (2) ..."); OK when none.
  core::Status error() const;
  bool any_problem() const { return !problems_.empty(); }
  bool any_wrong_value() const { return any_wrong_value_; }
  bool strict() const { return strict_; }
  const ParseOptions& options() const { return options_; }

  // Records "<path>: <message>" (a wrong value), unless the current section
  // already has one.
  void fail(std::string_view path, std::string_view message);
  // Records an unknown key that is an error; reading goes on.
  void fail_key(std::string_view path, std::string_view message);
  // A section's returned status: recorded when it did not come from fail().
  void absorb(const core::Status& s);
  // The next section starts with ok().
  void next_section() { section_failed_ = false; }
  // Logs at warn level and keeps the warning for Config::warnings.
  void warn(std::string path, std::string message);
  // Logs at info level.
  void note(std::string_view path, std::string_view message);
  // Logs how an "auto" (or a value derived from one) was resolved.
  void resolved(std::string_view path, std::string_view value, std::string_view why);
  std::vector<ConfigWarning> take_warnings() { return std::move(warnings_); }

 private:
  ParseOptions options_;
  bool strict_;
  std::vector<std::string> problems_;  // "<path>: <message>", in the order found
  bool section_failed_ = false;
  bool any_wrong_value_ = false;
  std::vector<ConfigWarning> warnings_;
};

// Checks an integral JSON number against [lo, hi]. Integers written as 1e9
// are accepted when integral. On failure the context holds the error.
bool read_int(Context* ctx, std::string_view path, const Json& v, std::int64_t lo, std::int64_t hi,
              std::int64_t* out);

// Checks a finite JSON number against `range`. On failure the context holds the error.
bool read_double(Context* ctx, std::string_view path, const Json& v, const Range& range,
                 double* out);

// True for the string "auto".
bool is_auto(const Json& v);

// One spelling of a key: DeepSpeed's alias or an old name.
struct Spelling {
  std::string_view name;
  bool old = false;
};

// Reads the keys of one JSON object, remembering which ones it was asked for,
// so that finish() can report the others as unknown. Getters return true when
// the key was given with a valid value (and store it), false when it is absent
// or wrong (then the context holds the error). "auto" is an error unless the
// caller asked take_auto() first. Lives no longer than the parsed document
// and its Context; thread-compatible.
class ObjectReader {
 public:
  // `object` is null for an absent section (every getter then finds nothing).
  ObjectReader(const Json* object, std::string path, Context* ctx)
      : object_(object), path_(std::move(path)), ctx_(ctx) {}

  bool present() const { return object_ != nullptr; }
  const std::string& path() const { return path_; }
  Context* ctx() const { return ctx_; }
  std::string path_of(std::string_view key) const {
    return path_.empty() ? std::string(key) : core::str_cat(path_, ".", key);
  }
  void fail(std::string_view key, std::string_view message) { ctx_->fail(path_of(key), message); }
  void warn(std::string_view key, std::string message) {
    ctx_->warn(path_of(key), std::move(message));
  }

  // The value of `key` without marking it known; nullptr when absent.
  const Json* peek(std::string_view key) const;
  bool has(std::string_view key) const { return peek(key) != nullptr; }

  // A byte count read from `key`, for messages: "\"1MB\" (1000000 bytes)" when
  // it was written as a string, else the number.
  std::string bytes_text(std::string_view key, std::uint64_t bytes) const;

  // Marks `key` known and returns its value (nullptr when absent or after an error).
  const Json* take(std::string_view key);

  // True when the key holds the string "auto" (the caller resolves it).
  bool take_auto(std::string_view key);

  bool get_bool(std::string_view key, bool* out);

  template <typename T>
  bool get_int(std::string_view key, std::int64_t lo, std::int64_t hi, T* out) {
    const Json* v = take_value(key);
    std::int64_t x = 0;
    if (v == nullptr || !read_int(ctx_, path_of(key), *v, lo, hi, &x)) return false;
    *out = static_cast<T>(x);
    return true;
  }

  // Unsigned 64-bit integers (seeds), the whole range.
  bool get_u64(std::string_view key, std::uint64_t* out);

  // Bytes: an integer (1e9 allowed when integral) or a string such as "64MiB", "2 GiB", "80GB".
  bool get_bytes(std::string_view key, std::uint64_t min, std::uint64_t* out);

  bool get_double(std::string_view key, const Range& range, double* out);

  // A string; null counts as absent (DeepSpeed's Optional paths).
  bool get_string(std::string_view key, bool allow_empty, std::string* out);

  // A string or a non-empty array of distinct non-empty strings.
  bool get_string_list(std::string_view key, std::vector<std::string>* out);

  // One of `names` (a name "auto" among them makes "auto" an ordinary value).
  template <typename E>
  bool get_enum(std::string_view key, std::span<const EnumName<E>> names, E* out,
                bool ignore_case = false) {
    const bool auto_is_a_name = std::any_of(names.begin(), names.end(),
                                            [](const EnumName<E>& n) { return n.name == "auto"; });
    const Json* v = auto_is_a_name ? take(key) : take_value(key);
    if (v == nullptr) return false;
    if (!v->is_string()) return type_error(key, core::str_cat("one of ", join_names(names)), *v);
    const std::string& s = v->get_ref<const std::string&>();
    for (const EnumName<E>& n : names) {
      if (s == n.name || (ignore_case && lower(s) == lower(n.name))) {
        *out = n.value;
        return true;
      }
    }
    return fail_false(key, core::str_cat(show(*v), " is not one of ", join_names(names)));
  }

  // A nested object; absent or null gives a reader of nothing.
  ObjectReader child(std::string_view key);

  // Keys DeepSpeed accepts that have no effect in strata: accepted, noted at info level.
  void ignore(std::initializer_list<std::string_view> keys, std::string_view why);

  // Picks the spelling to read among several names of one key (the first is
  // the current name). Two given with different values is an error; an old
  // name given adds a warning.
  std::string_view pick(std::initializer_list<Spelling> spellings);

  // Reports the keys nobody asked for: a misspelling of a known key, or any
  // unknown key under `strata`, is a problem recorded in the context (reading
  // goes on); another unknown key a warning (a problem under strict). Returns
  // the context's error when the current section has a wrong value, else OK.
  core::Status finish();

  // "<key>: missing; <what>", naming a present key within two edits of it
  // (`"typ" is there: a misspelling?`), as a wrong value.
  void missing(std::string_view key, std::string_view what);

 private:
  // take() that rejects "auto" on keys that do not resolve it.
  const Json* take_value(std::string_view key);
  bool type_error(std::string_view key, std::string_view expected, const Json& v);
  bool fail_false(std::string_view key, std::string_view message);

  const Json* object_;
  std::string path_;
  Context* ctx_;
  std::vector<std::string> known_;
  std::vector<std::string> old_names_;  // known, but never suggested
};

// Objects and arrays nested deeper than this are refused while parsing (the
// bound every JSON reader shares: engine/config/json_bounds.h).
using json_bounds::kMaxJsonDepth;
// Parses `text` (comments allowed) into `out`. Errors are kInvalidArgument:
// invalid JSON names the byte offset; nesting deeper than kMaxJsonDepth is
// refused as soon as it is seen (so no document costs more than a small
// multiple of its size, and nothing recurses deeply over it); a key given
// twice in one object (which nlohmann would take silently, keeping the last)
// names the first duplicate's key path, as DeepSpeed rejects duplicates too.
core::Status parse_json(std::string_view text, Json* out);

}  // namespace strata::engine::config_internal
