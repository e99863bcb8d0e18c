/* strata: the C API, the only public ABI of the strata engine.
 *
 * Conventions:
 *  1. Every name starts with strata_ / STRATA_; functions are
 *     strata_<object>_<verb>.
 *  2. Fallible calls return strata_status (STRATA_STATUS_OK = 0); results come
 *     back through trailing out-parameters, which are written only on success.
 *  3. On failure the calling thread's strata_last_error() describes what went
 *     wrong (naming the key path, file, offset or sizes involved). It stays
 *     valid until the next failing call on that thread.
 *  4. No call throws, asserts or exits on bad input: misuse returns
 *     STRATA_STATUS_INVALID_ARGUMENT or STRATA_STATUS_FAILED_PRECONDITION.
 *  5. Ownership is written on every pointer: "borrowed" (valid for the call),
 *     "caller-owned, free with X", or "valid until Y". destroy/free functions
 *     accept NULL and do nothing.
 *  6. Structs that cross the API begin with uint32_t struct_size, set by the
 *     matching STRATA_*_INIT to the caller's sizeof; fields are only appended.
 *  7. Thread-safety is stated per function; functions without a statement
 *     are thread-safe. The calls that take a strata_engine* are serialized
 *     per engine, so several threads may make them: e.g. a backward thread
 *     hands a group's gradients back (strata_group_grad_buffer,
 *     strata_group_grads_ready, strata_group_grads_host) while the training
 *     thread fetches the next group. The call order below still holds across
 *     threads (the framework makes strata_step_end wait for every gradient
 *     call of the step to return). strata_engine_destroy must not overlap
 *     any other call on its engine.
 *  8. Memory crosses as pointer, size in bytes, dtype and device. Device
 *     memory (strata_group_view.data) is touched only by the device's own
 *     operations or by the framework's kernels on that device; a framework
 *     that computes on the CPU copies with the *_host calls instead.
 *  9. A stream argument is a void*: a cudaStream_t on the CUDA device, NULL on
 *     the host device (anything else there is INVALID_ARGUMENT). NULL means
 *     "blocking".
 * 10. Callbacks take user_data last, say on which thread they run, and are
 *     never called with a lock held.
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#if defined(STRATA_BUILDING_LIBRARY)
#define STRATA_API __attribute__((visibility("default")))
#else
#define STRATA_API
#endif

#ifdef __cplusplus
#define STRATA_NOEXCEPT noexcept
extern "C" {
#else
#define STRATA_NOEXCEPT
#endif

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 5
#define STRATA_VERSION_PATCH 0

/* Status codes. Stable: values are never renumbered. */
typedef enum strata_status {
  STRATA_STATUS_OK = 0,
  STRATA_STATUS_INVALID_ARGUMENT = 1,    /* the caller passed something wrong */
  STRATA_STATUS_NOT_FOUND = 2,           /* a named file, key or group does not exist */
  STRATA_STATUS_ALREADY_EXISTS = 3,      /* creating what exists (or a locked swap path) */
  STRATA_STATUS_PERMISSION_DENIED = 4,   /* the OS refused access */
  STRATA_STATUS_OUT_OF_MEMORY = 5,       /* an allocator failed */
  STRATA_STATUS_RESOURCE_EXHAUSTED = 6,  /* a budget or a disk would be exceeded */
  STRATA_STATUS_FAILED_PRECONDITION = 7, /* wrong call order or state */
  STRATA_STATUS_OUT_OF_RANGE = 8,        /* an offset or index past the end */
  STRATA_STATUS_UNIMPLEMENTED = 9,       /* not built in or not supported here */
  STRATA_STATUS_UNAVAILABLE = 10,        /* exists but cannot be used now (no GPU driver) */
  STRATA_STATUS_IO_ERROR = 11,           /* a read, write, open or fsync failed */
  STRATA_STATUS_DATA_LOSS = 12,          /* corrupt data (CRC mismatch, truncated file) */
  STRATA_STATUS_CANCELLED = 13,          /* stopped on request */
  STRATA_STATUS_INTERNAL = 14            /* a bug in strata */
} strata_status;

/* --- version ------------------------------------------------------------- */

/* The library's version, "MAJOR.MINOR.PATCH". Static storage. */
STRATA_API const char* strata_version(void) STRATA_NOEXCEPT;

/* Nonzero when a program built against headers of version major.minor may
 * use this library: the same major and a minor no newer than the library's
 * (while major is 0, the minor must match exactly). */
STRATA_API int strata_abi_compatible(int major, int minor) STRATA_NOEXCEPT;

/* --- errors -------------------------------------------------------------- */

/* A stable upper-case name for a status ("INVALID_ARGUMENT"); "UNKNOWN" for
 * a value that is not a strata_status. Static storage. */
STRATA_API const char* strata_status_name(strata_status status) STRATA_NOEXCEPT;

/* The message of the last failing call on this thread ("" if none). Valid
 * until the next failing call on this thread. */
STRATA_API const char* strata_last_error(void) STRATA_NOEXCEPT;

/* --- configuration ------------------------------------------------------- */

/* Parses and checks a JSON configuration (DeepSpeed's keys and strata's, see
 * docs/config.md) without creating an engine. On success writes the number of
 * warnings (unknown keys, keys without effect) to *warning_count_out (may be
 * NULL). Errors: STRATA_STATUS_INVALID_ARGUMENT naming the key path and the
 * value (config_json NULL or not valid). config_json is borrowed. */
STRATA_API strata_status strata_config_check(const char* config_json,
                                             uint32_t* warning_count_out) STRATA_NOEXCEPT;

/* Writes the resolved configuration (every key, defaults filled in) as a
 * NUL-terminated JSON string to *json_out: caller-owned, free with
 * strata_string_free. Errors as strata_config_check. */
STRATA_API strata_status strata_config_resolve(const char* config_json, char** json_out) STRATA_NOEXCEPT;

