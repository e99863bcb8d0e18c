// The layout: offsets, norm-block alignment, chunks, tier homes and the bytes
// per tier, against values worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/layout.h"

namespace strata::engine {
namespace {

constexpr std::int64_t kB = 65536;  // norm block

Config config_with(OffloadDevice optimizer, OffloadDevice param, std::uint64_t chunk_bytes) {
  Config c;
  c.precision = Precision::kBf16;
  c.zero.stage = 3;
  c.zero.offload_optimizer.device = optimizer;
  c.zero.offload_param.device = param;
  c.strata.chunk_bytes = chunk_bytes;
  return c;
}

// Two layers of [w (1000x300), b (300)], plus a frozen embedding in its own group.
std::vector<ParamDesc> small_model() {
  return {
      {"embed", {500, 64}, "embed", /*trainable=*/false, 0},
      {"l0.w", {1000, 300}, "l0", true, 0},
      {"l0.b", {300}, "l0", true, 1},
      {"l1.w", {1000, 300}, "l1", true, 0},
      {"l1.b", {300}, "l1", true, 1},
  };
}

TEST(Layout, OffsetsAlignAndTheTrainableSpaceStartsGroupsOnNormBlocks) {
  auto l = plan_layout(small_model(), {{"decay", 0.1}, {"no_decay", 0.0}},
                       config_with(OffloadDevice::kCpu, OffloadDevice::kNone, 8 * kB));
  ASSERT_TRUE(l.ok()) << l.status();
  ASSERT_EQ(l->groups.size(), 3u);
  EXPECT_EQ(l->groups[0].name, "embed");
  EXPECT_EQ(l->groups[0].compute_elems, 32000);
  EXPECT_EQ(l->groups[0].trainable_elems, 0);  // frozen: no gradient, master or moments
  EXPECT_EQ(l->places[0].trainable_offset, -1);
  // l0: w = 300000 elements, b starts at the next multiple of 64: 300032.
  EXPECT_EQ(l->places[1].compute_offset, 0);
  EXPECT_EQ(l->places[2].compute_offset, 300032);
  EXPECT_EQ(l->groups[1].compute_elems, 300032 + 320);
  EXPECT_EQ(l->places[1].trainable_offset, 0);
  EXPECT_EQ(l->places[2].trainable_offset, 300032);
  // 300352 trainable elements round up to 5 norm blocks; l1 starts right after.
  EXPECT_EQ(l->groups[1].trainable_elems, 5 * kB);
  EXPECT_EQ(l->groups[2].trainable_begin, 5 * kB);
  EXPECT_EQ(l->places[3].trainable_offset, 5 * kB);
  EXPECT_EQ(l->trainable_elems, 10 * kB);
  EXPECT_EQ(l->grad_bytes, 2);  // bf16, no accumulation
}

// LoRA's shape: a group holding a frozen base weight and small trainable
// adapters, registered interleaved. The frozen parameters come first in the
// compute buffer, the trainable ones after them from a 4096-byte boundary, so
// that what a step rewrites (and the gradients that come down) is one range.
TEST(Layout, AGroupsFrozenParametersComeFirstAndItsTrainableOnesFromAnAlignedBoundary) {
  const std::vector<ParamDesc> model = {
      {"q.weight", {300, 100}, "l0", /*trainable=*/false, 0},
      {"q.lora_A", {4, 100}, "l0", true, 0},
      {"q.lora_B", {300, 4}, "l0", true, 0},
      {"o.weight", {100, 300}, "l0", false, 0},
      {"norm", {100}, "l1", true, 0},
  };
  auto l = plan_layout(model, {{"decay", 0.0}}, config_with(OffloadDevice::kCpu, OffloadDevice::kNvme, 8 * kB));
  ASSERT_TRUE(l.ok()) << l.status();
  const GroupPlace& g = l->groups[0];
  // bf16 copies: 30000 + 30000 frozen elements (each on a 64 boundary: 30016 + 30000), then the
  // adapters from the next multiple of 2048 elements (4096 bytes) on, in registration order.
  EXPECT_EQ(l->places[0].compute_offset, 0);
  EXPECT_EQ(l->places[3].compute_offset, 30016);
  EXPECT_EQ(g.trainable_compute_begin, 61440);  // 60016 rounded up to 30 x 2048
  EXPECT_EQ(l->places[1].compute_offset, 61440);
  EXPECT_EQ(l->places[2].compute_offset, 61440 + 448);  // 400 rounded up to 64
  EXPECT_EQ(g.compute_elems, 61440 + 448 + 1216);
  // The trainable space is as before: the adapters in registration order.
  EXPECT_EQ(l->places[1].trainable_offset, 0);
  EXPECT_EQ(l->places[2].trainable_offset, 448);
  const Layout::ByteRange t = l->trainable_home_range(g);
  EXPECT_EQ(t.lo, 61440u * 2);
  EXPECT_EQ(t.hi, static_cast<std::uint64_t>(g.compute_elems) * 2);
  EXPECT_EQ(t.lo % 4096, 0u);
  // A group wholly trainable or wholly frozen keeps its order, unpadded.
  EXPECT_EQ(l->groups[1].trainable_compute_begin, 0);
  EXPECT_EQ(l->trainable_home_range(l->groups[1]).lo, 0u);
  EXPECT_EQ(l->trainable_home_range(l->groups[1]).hi, l->home_bytes(l->groups[1]));
}

TEST(Layout, ChunksAreWholeBlocksAndNeverCrossAGroup) {
  // chunk_bytes of 2 blocks of fp32 master: each 5-block group cuts 2, 2, 1.
  auto l = plan_layout(small_model(), {{"decay", 0.1}, {"no_decay", 0.0}},
                       config_with(OffloadDevice::kCpu, OffloadDevice::kNone, 2 * kB * 4));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->chunk_elems, 2 * kB);
  ASSERT_EQ(l->chunks.size(), 6u);
  const std::int64_t want[6][2] = {{0, 2 * kB}, {2 * kB, 2 * kB}, {4 * kB, kB},
                                   {5 * kB, 2 * kB}, {7 * kB, 2 * kB}, {9 * kB, kB}};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(l->chunks[i].begin, want[i][0]) << i;
    EXPECT_EQ(l->chunks[i].elems, want[i][1]) << i;
    EXPECT_EQ(l->chunks[i].group, i < 3 ? 1u : 2u) << i;
  }
  EXPECT_EQ(l->groups[2].first_chunk, 3u);
  EXPECT_EQ(l->groups[2].chunk_count, 3u);
  // A chunk size below one block is rounded up to one block.
  auto tiny = plan_layout(small_model(), {{"d", 0.1}, {"n", 0.0}},
                          config_with(OffloadDevice::kCpu, OffloadDevice::kNone, 1000));
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->chunk_elems, kB);
  EXPECT_EQ(tiny->chunks.size(), 10u);
}

