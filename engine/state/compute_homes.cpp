#include "engine/state/compute_homes.h"

#include <array>
#include <cstring>
#include <vector>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/str.h"
#include "engine/internal/device_collective.h"
#include "engine/memory_model.h"

namespace strata::engine {

using core::Status;
using core::str_cat;

core::Result<std::unique_ptr<ComputeHomes>> ComputeHomes::create(const Layout& layout, gpu::Device& device,
                                                                 nvme::SwapStore* swap,
                                                                 BufferCache<gpu::PinnedBuffer>& pinned_cache,
                                                                 Trace& trace, partition::Communicator* ranks,
                                                                 FrozenFiles* files,
                                                                 const gpu::Device::PinnedFill& zero_fill) {
  std::unique_ptr<ComputeHomes> h(new ComputeHomes(layout, device, swap, pinned_cache, trace, ranks, files));
  h->groups_.resize(layout.groups.size());
  for (std::size_t g = 0; g < layout.groups.size(); ++g) {
    const GroupPlace& gp = layout.groups[g];
    const std::uint64_t bytes = h->bytes(g);
    const std::string what = str_cat("compute copies of group '", gp.name, "'");
    Group& home = h->groups_[g];
    switch (gp.compute_tier) {
      case Tier::kDevice: {
        STRATA_ASSIGN_OR_RETURN(home.device_home, device.allocate(bytes, what));
        break;
      }
      case Tier::kPinned: {
        STRATA_ASSIGN_OR_RETURN(home.pinned_home, device.allocate_pinned(bytes, what, zero_fill));
        break;
      }
      case Tier::kNvme:
        home.block_id = str_cat("compute/", g);
        if (h->frozen_from_files(g)) {
          // The frozen part's home is its files: a block for the trainable range alone.
          const Layout::ByteRange t = layout.trainable_home_range(gp);
          if (t.size() > 0) {
            STRATA_RETURN_IF_ERROR(swap->allocate(home.block_id, t.size()));
          } else {
            home.block_id.clear();
          }
        } else if (h->frozen_apart(g)) {
          const Layout::ByteRange t = layout.trainable_home_range(gp);
          home.frozen_block_id = str_cat("compute/", g, "/frozen");
          STRATA_RETURN_IF_ERROR(swap->allocate(home.block_id, t.size()));
          STRATA_RETURN_IF_ERROR(swap->allocate(home.frozen_block_id, bytes - t.size()));
        } else {
          STRATA_RETURN_IF_ERROR(swap->allocate(home.block_id, bytes));
        }
        break;
    }
  }
  return h;
}

std::uint64_t ComputeHomes::bytes(std::size_t g) const {
  return layout_.home_bytes(layout_.groups[g]);
}

core::Result<std::span<std::byte>> ComputeHomes::load(std::size_t g, gpu::PinnedBuffer& staging,
                                                      const CopyLane& lane) {
  const Tier tier = layout_.groups[g].compute_tier;
  Group& home = groups_[g];
  const std::uint64_t n = bytes(g);
  if (tier == Tier::kPinned) return home.pinned_home.bytes();
  STRATA_ASSIGN_OR_RETURN(staging, pinned_cache_.get(core::align_up(n, core::kDirectIoAlignment), "compute staging"));
  const std::span<std::byte> host = staging.bytes().first(n);
  if (tier == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(lane_d2h(device_, trace_, lane, host, home.device_home.span()));
  } else {
    // The swap block's read runs while the files are read.
    std::vector<nvme::SwapIo> ios;
    for (const auto& [id, r] : nvme_parts(g)) {
      STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, swap_->start_read(*id, host.subspan(r.lo, r.size())));
      ios.push_back(std::move(io));
    }
    Status s;
    if (frozen_from_files(g)) {
      const Layout::ByteRange fr = layout_.frozen_home_range(layout_.groups[g]);
      TraceScope t(trace_, TraceTrack::kSwap, str_cat("read frozen ", layout_.groups[g].name), fr.size());
      core::Result<std::uint64_t> read = files_->read(g, host.subspan(fr.lo, fr.size()));
      if (read.ok()) lane.bytes->file_read += *read;
      else s = std::move(read).status();
    }
    for (nvme::SwapIo& io : ios) {
      Status waited = io.wait();
      if (waited.ok()) lane.bytes->add_nvme_read(io.path_bytes());
      else if (s.ok()) s = std::move(waited);
    }
    STRATA_RETURN_IF_ERROR(s);
  }
  return host;
}

