#pragma once
/// \file
/// Grouped matrix multiply (GMM) of a MoE layer: the rows of the activations are split into
/// consecutive groups (one per expert) and every group is multiplied by its own weight matrix.
///
///   gmm : out[rows of group go+g, :] = lhs[rows, :] * rhs[g]   (rhs[g]^T with transpose_rhs)
///   tgmm: out[g] = lhs[rows of group go+g, :]^T * dy[same rows, :]          (weight gradient)
///
/// The algorithm is a compile-time policy, one file each under gmm/backend/ (Auto, OneDnn,
/// Vendor, Tiled<TM,TK,TN>, Dense). Group sizes are CSR offsets with a host copy (groups.hpp), so
/// no launch waits on the device. Semantics follow SEMANTICS.md §1.8 items 26-27, except that
/// rows outside the visited groups are always zeroed unless the call accumulates.

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

/// \brief The policy that runs for `Policy` on (ExecSpace, Scalar): Auto becomes OneDnn where
/// it is available, Vendor on other host spaces, and DeviceTiled (one launch per grouped GEMM)
/// on device spaces; a policy not available there runs as Vendor.
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
  if constexpr (std::is_same_v<R, OneDnn>)
    return "OneDnn";
  else if constexpr (std::is_same_v<R, Vendor>)
    return "Vendor";
  else if constexpr (std::is_same_v<R, Dense>)
    return "Dense";
  else
    return "Tiled";
}

}  // namespace moe::gmm

namespace moe::gmm {

/// \brief Grouped GEMM: out[rows of group group_offset+g, :] = lhs[rows, :] * rhs[g] for
/// g in [0, G_local) (rhs[g]^T with opt.transpose_rhs).
///
/// Rows that belong to no visited group (groups outside [group_offset, group_offset+G_local) and
/// rows >= groups.rows()) are set to zero, unless opt.accumulate, which adds the result to out
/// and leaves every other row unchanged. out must not alias lhs or rhs.
/// \tparam Policy Auto, OneDnn, Vendor, Tiled<TM,TK,TN> or Dense (see moe::gmm::is_policy)
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
  namespace impl = moe::gmm::detail;
  impl::static_checks<Policy, ExecSpace, LhsView, RhsView, OutView, 2>();
  using S = typename OutView::non_const_value_type;
  impl::check_gmm(lhs, rhs, groups, out, opt);
  using ML = typename LhsView::memory_space;
  using MR = typename RhsView::memory_space;
  using MO = typename OutView::memory_space;
  moe::detail::Region region("moe::gmm::gmm");
  impl::Impl<resolve_t<Policy, ExecSpace, S>>::gmm(space, impl::CMat<ExecSpace, S, ML>(lhs),
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
/// \tparam Policy Auto, OneDnn, Vendor, Tiled<TM,TK,TN> or Dense (see moe::gmm::is_policy)
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
  namespace impl = moe::gmm::detail;
  impl::static_checks<Policy, ExecSpace, LhsView, DyView, OutView, 3>();
  using S = typename OutView::non_const_value_type;
  impl::check_tgmm(lhs, dy, groups, out, opt);
  using ML = typename LhsView::memory_space;
  using MD = typename DyView::memory_space;
  using MO = typename OutView::memory_space;
  moe::detail::Region region("moe::gmm::tgmm");
  impl::Impl<resolve_t<Policy, ExecSpace, S>>::tgmm(space, impl::CMat<ExecSpace, S, ML>(lhs),
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
