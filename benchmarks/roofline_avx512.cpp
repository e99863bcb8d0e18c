// Streaming yardsticks (AVX-512): the fused step's access pattern with trivial
// arithmetic, and STREAM triad.
#include <immintrin.h>

#include <cstdint>

#include "benchmarks/roofline.h"

namespace strata::bench {
namespace {

// 16 elements of the pattern: the fused step's loads and stores, trivial arithmetic.
template <bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
inline void pattern16(float* __restrict master, float* __restrict exp_avg, float* __restrict exp_avg_sq,
                      const void* __restrict grad, std::uint16_t* __restrict copy_out, std::int64_t i) {
  __m512 g;
  if constexpr (kBf16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(grad) + i));
    g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    g = _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  }
  const __m512 p = _mm512_add_ps(_mm512_loadu_ps(master + i), g);
  const __m512 m = _mm512_add_ps(_mm512_loadu_ps(exp_avg + i), g);
  const __m512 v = _mm512_add_ps(_mm512_loadu_ps(exp_avg_sq + i), g);
  if constexpr (kNt) {
    _mm512_stream_ps(master + i, p);
    _mm512_stream_ps(exp_avg + i, m);
    _mm512_stream_ps(exp_avg_sq + i, v);
  } else {
    _mm512_storeu_ps(master + i, p);
    _mm512_storeu_ps(exp_avg + i, m);
    _mm512_storeu_ps(exp_avg_sq + i, v);
  }
  if constexpr (kCopy) {
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    if constexpr (kNtCopy) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(copy_out + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(copy_out + i), h);
    }
  }
}

// 8 elements of the pattern with 256-bit vectors (LoopShape::kYmm).
template <bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
inline void pattern8(float* __restrict master, float* __restrict exp_avg, float* __restrict exp_avg_sq,
                     const void* __restrict grad, std::uint16_t* __restrict copy_out, std::int64_t i) {
  __m256 g;
  if constexpr (kBf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grad) + i));
    g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    g = _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  }
  const __m256 p = _mm256_add_ps(_mm256_loadu_ps(master + i), g);
  const __m256 m = _mm256_add_ps(_mm256_loadu_ps(exp_avg + i), g);
  const __m256 v = _mm256_add_ps(_mm256_loadu_ps(exp_avg_sq + i), g);
  if constexpr (kNt) {
    _mm256_stream_ps(master + i, p);
    _mm256_stream_ps(exp_avg + i, m);
    _mm256_stream_ps(exp_avg_sq + i, v);
  } else {
    _mm256_storeu_ps(master + i, p);
    _mm256_storeu_ps(exp_avg + i, m);
    _mm256_storeu_ps(exp_avg_sq + i, v);
  }
  if constexpr (kCopy) {
    const __m128i h = _mm256_cvtepi32_epi16(_mm256_srli_epi32(_mm256_castps_si256(p), 16));
    if constexpr (kNtCopy) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(copy_out + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(copy_out + i), h);
    }
  }
}

// Software prefetches `kAhead` bytes ahead of element i on every read stream
// (once per 64-byte line of the fp32 arrays).
template <bool kBf16>
inline void prefetch_ahead(const float* master, const float* exp_avg, const float* exp_avg_sq, const void* grad,
                           std::int64_t i) {
  constexpr int kAhead = 1024;
  _mm_prefetch(reinterpret_cast<const char*>(master + i) + kAhead, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(exp_avg + i) + kAhead, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(exp_avg_sq + i) + kAhead, _MM_HINT_T0);
  if constexpr (kBf16) {
    if (i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(static_cast<const std::uint16_t*>(grad) + i) + kAhead, _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(static_cast<const float*>(grad) + i) + kAhead, _MM_HINT_T0);
  }
}

// Shaped like the fused step's loop (restrict locals, two vectors per
// iteration) so the yardstick is not handicapped by reloads the step avoids.
template <bool kBf16, bool kCopy, bool kNt, bool kNtCopy, LoopShape kShape>
void pattern(const PatternArrays& a) {
  float* __restrict master = a.master;
  float* __restrict exp_avg = a.exp_avg;
  float* __restrict exp_avg_sq = a.exp_avg_sq;
  const void* __restrict grad = a.grad;
  std::uint16_t* __restrict copy_out = a.copy_out;
  const std::int64_t n = a.n - a.n % 16;
  const std::int64_t n_pair = n - n % 32;
  std::int64_t i = 0;
  if constexpr (kShape == LoopShape::kYmm) {
    for (; i < n; i += 16) {
      pattern8<kBf16, kCopy, kNt, kNtCopy>(master, exp_avg, exp_avg_sq, grad, copy_out, i);
      pattern8<kBf16, kCopy, kNt, kNtCopy>(master, exp_avg, exp_avg_sq, grad, copy_out, i + 8);
    }
  } else {
    for (; i < n_pair; i += 32) {
      if constexpr (kShape == LoopShape::kZmmPrefetch) {
        prefetch_ahead<kBf16>(master, exp_avg, exp_avg_sq, grad, i);
        prefetch_ahead<kBf16>(master, exp_avg, exp_avg_sq, grad, i + 16);
      }
      pattern16<kBf16, kCopy, kNt, kNtCopy>(master, exp_avg, exp_avg_sq, grad, copy_out, i);
      pattern16<kBf16, kCopy, kNt, kNtCopy>(master, exp_avg, exp_avg_sq, grad, copy_out, i + 16);
    }
    for (; i < n; i += 16) pattern16<kBf16, kCopy, kNt, kNtCopy>(master, exp_avg, exp_avg_sq, grad, copy_out, i);
  }
  if constexpr (kNt || kNtCopy) _mm_sfence();
}

template <bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
void pattern_shape(const PatternArrays& a, LoopShape shape) {
  switch (shape) {
    case LoopShape::kZmm: return pattern<kBf16, kCopy, kNt, kNtCopy, LoopShape::kZmm>(a);
    case LoopShape::kZmmPrefetch: return pattern<kBf16, kCopy, kNt, kNtCopy, LoopShape::kZmmPrefetch>(a);
    case LoopShape::kYmm: return pattern<kBf16, kCopy, kNt, kNtCopy, LoopShape::kYmm>(a);
  }
}

template <bool kBf16, bool kCopy>
void pattern_stores(const PatternArrays& a, StoreKind stores, LoopShape shape) {
  switch (stores) {
    case StoreKind::kOrdinary: return pattern_shape<kBf16, kCopy, false, false>(a, shape);
    case StoreKind::kNontemporal: return pattern_shape<kBf16, kCopy, true, true>(a, shape);
    case StoreKind::kMixed: return pattern_shape<kBf16, kCopy, false, true>(a, shape);
  }
}

}  // namespace

void stream_pattern_avx512(const PatternArrays& a, StoreKind stores, LoopShape shape) {
  const bool copy = a.copy_out != nullptr;
  if (a.grad_bf16) {
    return copy ? pattern_stores<true, true>(a, stores, shape) : pattern_stores<true, false>(a, stores, shape);
  }
  return copy ? pattern_stores<false, true>(a, stores, shape) : pattern_stores<false, false>(a, stores, shape);
}

void stream_triad_avx512(float* a, const float* b, const float* c, float s, std::int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  const std::int64_t nv = n - n % 16;
  for (std::int64_t i = 0; i < nv; i += 16) {
    _mm512_storeu_ps(a + i, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
  }
}

}  // namespace strata::bench
