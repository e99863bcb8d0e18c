// numerics.h against independent references: a nearest-value search in double
// for bf16, the compiler's _Float16 for fp16, a float64 Adam, and hand-worked
// edge cases (ties, subnormals, NaN, inf).
#include "core/numerics.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

namespace strata::core::numerics {
namespace {

float f(std::uint32_t u) { return std::bit_cast<float>(u); }
std::uint32_t u32(float x) { return std::bit_cast<std::uint32_t>(x); }

// Independent bf16 reference: pick the nearer of the two neighbours in double,
// ties to the even pattern. Infinity acts as the value 2^128 for rounding.
std::uint16_t bf16_reference(float x) {
  const std::uint32_t u = u32(x);
  const std::uint32_t sign = u & 0x80000000u;
  const std::uint32_t mag = u & 0x7fffffffu;
  const std::uint32_t lo = mag & 0xffff0000u;
  const std::uint32_t hi = lo + 0x10000u;
  const double xv = std::fabs(static_cast<double>(x));
  const double lov = static_cast<double>(f(lo));
  const double hiv = hi >= 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(f(hi));
  std::uint32_t pick;
  if (xv - lov < hiv - xv) pick = lo;
  else if (xv - lov > hiv - xv) pick = hi;
  else pick = ((lo >> 16) & 1u) ? hi : lo;
  return static_cast<std::uint16_t>((sign | pick) >> 16);
}

bool is_nan_bits16_bf16(std::uint16_t h) { return (h & 0x7fffu) > 0x7f80u; }
bool is_quiet_bf16(std::uint16_t h) { return (h & 0x0040u) != 0; }

// Walks the 2^32 patterns with a stride (the slow suite sets the stride to 1).
std::uint64_t sweep_stride() {
  const char* env = std::getenv("STRATA_NUMERICS_EXHAUSTIVE");
  return (env != nullptr && env[0] == '1') ? 1 : 4099;
}

TEST(Bf16, RoundsToNearestEvenOverTheFloatRange) {
  const std::uint64_t stride = sweep_stride();
  std::uint64_t checked = 0;
  for (std::uint64_t i = 0; i < (1ull << 32); i += stride) {
    const std::uint32_t u = static_cast<std::uint32_t>(i);
    const float x = f(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(fp32_to_bf16_bits(x), bf16_reference(x)) << std::hex << "input 0x" << u;
    ++checked;
  }
  EXPECT_GT(checked, 1000000u / (stride == 1 ? 1 : 1000));
}

TEST(Bf16, TiesGoToEven) {
  EXPECT_EQ(fp32_to_bf16_bits(f(0x3f808000u)), 0x3f80u);  // 1 + 2^-8: tie, 0x3f80 is even
  EXPECT_EQ(fp32_to_bf16_bits(f(0x3f818000u)), 0x3f82u);  // tie, 0x3f81 is odd: up
  EXPECT_EQ(fp32_to_bf16_bits(f(0x3f808001u)), 0x3f81u);  // just past the tie: up
  EXPECT_EQ(fp32_to_bf16_bits(f(0xbf818000u)), 0xbf82u);  // negative ties mirror
}

TEST(Bf16, KeepsSubnormals) {
  EXPECT_EQ(fp32_to_bf16_bits(f(0x00010000u)), 0x0001u);  // smallest bf16 subnormal, exact
  EXPECT_EQ(fp32_to_bf16_bits(f(0x00018000u)), 0x0002u);  // tie, odd: up
  EXPECT_EQ(fp32_to_bf16_bits(f(0x00008000u)), 0x0000u);  // tie, even: to zero
  EXPECT_EQ(fp32_to_bf16_bits(f(0x00008001u)), 0x0001u);  // past the tie: not flushed
  EXPECT_EQ(fp32_to_bf16_bits(f(0x007fffffu)), 0x0080u);  // rounds up into the smallest normal
  EXPECT_EQ(fp32_to_bf16_bits(f(0x80010000u)), 0x8001u);  // negative subnormal keeps its sign
  EXPECT_EQ(u32(bf16_bits_to_fp32(0x0001u)), 0x00010000u);
}

TEST(Bf16, NanStaysQuietNanWithSignAndInfStays) {
  for (std::uint32_t nan : {0x7f800001u, 0x7fc00000u, 0x7fffffffu, 0x7f80ffffu, 0xff800001u,
                            0xffc12345u}) {
    const std::uint16_t h = fp32_to_bf16_bits(f(nan));
    EXPECT_TRUE(is_nan_bits16_bf16(h)) << std::hex << nan;
    EXPECT_TRUE(is_quiet_bf16(h)) << std::hex << nan;
    EXPECT_EQ(h & 0x8000u, (nan >> 16) & 0x8000u) << std::hex << nan;
  }
  // A signalling NaN whose payload lives only in the low bits must not become inf.
  EXPECT_EQ(fp32_to_bf16_bits(f(0x7f800001u)), 0x7fc0u);
  EXPECT_EQ(fp32_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80u);
  EXPECT_EQ(fp32_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80u);
  EXPECT_EQ(fp32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80u);  // overflows to inf
  EXPECT_EQ(fp32_to_bf16_bits(f(0x7f7f7fffu)), 0x7f7fu);                     // largest finite stays
}

TEST(Bf16, RoundTripIsExactForEveryBf16) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    if (is_nan_bits16_bf16(b)) continue;
    EXPECT_EQ(fp32_to_bf16_bits(bf16_bits_to_fp32(b)), b);
  }
}

// --- fp16 --------------------------------------------------------------------

std::uint16_t fp16_reference(float x) {
  const _Float16 h = static_cast<_Float16>(x);  // the compiler's RNE conversion (libgcc)
  return std::bit_cast<std::uint16_t>(h);
}

TEST(Fp16, MatchesTheCompilersConversionOverTheFloatRange) {
  const std::uint64_t stride = sweep_stride();
  for (std::uint64_t i = 0; i < (1ull << 32); i += stride) {
    const std::uint32_t u = static_cast<std::uint32_t>(i);
    const float x = f(u);
    if (std::isnan(x)) continue;
    ASSERT_EQ(fp32_to_fp16_bits(x), fp16_reference(x)) << std::hex << "input 0x" << u;
  }
}

TEST(Fp16, DenseSweepAroundEveryBoundary) {
  // Every float within +-64 ulps of each fp16 value's midpoint neighbourhood:
  // covers ties, the subnormal range, the normal/subnormal seam and overflow.
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {
    const float centre = static_cast<float>(std::bit_cast<_Float16>(static_cast<std::uint16_t>(h)));
    const std::uint32_t c = u32(centre);
    for (int d = -64; d <= 64; ++d) {
      const std::uint32_t u = c + static_cast<std::uint32_t>(d);
      if (u >= 0x7f800000u) continue;
      ASSERT_EQ(fp32_to_fp16_bits(f(u)), fp16_reference(f(u))) << std::hex << "input 0x" << u;
      ASSERT_EQ(fp32_to_fp16_bits(f(u | 0x80000000u)), fp16_reference(f(u | 0x80000000u)));
    }
  }
}

TEST(Fp16, EdgeCases) {
  EXPECT_EQ(fp32_to_fp16_bits(65504.0f), 0x7bffu);          // largest finite
  EXPECT_EQ(fp32_to_fp16_bits(65519.996f), 0x7bffu);        // below the overflow tie
  EXPECT_EQ(fp32_to_fp16_bits(65520.0f), 0x7c00u);          // the tie rounds to inf (even)
  EXPECT_EQ(fp32_to_fp16_bits(std::ldexp(1.0f, -24)), 0x0001u);  // smallest subnormal
  EXPECT_EQ(fp32_to_fp16_bits(std::ldexp(1.0f, -25)), 0x0000u);  // tie to even zero
  EXPECT_EQ(fp32_to_fp16_bits(std::ldexp(1.5f, -25)), 0x0001u);  // past the tie
  EXPECT_EQ(fp32_to_fp16_bits(std::ldexp(3.0f, -25)), 0x0002u);  // 1.5 units: tie, odd -> up
  EXPECT_EQ(fp32_to_fp16_bits(std::ldexp(1.0f, -14)), 0x0400u);  // smallest normal
  EXPECT_EQ(fp32_to_fp16_bits(-0.0f), 0x8000u);
  EXPECT_EQ(fp32_to_fp16_bits(std::numeric_limits<float>::denorm_min()), 0x0000u);
  EXPECT_EQ(fp32_to_fp16_bits(std::numeric_limits<float>::infinity()), 0x7c00u);
  EXPECT_EQ(fp32_to_fp16_bits(f(0x7f800001u)) & 0x7e00u, 0x7e00u);  // quiet NaN
  EXPECT_EQ(fp32_to_fp16_bits(f(0xff800001u)), 0xfe00u);            // sign kept
}

TEST(Fp16, WideningIsExactForEveryPattern) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float mine = fp16_bits_to_fp32(b);
    const float ref = static_cast<float>(std::bit_cast<_Float16>(b));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(mine)) << std::hex << h;
      continue;
    }
    EXPECT_EQ(u32(mine), u32(ref)) << std::hex << h;
    EXPECT_EQ(fp32_to_fp16_bits(mine), b) << std::hex << h;  // round trip
  }
}

