// What a step reports (Engine::step_end's StepStats) and the bytes it moves.
// Public through engine/engine.h.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::engine {

// Swap traffic of one swap path (Config::swap_paths()[i]: a strata.io.paths
// entry, or the placement's nvme_path).
struct SwapPathBytes {
  std::uint64_t read = 0;
  std::uint64_t written = 0;
  friend bool operator==(const SwapPathBytes&, const SwapPathBytes&) = default;
};

// Bytes moved in one step, per tier and direction.
struct StepBytes {
  std::uint64_t h2d = 0;         // host -> device copies
  std::uint64_t d2h = 0;         // device -> host copies
  std::uint64_t nvme_read = 0;   // swap reads
  std::uint64_t nvme_write = 0;  // swap writes
  // Frozen parameters read from the safetensors files they were imported
  // from (strata.frozen_base): reads of the drive outside the swap paths.
  std::uint64_t file_read = 0;
  // nvme_read and nvme_write by swap path (element i: Config::swap_paths()[i]),
  // each block's bytes where its extents lie (nvme::SwapStore::path_bytes):
  // the reads add up to nvme_read, the writes to nvme_write. Shorter than the
  // path list (empty) while nothing moved on the later paths.
  std::vector<SwapPathBytes> nvme_paths = {};
  friend bool operator==(const StepBytes&, const StepBytes&) = default;
  StepBytes& operator+=(const StepBytes& o) {
    h2d += o.h2d;
    d2h += o.d2h;
    nvme_read += o.nvme_read;
    nvme_write += o.nvme_write;
    file_read += o.file_read;
    if (nvme_paths.size() < o.nvme_paths.size()) nvme_paths.resize(o.nvme_paths.size());
    for (std::size_t i = 0; i < o.nvme_paths.size(); ++i) {
      nvme_paths[i].read += o.nvme_paths[i].read;
      nvme_paths[i].written += o.nvme_paths[i].written;
    }
    return *this;
  }
  // A swap block read or written: per_path[i] of its bytes on path i.
  void add_nvme_read(std::span<const std::uint64_t> per_path) { add_nvme(per_path, &SwapPathBytes::read, nvme_read); }
  void add_nvme_write(std::span<const std::uint64_t> per_path) {
    add_nvme(per_path, &SwapPathBytes::written, nvme_write);
  }

 private:
  void add_nvme(std::span<const std::uint64_t> per_path, std::uint64_t SwapPathBytes::*field, std::uint64_t& total) {
    if (nvme_paths.size() < per_path.size()) nvme_paths.resize(per_path.size());
    for (std::size_t i = 0; i < per_path.size(); ++i) {
      nvme_paths[i].*field += per_path[i];
      total += per_path[i];
    }
  }
};

// Where the CPU optimizer's threads run (strata.cpu_adam.bind, .numa_node),
// as finalize chose them: the same for every step.
struct CpuThreads {
  int threads = 0;       // threads of a CPU optimizer pass, the calling thread among them
  bool pinned = false;   // the worker threads are pinned, one per physical core
  int numa_node = -1;    // the NUMA node (the OS's number) whose cores were chosen; -1: none or several
  // The node the pinned memory was placed on (its GPU's with several local
  // ranks, or strata.cpu_adam.numa_node, on a machine of several nodes); -1:
  // not placed (where the allocating thread first touched it).
  int pinned_memory_node = -1;
  std::string description;  // one line saying the above, the CPUs and why not pinned
};

struct StepStats {
  std::int64_t step = 0;       // applied optimizer steps so far
  bool skipped = false;        // overflow (fp16) or non-finite gradients (bf16/fp32)
  std::int64_t skipped_total = 0;
  double grad_norm = 0.0;      // of the unscaled, averaged gradient (before clipping)
  double lr = 0.0;             // of optimizer group 0 for this step
  double loss_scale = 1.0;     // for the next step
  StepBytes bytes;             // since the previous step_end
  // Bytes moved to and from each swap path (element i: Config::swap_paths()[i])
  // since the engine was created, as the I/O layer counted its completions
  // (nvme::SwapStore::traffic): every step's swap traffic, plus finalize's
  // initialisation of the swap files (zeroed moments, initial values),
  // checkpoint saves and loads, export and inspection (read_state). Whole
  // sectors: with O_DIRECT a block's last partial 4 KiB sector moves whole.
  // Taken at step_end: an optimizer job still running then (overlap "exact",
  // "delayed") adds to it later (Engine::swap_traffic is the live figure).
  // A resumed run starts again from zero: checkpoints do not carry it.
  // Empty when the engine has no swap store.
  std::vector<SwapPathBytes> nvme_total;
  // Seconds spent since the previous step_end, by stage.
  double fetch_s = 0.0;        // fetch: compute copies to the device
  double grads_s = 0.0;        // grads_ready: gradients down and the gradient pass
  double optimizer_s = 0.0;    // the optimizer and new compute copies home (overlap "exact":
                               // the previous step's, which ran during this one)
  std::int64_t prefetched = 0; // fetches served by a prefetched copy (traced prefetch)
  std::int64_t resident = 0;   // fetches served by a copy kept on the device since its release
  std::uint64_t resident_bytes = 0;  // the compute copies they did not move (not in `bytes`)
  // The swap reads those fetches did not make: the homes on nvme of their
  // groups (the rank's shard at stage 3 over ranks; a frozen part read from
  // its files aside).
  std::uint64_t resident_nvme_bytes = 0;
  // overlap "speculative": elements whose speculative update was thrown away
  // (the step was skipped, or clipping fired and they were updated again),
  // counted when the job that did the work ends.
  std::int64_t speculative_discarded = 0;
  // The step whose gradients grad_norm, skipped and lr describe, counting
  // every step_end (applied or skipped) from 1: this one, except under
  // overlap "delayed" without fp16 and without strata.nonfinite "error",
  // where a step's verdict is taken by its own optimizer job once its last
  // gradients are in, after step_end returned: there it is the step before
  // (0 for the first), and `step` and `skipped_total` count verdicts taken.
  std::int64_t norm_step = 0;
};


}  // namespace strata::engine
