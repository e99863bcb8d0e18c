// strata-train: trains the example model (examples/model: a residual MLP
// student on a teacher-student regression task) through strata's C API, as
// an embedding framework would, and reports each step: loss, samples/s and
// the bytes the engine moved per tier. The README's main command runs it.
//
// Micro-batches per step come from the config (gradient_accumulation_steps);
// samples per micro-batch from --batch (the config's
// train_micro_batch_size_per_gpu counts the planner's sequences).
//
//   strata-train [--config FILE] [--steps N] [--width H] [--depth L] [--batch B]
//                [--freeze-base] [--checkpoint DIR] [--save-every K] [--resume]
//                [--export DIR] [--init-from DIR] [--dump-masters FILE]
//                [--model-device host|cuda|auto] [--quiet]
//
// The flags are parsed strictly (train_cli.h: CLI11; --help lists them); the
// default config is found from any directory; --checkpoint (when saving) and
// --export are created and checked for space before training. Exit status: 0
// done, 1 a run-time error (I/O, data loss, internal; a save or export that
// fails), 2 bad input (flags; the library's input errors while the engine is
// set up; a budget exceeded), 128 + signal when stopped (fail, below).
//
// Signals (stop_signal.h; the library installs no handler, this program
// does): the first SIGINT or SIGTERM lets the step in flight finish, starts
// no checkpoint (one being saved completes: it becomes `latest` only by an
// atomic rename), skips the export, destroys the engine (swap files removed
// unless strata.io.keep_files), prints "interrupted by SIGINT at step N" and
// exits 130 / 143. A second signal exits at once (_exit(128 + signal)); the
// next run in that swap directory reclaims the files left.
//
// --init-from DIR fine-tunes from a previous run's --export DIR: every
// parameter takes its initial values from DIR's safetensors files
// (strata_init_from_safetensors) instead of the model's initializer.
//
// Where the model computes (--model-device, default auto):
//  - host: on the CPU (OpenBLAS). It reads its weights with
//    strata_group_fetch_host and hands gradients back with
//    strata_group_grads_host, whatever the engine's device.
//  - cuda: on the engine's CUDA device (cuBLAS, CudaModelRunner), straight on
//    the views of strata_group_fetch and strata_group_grad_buffer, with the
//    runner's stream as the C API's stream argument. Needs the engine on CUDA
//    (strata.device "cuda", or "auto" with a GPU) and the CUDA runner in the
//    build.
//  - auto: cuda when the engine's device is CUDA and the CUDA runner is built
//    (else host, saying why), host otherwise.
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "examples/model/cuda_model_runner.h"
#include "examples/model/model_runner.h"
#include "examples/model/precision.h"
#include "examples/model/residual_mlp.h"
#include "examples/train/stop_signal.h"
#include "examples/train/train_cli.h"
#include "strata/strata.h"