// --- Adam -----------------------------------------------------------------------

struct Adam64 {
  double p, m, v;
};

// Float64 reference of DeepSpeed's Adam/AdamW, written from the papers.
void adam64_step(const AdamHyperparams& h, std::int64_t t, double grad_scale, double grad,
                 Adam64& s) {
  double g = grad * grad_scale;
  if (!h.adamw_mode) g += h.weight_decay * s.p;
  s.m = h.beta1 * s.m + (1 - h.beta1) * g;
  s.v = h.beta2 * s.v + (1 - h.beta2) * g * g;
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(t));
  const double denom = std::sqrt(s.v) / std::sqrt(bc2) + h.eps;
  if (h.adamw_mode) s.p -= h.lr * h.weight_decay * s.p;
  s.p -= h.lr / bc1 * s.m / denom;
}

void run_against_float64(const AdamHyperparams& h, double grad_scale, int steps) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int kN = 512;
  std::vector<float> p(kN), m(kN, 0.0f), v(kN, 0.0f);
  std::vector<Adam64> ref(kN);
  for (int i = 0; i < kN; ++i) {
    p[i] = normal(rng);
    ref[i] = {p[i], 0.0, 0.0};
  }
  for (int t = 1; t <= steps; ++t) {
    const AdamStepConstants c = make_adam_constants(h, t, grad_scale);
    for (int i = 0; i < kN; ++i) {
      const float g = normal(rng) * 3.0f;
      adam_step(c, g, p[i], m[i], v[i]);
      adam64_step(h, t, grad_scale, g, ref[i]);
    }
  }
  for (int i = 0; i < kN; ++i) {
    // Stated tolerance: 1e-5 relative to the parameter's scale after 100 steps
    // (each step's update is ~lr; float rounding adds ~1e-7 per step).
    EXPECT_NEAR(p[i], ref[i].p, 1e-5 * (1.0 + std::fabs(ref[i].p))) << i;
    EXPECT_NEAR(m[i], ref[i].m, 1e-5 * (1.0 + std::fabs(ref[i].m))) << i;
    EXPECT_NEAR(v[i], ref[i].v, 1e-5 * (1.0 + std::fabs(ref[i].v))) << i;
  }
}

