// gpu_bench: pinned host<->device bandwidth on the CUDA device (when one is
// usable), and, for the emulated host device, how close its timing model runs
// to the model and how much CPU it burns while it waits.
//
//   gpu_bench [--sizes 1MiB,16MiB,256MiB] [--reps 5] [--device all|cuda|host]
//             [--model-gbps 25] [--json FILE]
//
// Repetitions are interleaved over sizes and directions; figures are medians.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "benchmarks/bench_json.h"
#include "core/memory_budget.h"
#include "core/str.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"
#include "gpu/host_device.h"

namespace {

using strata::core::Status;
namespace gpu = strata::gpu;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::uint64_t> sizes = {1ull << 20, 16ull << 20, 256ull << 20};
  int reps = 5;
  std::string device = "all";
  double model_gbps = 25.0;
  std::string json_path;
};

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

[[noreturn]] void die(const Status& s, std::string_view what) {
  std::fprintf(stderr, "gpu_bench: %.*s: %s\n", static_cast<int>(what.size()), what.data(), s.to_string().c_str());
  std::exit(1);
}

template <typename T>
T take(strata::core::Result<T> r, std::string_view what) {
  if (!r.ok()) die(r.status(), what);
  return std::move(r).value();
}

void check(const Status& s, std::string_view what) {
  if (!s.ok()) die(s, what);
}

struct Row {
  std::string device;
  std::string direction;  // h2d, d2h, bidir, declared
  std::string memory;     // pinned, pageable, -
  std::uint64_t bytes = 0;
  double median_s = 0.0;
  double gb_per_s = 0.0;       // bytes / median time / 1e9 (bidir: both directions' bytes)
  double model_s = 0.0;        // host device: the modeled time; 0 otherwise
  double model_ratio = 0.0;    // median time / modeled time (>= 1; 1.00 is exact)
  double cpu_per_wall = 0.0;   // CPU seconds of the process per wall second while it ran
};

// Times `reps` rounds of one copy (or of both directions at once on two
// streams) of `bytes` between `host` and `dev`.
Row measure(gpu::Device& device, gpu::Stream& s1, gpu::Stream& s2, std::string_view direction,
            std::span<std::byte> host, std::span<std::byte> host2, gpu::DeviceSpan dev, gpu::DeviceSpan dev2,
            int reps) {
  std::vector<double> times;
  double cpu = 0.0;
  double wall = 0.0;
  for (int r = 0; r < reps; ++r) {
    const double c0 = cpu_seconds();
    const auto t0 = Clock::now();
    if (direction == "h2d") {
      check(device.copy_h2d(s1, dev, host), "copy_h2d");
    } else if (direction == "d2h") {
      check(device.copy_d2h(s1, host, dev), "copy_d2h");
    } else {
      check(device.copy_h2d(s1, dev, host), "copy_h2d");
      check(device.copy_d2h(s2, host2, dev2), "copy_d2h");
    }
    check(device.synchronize(s1), "synchronize");
    check(device.synchronize(s2), "synchronize");
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    times.push_back(t);
    wall += t;
    cpu += cpu_seconds() - c0;
  }
  Row row;
  row.device = gpu::device_kind_name(device.kind());
  row.direction = std::string(direction);
  row.bytes = host.size();
  row.median_s = strata::bench::median(times);
  const double moved = direction == "bidir" ? 2.0 * static_cast<double>(host.size()) : static_cast<double>(host.size());
  row.gb_per_s = moved / row.median_s / 1e9;
  row.cpu_per_wall = wall > 0 ? cpu / wall : 0.0;
  return row;
}

