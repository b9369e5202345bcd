#pragma once
/// \file
/// gmm::Dense: every group's weight on all rows, masked to the group (the reference path).

#include <moe/detail/blas.hpp>
#include <moe/gmm/backend/common.hpp>

namespace moe::gmm {

/// \brief Policy: the reference. Every group's weight is applied to all rows and the result is
/// masked to the group's rows: G times the work of Vendor, simple enough to trust.
struct Dense {};

template <>
struct is_policy<Dense> : std::true_type {};

}  // namespace moe::gmm

namespace moe::gmm::detail {

template <>
struct Impl<moe::gmm::Dense> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  Groups<Mem> const& groups, Mat<E, S, MO> const& out, GmmOptions const& opt) {
    int const num_local = rhs.extent(0);
    int64_t const m = lhs.extent(0), n = out.extent(1);
    auto const& off = groups.offsets_host;
    if (!opt.accumulate)
      zero_outside(space, out, off(opt.group_offset), off(opt.group_offset + num_local));
    if (m == 0 || n == 0) return;
    Kokkos::View<S**, Kokkos::LayoutRight, MO> all(
        Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::gmm::dense::all_rows"), m, n);
    Mat<E, S, MO> all_u = all;
    for (int g = 0; g < num_local; ++g) {
      int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
      zero(space, all_u, "moe::gmm::dense::zero");
      if (lhs.extent(1) > 0) {
        moe::detail::BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MR>, Mat<E, S, MO>> order(space);
        CMat<E, S, MR> b = Kokkos::subview(rhs, g, Kokkos::ALL, Kokkos::ALL);
        moe::detail::blas_gemm(space, "N", opt.transpose_rhs ? "T" : "N", S(1), lhs, b, S(1),
                               all_u);
      }
      bool const acc = opt.accumulate;
      Kokkos::parallel_for(
          "moe::gmm::dense::select_rows",
          Kokkos::RangePolicy<E, Kokkos::IndexType<int64_t>>(space, r0 * n, r1 * n),
          KOKKOS_LAMBDA(int64_t idx) {
            int64_t const r = idx / n, c = idx % n;
            out(r, c) = acc ? out(r, c) + all_u(r, c) : all_u(r, c);
          });
    }
    fence(space, "moe::gmm::dense: before releasing the temporary");
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   Groups<Mem> const& groups, Tensor<E, S, MO> const& out, GmmOptions const& opt) {
    int const num_local = out.extent(0);
    int64_t const m = lhs.extent(0), k = lhs.extent(1);
    auto const& off = groups.offsets_host;
    if (out.extent(1) == 0 || out.extent(2) == 0) return;
    Kokkos::View<S**, Kokkos::LayoutRight, ML> masked(
        Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::gmm::dense::masked_lhs"), m,
        k);
    for (int g = 0; g < num_local; ++g) {
      int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
      Mat<E, S, MO> c = Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL);
      if (!opt.accumulate) zero(space, c, "moe::gmm::dense::zero");
      if (m == 0 || k == 0) continue;
      Kokkos::parallel_for(
          "moe::gmm::dense::mask_rows",
          Kokkos::RangePolicy<E, Kokkos::IndexType<int64_t>>(space, 0, m * k),
          KOKKOS_LAMBDA(int64_t idx) {
            int64_t const r = idx / k, j = idx % k;
            masked(r, j) = (r >= r0 && r < r1) ? lhs(r, j) : S(0);
          });
      moe::detail::BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MD>, Mat<E, S, MO>> order(space);
      moe::detail::blas_gemm(space, "T", "N", S(1), CMat<E, S, ML>(masked), dy, S(1), c);
    }
    fence(space, "moe::gmm::dense: before releasing the temporary");
  }
};

}  // namespace moe::gmm::detail
