/* strata_init_from_safetensors from C11: a trained engine's weights exported
 * with strata_export_safetensors (F32 and BF16, one file and shards) become
 * the initial values of a second engine whose parameters have no init
 * callback: masters equal to the exported values bit for bit (F32: the first
 * engine's masters), compute copies too; a name prefix; a callback that
 * keeps its values; and each error named: a missing tensor, an extra one, a
 * shape mismatch, no files at all, bad paths and calls out of order. Exits 0
 * when every check holds; prints each failure. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

#include "c_api_check.h"

/* The last error mentions `needle`. */
#define CHECK_MESSAGE(needle)                                                                               \
  do {                                                                                                      \
    if (strstr(strata_last_error(), (needle)) == NULL) {                                                    \
      fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, strata_last_error(), (needle)); \
      ++failures;                                                                                           \
    }                                                                                                       \
  } while (0)

/* --- the parameters: name (after the prefix "model."), shape, group -------- */

enum { kParams = 4 };
struct param {
  const char* name;
  int64_t shape[2];
  int32_t ndim;
  const char* group;
  int32_t frozen;
  int64_t numel;
};
static const struct param kModel[kParams] = {
    {"w", {8, 32}, 2, "layer0", 0, 256},
    {"b", {8, 0}, 1, "layer0", 0, 8},
    {"v", {16, 8}, 2, "layer1", 0, 128},
    {"s", {4, 0}, 1, "frozen", 1, 4},
};
static const char* const kGroups[3] = {"layer0", "layer1", "frozen"};

static uint64_t next_u64(uint64_t* s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static float uniform(uint64_t* s) { return (float)(next_u64(s) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }
static float round_bf16(float f) { /* to bf16 (nearest even) and back; finite values */
  uint32_t u;
  memcpy(&u, &f, 4);
  u = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  memcpy(&f, &u, 4);
  return f;
}

static strata_status init_random(const char* name, float* out, int64_t numel, void* user_data) {
  (void)user_data;
  uint64_t seed = 77;
  for (const char* c = name; *c != '\0'; ++c) seed = seed * 131 + (unsigned char)*c;
  for (int64_t i = 0; i < numel; ++i) out[i] = 0.2f * uniform(&seed);
  return STRATA_STATUS_OK;
}
static strata_status init_sevens(const char* name, float* out, int64_t numel, void* user_data) {
  (void)name;
  (void)user_data;
  for (int64_t i = 0; i < numel; ++i) out[i] = 7.0f;
  return STRATA_STATUS_OK;
}

static const char* const kConfig =
    "{\"train_batch_size\": 4, \"bf16\": {\"enabled\": true},"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.01}},"
    " \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": %s},"
    " \"strata\": {\"device\": \"host\", \"io\": {\"backend\": \"%s\"}, \"cpu_adam\": {\"threads\": 1}}}";

static strata_engine* create(const char* offload, const char* io_backend) {
  char config[2048];
  snprintf(config, sizeof config, kConfig, offload, io_backend);
  strata_engine* e = NULL;
  CHECK_OK(strata_engine_create(config, &e));
  return e;
}

/* Registers kModel's parameters named prefix + name (all but `skip`, and
 * `odd` with its shape transposed); init for each: `init` (NULL: from the
 * files), `keep_callback` gets init_sevens. */
static void register_model(strata_engine* e, const char* prefix, strata_init_fn init, const char* skip,
                           const char* odd, const char* keep_callback) {
  for (int i = 0; i < kParams; ++i) {
    if (skip != NULL && strcmp(kModel[i].name, skip) == 0) continue;
    char name[64];
    snprintf(name, sizeof name, "%s%s", prefix, kModel[i].name);
    int64_t shape[2] = {kModel[i].shape[0], kModel[i].shape[1]};
    if (odd != NULL && strcmp(kModel[i].name, odd) == 0) {
      shape[0] = kModel[i].shape[1];
      shape[1] = kModel[i].shape[0];
    }
    strata_param_desc d = STRATA_PARAM_DESC_INIT;
    d.name = name;
    d.shape = shape;
    d.ndim = kModel[i].ndim;
    d.group = kModel[i].group;
    d.frozen = kModel[i].frozen;
    strata_init_fn fn = keep_callback != NULL && strcmp(kModel[i].name, keep_callback) == 0 ? init_sevens : init;
    CHECK_OK(strata_param_register(e, &d, fn, NULL));
  }
}

