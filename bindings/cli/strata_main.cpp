// The `strata` command: `strata plan` (the memory planner), `strata config`
// (the resolved configuration), `strata inspect` (a checkpoint's content and
// its verification), `strata version`, `strata help`. Exit status 0 on
// success (plan: the configured placement fits), 1 when the plan does not
// fit, the config is bad (config) or a checkpoint file is damaged (inspect),
// 2 on bad input. A command is a row of
// kCommands: a name, a line for the usage, and a function of its arguments.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/cli/inspect.h"
#include "bindings/cli/plan_args.h"
#include "core/logging.h"
#include "engine/config.h"
#include "engine/plan/machine.h"
#include "engine/plan/plan.h"
#include "strata_build_config.h"

namespace {

namespace cli = strata::cli;
namespace core = strata::core;
namespace engine = strata::engine;

constexpr int kExitOk = 0;
constexpr int kExitDoesNotFit = 1;
constexpr int kExitBadInput = 2;

void print_usage(std::FILE* to);

int fail(std::string_view command, const core::Status& status) {
  std::cerr << "strata " << command << ": " << status.message() << "\n";
  return kExitBadInput;
}

// Parses a command's flags into `app`. Returns the exit status when the
// command ends here (--help printed: 0; bad flags, named: 2), else nothing.
std::optional<int> parse_flags(CLI::App& app, std::string_view command, const std::vector<std::string_view>& args) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::cerr << "strata " << command << ": " << e.what() << " (see strata " << command << " --help)\n";
    return kExitBadInput;
  }
  return std::nullopt;
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
  parse_options.world_size = parsed->options.ranks;  // train_batch_size counts every rank's micro-batches
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

// `strata config FILE`: the resolved configuration (every key, as checkpoints
// store it) on stdout, its warnings on stderr; exit 0, or 1 with the config
// check's error naming the key.
int run_config(const std::vector<std::string_view>& args) {
  CLI::App app(
      "Prints the resolved configuration of a strata/DeepSpeed JSON config: every key with its value, "
      "defaults filled in and old names mapped (the form checkpoints store), then its warnings on stderr. "
      "Exit status: 0 valid, 1 the config check's error (naming the key), 2 bad flags.",
      "strata config");
  std::string path;
  engine::ParseOptions options;
  app.add_option("FILE", path, "the config (JSON; // and /* */ comments allowed)")->required();
  app.add_option("--hidden", options.hidden_size,
                 "the model's hidden size: resolves DeepSpeed's \"auto\" bucket sizes as the Hugging Face "
                 "integration does")
      ->type_name("H")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  app.add_option("--total-steps", options.total_num_steps,
                 "the run's optimizer steps: resolves scheduler.params.total_num_steps \"auto\"")
      ->type_name("N")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 62));
  app.add_flag("--strict", options.strict, "unknown keys are errors (as strata.strict: true)");
  if (const std::optional<int> done = parse_flags(app, "config", args)) return *done;
  // The warnings are printed below from Config::warnings, once.
  core::set_log_level(core::LogLevel::kError);
  core::Result<engine::Config> config = engine::load_config_file(path, options);
  if (!config.ok()) {
    std::cerr << "strata config: " << config.status().message() << "\n";
    return kExitDoesNotFit;
  }
  const std::string text = engine::to_json(*config);
  std::fputs(text.c_str(), stdout);
  if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
  for (const engine::ConfigWarning& w : config->warnings) {
    std::cerr << "strata config: warning: " << w.key_path << ": " << w.message << "\n";
  }
  std::cerr << "strata config: " << path << " is valid, " << config->warnings.size() << " warning(s)\n";
  return kExitOk;
}

// `strata inspect CKPT [--verify] [--json]` (bindings/cli/inspect.h).
int run_inspect(const std::vector<std::string_view>& args) {
  CLI::App app(
      "Prints what a checkpoint holds: step, counters, placement, config and tensors. Exit status: 0 it reads "
      "(and verifies), 1 a file is damaged (DATA_LOSS, the file named on stderr), 2 no checkpoint there or bad "
      "flags.",
      "strata inspect");
  std::string dir;
  bool verify = false;
  bool json = false;
  app.add_option("CKPT", dir, "a checkpoint root (its latest is followed) or a step-<N> folder")->required();
  app.add_flag("--verify", verify, "check every file's CRC64 (reads the whole state file)");
  app.add_flag("--json", json, "print JSON instead of a table");
  if (const std::optional<int> done = parse_flags(app, "inspect", args)) return *done;
  return cli::inspect_command(dir, verify, json);
}

int run_version(const std::vector<std::string_view>& args) {
  if (!args.empty()) {
    std::cerr << "strata version: takes no arguments, got '" << args.front() << "'\n";
    return kExitBadInput;
  }
  std::printf("strata %s (CUDA backend %s)\n", STRATA_VERSION_STRING,
              STRATA_HAVE_CUDA ? "built in" : "not built");
  return kExitOk;
}

int run_help(const std::vector<std::string_view>& /*args*/) {
  print_usage(stdout);
  return kExitOk;
}

struct Command {
  std::string_view name;
  std::string_view summary;  // lines of the usage text, indented by 13 after the first
  int (*run)(const std::vector<std::string_view>& args);  // the arguments after the name
};

// A new command is one row here (and its function).
constexpr Command kCommands[] = {
    {"plan",
     "plan the memory of a training run per tier (GPU, CPU RAM, NVMe)\n"
     "             and the bytes moved per step; exit 0 if the configured placement\n"
     "             fits, 1 if not, 2 on bad input",
     run_plan},
    {"config",
     "print a config resolved (every key, defaults filled in) and its\n"
     "             warnings; exit 0 if valid, 1 with the key's error if not",
     run_config},
    {"inspect",
     "print a checkpoint's step, counters, placement, config and tensors;\n"
     "             --verify checks every file's CRC64; exit 0, 1 if a file is\n"
     "             damaged, 2 if there is no checkpoint there",
     run_inspect},
    {"version", "print the version and the backends this build has", run_version},
    {"help", "print this text (also: strata --help, strata COMMAND --help)", run_help},
};

void print_usage(std::FILE* to) {
  std::fputs("usage: strata <command> [flags]\n\ncommands\n", to);
  for (const Command& c : kCommands) {
    std::fprintf(to, "  %-10s %s\n", std::string(c.name).c_str(), std::string(c.summary).c_str());
  }
  std::fputs("\n", to);
  std::fputs(std::string(cli::plan_usage()).c_str(), to);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  if (args.empty()) {
    print_usage(stderr);
    return kExitBadInput;
  }
  std::string_view command = args.front();
  const std::vector<std::string_view> rest(args.begin() + 1, args.end());
  if (command == "--help" || command == "-h") command = "help";
  if (command == "--version") command = "version";
  for (const Command& c : kCommands) {
    if (c.name == command) return c.run(rest);
  }
  std::cerr << "strata: unknown command '" << command << "'\n\n";
  print_usage(stderr);
  return kExitBadInput;
}
