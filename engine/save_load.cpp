// Checkpoints and weight export (Engine methods declared in engine/engine.h).
// Layout of <root>/step-<N>/ (docs/checkpoints.md):
//   state.safetensors  per parameter: "<name>.compute" (compute dtype) and, when
//                      trainable, "<name>.master" (F32) and the optimizer's arrays
//                      (engine/optimizer_spec.h: AdamW ".exp_avg", ".exp_avg_sq";
//                      Lion ".exp_avg"; Adagrad ".exp_avg_sq") in the format the
//                      engine keeps them (strata.optimizer_state: F32 or BF16)
//   framework.bin      the framework's blob (with several ranks rank 0's, and each
//                      other rank's in framework-rank-<r>-of-<N>.bin)
//   manifest.json      format version, step counters, loss scaler, lr override,
//                      the parameter list, the config, CRC64 of the two files,
//                      and its own CRC64 (engine/checkpoint/manifest.h)
// A frozen base read from its safetensors files (strata.frozen_base) is left
// out of the state files: the manifest's "frozen_base" names each such group,
// its files and the CRC64 of its values, and a load takes them from the same
// files (a LoRA run's checkpoint holds the adapters, not the base).
// Written into <root>/.step-<N>.tmp, fsynced, renamed; then <root>/latest
// ("step-<N> <CRC64>") is replaced (write aside, fsync, rename), and the
// retention policy (strata.checkpoint) removes old checkpoints. Loading
// follows latest. The state file is written front to back and read through
// the nvme engine (O_DIRECT, strata.io.backend), its CRC64 computed as it is
// written.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "core/logging.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/retention.h"
#include "engine/engine.h"
#include "engine/fetch/fetcher.h"
#include "engine/step/step.h"
#include "engine/checkpoint/file_io.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/engine_entry.h"
#include "engine/internal/engine_util.h"
#include "engine/internal/parallel_fill.h"
#include "engine/io_options.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/code_tables.h"
#include "engine/state/compute_homes.h"
#include "engine/state/state_store.h"
#include "nvme/crc64.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace fs = std::filesystem;

namespace {

// Test hook: STRATA_CHECKPOINT_CRASH_AT=<point> ends the process at that point
// of a save (tests/e2e kill a child there and load what is left).
void crash_point(const char* name) {
  const char* at = std::getenv("STRATA_CHECKPOINT_CRASH_AT");
  if (at != nullptr && std::strcmp(at, name) == 0) std::_Exit(86);
}

// A backend for checkpoint and export files, as strata.io configures the swap's.
core::Result<std::unique_ptr<nvme::IoBackend>> file_backend(const Config& config, const char* what) {
  auto backend = nvme::IoBackend::create(io_backend_options(config.strata.io));
  if (!backend.ok()) return std::move(backend).status().annotate(what);
  return backend;
}

// A whole parameter's optimizer arrays (the master, then the optimizer's), as
// the chunks keep them (OptimizerSpec::elem_bytes bytes an element) and,
// blockwise, their scales (one per block of the parameter: its trainable
// offset starts a block); the layout's optimizer.arrays of them are used.
struct ParamState {
  std::int64_t base = 0;  // the first element held (of the parameter); a block boundary
  std::array<std::vector<std::byte>, 3> arrays;
  std::array<std::vector<float>, 3> scales;
};
using StateArrays = std::map<std::size_t, ParamState>;

// The safetensors dtype of array k as the engine keeps it.
TensorDtype state_dtype(const OptimizerSpec& spec, int k) {
  switch (spec.elem_bytes(k)) {
    case 4: return TensorDtype::kF32;
    case 2: return TensorDtype::kBf16;
    default: return TensorDtype::kU8;
  }
}

// A blockwise array's scales beside its codes: "<param>.<array>.absmax".
std::string scales_tensor(const std::string& array_tensor) { return array_tensor + ".absmax"; }


// "<param>.<array name>" in a checkpoint's state file.
std::string state_tensor(const Layout& layout, std::size_t param, int array) {
  return layout.params[param].name + "." + std::string(layout.optimizer.names[static_cast<std::size_t>(array)]);
}

// The parameters of group gp with optimizer state, in parameter order.
std::vector<std::size_t> trainable_in(const Layout& layout, const GroupPlace& gp) {
  std::vector<std::size_t> out;
  for (std::size_t pi : gp.params) {
    if (layout.places[pi].trainable_offset >= 0) out.push_back(pi);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// What one state file holds of each parameter: [lo, hi) of its elements,
// or nothing (lo == hi).
using HeldRanges = std::vector<std::pair<std::int64_t, std::int64_t>>;

// What rank `rank` of the layout's ranks saves of each parameter: its part
// (Layout::shard_of): with one rank every parameter whole; with several, of
// a trainable parameter the elements in the rank's shard of its group, and
// of a frozen one its shard of the group's frozen part at stage 3, else the
// whole parameter in the file of rank (its index mod ranks). Nothing of a
// parameter `left_out` names (left_out_by).
HeldRanges held_ranges(const Layout& layout, int rank, const std::vector<bool>& left_out = {}) {
  HeldRanges out(layout.params.size());
  for (std::size_t pi = 0; pi < layout.params.size(); ++pi) {
    if (!left_out.empty() && left_out[pi]) continue;
    const Layout::ShardPiece s = layout.shard_of(pi, rank);
    out[pi] = {s.lo, s.hi};
  }
  return out;
}

// The manifest's "frozen_base": each group whose frozen part is its files'
// values (read from them, or a copy offload_param.max_in_cpu keeps in
// memory: recorded when the initial values were written, at finalize), its files and the
// CRC64 of its frozen range in the compute dtype; none with
// strata.checkpoint.keep_base (the checkpoint then holds the base).
std::vector<CheckpointFrozenBase> frozen_base_of(const Layout& layout, const ComputeHomes& homes,
                                                 const Config& config) {
  std::vector<CheckpointFrozenBase> out;
  if (config.strata.checkpoint.keep_base) return out;
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    if (!homes.base_of_files(g) || !homes.frozen_files().recorded(g)) continue;
    const FrozenFiles& files = homes.frozen_files();
    out.push_back({.group = layout.groups[g].name, .crc64 = files.crc(g), .files = files.files_of(g)});
  }
  return out;
}

// The parameters whose compute copies a checkpoint with `frozen_base` leaves
// out, by index: the frozen ones of its groups (CheckpointManifest::compute_in_base).
std::vector<bool> left_out_by(const Layout& layout, const std::vector<CheckpointFrozenBase>& frozen_base) {
  std::vector<bool> out(layout.params.size(), false);
  for (const CheckpointFrozenBase& b : frozen_base) {
    for (std::size_t pi : layout.find_group(b.group)->params) out[pi] = !layout.params[pi].trainable;
  }
  return out;
}

// A state file's tensors in the order save_checkpoint writes them: each
// group's compute copies, then the optimizer arrays of its trainable
// parameters, group after group; of each parameter the range `held` names,
// shaped as the parameter when `whole` (one rank: state.safetensors), else flat.
std::vector<SafetensorsWriter::Declared> checkpoint_tensors(const Layout& layout, Precision precision,
                                                            const HeldRanges& held, bool whole) {
  std::vector<SafetensorsWriter::Declared> declared;
  auto shape = [&](std::size_t pi) {
    return whole ? layout.params[pi].shape : std::vector<std::int64_t>{held[pi].second - held[pi].first};
  };
  for (const GroupPlace& gp : layout.groups) {
    for (std::size_t pi : gp.params) {
      if (held[pi].first == held[pi].second) continue;
      declared.push_back({layout.params[pi].name + ".compute", dtype_of(layout.compute_bytes, precision), shape(pi)});
    }
    for (std::size_t pi : trainable_in(layout, gp)) {
      if (held[pi].first == held[pi].second) continue;
      for (int k = 0; k < layout.optimizer.arrays; ++k) {
        declared.push_back({state_tensor(layout, pi, k), state_dtype(layout.optimizer, k), shape(pi)});
        if (k > 0 && layout.optimizer.blockwise()) {
          declared.push_back({scales_tensor(state_tensor(layout, pi, k)), TensorDtype::kF32,
                              {static_cast<std::int64_t>(OptimizerSpec::blocks(held[pi].second - held[pi].first))}});
        }
      }
    }
  }
  if (layout.optimizer.blockwise()) {
    declared.push_back({std::string(kCodeTableM), TensorDtype::kF32, {128}});
    declared.push_back({std::string(kCodeTableV), TensorDtype::kF32, {256}});
  }
  return declared;
}

// A checkpoint's manifest: the step counts, the loss scaler, the parameters,
// the CRCs of the state files (`state_crcs`) and of the ranks' framework blobs
// (`blob_crcs`, rank 0's first), and the config.
CheckpointManifest checkpoint_manifest(const Layout& layout, const Config& config, const Verdict& verdict,
                                       std::span<const std::int64_t> missed_steps,
                                       std::span<const std::uint64_t> state_crcs,
                                       std::span<const std::uint64_t> blob_crcs,
                                       std::vector<CheckpointFrozenBase> frozen_base) {
  CheckpointManifest m;
  m.step = verdict.applied_steps();
  m.skipped_steps = verdict.skipped_steps();
  m.lr_override = verdict.lr_override();
  const LossScaler::State& ls = verdict.scaler_state();
  m.loss_scaler = {.scale = ls.scale,
                   .iteration = ls.iteration,
                   .last_overflow_iteration = ls.last_overflow_iteration,
                   .hysteresis_left = ls.hysteresis_left};
  m.compute_dtype = std::string(to_string(dtype_of(layout.compute_bytes, config.precision)));
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const ParamDesc& p = layout.params[i];
    m.params.push_back({.name = p.name,
                        .shape = p.shape,
                        .group = p.group,
                        .trainable = p.trainable,
                        .optimizer_group = static_cast<std::int64_t>(p.optimizer_group),
                        .missed_steps = missed_steps[i]});
  }
  const int ranks = static_cast<int>(state_crcs.size());
  if (ranks == 1) {
    m.state_crc64 = state_crcs[0];
  } else {
    m.version = kCheckpointFormatRanks;
    m.ranks = ranks;
    const std::vector<bool> left_out = left_out_by(layout, frozen_base);
    for (int r = 0; r < ranks; ++r) {
      CheckpointStateFile f{
          .file = checkpoint_shard_file(r, ranks), .crc64 = state_crcs[static_cast<std::size_t>(r)], .ranges = {}, .whole = false};
      const HeldRanges held = held_ranges(layout, r, left_out);
      for (std::size_t pi = 0; pi < held.size(); ++pi) {
        if (held[pi].first < held[pi].second) {
          f.ranges.push_back({static_cast<std::int64_t>(pi), held[pi].first, held[pi].second});
        }
      }
      m.shards.push_back(std::move(f));
    }
  }
  m.framework_crc64 = blob_crcs[0];
  if (blob_crcs.size() > 1) m.rank_framework_crc64.assign(blob_crcs.begin(), blob_crcs.end());
  m.config_json = to_json(config);
  if (!frozen_base.empty()) m.version = kCheckpointFormatVersion;
  m.frozen_base = std::move(frozen_base);
  return m;
}

// Publishes a saved checkpoint: its directory `tmp` becomes root/name (one
// there before is moved aside, then removed), then root/latest names it.
core::Status publish_checkpoint(const std::string& root, const std::string& name, const std::string& tmp,
                                const IoConfig& io) {
  const std::string final_dir = str_cat(root, "/", name);
  std::error_code ec;
  if (fs::exists(final_dir)) {
    const std::string old = final_dir + ".old";
    fs::remove_all(old, ec);
    if (::rename(final_dir.c_str(), old.c_str()) != 0) return Status::from_errno(errno, str_cat("rename ", final_dir));
    crash_point("moved_aside");  // latest names final_dir, which is missing until the next rename
  }
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return Status::from_errno(errno, str_cat("rename ", tmp, " to ", final_dir));
  }
  STRATA_RETURN_IF_ERROR(fsync_dir(root));
  crash_point("renamed");
  const std::string pointer = format_latest_pointer(name);
  STRATA_RETURN_IF_ERROR(replace_file(root + "/latest", std::as_bytes(std::span<const char>(pointer)), io));
  fs::remove_all(final_dir + ".old", ec);
  return Status();
}

