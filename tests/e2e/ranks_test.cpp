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
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/str.h"
#include "engine/checkpoint/manifest.h"
#include "engine/io_faults.h"
#include "tests/e2e/ranks_harness.h"

namespace strata::engine::e2e {
namespace {

// `params` empty: stage 2 (the compute copies whole on every rank, their
// home the device); else stage 3 with their home there ("device", "cpu",
// "nvme"): each rank keeps its shard, a fetch gathers them; the outcome is
// the one rank's accumulating, bit for bit, either way.
struct Case {
  int ranks;
  std::string placement;
  OverlapMode overlap;
  std::string params;
  // No clipping and strata.nonfinite "apply": a certain step, whose early
  // job ("exact", "speculative") updates each group as its gradients arrive.
  bool certain = false;
  // gradient_clipping otherwise: at 1 it clips every step of these runs (their
  // norms fall from about 2.3 to 1.4); speculative cases take 1.75, so that
  // some steps keep the speculative work and others throw it away.
  double clip = 1.0;
};

class RanksMatchAccumulation : public RanksTest, public ::testing::WithParamInterface<Case> {};

TEST_P(RanksMatchAccumulation, BitIdenticalToOneRankAccumulating) {
  const Case k = GetParam();
  Config c = config(k.placement, k.overlap);
  if (!k.params.empty()) c = stage3(c, k.params);
  c.gradient_clipping = k.clip;
  if (k.certain) {
    c.gradient_clipping = 0.0;
    c.strata.nonfinite = NonfinitePolicy::kApply;
  }
  const Outcome one = accumulate(c, k.ranks);
  const Outcome many = data_parallel(c, k.ranks, "run");
  ASSERT_EQ(one.norms.size(), static_cast<std::size_t>(kRankSteps));
  ASSERT_EQ(many.norms.size(), static_cast<std::size_t>(kRankSteps));
  EXPECT_EQ(many.norms, one.norms);
  EXPECT_LT(one.losses.back(), one.losses.front());  // it trains
  // Clipping fires, so the norm the ranks agree on matters; a speculative
  // job is then thrown away, and kept on the other steps.
  const auto clipped = std::count_if(one.norms.begin(), one.norms.end(), [&](double n) { return n > k.clip; });
  if (!k.certain) {
    EXPECT_GT(clipped, 0);
    if (k.overlap == OverlapMode::kSpeculative) {
      EXPECT_LT(clipped, kRankSteps) << ::testing::PrintToString(one.norms);
    }
  }
  expect_same_outcome(many, one, k.ranks);
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return "N" + std::to_string(i.param.ranks) + "_" + i.param.placement + "_" + std::string(to_string(i.param.overlap)) +
         (i.param.params.empty() ? "" : "_params_" + i.param.params) + (i.param.certain ? "_certain" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Placements, RanksMatchAccumulation,
    ::testing::Values(Case{1, "cpu", OverlapMode::kExact, ""}, Case{2, "device", OverlapMode::kNone, ""},
                      Case{2, "cpu", OverlapMode::kExact, ""}, Case{2, "nvme", OverlapMode::kExact, ""},
                      Case{3, "cpu", OverlapMode::kNone, ""}, Case{3, "nvme", OverlapMode::kExact, ""},
                      Case{2, "nvme", OverlapMode::kDelayed, ""}, Case{3, "cpu", OverlapMode::kDelayed, ""},
                      Case{2, "nvme", OverlapMode::kSpeculative, "", false, 1.75},
                      Case{3, "cpu", OverlapMode::kSpeculative, "", false, 1.75},
                      Case{2, "cpu", OverlapMode::kExact, "", true}, Case{2, "device", OverlapMode::kExact, "", true},
                      Case{3, "nvme", OverlapMode::kSpeculative, "", true}),
    case_name);

INSTANTIATE_TEST_SUITE_P(
    Stage3, RanksMatchAccumulation,
    ::testing::Values(Case{2, "cpu", OverlapMode::kExact, "cpu"}, Case{3, "nvme", OverlapMode::kDelayed, "nvme"},
                      Case{3, "cpu", OverlapMode::kNone, "device"}, Case{2, "cpu", OverlapMode::kExact, "nvme"},
                      Case{3, "nvme", OverlapMode::kDelayed, "cpu"}, Case{2, "nvme", OverlapMode::kDelayed, "device"},
                      Case{2, "device", OverlapMode::kNone, "cpu"}, Case{2, "nvme", OverlapMode::kSpeculative, "nvme", false, 1.75},
                      Case{3, "cpu", OverlapMode::kExact, "device", true}),
    case_name);

TEST_F(RanksTest, Stage3ShardsTheComputeCopiesFrozenOnesToo) {
  // l2.b frozen: three ranks at stage 3 (its elements in one rank's frozen
  // shard, the others' padding) train as at stage 2, where every rank keeps
  // the compute copies whole; each rank's homes are its shards only.
  const std::vector<std::string> frozen = {"l2.b"};
  std::vector<std::vector<std::vector<float>>> weights(3);
  auto train = [&](const Config& c, const std::string& run, std::vector<std::uint64_t>* home_bytes) {
    return on_ranks(
        c, 3, run,
        [&](int r, Engine& e) {
          Framework f;
          for (int s = 0; s < 4; ++s) ASSERT_TRUE(micro_batch(e, f, s * 3 + r, true, nullptr).ok());
          // read_weights on every rank: the masters and the frozen compute copies whole.
          std::vector<std::vector<float>> values;
          std::vector<Engine::WeightRead> reads;
          values.reserve(kTensors.size());
          for (const Tensor& t : kTensors) {
            values.emplace_back(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
            reads.push_back({t.name, values.back()});
          }
          const core::Status read = e.read_weights(reads);
          EXPECT_TRUE(read.ok()) << read;
          weights[static_cast<std::size_t>(r)] = std::move(values);
          if (home_bytes == nullptr) return;
          const Layout& l = e.layout();
          EXPECT_TRUE(l.compute_sharded);
          std::uint64_t bytes = 0;
          for (const GroupPlace& g : l.groups) {
            EXPECT_EQ(l.home_elems(g) * 3, g.trainable_elems + g.frozen_elems) << g.name;
            bytes += l.home_bytes(g);
          }
          (*home_bytes)[static_cast<std::size_t>(r)] = bytes;
          EXPECT_EQ(l.bytes().pinned - bytes, static_cast<std::uint64_t>(l.trainable_elems / 3 * l.grad_bytes))
              << "the pinned state: the compute homes and the host gradients";
        },
        frozen);
  };
  Config two = config("nvme", OverlapMode::kExact);
  two.zero.offload_param.device = OffloadDevice::kCpu;  // stage 2 keeps it whole on every rank
  std::vector<std::uint64_t> homes(3);
  const Outcome whole = train(two, "stage2", nullptr);
  const std::vector<std::vector<std::vector<float>>> whole_weights = weights;
  const Outcome sharded = train(stage3(config("nvme", OverlapMode::kExact), "cpu"), "stage3", &homes);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(weights[static_cast<std::size_t>(r)].size(), kTensors.size());
    for (std::size_t k = 0; k < kTensors.size(); ++k) {
      EXPECT_TRUE(bits_equal(weights[static_cast<std::size_t>(r)][k], whole_weights[0][k]))
          << "rank " << r << ": read_weights of " << kTensors[k].name;
    }
  }
  expect_same(sharded.master, whole.master, "masters");
  ASSERT_EQ(sharded.compute.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    expect_same(sharded.compute[static_cast<std::size_t>(r)], whole.compute[0], "compute copies of rank " + std::to_string(r));
    EXPECT_EQ(homes[static_cast<std::size_t>(r)], homes[0]);
  }
}

TEST_F(RanksTest, Stage3KeptCopiesServeAFetchOnlyWhenEveryRankKeptOne) {
  // Stage 3 under a threaded schedule: a group's copy stays on the device
  // after its release, and its next fetch takes it back without gathering
  // when every rank kept its own (each says so in its gather's tag). Here l2 (a
  // group under stage3_param_persistence_threshold) always stays; l1 stays
  // within stage3_max_live_parameters, which may differ between the ranks:
  // with rank 1's at one element it keeps no l1, and every rank gathers l1
  // in the backward. Bits as one rank accumulating, either way, under
  // "exact", "delayed" (the forward computes with the copies before the
  // last update, kept ones too) and a certain step's early updates.
  struct Schedule {
    OverlapMode overlap;
    bool certain;
  };
  for (const Schedule sc : {Schedule{OverlapMode::kExact, false}, Schedule{OverlapMode::kDelayed, false},
                            Schedule{OverlapMode::kExact, true}}) {
  Config c = stage3(config("cpu", sc.overlap), "nvme");
  if (sc.certain) {
    c.gradient_clipping = 0.0;
    c.strata.nonfinite = NonfinitePolicy::kApply;
  }
  const Outcome one = accumulate(c, 2);
  for (const bool rank1_keeps_l1 : {true, false}) {
    SCOPED_TRACE(core::str_cat(to_string(sc.overlap), sc.certain ? " (certain)" : "",
                               rank1_keeps_l1 ? ": every rank keeps l1" : ": rank 1 keeps no l1"));
    std::vector<std::vector<StepStats>> stats(2);
    const Outcome many = on_ranks(
        c, 2, core::str_cat(to_string(sc.overlap), sc.certain ? "-certain" : "", rank1_keeps_l1 ? "-kept" : "-dropped"),
        [&](int r, Engine& e) {
          train_steps(e, r, 2, [&](int, const StepStats& st) { stats[static_cast<std::size_t>(r)].push_back(st); });
        },
        {}, "", [&](int r, Config& rc) {
          if (r == 1 && !rank1_keeps_l1) rc.zero.stage3_max_live_parameters = 1;
        });
    ASSERT_EQ(stats[0].size(), static_cast<std::size_t>(kRankSteps));
    ASSERT_EQ(stats[1].size(), static_cast<std::size_t>(kRankSteps));
    std::int64_t served = 0;
    for (int s = 0; s < kRankSteps; ++s) {
      const std::int64_t n = stats[0][static_cast<std::size_t>(s)].resident;
      EXPECT_EQ(stats[1][static_cast<std::size_t>(s)].resident, n) << "step " << s;  // the ranks agree
      served += n;
      // Under "exact" the backward's two fetches: both from kept copies, or l2's alone (each
      // step's update drops them).
      if (sc.overlap == OverlapMode::kExact && !sc.certain) {
        EXPECT_EQ(n, rank1_keeps_l1 ? 2 : 1) << "step " << s;
      }
    }
    EXPECT_GE(served, kRankSteps);  // l2's at least, every step
    expect_same_outcome(many, one, 2);
  }
  }
}

// A rank's compute homes are its own: at stage 3 with them on nvme, rank 0
// keeps its shards in pinned memory (offload_param.max_in_cpu), rank 1 on
// its swap drive; the fetches gather them alike and the outcome is one rank's
// accumulating, bit for bit. Rank 0 reads nothing from its drive for them.
TEST_F(RanksTest, Stage3RanksKeepTheirComputeHomesWhereMaxInCpuSays) {
  const Config c = stage3(config("cpu", OverlapMode::kExact), "nvme");
  const Outcome one = accumulate(c, 2);
  std::vector<std::vector<StepStats>> stats(2);
  std::vector<Tier> tiers(2, Tier::kDevice);
  const Outcome many = on_ranks(
      c, 2, "max-in-cpu",
      [&](int r, Engine& e) {
        tiers[static_cast<std::size_t>(r)] = e.layout().groups[0].compute_tier;
        train_steps(e, r, 2, [&](int, const StepStats& st) { stats[static_cast<std::size_t>(r)].push_back(st); });
      },
      {}, "", [](int r, Config& rc) {
        if (r == 0) rc.zero.offload_param.max_in_cpu = 1'000'000'000;
      });
  EXPECT_EQ(tiers, (std::vector<Tier>{Tier::kPinned, Tier::kNvme}));
  ASSERT_EQ(stats[0].size(), static_cast<std::size_t>(kRankSteps));
  ASSERT_EQ(stats[1].size(), static_cast<std::size_t>(kRankSteps));
  for (int s = 0; s < kRankSteps; ++s) {
    EXPECT_EQ(stats[0][static_cast<std::size_t>(s)].bytes.nvme_read, 0u) << s;  // the optimizer's state is pinned too
    EXPECT_GT(stats[1][static_cast<std::size_t>(s)].bytes.nvme_read, 0u) << s;
  }
  expect_same_outcome(many, one, 2);
}

TEST_F(RanksTest, Stage3AHomeThatCannotBeReadFailsEveryRanksFetchNamingTheRank) {
  // Stage 3, the compute copies' homes on nvme: rank 1's reads fail (EIO)
  // once it is finalized. A fetch reads each rank's home after the gather's
  // tags, and a failure travels with the rank's part of the payload: rank
  // 0's fetch fails naming rank 1 and its code, rank 1's with its own
  // error, both at once (not at the timeout).
  const Config c = stage3(config("cpu", OverlapMode::kExact), "nvme");
  FaultInjector faults;
  std::vector<core::Status> got(2);
  std::vector<double> seconds(2);
  std::uint64_t hits = 0;
  on_ranks(
      c, 2, "unreadable",
      [&](int r, Engine& e) {
        if (r == 1) faults.add(FaultRule{.kind = FaultKind::kEio, .ops = FaultOps::kReads, .times = -1});
        const auto t0 = std::chrono::steady_clock::now();
        got[static_cast<std::size_t>(r)] = e.fetch("l1").status();
        seconds[static_cast<std::size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r == 1) {
          hits = faults.total_hits();
          faults.clear();  // (the harness reads every rank's state afterwards)
        }
      },
      {}, "", [&](int r, Config& rc) {
        if (r == 1) rc.strata.io.fault_injector = &faults;
      });
  EXPECT_EQ(got[1].code(), core::StatusCode::kIoError) << got[1];
  EXPECT_EQ(got[0].code(), core::StatusCode::kIoError) << got[0];
  EXPECT_NE(got[0].message().find("rank 1 failed reading its part"), std::string::npos) << got[0];
  EXPECT_GT(hits, 0u);
  for (int r = 0; r < 2; ++r) EXPECT_LT(seconds[static_cast<std::size_t>(r)], 30.0) << "rank " << r;
}

TEST_F(RanksTest, Stage3FetchesThatDisagreeFailEveryRankAtOnce) {
  // Stage 3: a fetch is a gather every rank takes part in. Rank 1 fetching
  // l1 again without releasing it fails its fetch, and carries the failure
  // into the gather: rank 0's fetch fails too, naming rank 1, at once (not
  // at the 60 s timeout). Then rank 1 fetches l2 where rank 0 fetches l1:
  // both fail saying the ranks gathered different groups (the groups'
  // sizes differ: the tags, of one size, are compared first).
  const Config c = stage3(config("cpu", OverlapMode::kExact), "nvme");
  std::vector<core::Status> again(2), crossed(2);
  std::vector<double> seconds(2);
  on_ranks(c, 2, "disagree", [&](int r, Engine& e) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(e.fetch("l1").ok());
    if (r == 0) {
      ASSERT_TRUE(e.release("l1").ok());
    }
    again[static_cast<std::size_t>(r)] = e.fetch("l1").status();
    if (r == 0 && again[0].ok()) {
      ASSERT_TRUE(e.release("l1").ok());
    }
    if (r == 1) {
      ASSERT_TRUE(e.release("l1").ok());
    }
    crossed[static_cast<std::size_t>(r)] = e.fetch(r == 0 ? "l1" : "l2").status();
    seconds[static_cast<std::size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  EXPECT_EQ(again[1].code(), core::StatusCode::kFailedPrecondition) << again[1];
  EXPECT_NE(again[1].message().find("already fetched"), std::string::npos) << again[1];
  EXPECT_EQ(again[0].code(), core::StatusCode::kFailedPrecondition) << again[0];
  EXPECT_NE(again[0].message().find("rank 1 failed before its part"), std::string::npos) << again[0];
  for (int r = 0; r < 2; ++r) {
    const core::Status& x = crossed[static_cast<std::size_t>(r)];
    EXPECT_EQ(x.code(), core::StatusCode::kFailedPrecondition) << "rank " << r << ": " << x;
    EXPECT_NE(x.message().find("every rank fetches the same groups in the same order"), std::string::npos) << x;
    EXPECT_LT(seconds[static_cast<std::size_t>(r)], 30.0) << "rank " << r << " waited for the timeout";
  }
}

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
      const auto& g = f.backward(1.0f);
      got[static_cast<std::size_t>(r)] = [&]() -> core::Status {
        for (const char* group : r == 2 ? std::vector<const char*>{"l1", "l2"} : std::vector<const char*>{"l2", "l1"}) {
          STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, e->grad_buffer(group));
          std::vector<std::byte> zeros(span.size_bytes());
          const GroupPlace* gp = e->layout().find_group(group);
          for (std::size_t pi : gp->params) {  // the gradients, as the harness writes them
            const ParamDesc& p = e->layout().params[pi];
            const std::int64_t at = e->layout().places[pi].compute_offset - gp->trainable_compute_begin;
            if (e->layout().places[pi].trainable_offset < 0) continue;  // frozen: no slot
            const auto& src = g.at(p.name);
            for (std::size_t i = 0; i < src.size(); ++i) {
              const std::uint16_t hb = nx::fp32_to_bf16_bits(src[i]);
              std::memcpy(zeros.data() + (at + static_cast<std::int64_t>(i)) * 2, &hb, 2);
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

TEST_F(RanksTest, RanksConfiguredOtherwiseFailFinalizeNamingTheSetting) {
  // Rank 1 runs under another strata.overlap, then with another learning
  // rate: finalize compares the settings every rank must share and fails on
  // every rank, naming the key (a rank configured otherwise would issue
  // other collectives later). A setting that is a rank's own (its
  // stage3_max_live_parameters) is not compared.
  struct Case {
    std::function<void(Config&)> change;
    const char* key;
  };
  const Case cases[] = {
      {[](Config& c) { c.strata.overlap = OverlapMode::kNone; }, "rank 1's strata.overlap differs from rank 0's"},
      {[](Config& c) { c.optimizer.lr *= 2.0; }, "rank 1's optimizer.params.lr differs from rank 0's"},
      {[](Config& c) { c.scheduler.type = SchedulerType::kWarmupLR; }, "rank 1's scheduler differs from rank 0's:"},
      {[](Config& c) { c.zero.stage3_max_live_parameters = 1; }, nullptr},
  };
  int n = 0;
  for (const Case& k : cases) {
    std::vector<core::Status> got(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        Config c = config("cpu", OverlapMode::kExact);
        if (r == 1) k.change(c);
        auto created = Engine::create(c, ranks(r, 2, core::str_cat("settings", n)));
        ASSERT_TRUE(created.ok()) << created.status();
        std::unique_ptr<Engine> e = std::move(created).value();
        for (const Tensor& t : kTensors) {
          ASSERT_TRUE(e->register_param({t.name, t.shape, t.group, true, 0}, [t](std::span<float> out) {
                         init_values(t, out);
                         return core::Status();
                       }).ok());
        }
        got[static_cast<std::size_t>(r)] = e->finalize();
      });
    }
    for (std::thread& t : threads) t.join();
    ++n;
    for (int r = 0; r < 2; ++r) {
      const core::Status& s = got[static_cast<std::size_t>(r)];
      if (k.key == nullptr) {
        EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
        continue;
      }
      EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
      EXPECT_NE(s.message().find(k.key), std::string::npos) << s;
    }
  }
}

// strata.device_collectives: summed on the device (the host device's Gloo
// over its buffers) or on the host, the ranks' gradients give the same bits
// (both sum fp32 in rank order, the device's packing converts exactly as the
// host's pass does); on the device only the rank's fp32 shard of each
// group's sum comes down, on the host each group's trainable part whole in
// the compute dtype. Ranks that would sum in different places fail create,
// each naming the other.
TEST_F(RanksTest, GradientsSummedOnTheDeviceOrTheHostGiveTheSameBitsTheDeviceSendingTheShardDown) {
  Outcome got[2];
  for (const DeviceCollectives mode : {DeviceCollectives::kOn, DeviceCollectives::kOff}) {
    Config c = config("cpu", OverlapMode::kExact);
    c.strata.device_collectives = mode;
    const bool device = mode == DeviceCollectives::kOn;
    got[device ? 0 : 1] = on_ranks(c, 2, core::str_cat("where", device), [&](int r, Engine& e) {
      EXPECT_EQ(e.layout().share.device_collectives, device);
      std::uint64_t expected = 0;
      for (const GroupPlace& gp : e.layout().groups) {
        expected += device ? static_cast<std::uint64_t>(gp.shard_elems) * 4
                           : static_cast<std::uint64_t>(gp.gradient_elems() * e.layout().compute_bytes);
      }
      train_steps(e, r, 2, [&](int s, const StepStats& st) {
        if (s > 0) {
          EXPECT_EQ(st.bytes.d2h, expected) << "step " << s << ", rank " << r;
        }
      });
    });
  }
  expect_same(got[0].master, got[1].master, "masters");
  expect_same(got[0].exp_avg, got[1].exp_avg, "exp_avg");
  expect_same(got[0].exp_avg_sq, got[1].exp_avg_sq, "exp_avg_sq");
  // One rank on the host, the other on its device: neither meets the other
  // over a library the other does not take.
  // So do ranks at stage 3 whose schedules make other communicators (a
  // threaded one's prefetches'), before either waits to meet over one.
  struct Differs {
    std::function<Config(int)> config;
    const char* run;
    const char* key;
  };
  const Differs cases[] = {
      {[&](int r) {
         Config c = config("cpu", OverlapMode::kExact);
         c.strata.device_collectives = r == 0 ? DeviceCollectives::kOff : DeviceCollectives::kAuto;
         return c;
       },
       "where-differs", "strata.device_collectives"},
      {[&](int r) { return stage3(config("cpu", r == 0 ? OverlapMode::kNone : OverlapMode::kExact), "cpu"); },
       "stage3-differs", "every rank must share zero_optimization.stage and strata.overlap"},
  };
  for (const Differs& k : cases) {
    std::vector<core::Status> made(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        made[static_cast<std::size_t>(r)] = Engine::create(k.config(r), ranks(r, 2, k.run)).status();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      const core::Status& s = made[static_cast<std::size_t>(r)];
      EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition) << s;
      EXPECT_NE(s.message().find(core::str_cat("rank ", 1 - r, " ")), std::string::npos) << s;
      EXPECT_NE(s.message().find(k.key), std::string::npos) << s;
    }
  }
}

// communication_data_type "bf16": the gradients summed on the device in
// bf16 (each micro-batch's sum rounded to bf16 once: rank order on the host
// device's Gloo), half the bytes down; reruns bit-identical, the norms
// within bf16's rounding of fp32 sums'.
TEST_F(RanksTest, CommunicationDataTypeBf16SumsInBf16HalfTheBytesDown) {
  std::vector<std::vector<double>> norms;
  std::vector<Outcome> got;
  for (const auto& [type, run] : {std::pair{Precision::kFp32, "fp32"}, std::pair{Precision::kBf16, "bf16-a"},
                                  std::pair{Precision::kBf16, "bf16-b"}}) {
    Config c = config("cpu", OverlapMode::kExact);
    c.communication_data_type = type;
    std::vector<double> seen;
    got.push_back(on_ranks(c, 2, core::str_cat("comm-", run), [&, type](int r, Engine& e) {
      std::uint64_t down = 0;
      for (const GroupPlace& gp : e.layout().groups) {
        down += static_cast<std::uint64_t>(gp.shard_elems) * (type == Precision::kFp32 ? 4 : 2);
      }
      train_steps(e, r, 2, [&](int s, const StepStats& st) {
        if (s > 0) {
          EXPECT_EQ(st.bytes.d2h, down) << "step " << s;
        }
        if (r == 0) seen.push_back(st.grad_norm);
      });
    }));
    norms.push_back(seen);
  }
  ASSERT_EQ(norms[0].size(), static_cast<std::size_t>(kRankSteps));
  EXPECT_EQ(norms[1], norms[2]);  // reruns alike
  expect_same(got[1].master, got[2].master, "masters of two bf16 runs");
  bool differs = false;
  for (std::size_t s = 0; s < norms[0].size(); ++s) {
    EXPECT_NEAR(norms[1][s], norms[0][s], 1e-2 * norms[0][s]) << "step " << s;
    differs = differs || norms[1][s] != norms[0][s];
  }
  EXPECT_TRUE(differs);  // the sums were rounded to bf16
}

// Stage 3 with the collectives on the device: a fetch brings up the rank's
// own home alone and gathers the ranks' there (the host device's Gloo over
// its memory), then unpacks it into the fetched buffer; on the host ("off")
// it gathers in pinned memory and brings the group up whole. The same bits
// either way. Under "none" no copy is kept: every fetch gathers, four a
// micro-batch (each group in the forward and in the backward).
TEST_F(RanksTest, Stage3FetchesGatherOnTheDeviceBringingUpTheRanksOwnHomeAlone) {
  Outcome got[2];
  for (const DeviceCollectives mode : {DeviceCollectives::kOn, DeviceCollectives::kOff}) {
    Config c = stage3(config("cpu", OverlapMode::kNone), "cpu");
    c.strata.device_collectives = mode;
    const bool device = mode == DeviceCollectives::kOn;
    got[device ? 0 : 1] = on_ranks(c, 2, core::str_cat("gather", device), [&](int r, Engine& e) {
      const Layout& l = e.layout();
      ASSERT_TRUE(l.compute_sharded);
      std::uint64_t up = 0;
      for (const GroupPlace& gp : l.groups) {
        up += 2 * (device ? l.home_bytes(gp) : static_cast<std::uint64_t>(gp.compute_elems * l.compute_bytes));
      }
      train_steps(e, r, 2, [&](int s, const StepStats& st) {
        if (s > 0) {
          EXPECT_EQ(st.bytes.h2d, up) << "step " << s << ", rank " << r;
        }
      });
    });
  }
  expect_same(got[0].master, got[1].master, "masters");
  expect_same(got[0].exp_avg_sq, got[1].exp_avg_sq, "exp_avg_sq");
  ASSERT_EQ(got[0].compute.size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) expect_same(got[0].compute[r], got[1].compute[r], "compute copies");
}

// Stage 3 under a threaded schedule prefetches: the groups the learned
// fetch sequence names next are gathered on a thread of their own (their
// own communicators, in an order every rank shares), and a fetch takes the
// gathered copy without a collective of its own. Bits as one rank
// accumulating the ranks' micro-batches, under "exact" and "delayed", the
// gathers on the device or the host.
TEST_F(RanksTest, Stage3PrefetchesGatherTheNextGroupsOnTheirOwnThread) {
  struct Case {
    std::string home;
    OverlapMode overlap;
    DeviceCollectives collectives;
  };
  for (const Case& k : {Case{"nvme", OverlapMode::kExact, DeviceCollectives::kAuto},
                       Case{"cpu", OverlapMode::kExact, DeviceCollectives::kOff},
                       Case{"nvme", OverlapMode::kDelayed, DeviceCollectives::kAuto}}) {
    const std::string home = k.home + "-" + std::string(to_string(k.overlap)) + "-" +
                             std::string(to_string(k.collectives));
    Config c = stage3(config("cpu", k.overlap), k.home);
    c.strata.device_collectives = k.collectives;
    const Outcome one = accumulate(c, 2);
    std::vector<std::int64_t> prefetched(2, 0);
    const Outcome many = on_ranks(c, 2, "prefetch-" + home, [&](int r, Engine& e) {
      train_steps(e, r, 2, [&](int, const StepStats& st) { prefetched[static_cast<std::size_t>(r)] += st.prefetched; });
    });
    EXPECT_GT(prefetched[0], 0) << home;
    EXPECT_EQ(prefetched[0], prefetched[1]) << home;  // every rank takes the same gathered copies
    SCOPED_TRACE(home);
    expect_same_outcome(many, one, 2);
  }
}

// strata.no_grad "skip" with ranks: a parameter is skipped only when no rank
// gave it a gradient. l1.w and l1.b get none on any rank: left as they were
// (l1.w's weight decay would show an update); l2.w gets none on rank 0
// only: updated with rank 1's gradient. Two ranks give the bits of one rank
// accumulating their two micro-batches with the same parameters absent, and
// the checkpoint counts the skipped steps of l1.b, which only the last rank
// holds (the manifest takes every rank's count).
TEST_F(RanksTest, AParameterIsSkippedOnlyWhenNoRankGaveItAGradient) {
  constexpr int kN = 2;
  const auto absent_in = [](int micro) {
    std::vector<std::string> names = {"l1.w", "l1.b"};
    if (micro == 0) names.push_back("l2.w");
    return names;
  };
  for (const std::string placement : {"cpu", "nvme"}) {
    SCOPED_TRACE(placement);
    Config ranks_config = config(placement, OverlapMode::kExact);
    ranks_config.train_batch_size = kBatch;
    Config one = ranks_config;
    one.gradient_accumulation_steps = kN;
    one.train_batch_size = kBatch * kN;
    const Outcome single = on_ranks(one, 1, "single-" + placement, [&](int, Engine& e) {
      Framework f;
      for (int s = 0; s < kRankSteps; ++s) {
        for (int m = 0; m < kN; ++m) {
          if (m > 0) {
            ASSERT_TRUE(e.micro_step_end().ok());
          }
          ASSERT_TRUE(micro_batch(e, f, s * kN + m, m + 1 == kN, nullptr, absent_in(m)).ok());
        }
      }
    });
    const std::string root = (dir_ / ("ckpt-" + placement)).string();
    const Outcome ranked = on_ranks(ranks_config, kN, "ranks-" + placement, [&](int r, Engine& e) {
      Framework f;
      for (int s = 0; s < kRankSteps; ++s) {
        ASSERT_TRUE(micro_batch(e, f, s * kN + r, true, nullptr, absent_in(r)).ok());
      }
      const core::Status saved = e.save_checkpoint(root, {});
      ASSERT_TRUE(saved.ok()) << saved;
    });
    expect_same(ranked.master, single.master, "masters");
    expect_same(ranked.exp_avg, single.exp_avg, "exp_avg");
    expect_same(ranked.exp_avg_sq, single.exp_avg_sq, "exp_avg_sq");
    for (const Tensor& t : kTensors) {
      std::vector<float> init(ranked.master.at(t.name).size());
      init_values(t, init);
      EXPECT_EQ(bits_equal(ranked.master.at(t.name), init), t.group == "l1") << t.name;
    }
    auto found = locate_checkpoint(root);
    ASSERT_TRUE(found.ok()) << found.status();
    for (const CheckpointParam& p : found->manifest.params) {
      EXPECT_EQ(p.missed_steps, p.group == "l1" ? kRankSteps : 0) << p.name;
    }
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
  for (int r = 0; r < 3; ++r) {  // the engines are gone, and so are their swap folders
    EXPECT_FALSE(std::filesystem::exists(dir_ / ("rank-" + std::to_string(r)))) << "rank " << r;
  }
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

TEST_F(RanksTest, ReadWeightsGathersTheMastersOnEveryRank) {
  // After two steps on three ranks every rank's read_weights gives every
  // master whole, bit for bit the elements their owners hold; a call whose
  // list differs on one rank, or names what is not there, fails on every
  // rank naming that rank (none waits for the others).
  const Config c = config("nvme", OverlapMode::kDelayed);
  std::vector<std::map<std::string, std::vector<float>>> gathered(3);
  std::vector<core::Status> reordered(3), missing(3);
  const Outcome held = on_ranks(c, 3, "weights", [&](int r, Engine& e) {
    Framework f;
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(micro_batch(e, f, s * 3 + r, true, nullptr).ok());
    std::map<std::string, std::vector<float>>& mine = gathered[static_cast<std::size_t>(r)];
    std::vector<Engine::WeightRead> reads;
    for (const Tensor& t : kTensors) {
      std::vector<float>& v = mine[t.name];
      v.assign(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]), -1.0f);
      reads.push_back({t.name, v});
    }
    const core::Status s = e.read_weights(reads);
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
    std::vector<Engine::WeightRead> other = reads;
    if (r == 1) std::reverse(other.begin(), other.end());
    reordered[static_cast<std::size_t>(r)] = e.read_weights(other);
    std::vector<float> none(4);
    std::vector<Engine::WeightRead> absent = reads;
    if (r == 2) absent.back() = {"no.such", none};
    missing[static_cast<std::size_t>(r)] = e.read_weights(absent);
  });
  for (int r = 0; r < 3; ++r) {
    for (const auto& [name, v] : held.master) {
      const std::vector<float>& got = gathered[static_cast<std::size_t>(r)][name];
      ASSERT_EQ(got.size(), v.size()) << name;
      EXPECT_EQ(std::memcmp(got.data(), v.data(), v.size() * sizeof(float)), 0) << "rank " << r << ": " << name;
    }
    const core::Status& o = reordered[static_cast<std::size_t>(r)];
    EXPECT_EQ(o.code(), core::StatusCode::kInvalidArgument) << "rank " << r << ": " << o;
    EXPECT_NE(o.message().find("rank 1 asked for other parameters"), std::string::npos) << o;
    const core::Status& m = missing[static_cast<std::size_t>(r)];
    EXPECT_EQ(m.code(), core::StatusCode::kNotFound) << "rank " << r << ": " << m;
    EXPECT_NE(m.message().find(r == 2 ? "no parameter named 'no.such'" : "rank 2"), std::string::npos) << m;
  }
}

TEST_F(RanksTest, WhatCannotRunIsRefusedBeforeMeetingAnyone) {
  // A rank outside [0, size), and NCCL, which the step does not use yet.
  auto bad = Engine::create(config("cpu", OverlapMode::kExact), ranks(2, 2, "refused"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), core::StatusCode::kInvalidArgument);
  partition::CommunicatorOptions nccl = ranks(0, 2, "refused");
  nccl.backend = "nccl";
  auto device = Engine::create(config("cpu", OverlapMode::kExact), nccl);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), core::StatusCode::kUnimplemented);
  EXPECT_NE(device.status().message().find("\"gloo\""), std::string::npos) << device.status();
}

TEST_F(RanksTest, AnInitCallbackFailingOnOneRankFailsEveryRanksFinalize) {
  // Rank 1's init callback for l2.w fails; rank 0's finalize does not wait
  // for it to the timeout: it fails at once, naming rank 1.
  const Config c = config("cpu", OverlapMode::kExact);
  std::vector<core::Status> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      partition::CommunicatorOptions o = ranks(r, 2, "init");
      o.timeout = std::chrono::seconds(30);
      auto created = Engine::create(c, o);
      ASSERT_TRUE(created.ok()) << created.status();
      std::unique_ptr<Engine> e = std::move(created).value();
      for (const Tensor& t : kTensors) {
        ParamDesc d{t.name, t.shape, t.group, true, 0};
        ASSERT_TRUE(e->register_param(d, [t, r](std::span<float> out) {
                       if (r == 1 && t.name == "l2.w") return core::Status::invalid_argument("no weights for l2.w");
                       init_values(t, out);
                       return core::Status();
                     }).ok());
      }
      got[static_cast<std::size_t>(r)] = e->finalize();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_NE(got[1].message().find("no weights for l2.w"), std::string::npos) << got[1];
  EXPECT_EQ(got[0].code(), core::StatusCode::kInvalidArgument) << got[0];
  EXPECT_NE(got[0].message().find("rank 1 failed preparing its state or writing its initial values"),
            std::string::npos)
      << got[0];
}

TEST_F(RanksTest, CallsThatGatherAreRefusedWhileACertainStepAppliesAndTheStepGoesOn) {
  // A certain step (no clipping, nonfinite "apply") under "exact": the
  // optimizer updates and gathers each group during the backward, over the
  // communicator read_weights, checkpoints and export use; between the last
  // grads_ready and step_end they are refused on every rank before any
  // collective, and the step goes on on every rank.
  Config c = config("cpu", OverlapMode::kExact);
  c.gradient_clipping = 0.0;
  c.strata.nonfinite = NonfinitePolicy::kApply;
  std::vector<core::Status> refused(2), saved(2), stepped(2), after(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      partition::CommunicatorOptions o = ranks(r, 2, "mid-step");
      o.timeout = std::chrono::seconds(30);
      std::unique_ptr<Engine> e = make_mlp_engine(c, o);
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int s = 0; s < 2; ++s) {
        forward_backward(*e, f, 2 * s + r);
        if (s == 1) {
          std::vector<float> w(static_cast<std::size_t>(kTensors[0].shape[0] * kTensors[0].shape[1]));
          const std::vector<Engine::WeightRead> reads{{kTensors[0].name, w}};
          refused[static_cast<std::size_t>(r)] = e->read_weights(reads);
          saved[static_cast<std::size_t>(r)] = e->save_checkpoint((dir_ / "mid-step").string(), {});
        }
        stepped[static_cast<std::size_t>(r)] = e->step_end().status();
      }
      std::vector<float> w(static_cast<std::size_t>(kTensors[0].shape[0] * kTensors[0].shape[1]));
      const std::vector<Engine::WeightRead> reads{{kTensors[0].name, w}};
      after[static_cast<std::size_t>(r)] = e->read_weights(reads);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    const auto k = static_cast<std::size_t>(r);
    EXPECT_EQ(refused[k].code(), core::StatusCode::kFailedPrecondition) << "rank " << r << ": " << refused[k];
    EXPECT_NE(refused[k].message().find("during the backward"), std::string::npos) << refused[k];
    EXPECT_EQ(saved[k].code(), core::StatusCode::kFailedPrecondition) << "rank " << r << ": " << saved[k];
    EXPECT_TRUE(stepped[k].ok()) << "rank " << r << ": " << stepped[k];
    EXPECT_TRUE(after[k].ok()) << "rank " << r << ": " << after[k];
  }
}

TEST_F(RanksTest, AFinalizeFailingBeforeTheInitialValuesFailsEveryRanksAtOnce) {
  // Rank 1's pinned budget cannot hold its shard of the optimizer state:
  // its finalize fails before any initial value, and rank 0's fails at once
  // with it, naming rank 1, instead of waiting for it to the timeout.
  std::vector<core::Status> got(2);
  std::vector<double> seconds(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Config c = config("cpu", OverlapMode::kExact);
      if (r == 1) c.strata.budgets.pinned_bytes = 4096;
      partition::CommunicatorOptions o = ranks(r, 2, "prepare");
      o.timeout = std::chrono::seconds(60);
      auto created = Engine::create(c, o);
      ASSERT_TRUE(created.ok()) << created.status();
      std::unique_ptr<Engine> e = std::move(created).value();
      for (const Tensor& t : kTensors) {
        ParamDesc d{t.name, t.shape, t.group, true, 0};
        ASSERT_TRUE(e->register_param(d, [t](std::span<float> out) {
                       init_values(t, out);
                       return core::Status();
                     }).ok());
      }
      const auto start = std::chrono::steady_clock::now();
      got[static_cast<std::size_t>(r)] = e->finalize();
      seconds[static_cast<std::size_t>(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(got[1].code(), core::StatusCode::kResourceExhausted) << got[1];
  EXPECT_NE(got[0].message().find("rank 1 failed preparing its state or writing its initial values"),
            std::string::npos)
      << got[0];
  EXPECT_EQ(got[0].code(), core::StatusCode::kResourceExhausted) << got[0];
  EXPECT_LT(seconds[0], 30.0) << "rank 0 waited for the timeout";
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
      const auto& g = f.backward(1.0f);
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
