// Checkpoints across rank counts (docs/checkpoints.md, "Several ranks"): a
// checkpoint saved by N ranks (one state file per rank, each holding its
// shards) loads with M ranks and with one, every bit of every master, moment
// and compute copy where it was; a run resumed through N -> M -> 1 -> N
// goes on exactly as the run that saved it; export gathers the whole model;
// a damaged state file stops every rank before any changes its state.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint/inspect.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "tests/e2e/ranks_harness.h"

namespace strata::engine::e2e {
namespace {

namespace fs = std::filesystem;

constexpr int kBefore = 3;  // steps before the save
constexpr int kAfter = 3;   // steps after it

struct CkCase {
  std::string placement;
  OverlapMode overlap;
  StateFormat format;
};

void PrintTo(const CkCase& k, std::ostream* os) {
  *os << k.placement << " " << to_string(k.overlap) << " " << to_string(k.format);
}

std::string bytes_of_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void expect_same_outcome(const Outcome& got, const Outcome& want, const std::string& what) {
  expect_same(got.master, want.master, what + ": masters");
  expect_same(got.exp_avg, want.exp_avg, what + ": exp_avg");
  expect_same(got.exp_avg_sq, want.exp_avg_sq, what + ": exp_avg_sq");
  ASSERT_FALSE(want.compute.empty());
  for (std::size_t r = 0; r < got.compute.size(); ++r) {
    expect_same(got.compute[r], want.compute[0], what + ": compute copies of rank " + std::to_string(r));
  }
}

class RanksCheckpoint : public RanksTest, public ::testing::WithParamInterface<CkCase> {
 protected:
  Config with_format(StateFormat format) const {
    Config c = config(GetParam().placement, GetParam().overlap);
    c.strata.optimizer_state.format = format;
    c.strata.seed = 1234;
    return c;
  }
  // Steps [from, from + steps) on n ranks, one micro-batch each (rank r's of step s is batch s * n + r).
  static void train(Engine& e, int r, int n, int from, int steps) {
    Framework f;
    for (int s = from; s < from + steps; ++s) micro_batch(e, f, s * n + r, true, nullptr).status().ignore_error();
  }
  // Each rank's framework blob is its own ("framework of rank R": its RNG
  // states, its place in the data); a load by as many ranks gives each its
  // own, one by another count rank 0's (`from`: the rank whose blob comes back).
  static std::string blob_of(int r) { return "framework of rank " + std::to_string(r); }
  static void load(Engine& e, const fs::path& root, int from) {
    const auto blob = e.load_checkpoint(root.string());
    ASSERT_TRUE(blob.ok()) << blob.status();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(blob->data()), blob->size()), blob_of(from));
  }
  static void save(Engine& e, const fs::path& root, int r) {
    const std::string blob = blob_of(r);
    const core::Status s = e.save_checkpoint(root.string(), std::as_bytes(std::span<const char>(blob)));
    EXPECT_TRUE(s.ok()) << s;
  }
  // A checkpoint of one step saved by three ranks, at `root`.
  void save_one_step(const Config& c, const fs::path& root) {
    on_ranks(c, 3, "save", [&](int r, Engine& e) {
      train(e, r, 3, 0, 1);
      save(e, root, r);
    });
  }
  // Flips the bits `mask` of byte `at` of the file (its bytes before, returned).
  static std::string flip(const fs::path& file, std::size_t at, char mask) {
    std::string bytes = bytes_of_file(file);
    const std::string before = bytes;
    if (at < bytes.size()) bytes[at] = static_cast<char>(bytes[at] ^ mask);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    return before;
  }
};

