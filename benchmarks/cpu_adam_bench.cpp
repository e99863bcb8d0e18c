// cpu_adam_bench: the fused Adam step of every kernel against the memory
// roofline of its own access pattern, measured in the same process,
// interleaved. Prints a table; --json FILE writes the rows.
//
//   cpu_adam_bench [--quick] [--sizes 16M,256M] [--threads 1,2] [--reps N (5)]
//                  [--kernels scalar,avx2,avx512,avx512_bf16,naive] [--headline]
//                  [--bind auto|numa|cores|none,...] [--json FILE]
//
// --kernels and --headline (only the 28 B fp32-master / bf16-gradient / bf16
// copy-out pattern, plus its subnormal row) shorten a run while tuning; the
// figures in docs/benchmarks.md come from a full run. Besides fp32 moments,
// every kernel runs the bf16-gradient / bf16 copy-out pattern with bf16
// moments (pattern g16+copy+bf16m, 20 B) and with 8-bit blockwise moments
// (g16+copy+int8m, 16.06 B), each against the yardstick of its own pattern.
// --bind (default auto) runs every row once per CpuAdamOptions::bind mode, the
// modes interleaved in each repetition (their order reversed every other
// one); with two or more, a second table gives each mode's speedup over the
// first, paired per repetition.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/roofline.h"
#include "core/aligned_buffer.h"
#include "core/clock.h"
#include "core/numerics.h"
#include "cpu_adam/cpu_adam.h"

