// Swap traffic per swap path (the SSD wear figures) through the C++ engine on
// the host device, with everything on nvme striped over two swap paths: each
// step's per-path bytes add up to its nvme_read / nvme_write, and they equal
// what the I/O layer counted on each path's swap file as its completions
// arrived (nvme::IoBackend::traffic, counted independently of the engine's
// accounting, through Engine::swap_traffic and StepStats::nvme_total).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/numerics.h"
#include "engine/config.h"
#include "engine/engine.h"

namespace strata::engine {
namespace {

namespace nx = core::numerics;

// Two groups whose swap blocks are whole 4 KiB sectors (compute copies
// 2 B x elements, chunks 12 B x elements), so that the I/O layer's count,
// which moves the last partial sector of a block whole under O_DIRECT,
// equals the engine's count of the blocks' bytes.
struct Param {
  const char* name;
  std::int64_t rows, cols;
  const char* group;
};
constexpr Param kParams[] = {{"a.w", 256, 512, "a"}, {"b.w", 128, 256, "b"}};

class SwapTraffic : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_swap_traffic_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "p0");
    std::filesystem::create_directories(dir_ / "p1");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Config config(OverlapMode overlap) const {
    Config c;
    c.train_batch_size = 1;
    c.train_micro_batch_size_per_gpu = 1;
    c.precision = Precision::kBf16;
    c.zero.stage = 3;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.optimizer.lr = 1e-3;
    c.strata.device = DeviceKind::kHost;
    c.strata.overlap = overlap;
    c.strata.chunk_bytes = 65536 * 4;  // one norm block per chunk: several chunks per group
    c.strata.io.paths = {(dir_ / "p0").string(), (dir_ / "p1").string()};
    c.strata.io.stripe_bytes = 64 << 10;  // every block larger than this is striped over both
    c.strata.io.backend = IoBackend::kPsync;
    c.strata.cpu_adam.threads = 1;
    return c;
  }

  std::unique_ptr<Engine> make(const Config& c) {
    auto created = Engine::create(c);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return nullptr;
    std::unique_ptr<Engine> e = std::move(created).value();
    for (const Param& p : kParams) {
      const std::uint64_t seed = static_cast<std::uint64_t>(p.rows * 31 + p.cols);
      const core::Status s = e->register_param({p.name, {p.rows, p.cols}, p.group, true, 0},
                                               [seed](std::span<float> out) {
                                                 for (std::size_t i = 0; i < out.size(); ++i) {
                                                   out[i] = static_cast<float>((i * 7 + seed) % 97) / 97.0f - 0.5f;
                                                 }
                                                 return core::Status();
                                               });
      EXPECT_TRUE(s.ok()) << s;
    }
    const core::Status fin = e->finalize();
    EXPECT_TRUE(fin.ok()) << fin;
    return fin.ok() ? std::move(e) : nullptr;
  }

  // One step: every group fetched for the forward and again for the
  // backward, which hands back small gradients (varying with the step).
  core::Result<StepStats> step(Engine& e, int k) {
    for (const Param& p : kParams) {
      STRATA_RETURN_IF_ERROR(e.fetch(p.group).status());
      STRATA_RETURN_IF_ERROR(e.release(p.group));
    }
    STRATA_ASSIGN_OR_RETURN(gpu::Stream stream, e.device().create_stream("framework"));
    for (const Param& p : kParams) {
      STRATA_RETURN_IF_ERROR(e.fetch(p.group).status());
      STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan grads, e.grad_buffer(p.group));
      std::vector<std::uint16_t> host(grads.size_bytes() / 2);
      for (std::size_t i = 0; i < host.size(); ++i) {
        host[i] = nx::fp32_to_bf16_bits(static_cast<float>(static_cast<int>((i + k) % 13) - 6) * 1e-3f);
      }
      STRATA_RETURN_IF_ERROR(e.device().copy_h2d(stream, grads, std::as_bytes(std::span(host))));
      STRATA_RETURN_IF_ERROR(e.device().synchronize(stream));
      STRATA_RETURN_IF_ERROR(e.grads_ready(p.group));
      STRATA_RETURN_IF_ERROR(e.release(p.group));
    }
    return e.step_end();
  }

  std::filesystem::path dir_;
};

std::uint64_t sum_written(const std::vector<SwapPathBytes>& v) {
  std::uint64_t n = 0;
  for (const SwapPathBytes& p : v) n += p.written;
  return n;
}
std::uint64_t sum_read(const std::vector<SwapPathBytes>& v) {
  std::uint64_t n = 0;
  for (const SwapPathBytes& p : v) n += p.read;
  return n;
}

