// The memory planner: byte counts per tier and per step against hand
// calculations, the placement search, machine probing, and every input error.
#include "engine/plan/plan.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/plan/machine.h"

namespace strata::engine {
namespace {

using core::StatusCode;

constexpr std::uint64_t kGiB = 1ull << 30;

Config bf16_config(OffloadDevice params, OffloadDevice optimizer) {
  Config c;
  c.precision = Precision::kBf16;
  c.zero.stage = 3;
  c.zero.offload_param.device = params;
  c.zero.offload_optimizer.device = optimizer;
  return c;
}

MachineSpec machine(std::uint64_t gpu_bytes, std::uint64_t ram_bytes, std::uint64_t disk_bytes) {
  MachineSpec m;
  m.gpu_bytes = gpu_bytes;
  m.gpu_source = "given (--gpu-memory)";
  m.ram_bytes = ram_bytes;
  m.ram_source = "given (--ram)";
  m.disk_bytes = disk_bytes;
  m.disk_source = "given (--disk)";
  return m;
}

ModelSpec params_model(std::int64_t num_params, std::int64_t num_layers) {
  ModelSpec m;
  m.num_params = num_params;
  m.num_layers = num_layers;
  return m;
}

// A transformer shape: L layers of hidden size h, vocabulary V; seq_len and
// micro_batch when given (else the defaults: 2048, the config's).
ModelSpec shape_model(std::int64_t num_layers, std::int64_t hidden_size, std::int64_t vocab_size,
                      std::int64_t seq_len = 0, std::int64_t micro_batch = 0) {
  ModelSpec m;
  m.num_layers = num_layers;
  m.hidden_size = hidden_size;
  m.vocab_size = vocab_size;
  if (seq_len > 0) m.seq_len = seq_len;
  m.micro_batch = micro_batch;
  return m;
}

const PlacementPlan& candidate(const Plan& plan, OffloadDevice params, OffloadDevice optimizer) {
  for (const PlacementPlan& c : plan.candidates) {
    if (c.placement.param_device == params && c.placement.optimizer_device == optimizer) return c;
  }
  ADD_FAILURE() << "no candidate";
  return plan.candidates.front();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The planner's reference case: 40B parameters, 48 layers, bf16, AdamW, no
// gradient accumulation, on 80 GiB GPU / 128 GiB RAM / 2 TB NVMe, with the
// DeepSpeed defaults for every size key. Hand calculation (P = T = 40e9):
//
// GPU (params not resident):
//   fetch group       = ceil(40e9 / 48)                       =   833,333,334 params
//   fetch window      = 1e9 max live / 1 group = 1 group x 2 B = 1,666,666,668 B
//   device grad bufs  = max(2, 5e8 reduce bucket / 1 group) = 2 groups x 2 B
//                                                              = 3,333,333,336 B
//   total                                                      = 5,000,000,004 B
// CPU RAM (pinned):
//   host gradients    = 40e9 x 2 B                             = 80,000,000,000 B
//   param staging     = 1 group x 2 B                          =  1,666,666,668 B
//                       (offload_param.buffer_count / buffer_size: no effect)
//   gradient staging  = 3 groups x 2 B                         =  5,000,000,004 B
//   optimizer's view  = 1 group x 2 B                          =  1,666,666,668 B
//   optimizer staging = 4 slots x (64 MiB / 4 B x 12 B), a chunk
//                       being within a group (833,355,776 after norm blocks)
//                                                              =    805,306,368 B
//   total                                                      = 89,138,639,708 B
// NVMe:
//   compute copies 40e9 x 2 = 80e9, master 40e9 x 4 = 160e9, moments 40e9 x 8
//   = 320e9; the swap files' reserve: 560e9 / 16 + 64 MiB, rounded up to a
//   MiB: 595,067,928,576 - 560e9 = 35,067,928,576; checkpoint 80e9 + 480e9 =
//   560e9; total 1,155,067,928,576 B.
// Capacities:
//   GPU  80 GiB  = 85,899,345,920 - 10%           (8,589,934,592) = 77,309,411,328
//   RAM 128 GiB = 137,438,953,472 - 10% - 4 GiB (18,038,862,643) = 119,400,090,829
//   NVMe 2 TB   = 2e12 - 5% (1e11)                                = 1.9e12
// Per step: host->device 2 x 2 B x 40e9 less the backward's first group,
// kept since the forward (2 x 833,333,333, P / L): 158,333,333,334;
// device->host 2 B x 40e9 = 80e9 (gradients); disk read 12 x 40e9 + the
// fetches 158,333,333,334 = 638,333,333,334 (the optimizer rewrites every
// compute copy: it does not read the old ones), disk write 12 x 40e9 + the
// new compute copies 2 x 40e9 = 560e9.
Config forty_b_config(OffloadDevice params, OffloadDevice optimizer) {
  return bf16_config(params, optimizer);
}
MachineSpec forty_b_machine() { return machine(80 * kGiB, 128 * kGiB, 2'000'000'000'000); }

TEST(Planner, FortyBillionFitsWithParamsAndOptimizerOnNvme) {
  const Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;

  EXPECT_EQ(plan->model.group_params, 833'333'334);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "fetch_window"), 1'666'666'668u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "device_gradient_buffers"), 3'333'333'336u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "persistent_params"), 0u);
  EXPECT_EQ(p.tier(Tier::kDevice).needed_bytes, 5'000'000'004u);

  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 80'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "param_staging"), 1'666'666'668u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "gradient_staging"), 5'000'000'004u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_compute_view"), 1'666'666'668u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_staging"), 805'306'368u);
  EXPECT_EQ(p.tier(Tier::kPinned).needed_bytes, 89'138'639'708u);

  EXPECT_EQ(p.item_bytes(Tier::kNvme, "compute_copies"), 80'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "master_weights"), 160'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "optimizer_moments"), 320'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "swap_reserve"), 35'067'928'576u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "checkpoint"), 560'000'000'000u);
  EXPECT_EQ(p.tier(Tier::kNvme).needed_bytes, 1'155'067'928'576u);

