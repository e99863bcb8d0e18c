#include "engine/state/frozen_files.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/str.h"
#include "engine/checkpoint/manifest.h"
#include "engine/internal/engine_util.h"
#include "engine/io_options.h"
#include "nvme/crc64.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

namespace {

// A 16-bit compute copy read as it is: the quiet bit of each NaN set, as the
// conversion through fp32 (to_compute) sets it, so that the bytes equal the
// initial values' whatever the NaNs in the file.
void quiet_nans(std::span<std::byte> bytes, Precision p) {
  auto* h = reinterpret_cast<std::uint16_t*>(bytes.data());
  const std::size_t n = bytes.size() / 2;
  const std::uint16_t inf = p == Precision::kFp16 ? 0x7c00u : 0x7f80u;
  const std::uint16_t quiet = p == Precision::kFp16 ? 0x0200u : 0x0040u;
  for (std::size_t i = 0; i < n; ++i) {
    if ((h[i] & 0x7fffu) > inf) h[i] = static_cast<std::uint16_t>(h[i] | quiet);
  }
}

}  // namespace

core::Status FrozenFiles::choose(Layout& layout, FrozenBase mode, bool have_files,
                                 const std::vector<bool>& from_files, OffloadDevice param_device) {
  for (GroupPlace& gp : layout.groups) gp.frozen_in_files = gp.frozen_kept_from_files = false;
  if (mode == FrozenBase::kSwap) return Status();
  for (GroupPlace& gp : layout.groups) {
    std::size_t frozen = 0;
    std::string refused;  // why not, naming the group
    for (std::size_t pi : gp.params) {
      if (layout.params[pi].trainable) continue;
      ++frozen;
      if (!refused.empty()) continue;
      if (!have_files) {
        refused = str_cat("frozen parameter '", layout.params[pi].name,
                          "' takes its values from an init callback: no safetensors files were imported "
                          "(strata_init_from_safetensors)");
      } else if (!from_files[pi]) {
        refused = str_cat("frozen parameter '", layout.params[pi].name,
                          "' takes its values from an init callback, not from the files");
      }
    }
    if (frozen == 0) continue;
    // A copy of the files' values in the memory max_in_cpu keeps it in.
    const bool kept = param_device == OffloadDevice::kNvme && gp.compute_tier == Tier::kPinned;
    if (refused.empty() && kept && !layout.compute_sharded && mode == FrozenBase::kAuto) {
      gp.frozen_kept_from_files = true;
      continue;
    }
    if (refused.empty() && gp.compute_tier != Tier::kNvme) {
      refused = gp.compute_tier == Tier::kPinned
                    ? std::string("its compute copies live in pinned memory, not on nvme (zero_optimization."
                                  "offload_param.device \"cpu\", or \"nvme\" with offload_param.max_in_cpu keeping "
                                  "the group there), and a fetch reads them from there")
                    : str_cat("its compute copies live in ", to_string(gp.compute_tier),
                              " memory, not on nvme, and a fetch reads them from there (zero_optimization."
                              "offload_param.device \"nvme\" puts them there)");
    }
    if (refused.empty() && layout.compute_sharded) {
      refused = "stage 3 shards its compute copies over the ranks";
    }
    if (refused.empty()) {
      gp.frozen_in_files = true;
    } else if (mode == FrozenBase::kFiles) {
      return Status::failed_precondition(
          str_cat("strata.frozen_base \"files\": group '", gp.name, "' cannot read its frozen parameters from the "
                  "safetensors files: ", refused, " (\"auto\" keeps such a group's on the swap drive)"));
    }
  }
  return Status();
}

std::unique_ptr<FrozenFiles> FrozenFiles::create(const PretrainedWeights& weights, const Layout& layout,
                                                 const Config& config) {
  std::unique_ptr<FrozenFiles> f(new FrozenFiles());
  // Absolute: a reader closed to keep few files open reopens the same file
  // whatever the working directory has become since.
  for (const std::string& path : weights.files()) {
    std::error_code ec;
    const std::filesystem::path abs = std::filesystem::absolute(path, ec);
    f->files_.push_back(ec ? path : abs.lexically_normal().string());
  }
  f->compute_bytes_ = layout.compute_bytes;
  f->precision_ = config.precision;
  f->verify_ = config.strata.crc;
  f->backend_options_ = io_backend_options(config.strata.io);
  f->file_options_ = direct_file_options(config.strata.io);
  const auto cb = static_cast<std::uint64_t>(layout.compute_bytes);
  f->groups_.resize(layout.groups.size());
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    const GroupPlace& gp = layout.groups[g];
    if (!gp.frozen_of_files()) continue;  // (a kept group's tensors name its files; it is never read here)
    Group& fg = f->groups_[g];
    fg.name = gp.name;
    const Layout::ByteRange range = layout.frozen_home_range(gp);
    for (std::size_t pi : gp.params) {
      const ParamDesc& p = layout.params[pi];
      if (p.trainable) continue;
      const std::uint64_t at = static_cast<std::uint64_t>(layout.places[pi].compute_offset) * cb - range.lo;
      fg.tensors.push_back(Tensor{.file = weights.file_of(p.name),
                                  .name = weights.tensor_name(p.name),
                                  .param = p.name,
                                  .shape = p.shape,
                                  .lo = at,
                                  .hi = at + static_cast<std::uint64_t>(p.numel()) * cb});
    }
    std::sort(fg.tensors.begin(), fg.tensors.end(), [](const Tensor& a, const Tensor& b) { return a.lo < b.lo; });
  }
  core::MutexLock lock(f->mu_);
  f->open_.resize(f->files_.size());
  return f;
}