TEST(Layout, SegmentsFollowOptimizerGroupsWithPaddingOnThePreviousParam) {
  auto l = plan_layout(small_model(), {{"decay", 0.1}, {"no_decay", 0.0}},
                       config_with(OffloadDevice::kCpu, OffloadDevice::kNone, 2 * kB * 4));
  ASSERT_TRUE(l.ok());
  // Chunk 0 = [0, 2B): all of l0.w.
  auto s0 = l->segments(l->chunks[0]);
  ASSERT_EQ(s0.size(), 1u);
  EXPECT_EQ(s0[0].optimizer_group, 0);
  EXPECT_EQ(s0[0].elems, 2 * kB);
  // Chunk 2 = [4B, 5B): the rest of l0.w (to 300032), then l0.b with the group's padding.
  auto s2 = l->segments(l->chunks[2]);
  ASSERT_EQ(s2.size(), 2u);
  EXPECT_EQ(s2[0].begin, 4 * kB);
  EXPECT_EQ(s2[0].elems, 300032 - 4 * kB);
  EXPECT_EQ(s2[0].optimizer_group, 0);
  EXPECT_EQ(s2[1].begin, 300032);
  EXPECT_EQ(s2[1].elems, 5 * kB - 300032);
  EXPECT_EQ(s2[1].optimizer_group, 1);
}

