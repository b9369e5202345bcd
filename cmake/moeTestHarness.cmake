# Helpers to register tests that run under mpirun at several rank counts.
# mpirun as root needs OMPI_ALLOW_RUN_AS_ROOT*; --oversubscribe lets 4 ranks run on 2 cores.
# Threads: each rank runs moe's ranks x threads rule (moe/threads.hpp); a set OMP_NUM_THREADS is
# the budget of the whole test, split over its ranks (tests/main.cpp). OpenMP threads wait
# passively and unbound: ranks and ctest -j jobs share the cores.
include_guard(GLOBAL)
set(MOE_MPIEXEC_PREFLAGS --oversubscribe --bind-to none CACHE STRING "Extra mpiexec flags for tests")
set(MOE_TEST_MPI_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
    OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1 OMPI_MCA_mpi_yield_when_idle=1
    OMP_PROC_BIND=false OMP_WAIT_POLICY=passive)

# moe_add_mpi_test(NAME name COMMAND exe args... RANKS 1 2 4 [LABELS ...])
# Without MPI (MOE_ENABLE_MPI=OFF) only the one-rank test is registered, run without mpirun.
function(moe_add_mpi_test)
  cmake_parse_arguments(T "" "NAME" "COMMAND;RANKS;LABELS" ${ARGN})
  foreach(np IN LISTS T_RANKS)
    if(NOT MOE_ENABLE_MPI)
      if(np EQUAL 1)
        add_test(NAME ${T_NAME}_np1 COMMAND ${T_COMMAND})
        set_tests_properties(${T_NAME}_np1 PROPERTIES LABELS "mpi;${T_LABELS}")
      endif()
      continue()
    endif()
    add_test(NAME ${T_NAME}_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${MOE_MPIEXEC_PREFLAGS}
                     ${MPIEXEC_PREFLAGS} ${T_COMMAND} ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${T_NAME}_np${np} PROPERTIES PROCESSORS ${np} ENVIRONMENT "${MOE_TEST_MPI_ENV}"
                         LABELS "mpi;${T_LABELS}")
  endforeach()
endfunction()