/* Frees a string strata returned. NULL is a no-op. */
STRATA_API void strata_string_free(char* s) STRATA_NOEXCEPT;

/* What the embedding program knows that the JSON may leave to it (0.3). Every
 * field's 0 means "not given", so STRATA_CONFIG_OPTIONS_INIT gives the same
 * result as the calls without _ex. */
typedef struct strata_config_options {
  uint32_t struct_size;    /* STRATA_CONFIG_OPTIONS_INIT */
  int32_t strict;          /* nonzero: unknown keys are errors, whatever "strata.strict" says;
                              0: "strata.strict" decides (default false) */
  int64_t total_num_steps; /* optimizer steps of the run, >= 0: resolves "auto" in
                              scheduler.params.total_num_steps; 0: unknown ("auto" there is
                              then INVALID_ARGUMENT) */
  int64_t hidden_size;     /* the model's hidden size, >= 0: resolves "auto" in
                              zero_optimization.reduce_bucket_size (h^2),
                              stage3_prefetch_bucket_size (0.9 h^2) and
                              stage3_param_persistence_threshold (10 h), as the Hugging Face
                              integration does; 0: unknown (DeepSpeed's defaults apply) */
  int32_t world_size;      /* (since 0.5) the data-parallel ranks the config is for, >= 0:
                              train_batch_size = train_micro_batch_size_per_gpu x
                              gradient_accumulation_steps x world_size, as DeepSpeed counts it;
                              0: one (strata_config_check_ex, strata_config_resolve_ex) or the
                              engine's ranks (strata_engine_create_ranked sets it) */
} strata_config_options;
#define STRATA_CONFIG_OPTIONS_INIT {(uint32_t)sizeof(strata_config_options), 0, 0, 0, 0}

/* strata_config_check and strata_config_resolve with options (0.3). options
 * is borrowed; NULL means STRATA_CONFIG_OPTIONS_INIT. Errors as theirs, and
 * INVALID_ARGUMENT for options->struct_size 0 or a negative total_num_steps
 * or hidden_size. */
STRATA_API strata_status strata_config_check_ex(const char* config_json, const strata_config_options* options,
                                                uint32_t* warning_count_out) STRATA_NOEXCEPT;
STRATA_API strata_status strata_config_resolve_ex(const char* config_json, const strata_config_options* options,
                                                  char** json_out) STRATA_NOEXCEPT;

/* --- the engine ---------------------------------------------------------- */

/* Training state in device memory, pinned CPU memory or NVMe, driven by the
 * framework through the step protocol (bindings/c/README.md). Call order (any
 * other order is FAILED_PRECONDITION, never a hang):
 *
 *   strata_engine_create
 *   strata_optimizer_group_add*          optional per-group lr / weight decay
 *   strata_param_register+
 *   strata_engine_finalize
 *   per step, per micro-batch:
 *     forward:  { strata_group_fetch[_host]  ...  strata_group_release }*
 *     backward: { strata_group_fetch[_host], strata_group_grad_buffer +
 *                 strata_group_grads_ready (or strata_group_grads_host),
 *                 strata_group_release }* for every trainable group
 *     strata_micro_step_end              between micro-batches
 *   strata_step_end                      after the last micro-batch
 *   strata_engine_destroy
 *
 * Every call in this section is thread-safe as convention 7 says (but
 * strata_engine_destroy) and blocking: when it returns, the work it started
 * is complete. */
typedef struct strata_engine strata_engine;

/* Element types of compute copies and gradients. */
typedef enum strata_dtype {
  STRATA_DTYPE_F32 = 0,
  STRATA_DTYPE_BF16 = 1,
  STRATA_DTYPE_F16 = 2
} strata_dtype;

/* Where a view's memory lives. */
typedef enum strata_device_kind {
  STRATA_DEVICE_HOST = 0, /* the emulated device: host memory, used only through strata */
  STRATA_DEVICE_CUDA = 1  /* CUDA device memory */
} strata_device_kind;

/* Creates an engine from a JSON configuration (docs/config.md): the device
 * ("strata.device"), the budgets, the placement of every state. On success
 * *out is caller-owned: free it with strata_engine_destroy. Errors: the
 * config's (INVALID_ARGUMENT naming the key), the device's (UNAVAILABLE when
 * strata.device is "cuda" and there is none). config_json is borrowed. */
STRATA_API strata_status strata_engine_create(const char* config_json, strata_engine** out) STRATA_NOEXCEPT;

/* strata_engine_create with options (0.3): the run's total_num_steps for
 * "auto" in the scheduler, strict parsing, the hidden size (see
 * strata_config_options). options is borrowed; NULL means
 * STRATA_CONFIG_OPTIONS_INIT. Errors as strata_engine_create's, and those of
 * strata_config_check_ex. */
STRATA_API strata_status strata_engine_create_ex(const char* config_json, const strata_config_options* options,
                                                 strata_engine** out) STRATA_NOEXCEPT;

/* How an engine meets the other data-parallel ranks of its run (0.5; DESIGN.md
 * section 10, docs/distributed.md). Every rank creates its engine with the
 * same config and drives the same model through the same calls on its own
 * micro-batches; each keeps the optimizer state of its shard, the gradients
 * are averaged over every rank's micro-batches, and every rank gets the new
 * compute copies whole (at zero_optimization.stage 3 each keeps its shard of
 * them, and each fetch gathers the group from every rank: strata_group_fetch
 * is then a call every rank makes for the same groups in the same order). */
