#pragma once
/// \file
/// Grouped matrix multiply (GMM) of a MoE layer: the rows of the activations are split into
/// consecutive groups (one per expert) and every group is multiplied by its own weight matrix.
///
///   gmm : out[rows of group go+g, :] = lhs[rows, :] * rhs[g]   (rhs[g]^T with transpose_rhs)
///   tgmm: out[g] = lhs[rows of group go+g, :]^T * dy[same rows, :]          (weight gradient)
///
/// The algorithm is a compile-time policy (Vendor, Tiled<TM,TK,TN>, Dense; Auto = Vendor); group
/// sizes are runtime data held as CSR offsets with a host copy, so no launch waits on the device.
/// Semantics follow SEMANTICS.md §1.8 items 26-27, except that rows outside the visited groups are
/// always zeroed (never "unspecified") unless the call accumulates.

#include <moe/detail/blas.hpp>
#include <moe/detail/compat.hpp>
#include <moe/error.hpp>

#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>

#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::gmm {

/// \brief Policy: one vendor GEMM per non-empty group (Kokkos Kernels -> BLAS on the host,
/// cuBLAS / rocBLAS on GPUs) on row blocks of the operands. The default (Auto).
struct Vendor {};

/// \brief Policy: portable Kokkos team kernel. Each team computes one TM x TN output tile from
/// TM x TK and TK x TN tiles staged in team scratch; a tile never straddles two groups.
/// \tparam TM rows of an output tile (rows of lhs)
/// \tparam TK depth of one step of the contraction loop
/// \tparam TN columns of an output tile
template <int TM, int TK, int TN>
struct Tiled {
  static_assert(TM > 0 && TK > 0 && TN > 0,
                "moe::gmm::Tiled<TM,TK,TN>: every tile extent must be positive");
  static constexpr int tile_m = TM;
  static constexpr int tile_k = TK;
  static constexpr int tile_n = TN;
};

/// \brief Policy: the reference. Every group's weight is applied to all rows and the result is
/// masked to the group's rows: G times the work of Vendor, simple enough to trust.
struct Dense {};

/// \brief Default policy: Vendor (BLAS is the fastest path measured on every backend we have).
using Auto = Vendor;

/// \brief Row partition of the lhs into consecutive groups, as CSR offsets.
///
/// offsets[0] = 0 and offsets[g+1] - offsets[g] is the size of group g. The host copy lets a
/// launch size its grid and slice its operands without reading device memory.
/// \tparam MemorySpace where `offsets` lives (the memory space of the execution space used)
template <class MemorySpace>
struct Groups {
  /// [G+1] exclusive cumulative sum of the group sizes, on the device.
  Kokkos::View<int64_t*, MemorySpace> offsets;
  /// Host copy of `offsets` (same values).
  typename Kokkos::View<int64_t*, MemorySpace>::HostMirror offsets_host;

  /// \brief Number of groups G.
  int num_groups() const {
    return offsets_host.extent(0) == 0 ? 0 : static_cast<int>(offsets_host.extent(0) - 1);
  }
  /// \brief Number of grouped rows: the sum of the group sizes.
  int64_t rows() const { return num_groups() == 0 ? 0 : offsets_host(num_groups()); }
  /// \brief Size of group g.
  int64_t size(int g) const { return offsets_host(g + 1) - offsets_host(g); }
};

}  // namespace moe::gmm

namespace moe::detail::gmm_impl {

/// Allocates the offsets of `sizes` (device view + host mirror) and fills the host copy.
template <class MemorySpace, class... Alloc>
moe::gmm::Groups<MemorySpace> host_groups(std::vector<int64_t> const& sizes,
                                          Alloc const&... space) {
  moe::gmm::Groups<MemorySpace> groups;
  groups.offsets = Kokkos::View<int64_t*, MemorySpace>(
      Kokkos::view_alloc(space..., Kokkos::WithoutInitializing, "moe::gmm::Groups::offsets"),
      sizes.size() + 1);
  groups.offsets_host = Kokkos::create_mirror_view(groups.offsets);
  groups.offsets_host(0) = 0;
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    moe::detail::require<ShapeError>(sizes[g] >= 0, "moe::gmm::make_groups: group size sizes[", g,
                                     "]=", sizes[g], " is negative; group sizes must be >= 0");
    groups.offsets_host(g + 1) = groups.offsets_host(g) + sizes[g];
  }
  return groups;
}

}  // namespace moe::detail::gmm_impl

