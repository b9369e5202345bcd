#pragma once
/// \file
/// How much host memory a rank may still use (MemAvailable within the cgroup limits, shared by the
/// node's ranks), and the check refusing an estimate that does not fit (no device memory).

#include <moe/distributed/memory_estimate.hpp>
#include <moe/error.hpp>

#include <moe/comm/mpi.hpp>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

namespace moe::distributed {

namespace detail {

inline std::int64_t read_number(std::string const& path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return -1;
  char* end = nullptr;
  long long const v = std::strtoll(s.c_str(), &end, 10);
  return end && *end == '\0' && v >= 0 ? std::int64_t(v) : -1;
}

/// Value of `key` (the number after it) in a file of "key value ..." lines (memory.stat, meminfo).
inline std::int64_t read_field(std::string const& path, std::string const& key) {
  std::ifstream in(path);
  std::string k, rest;
  long long v = 0;
  while (in >> k >> v) {
    if (k == key) return std::int64_t(v);
    std::getline(in, rest);
  }
  return -1;
}

/// Bytes the cgroup at `dir` still admits: limit - usage + inactive file pages (-1: no limit).
inline std::int64_t cgroup_room(std::string const& dir, bool v2) {
  std::int64_t const limit = read_number(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"));
  if (limit < 0 || limit >= (std::int64_t(1) << 60)) return -1;  // none ("max", or v1's ~2^63)
  std::int64_t const usage = read_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"));
  if (usage < 0) return -1;
  std::int64_t const inactive = std::max<std::int64_t>(
      0, read_field(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file"));
  return std::max<std::int64_t>(0, std::min(limit, limit - usage + inactive));
}

}  // namespace detail

/// \brief Host bytes the node can still allocate (MemAvailable within the cgroups; -1: unknown).
inline std::int64_t available_memory_bytes() {
  std::int64_t const kib = detail::read_field("/proc/meminfo", "MemAvailable:");
  std::int64_t avail = kib < 0 ? -1 : kib * 1024;
  // cgroups: "0::/path" (v2) or "N:ctrl,memory,...:/path" (v1).
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    auto const a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::string const ctrl = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    bool const v2 = line.compare(0, a, "0") == 0 && ctrl.empty();
    bool v1 = false;
    for (auto const& c : MemoryEstimate::split_keys(ctrl)) v1 = v1 || c == "memory";
    if (!v2 && !v1) continue;
    std::string const base = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    // This cgroup and its ancestors (a cgroup namespace shows "/": the mount is its own root).
    while (true) {
      std::int64_t const room =
          detail::cgroup_room(base + (path == "/" ? std::string() : path), v2);
      if (room >= 0) avail = avail < 0 ? room : std::min(avail, room);
      if (path.empty() || path == "/") break;
      auto const slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return avail;
}

/// \brief Collective over `comm`: how many of its ranks share this rank's node.
inline int ranks_on_node(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  int n = 1;
  if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS)
    return 1;
  MPI_Comm_size(node, &n);
  MPI_Comm_free(&node);
  return std::max(1, n);
}

/// \brief Throws ConfigError naming the keys to reduce when `est` does not fit this rank's share
/// of `available`; nothing when that is < 0 or MOE_SKIP_MEMORY_CHECK is set (non-empty, not 0).
/// \param available available_memory_bytes() of the node (or cgroup)
/// \param ranks_on_node ranks sharing it (ranks_on_node(comm)), >= 1
/// \param keys_hint the keys to name; empty: the keys of the largest items (keys_to_reduce())
inline void require_fits(std::string const& who, MemoryEstimate const& est, std::int64_t available,
                         int ranks_on_node, std::string const& keys_hint = "") {
  char const* skip = std::getenv("MOE_SKIP_MEMORY_CHECK");
  if (available < 0 || (skip && *skip != '\0' && std::string(skip) != "0")) return;
  int const ranks = std::max(1, ranks_on_node);
  std::int64_t const share = available / ranks, need = est.total();
  if (need <= share) return;
  std::string keys = keys_hint;
  if (keys.empty()) {
    auto const ks = est.keys_to_reduce();
    for (std::size_t i = 0; i < ks.size(); ++i)
      keys += (i == 0 ? "" : i + 1 == ks.size() ? " or " : ", ") + ks[i];
  }
  throw ConfigError(moe::detail::cat(
      who, " needs about ", format_bytes(need), " per rank (", est.breakdown(),
      ") but this node has ", format_bytes(available), " available",
      ranks > 1 ? moe::detail::cat(" for ", ranks, " ranks (", format_bytes(share), " each)")
                : std::string(),
      keys.empty() ? std::string() : ": reduce " + keys,
      " (or set MOE_SKIP_MEMORY_CHECK=1 to run anyway)"));
}

}  // namespace moe::distributed

namespace moe {
using distributed::available_memory_bytes, distributed::ranks_on_node, distributed::require_fits;
}  // namespace moe
