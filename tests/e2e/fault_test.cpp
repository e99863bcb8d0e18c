// Faults injected under the engine (IoConfig::fault_injector, engine/io_faults.h): EIO, ENOSPC,
// short transfers, EINTR, EAGAIN and a flipped bit in the disk pipeline of a
// step (read and write side, every schedule), a checkpoint save, a checkpoint
// load, a safetensors import and an export. Each ends in its named status naming the file
// or in a transparent retry with the bits of a clean run; the engine is then
// destroyed (no hang; ASan checks leaks); after a failed save or load the last
// good checkpoint loads and the run resumed from it continues bit for bit.
// docs/reliability.md has the table these tests fill.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/io_faults.h"
#include "tests/e2e/mlp_harness.h"

namespace strata::engine {
namespace {

using namespace e2e;  // NOLINT: the harness is this test's vocabulary
namespace fs = std::filesystem;
using core::Status;
using core::StatusCode;

// Few steps, so that the file stays fast (also under ASan).
constexpr int kFaultSteps = 5;  // steps of a run under faults
constexpr int kFaultFrom = 1;   // the fault is armed after this many clean steps
constexpr int kSaveAt = 2;      // the good checkpoint; the faulty save comes at kSaveAt + 1
constexpr int kRunSteps = 5;    // steps of a run with checkpoints

// The faults, in the table's order.
enum class Fault { kEio, kEnospc, kShort, kEintr, kEagain, kFlipBit };

const char* fault_name(Fault f) {
  switch (f) {
    case Fault::kEio: return "Eio";
    case Fault::kEnospc: return "Enospc";
    case Fault::kShort: return "ShortTransfer";
    case Fault::kEintr: return "Eintr";
    case Fault::kEagain: return "Eagain";
    case Fault::kFlipBit: return "FlipBit";
  }
  return "?";
}

// The rule that plays `f` on the `skip`-th op of `ops` kind from now on.
// `small_file`: the op is a file_io transfer (page cache, often under 4096
// bytes), whose short transfers move one byte at a time; others move half
// the op rounded down to 4096 (as O_DIRECT would).
FaultRule rule_for(Fault f, FaultOps ops, std::uint64_t skip, bool small_file = false) {
  FaultRule r;
  r.ops = ops;
  r.skip = skip;
  switch (f) {
    case Fault::kEio: r.kind = FaultKind::kEio; break;
    case Fault::kEnospc: r.kind = FaultKind::kEnospc; break;
    case Fault::kShort:
      r.kind = FaultKind::kShortTransfer;  // the op and the rest of it, eight times
      r.short_bytes = small_file ? 1 : 0;
      r.times = 8;
      break;
    case Fault::kEintr:
      r.kind = FaultKind::kEintr;  // the op and seven of its retries
      r.times = 8;
      break;
    case Fault::kEagain:
      r.kind = FaultKind::kEagain;
      r.times = 8;
      break;
    case Fault::kFlipBit:
      r.kind = FaultKind::kFlipBit;
      r.bit = 8 * 4096 * 3 + 5;  // a bit of the op's data (modulo its size)
      break;
  }
  return r;
}

// What a fault gives: its status code, or OK (retried transparently).
StatusCode expected_code(Fault f) {
  switch (f) {
    case Fault::kEio: return StatusCode::kIoError;
    case Fault::kEnospc: return StatusCode::kResourceExhausted;
    case Fault::kFlipBit: return StatusCode::kDataLoss;
    default: return StatusCode::kOk;
  }
}

bool transparent(Fault f) { return expected_code(f) == StatusCode::kOk; }

std::vector<std::byte> blob_of(const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

// The framework's side of a step, as mlp_harness.h's run_step, but every
// engine error comes back as a Status (the faults make calls fail).
Status load_group(Engine& e, Framework& f, const std::string& group) {
  auto span = e.fetch(group);
  if (!span.ok()) return span.status();
  std::vector<std::byte> host(span->size_bytes());
  STRATA_RETURN_IF_ERROR(e.device().copy_d2h(f.stream(e), host, *span));
  STRATA_RETURN_IF_ERROR(e.device().synchronize(f.stream(e)));
  const GroupPlace* g = e.layout().find_group(group);
  for (std::size_t pi : g->params) {
    const ParamDesc& p = e.layout().params[pi];
    std::vector<float>& dst = f.w[p.name];
    dst.resize(static_cast<std::size_t>(p.numel()));
    const std::byte* src = host.data() + e.layout().places[pi].compute_offset * f.cb;
    for (std::size_t i = 0; i < dst.size(); ++i) {
      std::uint16_t hb;
      std::memcpy(&hb, src + 2 * i, 2);
      dst[i] = nx::bf16_bits_to_fp32(hb);
    }
  }
  return e.release(group);
}

Status give_grads(Engine& e, Framework& f, const std::string& group,
                  const std::map<std::string, std::vector<float>>& g) {
  auto span = e.grad_buffer(group);
  if (!span.ok()) return span.status();
  std::vector<std::byte> host(span->size_bytes());
  const GroupPlace* gp = e.layout().find_group(group);
  for (std::size_t pi : gp->params) {
    const ParamDesc& p = e.layout().params[pi];
    // (The buffer begins at the group's first trainable slot; a frozen parameter has none.)
    if (e.layout().places[pi].trainable_offset < 0) continue;
    std::byte* dst = host.data() + (e.layout().places[pi].compute_offset - gp->trainable_compute_begin) * f.cb;
    const auto& src = g.at(p.name);
    for (std::size_t i = 0; i < src.size(); ++i) {
      const std::uint16_t hb = nx::fp32_to_bf16_bits(src[i]);
      std::memcpy(dst + 2 * i, &hb, 2);
    }
  }
  STRATA_RETURN_IF_ERROR(e.device().copy_h2d(f.stream(e), *span, host));
  STRATA_RETURN_IF_ERROR(e.device().synchronize(f.stream(e)));
  return e.grads_ready(group);
}

Status try_step(Engine& e, Framework& f, int step, double* loss) {
  f.cb = e.layout().compute_bytes;
  f.precision = e.config().precision;
  f.batch(step * 16);
  STRATA_RETURN_IF_ERROR(load_group(e, f, "l1"));
  STRATA_RETURN_IF_ERROR(load_group(e, f, "l2"));
  *loss = f.forward();
  const auto& g = f.backward(static_cast<float>(e.loss_scale()));
  STRATA_RETURN_IF_ERROR(load_group(e, f, "l2"));
  STRATA_RETURN_IF_ERROR(give_grads(e, f, "l2", g));
  STRATA_RETURN_IF_ERROR(load_group(e, f, "l1"));
  STRATA_RETURN_IF_ERROR(give_grads(e, f, "l1", g));
  return e.step_end().status();
}

// An engine with the MLP registered (from `pretrained` when given, else the
// harness's init values); its finalize's status when that fails.
core::Result<std::unique_ptr<Engine>> try_engine(const Config& c, const std::string& pretrained = "") {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::create(c));
  STRATA_ASSIGN_OR_RETURN(const int no_decay, e->add_optimizer_group({"no_decay", 0.0, 1.0}));
  if (!pretrained.empty()) STRATA_RETURN_IF_ERROR(e->init_from_safetensors(pretrained, ""));
  for (const Tensor& t : kTensors) {
    ParamDesc d{t.name, t.shape, t.group, true, t.name.back() == 'b' ? no_decay : 0};
    InitFn init;
    if (pretrained.empty()) {
      init = [t](std::span<float> out) {
        init_values(t, out);
        return Status();
      };
    }
    STRATA_RETURN_IF_ERROR(e->register_param(d, std::move(init)));
  }
  STRATA_RETURN_IF_ERROR(e->finalize());
  return e;
}

// The outcome of a run: its losses and final masters.
struct Trajectory {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> masters;
};

class FaultTest : public MlpTest {
 protected:
  std::string swap_file() const { return (dir_ / "strata-swap.dat").string(); }
  std::string ckpt() const { return (dir_ / "ckpt").string(); }

