// cpu_adam's Adam step with 8-bit blockwise moments: every kernel, thread
// count, tile size and split of the range against
// numerics::adam_step_int8_block applied block by block, bit for bit, for
// every gradient type, with and without the compute copy, short last blocks,
// several steps in a row (the codes feed back), zeros, subnormals, every
// threshold of the code tables and its neighbours, and inf/NaN gradients that
// poison their block and no other; the first step from the zero state against
// the fp32 step; bad input. The vector quantizers' first guess (kernels.h's
// QuantLines) against quant_search over the float range, and the AVX-512
// kernels' dequantization without AVX512_VBMI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "cpu_adam/cpu_adam.h"
#include "cpu_adam/kernels/kernels.h"
#include "tests/cpu_adam/test_gradients.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
constexpr ElemType kGradTypes[] = {ElemType::kF32, ElemType::kBf16, ElemType::kF16};
constexpr std::int64_t kBlock = nx::kQuantBlockElems;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::int64_t blocks_of(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

std::unique_ptr<CpuAdam> make(Isa isa, int threads = 1, std::int64_t tile = 0) {
  CpuAdamOptions o;
  o.auto_isa = false;
  o.isa = isa;
  o.threads = threads;
  o.tile_elems = tile;
  auto r = CpuAdam::create(o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : nullptr;
}

// Bit-equal, or both NaN (NaN signs and payloads are outside the contract).
bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}
bool same_16(std::uint16_t a, std::uint16_t b, ElemType t) {
  if (a == b) return true;
  const std::uint16_t exp_mask = t == ElemType::kBf16 ? 0x7f80 : 0x7c00;
  const std::uint16_t man_mask = t == ElemType::kBf16 ? 0x007f : 0x03ff;
  auto is_nan = [&](std::uint16_t h) { return (h & exp_mask) == exp_mask && (h & man_mask) != 0; };
  return is_nan(a) && is_nan(b);
}

// Master, codes, one scale per block and moment, the gradient in every type,
// and the compute copy.
struct State : test::TestGradients {
  std::vector<float> p;
  std::vector<std::uint8_t> m, v;
  std::vector<float> m_scale, v_scale;
  std::vector<std::uint16_t> out;

  std::int64_t size() const { return static_cast<std::int64_t>(p.size()); }
};

// What a block of random_state holds besides random codes under random scales.
enum class BlockKind {
  kRandom,     // random codes, scales around 1e-2 (m) and 1e-4 (v)
  kZero,       // the zero state: codes and scales 0
  kPoisoned,   // scales NaN (a block that saw a non-finite moment)
  kSubnormal,  // subnormal scales, so subnormal moments, and subnormal gradients
  kNonFinite,  // one inf or NaN gradient
  kInfScale,   // an inf scale (not one a step writes; the product rules still hold)
};

// Random state. With `specials`, blocks of every BlockKind, and gradients that
// are zero, -0, subnormal or near the subnormal range here and there.
State random_state(std::int64_t n, std::uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.g32.resize(n);
  s.out.assign(n, 0xdead);
  const std::int64_t blocks = blocks_of(n);
  s.m_scale.resize(blocks);
  s.v_scale.resize(blocks);
  for (std::int64_t b = 0; b < blocks; ++b) {
    BlockKind kind = BlockKind::kRandom;
    if (specials) {
      switch (rng() % 12) {
        case 0: kind = BlockKind::kZero; break;
        case 1: kind = BlockKind::kPoisoned; break;
        case 2: kind = BlockKind::kSubnormal; break;
        case 3: kind = BlockKind::kNonFinite; break;
        case 4: kind = BlockKind::kInfScale; break;
        default: break;
      }
    }
    s.m_scale[b] = std::fabs(normal(rng)) * 1e-2f;
    s.v_scale[b] = std::fabs(normal(rng)) * 1e-4f;
    if (kind == BlockKind::kZero) s.m_scale[b] = s.v_scale[b] = 0.0f;
    if (kind == BlockKind::kPoisoned) s.m_scale[b] = s.v_scale[b] = kNaN;
    if (kind == BlockKind::kSubnormal) {
      s.m_scale[b] = std::ldexp(s.m_scale[b], -128);
      s.v_scale[b] = std::ldexp(s.v_scale[b], -122);
    }
    if (kind == BlockKind::kInfScale) (rng() % 2 ? s.m_scale[b] : s.v_scale[b]) = kInf;
    const std::int64_t begin = b * kBlock;
    const std::int64_t end = std::min(n, begin + kBlock);
    for (std::int64_t i = begin; i < end; ++i) {
      s.p[i] = normal(rng);
      s.m[i] = kind == BlockKind::kZero ? 0 : static_cast<std::uint8_t>(rng());
      s.v[i] = kind == BlockKind::kZero ? 0 : static_cast<std::uint8_t>(rng());
      float g = normal(rng) * 4.0f;
      if (kind == BlockKind::kSubnormal) g = std::ldexp(g, -135);
      if (specials) {
        switch (rng() % 32) {
          case 0: g = std::ldexp(1.0f, -140); break;  // subnormal
          case 1: g = 0.0f; break;
          case 2: g = -0.0f; break;
          case 3: g = std::ldexp(normal(rng), -120); break;  // near the subnormal range
          case 4: s.p[i] = 0.0f; break;
          default: break;
        }
      }
      s.g32[i] = g;
    }
    if (kind == BlockKind::kNonFinite) {
      const float bad[] = {kInf, -kInf, kNaN, 70000.0f /* inf as fp16 */};
      s.g32[begin + static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(end - begin))] = bad[rng() % 4];
    }
  }
  return s;
}