namespace moe::gmm {

/// \brief Builds Groups from host group sizes; the copy to the device runs on `space` (the host
/// copy stays alive in the result, so the copy may still be in flight when this returns).
/// \param space instance that performs the copy to the device
/// \param sizes group sizes, each >= 0
/// \throws moe::ShapeError if a size is negative
template <class ExecSpace, class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
Groups<typename ExecSpace::memory_space> make_groups(ExecSpace const& space,
                                                     std::vector<int64_t> const& sizes) {
  auto groups = moe::detail::gmm_impl::host_groups<typename ExecSpace::memory_space>(sizes, space);
  Kokkos::deep_copy(space, groups.offsets, groups.offsets_host);
  return groups;
}

/// \brief Builds Groups from host group sizes; returns after the device copy is complete.
/// \tparam MemorySpace memory space of the device offsets
/// \throws moe::ShapeError if a size is negative
template <class MemorySpace>
Groups<MemorySpace> make_groups(std::vector<int64_t> const& sizes) {
  auto groups = moe::detail::gmm_impl::host_groups<MemorySpace>(sizes);
  Kokkos::deep_copy(groups.offsets, groups.offsets_host);
  return groups;
}

/// \brief Builds Groups from device offsets and their host mirror, both already filled by the
/// caller (e.g. from an exchanged count vector). Only the host copy is read.
/// \throws moe::ShapeError if the extents differ, offsets_host(0) != 0, or offsets decrease
template <class MemorySpace>
Groups<MemorySpace> make_groups(
    Kokkos::View<int64_t*, MemorySpace> const& offsets,
    typename Kokkos::View<int64_t*, MemorySpace>::HostMirror const& offsets_host) {
  moe::detail::require<ShapeError>(
      offsets.extent(0) == offsets_host.extent(0) && offsets.extent(0) >= 1,
      "moe::gmm::make_groups: offsets.extent(0)=", offsets.extent(0),
      " and offsets_host.extent(0)=", offsets_host.extent(0),
      " must be equal and >= 1 (G+1 CSR offsets)");
  moe::detail::require<ShapeError>(offsets_host(0) == 0,
                                   "moe::gmm::make_groups: offsets_host(0)=", offsets_host(0),
                                   " must be 0");
  for (std::size_t g = 1; g < offsets_host.extent(0); ++g)
    moe::detail::require<ShapeError>(offsets_host(g) >= offsets_host(g - 1),
                                     "moe::gmm::make_groups: offsets_host(", g,
                                     ")=", offsets_host(g), " < offsets_host(", g - 1,
                                     ")=", offsets_host(g - 1), "; group sizes must be >= 0");
  return Groups<MemorySpace>{offsets, offsets_host};
}

/// \brief Options shared by gmm and tgmm.
struct GmmOptions {
  /// rhs is [G_local, n, k] and used transposed (dX = dY * W^T). gmm only.
  bool transpose_rhs = false;
  /// rhs[g] (gmm) or out[g] (tgmm) belongs to group group_offset + g.
  int group_offset = 0;
  /// out += result (rows of visited groups only) instead of out = result.
  bool accumulate = false;
};

}  // namespace moe::gmm

namespace moe::detail::gmm_impl {

template <class Exec, class Scalar, class Mem>
using CMat = Kokkos::View<const Scalar**, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>,
                          Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Exec, class Scalar, class Mem>
using Mat = Kokkos::View<Scalar**, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>,
                         Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Exec, class Scalar, class Mem>
using CTensor = Kokkos::View<const Scalar***, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>,
                             Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Exec, class Scalar, class Mem>
using Tensor = Kokkos::View<Scalar***, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>,
                            Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using Rows = std::pair<int64_t, int64_t>;

using moe::detail::fence;

using moe::detail::blas_gemm;
using moe::detail::BlasOrder;
using moe::detail::has_instance_gemm;

/// out = 0 on a 2-D block (any row stride).
template <class ExecSpace, class Scalar, class Mem>
void zero(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, char const* label) {
  int64_t const rows = out.extent(0), cols = out.extent(1);
  if (rows == 0 || cols == 0) return;
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<int64_t>>(space, 0, rows * cols),
      KOKKOS_LAMBDA(int64_t idx) { out(idx / cols, idx % cols) = Scalar(0); });
}

/// Zeroes the rows of out outside [begin, end) (rows of no visited group).
template <class ExecSpace, class Scalar, class Mem>
void zero_outside(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, int64_t begin,
                  int64_t end) {
  int64_t const m = out.extent(0);
  if (begin > 0)
    zero(space, Mat<ExecSpace, Scalar, Mem>(Kokkos::subview(out, Rows(0, begin), Kokkos::ALL)),
         "moe::gmm::zero_unvisited_rows");
  if (end < m)
    zero(space, Mat<ExecSpace, Scalar, Mem>(Kokkos::subview(out, Rows(end, m), Kokkos::ALL)),
         "moe::gmm::zero_unvisited_rows");
}

inline void check_blas_extent(char const* what, char const* name, int64_t value) {
  moe::detail::require<ShapeError>(value <= INT_MAX, what, ": ", name, "=", value,
                                   " exceeds the 32-bit BLAS limit ", INT_MAX,
                                   "; use the Tiled policy or split the problem");
}

// ----------------------------------------------------------------------------------------------
// Shape checks (host)

template <class Mem>
void check_groups(char const* what, moe::gmm::Groups<Mem> const& groups, int num_local,
                  moe::gmm::GmmOptions const& opt) {
  moe::detail::require<ShapeError>(
      groups.offsets.extent(0) == groups.offsets_host.extent(0) && groups.offsets.extent(0) >= 1,
      what, ": groups.offsets.extent(0)=", groups.offsets.extent(0),
      " and groups.offsets_host.extent(0)=", groups.offsets_host.extent(0),
      " must be equal and >= 1; build Groups with moe::gmm::make_groups");
  moe::detail::require<ShapeError>(opt.group_offset >= 0, what, ": group_offset=", opt.group_offset,
                                   " must be >= 0");
  moe::detail::require<ShapeError>(
      static_cast<int64_t>(opt.group_offset) + num_local <= groups.num_groups(), what,
      ": group_offset=", opt.group_offset, " + G_local=", num_local,
      " exceeds the number of groups G=", groups.num_groups());
}

