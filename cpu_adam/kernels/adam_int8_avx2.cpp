// AVX2 kernel (with FMA and F16C) of Adam with 8-bit blockwise moments:
// numerics::adam_step_int8_block 8 lanes at a time, one block of 256 elements
// per pass over memory, so results match the scalar kernel bit for bit. A
// short last block goes to the scalar kernel. Compiled with the AVX2 flags
// (cpu_adam/meson.build); called only after isa_supported(Isa::kAvx2).
//
// The shape of adam_int8_avx512.cpp at half the width: the codes are guessed
// from QuantAllLines (kernels.h: the minimum of every line, 7 fmas for m and
// 8 for v, where the AVX-512 kernels look two lines up by bin), and a group
// of vectors with a lane near a threshold takes quant_search's probes. AVX2 has no two-register
// permute, so a table lookup is a vpermps for up to 8 entries, vpermps
// results blended by index bits up to 64 (the search's probes but v's last),
// and a gather beyond (the dequantizing lookups into 128 and 256 values, v's
// last probe): on the Zen 5 this was tuned on, gathers lose to the blends up
// to 64 entries and win beyond.
#include <immintrin.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx2.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 8;
constexpr std::int64_t kBlock = core::numerics::kQuantBlockElems;
constexpr int kLevelStride = 128;       // floats per row of QuantKernelTables' levels
constexpr int kInterleave = 4;          // vectors the quantizer works side by side
constexpr int kMaxPermuteEntries = 64;  // larger tables are read with gathers

static_assert(kBlock % (kInterleave * kWidth) == 0);

using avx2::AdamVectors;
using avx2::adam_update;
using avx2::load8;
using avx2::store8;

// log2 of a power of two.
constexpr int log2_of(int x) { return x <= 1 ? 0 : 1 + log2_of(x / 2); }

// t[idx] for 8 lanes, idx < kEntries (a power of two): a vpermps up to 8
// entries; up to kMaxPermuteEntries, lookups of the halves blended by the
// index bit that picks the half (vblendvps reads it shifted into the sign);
// a gather beyond.
template <int kEntries>
inline __m256 lookup(const float* t, __m256i idx) {
  if constexpr (kEntries == 1) {
    return _mm256_set1_ps(t[0]);
  } else if constexpr (kEntries <= 8) {
    return _mm256_permutevar8x32_ps(_mm256_load_ps(t), idx);
  } else if constexpr (kEntries <= kMaxPermuteEntries) {
    const __m256 lo = lookup<kEntries / 2>(t, idx);
    const __m256 hi = lookup<kEntries / 2>(t + kEntries / 2, idx);
    const __m256i upper = _mm256_slli_epi32(idx, 31 - log2_of(kEntries / 2));
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(upper));
  } else {
    return _mm256_i32gather_ps(t, idx, 4);
  }
}

// numerics::quant_search over 2^kSteps thresholds for kN vectors, from probe
// kLevel on (see adam_int8_avx512.cpp): i holds each lane's count's top
// kLevel bits; a probe appends (threshold < xn), subtracting the compare's
// all-ones (-1) lanes. The kN independent searches run probe by probe.
template <int kLevel, int kSteps, int kN>
[[gnu::always_inline]] inline void search(const float* levels, const __m256 (&xn)[kN], __m256i (&i)[kN]) {
  if constexpr (kLevel < kSteps) {
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      const __m256 threshold = lookup<(1 << kLevel)>(levels + kLevel * kLevelStride, i[k]);
      const __m256 below = _mm256_cmp_ps(threshold, xn[k], _CMP_LT_OQ);
      i[k] = _mm256_sub_epi32(_mm256_add_epi32(i[k], i[k]), _mm256_castps_si256(below));
    }
    search<kLevel + 1, kSteps, kN>(levels, xn, i);
  }
}

inline __m256 abs_ps(__m256 x) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)));
}

// numerics::dequantize_m: the magnitude of the low 7 bits times the scale,
// negated (the sign bit flipped) when the code's 0x80 is set.
inline __m256 dequantize_m(const QuantKernelTables& t, __m256i code, __m256 scale) {
  const __m256i r = _mm256_and_si256(code, _mm256_set1_epi32(0x7f));
  const __m256 v = _mm256_mul_ps(lookup<128>(t.m_values, r), scale);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), sign));
}

