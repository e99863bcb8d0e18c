// safetensors: round trips, files written by hand as other tools write them,
// every kind of corrupt header, atomic writes and sharded export; the
// sequential writer and the reader over the nvme engine's direct files.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "engine/checkpoint/safetensors.h"
#include "nvme/crc64.h"
#include "nvme/direct_file.h"
#include "nvme/io_backend.h"

namespace strata::engine {
namespace {

namespace fs = std::filesystem;
namespace nx = core::numerics;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata_st_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A file as another tool writes it: length, JSON header, data.
  std::string write_by_hand(const std::string& name, const std::string& header, const std::string& data,
                            std::int64_t declared_len = -1) {
    const std::string p = path(name);
    std::ofstream f(p, std::ios::binary);
    const std::uint64_t len = declared_len >= 0 ? static_cast<std::uint64_t>(declared_len) : header.size();
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>(len >> (8 * i)));
    f << header << data;
    return p;
  }

  fs::path dir_;
};

std::string floats_as_bytes(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

TEST_F(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  std::vector<float> a(1000), b(37), c(5);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::sin(static_cast<float>(i)) * 3.0f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) * 0.3f - 4.0f;
  c = {0.0f, -0.0f, 1e-40f, std::numeric_limits<float>::infinity(), 65504.0f};
  auto w = SafetensorsWriter::create(path("m.safetensors"),
                                     {{"layers.0.w", TensorDtype::kF32, {10, 100}},
                                      {"layers.0.b", TensorDtype::kBf16, {37}},
                                      {"norm", TensorDtype::kF16, {5}}},
                                     {{"format", "pt"}, {"step", "20"}});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(w->write_f32("norm", c).ok());  // any order
  ASSERT_TRUE(w->write_f32("layers.0.w", a).ok());
  ASSERT_TRUE(w->write_f32("layers.0.b", b).ok());
  EXPECT_FALSE(fs::exists(path("m.safetensors"))) << "visible before finish()";
  ASSERT_TRUE(w->finish().ok());
  EXPECT_FALSE(fs::exists(path("m.safetensors.tmp")));
  EXPECT_EQ(fs::file_size(path("m.safetensors")), w->file_bytes());

  auto r = SafetensorsReader::open(path("m.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tensors().size(), 3u);
  EXPECT_EQ(r->metadata().at("step"), "20");
  const TensorInfo* t = r->find("layers.0.w");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<std::int64_t>{10, 100}));
  EXPECT_EQ(t->offset % 8, 0u) << "data starts 8-aligned";
  std::vector<float> got(1000);
  ASSERT_TRUE(r->read_f32("layers.0.w", got).ok());
  EXPECT_EQ(got, a);
  got.resize(37);
  ASSERT_TRUE(r->read_f32("layers.0.b", got).ok());
  for (std::size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(got[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(b[i]))) << i;
  }
  got.resize(5);
  ASSERT_TRUE(r->read_f32("norm", got).ok());
  for (std::size_t i = 0; i < c.size(); ++i) {
    EXPECT_EQ(nx::float_bits(got[i]), nx::float_bits(nx::fp16_bits_to_fp32(nx::fp32_to_fp16_bits(c[i])))) << i;
  }
  EXPECT_EQ(r->read_f32("missing", got).code(), core::StatusCode::kNotFound);
  EXPECT_EQ(r->read_f32("norm", std::span<float>(got.data(), 4)).code(), core::StatusCode::kInvalidArgument);
}

