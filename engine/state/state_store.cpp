#include "engine/state/state_store.h"

#include <cstring>

#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/str.h"

namespace strata::engine {

using core::Status;
using core::str_cat;


std::span<float> StateArray::f32() const {
  STRATA_CHECK(elem_bytes == 4) << "a view of " << elem_bytes << "-byte elements as fp32";
  return {reinterpret_cast<float*>(data), elems};
}

std::span<std::uint16_t> StateArray::bf16() const {
  STRATA_CHECK(elem_bytes == 2) << "a view of " << elem_bytes << "-byte elements as bf16";
  return {reinterpret_cast<std::uint16_t*>(data), elems};
}

std::span<std::uint8_t> StateArray::codes() const {
  STRATA_CHECK(elem_bytes == 1 && scales != nullptr) << "a view of " << elem_bytes << "-byte elements as codes";
  return {reinterpret_cast<std::uint8_t*>(data), elems};
}

std::span<float> StateArray::block_scales() const {
  STRATA_CHECK(scales != nullptr) << "the scales of an array without blocks";
  return {scales, static_cast<std::size_t>(OptimizerSpec::blocks(static_cast<std::int64_t>(elems)))};
}

ChunkState StateStore::views(std::byte* base, std::int64_t elems) const {
  const OptimizerSpec& spec = layout_.optimizer;
  ChunkState st;
  st.count = spec.arrays;
  for (int a = 0; a < st.count; ++a) {
    StateArray& array = st.arrays[static_cast<std::size_t>(a)];
    array = {base + spec.array_offset(a, elems), spec.elem_bytes(a), static_cast<std::size_t>(elems)};
    if (a > 0 && spec.blockwise()) array.scales = reinterpret_cast<float*>(base + spec.scales_offset(a, elems));
  }
  return st;
}

std::uint64_t StateStore::staging_bytes(std::size_t chunk) const {
  return tier(chunk) == Tier::kNvme ? layout_.state_bytes(layout_.chunks[chunk]) : 0;
}

std::vector<std::uint64_t> StateStore::path_bytes(std::size_t chunk) const {
  if (tier(chunk) != Tier::kNvme) return {};
  const Chunk& ch = chunks_[chunk];
  core::Result<std::vector<std::uint64_t>> split = swap_->path_bytes(ch.block_id[ch.current]);
  STRATA_CHECK(split.ok()) << split.status();  // the block lives as long as the store
  return std::move(split).value();
}

namespace {
std::string chunk_what(const Layout& layout, std::size_t i) {
  return str_cat("optimizer state of chunk ", i, " (", layout.groups[layout.chunks[i].group].name, ")");
}
}  // namespace

core::Status StateStore::allocate_deferred(const gpu::Device::PinnedFill& zero_fill) {
  for (std::size_t i : deferred_) {
    STRATA_ASSIGN_OR_RETURN(chunks_[i].pinned,
                            device_.allocate_pinned(layout_.state_bytes(layout_.chunks[i]), chunk_what(layout_, i),
                                                    zero_fill));
  }
  deferred_.clear();
  return Status();
}

std::uint64_t StateStore::nvme_bytes(const Layout& layout, bool two_versions) {
  std::uint64_t bytes = 0;
  for (const ChunkRun& r : layout.chunk_runs) {
    if (r.state_tier == Tier::kNvme) bytes += r.count * layout.state_bytes(r);
  }
  return two_versions ? 2 * bytes : bytes;
}

core::Result<std::unique_ptr<StateStore>> StateStore::create(const Layout& layout, gpu::Device& device,
                                                             nvme::SwapStore* swap, const Options& options) {
  const bool two_versions = options.two_versions;
  std::unique_ptr<StateStore> s(new StateStore(layout, device, swap, two_versions));
  s->chunks_.resize(layout.chunks.size());
  // One zeroed staging buffer, reused to initialise device chunks and (but
  // with nvme_unwritten) nvme chunks.
  core::AlignedBuffer zeros;
  std::uint64_t largest = 0;
  for (const ChunkPlace& c : layout.chunks) {
    if (c.state_tier == Tier::kDevice || (c.state_tier == Tier::kNvme && !options.nvme_unwritten)) {
      largest = std::max<std::uint64_t>(largest, layout.state_bytes(c));
    }
  }
  if (largest > 0) {
    STRATA_ASSIGN_OR_RETURN(zeros, core::AlignedBuffer::allocate(largest, core::kDirectIoAlignment));
    std::memset(zeros.data(), 0, largest);
  }
  std::size_t first_pinned = layout.chunks.size();
  for (std::size_t i = 0; i < layout.chunks.size() && first_pinned == layout.chunks.size(); ++i) {
    if (layout.chunks[i].state_tier == Tier::kPinned) first_pinned = i;
  }
  STRATA_ASSIGN_OR_RETURN(gpu::Stream stream, device.create_stream("state init"));
  for (std::size_t i = 0; i < layout.chunks.size(); ++i) {
    const ChunkPlace& c = layout.chunks[i];
    const std::uint64_t bytes = layout.state_bytes(c);
    const std::string what = chunk_what(layout, i);
    Chunk& chunk = s->chunks_[i];
    switch (c.state_tier) {
      case Tier::kDevice: {
        STRATA_ASSIGN_OR_RETURN(chunk.device, device.allocate(bytes, what));
        STRATA_RETURN_IF_ERROR(device.copy_h2d(stream, chunk.device.span(), {zeros.data(), bytes}));
        break;
      }
      case Tier::kPinned: {
        if (options.defer_pinned && i != first_pinned) {
          s->deferred_.push_back(i);
          break;
        }
        STRATA_ASSIGN_OR_RETURN(chunk.pinned, device.allocate_pinned(bytes, what));
        std::memset(chunk.pinned.data(), 0, bytes);
        break;
      }
      case Tier::kNvme: {
        if (swap == nullptr) {
          return Status::failed_precondition(str_cat(what, " lives on nvme, but no swap store was opened"));
        }
        chunk.block_id[0] = str_cat("state/", i);
        STRATA_RETURN_IF_ERROR(swap->allocate(chunk.block_id[0], bytes));
        if (!options.nvme_unwritten) {
          STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, swap->start_write(chunk.block_id[0], {zeros.data(), bytes}));
          STRATA_RETURN_IF_ERROR(io.wait());
        }
        if (two_versions) {  // written before it is ever read: a speculative update fills it
          chunk.block_id[1] = str_cat("state/", i, "~");
          STRATA_RETURN_IF_ERROR(swap->allocate(chunk.block_id[1], bytes));
        }
        break;
      }
    }
  }
  // The zero source must outlive the device copies that read it.
  STRATA_RETURN_IF_ERROR(device.synchronize(stream));
  return s;
}