namespace strata::bench {
namespace {

namespace nx = core::numerics;
using adam::ElemType;
using adam::Isa;

constexpr std::int64_t kTile = 4 * 65536;  // the same tiles CpuAdam uses by default

struct Options {
  std::vector<std::int64_t> sizes = {16ll << 20, 256ll << 20};
  std::vector<int> threads = {1, 2};
  int reps = 5;
  std::vector<std::string> kernels = {"scalar", "avx2", "avx512", "avx512_bf16", "naive"};
  bool headline_only = false;
  std::vector<std::string> binds = {"auto"};  // CpuAdamOptions::bind modes, by name
  std::string json_path;
};

bool bind_mode_of(std::string_view name, adam::BindMode* out) {
  for (adam::BindMode m :
       {adam::BindMode::kAuto, adam::BindMode::kNuma, adam::BindMode::kCores, adam::BindMode::kNone}) {
    if (adam::bind_mode_name(m) == name) {
      *out = m;
      return true;
    }
  }
  return false;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Arrays of one size, allocated and touched once (first touch is slow here).
// The compact moments have arrays of their own, so that the fp32 rows keep
// their values.
struct Arrays {
  core::AlignedBuffer p, m, v, g32, g16, out;
  core::AlignedBuffer m16, v16;          // bf16 moments
  core::AlignedBuffer m8, v8, m8s, v8s;  // 8-bit moments: codes, one scale per 256
  std::int64_t n = 0;
  float* fp() { return p.as<float>().data(); }
  float* fm() { return m.as<float>().data(); }
  float* fv() { return v.as<float>().data(); }
  float* fg() { return g32.as<float>().data(); }
  std::uint16_t* hg() { return g16.as<std::uint16_t>().data(); }
  std::uint16_t* hout() { return out.as<std::uint16_t>().data(); }
  std::int64_t blocks() const { return (n + nx::kQuantBlockElems - 1) / nx::kQuantBlockElems; }

  void fill(bool subnormal_moments) {
    std::uint32_t x = 12345;
    auto next = [&x] {
      x = x * 1664525u + 1013904223u;
      return static_cast<float>(x >> 8) * (1.0f / 16777216.0f) - 0.5f;  // [-0.5, 0.5)
    };
    for (std::int64_t i = 0; i < n; ++i) {
      const float r = next();
      fp()[i] = r;
      if (subnormal_moments) {
        fm()[i] = std::ldexp(r, -130);
        fv()[i] = std::ldexp(std::fabs(r), -135);
        fg()[i] = std::ldexp(r, -128);
      } else {
        fm()[i] = r * 1e-2f;
        fv()[i] = r * r * 1e-4f;
        fg()[i] = r * 2.0f;
      }
      hg()[i] = nx::fp32_to_bf16_bits(fg()[i]);
      hout()[i] = 0;
      m16.as<std::uint16_t>()[i] = nx::fp32_to_bf16_bits(fm()[i]);
      v16.as<std::uint16_t>()[i] = nx::fp32_to_bf16_bits(fv()[i]);
      // Codes spread over the tables, under scales of the fp32 moments' size.
      m8.as<std::uint8_t>()[i] = static_cast<std::uint8_t>(x >> 24);
      v8.as<std::uint8_t>()[i] = static_cast<std::uint8_t>(x >> 16);
    }
    for (std::int64_t b = 0; b < blocks(); ++b) {
      m8s.as<float>()[b] = 5e-3f;
      v8s.as<float>()[b] = 2.5e-5f;
    }
  }
};

core::Result<Arrays> make_arrays(std::int64_t n) {
  Arrays a;
  a.n = n;
  const std::size_t f = static_cast<std::size_t>(n) * 4, h = static_cast<std::size_t>(n) * 2;
  STRATA_ASSIGN_OR_RETURN(a.p, core::AlignedBuffer::allocate(f, 4096));
  STRATA_ASSIGN_OR_RETURN(a.m, core::AlignedBuffer::allocate(f, 4096));
  STRATA_ASSIGN_OR_RETURN(a.v, core::AlignedBuffer::allocate(f, 4096));
  STRATA_ASSIGN_OR_RETURN(a.g32, core::AlignedBuffer::allocate(f, 4096));
  STRATA_ASSIGN_OR_RETURN(a.g16, core::AlignedBuffer::allocate(h, 4096));
  STRATA_ASSIGN_OR_RETURN(a.out, core::AlignedBuffer::allocate(h, 4096));
  STRATA_ASSIGN_OR_RETURN(a.m16, core::AlignedBuffer::allocate(h, 4096));
  STRATA_ASSIGN_OR_RETURN(a.v16, core::AlignedBuffer::allocate(h, 4096));
  STRATA_ASSIGN_OR_RETURN(a.m8, core::AlignedBuffer::allocate(static_cast<std::size_t>(n), 4096));
  STRATA_ASSIGN_OR_RETURN(a.v8, core::AlignedBuffer::allocate(static_cast<std::size_t>(n), 4096));
  STRATA_ASSIGN_OR_RETURN(a.m8s,
                          core::AlignedBuffer::allocate(static_cast<std::size_t>(a.blocks()) * 4, 4096));
  STRATA_ASSIGN_OR_RETURN(a.v8s,
                          core::AlignedBuffer::allocate(static_cast<std::size_t>(a.blocks()) * 4, 4096));
  a.fill(false);
  return a;
}

// How a row stores the moments.
enum class MomentFormat { kFp32, kBf16, kInt8 };
const char* moment_format_name(MomentFormat f) {
  return f == MomentFormat::kBf16 ? "bf16" : f == MomentFormat::kInt8 ? "int8" : "fp32";
}

struct Row {
  std::string kernel;  // scalar, avx2, avx512, avx512_bf16, naive
  int threads = 1;
  std::int64_t n = 0;
  ElemType grad = ElemType::kF32;
  bool copy = false;
  bool subnormal = false;
  std::vector<double> seconds;
  // Per repetition: the fastest yardstick variant of this row's pattern in
  // the runs right before and right after the row (drift stays out of the ratio).
  std::vector<double> roof_seconds;
  MomentFormat format = MomentFormat::kFp32;
  // Master read and written (8), the moments read and written (fp32 16, bf16
  // 8, 8-bit 4 plus two fp32 scales read and written per 256 elements), the
  // gradient and the copy-out.
  double state_bytes() const {
    switch (format) {
      case MomentFormat::kFp32:
        return 24.0;
      case MomentFormat::kBf16:
        return 16.0;
      case MomentFormat::kInt8:
        return 12.0 + 16.0 / nx::kQuantBlockElems;
    }
    return 0.0;
  }
  double bytes_per_param() const { return state_bytes() + (grad == ElemType::kF32 ? 4 : 2) + (copy ? 2 : 0); }
  std::string pattern() const {
    const char* moments = format == MomentFormat::kBf16   ? "+bf16m"
                          : format == MomentFormat::kInt8 ? "+int8m"
                                                          : "";
    return std::string(grad == ElemType::kF32 ? "g32" : "g16") + (copy ? "+copy" : "") + moments;
  }
  std::string bind = "auto";  // CpuAdamOptions::bind
  std::string binding = {};   // CoreBinding::describe() of the CpuAdam it ran on
  std::string run_key() const;
  bool same_case(const Row& o) const {
    return kernel == o.kernel && threads == o.threads && n == o.n && grad == o.grad && copy == o.copy &&
           subnormal == o.subnormal && format == o.format;
  }
};

// The rooflines' and triads' key: the same arrays, threads and binding.
std::string run_key(std::int64_t n, int threads, const std::string& bind) {
  return std::to_string(n) + "/" + std::to_string(threads) + "/" + bind + "/";
}
std::string Row::run_key() const { return bench::run_key(n, threads, bind); }

// One STREAM triad figure per arrays, threads and binding.
struct Triad {
  std::int64_t n = 0;
  int threads = 0;
  std::string bind;
  std::vector<double> seconds;
};

// Every yardstick variant's seconds per repetition, by name ("ordinary/zmm", ...).
struct Roofline {
  std::map<std::string, std::vector<double>> variants;
};

const char* store_name(StoreKind k) {
  switch (k) {
    case StoreKind::kOrdinary:
      return "ordinary";
    case StoreKind::kNontemporal:
      return "nontemporal";
    case StoreKind::kMixed:
      return "mixed";
  }
  return "?";
}
const char* shape_name(LoopShape s) {
  switch (s) {
    case LoopShape::kZmm:
      return "zmm";
    case LoopShape::kZmmPrefetch:
      return "zmm+prefetch";
    case LoopShape::kYmm:
      return "ymm";
  }
  return "?";
}

// "g1, g2, ..." GB/s of `bytes` moved in each of `seconds`.
std::string gbps_list(double bytes, const std::vector<double>& seconds) {
  std::string out;
  for (double t : seconds) {
    char item[32];
    std::snprintf(item, sizeof item, "%s%.2f", out.empty() ? "" : ", ", bytes / t * 1e-9);
    out += item;
  }
  return out;
}

// The step with compact moments (bf16 or 8-bit, the arrays of their own)
// over the fp32 step's master, gradient, copy-out and constants.
core::Status step_compact(adam::CpuAdam& cpu, MomentFormat format, Arrays& a,
                          const adam::AdamStepArgs& like) {
  if (format == MomentFormat::kBf16) {
    adam::AdamStepBf16MomentsArgs args;
    args.constants = like.constants;
    args.master = like.master;
    args.exp_avg = a.m16.as<std::uint16_t>();
    args.exp_avg_sq = a.v16.as<std::uint16_t>();
    args.grad = like.grad;
    args.copy_out = like.copy_out;
    return cpu.step_bf16_moments(args);
  }
  adam::AdamStepInt8Args args;
  args.constants = like.constants;
  args.master = like.master;
  args.exp_avg = a.m8.as<std::uint8_t>();
  args.exp_avg_sq = a.v8.as<std::uint8_t>();
  args.exp_avg_scale = a.m8s.as<float>().first(static_cast<std::size_t>(a.blocks()));
  args.exp_avg_sq_scale = a.v8s.as<float>().first(static_cast<std::size_t>(a.blocks()));
  args.grad = like.grad;
  args.copy_out = like.copy_out;
  return cpu.step_int8_blockwise(args);
}

int run(const Options& opt) {
  std::vector<Row> rows;
  std::map<std::string, Roofline> rooflines;  // key: Row::run_key() + pattern
  std::map<std::string, Triad> triads;        // key: Row::run_key()
  std::vector<Isa> isas;
  auto wanted = [&](std::string_view kernel) {
    return std::find(opt.kernels.begin(), opt.kernels.end(), kernel) != opt.kernels.end();
  };
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (adam::isa_supported(isa) && wanted(adam::isa_name(isa))) isas.push_back(isa);
  }
  if (!adam::isa_supported(Isa::kAvx512)) {
    std::fprintf(stderr, "cpu_adam_bench: the roofline kernels need AVX-512, which this CPU lacks\n");
    return 1;
  }
  const nx::AdamHyperparams hyper{.lr = 1e-4, .beta2 = 0.95, .weight_decay = 0.01};
  for (std::int64_t n : opt.sizes) {
    auto arrays_or = make_arrays(n);
    if (!arrays_or.ok()) {
      std::fprintf(stderr, "cpu_adam_bench: %s\n", arrays_or.status().to_string().c_str());
      return 1;
    }
    Arrays& a = *arrays_or;
    for (int threads : opt.threads) {
      // The rows of each binding mode (--bind); the naive loop (no threads) once.
      struct BindRun {
        std::string bind;
        adam::BindMode mode = adam::BindMode::kAuto;
        size_t first_row = 0, end_row = 0;
      };
      std::vector<BindRun> runs;
      for (const std::string& bind : opt.binds) {
        BindRun br{bind, adam::BindMode::kAuto, rows.size(), 0};
        bind_mode_of(bind, &br.mode);
        auto add = [&](Row row) {
          row.bind = bind;
          rows.push_back(std::move(row));
        };
        for (size_t k = 0; k < isas.size(); ++k) {
          for (ElemType g : {ElemType::kF32, ElemType::kBf16}) {
            for (bool copy : {false, true}) {
              if (opt.headline_only && (g != ElemType::kBf16 || !copy)) continue;
              add({std::string(adam::isa_name(isas[k])), threads, n, g, copy, false, {}, {}});
            }
          }
        }
        if (!isas.empty()) {
          add({std::string(adam::isa_name(isas.back())), threads, n, ElemType::kBf16, true, true, {}, {}});
        }
        for (size_t k = 0; k < isas.size() && !opt.headline_only; ++k) {
          for (MomentFormat f : {MomentFormat::kBf16, MomentFormat::kInt8}) {
            add({std::string(adam::isa_name(isas[k])), threads, n, ElemType::kBf16, true, false, {}, {}, f});
          }
        }
        if (threads == 1 && wanted("naive") && runs.empty())
          add({"naive", 1, n, ElemType::kF32, false, false, {}, {}});
        br.end_row = rows.size();
        runs.push_back(br);
      }
      int step = 0;
      for (int rep = 0; rep < opt.reps; ++rep) {
        for (size_t k = 0; k < runs.size(); ++k) {
          // The modes in turn, their order reversed every other repetition, so
          // that the machine's drift falls on each alike.
          const BindRun& br = runs[rep % 2 == 0 ? k : runs.size() - 1 - k];
          // One CpuAdam (one oneTBB arena) per thread count and binding, made
          // anew for each turn: the step and its yardsticks run on the same
          // threads through for_each_tile.
          auto created = adam::CpuAdam::create(
              {.threads = threads, .tile_elems = kTile, .bind = br.mode, .near_memory = a.p.bytes()});
          if (!created.ok()) {
            std::fprintf(stderr, "cpu_adam_bench: %s\n", created.status().to_string().c_str());
            return 1;
          }
          adam::CpuAdam& cpu = **created;
          const std::string rkey = run_key(n, threads, br.bind);
          if (rep == 0) {
            std::printf("threads %d, bind %s: %s\n", threads, br.bind.c_str(),
                        cpu.binding().describe().c_str());
          }
          // The yardstick: every store kind and loop shape of a row's pattern,
          // over the same arrays through the same threads and tiles; the fastest
          // variant's seconds.
          auto yardstick = [&](const Row& row) {
            Roofline& rl = rooflines[rkey + row.pattern()];
            double fastest = 0.0;
            for (StoreKind kind : {StoreKind::kOrdinary, StoreKind::kNontemporal, StoreKind::kMixed}) {
              if (kind == StoreKind::kMixed && !row.copy) continue;  // same as ordinary without a copy-out
              for (LoopShape shape : {LoopShape::kZmm, LoopShape::kZmmPrefetch, LoopShape::kYmm}) {
                core::Stopwatch ysw;
                cpu.for_each_tile(n, [&](std::int64_t begin, std::int64_t len) {
                  if (row.format != MomentFormat::kFp32) {
                    const bool int8 = row.format == MomentFormat::kInt8;
                    const std::int64_t block = begin / nx::kQuantBlockElems;
                    CompactPatternArrays ca{a.fp() + begin,
                                            int8 ? static_cast<void*>(a.m8.as<std::uint8_t>().data() + begin)
                                                 : a.m16.as<std::uint16_t>().data() + begin,
                                            int8 ? static_cast<void*>(a.v8.as<std::uint8_t>().data() + begin)
                                                 : a.v16.as<std::uint16_t>().data() + begin,
                                            int8 ? 1 : 2,
                                            int8 ? a.m8s.as<float>().data() + block : nullptr,
                                            int8 ? a.v8s.as<float>().data() + block : nullptr,
                                            row.grad == ElemType::kF32
                                                ? static_cast<const void*>(a.fg() + begin)
                                                : a.hg() + begin,
                                            row.grad == ElemType::kBf16,
                                            row.copy ? a.hout() + begin : nullptr,
                                            len};
                    stream_compact_pattern_avx512(ca, kind, shape);
                    return;
                  }
                  PatternArrays pa{
                      a.fp() + begin,
                      a.fm() + begin,
                      a.fv() + begin,
                      row.grad == ElemType::kF32 ? static_cast<const void*>(a.fg() + begin) : a.hg() + begin,
                      row.grad == ElemType::kBf16,
                      row.copy ? a.hout() + begin : nullptr,
                      len};
                  stream_pattern_avx512(pa, kind, shape);
                });
                const double t = ysw.elapsed_s();
                rl.variants[std::string(store_name(kind)) + "/" + shape_name(shape)].push_back(t);
                fastest = fastest == 0.0 ? t : std::min(fastest, t);
              }
            }
            return fastest;
          };
          // Rows of one pattern run back to back, each between two runs of the
          // yardstick (the one after a row is the one before the next): a row's
          // ceiling is the faster of the two, what the memory system delivered
          // right around it.
          std::vector<size_t> order;
          for (size_t r = br.first_row; r < br.end_row; ++r) order.push_back(r);
          std::stable_sort(order.begin(), order.end(),
                           [&](size_t x, size_t y) { return rows[x].pattern() < rows[y].pattern(); });
          double before = 0.0;
          std::string before_pattern;
          for (size_t r : order) {
            Row& row = rows[r];
            row.binding = cpu.binding().describe();
            if (row.pattern() != before_pattern) {
              before = yardstick(row);
              before_pattern = row.pattern();
            }
            if (row.subnormal) a.fill(true);
            ++step;
            core::Stopwatch sw;
            if (row.kernel == "naive") {
              naive_adamw(a.fp(), a.fm(), a.fv(), a.fg(), n, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.01f, step);
            } else {
              const Isa isa = *std::find_if(isas.begin(), isas.end(),
                                            [&](Isa i) { return adam::isa_name(i) == row.kernel; });
              if (!cpu.set_isa(isa).ok()) return 1;
              adam::AdamStepArgs args;
              args.constants = nx::make_adam_constants(hyper, step, 1.0);
              args.master = a.p.as<float>();
              args.exp_avg = a.m.as<float>();
              args.exp_avg_sq = a.v.as<float>();
              args.grad = row.grad == ElemType::kF32 ? adam::ConstTypedSpan{a.fg(), ElemType::kF32, n}
                                                     : adam::ConstTypedSpan{a.hg(), ElemType::kBf16, n};
              if (row.copy) args.copy_out = {a.hout(), ElemType::kBf16, n};
              sw.restart();
              const core::Status s =
                  row.format == MomentFormat::kFp32 ? cpu.step(args) : step_compact(cpu, row.format, a, args);
              if (!s.ok()) {
                std::fprintf(stderr, "cpu_adam_bench: %s\n", s.to_string().c_str());
                return 1;
              }
            }
            row.seconds.push_back(sw.elapsed_s());
            if (row.subnormal) a.fill(false);
            const double after = yardstick(row);
            row.roof_seconds.push_back(std::min(before, after));
            before = after;
          }
          {
            core::Stopwatch sw;
            cpu.for_each_tile(n, [&](std::int64_t begin, std::int64_t len) {
              stream_triad_avx512(a.fm() + begin, a.fp() + begin, a.fv() + begin, 0.5f, len);
            });
            Triad& t = triads[rkey];
            t.n = n;
            t.threads = threads;
            t.bind = br.bind;
            t.seconds.push_back(sw.elapsed_s());
          }
        }
        a.fill(false);  // keep values in range for the next repetition
      }
    }
  }

  // Report.
  std::printf("\n%-11s %3s %-5s %6s %-14s %-9s %12s %8s %8s %9s %-24s %8s %13s %s\n", "kernel", "thr", "bind",
              "N", "pattern", "moments", "params/s", "B/param", "GB/s", "roof GB/s", "roof by", "fraction",
              "min..max", "");
  FILE* json = opt.json_path.empty() ? nullptr : std::fopen(opt.json_path.c_str(), "w");
  if (!opt.json_path.empty() && json == nullptr) {
    std::fprintf(stderr, "cpu_adam_bench: cannot write %s\n", opt.json_path.c_str());
    return 1;
  }
  if (json) std::fprintf(json, "{\n  \"rows\": [\n");
  bool first = true;
  int suspects = 0;
  for (const Row& row : rows) {
    const std::string rkey = row.run_key();
    const Roofline& rl = rooflines[rkey + row.pattern()];
    const double bytes = row.bytes_per_param() * static_cast<double>(row.n);
    const double gbps = bytes / median(row.seconds) * 1e-9;
    const double roof = bytes / median(row.roof_seconds) * 1e-9;
    // Each repetition's step against the yardstick runs right around it: the
    // fraction is the median of those paired ratios (the available memory
    // bandwidth of a shared machine drifts; a pair sees the same).
    std::vector<double> ratios;
    for (std::size_t i = 0; i < row.seconds.size(); ++i)
      ratios.push_back(row.roof_seconds[i] / row.seconds[i]);
    const double fraction = median(ratios);
    const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
    // The variant that was fastest most often over this pattern's runs.
    std::map<std::string, int> wins;
    const std::size_t runs = rl.variants.empty() ? 0 : rl.variants.begin()->second.size();
    for (std::size_t i = 0; i < runs; ++i) {
      const std::string* best = nullptr;
      double t_best = 0.0;
      for (const auto& [name, secs] : rl.variants) {
        if (best == nullptr || secs[i] < t_best) best = &name, t_best = secs[i];
      }
      ++wins[*best];
    }
    const auto roof_by = std::max_element(wins.begin(), wins.end(),
                                          [](const auto& x, const auto& y) { return x.second < y.second; });
    std::string variants_json;
    for (const auto& [name, secs] : rl.variants) {
      char item[96];
      std::snprintf(item, sizeof item, "%s\"%s\": %.4f", variants_json.empty() ? "" : ", ", name.c_str(),
                    bytes / median(secs) * 1e-9);
      variants_json += item;
    }
    const double triad = 12.0 * static_cast<double>(row.n) / median(triads[rkey].seconds) * 1e-9;
    const bool suspect = fraction > 1.0;
    suspects += suspect ? 1 : 0;
    char range[32];
    std::snprintf(range, sizeof range, "%.3f..%.3f", *lo, *hi);
    std::printf("%-11s %3d %-5s %5lldM %-14s %-9s %12.3e %8.4g %8.2f %9.2f %-24s %8.3f %13s %s\n",
                row.kernel.c_str(), row.threads, row.bind.c_str(), static_cast<long long>(row.n >> 20),
                row.pattern().c_str(), row.subnormal ? "subnormal" : "normal",
                gbps * 1e9 / row.bytes_per_param(), row.bytes_per_param(), gbps, roof,
                roof_by == wins.end() ? "-" : roof_by->first.c_str(), fraction, range,
                suspect ? "SUSPECT: above the roofline" : "");
    if (json) {
      std::fprintf(
          json,
          "%s    {\"kernel\": \"%s\", \"threads\": %d, \"bind\": \"%s\", \"binding\": \"%s\", "
          "\"n\": %lld, \"grad\": \"%s\", \"copy_out\": %s, \"moments\": \"%s\", \"moment_format\": \"%s\", "
          "\"params_per_s\": %.6e, \"bytes_per_param\": %.4g, \"gbps\": %.4f, "
          "\"roofline_gbps\": %.4f, \"roofline_variant\": \"%s\", \"roofline_variants_gbps\": {%s}, "
          "\"triad_gbps\": %.4f, \"fraction_of_roofline\": %.4f, \"fraction_min\": %.4f, "
          "\"fraction_max\": %.4f, \"suspect\": %s, \"reps\": %zu, \"gbps_per_rep\": [%s], "
          "\"roofline_gbps_per_rep\": [%s]}",
          first ? "" : ",\n", row.kernel.c_str(), row.threads, row.bind.c_str(), row.binding.c_str(),
          static_cast<long long>(row.n), adam::elem_type_name(row.grad).data(), row.copy ? "true" : "false",
          row.subnormal ? "subnormal" : "normal", moment_format_name(row.format),
          gbps * 1e9 / row.bytes_per_param(), row.bytes_per_param(), gbps, roof,
          roof_by == wins.end() ? "-" : roof_by->first.c_str(), variants_json.c_str(), triad, fraction, *lo,
          *hi, suspect ? "true" : "false", row.seconds.size(), gbps_list(bytes, row.seconds).c_str(),
          gbps_list(bytes, row.roof_seconds).c_str());
      first = false;
    }
  }
  std::printf("\nSTREAM triad (fp32, 12 B/element, for reference):\n");
  for (const auto& [key, t] : triads) {
    std::printf("  N=%lldM threads=%d bind=%s: %.2f GB/s\n", static_cast<long long>(t.n >> 20), t.threads,
                t.bind.c_str(), 12.0 * static_cast<double>(t.n) / median(t.seconds) * 1e-9);
  }
  // Each mode against the first, paired per repetition: the modes ran in
  // turn within a repetition, so a pair saw nearly the same machine.
  if (opt.binds.size() > 1) {
    std::printf(
        "\nbind against %s (the first --bind): speedup = %s's seconds / the mode's, the median over the "
        "repetitions of the paired ratio\n",
        opt.binds[0].c_str(), opt.binds[0].c_str());
    std::printf("%-11s %3s %-5s %6s %-14s %-9s %8s %13s\n", "kernel", "thr", "bind", "N", "pattern",
                "moments", "speedup", "min..max");
    auto paired = [](const std::vector<double>& base, const std::vector<double>& mode) {
      std::vector<double> ratios;
      for (std::size_t i = 0; i < mode.size(); ++i) ratios.push_back(base[i] / mode[i]);
      return ratios;
    };
    for (const Row& row : rows) {
      if (row.bind == opt.binds[0]) continue;
      const auto base = std::find_if(
          rows.begin(), rows.end(), [&](const Row& o) { return o.bind == opt.binds[0] && o.same_case(row); });
      if (base == rows.end() || base->seconds.size() != row.seconds.size()) continue;
      const std::vector<double> ratios = paired(base->seconds, row.seconds);
      const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
      std::printf("%-11s %3d %-5s %5lldM %-14s %-9s %8.3f %6.3f..%.3f\n", row.kernel.c_str(), row.threads,
                  row.bind.c_str(), static_cast<long long>(row.n >> 20), row.pattern().c_str(),
                  row.subnormal ? "subnormal" : "normal", median(ratios), *lo, *hi);
    }
    for (const auto& [key, t] : triads) {
      if (t.bind == opt.binds[0]) continue;
      const Triad& base = triads[run_key(t.n, t.threads, opt.binds[0])];
      if (base.seconds.size() != t.seconds.size()) continue;
      const std::vector<double> ratios = paired(base.seconds, t.seconds);
      const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
      std::printf("%-11s %3d %-5s %5lldM %-14s %-9s %8.3f %6.3f..%.3f\n", "triad", t.threads, t.bind.c_str(),
                  static_cast<long long>(t.n >> 20), "-", "-", median(ratios), *lo, *hi);
    }
  }
  std::printf("\n%d of %zu rows SUSPECT (the median paired ratio above 1)\n", suspects, rows.size());
  if (json) {
    std::fprintf(json, "\n  ]\n}\n");
    std::fclose(json);
  }
  return 0;
}

bool parse_list(const char* text, std::vector<std::int64_t>* out) {
  out->clear();
  std::string s(text);
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (item.empty()) return false;
    std::int64_t mult = 1;
    if (item.back() == 'M' || item.back() == 'm')
      mult = 1 << 20, item.pop_back();
    else if (item.back() == 'K' || item.back() == 'k')
      mult = 1 << 10, item.pop_back();
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || v <= 0) return false;
    out->push_back(v * mult);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return !out->empty();
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  // A line at a time into a file too: a run stopped at a limit (the GPU check's stage) keeps its rows.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  strata::bench::Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cpu_adam_bench: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      opt.sizes = {16ll << 20};
      opt.reps = 3;
    } else if (arg == "--sizes") {
      if (!strata::bench::parse_list(value("--sizes"), &opt.sizes)) {
        std::fprintf(stderr, "cpu_adam_bench: --sizes takes a list like 16M,256M\n");
        return 2;
      }
    } else if (arg == "--threads") {
      std::vector<std::int64_t> t;
      if (!strata::bench::parse_list(value("--threads"), &t)) {
        std::fprintf(stderr, "cpu_adam_bench: --threads takes a list like 1,2\n");
        return 2;
      }
      opt.threads.assign(t.begin(), t.end());
    } else if (arg == "--reps") {
      opt.reps = std::atoi(value("--reps"));
      if (opt.reps < 1) {
        std::fprintf(stderr, "cpu_adam_bench: --reps must be >= 1\n");
        return 2;
      }
    } else if (arg == "--kernels") {
      opt.kernels.clear();
      std::string list = value("--kernels");
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        const std::string k = list.substr(pos, comma - pos);
        if (k != "scalar" && k != "avx2" && k != "avx512" && k != "avx512_bf16" && k != "naive") {
          std::fprintf(
              stderr,
              "cpu_adam_bench: unknown kernel '%s' in --kernels (scalar, avx2, avx512, avx512_bf16, naive)\n",
              k.c_str());
          return 2;
        }
        opt.kernels.push_back(k);
        pos = comma + 1;
      }
    } else if (arg == "--headline") {
      opt.headline_only = true;
    } else if (arg == "--bind") {
      opt.binds.clear();
      const std::string list = value("--bind");
      for (size_t pos = 0; pos <= list.size();) {
        const size_t comma = std::min(list.find(',', pos), list.size());
        const std::string b = list.substr(pos, comma - pos);
        strata::adam::BindMode mode;
        if (!strata::bench::bind_mode_of(b, &mode) ||
            std::find(opt.binds.begin(), opt.binds.end(), b) != opt.binds.end()) {
          std::fprintf(stderr,
                       "cpu_adam_bench: '%s' in --bind is not one of auto, numa, cores, none (each once)\n",
                       b.c_str());
          return 2;
        }
        opt.binds.push_back(b);
        pos = comma + 1;
      }
    } else if (arg == "--json") {
      opt.json_path = value("--json");
    } else {
      std::fprintf(stderr,
                   "usage: cpu_adam_bench [--quick] [--sizes 16M,256M] [--threads 1,2] [--reps N]\n"
                   "                      [--kernels scalar,avx2,avx512,avx512_bf16,naive] [--headline]\n"
                   "                      [--bind auto|numa|cores|none,...] [--json FILE]\n");
      return 2;
    }
  }
  return strata::bench::run(opt);
}
