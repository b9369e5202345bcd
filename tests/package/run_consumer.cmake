# Script mode: install the already-built moe tree to WORK_DIR/prefix, then build and run the consumer.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
run(${CMAKE_COMMAND} --install ${MOE_BINARY_DIR} --prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} -S ${MOE_SOURCE_DIR}/tests/package/consumer -B ${WORK_DIR}/build
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
execute_process(COMMAND ${WORK_DIR}/build/consumer OUTPUT_VARIABLE out)

# The consumer got the Kokkos moe was built with (the package pins it)...
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)\\.([0-9]+)" _ "${EXPECT_KOKKOS_VERSION}")
math(EXPR v1 "${CMAKE_MATCH_1}")
math(EXPR v2 "${CMAKE_MATCH_2}")
math(EXPR v3 "${CMAKE_MATCH_3}")
if(NOT out MATCHES "\\(Kokkos ${v1}\\.${v2}\\.${v3}\\)")
  message(FATAL_ERROR "the consumer reports another Kokkos than ${EXPECT_KOKKOS_VERSION}: ${out}")
endif()
# ... and a package whose recorded Kokkos differs from the one found is refused, naming both.
set(cfg ${WORK_DIR}/prefix/lib/cmake/moe/moeConfig.cmake)
if(NOT EXISTS ${cfg})
  file(GLOB cfg ${WORK_DIR}/prefix/lib*/cmake/moe/moeConfig.cmake)
endif()
file(READ ${cfg} text)
string(REPLACE "set(MOE_KOKKOS_VERSION \"${EXPECT_KOKKOS_VERSION}\")" "set(MOE_KOKKOS_VERSION \"0.0.1\")"
       patched "${text}")
if(patched STREQUAL text)
  message(FATAL_ERROR "moeConfig.cmake does not record Kokkos ${EXPECT_KOKKOS_VERSION}")
endif()
file(WRITE ${cfg} "${patched}")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${MOE_SOURCE_DIR}/tests/package/consumer
                        -B ${WORK_DIR}/build-mismatch -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                        -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
                RESULT_VARIABLE rc OUTPUT_VARIABLE mout ERROR_VARIABLE merr)
if(rc EQUAL 0 OR NOT "${mout}${merr}" MATCHES "moe was built and tested against Kokkos 0.0.1")
  message(FATAL_ERROR "a Kokkos version mismatch was not refused (${rc}):\n${mout}\n${merr}")
endif()
message(STATUS "version mismatch refused as expected")

# moe configured without MPI (MOE_ENABLE_MPI=OFF): the package asks for no MPI, records the choice,
# and the consumer builds with a poisoned <mpi.h> ahead of every include directory (so nothing
# includes the real one) and runs on one process.
run(${CMAKE_COMMAND} -S ${MOE_SOURCE_DIR} -B ${WORK_DIR}/nompi-moe -DMOE_ENABLE_MPI=OFF
    -DMOE_ENABLE_TESTS=OFF -DMOE_ENABLE_EXAMPLES=OFF -DMOE_ENABLE_BENCHMARKS=OFF
    -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})
run(${CMAKE_COMMAND} --install ${WORK_DIR}/nompi-moe --prefix ${WORK_DIR}/nompi-prefix)
file(GLOB_RECURSE nompi_cfg ${WORK_DIR}/nompi-prefix/moeConfig.cmake)
file(READ ${nompi_cfg} text)
if(NOT text MATCHES "set\\(MOE_ENABLE_MPI OFF\\)")
  message(FATAL_ERROR "${nompi_cfg} does not record MOE_ENABLE_MPI OFF")
endif()
file(READ ${WORK_DIR}/nompi-prefix/include/moe/moe_config.hpp text)
if(NOT text MATCHES "#define MOE_ENABLE_MPI 0")
  message(FATAL_ERROR "the installed moe_config.hpp does not record MOE_ENABLE_MPI 0")
endif()
run(${CMAKE_COMMAND} -S ${MOE_SOURCE_DIR}/tests/package/consumer -B ${WORK_DIR}/nompi-build
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/nompi-prefix -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
    -DCMAKE_CXX_FLAGS=-I${MOE_SOURCE_DIR}/tests/no_mpi)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/nompi-build)
execute_process(COMMAND ${WORK_DIR}/nompi-build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT out MATCHES " ok")
  message(FATAL_ERROR "the consumer of the moe built without MPI failed (${rc}): ${out}")
endif()
message(STATUS "without MPI: ${out}")
