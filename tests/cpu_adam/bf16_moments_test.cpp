// cpu_adam's Adam step with bf16 moments: every kernel, thread count, tile size
// and split of the range against numerics::adam_step_bf16_moments applied
// element by element with numerics::stochastic_rounding_bits, bit for bit, for
// both roundings, every gradient type, tails, zeros, subnormals and inf/nan;
// nearest even against the fp32 step followed by fp32_to_bf16_bits; stochastic
// rounding's neighbours and its mean over seeds; the generator pinned to
// values computed from its definition outside C++; bad input.
#include <gtest/gtest.h>

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
#include "tests/cpu_adam/test_gradients.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;
using nx::AdamMoment;
using nx::Bf16Rounding;

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
constexpr ElemType kGradTypes[] = {ElemType::kF32, ElemType::kBf16, ElemType::kF16};
constexpr Bf16Rounding kRoundings[] = {Bf16Rounding::kNearestEven, Bf16Rounding::kStochastic};

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

const char* rounding_name(Bf16Rounding r) { return r == Bf16Rounding::kStochastic ? "stochastic" : "nearest-even"; }

// Bit-equal, or both NaN (NaN signs and payloads are outside the contract).
bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}
bool is_nan_bf16(std::uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x007f) != 0; }
bool same_bf16(std::uint16_t a, std::uint16_t b) { return a == b || (is_nan_bf16(a) && is_nan_bf16(b)); }
bool same_16(std::uint16_t a, std::uint16_t b, ElemType t) {
  if (t == ElemType::kBf16) return same_bf16(a, b);
  auto is_nan = [](std::uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0; };
  return a == b || (is_nan(a) && is_nan(b));
}

// Master, bf16 moments, the gradient in every type, the compute copy, and
// where the range sits in the global index space.
struct State : test::TestGradients {
  std::vector<float> p;
  std::vector<std::uint16_t> m, v;
  std::vector<std::uint16_t> out;

  std::int64_t size() const { return static_cast<std::int64_t>(p.size()); }
};

// Random state. `specials` sprinkles zero, -0, subnormal, inf, NaN (one with
// every payload bit set) and beyond-fp16 gradients, zero, subnormal and non-finite moments, and zero
// and subnormal masters.
State random_state(std::int64_t n, std::uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.g32.resize(n);
  s.out.assign(n, 0xdead);
  for (std::int64_t i = 0; i < n; ++i) {
    s.p[i] = normal(rng);
    float m = normal(rng) * 0.01f, v = std::fabs(normal(rng)) * 1e-4f;
    float g = normal(rng) * 4.0f;
    if (specials) {
      switch (rng() % 48) {
        case 0: g = std::ldexp(1.0f, -140); break;  // subnormal
        case 1: g = 0.0f; break;
        case 2: g = -0.0f; break;
        case 3: g = std::numeric_limits<float>::infinity(); break;
        case 4: g = -std::numeric_limits<float>::infinity(); break;
        case 5: g = std::numeric_limits<float>::quiet_NaN(); break;
        case 6: g = 70000.0f; break;  // beyond fp16
        case 7:  // zero moments and gradient
          m = 0.0f;
          v = 0.0f;
          g = 0.0f;
          break;
        case 8:  // subnormal moments and gradient (m and v stay in the subnormal range)
          m = std::ldexp(normal(rng), -130);
          v = std::ldexp(std::fabs(normal(rng)), -133);
          g = std::ldexp(normal(rng), -140);
          break;
        case 9:  // a subnormal master that stays subnormal
          s.p[i] = std::ldexp(normal(rng), -130);
          m = 0.0f;
          g = 0.0f;
          break;
        case 10: m = std::numeric_limits<float>::infinity(); break;   // an inf moment stays inf
        case 11: v = std::numeric_limits<float>::quiet_NaN(); break;  // a NaN moment stays NaN
        case 12: s.p[i] = 0.0f; break;
        case 13:  // a NaN whose payload fills the low 16 bits: adding random bits to it
                  // would carry out of the exponent (fp32 gradients keep the payload)
          g = std::bit_cast<float>(rng() % 2 ? 0x7fffffffu : 0xffffffffu);
          break;
        default: break;
      }
    }
    s.m[i] = nx::fp32_to_bf16_bits(m);
    s.v[i] = nx::fp32_to_bf16_bits(v);
    s.g32[i] = g;
  }
  return s;
}

