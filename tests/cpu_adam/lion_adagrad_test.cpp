// cpu_adam's Lion and Adagrad steps: every kernel, thread count and tile size
// against numerics::lion_step / adagrad_step applied element by element, bit
// for bit, on random inputs with tails, zeros, subnormals and inf/nan, every
// gradient type, with and without the compute copy and weight decay; values
// worked out by hand; agreement with float64 over many steps; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "cpu_adam/cpu_adam.h"
#include "tests/cpu_adam/test_gradients.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;

constexpr ElemType kGradTypes[] = {ElemType::kF32, ElemType::kBf16, ElemType::kF16};
constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};

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
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}
bool same16(std::uint16_t a, std::uint16_t b, ElemType t) {
  if (a == b) return true;
  const std::uint16_t exp_mask = t == ElemType::kBf16 ? 0x7f80 : 0x7c00;
  const std::uint16_t man_mask = t == ElemType::kBf16 ? 0x007f : 0x03ff;
  auto is_nan = [&](std::uint16_t h) { return (h & exp_mask) == exp_mask && (h & man_mask) != 0; };
  return is_nan(a) && is_nan(b);
}

// The master, its one state array (exp_avg for Lion, the sum for Adagrad),
// the gradient in every type, and the compute copy.
struct State : test::TestGradients {
  std::vector<float> p, s;
  std::vector<std::uint16_t> out;

  std::int64_t size() const { return static_cast<std::int64_t>(p.size()); }
};

enum class Opt { kLion, kAdagrad };

// Random state. `specials` sprinkles zero, -0, subnormal, inf, NaN and
// beyond-fp16 gradients, zero and subnormal states and masters, and (Lion)
// an interpolation that cancels to within rounding, so that the sign of c
// depends on every rounding step.
State random_state(Opt opt, std::int64_t n, std::uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State st;
  st.p.resize(n);
  st.s.resize(n);
  st.g32.resize(n);
  st.out.assign(n, 0xdead);
  for (std::int64_t i = 0; i < n; ++i) {
    st.p[i] = normal(rng);
    st.s[i] = opt == Opt::kLion ? normal(rng) * 0.01f : std::fabs(normal(rng)) * 1e-2f;
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
        case 7:  // zero state and zero gradient: Lion's c is 0, Adagrad divides 0 by eps
          st.s[i] = 0.0f;
          g = 0.0f;
          break;
        case 8:  // the same with negative zeros, and a zero master whose sign must survive
          st.s[i] = -0.0f;
          g = -0.0f;
          st.p[i] = -0.0f;
          break;
        case 9:  // a subnormal master that stays subnormal (zero state and gradient, so
                 // a zero update unless decay moves it): its compute copy converts a subnormal
          st.p[i] = std::ldexp(normal(rng), -130);
          st.s[i] = 0.0f;
          g = 0.0f;
          break;
        case 10:  // subnormal state and gradient
          st.s[i] = opt == Opt::kLion ? std::ldexp(normal(rng), -135) : std::ldexp(1.0f, -140);
          g = std::ldexp(normal(rng), -128);
          break;
        case 11:  // Lion: beta1 * m + (1 - beta1) * g cancels to within rounding (beta1 = 0.9)
          if (opt == Opt::kLion) g = -9.0f * st.s[i] * (1.0f + std::ldexp(normal(rng), -22));
          break;
        case 12: st.p[i] = 0.0f; break;
        default: break;
      }
    }
    st.g32[i] = g;
  }
  return st;
}

