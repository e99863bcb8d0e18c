// Streaming yardsticks (AVX-512): the fused steps' access patterns (fp32,
// bf16 or 8-bit moments) with trivial arithmetic, and STREAM triad.
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

namespace {

// The compact-moment patterns (CompactPatternArrays): the fp32 master, the
// gradient and the copy as in pattern16/pattern8, the moments kMomentBytes
// wide with a trivial integer add, and for 8-bit moments the two scales of
// each block of 256 read and written once per block.

template <bool kBf16>
inline __m512 grad16(const void* grad, std::int64_t i) {
  if constexpr (kBf16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const std::uint16_t*>(grad) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

template <bool kBf16>
inline __m256 grad8(const void* grad, std::int64_t i) {
  if constexpr (kBf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  }
}

// 16 moments of kMomentBytes at element i: load, add 1 to each, store.
template <int kMomentBytes, bool kNt>
inline void moments16(std::uint8_t* __restrict x, std::int64_t i) {
  if constexpr (kMomentBytes == 2) {
    auto* at = reinterpret_cast<__m256i*>(x + 2 * i);
    const __m256i y = _mm256_add_epi16(_mm256_loadu_si256(at), _mm256_set1_epi16(1));
    if constexpr (kNt) {
      _mm256_stream_si256(at, y);
    } else {
      _mm256_storeu_si256(at, y);
    }
  } else {
    auto* at = reinterpret_cast<__m128i*>(x + i);
    const __m128i y = _mm_add_epi8(_mm_loadu_si128(at), _mm_set1_epi8(1));
    if constexpr (kNt) {
      _mm_stream_si128(at, y);
    } else {
      _mm_storeu_si128(at, y);
    }
  }
}

// 8 moments of kMomentBytes at element i (LoopShape::kYmm).
template <int kMomentBytes, bool kNt>
inline void moments8(std::uint8_t* __restrict x, std::int64_t i) {
  if constexpr (kMomentBytes == 2) {
    auto* at = reinterpret_cast<__m128i*>(x + 2 * i);
    const __m128i y = _mm_add_epi16(_mm_loadu_si128(at), _mm_set1_epi16(1));
    if constexpr (kNt) {
      _mm_stream_si128(at, y);
    } else {
      _mm_storeu_si128(at, y);
    }
  } else {
    auto* at = reinterpret_cast<__m128i*>(x + i);
    const __m128i y = _mm_add_epi8(_mm_loadl_epi64(at), _mm_set1_epi8(1));
    if constexpr (kNt) {
      _mm_stream_si64(reinterpret_cast<long long*>(x + i), _mm_cvtsi128_si64(y));
    } else {
      _mm_storel_epi64(at, y);
    }
  }
}

struct CompactPointers {
  float* __restrict master;
  std::uint8_t* __restrict exp_avg;
  std::uint8_t* __restrict exp_avg_sq;
  float* __restrict exp_avg_scale;
  float* __restrict exp_avg_sq_scale;
  const void* __restrict grad;
  std::uint16_t* __restrict copy_out;
};

template <int kMomentBytes, bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
inline void compact16(const CompactPointers& a, std::int64_t i) {
  const __m512 p = _mm512_add_ps(_mm512_loadu_ps(a.master + i), grad16<kBf16>(a.grad, i));
  moments16<kMomentBytes, kNt>(a.exp_avg, i);
  moments16<kMomentBytes, kNt>(a.exp_avg_sq, i);
  if constexpr (kNt) {
    _mm512_stream_ps(a.master + i, p);
  } else {
    _mm512_storeu_ps(a.master + i, p);
  }
  if constexpr (kCopy) {
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
    if constexpr (kNtCopy) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(a.copy_out + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.copy_out + i), h);
    }
  }
}

template <int kMomentBytes, bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
inline void compact8(const CompactPointers& a, std::int64_t i) {
  const __m256 p = _mm256_add_ps(_mm256_loadu_ps(a.master + i), grad8<kBf16>(a.grad, i));
  moments8<kMomentBytes, kNt>(a.exp_avg, i);
  moments8<kMomentBytes, kNt>(a.exp_avg_sq, i);
  if constexpr (kNt) {
    _mm256_stream_ps(a.master + i, p);
  } else {
    _mm256_storeu_ps(a.master + i, p);
  }
  if constexpr (kCopy) {
    const __m128i h = _mm256_cvtepi32_epi16(_mm256_srli_epi32(_mm256_castps_si256(p), 16));
    if constexpr (kNtCopy) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(a.copy_out + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.copy_out + i), h);
    }
  }
}

// The scales of the block that starts at element i (8-bit moments only).
template <int kMomentBytes>
inline void scales_at(const CompactPointers& a, std::int64_t i) {
  if constexpr (kMomentBytes == 1) {
    if (i % 256 == 0) {
      a.exp_avg_scale[i / 256] = a.exp_avg_scale[i / 256] + 1.0f;
      a.exp_avg_sq_scale[i / 256] = a.exp_avg_sq_scale[i / 256] + 1.0f;
    }
  }
}

