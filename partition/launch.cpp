#include "partition/launch.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "core/str.h"

namespace strata::partition {

using core::Status;
using core::str_cat;

namespace {

// A whole number in [0, 2^31) from variable `name`; nullopt when unset.
core::Result<std::optional<int>> read_int(const GetEnv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr) return std::optional<int>();
  const std::string_view s(v);
  int x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || x < 0) {
    return Status::invalid_argument(str_cat("the launcher's ", name, "=\"", s, "\" is not a whole number >= 0"));
  }
  return std::optional<int>(x);
}

struct Names {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;  // may be null
  // Half set is no launcher (Slurm: an allocation's or batch script's shell
  // has SLURM_PROCID or SLURM_NTASKS, but only an srun step has both these).
  bool half_is_none;
};

constexpr Names kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", false},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", false},
    {"slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", nullptr, true},
};

std::string env_or(const GetEnv& getenv, const char* name, std::string fallback = {}) {
  const char* v = getenv(name);
  return v != nullptr ? std::string(v) : fallback;
}

// The numeric address of `a`.
std::string numeric(const sockaddr* a, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(a, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return {};
  return host;
}

// Node `node`'s task count in Slurm's compressed list ("2(x3),1": 2 tasks on
// each of the first three nodes, 1 on the fourth); 0 when it is not there or
// the list does not parse.
int tasks_on_node(std::string_view list, int node) {
  int first = 0;  // the first node of the entry read
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view entry = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    int tasks = 0, repeat = 1;
    auto [end, ec] = std::from_chars(entry.data(), entry.data() + entry.size(), tasks);
    if (ec != std::errc() || tasks < 1) return 0;
    std::string_view rest(end, static_cast<std::size_t>(entry.data() + entry.size() - end));
    if (!rest.empty()) {
      if (rest.size() < 4 || !rest.starts_with("(x") || !rest.ends_with(")")) return 0;
      auto [e2, ec2] = std::from_chars(rest.data() + 2, rest.data() + rest.size() - 1, repeat);
      if (ec2 != std::errc() || e2 != rest.data() + rest.size() - 1 || repeat < 1) return 0;
    }
    if (node < first + repeat) return tasks;
    first += repeat;
  }
  return 0;
}

bool is_loopback(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  }
  return a->sa_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
}

// This machine's address on the route to `host` (a UDP socket connected
// there sends nothing; the kernel picks the source address); empty when
// that is a loopback address (the master is this machine, named by a
// loopback address such as Debian's 127.0.1.1 for the host name).
core::Result<std::string> address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0) {
    return Status::unavailable(str_cat("the master's address '", host, "' does not resolve (", ::gai_strerror(rc),
                                       "): set STRATA_HOST_ADDRESS to this machine's address the others reach"));
  }
  std::string mine;
  for (const addrinfo* a = found; a != nullptr && mine.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    sockaddr_storage own{};
    socklen_t len = sizeof own;
    bool routed = false;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&own), &len) == 0) {
      routed = true;
      if (!is_loopback(reinterpret_cast<sockaddr*>(&own))) mine = numeric(reinterpret_cast<sockaddr*>(&own), len);
    }
    ::close(fd);
    if (routed && mine.empty()) break;  // a loopback route: the caller looks further
  }
  ::freeaddrinfo(found);
  return mine;
}

// The first address this machine's host name resolves to that is not a
// loopback one.
core::Result<std::string> address_of_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return Status::from_errno(errno, "gethostname");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::string mine;
  if (::getaddrinfo(name, nullptr, &hints, &found) == 0) {
    for (const addrinfo* a = found; a != nullptr && mine.empty(); a = a->ai_next) {
      if (!is_loopback(a->ai_addr)) mine = numeric(a->ai_addr, a->ai_addrlen);
    }
    ::freeaddrinfo(found);
  }
  if (mine.empty()) {
    return Status::unavailable(str_cat("the host name '", name, "' resolves to no address other machines reach: "
                                       "set STRATA_HOST_ADDRESS to this machine's address"));
  }
  return mine;
}

}  // namespace

