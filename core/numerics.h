// The numerics contract (DESIGN.md section 6), written once so that C++ and
// CUDA compile the same text: the scalar Adam/AdamW, Lion and Adagrad steps,
// Adam with bf16 moments and its stochastic rounding, Adam with 8-bit
// blockwise moments and its code tables, fp32 <-> bf16/fp16
// conversion, and the fixed summation order of the gradient norm.
//
// Every kernel (scalar, AVX2, AVX-512, the host device, CUDA) performs exactly
// these operations in exactly this order, with fused multiply-adds where this
// file calls fma and nowhere else. Build with -ffp-contract=off (nvcc
// --fmad=false), never with fast-math, never with flush-to-zero. Then results
// are bit-identical for finite inputs wherever they run. Where a result is
// NaN every kernel produces a NaN, but its sign and payload are not part of
// the contract (x86 and CUDA generate different default NaNs); the engine
// never commits a step whose gradients were not finite.
#pragma once

#include <cstdint>

#include <bit>
#include <cmath>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata::core::numerics {

// ---------------------------------------------------------------------------
// Bit casts and the IEEE operations the contract uses.
// ---------------------------------------------------------------------------

STRATA_HD std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}

STRATA_HD float float_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// Correctly rounded (IEEE 754) single-precision operations.
STRATA_HD float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
STRATA_HD float sqrt_f32(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
STRATA_HD float div_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
STRATA_HD float mul_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
STRATA_HD float add_f32(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// +1 for x > 0, -1 for x < 0, +0 for either zero, x itself for a NaN (the
// values of torch.sign; the sign and payload of the NaN are outside the
// contract). Exact.
STRATA_HD float sign_f32(float x) {
  if (x > 0.0f) return 1.0f;
  if (x < 0.0f) return -1.0f;
  if (x == 0.0f) return 0.0f;
  return x;
}

STRATA_HD bool is_finite_bits(std::uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }

// ---------------------------------------------------------------------------
// fp32 <-> bf16. bf16 is the upper half of an fp32.
// ---------------------------------------------------------------------------

// Round to nearest, ties to even, on the bit pattern. Subnormals are kept
// (never flushed); values past the largest bf16 round to infinity; a NaN
// becomes a quiet NaN with its sign and the upper bits of its payload.
STRATA_HD std::uint16_t fp32_to_bf16_bits(float x) {
  std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<std::uint16_t>(u >> 16);
}

// Exact.
STRATA_HD float bf16_bits_to_fp32(std::uint16_t h) {
  return float_from_bits(static_cast<std::uint32_t>(h) << 16);
}

// ---------------------------------------------------------------------------
// fp32 <-> fp16 (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits).
// ---------------------------------------------------------------------------

// Round to nearest, ties to even. Results below 2^-14 become fp16 subnormals
// (never flushed); magnitudes >= 65520 become infinity; a NaN becomes a quiet
// NaN with its sign and the upper bits of its payload.
STRATA_HD std::uint16_t fp32_to_fp16_bits(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x03ffu));
  }
  if (a >= 0x477ff000u) {  // >= 65520.0f (or inf): rounds to infinity
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x38800000u) {  // >= 2^-14: a normal fp16
    const std::uint32_t lsb = (a >> 13) & 1u;
    a += 0x0fffu + lsb;    // round to nearest even at bit 13
    a -= 112u << 23;       // rebias the exponent: 127 - 15
    return static_cast<std::uint16_t>(sign | (a >> 13));
  }
  if (a <= 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 is a tie, zero is even)
    return static_cast<std::uint16_t>(sign);
  }
  // fp16 subnormal: the value in units of 2^-24 is m * 2^(e - 150 + 24).
  const std::uint32_t e = a >> 23;  // 102 .. 112
  const std::uint32_t m = (a & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126u - e;  // 14 .. 24
  std::uint32_t r = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u) != 0)) ++r;  // may carry into the smallest normal
  return static_cast<std::uint16_t>(sign | r);
}