  EXPECT_EQ(p.tier(Tier::kDevice).available_bytes, 77'309'411'328u);
  EXPECT_EQ(p.tier(Tier::kPinned).margin_bytes, 18'038'862'643u);
  EXPECT_EQ(p.tier(Tier::kPinned).available_bytes, 119'400'090'829u);
  EXPECT_EQ(p.tier(Tier::kNvme).available_bytes, 1'900'000'000'000u);
  EXPECT_TRUE(p.tier(Tier::kDevice).fits);
  EXPECT_TRUE(p.tier(Tier::kPinned).fits);
  EXPECT_TRUE(p.tier(Tier::kNvme).fits);
  EXPECT_TRUE(plan->fits());

  EXPECT_EQ(p.traffic.host_to_device_bytes, 158'333'333'334u);
  EXPECT_EQ(p.traffic.device_to_host_bytes, 80'000'000'000u);
  EXPECT_EQ(p.traffic.disk_read_bytes, 638'333'333'334u);
  EXPECT_EQ(p.traffic.disk_write_bytes, 560'000'000'000u);
}

// The same placement with offload_param.max_in_cpu: whole homes of 833,333,334
// elements kept in pinned memory, as plan_layout keeps them. 8,333,333,340
// keeps 10 of the 48: 10 x 1,666,666,668 = 16,666,666,680 B move from NVMe
// to RAM (RAM 89,138,639,708 + that = 105,805,306,388 B); per step the other
// 38 groups' fetches are read: of the 95 fetches of a group's size (48 x 2,
// less the backward's first, the last group, kept since the forward) the
// kept groups are the first 10 (20 fetches), so 75 of 158,333,333,334 B x
// 75 / 95 = 125e9 (as scale_bench_plan measures it); and the other groups'
// new compute copies are written (80e9 - 10 x 1,666,666,666 = 63,333,333,340). With
// every home kept there is no param staging and no optimizer's host view.
TEST(Planner, MaxInCpuKeepsWholeComputeHomesInRam) {
  Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  config.zero.offload_param.max_in_cpu = 8'333'333'340;
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 16'666'666'680u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "compute_copies"), 63'333'333'320u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "param_staging"), 1'666'666'668u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_compute_view"), 1'666'666'668u);
  EXPECT_EQ(p.tier(Tier::kPinned).needed_bytes, 105'805'306'388u);
  EXPECT_EQ(p.traffic.host_to_device_bytes, 158'333'333'334u);  // the links do not change
  EXPECT_EQ(p.traffic.disk_read_bytes, 480'000'000'000u + 125'000'000'000u);
  EXPECT_EQ(p.traffic.disk_write_bytes, 480'000'000'000u + 63'333'333'340u);
  const std::string detail = [&] {
    for (const PlanItem& i : p.items) {
      if (i.name == "compute_copies_in_cpu") return i.detail;
    }
    return std::string();
  }();
  EXPECT_NE(detail.find("10 homes of 833,333,334 x 2 B"), std::string::npos) << detail;
  EXPECT_NE(detail.find("max_in_cpu = 8,333,333,340"), std::string::npos) << detail;
  // RAM holds 18 homes: 89,138,639,708 + 18 x 1,666,666,668 = 119,138,639,732
  // <= 119,400,090,829, 19 do not. The note's value leaves 4096 elements a
  // group for the engine's padding: 18 x (833,333,334 + 4096).
  const auto note_with = [](const Plan& plan, std::string_view text) {
    for (const std::string& n : plan.notes) {
      if (n.find(text) != std::string::npos) return n;
    }
    return std::string();
  };
  EXPECT_NE(note_with(*plan, "max_in_cpu = 15,000,073,740 (now 8,333,333,340) keeps the compute copies of 18 of 48 "
                             "groups (27.94 GiB) in CPU memory"),
            "");
  Config more = config;
  more.zero.offload_param.max_in_cpu = 15'000'073'740;
  core::Result<Plan> eighteen = make_plan(more, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(eighteen.ok());
  EXPECT_TRUE(eighteen->configured.fits);
  EXPECT_EQ(eighteen->configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 30'000'000'024u);  // 18 homes
  EXPECT_EQ(note_with(*eighteen, "RAM has room for more compute copies"), "");
  // A model whose every home fits: the note keeps them all (no param staging then).
  core::Result<Plan> small = make_plan(forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme),
                                       params_model(1'000'000'000, 8), forty_b_machine());
  ASSERT_TRUE(small.ok());
  EXPECT_NE(note_with(*small, "max_in_cpu = 1,000,032,768 (now 0) keeps the compute copies of 8 of 8 groups"), "");

  // One element short of 10 homes: 9.
  config.zero.offload_param.max_in_cpu = 8'333'333'339;
  plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 15'000'000'012u);

  // Every home: nothing of the compute copies on the drive or staged for it.
  config.zero.offload_param.max_in_cpu = 40'000'000'032;  // 48 homes
  plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok());
  const PlacementPlan& all = plan->configured;
  EXPECT_EQ(all.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 80'000'000'000u);
  EXPECT_EQ(all.item_bytes(Tier::kNvme, "compute_copies"), 0u);
  EXPECT_EQ(all.item_bytes(Tier::kPinned, "param_staging"), 0u);
  EXPECT_EQ(all.item_bytes(Tier::kPinned, "optimizer_compute_view"), 0u);
  EXPECT_EQ(all.traffic.disk_read_bytes, 480'000'000'000u);
  EXPECT_EQ(all.traffic.disk_write_bytes, 480'000'000'000u);
  EXPECT_FALSE(all.tier(Tier::kPinned).fits);  // 80e9 more of RAM than 119.4e9 holds

  // "auto" takes the most that fit in strata.budgets.pinned, as finalize
  // does: with the budget at the RAM the planner had (119,400,090,829 B
  // available), 17 homes, said in a note (under a budget the fit is
  // finalize's: the step's pinned working memory as it reserves it, above
  // the items' peak, so one home fewer than without one).
  Config autofill = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  autofill.zero.offload_param.max_in_cpu_auto = true;
  autofill.strata.budgets.pinned_bytes = 119'400'090'829;
  core::Result<Plan> filled = make_plan(autofill, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_TRUE(filled->configured.fits);
  EXPECT_EQ(filled->configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 28'333'333'356u);  // 17 homes
  EXPECT_NE(note_with(*filled, "max_in_cpu \"auto\": the compute copies of 17 of 48 groups fit"), "");
  EXPECT_EQ(note_with(*filled, "RAM has room for more compute copies"), "");

  // No effect unless the compute copies are on nvme.
  Config cpu = forty_b_config(OffloadDevice::kNone, OffloadDevice::kNvme);
  cpu.zero.offload_param.max_in_cpu = 8'333'333'340;
  plan = make_plan(cpu, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu"), 0u);
}

// The same model, configured ZeRO-Offload style (params and optimizer in CPU
// memory). Hand calculation of why the other placements fail (a group is
// 833,333,334 params, 1,666,666,668 B):
//   optimizer on cpu: RAM needs master + moments 480e9 + host grads 80e9
//     + gradient staging (3 groups) > 119.4e9
//   params on cpu, optimizer on nvme: compute copies 80e9 + host grads 80e9
//     + gradient staging 5.0e9 + optimizer staging 0.8e9 = 165.8e9 > 119.4e9
//   params on the GPU: compute copies 80e9 > 77.3e9 alone
// What fits: params and optimizer on nvme, and then the largest
// optimizer_cpu_fraction in 0.05 steps: 0.05 keeps 2e9 params' state (24e9 B)
// in RAM: 89.1e9 + 24e9 = 113.1e9 <= 119.4e9; 0.10 would need 137.1e9.
// Its disk traffic: 12 B x 38e9 = 456e9 each way, plus 158.3e9 of fetches
// read and 80e9 of new compute copies written: read 614,333,333,334, write
// 536e9.
TEST(Planner, FortyBillionRecommendsNvmeWhenCpuPlacementDoesNotFit) {
  const Config config = forty_b_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_FALSE(plan->fits());
  EXPECT_EQ(plan->configured.tier(Tier::kPinned).needed_bytes,
            80'000'000'000u + 80'000'000'000u + 480'000'000'000u + 5'000'000'004u);
  EXPECT_FALSE(plan->configured.tier(Tier::kPinned).fits);
  ASSERT_EQ(plan->configured.reasons.size(), 1u);
  EXPECT_TRUE(contains(plan->configured.reasons[0], "CPU RAM needs"))
      << plan->configured.reasons[0];

  const PlacementPlan& opt_cpu = candidate(*plan, OffloadDevice::kNvme, OffloadDevice::kCpu);
  EXPECT_FALSE(opt_cpu.fits);
  EXPECT_EQ(opt_cpu.tier(Tier::kPinned).needed_bytes,
            480'000'000'000u + 80'000'000'000u + 1'666'666'668u + 5'000'000'004u + 1'666'666'668u);
  const PlacementPlan& params_cpu = candidate(*plan, OffloadDevice::kCpu, OffloadDevice::kNvme);
  EXPECT_FALSE(params_cpu.fits);
  EXPECT_EQ(params_cpu.placement.optimizer_cpu_fraction, 0.0);
  EXPECT_EQ(params_cpu.tier(Tier::kPinned).needed_bytes, 165'805'306'372u);
  for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    const PlacementPlan& on_gpu = candidate(*plan, OffloadDevice::kNone, opt);
    EXPECT_FALSE(on_gpu.tier(Tier::kDevice).fits);
  }
  int fitting = 0;
  for (const PlacementPlan& c : plan->candidates) fitting += c.fits ? 1 : 0;
  EXPECT_EQ(fitting, 1);

  ASSERT_TRUE(plan->recommended.has_value());
  const PlacementPlan& r = *plan->recommended;
  EXPECT_EQ(r.placement.param_device, OffloadDevice::kNvme);
  EXPECT_EQ(r.placement.optimizer_device, OffloadDevice::kNvme);
  EXPECT_DOUBLE_EQ(r.placement.optimizer_cpu_fraction, 0.05);
  EXPECT_EQ(r.tier(Tier::kPinned).needed_bytes, 113'138'639'708u);
  EXPECT_EQ(r.traffic.disk_read_bytes, 614'333'333'334u);
  EXPECT_EQ(r.traffic.disk_write_bytes, 536'000'000'000u);
  ASSERT_EQ(plan->changes.size(), 3u);
  EXPECT_EQ(plan->changes[0].key_path, "zero_optimization.offload_param.device");
  EXPECT_EQ(plan->changes[0].from, "\"cpu\"");
  EXPECT_EQ(plan->changes[0].to, "\"nvme\"");
  EXPECT_EQ(plan->changes[1].key_path, "zero_optimization.offload_optimizer.device");
  EXPECT_EQ(plan->changes[2].key_path, "strata.optimizer_cpu_fraction");
  EXPECT_EQ(plan->changes[2].to, "0.05");

  const std::string table = format_plan_table(*plan);
  EXPECT_TRUE(contains(table, "DOES NOT FIT")) << table;
  EXPECT_TRUE(
      contains(table, "set zero_optimization.offload_param.device = \"nvme\" (now \"cpu\")"))
      << table;
  EXPECT_TRUE(contains(table, "80.00 GiB")) << table;
}

// The SSD wear estimate for the 40B model on nvme (writes 560e9 B per step,
// FortyBillionFitsWithParamsAndOptimizerOnNvme) over two swap paths on two
// drives rated 600 TBW, 60 s per step. Hand calculation:
//   per drive 280e9 B per step: 600e12 / 280e9 = 2142.86 -> 2142 steps, x 60 s = 1.4875 days
//   cpu fraction raised to 0.05 (the most that fits, FortyBillionRecommends...):
//     536e9 per step, 268e9 per drive: 2238.8 -> 2238 steps
//   optimizer state in pinned memory (does not fit): the compute copies only, 80e9
//   compute copies in pinned memory (does not fit, at any cpu fraction): 480e9
TEST(Planner, WearCountsStepsUntilEachDrivesRating) {
  Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  config.strata.io.paths = {"/nvme0/swap", "/nvme1/swap"};
  MachineSpec m = forty_b_machine();
  m.disks = {{"/nvme0/swap", "/nvme0", 1'000'000'000'000, 7, true},
             {"/nvme1/swap", "/nvme1", 1'000'000'000'000, 8, true}};
  PlanOptions options;
  options.drive = DriveEndurance{.tbw = 600, .step_seconds = 60};
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), m, options);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_TRUE(plan->wear.has_value());
  const WearPlan& w = *plan->wear;
  EXPECT_DOUBLE_EQ(w.rated_bytes_per_drive, 600e12);
  const PlacementWear& c = w.configured;
  EXPECT_EQ(c.write_bytes_per_step, plan->configured.traffic.disk_write_bytes);
  EXPECT_EQ(c.write_bytes_per_step, 560'000'000'000u);
  ASSERT_EQ(c.drives.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(c.drives[i].paths, std::vector<std::string>{config.strata.io.paths[i]});
    EXPECT_EQ(c.drives[i].write_bytes_per_step, 280'000'000'000u);
    EXPECT_EQ(c.drives[i].steps, 2142u);
  }
  EXPECT_EQ(c.steps, 2142u);
  ASSERT_TRUE(c.days.has_value());
  EXPECT_DOUBLE_EQ(*c.days, 2142 * 60 / 86400.0);

  ASSERT_EQ(w.alternatives.size(), 3u);
  const PlacementWear& raised = w.alternatives[0];
  EXPECT_TRUE(raised.fits);
  EXPECT_DOUBLE_EQ(raised.placement.optimizer_cpu_fraction, 0.05);
  ASSERT_TRUE(plan->recommended.has_value());  // the search's own figure for that placement
  EXPECT_EQ(raised.write_bytes_per_step, plan->recommended->traffic.disk_write_bytes);
  EXPECT_EQ(raised.write_bytes_per_step, 536'000'000'000u);
  EXPECT_EQ(raised.steps, 2238u);
  ASSERT_EQ(raised.changes.size(), 1u);
  EXPECT_EQ(raised.changes[0].key_path, "strata.optimizer_cpu_fraction");
  const PlacementWear& opt_cpu = w.alternatives[1];
  EXPECT_FALSE(opt_cpu.fits);
  EXPECT_EQ(opt_cpu.placement.optimizer_device, OffloadDevice::kCpu);
  EXPECT_EQ(opt_cpu.write_bytes_per_step, 80'000'000'000u);
  EXPECT_EQ(opt_cpu.write_bytes_per_step, candidate(*plan, OffloadDevice::kNvme, OffloadDevice::kCpu).traffic.disk_write_bytes);
  EXPECT_FALSE(opt_cpu.reasons.empty());
  const PlacementWear& params_cpu = w.alternatives[2];
  EXPECT_FALSE(params_cpu.fits);
  EXPECT_EQ(params_cpu.placement.param_device, OffloadDevice::kCpu);
  EXPECT_EQ(params_cpu.write_bytes_per_step, 480'000'000'000u);

  const std::string table = format_plan_table(*plan);
  EXPECT_TRUE(contains(table, "SSD wear: 600 TBW per drive")) << table;
  EXPECT_TRUE(contains(table, "the drives last 2,142 steps, 1.49 days at 60 s per step")) << table;
  EXPECT_TRUE(contains(table, "writes least while fitting: strata.optimizer_cpu_fraction = 0.05")) << table;
  const std::string json = plan_to_json(*plan);
  EXPECT_TRUE(contains(json, "\"steps\": 2142")) << json;

  // Two paths on one file system are one drive: it takes both halves.
  m.disks[1].device_id = 7;
  m.disks[1].counted = false;
  plan = make_plan(config, params_model(40'000'000'000, 48), m, options);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->wear->configured.drives.size(), 1u);
  EXPECT_EQ(plan->wear->configured.drives[0].paths, config.strata.io.paths);
  EXPECT_EQ(plan->wear->configured.drives[0].write_bytes_per_step, 560'000'000'000u);
  EXPECT_EQ(plan->wear->configured.steps, 1071u);  // 600e12 / 560e9 = 1071.4
}

TEST(Planner, WearByDwpdAndWithoutSwapWrites) {
  const Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  PlanOptions options;
  options.drive = DriveEndurance{.dwpd = 1, .capacity_bytes = 3'840'000'000'000};  // 5 years by default
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine(), options);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  // 1 x 3.84e12 x 365 x 5 = 7008e12 B per drive; one path (the nvme_path): 7008e12 / 560e9 = 12514.3
  EXPECT_DOUBLE_EQ(plan->wear->rated_bytes_per_drive, 1.0 * 3.84e12 * 365.0 * 5.0);
  EXPECT_EQ(plan->wear->configured.drives.size(), 1u);
  EXPECT_EQ(plan->wear->configured.steps, 12514u);
  EXPECT_FALSE(plan->wear->configured.days.has_value());  // no step time
  EXPECT_TRUE(contains(format_plan_table(*plan), "give --step-seconds")) << format_plan_table(*plan);

  // Nothing on nvme: no drives, no writes, nothing to change.
  const Config gpu = bf16_config(OffloadDevice::kNone, OffloadDevice::kNone);
  plan = make_plan(gpu, params_model(1'000'000'000, 8), forty_b_machine(), options);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->wear->configured.write_bytes_per_step, 0u);
  EXPECT_TRUE(plan->wear->configured.drives.empty());
  EXPECT_FALSE(plan->wear->configured.steps.has_value());
  EXPECT_TRUE(plan->wear->alternatives.empty());
  EXPECT_TRUE(contains(format_plan_table(*plan), "no swap writes")) << format_plan_table(*plan);

  // Bad ratings name the flag.
  const std::vector<std::pair<DriveEndurance, std::string>> bad = {
      {{.tbw = 600, .dwpd = 1, .capacity_bytes = 1}, "not both"},
      {{.tbw = -1}, "--drive-tbw must be a positive number"},
      {{.dwpd = -1, .capacity_bytes = 1}, "--drive-dwpd must be a positive number"},
      {{.dwpd = 1}, "--drive-capacity"},
      {{.dwpd = 1, .capacity_bytes = 1, .warranty_years = 0}, "--warranty-years"},
      {{.tbw = 600, .step_seconds = -5}, "--step-seconds"},
  };
  for (const auto& [drive, needle] : bad) {
    options.drive = drive;
    plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine(), options);
    ASSERT_FALSE(plan.ok()) << needle;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(std::string(plan.status().message()), needle)) << plan.status().message();
  }
}

// The engine ignores offload_param.buffer_count / buffer_size (docs/config.md),
// so the plan's staging does not follow them either.
TEST(Planner, ParamStagingIgnoresDeepSpeedBufferKeys) {
  Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  config.zero.offload_param.buffer_count = 50;
  config.zero.offload_param.buffer_size = 1'000'000'000;
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "param_staging"), 1'666'666'668u);
  config.strata.budgets.staging_bytes = 1;
  plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  for (const std::string& n : plan->notes) EXPECT_FALSE(contains(n, "buffer_count")) << n;
}

TEST(Planner, FortyBillionOnNvmeRecommendsTheLargestCpuFractionThatFits) {
  const Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), forty_b_machine());
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->fits());
  ASSERT_TRUE(plan->recommended.has_value());
  EXPECT_DOUBLE_EQ(plan->recommended->placement.optimizer_cpu_fraction, 0.05);
  ASSERT_EQ(plan->changes.size(), 1u);
  EXPECT_EQ(plan->changes[0].key_path, "strata.optimizer_cpu_fraction");
  EXPECT_EQ(plan->changes[0].from, "0");
}

// ZeRO-Offload: fp16, Adam, optimizer on cpu, params on the GPU, 8 gradient
// accumulation steps, micro-batch 4 from the config. Transformer L = 32,
// h = 4096, V = 32000, seq 2048, full checkpointing, a = 4096 / 128 = 32.
//   P = 32 (12 h^2 + 13 h) + V h + 2 h = 32 x 201,379,840 + 131,072,000 + 8,192
//     = 6,575,235,072
// GPU: compute copies 2P = 13,150,470,144
//      device grad buffers: group = max(12h^2 + 13h, V h) = 201,379,840;
//        max(2, 5e8 reduce bucket / group) = 2 groups x 2 B = 805,519,360
//      activations: one layer s b (34 h + 5 a s) = 8192 x 466,944 = 3,825,205,248;
//        kept 2 s b h = 67,108,864 per layer; 32 x 67,108,864 + 3,825,205,248
//        = 5,972,688,896
//      logits 4 s b V = 1,048,576,000
//      total 20,977,254,400
// CPU:  host grads fp32 4P = 26,300,940,288, master 4P, moments 8P: 16P
//       = 105,203,761,152; gradient staging 3 groups x 2 B = 1,208,279,040
//       and the optimizer's view of one group 402,759,680: total
//       106,814,799,872
// Per step: host->device 2P = 13,150,470,144 (new compute copies),
// device->host 8 micro-batches x 2P of gradients = 105,203,761,152 (the
// optimizer rewrites every compute copy: the old ones are not read).
TEST(Planner, ZeroOffloadCpuMatchesHandCalculation) {
  Config config;
  config.precision = Precision::kFp16;
  config.optimizer.type = OptimizerType::kAdam;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = OffloadDevice::kCpu;
  config.gradient_accumulation_steps = 8;
  config.train_micro_batch_size_per_gpu = 4;
  const ModelSpec model = shape_model(32, 4096, 32000);
  core::Result<Plan> plan =
      make_plan(config, model, machine(24 * kGiB, 256 * kGiB, 1'000'000'000'000));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const std::int64_t P = 6'575'235'072;
  EXPECT_EQ(plan->model.num_params, P);
  EXPECT_EQ(plan->model.num_heads, 32);
  EXPECT_EQ(plan->model.micro_batch, 4);
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "compute_copies"), 13'150'470'144u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "device_gradient_buffers"), 805'519'360u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "activations"), 5'972'688'896u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "logits"), 1'048'576'000u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "fetch_window"), 0u);
  EXPECT_EQ(p.tier(Tier::kDevice).needed_bytes, 20'977'254'400u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 26'300'940'288u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), 26'300'940'288u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_moments"), 52'601'880'576u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "gradient_staging"), 1'208'279'040u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_compute_view"), 402'759'680u);
  EXPECT_EQ(p.tier(Tier::kPinned).needed_bytes, 106'814'799'872u);
  EXPECT_EQ(p.tier(Tier::kNvme).needed_bytes, 14u * P);  // the checkpoint only
  EXPECT_TRUE(plan->fits());
  EXPECT_EQ(p.traffic.host_to_device_bytes, 13'150'470'144u);
  EXPECT_EQ(p.traffic.device_to_host_bytes, 105'203'761'152u);
  EXPECT_EQ(p.traffic.disk_bytes(), 0u);
  // Nothing that fits moves fewer bytes: everything on the GPU needs 16P + act.
  EXPECT_FALSE(plan->recommended.has_value());
  EXPECT_FALSE(candidate(*plan, OffloadDevice::kNone, OffloadDevice::kNone).fits);
  // With params offloaded the per-block small tensors stay on the GPU:
  // 13 h per block (all below the 1e5 threshold) x 32 + final norm 2 h.
  const PlacementPlan& offloaded = candidate(*plan, OffloadDevice::kCpu, OffloadDevice::kCpu);
  EXPECT_EQ(plan->model.persistent_params, 32 * 13 * 4096 + 2 * 4096);
  EXPECT_EQ(offloaded.item_bytes(Tier::kDevice, "persistent_params"),
            2u * (32 * 13 * 4096 + 2 * 4096));
}

// Four ranks, hand-calculated: P = T = 4 groups of 2^21 (32 norm blocks
// each, a multiple of 4 x 65,536: no padding), bf16, AdamW on cpu, stage 2.
// Each rank keeps T/4 of the master, moments and (fp32) host gradients;
// compute copies stay whole; the collectives send 3/4 x (4 B + 2 B) x T.
// The gradients are summed on the device (strata.device_collectives "on")
// or, "off", on the host.
TEST(Planner, RanksShardTheOptimizerStateAndGradients) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  config.zero.stage = 2;
  config.strata.device_collectives = DeviceCollectives::kOn;
  constexpr std::int64_t T = 4 * (std::int64_t{1} << 21);
  PlanOptions options;
  options.ranks = 4;
  core::Result<Plan> plan = make_plan(config, params_model(T, 4), machine(80 * kGiB, 512 * kGiB, 4000 * kGiB), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const PlacementPlan& p = plan->configured;
  const std::uint64_t t = T, shard = t / 4, group = t / 4;
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "compute_copies"), 2 * t);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 4 * shard);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), 4 * shard);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_moments"), 8 * shard);
  // A group's fp32 gradients summed on the device in place, the rank's
  // fp32 shard of each coming down (two in the pinned staging at once).
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "device_gradient_sums"), 4 * group);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "rank_gradient_sums"), 0u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "gradient_staging"), 2 * (4 * group / 4));
  EXPECT_EQ(p.traffic.device_to_host_bytes, 4 * shard);
  // A group's gathered compute copies: a buffer of their own (no staging buffer is their size).
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "rank_compute_gather"), 2 * group);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "checkpoint"), (2 * t + 12 * t) / 4);
  EXPECT_EQ(p.traffic.network_bytes, 6 * t / 4 * 3);
  {
    // Summed on the host: every micro-batch's gradients come down whole and
    // the pass sums them in pinned memory; the gather reuses a staging buffer.
    Config host = config;
    host.strata.device_collectives = DeviceCollectives::kOff;
    core::Result<Plan> h = make_plan(host, params_model(T, 4), machine(80 * kGiB, 512 * kGiB, 4000 * kGiB), options);
    ASSERT_TRUE(h.ok()) << h.status();
    const PlacementPlan& q = h->configured;
    EXPECT_EQ(q.item_bytes(Tier::kDevice, "device_gradient_sums"), 0u);
    EXPECT_EQ(q.item_bytes(Tier::kPinned, "rank_gradient_sums"), 4 * (group + group / 4));
    EXPECT_EQ(q.item_bytes(Tier::kPinned, "rank_compute_gather"), 0u);
    EXPECT_EQ(q.item_bytes(Tier::kPinned, "gradient_staging"), 2 * (2 * group));
    EXPECT_EQ(q.traffic.device_to_host_bytes, 2 * t);
    EXPECT_EQ(q.traffic.network_bytes, p.traffic.network_bytes);
  }
  {
    // communication_data_type bf16: the sums on the device in bf16, half the bytes.
    Config half = config;
    half.communication_data_type = Precision::kBf16;
    core::Result<Plan> h = make_plan(half, params_model(T, 4), machine(80 * kGiB, 512 * kGiB, 4000 * kGiB), options);
    ASSERT_TRUE(h.ok()) << h.status();
    const PlacementPlan& q = h->configured;
    EXPECT_EQ(q.item_bytes(Tier::kDevice, "device_gradient_sums"), 2 * group);
    EXPECT_EQ(q.item_bytes(Tier::kPinned, "gradient_staging"), 2 * (2 * group / 4));
    EXPECT_EQ(q.traffic.device_to_host_bytes, 2 * shard);
    EXPECT_EQ(q.traffic.network_bytes, (2 + 2) * t / 4 * 3);
  }
  EXPECT_EQ(p.ranks_per_node, 4);
  // One machine's RAM and disk are shared by its four ranks (margins too).
  EXPECT_EQ(p.tier(Tier::kPinned).capacity_bytes, 128 * kGiB);
  EXPECT_EQ(p.tier(Tier::kDevice).capacity_bytes, 80 * kGiB);
  EXPECT_TRUE(contains(p.tier(Tier::kPinned).capacity_source, "/ 4 ranks on the machine"));
  // On two machines each shares its RAM with two ranks; the bytes per rank stay.
  options.nodes = 2;
  core::Result<Plan> two = make_plan(config, params_model(T, 4), machine(80 * kGiB, 512 * kGiB, 4000 * kGiB), options);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->configured.tier(Tier::kPinned).capacity_bytes, 256 * kGiB);
  EXPECT_EQ(two->configured.tier(Tier::kPinned).needed_bytes, p.tier(Tier::kPinned).needed_bytes);
  EXPECT_TRUE(contains(format_plan_table(*two), "the machine's 2 ranks: CPU RAM"));
  EXPECT_TRUE(contains(plan_to_json(*two), "\"network_bytes\": " + std::to_string(6 * t / 4 * 3)));
}

// Stage 3 over four ranks, the compute copies' home pinned: a fetch
// gathered on the device takes every rank's shard of the group there (one
// group's bytes) and brings up the rank's own shard alone, a quarter of what
// a fetch gathered on the host brings up whole; the host gather's buffers
// stay for read_compute and export.
TEST(Planner, Stage3RanksGatherTheirFetchesOnTheDevice) {
  Config config = bf16_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  config.zero.stage = 3;
  constexpr std::int64_t T = 4 * (std::int64_t{1} << 21);
  PlanOptions options;
  options.ranks = 4;
  const auto plan_for = [&](DeviceCollectives mode) {
    Config c = config;
    c.strata.device_collectives = mode;
    core::Result<Plan> p = make_plan(c, params_model(T, 4), machine(80 * kGiB, 512 * kGiB, 4000 * kGiB), options);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? p->configured : PlacementPlan{};
  };
  const PlacementPlan on = plan_for(DeviceCollectives::kOn), off = plan_for(DeviceCollectives::kOff);
  const std::uint64_t group = std::uint64_t{1} << 21, home = group / 4;
  EXPECT_EQ(on.item_bytes(Tier::kDevice, "device_fetch_gather"), 4 * home * 2);
  EXPECT_EQ(on.item_bytes(Tier::kPinned, "rank_fetch_gather"), 0u);
  EXPECT_EQ(off.item_bytes(Tier::kDevice, "device_fetch_gather"), 0u);
  EXPECT_EQ(off.item_bytes(Tier::kPinned, "rank_fetch_gather"), 4 * (home * 2 + 8) + group * 2);
  // Outside the step a read gathers on the host all the same.
  EXPECT_EQ(on.item_bytes(Tier::kPinned, "rank_read_gather"), 4 * (home * 2 + 8) + group * 2);
  ASSERT_GT(on.traffic.host_to_device_bytes, 0u);
  EXPECT_EQ(off.traffic.host_to_device_bytes, 4 * on.traffic.host_to_device_bytes);
  EXPECT_EQ(on.traffic.network_bytes, off.traffic.network_bytes);
}

TEST(Planner, RanksPadEachGroupToWholeNormBlocksPerRank) {
  // Three groups of 100,000 trainable elements on 3 ranks: each group padded
  // to 3 norm blocks (196,608), one block per rank: the rank keeps 3 x
  // 65,536 elements of state, not 100,000. With one rank the plan counts T.
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  config.zero.stage = 2;
  PlanOptions options;
  options.ranks = 3;
  core::Result<Plan> plan = make_plan(config, params_model(300'000, 3), machine(80 * kGiB, 64 * kGiB, 100 * kGiB), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "master_weights"), 3u * 65'536 * 4);
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "host_gradients"), 3u * 65'536 * 4);
  EXPECT_EQ(plan->configured.traffic.network_bytes, 3u * 196'608 * 6 / 3 * 2);
  core::Result<Plan> one = make_plan(config, params_model(300'000, 3), machine(80 * kGiB, 64 * kGiB, 100 * kGiB));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->configured.item_bytes(Tier::kPinned, "master_weights"), 300'000u * 4);
  EXPECT_EQ(one->configured.traffic.network_bytes, 0u);
}

TEST(Planner, RanksAndNodesThatDoNotDivideAreErrors) {
  const Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  PlanOptions options;
  options.ranks = 4;
  options.nodes = 3;
  auto r = make_plan(config, params_model(1'000'000, 2), machine(80 * kGiB, 64 * kGiB, 100 * kGiB), options);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(std::string(r.status().message()), "--nodes must divide --ranks")) << r.status();
  options.nodes = 1;
  options.ranks = 0;
  r = make_plan(config, params_model(1'000'000, 2), machine(80 * kGiB, 64 * kGiB, 100 * kGiB), options);
  EXPECT_TRUE(contains(std::string(r.status().message()), "--ranks")) << r.status();
  Config speculative = config;
  speculative.strata.overlap = OverlapMode::kSpeculative;
  options.ranks = 2;
  r = make_plan(speculative, params_model(1'000'000, 2), machine(80 * kGiB, 64 * kGiB, 100 * kGiB), options);
  EXPECT_TRUE(contains(std::string(r.status().message()), "speculative")) << r.status();
}

// Frozen parameters have a compute copy only. 10e9 params, 3/4 frozen:
// T = 2.5e9 trainable. Params and optimizer on cpu, bf16, no accumulation.
TEST(Planner, FrozenParametersHaveOnlyComputeCopies) {
  const Config config = bf16_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  ModelSpec model = params_model(10'000'000'000, 40);
  model.frozen_fraction = 0.75;
  core::Result<Plan> plan =
      make_plan(config, model, machine(80 * kGiB, 512 * kGiB, 4'000'000'000'000));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->model.num_trainable_params, 2'500'000'000);
  EXPECT_EQ(plan->model.num_frozen_params, 7'500'000'000);
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "compute_copies"), 20'000'000'000u);  // all 10e9 x 2
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 5'000'000'000u);   // 2.5e9 x 2
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), 10'000'000'000u);  // 2.5e9 x 4
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_moments"), 20'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "checkpoint"), 20'000'000'000u + 30'000'000'000u);
  // Fetching touches every parameter (twice, less the 1e9 max live / 250e6
  // = 4 groups the backward finds kept since the forward: 2 x (20e9 - 1e9));
  // gradients only the trainable ones.
  EXPECT_EQ(p.traffic.host_to_device_bytes, 38'000'000'000u);
  EXPECT_EQ(p.traffic.device_to_host_bytes, 5'000'000'000u);

  model.frozen_fraction = 1.0;
  plan = make_plan(config, model, machine(80 * kGiB, 512 * kGiB, 4'000'000'000'000));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "master_weights"), 0u);
  EXPECT_EQ(plan->configured.traffic.device_to_host_bytes, 0u);
}

// LoRA (--lora 16): a 64.7B base (h 8192, 80 layers, V 32000) frozen and
// adapters of 16 x 16 x 8192 = 2,097,152 in every layer (167,772,160 in
// all): every group is mixed, so a step's gradients and optimizer view are a
// group's trainable part (2,097,152 x 2 B), not whole groups, and with the
// parameters on nvme the base's home is its files: the swap holds the
// adapters' copies alone and the base is read from the files on every fetch;
// strata.frozen_base "swap" puts it back on the swap drive.
TEST(Planner, LoraMixesEveryGroupAndReadsTheBaseFromItsFiles) {
  Config config = bf16_config(OffloadDevice::kNvme, OffloadDevice::kCpu);
  ModelSpec model = shape_model(80, 8192, 32000, 4096, 1);
  model.lora_rank = 16;
  const MachineSpec m = machine(80 * kGiB, 128 * kGiB, 2'000'000'000'000);
  core::Result<Plan> plan = make_plan(config, model, m);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const std::int64_t base = 64'695'189'504, adapters = 80ll * 16 * 16 * 8192;
  EXPECT_EQ(plan->model.num_trainable_params, adapters);
  EXPECT_EQ(plan->model.num_frozen_params, base);
  EXPECT_EQ(plan->model.num_params, base + adapters);
  EXPECT_TRUE(plan->model.mixed_groups);
  const PlacementPlan& p = plan->configured;
  EXPECT_TRUE(p.fits);
  const std::uint64_t part = adapters / 80 * 2;
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "compute_copies"), static_cast<std::uint64_t>(adapters) * 2);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "gradient_staging"), 3 * part);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_compute_view"), part);
  // The device's gradient buffers are trainable parts too, as many as
  // reduce_bucket_size holds (its elements over a part's, two at least, one
  // per group at most).
  const auto buffers = std::min<std::int64_t>(
      80, std::max<std::int64_t>(2, config.zero.reduce_bucket_size / static_cast<std::int64_t>(adapters / 80)));
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "device_gradient_buffers"), static_cast<std::uint64_t>(buffers) * part);
  EXPECT_LT(p.item_bytes(Tier::kDevice, "device_gradient_buffers"), p.item_bytes(Tier::kDevice, "fetch_window"));
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), static_cast<std::uint64_t>(adapters) * 4);
  EXPECT_EQ(p.traffic.device_to_host_bytes, static_cast<std::uint64_t>(adapters) * 2);
  // Every fetch reads the base from its files: its share of the fetches' reads.
  EXPECT_GT(p.traffic.file_read_bytes, 0u);
  // (read x base / (base + adapters), rounded down: 3.98 B per parameter
  // here, the forward's and the backward's fetches less the backward's first
  // group, kept since the forward; read / P first in integers gave 3 B.)
  EXPECT_EQ(p.traffic.file_read_bytes,
            static_cast<std::uint64_t>(static_cast<long double>(p.traffic.disk_read_bytes) * static_cast<long double>(base) /
                                       static_cast<long double>(base + adapters)));
  EXPECT_GT(p.traffic.file_read_bytes, 3.9 * static_cast<double>(base));
  EXPECT_EQ(p.traffic.disk_write_bytes, static_cast<std::uint64_t>(adapters) * 2);  // the adapters' new copies
  // A checkpoint leaves the base out (its files are named), unless strata.checkpoint.keep_base.
  const std::uint64_t checkpoint = p.item_bytes(Tier::kNvme, "checkpoint");
  Config keep = config;
  keep.strata.checkpoint.keep_base = true;
  const core::Result<Plan> kept = make_plan(keep, model, m);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->configured.item_bytes(Tier::kNvme, "checkpoint") - checkpoint, static_cast<std::uint64_t>(base) * 2);

  // "files" where the engine cannot read the base from its files is refused, naming the key.
  Config pinned_files = bf16_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  pinned_files.strata.frozen_base = FrozenBase::kFiles;
  const core::Result<Plan> refused = make_plan(pinned_files, model, m);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(std::string(refused.status().message()), "strata.frozen_base \"files\"")) << refused.status();
  // So is "files" with offload_param.max_in_cpu keeping groups of the base in
  // CPU memory; "auto" keeps them there, their base and all, and reads the
  // others' from the files.
  Config kept_files = config;
  kept_files.strata.frozen_base = FrozenBase::kFiles;
  kept_files.zero.offload_param.max_in_cpu = 1'000'000'000'000;
  const core::Result<Plan> kept_refused = make_plan(kept_files, model, m);
  ASSERT_FALSE(kept_refused.ok());
  EXPECT_TRUE(contains(std::string(kept_refused.status().message()), "offload_param.max_in_cpu"))
      << kept_refused.status();
  Config kept_auto = config;
  kept_auto.zero.offload_param.max_in_cpu = p.item_bytes(Tier::kDevice, "fetch_window") / 2;  // one home
  const core::Result<Plan> one_kept = make_plan(kept_auto, model, m);
  ASSERT_TRUE(one_kept.ok()) << one_kept.status();
  EXPECT_EQ(one_kept->configured.item_bytes(Tier::kPinned, "compute_copies_in_cpu"),
            p.item_bytes(Tier::kDevice, "fetch_window"));
  EXPECT_LT(one_kept->configured.traffic.file_read_bytes, p.traffic.file_read_bytes);

  config.strata.frozen_base = FrozenBase::kSwap;
  plan = make_plan(config, model, m);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kNvme, "compute_copies"), static_cast<std::uint64_t>(base + adapters) * 2);
  EXPECT_EQ(plan->configured.traffic.file_read_bytes, 0u);
  EXPECT_EQ(plan->configured.traffic.disk_read_bytes, p.traffic.disk_read_bytes);

  // --frozen-fraction's groups are wholly frozen or wholly trainable: a
  // trainable group moves whole.
  ModelSpec frozen = params_model(10'000'000'000, 40);
  frozen.frozen_fraction = 0.75;
  plan = make_plan(config, frozen, m);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->model.mixed_groups);
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "gradient_staging"), 3u * 250'000'000 * 2);
}

