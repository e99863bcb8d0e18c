// Tests of engine/config: DeepSpeed keys and defaults, strata's keys, every
// error class (each names its key path and value), warnings, "auto", to_json.
#include "engine/config.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <mutex>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/logging.h"
#include "core/result.h"
#include "engine/config/json_reader.h"

namespace strata::engine {
namespace {

// The bundled example configs; meson passes the source root in STRATA_SOURCE_ROOT.
std::string example(const char* name) {
  const char* root = std::getenv("STRATA_SOURCE_ROOT");
  return std::string(root != nullptr ? root : ".") + "/examples/configs/" + name;
}

using core::LogLevel;
using core::Result;
using core::StatusCode;

// A document with a batch size (DeepSpeed requires one) and the given members.
std::string doc(std::string_view members = "") {
  std::string s = R"({"train_batch_size": 8)";
  if (!members.empty()) s += std::string(", ") + std::string(members);
  return s + "}";
}

Config parse_ok(std::string_view json, const ParseOptions& options = {}) {
  Result<Config> c = parse_config(json, options);
  EXPECT_TRUE(c.ok()) << c.status().to_string() << "\nin: " << json;
  return c.ok() ? std::move(c).value() : Config{};
}

// Parsing must fail with kInvalidArgument and a message holding every fragment.
void expect_error(std::string_view json, std::initializer_list<std::string_view> fragments,
                  const ParseOptions& options = {}) {
  Result<Config> c = parse_config(json, options);
  ASSERT_FALSE(c.ok()) << "parsed without error: " << json;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
  const std::string message(c.status().message());
  for (std::string_view f : fragments) {
    EXPECT_NE(message.find(f), std::string::npos)
        << "message lacks [" << f << "]: " << message << "\nin: " << json;
  }
}

const ConfigWarning* find_warning(const Config& c, std::string_view path) {
  for (const ConfigWarning& w : c.warnings) {
    if (w.key_path == path) return &w;
  }
  return nullptr;
}

std::string all_warnings(const Config& c) {
  std::string s;
  for (const ConfigWarning& w : c.warnings) s += w.key_path + ": " + w.message + "\n";
  return s;
}

// Collects log lines while alive.
class LogCapture {
 public:
  LogCapture() : previous_level_(core::log_level()) {
    // Config lines are logged once per process: each test sees its own.
    config_internal::forget_logged_lines();
    core::set_log_level(LogLevel::kInfo);
    core::set_log_sink([this](LogLevel level, std::string_view message) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(level, std::string(message));
    });
  }
  ~LogCapture() {
    core::set_log_sink({});
    core::set_log_level(previous_level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  // True when a line at `level` contains every fragment.
  bool has(LogLevel level, std::initializer_list<std::string_view> fragments) { return count(level, fragments) > 0; }

  // The lines at `level` that contain every fragment.
  int count(LogLevel level, std::initializer_list<std::string_view> fragments) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& [l, text] : lines_) {
      if (l != level) continue;
      bool all = true;
      for (std::string_view f : fragments) all = all && text.find(f) != std::string::npos;
      n += all ? 1 : 0;
    }
    return n;
  }

 private:
  LogLevel previous_level_;
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
};

// --- defaults -------------------------------------------------------------------

TEST(Config, DefaultsEqualDeepSpeedWhenOnlyTheBatchIsGiven) {
  const Config c = parse_ok(doc());
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.precision, Precision::kFp32);
  EXPECT_EQ(c.compute_bytes(), 4);
  // DeepSpeed's FusedAdam / DeepSpeedCPUAdam defaults.
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_TRUE(c.optimizer.bias_correction);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
  // DeepSpeedFP16Config.
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_FALSE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  // DeepSpeedZeroConfig and the offload configs.
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, "/local_nvme");
  EXPECT_FALSE(c.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(c.zero.offload_optimizer.fast_init);
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 0);  // strata's default (DeepSpeed's is 1e9)
  EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 500'000'000);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_TRUE(c.zero.contiguous_gradients);
  EXPECT_FALSE(c.zero.stage3_gather_16bit_weights_on_model_save);
  // DeepSpeed's aio defaults.
  EXPECT_EQ(c.aio.block_size, 1'048'576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.use_gds);
  // strata's own.
  EXPECT_EQ(c.strata.io.queue_depth, 32);
  EXPECT_EQ(c.strata.io.block_bytes, 1u << 20);
  EXPECT_EQ(c.strata.chunk_bytes, 64u << 20);
  EXPECT_TRUE(c.strata.crc);
  EXPECT_FALSE(c.strata.strict);
  EXPECT_EQ(c.strata.cpu_adam.bind, CpuAdamBind::kAuto);
  EXPECT_EQ(c.strata.no_grad, NoGradPolicy::kSkip);  // torch.optim.AdamW's: a parameter without gradient is left as it is
  EXPECT_EQ(c.strata.cpu_adam.numa_node, -1);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_TRUE(c.swap_paths().empty());
}

TEST(Config, OverlapCommDefaultsToTrueOnlyAtStage3) {
  EXPECT_TRUE(parse_ok(doc(R"("zero_optimization": {"stage": 3})")).zero.overlap_comm);
  EXPECT_FALSE(parse_ok(doc(R"("zero_optimization": {"stage": 2})")).zero.overlap_comm);
  EXPECT_FALSE(parse_ok(doc(R"("zero_optimization": {"stage": 3, "overlap_comm": false})"))
                   .zero.overlap_comm);
}

// --- batch ----------------------------------------------------------------------

TEST(Config, BatchSizesResolveAsDeepSpeedDoesWithOneProcess) {
  struct Case {
    const char* json;
    std::int64_t train, micro, gas;
  };
  const Case cases[] = {
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 32, 4, 8},
      {R"({"train_batch_size": 32, "gradient_accumulation_steps": 4})", 32, 8, 4},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8})", 32, 4, 8},
      {R"({"train_batch_size": 16})", 16, 16, 1},
      {R"({"train_micro_batch_size_per_gpu": 3})", 3, 3, 1},
      {R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 6})",
       24, 4, 6},
  };
  for (const Case& k : cases) {
    const Config c = parse_ok(k.json);
    EXPECT_EQ(c.train_batch_size, k.train) << k.json;
    EXPECT_EQ(c.train_micro_batch_size_per_gpu, k.micro) << k.json;
    EXPECT_EQ(c.gradient_accumulation_steps, k.gas) << k.json;
  }
}

TEST(Config, BatchSizesCountEveryRankWithAWorldSize) {
  // DeepSpeed's rule on 4 ranks: train_batch_size = micro x gas x 4.
  struct Case {
    const char* json;
    std::int64_t train, micro, gas;
  };
  const Case cases[] = {
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 32, 4, 2},
      {R"({"train_batch_size": 32, "gradient_accumulation_steps": 4})", 32, 2, 4},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8})", 128, 4, 8},
      {R"({"train_batch_size": 16})", 16, 4, 1},
      {R"({"train_micro_batch_size_per_gpu": 3})", 12, 3, 1},
  };
  ParseOptions four;
  four.world_size = 4;
  for (const Case& k : cases) {
    Result<Config> c = parse_config(k.json, four);
    ASSERT_TRUE(c.ok()) << c.status() << " in " << k.json;
    EXPECT_EQ(c->train_batch_size, k.train) << k.json;
    EXPECT_EQ(c->train_micro_batch_size_per_gpu, k.micro) << k.json;
    EXPECT_EQ(c->gradient_accumulation_steps, k.gas) << k.json;
    EXPECT_EQ(c->world_size, 4);
    EXPECT_EQ(c->micro_batches_per_step(), 4 * k.gas);
  }
  expect_error(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})",
               {"train_batch_size: 32 != train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (4) x the "
                "world size (4) = 64"},
               four);
  expect_error(R"({"train_batch_size": 10})", {"train_batch_size: 10 is not a multiple of the world size (4)"}, four);
  expect_error(R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4})",
               {"is not a multiple of train_micro_batch_size_per_gpu (4) x the world size (4)"}, four);
  ParseOptions none;
  none.world_size = 0;
  expect_error(R"({"train_batch_size": 8})", {"ParseOptions.world_size: 0"}, none);
}

TEST(Config, BatchErrorsNameTheKeysAndValues) {
  expect_error("{}", {"train_batch_size", "train_micro_batch_size_per_gpu", "neither is set"});
  expect_error(R"({"gradient_accumulation_steps": 4})",
               {"train_batch_size", "train_micro_batch_size_per_gpu"});
  expect_error(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": 4})",
               {"train_batch_size: 32 != train_micro_batch_size_per_gpu (4) x "
                "gradient_accumulation_steps (4) = 16"});
  expect_error(R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})",
               {"train_batch_size: 10 is not a multiple of train_micro_batch_size_per_gpu (4)"});
  expect_error(R"({"train_batch_size": -4})", {"train_batch_size: -4 must be >= 1"});
  expect_error(R"({"train_batch_size": 0})", {"train_batch_size: 0 must be >= 1"});
  expect_error(R"({"train_micro_batch_size_per_gpu": 2.5})",
               {"train_micro_batch_size_per_gpu: 2.5 is not an integer"});
  expect_error(R"({"train_batch_size": "8"})",
               {"train_batch_size: expected an integer, got \"8\""});
  expect_error(R"({"train_batch_size": 1e30})", {"train_batch_size: 1e+30 is out of range"});
  expect_error(
      R"({"train_micro_batch_size_per_gpu": 4294967296, "gradient_accumulation_steps": 4294967296})",
      {"overflows"});
  expect_error(doc(R"("gradient_clipping": -1)"), {"gradient_clipping: -1 must be >= 0"});
}

