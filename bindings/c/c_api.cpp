// The C API's implementation: every entry point runs inside guard(), which
// turns a Status into a strata_status plus the thread's last-error message and
// catches anything thrown (bad_alloc becomes OUT_OF_MEMORY, the rest INTERNAL).
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "engine/config.h"
#include "engine/core/status.h"
#include "strata/strata.h"

namespace strata::c_api {
namespace {

thread_local std::string g_last_error;

static_assert(static_cast<int>(core::StatusCode::kInternal) == STRATA_STATUS_INTERNAL,
              "strata_status must follow core::StatusCode one to one");

strata_status fail(const core::Status& s) {
  g_last_error = s.to_string();
  return static_cast<strata_status>(s.code());
}

template <typename Fn>
strata_status guard(Fn&& fn) noexcept {
  try {
    const core::Status s = fn();
    return s.ok() ? STRATA_STATUS_OK : fail(s);
  } catch (const std::bad_alloc&) {
    g_last_error = "OUT_OF_MEMORY: a host allocation failed";
    return STRATA_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = std::string("INTERNAL: unexpected exception: ") + e.what();
    return STRATA_STATUS_INTERNAL;
  } catch (...) {
    g_last_error = "INTERNAL: unexpected exception";
    return STRATA_STATUS_INTERNAL;
  }
}

core::Result<engine::Config> parse(const char* json) {
  if (json == nullptr) return core::Status::invalid_argument("config_json is NULL");
  return engine::parse_config(json);
}

}  // namespace
}  // namespace strata::c_api

using strata::c_api::guard;
namespace core = strata::core;

extern "C" {

const char* strata_version(void) noexcept { return "0.1.0"; }

int strata_abi_compatible(int major, int minor) noexcept {
  if (major != STRATA_VERSION_MAJOR || minor < 0) return 0;
  return STRATA_VERSION_MAJOR == 0 ? minor == STRATA_VERSION_MINOR : minor <= STRATA_VERSION_MINOR;
}

const char* strata_status_name(strata_status status) noexcept {
  switch (status) {
    case STRATA_STATUS_OK: return "OK";
    case STRATA_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case STRATA_STATUS_NOT_FOUND: return "NOT_FOUND";
    case STRATA_STATUS_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case STRATA_STATUS_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case STRATA_STATUS_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case STRATA_STATUS_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case STRATA_STATUS_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case STRATA_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case STRATA_STATUS_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case STRATA_STATUS_UNAVAILABLE: return "UNAVAILABLE";
    case STRATA_STATUS_IO_ERROR: return "IO_ERROR";
    case STRATA_STATUS_DATA_LOSS: return "DATA_LOSS";
    case STRATA_STATUS_CANCELLED: return "CANCELLED";
    case STRATA_STATUS_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN";
}

const char* strata_last_error(void) noexcept { return strata::c_api::g_last_error.c_str(); }

strata_status strata_config_check(const char* config_json, uint32_t* warning_count_out) noexcept {
  return guard([&]() -> core::Status {
    STRATA_ASSIGN_OR_RETURN(strata::engine::Config c, strata::c_api::parse(config_json));
    if (warning_count_out != nullptr) *warning_count_out = static_cast<uint32_t>(c.warnings.size());
    return core::Status();
  });
}

strata_status strata_config_resolve(const char* config_json, char** json_out) noexcept {
  return guard([&]() -> core::Status {
    if (json_out == nullptr) return core::Status::invalid_argument("json_out is NULL");
    STRATA_ASSIGN_OR_RETURN(strata::engine::Config c, strata::c_api::parse(config_json));
    const std::string text = strata::engine::to_json(c);
    char* out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out == nullptr) throw std::bad_alloc();
    std::memcpy(out, text.c_str(), text.size() + 1);
    *json_out = out;
    return core::Status();
  });
}

void strata_string_free(char* s) noexcept { std::free(s); }

}  // extern "C"
