// The Gloo backend: host buffers over Gloo's TCP transport, the ranks met
// through a file store. The reductions do not use Gloo's own (whose order of
// summation follows its algorithm): reduce_scatter is an all-to-all (rank j
// receives every rank's block j) and a sum in rank order
// (reduce_in_rank_order); all_reduce is that on equal chunks, then an
// all-gather. Either moves the bytes of a ring algorithm, and every rank ends
// with the same bits.
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/pair.h>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/str.h"
#include "partition/communicator.h"

namespace strata::partition {
namespace {

using core::Status;
using core::str_cat;

// SIGPIPE blocked in this thread while it lives: Gloo writes to its sockets
// without MSG_NOSIGNAL, so a write to a rank whose process ended would kill
// this process (the default action) instead of failing the collective. A
// SIGPIPE raised meanwhile is taken off this thread before the mask is
// restored. The transport's own thread, started under the guard, keeps
// SIGPIPE blocked for good.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
  }
  ~SigpipeBlocked() {
    if (sigismember(&old_, SIGPIPE) == 0) {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      const timespec now{0, 0};
      int taken;
      do {
        taken = sigtimedwait(&pipe, nullptr, &now);
      } while (taken == SIGPIPE || (taken == -1 && errno == EINTR));
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

 private:
  sigset_t old_;
};

std::string why_failed(const std::exception& e, std::chrono::milliseconds timeout) {
  return str_cat("gloo: ", e.what(), " (a rank did not take part within the ", timeout.count(),
                 " ms timeout, or its process ended)");
}

// What names a peer in an error: the address Gloo's TCP transport names it
// by ("Connection closed by peer [127.0.0.1]:41234": what that rank listens
// on for its pair with this one, when this rank connected to it; Gloo names
// the connecting socket's own port when the peer connected instead), and
// its process (host name and pid), looked at once a collective failed: a
// process on this machine that has ended is the rank that left.
struct Peer {
  std::string address;  // empty for this rank
  std::string host;
  pid_t pid = 0;
};

constexpr std::size_t kAddressBytes = 128, kHostBytes = 256;

// The peers, by rank: every rank's addresses and process exchanged (an
// all-gather of fixed-width records) once the ranks met.
std::vector<Peer> exchange_peers(const std::shared_ptr<gloo::Context>& context, std::chrono::milliseconds timeout) {
  const auto n = static_cast<std::size_t>(context->size), me = static_cast<std::size_t>(context->rank);
  const std::size_t record = 8 + kHostBytes + n * kAddressBytes;
  std::vector<char> own(record, '\0'), all(n * record, '\0');
  const auto pid = static_cast<std::int64_t>(::getpid());
  std::memcpy(own.data(), &pid, 8);
  ::gethostname(own.data() + 8, kHostBytes - 1);
  for (std::size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    const std::string a = context->getPair(static_cast<int>(j))->address().str();
    std::memcpy(own.data() + 8 + kHostBytes + j * kAddressBytes, a.data(), std::min(a.size(), kAddressBytes - 1));
  }
  gloo::AllgatherOptions o(context);
  o.setInput(reinterpret_cast<std::uint8_t*>(own.data()), own.size());
  o.setOutput(reinterpret_cast<std::uint8_t*>(all.data()), all.size());
  o.setTimeout(timeout);
  gloo::allgather(o);
  std::vector<Peer> out(n);
  for (std::size_t j = 0; j < n; ++j) {
    const char* r = all.data() + j * record;
    std::int64_t their_pid = 0;
    std::memcpy(&their_pid, r, 8);
    out[j].pid = static_cast<pid_t>(their_pid);
    out[j].host = std::string(r + 8);
    if (j != me) out[j].address = std::string(r + 8 + kHostBytes + me * kAddressBytes);
  }
  return out;
}

// Whether process `pid` of this machine has ended (gone, or a zombie not
// yet reaped by its parent).
bool process_ended(pid_t pid) {
  if (::kill(pid, 0) == 0 || errno == EPERM) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return false;
    const std::size_t paren = line.rfind(')');  // "pid (comm) S ..."
    return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
  }
  return errno == ESRCH;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout,
                   std::vector<Peer> peers)
      : Communicator("gloo", rank, size), context_(std::move(context)), timeout_(timeout), peers_(std::move(peers)) {}

 private:
  // Runs a Gloo call, turning its exceptions into a Status. Gloo names a
  // peer whose connection failed (its process ended, was killed) by its
  // address: the error names its rank too.
  template <typename Call>
  Status guarded(Call&& call) {
    const SigpipeBlocked no_sigpipe;
    try {
      call();
      return Status();
    } catch (const std::exception& e) {
      return Status::unavailable(named_failure(e));
    }
  }