template <class L, class R, class O, class Mem>
void check_gmm(L const& lhs, R const& rhs, moe::gmm::Groups<Mem> const& groups, O const& out,
               moe::gmm::GmmOptions const& opt) {
  char const* what = "moe::gmm::gmm";
  int64_t const m = lhs.extent(0), k = lhs.extent(1);
  int64_t const rk = opt.transpose_rhs ? rhs.extent(2) : rhs.extent(1);
  int64_t const n = opt.transpose_rhs ? rhs.extent(1) : rhs.extent(2);
  moe::detail::require<ShapeError>(rhs.extent(0) <= INT_MAX, what,
                                   ": rhs.extent(0)=", rhs.extent(0), " groups is more than ",
                                   INT_MAX);
  check_groups(what, groups, static_cast<int>(rhs.extent(0)), opt);
  moe::detail::require<ShapeError>(m >= groups.rows(), what, ": lhs.extent(0)=", m,
                                   " is smaller than the number of grouped rows ", groups.rows(),
                                   " (sum of group sizes); lhs needs a row for each");
  moe::detail::require<ShapeError>(
      rk == k, what, ": lhs is [", m, ",", k, "] but rhs is [", rhs.extent(0), ",", rhs.extent(1),
      ",", rhs.extent(2), "]; rhs.extent(", opt.transpose_rhs ? 2 : 1, ")=", rk,
      " must equal lhs.extent(1)=", k, opt.transpose_rhs ? " (transpose_rhs)" : "");
  moe::detail::require<ShapeError>(out.extent(0) == lhs.extent(0) && int64_t(out.extent(1)) == n,
                                   what, ": out is [", out.extent(0), ",", out.extent(1),
                                   "] but must be [lhs.extent(0), n] = [", m, ",", n, "]");
}

template <class L, class D, class O, class Mem>
void check_tgmm(L const& lhs, D const& dy, moe::gmm::Groups<Mem> const& groups, O const& out,
                moe::gmm::GmmOptions const& opt) {
  char const* what = "moe::gmm::tgmm";
  int64_t const m = lhs.extent(0), k = lhs.extent(1), n = dy.extent(1);
  moe::detail::require<ShapeError>(out.extent(0) <= INT_MAX, what,
                                   ": out.extent(0)=", out.extent(0), " groups is more than ",
                                   INT_MAX);
  check_groups(what, groups, static_cast<int>(out.extent(0)), opt);
  moe::detail::require<ShapeError>(m >= groups.rows(), what, ": lhs.extent(0)=", m,
                                   " is smaller than the number of grouped rows ", groups.rows(),
                                   " (sum of group sizes); lhs needs a row for each");
  moe::detail::require<ShapeError>(int64_t(dy.extent(0)) == m, what,
                                   ": dy.extent(0)=", dy.extent(0),
                                   " must equal lhs.extent(0)=", m);
  moe::detail::require<ShapeError>(int64_t(out.extent(1)) == k && int64_t(out.extent(2)) == n, what,
                                   ": out is [", out.extent(0), ",", out.extent(1), ",",
                                   out.extent(2), "] but must be [G_local, ", k, ", ", n,
                                   "] = [G_local, lhs.extent(1), dy.extent(1)]");
}

// ----------------------------------------------------------------------------------------------
// Policy implementations. The primary template rejects unknown policies.

/// Row granule of the Vendor gmm on this backend (see Impl<Vendor>::gmm); 1 = no padding. Only
/// host BLAS was measured to need it, so device backends do not pad.
template <class ExecSpace>
struct VendorRowPad
    : std::integral_constant<
          int64_t, Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible ? 16 : 1> {
};

template <class Policy>
struct Impl {
  static_assert(!std::is_same<Policy, Policy>::value,
                "moe::gmm: Policy must be moe::gmm::Vendor, moe::gmm::Dense, moe::gmm::Auto or "
                "moe::gmm::Tiled<TM,TK,TN>");
};

