// A checkpoint's small files without an engine: manifest.json and latest
// checksummed so that every flipped bit is DATA_LOSS naming the file, their
// bounded parsing (nesting, size), version-1 files, the lookup from a root
// or a step folder, retention and the removal of interrupted saves.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/logging.h"
#include "core/numerics.h"
#include "engine/checkpoint/code_tables.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/retention.h"
#include "engine/config.h"
#include "nvme/crc64.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
using core::StatusCode;

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// A manifest as a small run saves it (the resolved default config included).
CheckpointManifest sample_manifest() {
  CheckpointManifest m;
  m.step = 8;
  m.skipped_steps = 1;
  m.lr_override = -1.0;
  m.loss_scaler = {.scale = 1.0, .iteration = 9, .last_overflow_iteration = 3, .hysteresis_left = 2};
  m.compute_dtype = "BF16";
  m.params = {{.name = "l1.w", .shape = {64, 32}, .group = "l1", .trainable = true, .optimizer_group = 0},
              {.name = "l1.b", .shape = {64}, .group = "l1", .trainable = false, .optimizer_group = 1}};
  m.state_crc64 = 0x0123456789abcdefull;
  m.framework_crc64 = 42;
  m.config_json = to_json(Config{});
  return m;
}

// `text` with its checksum line recomputed (a manifest edited on purpose).
std::string rechecksum(std::string text) {
  const std::size_t at = text.rfind(",\n  \"manifest_crc64\": \"");
  EXPECT_NE(at, std::string::npos);
  const std::uint64_t crc = nvme::crc64(0, bytes_of(text.substr(0, at)));
  text.replace(at + 23, 16, crc64_hex(crc));
  return text;
}

std::string replace_once(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

// sample_manifest as two ranks save it: l1.w cut between them, frozen l1.b whole in rank 1's file.
CheckpointManifest ranked_manifest() {
  CheckpointManifest m = sample_manifest();
  m.version = kCheckpointFormatRanks;
  m.state_crc64 = 0;
  m.ranks = 2;
  m.shards = {{.file = "state-rank-0-of-2.safetensors", .crc64 = 7, .ranges = {{0, 0, 1024}}},
              {.file = "state-rank-1-of-2.safetensors", .crc64 = 9, .ranges = {{0, 1024, 2048}, {1, 0, 64}}}};
  return m;
}

TEST(CheckpointManifest, SeveralRanksWriteVersionThreeWithTheirFilesAndRanges) {
  const CheckpointManifest m = ranked_manifest();
  const std::string text = format_checkpoint_manifest(m);
  EXPECT_NE(text.find("\"version\": 3"), std::string::npos) << text;
  EXPECT_EQ(text.find("\"state.safetensors\""), std::string::npos) << text;
  auto parsed = parse_checkpoint_manifest(bytes_of(text), "/x/manifest.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  CheckpointManifest want = m;
  want.config_json = parsed->config_json;
  EXPECT_EQ(*parsed, want);
  const std::vector<CheckpointStateFile> files = checkpoint_state_files(*parsed);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[1].file, checkpoint_shard_file(1, 2));
  // One rank: a single state.safetensors holding every parameter whole.
  const std::vector<CheckpointStateFile> one = checkpoint_state_files(sample_manifest());
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].file, "state.safetensors");
  EXPECT_TRUE(one[0].whole);
  EXPECT_FALSE(files[0].whole);
}

