// The resources of a training step measured in isolation (step_resources.h).
#include "benchmarks/step_resources.h"

#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>

#include "benchmarks/bench_json.h"
#include "core/clock.h"
#include "core/numerics.h"
#include "core/str.h"
#include "gpu/cuda_device.h"
#include "gpu/host_device.h"
#include "nvme/crc64.h"

namespace strata::bench {

namespace eng = strata::engine;
namespace nx = strata::core::numerics;
using core::Result;
using core::Status;
using core::str_cat;

namespace {

nvme::BackendKind backend_of(eng::IoBackend b) {
  switch (b) {
    case eng::IoBackend::kAuto:
      return nvme::BackendKind::kAuto;
    case eng::IoBackend::kIoUring:
      return nvme::BackendKind::kIoUring;
    case eng::IoBackend::kLibaio:
      return nvme::BackendKind::kLibaio;
    case eng::IoBackend::kPsync:
      return nvme::BackendKind::kPsync;
  }
  return nvme::BackendKind::kAuto;
}

}  // namespace

std::string Model::group(int g) const { return str_cat("layer", g); }

Status declare(gpu::Device& dev, gpu::Stream& stream, double flops, std::string_view what) {
  if (dev.kind() == gpu::DeviceKind::kCuda) return Status();
  return dev.declare_compute(stream, flops, what);
}

Status run_forward(eng::Engine& engine, gpu::Stream& stream, const Model& m) {
  for (int g = 0; g < m.layers; ++g) {
    const std::string name = m.group(g);
    STRATA_RETURN_IF_ERROR(engine.fetch(name).status());
    STRATA_RETURN_IF_ERROR(declare(engine.device(), stream, m.forward_flops(), "forward"));
    STRATA_RETURN_IF_ERROR(engine.release(name, &stream));  // its buffer is reused after this work
  }
  return Status();
}

std::vector<std::uint16_t> gradient_bits(const Model& m, const GradKind& kind, double loss_scale) {
  const float a = static_cast<float>(kind.norm / std::sqrt(static_cast<double>(m.params())) * loss_scale);
  const bool fp16 = m.precision == eng::Precision::kFp16;
  const std::uint16_t pos = fp16 ? nx::fp32_to_fp16_bits(a) : nx::fp32_to_bf16_bits(a);
  const std::uint16_t neg = fp16 ? nx::fp32_to_fp16_bits(-a) : nx::fp32_to_bf16_bits(-a);
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(m.layer_elems));
  std::uint32_t x = 2463534242u;
  for (std::uint16_t& b : bits) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = (x & 1) != 0 ? pos : neg;
  }
  if (kind.inf) bits[0] = fp16 ? nx::fp32_to_fp16_bits(INFINITY) : nx::fp32_to_bf16_bits(INFINITY);
  return bits;
}

Usage Usage::now() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return {static_cast<double>(u.ru_utime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec),
          static_cast<double>(u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_stime.tv_usec),
          static_cast<std::int64_t>(u.ru_minflt)};
}

double IsoSample::disk_s() const {
  if (shape.disk_bytes() == 0) return 0.0;
  return mixed_s > 0 ? std::min(read_s + write_s, mixed_s) : read_s + write_s;
}

IsoSample IsoSample::scaled(double factor) const {
  const auto grow = [factor](std::uint64_t b) {
    return static_cast<std::uint64_t>(std::llround(static_cast<double>(b) * factor));
  };
  IsoSample s = *this;
  s.shape.bytes = {grow(shape.bytes.h2d), grow(shape.bytes.d2h), grow(shape.bytes.nvme_read),
                   grow(shape.bytes.nvme_write)};
  s.shape.discarded = static_cast<std::int64_t>(std::llround(static_cast<double>(shape.discarded) * factor));
  for (double* t : {&s.device_s, &s.h2d_s, &s.d2h_s, &s.read_s, &s.write_s, &s.mixed_s, &s.grad_pass_s,
                    &s.adam_s, &s.crc_s, &s.copy_s, &s.host_h2d_s, &s.host_d2h_s, &s.host_kernel_s}) {
    *t *= factor;
  }
  return s;
}

