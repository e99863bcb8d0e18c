// Checkpoints end to end: resume bit-identically (also under another
// placement), survive a crash at every point inside save (a child process
// killed there), reject corrupt files, go through every I/O backend, and
// export safetensors; every flipped bit in any of a checkpoint's files is
// DATA_LOSS naming the file; version-1 checkpoints load; retention.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/logging.h"
#include "core/str.h"
#include "engine/checkpoint/inspect.h"
#include "engine/checkpoint/manifest.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/io_faults.h"
#include "tests/e2e/mlp_harness.h"

extern char** environ;

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary
namespace fs = std::filesystem;

constexpr int kSaveAt = 10;

Config config_for(const std::string& swap_dir, OffloadDevice optimizer, OffloadDevice param) {
  Config c;
  c.train_batch_size = kBatch;
  c.train_micro_batch_size_per_gpu = kBatch;
  c.precision = Precision::kBf16;
  c.zero.stage = 3;
  c.zero.offload_optimizer.device = optimizer;
  c.zero.offload_param.device = param;
  c.optimizer.lr = 3e-3;
  c.optimizer.weight_decay = 0.01;
  c.gradient_clipping = 1.0;
  c.scheduler.type = SchedulerType::kWarmupLR;  // the schedule must resume too
  c.scheduler.warmup_num_steps = 5;
  c.scheduler.warmup_max_lr = 3e-3;
  put_on_device(c, test_device().kind);
  c.strata.chunk_bytes = 65536 * 4;
  c.strata.io.paths = {swap_dir};
  c.strata.io.backend = IoBackend::kPsync;
  c.strata.cpu_adam.threads = 1;
  return c;
}

std::vector<std::byte> blob_of(const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const DeviceVerdict v = test_device().verdict;
    if (!v.error.empty()) FAIL() << v.error;
    if (!v.skip.empty()) GTEST_SKIP() << v.skip;
    dir_ = fs::temp_directory_path() / ("strata_ckpt_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "swap");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string swap() const { return (dir_ / "swap").string(); }
  std::string ckpt() const { return (dir_ / "ckpt").string(); }

  // Steps [0, kSteps) without interruption: losses and final masters.
  void straight_run(std::vector<double>* losses, std::map<std::string, std::vector<float>>* masters) {
    auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu));
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < kSteps; ++s) losses->push_back(train_one_step(*e, f, s));
    *masters = read_masters(*e);
  }

  // Loads the checkpoint into a fresh engine of `config` and trains on to
  // kSteps; checks the blob, the losses from kSaveAt on and the final masters.
  void resume_and_compare(const Config& config, const std::vector<double>& losses,
                          const std::map<std::string, std::vector<float>>& masters) {
    auto e = make_mlp_engine(config);
    ASSERT_NE(e, nullptr);
    auto blob = e->load_checkpoint(ckpt());
    ASSERT_TRUE(blob.ok()) << blob.status();
    EXPECT_EQ(*blob, blob_of("data loader at batch 10"));
    Framework f;
    for (int s = kSaveAt; s < kSteps; ++s) EXPECT_EQ(train_one_step(*e, f, s), losses[s]) << "step " << s;
    const auto got = read_masters(*e);
    for (const auto& [name, v] : masters) EXPECT_TRUE(bits_equal(got.at(name), v)) << name;
  }

  fs::path dir_;
};

TEST_F(Checkpoint, ResumesBitIdenticallyUnderAnotherPlacement) {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
  straight_run(&losses, &masters);
  {
    auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu));
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < kSaveAt; ++s) train_one_step(*e, f, s);
    // Mid-step saves are refused.
    f.load(*e, "l1");
    ASSERT_TRUE(e->fetch("l2").ok());
    EXPECT_EQ(e->save_checkpoint(ckpt(), blob_of("x")).code(), core::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(e->release("l2").ok());
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("data loader at batch 10")).ok());
  }
  // Same placement, then the optimizer on the device with compute copies on nvme.
  resume_and_compare(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu), losses, masters);
  resume_and_compare(config_for(swap(), OffloadDevice::kNone, OffloadDevice::kNvme), losses, masters);
  // Compute copies on nvme but l2's, which offload_param.max_in_cpu keeps in pinned memory.
  Config split = config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kNvme);
  split.zero.offload_param.max_in_cpu = 16448;
  resume_and_compare(split, losses, masters);
}

// The swap bytes an engine read and wrote since it was created, all paths.
SwapPathBytes swap_bytes(const Engine& e) {
  SwapPathBytes sum;
  for (const SwapPathBytes& p : e.swap_traffic()) {
    sum.read += p.read;
    sum.written += p.written;
  }
  return sum;
}

// Saves at kSaveAt from a run of the reference placement (blob "data loader
// at batch 10").
void save_at(const Config& c, const std::string& root) {
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < kSaveAt; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(root, blob_of("data loader at batch 10")).ok());
}