// The reference: the numerics.h functions, element by element, in this file.
void reference_lion(State& st, const nx::LionStepConstants& c, bool copy, ElemType copy_type) {
  for (std::int64_t i = 0; i < st.size(); ++i) {
    nx::lion_step(c, st.grad_f32(i), st.p[i], st.s[i]);
    if (copy) {
      st.out[i] =
          copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(st.p[i]) : nx::fp32_to_fp16_bits(st.p[i]);
    }
  }
}
void reference_adagrad(State& st, const nx::AdagradStepConstants& c, bool copy, ElemType copy_type) {
  for (std::int64_t i = 0; i < st.size(); ++i) {
    nx::adagrad_step(c, st.grad_f32(i), st.p[i], st.s[i]);
    if (copy) {
      st.out[i] =
          copy_type == ElemType::kBf16 ? nx::fp32_to_bf16_bits(st.p[i]) : nx::fp32_to_fp16_bits(st.p[i]);
    }
  }
}

core::Status run_lion(CpuAdam& adam, State& st, const nx::LionStepConstants& c, bool copy,
                      ElemType copy_type) {
  LionStepArgs a;
  a.constants = c;
  a.master = st.p;
  a.exp_avg = st.s;
  a.grad = st.grad();
  if (copy) a.copy_out = {st.out.data(), copy_type, st.size()};
  return adam.lion_step(a);
}
core::Status run_adagrad(CpuAdam& adam, State& st, const nx::AdagradStepConstants& c, bool copy,
                         ElemType copy_type) {
  AdagradStepArgs a;
  a.constants = c;
  a.master = st.p;
  a.exp_avg_sq = st.s;
  a.grad = st.grad();
  if (copy) a.copy_out = {st.out.data(), copy_type, st.size()};
  return adam.adagrad_step(a);
}