template <>
struct Impl<moe::gmm::Vendor> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  moe::gmm::Groups<Mem> const& groups, Mat<E, S, MO> const& out,
                  moe::gmm::GmmOptions const& opt) {
    char const* what = "moe::gmm::gmm<Vendor>";
    int const num_local = rhs.extent(0);
    int64_t const m = lhs.extent(0), k = lhs.extent(1);
    auto const& off = groups.offsets_host;
    int64_t const begin = off(opt.group_offset), end = off(opt.group_offset + num_local);
    if (out.extent(1) > 0 && end > begin && k == 0) {
      // BLAS returns early on an empty contraction without touching C.
      if (!opt.accumulate)
        zero(space, Mat<E, S, MO>(Kokkos::subview(out, Rows(begin, end), Kokkos::ALL)),
             "moe::gmm::zero_rows");
    } else if (out.extent(1) > 0 && end > begin) {
      check_blas_extent(what, "k", k);
      check_blas_extent(what, "n", out.extent(1));
      // Host BLAS kernels run a row count that is a multiple of their register block much faster
      // (OpenBLAS sgemm, 2 threads: 44 rows 99 GFLOP/s, 48 rows 182). Without accumulate a group
      // may compute up to pad-1 extra rows: they belong to later groups, which are computed
      // afterwards and overwrite them, or lie past the visited rows, which are zeroed below.
      int64_t const pad = opt.accumulate ? 1 : VendorRowPad<E>::value;
      BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MR>, Mat<E, S, MO>> order(space);
      for (int g = 0; g < num_local; ++g) {
        int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
        if (r1 == r0) continue;
        int64_t const padded = r0 + (r1 - r0 + pad - 1) / pad * pad;
        int64_t const stop = padded <= m ? padded : r1;
        check_blas_extent(what, "rows of a group", stop - r0);
        CMat<E, S, ML> a = Kokkos::subview(lhs, Rows(r0, stop), Kokkos::ALL);
        CMat<E, S, MR> b = Kokkos::subview(rhs, g, Kokkos::ALL, Kokkos::ALL);
        Mat<E, S, MO> c = Kokkos::subview(out, Rows(r0, stop), Kokkos::ALL);
        blas_gemm(space, "N", opt.transpose_rhs ? "T" : "N", S(1), a, b,
                  opt.accumulate ? S(1) : S(0), c);
      }
    }
    if (!opt.accumulate) zero_outside(space, out, begin, end);
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   moe::gmm::Groups<Mem> const& groups, Tensor<E, S, MO> const& out,
                   moe::gmm::GmmOptions const& opt) {
    char const* what = "moe::gmm::tgmm<Vendor>";
    int const num_local = out.extent(0);
    auto const& off = groups.offsets_host;
    if (out.extent(1) == 0 || out.extent(2) == 0) return;
    check_blas_extent(what, "k", out.extent(1));
    check_blas_extent(what, "n", out.extent(2));
    BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MD>, Mat<E, S, MO>> order(space);
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
      blas_gemm(space, "T", "N", S(1), a, b, opt.accumulate ? S(1) : S(0), c);
    }
  }
};

template <>
struct Impl<moe::gmm::Dense> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  moe::gmm::Groups<Mem> const& groups, Mat<E, S, MO> const& out,
                  moe::gmm::GmmOptions const& opt) {
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
        BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MR>, Mat<E, S, MO>> order(space);
        CMat<E, S, MR> b = Kokkos::subview(rhs, g, Kokkos::ALL, Kokkos::ALL);
        blas_gemm(space, "N", opt.transpose_rhs ? "T" : "N", S(1), lhs, b, S(1), all_u);
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
                   moe::gmm::Groups<Mem> const& groups, Tensor<E, S, MO> const& out,
                   moe::gmm::GmmOptions const& opt) {
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
      BlasOrder<E, CMat<E, S, ML>, CMat<E, S, MD>, Mat<E, S, MO>> order(space);
      blas_gemm(space, "T", "N", S(1), CMat<E, S, ML>(masked), dy, S(1), c);
    }
    fence(space, "moe::gmm::dense: before releasing the temporary");
  }
};

// ----------------------------------------------------------------------------------------------
// Tiled: a team computes one output tile C[TM,TN] += A[TM,TK-chunk] * B[TK-chunk,TN] with A and B
// staged in scratch. Each thread of the team owns UM x UN register blocks of C ("micro tiles");
// on host backends a team is one thread walking all micro tiles of its tile.

/// Bytes of one SIMD register of the host target this translation unit is compiled for.
#if defined(__AVX512F__)
constexpr int host_simd_bytes = 64;
#elif defined(__AVX__)
constexpr int host_simd_bytes = 32;
#else
constexpr int host_simd_bytes = 16;
#endif

template <class ExecSpace, class Scalar>
struct MicroTile {
  static constexpr bool host = Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
  // Host: 4 rows x 2 SIMD registers of accumulators (8 registers, leaving room for the operands
  // even with SSE's 16); a wider block spills and the compiler stops vectorising along columns.
  // Device: 4 x 4 per thread.
  static constexpr int um = 4;
  static constexpr int un = host ? static_cast<int>(2 * host_simd_bytes / sizeof(Scalar)) : 4;
  static constexpr int max_team = host ? 1 : 256;
};

constexpr int round_up(int x, int to) { return (x + to - 1) / to * to; }

template <class Scalar, int TMp, int TK, int TNp, int UM, int UN>
KOKKOS_INLINE_FUNCTION void micro_tile(Scalar const* As, Scalar const* Bs, Scalar* Cs, int i0,
                                       int j0) {
  // As is [TK][TMp] (k-major so a micro tile's UM values are adjacent), Bs is [TK][TNp].
  Scalar acc[UM][UN];
  for (int a = 0; a < UM; ++a)
    for (int b = 0; b < UN; ++b) acc[a][b] = Cs[(i0 + a) * TNp + j0 + b];
  for (int kk = 0; kk < TK; ++kk) {
    Scalar const* arow = As + kk * TMp + i0;
    Scalar const* brow = Bs + kk * TNp + j0;
    for (int a = 0; a < UM; ++a) {
      Scalar const av = arow[a];
      for (int b = 0; b < UN; ++b) acc[a][b] += av * brow[b];
    }
  }
  for (int a = 0; a < UM; ++a)
    for (int b = 0; b < UN; ++b) Cs[(i0 + a) * TNp + j0 + b] = acc[a][b];
}

