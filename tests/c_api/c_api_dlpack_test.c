/* strata_group_dlpack from C11 on the host device (whose device memory is
 * host memory, exported as kDLCPU): a COMPUTE tensor describes the fetched
 * view; gradients written through a GRADS tensor train bit for bit as
 * strata_group_grads_host; a tensor kept past release, and past
 * strata_engine_destroy, keeps its memory (nobody else gets it) until its
 * deleter runs, on any thread; wrong calls are refused. Exits 0 when every
 * check holds; prints each failure. */
#include <dlpack/dlpack.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

/* The host device poisons its memory under AddressSanitizer while no device
 * work touches it; this test reads and writes that memory as a framework's
 * kernels would, so it unpoisons around each access. */
#if defined(__SANITIZE_ADDRESS__)
#define STRATA_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_TEST_ASAN 1
#endif
#endif
#if defined(STRATA_TEST_ASAN)
#include <sanitizer/asan_interface.h>
#define DEVICE_TOUCH_BEGIN(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#define DEVICE_TOUCH_END(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#else
#define DEVICE_TOUCH_BEGIN(p, n) ((void)(p), (void)(n))
#define DEVICE_TOUCH_END(p, n) ((void)(p), (void)(n))
#endif

#include "c_api_check.h"

/* --- the model: y = A x + B x, A in group "a", B in "b" (same size), and a
 * frozen scale vector s in group "frozen" (unused by the math) ------------ */

enum { kIn = 32, kOut = 8, kBatch = 16, kSteps = 6 };