TEST(Config, IntegerKeysAcceptIntegralNumbersWrittenWithExponents) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3, "sub_group_size": 1e9,
      "stage3_prefetch_bucket_size": 5e7, "reduce_bucket_size": 2.5e8,
      "stage3_max_live_parameters": 3e9})"));
  EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(c.zero.reduce_bucket_size, 250'000'000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 3'000'000'000);
  expect_error(doc(R"("zero_optimization": {"sub_group_size": 1e30})"),
               {"zero_optimization.sub_group_size: 1e+30 is out of range"});
  expect_error(doc(R"("zero_optimization": {"sub_group_size": 1.5e0})"),
               {"zero_optimization.sub_group_size: 1.5 is not an integer"});
  expect_error(doc(R"("aio": {"queue_depth": 1.5})"), {"aio.queue_depth: 1.5 is not an integer"});
  expect_error(doc(R"("zero_optimization": {"stage": 4})"),
               {"zero_optimization.stage: 4 must be in [0, 3]"});
  expect_error(doc(R"("zero_optimization": {"reduce_bucket_size": -1})"),
               {"zero_optimization.reduce_bucket_size: -1 must be >= 0"});
}

TEST(Config, BooleansMustBeJsonBooleans) {
  expect_error(doc(R"("zero_optimization": {"overlap_comm": 1})"),
               {"zero_optimization.overlap_comm: expected a boolean (true or false), got 1"});
  expect_error(doc(R"("bf16": {"enabled": "true"})"),
               {"bf16.enabled: expected a boolean", "\"true\""});
  expect_error(doc(R"("strata": {"crc": null})"), {"strata.crc: expected a boolean", "null"});
  expect_error(doc(R"("strata": {"frozen_base": "disk"})"), {"strata.frozen_base", "disk", "files"});
}

TEST(Config, WrongSectionTypesAreErrors) {
  expect_error(doc(R"("aio": 5)"), {"aio: expected an object, got 5"});
  expect_error(doc(R"("strata": {"io": []})"), {"strata.io: expected an object, got []"});
  expect_error(doc(R"("zero_optimization": true)"),
               {"zero_optimization: expected an object, got true", "{\"stage\": 1}"});
  const Config c = parse_ok(doc(R"("aio": null, "zero_optimization": {"offload_param": null})"));
  EXPECT_EQ(c.aio.queue_depth, 8);
}

// --- optimizer ------------------------------------------------------------------

TEST(Config, OptimizerTypeIsCaseInsensitiveLikeDeepSpeed) {
  EXPECT_EQ(parse_ok(doc(R"("optimizer": {"type": "adamw"})")).optimizer.type,
            OptimizerType::kAdamW);
  EXPECT_EQ(parse_ok(doc(R"("optimizer": {"type": "ADAM"})")).optimizer.type, OptimizerType::kAdam);
}

TEST(Config, UnsupportedOptimizersAreErrorsNamingTheSupportedOnes) {
  expect_error(doc(R"("optimizer": {"type": "OneBitAdam"})"),
               {"optimizer.type: \"OneBitAdam\" is a DeepSpeed optimizer strata does not support",
                "supported: Adam, AdamW"});
  expect_error(doc(R"("optimizer": {"type": "SGD"})"), {"optimizer.type: \"SGD\" is not one of Adam, AdamW"});
  expect_error(doc(R"("optimizer": {"params": {"lr": 0.1}})"), {"optimizer.type: missing"});
}

TEST(Config, AdamWithoutAdamWModeWarnsAndFollowsDeepSpeed) {
  const Config c =
      parse_ok(doc(R"("optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}})"));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  const ConfigWarning* w = find_warning(c, "optimizer.params.adam_w_mode");
  ASSERT_NE(w, nullptr) << all_warnings(c);
  EXPECT_NE(w->message.find("AdamW"), std::string::npos);
  EXPECT_NE(w->message.find("\"adam_w_mode\": false"), std::string::npos);
  EXPECT_EQ(c.warnings.size(), 1u) << all_warnings(c);

  const Config l2 =
      parse_ok(doc(R"("optimizer": {"type": "Adam", "params": {"adam_w_mode": false}})"));
  EXPECT_FALSE(l2.optimizer.adam_w_mode);
  EXPECT_TRUE(l2.warnings.empty()) << all_warnings(l2);
}

TEST(Config, AdamWKeepsDecoupledDecayAndWarnsWhenAdamWModeIsFalse) {
  const Config c =
      parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}})"));
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_NE(find_warning(c, "optimizer.params.adam_w_mode"), nullptr) << all_warnings(c);
}

TEST(Config, OptimizerParamsParse) {
  const Config c = parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": 3e-4,
      "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05, "bias_correction": false,
      "torch_adam": false, "amsgrad": false}})"));
  EXPECT_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.05);
  EXPECT_FALSE(c.optimizer.bias_correction);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
}

TEST(Config, OptimizerParamErrorsNameKeyAndValue) {
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"betas": "0.9"}})"),
               {"optimizer.params.betas: expected an array of 2 numbers, got \"0.9\""});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"betas": [0.9]}})"),
               {"optimizer.params.betas: expected an array of 2 numbers, got [0.9]"});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}})"),
               {"optimizer.params.betas[1]: 1.0 must be in [0, 1)"});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"betas": [-0.1, 0.9]}})"),
               {"optimizer.params.betas[0]: -0.1 must be in [0, 1)"});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"eps": 0}})"),
               {"optimizer.params.eps: 0 must be > 0"});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": -0.001}})"),
               {"optimizer.params.lr: -0.001 must be >= 0"});
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"weight_decay": -1}})"),
               {"optimizer.params.weight_decay: -1 must be >= 0"});
  expect_error(doc(R"("optimizer": {"type": "Adam", "params": {"amsgrad": true}})"),
               {"optimizer.params.amsgrad: true is not supported"});
  expect_error(doc(R"("optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}})"),
               {"optimizer.params.max_grad_norm: 1.0", "gradient_clipping"});
}

// DeepSpeed's CPU Adagrad and Lion are named in DeepSpeed configs, but the
// engine implements only Adam(W): the config check refuses them (any
// spelling), naming the supported ones, before an engine is created.
TEST(Config, AdagradAndLionParseWithDeepSpeedsKeysAndDefaults) {
  const Config adagrad = parse_ok(doc(R"("optimizer": {"type": "Adagrad"})"));
  EXPECT_EQ(adagrad.optimizer.type, OptimizerType::kAdagrad);
  EXPECT_EQ(adagrad.optimizer.lr, 1e-2);   // DeepSpeedCPUAdagrad's defaults
  EXPECT_EQ(adagrad.optimizer.eps, 1e-10);
  const Config given = parse_ok(doc(R"("optimizer": {"type": "adagrad", "params": {"lr": 0.5, "eps": 1e-6,
      "weight_decay": 0.1}})"));
  EXPECT_EQ(given.optimizer.lr, 0.5);
  EXPECT_EQ(given.optimizer.eps, 1e-6);
  EXPECT_EQ(given.optimizer.weight_decay, 0.1);
  const Config lion = parse_ok(doc(R"("optimizer": {"type": "LION", "params": {"betas": [0.95, 0.98]}})"));
  EXPECT_EQ(lion.optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(lion.optimizer.lr, 1e-3);
  EXPECT_EQ(lion.optimizer.beta1, 0.95);
  EXPECT_EQ(lion.optimizer.beta2, 0.98);
  // Each takes only its own parameters, as DeepSpeed does.
  expect_error(doc(R"("optimizer": {"type": "Lion", "params": {"eps": 1e-8}})"),
               {"optimizer.params.eps", "Lion takes no eps"});
  expect_error(doc(R"("optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}})"),
               {"optimizer.params.betas", "Adagrad takes no betas"});
  expect_error(doc(R"("optimizer": {})"), {"optimizer.type: missing; give one of Adam, AdamW, Adagrad, Lion"});
}

TEST(Config, TorchAdamTrueIsAcceptedWithAWarning) {
  const Config c =
      parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"torch_adam": true}})"));
  EXPECT_NE(find_warning(c, "optimizer.params.torch_adam"), nullptr) << all_warnings(c);
}

// --- scheduler ------------------------------------------------------------------

TEST(Config, WarmupSchedulesParseWithDeepSpeedParamNames) {
  const Config lr = parse_ok(doc(R"("scheduler": {"type": "WarmupLR", "params": {
      "warmup_min_lr": 1e-6, "warmup_max_lr": 2e-4, "warmup_num_steps": 500,
      "warmup_type": "linear", "last_batch_iteration": -1}})"));
  EXPECT_EQ(lr.scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_EQ(lr.scheduler.warmup_min_lr, 1e-6);
  EXPECT_EQ(lr.scheduler.warmup_max_lr, 2e-4);
  EXPECT_EQ(lr.scheduler.warmup_num_steps, 500);
  EXPECT_EQ(lr.scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_TRUE(lr.warnings.empty()) << all_warnings(lr);

  const Config decay = parse_ok(doc(R"("scheduler": {"type": "WarmupDecayLR", "params": {
      "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "total_num_steps": 10000}})"));
  EXPECT_EQ(decay.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(decay.scheduler.total_num_steps, 10000);
  EXPECT_EQ(decay.scheduler.warmup_type, WarmupType::kLog);

  const Config cosine = parse_ok(doc(R"("scheduler": {"type": "WarmupCosineLR", "params": {
      "total_num_steps": 2000, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
      "warmup_num_steps": 50}})"));
  EXPECT_EQ(cosine.scheduler.type, SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(cosine.scheduler.total_num_steps, 2000);
  EXPECT_EQ(cosine.scheduler.warmup_min_ratio, 0.1);
  EXPECT_EQ(cosine.scheduler.cos_min_ratio, 0.01);
  EXPECT_EQ(cosine.scheduler.warmup_num_steps, 50);
}

TEST(Config, SchedulerErrorsNameKeyAndValue) {
  expect_error(doc(R"("scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})"),
               {"scheduler.params.total_num_steps: missing", "WarmupDecayLR"});
  expect_error(doc(R"("scheduler": {"type": "WarmupCosineLR"})"),
               {"scheduler.params.total_num_steps: missing"});
  expect_error(doc(R"("scheduler": {"type": "OneCycle", "params": {}})"),
               {"scheduler.type: \"OneCycle\"", "does not support"});
  expect_error(
      doc(R"("scheduler": {"type": "warmuplr"})"),
      {"scheduler.type: \"warmuplr\" is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR"});
  expect_error(doc(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})"),
               {"scheduler.params.warmup_type: \"cosine\" is not one of log, linear"});
  expect_error(
      doc(R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                   "warmup_max_lr": 0.1}})"),
      {"scheduler.params.warmup_max_lr: 0.1 given, but WarmupCosineLR takes no warmup_max_lr"});
  expect_error(doc(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}})"),
               {"scheduler.params.warmup_num_steps: 0 must be >= 1"});
  expect_error(doc(R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                   "cos_min_ratio": 1.5}})"),
               {"scheduler.params.cos_min_ratio: 1.5 must be in [0, 1]"});
  // The rule across keys that LrSchedule keeps too (engine/config.h's
  // broken_schedule_rule): refused by the parser, so `strata config` and
  // create agree with training (before, the config was valid and the engine
  // refused it).
  expect_error(doc(R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                   "warmup_num_steps": 10}})"),
               {"scheduler.params.total_num_steps: 10: WarmupCosineLR needs more steps than warmup_num_steps (10"});
  EXPECT_TRUE(parse_config(doc(R"("scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 11,
                   "warmup_num_steps": 10}})")).ok());
}