std::vector<Row> bench_device(gpu::Device& device, const Options& o, bool pageable_too, double model_gbps) {
  std::vector<Row> rows;
  gpu::Stream s1 = take(device.create_stream("bench-1"), "create_stream");
  gpu::Stream s2 = take(device.create_stream("bench-2"), "create_stream");
  const std::uint64_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  gpu::DeviceBuffer d1 = take(device.allocate(max_bytes, "bench buffer 1"), "allocate");
  gpu::DeviceBuffer d2 = take(device.allocate(max_bytes, "bench buffer 2"), "allocate");
  gpu::PinnedBuffer p1 = take(device.allocate_pinned(max_bytes, "bench pinned 1"), "allocate_pinned");
  gpu::PinnedBuffer p2 = take(device.allocate_pinned(max_bytes, "bench pinned 2"), "allocate_pinned");
  std::memset(p1.data(), 1, max_bytes);  // touch once: first touch is slow
  std::memset(p2.data(), 2, max_bytes);
  std::vector<std::byte> pageable1(pageable_too ? max_bytes : 0, std::byte{3});
  std::vector<std::byte> pageable2(pageable_too ? max_bytes : 0, std::byte{4});
  const char* directions[] = {"h2d", "d2h", "bidir"};

  // Warm up each path once, then interleave: for each repetition, every size
  // and direction once.
  struct Acc {
    std::vector<Row> reps;
  };
  const std::size_t kinds = std::size(directions) * (pageable_too ? 2 : 1);
  std::vector<Acc> acc(o.sizes.size() * kinds);
  for (int r = -1; r < o.reps; ++r) {
    for (std::size_t si = 0; si < o.sizes.size(); ++si) {
      const std::uint64_t n = o.sizes[si];
      for (std::size_t k = 0; k < kinds; ++k) {
        const bool pinned = k < std::size(directions);
        const char* dir = directions[k % std::size(directions)];
        std::span<std::byte> h1 = pinned ? p1.bytes().subspan(0, n) : std::span<std::byte>(pageable1).subspan(0, n);
        std::span<std::byte> h2 = pinned ? p2.bytes().subspan(0, n) : std::span<std::byte>(pageable2).subspan(0, n);
        Row row = measure(device, s1, s2, dir, h1, h2, d1.subspan(0, n), d2.subspan(0, n), 1);
        row.memory = pinned ? "pinned" : "pageable";
        if (r >= 0) acc[si * kinds + k].reps.push_back(row);
      }
    }
  }
  for (auto& a : acc) {
    std::vector<double> t, cpu;
    for (auto& r : a.reps) {
      t.push_back(r.median_s);
      cpu.push_back(r.cpu_per_wall);
    }
    Row row = a.reps.front();
    row.median_s = strata::bench::median(t);
    row.cpu_per_wall = strata::bench::median(cpu);
    const double moved = row.direction == "bidir" ? 2.0 * static_cast<double>(row.bytes) : static_cast<double>(row.bytes);
    row.gb_per_s = moved / row.median_s / 1e9;
    if (model_gbps > 0) {
      // Each direction is one link; bidir overlaps both.
      row.model_s = static_cast<double>(row.bytes) / (model_gbps * 1e9);
      row.model_ratio = row.median_s / row.model_s;
    }
    rows.push_back(row);
  }

  if (device.caps().declared_compute) {
    // Declared compute of about 100 ms: time and CPU while waiting.
    const double flops = 0.1 * 1e12;  // at 1 TFLOP/s
    std::vector<double> t, cpu;
    for (int r = 0; r < o.reps; ++r) {
      const double c0 = cpu_seconds();
      const auto t0 = Clock::now();
      check(device.declare_compute(s1, flops, "bench"), "declare_compute");
      check(device.synchronize(s1), "synchronize");
      const double w = std::chrono::duration<double>(Clock::now() - t0).count();
      t.push_back(w);
      cpu.push_back((cpu_seconds() - c0) / w);
    }
    Row row;
    row.device = gpu::device_kind_name(device.kind());
    row.direction = "declared";
    row.memory = "-";
    row.median_s = strata::bench::median(t);
    row.model_s = 0.1;
    row.model_ratio = row.median_s / row.model_s;
    row.cpu_per_wall = strata::bench::median(cpu);
    rows.push_back(row);
  }
  return rows;
}

