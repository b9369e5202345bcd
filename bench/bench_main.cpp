// Main of moe_bench: MPI, then Kokkos, then Google Benchmark, with the run's context (Kokkos
// version and backend, BLAS threads, git hash) recorded in the output.
#include <moe/moe_config.hpp>

#include <benchmark/benchmark.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdlib>
#include <string>

// OpenBLAS entry points, resolved only when the BLAS in use is OpenBLAS.
extern "C" int openblas_get_num_threads(void) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));

namespace {

std::string env_or(char const* name, char const* fallback) {
  char const* v = std::getenv(name);
  return v ? v : fallback;
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