// Exact (every fp16 is an fp32).
STRATA_HD float fp16_bits_to_fp32(std::uint16_t h) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1fu;
  std::uint32_t m = h & 0x03ffu;
  if (e == 0x1fu) return float_from_bits(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e == 0) {
    if (m == 0) return float_from_bits(sign);
    // Subnormal: normalise. value = m * 2^-24.
    e = 1;
    while ((m & 0x0400u) == 0) {
      m <<= 1;
      --e;
    }
    m &= 0x03ffu;
    return float_from_bits(sign | ((e + 112u) << 23) | (m << 13));
  }
  return float_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

// ---------------------------------------------------------------------------
// Adam / AdamW (DeepSpeed semantics: `Adam` with adam_w_mode = true is AdamW;
// eps is added after the bias-corrected square root). Loshchilov & Hutter,
// "Decoupled Weight Decay Regularization", Algorithm 2; Kingma & Ba, Alg. 1.
//
//   g  = grad * grad_scale                       (unscale, clip, 1/accumulation)
//   g  = fma(p, l2_decay, g)                     (Adam with L2 only: g += wd * p)
//   m  = fma(beta1, m, one_minus_beta1 * g)
//   v  = fma(beta2, v, one_minus_beta2 * (g * g))
//   d  = fma(sqrt(v), inv_sqrt_bias_correction2, eps)
//   u  = m / d
//   p  = fma(neg_lr_decay, p, p)                 (AdamW only: p -= lr * wd * p)
//   p  = fma(neg_step_size, u, p)                (p -= lr / bias_correction1 * u)
//
// The two decay lines run only when their constant is non-zero, so a kernel
// branches once per call, not per element.
// ---------------------------------------------------------------------------

// Per-step constants, computed on the host in double and rounded to float once
// (make_adam_constants). Every kernel takes this struct.
struct AdamStepConstants {
  float grad_scale = 1.0f;                 // combined factor applied to the raw gradient
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float one_minus_beta1 = 0.1f;            // rounded from double 1 - beta1
  float one_minus_beta2 = 0.001f;          // rounded from double 1 - beta2
  float eps = 1e-8f;
  float inv_sqrt_bias_correction2 = 1.0f;  // 1 / sqrt(1 - beta2^step); 1 without bias correction
  float neg_step_size = -1e-3f;            // -lr / (1 - beta1^step); -lr without bias correction
  float neg_lr_decay = 0.0f;               // AdamW: -lr * weight_decay; else 0
  float l2_decay = 0.0f;                   // Adam (L2): weight_decay; else 0
};

// Hyperparameters of one optimizer group for one step.
struct AdamHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw_mode = true;       // true: decoupled decay (AdamW); false: L2 added to the gradient
  bool bias_correction = true;
};

// `step` counts from 1 (the first update). `grad_scale` is the combined factor
// (see combined_grad_scale). Host only.
inline AdamStepConstants make_adam_constants(const AdamHyperparams& h, std::int64_t step,
                                             double grad_scale) {
  AdamStepConstants c;
  const double t = static_cast<double>(step < 1 ? 1 : step);
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  c.grad_scale = static_cast<float>(grad_scale);
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.neg_step_size = static_cast<float>(-h.lr / bc1);
  c.neg_lr_decay = h.adamw_mode ? static_cast<float>(-h.lr * h.weight_decay) : 0.0f;
  c.l2_decay = h.adamw_mode ? 0.0f : static_cast<float>(h.weight_decay);
  return c;
}

// One element of the step. `grad` is the raw fp32 gradient (or the fp32 value
// of a bf16/fp16 gradient); p, m, v are updated in place.
STRATA_HD void adam_step(const AdamStepConstants& c, float grad, float& p, float& m, float& v) {
  float g = mul_f32(grad, c.grad_scale);
  if (c.l2_decay != 0.0f) g = fma_f32(p, c.l2_decay, g);
  m = fma_f32(c.beta1, m, mul_f32(c.one_minus_beta1, g));
  v = fma_f32(c.beta2, v, mul_f32(c.one_minus_beta2, mul_f32(g, g)));
  const float d = fma_f32(sqrt_f32(v), c.inv_sqrt_bias_correction2, c.eps);
  const float u = div_f32(m, d);
  if (c.neg_lr_decay != 0.0f) p = fma_f32(c.neg_lr_decay, p, p);
  p = fma_f32(c.neg_step_size, u, p);
}

