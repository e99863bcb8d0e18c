// DeepSpeed's sections other than the optimizer's: the batch sizes and
// gradient_clipping, fp16/bf16, zero_optimization (offload_optimizer,
// offload_param, old forms, placement rules), aio, and the top-level keys
// accepted without effect. Keys, meaning and defaults: docs/config.md.
#include <cstdint>
#include <initializer_list>
#include <limits>
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
  // With device nvme, the compute copies' elements kept in pinned memory
  // (layout.cpp); no effect otherwise, as in DeepSpeed. "auto": finalize
  // fills what strata.budgets.pinned leaves (parse_config checks it is set).
  if (r.take_auto("max_in_cpu")) {
    o->max_in_cpu_auto = true;
  } else {
    r.get_int("max_in_cpu", 0, kMaxI64, &o->max_in_cpu);
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

}  // namespace

// train_batch_size = micro x gas x world size (ParseOptions::world_size),
// resolved as DeepSpeed does.
Status parse_batch(ObjectReader& r, Context& ctx, Config* c) {
  constexpr std::string_view kTrain = "train_batch_size";
  constexpr std::string_view kMicro = "train_micro_batch_size_per_gpu";
  constexpr std::string_view kGas = "gradient_accumulation_steps";
  const std::int64_t world = ctx.options().world_size;
  // " x world size (N)" in messages when there are several ranks.
  const std::string x_world = world > 1 ? str_cat(" x the world size (", world, ")") : std::string();
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
  // What one rank's micro-batches add up to across the ranks: micro x world
  // (kept below 2^63 by the checks below).
  std::int64_t per_step_unit = 0;
  if (has_micro && __builtin_mul_overflow(micro, world, &per_step_unit)) {
    return Status::invalid_argument(str_cat(kMicro, " (", micro, ")", x_world, " overflows a 64-bit integer"));
  }
  if (has_micro && has_gas) {
    std::int64_t product = 0;
    if (__builtin_mul_overflow(per_step_unit, gas, &product)) {
      return Status::invalid_argument(
          str_cat(kMicro, " (", micro, ") x ", kGas, " (", gas, ")", x_world, " overflows a 64-bit integer"));
    }
    if (has_train && train != product) {
      return Status::invalid_argument(str_cat(kTrain, ": ", train, " != ", kMicro, " (", micro,
                                              ") x ", kGas, " (", gas, ")", x_world, " = ", product));
    }
    train = product;
  } else if (has_train && has_micro) {
    if (train % per_step_unit != 0) {
      return Status::invalid_argument(
          str_cat(kTrain, ": ", train, " is not a multiple of ", kMicro, " (", micro, ")", x_world));
    }
    gas = train / per_step_unit;
  } else if (has_train && has_gas) {
    std::int64_t gas_world = 0;
    if (__builtin_mul_overflow(gas, world, &gas_world) || train % gas_world != 0) {
      return Status::invalid_argument(
          str_cat(kTrain, ": ", train, " is not a multiple of ", kGas, " (", gas, ")", x_world));
    }
    micro = train / gas_world;
  } else if (has_train) {
    if (train % world != 0) {
      return Status::invalid_argument(str_cat(kTrain, ": ", train, " is not a multiple of the world size (", world, ")"));
    }
    micro = train / world;
    gas = 1;
  } else if (has_micro) {
    train = per_step_unit;
    gas = 1;
  } else {
    return Status::invalid_argument(str_cat(
        kTrain, ", ", kMicro, ": neither is set; give at least one of them (DeepSpeed needs one: ",
        kGas, " alone does not determine the batch)"));
  }
  if (train_auto) ctx.resolved(kTrain, str_cat(train), str_cat(kMicro, " x ", kGas, world > 1 ? " x the world size" : ""));
  c->train_batch_size = train;
  c->train_micro_batch_size_per_gpu = micro;
  c->gradient_accumulation_steps = gas;

  if (r.take_auto("gradient_clipping")) {
    c->gradient_clipping = 1.0;
    ctx.resolved("gradient_clipping", "1", "Hugging Face's default max_grad_norm");
  } else {
    r.get_double("gradient_clipping", at_least(0), &c->gradient_clipping);
  }
  if (r.get_enum<Precision>("communication_data_type", kPrecisionNames, &c->communication_data_type) &&
      c->communication_data_type == Precision::kFp16) {
    r.fail("communication_data_type",
           "\"fp16\": strata sums gradients over the ranks in fp32 or bf16 (fp16 sums of scaled gradients "
           "overflow); use \"bf16\" or \"fp32\"");
  }
  return ctx.error();
}

