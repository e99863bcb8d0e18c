// The memory planner behind `strata plan`: for a model under a Config's
// placement, the bytes each tier (GPU, pinned CPU memory, NVMe) must hold and
// the bytes moved per step (DESIGN.md section 1), whether that fits the
// machine, and which placement fits while moving the fewest bytes.
//
// The estimates follow what the engine holds and moves (the scale benchmark
// holds them to a measured run: docs/benchmarks.md, "scale"). P parameters,
// T of them trainable, in L fetch groups (one layer each: P / L parameters,
// or with a transformer shape the larger of a block, 12h^2 + 13h, and the
// embedding, V h); c = 2 B for bf16/fp16 and 4 B for fp32 compute copies;
// g = c B of host gradient per trainable parameter when
// gradient_accumulation_steps = 1, else 4 (fp32 accumulation):
//  - compute copies: c x P, in offload_param.device's tier (none: GPU).
//  - optimizer state of the trainable parameters: fp32 master 4 B plus moments
//    (Adam/AdamW 8 B, Adagrad 4 B, Lion 4 B). offload_optimizer.device none:
//    all on the GPU; cpu/nvme: the share `ratio` is updated on the CPU, the
//    rest stays on the GPU. With nvme, strata.optimizer_cpu_fraction of the
//    CPU-updated share stays in pinned CPU memory, the rest lives on NVMe.
//  - gradients: every trainable group's come down to pinned host gradients
//    (g x T; never on NVMe), whichever tier updates them: the gradient pass
//    runs on the CPU. On the GPU, the buffers the framework writes them
//    into while they are on their way down: reduce_bucket_size elements of
//    groups, at least two, at most one per trainable group (one with
//    strata.overlap "none"). In pinned memory, three groups' staging: one in
//    its pass as copied down and as packed, the next one coming down.
//  - GPU working set when parameters are not GPU-resident: the fetch window,
//    the fetched, prefetched and kept (resident) copies, which share
//    stage3_max_live_parameters (at least one group; all of them when a
//    group is under stage3_param_persistence_threshold; one with overlap
//    "none"), and the persistent parameters (tensors below that threshold;
//    known only with a transformer shape).
//  - the optimizer's view: once per step it opens each trainable group's
//    compute copies on the host (a pinned copy of one group unless their
//    home is pinned), writes the new ones there and sends them home. A
//    chunk updated on the GPU takes its gradients up and its new compute
//    copies down: one chunk's g + c B on the GPU and c B pinned.
//  - pinned staging: with optimizer state on NVMe the disk pipeline's ring,
//    slots of the largest NVMe chunk's fp32 states (chunks never cross a
//    group: at most strata.chunk_bytes / 4 elements, at most a group's),
//    Schedule::ring_depth() slots, or strata.budgets.staging's, or fewer when
//    strata.budgets.pinned leaves less than two slots per slot, never more
//    than the NVMe chunks; with parameters on NVMe a staging copy of one
//    group on its way to the GPU (DeepSpeed's offload_param.buffer_count /
//    buffer_size have no effect).
//  - with strata.overlap "speculative" and optimizer state on NVMe: a second
//    version of that state on disk ((4 + moments) B per NVMe-resident
//    parameter) and pinned room for its groups' new compute copies (c B per
//    NVMe-resident parameter) until step_end decides; with "delayed" the
//    new compute copies of every trainable group (c B per trainable
//    parameter) until the next step_end.
//  - activations (GPU; only with a transformer shape): see
//    estimate_activations().
//  - the swap files: what lives on NVMe plus the room the engine reserves
//    (1/16 + 64 MiB, rounded up to 1 MiB), or strata.budgets.disk when set.
//  - checkpoint space on disk: c x P + (4 + moments) x T; c x T + (4 +
//    moments) x T when the frozen base is read from its files (left out).
//  - LoRA (ModelSpec::lora_rank): every group holds T / L adapter
//    parameters beside its frozen ones, so gradient staging, the optimizer's
//    host view and the gradients' wire buffer are a group's trainable part;
//    with offload_param nvme (not sharded) and strata.frozen_base not
//    "swap", the frozen compute copies are read from their safetensors files:
//    in no tier, their fetches' reads StepTraffic::file_read_bytes.
// Per optimizer step (G = gradient_accumulation_steps micro-batches), with R
// the groups a kept copy serves (stage3_max_live_parameters / group, at most
// L; L when groups are persistent; none with overlap "none"):
//  - host->device: fetches of offloaded compute copies, c B per parameter
//    forward and backward in every micro-batch less R groups of the first
//    backward and R of each later forward and backward; the new compute
//    copies of GPU-resident parameters, c x T; gradients of GPU-updated
//    chunks, g B each.
//  - device->host: gradients, c x T per micro-batch; the optimizer's view of
//    GPU-resident parameters, c x T; new compute copies of GPU-updated
//    chunks, c B each.
//  - disk: (4 + moments) B read and written per NVMe-resident optimizer
//    parameter; with parameters on NVMe, the fetches above read and the
//    optimizer's view read (c x T) and written back (c x T).
//
// With N data-parallel ranks (PlanOptions::ranks) the plan is one rank's,
// as the engine lays it out (engine/layout.h): each group's trainable part
// padded to N norm blocks, the rank's shard (T_r = L x that / N) carries
// the master, the moments and fp32 host gradients (4 B x T_r: summed over
// ranks); compute copies stay whole but at stage 3 (each rank's home its
// shard); a group's fp32 gradients are summed on the device in a buffer kept
// for it (device_gradient_sums), only the rank's shard coming down (4 B x
// T_r per micro-batch), or with strata.device_collectives "off" on the host:
// they come down whole and the pass sums them with its shard in pinned
// memory (rank_gradient_sums); the optimizer gathers a group's new compute
// copies (rank_compute_gather); a checkpoint is 1/N of one rank's. RAM and
// disk are a machine's, shared by its N / M ranks: each rank's capacity is
// 1/(N/M) of them (a budget is already one engine's). Per step each rank
// sends (N-1)/N x (4 B x T_pad x G + c x T_pad) over the collectives
// (StepTraffic::network_bytes, T_pad = N x T_r).
//
// Thread-compatible value types and pure functions (no I/O, no probing).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "engine/config.h"
#include "engine/plan/machine.h"
#include "engine/tier.h"

