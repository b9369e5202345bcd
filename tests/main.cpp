// Main of the multi-rank test binary (moe_mpi_tests, under mpirun): MPI, then Kokkos, once for all
// tests.
#include <moe/threads.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  moe::apply_host_threads(MPI_COMM_WORLD);  // ranks x threads <= cores
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
