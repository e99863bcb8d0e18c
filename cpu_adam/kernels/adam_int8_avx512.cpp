// AVX-512 kernels (F, BW, VL, DQ, plus F16C/FMA) of Adam with 8-bit blockwise
// moments: numerics::adam_step_int8_block 16 lanes at a time, one block of 256
// elements per pass over memory, so results match the scalar kernel bit for
// bit. A short last block goes to the scalar kernel. The avx512_bf16 entry
// point is the same loop with the hardware nearest-even conversion
// (vec_avx512.h's to_bf16<true>) for the compute copy. Compiled with the
// AVX-512 flags (cpu_adam/meson.build); called only after
// isa_supported(Isa::kAvx512) (kAvx512Bf16 for the second entry point).
//
// Per block: read the codes, scales, master and gradient once; dequantize (a
// table lookup: vpermt2ps over 32 values at a time, blended by the code's
// upper bits, times the scale); run the fp32 update (vec_avx512.h's
// adam_update); keep the new m and v in a 2 KiB stack buffer while their
// absmax is reduced (an unsigned max of the magnitudes' bit patterns, in
// which a NaN sorts above inf); then quantize against the new scales:
// |x| / scale, and the binary search of quant_search as 7 (m) or 8 (v)
// probes, each a lookup into the probe's row of QuantKernelTables, a compare
// and a masked add. A search is a chain of dependent lookups and compares,
// so the block's 16 vectors are searched side by side, probe by probe (about
// 1.8x faster than one vector at a time on a Zen 5).
#include <immintrin.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx512.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 16;
constexpr std::int64_t kBlock = core::numerics::kQuantBlockElems;
constexpr int kLevelStride = 128;  // floats per row of QuantKernelTables' levels
constexpr int kInterleave = 16;    // vectors the quantizer searches side by side

static_assert(kBlock % (kInterleave * kWidth) == 0);

using avx512::AdamVectors;
using avx512::adam_update;
using avx512::load16;
using avx512::store16;

// t[idx] for 16 lanes, idx < kEntries (a power of two). Up to 16 entries one
// vpermps; 32 one vpermt2ps over two registers; more: lookups of the halves
// blended by the index bit that picks the half.
template <int kEntries>
inline __m512 lookup(const float* t, __m512i idx) {
  if constexpr (kEntries == 1) {
    return _mm512_set1_ps(t[0]);
  } else if constexpr (kEntries <= 16) {
    return _mm512_permutexvar_ps(idx, _mm512_load_ps(t));
  } else if constexpr (kEntries == 32) {
    return _mm512_permutex2var_ps(_mm512_load_ps(t), idx, _mm512_load_ps(t + 16));
  } else {
    const __m512 lo = lookup<kEntries / 2>(t, idx);
    const __m512 hi = lookup<kEntries / 2>(t + kEntries / 2, idx);
    const __mmask16 upper = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(kEntries / 2));
    return _mm512_mask_blend_ps(upper, lo, hi);
  }
}

// numerics::quant_search over 2^kSteps thresholds for kN vectors, from probe
// kLevel on: i holds each lane's count's top kLevel bits; a probe compares
// the threshold the lane reaches (row kLevel of `levels`, at i) with xn and
// appends the result as the next bit. A NaN xn compares false (_CMP_LT_OQ),
// as in numerics.h. The kN searches are independent, and each is a chain of
// dependent lookups and compares: interleaving them probe by probe keeps the
// core busy where one chain would leave it waiting.
template <int kLevel, int kSteps, int kN>
[[gnu::always_inline]] inline void search(const float* levels, const __m512 (&xn)[kN], __m512i (&i)[kN]) {
  if constexpr (kLevel < kSteps) {
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      const __m512 threshold = lookup<(1 << kLevel)>(levels + kLevel * kLevelStride, i[k]);
      const __mmask16 below = _mm512_cmp_ps_mask(threshold, xn[k], _CMP_LT_OQ);
      i[k] = _mm512_add_epi32(i[k], i[k]);
      i[k] = _mm512_mask_add_epi32(i[k], below, i[k], _mm512_set1_epi32(1));
    }
    search<kLevel + 1, kSteps, kN>(levels, xn, i);
  }
}

