#include "engine/step/gradient_path.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/clock.h"
#include "core/numerics.h"
#include "core/str.h"
#include "engine/internal/device_collective.h"
#include "engine/internal/elem_types.h"
#include "engine/internal/parallel_fill.h"
#include "engine/working_memory.h"

namespace strata::engine {

using core::Status;
using core::str_cat;
namespace nx = core::numerics;

namespace {
constexpr std::int64_t kBlock = nx::kNormBlockElems;
}  // namespace

core::Result<std::unique_ptr<GradientPath>> GradientPath::create(const Parts& parts, bool threaded) {
  gpu::PinnedBuffer grads;
  const Layout& l = parts.layout;
  std::int64_t held = 0;  // the trainable space, or with several ranks the rank's shards
  for (const GroupPlace& gp : l.groups) held += gp.shard_elems;
  if (held > 0) {
    const auto bytes = static_cast<std::size_t>(held) * static_cast<std::size_t>(l.grad_bytes);
    STRATA_ASSIGN_OR_RETURN(grads, parts.device.allocate_pinned(bytes, "host gradients", zero_fill(parts.cpu_adam)));
  }
  std::unique_ptr<GradientPath> p(
      new GradientPath(parts, std::move(grads), static_cast<std::size_t>(l.trainable_elems / kBlock)));
  if (parts.ranks != nullptr && parts.device_ranks != nullptr) {
    std::int64_t largest = 0;
    for (const GroupPlace& gp : l.groups) largest = std::max(largest, gp.trainable_elems);
    if (largest > 0) {
      STRATA_ASSIGN_OR_RETURN(p->sums_, parts.device.allocate(static_cast<std::uint64_t>(largest) *
                                                                  static_cast<std::uint64_t>(l.share.sum_bytes),
                                                              "gradients to sum over the ranks"));
    }
  } else {
    p->parts_.device_ranks = nullptr;  // one rank: nothing to sum
  }
  if (threaded) {
    STRATA_ASSIGN_OR_RETURN(p->stream_, parts.device.create_stream("gradients"));
    p->grads_queue_ = std::make_unique<SerialQueue>();
    p->pass_queue_ = std::make_unique<SerialQueue>();
  }
  return p;
}

GradientPath::GradientPath(const Parts& parts, gpu::PinnedBuffer grads, std::size_t blocks)
    : parts_(parts), grads_(std::move(grads)), norm_partials_(blocks, 0.0), absent_(parts.layout.params.size(), 0) {
  std::int64_t at = 0;
  for (const GroupPlace& gp : parts.layout.groups) {
    shard_at_.push_back(at);
    at += gp.shard_elems;
  }
  const core::MutexLock lock(mu_);
  posted_.assign(parts.layout.groups.size(), 0);
  down_.assign(parts.layout.groups.size(), 0);
}

GradientPath::~GradientPath() { shutdown(); }

void GradientPath::shutdown() {
  grads_queue_.reset();  // drains the copies (which post passes)
  pass_queue_.reset();   // and the passes
  close();
}

core::Status GradientPath::submit(std::size_t g, gpu::DeviceBuffer grad, std::shared_ptr<gpu::Event> written,
                                  int micro_step, BeforePass before, AfterPass after) {
  if (!threaded()) {
    if (parts_.ranks != nullptr) {
      // With several ranks a failure is sticky here too: a rank that went on
      // would pair its next collective with the others' earlier one.
      const core::MutexLock lock(mu_);
      if (!error_.ok()) {
        parts_.device_cache.put(std::move(grad));
        return Status(error_).annotate(str_cat("grads_ready: an earlier gradient pass failed; the engine cannot go on"));
      }
    }
    LaunchOrder::Turn turn(sums_on_device() ? parts_.launch_order : nullptr);
    Status s = written != nullptr ? parts_.device.synchronize(*written) : Status();
    core::Result<gpu::PinnedBuffer> wire =
        s.ok() ? copy_down(g, grad, parts_.inline_lane, turn) : core::Result<gpu::PinnedBuffer>(s);
    parts_.device_cache.put(std::move(grad));
    s = wire.ok() ? pass(g, std::move(wire).value(), micro_step) : wire.status();
    if (!s.ok() && parts_.ranks != nullptr) fail(s);
    return s;
  }
  // The device buffer travels with the copy (the next grad_buffer gets a new
  // one); whatever becomes of the copy (a failed one skips those after it),
  // it goes back through the cache, which keeps a lent one aside.
  BufferCache<gpu::DeviceBuffer>* cache = &parts_.device_cache;
  std::shared_ptr<gpu::DeviceBuffer> buffer(new gpu::DeviceBuffer(std::move(grad)), [cache](gpu::DeviceBuffer* b) {
    cache->put(std::move(*b));
    delete b;
  });
  const std::int64_t elems = parts_.layout.groups[g].gradient_elems();
  {
    const core::MutexLock lock(mu_);
    ++posted_[g];
    ++in_flight_;
    in_flight_elems_ += elems;
  }
  // A sum on the device takes its launch's ticket here, in the framework's
  // call order (given up should the copy not run).
  auto turn = std::make_shared<LaunchOrder::Turn>(sums_on_device() ? parts_.launch_order : nullptr);
  grads_queue_->post([this, g, elems, buffer, micro_step, written, turn, before = std::move(before),
                      after = std::move(after)] {
    // At most kGradientCopiesInFlight copies down held at once (the pinned
    // working memory finalize reserved: engine/working_memory.h); a slot
    // comes back when its copy's pinned buffer is released, passed or not.
    {
      const core::MutexLock lock(mu_);
      cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) { return copies_in_flight_ < kGradientCopiesInFlight; });
      ++copies_in_flight_;
    }
    const auto release_slot = [this] {
      const core::MutexLock lock(mu_);
      --copies_in_flight_;
      cv_.notify_all();
    };
    const core::Stopwatch clock;
    Status s = written != nullptr ? parts_.device.wait(stream_, *written) : Status();
    core::Result<gpu::PinnedBuffer> wire =
        s.ok() ? copy_down(g, *buffer, {&stream_, &bytes_, TraceTrack::kGradDevice}, *turn)
               : core::Result<gpu::PinnedBuffer>(s);
    turn->done();
    parts_.device_cache.put(std::move(*buffer));
    copy_seconds_ += clock.elapsed_s();
    {
      const core::MutexLock lock(mu_);
      ++down_[g];
      cv_.notify_all();
    }
    if (!wire.ok()) {
      release_slot();
      fail(wire.status());  // a job waiting for these gradients fails with it
      passed(elems);
      return wire.status();
    }
    // The pass moves the buffer out (and puts it back in the cache); a pass
    // skipped after an earlier error leaves it here.
    BufferCache<gpu::PinnedBuffer>* pinned = &parts_.pinned_cache;
    std::shared_ptr<gpu::PinnedBuffer> host(new gpu::PinnedBuffer(std::move(wire).value()),
                                            [pinned, release_slot](gpu::PinnedBuffer* b) {
                                              pinned->put(std::move(*b));
                                              delete b;
                                              release_slot();
                                            });
    pass_queue_->post([this, g, elems, host, micro_step, before, after] {
      Status ps = before != nullptr ? before() : Status();
      const core::Stopwatch pass_clock;
      if (ps.ok()) ps = pass(g, std::move(*host), micro_step);
      pass_seconds_ += pass_clock.elapsed_s();
      if (ps.ok() && after != nullptr) after();
      if (!ps.ok()) fail(ps);
      host->reset();  // its staging is free (back in the cache after a pass)
      passed(elems);
      return ps;
    });
    return Status();
  });
  return Status();
}