core::Result<std::string> transport_address(const Launch& launch, const GetEnv& getenv) {
  const std::string given = env_or(getenv, "STRATA_HOST_ADDRESS");
  if (!given.empty()) return given;
  if (!launch.spans_machines()) return std::string("127.0.0.1");
  if (!launch.master.empty()) {
    std::string host = launch.master.substr(0, launch.master.rfind(':'));
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);  // [v6]
    if (!host.empty()) {
      STRATA_ASSIGN_OR_RETURN(std::string toward, address_toward(host));
      if (!toward.empty()) return toward;
    }
  }
  return address_of_hostname();
}


core::Result<std::optional<Launch>> launch_from_environment(const GetEnv& getenv) {
  for (const Names& n : kLaunchers) {
    STRATA_ASSIGN_OR_RETURN(const std::optional<int> rank, read_int(getenv, n.rank));
    STRATA_ASSIGN_OR_RETURN(const std::optional<int> size, read_int(getenv, n.size));
    if (!rank && !size) continue;
    if ((!rank || !size) && n.half_is_none) continue;
    if (!rank || !size) {
      return Status::invalid_argument(str_cat("the launcher (", n.launcher, ") set ", rank ? n.rank : n.size,
                                              " but not ", rank ? n.size : n.rank, ": both are needed"));
    }
    if (*size < 1 || *rank >= *size) {
      return Status::invalid_argument(str_cat("the launcher (", n.launcher, ") set ", n.rank, "=", *rank, " and ",
                                              n.size, "=", *size, ": need 0 <= rank < size"));
    }
    Launch l;
    l.launcher = n.launcher;
    l.rank = *rank;
    l.size = *size;
    STRATA_ASSIGN_OR_RETURN(const std::optional<int> local_rank, read_int(getenv, n.local_rank));
    l.local_rank = local_rank.value_or(0);
    l.local_size = 0;
    if (n.local_size != nullptr) {
      STRATA_ASSIGN_OR_RETURN(const std::optional<int> local_size, read_int(getenv, n.local_size));
      l.local_size = local_size.value_or(0);
    }
    if (l.launcher == "torchrun") {
      // DeepSpeed's launcher (deepspeed, its launch.py) sets RANK and
      // WORLD_SIZE as torchrun does, but the machine's rank count as
      // LOCAL_SIZE, beside CROSS_RANK and CROSS_SIZE (the machine's index and
      // count), which tell its LOCAL_SIZE from another program's; one that
      // does not fit the ranks (local rank < it <= size) is not taken.
      if (l.local_size == 0 && getenv("CROSS_RANK") != nullptr && getenv("CROSS_SIZE") != nullptr) {
        STRATA_ASSIGN_OR_RETURN(const std::optional<int> deepspeed_local, read_int(getenv, "LOCAL_SIZE"));
        const int n = deepspeed_local.value_or(0);
        if (n > l.local_rank && n <= l.size) l.local_size = n;
      }
      // torchrun without --rdzv-id says "none"; a restart of an elastic run keeps its id.
      l.run_id = env_or(getenv, "TORCHELASTIC_RUN_ID");
      if (l.run_id == "none") l.run_id.clear();
      if (!l.run_id.empty()) l.run_id += str_cat(".", env_or(getenv, "TORCHELASTIC_RESTART_COUNT", "0"));
      const std::string addr = env_or(getenv, "MASTER_ADDR"), port = env_or(getenv, "MASTER_PORT");
      if (!addr.empty() || !port.empty()) l.master = str_cat(addr, ":", port);
    } else if (l.launcher == "mpirun") {
      l.run_id = env_or(getenv, "OMPI_MCA_ess_base_jobid");
    } else {
      const std::string job = env_or(getenv, "SLURM_JOB_ID");
      if (!job.empty()) l.run_id = str_cat(job, ".", env_or(getenv, "SLURM_STEP_ID", "0"));
      const std::string launching = env_or(getenv, "SLURM_LAUNCH_NODE_IPADDR");
      if (!launching.empty()) l.master = str_cat(launching, ":0");
      STRATA_ASSIGN_OR_RETURN(const std::optional<int> nodes, read_int(getenv, "SLURM_STEP_NUM_NODES"));
      l.nodes = nodes.value_or(0);
      // This node's tasks: the step's per-node list at this node's index.
      STRATA_ASSIGN_OR_RETURN(const std::optional<int> node, read_int(getenv, "SLURM_NODEID"));
      const std::string per_node = env_or(getenv, "SLURM_STEP_TASKS_PER_NODE");
      if (node.has_value() && !per_node.empty()) l.local_size = tasks_on_node(per_node, *node);
    }
    return std::optional<Launch>(std::move(l));
  }
  return std::optional<Launch>();
}

