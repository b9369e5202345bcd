#pragma once
/// \file
/// Gathered-tokens strategies of the distributed layer (ExpertRoute::Ring, Replicated, Local,
/// and the dispatch and experts of EpTp): each rank runs its local experts on the working tokens
/// (sorted rows through the grouped GEMMs, the chunked ring's overlapped all-gathers, or the
/// dense masked path); partial outputs are summed back onto their owners; and the transposes.

#include <moe/comm/iall_gather.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/step_context.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>
#include <string>
#include <utility>

namespace moe::distributed::stages {

// ------------------------------------ strategy: gathered tokens (ring, replicated, local) --
// Each rank runs its local experts [e0, e0+L) on the working tokens; partial outputs (only
// local experts, tensor-split hidden dim) are summed back onto their owners.

/// The working tokens' slots on local experts, sorted by local expert (ctx.disp.perm).
template <class Ctx>
void local_sort(Ctx& ctx) {
  using memory_space = typename Ctx::memory_space;
  std::int64_t const Tw = ctx.plan.work_tokens;
  int const K = ctx.cfg.num_experts_per_tok;
  // Local expert ids (global id - e0) and the kept mask restricted to local experts.
  auto lids = ctx.ws.template make<int>("local_ids", Tw, K);
  auto lkept = ctx.ws.template make<int>("local_kept", Tw, K);
  permute::local_expert_ids(ctx.space, ctx.expert_ids(), ctx.kept(), int(ctx.layout.first_expert),
                            int(ctx.layout.local_experts), lids, lkept);
  permute::sort_by_expert(ctx.space, View2<int const, memory_space>(lids),
                          View2<int const, memory_space>(lkept), ctx.layout.local_experts,
                          ctx.disp.perm);
}
template <class Ctx>
void local_dispatch(Ctx& ctx, typename Ctx::view2 xw) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  local_sort(ctx);
  auto xs = ctx.ws.make("x_local", ctx.disp.perm.rows(), ctx.cfg.base_emb_dim);
  permute::gather_rows(ctx.space, cview2(xw), ivec(ctx.disp.perm.perm), ctx.cfg.num_experts_per_tok,
                       xs);
}
template <class Ctx>
void local_experts(Ctx& ctx, typename Ctx::view2 xs, std::uint64_t weights_version) {
  auto ys = ctx.ws.make("y_local", xs.extent(0), ctx.cfg.base_emb_dim);
  ctx.ffn.forward(ctx.space, ctx.cfg.mlp_activation, xs, ctx.disp.perm.groups, ctx.cp.wi_0,
                  ctx.cp.wi_1, ctx.cp.wo, ys, weights_version);
}
template <class Ctx>
using chunk_pieces = comm::AllGatherPieces<typename Ctx::scalar_type, typename Ctx::memory_space,
                                           typename Ctx::memory_space>;
