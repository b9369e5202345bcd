#pragma once
/// \file
/// Host threads under MPI: a rank runs `max(1, min(cores it may run on, node cores / ranks on the
/// node))` threads, set as OpenMP's (oneDNN, Kokkos OpenMP) and OpenBLAS's default unless the
/// user set OMP_NUM_THREADS / OPENBLAS_NUM_THREADS; plus the one-line description of the GEMM
/// backend. Call apply_host_threads() after MPI_Init and before Kokkos::initialize (without MPI:
/// apply_host_threads(host_threads_rule_for(1))).

#include <moe/moe_config.hpp>

#include <sched.h>
#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

// OpenBLAS entry points, resolved when Kokkos Kernels' BLAS TPL is OpenBLAS (weak: moe does not
// need it at link time). OpenMP's come from <omp.h> when compiled with OpenMP (moe built with
// oneDNN adds it), else as weak symbols resolved when some library loaded libgomp.
#if defined(_OPENMP)
#include <omp.h>
#else
extern "C" void omp_set_num_threads(int) __attribute__((weak));
extern "C" int omp_get_max_threads(void) __attribute__((weak));
#endif
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads(void) __attribute__((weak));

namespace moe {

namespace detail {
/// Whether OpenMP's runtime is there to be asked (always when compiled with OpenMP).
inline bool have_openmp() {
#if defined(_OPENMP)
  return true;
#else
  return omp_set_num_threads != nullptr && omp_get_max_threads != nullptr;
#endif
}
}  // namespace detail

/// \brief The host threads of this rank and why.
struct HostThreads {
  int threads = 1;        ///< host threads per rank (OpenMP / oneDNN)
  int blas_threads = 1;   ///< OpenBLAS threads per rank (when OpenBLAS is loaded)
  int local_ranks = 1;    ///< ranks on this node
  int node_cores = 1;     ///< cores of this node
  bool from_env = false;  ///< OMP_NUM_THREADS was set by the user
};

/// \brief Cores this process may run on (its affinity mask), at least 1.
inline int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

/// \brief The rule for a process sharing its node with `local_ranks` ranks (itself included).
inline HostThreads host_threads_rule_for(int local_ranks) {
  HostThreads h;
  h.local_ranks = std::max(1, local_ranks);
  h.node_cores = int(std::max(1u, std::thread::hardware_concurrency()));
  h.threads = std::max(1, std::min(affinity_cores(), h.node_cores / h.local_ranks));
  h.blas_threads = h.threads;
  if (char const* env = std::getenv("OMP_NUM_THREADS"); env && std::atoi(env) > 0) {
    h.threads = std::atoi(env);
    h.from_env = true;
  }
  if (char const* env = std::getenv("OPENBLAS_NUM_THREADS"); env && std::atoi(env) > 0)
    h.blas_threads = std::atoi(env);
  return h;
}

/// \brief The rule for this rank (collective over `comm`: counts the ranks sharing its node).
inline HostThreads host_threads_rule(MPI_Comm comm) {
  int local_ranks = 1;
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Comm_size(node, &local_ranks);
  MPI_Comm_free(&node);
  return host_threads_rule_for(local_ranks);
}

/// \brief The rule last applied by apply_host_threads() in this process (defaults before).
inline HostThreads& applied_host_threads() {
  static HostThreads h;
  return h;
}

/// \brief Applies a rule (see the file comment).
inline void apply_host_threads(HostThreads const& h) {
  if (detail::have_openmp()) omp_set_num_threads(h.threads);
  if (openblas_set_num_threads) openblas_set_num_threads(h.blas_threads);
  applied_host_threads() = h;
}

/// \brief Applies host_threads_rule(comm). Collective over `comm`.
inline void apply_host_threads(MPI_Comm comm) { apply_host_threads(host_threads_rule(comm)); }

/// \brief One line naming the GEMM backend of host float GEMMs, its ISA and threads, e.g.
/// "gemm: oneDNN 2.6.3 avx2, 1 thread per rank (2 ranks on 2 cores)".
inline std::string describe_gemm(HostThreads const& h = applied_host_threads()) {
  auto plural = [](int n, char const* word) {
    return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
  };
  std::string s = "gemm: ";
  int threads = h.threads;
#if MOE_HAS_ONEDNN
  s += detail::onednn::describe();
  if (detail::have_openmp()) threads = omp_get_max_threads();
#else
  s += "BLAS through Kokkos Kernels (moe built without oneDNN)";
  if (openblas_get_num_threads) threads = openblas_get_num_threads();
#endif
  s += ", " + plural(threads, "thread") + " per rank";
  s += " (" + plural(h.local_ranks, "rank") + " on " + plural(h.node_cores, "core") +
       (h.from_env ? ", OMP_NUM_THREADS as set" : "") + ")";
  if (threads * h.local_ranks > h.node_cores) s += ", warning: more threads than cores";
  return s;
}

}  // namespace moe
