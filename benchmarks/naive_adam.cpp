// A textbook AdamW loop, the in-run baseline of cpu_adam_bench. Compiled
// without vector flags and with vectorisation off (benchmarks/meson.build).
#include <cmath>
#include <cstdint>

#include "benchmarks/roofline.h"

namespace strata::bench {

void naive_adamw(float* p, float* m, float* v, const float* g, std::int64_t n, float lr, float beta1,
                 float beta2, float eps, float weight_decay, int step) {
  const float bc1 = 1.0f - std::pow(beta1, static_cast<float>(step));
  const float bc2 = 1.0f - std::pow(beta2, static_cast<float>(step));
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    const float m_hat = m[i] / bc1;
    const float v_hat = v[i] / bc2;
    p[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * p[i]);
  }
}

}  // namespace strata::bench