/// D-chunk c of the own tokens (chunk-major `own`) and its rows of the gathered `got`.
template <class Ctx>
std::pair<typename Ctx::view2, typename Ctx::view2> chunk_views(Ctx const& ctx,
                                                                typename Ctx::view2 own,
                                                                typename Ctx::view2 got,
                                                                std::int64_t c) {
  using view2 = typename Ctx::view2;
  std::int64_t const T = ctx.plan.tokens, Tw = ctx.plan.work_tokens, Dc = own.extent(1);
  return {view2(own.data() + c * T * Dc, T, Dc), view2(got.data() + c * Tw * Dc, Tw, Dc)};
}
/// Starts the all-gather of D-chunk c of the own tokens into its rows of `got`.
template <class Ctx>
auto start_chunk_gather(Ctx& ctx, chunk_pieces<Ctx> const& pieces, typename Ctx::view2 own,
                        typename Ctx::view2 got, std::int64_t c) {
  std::string const what = ctx.planned("all-gather", ctx.ep().axes);
  auto const v = chunk_views(ctx, own, got, c);
  return distributed::start_gather_rows(ctx.space, ctx.ep(), pieces, v.first, v.second, &ctx.log,
                                        what);
}
/// Chunked ring (num_moe_emb_chunks = nc): the expert group's tokens arrive in nc chunks of
/// Dc = D/nc columns, each by a non-blocking all-gather started before the first grouped GEMMs
/// of the previous chunk run (one GEMM piece per local expert, MPI progressed between pieces),
/// so the transfer of chunk c+1 overlaps the GEMMs of chunk c. Each chunk's sorted rows go to
/// the GEMMs and into their columns of x_local (kept for the backward).
template <class Ctx>
void chunked_ring_experts(Ctx& ctx, typename Ctx::view2 x, std::uint64_t weights_version) {
  using view2 = typename Ctx::view2;
  using view3 = typename Ctx::view3;
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  std::int64_t const D = ctx.cfg.base_emb_dim, T = ctx.plan.tokens, Tw = ctx.plan.work_tokens;
  std::int64_t const nc = ctx.plan.emb_chunks, Dc = D / nc, n = ctx.disp.perm.rows();
  std::int64_t const L = ctx.layout.local_experts, F = ctx.cp.wi_0.extent(2);
  int const K = ctx.cfg.num_experts_per_tok;
  // Own tokens chunk-major: rows [c*T, (c+1)*T) are columns [c*Dc, (c+1)*Dc) of x.
  auto own = ctx.ws.make("x_chunks_own", nc * T, Dc);
  distributed::detail::copy_rows(ctx.space, "moe::dist::chunk_pack", x.data(), own.data(), T * nc,
                                 Dc, distributed::detail::Identity{},
                                 distributed::detail::PaToAp{T, nc});
  auto got = ctx.ws.make("x_chunks", nc * Tw, Dc);
  auto xs = ctx.ws.make("x_local", n, D);
  auto xs_c = ctx.ws.make("x_local_chunk", n, Dc);
  auto rows = [](view2 const& v, std::int64_t r0, std::int64_t r) {
    return view2(v.data() + r0 * std::int64_t(v.extent(1)), r, v.extent(1));
  };
  // The chunks' shapes are agreed on once (one collective check, not one per chunk).
  auto const first = chunk_views(ctx, own, got, 0);
  chunk_pieces<Ctx> const pieces(ctx.ep().comm, ctx.space, first.first, first.second);
  using request = decltype(start_chunk_gather(ctx, pieces, own, got, 0));
  request next = start_chunk_gather(ctx, pieces, own, got, 0);
  ctx.ffn.forward_begin(ctx.space, ctx.cfg.mlp_activation, xs, F, weights_version);
  for (std::int64_t c = 0; c < nc; ++c) {
    request cur = std::move(next);
    cur.wait(ctx.space);
    if (c + 1 < nc) next = start_chunk_gather(ctx, pieces, own, got, c + 1);
    permute::gather_rows(ctx.space, cview2(rows(got, c * Tw, Tw)), ivec(ctx.disp.perm.perm), K,
                         xs_c);
    distributed::detail::copy_rows(ctx.space, "moe::dist::chunk_unpack", xs_c.data(), xs.data(), n,
                                   Dc, distributed::detail::Identity{},
                                   distributed::detail::Block{nc, c});
    // Rows [c*Dc, (c+1)*Dc) of expert l's [D, F] weights: a contiguous [1, Dc, F] block.
    for (std::int64_t l = 0; l < L; ++l) {
      std::int64_t const at = (l * D + c * Dc) * F;
      ctx.ffn.forward_chunk(ctx.space, xs_c, ctx.disp.perm.groups,
                            view3(ctx.cp.wi_0.data() + at, 1, Dc, F),
                            view3(ctx.cp.wi_1.data() + at, 1, Dc, F), int(l));
      if (c + 1 < nc) next.test();
    }
  }
  auto ys = ctx.ws.make("y_local", n, D);
  ctx.ffn.forward_end(ctx.space, ctx.disp.perm.groups, ctx.cp.wo, ys);
}
template <class Ctx>
void dense_experts(Ctx& ctx, typename Ctx::view2 xw) {
  using cview2 = typename Ctx::cview2;
  auto yw = ctx.ws.make("y_work", xw.extent(0), ctx.cfg.base_emb_dim);
  ctx.dense.forward(ctx.space, ctx.cfg.mlp_activation, cview2(xw), ctx.expert_ids(), ctx.kept(),
                    ctx.route_weights(), int(ctx.layout.first_expert), ctx.cp.wi_0, ctx.cp.wi_1,
                    ctx.cp.wo, yw);
}

