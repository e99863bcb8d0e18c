// The generic JSON reader of engine/config/json_reader.h: messages, numbers,
// the object reader with its unknown-key report, and the duplicate-key check.
#include "engine/config/json_reader.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/logging.h"
#include "core/status.h"
#include "core/str.h"

namespace strata::engine::config_internal {
namespace {

using core::Status;
using core::str_cat;

// The bound `x` breaks. An upper bound of INT_MAX or more only guards the
// field's type, so it is not mentioned unless broken.
std::string describe_int_bounds(std::int64_t x, std::int64_t lo, std::int64_t hi) {
  const bool open_above = hi >= std::numeric_limits<int>::max();
  if (x < lo && open_above) return str_cat(">= ", lo);
  if (x > hi && open_above) return str_cat("<= ", hi);
  return str_cat("in [", lo, ", ", hi, "]");
}

// DeepSpeed rejects duplicate keys; nlohmann keeps the last one. The
// checking pass before the parse (json_bounds::CheckingSax: syntax and
// nesting, nothing built) finds the first duplicate and its path.
class DuplicateKeyFinder : public json_bounds::CheckingSax {
 public:
  const std::string& duplicate() const { return duplicate_; }

 protected:
  bool on_enter(bool is_object) override {
    frames_.push_back(Frame{.is_object = is_object});
    return true;
  }
  void on_leave() override {
    if (!frames_.empty()) frames_.pop_back();
  }
  bool on_key(const std::string& key) override {
    if (frames_.empty()) return true;
    Frame& top = frames_.back();
    if (!top.keys.insert(key).second && duplicate_.empty()) duplicate_ = path_with(key);
    top.last_key = key;
    return true;
  }

 private:
  struct Frame {
    bool is_object = true;
    std::unordered_set<std::string> keys = {};  // (a set: linear in a document of many keys)
    std::string last_key = {};
  };
  std::string path_with(const std::string& key) const {
    std::string path;
    for (std::size_t i = 0; i + 1 < frames_.size(); ++i) {
      if (!frames_[i].is_object) continue;
      path += frames_[i].last_key;
      path += '.';
    }
    return path + key;
  }
  std::vector<Frame> frames_;
  std::string duplicate_;
};

}  // namespace

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// --- message helpers ------------------------------------------------------------

std::string show(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string show_double(double v) {
  if (std::trunc(v) == v && std::fabs(v) < 1e15) return str_cat(static_cast<std::int64_t>(v));
  return show(Json(v));
}

std::string show_paths(const std::vector<std::string>& paths) {
  Json a = Json::array();
  for (const std::string& p : paths) a.push_back(p);
  return show(a);
}

std::string Range::describe() const {
  if (std::isinf(hi)) return str_cat(lo_open ? "> " : ">= ", show_double(lo));
  return str_cat("in ", lo_open ? "(" : "[", show_double(lo), ", ", show_double(hi),
                 hi_open ? ")" : "]");
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// --- parse context ----------------------------------------------------------------

void Context::fail(std::string_view path, std::string_view message) {
  if (section_failed_) return;
  problems_.push_back(str_cat(path, ": ", message));
  section_failed_ = true;
  any_wrong_value_ = true;
}

void Context::fail_key(std::string_view path, std::string_view message) {
  problems_.push_back(str_cat(path, ": ", message));
}

void Context::absorb(const core::Status& s) {
  if (s.ok() || section_failed_ || s.message() == error().message()) return;
  problems_.push_back(std::string(s.message()));
  section_failed_ = true;
  any_wrong_value_ = true;
}

core::Status Context::error() const {
  if (problems_.empty()) return Status();
  if (problems_.size() == 1) return Status::invalid_argument(problems_[0]);
  std::string all = str_cat(problems_.size(), " problems:");
  for (std::size_t i = 0; i < problems_.size(); ++i) {
    all += str_cat(i == 0 ? " (" : "; (", i + 1, ") ", problems_[i]);
  }
  return Status::invalid_argument(all);
}

namespace {

// A program reads its config more than once (checked early, then by the
// engine): each line is logged once per process, the first time it is shown
// (a line whose level is off is not remembered). Bounded: past
// kRememberedLines distinct lines, every line is logged again.
constexpr std::size_t kRememberedLines = 4096;

std::mutex& logged_mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_set<std::string>& logged_lines() {
  static std::unordered_set<std::string> seen;
  return seen;
}

bool first_time(core::LogLevel level, const std::string& line) {
  if (!core::log_enabled(level)) return false;
  std::lock_guard<std::mutex> lock(logged_mu());
  std::unordered_set<std::string>& seen = logged_lines();
  return seen.size() >= kRememberedLines || seen.insert(line).second;
}

}  // namespace

void forget_logged_lines() {
  std::lock_guard<std::mutex> lock(logged_mu());
  logged_lines().clear();
}

void Context::warn(std::string path, std::string message) {
  if (std::string line = str_cat("config: ", path, ": ", message); first_time(core::LogLevel::kWarn, line)) {
    STRATA_LOG(kWarn) << line;
  }
  warnings_.push_back(ConfigWarning{.key_path = std::move(path), .message = std::move(message)});
}

void Context::note(std::string_view path, std::string_view message) {
  if (std::string line = str_cat("config: ", path, ": ", message); first_time(core::LogLevel::kInfo, line)) {
    STRATA_LOG(kInfo) << line;
  }
}

void Context::resolved(std::string_view path, std::string_view value, std::string_view why) {
  if (std::string line = str_cat("config: ", path, ": \"auto\" resolved to ", value, " (", why, ")");
      first_time(core::LogLevel::kInfo, line)) {
    STRATA_LOG(kInfo) << line;
  }
}

bool read_int(Context* ctx, std::string_view path, const Json& v, std::int64_t lo, std::int64_t hi,
              std::int64_t* out) {
  std::int64_t x = 0;
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(kMaxI64)) {
      ctx->fail(path, str_cat(show(v), " is out of range (must be <= ", hi, ")"));
      return false;
    }
    x = static_cast<std::int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d) {
      ctx->fail(path, str_cat(show(v), " is not an integer"));
      return false;
    }
    // 2^63: the first double past the int64 range.
    if (d >= 9223372036854775808.0 || d < -9223372036854775808.0) {
      ctx->fail(path, str_cat(show(v), " is out of range (must be ",
                              d > 0 ? str_cat("<= ", hi) : str_cat(">= ", lo), ")"));
      return false;
    }
    x = static_cast<std::int64_t>(d);
  } else {
    ctx->fail(path, str_cat("expected an integer, got ", show(v)));
    return false;
  }
  if (x < lo || x > hi) {
    ctx->fail(path, str_cat(x, " must be ", describe_int_bounds(x, lo, hi)));
    return false;
  }
  *out = x;
  return true;
}

