// Layout: where every element of every parameter's state lives. Built once at
// finalize from the registered parameters and the config, then read by the
// step machinery. Pure arithmetic: no memory is touched here.
//
// - Each fetch group (usually a layer) packs its parameters' compute copies
//   into one flat buffer, each parameter starting on a kParamAlignElems
//   boundary: its frozen parameters first, then its trainable ones from a
//   direct-I/O boundary (4096 bytes) on, each kind in registration order
//   (trainable_compute_begin), so that what a step rewrites is one range of
//   the buffer: only it goes home (a frozen base is never rewritten) and
//   only its gradients come down.
// - With a blockwise optimizer state (strata.optimizer_state int8_blockwise)
//   trainable parameters start on a quantization block boundary (256) of
//   the trainable space instead, so that no block spans two parameters.
// - Trainable parameters also get a place in the trainable space, which holds
//   gradients, fp32 master weights and both moments: group after group, each
//   group's part starting on a norm-block boundary (numerics.h, 65536
//   elements), so the gradient norm's block order is fixed by the layout and
//   never by placement, chunking or timing (DESIGN.md section 6).
// - The trainable space is cut into chunks of strata.chunk_bytes (fp32 master
//   bytes, rounded down to whole norm blocks; at least one block) that never
//   cross a group. Each chunk's optimizer state has one home tier: the tier
//   split_optimizer_state() (tier.h) gives the chunk's first element, so the
//   planner's shares and the layout's agree to within a chunk.
// - Padding elements (alignment gaps) are zero everywhere and stay zero.
// - The chunks are also kept as runs (ChunkRun: consecutive chunks of one
//   group with the same size and home, at most four per group), so what the
//   layout needs per tier can be counted from memory bounded by the
//   parameters and groups, before the chunks, one entry per chunk_bytes of
//   the model, are listed (plan_layout_runs, expand_chunks).
// - With N data-parallel ranks (RankShare, DESIGN.md section 10) every rank
//   lays out the whole model alike (the same trainable space, so gradients
//   and norm blocks have one address everywhere), each group's trainable part
//   padded to N whole norm blocks and cut into N equal shards
//   (partition/shards.h's rule with the norm block as alignment); the rank
//   owns shard `rank` of each group, and its chunks cover its shards only:
//   it keeps optimizer state for them alone, split between the tiers as the
//   placement rule says for its own elements.
// - At zero_optimization.stage 3 with several ranks (compute_sharded) the
//   compute copies are sharded too: a group's home on rank r holds the
//   compute copies of r's trainable shard (in the trainable layout, so the
//   optimizer writes them where it updates the masters), then r's shard of
//   the group's frozen part (the frozen parameters packed, each on a
//   kParamAlignElems boundary, padded to N equal shards). A fetch gathers
//   every rank's home and unpacks them into the group's compute buffer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/config.h"
#include "engine/optimizer_spec.h"
#include "engine/tier.h"

namespace strata::engine {

inline constexpr std::int64_t kParamAlignElems = 64;

// One registered parameter.
struct ParamDesc {
  std::string name;
  std::vector<std::int64_t> shape;  // every dimension > 0; [] is a scalar
  std::string group;                // fetch group
  bool trainable = true;            // frozen: a compute copy only
  int optimizer_group = 0;          // index into the optimizer groups
  std::int64_t numel() const;
};

// Per-group optimizer settings (e.g. no weight decay on norms and biases).
struct OptimizerGroupDesc {
  std::string name;
  double weight_decay = 0.0;
  double lr_scale = 1.0;  // the group's lr is the schedule's lr times this
};

struct ParamPlace {
  std::size_t group = 0;             // index into Layout::groups
  std::int64_t compute_offset = 0;   // in the group's compute buffer (elements)
  std::int64_t trainable_offset = -1;  // in the trainable space; -1 when frozen
  std::int64_t frozen_offset = -1;   // frozen, compute_sharded: in the group's frozen part
};

struct GroupPlace {
  std::string name;
  std::vector<std::size_t> params;   // in registration order
  std::int64_t compute_elems = 0;    // size of the compute buffer, padding included
  // Where its trainable parameters start in the compute buffer: after the
  // frozen ones, on a direct-I/O boundary when the group has both (0 when it
  // has no frozen one; compute_elems when it has no trainable one).
  std::int64_t trainable_compute_begin = 0;
  std::int64_t trainable_begin = 0;  // norm-block aligned
  std::int64_t trainable_elems = 0;  // padded to whole norm blocks; 0 when all frozen
  Tier compute_tier = Tier::kDevice;
  // Its frozen parameters' compute copies are read from the safetensors
  // files they were imported from (strata.frozen_base; compute_tier nvme):
  // that part of the home (frozen_home_range) is in no tier and no swap block.
  bool frozen_in_files = false;
  // Its home is in pinned memory by offload_param.max_in_cpu (compute_tier
  // pinned with the device nvme) and its frozen parameters all come from
  // the safetensors files: that part of the home is a copy of the files'
  // values, which checkpoints leave out as they leave out a base read from
  // its files (strata.frozen_base "auto"; FrozenFiles::choose).
  bool frozen_kept_from_files = false;
  // Either way: its frozen part is the files' values, recorded at import.
  bool frozen_of_files() const { return frozen_in_files || frozen_kept_from_files; }
  std::size_t first_chunk = 0, chunk_count = 0;
  // This rank's shard of the trainable part (in the trainable space, whole
  // norm blocks): the whole part with one rank.
  std::int64_t shard_begin = 0;
  std::int64_t shard_elems = 0;
  // compute_sharded: the group's frozen part (padded to N equal shards) and
  // each rank's shard of it; 0 otherwise.
  std::int64_t frozen_elems = 0;
  std::int64_t frozen_shard_elems = 0;