TEST(Layout, TierHomesFollowTheConfig) {
  const auto count = [](const Layout& l, Tier t) {
    int n = 0;
    for (const ChunkPlace& c : l.chunks) n += c.state_tier == t;
    return n;
  };
  const std::vector<OptimizerGroupDesc> og = {{"d", 0.1}, {"n", 0.0}};
  auto dev = plan_layout(small_model(), og, config_with(OffloadDevice::kNone, OffloadDevice::kNone, 4 * kB));
  ASSERT_TRUE(dev.ok());
  EXPECT_EQ(count(*dev, Tier::kDevice), 10);
  EXPECT_EQ(dev->groups[1].compute_tier, Tier::kDevice);

  Config nvme = config_with(OffloadDevice::kNvme, OffloadDevice::kNvme, 4 * kB);
  nvme.strata.optimizer_cpu_fraction = 0.3;
  auto split = plan_layout(small_model(), og, nvme);
  ASSERT_TRUE(split.ok());
  // Chunk starts 0..9 blocks of 10: those starting below 3 blocks are pinned.
  EXPECT_EQ(count(*split, Tier::kPinned), 3);
  EXPECT_EQ(count(*split, Tier::kNvme), 7);
  EXPECT_EQ(split->chunks.front().state_tier, Tier::kPinned);
  EXPECT_EQ(split->chunks.back().state_tier, Tier::kNvme);
  EXPECT_EQ(split->groups[0].compute_tier, Tier::kNvme);

  Config ratio = config_with(OffloadDevice::kCpu, OffloadDevice::kCpu, 4 * kB);
  ratio.zero.offload_optimizer.ratio = 0.5;  // DeepSpeed: half updated on the CPU, the rest on the GPU
  auto half = plan_layout(small_model(), og, ratio);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(count(*half, Tier::kPinned), 5);
  EXPECT_EQ(count(*half, Tier::kDevice), 5);
  EXPECT_EQ(half->chunks.back().state_tier, Tier::kDevice);
}

std::vector<ParamDesc> uneven_model();