static uint64_t next_u64(uint64_t* s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static float uniform(uint64_t* s) { return (float)(next_u64(s) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }
static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f32_to_bf16(float f) { /* round to nearest even; finite values */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static strata_status init_param(const char* name, float* out, int64_t numel, void* user_data) {
  (void)user_data;
  uint64_t seed = name[0] == 'A' ? 21 : name[0] == 'B' ? 22 : 23;
  for (int64_t i = 0; i < numel; ++i) out[i] = 0.1f * uniform(&seed);
  return STRATA_STATUS_OK;
}

static void make_batch(int step, float* x, float* t) {
  uint64_t s = 500u + (uint64_t)step;
  for (int k = 0; k < kBatch * kIn; ++k) x[k] = uniform(&s);
  for (int b = 0; b < kBatch; ++b) {
    for (int o = 0; o < kOut; ++o) t[b * kOut + o] = 0.3f * x[b * kIn + o] - 0.2f * x[b * kIn + o + kOut];
  }
}

static const char* const kConfig =
    "{\"train_batch_size\": 16, \"bf16\": {\"enabled\": true}, \"gradient_clipping\": 1.0,"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.02, \"weight_decay\": 0.01}},"
    " \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"cpu\"}%s},"
    " \"strata\": {\"device\": \"host\", \"overlap\": \"%s\", \"cpu_adam\": {\"threads\": 1}}}";

/* compute_home: "device" (compute copies live on the device: the view is
 * their home) or "cpu" (pinned: a fetched copy). */
static strata_engine* build(const char* compute_home, const char* overlap, int finalize) {
  char config[1024];
  snprintf(config, sizeof config, kConfig,
           strcmp(compute_home, "cpu") == 0 ? ", \"offload_param\": {\"device\": \"cpu\"}" : "", overlap);
  strata_engine* e = NULL;
  CHECK_OK(strata_engine_create(config, &e));
  if (e == NULL) return NULL;
  const int64_t wshape[2] = {kOut, kIn}, sshape[1] = {kOut};
  strata_param_desc d = STRATA_PARAM_DESC_INIT;
  d.name = "A";
  d.shape = wshape;
  d.ndim = 2;
  d.group = "a";
  CHECK_OK(strata_param_register(e, &d, init_param, NULL));
  d.name = "B";
  d.group = "b";
  CHECK_OK(strata_param_register(e, &d, init_param, NULL));
  d.name = "s";
  d.shape = sshape;
  d.ndim = 1;
  d.group = "frozen";
  d.frozen = 1;
  CHECK_OK(strata_param_register(e, &d, init_param, NULL));
  if (finalize) CHECK_OK(strata_engine_finalize(e));
  return e;
}

static DLManagedTensor* export_view(strata_engine* e, const char* group, strata_view_kind kind) {
  void* out = NULL;
  CHECK_OK(strata_group_dlpack(e, group, kind, &out));
  return (DLManagedTensor*)out;
}

static void delete_tensor(DLManagedTensor* t) {
  if (t != NULL && t->deleter != NULL) t->deleter(t);
}

static void copy_from_device(void* dst, const DLManagedTensor* t, size_t n) {
  void* p = t->dl_tensor.data;
  DEVICE_TOUCH_BEGIN(p, n);
  memcpy(dst, p, n);
  DEVICE_TOUCH_END(p, n);
}
static void copy_to_device(DLManagedTensor* t, const void* src, size_t n) {
  void* p = t->dl_tensor.data;
  DEVICE_TOUCH_BEGIN(p, n);
  memcpy(p, src, n);
  DEVICE_TOUCH_END(p, n);
}

/* --- a COMPUTE tensor describes the fetched view ------------------------------ */

static void describes_the_view(const char* compute_home) {
  strata_engine* e = build(compute_home, "exact", 1);
  if (e == NULL) return;
  strata_group_info info = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "a", &info));
  uint16_t* host = malloc(info.size_bytes);
  uint16_t* through = malloc(info.size_bytes);
  if (host == NULL || through == NULL) abort();
  CHECK_OK(strata_group_fetch_host(e, "a", host, info.size_bytes));
  CHECK_OK(strata_group_release(e, "a"));

  strata_group_view view = STRATA_GROUP_VIEW_INIT;
  CHECK_OK(strata_group_fetch(e, "a", NULL, &view));
  DLManagedTensor* t = export_view(e, "a", STRATA_VIEW_COMPUTE);
  if (t != NULL) {
    const DLTensor* d = &t->dl_tensor;
    CHECK(d->data == view.data);
    CHECK(d->device.device_type == kDLCPU && d->device.device_id == 0);
    CHECK(d->ndim == 1 && d->shape != NULL && d->shape[0] == (int64_t)(view.size_bytes / 2));
    CHECK(d->strides == NULL || d->strides[0] == 1);
    CHECK(d->byte_offset == 0);
    CHECK(d->dtype.code == kDLBfloat && d->dtype.bits == 16 && d->dtype.lanes == 1);
    CHECK(t->deleter != NULL);
    copy_from_device(through, t, info.size_bytes);
    CHECK(memcmp(host, through, info.size_bytes) == 0);
    /* Two tensors on one view, deleted in either order. */
    DLManagedTensor* again = export_view(e, "a", STRATA_VIEW_COMPUTE);
    CHECK(again != NULL && again != t && again->dl_tensor.data == view.data);
    delete_tensor(t);
    delete_tensor(again);
  }
  CHECK_OK(strata_group_release(e, "a"));

  /* A GRADS tensor is strata_group_grad_buffer's buffer. */
  strata_group_view grads = STRATA_GROUP_VIEW_INIT;
  CHECK_OK(strata_group_grad_buffer(e, "b", &grads));
  t = export_view(e, "b", STRATA_VIEW_GRADS);
  if (t != NULL) {
    CHECK(t->dl_tensor.data == grads.data && t->dl_tensor.shape[0] == (int64_t)(grads.size_bytes / 2));
    CHECK(t->dl_tensor.dtype.code == kDLBfloat && t->dl_tensor.device.device_type == kDLCPU);
    delete_tensor(t);
  }
  free(host);
  free(through);
  strata_engine_destroy(e);
}

/* --- errors --------------------------------------------------------------- */

static void refuses_wrong_calls(void) {
  void* out = (void*)&failures; /* must stay as it is on failure */
  void* const before = out;
  strata_engine* e = build("cpu", "exact", 0);
  if (e == NULL) return;
  CHECK_STATUS(strata_group_dlpack(e, "a", STRATA_VIEW_COMPUTE, &out), STRATA_STATUS_FAILED_PRECONDITION,
               "before finalize");
  CHECK_OK(strata_engine_finalize(e));
  CHECK_STATUS(strata_group_dlpack(NULL, "a", STRATA_VIEW_COMPUTE, &out), STRATA_STATUS_INVALID_ARGUMENT, "engine");
  CHECK_STATUS(strata_group_dlpack(e, NULL, STRATA_VIEW_COMPUTE, &out), STRATA_STATUS_INVALID_ARGUMENT, "group");
  CHECK_STATUS(strata_group_dlpack(e, "a", STRATA_VIEW_COMPUTE, NULL), STRATA_STATUS_INVALID_ARGUMENT,
               "managed_out");
  CHECK_STATUS(strata_group_dlpack(e, "a", (strata_view_kind)7, &out), STRATA_STATUS_INVALID_ARGUMENT, "kind 7");
  CHECK_STATUS(strata_group_dlpack(e, "nope", STRATA_VIEW_COMPUTE, &out), STRATA_STATUS_NOT_FOUND, "nope");
  /* COMPUTE needs the group fetched, and says which. */
  CHECK_STATUS(strata_group_dlpack(e, "a", STRATA_VIEW_COMPUTE, &out), STRATA_STATUS_FAILED_PRECONDITION,
               "'a'");
  CHECK(strstr(strata_last_error(), "not fetched") != NULL);
  /* GRADS: strata_group_grad_buffer's preconditions. */
  CHECK_STATUS(strata_group_dlpack(e, "frozen", STRATA_VIEW_GRADS, &out), STRATA_STATUS_FAILED_PRECONDITION,
               "no trainable parameters");
  strata_group_info info = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "a", &info));
  uint16_t* zeros = calloc(1, info.size_bytes);
  if (zeros == NULL) abort();
  CHECK_OK(strata_group_grads_host(e, "a", zeros, info.size_bytes));
  CHECK_STATUS(strata_group_dlpack(e, "a", STRATA_VIEW_GRADS, &out), STRATA_STATUS_FAILED_PRECONDITION,
               "arrived already");
  CHECK(out == before);
  free(zeros);
  strata_engine_destroy(e);
}