// ---------------------------------------------------------------------------
// Adam/AdamW with bf16 moments: the fp32 master stays fp32, exp_avg (m) and
// exp_avg_sq (v) are stored as bf16 bit patterns (4 bytes of state per element
// instead of 8). Each element, per step:
//
//   m32 = bf16_bits_to_fp32(m)                   (exact: shift left 16)
//   v32 = bf16_bits_to_fp32(v)
//   adam_step(c, grad, p, m32, v32)              (the fp32 step above, unchanged)
//   m   = narrow(m32), v = narrow(v32)
//
// where narrow is either fp32_to_bf16_bits (round to nearest even) or
// bf16_round_stochastic with 16 random bits per moment (stochastic rounding:
// Gupta et al., "Deep Learning with Limited Numerical Precision", 2015;
// Zamirai et al., "Revisiting BFloat16 Training", 2020).
//
// The random bits. They are a pure function of (seed, step, the element's
// global index, which moment), so a kernel may visit the elements in any
// tiles, threads or vector widths and still produce the same bits:
//
//   key  = splitmix64_mix(splitmix64_mix(seed + 0x9e3779b97f4a7c15) ^ step)
//   x    = hash32(lo32(index) ^ lo32(key))
//   x    = hash32(x ^ hi32(index) ^ hi32(key))
//   bits = x & 0xffff (m), x >> 16 (v)
//
// splitmix64_mix is the finalizer of Steele, Lea and Flood's SplitMix64
// (OOPSLA 2014; the variant with Stafford's "Mix13" constants); hash32 is the
// "lowbias32" integer hash from Chris Wellons' hash prospector (two
// xorshift-multiply rounds, a bijection on 32 bits with a measured bias of
// about 0.17). Why this shape: the key depends on the step only, so a kernel
// derives it once per call, in 64-bit scalar code; what runs per element is
// 32-bit xorshifts, xors and multiplies, which AVX2 (vpmulld) and AVX-512 do 8
// or 16 at a time (AVX2 has no 64-bit multiply, so a per-element splitmix64
// or Philox would not vectorise there). Two rounds, keyed before each, mix
// both halves of the 64-bit index; for a fixed key and index high half the
// map from the low half is a bijection, so no two elements of one step share
// their 32 bits. One 32-bit hash serves both moments (its two halves),
// halving the per-element work.
// ---------------------------------------------------------------------------

// How the moments are narrowed back to bf16.
enum class Bf16Rounding : std::uint8_t {
  kNearestEven = 0,  // fp32_to_bf16_bits
  kStochastic = 1,   // bf16_round_stochastic with the bits below
};

// Which moment a random draw is for.
enum class AdamMoment : std::uint8_t {
  kExpAvg = 0,    // m: the low 16 bits of the element's hash
  kExpAvgSq = 1,  // v: the high 16 bits
};

// SplitMix64's output function: a bijection on 64 bits.
STRATA_HD std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// lowbias32: a bijection on 32 bits.
STRATA_HD std::uint32_t hash32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-step key (64-bit scalar code; kernels compute it once per call).
STRATA_HD std::uint64_t stochastic_rounding_key(std::uint64_t seed, std::int64_t step) {
  return splitmix64_mix(splitmix64_mix(seed + 0x9e3779b97f4a7c15ull) ^ static_cast<std::uint64_t>(step));
}

// The 32-bit hash of one element under a step's key.
STRATA_HD std::uint32_t stochastic_rounding_hash(std::uint64_t key, std::uint64_t index) {
  std::uint32_t x = hash32(static_cast<std::uint32_t>(index) ^ static_cast<std::uint32_t>(key));
  x = hash32(x ^ static_cast<std::uint32_t>(index >> 32) ^ static_cast<std::uint32_t>(key >> 32));
  return x;
}

