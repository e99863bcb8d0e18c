// End to end through the C++ engine on the host device (on CUDA with
// STRATA_TEST_DEVICE=cuda, tests/e2e/mlp_harness.h): a small two-layer
// MLP (teacher-student regression, computed by this test as a CPU framework
// would) trains 20 steps under every placement. Final weights, compute copies
// and losses are bit-identical across placements; each placement's traffic
// matches the memory model; the loss halves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "core/str.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/schedule/schedule.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> master, compute, exp_avg, exp_avg_sq;
  std::vector<StepStats> stats;
  // Each step's traffic as if nothing stayed resident: StepStats::bytes plus
  // the compute copies that fetches served by a resident copy did not move
  // (over the link, and from nvme when they live there).
  std::vector<StepBytes> traffic;
  StepBytes expected_bytes;  // one step's traffic by the memory model
  core::Status error;        // of the step that was expected to fail
};

// Every array of `got` bit for bit as in `want` (masters, compute copies,
// both moments); a failure names the array and the parameter.
void expect_same_state(const RunResult& got, const RunResult& want) {
  using Arrays = std::map<std::string, std::vector<float>> RunResult::*;
  const std::pair<const char*, Arrays> arrays[] = {{"master", &RunResult::master},
                                                   {"compute", &RunResult::compute},
                                                   {"exp_avg", &RunResult::exp_avg},
                                                   {"exp_avg_sq", &RunResult::exp_avg_sq}};
  for (const auto& [label, array] : arrays) {
    for (const auto& [name, v] : want.*array) {
      const auto it = (got.*array).find(name);
      EXPECT_TRUE(it != (got.*array).end() && bits_equal(it->second, v)) << label << " " << name;
    }
  }
}

// One step's traffic, from the layout (every group fetched twice per micro-batch,
// gradients for every trainable group): compute copies cross the link on each
// fetch unless they live on the device, gradients come down once (2 B) for
// the group's trainable part (its frozen parameters, first in its buffer,
// have none), the optimizer commits the trainable part of each group's
// compute copies to their home (reading the old ones first only under
// "delayed", whose pending copy is whole, when a frozen parameter's are among
// them), nvme chunks are read and written once (the optimizer's state: AdamW
// 12 B per element, 8 with bf16 moments), device chunks take their
// gradients up and send new compute copies down.
StepBytes memory_model(const Layout& l, std::uint64_t micro_batches, bool delayed = false) {
  StepBytes b;
  const std::uint64_t cb = static_cast<std::uint64_t>(l.compute_bytes),
                      gb = static_cast<std::uint64_t>(l.grad_bytes);
  for (const GroupPlace& g : l.groups) {
    const std::uint64_t compute = static_cast<std::uint64_t>(g.compute_elems) * cb;
    const bool trainable = g.trainable_elems > 0;
    const std::uint64_t fetches = (trainable ? 2 : 1) * micro_batches;
    if (g.compute_tier != Tier::kDevice) b.h2d += fetches * compute;
    if (g.compute_tier == Tier::kNvme) b.nvme_read += fetches * compute;
    if (!trainable) continue;
    const std::uint64_t rewritten = compute - static_cast<std::uint64_t>(g.trainable_compute_begin) * cb;
    b.d2h += micro_batches * rewritten;  // gradients, laid out like the compute copies
    const bool reads_old = delayed && rewritten < compute;
    if (g.compute_tier == Tier::kDevice) {
      b.d2h += reads_old ? compute : 0;
      b.h2d += rewritten;
    } else if (g.compute_tier == Tier::kNvme) {
      b.nvme_read += reads_old ? compute : 0;
      b.nvme_write += rewritten;
    }
  }
  for (const ChunkPlace& c : l.chunks) {
    const std::uint64_t n = static_cast<std::uint64_t>(c.elems);
    if (c.state_tier == Tier::kNvme) {
      b.nvme_read += l.optimizer.state_bytes(c.elems);
      b.nvme_write += l.optimizer.state_bytes(c.elems);
    } else if (c.state_tier == Tier::kDevice) {
      b.h2d += gb * n;
      b.d2h += cb * n;
    }
  }
  return b;
}

class Placement : public MlpTest {
 protected:
  // train(): the backward holds a group's compute copies while it hands over
  // the group's gradients (else it copies them out and releases first).
  bool hold_in_backward_ = false;
  // train(): parameters frozen one by one (beside freeze_l1's whole group).
  std::set<std::string> frozen_;
  // Trainable parameters that get no gradient in any step: their gradients
  // zeroed and said so (Engine::no_grads) in every micro-batch.
  std::set<std::string> absent_;
  // train(): when set, the frozen parameters take their values from the
  // safetensors files here (init_from_safetensors), the others from init_values.
  std::string weights_dir_;

  // The budget tests below: a budget too small is refused at finalize with the
  // smallest that works ("KEY >= N"); that budget trains, to the same bits as
  // an unlimited one, and one byte less is refused again, naming the same N.
  // `set` puts a budget into the config; `tiny` is far too small.
  void expect_least_budget_trains(Config c, const std::string& key,
                                  const std::function<void(Config&, std::uint64_t)>& set, std::uint64_t tiny,
                                  int steps = kSteps) {
    SCOPED_TRACE(core::str_cat(key, ", overlap ", static_cast<int>(c.strata.overlap)));
    const RunResult unlimited = train(c, false, nullptr, -1, steps);
    set(c, tiny);
    core::Status s = finalize_status(c);
    ASSERT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
    const std::string message(s.message());
    const std::string says = key + " >= ";
    const std::size_t at = message.find(says);
    ASSERT_NE(at, std::string::npos) << s;
    const std::uint64_t least = std::stoull(message.substr(at + says.size()));
    ASSERT_GT(least, tiny);
    set(c, least);
    const RunResult r = train(c, false, nullptr, -1, steps);
    ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(steps));
    expect_same_state(r, unlimited);
    set(c, least - 1);
    s = finalize_status(c);
    EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(core::str_cat(says, least)), std::string::npos) << s;
  }

  // l1.w's initial values as bf16 in `dir`/model.safetensors (a pretrained
  // base to read from its file).
  void write_base(const std::string& dir) {
    const Tensor& w = kTensors[0];
    ASSERT_EQ(w.name, "l1.w");
    std::filesystem::create_directories(dir);
    std::vector<float> v(static_cast<std::size_t>(w.shape[0] * w.shape[1]));
    init_values(w, v);
    auto writer = SafetensorsWriter::create(dir + "/model.safetensors", {{w.name, TensorDtype::kBf16, w.shape}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(writer->write_f32(w.name, v).ok());
    ASSERT_TRUE(writer->finish().ok());
  }

  // An engine of the MLP with its parameters registered (frozen_'s frozen,
  // the others' initial values from init_values; `group_of` may move a
  // parameter to another group), not finalized; null after a failure.
  std::unique_ptr<Engine> registered(const Config& c,
                                     const std::map<std::string, std::string>& group_of = {}) {
    auto created = Engine::create(c);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return nullptr;
    for (const Tensor& t : kTensors) {
      const auto moved = group_of.find(t.name);
      const bool trainable = frozen_.count(t.name) == 0;
      InitFn init = [t](std::span<float> out) {
        init_values(t, out);
        return core::Status();
      };
      if (!weights_dir_.empty() && !trainable) init = nullptr;  // from the files
      const core::Status s = (*created)->register_param(
          {t.name, t.shape, moved == group_of.end() ? t.group : moved->second, trainable, 0}, init);
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) return nullptr;
    }
    if (!weights_dir_.empty()) {
      const core::Status s = (*created)->init_from_safetensors(weights_dir_, "");
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) return nullptr;
    }
    return std::move(created).value();
  }

  // `tamper(step, grads)` may change the gradients a step hands over.
  using Tamper = std::function<void(int step, std::map<std::string, std::vector<float>>& grads)>;
  // With `error_at` >= 0, step_end of that step must fail (and training stops there).
  RunResult train(const Config& c, bool freeze_l1 = false, const Tamper& tamper = nullptr, int error_at = -1,
                  int steps = kSteps) {
    RunResult r;
    auto created = Engine::create(c);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return r;
    Engine& e = **created;
    auto no_decay = e.add_optimizer_group({"no_decay", 0.0, 1.0});
    EXPECT_TRUE(no_decay.ok());
    for (const Tensor& t : kTensors) {
      ParamDesc d{t.name, t.shape, t.group, !(freeze_l1 && t.group == "l1") && frozen_.count(t.name) == 0,
                  t.name.back() == 'b' ? *no_decay : 0};
      InitFn init = [t](std::span<float> out) {
        init_values(t, out);
        return core::Status();
      };
      if (!weights_dir_.empty() && !d.trainable) init = nullptr;  // from the files
      EXPECT_TRUE(e.register_param(d, init).ok());
    }
    if (!weights_dir_.empty()) {
      EXPECT_TRUE(e.init_from_safetensors(weights_dir_, "").ok());
    }
    const core::Status fin = e.finalize();
    EXPECT_TRUE(fin.ok()) << fin;
    if (!fin.ok()) return r;
    Framework f;
    f.cb = e.layout().compute_bytes;
    f.precision = c.precision;
    for (int step = 0; step < steps; ++step) {
      for (int micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
        f.batch(step * 16 + micro);
        f.load(e, "l1");
        f.load(e, "l2");
        const double loss = f.forward();
        if (micro == 0) r.losses.push_back(loss);
        auto& g = f.backward(static_cast<float>(e.loss_scale()));
        if (tamper) tamper(step, g);
        // Fetched again for backward, as a framework does; with
        // hold_in_backward_ each group's compute copies stay held while its
        // gradients are handed over.
        for (const char* group : {"l2", "l1"}) {
          if (freeze_l1 && std::string(group) == "l1") continue;
          f.load(e, group, hold_in_backward_);
          const std::vector<std::string_view> absent = f.drop_grads(e, group, g, absent_);
          f.give_grads(e, group, g);
          if (!absent.empty()) {
            // Said after the group's gradients arrived: refused, naming why (it would count for no micro-batch).
            const core::Status late = e.no_grads(group, absent);
            EXPECT_EQ(late.code(), core::StatusCode::kFailedPrecondition) << late;
            EXPECT_NE(late.message().find("have arrived already"), std::string::npos) << late;
          }
          if (hold_in_backward_) {
            EXPECT_TRUE(e.release(group).ok());
          }
        }
        if (micro + 1 < c.gradient_accumulation_steps) {
          EXPECT_TRUE(e.micro_step_end().ok());
        }
      }
      auto st = e.step_end();
      if (step == error_at) {
        EXPECT_FALSE(st.ok());
        r.error = st.status();
        return r;
      }
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) return r;
      r.stats.push_back(*st);
      StepBytes t = st->bytes;
      t.h2d += st->resident_bytes;
      t.nvme_read += st->resident_nvme_bytes;
      t.nvme_paths.clear();  // the memory model counts tiers; swap_traffic_test.cpp checks the paths
      r.traffic.push_back(t);
    }
    r.expected_bytes = memory_model(e.layout(), static_cast<std::uint64_t>(c.gradient_accumulation_steps),
                                    c.strata.overlap == OverlapMode::kDelayed);
    for (const Tensor& t : kTensors) {
      std::vector<float> v(
          static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
      if (!(freeze_l1 && t.group == "l1") && frozen_.count(t.name) == 0) {
        {
          auto rs = e.read_master(t.name, v);
          EXPECT_TRUE(rs.ok()) << rs;
        }
        r.master[t.name] = v;
        EXPECT_TRUE(e.read_state(t.name, 1, v).ok());
        r.exp_avg[t.name] = v;
        EXPECT_TRUE(e.read_state(t.name, 2, v).ok());
        r.exp_avg_sq[t.name] = v;
      }
      EXPECT_TRUE(e.read_compute(t.name, v).ok());
      r.compute[t.name] = v;
    }
    return r;
  }

  // The delayed update emulated: the sequential schedule `seq`, with a
  // framework that computes each step's gradients at the weights it had one
  // step before (the initial ones for the first two steps).
  RunResult train_stale(const Config& seq, const Tamper& tamper = nullptr) {
    RunResult stale;
    std::unique_ptr<Engine> e = make_mlp_engine(seq);
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return stale;
    Framework f;
    f.bind(*e);
    std::vector<std::map<std::string, std::vector<float>>> seen;
    for (int step = 0; step < kSteps; ++step) {
      f.batch(step * 16);
      f.load(*e, "l1");
      f.load(*e, "l2");
      seen.push_back(f.w);
      f.w = seen[static_cast<std::size_t>(std::max(0, step - 1))];
      stale.losses.push_back(f.forward());
      auto& g = f.backward(1.0f);
      if (tamper) tamper(step, g);
      f.load(*e, "l2");
      f.give_grads(*e, "l2", g);
      f.load(*e, "l1");
      f.give_grads(*e, "l1", g);
      auto st = e->step_end();
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) return stale;
      stale.stats.push_back(*st);
    }
    stale.master = read_masters(*e);
    return stale;
  }

  // finalize's status for the MLP's parameters under `c`.
  core::Status finalize_status(const Config& c) {
    auto e = Engine::create(c);
    if (!e.ok()) return e.status();
    for (const Tensor& t : kTensors) {
      STRATA_RETURN_IF_ERROR((*e)->register_param({t.name, t.shape, t.group}, [t](std::span<float> out) {
        init_values(t, out);
        return core::Status();
      }));
    }
    return (*e)->finalize();
  }
};