typedef struct strata_ranks {
  uint32_t struct_size;  /* STRATA_RANKS_INIT */
  int32_t size;          /* ranks in the run; 0: from the launcher's environment (torchrun or
                            DeepSpeed's launcher, mpirun, srun: partition/launch.h), one rank
                            without a launcher */
  int32_t rank;          /* this engine's, in [0, size) (with size > 0) */
  const char* backend;   /* "gloo" (host buffers over TCP) or "self"; NULL: "gloo", "self" for one rank */
  const char* store_dir; /* the directory where the ranks meet (every rank reaches it; one per run,
                            or a run_id of its own); NULL with size 0: the launcher's default;
                            required with size > 1 */
  const char* run_id;    /* names this run's keys in store_dir; NULL: "strata" (size > 0) or the
                            launcher's run (size 0) */
  int64_t timeout_ms;    /* each collective, and meeting the others; 0: STRATA_TIMEOUT_S's seconds when
                            set, else 5 minutes */
  int32_t local_size;    /* ranks on this machine; 0: not given (with size 0 the launcher's, else every
                            rank on this machine, local_rank = rank) */
  int32_t local_rank;    /* this engine's among them, in [0, local_size) (with local_size > 0): it drives
                            CUDA device local_rank (the only one when its process sees one), and its CPU
                            optimizer takes its share of the cores near that GPU */
  /* A key-value store the ranks meet through instead of store_dir (0.5; with size > 0): a
     framework's own, such as torch.distributed's TCP store, so that ranks on machines without a
     shared file system meet. Both callbacks or neither, and a run_id of the run's own (a
     store's keys are not cleared between runs). store_set writes key's value (len
     bytes; a key is written once). store_get waits up to timeout_ms for key to be set, then
     copies up to cap bytes of its value into buf and its whole length into *len (a value longer
     than cap: called again with room for it). Each returns 0, or nonzero when it failed (for
     store_get: the key was not set in time). Called during strata_engine_create_ranked only,
     on its thread, with store_user. */
  void* store_user;
  int (*store_set)(void* store_user, const char* key, const void* value, size_t len);
  int (*store_get)(void* store_user, const char* key, void* buf, size_t cap, size_t* len, int64_t timeout_ms);
} strata_ranks;
#define STRATA_RANKS_INIT {(uint32_t)sizeof(strata_ranks), 0, 0, NULL, NULL, NULL, 0, 0, 0, NULL, NULL, NULL}

/* strata_engine_create_ex for one rank of several (0.5): meets the others
 * (every rank must call it; it returns once all arrived, or UNAVAILABLE when
 * they do not within the timeout). ranks is borrowed; NULL means
 * STRATA_RANKS_INIT. Errors as strata_engine_create_ex's; INVALID_ARGUMENT
 * for a rank outside [0, size), a local_rank outside [0, local_size), a
 * negative timeout, no store_dir (or store) with size > 1, a store with
 * size 0 or with one callback of two, or more ranks on this
 * machine than CUDA devices visible to each (strata.device cuda or auto); a launcher's variables half set or malformed, named;
 * UNIMPLEMENTED for what several ranks do not do yet (a backend other than
 * "gloo"). */
/* Every rank must register the same parameters with the same initial values
 * and hand the groups' gradients over in the same order; a step whose ranks
 * did not fails on every rank (FAILED_PRECONDITION) before anything is
 * applied. strata_param_read_master gives this rank's shard (the other
 * elements NaN). */
STRATA_API strata_status strata_engine_create_ranked(const char* config_json, const strata_config_options* options,
                                                     const strata_ranks* ranks,
                                                     strata_engine** out) STRATA_NOEXCEPT;

/* This engine's rank and the run's size into *rank_out and *size_out (either
 * may be NULL): 0 and 1 for an engine of its own (0.5). */
STRATA_API strata_status strata_engine_rank(strata_engine* engine, int32_t* rank_out,
                                            int32_t* size_out) STRATA_NOEXCEPT;

/* Destroys an engine: waits for its device work, frees its memory and its
 * swap files (unless strata.io.keep_files). Every view it handed out becomes
 * invalid. NULL is a no-op. */
STRATA_API void strata_engine_destroy(strata_engine* engine) STRATA_NOEXCEPT;

/* An optimizer group: per-group weight decay and learning-rate scale (e.g. no
 * weight decay on norms and biases). Group 0 exists already, with the
 * optimizer's weight decay and scale 1. */
typedef struct strata_optimizer_group_desc {
  uint32_t struct_size;  /* STRATA_OPTIMIZER_GROUP_DESC_INIT */
  const char* name;      /* for messages; NULL: "" */
  double weight_decay;   /* >= 0; 0: none */
  double lr_scale;       /* > 0: the group's lr is the schedule's times this; 0: 1 */
} strata_optimizer_group_desc;
#define STRATA_OPTIMIZER_GROUP_DESC_INIT {(uint32_t)sizeof(strata_optimizer_group_desc), NULL, 0.0, 0.0}

/* Adds an optimizer group before finalize and writes its index (for
 * strata_param_desc.optimizer_group) to *index_out. desc is borrowed.
 * Errors: INVALID_ARGUMENT (a NULL argument, struct_size 0, a negative or
 * non-finite value), FAILED_PRECONDITION after finalize. */
STRATA_API strata_status strata_optimizer_group_add(strata_engine* engine, const strata_optimizer_group_desc* desc,
                                                    int32_t* index_out) STRATA_NOEXCEPT;

/* A parameter. Zero is the default of every field but name. */
typedef struct strata_param_desc {
  uint32_t struct_size;    /* STRATA_PARAM_DESC_INIT */
  const char* name;        /* unique, required */
  const int64_t* shape;    /* ndim dimensions, each > 0; NULL when ndim is 0 (a scalar) */
  int32_t ndim;            /* >= 0 */
  const char* group;       /* fetch group (usually a layer); NULL: the parameter's own name */
  int32_t frozen;          /* nonzero: no gradient, master weights or moments (a compute copy only) */
  int32_t optimizer_group; /* from strata_optimizer_group_add; 0: the default group */
} strata_param_desc;
#define STRATA_PARAM_DESC_INIT {(uint32_t)sizeof(strata_param_desc), NULL, NULL, 0, NULL, 0, 0}

