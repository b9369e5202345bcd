#pragma once
/// \file
/// The chunked ring (num_moe_emb_chunks = n): routed from the all-gathered gate logits, its token
/// all-gather runs in n D-chunks overlapping the grouped GEMMs; the rest is the ring's.

#include <moe/comm/iall_gather.hpp>
#include <moe/detail/blas.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/strategy/gathered.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>
#include <utility>

namespace moe::distributed {

namespace stages {

template <class Ctx>
using chunk_pieces = comm::AllGatherPieces<typename Ctx::scalar_type, typename Ctx::memory_space,
                                           typename Ctx::memory_space>;
/// D-chunk c of the own tokens (chunk-major `own`) and its rows of the gathered `got`.
template <class Ctx>
auto chunk_views(Ctx const& ctx, typename Ctx::view2 own, typename Ctx::view2 got, std::int64_t c) {
  using view2 = typename Ctx::view2;
  std::int64_t const T = ctx.plan.tokens, Tw = ctx.plan.work_tokens, Dc = own.extent(1);
  return std::pair{view2(own.data() + c * T * Dc, T, Dc), view2(got.data() + c * Tw * Dc, Tw, Dc)};
}
/// Starts the all-gather of D-chunk c into its rows of `got`, on its wire (pool slot c % 2).
template <class Ctx>
auto start_chunk_gather(Ctx& ctx, chunk_pieces<Ctx> const& pieces, typename Ctx::view2 own,
                        typename Ctx::view2 got, std::int64_t c) {
  auto const& planned = ctx.planned("all-gather", ctx.ep().axes);
  auto const v = chunk_views(ctx, own, got, c);
  return distributed::start_gather_rows(ctx.space, ctx.ep(), pieces, v.first, v.second, &ctx.log,
                                        planned.what, planned.wire, &ctx.ws.pool(), int(c % 2));
}

}  // namespace stages

/// \brief The chunked ring (see the file comment): the ring's backward, its own forward.
struct ChunkedRing : Gathered<SortedExperts, true> {
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t value_bytes) const {
    PlanBuilder b(lay, cfg, par, value_bytes, true);
    begin(b).notes.push_back(moe::detail::cat(
        "num_moe_emb_chunks=", b.chunks,
        ": the ring gathers the gate logits for the routing, then the tokens in ", b.chunks,
        " non-blocking chunks of ", b.D / b.chunks,
        " columns (together the bytes of one token gather), chunk i+1 in flight while the first "
        "grouped GEMMs of chunk i run; the backward is the ring's"));
    Extent const n = b.local_rows(), Tw = b.work_tokens(), Dn{b.D / b.chunks, scale_emb};
    b.route(buf::x, true);
    b.stage(StageKind::dispatch, "moe::dispatch::gathered", {Buf::routing},
            {b.out(buf::local_ids, Tw, b.topk()), b.out(buf::local_kept, Tw, b.topk())});
    b.hold_sort({b.Tw * b.K, PlanBuilder::slot}, b.L);
    b.row_limit("sorted rows", n);
    // One overlapped stage: the chunk gathers and the GEMMs.
    auto& e = b.experts_stage({buf::x, Buf::routing},
                              {b.out(buf::x_chunks_own, {b.chunks * b.T, PlanBuilder::tok}, Dn),
                               b.out(buf::x_chunks, {b.chunks * b.Tw, PlanBuilder::tok}, Dn),
                               b.out(buf::x_local_chunk, n, Dn), b.out(buf::x_local, n, b.emb()),
                               b.out(buf::y_local, n, b.emb())},
                              "moe::dist::experts::chunked");
    for (std::int64_t c = 0; c < b.chunks; ++c)
      b.all_gather(e,
                   moe::detail::cat("all-gather tokens (ring, chunk ", c + 1, "/", b.chunks, ")"),
                   lay.ep_axes, b.T, b.D / b.chunks, 0);
    e.overlapped = true;
    b.hold_expert_ffn(n);
    return plan_after_experts(b);  // the ring's
  }

  template <class Ctx>
  static void dispatch(Ctx& c) {
    stages::local_sort(c);
  }
  /// Chunk c+1's all-gather progresses between the per-expert GEMMs of chunk c.
  template <class Ctx>
  static void experts(Ctx& ctx, std::uint64_t weights_version) {
    using view3 = typename Ctx::view3;
    std::int64_t const D = ctx.cfg.base_emb_dim, T = ctx.plan.tokens;
    std::int64_t const nc = ctx.plan.emb_chunks, Dc = D / nc, n = ctx.disp.perm.rows();
    std::int64_t const L = ctx.layout.local_experts, F = ctx.cp.wi_0.extent(2);
    int const K = ctx.cfg.num_experts_per_tok;
    // Own tokens chunk-major: rows [c*T, (c+1)*T) are columns [c*Dc, (c+1)*Dc) of x.
    auto own = ctx.ws.make(buf::x_chunks_own);
    detail::copy_rows(ctx.space, "moe::dist::chunk_pack", ctx.ws.at(buf::x).data(), own.data(),
                      T * nc, Dc, detail::Identity{}, detail::PaToAp{T, nc});
    auto got = ctx.ws.make(buf::x_chunks);
    auto xs = ctx.ws.make(buf::x_local, n).values();  // the chunked plan's rows are Values
    auto xs_c = ctx.ws.make(buf::x_local_chunk, n);
    // The chunks' shapes are agreed on once (one collective check, not one per chunk).
    auto const first = stages::chunk_views(ctx, own, got, 0);
    stages::chunk_pieces<Ctx> const pieces(ctx.ep().comm, ctx.space, first.first, first.second);
    auto next = stages::start_chunk_gather(ctx, pieces, own, got, 0);
    ctx.ffn.forward_begin(ctx.space, ctx.cfg.mlp_activation, xs, F, weights_version);
    for (std::int64_t c = 0; c < nc; ++c) {
      auto cur = std::move(next);
      cur.wait(ctx.space);
      if (c + 1 < nc) next = stages::start_chunk_gather(ctx, pieces, own, got, c + 1);
      permute::gather_rows(ctx.space, cview2_t<Ctx>(stages::chunk_views(ctx, own, got, c).second),
                           ctx.perm(), K, xs_c);
      detail::copy_rows(ctx.space, "moe::dist::chunk_unpack", xs_c.data(), xs.data(), n, Dc,
                        detail::Identity{}, detail::Block{nc, c});
      // Rows [c*Dc, (c+1)*Dc) of expert l's [D, F] weights: a contiguous [1, Dc, F] block.
      for (std::int64_t l = 0; l < L; ++l) {
        std::int64_t const at = (l * D + c * Dc) * F;
        ctx.ffn.forward_chunk(ctx.space, xs_c, ctx.disp.perm.groups,
                              view3(ctx.cp.wi_0.data() + at, 1, Dc, F),
                              view3(ctx.cp.wi_1.data() + at, 1, Dc, F), int(l));
        if (c + 1 < nc) next.test();
      }
    }
    auto ys = ctx.ws.make(buf::y_local, n).values();
    ctx.ffn.forward_end(ctx.space, ctx.disp.perm.groups, ctx.cp.wo, ys);
  }
};

}  // namespace moe::distributed