struct Call {
  nx::AdamStepConstants constants;
  Bf16Rounding rounding = Bf16Rounding::kNearestEven;
  std::uint64_t seed = 0;
  std::int64_t step = 1;
  std::int64_t index_base = 0;
  bool copy = false;
  ElemType copy_type = ElemType::kBf16;
};

// The reference: numerics.h element by element, the random bits from the
// generator's full form (seed, step, index, moment).
void reference(State& s, const Call& c) {
  for (std::int64_t i = 0; i < s.size(); ++i) {
    const std::int64_t index = c.index_base + i;
    const std::uint32_t bits_m = nx::stochastic_rounding_bits(c.seed, c.step, index, AdamMoment::kExpAvg);
    const std::uint32_t bits_v = nx::stochastic_rounding_bits(c.seed, c.step, index, AdamMoment::kExpAvgSq);
    nx::adam_step_bf16_moments(c.constants, s.grad_f32(i), s.p[i], s.m[i], s.v[i], c.rounding, bits_m, bits_v);
    if (c.copy) {
      s.out[i] = c.copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(s.p[i]) : nx::fp32_to_fp16_bits(s.p[i]);
    }
  }
}

AdamStepBf16MomentsArgs args_for(State& s, const Call& c, std::int64_t begin, std::int64_t length) {
  AdamStepBf16MomentsArgs a;
  a.constants = c.constants;
  a.master = std::span<float>(s.p).subspan(begin, length);
  a.exp_avg = std::span<std::uint16_t>(s.m).subspan(begin, length);
  a.exp_avg_sq = std::span<std::uint16_t>(s.v).subspan(begin, length);
  const ConstTypedSpan g = s.grad();
  a.grad = {static_cast<const std::byte*>(g.data) + begin * elem_size_bytes(g.type), g.type, length};
  if (c.copy) a.copy_out = {s.out.data() + begin, c.copy_type, length};
  a.rounding = c.rounding;
  a.seed = c.seed;
  a.step = c.step;
  a.index_base = c.index_base + begin;
  return a;
}

core::Status run(CpuAdam& adam, State& s, const Call& c) { return adam.step_bf16_moments(args_for(s, c, 0, s.size())); }

::testing::AssertionResult states_equal(const State& got, const State& want, ElemType copy_type) {
  for (std::int64_t i = 0; i < got.size(); ++i) {
    if (!same(got.p[i], want.p[i]) || !same_bf16(got.m[i], want.m[i]) || !same_bf16(got.v[i], want.v[i]) ||
        !same_16(got.out[i], want.out[i], copy_type)) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << got.size() << " (grad " << want.grad_f32(i) << "): p " << got.p[i]
             << " vs " << want.p[i] << std::hex << ", m 0x" << got.m[i] << " vs 0x" << want.m[i] << ", v 0x"
             << got.v[i] << " vs 0x" << want.v[i] << ", out 0x" << got.out[i] << " vs 0x" << want.out[i];
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

// The bf16 values just below and above x in magnitude (trunc and trunc + 1 ulp
// on the pattern), for a finite x.
std::uint16_t bf16_toward_zero(float x) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16); }

// --- the scalar reference ---------------------------------------------------

// Values computed from the definition in numerics.h by an independent Python
// implementation: a change to the generator changes every stored run's bits,
// so it must be deliberate.
TEST(Bf16MomentsGenerator, MatchesItsDefinition) {
  EXPECT_EQ(nx::stochastic_rounding_key(0, 1), 0x9e0160293a33aaf7ull);
  EXPECT_EQ(nx::stochastic_rounding_hash(0x9e0160293a33aaf7ull, 0), 0x52bd6dc7u);
  EXPECT_EQ(nx::stochastic_rounding_hash(0x9e0160293a33aaf7ull, 1), 0x6082e3a0u);
  EXPECT_EQ(nx::stochastic_rounding_key(42, 7), 0xaebdb1a5611cee63ull);
  EXPECT_EQ(nx::stochastic_rounding_hash(0xaebdb1a5611cee63ull, 123456789), 0x59b5de45u);
  EXPECT_EQ(nx::stochastic_rounding_key(0xdeadbeefcafef00dull, 1000000), 0xf4ec3ba8ec17f2f9ull);
  EXPECT_EQ(nx::stochastic_rounding_hash(0xf4ec3ba8ec17f2f9ull, (1ull << 32) + 5), 0xef2ee4f8u);
  EXPECT_EQ(nx::stochastic_rounding_key(1, -1), 0x75222573cc8a0d24ull);
  EXPECT_EQ(nx::stochastic_rounding_hash(0x75222573cc8a0d24ull, (1ull << 40) - 1), 0xf307adb0u);
  // The full form is the two stages; m takes the low half, v the high half.
  EXPECT_EQ(nx::stochastic_rounding_bits(42, 7, 123456789, AdamMoment::kExpAvg), 0xde45u);
  EXPECT_EQ(nx::stochastic_rounding_bits(42, 7, 123456789, AdamMoment::kExpAvgSq), 0x59b5u);
}