/// Shared part of the gmm and tgmm tile kernels: scratch layout, micro-tile loop, store.
template <class ExecSpace, class Scalar, int TM, int TK, int TN>
struct TileCore {
  using MT = MicroTile<ExecSpace, Scalar>;
  static constexpr int UM = TM < MT::um ? TM : MT::um;
  static constexpr int UN = TN < MT::un ? TN : MT::un;
  static constexpr int TMp = round_up(TM, UM);
  static constexpr int TNp = round_up(TN, UN);
  static constexpr int num_micro = (TMp / UM) * (TNp / UN);
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using ScratchView = Kokkos::View<Scalar*, typename ExecSpace::scratch_memory_space,
                                   Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  static std::size_t scratch_bytes() {
    return ScratchView::shmem_size(TK * TMp) + ScratchView::shmem_size(TK * TNp) +
           ScratchView::shmem_size(TMp * TNp);
  }

  struct Scratch {
    Scalar* a;
    Scalar* b;
    Scalar* c;
  };

  KOKKOS_INLINE_FUNCTION static Scratch scratch(member_type const& team, int level) {
    ScratchView a(team.team_scratch(level), TK * TMp);
    ScratchView b(team.team_scratch(level), TK * TNp);
    ScratchView c(team.team_scratch(level), TMp * TNp);
    return {a.data(), b.data(), c.data()};
  }

  /// Calls f(r, c, valid) for every element of an R x C block, valid = r < rv && c < cv, with c
  /// the fast index: host backends walk rows with a plain inner loop (vectorisable), device
  /// backends spread the flat index over the team (coalesced along c).
  template <class F>
  KOKKOS_INLINE_FUNCTION static void stage(member_type const& team, int R, int C, int rv, int cv,
                                           F const& f) {
    if constexpr (MT::host) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
        int const valid_cols = r < rv ? cv : 0;
        for (int c = 0; c < valid_cols; ++c) f(r, c, true);
        for (int c = valid_cols; c < C; ++c) f(r, c, false);
      });
    } else {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R * C), [&](int idx) {
        int const r = idx / C, c = idx % C;
        f(r, c, r < rv && c < cv);
      });
    }
  }

  KOKKOS_INLINE_FUNCTION static void clear(member_type const& team, Scratch const& s) {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TMp * TNp),
                         [&](int idx) { s.c[idx] = Scalar(0); });
  }

  /// C += A * B over the micro tiles that hold part of the valid rows x cols (the padding of a
  /// ragged tile is never stored, so it is not computed either).
  KOKKOS_INLINE_FUNCTION static void multiply(member_type const& team, Scratch const& s, int rows,
                                              int cols) {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, num_micro), [&](int t) {
      int const i0 = (t / (TNp / UN)) * UM, j0 = (t % (TNp / UN)) * UN;
      if (i0 < rows && j0 < cols) micro_tile<Scalar, TMp, TK, TNp, UM, UN>(s.a, s.b, s.c, i0, j0);
    });
  }

  /// out(row0 + i, col0 + j) (+)= C(i, j) for i < rows, j < cols.
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void store(member_type const& team, Scratch const& s,
                                           Out const& out, int64_t row0, int rows, int64_t col0,
                                           int cols, bool accumulate) {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows * cols), [&](int idx) {
      int const i = idx / cols, j = idx % cols;
      Scalar const v = s.c[i * TNp + j];
      if (accumulate)
        out(row0 + i, col0 + j) += v;
      else
        out(row0 + i, col0 + j) = v;
    });
  }

  static int team_size() { return num_micro < MT::max_team ? num_micro : MT::max_team; }
};

template <class ExecSpace, class Scalar, int TM, int TK, int TN, bool TransB, class MemL,
          class MemR, class MemO, class MemG>
struct TiledGmmKernel {
  using Core = TileCore<ExecSpace, Scalar, TM, TK, TN>;
  using member_type = typename Core::member_type;
  static constexpr int TMp = Core::TMp, TNp = Core::TNp;

  CMat<ExecSpace, Scalar, MemL> lhs;
  CTensor<ExecSpace, Scalar, MemR> rhs;
  Mat<ExecSpace, Scalar, MemO> out;
  Kokkos::View<const int64_t*, MemG> offsets;      // [G+1] of all groups
  Kokkos::View<const int64_t*, MemG> tile_prefix;  // [G_local+1] first tile of each local group
  int group_offset;
  int num_local;
  int64_t k;
  int64_t n;
  int n_tiles;
  bool accumulate;
  int level;

