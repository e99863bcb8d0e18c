// strata's own keys, the "strata" object: budgets, chunk_bytes, io (and its
// fallback on DeepSpeed's aio keys), checkpoint, cpu_adam, overlap, device, host_device,
// nonfinite, trace, strict; and strata.io.paths against DeepSpeed's nvme_paths.
// Keys: docs/config.md.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "core/result.h"
#include "core/status.h"
#include "core/str.h"
#include "engine/config.h"
#include "engine/config/json_reader.h"
#include "engine/config/keys.h"
#include "engine/config/sections.h"

namespace strata::engine::config_internal {
namespace {

using core::Status;
using core::str_cat;

// The norm block (core/numerics.h), in fp32 bytes: chunks and tiles are whole blocks.
using core::numerics::kNormBlockElems;
constexpr std::uint64_t kNormBlockBytes = sizeof(float) * kNormBlockElems;
// O_DIRECT alignment strata uses for every request (core/aligned_buffer.h).
using core::kDirectIoAlignment;
// strata.io.queue_depth's upper bound (nvme/io_backend.cpp checks the same range).
constexpr std::int64_t kMaxQueueDepth = 4096;
// strata.cpu_adam.numa_node's upper bound (Linux numbers nodes below 1024).
constexpr std::int64_t kMaxNumaNode = 1023;

}  // namespace

Status parse_strata(ObjectReader& root, Context& ctx, const AioConfig& aio,
                    const AioGiven& aio_given, bool* cpu_fraction_given, StrataConfig* s) {
  ObjectReader r = root.child("strata");
  r.get_bool("strict", &s->strict);
  r.get_u64("seed", &s->seed);

  ObjectReader b = r.child("budgets");
  b.get_bytes("device", 0, &s->budgets.device_bytes);
  b.get_bytes("pinned", 0, &s->budgets.pinned_bytes);
  b.get_bytes("staging", 0, &s->budgets.staging_bytes);
  b.get_bytes("disk", 0, &s->budgets.disk_bytes);
  STRATA_RETURN_IF_ERROR(b.finish());

  if (r.get_bytes("chunk_bytes", 1, &s->chunk_bytes) && s->chunk_bytes % kNormBlockBytes != 0) {
    r.fail("chunk_bytes", str_cat(r.bytes_text("chunk_bytes", s->chunk_bytes),
                                  " is not a multiple of ", kNormBlockBytes,
                                  " bytes (the norm block: ", kNormBlockElems, " fp32 elements)"));
  }
  *cpu_fraction_given =
      r.get_double("optimizer_cpu_fraction", closed(0, 1), &s->optimizer_cpu_fraction);
  ObjectReader os = r.child("optimizer_state");
  os.get_enum<StateFormat>("format", kStateFormatNames, &s->optimizer_state.format);
  os.get_enum<StateRounding>("rounding", kStateRoundingNames, &s->optimizer_state.rounding);
  STRATA_RETURN_IF_ERROR(os.finish());

  ObjectReader io = r.child("io");
  const bool backend_given = io.get_enum<IoBackend>("backend", kIoBackendNames, &s->io.backend);
  io.get_string_list("paths", &s->io.paths);
  if (io.get_bytes("stripe_bytes", 1, &s->io.stripe_bytes) &&
      s->io.stripe_bytes % kDirectIoAlignment != 0) {
    io.fail("stripe_bytes",
            str_cat(io.bytes_text("stripe_bytes", s->io.stripe_bytes), " is not a multiple of ",
                    kDirectIoAlignment, " bytes (the O_DIRECT alignment)"));
  }
  const bool queue_depth_given = io.get_int("queue_depth", 1, kMaxQueueDepth, &s->io.queue_depth);
  const bool block_given = io.get_bytes("block_bytes", 1, &s->io.block_bytes);
  if (block_given && s->io.block_bytes % kDirectIoAlignment != 0) {
    io.fail("block_bytes",
            str_cat(io.bytes_text("block_bytes", s->io.block_bytes), " is not a multiple of ",
                    kDirectIoAlignment, " bytes (the O_DIRECT alignment)"));
  }
  io.get_int("rings", 1, 64, &s->io.rings);
  io.get_bool("sqpoll", &s->io.sqpoll);
  io.get_bool("keep_files", &s->io.keep_files);
  STRATA_RETURN_IF_ERROR(io.finish());

  // Precedence: strata.io.* when given, else DeepSpeed's aio.* equivalents.
  if (!queue_depth_given && aio_given.queue_depth) {
    if (aio.queue_depth > kMaxQueueDepth) {
      return Status::invalid_argument(
          str_cat("aio.queue_depth: ", aio.queue_depth, " must be in [1, ", kMaxQueueDepth,
                  "] (strata uses it as strata.io.queue_depth, which is not set)"));
    }
    s->io.queue_depth = aio.queue_depth;
    ctx.note("strata.io.queue_depth", str_cat(s->io.queue_depth, ", from aio.queue_depth"));
  }
  if (!block_given) {
    if (static_cast<std::uint64_t>(aio.block_size) % kDirectIoAlignment != 0) {
      return Status::invalid_argument(
          str_cat("aio.block_size: ", aio.block_size, " is not a multiple of ", kDirectIoAlignment,
                  " bytes (strata uses it as strata.io.block_bytes, which is not set)"));
    }
    s->io.block_bytes = static_cast<std::uint64_t>(aio.block_size);
    if (aio_given.block_size) {
      ctx.note("strata.io.block_bytes", str_cat(s->io.block_bytes, ", from aio.block_size"));
    }
  }
  if (!backend_given && aio_given.posix) {
    s->io.backend = IoBackend::kPsync;
    ctx.note("strata.io.backend", "psync, from aio.io_backend \"posix\"");
  }

  ObjectReader ck = r.child("checkpoint");
  ck.get_int("keep_last", 0, kMaxI64, &s->checkpoint.keep_last);
  ck.get_int("keep_every", 0, kMaxI64, &s->checkpoint.keep_every);
  ck.get_bool("keep_base", &s->checkpoint.keep_base);
  STRATA_RETURN_IF_ERROR(ck.finish());

  r.get_bool("crc", &s->crc);
  r.get_enum<FrozenBase>("frozen_base", kFrozenBaseNames, &s->frozen_base);
  r.get_enum<NoGradPolicy>("no_grad", kNoGradNames, &s->no_grad);
  ObjectReader adam = r.child("cpu_adam");
  adam.get_enum<CpuAdamIsa>("isa", kCpuAdamIsaNames, &s->cpu_adam.isa);
  adam.get_int("threads", 0, 4096, &s->cpu_adam.threads);
  if (adam.get_int("tile_elems", 0, kMaxI64, &s->cpu_adam.tile_elems) &&
      s->cpu_adam.tile_elems % kNormBlockElems != 0) {
    adam.fail("tile_elems", str_cat(s->cpu_adam.tile_elems, " is not a multiple of ",
                                    kNormBlockElems, " (the norm block, in fp32 elements)"));
  }
  adam.get_enum<CpuAdamBind>("bind", kCpuAdamBindNames, &s->cpu_adam.bind);
  if (adam.get_int("numa_node", -1, kMaxNumaNode, &s->cpu_adam.numa_node) && s->cpu_adam.numa_node >= 0 &&
      (s->cpu_adam.bind == CpuAdamBind::kCores || s->cpu_adam.bind == CpuAdamBind::kNone)) {
    adam.fail("numa_node", str_cat(s->cpu_adam.numa_node, " applies to bind \"auto\" or \"numa\", not \"",
                                   to_string(s->cpu_adam.bind), "\" (strata.cpu_adam.bind)"));
  }
  STRATA_RETURN_IF_ERROR(adam.finish());

  r.get_enum<OverlapMode>("overlap", kOverlapNames, &s->overlap);
  r.get_enum<DeviceKind>("device", kDeviceNames, &s->device);
  r.get_enum<DeviceCollectives>("device_collectives", kDeviceCollectivesNames, &s->device_collectives);
  ObjectReader hd = r.child("host_device");
  hd.get_bytes("memory_bytes", 1, &s->host_device.memory_bytes);
  hd.get_double("h2d_gbps", at_least(0), &s->host_device.h2d_gbps);
  hd.get_double("d2h_gbps", at_least(0), &s->host_device.d2h_gbps);
  hd.get_double("d2d_gbps", at_least(0), &s->host_device.d2d_gbps);
  hd.get_double("tflops", at_least(0), &s->host_device.tflops);
  STRATA_RETURN_IF_ERROR(hd.finish());
  r.get_enum<NonfinitePolicy>("nonfinite", kNonfiniteNames, &s->nonfinite);
  r.get_string("trace", /*allow_empty=*/true, &s->trace);
  STRATA_RETURN_IF_ERROR(r.finish());

  if (s->budgets.staging_bytes != 0 && s->budgets.pinned_bytes != 0 &&
      s->budgets.staging_bytes > s->budgets.pinned_bytes) {
    return Status::invalid_argument(
        str_cat("strata.budgets.staging: ", s->budgets.staging_bytes, " bytes (",
                core::format_bytes(s->budgets.staging_bytes), ") exceeds strata.budgets.pinned ",
                s->budgets.pinned_bytes, " bytes (", core::format_bytes(s->budgets.pinned_bytes),
                "); the staging ring is part of pinned memory"));
  }
  return ctx.error();
}

// strata.io.paths versus the DeepSpeed nvme_paths it overrides.
void warn_overridden_nvme_paths(Context& ctx, const Config& c, const NvmePathsGiven& given) {
  const std::vector<std::string>& paths = c.strata.io.paths;
  auto check = [&](std::string_view section, OffloadDevice device, const std::string& nvme_path,
                   bool explicit_path) {
    if (device != OffloadDevice::kNvme) return;
    if (paths.empty()) {
      if (!explicit_path) {
        ctx.note(str_cat("zero_optimization.", section, ".nvme_path"),
                 str_cat("not set: swap files go to DeepSpeed's default ", kDefaultNvmePath));
      }
      return;
    }
    if (!explicit_path || std::find(paths.begin(), paths.end(), nvme_path) != paths.end()) return;
    ctx.warn(str_cat("zero_optimization.", section, ".nvme_path"),
             str_cat(show(Json(nvme_path)), " differs from strata.io.paths ", show_paths(paths),
                     "; strata.io.paths wins"));
  };
  check("offload_optimizer", c.zero.offload_optimizer.device, c.zero.offload_optimizer.nvme_path,
        given.optimizer);
  check("offload_param", c.zero.offload_param.device, c.zero.offload_param.nvme_path, given.param);
}

}  // namespace strata::engine::config_internal
