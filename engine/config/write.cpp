// Writing the configuration back: to_json (every key, defaults filled in,
// current names and forms only, so that parse_config(to_json(c)) gives back c)
// and the JSON spellings of engine/config.h's enums (to_string).
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/logging.h"
#include "engine/config.h"
#include "engine/config/json_reader.h"
#include "engine/config/keys.h"

namespace strata::engine {
namespace {

namespace ci = config_internal;

using config_internal::kDefaultNvmePath;
using OrderedJson = nlohmann::ordered_json;

// "optimizer": its type and the params its type reads.
OrderedJson optimizer_json(const OptimizerConfig& o) {
  OrderedJson op;
  op["lr"] = o.lr;
  if (o.type != OptimizerType::kAdagrad) op["betas"] = {o.beta1, o.beta2};
  if (o.type != OptimizerType::kLion) op["eps"] = o.eps;
  op["weight_decay"] = o.weight_decay;
  if (o.type == OptimizerType::kAdam || o.type == OptimizerType::kAdamW) {
    op["adam_w_mode"] = o.adam_w_mode;
    op["bias_correction"] = o.bias_correction;
  }
  return {{"type", std::string(to_string(o.type))}, {"params", op}};
}

// "scheduler", when there is one.
void put_scheduler(const SchedulerConfig& s, OrderedJson& j) {
  if (s.type != SchedulerType::kNone) {
    OrderedJson sp;
    if (s.type == SchedulerType::kWarmupCosineLR) {
      sp["warmup_min_ratio"] = s.warmup_min_ratio;
      sp["cos_min_ratio"] = s.cos_min_ratio;
    } else {
      sp["warmup_min_lr"] = s.warmup_min_lr;
      sp["warmup_max_lr"] = s.warmup_max_lr;
    }
    sp["warmup_num_steps"] = s.warmup_num_steps;
    sp["warmup_type"] = std::string(to_string(s.warmup_type));
    if (s.type != SchedulerType::kWarmupLR) sp["total_num_steps"] = s.total_num_steps;
    j["scheduler"] = {{"type", std::string(to_string(s.type))}, {"params", sp}};
  }
}

// "zero_optimization", its offload sections included.
OrderedJson zero_json(const ZeroConfig& z) {
  OrderedJson oo;
  oo["device"] = std::string(to_string(z.offload_optimizer.device));
  if (z.offload_optimizer.nvme_path != kDefaultNvmePath) {
    oo["nvme_path"] = z.offload_optimizer.nvme_path;
  }
  if (z.offload_optimizer.pin_memory) oo["pin_memory"] = true;
  oo["buffer_count"] = z.offload_optimizer.buffer_count;
  oo["fast_init"] = z.offload_optimizer.fast_init;
  oo["ratio"] = z.offload_optimizer.ratio;
  OrderedJson opar;
  opar["device"] = std::string(to_string(z.offload_param.device));
  if (z.offload_param.nvme_path != kDefaultNvmePath) opar["nvme_path"] = z.offload_param.nvme_path;
  if (z.offload_param.pin_memory) opar["pin_memory"] = true;
  opar["buffer_count"] = z.offload_param.buffer_count;
  opar["buffer_size"] = z.offload_param.buffer_size;
  if (z.offload_param.max_in_cpu_auto) {
    opar["max_in_cpu"] = "auto";
  } else {
    opar["max_in_cpu"] = z.offload_param.max_in_cpu;
  }
  OrderedJson zj;
  zj["stage"] = z.stage;
  zj["offload_optimizer"] = oo;
  zj["offload_param"] = opar;
  zj["sub_group_size"] = z.sub_group_size;
  zj["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size;
  zj["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zj["stage3_max_reuse_distance"] = z.stage3_max_reuse_distance;
  zj["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold;
  zj["reduce_bucket_size"] = z.reduce_bucket_size;
  zj["allgather_bucket_size"] = z.allgather_bucket_size;
  zj["overlap_comm"] = z.overlap_comm;
  zj["contiguous_gradients"] = z.contiguous_gradients;
  zj["stage3_gather_16bit_weights_on_model_save"] = z.stage3_gather_16bit_weights_on_model_save;
  return zj;
}

// "strata": strata's own keys (`z`: optimizer_cpu_fraction is written only
// with the optimizer on nvme).
OrderedJson strata_json(const StrataConfig& st, const ZeroConfig& z) {
  OrderedJson sj;
  sj["seed"] = st.seed;
  sj["budgets"] = {{"device", st.budgets.device_bytes},
                   {"pinned", st.budgets.pinned_bytes},
                   {"staging", st.budgets.staging_bytes},
                   {"disk", st.budgets.disk_bytes}};
  sj["chunk_bytes"] = st.chunk_bytes;
  if (z.offload_optimizer.device == OffloadDevice::kNvme) {
    sj["optimizer_cpu_fraction"] = st.optimizer_cpu_fraction;
  }
  sj["optimizer_state"] = {{"format", std::string(to_string(st.optimizer_state.format))},
                           {"rounding", std::string(to_string(st.optimizer_state.rounding))}};
  OrderedJson io;
  io["backend"] = std::string(to_string(st.io.backend));
  if (!st.io.paths.empty()) io["paths"] = st.io.paths;
  io["stripe_bytes"] = st.io.stripe_bytes;
  io["queue_depth"] = st.io.queue_depth;
  io["block_bytes"] = st.io.block_bytes;
  io["rings"] = st.io.rings;
  io["sqpoll"] = st.io.sqpoll;
  io["keep_files"] = st.io.keep_files;
  sj["io"] = io;
  sj["checkpoint"] = {{"keep_last", st.checkpoint.keep_last},
                      {"keep_every", st.checkpoint.keep_every},
                      {"keep_base", st.checkpoint.keep_base}};
  sj["crc"] = st.crc;
  sj["frozen_base"] = std::string(to_string(st.frozen_base));
  sj["no_grad"] = std::string(to_string(st.no_grad));
  sj["cpu_adam"] = {{"isa", std::string(to_string(st.cpu_adam.isa))},
                    {"threads", st.cpu_adam.threads},
                    {"tile_elems", st.cpu_adam.tile_elems},
                    {"bind", std::string(to_string(st.cpu_adam.bind))},
                    {"numa_node", st.cpu_adam.numa_node}};
  sj["overlap"] = std::string(to_string(st.overlap));
  sj["device"] = std::string(to_string(st.device));
  sj["device_collectives"] = std::string(to_string(st.device_collectives));
  sj["host_device"] = {{"memory_bytes", st.host_device.memory_bytes},
                       {"h2d_gbps", st.host_device.h2d_gbps},
                       {"d2h_gbps", st.host_device.d2h_gbps},
                       {"d2d_gbps", st.host_device.d2d_gbps},
                       {"tflops", st.host_device.tflops}};
  sj["nonfinite"] = std::string(to_string(st.nonfinite));
  sj["trace"] = st.trace;
  sj["strict"] = st.strict;
  return sj;
}

OrderedJson to_ordered_json(const Config& c) {
  OrderedJson j;
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["gradient_clipping"] = c.gradient_clipping;
  j["communication_data_type"] = std::string(to_string(c.communication_data_type));

  j["optimizer"] = optimizer_json(c.optimizer);
  put_scheduler(c.scheduler, j);
  j["fp16"] = {{"enabled", c.precision == Precision::kFp16},
               {"loss_scale", c.fp16.loss_scale},
               {"initial_scale_power", c.fp16.initial_scale_power},
               {"loss_scale_window", c.fp16.loss_scale_window},
               {"hysteresis", c.fp16.hysteresis},
               {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
               {"min_loss_scale", c.fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", c.precision == Precision::kBf16}};

  j["zero_optimization"] = zero_json(c.zero);
  j["aio"] = {{"block_size", c.aio.block_size},
              {"queue_depth", c.aio.queue_depth},
              {"intra_op_parallelism", c.aio.intra_op_parallelism},
              {"single_submit", c.aio.single_submit},
              {"overlap_events", c.aio.overlap_events},
              {"use_gds", c.aio.use_gds}};

  j["strata"] = strata_json(c.strata, c.zero);
  return j;
}

}  // namespace

// The names come from keys.h, the tables the reader matches against.
std::string_view to_string(OffloadDevice v) {
  return ci::name_of<OffloadDevice>(ci::kOffloadDeviceNames, v);
}
std::string_view to_string(OptimizerType v) {
  return ci::name_of<OptimizerType>(ci::kOptimizerNames, v);
}
std::string_view to_string(SchedulerType v) {
  return ci::name_of<SchedulerType>(ci::kSchedulerNames, v);
}
std::string_view to_string(WarmupType v) {
  return ci::name_of<WarmupType>(ci::kWarmupTypeNames, v);
}
std::string_view to_string(Precision v) {
  return ci::name_of<Precision>(ci::kPrecisionNames, v);
}
std::string_view to_string(IoBackend v) {
  return ci::name_of<IoBackend>(ci::kIoBackendNames, v);
}
std::string_view to_string(CpuAdamIsa v) {
  return ci::name_of<CpuAdamIsa>(ci::kCpuAdamIsaNames, v);
}
std::string_view to_string(CpuAdamBind v) {
  return ci::name_of<CpuAdamBind>(ci::kCpuAdamBindNames, v);
}
std::string_view to_string(NoGradPolicy v) { return ci::name_of<NoGradPolicy>(ci::kNoGradNames, v); }

std::string_view to_string(FrozenBase v) {
  return ci::name_of<FrozenBase>(ci::kFrozenBaseNames, v);
}
std::string_view to_string(OverlapMode v) {
  return ci::name_of<OverlapMode>(ci::kOverlapNames, v);
}
std::string_view to_string(DeviceCollectives v) {
  return ci::name_of<DeviceCollectives>(ci::kDeviceCollectivesNames, v);
}
std::string_view to_string(DeviceKind v) {
  return ci::name_of<DeviceKind>(ci::kDeviceNames, v);
}
std::string_view to_string(NonfinitePolicy v) {
  return ci::name_of<NonfinitePolicy>(ci::kNonfiniteNames, v);
}
std::string_view to_string(StateFormat v) { return ci::name_of<StateFormat>(ci::kStateFormatNames, v); }
std::string_view to_string(StateRounding v) { return ci::name_of<StateRounding>(ci::kStateRoundingNames, v); }

std::string to_json(const Config& config) {
  try {
    return to_ordered_json(config).dump(2, ' ', false, OrderedJson::error_handler_t::replace) +
           "\n";
  } catch (const std::exception& e) {
    STRATA_LOG(kError) << "config: to_json failed: " << e.what();
    return std::string();
  }
}

}  // namespace strata::engine
