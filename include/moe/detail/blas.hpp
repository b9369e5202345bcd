#pragma once
/// \file
/// Dense GEMM on an execution-space instance, whichever Kokkos Kernels version is present
/// (Kokkos Kernels 3.4 has no instance overload; 4.x has one).

#include <KokkosKernels_config.h>
#include <KokkosBlas3_gemm.hpp>

namespace moe::detail {

/// C = alpha * op(A) * op(B) + beta * C with op given by "N" / "T".
template <class ExecSpace, class AV, class BV, class CV>
void gemm(ExecSpace const& space, char const* ta, char const* tb,
          typename CV::non_const_value_type alpha, AV const& A, BV const& B,
          typename CV::non_const_value_type beta, CV const& C) {
  if (C.extent(0) == 0 || C.extent(1) == 0) return;
#if defined(KOKKOSKERNELS_VERSION_MAJOR) && KOKKOSKERNELS_VERSION_MAJOR >= 4
  KokkosBlas::gemm(space, ta, tb, alpha, A, B, beta, C);
#else
  (void)space;
  KokkosBlas::gemm(ta, tb, alpha, A, B, beta, C);
#endif
}

}  // namespace moe::detail
