// The `strata` command: `strata plan` (the memory planner), `strata version`,
// `strata help`. Exit status 0 on success (plan: the configured placement
// fits), 1 when the plan does not fit, 2 on bad input.
#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/cli/plan_args.h"
#include "engine/config.h"
#include "engine/machine.h"
#include "engine/plan.h"
#include "strata_build_config.h"

namespace {

namespace cli = strata::cli;
namespace core = strata::core;
namespace engine = strata::engine;

constexpr int kExitOk = 0;
constexpr int kExitDoesNotFit = 1;
constexpr int kExitBadInput = 2;

constexpr std::string_view kUsage = R"(usage: strata <command> [flags]

commands
  plan       plan the memory of a training run per tier (GPU, CPU RAM, NVMe)
             and the bytes moved per step; exit 0 if the configured placement
             fits, 1 if not, 2 on bad input
  version    print the version and the backends this build has
  help       print this text (also: strata --help, strata plan --help)

)";

void print_usage(std::FILE* to) {
  std::fputs(std::string(kUsage).c_str(), to);
  std::fputs(std::string(cli::plan_usage()).c_str(), to);
}

int fail(std::string_view command, const core::Status& status) {
  std::cerr << "strata " << command << ": " << status.message() << "\n";
  return kExitBadInput;
}

int run_plan(const std::vector<std::string_view>& args) {
  core::Result<cli::PlanArgs> parsed = cli::parse_plan_args(args);
  if (!parsed.ok()) return fail("plan", parsed.status());
  if (parsed->help) {
    std::fputs(std::string(cli::plan_usage()).c_str(), stdout);
    return kExitOk;
  }
  engine::ParseOptions parse_options;
  parse_options.hidden_size = parsed->model.hidden_size;
  core::Result<engine::Config> config =
      engine::load_config_file(parsed->config_path, parse_options);
  if (!config.ok()) return fail("plan", config.status());
  core::Result<engine::MachineSpec> machine =
      engine::probe_machine(engine::plan_swap_paths(*config), parsed->machine);
  if (!machine.ok()) return fail("plan", machine.status());
  core::Result<engine::Plan> plan =
      engine::make_plan(*config, parsed->model, *machine, parsed->options);
  if (!plan.ok()) return fail("plan", plan.status());
  const std::string text =
      parsed->json ? engine::plan_to_json(*plan) : engine::format_plan_table(*plan);
  std::fputs(text.c_str(), stdout);
  return plan->fits() ? kExitOk : kExitDoesNotFit;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (args.empty()) {
    print_usage(stderr);
    return kExitBadInput;
  }
  const std::string_view command = args.front();
  const std::vector<std::string_view> rest(args.begin() + 1, args.end());
  if (command == "help" || command == "--help" || command == "-h") {
    print_usage(stdout);
    return kExitOk;
  }
  if (command == "version" || command == "--version") {
    std::printf("strata %s (CUDA backend %s)\n", STRATA_VERSION_STRING,
                STRATA_HAVE_CUDA ? "built in" : "not built");
    return kExitOk;
  }
  if (command == "plan") return run_plan(rest);
  std::cerr << "strata: unknown command '" << command << "'\n\n";
  print_usage(stderr);
  return kExitBadInput;
}
