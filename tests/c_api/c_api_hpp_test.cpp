// strata.hpp: the unique_ptr owners destroy what the C API created.
#include <cstdio>
#include <cstring>

#include "strata/strata.hpp"

int main() {
  int failures = 0;
  const char* config = "{\"train_batch_size\": 4, \"strata\": {\"device\": \"host\"}}";
  strata_engine* raw = nullptr;
  if (strata_engine_create(config, &raw) != STRATA_STATUS_OK) {
    std::fprintf(stderr, "strata_engine_create: %s\n", strata_last_error());
    return 1;
  }
  strata::engine_ptr engine(raw);
  double scale = 0.0;
  if (strata_loss_scale(engine.get(), &scale) != STRATA_STATUS_OK || scale != 1.0) ++failures;
  engine.reset();  // strata_engine_destroy
  strata::engine_ptr none;  // destroying an empty one is fine

  char* json = nullptr;
  if (strata_config_resolve(config, &json) != STRATA_STATUS_OK) ++failures;
  strata::string_ptr resolved(json);
  if (resolved == nullptr || std::strstr(resolved.get(), "\"chunk_bytes\"") == nullptr) ++failures;
  if (failures == 0) std::printf("c_api_hpp_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