TEST_P(RanksCheckpoint, ThreeRanksToFourToTwoToOneAndBackResumesExactly) {
  const Config c = with_format(GetParam().format);
  const fs::path three = dir_ / "by-three", four = dir_ / "by-four", two = dir_ / "by-two", one = dir_ / "by-one";
  // Three ranks: l1.w is cut between ranks 0 and 1 (one norm block each), l1.b is rank 2's.
  const Outcome finished = on_ranks(c, 3, "first", [&](int r, Engine& e) {
    train(e, r, 3, 0, kBefore);
    save(e, three, r);
    train(e, r, 3, kBefore, kAfter);
  });
  // What the save holds: three fresh ranks loading it, each its own blob.
  const Outcome saved = on_ranks(c, 3, "reload", [&](int r, Engine& e) { load(e, three, r); });
  ASSERT_FALSE(saved.master.empty());
  auto inspected = inspect_checkpoint(three.string(), /*verify=*/true);
  ASSERT_TRUE(inspected.ok()) << inspected.status();
  EXPECT_EQ(inspected->manifest.version, kCheckpointFormatRanks);
  EXPECT_EQ(inspected->manifest.ranks, 3);
  // The manifest, three state files, framework.bin (rank 0's blob) and the other two ranks' blobs.
  ASSERT_EQ(inspected->files.size(), 7u);
  EXPECT_EQ(inspected->files[2].name, "state-rank-1-of-3.safetensors");
  EXPECT_EQ(inspected->files[4].name, "framework.bin");
  EXPECT_EQ(inspected->files[6].name, "framework-rank-2-of-3.bin");
  EXPECT_EQ(inspected->files[6].bytes, blob_of(2).size());
  EXPECT_TRUE(inspected->verified);

  // Four ranks load it (each reads its shards from the files that hold
  // them; rank 3's shards are all padding, so its file holds nothing) and
  // save it by four; two ranks load that and save it by two.
  const Outcome by_four = on_ranks(c, 4, "four", [&](int r, Engine& e) {
    load(e, three, 0);  // another rank count: rank 0's blob
    save(e, four, r);
  });
  expect_same_outcome(by_four, saved, "3 -> 4");
  auto four_ranks = locate_checkpoint(four.string());
  ASSERT_TRUE(four_ranks.ok()) << four_ranks.status();
  ASSERT_EQ(four_ranks->manifest.shards.size(), 4u);
  EXPECT_TRUE(four_ranks->manifest.shards[3].ranges.empty());
  const Outcome by_two = on_ranks(c, 2, "two", [&](int r, Engine& e) {
    load(e, four, 0);
    save(e, two, r);
  });
  expect_same_outcome(by_two, saved, "3 -> 4 -> 2");
  // One rank loads the two ranks' checkpoint and saves the one-rank format; it exports.
  const Outcome by_one = on_ranks(c, 1, "one", [&](int, Engine& e) {
    load(e, two, 0);
    save(e, one, 0);
    const core::Status x = e.export_safetensors((dir_ / "export-one").string(), Precision::kFp32, 0);
    EXPECT_TRUE(x.ok()) << x;
  });
  expect_same_outcome(by_one, saved, "3 -> 4 -> 2 -> 1");
  auto single = locate_checkpoint(one.string());
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->manifest.version, kCheckpointFormatOneRank);
  // Three ranks load the one-rank checkpoint, export (gathered, rank 0
  // writes) and train on: exactly where the first run went.
  const Outcome resumed = on_ranks(c, 3, "resumed", [&](int r, Engine& e) {
    load(e, one, 0);
    const core::Status x = e.export_safetensors((dir_ / "export-three").string(), Precision::kFp32, 0);
    EXPECT_TRUE(x.ok()) << x;
    train(e, r, 3, kBefore, kAfter);
  });
  expect_same_outcome(resumed, finished, "3 -> 4 -> 2 -> 1 -> 3, resumed");
  const std::string exported = bytes_of_file(dir_ / "export-three" / "model.safetensors");
  EXPECT_FALSE(exported.empty());
  EXPECT_EQ(exported, bytes_of_file(dir_ / "export-one" / "model.safetensors"));
}

TEST_P(RanksCheckpoint, ADamagedStateFileStopsEveryRankBeforeAnyChange) {
  const Config c = with_format(GetParam().format);
  const fs::path root = dir_ / "ckpt";
  save_one_step(c, root);
  // One flipped bit in rank 1's file: with two ranks loading, rank 1 checks
  // it (file j is checked by rank j mod 2) and rank 0 hears of it.
  const fs::path victim = root / "step-1" / "state-rank-1-of-3.safetensors";
  ASSERT_FALSE(flip(victim, fs::file_size(victim) / 2, 0x10).empty());
  const Outcome fresh = on_ranks(c, 2, "fresh", [](int, Engine&) {});
  std::vector<core::Status> got(2);
  const Outcome after = on_ranks(c, 2, "damaged", [&](int r, Engine& e) {
    got[static_cast<std::size_t>(r)] = e.load_checkpoint(root.string()).status();
  });
  for (int r = 0; r < 2; ++r) {
    const core::Status& s = got[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.code(), core::StatusCode::kDataLoss) << "rank " << r << ": " << s;
  }
  EXPECT_NE(got[1].message().find("state-rank-1-of-3.safetensors"), std::string::npos) << got[1];
  EXPECT_NE(got[0].message().find("rank 1"), std::string::npos) << got[0];
  expect_same_outcome(after, fresh, "after a refused load");
}

