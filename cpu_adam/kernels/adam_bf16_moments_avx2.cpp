// AVX2 kernel (with FMA and F16C) of Adam with bf16 moments: 8 elements per
// vector, numerics::adam_step_bf16_moments operation for operation (widen m and
// v, the fp32 Adam step, narrow by nearest even or stochastically with the
// counter-based bits of numerics::stochastic_rounding_hash), so results match
// the scalar kernel bit for bit. Tails shorter than a vector go to the scalar
// kernel. Compiled with the AVX2 flags (cpu_adam/meson.build); called only
// after isa_supported(Isa::kAvx2).
//
// The step is compute-bound on a core (twice the instructions per element of
// the AVX-512 kernel), so the loop is kept lean: its pointers in __restrict
// locals (a 16-bit store may alias the argument struct, and the pointers and
// constants would be reloaded after each), the decay lines fixed at compile
// time, m and v packed to 16 bits together, and the compute copy streamed
// when it is aligned.
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx2.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 8;

using avx2::AdamVectors;
using avx2::load8;
using avx2::pack_u16;
using avx2::to_bf16_lanes;
using avx2::to_f16;

// numerics::hash32 (lowbias32) on 8 lanes; vpmulld keeps the low 32 bits of
// each product, as uint32_t multiplication does.
inline __m256i hash32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return x;
}

// The step's key split into the two 32-bit words the per-element hash uses.
struct KeyVectors {
  __m256i lo, hi;
};

// numerics::stochastic_rounding_hash of the 8 elements index .. index + 7.
inline __m256i rounding_hash8(const KeyVectors& key, std::uint64_t index, __m256i iota) {
  const __m256i base_lo = _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(index)));
  const __m256i lo = _mm256_add_epi32(base_lo, iota);
  // A lane whose low half wrapped (lo < base_lo, unsigned) carries 1 into the
  // high half: flip the sign bits to compare unsigned values as signed ones.
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i carry =
      _mm256_cmpgt_epi32(_mm256_xor_si256(base_lo, sign), _mm256_xor_si256(lo, sign));  // -1 or 0
  const __m256i hi = _mm256_sub_epi32(
      _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(index >> 32))), carry);
  __m256i x = hash32x8(_mm256_xor_si256(lo, key.lo));
  x = hash32x8(_mm256_xor_si256(x, _mm256_xor_si256(hi, key.hi)));
  return x;
}

// All ones in a NaN lane (one vcmpps UNORD).
inline __m256i nan_lanes(__m256 x) { return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }

// numerics::bf16_round_stochastic with the random bits in each lane's low 16
// bits, in 32-bit lanes. Infinities need no special case (their low 16 bits
// are zero, so adding fewer than 2^16 leaves them as they are, which is what
// fp32_to_bf16_bits gives); NaNs are quieted as fp32_to_bf16_bits does.
inline __m256i round_stochastic_lanes(__m256 x, __m256i rand16) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, rand16), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(rounded, quiet, nan_lanes(x));
}

// Two vectors of 32-bit lanes holding 16-bit values, packed into one: m's
// eight in the lower 128 bits, v's in the upper (packus interleaves the
// 128-bit halves; the 64-bit permute puts them back in order).
inline __m256i pack_pair(__m256i m, __m256i v) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(m, v), 0xd8);
}

// kCopy: kF32 means "no copy-out". The pointers are copied out of the
// argument struct: the 16-bit stores may alias anything, and would otherwise
// make the compiler reload them (and the constants) after every store.
// 8 lanes of numerics::adam_step with the optional lines fixed at compile
// time (vec_avx2.h's adam_update tests them per vector, and the compiler
// leaves those tests in this loop).
template <bool kL2, bool kDecay>
inline void adam_update_fixed(const AdamVectors& k, __m256 grad, __m256& p, __m256& m, __m256& v) {
  __m256 g = _mm256_mul_ps(grad, k.grad_scale);
  if constexpr (kL2) g = _mm256_fmadd_ps(p, k.l2_decay, g);
  m = _mm256_fmadd_ps(k.beta1, m, _mm256_mul_ps(k.one_minus_beta1, g));
  v = _mm256_fmadd_ps(k.beta2, v, _mm256_mul_ps(k.one_minus_beta2, _mm256_mul_ps(g, g)));
  const __m256 d = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv_sqrt_bc2, k.eps);
  const __m256 u = _mm256_div_ps(m, d);
  if constexpr (kDecay) p = _mm256_fmadd_ps(k.neg_lr_decay, p, p);
  p = _mm256_fmadd_ps(k.neg_step_size, u, p);
}

