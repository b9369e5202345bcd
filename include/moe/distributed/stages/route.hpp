#pragma once
/// \file
/// Route stage of the distributed layer: the router on the working tokens, global statistics.

#include <moe/detail/blas.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/buffers.hpp>
#include <moe/routing/kernels.hpp>

#include <cstdint>
#include <vector>

namespace moe::distributed {
/// The const-value 2-D view type of a step context.
template <class Ctx>
using cview2_t = typename Ctx::cview2;
}  // namespace moe::distributed

namespace moe::distributed::stages {

/// Global index of the first token of each member of the routed block (ring: the expert group's).
template <class Ctx>
std::vector<std::uint64_t> member_token_offsets(Ctx const& ctx, bool ring) {
  auto const& lay = ctx.layout;
  std::vector<int> const members =
      ring ? lay.mesh.group_members(lay.rank, lay.ep_axes) : std::vector<int>{lay.rank};
  std::vector<std::uint64_t> offsets;
  for (int r : members)
    offsets.push_back(ctx.token_offset +
                      std::uint64_t(lay.mesh.rank_in_group(r, lay.batch_axes) * ctx.plan.tokens));
  return offsets;
}

/// The global load-balance loss and bias update of the last routing (summed over the batch axes).
template <class Ctx>
void route_statistics(Ctx& ctx) {
  ctx.lb_loss = 0;
  if (ctx.cfg.load_balance_loss_weight > 0) {
    View1<double, Kokkos::HostSpace> v("moe::dist::lb_sum", 1);
    v(0) = ctx.router.lb_sum();
    ctx.all_reduce(ctx.batch(), v, Kokkos::DefaultHostExecutionSpace());
    ctx.lb_loss = ctx.router.lb_loss(v(0), ctx.B);
  }
  ctx.bias_update.clear();
  if (ctx.cfg.routed_bias_update_rate > 0) {
    auto counts = ctx.router.expert_counts();
    View1<std::int64_t, Kokkos::HostSpace> h(counts.data(), counts.size());
    ctx.all_reduce(ctx.batch(), h, Kokkos::DefaultHostExecutionSpace());
    ctx.bias_update = routing::bias_update(counts, ctx.B * ctx.S * ctx.cfg.num_experts_per_tok,
                                           ctx.cfg.routed_bias_update_rate);
  }
}

/// Routes the working tokens xw (the own tokens, full D).
template <class Ctx>
void route_tokens(Ctx& ctx, typename Ctx::view2 xw) {
  ctx.router.forward(ctx.space, cview2_t<Ctx>(xw), ctx.cp.gate, ctx.cp.gate_bias, ctx.S,
                     member_token_offsets(ctx, false), 0);
  route_statistics(ctx);
}

/// Routes the expert group's tokens on the ring from their gate logits: the own tokens' logits
/// (x . gate, [T, E]) all-gathered over the expert axes, so that no rank multiplies the gathered
/// tokens by the gate, and the router never reads them (they may be 16-bit: x_work).
template <class Ctx>
void route_from_logits(Ctx& ctx) {
  using Scalar = typename Ctx::scalar_type;
  auto lo = ctx.ws.make(buf::logits_own);
  moe::detail::gemm(ctx.space, "N", "N", Scalar(1), cview2_t<Ctx>(ctx.ws.at(buf::x)), ctx.cp.gate,
                    Scalar(0), lo);
  ctx.all_gather(ctx.ep(), lo, ctx.router.logits_rows(ctx.space, ctx.plan.work_tokens), 0);
  ctx.router.forward_logits(ctx.space, ctx.cp.gate_bias, ctx.S, member_token_offsets(ctx, true),
                            ctx.ep().rank());
  route_statistics(ctx);
}

}  // namespace moe::distributed::stages