TEST(Config, WarmupLRWithoutMaxLrWarmsUpToTheOptimizerLr) {
  const Config c = parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}})"));
  EXPECT_EQ(c.scheduler.warmup_max_lr, 3e-5);
  EXPECT_NE(find_warning(c, "scheduler.params.warmup_max_lr"), nullptr) << all_warnings(c);

  const Config decay = parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}})"));
  EXPECT_EQ(decay.scheduler.warmup_max_lr, 1e-3);
  EXPECT_NE(find_warning(decay, "scheduler.params.warmup_max_lr"), nullptr) << all_warnings(decay);
}

TEST(Config, WarmupLRWithoutMaxLrDoesNotWarnWhenTheVersionsAgree) {
  const Config c = parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
      "scheduler": {"type": "WarmupLR"})"));
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-3);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
}

TEST(Config, SchedulerPositionAndShortRunsWarn) {
  const Config c = parse_ok(doc(R"("scheduler": {"type": "WarmupDecayLR", "params": {
      "warmup_max_lr": 1e-3, "warmup_num_steps": 100, "total_num_steps": 50,
      "last_batch_iteration": 7}})"));
  EXPECT_NE(find_warning(c, "scheduler.params.total_num_steps"), nullptr) << all_warnings(c);
  EXPECT_NE(find_warning(c, "scheduler.params.last_batch_iteration"), nullptr) << all_warnings(c);
}

// --- precision ------------------------------------------------------------------

TEST(Config, PrecisionFollowsBf16AndFp16Enabled) {
  const Config bf = parse_ok(doc(R"("bf16": {"enabled": true})"));
  EXPECT_EQ(bf.precision, Precision::kBf16);
  EXPECT_EQ(bf.compute_bytes(), 2);
  EXPECT_EQ(parse_ok(doc(R"("fp16": {"enabled": true})")).precision, Precision::kFp16);
  EXPECT_EQ(parse_ok(doc(R"("fp16": {"enabled": false}, "bf16": {"enabled": false})")).precision,
            Precision::kFp32);
  expect_error(doc(R"("fp16": {"enabled": true}, "bf16": {"enabled": true})"),
               {"fp16.enabled and bf16.enabled are both true"});
}

TEST(Config, Bfloat16IsAnOldNameOfBf16) {
  const Config c = parse_ok(doc(R"("bfloat16": {"enabled": true})"));
  EXPECT_EQ(c.precision, Precision::kBf16);
  EXPECT_NE(find_warning(c, "bfloat16"), nullptr) << all_warnings(c);
  expect_error(doc(R"("bf16": {"enabled": true}, "bfloat16": {"enabled": false})"),
               {"bfloat16", "conflicts with bf16"});
}

TEST(Config, Fp16LossScalerKeysParse) {
  const Config c = parse_ok(doc(R"("fp16": {"enabled": true, "loss_scale": 128,
      "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 4,
      "consecutive_hysteresis": true, "min_loss_scale": 0.5, "auto_cast": false})"));
  EXPECT_EQ(c.fp16.loss_scale, 128.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 4);
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  expect_error(doc(R"("fp16": {"hysteresis": 0})"), {"fp16.hysteresis: 0 must be >= 1"});
  expect_error(doc(R"("fp16": {"min_loss_scale": 0})"), {"fp16.min_loss_scale: 0 must be > 0"});
  expect_error(doc(R"("fp16": {"loss_scale": -1})"), {"fp16.loss_scale: -1 must be >= 0"});
  expect_error(doc(R"("fp16": {"initial_scale_power": 200})"),
               {"fp16.initial_scale_power: 200 must be in [0, 126]"});
  // 2^127 is no float's loss scale: refused here, as the engine would refuse it.
  expect_error(doc(R"("fp16": {"initial_scale_power": 127})"),
               {"fp16.initial_scale_power: 127 must be in [0, 126]"});
  const Config cast = parse_ok(doc(R"("fp16": {"enabled": true, "auto_cast": true})"));
  EXPECT_NE(find_warning(cast, "fp16.auto_cast"), nullptr) << all_warnings(cast);
}

TEST(Config, Bf16MasterWeightOptionsWarnThatStrataKeepsFp32) {
  const Config c = parse_ok(doc(R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
      "bf16_optimizer_states": false})"));
  EXPECT_NE(find_warning(c, "bf16.bf16_master_weights_and_grads"), nullptr) << all_warnings(c);
  EXPECT_EQ(find_warning(c, "bf16.bf16_optimizer_states"), nullptr) << all_warnings(c);
}

// --- zero_optimization ----------------------------------------------------------------

// DeepSpeed's ZeRO-Offload tutorial (stage 2, optimizer state on the CPU).
TEST(Config, ZeroOffloadCpuAsDeepSpeedDocumentsIt) {
  const Config c = parse_ok(doc(R"(
    "zero_optimization": {
      "stage": 2,
      "offload_optimizer": {"device": "cpu"},
      "contiguous_gradients": true,
      "overlap_comm": true
    })"));
  EXPECT_EQ(c.zero.stage, 2);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_TRUE(c.swap_paths().empty());
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
}

// DeepSpeed's ZeRO-Infinity example (stage 3, optimizer and parameters on NVMe).
TEST(Config, ZeroInfinityNvmeAsDeepSpeedDocumentsIt) {
  const Config c = parse_ok(doc(R"(
    "zero_optimization": {
      "stage": 3,
      "contiguous_gradients": true,
      "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9,
      "stage3_prefetch_bucket_size": 1e7,
      "stage3_param_persistence_threshold": 1e5,
      "reduce_bucket_size": 1e7,
      "sub_group_size": 1e9,
      "offload_optimizer": {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": true,
        "buffer_count": 4,
        "fast_init": false
      },
      "offload_param": {
        "device": "nvme",
        "nvme_path": "/local_nvme",
        "pin_memory": true,
        "buffer_count": 5,
        "buffer_size": 1e8,
        "max_in_cpu": 1e9
      }
    },
    "aio": {
      "block_size": 1048576,
      "queue_depth": 8,
      "thread_count": 1,
      "single_submit": false,
      "overlap_events": true
    })"));
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_TRUE(c.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 10'000'000);
  EXPECT_EQ(c.zero.reduce_bucket_size, 10'000'000);
  EXPECT_EQ(c.swap_paths(), std::vector<std::string>{"/local_nvme"});
  // Only the old aio name warns.
  ASSERT_EQ(c.warnings.size(), 1u) << all_warnings(c);
  EXPECT_EQ(c.warnings[0].key_path, "aio.thread_count");
  // aio.queue_depth was given: it becomes strata.io.queue_depth.
  EXPECT_EQ(c.strata.io.queue_depth, 8);
}

TEST(Config, ExampleConfigFilesLoad) {
  Result<Config> nvme = load_config_file(example("deepspeed_zero3_nvme.json"));
  ASSERT_TRUE(nvme.ok()) << nvme.status().to_string();
  EXPECT_EQ(nvme->precision, Precision::kBf16);
  EXPECT_EQ(nvme->train_batch_size, 16);
  EXPECT_EQ(nvme->gradient_accumulation_steps, 1);
  EXPECT_EQ(nvme->optimizer.weight_decay, 0.1);
  EXPECT_EQ(nvme->optimizer.beta2, 0.95);
  EXPECT_EQ(nvme->scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(nvme->scheduler.total_num_steps, 10000);
  EXPECT_EQ(nvme->zero.reduce_bucket_size, 1'000'000);
  EXPECT_TRUE(nvme->zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(nvme->zero.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(nvme->zero.offload_param.max_in_cpu, 1'000'000'000);  // written in the file: DeepSpeed's documented value
  EXPECT_NE(find_warning(*nvme, "aio.thread_count"), nullptr) << all_warnings(*nvme);

  Result<Config> cpu = load_config_file(example("deepspeed_zero_offload_cpu.json"));
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  EXPECT_EQ(cpu->precision, Precision::kFp16);
  EXPECT_EQ(cpu->train_batch_size, 32);
  EXPECT_EQ(cpu->optimizer.type, OptimizerType::kAdam);
  EXPECT_TRUE(cpu->optimizer.adam_w_mode);
  EXPECT_NE(find_warning(*cpu, "optimizer.params.adam_w_mode"), nullptr) << all_warnings(*cpu);
  EXPECT_EQ(cpu->scheduler.warmup_max_lr, 3e-5);
  EXPECT_EQ(cpu->zero.offload_optimizer.device, OffloadDevice::kCpu);

  Result<Config> native = load_config_file(example("strata_default.json"));
  ASSERT_TRUE(native.ok()) << native.status().to_string();
  EXPECT_EQ(native->strata.seed, 1234u);
  EXPECT_EQ(native->strata.device, DeviceKind::kHost);
  EXPECT_EQ(native->strata.chunk_bytes, 16u << 20);
  EXPECT_EQ(native->strata.budgets.device_bytes, 2ull << 30);
  EXPECT_EQ(native->strata.budgets.pinned_bytes, 8ull << 30);
  EXPECT_EQ(native->swap_paths(), std::vector<std::string>{"./strata_swap"});
  EXPECT_TRUE(native->warnings.empty()) << all_warnings(*native);
}

TEST(Config, PlacementExamplesLoadWithoutWarningsAndPlaceWhatTheyNameSay) {
  struct Case {
    const char* file;
    OffloadDevice optimizer, param;
    double cpu_fraction;
    std::int64_t max_in_cpu = 0;
  };
  const Case cases[] = {
      {"placement_device.json", OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
      {"placement_cpu_optimizer.json", OffloadDevice::kCpu, OffloadDevice::kNone, 0.0},
      {"placement_cpu_all.json", OffloadDevice::kCpu, OffloadDevice::kCpu, 0.0},
      {"placement_nvme_optimizer.json", OffloadDevice::kNvme, OffloadDevice::kNone, 0.0},
      {"placement_nvme_all.json", OffloadDevice::kNvme, OffloadDevice::kNvme, 0.0},
      {"placement_cpu_nvme_split.json", OffloadDevice::kNvme, OffloadDevice::kCpu, 0.5},
      {"placement_nvme_max_in_cpu.json", OffloadDevice::kNvme, OffloadDevice::kNvme, 0.0, 300'000},
      {"finetune_frozen_base.json", OffloadDevice::kNvme, OffloadDevice::kCpu, 0.0},
  };
  for (const Case& k : cases) {
    Result<Config> c = load_config_file(example(k.file));
    ASSERT_TRUE(c.ok()) << k.file << ": " << c.status().to_string();
    EXPECT_TRUE(c->warnings.empty()) << k.file << ": " << all_warnings(*c);
    EXPECT_EQ(c->zero.offload_optimizer.device, k.optimizer) << k.file;
    EXPECT_EQ(c->zero.offload_param.device, k.param) << k.file;
    EXPECT_EQ(c->strata.optimizer_cpu_fraction, k.cpu_fraction) << k.file;
    EXPECT_EQ(c->zero.offload_param.max_in_cpu, k.max_in_cpu) << k.file;
    EXPECT_EQ(c->strata.device, DeviceKind::kHost) << k.file;
    EXPECT_EQ(c->precision, Precision::kBf16) << k.file;
  }
}

void expect_round_trip(const Config& c);  // (to_json, below)

// max_in_cpu "auto" (strata's): filled at finalize from what
// strata.budgets.pinned leaves, so it needs one with the copies on nvme;
// written back as "auto".
TEST(Config, MaxInCpuAutoNeedsAPinnedBudget) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
      "max_in_cpu": "auto"}}, "strata": {"budgets": {"pinned": "8GiB"}})"));
  EXPECT_TRUE(c.zero.offload_param.max_in_cpu_auto);
  EXPECT_NE(to_json(c).find("\"max_in_cpu\": \"auto\""), std::string::npos) << to_json(c);
  expect_round_trip(c);
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "max_in_cpu": "auto"}})"),
               {"zero_optimization.offload_param.max_in_cpu: \"auto\"", "strata.budgets.pinned is not set"});
  // Without the copies on nvme it has no effect, and needs nothing.
  const Config cpu = parse_ok(
      doc(R"("zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": "auto"}})"));
  EXPECT_TRUE(cpu.zero.offload_param.max_in_cpu_auto);
}

