// Main of the single-rank test binary (moe_unit_tests): Kokkos only. MPI is started on demand by
// the few tests that use a communicator (moe_test::self_comm()), so the others, each its own
// process under ctest, neither pay for MPI_Init nor depend on Open MPI's session directory.
#include "unit/mpi_on_demand.hpp"

#include <moe/threads.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

int main(int argc, char** argv) {
  moe::apply_host_threads(moe::host_threads_rule_for(1));  // one process: threads <= cores
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    rc = RUN_ALL_TESTS();
  }
  moe_test::finalize_mpi_if_started();
  return rc;
}
