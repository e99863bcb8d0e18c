// DeepSpeed's "optimizer" and "scheduler" sections: which type takes which
// params (a foreign one is an error, as in DeepSpeed), their defaults, "auto"
// and the warnings where DeepSpeed's defaults surprise. Keys: docs/config.md.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/result.h"
#include "core/status.h"
#include "core/str.h"
#include "engine/config.h"
#include "engine/config/json_reader.h"
#include "engine/config/keys.h"
#include "engine/config/sections.h"

namespace strata::engine::config_internal {
namespace {

using core::Status;
using core::str_cat;

// Which optimizer takes which parameter (DeepSpeed's CPU Adam, Adagrad, Lion).
constexpr unsigned kAdamBit = 1;
constexpr unsigned kAdamWBit = 2;
constexpr unsigned kAdagradBit = 4;
constexpr unsigned kLionBit = 8;
constexpr unsigned kAdamFamily = kAdamBit | kAdamWBit;

struct ParamUse {
  std::string_view key;
  unsigned optimizers;
};
constexpr ParamUse kOptimizerParams[] = {
    {"lr", kAdamFamily | kAdagradBit | kLionBit},
    {"betas", kAdamFamily | kLionBit},
    {"eps", kAdamFamily | kAdagradBit},
    {"weight_decay", kAdamFamily | kAdagradBit | kLionBit},
    {"bias_correction", kAdamFamily},
    {"adam_w_mode", kAdamFamily},
    {"torch_adam", kAdamFamily},
    {"amsgrad", kAdamFamily | kAdagradBit},
};

unsigned optimizer_bit(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam: return kAdamBit;
    case OptimizerType::kAdamW: return kAdamWBit;
    case OptimizerType::kAdagrad: return kAdagradBit;
    case OptimizerType::kLion: return kLionBit;
  }
  return 0;
}

template <std::size_t N>
std::string params_taken_by(const ParamUse (&table)[N], unsigned bit) {
  std::string out;
  for (const ParamUse& p : table) {
    if ((p.optimizers & bit) == 0) continue;
    if (!out.empty()) out += ", ";
    out += p.key;
  }
  return out;
}

// A key of `params` that belongs to another optimizer or schedule: DeepSpeed
// fails on it (an unexpected keyword argument), so strata does too.
template <std::size_t N>
void reject_foreign_params(ObjectReader& p, const ParamUse (&table)[N], unsigned bit,
                           std::string_view owner) {
  for (const ParamUse& use : table) {
    const Json* v = p.peek(use.key);
    if (v == nullptr || (use.optimizers & bit) != 0) continue;
    p.fail(use.key, str_cat(show(*v), " given, but ", owner, " takes no ", use.key,
                            " (its parameters: ", params_taken_by(table, bit), ")"));
    return;
  }
}

// betas: [beta1, beta2], each in [0, 1).
bool read_betas(ObjectReader& p, OptimizerConfig* o) {
  const Json* v = p.take("betas");
  if (v == nullptr) return false;
  const std::string path = p.path_of("betas");
  if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number()) {
    p.ctx()->fail(path, str_cat("expected an array of 2 numbers, got ", show(*v)));
    return false;
  }
  double b[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    if (!read_double(p.ctx(), str_cat(path, "[", i, "]"), (*v)[static_cast<std::size_t>(i)],
                     closed_open(0, 1), &b[i])) {
      return false;
    }
  }
  o->beta1 = b[0];
  o->beta2 = b[1];
  return true;
}

// Which schedule takes which parameter (DeepSpeed's lr_schedules).
constexpr unsigned kWarmupLRBit = 1;
constexpr unsigned kWarmupDecayLRBit = 2;
constexpr unsigned kWarmupCosineLRBit = 4;
constexpr unsigned kAllSchedules = kWarmupLRBit | kWarmupDecayLRBit | kWarmupCosineLRBit;
constexpr ParamUse kSchedulerParams[] = {
    {"warmup_min_lr", kWarmupLRBit | kWarmupDecayLRBit},
    {"warmup_max_lr", kWarmupLRBit | kWarmupDecayLRBit},
    {"warmup_num_steps", kAllSchedules},
    {"warmup_type", kAllSchedules},
    {"total_num_steps", kWarmupDecayLRBit | kWarmupCosineLRBit},
    {"warmup_min_ratio", kWarmupCosineLRBit},
    {"cos_min_ratio", kWarmupCosineLRBit},
    {"last_batch_iteration", kAllSchedules},
};

}  // namespace