// Each rank's framework blob (its RNG states, its data position): rank 0's
// is framework.bin, the others' are named by rank in "files"; a checkpoint
// saved before they were kept has framework.bin alone, and every rank loads it.
TEST(CheckpointManifest, EachRanksFrameworkBlobIsNamedWithItsChecksum) {
  CheckpointManifest m = ranked_manifest();
  m.framework_crc64 = 11;
  m.rank_framework_crc64 = {11, 13};
  const std::string text = format_checkpoint_manifest(m);
  EXPECT_NE(text.find("\"framework-rank-1-of-2.bin\": 13"), std::string::npos) << text;
  auto parsed = parse_checkpoint_manifest(bytes_of(text), "/x/manifest.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rank_framework_crc64, m.rank_framework_crc64);
  const auto files = checkpoint_framework_files(*parsed);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], (std::pair<std::string, std::uint64_t>{"framework.bin", 11}));
  EXPECT_EQ(files[1], (std::pair<std::string, std::uint64_t>{"framework-rank-1-of-2.bin", 13}));
  // As many ranks: each its own; another count, or one rank: rank 0's.
  EXPECT_EQ(checkpoint_framework_file_for(*parsed, 1, 2).first, "framework-rank-1-of-2.bin");
  EXPECT_EQ(checkpoint_framework_file_for(*parsed, 0, 2).first, "framework.bin");
  EXPECT_EQ(checkpoint_framework_file_for(*parsed, 1, 3).first, "framework.bin");
  EXPECT_EQ(checkpoint_framework_file_for(*parsed, 0, 1).second, 11u);
  // Saved before the ranks' blobs were kept: framework.bin for every rank.
  m.rank_framework_crc64.clear();
  auto older = parse_checkpoint_manifest(bytes_of(format_checkpoint_manifest(m)), "/x/manifest.json");
  ASSERT_TRUE(older.ok()) << older.status();
  EXPECT_TRUE(older->rank_framework_crc64.empty());
  EXPECT_EQ(checkpoint_framework_file_for(*older, 1, 2).first, "framework.bin");
}

TEST(CheckpointManifest, ShardsThatDoNotCoverEveryElementOnceAreDamage) {
  // Each edit keeps the checksum right: the parser's own checks refuse it, naming the fault.
  const std::string good = format_checkpoint_manifest(ranked_manifest());
  const std::pair<std::string, std::string> edits[][1] = {
      {{"[\n          0,\n          1024,\n          2048\n        ]", "[\n          0,\n          1030,\n          2048\n        ]"}},
      {{"[\n          0,\n          0,\n          1024\n        ]", "[\n          0,\n          0,\n          1030\n        ]"}},
      {{"[\n          1,\n          0,\n          64\n        ]", "[\n          1,\n          0,\n          63\n        ]"}},
      {{"[\n          1,\n          0,\n          64\n        ]", "[\n          5,\n          0,\n          64\n        ]"}},
      {{"\"file\": \"state-rank-1-of-2.safetensors\"", "\"file\": \"../state-rank-1-of-2.safetensors\""}},
      {{"\"ranks\": 2", "\"ranks\": 1"}},
      {{"\"state-rank-0-of-2.safetensors\": 7", "\"other\": 7"}},
  };
  const char* want[] = {"leave a gap", "overlap", "end at element 63", "parameter #5", "is not state-rank-1-of-2",
                        "ranks 1 is outside", "files.state-rank-0-of-2.safetensors is missing"};
  for (std::size_t i = 0; i < std::size(edits); ++i) {
    const std::string text = rechecksum(replace_once(good, edits[i][0].first, edits[i][0].second));
    auto r = parse_checkpoint_manifest(bytes_of(text), "m.json");
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << i << ": " << r.status();
    EXPECT_NE(r.status().message().find(want[i]), std::string::npos) << i << ": " << r.status();
    EXPECT_NE(r.status().message().find("m.json"), std::string::npos) << r.status();
  }
}