// Copies a chunk's share of each parameter in `arrays` between the chunk's
// views and the whole arrays, either way.
enum class Exchange { kOutOfChunk, kIntoChunk };
void exchange_chunk_arrays(const Layout& layout, const ChunkPlace& cp, ChunkState& st, StateArrays& arrays,
                           Exchange way) {
  const bool into_chunk = way == Exchange::kIntoChunk;
  for (const Layout::Piece& p : layout.pieces(cp)) {
    const auto it = arrays.find(p.param);
    if (it == arrays.end()) continue;
    const std::int64_t off = layout.places[p.param].trainable_offset;
    for (std::size_t k = 0; k < static_cast<std::size_t>(st.count); ++k) {
      const auto eb = static_cast<std::size_t>(st.arrays[k].elem_bytes);
      const std::int64_t at = p.lo - off - it->second.base;  // in the held range
      std::byte* whole = it->second.arrays[k].data() + static_cast<std::size_t>(at) * eb;
      std::byte* part = st.arrays[k].data + static_cast<std::size_t>(p.lo - cp.begin) * eb;
      std::memcpy(into_chunk ? part : whole, into_chunk ? whole : part, static_cast<std::size_t>(p.hi - p.lo) * eb);
      if (st.arrays[k].scales == nullptr) continue;
      // Blocks: p.lo starts one (a parameter's offset and a chunk's begin both do).
      constexpr std::int64_t kB = core::numerics::kQuantBlockElems;
      float* whole_scales = it->second.scales[k].data() + at / kB;
      float* part_scales = st.arrays[k].scales + (p.lo - cp.begin) / kB;
      std::memcpy(into_chunk ? part_scales : whole_scales, into_chunk ? whole_scales : part_scales,
                  OptimizerSpec::blocks(p.hi - p.lo) * sizeof(float));
    }
  }
}

// The checkpoint is of this engine's model: the same parameters (names,
// shapes and trainability, in the same order) and compute dtype (placement
// and rank count may differ).
Status same_model(const std::string& dir, const CheckpointManifest& m, const std::vector<ParamDesc>& params,
                  const Config& config) {
  if (m.params.size() != params.size()) {
    return Status::failed_precondition(str_cat(dir, ": the checkpoint has ", m.params.size(),
                                               " parameters; this engine has ", params.size()));
  }
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const ParamDesc& p = params[i];
    const CheckpointParam& cp = m.params[i];
    if (cp.name != p.name || cp.shape != p.shape || cp.trainable != p.trainable) {
      return Status::failed_precondition(str_cat(dir, ": parameter #", i, " is '", cp.name,
                                                 "' in the checkpoint and '", p.name,
                                                 "' here (or its shape or trainability differs)"));
    }
  }
  const std::string_view compute_dtype = to_string(dtype_of(config.compute_bytes(), config.precision));
  if (m.compute_dtype != compute_dtype) {
    return Status::failed_precondition(str_cat(dir, ": compute copies are ", m.compute_dtype,
                                               " in the checkpoint; this engine uses ", compute_dtype));
  }
  return Status();
}

// A checkpoint file whose bytes give `got` where the manifest records `recorded`.
Status crc_mismatch(const std::string& path, std::uint64_t got, std::uint64_t recorded) {
  return Status::data_loss(str_cat(path, ": CRC64 mismatch: its bytes give ", crc64_hex(got),
                                   ", the manifest records ", crc64_hex(recorded),
                                   " (the file is damaged or truncated)"));
}

// What the ranks compare to know they found the same checkpoint: its step
// folder's name and manifest.
std::uint64_t checkpoint_fingerprint(const std::string& dir, const CheckpointManifest& m) {
  const std::string seen = str_cat(fs::path(dir).filename().string(), "\n", format_checkpoint_manifest(m));
  return nvme::crc64(0, std::as_bytes(std::span<const char>(seen)));
}

// True when `arrays` hold every piece of the chunk, so that copying them in
// writes all of it (the chunk need not be read first).
bool arrays_fill_chunk(const Layout& layout, const ChunkPlace& cp, const StateArrays& arrays) {
  for (const Layout::Piece& p : layout.pieces(cp)) {
    const auto it = arrays.find(p.param);
    if (it == arrays.end()) return false;
    const std::int64_t at = p.lo - layout.places[p.param].trainable_offset - it->second.base;
    const auto held = static_cast<std::int64_t>(it->second.arrays[0].size() / 4);  // fp32 masters
    if (at < 0 || at + (p.hi - p.lo) > held) return false;
  }
  return true;
}

// Where a parameter's elements are in a checkpoint's state files: file
// `file` holds [lo, hi) of them (the file's tensors hold just those, flat, or
// with one rank the whole parameter).
struct Held {
  std::size_t file;
  std::int64_t lo, hi;
};
using Sources = std::vector<std::vector<Held>>;  // per parameter

Sources sources_of(const CheckpointManifest& m, const std::vector<CheckpointStateFile>& files,
                   const Layout& layout) {
  Sources out(layout.params.size());
  for (std::size_t f = 0; f < files.size(); ++f) {
    if (files[f].whole) {
      for (std::size_t pi = 0; pi < layout.params.size(); ++pi) {
        if (!m.compute_in_base(pi)) out[pi].push_back({f, 0, layout.params[pi].numel()});
      }
    }
    for (const CheckpointRange& r : files[f].ranges) out[static_cast<std::size_t>(r.param)].push_back({f, r.lo, r.hi});
  }
  return out;
}