void GradientPath::note_absent(std::size_t g, int micro_step, std::span<const std::size_t> params) {
  if (micro_step == 0) {
    for (std::size_t pi : parts_.layout.groups[g].params) absent_[pi] = 0;
  }
  for (std::size_t pi : params) ++absent_[pi];
}

core::Result<gpu::PinnedBuffer> GradientPath::copy_down(std::size_t g, const gpu::DeviceBuffer& grad,
                                                         const CopyLane& lane, LaunchOrder::Turn& turn) {
  if (sums_on_device()) {
    core::Result<gpu::PinnedBuffer> wire = sum_down(g, grad, lane, turn);
    // Nothing queued may still read `grad` once it goes back to the cache.
    if (!wire.ok()) parts_.device.synchronize(*lane.stream).ignore_error();
    return wire;
  }
  // Device -> host, in the compute dtype and the compute layout of the
  // group's trainable part (the buffer holds that alone: gradient_elems).
  const GroupPlace& gp = parts_.layout.groups[g];
  const std::uint64_t bytes =
      static_cast<std::uint64_t>(gp.gradient_elems()) * static_cast<std::uint64_t>(parts_.layout.compute_bytes);
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer wire, parts_.pinned_cache.get(bytes, "gradient staging"));
  STRATA_RETURN_IF_ERROR(
      lane_d2h(parts_.device, parts_.trace, lane, wire.bytes().first(bytes), grad.subspan(0, bytes)));
  return wire;
}

