// The overlap schedules (engine/schedule/): what each mode does differently
// and the memory it holds beyond the placement's state. The engine's and the
// planner's end-to-end tests check that they act on it; these pin the table.
#include "engine/schedule/schedule.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace strata::engine {
namespace {

constexpr OverlapMode kModes[] = {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative,
                                  OverlapMode::kDelayed};

StepRules certain() { return {false, false, NonfinitePolicy::kApply}; }

std::vector<std::string> items(const Schedule& s) {
  std::vector<std::string> out;
  for (const ScheduleExtra& x : s.extra_memory()) out.emplace_back(x.item);
  return out;
}

TEST(Schedule, EachModeHasItsOwnScheduleNamedAsTheConfigSpellsIt) {
  EXPECT_EQ(schedule_for(OverlapMode::kNone).name(), "none");
  EXPECT_EQ(schedule_for(OverlapMode::kExact).name(), "exact");
  EXPECT_EQ(schedule_for(OverlapMode::kSpeculative).name(), "speculative");
  EXPECT_EQ(schedule_for(OverlapMode::kDelayed).name(), "delayed");
  for (OverlapMode m : kModes) EXPECT_EQ(schedule_for(m).mode(), m);
}

TEST(StepRules, CertainOnlyWithoutClippingScalerOrNonfiniteCheck) {
  Config c;
  c.precision = Precision::kBf16;
  c.gradient_clipping = 0.0;
  c.strata.nonfinite = NonfinitePolicy::kApply;
  EXPECT_TRUE(StepRules::of(c).certain());
  c.gradient_clipping = 1.0;
  EXPECT_FALSE(StepRules::of(c).certain());
  c.gradient_clipping = 0.0;
  c.strata.nonfinite = NonfinitePolicy::kSkip;
  EXPECT_FALSE(StepRules::of(c).certain());
  c.strata.nonfinite = NonfinitePolicy::kApply;
  c.precision = Precision::kFp16;
  EXPECT_FALSE(StepRules::of(c).certain());
}

TEST(Schedule, OnlyNoneRunsWithoutThreads) {
  for (OverlapMode m : kModes) EXPECT_EQ(schedule_for(m).threaded(), m != OverlapMode::kNone) << to_string(m);
}

TEST(Schedule, SpeculativeReadsFurtherAheadAndKeepsASecondVersion) {
  const Schedule& spec = schedule_for(OverlapMode::kSpeculative);
  EXPECT_EQ(spec.ring_depth(), 6);
  EXPECT_TRUE(spec.second_state_version());
  EXPECT_EQ(items(spec), (std::vector<std::string>{"speculative_state", "speculative_compute_copies"}));
  ASSERT_EQ(spec.extra_memory().size(), 2u);
  EXPECT_EQ(spec.extra_memory()[0].tier, Tier::kNvme);
  EXPECT_EQ(spec.extra_memory()[0].basis, ExtraBasis::kNvmeState);
  EXPECT_EQ(spec.extra_memory()[1].tier, Tier::kPinned);
  EXPECT_EQ(spec.extra_memory()[1].basis, ExtraBasis::kNvmeGroupCompute);
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kDelayed}) {
    EXPECT_EQ(schedule_for(m).ring_depth(), 4);
    EXPECT_FALSE(schedule_for(m).second_state_version());
  }
}

TEST(Schedule, DelayedHoldsEveryTrainableGroupsNewCopiesInPinnedMemory) {
  const Schedule& d = schedule_for(OverlapMode::kDelayed);
  ASSERT_EQ(d.extra_memory().size(), 1u);
  EXPECT_EQ(d.extra_memory()[0].item, "delayed_compute_copies");
  EXPECT_EQ(d.extra_memory()[0].tier, Tier::kPinned);
  EXPECT_EQ(d.extra_memory()[0].basis, ExtraBasis::kTrainableGroupCompute);
  EXPECT_NE(std::string(d.extra_memory()[0].why).find("\"delayed\""), std::string::npos);
  EXPECT_TRUE(items(schedule_for(OverlapMode::kNone)).empty());
  EXPECT_TRUE(items(schedule_for(OverlapMode::kExact)).empty());
}

