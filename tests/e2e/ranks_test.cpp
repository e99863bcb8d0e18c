// Data-parallel ranks through the engine (DESIGN.md section 10): N ranks as
// threads of this process, each an Engine on the host device meeting the
// others over Gloo (a file store in the test's folder), train the MLP on one
// micro-batch each per step. Their result is compared with one rank that
// accumulates the same N micro-batches per step.
//
// The bound, and why it is zero here: the ranks sum their fp32 host
// gradients in rank order (rank 0's + rank 1's + ...), which is the order
// one rank accumulating micro-batch r as its r-th forms the sum in, so with
// one micro-batch per rank the step's gradient is the same fp32 value bit
// for bit; the norm is the block partials summed in block order, whatever
// rank computed them (padding blocks add exact zeros); each element's update
// is numerics.h's whatever rank runs it. So weights, moments, compute
// copies and norms are bit-identical to the accumulating rank's. (With k > 1
// micro-batches per rank the sum is (m0 + .. + mk-1) per rank, then over the
// ranks: a different association, within fp32 rounding of the single rank's
// sum, |error| <= (N k - 1) u sum |g|, u = 2^-24.)
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/mlp_harness.h"

namespace strata::engine::e2e {
namespace {

// Steps per run: enough for clipping to fire and the moments to matter
// (every comparison is bit for bit, or within rounding), few enough that the
// suite stays short under the sanitizers (every case trains 2 to 4 engines).
constexpr int kRankSteps = 8;

// What a run leaves to compare: the fp32 masters and moments (each element
// from the rank that owns it), each rank's compute copies, and the norms.
struct Outcome {
  std::map<std::string, std::vector<float>> master, exp_avg, exp_avg_sq;
  std::vector<std::map<std::string, std::vector<float>>> compute;  // per rank
  std::vector<double> norms;  // per step (rank 0's)
  std::vector<double> losses;  // per step, rank 0's micro-batch
};

std::map<std::string, std::vector<float>> read_array(Engine& e, int which) {
  std::map<std::string, std::vector<float>> out;
  for (const Tensor& t : kTensors) {
    std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
    const core::Status s = e.read_state(t.name, which, v);
    EXPECT_TRUE(s.ok()) << s;
    out[t.name] = std::move(v);
  }
  return out;
}

std::map<std::string, std::vector<float>> read_computes(Engine& e) {
  std::map<std::string, std::vector<float>> out;
  for (const Tensor& t : kTensors) {
    std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
    const core::Status s = e.read_compute(t.name, v);
    EXPECT_TRUE(s.ok()) << s;
    out[t.name] = std::move(v);
  }
  return out;
}

// Each element from the rank that holds it (read_state gives NaN for the
// others'); every element must come from exactly one rank.
void merge_owned(std::map<std::string, std::vector<float>>& into, const std::map<std::string, std::vector<float>>& part) {
  for (const auto& [name, values] : part) {
    std::vector<float>& dst = into[name];
    if (dst.empty()) dst.assign(values.size(), std::numeric_limits<float>::quiet_NaN());
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(values[i])) continue;
      EXPECT_TRUE(std::isnan(dst[i])) << name << "[" << i << "] is held by two ranks";
      dst[i] = values[i];
    }
  }
}

class RanksTest : public MlpTest {
 protected:
  void SetUp() override {
    MlpTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (test_device().kind != DeviceKind::kHost) GTEST_SKIP() << "ranks as threads run on the host device";
    if (!partition::has_backend("gloo")) GTEST_SKIP() << "this build has no Gloo (libgloo-dev)";
  }

  // The e2e config with `placement` of the optimizer state ("device", "cpu"
  // or "nvme") and `overlap`; stage 2.
  Config config(const std::string& placement, OverlapMode overlap) const {
    Config c = base();
    c.zero.stage = 2;
    c.strata.overlap = overlap;
    if (placement == "cpu") c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    if (placement == "nvme") c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    return c;
  }

  partition::CommunicatorOptions ranks(int rank, int size, const std::string& run) const {
    partition::CommunicatorOptions o;
    o.backend = "gloo";
    o.rank = rank;
    o.size = size;
    o.store_dir = (dir_ / ("rendezvous-" + run)).string();
    std::filesystem::create_directories(o.store_dir);
    o.prefix = run;
    o.timeout = std::chrono::seconds(60);
    o.connect_timeout = std::chrono::seconds(60);
    return o;
  }