/* Fills a parameter's initial fp32 values: out has numel elements (row-major
 * in the registered shape), owned by strata and valid for the call; name is
 * valid for the call. Returns STRATA_STATUS_OK, or a failure that
 * strata_engine_finalize then returns (naming the parameter). Called once per
 * parameter on the thread that calls strata_engine_finalize, during that
 * call, group by group, never with a lock held. The layout is fixed before
 * the first call, so strata_group_info_get, strata_param_offset,
 * strata_loss_scale and strata_stats answer from it (as after finalize); every
 * other function taking this engine fails with FAILED_PRECONDITION until
 * finalize returns (from any thread). */
typedef strata_status (*strata_init_fn)(const char* name, float* out, int64_t numel, void* user_data);

/* Registers a parameter before finalize. desc and the strings and shape it
 * points to are borrowed (copied); init and user_data must stay valid until
 * strata_engine_finalize returns. init may be NULL (since 0.2): the initial
 * values then come from the files of strata_init_from_safetensors, called
 * before or after; once those are given, such a parameter is checked here
 * (NOT_FOUND when they hold no tensor for it, INVALID_ARGUMENT when its shape
 * differs; nothing is registered then), and without them finalize fails
 * (FAILED_PRECONDITION naming the parameter). Errors: INVALID_ARGUMENT (a
 * NULL engine or desc, struct_size 0, ndim < 0, shape NULL with ndim > 0),
 * FAILED_PRECONDITION after finalize. Names, dimensions and optimizer groups
 * are checked at finalize (INVALID_ARGUMENT naming the parameter). */
STRATA_API strata_status strata_param_register(strata_engine* engine, const strata_param_desc* desc,
                                               strata_init_fn init, void* user_data) STRATA_NOEXCEPT;

/* Initial values from safetensors files (since 0.2), before finalize: every
 * parameter registered with a NULL init takes them from the tensor named
 * name_prefix + its name (F32, BF16 or F16, converted exactly to the fp32
 * master weights, then rounded to the compute copies as an init callback's
 * values are); parameters with an init callback keep it. path: a directory
 * holding model.safetensors.index.json (Hugging Face's sharded layout) or
 * model.safetensors, or one .safetensors file. name_prefix may be NULL or ""
 * (no prefix). This call reads the files' headers and checks the parameters
 * registered so far; finalize checks that every tensor in the files is some
 * registered parameter's (after the prefix), before it allocates anything,
 * then streams the values in group by group with the nvme engine's direct
 * reads (strata.io), opening each file only while groups still read it: the
 * host never holds more than a group. Errors (the message names the
 * parameter, the tensor, the file, and both shapes on a mismatch):
 * NOT_FOUND (path, or a parameter's tensor is missing), INVALID_ARGUMENT
 * (NULL engine or path; a shape differs), DATA_LOSS (a file or the index is
 * corrupt, or they disagree), UNIMPLEMENTED (a tensor of another dtype),
 * FAILED_PRECONDITION (after finalize; called twice). On error nothing
 * changes. Finalize then reports, before it allocates anything, an extra
 * tensor (INVALID_ARGUMENT naming it and its file) and the checks above for
 * every parameter, and I/O errors while streaming. path and name_prefix are
 * borrowed. */
STRATA_API strata_status strata_init_from_safetensors(strata_engine* engine, const char* path,
                                                      const char* name_prefix) STRATA_NOEXCEPT;

/* Lays out every state, places it in its home tier under the budgets, and
 * writes the initial values (calling each parameter's init, or reading the
 * files of strata_init_from_safetensors). Errors: RESOURCE_EXHAUSTED naming
 * the budget (strata.budgets.*) and the bytes needed; INVALID_ARGUMENT for a
 * bad registration; an init callback's failure; the safetensors checks and
 * reads (see strata_init_from_safetensors); FAILED_PRECONDITION naming a
 * parameter with a NULL init when no safetensors files were given, and when
 * called twice: once per engine, also after a failure (which has released
 * what it built, the swap files and the swap paths' locks among it, before
 * it returns; destroy the engine and create another to try again). */
STRATA_API strata_status strata_engine_finalize(strata_engine* engine) STRATA_NOEXCEPT;

/* (since 0.5) strata_engine_finalize, then strata_checkpoint_load(root),
 * without writing the initial values the checkpoint replaces: the init
 * callbacks and safetensors files of every fetch group whose parameters all
 * train are not called or read, and their state is written once, by the
 * load (a resume of a model whose state is on nvme crosses the disk once).
 * Groups with a frozen parameter get their initial values as
 * strata_engine_finalize writes them. The blob: strata_checkpoint_blob.
 * root is borrowed. Before anything is built (every rank agrees): NOT_FOUND
 * (no complete checkpoint), DATA_LOSS (a damaged latest or manifest),
 * FAILED_PRECONDITION (other parameters or compute dtype, naming the first
 * difference; ranks that found different checkpoints, or a rank that called
 * strata_engine_finalize instead, named on every rank); these and
 * strata_engine_finalize's errors are a failed finalize's (destroy the
 * engine; to start fresh when there is no checkpoint, look for it first).
 * The load's errors (a damaged state file, another
 * frozen base): the engine stays finalized without values, and every step,
 * fetch, read, save, export and lr call is FAILED_PRECONDITION saying so
 * until a strata_checkpoint_load succeeds. */
STRATA_API strata_status strata_engine_finalize_from_checkpoint(strata_engine* engine,
                                                               const char* root) STRATA_NOEXCEPT;