TEST(CheckpointManifest, RoundTripsAndEndsWithItsChecksum) {
  const CheckpointManifest m = sample_manifest();
  const std::string text = format_checkpoint_manifest(m);
  EXPECT_TRUE(text.ends_with("\"\n}\n")) << text;
  EXPECT_NE(text.find("\"version\": 2"), std::string::npos);
  auto parsed = parse_checkpoint_manifest(bytes_of(text), "/x/manifest.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  CheckpointManifest want = m;
  want.config_json = parsed->config_json;  // compact, as parsed
  EXPECT_EQ(*parsed, want);
  EXPECT_NE(parsed->config_json.find("\"zero_optimization\""), std::string::npos);
}

// The report: "step": 8 -> 9 and lr_override -1.0 -> -0.0 loaded
// silently. Every bit of the file, flipped alone, is DATA_LOSS naming it.
TEST(CheckpointManifest, EveryFlippedBitIsDataLossNamingTheFile) {
  const std::string text = format_checkpoint_manifest(sample_manifest());
  const std::string path = "/ckpt/step-8/manifest.json";
  const std::string step9 = replace_once(text, "\"step\": 8", "\"step\": 9");
  const std::string neg_zero = replace_once(text, "\"lr_override\": -1.0", "\"lr_override\": -0.0");
  for (const std::string* edited : {&step9, &neg_zero}) {
    auto r = parse_checkpoint_manifest(bytes_of(*edited), path);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find("CRC64 mismatch"), std::string::npos) << r.status();
  }
  std::string flipped = text;
  for (std::size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      flipped[i] = static_cast<char>(text[i] ^ (1 << bit));
      auto r = parse_checkpoint_manifest(bytes_of(flipped), path);
      ASSERT_FALSE(r.ok()) << "byte " << i << " bit " << bit;
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss)
          << "byte " << i << " bit " << bit << ": " << r.status();
      ASSERT_EQ(r.status().message().rfind(path + ": ", 0), 0u) << r.status();
    }
    flipped[i] = text[i];
  }
  // Cut anywhere: also DATA_LOSS.
  for (std::size_t n = 0; n < text.size(); n += 7) {
    auto r = parse_checkpoint_manifest(bytes_of(text.substr(0, n)), path);
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << n;
  }
}

TEST(CheckpointManifest, VersionsOneAndNewer) {
  // Version 1: no checksum line; parsed as version 1.
  std::string v1 = format_checkpoint_manifest(sample_manifest());
  v1 = v1.substr(0, v1.rfind(",\n  \"manifest_crc64\"")) + "\n}\n";
  v1 = replace_once(v1, "\"version\": 2", "\"version\": 1");
  auto r = parse_checkpoint_manifest(bytes_of(v1), "m.json");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 1);
  EXPECT_EQ(r->step, 8);
  // Version 2 without its checksum line: damaged.
  const std::string v2_bare = replace_once(v1, "\"version\": 1", "\"version\": 2");
  r = parse_checkpoint_manifest(bytes_of(v2_bare), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("manifest_crc64"), std::string::npos) << r.status();
  // A newer version is refused, both versions named.
  const std::string v5 = rechecksum(
      replace_once(format_checkpoint_manifest(sample_manifest()), "\"version\": 2", "\"version\": 5"));
  r = parse_checkpoint_manifest(bytes_of(v5), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("version 5; this build reads versions 1 to 4"), std::string::npos)
      << r.status();
}