  // One rank accumulating n micro-batches per step: micro-batch r of step s
  // is batch s * n + r.
  Outcome accumulate(Config c, int n) {
    c.gradient_accumulation_steps = n;
    c.train_batch_size = kBatch * n;
    Outcome out;
    std::unique_ptr<Engine> e = make_mlp_engine(c);
    if (e == nullptr) return out;
    Framework f;
    for (int s = 0; s < kRankSteps; ++s) {
      for (int r = 0; r < n; ++r) {
        if (r > 0) {
          const core::Status m = e->micro_step_end();
          EXPECT_TRUE(m.ok()) << m;
        }
        const auto st = micro_batch(*e, f, s * n + r, r + 1 == n, r == 0 ? &out.losses : nullptr);
        if (r + 1 == n && st.ok()) out.norms.push_back(st->grad_norm);
      }
    }
    out.master = read_array(*e, 0);
    out.exp_avg = read_array(*e, 1);
    out.exp_avg_sq = read_array(*e, 2);
    out.compute.push_back(read_computes(*e));
    return out;
  }

  // n ranks as threads, each with `gas` micro-batches per step: rank r's
  // micro-batch m of step s is batch (s * gas + m) * n + r, the one a single
  // rank accumulating n x gas micro-batches takes as its (m * n + r)-th.
  Outcome data_parallel(Config c, int n, const std::string& run, int gas = 1) {
    c.gradient_accumulation_steps = gas;
    c.train_batch_size = kBatch * gas;
    Outcome out;
    std::vector<Outcome> per(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Outcome& o = per[static_cast<std::size_t>(r)];
        std::unique_ptr<Engine> e = make_mlp_engine(c, ranks(r, n, run));
        if (e == nullptr) return;
        Framework f;
        for (int s = 0; s < kRankSteps; ++s) {
          for (int m = 0; m + 1 < gas; ++m) {
            micro_batch(*e, f, (s * gas + m) * n + r, false, nullptr).status().ignore_error();
            const core::Status ms = e->micro_step_end();
            ASSERT_TRUE(ms.ok()) << ms;
          }
          const auto st = micro_batch(*e, f, (s * gas + gas - 1) * n + r, true, &o.losses);
          if (!st.ok()) return;
          o.norms.push_back(st->grad_norm);
        }
        o.master = read_array(*e, 0);
        o.exp_avg = read_array(*e, 1);
        o.exp_avg_sq = read_array(*e, 2);
        o.compute.push_back(read_computes(*e));
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      Outcome& o = per[static_cast<std::size_t>(r)];
      merge_owned(out.master, o.master);
      merge_owned(out.exp_avg, o.exp_avg);
      merge_owned(out.exp_avg_sq, o.exp_avg_sq);
      if (!o.compute.empty()) out.compute.push_back(o.compute.front());
      EXPECT_EQ(o.norms, per[0].norms) << "rank " << r << " saw other norms than rank 0";
    }
    out.norms = per[0].norms;
    out.losses = per[0].losses;
    return out;
  }

  // One micro-batch on batch `batch`: forward, backward, gradients, and
  // step_end when `last` (else the caller's micro_step_end follows).
  static core::Result<StepStats> micro_batch(Engine& e, Framework& f, int batch, bool last,
                                             std::vector<double>* losses) {
    f.bind(e);
    f.batch(batch * 16);
    f.load(e, "l1");
    f.load(e, "l2");
    const double loss = f.forward();
    if (losses != nullptr) losses->push_back(loss);
    const auto g = f.backward(static_cast<float>(e.loss_scale()));
    f.load(e, "l2");
    f.give_grads(e, "l2", g);
    f.load(e, "l1");
    f.give_grads(e, "l1", g);
    if (!last) return StepStats{};
    auto st = e.step_end();
    EXPECT_TRUE(st.ok()) << st.status();
    return st;
  }
};

void expect_same(const std::map<std::string, std::vector<float>>& a,
                 const std::map<std::string, std::vector<float>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, values] : a) {
    const auto it = b.find(name);
    ASSERT_NE(it, b.end()) << what << ": " << name;
    EXPECT_TRUE(bits_equal(values, it->second)) << what << " of " << name << " differ";
  }
}

