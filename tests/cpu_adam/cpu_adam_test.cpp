// cpu_adam: every kernel, thread count and tile size against the scalar
// kernel (numerics.h), bit for bit, on random inputs with tails, subnormals and
// inf/nan; agreement with float64 over 100 steps; the gradient pass; bad input.
#include "cpu_adam/cpu_adam.h"

#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/numerics.h"

namespace strata::adam {
namespace {

namespace nx = core::numerics;

std::unique_ptr<CpuAdam> make(Isa isa, int threads = 1, std::int64_t tile = 0) {
  CpuAdamOptions o;
  o.auto_isa = false;
  o.isa = isa;
  o.threads = threads;
  o.tile_elems = tile;
  auto r = CpuAdam::create(o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

// Bit-equal, or both NaN (NaN payloads are outside the contract).
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

// Random state; `specials` sprinkles subnormal, zero, -0, inf and NaN gradients.
struct State {
  std::vector<float> p, m, v;
  std::vector<std::uint16_t> g16;
  std::vector<float> g32;
  std::vector<std::uint16_t> out;
};

State random_state(std::int64_t n, std::uint32_t seed, bool specials, bool subnormal_moments = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.p.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.g32.resize(n);
  s.g16.resize(n);
  s.out.assign(n, 0xdead);
  for (std::int64_t i = 0; i < n; ++i) {
    s.p[i] = normal(rng);
    s.m[i] = subnormal_moments ? std::ldexp(normal(rng), -135) : normal(rng) * 0.01f;
    s.v[i] = subnormal_moments ? std::ldexp(std::fabs(normal(rng)), -140) : std::fabs(normal(rng)) * 1e-4f;
    float g = normal(rng) * 4.0f;
    if (specials) {
      switch (rng() % 64) {
        case 0: g = std::ldexp(1.0f, -140); break;  // subnormal
        case 1: g = 0.0f; break;
        case 2: g = -0.0f; break;
        case 3: g = std::numeric_limits<float>::infinity(); break;
        case 4: g = std::numeric_limits<float>::quiet_NaN(); break;
        case 5: g = std::ldexp(normal(rng), -120); break;  // near the subnormal range
        case 6: g = 70000.0f; break;                        // beyond fp16
        case 7:  // a subnormal master that stays subnormal (u = 0): its compute copy converts a subnormal
          s.p[i] = std::ldexp(normal(rng), -130);
          s.m[i] = 0.0f;
          g = 0.0f;
          break;
        default: break;
      }
    }
    s.g32[i] = g;
  }
  return s;
}

void fill_grad16(State& s, ElemType t) {
  for (size_t i = 0; i < s.g32.size(); ++i) {
    s.g16[i] = t == ElemType::kBf16 ? nx::fp32_to_bf16_bits(s.g32[i]) : nx::fp32_to_fp16_bits(s.g32[i]);
  }
}

void run_step(CpuAdam& adam, State& s, ElemType grad_type, ElemType copy_type, bool copy,
              const nx::AdamStepConstants& c) {
  AdamStepArgs a;
  a.constants = c;
  a.master = s.p;
  a.exp_avg = s.m;
  a.exp_avg_sq = s.v;
  const std::int64_t n = static_cast<std::int64_t>(s.p.size());
  if (grad_type == ElemType::kF32) a.grad = {s.g32.data(), ElemType::kF32, n};
  else a.grad = {s.g16.data(), grad_type, n};
  if (copy) a.copy_out = {s.out.data(), copy_type, n};
  const core::Status st = adam.step(a);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

::testing::AssertionResult states_equal(const State& a, const State& b, ElemType copy_type) {
  for (size_t i = 0; i < a.p.size(); ++i) {
    if (!same(a.p[i], b.p[i]) || !same(a.m[i], b.m[i]) || !same(a.v[i], b.v[i]) ||
        !same16(a.out[i], b.out[i], copy_type)) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << a.p.size() << ": p " << a.p[i] << " vs " << b.p[i]
             << ", m " << a.m[i] << " vs " << b.m[i] << ", v " << a.v[i] << " vs " << b.v[i]
             << ", out 0x" << std::hex << a.out[i] << " vs 0x" << b.out[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class CpuAdamIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU does not support " << isa_name(GetParam());
    }
  }
};

TEST_P(CpuAdamIsa, StepIsBitIdenticalToScalarForEveryTypeAndTail) {
  const std::vector<std::int64_t> sizes = {1, 15, 16, 17, 31, 33, 1023, 65536 + 17};
  const nx::AdamStepConstants adamw =
      nx::make_adam_constants({.lr = 1e-3, .beta2 = 0.95, .weight_decay = 0.1}, 7, 1.0 / 1024);
  const nx::AdamStepConstants l2 = nx::make_adam_constants(
      {.lr = 3e-4, .weight_decay = 0.01, .adamw_mode = false}, 1, 0.37);
  const nx::AdamStepConstants plain = nx::make_adam_constants({.lr = 2e-3}, 3, 1.0);
  // Not produced by make_adam_constants, but a valid struct: both decays at once.
  const nx::AdamStepConstants both = [&] {
    nx::AdamStepConstants c = l2;
    c.neg_lr_decay = adamw.neg_lr_decay;
    return c;
  }();
  auto vec = make(GetParam());
  auto ref = make(Isa::kScalar);
  std::uint32_t seed = 1;
  for (std::int64_t n : sizes) {
    for (ElemType gt : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      for (int copy = 0; copy < 3; ++copy) {
        const ElemType ct = copy == 2 ? ElemType::kF16 : ElemType::kBf16;
        for (const auto* c : {&adamw, &l2, &plain, &both}) {
          State a = random_state(n, ++seed, /*specials=*/true);
          fill_grad16(a, gt);
          State b = a;
          run_step(*vec, a, gt, ct, copy != 0, *c);
          run_step(*ref, b, gt, ct, copy != 0, *c);
          ASSERT_TRUE(states_equal(a, b, ct))
              << isa_name(GetParam()) << " n=" << n << " grad=" << elem_type_name(gt)
              << " copy=" << copy
              << (c == &l2 ? " L2" : c == &adamw ? " AdamW" : c == &plain ? " no decay" : " L2+AdamW");
        }
      }
    }
  }
}

TEST_P(CpuAdamIsa, LargeStepMatchesScalarOverManySteps) {
  constexpr std::int64_t kN = 3'000'000 + 5;
  auto vec = make(GetParam(), 2);
  auto ref = make(Isa::kScalar, 1);
  State a = random_state(kN, 99, /*specials=*/false);
  fill_grad16(a, ElemType::kBf16);
  State b = a;
  for (int t = 1; t <= 3; ++t) {
    const auto c = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, t, 0.5);
    run_step(*vec, a, ElemType::kBf16, ElemType::kBf16, true, c);
    run_step(*ref, b, ElemType::kBf16, ElemType::kBf16, true, c);
  }
  EXPECT_TRUE(states_equal(a, b, ElemType::kBf16));
}

TEST_P(CpuAdamIsa, SubnormalMomentsStaySubnormalEvenWithFlushToZeroSetByTheCaller) {
  constexpr std::int64_t kN = 4099;
  auto vec = make(GetParam());
  auto ref = make(Isa::kScalar);
  State a = random_state(kN, 5, false, /*subnormal_moments=*/true);
  for (float& g : a.g32) g = std::ldexp(g, -128);  // subnormal-range gradients
  State b = a;
  const auto c = nx::make_adam_constants({.lr = 1e-3}, 3, 1.0);
  // An embedder may run with FTZ/DAZ on; the kernels must not inherit it.
  const unsigned saved = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(saved | (1u << 15) | (1u << 6));
  run_step(*vec, a, ElemType::kF32, ElemType::kBf16, true, c);
  __builtin_ia32_ldmxcsr(saved);
  run_step(*ref, b, ElemType::kF32, ElemType::kBf16, true, c);
  EXPECT_TRUE(states_equal(a, b, ElemType::kBf16));
  std::int64_t subnormal = 0;
  for (float m : a.m) subnormal += std::fpclassify(m) == FP_SUBNORMAL;
  EXPECT_GT(subnormal, kN / 2);
}

// Gradient pass: every combination against the scalar kernel.
TEST_P(CpuAdamIsa, GradPassIsBitIdenticalToScalar) {
  auto vec = make(GetParam(), 2);
  auto ref = make(Isa::kScalar, 1);
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{31}, std::int64_t{33}, std::int64_t{65536},
                         std::int64_t{65536 * 2 + 1000}}) {
    for (ElemType st : {ElemType::kF32, ElemType::kBf16, ElemType::kF16}) {
      for (int mode = 0; mode < 6; ++mode) {
        // mode % 3: 0 assign to fp32, 1 accumulate, 2 keep the type. mode / 3:
        // finite data (partials must match bit for bit), then inf/NaN sprinkled in.
        if (mode % 3 == 2 && st == ElemType::kF32) continue;
        const bool specials = mode >= 3;
        State s = random_state(n, static_cast<std::uint32_t>(n) + mode, specials);
        fill_grad16(s, st);
        const void* src = st == ElemType::kF32 ? static_cast<const void*>(s.g32.data()) : s.g16.data();
        const ElemType dt = mode % 3 == 2 ? st : ElemType::kF32;
        std::vector<float> acc_a(s.p), acc_b(s.p);  // existing accumulators
        std::vector<std::uint16_t> keep_a(n), keep_b(n);
        std::vector<double> pa(nx::norm_block_count(n)), pb(pa.size());
        GradPassArgs args;
        args.src = {src, st, n};
        args.accumulate = mode % 3 == 1;
        auto run = [&](CpuAdam& adam, std::vector<float>& acc, std::vector<std::uint16_t>& keep,
                       std::vector<double>& partials) {
          args.dst = mode % 3 == 2 ? TypedSpan{keep.data(), dt, n} : TypedSpan{acc.data(), dt, n};
          args.norm_partials = partials;
          auto r = adam.grad_pass(args);
          EXPECT_TRUE(r.ok()) << r.status().to_string();
          return r.ok() && r->nonfinite;
        };
        const bool nf_a = run(*vec, acc_a, keep_a, pa);
        const bool nf_b = run(*ref, acc_b, keep_b, pb);
        EXPECT_EQ(nf_a, nf_b);
        if (!specials) {
          EXPECT_FALSE(nf_a);
        }
        for (std::int64_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same(acc_a[i], acc_b[i])) << i;
          ASSERT_EQ(keep_a[i], keep_b[i]) << i;
        }
        for (size_t b = 0; b < pa.size(); ++b) {
          ASSERT_TRUE(std::bit_cast<std::uint64_t>(pa[b]) == std::bit_cast<std::uint64_t>(pb[b]) ||
                      (specials && std::isnan(pa[b]) && std::isnan(pb[b])))
              << "block " << b << ": " << pa[b] << " vs " << pb[b];
        }
      }
    }
  }
}

// The vector kernels stream the copy-out when its address is aligned; the
// bits must not depend on which path ran.
TEST_P(CpuAdamIsa, CopyOutIsTheSameStreamedOrNot) {
  constexpr std::int64_t kN = 65536 + 45;
  const auto c = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.01}, 2, 1.0);
  auto vec = make(GetParam(), 2, 65536);
  auto ref = make(Isa::kScalar);
  auto buffer = core::AlignedBuffer::allocate((kN + 64) * 2, 64);
  ASSERT_TRUE(buffer.ok());
  for (std::int64_t offset : {0, 1, 8}) {  // 64-byte aligned, 2-byte aligned, 16-byte aligned
    std::uint16_t* out = buffer->as<std::uint16_t>().data() + offset;
    for (ElemType ct : {ElemType::kBf16, ElemType::kF16}) {
      State a = random_state(kN, 77, false);
      State b = a;
      AdamStepArgs args;
      args.constants = c;
      args.master = a.p;
      args.exp_avg = a.m;
      args.exp_avg_sq = a.v;
      args.grad = {a.g32.data(), ElemType::kF32, kN};
      args.copy_out = {out, ct, kN};
      ASSERT_TRUE(vec->step(args).ok());
      std::vector<std::uint16_t> got(out, out + kN);
      run_step(*ref, b, ElemType::kF32, ct, true, c);
      ASSERT_EQ(got, b.out) << "offset " << offset << " " << elem_type_name(ct);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CpuAdamIsa, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

TEST(CpuAdam, ThreadCountAndTileSizeDoNotChangeTheBits) {
  constexpr std::int64_t kN = 65536 * 9 + 123;
  const auto c = nx::make_adam_constants({.lr = 1e-3, .weight_decay = 0.05}, 11, 0.25);
  State base = random_state(kN, 42, true);
  fill_grad16(base, ElemType::kBf16);
  State expect = base;
  run_step(*make(Isa::kScalar, 1, 65536 * 16), expect, ElemType::kBf16, ElemType::kBf16, true, c);
  for (int threads : {1, 2, 3}) {
    for (std::int64_t tile : {65536, 65536 * 2, 65536 * 4}) {
      State s = base;
      run_step(*make(best_isa(), threads, tile), s, ElemType::kBf16, ElemType::kBf16, true, c);
      EXPECT_TRUE(states_equal(s, expect, ElemType::kBf16)) << threads << " threads, tile " << tile;
    }
  }
}

TEST(CpuAdam, UsesTheConfiguredThreads) {
  auto adam = make(best_isa(), 2, 65536);
  std::mutex mu;
  std::set<std::thread::id> ids;
  // Enough tiles, each slow enough, that a second thread must take some.
  adam->for_each_tile(65536 * 64, [&](std::int64_t, std::int64_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  EXPECT_EQ(ids.size(), 2u);
}

TEST(CpuAdam, GradPassNormFollowsTheContractAndFlagsNonFinite) {
  constexpr std::int64_t kN = 65536 * 3 + 77;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> g(kN);
  for (auto& x : g) x = nx::fp32_to_bf16_bits(normal(rng));
  std::vector<float> acc(kN);
  std::vector<double> partials(nx::norm_block_count(kN));
  auto adam = make(best_isa(), 2, 65536);
  GradPassArgs args{{g.data(), ElemType::kBf16, kN}, {acc.data(), ElemType::kF32, kN}, false, partials};
  auto r = adam->grad_pass(args);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->nonfinite);
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(partials.size()); ++b) {
    const std::int64_t begin = b * nx::kNormBlockElems;
    const std::int64_t len = std::min<std::int64_t>(nx::kNormBlockElems, kN - begin);
    const double expect = nx::norm_block_partial(g.data() + begin, len, nx::bf16_bits_to_fp32);
    EXPECT_EQ(std::bit_cast<std::uint64_t>(partials[b]), std::bit_cast<std::uint64_t>(expect)) << b;
    EXPECT_EQ(acc[begin], nx::bf16_bits_to_fp32(g[begin]));
  }
  // Accumulating the same gradient doubles every value exactly.
  args.accumulate = true;
  ASSERT_TRUE(adam->grad_pass(args).ok());
  EXPECT_EQ(acc[kN - 1], 2.0f * nx::bf16_bits_to_fp32(g[kN - 1]));
  // One inf in the last block is reported.
  g[kN - 3] = 0x7f80;
  args.accumulate = false;
  auto r2 = adam->grad_pass(args);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->nonfinite);
  // Keeping bf16 in place (src == dst) computes the norm without changing a bit.
  std::vector<std::uint16_t> before = g;
  GradPassArgs keep{{g.data(), ElemType::kBf16, kN}, {g.data(), ElemType::kBf16, kN}, false, partials};
  ASSERT_TRUE(adam->grad_pass(keep).ok());
  EXPECT_EQ(g, before);
}

TEST(CpuAdam, AgreesWithFloat64Over100Steps) {
  constexpr std::int64_t kN = 4096 + 7;
  const nx::AdamHyperparams h{.lr = 1e-3, .beta2 = 0.999, .weight_decay = 0.01};
  State s = random_state(kN, 17, false);
  std::vector<double> p(s.p.begin(), s.p.end()), m(s.m.begin(), s.m.end()), v(s.v.begin(), s.v.end());
  auto adam = make(best_isa(), 2, 65536);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 1; t <= 100; ++t) {
    for (float& g : s.g32) g = normal(rng);
    run_step(*adam, s, ElemType::kF32, ElemType::kBf16, false, nx::make_adam_constants(h, t, 1.0));
    const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
    for (std::int64_t i = 0; i < kN; ++i) {
      const double g = s.g32[i];
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1 - h.beta2) * g * g;
      p[i] -= h.lr * h.weight_decay * p[i];
      p[i] -= h.lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
    }
  }
  // Stated tolerance: 1e-5 relative to max(1, |x|) after 100 steps.
  for (std::int64_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(s.p[i], p[i], 1e-5 * std::max(1.0, std::fabs(p[i]))) << i;
    ASSERT_NEAR(s.m[i], m[i], 1e-5 * std::max(1.0, std::fabs(m[i]))) << i;
    ASSERT_NEAR(s.v[i], v[i], 1e-5 * std::max(1.0, std::fabs(v[i]))) << i;
  }
}

