// strata-train's flags (CLI11), its default config's lookup, and the output
// folders' checks made before training.
#include "examples/train/train_cli.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <vector>

#ifndef STRATA_TRAIN_SOURCE_ROOT
#define STRATA_TRAIN_SOURCE_ROOT ""
#endif

namespace strata::examples::train {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDefaultConfig = "examples/configs/strata_default.json";

// A whole decimal number in [min, max]: no exponent, no suffix, no hex, no
// overflow (CLI11's own conversion would take 010 as 8 and 0x10 as 16).
CLI::Validator whole_number(long long min, long long max) {
  const std::string range = "[" + std::to_string(min) + ", " + std::to_string(max) + "]";
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        long long v = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (text.empty() || ec == std::errc::invalid_argument || ptr != end) {
          return "'" + text + "' is not a whole number (write it out in digits, e.g. 1000, not 1e3)";
        }
        if (ec == std::errc::result_out_of_range || v < min || v > max) {
          return "'" + text + "' is out of range: give a whole number in " + range;
        }
        return std::string();
      },
      "INT in " + range);
}

std::string exe_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

}  // namespace

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) b /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

std::optional<std::string> find_default_config() {
  std::error_code ec;
  std::vector<fs::path> candidates = {fs::path(kDefaultConfig)};
  const std::string dir = exe_dir();
  if (!dir.empty()) {
    for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
      candidates.push_back(p / kDefaultConfig);
      if (p == p.root_path()) break;
    }
  }
  if (std::strlen(STRATA_TRAIN_SOURCE_ROOT) > 0) {
    candidates.push_back(fs::path(STRATA_TRAIN_SOURCE_ROOT) / kDefaultConfig);
  }
  for (const fs::path& c : candidates) {
    if (fs::is_regular_file(c, ec)) return c.lexically_normal().string();
  }
  return std::nullopt;
}

namespace {

// Creates (and removes) a file in `dir`: also right for root, whom
// access(W_OK) would wave through on a read-only file system. Empty or
// strerror.
std::string probe_write(const fs::path& dir) {
  std::string probe = (dir / ".strata-train-write-check-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return std::string();
}

}  // namespace

std::string check_output_dir(const std::string& flag, const std::string& dir) {
  std::error_code ec;
  const fs::path path(dir);
  if (fs::exists(path, ec)) {
    if (!fs::is_directory(path, ec)) return flag + " " + dir + ": exists and is not a directory";
  } else {
    fs::create_directories(path, ec);
    if (ec) return flag + " " + dir + ": cannot create the directory: " + ec.message();
  }
  if (const std::string err = probe_write(path); !err.empty()) {
    return flag + " " + dir + ": cannot write into the directory: " + err;
  }
  return std::string();
}

std::string check_output_file(const std::string& flag, const std::string& file) {
  std::error_code ec;
  const fs::path path(file);
  if (fs::is_directory(path, ec)) return flag + " " + file + ": is a directory";
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    return flag + " " + file + ": its folder " + dir.string() + (fs::exists(dir, ec) ? " is not a directory" : " does not exist");
  }
  if (const std::string err = probe_write(dir); !err.empty()) {
    return flag + " " + file + ": cannot write into " + dir.string() + ": " + err;
  }
  return std::string();
}

std::string check_output_space(const std::vector<OutputNeed>& outputs, const std::vector<std::string>& swap_paths) {
  // Outputs by file system, in the order given.
  std::vector<std::pair<dev_t, std::vector<const OutputNeed*>>> by_fs;
  for (const OutputNeed& out : outputs) {
    struct stat st {};
    if (::stat(out.dir.c_str(), &st) != 0) return out.flag + " " + out.dir + ": " + std::strerror(errno);
    auto it = std::find_if(by_fs.begin(), by_fs.end(), [&](const auto& e) { return e.first == st.st_dev; });
    if (it == by_fs.end()) {
      by_fs.push_back({st.st_dev, {}});
      it = by_fs.end() - 1;
    }
    it->second.push_back(&out);
  }
  for (const auto& [dev, outs] : by_fs) {
    struct statvfs vfs {};
    if (::statvfs(outs.front()->dir.c_str(), &vfs) != 0) continue;  // nothing to judge by: the save will say
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    std::uint64_t need = 0;
    std::string flags, whats, change;
    for (const OutputNeed* out : outs) {
      need += out->bytes;
      const std::string sep = flags.empty() ? "" : " and ";
      flags += sep + out->flag + " " + out->dir;
      whats += sep + out->what + " (" + human_bytes(static_cast<double>(out->bytes)) + ")";
      change += (change.empty() ? "" : " or ") + out->flag;
    }
    if (free_bytes >= need) continue;
    std::string swaps;
    for (const std::string& p : swap_paths) {
      struct stat st {};
      if (::stat(p.c_str(), &st) == 0 && st.st_dev == dev) swaps += (swaps.empty() ? "" : ", ") + p;
    }
    return flags + (outs.size() > 1 ? " (one file system)" : "") + ": " +
           human_bytes(static_cast<double>(free_bytes)) + " free (" + std::to_string(free_bytes) + " bytes)" +
           (swaps.empty() ? "" : ", after the swap files in " + swaps + " on the same file system (strata.io.paths)") +
           ", but " + whats + (outs.size() == 1 ? " needs " : " need ") + human_bytes(static_cast<double>(need)) + " (" + std::to_string(need) +
           " bytes): free some space, or point " + change + (swaps.empty() ? "" : " or strata.io.paths") + " elsewhere";
  }
  return std::string();
}