// finalize_from_checkpoint: no init callback runs, the swap is written once
// (finalize then load_checkpoint writes it twice) and read not at all (a load
// reads nothing of what it replaces whole, either way), and training goes on
// bit for bit as the run that never stopped, under every placement.
TEST_F(Checkpoint, FinalizeFromCheckpointWritesTheStateOnceAndResumesBitIdentically) {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
  straight_run(&losses, &masters);
  save_at(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu), ckpt());
  const std::pair<OffloadDevice, OffloadDevice> placements[] = {{OffloadDevice::kNvme, OffloadDevice::kCpu},
                                                                {OffloadDevice::kNone, OffloadDevice::kNvme},
                                                                {OffloadDevice::kNvme, OffloadDevice::kNvme},
                                                                {OffloadDevice::kCpu, OffloadDevice::kCpu}};
  for (const auto& [optimizer, param] : placements) {
    SCOPED_TRACE(core::str_cat("optimizer ", to_string(optimizer), ", param ", to_string(param)));
    Config c = config_for(swap(), optimizer, param);
    // Read requests, counted (a rule that delays none): the checkpoint's
    // files, which a load into unwritten state reads once (its CRC64s taken
    // as it goes), not first whole and then tensor by tensor.
    FaultInjector plain_io, resume_io;
    const FaultRule count_reads{.kind = FaultKind::kDelay, .ops = FaultOps::kReads, .times = -1};
    const std::size_t plain_reads = plain_io.add(count_reads);
    const std::size_t resume_reads = resume_io.add(count_reads);
    c.strata.io.fault_injector = &plain_io;
    SwapPathBytes twice;
    {
      auto plain = make_mlp_engine(c);
      ASSERT_NE(plain, nullptr);
      const SwapPathBytes finalized = swap_bytes(*plain);
      ASSERT_TRUE(plain->load_checkpoint(ckpt()).ok());
      twice = swap_bytes(*plain);
      EXPECT_EQ(twice.read, 0u);  // the load read nothing it replaces
      EXPECT_EQ(twice.written, 2 * finalized.written);
    }
    std::map<std::string, int> calls;
    c.strata.io.fault_injector = &resume_io;
    auto e = register_mlp(c, {}, {}, "", &calls);
    ASSERT_NE(e, nullptr);
    auto blob = e->finalize_from_checkpoint(ckpt());
    EXPECT_GT(resume_io.hits(resume_reads), 0u);
    EXPECT_LT(resume_io.hits(resume_reads), plain_io.hits(plain_reads));
    ASSERT_TRUE(blob.ok()) << blob.status();
    EXPECT_EQ(*blob, blob_of("data loader at batch 10"));
    EXPECT_TRUE(calls.empty()) << calls.begin()->first;
    const SwapPathBytes once = swap_bytes(*e);
    EXPECT_EQ(once.read, 0u);
    EXPECT_EQ(2 * once.written, twice.written);
    Framework f;
    for (int s = kSaveAt; s < kSteps; ++s) EXPECT_EQ(train_one_step(*e, f, s), losses[s]) << "step " << s;
    const auto got = read_masters(*e);
    for (const auto& [name, v] : masters) EXPECT_TRUE(bits_equal(got.at(name), v)) << name;
  }
}

// A group with a frozen parameter gets its initial values as finalize writes
// them (a checkpoint may leave its base out); the others are the
// checkpoint's alone. Either way the run is the one finalize and
// load_checkpoint give.
TEST_F(Checkpoint, FinalizeFromCheckpointInitializesTheGroupsWithAFrozenParameter) {
  const std::vector<std::string> frozen = {"l1.w"};
  auto read_trainable = [](Engine& e) {
    std::map<std::string, std::vector<float>> out;
    for (const Tensor& t : kTensors) {
      if (t.name == "l1.w") continue;
      std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
      EXPECT_TRUE(e.read_master(t.name, v).ok());
      out[t.name] = std::move(v);
    }
    return out;
  };
  const Config c = config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kNvme);
  {
    auto e = make_mlp_engine(c, {}, frozen);
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < kSaveAt; ++s) train_one_step(*e, f, s);
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("b")).ok());
  }
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
  {
    auto e = make_mlp_engine(c, {}, frozen);
    ASSERT_NE(e, nullptr);
    ASSERT_TRUE(e->load_checkpoint(ckpt()).ok());
    Framework f;
    for (int s = kSaveAt; s < kSteps; ++s) losses.push_back(train_one_step(*e, f, s));
    masters = read_trainable(*e);
  }
  std::map<std::string, int> calls;
  auto e = register_mlp(c, {}, frozen, "", &calls);
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->finalize_from_checkpoint(ckpt()).ok());
  EXPECT_EQ(calls, (std::map<std::string, int>{{"l1.b", 1}, {"l1.w", 1}}));
  Framework f;
  for (int s = kSaveAt; s < kSteps; ++s) EXPECT_EQ(train_one_step(*e, f, s), losses[s - kSaveAt]) << "step " << s;
  const auto got = read_trainable(*e);
  for (const auto& [name, v] : masters) EXPECT_TRUE(bits_equal(got.at(name), v)) << name;
}

