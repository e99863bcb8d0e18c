// Parses and validates the engine configuration of engine/config.h:
// DeepSpeed's keys with DeepSpeed's meaning plus strata's own under "strata".
// The generic JSON reader is in engine/config/json_reader.h, to_json and
// to_string in engine/config/write.cpp.
#include "engine/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/logging.h"
#include "core/numerics.h"
#include "core/status.h"
#include "core/str.h"
#include "core/unique_fd.h"
#include "engine/config/json_reader.h"
#include "engine/config/keys.h"

namespace strata::engine {
namespace {

// The reader (engine/config/json_reader.h) and the enum names (keys.h), for
// the sections still in this file.
using namespace config_internal;
using core::Status;
using core::str_cat;

// The norm block (core/numerics.h), in fp32 bytes: chunks and tiles are whole blocks.
using core::numerics::kNormBlockElems;
constexpr std::uint64_t kNormBlockBytes = sizeof(float) * kNormBlockElems;
// O_DIRECT alignment strata uses for every request (core/aligned_buffer.h).
using core::kDirectIoAlignment;
constexpr std::int64_t kMaxQueueDepth = 4096;

// --- sections ---------------------------------------------------------------------

// train_batch_size = micro x gas, resolved as DeepSpeed does with one process.
Status parse_batch(ObjectReader& r, Context& ctx, Config* c) {
  constexpr std::string_view kTrain = "train_batch_size";
  constexpr std::string_view kMicro = "train_micro_batch_size_per_gpu";
  constexpr std::string_view kGas = "gradient_accumulation_steps";
  std::int64_t train = 0;
  std::int64_t micro = 0;
  std::int64_t gas = 0;
  bool has_train = false;
  bool has_micro = false;
  bool has_gas = false;
  if (r.take_auto(kMicro)) {
    micro = 1;
    has_micro = true;
    ctx.resolved(kMicro, "1", "strata has no trainer arguments to take it from");
  } else {
    has_micro = r.get_int(kMicro, 1, kMaxI64, &micro);
  }
  if (r.take_auto(kGas)) {
    gas = 1;
    has_gas = true;
    ctx.resolved(kGas, "1", "strata has no trainer arguments to take it from");
  } else {
    has_gas = r.get_int(kGas, 1, kMaxI64, &gas);
  }
  const bool train_auto = r.take_auto(kTrain);
  if (!train_auto) has_train = r.get_int(kTrain, 1, kMaxI64, &train);
  if (!ctx.ok()) return ctx.error();

  if (train_auto) {
    if (!has_micro) {
      micro = 1;
      has_micro = true;
      ctx.resolved(kMicro, "1", "not set and train_batch_size is \"auto\"");
    }
    if (!has_gas) {
      gas = 1;
      has_gas = true;
      ctx.resolved(kGas, "1", "not set and train_batch_size is \"auto\"");
    }
  }
  if (has_micro && has_gas) {
    std::int64_t product = 0;
    if (__builtin_mul_overflow(micro, gas, &product)) {
      return Status::invalid_argument(
          str_cat(kMicro, " (", micro, ") x ", kGas, " (", gas, ") overflows a 64-bit integer"));
    }
    if (has_train && train != product) {
      return Status::invalid_argument(str_cat(kTrain, ": ", train, " != ", kMicro, " (", micro,
                                              ") x ", kGas, " (", gas, ") = ", product));
    }
    train = product;
  } else if (has_train && has_micro) {
    if (train % micro != 0) {
      return Status::invalid_argument(
          str_cat(kTrain, ": ", train, " is not a multiple of ", kMicro, " (", micro, ")"));
    }
    gas = train / micro;
  } else if (has_train && has_gas) {
    if (train % gas != 0) {
      return Status::invalid_argument(
          str_cat(kTrain, ": ", train, " is not a multiple of ", kGas, " (", gas, ")"));
    }
    micro = train / gas;
  } else if (has_train) {
    micro = train;
    gas = 1;
  } else if (has_micro) {
    train = micro;
    gas = 1;
  } else {
    return Status::invalid_argument(str_cat(
        kTrain, ", ", kMicro, ": neither is set; give at least one of them (DeepSpeed needs one: ",
        kGas, " alone does not determine the batch)"));
  }
  if (train_auto) ctx.resolved(kTrain, str_cat(train), str_cat(kMicro, " x ", kGas));
  c->train_batch_size = train;
  c->train_micro_batch_size_per_gpu = micro;
  c->gradient_accumulation_steps = gas;

  if (r.take_auto("gradient_clipping")) {
    c->gradient_clipping = 1.0;
    ctx.resolved("gradient_clipping", "1", "Hugging Face's default max_grad_norm");
  } else {
    r.get_double("gradient_clipping", at_least(0), &c->gradient_clipping);
  }
  return ctx.error();
}

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

Status parse_optimizer(ObjectReader& root, Context& ctx, OptimizerConfig* o) {
  ObjectReader r = root.child("optimizer");
  if (!r.present()) return r.finish();
  r.ignore({"legacy_fusion"}, "a DeepSpeed kernel choice");
  const Json* type = r.peek("type");
  if (type == nullptr) {
    r.fail("type", str_cat("missing; give one of ", join_names<OptimizerType>(kOptimizerNames)));
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
                               join_names<OptimizerType>(kOptimizerNames)));
        return ctx.error();
      }
    }
  }
  // DeepSpeed compares optimizer names case-insensitively.
  if (!r.get_enum<OptimizerType>("type", kOptimizerNames, &o->type, /*ignore_case=*/true)) {
    return ctx.error();
  }
  if (o->type == OptimizerType::kAdagrad) {
    o->lr = 1e-2;  // DeepSpeedCPUAdagrad's defaults
    o->eps = 1e-10;
  }
  const std::string_view type_name = name_of<OptimizerType>(kOptimizerNames, o->type);

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