core::Result<gpu::PinnedBuffer> GradientPath::sum_down(std::size_t g, const gpu::DeviceBuffer& grad,
                                                        const CopyLane& lane, LaunchOrder::Turn& turn) {
  const Layout& layout = parts_.layout;
  const GroupPlace& gp = layout.groups[g];
  const auto cb = static_cast<std::uint64_t>(layout.compute_bytes);
  const gpu::ElemType compute = gpu_type(layout.compute_bytes, parts_.precision);
  gpu::Device& d = parts_.device;
  gpu::Stream& stream = *lane.stream;
  // The sums' dtype (communication_data_type): fp32, or bf16.
  const auto sb = static_cast<std::uint64_t>(layout.share.sum_bytes);
  const gpu::ElemType sum_type = sb == 4 ? gpu::ElemType::kF32 : gpu::ElemType::kBf16;
  const gpu::DeviceSpan sums = sums_.subspan(0, static_cast<std::uint64_t>(gp.trainable_elems) * sb);
  {
    // The trainable layout in the sums' dtype (fp32: exact from bf16 and
    // fp16, as the host's pass converts): parameters adjacent in both
    // layouts converted as one run, the padding between runs zeroed.
    TraceScope t(parts_.trace, lane.track, str_cat("pack ", gp.name), sums.size_bytes());
    std::vector<std::size_t> order;
    for (std::size_t pi : gp.params) {
      if (layout.places[pi].trainable_offset >= 0) order.push_back(pi);
    }
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return layout.places[a].trainable_offset < layout.places[b].trainable_offset;
    });
    const auto zero = [&](std::int64_t from, std::int64_t to) {
      if (to <= from) return Status();
      return d.fill(stream, gpu::typed(sums.subspan(static_cast<std::uint64_t>(from - gp.trainable_begin) * sb,
                                                    static_cast<std::uint64_t>(to - from) * sb),
                                       sum_type),
                    0.0f);
    };
    std::int64_t at = gp.trainable_begin;  // the next element of the trainable layout to write
    for (std::size_t i = 0; i < order.size();) {
      const ParamPlace& first = layout.places[order[i]];
      std::int64_t n = layout.params[order[i]].numel();
      std::size_t j = i + 1;
      for (; j < order.size(); ++j) {
        const ParamPlace& next = layout.places[order[j]];
        if (next.trainable_offset != first.trainable_offset + n || next.compute_offset != first.compute_offset + n) {
          break;
        }
        n += layout.params[order[j]].numel();
      }
      STRATA_RETURN_IF_ERROR(zero(at, first.trainable_offset));
      const gpu::DeviceSpan dst = sums.subspan(static_cast<std::uint64_t>(first.trainable_offset - gp.trainable_begin) * sb,
                                               static_cast<std::uint64_t>(n) * sb);
      const gpu::DeviceSpan src = grad.subspan(
          static_cast<std::uint64_t>(first.compute_offset - gp.trainable_compute_begin) * cb,
          static_cast<std::uint64_t>(n) * cb);
      STRATA_RETURN_IF_ERROR(d.convert(stream, gpu::typed(dst, sum_type), gpu::typed(src, compute)));
      at = first.trainable_offset + n;
      i = j;
    }
    STRATA_RETURN_IF_ERROR(zero(at, gp.trainable_begin + gp.trainable_elems));
  }
  // Summed over the ranks in place: this rank's shard of the sum where its
  // shard of the gradients was.
  partition::Communicator& comm = *parts_.device_ranks;
  const auto shard = static_cast<std::size_t>(gp.shard_elems);
  const std::uint64_t shard_bytes = static_cast<std::uint64_t>(shard) * sb;
  const partition::DType wire_type = sb == 4 ? partition::DType::kF32 : partition::DType::kBf16;
  const std::uint64_t own = static_cast<std::uint64_t>(comm.rank()) * shard_bytes;
  {
    TraceScope t(parts_.trace, TraceTrack::kRanks, str_cat("reduce-scatter on the device ", gp.name),
                 sums.size_bytes());
    const gpu::DeviceSpan spans[] = {sums};
    Status s = run_device_collective(
        d, stream, spans, comm, turn,
        [&comm, shard, own, wire_type](void* native, std::span<void* const> ptrs) {
          auto* base = static_cast<std::byte*>(ptrs[0]);
          return comm.reduce_scatter(base, base + own, shard, wire_type, partition::ReduceOp::kSum, native);
        });
    STRATA_RETURN_IF_ERROR(std::move(s).annotate(str_cat("the gradients of group '", gp.name, "'")));
  }
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer wire, parts_.pinned_cache.get(shard_bytes, "gradient staging"));
  STRATA_RETURN_IF_ERROR(
      lane_d2h(d, parts_.trace, lane, wire.bytes().first(shard_bytes), sums.subspan(own, shard_bytes)));
  return wire;
}

