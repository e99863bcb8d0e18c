// The learning rate of each optimizer step, from DeepSpeed's schedules
// (WarmupLR, WarmupDecayLR, WarmupCosineLR) with their exact formulas, or the
// optimizer's constant lr when no scheduler is configured.
//
// DeepSpeed evaluates a schedule at `last_batch_iteration`, which its engine
// advances after every applied (not skipped) optimizer step. strata evaluates
// optimizer step k (counting applied steps from 1) at iteration k - 1, so the
// first step runs at the warmup's start (warmup_min_lr) and the shape of the
// curve is DeepSpeed's, step for step. Skipped steps do not advance it.
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "core/result.h"

namespace strata::engine {

class LrSchedule {
 public:
  // `optimizer_lr` is optimizer.params.lr (WarmupCosineLR scales it).
  // Errors (kInvalidArgument, naming the key): a negative lr or step count,
  // WarmupDecayLR or WarmupCosineLR without total_num_steps, WarmupCosineLR
  // with total_num_steps not above warmup_num_steps (its cosine would divide
  // by zero), ratios outside [0, 1].
  static core::Result<LrSchedule> create(const SchedulerConfig& config, double optimizer_lr);

  // The learning rate at DeepSpeed's last_batch_iteration `iteration` (>= 0).
  double lr_at(std::int64_t iteration) const;
  // The learning rate of applied optimizer step `step` (>= 1).
  double lr_for_step(std::int64_t step) const { return lr_at(step < 1 ? 0 : step - 1); }

  const SchedulerConfig& config() const { return config_; }

 private:
  LrSchedule(const SchedulerConfig& config, double optimizer_lr);
  // The warmup's fraction in [0, 1] at `iteration` (< warmup_steps_).
  double warmup_gamma(std::int64_t iteration) const;

  SchedulerConfig config_;
  double optimizer_lr_ = 0.0;
  std::int64_t warmup_steps_ = 2;  // DeepSpeed's max(2, warmup_num_steps)
  double inverse_log_warmup_ = 0.0;
};

}  // namespace strata::engine