// 16 random bits (in the low half) for one moment of one element in one step.
STRATA_HD std::uint32_t stochastic_rounding_bits(std::uint64_t key, std::int64_t index, AdamMoment moment) {
  const std::uint32_t x = stochastic_rounding_hash(key, static_cast<std::uint64_t>(index));
  return moment == AdamMoment::kExpAvg ? (x & 0xffffu) : (x >> 16);
}

// The same as a function of everything it depends on.
STRATA_HD std::uint32_t stochastic_rounding_bits(std::uint64_t seed, std::int64_t step, std::int64_t index,
                                                 AdamMoment moment) {
  return stochastic_rounding_bits(stochastic_rounding_key(seed, step), index, moment);
}

// Stochastic rounding to bf16 on the bit pattern: add the low 16 bits of
// `bits` to the low 16 bits of x's pattern and truncate. x rounds away from
// zero with probability (its low 16 bits) / 65536, so the result is one of the
// two bf16 values around x (x itself when it is a bf16) and its mean over
// uniform bits is x exactly. Subnormals are kept; a finite value above the
// largest bf16 may carry into infinity (as nearest-even does past the
// midpoint). Non-finite values (inf, NaN) take fp32_to_bf16_bits.
STRATA_HD std::uint16_t bf16_round_stochastic(float x, std::uint32_t bits) {
  const std::uint32_t u = float_bits(x);
  if (!is_finite_bits(u)) return fp32_to_bf16_bits(x);
  return static_cast<std::uint16_t>((u + (bits & 0xffffu)) >> 16);
}

// One element of the step with bf16 moments; p, m, v are updated in place.
// bits_m and bits_v are used by kStochastic only (their low 16 bits:
// stochastic_rounding_bits for kExpAvg and kExpAvgSq).
STRATA_HD void adam_step_bf16_moments(const AdamStepConstants& c, float grad, float& p, std::uint16_t& m,
                                      std::uint16_t& v, Bf16Rounding rounding, std::uint32_t bits_m,
                                      std::uint32_t bits_v) {
  float m32 = bf16_bits_to_fp32(m);
  float v32 = bf16_bits_to_fp32(v);
  adam_step(c, grad, p, m32, v32);
  if (rounding == Bf16Rounding::kStochastic) {
    m = bf16_round_stochastic(m32, bits_m);
    v = bf16_round_stochastic(v32, bits_v);
  } else {
    m = fp32_to_bf16_bits(m32);
    v = fp32_to_bf16_bits(v32);
  }
}

