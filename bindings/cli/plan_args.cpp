// `strata plan` flag parsing (CLI11 for the flags, the units parsed here).
#include "bindings/cli/plan_args.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <map>
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

// A positive, finite number: --drive-tbw, --drive-dwpd, --warranty-years, --step-seconds.
core::Result<double> positive_value(std::string_view flag, std::string_view value, std::string_view example) {
  const std::string text(value);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
    return bad_value(flag, value, str_cat("a positive number such as ", example));
  }
  if (v <= 0.0) return Status::invalid_argument(str_cat(flag, ": must be positive, got '", value, "'"));
  return v;
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
  // CLI11 takes the flags (unknown ones, a flag given twice, a missing value,
  // '--flag=value', stray arguments); the values are parsed below so that
  // sizes and counts keep their units (80GiB, 40e9).
  CLI::App app("strata plan", "strata plan");
  std::map<std::string, CLI::Option*, std::less<>> options;
  for (const char* flag :
       {"--config", "--params", "--layers", "--hidden", "--vocab", "--heads", "--seq", "--micro-batch",
        "--checkpointing", "--frozen-fraction", "--lora", "--gpu-memory", "--ram", "--disk", "--drive-tbw", "--drive-dwpd",
        "--drive-capacity", "--warranty-years", "--step-seconds", "--ranks", "--nodes"}) {
    // Every occurrence is kept so that a repeated flag is refused by name below.
    options[flag] = app.add_option(flag)->type_name("VALUE")->expected(1)->multi_option_policy(
        CLI::MultiOptionPolicy::TakeAll);
  }
  app.add_flag("--json", out.json);
  bool no_checkpoint = false;
  app.add_flag("--no-checkpoint", no_checkpoint);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out.help = true;
    return out;
  } catch (const CLI::ParseError& e) {
    return Status::invalid_argument(str_cat(e.what(), " (see strata plan --help)"));
  }
  out.options.include_checkpoint = !no_checkpoint;
  for (const auto& [flag, option] : options) {
    if (option->count() > 1) return Status::invalid_argument(str_cat(flag, " is given twice"));
  }
  engine::DriveEndurance drive;
  for (const auto& [flag, option] : options) {
    if (option->count() == 0) continue;
    const std::string value = option->results().front();
    if (flag == "--config") {
      if (value.empty()) return Status::invalid_argument("--config needs a file name");
      out.config_path = value;
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
    } else if (flag == "--lora") {
      STRATA_ASSIGN_OR_RETURN(out.model.lora_rank, count_value(flag, value));
      if (out.model.lora_rank <= 0) {
        return Status::invalid_argument(str_cat("lora_rank (--lora) must be positive, got '", value, "'"));
      }
    } else if (flag == "--gpu-memory") {
      STRATA_ASSIGN_OR_RETURN(out.machine.gpu_bytes, size_value(flag, value));
    } else if (flag == "--ram") {
      STRATA_ASSIGN_OR_RETURN(out.machine.ram_bytes, size_value(flag, value));
    } else if (flag == "--disk") {
      STRATA_ASSIGN_OR_RETURN(out.machine.disk_bytes, size_value(flag, value));
    } else if (flag == "--drive-tbw") {
      STRATA_ASSIGN_OR_RETURN(drive.tbw, positive_value(flag, value, "600 (TB written per drive, no unit)"));
    } else if (flag == "--drive-dwpd") {
      STRATA_ASSIGN_OR_RETURN(drive.dwpd, positive_value(flag, value, "1 or 0.3"));
    } else if (flag == "--drive-capacity") {
      STRATA_ASSIGN_OR_RETURN(drive.capacity_bytes, size_value(flag, value));
    } else if (flag == "--warranty-years") {
      STRATA_ASSIGN_OR_RETURN(drive.warranty_years, positive_value(flag, value, "5"));
    } else if (flag == "--step-seconds") {
      STRATA_ASSIGN_OR_RETURN(drive.step_seconds, positive_value(flag, value, "30 or 2.5"));
    } else if (flag == "--ranks" || flag == "--nodes") {
      STRATA_ASSIGN_OR_RETURN(const std::int64_t n, count_value(flag, value));
      if (n < 1 || n > 1'000'000) {
        return Status::invalid_argument(str_cat(flag, " must be in [1, 1000000], got '", value, "'"));
      }
      (flag == "--ranks" ? out.options.ranks : out.options.nodes) = static_cast<int>(n);
    }
  }
  auto given = [&options](const char* flag) { return options[flag]->count() > 0; };
  if (given("--drive-tbw") && given("--drive-dwpd")) {
    return Status::invalid_argument(
        "--drive-tbw and --drive-dwpd both rate the drives' endurance: give one (--drive-tbw TB, or --drive-dwpd D "
        "--drive-capacity SIZE)");
  }
  if (given("--drive-dwpd") != given("--drive-capacity")) {
    return Status::invalid_argument(given("--drive-dwpd")
                                        ? "--drive-dwpd needs the drive's capacity: --drive-capacity SIZE (e.g. 3.84TB)"
                                        : "--drive-capacity needs --drive-dwpd D (with --drive-tbw the capacity is "
                                          "not used)");
  }
  if (given("--warranty-years") && !given("--drive-dwpd")) {
    return Status::invalid_argument("--warranty-years goes with --drive-dwpd (TBW is rated over the warranty already)");
  }
  const bool rated = given("--drive-tbw") || given("--drive-dwpd");
  if (given("--step-seconds") && !rated) {
    return Status::invalid_argument(
        "--step-seconds sets the SSD wear estimate's days: give the drives' rating too (--drive-tbw TB, or "
        "--drive-dwpd D --drive-capacity SIZE)");
  }
  if (rated) out.options.drive = drive;
  if (options["--config"]->count() == 0) {
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
  --lora R               LoRA adapters of rank R on each block's projections
                         (16 R H parameters a layer; needs --hidden, --vocab),
                         the base frozen: every fetch group mixes the two, and
                         with the parameters on nvme the base is read from its
                         safetensors files unless strata.frozen_base is "swap"
machine (each replaces its probe; sizes like 80GiB, 128GiB, 2TB, 1.5e12)
  --gpu-memory SIZE      GPU memory (required without a GPU unless the config
                         sets strata.budgets.device)
  --ram SIZE             CPU RAM (default: MemTotal)
  --disk SIZE            free swap space (default: statvfs under the swap paths)
  --no-checkpoint        do not count checkpoint space (compute copies, master,
                         moments) on the swap disk: checkpoints go elsewhere
SSD wear (the same rating for each swap drive)
  --drive-tbw TB         rated terabytes written per drive (1 TB = 1e12 B)
  --drive-dwpd D         or: drive writes per day over the warranty, with
  --drive-capacity SIZE    the drive's capacity (3.84TB, 7.68e12) and
  --warranty-years Y       the warranty (default 5): TBW = D x SIZE x 365 x Y
  --step-seconds S       seconds per step, for days of training (the planner
                         has no step time estimate)
                         The plan then prints the bytes written per step to
                         each drive, the steps (and days) until the rating is
                         used, and the placement changes that write less.
data-parallel ranks (docs/distributed.md)
  --ranks N              plan one rank of N: its shard of the optimizer state
                         and host gradients, the collectives' bytes per step
  --nodes M              on M machines, N / M ranks on each (default 1),
                         sharing each machine's RAM and disk
output
  --json                 print the plan as JSON
  --help                 this text

exit status: 0 the configured placement fits, 1 it does not (the output says
what would), 2 bad input (the error is on stderr)
)";
}

}  // namespace strata::cli