bool read_double(Context* ctx, std::string_view path, const Json& v, const Range& range,
                 double* out) {
  if (!v.is_number()) {
    ctx->fail(path, str_cat("expected a number, got ", show(v)));
    return false;
  }
  const double d = v.get<double>();
  if (!std::isfinite(d) || !range.contains(d)) {
    ctx->fail(path, str_cat(show(v), " must be ", range.describe()));
    return false;
  }
  *out = d;
  return true;
}

bool is_auto(const Json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

// --- the object reader --------------------------------------------------------------

const Json* ObjectReader::peek(std::string_view key) const {
  if (object_ == nullptr) return nullptr;
  const auto it = object_->find(std::string(key));
  return it == object_->end() ? nullptr : &*it;
}

std::string ObjectReader::bytes_text(std::string_view key, std::uint64_t bytes) const {
  const Json* v = peek(key);
  if (v != nullptr && v->is_string()) return str_cat(show(*v), " (", bytes, " bytes)");
  return str_cat(bytes);
}

const Json* ObjectReader::take(std::string_view key) {
  known_.emplace_back(key);
  if (!ctx_->ok()) return nullptr;
  return peek(key);
}

bool ObjectReader::take_auto(std::string_view key) {
  const Json* v = take(key);
  return v != nullptr && is_auto(*v);
}

bool ObjectReader::get_bool(std::string_view key, bool* out) {
  const Json* v = take_value(key);
  if (v == nullptr) return false;
  if (!v->is_boolean()) return type_error(key, "a boolean (true or false)", *v);
  *out = v->get<bool>();
  return true;
}

bool ObjectReader::get_u64(std::string_view key, std::uint64_t* out) {
  const Json* v = take_value(key);
  if (v == nullptr) return false;
  if (v->is_number_unsigned()) {
    *out = v->get<std::uint64_t>();
    return true;
  }
  std::int64_t x = 0;
  if (!read_int(ctx_, path_of(key), *v, 0, kMaxI64, &x)) return false;
  *out = static_cast<std::uint64_t>(x);
  return true;
}

bool ObjectReader::get_bytes(std::string_view key, std::uint64_t min, std::uint64_t* out) {
  const Json* v = take_value(key);
  if (v == nullptr) return false;
  std::uint64_t bytes = 0;
  if (v->is_number_unsigned()) {
    bytes = v->get<std::uint64_t>();
  } else if (v->is_number_integer() && v->get<std::int64_t>() < 0) {
    return fail_false(key, str_cat(show(*v), " must be >= ", min, " (a byte count)"));
  } else if (v->is_number_integer()) {
    bytes = static_cast<std::uint64_t>(v->get<std::int64_t>());
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::trunc(d) != d)
      return fail_false(key, str_cat(show(*v), " is not a whole number of bytes"));
    if (d < 0) return fail_false(key, str_cat(show(*v), " must be >= ", min, " (a byte count)"));
    if (d >= 18446744073709551616.0) return fail_false(key, str_cat(show(*v), " is out of range"));
    bytes = static_cast<std::uint64_t>(d);
  } else if (v->is_string()) {
    if (!core::parse_bytes(v->get_ref<const std::string&>(), &bytes)) {
      return type_error(key, "a byte count (an integer or a string such as \"64MiB\" or \"2 GiB\")",
                        *v);
    }
  } else {
    return type_error(key, "a byte count (an integer or a string such as \"64MiB\" or \"2 GiB\")",
                      *v);
  }
  if (bytes < min) return fail_false(key, str_cat(show(*v), " must be >= ", min, " bytes"));
  *out = bytes;
  return true;
}

