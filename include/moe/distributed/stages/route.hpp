#pragma once
/// \file
/// Route stage of the distributed layer: the router on the working tokens, global statistics.

#include <moe/detail/views.hpp>
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

/// Routes the working tokens xw (own, or the expert group's on the ring).
template <class Ctx>
void route_tokens(Ctx& ctx, typename Ctx::view2 xw, bool ring) {
  ctx.router.forward(ctx.space, cview2_t<Ctx>(xw), ctx.cp.gate, ctx.cp.gate_bias, ctx.S,
                     member_token_offsets(ctx, ring), ring ? ctx.ep().rank() : 0);
  route_statistics(ctx);
}

}  // namespace moe::distributed::stages