  // The e2e config, optimizer state on nvme, overlap `mode`, faults from `inj`.
  Config nvme_config(OverlapMode mode, FaultInjector* inj) const {
    Config c = base();
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_param.device = OffloadDevice::kCpu;
    c.strata.overlap = mode;
    c.strata.io.fault_injector = inj;
    return c;
  }
  // Host-only placement (no swap I/O): every op the injector sees is a
  // checkpoint's or a safetensors file's.
  Config host_config(FaultInjector* inj) const {
    Config c = base();
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    c.zero.offload_param.device = OffloadDevice::kCpu;
    c.scheduler.type = SchedulerType::kWarmupLR;  // the schedule must resume too
    c.scheduler.warmup_num_steps = 5;
    c.scheduler.warmup_max_lr = 3e-3;
    c.strata.io.fault_injector = inj;
    return c;
  }

  // Steps [from, to) on `e`, expecting success.
  static void train(Engine& e, int from, int to, Trajectory* run) {
    Framework f;
    for (int s = from; s < to; ++s) {
      double loss = 0.0;
      const Status st = try_step(e, f, s, &loss);
      ASSERT_TRUE(st.ok()) << "step " << s << ": " << st;
      if (run != nullptr) run->losses.push_back(loss);
    }
    if (run != nullptr) run->masters = read_masters(e);
  }