/* A fetch group's layout, without fetching it. */
typedef struct strata_group_info {
  uint32_t struct_size;      /* STRATA_GROUP_INFO_INIT */
  uint64_t size_bytes;       /* of its compute copies (and of its gradient buffer), padding included */
  strata_dtype dtype;        /* of compute copies and gradients */
  strata_device_kind device; /* where strata_group_fetch's views live */
  int32_t param_count;       /* parameters in the group */
  int32_t trainable;         /* nonzero when some parameter of it is trainable (it needs gradients) */
  int32_t device_index;      /* (since 0.5) the CUDA device's ordinal (0 on the host device) */
  uint64_t grad_offset_bytes; /* (since 0.5) where its gradient buffer begins in this layout: its first
                                 trainable parameter's slot (frozen parameters come first and have
                                 none; 0 when every parameter trains, size_bytes when none does) */
} strata_group_info;
#define STRATA_GROUP_INFO_INIT {(uint32_t)sizeof(strata_group_info), 0, STRATA_DTYPE_F32, STRATA_DEVICE_HOST, 0, 0, 0, 0}

/* Writes the layout of a fetch group to *out (the caller sets
 * out->struct_size; strata writes only the fields that fit). Errors:
 * INVALID_ARGUMENT, FAILED_PRECONDITION before finalize, NOT_FOUND for an
 * unknown group. group is borrowed. */
STRATA_API strata_status strata_group_info_get(strata_engine* engine, const char* group,
                                               strata_group_info* out) STRATA_NOEXCEPT;

/* Where a parameter sits in its group's compute copies (and gradients): it
 * starts *offset_elems_out elements (of the group's dtype) into the group's
 * buffer and runs for its numel elements, row-major. *group_out (may be NULL)
 * is the group's name, valid until the engine is destroyed. Errors:
 * INVALID_ARGUMENT, FAILED_PRECONDITION before finalize, NOT_FOUND. */
STRATA_API strata_status strata_param_offset(strata_engine* engine, const char* param, int64_t* offset_elems_out,
                                             const char** group_out) STRATA_NOEXCEPT;

/* A view of device memory. */
typedef struct strata_group_view {
  uint32_t struct_size;      /* STRATA_GROUP_VIEW_INIT */
  void* data;                /* device address (see convention 8) */
  uint64_t size_bytes;
  strata_dtype dtype;
  strata_device_kind device;
  uint64_t offset_bytes;     /* (since 0.5) where data sits in the group's layout: 0 for the compute
                                copies; a gradient buffer's grad_offset_bytes (strata_group_info) */
} strata_group_view;
#define STRATA_GROUP_VIEW_INIT {(uint32_t)sizeof(strata_group_view), NULL, 0, STRATA_DTYPE_F32, STRATA_DEVICE_HOST, 0}

/* Fetches a group's compute copies to the device and writes a view of them to
 * *out (the caller sets out->struct_size). The view is valid until
 * strata_group_release(group) and must only be read. stream: see convention
 * 9. With a stream (CUDA only) the copies are queued and the stream waits for
 * them (an event): work the framework then enqueues on that stream may read
 * the view, and the host does not block on the copies (it still waits for the
 * optimizer's last update of the group, and for reads of compute copies kept
 * on NVMe). A reader on the host calls strata_group_wait first. NULL: the
 * call blocks until the copies are complete. Errors:
 * INVALID_ARGUMENT, FAILED_PRECONDITION (before finalize, or the group is
 * fetched already), NOT_FOUND, RESOURCE_EXHAUSTED (device budget). */
STRATA_API strata_status strata_group_fetch(strata_engine* engine, const char* group, void* stream,
                                            strata_group_view* out) STRATA_NOEXCEPT;

/* Waits until a fetched group's copies are complete (after a fetch with a
 * stream, for a reader on the host; after a NULL-stream fetch it returns at
 * once). Errors: FAILED_PRECONDITION when the group is not fetched. */
STRATA_API strata_status strata_group_wait(strata_engine* engine, const char* group) STRATA_NOEXCEPT;

/* For frameworks that compute on the CPU: fetches a group (as
 * strata_group_fetch with a NULL stream) and copies its compute copies into
 * host_dst, which must hold exactly size bytes (strata_group_info's
 * size_bytes). On success the group stays fetched until
 * strata_group_release; on failure it is not fetched. host_dst
 * is borrowed. These copies are the framework's and are not counted in the
 * step's bytes. Errors: as strata_group_fetch; INVALID_ARGUMENT naming both
 * sizes when size is not the group's (nothing is fetched then). */
STRATA_API strata_status strata_group_fetch_host(strata_engine* engine, const char* group, void* host_dst,
                                                 size_t size) STRATA_NOEXCEPT;

/* Ends a fetch: the group's views become invalid. Errors: FAILED_PRECONDITION
 * when the group is not fetched. */
STRATA_API strata_status strata_group_release(strata_engine* engine, const char* group) STRATA_NOEXCEPT;

/* As strata_group_release, for a framework whose work on the view is still
 * queued on `stream` (see convention 9): strata writes the group's buffer
 * again only after that work (an event; the host does not block). With NULL
 * it is strata_group_release: the caller's work on the view is done. */
STRATA_API strata_status strata_group_release_on(strata_engine* engine, const char* group,
                                                 void* stream) STRATA_NOEXCEPT;

/* A device buffer for a trainable group's gradients of the current
 * micro-batch, scaled by strata_loss_scale, laid out like its compute copies
 * from the group's first trainable slot on: out->offset_bytes (the group's
 * grad_offset_bytes) is where it begins, so parameter p's gradient goes to
 * data + strata_param_offset(p) x element size - offset_bytes, and
 * size_bytes is size_bytes - grad_offset_bytes of the group. Frozen
 * parameters, first in a group, have no slots: a LoRA block's gradient
 * buffer is the size of its adapters, not of its base. Valid until
 * strata_group_grads_ready(group). Errors: INVALID_ARGUMENT (also an `out`
 * whose struct_size ends before offset_bytes, for a group whose buffer does
 * not begin at 0), FAILED_PRECONDITION (before finalize, a group without
 * trainable parameters, its gradients for this micro-batch arrived already),
 * NOT_FOUND. */
