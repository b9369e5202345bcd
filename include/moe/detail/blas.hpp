#pragma once
/// \file
/// Dense GEMM on an execution-space instance, on oneDNN or whichever Kokkos Kernels is present.

#include <moe/detail/compat.hpp>
#include <moe/detail/onednn.hpp>
#include <moe/moe_config.hpp>

#include <KokkosBlas3_gemm.hpp>

#include <cstdint>
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

/// C = alpha * op(A) * op(B) + beta * C through Kokkos Kernels, on `space` where it can (4.x).
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

/// Fences around a default-instance BLAS call (old Kokkos Kernels) on a device `space`.
template <class ExecSpace, class A, class B, class C>
struct BlasOrder {
  static constexpr bool needed =
      !has_instance_gemm<ExecSpace, A, B, C>::value && !runs_on_host<ExecSpace>();
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

/// C = alpha * op(A) * op(B) + beta * C with op "N" / "T", ordered on `space`: oneDNN for host
/// float row-major operands when moe has it, else Kokkos Kernels. `bf16_inputs`: A and B hold bf16
/// values, multiplied on oneDNN's bf16 kernels (onednn::bf16_gemm) for alpha 1, beta 0 or 1.
template <class ExecSpace, class AV, class BV, class CV>
void gemm(ExecSpace const& space, char const* ta, char const* tb,
          typename CV::non_const_value_type alpha, AV const& A, BV const& B,
          typename CV::non_const_value_type beta, CV const& C, bool bf16_inputs = false) {
  if (C.extent(0) == 0 || C.extent(1) == 0) return;
  Region region("moe::gemm");
#if MOE_HAS_ONEDNN
  using F = typename CV::non_const_value_type;
  if constexpr (runs_on_host<ExecSpace>() && std::is_same_v<F, float> &&
                std::is_same_v<typename AV::non_const_value_type, F> &&
                std::is_same_v<typename BV::non_const_value_type, F>) {
    if (A.stride(1) == 1 && B.stride(1) == 1 && C.stride(1) == 1) {
      char const opA = ta[0] == 'T' || ta[0] == 't' ? 'T' : 'N';
      char const opB = tb[0] == 'T' || tb[0] == 't' ? 'T' : 'N';
      std::int64_t const M = C.extent(0), N = C.extent(1),
                         K = opA == 'T' ? A.extent(0) : A.extent(1);
      fence(space, "moe::gemm<OneDnn>: operands ready");
      if (bf16_inputs && alpha == 1.0f && (beta == 0.0f || beta == 1.0f) &&
          onednn::bf16_gemm(opA, opB, M, N, K, A.data(), A.stride(0), B.data(), B.stride(0),
                            beta == 1.0f, C.data(), C.stride(0)))
        return;
      onednn::sgemm(opA, opB, M, N, K, alpha, A.data(), A.stride(0), B.data(), B.stride(0), beta,
                    C.data(), C.stride(0));
      return;
    }
  }
#endif
  (void)bf16_inputs;
  BlasOrder<ExecSpace, AV, BV, CV> order(space);
  blas_gemm(space, ta, tb, alpha, A, B, beta, C);
}

}  // namespace moe::detail
