# Finds Kokkos and Kokkos Kernels and provides two targets whatever their origin:
#   moe_kokkos         (core + containers + algorithms)
#   moe_kokkoskernels  (KokkosKernels, with its BLAS TPL)
#
# Two layouts are accepted:
#  * a standalone Kokkos >= 3.4 / 4.x install: targets Kokkos::kokkos and Kokkos::kokkoskernels;
#  * Debian's Trilinos packages (Kokkos 3.4.01): targets trilinos_kokkoscore, trilinos_kokkoskernels, ...
#    whose imported targets carry no include directory at all, so we add the one that really holds
#    KokkosCore_config.h.
# This file is also installed and included by moeConfig.cmake, so consumers get the same targets.
include_guard(GLOBAL)

find_package(Kokkos REQUIRED CONFIG)

# Trilinos first: Debian's config also defines a Kokkos::kokkos, but with the include path
# <prefix>/lib/include (which does not exist) and a stray -DKOKKOS_DEPENDENCE link item.
if(TARGET trilinos_kokkoscore)
  set(MOE_KOKKOS_FROM_TRILINOS ON)
  set(_moe_kokkos_core trilinos_kokkoscore trilinos_kokkoscontainers trilinos_kokkosalgorithms)
elseif(TARGET Kokkos::kokkos)
  set(MOE_KOKKOS_FROM_TRILINOS OFF)
  set(_moe_kokkos_core Kokkos::kokkos)
else()
  message(FATAL_ERROR "moe: found Kokkos at ${Kokkos_DIR} but neither Kokkos::kokkos nor trilinos_kokkoscore")
endif()

# The include directory that really holds KokkosCore_config.h (Debian: /usr/include/trilinos).
set(_moe_kokkos_include_hints ${Kokkos_INCLUDE_DIRS})
if(Kokkos_DIR)
  list(APPEND _moe_kokkos_include_hints "${Kokkos_DIR}/../../../include/trilinos"
       "${Kokkos_DIR}/../../../../include/trilinos" "${Kokkos_DIR}/../../../include")
endif()
find_path(MOE_KOKKOS_INCLUDE_DIR KokkosCore_config.h
          HINTS ${_moe_kokkos_include_hints} PATH_SUFFIXES trilinos NO_DEFAULT_PATH)
if(NOT MOE_KOKKOS_INCLUDE_DIR)
  find_path(MOE_KOKKOS_INCLUDE_DIR KokkosCore_config.h PATH_SUFFIXES trilinos)
endif()

if(NOT TARGET moe_kokkos)
  add_library(moe_kokkos INTERFACE IMPORTED GLOBAL)
  target_link_libraries(moe_kokkos INTERFACE ${_moe_kokkos_core})
  if(MOE_KOKKOS_FROM_TRILINOS)
    if(NOT MOE_KOKKOS_INCLUDE_DIR)
      message(FATAL_ERROR "moe: Trilinos Kokkos found but no directory holds KokkosCore_config.h")
    endif()
    target_include_directories(moe_kokkos SYSTEM INTERFACE "${MOE_KOKKOS_INCLUDE_DIR}")
  endif()
endif()

find_package(KokkosKernels QUIET CONFIG)
if(NOT TARGET moe_kokkoskernels)
  add_library(moe_kokkoskernels INTERFACE IMPORTED GLOBAL)
  if(MOE_KOKKOS_FROM_TRILINOS AND TARGET trilinos_kokkoskernels)
    target_link_libraries(moe_kokkoskernels INTERFACE trilinos_kokkoskernels moe_kokkos)
  elseif(TARGET Kokkos::kokkoskernels)
    target_link_libraries(moe_kokkoskernels INTERFACE Kokkos::kokkoskernels moe_kokkos)
  else()
    message(FATAL_ERROR "moe: Kokkos Kernels not found (neither Kokkos::kokkoskernels nor trilinos_kokkoskernels)")
  endif()
endif()

if(NOT Kokkos_FIND_QUIETLY AND NOT _moe_kokkos_reported)
  set(_moe_kokkos_reported ON CACHE INTERNAL "")
  message(STATUS "moe: Kokkos ${Kokkos_VERSION} from ${Kokkos_DIR} (include ${MOE_KOKKOS_INCLUDE_DIR})")
endif()
