#pragma once
// MPI for the single-rank test binary, started by the first test that asks for it.

#include <moe/comm/mpi.hpp>

namespace moe_test {

/// MPI_COMM_SELF, after starting MPI if no test has yet.
inline MPI_Comm self_comm() {
  int started = 0;
  MPI_Initialized(&started);
  if (!started) MPI_Init(nullptr, nullptr);
  return MPI_COMM_SELF;
}

/// Called by main after the tests: finalizes MPI when a test started it.
inline void finalize_mpi_if_started() {
  int started = 0, finished = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finished);
  if (started && !finished) MPI_Finalize();
}

}  // namespace moe_test
