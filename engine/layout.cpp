#include "engine/layout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/aligned_buffer.h"
#include "core/numerics.h"
#include "core/str.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;

constexpr std::int64_t kBlock = core::numerics::kNormBlockElems;

std::int64_t round_up(std::int64_t n, std::int64_t m) {
  return static_cast<std::int64_t>(core::align_up(static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(m)));
}

}  // namespace

std::int64_t ParamDesc::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

core::Result<Layout> plan_layout(std::vector<ParamDesc> params, std::vector<OptimizerGroupDesc> optimizer_groups,
                                 const Config& config) {
  if (params.empty()) return Status::invalid_argument("no parameters registered");
  if (optimizer_groups.empty()) optimizer_groups.push_back({"default", config.optimizer.weight_decay, 1.0});
  Layout l;
  l.compute_bytes = config.compute_bytes();
  l.grad_bytes = config.precision != Precision::kFp32 && config.gradient_accumulation_steps == 1 ? 2 : 4;
  l.optimizer = optimizer_spec(config.optimizer.type);

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

  // Compute buffers and the trainable space.
  l.places.resize(params.size());
  std::int64_t trainable = 0;
  for (std::size_t gi = 0; gi < l.groups.size(); ++gi) {
    GroupPlace& g = l.groups[gi];
    std::int64_t compute = 0, own = 0;
    for (std::size_t pi : g.params) {
      const std::int64_t n = params[pi].numel();
      ParamPlace& place = l.places[pi];
      place.group = gi;
      place.compute_offset = compute;
      compute = round_up(compute + n, kParamAlignElems);
      if (params[pi].trainable) {
        place.trainable_offset = trainable + own;
        own = round_up(own + n, kParamAlignElems);
      }
    }
    g.compute_elems = compute;
    g.trainable_begin = trainable;
    g.trainable_elems = round_up(own, kBlock);
    trainable += g.trainable_elems;
  }
  l.trainable_elems = trainable;

  // Chunks, never crossing a group.
  const std::int64_t chunk_blocks =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(config.strata.chunk_bytes / 4) / kBlock);
  l.chunk_elems = chunk_blocks * kBlock;
  for (std::size_t gi = 0; gi < l.groups.size(); ++gi) {
    GroupPlace& g = l.groups[gi];
    g.first_chunk = l.chunks.size();
    for (std::int64_t off = 0; off < g.trainable_elems; off += l.chunk_elems) {
      l.chunks.push_back({gi, g.trainable_begin + off, std::min(l.chunk_elems, g.trainable_elems - off), Tier::kDevice});
    }
    g.chunk_count = l.chunks.size() - g.first_chunk;
  }

  // Homes of the optimizer state, in chunk order: each chunk goes where the
  // placement rule puts its first element (the offloaded share first,
  // pinned before nvme, then the device's).
  const OptimizerSplit split =
      split_optimizer_state(l.trainable_elems, config.zero.offload_optimizer.device,
                            config.zero.offload_optimizer.ratio, config.strata.optimizer_cpu_fraction);
  for (ChunkPlace& c : l.chunks) c.state_tier = split.tier_at(c.begin);
  l.params = std::move(params);
  l.optimizer_groups = std::move(optimizer_groups);
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

TierBytes Layout::bytes() const {
  TierBytes b;
  auto add = [&b](Tier t, std::uint64_t n) {
    (t == Tier::kDevice ? b.device : t == Tier::kPinned ? b.pinned : b.nvme) += n;
  };
  for (const GroupPlace& g : groups) {
    add(g.compute_tier, static_cast<std::uint64_t>(g.compute_elems) * static_cast<std::uint64_t>(compute_bytes));
  }
  for (const ChunkPlace& c : chunks) add(c.state_tier, state_bytes(c));
  b.pinned += static_cast<std::uint64_t>(trainable_elems) * static_cast<std::uint64_t>(grad_bytes);
  return b;
}

const GroupPlace* Layout::find_group(std::string_view name) const {
  for (const GroupPlace& g : groups) {
    if (g.name == name) return &g;
  }
  return nullptr;
}

}  // namespace strata::engine