Status parse_scheduler(ObjectReader& root, Context& ctx, const OptimizerConfig& optimizer,
                       SchedulerConfig* s) {
  ObjectReader r = root.child("scheduler");
  if (!r.present()) return r.finish();
  const Json* type = r.peek("type");
  if (type == nullptr) {
    r.fail("type",
           str_cat("missing; give one of ", join_names(std::span(kSchedulerNames).subspan(1))));
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
               "\"auto\" cannot be resolved: strata does not know the run's step count (pass "
               "ParseOptions.total_num_steps, or write the number)");
      } else {
        s->total_num_steps = ctx.options().total_num_steps;
        ctx.resolved(p.path_of("total_num_steps"), str_cat(s->total_num_steps),
                     "ParseOptions.total_num_steps");
      }
    } else if (!p.get_int("total_num_steps", 1, kMaxI64, &s->total_num_steps) && ctx.ok()) {
      p.fail("total_num_steps", str_cat("missing; ", type_name,
                                        " needs it (the number of "
                                        "optimizer steps of the run)"));
    }
    if (ctx.ok() && s->total_num_steps < s->warmup_num_steps) {
      p.warn("total_num_steps", str_cat(s->total_num_steps, " is less than warmup_num_steps (",
                                        s->warmup_num_steps, "): the decay never starts"));
    }
  }
  STRATA_RETURN_IF_ERROR(p.finish());
  return r.finish();
}

Status parse_precision(ObjectReader& root, Context& ctx, Config* c) {
  ObjectReader f = root.child("fp16");
  const bool fp16_auto = f.take_auto("enabled");
  if (!fp16_auto) f.get_bool("enabled", &c->fp16.enabled);
  f.get_double("loss_scale", at_least(0), &c->fp16.loss_scale);
  f.get_int("initial_scale_power", 0, 127, &c->fp16.initial_scale_power);
  f.get_int("loss_scale_window", 1, kMaxI64, &c->fp16.loss_scale_window);
  f.get_int("hysteresis", 1, std::numeric_limits<int>::max(), &c->fp16.hysteresis);
  f.get_bool("consecutive_hysteresis", &c->fp16.consecutive_hysteresis);
  f.get_double("min_loss_scale", above(0), &c->fp16.min_loss_scale);
  bool flag = false;
  if (f.get_bool("auto_cast", &flag) && flag) {
    f.warn("auto_cast",
           "true has no effect: strata does not run the forward pass; use your "
           "framework's autocast");
  }
  flag = false;
  if (f.get_bool("fp16_master_weights_and_grads", &flag) && flag) {
    f.warn("fp16_master_weights_and_grads",
           "true has no effect: strata keeps fp32 master "
           "weights and gradients");
  }
  STRATA_RETURN_IF_ERROR(f.finish());

  ObjectReader b = root.child(root.pick({{"bf16"}, {"bfloat16", /*old=*/true}}));
  bool bf16_enabled = false;
  const bool bf16_auto = b.take_auto("enabled");
  if (!bf16_auto) b.get_bool("enabled", &bf16_enabled);
  b.ignore({"immediate_grad_update", "check_grad_overflow"},
           "strata applies the update once per step and always checks gradients");
  for (std::string_view key : {"bf16_master_weights_and_grads", "bf16_optimizer_states"}) {
    flag = false;
    if (b.get_bool(key, &flag) && flag) {
      b.warn(key,
             "true has no effect: strata keeps fp32 master weights and fp32 optimizer "
             "state");
    }
  }
  STRATA_RETURN_IF_ERROR(b.finish());

  if (fp16_auto) {
    c->fp16.enabled = false;
    ctx.resolved("fp16.enabled", "false", "strata's default precision is bf16");
  }
  if (bf16_auto) {
    bf16_enabled = !c->fp16.enabled;
    ctx.resolved(str_cat(b.path(), ".enabled"), bf16_enabled ? "true" : "false",
                 bf16_enabled ? "fp16 is not enabled" : "fp16.enabled is true");
  }
  if (c->fp16.enabled && bf16_enabled) {
    return Status::invalid_argument(
        str_cat("fp16.enabled and ", b.path(), ".enabled are both true; enable at most one"));
  }
  c->precision = c->fp16.enabled ? Precision::kFp16
                 : bf16_enabled  ? Precision::kBf16
                                 : Precision::kFp32;
  return ctx.error();
}