bool parse_args(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto next = [&]() -> std::string_view { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--sizes") {
      o->sizes.clear();
      std::stringstream ss{std::string(next())};
      std::string item;
      while (std::getline(ss, item, ',')) {
        std::uint64_t b = 0;
        if (!strata::core::parse_bytes(item, &b) || b == 0) return false;
        o->sizes.push_back(b);
      }
      if (o->sizes.empty()) return false;
    } else if (a == "--reps") {
      o->reps = std::atoi(std::string(next()).c_str());
      if (o->reps < 1) return false;
    } else if (a == "--device") {
      o->device = std::string(next());
      if (o->device != "all" && o->device != "cuda" && o->device != "host") return false;
    } else if (a == "--model-gbps") {
      o->model_gbps = std::atof(std::string(next()).c_str());
      if (!(o->model_gbps > 0)) return false;
    } else if (a == "--json") {
      o->json_path = std::string(next());
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_args(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: gpu_bench [--sizes 1MiB,16MiB,256MiB] [--reps 5] [--device all|cuda|host] "
                 "[--model-gbps 25] [--json FILE]\n");
    return 2;
  }
  const std::uint64_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  strata::core::MemoryBudget device_budget("device memory", 4 * max_bytes + (64ull << 20));
  strata::core::MemoryBudget pinned_budget("pinned host memory", 4 * max_bytes);
  const gpu::DeviceBudgets budgets{&device_budget, &pinned_budget};
  std::vector<Row> rows;
  std::string cuda_note;

  if (o.device != "host") {
    gpu::CudaDeviceOptions co;
    co.budgets = budgets;
    auto cuda = gpu::make_cuda_device(co);
    if (cuda.ok()) {
      std::printf("CUDA device: %s (sm_%d)\n", (*cuda)->caps().name.c_str(), (*cuda)->caps().compute_capability);
      auto r = bench_device(**cuda, o, /*pageable_too=*/true, 0.0);
      rows.insert(rows.end(), r.begin(), r.end());
    } else {
      cuda_note = cuda.status().to_string();
      std::printf("CUDA device: not measured (%s)\n", cuda_note.c_str());
      if (o.device == "cuda") return 1;
    }
  }
  if (o.device != "cuda") {
    gpu::HostDeviceOptions ho;
    ho.budgets = budgets;
    ho.timing.h2d_gb_per_s = o.model_gbps;
    ho.timing.d2h_gb_per_s = o.model_gbps;
    ho.timing.compute_tflops = 1.0;
    auto host = take(gpu::make_host_device(ho), "make_host_device");
    std::printf("host device: timing model %.1f GB/s per link direction, 1 TFLOP/s\n", o.model_gbps);
    auto r = bench_device(*host, o, /*pageable_too=*/false, o.model_gbps);
    rows.insert(rows.end(), r.begin(), r.end());
  }

  std::printf("\n%-6s %-9s %-9s %12s %11s %9s %11s %10s %9s\n", "device", "direction", "memory", "bytes",
              "median ms", "GB/s", "model ms", "x model", "CPU/wall");
  for (const Row& r : rows) {
    char model_ms[32] = "-";
    char ratio[32] = "-";
    if (r.model_s > 0) {
      std::snprintf(model_ms, sizeof(model_ms), "%.3f", r.model_s * 1e3);
      std::snprintf(ratio, sizeof(ratio), "%.3f", r.model_ratio);
    }
    std::printf("%-6s %-9s %-9s %12llu %11.3f %9.2f %11s %10s %9.3f\n", r.device.c_str(), r.direction.c_str(),
                r.memory.c_str(), static_cast<unsigned long long>(r.bytes), r.median_s * 1e3, r.gb_per_s, model_ms,
                ratio, r.cpu_per_wall);
  }
  std::printf("\nx model: median time / modeled time (1.00 is exact; never below 1). CPU/wall: CPU seconds the\n"
              "process used per wall second of the measurement (1.0 is one core busy).\n");

  if (!o.json_path.empty()) {
    strata::bench::JsonWriter j;
    j.begin_object();
    j.str("benchmark", "gpu_bench").integer("reps", o.reps).num("model_gbps", o.model_gbps);
    j.str("cuda_note", cuda_note);
    j.begin_array("rows");
    for (const Row& r : rows) {
      j.begin_object();
      j.str("device", r.device).str("direction", r.direction).str("memory", r.memory);
      j.integer("bytes", static_cast<std::int64_t>(r.bytes))
          .num("median_s", r.median_s)
          .num("gb_per_s", r.gb_per_s);
      j.num("model_s", r.model_s).num("model_ratio", r.model_ratio).num("cpu_per_wall", r.cpu_per_wall);
      j.end_object();
    }
    j.end_array();
    j.end_object();
    if (!j.write_file(o.json_path)) {
      std::fprintf(stderr, "gpu_bench: cannot write %s\n", o.json_path.c_str());
      return 1;
    }
  }
  return 0;
}
