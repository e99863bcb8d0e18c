// The AVX-512 kernels' loads and stores (adam_avx512.cpp,
// lion_adagrad_avx512.cpp): 16 elements of fp32, bf16 or fp16 widened to fp32
// and back with numerics.h's bits. Included only by the AVX-512 kernel files,
// which are compiled with AVX-512 flags (cpu_adam/meson.build); everything here
// is inline, so each file's loops inline it as they did when it was theirs.
#pragma once

#include <immintrin.h>

#include <bit>
#include <cstdint>

#include "cpu_adam/kernels/kernels.h"

namespace strata::adam::kernels::avx512 {

// --- loads: 16 elements of the given type, widened to fp32 (exact) -----------

template <ElemType T>
inline __m512 load16(const void* base, std::int64_t i) {
  if constexpr (T == ElemType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(base) + i));
    if constexpr (T == ElemType::kBf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);  // exact, subnormals kept (DAZ is off)
    }
  }
}

// --- fp32 -> bf16 (numerics::fp32_to_bf16_bits) ----------------------------------

// On the bit pattern: round to nearest even by adding 0x7fff plus the kept
// lsb, NaNs quieted with their payload's top bits kept (the NaNs found by one
// unordered compare, and quieted by a masked or).
// to_bf16_lanes keeps the results in 32-bit lanes (the bf16 in each lane's low half).
inline __m512i to_bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7fff)), 16);
  return _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x0040));
}
inline __m256i to_bf16_bits(__m512 x) { return _mm512_cvtepi32_epi16(to_bf16_lanes(x)); }

// kNative (AVX512_BF16, only when isa_supported(kAvx512Bf16)): vcvtneps2bf16
// rounds to nearest even and quiets NaNs exactly as numerics.h does, but it
// ignores MXCSR and flushes subnormal inputs to zero. A vector holding any
// subnormal (vfpclassps, class 0x20) takes the bit-pattern path instead; normal
// training values never do. Either way the bits are numerics.h's.
template <bool kNative>
inline __m256i to_bf16(__m512 x) {
  if constexpr (kNative) {
    if (_mm512_fpclass_ps_mask(x, 0x20) != 0) [[unlikely]] return to_bf16_bits(x);
    return std::bit_cast<__m256i>(_mm512_cvtneps_pbh(x));
  } else {
    return to_bf16_bits(x);
  }
}

// fp32 -> fp16: the F16C conversion rounds to nearest even and keeps
// subnormals (FTZ is off), as numerics::fp32_to_fp16_bits does.
inline __m256i to_f16(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <ElemType T, bool kNativeBf16 = false>
inline void store16(void* base, std::int64_t i, __m512 x) {
  if constexpr (T == ElemType::kF32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, x);
  } else {
    const __m256i h = T == ElemType::kBf16 ? to_bf16<kNativeBf16>(x) : to_f16(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i), h);
  }
}

// The compute copy is write-only here (it goes to the device next), so when
// the destination is aligned it is written with non-temporal stores: no read
// for ownership, no cache pollution. The bits are the same either way.
template <ElemType T, bool kNativeBf16>
inline void stream_copy(void* base, std::int64_t i, __m512 x) {
  const __m256i h = T == ElemType::kBf16 ? to_bf16<kNativeBf16>(x) : to_f16(x);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<std::uint16_t*>(base) + i), h);
}

// Adam's per-step constants, one per lane (numerics::AdamStepConstants).
struct AdamVectors {
  __m512 grad_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, inv_sqrt_bc2, neg_step_size,
      neg_lr_decay, l2_decay;
  explicit AdamVectors(const core::numerics::AdamStepConstants& c)
      : grad_scale(_mm512_set1_ps(c.grad_scale)),
        beta1(_mm512_set1_ps(c.beta1)),
        beta2(_mm512_set1_ps(c.beta2)),
        one_minus_beta1(_mm512_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        eps(_mm512_set1_ps(c.eps)),
        inv_sqrt_bc2(_mm512_set1_ps(c.inv_sqrt_bias_correction2)),
        neg_step_size(_mm512_set1_ps(c.neg_step_size)),
        neg_lr_decay(_mm512_set1_ps(c.neg_lr_decay)),
        l2_decay(_mm512_set1_ps(c.l2_decay)) {}
};

// numerics::adam_step on 16 lanes, operation for operation: `grad` is the raw
// gradient, p, m and v fp32 (the fp32- and the bf16-moment kernels load and
// store them). `l2` and `decay` say whether those constants are non-zero
// (compile-time constants in the fp32 kernel's shapes).
inline void adam_update(const AdamVectors& k, __m512 grad, __m512& p, __m512& m, __m512& v, bool l2, bool decay) {
  __m512 g = _mm512_mul_ps(grad, k.grad_scale);
  if (l2) g = _mm512_fmadd_ps(p, k.l2_decay, g);
  m = _mm512_fmadd_ps(k.beta1, m, _mm512_mul_ps(k.one_minus_beta1, g));
  v = _mm512_fmadd_ps(k.beta2, v, _mm512_mul_ps(k.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), k.inv_sqrt_bc2, k.eps);
  const __m512 u = _mm512_div_ps(m, d);
  if (decay) p = _mm512_fmadd_ps(k.neg_lr_decay, p, p);
  p = _mm512_fmadd_ps(k.neg_step_size, u, p);
}

// adam_update with the optional lines taken under masks (all lanes or none)
// rather than branches: a lane whose mask bit is clear keeps its value, as
// when the line is skipped. The 8-bit-moment kernel's loop, where the branches
// were not hoisted out of the loop.
inline void adam_update_masked(const AdamVectors& k, __m512 grad, __m512& p, __m512& m, __m512& v, __mmask16 l2,
                               __mmask16 decay) {
  __m512 g = _mm512_mul_ps(grad, k.grad_scale);
  g = _mm512_mask3_fmadd_ps(p, k.l2_decay, g, l2);
  m = _mm512_fmadd_ps(k.beta1, m, _mm512_mul_ps(k.one_minus_beta1, g));
  v = _mm512_fmadd_ps(k.beta2, v, _mm512_mul_ps(k.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 d = _mm512_fmadd_ps(_mm512_sqrt_ps(v), k.inv_sqrt_bc2, k.eps);
  const __m512 u = _mm512_div_ps(m, d);
  p = _mm512_mask_fmadd_ps(p, decay, k.neg_lr_decay, p);  // neg_lr_decay p + p
  p = _mm512_fmadd_ps(k.neg_step_size, u, p);
}

}  // namespace strata::adam::kernels::avx512