// Reads elements [a, b) of array k of parameter pi into `out` (its base is a)
// as the engine keeps them, from the state files that hold them: the bytes
// themselves (and the scales) when the checkpoint has the engine's format,
// else converted from the checkpoint's (saved with another
// strata.optimizer_state): decoded to fp32 (bf16 and int8 codes exactly as
// the engine reads them), then encoded the engine's way (fp32 as is; bf16
// rounded to nearest even; int8_blockwise quantized per block of the
// parameter with its absmax, as a step would). `a` starts a block of the
// engine's format, and each file's ranges start blocks of its own.
core::Status read_state_range(std::span<const SafetensorsReader> readers, const std::vector<Held>& held,
                              const Layout& layout, std::size_t pi, int k, std::int64_t a, std::int64_t b,
                              ParamState& out) {
  namespace nx = core::numerics;
  constexpr std::int64_t kB = nx::kQuantBlockElems;
  const OptimizerSpec& spec = layout.optimizer;
  const std::string name = state_tensor(layout, pi, k);
  const TensorDtype dtype = state_dtype(spec, k);
  const auto kk = static_cast<std::size_t>(k);
  const auto n = static_cast<std::size_t>(b - a);
  const std::size_t eb = dtype_size(dtype);
  out.base = a;
  std::vector<std::byte>& bytes = out.arrays[kk];
  bytes.resize(n * eb);
  const bool blockwise = k > 0 && spec.blockwise();
  const std::size_t blocks = OptimizerSpec::blocks(b - a);
  if (blockwise) out.scales[kk].resize(blocks);
  bool same_format = true;
  for (const Held& h : held) {
    const TensorInfo* info = readers[h.file].find(name);
    if (info != nullptr && info->dtype != dtype) same_format = false;  // (a missing tensor: the reads name it)
  }
  if (same_format) {
    for (const Held& h : held) {
      const std::int64_t x = std::max(a, h.lo), y = std::min(b, h.hi);
      if (x >= y) continue;
      const SafetensorsReader& r = readers[h.file];
      STRATA_RETURN_IF_ERROR(r.read_raw_range(name, static_cast<std::uint64_t>(x - h.lo) * eb,
                                              std::span(bytes).subspan(static_cast<std::size_t>(x - a) * eb,
                                                                       static_cast<std::size_t>(y - x) * eb)));
      if (!blockwise) continue;
      std::span<float> part = std::span(out.scales[kk]).subspan(static_cast<std::size_t>((x - a) / kB),
                                                                OptimizerSpec::blocks(y - x));
      STRATA_RETURN_IF_ERROR(r.read_raw_range(scales_tensor(name), static_cast<std::uint64_t>((x - h.lo) / kB) * 4,
                                              std::as_writable_bytes(part)));
    }
    return Status();
  }
  const bool is_signed = spec.signed_codes(k);
  std::vector<float> wide(n);
  for (const Held& h : held) {
    const std::int64_t x = std::max(a, h.lo), y = std::min(b, h.hi);
    if (x >= y) continue;
    const SafetensorsReader& r = readers[h.file];
    const TensorInfo* info = r.find(name);
    if (info == nullptr) return Status::not_found(str_cat(r.path(), ": no tensor named '", name, "'"));
    std::span<float> to = std::span(wide).subspan(static_cast<std::size_t>(x - a), static_cast<std::size_t>(y - x));
    if (info->dtype != TensorDtype::kU8) {
      STRATA_RETURN_IF_ERROR(r.read_f32_range(name, static_cast<std::uint64_t>(x - h.lo), to));
      continue;
    }
    // Codes are decoded from the start of the file's block that holds x.
    const std::int64_t x0 = h.lo + (x - h.lo) / kB * kB;
    const auto m = static_cast<std::size_t>(y - x0);
    std::vector<std::uint8_t> codes(m);
    std::vector<float> scales(OptimizerSpec::blocks(y - x0)), decoded(m);
    STRATA_RETURN_IF_ERROR(r.read_raw_range(name, static_cast<std::uint64_t>(x0 - h.lo),
                                            std::as_writable_bytes(std::span<std::uint8_t>(codes))));
    STRATA_RETURN_IF_ERROR(r.read_raw_range(scales_tensor(name), static_cast<std::uint64_t>((x0 - h.lo) / kB) * 4,
                                            std::as_writable_bytes(std::span<float>(scales))));
    widen_state(1, is_signed, reinterpret_cast<const std::byte*>(codes.data()), scales.data(), m, decoded.data());
    std::copy(decoded.begin() + (x - x0), decoded.end(), to.begin());
  }
  switch (dtype) {
    case TensorDtype::kF32:
      std::memcpy(bytes.data(), wide.data(), n * 4);
      break;
    case TensorDtype::kBf16: {
      auto* narrow = reinterpret_cast<std::uint16_t*>(bytes.data());
      for (std::size_t i = 0; i < n; ++i) narrow[i] = nx::fp32_to_bf16_bits(wide[i]);
      break;
    }
    default: {
      auto* codes = reinterpret_cast<std::uint8_t*>(bytes.data());
      for (std::size_t blk = 0; blk < blocks; ++blk) {
        const std::size_t lo = blk * nx::kQuantBlockElems, hi = std::min(n, lo + nx::kQuantBlockElems);
        float absmax = 0.0f;
        for (std::size_t i = lo; i < hi; ++i) absmax = nx::absmax_step(absmax, wide[i]);
        const float sc = nx::block_scale(absmax);
        out.scales[kk][blk] = sc;
        for (std::size_t i = lo; i < hi; ++i) {
          codes[i] = is_signed ? nx::quantize_m(nx::kQuantTables, wide[i], sc) : nx::quantize_v(nx::kQuantTables, wide[i], sc);
        }
      }
      break;
    }
  }
  return Status();
}

}  // namespace

core::Status Engine::visit_group_state(std::size_t g, WriteBack write_back,
                                       const std::function<Status(const ChunkPlace&, ChunkState&)>& fn) {
  const GroupPlace& gp = layout_.groups[g];
  for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count; ++c) {
    const ChunkPlace& cp = layout_.chunks[c];
    const std::uint64_t bytes = layout_.state_bytes(cp);
    const bool whole = write_back == WriteBack::kWhole;
    if (cp.state_tier == Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan home, state_->device_state(c));
      // Through the cache: between steps it holds the step's staging, which
      // it gives back when the budget is tight.
      STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer host, pinned_cache_->get(bytes, "state staging"));
      if (whole) {
        parallel_zero(*cpu_adam_, host.bytes().first(bytes));
      } else {
        STRATA_RETURN_IF_ERROR(copy_d2h(host.bytes().first(bytes), home));
      }
      ChunkState st = state_->staged_views(c, host.bytes());
      STRATA_RETURN_IF_ERROR(fn(cp, st));
      if (write_back != WriteBack::kNo) STRATA_RETURN_IF_ERROR(copy_h2d(home, host.bytes().first(bytes)));
      pinned_cache_->put(std::move(host));
      continue;
    }
    gpu::PinnedBuffer stage;
    ChunkState st;
    if (whole && cp.state_tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(stage, pinned_cache_->get(state_->staging_bytes(c), "state staging"));
      parallel_zero(*cpu_adam_, stage.bytes());
      st = state_->staged_views(c, stage.bytes());
    } else {
      STRATA_ASSIGN_OR_RETURN(st, load_host_chunk(c, stage));
    }
    STRATA_RETURN_IF_ERROR(fn(cp, st));
    if (write_back != WriteBack::kNo) STRATA_RETURN_IF_ERROR(state_->store(c, stage.bytes()));
  }
  return Status();
}

core::Status Engine::agree(const char* op, const char* phase, core::Status local, std::uint64_t payload,
                           std::vector<std::uint64_t>* payloads) {
  const auto ranks = static_cast<std::size_t>(ranks_.share.ranks);
  if (ranks == 1) {
    if (payloads != nullptr) *payloads = {payload};
    return local;
  }
  // Each rank's status code and payload, in rank order.
  const std::array<std::uint64_t, 2> mine{static_cast<std::uint64_t>(local.code()), payload};
  std::vector<std::uint64_t> all(2 * ranks);
  Status gathered = ranks_.weights->all_gather(mine.data(), all.data(), 2, partition::DType::kI64);
  if (!gathered.ok()) {
    if (!local.ok()) return local;
    return std::move(gathered).annotate(str_cat(op, ": agreeing with the other ranks after ", phase));
  }
  if (!local.ok()) return local;
  for (std::size_t k = 0; k < ranks; ++k) {
    if (all[2 * k] != 0) {
      const auto code = static_cast<core::StatusCode>(all[2 * k]);
      return Status(code, str_cat(op, ": rank ", k, " failed ", phase, " (", core::status_code_name(code),
                                  "; its own error names the cause), so this rank stops too"));
    }
  }
  if (payloads != nullptr) {
    payloads->resize(ranks);
    for (std::size_t k = 0; k < ranks; ++k) (*payloads)[k] = all[2 * k + 1];
  }
  return Status();
}

core::Status Engine::ready_between_steps(const char* op) {
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer(op));
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation(op));  // it may be reading the state used here
  STRATA_RETURN_IF_ERROR(check_finalized(op));
  if (std::string_view(op) != "load_checkpoint") STRATA_RETURN_IF_ERROR(check_not_torn(op));
  if (!between_steps()) {
    return Status::failed_precondition(str_cat(
        op, " in the middle of a step (groups fetched or gradients pending): call it between steps (after step_end)"));
  }
  return Status();
}

