// Small string helpers shared by every module: concatenation for messages and
// human-readable byte counts.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>

namespace strata::core {

// Concatenates anything with an ostream operator<<. For error messages, not hot paths.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// "0 B", "512 B", "1.50 KiB", "80.00 GiB", "1.82 TiB" (binary units).
std::string format_bytes(std::uint64_t bytes);

// Parses "123", "1e9", "64KiB", "1.5 GiB", "80GB", "2TB" (binary and decimal
// suffixes, case-insensitive B optional). Returns false on anything else,
// negative values, or values beyond 2^63.
bool parse_bytes(std::string_view text, std::uint64_t* out);

}  // namespace strata::core