TEST_F(Safetensors, ReadsAFileWrittenByAnotherTool) {
  // Tensors out of order in the header, no padding, a scalar (shape []), an empty tensor.
  const std::string header =
      R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
      R"("s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
      R"("e":{"dtype":"BF16","shape":[0,3],"data_offsets":[12,12]}})";
  const std::string p = write_by_hand("x.safetensors", header, floats_as_bytes({7.0f, 1.5f, -2.0f}));
  auto r = SafetensorsReader::open(p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tensors().front().name, "s");  // file order
  float s = 0;
  ASSERT_TRUE(r->read_f32("s", std::span<float>(&s, 1)).ok());
  EXPECT_EQ(s, 7.0f);
  std::vector<float> b(2);
  ASSERT_TRUE(r->read_f32("b", b).ok());
  EXPECT_EQ(b, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(r->find("e")->numel(), 0);
}

TEST_F(Safetensors, CorruptHeadersAreDataLossNamingFileAndTensor) {
  const std::string data = floats_as_bytes({1, 2, 3, 4});
  struct Case {
    std::string header;
    std::int64_t declared_len;
    std::string expect;
    core::StatusCode code = core::StatusCode::kDataLoss;
  };
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 1 << 20,
       "the header length field says 1048576 bytes; the file has 79 bytes"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})", -1, "the header is invalid JSON (byte"},
      {R"([1,2])", -1, "not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[4]}})", -1, "tensor 'a' lacks"},
      {R"({"a":{"dtype":"F32","shape":[5],"data_offsets":[0,20]}})", -1, "outside the 16 data bytes"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", -1, "tensor 'a': 16 bytes do not hold"},
      {R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", -1, "not a count"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       -1, "overlap"},
      {R"({"a":{"dtype":"I8","shape":[16],"data_offsets":[0,16]}})", -1, "dtype I8",
       core::StatusCode::kUnimplemented},
      {R"({"__metadata__":{"k":3}})", -1, "__metadata__.k"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string p = write_by_hand("bad" + std::to_string(i) + ".safetensors", cases[i].header, data,
                                        cases[i].declared_len);
    auto r = SafetensorsReader::open(p);
    ASSERT_FALSE(r.ok()) << cases[i].header;
    EXPECT_EQ(r.status().code(), cases[i].code) << r.status();
    EXPECT_NE(r.status().message().find(cases[i].expect), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(p), std::string::npos) << r.status();
  }
  {
    std::ofstream f(path("tiny.safetensors"), std::ios::binary);
    f << "abc";
  }
  EXPECT_EQ(SafetensorsReader::open(path("tiny.safetensors")).status().code(), core::StatusCode::kDataLoss);
  EXPECT_EQ(SafetensorsReader::open(path("absent.safetensors")).status().code(), core::StatusCode::kNotFound);
}

// No header crashes, recurses deeply, or costs memory beyond a small
// multiple of its size: nesting, the length field (against the file and an
// absolute cap), truncation at every length, names in messages, and a shape
// whose byte count would wrap around.
TEST_F(Safetensors, HeaderParsingIsBounded) {
  const std::string data = floats_as_bytes({1, 2, 3, 4});
  // 100,000 nested arrays: refused at level 64 as soon as seen.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  std::string p = write_by_hand("deep.safetensors", R"({"a":{"dtype":"F32","shape":)" + deep + "}}", data);
  auto r = SafetensorsReader::open(p);
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("nested deeper than 64 levels"), std::string::npos) << r.status();
  // A length field of 2^62: beyond the file, nothing allocated.
  p = write_by_hand("huge.safetensors", "{}", data, std::int64_t{1} << 62);
  r = SafetensorsReader::open(p);
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("says 4611686018427387904 bytes; the file has 26 bytes"),
            std::string::npos)
      << r.status();
  // Within a (sparse) file, but over the absolute cap.
  p = write_by_hand("capped.safetensors", "{}", "",
                    static_cast<std::int64_t>(kMaxSafetensorsHeaderBytes + 1));
  fs::resize_file(p, kMaxSafetensorsHeaderBytes + 64);
  r = SafetensorsReader::open(p);
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("strata reads headers of at most 104857600 bytes"), std::string::npos)
      << r.status();
  // A good file cut at every length: DATA_LOSS each time (parsed from bytes, and a few from disk).
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  p = write_by_hand("good.safetensors", header, data);
  std::ifstream in(p, std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(parse_safetensors_header(std::as_bytes(std::span<const char>(whole)), whole.size(), p).ok());
  for (std::size_t n = 0; n < whole.size(); ++n) {
    const auto head = std::as_bytes(std::span<const char>(whole.data(), n));
    auto h = parse_safetensors_header(head, n, p);
    ASSERT_EQ(h.status().code(), core::StatusCode::kDataLoss) << n << ": " << h.status();
    if (n % 16 == 0) {
      fs::resize_file(p, n);
      EXPECT_EQ(SafetensorsReader::open(p).status().code(), core::StatusCode::kDataLoss) << n;
    }
  }
  // A megabyte-long tensor name with a bad dtype: the message quotes a preview.
  const std::string long_name(1 << 20, 'n');
  p = write_by_hand("longname.safetensors",
                    "{\"" + long_name + R"(":{"dtype":"I8","shape":[16],"data_offsets":[0,16]}})", data);
  r = SafetensorsReader::open(p);
  EXPECT_EQ(r.status().code(), core::StatusCode::kUnimplemented) << r.status().message().size();
  EXPECT_LT(r.status().message().size(), 400u);
  EXPECT_NE(r.status().message().find("nnn..."), std::string::npos);
  // shape [2^62] of F32 in 0 bytes: 2^62 * 4 wraps to 0; refused.
  p = write_by_hand("wrap.safetensors",
                    R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", data);
  r = SafetensorsReader::open(p);
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("overflowing size"), std::string::npos) << r.status();
}

