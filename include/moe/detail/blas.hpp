#pragma once
/// \file
/// Dense GEMM on an execution-space instance, whichever Kokkos Kernels version is present
/// (Kokkos Kernels 3.4 has no instance overload; 4.x has one).

#include <moe/detail/compat.hpp>

#include <KokkosBlas3_gemm.hpp>

#include <type_traits>
#include <utility>

namespace moe::detail {

/// Detects KokkosBlas::gemm(space, ...) (Kokkos Kernels 4.x); 3.4 only has the instance-less one.
template <class Space, class A, class B, class C, class = void>
struct has_instance_gemm : std::false_type {};
template <class Space, class A, class B, class C>
struct has_instance_gemm<
    Space, A, B, C,
    std::void_t<decltype(KokkosBlas::gemm(
        std::declval<Space const&>(), "N", "N", std::declval<typename A::const_value_type&>(),
        std::declval<A const&>(), std::declval<B const&>(),
        std::declval<typename C::const_value_type&>(), std::declval<C const&>()))>>
    : std::true_type {};

template <class ExecSpace, class A, class B, class C>
void blas_gemm(ExecSpace const& space, char const* ta, char const* tb,
               typename C::const_value_type alpha, A const& a, B const& b,
               typename C::const_value_type beta, C const& c) {
  if constexpr (has_instance_gemm<ExecSpace, A, B, C>::value) {
    KokkosBlas::gemm(space, ta, tb, alpha, a, b, beta, c);
  } else {
    (void)space;
    KokkosBlas::gemm(ta, tb, alpha, a, b, beta, c);
  }
}

/// Orders a default-instance BLAS call (old Kokkos Kernels) after and before work on `space`.
/// Host backends run synchronously, so there is nothing to order there.
template <class ExecSpace, class A, class B, class C>
struct BlasOrder {
  static constexpr bool needed =
      !has_instance_gemm<ExecSpace, A, B, C>::value &&
      !Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
  ExecSpace space;
  explicit BlasOrder(ExecSpace const& s) : space(s) {
    if constexpr (needed) fence(space, "moe::blas: before default-instance BLAS");
  }
  ~BlasOrder() {
    if constexpr (needed) fence(ExecSpace(), "moe::blas: after default-instance BLAS");
  }
  BlasOrder(BlasOrder const&) = delete;
  BlasOrder& operator=(BlasOrder const&) = delete;
};

/// C = alpha * op(A) * op(B) + beta * C with op given by "N" / "T", ordered on `space`.
template <class ExecSpace, class AV, class BV, class CV>
void gemm(ExecSpace const& space, char const* ta, char const* tb,
          typename CV::non_const_value_type alpha, AV const& A, BV const& B,
          typename CV::non_const_value_type beta, CV const& C) {
  if (C.extent(0) == 0 || C.extent(1) == 0) return;
  BlasOrder<ExecSpace, AV, BV, CV> order(space);
  blas_gemm(space, ta, tb, alpha, A, B, beta, C);
}

}  // namespace moe::detail
