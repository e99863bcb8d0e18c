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
      {{"--params", "40B", "--layers", "48"}, "--config FILE is required"},
      {{"--config", "c.json", "extra"}, "not expected: extra"},
      {{"--config"}, "--config: 1 required VALUE missing"},
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