// A frozen base read from its files (a LoRA run's) is left out of the state
// files: version 4 names each such group with its files and CRC64, for one
// rank and for several (whose ranges then leave its frozen parameters out).
TEST(CheckpointManifest, AFrozenBaseLeftOutIsVersionFourNamingItsGroupsFilesAndChecksum) {
  for (const bool ranked : {false, true}) {
    SCOPED_TRACE(ranked ? "two ranks" : "one rank");
    CheckpointManifest m = ranked ? ranked_manifest() : sample_manifest();
    if (ranked) m.shards[1].ranges = {{0, 1024, 2048}};  // l1.b (frozen) is in no file
    m.version = kCheckpointFormatVersion;
    m.frozen_base = {{.group = "l1", .crc64 = 0xfeedull, .files = {"/base/model-1.safetensors", "/base/model-2.safetensors"}}};
    EXPECT_FALSE(m.compute_in_base(0));  // l1.w trains
    EXPECT_TRUE(m.compute_in_base(1));
    const std::string text = format_checkpoint_manifest(m);
    EXPECT_NE(text.find("\"version\": 4"), std::string::npos) << text;
    EXPECT_NE(text.find("\"frozen_base\""), std::string::npos) << text;
    auto parsed = parse_checkpoint_manifest(bytes_of(text), "/x/manifest.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    CheckpointManifest want = m;
    want.config_json = parsed->config_json;
    EXPECT_EQ(*parsed, want);
    EXPECT_EQ(checkpoint_state_files(*parsed).size(), ranked ? 2u : 1u);
    // Each edit keeps the checksum right: the parser's own checks refuse it, naming the fault.
    const std::pair<std::string, std::string> edits[] = {
        {"\"group\": \"l1\",\n      \"crc64\"", "\"group\": \"l9\",\n      \"crc64\""},
        {"\"frozen_base\": [", "\"frozen_base\": [{\"group\": \"l1\", \"crc64\": 1, \"files\": []}, "},
        {"\"crc64\": 65261", "\"crc64\": \"feed\""},
        {"\"frozen_base\"", "\"frozen_based\""},
    };
    const char* why[] = {"group \"l9\" has no frozen parameter", "group \"l1\" is named twice",
                         "frozen_base[0].crc64", "frozen_base is missing"};
    for (std::size_t i = 0; i < std::size(edits); ++i) {
      const std::string bad = rechecksum(replace_once(text, edits[i].first, edits[i].second));
      auto r = parse_checkpoint_manifest(bytes_of(bad), "m.json");
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << i << ": " << r.status();
      EXPECT_NE(r.status().message().find(why[i]), std::string::npos) << i << ": " << r.status();
    }
    if (ranked) {
      // A range of a parameter left out is damage.
      const std::string bad = rechecksum(replace_once(
          text, "[\n          0,\n          1024,\n          2048\n        ]",
          "[\n          0,\n          1024,\n          2048\n        ],\n        [\n          1,\n          0,\n          64\n        ]"));
      auto r = parse_checkpoint_manifest(bytes_of(bad), "m.json");
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
      EXPECT_NE(r.status().message().find("frozen_base says no state file holds"), std::string::npos) << r.status();
    }
  }
}

TEST(CheckpointManifest, ParsingIsBounded) {
  const std::string text = format_checkpoint_manifest(sample_manifest());
  // Nested 100,000 levels deep (checksum valid): refused at level 64, no recursion.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  auto r = parse_checkpoint_manifest(
      bytes_of(rechecksum(replace_once(text, "\"skipped_steps\": 1", "\"skipped_steps\": " + deep))),
      "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("nested deeper than 64"), std::string::npos) << r.status();
  // The same without a checksum (as a version-1 file would be).
  r = parse_checkpoint_manifest(bytes_of("{\"format\": " + deep + "}"), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("nested deeper than 64"), std::string::npos) << r.status();
  // A huge string in a field of the wrong type: the message stays short.
  const std::string big(1 << 20, 'x');
  r = parse_checkpoint_manifest(bytes_of(rechecksum(replace_once(text, "\"compute_dtype\": \"BF16\"",
                                                                 "\"compute_dtype\": \"" + big + "\""))),
                                "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_LT(r.status().message().size(), 400u);
  // 1,000,000 objects in an array (checksum valid): parsed in linear time
  // (nlohmann's callback parser is quadratic there), then refused for its shape.
  std::string objects = "[";
  for (int i = 0; i < 1000000; ++i) objects += i == 0 ? "{}" : ",{}";
  objects += "]";
  r = parse_checkpoint_manifest(
      bytes_of(rechecksum(replace_once(text, "\"skipped_steps\": 1", "\"skipped_steps\": " + objects))), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("skipped_steps is not an integer"), std::string::npos) << r.status();
  // An unterminated huge string: the parser's message is cut too.
  r = parse_checkpoint_manifest(bytes_of("{\"format\": \"" + big), "m.json");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_LT(r.status().message().size(), 400u);
}

TEST(LatestPointer, EveryFlippedBitIsDataLossNamingTheFile) {
  const std::string text = format_latest_pointer("step-12");
  EXPECT_EQ(text.size(), std::string("step-12 ").size() + 16 + 1);
  auto p = parse_latest_pointer(bytes_of(text), "/r/latest");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->step_dir_name, "step-12");
  EXPECT_TRUE(p->checksummed);
  std::string flipped = text;
  for (std::size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      flipped[i] = static_cast<char>(text[i] ^ (1 << bit));
      auto r = parse_latest_pointer(bytes_of(flipped), "/r/latest");
      // A flip that leaves the version-1 form ("step-<N>\n") is caught by
      // locate_checkpoint (CheckpointLocate below); none does here.
      ASSERT_FALSE(r.ok()) << "byte " << i << " bit " << bit << ": " << flipped;
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
      ASSERT_EQ(r.status().message().rfind("/r/latest: ", 0), 0u) << r.status();
    }
    flipped[i] = text[i];
  }
  // Version 1.
  p = parse_latest_pointer(bytes_of(std::string("step-7\n")), "/r/latest");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->checksummed);
  for (const char* bad : {"", "step-7", "../step-7\n", "step-\n", "step-7 \n", "step-x\n"}) {
    EXPECT_EQ(parse_latest_pointer(bytes_of(std::string(bad)), "/r/latest").status().code(),
              StatusCode::kDataLoss)
        << bad;
  }
}