/* --- the first engine: trained a few steps, then exported ----------------- */

struct trained {
  float master[kParams][256]; /* trainable parameters only */
  unsigned char compute[3][4096];
  uint64_t compute_bytes[3];
};

static void train_and_export(const char* root, struct trained* out) {
  strata_engine* e = create("{\"device\": \"cpu\"}", "psync");
  if (e == NULL) return;
  register_model(e, "model.", init_random, NULL, NULL, NULL);
  CHECK_OK(strata_engine_finalize(e));
  strata_group_info info[3];
  for (int g = 0; g < 3; ++g) {
    info[g] = (strata_group_info)STRATA_GROUP_INFO_INIT;
    CHECK_OK(strata_group_info_get(e, kGroups[g], &info[g]));
    CHECK(info[g].size_bytes <= sizeof out->compute[g]);
  }
  unsigned char scratch[4096];
  uint16_t grads[2048];
  uint64_t seed = 99;
  for (int step = 0; step < 3; ++step) {
    for (int g = 1; g >= 0; --g) { /* layer1, layer0: trainable */
      for (uint64_t k = 0; k < info[g].size_bytes / 2; ++k) {
        const float v = 0.05f * uniform(&seed);
        uint32_t u;
        memcpy(&u, &v, 4);
        grads[k] = (uint16_t)(u >> 16);
      }
      CHECK_OK(strata_group_fetch_host(e, kGroups[g], scratch, info[g].size_bytes));
      CHECK_OK(strata_group_grads_host(e, kGroups[g], grads, info[g].size_bytes));
      CHECK_OK(strata_group_release(e, kGroups[g]));
    }
    CHECK_OK(strata_step_end(e, NULL));
  }
  for (int i = 0; i < kParams; ++i) {
    char name[64];
    snprintf(name, sizeof name, "model.%s", kModel[i].name);
    if (!kModel[i].frozen) CHECK_OK(strata_param_read_master(e, name, out->master[i], kModel[i].numel));
  }
  for (int g = 0; g < 3; ++g) {
    out->compute_bytes[g] = info[g].size_bytes;
    CHECK_OK(strata_group_fetch_host(e, kGroups[g], out->compute[g], info[g].size_bytes));
    CHECK_OK(strata_group_release(e, kGroups[g]));
  }
  char dir[1200];
  static const char* const kDirs[4] = {"f32", "f32_sharded", "bf16", "bf16_sharded"};
  for (int k = 0; k < 4; ++k) {
    snprintf(dir, sizeof dir, "%s/%s", root, kDirs[k]);
    /* Shards of at most 600 bytes: w (F32 1 KiB) alone, b and v together in BF16, ... */
    CHECK_OK(strata_export_safetensors(e, dir, k < 2 ? STRATA_DTYPE_F32 : STRATA_DTYPE_BF16, k % 2 == 1 ? 600 : 0));
  }
  strata_engine_destroy(e);
}

/* --- a second engine from the files --------------------------------------- */

/* Loads `path` (a directory or a file) into a fresh engine whose parameters
 * are named `prefix` + name, with NULL init (but `keep_callback`): with
 * prefix "" the files' "model." is the name prefix. Checks masters and
 * compute copies against the first engine's (rounded to BF16 when `bf16`). */
static void load_and_compare(const char* path, const char* prefix, int bf16, const struct trained* t,
                             const char* offload, const char* io_backend, const char* keep_callback) {
  strata_engine* e = create(offload, io_backend);
  if (e == NULL) return;
  register_model(e, prefix, NULL, NULL, NULL, keep_callback);
  CHECK_OK(strata_init_from_safetensors(e, path, strcmp(prefix, "model.") == 0 ? NULL : "model."));
  CHECK_OK(strata_engine_finalize(e));
  for (int i = 0; i < kParams; ++i) {
    if (kModel[i].frozen) continue;
    char name[64];
    snprintf(name, sizeof name, "%s%s", prefix, kModel[i].name);
    float got[256];
    CHECK_OK(strata_param_read_master(e, name, got, kModel[i].numel));
    int same = 1;
    for (int64_t k = 0; k < kModel[i].numel; ++k) {
      float want = bf16 ? round_bf16(t->master[i][k]) : t->master[i][k];
      if (keep_callback != NULL && strcmp(kModel[i].name, keep_callback) == 0) want = 7.0f;
      if (memcmp(&got[k], &want, 4) != 0) same = 0;
    }
    if (!same) fprintf(stderr, "%s: masters of '%s' differ from the exported values\n", path, name);
    CHECK(same);
  }
  if (keep_callback == NULL) {
    /* The compute copies are the masters rounded to BF16, as the first
     * engine's optimizer left its own (the frozen group's too). */
    for (int g = 0; g < 3; ++g) {
      unsigned char got[4096];
      CHECK_OK(strata_group_fetch_host(e, kGroups[g], got, t->compute_bytes[g]));
      CHECK_OK(strata_group_release(e, kGroups[g]));
      CHECK(memcmp(got, t->compute[g], t->compute_bytes[g]) == 0);
    }
  }
  strata_engine_destroy(e);
}