// offload_param.max_in_cpu with the compute copies on nvme: each group, in
// registration order, whose whole home fits in what is left of the
// allowance has a pinned home; a group that does not fit is passed over, so a
// later smaller one may still fit. No effect unless the device is nvme.
TEST(Layout, MaxInCpuKeepsWholeComputeHomesInPinnedMemory) {
  const std::vector<OptimizerGroupDesc> og = {{"d", 0.1}, {"n", 0.0}};
  // Homes: embed 32000 elements, l0 and l1 300032 + 320 = 300352 each.
  const auto tiers = [&](OffloadDevice param, std::int64_t max_in_cpu) {
    Config c = config_with(OffloadDevice::kCpu, param, 4 * kB);
    c.zero.offload_param.max_in_cpu = max_in_cpu;
    auto l = plan_layout(small_model(), og, c);
    EXPECT_TRUE(l.ok()) << l.status().to_string();
    std::vector<Tier> out;
    for (const GroupPlace& g : l->groups) out.push_back(g.compute_tier);
    return std::pair{out, l->bytes()};
  };
  constexpr Tier P = Tier::kPinned, N = Tier::kNvme;
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 0).first, (std::vector<Tier>{N, N, N}));
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 31999).first, (std::vector<Tier>{N, N, N}));
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 32000).first, (std::vector<Tier>{P, N, N}));
  // l0 does not fit in what embed leaves (300351 < 300352); l1 neither.
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 32000 + 300351).first, (std::vector<Tier>{P, N, N}));
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 32000 + 300352).first, (std::vector<Tier>{P, P, N}));
  EXPECT_EQ(tiers(OffloadDevice::kNvme, 1'000'000'000).first, (std::vector<Tier>{P, P, P}));
  // The homes' bytes move from nvme to pinned (bf16: 2 B an element).
  const auto [all_nvme, b0] = tiers(OffloadDevice::kNvme, 0);
  const auto [two_pinned, b1] = tiers(OffloadDevice::kNvme, 32000 + 300352);
  EXPECT_EQ(b1.pinned - b0.pinned, (32000u + 300352u) * 2);
  EXPECT_EQ(b0.nvme - b1.nvme, (32000u + 300352u) * 2);
  // Passed over: in uneven_model (groups l0, frozen0, l1, frozen1, l2,
  // frozen2; each frozen one 64 elements) l0 does not fit in 100, frozen0
  // does, and the 36 left hold no other.
  Config c = config_with(OffloadDevice::kCpu, OffloadDevice::kNvme, 4 * kB);
  c.zero.offload_param.max_in_cpu = 100;
  auto uneven = plan_layout(uneven_model(), og, c);
  ASSERT_TRUE(uneven.ok());
  std::vector<Tier> got;
  for (const GroupPlace& g : uneven->groups) got.push_back(g.compute_tier);
  EXPECT_EQ(got, (std::vector<Tier>{N, P, N, N, N, N}));
  // Other devices: the homes stay where the device says.
  EXPECT_EQ(tiers(OffloadDevice::kCpu, 0).first, (std::vector<Tier>{P, P, P}));
  EXPECT_EQ(tiers(OffloadDevice::kNone, 1'000'000'000).first,
            (std::vector<Tier>{Tier::kDevice, Tier::kDevice, Tier::kDevice}));
}

// The rule the layout and the planner share (tier.h): whole elements,
// offloaded share first, pinned before nvme.
TEST(Layout, OptimizerSplitRoundsToElementsAndAddsUp) {
  const OptimizerSplit none = split_optimizer_state(1000, OffloadDevice::kNone, 0.5, 0.5);
  EXPECT_EQ(none.device_elems, 1000);
  EXPECT_EQ(none.offloaded_elems(), 0);
  EXPECT_EQ(none.tier_at(0), Tier::kDevice);

  const OptimizerSplit cpu = split_optimizer_state(1001, OffloadDevice::kCpu, 0.5, 0.25);
  EXPECT_EQ(cpu.pinned_elems, 501);  // 500.5 rounds away from zero
  EXPECT_EQ(cpu.nvme_elems, 0);
  EXPECT_EQ(cpu.device_elems, 500);
  EXPECT_EQ(cpu.tier_at(500), Tier::kPinned);
  EXPECT_EQ(cpu.tier_at(501), Tier::kDevice);

  const OptimizerSplit nvme = split_optimizer_state(1000, OffloadDevice::kNvme, 0.8, 0.3);
  EXPECT_EQ(nvme.pinned_elems, 240);
  EXPECT_EQ(nvme.nvme_elems, 560);
  EXPECT_EQ(nvme.device_elems, 200);
  EXPECT_EQ(nvme.tier_at(239), Tier::kPinned);
  EXPECT_EQ(nvme.tier_at(240), Tier::kNvme);
  EXPECT_EQ(nvme.tier_at(799), Tier::kNvme);
  EXPECT_EQ(nvme.tier_at(800), Tier::kDevice);

  EXPECT_EQ(tier_of(OffloadDevice::kNone), Tier::kDevice);
  EXPECT_EQ(tier_of(OffloadDevice::kCpu), Tier::kPinned);
  EXPECT_EQ(tier_of(OffloadDevice::kNvme), Tier::kNvme);
  EXPECT_EQ(to_string(Tier::kPinned), "pinned");
  EXPECT_EQ(tier_key(Tier::kPinned), "cpu");
  EXPECT_EQ(tier_label(Tier::kPinned), "CPU RAM");
}

TEST(Layout, BytesPerTier) {
  Config c = config_with(OffloadDevice::kNvme, OffloadDevice::kCpu, 4 * kB);
  c.gradient_accumulation_steps = 4;  // fp32 gradient accumulators: 4 B
  auto l = plan_layout(small_model(), {{"d", 0.1}, {"n", 0.0}}, c);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->grad_bytes, 4);
  const TierBytes b = l->bytes();
  const std::uint64_t compute = (32000 + 2 * (300032 + 320)) * 2;
  EXPECT_EQ(b.device, 0u);
  EXPECT_EQ(b.pinned, compute + 10 * kB * 4);
  EXPECT_EQ(b.nvme, 10u * kB * 12);
}

// The chunks as the placement rule lists them one by one: whole chunks of a
// group in order, the last one shorter, each homed at its first element.
std::vector<ChunkPlace> chunks_by_hand(const Layout& l, const Config& c) {
  const OptimizerSplit split =
      split_optimizer_state(l.trainable_elems, c.zero.offload_optimizer.device, c.zero.offload_optimizer.ratio,
                            c.strata.optimizer_cpu_fraction);
  std::vector<ChunkPlace> out;
  for (std::size_t gi = 0; gi < l.groups.size(); ++gi) {
    const GroupPlace& g = l.groups[gi];
    for (std::int64_t off = 0; off < g.trainable_elems; off += l.chunk_elems) {
      const std::int64_t begin = g.trainable_begin + off;
      out.push_back({gi, begin, std::min(l.chunk_elems, g.trainable_elems - off), split.tier_at(begin)});
    }
  }
  return out;
}

// Layers of a w (rows x 300) and a b (300), a frozen one in between: groups of
// 2, 5 and 9 blocks, so chunks of 2 or 4 blocks leave a shorter last one.
std::vector<ParamDesc> uneven_model() {
  std::vector<ParamDesc> p;
  const std::int64_t rows[] = {400, 1000, 1900};
  for (int i = 0; i < 3; ++i) {
    const std::string g = "l" + std::to_string(i);
    p.push_back({g + ".w", {rows[i], 300}, g, true, 0});
    p.push_back({g + ".b", {300}, g, true, 1});
    p.push_back({g + ".frozen", {64}, "frozen" + std::to_string(i), false, 0});
  }
  return p;
}

TEST(Layout, ChunkRunsListTheSameChunksAsThePlacementRule) {
  struct Case {
    OffloadDevice optimizer;
    double ratio, cpu_fraction;
    std::uint64_t chunk_bytes;
  };
  const Case cases[] = {
      {OffloadDevice::kNone, 1.0, 1.0, 2 * kB * 4},  {OffloadDevice::kCpu, 1.0, 1.0, 4 * kB * 4},
      {OffloadDevice::kCpu, 0.5, 1.0, 2 * kB * 4},   {OffloadDevice::kNvme, 1.0, 0.3, 4 * kB * 4},
      {OffloadDevice::kNvme, 0.7, 0.4, 2 * kB * 4},  {OffloadDevice::kNvme, 0.9, 0.2, kB * 4},
      {OffloadDevice::kNvme, 0.55, 0.5, 64 * kB * 4}, {OffloadDevice::kNvme, 1.0, 0.0, 3 * kB * 4},
  };
  for (const Case& k : cases) {
    Config c = config_with(k.optimizer, OffloadDevice::kCpu, k.chunk_bytes);
    c.zero.offload_optimizer.ratio = k.ratio;
    c.strata.optimizer_cpu_fraction = k.cpu_fraction;
    const std::string label = std::string(to_string(tier_of(k.optimizer))) + " ratio " + std::to_string(k.ratio) +
                              " cpu_fraction " + std::to_string(k.cpu_fraction) + " chunk " +
                              std::to_string(k.chunk_bytes);
    auto runs = plan_layout_runs(uneven_model(), {{"d", 0.1}, {"n", 0.0}}, c);
    ASSERT_TRUE(runs.ok()) << runs.status();
    EXPECT_TRUE(runs->chunks.empty()) << label;
    EXPECT_LE(runs->chunk_runs.size(), 4 * runs->groups.size()) << label;
    const TierBytes counted = runs->bytes();  // from the runs alone

    auto l = plan_layout(uneven_model(), {{"d", 0.1}, {"n", 0.0}}, c);
    ASSERT_TRUE(l.ok()) << l.status();
    const std::vector<ChunkPlace> want = chunks_by_hand(*l, c);
    ASSERT_EQ(l->chunks.size(), want.size()) << label;
    TierBytes listed;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const ChunkPlace& got = l->chunks[i];
      EXPECT_EQ(got.group, want[i].group) << label << " chunk " << i;
      EXPECT_EQ(got.begin, want[i].begin) << label << " chunk " << i;
      EXPECT_EQ(got.elems, want[i].elems) << label << " chunk " << i;
      EXPECT_EQ(got.state_tier, want[i].state_tier) << label << " chunk " << i;
      (got.state_tier == Tier::kDevice ? listed.device : got.state_tier == Tier::kPinned ? listed.pinned : listed.nvme) +=
          l->state_bytes(got);
    }
    for (const GroupPlace& g : l->groups) {
      for (std::size_t i = g.first_chunk; i < g.first_chunk + g.chunk_count; ++i) {
        EXPECT_EQ(&l->groups[l->chunks[i].group], &g) << label << " chunk " << i;
      }
    }
    // Each run is its chunks, in order, and the runs' bytes are the chunks'.
    std::size_t next = 0;
    for (const ChunkRun& r : runs->chunk_runs) {
      EXPECT_EQ(r.first_chunk, next) << label;
      ASSERT_GE(r.count, 1u) << label;
      for (std::size_t k = 0; k < r.count; ++k) {
        EXPECT_EQ(want[r.first_chunk + k].begin, r.begin + static_cast<std::int64_t>(k) * r.elems) << label;
        EXPECT_EQ(want[r.first_chunk + k].elems, r.elems) << label;
        EXPECT_EQ(want[r.first_chunk + k].state_tier, r.state_tier) << label;
        EXPECT_EQ(want[r.first_chunk + k].group, r.group) << label;
      }
      next += r.count;
    }
    EXPECT_EQ(next, want.size()) << label;
    const TierBytes full = l->bytes();
    EXPECT_EQ(counted.device, full.device) << label;
    EXPECT_EQ(counted.pinned, full.pinned) << label;
    EXPECT_EQ(counted.nvme, full.nvme) << label;
    EXPECT_EQ(full.device, listed.device) << label;  // the compute copies are in pinned memory
    EXPECT_EQ(full.nvme, listed.nvme) << label;
  }
}