  static void expect_same(const Trajectory& got, const Trajectory& want, std::size_t first_loss = 0) {
    ASSERT_EQ(got.losses.size() + first_loss, want.losses.size());
    for (std::size_t i = 0; i < got.losses.size(); ++i) {
      EXPECT_EQ(got.losses[i], want.losses[i + first_loss]) << "step " << i + first_loss;
    }
    for (const auto& [name, v] : want.masters) EXPECT_TRUE(bits_equal(got.masters.at(name), v)) << name;
  }

  // How many ops of `ops` kind `fn` does (a rule that only counts them).
  template <typename Fn>
  static std::uint64_t count_ops(FaultInjector& inj, FaultOps ops, Fn&& fn) {
    inj.clear();
    const std::size_t counter = inj.add({.kind = FaultKind::kDelay, .ops = ops, .times = -1});
    fn();
    const std::uint64_t n = inj.hits(counter);
    inj.clear();
    return n;
  }
};

void expect_names(const Status& s, StatusCode code, const std::string& file) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(file), std::string::npos) << "the message does not name " << file << ": " << s;
}

// --- the disk pipeline of a step ------------------------------------------------

using StepParam = std::tuple<Fault, OverlapMode, FaultOps>;

class StepFault : public FaultTest, public ::testing::WithParamInterface<StepParam> {};

TEST_P(StepFault, EndsInItsStatusOrRetriesToTheSameBits) {
  const auto [fault, mode, side] = GetParam();
  // A clean run of the same schedule (once per schedule).
  static std::map<OverlapMode, Trajectory> clean_runs;
  if (!clean_runs.contains(mode)) {
    auto e = try_engine(nvme_config(mode, nullptr));
    ASSERT_TRUE(e.ok()) << e.status();
    train(**e, 0, kFaultSteps, &clean_runs[mode]);
  }
  const Trajectory& clean = clean_runs.at(mode);
  FaultInjector inj;
  auto created = try_engine(nvme_config(mode, &inj));
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> e = std::move(created).value();
  Trajectory run;
  Framework f;
  Status first_error;
  std::size_t rule = 0;
  for (int s = 0; s < kFaultSteps && first_error.ok(); ++s) {
    if (s == kFaultFrom) rule = inj.add(rule_for(fault, side, 0));
    double loss = 0.0;
    first_error = try_step(*e, f, s, &loss);
    if (first_error.ok()) run.losses.push_back(loss);
  }
  EXPECT_GT(inj.hits(rule), 0u) << "the fault never fired";
  // Under "speculative" the flipped I/O can be a job's that its verdict then
  // stops: a second version written that is never read, or a read whose data
  // the stopped job drops unchecked. The run goes on, and must give the clean
  // run's bits (whether that happens depends on timing: seen under load).
  const bool flipped_block_unread =
      fault == Fault::kFlipBit && mode == OverlapMode::kSpeculative && first_error.ok();
  if (transparent(fault) || flipped_block_unread) {
    ASSERT_TRUE(first_error.ok()) << first_error;
    run.masters = read_masters(*e);
    expect_same(run, clean);
  } else {
    expect_names(first_error, expected_code(fault), swap_file());
    // Every step before the fault was as the clean run's.
    for (std::size_t i = 0; i < std::min<std::size_t>(run.losses.size(), kFaultFrom); ++i) {
      EXPECT_EQ(run.losses[i], clean.losses[i]) << "step " << i;
    }
  }
  f.s = gpu::Stream();  // (the framework's stream goes before its device)
  e.reset();            // must neither hang nor leak, whatever the fault left in flight
}