// numerics::dequantize_v.
inline __m256 dequantize_v(const QuantKernelTables& t, __m256i code, __m256 scale) {
  return _mm256_mul_ps(lookup<256>(t.v_values, code), scale);
}

// QuantAllLines' guess (kernels.h) for 8 lanes of xn in [0, 1]: the count
// of thresholds below xn where the lane's bit in the returned movemask is
// clear; a set bit says the lane lies within 2^-12 of a step of a threshold
// and needs the search. y is the minimum of every line (7 for m, 8 for v):
// no bins, so no lookups, which AVX2 makes dear.
template <int kLines>
inline int guess(const QuantAllLines& l, __m256 xn, __m256i& code) {
  __m256 y = _mm256_fmadd_ps(xn, _mm256_broadcast_ss(&l.a[0]), _mm256_broadcast_ss(&l.c[0]));
#pragma GCC unroll 8
  for (int i = 1; i < kLines; ++i) {
    y = _mm256_min_ps(y, _mm256_fmadd_ps(xn, _mm256_broadcast_ss(&l.a[i]), _mm256_broadcast_ss(&l.c[i])));
  }
  const __m256 whole = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  code = _mm256_cvttps_epi32(whole);
  const __m256 fraction = _mm256_sub_ps(y, whole);
  return _mm256_movemask_ps(_mm256_cmp_ps(fraction, _mm256_set1_ps(2.0f * kQuantGuessDelta), _CMP_LT_OQ));
}

// numerics::quantize_m or quantize_v for a usable scale, kN vectors: the
// count of thresholds below xn = |x| / scale (m: with 0x80 for a negative x
// whose count is not zero). The lines' guesses, and where any lane of the kN
// vectors is near a threshold, quant_search's probes for all of them.
// kReciprocal: the guesses take |x| times the scale's reciprocal, the search
// the division (adam_int8_avx512.cpp's quantize says why that holds).
template <bool kExpAvg, bool kReciprocal, int kN>
[[gnu::always_inline]] inline void quantize(const QuantKernelTables& t, const __m256 (&x)[kN], __m256 scale,
                                            __m256 rcp, __m256i (&code)[kN]) {
  const QuantAllLines& lines = kExpAvg ? t.m_all_lines : t.v_all_lines;
  __m256 xn[kN];
  int near = 0;
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) {
    xn[k] = kReciprocal ? _mm256_mul_ps(abs_ps(x[k]), rcp) : _mm256_div_ps(abs_ps(x[k]), scale);
    near |= guess<kExpAvg ? 7 : 8>(lines, xn[k], code[k]);  // lines.count
  }
  if (near != 0) [[unlikely]] {
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      code[k] = _mm256_setzero_si256();
      if constexpr (kReciprocal) xn[k] = _mm256_div_ps(abs_ps(x[k]), scale);
    }
    if constexpr (kExpAvg) {
      search<0, 7, kN>(&t.m_levels[0][0], xn, code);
    } else {
      search<0, 8, kN>(&t.v_levels[0][0], xn, code);
    }
  }
  if constexpr (kExpAvg) {
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      const __m256i sign =
          _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x[k]), 24), _mm256_set1_epi32(0x80));
      const __m256i zero = _mm256_cmpeq_epi32(code[k], _mm256_setzero_si256());
      code[k] = _mm256_or_si256(code[k], _mm256_andnot_si256(zero, sign));
    }
  }
}

// numerics::block_scale of the absmax whose bit pattern is `bits` (a NaN
// counted as inf: every pattern above inf's is a NaN): the absmax when
// finite, else NaN.
inline float block_scale(std::uint32_t bits) {
  return bits >= 0x7f800000u ? std::bit_cast<float>(0x7fc00000u) : std::bit_cast<float>(bits);
}

// As adam_int8_avx512.cpp's: the scale and its reciprocal normal floats.
inline bool reciprocal_holds(float scale) { return scale >= 0x1p-126f && scale < 0x1p126f; }

// numerics::usable_scale: positive and finite.
inline bool usable(float scale) {
  return scale > 0.0f && (std::bit_cast<std::uint32_t>(scale) & 0x7f800000u) != 0x7f800000u;
}

inline std::uint32_t reduce_max_u32(__m256i x) {
  __m128i y = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0x4e));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0xb1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(y));
}

inline __m256i load_codes(const std::uint8_t* codes, std::int64_t i) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
}