core::Status StateStore::check_staged(std::size_t chunk, std::size_t staging_size, const char* what) const {
  if (chunk >= chunks_.size()) return Status::out_of_range(str_cat("chunk ", chunk, " of ", chunks_.size()));
  if (tier(chunk) != Tier::kNvme) {
    return Status::failed_precondition(str_cat("chunk ", chunk, " lives in ", to_string(tier(chunk)),
                                               " memory, not on nvme: nothing to ", what));
  }
  if (staging_size < staging_bytes(chunk)) {
    return Status::invalid_argument(
        str_cat("chunk ", chunk, " needs ", staging_bytes(chunk), " bytes of staging; got ", staging_size));
  }
  return Status();
}

core::Result<nvme::SwapIo> StateStore::start_load(std::size_t chunk, std::span<std::byte> staging) {
  STRATA_RETURN_IF_ERROR(check_staged(chunk, staging.size(), "read"));
  const Chunk& ch = chunks_[chunk];
  return swap_->start_read(ch.block_id[ch.current], staging.first(staging_bytes(chunk)));
}

core::Result<nvme::SwapIo> StateStore::start_store(std::size_t chunk, std::span<const std::byte> staging,
                                                   Version version) {
  STRATA_RETURN_IF_ERROR(check_staged(chunk, staging.size(), "write"));
  const Chunk& ch = chunks_[chunk];
  int which = ch.current;
  if (version == Version::kNext) {
    if (!two_versions_) return Status::failed_precondition(str_cat("chunk ", chunk, " has one version on nvme"));
    which = 1 - ch.current;
  }
  return swap_->start_write(ch.block_id[which], staging.first(staging_bytes(chunk)));
}

core::Status StateStore::commit_next(std::size_t chunk) {
  STRATA_RETURN_IF_ERROR(check_staged(chunk, SIZE_MAX, "commit"));
  if (!two_versions_) return Status::failed_precondition(str_cat("chunk ", chunk, " has one version on nvme"));
  chunks_[chunk].current = 1 - chunks_[chunk].current;
  return Status();
}

core::Result<ChunkState> StateStore::load(std::size_t chunk, std::span<std::byte> staging) {
  if (chunk >= chunks_.size()) return Status::out_of_range(str_cat("chunk ", chunk, " of ", chunks_.size()));
  switch (tier(chunk)) {
    case Tier::kPinned:
      return views(chunks_[chunk].pinned.data(), elems(chunk));
    case Tier::kNvme: {
      STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, start_load(chunk, staging));
      STRATA_RETURN_IF_ERROR(io.wait());
      return views(staging.data(), elems(chunk));
    }
    case Tier::kDevice:
      break;
  }
  return Status::failed_precondition(str_cat("chunk ", chunk, " lives on the device; it has no host views"));
}

core::Status StateStore::store(std::size_t chunk, std::span<const std::byte> staging) {
  if (chunk >= chunks_.size()) return Status::out_of_range(str_cat("chunk ", chunk, " of ", chunks_.size()));
  if (tier(chunk) == Tier::kPinned) return Status();
  if (tier(chunk) == Tier::kDevice) {
    return Status::failed_precondition(str_cat("chunk ", chunk, " lives on the device; nothing to store"));
  }
  STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, start_store(chunk, staging));
  return io.wait();
}

core::Result<gpu::DeviceSpan> StateStore::device_state(std::size_t chunk) const {
  if (chunk >= chunks_.size()) return Status::out_of_range(str_cat("chunk ", chunk, " of ", chunks_.size()));
  if (tier(chunk) != Tier::kDevice) {
    return Status::failed_precondition(str_cat("chunk ", chunk, " lives in ", to_string(tier(chunk)),
                                               " memory, not on the device"));
  }
  return chunks_[chunk].device.span();
}

}  // namespace strata::engine
