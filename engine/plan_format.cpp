// The planner's output: an aligned text table and a JSON document (written by
// a small escaping writer; nlohmann/json stays behind engine/config*).
#include <cstdio>
#include <string>
#include <vector>

#include "core/str.h"
#include "engine/internal/plan_internal.h"
#include "engine/plan.h"

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
                 format_bytes(t.disk_read_bytes), ", disk write ", format_bytes(t.disk_write_bytes),
                 "; total ", format_bytes(t.total_bytes()));
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
  *out += str_cat("\n  moved per step: ", traffic_line(p.traffic), "\n");
  for (const std::string& r : p.reasons) *out += str_cat("  does not fit: ", r, "\n");
}

// --- JSON ---------------------------------------------------------------------

// Writes indented JSON. Call key() before each member of an object.
class JsonWriter {
 public:
  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  void key(std::string_view k) {
    separate();
    quote(k);
    out_ += ": ";
    after_key_ = true;
  }
  void str(std::string_view v) {
    separate();
    quote(v);
  }
  void u64(std::uint64_t v) {
    separate();
    out_ += std::to_string(v);
  }
  void i64(std::int64_t v) {
    separate();
    out_ += std::to_string(v);
  }
  void f64(double v) {
    separate();
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.10g", v);
    out_ += buf;
  }
  void boolean(bool v) {
    separate();
    out_ += v ? "true" : "false";
  }
  void null() {
    separate();
    out_ += "null";
  }
  // A value that is already JSON text (the caller guarantees it).
  void raw(std::string_view json) {
    separate();
    out_ += json;
  }
  std::string take() { return std::move(out_) + "\n"; }

 private:
  void open(char c) {
    separate();
    out_ += c;
    first_.push_back(true);
  }
  void close(char c) {
    const bool empty = first_.back();
    first_.pop_back();
    if (!empty) newline();
    out_ += c;
  }
  // Comma and newline before a value, unless it follows its key.
  void separate() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (first_.empty()) return;
    if (!first_.back()) out_ += ',';
    first_.back() = false;
    newline();
  }
  void newline() {
    out_ += '\n';
    out_.append(2 * first_.size(), ' ');
  }
  void quote(std::string_view s) {
    out_ += '"';
    for (char ch : s) {
      const auto u = static_cast<unsigned char>(ch);
      switch (ch) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\r': out_ += "\\r"; break;
        case '\t': out_ += "\\t"; break;
        case '\b': out_ += "\\b"; break;
        case '\f': out_ += "\\f"; break;
        default:
          if (u < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", u);
            out_ += buf;
          } else {
            out_ += ch;  // UTF-8 passes through
          }
      }
    }
    out_ += '"';
  }

  std::string out_;
  std::vector<bool> first_;  // per open container: no member written yet
  bool after_key_ = false;
};

void write_traffic(const StepTraffic& t, JsonWriter* w) {
  w->begin_object();
  w->key("host_to_device_bytes");
  w->u64(t.host_to_device_bytes);
  w->key("device_to_host_bytes");
  w->u64(t.device_to_host_bytes);
  w->key("disk_read_bytes");
  w->u64(t.disk_read_bytes);
  w->key("disk_write_bytes");
  w->u64(t.disk_write_bytes);
  w->key("total_bytes");
  w->u64(t.total_bytes());
  w->end_object();
}

void write_placement(const PlacementPlan& p, JsonWriter* w) {
  w->begin_object();
  w->key("param_device");
  w->str(offload_device_key(p.placement.param_device));
  w->key("optimizer_device");
  w->str(offload_device_key(p.placement.optimizer_device));
  w->key("optimizer_ratio");
  w->f64(p.placement.optimizer_ratio);
  w->key("optimizer_cpu_fraction");
  w->f64(p.placement.optimizer_cpu_fraction);
  w->key("fits");
  w->boolean(p.fits);
  w->key("items");
  w->begin_array();
  for (const PlanItem& item : p.items) {
    w->begin_object();
    w->key("name");
    w->str(item.name);
    w->key("tier");
    w->str(tier_key(item.tier));
    w->key("bytes");
    w->u64(item.size_bytes);
    w->key("detail");
    w->str(item.detail);
    w->end_object();
  }
  w->end_array();
  w->key("tiers");
  w->begin_object();
  for (const TierPlan& t : p.tiers) {
    w->key(tier_key(t.tier));
    w->begin_object();
    w->key("needed_bytes");
    w->u64(t.needed_bytes);
    w->key("capacity_bytes");
    w->u64(t.capacity_bytes);
    w->key("margin_bytes");
    w->u64(t.margin_bytes);
    w->key("available_bytes");
    w->u64(t.available_bytes);
    w->key("fits");
    w->boolean(t.fits);
    w->key("capacity_source");
    w->str(t.capacity_source);
    w->end_object();
  }
  w->end_object();
  w->key("bytes_per_step");
  write_traffic(p.traffic, w);
  w->key("reasons");
  w->begin_array();
  for (const std::string& r : p.reasons) w->str(r);
  w->end_array();
  w->end_object();
}

}  // namespace