Status parse_optimizer(ObjectReader& root, Context& ctx, OptimizerConfig* o) {
  ObjectReader r = root.child("optimizer");
  if (!r.present()) return r.finish();
  r.ignore({"legacy_fusion"}, "a DeepSpeed kernel choice");
  const Json* type = r.peek("type");
  if (type == nullptr) {
    r.missing("type", str_cat("give one of ", join_names<OptimizerType>(kSupportedOptimizerNames)));
    return ctx.error();
  }
  if (type->is_string()) {
    constexpr std::string_view kOtherDeepSpeed[] = {
        "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw", "musgd", "muon"};
    const std::string t = lower(type->get_ref<const std::string&>());
    for (std::string_view other : kOtherDeepSpeed) {
      if (t == other) {
        r.fail("type", str_cat(show(*type),
                               " is a DeepSpeed optimizer strata does not support; "
                               "supported: ",
                               join_names<OptimizerType>(kSupportedOptimizerNames)));
        return ctx.error();
      }
    }
  }
  // DeepSpeed compares optimizer names case-insensitively.
  if (!r.get_enum<OptimizerType>("type", kSupportedOptimizerNames, &o->type, /*ignore_case=*/true)) {
    return ctx.error();
  }
  const std::string_view type_name = name_of<OptimizerType>(kOptimizerNames, o->type);
  // DeepSpeed's defaults where they differ from Adam's (DeepSpeedCPUAdagrad:
  // lr 1e-2, eps 1e-10; DeepSpeedCPULion: Adam's lr and betas, no eps).
  if (o->type == OptimizerType::kAdagrad) {
    o->lr = 1e-2;
    o->eps = 1e-10;
  }

  ObjectReader p = r.child("params");
  if (const Json* v = p.take("max_grad_norm")) {
    p.fail("max_grad_norm", str_cat(show(*v),
                                    " is not an optimizer parameter in DeepSpeed "
                                    "(it fails on it); use gradient_clipping"));
  }
  reject_foreign_params(p, kOptimizerParams, optimizer_bit(o->type), type_name);
  if (!ctx.ok()) return ctx.error();

  if (p.take_auto("lr")) {
    ctx.resolved(p.path_of("lr"), show_double(o->lr), str_cat(type_name, "'s default"));
  } else {
    p.get_double("lr", at_least(0), &o->lr);
  }
  if (p.take_auto("betas")) {
    ctx.resolved(p.path_of("betas"),
                 str_cat("[", show_double(o->beta1), ", ", show_double(o->beta2), "]"),
                 str_cat(type_name, "'s default"));
  } else {
    read_betas(p, o);
  }
  if (p.take_auto("eps")) {
    ctx.resolved(p.path_of("eps"), show_double(o->eps), str_cat(type_name, "'s default"));
  } else {
    p.get_double("eps", above(0), &o->eps);
  }
  if (p.take_auto("weight_decay")) {
    ctx.resolved(p.path_of("weight_decay"), show_double(o->weight_decay),
                 str_cat(type_name, "'s default"));
  } else {
    p.get_double("weight_decay", at_least(0), &o->weight_decay);
  }
  p.get_bool("bias_correction", &o->bias_correction);
  bool amsgrad = false;
  if (p.get_bool("amsgrad", &amsgrad) && amsgrad) {
    p.fail("amsgrad",
           "true is not supported (strata's CPU optimizer, like DeepSpeed's, has no "
           "AMSGrad); remove it or set false");
  }
  bool torch_adam = false;
  if (p.get_bool("torch_adam", &torch_adam) && torch_adam) {
    p.warn("torch_adam",
           "true has no effect: strata always runs its own CPU Adam (same update "
           "rule as torch.optim.Adam/AdamW)");
  }
  bool adam_w_mode = true;
  const bool has_adam_w_mode = p.get_bool("adam_w_mode", &adam_w_mode);
  if (!ctx.ok()) return ctx.error();
  if (o->type == OptimizerType::kAdam) {
    o->adam_w_mode = adam_w_mode;
    if (!has_adam_w_mode) {
      p.warn("adam_w_mode",
             "not set: DeepSpeed's default (true) makes type \"Adam\" AdamW, with decoupled "
             "weight decay; strata follows DeepSpeed. Set \"adam_w_mode\": false for Adam with "
             "L2 weight decay");
    }
  } else if (o->type == OptimizerType::kAdamW) {
    o->adam_w_mode = true;
    if (has_adam_w_mode && !adam_w_mode) {
      p.warn("adam_w_mode",
             "false has no effect with type \"AdamW\" (DeepSpeed ignores it too); "
             "use type \"Adam\" with adam_w_mode false for L2 weight decay");
    }
  }
  STRATA_RETURN_IF_ERROR(p.finish());
  return r.finish();
}

