#pragma once
/// \file
/// Element-wise kernels over contiguous views (free functions: a KOKKOS_LAMBDA in a member would
/// capture `this`, and nvcc rejects one in a private or protected member).

#include <moe/bf16.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/rows.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

namespace moe::detail {

/// \brief Flat index of the first NaN or Inf in the contiguous view v, or v.span() if none.
template <class ExecSpace, class V>
std::int64_t first_nonfinite(ExecSpace const& space, V const& v) {
  std::int64_t const n = std::int64_t(v.span());
  if (n == 0) return 0;
  auto const* p = v.data();
  // On OpenMP's threads: each block scanned up to its first non-finite element, the least kept.
  std::atomic<std::int64_t> least{n};
  auto scan = [&](std::int64_t begin, std::int64_t end) {
    std::int64_t i = begin;
    while (i < end && moe::detail::isfinite(p[i])) ++i;
    for (std::int64_t seen = least.load(); i < end && i < seen;)
      if (least.compare_exchange_weak(seen, i)) break;
  };
  if (run_blocks<ExecSpace>("moe::check_finite", n, element_grain, scan)) return least.load();
  std::int64_t first = n;
  Kokkos::parallel_reduce(
      "moe::check_finite", Kokkos::RangePolicy<ExecSpace>(space, 0, n),
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t & m) {
        if (!moe::detail::isfinite(p[i]) && i < m) m = i;
      },
      Kokkos::Min<std::int64_t>(first));
  return first < n ? first : n;  // the reducer starts from its identity (the largest int64)
}

/// \brief Whether every element of the contiguous view v is finite.
template <class ExecSpace, class V>
bool all_finite(ExecSpace const& space, V const& v) {
  return first_nonfinite(space, v) == std::int64_t(v.span());
}

/// \brief Throws InputError("<name> holds NaN or Inf at [i,j]: ...") at the first non-finite
/// element of v (its multi-index; `name` says which tensor, e.g. "wi_0" or "x").
template <class ExecSpace, class V>
void require_finite(ExecSpace const& space, V const& v, std::string const& name) {
  std::int64_t flat = first_nonfinite(space, v);
  if (flat == std::int64_t(v.span())) return;
  std::string where;  // every extent is > 0 here
  for (int d = int(V::rank) - 1; d >= 0; --d) {
    std::int64_t const n = std::int64_t(v.extent(d));
    where.insert(0, std::to_string(flat % n) + (where.empty() ? "" : ","));
    flat /= n;
  }
  throw InputError(
      cat(name, " holds NaN or Inf at [", where, "]: inputs and weights must be finite"));
}

/// \brief dst[i] += src[i] over two contiguous views of the same span.
template <class ExecSpace, class Src, class Dst>
void add_into(ExecSpace const& space, Src const& src, Dst const& dst) {
  auto const* s = src.data();
  auto* d = dst.data();
  for_each_index(
      space, "moe::add_into", std::int64_t(dst.span()), element_grain,
      KOKKOS_LAMBDA(std::int64_t i) { d[i] += s[i]; });
}

/// \brief Rounds every element of the contiguous view v to the nearest bf16 (ties to even), in
/// place: the cast points of the bf16 scheme (docs/precision.md); exact on bf16 values.
template <class ExecSpace, class V>
void round_bf16(ExecSpace const& space, V const& v) {
  auto* p = v.data();
  for_each_index(
      space, "moe::round_bf16", std::int64_t(v.span()), element_grain,
      KOKKOS_LAMBDA(std::int64_t i) { p[i] = round_to_bf16(p[i]); });
}

/// Whether T is moe::bf16 (const or not): an operand stored in 16 bits.
template <class T>
inline constexpr bool is_bf16 = std::is_same<std::remove_const_t<T>, moe::bf16>::value;

