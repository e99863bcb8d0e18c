// Lion and Adagrad through the optimizer seam (engine/optimizer_spec.h): they
// train, give the same bits wherever the state and the compute copies live
// and under every schedule, keep only their own arrays (read_state, the
// checkpoint's tensors), resume bit for bit, and refuse a checkpoint of
// another optimizer.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary

class OptimizersTest : public MlpTest {
 protected:
  Config with(OptimizerType type) const {
    Config c = base();
    c.optimizer.type = type;
    c.optimizer.lr = type == OptimizerType::kLion ? 3e-4 : 3e-3;
    c.optimizer.beta2 = 0.99;
    c.optimizer.eps = 1e-10;
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    return c;
  }
  static std::string name_of(OptimizerType t) { return std::string(to_string(t)); }
};

constexpr OptimizerType kTypes[] = {OptimizerType::kLion, OptimizerType::kAdagrad};

// "delayed" computes with the weights from before the last step (its own
// trajectory), so its runs are compared among themselves.
TEST_F(OptimizersTest, TheyTrainAndEveryPlacementAndScheduleGivesTheSameBits) {
  for (OptimizerType type : kTypes) {
    SCOPED_TRACE(name_of(type));
    std::map<bool, std::map<std::string, std::vector<float>>> base_masters;  // by "delayed"
    for (OverlapMode mode : {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative,
                             OverlapMode::kDelayed}) {
      // The state on the device, half on the device and half in pinned memory, pinned, nvme.
      for (int state = 0; state < 4; ++state) {
        for (OffloadDevice compute : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme}) {
          SCOPED_TRACE(std::string(to_string(mode)) + ", state " + std::to_string(state) + ", compute copies " +
                       std::string(to_string(compute)));
          Config c = with(type);
          c.strata.overlap = mode;
          c.zero.offload_optimizer.device =
              state == 0 ? OffloadDevice::kNone : state == 3 ? OffloadDevice::kNvme : OffloadDevice::kCpu;
          if (state == 1) c.zero.offload_optimizer.ratio = 0.5;
          c.zero.offload_param.device = compute;
          auto e = make_mlp_engine(c);
          ASSERT_NE(e, nullptr);
          Framework f;
          const double first = train_one_step(*e, f, 0);
          for (int step = 1; step < 6; ++step) train_one_step(*e, f, step);
          const auto masters = read_masters(*e);
          auto& base = base_masters[mode == OverlapMode::kDelayed];
          if (base.empty()) {
            base = masters;
            // The first batch again, with the trained weights.
            f.batch(0);
            f.load(*e, "l1");
            f.load(*e, "l2");
            EXPECT_LT(f.forward(), first) << "the run must learn for the comparison to mean anything";
            continue;
          }
          for (const Tensor& t : kTensors) EXPECT_TRUE(bits_equal(masters.at(t.name), base.at(t.name))) << t.name;
        }
      }
    }
  }
}

TEST_F(OptimizersTest, EachKeepsOnlyItsOwnArrays) {
  for (OptimizerType type : kTypes) {
    SCOPED_TRACE(name_of(type));
    auto e = make_mlp_engine(with(type));
    ASSERT_NE(e, nullptr);
    Framework f;
    train_one_step(*e, f, 0);
    std::vector<float> v(kOut);
    ASSERT_TRUE(e->read_state("l2.b", 1, v).ok());
    bool moved = false;
    for (float x : v) moved = moved || x != 0.0f;
    EXPECT_TRUE(moved) << "the optimizer's array stays zero after a step";
    const core::Status two = e->read_state("l2.b", 2, v);
    EXPECT_EQ(two.code(), core::StatusCode::kInvalidArgument) << two;
    EXPECT_NE(two.message().find("keeps 2"), std::string_view::npos) << two;
  }
}

TEST_F(OptimizersTest, ACheckpointResumesBitForBitAndOnlyWithItsOwnOptimizer) {
  for (OptimizerType type : kTypes) {
    SCOPED_TRACE(name_of(type));
    const std::string ck = (dir_ / ("ck_" + name_of(type))).string();
    Config c = with(type);
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    // Straight through: 5 steps.
    std::map<std::string, std::vector<float>> straight;
    {
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int step = 0; step < 5; ++step) train_one_step(*e, f, step);
      straight = read_masters(*e);
    }
    // 3 steps, saved; a new engine (the state in pinned memory) loads and runs 2 more.
    {
      auto e = make_mlp_engine(c);
      ASSERT_NE(e, nullptr);
      Framework f;
      for (int step = 0; step < 3; ++step) train_one_step(*e, f, step);
      ASSERT_TRUE(e->save_checkpoint(ck, {}).ok());
    }
    Config other = c;
    other.zero.offload_optimizer.device = OffloadDevice::kCpu;
    auto e = make_mlp_engine(other);
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->load_checkpoint(ck).ok());
    Framework f;
    for (int step = 3; step < 5; ++step) train_one_step(*e, f, step);
    const auto resumed = read_masters(*e);
    for (const Tensor& t : kTensors) EXPECT_TRUE(bits_equal(resumed.at(t.name), straight.at(t.name))) << t.name;

    // Another optimizer refuses it, naming what the file holds, and keeps its own state.
    Config adamw = other;
    adamw.optimizer.type = OptimizerType::kAdamW;
    auto a = make_mlp_engine(adamw);
    ASSERT_NE(a, nullptr);
    const auto before = read_masters(*a);
    const auto refused = a->load_checkpoint(ck);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), core::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_NE(refused.status().message().find("saved with another optimizer"), std::string_view::npos)
        << refused.status();
    const auto after = read_masters(*a);
    for (const Tensor& t : kTensors) EXPECT_TRUE(bits_equal(after.at(t.name), before.at(t.name))) << t.name;
  }
}

}  // namespace
}  // namespace strata::engine