// In fp32 and in the smallest optimizer state format (strata.optimizer_state
// int8_blockwise: codes and block scales; state_format_test.cpp runs every
// format under more schedules); each format is its own trajectory.
TEST_F(Placement, EveryPlacementGivesTheSameBitsAndItsOwnTraffic) {
  struct Format {
    StateFormat format;
    StateRounding rounding;
  };
  for (const Format fmt : {Format{StateFormat::kFp32, StateRounding::kNearestEven},
                           Format{StateFormat::kInt8Blockwise, StateRounding::kNearestEven}}) {
    SCOPED_TRACE(core::str_cat(to_string(fmt.format), " ", to_string(fmt.rounding)));
    struct Case {
      const char* name;
      OffloadDevice optimizer, param;
      double cpu_fraction = 0.0, ratio = 1.0;
      std::int64_t max_in_cpu = 0;
    };
    const std::vector<Case> cases = {
        {"all on the device", OffloadDevice::kNone, OffloadDevice::kNone},
        {"optimizer in pinned memory", OffloadDevice::kCpu, OffloadDevice::kNone},
        {"params and optimizer in pinned memory", OffloadDevice::kCpu, OffloadDevice::kCpu},
        {"optimizer on nvme", OffloadDevice::kNvme, OffloadDevice::kNone},
        {"everything on nvme", OffloadDevice::kNvme, OffloadDevice::kNvme},
        {"optimizer split cpu/nvme", OffloadDevice::kNvme, OffloadDevice::kCpu, 0.5},
        {"half the optimizer on the device (ratio)", OffloadDevice::kCpu, OffloadDevice::kCpu, 0.0, 0.5},
        // l2's compute home (32 x 512 + 32, padded: 16448 elements) in
        // pinned memory, l1's (131584) too large for what is left: on nvme.
        {"compute copies split pinned/nvme (max_in_cpu)", OffloadDevice::kNvme, OffloadDevice::kNvme, 0.0, 1.0,
         16448},
    };
    RunResult reference;
    for (const Case& k : cases) {
      SCOPED_TRACE(k.name);
      Config c = base();
      c.zero.offload_optimizer.device = k.optimizer;
      c.zero.offload_param.device = k.param;
      c.zero.offload_optimizer.ratio = k.ratio;
      c.strata.optimizer_cpu_fraction = k.cpu_fraction;
      c.zero.offload_param.max_in_cpu = k.max_in_cpu;
      c.strata.optimizer_state = {fmt.format, fmt.rounding};
      // The compressed format: fewer steps (its bits and traffic show from the first).
      const int steps = fmt.format == StateFormat::kFp32 ? kSteps : 6;
      RunResult r = train(c, false, nullptr, -1, steps);
      ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(steps));
      const StepBytes& got = r.stats.back().bytes;
      std::printf("%-42s loss %.6f -> %.6f  h2d %llu d2h %llu nvme r/w %llu/%llu\n", k.name, r.losses.front(),
                  r.losses.back(), static_cast<unsigned long long>(got.h2d),
                  static_cast<unsigned long long>(got.d2h), static_cast<unsigned long long>(got.nvme_read),
                  static_cast<unsigned long long>(got.nvme_write));
      if (reference.losses.empty()) {
        reference = r;
        const auto& m = r.exp_avg.at("l1.w");
        EXPECT_TRUE(std::any_of(m.begin(), m.end(), [](float x) { return x != 0.0f; }))
            << "moments never moved";
        if (steps == kSteps) {
          EXPECT_LT(r.losses.back(), 0.5 * r.losses.front()) << "the loss should halve in " << kSteps << " steps";
        }
      } else {
        EXPECT_EQ(r.losses, reference.losses);
        expect_same_state(r, reference);
      }
      EXPECT_EQ(r.traffic.back(), r.expected_bytes)
          << "h2d " << r.traffic.back().h2d << " vs " << r.expected_bytes.h2d << ", d2h "
          << r.traffic.back().d2h << " vs " << r.expected_bytes.d2h << ", nvme read "
          << r.traffic.back().nvme_read << " vs " << r.expected_bytes.nvme_read << ", nvme write "
          << r.traffic.back().nvme_write << " vs " << r.expected_bytes.nvme_write;
    }
  }
}

// The numerics contract across devices (DESIGN.md section 6): on the CUDA
// device (its Adam, conversion and norm kernels for state kept on the device,
// its copies and events) the same losses, bits and traffic as on the host
// device, for state on the device (fp32 and bf16 moments), in pinned memory,
// on nvme and half the optimizer on each (ratio), in bf16, fp16 with an
// overflow, and fp32.
// Skipped, saying why, without a usable CUDA device.
TEST_F(Placement, TheCudaDeviceGivesTheHostDevicesBits) {
  const DeviceVerdict v = cuda_verdict("");
  if (!v.error.empty()) FAIL() << v.error;
  if (!v.skip.empty()) GTEST_SKIP() << v.skip;
  using enum OffloadDevice;
  struct Case {
    const char* name;
    Precision precision;
    OffloadDevice optimizer, param;
    double ratio = 1.0;
    StateRounding bf16_moments_rounding = StateRounding::kNearestEven;
    bool bf16_moments = false;  // strata.optimizer_state.format bf16
  };
  const std::vector<Case> cases = {
      {"bf16, all on the device", Precision::kBf16, kNone, kNone},
      {"bf16 with bf16 moments, all on the device", Precision::kBf16, kNone, kNone, 1.0,
       StateRounding::kNearestEven, true},
      {"bf16 with stochastically rounded bf16 moments, half on the device", Precision::kBf16, kCpu, kCpu, 0.5,
       StateRounding::kStochastic, true},
      {"bf16, params and optimizer in pinned memory", Precision::kBf16, kCpu, kCpu},
      {"bf16, everything on nvme", Precision::kBf16, kNvme, kNvme},
      {"bf16, half the optimizer on the device", Precision::kBf16, kCpu, kCpu, 0.5},
      {"fp16 overflows, all on the device", Precision::kFp16, kNone, kNone},
      {"fp32, all on the device", Precision::kFp32, kNone, kNone},
  };
  const auto inf_at_4 = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == 4) g["l1.w"][3] = std::numeric_limits<float>::infinity();
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Config c = base();
    c.precision = k.precision;
    if (k.precision == Precision::kFp16) {
      c.fp16.enabled = true;
      c.fp16.initial_scale_power = 8;
    }
    c.zero.offload_optimizer.device = k.optimizer;
    c.zero.offload_param.device = k.param;
    c.zero.offload_optimizer.ratio = k.ratio;
    if (k.bf16_moments) c.strata.optimizer_state = {StateFormat::kBf16, k.bf16_moments_rounding};
    const Tamper tamper = k.precision == Precision::kFp16 ? Tamper(inf_at_4) : Tamper();
    put_on_device(c, DeviceKind::kHost);
    const RunResult host = train(c, false, tamper);
    put_on_device(c, DeviceKind::kCuda);
    const RunResult cuda = train(c, false, tamper);
    ASSERT_EQ(host.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(cuda.losses, host.losses);
    expect_same_state(cuda, host);
    ASSERT_EQ(cuda.stats.size(), host.stats.size());
    for (std::size_t s = 0; s < host.stats.size(); ++s) {
      EXPECT_EQ(cuda.stats[s].skipped, host.stats[s].skipped) << s;
      EXPECT_EQ(cuda.traffic[s], host.traffic[s]) << s;
    }
  }
}

TEST_F(Placement, GradientAccumulationIsBitIdenticalAcrossPlacements) {
  Config pinned = base();
  pinned.gradient_accumulation_steps = 2;
  pinned.train_batch_size = 2 * kBatch;
  pinned.zero.offload_optimizer.device = OffloadDevice::kCpu;
  pinned.zero.offload_param.device = OffloadDevice::kCpu;
  Config nvme = pinned;
  nvme.zero.offload_optimizer.device = OffloadDevice::kNvme;
  nvme.zero.offload_param.device = OffloadDevice::kNvme;
  constexpr int kAccumSteps = 8;
  const RunResult a = train(pinned, false, nullptr, -1, kAccumSteps),
                  b = train(nvme, false, nullptr, -1, kAccumSteps);
  ASSERT_EQ(a.losses.size(), static_cast<std::size_t>(kAccumSteps));
  EXPECT_EQ(a.losses, b.losses);
  for (const auto& [name, v] : a.master) EXPECT_TRUE(bits_equal(b.master.at(name), v)) << name;
  EXPECT_LT(a.losses.back(), 0.8 * a.losses.front());
  EXPECT_EQ(a.traffic.back(), a.expected_bytes);
  EXPECT_EQ(b.traffic.back(), b.expected_bytes);
}

TEST_F(Placement, FrozenBaseTrainsOnlyTheTrainablePart) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  const RunResult r = train(c, /*freeze_l1=*/true);
  ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(r.losses.back(), r.losses.front());
  EXPECT_EQ(r.master.count("l1.w"), 0u);  // frozen: no master weights
  for (const Tensor& t : kTensors) {
    if (t.group != "l1") continue;
    std::vector<float> init(r.compute.at(t.name).size());
    init_values(t, init);
    for (std::size_t i = 0; i < init.size(); ++i) {
      ASSERT_EQ(r.compute.at(t.name)[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(init[i])))
          << t.name << " " << i;
    }
  }
  EXPECT_EQ(r.traffic.back(), r.expected_bytes);
}

