// ComputeHomes: every fetch group's compute copies (bf16/fp16/fp32, the
// layout's offsets) in their home tier: a device buffer, a pinned buffer, or
// a swap block "compute/<g>". load() gives a host view (the pinned home
// itself, or a staging copy), commit() writes a host view home. Under
// overlap "delayed" a group's new copies wait as pending until the next
// step_end commits them. Thread-compatible: the protocol keeps one user per
// group at a time (the engine's calls, the optimizer's job on groups it has
// not marked done, a prefetch after that mark). With compute_sharded
// (stage 3 over several ranks) each home holds this rank's shard of the
// group (Layout's comment) and gather() gives the group whole: a collective
// over the ranks, which every rank calls for the same groups in the same
// order. Private to engine/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/result.h"
#include "engine/internal/buffer_cache.h"
#include "engine/internal/launch_order.h"
#include "engine/internal/view_holds.h"
#include "engine/layout.h"
#include "engine/state/copy_lane.h"
#include "engine/state/frozen_files.h"
#include "gpu/device.h"
#include "nvme/swap_store.h"
#include "partition/communicator.h"

namespace strata::engine {

class ComputeHomes {
 public:
  // Allocates each group's home (`swap` may be null when no home is on nvme).
  // `ranks`: the communicator gather() uses (the caller's thread's), with
  // compute_sharded; else null. `files` (may be null; borrowed, must outlive
  // this): the groups whose frozen part is read from its safetensors files
  // (strata.frozen_base), which then has no swap block. `zero_fill` (may be
  // null): zero-fills the pinned homes before they are locked
  // (gpu::Device::allocate_pinned's fill); without it their contents are
  // undefined until written.
  static core::Result<std::unique_ptr<ComputeHomes>> create(const Layout& layout, gpu::Device& device,
                                                            nvme::SwapStore* swap,
                                                            BufferCache<gpu::PinnedBuffer>& pinned_cache,
                                                            Trace& trace, partition::Communicator* ranks,
                                                            FrozenFiles* files = nullptr,
                                                            const gpu::Device::PinnedFill& zero_fill = nullptr);
  ComputeHomes(const ComputeHomes&) = delete;
  ComputeHomes& operator=(const ComputeHomes&) = delete;