struct Case {
  int ranks;
  std::string placement;
  OverlapMode overlap;
};

class RanksMatchAccumulation : public RanksTest, public ::testing::WithParamInterface<Case> {};

TEST_P(RanksMatchAccumulation, BitIdenticalToOneRankAccumulating) {
  const Case k = GetParam();
  const Config c = config(k.placement, k.overlap);
  const Outcome one = accumulate(c, k.ranks);
  const Outcome many = data_parallel(c, k.ranks, "run");
  ASSERT_EQ(one.norms.size(), static_cast<std::size_t>(kRankSteps));
  ASSERT_EQ(many.norms.size(), static_cast<std::size_t>(kRankSteps));
  EXPECT_EQ(many.norms, one.norms);
  EXPECT_LT(one.losses.back(), one.losses.front());  // it trains
  // Clipping (at 1) fires, so the norm the ranks agree on matters.
  EXPECT_GT(std::count_if(one.norms.begin(), one.norms.end(), [](double n) { return n > 1.0; }), 0);
  expect_same(many.master, one.master, "masters");
  expect_same(many.exp_avg, one.exp_avg, "exp_avg");
  expect_same(many.exp_avg_sq, one.exp_avg_sq, "exp_avg_sq");
  ASSERT_EQ(many.compute.size(), static_cast<std::size_t>(k.ranks));
  for (int r = 0; r < k.ranks; ++r) {
    expect_same(many.compute[static_cast<std::size_t>(r)], one.compute[0], "compute copies of rank " + std::to_string(r));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, RanksMatchAccumulation,
    ::testing::Values(Case{1, "cpu", OverlapMode::kExact}, Case{2, "device", OverlapMode::kNone},
                      Case{2, "cpu", OverlapMode::kExact}, Case{2, "nvme", OverlapMode::kExact},
                      Case{3, "cpu", OverlapMode::kNone}, Case{3, "nvme", OverlapMode::kExact},
                      Case{2, "nvme", OverlapMode::kDelayed}, Case{3, "cpu", OverlapMode::kDelayed}),
    [](const ::testing::TestParamInfo<Case>& i) {
      return "N" + std::to_string(i.param.ranks) + "_" + i.param.placement + "_" + std::string(to_string(i.param.overlap));
    });

TEST_F(RanksTest, AccumulationOnEachRankStaysWithinFp32Rounding) {
  // Two micro-batches on each of two ranks against one rank accumulating the
  // four: each micro-batch's gradients are summed over the ranks, then over
  // the micro-batches ((m0 + m1) + (m2 + m3) where one rank forms
  // ((m0 + m1) + m2) + m3), so the step's gradient differs by fp32 rounding
  // only (a few ulps); a few steps of Adam keep the weights within a few
  // ulps of their size.
  const Config c = config("cpu", OverlapMode::kExact);
  const Outcome one = accumulate(c, 4);
  const Outcome many = data_parallel(c, 2, "accumulating", 2);
  ASSERT_EQ(many.norms.size(), static_cast<std::size_t>(kRankSteps));
  for (std::size_t s = 0; s < one.norms.size(); ++s) {
    EXPECT_NEAR(many.norms[s], one.norms[s], 1e-5 * one.norms[s]) << "step " << s + 1;
  }
  double worst = 0.0;
  for (const auto& [name, values] : one.master) {
    const std::vector<float>& got = many.master.at(name);
    ASSERT_EQ(got.size(), values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
      worst = std::max(worst, std::abs(double(got[i]) - double(values[i])));
    }
  }
  EXPECT_LT(worst, 1e-5) << "the largest difference of a master weight";
  EXPECT_FALSE(bits_equal(many.master.at("l1.w"), one.master.at("l1.w")))
      << "another association of the sum was expected to round differently somewhere";
}

TEST_F(RanksTest, GroupsHandedOverInAnotherOrderFailTheStepOnEveryRank) {
  // Three ranks: both groups' shards are one norm block, so rank 2 handing
  // l1 over before l2 pairs its sums with the others' of the other group
  // (equal counts). The sums' sequence is compared at the partials' gather:
  // every rank's step fails, naming the order, before anything is applied.
  const Config c = config("cpu", OverlapMode::kExact);
  std::vector<core::Status> got(3);
  std::vector<std::map<std::string, std::vector<float>>> before(3), after(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Engine> e = make_mlp_engine(c, ranks(r, 3, "order"));
      if (e == nullptr) return;
      before[static_cast<std::size_t>(r)] = read_array(*e, 0);
      Framework f;
      f.bind(*e);
      f.batch(r * 16);
      f.load(*e, "l1");
      f.load(*e, "l2");
      f.forward();
      const auto g = f.backward(1.0f);
      got[static_cast<std::size_t>(r)] = [&]() -> core::Status {
        for (const char* group : r == 2 ? std::vector<const char*>{"l1", "l2"} : std::vector<const char*>{"l2", "l1"}) {
          STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, e->grad_buffer(group));
          std::vector<std::byte> zeros(span.size_bytes());
          const GroupPlace* gp = e->layout().find_group(group);
          for (std::size_t pi : gp->params) {  // the gradients, as the harness writes them
            const ParamDesc& p = e->layout().params[pi];
            const auto& src = g.at(p.name);
            for (std::size_t i = 0; i < src.size(); ++i) {
              const std::uint16_t hb = nx::fp32_to_bf16_bits(src[i]);
              std::memcpy(zeros.data() + (e->layout().places[pi].compute_offset + static_cast<std::int64_t>(i)) * 2, &hb, 2);
            }
          }
          STRATA_RETURN_IF_ERROR(e->device().copy_h2d(f.stream(*e), span, zeros));
          STRATA_RETURN_IF_ERROR(e->device().synchronize(f.stream(*e)));
          STRATA_RETURN_IF_ERROR(e->grads_ready(group));
        }
        return e->step_end().status();
      }();
      after[static_cast<std::size_t>(r)] = read_array(*e, 0);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    const core::Status& s = got[static_cast<std::size_t>(r)];
    EXPECT_FALSE(s.ok()) << "rank " << r;
    EXPECT_NE(s.message().find("in the same order"), std::string::npos) << "rank " << r << ": " << s;
    expect_same(after[static_cast<std::size_t>(r)], before[static_cast<std::size_t>(r)],
                "rank " + std::to_string(r) + "'s masters");
  }
}

