// `strata plan`'s flags: what they parse into, and errors that name the flag.
#include "bindings/cli/plan_args.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::cli {
namespace {

using core::StatusCode;

constexpr std::uint64_t kGiB = 1ull << 30;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<std::string_view> argv_of(const std::vector<const char*>& args) {
  return std::vector<std::string_view>(args.begin(), args.end());
}

TEST(PlanArgs, FlagsParseIntoModelAndMachine) {
  core::Result<PlanArgs> a = parse_plan_args(argv_of({"--config",
                                                      "c.json",
                                                      "--params",
                                                      "40B",
                                                      "--layers=48",
                                                      "--seq",
                                                      "4096",
                                                      "--micro-batch",
                                                      "2",
                                                      "--checkpointing",
                                                      "off",
                                                      "--frozen-fraction",
                                                      "0.25",
                                                      "--lora",
                                                      "16",
                                                      "--gpu-memory",
                                                      "80GiB",
                                                      "--ram",
                                                      "128GiB",
                                                      "--disk",
                                                      "2TB",
                                                      "--json",
                                                      "--no-checkpoint"}));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->config_path, "c.json");
  EXPECT_EQ(a->model.num_params, 40'000'000'000);
  EXPECT_EQ(a->model.num_layers, 48);
  EXPECT_EQ(a->model.seq_len, 4096);
  EXPECT_EQ(a->model.micro_batch, 2);
  EXPECT_FALSE(a->model.activation_checkpointing);
  EXPECT_DOUBLE_EQ(a->model.frozen_fraction, 0.25);
  EXPECT_EQ(a->model.lora_rank, 16);
  EXPECT_EQ(a->machine.gpu_bytes, 80 * kGiB);
  EXPECT_EQ(a->machine.ram_bytes, 128 * kGiB);
  EXPECT_EQ(a->machine.disk_bytes, 2'000'000'000'000u);
  EXPECT_TRUE(a->json);
  EXPECT_FALSE(a->options.include_checkpoint);

  a = parse_plan_args(argv_of({"--config", "c.json", "--layers", "32", "--hidden", "4096",
                               "--vocab", "32000", "--heads", "32"}));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->model.hidden_size, 4096);
  EXPECT_EQ(a->model.vocab_size, 32000);
  EXPECT_EQ(a->model.num_heads, 32);
  EXPECT_FALSE(a->machine.gpu_bytes.has_value());

  a = parse_plan_args(argv_of({"--help"}));
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->help);
  EXPECT_TRUE(contains(std::string(plan_usage()), "--gpu-memory"));
}

TEST(PlanArgs, DriveRatingFlagsFillTheWearOptions) {
  core::Result<PlanArgs> a = parse_plan_args(argv_of({"--config", "c.json", "--drive-tbw", "600", "--step-seconds",
                                                      "2.5"}));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(a->options.drive.has_value());
  EXPECT_DOUBLE_EQ(a->options.drive->tbw, 600.0);
  EXPECT_DOUBLE_EQ(a->options.drive->step_seconds, 2.5);
  EXPECT_DOUBLE_EQ(a->options.drive->rated_bytes(), 600e12);

  a = parse_plan_args(argv_of({"--config", "c.json", "--drive-dwpd", "0.3", "--drive-capacity", "3.84TB",
                               "--warranty-years=3"}));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(a->options.drive.has_value());
  EXPECT_DOUBLE_EQ(a->options.drive->tbw, 0.0);
  EXPECT_DOUBLE_EQ(a->options.drive->dwpd, 0.3);
  EXPECT_EQ(a->options.drive->capacity_bytes, 3'840'000'000'000u);
  EXPECT_DOUBLE_EQ(a->options.drive->warranty_years, 3.0);
  EXPECT_DOUBLE_EQ(a->options.drive->step_seconds, 0.0);
  EXPECT_DOUBLE_EQ(a->options.drive->rated_bytes(), 0.3 * 3.84e12 * 365 * 3);

  // The warranty defaults to 5 years; without a rating there is no wear estimate.
  a = parse_plan_args(argv_of({"--config", "c.json", "--drive-dwpd", "1", "--drive-capacity", "1TB"}));
  ASSERT_TRUE(a.ok());
  EXPECT_DOUBLE_EQ(a->options.drive->warranty_years, 5.0);
  a = parse_plan_args(argv_of({"--config", "c.json"}));
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->options.drive.has_value());
}

TEST(PlanArgs, RanksAndNodesFillTheOptions) {
  core::Result<PlanArgs> a = parse_plan_args(argv_of({"--config", "c.json", "--ranks", "16", "--nodes=2"}));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->options.ranks, 16);
  EXPECT_EQ(a->options.nodes, 2);
  core::Result<PlanArgs> one = parse_plan_args(argv_of({"--config", "c.json"}));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->options.ranks, 1);
  EXPECT_EQ(one->options.nodes, 1);
}

