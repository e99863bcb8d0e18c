/* The C API from C11: version, status names, the thread's last error,
 * configuration checks, and training a tiny linear model through the engine on
 * the host device (as a framework computing on the CPU would), with the
 * optimizer state in pinned memory and on nvme: bit-identical results, wrong
 * call orders refused. Exits 0 when every check holds; prints each failure. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

#include "c_api_check.h"

/* --- a tiny linear model: y = W x + b, W in group "weight", b in "bias" ---- */

enum { kIn = 32, kOut = 8, kBatch = 16, kSteps = 10 };

/* splitmix64: the same stream on every platform. */
static uint64_t next_u64(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static float uniform(uint64_t* s) { /* [-1, 1) */
  return (float)(next_u64(s) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f32_to_bf16(float f) { /* round to nearest even; the test's values are finite */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The init callback's state. */
struct init_log {
  int calls;
  int bad_name;
};

static strata_status init_param(const char* name, float* out, int64_t numel, void* user_data) {
  struct init_log* log = (struct init_log*)user_data;
  ++log->calls;
  uint64_t seed = strcmp(name, "w") == 0 ? 11 : 13;
  if ((strcmp(name, "w") == 0 && numel != kOut * kIn) || (strcmp(name, "b") == 0 && numel != kOut)) ++log->bad_name;
  for (int64_t i = 0; i < numel; ++i) out[i] = 0.1f * uniform(&seed);
  return STRATA_STATUS_OK;
}

static strata_status init_fails(const char* name, float* out, int64_t numel, void* user_data) {
  (void)name;
  (void)out;
  (void)numel;
  (void)user_data;
  return STRATA_STATUS_IO_ERROR;
}

/* An init callback that calls into its engine (user_data): a call that acts
 * (a fetch, setting the lr) is refused while finalize runs, never a deadlock;
 * the four reads of the fixed layout and of the scale answer. Records what it
 * got. */
struct reentry {
  strata_engine* engine;
  strata_status got;
  char message[256];
  strata_status lr_set;
  strata_status reads[4]; /* info_get, param_offset, loss_scale, stats */
  strata_group_info info;
  int64_t offset;
  double scale;
  strata_step_stats stats;
};
static strata_status init_reenters(const char* name, float* out, int64_t numel, void* user_data) {
  (void)name;
  struct reentry* r = (struct reentry*)user_data;
  for (int64_t i = 0; i < numel; ++i) out[i] = 0.0f;
  strata_group_view v = STRATA_GROUP_VIEW_INIT;
  r->got = strata_group_fetch(r->engine, "p", NULL, &v);
  snprintf(r->message, sizeof r->message, "%s", strata_last_error());
  r->lr_set = strata_lr_set(r->engine, 0.5);
  r->info.struct_size = sizeof r->info;
  r->reads[0] = strata_group_info_get(r->engine, "p", &r->info);
  r->reads[1] = strata_param_offset(r->engine, "p", &r->offset, NULL);
  r->reads[2] = strata_loss_scale(r->engine, &r->scale);
  r->stats.struct_size = sizeof r->stats;
  r->stats.step = -7;
  r->reads[3] = strata_stats(r->engine, &r->stats);
  return STRATA_STATUS_OK;
}

/* One batch of the teacher-student task: t = W* x + b*. */
static void make_batch(int step, float* x, float* t) {
  uint64_t teacher = 4242;
  float wt[kOut * kIn], bt[kOut];
  for (int k = 0; k < kOut * kIn; ++k) wt[k] = 0.5f * uniform(&teacher);
  for (int o = 0; o < kOut; ++o) bt[o] = 0.5f * uniform(&teacher);
  uint64_t s = 1000u + (uint64_t)step;
  for (int k = 0; k < kBatch * kIn; ++k) x[k] = uniform(&s);
  for (int b = 0; b < kBatch; ++b) {
    for (int o = 0; o < kOut; ++o) {
      float acc = bt[o];
      for (int i = 0; i < kIn; ++i) acc += wt[o * kIn + i] * x[b * kIn + i];
      t[b * kOut + o] = acc;
    }
  }
}

struct run_result {
  int ok;
  double loss[kSteps];
  float w[kOut * kIn], b[kOut];
  strata_step_stats last;
};

static const char* const kBase =
    "{\"train_batch_size\": 16, \"bf16\": {\"enabled\": true}, \"gradient_clipping\": 1.0,"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05, \"weight_decay\": 0.01}},"
    " \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": %s},"
    " \"strata\": {\"device\": \"host\", \"io\": {\"backend\": \"psync\"}, \"cpu_adam\": {\"threads\": 1}}}";

/* Registers the model; returns the engine, or NULL after reporting. */
static strata_engine* build(const char* config, struct init_log* log) {
  strata_engine* e = NULL;
  CHECK_OK(strata_engine_create(config, &e));
  if (e == NULL) return NULL;
  strata_optimizer_group_desc og = STRATA_OPTIMIZER_GROUP_DESC_INIT;
  og.name = "no_decay";
  int32_t no_decay = -1;
  CHECK_OK(strata_optimizer_group_add(e, &og, &no_decay));
  CHECK(no_decay == 1);

  const int64_t wshape[2] = {kOut, kIn}, bshape[1] = {kOut};
  strata_param_desc w = STRATA_PARAM_DESC_INIT;
  w.name = "w";
  w.shape = wshape;
  w.ndim = 2;
  w.group = "weight";
  CHECK_OK(strata_param_register(e, &w, init_param, log));
  strata_param_desc b = STRATA_PARAM_DESC_INIT;
  b.name = "b";
  b.shape = bshape;
  b.ndim = 1;
  b.group = "bias";
  b.optimizer_group = no_decay;
  CHECK_OK(strata_param_register(e, &b, init_param, log));
  return e;
}

/* Trains kSteps steps as a CPU framework would; with ckpt_root, saves a
 * checkpoint at the end (before destroying the engine). */
/* An engine that loaded the checkpoint train() saved: its blob, and the
 * masters of the run that saved it (`saved`). */
static void check_loaded(strata_engine* e, const struct run_result* saved) {
  const void* blob = NULL;
  size_t blob_size = 0;
  CHECK_OK(strata_checkpoint_blob(e, &blob, &blob_size));
  CHECK(blob_size == sizeof "data loader at epoch 3" && memcmp(blob, "data loader at epoch 3", blob_size) == 0);
  float w[kOut * kIn], b[kOut];
  CHECK_OK(strata_param_read_master(e, "w", w, kOut * kIn));
  CHECK_OK(strata_param_read_master(e, "b", b, kOut));
  CHECK(memcmp(w, saved->w, sizeof w) == 0);
  CHECK(memcmp(b, saved->b, sizeof b) == 0);
}

static void train(const char* config, int on_nvme, struct run_result* r, const char* ckpt_root) {
  memset(r, 0, sizeof *r);
  struct init_log log = {0, 0};
  strata_engine* e = build(config, &log);
  if (e == NULL) return;

  /* Before finalize: no views, no steps. */
  uint16_t scratch[4];
  strata_group_view view = STRATA_GROUP_VIEW_INIT;
  CHECK_STATUS(strata_group_fetch_host(e, "weight", scratch, sizeof scratch), STRATA_STATUS_FAILED_PRECONDITION,
               "before finalize");
  CHECK_STATUS(strata_group_fetch(e, "weight", NULL, &view), STRATA_STATUS_FAILED_PRECONDITION, "before finalize");
  CHECK_STATUS(strata_step_end(e, NULL), STRATA_STATUS_FAILED_PRECONDITION, "before finalize");
  int64_t off = -1;
  CHECK_STATUS(strata_param_offset(e, "w", &off, NULL), STRATA_STATUS_FAILED_PRECONDITION, "before finalize");
  CHECK(log.calls == 0);
  /* No swap paths before finalize. */
  uint32_t swap_paths = 99;
  strata_swap_stats swap = STRATA_SWAP_STATS_INIT;
  CHECK_OK(strata_swap_path_count(e, &swap_paths));
  CHECK(swap_paths == 0);
  CHECK_STATUS(strata_swap_stats_get(e, 0, &swap), STRATA_STATUS_OUT_OF_RANGE, "0 swap path(s)");
  /* No CPU optimizer threads before finalize. */
  strata_step_stats early = STRATA_STEP_STATS_INIT;
  CHECK_OK(strata_stats(e, &early));
  CHECK(early.cpu_adam_binding == NULL && early.cpu_adam_threads == 0 && early.cpu_adam_pinned == 0);

  CHECK_OK(strata_engine_finalize(e));
  CHECK(log.calls == 2 && log.bad_name == 0);
  /* Where the CPU optimizer's threads run, from finalize on: the config asks
   * for one thread, which runs on the calling thread and is never pinned. */
  strata_step_stats threads = STRATA_STEP_STATS_INIT;
  CHECK_OK(strata_stats(e, &threads));
  CHECK(threads.step == 0 && threads.cpu_adam_threads == 1 && threads.cpu_adam_pinned == 0);
  CHECK(threads.cpu_adam_numa_node >= -1);
  /* One rank, no strata.cpu_adam.numa_node: the pinned memory is not placed. */
  CHECK(threads.pinned_memory_numa_node == -1);
  CHECK(threads.cpu_adam_binding != NULL && strstr(threads.cpu_adam_binding, "1 thread, not pinned") != NULL);
  /* One swap path with the optimizer state on nvme, written already (zeroed
   * moments, initial masters); none without. */
  CHECK_OK(strata_swap_path_count(e, &swap_paths));
  CHECK(swap_paths == (on_nvme ? 1u : 0u));
  CHECK_STATUS(strata_swap_path_count(e, NULL), STRATA_STATUS_INVALID_ARGUMENT, "count_out");
  CHECK_STATUS(strata_swap_stats_get(e, swap_paths, &swap), STRATA_STATUS_OUT_OF_RANGE, "index");
  if (on_nvme) {
    CHECK_OK(strata_swap_stats_get(e, 0, &swap));
    CHECK(swap.path != NULL && strstr(swap.path, "strata_c_api") != NULL);
    CHECK(swap.bytes_written == 0 && swap.bytes_read == 0 && swap.bytes_written_total > 0);
  }
  CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_FAILED_PRECONDITION, "twice");
  strata_param_desc late = STRATA_PARAM_DESC_INIT;
  late.name = "late";
  CHECK_STATUS(strata_param_register(e, &late, init_param, &log), STRATA_STATUS_FAILED_PRECONDITION,
               "after finalize");

  /* The layout. */
  strata_group_info wi = STRATA_GROUP_INFO_INIT, bi = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "weight", &wi));
  CHECK_OK(strata_group_info_get(e, "bias", &bi));
  CHECK(wi.dtype == STRATA_DTYPE_BF16 && wi.device == STRATA_DEVICE_HOST && wi.param_count == 1 && wi.trainable);
  CHECK(wi.device_index == 0);
  CHECK(wi.size_bytes >= 2u * kOut * kIn && bi.size_bytes >= 2u * kOut);
  CHECK_STATUS(strata_group_info_get(e, "nope", &wi), STRATA_STATUS_NOT_FOUND, "nope");
  int64_t w_off = -1, b_off = -1;
  const char* group = NULL;
  CHECK_OK(strata_param_offset(e, "w", &w_off, &group));
  CHECK(group != NULL && strcmp(group, "weight") == 0);
  CHECK_OK(strata_param_offset(e, "b", &b_off, NULL));
  CHECK(w_off >= 0 && b_off >= 0);
  CHECK_STATUS(strata_param_offset(e, "nope", &off, NULL), STRATA_STATUS_NOT_FOUND, "nope");
  if (wi.size_bytes < 2u * kOut * kIn || bi.size_bytes < 2u * kOut || w_off < 0 || b_off < 0) {
    strata_engine_destroy(e);
    return;
  }

  /* A device view: on the host device it is not ours to touch, only to size. */
  CHECK_OK(strata_group_fetch(e, "weight", NULL, &view));
  CHECK(view.data != NULL && view.size_bytes == wi.size_bytes && view.dtype == STRATA_DTYPE_BF16 &&
        view.device == STRATA_DEVICE_HOST);
  CHECK_OK(strata_group_wait(e, "weight"));
  CHECK_STATUS(strata_group_fetch(e, "weight", NULL, &view), STRATA_STATUS_FAILED_PRECONDITION, "already fetched");
  CHECK_OK(strata_group_release(e, "weight"));
  CHECK_STATUS(strata_group_wait(e, "weight"), STRATA_STATUS_FAILED_PRECONDITION, "not fetched");
  int not_a_stream = 0;
  CHECK_STATUS(strata_group_fetch(e, "bias", &not_a_stream, &view), STRATA_STATUS_INVALID_ARGUMENT, "stream");
  /* release_on: a stream is refused on the host device (the group stays fetched); NULL releases. */
  CHECK_OK(strata_group_fetch(e, "weight", NULL, &view));
  CHECK_STATUS(strata_group_release_on(e, "weight", &not_a_stream), STRATA_STATUS_INVALID_ARGUMENT, "stream");
  CHECK_OK(strata_group_release_on(e, "weight", NULL));
  CHECK_STATUS(strata_group_release_on(e, "weight", NULL), STRATA_STATUS_FAILED_PRECONDITION, "not fetched");

  uint16_t* wbuf = malloc(wi.size_bytes);
  uint16_t* bbuf = malloc(bi.size_bytes);
  uint16_t* wgrad = malloc(wi.size_bytes);
  uint16_t* bgrad = malloc(bi.size_bytes);
  float x[kBatch * kIn], t[kBatch * kOut], y[kBatch * kOut], gw[kOut * kIn], gb[kOut];
  if (wbuf == NULL || bbuf == NULL || wgrad == NULL || bgrad == NULL) abort();

  /* Wrong sizes and arguments change nothing. */
  CHECK_STATUS(strata_group_fetch_host(e, "weight", wbuf, wi.size_bytes - 2), STRATA_STATUS_INVALID_ARGUMENT,
               "bytes");
  CHECK_STATUS(strata_group_fetch_host(e, NULL, wbuf, wi.size_bytes), STRATA_STATUS_INVALID_ARGUMENT, "group");
  CHECK_STATUS(strata_group_fetch_host(e, "weight", NULL, wi.size_bytes), STRATA_STATUS_INVALID_ARGUMENT,
               "host_dst");
  CHECK_STATUS(strata_group_fetch_host(e, "nope", wbuf, wi.size_bytes), STRATA_STATUS_NOT_FOUND, "nope");
  CHECK_STATUS(strata_group_release(e, "bias"), STRATA_STATUS_FAILED_PRECONDITION, "not fetched");

  for (int step = 0; step < kSteps; ++step) {
    double scale = 0.0;
    CHECK_OK(strata_loss_scale(e, &scale));
    CHECK(scale == 1.0); /* bf16: no loss scaling */
    make_batch(step, x, t);

    /* Forward. */
    CHECK_OK(strata_group_fetch_host(e, "weight", wbuf, wi.size_bytes));
    CHECK_OK(strata_group_release(e, "weight"));
    CHECK_OK(strata_group_fetch_host(e, "bias", bbuf, bi.size_bytes));
    CHECK_OK(strata_group_release(e, "bias"));
    double loss = 0.0;
    for (int b = 0; b < kBatch; ++b) {
      for (int o = 0; o < kOut; ++o) {
        float acc = bf16_to_f32(bbuf[b_off + o]);
        for (int i = 0; i < kIn; ++i) acc += bf16_to_f32(wbuf[w_off + o * kIn + i]) * x[b * kIn + i];
        y[b * kOut + o] = acc;
        const double d = (double)acc - (double)t[b * kOut + o];
        loss += 0.5 * d * d;
      }
    }
    r->loss[step] = loss / kBatch;

    /* Backward: gradients of loss * scale, in the groups' layouts. */
    memset(gw, 0, sizeof gw);
    memset(gb, 0, sizeof gb);
    for (int b = 0; b < kBatch; ++b) {
      for (int o = 0; o < kOut; ++o) {
        const float d = (y[b * kOut + o] - t[b * kOut + o]) * (float)scale / kBatch;
        gb[o] += d;
        for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += d * x[b * kIn + i];
      }
    }
    memset(wgrad, 0, wi.size_bytes);
    memset(bgrad, 0, bi.size_bytes);
    for (int k = 0; k < kOut * kIn; ++k) wgrad[w_off + k] = f32_to_bf16(gw[k]);
    for (int o = 0; o < kOut; ++o) bgrad[b_off + o] = f32_to_bf16(gb[o]);

    CHECK_OK(strata_group_fetch_host(e, "weight", wbuf, wi.size_bytes));
    CHECK_OK(strata_group_grads_host(e, "weight", wgrad, wi.size_bytes));
    CHECK_OK(strata_group_release(e, "weight"));
    if (step == 0) {
      /* The bias's gradients are missing: no step, and the message names it. */
      CHECK_STATUS(strata_step_end(e, NULL), STRATA_STATUS_FAILED_PRECONDITION, "'bias' has no gradients");
      CHECK_STATUS(strata_micro_step_end(e), STRATA_STATUS_FAILED_PRECONDITION, "'bias'");
      CHECK_STATUS(strata_group_grads_host(e, "weight", wgrad, wi.size_bytes), STRATA_STATUS_FAILED_PRECONDITION,
                   "arrived already");
      CHECK_STATUS(strata_group_grads_host(e, "bias", bgrad, bi.size_bytes + 2), STRATA_STATUS_INVALID_ARGUMENT,
                   "bytes");
    }
    CHECK_OK(strata_group_fetch_host(e, "bias", bbuf, bi.size_bytes));
    CHECK_OK(strata_group_grads_host(e, "bias", bgrad, bi.size_bytes));
    if (step == 0) {
      /* The optimizer rewrites compute copies: no group may still be fetched. */
      CHECK_STATUS(strata_step_end(e, NULL), STRATA_STATUS_FAILED_PRECONDITION, "'bias' is still fetched");
    }
    CHECK_OK(strata_group_release(e, "bias"));

    strata_step_stats st = STRATA_STEP_STATS_INIT;
    CHECK_OK(strata_step_end(e, &st));
    CHECK(st.struct_size == sizeof st);
    CHECK(st.step == step + 1 && st.skipped == 0 && st.skipped_total == 0 && st.norm_step == step + 1);
    CHECK(st.grad_norm > 0.0 && isfinite(st.grad_norm));
    CHECK(st.lr == 0.05 && st.loss_scale == 1.0);
    /* Compute copies live on the device: gradients come down, the optimizer
     * puts the new copies back (it rewrites every one: the old ones are not
     * taken down). The optimizer runs behind step_end (overlap "exact"), so
     * its traffic shows in the next step's statistics: the first step has the
     * gradients only. */
    CHECK(st.bytes_d2h == wi.size_bytes + bi.size_bytes);
    if (step == 0) {
      CHECK(st.bytes_h2d == 0 && st.bytes_nvme_read == 0 && st.bytes_nvme_write == 0);
    } else {
      CHECK(st.bytes_h2d == wi.size_bytes + bi.size_bytes);
      if (on_nvme) {
        CHECK(st.bytes_nvme_read > 0 && st.bytes_nvme_read == st.bytes_nvme_write);
      } else {
        CHECK(st.bytes_nvme_read == 0 && st.bytes_nvme_write == 0);
      }
    }
    /* The one swap path took all of the step's swap traffic; its totals,
     * taken now, hold at least what step_end saw (the job behind step_end
     * adds to them). */
    if (on_nvme) {
      CHECK_OK(strata_swap_stats_get(e, 0, &swap));
      CHECK(swap.bytes_written == st.bytes_nvme_write && swap.bytes_read == st.bytes_nvme_read);
      CHECK(st.bytes_nvme_write_total > 0 && swap.bytes_written_total >= st.bytes_nvme_write_total);
      CHECK(swap.bytes_read_total >= st.bytes_nvme_read_total);
    } else {
      CHECK(st.bytes_nvme_write_total == 0 && st.bytes_nvme_read_total == 0);
    }
    r->last = st;
  }
  CHECK(r->loss[kSteps - 1] < 0.5 * r->loss[0]);

  CHECK_OK(strata_param_read_master(e, "w", r->w, kOut * kIn));
  CHECK_OK(strata_param_read_master(e, "b", r->b, kOut));
  CHECK_STATUS(strata_param_read_master(e, "b", r->w, kOut + 1), STRATA_STATUS_INVALID_ARGUMENT, "9");
  CHECK_STATUS(strata_lr_set(e, -1.0), STRATA_STATUS_INVALID_ARGUMENT, "-1");
  strata_step_stats again = STRATA_STEP_STATS_INIT;
  CHECK_OK(strata_stats(e, &again));
  CHECK(again.step == kSteps && again.bytes_d2h == r->last.bytes_d2h && again.grad_norm == r->last.grad_norm);
  CHECK(again.bytes_nvme_write_total == r->last.bytes_nvme_write_total);
  CHECK(again.cpu_adam_binding == threads.cpu_adam_binding && r->last.cpu_adam_binding == threads.cpu_adam_binding);
  CHECK(r->last.cpu_adam_threads == 1 && r->last.cpu_adam_numa_node == threads.cpu_adam_numa_node);
  /* A caller built against 0.3 (no totals) gets the fields it has, and nothing past them. */
  strata_step_stats old = STRATA_STEP_STATS_INIT;
  old.struct_size = (uint32_t)offsetof(strata_step_stats, bytes_nvme_read_total);
  old.bytes_nvme_read_total = 7;
  old.bytes_nvme_write_total = 7;
  CHECK_OK(strata_stats(e, &old));
  CHECK(old.step == kSteps && old.norm_step == r->last.norm_step);
  CHECK(old.bytes_nvme_read_total == 7 && old.bytes_nvme_write_total == 7);
  /* Nor, built before the CPU threads' fields, does it see those. */
  strata_step_stats before_threads = STRATA_STEP_STATS_INIT;
  before_threads.struct_size = (uint32_t)offsetof(strata_step_stats, cpu_adam_binding);
  before_threads.cpu_adam_threads = 7;
  CHECK_OK(strata_stats(e, &before_threads));
  CHECK(before_threads.cpu_adam_binding == NULL && before_threads.cpu_adam_threads == 7);
  CHECK(before_threads.bytes_nvme_write_total == r->last.bytes_nvme_write_total);
  if (ckpt_root != NULL) {
    static const char kBlob[] = "data loader at epoch 3";
    CHECK_STATUS(strata_checkpoint_save(e, ckpt_root, NULL, 5), STRATA_STATUS_INVALID_ARGUMENT, "blob");
    CHECK_OK(strata_checkpoint_save(e, ckpt_root, kBlob, sizeof kBlob));
  }
  CHECK_OK(strata_lr_set(e, 0.01));
  free(wbuf);
  free(bbuf);
  free(wgrad);
  free(bgrad);
  strata_engine_destroy(e);
  r->ok = failures == 0;
}