core::Status Engine::write_state_file(const std::string& path, std::uint64_t* crc) {
  // One sequential stream: each group's compute copies, then the optimizer
  // arrays of its trainable parameters (in parameter order), group after
  // group, of what this rank saves of each (held_ranges); tensors are
  // declared in that order, so the header and then the data go out front
  // to back.
  const RankShare share = ranks_.share;
  const HeldRanges held = held_ranges(layout_, share.rank, left_out_by(layout_, frozen_base_of(layout_, *homes_, config_)));
  const int cb = layout_.compute_bytes;
  // Destruction order: the writer (which waits for its writes) before the backend.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoBackend> backend, file_backend(config_, "save_checkpoint"));
  STRATA_ASSIGN_OR_RETURN(
      SafetensorsWriter writer,
      SafetensorsWriter::create_sequential(path, checkpoint_tensors(layout_, config_.precision, held, share.ranks == 1),
                                           {{"format", "strata-checkpoint"}}, *backend,
                                           direct_file_options(config_.strata.io)));
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    const Step::TrafficPause pause(*step_);  // checkpoint traffic is not step traffic
    // What of the group's home the file takes: nothing (a group of a base
    // left out, or none of it this rank's), the trainable range alone when
    // no frozen parameter of the group is written (a LoRA block over a base
    // left out, or whose frozen parameters other ranks' files hold: the
    // frozen part is not read), or the whole home.
    bool any_held = false, frozen_held = false;
    for (std::size_t pi : gp.params) {
      if (held[pi].first == held[pi].second) continue;
      any_held = true;
      frozen_held = frozen_held || !layout_.params[pi].trainable;
    }
    gpu::PinnedBuffer staging;
    std::span<std::byte> host;
    std::size_t host_lo = 0;  // the home's byte at host[0]
    if (any_held && !frozen_held && homes_->frozen_apart(g) && !layout_.compute_sharded) {
      STRATA_ASSIGN_OR_RETURN(host, homes_->load_trainable(g, staging, step_lane()));
      host_lo = static_cast<std::size_t>(layout_.trainable_home_range(gp).lo);
    } else if (any_held) {
      STRATA_ASSIGN_OR_RETURN(host, homes_->load(g, staging, step_lane()));
    }
    for (std::size_t pi : gp.params) {
      const auto [lo, hi] = held[pi];
      if (lo == hi) continue;
      // Where element lo sits in the home (the whole buffer, or a shard at stage 3).
      const auto at = static_cast<std::size_t>(layout_.shard_of(pi, share.rank).home);
      STRATA_RETURN_IF_ERROR(writer.write_raw(layout_.params[pi].name + ".compute",
                                              host.subspan(at * cb - host_lo, static_cast<std::size_t>(hi - lo) * cb)));
    }
    // Gather each trainable parameter's arrays (what this rank holds) from the chunks.
    StateArrays arrays;
    for (std::size_t pi : trainable_in(layout_, gp)) {
      const auto [lo, hi] = held[pi];
      if (lo == hi) continue;
      ParamState& a = arrays[pi];
      a.base = lo;
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        const auto kk = static_cast<std::size_t>(k);
        a.arrays[kk].resize(static_cast<std::size_t>(hi - lo) * static_cast<std::size_t>(layout_.optimizer.elem_bytes(k)));
        if (k > 0 && layout_.optimizer.blockwise()) a.scales[kk].resize(OptimizerSpec::blocks(hi - lo));
      }
    }
    STRATA_RETURN_IF_ERROR(visit_group_state(g, WriteBack::kNo, [&](const ChunkPlace& cp, ChunkState& st) {
      exchange_chunk_arrays(layout_, cp, st, arrays, Exchange::kOutOfChunk);
      return Status();
    }));
    for (auto& [pi, a] : arrays) {
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        const auto kk = static_cast<std::size_t>(k);
        const std::string name = state_tensor(layout_, pi, k);
        STRATA_RETURN_IF_ERROR(writer.write_raw(name, a.arrays[kk]));
        if (k > 0 && layout_.optimizer.blockwise()) {
          STRATA_RETURN_IF_ERROR(writer.write_f32(scales_tensor(name), a.scales[kk]));
        }
      }
    }
  }
  if (layout_.optimizer.blockwise()) {
    STRATA_RETURN_IF_ERROR(writer.write_f32(kCodeTableM, core::numerics::kQuantTables.m_values));
    STRATA_RETURN_IF_ERROR(writer.write_f32(kCodeTableV, core::numerics::kQuantTables.v_values));
  }
  STRATA_RETURN_IF_ERROR(writer.finish());
  STRATA_ASSIGN_OR_RETURN(*crc, writer.crc64());
  return Status();
}

core::Status Engine::save_checkpoint(const std::string& root, std::span<const std::byte> blob) {
  STRATA_ENGINE_ENTRY("save_checkpoint");
  // With several ranks every rank calls it and each phase ends with all of
  // them agreeing (agree), so that a rank's failure stops every rank at the
  // same point and nothing is published unless every state file is written.
  constexpr const char* kOp = "save_checkpoint";
  const RankShare share = ranks_.share;
  // Before any collective: a certain step's optimizer gathers over the same
  // communicator during the backward (every rank is refused alike here).
  STRATA_RETURN_IF_ERROR(step_->refuse_while_applying(kOp));
  STRATA_RETURN_IF_ERROR(agree(kOp, "checking the engine", ready_between_steps(kOp)));
  // overlap "delayed": the checkpoint holds the latest update, and this run
  // goes on from it as a run resumed from it will.
  STRATA_RETURN_IF_ERROR(agree(kOp, "applying the delayed update", step_->flush_delayed(kOp)));
  fetcher_->settle_prefetches();  // the compute copies' homes are read below
  // The steps that left each parameter as it was (strata.no_grad "skip"):
  // with several ranks only those holding a piece of a parameter count them,
  // so every rank takes the largest count of any (the manifest's).
  if (share.ranks > 1 && !step_->missed_steps().empty()) {
    std::vector<std::int64_t> missed = step_->missed_steps();
    STRATA_RETURN_IF_ERROR(
        ranks_.weights->all_reduce(missed.data(), missed.size(), partition::DType::kI64, partition::ReduceOp::kMax)
            .annotate(str_cat(kOp, ": the steps each parameter missed, over the ranks")));
    step_->restore_missed_steps(std::move(missed));
  }
  const std::string name = str_cat("step-", step_->verdict().applied_steps());
  const std::string tmp = str_cat(root, "/.", name, ".tmp");
  // Rank 0 prepares the folder the ranks write into (a file system they share).
  Status prepared;
  if (share.rank == 0) {
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) prepared = Status::from_errno(ec.value(), str_cat("create checkpoint directory ", root));
    // What interrupted saves left behind goes first (each named at info level).
    if (prepared.ok()) {
      if (auto removed = remove_interrupted_saves(root); !removed.ok()) {
        STRATA_LOG(kWarn) << "save_checkpoint: could not remove what an interrupted save left: " << removed.status();
      }
      fs::remove_all(tmp, ec);
      fs::create_directories(tmp, ec);
      if (ec) prepared = Status::from_errno(ec.value(), str_cat("create ", tmp));
    }
  }
  STRATA_RETURN_IF_ERROR(agree(kOp, "preparing the checkpoint folder", std::move(prepared)));
  std::uint64_t crc = 0;
  const std::string file = share.ranks == 1 ? "state.safetensors" : checkpoint_shard_file(share.rank, share.ranks);
  Status wrote = write_state_file(tmp + "/" + file, &crc);
  std::vector<std::uint64_t> crcs;
  STRATA_RETURN_IF_ERROR(agree(kOp, "writing its state file", std::move(wrote), crc, &crcs));
  crash_point("state_written");
  // Every rank's framework blob (its RNG states, its data position: each
  // rank's own), rank 0's as framework.bin.
  const std::string blob_file = share.rank == 0 ? "framework.bin" : checkpoint_framework_file(share.rank, share.ranks);
  Status wrote_blob = write_file_synced(tmp + "/" + blob_file, blob, config_.strata.io);
  std::vector<std::uint64_t> blob_crcs;
  STRATA_RETURN_IF_ERROR(
      agree(kOp, "writing its framework blob", std::move(wrote_blob), nvme::crc64(0, blob), &blob_crcs));
  // Rank 0 writes the manifest and makes the checkpoint latest.
  Status published;
  if (share.rank == 0) published = publish_save(root, name, tmp, crcs, blob_crcs);
  return agree(kOp, "publishing the checkpoint", std::move(published));
}

core::Status Engine::publish_save(const std::string& root, const std::string& name, const std::string& tmp,
                                  std::span<const std::uint64_t> state_crcs,
                                  std::span<const std::uint64_t> blob_crcs) {
  const std::string text =
      format_checkpoint_manifest(checkpoint_manifest(layout_, config_, step_->verdict(), step_->missed_steps(),
                                                     state_crcs, blob_crcs, frozen_base_of(layout_, *homes_, config_)));
  STRATA_RETURN_IF_ERROR(write_file_synced(tmp + "/manifest.json", std::as_bytes(std::span<const char>(text)),
                                           config_.strata.io));
  STRATA_RETURN_IF_ERROR(fsync_dir(tmp));
  crash_point("manifest_written");

  STRATA_RETURN_IF_ERROR(publish_checkpoint(root, name, tmp, config_.strata.io));
  // Retention, once the save is latest: a failure here loses nothing saved.
  const RetentionPolicy policy{.keep_last = config_.strata.checkpoint.keep_last,
                               .keep_every = config_.strata.checkpoint.keep_every};
  if (auto removed = apply_retention(root, step_->verdict().applied_steps(), policy); !removed.ok()) {
    STRATA_LOG(kWarn) << "save_checkpoint: " << name
                      << " is saved, but removing older checkpoints failed: " << removed.status();
  }
  return Status();
}

