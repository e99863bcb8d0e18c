// AVX-512 kernels (F, BW, VL, DQ, plus F16C/FMA) of Adam with 8-bit blockwise
// moments: numerics::adam_step_int8_block 16 lanes at a time, one block of 256
// elements per pass over memory, so results match the scalar kernel bit for
// bit. A short last block goes to the scalar kernel. The avx512_bf16 entry
// point is the same loop with the hardware nearest-even conversion
// (vec_avx512.h's to_bf16<true>) for the compute copy. Compiled with the
// AVX-512 flags (cpu_adam/meson.build); called only after
// isa_supported(Isa::kAvx512) (kAvx512Bf16 for the second entry point).
//
// Per block: read the codes, scales, master and gradient once; dequantize
// (with AVX512_VBMI, dequantize_block_vbmi: vpermi2b over the values' byte
// planes, 64 codes at a time, into a 2 KiB stack buffer; without it,
// vpermt2ps over 32 values at a time, blended by the code's upper bits), times
// the scale; run the fp32 update (vec_avx512.h's adam_update_masked), keeping
// the new m and v in the buffer while their absmax is reduced (an unsigned
// max of the magnitudes' bit patterns, in which a NaN sorts above inf); then
// quantize against the new scales: q = x / scale (the division of the
// contract; the guess takes x times the scale's reciprocal, quantize says
// why that gives q's codes) and QuantLines' guess (kernels.h): the bin of |q| picks two
// lines (vpermps), the code is trunc(min of the two fmas). A group of four
// vectors with a lane within 2^-12 of a threshold (the guess's fraction below
// 2 kQuantGuessDelta; about one group in 30) takes quant_search's probes
// instead, each a lookup into the probe's row of QuantKernelTables, a compare
// and a masked add, the group's vectors side by side. With AVX512_VBMI the
// codes of four vectors are packed into bytes by vpermt2b and m's sign set
// on the bytes (quantize_block_vbmi). The loop prefetches the inputs of the
// block four on (half of a block's time is the quantizing, from L1) and
// streams the compute copy when it is aligned.
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
constexpr std::int64_t kPrefetchBlocks = 4;  // how far ahead the loop asks for its inputs (2 to 8 did as well)
constexpr int kLevelStride = 128;  // floats per row of QuantKernelTables' levels
constexpr int kInterleave = 4;     // vectors the quantizer works side by side

static_assert(kBlock % (kInterleave * kWidth) == 0);

using avx512::AdamVectors;
using avx512::adam_update_masked;
using avx512::load16;
using avx512::store16;
using avx512::stream_copy;

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

// QuantLines' guess (kernels.h) for 16 lanes of q = +-xn, xn in [0, 1]:
// `code` is the count of thresholds below xn wherever the returned fraction
// of y is at least 2 kQuantGuessDelta; below that the lane lies within 2^-12
// of a step of a threshold and needs the search. The bin (bits(xc) >> 24,
// which vpermps reads mod 16) picks two lines, y = the min of their fmas,
// the guess trunc(y), and vreduceps gives y - trunc(y) (exact).
inline __m512 guess(const QuantLines& l, __m512 q, __m512i& code) {
  // vrangeps 0x0b: max(|q|, |lo|) with the sign cleared, quant_guess's
  // max(xn, lo) where q = +-xn.
  const __m512 xc = _mm512_range_ps(q, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(l.lo))), 0x0b);
  const __m512i j = _mm512_srli_epi32(_mm512_castps_si512(xc), 24);
  const __m512 y0 = _mm512_fmadd_ps(xc, _mm512_permutexvar_ps(j, _mm512_load_ps(l.a0)),
                                    _mm512_permutexvar_ps(j, _mm512_load_ps(l.c0)));
  const __m512 y1 = _mm512_fmadd_ps(xc, _mm512_permutexvar_ps(j, _mm512_load_ps(l.a1)),
                                    _mm512_permutexvar_ps(j, _mm512_load_ps(l.c1)));
  const __m512 y = _mm512_min_ps(y0, y1);
  code = _mm512_cvttps_epi32(y);
  return _mm512_reduce_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}