TEST_F(RanksTest, RanksThatStartFromOtherValuesFailFinalize) {
  // Rank 1 initialises l2.b otherwise: finalize compares the ranks' initial
  // values and fails on both, naming the rank.
  const Config c = config("cpu", OverlapMode::kExact);
  std::vector<core::Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto created = Engine::create(c, ranks(r, 2, "start"));
      ASSERT_TRUE(created.ok()) << created.status();
      std::unique_ptr<Engine> e = std::move(created).value();
      for (const Tensor& t : kTensors) {
        const ParamDesc d{t.name, t.shape, t.group, true, 0};
        ASSERT_TRUE(e->register_param(d, [t, r](std::span<float> out) {
                       init_values(t, out);
                       if (r == 1 && t.name == "l2.b") out[0] += 1.0f;
                       return core::Status();
                     }).ok());
      }
      got[static_cast<std::size_t>(r)] = e->finalize();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    const core::Status& s = got[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
    EXPECT_NE(s.message().find("rank 1's initial values differ from rank 0's"), std::string::npos) << s;
  }
}

TEST_F(RanksTest, RerunsAreBitIdentical) {
  const Config c = config("cpu", OverlapMode::kExact);
  const Outcome a = data_parallel(c, 2, "first");
  const Outcome b = data_parallel(c, 2, "second");
  ASSERT_EQ(a.norms.size(), static_cast<std::size_t>(kRankSteps));
  EXPECT_EQ(a.norms, b.norms);
  expect_same(a.master, b.master, "masters");
  expect_same(a.exp_avg_sq, b.exp_avg_sq, "exp_avg_sq");
}

