// The section readers parse_config (engine/config.cpp) runs in order, and what
// they hand each other. DeepSpeed's sections are in deepspeed.cpp and
// deepspeed_optimizer.cpp, strata's own keys in strata_keys.cpp. Private to
// engine/config*.
//
// Each reader takes the document's root reader and the parse's Context,
// fills its part of the Config, marks its keys known, and returns the
// context's first error (kInvalidArgument naming the key path), or an error
// of its own for a rule between keys.
#pragma once

#include "core/status.h"
#include "engine/config.h"
#include "engine/config/json_reader.h"

namespace strata::engine::config_internal {

// Explicitly given DeepSpeed nvme_paths, for the strata.io.paths precedence warning.
struct NvmePathsGiven {
  bool optimizer = false;
  bool param = false;
};

// What the user gave under "aio", for strata.io's precedence rules.
struct AioGiven {
  bool queue_depth = false;
  bool block_size = false;
  bool posix = false;  // aio.io_backend "posix" (or an alias of it)
};

// --- deepspeed.cpp ---

// train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
// (resolved as DeepSpeed does with one process) and gradient_clipping.
core::Status parse_batch(ObjectReader& r, Context& ctx, Config* c);
// "fp16" and "bf16" (old name "bfloat16"): c->fp16 and c->precision.
core::Status parse_precision(ObjectReader& root, Context& ctx, Config* c);
// "zero_optimization" with offload_optimizer and offload_param, its old forms,
// and DeepSpeed's placement rules (offload needs the right stage).
core::Status parse_zero(ObjectReader& root, Context& ctx, ZeroConfig* zc, NvmePathsGiven* paths);
// "aio" (DeepSpeed's async I/O settings).
core::Status parse_aio(ObjectReader& root, Context& ctx, AioConfig* a, AioGiven* given);
// DeepSpeed's top-level keys outside strata's scope: accepted, noted at info level.
void ignore_top_level(ObjectReader& r, Context& ctx);

// --- deepspeed_optimizer.cpp ---

// "optimizer": type and params (Adam, AdamW; Adagrad and Lion refused as not implemented).
core::Status parse_optimizer(ObjectReader& root, Context& ctx, OptimizerConfig* o);
// "scheduler": type and params; warmup_max_lr may come from `optimizer`.
core::Status parse_scheduler(ObjectReader& root, Context& ctx, const OptimizerConfig& optimizer,
                             SchedulerConfig* s);

// --- strata_keys.cpp ---

// "strata": budgets, chunk_bytes, io (falling back on DeepSpeed's aio keys),
// checkpoint, cpu_adam, overlap, device, host_device, nonfinite, trace, strict.
// *cpu_fraction_given says whether strata.optimizer_cpu_fraction was given.
core::Status parse_strata(ObjectReader& root, Context& ctx, const AioConfig& aio,
                          const AioGiven& aio_given, bool* cpu_fraction_given, StrataConfig* s);
// strata.io.paths versus the DeepSpeed nvme_paths it overrides: a warning for
// each explicit nvme_path of an nvme placement that strata.io.paths lacks.
void warn_overridden_nvme_paths(Context& ctx, const Config& c, const NvmePathsGiven& given);

}  // namespace strata::engine::config_internal
