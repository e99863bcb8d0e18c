// The C API's implementation: every entry point runs inside guard(), which
// turns a Status into a strata_status plus the thread's last-error message and
// catches anything thrown (bad_alloc becomes OUT_OF_MEMORY, the rest INTERNAL).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/config.h"
#include "core/mutex.h"
#include "core/status.h"
#include "core/str.h"
#include "engine/engine.h"
#include "partition/launch.h"
#include "strata/strata.h"

#if STRATA_HAVE_DLPACK
#include <dlpack/dlpack.h>
#endif

// The handle behind strata_engine*. Members are destroyed in reverse order:
// the copy stream before the engine that owns its device. `mu` serializes
// the calls that take the handle (STRATA_C_ENTER); the engine locks itself
// too, inside.
struct strata_engine {
  strata::core::Mutex mu;
  std::unique_ptr<strata::engine::Engine> engine;
  // the *_host calls' copies (created on first use)
  strata::gpu::Stream copies STRATA_GUARDED_BY(mu);
  // groups fetched and not released
  std::set<std::string, std::less<>> fetched STRATA_GUARDED_BY(mu);
  std::vector<std::byte> blob STRATA_GUARDED_BY(mu);                 // of the last checkpoint load
  strata_step_stats last STRATA_GUARDED_BY(mu) = STRATA_STEP_STATS_INIT;  // of the last strata_step_end
  std::vector<strata::engine::SwapPathBytes> last_paths STRATA_GUARDED_BY(mu);  // its bytes per swap path
  // The swap paths (strata_swap_stats.path points into them): taken once
  // finalize made them, never changed after.
  std::vector<std::string> swap_paths STRATA_GUARDED_BY(mu);
  bool loaded STRATA_GUARDED_BY(mu) = false;
};