  KOKKOS_INLINE_FUNCTION void operator()(member_type const& team) const {
    // Tiles run group by group, n-tile by n-tile, then over the group's m-tiles, so the
    // rhs panel [k, TN] of a group stays in cache while its row tiles stream past.
    int64_t const t = team.league_rank();
    int lo = 0, hi = num_local;  // the last local group g with tile_prefix(g) <= t
    while (hi - lo > 1) {
      int const mid = (lo + hi) / 2;
      if (tile_prefix(mid) <= t)
        lo = mid;
      else
        hi = mid;
    }
    int const g = lo;
    int64_t const local = t - tile_prefix(g);
    int64_t const m_tiles = (tile_prefix(g + 1) - tile_prefix(g)) / n_tiles;
    int const nt = static_cast<int>(local / m_tiles);
    int64_t const mt = local % m_tiles;
    int64_t const row0 = offsets(group_offset + g) + mt * TM;
    int64_t const row_end = offsets(group_offset + g + 1);
    int const rows = static_cast<int>(row_end - row0 < TM ? row_end - row0 : TM);
    int64_t const col0 = int64_t(nt) * TN;
    int const cols = static_cast<int>(n - col0 < TN ? n - col0 : TN);

    auto s = Core::scratch(team, level);
    Core::clear(team, s);
    for (int64_t k0 = 0; k0 < k; k0 += TK) {
      int const kc = static_cast<int>(k - k0 < TK ? k - k0 : TK);
      Scalar* const a = s.a;
      Scalar* const b = s.b;
      // As[kk][i] = lhs(row0 + i, k0 + kk)
      Core::stage(team, TMp, TK, rows, kc, [&](int i, int kk, bool valid) {
        a[kk * TMp + i] = valid ? lhs(row0 + i, k0 + kk) : Scalar(0);
      });
      if (TransB) {  // Bs[kk][j] = rhs(g, col0 + j, k0 + kk)
        Core::stage(team, TNp, TK, cols, kc, [&](int j, int kk, bool valid) {
          b[kk * TNp + j] = valid ? rhs(g, col0 + j, k0 + kk) : Scalar(0);
        });
      } else {  // Bs[kk][j] = rhs(g, k0 + kk, col0 + j)
        Core::stage(team, TK, TNp, kc, cols, [&](int kk, int j, bool valid) {
          b[kk * TNp + j] = valid ? rhs(g, k0 + kk, col0 + j) : Scalar(0);
        });
      }
      team.team_barrier();
      Core::multiply(team, s, rows, cols);
      team.team_barrier();
    }
    Core::store(team, s, out, row0, rows, col0, cols, accumulate);
  }
};

template <class ExecSpace, class Scalar, int TM, int TK, int TN, class MemL, class MemD, class MemO,
          class MemG>
struct TiledTgmmKernel {
  using Core = TileCore<ExecSpace, Scalar, TM, TK, TN>;
  using member_type = typename Core::member_type;
  static constexpr int TMp = Core::TMp, TNp = Core::TNp;

  CMat<ExecSpace, Scalar, MemL> lhs;
  CMat<ExecSpace, Scalar, MemD> dy;
  Tensor<ExecSpace, Scalar, MemO> out;
  Kokkos::View<const int64_t*, MemG> offsets;
  int group_offset;
  int64_t k;
  int64_t n;
  int k_tiles;
  int n_tiles;
  bool accumulate;
  int level;

  KOKKOS_INLINE_FUNCTION void operator()(member_type const& team) const {
    int64_t const t = team.league_rank();
    int const g = static_cast<int>(t / (int64_t(k_tiles) * n_tiles));
    int const rest = static_cast<int>(t % (int64_t(k_tiles) * n_tiles));
    int64_t const kcol0 = int64_t(rest / n_tiles) * TM;
    int64_t const col0 = int64_t(rest % n_tiles) * TN;
    int const kcols = static_cast<int>(k - kcol0 < TM ? k - kcol0 : TM);
    int const cols = static_cast<int>(n - col0 < TN ? n - col0 : TN);
    int64_t const r_begin = offsets(group_offset + g), r_end = offsets(group_offset + g + 1);

    auto s = Core::scratch(team, level);
    Core::clear(team, s);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += TK) {
      int const rc = static_cast<int>(r_end - r0 < TK ? r_end - r0 : TK);
      // The contraction runs over the group's rows: As[kk][i] = lhs(r0 + kk, kcol0 + i).
      Scalar* const a = s.a;
      Scalar* const b = s.b;
      Core::stage(team, TK, TMp, rc, kcols, [&](int kk, int i, bool valid) {
        a[kk * TMp + i] = valid ? lhs(r0 + kk, kcol0 + i) : Scalar(0);
      });
      Core::stage(team, TK, TNp, rc, cols, [&](int kk, int j, bool valid) {
        b[kk * TNp + j] = valid ? dy(r0 + kk, col0 + j) : Scalar(0);
      });
      team.team_barrier();
      Core::multiply(team, s, kcols, cols);
      team.team_barrier();
    }
    auto out_g = Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL);
    Core::store(team, s, out_g, kcol0, kcols, col0, cols, accumulate);
  }
};

template <class ExecSpace>
Kokkos::TeamPolicy<ExecSpace> tile_policy(ExecSpace const& space, int64_t league, int team_size,
                                          std::size_t bytes, int& level, char const* what) {
  moe::detail::require<ShapeError>(league <= INT_MAX, what, ": ", league,
                                   " tiles exceed the launch limit ", INT_MAX,
                                   "; use larger tiles");
  level =
      bytes <= static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(0)) ? 0 : 1;
  moe::detail::require<ShapeError>(
      bytes <= static_cast<std::size_t>(Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(level)),
      what, ": the tiles need ", bytes, " bytes of team scratch, more than the ",
      Kokkos::TeamPolicy<ExecSpace>::scratch_size_max(level),
      " available; use smaller TM, TK or TN");
  return Kokkos::TeamPolicy<ExecSpace>(space, static_cast<int>(league), team_size)
      .set_scratch_size(level, Kokkos::PerTeam(bytes));
}

