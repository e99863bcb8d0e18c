// Initial values from safetensors files (Engine::init_from_safetensors): a
// model's files as Hugging Face lays them out, checked against the
// registered parameters before finalize allocates anything, then streamed in
// group by group through the nvme engine's direct reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "engine/layout.h"
#include "engine/checkpoint/safetensors.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {

// The tensors of a model's files (their headers; no data) and the name
// prefix that maps parameter P to tensor prefix + P. Thread-compatible.
class PretrainedWeights {
 public:
  // Finds the files (find_safetensors) and reads every header through the
  // page cache. Errors: find_safetensors'; a header's (kNotFound,
  // kDataLoss, kUnimplemented for a dtype other than F32, BF16, F16);
  // kDataLoss when the index and the shards' headers disagree or a tensor
  // is in two files, naming both; read errors (through `io`'s fault injector,
  // engine/checkpoint/file_io.h).
  static core::Result<PretrainedWeights> open(const std::string& path, std::string name_prefix,
                                              const IoConfig& io = IoConfig{});

  // A parameter that takes its values from here: kNotFound naming the
  // parameter, the tensor looked for and the files when there is none;
  // kInvalidArgument naming the tensor, its file and both shapes when the
  // shapes differ.
  core::Status check_param(const ParamDesc& param) const;
  // Every tensor is a registered parameter's (after the prefix); else
  // kInvalidArgument naming the first extra tensor (in file order) and its
  // file. A tensor of a parameter with an init callback is not extra (the
  // callback wins).
  core::Status check_extra(std::span<const ParamDesc> params) const;

  // The file holding parameter `param`'s tensor (an index into files()),
  // or SIZE_MAX when none does.
  std::size_t file_of(std::string_view param) const;
  const std::vector<std::string>& files() const { return files_.files; }
  // The tensor that holds parameter `param`'s values (the name prefix + param).
  std::string tensor_name(std::string_view param) const { return prefix_ + std::string(param); }
  const std::string& describe() const { return where_; }

  // Reads tensors through `backend` (borrowed; must outlive it) with direct
  // reads, opening a file on first use and closing it after the last group
  // that reads it. Owner-thread-only.
  class Stream {
   public:
    Stream(const PretrainedWeights& weights, nvme::IoBackend& backend, const nvme::DirectFileOptions& options)
        : weights_(weights), backend_(backend), options_(options), last_group_(weights.files().size(), 0),
          open_(weights.files().size()) {}
    // Group `group` (groups are read in increasing order) will read `param`.
    void plan(std::size_t group, std::string_view param);
    // Parameter `param`'s values (its registered shape checked again) as
    // fp32, exactly. Errors: the file's, naming it.
    core::Status read(const ParamDesc& param, std::span<float> out);
    // Closes the files no group after `group` reads.
    void end_group(std::size_t group);

   private:
    const PretrainedWeights& weights_;
    nvme::IoBackend& backend_;
    nvme::DirectFileOptions options_;
    std::vector<std::size_t> last_group_;  // per file: the last group that reads it
    std::vector<std::unique_ptr<SafetensorsReader>> open_;  // per file: open while needed
  };

 private:
  struct Tensor {
    std::size_t file = 0;  // index into files_.files
    std::vector<std::int64_t> shape;
  };

  SafetensorsFiles files_;
  std::string prefix_;
  std::string where_;                                  // files_.describe()
  std::map<std::string, Tensor, std::less<>> tensors_;  // by name
  std::vector<std::string> order_;                      // tensor names, file by file in file order
};

// "[8, 32]" ("[]" for a scalar).
std::string shape_string(std::span<const std::int64_t> shape);

}  // namespace strata::engine