// A group with a frozen parameter beside trainable ones: the frozen one's
// compute copies stay as they were in every compute home; the optimizer
// neither reads them nor writes them back (the group's trainable part goes
// home alone), and only the trainable part's gradients come down (the memory
// model counts it).
TEST_F(Placement, AFrozenParameterKeepsItsComputeCopiesInAGroupThatTrains) {
  frozen_ = {"l1.w"};
  // Every compute home, and the schedules whose jobs open a group otherwise:
  // speculative (the trainable range opened blank, committed at the verdict)
  // and delayed (the whole home read, held pending, its trainable range
  // committed at the next step_end).
  const std::pair<OffloadDevice, OverlapMode> cases[] = {
      {OffloadDevice::kNone, OverlapMode::kExact},        {OffloadDevice::kCpu, OverlapMode::kExact},
      {OffloadDevice::kNvme, OverlapMode::kExact},        {OffloadDevice::kNvme, OverlapMode::kSpeculative},
      {OffloadDevice::kNone, OverlapMode::kSpeculative},  {OffloadDevice::kNvme, OverlapMode::kDelayed},
      {OffloadDevice::kNone, OverlapMode::kDelayed}};
  std::map<OffloadDevice, RunResult> exact;
  for (const auto& [params, overlap] : cases) {
    SCOPED_TRACE(core::str_cat("offload_param ", static_cast<int>(params), ", overlap ", static_cast<int>(overlap)));
    Config c = base();
    c.strata.overlap = overlap;
    c.zero.offload_param.device = params;
    c.zero.offload_optimizer.device = params == OffloadDevice::kNone ? OffloadDevice::kNone : OffloadDevice::kNvme;
    // (Speculative with the state on nvme moves a second version, which the memory model does not count.)
    if (overlap == OverlapMode::kSpeculative && params != OffloadDevice::kNone) {
      c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    }
    const RunResult r = train(c);
    if (overlap == OverlapMode::kExact) exact.emplace(params, r);
    if (overlap == OverlapMode::kSpeculative) {
      // The sequential bits, as the exact schedule's run of the same compute home.
      for (const auto& [name, v] : exact.at(params).master) EXPECT_TRUE(bits_equal(r.master.at(name), v)) << name;
    }
    ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(r.master.count("l1.w"), 0u);
    ASSERT_EQ(r.master.count("l1.b"), 1u);
    const Tensor& w = kTensors[0];
    std::vector<float> init(r.compute.at(w.name).size());
    init_values(w, init);
    for (std::size_t i = 0; i < init.size(); ++i) {
      ASSERT_EQ(r.compute.at(w.name)[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(init[i]))) << i;
    }
    std::vector<float> b0(r.compute.at("l1.b").size());
    init_values(kTensors[1], b0);
    EXPECT_FALSE(bits_equal(r.compute.at("l1.b"), b0)) << "l1.b trains";
    EXPECT_EQ(r.traffic.back(), r.expected_bytes);
  }
}