// A damaged blob of rank 2 stops its load naming the file (the other
// ranks' loads stop with it); a load by another rank count reads rank 0's
// and goes on.
TEST_P(RanksCheckpoint, ADamagedRankBlobIsNamedByTheRankThatReadsIt) {
  const Config c = with_format(GetParam().format);
  const fs::path root = dir_ / "ckpt";
  save_one_step(c, root);
  ASSERT_EQ(flip(root / "step-1" / "framework-rank-2-of-3.bin", 0, 0x01), blob_of(2));
  std::vector<core::Status> got(3);
  on_ranks(c, 3, "damaged", [&](int r, Engine& e) {
    got[static_cast<std::size_t>(r)] = e.load_checkpoint(root.string()).status();
  });
  EXPECT_EQ(got[2].code(), core::StatusCode::kDataLoss) << got[2];
  EXPECT_NE(got[2].message().find("framework-rank-2-of-3.bin"), std::string::npos) << got[2];
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(got[static_cast<std::size_t>(r)].ok()) << "rank " << r;
  on_ranks(c, 2, "two", [&](int, Engine& e) { load(e, root, 0); });
}

INSTANTIATE_TEST_SUITE_P(
    Placements, RanksCheckpoint,
    ::testing::Values(CkCase{"cpu", OverlapMode::kExact, StateFormat::kFp32},
                      CkCase{"nvme", OverlapMode::kDelayed, StateFormat::kFp32},
                      CkCase{"device", OverlapMode::kNone, StateFormat::kBf16},
                      CkCase{"cpu", OverlapMode::kExact, StateFormat::kInt8Blockwise}),
    [](const ::testing::TestParamInfo<CkCase>& i) {
      return i.param.placement + "_" + std::string(to_string(i.param.overlap)) + "_" +
             std::string(to_string(i.param.format));
    });

TEST_F(RanksTest, Stage3CheckpointsLoadAcrossRankCountsAndStages) {
  // Stage 3 (each rank's homes hold its shard of the compute copies, l2.b
  // frozen, so a frozen part is sharded too): three ranks save; two ranks at
  // stage 2 (compute copies whole) load it and save; one rank loads that and
  // saves; three ranks at stage 3 load the one rank's and go on exactly as
  // the first run did.
  const std::vector<std::string> frozen = {"l2.b"};
  const Config c3 = stage3(config("cpu", OverlapMode::kDelayed), "nvme");
  const Config c2 = config("cpu", OverlapMode::kDelayed);
  const fs::path by_three = dir_ / "s3-by-three", by_two = dir_ / "s2-by-two", by_one = dir_ / "s3-by-one";
  auto train = [](Engine& e, int r, int n, int from, int steps) {
    Framework f;
    for (int s = from; s < from + steps; ++s) micro_batch(e, f, s * n + r, true, nullptr).status().ignore_error();
  };
  auto save = [](Engine& e, const fs::path& root) {
    const core::Status s = e.save_checkpoint(root.string(), {});
    EXPECT_TRUE(s.ok()) << s;
  };
  auto load = [](Engine& e, const fs::path& root) {
    const auto blob = e.load_checkpoint(root.string());
    EXPECT_TRUE(blob.ok()) << blob.status();
  };
  const Outcome finished = on_ranks(
      c3, 3, "s3-first",
      [&](int r, Engine& e) {
        train(e, r, 3, 0, kBefore);
        save(e, by_three);
        train(e, r, 3, kBefore, kAfter);
      },
      frozen);
  const Outcome saved = on_ranks(c3, 3, "s3-reload", [&](int, Engine& e) { load(e, by_three); }, frozen);
  ASSERT_FALSE(saved.master.empty());
  // Two ranks at stage 3: each one's part of a parameter from parts of two files.
  const Outcome two3 = on_ranks(c3, 2, "s3-two", [&](int, Engine& e) { load(e, by_three); }, frozen);
  expect_same_outcome(two3, saved, "stage 3 by 3 -> stage 3 by 2");
  const Outcome two = on_ranks(
      c2, 2, "s2-two",
      [&](int, Engine& e) {
        load(e, by_three);
        save(e, by_two);
      },
      frozen);
  expect_same_outcome(two, saved, "stage 3 by 3 -> stage 2 by 2");
  const Outcome one = on_ranks(
      c3, 1, "s3-one",
      [&](int, Engine& e) {
        load(e, by_two);
        save(e, by_one);
      },
      frozen);
  expect_same_outcome(one, saved, "stage 3 by 3 -> stage 2 by 2 -> 1");
  const Outcome resumed = on_ranks(
      c3, 3, "s3-resumed",
      [&](int r, Engine& e) {
        load(e, by_one);
        train(e, r, 3, kBefore, kAfter);
      },
      frozen);
  expect_same_outcome(resumed, finished, "-> stage 3 by 3, resumed");
}