::testing::AssertionResult states_equal(const State& got, const State& want, ElemType copy_type) {
  for (std::int64_t i = 0; i < got.size(); ++i) {
    if (!same(got.p[i], want.p[i]) || !same(got.s[i], want.s[i]) ||
        !same16(got.out[i], want.out[i], copy_type)) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << got.size() << " (grad " << want.grad_f32(i) << "): p "
             << got.p[i] << " vs " << want.p[i] << ", state " << got.s[i] << " vs " << want.s[i] << ", out 0x"
             << std::hex << got.out[i] << " vs 0x" << want.out[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// Lion and Adagrad constants: with and without weight decay, and an odd grad_scale.
std::vector<nx::LionStepConstants> lion_cases() {
  return {nx::make_lion_constants({.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1}, 1.0 / 1024),
          nx::make_lion_constants({.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.98}, 0.37),
          nx::make_lion_constants({.lr = 1e-3, .beta1 = 0.9, .weight_decay = 1.0}, 1.0)};
}
std::vector<nx::AdagradStepConstants> adagrad_cases() {
  return {nx::make_adagrad_constants({.lr = 1e-2, .eps = 1e-10, .weight_decay = 0.01}, 1.0 / 1024),
          nx::make_adagrad_constants({.lr = 3e-2, .eps = 1e-8}, 0.37),
          nx::make_adagrad_constants({.lr = 1e-1, .eps = 1e-6, .weight_decay = 0.5}, 1.0)};
}

std::string copy_name(int copy) { return copy == 0 ? "no copy" : copy == 1 ? "bf16 copy" : "fp16 copy"; }

class LionAdagradIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "this CPU does not support " << isa_name(GetParam());
  }
};

// Sizes around both vector widths (8, 16) and the two-vector unroll (32).
const std::vector<std::int64_t> kSizes = {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 1023, 65536 + 17};

TEST_P(LionAdagradIsa, LionIsBitIdenticalToTheReferenceForEveryTypeAndTail) {
  auto adam = make(GetParam());
  ASSERT_NE(adam, nullptr);
  std::uint32_t seed = 100;
  for (std::int64_t n : kSizes) {
    for (ElemType gt : kGradTypes) {
      for (int copy = 0; copy < 3; ++copy) {
        const ElemType ct = copy == 2 ? ElemType::kF16 : ElemType::kBf16;
        const auto cases = lion_cases();
        for (size_t k = 0; k < cases.size(); ++k) {
          State got = random_state(Opt::kLion, n, ++seed, /*specials=*/true);
          got.set_grad_type(gt);
          State want = got;
          ASSERT_TRUE(run_lion(*adam, got, cases[k], copy != 0, ct).ok());
          reference_lion(want, cases[k], copy != 0, ct);
          ASSERT_TRUE(states_equal(got, want, ct))
              << isa_name(GetParam()) << " n=" << n << " grad=" << elem_type_name(gt) << " "
              << copy_name(copy) << " case " << k;
        }
      }
    }
  }
}

TEST_P(LionAdagradIsa, AdagradIsBitIdenticalToTheReferenceForEveryTypeAndTail) {
  auto adam = make(GetParam());
  ASSERT_NE(adam, nullptr);
  std::uint32_t seed = 200;
  for (std::int64_t n : kSizes) {
    for (ElemType gt : kGradTypes) {
      for (int copy = 0; copy < 3; ++copy) {
        const ElemType ct = copy == 2 ? ElemType::kF16 : ElemType::kBf16;
        const auto cases = adagrad_cases();
        for (size_t k = 0; k < cases.size(); ++k) {
          State got = random_state(Opt::kAdagrad, n, ++seed, /*specials=*/true);
          got.set_grad_type(gt);
          State want = got;
          ASSERT_TRUE(run_adagrad(*adam, got, cases[k], copy != 0, ct).ok());
          reference_adagrad(want, cases[k], copy != 0, ct);
          ASSERT_TRUE(states_equal(got, want, ct))
              << isa_name(GetParam()) << " n=" << n << " grad=" << elem_type_name(gt) << " "
              << copy_name(copy) << " case " << k;
        }
      }
    }
  }
}

// Several steps in a row on a few tiles and two threads: the state each step
// leaves is the next one's input.
TEST_P(LionAdagradIsa, ManyStepsStayBitIdentical) {
  constexpr std::int64_t kN = 65536 * 5 + 13;
  auto adam = make(GetParam(), 2, 65536);
  ASSERT_NE(adam, nullptr);
  State lion_got = random_state(Opt::kLion, kN, 7, false);
  State ada_got = random_state(Opt::kAdagrad, kN, 8, false);
  State lion_want = lion_got, ada_want = ada_got;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 1; t <= 4; ++t) {
    for (std::int64_t i = 0; i < kN; ++i) lion_got.g32[i] = ada_got.g32[i] = normal(rng);
    lion_got.set_grad_type(ElemType::kBf16);
    ada_got.set_grad_type(ElemType::kBf16);
    lion_want.g16 = lion_got.g16;
    lion_want.grad_type = ElemType::kBf16;
    ada_want.g16 = ada_got.g16;
    ada_want.grad_type = ElemType::kBf16;
    const auto lc = nx::make_lion_constants({.lr = 1e-4, .weight_decay = 0.1}, 0.5);
    const auto ac = nx::make_adagrad_constants({.lr = 1e-2, .weight_decay = 0.01}, 0.5);
    ASSERT_TRUE(run_lion(*adam, lion_got, lc, true, ElemType::kBf16).ok());
    ASSERT_TRUE(run_adagrad(*adam, ada_got, ac, true, ElemType::kBf16).ok());
    reference_lion(lion_want, lc, true, ElemType::kBf16);
    reference_adagrad(ada_want, ac, true, ElemType::kBf16);
    ASSERT_TRUE(states_equal(lion_got, lion_want, ElemType::kBf16)) << "lion step " << t;
    ASSERT_TRUE(states_equal(ada_got, ada_want, ElemType::kBf16)) << "adagrad step " << t;
  }
}