// Each of the 32 bits is set about half the time over a million consecutive
// indices, and the 16-bit draws average 32767.5: stated tolerance 0.3% of the
// count (the standard deviation is 0.05%).
TEST(Bf16MomentsGenerator, BitsAreBalancedOverConsecutiveIndices) {
  constexpr std::int64_t kN = 1 << 20;
  const std::uint64_t key = nx::stochastic_rounding_key(7, 3);
  std::int64_t ones[32] = {};
  double sum_m = 0, sum_v = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    const std::uint32_t x = nx::stochastic_rounding_hash(key, static_cast<std::uint64_t>(i));
    for (int b = 0; b < 32; ++b) ones[b] += (x >> b) & 1u;
    sum_m += nx::stochastic_rounding_bits(key, i, AdamMoment::kExpAvg);
    sum_v += nx::stochastic_rounding_bits(key, i, AdamMoment::kExpAvgSq);
  }
  for (int b = 0; b < 32; ++b) EXPECT_NEAR(ones[b], kN / 2, 0.003 * kN) << "bit " << b;
  EXPECT_NEAR(sum_m / kN, 32767.5, 0.003 * 65536);
  EXPECT_NEAR(sum_v / kN, 32767.5, 0.003 * 65536);
}

// Over all 65536 draws, bf16_round_stochastic gives one of the two neighbours,
// rounds up exactly (low 16 bits) times, so the sum is 65536 x exactly; a bf16
// value stays itself; inf stays inf; NaN stays NaN.
TEST(Bf16MomentsReference, RoundStochasticIsANeighbourAndExactlyUnbiased) {
  std::mt19937 rng(5);
  std::vector<float> xs = {1.0f, -1.0f, 0.0f, -0.0f, 1.00390625f, std::ldexp(1.0f, -140), -std::ldexp(3.0f, -141),
                           std::nextafter(2.0f, 0.0f), -std::nextafter(1.0f, 2.0f)};
  for (int k = 0; k < 200; ++k) {
    xs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng()) & 0xbfffffffu));  // |x| < 2
    xs.push_back(std::ldexp(std::bit_cast<float>((static_cast<std::uint32_t>(rng()) & 0x807fffffu) | 0x3f800000u),
                            static_cast<int>(rng() % 250) - 140));
  }
  for (float x : xs) {
    ASSERT_TRUE(std::isfinite(x));
    const std::uint16_t lo = bf16_toward_zero(x);
    const std::uint32_t frac = std::bit_cast<std::uint32_t>(x) & 0xffffu;
    double sum = 0;
    std::uint32_t ups = 0;
    for (std::uint32_t bits = 0; bits < 65536; ++bits) {
      const std::uint16_t r = nx::bf16_round_stochastic(x, bits | 0xabcd0000u);  // upper half ignored
      ASSERT_TRUE(r == lo || r == lo + 1) << x << " bits " << bits;
      if (frac == 0) {
        ASSERT_EQ(r, lo) << x;
      }
      ups += r != lo;
      sum += nx::bf16_bits_to_fp32(r);
    }
    EXPECT_EQ(ups, frac) << x;
    EXPECT_EQ(sum, 65536.0 * static_cast<double>(x)) << x;
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (std::uint32_t bits : {0u, 1u, 0x8000u, 0xffffu}) {
    EXPECT_EQ(nx::bf16_round_stochastic(inf, bits), 0x7f80);
    EXPECT_EQ(nx::bf16_round_stochastic(-inf, bits), 0xff80);
    EXPECT_TRUE(is_nan_bf16(nx::bf16_round_stochastic(std::numeric_limits<float>::quiet_NaN(), bits)));
    EXPECT_TRUE(is_nan_bf16(nx::bf16_round_stochastic(std::bit_cast<float>(0x7f800001u), bits)));  // low payload
    EXPECT_TRUE(is_nan_bf16(nx::bf16_round_stochastic(std::bit_cast<float>(0x7fffffffu), bits)));  // would carry
  }
}

