// The planner's output: an aligned text table and a JSON document (written
// with nlohmann::ordered_json, members in the order below).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/str.h"
#include "engine/plan/plan_internal.h"
#include "engine/plan/plan.h"

namespace strata::engine {
namespace {

using core::format_bytes;
using core::str_cat;

// --- text ---------------------------------------------------------------------

enum class Align { kLeft, kRight };

// Rows of cells printed with each column padded to its widest cell.
class TextTable {
 public:
  explicit TextTable(std::vector<Align> align) : align_(std::move(align)) {}
  void row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  std::string render(std::string_view indent) const {
    std::vector<std::size_t> width(align_.size(), 0);
    for (const auto& r : rows_) {
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) {
        width[i] = std::max(width[i], r[i].size());
      }
    }
    std::string out;
    for (const auto& r : rows_) {
      std::string line(indent);
      for (std::size_t i = 0; i < r.size() && i < width.size(); ++i) {
        const std::string pad(width[i] - r[i].size(), ' ');
        const bool last = i + 1 == r.size();
        if (i > 0) line += "  ";
        if (align_[i] == Align::kRight) {
          line += pad + r[i];
        } else {
          line += last ? r[i] : r[i] + pad;  // no trailing blanks
        }
      }
      out += line + "\n";
    }
    return out;
  }

 private:
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;
};

std::string traffic_line(const StepTraffic& t) {
  return str_cat("host->device ", format_bytes(t.host_to_device_bytes), ", device->host ",
                 format_bytes(t.device_to_host_bytes), ", disk read ",
                 format_bytes(t.disk_read_bytes),
                 t.file_read_bytes > 0 ? str_cat(" (", format_bytes(t.file_read_bytes), " of it the frozen base from its files)")
                                       : std::string(),
                 ", disk write ", format_bytes(t.disk_write_bytes),
                 "; total ", format_bytes(t.total_bytes()),
                 t.network_bytes > 0 ? str_cat("; collectives ", format_bytes(t.network_bytes), " sent (as much received)")
                                     : std::string());
}

std::string device_cell(OffloadDevice d) {
  return d == OffloadDevice::kNone ? "gpu" : std::string(offload_device_key(d));
}

void append_placement(const PlacementPlan& p, std::string* out) {
  TextTable items({Align::kLeft, Align::kLeft, Align::kRight, Align::kLeft});
  items.row({"tier", "state", "bytes", "how"});
  for (Tier tier : kAllTiers) {
    for (const PlanItem& item : p.items) {
      if (item.tier != tier) continue;
      items.row({std::string(tier_label(tier)), std::string(item_label(item.name)),
                 format_bytes(item.size_bytes), item.detail});
    }
  }
  *out += items.render("  ");
  *out += "\n";
  TextTable tiers({Align::kLeft, Align::kRight, Align::kRight, Align::kRight, Align::kRight,
                   Align::kLeft, Align::kLeft});
  tiers.row({"tier", "needed", "capacity", "margin", "available", "fits", "capacity from"});
  for (const TierPlan& t : p.tiers) {
    tiers.row({std::string(tier_label(t.tier)), format_bytes(t.needed_bytes),
               format_bytes(t.capacity_bytes), format_bytes(t.margin_bytes),
               format_bytes(t.available_bytes), t.fits ? "yes" : "NO", t.capacity_source});
  }
  *out += tiers.render("  ");
  if (p.ranks_per_node > 1) {
    // What the machine holds for all its ranks.
    *out += str_cat("\n  the machine's ", p.ranks_per_node, " ranks: CPU RAM ",
                    format_bytes(p.tier(Tier::kPinned).needed_bytes * static_cast<std::uint64_t>(p.ranks_per_node)),
                    ", NVMe/disk ",
                    format_bytes(p.tier(Tier::kNvme).needed_bytes * static_cast<std::uint64_t>(p.ranks_per_node)),
                    ", disk written per step ",
                    format_bytes(p.traffic.disk_write_bytes * static_cast<std::uint64_t>(p.ranks_per_node)), "\n");
  }
  *out += str_cat("\n  moved per step: ", traffic_line(p.traffic), "\n");
  for (const std::string& r : p.reasons) *out += str_cat("  does not fit: ", r, "\n");
}

// "0.74", "12.3", "1071": days at a precision that reads.
std::string days_text(double d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, d >= 100.0 ? "%.0f" : d >= 10.0 ? "%.1f" : "%.2f", d);
  return buf;
}

