// The learning-rate schedules and the loss scaler against values worked out
// by hand from DeepSpeed's definitions (restated here, not called).
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"

namespace strata::engine {
namespace {

SchedulerConfig warmup(SchedulerType type, WarmupType wt, std::int64_t warmup_steps, std::int64_t total = 0) {
  SchedulerConfig c;
  c.type = type;
  c.warmup_type = wt;
  c.warmup_num_steps = warmup_steps;
  c.warmup_min_lr = 1e-5;
  c.warmup_max_lr = 1e-3;
  c.total_num_steps = total;
  return c;
}

TEST(LrSchedule, NoSchedulerIsTheOptimizerLr) {
  auto s = LrSchedule::create({}, 3e-4);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->lr_for_step(1), 3e-4);
  EXPECT_EQ(s->lr_for_step(100000), 3e-4);
}

TEST(LrSchedule, WarmupLrLogAndLinear) {
  auto log = LrSchedule::create(warmup(SchedulerType::kWarmupLR, WarmupType::kLog, 1000), 0.1);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_DOUBLE_EQ(log->lr_for_step(1), 1e-5);                 // iteration 0: log(1) = 0
  EXPECT_NEAR(log->lr_at(9), 1e-5 + (1e-3 - 1e-5) / 3.0, 1e-15);  // log(10) / log(1000)
  EXPECT_NEAR(log->lr_at(99), 1e-5 + (1e-3 - 1e-5) * 2.0 / 3.0, 1e-15);
  EXPECT_DOUBLE_EQ(log->lr_at(1000), 1e-3);
  EXPECT_DOUBLE_EQ(log->lr_at(50000), 1e-3);  // stays at the peak

  auto lin = LrSchedule::create(warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 100), 0.1);
  ASSERT_TRUE(lin.ok());
  EXPECT_DOUBLE_EQ(lin->lr_at(0), 1e-5);
  EXPECT_NEAR(lin->lr_at(25), 1e-5 + (1e-3 - 1e-5) * 0.25, 1e-15);
  EXPECT_DOUBLE_EQ(lin->lr_at(100), 1e-3);
  // step k is iteration k - 1
  EXPECT_EQ(lin->lr_for_step(26), lin->lr_at(25));
}

TEST(LrSchedule, WarmupNumStepsBelowTwoIsTwo) {
  // DeepSpeed clamps warmup_num_steps to at least 2 (its log warmup divides by log(steps)).
  auto s = LrSchedule::create(warmup(SchedulerType::kWarmupLR, WarmupType::kLinear, 0), 0.1);
  ASSERT_TRUE(s.ok());
  EXPECT_DOUBLE_EQ(s->lr_at(0), 1e-5);
  EXPECT_NEAR(s->lr_at(1), 1e-5 + (1e-3 - 1e-5) * 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s->lr_at(2), 1e-3);
}

TEST(LrSchedule, WarmupDecayLrFallsLinearlyToZero) {
  auto s = LrSchedule::create(warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLinear, 10, 110), 0.1);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->lr_at(10), 1e-5 + (1e-3 - 1e-5) * 1.0);  // (110 - 10) / 100
  EXPECT_NEAR(s->lr_at(60), 1e-5 + (1e-3 - 1e-5) * 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s->lr_at(110), 1e-5);  // gamma 0: the minimum
  EXPECT_DOUBLE_EQ(s->lr_at(500), 1e-5);  // never negative
}

TEST(LrSchedule, WarmupCosineLr) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupCosineLR, WarmupType::kLinear, 10, 110);
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 0.01;
  auto s = LrSchedule::create(c, 2e-3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_DOUBLE_EQ(s->lr_at(0), 2e-3 * 0.1);
  EXPECT_NEAR(s->lr_at(5), 2e-3 * (0.1 + 0.5 * 0.9), 1e-15);
  // After warmup: ratio = cos_min + (1 - cos_min) (1 + cos(pi (it - W + 1) / (T - W))) / 2.
  auto expect = [&](std::int64_t it) {
    const double r = (1.0 + std::cos(std::numbers::pi * static_cast<double>(it - 10 + 1) / 100.0)) / 2.0;
    return 2e-3 * (0.01 + 0.99 * r);
  };
  for (std::int64_t it : {10, 11, 59, 60, 108, 109}) EXPECT_NEAR(s->lr_at(it), expect(it), 1e-15) << it;
  EXPECT_NEAR(s->lr_at(109), 2e-3 * 0.01, 1e-15);  // (1 + cos(pi)) / 2 = 0
}

