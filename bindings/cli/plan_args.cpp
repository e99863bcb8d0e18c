// `strata plan` flag parsing.
#include "bindings/cli/plan_args.h"

#include <cmath>
#include <cstdlib>
#include <set>
#include <string>

#include "core/str.h"

namespace strata::cli {
namespace {

using core::Status;
using core::str_cat;

Status bad_value(std::string_view flag, std::string_view value, std::string_view expected) {
  return Status::invalid_argument(
      str_cat(flag, ": cannot parse '", value, "' (expected ", expected, ")"));
}

core::Result<std::int64_t> count_value(std::string_view flag, std::string_view value) {
  std::int64_t n = 0;
  if (!engine::parse_count(value, &n)) return bad_value(flag, value, "a count such as 40e9, 40B, 7M, 4096");
  return n;
}

core::Result<std::uint64_t> size_value(std::string_view flag, std::string_view value) {
  std::uint64_t n = 0;
  if (!core::parse_bytes(value, &n)) {
    return bad_value(flag, value, "a size such as 80GiB, 128GiB, 2TB, 1.5e12");
  }
  if (n == 0)
    return Status::invalid_argument(str_cat(flag, ": must be positive, got '", value, "'"));
  return n;
}

core::Result<double> fraction_value(std::string_view flag, std::string_view value) {
  const std::string text(value);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
    return bad_value(flag, value, "a number in [0, 1] such as 0.25");
  }
  return v;
}

}  // namespace

core::Result<PlanArgs> parse_plan_args(const std::vector<std::string_view>& args) {
  PlanArgs out;
  std::set<std::string, std::less<>> seen;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view arg = args[i];
    if (arg == "--help" || arg == "-h") {
      out.help = true;
      continue;
    }
    if (arg == "--json") {
      out.json = true;
      continue;
    }
    if (arg == "--no-checkpoint") {
      out.options.include_checkpoint = false;
      continue;
    }
    if (arg.substr(0, 2) != "--") {
      return Status::invalid_argument(
          str_cat("unexpected argument '", arg, "' (flags start with --; see strata plan --help)"));
    }
    std::string_view flag = arg;
    std::string_view value;
    bool has_value = false;
    if (const std::size_t eq = arg.find('='); eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    static const std::set<std::string_view> kFlags = {
        "--config",     "--params", "--layers",      "--hidden",        "--vocab",
        "--heads",      "--seq",    "--micro-batch", "--checkpointing", "--frozen-fraction",
        "--gpu-memory", "--ram",    "--disk"};
    if (kFlags.count(flag) == 0) {
      return Status::invalid_argument(str_cat("unknown flag ", flag, " (see strata plan --help)"));
    }
    if (!seen.insert(std::string(flag)).second) {
      return Status::invalid_argument(str_cat(flag, " is given twice"));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) return Status::invalid_argument(str_cat(flag, " needs a value"));
      value = args[++i];
    }
    if (flag == "--config") {
      if (value.empty()) return Status::invalid_argument("--config needs a file name");
      out.config_path = std::string(value);
    } else if (flag == "--params") {
      STRATA_ASSIGN_OR_RETURN(out.model.num_params, count_value(flag, value));
      if (out.model.num_params == 0) {
        return Status::invalid_argument(
            str_cat("num_params (--params) must be positive, got '", value, "'"));
      }
    } else if (flag == "--layers") {
      STRATA_ASSIGN_OR_RETURN(out.model.num_layers, count_value(flag, value));
      if (out.model.num_layers == 0) {
        return Status::invalid_argument(
            str_cat("num_layers (--layers) must be positive, got '", value, "'"));
      }
    } else if (flag == "--hidden") {
      STRATA_ASSIGN_OR_RETURN(out.model.hidden_size, count_value(flag, value));
      if (out.model.hidden_size == 0) {
        return Status::invalid_argument(
            str_cat("hidden_size (--hidden) must be positive, got '", value, "'"));
      }
    } else if (flag == "--vocab") {
      STRATA_ASSIGN_OR_RETURN(out.model.vocab_size, count_value(flag, value));
      if (out.model.vocab_size == 0) {
        return Status::invalid_argument(
            str_cat("vocab_size (--vocab) must be positive, got '", value, "'"));
      }
    } else if (flag == "--heads") {
      STRATA_ASSIGN_OR_RETURN(out.model.num_heads, count_value(flag, value));
      if (out.model.num_heads <= 0) {
        return Status::invalid_argument(
            str_cat("num_heads (--heads) must be positive, got '", value, "'"));
      }
    } else if (flag == "--seq") {
      STRATA_ASSIGN_OR_RETURN(out.model.seq_len, count_value(flag, value));
    } else if (flag == "--micro-batch") {
      STRATA_ASSIGN_OR_RETURN(out.model.micro_batch, count_value(flag, value));
      if (out.model.micro_batch <= 0) {
        return Status::invalid_argument(
            str_cat("micro_batch (--micro-batch) must be positive, got '", value, "'"));
      }
    } else if (flag == "--checkpointing") {
      if (value != "on" && value != "off") return bad_value(flag, value, "on or off");
      out.model.activation_checkpointing = value == "on";
    } else if (flag == "--frozen-fraction") {
      STRATA_ASSIGN_OR_RETURN(out.model.frozen_fraction, fraction_value(flag, value));
    } else if (flag == "--gpu-memory") {
      STRATA_ASSIGN_OR_RETURN(out.machine.gpu_bytes, size_value(flag, value));
    } else if (flag == "--ram") {
      STRATA_ASSIGN_OR_RETURN(out.machine.ram_bytes, size_value(flag, value));
    } else if (flag == "--disk") {
      STRATA_ASSIGN_OR_RETURN(out.machine.disk_bytes, size_value(flag, value));
    }
  }
  if (!out.help && out.config_path.empty()) {
    return Status::invalid_argument("--config FILE is required (the strata/DeepSpeed JSON config)");
  }
  return out;
}

std::string_view plan_usage() {
  return R"(usage: strata plan --config FILE (--params N | --hidden H --vocab V) --layers L [flags]

Plans where each byte of training state lives (GPU, pinned CPU RAM, NVMe) for
the config's placement, checks it against the machine, and recommends the
placement that fits while moving the fewest bytes per step.

model
  --params N             parameter count: 40e9, 40B, 7M, 125000000
  --layers L             layers (fetch groups); required
  --hidden H             transformer hidden size  } parameters = L (12 H^2 + 13 H)
  --vocab V              vocabulary size          }              + V H + 2 H
  --heads A              attention heads (default H / 128)
  --seq S                sequence length (default 2048)
  --micro-batch B        sequences per micro-batch (default: the config's
                         train_micro_batch_size_per_gpu)
  --checkpointing on|off full activation checkpointing (default on)
  --frozen-fraction F    share of parameters not trained, 0..1 (default 0)
machine (each replaces its probe; sizes like 80GiB, 128GiB, 2TB, 1.5e12)
  --gpu-memory SIZE      GPU memory (required without a GPU unless the config
                         sets strata.budgets.device)
  --ram SIZE             CPU RAM (default: MemTotal)
  --disk SIZE            free swap space (default: statvfs under the swap paths)
  --no-checkpoint        do not count checkpoint space (compute copies, master,
                         moments) on the swap disk: checkpoints go elsewhere
output
  --json                 print the plan as JSON
  --help                 this text

exit status: 0 the configured placement fits, 1 it does not (the output says
what would), 2 bad input (the error is on stderr)
)";
}

}  // namespace strata::cli