// No checkpoint, or another model's: a failed finalize, before anything is
// built (the swap paths free for the next engine). A checkpoint damaged past
// its manifest: the engine is built without values and refuses everything
// but a load, naming why, until one succeeds; then it trains on bit for bit.
TEST_F(Checkpoint, FinalizeFromCheckpointErrorsNameTheCauseAndLoseNothing) {
  const Config c = config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu);
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
  straight_run(&losses, &masters);
  save_at(c, ckpt());
  {
    auto e = register_mlp(c);
    ASSERT_NE(e, nullptr);
    auto r = e->finalize_from_checkpoint((dir_ / "nothing").string());
    EXPECT_EQ(r.status().code(), core::StatusCode::kNotFound) << r.status();
    EXPECT_FALSE(e->finalized());
    auto other = register_mlp(c, {}, {"l2.b"});  // another trainability
    ASSERT_NE(other, nullptr);
    r = other->finalize_from_checkpoint(ckpt());
    EXPECT_EQ(r.status().code(), core::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("'l2.b'"), std::string::npos) << r.status();
    EXPECT_FALSE(other->finalized());
    Config fp32 = c;  // another compute dtype
    fp32.precision = Precision::kFp32;
    auto wide = register_mlp(fp32);
    ASSERT_NE(wide, nullptr);
    r = wide->finalize_from_checkpoint(ckpt());
    EXPECT_EQ(r.status().code(), core::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("compute copies are BF16 in the checkpoint; this engine uses F32"), std::string::npos) << r.status();
    EXPECT_FALSE(wide->finalized());
    EXPECT_EQ(e->finalize().code(), core::StatusCode::kFailedPrecondition);
    auto fresh = make_mlp_engine(c);  // the swap paths are free
    ASSERT_NE(fresh, nullptr);
    EXPECT_EQ(fresh->finalize_from_checkpoint(ckpt()).status().code(), core::StatusCode::kFailedPrecondition);
  }
  const std::string good = (dir_ / "good").string();
  fs::copy(ckpt(), good, fs::copy_options::recursive);
  const std::string state = ckpt() + "/step-10/state.safetensors";
  {
    std::fstream file(state, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(fs::file_size(state) - 100));
    file.put('\x7f');
  }
  auto e = register_mlp(c);
  ASSERT_NE(e, nullptr);
  auto r = e->finalize_from_checkpoint(ckpt());
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("state.safetensors"), std::string::npos) << r.status();
  EXPECT_TRUE(e->finalized());
  const core::Status fetch = e->fetch("l1").status();
  EXPECT_EQ(fetch.code(), core::StatusCode::kFailedPrecondition) << fetch;
  EXPECT_NE(fetch.message().find("finalize_from_checkpoint"), std::string::npos) << fetch;
  std::vector<float> v(static_cast<std::size_t>(kOut));
  EXPECT_EQ(e->read_master("l2.b", v).code(), core::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->read_compute("l2.b", v).code(), core::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->save_checkpoint((dir_ / "other").string(), blob_of("x")).code(),
            core::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->set_lr(1e-3).code(), core::StatusCode::kFailedPrecondition);
  auto blob = e->load_checkpoint(good);
  ASSERT_TRUE(blob.ok()) << blob.status();
  {
    Framework f;
    for (int s = kSaveAt; s < kSteps; ++s) EXPECT_EQ(train_one_step(*e, f, s), losses[s]) << "step " << s;
  }
  const auto got = read_masters(*e);
  for (const auto& [name, m] : masters) EXPECT_TRUE(bits_equal(got.at(name), m)) << name;
  // A flipped bit in a tensor's name (the file read once, its CRC64 taken as
  // it goes): the damage is named, not "another optimizer's checkpoint".
  const std::string renamed = (dir_ / "renamed").string();
  fs::copy(good, renamed, fs::copy_options::recursive);
  const std::string renamed_state = renamed + "/step-10/state.safetensors";
  {
    std::fstream file(renamed_state, std::ios::in | std::ios::out | std::ios::binary);
    std::string head(4096, '\0');
    file.read(head.data(), static_cast<std::streamsize>(head.size()));
    const std::size_t at = head.find("l1.w.exp_avg\"");
    ASSERT_NE(at, std::string::npos);
    file.clear();
    file.seekp(static_cast<std::streamoff>(at + 6));  // "exp_avg" -> "exq_avg"
    file.put('q');
  }
  e.reset();
  auto again = register_mlp(c);
  ASSERT_NE(again, nullptr);
  r = again->finalize_from_checkpoint(renamed);
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(renamed_state + ": CRC64 mismatch"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("found first"), std::string::npos) << r.status();
}