// A checkpoint read and checked, ready to replace the engine's state.
struct Engine::CheckpointToLoad {
  // The state files' CRC64s are taken as the load reads them and checked
  // after (check_files_as_read), not read whole before anything changes:
  // for a load into state that holds no values yet (finalize_from_checkpoint).
  bool verify_as_read = false;
  std::vector<nvme::DirectFileReader*> direct;  // each file's (owned by its reader)
  // Whether this rank checks file f: every ranks-th file is each rank's (a
  // rank loading as many ranks' checkpoint reads its own file whole).
  static bool checks(std::size_t f, const RankShare& share) {
    return f % static_cast<std::size_t>(share.ranks) == static_cast<std::size_t>(share.rank);
  }
  std::string dir;
  CheckpointManifest manifest;
  std::vector<CheckpointStateFile> files;
  Sources sources;  // per parameter, the files' ranges that hold it (sources_of)
  LossScaler::State scaler;
  std::vector<std::byte> blob;
  // CRC64 of the step folder's name and the manifest: the ranks compare it.
  std::uint64_t fingerprint = 0;
  // Stage 3 over several ranks: the groups whose left-out base each rank
  // holds a shard of, their CRC64 and the message's start (compare_sharded_base).
  struct ShardedBase {
    std::size_t group;
    std::uint64_t crc64;
    std::string what;
  };
  std::vector<ShardedBase> sharded_base;
  // Destruction order: the readers (they own their files) before the backend.
  std::unique_ptr<nvme::IoBackend> backend;
  std::vector<SafetensorsReader> readers;  // one per file
};

// The frozen base a checkpoint leaves out (its manifest's frozen_base) must be
// this engine's, byte for byte: the CRC64 of each such group's frozen range
// (Layout::frozen_home_range) in the compute dtype, which the save recorded,
// is that of the engine's values: those its files give (FrozenFiles' record)
// where the group is read from its files, else its home's, read here (with
// the compute copies sharded over ranks at stage 3: gathered later, in a
// phase every rank reaches, compare_sharded_base). The frozen values never
// change in training, so a run that imported the same base loads it,
// wherever its base lives.
core::Status Engine::check_frozen_base(const std::string& dir, const CheckpointManifest& m, CheckpointToLoad& ck) {
  for (const CheckpointFrozenBase& b : m.frozen_base) {
    std::string saved_from;
    for (const std::string& f : b.files) saved_from += (saved_from.empty() ? "" : ", ") + f;
    const std::string what = str_cat(dir, ": the checkpoint does not hold the compute copies of the frozen "
                                          "parameters of group '", b.group, "', which the run that saved it read from ",
                                      saved_from, " (strata.frozen_base), CRC64 ", crc64_hex(b.crc64),
                                      " in the compute dtype; ");
    const GroupPlace* gp = layout_.find_group(b.group);
    if (gp == nullptr) return Status::failed_precondition(str_cat(what, "this engine has no such group"));
    const auto g = static_cast<std::size_t>(gp - layout_.groups.data());
    // The same frozen parameters in the group (else the fetch groups differ
    // and the bytes compared would not be the same parameters').
    std::vector<std::string> saved_names, names;
    for (const CheckpointParam& p : m.params) {
      if (p.group == b.group && !p.trainable) saved_names.push_back(p.name);
    }
    for (std::size_t pi : gp->params) {
      if (!layout_.params[pi].trainable) names.push_back(layout_.params[pi].name);
    }
    std::sort(saved_names.begin(), saved_names.end());
    std::sort(names.begin(), names.end());
    if (saved_names != names) {
      return Status::failed_precondition(str_cat(what, "this engine's group '", b.group, "' holds ", names.size(),
                                                 " frozen parameters, the checkpoint's ", saved_names.size(),
                                                 " others (the fetch groups differ: the same config and model "
                                                 "give the same groups)"));
    }
    std::uint64_t have = 0;
    std::string here;
    // A base read from its files: their record (the files are never
    // written). A kept copy of them (frozen_kept_from_files) or any other
    // home: the bytes the home holds (a load that failed half-way may have
    // written there).
    if (homes_->frozen_from_files(g)) {
      const FrozenFiles& files = homes_->frozen_files();
      if (!files.recorded(g)) return Status::internal(str_cat(what, "this engine has not read its own yet"));
      have = files.crc(g);
      here = files.describe(g);
    } else if (layout_.compute_sharded) {
      // Each rank holds a shard of the base: gathered and compared once
      // every rank found the checkpoint fit (a gather is a collective).
      ck.sharded_base.push_back({g, b.crc64, what});
      continue;
    } else {
      // Nothing may still read the home, and these reads are not a step's.
      fetcher_->settle_prefetches();
      const Step::TrafficPause pause(*step_);
      gpu::PinnedBuffer staging;
      STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(g, staging, step_lane()));
      const Layout::ByteRange fr = layout_.frozen_home_range(*gp);
      have = nvme::crc64(0, host.subspan(static_cast<std::size_t>(fr.lo), static_cast<std::size_t>(fr.size())));
      here = str_cat("the frozen parameters of group '", b.group, "' (its compute copies)");
    }
    if (have != b.crc64) {
      return Status::failed_precondition(str_cat(what, "this engine's values of ", here, " give CRC64 ",
                                                 crc64_hex(have), ": load it over the base it was trained on"));
    }
  }
  return Status();
}

core::Status Engine::check_checkpoint(const std::string& root, CheckpointToLoad& ck) {
  const RankShare share = ranks_.share;
  STRATA_ASSIGN_OR_RETURN(CheckpointLocation loc, locate_checkpoint(root, config_.strata.io));
  ck.dir = loc.dir;
  ck.manifest = std::move(loc.manifest);
  const std::string& dir = ck.dir;
  const CheckpointManifest& m = ck.manifest;
  STRATA_RETURN_IF_ERROR(same_model(dir, m, layout_.params, config_));
  STRATA_RETURN_IF_ERROR(check_frozen_base(dir, m, ck));
  // Integrity before anything changes: the state files' CRC64s, each read
  // front to back with direct reads (read-ahead); with several ranks each
  // rank checks every ranks-th file and they agree before any rank loads.
  ck.files = checkpoint_state_files(m);
  STRATA_ASSIGN_OR_RETURN(ck.backend, file_backend(config_, "load_checkpoint"));
  for (std::size_t f = 0; f < ck.files.size(); ++f) {
    const std::string path = str_cat(dir, "/", ck.files[f].file);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::DirectFileReader> file,
                            nvme::DirectFileReader::open(*ck.backend, path, direct_file_options(config_.strata.io)));
    ck.direct.push_back(file.get());
    if (!ck.checks(f, share)) {
      // (another rank checks it)
    } else if (ck.verify_as_read) {
      file->take_crc64_as_read();
    } else {
      STRATA_ASSIGN_OR_RETURN(const std::uint64_t crc, file->crc64());
      if (crc != ck.files[f].crc64) return crc_mismatch(path, crc, ck.files[f].crc64);
    }
    // Tensors come in with direct reads of the aligned blocks around them.
    STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(std::move(file)));
    // 8-bit codes are read with this build's tables only.
    STRATA_RETURN_IF_ERROR(check_code_tables(reader));
    ck.readers.push_back(std::move(reader));
  }
  // This rank's own framework blob when the checkpoint has one (saved by as
  // many ranks), else rank 0's.
  const auto [blob_file, blob_crc] = checkpoint_framework_file_for(m, share.rank, share.ranks);
  STRATA_ASSIGN_OR_RETURN(ck.blob, read_file(dir + "/" + blob_file, config_.strata.io));
  if (const std::uint64_t crc = nvme::crc64(0, ck.blob); crc != blob_crc) {
    return crc_mismatch(str_cat(dir, "/", blob_file), crc, blob_crc);
  }
  // The optimizer's arrays, and no other optimizer's, before anything changes.
  ck.sources = sources_of(m, ck.files, layout_);
  const Sources& sources = ck.sources;
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (!layout_.params[pi].trainable) continue;
    for (const Held& h : sources[pi]) {
      const SafetensorsReader& reader = ck.readers[h.file];
      for (std::string_view array : {"exp_avg", "exp_avg_sq"}) {
        const std::string name = layout_.params[pi].name + "." + std::string(array);
        const bool kept = layout_.optimizer.index_of(array) > 0;
        if ((reader.find(name) != nullptr) != kept) {
          return Status::failed_precondition(str_cat(
              reader.path(), ": ", kept ? "has no " : "has ", name, ", which optimizer.type ",
              to_string(layout_.optimizer.type), kept ? " keeps" : " does not keep",
              ": the checkpoint was saved with another optimizer (a checkpoint resumes only with its own)"));
        }
      }
    }
  }
  // Every tensor each file's ranges name, with a dtype the load reads and the
  // range's element count, so that no read below fails part-way.
  constexpr std::int64_t kB = core::numerics::kQuantBlockElems;
  const TensorDtype compute = dtype_of(layout_.compute_bytes, config_.precision);
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    for (const Held& h : sources[pi]) {
      const SafetensorsReader& reader = ck.readers[h.file];
      const std::int64_t n = h.hi - h.lo;
      auto expect = [&](const std::string& name, std::initializer_list<TensorDtype> dtypes,
                        std::int64_t elems) -> Status {
        const TensorInfo* t = reader.find(name);
        const std::string what = str_cat(reader.path(), ": ", name, ", which the manifest says holds elements [",
                                         h.lo, ", ", h.hi, ") of ", layout_.params[pi].name);
        if (t == nullptr) return Status::data_loss(str_cat(what, ", is missing"));
        if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end()) {
          return Status::data_loss(str_cat(what, ", is ", to_string(t->dtype), ", which a checkpoint never holds there"));
        }
        if (t->numel() != elems) {
          return Status::data_loss(str_cat(what, ", has ", t->numel(), " elements, not ", elems));
        }
        if (t->dtype == TensorDtype::kU8 && h.lo % kB != 0) {
          return Status::data_loss(str_cat(what, ", holds 8-bit codes from element ", h.lo,
                                           ", which does not start a block of ", kB));
        }
        return Status();
      };
      STRATA_RETURN_IF_ERROR(expect(layout_.params[pi].name + ".compute", {compute}, n));
      if (!layout_.params[pi].trainable) continue;
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        const std::string name = state_tensor(layout_, pi, k);
        if (k == 0) {
          STRATA_RETURN_IF_ERROR(expect(name, {TensorDtype::kF32}, n));
          continue;
        }
        STRATA_RETURN_IF_ERROR(expect(name, {TensorDtype::kF32, TensorDtype::kBf16, TensorDtype::kU8}, n));
        if (reader.find(name)->dtype == TensorDtype::kU8) {
          STRATA_RETURN_IF_ERROR(
              expect(scales_tensor(name), {TensorDtype::kF32}, static_cast<std::int64_t>(OptimizerSpec::blocks(n))));
        }
      }
    }
  }
  // Moments saved in another format are converted as they come in (read_state_range).
  for (std::size_t pi = 0; pi < layout_.params.size() && layout_.optimizer.arrays >= 2; ++pi) {
    if (!layout_.params[pi].trainable || sources[pi].empty()) continue;
    const TensorInfo* info = ck.readers[sources[pi].front().file].find(state_tensor(layout_, pi, 1));
    const TensorDtype want = state_dtype(layout_.optimizer, 1);
    if (info != nullptr && info->dtype != want) {
      const std::string what =
          str_cat("load_checkpoint: ", dir, " keeps the optimizer's arrays as ", to_string(info->dtype),
                  info->dtype == TensorDtype::kU8 ? " codes" : "", "; this engine keeps them as ", to_string(want),
                  want == TensorDtype::kU8 ? " codes" : "", " (strata.optimizer_state.format \"",
                  to_string(config_.strata.optimizer_state.format), "\"), so they are converted");
      // To fp32 is exact; anything else rounds.
      if (want == TensorDtype::kF32) {
        STRATA_LOG(kInfo) << what << " exactly";
      } else {
        STRATA_LOG(kWarn) << what << (want == TensorDtype::kBf16 ? ", rounded to nearest even" : ", quantized per block");
      }
    }
    break;
  }
  if (m.ranks != share.ranks) {
    STRATA_LOG(kInfo) << "load_checkpoint: " << dir << " was saved by " << m.ranks << " rank(s); this run has "
                      << share.ranks << ", so the state is resharded as it is read";
  }
  // The loss scaler's state must be one this config reaches (fp16.hysteresis bounds hysteresis_left).
  ck.scaler.scale = m.loss_scaler.scale;
  ck.scaler.iteration = m.loss_scaler.iteration;
  ck.scaler.last_overflow_iteration = m.loss_scaler.last_overflow_iteration;
  ck.scaler.hysteresis_left = m.loss_scaler.hysteresis_left;
  if (const Status fits = step_->verdict().check_restore(ck.scaler); !fits.ok()) {
    return Status::failed_precondition(str_cat(dir, "/manifest.json: ", fits.message(),
                                               ": the checkpoint's loss scaler does not fit this engine's fp16 config"));
  }
  // Last (it reads the frozen base): a frozen base of its files' values (read
  // from them, or kept in memory) is never written after the initial values,
  // so the checkpoint's copies of it must be the files' values
  // (a checkpoint that leaves them out named them: check_frozen_base).
  const auto cb = static_cast<std::size_t>(layout_.compute_bytes);
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    if (!homes_->base_of_files(g)) continue;
    const auto left_out = [&](const CheckpointFrozenBase& b) { return b.group == layout_.groups[g].name; };
    if (std::any_of(m.frozen_base.begin(), m.frozen_base.end(), left_out)) continue;
    const Layout::ByteRange fr = layout_.frozen_home_range(layout_.groups[g]);
    std::vector<std::byte> frozen(static_cast<std::size_t>(fr.size()));
    for (std::size_t pi : layout_.groups[g].params) {
      if (layout_.params[pi].trainable) continue;
      const std::size_t at = static_cast<std::size_t>(layout_.places[pi].compute_offset) * cb - fr.lo;
      for (const Held& h : sources[pi]) {
        STRATA_RETURN_IF_ERROR(ck.readers[h.file].read_raw_range(
            layout_.params[pi].name + ".compute", 0,
            std::span<std::byte>(frozen).subspan(at + static_cast<std::size_t>(h.lo) * cb,
                                                 static_cast<std::size_t>(h.hi - h.lo) * cb)));
      }
    }
    STRATA_RETURN_IF_ERROR(homes_->check_frozen(g, frozen).annotate(str_cat("load_checkpoint: ", dir)));
  }
  ck.fingerprint = checkpoint_fingerprint(dir, m);
  return Status();
}