std::string changes_text(const std::vector<ConfigChange>& changes) {
  std::string s;
  for (const ConfigChange& ch : changes) s += str_cat(s.empty() ? "" : "; ", ch.key_path, " = ", ch.to);
  return s.empty() ? std::string("(no key changes)") : s;
}

std::string lasts_text(const PlacementWear& w, double step_seconds) {
  if (!w.steps) return "no swap writes: the drives do not wear from training";
  std::string s = str_cat(group_digits(*w.steps), " steps");
  if (w.days) s += str_cat(", ", days_text(*w.days), " days at ", number_text(step_seconds), " s per step");
  return s;
}

// The configured placement under each optimizer state format.
void append_formats(const Plan& plan, std::string* out) {
  *out += str_cat("\noptimizer state formats (strata.optimizer_state.format; now ", plan.state.moment_format,
                  "), the configured placement under each:\n");
  TextTable t({Align::kLeft, Align::kRight, Align::kRight, Align::kRight, Align::kRight, Align::kRight,
               Align::kRight, Align::kLeft, Align::kRight});
  t.row({"format", "state/param", "GPU", "CPU RAM", "NVMe/disk", "disk read/step", "disk write/step", "fits",
         plan.wear ? "drives last" : ""});
  for (const FormatPlan& f : plan.formats) {
    const PlacementPlan& p = f.plan;
    std::string lasts;
    if (f.wear) {
      lasts = f.wear->steps ? str_cat(group_digits(*f.wear->steps), " steps") : std::string("no writes");
      if (f.wear->days) lasts += str_cat(" (", days_text(*f.wear->days), " days)");
    }
    t.row({f.format, str_cat(f.state_bytes, " B"), format_bytes(p.tier(Tier::kDevice).needed_bytes),
           format_bytes(p.tier(Tier::kPinned).needed_bytes), format_bytes(p.tier(Tier::kNvme).needed_bytes),
           format_bytes(p.traffic.disk_read_bytes), format_bytes(p.traffic.disk_write_bytes), p.fits ? "yes" : "no",
           lasts});
  }
  *out += t.render("  ");
}

void append_wear(const WearPlan& w, std::string* out) {
  const double step_s = w.drive.step_seconds;
  *out += str_cat("\nSSD wear: ", w.rating,
                  w.drive.tbw != 0.0 ? " (--drive-tbw)" : " (--drive-dwpd, --drive-capacity, --warranty-years)",
                  step_s > 0.0 ? str_cat("; ", number_text(step_s), " s per step (--step-seconds)") : std::string(),
                  "\n");
  const PlacementWear& c = w.configured;
  *out += str_cat("  configured placement (", describe_placement(c.placement), ") writes ",
                  format_bytes(c.write_bytes_per_step), " per step to the swap drives",
                  c.fits ? "" : " (it does not fit this machine)", "\n");
  if (!c.drives.empty()) {
    TextTable drives({Align::kLeft, Align::kLeft, Align::kRight, Align::kRight, Align::kRight});
    drives.row({"drive", "swap paths", "written/step", "steps to rated", "days"});
    for (std::size_t i = 0; i < c.drives.size(); ++i) {
      const DriveWear& d = c.drives[i];
      std::string paths;
      for (const std::string& p : d.paths) paths += str_cat(paths.empty() ? "" : ", ", p);
      drives.row({std::to_string(i + 1), paths, format_bytes(d.write_bytes_per_step),
                  d.steps ? group_digits(*d.steps) : "-", d.days ? days_text(*d.days) : "-"});
    }
    *out += drives.render("    ");
  }
  *out += str_cat("  the drives last ", lasts_text(c, step_s), "\n");
  if (step_s <= 0.0 && c.steps) {
    *out += "  days: give --step-seconds S (the planner has no step time estimate)\n";
  }
  if (!c.steps) return;
  if (w.alternatives.empty()) {
    *out += "  no placement change writes less\n";
    return;
  }
  *out += "  placement changes that write less (each evaluated by the planner; bytes per step over all drives):\n";
  TextTable alts({Align::kLeft, Align::kLeft, Align::kRight, Align::kRight, Align::kRight});
  alts.row({"change", "fits", "written/step", "steps to rated", "days"});
  for (const PlacementWear& a : w.alternatives) {
    alts.row({changes_text(a.changes), a.fits ? "yes" : "no", format_bytes(a.write_bytes_per_step),
              a.steps ? group_digits(*a.steps) : "no writes", a.days ? days_text(*a.days) : "-"});
  }
  *out += alts.render("    ");
  for (const PlacementWear& a : w.alternatives) {
    if (a.fits) continue;
    *out += str_cat("    ", changes_text(a.changes), " does not fit:\n");
    for (const std::string& r : a.reasons) *out += str_cat("      ", r, "\n");
  }
  const PlacementWear& best = w.alternatives.front();
  if (best.fits) {
    *out += str_cat("  writes least while fitting: ", changes_text(best.changes), " (", describe_placement(best.placement),
                    "): ", format_bytes(best.write_bytes_per_step), " per step, ", lasts_text(best, step_s), "\n");
  } else {
    *out += "  none of them fits this machine: the configured placement writes least of those that fit\n";
  }
}

