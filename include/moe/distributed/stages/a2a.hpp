#pragma once
/// \file
/// Ragged all-to-all strategy of the distributed layer (ExpertRoute::RaggedA2A): its dispatch,
/// experts and combine stages and their transposes.

#include <moe/comm/collectives.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/step_context.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace moe::distributed::stages {

// Rows travel to the ranks of their experts (dispatch), are regrouped by local expert, run
// through the grouped GEMMs, and travel back (combine) as D/tp column blocks.
template <class Ctx>
void a2a_dispatch(Ctx& ctx, typename Ctx::view2 x) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  int const D = ctx.cfg.base_emb_dim, E = ctx.cfg.num_experts, K = ctx.cfg.num_experts_per_tok;
  int const ep = ctx.ep().size();
  std::int64_t const L = ctx.layout.local_experts;
  auto& perm = ctx.disp.perm;
  permute::sort_by_expert(ctx.space, ctx.expert_ids(), ctx.kept(), E, perm);
  auto xs_o = ctx.ws.make("x_sorted", perm.rows(), D);
  permute::gather_rows(ctx.space, cview2(x), ivec(perm.perm), K, xs_o);
  auto const& off = perm.groups.offsets_host;
  std::vector<std::int64_t> sizes(E), send(ep);
  for (int e = 0; e < E; ++e) sizes[e] = off(e + 1) - off(e);
  for (int j = 0; j < ep; ++j) send[j] = off((j + 1) * L) - off(j * L);
  std::int64_t const R =
      ctx.par.ragged_buffer_factor > 0
          ? comm::ragged_buffer_size(ctx.plan.tokens * K, ep, E, K, ctx.par.ragged_buffer_factor)
          : -1;
  ctx.disp.a2a = std::make_unique<comm::RaggedAllToAll>(ctx.ep().comm, send, R);
  ctx.log_all_to_all(false, D);
  auto xr = ctx.ws.make("x_received", ctx.disp.a2a->recv_total(), D);
  ctx.disp.a2a->forward(ctx.space, xs_o, xr);
  // Everyone's group sizes -> the local regrouping of received rows by local expert.
  View1<std::int64_t, Kokkos::HostSpace> mine("moe::dist::sizes", E),
      all("moe::dist::all_sizes", E * ep);
  std::copy(sizes.begin(), sizes.end(), mine.data());
  comm::all_gather(ctx.ep().comm, Kokkos::DefaultHostExecutionSpace(), mine, all);
  std::vector<std::int64_t> G(all.data(), all.data() + E * ep);
  permute::make_local_permutation(ctx.space, permute::local_layout(G, E, ep, ctx.ep().rank(), R),
                                  ctx.disp.lp);
  auto xs = ctx.ws.make("x_local", ctx.disp.lp.rows(), D);
  permute::permute_rows(ctx.space, ctx.disp.lp, xr, xs);
  ctx.disp.groups.offsets = ctx.disp.lp.group_offsets;
  ctx.disp.groups.offsets_host = ctx.disp.lp.group_offsets_host;
}
template <class Ctx>
void a2a_experts(Ctx& ctx, typename Ctx::view2 xs, std::uint64_t weights_version) {
  std::int64_t const D = ctx.cfg.base_emb_dim, n = xs.extent(0);
  auto ys = ctx.ws.make("y_local", n, D);
  ctx.ffn.forward(ctx.space, ctx.cfg.mlp_activation, xs, ctx.disp.groups, ctx.cp.wi_0, ctx.cp.wi_1,
                  ctx.cp.wo, ys, weights_version);
  // Partial down-projections (tensor-split hidden dim) -> column blocks of D.
  auto ys_c = ctx.ws.make("y_local_cols", n, D / ctx.tp().size());
  ctx.reduce_scatter(ctx.tp(), ys, ys_c, 1);
}
template <class Ctx>
void a2a_combine(Ctx& ctx, typename Ctx::view2 ys_c) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  std::int64_t const Dc = ys_c.extent(1);
  auto yr_c = ctx.ws.make("y_received_cols", ctx.disp.a2a->recv_total(), Dc);
  permute::unpermute_rows(ctx.space, ctx.disp.lp, ys_c, yr_c);
  auto ys_o_c = ctx.ws.make("y_sorted_cols", ctx.disp.perm.rows(), Dc);
  ctx.log_all_to_all(true, Dc);
  ctx.disp.a2a->reverse(ctx.space, yr_c, ys_o_c);
  auto y_c = ctx.ws.make("y_cols", ctx.plan.tokens, Dc);
  permute::combine(ctx.space, cview2(ys_o_c), ivec(ctx.disp.perm.inverse), ctx.route_weights(),
                   false, y_c);
}
template <class Ctx>
void a2a_output_backward(Ctx& ctx, typename Ctx::cview2 dy) {
  int const tp = ctx.tp().size();
  auto dy_c = ctx.ws.make("dy_cols", ctx.plan.tokens, ctx.cfg.base_emb_dim / tp);
  distributed::slice_dim(ctx.space, tp, ctx.tp().rank(), dy, dy_c, 1);
}
template <class Ctx>
void a2a_combine_backward(Ctx& ctx, typename Ctx::view2 dy_c) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  std::int64_t const Dc = dy_c.extent(1);
  auto dys_o_c = ctx.ws.make("dy_sorted_cols", ctx.disp.perm.rows(), Dc);
  auto dw = ctx.ws.make("d_weights", ctx.plan.tokens, ctx.cfg.num_experts_per_tok);
  permute::combine_backward(ctx.space, cview2(dy_c), cview2(ctx.ws.at("y_sorted_cols")),
                            ivec(ctx.disp.perm.perm), ivec(ctx.disp.perm.inverse),
                            ctx.route_weights(), dys_o_c, dw);
  ctx.all_reduce(ctx.tp(), dw);
  auto dyr_c = ctx.ws.make("dy_received_cols", ctx.disp.a2a->recv_total(), Dc);
  ctx.log_all_to_all(false, Dc);
  ctx.disp.a2a->forward(ctx.space, dys_o_c, dyr_c);
  auto dys_c = ctx.ws.make("dy_local_cols", ctx.disp.lp.rows(), Dc);
  permute::permute_rows(ctx.space, ctx.disp.lp, dyr_c, dys_c);
}
template <class Ctx>
void a2a_experts_backward(Ctx& ctx, typename Ctx::view2 dys_c) {
  auto dys = ctx.ws.make("dy_local", dys_c.extent(0), ctx.cfg.base_emb_dim);
  ctx.all_gather(ctx.tp(), dys_c, dys, 1);
  // dxs (partial over the tensor-split hidden dim) overwrites dys, then its column block dys_c.
  ctx.ffn.backward(ctx.space, dys, ctx.disp.groups, ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, dys,
                   ctx.gc.wi_0, ctx.gc.wi_1, ctx.gc.wo);
  ctx.reduce_scatter(ctx.tp(), dys, dys_c, 1);
}
template <class Ctx>
void a2a_dispatch_backward(Ctx& ctx, typename Ctx::view2 dxs_c, typename Ctx::view2 dx) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  auto dxr_c = ctx.ws.at("dy_received_cols");
  permute::unpermute_rows(ctx.space, ctx.disp.lp, dxs_c, dxr_c);
  auto dxs_o_c = ctx.ws.at("dy_sorted_cols");
  ctx.log_all_to_all(true, dxs_c.extent(1));
  ctx.disp.a2a->reverse(ctx.space, dxr_c, dxs_o_c);
  auto dx_c = ctx.ws.at("dy_cols");
  permute::gather_rows_backward(ctx.space, cview2(dxs_o_c), ivec(ctx.disp.perm.inverse),
                                ctx.cfg.num_experts_per_tok, false, dx_c);
  ctx.all_gather(ctx.tp(), dx_c, dx, 1);
}

}  // namespace moe::distributed::stages
