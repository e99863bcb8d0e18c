// The e2e framework's arithmetic (mlp_kernels.h), uninstrumented by the
// sanitizer builds: it is the test's scaffolding, not the engine, and
// instrumented it was most of the e2e suites' time under ASan and TSan.
#include "tests/e2e/mlp_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/numerics.h"

#define STRATA_E2E_UNSANITIZED __attribute__((no_sanitize("address", "undefined", "thread")))

namespace strata::engine::e2e {

namespace nx = core::numerics;

namespace {
// bias + w . x over n elements, summed in index order.
STRATA_E2E_UNSANITIZED float affine(float bias, const float* w, const float* x, int n) {
  float s = bias;
  for (int i = 0; i < n; ++i) s += w[i] * x[i];
  return s;
}
}  // namespace

STRATA_E2E_UNSANITIZED void mlp_batch(std::uint64_t seed, float* x, float* y) {
  Rng r{seed};
  for (int k = 0; k < kBatch * kIn; ++k) x[k] = r.uniform();
  // The teacher: a fixed linear map of x, mildly nonlinear.
  Rng t{424242};
  std::vector<float> teacher(kOut * kIn);
  for (float& v : teacher) v = t.uniform() / 16.0f;
  for (int b = 0; b < kBatch; ++b) {
    const float* xb = x + b * kIn;
    for (int o = 0; o < kOut; ++o) y[b * kOut + o] = std::tanh(affine(0.0f, teacher.data() + o * kIn, xb, kIn));
  }
}

STRATA_E2E_UNSANITIZED void mlp_forward(const float* w1, const float* b1, const float* w2, const float* b2,
                                        const float* x, float* pre, float* h, float* out) {
  for (int b = 0; b < kBatch; ++b) {
    const float* xb = x + b * kIn;
    for (int j = 0; j < kHidden; ++j) {
      const float s = affine(b1[j], w1 + j * kIn, xb, kIn);
      pre[b * kHidden + j] = s;
      h[b * kHidden + j] = s > 0.0f ? s : 0.0f;
    }
    const float* hb = h + b * kHidden;
    for (int o = 0; o < kOut; ++o) out[b * kOut + o] = affine(b2[o], w2 + o * kHidden, hb, kHidden);
  }
}

STRATA_E2E_UNSANITIZED void mlp_backward(float scale, const float* w2, const float* x, const float* pre,
                                         const float* h, const float* out, const float* y, float* dh,
                                         float* __restrict g1w, float* g1b, float* __restrict g2w, float* g2b) {
  for (int b = 0; b < kBatch; ++b) {
    const float* hb = h + b * kHidden;
    float* dhb = dh + b * kHidden;
    for (int o = 0; o < kOut; ++o) {
      const float d = (out[b * kOut + o] - y[b * kOut + o]) * scale / kBatch;
      g2b[o] += d;
      float* g2o = g2w + o * kHidden;
      const float* w2o = w2 + o * kHidden;
      for (int j = 0; j < kHidden; ++j) {
        g2o[j] += d * hb[j];
        dhb[j] += d * w2o[j];
      }
    }
    const float* xb = x + b * kIn;
    for (int j = 0; j < kHidden; ++j) {
      const float d = pre[b * kHidden + j] > 0.0f ? dhb[j] : 0.0f;
      g1b[j] += d;
      float* g1j = g1w + j * kIn;
      for (int i = 0; i < kIn; ++i) g1j[i] += d * xb[i];
    }
  }
}

STRATA_E2E_UNSANITIZED void copies_to_fp32(const std::byte* src, std::size_t n, int bytes, bool fp16, float* dst) {
  if (bytes == 4) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t hb;
    std::memcpy(&hb, src + 2 * i, 2);
    dst[i] = fp16 ? nx::fp16_bits_to_fp32(hb) : nx::bf16_bits_to_fp32(hb);
  }
}

STRATA_E2E_UNSANITIZED void fp32_to_copies(const float* src, std::size_t n, int bytes, bool fp16, std::byte* dst) {
  if (bytes == 4) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t hb = fp16 ? nx::fp32_to_fp16_bits(src[i]) : nx::fp32_to_bf16_bits(src[i]);
    std::memcpy(dst + 2 * i, &hb, 2);
  }
}

}  // namespace strata::engine::e2e