std::vector<std::pair<const std::string*, Layout::ByteRange>> ComputeHomes::nvme_parts(std::size_t g) const {
  const Group& home = groups_[g];
  const std::uint64_t n = bytes(g);
  const Layout::ByteRange t = layout_.trainable_home_range(layout_.groups[g]);
  if (frozen_from_files(g)) {
    if (home.block_id.empty()) return {};
    return {{&home.block_id, t}};
  }
  if (home.frozen_block_id.empty()) return {{&home.block_id, {0, n}}};
  return {{&home.frozen_block_id, layout_.frozen_home_range(layout_.groups[g])}, {&home.block_id, t}};
}

core::Result<std::span<std::byte>> ComputeHomes::gather(std::size_t g, gpu::PinnedBuffer& staging,
                                                        const CopyLane& lane, bool pending, Status local,
                                                        FetchVote* vote) {
  const GroupPlace& gp = layout_.groups[g];
  const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
  const auto n = static_cast<std::uint64_t>(layout_.share.ranks);
  const auto me = static_cast<std::uint64_t>(layout_.share.rank);
  const std::uint64_t home = bytes(g), whole = static_cast<std::uint64_t>(gp.compute_elems) * cb;
  // Each rank's block of the payload: its home, then its status after the
  // tags (reading the home, the caller's preparation).
  const std::uint64_t block = home + kGatherTrailerBytes;
  const std::string what = str_cat("gathering the compute copies of group '", gp.name, "'");
  // Every rank's blocks, and the staging the group is unpacked into: a
  // local failure (or the caller's) is carried to the others below instead
  // of leaving them waiting. A rank that kept the group takes them only
  // once the tags say it is gathered (a fetch every rank kept needs none);
  // should the pinned cache fail it then, its blocks go through the heap
  // and the failure in its trailer.
  gpu::PinnedBuffer all;
  const auto take_buffers = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(all, pinned_cache_.get(block * n, "compute copies gathered over ranks"));
    STRATA_ASSIGN_OR_RETURN(staging,
                            pinned_cache_.get(core::align_up(whole, core::kDirectIoAlignment), "compute staging"));
    return Status();
  };
  const bool kept = vote != nullptr && vote->kept;
  bool declines = vote != nullptr && vote->declines;
  const bool on_device = vote != nullptr && vote->device != nullptr && !pending;
  partition::Communicator& host = vote != nullptr && vote->host != nullptr ? *vote->host : *ranks_;
  std::uint64_t& gathers = vote != nullptr && vote->gathers != nullptr ? *vote->gathers : gathers_;
  if (local.ok() && !kept && !declines && !on_device) {
    local = take_buffers();
    if (local.code() == core::StatusCode::kResourceExhausted && vote != nullptr && vote->may_decline) {
      local = Status();
      declines = true;
    }
  }
  // First every rank's tag (small, fixed size whatever the group): the
  // group, this gather's number, the bytes, the rank's status and its vote.
  // Ranks that gather other groups or failed stop here, every one of them,
  // before the payload (whose size may differ between groups); ranks that
  // all kept the group's copy stop here too.
  const std::array<std::uint64_t, 5> tag{g, gathers++, home, static_cast<std::uint64_t>(local.code()),
                                         declines ? 2u : kept ? 1u : 0u};
  std::vector<std::uint64_t> tags(5 * n);
  Status s = host.all_gather(tag.data(), tags.data(), 5, partition::DType::kI64);
  bool all_kept = vote != nullptr;
  bool declined = false;
  for (std::uint64_t r = 0; s.ok() && local.ok() && r < n; ++r) {
    const std::uint64_t* t = tags.data() + 5 * r;
    all_kept = all_kept && t[4] == 1;
    declined = declined || t[4] == 2;
    if (t[3] != 0) {
      const auto code = static_cast<core::StatusCode>(t[3]);
      s = Status(code, str_cat("rank ", r, " failed before its part (", core::status_code_name(code),
                               "; its own error names the cause), so this rank stops too"));
    } else if (t[0] != tag[0] || t[1] != tag[1] || t[2] != tag[2]) {
      const std::string theirs = t[0] < layout_.groups.size() ? layout_.groups[t[0]].name : str_cat("#", t[0]);
      s = Status::failed_precondition(str_cat("rank ", r, " gathered group '", theirs, "' as its gather #", t[1],
                                              " where rank ", me, " gathered '", gp.name, "' as #", tag[1],
                                              ": every rank fetches the same groups in the same order"));
    }
  }
  if (s.ok() && local.ok() && (all_kept || declined)) {
    vote->all_kept = all_kept;
    vote->declined = declined;
    pinned_cache_.put(std::move(all));
    pinned_cache_.put(std::move(staging));
    staging = {};
    return std::span<std::byte>();
  }
  if (s.ok() && local.ok() && on_device) {
    s = gather_on_device(g, lane, *vote, host);
    // Nothing queued may still read or write the buffers once they go back.
    if (!s.ok()) device_.synchronize(*lane.stream).ignore_error();
    return s.ok() ? core::Result<std::span<std::byte>>(std::span<std::byte>()) : std::move(s).annotate(what);
  }
  if (s.ok() && local.ok()) {
    // This rank's part: the caller's preparation, then its home (or its
    // pending copy) into its block; a failure goes in the block's trailer.
    Status part = kept ? take_buffers() : Status();
    std::vector<std::byte> heap;
    if (all.empty()) heap.resize(block * n);
    std::byte* const blocks = all.empty() ? heap.data() : all.data();
    std::byte* mine = blocks + me * block;
    if (part.ok() && vote != nullptr && vote->prepare) part = vote->prepare();
    if (part.ok()) {
      if (const std::byte* p = pending ? pending_copy(g) : nullptr; p != nullptr) {
        std::memcpy(mine, p, home);
      } else {
        gpu::PinnedBuffer own;  // stays empty for a pinned home (load lends it)
        core::Result<std::span<std::byte>> loaded = load(g, own, lane);
        if (loaded.ok()) std::memcpy(mine, loaded->data(), home);
        else part = std::move(loaded).status();
        pinned_cache_.put(std::move(own));
      }
    }
    const auto code = static_cast<std::uint64_t>(part.code());
    std::memcpy(mine + home, &code, sizeof code);
    {
      TraceScope t(trace_, TraceTrack::kRanks, str_cat("all-gather ", gp.name), block * n);
      s = host.all_gather(mine, blocks, block, partition::DType::kU8);
    }
    if (s.ok() && !part.ok()) s = part;  // this rank's own failure, named by its own error
    for (std::uint64_t r = 0; s.ok() && r < n; ++r) {
      std::uint64_t theirs = 0;
      std::memcpy(&theirs, blocks + r * block + home, sizeof theirs);
      if (theirs == 0) continue;
      s = Status(static_cast<core::StatusCode>(theirs),
                 str_cat("rank ", r, " failed reading its part (",
                         core::status_code_name(static_cast<core::StatusCode>(theirs)),
                         "; its own error names the cause), so this rank stops too"));
    }
  }
  if (s.ok() && local.ok()) unpack_homes(layout_, g, all.bytes().first(block * n), block, 0, staging.bytes().first(whole));
  pinned_cache_.put(std::move(all));
  if (!local.ok()) s = std::move(local);
  if (!s.ok()) {
    pinned_cache_.put(std::move(staging));
    staging = {};
    return std::move(s).annotate(what);
  }
  return staging.bytes().first(whole);
}