TEST(Config, OffloadPlacementRulesFollowDeepSpeed) {
  expect_error(doc(R"("zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}})"),
               {"zero_optimization.offload_param.device: \"nvme\" needs zero_optimization.stage 3",
                "stage is 2"});
  expect_error(doc(R"("zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}})"),
               {"zero_optimization.offload_param.device: \"cpu\""});
  expect_error(doc(R"("zero_optimization": {"offload_optimizer": {"device": "cpu"}})"),
               {"zero_optimization.offload_optimizer.device: \"cpu\"", "stage is 0"});
  expect_error(doc(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                   "ratio": 0.5}})"),
               {"zero_optimization.offload_optimizer.ratio: 0.5", "stage 3"});
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0}})"),
               {"zero_optimization.offload_optimizer.ratio: 0 must be in (0, 1]"});
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 1.5}})"),
               {"zero_optimization.offload_optimizer.ratio: 1.5 must be in (0, 1]"});
  expect_error(
      doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}})"),
      {"zero_optimization.offload_optimizer.device: \"gpu\" is not one of none, cpu, nvme"});
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"nvme_path": ""}})"),
               {"zero_optimization.offload_optimizer.nvme_path: \"\" must not be empty"});
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "ratio": 0.3}})"));
  EXPECT_EQ(c.zero.offload_optimizer.ratio, 0.3);
}

TEST(Config, OldZeroFormsAreReadWithWarnings) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3, "cpu_offload": true,
      "cpu_offload_param": true, "cpu_offload_use_pin_memory": true,
      "stage3_gather_fp16_weights_on_model_save": true})"));
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  for (const char* path : {"zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
                           "zero_optimization.cpu_offload_use_pin_memory",
                           "zero_optimization.stage3_gather_fp16_weights_on_model_save"}) {
    EXPECT_NE(find_warning(c, path), nullptr) << path << "\n" << all_warnings(c);
  }
  expect_error(doc(R"("zero_optimization": {"stage": 2, "cpu_offload": true,
                   "offload_optimizer": {"device": "cpu"}})"),
               {"zero_optimization.cpu_offload: true conflicts with "
                "zero_optimization.offload_optimizer"});
  expect_error(doc(R"("zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                   "stage3_gather_fp16_weights_on_model_save": false})"),
               {"zero_optimization.stage3_gather_fp16_weights_on_model_save: false conflicts "
                "with zero_optimization.stage3_gather_16bit_weights_on_model_save = true"});
}

TEST(Config, DeepSpeedFieldNamesOfStage3KeysAreAccepted) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3, "prefetch_bucket_size": 123,
      "param_persistence_threshold": 456, "max_live_parameters": 789,
      "max_reuse_distance": 1011, "gather_16bit_weights_on_model_save": true})"));
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 123);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 456);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 789);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 1011);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
}

TEST(Config, TwoSpellingsOfOneKeyMustAgree) {
  expect_error(doc(R"("zero_optimization": {"stage3_prefetch_bucket_size": 100,
                   "prefetch_bucket_size": 200})"),
               {"zero_optimization.prefetch_bucket_size: 200 conflicts with "
                "zero_optimization.stage3_prefetch_bucket_size = 100"});
  const Config same = parse_ok(doc(R"("zero_optimization": {"stage3_prefetch_bucket_size": 100,
      "prefetch_bucket_size": 100})"));
  EXPECT_EQ(same.zero.stage3_prefetch_bucket_size, 100);
  EXPECT_TRUE(same.warnings.empty()) << all_warnings(same);
}

TEST(Config, KeysWithoutEffectWarnOnlyWhenTheyWouldMatter) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "pin_memory": false, "buffer_count": 8,
                            "fast_init": true, "cpuadam_cores_perc": 0.5},
      "offload_param": {"device": "nvme", "pin_memory": true, "buffer_count": 5,
                        "buffer_size": 2e8, "max_in_cpu": 1e8}},
      "aio": {"intra_op_parallelism": 4, "use_gds": true, "single_submit": true,
              "overlap_events": false})"));
  for (const char* path :
       {"zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        "zero_optimization.offload_param.buffer_size",
        "aio.intra_op_parallelism", "aio.use_gds", "aio.single_submit", "aio.overlap_events"}) {
    EXPECT_NE(find_warning(c, path), nullptr) << path << "\n" << all_warnings(c);
  }
  // max_in_cpu has its effect: the compute copies kept in pinned memory.
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 100'000'000);
  EXPECT_FALSE(c.zero.offload_param.max_in_cpu_auto);
  EXPECT_EQ(find_warning(c, "zero_optimization.offload_param.max_in_cpu"), nullptr);
  // Defaults, or values strata matches anyway, do not warn.
  EXPECT_EQ(find_warning(c, "zero_optimization.offload_param.pin_memory"), nullptr);
  EXPECT_EQ(find_warning(c, "zero_optimization.offload_param.buffer_count"), nullptr);
  EXPECT_NE(find_warning(c, "zero_optimization.offload_optimizer.buffer_count")
                ->message.find("strata.budgets.staging"),
            std::string::npos);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 8);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 200'000'000);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
}

TEST(Config, KnownDeepSpeedKeysWithoutEffectAreNotUnknown) {
  LogCapture logs;
  const std::string json = doc(R"("steps_per_print": 10, "wall_clock_breakdown": false,
      "wandb": {"enabled": true}, "tensorboard": {"enabled": false},
      "activation_checkpointing": {"partition_activations": true},
      "communication_data_type": "fp32", "zero_allow_untested_optimizer": true,
      "amp": {"enabled": false}, "flops_profiler": {}, "data_types": {"grad_accum_dtype": "fp32"},
      "optimizer": {"type": "AdamW", "legacy_fusion": false},
      "bf16": {"enabled": true, "immediate_grad_update": true},
      "zero_optimization": {"stage": 2, "reduce_scatter": true, "allgather_partitions": true,
          "round_robin_gradients": true, "zero_quantized_weights": false, "mics_shard_size": -1,
          "memory_efficient_linear": true, "stage3_model_persistence_threshold": 1e9,
          "offload_optimizer": {"device": "cpu", "pin_memory": true, "pipeline_read": false}})");
  ParseOptions strict;
  strict.strict = true;
  const Config c = parse_ok(json, strict);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_TRUE(c.strata.strict);
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"steps_per_print", "no effect"}));
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"zero_optimization.reduce_scatter", "no effect"}));

  const Config amp = parse_ok(doc(R"("amp": {"enabled": true, "opt_level": "O1"})"));
  EXPECT_NE(find_warning(amp, "amp"), nullptr) << all_warnings(amp);
}