static void engine_checks(void) {
  /* NULL and unversioned arguments name what is wrong. */
  strata_engine* e = NULL;
  CHECK_STATUS(strata_engine_create("{\"train_batch_size\": 4}", NULL), STRATA_STATUS_INVALID_ARGUMENT, "out");
  CHECK_STATUS(strata_engine_create(NULL, &e), STRATA_STATUS_INVALID_ARGUMENT, "config_json");
  CHECK(e == NULL);
  CHECK_STATUS(strata_engine_finalize(NULL), STRATA_STATUS_INVALID_ARGUMENT, "engine");
  strata_engine_destroy(NULL);

  char config[2048];
  snprintf(config, sizeof config, kBase, "{\"device\": \"cpu\"}");
  CHECK_OK(strata_engine_create(config, &e));
  if (e != NULL) {
    strata_param_desc d = STRATA_PARAM_DESC_INIT;
    d.struct_size = 0;
    d.name = "p";
    CHECK_STATUS(strata_param_register(e, &d, init_param, NULL), STRATA_STATUS_INVALID_ARGUMENT, "struct_size");
    d.struct_size = sizeof d;
    d.ndim = 1;
    CHECK_STATUS(strata_param_register(e, &d, init_param, NULL), STRATA_STATUS_INVALID_ARGUMENT, "shape");
    /* An init callback's failure is finalize's, naming the parameter. */
    const int64_t shape[1] = {4};
    d.shape = shape;
    CHECK_OK(strata_param_register(e, &d, init_fails, NULL));
    CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_IO_ERROR, "'p'");
    strata_engine_destroy(e);
  }
  /* An init callback calling its engine gets FAILED_PRECONDITION. */
  CHECK_OK(strata_engine_create(config, &e));
  if (e != NULL) {
    struct reentry r;
    memset(&r, 0, sizeof r);
    r.engine = e;
    r.offset = -1;
    const int64_t shape[1] = {4};
    strata_param_desc d = STRATA_PARAM_DESC_INIT;
    d.name = "p";
    d.shape = shape;
    d.ndim = 1;
    CHECK_OK(strata_param_register(e, &d, init_reenters, &r));
    CHECK_OK(strata_engine_finalize(e));
    CHECK(r.got == STRATA_STATUS_FAILED_PRECONDITION);
    CHECK(strstr(r.message, "while finalize runs") != NULL);
    CHECK(r.lr_set == STRATA_STATUS_FAILED_PRECONDITION);
    /* The reads answer from the callback, as they do after finalize. */
    for (int i = 0; i < 4; ++i) CHECK(r.reads[i] == STRATA_STATUS_OK);
    strata_group_info after = STRATA_GROUP_INFO_INIT;
    CHECK_OK(strata_group_info_get(e, "p", &after));
    CHECK(r.info.size_bytes == after.size_bytes && r.info.param_count == 1 && r.info.trainable == 1);
    CHECK(r.offset == 0);
    CHECK(r.scale == 1.0);
    CHECK(r.stats.step == 0);
    strata_engine_destroy(e);
  }

  /* Optimizer state in pinned memory, then on nvme: the same bits. */
  static struct run_result pinned, nvme;
  const char* tmp = getenv("TMPDIR");
  char ckpt[1024];
  snprintf(ckpt, sizeof ckpt, "%s/strata_c_ckpt_XXXXXX", tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
  if (mkdtemp(ckpt) == NULL) {
    fprintf(stderr, "mkdtemp(%s) failed\n", ckpt);
    ++failures;
    return;
  }
  train(config, 0, &pinned, ckpt);

  char dir[1024];
  snprintf(dir, sizeof dir, "%s/strata_c_api_XXXXXX", tmp != NULL && tmp[0] != '\0' ? tmp : "/tmp");
  if (mkdtemp(dir) == NULL) {
    fprintf(stderr, "mkdtemp(%s) failed\n", dir);
    ++failures;
    return;
  }
  char offload[1200];
  snprintf(offload, sizeof offload, "{\"device\": \"nvme\", \"nvme_path\": \"%s\"}", dir);
  snprintf(config, sizeof config, kBase, offload);
  train(config, 1, &nvme, NULL);

  /* The pinned run's checkpoint, loaded into a fresh engine with the optimizer
   * state on nvme: the same masters and the framework's blob back. */
  {
    struct init_log log = {0, 0};
    strata_engine* e = build(config, &log);
    if (e != NULL) {
      CHECK_OK(strata_engine_finalize(e));
      const void* blob = NULL;
      size_t blob_size = 0;
      CHECK_STATUS(strata_checkpoint_blob(e, &blob, &blob_size), STRATA_STATUS_FAILED_PRECONDITION, "no checkpoint");
      CHECK_STATUS(strata_checkpoint_load(e, "/nonexistent/strata"), STRATA_STATUS_NOT_FOUND, "no checkpoint");
      CHECK_OK(strata_checkpoint_load(e, ckpt));
      check_loaded(e, &pinned);
      char exported[1100];
      snprintf(exported, sizeof exported, "%s/export", ckpt);
      CHECK_OK(strata_export_safetensors(e, exported, STRATA_DTYPE_BF16, 0));
      CHECK_STATUS(strata_export_safetensors(e, exported, (strata_dtype)7, 0), STRATA_STATUS_INVALID_ARGUMENT, "7");
      strata_engine_destroy(e);
    }
  }
  /* The same through strata_engine_finalize_from_checkpoint: no init callback
   * runs, the same masters and blob. No checkpoint at the root: a failed
   * finalize, nothing built. */
  {
    struct init_log log = {0, 0};
    strata_engine* e = build(config, &log);
    if (e != NULL) {
      CHECK_STATUS(strata_engine_finalize_from_checkpoint(e, "/nonexistent/strata"), STRATA_STATUS_NOT_FOUND,
                   "/nonexistent/strata");
      CHECK_STATUS(strata_engine_finalize(e), STRATA_STATUS_FAILED_PRECONDITION, "failed finalize");
      strata_engine_destroy(e);
    }
    e = build(config, &log);
    if (e != NULL) {
      CHECK_STATUS(strata_engine_finalize_from_checkpoint(e, NULL), STRATA_STATUS_INVALID_ARGUMENT, "root");
      CHECK_OK(strata_engine_finalize_from_checkpoint(e, ckpt));
      CHECK(log.calls == 0);
      check_loaded(e, &pinned);
      CHECK_STATUS(strata_engine_finalize_from_checkpoint(e, ckpt), STRATA_STATUS_FAILED_PRECONDITION, "after finalize");
      strata_engine_destroy(e);
    }
  }
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", ckpt);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", ckpt);
  /* The swap files and the directory's lock file go with the engine. */
  if (rmdir(dir) != 0) {
    fprintf(stderr, "%s: swap or lock files left after the engine was destroyed\n", dir);
    ++failures;
  }

  if (pinned.ok && nvme.ok) {
    CHECK(memcmp(pinned.loss, nvme.loss, sizeof pinned.loss) == 0);
    CHECK(memcmp(pinned.w, nvme.w, sizeof pinned.w) == 0);
    CHECK(memcmp(pinned.b, nvme.b, sizeof pinned.b) == 0);
    CHECK(pinned.last.grad_norm == nvme.last.grad_norm);
    printf("c_api_test: loss %.6f -> %.6f over %d steps, pinned and nvme bit-identical\n", pinned.loss[0],
           pinned.loss[kSteps - 1], kSteps);
  }
}

