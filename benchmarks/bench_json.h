// Small helpers for benchmark programs: medians and means of repetitions, and
// a minimal JSON writer for their --json output (objects, arrays, numbers,
// strings; non-finite numbers are written as null). Header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

// Builds JSON text in memory. Thread-compatible. Keys are given for members
// of an object and left empty for elements of an array; the caller keeps
// begin/end balanced.
class JsonWriter {
 public:
  JsonWriter& begin_object(std::string_view key = {}) { return open(key, '{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array(std::string_view key = {}) { return open(key, '['); }
  JsonWriter& end_array() { return close(']'); }

  JsonWriter& num(std::string_view key, double v) {
    prefix(key);
    if (!std::isfinite(v)) {
      out_ += "null";
    } else {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.6g", v);
      out_ += buf;
    }
    return *this;
  }
  JsonWriter& integer(std::string_view key, std::int64_t v) {
    prefix(key);
    out_ += std::to_string(v);
    return *this;
  }
  JsonWriter& boolean(std::string_view key, bool v) {
    prefix(key);
    out_ += v ? "true" : "false";
    return *this;
  }
  JsonWriter& str(std::string_view key, std::string_view v) {
    prefix(key);
    quote(v);
    return *this;
  }
  JsonWriter& nums(std::string_view key, const std::vector<double>& v) {
    begin_array(key);
    for (double x : v) num({}, x);
    return end_array();
  }

  const std::string& text() const { return out_; }

  // Writes the text (and a final newline) to `path`; false when it cannot.
  bool write_file(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) return false;
    const bool ok = std::fwrite(out_.data(), 1, out_.size(), f) == out_.size() && std::fputc('\n', f) != EOF;
    return std::fclose(f) == 0 && ok;
  }

 private:
  JsonWriter& open(std::string_view key, char bracket) {
    prefix(key);
    out_ += bracket;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& close(char bracket) {
    const bool empty = first_.empty() || first_.back();
    if (!first_.empty()) first_.pop_back();
    if (!empty) newline();
    out_ += bracket;
    return *this;
  }
  void prefix(std::string_view key) {
    if (!first_.empty()) {
      if (!first_.back()) out_ += ',';
      first_.back() = false;
      newline();
    }
    if (!key.empty()) {
      quote(key);
      out_ += ": ";
    }
  }
  void newline() {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  void quote(std::string_view s) {
    out_ += '"';
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out_ += '\\';
        out_ += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
        out_ += buf;
      } else {
        out_ += c;
      }
    }
    out_ += '"';
  }

  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written into it yet
};

}  // namespace strata::bench
