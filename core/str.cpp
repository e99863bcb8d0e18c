// Byte formatting and parsing.
#include "core/str.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace strata::core {

std::string format_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 6) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  return buf;
}

bool parse_bytes(std::string_view text, std::uint64_t* out) {
  std::string s(text);
  // Trim.
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t start = 0;
  while (start < s.size() && std::isspace(static_cast<unsigned char>(s[start]))) ++start;
  s = s.substr(start);
  if (s.empty() || s[0] == '-' || s[0] == '+') return false;
  char* end = nullptr;
  const double number = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(number) || number < 0) return false;
  std::string suffix(end);
  while (!suffix.empty() && std::isspace(static_cast<unsigned char>(suffix.front()))) {
    suffix.erase(suffix.begin());
  }
  for (char& c : suffix) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!suffix.empty() && suffix.back() == 'b') suffix.pop_back();
  double mult = 1;
  if (suffix.empty()) mult = 1;
  else if (suffix == "k") mult = 1e3;
  else if (suffix == "m") mult = 1e6;
  else if (suffix == "g") mult = 1e9;
  else if (suffix == "t") mult = 1e12;
  else if (suffix == "p") mult = 1e15;
  else if (suffix == "ki") mult = 1024.0;
  else if (suffix == "mi") mult = 1024.0 * 1024;
  else if (suffix == "gi") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "ti") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (suffix == "pi") mult = 1024.0 * 1024 * 1024 * 1024 * 1024;
  else return false;
  const double value = std::round(number * mult);
  if (value >= 9.2e18) return false;
  // Reject fractional byte counts such as "1.5" (but "1.5KiB" is fine).
  if (std::fabs(number * mult - value) > 1e-6 * std::max(1.0, value)) return false;
  *out = static_cast<std::uint64_t>(value);
  return true;
}

}  // namespace strata::core