/* --- lifetime: the memory is nobody else's while a tensor lives ----------- */

static void* delete_on_thread(void* t) {
  delete_tensor((DLManagedTensor*)t);
  return NULL;
}

static void keeps_memory_until_deleted(void) {
  /* overlap "none" with compute copies in pinned memory: a released group's
   * buffer goes straight back to the engine's cache, and the next fetch of a
   * group of the same size takes it. */
  strata_engine* e = build("cpu", "none", 1);
  if (e == NULL) return;
  strata_group_info info = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "a", &info));
  const size_t n = info.size_bytes;
  uint16_t* snapshot = malloc(n);
  uint16_t* later = malloc(n);
  if (snapshot == NULL || later == NULL) abort();

  /* Without a tensor: b reuses a's buffer. */
  strata_group_view va = STRATA_GROUP_VIEW_INIT, vb = STRATA_GROUP_VIEW_INIT;
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  CHECK_OK(strata_group_release(e, "a"));
  CHECK_OK(strata_group_fetch(e, "b", NULL, &vb));
  CHECK_OK(strata_group_release(e, "b"));
  CHECK(vb.data == va.data);
  void* const shared = va.data;

  /* With a's tensor alive past its release, b gets other memory and a's
   * bytes stay as they were. */
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  CHECK(va.data == shared);
  DLManagedTensor* t = export_view(e, "a", STRATA_VIEW_COMPUTE);
  if (t == NULL) {
    strata_engine_destroy(e);
    return;
  }
  copy_from_device(snapshot, t, n);
  CHECK_OK(strata_group_release(e, "a"));
  CHECK_OK(strata_group_fetch(e, "b", NULL, &vb));
  CHECK(vb.data != shared);
  copy_from_device(later, t, n);
  CHECK(memcmp(snapshot, later, n) == 0);
  CHECK_OK(strata_group_release(e, "b"));
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  CHECK(va.data != shared); /* a itself gets b's buffer now */
  void* const other = va.data;
  CHECK_OK(strata_group_release(e, "a"));

  /* After the deleter the memory is the engine's again: the next two
   * fetches take both buffers. */
  delete_tensor(t);
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  CHECK_OK(strata_group_fetch(e, "b", NULL, &vb));
  CHECK((va.data == shared && vb.data == other) || (va.data == other && vb.data == shared));
  CHECK_OK(strata_group_release(e, "a"));
  CHECK_OK(strata_group_release(e, "b"));

  /* A gradient tensor kept past grads_ready: the next buffer handed out is
   * other memory. */
  uint16_t* grads = calloc(1, n);
  if (grads == NULL) abort();
  strata_group_view g1 = STRATA_GROUP_VIEW_INIT, g2 = STRATA_GROUP_VIEW_INIT;
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  DLManagedTensor* tg = export_view(e, "a", STRATA_VIEW_GRADS);
  CHECK_OK(strata_group_grad_buffer(e, "a", &g1));
  if (tg != NULL) {
    CHECK(tg->dl_tensor.data == g1.data);
    copy_to_device(tg, grads, n);
  }
  CHECK_OK(strata_group_grads_ready(e, "a", NULL));
  CHECK_OK(strata_group_release(e, "a"));
  CHECK_OK(strata_group_fetch(e, "b", NULL, &vb));
  CHECK(vb.data != g1.data);
  CHECK_OK(strata_group_grad_buffer(e, "b", &g2));
  CHECK(g2.data != g1.data);
  CHECK_OK(strata_group_grads_ready(e, "b", NULL));
  CHECK_OK(strata_group_release(e, "b"));
  CHECK_OK(strata_step_end(e, NULL));
  delete_tensor(tg);

  /* Tensors alive when the engine is destroyed keep their memory until
   * their deleters run, here on another thread. */
  CHECK_OK(strata_group_fetch(e, "a", NULL, &va));
  DLManagedTensor* kept = export_view(e, "a", STRATA_VIEW_COMPUTE);
  DLManagedTensor* kept_grads = export_view(e, "b", STRATA_VIEW_GRADS);
  if (kept != NULL) copy_from_device(snapshot, kept, n);
  strata_engine_destroy(e); /* a is still fetched, b's gradients never handed back */
  if (kept != NULL) {
    copy_from_device(later, kept, n);
    CHECK(memcmp(snapshot, later, n) == 0);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, delete_on_thread, kept) == 0);
    CHECK(pthread_join(thread, NULL) == 0);
  }
  if (kept_grads != NULL) {
    copy_to_device(kept_grads, grads, n); /* still writable memory */
    delete_tensor(kept_grads);
  }
  free(grads);
  free(snapshot);
  free(later);
}