core::Status GradientPath::pass(std::size_t g, gpu::PinnedBuffer wire, int micro_step) {
  if (sums_on_device()) {
    // The rank's shard of this micro-batch's sum, in the sums' dtype.
    Status s = pass_sum(g, wire.data(), parts_.layout.share.sum_bytes == 4 ? adam::ElemType::kF32 : adam::ElemType::kBf16,
                        micro_step);
    parts_.pinned_cache.put(std::move(wire));
    return s;
  }
  // Into the trainable layout, then the gradient pass into the host gradients.
  const Layout& layout = parts_.layout;
  const GroupPlace& gp = layout.groups[g];
  const int cb = layout.compute_bytes;
  const std::uint64_t tbytes = static_cast<std::uint64_t>(gp.trainable_elems) * static_cast<std::uint64_t>(cb);
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer packed, parts_.pinned_cache.get(tbytes, "gradient staging"));
  std::memset(packed.data(), 0, tbytes);
  for (std::size_t pi : gp.params) {
    const ParamPlace& pl = layout.places[pi];
    if (pl.trainable_offset < 0) continue;
    std::memcpy(packed.data() + (pl.trainable_offset - gp.trainable_begin) * cb,
                wire.data() + (pl.compute_offset - gp.trainable_compute_begin) * cb,
                static_cast<std::size_t>(layout.params[pi].numel()) * static_cast<std::size_t>(cb));
  }
  // With several ranks the pass writes this micro-batch's fp32 gradients
  // into staging, which reduce_over_ranks sums over the ranks into the
  // rank's shard; its partials and flag are not the step's (they are
  // gathered there).
  const bool ranks = parts_.ranks != nullptr;
  gpu::PinnedBuffer local;
  if (ranks) {
    STRATA_ASSIGN_OR_RETURN(local, parts_.pinned_cache.get(static_cast<std::uint64_t>(gp.trainable_elems) * 4,
                                                           "gradients to sum over ranks"));
  }
  std::vector<double> local_partials(ranks ? static_cast<std::size_t>(gp.trainable_elems / kBlock) : 0);
  adam::GradPassArgs a;
  a.src = {packed.data(), adam_type(cb, parts_.precision), gp.trainable_elems};
  a.dst = {ranks ? local.data() : shard_grads(g), adam_type(layout.grad_bytes, parts_.precision), gp.trainable_elems};
  a.accumulate = !ranks && layout.grad_bytes == 4 && micro_step > 0;  // fp32 accumulators add up the micro-batches
  a.norm_partials = ranks ? std::span<double>(local_partials)
                          : std::span<double>(norm_partials_).subspan(
                                static_cast<std::size_t>(gp.trainable_begin / kBlock),
                                static_cast<std::size_t>(gp.trainable_elems / kBlock));
  core::Result<adam::GradPassResult> r = [&] {
    const CpuTurns::Turn turn(parts_.turns, CpuTurns::kUrgent);
    TraceScope tp(parts_.trace, TraceTrack::kCpuAdam, str_cat("gradient pass ", gp.name), tbytes);
    return parts_.cpu_adam.grad_pass(a);
  }();
  parts_.pinned_cache.put(std::move(wire));
  parts_.pinned_cache.put(std::move(packed));
  if (!r.ok()) {
    if (ranks) parts_.pinned_cache.put(std::move(local));
    return r.status();
  }
  if (!ranks) {
    nonfinite_ = nonfinite_ || r->nonfinite;
    return Status();
  }
  Status s = reduce_over_ranks(g, local.data(), micro_step);
  parts_.pinned_cache.put(std::move(local));
  return s;
}

