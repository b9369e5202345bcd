#pragma once
/// \file
/// The shared expert (SharedExpert; EP-TP's own), and StageDefaults: the stage functions a
/// strategy may not define.

#include <moe/bf16.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/stages/route.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::distributed::stages {

/// Working tokens -> own tokens in the plan (see tokens_reduce).
inline void plan_tokens_reduce(PlanBuilder const& b, Stage& st, std::string const& what,
                               std::int64_t cols, bool spans) {
  if (spans)
    b.reduce_scatter(st, "reduce-scatter " + what + " (expert)", b.lay.ep_axes, b.T, cols, 0);
  else
    b.all_reduce(st, "reduce " + what + " (expert)", b.lay.ep_axes, b.T * cols);
}
/// The forward stage, as the layout's SharedExpert says (EP-as-TP: through the expert group).
inline void plan_shared_forward(PlanBuilder& b) {
  Extent const Tg = b.shared_tokens(), D = b.emb(), T = b.tokens();
  bool const own = b.lay.shared == SharedExpert::own, spans = b.shared_spans();
  auto const ysh_cols = b.out(buf::y_shared_cols, T, b.emb_cols());
  auto& st = b.shared_stage(
      buf::x, Tg,
      own ? std::vector<Out>{b.out(buf::y_shared, Tg, D), ysh_cols, buf::y_cols}
          : std::vector<Out>{b.out(buf::x_shared, Tg, D), b.out(buf::y_shared, Tg, D),
                             b.out(buf::y_own, T, D, Item::shared), ysh_cols, buf::y_cols});
  if (spans) b.all_gather(st, "all-gather x (shared, expert)", b.lay.ep_axes, b.T, b.D, 0);
  if (!own) plan_tokens_reduce(b, st, "y shared", b.D, spans);
  b.reduce_scatter(st, "reduce-scatter y shared (tensor)", b.lay.tp_axes, b.T, b.Dc, 1);
}
inline void plan_shared_backward(PlanBuilder& b) {
  Extent const Tg = b.shared_tokens(), D = b.emb();
  bool const own = b.lay.shared == SharedExpert::own, spans = b.shared_spans();
  // The caller's dy: on a bf16 layer the shared expert's own tokens read a rounded copy of it.
  std::vector<Out> writes;
  if (!own || b.cfg.bf16()) writes.push_back(b.out(buf::dy_shared, Tg, D));
  writes.push_back(b.out(buf::dx_shared, Tg, D));
  if (!own) writes.push_back(buf::y_own);
  writes.push_back(Buf::dx);
  auto& st = b.shared_stage(Buf::dy, Tg, std::move(writes));
  if (spans) b.all_gather(st, "all-gather d_y (shared, expert)", b.lay.ep_axes, b.T, b.D, 0);
  b.all_reduce(st, "reduce d_x shared (tensor)", b.lay.tp_axes, b.T * (spans ? b.ep : 1) * b.D);
  if (!own) plan_tokens_reduce(b, st, "d_x shared", b.D, spans);
}

/// The shared MLP on the tokens x (full D) into the zeroed workspace buffer `name` [rows, D].
template <class Ctx>
typename Ctx::view2 shared_mlp_forward(Ctx& ctx, typename Ctx::cview2 x, Handle<Values> name) {
  auto y = ctx.ws.make(name, std::int64_t(x.extent(0)));
  Kokkos::deep_copy(ctx.space, y, typename Ctx::scalar_type(0));
  ctx.shared.forward(ctx.space, ctx.cfg.mlp_activation, x, ctx.cp.shared_wi_0, ctx.cp.shared_wi_1,
                     ctx.cp.shared_wo, y);
  return y;
}
/// Its transpose: dx into the zeroed buffer `name`, the weight gradients into ctx.gc.
template <class Ctx>
typename Ctx::view2 shared_mlp_backward(Ctx& ctx, typename Ctx::cview2 dy, Handle<Values> name) {
  auto dx = ctx.ws.make(name, std::int64_t(dy.extent(0)));
  Kokkos::deep_copy(ctx.space, dx, typename Ctx::scalar_type(0));
  ctx.shared.backward(ctx.space, dy, ctx.cp.shared_wi_0, ctx.cp.shared_wi_1, ctx.cp.shared_wo, dx,
                      ctx.gc.shared_wi_0, ctx.gc.shared_wi_1, ctx.gc.shared_wo);
  return dx;
}

