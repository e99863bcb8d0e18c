/* strata: the C API, the only public ABI of the strata engine.
 *
 * Conventions:
 *  1. Every name starts with strata_ / STRATA_; functions are
 *     strata_<object>_<verb>.
 *  2. Fallible calls return strata_status (STRATA_STATUS_OK = 0); results come
 *     back through trailing out-parameters, which are written only on success.
 *  3. On failure the calling thread's strata_last_error() describes what went
 *     wrong (naming the key path, file, offset or sizes involved). It stays
 *     valid until the next failing call on that thread.
 *  4. No call throws, asserts or exits on bad input: misuse returns
 *     STRATA_STATUS_INVALID_ARGUMENT or STRATA_STATUS_FAILED_PRECONDITION.
 *  5. Ownership is written on every pointer: "borrowed" (valid for the call),
 *     "caller-owned, free with X", or "valid until Y". destroy/free functions
 *     accept NULL and do nothing.
 *  6. Structs that cross the API begin with uint32_t struct_size, set by the
 *     matching STRATA_*_INIT to the caller's sizeof; fields are only appended.
 *  7. Thread-safety is stated per function; functions without a statement
 *     are thread-safe.
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#if defined(STRATA_BUILDING_LIBRARY)
#define STRATA_API __attribute__((visibility("default")))
#else
#define STRATA_API
#endif

#ifdef __cplusplus
#define STRATA_NOEXCEPT noexcept
extern "C" {
#else
#define STRATA_NOEXCEPT
#endif

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 1
#define STRATA_VERSION_PATCH 0

/* Status codes. Stable: values are never renumbered. */
typedef enum strata_status {
  STRATA_STATUS_OK = 0,
  STRATA_STATUS_INVALID_ARGUMENT = 1,    /* the caller passed something wrong */
  STRATA_STATUS_NOT_FOUND = 2,           /* a named file, key or group does not exist */
  STRATA_STATUS_ALREADY_EXISTS = 3,      /* creating what exists (or a locked swap path) */
  STRATA_STATUS_PERMISSION_DENIED = 4,   /* the OS refused access */
  STRATA_STATUS_OUT_OF_MEMORY = 5,       /* an allocator failed */
  STRATA_STATUS_RESOURCE_EXHAUSTED = 6,  /* a budget or a disk would be exceeded */
  STRATA_STATUS_FAILED_PRECONDITION = 7, /* wrong call order or state */
  STRATA_STATUS_OUT_OF_RANGE = 8,        /* an offset or index past the end */
  STRATA_STATUS_UNIMPLEMENTED = 9,       /* not built in or not supported here */
  STRATA_STATUS_UNAVAILABLE = 10,        /* exists but cannot be used now (no GPU driver) */
  STRATA_STATUS_IO_ERROR = 11,           /* a read, write, open or fsync failed */
  STRATA_STATUS_DATA_LOSS = 12,          /* corrupt data (CRC mismatch, truncated file) */
  STRATA_STATUS_CANCELLED = 13,          /* stopped on request */
  STRATA_STATUS_INTERNAL = 14            /* a bug in strata */
} strata_status;

/* --- version ------------------------------------------------------------- */

/* The library's version, "MAJOR.MINOR.PATCH". Static storage. */
STRATA_API const char* strata_version(void) STRATA_NOEXCEPT;

/* Nonzero when a program built against headers of version major.minor may
 * use this library: the same major and a minor no newer than the library's
 * (while major is 0, the minor must match exactly). */
STRATA_API int strata_abi_compatible(int major, int minor) STRATA_NOEXCEPT;

/* --- errors -------------------------------------------------------------- */

/* A stable upper-case name for a status ("INVALID_ARGUMENT"); "UNKNOWN" for
 * a value that is not a strata_status. Static storage. */
STRATA_API const char* strata_status_name(strata_status status) STRATA_NOEXCEPT;

/* The message of the last failing call on this thread ("" if none). Valid
 * until the next failing call on this thread. */
STRATA_API const char* strata_last_error(void) STRATA_NOEXCEPT;

/* --- configuration ------------------------------------------------------- */

/* Parses and checks a JSON configuration (DeepSpeed's keys and strata's, see
 * docs/config.md) without creating an engine. On success writes the number of
 * warnings (unknown keys, keys without effect) to *warning_count_out (may be
 * NULL). Errors: STRATA_STATUS_INVALID_ARGUMENT naming the key path and the
 * value (config_json NULL or not valid). config_json is borrowed. */
STRATA_API strata_status strata_config_check(const char* config_json,
                                             uint32_t* warning_count_out) STRATA_NOEXCEPT;

/* Writes the resolved configuration (every key, defaults filled in) as a
 * NUL-terminated JSON string to *json_out: caller-owned, free with
 * strata_string_free. Errors as strata_config_check. */
STRATA_API strata_status strata_config_resolve(const char* config_json, char** json_out) STRATA_NOEXCEPT;

/* Frees a string strata returned. NULL is a no-op. */
STRATA_API void strata_string_free(char* s) STRATA_NOEXCEPT;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