inline __m512 abs_ps(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

// numerics::dequantize_m: the magnitude of the low 7 bits times the scale,
// negated (the sign bit flipped) when the code's 0x80 is set.
inline __m512 dequantize_m(const QuantKernelTables& t, __m512i code, __m512 scale) {
  const __m512 v = _mm512_mul_ps(lookup<128>(t.m_values, code), scale);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign));
}

// numerics::dequantize_v.
inline __m512 dequantize_v(const QuantKernelTables& t, __m512i code, __m512 scale) {
  return _mm512_mul_ps(lookup<256>(t.v_values, code), scale);
}

// numerics::quantize_m for a usable scale, kN vectors: the count of
// thresholds below |x| / scale, with 0x80 for a negative x whose count is not
// zero.
template <int kN>
[[gnu::always_inline]] inline void quantize_m(const QuantKernelTables& t, const __m512 (&x)[kN], __m512 scale,
                                              __m512i (&code)[kN]) {
  __m512 xn[kN];
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) xn[k] = _mm512_div_ps(abs_ps(x[k]), scale);
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) code[k] = _mm512_setzero_si512();
  search<0, 7, kN>(&t.m_levels[0][0], xn, code);
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) {
    const __mmask16 nonzero = _mm512_test_epi32_mask(code[k], code[k]);
    const __mmask16 negative = _mm512_mask_test_epi32_mask(nonzero, _mm512_castps_si512(x[k]),
                                                           _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    code[k] = _mm512_mask_or_epi32(code[k], negative, code[k], _mm512_set1_epi32(0x80));
  }
}

// numerics::quantize_v for a usable scale, kN vectors.
template <int kN>
[[gnu::always_inline]] inline void quantize_v(const QuantKernelTables& t, const __m512 (&x)[kN], __m512 scale,
                                              __m512i (&code)[kN]) {
  __m512 xn[kN];
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) xn[k] = _mm512_div_ps(abs_ps(x[k]), scale);
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) code[k] = _mm512_setzero_si512();
  search<0, 8, kN>(&t.v_levels[0][0], xn, code);
}

// numerics::block_scale of the absmax whose bit pattern is `bits` (a NaN
// counted as inf: every pattern above inf's is a NaN): the absmax when
// finite, else NaN.
inline float block_scale(std::uint32_t bits) {
  return bits >= 0x7f800000u ? std::bit_cast<float>(0x7fc00000u) : std::bit_cast<float>(bits);
}

// numerics::usable_scale: positive and finite.
inline bool usable(float scale) {
  return scale > 0.0f && (std::bit_cast<std::uint32_t>(scale) & 0x7f800000u) != 0x7f800000u;
}

// Quantizes a block's 256 new values of one moment into codes against its
// new scale; a scale that cannot scale (zero, or the NaN of a non-finite
// absmax) gives code 0 everywhere.
template <bool kExpAvg>
inline void quantize_block(const QuantKernelTables& t, const float* values, float scale,
                           std::uint8_t* __restrict codes) {
  if (!usable(scale)) {
    std::memset(codes, 0, kBlock);
    return;
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (std::int64_t j = 0; j < kBlock; j += kInterleave * kWidth) {
    __m512 x[kInterleave];
    __m512i r[kInterleave];
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) x[k] = _mm512_load_ps(values + j + k * kWidth);
    if constexpr (kExpAvg) {
      quantize_m(t, x, s, r);
    } else {
      quantize_v(t, x, s, r);
    }
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j + k * kWidth), _mm512_cvtepi32_epi8(r[k]));
    }
  }
}

inline __m512i load_codes(const std::uint8_t* codes, std::int64_t i) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
}