// A manifest edited by hand with its checksum recomputed still cannot carry a
// value no save writes: DATA_LOSS naming the file, the field and the value.
TEST(CheckpointManifest, ImpossibleValuesAreDataLossNamingTheFieldAndTheFile) {
  const std::string text = format_checkpoint_manifest(sample_manifest());
  const std::string path = "/ck/step-8/manifest.json";
  const struct {
    const char* from;
    const char* to;
    const char* field;
  } cases[] = {
      {"\"step\": 8", "\"step\": -7", "step -7"},
      {"\"skipped_steps\": 1", "\"skipped_steps\": -1", "skipped_steps -1"},
      {"\"lr_override\": -1.0", "\"lr_override\": -2.0", "lr_override -2"},
      {"\"lr_override\": -1.0", "\"lr_override\": -0.5", "lr_override -0.5"},
      {"\"scale\": 1.0", "\"scale\": 0.0", "loss_scaler.scale 0"},
      {"\"scale\": 1.0", "\"scale\": -4.0", "loss_scaler.scale -4"},
      {"\"iteration\": 9", "\"iteration\": -1", "loss_scaler.iteration -1"},
      {"\"last_overflow_iteration\": 3", "\"last_overflow_iteration\": -2", "loss_scaler.last_overflow_iteration -2"},
      {"\"last_overflow_iteration\": 3", "\"last_overflow_iteration\": 9", "loss_scaler.last_overflow_iteration 9"},
      {"\"hysteresis_left\": 2", "\"hysteresis_left\": 0", "loss_scaler.hysteresis_left 0"},
      {"\"optimizer_group\": 1", "\"optimizer_group\": -3", "params[1].optimizer_group -3"},
      {"\"compute_dtype\": \"BF16\"", "\"compute_dtype\": \"F8\"", "compute_dtype \"F8\""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.to);
    auto r = parse_checkpoint_manifest(bytes_of(rechecksum(replace_once(text, c.from, c.to))), path);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
    EXPECT_EQ(r.status().message().rfind(path + ": damaged: ", 0), 0u) << r.status();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
  }
  // The values a save writes: no override, a rate of 0, no overflow yet.
  for (const auto& [from, to] : {std::pair{"\"lr_override\": -1.0", "\"lr_override\": 0.0"},
                                 std::pair{"\"last_overflow_iteration\": 3", "\"last_overflow_iteration\": -1"}}) {
    auto r = parse_checkpoint_manifest(bytes_of(rechecksum(replace_once(text, from, to))), path);
    EXPECT_TRUE(r.ok()) << r.status();
  }
}