  // The error of a failed Gloo call, naming the rank that failed where it
  // can be told: by the address Gloo names, by a peer process on this
  // machine that has ended, or, with two ranks, the other one. Gloo's
  // transport failures are IoExceptions: its timeouts say "Timed out" or
  // "timeout" (a pair closed after one says so too); any other is a
  // connection that broke (closed or reset by the peer, a write to a closed
  // socket).
  std::string named_failure(const std::exception& e) const {
    const std::string_view what = e.what();
    for (std::size_t j = 0; j < peers_.size(); ++j) {
      if (!peers_[j].address.empty() && what.find(peers_[j].address) != std::string_view::npos) {
        return str_cat("rank ", j, " failed or left (its connection broke): gloo: ", what);
      }
    }
    std::string lower(what);
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool timed_out = lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos;
    // Gloo's transport failures are IoExceptions; anything else (a failed
    // check of Gloo's own) blames no peer.
    const bool transport = dynamic_cast<const gloo::IoException*>(&e) != nullptr;
    // A process's sockets close while it exits, a moment before it is
    // seen to have ended: looked at for up to half a second after a
    // broken connection, once after a timeout.
    const std::string& host = peers_[static_cast<std::size_t>(rank())].host;
    for (int look = 0; look < 50; ++look) {
      for (std::size_t j = 0; j < peers_.size(); ++j) {
        const Peer& p = peers_[j];
        if (static_cast<int>(j) != rank() && p.host == host && p.pid != ::getpid() && process_ended(p.pid)) {
          return str_cat("rank ", j, " failed or left (its process ", p.pid, " has ended): gloo: ", what);
        }
      }
      if (timed_out || !transport) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (size() == 2 && transport) {  // the error names no peer; with two ranks it can only be the other
      return timed_out ? str_cat("rank ", 1 - rank(), " did not take part within the ", timeout_.count(),
                                 " ms timeout, or its process ended: gloo: ", what)
                       : str_cat("rank ", 1 - rank(), " failed or left (its connection broke): gloo: ", what);
    }
    return why_failed(e, timeout_);
  }

  // out[j * block, (j + 1) * block) = rank j's in[rank() * block, ...): the bytes each rank sends to each.
  Status all_to_all(const std::byte* in, std::byte* out, std::size_t block_bytes) {
    return guarded([&] {
      gloo::AlltoallOptions o(context_);
      o.setInput(const_cast<std::uint8_t*>(reinterpret_cast<const std::uint8_t*>(in)),
                 block_bytes * static_cast<std::size_t>(size()));
      o.setOutput(reinterpret_cast<std::uint8_t*>(out), block_bytes * static_cast<std::size_t>(size()));
      o.setTimeout(timeout_);
      gloo::alltoall(o);
    });
  }

  Status gather_bytes(const std::byte* in, std::byte* out, std::size_t block_bytes) {
    return guarded([&] {
      gloo::AllgatherOptions o(context_);
      o.setInput(const_cast<std::uint8_t*>(reinterpret_cast<const std::uint8_t*>(in)), block_bytes);
      o.setOutput(reinterpret_cast<std::uint8_t*>(out), block_bytes * static_cast<std::size_t>(size()));
      o.setTimeout(timeout_);
      gloo::allgather(o);
    });
  }

  Status do_reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, void*) override {
    const std::size_t block = count * dtype_bytes(t);
    std::vector<std::byte> blocks(block * static_cast<std::size_t>(size()));
    STRATA_RETURN_IF_ERROR(all_to_all(static_cast<const std::byte*>(send), blocks.data(), block));
    reduce_in_rank_order(blocks.data(), size(), count, t, op, recv);
    return Status();
  }

  Status do_all_reduce(void* buf, std::size_t count, DType t, ReduceOp op, void*) override {
    const std::size_t n = static_cast<std::size_t>(size());
    const std::size_t chunk = (count + n - 1) / n;  // elements per rank, the last ones padded
    const std::size_t bytes = dtype_bytes(t);
    std::vector<std::byte> padded(chunk * n * bytes);
    std::memcpy(padded.data(), buf, count * bytes);
    std::vector<std::byte> mine(chunk * bytes);
    STRATA_RETURN_IF_ERROR(do_reduce_scatter(padded.data(), mine.data(), chunk, t, op, nullptr));
    STRATA_RETURN_IF_ERROR(gather_bytes(mine.data(), padded.data(), chunk * bytes));
    std::memcpy(buf, padded.data(), count * bytes);
    return Status();
  }