STRATA_API strata_status strata_group_grad_buffer(strata_engine* engine, const char* group,
                                                  strata_group_view* out) STRATA_NOEXCEPT;

/* The framework has written the group's gradients into the buffer of
 * strata_group_grad_buffer. stream: the stream they were written on (see
 * convention 9); strata's copy waits for that stream's work so far (an
 * event: the host does not block). With NULL the caller guarantees the
 * writes are complete. Errors: FAILED_PRECONDITION without a gradient
 * buffer, NOT_FOUND. */
STRATA_API strata_status strata_group_grads_ready(strata_engine* engine, const char* group,
                                                  void* stream) STRATA_NOEXCEPT;

/* (0.5) The trainable parameters params[0..count) (names) of group got no
 * gradient in the micro-batch under way: their slots in its gradient buffer
 * hold zeros. Call it before the group's strata_group_grads_ready (or
 * strata_group_grads_host) of that micro-batch; calling it again adds to the
 * list. With strata.no_grad "skip" (the default) a parameter without a
 * gradient in every micro-batch of a step is left as it is by that step:
 * its weights, optimizer state and step count (its bias correction counts
 * the steps that updated it), as torch's optimizers skip a parameter whose
 * grad is None; "zero" updates it with the zero gradient (DeepSpeed's way).
 * With several ranks a parameter is skipped when no rank gave it a gradient
 * (each rank says what it did; every rank skips the same). Errors: INVALID_ARGUMENT
 * (a NULL argument, a name that is not a trainable parameter of the group),
 * FAILED_PRECONDITION (before finalize; the group's gradients for this
 * micro-batch arrived already), NOT_FOUND for an unknown group. */
STRATA_API strata_status strata_group_no_grads(strata_engine* engine, const char* group, const char* const* params,
                                               size_t count) STRATA_NOEXCEPT;

/* For frameworks that compute on the CPU: copies size bytes of gradients
 * (its dtype, scaled by strata_loss_scale) from host_src into the engine's
 * gradient buffer and calls strata_group_grads_ready. host_src is laid out
 * like the group's compute copies, either whole (size = size_bytes; the
 * frozen parameters' slots are not read) or from grad_offset_bytes on as
 * strata_group_grad_buffer's buffer (size = size_bytes - grad_offset_bytes).
 * host_src is borrowed. Errors: as strata_group_grad_buffer; INVALID_ARGUMENT
 * naming the sizes when size is neither. */
STRATA_API strata_status strata_group_grads_host(strata_engine* engine, const char* group, const void* host_src,
                                                 size_t size) STRATA_NOEXCEPT;

/* --- DLPack views (since 0.2) --------------------------------------------- */

/* Which of a group's buffers strata_group_dlpack exports. */
typedef enum strata_view_kind {
  STRATA_VIEW_COMPUTE = 0,    /* the fetched compute copies (strata_group_fetch's view) */
  STRATA_VIEW_GRADS = 1,      /* the gradient buffer of a group whose buffer begins at 0 (every parameter
                                 in the layout from its start: none frozen before a trainable one) */
  STRATA_VIEW_GRAD_BUFFER = 2 /* (since 0.5) the gradient buffer, any group: strata_group_grad_buffer's,
                                 from the group's grad_offset_bytes on */
} strata_view_kind;

/* Exports a view of a group's buffer as a DLPack tensor: *managed_out is a
 * DLManagedTensor* (DLPack 0.6 ABI, the unversioned struct of
 * <dlpack/dlpack.h>, which this header does not include). The tensor is 1-D,
 * contiguous (strides {1}), of the group's dtype (kDLFloat 32, kDLBfloat 16,
 * kDLFloat 16) with as many elements as its view has (padding included;
 * strata_param_offset places each parameter; a gradient buffer begins at
 * the group's grad_offset_bytes, as strata_group_grad_buffer's), on kDLCUDA
 * (the engine's device, strata_group_info.device_index) or, on the host device,
 * kDLCPU (the emulated device's memory is host memory; the rules of
 * convention 8 still hold for it).
 *  - STRATA_VIEW_COMPUTE: the group must be fetched; the tensor views the
 *    compute copies strata_group_fetch returned, to be read only.
 *  - STRATA_VIEW_GRAD_BUFFER: does what strata_group_grad_buffer does (same
 *    preconditions and errors) and views that buffer (from the group's
 *    grad_offset_bytes on); write the gradients into it, then call
 *    strata_group_grads_ready.
 *  - STRATA_VIEW_GRADS: as STRATA_VIEW_GRAD_BUFFER for a group whose buffer
 *    begins at 0, the only kind before 0.5 (whose callers place gradients
 *    at their parameters' offsets); FAILED_PRECONDITION for another group,
 *    naming STRATA_VIEW_GRAD_BUFFER.
 * Ownership: the caller owns the tensor and ends it by calling its deleter
 * exactly once (a framework's from_dlpack takes it over), on any thread, at
 * any time, also after strata_engine_destroy. Until then strata neither
 * frees the memory nor hands it to anything else: after strata_group_release
 * or strata_group_grads_ready the buffer is set aside instead of reused, and
 * strata_engine_destroy leaves it (with the device, which on CUDA includes
 * the engine's device-memory arena) to the deleter, which frees it once the
 * work queued on it by strata_group_release_on has passed. A live tensor's
 * memory stays charged to strata.budgets.device. What the memory holds is
 * defined only while the view is: using the tensor after strata_group_release
 * (COMPUTE) or strata_group_grads_ready (GRADS) is the framework's bug, and
 * for a group whose compute copies live on the device the view is their home,
 * which the optimizer rewrites in place. Errors: INVALID_ARGUMENT (a NULL
 * argument, kind not a strata_view_kind), FAILED_PRECONDITION (before
 * finalize; COMPUTE: the group is not fetched, naming it; GRADS: as
 * strata_group_grad_buffer), NOT_FOUND, UNIMPLEMENTED when the library was
 * built without <dlpack/dlpack.h>. group is borrowed. */