TEST_F(RanksTest, EachRankKeepsItsShardOfTheState) {
  // The optimizer state of one rank of three is a third of one rank's (the
  // groups padded to three norm blocks each), in its own swap folder.
  const Config c = config("nvme", OverlapMode::kExact);
  std::unique_ptr<Engine> one = make_mlp_engine(c);
  ASSERT_NE(one, nullptr);
  const std::uint64_t whole = one->layout().bytes().nvme;
  one.reset();
  std::vector<std::uint64_t> nvme(3), pinned(3);
  std::vector<std::vector<std::string>> paths(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Engine> e = make_mlp_engine(c, ranks(r, 3, "shares"));
      if (e == nullptr) return;
      nvme[static_cast<std::size_t>(r)] = e->layout().bytes().nvme;
      pinned[static_cast<std::size_t>(r)] = e->layout().bytes().pinned;
      paths[static_cast<std::size_t>(r)] = e->swap_paths();
      for (const GroupPlace& g : e->layout().groups) {
        EXPECT_EQ(g.trainable_elems % (3 * nx::kNormBlockElems), 0) << g.name;
        EXPECT_EQ(g.shard_begin, g.trainable_begin + r * g.shard_elems) << g.name;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The MLP's groups: l1 three blocks, l2 one, so one rank of three holds
  // one block of each where one rank alone holds all four.
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(nvme[static_cast<std::size_t>(r)] * 2, whole) << "rank " << r;
    // Its host gradients (the only pinned state here: compute copies on the
    // device) are its two blocks' in fp32, not the six of the padded space.
    EXPECT_EQ(pinned[static_cast<std::size_t>(r)], 2u * nx::kNormBlockElems * 4) << "rank " << r;
    ASSERT_EQ(paths[static_cast<std::size_t>(r)].size(), 1u);
    EXPECT_EQ(paths[static_cast<std::size_t>(r)][0], (dir_ / ("rank-" + std::to_string(r))).string());
  }
}

TEST_F(RanksTest, WhatIsNotBuiltForRanksSaysSo) {
  // Speculative updates with ranks: refused at create, before meeting anyone.
  auto spec = Engine::create(config("nvme", OverlapMode::kSpeculative), ranks(0, 2, "refused"));
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), core::StatusCode::kUnimplemented);
  EXPECT_NE(spec.status().message().find("speculative"), std::string::npos) << spec.status();
  auto bad = Engine::create(config("cpu", OverlapMode::kExact), ranks(2, 2, "refused"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), core::StatusCode::kInvalidArgument);
  // Checkpoints with ranks: refused on every rank, naming the call.
  const Config c = config("cpu", OverlapMode::kExact);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Engine> e = make_mlp_engine(c, ranks(r, 2, "checkpoint"));
      if (e == nullptr) return;
      const core::Status s = e->save_checkpoint((dir_ / "ckpt").string(), {});
      EXPECT_EQ(s.code(), core::StatusCode::kUnimplemented) << s;
      EXPECT_NE(s.message().find("save_checkpoint"), std::string::npos) << s;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ckpt"));
}

TEST_F(RanksTest, ARankThatLeavesFailsTheOthersWithinTheTimeout) {
  // Rank 1 leaves after one step; rank 0's next step fails within the
  // collectives' timeout with an error naming what it waited for.
  const Config c = config("cpu", OverlapMode::kExact);
  core::Status second;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      partition::CommunicatorOptions o = ranks(r, 2, "leaves");
      o.timeout = std::chrono::seconds(3);
      std::unique_ptr<Engine> e = make_mlp_engine(c, o);
      if (e == nullptr) return;
      Framework f;
      const auto first = micro_batch(*e, f, r, true, nullptr);
      EXPECT_TRUE(first.ok()) << first.status();
      if (r == 1) return;  // leaves: its engine and communicators are destroyed
      f.bind(*e);
      f.batch(99);
      f.load(*e, "l1");
      f.load(*e, "l2");
      f.forward();
      const auto g = f.backward(1.0f);
      f.load(*e, "l2");
      f.give_grads(*e, "l2", g);  // its pass waits for rank 1 in vain
      // l1's gradients (their values do not matter): any call may see the failure.
      second = [&]() -> core::Status {
        STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, e->grad_buffer("l1"));
        (void)span;
        STRATA_RETURN_IF_ERROR(e->grads_ready("l1"));
        return e->step_end().status();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.message().find("group"), std::string::npos) << second;
}

}  // namespace
}  // namespace strata::engine::e2e