// An embedder may run its threads with FTZ/DAZ set; the kernels must not
// inherit it (subnormal states and gradients stay subnormal).
TEST_P(LionAdagradIsa, SubnormalsSurviveFlushToZeroSetByTheCaller) {
  constexpr std::int64_t kN = 4099;
  auto adam = make(GetParam());
  ASSERT_NE(adam, nullptr);
  State lion = random_state(Opt::kLion, kN, 11, false);
  State ada = random_state(Opt::kAdagrad, kN, 12, false);
  for (std::int64_t i = 0; i < kN; ++i) {
    lion.s[i] = std::ldexp(lion.s[i], -130);
    lion.g32[i] = std::ldexp(lion.g32[i], -130);
    ada.s[i] = std::ldexp(ada.s[i], -135);
    ada.g32[i] = std::ldexp(ada.g32[i], -135);
  }
  State lion_want = lion, ada_want = ada;
  const auto lc = nx::make_lion_constants({.lr = 1e-3}, 1.0);
  const auto ac = nx::make_adagrad_constants({.lr = 1e-2, .eps = 1e-30}, 1.0);
  const unsigned saved = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(saved | (1u << 15) | (1u << 6));
  const core::Status s1 = run_lion(*adam, lion, lc, true, ElemType::kBf16);
  const core::Status s2 = run_adagrad(*adam, ada, ac, true, ElemType::kBf16);
  __builtin_ia32_ldmxcsr(saved);
  ASSERT_TRUE(s1.ok()) << s1.to_string();
  ASSERT_TRUE(s2.ok()) << s2.to_string();
  reference_lion(lion_want, lc, true, ElemType::kBf16);
  reference_adagrad(ada_want, ac, true, ElemType::kBf16);
  EXPECT_TRUE(states_equal(lion, lion_want, ElemType::kBf16));
  EXPECT_TRUE(states_equal(ada, ada_want, ElemType::kBf16));
  std::int64_t subnormal = 0;
  for (float m : lion.s) subnormal += std::fpclassify(m) == FP_SUBNORMAL;
  EXPECT_GT(subnormal, kN / 2);
}

// The vector kernels stream the copy-out when its address is aligned; the
// bits must not depend on which path ran.
TEST_P(LionAdagradIsa, CopyOutIsTheSameStreamedOrNot) {
  constexpr std::int64_t kN = 65536 + 45;
  auto adam = make(GetParam(), 2, 65536);
  ASSERT_NE(adam, nullptr);
  auto buffer = core::AlignedBuffer::allocate((kN + 64) * 2, 64);
  ASSERT_TRUE(buffer.ok());
  const auto lc = nx::make_lion_constants({.lr = 1e-3, .weight_decay = 0.01}, 1.0);
  const auto ac = nx::make_adagrad_constants({.lr = 1e-2, .weight_decay = 0.01}, 1.0);
  for (std::int64_t offset : {0, 1, 8}) {  // 64-byte aligned, 2-byte aligned, 16-byte aligned
    std::uint16_t* out = buffer->as<std::uint16_t>().data() + offset;
    for (ElemType ct : {ElemType::kBf16, ElemType::kF16}) {
      for (Opt opt : {Opt::kLion, Opt::kAdagrad}) {
        State got = random_state(opt, kN, 77, false);
        State want = got;
        if (opt == Opt::kLion) {
          ASSERT_TRUE(adam->lion_step({lc, got.p, got.s, got.grad(), {out, ct, kN}}).ok());
          reference_lion(want, lc, true, ct);
        } else {
          ASSERT_TRUE(adam->adagrad_step({ac, got.p, got.s, got.grad(), {out, ct, kN}}).ok());
          reference_adagrad(want, ac, true, ct);
        }
        std::vector<std::uint16_t> copied(out, out + kN);
        ASSERT_EQ(copied, want.out) << "offset " << offset << " " << elem_type_name(ct)
                                    << (opt == Opt::kLion ? " lion" : " adagrad");
      }
    }
  }
}