core::Status Engine::compare_sharded_base(const CheckpointToLoad& ck) {
  fetcher_->settle_prefetches();  // nothing may still read the homes
  const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
  Status local;
  for (const CheckpointToLoad::ShardedBase& b : ck.sharded_base) {
    gpu::PinnedBuffer staging;
    std::span<std::byte> whole;
    gather_compute(b.group, staging, whole, local);  // every rank, even after a failure (carried in it)
    if (!local.ok()) continue;
    // The group whole, as one rank's home holds it: the frozen parameters
    // first, up to the trainable ones (Layout: trainable_compute_begin).
    const GroupPlace& gp = layout_.groups[b.group];
    const std::uint64_t n = gp.trainable_elems == 0 ? whole.size() : static_cast<std::uint64_t>(gp.trainable_compute_begin) * cb;
    const std::uint64_t have = nvme::crc64(0, whole.first(static_cast<std::size_t>(n)));
    if (have != b.crc64) {
      local = Status::failed_precondition(str_cat(
          b.what, "this engine's values of the frozen parameters of group '", gp.name, "' (gathered from its ",
          ranks_.share.ranks, " ranks' shards) give CRC64 ", crc64_hex(have), ": load it over the base it was "
          "trained on"));
    }
  }
  return local;
}

core::Status Engine::check_files_as_read(CheckpointToLoad& ck, core::Status first) {
  // After a failure, the files opened so far: a damaged one is the cause to
  // name (a flipped bit in a tensor's name reads as another optimizer's
  // checkpoint), else the failure stands.
  for (std::size_t f = 0; f < ck.direct.size(); ++f) {
    if (!ck.checks(f, ranks_.share)) continue;
    core::Result<std::uint64_t> crc = ck.direct[f]->crc64_as_read();
    if (!crc.ok()) return first.ok() ? crc.status() : first;
    if (*crc != ck.files[f].crc64) {
      const Status damaged = crc_mismatch(ck.direct[f]->path(), *crc, ck.files[f].crc64);
      return first.ok() ? damaged : Status::data_loss(str_cat(damaged.message(), "; found first: ", first.message()));
    }
  }
  return first;
}

core::Status Engine::apply_checkpoint(CheckpointToLoad& ck) {
  // From here on the load replaces the engine's state.
  fetcher_->drop_copies(DropCopies::kAll);  // they hold compute copies the load replaces
  STRATA_RETURN_IF_ERROR(fetcher_->settle_copies());  // nothing may still read the homes it writes
  homes_->drop_pending();  // overlap "delayed": so does the last step's update
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("load_checkpoint"));  // it read state the load replaces
  const Sources& sources = ck.sources;
  const CheckpointManifest& m = ck.manifest;
  const HeldRanges own = held_ranges(layout_, ranks_.share.rank);
  const int cb = layout_.compute_bytes;
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    // A group whose frozen part the checkpoint left out (the base, which
    // check_frozen_base found equal to this engine's): the trainable range
    // alone is read from the checkpoint and goes home; the frozen part is
    // neither read nor written (nothing at all when the group is all frozen).
    bool left_out = false;
    for (std::size_t pi : gp.params) left_out = left_out || m.compute_in_base(pi);
    if (left_out && gp.trainable_elems == 0) continue;
    const bool trainable_only = left_out && !layout_.compute_sharded;
    const std::uint64_t host_lo = trainable_only ? layout_.trainable_home_range(gp).lo : 0;
    // The home is not read where the checkpoint gives every byte of it (no
    // base left out): a blank one (padding zero) takes the copies; with a
    // base left out at stage 3 over ranks it is read whole (its shard of the
    // base kept).
    gpu::PinnedBuffer staging;
    STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, trainable_only ? homes_->blank_trainable(g, staging)
                                                       : left_out     ? homes_->load(g, staging, step_lane())
                                                                      : homes_->blank(g, staging));
    // In the files' order (the group's compute copies, then each trainable
    // parameter's arrays), so that a file read front to back is read once
    // (check_files_as_read).
    StateArrays arrays;
    for (std::size_t pi : gp.params) {
      const ParamDesc& p = layout_.params[pi];
      // This rank's compute copies (all of them; at stage 3 its part), each
      // piece from the files that hold it.
      const Layout::ShardPiece part = layout_.compute_sharded
                                          ? layout_.shard_of(pi, ranks_.share.rank)
                                          : Layout::ShardPiece{0, p.numel(), layout_.places[pi].compute_offset};
      for (const Held& h : sources[pi]) {
        const std::int64_t x = std::max(part.lo, h.lo), y = std::min(part.hi, h.hi);
        if (x >= y) continue;
        STRATA_RETURN_IF_ERROR(ck.readers[h.file].read_raw_range(
            p.name + ".compute", static_cast<std::uint64_t>(x - h.lo) * static_cast<std::uint64_t>(cb),
            host.subspan(static_cast<std::size_t>(part.home + (x - part.lo)) * cb - host_lo,
                         static_cast<std::size_t>(y - x) * cb)));
      }
    }
    for (std::size_t pi : gp.params) {
      // The optimizer's arrays of this rank's elements only.
      if (!layout_.params[pi].trainable || own[pi].first == own[pi].second) continue;
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        STRATA_RETURN_IF_ERROR(read_state_range(ck.readers, sources[pi], layout_, pi, k, own[pi].first,
                                                own[pi].second, arrays[pi]));
      }
    }
    // A left-out base is not written back (at stage 3 over ranks the home
    // was read whole, its shard of the base kept as it was).
    STRATA_RETURN_IF_ERROR(left_out ? homes_->commit_trainable(g, host, step_lane(), host_lo)
                                    : homes_->commit(g, host, step_lane()));
    // The chunks are not read either when the checkpoint's arrays fill them
    // (they do: its ranges cover every element, uncovered_elements).
    bool fill = true;
    for (std::size_t c = gp.first_chunk; c < gp.first_chunk + gp.chunk_count && fill; ++c) {
      fill = arrays_fill_chunk(layout_, layout_.chunks[c], arrays);
    }
    STRATA_RETURN_IF_ERROR(visit_group_state(g, fill ? WriteBack::kWhole : WriteBack::kYes,
                                             [&](const ChunkPlace& cp, ChunkState& st) {
                                               exchange_chunk_arrays(layout_, cp, st, arrays, Exchange::kIntoChunk);
                                               return Status();
                                             }));
  }
  STRATA_RETURN_IF_ERROR(step_->verdict().restore(ck.scaler, m.step, m.skipped_steps, m.lr_override));
  std::vector<std::int64_t> missed;
  missed.reserve(m.params.size());
  for (const CheckpointParam& p : m.params) missed.push_back(p.missed_steps);
  step_->restore_missed_steps(std::move(missed));
  step_->forget_traffic();  // the load's traffic is not a step's
  return Status();
}

