#include "engine/layout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "core/str.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;

constexpr std::int64_t kBlock = core::numerics::kNormBlockElems;

// n rounded up to a multiple of m (any m > 0: the norm block times the ranks).
std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

}  // namespace

std::int64_t ParamDesc::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

core::Result<Layout> plan_layout_runs(std::vector<ParamDesc> params,
                                      std::vector<OptimizerGroupDesc> optimizer_groups, const Config& config,
                                      RankShare share) {
  if (params.empty()) return Status::invalid_argument("no parameters registered");
  if (share.ranks < 1 || share.rank < 0 || share.rank >= share.ranks) {
    return Status::invalid_argument(str_cat("rank ", share.rank, " of ", share.ranks, " ranks"));
  }
  if (optimizer_groups.empty()) optimizer_groups.push_back({"default", config.optimizer.weight_decay, 1.0});
  Layout l;
  l.compute_bytes = config.compute_bytes();
  // Host gradients in the compute dtype with one micro-batch per step and
  // one rank; fp32 where micro-batches or ranks are summed into them.
  l.grad_bytes =
      config.precision != Precision::kFp32 && config.gradient_accumulation_steps == 1 && share.ranks == 1 ? 2 : 4;
  l.share = share;
  l.compute_sharded = config.zero.stage == 3 && share.ranks > 1;
  l.optimizer = optimizer_spec(config.optimizer.type, config.strata.optimizer_state.format);

  // Validate, and group by fetch group in first-registration order.
  std::set<std::string_view> names;
  std::map<std::string, std::size_t> group_index;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamDesc& p = params[i];
    if (p.name.empty()) return Status::invalid_argument(str_cat("parameter #", i, " has an empty name"));
    if (!names.insert(p.name).second) {
      return Status::invalid_argument(str_cat("parameter '", p.name, "' is registered twice"));
    }
    if (p.group.empty()) return Status::invalid_argument(str_cat("parameter '", p.name, "' has no fetch group"));
    std::int64_t numel = 1;
    for (std::int64_t d : p.shape) {
      if (d <= 0) {
        return Status::invalid_argument(str_cat("parameter '", p.name, "' has a dimension of ", d,
                                                " (every dimension must be > 0)"));
      }
      if (numel > std::numeric_limits<std::int64_t>::max() / 4 / d) {
        return Status::invalid_argument(str_cat("parameter '", p.name, "' is too large"));
      }
      numel *= d;
    }
    if (p.trainable && (p.optimizer_group < 0 || p.optimizer_group >= static_cast<int>(optimizer_groups.size()))) {
      return Status::invalid_argument(str_cat("parameter '", p.name, "' names optimizer group ", p.optimizer_group,
                                              "; there are ", optimizer_groups.size()));
    }
    auto [it, inserted] = group_index.try_emplace(p.group, l.groups.size());
    if (inserted) {
      GroupPlace g;
      g.name = p.group;
      g.compute_tier = tier_of(config.zero.offload_param.device);
      l.groups.push_back(std::move(g));
    }
    l.groups[it->second].params.push_back(i);
  }

  // Compute buffers and the trainable space. A blockwise format's blocks
  // never cross a parameter (each has its optimizer group's constants): its
  // parameters start on a block boundary of the trainable space.
  const std::int64_t trainable_align =
      l.optimizer.blockwise() ? std::max<std::int64_t>(kParamAlignElems, core::numerics::kQuantBlockElems)
                              : kParamAlignElems;
  l.places.resize(params.size());
  std::int64_t trainable = 0;
  // A group's frozen parameters come first in its compute buffer and its
  // trainable ones after them, from a direct-I/O boundary on when the group
  // has both: the part a step rewrites is one aligned range, so only it is
  // written home (a frozen base is never rewritten: LoRA) and only its
  // gradients come down.
  const std::int64_t tail_align = std::max<std::int64_t>(
      kParamAlignElems, static_cast<std::int64_t>(core::kDirectIoAlignment) / l.compute_bytes);
  for (std::size_t gi = 0; gi < l.groups.size(); ++gi) {
    GroupPlace& g = l.groups[gi];
    std::int64_t compute = 0, own = 0, frozen = 0;
    bool any_frozen = false, any_trainable = false;
    for (std::size_t pi : g.params) (params[pi].trainable ? any_trainable : any_frozen) = true;
    for (const bool trainable_pass : {false, true}) {
      if (trainable_pass && any_frozen && any_trainable) compute = round_up(compute, tail_align);
      if (trainable_pass) g.trainable_compute_begin = compute;
      for (std::size_t pi : g.params) {
        if (params[pi].trainable != trainable_pass) continue;
        const std::int64_t n = params[pi].numel();
        ParamPlace& place = l.places[pi];
        place.group = gi;
        place.compute_offset = compute;
        compute = round_up(compute + n, kParamAlignElems);
        if (params[pi].trainable) {
          place.trainable_offset = trainable + own;
          own = round_up(own + n, trainable_align);
        } else if (l.compute_sharded) {
          place.frozen_offset = frozen;
          frozen = round_up(frozen + n, kParamAlignElems);
        }
      }
    }
    g.compute_elems = compute;
    g.frozen_elems = round_up(frozen, kParamAlignElems * share.ranks);
    g.frozen_shard_elems = g.frozen_elems / share.ranks;
    g.trainable_begin = trainable;
    g.trainable_elems = round_up(own, kBlock * share.ranks);
    g.shard_elems = g.trainable_elems / share.ranks;
    g.shard_begin = g.trainable_begin + share.rank * g.shard_elems;
    trainable += g.trainable_elems;
  }
  l.trainable_elems = trainable;

  // offload_param.max_in_cpu, DeepSpeed's meaning: with the compute copies on
  // nvme, up to that many of their elements stay in CPU memory ("auto":
  // finalize fills what strata.budgets.pinned leaves).
  if (config.zero.offload_param.device == OffloadDevice::kNvme && !config.zero.offload_param.max_in_cpu_auto) {
    keep_compute_homes_in_pinned(l, config.zero.offload_param.max_in_cpu);
  }

  // Chunks over this rank's shards (each group's whole part with one rank),
  // never crossing a group, each homed where the placement rule puts its
  // first element among the rank's own (the offloaded share first, pinned
  // before nvme, then the device's), listed as runs: a run ends where the
  // rule's tier changes and before a group's last chunk when that one is
  // shorter.
  const std::int64_t chunk_blocks =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(config.strata.chunk_bytes / 4) / kBlock);
  l.chunk_elems = chunk_blocks * kBlock;
  const OptimizerSplit split =
      split_optimizer_state(l.trainable_elems / share.ranks, config.zero.offload_optimizer.device,
                            config.zero.offload_optimizer.ratio, config.strata.optimizer_cpu_fraction);
  const std::int64_t ce = l.chunk_elems;
  std::size_t chunk_total = 0;
  std::int64_t owned = 0;  // the rank's elements before this group's shard
  for (std::size_t gi = 0; gi < l.groups.size(); ++gi) {
    GroupPlace& g = l.groups[gi];
    const std::int64_t n = (g.shard_elems + ce - 1) / ce;  // the group's chunks
    const std::int64_t last_elems = g.shard_elems - (n - 1) * ce;
    g.first_chunk = chunk_total;
    g.chunk_count = static_cast<std::size_t>(n);
    for (std::int64_t k = 0; k < n;) {
      const std::int64_t at = owned + k * ce;  // among the rank's own elements
      // The chunks from k on that begin below the next tier boundary above `at`.
      std::int64_t end = n;
      const std::int64_t boundary = at < split.pinned_elems       ? split.pinned_elems
                                    : at < split.offloaded_elems() ? split.offloaded_elems()
                                                                   : -1;
      if (boundary >= 0) end = std::min(n, (boundary - owned + ce - 1) / ce);
      if (end == n && last_elems != ce && k < n - 1) end = n - 1;  // the shorter last chunk on its own
      l.chunk_runs.push_back({.group = gi,
                              .first_chunk = chunk_total + static_cast<std::size_t>(k),
                              .count = static_cast<std::size_t>(end - k),
                              .begin = g.shard_begin + k * ce,
                              .elems = k == n - 1 ? last_elems : ce,
                              .state_tier = split.tier_at(at)});
      k = end;
    }
    chunk_total += g.chunk_count;
    owned += g.shard_elems;
  }
  l.params = std::move(params);
  l.optimizer_groups = std::move(optimizer_groups);
  return l;
}

