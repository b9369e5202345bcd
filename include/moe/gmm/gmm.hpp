#pragma once
/// \file
/// Grouped matrix multiply (GMM): consecutive row groups (one per expert), each multiplied by its
/// own weight matrix, by a compile-time policy (one file each under gmm/backend/). SEMANTICS.md
/// §1.8 items 26-27, except that rows of no visited group are zeroed unless the call accumulates.

#include <moe/detail/compat.hpp>
#include <moe/gmm/backend/dense.hpp>
#include <moe/gmm/backend/onednn.hpp>
#include <moe/gmm/backend/tiled.hpp>
#include <moe/gmm/backend/vendor.hpp>
#include <moe/gmm/groups.hpp>
#include <moe/gmm/pack_cache.hpp>
#include <moe/gmm/policy.hpp>

#include <type_traits>

namespace moe::gmm {

/// \brief The policy that runs for `Policy` on (ExecSpace, Scalar): Auto as documented there; an
/// unavailable policy runs as Vendor.
template <class Policy, class ExecSpace, class Scalar>
struct resolve {
  using type = std::conditional_t<is_available<Policy, ExecSpace, Scalar>::value, Policy, Vendor>;
};
template <class ExecSpace, class Scalar>
struct resolve<Auto, ExecSpace, Scalar> {
  using type = std::conditional_t<
      is_available<OneDnn, ExecSpace, Scalar>::value, OneDnn,
      std::conditional_t<moe::detail::runs_on_host<ExecSpace>(), Vendor, DeviceTiled>>;
};
template <class Policy, class ExecSpace, class Scalar>
using resolve_t = typename resolve<Policy, ExecSpace, Scalar>::type;

/// \brief Name of the backend that runs for `Policy` on (ExecSpace, Scalar), e.g. "OneDnn".
template <class Policy, class ExecSpace, class Scalar>
constexpr char const* backend_name() {
  using R = resolve_t<Policy, ExecSpace, Scalar>;
  return std::is_same_v<R, OneDnn>   ? "OneDnn"
         : std::is_same_v<R, Vendor> ? "Vendor"
         : std::is_same_v<R, Dense>  ? "Dense"
                                     : "Tiled";
}

/// \brief Grouped GEMM on the instance `space`: out[rows of group group_offset+g, :] = lhs[rows, :]
/// * rhs[g] for g in [0, G_local) (rhs[g]^T with opt.transpose_rhs). lhs [m, k] with m >=
/// groups.rows(), rhs [G_local, k, n] ([G_local, n, k] transposed), out [m, n], not aliasing lhs
/// or rhs. Rows of no visited group are zeroed, unless opt.accumulate, which adds to out and leaves
/// other rows unchanged; opt.bf16_output rounds the visited rows to bf16 (moe::ConfigError with
/// accumulate). rhs holds the scalar (float or double); lhs and out hold it or moe::bf16 (16-bit
/// activations: read exactly; written rounded, as bf16_output, and never accumulated into).
/// Throws moe::ShapeError if extents disagree.
/// \tparam Policy Auto, OneDnn, Vendor, Tiled<TM,TK,TN> or Dense (see moe::gmm::is_policy)
template <class Policy, class ExecSpace, class LhsView, class RhsView, class OutView,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void gmm(ExecSpace const& space, Policy, LhsView const& lhs, RhsView const& rhs,
         Groups<typename ExecSpace::memory_space> const& groups, OutView const& out,
         GmmOptions opt = {}) {
  namespace impl = moe::gmm::detail;
  impl::static_checks<Policy, ExecSpace, LhsView, RhsView, OutView, 2>();
  using S = typename RhsView::non_const_value_type;
  using TL = typename LhsView::non_const_value_type;
  using TO = typename OutView::non_const_value_type;
  impl::check_gmm(lhs, rhs, groups, out, opt);
  moe::detail::Region region("moe::gmm::gmm");
  using R = resolve_t<Policy, ExecSpace, S>;
  if constexpr (!rounds_rhs<R>::value)
    if (opt.round_rhs) {  // this backend reads rhs as it is: hand it a rounded copy
      opt.round_rhs = false;
      auto const rounded = moe::detail::rounded_copy(space, rhs);
      gmm(space, R{}, lhs, rounded, groups, out, opt);
      moe::detail::fence(space, "moe::gmm: rounded weights used");  // before they are freed
      return;
    }
  constexpr bool rows16 = impl::is_bf16<TL> || impl::is_bf16<TO>;
  if constexpr (rows16 && !handles_bf16<R>::value) {
    opt.bf16_output = opt.bf16_output && !impl::is_bf16<TO>;  // narrowing rounds
    impl::via_float<S, true>(space, lhs, out, [&](auto const& l, auto const& o) {
      gmm(space, R{}, l, rhs, groups, o, opt);
    });
  } else {
    impl::Mat<ExecSpace, TO, typename OutView::memory_space> const o(out);
    impl::Impl<R>::gmm(space, impl::CMat<ExecSpace, TL, typename LhsView::memory_space>(lhs),
                       impl::CTensor<ExecSpace, S, typename RhsView::memory_space>(rhs), groups, o,
                       opt);
    if constexpr (!handles_bf16<R>::value)  // those round their rows themselves
      if (opt.bf16_output)
        impl::round_rows(space, o, groups.offsets_host(opt.group_offset),
                         groups.offsets_host(opt.group_offset + int(rhs.extent(0))));
  }
}

/// \brief gmm on the default instance of OutView's execution space.
template <class Policy, class LhsView, class RhsView, class OutView,
          class = std::enable_if_t<!Kokkos::is_execution_space<Policy>::value>>
void gmm(Policy policy, LhsView const& lhs, RhsView const& rhs,
         Groups<typename OutView::execution_space::memory_space> const& groups, OutView const& out,
         GmmOptions opt = {}) {
  gmm(typename OutView::execution_space(), policy, lhs, rhs, groups, out, opt);
}

/// \brief Two grouped GEMMs summed: out = lhs_a * rhs_a[g] + lhs_b * rhs_b[g] on the rows of each
/// visited group (each product as gmm's, with the same groups and options; other rows zeroed). The
/// sum is taken in the scalar before out is written, so a moe::bf16 out (or opt.bf16_output)
/// rounds it once: the bits of gmm(a), then gmm(b) with accumulate into a scalar out, rounded
/// after. A gated FFN's input gradient (d_h0 . wi_0^T + d_h1 . wi_1^T) written into 16-bit rows.
/// With a 16-bit out, OneDnn's packed mode sums each row chunk in a thread buffer; elsewhere the
/// sum goes through a scalar copy of out made for the call. opt.accumulate: moe::ConfigError.
template <class Policy, class ExecSpace, class LhsA, class RhsA, class LhsB, class RhsB,
          class OutView, class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void gmm_sum(ExecSpace const& space, Policy policy, LhsA const& lhs_a, RhsA const& rhs_a,
             LhsB const& lhs_b, RhsB const& rhs_b,
             Groups<typename ExecSpace::memory_space> const& groups, OutView const& out,
             GmmOptions const& opt = {}) {
  namespace impl = moe::gmm::detail;
  impl::static_checks<Policy, ExecSpace, LhsA, RhsA, OutView, 2>();
  impl::static_checks<Policy, ExecSpace, LhsB, RhsB, OutView, 2>();
  using S = typename RhsA::non_const_value_type;
  using TO = typename OutView::non_const_value_type;
  moe::detail::require<ConfigError>(!opt.accumulate,
                                    "moe::gmm::gmm_sum: accumulate=true; the sum overwrites out");
  impl::check_gmm(lhs_a, rhs_a, groups, out, opt);
  impl::check_gmm(lhs_b, rhs_b, groups, out, opt);
  moe::detail::require<ShapeError>(rhs_a.extent(0) == rhs_b.extent(0),
                                   "moe::gmm::gmm_sum: rhs_a.extent(0)=", rhs_a.extent(0),
                                   " and rhs_b.extent(0)=", rhs_b.extent(0),
                                   " must be equal (one weight matrix per group for each product)");
  moe::detail::Region region("moe::gmm::gmm_sum");
  using R = resolve_t<Policy, ExecSpace, S>;
  if constexpr (!impl::is_bf16<TO>) {
    GmmOptions first = opt;
    first.bf16_output = false;
    gmm(space, policy, lhs_a, rhs_a, groups, out, first);
    GmmOptions second = first;
    second.accumulate = true;
    gmm(space, policy, lhs_b, rhs_b, groups, out, second);
    if (opt.bf16_output)
      impl::round_rows(space, impl::Mat<ExecSpace, TO, typename OutView::memory_space>(out),
                       groups.offsets_host(opt.group_offset),
                       groups.offsets_host(opt.group_offset + int(rhs_a.extent(0))));
  } else {
    using TL = typename LhsA::non_const_value_type;
    if constexpr (impl::sums_rows16<R>::value &&
                  std::is_same<TL, typename LhsB::non_const_value_type>::value) {
      using M = typename OutView::memory_space;
      if (impl::Impl<R>::gmm_sum(
              space, impl::CMat<ExecSpace, TL, M>(lhs_a), impl::CTensor<ExecSpace, S, M>(rhs_a),
              impl::CMat<ExecSpace, TL, M>(lhs_b), impl::CTensor<ExecSpace, S, M>(rhs_b), groups,
              impl::Mat<ExecSpace, TO, M>(out), opt))
        return;
    }
    auto const wide = impl::widened<S>(space, out, false);
    gmm_sum(space, policy, lhs_a, rhs_a, lhs_b, rhs_b, groups, wide, opt);
    impl::convert_into(space, wide, out, "moe::gmm::narrow");
    moe::detail::fence(space, "moe::gmm::gmm_sum: float sum narrowed");  // before it is freed
  }
}

/// \brief Weight gradient of gmm: out[g] = lhs[rows of group group_offset+g, :]^T * dy[same rows,
/// :] for g in [0, G_local); lhs [m, k], dy [m, n], out [G_local, k, n]. Empty groups give zero
/// blocks; opt.accumulate adds to out instead; opt.transpose_rhs is ignored. out holds the scalar;
/// lhs and dy hold it or moe::bf16. Throws moe::ShapeError if extents disagree. Policy as for gmm.
template <class Policy, class ExecSpace, class LhsView, class DyView, class OutView,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void tgmm(ExecSpace const& space, Policy, LhsView const& lhs, DyView const& dy,
          Groups<typename ExecSpace::memory_space> const& groups, OutView const& out,
          GmmOptions opt = {}) {
  namespace impl = moe::gmm::detail;
  impl::static_checks<Policy, ExecSpace, LhsView, DyView, OutView, 3>();
  using S = typename OutView::non_const_value_type;
  using TL = typename LhsView::non_const_value_type;
  using TD = typename DyView::non_const_value_type;
  impl::check_tgmm(lhs, dy, groups, out, opt);
  moe::detail::Region region("moe::gmm::tgmm");
  using R = resolve_t<Policy, ExecSpace, S>;
  constexpr bool rows16 = impl::is_bf16<TL> || impl::is_bf16<TD>;
  if constexpr (rows16 && !handles_bf16<R>::value) {
    impl::via_float<S, false>(space, lhs, dy, [&](auto const& l, auto const& d) {
      tgmm(space, R{}, l, d, groups, out, opt);
    });
  } else {
    impl::Impl<R>::tgmm(space, impl::CMat<ExecSpace, TL, typename LhsView::memory_space>(lhs),
                        impl::CMat<ExecSpace, TD, typename DyView::memory_space>(dy), groups,
                        impl::Tensor<ExecSpace, S, typename OutView::memory_space>(out), opt);
  }
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