template <int TM, int TK, int TN>
struct Impl<moe::gmm::Tiled<TM, TK, TN>> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  moe::gmm::Groups<Mem> const& groups, Mat<E, S, MO> const& out,
                  moe::gmm::GmmOptions const& opt) {
    using Core = TileCore<E, S, TM, TK, TN>;
    char const* what = "moe::gmm::gmm<Tiled>";
    int const num_local = rhs.extent(0);
    int64_t const n = out.extent(1);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    if (!opt.accumulate) zero_outside(space, out, off(go), off(go + num_local));
    if (n == 0 || off(go + num_local) == off(go)) return;

    int64_t m_tiles = 0;
    for (int g = 0; g < num_local; ++g) m_tiles += (off(go + g + 1) - off(go + g) + TM - 1) / TM;
    int64_t const n_tiles = (n + TN - 1) / TN;
    moe::detail::require<ShapeError>(n_tiles <= INT_MAX, what, ": n=", n, " is too large");

    // First tile of each local group, computed where the offsets live (no host->device copy).
    Kokkos::View<int64_t*, Mem> prefix(
        Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::gmm::tiled::tile_prefix"),
        num_local + 1);
    auto offsets = groups.offsets;
    Kokkos::parallel_scan(
        "moe::gmm::tiled::tile_prefix", Kokkos::RangePolicy<E>(space, 0, num_local),
        KOKKOS_LAMBDA(int g, int64_t& sum, bool final) {
          if (final) prefix(g) = sum;
          sum += (offsets(go + g + 1) - offsets(go + g) + TM - 1) / TM * n_tiles;
          if (final && g + 1 == num_local) prefix(g + 1) = sum;
        });

    int level = 0;
    auto policy = tile_policy(space, m_tiles * n_tiles, Core::team_size(), Core::scratch_bytes(),
                              level, what);
    auto launch = [&](auto trans) {
      TiledGmmKernel<E, S, TM, TK, TN, decltype(trans)::value, ML, MR, MO, Mem> kernel{
          lhs,
          rhs,
          out,
          offsets,
          prefix,
          go,
          num_local,
          int64_t(lhs.extent(1)),
          n,
          static_cast<int>(n_tiles),
          opt.accumulate,
          level};
      Kokkos::parallel_for("moe::gmm::gmm<Tiled>", policy, kernel);
    };
    if (opt.transpose_rhs)
      launch(std::true_type{});
    else
      launch(std::false_type{});
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   moe::gmm::Groups<Mem> const& groups, Tensor<E, S, MO> const& out,
                   moe::gmm::GmmOptions const& opt) {
    using Core = TileCore<E, S, TM, TK, TN>;
    char const* what = "moe::gmm::tgmm<Tiled>";
    int const num_local = out.extent(0);
    int64_t const k = out.extent(1), n = out.extent(2);
    if (num_local == 0 || k == 0 || n == 0) return;
    int64_t const k_tiles = (k + TM - 1) / TM, n_tiles = (n + TN - 1) / TN;
    moe::detail::require<ShapeError>(k_tiles * n_tiles <= INT_MAX, what, ": k=", k, " x n=", n,
                                     " is too large");
    int level = 0;
    auto policy = tile_policy(space, num_local * k_tiles * n_tiles, Core::team_size(),
                              Core::scratch_bytes(), level, what);
    TiledTgmmKernel<E, S, TM, TK, TN, ML, MD, MO, Mem> kernel{lhs,
                                                              dy,
                                                              out,
                                                              groups.offsets,
                                                              opt.group_offset,
                                                              k,
                                                              n,
                                                              static_cast<int>(k_tiles),
                                                              static_cast<int>(n_tiles),
                                                              opt.accumulate,
                                                              level};
    Kokkos::parallel_for("moe::gmm::tgmm<Tiled>", policy, kernel);
  }
};

template <class ExecSpace, class... Views>
constexpr void static_checks() {
  static_assert(Kokkos::is_execution_space<ExecSpace>::value,
                "moe::gmm: the first argument must be a Kokkos execution space instance");
  static_assert((Kokkos::is_view<Views>::value && ...), "moe::gmm: operands must be Kokkos::Views");
  static_assert((std::is_same<typename Views::array_layout, Kokkos::LayoutRight>::value && ...),
                "moe::gmm: operands must be LayoutRight (row-major) Views");
  static_assert(
      (Kokkos::SpaceAccessibility<ExecSpace, typename Views::memory_space>::accessible && ...),
      "moe::gmm: operands must be accessible from the execution space");
}

}  // namespace moe::detail::gmm_impl