// A trainable parameter that never gets a gradient (Engine::no_grads in
// every micro-batch, its slots zero): under strata.no_grad "skip" every step
// leaves it as it was (its initial master, zero moments), and every other
// parameter trains to the bits of a run where it is frozen (the forward sees
// the same copies; zeros add nothing to the norm), in every compute home and
// schedule; under "zero" its weight decay applies. The calls out of order are
// refused, naming what is wrong.
TEST_F(Placement, AParameterWithoutGradientsIsLeftAsItWas) {
  const std::pair<OffloadDevice, OverlapMode> cases[] = {
      {OffloadDevice::kNone, OverlapMode::kExact},
      {OffloadDevice::kNvme, OverlapMode::kSpeculative},
      {OffloadDevice::kNvme, OverlapMode::kDelayed},
      {OffloadDevice::kCpu, OverlapMode::kNone}};
  for (const auto& [params, overlap] : cases) {
    SCOPED_TRACE(core::str_cat("offload_param ", static_cast<int>(params), ", overlap ", static_cast<int>(overlap)));
    Config c = base();
    c.strata.overlap = overlap;
    c.zero.offload_param.device = params;
    c.zero.offload_optimizer.device = params == OffloadDevice::kNone ? OffloadDevice::kNone : OffloadDevice::kCpu;
    c.gradient_accumulation_steps = 2;
    frozen_ = {"l1.w"};
    absent_ = {};
    const RunResult frozen = train(c);
    frozen_ = {};
    absent_ = {"l1.w"};
    const RunResult skipped = train(c);
    ASSERT_EQ(skipped.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(skipped.losses, frozen.losses);
    for (const auto& [name, v] : frozen.master) EXPECT_TRUE(bits_equal(skipped.master.at(name), v)) << name;
    std::vector<float> init(skipped.master.at("l1.w").size());
    init_values(kTensors[0], init);
    EXPECT_TRUE(bits_equal(skipped.master.at("l1.w"), init));
    EXPECT_TRUE(std::all_of(skipped.exp_avg_sq.at("l1.w").begin(), skipped.exp_avg_sq.at("l1.w").end(),
                            [](float x) { return x == 0.0f; }));
    if (overlap == OverlapMode::kExact) {
      c.strata.no_grad = NoGradPolicy::kZero;
      const RunResult zero = train(c);
      EXPECT_FALSE(bits_equal(zero.master.at("l1.w"), init)) << "weight decay applies";
    }
  }
  absent_ = {};
  // Out of order, or naming what is not a trainable parameter of the group.
  frozen_ = {"l1.w"};
  std::unique_ptr<Engine> made = registered(base());
  ASSERT_NE(made, nullptr);
  Engine& e = *made;
  const std::string_view w[] = {"l1.w"}, nothing[] = {"l9.w"}, other[] = {"l2.w"};
  EXPECT_EQ(e.no_grads("l1", w).code(), core::StatusCode::kFailedPrecondition);  // before finalize
  ASSERT_TRUE(e.finalize().ok());
  core::Status s = e.no_grads("l1", w);
  EXPECT_EQ(s.code(), core::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("'l1.w' is not a trainable parameter"), std::string::npos) << s;
  s = e.no_grads("l1", nothing);
  EXPECT_NE(s.message().find("no parameter named 'l9.w'"), std::string::npos) << s;
  s = e.no_grads("l1", other);
  EXPECT_EQ(s.code(), core::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(e.no_grads("l9", w).code(), core::StatusCode::kNotFound);
}

// A group's gradient buffer begins at its first trainable slot: l1's frozen
// l1.w (first in the group) has none, so the buffer and the device memory it
// takes are l1.b's part (a LoRA block's buffer is its adapters', not its
// base's); the planner's device_gradient_buffers counts the same.
TEST_F(Placement, AGroupsGradientBufferHoldsItsTrainablePartAlone) {
  frozen_ = {"l1.w"};
  std::unique_ptr<Engine> made = registered(base());
  ASSERT_NE(made, nullptr);
  Engine& e = *made;
  ASSERT_TRUE(e.finalize().ok());
  const GroupPlace* l1 = e.layout().find_group("l1");
  ASSERT_NE(l1, nullptr);
  const auto cb = static_cast<std::uint64_t>(e.layout().compute_bytes);
  EXPECT_GT(l1->trainable_compute_begin, 0);
  const std::uint64_t before = e.device_budget().used_bytes();
  auto grads = e.grad_buffer("l1");
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->size_bytes(), static_cast<std::uint64_t>(l1->gradient_elems()) * cb);
  EXPECT_LT(grads->size_bytes(), static_cast<std::uint64_t>(l1->compute_elems) * cb / 4);
  const std::uint64_t taken = e.device_budget().used_bytes() - before;
  EXPECT_GE(taken, grads->size_bytes());
  EXPECT_LT(taken, static_cast<std::uint64_t>(l1->compute_elems) * cb / 2) << "the device memory is the part's";
}

// The frozen parameter's compute copies read straight from the safetensors
// file it was imported from (strata.frozen_base "files"; FrozenFiles, which
// fetches on the prefetch thread and the step's read at once): the same bits
// as with a copy on the swap drive ("swap") under the exact and the delayed
// schedules, the file never written, read on every fetch of its group that
// no device copy serves, and nothing of it on the swap drive. The file's l1.w
// is bf16, the compute dtype: read as it is.
TEST_F(Placement, AFrozenBaseReadFromItsFileGivesTheBitsOfASwapCopy) {
  frozen_ = {"l1.w"};
  const Tensor& w = kTensors[0];
  ASSERT_EQ(w.name, "l1.w");
  weights_dir_ = (dir_ / "base").string();
  ASSERT_NO_FATAL_FAILURE(write_base(weights_dir_));
  for (const OverlapMode overlap : {OverlapMode::kExact, OverlapMode::kDelayed}) {
    std::map<FrozenBase, RunResult> runs;
    for (const FrozenBase mode : {FrozenBase::kSwap, FrozenBase::kFiles}) {
      SCOPED_TRACE(core::str_cat("overlap ", static_cast<int>(overlap), ", frozen_base ", to_string(mode)));
      Config c = base();
      c.strata.overlap = overlap;
      c.strata.frozen_base = mode;
      c.zero.offload_param.device = OffloadDevice::kNvme;
      c.zero.offload_optimizer.device = OffloadDevice::kCpu;
      runs[mode] = train(c);
      ASSERT_EQ(runs[mode].losses.size(), static_cast<std::size_t>(kSteps));
    }
    const RunResult& swap = runs.at(FrozenBase::kSwap);
    const RunResult& files = runs.at(FrozenBase::kFiles);
    EXPECT_EQ(files.losses, swap.losses);
    expect_same_state(files, swap);
    std::vector<float> v(files.compute.at(w.name).size());
    init_values(w, v);
    for (std::size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(files.compute.at(w.name)[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(v[i]))) << i;
    }
    const std::uint64_t frozen_bytes = v.size() * 2;
    for (std::size_t s = 0; s < swap.stats.size(); ++s) {
      // A step writes the same either way (the trainable part), reads the
      // frozen part from the file instead of the swap drive.
      EXPECT_EQ(files.stats[s].bytes.nvme_write, swap.stats[s].bytes.nvme_write) << s;
      EXPECT_EQ(swap.stats[s].bytes.file_read, 0u) << s;
      EXPECT_EQ(files.stats[s].resident, swap.stats[s].resident) << s;
      EXPECT_EQ(files.stats[s].bytes.file_read % frozen_bytes, 0u) << s;
      // (The swap copy's reads are its block's aligned extents: at least the tensor's bytes.)
      EXPECT_LE(files.stats[s].bytes.nvme_read + files.stats[s].bytes.file_read, swap.stats[s].bytes.nvme_read) << s;
      EXPECT_LT(files.stats[s].bytes.nvme_read, swap.stats[s].bytes.nvme_read) << s;
    }
    std::uint64_t read = 0;
    for (const StepStats& st : files.stats) read += st.bytes.file_read;
    EXPECT_GE(read, frozen_bytes * kSteps) << "every step fetches l1 at least once";
  }
}

// offload_param.max_in_cpu keeping a group whose frozen parameter comes from
// the imported file (l1: l1.w frozen, from the file; strata.frozen_base
// "auto"): its pinned home holds a copy of the file's values, recorded at
// import. The run has the bits of the base read from its file, reads
// nothing of it from the file, and its checkpoints leave the base out as a
// base read from its file does: each engine (kept, read from the file, a
// copy on the swap drive) loads the other's checkpoints.
TEST_F(Placement, ABaseKeptInCpuMemoryIsTheFilesValuesAndLeftOutOfCheckpoints) {
  frozen_ = {"l1.w"};
  weights_dir_ = (dir_ / "base").string();
  ASSERT_NO_FATAL_FAILURE(write_base(weights_dir_));
  Config files = base();
  files.zero.offload_param.device = OffloadDevice::kNvme;
  files.zero.offload_optimizer.device = OffloadDevice::kCpu;
  Config kept = files;
  kept.zero.offload_param.max_in_cpu = 131584;  // l1's home: l1.w (frozen), then l1.b from a 4 KiB boundary
  Config swap = files;
  swap.strata.frozen_base = FrozenBase::kSwap;
  const RunResult from_files = train(files);
  const RunResult from_memory = train(kept);
  ASSERT_EQ(from_memory.losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(from_memory.losses, from_files.losses);
  expect_same_state(from_memory, from_files);
  for (std::size_t s = 0; s < from_memory.stats.size(); ++s) {
    EXPECT_EQ(from_memory.stats[s].bytes.file_read, 0u) << s;
    EXPECT_GT(from_files.stats[s].bytes.file_read, 0u) << s;
  }

  const auto make = [&](const Config& c) -> std::unique_ptr<Engine> {
    std::unique_ptr<Engine> e = registered(c);
    if (e == nullptr) return nullptr;
    const core::Status fin = e->finalize();
    EXPECT_TRUE(fin.ok()) << fin;
    return fin.ok() ? std::move(e) : nullptr;
  };
  // The groups a checkpoint left the base of out (its manifest's frozen_base).
  const auto left_out = [](const std::string& root) {
    std::vector<std::string> groups;
    for (const auto& f : std::filesystem::recursive_directory_iterator(root)) {
      if (f.path().filename() != "manifest.json") continue;
      std::ifstream in(f.path(), std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      auto m = parse_checkpoint_manifest(std::as_bytes(std::span(text)), f.path().string());
      EXPECT_TRUE(m.ok()) << m.status();
      if (m.ok()) {
        for (const CheckpointFrozenBase& b : m->frozen_base) groups.push_back(b.group);
      }
    }
    return groups;
  };
  // The trainable parameters' masters and every compute copy (l1.w's: the base).
  const auto state_of = [](Engine& e) {
    std::map<std::string, std::vector<float>> out;
    for (const Tensor& t : kTensors) {
      std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
      EXPECT_TRUE(e.read_compute(t.name, v).ok()) << t.name;
      out[t.name + ".compute"] = v;
      if (t.name != "l1.w") {
        EXPECT_TRUE(e.read_master(t.name, v).ok()) << t.name;
        out[t.name] = std::move(v);
      }
    }
    return out;
  };
  std::map<std::string, std::map<std::string, std::vector<float>>> saved;
  const std::pair<const char*, const Config*> engines[] = {{"kept", &kept}, {"files", &files}, {"swap", &swap}};
  for (const auto& [name, c] : engines) {
    std::unique_ptr<Engine> e = make(*c);
    ASSERT_NE(e, nullptr) << name;
    const GroupPlace* l1 = e->layout().find_group("l1");
    EXPECT_EQ(l1->compute_tier, c == &kept ? Tier::kPinned : Tier::kNvme) << name;
    EXPECT_EQ(l1->frozen_kept_from_files, c == &kept) << name;
    Framework f;
    f.bind(*e);
    for (int step = 0; step < 2; ++step) {
      f.batch(step * 16);
      f.load(*e, "l1");
      f.load(*e, "l2");
      f.forward();
      auto& g = f.backward(1.0f);
      f.give_grads(*e, "l2", g);
      f.give_grads(*e, "l1", g);
      ASSERT_TRUE(e->step_end().ok()) << name;
    }
    const core::Status status = e->save_checkpoint((dir_ / core::str_cat("ck_", name)).string(), {});
    ASSERT_TRUE(status.ok()) << name << ": " << status;
    saved[name] = state_of(*e);
  }
  EXPECT_EQ(saved.at("kept"), saved.at("files"));  // (bit for bit: their float vectors compare equal, no NaNs)
  EXPECT_EQ(left_out((dir_ / "ck_kept").string()), std::vector<std::string>{"l1"});
  EXPECT_EQ(left_out((dir_ / "ck_files").string()), std::vector<std::string>{"l1"});
  EXPECT_EQ(left_out((dir_ / "ck_swap").string()), std::vector<std::string>{});
  for (const auto& [name, c] : engines) {
    for (const char* from : {"kept", "files", "swap"}) {
      std::unique_ptr<Engine> e = make(*c);
      ASSERT_NE(e, nullptr) << name;
      const auto loaded = e->load_checkpoint((dir_ / core::str_cat("ck_", from)).string());
      ASSERT_TRUE(loaded.ok()) << name << " loading " << from << ": " << loaded.status();
      for (const auto& [t, v] : state_of(*e)) EXPECT_TRUE(bits_equal(v, saved.at(from).at(t))) << name << " " << from << " " << t;
    }
  }
  // A checkpoint whose base is another (a swap copy of other values) is
  // refused by the kept engine before anything changes, as by the files one.
  weights_dir_ = (dir_ / "other").string();
  {
    const Tensor& w = kTensors[0];
    std::filesystem::create_directories(weights_dir_);
    std::vector<float> v(static_cast<std::size_t>(w.shape[0] * w.shape[1]));
    init_values(w, v);
    for (float& x : v) x += 1.0f;
    auto writer = SafetensorsWriter::create(weights_dir_ + "/model.safetensors", {{w.name, TensorDtype::kBf16, w.shape}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(writer->write_f32(w.name, v).ok());
    ASSERT_TRUE(writer->finish().ok());
    std::unique_ptr<Engine> other = make(swap);
    ASSERT_NE(other, nullptr);
    ASSERT_TRUE(other->save_checkpoint((dir_ / "ck_other").string(), {}).ok());
  }
  weights_dir_ = (dir_ / "base").string();
  std::unique_ptr<Engine> e = make(kept);
  ASSERT_NE(e, nullptr);
  const auto before = state_of(*e);
  const auto refused = e->load_checkpoint((dir_ / "ck_other").string());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), core::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("differ from those files' values"), std::string::npos) << refused.status();
  EXPECT_EQ(state_of(*e), before);
}

// A checkpoint that leaves its frozen base out (strata.frozen_base "files")
// names the groups whose base it left out, with their frozen parameters; an
// engine whose group of that name holds other frozen parameters (the same
// model grouped otherwise: l1.w moved to l2) cannot compare that base and is
// refused, naming both counts, before anything changes; the same grouping
// loads.
TEST_F(Placement, ABaseLeftOutOfACheckpointIsRefusedWhereTheGroupsDiffer) {
  const Tensor& w = kTensors[0];
  ASSERT_EQ(w.name, "l1.w");
  const std::string dir = (dir_ / "base").string();
  ASSERT_NO_FATAL_FAILURE(write_base(dir));
  Config c = base();
  c.strata.frozen_base = FrozenBase::kFiles;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  // The model with l1.w (frozen, read from its file) in group `w_group`.
  frozen_ = {w.name};
  weights_dir_ = dir;
  const auto make = [&](const std::string& w_group) -> std::unique_ptr<Engine> {
    std::unique_ptr<Engine> e = registered(c, {{w.name, w_group}});
    if (e == nullptr) return nullptr;
    const core::Status fin = e->finalize();
    EXPECT_TRUE(fin.ok()) << fin;
    return fin.ok() ? std::move(e) : nullptr;
  };
  const std::string ck = (dir_ / "ck").string();
  {
    std::unique_ptr<Engine> saver = make("l1");
    ASSERT_NE(saver, nullptr);
    const core::Status saved = saver->save_checkpoint(ck, {});
    ASSERT_TRUE(saved.ok()) << saved;
  }
  std::unique_ptr<Engine> other = make("l2");
  ASSERT_NE(other, nullptr);
  std::vector<float> before(static_cast<std::size_t>(kTensors[1].shape[0]));
  ASSERT_TRUE(other->read_master("l1.b", before).ok());
  const auto refused = other->load_checkpoint(ck);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), core::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("group 'l1' holds 0 frozen parameters, the checkpoint's 1 others "
                                            "(the fetch groups differ"),
            std::string::npos)
      << refused.status();
  std::vector<float> after(before.size());
  ASSERT_TRUE(other->read_master("l1.b", after).ok());
  EXPECT_TRUE(bits_equal(after, before));
  other.reset();  // (its swap path is the next engine's)
  std::unique_ptr<Engine> same = make("l1");
  ASSERT_NE(same, nullptr);
  const auto loaded = same->load_checkpoint(ck);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
}

TEST_F(Placement, Bf16NonFiniteGradientsSkipTheStepAndCount) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const auto nan_at_5 = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == 5) g["l2.w"][7] = std::numeric_limits<float>::quiet_NaN();
  };
  const RunResult r = train(c, false, nan_at_5);
  ASSERT_EQ(r.stats.size(), static_cast<std::size_t>(kSteps));
  EXPECT_TRUE(r.stats[5].skipped);
  EXPECT_EQ(r.stats[5].step, 5);  // not advanced
  EXPECT_EQ(r.stats.back().skipped_total, 1);
  EXPECT_EQ(r.stats.back().step, kSteps - 1);
  for (const auto& [name, v] : r.master) {
    for (float x : v) ASSERT_TRUE(std::isfinite(x)) << name;  // the NaN never reached the weights
  }
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());

  // strata.nonfinite = "error": the same step fails, naming the key.
  c.strata.nonfinite = NonfinitePolicy::kError;
  const RunResult strict = train(c, false, nan_at_5, /*error_at=*/5);
  EXPECT_EQ(strict.error.code(), core::StatusCode::kFailedPrecondition);
  EXPECT_NE(strict.error.message().find("strata.nonfinite"), std::string::npos) << strict.error;
}

TEST_F(Placement, Fp16OverflowSkipsAndHalvesTheScaleAsDeepSpeedDoes) {
  Config c = base();
  c.precision = Precision::kFp16;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 1000;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const auto inf_at_4 = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == 4) g["l1.w"][3] = std::numeric_limits<float>::infinity();
  };
  const RunResult r = train(c, false, inf_at_4);
  ASSERT_EQ(r.stats.size(), static_cast<std::size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(r.stats[s].skipped, s == 4) << s;
    EXPECT_EQ(r.stats[s].loss_scale, s < 4 ? 256.0 : 128.0) << s;
  }
  EXPECT_EQ(r.stats.back().step, kSteps - 1);
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());
}