namespace strata::c_api {
namespace {

thread_local std::string g_last_error;

static_assert(static_cast<int>(core::StatusCode::kInternal) == STRATA_STATUS_INTERNAL,
              "strata_status must follow core::StatusCode one to one");

strata_status fail(const core::Status& s) {
  g_last_error = s.to_string();
  return static_cast<strata_status>(s.code());
}

template <typename Fn>
strata_status guard(Fn&& fn) noexcept {
  try {
    const core::Status s = fn();
    return s.ok() ? STRATA_STATUS_OK : fail(s);
  } catch (const std::bad_alloc&) {
    g_last_error = "OUT_OF_MEMORY: a host allocation failed";
    return STRATA_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = std::string("INTERNAL: unexpected exception: ") + e.what();
    return STRATA_STATUS_INTERNAL;
  } catch (...) {
    g_last_error = "INTERNAL: unexpected exception";
    return STRATA_STATUS_INTERNAL;
  }
}

core::Result<engine::Config> parse(const char* json, engine::ParseOptions options = {}) {
  if (json == nullptr) return core::Status::invalid_argument("config_json is NULL");
  if (options.world_size == 0) options.world_size = 1;  // strata_config_options.world_size not given
  return engine::parse_config(json, options);
}

core::Status null_argument(const char* fn, const char* arg) {
  return core::Status::invalid_argument(core::str_cat(fn, ": ", arg, " is NULL"));
}
#define STRATA_C_NOT_NULL(fn, arg) \
  if ((arg) == nullptr) return ::strata::c_api::null_argument(fn, #arg)
// The start of every call that takes a strata_engine* (but finalize, which
// only calls the engine, so that init callbacks run with no lock held): the
// handle is not NULL, then the handle's lock for the rest of the call.
#define STRATA_C_ENTER(fn, handle) \
  STRATA_C_NOT_NULL(fn, handle);   \
  const ::strata::core::MutexLock strata_c_lock_((handle)->mu)

// A caller's versioned struct, read as this library's version of it: the
// bytes that fit are copied, the rest stays zero (the defaults).
template <typename T>
core::Result<T> read_struct(const T* in, const char* fn, const char* arg) {
  if (in == nullptr) return null_argument(fn, arg);
  if (in->struct_size < sizeof(std::uint32_t)) {
    return core::Status::invalid_argument(
        core::str_cat(fn, ": ", arg, "->struct_size is ", in->struct_size, "; initialize it with its STRATA_*_INIT"));
  }
  T out{};
  std::memcpy(&out, in, std::min<std::size_t>(in->struct_size, sizeof(T)));
  out.struct_size = sizeof(T);
  return out;
}

// Writes a result into a caller's versioned struct: only the bytes that fit
// its struct_size; struct_size itself keeps the caller's value.
template <typename T>
core::Status check_out_struct(const T* out, const char* fn, const char* arg) {
  if (out == nullptr) return null_argument(fn, arg);
  if (out->struct_size < sizeof(std::uint32_t)) {
    return core::Status::invalid_argument(
        core::str_cat(fn, ": ", arg, "->struct_size is ", out->struct_size, "; initialize it with its STRATA_*_INIT"));
  }
  return core::Status();
}
template <typename T>
void write_struct(T* out, T value) {
  const std::uint32_t caller_size = out->struct_size;
  value.struct_size = caller_size;
  std::memcpy(out, &value, std::min<std::size_t>(caller_size, sizeof(T)));
}

strata_dtype dtype_of(const engine::Engine& e) {
  if (e.layout().compute_bytes == 4) return STRATA_DTYPE_F32;
  return e.config().precision == engine::Precision::kFp16 ? STRATA_DTYPE_F16 : STRATA_DTYPE_BF16;
}
strata_device_kind device_of(engine::Engine& e) {
  return e.device().kind() == gpu::DeviceKind::kCuda ? STRATA_DEVICE_CUDA : STRATA_DEVICE_HOST;
}

strata_group_view view_of(engine::Engine& e, const gpu::DeviceSpan& span) {
  strata_group_view v = STRATA_GROUP_VIEW_INIT;
  v.data = span.data();
  v.size_bytes = span.size_bytes();
  v.dtype = dtype_of(e);
  v.device = device_of(e);
  return v;
}

core::Result<const engine::GroupPlace*> find_group(engine::Engine& e, const char* group, const char* fn) {
  if (!e.finalized()) return core::Status::failed_precondition(core::str_cat(fn, " before finalize"));
  const engine::GroupPlace* g = e.layout().find_group(group);
  if (g == nullptr) return core::Status::not_found(core::str_cat(fn, ": no fetch group named '", group, "'"));
  return g;
}

std::uint64_t group_bytes(const engine::Engine& e, const engine::GroupPlace& g) {
  return static_cast<std::uint64_t>(g.compute_elems) * static_cast<std::uint64_t>(e.layout().compute_bytes);
}

core::Status check_size(const engine::Engine& e, const engine::GroupPlace& g, std::size_t size, const char* fn) {
  if (size != group_bytes(e, g)) {
    return core::Status::invalid_argument(core::str_cat(fn, "('", g.name, "'): size is ", size,
                                                        " bytes; the group's buffer is ", group_bytes(e, g),
                                                        " bytes (strata_group_info_get)"));
  }
  return core::Status();
}

// Where a group's gradient buffer begins in its compute layout (its first
// trainable slot), in bytes.
std::uint64_t grad_offset_bytes(const engine::Engine& e, const engine::GroupPlace& g) {
  return static_cast<std::uint64_t>(g.trainable_compute_begin) * static_cast<std::uint64_t>(e.layout().compute_bytes);
}

// Whether the caller's view struct has room for offset_bytes: one built
// against a header without it would place every gradient at its slot in the
// whole layout.
core::Status check_view_has_offset(const strata_group_view* out, std::uint64_t offset, const engine::GroupPlace& g,
                                   const char* fn) {
  constexpr std::size_t kNeeds = offsetof(strata_group_view, offset_bytes) + sizeof(out->offset_bytes);
  // (A group with no trainable parameter has no buffer: grad_buffer says so.)
  if (offset == 0 || g.trainable_elems == 0 || out->struct_size >= kNeeds) return core::Status();
  return core::Status::invalid_argument(core::str_cat(
      fn, "('", g.name, "'): the gradient buffer of this group begins ", offset,
      " bytes into its layout (its frozen parameters have no slots), and out->struct_size (", out->struct_size,
      ") has no room for offset_bytes to say so: build against strata.h 0.5 or later (STRATA_GROUP_VIEW_INIT)"));
}

core::Result<gpu::Stream*> copy_stream(strata_engine& h) STRATA_REQUIRES(h.mu) {
  if (h.copies.empty()) {
    STRATA_ASSIGN_OR_RETURN(h.copies, h.engine->device().create_stream("c_api host copies"));
  }
  return &h.copies;
}

// Fetch, recording the group as fetched; `stream`: the framework's (null:
// a blocking fetch).
core::Result<gpu::DeviceSpan> fetch(strata_engine& h, const char* group, gpu::Stream* stream = nullptr)
    STRATA_REQUIRES(h.mu) {
  STRATA_ASSIGN_OR_RETURN(gpu::DeviceSpan span, h.engine->fetch(group, stream));
  h.fetched.insert(group);
  return span;
}

#if STRATA_HAVE_DLPACK
// A DLPack tensor strata_group_dlpack made: the DLManagedTensor handed out,
// its shape and strides, and the lease that keeps its memory.
struct DlpackTensor {
  DLManagedTensor managed{};
  std::int64_t shape[1] = {0};
  std::int64_t strides[1] = {1};
  std::unique_ptr<engine::ViewLease> lease;
};

extern "C" {
// The tensor's deleter: ends the lease (any thread, also after the engine).
static void delete_dlpack_tensor(DLManagedTensor* self) noexcept {
  if (self != nullptr) delete static_cast<DlpackTensor*>(self->manager_ctx);
}
}  // extern "C"

DLDataType dl_dtype(strata_dtype d) {
  switch (d) {
    case STRATA_DTYPE_F32: return DLDataType{kDLFloat, 32, 1};
    case STRATA_DTYPE_BF16: return DLDataType{kDLBfloat, 16, 1};
    case STRATA_DTYPE_F16: break;
  }
  return DLDataType{kDLFloat, 16, 1};
}
#endif

}  // namespace
}  // namespace strata::c_api

using strata::c_api::guard;
namespace core = strata::core;
namespace c_api = strata::c_api;
namespace se = strata::engine;
namespace gpu = strata::gpu;
using core::str_cat;

namespace strata::c_api {
namespace {

// The swap paths, taken from the engine the first time they exist (finalize
// makes them; they never change after).
const std::vector<std::string>& swap_paths(strata_engine& h) STRATA_REQUIRES(h.mu) {
  if (h.swap_paths.empty()) h.swap_paths = h.engine->swap_paths();
  return h.swap_paths;
}

// The CPU optimizer's threads into a step's statistics: what finalize chose
// (the description lives in the engine until it is destroyed); NULL and
// zeros before finalize.
void put_cpu_threads(const engine::Engine& e, strata_step_stats* r) {
  if (!e.finalized()) return;
  const engine::CpuThreads& t = e.cpu_threads();
  r->cpu_adam_binding = t.description.c_str();
  r->cpu_adam_threads = t.threads;
  r->cpu_adam_pinned = t.pinned ? 1 : 0;
  r->cpu_adam_numa_node = t.numa_node;
  r->pinned_memory_numa_node = t.pinned_memory_node;
}

// A caller's strata_config_options (NULL: defaults) as the engine's ParseOptions.
core::Result<engine::ParseOptions> parse_options(const strata_config_options* in, const char* fn) {
  if (in == nullptr) return engine::ParseOptions{};
  STRATA_ASSIGN_OR_RETURN(const strata_config_options o, read_struct(in, fn, "options"));
  if (o.total_num_steps < 0 || o.hidden_size < 0) {
    return core::Status::invalid_argument(core::str_cat(
        fn, ": options->", o.total_num_steps < 0 ? "total_num_steps" : "hidden_size", " is ",
        o.total_num_steps < 0 ? o.total_num_steps : o.hidden_size, "; it must be >= 0 (0: not given)"));
  }
  if (o.world_size < 0) {
    return core::Status::invalid_argument(
        core::str_cat(fn, ": options->world_size is ", o.world_size, "; it must be >= 0 (0: one, or the engine's ranks)"));
  }
  // world_size 0 (not given) stays 0 here: create_engine tells it from a
  // given 1; parse() makes it one.
  return engine::ParseOptions{.hidden_size = o.hidden_size,
                              .total_num_steps = o.total_num_steps,
                              .strict = o.strict != 0,
                              .world_size = o.world_size};
}

// strata_ranks' store callbacks as a partition::RendezvousStore.
class CallbackStore final : public partition::RendezvousStore {
 public:
  explicit CallbackStore(const strata_ranks& r) : user_(r.store_user), set_(r.store_set), get_(r.store_get) {}

