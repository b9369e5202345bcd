#pragma once
/// \file
/// Gated expert activations: a = act(h0) * h1 (SwiGLU with silu, GeGLU with gelu), and backward.
/// gelu is the tanh approximation (flax.linen.gelu's default, which MaxText uses).

#include <moe/config.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/views.hpp>

namespace moe::nn {

namespace detail {
using moe::detail::exp;
using moe::detail::tanh;

template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S x) {
  return x >= S(0) ? S(1) / (S(1) + exp(-x)) : exp(x) / (S(1) + exp(x));
}

/// act(x) alone (the forward pass). Branch-free so the compiler can vectorise it; for very
/// negative x, exp(-x) overflows to inf and x / inf = -0, the correct limit of silu.
template <class S>
KOKKOS_INLINE_FUNCTION S act(Activation a, S x) {
  if (a == Activation::Silu) return x / (S(1) + exp(-x));
  S const c = S(0.7978845608028654);  // sqrt(2/pi)
  return S(0.5) * x * (S(1) + tanh(c * (x + S(0.044715) * x * x * x)));
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
    S const th = tanh(u);
    f = S(0.5) * x * (S(1) + th);
    df = S(0.5) * (S(1) + th) + S(0.5) * x * (S(1) - th * th) * c * (S(1) + S(3) * k * x * x);
  }
}
}  // namespace detail

/// \brief a[i] = act(h0[i]) * h1[i] over the first `rows` rows of [*, F] views.
template <class ExecSpace, class Scalar, class MS>
void gated_forward(ExecSpace const& space, Activation act, std::int64_t rows,
                   View2<Scalar const, MS> h0, View2<Scalar const, MS> h1, View2<Scalar, MS> a) {
  std::int64_t const F = h0.extent(1);
  Scalar const* p0 = h0.data();
  Scalar const* p1 = h1.data();
  Scalar* pa = a.data();
  Kokkos::RangePolicy<ExecSpace> range(space, 0, rows * F);
  // One kernel per activation: no branch inside the loop, so it vectorises.
  if (act == Activation::Silu)
    Kokkos::parallel_for(
        "moe::nn::gated_forward_silu", range,
        KOKKOS_LAMBDA(std::int64_t i) { pa[i] = detail::act(Activation::Silu, p0[i]) * p1[i]; });
  else
    Kokkos::parallel_for(
        "moe::nn::gated_forward_gelu", range,
        KOKKOS_LAMBDA(std::int64_t i) { pa[i] = detail::act(Activation::Gelu, p0[i]) * p1[i]; });
}

/// \brief Backward of gated_forward: dh0 = da * h1 * act'(h0), dh1 = da * act(h0).
template <class ExecSpace, class Scalar, class MS>
void gated_backward(ExecSpace const& space, Activation act, std::int64_t rows,
                    View2<Scalar const, MS> h0, View2<Scalar const, MS> h1,
                    View2<Scalar const, MS> da, View2<Scalar, MS> dh0, View2<Scalar, MS> dh1) {
  std::int64_t const F = h0.extent(1);
  Scalar const* p0 = h0.data();
  Scalar const* p1 = h1.data();
  Scalar const* pd = da.data();
  Scalar* q0 = dh0.data();
  Scalar* q1 = dh1.data();
  Kokkos::parallel_for(
      "moe::nn::gated_backward", Kokkos::RangePolicy<ExecSpace>(space, 0, rows * F),
      KOKKOS_LAMBDA(std::int64_t i) {
        Scalar f, df;
        detail::act_and_grad(act, p0[i], f, df);
        Scalar const g = pd[i];
        q0[i] = g * p1[i] * df;
        q1[i] = g * f;
      });
}

}  // namespace moe::nn