// --- aio ------------------------------------------------------------------------

TEST(Config, AioThreadCountIsTheOldNameOfIntraOpParallelism) {
  const Config c = parse_ok(doc(R"("aio": {"thread_count": 2})"));
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_NE(find_warning(c, "aio.thread_count"), nullptr) << all_warnings(c);
  const Config same = parse_ok(doc(R"("aio": {"thread_count": 1, "intra_op_parallelism": 1})"));
  EXPECT_EQ(same.aio.intra_op_parallelism, 1);
  expect_error(doc(R"("aio": {"intra_op_parallelism": 2, "thread_count": 4})"),
               {"aio.thread_count: 4 conflicts with aio.intra_op_parallelism = 2"});
  expect_error(doc(R"("aio": {"io_backend": "spdk"})"),
               {"aio.io_backend: \"spdk\" is not one of async_io, posix"});
}

TEST(Config, IoQueueDepthAndBlockSizePrecedence) {
  // Nothing given: strata's own default, not aio's 8.
  EXPECT_EQ(parse_ok(doc()).strata.io.queue_depth, 32);
  // aio.queue_depth given: used.
  EXPECT_EQ(parse_ok(doc(R"("aio": {"queue_depth": 64})")).strata.io.queue_depth, 64);
  // strata.io.queue_depth given: wins.
  const Config both = parse_ok(doc(R"("aio": {"queue_depth": 64, "block_size": 262144},
      "strata": {"io": {"queue_depth": 16, "block_bytes": "2MiB"}})"));
  EXPECT_EQ(both.strata.io.queue_depth, 16);
  EXPECT_EQ(both.aio.queue_depth, 64);
  EXPECT_EQ(both.strata.io.block_bytes, 2u << 20);
  EXPECT_EQ(both.aio.block_size, 262144);
  // aio.block_size given alone: used.
  EXPECT_EQ(parse_ok(doc(R"("aio": {"block_size": 262144})")).strata.io.block_bytes, 262144u);
  expect_error(doc(R"("aio": {"queue_depth": 5000})"),
               {"aio.queue_depth: 5000 must be in [1, 4096]", "strata.io.queue_depth"});
  expect_error(doc(R"("aio": {"block_size": 1000})"),
               {"aio.block_size: 1000 is not a multiple of 4096", "strata.io.block_bytes"});
  // strata.io.block_bytes given: an odd aio.block_size does not matter.
  EXPECT_EQ(parse_ok(doc(R"("aio": {"block_size": 1000}, "strata": {"io": {"block_bytes": 4096}})"))
                .strata.io.block_bytes,
            4096u);
}

TEST(Config, AioPosixBackendSelectsPsyncUnlessStrataSaysOtherwise) {
  EXPECT_EQ(parse_ok(doc(R"("aio": {"io_backend": "posix"})")).strata.io.backend,
            IoBackend::kPsync);
  EXPECT_EQ(parse_ok(doc(R"("aio": {"io_backend": "async_io"})")).strata.io.backend,
            IoBackend::kAuto);
  EXPECT_EQ(
      parse_ok(doc(R"("aio": {"io_backend": "posix"}, "strata": {"io": {"backend": "libaio"}})"))
          .strata.io.backend,
      IoBackend::kLibaio);
}

// --- strata ---------------------------------------------------------------------

TEST(Config, StrataKeysParse) {
  const Config c = parse_ok(doc(R"(
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
    "strata": {
      "strict": false,
      "seed": 18446744073709551615,
      "budgets": {"device": "70 GiB", "pinned": "64GiB", "staging": 1073741824, "disk": "2TB"},
      "chunk_bytes": "32MiB",
      "optimizer_cpu_fraction": 0.25,
      "io": {"backend": "io_uring", "paths": ["/nvme0/swap", "/nvme1/swap"],
             "stripe_bytes": "4MiB", "queue_depth": 128, "block_bytes": 524288, "rings": 2,
             "sqpoll": true, "keep_files": true},
      "checkpoint": {"keep_last": 3, "keep_every": 1000, "keep_base": true},
      "crc": false,
      "frozen_base": "files",
      "cpu_adam": {"isa": "avx512", "threads": 12, "tile_elems": 262144, "bind": "numa", "numa_node": 1},
      "optimizer_state": {"format": "bf16", "rounding": "stochastic"},
      "overlap": "delayed",
      "device": "host",
      "host_device": {"memory_bytes": "24GiB", "h2d_gbps": 25, "d2h_gbps": 24.5,
                      "d2d_gbps": 1500, "tflops": 400},
      "nonfinite": "error",
      "no_grad": "zero",
      "device_collectives": "off",
      "trace": "/tmp/trace.json"
    })"));
  const StrataConfig& s = c.strata;
  EXPECT_EQ(s.seed, 18446744073709551615ull);
  EXPECT_EQ(s.budgets.device_bytes, 70ull << 30);
  EXPECT_EQ(s.budgets.pinned_bytes, 64ull << 30);
  EXPECT_EQ(s.budgets.staging_bytes, 1ull << 30);
  EXPECT_EQ(s.budgets.disk_bytes, 2'000'000'000'000ull);
  EXPECT_EQ(s.chunk_bytes, 32ull << 20);
  EXPECT_EQ(s.frozen_base, FrozenBase::kFiles);
  EXPECT_EQ(s.optimizer_cpu_fraction, 0.25);
  EXPECT_EQ(s.io.backend, IoBackend::kIoUring);
  EXPECT_EQ(s.io.paths, (std::vector<std::string>{"/nvme0/swap", "/nvme1/swap"}));
  EXPECT_EQ(s.io.stripe_bytes, 4ull << 20);
  EXPECT_EQ(s.io.queue_depth, 128);
  EXPECT_EQ(s.io.block_bytes, 524288u);
  EXPECT_EQ(s.io.rings, 2);
  EXPECT_TRUE(s.io.sqpoll);
  EXPECT_TRUE(s.io.keep_files);
  EXPECT_EQ(s.checkpoint.keep_last, 3);
  EXPECT_EQ(s.checkpoint.keep_every, 1000);
  EXPECT_TRUE(s.checkpoint.keep_base);
  EXPECT_FALSE(s.crc);
  EXPECT_EQ(s.cpu_adam.isa, CpuAdamIsa::kAvx512);
  EXPECT_EQ(s.cpu_adam.threads, 12);
  EXPECT_EQ(s.cpu_adam.tile_elems, 262144);
  EXPECT_EQ(s.cpu_adam.bind, CpuAdamBind::kNuma);
  EXPECT_EQ(s.cpu_adam.numa_node, 1);
  EXPECT_EQ(s.optimizer_state.format, StateFormat::kBf16);
  EXPECT_EQ(s.optimizer_state.rounding, StateRounding::kStochastic);
  EXPECT_EQ(s.overlap, OverlapMode::kDelayed);
  EXPECT_EQ(s.device, DeviceKind::kHost);
  EXPECT_EQ(s.host_device.memory_bytes, 24ull << 30);
  EXPECT_EQ(s.host_device.h2d_gbps, 25.0);
  EXPECT_EQ(s.host_device.d2h_gbps, 24.5);
  EXPECT_EQ(s.host_device.d2d_gbps, 1500.0);
  EXPECT_EQ(s.host_device.tflops, 400.0);
  EXPECT_EQ(s.nonfinite, NonfinitePolicy::kError);
  EXPECT_EQ(s.no_grad, NoGradPolicy::kZero);
  EXPECT_EQ(s.device_collectives, DeviceCollectives::kOff);
  EXPECT_EQ(s.trace, "/tmp/trace.json");
  EXPECT_EQ(c.swap_paths(), s.io.paths);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  // A single path may be a string.
  EXPECT_EQ(parse_ok(doc(R"("strata": {"io": {"paths": "/swap"}})")).strata.io.paths,
            std::vector<std::string>{"/swap"});
}

TEST(Config, StrataErrorsNameKeyAndValue) {
  expect_error(doc(R"("strata": {"checkpoint": {"keep_last": -1}})"),
               {"strata.checkpoint.keep_last: -1 must be >= 0"});
  expect_error(doc(R"("strata": {"checkpoint": {"keep_every": 2.5}})"), {"strata.checkpoint.keep_every"});
  expect_error(doc(R"("strata": {"chunk_bytes": 1000000})"),
               {"strata.chunk_bytes: 1000000 is not a multiple of 262144 bytes",
                "the norm block: 65536 fp32 elements"});
  expect_error(doc(R"("strata": {"chunk_bytes": 0})"), {"strata.chunk_bytes: 0 must be >= 1"});
  expect_error(doc(R"("strata": {"io": {"queue_depth": 0}})"),
               {"strata.io.queue_depth: 0 must be in [1, 4096]"});
  expect_error(doc(R"("strata": {"io": {"queue_depth": 4097}})"),
               {"strata.io.queue_depth: 4097 must be in [1, 4096]"});
  expect_error(doc(R"("strata": {"io": {"block_bytes": 1000}})"),
               {"strata.io.block_bytes: 1000 is not a multiple of 4096"});
  expect_error(doc(R"("strata": {"io": {"stripe_bytes": "1000B"}})"),
               {"strata.io.stripe_bytes: \"1000B\" (1000 bytes) is not a multiple of 4096"});
  expect_error(doc(R"("strata": {"io": {"rings": 65}})"),
               {"strata.io.rings: 65 must be in [1, 64]"});
  expect_error(doc(R"("strata": {"io": {"paths": []}})"),
               {"strata.io.paths: [] must not be empty"});
  expect_error(doc(R"("strata": {"io": {"paths": ["/a", "/b", "/a"]}})"),
               {"strata.io.paths[2]: \"/a\" is listed twice"});
  expect_error(doc(R"("strata": {"io": {"paths": ["/a", 3]}})"),
               {"strata.io.paths[1]: expected a string, got 3"});
  expect_error(doc(R"("strata": {"io": {"paths": ["/a", ""]}})"),
               {"strata.io.paths[1]: \"\" must not be empty"});
  expect_error(doc(R"("strata": {"io": {"backend": "spdk"}})"),
               {"strata.io.backend: \"spdk\" is not one of auto, io_uring, libaio, psync"});
  expect_error(doc(R"("strata": {"cpu_adam": {"tile_elems": 1000}})"),
               {"strata.cpu_adam.tile_elems: 1000 is not a multiple of 65536"});
  expect_error(doc(R"("strata": {"cpu_adam": {"threads": -1}})"),
               {"strata.cpu_adam.threads: -1 must be in [0, 4096]"});
  expect_error(doc(R"("strata": {"cpu_adam": {"isa": "sse"}})"),
               {"strata.cpu_adam.isa: \"sse\" is not one of auto, avx512_bf16, avx512, avx2, scalar"});
  expect_error(doc(R"("strata": {"cpu_adam": {"bind": "socket"}})"),
               {"strata.cpu_adam.bind: \"socket\" is not one of auto, numa, cores, none"});
  expect_error(doc(R"("strata": {"cpu_adam": {"bind": true}})"), {"strata.cpu_adam.bind", "true"});
  expect_error(doc(R"("strata": {"cpu_adam": {"numa_node": -2}})"),
               {"strata.cpu_adam.numa_node: -2 must be in [-1, 1023]"});
  expect_error(doc(R"("strata": {"cpu_adam": {"numa_node": "0"}})"), {"strata.cpu_adam.numa_node", "\"0\""});
  expect_error(doc(R"("strata": {"cpu_adam": {"bind": "none", "numa_node": 1}})"),
               {"strata.cpu_adam.numa_node: 1 applies to bind \"auto\" or \"numa\", not \"none\""});
  expect_error(doc(R"("strata": {"host_device": {"tflops": -1}})"),
               {"strata.host_device.tflops: -1 must be >= 0"});
  expect_error(doc(R"("strata": {"budgets": {"pinned": "ten"}})"),
               {"strata.budgets.pinned: expected a byte count", "\"ten\""});
  expect_error(doc(R"("strata": {"budgets": {"pinned": -5}})"),
               {"strata.budgets.pinned: -5 must be >= 0"});
  expect_error(doc(R"("strata": {"budgets": {"pinned": 1.5}})"),
               {"strata.budgets.pinned: 1.5 is not a whole number of bytes"});
  expect_error(
      doc(R"("strata": {"budgets": {"pinned": "1GiB", "staging": "2GiB"}})"),
      {"strata.budgets.staging: 2147483648 bytes (2.00 GiB) exceeds strata.budgets.pinned"});
  expect_error(doc(R"("zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   "strata": {"optimizer_cpu_fraction": 0.5})"),
               {"strata.optimizer_cpu_fraction: 0.5 is set but "
                "zero_optimization.offload_optimizer.device is \"cpu\""});
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
                   "strata": {"optimizer_cpu_fraction": 1.5})"),
               {"strata.optimizer_cpu_fraction: 1.5 must be in [0, 1]"});
  expect_error(doc(R"("strata": {"overlap": "full"})"),
               {"strata.overlap: \"full\" is not one of exact, delayed, speculative, none"});
  expect_error(doc(R"("strata": {"device": "gpu"})"),
               {"strata.device: \"gpu\" is not one of auto, cuda, host"});
  expect_error(doc(R"("strata": {"nonfinite": "ignore"})"),
               {"strata.nonfinite: \"ignore\" is not one of skip, error, apply"});
  expect_error(doc(R"("strata": {"no_grad": "accumulate"})"),
               {"strata.no_grad: \"accumulate\" is not one of skip, zero"});
  expect_error(doc(R"("communication_data_type": "fp16")"), {"communication_data_type: \"fp16\": strata sums"});
  expect_error(doc(R"("communication_data_type": "int8")"),
               {"communication_data_type: \"int8\" is not one of fp32, bf16, fp16"});
  expect_error(doc(R"("strata": {"device_collectives": "nccl"})"),
               {"strata.device_collectives: \"nccl\" is not one of auto, on, off"});
  expect_error(doc(R"("strata": {"seed": -1})"), {"strata.seed: -1 must be >= 0"});
  expect_error(doc(R"("strata": {"optimizer_state": {"format": "int4"}})"),
               {"strata.optimizer_state.format: \"int4\" is not one of fp32, bf16, int8_blockwise"});
  expect_error(doc(R"("strata": {"optimizer_state": {"format": "int8_blockwise", "rounding": "stochastic"}})"),
               {"strata.optimizer_state.rounding: \"stochastic\" rounds bf16 moments, but "
                "strata.optimizer_state.format is \"int8_blockwise\""});
  expect_error(doc(R"("optimizer": {"type": "Lion"}, "strata": {"optimizer_state": {"format": "int8_blockwise"}})"),
               {"strata.optimizer_state.format: \"int8_blockwise\" stores Adam's and AdamW's moments"});
  expect_error(doc(R"("strata": {"optimizer_state": {"format": "bf16", "rounding": "up"}})"),
               {"strata.optimizer_state.rounding: \"up\" is not one of nearest_even, stochastic"});
  expect_error(doc(R"("strata": {"optimizer_state": {"rounding": "stochastic"}})"),
               {"strata.optimizer_state.rounding: \"stochastic\" rounds bf16 moments, but "
                "strata.optimizer_state.format is \"fp32\""});
  expect_error(doc(R"("optimizer": {"type": "Lion"}, "strata": {"optimizer_state": {"format": "bf16"}})"),
               {"strata.optimizer_state.format: \"bf16\" stores Adam's and AdamW's moments; "
                "optimizer.type is \"Lion\""});
  expect_error(doc(R"("optimizer": {"type": "Adagrad"}, "strata": {"optimizer_state": {"format": "bf16"}})"),
               {"optimizer.type is \"Adagrad\""});
  expect_error(doc(R"("strata": {"trace": 5})"), {"strata.trace: expected a string, got 5"});
}