core::Result<std::vector<std::byte>> Engine::load_checkpoint(const std::string& root) {
  STRATA_ENGINE_ENTRY("load_checkpoint");
  return load_checkpoint_locked(root);
}

core::Status Engine::agree_on_start(const char* op, core::Status local, std::optional<std::uint64_t> checkpoint) {
  // finalize's payload; finalize_from_checkpoint's is its checkpoint's
  // fingerprint (never this, but by a 2^-64 chance).
  constexpr std::uint64_t kPlain = 0x66696e616c697a65;  // "finalize"
  std::vector<std::uint64_t> all;
  STRATA_RETURN_IF_ERROR(agree(op, "starting", std::move(local), checkpoint.value_or(kPlain), &all));
  for (std::size_t k = 0; k < all.size(); ++k) {
    if (all[k] == all[0]) continue;
    if ((all[k] == kPlain) != (all[0] == kPlain)) {
      const std::size_t plain = all[k] == kPlain ? k : 0;
      return Status::failed_precondition(str_cat(op, ": rank ", plain, " called finalize and rank ",
                                                 plain == 0 ? k : 0, " finalize_from_checkpoint: every rank must start "
                                                 "the same way"));
    }
    return Status::failed_precondition(str_cat(op, ": rank ", k, " found another checkpoint than rank 0 (another "
                                               "step folder or manifest): the ranks must resume from one checkpoint "
                                               "on a file system they share"));
  }
  return Status();
}

core::Result<std::vector<std::byte>> Engine::finalize_from_checkpoint(const std::string& root) {
  STRATA_ENGINE_ENTRY("finalize_from_checkpoint");
  constexpr const char* kOp = "finalize_from_checkpoint";
  if (finalized_) return Status::failed_precondition(str_cat(kOp, " after finalize"));
  if (!finalize_failure_.empty()) {
    return Status::failed_precondition(
        str_cat(kOp, " after a failed finalize (", finalize_failure_, "): create a new engine"));
  }
  // Before anything is built, on every rank: the checkpoint is there and is
  // this engine's, with its compute dtype (check_checkpoint checks the rest
  // after finalize), and every rank found the same one.
  Status found;
  std::uint64_t fingerprint = 0;
  if (auto loc = locate_checkpoint(root, config_.strata.io); !loc.ok()) {
    found = std::move(loc).status().annotate(kOp);
  } else {
    found = same_model(loc->dir, loc->manifest, registry_.params, config_).annotate(kOp);
    fingerprint = checkpoint_fingerprint(loc->dir, loc->manifest);
  }
  // A failure is finalize's (nothing was built yet): the engine is done.
  Status s = agree_on_start(kOp, std::move(found), fingerprint);
  values_from_checkpoint_ = true;
  if (s.ok()) s = finalize_locked();
  if (!s.ok()) {
    finalize_failure_ = std::string(s.message());
    release_after_failed_finalize();
    return s;
  }
  // Until the load succeeds the state the checkpoint replaces is unwritten:
  // only another load is allowed (load_checkpoint_locked clears this).
  torn_load_ = str_cat(kOp, " built the engine but its checkpoint did not load; its initial values were left to it");
  core::Result<std::vector<std::byte>> blob = load_checkpoint_locked(root, /*into_unwritten=*/true);
  if (!blob.ok()) {
    return std::move(blob).status().annotate(
        str_cat(kOp, ": the engine is built, without values (or with a damaged checkpoint's): only a load is allowed"));
  }
  return blob;
}

core::Result<std::vector<std::byte>> Engine::load_checkpoint_locked(const std::string& root, bool into_unwritten) {
  // With several ranks every rank calls it; they agree after each phase
  // (agree), so that no rank changes its state unless every rank found the
  // checkpoint whole and fitting. A checkpoint saved by any number of ranks
  // loads: each rank reads whole compute copies and its own shard's state
  // from the files that hold them.
  constexpr const char* kOp = "load_checkpoint";
  STRATA_RETURN_IF_ERROR(step_->refuse_while_applying(kOp));  // before any collective (save_checkpoint)
  STRATA_RETURN_IF_ERROR(agree(kOp, "checking the engine", ready_between_steps(kOp)));
  CheckpointToLoad ck;
  // Into state that holds no values yet there is nothing to keep from a
  // damaged file: the CRC64 of each file this rank checks is taken as it is
  // read, once, not first in a read of its own (every parameter trained: no
  // base compared first); the ranks agree on it after the load.
  ck.verify_as_read = into_unwritten &&
                      std::all_of(layout_.params.begin(), layout_.params.end(),
                                  [](const ParamDesc& p) { return p.trainable; });
  std::vector<std::uint64_t> found;
  Status checked = check_checkpoint(root, ck);
  if (!checked.ok() && ck.verify_as_read) checked = check_files_as_read(ck, std::move(checked));
  STRATA_RETURN_IF_ERROR(agree(kOp, "checking the checkpoint", std::move(checked), ck.fingerprint, &found));
  for (std::size_t k = 1; k < found.size(); ++k) {
    if (found[k] != found[0]) {  // every rank sees the same list: every rank stops here
      return Status::failed_precondition(str_cat(
          "load_checkpoint: rank ", k, " found another checkpoint at ", root, " than rank 0 (another step folder or "
          "manifest): the ranks must load one checkpoint from a file system they share"));
    }
  }
  if (!ck.sharded_base.empty()) {  // the same list on every rank (the manifest and layout agree)
    STRATA_RETURN_IF_ERROR(agree(kOp, "comparing the frozen base", compare_sharded_base(ck)));
  }
  // From here a failure leaves the state part old, part new (on some ranks):
  // training is refused until a load succeeds.
  Status applied = apply_checkpoint(ck);
  if (ck.verify_as_read) applied = check_files_as_read(ck, std::move(applied));
  const Status loaded = agree(kOp, "loading the state", std::move(applied));
  if (!loaded.ok()) {
    torn_load_ = into_unwritten ? str_cat("finalize_from_checkpoint built the engine but its checkpoint did not load (",
                                          loaded.message(), ")")
                                : str_cat("a load_checkpoint failed after it began replacing the state (",
                                          loaded.message(), ")");
    return loaded;
  }
  torn_load_.clear();
  return std::move(ck.blob);
}

core::Status Engine::gather_masters(const char* op, std::size_t g, std::vector<float>& out, core::Status& local) {
  // This rank's shard of the group's masters (padding zero), then every
  // rank's, in rank order: the group's trainable part.
  const GroupPlace& gp = layout_.groups[g];
  std::vector<float> own(static_cast<std::size_t>(gp.shard_elems), 0.0f);
  if (local.ok()) {
    local = visit_group_state(g, WriteBack::kNo, [&](const ChunkPlace& cp, ChunkState& st) {
      const std::span<const float> master = st.master();
      std::copy_n(master.begin(), cp.elems, own.begin() + (cp.begin - gp.shard_begin));
      return Status();
    });
  }
  out.resize(static_cast<std::size_t>(gp.trainable_elems));
  return ranks_.weights->all_gather(own.data(), out.data(), own.size(), partition::DType::kF32)
      .annotate(str_cat(op, ": gathering group '", gp.name, "' from the ranks"));
}

void Engine::gather_compute(std::size_t g, gpu::PinnedBuffer& staging, std::span<std::byte>& whole,
                            core::Status& local) {
  const Step::TrafficPause pause(*step_);  // not step traffic
  // The prefetch gathers in flight may be reading the homes (every rank
  // settles its own: each reaches this call alike).
  fetcher_->settle_prefetches();
  core::Result<std::span<std::byte>> got = homes_->gather(g, staging, step_lane(), /*pending=*/true, local);
  if (got.ok()) {
    whole = *got;
  } else {
    whole = {};
    if (local.ok()) local = std::move(got).status();
  }
}

