// `strata inspect`: a checkpoint written by hand (the format's own writers)
// printed as a table and as JSON, from its root or its step folder; a damaged
// file is exit 1 naming it, no checkpoint is exit 2.
#include "bindings/cli/inspect.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "nvme/crc64.h"

namespace strata::cli {
namespace {

namespace fs = std::filesystem;

class Inspect : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("strata_inspect_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    const fs::path dir = root_ / "step-7";
    fs::create_directories(dir);
    // state.safetensors: one parameter's compute copy and optimizer arrays.
    std::vector<engine::SafetensorsWriter::Declared> declared = {
        {"w.compute", engine::TensorDtype::kBf16, {2, 3}},
        {"w.master", engine::TensorDtype::kF32, {2, 3}},
        {"w.exp_avg", engine::TensorDtype::kF32, {2, 3}},
        {"w.exp_avg_sq", engine::TensorDtype::kF32, {2, 3}}};
    auto w = engine::SafetensorsWriter::create((dir / "state.safetensors").string(), declared,
                                               {{"format", "strata-checkpoint"}});
    ASSERT_TRUE(w.ok()) << w.status();
    const std::vector<float> v = {1, 2, 3, 4, 5, 6};
    for (const auto& d : declared) ASSERT_TRUE(w->write_f32(d.name, v).ok());
    ASSERT_TRUE(w->finish().ok());
    write(dir / "framework.bin", "loader state");
    engine::CheckpointManifest m;
    m.step = 7;
    m.skipped_steps = 2;
    m.lr_override = 0.5;
    m.compute_dtype = "BF16";
    m.params = {{.name = "w", .shape = {2, 3}, .group = "g", .trainable = true, .optimizer_group = 0}};
    m.state_crc64 = crc_of(dir / "state.safetensors");
    m.framework_crc64 = crc_of(dir / "framework.bin");
    m.config_json = R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                        "offload_param": {"device": "cpu"}}, "strata": {"device": "host"}})";
    write(dir / "manifest.json", engine::format_checkpoint_manifest(m));
    write(root_ / "latest", engine::format_latest_pointer("step-7"));
  }
  void TearDown() override { fs::remove_all(root_); }

  static void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
  static std::uint64_t crc_of(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return nvme::crc64(0, std::as_bytes(std::span<const char>(s)));
  }
  int run(const std::string& dir, bool verify, bool json) {
    out_.str("");
    err_.str("");
    return inspect_command(dir, verify, json, out_, err_);
  }

  fs::path root_;
  std::ostringstream out_, err_;
};

TEST_F(Inspect, PrintsATableFromTheRootOrTheStepFolder) {
  for (const std::string& where : {root_.string(), (root_ / "step-7").string()}) {
    ASSERT_EQ(run(where, /*verify=*/true, /*json=*/false), kInspectOk) << err_.str();
    const std::string t = out_.str();
    EXPECT_EQ(err_.str(), "");
    for (const char* want : {"step          7 (2 skipped)", "lr override   0.5", "compute dtype BF16",
                             "zero_optimization.offload_optimizer.device \"nvme\"", "strata.device \"host\"",
                             "parameters    1 (1 trainable)", "framework.bin  12 bytes",
                             "verified      yes", "tensors (4)", "w.exp_avg_sq", "[2, 3]"}) {
      EXPECT_NE(t.find(want), std::string::npos) << want << "\n" << t;
    }
    EXPECT_EQ(t.find("named by") != std::string::npos, where == root_.string()) << t;
  }
  ASSERT_EQ(run(root_.string(), /*verify=*/false, /*json=*/false), kInspectOk) << err_.str();
  EXPECT_NE(out_.str().find("--verify checks every file"), std::string::npos) << out_.str();
}

TEST_F(Inspect, PrintsJson) {
  ASSERT_EQ(run(root_.string(), /*verify=*/true, /*json=*/true), kInspectOk) << err_.str();
  const std::string j = out_.str();
  for (const char* want : {"\"step\": 7", "\"skipped_steps\": 2", "\"verified\": true", "\"format_version\": 2",
                           "\"zero_optimization.offload_param.device\": \"cpu\"", "\"name\": \"w.master\"",
                           "\"dtype\": \"F32\"", "\"bytes\": 24", "\"config\": {"}) {
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  }
  EXPECT_EQ(j.front(), '{');
  EXPECT_EQ(j.substr(j.size() - 2), "}\n");
}

TEST_F(Inspect, DamagedFilesAreExitOneNamingTheFile) {
  const fs::path framework = root_ / "step-7" / "framework.bin";
  write(framework, "loader statf");
  // Without --verify only the manifest and latest are checked.
  EXPECT_EQ(run(root_.string(), /*verify=*/false, /*json=*/false), kInspectOk) << err_.str();
  EXPECT_EQ(run(root_.string(), /*verify=*/true, /*json=*/false), kInspectDamaged);
  EXPECT_EQ(out_.str(), "");
  EXPECT_EQ(err_.str().rfind("strata inspect: " + framework.string() + ": CRC64 mismatch", 0), 0u) << err_.str();
  // A flipped bit in the manifest is found without --verify.
  const fs::path manifest = root_ / "step-7" / "manifest.json";
  std::ifstream in(manifest, std::ios::binary);
  std::string m((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  m[m.find("\"step\": 7") + 8] = '6';
  write(manifest, m);
  EXPECT_EQ(run(root_.string(), /*verify=*/false, /*json=*/true), kInspectDamaged);
  EXPECT_NE(err_.str().find(manifest.string() + ": CRC64 mismatch"), std::string::npos) << err_.str();
}

// A manifest edited by hand with its checksum recomputed: a value no save
// writes is exit 1 naming the file and the field, as the engine's load refuses it.
TEST_F(Inspect, ImpossibleValueIsExitOneNamingTheFileAndTheField) {
  const fs::path manifest = root_ / "step-7" / "manifest.json";
  std::ifstream in(manifest, std::ios::binary);
  std::string m((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  m.replace(m.find("\"step\": 7"), 9, "\"step\": -7");
  const std::size_t at = m.rfind(",\n  \"manifest_crc64\": \"");
  ASSERT_NE(at, std::string::npos);
  m.replace(at + 23, 16, engine::crc64_hex(nvme::crc64(0, std::as_bytes(std::span<const char>(m.data(), at)))));
  write(manifest, m);
  EXPECT_EQ(run(root_.string(), /*verify=*/true, /*json=*/false), kInspectDamaged);
  EXPECT_EQ(out_.str(), "");
  EXPECT_NE(err_.str().find(manifest.string() + ": damaged: step -7 is below 0"), std::string::npos) << err_.str();
}

TEST_F(Inspect, NoCheckpointIsExitTwo) {
  EXPECT_EQ(run((root_ / "absent").string(), /*verify=*/false, /*json=*/false), kInspectBadInput);
  EXPECT_NE(err_.str().find("no checkpoint at"), std::string::npos) << err_.str();
  EXPECT_NE(std::string(inspect_usage()).find("--verify"), std::string::npos);
}

}  // namespace
}  // namespace strata::cli
