// The e2e framework's arithmetic (mlp_kernels.h), uninstrumented by the
// sanitizer builds (-fno-sanitize=all, meson.build: the whole file, so that
// numerics.h's conversions are inlined uninstrumented too): it is the test's
// scaffolding, not the engine, and instrumented it was most of the e2e
// suites' time under ASan and TSan. Compiled with
// -fno-tree-loop-distribute-patterns too: a loop that zeroes or copies stays
// a loop, where a call to memset or memcpy would go through the sanitizers'
// interceptors, which check and mark every byte.
#include "tests/e2e/mlp_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/numerics.h"

namespace strata::engine::e2e {

namespace nx = core::numerics;

namespace {
// out[b][o] = bias[o] + w[o] . in[b] for the batch's rows b: each sum starts at
// the bias and adds w[o][i] * in[b][i] in index order i, as a dot product
// written plainly would. The loops run across the batch (over `in`
// transposed), so that they vectorise without reordering any sum: the same
// bits, several times faster.
void affine(const float* w, const float* bias, const float* in, int n_in, int n_out,
                                   float* out) {
  float in_t[std::max(kIn, kHidden) * kBatch];
  for (int b = 0; b < kBatch; ++b) {
    for (int i = 0; i < n_in; ++i) in_t[i * kBatch + b] = in[b * n_in + i];
  }
  for (int o = 0; o < n_out; ++o) {
    float acc[kBatch];
    for (float& a : acc) a = bias[o];
    const float* wo = w + o * n_in;
    for (int i = 0; i < n_in; ++i) {
      const float wi = wo[i];
      const float* col = in_t + i * kBatch;
      for (int b = 0; b < kBatch; ++b) acc[b] += wi * col[b];
    }
    for (int b = 0; b < kBatch; ++b) out[b * n_out + o] = acc[b];
  }
}
}  // namespace

void mlp_batch(std::uint64_t seed, float* x, float* y) {
  Rng r{seed};
  for (int k = 0; k < kBatch * kIn; ++k) x[k] = r.uniform();
  // The teacher: a fixed linear map of x, mildly nonlinear.
  Rng t{424242};
  std::vector<float> teacher(kOut * kIn);
  for (float& v : teacher) v = t.uniform() / 16.0f;
  const std::vector<float> zero(kOut, 0.0f);
  affine(teacher.data(), zero.data(), x, kIn, kOut, y);
  for (int k = 0; k < kBatch * kOut; ++k) y[k] = std::tanh(y[k]);
}

void mlp_forward(const float* w1, const float* b1, const float* w2, const float* b2,
                                        const float* x, float* pre, float* h, float* out) {
  affine(w1, b1, x, kIn, kHidden, pre);
  for (int k = 0; k < kBatch * kHidden; ++k) h[k] = pre[k] > 0.0f ? pre[k] : 0.0f;
  affine(w2, b2, h, kHidden, kOut, out);
}

void mlp_backward(float scale, const float* w2, const float* x, const float* pre,
                                         const float* h, const float* out, const float* y, float* dh,
                                         float* __restrict g1w, float* g1b, float* __restrict g2w, float* g2b) {
  for (int k = 0; k < kBatch * kHidden; ++k) dh[k] = 0.0f;
  for (int k = 0; k < kHidden * kIn; ++k) g1w[k] = 0.0f;
  for (int k = 0; k < kHidden; ++k) g1b[k] = 0.0f;
  for (int k = 0; k < kOut * kHidden; ++k) g2w[k] = 0.0f;
  for (int k = 0; k < kOut; ++k) g2b[k] = 0.0f;
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

void copies_to_fp32(const std::byte* src, std::size_t n, int bytes, bool fp16, float* dst) {
  if (bytes == 4) {
    for (std::size_t i = 0; i < n; ++i) std::memcpy(dst + i, src + 4 * i, 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t hb;
    std::memcpy(&hb, src + 2 * i, 2);
    dst[i] = fp16 ? nx::fp16_bits_to_fp32(hb) : nx::bf16_bits_to_fp32(hb);
  }
}

void fp32_to_copies(const float* src, std::size_t n, int bytes, bool fp16, std::byte* dst) {
  if (bytes == 4) {
    for (std::size_t i = 0; i < n; ++i) std::memcpy(dst + 4 * i, src + i, 4);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint16_t hb = fp16 ? nx::fp32_to_fp16_bits(src[i]) : nx::fp32_to_bf16_bits(src[i]);
    std::memcpy(dst + 2 * i, &hb, 2);
  }
}

void zero_bytes(std::byte* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) p[i] = std::byte{0};
}

}  // namespace strata::engine::e2e