// strata.overlap "delayed": a save between steps commits the pending update
// first (the saving run then computes with it too), so a run resumed from
// the checkpoint, under "delayed" in another placement, goes on bit for bit
// as the run that saved it.
TEST_F(Checkpoint, DelayedRunResumesAsTheRunThatSaved) {
  Config delayed = config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu);
  delayed.strata.overlap = OverlapMode::kDelayed;
  std::vector<double> losses(kSteps);
  std::map<std::string, std::vector<float>> masters;
  {
    auto e = make_mlp_engine(delayed);
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < kSaveAt; ++s) losses[s] = train_one_step(*e, f, s);
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("data loader at batch 10")).ok());
    for (int s = kSaveAt; s < kSteps; ++s) losses[s] = train_one_step(*e, f, s);
    masters = read_masters(*e);
  }
  Config other = config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kNvme);
  other.strata.overlap = OverlapMode::kDelayed;
  resume_and_compare(other, losses, masters);
}

// The child process: trains to kSaveAt, saves, trains two more steps and
// saves again with STRATA_CHECKPOINT_CRASH_AT set, which ends it there. It is
// registered only inside the child (STRATA_TEST_CHILD_ROOT set), so ordinary
// runs neither run nor skip it.
void child_train_save_and_crash() {
  const std::string root = std::getenv("STRATA_TEST_CHILD_ROOT");
  const std::string crash = std::getenv("STRATA_TEST_CHILD_CRASH");
  auto e = make_mlp_engine(config_for(root + "/swap", OffloadDevice::kNvme, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < kSaveAt; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(root + "/ckpt", blob_of("data loader at batch 10")).ok());
  // "moved_aside" happens only when the step saved already has a folder: save the same step again.
  if (crash != "moved_aside") {
    for (int s = kSaveAt; s < kSaveAt + 2; ++s) train_one_step(*e, f, s);
  }
  ::setenv("STRATA_CHECKPOINT_CRASH_AT", crash.c_str(), 1);
  const core::Status s = e->save_checkpoint(root + "/ckpt", blob_of("data loader at batch 12"));
  ADD_FAILURE() << "the save should have ended the process at " << crash << ": " << s;
}

class ChildTest : public ::testing::Test {
 public:
  void TestBody() override { child_train_save_and_crash(); }
};

const bool kChildRegistered = [] {
  if (std::getenv("STRATA_TEST_CHILD_ROOT") == nullptr) return false;
  ::testing::RegisterTest("CheckpointChild", "TrainSaveAndCrash", nullptr, nullptr, __FILE__, __LINE__,
                          []() -> ::testing::Test* { return new ChildTest; });
  return true;
}();

TEST_F(Checkpoint, CrashInsideSaveLeavesThePreviousOneLoadable) {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
  straight_run(&losses, &masters);
  for (const char* point : {"state_written", "manifest_written", "moved_aside", "renamed"}) {
    SCOPED_TRACE(point);
    fs::remove_all(ckpt());
    const std::string exe = fs::read_symlink("/proc/self/exe").string();
    std::vector<std::string> args = {exe, "--gtest_filter=CheckpointChild.TrainSaveAndCrash"};
    std::vector<std::string> env_s = {"STRATA_TEST_CHILD_ROOT=" + dir_.string(),
                                      std::string("STRATA_TEST_CHILD_CRASH=") + point};
    for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& v : env_s) envp.push_back(v.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_EQ(WEXITSTATUS(status), 86) << "the child did not stop at the crash point";
    // Whatever the save left behind, latest still names step 10.
    resume_and_compare(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu), losses, masters);
  }
}

TEST_F(Checkpoint, CorruptStateIsDataLossAndChangesNothing) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("b")).ok());
  const auto before = read_masters(*e);
  const std::string state = ckpt() + "/step-3/state.safetensors";
  {
    std::fstream file(state, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(fs::file_size(state) - 100));
    file.put('\x7f');
  }
  train_one_step(*e, f, 3);
  const auto after_step = read_masters(*e);
  auto r = e->load_checkpoint(ckpt());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("state.safetensors"), std::string::npos) << r.status();
  auto now = read_masters(*e);
  for (const auto& [name, v] : after_step) EXPECT_TRUE(bits_equal(now.at(name), v)) << name;
  EXPECT_FALSE(bits_equal(before.at("l1.w"), after_step.at("l1.w")));
  // Truncated (within the last block, and by more than a block): the same.
  for (std::uintmax_t cut : {std::uintmax_t{100}, std::uintmax_t{5000}}) {
    fs::resize_file(state, fs::file_size(state) - cut);
    r = e->load_checkpoint(ckpt());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find("state.safetensors"), std::string::npos) << r.status();
    now = read_masters(*e);
    for (const auto& [name, v] : after_step) EXPECT_TRUE(bits_equal(now.at(name), v)) << name;
  }
  EXPECT_EQ(e->load_checkpoint((dir_ / "nothing").string()).status().code(), core::StatusCode::kNotFound);
}

// All three optimizer arrays of every parameter.
std::map<std::string, std::vector<float>> read_all_state(Engine& e) {
  std::map<std::string, std::vector<float>> out;
  for (const Tensor& t : kTensors) {
    for (int k = 0; k < 3; ++k) {
      std::vector<float> v(static_cast<std::size_t>(t.shape.size() == 2 ? t.shape[0] * t.shape[1] : t.shape[0]));
      EXPECT_TRUE(e.read_state(t.name, k, v).ok());
      out[t.name + "#" + std::to_string(k)] = std::move(v);
    }
  }
  return out;
}