  core::Status set(const std::string& key, const std::vector<char>& value) override {
    if (set_(user_, key.c_str(), value.data(), value.size()) != 0) {
      return core::Status::unavailable(core::str_cat("ranks->store_set failed for key '", key, "'"));
    }
    return core::Status();
  }
  core::Result<std::vector<char>> get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::vector<char> value(64);  // Gloo's addresses are longer: the second call is the common path
    for (int round = 0; round < 2; ++round) {
      std::size_t len = 0;
      if (get_(user_, key.c_str(), value.data(), value.size(), &len, static_cast<std::int64_t>(timeout.count())) != 0) {
        return core::Status::unavailable(core::str_cat("ranks->store_get found no key '", key, "' within ",
                                                       timeout.count(), " ms"));
      }
      if (len <= value.size()) {
        value.resize(len);
        return value;
      }
      value.resize(len);  // longer than the room: again, with room for it
    }
    return core::Status::internal(core::str_cat("ranks->store_get: key '", key, "' grew between two calls"));
  }

 private:
  void* user_;
  int (*set_)(void*, const char*, const void*, size_t);
  int (*get_)(void*, const char*, void*, size_t, size_t*, int64_t);
};

// The communicator options a strata_ranks describes (see strata.h).
core::Result<partition::CommunicatorOptions> communicator_options(const strata_ranks* in, const char* fn) {
  STRATA_ASSIGN_OR_RETURN(const strata_ranks r, read_struct(in, fn, "ranks"));
  if (r.timeout_ms < 0) {
    return core::Status::invalid_argument(core::str_cat(fn, ": ranks->timeout_ms is ", r.timeout_ms,
                                                        "; it must be >= 0 (0: STRATA_TIMEOUT_S, else 5 minutes)"));
  }
  const partition::GetEnv getenv = [](const char* name) { return std::getenv(name); };
  // 0: STRATA_TIMEOUT_S (seconds) when set, else 5 minutes.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  if (r.timeout_ms > 0) {
    timeout = std::chrono::milliseconds(r.timeout_ms);
  } else if (const char* env = getenv("STRATA_TIMEOUT_S"); env != nullptr && *env != '\0') {
    const std::string_view text(env);
    double seconds = 0.0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), seconds);  // not the locale's
    if (ec != std::errc() || end != text.data() + text.size() || !(seconds >= 0.001) || !(seconds <= 1e7)) {
      return core::Status::invalid_argument(core::str_cat(fn, ": STRATA_TIMEOUT_S is '", text,
                                                          "'; it must be a number of seconds from 0.001 to 1e7 "
                                                          "(the collectives' timeout)"));
    }
    timeout = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
  }
  partition::CommunicatorOptions o;
  const core::Result<std::optional<partition::Launch>> launch = partition::launch_from_environment(getenv);
  if (r.size == 0) {
    if (r.store_set != nullptr || r.store_get != nullptr) {
      return core::Status::invalid_argument(core::str_cat(
          fn, ": ranks has a store and size 0 (the launcher's ranks meet in its directory): give rank and size too"));
    }
    STRATA_RETURN_IF_ERROR(launch.status());  // the launcher's variables, half set or malformed
    if (launch->has_value()) {  // else one rank
      STRATA_ASSIGN_OR_RETURN(o, partition::communicator_options(**launch, getenv, timeout));
      if (r.backend != nullptr) o.backend = r.backend;
      if (r.store_dir != nullptr) o.store_dir = r.store_dir;
      if (r.run_id != nullptr) o.prefix = r.run_id;
    }
  } else {
    if (r.size < 0 || r.rank < 0 || r.rank >= r.size) {
      return core::Status::invalid_argument(core::str_cat(fn, ": ranks->rank is ", r.rank, " and ranks->size ",
                                                          r.size, "; the rank must be in [0, size)"));
    }
    o.backend = r.backend != nullptr ? r.backend : r.size > 1 ? "gloo" : "self";
    o.rank = r.rank;
    o.size = r.size;
    o.store_dir = r.store_dir != nullptr ? r.store_dir : "";
    if ((r.store_set == nullptr) != (r.store_get == nullptr)) {
      return core::Status::invalid_argument(
          core::str_cat(fn, ": ranks has one of store_set and store_get; a store needs both"));
    }
    if (r.store_set != nullptr) {
      if (r.run_id == nullptr || *r.run_id == '\0') {
        return core::Status::invalid_argument(core::str_cat(
            fn, ": ranks has a store and no run_id; a store's keys are not cleared between runs, so each run "
                "(each engine) meets under a run_id of its own"));
      }
      o.store = std::make_shared<CallbackStore>(r);
    }
    if (r.size > 1 && o.store_dir.empty() && o.store == nullptr) {
      return core::Status::invalid_argument(core::str_cat(fn, ": ranks->store_dir is NULL and ranks has no store; ",
                                                          r.size, " ranks need a directory or a store to meet in"));
    }
    if (r.run_id != nullptr) o.prefix = r.run_id;
    // A launcher's environment that describes this same rank (torchrun's
    // around a script that bootstraps from torch.distributed) gives its
    // machine's share and, across machines, its address; without one the
    // address is STRATA_HOST_ADDRESS's, else loopback (transport_address of
    // a launch on one machine).
    const bool same = launch.ok() && launch->has_value() && (*launch)->rank == r.rank && (*launch)->size == r.size;
    if (same) {
      o.local_rank = (*launch)->local_rank;
      o.local_size = (*launch)->local_size;
    }
    if (r.size > 1) {
      STRATA_ASSIGN_OR_RETURN(o.hostname, partition::transport_address(same ? **launch : partition::Launch{}, getenv));
    }
  }
  if (r.local_size < 0 || (r.local_size > 0 && (r.local_rank < 0 || r.local_rank >= r.local_size)) ||
      (r.local_size == 0 && r.local_rank != 0)) {
    return core::Status::invalid_argument(core::str_cat(fn, ": ranks->local_rank is ", r.local_rank,
                                                        " and ranks->local_size ", r.local_size,
                                                        "; the local rank must be in [0, local_size) (local_size 0: "
                                                        "not given, local_rank 0)"));
  }
  if (r.local_size > 0) {
    o.local_rank = r.local_rank;
    o.local_size = r.local_size;
  }
  o.timeout = timeout;
  o.connect_timeout = timeout;
  return o;
}