struct Call {
  nx::AdamStepConstants constants;
  bool copy = false;
  ElemType copy_type = ElemType::kBf16;
};

// The reference: numerics::adam_step_int8_block on each block, with the
// gradient's fp32 values; the copy from the new master.
void reference(State& s, const Call& c) {
  for (std::int64_t b = 0; b < blocks_of(s.size()); ++b) {
    const std::int64_t begin = b * kBlock;
    const int len = static_cast<int>(std::min(kBlock, s.size() - begin));
    float g[kBlock];
    for (int i = 0; i < len; ++i) g[i] = s.grad_f32(begin + i);
    nx::adam_step_int8_block(c.constants, nx::kQuantTables, g, &s.p[begin], &s.m[begin], &s.v[begin], s.m_scale[b],
                             s.v_scale[b], len);
  }
  if (!c.copy) return;
  for (std::int64_t i = 0; i < s.size(); ++i) {
    s.out[i] = c.copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(s.p[i]) : nx::fp32_to_fp16_bits(s.p[i]);
  }
}

// Elements [begin, begin + length), begin a multiple of the block.
AdamStepInt8Args args_for(State& s, const Call& c, std::int64_t begin, std::int64_t length) {
  AdamStepInt8Args a;
  a.constants = c.constants;
  a.master = std::span<float>(s.p).subspan(begin, length);
  a.exp_avg = std::span<std::uint8_t>(s.m).subspan(begin, length);
  a.exp_avg_sq = std::span<std::uint8_t>(s.v).subspan(begin, length);
  a.exp_avg_scale = std::span<float>(s.m_scale).subspan(begin / kBlock, blocks_of(length));
  a.exp_avg_sq_scale = std::span<float>(s.v_scale).subspan(begin / kBlock, blocks_of(length));
  const ConstTypedSpan g = s.grad();
  a.grad = {static_cast<const std::byte*>(g.data) + begin * elem_size_bytes(g.type), g.type, length};
  if (c.copy) a.copy_out = {s.out.data() + begin, c.copy_type, length};
  return a;
}

core::Status run(CpuAdam& adam, State& s, const Call& c) { return adam.step_int8_blockwise(args_for(s, c, 0, s.size())); }