// The state file is written and read through the nvme engine on the backend
// strata.io.backend names: saved on each backend, loaded on psync and on the
// same one, every optimizer array comes back; the file is laid out group by
// group (compute copies, then the optimizer arrays), in the order written.
class CheckpointIo : public Checkpoint, public ::testing::WithParamInterface<IoBackend> {};

TEST_P(CheckpointIo, SavedAndLoadedThroughTheConfiguredBackend) {
  Config c = config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu);
  c.strata.io.backend = GetParam();
  std::map<std::string, std::vector<float>> saved;
  {
    auto e = make_mlp_engine(c);
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
    const core::Status s = e->save_checkpoint(ckpt(), blob_of("io"));
    if (s.code() == core::StatusCode::kUnavailable || s.code() == core::StatusCode::kUnimplemented) {
      GTEST_SKIP() << "this I/O backend cannot run here: " << s;
    }
    ASSERT_TRUE(s.ok()) << s;
    saved = read_all_state(*e);
  }
  for (IoBackend load_with : {IoBackend::kPsync, GetParam()}) {
    Config lc = config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu);
    lc.strata.io.backend = load_with;
    auto e = make_mlp_engine(lc);
    ASSERT_NE(e, nullptr);
    auto blob = e->load_checkpoint(ckpt());
    ASSERT_TRUE(blob.ok()) << blob.status();
    EXPECT_EQ(*blob, blob_of("io"));
    const auto got = read_all_state(*e);
    for (const auto& [name, v] : saved) EXPECT_TRUE(bits_equal(got.at(name), v)) << name;
  }
  auto r = SafetensorsReader::open(ckpt() + "/step-3/state.safetensors");
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<std::string> order;
  for (const TensorInfo& t : r->tensors()) order.push_back(t.name);  // by offset
  const std::vector<std::string> want = {
      "l1.w.compute", "l1.b.compute", "l1.w.master", "l1.w.exp_avg", "l1.w.exp_avg_sq", "l1.b.master",
      "l1.b.exp_avg", "l1.b.exp_avg_sq", "l2.w.compute", "l2.b.compute", "l2.w.master", "l2.w.exp_avg",
      "l2.w.exp_avg_sq", "l2.b.master", "l2.b.exp_avg", "l2.b.exp_avg_sq"};
  EXPECT_EQ(order, want);
}

INSTANTIATE_TEST_SUITE_P(Backends, CheckpointIo,
                         ::testing::Values(IoBackend::kIoUring, IoBackend::kLibaio, IoBackend::kPsync, IoBackend::kAuto),
                         [](const ::testing::TestParamInfo<IoBackend>& info) {
                           switch (info.param) {
                             case IoBackend::kIoUring: return std::string("IoUring");
                             case IoBackend::kLibaio: return std::string("Libaio");
                             case IoBackend::kPsync: return std::string("Psync");
                             case IoBackend::kAuto: return std::string("Auto");
                           }
                           return std::string("Unknown");
                         });

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

std::span<const std::byte> bytes_of(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// The issue's reproduction: "step": 3 -> 2 or lr_override -1.0 -> -0.0 in
// manifest.json, and a flipped bit in latest, loaded silently. Each is now
// DATA_LOSS naming the file, and the engine keeps its state. Then every byte
// position of the saved manifest (one bit each, parse-only) and every bit of
// latest (on disk, through the lookup load uses).
TEST_F(Checkpoint, FlippedBitsInManifestOrLatestAreDataLossNamingTheFile) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("b")).ok());
  train_one_step(*e, f, 3);
  const auto after_step = read_masters(*e);
  const std::string manifest_path = ckpt() + "/step-3/manifest.json";
  const std::string latest_path = ckpt() + "/latest";
  const std::string manifest = read_text(manifest_path);
  const std::string latest = read_text(latest_path);
  auto expect_data_loss_naming = [&](const std::string& file) {
    auto r = e->load_checkpoint(ckpt());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status();
    const auto now = read_masters(*e);
    for (const auto& [name, v] : after_step) EXPECT_TRUE(bits_equal(now.at(name), v)) << name;
  };
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\": 3", "\"step\": 2"}, {"\"lr_override\": -1.0", "\"lr_override\": -0.0"}}) {
    std::string edited = manifest;
    const std::size_t at = edited.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    edited.replace(at, from.size(), to);
    write_text(manifest_path, edited);
    expect_data_loss_naming(manifest_path);
  }
  write_text(manifest_path, manifest);
  std::string flipped = latest;
  flipped[5] ^= 1;  // step-3 -> step-2
  write_text(latest_path, flipped);
  expect_data_loss_naming(latest_path);
  write_text(latest_path, latest);
  ASSERT_TRUE(e->load_checkpoint(ckpt()).ok());

  flipped = manifest;
  for (std::size_t i = 0; i < manifest.size(); ++i) {
    flipped[i] = static_cast<char>(manifest[i] ^ (1 << (i % 8)));
    auto r = parse_checkpoint_manifest(bytes_of(flipped), manifest_path);
    ASSERT_EQ(r.status().code(), core::StatusCode::kDataLoss) << "byte " << i << ": " << r.status();
    ASSERT_EQ(r.status().message().rfind(manifest_path + ": ", 0), 0u) << r.status();
    flipped[i] = manifest[i];
  }
  for (std::size_t i = 0; i < latest.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      flipped = latest;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      write_text(latest_path, flipped);
      auto r = locate_checkpoint(ckpt());
      ASSERT_EQ(r.status().code(), core::StatusCode::kDataLoss)
          << "byte " << i << " bit " << bit << ": " << r.status();
      ASSERT_EQ(r.status().message().rfind(latest_path + ": ", 0), 0u) << r.status();
    }
  }
}