TEST(Schedule, EarlyJobsSpeculativeAlwaysExactOnlyWhenCertain) {
  const StepRules uncertain{true, false, NonfinitePolicy::kSkip};
  EXPECT_TRUE(schedule_for(OverlapMode::kSpeculative).early_jobs(uncertain));
  EXPECT_TRUE(schedule_for(OverlapMode::kSpeculative).early_jobs(certain()));
  EXPECT_FALSE(schedule_for(OverlapMode::kExact).early_jobs(uncertain));
  EXPECT_TRUE(schedule_for(OverlapMode::kExact).early_jobs(certain()));
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kDelayed}) {
    EXPECT_FALSE(schedule_for(m).early_jobs(certain()));
    EXPECT_FALSE(schedule_for(m).early_jobs(uncertain));
  }
}

TEST(Schedule, JobKindsOrdinaryButDelayedEarlyOnesSpeculativeUnlessCertain) {
  const StepRules uncertain{true, false, NonfinitePolicy::kSkip};
  EXPECT_EQ(schedule_for(OverlapMode::kDelayed).step_job_kind(), JobKind::kDelayed);
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative}) {
    EXPECT_EQ(schedule_for(m).step_job_kind(), JobKind::kOrdinary) << to_string(m);
  }
  EXPECT_EQ(schedule_for(OverlapMode::kSpeculative).early_job_kind(uncertain), JobKind::kSpeculative);
  EXPECT_EQ(schedule_for(OverlapMode::kSpeculative).early_job_kind(certain()), JobKind::kCertainEarly);
  EXPECT_EQ(schedule_for(OverlapMode::kExact).early_job_kind(certain()), JobKind::kCertainEarly);
}

TEST(Schedule, OnlyDelayedLetsTheStepRunAheadOfTheOptimizer) {
  const Schedule& d = schedule_for(OverlapMode::kDelayed);
  EXPECT_TRUE(d.delays_update());
  EXPECT_FALSE(d.gradients_wait_for_optimizer());
  // Compute copies on nvme: one block takes one I/O at a time, so fetch waits.
  EXPECT_TRUE(d.fetch_waits_for_optimizer(Tier::kNvme));
  EXPECT_FALSE(d.fetch_waits_for_optimizer(Tier::kPinned));
  EXPECT_FALSE(d.fetch_waits_for_optimizer(Tier::kDevice));
  EXPECT_TRUE(d.updates_in_backward_order(false));
  EXPECT_FALSE(d.updates_in_backward_order(true));
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative}) {
    const Schedule& s = schedule_for(m);
    EXPECT_FALSE(s.delays_update());
    EXPECT_TRUE(s.gradients_wait_for_optimizer());
    for (Tier t : {Tier::kDevice, Tier::kPinned, Tier::kNvme}) EXPECT_TRUE(s.fetch_waits_for_optimizer(t));
    EXPECT_FALSE(s.updates_in_backward_order(false));
  }
}

TEST(Schedule, DelayedDefersVerdictsUnlessTheScalerOrAnErrorPolicyNeedsThemAtStepEnd) {
  const Schedule& d = schedule_for(OverlapMode::kDelayed);
  EXPECT_TRUE(d.defers_verdicts({true, false, NonfinitePolicy::kSkip}));
  EXPECT_TRUE(d.defers_verdicts({false, false, NonfinitePolicy::kApply}));
  EXPECT_FALSE(d.defers_verdicts({false, true, NonfinitePolicy::kSkip}));   // fp16: the next scale
  EXPECT_FALSE(d.defers_verdicts({false, false, NonfinitePolicy::kError}));  // step_end reports it
  for (OverlapMode m : {OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative}) {
    EXPECT_FALSE(schedule_for(m).defers_verdicts({false, false, NonfinitePolicy::kSkip}));
  }
}

}  // namespace
}  // namespace strata::engine
