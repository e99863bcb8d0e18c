// The AVX2 kernels' loads and stores (adam_avx2.cpp, lion_adagrad_avx2.cpp):
// 8 elements of fp32, bf16 or fp16 widened to fp32 and back with numerics.h's
// bits. Included only by the AVX2 kernel files, which are compiled with AVX2
// flags (cpu_adam/meson.build); everything here is inline.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"

namespace strata::adam::kernels::avx2 {

// --- loads: 8 elements of the given type, widened to fp32 (exact) ------------

template <ElemType T>
inline __m256 load8(const void* base, std::int64_t i) {
  if constexpr (T == ElemType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(base) + i));
    if constexpr (T == ElemType::kBf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);  // exact, subnormals kept (DAZ is off)
    }
  }
}

// --- fp32 -> bf16 on the bit pattern (numerics::fp32_to_bf16_bits) -----------

// In 32-bit lanes (the bf16 in each lane's low half), before packing.
inline __m256i to_bf16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // all ones in a NaN lane
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// Packs 8 lanes that each hold a 16-bit value into 8 uint16_t, in order.
inline __m128i pack_u16(__m256i r) {
  // Every value fits 16 bits, so unsigned saturation packs without change.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m128i to_bf16(__m256 x) { return pack_u16(to_bf16_lanes(x)); }

// fp32 -> fp16: the F16C conversion rounds to nearest even and keeps
// subnormals (FTZ is off), as numerics::fp32_to_fp16_bits does.
inline __m128i to_f16(__m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <ElemType T>
inline void store8(void* base, std::int64_t i, __m256 x) {
  if constexpr (T == ElemType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  } else {
    const __m128i h = T == ElemType::kBf16 ? to_bf16(x) : to_f16(x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i), h);
  }
}

// The compute copy is write-only here (it goes to the device next), so when
// the destination is aligned it is written with non-temporal stores: no read
// for ownership, no cache pollution. The bits are the same either way.
template <ElemType T>
inline void stream_copy(void* base, std::int64_t i, __m256 x) {
  const __m128i h = T == ElemType::kBf16 ? to_bf16(x) : to_f16(x);
  _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(base) + i), h);
}

// Adam's per-step constants, one per lane (numerics::AdamStepConstants), and
// whether the two decays are on.
struct AdamVectors {
  __m256 grad_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, inv_sqrt_bc2, neg_step_size,
      neg_lr_decay, l2_decay;
  bool has_l2, has_decay;
  explicit AdamVectors(const core::numerics::AdamStepConstants& c)
      : grad_scale(_mm256_set1_ps(c.grad_scale)),
        beta1(_mm256_set1_ps(c.beta1)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        eps(_mm256_set1_ps(c.eps)),
        inv_sqrt_bc2(_mm256_set1_ps(c.inv_sqrt_bias_correction2)),
        neg_step_size(_mm256_set1_ps(c.neg_step_size)),
        neg_lr_decay(_mm256_set1_ps(c.neg_lr_decay)),
        l2_decay(_mm256_set1_ps(c.l2_decay)),
        has_l2(c.l2_decay != 0.0f),
        has_decay(c.neg_lr_decay != 0.0f) {}
};

// numerics::adam_step on 8 lanes, operation for operation: `grad` is the raw
// gradient, p, m and v fp32 (the fp32- and the bf16-moment kernels load and
// store them).
inline void adam_update(const AdamVectors& k, __m256 grad, __m256& p, __m256& m, __m256& v) {
  __m256 g = _mm256_mul_ps(grad, k.grad_scale);
  if (k.has_l2) g = _mm256_fmadd_ps(p, k.l2_decay, g);
  m = _mm256_fmadd_ps(k.beta1, m, _mm256_mul_ps(k.one_minus_beta1, g));
  v = _mm256_fmadd_ps(k.beta2, v, _mm256_mul_ps(k.one_minus_beta2, _mm256_mul_ps(g, g)));
  const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv_sqrt_bc2, k.eps);
  const __m256 u = _mm256_div_ps(m, d);
  if (k.has_decay) p = _mm256_fmadd_ps(k.neg_lr_decay, p, p);
  p = _mm256_fmadd_ps(k.neg_step_size, u, p);
}

}  // namespace strata::adam::kernels::avx2