TEST(AdamStep, AdamWAgreesWithFloat64Over100Steps) {
  run_against_float64({.lr = 1e-3, .weight_decay = 0.01, .adamw_mode = true}, 0.5, 100);
}

TEST(AdamStep, AdamL2AgreesWithFloat64Over100Steps) {
  run_against_float64({.lr = 3e-4, .beta2 = 0.95, .weight_decay = 0.1, .adamw_mode = false},
                      1.0 / 1024, 100);
}

TEST(AdamStep, FirstStepByHand) {
  // t = 1: m = (1-b1) g, v = (1-b2) g^2, bias-corrected update = g / (|g| + eps) = sign(g)
  // (eps after the square root), so p moves by ~lr.
  AdamHyperparams h{.lr = 0.01, .weight_decay = 0.0};
  const AdamStepConstants c = make_adam_constants(h, 1, 1.0);
  EXPECT_FLOAT_EQ(c.neg_step_size, -0.1f);  // -lr / (1 - 0.9)
  EXPECT_FLOAT_EQ(c.inv_sqrt_bias_correction2, static_cast<float>(1.0 / std::sqrt(0.001)));
  float p = 1.0f, m = 0.0f, v = 0.0f;
  adam_step(c, 2.0f, p, m, v);
  EXPECT_FLOAT_EQ(m, 0.2f);
  EXPECT_FLOAT_EQ(v, 0.004f);
  EXPECT_NEAR(p, 1.0f - 0.01f, 1e-6f);
}