// The overlapped schedules (the default, "exact": the optimizer runs behind
// step_end while the next forward goes on; "speculative": nvme chunks are
// updated during the backward and committed or thrown away at step_end)
// against the sequential one ("none"), with clipping firing and with fp16
// overflows: the same bits. Each step's traffic equals the memory model under
// "none"; under "exact" the optimizer's traffic shows one step later, so
// every step after the first equals it too. Under "speculative" the work
// thrown away (clipped and skipped steps) shows as speculative_discarded.
TEST_F(Placement, OverlappedScheduleGivesTheSequentialBits) {
  struct Case {
    const char* name;
    Precision precision;
    OffloadDevice optimizer, param;
  };
  const std::vector<Case> cases = {
      {"bf16, clipping, optimizer on nvme", Precision::kBf16, OffloadDevice::kNvme, OffloadDevice::kCpu},
      {"bf16, clipping, everything on nvme", Precision::kBf16, OffloadDevice::kNvme, OffloadDevice::kNvme},
      {"fp16 overflows, optimizer pinned", Precision::kFp16, OffloadDevice::kCpu, OffloadDevice::kNone},
      {"fp16 overflows, optimizer on nvme", Precision::kFp16, OffloadDevice::kNvme, OffloadDevice::kCpu},
  };
  const auto overflows = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == 3 || step == 4 || step == 11) g["l2.w"][7] = std::numeric_limits<float>::infinity();
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Config c = base();
    c.precision = k.precision;
    c.fp16.enabled = k.precision == Precision::kFp16;
    c.fp16.initial_scale_power = 8;
    c.zero.offload_optimizer.device = k.optimizer;
    c.zero.offload_param.device = k.param;
    c.gradient_clipping = 0.5;
    const Tamper tamper = k.precision == Precision::kFp16 ? Tamper(overflows) : Tamper();
    c.strata.overlap = OverlapMode::kNone;
    const RunResult seq = train(c, false, tamper);
    c.strata.overlap = OverlapMode::kExact;
    const RunResult ovl = train(c, false, tamper);
    c.strata.overlap = OverlapMode::kSpeculative;
    const RunResult spec = train(c, false, tamper);
    ASSERT_EQ(seq.stats.size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(ovl.stats.size(), static_cast<std::size_t>(kSteps));
    ASSERT_EQ(spec.stats.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(seq.losses, ovl.losses);
    EXPECT_EQ(seq.losses, spec.losses);
    std::int64_t discarded = 0;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(seq.stats[s].skipped, spec.stats[s].skipped) << s;
      EXPECT_EQ(seq.stats[s].grad_norm, spec.stats[s].grad_norm) << s;
      EXPECT_EQ(seq.stats[s].loss_scale, spec.stats[s].loss_scale) << s;
      discarded += spec.stats[s].speculative_discarded;
    }
    if (k.optimizer == OffloadDevice::kNvme) {
      EXPECT_GT(discarded, 0) << "clipped and skipped steps throw speculative work away";
    } else {
      EXPECT_EQ(discarded, 0) << "only nvme chunks are updated speculatively";
    }
    {
      SCOPED_TRACE("speculative");
      expect_same_state(spec, seq);
    }
    int clipped = 0, skipped = 0;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(seq.stats[s].skipped, ovl.stats[s].skipped) << s;
      EXPECT_EQ(seq.stats[s].grad_norm, ovl.stats[s].grad_norm) << s;
      EXPECT_EQ(seq.stats[s].loss_scale, ovl.stats[s].loss_scale) << s;
      clipped += !seq.stats[s].skipped && seq.stats[s].grad_norm > c.gradient_clipping;
      skipped += seq.stats[s].skipped;
      if (seq.stats[s].skipped || (s > 0 && seq.stats[s - 1].skipped)) continue;  // no optimizer traffic
      EXPECT_EQ(seq.traffic[s], seq.expected_bytes) << "sequential, step " << s;
      if (s > 0) {
        EXPECT_EQ(ovl.traffic[s], ovl.expected_bytes) << "overlapped, step " << s;
      }
    }
    EXPECT_GE(clipped, kSteps * 3 / 10) << "clipping should fire in at least 30% of the steps";
    EXPECT_EQ(skipped, k.precision == Precision::kFp16 ? 3 : 0);
    expect_same_state(ovl, seq);
  }
}

// Without clipping, a loss scaler or a non-finite check (strata.nonfinite
// "apply"), nothing step_end learns can change a step: "exact" and
// "speculative" update each group in place as its gradients of the last
// micro-batch arrive, during the backward. The same bits as the sequential
// schedule in every placement (compute copies on the device, whose commit
// waits for step_end, in pinned memory and on nvme; state pinned, on nvme and
// on the device), nothing thrown away, and the memory model's traffic. An
// infinite gradient in the last step is applied, not skipped, the same way in
// every schedule.
TEST_F(Placement, CertainStepsUpdateDuringTheBackwardWithTheSequentialBits) {
  struct Case {
    const char* name;
    OffloadDevice optimizer, param;
    double ratio = 1.0;
  };
  const std::vector<Case> cases = {
      {"optimizer pinned, params on the device", OffloadDevice::kCpu, OffloadDevice::kNone},
      {"optimizer and params pinned", OffloadDevice::kCpu, OffloadDevice::kCpu},
      {"optimizer on nvme, params pinned", OffloadDevice::kNvme, OffloadDevice::kCpu},
      {"everything on nvme", OffloadDevice::kNvme, OffloadDevice::kNvme},
      {"half the optimizer on the device, params pinned", OffloadDevice::kCpu, OffloadDevice::kCpu, 0.5},
  };
  const auto inf_in_last_step = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == kSteps - 1) g["l2.w"][7] = std::numeric_limits<float>::infinity();
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Config c = base();
    c.gradient_clipping = 0.0;
    c.strata.nonfinite = NonfinitePolicy::kApply;
    c.zero.offload_optimizer.device = k.optimizer;
    c.zero.offload_param.device = k.param;
    c.zero.offload_optimizer.ratio = k.ratio;
    RunResult runs[3];
    const OverlapMode modes[3] = {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative};
    for (int m = 0; m < 3; ++m) {
      c.strata.overlap = modes[m];
      runs[m] = train(c, false, inf_in_last_step);
      ASSERT_EQ(runs[m].stats.size(), static_cast<std::size_t>(kSteps)) << to_string(modes[m]);
    }
    const RunResult& seq = runs[0];
    EXPECT_LT(seq.losses.back(), 0.5 * seq.losses.front());
    EXPECT_FALSE(seq.stats.back().skipped) << "\"apply\" applies a step with an infinite gradient";
    EXPECT_EQ(seq.stats.back().step, kSteps);
    EXPECT_FALSE(std::isfinite(seq.stats.back().grad_norm));
    EXPECT_TRUE(std::isnan(seq.master.at("l2.w")[7])) << "the infinite gradient reached its weight";
    EXPECT_TRUE(std::isfinite(seq.master.at("l2.w")[6]));
    for (int m = 1; m < 3; ++m) {
      SCOPED_TRACE(to_string(modes[m]));
      const RunResult& r = runs[m];
      EXPECT_EQ(r.losses, seq.losses);
      std::int64_t discarded = 0;
      for (int s = 0; s < kSteps; ++s) {
        EXPECT_FALSE(r.stats[s].skipped) << s;
        EXPECT_EQ(r.stats[s].step, seq.stats[s].step) << s;
        discarded += r.stats[s].speculative_discarded;
        // The sequential schedule counts a step's optimizer in that step;
        // the overlapped ones in the next step (the job ends after the
        // verdict), so every step after the first matches the model.
        EXPECT_EQ(seq.traffic[s], seq.expected_bytes) << "sequential, step " << s;
        if (s > 0) {
          EXPECT_EQ(r.traffic[s], r.expected_bytes) << "step " << s;
        }
      }
      EXPECT_EQ(discarded, 0) << "a certain step's work is never thrown away";
      expect_same_state(r, seq);
    }
  }
}

// While a certain step updates in place (from its last micro-batch's first
// grads_ready to step_end), what would read half-updated state is refused
// with a clear error and changes nothing: fetching a group whose gradients
// are in, read_state, read_compute, set_lr, save_checkpoint. The rest of the
// step goes on, and set_lr between steps restarts the job the last step_end
// began: the run gives the sequential schedule's bits.
TEST_F(Placement, CallsThatWouldSeeAStepHalfAppliedAreRefused) {
  Config c = base();
  c.gradient_clipping = 0.0;
  c.strata.nonfinite = NonfinitePolicy::kApply;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  auto run = [&](OverlapMode mode, bool probe) {
    c.strata.overlap = mode;
    std::unique_ptr<Engine> e = make_mlp_engine(c);
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return std::map<std::string, std::vector<float>>{};
    Framework f;
    f.cb = e->layout().compute_bytes;
    f.precision = c.precision;
    train_one_step(*e, f, 0);
    // Step 2, up to the first group's gradients.
    f.batch(16);
    f.load(*e, "l1");
    f.load(*e, "l2");
    f.forward();
    const auto& g = f.backward(1.0f);
    f.load(*e, "l2");
    f.give_grads(*e, "l2", g);
    if (probe) {
      auto expect_refused = [](const core::Status& s, const char* op) {
        EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition) << op << ": " << s;
        EXPECT_NE(s.message().find(op), std::string::npos) << s;
        EXPECT_NE(s.message().find("strata.nonfinite"), std::string::npos) << s;
      };
      expect_refused(e->fetch("l2").status(), "fetch('l2')");
      std::vector<float> v(static_cast<std::size_t>(kOut * kHidden));
      expect_refused(e->read_state("l2.w", 0, v), "read_state");
      expect_refused(e->read_compute("l2.w", v), "read_compute");
      expect_refused(e->set_lr(1e-3), "set_lr");
      expect_refused(e->save_checkpoint((dir_ / "ckpt").string(), {}), "save_checkpoint");
    }
    f.load(*e, "l1");  // its gradients are not in yet: fetched as usual
    f.give_grads(*e, "l1", g);
    EXPECT_TRUE(e->step_end().ok());
    EXPECT_TRUE(e->set_lr(1e-3).ok());
    train_one_step(*e, f, 2);
    train_one_step(*e, f, 3);
    return read_masters(*e);
  };
  const auto seq = run(OverlapMode::kNone, false);
  const auto exact = run(OverlapMode::kExact, true);
  const auto spec = run(OverlapMode::kSpeculative, true);
  for (const auto& [name, v] : seq) {
    EXPECT_TRUE(bits_equal(exact.at(name), v)) << "exact " << name;
    EXPECT_TRUE(bits_equal(spec.at(name), v)) << "speculative " << name;
  }
}

// strata.overlap "delayed", the one-step delayed update: step N's optimizer
// runs during step N+1, which computes with the weights from before it. So
// steps 1 and 2 both compute with the initial weights and step 3 with the
// weights after the first update, which is the sequential schedule's first
// update bit for bit; from then on the trajectory is its own, the same in
// every placement, and the sequential schedule's when the framework computes
// each step's gradients at the weights of the step before. Between steps
// read_compute shows the latest update, and the traffic is the memory
// model's from the second step on.
TEST_F(Placement, DelayedUpdateComputesWithTheWeightsFromBeforeTheLastStep) {
  struct Case {
    const char* name;
    OffloadDevice optimizer, param;
  };
  const std::vector<Case> cases = {
      {"optimizer and params pinned", OffloadDevice::kCpu, OffloadDevice::kCpu},
      {"optimizer pinned, params on the device", OffloadDevice::kCpu, OffloadDevice::kNone},
      {"optimizer on nvme, params pinned", OffloadDevice::kNvme, OffloadDevice::kCpu},
      {"everything on nvme", OffloadDevice::kNvme, OffloadDevice::kNvme},
  };
  Config seq = base();
  seq.strata.overlap = OverlapMode::kNone;
  const RunResult w0 = train(seq, false, nullptr, -1, 0), w1 = train(seq, false, nullptr, -1, 1);
  const RunResult sequential = train(seq);
  const RunResult stale = train_stale(seq);
  auto loss_of = [](const std::map<std::string, std::vector<float>>& weights, int step) {
    Framework f;
    f.w = weights;
    f.batch(step * 16);
    return f.forward();
  };
  RunResult reference;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    Config c = base();
    c.strata.overlap = OverlapMode::kDelayed;
    c.zero.offload_optimizer.device = k.optimizer;
    c.zero.offload_param.device = k.param;
    const RunResult r = train(c);
    ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(r.losses[0], loss_of(w0.compute, 0));
    EXPECT_EQ(r.losses[1], loss_of(w0.compute, 1)) << "step 2 computes with the initial weights";
    EXPECT_EQ(r.losses[2], loss_of(w1.compute, 2)) << "step 3 with the sequential schedule's first update";
    EXPECT_NE(r.losses[2], sequential.losses[2]);
    EXPECT_EQ(r.losses, stale.losses) << "the sequential schedule fed gradients of the weights before";
    for (const auto& [name, v] : stale.master) EXPECT_TRUE(bits_equal(r.master.at(name), v)) << name;
    EXPECT_LT(r.losses.back(), r.losses.front());
    for (int s = 1; s < kSteps; ++s) {
      EXPECT_EQ(r.traffic[s], r.expected_bytes) << "step " << s;
    }
    // read_compute between steps: the compute dtype of the latest masters.
    for (const auto& [name, master] : r.master) {
      const std::vector<float>& compute = r.compute.at(name);
      for (std::size_t i = 0; i < master.size(); ++i) {
        ASSERT_EQ(compute[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(master[i]))) << name << " " << i;
      }
    }
    if (reference.losses.empty()) {
      reference = r;
      continue;
    }
    EXPECT_EQ(r.losses, reference.losses);
    expect_same_state(r, reference);
  }
}