  // Its gradient buffer: the compute layout from trainable_compute_begin on
  // (a frozen parameter has no slot; 0 when none trains).
  std::int64_t gradient_elems() const { return compute_elems - trainable_compute_begin; }
};

// Which share of the model this layout's rank keeps (DESIGN.md section 10).
struct RankShare {
  int rank = 0;
  int ranks = 1;
  // Several ranks: the collectives run on the device (strata.device_collectives):
  // each micro-batch's gradients are summed over the ranks there, only the
  // rank's fp32 shard of the sum coming down, and at stage 3 a fetch
  // gathers the ranks' shards there; else on the host (the gradients come
  // down whole, a fetch gathers in pinned memory).
  bool device_collectives = false;
  // With device_collectives: the bytes of an element of the gradients' sums
  // there (communication_data_type: 4 for fp32, 2 for bf16).
  int sum_bytes = 4;
};

struct ChunkPlace {
  std::size_t group = 0;
  std::int64_t begin = 0;  // in the trainable space, norm-block aligned
  std::int64_t elems = 0;
  Tier state_tier = Tier::kDevice;  // the master and the optimizer's arrays
};

// Consecutive chunks of one group with the same size and home: chunk k of
// the run (k < count) is Layout::chunks[first_chunk + k], {group, begin + k *
// elems, elems, state_tier}.
struct ChunkRun {
  std::size_t group = 0;
  std::size_t first_chunk = 0;  // index into Layout::chunks
  std::size_t count = 0;        // chunks, >= 1
  std::int64_t begin = 0;       // the first chunk's, in the trainable space
  std::int64_t elems = 0;       // each chunk's
  Tier state_tier = Tier::kDevice;
};

// A run of a chunk whose elements share an optimizer group.
struct Segment {
  std::int64_t begin = 0;  // in the trainable space
  std::int64_t elems = 0;
  int optimizer_group = 0;
};


// Bytes the layout puts in each tier (state only: the pipelines' working
// buffers are budgeted by the engine on top).
struct TierBytes {
  std::uint64_t device = 0, pinned = 0, nvme = 0;
};

struct Layout {
  std::vector<ParamDesc> params;
  std::vector<OptimizerGroupDesc> optimizer_groups;
  std::vector<ParamPlace> places;  // one per param
  std::vector<GroupPlace> groups;  // in first-registration order
  std::vector<ChunkPlace> chunks;  // in trainable-space order; empty until expand_chunks (plan_layout_runs)
  std::vector<ChunkRun> chunk_runs;  // the same chunks in runs, in order; always filled
  std::int64_t chunk_elems = 0;
  std::int64_t trainable_elems = 0;  // the whole trainable space, padding included
  int compute_bytes = 2;             // per compute-copy element (config precision)
  int grad_bytes = 2;                // per host gradient element (DESIGN.md section 1)
  OptimizerSpec optimizer;           // the state per trainable element (engine/optimizer_spec.h)
  RankShare share;                   // this rank's share; the chunks are its shards'
  // zero_optimization.stage 3 with several ranks: each rank's compute homes
  // hold its shard of each group's compute copies (the header's comment).
  bool compute_sharded = false;

  // Bytes of a chunk's state (the master and the optimizer's arrays), wherever it lives.
  std::uint64_t state_bytes(const ChunkPlace& c) const { return optimizer.state_bytes(c.elems); }
  // The same for each chunk of a run.
  std::uint64_t state_bytes(const ChunkRun& r) const { return optimizer.state_bytes(r.elems); }

