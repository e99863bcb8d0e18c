// nvme_bench: sequential read and write of a multi-GiB swap file through
// SwapStore (CRC64 on, inside the timed window) for each I/O backend, against
// fio on the same pre-written file with the same block size and queue depth.
// strata and fio alternate over the repetitions; medians are reported.
//
//   nvme_bench [--quick] [--dir DIR] [--size BYTES] [--reps N] [--backends io_uring,libaio,psync]
//              [--block-sizes 256KiB,1MiB,4MiB,8MiB] [--queue-depths 4,16,64] [--no-crc]
//              [--fio PATH] [--json FILE]
//
// The fio job (kFioJob below, printed at start) uses the io_uring engine with
// O_DIRECT, registered buffers and files: the strongest plain fio setup. With
// O_DIRECT on both sides the page cache plays no part, so there is nothing to
// scrub between repetitions. Install fio with `bash scripts/install-deps.sh
// --with-tools` (or `apt-get install fio`).
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/memory_budget.h"
#include "core/str.h"
#include "nvme/buffer_pool.h"
#include "nvme/crc64.h"
#include "nvme/swap_store.h"

extern char** environ;

namespace {

using strata::core::Status;
using strata::core::str_cat;
namespace nvme = strata::nvme;

// Options common to every fio run; per row the bench adds --rw, --bs,
// --iodepth, --size, --filename and --output.
const std::vector<std::string> kFioJob = {
    "--name=strata_yardstick", "--ioengine=io_uring", "--direct=1",   "--fixedbufs=1",
    "--registerfiles=1",       "--numjobs=1",         "--thread=1",   "--allow_file_create=0",
    "--offset=0",              "--invalidate=0",      "--end_fsync=0", "--output-format=json"};

struct Options {
  bool quick = false;
  std::string dir;
  std::uint64_t size_bytes = 0;
  int reps = 3;
  std::vector<nvme::BackendKind> backends = {nvme::BackendKind::kIoUring, nvme::BackendKind::kLibaio,
                                             nvme::BackendKind::kPsync};
  std::vector<std::uint64_t> block_sizes = {256ull << 10, 1ull << 20, 4ull << 20, 8ull << 20};
  std::vector<unsigned> queue_depths = {4, 16, 64};
  bool crc = true;
  std::string fio;
  std::string json_path;
};

struct Row {
  std::string backend;
  std::string op;
  std::uint64_t block_size = 0;
  unsigned queue_depth = 0;
  double gbps = 0;
  double fio_gbps = 0;
  std::vector<double> all_gbps, all_fio_gbps;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string find_fio(const std::string& given) {
  if (!given.empty()) return ::access(given.c_str(), X_OK) == 0 ? given : std::string();
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "";
  dirs += ":/usr/bin:/usr/local/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    const std::size_t end = dirs.find(':', start);
    const std::string d = dirs.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!d.empty() && ::access((d + "/fio").c_str(), X_OK) == 0) return d + "/fio";
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return {};
}

// Runs fio once; returns GB/s (1e9 bytes/s), or a negative value on failure.
double run_fio(const Options& opt, const std::string& file, const char* rw, std::uint64_t bs, unsigned qd,
               std::uint64_t bytes) {
  const std::string out = opt.dir + "/nvme_bench_fio.json";
  std::vector<std::string> args = {opt.fio};
  args.insert(args.end(), kFioJob.begin(), kFioJob.end());
  args.push_back(str_cat("--rw=", rw));
  args.push_back(str_cat("--bs=", bs));
  args.push_back(str_cat("--iodepth=", qd));
  args.push_back(str_cat("--size=", bytes));
  args.push_back(str_cat("--filename=", file));
  args.push_back(str_cat("--output=", out));
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, opt.fio.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  std::string json;
  if (FILE* f = std::fopen(out.c_str(), "r")) {
    char buf[8192];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) json.append(buf, n);
    std::fclose(f);
  }
  ::unlink(out.c_str());
  // The job's "read" or "write" section, then its bw_bytes (bytes/s).
  const std::size_t section = json.find(str_cat("\"", std::string(rw) == "read" ? "read" : "write", "\" : {"));
  if (section == std::string::npos) return -1;
  const std::size_t key = json.find("\"bw_bytes\"", section);
  if (key == std::string::npos) return -1;
  const std::size_t colon = json.find(':', key);
  return std::strtod(json.c_str() + colon + 1, nullptr) / 1e9;
}