// Under "delayed" (bf16 or fp32, strata.nonfinite not "error") step_end
// does not wait for the step's last gradients: the step's own optimizer job
// takes its verdict once they are in (skip on inf/NaN, the clipping
// coefficient from the norm) and StepStats report each verdict at the next
// step_end (norm_step says whose). With clipping firing and two steps
// skipped, the trajectory is the emulated delayed update's bit for bit, and
// each step_end reports what the sequential schedule reported one step
// before; the first reports no verdict yet.
TEST_F(Placement, DelayedVerdictsAreTakenByTheJobAndReportedAStepLate) {
  Config seq = base();
  seq.strata.overlap = OverlapMode::kNone;
  seq.gradient_clipping = 0.5;
  const auto inf_at = [](int step, std::map<std::string, std::vector<float>>& g) {
    if (step == 3 || step == 11) g["l2.w"][7] = std::numeric_limits<float>::infinity();
  };
  const RunResult stale = train_stale(seq, inf_at);
  ASSERT_EQ(stale.stats.size(), static_cast<std::size_t>(kSteps));
  int skipped = 0, clipped = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(stale.stats[s].norm_step, s + 1);
    skipped += stale.stats[s].skipped;
    clipped += !stale.stats[s].skipped && stale.stats[s].grad_norm > seq.gradient_clipping;
  }
  EXPECT_EQ(skipped, 2);
  EXPECT_GE(clipped, kSteps * 3 / 10) << "clipping should fire in at least 30% of the steps";
  for (const OffloadDevice optimizer : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    SCOPED_TRACE(optimizer == OffloadDevice::kCpu ? "optimizer pinned" : "optimizer on nvme");
    Config c = seq;
    c.strata.overlap = OverlapMode::kDelayed;
    c.zero.offload_optimizer.device = optimizer;
    c.zero.offload_param.device = OffloadDevice::kCpu;
    const RunResult r = train(c, false, inf_at);
    ASSERT_EQ(r.stats.size(), static_cast<std::size_t>(kSteps));
    EXPECT_EQ(r.losses, stale.losses);
    for (const auto& [name, v] : stale.master) EXPECT_TRUE(bits_equal(r.master.at(name), v)) << name;
    EXPECT_EQ(r.stats[0].norm_step, 0) << "no verdict before the first step's job";
    EXPECT_EQ(r.stats[0].step, 0);
    for (int s = 1; s < kSteps; ++s) {
      const StepStats& got = r.stats[s];
      const StepStats& want = stale.stats[s - 1];
      EXPECT_EQ(got.norm_step, s) << s;
      EXPECT_EQ(got.grad_norm, want.grad_norm) << s;
      EXPECT_EQ(got.skipped, want.skipped) << s;
      EXPECT_EQ(got.lr, want.lr) << s;
      EXPECT_EQ(got.step, want.step) << s;
      EXPECT_EQ(got.skipped_total, want.skipped_total) << s;
    }
  }
}

// Released copies stay on the device while they are current: within
// stage3_max_live_parameters, the one used again farthest ahead goes first
// (Belady on the learned sequence). With room for both groups, the backward
// takes both from the device; with room for l1 only, the forward's end
// keeps l2 (used next, by the backward) and lets l1 go; groups under
// stage3_param_persistence_threshold stay whatever the room. Same bits and,
// with what the resident copies did not move, the memory model's traffic.
TEST_F(Placement, ReleasedCopiesStayResidentBeladyPicksWhatGoes) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.stage3_param_persistence_threshold = 0;
  const RunResult all = train(c, false, nullptr, -1, 6);
  std::int64_t l1_elems = 0, l2_elems = 0;
  {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    l1_elems = e->layout().find_group("l1")->compute_elems;
    l2_elems = e->layout().find_group("l2")->compute_elems;
  }
  ASSERT_GT(l1_elems, l2_elems);
  c.zero.stage3_max_live_parameters = l1_elems;
  c.zero.stage3_prefetch_bucket_size = l1_elems;
  const RunResult one = train(c, false, nullptr, -1, 6);
  c.zero.stage3_max_live_parameters = 0;
  c.zero.stage3_prefetch_bucket_size = 0;
  c.zero.stage3_param_persistence_threshold = l2_elems;
  const RunResult persistent = train(c, false, nullptr, -1, 6);
  for (int s = 1; s < 6; ++s) {
    EXPECT_EQ(all.stats[s].resident, 2) << s;
    EXPECT_EQ(one.stats[s].resident, 1) << s;
    EXPECT_EQ(persistent.stats[s].resident, 1) << s;  // l2, in the backward
    EXPECT_EQ(one.stats[s].resident_bytes, static_cast<std::uint64_t>(l2_elems) * 2) << s;
    EXPECT_EQ(all.traffic[s], all.expected_bytes) << s;
    EXPECT_EQ(one.traffic[s], one.expected_bytes) << s;
  }
  for (const RunResult* r : {&one, &persistent}) {
    EXPECT_EQ(r->losses, all.losses);
    for (const auto& [name, v] : all.master) EXPECT_TRUE(bits_equal(r->master.at(name), v)) << name;
  }
}

// grads_ready with the stream the gradients were written on: the engine's copy
// waits for that stream (an event), the host does not. The framework queues
// 20 ms of backward (queue_busy_work) and then the gradient writes, and calls grads_ready at
// once: the same bits as writing, synchronizing and calling it without a
// stream under the sequential schedule (a copy that did not wait would read
// the buffer before the writes).
TEST_F(Placement, GradsReadyWaitsForTheStreamTheGradientsWereWrittenOn) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.host_device.tflops = 1.0;
  std::map<bool, std::vector<double>> losses;
  std::map<bool, std::map<std::string, std::vector<float>>> masters;
  for (const bool async : {false, true}) {
    c.strata.overlap = async ? OverlapMode::kExact : OverlapMode::kNone;
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    f.async_grads_flops = async ? 2e10 : 0.0;
    for (int s = 0; s < 4; ++s) {
      double loss = 0.0;
      auto st = run_step(*e, f, s, &loss);
      ASSERT_TRUE(st.ok()) << st.status();
      losses[async].push_back(loss);
      f.in_flight.clear();  // step_end waited for every gradient copy
    }
    masters[async] = read_masters(*e);
  }
  EXPECT_EQ(losses[false], losses[true]);
  for (const auto& [name, v] : masters[false]) EXPECT_TRUE(bits_equal(masters[true].at(name), v)) << name;
}

// release(group, stream): the framework's work on the view is still queued
// (20 ms of compute by queue_busy_work, then a copy that reads the view); the next fetch reuses
// the same device buffer for another group of the same size, and writes it
// only after that work: the copy reads group a's values, not b's. Without
// the stream (the caller's promise that its work is done) the fetch would
// overwrite the buffer at once.
TEST_F(Placement, ReleaseWithAStreamFencesTheBuffersReuse) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.overlap = OverlapMode::kNone;  // a released buffer goes straight back to the cache
  c.strata.host_device.tflops = 1.0;
  constexpr std::int64_t kElems = 65536;
  auto created = Engine::create(c);
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& e = **created;
  for (const auto& [name, value] : {std::pair<std::string, float>{"a", 1.5f}, {"b", -2.25f}}) {
    ASSERT_TRUE(e.register_param({name + ".w", {kElems}, name}, [value](std::span<float> out) {
                   std::fill(out.begin(), out.end(), value);
                   return core::Status();
                 }).ok());
  }
  ASSERT_TRUE(e.finalize().ok());
  gpu::Device& dev = e.device();
  auto fs = dev.create_stream("framework");
  ASSERT_TRUE(fs.ok());
  auto snapshot = dev.allocate(kElems * 2, "snapshot");
  ASSERT_TRUE(snapshot.ok());
  auto a = e.fetch("a");
  ASSERT_TRUE(a.ok()) << a.status();
  BusyScratch busy;
  ASSERT_TRUE(queue_busy_work(dev, *fs, 2e10, busy, "forward").ok());
  ASSERT_TRUE(dev.copy_d2d(*fs, snapshot->span(), *a).ok());
  ASSERT_TRUE(e.release("a", &*fs).ok());
  auto b = e.fetch("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->buffer_id(), a->buffer_id()) << "the test needs b in a's old buffer";
  std::vector<std::uint16_t> got(kElems);
  ASSERT_TRUE(dev.copy_d2h(*fs, std::as_writable_bytes(std::span(got)), snapshot->span()).ok());
  ASSERT_TRUE(dev.synchronize(*fs).ok());
  EXPECT_EQ(got.front(), nx::fp32_to_bf16_bits(1.5f));
  EXPECT_EQ(got.back(), nx::fp32_to_bf16_bits(1.5f));
  ASSERT_TRUE(e.release("b").ok());
}

// The disk pipeline's staging ring stays inside strata.budgets.staging: two
// slots for a dozen nvme chunks still train to the same bits, under "exact"
// and "speculative" (derived: four and six slots); a budget below one chunk
// is refused at finalize naming the key.
TEST_F(Placement, TheDiskPipelineStaysInsideItsStagingBudget) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  const RunResult reference = train(c, false, nullptr, -1, 6);
  const std::uint64_t chunk_state = 65536ull * 12;  // base(): one norm block per chunk
  for (const OverlapMode mode : {OverlapMode::kExact, OverlapMode::kSpeculative}) {
    SCOPED_TRACE(to_string(mode));
    c.strata.overlap = mode;
    c.strata.budgets.staging_bytes = 0;  // derived: 4 slots, 6 when speculative, no more than the chunks
    {
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      const auto depth = static_cast<std::size_t>(schedule_for(mode).ring_depth());
      EXPECT_EQ(depth, mode == OverlapMode::kSpeculative ? 6u : 4u);
      EXPECT_EQ(e->staging_slots(), std::min(depth, e->layout().chunks.size()));
    }
    c.strata.budgets.staging_bytes = 2 * chunk_state + chunk_state / 2;
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->staging_slots(), 2u);
    Framework f;
    for (int s = 0; s < 6; ++s) train_one_step(*e, f, s);
    const auto masters = read_masters(*e);
    for (const auto& [name, v] : reference.master) EXPECT_TRUE(bits_equal(masters.at(name), v)) << name;
    EXPECT_EQ(e->staging_budget().peak_bytes(), 2 * chunk_state);
    EXPECT_LE(e->staging_budget().peak_bytes(), c.strata.budgets.staging_bytes);
  }
  c.strata.overlap = OverlapMode::kExact;
  c.strata.budgets.staging_bytes = chunk_state - 4096;
  const core::Status s = finalize_status(c);
  EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("strata.budgets.staging"), std::string::npos) << s;
  // The ring is the last thing finalize builds, after the initial values: an
  // engine whose finalize failed there is not finalized, and refuses the
  // step's calls instead of running them without an optimizer.
  auto e = Engine::create(c);
  ASSERT_TRUE(e.ok()) << e.status();
  for (const Tensor& t : kTensors) {
    ASSERT_TRUE((*e)->register_param({t.name, t.shape, t.group}, [t](std::span<float> out) {
                      init_values(t, out);
                      return core::Status();
                    }).ok());
  }
  EXPECT_EQ((*e)->finalize().code(), core::StatusCode::kResourceExhausted);
  EXPECT_FALSE((*e)->finalized());
  EXPECT_EQ((*e)->fetch(kTensors[0].group).status().code(), core::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*e)->step_end().status().code(), core::StatusCode::kFailedPrecondition);
  // Once per engine: a retry is refused naming the first failure, and the
  // failed finalize has let go of its swap files and the swap path's lock
  // already (before, a retry found the path held by its own process).
  const core::Status again = (*e)->finalize();
  EXPECT_EQ(again.code(), core::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("strata.budgets.staging"), std::string::npos) << again;
  for (const std::string& path : c.swap_paths()) {
    for (const auto& entry : std::filesystem::directory_iterator(path)) ADD_FAILURE() << "left behind: " << entry.path();
  }
  c.strata.budgets.staging_bytes = 0;
  EXPECT_TRUE(finalize_status(c).ok());  // the same swap path, while the failed engine lives
}