namespace moe::gmm {

/// \brief Grouped GEMM: out[rows of group group_offset+g, :] = lhs[rows, :] * rhs[g] for
/// g in [0, G_local) (rhs[g]^T with opt.transpose_rhs).
///
/// Rows that belong to no visited group (groups outside [group_offset, group_offset+G_local) and
/// rows >= groups.rows()) are set to zero, unless opt.accumulate, which adds the result to out
/// and leaves every other row unchanged. out must not alias lhs or rhs.
/// \tparam Policy Vendor (= Auto), Tiled<TM,TK,TN> or Dense
/// \param space execution space instance every kernel and copy runs on
/// \param lhs [m, k], m >= groups.rows()
/// \param rhs [G_local, k, n], or [G_local, n, k] with opt.transpose_rhs
/// \param groups row partition of lhs (G >= group_offset + G_local groups)
/// \param out [m, n]
/// \param opt transpose_rhs, group_offset, accumulate
/// \throws moe::ShapeError if the extents disagree
template <class Policy, class ExecSpace, class LhsView, class RhsView, class OutView,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void gmm(ExecSpace const& space, Policy, LhsView const& lhs, RhsView const& rhs,
         Groups<typename ExecSpace::memory_space> const& groups, OutView const& out,
         GmmOptions opt = {}) {
  namespace impl = moe::detail::gmm_impl;
  impl::static_checks<ExecSpace, LhsView, RhsView, OutView>();
  static_assert(LhsView::rank == 2 && RhsView::rank == 3 && OutView::rank == 2,
                "moe::gmm::gmm: lhs must be rank 2, rhs rank 3, out rank 2");
  using S = typename OutView::non_const_value_type;
  static_assert(std::is_same<typename LhsView::non_const_value_type, S>::value &&
                    std::is_same<typename RhsView::non_const_value_type, S>::value,
                "moe::gmm::gmm: lhs, rhs and out must have the same scalar type");
  static_assert(std::is_floating_point<S>::value, "moe::gmm::gmm: Scalar must be float or double");
  static_assert(std::is_same<typename OutView::value_type, S>::value,
                "moe::gmm::gmm: out must be writable (non-const)");
  impl::check_gmm(lhs, rhs, groups, out, opt);
  using ML = typename LhsView::memory_space;
  using MR = typename RhsView::memory_space;
  using MO = typename OutView::memory_space;
  impl::Impl<Policy>::gmm(space, impl::CMat<ExecSpace, S, ML>(lhs),
                          impl::CTensor<ExecSpace, S, MR>(rhs), groups,
                          impl::Mat<ExecSpace, S, MO>(out), opt);
}

/// \brief gmm on the default instance of OutView's execution space.
template <class Policy, class LhsView, class RhsView, class OutView,
          class = std::enable_if_t<!Kokkos::is_execution_space<Policy>::value>>
void gmm(Policy policy, LhsView const& lhs, RhsView const& rhs,
         Groups<typename OutView::execution_space::memory_space> const& groups, OutView const& out,
         GmmOptions opt = {}) {
  gmm(typename OutView::execution_space(), policy, lhs, rhs, groups, out, opt);
}

/// \brief Weight gradient of gmm: out[g] = lhs[rows of group group_offset+g, :]^T * dy[same rows,
/// :] for g in [0, G_local). Empty groups produce zero blocks; opt.accumulate adds to out instead.
/// opt.transpose_rhs is ignored.
/// \tparam Policy Vendor (= Auto), Tiled<TM,TK,TN> or Dense
/// \param space execution space instance every kernel and copy runs on
/// \param lhs [m, k], m >= groups.rows()
/// \param dy [m, n]
/// \param groups row partition of lhs and dy
/// \param out [G_local, k, n]
/// \param opt group_offset, accumulate
/// \throws moe::ShapeError if the extents disagree
template <class Policy, class ExecSpace, class LhsView, class DyView, class OutView,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void tgmm(ExecSpace const& space, Policy, LhsView const& lhs, DyView const& dy,
          Groups<typename ExecSpace::memory_space> const& groups, OutView const& out,
          GmmOptions opt = {}) {
  namespace impl = moe::detail::gmm_impl;
  impl::static_checks<ExecSpace, LhsView, DyView, OutView>();
  static_assert(LhsView::rank == 2 && DyView::rank == 2 && OutView::rank == 3,
                "moe::gmm::tgmm: lhs must be rank 2, dy rank 2, out rank 3");
  using S = typename OutView::non_const_value_type;
  static_assert(std::is_same<typename LhsView::non_const_value_type, S>::value &&
                    std::is_same<typename DyView::non_const_value_type, S>::value,
                "moe::gmm::tgmm: lhs, dy and out must have the same scalar type");
  static_assert(std::is_floating_point<S>::value, "moe::gmm::tgmm: Scalar must be float or double");
  static_assert(std::is_same<typename OutView::value_type, S>::value,
                "moe::gmm::tgmm: out must be writable (non-const)");
  impl::check_tgmm(lhs, dy, groups, out, opt);
  using ML = typename LhsView::memory_space;
  using MD = typename DyView::memory_space;
  using MO = typename OutView::memory_space;
  impl::Impl<Policy>::tgmm(space, impl::CMat<ExecSpace, S, ML>(lhs),
                           impl::CMat<ExecSpace, S, MD>(dy), groups,
                           impl::Tensor<ExecSpace, S, MO>(out), opt);
}

/// \brief tgmm on the default instance of OutView's execution space.
template <class Policy, class LhsView, class DyView, class OutView,
          class = std::enable_if_t<!Kokkos::is_execution_space<Policy>::value>>
void tgmm(Policy policy, LhsView const& lhs, DyView const& dy,
          Groups<typename OutView::execution_space::memory_space> const& groups, OutView const& out,
          GmmOptions opt = {}) {
  tgmm(typename OutView::execution_space(), policy, lhs, dy, groups, out, opt);
}

}  // namespace moe::gmm