// numerics::quantize_m or quantize_v for a usable scale, kN vectors: the
// count of thresholds below xn = |x| / scale (m with kSign: with 0x80 for a
// negative x whose count is not zero). The lines' guesses, and where any
// lane of the kN vectors is near a threshold (the least fraction below
// 2 delta), quant_search's probes for all of them.
//
// kReciprocal: the guesses take q' = x * rcp (rcp = 1 / scale rounded, a
// normal float) instead of the contract's q = x / scale, a multiply for a
// division. q' is within a relative 3 * 2^-24 + O(2^-48) of q (three
// roundings), which
// moves r (kernels.h) by at most that times q * r'(q) <= 2^k / 0.9 < 143
// (the 128 codes of v's top decade): under 2^-15.2. With the guess's own
// error under 2^-15, a lane whose fraction of y is at least 2 delta has
// r(q) + 1/2 at least delta - 2^-14 (> 0) from every integer, so its guess
// is q's count. Lanes near a step search, as before, with q itself (the
// divisions are done there only: about one group in 30).
template <bool kExpAvg, bool kSign, bool kReciprocal, int kN>
[[gnu::always_inline]] inline void quantize(const QuantKernelTables& t, const __m512 (&x)[kN], __m512 scale,
                                            __m512 rcp, __m512i (&code)[kN]) {
  const QuantLines& lines = kExpAvg ? t.m_lines : t.v_lines;
  // q = x / scale = +-(|x| / scale) exactly (the rounding is symmetric).
  __m512 q[kN];
  __m512 fraction = _mm512_set1_ps(1.0f);
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) {
    q[k] = kReciprocal ? _mm512_mul_ps(x[k], rcp) : _mm512_div_ps(x[k], scale);
    fraction = _mm512_min_ps(fraction, guess(lines, q[k], code[k]));
  }
  const __mmask16 near = _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(2.0f * kQuantGuessDelta), _CMP_LT_OQ);
  if (near != 0) [[unlikely]] {
    __m512 xn[kN];
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      xn[k] = abs_ps(kReciprocal ? _mm512_div_ps(x[k], scale) : q[k]);
      code[k] = _mm512_setzero_si512();
    }
    if constexpr (kExpAvg) {
      search<0, 7, kN>(&t.m_levels[0][0], xn, code);
    } else {
      search<0, 8, kN>(&t.v_levels[0][0], xn, code);
    }
  }
  if constexpr (kExpAvg && kSign) {
#pragma GCC unroll 16
    for (int k = 0; k < kN; ++k) {
      const __mmask16 nonzero = _mm512_test_epi32_mask(code[k], code[k]);
      const __mmask16 negative = _mm512_mask_test_epi32_mask(nonzero, _mm512_castps_si512(x[k]),
                                                             _mm512_set1_epi32(static_cast<int>(0x80000000u)));
      code[k] = _mm512_mask_or_epi32(code[k], negative, code[k], _mm512_set1_epi32(0x80));
    }
  }
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

// Whether quantize's reciprocal path holds for a usable scale: the scale and
// its reciprocal both normal floats (2^-126 <= scale < 2^126), so that
// 1 / scale is rounded once, as the bound there assumes.
inline bool reciprocal_holds(float scale) { return scale >= 0x1p-126f && scale < 0x1p126f; }

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
  const bool reciprocal = reciprocal_holds(scale);
  const __m512 rcp = _mm512_set1_ps(reciprocal ? 1.0f / scale : 0.0f);
  for (std::int64_t j = 0; j < kBlock; j += kInterleave * kWidth) {
    __m512 x[kInterleave];
    __m512i r[kInterleave];
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) x[k] = _mm512_load_ps(values + j + k * kWidth);
    if (reciprocal) [[likely]] {
      quantize<kExpAvg, true, true>(t, x, s, rcp, r);
    } else {
      quantize<kExpAvg, true, false>(t, x, s, rcp, r);
    }
#pragma GCC unroll 16
    for (int k = 0; k < kInterleave; ++k) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j + k * kWidth), _mm512_cvtepi32_epi8(r[k]));
    }
  }
}