// Traced prefetch: the first step teaches the engine the fetch sequence
// (l1, l2 forward; l2, l1 backward); from the second step on the copies of
// the groups that come next are started ahead and fetch takes them, and the
// backward finds the forward's copies still resident. Evaluation passes
// between steps (two before step 3) are served too and do not unlearn it;
// with overlap "none" nothing is prefetched or kept.
TEST_F(Placement, TracedPrefetchServesTheFetchesThatComeNext) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  for (const OverlapMode mode : {OverlapMode::kExact, OverlapMode::kNone}) {
    c.strata.overlap = mode;
    c.strata.trace = mode == OverlapMode::kExact ? (dir_ / "prefetch_trace.json").string() : "";
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    f.bind(*e);
    for (int s = 0; s < 5; ++s) {
      if (s == 3) {  // evaluation passes between steps
        for (int pass = 0; pass < 2; ++pass) {
          f.batch(999);
          f.load(*e, "l1");
          f.load(*e, "l2");
          f.forward();
        }
      }
      auto st = run_step(*e, f, s);
      ASSERT_TRUE(st.ok()) << st.status();
      // The forward's copies are prefetched (from the second step on); the
      // backward's stay resident since the forward released them (also in
      // the first step), as do the evaluation passes' after their first.
      const bool none = mode == OverlapMode::kNone;
      EXPECT_EQ(st->prefetched, none || s == 0 ? 0 : 2) << "step " << s << (none ? " (none)" : " (exact)");
      EXPECT_EQ(st->resident, none ? 0 : s == 3 ? 6 : 2) << "step " << s << (none ? " (none)" : " (exact)");
      EXPECT_EQ(e->fetch_sequence(), (std::vector<std::string>{"l1", "l2", "l2", "l1"})) << "step " << s;
    }
  }
  std::ifstream in(dir_ / "prefetch_trace.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"prefetch l1\""), std::string::npos);
}

// A copy prefetched during a step must not be served after that step's
// optimizer replaced its source: here an evaluation pass between the
// backward and step_end (on every other step, so that the learned sequence
// does not contain it) runs the trace around into the next forward (its
// fetch of l2 starts a prefetch of l1), and the next step must still see the
// updated l1. Losses and masters equal the sequential schedule's.
TEST_F(Placement, CopiesPrefetchedBeforeStepEndAreNotServedStale) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  std::map<OverlapMode, std::vector<double>> losses;
  std::map<OverlapMode, std::map<std::string, std::vector<float>>> masters;
  for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kExact}) {
    c.strata.overlap = mode;
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    f.bind(*e);
    for (int s = 0; s < 6; ++s) {
      losses[mode].push_back(forward_backward(*e, f, s * 16));
      if (s % 2 == 0) {  // an evaluation pass before step_end, on every other step
        f.load(*e, "l1");
        f.load(*e, "l2");
      }
      const auto st = e->step_end();
      ASSERT_TRUE(st.ok()) << st.status();
    }
    masters[mode] = read_masters(*e);
  }
  EXPECT_EQ(losses[OverlapMode::kNone], losses[OverlapMode::kExact]);
  for (const auto& [name, v] : masters[OverlapMode::kNone]) {
    EXPECT_TRUE(bits_equal(v, masters[OverlapMode::kExact][name])) << name;
  }
}

// The optimizer's failures reach the framework: a state chunk corrupted on
// disk between steps is DATA_LOSS from the optimizer that reads it (under
// "none", from that step_end; under "exact", from the next call that waits
// for it, and from every call after, naming the step), never silent garbage.
TEST_F(Placement, AFailedOptimizerStopsTheEngineWithTheError) {
  for (const OverlapMode mode : {OverlapMode::kNone, OverlapMode::kExact}) {
    SCOPED_TRACE(mode == OverlapMode::kNone ? "none" : "exact");
    Config c = base();
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_param.device = OffloadDevice::kCpu;
    c.strata.overlap = mode;
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    train_one_step(*e, f, 0);
    std::vector<float> v(static_cast<std::size_t>(kOut) * kHidden);
    ASSERT_TRUE(e->read_master("l2.w", v).ok());  // the first step's optimizer has ended
    // Overwrite the start of every swap file (the state blocks live there).
    const std::vector<char> junk(8u << 20, '\x5a');
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir_)) {
      if (!entry.is_regular_file()) continue;
      std::fstream out(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
      out.write(junk.data(),
                static_cast<std::streamsize>(std::min<std::uintmax_t>(junk.size(), entry.file_size())));
    }
    auto st = run_step(*e, f, 1);
    core::Status failed;
    if (mode == OverlapMode::kNone) {
      failed = st.status();
    } else {
      ASSERT_TRUE(st.ok()) << st.status();  // the optimizer runs behind step_end
      failed = e->fetch("l1").status();
      EXPECT_NE(failed.message().find("the engine cannot go on"), std::string::npos) << failed;
      const core::Status again = e->read_master("l2.w", v);
      EXPECT_EQ(again.code(), core::StatusCode::kDataLoss) << again;
    }
    EXPECT_EQ(failed.code(), core::StatusCode::kDataLoss) << failed;
    EXPECT_NE(failed.message().find("step 2"), std::string::npos) << failed;
  }
}

TEST_F(Placement, TightBudgetsPushStateToDiskAndStillTrain) {
  // Compute copies: 295936 bytes; optimizer state: 4 blocks x 12 B = 3 MiB.
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.strata.budgets.device_bytes = 526336;      // the least: the largest group's compute copies and gradients
  c.strata.budgets.pinned_bytes = 5ull << 19;  // 2.5 MiB: below the optimizer state
  const RunResult r = train(c);
  ASSERT_EQ(r.losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());
  EXPECT_EQ(r.traffic.back(), r.expected_bytes);

  // The same budgets with the optimizer state in pinned memory: refused at
  // finalize with the numbers and the key to change.
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const core::Status s = finalize_status(c);
  EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("strata.budgets.pinned"), std::string::npos) << s;
}

// A model far over the budgets: 4096 parameters of 65536 x 65536 (2^44
// elements; listed one by one, its 2^28 chunks of one norm block would take
// over 10 GB). finalize refuses it with the numbers and the budget's key,
// counting from the layout's chunk runs: the chunks are never listed.
TEST_F(Placement, AModelFarOverTheBudgetsIsRefusedBeforeItsChunksAreListed) {
  struct Case {
    std::uint64_t device_bytes;
    std::string expect;
  };
  const Case cases[] = {
      // One group's compute copies fetched to the device and its gradients: 2 x 2^32 x 2 B.
      {2ull << 30, "strata.budgets.device >= 17179869184 (16.00 GiB) works"},
      // The device holds a group; the compute homes alone are 32 TiB of pinned memory.
      {64ull << 30, "strata.budgets.pinned allows 8.00 GiB: strata.budgets.pinned >= "},
  };
  for (const Case& k : cases) {
    Config c = base();
    c.zero.offload_param.device = OffloadDevice::kCpu;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.strata.budgets.device_bytes = k.device_bytes;
    c.strata.budgets.pinned_bytes = 8ull << 30;
    auto created = Engine::create(c);
    ASSERT_TRUE(created.ok()) << created.status();
    Engine& e = **created;
    for (int i = 0; i < 4096; ++i) {
      const std::string name = "w" + std::to_string(i);
      ASSERT_TRUE(e.register_param({name, {65536, 65536}, "l" + std::to_string(i)}, [](std::span<float>) {
                     return core::Status::internal("an initial value was asked for");
                   }).ok());
    }
    const core::Status s = e.finalize();
    EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(k.expect), std::string::npos) << s;
    EXPECT_TRUE(e.layout().chunks.empty());
    EXPECT_EQ(e.layout().groups.size(), 4096u);
    EXPECT_LE(e.layout().chunk_runs.size(), 4 * e.layout().groups.size());
  }
}

// strata.overlap "speculative" keeps a second version of the nvme state: a
// disk budget that holds one version is enough under "exact" and refused at
// finalize under "speculative", saying why.
TEST_F(Placement, SpeculativeUpdatesNeedRoomForTheSecondVersion) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  const std::uint64_t one_version = e->layout().bytes().nvme;
  e.reset();
  c.strata.budgets.disk_bytes = one_version + (one_version / 2);
  EXPECT_TRUE(finalize_status(c).ok());
  c.strata.overlap = OverlapMode::kSpeculative;
  const core::Status s = finalize_status(c);
  EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("two versions"), std::string::npos) << s;
  EXPECT_NE(s.message().find("strata.budgets.disk"), std::string::npos) << s;
}

// Disk: the placement's blocks, aligned (one version, two under "speculative").
TEST_F(Placement, TheSmallestDiskBudgetTheMessageNamesTrains) {
  for (const OverlapMode mode : {OverlapMode::kExact, OverlapMode::kSpeculative}) {
    Config c = base();
    c.strata.overlap = mode;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    Config tiny = c;
    tiny.strata.budgets.disk_bytes = 4096;
    const core::Status s = finalize_status(tiny);
    EXPECT_NE(s.message().find("strata.budgets.disk = 4096 (4.00 KiB) is too small"), std::string::npos) << s;
    expect_least_budget_trains(
        c, "strata.budgets.disk", [](Config& k, std::uint64_t b) { k.strata.budgets.disk_bytes = b; }, 4096);
  }
}

// Device: the state kept on the device plus the most one group's backward
// holds (its compute copies with its gradient buffer) and, beside it, a
// device chunk's update; also with half the optimizer state on the device
// and no clipping, where the optimizer updates device chunks during the
// backward (overlap "exact").
TEST_F(Placement, TheSmallestDeviceBudgetTheMessageNamesTrains) {
  hold_in_backward_ = true;
  struct Case {
    OffloadDevice params, optimizer;
    double ratio, clip;
  };
  const Case cases[] = {{OffloadDevice::kNone, OffloadDevice::kNone, 1.0, 1.0},
                        {OffloadDevice::kCpu, OffloadDevice::kCpu, 1.0, 1.0},
                        {OffloadDevice::kCpu, OffloadDevice::kCpu, 0.5, 0.0},
                        {OffloadDevice::kNone, OffloadDevice::kCpu, 0.5, 0.0}};
  for (const Case& k : cases) {
    SCOPED_TRACE(core::str_cat("ratio ", k.ratio, ", clip ", k.clip));
    Config c = base();
    c.zero.offload_param.device = k.params;
    c.zero.offload_optimizer.device = k.optimizer;
    c.zero.offload_optimizer.ratio = k.ratio;
    c.gradient_clipping = k.clip;
    expect_least_budget_trains(
        c, "strata.budgets.device", [](Config& k2, std::uint64_t b) { k2.strata.budgets.device_bytes = b; },
        4096);
  }
}