TEST(Config, ByteSizesWrittenAsStringsAreQuotedInErrors) {
  expect_error(doc(R"("strata": {"chunk_bytes": "1MB"})"),
               {"strata.chunk_bytes: \"1MB\" (1000000 bytes) is not a multiple of 262144 bytes"});
  EXPECT_EQ(parse_ok(doc(R"("strata": {"chunk_bytes": "1MiB"})")).strata.chunk_bytes, 1u << 20);
  EXPECT_EQ(parse_ok(doc(R"("strata": {"chunk_bytes": 5.24288e5})")).strata.chunk_bytes, 524288u);
}

TEST(Config, StrataIoPathsWinOverDeepSpeedNvmePathsWithAWarning) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/mnt/b"}},
      "strata": {"io": {"paths": ["/mnt/b", "/mnt/c"]}})"));
  EXPECT_EQ(c.swap_paths(), (std::vector<std::string>{"/mnt/b", "/mnt/c"}));
  const ConfigWarning* w = find_warning(c, "zero_optimization.offload_optimizer.nvme_path");
  ASSERT_NE(w, nullptr) << all_warnings(c);
  EXPECT_NE(w->message.find("\"/mnt/a\""), std::string::npos) << w->message;
  EXPECT_NE(w->message.find("strata.io.paths wins"), std::string::npos) << w->message;
  // /mnt/b is among strata.io.paths: no warning for it.
  EXPECT_EQ(find_warning(c, "zero_optimization.offload_param.nvme_path"), nullptr);
  EXPECT_EQ(c.warnings.size(), 1u) << all_warnings(c);
}

TEST(Config, SwapPathsComeFromNvmePlacementsWithoutStrataPaths) {
  const Config c = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/mnt/a"}})"));
  EXPECT_EQ(c.swap_paths(), std::vector<std::string>{"/mnt/a"});
  const Config two = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/mnt/b"}})"));
  EXPECT_EQ(two.swap_paths(), (std::vector<std::string>{"/mnt/a", "/mnt/b"}));
  const Config cpu = parse_ok(doc(R"("zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "nvme_path": "/mnt/a"}},
      "strata": {"io": {"paths": ["/x"]}})"));
  EXPECT_TRUE(cpu.swap_paths().empty());
  EXPECT_TRUE(cpu.warnings.empty()) << all_warnings(cpu);
}

// --- unknown keys and strict ----------------------------------------------------------

TEST(Config, MisspelledKeysAndUnknownStrataKeysAreErrorsAllNamedInOneRun) {
  // A misspelled key would silently take its default (clipping off, the
  // optimizer state left on the GPU): an error, with the key it resembles;
  // so is any unknown key in strata's own section. Every one is named.
  const Result<Config> c = parse_config(doc(R"("trian_batch_size": 3, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"devise": "cpu"}}, "strata": {"io": {"ring": 2}, "frobnicate": 1})"));
  ASSERT_FALSE(c.ok());
  const std::string m(c.status().message());
  EXPECT_NE(m.find("4 problems: (1) "), std::string::npos) << m;
  for (const char* want : {"trian_batch_size: unknown key; did you mean \"train_batch_size\"",
                           "zero_optimization.offload_optimizer.devise: unknown key; did you mean \"device\"",
                           "strata.io.ring: unknown key; did you mean \"rings\"",
                           "strata.frobnicate: unknown key in strata's own section"}) {
    EXPECT_NE(m.find(want), std::string::npos) << want << "\nin: " << m;
  }
  // A wrong value in one section and misspellings in others, in one run.
  expect_error(doc(R"("optimizer": {"type": "AdamW", "params": {"lr": -1}}, "zero_optimization": {"stage": 7},
                   "strata": {"budgets": {"pinnned": 5}})"),
               {"3 problems", "optimizer.params.lr: -1 must be >= 0", "zero_optimization.stage: 7 must be in [0, 3]",
                "strata.budgets.pinnned: unknown key; did you mean \"pinned\""});
  // One problem keeps its one-line form.
  expect_error(doc(R"("gradient_cliping": 1.0)"), {"gradient_cliping: unknown key; did you mean \"gradient_clipping\""});
  // Keys of four letters or fewer: two edits reach other words, so only one counts as a misspelling.
  expect_error(doc(R"("bf17": {"enabled": true})"), {"bf17: unknown key; did you mean \"bf16\""});
  const Config two_edits = parse_ok(doc(R"("bf61": {"enabled": true})"));
  EXPECT_NE(find_warning(two_edits, "bf61"), nullptr) << all_warnings(two_edits);
}

