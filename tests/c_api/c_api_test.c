/* The C API from C11: version, status names, the thread's last error, and
 * configuration checks. Exits 0 when every check holds; prints each failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  /* version */
  char expect[32];
  snprintf(expect, sizeof expect, "%d.%d.%d", STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR, STRATA_VERSION_PATCH);
  CHECK(strcmp(strata_version(), expect) == 0);
  CHECK(strata_abi_compatible(STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR));
  CHECK(!strata_abi_compatible(STRATA_VERSION_MAJOR + 1, 0));
  CHECK(!strata_abi_compatible(STRATA_VERSION_MAJOR, STRATA_VERSION_MINOR + 1));

  /* status names */
  CHECK(strcmp(strata_status_name(STRATA_STATUS_OK), "OK") == 0);
  CHECK(strcmp(strata_status_name(STRATA_STATUS_DATA_LOSS), "DATA_LOSS") == 0);
  CHECK(strcmp(strata_status_name((strata_status)99), "UNKNOWN") == 0);
  CHECK(strcmp(strata_last_error(), "") == 0);

  /* a good config, with one unknown key: a warning, not an error */
  uint32_t warnings = 99;
  CHECK(strata_config_check("{\"train_batch_size\": 8, \"bf16\": {\"enabled\": true}, \"no_such_key\": 1}",
                            &warnings) == STRATA_STATUS_OK);
  CHECK(warnings == 1);
  CHECK(strata_config_check("{\"train_micro_batch_size_per_gpu\": 2}", NULL) == STRATA_STATUS_OK);

  /* a bad one: the status and a message naming the key */
  strata_status s = strata_config_check("{\"train_batch_size\": 8, \"zero_optimization\": {\"stage\": 7}}", &warnings);
  CHECK(s == STRATA_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "zero_optimization.stage") != NULL);
  if (strstr(strata_last_error(), "zero_optimization.stage") == NULL) fprintf(stderr, "got: %s\n", strata_last_error());
  CHECK(warnings == 1); /* out-parameters are written only on success */
  CHECK(strata_config_check(NULL, NULL) == STRATA_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "NULL") != NULL);
  CHECK(strata_config_check("{not json", NULL) == STRATA_STATUS_INVALID_ARGUMENT);

  /* the resolved config: every key with its default */
  char* json = NULL;
  CHECK(strata_config_resolve("{\"train_batch_size\": 8}", &json) == STRATA_STATUS_OK);
  CHECK(json != NULL && strstr(json, "\"gradient_accumulation_steps\"") != NULL);
  CHECK(json != NULL && strstr(json, "\"chunk_bytes\"") != NULL);
  strata_string_free(json);
  strata_string_free(NULL);
  CHECK(strata_config_resolve("{\"train_batch_size\": 8}", NULL) == STRATA_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "json_out") != NULL);

  if (failures == 0) printf("c_api_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