STRATA_API strata_status strata_group_dlpack(strata_engine* engine, const char* group, strata_view_kind kind,
                                             void** managed_out) STRATA_NOEXCEPT;

/* Ends a micro-batch that is not the step's last. Errors: FAILED_PRECONDITION
 * naming a trainable group without gradients, or after the last micro-batch
 * (gradient_accumulation_steps). */
STRATA_API strata_status strata_micro_step_end(strata_engine* engine) STRATA_NOEXCEPT;

/* One step's outcome. */
typedef struct strata_step_stats {
  uint32_t struct_size;      /* STRATA_STEP_STATS_INIT */
  int32_t skipped;           /* nonzero: not applied (fp16 overflow, or non-finite bf16/fp32 gradients) */
  int64_t step;              /* optimizer steps applied so far */
  int64_t skipped_total;     /* steps skipped so far */
  double grad_norm;          /* of the unscaled, averaged gradients, before clipping */
  double lr;                 /* of optimizer group 0 for this step (0 when skipped) */
  double loss_scale;         /* for the next step */
  uint64_t bytes_h2d;        /* moved by the engine since the previous strata_step_end */
  uint64_t bytes_d2h;
  uint64_t bytes_nvme_read;
  uint64_t bytes_nvme_write;
  double fetch_seconds;      /* in fetches (compute copies to the device) since the previous step_end */
  double grads_seconds;      /* in taking gradients back (down, gradient pass) */
  double optimizer_seconds;  /* in the optimizer and writing compute copies home */
  int64_t prefetched;        /* fetches served by a prefetched copy since the previous step_end */
  int64_t speculative_discarded; /* strata.overlap "speculative": elements whose speculative update was
                                    thrown away (skipped or clipped steps), by jobs ended since the previous step_end */
  int64_t resident;          /* fetches served by a copy kept on the device since its release */
  uint64_t resident_bytes;   /* the compute copies those fetches did not move (not in bytes_*) */
  int64_t norm_step;         /* the step (counting every step_end from 1) whose gradients grad_norm, skipped
                                and lr describe: this one, except under strata.overlap "delayed" in bf16/fp32
                                (strata.nonfinite not "error"), whose step_end does not wait for the step's
                                last gradients: there, the step before (0: none yet), and step and
                                skipped_total count the verdicts taken */
  /* (0.4) Bytes read from and written to the swap paths, all of them, since the
   * engine was created, as of this step_end: what strata_swap_stats_get gives
   * per path (bytes_read_total, bytes_written_total). */
  uint64_t bytes_nvme_read_total;
  uint64_t bytes_nvme_write_total;
  /* (0.4) Where the CPU optimizer's threads run (strata.cpu_adam.bind and numa_node), as
   * strata_engine_finalize chose them: the same in every step's statistics, and given by
   * strata_stats from finalize on (NULL and zeros before). */
  const char* cpu_adam_binding; /* one line: the threads, whether pinned, the NUMA node and CPUs, or
                                   why not pinned; owned by the engine, valid until
                                   strata_engine_destroy */
  int32_t cpu_adam_threads;     /* threads of a CPU optimizer pass, the calling thread among them */
  int32_t cpu_adam_pinned;      /* nonzero: its worker threads are pinned, one per physical core */
  int32_t cpu_adam_numa_node;   /* the NUMA node (the OS's number) of the chosen cores; -1: none or
                                   several */
  /* (0.5) The NUMA node the engine's pinned memory was placed on: the node of this rank's GPU (several
   * local ranks) or strata.cpu_adam.numa_node, on a machine of several nodes; -1: not placed (the
   * pages lie where the allocating thread first touched them). */
  int32_t pinned_memory_numa_node;
  /* (0.5) Bytes of frozen parameters read from the safetensors files they were imported from
   * (strata.frozen_base: a frozen base whose home is its files) since the previous strata_step_end:
   * reads of the drive outside the swap paths, in none of the bytes_nvme_* figures. */
  uint64_t bytes_file_read;
  /* (0.5) The swap reads the fetches counted in resident did not make: their groups' compute homes
   * on nvme (this rank's shard at stage 3 over ranks; a frozen part read from its safetensors files
   * aside; none for a home in pinned memory, where zero_optimization.offload_param.max_in_cpu keeps
   * some groups'). */
  uint64_t resident_nvme_bytes;
} strata_step_stats;
#define STRATA_STEP_STATS_INIT                                                                             \
  {(uint32_t)sizeof(strata_step_stats), 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, \
   NULL, 0, 0, 0, -1, 0, 0}

/* Ends the step after its last micro-batch: loss scaling or skip, clipping,
 * the learning rate, the optimizer, new compute copies home. Writes the
 * step's statistics to *out when out is not NULL (the caller sets
 * out->struct_size). Errors: FAILED_PRECONDITION naming a trainable group
 * without gradients or a group still fetched (release every group first: the
 * optimizer rewrites their compute copies), or when micro-batches are
 * missing; the I/O and device
 * errors of the optimizer pass. */
STRATA_API strata_status strata_step_end(strata_engine* engine, strata_step_stats* out) STRATA_NOEXCEPT;

/* The statistics of the last strata_step_end (zeros before the first) into
 * *out (the caller sets out->struct_size). */
STRATA_API strata_status strata_stats(strata_engine* engine, strata_step_stats* out) STRATA_NOEXCEPT;