// ---------------------------------------------------------------------------
// Isolated.

Isolated::Isolated(const Options& o, adam::CpuAdam& cpu)
    : o_(o),
      cpu_(cpu),
      device_budget_("isolated device", core::MemoryBudget::kUnlimited),
      pinned_budget_("isolated pinned", core::MemoryBudget::kUnlimited) {}

Result<std::unique_ptr<Isolated>> Isolated::create(const Options& o, adam::CpuAdam& cpu) {
  std::unique_ptr<Isolated> iso(new Isolated(o, cpu));
  STRATA_RETURN_IF_ERROR(iso->allocate());
  if (o.host_device) STRATA_RETURN_IF_ERROR(iso->make_rig(iso->untimed_, {}));
  return iso;
}

Isolated::~Isolated() {
  if (store_ != nullptr) store_->close().ignore_error();  // the swap files go; nothing to keep
  for (Rig* r : {&timed_, &untimed_}) {
    if (r->device != nullptr) r->device->synchronize().ignore_error();  // before the buffers go
  }
}

void Isolated::Rig::reset() {
  hlink.reset();
  dlink.reset();
  dgrad.reset();
  dpattern.reset();
  stream.reset();
  device.reset();
}

Status Isolated::make_rig(Rig& rig, const TimingPlan& t) {
  rig.reset();
  const std::uint64_t gbytes = o_.model.group_bytes();
  if (o_.cuda && &rig == &timed_) {
    gpu::CudaDeviceOptions co;
    co.budgets = {&device_budget_, &pinned_budget_};
    co.arena_bytes = 3 * core::align_up(gbytes, 1ull << 20);
    STRATA_ASSIGN_OR_RETURN(rig.device, gpu::make_cuda_device(co));
  } else {
    gpu::HostDeviceOptions ho;
    ho.budgets = {&device_budget_, &pinned_budget_};
    ho.timing.compute_tflops = t.tflops;
    ho.timing.h2d_gb_per_s = t.h2d_gbps;
    ho.timing.d2h_gb_per_s = t.d2h_gbps;
    STRATA_ASSIGN_OR_RETURN(rig.device, gpu::make_host_device(ho));
  }
  STRATA_ASSIGN_OR_RETURN(rig.stream, rig.device->create_stream("isolated"));
  STRATA_ASSIGN_OR_RETURN(rig.dpattern, rig.device->allocate(gbytes, "isolated gradient pattern"));
  STRATA_ASSIGN_OR_RETURN(rig.dgrad, rig.device->allocate(gbytes, "isolated gradient"));
  STRATA_ASSIGN_OR_RETURN(rig.dlink, rig.device->allocate(gbytes, "isolated link target"));
  STRATA_ASSIGN_OR_RETURN(rig.hlink, rig.device->allocate_pinned(gbytes, "isolated link source"));
  std::memcpy(rig.hlink.data(), src_.data(), gbytes);
  STRATA_RETURN_IF_ERROR(rig.device->copy_h2d(rig.stream, rig.dpattern.span(), rig.hlink.bytes()));
  STRATA_RETURN_IF_ERROR(rig.device->copy_h2d(rig.stream, rig.dgrad.span(), rig.hlink.bytes()));
  STRATA_RETURN_IF_ERROR(rig.device->copy_h2d(rig.stream, rig.dlink.span(), rig.hlink.bytes()));
  return rig.device->synchronize(rig.stream);
}

Status Isolated::set_timing(const TimingPlan& t) { return make_rig(timed_, t); }

Result<double> Isolated::device_time(DeviceWork work) { return device_time(timed_, work); }

Result<double> Isolated::device_time(Rig& rig, DeviceWork work) {
  if (o_.device_work) return o_.device_work(*rig.device, rig.stream, work);
  const Model& m = o_.model;
  const bool with_compute = work == DeviceWork::kComputeAndGradients;
  gpu::Device& dev = *rig.device;
  core::Stopwatch sw;
  if (with_compute) {
    for (int g = 0; g < m.layers; ++g) {
      STRATA_RETURN_IF_ERROR(declare(dev, rig.stream, m.forward_flops(), "forward"));
    }
  }
  for (int g = 0; g < m.layers; ++g) {
    if (with_compute)
      STRATA_RETURN_IF_ERROR(declare(dev, rig.stream, 2.0 * m.forward_flops(), "backward"));
    STRATA_RETURN_IF_ERROR(dev.copy_d2d(rig.stream, rig.dgrad.span(), rig.dpattern.span()));
  }
  STRATA_RETURN_IF_ERROR(dev.synchronize(rig.stream));
  return sw.elapsed_s();
}