// Pinned: the state there, the step's working memory (gradient and compute
// staging, reserved at finalize: engine/working_memory.h) and one slot of
// the disk pipeline's ring, under every schedule and the placements that
// use each part; at that budget the derived ring has one slot.
TEST_F(Placement, TheSmallestPinnedBudgetTheMessageNamesTrains) {
  const std::pair<OffloadDevice, OffloadDevice> placements[] = {
      {OffloadDevice::kCpu, OffloadDevice::kNvme},   // compute copies pinned, optimizer state on nvme
      {OffloadDevice::kNvme, OffloadDevice::kNvme},  // both on nvme: compute staging too
      {OffloadDevice::kCpu, OffloadDevice::kCpu},    // everything pinned, no ring
  };
  for (const auto& [params, optimizer] : placements) {
    for (const OverlapMode mode :
         {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative, OverlapMode::kDelayed}) {
      Config c = base();
      c.strata.overlap = mode;
      c.zero.offload_param.device = params;
      c.zero.offload_optimizer.device = optimizer;
      expect_least_budget_trains(
          c, "strata.budgets.pinned", [](Config& k, std::uint64_t b) { k.strata.budgets.pinned_bytes = b; },
          4096, /*steps=*/4);
    }
  }
}

// offload_param.max_in_cpu keeps l2's compute copies in pinned memory (l1's
// stay on nvme): the least pinned budget counts them, says they are there by
// max_in_cpu, and trains; the compute homes move the same bits wherever they
// are (EveryPlacementGivesTheSameBitsAndItsOwnTraffic).
TEST_F(Placement, ComputeCopiesKeptInCpuMemoryByMaxInCpuCountInThePinnedBudget) {
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.max_in_cpu = 16448;  // l2's home: 32 x 512 + 32, padded
  c.strata.budgets.pinned_bytes = 4096;
  const core::Status s = finalize_status(c);
  ASSERT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("32.12 KiB of it compute copies that zero_optimization.offload_param.max_in_cpu = 16448 "
                             "keeps there"),
            std::string::npos)
      << s;
  c.strata.budgets.pinned_bytes = base().strata.budgets.pinned_bytes;
  for (const OverlapMode mode : {OverlapMode::kExact, OverlapMode::kDelayed}) {
    c.strata.overlap = mode;
    expect_least_budget_trains(
        c, "strata.budgets.pinned", [](Config& k, std::uint64_t b) { k.strata.budgets.pinned_bytes = b; }, 4096,
        /*steps=*/4);
  }
}

// max_in_cpu "auto": finalize keeps the groups (registration order, whole
// homes, one passed over when it does not fit) that fit in what
// strata.budgets.pinned leaves beside the rest of the placement (the disk
// pipeline's ring at its depth). Budgets from the least that works up: none
// kept at first, then l2 alone (32896 B; l1, 263168 B, passed over), then
// both, exactly l1's bytes of budget later; the ring keeps its depth (as
// many slots as under a budget with room to spare) and every one trains the
// same bits. Under strata.frozen_base "files" a group with a frozen
// parameter read from its file is not kept.
TEST_F(Placement, MaxInCpuAutoKeepsWhatThePinnedBudgetLeaves) {
  Config c = base();
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.max_in_cpu_auto = true;
  c.strata.budgets.pinned_bytes = 4096;
  const core::Status tiny = finalize_status(c);
  ASSERT_EQ(tiny.code(), core::StatusCode::kResourceExhausted) << tiny;
  const std::string says = "strata.budgets.pinned >= ";
  const std::string m(tiny.message());
  ASSERT_NE(m.find(says), std::string::npos) << m;
  const std::uint64_t least = std::stoull(m.substr(m.find(says) + says.size()));
  // The groups kept in pinned memory under `budget` (l1 first, then l2) and their elements.
  struct Kept {
    std::vector<bool> groups;
    std::int64_t elems = 0;
    std::size_t ring_slots = 0;
  };
  const auto kept_at = [&](std::uint64_t budget) {
    Config k = c;
    k.strata.budgets.pinned_bytes = budget;
    Kept out;
    auto e = registered(k);
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return out;
    const core::Status fin = e->finalize();
    EXPECT_TRUE(fin.ok()) << budget << ": " << fin;
    for (const GroupPlace& g : e->layout().groups) {
      out.groups.push_back(g.compute_tier == Tier::kPinned);
      if (g.compute_tier == Tier::kPinned) out.elems += g.compute_elems;
    }
    out.ring_slots = e->staging_slots();
    return out;
  };
  // The least budget under which at least `n` groups are kept.
  const auto least_keeping = [&](int n) {
    std::uint64_t lo = least, hi = std::uint64_t{64} << 20;  // keeps fewer at lo; n at hi
    const std::vector<bool> at_hi = kept_at(hi).groups;
    EXPECT_GE(std::count(at_hi.begin(), at_hi.end(), true), n);
    while (hi - lo > 1) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      const std::vector<bool> g = kept_at(mid).groups;
      (std::count(g.begin(), g.end(), true) >= n ? hi : lo) = mid;
    }
    return hi;
  };
  EXPECT_EQ(kept_at(least).groups, (std::vector<bool>{false, false}));
  const std::uint64_t one = least_keeping(1), two = least_keeping(2);
  EXPECT_EQ(kept_at(one).groups, (std::vector<bool>{false, true}));  // l2 alone: l1 passed over
  EXPECT_EQ(kept_at(two).groups, (std::vector<bool>{true, true}));
  EXPECT_EQ(two - one, 131584u * 2);  // l1's home
  const std::size_t depth = kept_at(std::uint64_t{64} << 20).ring_slots;
  EXPECT_GT(depth, 1u);
  for (const std::uint64_t budget : {one, two}) EXPECT_EQ(kept_at(budget).ring_slots, depth) << budget;
  Config none = c;
  none.zero.offload_param.max_in_cpu_auto = false;
  none.strata.budgets.pinned_bytes = 0;
  const RunResult reference = train(none, false, nullptr, -1, 3);
  for (const std::uint64_t budget : {least, one, two}) {
    SCOPED_TRACE(core::str_cat("strata.budgets.pinned ", budget));
    c.strata.budgets.pinned_bytes = budget;
    const RunResult r = train(c, false, nullptr, -1, 3);
    ASSERT_EQ(r.losses.size(), 3u);
    EXPECT_EQ(r.losses, reference.losses);
    expect_same_state(r, reference);
  }
  // "files": l1.w frozen from its file; with room for both homes, l2 alone is kept.
  frozen_ = {"l1.w"};
  weights_dir_ = (dir_ / "base").string();
  ASSERT_NO_FATAL_FAILURE(write_base(weights_dir_));
  c.strata.frozen_base = FrozenBase::kFiles;
  const Kept files = kept_at(std::uint64_t{64} << 20);
  EXPECT_EQ(files.groups, (std::vector<bool>{false, true}));
}

// strata.overlap "delayed" keeps the new compute copies in pinned memory
// until the next step_end: a pinned budget with room for the placement but
// not for them fails finalize under "delayed", saying why.
TEST_F(Placement, DelayedUpdatesNeedPinnedRoomForTheNextCopies) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  const std::uint64_t placement = e->layout().bytes().pinned;
  e.reset();
  c.strata.overlap = OverlapMode::kDelayed;
  c.strata.budgets.pinned_bytes = placement + 4096;
  const core::Status s = finalize_status(c);
  EXPECT_EQ(s.code(), core::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("\"delayed\" holds until the next step_end"), std::string::npos) << s;
  EXPECT_NE(s.message().find("strata.budgets.pinned"), std::string::npos) << s;
}

TEST_F(Placement, FineTunesFromASafetensorsFile) {
  // A "pretrained" model: train, export.
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const std::string pretrained = (dir_ / "pretrained").string();
  {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < 5; ++s) train_one_step(*e, f, s);
    ASSERT_TRUE(e->export_safetensors(pretrained, Precision::kFp32, 0).ok());
  }
  auto reader = SafetensorsReader::open(pretrained + "/model.safetensors");
  ASSERT_TRUE(reader.ok()) << reader.status();
  // Fine-tune: the first layer frozen, its weights streamed in from the file.
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  auto created = Engine::create(c);
  ASSERT_TRUE(created.ok());
  Engine& e = **created;
  for (const Tensor& t : kTensors) {
    const SafetensorsReader* r = &*reader;
    ASSERT_TRUE(e.register_param({t.name, t.shape, t.group, t.group != "l1"}, [r, name = t.name](
                                                                                  std::span<float> out) {
                   return r->read_f32(name, out);
                 }).ok());
  }
  ASSERT_TRUE(e.finalize().ok());
  std::vector<float> w(kHidden * kIn), from_file(kHidden * kIn);
  ASSERT_TRUE(reader->read_f32("l1.w", from_file).ok());
  ASSERT_TRUE(e.read_compute("l1.w", w).ok());
  for (std::size_t i = 0; i < w.size(); i += 101) {
    ASSERT_EQ(w[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(from_file[i]))) << i;
  }
  Framework f;
  f.cb = e.layout().compute_bytes;
  std::vector<double> losses;
  for (int s = 5; s < 15; ++s) {
    f.batch(s * 16);
    f.load(e, "l1");
    f.load(e, "l2");
    losses.push_back(f.forward());
    const auto& g = f.backward(1.0f);
    f.load(e, "l2");
    f.give_grads(e, "l2", g);
    ASSERT_TRUE(e.step_end().ok());
  }
  EXPECT_LT(losses.back(), losses.front());
}

TEST_F(Placement, StatisticsAndTheTimelineTrace) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.strata.trace = (dir_ / "trace.json").string();
  {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    train_one_step(*e, f, 0);
    auto st = run_step(*e, f, 1);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->step, 2);
    EXPECT_GT(st->fetch_s, 0.0);
    EXPECT_GT(st->grads_s, 0.0);
    EXPECT_GT(st->optimizer_s, 0.0);
    EXPECT_GT(st->grad_norm, 0.0);
    EXPECT_GT(st->lr, 0.0);
    EXPECT_EQ(st->loss_scale, 1.0);
  }  // the engine writes its trace when destroyed
  std::ifstream in(c.strata.trace);
  ASSERT_TRUE(in.good()) << "no trace at " << c.strata.trace;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* want : {"\"traceEvents\"", "\"thread_name\"", "\"disk pipeline reads\"", "\"cpu_adam\"",
                           "\"fetch l1\"", "\"gradient pass l2\"", "\"adam chunk 0\"", "\"read chunk 3\"",
                           "\"write chunk 3\"", "\"step 2 group l1\"", "\"h2d\""}) {
    EXPECT_NE(text.find(want), std::string::npos) << want;
  }
}

TEST_F(Placement, EvaluationPassesBetweenStepsChangeNothing) {
  Config c = base();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  std::map<std::string, std::vector<float>> plain, with_eval;
  std::vector<double> eval_losses;
  for (bool eval : {false, true}) {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < 6; ++s) {
      train_one_step(*e, f, s);
      if (eval) {  // forward only, on held-out batches: no gradients, no step
        f.batch(-1 - s);
        f.load(*e, "l1");
        f.load(*e, "l2");
        eval_losses.push_back(f.forward());
      }
    }
    (eval ? with_eval : plain) = read_masters(*e);
  }
  for (const auto& [name, v] : plain) EXPECT_TRUE(bits_equal(with_eval.at(name), v)) << name;
  EXPECT_LT(eval_losses.back(), eval_losses.front());
}

}  // namespace
}  // namespace strata::engine