bool ObjectReader::get_double(std::string_view key, const Range& range, double* out) {
  const Json* v = take_value(key);
  return v != nullptr && read_double(ctx_, path_of(key), *v, range, out);
}

bool ObjectReader::get_string(std::string_view key, bool allow_empty, std::string* out) {
  const Json* v = take_value(key);
  if (v == nullptr || v->is_null()) return false;
  if (!v->is_string()) return type_error(key, "a string", *v);
  const std::string& s = v->get_ref<const std::string&>();
  if (s.empty() && !allow_empty) return fail_false(key, "\"\" must not be empty");
  *out = s;
  return true;
}

bool ObjectReader::get_string_list(std::string_view key, std::vector<std::string>* out) {
  const Json* v = take_value(key);
  if (v == nullptr) return false;
  std::vector<std::string> list;
  if (v->is_string()) {
    list.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const Json& e : *v) {
      const std::string element_path = str_cat(path_of(key), "[", list.size(), "]");
      if (!e.is_string()) {
        ctx_->fail(element_path, str_cat("expected a string, got ", show(e)));
        return false;
      }
      const std::string& s = e.get_ref<const std::string&>();
      if (std::find(list.begin(), list.end(), s) != list.end()) {
        ctx_->fail(element_path, str_cat(show(e), " is listed twice"));
        return false;
      }
      list.push_back(s);
    }
    if (list.empty()) return fail_false(key, "[] must not be empty (give at least one path)");
  } else {
    return type_error(key, "a string or an array of strings", *v);
  }
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list[i].empty()) {
      ctx_->fail(v->is_array() ? str_cat(path_of(key), "[", i, "]") : path_of(key),
                 "\"\" must not be empty");
      return false;
    }
  }
  *out = std::move(list);
  return true;
}

ObjectReader ObjectReader::child(std::string_view key) {
  const Json* v = take(key);
  if (v != nullptr && v->is_null()) v = nullptr;
  if (v != nullptr && !v->is_object()) {
    type_error(key, "an object", *v);
    v = nullptr;
  }
  return ObjectReader(v, path_of(key), ctx_);
}

void ObjectReader::ignore(std::initializer_list<std::string_view> keys, std::string_view why) {
  for (std::string_view key : keys) {
    if (take(key) != nullptr) {
      ctx_->note(path_of(key), str_cat("accepted; no effect in strata (", why, ")"));
    }
  }
}

std::string_view ObjectReader::pick(std::initializer_list<Spelling> spellings) {
  const Spelling* chosen = nullptr;
  const Json* chosen_value = nullptr;
  const std::string_view current = spellings.begin()->name;
  for (const Spelling& s : spellings) {
    known_.emplace_back(s.name);
    if (s.old) old_names_.emplace_back(s.name);
    const Json* v = peek(s.name);
    if (v == nullptr || !ctx_->ok()) continue;
    if (s.old) {
      warn(s.name, str_cat("old name of ", path_of(current), "; read as ", current,
                           " (write the new name)"));
    }
    if (chosen == nullptr) {
      chosen = &s;
      chosen_value = v;
    } else if (*v != *chosen_value) {
      fail(s.name, str_cat(show(*v), " conflicts with ", path_of(chosen->name), " = ",
                           show(*chosen_value), ": both name one key; give one"));
    }
  }
  return chosen != nullptr ? chosen->name : current;
}