  Status do_all_gather(const void* send, void* recv, std::size_t count, DType t, void*) override {
    const std::size_t block = count * dtype_bytes(t);
    std::vector<std::byte> copy;
    const std::byte* in = static_cast<const std::byte*>(send);
    const std::byte* out = static_cast<const std::byte*>(recv);
    if (in < out + block * static_cast<std::size_t>(size()) && out < in + block) {
      copy.assign(in, in + block);  // in place: Gloo writes the output while it reads the input
      in = copy.data();
    }
    return gather_bytes(in, static_cast<std::byte*>(recv), block);
  }

  Status do_broadcast(void* buf, std::size_t count, DType t, int root, void*) override {
    return guarded([&] {
      gloo::BroadcastOptions o(context_);
      o.setOutput(static_cast<std::uint8_t*>(buf), count * dtype_bytes(t));
      o.setRoot(root);
      o.setTimeout(timeout_);
      gloo::broadcast(o);
    });
  }

  Status do_barrier() override {
    return guarded([&] {
      gloo::BarrierOptions o(context_);
      o.setTimeout(timeout_);
      gloo::barrier(o);
    });
  }

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
  std::vector<Peer> peers_;  // by rank (exchange_peers)
};

}  // namespace

bool gloo_built() { return true; }

// The caller's RendezvousStore as Gloo's: its failures thrown, as Gloo's
// own stores do (make_gloo_communicator catches them). Gloo waits for a key,
// then gets it: the value the wait read is kept for the get (a caller's
// store is a network round trip a read).
class CallerStore final : public gloo::rendezvous::Store {
 public:
  CallerStore(RendezvousStore& store, std::chrono::milliseconds timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    if (Status s = store_.set(key, data); !s.ok()) throw std::runtime_error("the store's set: " + s.to_string());
  }
  std::vector<char> get(const std::string& key) override { return fetch(key, timeout_); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) fetch(key, timeout);
  }

 private:
  std::vector<char> fetch(const std::string& key, std::chrono::milliseconds timeout) {
    if (auto it = read_.find(key); it != read_.end()) return it->second;  // keys are written once
    core::Result<std::vector<char>> got = store_.get(key, timeout);
    if (!got.ok()) throw std::runtime_error("the store's get: " + got.status().to_string());
    return read_.emplace(key, std::move(got).value()).first->second;
  }

  RendezvousStore& store_;
  const std::chrono::milliseconds timeout_;
  std::map<std::string, std::vector<char>> read_;
};

core::Result<std::unique_ptr<Communicator>> make_gloo_communicator(const CommunicatorOptions& o) {
  const bool own_store = o.store != nullptr;
  if (!own_store) {
    if (o.store_dir.empty()) {
      return Status::invalid_argument("communicator \"gloo\": no store_dir (a directory every rank can reach, "
                                      "where the ranks meet) and no store");
    }
    std::error_code ec;
    if (!std::filesystem::is_directory(o.store_dir, ec)) {
      return Status::not_found(str_cat("communicator \"gloo\": store_dir '", o.store_dir, "' is not a directory"));
    }
  }
  const SigpipeBlocked no_sigpipe;
  try {
    std::unique_ptr<gloo::rendezvous::Store> base;
    if (own_store) {
      base = std::make_unique<CallerStore>(*o.store, o.connect_timeout);
    } else {
      base = std::make_unique<gloo::rendezvous::FileStore>(o.store_dir);
    }
    gloo::rendezvous::PrefixStore store(o.prefix, *base);
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(o.connect_timeout);
    context->connectFullMesh(store, device);
    // Every rank connected before any goes on: a rank that returned at once
    // and closed its communicator (a first collective with nothing to send)
    // would otherwise break the connection of a rank still meeting the others.
    gloo::BarrierOptions met(context);
    met.setTimeout(o.connect_timeout);
    gloo::barrier(met);
    std::vector<Peer> peers = exchange_peers(context, o.connect_timeout);
    context->setTimeout(o.timeout);
    return std::unique_ptr<Communicator>(
        new GlooCommunicator(o.rank, o.size, std::move(context), o.timeout, std::move(peers)));
  } catch (const std::exception& e) {
    const std::string where = own_store ? std::string("the caller's store") : str_cat("'", o.store_dir, "'");
    return Status::unavailable(str_cat("communicator \"gloo\": rank ", o.rank, " of ", o.size,
                                       " could not meet the others through ", where, " (prefix \"", o.prefix,
                                       "\"; each run needs a store or prefix of its own): ",
                                       why_failed(e, o.connect_timeout)));
  }
}

}  // namespace strata::partition
