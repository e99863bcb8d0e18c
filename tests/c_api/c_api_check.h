/* The checks of the C API tests (C11): each failure is printed with its file
 * and line and counted in `failures`; a test's main returns failures != 0. */
#ifndef STRATA_TESTS_C_API_CHECK_H_
#define STRATA_TESTS_C_API_CHECK_H_

#include <stdio.h>
#include <string.h>

#include "strata/strata.h"

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* Checks a call's status and, for a failure, that the message contains
 * `needle`. */
#define CHECK_STATUS(call, want, needle)                                                      \
  do {                                                                                        \
    strata_status got_ = (call);                                                              \
    if (got_ != (want)) {                                                                     \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__, #call, \
              strata_status_name(got_), strata_status_name(want), strata_last_error());       \
      ++failures;                                                                             \
    } else if ((want) != STRATA_STATUS_OK && strstr(strata_last_error(), (needle)) == NULL) { \
      fprintf(stderr, "%s:%d: %s: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, #call, \
              strata_last_error(), (needle));                                                 \
      ++failures;                                                                             \
    }                                                                                         \
  } while (0)
#define CHECK_OK(call) CHECK_STATUS(call, STRATA_STATUS_OK, "")

#endif /* STRATA_TESTS_C_API_CHECK_H_ */