/// Working tokens -> own tokens: reduce-scatter (ring) or all-reduce (replicated) over the
/// expert group; a copy without expert parallelism.
template <class Ctx>
void tokens_reduce(Ctx& ctx, typename Ctx::view2 work, typename Ctx::view2 own) {
  if (ctx.layout.route == ExpertRoute::Ring) {
    ctx.reduce_scatter(ctx.ep(), work, own, 0);
  } else {
    ctx.all_reduce(ctx.ep(), work);
    Kokkos::deep_copy(ctx.space, own, work);
  }
}
/// The working tokens' routed outputs, y_work [work_tokens, D]: the sorted rows ys weighted and
/// summed onto their tokens, or ys itself on the dense path (which computed y_work).
template <class Ctx>
typename Ctx::view2 combined_tokens(Ctx& ctx, typename Ctx::view2 ys) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  if (ctx.plan.dense) return ys;
  auto yw = ctx.ws.make("y_work", ctx.plan.work_tokens, ctx.cfg.base_emb_dim);
  permute::combine(ctx.space, cview2(ys), ivec(ctx.disp.perm.inverse), ctx.route_weights(), false,
                   yw);
  return yw;
}
template <class Ctx>
void gathered_combine(Ctx& ctx, typename Ctx::view2 ys) {
  std::int64_t const D = ctx.cfg.base_emb_dim;
  auto yw = combined_tokens(ctx, ys);
  // Sum the expert group's partial outputs onto each rank's own tokens, then split D over tensor.
  auto yo = ctx.ws.make("y_own", ctx.plan.tokens, D);
  tokens_reduce(ctx, yw, yo);
  auto y_c = ctx.ws.make("y_cols", ctx.plan.tokens, D / ctx.tp().size());
  ctx.reduce_scatter(ctx.tp(), yo, y_c, 1);
}
template <class Ctx>
void gathered_output_backward(Ctx& ctx, typename Ctx::cview2 dy) {
  auto dyw = ctx.ws.make("dy_work", ctx.plan.work_tokens, ctx.cfg.base_emb_dim);
  if (ctx.layout.route == ExpertRoute::Ring)
    ctx.all_gather(ctx.ep(), dy, dyw, 0);
  else
    Kokkos::deep_copy(ctx.space, dyw, dy);
}
template <class Ctx>
void local_combine_backward(Ctx& ctx, typename Ctx::view2 dyw) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  auto dys = ctx.ws.make("dy_local", ctx.disp.perm.rows(), ctx.cfg.base_emb_dim);
  auto dww = ctx.ws.make("d_weights_work", ctx.plan.work_tokens, ctx.cfg.num_experts_per_tok);
  permute::combine_backward(ctx.space, cview2(dyw), cview2(ctx.ws.at("y_local")),
                            ivec(ctx.disp.perm.perm), ivec(ctx.disp.perm.inverse),
                            ctx.route_weights(), dys, dww);
}
template <class Ctx>
void local_experts_backward(Ctx& ctx, typename Ctx::view2 dys) {
  // dxs overwrites dys.
  ctx.ffn.backward(ctx.space, dys, ctx.disp.perm.groups, ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, dys,
                   ctx.gc.wi_0, ctx.gc.wi_1, ctx.gc.wo);
}
template <class Ctx>
void dense_experts_backward(Ctx& ctx, typename Ctx::view2 dyw) {
  using cview2 = typename Ctx::cview2;
  auto dxw = ctx.ws.make("dx_work", ctx.plan.work_tokens, ctx.cfg.base_emb_dim);
  auto dww = ctx.ws.make("d_weights_work", ctx.plan.work_tokens, ctx.cfg.num_experts_per_tok);
  ctx.dense.backward(ctx.space, cview2(dyw), ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, dxw, dww,
                     ctx.gc.wi_0, ctx.gc.wi_1, ctx.gc.wo);
}
/// dx of the working tokens, [work_tokens, D]: the dense experts' own, or the sorted rows'
/// gradients (dy_local) scattered back to their tokens.
template <class Ctx>
typename Ctx::view2 work_dx(Ctx& ctx) {
  using cview2 = typename Ctx::cview2;
  using ivec = typename Ctx::ivec;
  if (ctx.plan.dense) return ctx.ws.at("dx_work");
  auto dxw = ctx.ws.make("dx_work", ctx.plan.work_tokens, ctx.cfg.base_emb_dim);
  permute::gather_rows_backward(ctx.space, cview2(ctx.ws.at("dy_local")),
                                ivec(ctx.disp.perm.inverse), ctx.cfg.num_experts_per_tok, false,
                                dxw);
  return dxw;
}
template <class Ctx>
void gathered_dispatch_backward(Ctx& ctx, typename Ctx::view2 dx) {
  using view2 = typename Ctx::view2;
  view2 dxw = work_dx(ctx);
  // ys and dxs are partial over the tensor-split hidden dim; the expert group's partial
  // d_weights / dx go back to the ranks that own the tokens.
  auto dww = ctx.ws.at("d_weights_work");
  ctx.all_reduce(ctx.tp(), dww);
  tokens_reduce(ctx, dww, ctx.ws.make("d_weights", ctx.plan.tokens, ctx.cfg.num_experts_per_tok));
  ctx.all_reduce(ctx.tp(), dxw);
  tokens_reduce(ctx, dxw, dx);
}

}  // namespace moe::distributed::stages
