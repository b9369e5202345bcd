#pragma once
/// \file
/// Gated expert activations: a = act(h0) * h1 (SwiGLU with silu, GeGLU with gelu), and backward.
/// gelu is the tanh approximation (flax.linen.gelu's default, which MaxText uses).

#include <moe/bf16.hpp>
#include <moe/config_types.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/rows.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>

#include <cstdint>
#include <type_traits>

namespace moe::nn {

namespace detail {
using moe::detail::exp;
using moe::detail::tanh;

/// A float's bits as a signed integer (so >> 31 spreads the sign bit) and back.
KOKKOS_INLINE_FUNCTION std::int32_t float_bits(float x) {
  return std::int32_t(moe::detail::float_bits(x));
}
KOKKOS_INLINE_FUNCTION float bits_float(std::int32_t i) {
  return moe::detail::bits_float(std::uint32_t(i));
}

/// exp(-|x|) in float (|x| clamped to 87, NaN too: callers multiply by x, which carries it).
/// Branch-free and no library call, so the loops vectorise without fast-math (glibc's expf does
/// not): exp(y) = 2^n exp(r), n = round(y / ln 2), exp(r) by Cephes' expf polynomial (a few ulp).
KOKKOS_INLINE_FUNCTION float exp_neg_abs(float x) {
  std::int32_t const limit = 0x42ae0000;  // 87.0f
  std::int32_t const a = float_bits(x) & 0x7fffffff;
  std::int32_t const d = a - limit;
  float const y = -bits_float(limit + (d & (d >> 31)));  // -min(|x|, 87), branch-free
  // Round to nearest through the 1.5 * 2^23 trick (exact for |y / ln 2| < 2^22).
  float const n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = y - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  return p * bits_float((std::int32_t(n) + 127) << 23);  // 2^n, n in [-126, 0]
}

/// Logistic sigmoid. The float overload is branch-free (vectorises); the generic one is the
/// textbook two-sided form in the library's exp.
template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S x) {
  return x >= S(0) ? S(1) / (S(1) + exp(-x)) : exp(x) / (S(1) + exp(x));
}
KOKKOS_INLINE_FUNCTION float sigmoid(float x) {
  float const e = exp_neg_abs(x);
  float const s = 1.0f / (1.0f + e);             // sigmoid(|x|)
  std::int32_t const neg = float_bits(x) >> 31;  // all ones when the sign bit is set
  // x >= 0: s; x < 0: e * s = sigmoid(-|x|); the factor picked by bit masks, not a branch.
  return s * bits_float((neg & float_bits(e)) | (~neg & 0x3f800000));
}

/// tanh, with the same split as sigmoid: float branch-free through exp_neg_abs(2x).
template <class S>
KOKKOS_INLINE_FUNCTION S tanh_(S x) {
  return tanh(x);
}
KOKKOS_INLINE_FUNCTION float tanh_(float x) {
  float const e = exp_neg_abs(2.0f * x);
  float const t = (1.0f - e) / (1.0f + e);  // tanh(|x|)
  return bits_float(float_bits(t) | (float_bits(x) & std::int32_t(0x80000000u)));
}

/// act(x) alone (the forward pass); branch-free in float, so the compiler can vectorise it.
template <class S>
KOKKOS_INLINE_FUNCTION S act(Activation a, S x) {
  if (a == Activation::Silu) return x * sigmoid(x);
  S const c = S(0.7978845608028654);  // sqrt(2/pi)
  return S(0.5) * x * (S(1) + tanh_(c * (x + S(0.044715) * x * x * x)));
}

/// act(x) and act'(x) for the chosen activation.
template <class S>
KOKKOS_INLINE_FUNCTION void act_and_grad(Activation a, S x, S& f, S& df) {
  if (a == Activation::Silu) {
    S const sg = sigmoid(x);
    f = x * sg;
    df = sg * (S(1) + x * (S(1) - sg));
  } else {
    S const c = S(0.7978845608028654);  // sqrt(2/pi)
    S const k = S(0.044715);
    S const u = c * (x + k * x * x * x);
    S const th = tanh_(u);
    f = S(0.5) * x * (S(1) + th);
    df = S(0.5) * (S(1) + th) + S(0.5) * x * (S(1) - th * th) * c * (S(1) + S(3) * k * x * x);
  }
}

/// round_to_bf16(x) when Round, else x.
template <bool Round, class S>
KOKKOS_INLINE_FUNCTION S cast(S x) {
  if constexpr (Round)
    return moe::detail::round_to_bf16(x);
  else
    return x;
}

/// A stored element as the compute type S (moe::bf16 widens through float, exactly; storing
/// converts back with T(x), moe::bf16 rounding through float).
template <class S, class T>
KOKKOS_INLINE_FUNCTION S load(T const& x) {
  if constexpr (std::is_same<T, moe::bf16>::value)
    return S(float(x));
  else
    return S(x);
}
/// A stored element as S, rounded to bf16 when Round: cast<Round>(load<S>(x)), where a moe::bf16
/// element skips the rounding (a bf16 value rounds to itself; saves the work in the 16-bit case).
template <bool Round, class S, class T>
KOKKOS_INLINE_FUNCTION S load_rounded(T const& x) {
  if constexpr (std::is_same<std::remove_const_t<T>, moe::bf16>::value)
    return load<S>(x);
  else
    return cast<Round>(load<S>(x));
}
/// x as a stored element of type T, rounded to bf16 when Round: T(cast<Round>(x)), where a
/// moe::bf16 element rounds once, in its own conversion (the same bits).
template <bool Round, class T, class S>
KOKKOS_INLINE_FUNCTION T store_rounded(S x) {
  if constexpr (std::is_same<T, moe::bf16>::value)
    return T(float(x));
  else
    return T(cast<Round>(x));
}
/// What the kernels compute in: the first of Ts that is not moe::bf16 (float if all are).
template <class... Ts>
struct compute_type {
  using type = float;
};
template <class T, class... Ts>
struct compute_type<T, Ts...> {
  using type = std::conditional_t<std::is_same<std::remove_const_t<T>, moe::bf16>::value,
                                  typename compute_type<Ts...>::type, std::remove_const_t<T>>;
};

/// The gated kernels index their views' data flat: rank-2 row-major contiguous Views.
template <class... V>
void check_views(V const&... v) {
  static_assert(
      ((V::rank == 2 && std::is_same<typename V::array_layout, Kokkos::LayoutRight>::value) && ...),
      "moe::nn::gated_forward / gated_backward take rank-2 LayoutRight Views");
  moe::detail::require<ShapeError>((v.span_is_contiguous() && ...),
                                   "moe::nn::gated_forward / gated_backward: the views must be "
                                   "contiguous (whole rows), not strided");
}

/// gated_forward's kernel for one activation A (a template argument: no branch in the loop).
template <Activation A, bool Round, class S, class ExecSpace, class T0, class T1, class TA>
void gated_forward_kernel(ExecSpace const& space, std::int64_t n, T0 const* p0, T1 const* p1,
                          TA* pa) {
  moe::detail::for_each_index(
      space, "moe::nn::gated_forward", n, moe::detail::element_grain,
      KOKKOS_LAMBDA(std::int64_t i) {
        pa[i] = store_rounded<Round, TA>(detail::act(A, load_rounded<Round, S>(p0[i])) *
                                         load_rounded<Round, S>(p1[i]));
      });
}

/// gated_backward's kernel for one activation A (a template argument: no branch in the loop).
template <Activation A, bool Round, class S, class ExecSpace, class T0, class T1, class TD,
          class Q0, class Q1>
void gated_backward_kernel(ExecSpace const& space, std::int64_t n, T0 const* p0, T1 const* p1,
                           TD const* pd, Q0* q0, Q1* q1) {
  moe::detail::for_each_index(
      space, "moe::nn::gated_backward", n, moe::detail::element_grain,
      KOKKOS_LAMBDA(std::int64_t i) {
        S f, df;
        detail::act_and_grad(A, load_rounded<Round, S>(p0[i]), f, df);
        S const g = load_rounded<Round, S>(pd[i]);
        q0[i] = store_rounded<Round, Q0>(g * load_rounded<Round, S>(p1[i]) * df);
        q1[i] = store_rounded<Round, Q1>(g * f);
      });
}

/// Calls run(act, round) with std::integral_constant arguments (the Activation, bf16): one
/// kernel instantiation per combination, chosen once outside the loop.
template <class Run>
void dispatch(Activation act, bool bf16, Run&& run) {
  using silu = std::integral_constant<Activation, Activation::Silu>;
  using gelu = std::integral_constant<Activation, Activation::Gelu>;
  if (act == Activation::Silu)
    bf16 ? run(silu{}, std::true_type{}) : run(silu{}, std::false_type{});
  else
    bf16 ? run(gelu{}, std::true_type{}) : run(gelu{}, std::false_type{});
}
}  // namespace detail

