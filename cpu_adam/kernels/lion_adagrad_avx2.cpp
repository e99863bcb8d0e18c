// AVX2 Lion and Adagrad kernels (with FMA and F16C): 8 floats per vector,
// numerics::lion_step and numerics::adagrad_step operation for operation, so
// results match the scalar kernels bit for bit. Tails shorter than a vector go
// to the scalar kernels. Compiled in the AVX2 library (cpu_adam/meson.build);
// called only after isa_supported(Isa::kAvx2).
//
// A file of its own, apart from adam_avx2.cpp, so that these loops do not
// change how the compiler inlines Adam's. The loads and conversions below are
// adam_avx2.cpp's (the vector files share no header: <immintrin.h> stays in
// the kernel .cpp files); the tests hold both to numerics.h's bits.
#include <immintrin.h>

#include <cstdint>

#include "cpu_adam/kernels/kernels.h"

namespace strata::adam::kernels {
namespace {

constexpr std::int64_t kWidth = 8;

// --- loads and the compute copy ---------------------------------------------------

// 8 elements of the given type, widened to fp32 (exact; subnormals kept, DAZ is off).
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
      return _mm256_cvtph_ps(h);
    }
  }
}

// numerics::fp32_to_bf16_bits on the bit pattern: round to nearest even by
// adding 0x7fff plus the kept lsb; NaNs quieted with their payload's top bits.
inline __m128i to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  // abs < 2^31, so the signed compare is the unsigned one.
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x0040));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // Every value fits 16 bits, so unsigned saturation packs without change.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Writes 8 elements of the compute copy (kCopy == kF32: no copy). Aligned
// destinations take non-temporal stores (the copy is not read again here);
// the bits are the same either way. F16C's conversion rounds to nearest even
// and keeps subnormals (FTZ is off), as numerics::fp32_to_fp16_bits does.
template <ElemType kCopy, bool kStream>
inline void copy8(void* __restrict copy_out, std::int64_t i, __m256 p) {
  if constexpr (kCopy != ElemType::kF32) {
    const __m128i h = kCopy == ElemType::kBf16
                          ? to_bf16(p)
                          : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    auto* dst = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(copy_out) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
}

// --- one loop for both optimizers ----------------------------------------------------
//
// An update object (Lion8, Adagrad8) holds the pointers and the constants,
// updates 8 elements of the master and its state at i, and returns the new
// master for the compute copy. It is taken by value and its call forced
// inline, so the constants stay in registers and no store can make the
// compiler reload a pointer. The optional decay line is a template flag:
// numerics.h runs it only when its constant is non-zero, and so must every
// kernel (with a zero constant it would still change the sign of some zeros).

template <class Update, ElemType kCopy, bool kStream>
void update_loop(const Update update, void* __restrict copy_out, std::int64_t n_vec) {
  for (std::int64_t i = 0; i < n_vec; i += kWidth) copy8<kCopy, kStream>(copy_out, i, update(i));
}

template <class Update>
void update_dispatch_copy(const Update& update, void* copy_out, ElemType copy_type, std::int64_t n_vec) {
  if (copy_out == nullptr) return update_loop<Update, ElemType::kF32, false>(update, nullptr, n_vec);
  const bool stream = reinterpret_cast<std::uintptr_t>(copy_out) % 16 == 0;
  if (copy_type == ElemType::kBf16) {
    stream ? update_loop<Update, ElemType::kBf16, true>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kBf16, false>(update, copy_out, n_vec);
  } else {
    stream ? update_loop<Update, ElemType::kF16, true>(update, copy_out, n_vec)
           : update_loop<Update, ElemType::kF16, false>(update, copy_out, n_vec);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the caller reads or hands off the copy
}

// The arguments of the elements after the last whole vector, for the scalar
// kernel; the caller advances its state array.
template <class Args>
Args tail_args(const Args& a, std::int64_t n_vec) {
  Args tail = a;
  tail.master += n_vec;
  tail.grad = static_cast<const std::byte*>(a.grad) + n_vec * elem_size_bytes(a.grad_type);
  if (a.copy_out != nullptr) {
    tail.copy_out = static_cast<std::byte*>(a.copy_out) + n_vec * elem_size_bytes(a.copy_type);
  }
  tail.n = a.n - n_vec;
  return tail;
}

// --- Lion ------------------------------------------------------------------------------

// numerics::sign_f32, 8 wide: +-1 from the sign bit, +0 where c is a zero, c
// itself where it is a NaN.
inline __m256 sign8(__m256 c) {
  const __m256 unit = _mm256_or_ps(_mm256_and_ps(c, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
  const __m256 zero = _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 nan = _mm256_cmp_ps(c, c, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_andnot_ps(zero, unit), c, nan);
}

template <ElemType kGrad, bool kDecay>
class Lion8 {
 public:
  explicit Lion8(const LionKernelArgs& a)
      : master_(a.master),
        exp_avg_(a.exp_avg),
        grad_(a.grad),
        grad_scale_(_mm256_set1_ps(a.constants->grad_scale)),
        beta1_(_mm256_set1_ps(a.constants->beta1)),
        beta2_(_mm256_set1_ps(a.constants->beta2)),
        one_minus_beta1_(_mm256_set1_ps(a.constants->one_minus_beta1)),
        one_minus_beta2_(_mm256_set1_ps(a.constants->one_minus_beta2)),
        neg_lr_(_mm256_set1_ps(a.constants->neg_lr)),
        neg_lr_decay_(_mm256_set1_ps(a.constants->neg_lr_decay)) {}

  // 8 elements of numerics::lion_step.
  [[gnu::always_inline]] inline __m256 operator()(std::int64_t i) const {
    __m256 p = _mm256_loadu_ps(master_ + i);
    __m256 m = _mm256_loadu_ps(exp_avg_ + i);
    const __m256 g = _mm256_mul_ps(load8<kGrad>(grad_, i), grad_scale_);
    const __m256 s = sign8(_mm256_fmadd_ps(beta1_, m, _mm256_mul_ps(one_minus_beta1_, g)));
    if constexpr (kDecay) p = _mm256_fmadd_ps(neg_lr_decay_, p, p);
    p = _mm256_fmadd_ps(neg_lr_, s, p);
    m = _mm256_fmadd_ps(beta2_, m, _mm256_mul_ps(one_minus_beta2_, g));
    _mm256_storeu_ps(master_ + i, p);
    _mm256_storeu_ps(exp_avg_ + i, m);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_;
  const void* __restrict grad_;
  __m256 grad_scale_, beta1_, beta2_, one_minus_beta1_, one_minus_beta2_, neg_lr_, neg_lr_decay_;
};

template <ElemType kGrad>
void lion_dispatch(const LionKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->neg_lr_decay != 0.0f) {
    update_dispatch_copy(Lion8<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy(Lion8<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

// --- Adagrad ---------------------------------------------------------------------------

template <ElemType kGrad, bool kDecay>
class Adagrad8 {
 public:
  explicit Adagrad8(const AdagradKernelArgs& a)
      : master_(a.master),
        exp_avg_sq_(a.exp_avg_sq),
        grad_(a.grad),
        grad_scale_(_mm256_set1_ps(a.constants->grad_scale)),
        eps_(_mm256_set1_ps(a.constants->eps)),
        neg_lr_(_mm256_set1_ps(a.constants->neg_lr)),
        l2_decay_(_mm256_set1_ps(a.constants->l2_decay)) {}

  // 8 elements of numerics::adagrad_step.
  [[gnu::always_inline]] inline __m256 operator()(std::int64_t i) const {
    __m256 p = _mm256_loadu_ps(master_ + i);
    __m256 v = _mm256_loadu_ps(exp_avg_sq_ + i);
    __m256 g = _mm256_mul_ps(load8<kGrad>(grad_, i), grad_scale_);
    if constexpr (kDecay) g = _mm256_fmadd_ps(p, l2_decay_, g);
    v = _mm256_fmadd_ps(g, g, v);
    const __m256 d = _mm256_add_ps(_mm256_sqrt_ps(v), eps_);
    p = _mm256_fmadd_ps(neg_lr_, _mm256_div_ps(g, d), p);
    _mm256_storeu_ps(master_ + i, p);
    _mm256_storeu_ps(exp_avg_sq_ + i, v);
    return p;
  }

 private:
  float* __restrict master_;
  float* __restrict exp_avg_sq_;
  const void* __restrict grad_;
  __m256 grad_scale_, eps_, neg_lr_, l2_decay_;
};

template <ElemType kGrad>
void adagrad_dispatch(const AdagradKernelArgs& a, std::int64_t n_vec) {
  if (a.constants->l2_decay != 0.0f) {
    update_dispatch_copy(Adagrad8<kGrad, true>(a), a.copy_out, a.copy_type, n_vec);
  } else {
    update_dispatch_copy(Adagrad8<kGrad, false>(a), a.copy_out, a.copy_type, n_vec);
  }
}

}  // namespace

void lion_avx2(const LionKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: lion_dispatch<ElemType::kF32>(a, n_vec); break;
    case ElemType::kBf16: lion_dispatch<ElemType::kBf16>(a, n_vec); break;
    case ElemType::kF16: lion_dispatch<ElemType::kF16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  LionKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg += n_vec;
  scalar_kernels().lion(tail);
}

void adagrad_avx2(const AdagradKernelArgs& a) {
  const std::int64_t n_vec = a.n - a.n % kWidth;
  switch (a.grad_type) {
    case ElemType::kF32: adagrad_dispatch<ElemType::kF32>(a, n_vec); break;
    case ElemType::kBf16: adagrad_dispatch<ElemType::kBf16>(a, n_vec); break;
    case ElemType::kF16: adagrad_dispatch<ElemType::kF16>(a, n_vec); break;
  }
  if (n_vec == a.n) return;
  AdagradKernelArgs tail = tail_args(a, n_vec);
  tail.exp_avg_sq += n_vec;
  scalar_kernels().adagrad(tail);
}

}  // namespace strata::adam::kernels
