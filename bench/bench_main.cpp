// Main of moe_bench: MPI, then Kokkos, then Google Benchmark, with the run's context recorded in
// the output: Kokkos version and backend, git hash, BLAS threads, config and core type, oneDNN
// version and ISA, the dense yardstick's GEMM, and the machine yardsticks measured here before any
// benchmark runs (fma_peak, triad_bandwidth: the denominators of peak_ratio and bw_ratio). A
// "warning_blas_core" entry appears when OpenBLAS runs kernels for an older ISA than CPUID reports.
#include <moe/moe_config.hpp>

#include <benchmark/benchmark.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "bench_common.hpp"
#include "yardsticks.hpp"

#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

// OpenBLAS entry points, resolved only when the BLAS in use is OpenBLAS.
extern "C" int openblas_get_num_threads(void) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));
extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace {

std::string env_or(char const* name, char const* fallback) {
  char const* v = std::getenv(name);
  return v ? v : fallback;
}

/// Vector ISA levels, oldest first.
enum IsaLevel { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3, kUnknown = -1 };
char const* const kIsaNames[] = {"sse", "avx", "avx2", "avx512f"};

/// The widest level CPUID (and the OS) reports.
IsaLevel cpu_isa_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  if (__builtin_cpu_supports("avx")) return kAvx;
  return kSse;
#else
  return kUnknown;
#endif
}

/// The ISA level of an OpenBLAS x86 core type (openblas_get_corename()); kUnknown for other
/// names (other architectures, cores this table does not know).
IsaLevel blas_core_level(std::string core) {
  std::transform(core.begin(), core.end(), core.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  for (char const* n : {"skylakex", "cooperlake", "sapphirerapids"})
    if (core == n) return kAvx512;
  for (char const* n : {"haswell", "zen", "excavator"})
    if (core == n) return kAvx2;
  for (char const* n : {"sandybridge", "bulldozer", "piledriver", "steamroller"})
    if (core == n) return kAvx;
  for (char const* n :
       {"katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
        "nehalem", "atom", "athlon", "opteron", "opteron_sse3", "barcelona", "bobcat", "nano"})
    if (core == n) return kSse;
  return kUnknown;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

#if MOE_HAS_ONEDNN
char const* const kBlasUsers =
    ": host float GEMMs run on oneDNN, any GEMM left on this BLAS (e.g. double) is slowed";
#else
char const* const kBlasUsers = ": the Vendor rows and the dense yardstick run on it, slowed";
#endif

/// Machine yardsticks and GEMM backends (measures the FMA peak and the triad bandwidth).
void add_machine_context() {
  int const threads = moe::bench::gemm_threads();
  benchmark::AddCustomContext("gemm_threads", std::to_string(threads));
#if MOE_HAS_ONEDNN
  benchmark::AddCustomContext("onednn", moe::detail::onednn::describe());
#else
  benchmark::AddCustomContext("onednn", "not built (MOE_HAS_ONEDNN=0)");
#endif
  benchmark::AddCustomContext("dense_yardstick", moe::bench::DenseYardstick::candidates());
  auto const peak = moe::bench::fma_peak(threads);
  benchmark::AddCustomContext("fma_peak", fixed(peak.gflops, 1) + " GFLOP/s, " +
                                              std::to_string(peak.threads) + " threads, " +
                                              peak.isa);
  auto const triad = moe::bench::triad_bandwidth(threads);
  benchmark::AddCustomContext(
      "triad_bandwidth", fixed(triad.gbs, 1) + " GB/s, " + std::to_string(triad.threads) +
                             " threads, 3 x " + std::to_string(triad.array_bytes >> 20) + " MiB");
  if (!openblas_get_corename) {
    benchmark::AddCustomContext("blas_core", "OpenBLAS not loaded in this process");
  } else {
    std::string const core = openblas_get_corename();
    benchmark::AddCustomContext("blas_core", core);
    IsaLevel const cpu = cpu_isa_level(), blas = blas_core_level(core);
    if (cpu != kUnknown && blas != kUnknown && blas < cpu)
      benchmark::AddCustomContext("warning_blas_core",
                                  "OpenBLAS runs " + core + " kernels (" + kIsaNames[blas] +
                                      ") but the CPU reports " + kIsaNames[cpu] + kBlasUsers);
  }
}

void add_context() {
  benchmark::AddCustomContext("kokkos_version", std::to_string(KOKKOS_VERSION));
  benchmark::AddCustomContext("kokkos_execution_space", Kokkos::DefaultExecutionSpace::name());
  benchmark::AddCustomContext("kokkos_concurrency",
                              std::to_string(Kokkos::DefaultExecutionSpace().concurrency()));
  benchmark::AddCustomContext("moe_version", std::to_string(MOE_VERSION));
#ifdef MOE_GIT_HASH
  benchmark::AddCustomContext("moe_git_hash", MOE_GIT_HASH);
#endif
  benchmark::AddCustomContext("OPENBLAS_NUM_THREADS", env_or("OPENBLAS_NUM_THREADS", "unset"));
  if (openblas_get_num_threads)
    benchmark::AddCustomContext("blas_threads", std::to_string(openblas_get_num_threads()));
  if (openblas_get_config) benchmark::AddCustomContext("blas_config", openblas_get_config());
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  benchmark::AddCustomContext("mpi_ranks", std::to_string(ranks));
  add_machine_context();
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
      rc = 1;
    } else {
      add_context();
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
    }
  }
  MPI_Finalize();
  return rc;
}