Result<IsoSample> Isolated::measure(const Shape& shape) {
  IsoSample s;
  s.shape = shape;
  STRATA_ASSIGN_OR_RETURN(s.device_s, device_time(timed_, DeviceWork::kComputeAndGradients));
  STRATA_ASSIGN_OR_RETURN(s.h2d_s, link_time(timed_, Direction::kH2d, shape.bytes.h2d));
  STRATA_ASSIGN_OR_RETURN(s.d2h_s, link_time(timed_, Direction::kD2h, shape.bytes.d2h));
  if (o_.host_device) {
    STRATA_ASSIGN_OR_RETURN(s.host_h2d_s, link_time(untimed_, Direction::kH2d, shape.bytes.h2d));
    STRATA_ASSIGN_OR_RETURN(s.host_d2h_s, link_time(untimed_, Direction::kD2h, shape.bytes.d2h));
    STRATA_ASSIGN_OR_RETURN(s.host_kernel_s, device_time(untimed_, DeviceWork::kGradientsOnly));
  }
  if (o_.phase_sync) o_.phase_sync();
  if (shape.disk_bytes() > 0) STRATA_RETURN_IF_ERROR(disk_times(shape, s));
  if (o_.phase_sync) o_.phase_sync();
  STRATA_RETURN_IF_ERROR(cpu_times(shape, s));
  return s;
}