// Explicitly given DeepSpeed nvme_paths, for the strata.io.paths precedence warning.
struct NvmePathsGiven {
  bool optimizer = false;
  bool param = false;
};

constexpr std::string_view kStagingGoverns =
    "strata sizes its own staging ring: strata.budgets.staging and strata.io.queue_depth govern";

Status parse_offload_optimizer(ObjectReader& z, bool* given, OffloadOptimizerConfig* o,
                               bool* nvme_path_given) {
  ObjectReader r = z.child("offload_optimizer");
  *given = r.present();
  r.get_enum<OffloadDevice>("device", kOffloadDeviceNames, &o->device);
  *nvme_path_given = r.get_string("nvme_path", /*allow_empty=*/false, &o->nvme_path);
  const bool on = o->device != OffloadDevice::kNone;
  const bool nvme = o->device == OffloadDevice::kNvme;
  if (r.get_bool("pin_memory", &o->pin_memory) && !o->pin_memory && on) {
    r.warn("pin_memory", "false has no effect: strata always pins its host buffers");
  }
  if (r.get_int("buffer_count", 0, kMaxI64, &o->buffer_count) && o->buffer_count != 4 && nvme) {
    r.warn("buffer_count", str_cat(o->buffer_count, " has no effect: ", kStagingGoverns));
  }
  if (r.get_bool("fast_init", &o->fast_init) && o->fast_init && nvme) {
    r.warn("fast_init",
           "true has no effect: strata creates its swap files the same way either "
           "way");
  }
  r.get_double("ratio", open_closed(0, 1), &o->ratio);
  r.ignore({"pipeline_read", "pipeline_write"}, "strata always overlaps swap I/O with compute");
  r.ignore({"super_offload", "convert_grad_on_cpu"}, "a DeepSpeed-specific offload variant");
  if (r.take("cpuadam_cores_perc") != nullptr) {
    r.warn("cpuadam_cores_perc",
           "has no effect: strata.cpu_adam.threads governs the CPU Adam "
           "threads");
  }
  return r.finish();
}

Status parse_offload_param(ObjectReader& z, bool* given, OffloadParamConfig* o,
                           bool* nvme_path_given) {
  ObjectReader r = z.child("offload_param");
  *given = r.present();
  r.get_enum<OffloadDevice>("device", kOffloadDeviceNames, &o->device);
  *nvme_path_given = r.get_string("nvme_path", /*allow_empty=*/false, &o->nvme_path);
  const bool on = o->device != OffloadDevice::kNone;
  const bool nvme = o->device == OffloadDevice::kNvme;
  if (r.get_bool("pin_memory", &o->pin_memory) && !o->pin_memory && on) {
    r.warn("pin_memory", "false has no effect: strata always pins its host buffers");
  }
  if (r.get_int("buffer_count", 0, kMaxI64, &o->buffer_count) && o->buffer_count != 5 && nvme) {
    r.warn("buffer_count", str_cat(o->buffer_count, " has no effect: ", kStagingGoverns));
  }
  if (r.get_int("buffer_size", 0, kMaxI64, &o->buffer_size) && o->buffer_size != 100'000'000 &&
      nvme) {
    r.warn("buffer_size", str_cat(o->buffer_size, " has no effect: ", kStagingGoverns));
  }
  if (r.get_int("max_in_cpu", 0, kMaxI64, &o->max_in_cpu) && o->max_in_cpu != 1'000'000'000 &&
      nvme) {
    r.warn("max_in_cpu", str_cat(o->max_in_cpu,
                                 " has no effect: strata.budgets.pinned governs "
                                 "how much stays in CPU memory"));
  }
  return r.finish();
}

// A zero_optimization size key (elements) that may be "auto".
void read_zero_size(ObjectReader& z, Context& ctx, std::initializer_list<Spelling> spellings,
                    std::int64_t auto_value, std::string_view auto_why, std::int64_t* out) {
  const std::string_view key = z.pick(spellings);
  if (z.take_auto(key)) {
    *out = auto_value;
    ctx.resolved(z.path_of(key), str_cat(auto_value), auto_why);
    return;
  }
  z.get_int(key, 0, kMaxI64, out);
}

