#pragma once
/// \file
/// The shared expert of every strategy but EP-TP (whose own is in strategy/ep_tp.hpp): EP-as-TP,
/// the shared expert on the expert group's tokens (all-gathered when the tokens are split over
/// the expert axes) with its hidden dim split over tensor x expert; its stages and their
/// functions, and the transposes. The MLP itself (shared_mlp_forward / backward) is shared with
/// EP-TP.

#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/step_plan.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace moe::distributed::stages {

// ---------------------------------------------------------------------------- plan
/// Its partial outputs go back to their tokens' owners: reduce-scatter when the group's tokens
/// were gathered (`spans`), else a sum over the expert group.
inline void plan_shared_reduce(PlanBuilder const& b, Stage& st, std::string const& what,
                               bool spans) {
  if (spans)
    b.reduce_scatter(st, "reduce-scatter " + what + " (expert)", b.lay.ep_axes, b.T * b.D);
  else
    b.all_reduce(st, "reduce " + what + " (expert)", b.lay.ep_axes, b.T * b.D);
}
/// The forward stage; `spans`: the tokens are split over the expert axes (and gathered here).
inline void plan_shared_forward(PlanBuilder const& b, std::vector<Stage>& f, bool spans) {
  auto& st = b.stage(f, StageKind::shared_expert, "moe::dist::shared_expert",
                     {"x", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
                     {"x_shared", "y_shared", "y_own", "y_shared_cols", "y_cols"});
  if (spans) b.all_gather(st, "all-gather x (shared, expert)", b.lay.ep_axes, b.T * b.D);
  plan_shared_reduce(b, st, "y shared", spans);
  b.reduce_scatter(st, "reduce-scatter y shared (tensor)", b.lay.tp_axes, b.T * b.Dc);
}
inline void plan_shared_backward(PlanBuilder const& b, std::vector<Stage>& bw, bool spans) {
  auto& st = b.stage(
      bw, StageKind::shared_expert, "moe::dist::shared_expert::backward",
      {"dy", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
      {"dy_shared", "dx_shared", "y_own", "dx", "d.shared_wi_0", "d.shared_wi_1", "d.shared_wo"});
  if (spans) b.all_gather(st, "all-gather d_y (shared, expert)", b.lay.ep_axes, b.T * b.D);
  b.all_reduce(st, "reduce d_x shared (tensor)", b.lay.tp_axes, b.T * (spans ? b.ep : 1) * b.D);
  plan_shared_reduce(b, st, "d_x shared", spans);
}

// ---------------------------------------------------------------------------- run

/// The shared MLP on the tokens x (full D) into the zeroed workspace buffer `name` [rows, D].
template <class Ctx>
typename Ctx::view2 shared_mlp_forward(Ctx& ctx, typename Ctx::cview2 x, char const* name) {
  using Scalar = typename Ctx::scalar_type;
  auto y = ctx.ws.make(name, std::int64_t(x.extent(0)), ctx.cfg.base_emb_dim);
  Kokkos::deep_copy(ctx.space, y, Scalar(0));
  ctx.shared.forward(ctx.space, ctx.cfg.mlp_activation, x, ctx.cp.shared_wi_0, ctx.cp.shared_wi_1,
                     ctx.cp.shared_wo, y);
  return y;
}
/// Its transpose: the input gradient for dy into the zeroed buffer `name`; the weight gradients
/// into the compute-block gradients.
template <class Ctx>
typename Ctx::view2 shared_mlp_backward(Ctx& ctx, typename Ctx::cview2 dy, char const* name) {
  using Scalar = typename Ctx::scalar_type;
  auto dx = ctx.ws.make(name, std::int64_t(dy.extent(0)), ctx.cfg.base_emb_dim);
  Kokkos::deep_copy(ctx.space, dx, Scalar(0));
  ctx.shared.backward(ctx.space, dy, ctx.cp.shared_wi_0, ctx.cp.shared_wi_1, ctx.cp.shared_wo, dx,
                      ctx.gc.shared_wi_0, ctx.gc.shared_wi_1, ctx.gc.shared_wo);
  return dx;
}

template <class Ctx>
bool shared_spans_group(Ctx const& ctx) {
  return ctx.plan.shared_tokens > ctx.plan.tokens;
}
template <class Ctx>
void shared_tokens_gather(Ctx& ctx, typename Ctx::cview2 own, typename Ctx::view2 work) {
  if (shared_spans_group(ctx))
    ctx.all_gather(ctx.ep(), own, work, 0);
  else
    Kokkos::deep_copy(ctx.space, work, own);
}
template <class Ctx>
void shared_tokens_reduce(Ctx& ctx, typename Ctx::view2 work, typename Ctx::view2 own) {
  if (shared_spans_group(ctx)) {
    ctx.reduce_scatter(ctx.ep(), work, own, 0);
  } else {
    ctx.all_reduce(ctx.ep(), work);
    Kokkos::deep_copy(ctx.space, own, work);
  }
}

/// EP-as-TP: the shared expert runs on the expert group's tokens with its hidden dim split over
/// tensor x expert; partial outputs go back to their tokens' owners, then to the D/tp columns
/// of y_c (added).
template <class Ctx>
void shared_forward(Ctx& ctx, typename Ctx::view2 x, typename Ctx::view2 y_c) {
  using cview2 = typename Ctx::cview2;
  std::int64_t const D = ctx.cfg.base_emb_dim, Tg = ctx.plan.shared_tokens;
  auto xsh = ctx.ws.make("x_shared", Tg, D);
  shared_tokens_gather(ctx, cview2(x), xsh);
  auto ysh = shared_mlp_forward(ctx, cview2(xsh), "y_shared");
  auto yo = ctx.ws.make("y_own", ctx.plan.tokens, D);
  shared_tokens_reduce(ctx, ysh, yo);
  auto ysh_c = ctx.ws.make("y_shared_cols", ctx.plan.tokens, D / ctx.tp().size());
  ctx.reduce_scatter(ctx.tp(), yo, ysh_c, 1);
  moe::detail::add_into(ctx.space, ysh_c, y_c);
}
/// The transpose of shared_forward: dx += the shared expert's input gradient.
template <class Ctx>
void shared_backward(Ctx& ctx, typename Ctx::cview2 dy, typename Ctx::view2 dx) {
  using cview2 = typename Ctx::cview2;
  std::int64_t const D = ctx.cfg.base_emb_dim, Tg = ctx.plan.shared_tokens;
  auto dysh = ctx.ws.make("dy_shared", Tg, D);
  shared_tokens_gather(ctx, dy, dysh);
  auto dxsh = shared_mlp_backward(ctx, cview2(dysh), "dx_shared");
  ctx.all_reduce(ctx.tp(), dxsh);
  auto yo = ctx.ws.make("y_own", ctx.plan.tokens, D);
  shared_tokens_reduce(ctx, dxsh, yo);
  moe::detail::add_into(ctx.space, yo, dx);
}

}  // namespace moe::distributed::stages