::testing::AssertionResult states_equal(const State& got, const State& want, ElemType copy_type) {
  for (std::int64_t b = 0; b < blocks_of(got.size()); ++b) {
    if (!same(got.m_scale[b], want.m_scale[b]) || !same(got.v_scale[b], want.v_scale[b])) {
      return ::testing::AssertionFailure() << "block " << b << " of " << blocks_of(got.size()) << ": m scale "
                                           << got.m_scale[b] << " vs " << want.m_scale[b] << ", v scale "
                                           << got.v_scale[b] << " vs " << want.v_scale[b];
    }
  }
  for (std::int64_t i = 0; i < got.size(); ++i) {
    if (!same(got.p[i], want.p[i]) || got.m[i] != want.m[i] || got.v[i] != want.v[i] ||
        !same_16(got.out[i], want.out[i], copy_type)) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << got.size() << " (block " << i / kBlock << ", grad " << want.grad_f32(i)
             << "): p " << got.p[i] << " vs " << want.p[i] << ", m " << int{got.m[i]} << " vs " << int{want.m[i]}
             << ", v " << int{got.v[i]} << " vs " << int{want.v[i]} << std::hex << ", out 0x" << got.out[i]
             << " vs 0x" << want.out[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// AdamW, Adam with L2, neither, and both decays at once (a valid struct that
// make_adam_constants does not produce).
std::vector<nx::AdamStepConstants> constants_set() {
  const auto adamw = nx::make_adam_constants({.lr = 1e-3, .beta2 = 0.95, .weight_decay = 0.1}, 7, 1.0 / 1024);
  const auto l2 = nx::make_adam_constants({.lr = 3e-4, .weight_decay = 0.01, .adamw_mode = false}, 1, 0.37);
  const auto plain = nx::make_adam_constants({.lr = 2e-3}, 3, 1.0);
  nx::AdamStepConstants both = l2;
  both.neg_lr_decay = adamw.neg_lr_decay;
  return {adamw, l2, plain, both};
}

// The call of one case of the sweeps: constants picked by the seed, no copy,
// a bf16 copy or an fp16 copy (copy 0, 1, 2).
Call sweep_call(const std::vector<nx::AdamStepConstants>& constants, std::uint32_t seed, int copy) {
  Call c;
  c.constants = constants[seed % constants.size()];
  c.copy = copy != 0;
  c.copy_type = copy == 2 ? ElemType::kF16 : ElemType::kBf16;
  return c;
}

// --- every kernel against the reference -----------------------------------------

class Int8MomentsIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU does not support " << isa_name(GetParam());
  }
};

// Lengths with and without a short last block (and below a vector), every
// gradient type, copy none / bf16 / fp16, four decay shapes, blocks of every
// kind.
TEST_P(Int8MomentsIsa, BitIdenticalToTheReferenceForEveryTypeAndTail) {
  const std::int64_t sizes[] = {1, 2, 7, 8, 15, 16, 17, 100, 255, 256, 257, 511, 512, 513, 4096 + 31, 65536 + 100};
  const auto constants = constants_set();
  auto adam = make(GetParam());
  std::uint32_t seed = 1;
  for (std::int64_t n : sizes) {
    for (ElemType gt : kGradTypes) {
      for (int copy = 0; copy < 3; ++copy) {
        ++seed;
        const Call c = sweep_call(constants, seed, copy);
        State got = random_state(n, seed, /*specials=*/true);
        got.set_grad_type(gt);
        State want = got;
        ASSERT_TRUE(run(*adam, got, c).ok());
        reference(want, c);
        ASSERT_TRUE(states_equal(got, want, c.copy_type))
            << isa_name(GetParam()) << " n=" << n << " grad=" << elem_type_name(gt) << " copy=" << copy;
      }
    }
  }
}

// Eight steps in a row on a multi-tile range (two threads, tiles of 65536):
// each step dequantizes the codes and scales the previous one wrote.
TEST_P(Int8MomentsIsa, SeveralStepsInARowFeedTheCodesBack) {
  constexpr std::int64_t kN = 65536 * 3 + 300;
  auto adam = make(GetParam(), 2, 65536);
  for (ElemType gt : kGradTypes) {
    State got = random_state(kN, 21, /*specials=*/false);
    State want = got;
    std::mt19937 rng(22);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int t = 1; t <= 8; ++t) {
      for (float& g : got.g32) g = normal(rng) * (t % 3 == 0 ? 1e-3f : 2.0f);
      got.set_grad_type(gt);
      want.g32 = got.g32;
      want.set_grad_type(gt);
      Call c;
      c.constants = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, t, 0.5);
      c.copy = t % 2 == 0;
      ASSERT_TRUE(run(*adam, got, c).ok());
      reference(want, c);
      ASSERT_TRUE(states_equal(got, want, ElemType::kBf16))
          << isa_name(GetParam()) << " grad=" << elem_type_name(gt) << " step " << t;
    }
  }
}

// Zero gradients on the zero state without L2 (which would add wd * p to the
// gradient): codes and scales stay 0, and the master moves only by its
// decoupled decay.
TEST_P(Int8MomentsIsa, ZeroGradientsOnTheZeroStateKeepItZero) {
  constexpr std::int64_t kN = 3 * kBlock + 5;
  auto adam = make(GetParam());
  for (const auto& constants : constants_set()) {
    if (constants.l2_decay != 0.0f) continue;
    State got = random_state(kN, 23, false);
    std::fill(got.m.begin(), got.m.end(), 0);
    std::fill(got.v.begin(), got.v.end(), 0);
    std::fill(got.m_scale.begin(), got.m_scale.end(), 0.0f);
    std::fill(got.v_scale.begin(), got.v_scale.end(), 0.0f);
    std::fill(got.g32.begin(), got.g32.end(), 0.0f);
    const State start = got;
    State want = got;
    Call c;
    c.constants = constants;
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam());
    for (std::int64_t i = 0; i < kN; ++i) {
      ASSERT_EQ(got.m[i] | got.v[i], 0) << i;
      const float decayed = std::fma(constants.neg_lr_decay, start.p[i], start.p[i]);
      ASSERT_EQ(got.p[i], constants.neg_lr_decay != 0.0f ? decayed : start.p[i]) << i;
    }
    for (std::int64_t b = 0; b < blocks_of(kN); ++b) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.m_scale[b]), 0u) << b;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.v_scale[b]), 0u) << b;
    }
  }
}