core::Status GradientPath::reduce_over_ranks(std::size_t g, const std::byte* local, int micro_step) {
  // This micro-batch's fp32 gradients of the group are summed over the
  // ranks in rank order; rank r gets shard r.
  const GroupPlace& gp = parts_.layout.groups[g];
  const auto shard = static_cast<std::size_t>(gp.shard_elems);
  STRATA_ASSIGN_OR_RETURN(gpu::PinnedBuffer sum, parts_.pinned_cache.get(shard * 4, "gradients summed over ranks"));
  {
    TraceScope t(parts_.trace, TraceTrack::kRanks, str_cat("reduce-scatter ", gp.name), gp.trainable_elems * 4);
    Status s =
        parts_.ranks->reduce_scatter(local, sum.data(), shard, partition::DType::kF32, partition::ReduceOp::kSum);
    if (!s.ok()) {
      parts_.pinned_cache.put(std::move(sum));
      return std::move(s).annotate(str_cat("the gradients of group '", gp.name, "'"));
    }
  }
  Status s = pass_sum(g, sum.data(), adam::ElemType::kF32, micro_step);
  parts_.pinned_cache.put(std::move(sum));
  return s;
}

core::Status GradientPath::pass_sum(std::size_t g, const std::byte* sum, adam::ElemType sum_type, int micro_step) {
  // The rank's shard of the sum over the ranks, passed into (or, after the
  // first micro-batch, added to) its host gradients. After the last
  // micro-batch the partials and flag of the shard's sums are every rank's
  // to gather, so each rank's norm is the whole group's, summed in block
  // order.
  partition::Communicator& comm = *parts_.ranks;
  const GroupPlace& gp = parts_.layout.groups[g];
  const auto shard = static_cast<std::size_t>(gp.shard_elems);
  const std::size_t blocks = shard / kBlock;
  // Every rank must sum the same group at the same time; the sequence of
  // (group, micro-batch) sums is hashed and compared at the partials' gather
  // (FNV-1a), so ranks that handed groups over in other orders fail the
  // step before any of it is applied.
  for (const std::uint64_t v : {static_cast<std::uint64_t>(g), static_cast<std::uint64_t>(micro_step)}) {
    for (int b = 0; b < 8; ++b) sequence_hash_ = (sequence_hash_ ^ ((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
  }
  const std::span<double> partials(norm_partials_);
  const std::size_t first_block = static_cast<std::size_t>(gp.trainable_begin / kBlock);
  const std::size_t own_block = static_cast<std::size_t>(gp.shard_begin / kBlock);
  adam::GradPassArgs a;
  a.src = {sum, sum_type, static_cast<std::int64_t>(shard)};
  a.dst = {shard_grads(g), adam::ElemType::kF32, static_cast<std::int64_t>(shard)};
  a.accumulate = micro_step > 0;
  a.norm_partials = partials.subspan(own_block, blocks);
  core::Result<adam::GradPassResult> r = [&] {
    const CpuTurns::Turn turn(parts_.turns, CpuTurns::kUrgent);
    TraceScope tp(parts_.trace, TraceTrack::kCpuAdam, str_cat("gradient pass (summed) ", gp.name), shard * 4);
    return parts_.cpu_adam.grad_pass(a);
  }();
  STRATA_RETURN_IF_ERROR(r.status());
  if (micro_step + 1 < parts_.micro_steps) return Status();
  // Per rank: its blocks' partials, its flag, the group and the hash of its
  // sums so far (in two exact 32-bit halves), then for each of the group's
  // parameters whether it got no gradient in any of the rank's micro-batches
  // (note_absent): it got none in the step only if no rank gave it one.
  const std::vector<std::size_t>& params = gp.params;
  const std::size_t per_rank = blocks + 4 + params.size();
  std::vector<double> mine(per_rank);
  std::copy_n(partials.begin() + static_cast<std::ptrdiff_t>(own_block), blocks, mine.begin());
  mine[blocks] = r->nonfinite ? 1.0 : 0.0;
  mine[blocks + 1] = static_cast<double>(g);
  mine[blocks + 2] = static_cast<double>(sequence_hash_ >> 32);
  mine[blocks + 3] = static_cast<double>(sequence_hash_ & 0xffffffffull);
  for (std::size_t i = 0; i < params.size(); ++i) mine[blocks + 4 + i] = no_gradient(params[i]) ? 1.0 : 0.0;
  std::vector<double> all(per_rank * static_cast<std::size_t>(comm.size()));
  {
    TraceScope t(parts_.trace, TraceTrack::kRanks, str_cat("norm partials ", gp.name), all.size() * 8);
    STRATA_RETURN_IF_ERROR(comm.all_gather(mine.data(), all.data(), per_rank, partition::DType::kF64)
                               .annotate(str_cat("the norm partials of group '", gp.name, "'")));
  }
  for (std::size_t k = 0; k < static_cast<std::size_t>(comm.size()); ++k) {
    const double* theirs = all.data() + k * per_rank + blocks + 1;
    if (!std::equal(theirs, theirs + 3, mine.data() + blocks + 1)) {
      const auto other = static_cast<std::size_t>(theirs[0]);
      return Status::failed_precondition(str_cat(
          "rank ", comm.rank(), " summed group '", gp.name, "' where rank ", k, " summed '",
          other < parts_.layout.groups.size() ? parts_.layout.groups[other].name : "?",
          "', or the two handed their groups' gradients over in other orders this step: every rank must call "
          "grads_ready for the same groups in the same order, every micro-batch"));
    }
  }
  for (std::size_t k = 0; k < static_cast<std::size_t>(comm.size()); ++k) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(k * per_rank), blocks,
                partials.begin() + static_cast<std::ptrdiff_t>(first_block + k * blocks));
    nonfinite_ = nonfinite_ || all[k * per_rank + blocks] != 0.0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (all[k * per_rank + blocks + 4 + i] == 0.0) absent_[params[i]] = 0;  // rank k gave it a gradient
    }
  }
  return Status();
}

