// The optimizer state's formats (strata.optimizer_state) end to end: AdamW
// with bf16 moments trains, gives the same bits wherever the state and the
// compute copies live, under every schedule, ISA and thread count, for both
// roundings; its first step is the fp32 step with the moments rounded; its
// checkpoints keep the moments as BF16 tensors and resume bit for bit; a
// checkpoint of the other format is converted as it loads.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary
namespace nx = core::numerics;

using Arrays = std::map<std::string, std::vector<float>>;

// A run's masters and moments (read_state widens bf16 moments to fp32).
struct State {
  Arrays master, exp_avg, exp_avg_sq;
};

State read_all(Engine& e) {
  State s;
  s.master = read_masters(e);
  for (const Tensor& t : kTensors) {
    std::vector<float> v(s.master.at(t.name).size());
    EXPECT_TRUE(e.read_state(t.name, 1, v).ok());
    s.exp_avg[t.name] = v;
    EXPECT_TRUE(e.read_state(t.name, 2, v).ok());
    s.exp_avg_sq[t.name] = v;
  }
  return s;
}

void expect_same_bits(const State& got, const State& want) {
  for (const Tensor& t : kTensors) {
    EXPECT_TRUE(bits_equal(got.master.at(t.name), want.master.at(t.name))) << "master " << t.name;
    EXPECT_TRUE(bits_equal(got.exp_avg.at(t.name), want.exp_avg.at(t.name))) << "exp_avg " << t.name;
    EXPECT_TRUE(bits_equal(got.exp_avg_sq.at(t.name), want.exp_avg_sq.at(t.name))) << "exp_avg_sq " << t.name;
  }
}

// Every value is a bf16 (its low 16 bits are zero).
bool all_bf16(const std::vector<float>& v) {
  for (float x : v) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0xffffu) != 0) return false;
  }
  return true;
}

class OptimizerState : public MlpTest {
 protected:
  Config with(StateFormat format, StateRounding rounding = StateRounding::kNearestEven) const {
    Config c = base();
    c.strata.optimizer_state.format = format;
    c.strata.optimizer_state.rounding = rounding;
    c.strata.seed = 1234;
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    return c;
  }
  State train(const Config& c, int steps) {
    auto e = make_mlp_engine(c);
    EXPECT_NE(e, nullptr);
    if (e == nullptr) return {};
    Framework f;
    for (int step = 0; step < steps; ++step) train_one_step(*e, f, step);
    return read_all(*e);
  }
};

// One placement or schedule of the bit-identity test.
struct Variant {
  const char* name;
  OffloadDevice optimizer, param;
  double ratio = 1.0, cpu_fraction = 0.0;
  OverlapMode overlap = OverlapMode::kExact;
  CpuAdamIsa isa = CpuAdamIsa::kAuto;
  int threads = 1;
};

const Variant kVariants[] = {
    {"state and compute copies in pinned memory", OffloadDevice::kCpu, OffloadDevice::kCpu},
    {"state on the device", OffloadDevice::kNone, OffloadDevice::kNone},
    {"half the state on the device (ratio)", OffloadDevice::kCpu, OffloadDevice::kNone, 0.5},
    {"state on nvme", OffloadDevice::kNvme, OffloadDevice::kNone},
    {"everything on nvme", OffloadDevice::kNvme, OffloadDevice::kNvme},
    {"state split pinned/nvme", OffloadDevice::kNvme, OffloadDevice::kCpu, 1.0, 0.5},
    {"no overlap", OffloadDevice::kCpu, OffloadDevice::kCpu, 1.0, 0.0, OverlapMode::kNone},
    {"speculative, state on nvme", OffloadDevice::kNvme, OffloadDevice::kCpu, 1.0, 0.0, OverlapMode::kSpeculative},
    {"scalar kernel", OffloadDevice::kCpu, OffloadDevice::kNone, 1.0, 0.0, OverlapMode::kExact, CpuAdamIsa::kScalar},
    {"the widest kernel, two threads", OffloadDevice::kNvme, OffloadDevice::kNone, 1.0, 0.0, OverlapMode::kExact,
     CpuAdamIsa::kAuto, 2},
};