// An inf or NaN gradient makes its block's scales NaN and its codes 0; the
// block's masters are NaN from the next step on, the other blocks never
// notice.
TEST_P(Int8MomentsIsa, ANonFiniteGradientPoisonsItsBlockOnly) {
  constexpr std::int64_t kN = 6 * kBlock + 40;  // the short last block poisoned too
  auto adam = make(GetParam());
  for (float bad : {kInf, -kInf, kNaN}) {
    State got = random_state(kN, 24, false);
    got.g32[kBlock + 17] = bad;
    got.g32[3 * kBlock + 255] = bad;
    got.g32[6 * kBlock + 39] = bad;
    State want = got;
    Call c;
    c.constants = constants_set()[0];
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " " << bad;
    for (std::int64_t b = 0; b < blocks_of(kN); ++b) {
      const bool poisoned = b == 1 || b == 3 || b == 6;
      EXPECT_EQ(std::isnan(got.m_scale[b]), poisoned) << b;
      EXPECT_EQ(std::isnan(got.v_scale[b]), poisoned) << b;
    }
    // The next step with finite gradients: NaN masters in the poisoned blocks only.
    for (float& g : got.g32) g = std::isfinite(g) ? g : 1.0f;
    want.g32 = got.g32;
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " " << bad << ", step 2";
    for (std::int64_t i = 0; i < kN; ++i) {
      const std::int64_t b = i / kBlock;
      ASSERT_EQ(std::isnan(got.p[i]), b == 1 || b == 3 || b == 6) << i;
    }
  }
}

// Subnormal gradients and subnormal moments (subnormal scales): never
// flushed, and the codes do not all collapse to 0.
TEST_P(Int8MomentsIsa, SubnormalGradientsAndMomentsAreKept) {
  constexpr std::int64_t kN = 8 * kBlock + 77;
  auto adam = make(GetParam());
  State got = random_state(kN, 25, false);
  for (std::int64_t b = 0; b < blocks_of(kN); ++b) {
    got.m_scale[b] = std::ldexp(std::fabs(got.m_scale[b]) + 1e-3f, -128);
    got.v_scale[b] = b % 2 ? std::ldexp(got.v_scale[b] + 1e-5f, -120) : 0.0f;
  }
  for (float& g : got.g32) g = std::ldexp(g, -132);
  State want = got;
  Call c;
  c.constants = constants_set()[2];
  ASSERT_TRUE(run(*adam, got, c).ok());
  reference(want, c);
  ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam());
  std::int64_t nonzero_m = 0;
  for (std::int64_t b = 0; b < blocks_of(kN); ++b) {
    ASSERT_GT(got.m_scale[b], 0.0f) << b;
    ASSERT_LT(got.m_scale[b], std::numeric_limits<float>::min()) << b;  // still subnormal
  }
  for (std::uint8_t code : got.m) nonzero_m += code != 0;
  EXPECT_GT(nonzero_m, kN / 2);
}

// Blocks of `values` as gradients, each block led by `absmax` (its m's
// scale; v's is its square), values beyond it clamped to it.
std::vector<float> blocks_led_by(const std::vector<float>& values, float absmax) {
  std::vector<float> grads;
  for (float x : values) {
    if (grads.size() % kBlock == 0) grads.push_back(absmax);
    grads.push_back(std::fabs(x) < absmax ? x : std::copysign(absmax, x));
  }
  return grads;
}

// Constants under which the new m is the gradient and the new v its square.
nx::AdamStepConstants moments_are_the_gradient() {
  nx::AdamStepConstants c;
  c.beta1 = 0.0f;
  c.beta2 = 0.0f;
  c.one_minus_beta1 = 1.0f;
  c.one_minus_beta2 = 1.0f;
  return c;
}

// With beta1 = beta2 = 0 and grad_scale 1, the new m is the gradient itself,
// so a block whose absmax is 1 quantizes the gradient directly: every m
// threshold, its neighbours above and below, and both signs; v = g * g lands
// next to every v threshold.
TEST_P(Int8MomentsIsa, EveryThresholdAndItsNeighboursQuantizeAsTheReference) {
  const nx::QuantTables& t = nx::kQuantTables;
  std::vector<float> values;
  for (int i = 0; i < 127; ++i) {
    const float th = t.m_thresholds[i];
    for (float x : {std::nextafter(th, 0.0f), th, std::nextafter(th, 2.0f)}) {
      values.push_back(x);
      values.push_back(-x);
    }
  }
  for (int i = 0; i < 255; ++i) {
    const float g = std::sqrt(t.v_thresholds[i]);
    for (float x : {std::nextafter(g, 0.0f), g, std::nextafter(g, 2.0f)}) values.push_back(x);
  }
  for (int r = 0; r < 128; ++r) values.push_back(t.m_values[r]);
  // Blocks of 255 such gradients after a 1: the absmax, so the scale, is 1.
  const std::vector<float> grads = blocks_led_by(values, 1.0f);
  const auto n = static_cast<std::int64_t>(grads.size());
  const nx::AdamStepConstants c0 = moments_are_the_gradient();
  auto adam = make(GetParam());
  for (ElemType gt : {ElemType::kF32, ElemType::kBf16}) {
    State got = random_state(n, 26, false);
    got.g32 = grads;
    got.set_grad_type(gt);
    State want = got;
    Call c;
    c.constants = c0;
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " " << elem_type_name(gt);
    if (gt == ElemType::kF32) {
      // Each threshold itself rounds down, the value above it up: every code is reached.
      std::vector<bool> seen_m(256), seen_v(256);
      for (std::int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got.m[i], nx::quantize_m(t, grads[i], 1.0f)) << i;
        seen_m[got.m[i]] = true;
        seen_v[got.v[i]] = true;
      }
      for (int r = 0; r < 256; ++r) {
        EXPECT_TRUE(seen_m[r] || r == 0x80) << "m code " << r;
        EXPECT_TRUE(seen_v[r]) << "v code " << r;
      }
    }
  }
}