// --- every kernel against the reference -----------------------------------------

class Bf16MomentsIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU does not support " << isa_name(GetParam());
  }
};

// n = 1..40 and beyond a vector and a tile, every gradient type, copy none /
// bf16 / fp16, four decay shapes, both roundings, and index bases that put the
// range across 2^32 (the hash's high-half carry) and near 2^40.
TEST_P(Bf16MomentsIsa, BitIdenticalToTheReferenceForEveryTypeTailAndRounding) {
  std::vector<std::int64_t> sizes;
  for (std::int64_t n = 1; n <= 40; ++n) sizes.push_back(n);
  sizes.insert(sizes.end(), {1023, 65536 + 17});
  const auto constants = constants_set();
  const std::int64_t bases[] = {0, 5, (std::int64_t{1} << 32) - 13, (std::int64_t{1} << 40) + 3};
  auto adam = make(GetParam());
  std::uint32_t seed = 1;
  for (std::int64_t n : sizes) {
    for (ElemType gt : kGradTypes) {
      for (int copy = 0; copy < 3; ++copy) {
        for (Bf16Rounding rounding : kRoundings) {
          ++seed;
          Call c;
          c.constants = constants[seed % constants.size()];
          c.rounding = rounding;
          c.seed = 0x1234567890abcdefull * seed;
          c.step = seed;
          c.index_base = bases[(seed / 2) % 4];
          c.copy = copy != 0;
          c.copy_type = copy == 2 ? ElemType::kF16 : ElemType::kBf16;
          State got = random_state(n, seed, /*specials=*/true);
          got.set_grad_type(gt);
          State want = got;
          ASSERT_TRUE(run(*adam, got, c).ok());
          reference(want, c);
          ASSERT_TRUE(states_equal(got, want, c.copy_type))
              << isa_name(GetParam()) << " n=" << n << " grad=" << elem_type_name(gt) << " copy=" << copy << " "
              << rounding_name(rounding) << " index_base=" << c.index_base;
        }
      }
    }
  }
}

// Nearest even: the same as the fp32 step on the widened moments followed by
// fp32_to_bf16_bits on each (written out here, not through
// adam_step_bf16_moments).
TEST_P(Bf16MomentsIsa, NearestEvenIsTheFp32StepThenFp32ToBf16Bits) {
  constexpr std::int64_t kN = 4099;
  auto adam = make(GetParam(), 2, 65536);
  for (const auto& constants : constants_set()) {
    for (ElemType gt : kGradTypes) {
      State got = random_state(kN, 11, true);
      got.set_grad_type(gt);
      State want = got;
      Call c;
      c.constants = constants;
      ASSERT_TRUE(run(*adam, got, c).ok());
      for (std::int64_t i = 0; i < kN; ++i) {
        float m = nx::bf16_bits_to_fp32(want.m[i]), v = nx::bf16_bits_to_fp32(want.v[i]);
        nx::adam_step(constants, want.grad_f32(i), want.p[i], m, v);
        want.m[i] = nx::fp32_to_bf16_bits(m);
        want.v[i] = nx::fp32_to_bf16_bits(v);
      }
      ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " " << elem_type_name(gt);
    }
  }
}

