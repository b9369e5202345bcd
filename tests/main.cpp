// Main of the multi-rank test binary (moe_mpi_tests, under mpirun): MPI, then Kokkos, once for all
// tests.
#include <moe/threads.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <moe/comm/mpi.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  // ranks x threads <= cores. The harness's own rule on top: a set OMP_NUM_THREADS is the thread
  // budget of the whole test, split over its ranks on this node (OMP_NUM_THREADS=4 ctest runs the
  // 4-rank test with 1 thread per rank, not 16 threads on the node).
  moe::HostThreads h = moe::host_threads_rule(MPI_COMM_WORLD);
  if (h.from_env) h.threads = std::max(1, h.threads / h.local_ranks);
  moe::apply_host_threads(h);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    rc = RUN_ALL_TESTS();
  }
  MPI_Finalize();
  return rc;
}