template <ElemType kGrad, ElemType kCopy, bool kStochastic, bool kStreamCopy, bool kL2, bool kDecay>
void loop(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  const AdamVectors k(*a.constants);
  const KeyVectors key{_mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(a.key))),
                       _mm256_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(a.key >> 32)))};
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  float* __restrict master = a.master;
  std::uint16_t* __restrict exp_avg = a.exp_avg;
  std::uint16_t* __restrict exp_avg_sq = a.exp_avg_sq;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const std::int64_t index_base = a.index_base;
  for (std::int64_t i = 0; i < n_vec; i += kWidth) {
    __m256 p = _mm256_loadu_ps(master + i);
    __m256 m = load8<ElemType::kBf16>(exp_avg, i);  // widen: shift left 16 (exact)
    __m256 v = load8<ElemType::kBf16>(exp_avg_sq, i);
    adam_update_fixed<kL2, kDecay>(k, load8<kGrad>(grad, i), p, m, v);
    _mm256_storeu_ps(master + i, p);
    __m256i m16, v16;
    if constexpr (kStochastic) {
      const __m256i h = rounding_hash8(key, static_cast<std::uint64_t>(index_base + i), iota);
      m16 = round_stochastic_lanes(m, _mm256_and_si256(h, low16));  // m: the low half
      v16 = round_stochastic_lanes(v, _mm256_srli_epi32(h, 16));    // v: the high half
    } else {
      m16 = to_bf16_lanes(m);
      v16 = to_bf16_lanes(v);
    }
    const __m256i mv = pack_pair(m16, v16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(exp_avg + i), _mm256_castsi256_si128(mv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(exp_avg_sq + i), _mm256_extracti128_si256(mv, 1));
    if constexpr (kCopy != ElemType::kF32) {
      const __m128i h = kCopy == ElemType::kBf16 ? pack_u16(to_bf16_lanes(p)) : to_f16(p);
      __m128i* dst = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(copy_out) + i);
      if constexpr (kStreamCopy) {
        _mm_stream_si128(dst, h);
      } else {
        _mm_storeu_si128(dst, h);
      }
    }
  }
}

// The compute copy goes out with non-temporal stores when it is 16-byte
// aligned (as in adam_avx2.cpp): no read for ownership.
template <ElemType kGrad, ElemType kCopy, bool kStochastic, bool kStreamCopy>
void dispatch_decay(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  const bool l2 = a.constants->l2_decay != 0.0f, decay = a.constants->neg_lr_decay != 0.0f;
  if (l2 && decay) return loop<kGrad, kCopy, kStochastic, kStreamCopy, true, true>(a, n_vec);
  if (l2) return loop<kGrad, kCopy, kStochastic, kStreamCopy, true, false>(a, n_vec);
  if (decay) return loop<kGrad, kCopy, kStochastic, kStreamCopy, false, true>(a, n_vec);
  loop<kGrad, kCopy, kStochastic, kStreamCopy, false, false>(a, n_vec);
}

template <ElemType kGrad, bool kStochastic>
void dispatch_copy(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  if (a.copy_out == nullptr) return dispatch_decay<kGrad, ElemType::kF32, kStochastic, false>(a, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(a.copy_out) % 16 == 0;
  if (a.copy_type == ElemType::kBf16) {
    stream ? dispatch_decay<kGrad, ElemType::kBf16, kStochastic, true>(a, n_vec)
           : dispatch_decay<kGrad, ElemType::kBf16, kStochastic, false>(a, n_vec);
  } else {
    stream ? dispatch_decay<kGrad, ElemType::kF16, kStochastic, true>(a, n_vec)
           : dispatch_decay<kGrad, ElemType::kF16, kStochastic, false>(a, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

template <bool kStochastic>
void dispatch_grad(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  switch (a.grad_type) {
    case ElemType::kF32: return dispatch_copy<ElemType::kF32, kStochastic>(a, n_vec);
    case ElemType::kBf16: return dispatch_copy<ElemType::kBf16, kStochastic>(a, n_vec);
    case ElemType::kF16: return dispatch_copy<ElemType::kF16, kStochastic>(a, n_vec);
  }
}

}  // namespace

void adam_bf16_moments_avx2(const AdamBf16MomentsKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  if (a.rounding == core::numerics::Bf16Rounding::kStochastic) {
    dispatch_grad<true>(a, n_vec);
  } else {
    dispatch_grad<false>(a, n_vec);
  }
  if (n_vec == a.n) return;
  AdamBf16MomentsKernelArgs tail = a;
  tail.master += n_vec;
  tail.exp_avg += n_vec;
  tail.exp_avg_sq += n_vec;
  tail.grad = static_cast<const std::byte*>(a.grad) + n_vec * elem_size_bytes(a.grad_type);
  if (a.copy_out != nullptr) {
    tail.copy_out = static_cast<std::byte*>(a.copy_out) + n_vec * elem_size_bytes(a.copy_type);
  }
  tail.index_base = a.index_base + n_vec;
  tail.n = a.n - n_vec;
  scalar_kernels().adam_bf16_moments(tail);
}

}  // namespace strata::adam::kernels
