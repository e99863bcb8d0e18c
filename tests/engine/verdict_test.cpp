// The step's verdict (engine/step/verdict.h): skip, clipping, the fp16 loss
// scaler, deferred verdicts, the learning rate and the constants per
// optimizer group, checked against core/numerics.h's formulas directly.
#include "engine/step/verdict.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace strata::engine {
namespace {

namespace nx = core::numerics;

Config bf16_config() {
  Config c;
  c.precision = Precision::kBf16;
  c.optimizer.lr = 1e-3;
  c.gradient_accumulation_steps = 2;
  return c;
}

Verdict make(const Config& c) {
  auto scaler = LossScaler::create(c.precision == Precision::kFp16 ? c.fp16 : Fp16Config{});
  auto schedule = LrSchedule::create(c.scheduler, c.optimizer.lr);
  EXPECT_TRUE(scaler.ok() && schedule.ok());
  return Verdict(c, std::move(scaler).value(), std::move(schedule).value());
}

const std::vector<OptimizerGroupDesc> kGroups = {{"default", 0.01, 1.0}, {"no_decay", 0.0, 0.5}};

bool same(const nx::AdamStepConstants& a, const nx::AdamStepConstants& b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

TEST(Verdict, FiniteGradientsApplyWithTheUnscaledAveragedNorm) {
  const Config c = bf16_config();
  Verdict v = make(c);
  auto d = v.decide(8.0, false);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->skip);
  EXPECT_DOUBLE_EQ(d->grad_norm, 4.0);  // / gradient_accumulation_steps, loss scale 1
  EXPECT_EQ(d->clip, 1.0);              // no gradient_clipping
  const auto k = v.constants(kGroups, d->clip);
  ASSERT_EQ(k.size(), 2u);
  const nx::AdamHyperparams h0{.lr = 1e-3, .weight_decay = 0.01};
  const nx::AdamHyperparams h1{.lr = 0.5e-3, .weight_decay = 0.0};
  EXPECT_TRUE(same(k[0].adam, nx::make_adam_constants(h0, 1, nx::combined_grad_scale(1.0, 1.0, 2))));
  EXPECT_TRUE(same(k[1].adam, nx::make_adam_constants(h1, 1, nx::combined_grad_scale(1.0, 1.0, 2))));
}

TEST(Verdict, ClippingFoldsIntoTheOneFactor) {
  Config c = bf16_config();
  c.gradient_clipping = 1.0;
  Verdict v = make(c);
  auto d = v.decide(8.0, false);  // norm 4 > 1: clip
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d->clip, nx::clip_coefficient(4.0, 1.0));
  EXPECT_LT(d->clip, 0.26);
  const auto k = v.constants(kGroups, d->clip);
  EXPECT_FLOAT_EQ(k[0].adam.grad_scale, static_cast<float>(nx::combined_grad_scale(1.0, d->clip, 2)));
  auto small = v.decide(1.0, false);  // norm 0.5 < 1: no clip
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->clip, 1.0);
}

TEST(Verdict, NonfiniteGradientsFollowThePolicy) {
  Config c = bf16_config();
  const double inf = std::numeric_limits<double>::infinity();
  c.strata.nonfinite = NonfinitePolicy::kSkip;
  {
    Verdict v = make(c);
    auto d = v.decide(1.0, /*nonfinite=*/true);
    ASSERT_TRUE(d.ok());
    EXPECT_TRUE(d->skip);
    auto n = v.decide(inf, false);  // a non-finite norm counts as well
    ASSERT_TRUE(n.ok());
    EXPECT_TRUE(n->skip);
  }
  c.strata.nonfinite = NonfinitePolicy::kError;
  {
    Verdict v = make(c);
    auto d = v.decide(1.0, true);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), core::StatusCode::kFailedPrecondition);
    EXPECT_NE(d.status().message().find("strata.nonfinite is \"error\""), std::string::npos) << d.status();
    EXPECT_NE(d.status().message().find("step 1"), std::string::npos) << d.status();
  }
  c.strata.nonfinite = NonfinitePolicy::kApply;
  {
    Verdict v = make(c);
    auto d = v.decide(1.0, true);
    ASSERT_TRUE(d.ok());
    EXPECT_FALSE(d->skip);
  }
}

TEST(Verdict, Fp16ScalerSkipsAndHalvesOnOverflowAndUnscalesByItsScale) {
  Config c = bf16_config();
  c.precision = Precision::kFp16;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 4;  // 16
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 1000;
  Verdict v = make(c);
  EXPECT_EQ(v.loss_scale(), 16.0);
  auto d = v.decide(64.0, false);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->skip);
  EXPECT_DOUBLE_EQ(d->grad_norm, 64.0 / 16.0 / 2.0);
  EXPECT_FLOAT_EQ(v.constants(kGroups, 1.0)[0].adam.grad_scale, static_cast<float>(1.0 / 16.0 / 2.0));
  v.count(Verdict::Outcome::kApplied);
  auto o = v.decide(1.0, /*nonfinite=*/true);
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->skip);
  EXPECT_EQ(v.loss_scale(), 8.0);
  // At the minimum scale an overflow is an error, and nothing changes.
  c.fp16.initial_scale_power = 0;
  Verdict m = make(c);
  auto e = m.decide(1.0, true);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(m.loss_scale(), 1.0);
}