// A flipped bit in framework.bin (every bit) or state.safetensors (every
// byte of its header, then positions across its data) is DATA_LOSS naming
// the file, through inspect_checkpoint's verification and through load.
TEST_F(Checkpoint, FlippedBitsInStateOrFrameworkAreDataLossNamingTheFile) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 2; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("data loader at batch 2")).ok());
  ASSERT_TRUE(inspect_checkpoint(ckpt(), /*verify=*/true).ok());
  auto flip_and_check = [&](const std::string& path, std::uint64_t offset, int bit) {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(offset));
    const int c = file.get();
    file.seekp(static_cast<std::streamoff>(offset));
    file.put(static_cast<char>(c ^ (1 << bit)));
    file.flush();
    auto r = inspect_checkpoint(ckpt(), /*verify=*/true);
    EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << path << " byte " << offset << " bit " << bit;
    EXPECT_EQ(r.status().message().rfind(path + ": ", 0), 0u) << r.status();
    file.seekp(static_cast<std::streamoff>(offset));
    file.put(static_cast<char>(c));
  };
  const std::string framework = ckpt() + "/step-2/framework.bin";
  for (std::uint64_t i = 0; i < fs::file_size(framework); ++i) {
    for (int bit = 0; bit < 8; ++bit) flip_and_check(framework, i, bit);
  }
  const std::string state = ckpt() + "/step-2/state.safetensors";
  auto reader = SafetensorsReader::open(state);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::uint64_t data_start = reader->tensors().front().offset;
  const std::uint64_t size = fs::file_size(state);
  for (std::uint64_t i = 0; i < data_start; ++i) flip_and_check(state, i, static_cast<int>(i % 8));
  for (std::uint64_t i = data_start; i < size; i += 4099) flip_and_check(state, i, static_cast<int>(i % 8));
  flip_and_check(state, size - 1, 7);
  ASSERT_FALSE(HasFailure());
  // Through load: the framework file's last bit.
  {
    std::fstream file(framework, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(-1, std::ios::end);
    file.put('3');  // "...batch 2" -> "...batch 3"
  }
  auto r = e->load_checkpoint(ckpt());
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(framework), std::string::npos) << r.status();
}

// A manifest edited with its checksum recomputed ("step": -7, a negative
// lr_override) loaded silently before. A value no save writes is now DATA_LOSS naming the file and the field; a loss scaler state this
// engine's config cannot reach is FAILED_PRECONDITION naming them. Each
// changes nothing in the engine, and the unedited manifest then loads.
TEST_F(Checkpoint, ImpossibleValuesAreRefusedNamingTheFileAndTheFieldAndChangeNothing) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("b")).ok());
  train_one_step(*e, f, 3);
  const auto after_step = read_all_state(*e);
  const double scale = e->loss_scale();
  const std::string manifest_path = ckpt() + "/step-3/manifest.json";
  const std::string manifest = read_text(manifest_path);
  auto parsed = parse_checkpoint_manifest(bytes_of(manifest), manifest_path);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const CheckpointManifest saved = *parsed;
  ASSERT_EQ(saved.loss_scaler.hysteresis_left, 1);
  // Each edit written back through format_checkpoint_manifest, so its checksum matches.
  const struct {
    void (*edit)(CheckpointManifest&);
    const char* field;
    core::StatusCode code;
  } cases[] = {
      {[](CheckpointManifest& m) { m.step = -7; }, "step -7", core::StatusCode::kDataLoss},
      {[](CheckpointManifest& m) { m.skipped_steps = -1; }, "skipped_steps -1", core::StatusCode::kDataLoss},
      {[](CheckpointManifest& m) { m.lr_override = -3.0; }, "lr_override -3", core::StatusCode::kDataLoss},
      {[](CheckpointManifest& m) { m.loss_scaler.scale = 0.0; }, "loss_scaler.scale 0", core::StatusCode::kDataLoss},
      {[](CheckpointManifest& m) { m.loss_scaler.hysteresis_left = 0; }, "loss_scaler.hysteresis_left 0",
       core::StatusCode::kDataLoss},
      {[](CheckpointManifest& m) { m.compute_dtype = "F64"; }, "compute_dtype \"F64\"", core::StatusCode::kDataLoss},
      // Possible with fp16's dynamic scale, not with this bf16 engine's static 1.
      {[](CheckpointManifest& m) { m.loss_scaler.hysteresis_left = 2; }, "hysteresis_left 2 is outside [1, 1]",
       core::StatusCode::kFailedPrecondition},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.field);
    CheckpointManifest edited = saved;
    c.edit(edited);
    write_text(manifest_path, format_checkpoint_manifest(edited));
    auto r = e->load_checkpoint(ckpt());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_EQ(r.status().message().rfind(manifest_path + ": ", 0), 0u) << r.status();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
    const auto now = read_all_state(*e);
    for (const auto& [name, v] : after_step) EXPECT_TRUE(bits_equal(now.at(name), v)) << name;
    EXPECT_EQ(e->loss_scale(), scale);
  }
  write_text(manifest_path, manifest);
  auto blob = e->load_checkpoint(ckpt());
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ(*blob, blob_of("b"));
}