// overlap "none": step_end runs the step's optimizer to the end, so between
// two step_ends the swap files see exactly that step's traffic.
TEST_F(SwapTraffic, PerPathBytesAddUpToTheStepAndEqualWhatEachSwapFileWasWritten) {
  const Config c = config(OverlapMode::kNone);
  std::unique_ptr<Engine> e = make(c);
  ASSERT_NE(e, nullptr);
  // The precondition of an exact comparison: every swap block is whole sectors.
  for (const GroupPlace& g : e->layout().groups) {
    ASSERT_EQ(g.compute_elems * e->layout().compute_bytes % 4096, 0) << g.name;
  }
  for (const ChunkPlace& ch : e->layout().chunks) ASSERT_EQ(ch.elems * 12 % 4096, 0);
  EXPECT_EQ(e->swap_paths(), c.strata.io.paths);
  // finalize wrote the swap files' first contents (zeroed moments, initial
  // values): in the totals from the start, in no step's bytes.
  std::vector<SwapPathBytes> before = e->swap_traffic();
  ASSERT_EQ(before.size(), 2u);
  EXPECT_GT(before[0].written, 0u);
  EXPECT_GT(before[1].written, 0u);
  constexpr int kSteps = 4;
  std::uint64_t written = 0;
  for (int k = 0; k < kSteps; ++k) {
    core::Result<StepStats> st = step(*e, k);
    ASSERT_TRUE(st.ok()) << st.status();
    const StepBytes& b = st->bytes;
    ASSERT_EQ(b.nvme_paths.size(), 2u) << "step " << k + 1;
    EXPECT_GT(b.nvme_write, 0u);
    EXPECT_EQ(sum_written(b.nvme_paths), b.nvme_write) << "step " << k + 1;
    EXPECT_EQ(sum_read(b.nvme_paths), b.nvme_read) << "step " << k + 1;
    for (int p = 0; p < 2; ++p) EXPECT_GT(b.nvme_paths[p].written, 0u) << "path " << p << " wrote nothing";
    // The totals are the I/O layer's, now (nothing in flight under "none").
    ASSERT_EQ(st->nvme_total.size(), 2u);
    EXPECT_EQ(st->nvme_total, e->swap_traffic());
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(st->nvme_total[p].written - before[p].written, b.nvme_paths[p].written)
          << "step " << k + 1 << ", path " << p;
      EXPECT_EQ(st->nvme_total[p].read - before[p].read, b.nvme_paths[p].read) << "step " << k + 1 << ", path " << p;
    }
    written += b.nvme_write;
    before = st->nvme_total;
  }
  // Every step writes the same: each group's compute copies and each chunk's
  // optimizer state (12 B per element), once.
  std::uint64_t per_step = 0;
  for (const GroupPlace& g : e->layout().groups) per_step += static_cast<std::uint64_t>(g.compute_elems) * 2;
  for (const ChunkPlace& ch : e->layout().chunks) per_step += static_cast<std::uint64_t>(ch.elems) * 12;
  EXPECT_EQ(written, kSteps * per_step);
}

// The threaded schedule writes the same bytes per path and step (its
// optimizer job is reported by the step_end after it), and the per-path
// split still adds up.
TEST_F(SwapTraffic, OverlappedScheduleSplitsTheSameBytesOverThePaths) {
  std::unique_ptr<Engine> none = make(config(OverlapMode::kNone));
  ASSERT_NE(none, nullptr);
  std::vector<StepStats> want;
  for (int k = 0; k < 3; ++k) {
    core::Result<StepStats> st = step(*none, k);
    ASSERT_TRUE(st.ok()) << st.status();
    want.push_back(*st);
  }
  none.reset();
  std::filesystem::remove_all(dir_ / "p0");
  std::filesystem::remove_all(dir_ / "p1");
  std::filesystem::create_directories(dir_ / "p0");
  std::filesystem::create_directories(dir_ / "p1");
  std::unique_ptr<Engine> exact = make(config(OverlapMode::kExact));
  ASSERT_NE(exact, nullptr);
  for (int k = 0; k < 3; ++k) {
    core::Result<StepStats> st = step(*exact, k);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(sum_written(st->bytes.nvme_paths), st->bytes.nvme_write);
    EXPECT_EQ(sum_read(st->bytes.nvme_paths), st->bytes.nvme_read);
    if (k > 0) {  // "exact"'s step reports the previous step's job, "none"'s its own: the same writes
      // (reads differ: fetches served by copies kept on the device read nothing)
      const std::vector<SwapPathBytes>& w = want[static_cast<std::size_t>(k)].bytes.nvme_paths;
      ASSERT_EQ(st->bytes.nvme_paths.size(), w.size());
      for (std::size_t p = 0; p < w.size(); ++p) EXPECT_EQ(st->bytes.nvme_paths[p].written, w[p].written) << p;
    }
  }
}

}  // namespace
}  // namespace strata::engine
