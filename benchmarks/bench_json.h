// Small helpers for benchmark programs: medians and means of repetitions, and
// a JSON writer for their --json output (objects, arrays, numbers, strings;
// non-finite numbers are written as null) over nlohmann::ordered_json.
// Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strata::bench {

// The median (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0.0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

// A number for JSON output as `%.<digits>g` would show it (the figures are
// rounded to what is worth reading); integral values are written as integers
// and non-finite ones as null.
inline nlohmann::ordered_json json_number(double v, int digits = 6) {
  if (!std::isfinite(v)) return nullptr;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  const double rounded = std::strtod(buf, nullptr);
  if (rounded == std::trunc(rounded) && std::fabs(rounded) < 9e15) return static_cast<std::int64_t>(rounded);
  return rounded;
}

// Builds a JSON document (nlohmann::ordered_json: members keep the order they
// were written in). Thread-compatible. Keys are given for members of an
// object and left empty for elements of an array; the caller keeps
// begin/end balanced.
class JsonWriter {
 public:
  JsonWriter& begin_object(std::string_view key = {}) { return open(key, nlohmann::ordered_json::object()); }
  JsonWriter& end_object() { return close(); }
  JsonWriter& begin_array(std::string_view key = {}) { return open(key, nlohmann::ordered_json::array()); }
  JsonWriter& end_array() { return close(); }

  JsonWriter& num(std::string_view key, double v) {
    add(key, json_number(v));
    return *this;
  }
  JsonWriter& integer(std::string_view key, std::int64_t v) {
    add(key, v);
    return *this;
  }
  JsonWriter& boolean(std::string_view key, bool v) {
    add(key, v);
    return *this;
  }
  JsonWriter& str(std::string_view key, std::string_view v) {
    add(key, std::string(v));
    return *this;
  }
  JsonWriter& nums(std::string_view key, const std::vector<double>& v) {
    begin_array(key);
    for (double x : v) num({}, x);
    return end_array();
  }

  // The document, indented by two spaces (invalid UTF-8 becomes U+FFFD).
  std::string text() const {
    return root_.dump(2, ' ', /*ensure_ascii=*/false, nlohmann::ordered_json::error_handler_t::replace);
  }

  const nlohmann::ordered_json& doc() const { return root_; }

  // Writes the text (and a final newline) to `path`; false when it cannot.
  bool write_file(const std::string& path) const {
    const std::string out = text() + "\n";
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return false;
    const bool ok = std::fwrite(out.data(), 1, out.size(), f) == out.size();
    return std::fclose(f) == 0 && ok;
  }

 private:
  // Adds `v` to the innermost open container (or makes it the document) and
  // returns where it now lives.
  nlohmann::ordered_json* add(std::string_view key, nlohmann::ordered_json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    nlohmann::ordered_json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    nlohmann::ordered_json& member = parent[std::string(key)];
    member = std::move(v);
    return &member;
  }
  JsonWriter& open(std::string_view key, nlohmann::ordered_json container) {
    open_.push_back(add(key, std::move(container)));
    return *this;
  }
  JsonWriter& close() {
    if (!open_.empty()) open_.pop_back();
    return *this;
  }

  nlohmann::ordered_json root_;
  // The open containers, outermost first. Only the innermost one grows, so
  // the pointers to its ancestors stay valid.
  std::vector<nlohmann::ordered_json*> open_;
};

}  // namespace strata::bench