// ---------------------------------------------------------------------------
// Adam/AdamW with 8-bit blockwise moments (Dettmers, Lewis, Shleifer and
// Zettlemoyer, "8-bit Optimizers via Block-wise Quantization", ICLR 2022): m
// and v are stored as one byte each, in blocks of kQuantBlockElems
// consecutive elements, each block with one fp32 scale per moment (its
// absolute maximum): 4 + 1 + 1 + 8/256 = 6.03 bytes of state per element with
// the fp32 master, against 12 for fp32 moments.
//
// The codes: a byte names a value in [-1, 1] (m) or [0, 1] (v), laid out as a
// dynamic tree. The magnitude field r (m: the low 7 bits, the sign in 0x80;
// v: all 8 bits) is read as: z leading zero bits pick the decade 10^-z, the
// first one bit after them is an indicator, and the k = width - 1 - z bits
// after it cut the decade's [0.1, 1] into 2^k equal steps, the code naming a
// step's upper end:
//
//   magnitude(r) = 10^-z * (0.1 + 0.9 * (F + 1) / 2^k)   (F: r's k low bits)
//   magnitude(0) = 0
//
// So r = 2^width - 1 is exactly 1 (the element at its block's absmax comes
// back exactly), the smallest nonzero magnitude is 1e-6 (m) or 1e-7 (v) of the
// block's absmax, decades near the absmax get the most codes, and a larger r
// is a larger magnitude. m's zero is byte 0 (the sign bit of magnitude 0 is
// never set); the state's zero fill is all-zero moments with zero scales.
//
// The values are computed in double and rounded to float once; the rounding
// thresholds are the midpoints of consecutive values, computed in double and
// rounded to float (QuantTables). Quantizing x against scale s:
//
//   s == 0, or s not finite            -> code 0
//   xn = div_f32(|x|, s); r = the number of thresholds below xn (a NaN xn: 0;
//   xn equal to a threshold rounds down); m: r | 0x80 when x < 0 and r > 0
//
// Dequantizing: mul_f32(magnitude[r], s), negated (exactly) when m's sign
// bit is set. One block's step, n <= kQuantBlockElems elements:
//
//   m32[i] = dequantize(m[i], m_scale), v32[i] = dequantize(v[i], v_scale)
//   adam_step(c, grad[i], p[i], m32[i], v32[i])           (the fp32 step, unchanged)
//   m_scale = block_scale(absmax of m32), v_scale = block_scale(absmax of v32)
//   m[i] = quantize(m32[i], m_scale), v[i] = quantize(v32[i], v_scale)
//
// The absmax counts a NaN as +inf; block_scale keeps a finite absmax and makes
// any other a NaN, so a block with a non-finite moment dequantizes to NaN
// everywhere from then on (it is poisoned, not silently zeroed). A max is
// exact in any order, so a kernel may reduce a block however it likes; the
// blocks themselves start at multiples of kQuantBlockElems of the element's
// global index, so a kernel's range starts on a block boundary.
// ---------------------------------------------------------------------------

inline constexpr int kQuantBlockElems = 256;

// The code tables. thresholds[i] (i < N - 1) is the midpoint of values[i]
// and values[i + 1]; thresholds[N - 1] is +inf, so that a binary search over
// N entries counts at most N - 1 of them.
struct QuantTables {
  float m_values[128];  // magnitude of m's 7-bit field r
  float m_thresholds[128];
  float v_values[256];  // value of v's byte
  float v_thresholds[256];
};

constexpr double dynamic_tree_magnitude(int r, int width) {
  if (r == 0) return 0.0;
  constexpr double kDecades[8] = {1.0, 0.1, 0.01, 0.001, 0.0001, 0.00001, 0.000001, 0.0000001};
  int z = 0;
  while ((r & (1 << (width - 1 - z))) == 0) ++z;
  const int k = width - 1 - z;
  const int f = r & ((1 << k) - 1);
  return kDecades[z] * (0.1 + 0.9 * static_cast<double>(f + 1) / static_cast<double>(1 << k));
}

constexpr QuantTables make_quant_tables() {
  QuantTables t{};
  for (int r = 0; r < 128; ++r) t.m_values[r] = static_cast<float>(dynamic_tree_magnitude(r, 7));
  for (int r = 0; r < 256; ++r) t.v_values[r] = static_cast<float>(dynamic_tree_magnitude(r, 8));
  for (int i = 0; i < 127; ++i) {
    t.m_thresholds[i] = static_cast<float>(
        (static_cast<double>(t.m_values[i]) + static_cast<double>(t.m_values[i + 1])) / 2.0);
  }
  for (int i = 0; i < 255; ++i) {
    t.v_thresholds[i] = static_cast<float>(
        (static_cast<double>(t.v_values[i]) + static_cast<double>(t.v_values[i + 1])) / 2.0);
  }
  t.m_thresholds[127] = __builtin_inff();
  t.v_thresholds[255] = __builtin_inff();
  return t;
}

// The tables for host code; device code gets a copy in its own memory and
// passes it to the functions below.
inline constexpr QuantTables kQuantTables = make_quant_tables();