/* strata_config_options (0.3): the program passes the run's step count for
 * "auto", strict parsing and the hidden size; NULL and the INIT are the
 * defaults, an older caller's smaller struct_size leaves the rest unset. */
static void options_checks(void) {
  const char* decay =
      "{\"train_batch_size\": 4, \"strata\": {\"device\": \"host\"},"
      " \"scheduler\": {\"type\": \"WarmupDecayLR\","
      " \"params\": {\"warmup_num_steps\": 10, \"total_num_steps\": \"auto\"}}}";
  strata_engine* e = NULL;
  CHECK_STATUS(strata_engine_create(decay, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "scheduler.params.total_num_steps: \"auto\" cannot be resolved");
  CHECK_STATUS(strata_engine_create_ex(decay, NULL, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "strata_config_options.total_num_steps");
  CHECK(e == NULL);
  strata_config_options o = STRATA_CONFIG_OPTIONS_INIT;
  CHECK_STATUS(strata_engine_create_ex(decay, &o, &e), STRATA_STATUS_INVALID_ARGUMENT, "total_num_steps");
  o.total_num_steps = 250;
  CHECK_OK(strata_engine_create_ex(decay, &o, &e));
  CHECK(e != NULL);
  strata_engine_destroy(e);
  e = NULL;
  char* json = NULL;
  CHECK_OK(strata_config_resolve_ex(decay, &o, &json));
  CHECK(json != NULL && strstr(json, "\"total_num_steps\": 250") != NULL);
  if (json != NULL && strstr(json, "\"total_num_steps\": 250") == NULL) fprintf(stderr, "got: %s\n", json);
  strata_string_free(json);
  uint32_t warnings = 99;
  CHECK_OK(strata_config_check_ex(decay, &o, &warnings));
  CHECK(warnings == 0);

  /* Strict: an unknown key is a warning, or an error when the program says so. */
  const char* unknown = "{\"train_batch_size\": 4, \"strata\": {\"device\": \"host\"}, \"no_such_key\": 1}";
  CHECK_OK(strata_config_check_ex(unknown, &o, &warnings));
  CHECK(warnings == 1);
  CHECK_OK(strata_engine_create_ex(unknown, &o, &e));
  strata_engine_destroy(e);
  e = NULL;
  o.strict = 1;
  CHECK_STATUS(strata_config_check_ex(unknown, &o, &warnings), STRATA_STATUS_INVALID_ARGUMENT, "no_such_key");
  CHECK_STATUS(strata_engine_create_ex(unknown, &o, &e), STRATA_STATUS_INVALID_ARGUMENT, "no_such_key");
  CHECK(e == NULL);
  o.strict = 0;

  /* The hidden size resolves the "auto" bucket sizes (h^2). */
  const char* buckets =
      "{\"train_batch_size\": 4, \"zero_optimization\": {\"stage\": 3, \"reduce_bucket_size\": \"auto\"}}";
  o.hidden_size = 64;
  CHECK_OK(strata_config_resolve_ex(buckets, &o, &json));
  CHECK(json != NULL && strstr(json, "\"reduce_bucket_size\": 4096") != NULL);
  strata_string_free(json);

  /* A caller built against a struct that ends after total_num_steps: the
   * hidden size it does not know stays unset (DeepSpeed's default). */
  o.struct_size = (uint32_t)offsetof(strata_config_options, hidden_size);
  CHECK_OK(strata_config_resolve_ex(buckets, &o, &json));
  CHECK(json != NULL && strstr(json, "\"reduce_bucket_size\": 500000000") != NULL);
  strata_string_free(json);

  /* The world size (0.5): train_batch_size counts every rank's micro-batches,
   * as DeepSpeed does: 16 over 2 ranks of 4 is 2 micro-batches a step each. */
  const char* batch = "{\"train_batch_size\": 16, \"train_micro_batch_size_per_gpu\": 4}";
  o.struct_size = sizeof o;
  o.hidden_size = 0;
  o.world_size = 2;
  CHECK_OK(strata_config_resolve_ex(batch, &o, &json));
  CHECK(json != NULL && strstr(json, "\"gradient_accumulation_steps\": 2") != NULL);
  strata_string_free(json);
  o.world_size = 3;
  CHECK_STATUS(strata_config_check_ex(batch, &o, NULL), STRATA_STATUS_INVALID_ARGUMENT,
               "is not a multiple of train_micro_batch_size_per_gpu (4) x the world size (3)");
  o.world_size = -1;
  CHECK_STATUS(strata_config_check_ex(batch, &o, NULL), STRATA_STATUS_INVALID_ARGUMENT, "options->world_size is -1");
  o.world_size = 0;

  /* Bad options name what is wrong; nothing is written. */
  o.struct_size = 0;
  CHECK_STATUS(strata_engine_create_ex(decay, &o, &e), STRATA_STATUS_INVALID_ARGUMENT, "struct_size");
  o.struct_size = sizeof o;
  o.total_num_steps = -1;
  CHECK_STATUS(strata_engine_create_ex(decay, &o, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "options->total_num_steps is -1");
  o.total_num_steps = 0;
  o.hidden_size = -5;
  CHECK_STATUS(strata_config_check_ex(decay, &o, NULL), STRATA_STATUS_INVALID_ARGUMENT,
               "options->hidden_size is -5");
  CHECK(e == NULL);
  CHECK_STATUS(strata_engine_create_ex(decay, NULL, NULL), STRATA_STATUS_INVALID_ARGUMENT, "out");
}

/* A store that holds nothing: every set counted and dropped, every get
 * fails (as a key that no other rank sets within the timeout). */
static int g_store_sets = 0, g_store_gets = 0;
static int forgetting_set(void* user, const char* key, const void* value, size_t len) {
  (void)user, (void)key, (void)value, (void)len;
  ++g_store_sets;
  return 0;
}
static int forgetting_get(void* user, const char* key, void* buf, size_t cap, size_t* len, int64_t timeout_ms) {
  (void)user, (void)key, (void)buf, (void)cap, (void)len, (void)timeout_ms;
  ++g_store_gets;
  return 1;
}

/* One rank of several (0.5): the arguments checked; one rank as self, or
 * from the environment without a launcher (the run has none). Several ranks
 * training together: tests/e2e/ranks_test.cpp, tests/python/test_ranks.py. */
static void ranks_checks(void) {
  const char* cfg =
      "{\"train_batch_size\": 16, \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05}},"
      " \"strata\": {\"device\": \"host\", \"cpu_adam\": {\"threads\": 1}}}";
  strata_engine* e = NULL;
  strata_ranks r = STRATA_RANKS_INIT;
  r.size = 2;
  r.rank = 2;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &r, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->rank is 2 and ranks->size 2");
  r.rank = 1;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &r, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->store_dir is NULL");
  r.timeout_ms = -1;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &r, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->timeout_ms is -1");
  strata_ranks local = STRATA_RANKS_INIT;
  local.size = 1;
  local.local_size = 2;
  local.local_rank = 2;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &local, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->local_rank is 2 and ranks->local_size 2");
  local.local_size = 0;
  local.local_rank = 1;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &local, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->local_rank is 1 and ranks->local_size 0");
  /* A store of the caller's: both callbacks or neither, with rank and size;
   * rank 1 alone in it fails to meet the other within its timeout, named. */
  strata_ranks stored = STRATA_RANKS_INIT;
  stored.size = 2;
  stored.rank = 1;
  stored.store_set = forgetting_set;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &stored, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "one of store_set and store_get");
  stored.store_get = forgetting_get;
  stored.timeout_ms = 300;
  strata_config_options both = STRATA_CONFIG_OPTIONS_INIT;  /* world_size 0: the engine's ranks */
  CHECK_STATUS(strata_engine_create_ranked(cfg, &both, &stored, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "a store and no run_id");
  stored.run_id = "run-1";
  CHECK_STATUS(strata_engine_create_ranked(cfg, &both, &stored, &e), STRATA_STATUS_UNAVAILABLE,
               "could not meet the others through the caller's store");
  CHECK(g_store_sets > 0 && g_store_gets > 0);
  stored.size = 0;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &stored, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "has a store and size 0");
  strata_ranks zero = STRATA_RANKS_INIT;
  zero.struct_size = 0;
  CHECK_STATUS(strata_engine_create_ranked(cfg, NULL, &zero, &e), STRATA_STATUS_INVALID_ARGUMENT,
               "ranks->struct_size is 0");
  CHECK(e == NULL);

  /* One rank, said outright, the second of its machine's two (its GPU would be
   * CUDA device 1). */
  strata_ranks one = STRATA_RANKS_INIT;
  one.size = 1;
  one.local_size = 2;
  one.local_rank = 1;
  CHECK_OK(strata_engine_create_ranked(cfg, NULL, &one, &e));
  int32_t rank = -1, size = -1;
  CHECK_OK(strata_engine_rank(e, &rank, &size));
  CHECK(rank == 0 && size == 1);
  strata_engine_destroy(e);
  e = NULL;
  /* From the environment: no launcher here, so one rank. */
  strata_ranks launcher = STRATA_RANKS_INIT;
  CHECK_OK(strata_engine_create_ranked(cfg, NULL, &launcher, &e));
  rank = size = -1;
  CHECK_OK(strata_engine_rank(e, &rank, NULL));
  CHECK_OK(strata_engine_rank(e, NULL, &size));
  CHECK(rank == 0 && size == 1);
  strata_engine_destroy(e);
  CHECK_STATUS(strata_engine_rank(NULL, &rank, &size), STRATA_STATUS_INVALID_ARGUMENT, "engine");
}

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

  options_checks();
  engine_checks();
  ranks_checks();

  if (failures == 0) printf("c_api_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