class CheckpointLocate : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("strata_ckfiles_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  std::string root() const { return root_.string(); }
  // A whole checkpoint <root>/step-<step>: its files and a manifest with their CRC64s.
  void write_complete(std::int64_t step) {
    const fs::path dir = root_ / ("step-" + std::to_string(step));
    const std::string state = "state of step " + std::to_string(step);
    const std::string framework = "loader at " + std::to_string(step);
    write(dir / "state.safetensors", state);
    write(dir / "framework.bin", framework);
    CheckpointManifest m = sample_manifest();
    m.step = step;
    m.state_crc64 = nvme::crc64(0, bytes_of(state));
    m.framework_crc64 = nvme::crc64(0, bytes_of(framework));
    write(dir / "manifest.json", format_checkpoint_manifest(m));
  }
  fs::path root_;
};

TEST_F(CheckpointLocate, FollowsLatestOrReadsAStepFolder) {
  const std::string manifest = format_checkpoint_manifest(sample_manifest());
  write(root_ / "step-8" / "manifest.json", manifest);
  write(root_ / "latest", format_latest_pointer("step-8"));
  auto loc = locate_checkpoint(root() + "/");
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->dir, root() + "/step-8");
  EXPECT_EQ(loc->latest_path, root() + "/latest");
  EXPECT_EQ(loc->manifest.step, 8);
  loc = locate_checkpoint(root() + "/step-8");
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->latest_path, "");
  EXPECT_EQ(locate_checkpoint(root() + "/nothing").status().code(), StatusCode::kNotFound);

  // Every bit of latest flipped on disk: DATA_LOSS naming latest.
  const std::string latest = format_latest_pointer("step-8");
  for (std::size_t i = 0; i < latest.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = latest;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      write(root_ / "latest", flipped);
      auto r = locate_checkpoint(root());
      ASSERT_FALSE(r.ok()) << flipped;
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
      ASSERT_EQ(r.status().message().rfind(root() + "/latest: ", 0), 0u) << r.status();
    }
  }
  // A version-1 pointer to a version-2 checkpoint: damaged. To a missing folder: damaged.
  write(root_ / "latest", "step-8\n");
  EXPECT_EQ(locate_checkpoint(root()).status().code(), StatusCode::kDataLoss);
  write(root_ / "latest", format_latest_pointer("step-9"));
  auto r = locate_checkpoint(root());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("step-9/manifest.json does not exist"), std::string::npos)
      << r.status();
}

TEST_F(CheckpointLocate, VersionOneLoadsWithAWarning) {
  std::string v1 = format_checkpoint_manifest(sample_manifest());
  v1 = v1.substr(0, v1.rfind(",\n  \"manifest_crc64\"")) + "\n}\n";
  v1.replace(v1.find("\"version\": 2"), 12, "\"version\": 1");
  write(root_ / "step-8" / "manifest.json", v1);
  write(root_ / "latest", "step-8\n");
  std::vector<std::string> warnings;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kWarn) warnings.emplace_back(message);
  });
  auto loc = locate_checkpoint(root());
  core::set_log_sink({});
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->manifest.version, 1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("version-1 checkpoint"), std::string::npos) << warnings[0];
}

TEST_F(CheckpointLocate, OversizedFilesAreRefusedBeforeTheyAreRead) {
  fs::create_directories(root_ / "step-1");
  { std::ofstream(root_ / "step-1" / "manifest.json") << "{"; }
  fs::resize_file(root_ / "step-1" / "manifest.json", kMaxCheckpointManifestBytes + 1);  // sparse
  auto r = locate_checkpoint(root() + "/step-1");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("manifest.json"), std::string::npos) << r.status();
  write(root_ / "latest", std::string(100000, 's'));
  r = locate_checkpoint(root());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("latest"), std::string::npos) << r.status();
}

