#pragma once
/// \file
/// EP-TP strategy of the distributed layer (ExpertRoute::EpTp): the tokens are split on D over
/// the expert axes and gathered to full D; dispatch and experts are the gathered path's
/// (stages/gathered.hpp), partial outputs are reduce-scattered back to this rank's D columns; the
/// shared expert runs on the full-D tokens. Its router backward is in stages/route.hpp.

#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/stages/gathered.hpp>
#include <moe/distributed/stages/shared_expert.hpp>
#include <moe/distributed/step_context.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>

namespace moe::distributed::stages {

// ------------------------------------------------------- strategy: EP-TP ------------------
// The tokens are split on D over the expert axes; x_work holds the full-D tokens, the same on
// every expert rank. Dispatch and experts are the gathered path's (local experts, routed rows
// only); partial outputs are reduce-scattered back to this rank's D columns.

/// Reduce-scatters partial full-D rows over the expert axes to this rank's D columns (the
/// workspace buffer `cols`) and adds them to `into`.
template <class Ctx>
void scatter_cols_into(Ctx& ctx, typename Ctx::view2 full, char const* cols,
                       typename Ctx::view2 into) {
  auto c = ctx.ws.make(cols, ctx.plan.tokens, ctx.plan.token_cols);
  ctx.reduce_scatter(ctx.ep(), full, c, 1);
  moe::detail::add_into(ctx.space, c, into);
}
template <class Ctx>
void ep_tp_combine(Ctx& ctx, typename Ctx::view2 ys) {
  auto yw = combined_tokens(ctx, ys);
  ctx.reduce_scatter(ctx.ep(), yw, ctx.ws.make("y_cols", ctx.plan.tokens, ctx.plan.token_cols), 1);
}
template <class Ctx>
void ep_tp_output_backward(Ctx& ctx, typename Ctx::cview2 dy) {
  ctx.all_gather(ctx.ep(), dy, ctx.ws.make("dy_work", ctx.plan.tokens, ctx.cfg.base_emb_dim), 1);
}
template <class Ctx>
void ep_tp_dispatch_backward(Ctx& ctx, typename Ctx::view2 dx) {
  using view2 = typename Ctx::view2;
  view2 dxw = work_dx(ctx);  // EP-TP: work_tokens == tokens (full-D rows of this rank's batch)
  // Every expert rank holds the same tokens: d_weights (only the local experts' slots) summed,
  // dx (only the local experts' rows) summed and split on D.
  auto dw = ctx.ws.make("d_weights", ctx.plan.tokens, ctx.cfg.num_experts_per_tok);
  Kokkos::deep_copy(ctx.space, dw, ctx.ws.at("d_weights_work"));
  ctx.all_reduce(ctx.ep(), dw);
  ctx.reduce_scatter(ctx.ep(), dxw, dx, 1);
}
/// The shared expert on the full-D tokens, hidden dim split over the expert axes: partial
/// outputs reduce-scattered to this rank's D columns and added to y_c.
template <class Ctx>
void ep_tp_shared_forward(Ctx& ctx, typename Ctx::view2 xw, typename Ctx::view2 y_c) {
  using cview2 = typename Ctx::cview2;
  auto ysh = shared_mlp_forward(ctx, cview2(xw), "y_shared");  // [T, D]: x_work is this rank's T
  scatter_cols_into(ctx, ysh, "y_shared_cols", y_c);
}
template <class Ctx>
void ep_tp_shared_backward(Ctx& ctx, typename Ctx::view2 dyw, typename Ctx::view2 dx) {
  using cview2 = typename Ctx::cview2;
  auto dxsh = shared_mlp_backward(ctx, cview2(dyw), "dx_shared");
  scatter_cols_into(ctx, dxsh, "dx_shared_cols", dx);
}

}  // namespace moe::distributed::stages