  // Bytes of group g's home (Layout::home_bytes).
  std::uint64_t bytes(std::size_t g) const;
  // The group's compute copies in host memory: the pinned home itself, or a
  // staging copy (4096-aligned, from the pinned cache) read from the device
  // or the swap file on `lane`.
  core::Result<std::span<std::byte>> load(std::size_t g, gpu::PinnedBuffer& staging, const CopyLane& lane);
  // A host buffer for group g's new compute copies when the step rewrites
  // every parameter's (no frozen one in the group): its home is not read
  // (a pinned home is itself the buffer); the padding between parameters is
  // zero, as in every home. Staging from the pinned cache, as load's.
  core::Result<std::span<std::byte>> blank(std::size_t g, gpu::PinnedBuffer& staging);
  // True when a step rewrites every parameter's compute copies in group g.
  bool rewritten_whole(std::size_t g) const;
  // frozen_apart groups: a zeroed host view of the trainable range alone
  // (Layout::trainable_home_range; the pinned home's own range in place),
  // for a step that rewrites it whole; staging from the pinned cache.
  core::Result<std::span<std::byte>> blank_trainable(std::size_t g, gpu::PinnedBuffer& staging);
  // frozen_apart groups: a host view of the trainable range alone
  // (Layout::trainable_home_range; element 0 is the home's byte t.lo): the
  // pinned home's own range, else a staging copy read from the device or
  // the trainable part's swap block on `lane`. The frozen part is not read
  // (a checkpoint that leaves out a base read from its files).
  core::Result<std::span<std::byte>> load_trainable(std::size_t g, gpu::PinnedBuffer& staging,
                                                    const CopyLane& lane);
  // True when group g has frozen and trainable parameters: its home's
  // trainable range (Layout::trainable_home_range) is all a step rewrites,
  // and on nvme it is a swap block of its own, the frozen part another.
  bool frozen_apart(std::size_t g) const;
  // compute_sharded: group g's compute copies whole in host memory (staging
  // from the pinned cache, as load's): every rank's home gathered over the
  // ranks and unpacked (padding zero). This rank gives its pending copy
  // where one waits when `pending` (read_compute), else its home. A
  // collective every rank calls for the same groups in the same order:
  // first each rank's tag (the group, the gather's number, its bytes, its
  // status, its vote), so that a rank that failed, before (`local`, the
  // caller's error: it takes part all the same) or in reading its home
  // (carried with the payload), fails every rank's gather at once with its
  // status code, naming it, and ranks that gather other groups fail with
  // kFailedPrecondition saying so; kUnavailable when a rank leaves. (The
  // tags travel on the heap: kGatherTagBytes a rank.)
  //
  // A fetch's gather takes a vote (`vote`): whether this rank still holds
  // group g's copy on the device since its release (`kept`, in its tag).
  // When every rank does, `all_kept` comes back true and nothing is read or
  // gathered (the span is empty): what each rank kept depends on its device
  // budget's state, so the ranks agree rather than each deciding alone.
  // Else `prepare` runs (the fetch's device buffer) and the home is read
  // after the tags; a failure of either travels to the others in the last
  // kGatherTrailerBytes of the rank's block of the payload.
  //
  // On the device (`device`: a communicator of device buffers, NCCL or Gloo
  // on the host device, the caller's thread's): `prepare` also sets `dst`
  // (the fetch's buffer, the group whole) and `payload` (every rank's home,
  // n x bytes(g) of device memory); the rank's home goes up into its slot
  // of the payload (a device home by a device copy), every rank's status is
  // compared over `ranks` (the host communicator), the payload is
  // all-gathered on the device in place and unpacked into `dst`, queued on
  // the lane's stream with `landed` recorded after it (the payload is read
  // until then); the span returned is empty.
  //
  // A prefetch's gather (another thread's): `host` (its host communicator,
  // for ranks_) and `gathers` (its count of gathers, for this object's), and
  // a rank without room for the copy `declines`: when one does, no rank
  // gathers (`declined` comes back true, the span empty; each rank's fetch
  // gathers later).
  struct FetchVote {
    bool kept = false;
    bool all_kept = false;
    std::function<core::Status()> prepare;
    partition::Communicator* device = nullptr;
    gpu::DeviceSpan dst, payload;
    std::shared_ptr<gpu::Event> landed;
    partition::Communicator* host = nullptr;
    std::uint64_t* gathers = nullptr;
    bool declines = false;
    bool declined = false;
    // A prefetch: a rank short of pinned memory for the gather declines
    // rather than failing every rank's gather.
    bool may_decline = false;
    // On the device: the order of the rank's launches, whose ticket the
    // payload's gather takes once the statuses agree (the caller's thread
    // must be the framework's, in its call order; null: none).
    LaunchOrder* order = nullptr;
    // A turn taken already, in the framework's call order (a prefetch's,
    // taken when it was issued): used instead of `order`.
    LaunchOrder::Turn* turn = nullptr;
  };
  core::Result<std::span<std::byte>> gather(std::size_t g, gpu::PinnedBuffer& staging, const CopyLane& lane,
                                            bool pending = false, core::Status local = {},
                                            FetchVote* vote = nullptr);
  // Writes a host view of group g's compute copies home on `lane`. A frozen
  // part of its files' values (base_of_files: read from them, not written;
  // or a copy kept in pinned memory): the first commit (the initial values)
  // records its CRC64, a later one (a checkpoint's load) must give the same
  // bytes (kFailedPrecondition: check_frozen first).
  core::Status commit(std::size_t g, std::span<const std::byte> host, const CopyLane& lane);
  // A checkpoint's compute copies of group g's frozen part (`frozen`, the
  // bytes of Layout::frozen_home_range) fit its home: kFailedPrecondition
  // when that part is read from files that hold other values, naming the
  // group and files.
  core::Status check_frozen(std::size_t g, std::span<const std::byte> frozen) const;
  // True when group g's frozen part is read from its safetensors files.
  bool frozen_from_files(std::size_t g) const { return files_ != nullptr && layout_.groups[g].frozen_in_files; }
  // True when group g's frozen part is the files' values, recorded at
  // import: read from them (frozen_from_files), or a copy of them kept in
  // pinned memory (GroupPlace::frozen_kept_from_files). Never written after
  // the initial values; a checkpoint leaves it out.
  bool base_of_files(std::size_t g) const { return files_ != nullptr && layout_.groups[g].frozen_of_files(); }
  // The files' record of group g's frozen part (base_of_files(g)): what
  // a checkpoint that leaves the part out names.
  const FrozenFiles& frozen_files() const { return *files_; }
  // A step's commit: of `host`, a view of the home's bytes from `host_lo`
  // on (the whole home, or blank_trainable's range), the trainable range
  // alone goes home; the frozen part of the home is neither read nor written
  // (the frozen base of a LoRA run: no SSD write, no copy). The whole home
  // when every parameter trains.
  core::Status commit_trainable(std::size_t g, std::span<const std::byte> host, const CopyLane& lane,
                                std::uint64_t host_lo = 0);