namespace {

using strata::examples::Batch;
using strata::examples::ComputeType;
using strata::examples::CudaGrads;
using strata::examples::CudaModelRunner;
using strata::examples::CudaWeights;
using strata::examples::GroupLayout;
using strata::examples::ModelRunner;
using strata::examples::ModelSpec;
using strata::examples::ResidualMlp;

using strata::examples::train::human_bytes;
using strata::examples::train::ModelDevice;
using strata::examples::train::Options;
using strata::examples::train::OutputNeed;

// Prints the library's error. While the engine is set up (create,
// registration, initial values, finalize, a checkpoint's load) the errors
// that come from the input (the config, the budgets it sets, the paths and
// files named) exit 2, as train_llama.py's do; during training a budget
// exceeded (RESOURCE_EXHAUSTED: the swap files are made at full size, so it
// is a budget, not a full disk) or a bad argument exits 2, the rest (I/O,
// data loss, a swap file gone, internal) are faults: exit 1.
int fail(const char* what, strata_status s, bool setup) {
  std::fprintf(stderr, "strata-train: %s: %s (%s)\n", what, strata_last_error(), strata_status_name(s));
  switch (s) {
    case STRATA_STATUS_INVALID_ARGUMENT:
    case STRATA_STATUS_RESOURCE_EXHAUSTED:
      return 2;
    case STRATA_STATUS_NOT_FOUND:
    case STRATA_STATUS_ALREADY_EXISTS:
    case STRATA_STATUS_PERMISSION_DENIED:
    case STRATA_STATUS_FAILED_PRECONDITION:
    case STRATA_STATUS_OUT_OF_RANGE:
    case STRATA_STATUS_UNIMPLEMENTED:
      return setup ? 2 : 1;
    default:
      return 1;
  }
}

#define CHECK_STRATA(call, what)                                 \
  do {                                                           \
    const strata_status s_ = (call);                             \
    if (s_ != STRATA_STATUS_OK) return fail((what), s_, false);  \
  } while (0)

// The calls that set the engine up: their input errors exit 2.
#define CHECK_SETUP(call, what)                                 \
  do {                                                          \
    const strata_status s_ = (call);                            \
    if (s_ != STRATA_STATUS_OK) return fail((what), s_, true);  \
  } while (0)

// A top-level integer of the resolved config (every key is present there):
// gradient_accumulation_steps, train_micro_batch_size_per_gpu.
long resolved_int(const char* json, const char* key) {
  char* resolved = nullptr;
  if (strata_config_resolve(json, &resolved) != STRATA_STATUS_OK) return 1;
  long v = 1;
  const std::string quoted = std::string("\"") + key + "\"";
  if (const char* p = std::strstr(resolved, quoted.c_str())) {
    p = std::strchr(p, ':');
    if (p != nullptr) v = std::strtol(p + 1, nullptr, 10);
  }
  strata_string_free(resolved);
  return v > 0 ? v : 1;
}

struct InitContext {
  const ResidualMlp* model;
};

strata_status init_param(const char* name, float* out, int64_t numel, void* user_data) {
  const auto* ctx = static_cast<const InitContext*>(user_data);
  const auto& params = ctx->model->params();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) {
      const auto st = ctx->model->init_param(static_cast<int>(i), {out, static_cast<std::size_t>(numel)});
      return st.ok() ? STRATA_STATUS_OK : static_cast<strata_status>(st.code());
    }
  }
  return STRATA_STATUS_NOT_FOUND;
}

// What the run writes besides its swap files: one checkpoint (when saving:
// up to 4 bytes per parameter for the compute copy plus 12 per trainable one
// for the fp32 master and Adam's two moments, docs/checkpoints.md), the
// export (2 bytes per parameter, bf16) and the masters' dump (4 bytes per
// trainable parameter).
std::vector<OutputNeed> output_needs(const Options& o, std::int64_t all_params, std::int64_t trainable_params) {
  std::vector<OutputNeed> out;
  const auto all = static_cast<std::uint64_t>(all_params);
  const auto trainable = static_cast<std::uint64_t>(trainable_params);
  if (o.save_every > 0) {
    out.push_back({"--checkpoint", o.checkpoint, 4 * all + 12 * trainable,
                   "one checkpoint of " + std::to_string(all_params) + " parameters (" +
                       std::to_string(trainable_params) + " trainable; 4 bytes each, plus 12 per trainable one)"});
  }
  if (!o.export_dir.empty()) {
    out.push_back({"--export", o.export_dir, 2 * all,
                   "the export of " + std::to_string(all_params) + " parameters (2 bytes each, bf16)"});
  }
  if (!o.dump_masters.empty()) {
    const std::filesystem::path file(o.dump_masters);
    out.push_back({"--dump-masters", file.has_parent_path() ? file.parent_path().string() : std::string("."),
                   4 * trainable,
                   "the masters of " + std::to_string(trainable_params) + " trainable parameters (4 bytes each)"});
  }
  return out;
}

