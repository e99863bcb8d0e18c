// StateStore: every chunk's optimizer state (the fp32 master weight and the
// optimizer's arrays, engine/optimizer_spec.h) in its home tier
// (engine/layout.h), and the one way the optimizer gets at it. A chunk's state
// is the layout's `optimizer.arrays` arrays of `elems` elements, kept together
// as [master | state 1 | state 2] (AdamW: exp_avg, exp_avg_sq; Lion: exp_avg;
// Adagrad: exp_avg_sq), the master fp32 and the others in the spec's format
// (OptimizerSpec::elem_bytes: fp32, or bf16 bit patterns):
// - device: one DeviceBuffer per chunk; the device's AdamW updates it there;
// - pinned: one PinnedBuffer per chunk; the CPU optimizer works in place;
// - nvme: one SwapStore block per chunk ("state/<index>", CRC-checked); the
//   CPU optimizer works on a staging copy that load() reads and store() writes.
// Every byte is charged to its budget when the store is created: device and
// pinned through the Device, disk space through the SwapStore's capacity.
// Thread-compatible: one thread at a time (the optimizer's, during a step).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/result.h"
#include "engine/layout.h"
#include "gpu/device.h"
#include "nvme/swap_store.h"

namespace strata::engine {

// A host view of one of a chunk's arrays: `elems` elements of `elem_bytes`
// each (4: fp32; 2: bf16 bit patterns; 1: int8_blockwise codes, with one
// fp32 scale per block of 256 at `scales`).
struct StateArray {
  std::byte* data = nullptr;
  int elem_bytes = 4;
  std::size_t elems = 0;
  float* scales = nullptr;  // blockwise arrays: OptimizerSpec::blocks(elems) of them; else null
  std::span<std::byte> bytes() const { return {data, elems * static_cast<std::size_t>(elem_bytes)}; }
  // Typed views; the array must have that element size (codes: 1, with scales).
  std::span<float> f32() const;
  std::span<std::uint16_t> bf16() const;
  std::span<std::uint8_t> codes() const;
  std::span<float> block_scales() const;
};

// Host views of one chunk's state: arrays[0] the master (fp32), then the
// optimizer's arrays in OptimizerSpec's order; `count` of them are set.
struct ChunkState {
  std::array<StateArray, 3> arrays;
  int count = 0;
  std::span<float> master() const { return arrays[0].f32(); }
};

class StateStore {
 public:
  // How create() places the chunks.
  struct Options {
    // Every nvme chunk has a second block ("state/<index>~") for speculative
    // updates: start_store(..., kNext) writes it and commit_next() makes it
    // the current one, so the current state stays intact until a
    // speculative update is known to be right.
    bool two_versions = false;
    // Only the first pinned chunk is allocated (and zero-filled) by create(),
    // its pages placed by the calling thread so that CpuAdam can find their
    // NUMA node; allocate_deferred() allocates the others.
    bool defer_pinned = false;
    // The nvme chunks' blocks are allocated, not written: the caller writes
    // each one whole (staged_views over a staging buffer it fills, then
    // store) before anything reads it. The engine's initial values do, so a
    // model's state crosses the disk once at finalize instead of three times
    // (zeros written, read back, written with the masters).
    bool nvme_unwritten = false;
  };
  // Allocates every chunk in its home tier and zero-fills it (but as
  // `options` say). `swap` may be null when no chunk lives on nvme. Errors:
  // the budgets' and the swap store's, naming what was being allocated.
  static core::Result<std::unique_ptr<StateStore>> create(const Layout& layout, gpu::Device& device,
                                                          nvme::SwapStore* swap, const Options& options);
  static core::Result<std::unique_ptr<StateStore>> create(const Layout& layout, gpu::Device& device,
                                                          nvme::SwapStore* swap) {
    return create(layout, device, swap, Options{});
  }
  // Allocates the pinned chunks create() left (none without defer_pinned),
  // each zero-filled by `zero_fill` before it is locked
  // (gpu::Device::allocate_pinned's fill, which must write zeros over the
  // span it gets): the engine passes CpuAdam's threads, so that a model's
  // state is zeroed, its pages brought in and placed by the threads that will
  // update it, in parallel, and then locked. Errors as create()'s.
  core::Status allocate_deferred(const gpu::Device::PinnedFill& zero_fill);
  // Disk bytes a layout's nvme state takes (twice the state with two versions).
  static std::uint64_t nvme_bytes(const Layout& layout, bool two_versions);

