// strata-train's command line (parsed strictly with CLI11) and the checks made
// before any training: where the default config is, and whether the output
// folders can take what the run will write. Owner-thread-only (main).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "examples/model/residual_mlp.h"

namespace strata::examples::train {

enum class ModelDevice { kHost, kCuda, kAuto };

struct Options {
  std::string config;              // --config FILE; after parse_options, never empty
  bool config_is_default = false;  // true when --config was not given (find_default_config chose it)
  int steps = 30;                  // --steps N: the step the run ends at (counted from the run's start)
  ModelSpec spec;                  // --width (hidden; ffn = 4 x width), --depth, --batch
  bool freeze_base = false;        // --freeze-base
  std::string checkpoint;          // --checkpoint DIR; empty: none
  int save_every = 0;              // --save-every K (needs --checkpoint); 0: never
  bool resume = false;             // --resume (needs --checkpoint)
  std::string export_dir;          // --export DIR; empty: none
  std::string init_from;           // --init-from DIR; empty: the model's initializer
  std::string dump_masters;        // --dump-masters FILE; empty: none
  ModelDevice model_device = ModelDevice::kAuto;  // --model-device host|cuda|auto
  bool quiet = false;                             // --quiet
};

// Parses argv. On success returns the options with `config` resolved (the
// default one found by find_default_config when --config is absent). Otherwise
// it has printed what to print and sets *exit_code: 0 after --help (the help on
// stdout), 2 on bad input (the error on stderr, naming the flag: an unknown
// flag, a flag given twice, a value that is not a whole number in its range
// such as --steps 1e3, 3abc, 4294967298 or -1, --resume or --save-every
// without --checkpoint, a --config that is missing or a directory, no default
// config found).
std::optional<Options> parse_options(int argc, char** argv, int* exit_code);

// The default config, examples/configs/strata_default.json, looked up in this
// order: under the current directory (the repository root, as scripts/run.sh
// runs it); in the folders above the executable (/proc/self/exe: a build tree
// inside the checkout, build/examples/train/strata-train); in the source tree
// the executable was built from (its path is compiled in). Returns the first
// that exists, or nullopt.
std::optional<std::string> find_default_config();

// Checks an output folder before the engine is built: creates `dir` (and
// its parents) when missing and checks that a file can be created in it.
// `flag` names it in the error ("--export"). Returns an empty string when it
// is fine, else the message. The room is checked by check_output_space.
std::string check_output_dir(const std::string& flag, const std::string& dir);

// Checks that the folder `file` would be written into exists and takes a new
// file, and that `file` is not a directory (--dump-masters). Empty or the
// message, as check_output_dir.
std::string check_output_file(const std::string& flag, const std::string& file);

// One thing the run writes besides its swap files: its flag, its folder, the
// most bytes it takes ("one checkpoint", "the export") and what that is.
struct OutputNeed {
  std::string flag;
  std::string dir;
  std::uint64_t bytes = 0;
  std::string what;
};

// Once the engine holds its swap files (made at full size at finalize, so a
// file system's free space already counts them): the outputs on each file
// system together fit in what is free there. The message names every output
// of a file system that does not hold them, and the swap paths among
// `swap_paths` on it (strata.io.paths). Empty when they fit.
std::string check_output_space(const std::vector<OutputNeed>& outputs, const std::vector<std::string>& swap_paths);

// "123.4 MiB".
std::string human_bytes(double bytes);

}  // namespace strata::examples::train