  // The chunk's runs by optimizer group, in order; padding after a parameter
  // belongs to that parameter's run.
  std::vector<Segment> segments(const ChunkPlace& chunk) const;
  // The trainable parameters' elements in the chunk, one piece per
  // parameter: [lo, hi) in the trainable space, padding excluded.
  struct Piece {
    std::size_t param;
    std::int64_t lo, hi;
  };
  std::vector<Piece> pieces(const ChunkPlace& chunk) const;
  // Elements and bytes of a group's compute home on this rank: its compute
  // buffer, or with compute_sharded its trainable shard and frozen shard.
  std::int64_t home_elems(const GroupPlace& g) const {
    return compute_sharded ? g.shard_elems + g.frozen_shard_elems : g.compute_elems;
  }
  std::uint64_t home_bytes(const GroupPlace& g) const {
    return static_cast<std::uint64_t>(home_elems(g)) * static_cast<std::uint64_t>(compute_bytes);
  }
  // The bytes [lo, hi) of a group's home that a step rewrites: its trainable
  // part (the whole home when every parameter trains; empty when none
  // does), at one end of the home and starting on a direct-I/O boundary.
  // The rest, the frozen parameters' copies, is written at finalize and by a
  // checkpoint's load, never by a step.
  struct ByteRange {
    std::uint64_t lo = 0, hi = 0;
    std::uint64_t size() const { return hi - lo; }
  };
  ByteRange trainable_home_range(const GroupPlace& g) const {
    const auto cb = static_cast<std::uint64_t>(compute_bytes);
    if (g.trainable_elems == 0) return {};
    if (compute_sharded) return {0, static_cast<std::uint64_t>(g.shard_elems) * cb};
    return {static_cast<std::uint64_t>(g.trainable_compute_begin) * cb, static_cast<std::uint64_t>(g.compute_elems) * cb};
  }
  // The rest of the home: the frozen parameters' copies (empty when every
  // parameter trains).
  ByteRange frozen_home_range(const GroupPlace& g) const {
    const ByteRange t = trainable_home_range(g);
    const std::uint64_t n = home_bytes(g);
    if (t.size() == 0) return {0, n};
    return t.lo == 0 ? ByteRange{t.hi, n} : ByteRange{0, t.lo};
  }
  // Bytes of the home its tier holds: home_bytes, less the frozen part
  // with frozen_in_files.
  std::uint64_t tier_home_bytes(const GroupPlace& g) const {
    return g.frozen_in_files ? home_bytes(g) - frozen_home_range(g).size() : home_bytes(g);
  }
  // Whether a fetch hands out the group's home itself (a whole home on the
  // device), not a copy of it.
  bool fetched_in_place(const GroupPlace& g) const { return g.compute_tier == Tier::kDevice && !compute_sharded; }
  // Rank `rank`'s part of parameter `param`: elements [lo, hi) (lo == hi:
  // none), and where lo sits in that rank's compute home (compute_sharded;
  // else at compute_offset + lo of the whole buffer). A trainable parameter's
  // part is what its shard of the trainable space covers; a frozen one's,
  // with compute_sharded, what its shard of the frozen part covers, else the
  // whole parameter on rank param mod N (what a checkpoint's file of that
  // rank holds). The parts of all ranks cover the parameter once.
  struct ShardPiece {
    std::int64_t lo = 0, hi = 0;
    std::int64_t home = 0;
  };
  ShardPiece shard_of(std::size_t param, int rank) const;
  // Counted from chunk_runs: valid before expand_chunks.
  TierBytes bytes() const;
  const GroupPlace* find_group(std::string_view name) const;
};

// Errors (kInvalidArgument, naming the parameter): an empty or duplicate
// name, an empty group name, a dimension <= 0, an optimizer group out of
// range, no parameters at all; an invalid config combination the parser
// cannot see (strata.chunk_bytes below one fp32 norm block is rounded up,
// not an error); a share whose rank is not in [0, ranks).
core::Result<Layout> plan_layout(std::vector<ParamDesc> params, std::vector<OptimizerGroupDesc> optimizer_groups,
                                 const Config& config, RankShare share = {});

// plan_layout without the list of chunks: Layout::chunks is left empty and
// every other field is filled (chunk_runs, and the groups' first_chunk and
// chunk_count, which index the chunks expand_chunks lists). Its memory is
// bounded by the parameters and groups, not by the elements, so a caller can
// check what the layout needs (Layout::bytes and the like, from chunk_runs)
// before it lists one entry per chunk (Engine::finalize). Same errors.
core::Result<Layout> plan_layout_runs(std::vector<ParamDesc> params,
                                      std::vector<OptimizerGroupDesc> optimizer_groups, const Config& config,
                                      RankShare share = {});

// offload_param.max_in_cpu's rule: each group whose compute tier is nvme, in
// registration order, whose home (home_elems) still fits in what is left of
// `max_elems` gets a pinned home. plan_layout_runs
// applies it with the config's value (compute copies on nvme); finalize with
// what strata.budgets.pinned leaves under "auto", there with
// `without_frozen` under strata.frozen_base "files" (a group with frozen
// parameters keeps reading them from their files).
void keep_compute_homes_in_pinned(Layout& layout, std::int64_t max_elems, bool without_frozen = false);

// Lists Layout::chunks from chunk_runs (no-op when already listed);
// plan_layout(...) is plan_layout_runs(...) then this.
void expand_chunks(Layout& layout);

}  // namespace strata::engine
