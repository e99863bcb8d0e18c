// Checkpoints and weight export (Engine methods declared in engine/engine.h).
// Layout of <root>/step-<N>/ (docs/checkpoints.md):
//   state.safetensors  per parameter: "<name>.compute" (compute dtype) and, when
//                      trainable, "<name>.master" (F32) and the optimizer's arrays
//                      (engine/optimizer_spec.h: AdamW ".exp_avg", ".exp_avg_sq";
//                      Lion ".exp_avg"; Adagrad ".exp_avg_sq") in the format the
//                      engine keeps them (strata.optimizer_state: F32 or BF16)
//   framework.bin      the framework's blob
//   manifest.json      format version, step counters, loss scaler, lr override,
//                      the parameter list, the config, CRC64 of the two files,
//                      and its own CRC64 (engine/checkpoint/manifest.h)
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

TensorDtype dtype_of(int bytes, Precision p) {
  if (bytes == 4) return TensorDtype::kF32;
  return p == Precision::kFp16 ? TensorDtype::kF16 : TensorDtype::kBf16;
}

// A whole parameter's optimizer arrays (the master, then the optimizer's), as
// the chunks keep them (OptimizerSpec::elem_bytes bytes an element) and,
// blockwise, their scales (one per block of the parameter: its trainable
// offset starts a block); the layout's optimizer.arrays of them are used.
struct ParamState {
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

// state.safetensors' tensors in the order save_checkpoint writes them: each
// group's compute copies, then the optimizer arrays of its trainable
// parameters, group after group.
std::vector<SafetensorsWriter::Declared> checkpoint_tensors(const Layout& layout, Precision precision) {
  std::vector<SafetensorsWriter::Declared> declared;
  for (const GroupPlace& gp : layout.groups) {
    for (std::size_t pi : gp.params) {
      const ParamDesc& p = layout.params[pi];
      declared.push_back({p.name + ".compute", dtype_of(layout.compute_bytes, precision), p.shape});
    }
    for (std::size_t pi : trainable_in(layout, gp)) {
      const ParamDesc& p = layout.params[pi];
      for (int k = 0; k < layout.optimizer.arrays; ++k) {
        declared.push_back({state_tensor(layout, pi, k), state_dtype(layout.optimizer, k), p.shape});
        if (k > 0 && layout.optimizer.blockwise()) {
          declared.push_back({scales_tensor(state_tensor(layout, pi, k)), TensorDtype::kF32,
                              {static_cast<std::int64_t>(OptimizerSpec::blocks(p.numel()))}});
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
// the CRCs of the state file (`state_crc`) and of the framework's `blob`,
// and the config.
CheckpointManifest checkpoint_manifest(const Layout& layout, const Config& config, const Verdict& verdict,
                                       std::uint64_t state_crc, std::span<const std::byte> blob) {
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
  for (const ParamDesc& p : layout.params) {
    m.params.push_back({.name = p.name,
                        .shape = p.shape,
                        .group = p.group,
                        .trainable = p.trainable,
                        .optimizer_group = static_cast<std::int64_t>(p.optimizer_group)});
  }
  m.state_crc64 = state_crc;
  m.framework_crc64 = nvme::crc64(0, blob);
  m.config_json = to_json(config);
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
      std::byte* whole = it->second.arrays[k].data() + static_cast<std::size_t>(p.lo - off) * eb;
      std::byte* part = st.arrays[k].data + static_cast<std::size_t>(p.lo - cp.begin) * eb;
      std::memcpy(into_chunk ? part : whole, into_chunk ? whole : part, static_cast<std::size_t>(p.hi - p.lo) * eb);
      if (st.arrays[k].scales == nullptr) continue;
      // Blocks: p.lo starts one (a parameter's offset and a chunk's begin both do).
      constexpr std::int64_t kB = core::numerics::kQuantBlockElems;
      float* whole_scales = it->second.scales[k].data() + (p.lo - off) / kB;
      float* part_scales = st.arrays[k].scales + (p.lo - cp.begin) / kB;
      std::memcpy(into_chunk ? part_scales : whole_scales, into_chunk ? whole_scales : part_scales,
                  OptimizerSpec::blocks(p.hi - p.lo) * sizeof(float));
    }
  }
}

// Reads array k of parameter pi (n elements) into `out` as the engine keeps
// it: the bytes themselves (and the scales) when the checkpoint has the
// engine's format, else converted from the checkpoint's (a checkpoint saved
// with another strata.optimizer_state): decoded to fp32 (bf16 and int8 codes
// exactly as the engine reads them), then encoded the engine's way (fp32 as
// is; bf16 rounded to nearest even; int8_blockwise quantized per block of the
// parameter with its absmax, as a step would).
core::Status read_state_array(const SafetensorsReader& reader, const Layout& layout, std::size_t pi, int k,
                              std::size_t n, ParamState& out) {
  namespace nx = core::numerics;
  const OptimizerSpec& spec = layout.optimizer;
  const std::string name = state_tensor(layout, pi, k);
  const TensorDtype dtype = state_dtype(spec, k);
  const auto kk = static_cast<std::size_t>(k);
  std::vector<std::byte>& bytes = out.arrays[kk];
  bytes.resize(n * dtype_size(dtype));
  const bool blockwise = k > 0 && spec.blockwise();
  const std::size_t blocks = OptimizerSpec::blocks(static_cast<std::int64_t>(n));
  if (blockwise) out.scales[kk].resize(blocks);
  const TensorInfo* info = reader.find(name);
  if (info == nullptr || info->dtype == dtype) {  // (a missing tensor: read_raw names it)
    STRATA_RETURN_IF_ERROR(reader.read_raw(name, bytes));
    if (blockwise) STRATA_RETURN_IF_ERROR(reader.read_f32(scales_tensor(name), out.scales[kk]));
    return Status();
  }
  const bool is_signed = spec.signed_codes(k);
  std::vector<float> wide(n);
  if (info->dtype == TensorDtype::kU8) {
    std::vector<std::uint8_t> codes(n);
    std::vector<float> scales(blocks);
    STRATA_RETURN_IF_ERROR(reader.read_raw(name, std::as_writable_bytes(std::span<std::uint8_t>(codes))));
    STRATA_RETURN_IF_ERROR(reader.read_f32(scales_tensor(name), scales));
    widen_state(1, is_signed, reinterpret_cast<const std::byte*>(codes.data()), scales.data(), n, wide.data());
  } else {
    STRATA_RETURN_IF_ERROR(reader.read_f32(name, wide));
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
      for (std::size_t b = 0; b < blocks; ++b) {
        const std::size_t lo = b * nx::kQuantBlockElems, hi = std::min(n, lo + nx::kQuantBlockElems);
        float absmax = 0.0f;
        for (std::size_t i = lo; i < hi; ++i) absmax = nx::absmax_step(absmax, wide[i]);
        const float s = nx::block_scale(absmax);
        out.scales[kk][b] = s;
        for (std::size_t i = lo; i < hi; ++i) {
          codes[i] = is_signed ? nx::quantize_m(nx::kQuantTables, wide[i], s) : nx::quantize_v(nx::kQuantTables, wide[i], s);
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
    if (cp.state_tier == Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan home, state_->device_state(c));
      // Through the cache: between steps it holds the step's staging, which
      // it gives back when the budget is tight.
      STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer host, pinned_cache_->get(bytes, "state staging"));
      STRATA_RETURN_IF_ERROR(copy_d2h(host.bytes().first(bytes), home));
      ChunkState st = state_->staged_views(c, host.bytes());
      STRATA_RETURN_IF_ERROR(fn(cp, st));
      if (write_back == WriteBack::kYes) STRATA_RETURN_IF_ERROR(copy_h2d(home, host.bytes().first(bytes)));
      pinned_cache_->put(std::move(host));
      continue;
    }
    gpu::PinnedBuffer stage;
    STRATA_ASSIGN_OR_RETURN(ChunkState st, load_host_chunk(c, stage));
    STRATA_RETURN_IF_ERROR(fn(cp, st));
    if (write_back == WriteBack::kYes) STRATA_RETURN_IF_ERROR(state_->store(c, stage.bytes()));
  }
  return Status();
}

core::Status Engine::save_checkpoint(const std::string& root, std::span<const std::byte> blob) {
  STRATA_ENGINE_ENTRY("save_checkpoint");
  STRATA_RETURN_IF_ERROR(refuse_with_ranks("save_checkpoint"));
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer("save_checkpoint"));
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("save_checkpoint"));  // it may be reading the state saved here
  STRATA_RETURN_IF_ERROR(check_finalized("save_checkpoint"));
  if (!between_steps()) {
    return Status::failed_precondition(
        "save_checkpoint in the middle of a step (groups fetched or gradients pending): call it after step_end");
  }
  // overlap "delayed": the checkpoint holds the latest update, and this run
  // goes on from it as a run resumed from it will.
  STRATA_RETURN_IF_ERROR(step_->flush_delayed("save_checkpoint"));
  fetcher_->settle_prefetches();  // the compute copies' homes are read below
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::from_errno(ec.value(), str_cat("create checkpoint directory ", root));
  // What interrupted saves left behind goes first (each named at info level).
  if (auto removed = remove_interrupted_saves(root); !removed.ok()) {
    STRATA_LOG(kWarn) << "save_checkpoint: could not remove what an interrupted save left: "
                      << removed.status();
  }
  const std::string name = str_cat("step-", step_->verdict().applied_steps());
  const std::string tmp = str_cat(root, "/.", name, ".tmp");
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return Status::from_errno(ec.value(), str_cat("create ", tmp));

  // state.safetensors, one sequential stream: each group's compute copies,
  // then the optimizer arrays of its trainable parameters (in parameter
  // order), group after group; tensors are declared in that order, so the
  // header and then the data go out front to back.
  const int cb = layout_.compute_bytes;
  std::vector<SafetensorsWriter::Declared> declared = checkpoint_tensors(layout_, config_.precision);
  const std::string state_path = tmp + "/state.safetensors";
  // Destruction order: the writer (which waits for its writes) before the backend.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoBackend> backend, file_backend(config_, "save_checkpoint"));
  STRATA_ASSIGN_OR_RETURN(SafetensorsWriter writer,
                          SafetensorsWriter::create_sequential(state_path, std::move(declared),
                                                               {{"format", "strata-checkpoint"}}, *backend,
                                                               direct_file_options(config_.strata.io)));
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    const Step::TrafficPause pause(*step_);  // checkpoint traffic is not step traffic
    gpu::PinnedBuffer staging;
    STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(g, staging, step_lane()));
    for (std::size_t pi : gp.params) {
      const ParamDesc& p = layout_.params[pi];
      const auto n = static_cast<std::size_t>(p.numel());
      STRATA_RETURN_IF_ERROR(writer.write_raw(
          p.name + ".compute", host.subspan(static_cast<std::size_t>(layout_.places[pi].compute_offset) * cb, n * cb)));
    }
    // Gather each trainable parameter's arrays from the chunks.
    StateArrays arrays;
    for (std::size_t pi : trainable_in(layout_, gp)) {
      const std::int64_t n = layout_.params[pi].numel();
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        const auto kk = static_cast<std::size_t>(k);
        arrays[pi].arrays[kk].resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(layout_.optimizer.elem_bytes(k)));
        if (k > 0 && layout_.optimizer.blockwise()) arrays[pi].scales[kk].resize(OptimizerSpec::blocks(n));
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
  STRATA_ASSIGN_OR_RETURN(const std::uint64_t state_crc, writer.crc64());
  crash_point("state_written");
  STRATA_RETURN_IF_ERROR(write_file_synced(tmp + "/framework.bin", blob, config_.strata.io));

  const std::string text = format_checkpoint_manifest(checkpoint_manifest(layout_, config_, step_->verdict(), state_crc, blob));
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

core::Result<std::vector<std::byte>> Engine::load_checkpoint(const std::string& root) {
  STRATA_ENGINE_ENTRY("load_checkpoint");
  STRATA_RETURN_IF_ERROR(refuse_with_ranks("load_checkpoint"));
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer("load_checkpoint"));
  STRATA_RETURN_IF_ERROR(check_finalized("load_checkpoint"));
  if (!between_steps()) {
    return Status::failed_precondition("load_checkpoint in the middle of a step: call it between steps");
  }
  STRATA_ASSIGN_OR_RETURN(const CheckpointLocation loc, locate_checkpoint(root, config_.strata.io));
  const std::string& dir = loc.dir;
  const CheckpointManifest& m = loc.manifest;
  // Same parameters, same shapes, same trainability (placement may differ).
  if (m.params.size() != layout_.params.size()) {
    return Status::failed_precondition(str_cat(dir, ": the checkpoint has ", m.params.size(),
                                               " parameters; this engine has ", layout_.params.size()));
  }
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const ParamDesc& p = layout_.params[i];
    const CheckpointParam& cp = m.params[i];
    if (cp.name != p.name || cp.shape != p.shape || cp.trainable != p.trainable) {
      return Status::failed_precondition(str_cat(dir, ": parameter #", i, " is '", cp.name,
                                                 "' in the checkpoint and '", p.name,
                                                 "' here (or its shape or trainability differs)"));
    }
  }
  const std::string_view compute_dtype = to_string(dtype_of(layout_.compute_bytes, config_.precision));
  if (m.compute_dtype != compute_dtype) {
    return Status::failed_precondition(str_cat(dir, ": compute copies are ", m.compute_dtype,
                                               " in the checkpoint; this engine uses ", compute_dtype));
  }
  // Integrity before anything changes: the state file's CRC64, read front
  // to back with direct reads (read-ahead), then the blob's.
  const std::string state_path = dir + "/state.safetensors";
  // Destruction order: the reader (it owns the file) before the backend.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoBackend> backend, file_backend(config_, "load_checkpoint"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::DirectFileReader> state_file,
                          nvme::DirectFileReader::open(*backend, state_path, direct_file_options(config_.strata.io)));
  STRATA_ASSIGN_OR_RETURN(const std::uint64_t state_crc, state_file->crc64());
  if (state_crc != m.state_crc64) {
    return Status::data_loss(str_cat(state_path, ": CRC64 mismatch: its bytes give ", crc64_hex(state_crc),
                                     ", the manifest records ", crc64_hex(m.state_crc64),
                                     " (the file is damaged or truncated)"));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<std::byte> blob, read_file(dir + "/framework.bin", config_.strata.io));
  if (const std::uint64_t crc = nvme::crc64(0, blob); crc != m.framework_crc64) {
    return Status::data_loss(str_cat(dir, "/framework.bin: CRC64 mismatch: its bytes give ", crc64_hex(crc),
                                     ", the manifest records ", crc64_hex(m.framework_crc64),
                                     " (the file is damaged or truncated)"));
  }
  // Tensors come in with direct reads of the aligned blocks around them.
  STRATA_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(std::move(state_file)));
  // The optimizer's arrays, and no other optimizer's, before anything changes.
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (!layout_.params[pi].trainable) continue;
    for (std::string_view array : {"exp_avg", "exp_avg_sq"}) {
      const std::string name = layout_.params[pi].name + "." + std::string(array);
      const bool kept = layout_.optimizer.index_of(array) > 0;
      if ((reader.find(name) != nullptr) != kept) {
        return Status::failed_precondition(str_cat(
            state_path, ": ", kept ? "has no " : "has ", name, ", which optimizer.type ",
            to_string(layout_.optimizer.type), kept ? " keeps" : " does not keep",
            ": the checkpoint was saved with another optimizer (a checkpoint resumes only with its own)"));
      }
    }
  }
  // 8-bit codes are read with this build's tables only.
  STRATA_RETURN_IF_ERROR(check_code_tables(reader));
  // Moments saved in another format are converted as they come in (read_state_array).
  for (std::size_t pi = 0; pi < layout_.params.size(); ++pi) {
    if (!layout_.params[pi].trainable || layout_.optimizer.arrays < 2) continue;
    const TensorInfo* info = reader.find(state_tensor(layout_, pi, 1));
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
  // The loss scaler's state must be one this config reaches (fp16.hysteresis bounds hysteresis_left).
  LossScaler::State state;
  state.scale = m.loss_scaler.scale;
  state.iteration = m.loss_scaler.iteration;
  state.last_overflow_iteration = m.loss_scaler.last_overflow_iteration;
  state.hysteresis_left = m.loss_scaler.hysteresis_left;
  if (const Status fits = step_->verdict().check_restore(state); !fits.ok()) {
    return Status::failed_precondition(str_cat(dir, "/manifest.json: ", fits.message(),
                                               ": the checkpoint's loss scaler does not fit this engine's fp16 config"));
  }
  // Every check passed: from here on the load replaces the engine's state.
  fetcher_->drop_copies(DropCopies::kAll);  // they hold compute copies the load replaces
  STRATA_RETURN_IF_ERROR(fetcher_->settle_copies());  // nothing may still read the homes it writes
  homes_->drop_pending();  // overlap "delayed": so does the last step's update
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("load_checkpoint"));  // it read state the load replaces
  const int cb = layout_.compute_bytes;
  for (std::size_t g = 0; g < layout_.groups.size(); ++g) {
    const GroupPlace& gp = layout_.groups[g];
    gpu::PinnedBuffer staging;
    STRATA_ASSIGN_OR_RETURN(std::span<std::byte> host, homes_->load(g, staging, step_lane()));
    StateArrays arrays;
    for (std::size_t pi : gp.params) {
      const ParamDesc& p = layout_.params[pi];
      const auto n = static_cast<std::size_t>(p.numel());
      STRATA_RETURN_IF_ERROR(reader.read_raw(
          p.name + ".compute", host.subspan(static_cast<std::size_t>(layout_.places[pi].compute_offset) * cb, n * cb)));
      if (!p.trainable) continue;
      for (int k = 0; k < layout_.optimizer.arrays; ++k) {
        STRATA_RETURN_IF_ERROR(read_state_array(reader, layout_, pi, k, n, arrays[pi]));
      }
    }
    STRATA_RETURN_IF_ERROR(homes_->commit(g, host, step_lane()));
    STRATA_RETURN_IF_ERROR(visit_group_state(g, WriteBack::kYes, [&](const ChunkPlace& cp, ChunkState& st) {
      exchange_chunk_arrays(layout_, cp, st, arrays, Exchange::kIntoChunk);
      return Status();
    }));
  }
  STRATA_RETURN_IF_ERROR(step_->verdict().restore(state, m.step, m.skipped_steps, m.lr_override));
  step_->forget_traffic();  // the load's traffic is not a step's
  return blob;
}