TEST(LrSchedule, ErrorsNameTheKey) {
  struct Case {
    SchedulerConfig config;
    double lr;
    std::string expect;
  };
  SchedulerConfig cos_short = warmup(SchedulerType::kWarmupCosineLR, WarmupType::kLog, 100, 100);
  SchedulerConfig cos_ratio = warmup(SchedulerType::kWarmupCosineLR, WarmupType::kLog, 10, 100);
  cos_ratio.cos_min_ratio = 1.5;
  SchedulerConfig neg_min = warmup(SchedulerType::kWarmupLR, WarmupType::kLog, 10);
  neg_min.warmup_min_lr = -1.0;
  const std::vector<Case> cases = {
      {warmup(SchedulerType::kWarmupDecayLR, WarmupType::kLog, 10, 0), 1e-3, "scheduler.params.total_num_steps"},
      {cos_short, 1e-3, "scheduler.params.total_num_steps = 100"},
      {cos_ratio, 1e-3, "scheduler.params.cos_min_ratio = 1.5"},
      {neg_min, 1e-3, "scheduler.params.warmup_min_lr = -1"},
      {warmup(SchedulerType::kWarmupLR, WarmupType::kLog, -5), 1e-3, "scheduler.params.warmup_num_steps = -5"},
      {{}, -1.0, "optimizer.params.lr = -1"},
  };
  for (const Case& c : cases) {
    auto s = LrSchedule::create(c.config, c.lr);
    ASSERT_FALSE(s.ok()) << c.expect;
    EXPECT_EQ(s.status().code(), core::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(c.expect), std::string::npos) << s.status();
  }
}

Fp16Config dynamic_fp16(int power, std::int64_t window, int hysteresis, bool consecutive, double min_scale) {
  Fp16Config c;
  c.enabled = true;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.consecutive_hysteresis = consecutive;
  c.min_loss_scale = min_scale;
  return c;
}

struct Expect {
  bool overflow;
  LossScaler::Outcome outcome;
  double scale_after;
};

void run_script(LossScaler& s, const std::vector<Expect>& script) {
  for (size_t i = 0; i < script.size(); ++i) {
    auto r = s.update(script[i].overflow);
    ASSERT_TRUE(r.ok()) << "update " << i << ": " << r.status();
    EXPECT_EQ(*r, script[i].outcome) << "update " << i;
    EXPECT_EQ(s.scale(), script[i].scale_after) << "update " << i;
  }
}

constexpr auto kApply = LossScaler::Outcome::kApply;
constexpr auto kSkip = LossScaler::Outcome::kSkip;

TEST(LossScaler, DynamicWithHysteresisFollowsDeepSpeed) {
  // Worked by hand: hysteresis 2, window 3, scale 2^4.
  auto s = LossScaler::create(dynamic_fp16(4, 3, 2, false, 1.0));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->dynamic());
  EXPECT_EQ(s->scale(), 16.0);
  run_script(*s, {
                     {true, kSkip, 16.0},    // it 0: hysteresis 2 -> 1, scale kept
                     {true, kSkip, 8.0},     // it 1: hysteresis spent: halve
                     {false, kApply, 8.0},   // it 2: 1 since the overflow
                     {false, kApply, 8.0},   // it 3: 2
                     {false, kApply, 16.0},  // it 4: 3 = window: double, hysteresis back to 2
                     {true, kSkip, 16.0},    // it 5: hysteresis 2 -> 1
                     {false, kApply, 16.0},  // it 6: no refill without consecutive_hysteresis
                     {true, kSkip, 8.0},     // it 7: hysteresis spent: halve
                 });
  EXPECT_EQ(s->state().iteration, 8);
  EXPECT_EQ(s->state().last_overflow_iteration, 7);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsAfterEveryGoodStep) {
  auto s = LossScaler::create(dynamic_fp16(4, 3, 2, true, 1.0));
  ASSERT_TRUE(s.ok());
  run_script(*s, {
                     {true, kSkip, 16.0},    // hysteresis 2 -> 1
                     {false, kApply, 16.0},  // refilled to 2
                     {true, kSkip, 16.0},    // 2 -> 1 again: no halving
                     {true, kSkip, 8.0},     // spent
                 });
}