TEST(AdamStep, EpsIsAddedAfterTheBiasCorrectedRoot) {
  // With a tiny gradient the update is g/(|g| + eps): eps is not scaled by sqrt(bc2).
  AdamHyperparams h{.lr = 1.0, .eps = 1e-3, .weight_decay = 0.0};
  const AdamStepConstants c = make_adam_constants(h, 1, 1.0);
  float p = 0.0f, m = 0.0f, v = 0.0f;
  adam_step(c, 1e-3f, p, m, v);
  EXPECT_NEAR(p, -0.5f, 1e-5f);  // 1e-3 / (1e-3 + 1e-3)
}

TEST(AdamStep, DecoupledDecayLeavesTheGradientAlone) {
  const AdamStepConstants w =
      make_adam_constants({.lr = 0.1, .weight_decay = 0.5, .adamw_mode = true}, 1, 1.0);
  EXPECT_FLOAT_EQ(w.neg_lr_decay, -0.05f);
  EXPECT_EQ(w.l2_decay, 0.0f);
  const AdamStepConstants l2 =
      make_adam_constants({.lr = 0.1, .weight_decay = 0.5, .adamw_mode = false}, 1, 1.0);
  EXPECT_EQ(l2.neg_lr_decay, 0.0f);
  EXPECT_FLOAT_EQ(l2.l2_decay, 0.5f);
  // Zero gradient: AdamW shrinks p by lr*wd; L2 Adam sees a gradient of wd*p.
  float p = 2.0f, m = 0.0f, v = 0.0f;
  adam_step(w, 0.0f, p, m, v);
  EXPECT_FLOAT_EQ(p, 1.9f);
  EXPECT_EQ(m, 0.0f);
  p = 2.0f, m = 0.0f, v = 0.0f;
  adam_step(l2, 0.0f, p, m, v);
  EXPECT_FLOAT_EQ(m, 0.1f);  // (1 - 0.9) * 0.5 * 2
}

TEST(AdamStep, SubnormalMomentsAreNotFlushed) {
  const AdamStepConstants c = make_adam_constants({.lr = 1e-3}, 10, 1.0);
  float p = 1.0f, m = 0.0f, v = 0.0f;
  const float g = std::ldexp(1.0f, -130);  // subnormal gradient
  ASSERT_EQ(std::fpclassify(g), FP_SUBNORMAL);
  adam_step(c, g, p, m, v);
  EXPECT_EQ(std::fpclassify(m), FP_SUBNORMAL);
  EXPECT_GT(m, 0.0f);
}

TEST(AdamStep, NonFiniteGradientsGiveNaNParameters) {
  const AdamStepConstants c = make_adam_constants({.lr = 1e-3}, 3, 1.0);
  for (float g : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    float p = 1.0f, m = 0.1f, v = 0.1f;
    adam_step(c, g, p, m, v);
    EXPECT_TRUE(std::isnan(p)) << g;
  }
}

TEST(AdamStep, ConstantsComeFromDoublePrecision) {
  // beta2 = 0.999 at step 1: 1 - 0.999 in float would be 0.00099998713; in
  // double rounded once it is 0.001f.
  const AdamStepConstants c = make_adam_constants({}, 1, 1.0);
  EXPECT_EQ(c.one_minus_beta2, static_cast<float>(1.0 - 0.999));
  EXPECT_EQ(c.one_minus_beta1, static_cast<float>(1.0 - 0.9));
  const AdamStepConstants nobc = make_adam_constants({.bias_correction = false}, 7, 1.0);
  EXPECT_EQ(nobc.inv_sqrt_bias_correction2, 1.0f);
  EXPECT_EQ(nobc.neg_step_size, -1e-3f);
}

TEST(GradScale, ClipAndCombinedFactorFollowDeepSpeed) {
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);  // under the limit: no clipping
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(100.0, 0.0), 1.0);  // clipping off
  EXPECT_DOUBLE_EQ(combined_grad_scale(1024.0, 0.5, 4), 1.0 / 1024 * 0.5 / 4);
}

// --- norm order ---------------------------------------------------------------------

TEST(NormOrder, BlockPartialFollowsTheLaneTree) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  std::vector<float> x(kNormBlockElems);
  for (float& e : x) e = dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  // Independent restatement: lane sums by stride, then the pairwise tree written out.
  double lanes[32] = {};
  for (int j = 0; j < 32; ++j) {
    for (std::int64_t i = j; i < kNormBlockElems; i += 32) {
      lanes[j] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    }
  }
  double l16[16], l8[8], l4[4], l2[2];
  for (int k = 0; k < 16; ++k) l16[k] = lanes[k] + lanes[k + 16];
  for (int k = 0; k < 8; ++k) l8[k] = l16[k] + l16[k + 8];
  for (int k = 0; k < 4; ++k) l4[k] = l8[k] + l8[k + 4];
  for (int k = 0; k < 2; ++k) l2[k] = l4[k] + l4[k + 2];
  const double expected = l2[0] + l2[1];
  const double got = norm_block_partial(x.data(), kNormBlockElems, [](float e) { return e; });
  EXPECT_EQ(std::bit_cast<std::uint64_t>(got), std::bit_cast<std::uint64_t>(expected));
}