// Packs 8 lanes holding values below 256 into 8 bytes (unsigned saturation
// changes none of them).
inline void store_codes(std::uint8_t* codes, std::int64_t i, __m256i r) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
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
  const __m256 s = _mm256_set1_ps(scale);
  const bool reciprocal = reciprocal_holds(scale);
  const __m256 rcp = _mm256_set1_ps(reciprocal ? 1.0f / scale : 0.0f);
  for (std::int64_t j = 0; j < kBlock; j += kInterleave * kWidth) {
    __m256 x[kInterleave];
    __m256i r[kInterleave];
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) x[k] = _mm256_load_ps(values + j + k * kWidth);
    if (reciprocal) [[likely]] {
      quantize<kExpAvg, true>(t, x, s, rcp, r);
    } else {
      quantize<kExpAvg, false>(t, x, s, rcp, r);
    }
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) store_codes(codes, j + k * kWidth, r[k]);
  }
}

// kCopy: kF32 means "no copy-out". n_blocks whole blocks.
template <ElemType kGrad, ElemType kCopy>
void loop(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  const AdamVectors k(*a.constants);
  const QuantKernelTables& t = quant_kernel_tables();
  float* __restrict master = a.master;
  std::uint8_t* __restrict exp_avg = a.exp_avg;
  std::uint8_t* __restrict exp_avg_sq = a.exp_avg_sq;
  float* __restrict exp_avg_scale = a.exp_avg_scale;
  float* __restrict exp_avg_sq_scale = a.exp_avg_sq_scale;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  alignas(32) float m32[kBlock];
  alignas(32) float v32[kBlock];
  for (std::int64_t b = 0; b < n_blocks; ++b) {
    const std::int64_t base = b * kBlock;
    const __m256 m_scale = _mm256_set1_ps(exp_avg_scale[b]);
    const __m256 v_scale = _mm256_set1_ps(exp_avg_sq_scale[b]);
    __m256i m_absmax = _mm256_setzero_si256();
    __m256i v_absmax = _mm256_setzero_si256();
    for (std::int64_t j = 0; j < kBlock; j += kWidth) {
      const std::int64_t i = base + j;
      __m256 m = dequantize_m(t, load_codes(exp_avg, i), m_scale);
      __m256 v = dequantize_v(t, load_codes(exp_avg_sq, i), v_scale);
      __m256 p = _mm256_loadu_ps(master + i);
      adam_update(k, load8<kGrad>(grad, i), p, m, v);
      _mm256_storeu_ps(master + i, p);
      if constexpr (kCopy != ElemType::kF32) store8<kCopy>(copy_out, i, p);
      _mm256_store_ps(m32 + j, m);
      _mm256_store_ps(v32 + j, v);
      // The absmax on the magnitudes' bit patterns: for non-negative floats
      // the unsigned order is the numeric order, and NaNs sort above inf.
      m_absmax = _mm256_max_epu32(m_absmax, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
      v_absmax = _mm256_max_epu32(v_absmax, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
    }
    const float m_new = block_scale(reduce_max_u32(m_absmax));
    const float v_new = block_scale(reduce_max_u32(v_absmax));
    exp_avg_scale[b] = m_new;
    exp_avg_sq_scale[b] = v_new;
    quantize_block<true>(t, m32, m_new, exp_avg + base);
    quantize_block<false>(t, v32, v_new, exp_avg_sq + base);
  }
}

template <ElemType kGrad>
void dispatch_copy(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  if (a.copy_out == nullptr) return loop<kGrad, ElemType::kF32>(a, n_blocks);
  if (a.copy_type == ElemType::kBf16) return loop<kGrad, ElemType::kBf16>(a, n_blocks);
  return loop<kGrad, ElemType::kF16>(a, n_blocks);
}

}  // namespace

void adam_int8_avx2(const AdamInt8KernelArgs& a) {
  const std::int64_t n_blocks = a.n / kBlock;
  switch (a.grad_type) {
    case ElemType::kF32: dispatch_copy<ElemType::kF32>(a, n_blocks); break;
    case ElemType::kBf16: dispatch_copy<ElemType::kBf16>(a, n_blocks); break;
    case ElemType::kF16: dispatch_copy<ElemType::kF16>(a, n_blocks); break;
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

}  // namespace strata::adam::kernels