core::Status ComputeHomes::gather_on_device(std::size_t g, const CopyLane& lane, FetchVote& vote,
                                            partition::Communicator& host) {
  const GroupPlace& gp = layout_.groups[g];
  const auto cb = static_cast<std::uint64_t>(layout_.compute_bytes);
  const auto n = static_cast<std::uint64_t>(layout_.share.ranks);
  const auto me = static_cast<std::uint64_t>(layout_.share.rank);
  const std::uint64_t home = bytes(g), whole = static_cast<std::uint64_t>(gp.compute_elems) * cb;
  partition::Communicator& comm = *vote.device;
  gpu::Stream& stream = *lane.stream;
  // This rank's part: the caller's preparation (the fetch's buffer and the
  // payload), then its home up into its slot of the payload.
  Status part = vote.prepare ? vote.prepare() : Status();
  if (part.ok() && (vote.dst.size_bytes() != whole || vote.payload.size_bytes() < n * home)) {
    part = Status::internal(str_cat("the fetch's buffers hold ", vote.dst.size_bytes(), " and ",
                                    vote.payload.size_bytes(), " bytes, not ", whole, " and ", n * home));
  }
  const gpu::DeviceSpan payload = vote.payload.subspan(0, n * home);
  if (part.ok()) part = home_to_device(g, payload.subspan(me * home, home), lane);
  // Every rank's status (small, over the host communicator): a rank that
  // could not read its home or make room fails every rank's fetch at once,
  // named, before the payload.
  const auto code = static_cast<std::int64_t>(part.code());
  std::vector<std::int64_t> codes(n);
  Status s = host.all_gather(&code, codes.data(), 1, partition::DType::kI64);
  if (s.ok() && !part.ok()) s = part;  // this rank's own failure, named by its own error
  for (std::uint64_t r = 0; s.ok() && r < n; ++r) {
    if (codes[r] == 0) continue;
    const auto theirs = static_cast<core::StatusCode>(codes[r]);
    s = Status(theirs, str_cat("rank ", r, " failed reading its part (", core::status_code_name(theirs),
                               "; its own error names the cause), so this rank stops too"));
  }
  if (!s.ok()) {
    device_.synchronize(stream).ignore_error();  // nothing queued may still write the payload
    return s;
  }
  {
    TraceScope t(trace_, TraceTrack::kRanks, str_cat("all-gather on the device ", gp.name), n * home);
    const gpu::DeviceSpan spans[] = {payload};
    LaunchOrder::Turn own(vote.turn != nullptr ? nullptr : vote.order);  // after the framework's earlier calls' launches
    s = run_device_collective(device_, stream, spans, comm, vote.turn != nullptr ? *vote.turn : own,
                              [&comm, home, me](void* native, std::span<void* const> ptrs) {
                                auto* base = static_cast<std::byte*>(ptrs[0]);
                                return comm.all_gather(base + me * home, base, home, partition::DType::kU8, native);
                              });
    STRATA_RETURN_IF_ERROR(s);
  }
  // Unpacked whole into the fetch's buffer (padding zero), queued.
  const gpu::ElemType zeros = cb == 4 ? gpu::ElemType::kF32 : gpu::ElemType::kBf16;  // zero bits either way
  STRATA_RETURN_IF_ERROR(device_.fill(stream, gpu::typed(vote.dst, zeros), 0.0f));
  for (int r = 0; r < layout_.share.ranks; ++r) {
    for (std::size_t pi : gp.params) {
      const Layout::ShardPiece sp = layout_.shard_of(pi, r);
      if (sp.lo == sp.hi) continue;
      const auto len = static_cast<std::uint64_t>(sp.hi - sp.lo) * cb;
      STRATA_RETURN_IF_ERROR(device_.copy_d2d(
          stream, vote.dst.subspan(static_cast<std::uint64_t>(layout_.places[pi].compute_offset + sp.lo) * cb, len),
          payload.subspan(static_cast<std::uint64_t>(r) * home + static_cast<std::uint64_t>(sp.home) * cb, len)));
    }
  }
  STRATA_ASSIGN_OR_RETURN(gpu::Event landed, device_.create_event());
  STRATA_RETURN_IF_ERROR(device_.record(landed, stream));
  vote.landed = std::make_shared<gpu::Event>(std::move(landed));
  return Status();
}