// Stochastic: each new moment is one of the two bf16 values around the exact
// fp32 result of the step (itself when that is a bf16); non-finite results are
// what nearest even gives. And the draws differ from nearest even somewhere.
TEST_P(Bf16MomentsIsa, StochasticGivesABf16NeighbourOfTheFp32Value) {
  constexpr std::int64_t kN = 65536 + 77;
  auto adam = make(GetParam(), 2, 65536);
  State got = random_state(kN, 12, true);
  got.set_grad_type(ElemType::kBf16);
  State start = got;
  Call c;
  c.constants = constants_set()[0];
  c.rounding = Bf16Rounding::kStochastic;
  c.seed = 99;
  c.step = 4;
  ASSERT_TRUE(run(*adam, got, c).ok());
  std::int64_t differs_from_nearest = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    float p = start.p[i], m = nx::bf16_bits_to_fp32(start.m[i]), v = nx::bf16_bits_to_fp32(start.v[i]);
    nx::adam_step(c.constants, start.grad_f32(i), p, m, v);
    const std::uint16_t got_mv[] = {got.m[i], got.v[i]};
    const float exact[] = {m, v};
    for (int k = 0; k < 2; ++k) {
      const float x = exact[k];
      if (!std::isfinite(x)) {
        ASSERT_TRUE(same_bf16(got_mv[k], nx::fp32_to_bf16_bits(x))) << i;
        continue;
      }
      const std::uint16_t lo = bf16_toward_zero(x);
      const bool exact_bf16 = (std::bit_cast<std::uint32_t>(x) & 0xffffu) == 0;
      ASSERT_TRUE(got_mv[k] == lo || (!exact_bf16 && got_mv[k] == lo + 1))
          << "element " << i << (k == 0 ? " m " : " v ") << x << std::hex << ": got 0x" << got_mv[k];
      differs_from_nearest += got_mv[k] != nx::fp32_to_bf16_bits(x);
    }
  }
  EXPECT_GT(differs_from_nearest, kN / 10);
}

// Over 4096 seeds the mean of the stochastically rounded moments is within
// 0.05 bf16 ulp of the fp32 value (a draw's standard deviation is at most
// 0.5 ulp, so the mean's is at most 0.5 / 64 = 0.0078 ulp: the bound is 6.4
// of them). Nearest even, for comparison, is off by up to 0.5 ulp, and by more
// than the bound for most elements. Fixed seeds, so the test is deterministic.
TEST_P(Bf16MomentsIsa, StochasticMeanOverSeedsIsTheFp32Value) {
  constexpr std::int64_t kN = 200;
  constexpr int kSeeds = 4096;
  auto adam = make(GetParam());
  const State start = random_state(kN, 13, false);
  Call c;
  c.constants = constants_set()[0];
  c.rounding = Bf16Rounding::kStochastic;
  c.step = 9;
  c.index_base = 1000;
  std::vector<double> sum_m(kN), sum_v(kN);
  for (int s = 0; s < kSeeds; ++s) {
    State st = start;
    c.seed = 0x5eed0000ull + static_cast<std::uint64_t>(s);
    ASSERT_TRUE(run(*adam, st, c).ok());
    for (std::int64_t i = 0; i < kN; ++i) {
      sum_m[i] += nx::bf16_bits_to_fp32(st.m[i]);
      sum_v[i] += nx::bf16_bits_to_fp32(st.v[i]);
    }
  }
  std::int64_t nearest_off = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    float p = start.p[i], m = nx::bf16_bits_to_fp32(start.m[i]), v = nx::bf16_bits_to_fp32(start.v[i]);
    nx::adam_step(c.constants, start.grad_f32(i), p, m, v);
    const double means[] = {sum_m[i] / kSeeds, sum_v[i] / kSeeds};
    const float exact[] = {m, v};
    for (int k = 0; k < 2; ++k) {
      const float x = exact[k];
      // The bf16 ulp at x: the spacing of bf16 values around it.
      const float lo = nx::bf16_bits_to_fp32(bf16_toward_zero(x));
      const double ulp = std::fabs(static_cast<double>(nx::bf16_bits_to_fp32(bf16_toward_zero(x) + 1)) - lo);
      EXPECT_LE(std::fabs(means[k] - x), 0.05 * ulp) << "element " << i << (k == 0 ? " m " : " v ") << x;
      nearest_off += std::fabs(nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(x)) - static_cast<double>(x)) > 0.05 * ulp;
    }
  }
  EXPECT_GT(nearest_off, kN);  // of 2 kN moments: nearest even is biased where stochastic is not
}