namespace strata::engine {

// The model to plan for: either num_params, or a decoder-only transformer
// shape (hidden_size and vocab_size) whose parameter count is
// transformer_num_params(); num_layers in both cases. Field names double as
// the `strata plan` flags named beside them.
struct ModelSpec {
  std::int64_t num_params = 0;           // --params; 0: from the transformer shape
  std::int64_t num_layers = 0;           // --layers; required, 1 <= num_layers <= num_params
  std::int64_t hidden_size = 0;          // --hidden (h); 0: no transformer shape
  std::int64_t vocab_size = 0;           // --vocab (V); required with hidden_size
  std::int64_t num_heads = 0;            // --heads (a); 0: max(1, h / 128)
  std::int64_t seq_len = 2048;           // --seq: tokens per sequence
  std::int64_t micro_batch = 0;          // --micro-batch: 0 means train_micro_batch_size_per_gpu
  bool activation_checkpointing = true;  // --checkpointing on|off (full, per layer)
  double frozen_fraction = 0.0;  // --frozen-fraction: share of parameters not trained, [0, 1]
  // --lora RANK: LoRA adapters of this rank on each block's four projection
  // matrices (a transformer shape: 16 x RANK x H adapter parameters a layer),
  // the rest frozen; every layer's fetch group mixes frozen and trainable
  // parameters. 0: none. Not with frozen_fraction.
  std::int64_t lora_rank = 0;
};

// Safety margins kept free on each tier whose capacity comes from the machine
// (probed or given). A tier capped by a strata.budgets.* value has no margin:
// the budget is already the amount the engine may hold.
struct PlanMargins {
  double gpu_fraction = 0.10;                    // of GPU memory (CUDA context, fragmentation)
  double ram_fraction = 0.10;                    // of CPU RAM
  std::uint64_t ram_reserve_bytes = 4ull << 30;  // plus this (OS, the framework process)
  double disk_fraction = 0.05;                   // of free disk space
};

// The swap drives' rated endurance, the same for each drive, for the SSD wear
// estimate (strata plan --drive-tbw, or --drive-dwpd with --drive-capacity
// and --warranty-years; --step-seconds).
struct DriveEndurance {
  // Rated terabytes written per drive (TBW, 1 TB = 1e12 B); > 0, or 0 to rate
  // it by dwpd instead.
  double tbw = 0.0;
  // Drive writes per day over the warranty: TBW = dwpd x capacity_bytes x 365
  // x warranty_years. Used when tbw is 0; all three > 0 then.
  double dwpd = 0.0;
  std::uint64_t capacity_bytes = 0;
  double warranty_years = 5.0;
  // Seconds per optimizer step, for days of training (the planner has no
  // step time estimate); 0: unknown, steps only.
  double step_seconds = 0.0;
  // The rated bytes written per drive.
  double rated_bytes() const;
};

struct PlanOptions {
  PlanMargins margins;
  // The search tries strata.optimizer_cpu_fraction = 0, step, 2 step, ...
  // below 1 for optimizer state on NVMe. In (0, 1].
  double cpu_fraction_step = 0.05;
  // Count checkpoint space (compute copies, master, moments) in the disk tier.
  bool include_checkpoint = true;
  // When set, the plan estimates the swap drives' wear (Plan::wear).
  std::optional<DriveEndurance> drive;
  // Data-parallel ranks (docs/distributed.md) on `nodes` machines, ranks /
  // nodes on each (strata plan --ranks N --nodes M): the plan is one rank's
  // (its shard of the optimizer state and host gradients, whole compute
  // copies), and each machine's RAM and disk are shared by its ranks.
  int ranks = 1;
  int nodes = 1;
};

// Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
// Transformer Models", section 4: one block keeps s b h (34 + 5 a s / h) bytes
// of 16-bit activations for backward (written here as s b (34 h + 5 a s)).
// With full checkpointing each block keeps only its 16-bit input, 2 s b h,
// plus one block's full activations while it is recomputed. The output
// logits add 4 s b V (fp32, for the loss). fp32 compute doubles the 16-bit
// terms (approximate: dropout masks stay 1 B).
struct ActivationEstimate {
  std::uint64_t full_layer_bytes = 0;  // s b (34 h + 5 a s) x c / 2
  std::uint64_t kept_layer_bytes = 0;  // per layer held until backward
  std::uint64_t layers_bytes = 0;      // all layers (and the recompute buffer)
  std::uint64_t logits_bytes = 0;      // 4 s b V
  std::uint64_t total_bytes = 0;       // layers_bytes + logits_bytes
};

// Errors: kInvalidArgument when an argument is not positive or the result
// overflows 64 bits.
core::Result<ActivationEstimate> estimate_activations(
    std::int64_t num_layers, std::int64_t hidden_size, std::int64_t num_heads,
    std::int64_t vocab_size, std::int64_t seq_len, std::int64_t micro_batch,
    bool activation_checkpointing, int compute_bytes);

// Parameters of a GPT-style decoder with tied embeddings and no learned
// position embeddings: L (12 h^2 + 13 h) + V h + 2 h. Per block: attention
// QKV 3h^2 + 3h and output h^2 + h, MLP (4h) h^2 + 4h and 4h^2 + h, two layer
// norms 4h; then the embedding V h and the final layer norm 2h.
// kInvalidArgument when an argument is not positive or on overflow.
core::Result<std::int64_t> transformer_num_params(std::int64_t num_layers, std::int64_t hidden_size,
                                                  std::int64_t vocab_size);

// Parses a count: "40000000000", "40e9", "1.5e9", "40B" (billion), "7M",
// "125K", "1T" (case-insensitive, decimal). A leading '-' is accepted so the
// caller can say "must be positive". False unless the value is integral and
// fits in 63 bits.
bool parse_count(std::string_view text, std::int64_t* out);

// The swap directories the planner measures: strata.io.paths when set, else
// the distinct nvme_paths of offload_optimizer and offload_param, whether or
// not they are on nvme now (the search may move state there). Unlike
// Config::swap_paths(), never empty.
std::vector<std::string> plan_swap_paths(const Config& config);

// Where the state goes.
struct Placement {
  OffloadDevice param_device = OffloadDevice::kNone;      // offload_param.device
  OffloadDevice optimizer_device = OffloadDevice::kNone;  // offload_optimizer.device
  double optimizer_ratio = 1.0;         // offload_optimizer.ratio (share updated on the CPU)
  double optimizer_cpu_fraction = 0.0;  // strata.optimizer_cpu_fraction (with nvme)
};

// One line of the plan: a state or buffer in one tier.
struct PlanItem {
  // Stable key: compute_copies, persistent_params, fetch_window,
  // device_gradient_buffers, host_gradients, gradient_staging,
  // optimizer_compute_view, master_weights, optimizer_moments,
  // optimizer_device_buffers, optimizer_device_copies, optimizer_staging,
  // param_staging, compute_copies_in_cpu (offload_param.max_in_cpu),
  // speculative_state, speculative_compute_copies,
  // delayed_compute_copies, activations, logits, swap_reserve, checkpoint,
  // rank_gradient_sums or device_gradient_sums, rank_compute_gather,
  // rank_fetch_gather or device_fetch_gather with rank_read_gather (several
  // ranks).
  std::string name;
  Tier tier = Tier::kDevice;
  std::uint64_t size_bytes = 0;
  std::string detail;  // how it was computed: "40,000,000,000 x 2 B (bf16)"
};

struct TierPlan {
  Tier tier = Tier::kDevice;
  std::uint64_t needed_bytes = 0;     // sum of the tier's items
  std::uint64_t capacity_bytes = 0;   // machine capacity, capped by the tier's budget
  std::uint64_t margin_bytes = 0;     // kept free (PlanMargins); 0 when a budget caps the tier
  std::uint64_t available_bytes = 0;  // capacity_bytes - margin_bytes
  bool fits = false;                  // needed_bytes <= available_bytes
  std::string capacity_source;        // where capacity_bytes came from
};

// Bytes moved per optimizer step.
struct StepTraffic {
  std::uint64_t host_to_device_bytes = 0;
  std::uint64_t device_to_host_bytes = 0;
  std::uint64_t disk_read_bytes = 0;
  std::uint64_t disk_write_bytes = 0;
  // Of disk_read_bytes, the frozen parameters' compute copies read from the
  // safetensors files they were imported from (strata.frozen_base): reads
  // of the drive outside the swap files, no wear.
  std::uint64_t file_read_bytes = 0;
  // With several ranks: what the rank sends over the collectives per step (it
  // receives as much): (N-1)/N of each micro-batch's fp32 gradients
  // (reduce-scatter) and of the new compute copies (all-gather), the norm
  // partials aside. The same for every placement: not in total_bytes().
  std::uint64_t network_bytes = 0;
  std::uint64_t total_bytes() const {
    return host_to_device_bytes + device_to_host_bytes + disk_read_bytes + disk_write_bytes;
  }
  std::uint64_t disk_bytes() const { return disk_read_bytes + disk_write_bytes; }
};

// One placement evaluated.
struct PlacementPlan {
  Placement placement;
  std::vector<PlanItem> items;
  std::array<TierPlan, kNumTiers> tiers;  // indexed by Tier
  StepTraffic traffic;
  bool fits = false;                 // every tier fits
  std::vector<std::string> reasons;  // one per tier that does not fit
  // Ranks sharing a machine's RAM and disk (PlanOptions): the items and
  // traffic are one rank's; the machine holds and writes this many times
  // theirs in pinned memory and on disk.
  int ranks_per_node = 1;