TEST_F(Safetensors, AnUnfinishedWriterLeavesNothingBehind) {
  {
    auto w = SafetensorsWriter::create(path("m.safetensors"), {{"a", TensorDtype::kF32, {4}},
                                                               {"b", TensorDtype::kF32, {2}}});
    ASSERT_TRUE(w.ok());
    const float a[4] = {1, 2, 3, 4};
    ASSERT_TRUE(w->write_f32("a", a).ok());
    const core::Status s = w->finish();
    EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("'b' was never written"), std::string::npos) << s;
    EXPECT_EQ(w->write_f32("zzz", a).code(), core::StatusCode::kNotFound);
    EXPECT_EQ(w->write_f32("a", std::span<const float>(a, 3)).code(), core::StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(fs::exists(path("m.safetensors")));
  EXPECT_FALSE(fs::exists(path("m.safetensors.tmp")));
  EXPECT_EQ(SafetensorsWriter::create(path("d.safetensors"), {{"a", TensorDtype::kF32, {1}},
                                                              {"a", TensorDtype::kF32, {1}}})
                .status()
                .code(),
            core::StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::create(path("no/such/dir/x.safetensors"), {}).status().code(),
            core::StatusCode::kNotFound);
}

// The nvme engine's psync backend: runs everywhere (io_uring and libaio are
// covered by tests/nvme/direct_file_test.cpp).
std::unique_ptr<nvme::IoBackend> psync_backend() {
  nvme::IoBackendOptions o;
  o.kind = nvme::BackendKind::kPsync;
  o.queue_depth = 4;
  auto b = nvme::IoBackend::create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(b).value() : nullptr;
}

// A small ring, so that a tensor spans several buffers.
nvme::DirectFileOptions small_ring() {
  nvme::DirectFileOptions o;
  o.buffer_bytes = 8192;
  o.buffer_count = 3;
  o.request_bytes = 4096;
  return o;
}

std::string file_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST_F(Safetensors, SequentialWriterStreamsTheFileWithItsCrcAndDirectReadsReadIt) {
  auto backend = psync_backend();
  ASSERT_NE(backend, nullptr);
  std::vector<float> a(10000), b(37), c(5);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::sin(static_cast<float>(i)) * 3.0f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) * 0.3f - 4.0f;
  c = {0.0f, -0.0f, 1e-40f, std::numeric_limits<float>::infinity(), 65504.0f};
  std::uint64_t crc = 0;
  {
    auto w = SafetensorsWriter::create_sequential(path("s.safetensors"),
                                                  {{"w", TensorDtype::kF32, {100, 100}},
                                                   {"b", TensorDtype::kBf16, {37}},
                                                   {"n", TensorDtype::kF16, {5}}},
                                                  {{"format", "pt"}}, *backend, small_ring());
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->crc64().status().code(), core::StatusCode::kFailedPrecondition);  // not yet
    // Out of order is refused, naming the tensor expected.
    const core::Status early = w->write_f32("b", b);
    EXPECT_EQ(early.code(), core::StatusCode::kFailedPrecondition) << early;
    EXPECT_NE(early.message().find("expects 'w' next"), std::string::npos) << early;
    ASSERT_TRUE(w->write_f32("w", a).ok());
    EXPECT_EQ(w->write_f32("w", a).code(), core::StatusCode::kFailedPrecondition);  // twice
    EXPECT_EQ(w->write_f32("zzz", a).code(), core::StatusCode::kNotFound);
    ASSERT_TRUE(w->write_f32("b", b).ok());
    EXPECT_EQ(w->write_raw("n", std::as_bytes(std::span<const float>(c))).code(),
              core::StatusCode::kInvalidArgument);  // F16 takes 10 bytes
    ASSERT_TRUE(w->write_f32("n", c).ok());
    EXPECT_FALSE(fs::exists(path("s.safetensors")));
    ASSERT_TRUE(w->finish().ok());
    EXPECT_EQ(fs::file_size(path("s.safetensors")), w->file_bytes());
    auto got = w->crc64();
    ASSERT_TRUE(got.ok()) << got.status();
    crc = *got;
  }
  EXPECT_FALSE(fs::exists(path("s.safetensors.tmp")));
  const std::string bytes = file_bytes(path("s.safetensors"));
  EXPECT_EQ(crc, nvme::crc64(0, std::as_bytes(std::span<const char>(bytes))));

  // The page-cache reader and the direct reader see the same tensors.
  auto plain = SafetensorsReader::open(path("s.safetensors"));
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto file = nvme::DirectFileReader::open(*backend, path("s.safetensors"), small_ring());
  ASSERT_TRUE(file.ok()) << file.status();
  auto direct = SafetensorsReader::open(std::move(file).value());
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(direct->metadata().at("format"), "pt");
  ASSERT_EQ(direct->tensors().size(), 3u);
  for (SafetensorsReader* r : {&*plain, &*direct}) {
    std::vector<float> ga(a.size()), gb(b.size()), gc(c.size());
    ASSERT_TRUE(r->read_f32("w", ga).ok());
    ASSERT_TRUE(r->read_f32("b", gb).ok());
    ASSERT_TRUE(r->read_f32("n", gc).ok());
    EXPECT_EQ(0, std::memcmp(ga.data(), a.data(), a.size() * 4));
    for (std::size_t i = 0; i < b.size(); ++i) EXPECT_EQ(gb[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(b[i])));
    for (std::size_t i = 0; i < c.size(); ++i) EXPECT_EQ(gc[i], nx::fp16_bits_to_fp32(nx::fp32_to_fp16_bits(c[i])));
  }
  // Tensors lie in the file in declared order, back to back.
  EXPECT_EQ(direct->tensors()[0].name, "w");
  EXPECT_EQ(direct->tensors()[1].name, "b");
  EXPECT_EQ(direct->tensors()[2].offset + direct->tensors()[2].nbytes, bytes.size());
}