// One sequential pass over every block with `qd` blocks in flight; GB/s, or
// a negative value after printing the error.
double strata_pass(nvme::SwapStore& store, nvme::IoOp op, const std::vector<std::string>& ids,
                   std::vector<nvme::PoolBuffer>& buffers, unsigned qd, std::uint64_t bs) {
  // Up to qd blocks in flight, each in its own buffer slot. A slot is refilled
  // as soon as its block is done, whether or not older blocks are, so a slow
  // request does not idle the others (the drive may complete out of order).
  struct Slot {
    nvme::SwapIo io;
    bool busy = false;
  };
  std::vector<Slot> slots(qd);
  std::deque<unsigned> order;  // busy slots, oldest first
  std::size_t next = 0;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "nvme_bench: %s\n", s.to_string().c_str());
    return -1.0;
  };
  auto start = [&](unsigned slot) -> Status {
    auto& buf = buffers[slot];
    auto io = op == nvme::IoOp::kWrite ? store.start_write(ids[next], std::span<const std::byte>(buf.data(), bs))
                                       : store.start_read(ids[next], std::span<std::byte>(buf.data(), bs));
    if (!io.ok()) return io.status();
    ++next;
    slots[slot].io = std::move(io).value();
    slots[slot].busy = true;
    order.push_back(slot);
    return Status();
  };
  strata::core::Stopwatch clock;
  for (unsigned s = 0; s < qd && next < ids.size(); ++s) {
    if (Status st = start(s); !st.ok()) return fail(st);
  }
  while (!order.empty()) {
    // Finish the oldest (blocking), then every other one already done.
    const unsigned oldest = order.front();
    order.pop_front();
    if (Status st = slots[oldest].io.wait(); !st.ok()) return fail(st);
    slots[oldest].busy = false;
    if (next < ids.size()) {
      if (Status st = start(oldest); !st.ok()) return fail(st);
    }
    for (std::size_t k = 0; k < order.size();) {
      const unsigned s = order[k];
      if (!slots[s].io.ready()) {
        ++k;
        continue;
      }
      order.erase(order.begin() + static_cast<std::ptrdiff_t>(k));
      if (Status st = slots[s].io.wait(); !st.ok()) return fail(st);
      if (next < ids.size()) {
        if (Status st = start(s); !st.ok()) return fail(st);
      }
    }
  }
  const double secs = clock.elapsed_s();
  return static_cast<double>(ids.size() * bs) / secs / 1e9;
}