std::string step_name(const ::testing::TestParamInfo<StepParam>& info) {
  const auto [fault, mode, side] = info.param;
  const char* m = mode == OverlapMode::kNone          ? "None"
                  : mode == OverlapMode::kExact       ? "Exact"
                  : mode == OverlapMode::kSpeculative ? "Speculative"
                                                      : "Delayed";
  return std::string(fault_name(fault)) + m + (side == FaultOps::kReads ? "Read" : "Write");
}

INSTANTIATE_TEST_SUITE_P(
    Faults, StepFault,
    ::testing::Combine(::testing::Values(Fault::kEio, Fault::kEnospc, Fault::kShort, Fault::kEintr, Fault::kEagain,
                                         Fault::kFlipBit),
                       ::testing::Values(OverlapMode::kNone, OverlapMode::kExact, OverlapMode::kSpeculative,
                                         OverlapMode::kDelayed),
                       ::testing::Values(FaultOps::kReads, FaultOps::kWrites)),
    step_name);

// --- checkpoint save and load ------------------------------------------------------

// Which file of a checkpoint the fault hits.
enum class CkptFile { kState, kFramework, kManifest, kLatest };

const char* file_name(CkptFile f) {
  switch (f) {
    case CkptFile::kState: return "state.safetensors";
    case CkptFile::kFramework: return "framework.bin";
    case CkptFile::kManifest: return "manifest.json";
    case CkptFile::kLatest: return "latest";
  }
  return "?";
}

using CkptParam = std::tuple<Fault, CkptFile>;

std::string ckpt_name(const ::testing::TestParamInfo<CkptParam>& info) {
  const auto [fault, file] = info.param;
  const char* f = file == CkptFile::kState       ? "State"
                  : file == CkptFile::kFramework ? "Framework"
                  : file == CkptFile::kManifest  ? "Manifest"
                                                 : "Latest";
  return std::string(fault_name(fault)) + f;
}

class CheckpointFault : public FaultTest, public ::testing::WithParamInterface<CkptParam> {
 protected:
  // The uninterrupted run: steps [0, kRunSteps) on the host placement (once).
  Trajectory straight() {
    static Trajectory r;
    if (r.losses.empty()) {
      auto e = try_engine(host_config(nullptr));
      EXPECT_TRUE(e.ok()) << e.status();
      if (e.ok()) train(**e, 0, kRunSteps, &r);
    }
    return r;
  }
  // A fresh engine loads `path` (saved after step `at`) and trains on to kRunSteps.
  void resume_and_compare(const std::string& path, const Trajectory& want, int at = kSaveAt) {
    auto e = try_engine(host_config(nullptr));
    ASSERT_TRUE(e.ok()) << e.status();
    auto blob = (*e)->load_checkpoint(path);
    ASSERT_TRUE(blob.ok()) << blob.status();
    EXPECT_EQ(*blob, blob_of("at " + std::to_string(at)));
    Trajectory r;
    train(**e, at, kRunSteps, &r);
    expect_same(r, want, static_cast<std::size_t>(at));
  }
  // The op of a save or load (of `ops` kind) that touches `file` first; the
  // ops come in the order of engine/save_load.cpp (state file, framework.bin,
  // manifest, latest for a save; latest, manifest, then the state file for a
  // load of the root), one op for each of the small files.
  static std::uint64_t first_op_of(CkptFile file, std::uint64_t ops_in_all, bool save) {
    if (save) {
      switch (file) {
        case CkptFile::kState: return 0;
        case CkptFile::kFramework: return ops_in_all - 3;
        case CkptFile::kManifest: return ops_in_all - 2;
        case CkptFile::kLatest: return ops_in_all - 1;
      }
    }
    switch (file) {
      case CkptFile::kLatest: return 0;
      case CkptFile::kManifest: return 1;
      case CkptFile::kState: return 2;
      case CkptFile::kFramework: break;  // (after the state file's checksum pass: not targeted)
    }
    return 0;
  }
};

class SaveFault : public CheckpointFault {};