/* --- training through tensors equals training through the *_host calls --- */

struct run {
  double loss[kSteps];
  float a[kOut * kIn], b[kOut * kIn];
};

/* via_dlpack: read weights through COMPUTE tensors and write gradients
 * through GRADS tensors (deleting a's after grads_ready, b's before); else
 * strata_group_fetch_host / strata_group_grads_host. */
static void train(const char* compute_home, int via_dlpack, struct run* r) {
  memset(r, 0, sizeof *r);
  strata_engine* e = build(compute_home, "exact", 1);
  if (e == NULL) return;
  strata_group_info info = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "a", &info));
  int64_t off[2] = {-1, -1};
  CHECK_OK(strata_param_offset(e, "A", &off[0], NULL));
  CHECK_OK(strata_param_offset(e, "B", &off[1], NULL));
  const size_t n = info.size_bytes;
  uint16_t* w[2] = {malloc(n), malloc(n)};
  uint16_t* g = malloc(n);
  if (w[0] == NULL || w[1] == NULL || g == NULL) abort();
  const char* groups[2] = {"a", "b"};
  float x[kBatch * kIn], t[kBatch * kOut], gw[kOut * kIn];
  for (int step = 0; step < kSteps; ++step) {
    make_batch(step, x, t);
    for (int k = 0; k < 2; ++k) { /* forward */
      if (via_dlpack) {
        strata_group_view v = STRATA_GROUP_VIEW_INIT;
        CHECK_OK(strata_group_fetch(e, groups[k], NULL, &v));
        DLManagedTensor* tw = export_view(e, groups[k], STRATA_VIEW_COMPUTE);
        if (tw != NULL) copy_from_device(w[k], tw, n);
        delete_tensor(tw);
      } else {
        CHECK_OK(strata_group_fetch_host(e, groups[k], w[k], n));
      }
      CHECK_OK(strata_group_release(e, groups[k]));
    }
    double loss = 0.0;
    memset(gw, 0, sizeof gw);
    for (int bi = 0; bi < kBatch; ++bi) {
      for (int o = 0; o < kOut; ++o) {
        float acc = 0.0f;
        for (int i = 0; i < kIn; ++i) {
          acc += (bf16_to_f32(w[0][off[0] + o * kIn + i]) + bf16_to_f32(w[1][off[1] + o * kIn + i])) * x[bi * kIn + i];
        }
        const float d = acc - t[bi * kOut + o];
        loss += 0.5 * (double)d * (double)d;
        for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += d / kBatch * x[bi * kIn + i];
      }
    }
    r->loss[step] = loss / kBatch;
    for (int k = 1; k >= 0; --k) { /* backward: both groups get the same gradient */
      memset(g, 0, n);
      for (int j = 0; j < kOut * kIn; ++j) g[off[k] + j] = f32_to_bf16(gw[j]);
      if (via_dlpack) {
        strata_group_view v = STRATA_GROUP_VIEW_INIT;
        CHECK_OK(strata_group_fetch(e, groups[k], NULL, &v));
        DLManagedTensor* tg = export_view(e, groups[k], STRATA_VIEW_GRADS);
        if (tg != NULL) copy_to_device(tg, g, n);
        if (k == 1) delete_tensor(tg);
        CHECK_OK(strata_group_grads_ready(e, groups[k], NULL));
        if (k == 0) delete_tensor(tg);
        CHECK_OK(strata_group_release(e, groups[k]));
      } else {
        CHECK_OK(strata_group_fetch_host(e, groups[k], w[k], n));
        CHECK_OK(strata_group_grads_host(e, groups[k], g, n));
        CHECK_OK(strata_group_release(e, groups[k]));
      }
    }
    CHECK_OK(strata_step_end(e, NULL));
  }
  CHECK(r->loss[kSteps - 1] < r->loss[0]);
  CHECK_OK(strata_param_read_master(e, "A", r->a, kOut * kIn));
  CHECK_OK(strata_param_read_master(e, "B", r->b, kOut * kIn));
  free(w[0]);
  free(w[1]);
  free(g);
  strata_engine_destroy(e);
}