/// \brief dst[i] = src[i], rounded to the nearest bf16 when `round` (the bf16 scheme's copy of
/// an input), over two contiguous views of the same span: deep_copy and round_bf16 in one pass.
/// The element types may differ (value_cast: a moe::bf16 dst rounds every value).
template <class ExecSpace, class Src, class Dst>
void copy_into(ExecSpace const& space, Src const& src, Dst const& dst, bool round) {
  using T = typename Dst::non_const_value_type;
  static_assert(Kokkos::SpaceAccessibility<ExecSpace, typename Src::memory_space>::accessible &&
                    Kokkos::SpaceAccessibility<ExecSpace, typename Dst::memory_space>::accessible,
                "moe::detail::copy_into: both views must be reachable from the execution space");
  require<ShapeError>(
      src.span() == dst.span() && src.span_is_contiguous() && dst.span_is_contiguous(),
      "moe::detail::copy_into: two contiguous views of one span, not ", src.span(), " and ",
      dst.span(), " elements");
  auto const* s = src.data();
  auto* d = dst.data();
  std::int64_t const n = std::int64_t(dst.span());
  if constexpr (!is_bf16<T> && !is_bf16<typename Src::value_type>) {
    if (round) {
      for_each_index(
          space, "moe::copy_rounded", n, element_grain,
          KOKKOS_LAMBDA(std::int64_t i) { d[i] = round_to_bf16(T(s[i])); });
      return;
    }
  }
  for_each_index(
      space, "moe::copy", n, element_grain,
      KOKKOS_LAMBDA(std::int64_t i) { d[i] = value_cast<T>(s[i]); });
}

/// round_bf16(space, v) when `on` (the layer's dtype is bfloat16); nothing otherwise.
template <class ExecSpace, class V>
void round_bf16_if(bool on, ExecSpace const& space, V const& v) {
  if (on && v.span() > 0) round_bf16(space, v);
}

/// w(i, j) = W(v(i, j)) over the extents of v (W: w's element type; bf16 converts via float).
template <class ExecSpace, class V, class Wv>
void convert_into(ExecSpace const& space, V const& v, Wv const& w, char const* label) {
  using W = typename Wv::value_type;
  std::int64_t const cols = v.extent(1);
  for_each_row(
      space, label, std::int64_t(v.extent(0)),
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t lane, std::int64_t lanes) {
        for (std::int64_t j = lane; j < cols; j += lanes) w(i, j) = W(float(v(i, j)));
      });
}

/// A 2-D view as S values: itself, or an S copy (widened with `read`, else uninitialised).
template <class S, class ExecSpace, class V>
auto widened(ExecSpace const& space, V const& v, bool read = true) {
  if constexpr (!is_bf16<typename V::value_type>) {
    return v;
  } else {
    Kokkos::View<S**, Kokkos::LayoutRight, typename ExecSpace::memory_space> w(
        Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::gmm::widened"), v.extent(0),
        v.extent(1));
    if (read) convert_into(space, v, w, "moe::gmm::widen");
    return w;
  }
}

/// The row-major view rounded_copy makes of a 2-D or 3-D view V.
template <class V>
using rounded_copy_t =
    Kokkos::View<std::conditional_t<V::rank == 2, typename V::non_const_value_type**,
                                    typename V::non_const_value_type***>,
                 Kokkos::LayoutRight, typename V::memory_space>;

/// A row-major copy of the 2-D or 3-D view v with every value rounded to bf16: the operand a
/// GEMM multiplies when its caller holds fp32 weights that the product takes rounded
/// (GmmOptions::round_rhs, detail::gemm's round_b) and the GEMM path does not round them itself.
/// (The return type is spelled out: nvcc refuses an extended lambda in a function whose return
/// type is deduced.)
template <class ExecSpace, class V>
rounded_copy_t<V> rounded_copy(ExecSpace const& space, V const& v) {
  using S = typename V::non_const_value_type;
  using MS = typename V::memory_space;
  static_assert(V::rank == 2 || V::rank == 3, "moe::detail::rounded_copy: a 2-D or 3-D view");
  auto const alloc = Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::rounded_copy");
  std::int64_t const e1 = v.extent(1);
  if constexpr (V::rank == 2) {
    Kokkos::View<S**, Kokkos::LayoutRight, MS> out(alloc, v.extent(0), v.extent(1));
    Kokkos::parallel_for(
        "moe::rounded_copy", Kokkos::RangePolicy<ExecSpace>(space, 0, std::int64_t(out.size())),
        KOKKOS_LAMBDA(std::int64_t i) {
          out(i / e1, i % e1) = round_to_bf16(S(v(i / e1, i % e1)));
        });
    return out;
  } else {
    Kokkos::View<S***, Kokkos::LayoutRight, MS> out(alloc, v.extent(0), v.extent(1), v.extent(2));
    std::int64_t const e2 = v.extent(2);
    Kokkos::parallel_for(
        "moe::rounded_copy", Kokkos::RangePolicy<ExecSpace>(space, 0, std::int64_t(out.size())),
        KOKKOS_LAMBDA(std::int64_t i) {
          std::int64_t const g = i / (e1 * e2), r = i / e2 % e1, c = i % e2;
          out(g, r, c) = round_to_bf16(S(v(g, r, c)));
        });
    return out;
  }
}

}  // namespace moe::detail