TEST_P(SaveFault, FailsNamingTheFileAndTheLastGoodCheckpointResumes) {
  const auto [fault, file] = GetParam();
  const Trajectory want = straight();
  FaultInjector inj;
  auto created = try_engine(host_config(&inj));
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> e = std::move(created).value();
  train(*e, 0, kSaveAt, nullptr);
  // The good checkpoint (its write ops counted), then one step, then the faulty save.
  const std::uint64_t writes =
      count_ops(inj, FaultOps::kWrites, [&] { ASSERT_TRUE(e->save_checkpoint(ckpt(), blob_of("at 2")).ok()); });
  ASSERT_GE(writes, 4u);
  train(*e, kSaveAt, kSaveAt + 1, nullptr);
  const std::size_t rule =
      inj.add(rule_for(fault, FaultOps::kWrites, first_op_of(file, writes, true), file != CkptFile::kState));
  const Status saved = e->save_checkpoint(ckpt(), blob_of("at 3"));
  EXPECT_GT(inj.hits(rule), 0u) << "the fault never fired";
  inj.clear();
  const std::string faulty = ckpt() + "/step-" + std::to_string(kSaveAt + 1);
  if (fault == Fault::kFlipBit) {
    // The save cannot see it (it does not read back); the load does.
    ASSERT_TRUE(saved.ok()) << saved;
    auto fresh = try_engine(host_config(nullptr));
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    expect_names((*fresh)->load_checkpoint(ckpt()).status(), StatusCode::kDataLoss, file_name(file));
  } else if (!transparent(fault)) {
    expect_names(saved, expected_code(fault), file_name(file));
    // The engine goes on: the next save works.
    EXPECT_TRUE(e->save_checkpoint((dir_ / "again").string(), blob_of("at 3")).ok());
  } else {
    ASSERT_TRUE(saved.ok()) << saved;
    resume_and_compare(faulty, want, kSaveAt + 1);
  }
  e.reset();
  if (transparent(fault)) return;  // (the faulty save itself resumed bit for bit above)
  // The last good checkpoint loads and resumes bit for bit; after a failed
  // save `latest` still names it.
  resume_and_compare(fault == Fault::kFlipBit ? ckpt() + "/step-" + std::to_string(kSaveAt) : ckpt(), want);
}

INSTANTIATE_TEST_SUITE_P(Faults, SaveFault,
                         ::testing::Combine(::testing::Values(Fault::kEio, Fault::kEnospc, Fault::kShort,
                                                              Fault::kEintr, Fault::kEagain),
                                            ::testing::Values(CkptFile::kState, CkptFile::kFramework,
                                                              CkptFile::kManifest, CkptFile::kLatest)),
                         ckpt_name);
// A flipped bit in any file: each carries a CRC64 (manifest.json and latest
// their own), so the load is DATA_LOSS naming it.
INSTANTIATE_TEST_SUITE_P(Flip, SaveFault,
                         ::testing::Values(CkptParam{Fault::kFlipBit, CkptFile::kState},
                                           CkptParam{Fault::kFlipBit, CkptFile::kFramework},
                                           CkptParam{Fault::kFlipBit, CkptFile::kManifest},
                                           CkptParam{Fault::kFlipBit, CkptFile::kLatest}),
                         ckpt_name);

class LoadFault : public CheckpointFault {};

TEST_P(LoadFault, FailsNamingTheFileAndTheSameEngineThenLoadsIt) {
  const auto [fault, file] = GetParam();
  const Trajectory want = straight();
  {
    auto e = try_engine(host_config(nullptr));
    ASSERT_TRUE(e.ok()) << e.status();
    train(**e, 0, kSaveAt, nullptr);
    ASSERT_TRUE((*e)->save_checkpoint(ckpt(), blob_of("at 2")).ok());
  }
  FaultInjector inj;
  auto created = try_engine(host_config(&inj));
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> e = std::move(created).value();
  const std::uint64_t reads = count_ops(inj, FaultOps::kReads, [&] { ASSERT_TRUE(e->load_checkpoint(ckpt()).ok()); });
  ASSERT_GE(reads, 5u);
  const std::size_t rule =
      inj.add(rule_for(fault, FaultOps::kReads, first_op_of(file, reads, false), file != CkptFile::kState));
  auto loaded = e->load_checkpoint(ckpt());
  EXPECT_GT(inj.hits(rule), 0u) << "the fault never fired";
  inj.clear();
  if (transparent(fault)) {
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  } else {
    expect_names(loaded.status(), expected_code(fault), file_name(file));
    // Nothing was lost: the same engine loads it now.
    loaded = e->load_checkpoint(ckpt());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }
  EXPECT_EQ(*loaded, blob_of("at 2"));
  Trajectory r;
  train(*e, kSaveAt, kRunSteps, &r);
  expect_same(r, want, kSaveAt);
  e.reset();
}

