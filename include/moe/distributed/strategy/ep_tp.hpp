#pragma once
/// \file
/// The EP-TP strategy (ExpertRoute::EpTp): tokens split on D over the expert axes are gathered to
/// full D, run through the local experts, and the partial outputs reduce-scattered back on D.

#include <moe/detail/views.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/strategy/gathered.hpp>

#include <cstdint>

namespace moe::distributed {

/// \brief The EP-TP strategy (see the file comment).
template <class Experts>
struct EpTp : OnWorkTokens<Experts, Buf::x_work, false> {
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t value_bytes) const {
    PlanBuilder b(lay, cfg, par, value_bytes, false);
    StepPlan& p = b.begin();
    p.route_text = "ep-tp: tokens split on D over " + detail::axes_text(lay.ep_axes) +
                   ", all-gathered on D, local experts on their routed rows, outputs "
                   "reduce-scattered on D";
    p.token_gathered[2] = lay.emb_axes;
    Extent const T = b.tokens(), D = b.emb(), Dl = b.token_cols();
    // The shared expert on the full-D tokens `x`, its outputs reduce-scattered on D into `into`.
    auto shared = [&](Ref x, Handle<Values> y, Handle<Values> cols, Out into, char const* what) {
      if (!b.shared()) return;
      auto& st = b.shared_stage(x, T, {b.out(y, T, D), b.out(cols, T, Dl), std::move(into)});
      b.reduce_scatter(st, moe::detail::cat("reduce-scatter ", what, " shared (ep-tp)"),
                       lay.ep_axes, b.T, b.Dl, 1);
    };
    auto& g = b.stage(StageKind::gather_tokens, "moe::dist::gather_tokens", {buf::x},
                      {b.out(buf::x_work, T, D, {}, false)});  // read as values
    b.all_gather(g, "all-gather tokens (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    b.route(buf::x_work);
    Experts::plan_forward(b, buf::x_work);
    auto& c = b.stage(StageKind::combine, "moe::dist::combine", {Experts::rows_out, Buf::routing},
                      {b.out(buf::y_work, T, D, {}, !Experts::dense), b.out(buf::y_cols, T, Dl)});
    b.reduce_scatter(c, "reduce-scatter y (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    shared(buf::x_work, buf::y_shared, buf::y_shared_cols, buf::y_cols, "y");
    b.output();
    // dy_work read as values (the shared expert); dx_work only reduce-scattered on the bf16 wire
    // (the dense path's GEMMs write it as values).
    auto& d = stages::plan_gathered_experts_backward<Experts>(b, "all-gather d_y (ep-tp)", b.Dl, 1,
                                                              false, !Experts::dense);
    b.all_reduce(d, "reduce d_weights (expert)", lay.ep_axes, b.T * b.K);
    b.reduce_scatter(d, "reduce-scatter d_x (ep-tp)", lay.ep_axes, b.T, b.Dl, 1);
    shared(buf::dy_work, buf::dx_shared, buf::dx_shared_cols, Buf::dx, "d_x");
    return b.finish(buf::x_work);
  }

  /// Partial outputs reduce-scattered back to this rank's D columns.
  template <class Ctx>
  static void combine(Ctx& c) {
    auto const yc = c.ws.make(buf::y_cols);
    Experts::combined(c).visit([&](auto const& yw) { c.reduce_scatter(c.ep(), yw, yc, 1); });
  }
  /// The shared expert on the full-D tokens, its partial outputs added to y_cols.
  template <class Ctx>
  static void shared_forward(Ctx& c) {
    auto ysh =
        stages::shared_mlp_forward(c, cview2_t<Ctx>(c.ws.values(buf::x_work)), buf::y_shared);
    stages::scatter_cols_into(c, c.ep(), ysh, buf::y_shared_cols, c.ws.at(buf::y_cols));
  }
  template <class Ctx>
  static void output_backward(Ctx& c, typename Ctx::cview2 dy) {
    // EP-TP has ep > 1 (compute_layout): on a bf16 layer the wire rounds dy as it gathers it.
    c.all_gather(c.ep(), dy, c.ws.make(buf::dy_work).values(), 1);
  }
  template <class Ctx>
  static void dispatch_backward(Ctx& c, typename Ctx::view2 dx) {
    auto const dxw = Experts::work_dx(c);
    // Every expert rank holds the same tokens: d_weights summed, dx summed and split on D.
    auto dw = c.ws.make(buf::d_weights);
    Kokkos::deep_copy(c.space, dw, c.ws.at(buf::d_weights_work));
    c.all_reduce(c.ep(), dw);
    dxw.visit([&](auto const& v) { c.reduce_scatter(c.ep(), v, dx, 1); });
  }
  template <class Ctx>
  static void shared_backward(Ctx& c, typename Ctx::cview2 /*dy*/, typename Ctx::view2 dx) {
    auto dxsh =
        stages::shared_mlp_backward(c, cview2_t<Ctx>(c.ws.values(buf::dy_work)), buf::dx_shared);
    stages::scatter_cols_into(c, c.ep(), dxsh, buf::dx_shared_cols, dx);
  }
  /// The router's backward on the full-D tokens: dx for this rank's D columns, d_gate whole.
  template <class Ctx>
  static void route_backward(Ctx& c, typename Ctx::view2 dx) {
    std::int64_t const E = c.cfg.num_experts, Dl = c.plan.token_cols;
    cview2_t<Ctx> gate_rows(c.cp.gate.data() + c.x_col0 * E, Dl, E);
    c.router.backward(c.space, cview2_t<Ctx>(c.ws.values(buf::x_work)), gate_rows,
                      cview2_t<Ctx>(c.ws.at(buf::d_weights)), c.router.lb_coefficient(c.B), dx,
                      c.gc.gate, c.gc.gate_bias);
  }
};

}  // namespace moe::distributed