Status parse_scheduler(ObjectReader& root, Context& ctx, const OptimizerConfig& optimizer,
                       SchedulerConfig* s) {
  ObjectReader r = root.child("scheduler");
  if (!r.present()) return r.finish();
  const Json* type = r.peek("type");
  if (type == nullptr) {
    r.missing("type", str_cat("give one of ", join_names(std::span(kSchedulerNames).subspan(1))));
    return ctx.error();
  }
  if (type->is_string() && (type->get_ref<const std::string&>() == "LRRangeTest" ||
                            type->get_ref<const std::string&>() == "OneCycle")) {
    r.fail("type", str_cat(show(*type),
                           " is a DeepSpeed schedule strata does not support; "
                           "supported: ",
                           join_names(std::span(kSchedulerNames).subspan(1))));
    return ctx.error();
  }
  // DeepSpeed matches schedule names exactly.
  if (!r.get_enum(std::string_view("type"), std::span(kSchedulerNames).subspan(1), &s->type)) {
    return ctx.error();
  }
  const std::string_view type_name = name_of<SchedulerType>(kSchedulerNames, s->type);
  const unsigned bit = s->type == SchedulerType::kWarmupLR        ? kWarmupLRBit
                       : s->type == SchedulerType::kWarmupDecayLR ? kWarmupDecayLRBit
                                                                  : kWarmupCosineLRBit;
  const bool cosine = s->type == SchedulerType::kWarmupCosineLR;

  ObjectReader p = r.child("params");
  reject_foreign_params(p, kSchedulerParams, bit, type_name);
  if (!ctx.ok()) return ctx.error();

  if (!cosine) {
    if (p.take_auto("warmup_min_lr")) {
      ctx.resolved(p.path_of("warmup_min_lr"), "0", "DeepSpeed's default");
    } else {
      p.get_double("warmup_min_lr", at_least(0), &s->warmup_min_lr);
    }
    if (p.take_auto("warmup_max_lr")) {
      s->warmup_max_lr = optimizer.lr;
      ctx.resolved(p.path_of("warmup_max_lr"), show_double(optimizer.lr), "optimizer.params.lr");
    } else if (!p.get_double("warmup_max_lr", at_least(0), &s->warmup_max_lr) && ctx.ok()) {
      if (s->type == SchedulerType::kWarmupLR) {
        s->warmup_max_lr = optimizer.lr;
        if (optimizer.lr != 1e-3) {
          p.warn("warmup_max_lr",
                 str_cat("not set: strata follows current DeepSpeed and warms up to "
                         "optimizer.params.lr (",
                         show_double(optimizer.lr),
                         "); older DeepSpeed releases used 0.001. Set it to be sure"));
        }
      } else if (optimizer.lr != s->warmup_max_lr) {
        p.warn("warmup_max_lr",
               str_cat("not set: DeepSpeed's WarmupDecayLR default 0.001 applies and overrides "
                       "optimizer.params.lr (",
                       show_double(optimizer.lr), "). Set it to be sure"));
      }
    }
  } else {
    p.get_double("warmup_min_ratio", closed(0, 1), &s->warmup_min_ratio);
    p.get_double("cos_min_ratio", closed(0, 1), &s->cos_min_ratio);
  }
  if (p.take_auto("warmup_num_steps")) {
    ctx.resolved(p.path_of("warmup_num_steps"), str_cat(s->warmup_num_steps),
                 "DeepSpeed's default");
  } else {
    p.get_int("warmup_num_steps", 1, kMaxI64, &s->warmup_num_steps);
  }
  p.get_enum<WarmupType>("warmup_type", kWarmupTypeNames, &s->warmup_type);
  std::int64_t last_batch_iteration = -1;
  if (p.get_int("last_batch_iteration", -1, kMaxI64, &last_batch_iteration) &&
      last_batch_iteration != -1) {
    p.warn("last_batch_iteration", str_cat(last_batch_iteration,
                                           " has no effect: strata resumes the schedule from "
                                           "its checkpoint's step count"));
  }
  if (s->type != SchedulerType::kWarmupLR) {
    if (p.take_auto("total_num_steps")) {
      if (ctx.options().total_num_steps <= 0) {
        p.fail("total_num_steps",
               "\"auto\" cannot be resolved: the program did not pass the run's step count "
               "(strata_config_options.total_num_steps in C, total_num_steps= in Python); write the number");
      } else {
        s->total_num_steps = ctx.options().total_num_steps;
        ctx.resolved(p.path_of("total_num_steps"), str_cat(s->total_num_steps),
                     "the run's step count, passed by the program");
      }
    } else if (!p.get_int("total_num_steps", 1, kMaxI64, &s->total_num_steps) && ctx.ok()) {
      p.missing("total_num_steps", str_cat(type_name, " needs it (the number of optimizer steps of the run)"));
    }
    if (ctx.ok()) {
      if (const std::optional<ScheduleRuleBroken> broken = broken_schedule_rule(*s)) {
        p.fail(broken->key, str_cat(s->total_num_steps, ": ", broken->expected));
      }
    }
    if (ctx.ok() && s->total_num_steps < s->warmup_num_steps) {
      p.warn("total_num_steps", str_cat(s->total_num_steps, " is less than warmup_num_steps (",
                                        s->warmup_num_steps, "): the decay never starts"));
    }
  }
  STRATA_RETURN_IF_ERROR(p.finish());
  return r.finish();
}

}  // namespace strata::engine::config_internal