INSTANTIATE_TEST_SUITE_P(Faults, LoadFault,
                         ::testing::Combine(::testing::Values(Fault::kEio, Fault::kEnospc, Fault::kShort,
                                                              Fault::kEintr, Fault::kEagain),
                                            ::testing::Values(CkptFile::kLatest, CkptFile::kManifest,
                                                              CkptFile::kState)),
                         ckpt_name);
INSTANTIATE_TEST_SUITE_P(Flip, LoadFault,
                         ::testing::Values(CkptParam{Fault::kFlipBit, CkptFile::kLatest},
                                           CkptParam{Fault::kFlipBit, CkptFile::kManifest},
                                           CkptParam{Fault::kFlipBit, CkptFile::kState}),
                         ckpt_name);

// --- safetensors import -------------------------------------------------------

// Which reads of an import the fault hits: the header (read when
// init_from_safetensors checks the file) or the tensors (read at finalize).
enum class ImportSite { kHeader, kTensors };

using ImportParam = std::tuple<Fault, ImportSite>;

class ImportFault : public FaultTest, public ::testing::WithParamInterface<ImportParam> {};

TEST_P(ImportFault, FailsNamingTheFileOrImportsTheSameBits) {
  const auto [fault, site] = GetParam();
  const std::string model = (dir_ / "model").string();
  {
    auto e = try_engine(host_config(nullptr));
    ASSERT_TRUE(e.ok()) << e.status();
    train(**e, 0, 2, nullptr);
    ASSERT_TRUE((*e)->export_safetensors(model, Precision::kFp32, 0).ok());
  }
  Trajectory clean;
  FaultInjector inj;
  std::uint64_t header_reads = 0;
  {
    auto e = try_engine(host_config(&inj), model);  // counts the reads of the checks
    ASSERT_TRUE(e.ok()) << e.status();
    clean.masters = read_masters(**e);
  }
  header_reads = count_ops(inj, FaultOps::kReads, [&] {
    auto created = Engine::create(host_config(&inj));
    ASSERT_TRUE(created.ok());
    ASSERT_TRUE((*created)->init_from_safetensors(model, "").ok());
  });
  ASSERT_GE(header_reads, 2u);
  const std::size_t rule =
      inj.add(rule_for(fault, FaultOps::kReads, site == ImportSite::kHeader ? 0 : header_reads,
                       site == ImportSite::kHeader));
  auto e = try_engine(host_config(&inj), model);
  EXPECT_GT(inj.hits(rule), 0u) << "the fault never fired";
  inj.clear();
  if (transparent(fault)) {
    ASSERT_TRUE(e.ok()) << e.status();
    Trajectory run;
    run.masters = read_masters(**e);
    expect_same(run, clean);
  } else {
    expect_names(e.status(), expected_code(fault), model + "/model.safetensors");
  }
}

std::string import_name(const ::testing::TestParamInfo<ImportParam>& info) {
  const auto [fault, site] = info.param;
  return std::string(fault_name(fault)) + (site == ImportSite::kHeader ? "Header" : "Tensors");
}

INSTANTIATE_TEST_SUITE_P(Faults, ImportFault,
                         ::testing::Combine(::testing::Values(Fault::kEio, Fault::kEnospc, Fault::kShort,
                                                              Fault::kEintr, Fault::kEagain),
                                            ::testing::Values(ImportSite::kHeader, ImportSite::kTensors)),
                         import_name);
// A flipped bit in a tensor's data cannot be seen (safetensors carries no
// checksum), so flips go to the header only.
INSTANTIATE_TEST_SUITE_P(OneSite, ImportFault, ::testing::Values(ImportParam{Fault::kFlipBit, ImportSite::kHeader}),
                         import_name);

// --- safetensors export -------------------------------------------------------