// Whole homes: each group, in registration order, whose home still fits in
// what the earlier ones left has a pinned home (a fetch reads it from memory,
// a step writes it there); the others stay on nvme.
void keep_compute_homes_in_pinned(Layout& layout, std::int64_t max_elems, bool without_frozen) {
  std::int64_t left = max_elems;
  for (GroupPlace& g : layout.groups) {
    const std::int64_t n = layout.home_elems(g);
    if (g.compute_tier != Tier::kNvme || n > left) continue;
    if (without_frozen && g.trainable_compute_begin > 0) continue;  // (its frozen parameters come first)
    g.compute_tier = Tier::kPinned;
    left -= n;
  }
}

void expand_chunks(Layout& layout) {
  if (!layout.chunks.empty()) return;
  std::size_t total = 0;
  for (const ChunkRun& r : layout.chunk_runs) total += r.count;
  layout.chunks.reserve(total);
  for (const ChunkRun& r : layout.chunk_runs) {
    for (std::size_t k = 0; k < r.count; ++k) {
      layout.chunks.push_back({r.group, r.begin + static_cast<std::int64_t>(k) * r.elems, r.elems, r.state_tier});
    }
  }
}

core::Result<Layout> plan_layout(std::vector<ParamDesc> params, std::vector<OptimizerGroupDesc> optimizer_groups,
                                 const Config& config, RankShare share) {
  STRATA_ASSIGN_OR_RETURN(Layout l, plan_layout_runs(std::move(params), std::move(optimizer_groups), config, share));
  expand_chunks(l);
  return l;
}

