// The optimizer state's formats (strata.optimizer_state) end to end: AdamW
// with bf16 moments (both roundings) and with 8-bit blockwise moments trains,
// gives the same bits wherever the state and the compute copies live, under
// every schedule, ISA and thread count; its first step is the fp32 step with
// the moments rounded (bf16) or quantized (int8); its checkpoints keep the
// moments as the engine does (BF16; U8 codes with F32 block scales) and
// resume bit for bit; a checkpoint of another format is converted as it loads.
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

// The moments `wide` as the engine stores them in `format`, read back as
// fp32: bf16 rounded to nearest even, int8 quantized per block of 256 of
// the parameter with the block's absmax (`is_signed`: exp_avg's code table).
std::vector<float> stored(StateFormat format, const std::vector<float>& wide, bool is_signed) {
  std::vector<float> out(wide.size());
  if (format == StateFormat::kBf16) {
    for (std::size_t i = 0; i < wide.size(); ++i) out[i] = nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(wide[i]));
    return out;
  }
  if (format == StateFormat::kFp32) return wide;
  const auto& t = nx::kQuantTables;
  for (std::size_t lo = 0; lo < wide.size(); lo += nx::kQuantBlockElems) {
    const std::size_t hi = std::min(wide.size(), lo + nx::kQuantBlockElems);
    float absmax = 0.0f;
    for (std::size_t i = lo; i < hi; ++i) absmax = nx::absmax_step(absmax, wide[i]);
    const float s = nx::block_scale(absmax);
    for (std::size_t i = lo; i < hi; ++i) {
      out[i] = is_signed ? nx::dequantize_m(t, nx::quantize_m(t, wide[i], s), s)
                         : nx::dequantize_v(t, nx::quantize_v(t, wide[i], s), s);
    }
  }
  return out;
}

// A format and its rounding, named.
struct Format {
  StateFormat format;
  StateRounding rounding = StateRounding::kNearestEven;
  std::string name() const {
    return std::string(to_string(format)) + (format == StateFormat::kBf16 ? " " + std::string(to_string(rounding)) : "");
  }
};
const Format kCompressed[] = {{StateFormat::kBf16, StateRounding::kNearestEven},
                              {StateFormat::kBf16, StateRounding::kStochastic},
                              {StateFormat::kInt8Blockwise}};

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

TEST_F(OptimizerState, CompressedMomentsGiveTheSameBitsUnderEveryPlacementScheduleAndKernel) {
  for (const Format& fmt : kCompressed) {
    SCOPED_TRACE(fmt.name());
    State reference;
    std::vector<double> losses;
    for (const Variant& v : kVariants) {
      SCOPED_TRACE(v.name);
      Config c = with(fmt.format, fmt.rounding);
      c.zero.offload_optimizer.device = v.optimizer;
      c.zero.offload_param.device = v.param;
      c.zero.offload_optimizer.ratio = v.ratio;
      c.strata.optimizer_cpu_fraction = v.cpu_fraction;
      c.strata.overlap = v.overlap;
      c.strata.cpu_adam.isa = v.isa;
      c.strata.cpu_adam.threads = v.threads;
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->layout().optimizer.state_bytes(65536),
                fmt.format == StateFormat::kBf16 ? 8u * 65536 : 6u * 65536 + 8u * 256);
      Framework f;
      std::vector<double> l;
      for (int step = 0; step < 8; ++step) l.push_back(train_one_step(*e, f, step));
      const State s = read_all(*e);
      if (reference.master.empty()) {
        reference = s;
        losses = l;
        EXPECT_LT(l.back(), 0.8 * l.front()) << "the run must learn for the comparison to mean anything";
        for (const Tensor& t : kTensors) {
          if (fmt.format == StateFormat::kBf16) {
            EXPECT_TRUE(all_bf16(s.exp_avg.at(t.name))) << t.name;
            EXPECT_TRUE(all_bf16(s.exp_avg_sq.at(t.name))) << t.name;
          }
          // Stored is stored: the moments read back are their own stored form.
          EXPECT_TRUE(bits_equal(stored(fmt.format, s.exp_avg.at(t.name), true), s.exp_avg.at(t.name))) << t.name;
          EXPECT_TRUE(bits_equal(stored(fmt.format, s.exp_avg_sq.at(t.name), false), s.exp_avg_sq.at(t.name)))
              << t.name;
        }
        continue;
      }
      EXPECT_EQ(l, losses);
      expect_same_bits(s, reference);
    }
  }
}

