#pragma once
/// \file
/// Dense GEMM on an execution-space instance, on oneDNN or whichever Kokkos Kernels is present.

#include <moe/detail/compat.hpp>
#include <moe/detail/elementwise.hpp>
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

/// The scalar a GEMM writing V's elements computes in (float for moe::bf16).
template <class V>
using gemm_scalar_t =
    std::conditional_t<is_bf16<typename V::value_type>, float, typename V::non_const_value_type>;

/// C = alpha * op(A) * op(B) + beta * C with op "N" / "T", ordered on `space`: oneDNN for host
/// float row-major operands when moe has it, else Kokkos Kernels. `bf16_inputs`: A and B hold bf16
/// values, multiplied on oneDNN's bf16 kernels (onednn::bf16_gemm) for alpha 1, beta 0 or 1.
/// Operands stored as moe::bf16 (16-bit hidden states, docs/precision.md) go to those kernels
/// where the CPU has them (a bf16 C rounded by the kernel, beta 0), else through float copies (a
/// bf16 C narrowed after): with oneDNN in buffers of the calling thread kept from call to call,
/// elsewhere Views made for the call. `round_b`: B holds fp32 values (a layer's master weights)
/// that the product takes rounded to bf16: the bf16 kernels round them as they copy B (to nearest
/// even, as round_to_bf16), every other path multiplies a rounded copy made for the call.
template <class ExecSpace, class AV, class BV, class CV>
void gemm(ExecSpace const& space, char const* ta, char const* tb, gemm_scalar_t<CV> alpha,
          AV const& A, BV const& B, gemm_scalar_t<CV> beta, CV const& C, bool bf16_inputs = false,
          bool round_b = false) {
  if (C.extent(0) == 0 || C.extent(1) == 0) return;
  Region region("moe::gemm");
  constexpr bool c16 = is_bf16<typename CV::value_type>;
  constexpr bool any16 =
      is_bf16<typename AV::value_type> || is_bf16<typename BV::value_type> || c16;
#if MOE_HAS_ONEDNN
  using F = gemm_scalar_t<CV>;
  if constexpr (runs_on_host<ExecSpace>() && std::is_same_v<F, float> &&
                std::is_same_v<gemm_scalar_t<AV>, F> && std::is_same_v<gemm_scalar_t<BV>, F>) {
    if (A.stride(1) == 1 && B.stride(1) == 1 && C.stride(1) == 1) {
      char const opA = ta[0] == 'T' || ta[0] == 't' ? 'T' : 'N';
      char const opB = tb[0] == 'T' || tb[0] == 't' ? 'T' : 'N';
      std::int64_t const M = C.extent(0), N = C.extent(1),
                         K = opA == 'T' ? A.extent(0) : A.extent(1);
      fence(space, "moe::gemm<OneDnn>: operands ready");
      if ((bf16_inputs || any16) && alpha == 1.0f && (beta == 0.0f || beta == 1.0f) &&
          onednn::bf16_gemm(opA, opB, M, N, K, A.data(), A.stride(0), B.data(), B.stride(0),
                            beta == 1.0f, C.data(), C.stride(0)))
        return;
      if constexpr (!any16)
        if (!round_b) {
          onednn::sgemm(opA, opB, M, N, K, alpha, A.data(), A.stride(0), B.data(), B.stride(0),
                        beta, C.data(), C.stride(0));
          return;
        }
      if constexpr (any16)
        if (!round_b) {
          // Below the bf16 tiers: each 16-bit operand widened into a buffer of the calling thread
          // (float slots 2, 3, 0 in turn; kept from call to call: the memory estimate's "GEMM
          // operand copies"), multiplied by sgemm, a 16-bit C narrowed after.
          using Buffer = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace,
                                      Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
          int slot = 2;
          auto floats = [&](auto const& V, bool read) -> std::pair<float*, std::int64_t> {
            using T = std::remove_const_t<typename std::decay_t<decltype(V)>::value_type>;
            std::int64_t const rows = V.extent(0), cols = V.extent(1);
            if constexpr (is_bf16<T>) {
              float* const f = onednn::thread_buffer(slot, std::size_t(rows * cols));
              slot = slot == 2 ? 3 : 0;
              if (read) convert_into(space, V, Buffer(f, rows, cols), "moe::gemm::widen");
              return {f, cols};
            } else {
              return {const_cast<float*>(V.data()), std::int64_t(V.stride(0))};
            }
          };
          auto const a = floats(A, true), b = floats(B, true), c = floats(C, beta != 0.0f);
          fence(space, "moe::gemm<OneDnn>: float copies made");
          onednn::sgemm(opA, opB, M, N, K, alpha, a.first, a.second, b.first, b.second, beta,
                        c.first, c.second);
          if constexpr (c16) {
            convert_into(space, Buffer(c.first, M, N), C, "moe::gemm::narrow");
            fence(space, "moe::gemm<OneDnn>: C narrowed");
          }
          return;
        }
    }
  }
#endif
  if constexpr (!is_bf16<typename BV::value_type>)
    if (round_b) {
      gemm(space, ta, tb, alpha, A, rounded_copy(space, B), beta, C, bf16_inputs);
      fence(space, "moe::gemm: rounded copy of B used");  // before it is freed
      return;
    }
  if constexpr (any16) {
    auto const c = widened<float>(space, C, beta != 0.0f);
    gemm(space, ta, tb, alpha, widened<float>(space, A), widened<float>(space, B), beta, c,
         bf16_inputs);
    if constexpr (c16) convert_into(space, c, C, "moe::gemm::narrow");
    fence(space, "moe::gemm: float copies used");  // before they are freed
  } else {
    (void)bf16_inputs;
    BlasOrder<ExecSpace, AV, BV, CV> order(space);
    blas_gemm(space, ta, tb, alpha, A, B, beta, C);
  }
}

}  // namespace moe::detail