core::Status config_check(const char* config_json, const strata_config_options* options,
                          uint32_t* warning_count_out, const char* fn) {
  STRATA_ASSIGN_OR_RETURN(const engine::ParseOptions po, parse_options(options, fn));
  STRATA_ASSIGN_OR_RETURN(engine::Config c, parse(config_json, po));
  if (warning_count_out != nullptr) *warning_count_out = static_cast<uint32_t>(c.warnings.size());
  return core::Status();
}

core::Status config_resolve(const char* config_json, const strata_config_options* options, char** json_out,
                            const char* fn) {
  if (json_out == nullptr) return core::Status::invalid_argument("json_out is NULL");
  STRATA_ASSIGN_OR_RETURN(const engine::ParseOptions po, parse_options(options, fn));
  STRATA_ASSIGN_OR_RETURN(engine::Config c, parse(config_json, po));
  const std::string text = engine::to_json(c);
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, text.c_str(), text.size() + 1);
  *json_out = out;
  return core::Status();
}

}  // namespace
}  // namespace strata::c_api

extern "C" {

#define STRATA_C_STR2(x) #x
#define STRATA_C_STR(x) STRATA_C_STR2(x)
const char* strata_version(void) noexcept {
  return STRATA_C_STR(STRATA_VERSION_MAJOR) "." STRATA_C_STR(STRATA_VERSION_MINOR) "." STRATA_C_STR(STRATA_VERSION_PATCH);
}

int strata_abi_compatible(int major, int minor) noexcept {
  if (major != STRATA_VERSION_MAJOR || minor < 0) return 0;
  return STRATA_VERSION_MAJOR == 0 ? minor == STRATA_VERSION_MINOR : minor <= STRATA_VERSION_MINOR;
}

const char* strata_status_name(strata_status status) noexcept {
  int raw = 0;  // a C caller may pass any int: read its bytes, not an out-of-range enum
  std::memcpy(&raw, &status, sizeof raw);
  switch (raw) {
    case STRATA_STATUS_OK: return "OK";
    case STRATA_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case STRATA_STATUS_NOT_FOUND: return "NOT_FOUND";
    case STRATA_STATUS_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case STRATA_STATUS_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case STRATA_STATUS_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case STRATA_STATUS_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case STRATA_STATUS_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case STRATA_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case STRATA_STATUS_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case STRATA_STATUS_UNAVAILABLE: return "UNAVAILABLE";
    case STRATA_STATUS_IO_ERROR: return "IO_ERROR";
    case STRATA_STATUS_DATA_LOSS: return "DATA_LOSS";
    case STRATA_STATUS_CANCELLED: return "CANCELLED";
    case STRATA_STATUS_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN";
}

const char* strata_last_error(void) noexcept { return strata::c_api::g_last_error.c_str(); }


strata_status strata_config_check(const char* config_json, uint32_t* warning_count_out) noexcept {
  return guard(
      [&] { return c_api::config_check(config_json, nullptr, warning_count_out, "strata_config_check"); });
}

strata_status strata_config_check_ex(const char* config_json, const strata_config_options* options,
                                     uint32_t* warning_count_out) noexcept {
  return guard(
      [&] { return c_api::config_check(config_json, options, warning_count_out, "strata_config_check_ex"); });
}

strata_status strata_config_resolve(const char* config_json, char** json_out) noexcept {
  return guard(
      [&] { return c_api::config_resolve(config_json, nullptr, json_out, "strata_config_resolve"); });
}

strata_status strata_config_resolve_ex(const char* config_json, const strata_config_options* options,
                                       char** json_out) noexcept {
  return guard(
      [&] { return c_api::config_resolve(config_json, options, json_out, "strata_config_resolve_ex"); });
}

void strata_string_free(char* s) noexcept { std::free(s); }

// --- the engine ---------------------------------------------------------------

namespace {
// The engine creation calls' body; `fn` names the call in errors.
strata_status create_engine(const char* config_json, const strata_config_options* options, const strata_ranks* ranks,
                            strata_engine** out, const char* fn) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_NOT_NULL(fn, out);
    STRATA_ASSIGN_OR_RETURN(se::ParseOptions po, c_api::parse_options(options, fn));
    strata::partition::CommunicatorOptions co;
    if (ranks != nullptr) {
      STRATA_ASSIGN_OR_RETURN(co, c_api::communicator_options(ranks, fn));
    }
    // DeepSpeed's batch: train_batch_size counts every rank's micro-batches.
    if (po.world_size != 0 && po.world_size != co.size) {
      return core::Status::invalid_argument(core::str_cat(fn, ": options->world_size is ", po.world_size,
                                                          " and the engine is one of ", co.size, " ranks"));
    }
    po.world_size = co.size;
    STRATA_ASSIGN_OR_RETURN(se::Config config, c_api::parse(config_json, po));
    auto h = std::make_unique<strata_engine>();
    STRATA_ASSIGN_OR_RETURN(h->engine, se::Engine::create(config, co));
    *out = h.release();
    return core::Status();
  });
}
}  // namespace

strata_status strata_engine_create(const char* config_json, strata_engine** out) noexcept {
  return create_engine(config_json, nullptr, nullptr, out, "strata_engine_create");
}

strata_status strata_engine_create_ex(const char* config_json, const strata_config_options* options,
                                      strata_engine** out) noexcept {
  return create_engine(config_json, options, nullptr, out, "strata_engine_create_ex");
}

strata_status strata_engine_create_ranked(const char* config_json, const strata_config_options* options,
                                          const strata_ranks* ranks, strata_engine** out) noexcept {
  return create_engine(config_json, options, ranks, out, "strata_engine_create_ranked");
}

