// The flags of `strata plan`, parsed into the planner's inputs (engine/plan/plan.h,
// engine/plan/machine.h). Part of the command, in a library of its own so that
// tests/cli/ checks its errors without the config parser. Pure functions;
// thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "engine/plan/machine.h"
#include "engine/plan/plan.h"

namespace strata::cli {

struct PlanArgs {
  std::string config_path;           // --config FILE; required unless help
  engine::ModelSpec model;           // --params/--layers/--hidden/--vocab/--heads/--seq/...
  engine::MachineOverrides machine;  // --gpu-memory, --ram, --disk
  engine::PlanOptions options;       // --no-checkpoint clears include_checkpoint; --drive-* set drive; --ranks, --nodes
  bool json = false;                 // --json: print JSON instead of the table
  bool help = false;                 // --help or -h: print plan_usage() and do nothing else
};

// Parses the arguments after `plan` (CLI11 for the flags, the units here).
// Flags take their value as the next argument or after '=' (--seq=4096).
// Errors are kInvalidArgument and name the flag (or the stray argument): an
// unknown flag, a flag given twice, a missing value, a size that
// core::parse_bytes rejects, a count that engine::parse_count rejects, a non-number
// fraction, a checkpointing value other than on/off, a zero size, a missing
// --config; for the wear estimate (options.drive): a rating that is not a
// positive number, both --drive-tbw and --drive-dwpd, --drive-dwpd without
// --drive-capacity (or the other way round), --warranty-years without
// --drive-dwpd, --step-seconds without a rating. Range checks of the model (positive, layers <= params, fraction
// in [0, 1]) are make_plan's, which names the same flags.
core::Result<PlanArgs> parse_plan_args(const std::vector<std::string_view>& args);

// The usage text of `strata plan` (flags, units, exit codes).
std::string_view plan_usage();

}  // namespace strata::cli
