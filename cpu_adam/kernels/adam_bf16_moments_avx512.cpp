// AVX-512 kernels (F, BW, VL, DQ, plus F16C/FMA) of Adam with bf16 moments: 16
// elements per vector, numerics::adam_step_bf16_moments operation for
// operation (widen m and v, the fp32 Adam step, narrow by nearest even or
// stochastically with the counter-based bits of
// numerics::stochastic_rounding_hash), so results match the scalar kernel bit
// for bit. Tails shorter than a vector go to the scalar kernel. The
// avx512_bf16 entry point is the same loop with the hardware nearest-even
// conversion (vec_avx512.h's to_bf16<true>) for the moments and the compute
// copy. The compute copy, written and not read, goes out with non-temporal
// stores when it is 32-byte aligned (as the fp32 kernel's: no read for
// ownership), the moments, read first, with ordinary ones. Compiled with the
// AVX-512 flags (cpu_adam/meson.build); called only after
// isa_supported(Isa::kAvx512) (kAvx512Bf16 for the second entry point).
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"
#include "cpu_adam/kernels/vec_avx512.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 16;

using avx512::AdamVectors;
using avx512::adam_update;
using avx512::load16;
using avx512::store16;
using avx512::stream_copy;
using avx512::to_bf16;

// numerics::hash32 (lowbias32) on 16 lanes; vpmulld keeps the low 32 bits of
// each product, as uint32_t multiplication does.
inline __m512i hash32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return x;
}

// The step's key split into the two 32-bit words the per-element hash uses.
struct KeyVectors {
  __m512i lo, hi;
};

// numerics::stochastic_rounding_hash of the 16 elements index .. index + 15.
inline __m512i rounding_hash16(const KeyVectors& key, std::uint64_t index, __m512i iota) {
  const __m512i base_lo = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(index)));
  const __m512i lo = _mm512_add_epi32(base_lo, iota);
  // A lane whose low half wrapped (lo < base_lo, unsigned) carries 1 into the high half.
  const __mmask16 carry = _mm512_cmplt_epu32_mask(lo, base_lo);
  const __m512i base_hi = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(index >> 32)));
  const __m512i hi = _mm512_mask_add_epi32(base_hi, carry, base_hi, _mm512_set1_epi32(1));
  __m512i x = hash32x16(_mm512_xor_si512(lo, key.lo));
  x = hash32x16(_mm512_xor_si512(x, _mm512_xor_si512(hi, key.hi)));
  return x;
}

// numerics::bf16_round_stochastic with the random bits in each lane's low 16
// bits, packed to 16 bits. Infinities need no special case (their low 16 bits
// are zero, so adding fewer than 2^16 leaves them as they are, which is what
// fp32_to_bf16_bits gives); NaNs are quieted as fp32_to_bf16_bits does.
inline __m256i round_stochastic(__m512 x, __m512i rand16) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, rand16), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// kCopy: kF32 means "no copy-out". The pointers are copied out of the
// argument struct so the compiler knows the stores cannot change them.
template <ElemType kGrad, ElemType kCopy, bool kStreamCopy, bool kStochastic, bool kNativeBf16>
void loop(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  const AdamVectors k(*a.constants);
  const bool has_l2 = a.constants->l2_decay != 0.0f;
  const bool has_decay = a.constants->neg_lr_decay != 0.0f;
  float* __restrict master = a.master;
  std::uint16_t* __restrict exp_avg = a.exp_avg;
  std::uint16_t* __restrict exp_avg_sq = a.exp_avg_sq;
  const void* __restrict grad = a.grad;
  void* __restrict copy_out = a.copy_out;
  const KeyVectors key{_mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(a.key))),
                       _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(a.key >> 32)))};
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  for (std::int64_t i = 0; i < n_vec; i += kWidth) {
    __m512 p = _mm512_loadu_ps(master + i);
    __m512 m = load16<ElemType::kBf16>(exp_avg, i);  // widen: shift left 16 (exact)
    __m512 v = load16<ElemType::kBf16>(exp_avg_sq, i);
    adam_update(k, load16<kGrad>(grad, i), p, m, v, has_l2, has_decay);
    _mm512_storeu_ps(master + i, p);
    __m256i m16, v16;
    if constexpr (kStochastic) {
      const __m512i h = rounding_hash16(key, static_cast<std::uint64_t>(a.index_base + i), iota);
      m16 = round_stochastic(m, _mm512_and_si512(h, low16));  // m: the low half
      v16 = round_stochastic(v, _mm512_srli_epi32(h, 16));    // v: the high half
    } else {
      m16 = to_bf16<kNativeBf16>(m);
      v16 = to_bf16<kNativeBf16>(v);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg + i), m16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(exp_avg_sq + i), v16);
    if constexpr (kCopy != ElemType::kF32) {
      if constexpr (kStreamCopy) {
        stream_copy<kCopy, kNativeBf16>(copy_out, i, p);
      } else {
        store16<kCopy, kNativeBf16>(copy_out, i, p);
      }
    }
  }
}

template <ElemType kGrad, bool kStochastic, bool kNativeBf16>
void dispatch_copy(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  if (a.copy_out == nullptr) return loop<kGrad, ElemType::kF32, false, kStochastic, kNativeBf16>(a, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(a.copy_out) % 32 == 0;
  if (a.copy_type == ElemType::kBf16) {
    stream ? loop<kGrad, ElemType::kBf16, true, kStochastic, kNativeBf16>(a, n_vec)
           : loop<kGrad, ElemType::kBf16, false, kStochastic, kNativeBf16>(a, n_vec);
  } else {
    stream ? loop<kGrad, ElemType::kF16, true, kStochastic, kNativeBf16>(a, n_vec)
           : loop<kGrad, ElemType::kF16, false, kStochastic, kNativeBf16>(a, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

template <bool kStochastic, bool kNativeBf16>
void dispatch_grad(const AdamBf16MomentsKernelArgs& a, std::int64_t n_vec) {
  switch (a.grad_type) {
    case ElemType::kF32: return dispatch_copy<ElemType::kF32, kStochastic, kNativeBf16>(a, n_vec);
    case ElemType::kBf16: return dispatch_copy<ElemType::kBf16, kStochastic, kNativeBf16>(a, n_vec);
    case ElemType::kF16: return dispatch_copy<ElemType::kF16, kStochastic, kNativeBf16>(a, n_vec);
  }
}

template <bool kNativeBf16>
void adam_bf16_moments(const AdamBf16MomentsKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  if (a.rounding == core::numerics::Bf16Rounding::kStochastic) {
    dispatch_grad<true, kNativeBf16>(a, n_vec);
  } else {
    dispatch_grad<false, kNativeBf16>(a, n_vec);
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

}  // namespace

void adam_bf16_moments_avx512(const AdamBf16MomentsKernelArgs& a) { adam_bf16_moments<false>(a); }
void adam_bf16_moments_avx512_bf16(const AdamBf16MomentsKernelArgs& a) { adam_bf16_moments<true>(a); }

}  // namespace strata::adam::kernels