core::Status Engine::export_safetensors(const std::string& dir, Precision dtype, std::uint64_t max_shard_bytes) {
  STRATA_ENGINE_ENTRY("export_safetensors");
  STRATA_RETURN_IF_ERROR(refuse_with_ranks("export_safetensors"));
  STRATA_RETURN_IF_ERROR(step_->wait_optimizer("export_safetensors"));
  STRATA_RETURN_IF_ERROR(step_->abandon_speculation("export_safetensors"));  // it may be reading the state exported here
  STRATA_RETURN_IF_ERROR(check_finalized("export_safetensors"));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::from_errno(ec.value(), str_cat("create ", dir));
  const TensorDtype td = dtype == Precision::kFp32 ? TensorDtype::kF32
                         : dtype == Precision::kFp16 ? TensorDtype::kF16
                                                     : TensorDtype::kBf16;
  std::vector<std::uint64_t> sizes;
  for (const ParamDesc& p : layout_.params) sizes.push_back(static_cast<std::uint64_t>(p.numel()) * dtype_size(td));
  const auto shards = plan_shards(sizes, max_shard_bytes == 0 ? ~0ull : max_shard_bytes);
  std::map<std::string, std::string> weight_map;
  std::uint64_t total = 0;
  // Each shard is written front to back through the nvme engine, as checkpoints are.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoBackend> backend, file_backend(config_, "export_safetensors"));
  for (std::size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? "model.safetensors" : shard_file_name(s + 1, shards.size());
    std::vector<SafetensorsWriter::Declared> declared;
    for (std::size_t pi : shards[s]) declared.push_back({layout_.params[pi].name, td, layout_.params[pi].shape});
    STRATA_ASSIGN_OR_RETURN(SafetensorsWriter w,
                            SafetensorsWriter::create_sequential(dir + "/" + file, std::move(declared),
                                                                 {{"format", "pt"}}, *backend,
                                                                 direct_file_options(config_.strata.io)));
    for (std::size_t pi : shards[s]) {
      const ParamDesc& p = layout_.params[pi];
      std::vector<float> v(static_cast<std::size_t>(p.numel()));
      {
        const Step::TrafficPause pause(*step_);  // export traffic is not step traffic
        STRATA_RETURN_IF_ERROR(p.trainable ? read_state_locked(p.name, 0, v) : read_compute_locked(p.name, v));
      }
      STRATA_RETURN_IF_ERROR(w.write_f32(p.name, v));
      weight_map[p.name] = file;
      total += sizes[pi];
    }
    STRATA_RETURN_IF_ERROR(w.finish());
  }
  if (shards.size() > 1) STRATA_RETURN_IF_ERROR(write_shard_index(dir, total, weight_map, config_.strata.io));
  return Status();
}

}  // namespace strata::engine