std::string format_plan_table(const Plan& plan) {
  const ModelSummary& m = plan.model;
  std::string out;
  out += str_cat("model    ", group_digits(static_cast<std::uint64_t>(m.num_params)),
                 " parameters (trainable ",
                 group_digits(static_cast<std::uint64_t>(m.num_trainable_params)), ", frozen ",
                 group_digits(static_cast<std::uint64_t>(m.num_frozen_params)), "), ", m.num_layers,
                 " layers");
  if (m.has_shape) {
    out += str_cat(", hidden ", m.hidden_size, ", vocab ", m.vocab_size, ", heads ", m.num_heads);
  }
  out += "\n";
  const StateSizes& st = plan.state;
  out += str_cat("state    ", st.precision, " compute copies ", st.compute_bytes, " B, gradients ",
                 st.gradient_bytes, " B (gradient_accumulation_steps ",
                 st.gradient_accumulation_steps, "), ", st.optimizer, ": fp32 master ",
                 st.master_bytes, " B + moments ", st.moment_bytes, " B per trainable parameter\n");
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
  if (!plan.notes.empty()) {
    out += "\nnotes\n";
    for (const std::string& n : plan.notes) out += str_cat("  - ", n, "\n");
  }
  return out;
}

std::string plan_to_json(const Plan& plan) {
  JsonWriter w;
  const ModelSummary& m = plan.model;
  w.begin_object();
  w.key("fits");
  w.boolean(plan.fits());
  w.key("model");
  w.begin_object();
  w.key("num_params");
  w.i64(m.num_params);
  w.key("num_trainable_params");
  w.i64(m.num_trainable_params);
  w.key("num_frozen_params");
  w.i64(m.num_frozen_params);
  w.key("num_layers");
  w.i64(m.num_layers);
  w.key("frozen_fraction");
  w.f64(m.frozen_fraction);
  w.key("group_params");
  w.i64(m.group_params);
  w.key("persistent_params");
  w.i64(m.persistent_params);
  w.key("seq_len");
  w.i64(m.seq_len);
  w.key("micro_batch");
  w.i64(m.micro_batch);
  w.key("activation_checkpointing");
  w.boolean(m.activation_checkpointing);
  w.key("transformer");
  if (m.has_shape) {
    w.begin_object();
    w.key("hidden_size");
    w.i64(m.hidden_size);
    w.key("vocab_size");
    w.i64(m.vocab_size);
    w.key("num_heads");
    w.i64(m.num_heads);
    w.end_object();
  } else {
    w.null();
  }
  w.key("activations");
  if (m.activations) {
    w.begin_object();
    w.key("full_layer_bytes");
    w.u64(m.activations->full_layer_bytes);
    w.key("kept_layer_bytes");
    w.u64(m.activations->kept_layer_bytes);
    w.key("layers_bytes");
    w.u64(m.activations->layers_bytes);
    w.key("logits_bytes");
    w.u64(m.activations->logits_bytes);
    w.key("total_bytes");
    w.u64(m.activations->total_bytes);
    w.end_object();
  } else {
    w.null();
  }
  w.end_object();

  w.key("state");
  w.begin_object();
  w.key("precision");
  w.str(plan.state.precision);
  w.key("optimizer");
  w.str(plan.state.optimizer);
  w.key("compute_bytes");
  w.u64(plan.state.compute_bytes);
  w.key("gradient_bytes");
  w.u64(plan.state.gradient_bytes);
  w.key("master_bytes");
  w.u64(plan.state.master_bytes);
  w.key("moment_bytes");
  w.u64(plan.state.moment_bytes);
  w.key("gradient_accumulation_steps");
  w.i64(plan.state.gradient_accumulation_steps);
  w.end_object();

  w.key("machine");
  w.begin_object();
  w.key("gpu_bytes");
  if (plan.machine.gpu_bytes) {
    w.u64(*plan.machine.gpu_bytes);
  } else {
    w.null();
  }
  w.key("gpu_source");
  w.str(plan.machine.gpu_source);
  w.key("gpu_probe");
  w.str(plan.machine.gpu_probe);
  w.key("ram_bytes");
  w.u64(plan.machine.ram_bytes);
  w.key("ram_source");
  w.str(plan.machine.ram_source);
  w.key("disk_bytes");
  w.u64(plan.machine.disk_bytes);
  w.key("disk_source");
  w.str(plan.machine.disk_source);
  w.key("disks");
  w.begin_array();
  for (const DiskSpace& d : plan.machine.disks) {
    w.begin_object();
    w.key("path");
    w.str(d.path);
    w.key("measured_at");
    w.str(d.measured_at);
    w.key("free_bytes");
    w.u64(d.free_bytes);
    w.key("counted");
    w.boolean(d.counted);
    w.end_object();
  }
  w.end_array();
  w.end_object();

  w.key("configured");
  write_placement(plan.configured, &w);
  w.key("recommended");
  if (plan.recommended) {
    write_placement(*plan.recommended, &w);
  } else {
    w.null();
  }
  w.key("config_changes");
  w.begin_array();
  for (const ConfigChange& ch : plan.changes) {
    w.begin_object();
    w.key("key_path");
    w.str(ch.key_path);
    w.key("from");
    w.raw(ch.from);
    w.key("to");
    w.raw(ch.to);
    w.end_object();
  }
  w.end_array();
  w.key("candidates");
  w.begin_array();
  for (const PlacementPlan& c : plan.candidates) write_placement(c, &w);
  w.end_array();
  w.key("notes");
  w.begin_array();
  for (const std::string& n : plan.notes) w.str(n);
  w.end_array();
  w.end_object();
  return w.take();
}

}  // namespace strata::engine