TEST_F(OptimizerState, Bf16MomentsGiveTheSameBitsUnderEveryPlacementScheduleAndKernel) {
  for (StateRounding rounding : {StateRounding::kNearestEven, StateRounding::kStochastic}) {
    SCOPED_TRACE(std::string(to_string(rounding)));
    State reference;
    std::vector<double> losses;
    for (const Variant& v : kVariants) {
      SCOPED_TRACE(v.name);
      Config c = with(StateFormat::kBf16, rounding);
      c.zero.offload_optimizer.device = v.optimizer;
      c.zero.offload_param.device = v.param;
      c.zero.offload_optimizer.ratio = v.ratio;
      c.strata.optimizer_cpu_fraction = v.cpu_fraction;
      c.strata.overlap = v.overlap;
      c.strata.cpu_adam.isa = v.isa;
      c.strata.cpu_adam.threads = v.threads;
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->layout().optimizer.bytes_per_elem(), 8u);
      Framework f;
      std::vector<double> l;
      for (int step = 0; step < 8; ++step) l.push_back(train_one_step(*e, f, step));
      const State s = read_all(*e);
      if (reference.master.empty()) {
        reference = s;
        losses = l;
        EXPECT_LT(l.back(), 0.8 * l.front()) << "the run must learn for the comparison to mean anything";
        for (const Tensor& t : kTensors) {
          EXPECT_TRUE(all_bf16(s.exp_avg.at(t.name))) << t.name;
          EXPECT_TRUE(all_bf16(s.exp_avg_sq.at(t.name))) << t.name;
        }
        continue;
      }
      EXPECT_EQ(l, losses);
      expect_same_bits(s, reference);
    }
  }
}

// The delayed update has its own trajectory: its placements agree among themselves.
TEST_F(OptimizerState, DelayedUpdatesWithBf16MomentsAgreeAcrossPlacements) {
  State reference;
  for (OffloadDevice optimizer : {OffloadDevice::kCpu, OffloadDevice::kNvme, OffloadDevice::kNone}) {
    SCOPED_TRACE(std::string(to_string(optimizer)));
    Config c = with(StateFormat::kBf16, StateRounding::kStochastic);
    c.strata.overlap = OverlapMode::kDelayed;
    c.zero.offload_optimizer.device = optimizer;
    const State s = train(c, 6);
    if (reference.master.empty()) {
      reference = s;
      continue;
    }
    expect_same_bits(s, reference);
  }
}

// From zero moments, the first update computes with the same fp32 moments in
// both formats: the masters agree bit for bit, and the bf16 moments are the
// fp32 ones rounded (to nearest even; stochastically to one of the two bf16
// neighbours, some up and some down). From then on the runs part.
TEST_F(OptimizerState, TheFirstStepIsTheFp32StepWithItsMomentsRounded) {
  const State fp32 = train(with(StateFormat::kFp32), 1);
  const State nearest = train(with(StateFormat::kBf16), 1);
  const State stochastic = train(with(StateFormat::kBf16, StateRounding::kStochastic), 1);
  std::int64_t up = 0, down = 0;
  for (const Tensor& t : kTensors) {
    SCOPED_TRACE(t.name);
    EXPECT_TRUE(bits_equal(nearest.master.at(t.name), fp32.master.at(t.name)));
    EXPECT_TRUE(bits_equal(stochastic.master.at(t.name), fp32.master.at(t.name)));
    for (const auto moments : {&State::exp_avg, &State::exp_avg_sq}) {
      const std::vector<float>& wide = (fp32.*moments).at(t.name);
      const std::vector<float>& rne = (nearest.*moments).at(t.name);
      const std::vector<float>& sr = (stochastic.*moments).at(t.name);
      for (std::size_t i = 0; i < wide.size(); ++i) {
        ASSERT_EQ(rne[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(wide[i]))) << i;
        // The bf16 at or below |x| and the next one away from zero.
        std::uint32_t u;
        std::memcpy(&u, &wide[i], 4);
        const float below = nx::bf16_bits_to_fp32(static_cast<std::uint16_t>(u >> 16));
        const float above = nx::bf16_bits_to_fp32(static_cast<std::uint16_t>((u >> 16) + 1));
        if (below == wide[i]) {
          ASSERT_EQ(sr[i], wide[i]) << i;
        } else {
          ASSERT_TRUE(sr[i] == below || sr[i] == above) << i << ": " << wide[i] << " -> " << sr[i];
          (sr[i] == below ? down : up) += 1;
        }
      }
    }
  }
  EXPECT_GT(up, 1000);
  EXPECT_GT(down, 1000);
  // A second step parts them: the masters now see the rounded moments.
  const State fp32_2 = train(with(StateFormat::kFp32), 2);
  const State nearest_2 = train(with(StateFormat::kBf16), 2);
  EXPECT_FALSE(bits_equal(nearest_2.master.at("l1.w"), fp32_2.master.at("l1.w")));
}