strata_status strata_engine_rank(strata_engine* engine, int32_t* rank_out, int32_t* size_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_engine_rank";
    STRATA_C_ENTER(fn, engine);
    const se::RankShare share = engine->engine->rank_share();
    if (rank_out != nullptr) *rank_out = share.rank;
    if (size_out != nullptr) *size_out = share.ranks;
    return core::Status();
  });
}

void strata_engine_destroy(strata_engine* engine) noexcept {
  // Destructors report nothing; errors were returned where they arose.
  try {
    delete engine;
  } catch (...) {
  }
}

strata_status strata_optimizer_group_add(strata_engine* engine, const strata_optimizer_group_desc* desc,
                                         int32_t* index_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_optimizer_group_add";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, index_out);
    STRATA_ASSIGN_OR_RETURN(const strata_optimizer_group_desc d, c_api::read_struct(desc, fn, "desc"));
    se::OptimizerGroupDesc g;
    g.name = d.name != nullptr ? d.name : "";
    g.weight_decay = d.weight_decay;
    g.lr_scale = d.lr_scale == 0.0 ? 1.0 : d.lr_scale;
    if (!std::isfinite(g.weight_decay) || !std::isfinite(g.lr_scale)) {
      return core::Status::invalid_argument(str_cat(fn, ": optimizer group '", g.name, "': weight_decay ",
                                                    g.weight_decay, " and lr_scale ", g.lr_scale,
                                                    " must be finite"));
    }
    STRATA_ASSIGN_OR_RETURN(const int index, engine->engine->add_optimizer_group(g));
    *index_out = index;
    return core::Status();
  });
}

strata_status strata_param_register(strata_engine* engine, const strata_param_desc* desc, strata_init_fn init,
                                    void* user_data) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_param_register";
    STRATA_C_ENTER(fn, engine);
    STRATA_ASSIGN_OR_RETURN(const strata_param_desc d, c_api::read_struct(desc, fn, "desc"));
    if (d.name == nullptr) return core::Status::invalid_argument(str_cat(fn, ": desc->name is NULL"));
    if (d.ndim < 0) {
      return core::Status::invalid_argument(str_cat(fn, "('", d.name, "'): desc->ndim is ", d.ndim, "; expected >= 0"));
    }
    if (d.ndim > 0 && d.shape == nullptr) {
      return core::Status::invalid_argument(
          str_cat(fn, "('", d.name, "'): desc->shape is NULL with desc->ndim ", d.ndim));
    }
    se::ParamDesc p;
    p.name = d.name;
    p.shape.assign(d.shape, d.shape + d.ndim);
    p.group = d.group != nullptr ? d.group : d.name;
    p.trainable = d.frozen == 0;
    p.optimizer_group = d.optimizer_group;
    // No callback: the values come from strata_init_from_safetensors' files.
    if (init == nullptr) {
      auto s = engine->engine->register_param(p, nullptr);
      return s.ok() ? s : std::move(s).annotate(str_cat(fn, "('", d.name, "')"));
    }
    // The callback runs during finalize, on its caller's thread, with no lock held
    // (calls into the engine meanwhile fail with FAILED_PRECONDITION).
    se::InitFn fill = [init, user_data, name = p.name](std::span<float> out) -> core::Status {
      const strata_status s = init(name.c_str(), out.data(), static_cast<int64_t>(out.size()), user_data);
      if (s == STRATA_STATUS_OK) return core::Status();
      const auto code = s > STRATA_STATUS_OK && s <= STRATA_STATUS_INTERNAL ? static_cast<core::StatusCode>(s)
                                                                           : core::StatusCode::kInternal;
      return core::Status(code, str_cat("the init callback returned ", strata_status_name(s)));
    };
    return engine->engine->register_param(p, std::move(fill));
  });
}

strata_status strata_init_from_safetensors(strata_engine* engine, const char* path, const char* name_prefix) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_init_from_safetensors";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, path);
    return engine->engine->init_from_safetensors(path, name_prefix != nullptr ? name_prefix : "");
  });
}

strata_status strata_engine_finalize(strata_engine* engine) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_NOT_NULL("strata_engine_finalize", engine);  // no handle lock: see STRATA_C_ENTER
    return engine->engine->finalize();
  });
}

strata_status strata_engine_finalize_from_checkpoint(strata_engine* engine, const char* root) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_engine_finalize_from_checkpoint";
    STRATA_C_NOT_NULL(fn, engine);  // no handle lock (init callbacks may run): see STRATA_C_ENTER
    STRATA_C_NOT_NULL(fn, root);
    STRATA_ASSIGN_OR_RETURN(std::vector<std::byte> blob, engine->engine->finalize_from_checkpoint(root));
    const core::MutexLock lock(engine->mu);
    engine->blob = std::move(blob);
    engine->loaded = true;
    return core::Status();
  });
}

strata_status strata_group_info_get(strata_engine* engine, const char* group, strata_group_info* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_info_get";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    se::Engine& e = *engine->engine;
    STRATA_ASSIGN_OR_RETURN(const se::GroupPlace* g, c_api::find_group(e, group, fn));
    strata_group_info info = STRATA_GROUP_INFO_INIT;
    info.size_bytes = c_api::group_bytes(e, *g);
    info.dtype = c_api::dtype_of(e);
    info.device = c_api::device_of(e);
    info.device_index = e.device().caps().index;
    info.param_count = static_cast<int32_t>(g->params.size());
    info.trainable = g->trainable_elems > 0 ? 1 : 0;
    info.grad_offset_bytes = c_api::grad_offset_bytes(e, *g);
    c_api::write_struct(out, info);
    return core::Status();
  });
}

strata_status strata_param_offset(strata_engine* engine, const char* param, int64_t* offset_elems_out,
                                  const char** group_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_param_offset";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, param);
    STRATA_C_NOT_NULL(fn, offset_elems_out);
    const se::Engine& e = *engine->engine;
    if (!e.finalized()) return core::Status::failed_precondition(str_cat(fn, " before finalize"));
    const se::Layout& l = e.layout();
    for (std::size_t pi = 0; pi < l.params.size(); ++pi) {
      if (l.params[pi].name != param) continue;
      *offset_elems_out = l.places[pi].compute_offset;
      if (group_out != nullptr) *group_out = l.groups[l.places[pi].group].name.c_str();
      return core::Status();
    }
    return core::Status::not_found(str_cat(fn, ": no parameter named '", param, "'"));
  });
}