TEST(NormOrder, PartialAgreesWithALongDoubleSum) {
  std::vector<std::uint16_t> x(1000);
  std::mt19937 rng(9);
  long double exact = 0;
  for (auto& e : x) {
    e = fp32_to_bf16_bits(std::normal_distribution<float>(0, 2)(rng));
    const long double d = bf16_bits_to_fp32(e);
    exact += d * d;
  }
  const double got = norm_block_partial(x.data(), 1000, bf16_bits_to_fp32);
  EXPECT_NEAR(got, static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
}

TEST(NormOrder, PartialsSumInIndexOrderAndFlagNonFinite) {
  const double partials[] = {1e16, 1.0, -1e16, 1.0};
  // Index order: ((1e16 + 1) - 1e16) + 1 = 0 + 1 = 1 (1e16 + 1 rounds to 1e16).
  EXPECT_EQ(sum_norm_partials(partials, 4), 1.0);
  EXPECT_EQ(norm_block_count(0), 0);
  EXPECT_EQ(norm_block_count(1), 1);
  EXPECT_EQ(norm_block_count(kNormBlockElems), 1);
  EXPECT_EQ(norm_block_count(kNormBlockElems + 1), 2);
  const float bad[] = {1.0f, std::numeric_limits<float>::infinity()};
  EXPECT_TRUE(std::isinf(norm_block_partial(bad, 2, [](float e) { return e; })));
}

}  // namespace
// --- 8-bit blockwise moments ------------------------------------------------

TEST(QuantTables, TheDynamicTreeValuesAscendFromZeroToOne) {
  const QuantTables& t = kQuantTables;
  EXPECT_EQ(t.m_values[0], 0.0f);
  EXPECT_EQ(t.v_values[0], 0.0f);
  EXPECT_EQ(t.m_values[127], 1.0f);
  EXPECT_EQ(t.v_values[255], 1.0f);
  EXPECT_EQ(t.m_values[1], 1e-6f);  // 0000001: six leading zeros, no fraction bits
  EXPECT_EQ(t.v_values[1], 1e-7f);
  EXPECT_EQ(t.m_values[64], static_cast<float>(0.1 + 0.9 / 64));  // 1000000: the first step of [0.1, 1]
  EXPECT_EQ(t.v_values[128], static_cast<float>(0.1 + 0.9 / 128));
  for (int i = 0; i < 127; ++i) {
    ASSERT_LT(t.m_values[i], t.m_values[i + 1]) << i;
    ASSERT_GT(t.m_thresholds[i], t.m_values[i]) << i;
    ASSERT_LT(t.m_thresholds[i], t.m_values[i + 1]) << i;
  }
  for (int i = 0; i < 255; ++i) {
    ASSERT_LT(t.v_values[i], t.v_values[i + 1]) << i;
    ASSERT_GT(t.v_thresholds[i], t.v_values[i]) << i;
    ASSERT_LT(t.v_thresholds[i], t.v_values[i + 1]) << i;
  }
  EXPECT_TRUE(std::isinf(t.m_thresholds[127]));
  EXPECT_TRUE(std::isinf(t.v_thresholds[255]));
}