// quantize_block with AVX512_VBMI (called only where avx512_vbmi_supported(),
// a function of its own like dequantize_block_vbmi): four vectors' codes
// are packed into 64 bytes by two vpermt2b, and m's sign is set on the bytes:
// the sign bytes (byte 3 of each x) packed likewise, or-ed in where the code
// is not zero.
template <bool kExpAvg>
[[gnu::target("avx512vbmi")]] void quantize_block_vbmi(const QuantKernelTables& t, const float* values, float scale,
                                                       std::uint8_t* __restrict codes) {
  if (!usable(scale)) {
    std::memset(codes, 0, kBlock);
    return;
  }
  const __m512 s = _mm512_set1_ps(scale);
  // Byte 0 of each dword of two vectors: 32 bytes (the lower half), and
  // byte 3 likewise.
  const __m512i low_bytes = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                            0, 0, 0, 0, 0, 0, 0, 0, 124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84,
                                            80, 76, 72, 68, 64, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4,
                                            0);
  const __m512i high_bytes = _mm512_add_epi8(low_bytes, _mm512_set1_epi8(3));
  const bool reciprocal = reciprocal_holds(scale);
  const __m512 rcp = _mm512_set1_ps(reciprocal ? 1.0f / scale : 0.0f);
  for (std::int64_t j = 0; j < kBlock; j += 4 * kWidth) {
    __m512 x[4];
    __m512i r[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) x[k] = _mm512_load_ps(values + j + k * kWidth);
    if (reciprocal) [[likely]] {
      quantize<kExpAvg, false, true>(t, x, s, rcp, r);
    } else {
      quantize<kExpAvg, false, false>(t, x, s, rcp, r);
    }
    const __m512i lo = _mm512_permutex2var_epi8(r[0], low_bytes, r[1]);
    const __m512i hi = _mm512_permutex2var_epi8(r[2], low_bytes, r[3]);
    __m512i packed = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
    if constexpr (kExpAvg) {
      const __m512i slo = _mm512_permutex2var_epi8(_mm512_castps_si512(x[0]), high_bytes, _mm512_castps_si512(x[1]));
      const __m512i shi = _mm512_permutex2var_epi8(_mm512_castps_si512(x[2]), high_bytes, _mm512_castps_si512(x[3]));
      const __m512i sign = _mm512_inserti64x4(slo, _mm512_castsi512_si256(shi), 1);
      const __mmask64 nonzero = _mm512_test_epi8_mask(packed, packed);
      // packed | (sign & 0x80)
      const __m512i signed_codes = _mm512_ternarylogic_epi32(packed, sign, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
      packed = _mm512_mask_mov_epi8(packed, nonzero, signed_codes);
    }
    _mm512_storeu_si512(codes + j, packed);
  }
}

// Four vectors of bytes, b[p] holding byte p of 64 values, as 64 dwords in
// four vectors: out[a] lane q of 128-bit lane L from the bytes at 16 L + 4 a + q.
inline void widen_planes(const __m512i (&b)[4], __m512 (&out)[4]) {
  const __m512i w01lo = _mm512_unpacklo_epi8(b[0], b[1]);
  const __m512i w01hi = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i w23lo = _mm512_unpacklo_epi8(b[2], b[3]);
  const __m512i w23hi = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi));
}