// Values worked out by hand (decimal arithmetic), checked on every kernel: 37
// elements, so the vector body and the scalar tail both see each case.
TEST_P(LionAdagradIsa, LionMatchesHandWorkedValues) {
  // lr 0.01, beta1 0.9, beta2 0.99, weight decay 0.1, grad_scale 0.5.
  //  p    m     grad | g    c = 0.9 m + 0.1 g   p' = 0.999 p - 0.01 sign(c)   m' = 0.99 m + 0.01 g
  //  1    0.5   -4   | -2   0.25                0.989                          0.475
  //  1   -1      0   |  0  -0.9                 1.009                         -0.99
  //  1    0      0   |  0   0 (sign 0)          0.999                          0
  // -2    0      6   |  3   0.3                -2.008                          0.03
  struct Case { float p, m, grad, p_next, m_next; };
  const Case cases[] = {{1.0f, 0.5f, -4.0f, 0.989f, 0.475f},
                        {1.0f, -1.0f, 0.0f, 1.009f, -0.99f},
                        {1.0f, 0.0f, 0.0f, 0.999f, 0.0f},
                        {-2.0f, 0.0f, 6.0f, -2.008f, 0.03f}};
  constexpr std::int64_t kN = 37;
  auto adam = make(GetParam());
  ASSERT_NE(adam, nullptr);
  State st;
  for (std::int64_t i = 0; i < kN; ++i) {
    const Case& c = cases[i % 4];
    st.p.push_back(c.p);
    st.s.push_back(c.m);
    st.g32.push_back(c.grad);
  }
  st.out.assign(kN, 0);
  const auto k = nx::make_lion_constants({.lr = 0.01, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1}, 0.5);
  ASSERT_TRUE(run_lion(*adam, st, k, false, ElemType::kBf16).ok());
  for (std::int64_t i = 0; i < kN; ++i) {
    const Case& c = cases[i % 4];
    EXPECT_NEAR(st.p[i], c.p_next, 1e-6) << i;
    EXPECT_NEAR(st.s[i], c.m_next, 1e-6) << i;
  }
  // With no decay, a zero interpolation leaves the master exactly as it was.
  State zero;
  zero.p = {0.75f, -0.0f};
  zero.s = {0.0f, 0.0f};
  zero.g32 = {0.0f, 0.0f};
  zero.out = {0, 0};
  ASSERT_TRUE(run_lion(*adam, zero, nx::make_lion_constants({.lr = 0.01}, 1.0), false, ElemType::kBf16).ok());
  EXPECT_EQ(std::bit_cast<std::uint32_t>(zero.p[0]), std::bit_cast<std::uint32_t>(0.75f));
  EXPECT_EQ(std::bit_cast<std::uint32_t>(zero.p[1]), std::bit_cast<std::uint32_t>(-0.0f));
}

