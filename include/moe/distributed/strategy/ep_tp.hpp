#pragma once
/// \file
/// The EP-TP strategy of the distributed layer (ExpertRoute::EpTp): the tokens are split on D
/// over the expert axes (the expert axis acts as tensor parallelism outside the routed experts);
/// every expert rank all-gathers its D columns into the full-D tokens (the same on every expert
/// rank), routes them, runs only its local experts on only the rows routed to them (sorted
/// through the grouped GEMMs, or the dense masked experts: the gathered path's SortedExperts /
/// DenseExperts), and reduce-scatters the partial outputs back to D columns. The shared expert
/// runs on the full-D tokens with its hidden dim split over the expert axes. The transposes: dy
/// all-gathered on D, dx reduce-scattered on D, d_weights summed over the expert group.

#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/stages/route.hpp>
#include <moe/distributed/strategy/gathered.hpp>
#include <moe/distributed/strategy/shared_expert.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>
#include <vector>

namespace moe::distributed {
namespace stages {

// ------------------------------------------------------- strategy: EP-TP ------------------
// The tokens are split on D over the expert axes; x_work holds the full-D tokens, the same on
// every expert rank. Dispatch and experts are the gathered path's (local experts, routed rows
// only); partial outputs are reduce-scattered back to this rank's D columns.

/// Reduce-scatters partial full-D rows over the expert axes to this rank's D columns (the
/// workspace buffer `cols`) and adds them to `into`.
template <class Ctx>
void scatter_cols_into(Ctx& ctx, typename Ctx::view2 full, Handle<Values> cols,
                       typename Ctx::view2 into) {
  auto c = ctx.ws.make(cols);
  ctx.reduce_scatter(ctx.ep(), full, c, 1);
  moe::detail::add_into(ctx.space, c, into);
}
template <class Ctx>
void ep_tp_combine(Ctx& ctx, typename Ctx::view2 yw) {
  ctx.reduce_scatter(ctx.ep(), yw, ctx.ws.make(buf::y_cols), 1);
}
template <class Ctx>
void ep_tp_output_backward(Ctx& ctx, typename Ctx::cview2 dy) {
  ctx.all_gather(ctx.ep(), dy, ctx.ws.make(buf::dy_work), 1);
}
/// dxw: the working tokens' dx (EP-TP: work_tokens == tokens, the full-D rows of this rank's
/// batch).
template <class Ctx>
void ep_tp_dispatch_backward(Ctx& ctx, typename Ctx::view2 dxw, typename Ctx::view2 dx) {
  // Every expert rank holds the same tokens: d_weights (only the local experts' slots) summed,
  // dx (only the local experts' rows) summed and split on D.
  auto dw = ctx.ws.make(buf::d_weights);
  Kokkos::deep_copy(ctx.space, dw, ctx.ws.at(buf::d_weights_work));
  ctx.all_reduce(ctx.ep(), dw);
  ctx.reduce_scatter(ctx.ep(), dxw, dx, 1);
}
/// The shared expert on the full-D tokens, hidden dim split over the expert axes: partial
/// outputs reduce-scattered to this rank's D columns and added to y_c.
template <class Ctx>
void ep_tp_shared_forward(Ctx& ctx, typename Ctx::view2 xw, typename Ctx::view2 y_c) {
  using cview2 = typename Ctx::cview2;
  auto ysh = shared_mlp_forward(ctx, cview2(xw), buf::y_shared);  // [T, D]: x_work is this rank's T
  scatter_cols_into(ctx, ysh, buf::y_shared_cols, y_c);
}
template <class Ctx>
void ep_tp_shared_backward(Ctx& ctx, typename Ctx::view2 dyw, typename Ctx::view2 dx) {
  using cview2 = typename Ctx::cview2;
  auto dxsh = shared_mlp_backward(ctx, cview2(dyw), buf::dx_shared);
  scatter_cols_into(ctx, dxsh, buf::dx_shared_cols, dx);
}

}  // namespace stages

/// \brief The EP-TP strategy (see the file comment).
template <class Experts>
struct EpTp {
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t value_bytes) const {
    PlanBuilder b(lay, cfg, par, value_bytes, false);
    StepPlan& p = b.begin();
    p.route_text = "ep-tp: tokens split on D over " + detail::axes_text(lay.ep_axes) +
                   ", all-gathered on D, local experts on their routed rows, outputs "
                   "reduce-scattered on D";
    p.token_gathered[2] = lay.emb_axes;
    Extent const T = b.tokens(), D = b.emb(), Dl = b.token_cols();
    b.gather_weights();
    auto& g = b.stage(StageKind::gather_tokens, "moe::dist::gather_tokens", {buf::x},
                      {b.out(buf::x_work, T, D)});
    b.all_gather(g, "all-gather tokens (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    b.route(buf::x_work);
    Experts::plan_forward(b, buf::x_work);
    auto& c = b.stage(StageKind::combine, "moe::dist::combine", {Experts::rows_out, Buf::routing},
                      {b.out(buf::y_work, T, D), b.out(buf::y_cols, T, Dl)});
    b.reduce_scatter(c, "reduce-scatter y (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    if (b.shared()) {
      auto& st =
          b.stage(StageKind::shared_expert, "moe::dist::shared_expert",
                  {buf::x_work, compute(Weight::shared_wi_0), compute(Weight::shared_wi_1),
                   compute(Weight::shared_wo)},
                  {b.out(buf::y_shared, T, D), b.out(buf::y_shared_cols, T, Dl), buf::y_cols});
      b.reduce_scatter(st, "reduce-scatter y shared (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
      b.hold_shared_mlp(T);
    }
    b.output();
    b.backward = true;
    auto& d = stages::plan_gathered_experts_backward<Experts>(b, "all-gather d_y (ep-tp)", b.Dl, 1);
    b.all_reduce(d, "reduce d_weights (expert)", lay.ep_axes, b.T * b.K);
    b.reduce_scatter(d, "reduce-scatter d_x (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    if (b.shared()) {
      auto& st =
          b.stage(StageKind::shared_expert, "moe::dist::shared_expert::backward",
                  {buf::dy_work, compute(Weight::shared_wi_0), compute(Weight::shared_wi_1),
                   compute(Weight::shared_wo)},
                  {b.out(buf::dx_shared, T, D), b.out(buf::dx_shared_cols, T, Dl), Buf::dx,
                   grad(Weight::shared_wi_0), grad(Weight::shared_wi_1), grad(Weight::shared_wo)});
      b.reduce_scatter(st, "reduce-scatter d_x shared (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
      b.hold_shared_mlp(T);
    }
    // The router's dx for this rank's D columns, from the full-D tokens.
    b.route_backward(buf::x_work);
    b.reduce_grads();
    return b.finish();
  }

  template <class Ctx>
  void forward(Ctx& c, Stage const& st, std::uint64_t weights_version) const {
    switch (st.kind) {
      case StageKind::gather_tokens:  // this rank's D columns -> the full-D tokens
        return c.all_gather(c.ep(), c.ws.at(buf::x), c.ws.make(buf::x_work), 1);
      case StageKind::route:
        return stages::route_tokens(c, c.ws.at(buf::x_work), false);
      case StageKind::dispatch:
        if constexpr (!Experts::dense) return Experts::dispatch(c, c.ws.at(buf::x_work));
        break;
      case StageKind::experts:
        return Experts::experts(c, buf::x_work, weights_version);
      case StageKind::combine:
        return stages::ep_tp_combine(c, Experts::combined(c));
      case StageKind::shared_expert:
        return stages::ep_tp_shared_forward(c, c.ws.at(buf::x_work), c.ws.at(buf::y_cols));
      default:
        break;
    }
    stages::no_stage(st);
  }
  template <class Ctx>
  void backward(Ctx& c, Stage const& st, typename Ctx::cview2 dy, typename Ctx::view2 dx) const {
    switch (st.kind) {
      case StageKind::output:
        return stages::ep_tp_output_backward(c, dy);
      case StageKind::combine:
        if constexpr (!Experts::dense) return Experts::combine_backward(c);
        break;
      case StageKind::experts:
        return Experts::experts_backward(c);
      case StageKind::dispatch:
        return stages::ep_tp_dispatch_backward(c, Experts::work_dx(c), dx);
      case StageKind::shared_expert:
        return stages::ep_tp_shared_backward(c, c.ws.at(buf::dy_work), dx);
      case StageKind::route:
        return stages::ep_tp_route_backward(c, dx);
      default:
        break;
    }
    stages::no_stage(st);
  }
  template <class Ctx>
  std::int64_t routed_rows(Ctx const& c) const {
    return Experts::routed_rows(c);
  }
};

}  // namespace moe::distributed