// The same at scales other than 1, where x / scale is a rounded division
// (the AVX-512 and AVX2 quantizers guess from x times the scale's
// reciprocal and divide only near a step): every threshold times the scale and its
// neighbours two ulps either way, at scales whose v scale (their square) is
// a normal float, and at scales whose m or v scale or its reciprocal is not
// (the division throughout).
TEST_P(Int8MomentsIsa, EveryThresholdAtScalesOtherThanOneQuantizesAsTheReference) {
  const nx::QuantTables& t = nx::kQuantTables;
  auto adam = make(GetParam());
  for (float s : {0.3f, 1.7f, 3.14159e-3f, 12345.678f, 7.1e-19f, 0x1p-62f * 1.37f, 0x1p-70f * 1.11f, 0x1p62f * 1.21f,
                  0x1p64f * 1.5f, 0x1p126f * 1.5f, 0x1p-126f, std::nextafter(0x1p126f, 0.0f), 0x1p-127f * 1.5f}) {
    std::vector<float> values;
    const auto around = [&](float x, bool both_signs) {
      float lo = x, hi = x;
      for (int k = 0; k < 2; ++k) {
        lo = std::nextafter(lo, 0.0f);
        hi = std::nextafter(hi, 2.0f * x);
      }
      for (float y = lo; y <= hi; y = std::nextafter(y, 2.0f * x)) {
        values.push_back(y);
        if (both_signs) values.push_back(-y);
      }
    };
    for (int i = 0; i < 127; ++i) around(t.m_thresholds[i] * s, true);
    if (std::isfinite(s * s)) {
      for (int i = 0; i < 255; ++i) around(std::sqrt(t.v_thresholds[i]) * s, false);
    }
    const std::vector<float> grads = blocks_led_by(values, s);
    const auto n = static_cast<std::int64_t>(grads.size());
    State got = random_state(n, 27, false);
    got.g32 = grads;
    got.set_grad_type(ElemType::kF32);
    State want = got;
    Call c;
    c.constants = moments_are_the_gradient();
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " scale " << s;
  }
}

// The first step from the zero state computes with the fp32 moments: its
// masters are those of numerics::adam_step with zero moments (checked
// without adam_step_int8_block).
TEST_P(Int8MomentsIsa, TheFirstStepFromZeroIsTheFp32Step) {
  constexpr std::int64_t kN = 5 * kBlock + 9;
  auto adam = make(GetParam());
  for (const auto& constants : constants_set()) {
    State got = random_state(kN, 27, false);
    std::fill(got.m.begin(), got.m.end(), 0);
    std::fill(got.v.begin(), got.v.end(), 0);
    std::fill(got.m_scale.begin(), got.m_scale.end(), 0.0f);
    std::fill(got.v_scale.begin(), got.v_scale.end(), 0.0f);
    const State start = got;
    Call c;
    c.constants = constants;
    ASSERT_TRUE(run(*adam, got, c).ok());
    for (std::int64_t i = 0; i < kN; ++i) {
      float p = start.p[i], m = 0.0f, v = 0.0f;
      nx::adam_step(constants, start.grad_f32(i), p, m, v);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got.p[i]), std::bit_cast<std::uint32_t>(p)) << i;
      // The codes name values within the code spacing of the moments.
      ASSERT_NEAR(nx::dequantize_m(nx::kQuantTables, got.m[i], got.m_scale[i / kBlock]), m,
                  0.03f * got.m_scale[i / kBlock])
          << i;
      ASSERT_NEAR(nx::dequantize_v(nx::kQuantTables, got.v[i], got.v_scale[i / kBlock]), v,
                  0.03f * got.v_scale[i / kBlock])
          << i;
    }
  }
}