// numerics::dequantize_m and dequantize_v for a whole block, with AVX512_VBMI
// (called only where avx512_vbmi_supported(); a function of its own, so that
// nothing else is compiled for VBMI): 64 codes at a time, vpermi2b over the
// values' byte planes (kernels.h) gives byte p of each code's value, four
// planes give the values. The unpacks that put the bytes together work
// within 128-bit lanes, so the codes' dwords are first transposed (vector a,
// 128-bit lane L takes codes 16 a + 4 L .. + 3) and the values come out in
// element order. Then value x scale, and m's sign flipped where its code has
// 0x80 (after the product, as numerics.h does, NaN scales included).
[[gnu::target("avx512vbmi")]] void dequantize_block_vbmi(const QuantKernelTables& t,
                                                         const std::uint8_t* __restrict m_codes,
                                                         const std::uint8_t* __restrict v_codes, float m_scale,
                                                         float v_scale, float* __restrict m32,
                                                         float* __restrict v32) {
  const __m512i transpose = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512 ms = _mm512_set1_ps(m_scale);
  const __m512 vs = _mm512_set1_ps(v_scale);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (std::int64_t j = 0; j < kBlock; j += 4 * kWidth) {
    const __m512i mc = _mm512_loadu_si512(m_codes + j);
    const __m512i mi = _mm512_permutexvar_epi32(transpose, mc);
    const __mmask64 negative = _mm512_movepi8_mask(mc);
    __m512i b[4];
    __m512 x[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      b[p] = _mm512_permutex2var_epi8(_mm512_load_si512(t.m_value_bytes[p]), mi,
                                      _mm512_load_si512(t.m_value_bytes[p] + 64));
    }
    widen_planes(b, x);
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) {
      const __m512i m = _mm512_castps_si512(_mm512_mul_ps(x[a], ms));
      const __mmask16 neg = static_cast<__mmask16>(negative >> (16 * a));
      _mm512_store_ps(m32 + j + a * kWidth, _mm512_castsi512_ps(_mm512_mask_xor_epi32(m, neg, m, sign)));
    }
    const __m512i vi = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(v_codes + j));
    const __mmask64 upper = _mm512_movepi8_mask(vi);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.v_value_bytes[p]), vi,
                                                  _mm512_load_si512(t.v_value_bytes[p] + 64));
      const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.v_value_bytes[p] + 128), vi,
                                                  _mm512_load_si512(t.v_value_bytes[p] + 192));
      b[p] = _mm512_mask_blend_epi8(upper, lo, hi);
    }
    widen_planes(b, x);
#pragma GCC unroll 4
    for (int a = 0; a < 4; ++a) _mm512_store_ps(v32 + j + a * kWidth, _mm512_mul_ps(x[a], vs));
  }
}

inline __m512i load_codes(const std::uint8_t* codes, std::int64_t i) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
}