// --- JSON ---------------------------------------------------------------------

using Json = nlohmann::ordered_json;

// A fraction as the plan shows it: 10 significant digits; integral values as
// integers (1, not 1.0).
Json number(double v) {
  if (!std::isfinite(v)) return nullptr;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  const double rounded = std::strtod(buf, nullptr);
  if (rounded == std::trunc(rounded) && std::fabs(rounded) < 9e15) return static_cast<std::int64_t>(rounded);
  return rounded;
}

// A ConfigChange value: JSON text by contract ("3", "\"nvme\"", "0.05"); kept
// as a string should it not parse.
Json json_value(const std::string& text) {
  Json v = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return text;
  return v;
}

template <typename T>
Json optional_json(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

Json traffic_json(const StepTraffic& t) {
  return Json{{"host_to_device_bytes", t.host_to_device_bytes},
              {"device_to_host_bytes", t.device_to_host_bytes},
              {"disk_read_bytes", t.disk_read_bytes},
              {"disk_write_bytes", t.disk_write_bytes},
              {"file_read_bytes", t.file_read_bytes},
              {"total_bytes", t.total_bytes()},
              {"network_bytes", t.network_bytes}};
}

Json placement_json(const PlacementPlan& p) {
  Json items = Json::array();
  for (const PlanItem& item : p.items) {
    items.push_back({{"name", item.name},
                     {"tier", tier_key(item.tier)},
                     {"bytes", item.size_bytes},
                     {"detail", item.detail}});
  }
  Json tiers = Json::object();
  for (const TierPlan& t : p.tiers) {
    tiers[std::string(tier_key(t.tier))] = {{"needed_bytes", t.needed_bytes},
                                            {"capacity_bytes", t.capacity_bytes},
                                            {"margin_bytes", t.margin_bytes},
                                            {"available_bytes", t.available_bytes},
                                            {"fits", t.fits},
                                            {"capacity_source", t.capacity_source}};
  }
  Json out = Json::object();
  out["param_device"] = offload_device_key(p.placement.param_device);
  out["optimizer_device"] = offload_device_key(p.placement.optimizer_device);
  out["optimizer_ratio"] = number(p.placement.optimizer_ratio);
  out["optimizer_cpu_fraction"] = number(p.placement.optimizer_cpu_fraction);
  out["fits"] = p.fits;
  out["ranks_per_node"] = p.ranks_per_node;
  out["items"] = std::move(items);
  out["tiers"] = std::move(tiers);
  out["bytes_per_step"] = traffic_json(p.traffic);
  out["reasons"] = p.reasons;
  return out;
}

Json model_json(const ModelSummary& m) {
  Json out = Json::object();
  out["num_params"] = m.num_params;
  out["num_trainable_params"] = m.num_trainable_params;
  out["num_frozen_params"] = m.num_frozen_params;
  out["num_layers"] = m.num_layers;
  out["frozen_fraction"] = number(m.frozen_fraction);
  out["lora_rank"] = m.lora_rank;
  out["mixed_groups"] = m.mixed_groups;
  out["group_params"] = m.group_params;
  out["persistent_params"] = m.persistent_params;
  out["seq_len"] = m.seq_len;
  out["micro_batch"] = m.micro_batch;
  out["activation_checkpointing"] = m.activation_checkpointing;
  out["transformer"] = nullptr;
  if (m.has_shape) {
    out["transformer"] = {
        {"hidden_size", m.hidden_size}, {"vocab_size", m.vocab_size}, {"num_heads", m.num_heads}};
  }
  out["activations"] = nullptr;
  if (m.activations) {
    const ActivationEstimate& a = *m.activations;
    out["activations"] = {{"full_layer_bytes", a.full_layer_bytes},
                          {"kept_layer_bytes", a.kept_layer_bytes},
                          {"layers_bytes", a.layers_bytes},
                          {"logits_bytes", a.logits_bytes},
                          {"total_bytes", a.total_bytes}};
  }
  return out;
}

Json state_json(const StateSizes& s) {
  return Json{{"precision", s.precision},
              {"optimizer", s.optimizer},
              {"compute_bytes", s.compute_bytes},
              {"gradient_bytes", s.gradient_bytes},
              {"master_bytes", s.master_bytes},
              {"moment_bytes", s.moment_bytes},
              {"moment_format", s.moment_format},
              {"gradient_accumulation_steps", s.gradient_accumulation_steps}};
}

template <typename T>
Json optional_number(const std::optional<T>& v) {
  if (!v) return nullptr;
  if constexpr (std::is_floating_point_v<T>) return number(*v);
  return Json(*v);
}

Json changes_json(const std::vector<ConfigChange>& changes) {
  Json out = Json::array();
  for (const ConfigChange& ch : changes) {
    out.push_back({{"key_path", ch.key_path}, {"from", json_value(ch.from)}, {"to", json_value(ch.to)}});
  }
  return out;
}

Json placement_wear_json(const PlacementWear& w) {
  Json drives = Json::array();
  for (const DriveWear& d : w.drives) {
    drives.push_back({{"paths", d.paths},
                      {"write_bytes_per_step", d.write_bytes_per_step},
                      {"steps", optional_number(d.steps)},
                      {"days", optional_number(d.days)}});
  }
  Json out = Json::object();
  out["param_device"] = offload_device_key(w.placement.param_device);
  out["optimizer_device"] = offload_device_key(w.placement.optimizer_device);
  out["optimizer_ratio"] = number(w.placement.optimizer_ratio);
  out["optimizer_cpu_fraction"] = number(w.placement.optimizer_cpu_fraction);
  out["changes"] = changes_json(w.changes);
  out["fits"] = w.fits;
  out["reasons"] = w.reasons;
  out["write_bytes_per_step"] = w.write_bytes_per_step;
  out["steps"] = optional_number(w.steps);
  out["days"] = optional_number(w.days);
  out["drives"] = std::move(drives);
  return out;
}

Json wear_json(const WearPlan& w) {
  Json alternatives = Json::array();
  for (const PlacementWear& a : w.alternatives) alternatives.push_back(placement_wear_json(a));
  const DriveEndurance& d = w.drive;
  Json out = Json::object();
  out["rating"] = w.rating;
  out["rated_bytes_per_drive"] = number(w.rated_bytes_per_drive);
  out["drive_tbw"] = d.tbw != 0.0 ? number(d.tbw) : Json(nullptr);
  out["drive_dwpd"] = d.tbw == 0.0 ? number(d.dwpd) : Json(nullptr);
  out["drive_capacity_bytes"] = d.tbw == 0.0 ? Json(d.capacity_bytes) : Json(nullptr);
  out["warranty_years"] = d.tbw == 0.0 ? number(d.warranty_years) : Json(nullptr);
  out["step_seconds"] = d.step_seconds > 0.0 ? number(d.step_seconds) : Json(nullptr);
  out["configured"] = placement_wear_json(w.configured);
  out["alternatives"] = std::move(alternatives);
  return out;
}

Json machine_json(const MachineSpec& m) {
  Json disks = Json::array();
  for (const DiskSpace& d : m.disks) {
    disks.push_back({{"path", d.path},
                     {"measured_at", d.measured_at},
                     {"free_bytes", d.free_bytes},
                     {"counted", d.counted}});
  }
  return Json{{"gpu_bytes", optional_json(m.gpu_bytes)},
              {"gpu_source", m.gpu_source},
              {"gpu_probe", m.gpu_probe},
              {"ram_bytes", m.ram_bytes},
              {"ram_source", m.ram_source},
              {"disk_bytes", m.disk_bytes},
              {"disk_source", m.disk_source},
              {"disks", std::move(disks)}};
}

}  // namespace