// The delayed update has its own trajectory: its placements agree among themselves.
TEST_F(OptimizerState, DelayedUpdatesWithCompressedMomentsAgreeAcrossPlacements) {
  for (const Format& fmt : {kCompressed[1], kCompressed[2]}) {
  SCOPED_TRACE(fmt.name());
  State reference;
  for (OffloadDevice optimizer : {OffloadDevice::kCpu, OffloadDevice::kNvme, OffloadDevice::kNone}) {
    SCOPED_TRACE(std::string(to_string(optimizer)));
    Config c = with(fmt.format, fmt.rounding);
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
}

// From zero moments, the first update computes with the same fp32 moments in
// every format: the masters agree bit for bit, and the stored moments are the
// fp32 ones rounded (bf16: to nearest even; stochastically to one of the two
// bf16 neighbours, some up and some down) or quantized per block (int8).
// From then on the runs part.
TEST_F(OptimizerState, TheFirstStepIsTheFp32StepWithItsMomentsRounded) {
  const State fp32 = train(with(StateFormat::kFp32), 1);
  const State nearest = train(with(StateFormat::kBf16), 1);
  const State stochastic = train(with(StateFormat::kBf16, StateRounding::kStochastic), 1);
  const State int8 = train(with(StateFormat::kInt8Blockwise), 1);
  std::int64_t up = 0, down = 0;
  for (const Tensor& t : kTensors) {
    SCOPED_TRACE(t.name);
    EXPECT_TRUE(bits_equal(nearest.master.at(t.name), fp32.master.at(t.name)));
    EXPECT_TRUE(bits_equal(stochastic.master.at(t.name), fp32.master.at(t.name)));
    EXPECT_TRUE(bits_equal(int8.master.at(t.name), fp32.master.at(t.name)));
    for (const auto moments : {&State::exp_avg, &State::exp_avg_sq}) {
      const std::vector<float>& wide = (fp32.*moments).at(t.name);
      const std::vector<float>& rne = (nearest.*moments).at(t.name);
      const std::vector<float>& sr = (stochastic.*moments).at(t.name);
      // int8: each block of 256 of the parameter quantized with its absmax.
      EXPECT_TRUE(bits_equal((int8.*moments).at(t.name), stored(StateFormat::kInt8Blockwise, wide,
                                                                  moments == &State::exp_avg)));
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

TEST_F(OptimizerState, ACheckpointKeepsCompressedMomentsAndResumesBitForBit) {
  for (const Format& fmt : kCompressed) {
    SCOPED_TRACE(fmt.name());
    const std::string ck = (dir_ / ("ck_" + std::to_string(&fmt - kCompressed))).string();
    Config c = with(fmt.format, fmt.rounding);
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    const State straight = train(c, 5);
    {
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int step = 0; step < 3; ++step) train_one_step(*e, f, step);
      ASSERT_TRUE(e->save_checkpoint(ck, {}).ok());
    }
    // The file keeps the moments as the engine did: BF16, 2 bytes an
    // element; or U8 codes with an F32 absmax per block of 256; the master F32.
    {
      auto r = SafetensorsReader::open(ck + "/step-3/state.safetensors");
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_NE(r->find("l1.w.exp_avg"), nullptr);
      const bool int8 = fmt.format == StateFormat::kInt8Blockwise;
      const TensorDtype want = int8 ? TensorDtype::kU8 : TensorDtype::kBf16;
      EXPECT_EQ(r->find("l1.w.exp_avg")->dtype, want);
      EXPECT_EQ(r->find("l1.w.exp_avg_sq")->dtype, want);
      EXPECT_EQ(r->find("l1.w.exp_avg_sq")->nbytes, static_cast<std::uint64_t>(kHidden) * kIn * (int8 ? 1 : 2));
      EXPECT_EQ(r->find("l1.w.master")->dtype, TensorDtype::kF32);
      EXPECT_EQ(r->find("l1.w.exp_avg.absmax") != nullptr, int8);
      if (int8) {
        EXPECT_EQ(r->find("l1.w.exp_avg_sq.absmax")->nbytes, static_cast<std::uint64_t>(kHidden) * kIn / 256 * 4);
        EXPECT_EQ(r->find("l2.b.exp_avg.absmax")->nbytes, 4u);  // 32 elements: one short block
      }
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

// A checkpoint saved in one format loads into an engine of any other: the
// saved moments are read back as fp32 (bf16 exactly, int8 codes as a step
// dequantizes them) and stored the engine's way (fp32 as they are, bf16
// rounded to nearest even, int8 quantized per block); the masters come back
// as saved either way.
TEST_F(OptimizerState, ACheckpointOfAnotherFormatIsConvertedAsItLoads) {
  constexpr StateFormat kAll[] = {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kInt8Blockwise};
  for (StateFormat saved : kAll) {
  for (StateFormat loaded : kAll) {
    if (loaded == saved) continue;
    SCOPED_TRACE(std::string("saved ") + std::string(to_string(saved)) + ", loaded " + std::string(to_string(loaded)));
    const std::string ck = (dir_ / ("ck_" + std::string(to_string(saved)) + "_" + std::string(to_string(loaded)))).string();
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
        // What was read back (the saved format's values, widened exactly),
        // stored the loading engine's way.
        const std::vector<float>& was = (before.*moments).at(t.name);
        const std::vector<float>& now = (after.*moments).at(t.name);
        ASSERT_EQ(was.size(), now.size());
        EXPECT_TRUE(bits_equal(now, stored(loaded, was, moments == &State::exp_avg)));
      }
    }
    // It trains on from there.
    Framework f;
    for (int step = 3; step < 5; ++step) train_one_step(*e, f, step);
  }
  }
}

}  // namespace
}  // namespace strata::engine