core::Status Engine::read_weights(std::span<const WeightRead> reads) {
  STRATA_ENGINE_ENTRY("read_weights");
  constexpr const char* kOp = "read_weights";
  STRATA_RETURN_IF_ERROR(step_->refuse_while_applying(kOp));  // before any collective (save_checkpoint)
  Status ready = step_->wait_optimizer(kOp);
  if (ready.ok()) ready = step_->abandon_speculation(kOp);  // it may be reading the state read here
  if (ready.ok()) ready = check_finalized(kOp);
  if (ready.ok()) ready = check_not_torn(kOp);
  // Each read's parameter, and a fingerprint of the list the ranks compare.
  std::vector<std::size_t> index(reads.size(), SIZE_MAX);
  std::uint64_t asked = 0;
  for (std::size_t i = 0; i < reads.size(); ++i) {
    const std::string_view name = reads[i].param;
    asked = nvme::crc64(asked, std::as_bytes(std::span<const char>(name.data(), name.size())));
    asked = nvme::crc64(asked, std::as_bytes(std::span<const char>("\n", 1)));  // "ab", "c" is not "a", "bc"
    if (!ready.ok()) continue;
    for (std::size_t pi = 0; pi < layout_.params.size() && index[i] == SIZE_MAX; ++pi) {
      if (layout_.params[pi].name == name) index[i] = pi;
    }
    if (index[i] == SIZE_MAX) {
      ready = Status::not_found(str_cat(kOp, ": no parameter named '", name, "'"));
    } else if (static_cast<std::int64_t>(reads[i].out.size()) != layout_.params[index[i]].numel()) {
      ready = Status::invalid_argument(str_cat(kOp, "('", name, "'): ", layout_.params[index[i]].numel(),
                                               " elements, buffer of ", reads[i].out.size()));
    }
  }
  if (ranks_.share.ranks == 1) {
    STRATA_RETURN_IF_ERROR(ready);
    for (std::size_t i = 0; i < reads.size(); ++i) {
      const bool trainable = layout_.places[index[i]].trainable_offset >= 0;
      STRATA_RETURN_IF_ERROR(trainable ? read_state_locked(reads[i].param, 0, reads[i].out)
                                       : read_compute_locked(reads[i].param, reads[i].out));
    }
    return Status();
  }
  std::vector<std::uint64_t> lists;
  STRATA_RETURN_IF_ERROR(agree(kOp, "checking the parameters", std::move(ready), asked, &lists));
  for (std::size_t r = 0; r < lists.size(); ++r) {
    if (lists[r] != lists[0]) {
      return Status::invalid_argument(str_cat(kOp, ": rank ", r, " asked for other parameters (or another order) than rank 0: "
                                              "every rank asks for the same ones"));
    }
  }
  // Group by group in the layout's order, each gathered once.
  std::vector<std::vector<std::size_t>> by_group(layout_.groups.size());
  for (std::size_t i = 0; i < reads.size(); ++i) by_group[layout_.places[index[i]].group].push_back(i);
  Status local;
  std::vector<float> gathered;
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    bool gather = false;
    for (std::size_t i : by_group[g]) gather = gather || layout_.places[index[i]].trainable_offset >= 0;
    if (gather) STRATA_RETURN_IF_ERROR(gather_masters(kOp, g, gathered, local));
    // Stage 3: the group's compute copies gathered once for its frozen parameters.
    gpu::PinnedBuffer staging;
    std::span<std::byte> whole;
    bool frozen = false;
    for (std::size_t i : by_group[g]) frozen = frozen || layout_.places[index[i]].trainable_offset < 0;
    if (frozen && layout_.compute_sharded) gather_compute(g, staging, whole, local);
    for (std::size_t i : by_group[g]) {
      const ParamPlace& pl = layout_.places[index[i]];
      if (pl.trainable_offset >= 0) {
        std::copy_n(gathered.begin() + static_cast<std::ptrdiff_t>(pl.trainable_offset - gp.trainable_begin),
                    reads[i].out.size(), reads[i].out.begin());
      } else if (layout_.compute_sharded) {
        if (!whole.empty()) {
          from_compute(whole.data() + pl.compute_offset * layout_.compute_bytes, reads[i].out, layout_.compute_bytes,
                       config_.precision);
        }
      } else if (local.ok()) {
        local = read_compute_locked(reads[i].param, reads[i].out);
      }
    }
    pinned_cache_->put(std::move(staging));
  }
  return agree(kOp, "reading", std::move(local));
}

core::Status Engine::export_safetensors(const std::string& dir, Precision dtype, std::uint64_t max_shard_bytes) {
  STRATA_ENGINE_ENTRY("export_safetensors");
  // With several ranks every rank calls it: each group's masters are
  // gathered from the ranks' shards (one group's fp32 trainable part in
  // memory at a time) and rank 0 writes the files.
  constexpr const char* kOp = "export_safetensors";
  const bool writes = ranks_.share.rank == 0;
  STRATA_RETURN_IF_ERROR(step_->refuse_while_applying(kOp));  // before any collective (save_checkpoint)
  Status ready = step_->wait_optimizer(kOp);
  if (ready.ok()) ready = step_->abandon_speculation(kOp);  // it may be reading the state exported here
  if (ready.ok()) ready = check_finalized(kOp);
  if (ready.ok()) ready = check_not_torn(kOp);
  if (ready.ok() && writes) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) ready = Status::from_errno(ec.value(), str_cat("create ", dir));
  }
  STRATA_RETURN_IF_ERROR(agree(kOp, "checking the engine", std::move(ready)));
  const TensorDtype td = dtype == Precision::kFp32 ? TensorDtype::kF32
                         : dtype == Precision::kFp16 ? TensorDtype::kF16
                                                     : TensorDtype::kBf16;
  std::vector<std::uint64_t> sizes;
  for (const ParamDesc& p : layout_.params) sizes.push_back(static_cast<std::uint64_t>(p.numel()) * dtype_size(td));
  const auto shards = plan_shards(sizes, max_shard_bytes == 0 ? ~0ull : max_shard_bytes);
  std::map<std::string, std::string> weight_map;
  std::uint64_t total = 0;
  // Each shard is written front to back through the nvme engine, as checkpoints are.
  // A failure on this rank is kept in `local` while the ranks still gather
  // together, so that none waits for another; they agree on it at the end.
  Status local;
  std::unique_ptr<nvme::IoBackend> backend;
  if (writes) {
    auto made = file_backend(config_, kOp);
    if (made.ok()) backend = *std::move(made);
    else local = std::move(made).status();
  }
  std::size_t gathered_group = layout_.groups.size();  // none yet
  std::vector<float> gathered;
  // Stage 3: the last group whose compute copies were gathered (frozen parameters).
  std::size_t compute_group = layout_.groups.size();
  gpu::PinnedBuffer compute_staging;
  std::span<std::byte> compute;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? "model.safetensors" : shard_file_name(s + 1, shards.size());
    std::optional<SafetensorsWriter> w;
    if (writes && local.ok()) {
      std::vector<SafetensorsWriter::Declared> declared;
      for (std::size_t pi : shards[s]) declared.push_back({layout_.params[pi].name, td, layout_.params[pi].shape});
      auto made = SafetensorsWriter::create_sequential(dir + "/" + file, std::move(declared), {{"format", "pt"}},
                                                       *backend, direct_file_options(config_.strata.io));
      if (made.ok()) w.emplace(*std::move(made));
      else local = std::move(made).status();
    }
    for (std::size_t pi : shards[s]) {
      const ParamDesc& p = layout_.params[pi];
      const std::size_t g = layout_.places[pi].group;
      std::vector<float> v(static_cast<std::size_t>(p.numel()));
      {
        const Step::TrafficPause pause(*step_);  // export traffic is not step traffic
        if (p.trainable && ranks_.share.ranks > 1) {
          if (gathered_group != g) {
            STRATA_RETURN_IF_ERROR(gather_masters(kOp, g, gathered, local));
            gathered_group = g;
          }
          const auto at = static_cast<std::size_t>(layout_.places[pi].trainable_offset - layout_.groups[g].trainable_begin);
          std::copy_n(gathered.begin() + static_cast<std::ptrdiff_t>(at), v.size(), v.begin());
        } else if (!p.trainable && layout_.compute_sharded) {
          // Stage 3: every rank takes part in gathering the group's compute copies.
          if (compute_group != g) {
            pinned_cache_->put(std::move(compute_staging));
            compute_staging = {};
            gather_compute(g, compute_staging, compute, local);
            compute_group = g;
          }
          if (!compute.empty()) {
            from_compute(compute.data() + layout_.places[pi].compute_offset * layout_.compute_bytes, v,
                         layout_.compute_bytes, config_.precision);
          }
        } else if (writes && local.ok()) {
          local = p.trainable ? read_state_locked(p.name, 0, v) : read_compute_locked(p.name, v);
        }
      }
      if (!w.has_value() || !local.ok()) continue;
      local = w->write_f32(p.name, v);
      weight_map[p.name] = file;
      total += sizes[pi];
    }
    if (w.has_value() && local.ok()) local = w->finish();
  }
  if (writes && local.ok() && shards.size() > 1) local = write_shard_index(dir, total, weight_map, config_.strata.io);
  return agree(kOp, "exporting", std::move(local));
}

}  // namespace strata::engine