Status parse_precision(ObjectReader& root, Context& ctx, Config* c) {
  ObjectReader f = root.child("fp16");
  const bool fp16_auto = f.take_auto("enabled");
  if (!fp16_auto) f.get_bool("enabled", &c->fp16.enabled);
  f.get_double("loss_scale", at_least(0), &c->fp16.loss_scale);
  f.get_int("initial_scale_power", 0, 126, &c->fp16.initial_scale_power);
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

namespace {

// zero_optimization's offload sections, and the old boolean forms DeepSpeed
// maps to them.
Status parse_zero_offload(ObjectReader& z, ZeroConfig* zc, NvmePathsGiven* paths) {
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
  return Status();
}

// zero_optimization's sizes (defaults from hidden_size where DeepSpeed's
// depend on it) and flags.
void read_zero_sizes(ObjectReader& z, Context& ctx, ZeroConfig* zc) {
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
}

// zero_optimization's keys strata reads and ignores (a warning each).
void ignore_zero_keys(ObjectReader& z) {
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
}

// DeepSpeed's placement rules: which offloads each stage allows.
Status check_zero_placement(const ZeroConfig& zc) {
  const std::string where = "zero_optimization";
  if (zc.offload_param.device != OffloadDevice::kNone && zc.stage != 3) {
    return Status::invalid_argument(str_cat(
        where, ".offload_param.device: \"", to_string(zc.offload_param.device),
        "\" needs zero_optimization.stage 3 (DeepSpeed offloads parameters only at stage 3); "
        "stage is ",
        zc.stage));
  }
  if (zc.offload_optimizer.device != OffloadDevice::kNone && zc.stage == 0) {
    return Status::invalid_argument(str_cat(where, ".offload_optimizer.device: \"",
                                            to_string(zc.offload_optimizer.device),
                                            "\" needs zero_optimization.stage 1, 2 or 3 (DeepSpeed "
                                            "offloads the optimizer only through ZeRO); "
                                            "stage is 0"));
  }
  if (zc.offload_optimizer.ratio < 1.0 && zc.stage != 3) {
    return Status::invalid_argument(str_cat(
        where, ".offload_optimizer.ratio: ", show_double(zc.offload_optimizer.ratio),
        " < 1 needs zero_optimization.stage 3 (DeepSpeed offloads part of the optimizer only at "
        "stage 3); stage is ",
        zc.stage));
  }
  return Status();
}

}  // namespace

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

  STRATA_RETURN_IF_ERROR(parse_zero_offload(z, zc, paths));
  read_zero_sizes(z, ctx, zc);
  ignore_zero_keys(z);
  STRATA_RETURN_IF_ERROR(z.finish());
  STRATA_RETURN_IF_ERROR(check_zero_placement(*zc));
  return ctx.error();
}

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

// DeepSpeed keys outside strata's scope, accepted with an info note.
void ignore_top_level(ObjectReader& r, Context& ctx) {
  r.ignore(
      {"steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard",
       "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "timers"},
      "monitoring and logging belong to the framework");
  r.ignore({"seq_parallel_communication_data_type", "prescale_gradients",
            "gradient_predivide_factor", "gradient_allreduce_op", "disable_allgather",
            "sparse_gradients", "sequence_parallel_size", "tensor_parallel", "expert_parallel",
            "use_data_before_expert_parallel_", "pipeline", "managed_gradient_accumulation"},
           "other parallelism than data parallelism, or DeepSpeed's own gradient scaling");
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

}  // namespace strata::engine::config_internal