/* One swap path's traffic (0.4): what an SSD under it is written, for its
 * wear. The step figures split the last strata_step_end's bytes_nvme_read and
 * bytes_nvme_write by path (each swap block's bytes on the path its extents
 * lie on); the totals are the I/O layer's count for the path's swap file since
 * the engine was created: every step's traffic plus the swap files'
 * initialisation at finalize, checkpoint saves and loads, export and
 * strata_param_read_master, with O_DIRECT's last partial 4 KiB sector of a
 * block moved whole. A resumed run counts from zero again (checkpoints do
 * not carry it). */
typedef struct strata_swap_stats {
  uint32_t struct_size;         /* STRATA_SWAP_STATS_INIT */
  const char* path;             /* the swap directory (strata.io.paths or nvme_path); owned by the engine,
                                   valid until strata_engine_destroy */
  uint64_t bytes_read;          /* in the last strata_step_end's step (0 before the first) */
  uint64_t bytes_written;
  uint64_t bytes_read_total;    /* since the engine was created, up to now: I/O of an optimizer job still
                                   running (strata.overlap "exact", "delayed") adds to them later */
  uint64_t bytes_written_total;
} strata_swap_stats;
#define STRATA_SWAP_STATS_INIT {(uint32_t)sizeof(strata_swap_stats), NULL, 0, 0, 0, 0}

/* The number of swap paths into *count_out (0 before finalize, and when no
 * state lives on nvme), in the order of the config's strata.io.paths (else the
 * placements' nvme_path). */
STRATA_API strata_status strata_swap_path_count(strata_engine* engine, uint32_t* count_out) STRATA_NOEXCEPT;

/* Swap path `index`'s traffic into *out (the caller sets out->struct_size).
 * Errors: OUT_OF_RANGE when index >= strata_swap_path_count, naming both. */
STRATA_API strata_status strata_swap_stats_get(strata_engine* engine, uint32_t index,
                                               strata_swap_stats* out) STRATA_NOEXCEPT;

/* The loss scale for the next backward pass (1 unless fp16): the framework
 * multiplies its loss by it. */
STRATA_API strata_status strata_loss_scale(strata_engine* engine, double* out) STRATA_NOEXCEPT;

/* Overrides the schedule's learning rate (>= 0, finite) from the next step on.
 * Errors: INVALID_ARGUMENT. */
STRATA_API strata_status strata_lr_set(strata_engine* engine, double lr) STRATA_NOEXCEPT;

/* Copies a trainable parameter's fp32 master weights, wherever they live,
 * into out (numel elements, caller-owned). Errors: INVALID_ARGUMENT (numel is
 * not the parameter's, naming both), FAILED_PRECONDITION (before finalize, a
 * frozen parameter), NOT_FOUND. */
STRATA_API strata_status strata_param_read_master(strata_engine* engine, const char* param, float* out,
                                                  int64_t numel) STRATA_NOEXCEPT;

/* The weights of `count` parameters as a state_dict holds them (0.5): a
 * trainable parameter's fp32 master weights, a frozen one's compute copies
 * (as fp32), params[i] into outs[i] (numels[i] floats, caller-owned). With
 * several ranks a call every rank makes with the same parameters in the same
 * order: the masters are gathered from the ranks' shards (each fetch group's
 * once), and a failure on one rank fails every rank's call, naming it.
 * Errors: INVALID_ARGUMENT (a numel not the parameter's, naming both; ranks
 * that asked for other parameters), NOT_FOUND, FAILED_PRECONDITION (before
 * finalize, in the middle of a step's update). */
STRATA_API strata_status strata_params_read_weights(strata_engine* engine, const char* const* params,
                                                    float* const* outs, const int64_t* numels,
                                                    size_t count) STRATA_NOEXCEPT;


/* --- checkpoints and export (format: docs/checkpoints.md) ----------------- */

/* Saves the whole training state between steps into <root>/step-<N>/ and then
 * points <root>/latest at it; a save interrupted anywhere leaves the previous
 * checkpoint loadable. blob (blob_size bytes, may be NULL when 0) is the
 * framework's own state, returned by strata_checkpoint_blob after a load;
 * root and blob are borrowed. Errors: FAILED_PRECONDITION in the middle of a
 * step (groups fetched, gradients pending); I/O errors naming the file. */
STRATA_API strata_status strata_checkpoint_save(strata_engine* engine, const char* root, const void* blob,
                                                size_t blob_size) STRATA_NOEXCEPT;

/* Loads <root>/latest (or <root> itself when it is a step directory; or,
 * when <root>/latest is missing, the newest complete <root>/step-<N>, named
 * in a warning) into a finalized engine with the same parameters, under any
 * placement. Errors: NOT_FOUND (no complete checkpoint); DATA_LOSS naming the file for a damaged or truncated one (every
 * file of a checkpoint, latest included, carries a CRC64, checked before
 * anything changes); FAILED_PRECONDITION for a newer format version, another
 * parameter set (naming the first difference), a checkpoint that left its
 * frozen base out (strata.frozen_base) loaded over another base, or
 * mid-step. */
STRATA_API strata_status strata_checkpoint_load(strata_engine* engine, const char* root) STRATA_NOEXCEPT;

/* The framework blob of the last strata_checkpoint_load: *data_out (owned by
 * the engine, valid until the next load or destroy) and *size_out. Errors:
 * FAILED_PRECONDITION when nothing was loaded. */
STRATA_API strata_status strata_checkpoint_blob(strata_engine* engine, const void** data_out,
                                                size_t* size_out) STRATA_NOEXCEPT;

/* Writes the current weights (fp32 masters of trainable parameters, compute
 * copies of frozen ones) as safetensors in dtype into dir: model.safetensors,
 * or shards of at most max_shard_bytes (0: no limit) with
 * model.safetensors.index.json. dir is borrowed. */
STRATA_API strata_status strata_export_safetensors(strata_engine* engine, const char* dir, strata_dtype dtype,
                                                   uint64_t max_shard_bytes) STRATA_NOEXCEPT;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