TEST(Retention, KeepsTheNewestAndEveryMthAndLatest) {
  const std::vector<std::int64_t> steps = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(checkpoints_to_remove(steps, 9, {.keep_last = 0, .keep_every = 4}), std::vector<std::int64_t>{});
  EXPECT_EQ(checkpoints_to_remove(steps, 9, {.keep_last = 2}),
            (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(checkpoints_to_remove(steps, 9, {.keep_last = 2, .keep_every = 4}),
            (std::vector<std::int64_t>{1, 2, 3, 5, 6, 7}));
  // A run resumed from step 5 saved step 6 (latest) while 8 and 9 exist: 6 stays.
  EXPECT_EQ(checkpoints_to_remove(std::vector<std::int64_t>{4, 5, 6, 8, 9}, 6, {.keep_last = 1}),
            (std::vector<std::int64_t>{4, 5, 8}));
  EXPECT_EQ(checkpoints_to_remove(steps, 9, {.keep_last = 20}), std::vector<std::int64_t>{});
}

TEST_F(CheckpointLocate, RetentionAndInterruptedSavesOnDisk) {
  for (int s : {2, 4, 6, 8, 10}) write(root_ / ("step-" + std::to_string(s)) / "manifest.json", "x");
  write(root_ / ".step-12.tmp" / "state.safetensors", std::string(1000, 'x'));
  write(root_ / ".step-x.tmp" / "f", "not ours");
  write(root_ / "notes.txt", "not ours");
  std::vector<std::string> infos;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kInfo) infos.emplace_back(message);
  });
  auto tmp = remove_interrupted_saves(root());
  auto kept = apply_retention(root(), 10, {.keep_last = 2, .keep_every = 4});
  core::set_log_sink({});
  ASSERT_TRUE(tmp.ok()) << tmp.status();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*tmp, std::vector<std::string>{root() + "/.step-12.tmp"});
  EXPECT_EQ(*kept, (std::vector<std::string>{root() + "/step-2", root() + "/step-6"}));
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(root_)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{".step-x.tmp", "notes.txt", "step-10", "step-4", "step-8"}));
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_NE(infos[0].find(".step-12.tmp"), std::string::npos) << infos[0];
  EXPECT_NE(infos[0].find("interrupted"), std::string::npos) << infos[0];
  EXPECT_NE(infos[1].find("step-2"), std::string::npos) << infos[1];
}

// Without latest (a save killed before it wrote the first one) the newest
// complete step-<N> folder is loaded, with a warning naming it; a damaged one
// is passed over; none complete is NOT_FOUND naming the root. A latest that
// names an older folder is still followed (it is the commit point), with a
// warning naming the newer one; one that names a damaged folder is DATA_LOSS.
TEST_F(CheckpointLocate, WithoutLatestTheNewestCompleteFolderLoads) {
  write_complete(2);
  write_complete(4);
  write(root_ / ".step-6.tmp" / "manifest.json", "partial");
  std::vector<std::string> warnings;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kWarn) warnings.emplace_back(message);
  });
  auto loc = locate_checkpoint(root());
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->dir, root() + "/step-4");
  EXPECT_EQ(loc->latest_path, "");
  EXPECT_EQ(loc->manifest.step, 4);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(root() + "/latest is missing"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("loading " + root() + "/step-4"), std::string::npos) << warnings[0];

  // latest names step-2: followed, and step-4 named.
  warnings.clear();
  write(root_ / "latest", format_latest_pointer("step-2"));
  loc = locate_checkpoint(root());
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->dir, root() + "/step-2");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(root() + "/step-4 is newer"), std::string::npos) << warnings[0];
  // latest names the newest: no warning, as before.
  warnings.clear();
  write(root_ / "latest", format_latest_pointer("step-4"));
  ASSERT_TRUE(locate_checkpoint(root()).ok());
  EXPECT_TRUE(warnings.empty());
  fs::remove(root_ / "latest");

  // step-4's framework file damaged: step-2, and the warning says why step-4 was passed over.
  write(root_ / "step-4" / "framework.bin", "loader at 5");
  warnings.clear();
  loc = locate_checkpoint(root());
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->dir, root() + "/step-2");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step-4/framework.bin: CRC64 mismatch"), std::string::npos) << warnings[0];

  // latest naming the damaged step-4 is not passed over: the load's check finds it.
  write(root_ / "step-4" / "manifest.json", "damaged");
  write(root_ / "latest", format_latest_pointer("step-4"));
  EXPECT_EQ(locate_checkpoint(root()).status().code(), StatusCode::kDataLoss);
  fs::remove(root_ / "latest");

  // Nothing complete: NOT_FOUND naming the root and each folder's fault.
  fs::remove(root_ / "step-2" / "state.safetensors");
  warnings.clear();
  auto r = locate_checkpoint(root());
  core::set_log_sink({});
  EXPECT_TRUE(warnings.empty());
  ASSERT_EQ(r.status().code(), StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("no complete checkpoint at " + root()), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("step-2: "), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("step-4: "), std::string::npos) << r.status();
}