Status parse_zero(ObjectReader& root, Context& ctx, ZeroConfig* zc, NvmePathsGiven* paths) {
  if (const Json* v = root.peek("zero_optimization"); v != nullptr && v->is_boolean()) {
    root.take("zero_optimization");
    root.fail("zero_optimization",
              str_cat("expected an object, got ", show(*v),
                      " (DeepSpeed's deprecated boolean form); write {\"stage\": 1}"));
    return ctx.error();
  }
  ObjectReader z = root.child("zero_optimization");
  z.get_int("stage", 0, 3, &zc->stage);

  bool optimizer_given = false;
  bool param_given = false;
  STRATA_RETURN_IF_ERROR(
      parse_offload_optimizer(z, &optimizer_given, &zc->offload_optimizer, &paths->optimizer));
  STRATA_RETURN_IF_ERROR(parse_offload_param(z, &param_given, &zc->offload_param, &paths->param));

  // Old forms: booleans that DeepSpeed maps to the offload sections.
  bool old_flag = false;
  if (z.get_bool("cpu_offload", &old_flag)) {
    if (old_flag && optimizer_given) {
      z.fail("cpu_offload",
             "true conflicts with zero_optimization.offload_optimizer: the old "
             "form and the new one; give offload_optimizer only");
    } else {
      z.warn("cpu_offload",
             str_cat("old form of offload_optimizer; read as ",
                     old_flag ? "offload_optimizer.device \"cpu\"" : "no optimizer offload",
                     " (write zero_optimization.offload_optimizer)"));
      if (old_flag) zc->offload_optimizer.device = OffloadDevice::kCpu;
    }
  }
  old_flag = false;
  if (z.get_bool("cpu_offload_param", &old_flag)) {
    if (old_flag && param_given) {
      z.fail("cpu_offload_param",
             "true conflicts with zero_optimization.offload_param: the old "
             "form and the new one; give offload_param only");
    } else {
      z.warn("cpu_offload_param",
             str_cat("old form of offload_param; read as ",
                     old_flag ? "offload_param.device \"cpu\"" : "no parameter offload",
                     " (write zero_optimization.offload_param)"));
      if (old_flag) zc->offload_param.device = OffloadDevice::kCpu;
    }
  }
  if (z.get_bool("cpu_offload_use_pin_memory", &old_flag)) {
    z.warn("cpu_offload_use_pin_memory",
           "old key; no effect: strata always pins its host "
           "buffers");
  }

  const std::int64_t h = ctx.options().hidden_size;
  const bool know_h = h > 0;
  const std::string h_text = str_cat("hidden_size ", h);
  read_zero_size(z, ctx, {{"sub_group_size"}}, zc->sub_group_size, "DeepSpeed's default",
                 &zc->sub_group_size);
  read_zero_size(z, ctx, {{"reduce_bucket_size"}}, know_h ? h * h : zc->reduce_bucket_size,
                 know_h ? str_cat(h_text, " squared") : "DeepSpeed's default; hidden_size unknown",
                 &zc->reduce_bucket_size);
  read_zero_size(
      z, ctx, {{"stage3_prefetch_bucket_size"}, {"prefetch_bucket_size"}},
      know_h ? (h * h / 10) * 9 + (h * h % 10) * 9 / 10 : zc->stage3_prefetch_bucket_size,
      know_h ? str_cat("0.9 x ", h_text, " squared") : "DeepSpeed's default; hidden_size unknown",
      &zc->stage3_prefetch_bucket_size);
  read_zero_size(z, ctx, {{"stage3_param_persistence_threshold"}, {"param_persistence_threshold"}},
                 know_h ? 10 * h : zc->stage3_param_persistence_threshold,
                 know_h ? str_cat("10 x ", h_text) : "DeepSpeed's default; hidden_size unknown",
                 &zc->stage3_param_persistence_threshold);
  z.get_int(z.pick({{"stage3_max_live_parameters"}, {"max_live_parameters"}}), 0, kMaxI64,
            &zc->stage3_max_live_parameters);
  z.get_int(z.pick({{"stage3_max_reuse_distance"}, {"max_reuse_distance"}}), 0, kMaxI64,
            &zc->stage3_max_reuse_distance);
  z.get_int("allgather_bucket_size", 0, kMaxI64, &zc->allgather_bucket_size);
  zc->overlap_comm = zc->stage == 3;  // DeepSpeed's stage-dependent default
  z.get_bool("overlap_comm", &zc->overlap_comm);
  z.get_bool("contiguous_gradients", &zc->contiguous_gradients);
  z.get_bool(z.pick({{"stage3_gather_16bit_weights_on_model_save"},
                     {"gather_16bit_weights_on_model_save"},
                     {"stage3_gather_fp16_weights_on_model_save", /*old=*/true}}),
             &zc->stage3_gather_16bit_weights_on_model_save);
  z.ignore({"reduce_scatter",
            "use_multi_rank_bucket_allreduce",
            "allgather_partitions",
            "load_from_fp32_weights",
            "elastic_checkpoint",
            "ignore_unused_parameters",
            "legacy_stage1",
            "round_robin_gradients",
            "zero_hpz_partition_size",
            "zero_quantized_weights",
            "zero_quantized_nontrainable_weights",
            "zero_quantized_gradients",
            "zeropp_loco_param",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "memory_efficient_linear",
            "pipeline_loading_checkpoint",
            "override_module_apply",
            "log_trace_cache_warnings",
            "enable_sanity_checks",
            "save_muon_momentum_buffer_in_memory",
            "leaf_module",
            "zenflow",
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            "stage3_partition_stream_chunk_size",
            "partition_stream_chunk_size"},
           "multi-GPU partitioning, communication or PyTorch module handling");
  STRATA_RETURN_IF_ERROR(z.finish());

  // DeepSpeed's placement rules.
  const std::string where = "zero_optimization";
  if (zc->offload_param.device != OffloadDevice::kNone && zc->stage != 3) {
    return Status::invalid_argument(str_cat(
        where, ".offload_param.device: \"", to_string(zc->offload_param.device),
        "\" needs zero_optimization.stage 3 (DeepSpeed offloads parameters only at stage 3); "
        "stage is ",
        zc->stage));
  }
  if (zc->offload_optimizer.device != OffloadDevice::kNone && zc->stage == 0) {
    return Status::invalid_argument(str_cat(where, ".offload_optimizer.device: \"",
                                            to_string(zc->offload_optimizer.device),
                                            "\" needs zero_optimization.stage 1, 2 or 3 (DeepSpeed "
                                            "offloads the optimizer only through ZeRO); "
                                            "stage is 0"));
  }
  if (zc->offload_optimizer.ratio < 1.0 && zc->stage != 3) {
    return Status::invalid_argument(str_cat(
        where, ".offload_optimizer.ratio: ", show_double(zc->offload_optimizer.ratio),
        " < 1 needs zero_optimization.stage 3 (DeepSpeed offloads part of the optimizer only at "
        "stage 3); stage is ",
        zc->stage));
  }
  return ctx.error();
}