// The number of thresholds[0 .. 2^steps - 1] below xn: a binary search of
// `steps` probes (7 for m, 8 for v), the last threshold being +inf.
STRATA_HD std::uint32_t quant_search(const float* thresholds, int steps, float xn) {
  std::uint32_t r = 0;
  for (std::uint32_t s = 1u << (steps - 1); s > 0; s >>= 1) {
    if (thresholds[r + s - 1] < xn) r += s;
  }
  return r;
}

STRATA_HD bool usable_scale(float s) { return s > 0.0f && is_finite_bits(float_bits(s)); }

STRATA_HD std::uint8_t quantize_m(const QuantTables& t, float x, float scale) {
  if (!usable_scale(scale)) return 0;
  const std::uint32_t bits = float_bits(x);
  const std::uint32_t r = quant_search(t.m_thresholds, 7, div_f32(float_from_bits(bits & 0x7fffffffu), scale));
  return static_cast<std::uint8_t>(r == 0 ? 0u : r | ((bits >> 24) & 0x80u));
}

STRATA_HD std::uint8_t quantize_v(const QuantTables& t, float x, float scale) {
  if (!usable_scale(scale)) return 0;
  return static_cast<std::uint8_t>(
      quant_search(t.v_thresholds, 8, div_f32(float_from_bits(float_bits(x) & 0x7fffffffu), scale)));
}

STRATA_HD float dequantize_m(const QuantTables& t, std::uint8_t code, float scale) {
  const float v = mul_f32(t.m_values[code & 0x7fu], scale);
  return (code & 0x80u) != 0 ? -v : v;
}

STRATA_HD float dequantize_v(const QuantTables& t, std::uint8_t code, float scale) {
  return mul_f32(t.v_values[code], scale);
}

// The running absmax: |x|, a NaN counting as +inf.
STRATA_HD float absmax_step(float acc, float x) {
  const std::uint32_t u = float_bits(x) & 0x7fffffffu;
  const float ax = u > 0x7f800000u ? float_from_bits(0x7f800000u) : float_from_bits(u);
  return ax > acc ? ax : acc;
}

// The scale a block stores for its absmax: the absmax when finite, else NaN.
STRATA_HD float block_scale(float absmax) {
  return is_finite_bits(float_bits(absmax)) ? absmax : float_from_bits(0x7fc00000u);
}

// One block's step (above): n <= kQuantBlockElems elements, their fp32
// gradients (raw: adam_step applies grad_scale), p, m and v updated in place,
// and the block's two scales.
STRATA_HD void adam_step_int8_block(const AdamStepConstants& c, const QuantTables& t, const float* grad, float* p,
                                    std::uint8_t* m, std::uint8_t* v, float& m_scale, float& v_scale, int n) {
  float m32[kQuantBlockElems];
  float v32[kQuantBlockElems];
  float am = 0.0f, av = 0.0f;
  for (int i = 0; i < n; ++i) {
    m32[i] = dequantize_m(t, m[i], m_scale);
    v32[i] = dequantize_v(t, v[i], v_scale);
    adam_step(c, grad[i], p[i], m32[i], v32[i]);
    am = absmax_step(am, m32[i]);
    av = absmax_step(av, v32[i]);
  }
  m_scale = block_scale(am);
  v_scale = block_scale(av);
  for (int i = 0; i < n; ++i) {
    m[i] = quantize_m(t, m32[i], m_scale);
    v[i] = quantize_v(t, v32[i], v_scale);
  }
}

// ---------------------------------------------------------------------------
// Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023,
// Program 1; DeepSpeed's DeepSpeedCPULion). One fp32 state, exp_avg. Weight
// decay is decoupled and shrinks the master before the signed update, as the
// torch implementations do.
//
//   g  = grad * grad_scale                       (unscale, clip, 1/accumulation)
//   c  = fma(beta1, m, one_minus_beta1 * g)      (the interpolation; not stored)
//   s  = sign(c)                                 (sign_f32: +1, -1, +0 for a zero)
//   p  = fma(neg_lr_decay, p, p)                 (decay only: p -= lr * wd * p)
//   p  = fma(neg_lr, s, p)                       (p -= lr * s; the product is exact)
//   m  = fma(beta2, m, one_minus_beta2 * g)
//
// Where this differs from DeepSpeed's CPU kernel: sign(0) is 0 (DeepSpeed
// takes copysign(lr, c), so a zero c still moves p by lr), and the decay and
// the update are rounded separately (DeepSpeed rounds p * (1 - lr * wd) + u
// once, with 1 - lr * wd rounded to float first).
// ---------------------------------------------------------------------------