strata_status strata_group_fetch(strata_engine* engine, const char* group, void* stream,
                                 strata_group_view* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_fetch";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    se::Engine& e = *engine->engine;
    if (stream == nullptr) {  // blocking: the copies are complete on return
      STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, c_api::fetch(*engine, group));
      c_api::write_struct(out, c_api::view_of(e, span));
      return core::Status();
    }
    if (e.device().kind() != gpu::DeviceKind::kCuda) {
      return core::Status::invalid_argument(str_cat(fn, ": stream must be NULL on the host device"));
    }
    // The copies are queued; the framework's stream waits for them, the host does not.
    auto wrapped = e.device().wrap_native_stream(stream, "framework");
    if (!wrapped.ok()) return std::move(wrapped).status().annotate(fn);
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, c_api::fetch(*engine, group, &*wrapped));
    c_api::write_struct(out, c_api::view_of(e, span));
    return core::Status();
  });
}

strata_status strata_group_wait(strata_engine* engine, const char* group) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_wait";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_RETURN_IF_ERROR(c_api::find_group(*engine->engine, group, fn).status());
    if (!engine->fetched.contains(std::string_view(group))) {
      return core::Status::failed_precondition(str_cat(fn, "('", group, "'): the group is not fetched"));
    }
    return engine->engine->wait_fetched(group);
  });
}

strata_status strata_group_fetch_host(strata_engine* engine, const char* group, void* host_dst, size_t size) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_fetch_host";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_C_NOT_NULL(fn, host_dst);
    se::Engine& e = *engine->engine;
    STRATA_ASSIGN_OR_RETURN(const se::GroupPlace* g, c_api::find_group(e, group, fn));
    STRATA_RETURN_IF_ERROR(c_api::check_size(e, *g, size, fn));
    STRATA_ASSIGN_OR_RETURN(gpu::Stream * s, c_api::copy_stream(*engine));
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, c_api::fetch(*engine, group));
    const std::span<std::byte> dst(static_cast<std::byte*>(host_dst), size);
    core::Status copied = e.device().copy_d2h(*s, dst, span);
    if (copied.ok()) copied = e.device().synchronize(*s);
    if (!copied.ok()) {  // a failed call leaves the group as it was: not fetched
      e.release(group).ignore_error();
      engine->fetched.erase(std::string(group));
    }
    return copied;
  });
}

strata_status strata_group_release(strata_engine* engine, const char* group) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_ENTER("strata_group_release", engine);
    STRATA_C_NOT_NULL("strata_group_release", group);
    STRATA_RETURN_IF_ERROR(engine->engine->release(group));
    engine->fetched.erase(std::string(group));
    return core::Status();
  });
}

strata_status strata_group_release_on(strata_engine* engine, const char* group, void* stream) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_release_on";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    if (stream == nullptr) {
      STRATA_RETURN_IF_ERROR(engine->engine->release(group));
    } else {
      if (engine->engine->device().kind() != gpu::DeviceKind::kCuda) {
        return core::Status::invalid_argument(str_cat(fn, ": stream must be NULL on the host device"));
      }
      auto wrapped = engine->engine->device().wrap_native_stream(stream, "framework");
      if (!wrapped.ok()) return std::move(wrapped).status().annotate(fn);
      STRATA_RETURN_IF_ERROR(engine->engine->release(group, &*wrapped));
    }
    engine->fetched.erase(std::string(group));
    return core::Status();
  });
}

strata_status strata_group_grad_buffer(strata_engine* engine, const char* group, strata_group_view* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_grad_buffer";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    se::Engine& e = *engine->engine;
    STRATA_ASSIGN_OR_RETURN(const se::GroupPlace* g, c_api::find_group(e, group, fn));
    const std::uint64_t offset = c_api::grad_offset_bytes(e, *g);
    STRATA_RETURN_IF_ERROR(c_api::check_view_has_offset(out, offset, *g, fn));
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, e.grad_buffer(group));
    strata_group_view view = c_api::view_of(e, span);
    view.offset_bytes = offset;
    c_api::write_struct(out, view);
    return core::Status();
  });
}

strata_status strata_group_grads_ready(strata_engine* engine, const char* group, void* stream) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_grads_ready";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    if (stream == nullptr) return engine->engine->grads_ready(group);
    if (engine->engine->device().kind() != gpu::DeviceKind::kCuda) {
      return core::Status::invalid_argument(str_cat(fn, ": stream must be NULL on the host device"));
    }
    // The engine's copy waits for the stream (an event), the host does not.
    auto wrapped = engine->engine->device().wrap_native_stream(stream, "framework");
    if (!wrapped.ok()) return std::move(wrapped).status().annotate(fn);
    return engine->engine->grads_ready(group, &*wrapped);
  });
}

strata_status strata_group_no_grads(strata_engine* engine, const char* group, const char* const* params,
                                   size_t count) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_no_grads";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    if (count > 0) {
      STRATA_C_NOT_NULL(fn, params);
    }
    std::vector<std::string_view> names;
    names.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      if (params[i] == nullptr) return core::Status::invalid_argument(str_cat(fn, ": params[", i, "] is NULL"));
      names.emplace_back(params[i]);
    }
    return engine->engine->no_grads(group, names);
  });
}