// Updating [0, n) in one call equals calls over ranges split on block
// boundaries (each with its own scales' subspan).
TEST_P(Int8MomentsIsa, CallsSplitOnBlockBoundariesEqualOneCall) {
  constexpr std::int64_t kN = 12 * kBlock + 100;
  auto adam = make(GetParam());
  Call c;
  c.constants = constants_set()[1];
  c.copy = true;
  State whole = random_state(kN, 28, true);
  whole.set_grad_type(ElemType::kF16);
  const State start = whole;
  ASSERT_TRUE(run(*adam, whole, c).ok());
  for (std::int64_t k : {kBlock, 5 * kBlock, 12 * kBlock}) {
    State split = start;
    ASSERT_TRUE(adam->step_int8_blockwise(args_for(split, c, 0, k)).ok());
    ASSERT_TRUE(adam->step_int8_blockwise(args_for(split, c, k, kN - k)).ok());
    ASSERT_TRUE(states_equal(split, whole, ElemType::kBf16)) << isa_name(GetParam()) << " split at " << k;
  }
}

// A range of many tiles on two threads, three steps, against the reference.
TEST_P(Int8MomentsIsa, LargeRangeMatchesTheReferenceOverSteps) {
  constexpr std::int64_t kN = 1'000'000 + 5;
  auto adam = make(GetParam(), 2);
  State got = random_state(kN, 29, true);
  got.set_grad_type(ElemType::kBf16);
  State want = got;
  for (int t = 1; t <= 3; ++t) {
    Call c;
    c.constants = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, t, 0.5);
    c.copy = true;
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " step " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Int8MomentsIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

// Every supported ISA, 1-3 threads and three tile sizes give the bits of the
// scalar kernel on one thread and one tile.
TEST(Int8Moments, ThreadCountTileSizeAndIsaDoNotChangeTheBits) {
  constexpr std::int64_t kN = 65536 * 5 + 123;
  Call c;
  c.constants = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.05}, 11, 0.25);
  c.copy = true;
  State base = random_state(kN, 42, true);
  base.set_grad_type(ElemType::kBf16);
  State expect = base;
  ASSERT_TRUE(run(*make(Isa::kScalar, 1, 65536 * 16), expect, c).ok());
  for (Isa isa : kAllIsas) {
    if (!isa_supported(isa)) continue;
    for (int threads : {1, 2, 3}) {
      for (std::int64_t tile : {65536, 65536 * 2, 65536 * 4}) {
        State s = base;
        ASSERT_TRUE(run(*make(isa, threads, tile), s, c).ok());
        EXPECT_TRUE(states_equal(s, expect, ElemType::kBf16))
            << isa_name(isa) << " " << threads << " threads, tile " << tile;
      }
    }
  }
}

// --- bad input ------------------------------------------------------------------

class Int8MomentsBadInput : public ::testing::Test {
 protected:
  static constexpr std::int64_t kN = 300;  // two blocks, the second short