TEST(PlanArgs, BadFlagsAreErrorsNamingTheFlag) {
  const std::vector<std::pair<std::vector<const char*>, const char*>> cases = {
      {{"--config", "c.json", "--parms", "40B"}, "not expected: 40B --parms"},
      {{"--config", "c.json", "--gpu-memory", "80XB"}, "--gpu-memory: cannot parse '80XB'"},
      {{"--config", "c.json", "--ram", "lots"}, "--ram: cannot parse 'lots'"},
      {{"--config", "c.json", "--disk", "0"}, "--disk: must be positive"},
      {{"--config", "c.json", "--params", "forty"}, "--params: cannot parse 'forty'"},
      {{"--config", "c.json", "--params", "0"}, "num_params (--params) must be positive"},
      {{"--config", "c.json", "--layers", "1.5"}, "--layers: cannot parse '1.5'"},
      {{"--config", "c.json", "--layers"}, "--layers: 1 required VALUE missing"},
      {{"--config", "c.json", "--checkpointing", "maybe"}, "--checkpointing: cannot parse 'maybe'"},
      {{"--config", "c.json", "--frozen-fraction", "half"},
       "--frozen-fraction: cannot parse 'half'"},
      {{"--config", "c.json", "--micro-batch", "-2"},
       "micro_batch (--micro-batch) must be positive"},
      {{"--config", "c.json", "--seq", "1", "--seq", "2"}, "--seq is given twice"},
      {{"--config", "c.json", "--ranks", "0"}, "--ranks must be in [1, 1000000], got '0'"},
      {{"--config", "c.json", "--ranks", "two"}, "--ranks: cannot parse 'two'"},
      {{"--config", "c.json", "--nodes", "2M"}, "--nodes must be in [1, 1000000], got '2M'"},
      {{"--params", "40B", "--layers", "48"}, "--config FILE is required"},
      {{"--config", "c.json", "extra"}, "not expected: extra"},
      {{"--config"}, "--config: 1 required VALUE missing"},
      {{"--config", "c.json", "--drive-tbw", "-600"}, "--drive-tbw: must be positive, got '-600'"},
      {{"--config", "c.json", "--drive-tbw", "0"}, "--drive-tbw: must be positive, got '0'"},
      {{"--config", "c.json", "--drive-tbw", "600TB"}, "--drive-tbw: cannot parse '600TB'"},
      {{"--config", "c.json", "--drive-tbw", "nan"}, "--drive-tbw: cannot parse 'nan'"},
      {{"--config", "c.json", "--drive-tbw", "1e999"}, "--drive-tbw: cannot parse '1e999'"},
      {{"--config", "c.json", "--drive-dwpd", "x", "--drive-capacity", "1TB"}, "--drive-dwpd: cannot parse 'x'"},
      {{"--config", "c.json", "--drive-dwpd", "1", "--drive-capacity", "0"}, "--drive-capacity: must be positive"},
      {{"--config", "c.json", "--drive-dwpd", "1", "--drive-capacity", "big"}, "--drive-capacity: cannot parse"},
      {{"--config", "c.json", "--drive-dwpd", "1", "--drive-capacity", "1TB", "--warranty-years", "0"},
       "--warranty-years: must be positive"},
      {{"--config", "c.json", "--drive-tbw", "600", "--step-seconds", "-1"}, "--step-seconds: must be positive"},
      {{"--config", "c.json", "--drive-tbw", "600", "--drive-dwpd", "1", "--drive-capacity", "1TB"},
       "--drive-tbw and --drive-dwpd both rate"},
      {{"--config", "c.json", "--drive-dwpd", "1"}, "--drive-dwpd needs the drive's capacity"},
      {{"--config", "c.json", "--drive-capacity", "1TB"}, "--drive-capacity needs --drive-dwpd"},
      {{"--config", "c.json", "--drive-tbw", "600", "--warranty-years", "3"}, "--warranty-years goes with --drive-dwpd"},
      {{"--config", "c.json", "--step-seconds", "10"}, "--step-seconds sets the SSD wear estimate's days"},
  };
  for (const auto& [args, expected] : cases) {
    core::Result<PlanArgs> a = parse_plan_args(argv_of(args));
    ASSERT_FALSE(a.ok()) << expected;
    EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(std::string(a.status().message()), expected))
        << a.status().message() << " lacks " << expected;
  }
}

}  // namespace
}  // namespace strata::cli