void GradientPath::passed(std::int64_t elems) {
  const core::MutexLock lock(mu_);
  --in_flight_;
  in_flight_elems_ -= elems;
  cv_.notify_all();
}

void GradientPath::fail(const Status& s) {
  const core::MutexLock lock(mu_);
  if (error_.ok()) error_ = s;
  cv_.notify_all();
}

core::Status GradientPath::wait(const char* op) {
  if (!threaded()) return Status();
  Status s = grads_queue_->drain();  // the copies first: they post the passes
  if (!s.ok()) return std::move(s).annotate(str_cat(op, ": a gradient copy failed; the engine cannot go on"));
  s = pass_queue_->drain();
  if (!s.ok()) return std::move(s).annotate(str_cat(op, ": a gradient pass failed; the engine cannot go on"));
  return Status();
}

core::Status GradientPath::wait_down(std::size_t g, std::string_view group, std::int64_t room_elems) {
  const std::int64_t elems = parts_.layout.groups[g].gradient_elems();
  const core::MutexLock lock(mu_);
  cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) {
    const bool room = in_flight_ <= 1 || in_flight_elems_ <= room_elems - elems;
    return (down_[g] >= posted_[g] && room) || !error_.ok();
  });
  if (!error_.ok()) {
    return Status(error_).annotate(str_cat("grad_buffer('", group, "'): the gradient path failed"));
  }
  return Status();
}