static int file_exists(const char* path) { return access(path, F_OK) == 0; }

static void loads_what_was_exported(const char* root, const struct trained* t) {
  char path[1200];
  snprintf(path, sizeof path, "%s/f32_sharded/model.safetensors.index.json", root);
  CHECK(file_exists(path)); /* really sharded */
  snprintf(path, sizeof path, "%s/bf16_sharded/model.safetensors.index.json", root);
  CHECK(file_exists(path));

  snprintf(path, sizeof path, "%s/f32", root);
  load_and_compare(path, "model.", 0, t, "{\"device\": \"cpu\"}", "psync", NULL);
  snprintf(path, sizeof path, "%s/f32_sharded", root);
  load_and_compare(path, "model.", 0, t, "{\"device\": \"cpu\"}", "psync", NULL);
  snprintf(path, sizeof path, "%s/bf16", root);
  load_and_compare(path, "model.", 1, t, "{\"device\": \"cpu\"}", "psync", NULL);
  /* Optimizer state on nvme, the default I/O backend. */
  char offload[1400];
  snprintf(offload, sizeof offload, "mkdir -p '%s/swap'", root);
  CHECK(system(offload) == 0);
  snprintf(offload, sizeof offload, "{\"device\": \"nvme\", \"nvme_path\": \"%s/swap\"}", root);
  snprintf(path, sizeof path, "%s/bf16_sharded", root);
  load_and_compare(path, "model.", 1, t, offload, "auto", NULL);
  /* The file itself; a name prefix; a parameter that keeps its callback. */
  snprintf(path, sizeof path, "%s/f32/model.safetensors", root);
  load_and_compare(path, "model.", 0, t, "{\"device\": \"cpu\"}", "psync", NULL);
  snprintf(path, sizeof path, "%s/f32_sharded", root);
  load_and_compare(path, "", 0, t, "{\"device\": \"cpu\"}", "psync", NULL);
  snprintf(path, sizeof path, "%s/bf16", root);
  load_and_compare(path, "model.", 1, t, "{\"device\": \"cpu\"}", "psync", "v");
}

/* --- errors ---------------------------------------------------------------- */