TEST_P(LionAdagradIsa, AdagradMatchesHandWorkedValues) {
  // lr 0.1, eps 1e-10 (below the tolerance), weight decay 0.5, grad_scale 0.5.
  //  p    sum   grad | g = 0.5 grad + 0.5 p   sum' = sum + g^2   p' = p - 0.1 g / sqrt(sum')
  //  1    0      3   | 2                      4                  0.9
  //  2    9      6   | 4                      25                 1.92
  // -1    0.75  -3   | -2                     4.75               -1 + 0.2 / sqrt(4.75)
  //  0    0      0   | 0                      0                  0 (0 / eps)
  struct Case { float p, sum, grad, p_next, sum_next; };
  const Case cases[] = {{1.0f, 0.0f, 3.0f, 0.9f, 4.0f},
                        {2.0f, 9.0f, 6.0f, 1.92f, 25.0f},
                        {-1.0f, 0.75f, -3.0f, static_cast<float>(-1.0 + 0.2 / std::sqrt(4.75)), 4.75f},
                        {0.0f, 0.0f, 0.0f, 0.0f, 0.0f}};
  constexpr std::int64_t kN = 37;
  auto adam = make(GetParam());
  ASSERT_NE(adam, nullptr);
  State st;
  for (std::int64_t i = 0; i < kN; ++i) {
    const Case& c = cases[i % 4];
    st.p.push_back(c.p);
    st.s.push_back(c.sum);
    st.g32.push_back(c.grad);
  }
  st.out.assign(kN, 0);
  const auto k = nx::make_adagrad_constants({.lr = 0.1, .eps = 1e-10, .weight_decay = 0.5}, 0.5);
  ASSERT_TRUE(run_adagrad(*adam, st, k, false, ElemType::kBf16).ok());
  for (std::int64_t i = 0; i < kN; ++i) {
    const Case& c = cases[i % 4];
    EXPECT_NEAR(st.p[i], c.p_next, 1e-6) << i;
    EXPECT_EQ(st.s[i], c.sum_next) << i;  // small integers and 4.75: exact
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, LionAdagradIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

TEST(LionAdagrad, ThreadCountTileSizeAndKernelDoNotChangeTheBits) {
  constexpr std::int64_t kN = 65536 * 9 + 123;
  const auto lc = nx::make_lion_constants({.lr = 1e-4, .weight_decay = 0.05}, 0.25);
  const auto ac = nx::make_adagrad_constants({.lr = 1e-2, .weight_decay = 0.05}, 0.25);
  State lion_base = random_state(Opt::kLion, kN, 42, true);
  State ada_base = random_state(Opt::kAdagrad, kN, 43, true);
  lion_base.set_grad_type(ElemType::kBf16);
  ada_base.set_grad_type(ElemType::kF16);
  State lion_want = lion_base, ada_want = ada_base;
  reference_lion(lion_want, lc, true, ElemType::kBf16);
  reference_adagrad(ada_want, ac, true, ElemType::kF16);
  for (Isa isa : kAllIsas) {
    if (!isa_supported(isa)) continue;
    for (int threads : {1, 2, 3}) {
      for (std::int64_t tile : {65536, 65536 * 2, 65536 * 4}) {
        auto adam = make(isa, threads, tile);
        ASSERT_NE(adam, nullptr);
        State lion = lion_base, ada = ada_base;
        ASSERT_TRUE(run_lion(*adam, lion, lc, true, ElemType::kBf16).ok());
        ASSERT_TRUE(run_adagrad(*adam, ada, ac, true, ElemType::kF16).ok());
        EXPECT_TRUE(states_equal(lion, lion_want, ElemType::kBf16))
            << "lion " << isa_name(isa) << ", " << threads << " threads, tile " << tile;
        EXPECT_TRUE(states_equal(ada, ada_want, ElemType::kF16))
            << "adagrad " << isa_name(isa) << ", " << threads << " threads, tile " << tile;
      }
    }
  }
}

// The paper's Lion in float64 over 50 steps. An element whose float64
// interpolation comes within 1e-6 of zero at some step may take the other
// sign in fp32; those (rare) elements are left out, and most must remain.
TEST(LionAdagrad, LionAgreesWithFloat64OverManySteps) {
  constexpr std::int64_t kN = 4096 + 7;
  constexpr int kSteps = 50;
  const nx::LionHyperparams h{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .weight_decay = 0.1};
  State st = random_state(Opt::kLion, kN, 17, false);
  std::vector<double> p(st.p.begin(), st.p.end()), m(st.s.begin(), st.s.end());
  std::vector<bool> ambiguous(kN, false);
  auto adam = make(best_isa(), 2, 65536);
  ASSERT_NE(adam, nullptr);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 1; t <= kSteps; ++t) {
    for (float& g : st.g32) g = normal(rng);
    ASSERT_TRUE(run_lion(*adam, st, nx::make_lion_constants(h, 1.0), false, ElemType::kBf16).ok());
    for (std::int64_t i = 0; i < kN; ++i) {
      const double g = st.g32[i];
      const double c = h.beta1 * m[i] + (1 - h.beta1) * g;
      if (std::fabs(c) < 1e-6) ambiguous[i] = true;
      const double sign = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
      p[i] = p[i] * (1 - h.lr * h.weight_decay) - h.lr * sign;
      m[i] = h.beta2 * m[i] + (1 - h.beta2) * g;
    }
  }
  std::int64_t checked = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    if (ambiguous[i]) continue;
    ++checked;
    // Stated tolerance: 1e-5 relative to max(1, |x|).
    ASSERT_NEAR(st.p[i], p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
    ASSERT_NEAR(st.s[i], m[i], 1e-5 * std::max(1.0, std::fabs(m[i]))) << i;
  }
  EXPECT_GT(checked, kN * 99 / 100);
}

// torch.optim.Adagrad's formula in float64 (lr_decay 0, initial sum 0).
TEST(LionAdagrad, AdagradAgreesWithFloat64OverManySteps) {
  constexpr std::int64_t kN = 4096 + 7;
  const nx::AdagradHyperparams h{.lr = 1e-2, .eps = 1e-10, .weight_decay = 0.01};
  State st = random_state(Opt::kAdagrad, kN, 19, false);
  std::fill(st.s.begin(), st.s.end(), 0.0f);
  std::vector<double> p(st.p.begin(), st.p.end()), v(kN, 0.0);
  auto adam = make(best_isa(), 2, 65536);
  ASSERT_NE(adam, nullptr);
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 1; t <= 100; ++t) {
    for (float& g : st.g32) g = normal(rng);
    ASSERT_TRUE(run_adagrad(*adam, st, nx::make_adagrad_constants(h, 1.0), false, ElemType::kBf16).ok());
    for (std::int64_t i = 0; i < kN; ++i) {
      const double g = st.g32[i] + h.weight_decay * p[i];
      v[i] += g * g;
      p[i] -= h.lr * g / (std::sqrt(v[i]) + h.eps);
    }
  }
  // Stated tolerance: 1e-5 relative to max(1, |x|) after 100 steps.
  for (std::int64_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(st.p[i], p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
    ASSERT_NEAR(st.s[i], v[i], 1e-5 * std::max(1.0, std::fabs(v[i]))) << i;
  }
}

// --- bad input ------------------------------------------------------------------

class LionAdagradBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    st_ = random_state(Opt::kAdagrad, 64, 1, false);
    before_ = st_;
    lion_ = {nx::make_lion_constants({}, 1.0), st_.p, st_.s, st_.grad(), {}};
    adagrad_ = {nx::make_adagrad_constants({}, 1.0), st_.p, st_.s, st_.grad(), {}};
  }
  // Both calls fail with kInvalidArgument and write nothing; returns the messages.
  std::string lion_error() { return error(adam_->lion_step(lion_)); }
  std::string adagrad_error() { return error(adam_->adagrad_step(adagrad_)); }
  std::string error(const core::Status& st) {
    EXPECT_EQ(st.code(), core::StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_EQ(st_.p, before_.p);
    EXPECT_EQ(st_.s, before_.s);
    return std::string(st.message());
  }
  State st_, before_;
  LionStepArgs lion_;
  AdagradStepArgs adagrad_;
  std::unique_ptr<CpuAdam> adam_ = make(best_isa(), 1);
};