// Checks --checkpoint (when saving), --export and --dump-masters before the
// engine is built: folders created if missing and writable, each output's
// room on its own (an output no disk holds is refused before the model is
// built; together with the swap files, after finalize: check_output_space).
// Returns 0 or the exit status.
int check_outputs(const Options& o, const std::vector<OutputNeed>& needs) {
  std::string error;
  for (const OutputNeed& out : needs) {
    // --dump-masters names a file, whose folder must exist.
    error = out.flag == std::string("--dump-masters")
                ? strata::examples::train::check_output_file(out.flag, o.dump_masters)
                : strata::examples::train::check_output_dir(out.flag, out.dir);
    if (error.empty()) error = strata::examples::train::check_output_space({out}, {});
    if (!error.empty()) break;
  }
  if (error.empty()) return 0;
  std::fprintf(stderr, "strata-train: %s\n", error.c_str());
  return 2;
}

// After finalize, when the swap files hold their room: the outputs on each
// file system fit together. Returns 0 or the exit status.
int check_output_space(strata_engine* engine, const std::vector<OutputNeed>& needs) {
  std::vector<std::string> swap_paths;
  uint32_t n = 0;
  if (strata_swap_path_count(engine, &n) == STRATA_STATUS_OK) {
    for (uint32_t i = 0; i < n; ++i) {
      strata_swap_stats s = STRATA_SWAP_STATS_INIT;
      if (strata_swap_stats_get(engine, i, &s) == STRATA_STATUS_OK) swap_paths.emplace_back(s.path);
    }
  }
  const std::string error = strata::examples::train::check_output_space(needs, swap_paths);
  if (error.empty()) return 0;
  std::fprintf(stderr, "strata-train: %s\n", error.c_str());
  return 2;
}

