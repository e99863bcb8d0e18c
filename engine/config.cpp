// The entry points of engine/config.h: parse_config runs the section readers
// (engine/config/: the JSON reader, DeepSpeed's sections, strata's keys) in
// order and checks the rules between sections; load_config_file reads a file;
// Config::swap_paths. to_json and to_string are in engine/config/write.cpp.
#include "engine/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/result.h"
#include "core/status.h"
#include "core/str.h"
#include "core/unique_fd.h"
#include "engine/config/json_reader.h"
#include "engine/config/sections.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
// The JSON reader (engine/config/json_reader.h).
using config_internal::Context;
using config_internal::Json;
using config_internal::ObjectReader;
using config_internal::parse_json;
using config_internal::show;
using config_internal::show_double;
// The section readers (engine/config/sections.h), in the order they run.
using config_internal::AioGiven;
using config_internal::NvmePathsGiven;
using config_internal::parse_batch;
using config_internal::parse_optimizer;
using config_internal::parse_scheduler;
using config_internal::parse_precision;
using config_internal::parse_zero;
using config_internal::parse_aio;
using config_internal::parse_strata;
using config_internal::ignore_top_level;
using config_internal::warn_overridden_nvme_paths;

core::Result<Config> parse_config_unsafe(std::string_view text, const ParseOptions& options) {
  if (options.hidden_size < 0 || options.hidden_size > 3'000'000'000) {
    return Status::invalid_argument(
        str_cat("ParseOptions.hidden_size: ", options.hidden_size, " must be in [0, 3000000000]"));
  }
  if (options.total_num_steps < 0) {
    return Status::invalid_argument(
        str_cat("ParseOptions.total_num_steps: ", options.total_num_steps, " must be >= 0"));
  }
  if (options.world_size < 1 || options.world_size > (1 << 20)) {
    return Status::invalid_argument(
        str_cat("ParseOptions.world_size: ", options.world_size, " must be in [1, 1048576]"));
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

  // Each section is read even after another one failed, so that one run
  // names every section's problem (and every unknown key); the scheduler
  // reads the optimizer's lr, so it is left out when the optimizer failed.
  auto section = [&](const Status& s) {
    ctx.absorb(s);
    const bool failed = !ctx.ok();
    ctx.next_section();
    return !failed;
  };
  section(parse_batch(r, ctx, &c));
  if (section(parse_optimizer(r, ctx, &c.optimizer))) {
    section(parse_scheduler(r, ctx, c.optimizer, &c.scheduler));
  } else {
    r.take("scheduler");  // (not reported as unknown)
  }
  section(parse_precision(r, ctx, &c));
  section(parse_zero(r, ctx, &c.zero, &nvme_paths_given));
  const bool aio_read = section(parse_aio(r, ctx, &c.aio, &aio_given));
  if (aio_read) {
    section(parse_strata(r, ctx, c.aio, aio_given, &cpu_fraction_given, &c.strata));
  } else {
    r.take("strata");
  }
  ignore_top_level(r, ctx);
  section(r.finish());
  if (ctx.any_problem()) return ctx.error();

  if (cpu_fraction_given && c.zero.offload_optimizer.device != OffloadDevice::kNvme) {
    return Status::invalid_argument(
        str_cat("strata.optimizer_cpu_fraction: ", show_double(c.strata.optimizer_cpu_fraction),
                " is set but zero_optimization.offload_optimizer.device is \"",
                to_string(c.zero.offload_optimizer.device),
                "\"; it splits optimizer state between CPU and NVMe, so it needs device \"nvme\""));
  }
  if (c.zero.offload_param.max_in_cpu_auto && c.zero.offload_param.device == OffloadDevice::kNvme &&
      c.strata.budgets.pinned_bytes == 0) {
    return Status::invalid_argument(
        "zero_optimization.offload_param.max_in_cpu: \"auto\" keeps as many groups' compute copies in pinned memory "
        "as strata.budgets.pinned leaves room for, and strata.budgets.pinned is not set (unlimited): set it, or "
        "write a number of elements (strata plan's note gives the largest that fits the machine)");
  }
  const OptimizerStateConfig& os = c.strata.optimizer_state;
  if (os.format != StateFormat::kFp32 && c.optimizer.type != OptimizerType::kAdam &&
      c.optimizer.type != OptimizerType::kAdamW) {
    return Status::invalid_argument(str_cat("strata.optimizer_state.format: \"", to_string(os.format),
                                            "\" stores Adam's and AdamW's moments; optimizer.type is \"",
                                            to_string(c.optimizer.type), "\", whose state is fp32 only"));
  }
  if (os.format != StateFormat::kBf16 && os.rounding != StateRounding::kNearestEven) {
    return Status::invalid_argument(str_cat("strata.optimizer_state.rounding: \"", to_string(os.rounding),
                                            "\" rounds bf16 moments, but strata.optimizer_state.format is \"",
                                            to_string(os.format), "\""));
  }
  warn_overridden_nvme_paths(ctx, c, nvme_paths_given);
  c.strata.strict = c.strata.strict || options.strict;
  c.world_size = options.world_size;
  c.warnings = ctx.take_warnings();
  return c;
}

}  // namespace

std::optional<ScheduleRuleBroken> broken_schedule_rule(const SchedulerConfig& c) {
  if (c.type != SchedulerType::kWarmupCosineLR) return std::nullopt;
  const std::int64_t warmup = std::max<std::int64_t>(2, c.warmup_num_steps);
  if (c.total_num_steps > warmup) return std::nullopt;
  return ScheduleRuleBroken{"total_num_steps", str_cat("WarmupCosineLR needs more steps than warmup_num_steps (",
                                                       warmup, " after DeepSpeed's minimum of 2)")};
}

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