TEST_F(LionAdagradBadInput, GoodArgumentsSucceed) {
  EXPECT_TRUE(adam_->lion_step(lion_).ok());
  EXPECT_TRUE(adam_->adagrad_step(adagrad_).ok());
}
TEST_F(LionAdagradBadInput, NegativeLearningRate) {
  lion_.constants = nx::make_lion_constants({.lr = -1e-3}, 1.0);
  EXPECT_NE(lion_error().find("lion constants: neg_lr"), std::string::npos);
  adagrad_.constants = nx::make_adagrad_constants({.lr = -1e-2}, 1.0);
  EXPECT_NE(adagrad_error().find("adagrad constants: neg_lr"), std::string::npos);
}
TEST_F(LionAdagradBadInput, NegativeWeightDecay) {
  lion_.constants = nx::make_lion_constants({.weight_decay = -0.1}, 1.0);
  EXPECT_NE(lion_error().find("neg_lr_decay"), std::string::npos);
  adagrad_.constants = nx::make_adagrad_constants({.weight_decay = -0.1}, 1.0);
  EXPECT_NE(adagrad_error().find("l2_decay"), std::string::npos);
}
TEST_F(LionAdagradBadInput, LionBetaOutsideZeroToOne) {
  lion_.constants = nx::make_lion_constants({.beta1 = 1.0}, 1.0);
  EXPECT_NE(lion_error().find("beta1"), std::string::npos);
  lion_.constants = nx::make_lion_constants({.beta2 = 1.5}, 1.0);
  EXPECT_NE(lion_error().find("beta2"), std::string::npos);
  lion_.constants = nx::make_lion_constants({.beta1 = -0.1}, 1.0);
  EXPECT_NE(lion_error().find("beta1"), std::string::npos);
  // 1 - 1e-9 rounds to 1.0f: outside [0, 1) once it is a float.
  lion_.constants = nx::make_lion_constants({.beta2 = 1.0 - 1e-9}, 1.0);
  EXPECT_NE(lion_error().find("beta2"), std::string::npos);
}
TEST_F(LionAdagradBadInput, AdagradEpsNotPositive) {
  adagrad_.constants = nx::make_adagrad_constants({.eps = 0.0}, 1.0);
  EXPECT_NE(adagrad_error().find("eps"), std::string::npos);
  adagrad_.constants = nx::make_adagrad_constants({.eps = -1e-10}, 1.0);
  EXPECT_NE(adagrad_error().find("eps"), std::string::npos);
  adagrad_.constants = nx::make_adagrad_constants({.eps = 1e-50}, 1.0);  // rounds to 0.0f
  EXPECT_NE(adagrad_error().find("eps"), std::string::npos);
}
TEST_F(LionAdagradBadInput, NonFiniteOrNonPositiveScale) {
  lion_.constants.neg_lr = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(lion_error().find("not finite"), std::string::npos);
  adagrad_.constants.l2_decay = std::numeric_limits<float>::infinity();
  EXPECT_NE(adagrad_error().find("not finite"), std::string::npos);
  lion_.constants = nx::make_lion_constants({}, 0.0);
  EXPECT_NE(lion_error().find("grad_scale"), std::string::npos);
  adagrad_.constants = nx::make_adagrad_constants({}, -1.0);
  EXPECT_NE(adagrad_error().find("grad_scale"), std::string::npos);
}
TEST_F(LionAdagradBadInput, Buffers) {
  LionStepArgs lion = lion_;
  lion_.master = {};
  EXPECT_NE(lion_error().find("lion step: zero elements"), std::string::npos);
  lion_ = lion;
  lion_.exp_avg = std::span<float>(st_.s).first(10);
  EXPECT_NE(lion_error().find("lion step: sizes differ: master 64, exp_avg 10, grad 64"), std::string::npos);
  lion_ = lion;
  lion_.exp_avg = std::span<float>(st_.p);
  EXPECT_NE(lion_error().find("master and exp_avg overlap"), std::string::npos);

  adagrad_.exp_avg_sq = std::span<float>(st_.p).subspan(8, 56);
  adagrad_.master = std::span<float>(st_.p).first(56);
  adagrad_.grad.size = 56;
  EXPECT_NE(adagrad_error().find("master and exp_avg_sq overlap"), std::string::npos);
  std::vector<float> out(64);
  adagrad_ = {
      nx::make_adagrad_constants({}, 1.0), st_.p, st_.s, st_.grad(), {out.data(), ElemType::kF32, 64}};
  EXPECT_NE(adagrad_error().find("adagrad step: copy_out must be bf16 or fp16"), std::string::npos);
  std::vector<float> buf(80);
  adagrad_.copy_out = {};
  adagrad_.exp_avg_sq =
      std::span<float>(reinterpret_cast<float*>(reinterpret_cast<char*>(buf.data()) + 2), 64);
  EXPECT_NE(adagrad_error().find("exp_avg_sq"), std::string::npos);
}

}  // namespace
}  // namespace strata::adam