// Software prefetches 1 KiB ahead on every read stream, once per 64-byte line.
template <int kMomentBytes, bool kBf16>
inline void compact_prefetch(const CompactPointers& a, std::int64_t i) {
  constexpr int kAhead = 1024;
  _mm_prefetch(reinterpret_cast<const char*>(a.master + i) + kAhead, _MM_HINT_T0);
  if (kBf16 ? i % 32 == 0 : true) {
    _mm_prefetch(static_cast<const char*>(a.grad) + i * (kBf16 ? 2 : 4) + kAhead, _MM_HINT_T0);
  }
  if (i % (64 / kMomentBytes) == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(a.exp_avg + i * kMomentBytes) + kAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a.exp_avg_sq + i * kMomentBytes) + kAhead, _MM_HINT_T0);
  }
}

template <int kMomentBytes, bool kBf16, bool kCopy, bool kNt, bool kNtCopy, LoopShape kShape>
void compact(const CompactPatternArrays& in) {
  const CompactPointers a{in.master,
                          static_cast<std::uint8_t*>(in.exp_avg),
                          static_cast<std::uint8_t*>(in.exp_avg_sq),
                          in.exp_avg_scale,
                          in.exp_avg_sq_scale,
                          in.grad,
                          in.copy_out};
  const std::int64_t n = in.n - in.n % 16;
  const std::int64_t n_pair = n - n % 32;
  std::int64_t i = 0;
  if constexpr (kShape == LoopShape::kYmm) {
    for (; i < n; i += 16) {
      scales_at<kMomentBytes>(a, i);
      compact8<kMomentBytes, kBf16, kCopy, kNt, kNtCopy>(a, i);
      compact8<kMomentBytes, kBf16, kCopy, kNt, kNtCopy>(a, i + 8);
    }
  } else {
    for (; i < n_pair; i += 32) {
      scales_at<kMomentBytes>(a, i);
      if constexpr (kShape == LoopShape::kZmmPrefetch) {
        compact_prefetch<kMomentBytes, kBf16>(a, i);
        compact_prefetch<kMomentBytes, kBf16>(a, i + 16);
      }
      compact16<kMomentBytes, kBf16, kCopy, kNt, kNtCopy>(a, i);
      compact16<kMomentBytes, kBf16, kCopy, kNt, kNtCopy>(a, i + 16);
    }
    for (; i < n; i += 16) {
      scales_at<kMomentBytes>(a, i);
      compact16<kMomentBytes, kBf16, kCopy, kNt, kNtCopy>(a, i);
    }
  }
  if constexpr (kNt || kNtCopy) _mm_sfence();
}

template <int kMomentBytes, bool kBf16, bool kCopy, bool kNt, bool kNtCopy>
void compact_shape(const CompactPatternArrays& a, LoopShape shape) {
  switch (shape) {
    case LoopShape::kZmm: return compact<kMomentBytes, kBf16, kCopy, kNt, kNtCopy, LoopShape::kZmm>(a);
    case LoopShape::kZmmPrefetch: return compact<kMomentBytes, kBf16, kCopy, kNt, kNtCopy, LoopShape::kZmmPrefetch>(a);
    case LoopShape::kYmm: return compact<kMomentBytes, kBf16, kCopy, kNt, kNtCopy, LoopShape::kYmm>(a);
  }
}

template <int kMomentBytes, bool kBf16, bool kCopy>
void compact_stores(const CompactPatternArrays& a, StoreKind stores, LoopShape shape) {
  switch (stores) {
    case StoreKind::kOrdinary: return compact_shape<kMomentBytes, kBf16, kCopy, false, false>(a, shape);
    case StoreKind::kNontemporal: return compact_shape<kMomentBytes, kBf16, kCopy, true, true>(a, shape);
    case StoreKind::kMixed: return compact_shape<kMomentBytes, kBf16, kCopy, false, true>(a, shape);
  }
}

template <int kMomentBytes>
void compact_moments(const CompactPatternArrays& a, StoreKind stores, LoopShape shape) {
  const bool copy = a.copy_out != nullptr;
  if (a.grad_bf16) {
    return copy ? compact_stores<kMomentBytes, true, true>(a, stores, shape)
                : compact_stores<kMomentBytes, true, false>(a, stores, shape);
  }
  return copy ? compact_stores<kMomentBytes, false, true>(a, stores, shape)
              : compact_stores<kMomentBytes, false, false>(a, stores, shape);
}

}  // namespace

void stream_compact_pattern_avx512(const CompactPatternArrays& a, StoreKind stores, LoopShape shape) {
  if (a.moment_bytes == 2) return compact_moments<2>(a, stores, shape);
  return compact_moments<1>(a, stores, shape);
}

void stream_triad_avx512(float* a, const float* b, const float* c, float s, std::int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  const std::int64_t nv = n - n % 16;
  for (std::int64_t i = 0; i < nv; i += 16) {
    _mm512_storeu_ps(a + i, _mm512_fmadd_ps(vs, _mm512_loadu_ps(c + i), _mm512_loadu_ps(b + i)));
  }
}

}  // namespace strata::bench