strata_status strata_group_grads_host(strata_engine* engine, const char* group, const void* host_src,
                                      size_t size) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_grads_host";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_C_NOT_NULL(fn, host_src);
    se::Engine& e = *engine->engine;
    STRATA_ASSIGN_OR_RETURN(const se::GroupPlace* g, c_api::find_group(e, group, fn));
    // The whole layout, or the gradient buffer's part of it.
    const std::uint64_t whole = c_api::group_bytes(e, *g), offset = c_api::grad_offset_bytes(e, *g);
    if (size != whole && size != whole - offset) {
      return core::Status::invalid_argument(
          str_cat(fn, "('", g->name, "'): size is ", size, " bytes; the group's layout is ", whole,
                  " bytes, its gradients' part of it ", whole - offset,
                  " (from grad_offset_bytes on; strata_group_info_get)"));
    }
    STRATA_ASSIGN_OR_RETURN(gpu::Stream * s, c_api::copy_stream(*engine));
    STRATA_ASSIGN_OR_RETURN(const gpu::DeviceSpan span, e.grad_buffer(group));
    const std::size_t skip = size == whole ? static_cast<std::size_t>(offset) : 0;
    const std::span<const std::byte> src(static_cast<const std::byte*>(host_src) + skip, size - skip);
    STRATA_RETURN_IF_ERROR(e.device().copy_h2d(*s, span, src));
    STRATA_RETURN_IF_ERROR(e.device().synchronize(*s));
    return e.grads_ready(group);
  });
}

strata_status strata_group_dlpack(strata_engine* engine, const char* group, strata_view_kind kind,
                                  void** managed_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_group_dlpack";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, group);
    STRATA_C_NOT_NULL(fn, managed_out);
    int raw = 0;  // a C caller may pass any int: read its bytes, not an out-of-range enum
    static_assert(sizeof raw == sizeof kind);
    std::memcpy(&raw, &kind, sizeof raw);
    if (raw != STRATA_VIEW_COMPUTE && raw != STRATA_VIEW_GRADS && raw != STRATA_VIEW_GRAD_BUFFER) {
      return core::Status::invalid_argument(str_cat(fn, "('", group, "'): kind ", raw,
                                                    " is not a strata_view_kind (STRATA_VIEW_COMPUTE, "
                                                    "STRATA_VIEW_GRADS or STRATA_VIEW_GRAD_BUFFER)"));
    }
    const char* kind_name = raw == STRATA_VIEW_COMPUTE ? "STRATA_VIEW_COMPUTE"
                            : raw == STRATA_VIEW_GRADS ? "STRATA_VIEW_GRADS"
                                                       : "STRATA_VIEW_GRAD_BUFFER";
#if STRATA_HAVE_DLPACK
    se::Engine& e = *engine->engine;
    if (raw == STRATA_VIEW_GRADS) {
      // The whole-layout kind of 0.2-0.4, whose callers place a gradient at
      // its parameter's offset: refused where the buffer does not begin at 0.
      STRATA_ASSIGN_OR_RETURN(const se::GroupPlace* g, c_api::find_group(e, group, fn));
      const std::uint64_t offset = c_api::grad_offset_bytes(e, *g);
      if (g->trainable_elems > 0 && offset != 0) {
        return core::Status::failed_precondition(str_cat(
            fn, "('", group, "', STRATA_VIEW_GRADS): the group's gradient buffer begins ", offset,
            " bytes into its layout (its frozen parameters have no slots), which a STRATA_VIEW_GRADS tensor cannot "
            "say: ask for STRATA_VIEW_GRAD_BUFFER and place each gradient at its offset less grad_offset_bytes"));
      }
    }
    auto lent = e.lend_view(group, raw == STRATA_VIEW_COMPUTE ? se::ViewKind::kCompute : se::ViewKind::kGrads);
    if (!lent.ok()) return std::move(lent).status().annotate(str_cat(fn, "('", group, "', ", kind_name, ")"));
    const strata_dtype dtype = c_api::dtype_of(e);
    auto t = std::make_unique<c_api::DlpackTensor>();
    t->shape[0] = static_cast<std::int64_t>(lent->span.size_bytes() / static_cast<std::uint64_t>(e.layout().compute_bytes));
    t->lease = std::move(lent->lease);
    DLTensor& d = t->managed.dl_tensor;
    d.data = lent->span.data();
    d.device = c_api::device_of(e) == STRATA_DEVICE_CUDA ? DLDevice{kDLCUDA, e.device().caps().index} : DLDevice{kDLCPU, 0};
    d.ndim = 1;
    d.dtype = c_api::dl_dtype(dtype);
    d.shape = t->shape;
    d.strides = t->strides;
    d.byte_offset = 0;
    t->managed.manager_ctx = t.get();
    t->managed.deleter = c_api::delete_dlpack_tensor;
    *managed_out = &t.release()->managed;
    return core::Status();
#else
    return core::Status::unimplemented(str_cat(fn, "('", group, "', ", kind_name,
                                               "): this libstrata was built without <dlpack/dlpack.h> "
                                               "(Debian: libdlpack-dev)"));
#endif
  });
}

strata_status strata_micro_step_end(strata_engine* engine) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_ENTER("strata_micro_step_end", engine);
    return engine->engine->micro_step_end();
  });
}

strata_status strata_step_end(strata_engine* engine, strata_step_stats* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_step_end";
    STRATA_C_ENTER(fn, engine);
    if (out != nullptr) {
      STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    }
    STRATA_ASSIGN_OR_RETURN(const se::StepStats st, engine->engine->step_end());
    strata_step_stats r = STRATA_STEP_STATS_INIT;
    r.skipped = st.skipped ? 1 : 0;
    r.step = st.step;
    r.skipped_total = st.skipped_total;
    r.grad_norm = st.grad_norm;
    r.lr = st.lr;
    r.loss_scale = st.loss_scale;
    r.bytes_h2d = st.bytes.h2d;
    r.bytes_d2h = st.bytes.d2h;
    r.bytes_nvme_read = st.bytes.nvme_read;
    r.bytes_nvme_write = st.bytes.nvme_write;
    r.bytes_file_read = st.bytes.file_read;
    r.fetch_seconds = st.fetch_s;
    r.grads_seconds = st.grads_s;
    r.optimizer_seconds = st.optimizer_s;
    r.prefetched = st.prefetched;
    r.speculative_discarded = st.speculative_discarded;
    r.resident = st.resident;
    r.norm_step = st.norm_step;
    r.resident_bytes = st.resident_bytes;
    r.resident_nvme_bytes = st.resident_nvme_bytes;
    for (const se::SwapPathBytes& p : st.nvme_total) {
      r.bytes_nvme_read_total += p.read;
      r.bytes_nvme_write_total += p.written;
    }
    c_api::put_cpu_threads(*engine->engine, &r);
    engine->last = r;
    engine->last_paths = st.bytes.nvme_paths;
    if (out != nullptr) c_api::write_struct(out, r);
    return core::Status();
  });
}