// The most edits a misspelling of `key` is taken to have: two, or one for
// keys of four letters or fewer, where two edits reach other words.
namespace {
std::size_t misspelling_edits(std::string_view key) { return key.size() <= 4 ? 1 : 2; }
}  // namespace

Status ObjectReader::finish() {
  // A section stopped at a wrong value may not have asked for all of its
  // keys; the top level's keys are asked for by every section.
  const bool top_level = path_.empty();
  if (object_ == nullptr || !ctx_->ok() || (top_level && ctx_->any_wrong_value())) {
    return ctx_->ok() ? Status() : ctx_->error();
  }
  // strata's own section: no DeepSpeed config has keys there, so an unknown
  // one is a mistake.
  const bool own = path_ == "strata" || path_.starts_with("strata.");
  for (const auto& item : object_->items()) {
    const std::string& key = item.key();
    if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
    std::string_view best;
    std::size_t best_distance = misspelling_edits(key) + 1;
    // Current names first; an old name only when no current one is close.
    for (const bool old_ones : {false, true}) {
      for (const std::string& k : known_) {
        const bool is_old = std::find(old_names_.begin(), old_names_.end(), k) != old_names_.end();
        if (is_old != old_ones) continue;
        const std::size_t d = edit_distance(key, k);
        if (d < best_distance) {
          best_distance = d;
          best = k;
        }
      }
      if (!best.empty()) break;
    }
    std::string message = "unknown key";
    if (!best.empty()) {
      message += str_cat("; did you mean \"", best, "\"? (a misspelled key is an error: its setting would "
                         "silently take its default)");
    } else if (own) {
      message += " in strata's own section (an error: see docs/config.md for its keys)";
    } else if (ctx_->strict()) {
      message += " (an error under strata.strict)";
    }
    if (!best.empty() || own || ctx_->strict()) {
      ctx_->fail_key(path_of(key), message);
    } else {
      ctx_->warn(path_of(key), message + "; ignored");
    }
  }
  return Status();
}

void ObjectReader::missing(std::string_view key, std::string_view what) {
  std::string message = str_cat("missing; ", what);
  if (object_ != nullptr) {
    for (const auto& item : object_->items()) {
      const std::string& k = item.key();
      if (k == key || std::find(known_.begin(), known_.end(), k) != known_.end()) continue;
      if (edit_distance(k, key) <= misspelling_edits(key)) {
        message += str_cat(" (\"", k, "\" is there: a misspelling of \"", key, "\"?)");
        break;
      }
    }
  }
  fail(key, message);
}

const Json* ObjectReader::take_value(std::string_view key) {
  const Json* v = take(key);
  if (v != nullptr && is_auto(*v)) {
    fail(key,
         "\"auto\" is not accepted here (only the keys docs/config.md lists resolve "
         "\"auto\"); write a value");
    return nullptr;
  }
  return v;
}

bool ObjectReader::type_error(std::string_view key, std::string_view expected, const Json& v) {
  fail(key, str_cat("expected ", expected, ", got ", show(v)));
  return false;
}

bool ObjectReader::fail_false(std::string_view key, std::string_view message) {
  fail(key, message);
  return false;
}

// --- the document -------------------------------------------------------------------

Status parse_json(std::string_view text, Json* out) {
  DuplicateKeyFinder finder;
  const Status checked = json_bounds::check_json(text, &finder, /*ignore_comments=*/true);
  if (!checked.ok()) {
    if (!finder.too_deep()) return checked;
    return Status::invalid_argument(str_cat(checked.message(), " (a configuration needs a handful)"));
  }
  if (!finder.duplicate().empty()) {
    return Status::invalid_argument(str_cat(finder.duplicate(),
                                            ": duplicate key (DeepSpeed "
                                            "rejects duplicate keys too)"));
  }
  // Checked: the plain parser (linear; nlohmann's callback parser is not).
  try {
    *out = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const Json::exception& e) {  // the check passed: not expected
    return Status::invalid_argument(
        str_cat("invalid JSON: ", json_bounds::preview(e.what(), json_bounds::kMaxParserMessageChars)));
  }
  return Status();
}

}  // namespace strata::engine::config_internal