std::optional<Options> parse_options(int argc, char** argv, int* exit_code) {
  Options o;
  o.spec.input_dim = 64;
  o.spec.hidden_dim = 256;
  o.spec.ffn_dim = 1024;
  o.spec.output_dim = 16;
  o.spec.depth = 8;
  o.spec.teacher_hidden_dim = 64;
  o.spec.batch = 64;
  o.spec.seed = 1234;

  CLI::App app(
      "Trains the example model (a residual MLP, examples/model) through strata's C API and reports each "
      "step.\n\nExit status: 0 done, 1 a run-time error, 2 bad input, 130/143 stopped by SIGINT/SIGTERM "
      "(a second signal exits at once).",
      "strata-train");
  app.get_formatter()->column_width(34);
  std::string config;
  app.add_option(
         "--config", config,
         "strata/DeepSpeed JSON config (default: examples/configs/strata_default.json, looked up under "
         "the current directory, then above the executable, then in the source tree it was built from)")
      ->type_name("FILE");
  app.add_option(
         "--steps", o.steps,
         "train until step N, counted from the start of the run (with --resume: the checkpoint's step "
         "counts; N below it is an error)")
      ->type_name("N")
      ->check(whole_number(0, INT_MAX))
      ->capture_default_str();
  std::int64_t width = o.spec.hidden_dim;
  app.add_option("--width", width, "hidden width H (the blocks' inner width is 4 H)")
      ->type_name("H")
      ->check(whole_number(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--depth", o.spec.depth, "residual blocks L")
      ->type_name("L")
      ->check(whole_number(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--batch", o.spec.batch, "samples per micro-batch B")
      ->type_name("B")
      ->check(whole_number(1, 1 << 24))
      ->capture_default_str();
  app.add_flag("--freeze-base", o.freeze_base, "freeze the embedding and the first half of the blocks");
  CLI::Option* checkpoint =
      app.add_option("--checkpoint", o.checkpoint, "checkpoint directory (see --save-every, --resume)")
          ->type_name("DIR");
  app.add_option("--save-every", o.save_every,
                 "save a checkpoint into --checkpoint every K steps (the folder is created and checked for "
                 "space before training)")
      ->type_name("K")
      ->check(whole_number(1, INT_MAX))
      ->needs(checkpoint);
  app.add_flag("--resume", o.resume, "resume from --checkpoint's latest checkpoint")->needs(checkpoint);
  app.add_option("--export", o.export_dir,
                 "write the final weights (bf16 safetensors) here (created and checked for space before "
                 "training)")
      ->type_name("DIR");
  app.add_option("--init-from", o.init_from, "take the initial weights from a previous run's --export DIR")
      ->type_name("DIR");
  app.add_option("--dump-masters", o.dump_masters, "write the trainable fp32 master weights here at the end")
      ->type_name("FILE");
  std::string model_device = "auto";
  app.add_option("--model-device", model_device, "where the model computes: host, cuda or auto")
      ->type_name("DEVICE")
      ->check(CLI::IsMember({"host", "cuda", "auto"}))
      ->capture_default_str();
  app.add_flag("--quiet", o.quiet, "no per-step lines (the summary only)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    *exit_code = 0;
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "strata-train: %s\n(strata-train --help lists the flags)\n", e.what());
    *exit_code = 2;
    return std::nullopt;
  }
  const std::map<std::string, ModelDevice> devices = {
      {"host", ModelDevice::kHost}, {"cuda", ModelDevice::kCuda}, {"auto", ModelDevice::kAuto}};
  o.model_device = devices.at(model_device);
  o.spec.hidden_dim = width;
  o.spec.ffn_dim = 4 * width;

  std::error_code ec;
  if (config.empty()) {
    const std::optional<std::string> found = find_default_config();
    if (!found) {
      std::fprintf(stderr,
                   "strata-train: no --config given and the default %s is not under the current directory, "
                   "above the executable, or in the source tree %s; give --config FILE\n",
                   kDefaultConfig, STRATA_TRAIN_SOURCE_ROOT);
      *exit_code = 2;
      return std::nullopt;
    }
    o.config = *found;
    o.config_is_default = true;
  } else if (fs::is_directory(config, ec)) {
    std::fprintf(stderr, "strata-train: --config %s: is a directory, not a config file\n", config.c_str());
    *exit_code = 2;
    return std::nullopt;
  } else if (!fs::exists(config, ec)) {
    std::fprintf(stderr, "strata-train: --config %s: no such file\n", config.c_str());
    *exit_code = 2;
    return std::nullopt;
  } else {
    o.config = config;
  }
  return o;
}

}  // namespace strata::examples::train
