// SSD wear: the bytes a placement writes per swap drive per step, how many steps
// and days the drives' rated endurance lasts, and the placement changes that
// write less (`strata plan --drive-tbw | --drive-dwpd`).
#include "engine/plan/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/str.h"
#include "engine/plan/plan_internal.h"

namespace strata::engine {
namespace {

using core::Status;
using core::str_cat;
using plan_detail::changes_for;
using plan_detail::evaluate;
using plan_detail::grid_fraction;
using plan_detail::Inputs;
using plan_detail::invalid;

// The swap paths a placement writes to, as the engine picks them
// (Config::swap_paths(), for this placement): strata.io.paths, else the
// nvme_paths of the devices on nvme. Empty when nothing is on nvme.
std::vector<std::string> placement_swap_paths(const Config& config, const Placement& p) {
  const bool optimizer_nvme = p.optimizer_device == OffloadDevice::kNvme;
  const bool param_nvme = p.param_device == OffloadDevice::kNvme;
  if (!optimizer_nvme && !param_nvme) return {};
  if (!config.strata.io.paths.empty()) return config.strata.io.paths;
  std::vector<std::string> out;
  if (optimizer_nvme) out.push_back(config.zero.offload_optimizer.nvme_path);
  if (param_nvme && std::find(out.begin(), out.end(), config.zero.offload_param.nvme_path) == out.end()) {
    out.push_back(config.zero.offload_param.nvme_path);
  }
  return out;
}

// Whole steps until `rated` bytes are written at `bytes` per step (double
// arithmetic, as a reader checking the plan would do it).
std::uint64_t steps_until(double rated, std::uint64_t bytes) {
  const double steps = std::floor(rated / static_cast<double>(bytes));
  return steps >= 1.8e19 ? std::numeric_limits<std::uint64_t>::max() : static_cast<std::uint64_t>(steps);
}

std::optional<double> days_of(std::uint64_t steps, double step_seconds) {
  if (step_seconds <= 0.0) return std::nullopt;
  return static_cast<double>(steps) * step_seconds / 86400.0;
}

bool same_placement(const Placement& a, const Placement& b) {
  return a.param_device == b.param_device && a.optimizer_device == b.optimizer_device &&
         a.optimizer_ratio == b.optimizer_ratio &&
         (a.optimizer_device != OffloadDevice::kNvme || a.optimizer_cpu_fraction == b.optimizer_cpu_fraction);
}

// With the optimizer on nvme: the largest cpu fraction on the search's grid
// above `from` under which `p` fits; else the next one above `from` (which
// does not fit: its reasons say why); nullopt when none is above.
std::optional<Placement> raised_fraction(const Inputs& in, Placement p, double from, int steps, double step) {
  std::optional<Placement> next;
  for (int k = steps - 1; k >= 0; --k) {
    const double f = grid_fraction(k, step);
    if (f <= from) break;
    p.optimizer_cpu_fraction = f;
    if (evaluate(in, p).fits) return p;
    next = p;
  }
  return next;
}

}  // namespace

namespace plan_detail {

// A placement's writes per swap drive and how long the drives last. Each
// swap path takes an even share of the bytes written per step (the swap store
// stripes blocks over the paths; the remainder goes to the first paths);
// paths on one file system (the probe's device ids) are one drive.
PlacementWear placement_wear(const Config& config, const MachineSpec& machine, const PlacementPlan& pp,
                             double rated, double step_seconds) {
  PlacementWear w;
  w.placement = pp.placement;
  w.changes = changes_for(config, pp.placement);
  w.fits = pp.fits;
  w.reasons = pp.reasons;
  // The machine's ranks write to the same drives.
  w.write_bytes_per_step = plan_detail::sat_mul(pp.traffic.disk_write_bytes, static_cast<std::uint64_t>(pp.ranks_per_node));
  const std::vector<std::string> paths = placement_swap_paths(config, pp.placement);
  if (paths.empty()) return w;
  // Per drive: the file system's device id, as probed (nullopt: not probed, a drive of its own).
  std::vector<std::optional<std::uint64_t>> drive_ids;
  const std::uint64_t n = paths.size();
  for (std::size_t i = 0; i < paths.size(); ++i) {
    std::optional<std::uint64_t> id;
    for (const DiskSpace& d : machine.disks) {
      if (d.path == paths[i]) id = d.device_id;
    }
    std::size_t drive = w.drives.size();
    for (std::size_t k = 0; id && k < drive_ids.size(); ++k) {
      if (drive_ids[k] == id) drive = k;
    }
    if (drive == w.drives.size()) {
      w.drives.emplace_back();
      drive_ids.push_back(id);
    }
    const std::uint64_t total = w.write_bytes_per_step;
    w.drives[drive].paths.push_back(paths[i]);
    w.drives[drive].write_bytes_per_step += total / n + (i < total % n ? 1 : 0);
  }
  for (DriveWear& d : w.drives) {
    if (d.write_bytes_per_step == 0) continue;
    d.steps = steps_until(rated, d.write_bytes_per_step);
    d.days = days_of(*d.steps, step_seconds);
    if (!w.steps || *d.steps < *w.steps) {
      w.steps = d.steps;
      w.days = d.days;
    }
  }
  return w;
}

// `fitting`: every placement of the search that fits (Plan's search below).
core::Result<WearPlan> plan_wear(const Inputs& in, const Plan& plan, const DriveEndurance& drive, int steps,
                                 const std::vector<PlacementPlan>& fitting) {
  const Config& config = in.config;
  auto positive = [](double v) { return std::isfinite(v) && v > 0.0; };
  if (drive.tbw != 0.0 && drive.dwpd != 0.0) {
    return invalid("give the drives' rated endurance either as TBW (--drive-tbw) or as DWPD (--drive-dwpd with "
                   "--drive-capacity), not both");
  }
  WearPlan w;
  w.drive = drive;
  if (drive.tbw != 0.0) {
    if (!positive(drive.tbw)) return invalid(str_cat("--drive-tbw must be a positive number of TB, got ", drive.tbw));
    w.rated_bytes_per_drive = drive.tbw * 1e12;
    w.rating = str_cat(number_text(drive.tbw), " TBW per drive");
  } else {
    if (!positive(drive.dwpd)) return invalid(str_cat("--drive-dwpd must be a positive number, got ", drive.dwpd));
    if (drive.capacity_bytes == 0) return invalid("--drive-dwpd needs the drive's capacity (--drive-capacity SIZE)");
    if (!positive(drive.warranty_years)) {
      return invalid(str_cat("--warranty-years must be a positive number, got ", drive.warranty_years));
    }
    w.rated_bytes_per_drive = drive.dwpd * static_cast<double>(drive.capacity_bytes) * 365.0 * drive.warranty_years;
    w.rating = str_cat(number_text(drive.dwpd), " DWPD x ", number_text(static_cast<double>(drive.capacity_bytes) / 1e12),
                       " TB x 365 days x ", number_text(drive.warranty_years), " years = ",
                       number_text(w.rated_bytes_per_drive / 1e12), " TBW per drive");
  }
  if (drive.step_seconds != 0.0 && !positive(drive.step_seconds)) {
    return invalid(str_cat("--step-seconds must be a positive number, got ", drive.step_seconds));
  }
  const double rated = w.rated_bytes_per_drive;
  w.configured = placement_wear(config, plan.machine, plan.configured, rated, drive.step_seconds);

  // The placement changes, each evaluated here (never guessed).
  const Placement& c = plan.configured.placement;
  const double step = in.options.cpu_fraction_step;
  std::vector<Placement> tries;
  if (c.optimizer_device == OffloadDevice::kNvme) {
    if (auto p = raised_fraction(in, c, c.optimizer_cpu_fraction, steps, step)) tries.push_back(*p);
    Placement cpu = c;
    cpu.optimizer_device = OffloadDevice::kCpu;
    cpu.optimizer_cpu_fraction = 0.0;
    tries.push_back(cpu);
  }
  if (c.param_device == OffloadDevice::kNvme) {
    Placement p = c;
    p.param_device = OffloadDevice::kCpu;
    if (c.optimizer_device == OffloadDevice::kNvme) {
      if (auto raised = raised_fraction(in, p, c.optimizer_cpu_fraction, steps, step); raised && evaluate(in, *raised).fits) {
        p = *raised;
      }
    }
    tries.push_back(p);
  }
  // The search's placement that writes least while fitting (ties: fewer bytes
  // moved, then search order).
  const PlacementPlan* least = nullptr;
  for (const PlacementPlan& e : fitting) {
    const StepTraffic& t = e.traffic;
    if (least == nullptr || t.disk_write_bytes < least->traffic.disk_write_bytes ||
        (t.disk_write_bytes == least->traffic.disk_write_bytes && t.total_bytes() < least->traffic.total_bytes())) {
      least = &e;
    }
  }
  if (least) tries.push_back(least->placement);
  for (const Placement& p : tries) {
    if (same_placement(p, c)) continue;
    bool seen = false;
    for (const PlacementWear& a : w.alternatives) seen = seen || same_placement(a.placement, p);
    if (seen) continue;
    const PlacementPlan e = evaluate(in, p);
    if (e.traffic.disk_write_bytes >= plan.configured.traffic.disk_write_bytes) continue;
    w.alternatives.push_back(placement_wear(config, plan.machine, e, rated, drive.step_seconds));
  }
  std::stable_sort(w.alternatives.begin(), w.alternatives.end(), [](const PlacementWear& a, const PlacementWear& b) {
    if (a.fits != b.fits) return a.fits;
    return a.write_bytes_per_step < b.write_bytes_per_step;
  });
  return w;
}

}  // namespace plan_detail

double DriveEndurance::rated_bytes() const {
  return tbw != 0.0 ? tbw * 1e12 : dwpd * static_cast<double>(capacity_bytes) * 365.0 * warranty_years;
}

}  // namespace strata::engine