  // The homes themselves (device: fetch's view; pinned: the optimizer's).
  gpu::DeviceBuffer& device_home(std::size_t g) { return groups_[g].device_home; }
  gpu::PinnedBuffer& pinned_home(std::size_t g) { return groups_[g].pinned_home; }

  // overlap "delayed": group g's new compute copies (the first `bytes` of
  // `buffer`), home at commit_pending.
  void hold_pending(std::size_t g, gpu::PinnedBuffer buffer, std::uint64_t bytes);
  // True when some group holds a pending copy.
  bool has_pending() const;
  // Group g's pending copy (null: none), for a reader that must not commit it.
  const std::byte* pending_copy(std::size_t g) const {
    return groups_[g].pending_bytes > 0 ? groups_[g].pending.data() : nullptr;
  }
  // Sends every pending copy home (a pinned home of the same size is
  // swapped with it; else commit_trainable); true when there was one.
  // Errors name the group.
  core::Result<bool> commit_pending(const CopyLane& lane);
  // Gives every pending copy back to the cache (load_checkpoint replaces them).
  void drop_pending();

  // The engine's destructor: a device home lent to the framework stays
  // with the lease (ViewHolds::park) until it ends.
  void park_device_homes(ViewHolds& holds);

 private:
  struct Group {
    gpu::DeviceBuffer device_home;
    gpu::PinnedBuffer pinned_home;
    std::string block_id;  // nvme: the home, or with frozen_apart its trainable range
    std::string frozen_block_id;  // nvme, frozen_apart: the rest of the home
    gpu::PinnedBuffer pending;
    std::uint64_t pending_bytes = 0;
  };
  // Group g's nvme blocks and the bytes of the home each holds: the home's
  // one block, or with frozen_apart the frozen part's block, then the
  // trainable range's; with the frozen part read from files, the trainable
  // range's block alone (none when the group has no trainable parameter).
  std::vector<std::pair<const std::string*, Layout::ByteRange>> nvme_parts(std::size_t g) const;
  // commit and commit_trainable: the home's bytes `r` from `host`, a view of
  // the home's bytes from `host_lo` on (in place for a pinned home; the
  // device's range; each nvme block within r).
  core::Status write_home(std::size_t g, std::span<const std::byte> host, std::uint64_t host_lo, Layout::ByteRange r,
                          const CopyLane& lane);
  // gather's part on the device (FetchVote's comment), after the tags.
  core::Status gather_on_device(std::size_t g, const CopyLane& lane, FetchVote& vote, partition::Communicator& host);
  // This rank's home of group g into `slot` of device memory, on the lane.
  core::Status home_to_device(std::size_t g, gpu::DeviceSpan slot, const CopyLane& lane);
  ComputeHomes(const Layout& layout, gpu::Device& device, nvme::SwapStore* swap,
               BufferCache<gpu::PinnedBuffer>& pinned_cache, Trace& trace, partition::Communicator* ranks,
               FrozenFiles* files)
      : layout_(layout), device_(device), swap_(swap), pinned_cache_(pinned_cache), trace_(trace), ranks_(ranks),
        files_(files) {}

  const Layout& layout_;
  gpu::Device& device_;
  nvme::SwapStore* swap_;
  BufferCache<gpu::PinnedBuffer>& pinned_cache_;
  Trace& trace_;
  partition::Communicator* ranks_;
  FrozenFiles* files_;
  std::uint64_t gathers_ = 0;  // gather() calls so far: the ranks compare them
  std::vector<Group> groups_;
};

// compute_sharded: rank `rank`'s home of group g packed from the group's
// whole compute buffer `whole` (every element of `home` written: padding
// zero), and the whole buffer unpacked from every rank's home (rank r's at
// byte r x block_bytes + home_at of `blocks`; `whole`'s padding zeroed).
void pack_home(const Layout& layout, std::size_t g, int rank, std::span<const std::byte> whole,
               std::span<std::byte> home);
void unpack_homes(const Layout& layout, std::size_t g, std::span<const std::byte> blocks, std::size_t block_bytes,
                  std::size_t home_at, std::span<std::byte> whole);

}  // namespace strata::engine