strata_status strata_stats(strata_engine* engine, strata_step_stats* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_stats";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, out);
    STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    strata_step_stats r = engine->last;
    c_api::put_cpu_threads(*engine->engine, &r);
    c_api::write_struct(out, r);
    return core::Status();
  });
}

strata_status strata_swap_path_count(strata_engine* engine, uint32_t* count_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_swap_path_count";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, count_out);
    *count_out = static_cast<uint32_t>(c_api::swap_paths(*engine).size());
    return core::Status();
  });
}

strata_status strata_swap_stats_get(strata_engine* engine, uint32_t index, strata_swap_stats* out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_swap_stats_get";
    STRATA_C_ENTER(fn, engine);
    STRATA_RETURN_IF_ERROR(c_api::check_out_struct(out, fn, "out"));
    const std::vector<std::string>& paths = c_api::swap_paths(*engine);
    if (index >= paths.size()) {
      return core::Status::out_of_range(str_cat(fn, ": index ", index, ", but the engine has ", paths.size(),
                                                " swap path(s)", paths.empty() ? " (none before finalize, or "
                                                                                 "nothing on nvme)" : ""));
    }
    strata_swap_stats r = STRATA_SWAP_STATS_INIT;
    r.path = paths[index].c_str();
    if (index < engine->last_paths.size()) {
      r.bytes_read = engine->last_paths[index].read;
      r.bytes_written = engine->last_paths[index].written;
    }
    const std::vector<se::SwapPathBytes> totals = engine->engine->swap_traffic();
    if (index < totals.size()) {
      r.bytes_read_total = totals[index].read;
      r.bytes_written_total = totals[index].written;
    }
    c_api::write_struct(out, r);
    return core::Status();
  });
}

strata_status strata_loss_scale(strata_engine* engine, double* out) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_ENTER("strata_loss_scale", engine);
    STRATA_C_NOT_NULL("strata_loss_scale", out);
    *out = engine->engine->loss_scale();
    return core::Status();
  });
}

strata_status strata_lr_set(strata_engine* engine, double lr) noexcept {
  return guard([&]() -> core::Status {
    STRATA_C_ENTER("strata_lr_set", engine);
    return engine->engine->set_lr(lr);
  });
}

strata_status strata_param_read_master(strata_engine* engine, const char* param, float* out, int64_t numel) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_param_read_master";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, param);
    STRATA_C_NOT_NULL(fn, out);
    if (numel < 0) return core::Status::invalid_argument(str_cat(fn, "('", param, "'): numel is ", numel));
    return engine->engine->read_master(param, std::span<float>(out, static_cast<std::size_t>(numel)));
  });
}
strata_status strata_params_read_weights(strata_engine* engine, const char* const* params, float* const* outs,
                                         const int64_t* numels, size_t count) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_params_read_weights";
    STRATA_C_ENTER(fn, engine);
    if (count > 0) {
      STRATA_C_NOT_NULL(fn, params);
      STRATA_C_NOT_NULL(fn, outs);
      STRATA_C_NOT_NULL(fn, numels);
    }
    std::vector<strata::engine::Engine::WeightRead> reads(count);
    for (std::size_t i = 0; i < count; ++i) {
      if (params[i] == nullptr) return core::Status::invalid_argument(str_cat(fn, ": params[", i, "] is NULL"));
      if (outs[i] == nullptr || numels[i] < 0) {
        return core::Status::invalid_argument(
            str_cat(fn, "('", params[i], "'): ", outs[i] == nullptr ? "outs[i] is NULL" : "numels[i] < 0"));
      }
      reads[i] = {params[i], std::span<float>(outs[i], static_cast<std::size_t>(numels[i]))};
    }
    return engine->engine->read_weights(reads);
  });
}

strata_status strata_checkpoint_save(strata_engine* engine, const char* root, const void* blob,
                                     size_t blob_size) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_checkpoint_save";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, root);
    if (blob == nullptr && blob_size != 0) {
      return core::Status::invalid_argument(str_cat(fn, ": blob is NULL with blob_size ", blob_size));
    }
    return engine->engine->save_checkpoint(
        root, std::span<const std::byte>(static_cast<const std::byte*>(blob), blob == nullptr ? 0 : blob_size));
  });
}

strata_status strata_checkpoint_load(strata_engine* engine, const char* root) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_checkpoint_load";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, root);
    STRATA_ASSIGN_OR_RETURN(std::vector<std::byte> blob, engine->engine->load_checkpoint(root));
    engine->blob = std::move(blob);
    engine->loaded = true;
    return core::Status();
  });
}

strata_status strata_checkpoint_blob(strata_engine* engine, const void** data_out, size_t* size_out) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_checkpoint_blob";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, data_out);
    STRATA_C_NOT_NULL(fn, size_out);
    if (!engine->loaded) return core::Status::failed_precondition(str_cat(fn, ": no checkpoint was loaded"));
    *data_out = engine->blob.data();
    *size_out = engine->blob.size();
    return core::Status();
  });
}

strata_status strata_export_safetensors(strata_engine* engine, const char* dir, strata_dtype dtype,
                                        uint64_t max_shard_bytes) noexcept {
  return guard([&]() -> core::Status {
    constexpr const char* fn = "strata_export_safetensors";
    STRATA_C_ENTER(fn, engine);
    STRATA_C_NOT_NULL(fn, dir);
    // A C caller may pass any int: read its bytes, not an out-of-range enum.
    int raw = 0;
    static_assert(sizeof raw == sizeof dtype);
    std::memcpy(&raw, &dtype, sizeof raw);
    strata::engine::Precision p;
    switch (raw) {
      case STRATA_DTYPE_F32: p = strata::engine::Precision::kFp32; break;
      case STRATA_DTYPE_BF16: p = strata::engine::Precision::kBf16; break;
      case STRATA_DTYPE_F16: p = strata::engine::Precision::kFp16; break;
      default: return core::Status::invalid_argument(str_cat(fn, ": dtype ", raw, " is not a strata_dtype"));
    }
    return engine->engine->export_safetensors(dir, p, max_shard_bytes);
  });
}
}  // extern "C"