core::Status ComputeHomes::home_to_device(std::size_t g, gpu::DeviceSpan slot, const CopyLane& lane) {
  if (layout_.groups[g].compute_tier == Tier::kDevice) {
    return device_.copy_d2d(*lane.stream, slot, groups_[g].device_home.subspan(0, slot.size_bytes()));
  }
  gpu::PinnedBuffer own;  // stays empty for a pinned home (load lends it)
  core::Result<std::span<std::byte>> host = load(g, own, lane);
  Status s = host.ok() ? lane_h2d(device_, trace_, lane, slot, *host) : host.status();
  pinned_cache_.put(std::move(own));
  return s;
}

void pack_home(const Layout& layout, std::size_t g, int rank, std::span<const std::byte> whole,
               std::span<std::byte> home) {
  const auto cb = static_cast<std::size_t>(layout.compute_bytes);
  std::memset(home.data(), 0, home.size());
  for (std::size_t pi : layout.groups[g].params) {
    const Layout::ShardPiece s = layout.shard_of(pi, rank);
    if (s.lo == s.hi) continue;
    std::memcpy(home.data() + static_cast<std::size_t>(s.home) * cb,
                whole.data() + static_cast<std::size_t>(layout.places[pi].compute_offset + s.lo) * cb,
                static_cast<std::size_t>(s.hi - s.lo) * cb);
  }
}