TEST(Config, AMissingKeyNamesAPresentMisspellingOfIt) {
  expect_error(doc(R"("optimizer": {"typ": "AdamW", "params": {"lr": 1e-3}})"),
               {"optimizer.type: missing; give one of", "(\"typ\" is there: a misspelling of \"type\"?)"});
  expect_error(doc(R"("scheduler": {"type": "WarmupDecayLR", "params": {"total_num_step": 10}})"),
               {"scheduler.params.total_num_steps: missing",
                "(\"total_num_step\" is there: a misspelling of \"total_num_steps\"?)"});
}

TEST(Config, AMisspellingIsToldTheCurrentNameBeforeAnOldOne) {
  // "intra_op_parallelizm" is one edit from the current name; "thread_cont"
  // is close only to the old name thread_count, which is suggested then.
  expect_error(doc(R"("aio": {"intra_op_parallelizm": 2})"), {"did you mean \"intra_op_parallelism\""});
  expect_error(doc(R"("aio": {"thread_cont": 2})"), {"did you mean \"thread_count\""});
}

TEST(Config, OtherUnknownDeepSpeedKeysWarnWithTheirPath) {
  const Config c = parse_ok(doc(R"("wall_clock_breakdown_extra": true, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu", "some_future_knob": 1}})"));
  EXPECT_NE(find_warning(c, "wall_clock_breakdown_extra"), nullptr) << all_warnings(c);
  EXPECT_NE(find_warning(c, "zero_optimization.offload_optimizer.some_future_knob"), nullptr) << all_warnings(c);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.warnings.size(), 2u) << all_warnings(c);

  const Config params =
      parse_ok(doc(R"("optimizer": {"type": "AdamW", "params": {"momentum": 0.9}})"));
  EXPECT_NE(find_warning(params, "optimizer.params.momentum"), nullptr) << all_warnings(params);
}

TEST(Config, StrictMakesUnknownKeysErrors) {
  expect_error(doc(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"devise": "cpu"}},
                   "strata": {"strict": true})"),
               {"zero_optimization.offload_optimizer.devise: unknown key"});
  ParseOptions strict;
  strict.strict = true;
  expect_error(doc(R"("foo": 1)"), {"foo: unknown key"}, strict);
  expect_error(doc(R"("strata": {"strict": true, "budget": {}})"),
               {"strata.budget: unknown key", "did you mean \"budgets\""});
  expect_error(doc(R"("strata": {"strict": "yes"})"), {"strata.strict: expected a boolean"});
}

// --- "auto" ---------------------------------------------------------------------

TEST(Config, AutoResolvesAsTheHuggingFaceIntegrationDoesAndIsLogged) {
  LogCapture logs;
  const std::string json = R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                  "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "sub_group_size": "auto"}
  })";
  ParseOptions with_hidden;
  with_hidden.hidden_size = 1024;
  const Config c = parse_ok(json, with_hidden);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 1);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 1e-3);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.precision, Precision::kBf16);
  EXPECT_EQ(c.zero.reduce_bucket_size, 1024 * 1024);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 943718);  // int(0.9 * 1024^2)
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 10240);
  EXPECT_EQ(c.zero.sub_group_size, 1'000'000'000);
  EXPECT_TRUE(c.warnings.empty()) << all_warnings(c);
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"train_batch_size", "\"auto\" resolved to 1"}));
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"zero_optimization.reduce_bucket_size",
                                         "\"auto\" resolved to 1048576", "hidden_size 1024"}));
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"gradient_clipping", "\"auto\" resolved to 1"}));
  EXPECT_TRUE(logs.has(LogLevel::kInfo, {"bf16.enabled", "\"auto\" resolved to true"}));

  // Without a hidden size, DeepSpeed's defaults.
  const Config d = parse_ok(json);
  EXPECT_EQ(d.zero.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(d.zero.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(d.zero.stage3_param_persistence_threshold, 100'000);
}

TEST(Config, AutoBatchSizeIsMicroTimesAccumulation) {
  const Config c = parse_ok(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 8})");
  EXPECT_EQ(c.train_batch_size, 32);
  const Config only = parse_ok(R"({"train_batch_size": "auto"})");
  EXPECT_EQ(only.train_batch_size, 1);
  EXPECT_EQ(only.train_micro_batch_size_per_gpu, 1);
}

TEST(Config, AutoBf16StaysOffWhenFp16IsEnabled) {
  const Config c = parse_ok(doc(R"("fp16": {"enabled": true}, "bf16": {"enabled": "auto"})"));
  EXPECT_EQ(c.precision, Precision::kFp16);
}

TEST(Config, AutoWhereNothingResolvesItIsAnErrorNamingTheKey) {
  expect_error(doc(R"("aio": {"queue_depth": "auto"})"),
               {"aio.queue_depth: \"auto\" is not accepted here"});
  expect_error(doc(R"("zero_optimization": {"stage3_max_live_parameters": "auto"})"),
               {"zero_optimization.stage3_max_live_parameters: \"auto\" is not accepted here"});
  expect_error(doc(R"("zero_optimization": {"stage": "auto"})"),
               {"zero_optimization.stage: \"auto\" is not accepted here"});
  expect_error(doc(R"("strata": {"chunk_bytes": "auto"})"),
               {"strata.chunk_bytes: \"auto\" is not accepted here"});
}

TEST(Config, AutoTotalNumStepsNeedsTheCallersStepCount) {
  const std::string json = doc(R"("scheduler": {"type": "WarmupDecayLR",
      "params": {"warmup_max_lr": 1e-3, "total_num_steps": "auto"}})");
  expect_error(json, {"scheduler.params.total_num_steps: \"auto\" cannot be resolved",
                      "strata_config_options.total_num_steps in C, total_num_steps= in Python"});
  ParseOptions options;
  options.total_num_steps = 12345;
  EXPECT_EQ(parse_ok(json, options).scheduler.total_num_steps, 12345);
}

// --- to_json --------------------------------------------------------------------

void expect_round_trip(const Config& c) {
  const std::string json = to_json(c);
  ASSERT_FALSE(json.empty());
  const Config again = parse_ok(json);
  EXPECT_TRUE(again.warnings.empty()) << all_warnings(again) << json;
  Config expected = c;
  expected.warnings.clear();
  EXPECT_TRUE(again == expected) << json;
  // Field groups, to show which one differs when the above fails.
  EXPECT_EQ(again.train_batch_size, c.train_batch_size);
  EXPECT_EQ(again.train_micro_batch_size_per_gpu, c.train_micro_batch_size_per_gpu);
  EXPECT_EQ(again.gradient_accumulation_steps, c.gradient_accumulation_steps);
  EXPECT_EQ(again.gradient_clipping, c.gradient_clipping);
  EXPECT_EQ(again.precision, c.precision);
  EXPECT_TRUE(again.fp16 == c.fp16);
  EXPECT_TRUE(again.optimizer == c.optimizer);
  EXPECT_TRUE(again.scheduler == c.scheduler);
  EXPECT_TRUE(again.zero.offload_optimizer == c.zero.offload_optimizer);
  EXPECT_TRUE(again.zero.offload_param == c.zero.offload_param);
  EXPECT_TRUE(again.zero == c.zero);
  EXPECT_TRUE(again.aio == c.aio);
  EXPECT_TRUE(again.strata.io == c.strata.io);
  EXPECT_TRUE(again.strata.budgets == c.strata.budgets);
  EXPECT_TRUE(again.strata == c.strata);
  EXPECT_EQ(to_json(again), json);
}

