// The data-parallel harness of the e2e suites (ranks_test.cpp,
// ranks_checkpoint_test.cpp): N ranks as threads of this process, each an
// Engine on the host device meeting the others over Gloo (a file store in
// the test's folder), training the MLP of mlp_harness.h on one micro-batch
// each per step, and what they hold together read back.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/mlp_harness.h"

namespace strata::engine::e2e {

// Steps per run: enough for clipping to fire and the moments to matter
// (every comparison is bit for bit, or within rounding), few enough that the
// suite stays short under the sanitizers (every case trains 2 to 4 engines).
inline constexpr int kRankSteps = 8;

// What a run leaves to compare: the fp32 masters and moments (each element
// from the rank that owns it), each rank's compute copies, and the norms.
struct Outcome {
  std::map<std::string, std::vector<float>> master, exp_avg, exp_avg_sq;
  std::vector<std::map<std::string, std::vector<float>>> compute;  // per rank
  std::vector<double> norms;  // per step (rank 0's)
  std::vector<double> losses;  // per step, rank 0's micro-batch
};

// (Of the trainable tensors: a frozen one has no optimizer state.)
inline std::map<std::string, std::vector<float>> read_array(Engine& e, int which) {
  std::map<std::string, std::vector<float>> out;
  for (const Tensor& t : kTensors) {
    const std::size_t pi = static_cast<std::size_t>(
        std::find_if(e.layout().params.begin(), e.layout().params.end(), [&](const ParamDesc& p) { return p.name == t.name; }) -
        e.layout().params.begin());
    if (pi < e.layout().params.size() && !e.layout().params[pi].trainable) continue;
    std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
    const core::Status s = e.read_state(t.name, which, v);
    EXPECT_TRUE(s.ok()) << s;
    out[t.name] = std::move(v);
  }
  return out;
}

inline std::map<std::string, std::vector<float>> read_computes(Engine& e) {
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
inline void merge_owned(std::map<std::string, std::vector<float>>& into, const std::map<std::string, std::vector<float>>& part) {
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

  // Stage 3 with the compute copies' home on `params` ("device": none
  // offloaded, "cpu", "nvme"): with several ranks each keeps its shard.
  static Config stage3(Config c, const std::string& params) {
    c.zero.stage = 3;
    c.zero.offload_param.device = params == "cpu"    ? OffloadDevice::kCpu
                                  : params == "nvme" ? OffloadDevice::kNvme
                                                     : OffloadDevice::kNone;
    return c;
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
        read_outcome(*e, o);
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

  // Runs body(rank, engine) on n ranks as threads, each with its own engine
  // (n == 1: one engine without ranks), then reads back what they hold
  // together: masters and moments from the rank that owns each element,
  // and each rank's compute copies.
  // `per_rank` (optional) changes rank r's config: settings that may differ
  // between the ranks (a device budget, stage3_max_live_parameters).
  Outcome on_ranks(const Config& c, int n, const std::string& run, const std::function<void(int, Engine&)>& body,
                   const std::vector<std::string>& frozen = {}, const std::string& weights_dir = "",
                   const std::function<void(int, Config&)>& per_rank = nullptr) {
    std::vector<Outcome> per(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Config rc = c;
        if (per_rank) per_rank(r, rc);
        std::unique_ptr<Engine> e =
            n == 1 ? make_mlp_engine(rc, {}, frozen, weights_dir)
                   : make_mlp_engine(rc, ranks(r, n, run), frozen, weights_dir);
        if (e == nullptr) return;
        body(r, *e);
        read_outcome(*e, per[static_cast<std::size_t>(r)]);
      });
    }
    for (std::thread& t : threads) t.join();
    return merge_outcomes(per);
  }

  // What one rank's engine holds: its masters and moments, its compute copies.
  static void read_outcome(Engine& e, Outcome& o) {
    o.master = read_array(e, 0);
    o.exp_avg = read_array(e, 1);
    o.exp_avg_sq = read_array(e, 2);
    o.compute.push_back(read_computes(e));
  }
  // The ranks' outcomes together: each element from the rank that owns it,
  // each rank's compute copies.
  static Outcome merge_outcomes(std::vector<Outcome>& per) {
    Outcome out;
    for (Outcome& o : per) {
      merge_owned(out.master, o.master);
      merge_owned(out.exp_avg, o.exp_avg);
      merge_owned(out.exp_avg_sq, o.exp_avg_sq);
      if (!o.compute.empty()) out.compute.push_back(o.compute.front());
    }
    return out;
  }

  // Rank r of n trains kRankSteps steps of one micro-batch each (batch
  // s * n + r: one rank accumulating them takes them in that order), handing
  // each step's statistics to `seen(step, stats)`.
  static void train_steps(Engine& e, int r, int n, const std::function<void(int, const StepStats&)>& seen) {
    Framework f;
    for (int s = 0; s < kRankSteps; ++s) {
      const auto st = micro_batch(e, f, s * n + r, true, nullptr);
      ASSERT_TRUE(st.ok()) << st.status();
      seen(s, *st);
    }
  }

  // One micro-batch on batch `batch`: forward, backward, gradients (those
  // of `absent`'s parameters zeroed and said so: Framework::drop_grads), and
  // step_end when `last` (else the caller's micro_step_end follows).
  static core::Result<StepStats> micro_batch(Engine& e, Framework& f, int batch, bool last,
                                             std::vector<double>* losses,
                                             const std::vector<std::string>& absent = {}) {
    f.bind(e);
    f.batch(batch * 16);
    f.load(e, "l1");
    f.load(e, "l2");
    const double loss = f.forward();
    if (losses != nullptr) losses->push_back(loss);
    auto& g = f.backward(static_cast<float>(e.loss_scale()));
    for (const std::string group : {"l2", "l1"}) {
      f.load(e, group);
      f.drop_grads(e, group, g, absent);
      f.give_grads(e, group, g);
    }
    if (!last) return StepStats{};
    auto st = e.step_end();
    EXPECT_TRUE(st.ok()) << st.status();
    return st;
  }
};

inline void expect_same(const std::map<std::string, std::vector<float>>& a,
                 const std::map<std::string, std::vector<float>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, values] : a) {
    const auto it = b.find(name);
    ASSERT_NE(it, b.end()) << what << ": " << name;
    EXPECT_TRUE(bits_equal(values, it->second)) << what << " of " << name << " differ";
  }
}

// `many` (ranks, each with its compute copies) holds the state `one` (a rank
// accumulating) holds, bit for bit: masters, moments, every rank's copies.
inline void expect_same_outcome(const Outcome& many, const Outcome& one, int ranks) {
  expect_same(many.master, one.master, "masters");
  expect_same(many.exp_avg, one.exp_avg, "exp_avg");
  expect_same(many.exp_avg_sq, one.exp_avg_sq, "exp_avg_sq");
  ASSERT_EQ(many.compute.size(), static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    expect_same(many.compute[static_cast<std::size_t>(r)], one.compute[0], "compute copies of rank " + std::to_string(r));
  }
}

}  // namespace strata::engine::e2e