void unpack_homes(const Layout& layout, std::size_t g, std::span<const std::byte> blocks, std::size_t block_bytes,
                  std::size_t home_at, std::span<std::byte> whole) {
  const auto cb = static_cast<std::size_t>(layout.compute_bytes);
  std::memset(whole.data(), 0, whole.size());
  for (int r = 0; r < layout.share.ranks; ++r) {
    for (std::size_t pi : layout.groups[g].params) {
      const Layout::ShardPiece s = layout.shard_of(pi, r);
      if (s.lo == s.hi) continue;
      std::memcpy(whole.data() + static_cast<std::size_t>(layout.places[pi].compute_offset + s.lo) * cb,
                  blocks.data() + static_cast<std::size_t>(r) * block_bytes + home_at + static_cast<std::size_t>(s.home) * cb,
                  static_cast<std::size_t>(s.hi - s.lo) * cb);
    }
  }
}

bool ComputeHomes::rewritten_whole(std::size_t g) const {
  const GroupPlace& gp = layout_.groups[g];
  for (std::size_t pi : gp.params) {
    if (!layout_.params[pi].trainable) return false;
  }
  return !gp.params.empty();
}

bool ComputeHomes::frozen_apart(std::size_t g) const {
  const GroupPlace& gp = layout_.groups[g];
  const Layout::ByteRange t = layout_.trainable_home_range(gp);
  return t.size() > 0 && t.size() < bytes(g);
}

core::Result<std::span<std::byte>> ComputeHomes::blank(std::size_t g, gpu::PinnedBuffer& staging) {
  if (layout_.groups[g].compute_tier == Tier::kPinned) return groups_[g].pinned_home.bytes();
  const std::uint64_t n = bytes(g);
  STRATA_ASSIGN_OR_RETURN(staging, pinned_cache_.get(core::align_up(n, core::kDirectIoAlignment), "compute staging"));
  const std::span<std::byte> host = staging.bytes().first(n);
  std::memset(host.data(), 0, host.size());
  return host;
}

core::Status ComputeHomes::commit(std::size_t g, std::span<const std::byte> host, const CopyLane& lane) {
  return write_home(g, host, 0, {0, bytes(g)}, lane);
}

core::Result<std::span<std::byte>> ComputeHomes::blank_trainable(std::size_t g, gpu::PinnedBuffer& staging) {
  const Layout::ByteRange t = layout_.trainable_home_range(layout_.groups[g]);
  if (layout_.groups[g].compute_tier == Tier::kPinned) return groups_[g].pinned_home.bytes().subspan(t.lo, t.size());
  STRATA_ASSIGN_OR_RETURN(staging,
                          pinned_cache_.get(core::align_up(t.size(), core::kDirectIoAlignment), "compute staging"));
  const std::span<std::byte> host = staging.bytes().first(t.size());
  std::memset(host.data(), 0, host.size());
  return host;
}

core::Result<std::span<std::byte>> ComputeHomes::load_trainable(std::size_t g, gpu::PinnedBuffer& staging,
                                                                const CopyLane& lane) {
  if (!frozen_apart(g)) {
    return Status::internal(str_cat("load_trainable: group '", layout_.groups[g].name, "' has no frozen part apart"));
  }
  const Layout::ByteRange t = layout_.trainable_home_range(layout_.groups[g]);
  Group& home = groups_[g];
  switch (layout_.groups[g].compute_tier) {
    case Tier::kPinned:
      return home.pinned_home.bytes().subspan(t.lo, t.size());
    case Tier::kDevice: {
      STRATA_ASSIGN_OR_RETURN(staging,
                              pinned_cache_.get(core::align_up(t.size(), core::kDirectIoAlignment), "compute staging"));
      const std::span<std::byte> host = staging.bytes().first(t.size());
      STRATA_RETURN_IF_ERROR(lane_d2h(device_, trace_, lane, host, home.device_home.span().subspan(t.lo, t.size())));
      return host;
    }
    case Tier::kNvme: {
      STRATA_ASSIGN_OR_RETURN(staging,
                              pinned_cache_.get(core::align_up(t.size(), core::kDirectIoAlignment), "compute staging"));
      const std::span<std::byte> host = staging.bytes().first(t.size());
      // The trainable part's own block (frozen_apart: the frozen part is another, or the files).
      for (const auto& [id, r] : nvme_parts(g)) {
        if (r.lo != t.lo || r.hi != t.hi) continue;
        STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, swap_->start_read(*id, host));
        STRATA_RETURN_IF_ERROR(io.wait());
        lane.bytes->add_nvme_read(io.path_bytes());
        return host;
      }
      return Status::internal(str_cat("load_trainable: group '", layout_.groups[g].name,
                                      "' has no swap block of its trainable part"));
    }
  }
  return Status::internal("load_trainable: unknown tier");
}