int run(const Options& o) {
  std::ifstream in(o.config);
  if (!in) {
    std::fprintf(stderr, "strata-train: --config %s: cannot read it: %s\n", o.config.c_str(),
                 std::strerror(errno));
    return 2;
  }
  std::stringstream text;
  text << in.rdbuf();
  if (o.config_is_default) {
    // The default config swaps to ./strata_swap; made here as scripts/run.sh makes it.
    std::printf("strata-train: config %s\n", o.config.c_str());
    if (::mkdir("strata_swap", 0755) != 0 && errno != EEXIST) {
      std::fprintf(stderr,
                   "strata-train: cannot create the default config's swap directory ./strata_swap: %s\n",
                   std::strerror(errno));
      return 1;
    }
  }
  const std::string json = text.str();
  const long gas = resolved_int(json.c_str(), "gradient_accumulation_steps");
  const ModelSpec spec = o.spec;

  auto model_or = ResidualMlp::create(spec);
  if (!model_or.ok()) {
    std::fprintf(stderr, "strata-train: %s\n", model_or.status().to_string().c_str());
    return 2;
  }
  const ResidualMlp& model = *model_or;
  // The base (embedding and the first half of the blocks) is frozen when fine-tuning.
  const int groups = model.num_groups();
  auto frozen_group = [&](int g) { return o.freeze_base && g <= groups / 2 - 1; };
  std::vector<OutputNeed> needs;
  {
    std::int64_t all = 0, trainable = 0;
    for (const auto& p : model.params()) {
      all += p.num_elems;
      if (!frozen_group(p.group_index)) trainable += p.num_elems;
    }
    needs = output_needs(o, all, trainable);
    if (const int rc = check_outputs(o, needs); rc != 0) return rc;
  }

  strata_engine* engine = nullptr;
  CHECK_SETUP(strata_engine_create(json.c_str(), &engine), "create the engine");
  struct Destroy {
    strata_engine* e;
    ~Destroy() { strata_engine_destroy(e); }
  } destroy{engine};

  strata_optimizer_group_desc no_decay = STRATA_OPTIMIZER_GROUP_DESC_INIT;
  no_decay.name = "no_decay";
  no_decay.weight_decay = 0.0;
  int32_t no_decay_index = 0;
  CHECK_SETUP(strata_optimizer_group_add(engine, &no_decay, &no_decay_index), "add an optimizer group");

  InitContext ctx{&model};
  std::int64_t trainable_params = 0, all_params = 0;
  for (const auto& p : model.params()) {
    strata_param_desc d = STRATA_PARAM_DESC_INIT;
    d.name = p.name.c_str();
    d.shape = p.shape.data();
    d.ndim = static_cast<int32_t>(p.shape.size());
    d.group = model.groups()[static_cast<std::size_t>(p.group_index)].name.c_str();
    d.frozen = frozen_group(p.group_index) ? 1 : 0;
    d.optimizer_group = p.no_decay ? no_decay_index : 0;
    // With --init-from, no callback: the values come from the files.
    CHECK_SETUP(strata_param_register(engine, &d, o.init_from.empty() ? init_param : nullptr, &ctx),
                 "register a parameter");
    all_params += p.num_elems;
    if (!d.frozen) trainable_params += p.num_elems;
  }
  if (!o.init_from.empty()) {
    CHECK_SETUP(strata_init_from_safetensors(engine, o.init_from.c_str(), nullptr), "read the initial values");
    std::printf("strata-train: initial values from %s\n", o.init_from.c_str());
  }
  const auto t_finalize = std::chrono::steady_clock::now();
  // With --resume, the checkpoint's values are loaded as the engine is built
  // (the initial values they replace are not computed or written).
  if (o.resume) {
    CHECK_SETUP(strata_engine_finalize_from_checkpoint(engine, o.checkpoint.c_str()),
                "finalize from the checkpoint");
  } else {
    CHECK_SETUP(strata_engine_finalize(engine), "finalize");
  }
  const double finalize_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_finalize).count();
  if (const int rc = check_output_space(engine, needs); rc != 0) return rc;

  // Each group's layout, as the engine placed it.
  std::vector<GroupLayout> layouts(static_cast<std::size_t>(groups));
  std::vector<strata_group_info> infos(static_cast<std::size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    const auto& gd = model.groups()[static_cast<std::size_t>(g)];
    strata_group_info& info = infos[static_cast<std::size_t>(g)];
    info = STRATA_GROUP_INFO_INIT;
    CHECK_STRATA(strata_group_info_get(engine, gd.name.c_str(), &info), "group info");
    const std::int64_t esize = info.dtype == STRATA_DTYPE_F32 ? 4 : 2;
    layouts[static_cast<std::size_t>(g)].size_elems = static_cast<std::int64_t>(info.size_bytes) / esize;
    for (int pi : gd.param_indices) {
      int64_t off = 0;
      CHECK_STRATA(strata_param_offset(engine, model.params()[static_cast<std::size_t>(pi)].name.c_str(), &off, nullptr),
                   "parameter offset");
      layouts[static_cast<std::size_t>(g)].offset_elems.push_back(off);
    }
  }
  // The runner: on the engine's CUDA device, or on the host.
  const bool engine_on_cuda = infos[0].device == STRATA_DEVICE_CUDA;
  if (o.model_device == ModelDevice::kCuda && !engine_on_cuda) {
    std::fprintf(stderr,
                 "strata-train: --model-device cuda needs the engine on a CUDA device (strata.device \"cuda\", "
                 "or \"auto\" on a machine with a GPU); this engine's device is the host\n");
    return 2;
  }
  std::optional<CudaModelRunner> cuda_runner;
  if (engine_on_cuda && o.model_device != ModelDevice::kHost) {
    auto created = CudaModelRunner::create(model, layouts);
    if (created.ok()) {
      cuda_runner.emplace(std::move(created).value());
      std::printf("strata-train: the model computes on the engine's CUDA device (cuBLAS)\n");
    } else if (o.model_device == ModelDevice::kAuto &&
               created.status().code() == strata::core::StatusCode::kUnimplemented) {
      std::printf("strata-train: the engine is on CUDA but the model computes on the host (OpenBLAS): %s\n",
                  std::string(created.status().message()).c_str());
    } else {
      std::fprintf(stderr, "strata-train: %s\n", created.status().to_string().c_str());
      return 1;
    }
  } else if (engine_on_cuda) {
    std::printf("strata-train: the engine is on CUDA; the model computes on the host (OpenBLAS, --model-device host)\n");
  }
  std::optional<ModelRunner> host_runner;
  if (!cuda_runner) {
    auto runner_or = ModelRunner::create(model, layouts);
    if (!runner_or.ok()) {
      std::fprintf(stderr, "strata-train: %s\n", runner_or.status().to_string().c_str());
      return 1;
    }
    host_runner.emplace(std::move(runner_or).value());
  }
  auto compute_type = [](strata_dtype d) {
    return d == STRATA_DTYPE_F32 ? ComputeType::kF32 : d == STRATA_DTYPE_BF16 ? ComputeType::kBf16 : ComputeType::kF16;
  };
  auto weights_of = [&](const strata_group_view& v) {
    const ComputeType t = compute_type(v.dtype);
    return CudaWeights{.data = v.data,
                       .size_elems = static_cast<std::int64_t>(v.size_bytes / strata::examples::compute_type_bytes(t)),
                       .type = t};
  };
  auto grads_of = [&](const strata_group_view& v) {
    const ComputeType t = compute_type(v.dtype);
    return CudaGrads{.data = v.data,
                     .size_elems = static_cast<std::int64_t>(v.size_bytes / strata::examples::compute_type_bytes(t)),
                     .type = t};
  };

  int first_step = 0;
  if (o.resume) {
    const void* blob = nullptr;
    size_t blob_size = 0;
    CHECK_STRATA(strata_checkpoint_blob(engine, &blob, &blob_size), "read the checkpoint's blob");
    first_step = std::atoi(std::string(static_cast<const char*>(blob), blob_size).c_str());
    std::printf("resumed from %s at step %d\n", o.checkpoint.c_str(), first_step);
    if (o.steps < first_step) {
      std::fprintf(
          stderr,
          "strata-train: --steps %d is below the checkpoint's step %d: --steps is the step the run ends "
          "at, counted from its start; give --steps %d or more\n",
          o.steps, first_step, first_step);
      return 2;
    }
  }

  std::printf("strata-train: %lld parameters (%lld trainable) in %d groups, %ld micro-batch(es) of %lld per step; "
              "finalize %.2f s\n",
              static_cast<long long>(all_params), static_cast<long long>(trainable_params), groups, gas,
              static_cast<long long>(spec.batch), finalize_s);
  if (!o.quiet) {
    std::printf("%5s %12s %10s %10s %10s %10s %10s %9s\n", "step", "loss", "samples/s", "h2d", "d2h", "nvme rd",
                "nvme wr", "lr");
  }
  std::fflush(stdout);

  std::vector<std::uint16_t> half;
  std::vector<float> weights, grads;
  auto to_f32 = [&](const strata_group_info& info, const std::vector<unsigned char>& raw, std::vector<float>& out) {
    const std::size_t n = info.dtype == STRATA_DTYPE_F32 ? raw.size() / 4 : raw.size() / 2;
    out.resize(n);
    if (info.dtype == STRATA_DTYPE_F32) {
      std::memcpy(out.data(), raw.data(), raw.size());
      return;
    }
    half.resize(n);
    std::memcpy(half.data(), raw.data(), raw.size());
    (info.dtype == STRATA_DTYPE_BF16 ? strata::examples::bf16_to_fp32(half, out)
                                     : strata::examples::fp16_to_fp32(half, out))
        .ignore_error();  // sizes match by construction
  };
  std::vector<unsigned char> raw;
  double first_loss = 0.0, last_loss = 0.0, samples_per_s_sum = 0.0;
  strata_step_stats last = STRATA_STEP_STATS_INIT;
  // The swap paths' writes and reads, summed over the steps run (the SSD wear figures).
  uint32_t swap_path_count = 0;
  CHECK_STRATA(strata_swap_path_count(engine, &swap_path_count), "count the swap paths");
  std::vector<std::uint64_t> swap_written(swap_path_count, 0), swap_read(swap_path_count, 0);
  std::uint64_t nvme_written = 0;
  const auto t_train = std::chrono::steady_clock::now();
  int done = first_step;  // the last step completed
  for (int step = first_step; step < o.steps && strata::examples::train::stop_signal() == 0; ++step) {
    const auto t_step = std::chrono::steady_clock::now();
    double step_loss = 0.0;
    for (long micro = 0; micro < gas; ++micro) {
      double scale = 1.0;
      CHECK_STRATA(strata_loss_scale(engine, &scale), "loss scale");
      const Batch batch = model.make_batch(step * gas + micro);
      if (cuda_runner) {
        // On the device: the runner reads the fetched views and writes the
        // engine's gradient buffers on its stream, and waits for that stream
        // before it returns, so each group is released right after its call.
        void* stream = cuda_runner->native_stream();
        if (const auto st = cuda_runner->begin(batch, static_cast<float>(scale)); !st.ok()) {
          std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
          return 1;
        }
        for (int g = 0; g < groups; ++g) {
          const char* name = model.groups()[static_cast<std::size_t>(g)].name.c_str();
          strata_group_view view = STRATA_GROUP_VIEW_INIT;
          CHECK_STRATA(strata_group_fetch(engine, name, stream, &view), "fetch for forward");
          if (const auto st = cuda_runner->forward_group(g, weights_of(view)); !st.ok()) {
            std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
            return 1;
          }
          CHECK_STRATA(strata_group_release(engine, name), "release");
        }
        step_loss += cuda_runner->loss() / static_cast<double>(gas);
        for (int g = groups - 1; g >= 0; --g) {
          const char* name = model.groups()[static_cast<std::size_t>(g)].name.c_str();
          const bool trainable = infos[static_cast<std::size_t>(g)].trainable != 0;
          strata_group_view view = STRATA_GROUP_VIEW_INIT;
          CHECK_STRATA(strata_group_fetch(engine, name, stream, &view), "fetch for backward");
          strata_group_view grad_view = STRATA_GROUP_VIEW_INIT;
          if (trainable) CHECK_STRATA(strata_group_grad_buffer(engine, name, &grad_view), "gradient buffer");
          if (const auto st = cuda_runner->backward_group(g, weights_of(view), trainable ? grads_of(grad_view) : CudaGrads{});
              !st.ok()) {
            std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
            return 1;
          }
          if (trainable) CHECK_STRATA(strata_group_grads_ready(engine, name, stream), "hand back gradients");
          CHECK_STRATA(strata_group_release(engine, name), "release");
        }
        if (micro + 1 < gas) CHECK_STRATA(strata_micro_step_end(engine), "end a micro-batch");
        continue;
      }
      ModelRunner& runner = *host_runner;
      if (const auto st = runner.begin(batch, static_cast<float>(scale)); !st.ok()) {
        std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
        return 1;
      }
      for (int g = 0; g < groups; ++g) {
        const auto& info = infos[static_cast<std::size_t>(g)];
        const char* name = model.groups()[static_cast<std::size_t>(g)].name.c_str();
        raw.resize(info.size_bytes);
        CHECK_STRATA(strata_group_fetch_host(engine, name, raw.data(), raw.size()), "fetch for forward");
        to_f32(info, raw, weights);
        CHECK_STRATA(strata_group_release(engine, name), "release");
        if (const auto st = runner.forward_group(g, weights); !st.ok()) {
          std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
          return 1;
        }
      }
      step_loss += runner.loss() / static_cast<double>(gas);
      for (int g = groups - 1; g >= 0; --g) {
        const auto& info = infos[static_cast<std::size_t>(g)];
        const char* name = model.groups()[static_cast<std::size_t>(g)].name.c_str();
        raw.resize(info.size_bytes);
        CHECK_STRATA(strata_group_fetch_host(engine, name, raw.data(), raw.size()), "fetch for backward");
        to_f32(info, raw, weights);
        const bool trainable = info.trainable != 0;
        grads.assign(weights.size(), 0.0f);
        if (const auto st = runner.backward_group(g, weights, trainable ? std::span<float>(grads) : std::span<float>());
            !st.ok()) {
          std::fprintf(stderr, "strata-train: %s\n", st.to_string().c_str());
          return 1;
        }
        if (trainable) {
          if (info.dtype == STRATA_DTYPE_F32) {
            std::memcpy(raw.data(), grads.data(), raw.size());
          } else {
            half.resize(grads.size());
            (info.dtype == STRATA_DTYPE_BF16 ? strata::examples::fp32_to_bf16(grads, half)
                                             : strata::examples::fp32_to_fp16(grads, half))
                .ignore_error();
            std::memcpy(raw.data(), half.data(), raw.size());
          }
          CHECK_STRATA(strata_group_grads_host(engine, name, raw.data(), raw.size()), "hand back gradients");
        }
        CHECK_STRATA(strata_group_release(engine, name), "release");
      }
      if (micro + 1 < gas) CHECK_STRATA(strata_micro_step_end(engine), "end a micro-batch");
    }
    strata_step_stats stats = STRATA_STEP_STATS_INIT;
    CHECK_STRATA(strata_step_end(engine, &stats), "step_end");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
    const double sps = static_cast<double>(spec.batch * gas) / secs;
    if (step == first_step) first_loss = step_loss;
    last_loss = step_loss;
    samples_per_s_sum += sps;
    last = stats;
    nvme_written += stats.bytes_nvme_write;
    for (uint32_t i = 0; i < swap_path_count; ++i) {
      strata_swap_stats swap = STRATA_SWAP_STATS_INIT;
      CHECK_STRATA(strata_swap_stats_get(engine, i, &swap), "read a swap path's traffic");
      swap_written[i] += swap.bytes_written;
      swap_read[i] += swap.bytes_read;
    }
    done = step + 1;
    if (!o.quiet) {
      std::printf("%5d %12.6f %10.1f %10s %10s %10s %10s %9.2e%s\n", step + 1, step_loss, sps,
                  human_bytes(static_cast<double>(stats.bytes_h2d)).c_str(),
                  human_bytes(static_cast<double>(stats.bytes_d2h)).c_str(),
                  human_bytes(static_cast<double>(stats.bytes_nvme_read)).c_str(),
                  human_bytes(static_cast<double>(stats.bytes_nvme_write)).c_str(), stats.lr,
                  stats.skipped ? "  (skipped)" : "");
      std::fflush(stdout);  // a step's line as it ends, also through a pipe
    }
    // No checkpoint is started after a stop signal (one already started
    // completes: a save becomes `latest` only by its last atomic rename).
    if (o.save_every > 0 && (step + 1) % o.save_every == 0 && strata::examples::train::stop_signal() == 0) {
      const std::string blob = std::to_string(step + 1);
      if (const strata_status st = strata_checkpoint_save(engine, o.checkpoint.c_str(), blob.data(), blob.size());
          st != STRATA_STATUS_OK) {
        std::fprintf(stderr,
                     "strata-train: --checkpoint %s: the save of step %d failed: %s (%s); the checkpoint `latest` "
                     "names is intact: free space there or point --checkpoint elsewhere, then --resume\n",
                     o.checkpoint.c_str(), step + 1, strata_last_error(), strata_status_name(st));
        return 1;
      }
    }
  }
  const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_train).count();
  const int ran = done - first_step;
  std::printf("\nsummary: %d steps in %.1f s, %.1f samples/s on average; loss %.6f -> %.6f (%.1f%% of the first)\n",
              ran, train_s, ran > 0 ? samples_per_s_sum / ran : 0.0, first_loss, last_loss,
              first_loss > 0 ? 100.0 * last_loss / first_loss : 0.0);
  std::printf("         per step: h2d %s, d2h %s, nvme read %s, nvme write %s; %lld skipped\n",
              human_bytes(static_cast<double>(last.bytes_h2d)).c_str(),
              human_bytes(static_cast<double>(last.bytes_d2h)).c_str(),
              human_bytes(static_cast<double>(last.bytes_nvme_read)).c_str(),
              human_bytes(static_cast<double>(last.bytes_nvme_write)).c_str(),
              static_cast<long long>(last.skipped_total));
  // Where the CPU optimizer's threads ran (strata.cpu_adam.bind): from the
  // engine, also when no step ran.
  strata_step_stats now = STRATA_STEP_STATS_INIT;
  CHECK_STRATA(strata_stats(engine, &now), "read the statistics");
  std::printf("         cpu_adam: %s\n", now.cpu_adam_binding != nullptr ? now.cpu_adam_binding : "(not reported)");
  // What the swap drives were written: since the engine was created (the
  // swap files' first contents included), and per step on average.
  if (swap_path_count == 0) {
    std::printf("         swap (SSD wear): nothing lives on nvme, no swap writes\n");
  } else {
    std::vector<strata_swap_stats> swaps(swap_path_count);
    std::uint64_t written_total = 0, read_total = 0;
    for (uint32_t i = 0; i < swap_path_count; ++i) {
      swaps[i] = STRATA_SWAP_STATS_INIT;
      CHECK_STRATA(strata_swap_stats_get(engine, i, &swaps[i]), "read a swap path's traffic");
      written_total += swaps[i].bytes_written_total;
      read_total += swaps[i].bytes_read_total;
    }
    auto per_step = [ran](std::uint64_t bytes) {
      return human_bytes(ran > 0 ? static_cast<double>(bytes) / ran : 0.0);
    };
    std::printf("         swap (SSD wear): wrote %s to %u path(s) since the engine was created, %s per step on "
                "average; read %s\n",
                human_bytes(static_cast<double>(written_total)).c_str(), swap_path_count,
                per_step(nvme_written).c_str(), human_bytes(static_cast<double>(read_total)).c_str());
    for (uint32_t i = 0; i < swap_path_count; ++i) {
      std::printf("           %s: wrote %s, %s per step; read %s\n", swaps[i].path,
                  human_bytes(static_cast<double>(swaps[i].bytes_written_total)).c_str(),
                  per_step(swap_written[i]).c_str(),
                  human_bytes(static_cast<double>(swaps[i].bytes_read_total)).c_str());
    }
  }
  if (const int sig = strata::examples::train::stop_signal(); sig != 0) {
    // Stopped: no export, no dump; the engine is destroyed on return (its
    // swap files removed unless strata.io.keep_files).
    std::printf(
        "strata-train: interrupted by %s at step %d; %s\n", strata::examples::train::signal_name(sig), done,
        o.save_every > 0 ? "the checkpoint named by `latest` is the last complete one (--resume continues)"
                         : "nothing saved");
    std::fflush(stdout);
    return 128 + sig;
  }
  if (!o.export_dir.empty()) {
    if (const strata_status st = strata_export_safetensors(engine, o.export_dir.c_str(), STRATA_DTYPE_BF16, 0);
        st != STRATA_STATUS_OK) {
      std::fprintf(stderr, "strata-train: --export %s: the export failed: %s (%s): free space there or point --export "
                   "elsewhere\n", o.export_dir.c_str(), strata_last_error(), strata_status_name(st));
      return 1;
    }
    std::printf("exported the weights to %s/model.safetensors\n", o.export_dir.c_str());
  }
  if (!o.dump_masters.empty()) {
    // Every trainable parameter's fp32 masters, back to back in registration
    // order: placements are compared on these bytes.
    std::ofstream out(o.dump_masters, std::ios::binary);
    for (const auto& p : model.params()) {
      if (frozen_group(p.group_index)) continue;
      std::vector<float> v(static_cast<std::size_t>(p.num_elems));
      CHECK_STRATA(strata_param_read_master(engine, p.name.c_str(), v.data(), p.num_elems), "read masters");
      out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
    }
    out.flush();
    if (!out) {
      std::fprintf(stderr, "strata-train: --dump-masters %s: cannot write it: %s\n", o.dump_masters.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  const std::optional<Options> options = strata::examples::train::parse_options(argc, argv, &exit_code);
  if (!options) return exit_code;
  strata::examples::train::install_stop_handlers();
  return run(*options);
}
