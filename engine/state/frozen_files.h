// FrozenFiles: the read-only home of frozen parameters' compute copies (a
// LoRA run's base) in the safetensors files they were imported from
// (strata.frozen_base "files"): no copy on the swap drive and no write, ever.
// A group's frozen range of its home (Layout::frozen_home_range) is
// read tensor by tensor with direct reads through the nvme layer, each tensor
// converted to the compute dtype exactly as the initial values are (so that
// every placement gives the same bytes), the padding zero. A CRC64 of the
// range taken when the initial values are written (record) is checked on
// every read (with strata.crc) and against a checkpoint's values
// (matches): a file changed behind the run's back is kDataLoss naming it.
// Thread-safe: reads are one at a time (the files' readers are
// owner-thread-only). Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/mutex.h"
#include "core/result.h"
#include "engine/checkpoint/pretrained.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/config.h"
#include "engine/layout.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {

class FrozenFiles {
 public:
  // Marks the groups whose frozen parts are read from the files
  // (GroupPlace::frozen_in_files): a group whose home is on nvme, with
  // frozen parameters that all take their initial values from the files
  // (`from_files[pi]`: no init callback; `have_files`: some were imported),
  // and compute copies that are not sharded over ranks. "auto" takes every
  // such group; "files" is kFailedPrecondition naming the first group (and
  // why) that cannot be; "swap" takes none.
  // With the compute copies on nvme (`param_device`), a group whose home
  // offload_param.max_in_cpu keeps in pinned memory and whose frozen
  // parameters all come from the files is marked frozen_kept_from_files
  // under "auto" instead ("files" refuses it).
  static core::Status choose(Layout& layout, FrozenBase mode, bool have_files, const std::vector<bool>& from_files,
                             OffloadDevice param_device);

  // Reads the frozen range of every group with frozen_in_files from
  // `weights`. Nothing is opened until the first read.
  static std::unique_ptr<FrozenFiles> create(const PretrainedWeights& weights, const Layout& layout,
                                             const Config& config);
  ~FrozenFiles();
  FrozenFiles(const FrozenFiles&) = delete;
  FrozenFiles& operator=(const FrozenFiles&) = delete;

  // Group g's frozen range (Layout::frozen_home_range) read into `part`: every
  // frozen parameter's tensor converted to the compute dtype, the padding
  // zero; then its CRC64 checked against record's (strata.crc). Returns the
  // bytes read from the files. Errors: the file's (naming it); kDataLoss
  // when a tensor is gone, changed shape, or the bytes differ from those
  // recorded, naming the file and tensor that changed.
  core::Result<std::uint64_t> read(std::size_t g, std::span<std::byte> part);
  // The initial values' frozen range of group g (the engine's own
  // conversion of the files): its CRC64 is what later reads must give.
  void record(std::size_t g, std::span<const std::byte> part);
  bool recorded(std::size_t g) const { return groups_[g].recorded; }
  // True when `part` (group g's frozen range, as a checkpoint holds it)
  // equals what the files give (the recorded CRC64).
  bool matches(std::size_t g, std::span<const std::byte> part) const;
  // "the frozen parameters of group 'g' (read from a.safetensors, b.safetensors)".
  std::string describe(std::size_t g) const;
  // Group g's record (recorded(g) must hold): the CRC64 of its frozen range,
  // and the files its tensors are read from, in the order first read.
  std::uint64_t crc(std::size_t g) const { return groups_[g].crc; }
  std::vector<std::string> files_of(std::size_t g) const;

 private:
  struct Tensor {
    std::size_t file = 0;   // index into files_
    std::string name;       // the tensor in that file
    std::string param;      // the parameter it holds
    std::vector<std::int64_t> shape;
    std::uint64_t lo = 0;   // its bytes in the group's frozen range
    std::uint64_t hi = 0;
  };
  struct Group {
    std::string name;  // the group's (empty: not read from files)
    std::vector<Tensor> tensors;  // by offset
    std::uint64_t crc = 0;
    std::vector<std::uint64_t> tensor_crcs;  // each tensor's, to name the one that changed
    bool recorded = false;
  };
  FrozenFiles() = default;
  // The reader of file f, opened now if it is not (at most kOpenFiles stay
  // open: the least recently used is closed first).
  core::Result<SafetensorsReader*> reader(std::size_t f) STRATA_REQUIRES(mu_);
  core::Status read_tensor(const Tensor& t, std::span<std::byte> out) STRATA_REQUIRES(mu_);

  static constexpr std::size_t kOpenFiles = 4;
  std::vector<std::string> files_;
  std::vector<Group> groups_;
  int compute_bytes_ = 2;
  Precision precision_ = Precision::kBf16;
  bool verify_ = true;
  nvme::IoBackendOptions backend_options_;
  nvme::DirectFileOptions file_options_;

  mutable core::Mutex mu_;
  // Destruction order: the readers (they own their files) before the backend.
  std::unique_ptr<nvme::IoBackend> backend_ STRATA_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<SafetensorsReader>> open_ STRATA_GUARDED_BY(mu_);  // per file
  std::list<std::size_t> recent_ STRATA_GUARDED_BY(mu_);  // open files, most recently used first
  std::vector<float> convert_ STRATA_GUARDED_BY(mu_);      // a tensor as fp32, where dtypes differ
  std::uint64_t bytes_read_ STRATA_GUARDED_BY(mu_) = 0;
};

}  // namespace strata::engine