int run(const Options& opt) {
  std::printf("nvme_bench: file %s of %s under %s, %d repetitions, CRC64 %s (%s)\n",
              nvme::SwapStore::kSwapFileName.data(), strata::core::format_bytes(opt.size_bytes).c_str(),
              opt.dir.c_str(), opt.reps, opt.crc ? "on" : "off",
              nvme::crc64_accelerated() ? "ISA-L" : "portable table");
  if (opt.fio.empty()) {
    std::printf("fio not found: no yardstick (install it with `bash scripts/install-deps.sh --with-tools` or "
                "`apt-get install fio`); ratio_vs_fio is reported as 0\n");
  } else {
    std::string job;
    for (const auto& a : kFioJob) job += " " + a;
    std::printf("fio yardstick: %s%s --rw=read|write --bs=B --iodepth=Q --size=S --filename=F\n", opt.fio.c_str(),
                job.c_str());
  }
  const std::uint64_t max_bs = *std::max_element(opt.block_sizes.begin(), opt.block_sizes.end());
  const unsigned max_qd = *std::max_element(opt.queue_depths.begin(), opt.queue_depths.end());
  strata::core::MemoryBudget budget("nvme_bench staging", static_cast<std::uint64_t>(max_qd) * max_bs);
  auto pool = nvme::BufferPool::create({.buffer_bytes = max_bs, .buffer_count = max_qd, .name = "bench buffers"},
                                       budget);
  if (!pool.ok()) {
    std::fprintf(stderr, "nvme_bench: %s\n", pool.status().to_string().c_str());
    return 1;
  }
  std::vector<nvme::PoolBuffer> buffers;
  std::mt19937_64 rng(42);
  for (unsigned i = 0; i < max_qd; ++i) {
    buffers.push_back((*pool)->acquire());
    auto* p = reinterpret_cast<std::uint64_t*>(buffers.back().data());
    for (std::size_t k = 0; k < max_bs / 8; ++k) p[k] = rng();
  }
  std::vector<Row> rows;
  std::printf("\n%-9s %-5s %8s %4s %9s %9s %8s\n", "backend", "op", "block", "qd", "GB/s", "fio GB/s", "ratio");
  for (nvme::BackendKind kind : opt.backends) {
    nvme::SwapStoreOptions so;
    so.paths = {opt.dir};
    so.capacity_bytes = opt.size_bytes;
    so.stripe_bytes = max_bs;
    so.request_bytes = max_bs;  // one request per block
    so.crc = opt.crc;
    so.direct_io = nvme::DirectIo::kOn;
    so.io.kind = kind;
    so.io.queue_depth = max_qd;  // the window below sets what is in flight
    auto store_r = nvme::SwapStore::create(so);
    if (!store_r.ok()) {
      std::printf("%-9s skipped: %s\n", std::string(nvme::to_string(kind)).c_str(),
                  store_r.status().to_string().c_str());
      continue;
    }
    auto& store = *store_r;
    if (Status s = store->register_buffers(**pool); !s.ok()) {
      std::printf("(%s: buffers not registered: %s)\n", std::string(nvme::to_string(kind)).c_str(),
                  s.to_string().c_str());
    }
    const std::string file = store->file_path(0);
    for (std::uint64_t bs : opt.block_sizes) {
      // Lay the file out as consecutive blocks of bs bytes and pre-write it.
      std::vector<std::string> ids;
      for (std::uint64_t off = 0; off + bs <= opt.size_bytes; off += bs) {
        ids.push_back(str_cat("b", off / bs));
        if (Status s = store->allocate(ids.back(), bs); !s.ok()) {
          std::fprintf(stderr, "nvme_bench: %s\n", s.to_string().c_str());
          return 1;
        }
      }
      const std::uint64_t bytes = ids.size() * bs;
      if (strata_pass(*store, nvme::IoOp::kWrite, ids, buffers, max_qd, bs) < 0) return 1;
      for (unsigned qd : opt.queue_depths) {
        // Reads first (fio reads leave the data alone), then writes.
        for (const char* opname : {"read", "write"}) {
          const bool is_read = std::string(opname) == "read";
          Row row;
          row.backend = std::string(nvme::to_string(kind));
          row.op = opname;
          row.block_size = bs;
          row.queue_depth = qd;
          // ABBA order (strata first on even repetitions for reads, fio first
          // for writes), so neither side always runs right after the other.
          bool last_was_fio = false;
          for (int r = 0; r < opt.reps; ++r) {
            const bool fio_first = !opt.fio.empty() && ((r % 2 == 0) != is_read);
            if (fio_first) row.all_fio_gbps.push_back(run_fio(opt, file, opname, bs, qd, bytes));
            const double g = strata_pass(*store, is_read ? nvme::IoOp::kRead : nvme::IoOp::kWrite, ids, buffers,
                                         qd, bs);
            if (g < 0) return 1;
            row.all_gbps.push_back(g);
            if (!fio_first && !opt.fio.empty()) row.all_fio_gbps.push_back(run_fio(opt, file, opname, bs, qd, bytes));
            last_was_fio = !fio_first && !opt.fio.empty();
          }
          // fio's writes leave data whose CRCs the store does not know: rewrite
          // (untimed) so the next reads find valid blocks.
          if (!is_read && last_was_fio && strata_pass(*store, nvme::IoOp::kWrite, ids, buffers, qd, bs) < 0) return 1;
          row.gbps = median(row.all_gbps);
          row.fio_gbps = median(row.all_fio_gbps);
          const double ratio = row.fio_gbps > 0 ? row.gbps / row.fio_gbps : 0;
          std::printf("%-9s %-5s %8s %4u %9.3f %9.3f %8.3f\n", row.backend.c_str(), opname,
                      strata::core::format_bytes(bs).c_str(), qd, row.gbps, row.fio_gbps, ratio);
          std::fflush(stdout);
          rows.push_back(row);
        }
      }
      for (const auto& id : ids) {
        if (Status s = store->remove(id); !s.ok()) return 1;
      }
    }
    if (Status s = store->close(); !s.ok()) {
      std::fprintf(stderr, "nvme_bench: %s\n", s.to_string().c_str());
      return 1;
    }
  }
  if (!opt.json_path.empty()) {
    FILE* json = std::fopen(opt.json_path.c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "nvme_bench: cannot write %s\n", opt.json_path.c_str());
      return 1;
    }
    std::string job;
    for (const auto& a : kFioJob) job += (job.empty() ? "" : " ") + a;
    std::fprintf(json, "{\n  \"file_bytes\": %llu,\n  \"reps\": %d,\n  \"crc\": %s,\n  \"fio_job\": \"%s\",\n",
                 static_cast<unsigned long long>(opt.size_bytes), opt.reps, opt.crc ? "true" : "false", job.c_str());
    std::fprintf(json, "  \"rows\": [\n");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      auto list = [](const std::vector<double>& v) {
        std::string s = "[";
        for (std::size_t k = 0; k < v.size(); ++k) s += str_cat(k ? ", " : "", v[k]);
        return s + "]";
      };
      std::fprintf(json,
                   "    {\"backend\": \"%s\", \"op\": \"%s\", \"block_size\": %llu, \"queue_depth\": %u, "
                   "\"gbps\": %.4f, \"fio_gbps\": %.4f, \"ratio_vs_fio\": %.4f, \"gbps_reps\": %s, "
                   "\"fio_gbps_reps\": %s}%s\n",
                   r.backend.c_str(), r.op.c_str(), static_cast<unsigned long long>(r.block_size), r.queue_depth,
                   r.gbps, r.fio_gbps, r.fio_gbps > 0 ? r.gbps / r.fio_gbps : 0.0, list(r.all_gbps).c_str(),
                   list(r.all_fio_gbps).c_str(), i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(json, "  ]\n}\n");
    std::fclose(json);
  }
  return 0;
}