FrozenFiles::~FrozenFiles() {
  core::MutexLock lock(mu_);
  open_.clear();  // before the backend
  backend_.reset();
}

core::Result<SafetensorsReader*> FrozenFiles::reader(std::size_t f) {
  if (open_[f] != nullptr) {
    recent_.remove(f);
    recent_.push_front(f);
    return open_[f].get();
  }
  if (backend_ == nullptr) {
    auto created = nvme::IoBackend::create(backend_options_);
    if (!created.ok()) return std::move(created).status().annotate("reading the frozen parameters from their files");
    backend_ = std::move(created).value();
  }
  while (recent_.size() >= kOpenFiles) {
    open_[recent_.back()].reset();
    recent_.pop_back();
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::DirectFileReader> file,
                          nvme::DirectFileReader::open(*backend_, files_[f], file_options_));
  STRATA_ASSIGN_OR_RETURN(SafetensorsReader r, SafetensorsReader::open(std::move(file)));
  open_[f] = std::make_unique<SafetensorsReader>(std::move(r));
  recent_.push_front(f);
  return open_[f].get();
}

core::Status FrozenFiles::read_tensor(const Tensor& t, std::span<std::byte> out) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsReader * r, reader(t.file));
  const TensorInfo* info = r->find(t.name);
  if (info == nullptr || info->shape != t.shape) {  // the file changed since the run imported it
    return Status::data_loss(str_cat(files_[t.file], ": tensor '", t.name, "' ",
                                     info == nullptr ? std::string("is gone")
                                                     : str_cat("now has shape ", shape_string(info->shape)),
                                     " (frozen parameter '", t.param, "' is ", shape_string(t.shape),
                                     " and is read from this file)"));
  }
  if (info->dtype == dtype_of(compute_bytes_, precision_)) {
    STRATA_RETURN_IF_ERROR(r->read_raw(t.name, out));
    if (compute_bytes_ == 2) quiet_nans(out, precision_);
  } else {
    // Another dtype in the file: through fp32 as the initial values went.
    convert_.resize(static_cast<std::size_t>(info->numel()));
    STRATA_RETURN_IF_ERROR(r->read_f32(t.name, convert_));
    to_compute(convert_, out.data(), compute_bytes_, precision_);
  }
  bytes_read_ += info->nbytes;
  return Status();
}

core::Result<std::uint64_t> FrozenFiles::read(std::size_t g, std::span<std::byte> part) {
  const Group& fg = groups_[g];
  std::uint64_t read = 0;
  {
    core::MutexLock lock(mu_);
    const std::uint64_t before = bytes_read_;
    std::uint64_t at = 0;  // the range's bytes [0, at) are filled
    for (const Tensor& t : fg.tensors) {
      std::memset(part.data() + at, 0, t.lo - at);
      const Status s = read_tensor(t, part.subspan(t.lo, t.hi - t.lo));
      if (!s.ok()) return Status(s).annotate(str_cat("reading ", describe(g)));
      at = t.hi;
    }
    std::memset(part.data() + at, 0, part.size() - at);
    read = bytes_read_ - before;
  }
  if (verify_ && fg.recorded) {
    if (const std::uint64_t crc = nvme::crc64(0, part); crc != fg.crc) {
      // The tensor whose bytes changed, by its own CRC64 taken at import.
      std::string which = describe(g);
      for (std::size_t i = 0; i < fg.tensors.size(); ++i) {
        const Tensor& t = fg.tensors[i];
        if (nvme::crc64(0, part.subspan(t.lo, t.hi - t.lo)) != fg.tensor_crcs[i]) {
          which = str_cat(files_[t.file], ": tensor '", t.name, "' (frozen parameter '", t.param, "' of group '",
                          fg.name, "')");
          break;
        }
      }
      return Status::data_loss(str_cat(which, ": the bytes read give CRC64 ", crc64_hex(crc), " for the group, not the ",
                                       crc64_hex(fg.crc), " they gave when the run imported them: a file changed "
                                       "during the run (a frozen base is read from its files on every fetch; keep "
                                       "them unchanged, or set strata.frozen_base \"swap\" to copy them to the swap "
                                       "drive)"));
    }
  }
  return read;
}

void FrozenFiles::record(std::size_t g, std::span<const std::byte> part) {
  Group& fg = groups_[g];
  fg.crc = nvme::crc64(0, part);
  fg.tensor_crcs.clear();
  for (const Tensor& t : fg.tensors) fg.tensor_crcs.push_back(nvme::crc64(0, part.subspan(t.lo, t.hi - t.lo)));
  fg.recorded = true;
}

bool FrozenFiles::matches(std::size_t g, std::span<const std::byte> part) const {
  return groups_[g].recorded && nvme::crc64(0, part) == groups_[g].crc;
}

std::vector<std::string> FrozenFiles::files_of(std::size_t g) const {
  std::vector<std::string> files;
  for (const Tensor& t : groups_[g].tensors) {
    if (std::find(files.begin(), files.end(), files_[t.file]) == files.end()) files.push_back(files_[t.file]);
  }
  return files;
}

std::string FrozenFiles::describe(std::size_t g) const {
  const std::vector<std::string> files = files_of(g);
  std::string s = str_cat("the frozen parameters of group '", groups_[g].name, "' (imported from ");
  for (std::size_t i = 0; i < files.size(); ++i) s += str_cat(i == 0 ? "" : ", ", files[i]);
  return s + ")";
}

}  // namespace strata::engine
