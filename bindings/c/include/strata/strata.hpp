// strata.hpp: std::unique_ptr owners over the C API's handles and strings
// (header-only; the C API stays the only ABI).
//
//   strata_engine* raw = nullptr;
//   if (strata_engine_create(json, &raw) != STRATA_STATUS_OK) { ... strata_last_error() ... }
//   strata::engine_ptr engine(raw);  // strata_engine_destroy when it goes out of scope
#ifndef STRATA_STRATA_HPP_
#define STRATA_STRATA_HPP_

#include <memory>

#include "strata/strata.h"

namespace strata {

struct engine_deleter {
  void operator()(strata_engine* e) const noexcept { strata_engine_destroy(e); }
};
struct string_deleter {
  void operator()(char* s) const noexcept { strata_string_free(s); }
};

using engine_ptr = std::unique_ptr<strata_engine, engine_deleter>;  // from strata_engine_create[_ex]
using string_ptr = std::unique_ptr<char, string_deleter>;           // from strata_config_resolve[_ex]

}  // namespace strata

#endif  // STRATA_STRATA_HPP_