// What the user gave under "aio", for strata.io's precedence rules.
struct AioGiven {
  bool queue_depth = false;
  bool block_size = false;
  bool posix = false;  // aio.io_backend "posix" (or an alias of it)
};

Status parse_aio(ObjectReader& root, Context& ctx, AioConfig* a, AioGiven* given) {
  ObjectReader r = root.child("aio");
  given->block_size = r.get_int("block_size", 1, kMaxI64, &a->block_size);
  given->queue_depth = r.get_int("queue_depth", 1, kMaxI64, &a->queue_depth);
  const std::string_view parallelism =
      r.pick({{"intra_op_parallelism"}, {"thread_count", /*old=*/true}});
  if (r.get_int(parallelism, 1, kMaxI64, &a->intra_op_parallelism) &&
      a->intra_op_parallelism != 1) {
    r.warn(parallelism, str_cat(a->intra_op_parallelism,
                                " has no effect: strata.io.rings governs "
                                "strata's I/O parallelism"));
  }
  if (r.get_bool("single_submit", &a->single_submit) && a->single_submit) {
    r.warn("single_submit", "true has no effect: strata batches its submissions itself");
  }
  if (r.get_bool("overlap_events", &a->overlap_events) && !a->overlap_events) {
    r.warn("overlap_events",
           "false has no effect: strata always overlaps submission and "
           "completion");
  }
  if (r.get_bool("use_gds", &a->use_gds) && a->use_gds) {
    r.warn("use_gds",
           "true has no effect: strata does not use GPUDirect Storage; swap I/O goes "
           "through pinned host buffers");
  }
  // DeepSpeed's io_backend: "async_io" (aliases aio, async, deepnvme) or "posix" (sync, simple).
  if (const Json* v = r.take("io_backend"); v != nullptr && ctx.ok()) {
    const std::string b = v->is_string() ? lower(v->get_ref<const std::string&>()) : "";
    if (b == "posix" || b == "sync" || b == "simple") {
      given->posix = true;
    } else if (b != "async_io" && b != "aio" && b != "async" && b != "deepnvme") {
      r.fail("io_backend", str_cat(show(*v), " is not one of async_io, posix"));
    }
  }
  return r.finish();
}