// Updating [0, n) in one call equals [0, k) then [k, n) with index_base k
// (and the same for a range that starts at index_base 777).
TEST_P(Bf16MomentsIsa, SplitCallsEqualOneCall) {
  constexpr std::int64_t kN = 3000;
  auto adam = make(GetParam());
  for (Bf16Rounding rounding : kRoundings) {
    for (std::int64_t base : {std::int64_t{0}, std::int64_t{777}}) {
      Call c;
      c.constants = constants_set()[1];
      c.rounding = rounding;
      c.seed = 31337;
      c.step = 12;
      c.index_base = base;
      c.copy = true;
      State whole = random_state(kN, 14, true);
      whole.set_grad_type(ElemType::kF16);
      const State start = whole;
      ASSERT_TRUE(run(*adam, whole, c).ok());
      for (std::int64_t k : {1, 7, 16, 17, 1000, 2999}) {
        State split = start;
        ASSERT_TRUE(adam->step_bf16_moments(args_for(split, c, 0, k)).ok());
        ASSERT_TRUE(adam->step_bf16_moments(args_for(split, c, k, kN - k)).ok());
        ASSERT_TRUE(states_equal(split, whole, ElemType::kBf16))
            << isa_name(GetParam()) << " " << rounding_name(rounding) << " base " << base << " split at " << k;
      }
    }
  }
}

// Large n over several steps, two threads, against the reference.
TEST_P(Bf16MomentsIsa, LargeRangeMatchesTheReferenceOverSteps) {
  constexpr std::int64_t kN = 1'000'000 + 5;
  auto adam = make(GetParam(), 2);
  State got = random_state(kN, 15, false);
  got.set_grad_type(ElemType::kBf16);
  State want = got;
  for (int t = 1; t <= 3; ++t) {
    Call c;
    c.constants = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, t, 0.5);
    c.rounding = t == 2 ? Bf16Rounding::kNearestEven : Bf16Rounding::kStochastic;
    c.seed = 2024;
    c.step = t;
    c.index_base = 123;
    c.copy = true;
    ASSERT_TRUE(run(*adam, got, c).ok());
    reference(want, c);
    ASSERT_TRUE(states_equal(got, want, ElemType::kBf16)) << isa_name(GetParam()) << " step " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Bf16MomentsIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

// Every supported ISA, 1-3 threads and three tile sizes give the bits of the
// scalar kernel on one thread and one tile, for both roundings.
TEST(Bf16Moments, ThreadCountTileSizeAndIsaDoNotChangeTheBits) {
  constexpr std::int64_t kN = 65536 * 5 + 123;
  for (Bf16Rounding rounding : kRoundings) {
    Call c;
    c.constants = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.05}, 11, 0.25);
    c.rounding = rounding;
    c.seed = 77;
    c.step = 11;
    c.index_base = 65536 * 3 + 9;
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
              << rounding_name(rounding) << " " << isa_name(isa) << " " << threads << " threads, tile " << tile;
        }
      }
    }
  }
}

// The draws depend on the seed, the step and the index, and m and v draw
// different bits: changing any one of them changes some stochastic result.
TEST(Bf16Moments, SeedStepAndIndexEachChangeTheDraws) {
  constexpr std::int64_t kN = 4096;
  auto adam = make(best_isa());
  Call c;
  c.constants = constants_set()[0];
  c.rounding = Bf16Rounding::kStochastic;
  c.seed = 1;
  c.step = 1;
  const State start = random_state(kN, 16, false);
  State first = start;
  ASSERT_TRUE(run(*adam, first, c).ok());
  State again = start;
  ASSERT_TRUE(run(*adam, again, c).ok());
  EXPECT_EQ(first.m, again.m);  // a pure function: the same call gives the same bits
  EXPECT_EQ(first.v, again.v);
  for (int which = 0; which < 3; ++which) {
    Call d = c;
    if (which == 0) d.seed = 2;
    if (which == 1) d.step = 2;
    if (which == 2) d.index_base = 1;
    State other = start;
    ASSERT_TRUE(run(*adam, other, d).ok());
    EXPECT_NE(other.m, first.m) << which;
    EXPECT_NE(other.v, first.v) << which;
  }
  // m and v use different halves of the hash.
  std::int64_t same_half = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    same_half += nx::stochastic_rounding_bits(1, 1, i, AdamMoment::kExpAvg) ==
                 nx::stochastic_rounding_bits(1, 1, i, AdamMoment::kExpAvgSq);
  }
  EXPECT_LT(same_half, 10);
}