  std::size_t chunk_count() const { return chunks_.size(); }
  const Layout& layout() const { return layout_; }
  Tier tier(std::size_t chunk) const { return layout_.chunks[chunk].state_tier; }
  std::int64_t elems(std::size_t chunk) const { return layout_.chunks[chunk].elems; }
  // Bytes of staging memory a chunk needs for load()/store() (0 unless nvme).
  std::uint64_t staging_bytes(std::size_t chunk) const;
  // How an nvme chunk's current block splits over the swap paths
  // (nvme::SwapStore::path_bytes; it adds up to staging_bytes): what load()
  // reads and store() writes on each path. Empty for other tiers.
  std::vector<std::uint64_t> path_bytes(std::size_t chunk) const;

  // Host views of a pinned or nvme chunk. Pinned: views of its own memory
  // (`staging` unused). Nvme: reads the block into `staging` (at least
  // staging_bytes(chunk), 4096-aligned) and returns views into it; a CRC
  // mismatch is kDataLoss naming the file and offset. Device chunks:
  // kFailedPrecondition (use device_state()).
  core::Result<ChunkState> load(std::size_t chunk, std::span<std::byte> staging);
  // Writes an nvme chunk's staging copy back and waits for it; no-op for
  // pinned chunks. The staging copy must be the one load() filled, or one
  // filled whole through staged_views().
  core::Status store(std::size_t chunk, std::span<const std::byte> staging);

  // The asynchronous halves of load() and store() for an nvme chunk (the
  // optimizer's disk pipeline keeps several in flight): start_load reads the
  // block into `staging`; after its wait() succeeds (CRCs checked),
  // staged_views gives the host views; start_store writes the staging copy
  // back. Errors as load()/store(); kFailedPrecondition for other tiers.
  core::Result<nvme::SwapIo> start_load(std::size_t chunk, std::span<std::byte> staging);
  enum class Version { kCurrent, kNext };
  core::Result<nvme::SwapIo> start_store(std::size_t chunk, std::span<const std::byte> staging,
                                         Version version = Version::kCurrent);
  // The next version written by start_store(..., kNext) becomes the current
  // one (the caller has waited for that write, or will before any read).
  // kFailedPrecondition without two versions or for other tiers.
  core::Status commit_next(std::size_t chunk);
  ChunkState staged_views(std::size_t chunk, std::span<std::byte> staging) const {
    return views(staging.data(), elems(chunk));
  }

  // The device state [master | state 1 | state 2] of a device chunk.
  core::Result<gpu::DeviceSpan> device_state(std::size_t chunk) const;

 private:
  struct Chunk {
    gpu::DeviceBuffer device;
    gpu::PinnedBuffer pinned;
    std::string block_id[2];  // nvme: the current version is block_id[current]
    int current = 0;
  };
  StateStore(const Layout& layout, gpu::Device& device, nvme::SwapStore* swap, bool two_versions)
      : layout_(layout), device_(device), swap_(swap), two_versions_(two_versions) {}
  ChunkState views(std::byte* base, std::int64_t elems) const;
  // An nvme chunk with enough staging for `what` ("read", "write").
  core::Status check_staged(std::size_t chunk, std::size_t staging_size, const char* what) const;

  std::vector<std::size_t> deferred_;  // pinned chunks allocate_deferred() allocates
  const Layout& layout_;
  gpu::Device& device_;
  nvme::SwapStore* swap_;
  bool two_versions_;
  std::vector<Chunk> chunks_;
};

}  // namespace strata::engine