Status parse_strata(ObjectReader& root, Context& ctx, const AioConfig& aio,
                    const AioGiven& aio_given, bool* cpu_fraction_given, StrataConfig* s) {
  ObjectReader r = root.child("strata");
  r.get_bool("strict", &s->strict);
  r.get_u64("seed", &s->seed);

  ObjectReader b = r.child("budgets");
  b.get_bytes("device", 0, &s->budgets.device_bytes);
  b.get_bytes("pinned", 0, &s->budgets.pinned_bytes);
  b.get_bytes("staging", 0, &s->budgets.staging_bytes);
  b.get_bytes("disk", 0, &s->budgets.disk_bytes);
  STRATA_RETURN_IF_ERROR(b.finish());

  if (r.get_bytes("chunk_bytes", 1, &s->chunk_bytes) && s->chunk_bytes % kNormBlockBytes != 0) {
    r.fail("chunk_bytes", str_cat(r.bytes_text("chunk_bytes", s->chunk_bytes),
                                  " is not a multiple of ", kNormBlockBytes,
                                  " bytes (the norm block: ", kNormBlockElems, " fp32 elements)"));
  }
  *cpu_fraction_given =
      r.get_double("optimizer_cpu_fraction", closed(0, 1), &s->optimizer_cpu_fraction);

  ObjectReader io = r.child("io");
  const bool backend_given = io.get_enum<IoBackend>("backend", kIoBackendNames, &s->io.backend);
  io.get_string_list("paths", &s->io.paths);
  if (io.get_bytes("stripe_bytes", 1, &s->io.stripe_bytes) &&
      s->io.stripe_bytes % kDirectIoAlignment != 0) {
    io.fail("stripe_bytes",
            str_cat(io.bytes_text("stripe_bytes", s->io.stripe_bytes), " is not a multiple of ",
                    kDirectIoAlignment, " bytes (the O_DIRECT alignment)"));
  }
  const bool queue_depth_given = io.get_int("queue_depth", 1, kMaxQueueDepth, &s->io.queue_depth);
  const bool block_given = io.get_bytes("block_bytes", 1, &s->io.block_bytes);
  if (block_given && s->io.block_bytes % kDirectIoAlignment != 0) {
    io.fail("block_bytes",
            str_cat(io.bytes_text("block_bytes", s->io.block_bytes), " is not a multiple of ",
                    kDirectIoAlignment, " bytes (the O_DIRECT alignment)"));
  }
  io.get_int("rings", 1, 64, &s->io.rings);
  io.get_bool("sqpoll", &s->io.sqpoll);
  io.get_bool("keep_files", &s->io.keep_files);
  STRATA_RETURN_IF_ERROR(io.finish());

  // Precedence: strata.io.* when given, else DeepSpeed's aio.* equivalents.
  if (!queue_depth_given && aio_given.queue_depth) {
    if (aio.queue_depth > kMaxQueueDepth) {
      return Status::invalid_argument(
          str_cat("aio.queue_depth: ", aio.queue_depth, " must be in [1, ", kMaxQueueDepth,
                  "] (strata uses it as strata.io.queue_depth, which is not set)"));
    }
    s->io.queue_depth = aio.queue_depth;
    ctx.note("strata.io.queue_depth", str_cat(s->io.queue_depth, ", from aio.queue_depth"));
  }
  if (!block_given) {
    if (static_cast<std::uint64_t>(aio.block_size) % kDirectIoAlignment != 0) {
      return Status::invalid_argument(
          str_cat("aio.block_size: ", aio.block_size, " is not a multiple of ", kDirectIoAlignment,
                  " bytes (strata uses it as strata.io.block_bytes, which is not set)"));
    }
    s->io.block_bytes = static_cast<std::uint64_t>(aio.block_size);
    if (aio_given.block_size) {
      ctx.note("strata.io.block_bytes", str_cat(s->io.block_bytes, ", from aio.block_size"));
    }
  }
  if (!backend_given && aio_given.posix) {
    s->io.backend = IoBackend::kPsync;
    ctx.note("strata.io.backend", "psync, from aio.io_backend \"posix\"");
  }

  r.get_bool("crc", &s->crc);
  ObjectReader adam = r.child("cpu_adam");
  adam.get_enum<CpuAdamIsa>("isa", kCpuAdamIsaNames, &s->cpu_adam.isa);
  adam.get_int("threads", 0, 4096, &s->cpu_adam.threads);
  if (adam.get_int("tile_elems", 0, kMaxI64, &s->cpu_adam.tile_elems) &&
      s->cpu_adam.tile_elems % kNormBlockElems != 0) {
    adam.fail("tile_elems", str_cat(s->cpu_adam.tile_elems, " is not a multiple of ",
                                    kNormBlockElems, " (the norm block, in fp32 elements)"));
  }
  STRATA_RETURN_IF_ERROR(adam.finish());

  r.get_enum<OverlapMode>("overlap", kOverlapNames, &s->overlap);
  r.get_enum<DeviceKind>("device", kDeviceNames, &s->device);
  ObjectReader hd = r.child("host_device");
  hd.get_bytes("memory_bytes", 1, &s->host_device.memory_bytes);
  hd.get_double("h2d_gbps", at_least(0), &s->host_device.h2d_gbps);
  hd.get_double("d2h_gbps", at_least(0), &s->host_device.d2h_gbps);
  hd.get_double("d2d_gbps", at_least(0), &s->host_device.d2d_gbps);
  hd.get_double("tflops", at_least(0), &s->host_device.tflops);
  STRATA_RETURN_IF_ERROR(hd.finish());
  r.get_enum<NonfinitePolicy>("nonfinite", kNonfiniteNames, &s->nonfinite);
  r.get_string("trace", /*allow_empty=*/true, &s->trace);
  STRATA_RETURN_IF_ERROR(r.finish());

  if (s->budgets.staging_bytes != 0 && s->budgets.pinned_bytes != 0 &&
      s->budgets.staging_bytes > s->budgets.pinned_bytes) {
    return Status::invalid_argument(
        str_cat("strata.budgets.staging: ", s->budgets.staging_bytes, " bytes (",
                core::format_bytes(s->budgets.staging_bytes), ") exceeds strata.budgets.pinned ",
                s->budgets.pinned_bytes, " bytes (", core::format_bytes(s->budgets.pinned_bytes),
                "); the staging ring is part of pinned memory"));
  }
  return ctx.error();
}