  void SetUp() override {
    s_ = random_state(kN, 1, false);
    args_.constants = nx::make_adam_constants({}, 1, 1.0);
    args_.master = s_.p;
    args_.exp_avg = s_.m;
    args_.exp_avg_sq = s_.v;
    args_.exp_avg_scale = s_.m_scale;
    args_.exp_avg_sq_scale = s_.v_scale;
    args_.grad = {s_.g32.data(), ElemType::kF32, kN};
  }
  // The error's message; nothing may have been written.
  std::string error() {
    const State before = s_;
    const core::Status st = adam_->step_int8_blockwise(args_);
    EXPECT_EQ(st.code(), core::StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_EQ(s_.p, before.p);
    EXPECT_EQ(s_.m, before.m);
    EXPECT_EQ(s_.v, before.v);
    EXPECT_EQ(s_.m_scale, before.m_scale);
    EXPECT_EQ(s_.v_scale, before.v_scale);
    return std::string(st.message());
  }
  State s_;
  AdamStepInt8Args args_;
  std::unique_ptr<CpuAdam> adam_ = make(best_isa(), 1);
};

TEST_F(Int8MomentsBadInput, TheArgumentsAreValidAsWritten) {
  EXPECT_EQ(s_.m_scale.size(), 2u);
  EXPECT_TRUE(adam_->step_int8_blockwise(args_).ok());
}
TEST_F(Int8MomentsBadInput, ZeroLength) {
  args_.master = {};
  EXPECT_NE(error().find("zero elements"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, SizesDiffer) {
  args_.exp_avg_sq = std::span<std::uint8_t>(s_.v).first(10);
  const std::string e = error();
  EXPECT_NE(e.find("sizes differ"), std::string::npos) << e;
  EXPECT_NE(e.find("exp_avg_sq 10"), std::string::npos) << e;
}
TEST_F(Int8MomentsBadInput, TooFewScales) {
  args_.exp_avg_scale = std::span<float>(s_.m_scale).first(1);
  const std::string e = error();
  EXPECT_NE(e.find("exp_avg_scale holds 1 scales"), std::string::npos) << e;
  EXPECT_NE(e.find("= 2"), std::string::npos) << e;
}
TEST_F(Int8MomentsBadInput, TooManyScales) {
  std::vector<float> scales(3, 1.0f);
  args_.exp_avg_sq_scale = scales;
  EXPECT_NE(error().find("exp_avg_sq_scale holds 3 scales"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, ScalesOverlap) {
  std::vector<float> both(3);
  args_.exp_avg_scale = std::span<float>(both).first(2);
  args_.exp_avg_sq_scale = std::span<float>(both).subspan(1, 2);
  EXPECT_NE(error().find("exp_avg_scale and exp_avg_sq_scale overlap"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, ScaleInsideTheMaster) {
  args_.exp_avg_scale = std::span<float>(s_.p).subspan(100, 2);
  EXPECT_NE(error().find("master and exp_avg_scale overlap"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, CodesOverlap) {
  std::vector<std::uint8_t> both(400);
  args_.exp_avg = std::span<std::uint8_t>(both).first(kN);
  args_.exp_avg_sq = std::span<std::uint8_t>(both).subspan(50, kN);
  EXPECT_NE(error().find("exp_avg and exp_avg_sq overlap"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, CodesInsideTheGradient) {
  args_.exp_avg = std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(s_.g32.data()) + 7, kN);
  EXPECT_NE(error().find("exp_avg and grad overlap"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, MisalignedScale) {
  std::vector<float> buf(4);
  args_.exp_avg_scale = std::span<float>(reinterpret_cast<float*>(reinterpret_cast<char*>(buf.data()) + 2), 2);
  const std::string e = error();
  EXPECT_NE(e.find("exp_avg_scale at"), std::string::npos) << e;
  EXPECT_NE(e.find("not aligned"), std::string::npos) << e;
}
TEST_F(Int8MomentsBadInput, BadConstants) {
  args_.constants.beta2 = -0.5f;
  EXPECT_NE(error().find("beta2"), std::string::npos);
  args_.constants = nx::make_adam_constants({}, 1, 1.0);
  args_.constants.grad_scale = kInf;
  EXPECT_NE(error().find("not finite"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, Fp32CopyOut) {
  std::vector<float> out(kN);
  args_.copy_out = {out.data(), ElemType::kF32, kN};
  EXPECT_NE(error().find("copy_out must be bf16 or fp16"), std::string::npos);
}
TEST_F(Int8MomentsBadInput, CopyOutOfAnotherSize) {
  std::vector<std::uint16_t> out(kN - 1);
  args_.copy_out = {out.data(), ElemType::kBf16, kN - 1};
  EXPECT_NE(error().find("copy_out 299"), std::string::npos);
}


// --- the vector quantizers' first guess (kernels.h) ---------------------------------

// Where quant_guess calls its guess exact, it is quant_search's count; where
// it does not, xn is near a threshold (within 2^-10 of a step).
// (`all` set: QuantAllLines' guess, the AVX2 kernel's, instead of the bins'.)
struct GuessChecker {
  const kernels::QuantLines& lines;
  const kernels::QuantAllLines* all;
  const float* thresholds;
  int steps;
  std::int64_t checked = 0;
  std::int64_t inexact = 0;

  ::testing::AssertionResult check(float xn) {
    const kernels::QuantGuess g = all != nullptr ? kernels::quant_guess(*all, xn) : kernels::quant_guess(lines, xn);
    const std::uint32_t want = nx::quant_search(thresholds, steps, xn);
    ++checked;
    if (!g.exact) {
      ++inexact;
      // The lane is sent to the search: it must be near a threshold.
      const float below = want > 0 ? thresholds[want - 1] : 0.0f;
      const float above = thresholds[want];
      const double step = static_cast<double>(above) - static_cast<double>(below);
      const double dist = std::min(static_cast<double>(xn) - below, static_cast<double>(above) - xn);
      if (want > 0 && dist > step / 1024.0) {
        return ::testing::AssertionFailure() << "xn " << std::hexfloat << xn << " is far from every threshold but "
                                             << "was not guessed (count " << std::dec << want << ")";
      }
      return ::testing::AssertionSuccess();
    }
    if (g.code != want) {
      return ::testing::AssertionFailure() << "xn " << std::hexfloat << xn << ": guess " << std::dec << g.code
                                           << ", quant_search " << want;
    }
    return ::testing::AssertionSuccess();
  }
};

std::vector<GuessChecker> guess_checkers() {
  const kernels::QuantKernelTables& k = kernels::quant_kernel_tables();
  return {GuessChecker{k.m_lines, nullptr, nx::kQuantTables.m_thresholds, 7},
          GuessChecker{k.v_lines, nullptr, nx::kQuantTables.v_thresholds, 8},
          GuessChecker{k.m_lines, &k.m_all_lines, nx::kQuantTables.m_thresholds, 7},
          GuessChecker{k.v_lines, &k.v_all_lines, nx::kQuantTables.v_thresholds, 8}};
}

// Every threshold and the 64 floats on either side, every bin edge of the
// lines and every power of ten (where the decades meet) likewise, 0, the
// subnormals' edge, 1, and every 61st float in [0, 1].
TEST(QuantGuess, AgreesWithTheSearchAtEveryEdgeAndOverTheRange) {
  // The AVX2 kernel unrolls 7 and 8 lines.
  ASSERT_EQ(kernels::quant_kernel_tables().m_all_lines.count, 7);
  ASSERT_EQ(kernels::quant_kernel_tables().v_all_lines.count, 8);
  for (GuessChecker& c : guess_checkers()) {
    std::vector<float> centres;
    for (int i = 0; i < (1 << c.steps) - 1; ++i) centres.push_back(c.thresholds[i]);
    for (std::uint32_t j = 0; j < 16; ++j) centres.push_back(std::bit_cast<float>(c.lines.lo + (j << 24)));
    centres.push_back(nx::kQuantTables.m_values[1]);
    centres.push_back(nx::kQuantTables.v_values[1]);
    for (float p = 1.0f; p > 1e-9f; p /= 10.0f) centres.push_back(p);
    centres.push_back(std::numeric_limits<float>::min());
    for (float x : centres) {
      float lo = x, hi = x;
      for (int k = 0; k <= 64; ++k) {
        if (lo >= 0.0f && lo <= 1.0f) {
          ASSERT_TRUE(c.check(lo)) << "steps " << c.steps;
        }
        if (hi >= 0.0f && hi <= 1.0f) {
          ASSERT_TRUE(c.check(hi)) << "steps " << c.steps;
        }
        lo = std::nextafter(lo, -1.0f);
        hi = std::nextafter(hi, 2.0f);
      }
    }
    ASSERT_TRUE(c.check(0.0f));
    ASSERT_TRUE(c.check(1.0f));
    for (std::uint32_t b = 0; b <= 0x3f800000u; b += 61) ASSERT_TRUE(c.check(std::bit_cast<float>(b)));
    // The search is the exception, not the rule.
    EXPECT_LT(c.inexact * 100, c.checked) << "steps " << c.steps;
  }
}

// Every float in [0, 1] (the slow suite: STRATA_INT8_EXHAUSTIVE=1).
TEST(QuantGuess, AgreesWithTheSearchForEveryFloatInTheUnitInterval) {
  const char* env = std::getenv("STRATA_INT8_EXHAUSTIVE");
  if (env == nullptr || env[0] != '1') GTEST_SKIP() << "set STRATA_INT8_EXHAUSTIVE=1 (the slow suite does)";
  for (GuessChecker& c : guess_checkers()) {
    for (std::uint32_t b = 0; b <= 0x3f800000u; ++b) ASSERT_TRUE(c.check(std::bit_cast<float>(b)));
  }
}

// --- the AVX-512 kernels without AVX512_VBMI -------------------------------------------

// The kernel entry points that dequantize with float lookups, called directly
// (CpuAdam takes the VBMI way where the CPU has it): random blocks of every
// kind, every gradient type and copy, short last blocks, and gradients next to
// every threshold.
TEST(Int8MomentsNoVbmi, BitIdenticalToTheReference) {
  if (!isa_supported(Isa::kAvx512)) GTEST_SKIP() << "this CPU does not support avx512";
  struct Entry {
    void (*fn)(const kernels::AdamInt8KernelArgs&);
    Isa isa;
  };
  const Entry entries[] = {{kernels::adam_int8_avx512_no_vbmi, Isa::kAvx512},
                           {kernels::adam_int8_avx512_bf16_no_vbmi, Isa::kAvx512Bf16}};
  const auto constants = constants_set();
  std::uint32_t seed = 100;
  for (const Entry& e : entries) {
    if (!isa_supported(e.isa)) continue;
    for (std::int64_t n : {std::int64_t{256}, std::int64_t{300}, std::int64_t{4096 + 31}}) {
      for (ElemType gt : kGradTypes) {
        for (int copy = 0; copy < 3; ++copy) {
          ++seed;
          const Call c = sweep_call(constants, seed, copy);
          State got = random_state(n, seed, /*specials=*/true);
          got.set_grad_type(gt);
          State want = got;
          const ConstTypedSpan g = got.grad();
          const kernels::AdamInt8KernelArgs k{&c.constants, got.p.data(),  got.m.data(),       got.v.data(),
                                              got.m_scale.data(), got.v_scale.data(), g.data, g.type,
                                              c.copy ? got.out.data() : nullptr, c.copy_type, n};
          e.fn(k);
          reference(want, c);
          ASSERT_TRUE(states_equal(got, want, c.copy_type))
              << isa_name(e.isa) << " n=" << n << " grad=" << elem_type_name(gt) << " copy=" << copy;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::adam