Status Isolated::close_disk() {
  if (store_ == nullptr) return Status();
  for (const Block& b : reads_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
  for (const Block& b : writes_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
  reads_.clear();
  writes_.clear();
  reads_bytes_ = writes_bytes_ = 0;
  const Status s = store_->close();
  store_.reset();
  return s;
}

std::uint64_t Isolated::copy_bytes_of(const Shape& shape) const {
  return shape.bytes.h2d + shape.bytes.d2h +
         static_cast<std::uint64_t>(o_.model.params() * o_.model.compute_bytes());
}

adam::ElemType Isolated::compute_type() const {
  return o_.model.precision == eng::Precision::kFp16 ? adam::ElemType::kF16 : adam::ElemType::kBf16;
}

// The CPU buffers, sized for the whole model and touched once (first touch
// is slow here): the optimizer state (laid out chunk by chunk as the
// engine's staging is: master, exp_avg, exp_avg_sq), the host gradients,
// the gradients as they come down, the new compute copies.
Status Isolated::allocate() {
  const auto n = static_cast<std::size_t>(o_.model.params());
  const auto cb = static_cast<std::size_t>(o_.model.compute_bytes());
  STRATA_ASSIGN_OR_RETURN(state_, core::AlignedBuffer::allocate(12 * n, core::kDirectIoAlignment));
  STRATA_ASSIGN_OR_RETURN(grads_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
  STRATA_ASSIGN_OR_RETURN(src_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
  STRATA_ASSIGN_OR_RETURN(copyout_, core::AlignedBuffer::allocate(cb * n, core::kDirectIoAlignment));
  partials_.assign(n / static_cast<std::size_t>(nx::kNormBlockElems), 0.0);
  auto* st = state_.as<float>().data();
  for (std::int64_t b = 0; b < o_.model.params(); b += o_.chunk_elems) {
    const std::int64_t len = std::min(o_.chunk_elems, o_.model.params() - b);
    float* master = st + 3 * b;
    std::uint32_t x = 12345u + static_cast<std::uint32_t>(b);
    for (std::int64_t i = 0; i < len; ++i) {
      x = x * 1664525u + 1013904223u;
      master[i] = static_cast<float>(static_cast<int>(x >> 20) - 2048) * 1e-5f;
    }
    std::memset(master + len, 0, static_cast<std::size_t>(2 * len) * 4);
  }
  const std::vector<std::uint16_t> g = gradient_bits(o_.model, GradKind{}, 1.0);
  auto* s16 = src_.as<std::uint16_t>().data();
  for (std::size_t i = 0; i < n; i += g.size()) std::memcpy(s16 + i, g.data(), g.size() * 2);
  std::memset(grads_.data(), 0, grads_.size_bytes());
  std::memset(copyout_.data(), 0, copyout_.size_bytes());
  return Status();
}

// `bytes` of copies in one direction, in pieces of one layer's compute copies.
Result<double> Isolated::link_time(Rig& rig, Direction dir, std::uint64_t bytes) {
  if (bytes == 0) return 0.0;
  const std::uint64_t piece = o_.model.group_bytes();
  gpu::Device& dev = *rig.device;
  core::Stopwatch sw;
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t n = std::min(piece, bytes - done);
    if (dir == Direction::kH2d) {
      STRATA_RETURN_IF_ERROR(dev.copy_h2d(rig.stream, rig.dlink.subspan(0, n), rig.hlink.bytes().first(n)));
    } else {
      STRATA_RETURN_IF_ERROR(dev.copy_d2h(rig.stream, rig.hlink.bytes().first(n), rig.dlink.subspan(0, n)));
    }
    done += n;
  }
  STRATA_RETURN_IF_ERROR(dev.synchronize(rig.stream));
  return sw.elapsed_s();
}

// --- the disk ---

// Blocks of the engine's state-chunk size (the last one shorter) covering
// `bytes`, over the state buffer in order (region `shift` blocks on).
std::vector<Isolated::Block> Isolated::blocks(const char* prefix, std::uint64_t bytes,
                                              std::size_t shift) const {
  const std::uint64_t bb = state_block_bytes();
  const std::size_t regions = std::max<std::size_t>(1, state_.size_bytes() / bb);
  std::vector<Block> out;
  for (std::uint64_t off = 0, j = 0; off < bytes; off += bb, ++j) {
    out.push_back(
        {str_cat(prefix, j), std::min(bb, bytes - off), state_.data() + ((j + shift) % regions) * bb});
  }
  return out;
}

// Makes the read set (written once, untimed) and the write set for this
// shape, reopening the store when it is too small.
Status Isolated::prepare_disk(const Shape& shape) {
  const std::uint64_t r = shape.bytes.nvme_read, w = shape.bytes.nvme_write;
  if (store_ != nullptr && r == reads_bytes_ && w == writes_bytes_) return Status();
  const std::uint64_t need = core::align_up(r + w + (r + w) / 4 + (64ull << 20), 1ull << 20);
  if (store_ != nullptr) {
    for (const Block& b : reads_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
    for (const Block& b : writes_) STRATA_RETURN_IF_ERROR(store_->remove(b.id));
    reads_.clear();
    writes_.clear();
    if (store_->capacity_bytes() < need) {
      STRATA_RETURN_IF_ERROR(store_->close());
      store_.reset();
    }
  }
  if (store_ == nullptr) {
    const eng::Config& c = o_.config;
    nvme::SwapStoreOptions so;
    so.paths = {o_.swap_dir};
    so.capacity_bytes = need;
    so.stripe_bytes = c.strata.io.stripe_bytes;
    so.request_bytes = c.strata.io.block_bytes;
    so.crc = c.strata.crc;
    so.io.kind = backend_of(c.strata.io.backend);
    so.io.queue_depth = static_cast<unsigned>(c.strata.io.queue_depth);
    so.io.rings = static_cast<unsigned>(c.strata.io.rings);
    so.io.sqpoll = c.strata.io.sqpoll;
    STRATA_ASSIGN_OR_RETURN(store_, nvme::SwapStore::create(so));
  }
  const std::size_t regions = std::max<std::size_t>(1, state_.size_bytes() / state_block_bytes());
  reads_ = blocks("read", r, 0);
  writes_ = blocks("write", w, regions / 2);
  for (const Block& b : reads_) STRATA_RETURN_IF_ERROR(store_->allocate(b.id, b.bytes));
  for (const Block& b : writes_) STRATA_RETURN_IF_ERROR(store_->allocate(b.id, b.bytes));
  reads_bytes_ = r;
  writes_bytes_ = w;
  return run_disk({}, reads_).status();  // the read set's contents (and CRCs)
}

// Reads `reads` and writes `writes` with up to kWindow blocks of each kind
// in flight (each block is split into the engine's requests, with its
// queue depth); returns the seconds.
Result<double> Isolated::run_disk(const std::vector<Block>& reads, const std::vector<Block>& writes) {
  constexpr std::size_t kWindow = 2;
  struct InFlight {
    bool write;
    nvme::SwapIo io;
  };
  std::deque<InFlight> flight;
  std::size_t nr = 0, nw = 0, r_in = 0, w_in = 0;
  auto start_more = [&]() -> Status {
    while (r_in < kWindow && nr < reads.size()) {
      const Block& b = reads[nr++];
      STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, store_->start_read(b.id, {b.data, b.bytes}));
      flight.push_back({false, std::move(io)});
      ++r_in;
    }
    while (w_in < kWindow && nw < writes.size()) {
      const Block& b = writes[nw++];
      STRATA_ASSIGN_OR_RETURN(nvme::SwapIo io, store_->start_write(b.id, {b.data, b.bytes}));
      flight.push_back({true, std::move(io)});
      ++w_in;
    }
    return Status();
  };
  core::Stopwatch sw;
  STRATA_RETURN_IF_ERROR(start_more());
  while (!flight.empty()) {
    InFlight f = std::move(flight.front());
    flight.pop_front();
    STRATA_RETURN_IF_ERROR(f.io.wait());
    --(f.write ? w_in : r_in);
    STRATA_RETURN_IF_ERROR(start_more());
  }
  return sw.elapsed_s();
}

Status Isolated::disk_times(const Shape& shape, IsoSample& s) {
  STRATA_RETURN_IF_ERROR(prepare_disk(shape));
  STRATA_ASSIGN_OR_RETURN(s.read_s, run_disk(reads_, {}));
  STRATA_ASSIGN_OR_RETURN(s.write_s, run_disk({}, writes_));
  if (o_.disk_mixed && !reads_.empty() && !writes_.empty()) {
    STRATA_ASSIGN_OR_RETURN(s.mixed_s, run_disk(reads_, writes_));
  }
  return Status();
}

// --- the CPU ---
Status Isolated::cpu_times(const Shape& shape, IsoSample& s) {
  const Model& m = o_.model;
  const adam::ElemType ct = compute_type();
  const int cb = m.compute_bytes();
  // Untimed: a short pass first, so that oneTBB's worker (shared with the
  // engines' arenas) has joined this arena before the clock starts.
  const auto warm =
      std::min<std::int64_t>(4 * cpu_.tile_elems(), static_cast<std::int64_t>(src_.size_bytes()));
  cpu_.for_each_tile(warm, [&](std::int64_t begin, std::int64_t len) {
    std::memcpy(copyout_.data() + begin, src_.data() + begin, static_cast<std::size_t>(len));
  });
  core::Stopwatch sw;
  for (int g = 0; g < m.layers; ++g) {
    const std::int64_t b = g * m.layer_elems;
    adam::GradPassArgs a;
    a.src = {src_.data() + b * cb, ct, m.layer_elems};
    a.dst = {grads_.data() + b * cb, ct, m.layer_elems};
    a.norm_partials =
        std::span<double>(partials_).subspan(static_cast<std::size_t>(b / nx::kNormBlockElems),
                                             static_cast<std::size_t>(m.layer_elems / nx::kNormBlockElems));
    STRATA_RETURN_IF_ERROR(cpu_.grad_pass(a).status());
  }
  s.grad_pass_s = sw.elapsed_s();
  if (shape.applied) {
    const nx::AdamHyperparams hyper{.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.01};
    const double grad_scale = m.precision == eng::Precision::kFp16 ? 1.0 / 65536.0 : 1.0;
    ++adam_steps_;
    sw.restart();
    auto* st = state_.as<float>().data();
    const std::int64_t updated = o_.adam_layer_elems > 0 ? o_.adam_layer_elems : m.layer_elems;
    for (int g = 0; g < m.layers; ++g) {
      for (std::int64_t off = 0; off < updated; off += o_.chunk_elems) {
        const std::int64_t b = g * m.layer_elems + off;
        const std::int64_t n = std::min(o_.chunk_elems, updated - off);
        const auto un = static_cast<std::size_t>(n);
        adam::AdamStepArgs a;
        a.constants = nx::make_adam_constants(hyper, adam_steps_, grad_scale);
        a.master = {st + 3 * b, un};
        a.exp_avg = {st + 3 * b + n, un};
        a.exp_avg_sq = {st + 3 * b + 2 * n, un};
        a.grad = {grads_.data() + b * cb, ct, n};
        a.copy_out = {copyout_.data() + b * cb, ct, n};
        STRATA_RETURN_IF_ERROR(cpu_.step(a));
      }
    }
    s.adam_s = sw.elapsed_s();
  }
  // CRC64 of every byte read from or written to the disk, on the same threads.
  const std::span<const std::byte> crc_src(state_.data(), state_.size_bytes());
  std::atomic<std::uint64_t> sink{0};
  sw.restart();
  cpu_.for_each_tile(
      static_cast<std::int64_t>(shape.disk_bytes()), [&](std::int64_t begin, std::int64_t len) {
        std::uint64_t crc = 0;
        for (std::uint64_t done = 0; done < static_cast<std::uint64_t>(len);) {
          const std::uint64_t at = (static_cast<std::uint64_t>(begin) + done) % crc_src.size();
          const std::uint64_t n =
              std::min<std::uint64_t>(static_cast<std::uint64_t>(len) - done, crc_src.size() - at);
          crc = nvme::crc64(crc, crc_src.subspan(at, n));
          done += n;
        }
        sink.fetch_xor(crc, std::memory_order_relaxed);
      });
  s.crc_s = shape.disk_bytes() > 0 ? sw.elapsed_s() : 0.0;
  // The host device's copies as memcpys on cpu_adam's threads (the figure
  // the bound used before it measured the host device's own copies).
  const std::uint64_t copy_bytes = copy_bytes_of(shape);
  const std::size_t span = src_.size_bytes();
  sw.restart();
  cpu_.for_each_tile(static_cast<std::int64_t>(copy_bytes), [&](std::int64_t begin, std::int64_t len) {
    for (std::uint64_t done = 0; done < static_cast<std::uint64_t>(len);) {
      const std::uint64_t at = (static_cast<std::uint64_t>(begin) + done) % span;
      const std::uint64_t n = std::min<std::uint64_t>(static_cast<std::uint64_t>(len) - done, span - at);
      std::memcpy(copyout_.data() + at, src_.data() + at, n);
      done += n;
    }
  });
  s.copy_s = sw.elapsed_s();
  crc_sink_ ^= sink.load();
  return Status();
}

// ---------------------------------------------------------------------------
// RateModel.

RateModel RateModel::from(const std::vector<IsoSample>& samples, std::uint64_t fixed_copy_bytes,
                          std::int64_t trainable) {
  RateModel r;
  r.fixed_copy_bytes = fixed_copy_bytes;
  r.trainable = static_cast<double>(trainable);
  auto med = [&](auto per_sample) {
    std::vector<double> v;
    for (const IsoSample& s : samples) v.push_back(per_sample(s));
    return median(v);
  };
  auto per = [](double s, std::uint64_t bytes) { return bytes > 0 ? s / static_cast<double>(bytes) : 0.0; };
  r.device_s = med([](const IsoSample& s) { return s.device_s; });
  r.grad_pass_s = med([](const IsoSample& s) { return s.grad_pass_s; });
  r.adam_s = med([](const IsoSample& s) { return s.adam_s; });
  r.host_kernel_s = med([](const IsoSample& s) { return s.host_kernel_s; });
  r.h2d = med([&](const IsoSample& s) { return per(s.h2d_s, s.shape.bytes.h2d); });
  r.d2h = med([&](const IsoSample& s) { return per(s.d2h_s, s.shape.bytes.d2h); });
  r.host_h2d = med([&](const IsoSample& s) { return per(s.host_h2d_s, s.shape.bytes.h2d); });
  r.host_d2h = med([&](const IsoSample& s) { return per(s.host_d2h_s, s.shape.bytes.d2h); });
  r.read = med([&](const IsoSample& s) { return per(s.read_s, s.shape.bytes.nvme_read); });
  r.write = med([&](const IsoSample& s) { return per(s.write_s, s.shape.bytes.nvme_write); });
  r.mixed = med([&](const IsoSample& s) { return per(s.mixed_s, s.shape.disk_bytes()); });
  r.crc = med([&](const IsoSample& s) { return per(s.crc_s, s.shape.disk_bytes()); });
  r.copy = med([&](const IsoSample& s) {
    return per(s.copy_s, s.shape.bytes.h2d + s.shape.bytes.d2h + fixed_copy_bytes);
  });
  return r;
}

IsoSample RateModel::at(const Shape& s) const {
  const eng::StepBytes& b = s.bytes;
  const auto d = [](std::uint64_t x) { return static_cast<double>(x); };
  IsoSample x;
  x.shape = s;
  x.device_s = device_s;
  x.h2d_s = h2d * d(b.h2d);
  x.d2h_s = d2h * d(b.d2h);
  x.read_s = read * d(b.nvme_read);
  x.write_s = write * d(b.nvme_write);
  x.mixed_s = mixed * d(s.disk_bytes());
  x.grad_pass_s = grad_pass_s;
  x.adam_s = adam_s *
             ((s.applied ? 1.0 : 0.0) + (trainable > 0 ? static_cast<double>(s.discarded) / trainable : 0.0));
  x.crc_s = crc * d(s.disk_bytes());
  x.copy_s = copy * d(b.h2d + b.d2h + fixed_copy_bytes);
  x.host_h2d_s = host_h2d * d(b.h2d);
  x.host_d2h_s = host_d2h * d(b.d2h);
  x.host_kernel_s = host_kernel_s;
  return x;
}

ResTimes RateModel::resources(const Shape& s) const {
  const IsoSample x = at(s);
  return {x.device_s, x.h2d_s, x.d2h_s, x.disk_s(), x.cpu_s()};
}

ResTimes RateModel::resources_tiled(const Shape& s) const {
  const IsoSample x = at(s);
  return {x.device_s, x.h2d_s, x.d2h_s, x.disk_s(), x.cpu_tiled_s()};
}

double RateModel::bound(const ResTimes& t) { return *std::max_element(t.begin(), t.end()); }

std::pair<int, int> top_two(const ResTimes& t) {
  int a = 0;
  for (int r = 1; r < kResCount; ++r) {
    if (t[r] > t[a]) a = r;
  }
  int b = a == 0 ? 1 : 0;
  for (int r = 0; r < kResCount; ++r) {
    if (r != a && t[r] > t[b]) b = r;
  }
  return {a, b};
}

Shape typical_shape(const std::vector<Shape>& shapes) {
  std::vector<std::pair<Shape, int>> counts;
  for (bool need_applied : {true, false}) {
    for (const Shape& s : shapes) {
      if (need_applied && !s.applied) continue;
      auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& p) { return p.first == s; });
      if (it == counts.end()) {
        counts.push_back({s, 1});
      } else {
        ++it->second;
      }
    }
    if (!counts.empty()) break;
  }
  if (counts.empty()) return {};
  return std::max_element(counts.begin(), counts.end(),
                          [](const auto& x, const auto& y) { return x.second < y.second; })
      ->first;
}

// ---------------------------------------------------------------------------
// Tables and JSON.

namespace {
double gb_per_s(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds * 1e-9 : 0.0;
}
}  // namespace

std::string resources_row(const ResTimes& t, const IsoSample& m) {
  char row[200];
  std::snprintf(row, sizeof row,
                "%8.3f %8.3f %8.3f %8.3f %8.3f %12.3f   %.3f + %.3f + %.3f + %.3f (%.3f + %.3f + %.3f)",
                t[kDevice], t[kH2d], t[kD2h], t[kDisk], t[kCpu], m.cpu_tiled_s(), m.grad_pass_s, m.adam_s,
                m.crc_s, m.cpu_copy_s(), m.host_h2d_s, m.host_d2h_s, m.host_kernel_s);
  return row;
}

std::string rates_row(const IsoSample& m, std::int64_t params, std::uint64_t fixed_copy_bytes) {
  const eng::StepBytes& b = m.shape.bytes;
  const double n = static_cast<double>(params);
  char row[200];
  std::snprintf(row, sizeof row, "%9.3f %10.3f %9.3f %12.4g %9.2f %9.2f %9.2f %8.2f %8.2f",
                gb_per_s(b.nvme_read, m.read_s), gb_per_s(b.nvme_write, m.write_s),
                gb_per_s(m.shape.disk_bytes(), m.mixed_s), m.adam_s > 0 ? n / m.adam_s : 0.0,
                m.adam_s > 0 ? 28.0 * n / m.adam_s * 1e-9 : 0.0, gb_per_s(m.shape.disk_bytes(), m.crc_s),
                gb_per_s(b.h2d + b.d2h + fixed_copy_bytes, m.copy_s), gb_per_s(b.h2d, m.host_h2d_s),
                gb_per_s(b.d2h, m.host_d2h_s));
  return row;
}

void json_resources(JsonWriter& j, std::string_view key, const ResTimes& t) {
  j.begin_object(key);
  for (int r = 0; r < kResCount; ++r) j.num(str_cat(kResName[r], "_s"), t[r]);
  j.end_object();
}

void json_bytes(JsonWriter& j, std::string_view key, const eng::StepBytes& b) {
  j.begin_object(key)
      .integer("h2d", static_cast<std::int64_t>(b.h2d))
      .integer("d2h", static_cast<std::int64_t>(b.d2h))
      .integer("nvme_read", static_cast<std::int64_t>(b.nvme_read))
      .integer("nvme_write", static_cast<std::int64_t>(b.nvme_write))
      .end_object();
}

void json_sample(JsonWriter& j, std::string_view key, const IsoSample& s, std::int64_t params,
                 std::uint64_t fixed_copy_bytes) {
  const double n = static_cast<double>(params);
  const eng::StepBytes& b = s.shape.bytes;
  const auto gbps = gb_per_s;
  j.begin_object(key);
  json_bytes(j, "bytes", b);
  j.num("device_s", s.device_s).num("h2d_s", s.h2d_s).num("d2h_s", s.d2h_s);
  j.num("disk_s", s.disk_s())
      .num("disk_read_s", s.read_s)
      .num("disk_write_s", s.write_s)
      .num("disk_mixed_s", s.mixed_s);
  j.num("disk_read_gbps", gbps(b.nvme_read, s.read_s));
  j.num("disk_write_gbps", gbps(b.nvme_write, s.write_s));
  j.num("disk_mixed_gbps", gbps(s.shape.disk_bytes(), s.mixed_s));
  j.num("cpu_s", s.cpu_s()).num("grad_pass_s", s.grad_pass_s).num("adam_s", s.adam_s).num("crc_s", s.crc_s);
  j.num("cpu_copy_s", s.cpu_copy_s())
      .num("host_h2d_s", s.host_h2d_s)
      .num("host_d2h_s", s.host_d2h_s)
      .num("host_kernel_s", s.host_kernel_s);
  j.num("cpu_tiled_s", s.cpu_tiled_s()).num("copy_s", s.copy_s);
  j.num("adam_params_per_s", s.adam_s > 0 ? n / s.adam_s : 0.0);
  j.num("adam_gbps", s.adam_s > 0 ? 28.0 * n / s.adam_s * 1e-9 : 0.0);
  j.num("crc_gbps", gbps(s.shape.disk_bytes(), s.crc_s));
  j.num("copy_gbps", gbps(b.h2d + b.d2h + fixed_copy_bytes, s.copy_s));
  j.num("host_h2d_gbps", gbps(b.h2d, s.host_h2d_s)).num("host_d2h_gbps", gbps(b.d2h, s.host_d2h_s));
  j.end_object();
}

Status make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
    return Status::from_errno(errno, str_cat("mkdir ", path));
  return Status();
}

}  // namespace strata::bench