// Stochastic rounding draws from strata.seed: another seed, other bits.
TEST_F(OptimizerState, StochasticRoundingFollowsTheSeed) {
  Config c = with(StateFormat::kBf16, StateRounding::kStochastic);
  const State a = train(c, 3);
  EXPECT_TRUE(bits_equal(train(c, 3).master.at("l1.w"), a.master.at("l1.w")));
  c.strata.seed = 1235;
  EXPECT_FALSE(bits_equal(train(c, 3).master.at("l1.w"), a.master.at("l1.w")));
}

TEST_F(OptimizerState, ACheckpointKeepsBf16MomentsAndResumesBitForBit) {
  for (StateRounding rounding : {StateRounding::kNearestEven, StateRounding::kStochastic}) {
    SCOPED_TRACE(std::string(to_string(rounding)));
    const std::string ck = (dir_ / ("ck_" + std::string(to_string(rounding)))).string();
    Config c = with(StateFormat::kBf16, rounding);
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    const State straight = train(c, 5);
    {
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int step = 0; step < 3; ++step) train_one_step(*e, f, step);
      ASSERT_TRUE(e->save_checkpoint(ck, {}).ok());
    }
    // The file keeps the moments as the engine did: BF16, 2 bytes an element; the master F32.
    {
      auto r = SafetensorsReader::open(ck + "/step-3/state.safetensors");
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_NE(r->find("l1.w.exp_avg"), nullptr);
      EXPECT_EQ(r->find("l1.w.exp_avg")->dtype, TensorDtype::kBf16);
      EXPECT_EQ(r->find("l1.w.exp_avg_sq")->dtype, TensorDtype::kBf16);
      EXPECT_EQ(r->find("l1.w.exp_avg_sq")->nbytes, static_cast<std::uint64_t>(kHidden) * kIn * 2);
      EXPECT_EQ(r->find("l1.w.master")->dtype, TensorDtype::kF32);
    }
    // Loaded under another placement (the state in pinned memory), two more steps.
    Config other = c;
    other.zero.offload_optimizer.device = OffloadDevice::kCpu;
    auto e = make_mlp_engine(other);
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->load_checkpoint(ck).ok());
    Framework f;
    for (int step = 3; step < 5; ++step) train_one_step(*e, f, step);
    expect_same_bits(read_all(*e), straight);
  }
}

// A checkpoint saved in one format loads into an engine of the other: bf16
// moments widen exactly, fp32 ones round to nearest even; the masters come
// back as saved either way.
TEST_F(OptimizerState, ACheckpointOfTheOtherFormatIsConvertedAsItLoads) {
  for (StateFormat saved : {StateFormat::kFp32, StateFormat::kBf16}) {
    const StateFormat loaded = saved == StateFormat::kFp32 ? StateFormat::kBf16 : StateFormat::kFp32;
    SCOPED_TRACE(std::string("saved ") + std::string(to_string(saved)));
    const std::string ck = (dir_ / ("ck_" + std::string(to_string(saved)))).string();
    State before;
    {
      auto e = make_mlp_engine(with(saved));
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int step = 0; step < 3; ++step) train_one_step(*e, f, step);
      before = read_all(*e);
      ASSERT_TRUE(e->save_checkpoint(ck, {}).ok());
    }
    Config c = with(loaded);
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->load_checkpoint(ck).ok());
    const State after = read_all(*e);
    for (const Tensor& t : kTensors) {
      SCOPED_TRACE(t.name);
      EXPECT_TRUE(bits_equal(after.master.at(t.name), before.master.at(t.name)));
      for (const auto moments : {&State::exp_avg, &State::exp_avg_sq}) {
        const std::vector<float>& was = (before.*moments).at(t.name);
        const std::vector<float>& now = (after.*moments).at(t.name);
        ASSERT_EQ(was.size(), now.size());
        for (std::size_t i = 0; i < was.size(); ++i) {
          const float want = loaded == StateFormat::kBf16 ? nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(was[i]))
                                                          : was[i];
          ASSERT_EQ(now[i], want) << i;
        }
      }
    }
    // It trains on from there.
    Framework f;
    for (int step = 3; step < 5; ++step) train_one_step(*e, f, step);
  }
}

}  // namespace
}  // namespace strata::engine