// DeepSpeed keys outside strata's scope, accepted with an info note.
void ignore_top_level(ObjectReader& r, Context& ctx) {
  r.ignore(
      {"steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard",
       "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers"},
      "monitoring and logging belong to the framework");
  r.ignore({"communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
            "gradient_predivide_factor", "gradient_allreduce_op", "disable_allgather",
            "sparse_gradients", "sequence_parallel_size", "tensor_parallel", "expert_parallel",
            "use_data_before_expert_parallel_", "pipeline", "managed_gradient_accumulation"},
           "communication between GPUs; strata trains on one GPU");
  r.ignore({"activation_checkpointing", "sparse_attention", "progressive_layer_drop",
            "curriculum_learning", "data_efficiency", "compression_training", "quantize_training",
            "eigenvalue", "weight_quantization", "hybrid_engine", "compile", "torch_autocast",
            "graph_harvesting", "data_types", "dataloader_drop_last", "vocabulary_size",
            "elasticity", "autotuning"},
           "a model, data or autotuning feature of the framework");
  r.ignore({"checkpoint", "nebula", "datastates"}, "strata writes its own checkpoints");
  r.ignore({"zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"},
           "strata always runs its own CPU optimizer");
  if (const Json* amp = r.take("amp"); amp != nullptr && ctx.ok()) {
    const auto e = amp->is_object() ? amp->find("enabled") : amp->end();
    const bool enabled = amp->is_object() && e != amp->end() && e->is_boolean() && e->get<bool>();
    if (enabled) {
      r.warn("amp", "Apex AMP has no effect in strata; use bf16 or fp16");
    } else {
      ctx.note("amp", "accepted; no effect in strata (Apex AMP is not supported)");
    }
  }
}

// strata.io.paths versus the DeepSpeed nvme_paths it overrides.
void warn_overridden_nvme_paths(Context& ctx, const Config& c, const NvmePathsGiven& given) {
  const std::vector<std::string>& paths = c.strata.io.paths;
  auto check = [&](std::string_view section, OffloadDevice device, const std::string& nvme_path,
                   bool explicit_path) {
    if (device != OffloadDevice::kNvme) return;
    if (paths.empty()) {
      if (!explicit_path) {
        ctx.note(str_cat("zero_optimization.", section, ".nvme_path"),
                 str_cat("not set: swap files go to DeepSpeed's default ", kDefaultNvmePath));
      }
      return;
    }
    if (!explicit_path || std::find(paths.begin(), paths.end(), nvme_path) != paths.end()) return;
    ctx.warn(str_cat("zero_optimization.", section, ".nvme_path"),
             str_cat(show(Json(nvme_path)), " differs from strata.io.paths ", show_paths(paths),
                     "; strata.io.paths wins"));
  };
  check("offload_optimizer", c.zero.offload_optimizer.device, c.zero.offload_optimizer.nvme_path,
        given.optimizer);
  check("offload_param", c.zero.offload_param.device, c.zero.offload_param.nvme_path, given.param);
}