// A model whose chunks would take many GB to list: 4096 parameters of
// 65536 x 65536 (2^44 elements, 2^28 chunks of one norm block). Its runs, and
// what it needs per tier, are counted from a few per group.
TEST(Layout, AHugeModelsRunsAreBoundedByItsGroups) {
  std::vector<ParamDesc> params;
  for (int i = 0; i < 4096; ++i) {
    params.push_back({"w" + std::to_string(i), {65536, 65536}, "l" + std::to_string(i), true, 0});
  }
  Config c = config_with(OffloadDevice::kNvme, OffloadDevice::kCpu, kB * 4);
  c.strata.optimizer_cpu_fraction = 0.25;
  auto l = plan_layout_runs(std::move(params), {{"d", 0.1}}, c);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->chunks.empty());
  EXPECT_LE(l->chunk_runs.size(), 2u * 4096u);  // one tier boundary: one group in two runs
  const std::uint64_t elems = 4096ull << 32;
  EXPECT_EQ(static_cast<std::uint64_t>(l->trainable_elems), elems);
  std::uint64_t chunks = 0;
  for (const ChunkRun& r : l->chunk_runs) chunks += r.count;
  EXPECT_EQ(chunks, elems / kB);
  const TierBytes b = l->bytes();
  EXPECT_EQ(b.device, 0u);
  EXPECT_EQ(b.pinned, elems * 2 + elems / 4 * 12 + elems * 2);  // compute copies, a quarter's state, gradients
  EXPECT_EQ(b.nvme, elems / 4 * 3 * 12);
}