TEST_F(Safetensors, DirectReaderRejectsCorruptFilesLikeThePreadReader) {
  auto backend = psync_backend();
  ASSERT_NE(backend, nullptr);
  const std::string bad = write_by_hand("bad.safetensors", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,20]}})",
                                        std::string(16, '\0'));
  auto file = nvme::DirectFileReader::open(*backend, bad, small_ring());
  ASSERT_TRUE(file.ok()) << file.status();
  auto r = SafetensorsReader::open(std::move(file).value());
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status();
  {
    std::ofstream f(path("tiny.safetensors"), std::ios::binary);
    f << "abc";
  }
  auto tiny = nvme::DirectFileReader::open(*backend, path("tiny.safetensors"), small_ring());
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(SafetensorsReader::open(std::move(tiny).value()).status().code(), core::StatusCode::kDataLoss);
}

TEST_F(Safetensors, AnUnfinishedSequentialWriterLeavesNothingBehind) {
  auto backend = psync_backend();
  ASSERT_NE(backend, nullptr);
  {
    auto w = SafetensorsWriter::create_sequential(path("m.safetensors"),
                                                  {{"a", TensorDtype::kF32, {4}}, {"b", TensorDtype::kF32, {2}}}, {},
                                                  *backend, small_ring());
    ASSERT_TRUE(w.ok()) << w.status();
    const float a[4] = {1, 2, 3, 4};
    ASSERT_TRUE(w->write_f32("a", a).ok());
    const core::Status s = w->finish();
    EXPECT_EQ(s.code(), core::StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("'b' was never written"), std::string::npos) << s;
    EXPECT_TRUE(fs::exists(path("m.safetensors.tmp")));
  }
  EXPECT_FALSE(fs::exists(path("m.safetensors")));
  EXPECT_FALSE(fs::exists(path("m.safetensors.tmp")));
}

TEST_F(Safetensors, ShardPlanAndIndex) {
  const std::vector<std::uint64_t> sizes = {40, 50, 20, 200, 10, 10};
  const auto shards = plan_shards(sizes, 100);
  ASSERT_EQ(shards.size(), 4u);
  EXPECT_EQ(shards[0], (std::vector<std::size_t>{0, 1}));  // 90
  EXPECT_EQ(shards[1], (std::vector<std::size_t>{2}));     // 20 + 200 > 100
  EXPECT_EQ(shards[2], (std::vector<std::size_t>{3}));     // larger than a shard: alone
  EXPECT_EQ(shards[3], (std::vector<std::size_t>{4, 5}));
  EXPECT_TRUE(plan_shards({}, 100).empty());
  EXPECT_EQ(shard_file_name(2, 5), "model-00002-of-00005.safetensors");

  ASSERT_TRUE(write_shard_index(dir_.string(), 330, {{"w", shard_file_name(1, 2)}, {"b", shard_file_name(2, 2)}}).ok());
  std::ifstream f(path("model.safetensors.index.json"));
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_NE(text.str().find(R"("total_size": 330)"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find(R"("w": "model-00001-of-00002.safetensors")"), std::string::npos) << text.str();
}

}  // namespace
}  // namespace strata::engine