core::Status ComputeHomes::commit_trainable(std::size_t g, std::span<const std::byte> host, const CopyLane& lane,
                                            std::uint64_t host_lo) {
  const Layout::ByteRange r =
      frozen_apart(g) ? layout_.trainable_home_range(layout_.groups[g]) : Layout::ByteRange{0, bytes(g)};
  return write_home(g, host, host_lo, r, lane);
}

core::Status ComputeHomes::write_home(std::size_t g, std::span<const std::byte> host, std::uint64_t host_lo,
                                      Layout::ByteRange r, const CopyLane& lane) {
  Group& home = groups_[g];
  const std::span<const std::byte> part = host.subspan(r.lo - host_lo, r.size());
  if (base_of_files(g)) {
    // The files' values: the first write of the frozen part (the initial
    // values) is what later reads (and checkpoints that leave it out) must
    // give; a later write must give the same.
    const Layout::ByteRange fr = layout_.frozen_home_range(layout_.groups[g]);
    if (fr.lo >= r.lo && fr.hi <= r.hi) {
      const std::span<const std::byte> frozen = host.subspan(fr.lo - host_lo, fr.size());
      if (!files_->recorded(g)) {
        files_->record(g, frozen);
      } else {
        STRATA_RETURN_IF_ERROR(check_frozen(g, frozen));
      }
    }
  }
  switch (layout_.groups[g].compute_tier) {
    case Tier::kPinned:
      if (part.data() != home.pinned_home.data() + r.lo) std::memcpy(home.pinned_home.data() + r.lo, part.data(), part.size());
      return Status();
    case Tier::kDevice:
      return lane_h2d(device_, trace_, lane, home.device_home.span().subspan(r.lo, r.size()), part);
    case Tier::kNvme:
      // Each swap block the range holds (r is the whole home or one block's).
      for (const auto& [id, b] : nvme_parts(g)) {
        if (b.lo < r.lo || b.hi > r.hi) continue;
        STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, swap_->start_write(*id, host.subspan(b.lo - host_lo, b.size())));
        STRATA_RETURN_IF_ERROR(io.wait());
        lane.bytes->add_nvme_write(io.path_bytes());
      }
      return Status();
  }
  return Status();
}

core::Status ComputeHomes::check_frozen(std::size_t g, std::span<const std::byte> frozen) const {
  if (!base_of_files(g) || files_->matches(g, frozen)) return Status();
  return Status::failed_precondition(str_cat(
      "the compute copies of ", files_->describe(g), " differ from those files' values: a frozen base of its files' "
      "values (read from them, or kept in memory by offload_param.max_in_cpu; strata.frozen_base \"files\" or "
      "\"auto\") is never written; start from the files these values came from, or set strata.frozen_base "
      "\"swap\" to keep a copy of the base that can take other values"));
}

void ComputeHomes::hold_pending(std::size_t g, gpu::PinnedBuffer buffer, std::uint64_t bytes) {
  Group& home = groups_[g];
  pinned_cache_.put(std::move(home.pending));
  home.pending = std::move(buffer);
  home.pending_bytes = bytes;
}

bool ComputeHomes::has_pending() const {
  for (const Group& home : groups_) {
    if (!home.pending.empty()) return true;
  }
  return false;
}

core::Result<bool> ComputeHomes::commit_pending(const CopyLane& lane) {
  bool committed = false;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    Group& home = groups_[g];
    if (home.pending.empty()) continue;
    Status s;
    if (layout_.groups[g].compute_tier == Tier::kPinned && home.pending.size_bytes() == home.pinned_home.size_bytes()) {
      std::swap(home.pinned_home, home.pending);
    } else {
      s = commit_trainable(g, home.pending.bytes().first(home.pending_bytes), lane);
    }
    pinned_cache_.put(std::move(home.pending));
    home.pending = {};
    home.pending_bytes = 0;
    if (!s.ok()) {
      return std::move(s).annotate(str_cat("the last step's new compute copies of group '", layout_.groups[g].name, "'"));
    }
    committed = true;
  }
  return committed;
}

void ComputeHomes::drop_pending() {
  for (Group& home : groups_) {
    pinned_cache_.put(std::move(home.pending));
    home.pending = {};
    home.pending_bytes = 0;
  }
}

void ComputeHomes::park_device_homes(ViewHolds& holds) {
  for (Group& home : groups_) {
    std::shared_ptr<gpu::Event> no_fence;
    holds.park(home.device_home, no_fence);
  }
}

}  // namespace strata::engine