double GradientPath::raw_norm() const {
  return std::sqrt(nx::sum_norm_partials(norm_partials_.data(), static_cast<std::int64_t>(norm_partials_.size())));
}

bool GradientPath::take_nonfinite() { return std::exchange(nonfinite_, false); }

GradientPath::Totals GradientPath::take_totals() {
  Totals t;
  t.bytes = std::exchange(bytes_, {});
  t.seconds = std::exchange(copy_seconds_, 0.0) + std::exchange(pass_seconds_, 0.0);
  return t;
}

void GradientPath::post_marker(std::int64_t seq) {
  // Behind every copy posted so far on the gradient thread, then behind
  // their passes on the pass thread (each posts the next: the order holds).
  grads_queue_->post([this, seq] {
    const StepBytes bytes = std::exchange(bytes_, {});
    const double copy_s = std::exchange(copy_seconds_, 0.0);
    pass_queue_->post([this, seq, bytes, copy_s] {
      const Marker m{raw_norm(), take_nonfinite()};
      const double pass_s = std::exchange(pass_seconds_, 0.0);
      const core::MutexLock lock(mu_);
      marker_done_ = seq;
      marker_ = m;
      late_.bytes += bytes;
      late_.seconds += copy_s + pass_s;
      cv_.notify_all();
      return Status();
    });
    return Status();
  });
}

core::Result<GradientPath::Marker> GradientPath::wait_marker(std::int64_t seq, std::int64_t norm_step) {
  const core::MutexLock lock(mu_);
  cv_.wait(mu_, [&]() STRATA_REQUIRES(mu_) { return marker_done_ >= seq || !error_.ok() || closed_; });
  if (marker_done_ >= seq) return marker_;
  if (!error_.ok()) return Status(error_).annotate(str_cat("the gradients of step ", norm_step));
  return Status::cancelled(str_cat("the engine closed before the gradients of step ", norm_step, " were in"));
}

GradientPath::Totals GradientPath::take_late_totals() {
  const core::MutexLock lock(mu_);
  return std::exchange(late_, {});
}

void GradientPath::close() {
  const core::MutexLock lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

}  // namespace strata::engine
