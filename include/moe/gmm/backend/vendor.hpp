#pragma once
/// \file
/// gmm::Vendor: one vendor GEMM per non-empty group through Kokkos Kernels.

#include <moe/detail/blas.hpp>
#include <moe/gmm/backend/common.hpp>

namespace moe::gmm {

/// \brief Policy: one vendor GEMM per non-empty group (Kokkos Kernels: BLAS, cuBLAS, rocBLAS) on
/// row blocks of the operands; Auto's choice on host spaces without oneDNN (or for double).
struct Vendor {};

template <>
struct is_policy<Vendor> : std::true_type {};

}  // namespace moe::gmm

namespace moe::gmm::detail {

template <>
struct Impl<moe::gmm::Vendor> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  Groups<Mem> const& groups, Mat<E, S, MO> const& out, GmmOptions const& opt) {
    char const* what = "moe::gmm::gmm<Vendor>";
    int const num_local = rhs.extent(0);
    int64_t const m = lhs.extent(0), k = lhs.extent(1);
    auto const& off = groups.offsets_host;
    int64_t const begin = off(opt.group_offset), end = off(opt.group_offset + num_local);
    if (k == 0 && !opt.accumulate) {  // BLAS returns early on an empty contraction, C untouched
      zero_rows(space, out, begin, end, "moe::gmm::zero_rows");
    } else if (k > 0 && out.extent(1) > 0 && end > begin) {
      check_blas_extent(what, "k", k);
      check_blas_extent(what, "n", out.extent(1));
      // Host BLAS runs a multiple of its register block of rows faster: without accumulate a
      // group's rows are padded to 16 (later groups overwrite the extra rows, or they are zeroed).
      int64_t const pad = opt.accumulate || !moe::detail::runs_on_host<E>() ? 1 : 16;
      moe::detail::BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MR>, Mat<E, S, MO>> order(space);
      for (int g = 0; g < num_local; ++g) {
        int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
        if (r1 == r0) continue;
        int64_t const padded = r0 + (r1 - r0 + pad - 1) / pad * pad;
        int64_t const stop = padded <= m ? padded : r1;
        check_blas_extent(what, "rows of a group", stop - r0);
        CMat<E, S, ML> a = Kokkos::subview(lhs, Rows(r0, stop), Kokkos::ALL);
        CMat<E, S, MR> b = Kokkos::subview(rhs, g, Kokkos::ALL, Kokkos::ALL);
        Mat<E, S, MO> c = Kokkos::subview(out, Rows(r0, stop), Kokkos::ALL);
        moe::detail::blas_gemm(space, "N", opt.transpose_rhs ? "T" : "N", S(1), a, b,
                               opt.accumulate ? S(1) : S(0), c);
      }
    }
    if (!opt.accumulate) zero_outside(space, out, begin, end);
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   Groups<Mem> const& groups, Tensor<E, S, MO> const& out, GmmOptions const& opt) {
    char const* what = "moe::gmm::tgmm<Vendor>";
    int const num_local = out.extent(0);
    auto const& off = groups.offsets_host;
    if (out.extent(1) == 0 || out.extent(2) == 0) return;
    check_blas_extent(what, "k", out.extent(1));
    check_blas_extent(what, "n", out.extent(2));
    moe::detail::BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MD>, Mat<E, S, MO>> order(space);
    for (int g = 0; g < num_local; ++g) {
      int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
      Mat<E, S, MO> c = Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL);
      if (r1 == r0) {  // BLAS returns early on an empty contraction without touching C
        if (!opt.accumulate) zero(space, c, "moe::gmm::tgmm::zero_empty_group");
        continue;
      }
      check_blas_extent(what, "rows of a group", r1 - r0);
      CMat<E, S, ML> a = Kokkos::subview(lhs, Rows(r0, r1), Kokkos::ALL);
      CMat<E, S, MD> b = Kokkos::subview(dy, Rows(r0, r1), Kokkos::ALL);
      moe::detail::blas_gemm(space, "T", "N", S(1), a, b, opt.accumulate ? S(1) : S(0), c);
    }
  }
};

}  // namespace moe::gmm::detail