// kCopy: kF32 means "no copy-out". The pointers are copied out of the
// argument struct so the compiler knows the stores cannot change them.
// n_blocks whole blocks.
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy, bool kNativeBf16, bool kVbmi>
void loop(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  const AdamVectors k(*a.constants);
  const __mmask16 l2 = a.constants->l2_decay != 0.0f ? 0xffff : 0;
  const __mmask16 decay = a.constants->neg_lr_decay != 0.0f ? 0xffff : 0;
  const QuantKernelTables& t = quant_kernel_tables();
  float* __restrict master = a.master;
  std::uint8_t* __restrict exp_avg = a.exp_avg;
  std::uint8_t* __restrict exp_avg_sq = a.exp_avg_sq;
  float* __restrict exp_avg_scale = a.exp_avg_scale;
  float* __restrict exp_avg_sq_scale = a.exp_avg_sq_scale;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  constexpr std::int64_t kGradBytes = kGrad == ElemType::kF32 ? 4 : 2;
  alignas(64) float m32[kBlock];
  alignas(64) float v32[kBlock];
  for (std::int64_t b = 0; b < n_blocks; ++b) {
    const std::int64_t base = b * kBlock;
    const __m512 m_scale = _mm512_set1_ps(exp_avg_scale[b]);
    const __m512 v_scale = _mm512_set1_ps(exp_avg_sq_scale[b]);
    __m512i m_absmax = _mm512_setzero_si512();
    __m512i v_absmax = _mm512_setzero_si512();
    if constexpr (kVbmi) {
      dequantize_block_vbmi(t, exp_avg + base, exp_avg_sq + base, exp_avg_scale[b], exp_avg_sq_scale[b], m32, v32);
    }
    // Half of a block's time goes to quantizing, from L1, when no stream
    // asks memory for anything: the inputs of the block kPrefetchBlocks on
    // are requested now, so that memory keeps working meanwhile.
    const std::int64_t ahead = (b + kPrefetchBlocks < n_blocks ? b + kPrefetchBlocks : b) * kBlock;
#pragma GCC unroll 4
    for (std::int64_t j = 0; j < kBlock; j += kWidth) {
      const std::int64_t i = base + j;
      if (j % 64 == 0) {  // 64 elements: a line of each code array, 4 of master, 2 or 4 of grad
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg + ahead + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(exp_avg_sq + ahead + j), _MM_HINT_T0);
#pragma GCC unroll 4
        for (std::int64_t line = 0; line < 64 * kGradBytes; line += 64) {
          _mm_prefetch(static_cast<const char*>(grad) + (ahead + j) * kGradBytes + line, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (std::int64_t line = 0; line < 64; line += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(master + ahead + j + line), _MM_HINT_T0);
        }
      }
      __m512 m, v;
      if constexpr (kVbmi) {
        m = _mm512_load_ps(m32 + j);
        v = _mm512_load_ps(v32 + j);
      } else {
        m = dequantize_m(t, load_codes(exp_avg, i), m_scale);
        v = dequantize_v(t, load_codes(exp_avg_sq, i), v_scale);
      }
      __m512 p = _mm512_loadu_ps(master + i);
      adam_update_masked(k, load16<kGrad>(grad, i), p, m, v, l2, decay);
      _mm512_storeu_ps(master + i, p);
      if constexpr (kStreamCopy) {
        stream_copy<kCopy, kNativeBf16>(copy_out, i, p);
      } else if constexpr (kCopy != ElemType::kF32) {
        store16<kCopy, kNativeBf16>(copy_out, i, p);
      }
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
    if constexpr (kVbmi) {
      quantize_block_vbmi<true>(t, m32, m_new, exp_avg + base);
      quantize_block_vbmi<false>(t, v32, v_new, exp_avg_sq + base);
    } else {
      quantize_block<true>(t, m32, m_new, exp_avg + base);
      quantize_block<false>(t, v32, v_new, exp_avg_sq + base);
    }
  }
}

// The compute copy goes out with non-temporal stores when it is 32-byte
// aligned (as in adam_avx512.cpp): no read for ownership.
template <ElemType kGrad, bool kNativeBf16, bool kVbmi>
void dispatch_copy(const AdamInt8KernelArgs& a, std::int64_t n_blocks) {
  if (a.copy_out == nullptr) return loop<kGrad, ElemType::kF32, false, kNativeBf16, kVbmi>(a, n_blocks);
  const bool stream = reinterpret_cast<std::uintptr_t>(a.copy_out) % 32 == 0;
  if (a.copy_type == ElemType::kBf16) {
    stream ? loop<kGrad, ElemType::kBf16, true, kNativeBf16, kVbmi>(a, n_blocks)
           : loop<kGrad, ElemType::kBf16, false, kNativeBf16, kVbmi>(a, n_blocks);
  } else {
    stream ? loop<kGrad, ElemType::kF16, true, false, kVbmi>(a, n_blocks)
           : loop<kGrad, ElemType::kF16, false, false, kVbmi>(a, n_blocks);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

template <bool kNativeBf16, bool kVbmi>
void adam_int8(const AdamInt8KernelArgs& a) {
  const std::int64_t n_blocks = a.n / kBlock;
  switch (a.grad_type) {
    case ElemType::kF32: dispatch_copy<ElemType::kF32, kNativeBf16, kVbmi>(a, n_blocks); break;
    case ElemType::kBf16: dispatch_copy<ElemType::kBf16, kNativeBf16, kVbmi>(a, n_blocks); break;
    case ElemType::kF16: dispatch_copy<ElemType::kF16, kNativeBf16, kVbmi>(a, n_blocks); break;
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

void adam_int8_avx512(const AdamInt8KernelArgs& a) {
  if (avx512_vbmi_supported()) return adam_int8<false, true>(a);
  adam_int8<false, false>(a);
}
void adam_int8_avx512_bf16(const AdamInt8KernelArgs& a) {
  if (avx512_vbmi_supported()) return adam_int8<true, true>(a);
  adam_int8<true, false>(a);
}
void adam_int8_avx512_no_vbmi(const AdamInt8KernelArgs& a) { adam_int8<false, false>(a); }
void adam_int8_avx512_bf16_no_vbmi(const AdamInt8KernelArgs& a) { adam_int8<true, false>(a); }

}  // namespace strata::adam::kernels