// --resume after a save ended before it wrote `latest` (the very first one, or
// one removed): the newest complete step-<N> folder loads, with a warning
// naming it; a damaged one is passed over; nothing complete is NOT_FOUND
// naming the root. A `latest` naming an older folder is still followed (it is
// the commit point), with a warning naming the newer folder, and one naming a
// damaged folder stays DATA_LOSS.
TEST_F(Checkpoint, WithoutLatestTheNewestCompleteCheckpointLoads) {
  {
    auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < 4; ++s) {
      train_one_step(*e, f, s);
      if (s == 1) {
        ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("at 2")).ok());
      }
    }
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("at 4")).ok());
  }
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  std::vector<std::string> warnings;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kWarn) warnings.emplace_back(message);
  });
  const std::string latest = ckpt() + "/latest";
  const std::string latest_text = read_text(latest);
  fs::remove(latest);
  auto blob = e->load_checkpoint(ckpt());
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ(*blob, blob_of("at 4"));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(latest + " is missing"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("loading " + ckpt() + "/step-4"), std::string::npos) << warnings[0];

  warnings.clear();
  write_text(latest, format_latest_pointer("step-2"));
  blob = e->load_checkpoint(ckpt());
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ(*blob, blob_of("at 2"));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(ckpt() + "/step-4 is newer"), std::string::npos) << warnings[0];

  // step-4 damaged: with latest naming it, DATA_LOSS; without latest, step-2.
  const std::string state4 = ckpt() + "/step-4/state.safetensors";
  {
    std::fstream file(state4, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(fs::file_size(state4) - 100));
    file.put('\x7f');
  }
  write_text(latest, latest_text);
  auto r = e->load_checkpoint(ckpt());
  EXPECT_EQ(r.status().code(), core::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(state4), std::string::npos) << r.status();
  fs::remove(latest);
  warnings.clear();
  blob = e->load_checkpoint(ckpt());
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ(*blob, blob_of("at 2"));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("loading " + ckpt() + "/step-2"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find(state4 + ": CRC64 mismatch"), std::string::npos) << warnings[0];

  // Nothing complete.
  fs::remove(ckpt() + "/step-2/framework.bin");
  r = e->load_checkpoint(ckpt());
  core::set_log_sink({});
  EXPECT_EQ(r.status().code(), core::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("no complete checkpoint at " + ckpt()), std::string::npos) << r.status();
}

// A checkpoint written by the previous format (version 1: no checksum in
// manifest.json, "step-<N>\n" in latest) loads with a warning and resumes.
TEST_F(Checkpoint, VersionOneCheckpointLoadsWithAWarning) {
  std::map<std::string, std::vector<float>> saved;
  {
    auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu));
    ASSERT_NE(e, nullptr);
    Framework f;
    for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("v1")).ok());
    saved = read_all_state(*e);
  }
  const std::string manifest_path = ckpt() + "/step-3/manifest.json";
  std::string m = read_text(manifest_path);
  m = m.substr(0, m.rfind(",\n  \"manifest_crc64\"")) + "\n}\n";
  m.replace(m.find("\"version\": 2"), 12, "\"version\": 1");
  write_text(manifest_path, m);
  write_text(ckpt() + "/latest", "step-3\n");
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  std::vector<std::string> warnings;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kWarn) warnings.emplace_back(message);
  });
  auto blob = e->load_checkpoint(ckpt());
  core::set_log_sink({});
  ASSERT_TRUE(blob.ok()) << blob.status();
  EXPECT_EQ(*blob, blob_of("v1"));
  const auto got = read_all_state(*e);
  for (const auto& [name, v] : saved) EXPECT_TRUE(bits_equal(got.at(name), v)) << name;
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("version-1 checkpoint"), std::string::npos) << warnings[0];
  // The next save writes version 2 beside it.
  Framework f;
  train_one_step(*e, f, 3);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("v2")).ok());
  auto loc = locate_checkpoint(ckpt());
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->manifest.version, kCheckpointFormatOneRank);
}