TEST(QuantTables, TheSearchCountsTheThresholdsBelowAndValuesComeBackExactly) {
  const QuantTables& t = kQuantTables;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-9.0f, 0.5f);
  for (int k = 0; k < 200000; ++k) {
    const float xn = std::pow(10.0f, exponent(rng));
    std::uint32_t below_m = 0, below_v = 0;
    for (int i = 0; i < 127; ++i) below_m += t.m_thresholds[i] < xn;
    for (int i = 0; i < 255; ++i) below_v += t.v_thresholds[i] < xn;
    ASSERT_EQ(quant_search(t.m_thresholds, 7, xn), below_m) << xn;
    ASSERT_EQ(quant_search(t.v_thresholds, 8, xn), below_v) << xn;
  }
  // A threshold itself rounds down; every value is its own code.
  EXPECT_EQ(quant_search(t.m_thresholds, 7, t.m_thresholds[40]), 40u);
  for (int r = 0; r < 128; ++r) {
    ASSERT_EQ(quantize_m(t, t.m_values[r], 1.0f), r);
    if (r > 0) {
      ASSERT_EQ(quantize_m(t, -t.m_values[r], 1.0f), r | 0x80);
    }
    ASSERT_EQ(dequantize_m(t, static_cast<std::uint8_t>(r), 1.0f), t.m_values[r]);
  }
  for (int r = 0; r < 256; ++r) ASSERT_EQ(quantize_v(t, t.v_values[r], 1.0f), r);
  // -0 and tiny negatives are code 0 (+0), never 0x80.
  EXPECT_EQ(quantize_m(t, -0.0f, 1.0f), 0);
  EXPECT_EQ(quantize_m(t, -1e-9f, 1.0f), 0);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(dequantize_m(t, 0, 3.0f)), 0u);
  // The element at the absmax is exact.
  EXPECT_EQ(dequantize_m(t, quantize_m(t, -0.37f, 0.37f), 0.37f), -0.37f);
}

TEST(QuantTables, ScalesThatCannotScaleGiveCodeZero) {
  const QuantTables& t = kQuantTables;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float s : {0.0f, inf, nan, -1.0f}) {
    EXPECT_EQ(quantize_m(t, 0.5f, s), 0) << s;
    EXPECT_EQ(quantize_v(t, 0.5f, s), 0) << s;
  }
  EXPECT_TRUE(std::isnan(block_scale(inf)));
  EXPECT_TRUE(std::isnan(block_scale(nan)));
  EXPECT_EQ(block_scale(2.5f), 2.5f);
  EXPECT_EQ(absmax_step(absmax_step(0.0f, -3.0f), 2.0f), 3.0f);
  EXPECT_TRUE(std::isinf(absmax_step(1.0f, nan)));
}

TEST(AdamInt8Block, AZeroBlockStaysZeroAndANonFiniteMomentPoisonsItsBlock) {
  const QuantTables& t = kQuantTables;
  const AdamStepConstants c = make_adam_constants({.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                                   .weight_decay = 0.0, .adamw_mode = true, .bias_correction = true},
                                                  1, 1.0f);
  std::vector<float> g(kQuantBlockElems, 0.0f), p(kQuantBlockElems, 0.5f);
  std::vector<std::uint8_t> m(kQuantBlockElems, 0), v(kQuantBlockElems, 0);
  float ms = 0.0f, vs = 0.0f;
  adam_step_int8_block(c, t, g.data(), p.data(), m.data(), v.data(), ms, vs, kQuantBlockElems);
  EXPECT_EQ(ms, 0.0f);
  EXPECT_EQ(vs, 0.0f);
  for (int i = 0; i < kQuantBlockElems; ++i) ASSERT_EQ(m[i] | v[i], 0) << i;
  // A gradient: the largest |m| of the block is exact, every code dequantizes near its moment.
  for (int i = 0; i < kQuantBlockElems; ++i) g[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + i % 7);
  std::vector<float> p32(p), m32(kQuantBlockElems, 0.0f), v32(kQuantBlockElems, 0.0f);
  for (int i = 0; i < kQuantBlockElems; ++i) adam_step(c, g[i], p32[i], m32[i], v32[i]);
  adam_step_int8_block(c, t, g.data(), p.data(), m.data(), v.data(), ms, vs, kQuantBlockElems);
  float am = 0.0f;
  for (int i = 0; i < kQuantBlockElems; ++i) {
    ASSERT_EQ(p[i], p32[i]) << i;  // the first step computes with the fp32 moments
    am = std::max(am, std::fabs(m32[i]));
    ASSERT_NEAR(dequantize_m(t, m[i], ms), m32[i], 0.02f * ms) << i;
    ASSERT_NEAR(dequantize_v(t, v[i], vs), v32[i], 0.02f * vs) << i;
  }
  EXPECT_EQ(ms, am);
  // An inf gradient: its block's scales become NaN, and every element of it NaN from then on.
  g[3] = std::numeric_limits<float>::infinity();
  adam_step_int8_block(c, t, g.data(), p.data(), m.data(), v.data(), ms, vs, kQuantBlockElems);
  EXPECT_TRUE(std::isnan(ms));
  EXPECT_TRUE(std::isnan(vs));
  EXPECT_TRUE(std::isnan(dequantize_m(t, m[100], ms)));
}

}  // namespace strata::core::numerics