bool parse_list_bytes(const std::string& text, std::vector<std::uint64_t>* out) {
  out->clear();
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::uint64_t v = 0;
    if (!strata::core::parse_bytes(text.substr(start, end - start), &v) || v == 0 || v % 4096 != 0) return false;
    out->push_back(v);
    start = end + 1;
  }
  return !out->empty();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  bool size_given = false, bs_given = false, qd_given = false;
  std::string fio_arg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nvme_bench: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--quick") {
      opt.quick = true;
    } else if (arg == "--dir") {
      opt.dir = value("--dir");
    } else if (arg == "--size") {
      if (!strata::core::parse_bytes(value("--size"), &opt.size_bytes) || opt.size_bytes == 0) {
        std::fprintf(stderr, "nvme_bench: bad --size\n");
        return 2;
      }
      size_given = true;
    } else if (arg == "--reps") {
      opt.reps = std::atoi(value("--reps").c_str());
      if (opt.reps < 1) opt.reps = 1;
    } else if (arg == "--backends") {
      opt.backends.clear();
      const std::string list = value("--backends");
      std::size_t start = 0;
      while (start < list.size()) {
        std::size_t end = list.find(',', start);
        if (end == std::string::npos) end = list.size();
        auto k = nvme::parse_backend_kind(list.substr(start, end - start));
        if (!k.ok() || *k == nvme::BackendKind::kAuto) {
          std::fprintf(stderr, "nvme_bench: bad backend in --backends\n");
          return 2;
        }
        opt.backends.push_back(*k);
        start = end + 1;
      }
    } else if (arg == "--block-sizes") {
      if (!parse_list_bytes(value("--block-sizes"), &opt.block_sizes)) {
        std::fprintf(stderr, "nvme_bench: --block-sizes needs multiples of 4096\n");
        return 2;
      }
      bs_given = true;
    } else if (arg == "--queue-depths") {
      opt.queue_depths.clear();
      const std::string list = value("--queue-depths");
      std::size_t start = 0;
      while (start < list.size()) {
        std::size_t end = list.find(',', start);
        if (end == std::string::npos) end = list.size();
        const int q = std::atoi(list.substr(start, end - start).c_str());
        if (q < 1 || q > 4096) {
          std::fprintf(stderr, "nvme_bench: bad queue depth\n");
          return 2;
        }
        opt.queue_depths.push_back(static_cast<unsigned>(q));
        start = end + 1;
      }
      qd_given = true;
    } else if (arg == "--no-crc") {
      opt.crc = false;
    } else if (arg == "--fio") {
      fio_arg = value("--fio");
    } else if (arg == "--json") {
      opt.json_path = value("--json");
    } else {
      std::fprintf(stderr,
                   "usage: nvme_bench [--quick] [--dir DIR] [--size BYTES] [--reps N] "
                   "[--backends io_uring,libaio,psync]\n"
                   "                  [--block-sizes 256KiB,1MiB,4MiB,8MiB] [--queue-depths 4,16,64] [--no-crc]\n"
                   "                  [--fio PATH] [--json FILE]\n");
      return 2;
    }
  }
  if (opt.quick) {
    if (!bs_given) opt.block_sizes = {1ull << 20, 4ull << 20};
    if (!qd_given) opt.queue_depths = {16, 64};
  }
  if (!size_given) opt.size_bytes = opt.quick ? (2ull << 30) : (4ull << 30);
  if (opt.dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    opt.dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  opt.fio = find_fio(fio_arg);
  return run(opt);
}