TEST(Verdict, LearningRateFromTheScheduleOrTheOverride) {
  Config c = bf16_config();
  c.scheduler.type = SchedulerType::kWarmupLR;
  c.scheduler.warmup_min_lr = 0.0;
  c.scheduler.warmup_max_lr = 1e-3;
  c.scheduler.warmup_num_steps = 10;
  c.scheduler.warmup_type = WarmupType::kLinear;
  Verdict v = make(c);
  auto schedule = LrSchedule::create(c.scheduler, c.optimizer.lr);
  ASSERT_TRUE(schedule.ok());
  EXPECT_DOUBLE_EQ(v.next_lr(), schedule->lr_for_step(1));
  v.count(Verdict::Outcome::kApplied);
  v.count(Verdict::Outcome::kApplied);
  EXPECT_DOUBLE_EQ(v.next_lr(), schedule->lr_for_step(3));
  v.count(Verdict::Outcome::kSkipped);  // a skipped step does not move the schedule
  EXPECT_DOUBLE_EQ(v.next_lr(), schedule->lr_for_step(3));
  v.set_lr_override(0.25);
  EXPECT_EQ(v.next_lr(), 0.25);
  const auto h = v.hyperparams(kGroups);
  EXPECT_EQ(h[0].lr, 0.25);
  EXPECT_EQ(h[1].lr, 0.125);  // lr_scale 0.5
  EXPECT_EQ(h[0].weight_decay, 0.01);
  EXPECT_EQ(h[1].weight_decay, 0.0);
  EXPECT_EQ(v.applied_steps(), 2);
  EXPECT_EQ(v.skipped_steps(), 1);
  EXPECT_EQ(v.verdicts(), 3);
}

// A deferred verdict decides exactly as step_end would have.
TEST(Verdict, DeferredVerdictAgreesWithStepEndBitForBit) {
  Config c = bf16_config();
  c.gradient_clipping = 1.0;
  c.strata.nonfinite = NonfinitePolicy::kSkip;
  for (double raw : {0.5, 3.0, 100.0}) {
    Verdict v = make(c);
    const auto hyper = v.hyperparams(kGroups);
    const Verdict::Deferred d = Verdict::decide_deferred(c, raw, false, hyper, 1, 1);
    auto e = v.decide(raw, false);
    ASSERT_TRUE(e.ok());
    const auto k = v.constants(kGroups, e->clip);
    EXPECT_FALSE(d.record.skipped);
    EXPECT_EQ(d.record.grad_norm, e->grad_norm);
    EXPECT_EQ(d.record.lr, hyper[0].lr);
    EXPECT_EQ(d.record.norm_step, 1);
    ASSERT_EQ(d.constants.size(), k.size());
    for (std::size_t i = 0; i < k.size(); ++i) EXPECT_TRUE(same(d.constants[i].adam, k[i].adam)) << raw;
  }
  const Verdict::Deferred skipped =
      Verdict::decide_deferred(c, 1.0, /*nonfinite=*/true, make(c).hyperparams(kGroups), 4, 5);
  EXPECT_TRUE(skipped.record.skipped);
  EXPECT_TRUE(skipped.constants.empty());
  EXPECT_EQ(skipped.record.norm_step, 5);
  c.strata.nonfinite = NonfinitePolicy::kApply;
  const Verdict::Deferred applied =
      Verdict::decide_deferred(c, 1.0, /*nonfinite=*/true, make(c).hyperparams(kGroups), 4, 5);
  EXPECT_FALSE(applied.record.skipped);
  EXPECT_EQ(applied.constants.size(), kGroups.size());
}

TEST(Verdict, FoldCountsDeferredVerdictsAndKeepsTheLast) {
  Verdict v = make(bf16_config());
  v.fold({.norm_step = 1, .grad_norm = 2.0, .lr = 1e-3, .skipped = false});
  v.fold({.norm_step = 2, .grad_norm = 9.0, .lr = 0.0, .skipped = true});
  EXPECT_EQ(v.applied_steps(), 1);
  EXPECT_EQ(v.skipped_steps(), 1);
  EXPECT_EQ(v.last().norm_step, 2);
  EXPECT_TRUE(v.last().skipped);
}

TEST(Verdict, RestoreTakesACheckpointsCountsScalerAndOverride) {
  Config c = bf16_config();
  c.precision = Precision::kFp16;
  c.fp16.enabled = true;
  Verdict v = make(c);
  LossScaler::State s = v.scaler_state();
  s.scale = 1024.0;
  s.iteration = 7;
  ASSERT_TRUE(v.restore(s, 5, 2, 0.5).ok());
  EXPECT_EQ(v.loss_scale(), 1024.0);
  EXPECT_EQ(v.applied_steps(), 5);
  EXPECT_EQ(v.skipped_steps(), 2);
  EXPECT_EQ(v.lr_override(), 0.5);
  EXPECT_EQ(v.next_lr(), 0.5);
  s.scale = -1.0;  // not a state this config could reach
  EXPECT_FALSE(v.restore(s, 5, 2, 0.5).ok());
}

}  // namespace
}  // namespace strata::engine