TEST_F(RanksTest, ABaseOneRankLeftOutLoadsIntoStage3RanksThatGatherAndCompareIt) {
  // One rank reads its frozen base (l1.w) from a safetensors file and leaves
  // it out of its checkpoint (manifest version 4, the base's CRC64). Two
  // ranks at stage 3 hold that base in shards on the swap drive: the load
  // gathers it, compares its CRC64 in a phase of its own, and gives every
  // master, moment and compute copy of the one rank's; a base of other
  // values is refused, every rank unchanged.
  const std::vector<std::string> frozen = {"l1.w"};
  const Tensor& w = kTensors[0];
  ASSERT_EQ(w.name, "l1.w");
  auto write_base = [&](const fs::path& d, float add) {
    fs::create_directories(d);
    std::vector<float> v(static_cast<std::size_t>(w.shape[0] * w.shape[1]));
    init_values(w, v);
    for (float& x : v) x += add;
    auto writer = SafetensorsWriter::create((d / "model.safetensors").string(), {{w.name, TensorDtype::kBf16, w.shape}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(writer->write_f32(w.name, v).ok());
    ASSERT_TRUE(writer->finish().ok());
  };
  write_base(dir_ / "base", 0.0f);
  write_base(dir_ / "other", 0.5f);
  Config one = stage3(config("cpu", OverlapMode::kExact), "nvme");
  one.strata.frozen_base = FrozenBase::kFiles;
  const fs::path ck = dir_ / "ck-one";
  const Outcome saved = on_ranks(
      one, 1, "one",
      [&](int, Engine& e) {
        Framework f;
        for (int s = 0; s < kBefore; ++s) micro_batch(e, f, s, true, nullptr).status().ignore_error();
        const core::Status st = e.save_checkpoint(ck.string(), {});
        EXPECT_TRUE(st.ok()) << st;
      },
      frozen, (dir_ / "base").string());
  auto located = locate_checkpoint(ck.string());
  ASSERT_TRUE(located.ok()) << located.status();
  ASSERT_EQ(located->manifest.frozen_base.size(), 1u);
  EXPECT_EQ(located->manifest.frozen_base[0].group, "l1");

  const Config three = stage3(config("cpu", OverlapMode::kExact), "nvme");  // the base on the swap drive
  const Outcome two = on_ranks(
      three, 2, "two",
      [&](int, Engine& e) {
        const auto blob = e.load_checkpoint(ck.string());
        EXPECT_TRUE(blob.ok()) << blob.status();
      },
      frozen, (dir_ / "base").string());
  expect_same_outcome(two, saved, "one rank without its base -> stage 3 by 2");

  const Outcome before = on_ranks(three, 2, "other-before", [](int, Engine&) {}, frozen, (dir_ / "other").string());
  const Outcome refused = on_ranks(
      three, 2, "other",
      [&](int, Engine& e) {
        const auto blob = e.load_checkpoint(ck.string());
        ASSERT_FALSE(blob.ok());
        EXPECT_EQ(blob.status().code(), core::StatusCode::kFailedPrecondition) << blob.status();
        EXPECT_NE(blob.status().message().find("gathered from its 2 ranks' shards"), std::string::npos)
            << blob.status();
      },
      frozen, (dir_ / "other").string());
  expect_same_outcome(refused, before, "a refused load changes nothing");
}

TEST_F(RanksTest, RangesThatDoNotMatchTheirFilesAreRefusedBeforeAnyChange) {
  // A manifest (checksummed anew) whose ranges still cover every element but
  // do not match the tensors in the files: l1.w's cut moved from 65,536 to
  // 70,000. Every rank finds it while checking, before its state changes.
  const Config c = config("cpu", OverlapMode::kExact);
  const fs::path root = dir_ / "ckpt";
  on_ranks(c, 3, "save", [&](int r, Engine& e) {
    Framework f;
    micro_batch(e, f, r, true, nullptr).status().ignore_error();
    EXPECT_TRUE(e.save_checkpoint(root.string(), {}).ok());
  });
  const fs::path manifest = root / "step-1" / "manifest.json";
  const std::string text = bytes_of_file(manifest);
  auto m = parse_checkpoint_manifest(std::as_bytes(std::span<const char>(text)), manifest.string());
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->shards.size(), 3u);
  ASSERT_FALSE(m->shards[0].ranges.empty());
  ASSERT_FALSE(m->shards[1].ranges.empty());
  CheckpointRange& first = m->shards[0].ranges.front();
  CheckpointRange& second = m->shards[1].ranges.front();
  ASSERT_EQ(first.param, second.param);
  ASSERT_EQ(first.hi, second.lo);
  first.hi = second.lo = 70'000;
  std::ofstream(manifest, std::ios::binary | std::ios::trunc) << format_checkpoint_manifest(*m);
  std::vector<core::Status> got(2);
  on_ranks(c, 2, "mismatched", [&](int r, Engine& e) {
    got[static_cast<std::size_t>(r)] = e.load_checkpoint(root.string()).status();
    // Nothing changed, so training goes on.
    Framework f;
    EXPECT_TRUE(micro_batch(e, f, r, true, nullptr).ok());
  });
  for (const core::Status& s : got) {
    EXPECT_EQ(s.code(), core::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("which the manifest says holds elements [0, 70000)"), std::string::npos) << s;
  }
}

TEST_F(RanksTest, EightBitStateSavedByRanksLoadsAsFp32Exactly) {
  // Codes saved in shards, read into another format: each range decoded
  // from its own blocks' scales, then kept as fp32, which is exact.
  Config int8 = config("cpu", OverlapMode::kExact);
  int8.strata.optimizer_state.format = StateFormat::kInt8Blockwise;
  int8.strata.seed = 1234;
  Config fp32 = int8;
  fp32.strata.optimizer_state.format = StateFormat::kFp32;
  const fs::path root = dir_ / "int8";
  const Outcome saved = on_ranks(int8, 3, "int8", [&](int r, Engine& e) {
    Framework f;
    for (int s = 0; s < 2; ++s) micro_batch(e, f, s * 3 + r, true, nullptr).status().ignore_error();
    const core::Status st = e.save_checkpoint(root.string(), {});
    EXPECT_TRUE(st.ok()) << st;
  });
  const Outcome loaded = on_ranks(fp32, 2, "fp32", [&](int, Engine& e) {
    const auto blob = e.load_checkpoint(root.string());
    EXPECT_TRUE(blob.ok()) << blob.status();
  });
  expect_same(loaded.master, saved.master, "masters");
  expect_same(loaded.exp_avg, saved.exp_avg, "exp_avg");
  expect_same(loaded.exp_avg_sq, saved.exp_avg_sq, "exp_avg_sq");
}

// finalize_from_checkpoint on several ranks (stage 3 on nvme, saved by
// three, read by two): every rank ends as a finalize and a load leave it and
// trains on alike; a rank that finds no checkpoint stops every rank before
// anything is built.
TEST_F(RanksTest, FinalizeFromCheckpointOnRanksIsAFinalizeAndALoad) {
  Config c = stage3(config("nvme", OverlapMode::kExact), "nvme");
  c.strata.seed = 1234;
  const fs::path root = dir_ / "saved";
  on_ranks(c, 3, "save", [&](int r, Engine& e) {
    Framework f;
    for (int s = 0; s < 2; ++s) micro_batch(e, f, s * 3 + r, true, nullptr).status().ignore_error();
    const core::Status st = e.save_checkpoint(root.string(), {});
    EXPECT_TRUE(st.ok()) << st;
  });
  auto train_on = [](int r, Engine& e) {
    Framework f;
    for (int s = 2; s < 4; ++s) micro_batch(e, f, s * 2 + r, true, nullptr).status().ignore_error();
  };
  const Outcome want = on_ranks(c, 2, "load", [&](int r, Engine& e) {
    const auto blob = e.load_checkpoint(root.string());
    ASSERT_TRUE(blob.ok()) << blob.status();
    train_on(r, e);
  });
  std::vector<int> built(2);  // whether each rank's engine was finalized
  auto from_checkpoint = [&](const std::string& run, const std::function<fs::path(int)>& root_of,
                             std::vector<core::Status>* status) {
    std::vector<Outcome> per(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        std::unique_ptr<Engine> e = register_mlp(c, ranks(r, 2, run));
        if (e == nullptr) return;
        const fs::path from = root_of(r);  // empty: finalize
        const auto blob = from.empty() ? core::Result<std::vector<std::byte>>(e->finalize())
                                       : e->finalize_from_checkpoint(from.string());
        (*status)[static_cast<std::size_t>(r)] = blob.status();
        built[static_cast<std::size_t>(r)] = e->finalized() ? 1 : 0;
        if (!blob.ok()) return;
        train_on(r, *e);
        read_outcome(*e, per[static_cast<std::size_t>(r)]);
      });
    }
    for (std::thread& t : threads) t.join();
    return merge_outcomes(per);
  };
  std::vector<core::Status> status(2);
  const Outcome got = from_checkpoint("from", [&](int) { return root; }, &status);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(status[static_cast<std::size_t>(r)].ok()) << status[static_cast<std::size_t>(r)];
  expect_same(got.master, want.master, "masters");
  expect_same(got.exp_avg, want.exp_avg, "exp_avg");
  expect_same(got.exp_avg_sq, want.exp_avg_sq, "exp_avg_sq");
  ASSERT_EQ(got.compute.size(), 2u);
  for (std::size_t r = 0; r < 2; ++r) expect_same(got.compute[r], want.compute[0], "compute copies");
  // Rank 1 finds nothing: both stop, naming it, and neither built anything.
  from_checkpoint("missing", [&](int r) { return r == 1 ? dir_ / "nothing" : root; }, &status);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[static_cast<std::size_t>(r)].code(), core::StatusCode::kNotFound) << status[static_cast<std::size_t>(r)];
    EXPECT_EQ(built[static_cast<std::size_t>(r)], 0) << "rank " << r;
  }
  EXPECT_NE(status[0].message().find("rank 1"), std::string::npos) << status[0];
  // A damaged state file that rank 1 checks (as it reads it: the state holds
  // no values yet): both engines built and refusing all but a load, rank 1
  // naming the file, rank 0 naming rank 1.
  const fs::path damaged = dir_ / "damaged";
  fs::copy(root, damaged, fs::copy_options::recursive);
  const fs::path file = damaged / "step-2" / "state-rank-1-of-3.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) / 2));
    f.put('\x5a');
  }
  from_checkpoint("damaged", [&](int) { return damaged; }, &status);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[static_cast<std::size_t>(r)].code(), core::StatusCode::kDataLoss) << status[static_cast<std::size_t>(r)];
    EXPECT_EQ(built[static_cast<std::size_t>(r)], 1) << "rank " << r;
  }
  EXPECT_NE(status[1].message().find(file.string() + ": CRC64 mismatch"), std::string::npos) << status[1];
  EXPECT_NE(status[0].message().find("rank 1 failed"), std::string::npos) << status[0];
  // Rank 1 calls finalize, or resumes from another checkpoint: both ranks
  // stop at their first vote, naming it (none waits for the other).
  const fs::path other = dir_ / "other";
  fs::copy(root, other, fs::copy_options::recursive);
  fs::rename(other / "step-2", other / "step-3");
  fs::remove(other / "latest");  // the newest complete step folder: step-3
  for (const bool plain : {true, false}) {
    from_checkpoint(plain ? "plain" : "another", [&](int r) { return r == 0 ? root : plain ? fs::path() : other; },
                    &status);
    for (int r = 0; r < 2; ++r) {
      const core::Status& st = status[static_cast<std::size_t>(r)];
      EXPECT_EQ(st.code(), core::StatusCode::kFailedPrecondition) << st;
      EXPECT_NE(st.message().find(plain ? "rank 1 called finalize and rank 0 finalize_from_checkpoint"
                                        : "rank 1 found another checkpoint"),
                std::string::npos)
          << st;
    }
  }
}

}  // namespace
}  // namespace strata::engine::e2e
