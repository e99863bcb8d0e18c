// The spellings the config reader and writer share: the JSON names of
// engine/config.h's enums and DeepSpeed's default nvme_path. Private to
// engine/config*.
#pragma once

#include <string_view>

#include "engine/config.h"
#include "engine/config/json_reader.h"

namespace strata::engine::config_internal {

inline constexpr std::string_view kDefaultNvmePath = "/local_nvme";

// The JSON spelling of each value; the order is the one messages list.
inline constexpr EnumName<OffloadDevice> kOffloadDeviceNames[] = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}};
inline constexpr EnumName<OptimizerType> kOptimizerNames[] = {{"Adam", OptimizerType::kAdam},
                                                              {"AdamW", OptimizerType::kAdamW},
                                                              {"Adagrad", OptimizerType::kAdagrad},
                                                              {"Lion", OptimizerType::kLion}};
// The optimizers the engine implements: the only ones the config check accepts
// (today every one named above; Lion and Adagrad with the state on the CPU).
inline constexpr EnumName<OptimizerType> kSupportedOptimizerNames[] = {{"Adam", OptimizerType::kAdam},
                                                                       {"AdamW", OptimizerType::kAdamW},
                                                                       {"Adagrad", OptimizerType::kAdagrad},
                                                                       {"Lion", OptimizerType::kLion}};
// The first entry is for to_string only: "scheduler.type" has no "none".
inline constexpr EnumName<SchedulerType> kSchedulerNames[] = {
    {"none", SchedulerType::kNone},
    {"WarmupLR", SchedulerType::kWarmupLR},
    {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
    {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}};
inline constexpr EnumName<WarmupType> kWarmupTypeNames[] = {{"log", WarmupType::kLog},
                                                            {"linear", WarmupType::kLinear}};
inline constexpr EnumName<Precision> kPrecisionNames[] = {
    {"fp32", Precision::kFp32}, {"bf16", Precision::kBf16}, {"fp16", Precision::kFp16}};
inline constexpr EnumName<IoBackend> kIoBackendNames[] = {{"auto", IoBackend::kAuto},
                                                          {"io_uring", IoBackend::kIoUring},
                                                          {"libaio", IoBackend::kLibaio},
                                                          {"psync", IoBackend::kPsync}};
inline constexpr EnumName<CpuAdamIsa> kCpuAdamIsaNames[] = {
    {"auto", CpuAdamIsa::kAuto},     {"avx512_bf16", CpuAdamIsa::kAvx512Bf16},
    {"avx512", CpuAdamIsa::kAvx512}, {"avx2", CpuAdamIsa::kAvx2},
    {"scalar", CpuAdamIsa::kScalar}};
inline constexpr EnumName<CpuAdamBind> kCpuAdamBindNames[] = {{"auto", CpuAdamBind::kAuto},
                                                             {"numa", CpuAdamBind::kNuma},
                                                             {"cores", CpuAdamBind::kCores},
                                                             {"none", CpuAdamBind::kNone}};
inline constexpr EnumName<OverlapMode> kOverlapNames[] = {
    {"exact", OverlapMode::kExact},
    {"delayed", OverlapMode::kDelayed},
    {"speculative", OverlapMode::kSpeculative},
    {"none", OverlapMode::kNone}};
inline constexpr EnumName<DeviceKind> kDeviceNames[] = {
    {"auto", DeviceKind::kAuto}, {"cuda", DeviceKind::kCuda}, {"host", DeviceKind::kHost}};
inline constexpr EnumName<NonfinitePolicy> kNonfiniteNames[] = {{"skip", NonfinitePolicy::kSkip},
                                                                {"error", NonfinitePolicy::kError},
                                                                {"apply", NonfinitePolicy::kApply}};
inline constexpr EnumName<StateFormat> kStateFormatNames[] = {
    {"fp32", StateFormat::kFp32}, {"bf16", StateFormat::kBf16}, {"int8_blockwise", StateFormat::kInt8Blockwise}};
inline constexpr EnumName<StateRounding> kStateRoundingNames[] = {{"nearest_even", StateRounding::kNearestEven},
                                                                  {"stochastic", StateRounding::kStochastic}};
inline constexpr EnumName<FrozenBase> kFrozenBaseNames[] = {
    {"auto", FrozenBase::kAuto}, {"swap", FrozenBase::kSwap}, {"files", FrozenBase::kFiles}};
inline constexpr EnumName<NoGradPolicy> kNoGradNames[] = {{"skip", NoGradPolicy::kSkip}, {"zero", NoGradPolicy::kZero}};
inline constexpr EnumName<DeviceCollectives> kDeviceCollectivesNames[] = {
    {"auto", DeviceCollectives::kAuto}, {"on", DeviceCollectives::kOn}, {"off", DeviceCollectives::kOff}};

}  // namespace strata::engine::config_internal