/// Own tokens -> working tokens (values, or 16-bit rows): all-gathered over the expert group
/// (`spans`), else copied. On a bf16 layer rounded to bf16 either way (the bf16 wire rounds
/// what it moves, the copy as it copies): where the stages take the caller's dy, this first
/// copy of it is where MaxText's bf16 cotangent is rounded (docs/precision.md).
template <class Ctx, class Work>
void tokens_gather(Ctx& ctx, bool spans, typename Ctx::cview2 own, Work const& work) {
  if (spans && ctx.ep().size() > 1)
    ctx.all_gather(ctx.ep(), own, work, 0);
  else
    moe::detail::copy_into(ctx.space, own, work, ctx.cfg.bf16());
}
/// Rows `v` rounded to bf16 in place on a bf16 layer where they are float (16-bit rows are).
template <class Ctx, class V>
void round_if_wide(Ctx& ctx, V const& v) {
  if constexpr (!moe::detail::is_bf16<typename V::value_type>)
    moe::detail::round_bf16_if(ctx.cfg.bf16(), ctx.space, v);
}
/// Working tokens -> own tokens: reduce-scattered over the expert group (`spans`; `work` may be
/// 16-bit rows there, which its bf16 wire moves as they are), else summed.
template <class Ctx, class Work>
void tokens_reduce(Ctx& ctx, bool spans, Work const& work, typename Ctx::view2 own) {
  if (spans) {
    ctx.reduce_scatter(ctx.ep(), work, own, 0);
  } else if constexpr (std::is_same<typename Work::non_const_value_type, moe::bf16>::value) {
    throw Error("moe internal error: 16-bit working rows summed by an all-reduce");
  } else {
    ctx.all_reduce(ctx.ep(), work);
    Kokkos::deep_copy(ctx.space, own, work);
  }
}

/// Partial full-D rows reduce-scattered over `g` into the D columns `cols`, added to `into`.
template <class Ctx, class Group>
void scatter_cols_into(Ctx& ctx, Group const& g, typename Ctx::view2 full, Handle<Values> cols,
                       typename Ctx::view2 into) {
  auto c = ctx.ws.make(cols);
  ctx.reduce_scatter(g, full, c, 1);
  moe::detail::add_into(ctx.space, c, into);
}
/// Own tokens `x` -> the shared expert's: `x` (SharedExpert::own), else gathered into `work`;
/// `work` is also a rounded copy of `x` where the plan declares it so (the caller's dy on a bf16
/// layer with SharedExpert::own: plan_shared_backward).
template <class Ctx>
typename Ctx::cview2 shared_in(Ctx& ctx, typename Ctx::cview2 x, Handle<Values> work) {
  if (ctx.layout.shared == SharedExpert::own && !ctx.plan.find(work.id)) return x;
  auto w = ctx.ws.make(work);
  tokens_gather(ctx, ctx.plan.shared_spans(), x, w);
  return w;
}
/// The shared expert's rows `y` -> own tokens: `y` (SharedExpert::own), else reduced into y_own.
template <class Ctx>
typename Ctx::view2 shared_out(Ctx& ctx, typename Ctx::view2 y) {
  if (ctx.layout.shared == SharedExpert::own) return y;
  auto yo = ctx.ws.make(buf::y_own);
  tokens_reduce(ctx, ctx.plan.shared_spans(), y, yo);
  return yo;
}

}  // namespace moe::distributed::stages

namespace moe::distributed {

/// \brief The stage functions a strategy (deriving from it) does not define itself.
struct StageDefaults {
  /// Kinds the strategy never plans: an internal error naming the stage.
  struct NoStage {
    template <class Ctx, class... Args>
    void operator()(Ctx& c, Args&&...) const {
      stages::no_stage(*c.stage);
    }
  };
  static constexpr NoStage gather_tokens{}, dispatch{}, combine_backward{};

  /// The shared expert added into the D/tp columns y_cols (own tokens, or EP-as-TP the group's).
  template <class Ctx>
  static void shared_forward(Ctx& ctx) {
    auto const x = ctx.ws.at(buf::x), y_c = ctx.ws.at(buf::y_cols);
    auto const xs = stages::shared_in(ctx, cview2_t<Ctx>(x), buf::x_shared);
    auto const ysh = stages::shared_out(ctx, stages::shared_mlp_forward(ctx, xs, buf::y_shared));
    stages::scatter_cols_into(ctx, ctx.tp(), ysh, buf::y_shared_cols, y_c);
  }
  /// The transpose of shared_forward: dx += the shared expert's input gradient.
  template <class Ctx>
  static void shared_backward(Ctx& ctx, typename Ctx::cview2 dy, typename Ctx::view2 dx) {
    auto dxsh = stages::shared_mlp_backward(ctx, stages::shared_in(ctx, dy, buf::dy_shared),
                                            buf::dx_shared);
    ctx.all_reduce(ctx.tp(), dxsh);
    moe::detail::add_into(ctx.space, stages::shared_out(ctx, dxsh), dx);
  }
  /// The router's backward on this rank's tokens: dx += d_logits gate^T, d_gate, d_gate_bias.
  template <class Ctx>
  static void route_backward(Ctx& ctx, typename Ctx::view2 dx) {
    ctx.router.backward(ctx.space, cview2_t<Ctx>(ctx.ws.at(buf::x)), ctx.cp.gate,
                        cview2_t<Ctx>(ctx.ws.at(buf::d_weights)), ctx.router.lb_coefficient(ctx.B),
                        dx, ctx.gc.gate, ctx.gc.gate_bias);
  }
};

}  // namespace moe::distributed