// --- 8-bit moments: code tables, codes and scales ---------------------------

class CodeTables : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata_codes_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A state file with 300 exp_avg codes and their 2 scales, and the code
  // tables unless `tables` is false; `m_table` replaces exp_avg's.
  std::string write(std::vector<std::uint8_t> codes, std::vector<float> scales, bool tables = true,
                    const float* m_table = core::numerics::kQuantTables.m_values) {
    const std::string path = (dir_ / "state.safetensors").string();
    std::vector<SafetensorsWriter::Declared> d = {
        {"w.exp_avg", TensorDtype::kU8, {static_cast<std::int64_t>(codes.size())}},
        {"w.exp_avg.absmax", TensorDtype::kF32, {static_cast<std::int64_t>(scales.size())}}};
    if (tables) {
      d.push_back({std::string(kCodeTableM), TensorDtype::kF32, {128}});
      d.push_back({std::string(kCodeTableV), TensorDtype::kF32, {256}});
    }
    auto w = SafetensorsWriter::create(path, d);
    EXPECT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->write_raw("w.exp_avg", std::as_bytes(std::span<const std::uint8_t>(codes))).ok());
    EXPECT_TRUE(w->write_f32("w.exp_avg.absmax", scales).ok());
    if (tables) {
      EXPECT_TRUE(w->write_f32(kCodeTableM, std::span<const float>(m_table, 128)).ok());
      EXPECT_TRUE(w->write_f32(kCodeTableV, core::numerics::kQuantTables.v_values).ok());
    }
    EXPECT_TRUE(w->finish().ok());
    return path;
  }
  core::Status verify(const std::string& path) {
    auto r = SafetensorsReader::open(path);
    if (!r.ok()) return r.status();
    return verify_codes(*r);
  }
  fs::path dir_;
};

TEST_F(CodeTables, GoodCodesAndScalesPassAndEachFlawIsNamed) {
  std::vector<std::uint8_t> codes(300, 0x7f);
  codes[5] = 0x81;
  EXPECT_TRUE(verify(write(codes, {1.0f, std::numeric_limits<float>::quiet_NaN()})).ok());  // NaN: a poisoned block

  codes[299] = 0x80;
  core::Status s = verify(write(codes, {1.0f, 2.0f}));
  EXPECT_EQ(s.code(), core::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("'w.exp_avg' element 299 has code 0x80"), std::string_view::npos) << s;
  codes[299] = 0;

  s = verify(write(codes, {1.0f, -2.0f}));
  EXPECT_EQ(s.code(), core::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("'w.exp_avg.absmax' block 1 has scale -2"), std::string_view::npos) << s;

  s = verify(write(codes, {1.0f}));
  EXPECT_EQ(s.code(), core::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("need 2 F32 scales"), std::string_view::npos) << s;

  s = verify(write(codes, {1.0f, 2.0f}, /*tables=*/false));
  EXPECT_EQ(s.code(), core::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find(std::string(kCodeTableM)), std::string_view::npos) << s;

  float other[128];
  std::memcpy(other, core::numerics::kQuantTables.m_values, sizeof other);
  other[64] = 0.125f;
  s = verify(write(codes, {1.0f, 2.0f}, true, other));
  EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("other code tables"), std::string_view::npos) << s;
}

}  // namespace
}  // namespace strata::engine