std::vector<Segment> Layout::segments(const ChunkPlace& chunk) const {
  std::vector<Segment> out;
  const GroupPlace& g = groups[chunk.group];
  const std::int64_t chunk_end = chunk.begin + chunk.elems;
  // Trainable params of the group in order; each owns [offset, next offset).
  std::vector<std::size_t> trainable;
  for (std::size_t pi : g.params) {
    if (places[pi].trainable_offset >= 0) trainable.push_back(pi);
  }
  for (std::size_t k = 0; k < trainable.size(); ++k) {
    const std::int64_t begin = places[trainable[k]].trainable_offset;
    const std::int64_t end =
        k + 1 < trainable.size() ? places[trainable[k + 1]].trainable_offset : g.trainable_begin + g.trainable_elems;
    const std::int64_t lo = std::max(begin, chunk.begin), hi = std::min(end, chunk_end);
    if (lo >= hi) continue;
    const int og = params[trainable[k]].optimizer_group;
    if (!out.empty() && out.back().optimizer_group == og && out.back().begin + out.back().elems == lo) {
      out.back().elems += hi - lo;
    } else {
      out.push_back({lo, hi - lo, og});
    }
  }
  return out;
}

std::vector<Layout::Piece> Layout::pieces(const ChunkPlace& chunk) const {
  std::vector<Piece> out;
  for (std::size_t pi : groups[chunk.group].params) {
    const ParamPlace& pl = places[pi];
    if (pl.trainable_offset < 0) continue;
    const std::int64_t lo = std::max(pl.trainable_offset, chunk.begin);
    const std::int64_t hi = std::min(pl.trainable_offset + params[pi].numel(), chunk.begin + chunk.elems);
    if (lo < hi) out.push_back({pi, lo, hi});
  }
  return out;
}

Layout::ShardPiece Layout::shard_of(std::size_t param, int rank) const {
  const ParamPlace& pl = places[param];
  const GroupPlace& g = groups[pl.group];
  const std::int64_t n = params[param].numel();
  // The parameter's elements in [begin, begin + size) of its space, which
  // starts at `at`.
  auto part = [n](std::int64_t at, std::int64_t begin, std::int64_t size) {
    const std::int64_t lo = std::clamp(begin - at, std::int64_t{0}, n);
    const std::int64_t hi = std::clamp(begin + size - at, std::int64_t{0}, n);
    return std::pair{lo, std::max(lo, hi)};
  };
  ShardPiece s;
  if (pl.trainable_offset >= 0) {
    const std::int64_t begin = g.trainable_begin + rank * g.shard_elems;
    std::tie(s.lo, s.hi) = part(pl.trainable_offset, begin, g.shard_elems);
    s.home = compute_sharded ? pl.trainable_offset + s.lo - begin : pl.compute_offset + s.lo;
  } else if (compute_sharded) {
    const std::int64_t begin = rank * g.frozen_shard_elems;
    std::tie(s.lo, s.hi) = part(pl.frozen_offset, begin, g.frozen_shard_elems);
    s.home = g.shard_elems + pl.frozen_offset + s.lo - begin;
  } else {
    if (static_cast<int>(param % static_cast<std::size_t>(share.ranks)) == rank) s.hi = n;
    s.home = pl.compute_offset;
  }
  return s;
}

TierBytes Layout::bytes() const {
  TierBytes b;
  auto add = [&b](Tier t, std::uint64_t n) {
    (t == Tier::kDevice ? b.device : t == Tier::kPinned ? b.pinned : b.nvme) += n;
  };
  for (const GroupPlace& g : groups) {
    add(g.compute_tier, tier_home_bytes(g));
  }
  for (const ChunkRun& r : chunk_runs) add(r.state_tier, r.count * state_bytes(r));
  // The host gradients (with several ranks, the rank's shards only).
  b.pinned += static_cast<std::uint64_t>(trainable_elems / share.ranks) * static_cast<std::uint64_t>(grad_bytes);
  return b;
}

const GroupPlace* Layout::find_group(std::string_view name) const {
  for (const GroupPlace& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

}  // namespace strata::engine
