// Pretrained weights (engine/checkpoint/pretrained.h) and finding a model's files
// (find_safetensors): the layouts Hugging Face writes, indexes that disagree
// with their shards, and the checks against registered parameters.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/checkpoint/pretrained.h"
#include "engine/checkpoint/safetensors.h"
#include "nvme/io_backend.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
using core::StatusCode;

class Pretrained : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_pre_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A safetensors file of F32 tensors {name: values}, each 1-D.
  void write(const std::string& name, const std::vector<std::pair<std::string, std::vector<float>>>& tensors) {
    std::vector<SafetensorsWriter::Declared> declared;
    for (const auto& [n, v] : tensors) declared.push_back({n, TensorDtype::kF32, {static_cast<std::int64_t>(v.size())}});
    auto w = SafetensorsWriter::create(path(name), declared);
    ASSERT_TRUE(w.ok()) << w.status();
    for (const auto& [n, v] : tensors) ASSERT_TRUE(w->write_f32(n, v).ok());
    ASSERT_TRUE(w->finish().ok());
  }
  void write_text(const std::string& name, const std::string& text) { std::ofstream(path(name)) << text; }

  fs::path dir_;
};

ParamDesc param(std::string name, std::vector<std::int64_t> shape) {
  ParamDesc p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.group = p.name;
  return p;
}

TEST_F(Pretrained, FindsOneFileOrTheShardsOfAnIndex) {
  write("model.safetensors", {{"a", {1, 2}}});
  auto single = find_safetensors(dir_.string());
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(single->files, std::vector<std::string>{path("model.safetensors")});
  EXPECT_TRUE(single->index.empty());
  auto file = find_safetensors(path("model.safetensors"));
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->files, std::vector<std::string>{path("model.safetensors")});

  // An index wins over model.safetensors; its shards come sorted, once each.
  write_text("model.safetensors.index.json",
             R"({"metadata": {"total_size": 12}, "weight_map": {"b": "s-2.safetensors", "a": "s-1.safetensors",
                 "c": "s-2.safetensors"}})");
  auto sharded = find_safetensors(dir_.string() + "/");
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ(sharded->index, path("model.safetensors.index.json"));
  EXPECT_EQ(sharded->files, (std::vector<std::string>{path("s-1.safetensors"), path("s-2.safetensors")}));
  EXPECT_EQ(sharded->weight_map.at("c"), path("s-2.safetensors"));
  EXPECT_NE(sharded->describe().find("s-1.safetensors, s-2.safetensors"), std::string::npos) << sharded->describe();
}

TEST_F(Pretrained, MissingOrBadFilesAreNamed) {
  auto none = find_safetensors(dir_.string());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("model.safetensors.index.json"), std::string::npos);
  EXPECT_EQ(find_safetensors(path("absent")).status().code(), StatusCode::kNotFound);
  for (const char* bad : {"[1, 2]", R"({"weight_map": []})", R"({"weight_map": {"a": 3}})",
                          R"({"weight_map": {"a": "../x.safetensors"}})", R"({"weight_map": {}})", "{oops"}) {
    write_text("model.safetensors.index.json", bad);
    auto r = find_safetensors(dir_.string());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << bad;
    EXPECT_NE(r.status().message().find("model.safetensors.index.json"), std::string::npos) << r.status();
  }
}

TEST_F(Pretrained, AnIndexThatDisagreesWithItsShardsIsDataLoss) {
  write("s-1.safetensors", {{"a", {1}}, {"b", {2}}});
  write("s-2.safetensors", {{"c", {3}}});
  // b is in s-1, the index says s-2.
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors", "c": "s-2.safetensors"}})");
  auto r = PretrainedWeights::open(dir_.string(), "");
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("'b'"), std::string::npos) << r.status();
  // The index names a tensor no shard has.
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"a": "s-1.safetensors", "b": "s-1.safetensors", "c": "s-2.safetensors",
                 "d": "s-2.safetensors"}})");
  r = PretrainedWeights::open(dir_.string(), "");
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("'d'"), std::string::npos) << r.status();
  // One tensor in two shards.
  write("s-2.safetensors", {{"c", {3}}, {"a", {4}}});
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"a": "s-1.safetensors", "b": "s-1.safetensors", "c": "s-2.safetensors"}})");
  r = PretrainedWeights::open(dir_.string(), "");
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("both"), std::string::npos) << r.status();
}

TEST_F(Pretrained, ChecksParametersAndStreamsTheirValues) {
  write("s-1.safetensors", {{"m.a", {1, 2}}, {"m.b", {3, 4, 5}}});
  write("s-2.safetensors", {{"m.c", {6}}});
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"m.a": "s-1.safetensors", "m.b": "s-1.safetensors", "m.c": "s-2.safetensors"}})");
  auto w = PretrainedWeights::open(dir_.string(), "m.");
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<ParamDesc> params = {param("a", {2}), param("b", {3}), param("c", {1})};
  for (const ParamDesc& p : params) EXPECT_TRUE(w->check_param(p).ok()) << p.name;
  EXPECT_TRUE(w->check_extra(params).ok());
  const auto missing = w->check_param(param("d", {1}));
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("'m.d'"), std::string::npos) << missing;
  const auto shape = w->check_param(param("b", {1, 3}));
  EXPECT_EQ(shape.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shape.message().find("[3]"), std::string::npos) << shape;
  EXPECT_NE(shape.message().find("[1, 3]"), std::string::npos) << shape;
  EXPECT_NE(shape.message().find(path("s-1.safetensors")), std::string::npos) << shape;
  const auto extra = w->check_extra(std::vector<ParamDesc>{params[0], params[2]});
  EXPECT_EQ(extra.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(extra.message().find("extra tensor 'm.b'"), std::string::npos) << extra;

  auto backend = nvme::IoBackend::create({});
  ASSERT_TRUE(backend.ok()) << backend.status();
  PretrainedWeights::Stream stream(*w, **backend, {});
  stream.plan(0, "a");
  stream.plan(1, "c");
  stream.plan(2, "b");
  std::vector<float> a(2), b(3), c(1);
  ASSERT_TRUE(stream.read(params[0], a).ok());
  stream.end_group(0);
  ASSERT_TRUE(stream.read(params[2], c).ok());
  stream.end_group(1);  // s-2 closes; s-1 stays open for b
  ASSERT_TRUE(stream.read(params[1], b).ok());
  stream.end_group(2);
  EXPECT_EQ(a, (std::vector<float>{1, 2}));
  EXPECT_EQ(b, (std::vector<float>{3, 4, 5}));
  EXPECT_EQ(c, (std::vector<float>{6}));
}

}  // namespace
}  // namespace strata::engine