std::string format_plan_table(const Plan& plan) {
  const ModelSummary& m = plan.model;
  std::string out;
  out += str_cat("model    ", group_digits(static_cast<std::uint64_t>(m.num_params)),
                 " parameters (trainable ",
                 group_digits(static_cast<std::uint64_t>(m.num_trainable_params)), ", frozen ",
                 group_digits(static_cast<std::uint64_t>(m.num_frozen_params)),
                 m.lora_rank > 0 ? str_cat(": LoRA rank ", m.lora_rank, " in every layer") : std::string(), "), ",
                 m.num_layers, " layers");
  if (m.has_shape) {
    out += str_cat(", hidden ", m.hidden_size, ", vocab ", m.vocab_size, ", heads ", m.num_heads);
  }
  out += "\n";
  if (plan.ranks > 1) {
    out += str_cat("ranks    ", plan.ranks, " data-parallel ranks, ", plan.ranks / plan.nodes, " on each of ", plan.nodes,
                   plan.nodes == 1 ? " machine" : " machines", ": the bytes below are one rank's\n");
  }
  const StateSizes& st = plan.state;
  out += str_cat("state    ", st.precision, " compute copies ", st.compute_bytes, " B, gradients ",
                 st.gradient_bytes, " B (gradient_accumulation_steps ",
                 st.gradient_accumulation_steps, "), ", st.optimizer, ": fp32 master ",
                 st.master_bytes, " B + ", st.moment_format, " moments ", st.moment_bytes,
                 " B per trainable parameter\n");
  if (m.activations) {
    out += str_cat("         activations for seq ", m.seq_len, " x micro-batch ", m.micro_batch,
                   ", checkpointing ", m.activation_checkpointing ? "on" : "off", ": ",
                   format_bytes(m.activations->total_bytes), "\n");
  } else {
    out += "         activations: not estimated (no transformer shape)\n";
  }
  TextTable machine({Align::kLeft, Align::kRight, Align::kLeft});
  std::string gpu_from = plan.machine.gpu_source;
  if (!plan.machine.gpu_probe.empty()) gpu_from += str_cat("; ", plan.machine.gpu_probe);
  machine.row({"GPU", plan.machine.gpu_bytes ? format_bytes(*plan.machine.gpu_bytes) : "unknown",
               gpu_from});
  machine.row({"CPU RAM", format_bytes(plan.machine.ram_bytes), plan.machine.ram_source});
  machine.row({"NVMe/disk", format_bytes(plan.machine.disk_bytes), plan.machine.disk_source});
  out += "machine\n" + machine.render("  ");
  for (const DiskSpace& d : plan.machine.disks) {
    out += str_cat("    swap path ", d.path, ": ", format_bytes(d.free_bytes), " free at ",
                   d.measured_at,
                   d.counted ? "" : " (same file system as an earlier path: counted once)", "\n");
  }

  out += str_cat("\nconfigured placement: ", describe_placement(plan.configured.placement), ": ",
                 plan.configured.fits ? "FITS" : "DOES NOT FIT", "\n");
  append_placement(plan.configured, &out);

  out += "\nplacements searched (an nvme optimizer shows the largest cpu fraction that fits):\n";
  TextTable cand({Align::kLeft, Align::kLeft, Align::kRight, Align::kRight, Align::kRight,
                  Align::kRight, Align::kLeft});
  cand.row({"params", "optimizer", "GPU", "CPU RAM", "NVMe/disk", "moved/step", "fits"});
  for (const PlacementPlan& c : plan.candidates) {
    std::string opt = device_cell(c.placement.optimizer_device);
    if (c.placement.optimizer_device == OffloadDevice::kNvme) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " (cpu fraction %.6g)", c.placement.optimizer_cpu_fraction);
      opt += buf;
    }
    cand.row({device_cell(c.placement.param_device), opt,
              format_bytes(c.tier(Tier::kDevice).needed_bytes),
              format_bytes(c.tier(Tier::kPinned).needed_bytes),
              format_bytes(c.tier(Tier::kNvme).needed_bytes), format_bytes(c.traffic.total_bytes()),
              c.fits ? "yes" : "no"});
  }
  out += cand.render("  ");
  bool any_misfit = false;
  for (const PlacementPlan& c : plan.candidates) {
    if (c.fits) continue;
    if (!any_misfit) out += "why these do not fit:\n";
    any_misfit = true;
    out += str_cat("  ", describe_placement(c.placement), ":\n");
    for (const std::string& r : c.reasons) out += str_cat("    ", r, "\n");
  }

  out += "\n";
  if (plan.recommended) {
    const PlacementPlan& r = *plan.recommended;
    out += str_cat("recommended: ", describe_placement(r.placement), ": fits, moves ",
                   format_bytes(r.traffic.total_bytes()), " per step",
                   plan.configured.fits
                       ? str_cat(" (the configured placement moves ",
                                 format_bytes(plan.configured.traffic.total_bytes()), ")")
                       : std::string(" (the configured placement does not fit)"),
                   "\n");
    for (const ConfigChange& ch : plan.changes) {
      out += str_cat("  set ", ch.key_path, " = ", ch.to, " (now ", ch.from, ")\n");
    }
    out += str_cat("  GPU ", format_bytes(r.tier(Tier::kDevice).needed_bytes), ", CPU RAM ",
                   format_bytes(r.tier(Tier::kPinned).needed_bytes), ", NVMe/disk ",
                   format_bytes(r.tier(Tier::kNvme).needed_bytes),
                   "; moved per step: ", traffic_line(r.traffic), "\n");
  } else if (plan.configured.fits) {
    out +=
        "recommended: keep the configured placement (it fits; no placement that fits moves fewer "
        "bytes per step)\n";
  } else {
    out +=
        "recommended: nothing fits this machine; see the reasons above (a smaller model, more "
        "RAM or disk, or larger budgets)\n";
  }
  if (plan.wear) append_wear(*plan.wear, &out);
  if (plan.formats.size() > 1) append_formats(plan, &out);
  if (!plan.notes.empty()) {
    out += "\nnotes\n";
    for (const std::string& n : plan.notes) out += str_cat("  - ", n, "\n");
  }
  return out;
}