TEST(LossScaler, OverflowAtTheMinimumIsAnErrorThatChangesNothing) {
  auto s = LossScaler::create(dynamic_fp16(3, 1000, 1, false, 4.0));
  ASSERT_TRUE(s.ok());
  run_script(*s, {{true, kSkip, 4.0}});
  const LossScaler::State before = s->state();
  auto r = s->update(true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), core::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("fp16.min_loss_scale"), std::string::npos) << r.status();
  EXPECT_EQ(s->state(), before);
  run_script(*s, {{false, kApply, 4.0}});  // a good step still works
}

TEST(LossScaler, HalvingStopsAtTheMinimum) {
  auto s = LossScaler::create(dynamic_fp16(3, 1000, 1, false, 5.0));
  ASSERT_TRUE(s.ok());
  run_script(*s, {{true, kSkip, 5.0}});  // 8 / 2 = 4, raised to the minimum 5
}

TEST(LossScaler, StaticAndDisabled) {
  Fp16Config st;
  st.enabled = true;
  st.loss_scale = 128.0;
  auto s = LossScaler::create(st);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->dynamic());
  run_script(*s, {{true, kSkip, 128.0}, {false, kApply, 128.0}, {true, kSkip, 128.0}});

  auto off = LossScaler::create(Fp16Config{});
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->scale(), 1.0);
  run_script(*off, {{false, kApply, 1.0}, {true, kSkip, 1.0}});
}

TEST(LossScaler, RestoreRoundTripsAndRejectsImpossibleStates) {
  auto a = LossScaler::create(dynamic_fp16(10, 2, 3, false, 1.0));
  ASSERT_TRUE(a.ok());
  for (bool o : {true, false, false, true, true, false}) ASSERT_TRUE(a->update(o).ok());
  auto b = LossScaler::create(dynamic_fp16(10, 2, 3, false, 1.0));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->restore(a->state()).ok());
  for (bool o : {false, true, true, true, false, false, false}) {
    auto ra = a->update(o);
    auto rb = b->update(o);
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_EQ(*ra, *rb);
    EXPECT_EQ(a->state(), b->state());
  }
  LossScaler::State bad = a->state();
  bad.hysteresis_left = 4;
  EXPECT_EQ(b->restore(bad).code(), core::StatusCode::kInvalidArgument);
  bad = a->state();
  bad.scale = 0.0;
  EXPECT_EQ(b->restore(bad).code(), core::StatusCode::kInvalidArgument);
  bad = a->state();
  bad.last_overflow_iteration = bad.iteration;
  EXPECT_EQ(b->restore(bad).code(), core::StatusCode::kInvalidArgument);
}

TEST(LossScaler, ConfigErrorsNameTheKey) {
  const std::vector<std::pair<Fp16Config, std::string>> cases = {
      {dynamic_fp16(200, 1000, 2, false, 1.0), "fp16.initial_scale_power = 200"},
      {dynamic_fp16(16, 0, 2, false, 1.0), "fp16.loss_scale_window = 0"},
      {dynamic_fp16(16, 1000, 0, false, 1.0), "fp16.hysteresis = 0"},
      {dynamic_fp16(16, 1000, 2, false, 0.0), "fp16.min_loss_scale = 0"},
      {[] {
         Fp16Config c;
         c.enabled = true;
         c.loss_scale = -2.0;
         return c;
       }(),
       "fp16.loss_scale = -2"},
  };
  for (const auto& [config, expect] : cases) {
    auto s = LossScaler::create(config);
    ASSERT_FALSE(s.ok()) << expect;
    EXPECT_NE(s.status().message().find(expect), std::string::npos) << s.status();
  }
}

}  // namespace
}  // namespace strata::engine