struct LionStepConstants {
  float grad_scale = 1.0f;         // combined factor applied to the raw gradient
  float beta1 = 0.9f;              // interpolation factor of the update direction
  float beta2 = 0.999f;            // decay of exp_avg
  float one_minus_beta1 = 0.1f;    // rounded from double 1 - beta1
  float one_minus_beta2 = 0.001f;  // rounded from double 1 - beta2
  float neg_lr = -1e-3f;           // -lr
  float neg_lr_decay = 0.0f;       // -lr * weight_decay; 0 without decay
};

// DeepSpeedCPULion's defaults.
struct LionHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double weight_decay = 0.0;  // decoupled
};

// Lion has no bias correction, so the constants do not depend on the step.
// `grad_scale` is the combined factor (see combined_grad_scale). Host only.
inline LionStepConstants make_lion_constants(const LionHyperparams& h, double grad_scale) {
  LionStepConstants c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_lr = static_cast<float>(-h.lr);
  c.neg_lr_decay = static_cast<float>(-h.lr * h.weight_decay);
  return c;
}

// One element of the step; p and m are updated in place.
STRATA_HD void lion_step(const LionStepConstants& c, float grad, float& p, float& m) {
  const float g = mul_f32(grad, c.grad_scale);
  const float s = sign_f32(fma_f32(c.beta1, m, mul_f32(c.one_minus_beta1, g)));
  if (c.neg_lr_decay != 0.0f) p = fma_f32(c.neg_lr_decay, p, p);
  p = fma_f32(c.neg_lr, s, p);
  m = fma_f32(c.beta2, m, mul_f32(c.one_minus_beta2, g));
}

// ---------------------------------------------------------------------------
// Adagrad (Duchi et al., 2011; torch.optim.Adagrad with lr_decay = 0 and
// initial_accumulator_value = 0, DeepSpeed's DeepSpeedCPUAdagrad). One fp32
// state, the sum of squared gradients (stored as exp_avg_sq). Weight decay is
// L2: added to the gradient, which then feeds both the sum and the update.
//
//   g  = grad * grad_scale                       (unscale, clip, 1/accumulation)
//   g  = fma(p, l2_decay, g)                     (decay only: g += wd * p)
//   v  = fma(g, g, v)                            (v += g * g, rounded once)
//   d  = sqrt(v) + eps
//   u  = g / d
//   p  = fma(neg_lr, u, p)                       (p -= lr * u)
//
// Where this differs from DeepSpeed's CPU kernel: with weight decay,
// DeepSpeed divides the gradient as it was before the decay (u = grad / d)
// while its sum takes the decayed one; torch and this step use the decayed
// gradient in both places.
// ---------------------------------------------------------------------------

struct AdagradStepConstants {
  float grad_scale = 1.0f;  // combined factor applied to the raw gradient
  float eps = 1e-10f;       // added after the square root
  float neg_lr = -1e-2f;    // -lr
  float l2_decay = 0.0f;    // weight_decay; 0 without decay
};

// DeepSpeedCPUAdagrad's defaults.
struct AdagradHyperparams {
  double lr = 1e-2;
  double eps = 1e-10;
  double weight_decay = 0.0;  // L2
};

// Adagrad has no bias correction, so the constants do not depend on the step.
// `grad_scale` is the combined factor (see combined_grad_scale). Host only.
inline AdagradStepConstants make_adagrad_constants(const AdagradHyperparams& h, double grad_scale) {
  AdagradStepConstants c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.eps = static_cast<float>(h.eps);
  c.neg_lr = static_cast<float>(-h.lr);
  c.l2_decay = static_cast<float>(h.weight_decay);
  return c;
}