// kCopy: kF32 means "no copy-out". The pointers are copied out of the
// argument struct so the compiler knows the stores cannot change them.
// n_blocks whole blocks.
template <ElemType kGrad, ElemType kCopy, bool kNativeBf16>
void loop(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  const AdamVectors k(*a.constants);
  const bool has_l2 = a.constants->l2_decay != 0.0f;
  const bool has_decay = a.constants->neg_lr_decay != 0.0f;
  const QuantKernelTables& t = quant_kernel_tables();
  float* __restrict master = a.master;
  std::uint8_t* __restrict exp_avg = a.exp_avg;
  std::uint8_t* __restrict exp_avg_sq = a.exp_avg_sq;
  float* __restrict exp_avg_scale = a.exp_avg_scale;
  float* __restrict exp_avg_sq_scale = a.exp_avg_sq_scale;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  alignas(64) float m32[kBlock];
  alignas(64) float v32[kBlock];
  for (std::int64_t b = 0; b < n_blocks; ++b) {
    const std::int64_t base = b * kBlock;
    const __m512 m_scale = _mm512_set1_ps(exp_avg_scale[b]);
    const __m512 v_scale = _mm512_set1_ps(exp_avg_sq_scale[b]);
    __m512i m_absmax = _mm512_setzero_si512();
    __m512i v_absmax = _mm512_setzero_si512();
    for (std::int64_t j = 0; j < kBlock; j += kWidth) {
      const std::int64_t i = base + j;
      __m512 m = dequantize_m(t, load_codes(exp_avg, i), m_scale);
      __m512 v = dequantize_v(t, load_codes(exp_avg_sq, i), v_scale);
      __m512 p = _mm512_loadu_ps(master + i);
      adam_update(k, load16<kGrad>(grad, i), p, m, v, has_l2, has_decay);
      _mm512_storeu_ps(master + i, p);
      if constexpr (kCopy != ElemType::kF32) store16<kCopy, kNativeBf16>(copy_out, i, p);
      _mm512_store_ps(m32 + j, m);
      _mm512_store_ps(v32 + j, v);
      // The absmax on the magnitudes' bit patterns: for non-negative floats
      // the unsigned order is the numeric order, and NaNs sort above inf.
      m_absmax = _mm512_max_epu32(m_absmax, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
      v_absmax = _mm512_max_epu32(v_absmax, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
    }
    const float m_new = block_scale(_mm512_reduce_max_epu32(m_absmax));
    const float v_new = block_scale(_mm512_reduce_max_epu32(v_absmax));
    exp_avg_scale[b] = m_new;
    exp_avg_sq_scale[b] = v_new;
    quantize_block<true>(t, m32, m_new, exp_avg + base);
    quantize_block<false>(t, v32, v_new, exp_avg_sq + base);
  }
}

template <ElemType kGrad, bool kNativeBf16>
void dispatch_copy(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  if (a.copy_out == nullptr) return loop<kGrad, ElemType::kF32, kNativeBf16>(a, n_blocks);
  if (a.copy_type == ElemType::kBf16) return loop<kGrad, ElemType::kBf16, kNativeBf16>(a, n_blocks);
  return loop<kGrad, ElemType::kF16, kNativeBf16>(a, n_blocks);
}

template <bool kNativeBf16>
void adam_int8(const AdamInt8KernelArgs& a) {
  const std::int64_t n_blocks = a.n / kBlock;
  switch (a.grad_type) {
    case ElemType::kF32: dispatch_copy<ElemType::kF32, kNativeBf16>(a, n_blocks); break;
    case ElemType::kBf16: dispatch_copy<ElemType::kBf16, kNativeBf16>(a, n_blocks); break;
    case ElemType::kF16: dispatch_copy<ElemType::kF16, kNativeBf16>(a, n_blocks); break;
  }
  const std::int64_t done = n_blocks * kBlock;
  if (done == a.n) return;
  AdamInt8KernelArgs tail = a;
  tail.master += done;
  tail.exp_avg += done;
  tail.exp_avg_sq += done;
  tail.exp_avg_scale += n_blocks;
  tail.exp_avg_sq_scale += n_blocks;
  tail.grad = static_cast<const std::byte*>(a.grad) + done * elem_size_bytes(a.grad_type);
  if (a.copy_out != nullptr) {
    tail.copy_out = static_cast<std::byte*>(a.copy_out) + done * elem_size_bytes(a.copy_type);
  }
  tail.n = a.n - done;
  scalar_kernels().adam_int8(tail);
}

}  // namespace

void adam_int8_avx512(const AdamInt8KernelArgs& a) { adam_int8<false>(a); }
void adam_int8_avx512_bf16(const AdamInt8KernelArgs& a) { adam_int8<true>(a); }

}  // namespace strata::adam::kernels