core::Result<CommunicatorOptions> communicator_options(const Launch& launch, const GetEnv& getenv,
                                                       std::chrono::milliseconds timeout) {
  CommunicatorOptions o;
  o.rank = launch.rank;
  o.size = launch.size;
  o.local_rank = launch.local_rank;
  o.local_size = launch.local_size > 0 ? launch.local_size : 0;
  o.timeout = timeout;
  if (launch.size == 1) {
    o.backend = "self";
    return o;
  }
  o.backend = "gloo";
  auto safe = [](std::string s) {
    for (char& c : s) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
    }
    return s;
  };
  // The run's keys: STRATA_RUN_ID, else the launcher's run or job id.
  std::string run_id = env_or(getenv, "STRATA_RUN_ID", launch.run_id);
  std::string dir = env_or(getenv, "STRATA_RENDEZVOUS_DIR");
  std::error_code ec;
  if (dir.empty()) {
    // One machine: a private directory of this user, named after the master
    // (or job) and the launcher's process, every rank's parent, so that each
    // run meets in a directory of its own.
    if (launch.spans_machines()) {
      return Status::invalid_argument(str_cat("the launcher (", launch.launcher, ") started ", launch.size,
                                              " ranks, ", launch.nodes > 1 ? str_cat("on ", launch.nodes, " machines")
                                                                           : str_cat(launch.local_size, " on this machine"),
                                              ": set "
                                              "STRATA_RENDEZVOUS_DIR to a directory every machine reaches (a "
                                              "shared file system) and STRATA_RUN_ID to a name unique to the run"));
    }
    const std::string tag = !launch.master.empty() ? launch.master : run_id;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    dir = ((ec ? std::filesystem::path("/tmp") : tmp) /
           str_cat("strata-rendezvous-", ::getuid(), "-", safe(tag.empty() ? "local" : tag), "-", ::getppid()))
              .string();
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return Status::from_errno(errno, str_cat("creating the rendezvous directory '", dir, "'"));
    }
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::getuid() ||
        (st.st_mode & 0077) != 0) {
      return Status::permission_denied(str_cat("the rendezvous directory '", dir, "' is not a directory of this "
                                                "user's alone (mode 0700): remove it, or set "
                                                "STRATA_RENDEZVOUS_DIR"));
    }
    if (run_id.empty()) run_id = "run";
    o.store_is_the_runs = true;
  } else {
    if (run_id.empty()) {
      return Status::invalid_argument(str_cat("STRATA_RENDEZVOUS_DIR is set and the launcher (", launch.launcher,
                                              ") gives no run id: set STRATA_RUN_ID to a name unique to this run "
                                              "(a directory's keys are written once)"));
    }
    std::filesystem::create_directories(dir, ec);  // every rank may: one wins, the others find it
    if (!std::filesystem::is_directory(dir, ec)) {
      return Status::unavailable(str_cat("the rendezvous directory '", dir, "' cannot be created",
                                         ec ? str_cat(": ", ec.message()) : std::string()));
    }
  }
  o.store_dir = dir;
  o.prefix = str_cat("strata-", safe(run_id));
  STRATA_ASSIGN_OR_RETURN(o.hostname, transport_address(launch, getenv));
  return o;
}

}  // namespace strata::partition