// --- bad input ------------------------------------------------------------------

class CpuAdamBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    s_ = random_state(64, 1, false);
    args_.constants = nx::make_adam_constants({}, 1, 1.0);
    args_.master = s_.p;
    args_.exp_avg = s_.m;
    args_.exp_avg_sq = s_.v;
    args_.grad = {s_.g32.data(), ElemType::kF32, 64};
  }
  std::string error() {
    const core::Status st = adam_->step(args_);
    EXPECT_EQ(st.code(), core::StatusCode::kInvalidArgument) << st.to_string();
    return std::string(st.message());
  }
  State s_;
  AdamStepArgs args_;
  std::unique_ptr<CpuAdam> adam_ = make(best_isa(), 1);
};

TEST_F(CpuAdamBadInput, ZeroLength) {
  args_.master = {};
  EXPECT_NE(error().find("zero elements"), std::string::npos);
}
TEST_F(CpuAdamBadInput, SizesDiffer) {
  args_.exp_avg = std::span<float>(s_.m).first(10);
  EXPECT_NE(error().find("sizes differ"), std::string::npos);
}
TEST_F(CpuAdamBadInput, OverlappingBuffers) {
  args_.exp_avg = std::span<float>(s_.p);
  EXPECT_NE(error().find("master and exp_avg overlap"), std::string::npos);
}
TEST_F(CpuAdamBadInput, MisalignedMaster) {
  std::vector<float> buf(80);
  args_.master = std::span<float>(reinterpret_cast<float*>(reinterpret_cast<char*>(buf.data()) + 1), 64);
  EXPECT_NE(error().find("master"), std::string::npos);
}
TEST_F(CpuAdamBadInput, BetaAtLeastOne) {
  args_.constants.beta2 = 1.0f;
  EXPECT_NE(error().find("beta2"), std::string::npos);
}
TEST_F(CpuAdamBadInput, EpsNotPositive) {
  args_.constants.eps = 0.0f;
  EXPECT_NE(error().find("eps"), std::string::npos);
}
TEST_F(CpuAdamBadInput, Fp32CopyOut) {
  std::vector<float> out(64);
  args_.copy_out = {out.data(), ElemType::kF32, 64};
  EXPECT_NE(error().find("copy_out must be bf16 or fp16"), std::string::npos);
}
TEST_F(CpuAdamBadInput, GradPassCombinations) {
  std::vector<std::uint16_t> g(64);
  std::vector<double> partials(1);
  GradPassArgs a{{s_.g32.data(), ElemType::kF32, 64}, {g.data(), ElemType::kBf16, 64}, false, partials};
  EXPECT_EQ(adam_->grad_pass(a).status().code(), core::StatusCode::kInvalidArgument);
  a = {{g.data(), ElemType::kBf16, 64}, {g.data(), ElemType::kBf16, 64}, true, partials};
  EXPECT_EQ(adam_->grad_pass(a).status().code(), core::StatusCode::kInvalidArgument);
  a = {{g.data(), ElemType::kBf16, 64}, {s_.p.data(), ElemType::kF32, 64}, false, {}};
  EXPECT_NE(adam_->grad_pass(a).status().to_string().find("norm_partials"), std::string::npos);
}
TEST(CpuAdamCreate, RejectsBadTilesAndThreads) {
  EXPECT_EQ(CpuAdam::create({.tile_elems = 1000}).status().code(), core::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuAdam::create({.threads = -1}).status().code(), core::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::adam