static void trains_as_the_host_calls(const char* compute_home) {
  static struct run host, dlpack;
  train(compute_home, 0, &host);
  train(compute_home, 1, &dlpack);
  CHECK(memcmp(host.loss, dlpack.loss, sizeof host.loss) == 0);
  CHECK(memcmp(host.a, dlpack.a, sizeof host.a) == 0);
  CHECK(memcmp(host.b, dlpack.b, sizeof host.b) == 0);
}

/* --- a group of frozen and trainable parameters (a LoRA block's shape) ---- */

enum { kBase = 64 };

/* A mixed group "m": a frozen kBase x kBase "Base" and a trainable "A".
 * how: 0 gradients through a GRADS tensor, 1 strata_group_grads_host with
 * the whole layout, 2 with the gradient buffer's part of it. Trains
 * kSteps steps on a fixed gradient and writes A's master to a_out. */
static void train_mixed(int how, float* a_out) {
  char config[1024];
  snprintf(config, sizeof config, kConfig, "", "exact");
  strata_engine* e = NULL;
  CHECK_OK(strata_engine_create(config, &e));
  if (e == NULL) return;
  const int64_t base_shape[2] = {kBase, kBase}, wshape[2] = {kOut, kIn};
  strata_param_desc d = STRATA_PARAM_DESC_INIT;
  d.name = "Base";
  d.shape = base_shape;
  d.ndim = 2;
  d.group = "m";
  d.frozen = 1;
  CHECK_OK(strata_param_register(e, &d, init_param, NULL));
  d.name = "A";
  d.shape = wshape;
  d.frozen = 0;
  CHECK_OK(strata_param_register(e, &d, init_param, NULL));
  CHECK_OK(strata_engine_finalize(e));
  strata_group_info info = STRATA_GROUP_INFO_INIT;
  CHECK_OK(strata_group_info_get(e, "m", &info));
  int64_t off_base = -1, off_a = -1;
  CHECK_OK(strata_param_offset(e, "Base", &off_base, NULL));
  CHECK_OK(strata_param_offset(e, "A", &off_a, NULL));
  /* The frozen part first; the gradients begin at A's slot's part of the layout. */
  CHECK(off_base == 0 && info.grad_offset_bytes >= (uint64_t)kBase * kBase * 2);
  CHECK(info.grad_offset_bytes <= (uint64_t)off_a * 2 && info.grad_offset_bytes < info.size_bytes);
  const size_t whole = info.size_bytes, part = info.size_bytes - info.grad_offset_bytes;
  uint16_t* g = calloc(1, whole);
  if (g == NULL) abort();
  for (int step = 0; step < kSteps; ++step) {
    memset(g, 0, whole);
    for (int j = 0; j < kOut * kIn; ++j) g[off_a + j] = f32_to_bf16(0.01f * (float)((j + step) % 7 - 3));
    /* (Base's slots hold garbage: never read.) */
    for (int j = 0; j < kBase * kBase; ++j) g[off_base + j] = 0x7fc0;
    if (how == 0) {
      strata_group_view v = STRATA_GROUP_VIEW_INIT;
      CHECK_OK(strata_group_grad_buffer(e, "m", &v));
      CHECK(v.offset_bytes == info.grad_offset_bytes && v.size_bytes == part);
      /* The whole-layout kind cannot say where the buffer begins: refused, naming the one that can. */
      void* refused = NULL;
      CHECK_STATUS(strata_group_dlpack(e, "m", STRATA_VIEW_GRADS, &refused), STRATA_STATUS_FAILED_PRECONDITION,
                   "STRATA_VIEW_GRAD_BUFFER");
      CHECK(refused == NULL);
      DLManagedTensor* t = export_view(e, "m", STRATA_VIEW_GRAD_BUFFER);
      if (t != NULL) {
        CHECK(t->dl_tensor.data == v.data && t->dl_tensor.shape[0] == (int64_t)(part / 2));
        copy_to_device(t, (const char*)g + info.grad_offset_bytes, part);
        delete_tensor(t);
      }
      CHECK_OK(strata_group_grads_ready(e, "m", NULL));
    } else if (how == 1) {
      CHECK_OK(strata_group_grads_host(e, "m", g, whole));
    } else {
      CHECK_OK(strata_group_grads_host(e, "m", (const char*)g + info.grad_offset_bytes, part));
    }
    strata_step_stats stats = STRATA_STEP_STATS_INIT;
    CHECK_OK(strata_step_end(e, &stats));
    CHECK(!stats.skipped);
  }
  /* Any other size is refused, naming both; so is a view struct from before offset_bytes. */
  CHECK_STATUS(strata_group_grads_host(e, "m", g, part + 2), STRATA_STATUS_INVALID_ARGUMENT, "gradients' part");
  strata_group_view old = STRATA_GROUP_VIEW_INIT;
  old.struct_size = (uint32_t)offsetof(strata_group_view, offset_bytes);
  CHECK_STATUS(strata_group_grad_buffer(e, "m", &old), STRATA_STATUS_INVALID_ARGUMENT, "offset_bytes");
  CHECK_OK(strata_param_read_master(e, "A", a_out, kOut * kIn));
  free(g);
  strata_engine_destroy(e);
}

static void mixed_group_gradients_begin_at_the_first_trainable_slot(void) {
  static float through_tensor[kOut * kIn], whole[kOut * kIn], part[kOut * kIn], init[kOut * kIn];
  train_mixed(0, through_tensor);
  train_mixed(1, whole);
  train_mixed(2, part);
  CHECK(memcmp(through_tensor, whole, sizeof whole) == 0);
  CHECK(memcmp(part, whole, sizeof whole) == 0);
  CHECK(init_param("A", init, kOut * kIn, NULL) == STRATA_STATUS_OK);
  CHECK(memcmp(init, whole, sizeof whole) != 0); /* it trained */
}

int main(void) {
  describes_the_view("cpu");
  describes_the_view("device");
  refuses_wrong_calls();
  keeps_memory_until_deleted();
  trains_as_the_host_calls("cpu");
  trains_as_the_host_calls("device");
  mixed_group_gradients_begin_at_the_first_trainable_slot();
  if (failures == 0) printf("c_api_dlpack_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