core::Result<Config> parse_config_unsafe(std::string_view text, const ParseOptions& options) {
  if (options.hidden_size < 0 || options.hidden_size > 3'000'000'000) {
    return Status::invalid_argument(
        str_cat("ParseOptions.hidden_size: ", options.hidden_size, " must be in [0, 3000000000]"));
  }
  if (options.total_num_steps < 0) {
    return Status::invalid_argument(
        str_cat("ParseOptions.total_num_steps: ", options.total_num_steps, " must be >= 0"));
  }
  Json root;
  STRATA_RETURN_IF_ERROR(parse_json(text, &root));
  if (!root.is_object()) {
    return Status::invalid_argument(
        str_cat("config: expected a JSON object at the top level, got ", show(root)));
  }
  // strata.strict first: it decides whether unknown keys anywhere are errors.
  bool strict = options.strict;
  if (const auto s = root.find("strata"); s != root.end() && s->is_object()) {
    if (const auto k = s->find("strict"); k != s->end() && k->is_boolean()) {
      strict = strict || k->get<bool>();
    }
  }
  Context ctx(options, strict);
  Config c;
  ObjectReader r(&root, "", &ctx);
  NvmePathsGiven nvme_paths_given;
  AioGiven aio_given;
  bool cpu_fraction_given = false;

  STRATA_RETURN_IF_ERROR(parse_batch(r, ctx, &c));
  STRATA_RETURN_IF_ERROR(parse_optimizer(r, ctx, &c.optimizer));
  STRATA_RETURN_IF_ERROR(parse_scheduler(r, ctx, c.optimizer, &c.scheduler));
  STRATA_RETURN_IF_ERROR(parse_precision(r, ctx, &c));
  STRATA_RETURN_IF_ERROR(parse_zero(r, ctx, &c.zero, &nvme_paths_given));
  STRATA_RETURN_IF_ERROR(parse_aio(r, ctx, &c.aio, &aio_given));
  STRATA_RETURN_IF_ERROR(parse_strata(r, ctx, c.aio, aio_given, &cpu_fraction_given, &c.strata));
  ignore_top_level(r, ctx);
  STRATA_RETURN_IF_ERROR(r.finish());

  if (cpu_fraction_given && c.zero.offload_optimizer.device != OffloadDevice::kNvme) {
    return Status::invalid_argument(
        str_cat("strata.optimizer_cpu_fraction: ", show_double(c.strata.optimizer_cpu_fraction),
                " is set but zero_optimization.offload_optimizer.device is \"",
                to_string(c.zero.offload_optimizer.device),
                "\"; it splits optimizer state between CPU and NVMe, so it needs device \"nvme\""));
  }
  warn_overridden_nvme_paths(ctx, c, nvme_paths_given);
  c.strata.strict = c.strata.strict || options.strict;
  c.warnings = ctx.take_warnings();
  return c;
}

}  // namespace

std::vector<std::string> Config::swap_paths() const {
  const bool optimizer_nvme = zero.offload_optimizer.device == OffloadDevice::kNvme;
  const bool param_nvme = zero.offload_param.device == OffloadDevice::kNvme;
  if (!optimizer_nvme && !param_nvme) return {};
  if (!strata.io.paths.empty()) return strata.io.paths;
  std::vector<std::string> out;
  if (optimizer_nvme) out.push_back(zero.offload_optimizer.nvme_path);
  if (param_nvme && std::find(out.begin(), out.end(), zero.offload_param.nvme_path) == out.end()) {
    out.push_back(zero.offload_param.nvme_path);
  }
  return out;
}

core::Result<Config> parse_config(std::string_view json_text, const ParseOptions& options) {
  try {
    return parse_config_unsafe(json_text, options);
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("config: out of memory while parsing");
  } catch (const std::exception& e) {
    return Status::internal(str_cat("config: unexpected exception while parsing: ", e.what()));
  }
}

core::Result<Config> load_config_file(const std::string& path, const ParseOptions& options) {
  std::string text;
  {
    core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      const int err = errno;
      return Status::from_errno(err, str_cat("config file '", path, "': cannot open"));
    }
    char buffer[65536];
    for (;;) {
      const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
      if (n < 0) {
        const int err = errno;
        if (err == EINTR) continue;
        return Status::from_errno(err, str_cat("config file '", path, "': cannot read"));
      }
      if (n == 0) break;
      text.append(buffer, static_cast<std::size_t>(n));
    }
  }
  core::Result<Config> config = parse_config(text, options);
  if (!config.ok()) return std::move(config).status().annotate(str_cat("config file '", path, "'"));
  return config;
}

}  // namespace strata::engine