static void names_each_error(const char* root) {
  char dir[1200], file[1300], index[1300];
  snprintf(dir, sizeof dir, "%s/f32", root);
  snprintf(file, sizeof file, "%s/f32/model.safetensors", root);
  strata_param_desc extra = STRATA_PARAM_DESC_INIT;
  const int64_t shape[1] = {3};
  extra.name = "model.extra";
  extra.shape = shape;
  extra.ndim = 1;

  /* NULL init and no files: finalize names the parameter. */
  strata_engine* e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    register_model(e, "model.", NULL, NULL, NULL, NULL);
    CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_FAILED_PRECONDITION, "'model.w' has no init callback");
    CHECK_MESSAGE("strata_init_from_safetensors");
    strata_engine_destroy(e);
  }
  /* A missing tensor, found when both are known: here by the files... */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    register_model(e, "model.", NULL, NULL, NULL, NULL);
    CHECK_OK(strata_param_register(e, &extra, NULL, NULL));
    CHECK_STATUS(strata_init_from_safetensors(e, dir, NULL), STRATA_STATUS_NOT_FOUND, "'model.extra'");
    CHECK_MESSAGE(file);
    CHECK_MESSAGE("no tensor 'model.extra'");
    /* nothing changed: still no files, so finalize says so */
    CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_FAILED_PRECONDITION, "no init callback");
    strata_engine_destroy(e);
  }
  /* ... there by the registration, with the shards named. */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    snprintf(dir, sizeof dir, "%s/bf16_sharded", root);
    snprintf(index, sizeof index, "%s/bf16_sharded/model.safetensors.index.json", root);
    CHECK_OK(strata_init_from_safetensors(e, dir, ""));
    CHECK_STATUS(strata_param_register(e, &extra, NULL, NULL), STRATA_STATUS_NOT_FOUND, "no tensor 'model.extra'");
    CHECK_MESSAGE(index);
    CHECK_MESSAGE("model-00001-of-");
    register_model(e, "model.", NULL, NULL, NULL, NULL);
    CHECK_STATUS(strata_init_from_safetensors(e, dir, ""), STRATA_STATUS_FAILED_PRECONDITION, "already");
    CHECK_OK(strata_engine_finalize(e)); /* the refused registration left nothing behind */
    CHECK_STATUS(strata_init_from_safetensors(e, dir, ""), STRATA_STATUS_FAILED_PRECONDITION, "after finalize");
    strata_engine_destroy(e);
  }
  snprintf(dir, sizeof dir, "%s/f32", root);
  /* A shape mismatch: the tensor, its file and both shapes. */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    register_model(e, "model.", NULL, NULL, "v", NULL);
    CHECK_STATUS(strata_init_from_safetensors(e, dir, NULL), STRATA_STATUS_INVALID_ARGUMENT, "tensor 'model.v'");
    CHECK_MESSAGE(file);
    CHECK_MESSAGE("[16, 8]");
    CHECK_MESSAGE("[8, 16]");
    strata_engine_destroy(e);
  }
  /* An extra tensor: finalize names it and its file, before allocating. */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    register_model(e, "model.", NULL, "v", NULL, NULL);
    CHECK_OK(strata_init_from_safetensors(e, dir, NULL));
    CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_INVALID_ARGUMENT, "extra tensor 'model.v'");
    CHECK_MESSAGE(file);
    strata_engine_destroy(e);
  }
  /* A prefix that does not match makes every tensor extra... and the
   * parameters' tensors missing, which registration reports first. */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    register_model(e, "", NULL, NULL, NULL, NULL);
    CHECK_STATUS(strata_init_from_safetensors(e, dir, "layers."), STRATA_STATUS_NOT_FOUND, "'layers.w'");
    strata_engine_destroy(e);
  }
  /* Bad paths and arguments. */
  e = create("{\"device\": \"cpu\"}", "psync");
  if (e != NULL) {
    CHECK_STATUS(strata_init_from_safetensors(NULL, dir, NULL), STRATA_STATUS_INVALID_ARGUMENT, "engine");
    CHECK_STATUS(strata_init_from_safetensors(e, NULL, NULL), STRATA_STATUS_INVALID_ARGUMENT, "path");
    CHECK_STATUS(strata_init_from_safetensors(e, "/nonexistent/strata/model", NULL), STRATA_STATUS_NOT_FOUND,
                 "/nonexistent/strata/model");
    CHECK_STATUS(strata_init_from_safetensors(e, root, NULL), STRATA_STATUS_NOT_FOUND, "model.safetensors");
    /* An index that is not one, and one naming a shard that is not there. */
    char bad[1100];
    snprintf(bad, sizeof bad, "%s/bad", root);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", bad);
    CHECK(system(cmd) == 0);
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", bad);
    FILE* f = fopen(index, "w");
    if (f != NULL) {
      fputs("{\"metadata\": {}}", f);
      fclose(f);
    }
    CHECK_STATUS(strata_init_from_safetensors(e, bad, NULL), STRATA_STATUS_DATA_LOSS, "weight_map");
    f = fopen(index, "w");
    if (f != NULL) {
      fputs("{\"weight_map\": {\"model.w\": \"model-00001-of-00002.safetensors\"}}", f);
      fclose(f);
    }
    CHECK_STATUS(strata_init_from_safetensors(e, bad, NULL), STRATA_STATUS_NOT_FOUND,
                 "model-00001-of-00002.safetensors");
    strata_engine_destroy(e);
  }
}

int main(void) {
  const char* tmp = getenv("TMPDIR");
  char root[1024];
  snprintf(root, sizeof root, "%s/strata_c_init_XXXXXX", tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
  if (mkdtemp(root) == NULL) {
    fprintf(stderr, "mkdtemp(%s) failed\n", root);
    return 1;
  }
  static struct trained t;
  train_and_export(root, &t);
  if (failures == 0) {
    loads_what_was_exported(root, &t);
    names_each_error(root);
  }
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
  if (failures == 0) printf("c_api_safetensors_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