// --- bad input ------------------------------------------------------------------

class Bf16MomentsBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    s_ = random_state(64, 1, false);
    args_.constants = nx::make_adam_constants({}, 1, 1.0);
    args_.master = s_.p;
    args_.exp_avg = s_.m;
    args_.exp_avg_sq = s_.v;
    args_.grad = {s_.g32.data(), ElemType::kF32, 64};
    args_.rounding = Bf16Rounding::kStochastic;
  }
  // The error's message; nothing may have been written.
  std::string error() {
    const State before = s_;
    const core::Status st = adam_->step_bf16_moments(args_);
    EXPECT_EQ(st.code(), core::StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_EQ(s_.p, before.p);
    EXPECT_EQ(s_.m, before.m);
    EXPECT_EQ(s_.v, before.v);
    return std::string(st.message());
  }
  State s_;
  AdamStepBf16MomentsArgs args_;
  std::unique_ptr<CpuAdam> adam_ = make(best_isa(), 1);
};

TEST_F(Bf16MomentsBadInput, TheArgumentsAreValidAsWritten) {
  EXPECT_TRUE(adam_->step_bf16_moments(args_).ok());
}
TEST_F(Bf16MomentsBadInput, ZeroLength) {
  args_.master = {};
  EXPECT_NE(error().find("zero elements"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, SizesDiffer) {
  args_.exp_avg_sq = std::span<std::uint16_t>(s_.v).first(10);
  const std::string e = error();
  EXPECT_NE(e.find("sizes differ"), std::string::npos) << e;
  EXPECT_NE(e.find("exp_avg_sq 10"), std::string::npos) << e;
}
TEST_F(Bf16MomentsBadInput, MomentsOverlap) {
  std::vector<std::uint16_t> both(100);
  args_.exp_avg = std::span<std::uint16_t>(both).first(64);
  args_.exp_avg_sq = std::span<std::uint16_t>(both).subspan(30, 64);
  EXPECT_NE(error().find("exp_avg and exp_avg_sq overlap"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, MomentOverlapsMaster) {
  // 64 bf16 moments inside the master's 256 bytes.
  args_.exp_avg = std::span<std::uint16_t>(reinterpret_cast<std::uint16_t*>(s_.p.data()) + 64, 64);
  EXPECT_NE(error().find("master and exp_avg overlap"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, MisalignedMoment) {
  std::vector<std::uint16_t> buf(80);
  args_.exp_avg = std::span<std::uint16_t>(
      reinterpret_cast<std::uint16_t*>(reinterpret_cast<char*>(buf.data()) + 1), 64);
  const std::string e = error();
  EXPECT_NE(e.find("exp_avg at"), std::string::npos) << e;
  EXPECT_NE(e.find("not aligned"), std::string::npos) << e;
}
TEST_F(Bf16MomentsBadInput, BadConstants) {
  args_.constants.beta1 = 1.0f;
  EXPECT_NE(error().find("beta1"), std::string::npos);
  args_.constants = nx::make_adam_constants({}, 1, 1.0);
  args_.constants.eps = 0.0f;
  EXPECT_NE(error().find("eps"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, Fp32CopyOut) {
  std::vector<float> out(64);
  args_.copy_out = {out.data(), ElemType::kF32, 64};
  EXPECT_NE(error().find("copy_out must be bf16 or fp16"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, UnknownRounding) {
  args_.rounding = static_cast<Bf16Rounding>(7);
  EXPECT_NE(error().find("rounding = 7"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, NegativeIndexBase) {
  args_.index_base = -1;
  EXPECT_NE(error().find("index_base = -1"), std::string::npos);
}
TEST_F(Bf16MomentsBadInput, IndexBasePastInt64Max) {
  args_.index_base = std::numeric_limits<std::int64_t>::max() - 10;
  EXPECT_NE(error().find("INT64_MAX"), std::string::npos);
  args_.index_base = std::numeric_limits<std::int64_t>::max() - 64;  // the last index is INT64_MAX - 1: fine
  EXPECT_TRUE(adam_->step_bf16_moments(args_).ok());
}

}  // namespace
}  // namespace strata::adam