// strata.checkpoint.keep_last / keep_every after each save, and what an
// interrupted save left (a .step-<N>.tmp folder) removed at the next save
// with an info line naming it.
TEST_F(Checkpoint, RetentionAndLeftoversOfInterruptedSaves) {
  Config c = config_for(swap(), OffloadDevice::kCpu, OffloadDevice::kCpu);
  c.strata.checkpoint.keep_last = 2;
  c.strata.checkpoint.keep_every = 4;
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  fs::create_directories(ckpt() + "/.step-100.tmp");
  write_text(ckpt() + "/.step-100.tmp/state.safetensors.tmp", std::string(5000, 'x'));
  std::vector<std::string> infos;
  core::set_log_sink([&](core::LogLevel level, std::string_view message) {
    if (level == core::LogLevel::kInfo) infos.emplace_back(message);
  });
  Framework f;
  for (int s = 0; s < 9; ++s) {
    train_one_step(*e, f, s);
    ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("r")).ok());
  }
  core::set_log_sink({});
  std::vector<std::string> left;
  for (const auto& entry : fs::directory_iterator(ckpt())) left.push_back(entry.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "step-4", "step-8", "step-9"}));
  ASSERT_FALSE(infos.empty());
  EXPECT_TRUE(std::any_of(infos.begin(), infos.end(), [&](const std::string& m) {
    return m.find(ckpt() + "/.step-100.tmp") != std::string::npos &&
           m.find("interrupted") != std::string::npos;
  }));
  EXPECT_TRUE(std::any_of(infos.begin(), infos.end(), [&](const std::string& m) {
    return m.find("removed checkpoint " + ckpt() + "/step-7") != std::string::npos;
  }));
  ASSERT_TRUE(e->load_checkpoint(ckpt()).ok());
}

// inspect_checkpoint reads what the engine saved: counters, placement, tensors.
TEST_F(Checkpoint, InspectReadsWhatTheEngineSaved) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kCpu));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 2; ++s) train_one_step(*e, f, s);
  ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("inspect")).ok());
  for (const std::string& where : {ckpt(), ckpt() + "/step-2"}) {
    auto in = inspect_checkpoint(where, /*verify=*/true);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->dir, ckpt() + "/step-2");
    EXPECT_EQ(in->latest_path, where == ckpt() ? ckpt() + "/latest" : "");
    EXPECT_TRUE(in->verified);
    EXPECT_EQ(in->manifest.step, 2);
    EXPECT_EQ(in->manifest.compute_dtype, "BF16");
    ASSERT_EQ(in->tensors.size(), 16u);
    EXPECT_EQ(in->tensors[0].name, "l1.w.compute");
    EXPECT_EQ(in->tensors[0].dtype, "BF16");
    EXPECT_EQ(in->files[2].bytes, std::string("inspect").size());
    const auto has = [&](const std::string& key, const std::string& value) {
      return std::find(in->placement.begin(), in->placement.end(), std::make_pair(key, value)) !=
             in->placement.end();
    };
    EXPECT_TRUE(has("zero_optimization.offload_optimizer.device", "\"nvme\"")) << in->placement.size();
    EXPECT_TRUE(has("zero_optimization.stage", "3"));
    const std::string json = format_inspection_json(*in);
    EXPECT_NE(json.find("\"step\": 2"), std::string::npos) << json.substr(0, 400);
    EXPECT_NE(json.find("\"l1.w.exp_avg_sq\""), std::string::npos);
  }
}

TEST_F(Checkpoint, ExportsSafetensorsSingleAndSharded) {
  auto e = make_mlp_engine(config_for(swap(), OffloadDevice::kNvme, OffloadDevice::kNvme));
  ASSERT_NE(e, nullptr);
  Framework f;
  for (int s = 0; s < 3; ++s) train_one_step(*e, f, s);
  const auto masters = read_masters(*e);
  const std::string one = (dir_ / "export").string(), sharded = (dir_ / "sharded").string();
  ASSERT_TRUE(e->export_safetensors(one, Precision::kFp32, 0).ok());
  auto r = SafetensorsReader::open(one + "/model.safetensors");
  ASSERT_TRUE(r.ok()) << r.status();
  for (const auto& [name, v] : masters) {
    std::vector<float> got(v.size());
    ASSERT_TRUE(r->read_f32(name, got).ok());
    EXPECT_TRUE(bits_equal(got, v)) << name;
  }
  ASSERT_TRUE(e->export_safetensors(sharded, Precision::kBf16, 200000).ok());  // l1.w alone is 262144 B
  EXPECT_TRUE(fs::exists(sharded + "/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(sharded + "/" + shard_file_name(1, 2)));
  auto s2 = SafetensorsReader::open(sharded + "/" + shard_file_name(2, 2));
  ASSERT_TRUE(s2.ok()) << s2.status();
  std::vector<float> b(kOut);
  ASSERT_TRUE(s2->read_f32("l2.b", b).ok());
  for (int i = 0; i < kOut; ++i) {
    EXPECT_EQ(b[i], nx::bf16_bits_to_fp32(nx::fp32_to_bf16_bits(masters.at("l2.b")[i])));
  }
}

}  // namespace
}  // namespace strata::engine
