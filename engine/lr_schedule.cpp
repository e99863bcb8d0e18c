#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/str.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;

Status bad(const char* key, double value, const char* expected) {
  return Status::invalid_argument(str_cat("scheduler.params.", key, " = ", value, ": ", expected));
}

}  // namespace

LrSchedule::LrSchedule(const SchedulerConfig& config, double optimizer_lr)
    : config_(config),
      optimizer_lr_(optimizer_lr),
      warmup_steps_(std::max<std::int64_t>(2, config.warmup_num_steps)),
      inverse_log_warmup_(1.0 / std::log(static_cast<double>(warmup_steps_))) {}

core::Result<LrSchedule> LrSchedule::create(const SchedulerConfig& c, double optimizer_lr) {
  if (!(optimizer_lr >= 0.0) || !std::isfinite(optimizer_lr)) {
    return Status::invalid_argument(str_cat("optimizer.params.lr = ", optimizer_lr, ": expected a finite lr >= 0"));
  }
  if (c.type == SchedulerType::kNone) return LrSchedule(c, optimizer_lr);
  if (c.warmup_num_steps < 0) return bad("warmup_num_steps", static_cast<double>(c.warmup_num_steps), "expected >= 0");
  if (c.type == SchedulerType::kWarmupLR || c.type == SchedulerType::kWarmupDecayLR) {
    if (!(c.warmup_min_lr >= 0.0) || !std::isfinite(c.warmup_min_lr)) {
      return bad("warmup_min_lr", c.warmup_min_lr, "expected a finite lr >= 0");
    }
    if (!(c.warmup_max_lr >= 0.0) || !std::isfinite(c.warmup_max_lr)) {
      return bad("warmup_max_lr", c.warmup_max_lr, "expected a finite lr >= 0");
    }
  }
  if (c.type == SchedulerType::kWarmupDecayLR || c.type == SchedulerType::kWarmupCosineLR) {
    if (c.total_num_steps <= 0) {
      return bad("total_num_steps", static_cast<double>(c.total_num_steps),
                 str_cat("required by ", to_string(c.type), " (a step count > 0)").c_str());
    }
  }
  if (const std::optional<ScheduleRuleBroken> broken = broken_schedule_rule(c)) {
    return Status::invalid_argument(
        str_cat("scheduler.params.", broken->key, " = ", c.total_num_steps, ": ", broken->expected));
  }
  if (c.type == SchedulerType::kWarmupCosineLR) {
    if (!(c.warmup_min_ratio >= 0.0 && c.warmup_min_ratio <= 1.0)) {
      return bad("warmup_min_ratio", c.warmup_min_ratio, "expected a ratio in [0, 1]");
    }
    if (!(c.cos_min_ratio >= 0.0 && c.cos_min_ratio <= 1.0)) {
      return bad("cos_min_ratio", c.cos_min_ratio, "expected a ratio in [0, 1]");
    }
  }
  return LrSchedule(c, optimizer_lr);
}

double LrSchedule::warmup_gamma(std::int64_t iteration) const {
  if (config_.warmup_type == WarmupType::kLinear) {
    return static_cast<double>(iteration) / static_cast<double>(warmup_steps_);
  }
  return inverse_log_warmup_ * std::log(static_cast<double>(iteration) + 1.0);
}

double LrSchedule::lr_at(std::int64_t iteration) const {
  if (iteration < 0) iteration = 0;
  const SchedulerConfig& c = config_;
  switch (c.type) {
    case SchedulerType::kNone:
      return optimizer_lr_;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR: {
      double gamma = 1.0;
      if (iteration < warmup_steps_) {
        gamma = warmup_gamma(iteration);
      } else if (c.type == SchedulerType::kWarmupDecayLR) {
        const double left = static_cast<double>(c.total_num_steps - iteration);
        const double span = std::max(1.0, static_cast<double>(c.total_num_steps - warmup_steps_));
        gamma = std::max(0.0, left / span);
      }
      return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma;
    }
    case SchedulerType::kWarmupCosineLR: {
      double ratio;
      if (iteration < warmup_steps_) {
        ratio = c.warmup_min_ratio + warmup_gamma(iteration) * (1.0 - c.warmup_min_ratio);
      } else {
        const double done = static_cast<double>(iteration - warmup_steps_ + 1);
        const double span = static_cast<double>(c.total_num_steps - warmup_steps_);
        const double cosine = (1.0 + std::cos(std::numbers::pi * done / span)) / 2.0;
        ratio = std::max(0.0, c.cos_min_ratio + (1.0 - c.cos_min_ratio) * cosine);
      }
      return optimizer_lr_ * ratio;
    }
  }
  return optimizer_lr_;
}

}  // namespace strata::engine