  const TierPlan& tier(Tier t) const { return tiers[static_cast<int>(t)]; }
  // Sum of the items called `name` in tier `t` (0 when none).
  std::uint64_t item_bytes(Tier t, std::string_view name) const;
};

// The model after defaults and derivations.
struct ModelSummary {
  std::int64_t num_params = 0;
  std::int64_t num_trainable_params = 0;
  std::int64_t num_frozen_params = 0;
  std::int64_t num_layers = 0;
  bool has_shape = false;  // a transformer shape was given
  std::int64_t hidden_size = 0;
  std::int64_t vocab_size = 0;
  std::int64_t num_heads = 0;
  std::int64_t seq_len = 0;
  std::int64_t micro_batch = 0;
  bool activation_checkpointing = true;
  double frozen_fraction = 0.0;
  std::int64_t lora_rank = 0;
  // Every group holds trainable parameters beside frozen ones (LoRA): its
  // trainable part (num_trainable_params / num_layers) is what a step's
  // gradients and new compute copies move; else groups are wholly
  // trainable or wholly frozen.
  bool mixed_groups = false;
  std::int64_t group_params = 0;                  // largest fetch group
  std::int64_t persistent_params = 0;             // kept on the GPU when parameters are offloaded
  std::optional<ActivationEstimate> activations;  // nullopt without a transformer shape
};

// A config key to change to get the recommended placement.
struct ConfigChange {
  std::string key_path;  // "zero_optimization.offload_param.device"
  std::string from;      // "\"cpu\"" (JSON text)
  std::string to;        // "\"nvme\""
};

// Bytes per parameter of each state under the config (DESIGN.md section 1).
struct StateSizes {
  std::string precision;            // "bf16", "fp16", "fp32"
  std::string optimizer;            // "AdamW", "Adam", "Adagrad", "Lion"
  std::uint64_t compute_bytes = 2;  // per parameter: 2 (bf16/fp16), 4 (fp32)
  std::uint64_t gradient_bytes =
      2;                           // per trainable parameter: compute_bytes, or 4 with accumulation or ranks
  std::uint64_t master_bytes = 4;  // per trainable parameter (fp32)
  double moment_bytes = 8;  // per trainable parameter: Adam(W) 8 (bf16: 4; int8_blockwise: 2.03125), Adagrad 4, Lion 4
  std::string moment_format = "fp32";  // strata.optimizer_state.format: "fp32", "bf16", "int8_blockwise"
  std::int64_t gradient_accumulation_steps = 1;
};

// One swap drive's share of a placement's writes. The swap store stripes
// blocks over the swap paths evenly, so each path takes 1/N of the bytes
// written per step; paths on one file system (as probed) are one drive.
struct DriveWear {
  std::vector<std::string> paths;       // the swap paths on this drive
  std::uint64_t write_bytes_per_step = 0;
  std::optional<std::uint64_t> steps;   // whole steps until the rated bytes are written; nullopt: no writes
  std::optional<double> days;           // steps x step_seconds / 86400; nullopt without a step time or writes
};

// What a placement writes to the swap drives per step and how long they last.
struct PlacementWear {
  Placement placement;
  std::vector<ConfigChange> changes;  // from the configured placement (empty for the configured one)
  bool fits = false;                  // the placement fits this machine (PlacementPlan::fits)
  std::vector<std::string> reasons;   // why not, one per tier that does not fit
  std::uint64_t write_bytes_per_step = 0;  // all of a machine's drives (its ranks' StepTraffic::disk_write_bytes)
  std::vector<DriveWear> drives;      // empty when nothing lives on nvme
  std::optional<std::uint64_t> steps; // the drive that wears first; nullopt: no writes
  std::optional<double> days;
};

// The swap drives' wear (PlanOptions::drive): the configured placement's, and
// the placement changes that write less per step, each evaluated by the
// planner: strata.optimizer_cpu_fraction raised as far as pinned memory
// allows, the optimizer state in pinned memory (offload_optimizer.device
// cpu), the compute copies in pinned memory (offload_param.device cpu, with
// the largest cpu fraction that still fits), and the placement of the search
// that writes least while fitting.
struct WearPlan {
  DriveEndurance drive;
  double rated_bytes_per_drive = 0.0;
  std::string rating;  // "600 TBW", "1 DWPD x 3.84 TB x 5 years = 7008 TBW"
  PlacementWear configured;
  // Placements that write less than the configured one: those that fit first,
  // fewest bytes written per step first; then those that do not fit.
  std::vector<PlacementWear> alternatives;
};

// The configured placement under one optimizer state format
// (strata.optimizer_state.format), evaluated as the config's own: what it
// needs per tier, what it moves per step and, with a drive rating, how long
// the swap drives last.
struct FormatPlan {
  std::string format;        // "fp32", "bf16", "int8_blockwise"
  double state_bytes = 12;   // per trainable parameter: the fp32 master and the moments
  PlacementPlan plan;
  std::optional<PlacementWear> wear;  // with PlanOptions::drive
};

struct Plan {
  int ranks = 1, nodes = 1;  // PlanOptions': the items are one rank's of `ranks`
  ModelSummary model;
  StateSizes state;
  MachineSpec machine;
  PlacementPlan configured;  // the placement the config asks for
  // Every (param device, optimizer device) pair, params none/cpu/nvme outer,
  // optimizer none/cpu/nvme inner. An nvme optimizer shows the largest
  // fraction that fits, or fraction 0 when none does.
  std::vector<PlacementPlan> candidates;
  // Set when the configured placement does not fit and one does, or when one
  // fits that moves fewer bytes per step: the fitting placement with the
  // fewest bytes moved per step (ties: fewer disk bytes, then search order).
  std::optional<PlacementPlan> recommended;
  std::vector<ConfigChange> changes;  // config keys to set for `recommended`
  std::vector<std::string> notes;     // assumptions and warnings, one sentence each
  std::optional<WearPlan> wear;       // with PlanOptions::drive
  // The configured placement under each state format the optimizer takes
  // (fp32 first; Adam and AdamW also bf16), the configured format among them.
  std::vector<FormatPlan> formats;
  bool fits() const { return configured.fits; }
};

// Plans `model` under `config` on `machine`. Errors (kInvalidArgument) name
// the field and its flag or the config key path: a non-positive or missing
// size, num_layers > num_params, frozen_fraction outside [0, 1], both
// num_params and a transformer shape, an optimizer ratio outside (0, 1], an
// unknown GPU size with no strata.budgets.device (kFailedPrecondition: says
// to pass --gpu-memory or set the budget), a drive rating that is not
// positive and finite (naming its flag).
core::Result<Plan> make_plan(const Config& config, const ModelSpec& model,
                             const MachineSpec& machine, const PlanOptions& options = {});

// A readable, aligned table of the plan with byte units and the reasons.
std::string format_plan_table(const Plan& plan);

// The plan as a JSON object (bytes as integers).
std::string plan_to_json(const Plan& plan);

}  // namespace strata::engine