/// \brief a[i] = act(h0[i]) * h1[i] over the first `rows` rows of contiguous [*, F] views (each
/// of the layer's scalar or moe::bf16, computed in the scalar). `bf16` (the bf16 scheme,
/// docs/precision.md): the casts fused into the same pass, a = bf16(act(bf16(h0)) * bf16(h1));
/// h0 and h1 stay as they are (gated_backward rounds them again as it reads them).
template <class ExecSpace, class V0, class V1, class VA>
void gated_forward(ExecSpace const& space, Activation act, std::int64_t rows, V0 const& h0,
                   V1 const& h1, VA const& a, bool bf16 = false) {
  using S = typename detail::compute_type<typename V0::value_type, typename V1::value_type,
                                          typename VA::value_type>::type;
  detail::check_views(h0, h1, a);
  std::int64_t const n = rows * std::int64_t(h0.extent(1));
  detail::dispatch(act, bf16, [&](auto A, auto round) {
    detail::gated_forward_kernel<decltype(A)::value, decltype(round)::value, S>(
        space, n, h0.data(), h1.data(), a.data());
  });
}

/// \brief Backward of gated_forward: dh0 = da * h1 * act'(h0), dh1 = da * act(h0). dh0 may
/// alias da (each element reads its own da before writing). `bf16`: h0, h1 and da are read
/// rounded to bf16 and dh0, dh1 written rounded (the bf16 scheme's casts, fused).
template <class ExecSpace, class V0, class V1, class VD, class Q0, class Q1>
void gated_backward(ExecSpace const& space, Activation act, std::int64_t rows, V0 const& h0,
                    V1 const& h1, VD const& da, Q0 const& dh0, Q1 const& dh1, bool bf16 = false) {
  using S = typename detail::compute_type<typename V0::value_type, typename V1::value_type,
                                          typename VD::value_type, typename Q0::value_type,
                                          typename Q1::value_type>::type;
  detail::check_views(h0, h1, da, dh0, dh1);
  std::int64_t const n = rows * std::int64_t(h0.extent(1));
  detail::dispatch(act, bf16, [&](auto A, auto round) {
    detail::gated_backward_kernel<decltype(A)::value, decltype(round)::value, S>(
        space, n, h0.data(), h1.data(), da.data(), dh0.data(), dh1.data());
  });
}

}  // namespace moe::nn