// One element of the step; p and v (the sum) are updated in place.
STRATA_HD void adagrad_step(const AdagradStepConstants& c, float grad, float& p, float& v) {
  float g = mul_f32(grad, c.grad_scale);
  if (c.l2_decay != 0.0f) g = fma_f32(p, c.l2_decay, g);
  v = fma_f32(g, g, v);
  const float d = add_f32(sqrt_f32(v), c.eps);
  const float u = div_f32(g, d);
  p = fma_f32(c.neg_lr, u, p);
}

// ---------------------------------------------------------------------------
// Gradient scaling (host, double).
// ---------------------------------------------------------------------------

// DeepSpeed's clip coefficient: max_norm / (norm + 1e-6), capped at 1; 1 when
// clipping is off (max_norm <= 0). `norm` is the norm of the unscaled gradient.
inline double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

// The one factor the raw (scaled, summed over micro-batches) gradient is
// multiplied by: 1/loss_scale x clip coefficient x 1/gradient_accumulation_steps,
// formed in double and rounded to float once (by the make_*_constants).
inline double combined_grad_scale(double loss_scale, double clip_coef,
                                  std::int64_t gradient_accumulation_steps) {
  return (1.0 / loss_scale) * clip_coef / static_cast<double>(gradient_accumulation_steps);
}

// ---------------------------------------------------------------------------
// The global gradient norm: a fixed order, whatever the arrival order,
// chunking or device.
//
// Parameters are numbered by their global flat offset. Block b covers offsets
// [b * kNormBlockElems, (b + 1) * kNormBlockElems); chunks and tiles start on
// block boundaries, so every block is reduced by one worker. Within a block,
// lane j (0..31) sums, in increasing offset, the squares (in double, exact)
// of the elements whose offset within the block is j mod 32, starting from
// +0.0; then the lanes are folded in a fixed tree, for s = 16, 8, 4, 2, 1:
// lane[k] += lane[k + s] for k < s (a CUDA warp's shuffle-down). The block's
// partial is lane[0]. The squared norm is the sum of the partials in block
// index order starting from +0.0; the norm is its square root.
// ---------------------------------------------------------------------------

inline constexpr std::int64_t kNormBlockElems = 65536;
inline constexpr int kNormLanes = 32;

// Square of an fp32 value in double: exact (48 significant bits).
STRATA_HD double square_f64(float x) {
  const double d = static_cast<double>(x);
  return d * d;
}

// Folds 32 lane sums in the contract's tree order; lanes is overwritten.
STRATA_HD double fold_norm_lanes(double* lanes) {
  for (int s = kNormLanes / 2; s >= 1; s /= 2) {
    for (int k = 0; k < s; ++k) lanes[k] = lanes[k] + lanes[k + s];
  }
  return lanes[0];
}

// Reference partial of one block (n <= kNormBlockElems elements, which start
// on a block boundary). `to_f32` converts one element (identity for float,
// bf16_bits_to_fp32, fp16_bits_to_fp32).
template <typename T, typename ToF32>
STRATA_HD double norm_block_partial(const T* x, std::int64_t n, ToF32 to_f32) {
  double lanes[kNormLanes];
  for (int j = 0; j < kNormLanes; ++j) lanes[j] = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    lanes[i % kNormLanes] = lanes[i % kNormLanes] + square_f64(to_f32(x[i]));
  }
  return fold_norm_lanes(lanes);
}

// Sum of block partials in index order.
STRATA_HD double sum_norm_partials(const double* partials, std::int64_t count) {
  double total = 0.0;
  for (std::int64_t b = 0; b < count; ++b) total = total + partials[b];
  return total;
}

// Number of norm blocks covering n elements that start on a block boundary.
STRATA_HD std::int64_t norm_block_count(std::int64_t n) {
  return (n + kNormBlockElems - 1) / kNormBlockElems;
}

}  // namespace strata::core::numerics