class ExportFault : public FaultTest, public ::testing::WithParamInterface<Fault> {};

// An export that fails names the file and leaves none behind (the writer
// removes its temporary file), and the engine goes on: the next export works.
// A transparent fault gives the bytes of a clean export.
TEST_P(ExportFault, FailsNamingTheFileOrWritesTheSameBytes) {
  const Fault fault = GetParam();
  FaultInjector inj;
  auto created = try_engine(host_config(&inj));
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Engine> e = std::move(created).value();
  train(*e, 0, 1, nullptr);
  const std::string clean = (dir_ / "clean").string(), faulty = (dir_ / "faulty").string();
  ASSERT_TRUE(e->export_safetensors(clean, Precision::kFp32, 0).ok());
  const std::size_t rule = inj.add(rule_for(fault, FaultOps::kWrites, 0));
  const Status s = e->export_safetensors(faulty, Precision::kFp32, 0);
  EXPECT_GT(inj.hits(rule), 0u) << "the fault never fired";
  inj.clear();
  const std::string file = faulty + "/model.safetensors";
  auto bytes = [](const std::string& path) {
    std::vector<char> b(fs::file_size(path));
    std::FILE* f = std::fopen(path.c_str(), "rb");
    EXPECT_NE(f, nullptr) << path;
    if (f != nullptr) {
      EXPECT_EQ(std::fread(b.data(), 1, b.size(), f), b.size());
      std::fclose(f);
    }
    return b;
  };
  if (transparent(fault)) {
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(bytes(file) == bytes(clean + "/model.safetensors"));
  } else {
    expect_names(s, expected_code(fault), file);
    EXPECT_FALSE(fs::exists(file));
    for (const auto& entry : fs::directory_iterator(faulty)) ADD_FAILURE() << "left behind: " << entry.path();
    ASSERT_TRUE(e->export_safetensors(faulty, Precision::kFp32, 0).ok());
    EXPECT_TRUE(bytes(file) == bytes(clean + "/model.safetensors"));
  }
}

// A flipped bit in an exported file cannot be seen (safetensors carries no
// checksum; the table says so).
INSTANTIATE_TEST_SUITE_P(Faults, ExportFault,
                         ::testing::Values(Fault::kEio, Fault::kEnospc, Fault::kShort, Fault::kEintr, Fault::kEagain),
                         [](const ::testing::TestParamInfo<Fault>& info) { return fault_name(info.param); });

// --- a slow disk under the calls between steps ----------------------------------

// With the compute copies on nvme, step_end starts prefetches of the next
// forward's groups; on a slow disk their reads are still in flight when the
// framework inspects or saves right after step_end. read_compute and
// save_checkpoint read the same swap blocks: they wait for those prefetches
// (which keep their copies) instead of failing on a busy block, and no
// prefetch fails on a block they read (which would fail the next fetch).
TEST_F(FaultTest, CallsRightAfterStepEndWaitForThePrefetchesInFlight) {
  FaultInjector inj;
  Config c = nvme_config(OverlapMode::kExact, &inj);
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;  // only the compute copies on the disk
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.stage3_param_persistence_threshold = 0;  // every group released, and prefetched
  auto e = make_mlp_engine(c);
  ASSERT_NE(e, nullptr);
  Framework f;
  std::vector<float> l1(static_cast<std::size_t>(kHidden) * kIn), l2(static_cast<std::size_t>(kOut) * kHidden);
  std::int64_t prefetched = 0;
  for (int s = 0; s < 8; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    // From step 2 on (the fetch sequence is learned) every read starts 100 ms late.
    if (s == 2) inj.add({.kind = FaultKind::kDelay, .ops = FaultOps::kReads, .times = -1, .delay_ms = 100});
    const core::Result<StepStats> st = run_step(*e, f, s);
    ASSERT_TRUE(st.ok()) << st.status();
    prefetched += st->prefetched;
    Status r;
    if (s % 3 == 2) {
      r = e->save_checkpoint(ckpt(), {});
    } else {
      r = s % 2 ? e->read_compute("l2.w", l2) : e->read_compute("l1.w", l1);
    }
    EXPECT_TRUE(r.ok()) << r;
  }
  EXPECT_GT(prefetched, 0) << "no fetch was served by a prefetch: the test lost its point";
}

}  // namespace
}  // namespace strata::engine