TEST(Layout, Stage3ShardsEveryParameterOnceAcrossTheRanks) {
  // l0 mixes a frozen parameter with trainable ones. At stage 3 each rank's
  // part of every parameter (Layout::shard_of) covers it exactly once over
  // the ranks, and each rank's parts sit in its home without overlapping;
  // at stage 2 the compute copies stay whole (a frozen parameter is held
  // whole by rank param mod N, the checkpoint's rule).
  std::vector<ParamDesc> model = small_model();
  model.insert(model.begin() + 2, ParamDesc{"l0.frozen", {77}, "l0", false, 0});
  for (int n : {2, 3, 5}) {
    for (int stage : {2, 3}) {
      Config c = config_with(OffloadDevice::kCpu, OffloadDevice::kCpu, 8 * kB);
      c.zero.stage = stage;
      std::vector<Layout> ranks;
      for (int r = 0; r < n; ++r) {
        auto l = plan_layout(model, {{"decay", 0.1}, {"no_decay", 0.0}}, c, {r, n});
        ASSERT_TRUE(l.ok()) << l.status();
        EXPECT_EQ(l->compute_sharded, stage == 3);
        ranks.push_back(*std::move(l));
      }
      const Layout& l0 = ranks[0];
      for (std::size_t g = 0; g < l0.groups.size(); ++g) {
        const GroupPlace& gp = l0.groups[g];
        EXPECT_EQ(l0.home_elems(gp), stage == 3 ? gp.shard_elems + gp.frozen_shard_elems : gp.compute_elems);
        for (int r = 0; r < n; ++r) {
          // This rank's parts of the group's parameters, as [home, home + size): disjoint, in the home.
          std::vector<std::pair<std::int64_t, std::int64_t>> used;
          for (std::size_t pi : gp.params) {
            const Layout::ShardPiece s = ranks[static_cast<std::size_t>(r)].shard_of(pi, r);
            if (s.lo == s.hi) continue;
            if (stage == 3) {
              EXPECT_LE(s.home + (s.hi - s.lo), l0.home_elems(gp)) << model[pi].name << " rank " << r;
            } else {
              EXPECT_EQ(s.home, l0.places[pi].compute_offset + s.lo);
            }
            used.push_back({s.home, s.home + (s.hi - s.lo)});
          }
          std::sort(used.begin(), used.end());
          for (std::size_t k = 1; k < used.size(); ++k) EXPECT_LE(used[k - 1].second, used[k].first) << "rank " << r;
        }
      }
      for (std::size_t pi = 0; pi < model.size(); ++pi) {
        std::vector<std::pair<std::int64_t, std::int64_t>> parts;
        for (int r = 0; r < n; ++r) {
          const Layout::ShardPiece s = l0.shard_of(pi, r);
          EXPECT_EQ(s.lo, ranks[static_cast<std::size_t>(r)].shard_of(pi, r).lo);  // every rank agrees
          if (s.lo < s.hi) parts.push_back({s.lo, s.hi});
          if (stage == 2 && !model[pi].trainable) {
            EXPECT_EQ(s.hi - s.lo, static_cast<int>(pi) % n == r ? model[pi].numel() : 0) << model[pi].name;
          }
        }
        std::sort(parts.begin(), parts.end());
        std::int64_t at = 0;
        for (const auto& [lo, hi] : parts) {
          EXPECT_EQ(lo, at) << model[pi].name << ": a gap or an overlap with " << n << " ranks, stage " << stage;
          at = hi;
        }
        EXPECT_EQ(at, model[pi].numel()) << model[pi].name;
      }
    }
  }
}

TEST(Layout, BadRegistrationsNameTheParameter) {
  const Config c = config_with(OffloadDevice::kCpu, OffloadDevice::kNone, 4 * kB);
  struct Case {
    std::vector<ParamDesc> params;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{}, "no parameters"},
      {{{"a", {4}, "g"}, {"a", {4}, "g"}}, "'a' is registered twice"},
      {{{"a", {4, 0}, "g"}}, "'a' has a dimension of 0"},
      {{{"a", {4}, ""}}, "'a' has no fetch group"},
      {{{"", {4}, "g"}}, "#0 has an empty name"},
      {{{"a", {4}, "g", true, 5}}, "'a' names optimizer group 5"},
  };
  for (const Case& k : cases) {
    auto l = plan_layout(k.params, {{"d", 0.0}}, c);
    ASSERT_FALSE(l.ok()) << k.expect;
    EXPECT_EQ(l.status().code(), core::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find(k.expect), std::string::npos) << l.status();
  }
  // A frozen parameter's optimizer group is not looked at.
  EXPECT_TRUE(plan_layout({{"a", {4}, "g", false, 9}}, {}, c).ok());
}

}  // namespace
}  // namespace strata::engine