TEST(Config, ToJsonRoundTripsFieldByField) {
  expect_round_trip(parse_ok(doc()));
  for (const std::string& file : {example("deepspeed_zero3_nvme.json"), example("deepspeed_zero_offload_cpu.json"),
                                 example("strata_default.json")}) {
    Result<Config> c = load_config_file(file);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    expect_round_trip(*c);
  }
  // Every field away from its default, old names and "auto" included.
  ParseOptions options;
  options.hidden_size = 4096;
  const Config busy = parse_ok(R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 16,
    "gradient_clipping": 0.7,
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.85, 0.97], "eps": 3e-7,
                  "weight_decay": 0.123456789012345, "adam_w_mode": false,
                  "bias_correction": false}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 777,
                  "warmup_min_ratio": 0.05, "cos_min_ratio": 0.002, "warmup_num_steps": 33,
                  "warmup_type": "linear"}},
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 20,
             "loss_scale_window": 250, "hysteresis": 3, "consecutive_hysteresis": true,
             "min_loss_scale": 0.25},
    "zero_optimization": {"stage": 3, "cpu_offload_param": true,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/opt", "pin_memory": true,
                              "buffer_count": 6, "fast_init": true, "ratio": 0.75},
        "sub_group_size": 2e8, "stage3_prefetch_bucket_size": "auto",
        "stage3_max_live_parameters": 3e8, "stage3_max_reuse_distance": 4e8,
        "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto",
        "allgather_bucket_size": 6e8, "overlap_comm": false, "contiguous_gradients": false,
        "stage3_gather_fp16_weights_on_model_save": true},
    "aio": {"block_size": 131072, "queue_depth": 16, "thread_count": 3, "single_submit": true,
            "overlap_events": false, "use_gds": true},
    "strata": {"seed": 99, "budgets": {"device": "10GiB", "pinned": "20GiB", "staging": "1GiB",
               "disk": "1TiB"}, "chunk_bytes": "8MiB", "optimizer_cpu_fraction": 0.4,
               "io": {"backend": "libaio", "paths": ["/mnt/opt", "/mnt/two"],
                      "stripe_bytes": "16MiB", "block_bytes": "256KiB", "rings": 4,
                      "sqpoll": true, "keep_files": true},
               "checkpoint": {"keep_last": 5, "keep_every": 250, "keep_base": true},
               "crc": false, "frozen_base": "swap", "cpu_adam": {"isa": "avx2", "threads": 7, "tile_elems": 131072, "bind": "numa",
                                          "numa_node": 3},
               "optimizer_state": {"format": "bf16", "rounding": "stochastic"},
               "overlap": "none", "device": "cuda",
               "host_device": {"memory_bytes": "1GiB", "h2d_gbps": 12.5, "d2h_gbps": 11,
                               "d2d_gbps": 900, "tflops": 0.5},
               "nonfinite": "error", "trace": "out.json", "strict": true}
  })",
                               options);
  EXPECT_EQ(busy.zero.stage3_prefetch_bucket_size, 15099494);  // int(0.9 * 4096^2)
  EXPECT_EQ(busy.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(busy.strata.io.queue_depth, 16);
  EXPECT_FALSE(busy.warnings.empty());
  // The re-parse keeps the warnings the values themselves warrant (non-default
  // values of keys without effect) and drops the ones of old names.
  const Config again = parse_ok(to_json(busy));
  Config expected = busy;
  expected.warnings.clear();
  Config got = again;
  got.warnings.clear();
  EXPECT_TRUE(got == expected) << to_json(busy);
  EXPECT_EQ(find_warning(again, "aio.thread_count"), nullptr);
  EXPECT_EQ(find_warning(again, "zero_optimization.cpu_offload_param"), nullptr);
  EXPECT_EQ(find_warning(again, "zero_optimization.stage3_gather_fp16_weights_on_model_save"),
            nullptr);
  EXPECT_NE(find_warning(again, "aio.intra_op_parallelism"), nullptr);
}

TEST(Config, ToJsonWritesCurrentNamesAndEveryKey) {
  Result<Config> c = load_config_file(example("deepspeed_zero3_nvme.json"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const std::string json = to_json(*c);
  for (const char* key :
       {"\"intra_op_parallelism\"", "\"stage3_gather_16bit_weights_on_model_save\"",
        "\"adam_w_mode\"", "\"overlap_comm\"", "\"strata\"", "\"block_bytes\"", "\"host_device\"",
        "\"total_num_steps\"", "\"sub_group_size\"", "\"keep_last\"", "\"keep_every\"", "\"keep_base\""}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << "\n" << json;
  }
  EXPECT_EQ(json.find("thread_count"), std::string::npos) << json;
  EXPECT_EQ(json.find("fp16_weights"), std::string::npos) << json;
}

// --- JSON syntax and files ----------------------------------------------------------

TEST(Config, SyntaxErrorsGiveTheLineAndColumn) {
  expect_error("{\n  \"train_batch_size\": 8,\n  \"aio\": {\"queue_depth\": }\n}",
               {"invalid JSON", "line 3"});
  expect_error("{\"train_batch_size\": 8,}", {"invalid JSON", "line 1"});
  expect_error("", {"invalid JSON"});
  expect_error("[1, 2]", {"expected a JSON object at the top level"});
}

TEST(Config, DuplicateKeysAreErrorsAsInDeepSpeed) {
  expect_error(R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}})",
               {"zero_optimization.stage: duplicate key"});
  expect_error(R"({"train_batch_size": 8, "train_batch_size": 8})",
               {"train_batch_size: duplicate key"});
}

// Flat documents cost time linear in their size: 600,000 objects in an array
// (nlohmann's callback parser scanned the parent at each object's end:
// quadratic) and 200,000 keys in one object (the duplicate check compared
// each key with the object's others: quadratic). Without the fixes this test
// runs for hours.
TEST(Config, LargeFlatDocumentsParseInLinearTime) {
  std::string objects = "[";
  for (int i = 0; i < 600000; ++i) objects += i == 0 ? "{}" : ",{}";
  objects += "]";
  EXPECT_TRUE(parse_config(doc(R"("wandb": )" + objects)).ok());
  std::string keys = "{";
  for (int i = 0; i < 200000; ++i) keys += (i == 0 ? "\"k" : ",\"k") + std::to_string(i) + "\": 0";
  EXPECT_TRUE(parse_config(doc(R"("wandb": )" + keys + "}")).ok());
  expect_error(doc(R"("wandb": )" + keys + R"(, "k7": 1})"), {"wandb.k7: duplicate key"});
}

// A document nested deeper than any configuration needs is refused while it
// is parsed: 100,000 levels (which once crashed the error message's preview)
// and a deep value under a known key, and nesting just within the limit parses.
TEST(Config, DeepNestingIsRefusedWithAClearError) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_error(deep, {"invalid JSON", "nested deeper than 64 levels"});
  expect_error(doc(R"("wandb": )" + std::string(70, '[') + std::string(70, ']')), {"nested deeper than 64"});
  std::string objects;
  for (int i = 0; i < 70; ++i) objects += "{\"a\": ";
  objects += "1" + std::string(70, '}');
  expect_error(doc(R"("wandb": )" + objects), {"nested deeper than 64"});
  // 63 levels below the top-level object: within the limit (an unknown
  // section's content is not checked).
  const Config c = parse_ok(doc(R"("wandb": )" + std::string(63, '[') + std::string(63, ']')));
  EXPECT_EQ(c.train_batch_size, 8);
}

TEST(Config, EqualKeysInSiblingObjectsAreNotDuplicates) {
  const Config c = parse_ok(doc(R"("wandb": {"runs": [{"name": "a"}, {"name": "b"}]},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
      "zero_optimization": {"offload_optimizer": {"device": "none"},
                            "offload_param": {"device": "none"}})"));
  EXPECT_EQ(c.optimizer.lr, 0.1);
  expect_error(R"({"train_batch_size": 8, "wandb": {"runs": [{"name": "a", "name": "b"}]}})",
               {"duplicate key"});
}

TEST(Config, CommentsAreAllowedAsInDeepSpeedsHjsonLoader) {
  const Config c = parse_ok(
      "{\n  // batch\n  \"train_batch_size\": 4, /* block */ \"bf16\": "
      "{\"enabled\": true}\n}");
  EXPECT_EQ(c.train_batch_size, 4);
  EXPECT_EQ(c.precision, Precision::kBf16);
}

TEST(Config, LoadConfigFileErrorsNameTheFile) {
  Result<Config> missing = load_config_file("/nonexistent/strata_config.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/strata_config.json"), std::string::npos);

  Result<Config> dir = load_config_file("/tmp");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("'/tmp'"), std::string::npos) << dir.status().to_string();

  char path[] = "/tmp/strata_config_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string bad = R"({"train_batch_size": 8, "aio": {"queue_depth": 0}})";
  ASSERT_EQ(write(fd, bad.data(), bad.size()), static_cast<ssize_t>(bad.size()));
  close(fd);
  Result<Config> invalid = load_config_file(path);
  unlink(path);
  ASSERT_FALSE(invalid.ok());
  EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(invalid.status().message().find(path), std::string::npos);
  EXPECT_NE(invalid.status().message().find("aio.queue_depth: 0 must be >= 1"), std::string::npos)
      << invalid.status().to_string();
}

TEST(Config, InvalidParseOptionsAreErrors) {
  ParseOptions options;
  options.hidden_size = -1;
  expect_error(doc(), {"ParseOptions.hidden_size: -1"}, options);
}

// --- logging and names ------------------------------------------------------------

// Logged at warn level once per process (a program reads its config more
// than once: checked early, then by the engine); every parse still returns
// them. The keys are this test's own: other tests' lines are logged already.
TEST(Config, WarningsAreLoggedAtWarnLevelOncePerProcess) {
  LogCapture logs;
  const std::string json = doc(R"("bogus_logged_once": true, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "buffer_count_logged_once": 2}})");
  for (int i = 0; i < 3; ++i) {
    const Config c = parse_ok(json);
    EXPECT_EQ(c.warnings.size(), 2u) << all_warnings(c);
  }
  EXPECT_EQ(logs.count(LogLevel::kWarn, {"bogus_logged_once", "unknown key"}), 1);
  EXPECT_EQ(logs.count(LogLevel::kWarn, {"buffer_count_logged_once", "unknown key"}), 1);
}

TEST(Config, ToStringGivesTheConfigSpelling) {
  EXPECT_EQ(to_string(OffloadDevice::kNvme), "nvme");
  EXPECT_EQ(to_string(OptimizerType::kAdamW), "AdamW");
  EXPECT_EQ(to_string(SchedulerType::kWarmupCosineLR), "WarmupCosineLR");
  EXPECT_EQ(to_string(SchedulerType::kNone), "none");
  EXPECT_EQ(to_string(WarmupType::kLinear), "linear");
  EXPECT_EQ(to_string(Precision::kBf16), "bf16");
  EXPECT_EQ(to_string(IoBackend::kIoUring), "io_uring");
  EXPECT_EQ(to_string(CpuAdamIsa::kAvx512), "avx512");
  EXPECT_EQ(to_string(CpuAdamIsa::kAvx512Bf16), "avx512_bf16");
  EXPECT_EQ(to_string(CpuAdamBind::kAuto), "auto");
  EXPECT_EQ(to_string(CpuAdamBind::kNuma), "numa");
  EXPECT_EQ(to_string(CpuAdamBind::kCores), "cores");
  EXPECT_EQ(to_string(CpuAdamBind::kNone), "none");
  EXPECT_EQ(to_string(OverlapMode::kDelayed), "delayed");
  EXPECT_EQ(to_string(DeviceKind::kHost), "host");
  EXPECT_EQ(to_string(NonfinitePolicy::kSkip), "skip");
  EXPECT_EQ(to_string(NonfinitePolicy::kApply), "apply");
}

}  // namespace
}  // namespace strata::engine