// gradient_accumulation_steps > 1: host gradients are fp32 (4 B), and each
// micro-batch fetches and sends gradients again. 1e9 params, params on the
// GPU, optimizer on cpu, 4 steps: host grads 4e9; d2h 4 x 2 B x 1e9 = 8e9
// of gradients (the optimizer's view of the compute copies is written, not
// read); h2d 2 B x 1e9 = 2e9 (the new copies, once per step).
TEST(Planner, GradientAccumulationUsesFp32HostGradients) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  config.gradient_accumulation_steps = 4;
  core::Result<Plan> plan = make_plan(config, params_model(1'000'000'000, 10),
                                      machine(80 * kGiB, 128 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 4'000'000'000u);
  EXPECT_EQ(p.traffic.device_to_host_bytes, 8'000'000'000u);
  EXPECT_EQ(p.traffic.host_to_device_bytes, 2'000'000'000u);

  config.gradient_accumulation_steps = 1;
  plan = make_plan(config, params_model(1'000'000'000, 10),
                   machine(80 * kGiB, 128 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "host_gradients"), 2'000'000'000u);

  // fp32 compute: copies and gradients are 4 B whatever the accumulation.
  config.precision = Precision::kFp32;
  plan = make_plan(config, params_model(1'000'000'000, 10),
                   machine(80 * kGiB, 128 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kDevice, "compute_copies"), 4'000'000'000u);
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "host_gradients"), 4'000'000'000u);
}

// offload_optimizer.ratio = 0.25: a quarter of the optimizer is updated on
// the CPU, the rest stays on the GPU. 4e9 params, bf16, params on the GPU:
// CPU share 1e9, GPU share 3e9. Every gradient comes down to the host (the
// gradient pass is the CPU's): host gradients 4e9 x 2 B; the GPU share's go
// back up chunk by chunk (16,777,216 elements: 64 MiB of master) for the
// device's Adam, whose new compute copies come down to the optimizer's view
// of each group before it goes home.
TEST(Planner, RatioBelowOneKeepsPartOfTheOptimizerOnTheGpu) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  config.zero.offload_optimizer.ratio = 0.25;
  core::Result<Plan> plan = make_plan(config, params_model(4'000'000'000, 32),
                                      machine(141 * kGiB, 128 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), 4'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_moments"), 8'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "host_gradients"), 8'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "master_weights"), 12'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "optimizer_moments"), 24'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "compute_copies"), 8'000'000'000u);
  // group = 4e9 / 32 = 125e6; 5e8 reduce bucket / group = 4 groups x 2 B.
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "device_gradient_buffers"), 1'000'000'000u);
  // One chunk's gradients up and new compute copies down: 16,777,216 x (2 + 2) B.
  EXPECT_EQ(p.item_bytes(Tier::kDevice, "optimizer_device_buffers"), 67'108'864u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_device_copies"), 33'554'432u);
  // Down: gradients 8e9, the GPU share's new copies 3e9 x 2 B (the view is
  // written, not read); up: the new compute copies 8e9, the GPU share's
  // gradients 3e9 x 2 B.
  EXPECT_EQ(p.traffic.device_to_host_bytes, 14'000'000'000u);
  EXPECT_EQ(p.traffic.host_to_device_bytes, 14'000'000'000u);
}

// strata.optimizer_cpu_fraction = 0.5 with the optimizer on nvme: half the
// state in pinned RAM, half on NVMe, and the disk moves 12 B per NVMe param
// each way. 2e9 params on the GPU: 1e9 in RAM (12e9 B), 1e9 on NVMe (12e9 B).
TEST(Planner, OptimizerCpuFractionSplitsStateBetweenRamAndNvme) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kNvme);
  config.strata.optimizer_cpu_fraction = 0.5;
  config.strata.chunk_bytes = 16ull << 20;
  core::Result<Plan> plan =
      make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "master_weights"), 4'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_moments"), 8'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "master_weights"), 4'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kNvme, "optimizer_moments"), 8'000'000'000u);
  EXPECT_EQ(p.item_bytes(Tier::kPinned, "optimizer_staging"), 4u * (16u << 20) * 3u);
  EXPECT_EQ(p.traffic.disk_read_bytes, 12'000'000'000u);
  EXPECT_EQ(p.traffic.disk_write_bytes, 12'000'000'000u);

  // The staging ring holds no more slots than there are NVMe chunks, each
  // the largest chunk: 1000 params in 2 groups are 2 chunks of one norm
  // block (65,536 elements, 786,432 B of state) each.
  config.strata.optimizer_cpu_fraction = 0.0;
  plan = make_plan(config, params_model(1000, 2), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "optimizer_staging"), 2u * 786'432u);
}

// Under a pinned budget the ring takes what finalize leaves it (memory_model.h's
// ring_room_bytes: the budget less the host gradients, the pinned state and
// the step's working memory as finalize reserves it), and a budget below the
// least finalize accepts (pinned_least) does not fit. The numbers are the
// engine's, as scale_bench measures them (--params 4M --layers 64 --placement
// nvme --pinned-budget B): 8 MiB of host gradients, 896 KiB of working
// memory, slots of 768 KiB.
// strata.optimizer_state.format bf16 halves Adam's moments: 4 B per trainable
// parameter instead of 8 in every tier they live in and in the disk traffic,
// and the plan shows the configured placement under each format (with the
// drive life each gives).
TEST(Planner, Bf16MomentsTakeFourBytesAndThePlanComparesTheFormats) {
  Config config;
  config.precision = Precision::kBf16;
  config.zero.stage = 3;
  config.zero.offload_optimizer.device = OffloadDevice::kNvme;
  config.zero.offload_param.device = OffloadDevice::kNvme;
  ModelSpec model;
  model.num_params = 40'000'000'000;
  model.num_layers = 48;
  PlanOptions options;
  options.drive = DriveEndurance{.tbw = 600};
  const MachineSpec m = machine(80 * kGiB, 128 * kGiB, 2'000'000'000'000);
  core::Result<Plan> fp32 = make_plan(config, model, m, options);
  config.strata.optimizer_state.format = StateFormat::kBf16;
  core::Result<Plan> bf16 = make_plan(config, model, m, options);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  const std::uint64_t T = 40'000'000'000;
  EXPECT_EQ(fp32->state.moment_bytes, 8.0);
  EXPECT_EQ(bf16->state.moment_bytes, 4.0);
  EXPECT_EQ(bf16->state.moment_format, "bf16");
  EXPECT_EQ(fp32->configured.item_bytes(Tier::kNvme, "optimizer_moments"), 8 * T);
  EXPECT_EQ(bf16->configured.item_bytes(Tier::kNvme, "optimizer_moments"), 4 * T);
  // The state is read and written once a step: 4 B per parameter less each way.
  EXPECT_EQ(fp32->configured.traffic.disk_read_bytes - bf16->configured.traffic.disk_read_bytes, 4 * T);
  EXPECT_EQ(fp32->configured.traffic.disk_write_bytes - bf16->configured.traffic.disk_write_bytes, 4 * T);
  // Both plans list every format, each the configured placement under it.
  for (const Plan* p : {&*fp32, &*bf16}) {
    ASSERT_EQ(p->formats.size(), 3u);
    EXPECT_EQ(p->formats[0].format, "fp32");
    EXPECT_EQ(p->formats[0].state_bytes, 12.0);
    EXPECT_EQ(p->formats[1].format, "bf16");
    EXPECT_EQ(p->formats[1].state_bytes, 8.0);
    EXPECT_EQ(p->formats[2].format, "int8_blockwise");
    EXPECT_EQ(p->formats[2].state_bytes, 6.03125);
    // int8: 2 B of codes per parameter and 8 B of scales per 256.
    EXPECT_EQ(p->formats[2].plan.item_bytes(Tier::kNvme, "optimizer_moments"), 2 * T + 8 * (T / 256));
    EXPECT_EQ(p->formats[0].plan.traffic.disk_write_bytes, fp32->configured.traffic.disk_write_bytes);
    EXPECT_EQ(p->formats[1].plan.traffic.disk_write_bytes, bf16->configured.traffic.disk_write_bytes);
    ASSERT_TRUE(p->formats[0].wear && p->formats[0].wear->steps && p->formats[1].wear && p->formats[1].wear->steps);
    EXPECT_GT(*p->formats[1].wear->steps, *p->formats[0].wear->steps);
    ASSERT_TRUE(p->formats[2].wear && p->formats[2].wear->steps);
    EXPECT_GT(*p->formats[2].wear->steps, *p->formats[1].wear->steps);
  }
  EXPECT_EQ(*fp32->formats[0].wear->steps, *fp32->wear->configured.steps);
  const std::string table = format_plan_table(*bf16);
  EXPECT_NE(table.find("bf16 moments 4 B per trainable parameter"), std::string::npos) << table;
  EXPECT_NE(table.find("optimizer state formats"), std::string::npos) << table;
  EXPECT_NE(plan_to_json(*bf16).find("\"formats\""), std::string::npos);
  // Lion keeps fp32 only: one format, no table.
  config.optimizer.type = OptimizerType::kLion;
  config.strata.optimizer_state.format = StateFormat::kFp32;
  core::Result<Plan> lion = make_plan(config, model, m, options);
  ASSERT_TRUE(lion.ok()) << lion.status();
  EXPECT_EQ(lion->formats.size(), 1u);
  EXPECT_EQ(format_plan_table(*lion).find("optimizer state formats"), std::string::npos);
}

TEST(Planner, PinnedBudgetGivesTheRingWhatFinalizeLeaves) {
  Config config = bf16_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  const MachineSpec m = machine(80 * kGiB, 64 * kGiB, kGiB << 10);
  const auto staging = [&](std::uint64_t budget) {
    config.strata.budgets.pinned_bytes = budget;
    core::Result<Plan> plan = make_plan(config, params_model(64 * 65'536, 64), m);
    EXPECT_TRUE(plan.ok()) << plan.status().to_string();
    return plan.ok() ? plan->configured.item_bytes(Tier::kPinned, "optimizer_staging") : 0;
  };
  EXPECT_EQ(staging(12 * kGiB), 4u * 786'432u);     // the schedule's depth
  EXPECT_EQ(staging(21u << 19), 2u * 786'432u);      // 10.5 MiB: 1.625 MiB of room
  EXPECT_EQ(staging(10'092'544), 1u * 786'432u);     // the least: one slot

  config.strata.budgets.pinned_bytes = 10'092'544;
  core::Result<Plan> plan = make_plan(config, params_model(64 * 65'536, 64), m);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_TRUE(plan->configured.fits);
  config.strata.budgets.pinned_bytes = 10'092'543;
  plan = make_plan(config, params_model(64 * 65'536, 64), m);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_FALSE(plan->configured.fits);
  EXPECT_FALSE(plan->configured.tier(Tier::kPinned).fits);
  ASSERT_FALSE(plan->configured.reasons.empty());
  EXPECT_TRUE(contains(plan->configured.reasons[0], "strata.budgets.pinned >= 10092544 works"))
      << plan->configured.reasons[0];
}

// strata.overlap "speculative" keeps a second version of the NVMe state and
// the new compute copies of its parameters until step_end: both are counted.
TEST(Planner, SpeculativeUpdatesCountTheirSecondVersion) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kNvme);
  config.strata.optimizer_cpu_fraction = 0.5;
  core::Result<Plan> plan =
      make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kNvme, "speculative_state"), 0u);
  config.strata.overlap = OverlapMode::kSpeculative;
  plan = make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kNvme, "speculative_state"), 12'000'000'000u);
  // The compute copies in whole fetch groups, as finalize counts them
  // (ExtraBasis::kNvmeGroupCompute): the 12 groups with state on nvme, 83,333,334 x 2 B each.
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "speculative_compute_copies"), 2'000'000'016u);
  // The nvme state starting inside group 7 (30% of 24 groups in pinned
  // memory): that group's compute copies count whole, 17 groups.
  config.strata.optimizer_cpu_fraction = 0.3;
  plan = make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "speculative_compute_copies"), 17u * 166'666'668u);
}

// strata.overlap "delayed" keeps the new compute copies of every trainable
// parameter in pinned memory until the next step_end: counted.
TEST(Planner, DelayedUpdatesCountTheirPendingComputeCopies) {
  Config config = bf16_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  core::Result<Plan> plan =
      make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "delayed_compute_copies"), 0u);
  const std::uint64_t without = plan->configured.tier(Tier::kPinned).needed_bytes;
  config.strata.overlap = OverlapMode::kDelayed;
  plan = make_plan(config, params_model(2'000'000'000, 24), machine(80 * kGiB, 64 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  // bf16, in whole fetch groups as finalize counts them (ExtraBasis::kTrainableGroupCompute): 24 x 83,333,334 x 2 B.
  EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "delayed_compute_copies"), 4'000'000'032u);
  EXPECT_EQ(plan->configured.tier(Tier::kPinned).needed_bytes, without + 4'000'000'032u);
}

// Two fresh directories under /tmp, removed at the end of the test.
class TempDirs {
 public:
  TempDirs() {
    for (std::string* dir : {&a_, &b_}) {
      char templ[] = "/tmp/strata_plan_XXXXXX";
      if (::mkdtemp(templ) != nullptr) *dir = templ;
    }
  }
  TempDirs(const TempDirs&) = delete;
  TempDirs& operator=(const TempDirs&) = delete;
  ~TempDirs() {
    std::error_code ec;
    for (const std::string& dir : {a_, b_}) {
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  }
  bool ok() const { return !a_.empty() && !b_.empty(); }
  const std::string& a() const { return a_; }
  const std::string& b() const { return b_; }

 private:
  std::string a_, b_;
};

TEST(Planner, PathsOnOneFileSystemAreCountedOnce) {
  const TempDirs dirs;
  ASSERT_TRUE(dirs.ok());
  const std::string missing = dirs.a() + "/not/yet/created";
  core::Result<std::vector<DiskSpace>> disks =
      probe_disk_space({dirs.a(), dirs.b(), missing, "/proc"});
  ASSERT_TRUE(disks.ok()) << disks.status().to_string();
  ASSERT_EQ(disks->size(), 4u);
  EXPECT_TRUE((*disks)[0].counted);
  EXPECT_FALSE((*disks)[1].counted);
  EXPECT_FALSE((*disks)[2].counted);
  EXPECT_EQ((*disks)[2].measured_at, dirs.a());
  EXPECT_EQ((*disks)[2].device_id, (*disks)[0].device_id);
  EXPECT_TRUE((*disks)[3].counted);  // procfs: another file system
  EXPECT_NE((*disks)[3].device_id, (*disks)[0].device_id);
  EXPECT_EQ(counted_free_bytes(*disks), (*disks)[0].free_bytes + (*disks)[3].free_bytes);
  EXPECT_GT((*disks)[0].free_bytes, 0u);

  // A relative path is measured from the current directory.
  disks = probe_disk_space({"strata_plan_relative_dir_that_does_not_exist"});
  ASSERT_TRUE(disks.ok());
  EXPECT_EQ((*disks)[0].measured_at, std::filesystem::current_path().string());
}

TEST(Planner, MachineIsProbedUnlessGiven) {
  const TempDirs dirs;
  ASSERT_TRUE(dirs.ok());
  MachineOverrides given;
  given.gpu_bytes = 80 * kGiB;
  given.ram_bytes = 128 * kGiB;
  core::Result<MachineSpec> m = probe_machine({dirs.a(), dirs.b()}, given);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->gpu_bytes, 80 * kGiB);
  EXPECT_EQ(m->gpu_source, "given (--gpu-memory)");
  EXPECT_FALSE(m->gpu_probe.empty());  // "no GPU: <why>" or the device found
  EXPECT_EQ(m->ram_bytes, 128 * kGiB);
  ASSERT_EQ(m->disks.size(), 2u);
  EXPECT_EQ(m->disk_bytes, m->disks[0].free_bytes);

  core::Result<MachineSpec> probed = probe_machine({dirs.a()}, {});
  ASSERT_TRUE(probed.ok()) << probed.status().to_string();
  EXPECT_GT(probed->ram_bytes, 0u);
  if (!probed->gpu_bytes) {
    // No GPU here: planning needs --gpu-memory or strata.budgets.device.
    EXPECT_EQ(probed->gpu_probe.rfind("no GPU: ", 0), 0u) << probed->gpu_probe;
    EXPECT_EQ(probed->gpu_source, "unknown");
    Config config = bf16_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
    core::Result<Plan> plan = make_plan(config, params_model(1'000'000, 2), *probed);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(contains(std::string(plan.status().message()), "--gpu-memory"));
    EXPECT_TRUE(contains(std::string(plan.status().message()), "strata.budgets.device"));
    config.strata.budgets.device_bytes = 8 * kGiB;
    plan = make_plan(config, params_model(1'000'000, 2), *probed);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    EXPECT_EQ(plan->configured.tier(Tier::kDevice).capacity_bytes, 8 * kGiB);
  }
}

TEST(Planner, MemTotalParsesMeminfo) {
  core::Result<std::uint64_t> total =
      parse_mem_total_bytes("MemTotal:       24594560 kB\nMemFree: 1 kB\n");
  ASSERT_TRUE(total.ok());
  EXPECT_EQ(*total, 24'594'560ull * 1024);
  EXPECT_FALSE(parse_mem_total_bytes("MemFree: 1 kB\n").ok());
  EXPECT_FALSE(parse_mem_total_bytes("MemTotal: lots\n").ok());
  EXPECT_EQ(read_mem_total_bytes("/nonexistent/meminfo").status().code(), StatusCode::kNotFound);
}

TEST(Planner, BudgetsCapTiersWithoutMargin) {
  Config config = bf16_config(OffloadDevice::kCpu, OffloadDevice::kCpu);
  config.strata.budgets.device_bytes = 2 * kGiB;
  config.strata.budgets.pinned_bytes = 8 * kGiB;
  config.strata.budgets.disk_bytes = 100'000'000'000;
  core::Result<Plan> plan = make_plan(config, params_model(100'000'000, 10),
                                      machine(80 * kGiB, 128 * kGiB, 1'000'000'000'000));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const PlacementPlan& p = plan->configured;
  EXPECT_EQ(p.tier(Tier::kDevice).capacity_bytes, 2 * kGiB);
  EXPECT_EQ(p.tier(Tier::kDevice).margin_bytes, 0u);
  EXPECT_EQ(p.tier(Tier::kDevice).available_bytes, 2 * kGiB);
  EXPECT_EQ(p.tier(Tier::kDevice).capacity_source, "strata.budgets.device (budget)");
  EXPECT_EQ(p.tier(Tier::kPinned).available_bytes, 8 * kGiB);
  EXPECT_EQ(p.tier(Tier::kNvme).available_bytes, 100'000'000'000u);
  EXPECT_TRUE(plan->fits());
  // Below a machine size the user gave (--gpu-memory): a note says the budget
  // wins, and how to plan for the whole GPU.
  bool capped = false;
  for (const std::string& n : plan->notes) {
    capped = capped || (contains(n, "strata.budgets.device = 2.00 GiB caps this tier below the 80.00 GiB given "
                                    "(--gpu-memory)") &&
                        contains(n, "drop it from the config"));
  }
  EXPECT_TRUE(capped);

  // A budget the tier cannot hold: the tier does not fit and says why.
  config.strata.budgets.pinned_bytes = 1 * kGiB;  // needs 0.2 + 0.2 + 1.2 GB
  plan = make_plan(config, params_model(100'000'000, 10),
                   machine(80 * kGiB, 128 * kGiB, 1'000'000'000'000));
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->configured.tier(Tier::kPinned).fits);
  ASSERT_FALSE(plan->configured.reasons.empty());
  EXPECT_TRUE(contains(plan->configured.reasons[0], "strata.budgets.pinned"))
      << plan->configured.reasons[0];

  // A budget above the machine: the machine's capacity and margin apply.
  config.strata.budgets.device_bytes = 200 * kGiB;
  plan = make_plan(config, params_model(100'000'000, 10),
                   machine(80 * kGiB, 128 * kGiB, 1'000'000'000'000));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.tier(Tier::kDevice).capacity_bytes, 80 * kGiB);
  EXPECT_EQ(plan->configured.tier(Tier::kDevice).margin_bytes, 8 * kGiB);
  bool noted = false;
  for (const std::string& n : plan->notes) noted = noted || contains(n, "strata.budgets.device");
  EXPECT_TRUE(noted);
}

TEST(Planner, CheckpointSpaceCanBeLeftOut) {
  const Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  PlanOptions options;
  options.include_checkpoint = false;
  core::Result<Plan> plan =
      make_plan(config, params_model(40'000'000'000, 48), forty_b_machine(), options);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kNvme, "checkpoint"), 0u);
  EXPECT_EQ(plan->configured.tier(Tier::kNvme).needed_bytes, 595'067'928'576u);  // with the swap reserve
}

TEST(Planner, TransformerFormulaCountsParameters) {
  // GPT-2 small has 124,439,808 parameters with its 1024 x 768 learned
  // position embeddings, which this formula leaves out.
  core::Result<std::int64_t> gpt2 = transformer_num_params(12, 768, 50257);
  ASSERT_TRUE(gpt2.ok());
  EXPECT_EQ(*gpt2, 124'439'808 - 1024 * 768);
  // L (12 h^2 + 13 h) + V h + 2 h with L = 2, h = 4, V = 10: 2 x 244 + 40 + 8.
  EXPECT_EQ(transformer_num_params(2, 4, 10).value(), 536);
  EXPECT_EQ(transformer_num_params(0, 4, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(transformer_num_params(1'000'000, 4'000'000'000, 10).status().code(),
            StatusCode::kInvalidArgument);
}

// Korthikanti et al.: L = 2, h = 256, a = 2, V = 1000, s = 128, b = 2.
//   one layer s b (34 h + 5 a s) = 256 x (8704 + 1280) = 2,555,904
//   kept with checkpointing 2 s b h = 131,072
//   checkpointing on: 2 x 131,072 + 2,555,904 = 2,818,048; off: 2 x 2,555,904
//   logits 4 s b V = 1,024,000
TEST(Planner, ActivationEstimateFollowsKorthikanti) {
  core::Result<ActivationEstimate> on = estimate_activations(2, 256, 2, 1000, 128, 2, true, 2);
  ASSERT_TRUE(on.ok());
  EXPECT_EQ(on->full_layer_bytes, 2'555'904u);
  EXPECT_EQ(on->kept_layer_bytes, 131'072u);
  EXPECT_EQ(on->layers_bytes, 2'818'048u);
  EXPECT_EQ(on->logits_bytes, 1'024'000u);
  EXPECT_EQ(on->total_bytes, 2'818'048u + 1'024'000u);
  core::Result<ActivationEstimate> off = estimate_activations(2, 256, 2, 1000, 128, 2, false, 2);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->kept_layer_bytes, 2'555'904u);
  EXPECT_EQ(off->layers_bytes, 5'111'808u);
  core::Result<ActivationEstimate> fp32 = estimate_activations(2, 256, 2, 1000, 128, 2, false, 4);
  ASSERT_TRUE(fp32.ok());
  EXPECT_EQ(fp32->layers_bytes, 2u * 5'111'808u);
  EXPECT_EQ(fp32->logits_bytes, 1'024'000u);
  EXPECT_FALSE(estimate_activations(2, 256, 0, 1000, 128, 2, true, 2).ok());

  // Through the planner: --seq, --micro-batch and --checkpointing reach it,
  // and without a shape there is no estimate (and a note says so).
  ModelSpec model = shape_model(2, 256, 1000, 128, 2);
  model.num_heads = 2;
  model.activation_checkpointing = false;
  const Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kNone);
  core::Result<Plan> plan = make_plan(config, model, machine(8 * kGiB, 16 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->configured.item_bytes(Tier::kDevice, "activations"), 5'111'808u);
  EXPECT_EQ(plan->configured.item_bytes(Tier::kDevice, "logits"), 1'024'000u);
  plan = make_plan(config, params_model(1'000'000, 2), machine(8 * kGiB, 16 * kGiB, kGiB << 10));
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->model.activations.has_value());
  EXPECT_EQ(plan->configured.item_bytes(Tier::kDevice, "activations"), 0u);
  ASSERT_FALSE(plan->notes.empty());
  EXPECT_TRUE(contains(plan->notes[0], "activations")) << plan->notes[0];
}

TEST(Planner, OptimizerTypeSetsMomentBytes) {
  Config config = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  for (auto [type, bytes] :
       {std::pair{OptimizerType::kAdamW, 8u}, std::pair{OptimizerType::kAdam, 8u},
        std::pair{OptimizerType::kAdagrad, 4u}, std::pair{OptimizerType::kLion, 4u}}) {
    config.optimizer.type = type;
    core::Result<Plan> plan =
        make_plan(config, params_model(1'000'000, 2), machine(8 * kGiB, 16 * kGiB, kGiB << 10));
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->configured.item_bytes(Tier::kPinned, "optimizer_moments"), bytes * 1'000'000u);
  }
}

TEST(Planner, NothingFitsSaysSo) {
  const Config config = bf16_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48),
                                      machine(80 * kGiB, 16 * kGiB, 100'000'000'000));
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->fits());
  EXPECT_FALSE(plan->recommended.has_value());
  for (const PlacementPlan& c : plan->candidates) {
    EXPECT_FALSE(c.fits);
    EXPECT_FALSE(c.reasons.empty());
  }
  EXPECT_EQ(plan->candidates.size(), 9u);
  EXPECT_TRUE(contains(format_plan_table(*plan), "nothing fits"));
}

TEST(Planner, JsonHasTheNumbersAndEscapesStrings) {
  const Config config = forty_b_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  MachineSpec m = forty_b_machine();
  m.disks.push_back(DiskSpace{"/tmp/a \"quoted\"\npath", "/tmp", 1, 7, true});
  core::Result<Plan> plan = make_plan(config, params_model(40'000'000'000, 48), m);
  ASSERT_TRUE(plan.ok());
  const std::string json = plan_to_json(*plan);
  EXPECT_TRUE(contains(json, "\"fits\": true")) << json;
  EXPECT_TRUE(contains(json, "\"needed_bytes\": 89138639708")) << json;
  EXPECT_TRUE(contains(json, "\"host_to_device_bytes\": 158333333334")) << json;
  EXPECT_TRUE(contains(json, "\"path\": \"/tmp/a \\\"quoted\\\"\\npath\"")) << json;
  EXPECT_TRUE(contains(json, "\"key_path\": \"strata.optimizer_cpu_fraction\"")) << json;
  EXPECT_TRUE(contains(json, "\"to\": 0.05")) << json;
  EXPECT_TRUE(contains(json, "\"activations\": null")) << json;
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < json.size(); ++i) {
    const char ch = json[i];
    if (in_string) {
      if (ch == '\\') {
        ++i;
      } else if (ch == '"') {
        in_string = false;
      } else {
        EXPECT_GE(static_cast<unsigned char>(ch), 0x20u);
      }
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      ++depth;
    } else if (ch == '}' || ch == ']') {
      --depth;
      EXPECT_GE(depth, 0);
    }
  }
  EXPECT_EQ(depth, 0);
  EXPECT_FALSE(in_string);
}

TEST(Planner, BadModelInputIsAnErrorNamingTheFlag) {
  const Config config = bf16_config(OffloadDevice::kNvme, OffloadDevice::kNvme);
  const MachineSpec m = machine(80 * kGiB, 128 * kGiB, 2'000'000'000'000);
  struct Case {
    ModelSpec model;
    const char* expected;
  };
  ModelSpec both = params_model(1000, 2);
  both.hidden_size = 64;
  both.vocab_size = 100;
  ModelSpec no_vocab;
  no_vocab.num_layers = 2;
  no_vocab.hidden_size = 64;
  ModelSpec heads_without_shape = params_model(1000, 2);
  heads_without_shape.num_heads = 4;
  ModelSpec too_many_heads = shape_model(2, 64, 100);
  too_many_heads.num_heads = 65;
  ModelSpec frozen_high = params_model(1000, 2);
  frozen_high.frozen_fraction = 1.5;
  ModelSpec frozen_low = params_model(1000, 2);
  frozen_low.frozen_fraction = -0.1;
  ModelSpec frozen_nan = params_model(1000, 2);
  frozen_nan.frozen_fraction = std::nan("");
  ModelSpec lora_without_shape = params_model(1000, 2);
  lora_without_shape.lora_rank = 8;
  ModelSpec lora_and_frozen = shape_model(2, 64, 100);
  lora_and_frozen.lora_rank = 8;
  lora_and_frozen.frozen_fraction = 0.5;
  ModelSpec seq = params_model(1000, 2);
  seq.seq_len = 0;
  ModelSpec micro = params_model(1000, 2);
  micro.micro_batch = -1;
  const std::vector<Case> cases = {
      {params_model(0, 2), "--params"},
      {params_model(-5, 2), "num_params (--params) must be positive, got -5"},
      {params_model(1000, 0), "--layers) is required"},
      {params_model(1000, -1), "--layers) must be positive"},
      {params_model(50, 100), "num_layers (--layers) 100 exceeds num_params (--params) 50"},
      {params_model(2'000'000'000'000'000, 2), "beyond the planner's range"},
      {both, "not both"},
      {no_vocab, "vocab_size (--vocab)"},
      {heads_without_shape, "num_heads (--heads) needs a transformer shape"},
      {too_many_heads, "num_heads (--heads)"},
      {frozen_high, "frozen_fraction (--frozen-fraction) must be in [0, 1], got 1.5"},
      {frozen_low, "frozen_fraction (--frozen-fraction)"},
      {frozen_nan, "frozen_fraction (--frozen-fraction)"},
      {lora_without_shape, "lora_rank (--lora) needs a transformer shape"},
      {lora_and_frozen, "either lora_rank (--lora) or frozen_fraction"},
      {seq, "seq_len (--seq)"},
      {micro, "micro_batch (--micro-batch)"},
  };
  for (const Case& c : cases) {
    core::Result<Plan> plan = make_plan(config, c.model, m);
    ASSERT_FALSE(plan.ok()) << c.expected;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(std::string(plan.status().message()), c.expected))
        << plan.status().message() << " lacks " << c.expected;
  }
}

TEST(Planner, BadConfigValuesAreErrorsNamingTheKey) {
  const MachineSpec m = machine(80 * kGiB, 128 * kGiB, 2'000'000'000'000);
  const ModelSpec model = params_model(1000, 2);
  struct Case {
    Config config;
    const char* expected;
  };
  std::vector<Case> cases;
  Config c = bf16_config(OffloadDevice::kNone, OffloadDevice::kCpu);
  c.zero.offload_optimizer.ratio = 0.0;
  cases.push_back({c, "zero_optimization.offload_optimizer.ratio must be in (0, 1]"});
  c = bf16_config(OffloadDevice::kNone, OffloadDevice::kNvme);
  c.strata.optimizer_cpu_fraction = 2.0;
  cases.push_back({c, "strata.optimizer_cpu_fraction must be in [0, 1]"});
  c = bf16_config(OffloadDevice::kNone, OffloadDevice::kNone);
  c.gradient_accumulation_steps = 0;
  cases.push_back({c, "gradient_accumulation_steps must be positive"});
  c = bf16_config(OffloadDevice::kNone, OffloadDevice::kNone);
  c.train_micro_batch_size_per_gpu = 0;
  cases.push_back({c, "train_micro_batch_size_per_gpu must be positive"});
  c = bf16_config(OffloadDevice::kNone, OffloadDevice::kNone);
  c.strata.chunk_bytes = 0;
  cases.push_back({c, "strata.chunk_bytes"});
  c = bf16_config(OffloadDevice::kNvme, OffloadDevice::kNone);
  c.zero.offload_param.buffer_count = -1;
  cases.push_back({c, "zero_optimization.offload_param.buffer_count"});
  for (const Case& k : cases) {
    core::Result<Plan> plan = make_plan(k.config, model, m);
    ASSERT_FALSE(plan.ok()) << k.expected;
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(std::string(plan.status().message()), k.expected))
        << plan.status().message() << " lacks " << k.expected;
  }
  PlanOptions options;
  options.margins.gpu_fraction = 1.0;
  EXPECT_FALSE(
      make_plan(bf16_config(OffloadDevice::kNone, OffloadDevice::kNone), model, m, options).ok());
}

TEST(Planner, CountParserAcceptsSuffixesAndExponents) {
  std::int64_t n = 0;
  ASSERT_TRUE(parse_count("40e9", &n));
  EXPECT_EQ(n, 40'000'000'000);
  ASSERT_TRUE(parse_count("40B", &n));
  EXPECT_EQ(n, 40'000'000'000);
  ASSERT_TRUE(parse_count("1.5b", &n));
  EXPECT_EQ(n, 1'500'000'000);
  ASSERT_TRUE(parse_count("7M", &n));
  EXPECT_EQ(n, 7'000'000);
  ASSERT_TRUE(parse_count("125k", &n));
  EXPECT_EQ(n, 125'000);
  ASSERT_TRUE(parse_count("1T", &n));
  EXPECT_EQ(n, 1'000'000'000'000);
  ASSERT_TRUE(parse_count(" 4096 ", &n));
  EXPECT_EQ(n, 4096);
  ASSERT_TRUE(parse_count("-5", &n));
  EXPECT_EQ(n, -5);
  for (const char* bad :
       {"", "forty", "1.5", "40X", "40 B", "1e30", "--5", "e9", "nan", "inf", "0x10"}) {
    EXPECT_FALSE(parse_count(bad, &n)) << bad;
  }
}

TEST(Planner, SwapPathsComeFromIoPathsElseNvmePaths) {
  Config config;
  EXPECT_EQ(plan_swap_paths(config), std::vector<std::string>{"/local_nvme"});
  config.zero.offload_param.nvme_path = "/nvme1";
  EXPECT_EQ(plan_swap_paths(config), (std::vector<std::string>{"/local_nvme", "/nvme1"}));
  config.strata.io.paths = {"/a", "/b"};
  EXPECT_EQ(plan_swap_paths(config), (std::vector<std::string>{"/a", "/b"}));
}

}  // namespace
}  // namespace strata::engine