std::string plan_to_json(const Plan& plan) {
  Json changes = changes_json(plan.changes);
  Json candidates = Json::array();
  for (const PlacementPlan& c : plan.candidates) candidates.push_back(placement_json(c));
  Json doc = Json::object();
  doc["fits"] = plan.fits();
  doc["ranks"] = plan.ranks;
  doc["nodes"] = plan.nodes;
  doc["model"] = model_json(plan.model);
  doc["state"] = state_json(plan.state);
  doc["machine"] = machine_json(plan.machine);
  doc["configured"] = placement_json(plan.configured);
  doc["recommended"] = plan.recommended ? placement_json(*plan.recommended) : Json(nullptr);
  doc["config_changes"] = std::move(changes);
  doc["candidates"] = std::move(candidates);
  doc["wear"] = plan.wear ? wear_json(*plan.wear) : Json(nullptr);
  Json formats = Json::array();
  for (const FormatPlan& f : plan.formats) {
    Json j = Json::object();
    j["format"] = f.format;
    j["state_bytes"] = f.state_bytes;
    j["placement"] = placement_json(f.plan);
    j["wear"] = f.wear ? placement_wear_json(*f.wear) : Json(nullptr);
    formats.push_back(std::move(j));
  }
  doc["formats"] = std::move(formats);
  doc["notes"] = plan.notes;
  // Paths and config text are passed through; bytes that are not UTF-8
  // become U+FFFD rather than an exception.
  return doc.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
}

}  // namespace strata::engine
