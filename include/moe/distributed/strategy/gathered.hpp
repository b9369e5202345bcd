#pragma once
/// \file
/// The gathered-tokens strategy (Ring, Replicated, Local): local experts, sorted or dense, on the
/// working tokens (own, or the group's on the ring), partial outputs summed back to their owners.

#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/stages/experts.hpp>
#include <moe/distributed/strategy/shared_expert.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>
#include <string>

namespace moe::distributed {

namespace stages {

/// The working tokens' slots on local experts, sorted by local expert (ctx.disp.perm).
template <class Ctx>
void local_sort(Ctx& ctx) {
  using civ2 = typename Ctx::civ2;
  auto lids = ctx.ws.make(buf::local_ids);
  auto lkept = ctx.ws.make(buf::local_kept);
  permute::local_expert_ids(ctx.space, ctx.expert_ids(), ctx.kept(), int(ctx.layout.first_expert),
                            int(ctx.layout.local_experts), lids, lkept);
  permute::sort_by_expert(ctx.space, civ2(lids), civ2(lkept), ctx.layout.local_experts,
                          ctx.disp.perm);
}

/// The experts' backward on gathered tokens (dy all-gathered as `gather_dy` unless null); the
/// working dy_work and dx_work 16-bit where the plan narrows rows and `narrow_dy`, `narrow_dx`
/// (their readers take both).
template <class Experts>
Stage& plan_gathered_experts_backward(PlanBuilder& b, char const* gather_dy, std::int64_t cols,
                                      int dim, bool narrow_dy, bool narrow_dx) {
  auto& o = b.stage(StageKind::output, "moe::dist::output::backward", {Buf::dy},
                    {b.out(buf::dy_work, b.work_tokens(), b.emb(), {}, narrow_dy)});
  if (gather_dy) {
    b.all_gather(o, gather_dy, b.lay.ep_axes, b.T, cols, dim);
    PlanBuilder::rows16(o, 0, dim == 0 && b.find(Buf::dy_work)->elem == Elem::bf16);
  }
  Experts::plan_backward(b);
  return b.stage(StageKind::dispatch, "moe::dispatch::gathered::backward",
                 {Experts::dx_rows(b), buf::d_weights_work},
                 {b.out(buf::dx_work, b.work_tokens(), b.emb(), {}, narrow_dx),
                  b.out(buf::d_weights, b.tokens(), b.topk()), Buf::dx});
}

}  // namespace stages

/// \brief The routed rows of the working tokens sorted by local expert through the grouped GEMMs.
/// x_local, y_local and dy_local, and the working tokens x_work and dy_work they come from, are
/// 16-bit where the plan narrows them (PlanBuilder::rows_elem), and so are the sums y_work and
/// dx_work where the plan narrows those; the experts' dx rows overwrite dy_local.
struct SortedExperts : StageDefaults {
  static constexpr bool dense = false;
  /// What the experts write (the combine reads it) and what the dispatch backward reads.
  static constexpr auto rows_out = buf::y_local;
  static Ref dx_rows(PlanBuilder const&) { return buf::dy_local; }

  /// The dispatch and experts stages on the working tokens `xw`.
  static void plan_forward(PlanBuilder& b, Ref xw) {
    Extent const n = b.local_rows(), D = b.emb(), Tw = b.work_tokens();
    b.stage(StageKind::dispatch, "moe::dispatch::gathered", {xw, Buf::routing},
            {b.out(buf::local_ids, Tw, b.topk()), b.out(buf::local_kept, Tw, b.topk()),
             b.out(buf::x_local, n, D)});
    b.hold_sort({b.Tw * b.K, PlanBuilder::slot}, b.L);
    b.row_limit("sorted rows", n);
    b.experts_stage({buf::x_local}, {b.out(buf::y_local, n, D)});
    b.hold_expert_ffn(n);
  }
  static void plan_backward(PlanBuilder& b) {
    Extent const n = b.local_rows();
    b.stage(
        StageKind::combine, "moe::dist::combine::backward",
        {buf::dy_work, buf::y_local, Buf::routing},
        {b.out(buf::dy_local, n, b.emb()), b.out(buf::d_weights_work, b.work_tokens(), b.topk())});
    b.experts_stage({buf::dy_local}, {buf::dy_local});
    b.hold_expert_ffn(n);
  }

  /// The working tokens `xw` (rows of either width) sorted into x_local.
  template <class Ctx, class Rows>
  static void dispatch(Ctx& ctx, Rows const& xw) {
    stages::local_sort(ctx);
    auto const xs = ctx.ws.make(buf::x_local, ctx.disp.perm.rows());
    xw.visit([&](auto const& x) {
      xs.visit([&](auto const& s) {
        permute::gather_rows(ctx.space, stages::const_rows(x), ctx.perm(),
                             ctx.cfg.num_experts_per_tok, s);
      });
    });
  }
  /// The experts on the sorted rows (x_local; `xw` is the working tokens they came from).
  template <class Ctx, class H>
  static void experts(Ctx& ctx, H /*xw*/, std::uint64_t weights_version) {
    auto const xr = ctx.ws.at(buf::x_local);
    auto const yr = ctx.ws.make(buf::y_local, xr.rows());
    stages::experts_forward(ctx, xr, yr, ctx.disp.perm.groups, weights_version);
  }
  /// The working tokens' routed outputs y_work: the sorted rows weighted and summed onto them.
  template <class Ctx>
  static auto combined(Ctx& ctx) {
    auto const yw = ctx.ws.make(buf::y_work);
    ctx.ws.at(buf::y_local).visit([&](auto const& ys) {
      yw.visit([&](auto const& y) {
        permute::combine(ctx.space, stages::const_rows(ys), ctx.inverse(), ctx.route_weights(),
                         false, y);
      });
    });
    return yw;
  }
  template <class Ctx>
  static void combine_backward(Ctx& ctx) {
    auto dyr = ctx.ws.make(buf::dy_local, ctx.disp.perm.rows());
    auto dww = ctx.ws.make(buf::d_weights_work);
    ctx.ws.at(buf::dy_work).visit([&](auto const& dyw) {
      ctx.ws.at(buf::y_local).visit([&](auto const& ys) {
        dyr.visit([&](auto const& dys) {
          permute::combine_backward(ctx.space, stages::const_rows(dyw), stages::const_rows(ys),
                                    ctx.perm(), ctx.inverse(), ctx.route_weights(), dys, dww);
        });
      });
    });
  }
  template <class Ctx>
  static void experts_backward(Ctx& ctx) {
    stages::experts_backward(ctx, ctx.ws.at(buf::dy_local), ctx.disp.perm.groups);  // dxs: dys
  }
  /// dx of the working tokens: the sorted rows' gradients scattered back to them.
  template <class Ctx>
  static auto work_dx(Ctx& ctx) {
    auto const dxw = ctx.ws.make(buf::dx_work);
    ctx.ws.at(buf::dy_local).visit([&](auto const& dxs) {
      dxw.visit([&](auto const& dx) {
        permute::gather_rows_backward(ctx.space, stages::const_rows(dxs), ctx.inverse(),
                                      ctx.cfg.num_experts_per_tok, false, dx);
      });
    });
    return dxw;
  }
  template <class Ctx>
  static std::int64_t routed_rows(Ctx const& ctx) {
    return ctx.disp.perm.rows();
  }
};

/// \brief The dense masked experts: every working token through every local expert, masked.
struct DenseExperts : StageDefaults {
  static constexpr bool dense = true;
  static constexpr auto rows_out = buf::y_work;
  static Ref dx_rows(PlanBuilder const&) { return buf::dx_work; }

  static void plan_forward(PlanBuilder& b, Ref xw) {
    Extent const Tw = b.work_tokens(), L{b.L, scale_experts};
    b.experts_stage({xw, Buf::routing}, {b.out(buf::y_work, Tw, b.emb(), {}, false)});
    // What nn::DenseExperts keeps.
    b.row_limit("dense expert rows", Tw);
    b.phase().back().flops = b.ffn_flops(double(b.Tw) * double(b.L), double(b.F));
    b.hold(Buf::dense_weights, {Tw, L});
    for (Buf h : {Buf::h0, Buf::h1, Buf::act}) b.hold_hidden(h, {Tw, b.mlp()});
    b.hold(Buf::y_expert, {Tw, b.emb()});
  }
  static void plan_backward(PlanBuilder& b) {
    Extent const Tw = b.work_tokens(), L{b.L, scale_experts};
    b.experts_stage({buf::dy_work}, {b.out(buf::dx_work, Tw, b.emb(), {}, false),
                                     b.out(buf::d_weights_work, Tw, b.topk())});
    // The backward runs each expert's forward again (it keeps one expert's hidden states).
    double const rows = double(b.Tw) * double(b.L);
    b.phase().back().flops = b.ffn_flops(rows, double(b.F)) + 3 * b.gemm(rows, b.D, b.F);
    b.hold(Buf::dy_expert, {Tw, b.emb()});
    for (Buf h : {Buf::d_act, Buf::d_h1}) b.hold_hidden(h, {Tw, b.mlp()});
    b.hold(Buf::d_dense_weights, {Tw, L});
  }

  /// The experts on the working tokens, the buffer `xw` (declared wide: the plan keeps the
  /// dense path's working tokens as values).
  template <class Ctx, class H>
  static void experts(Ctx& ctx, H xw, std::uint64_t /*weights_version*/) {
    auto yw = ctx.ws.make(buf::y_work).values();
    ctx.dense.forward(ctx.space, ctx.cfg.mlp_activation, cview2_t<Ctx>(ctx.ws.values(xw)),
                      ctx.expert_ids(), ctx.kept(), ctx.route_weights(),
                      int(ctx.layout.first_expert), ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, yw);
  }
  /// The dense experts computed y_work itself.
  template <class Ctx>
  static auto combined(Ctx& ctx) {
    return ctx.ws.at(buf::y_work);
  }
  template <class Ctx>
  static void experts_backward(Ctx& ctx) {
    auto dxw = ctx.ws.make(buf::dx_work).values();
    auto dww = ctx.ws.make(buf::d_weights_work);
    ctx.dense.backward(ctx.space, cview2_t<Ctx>(ctx.ws.values(buf::dy_work)), ctx.cp.wi_0,
                       ctx.cp.wi_1, ctx.cp.wo, dxw, dww, ctx.gc.wi_0, ctx.gc.wi_1, ctx.gc.wo);
  }
  template <class Ctx>
  static auto work_dx(Ctx& ctx) {
    return ctx.ws.at(buf::dx_work);
  }
  /// The dense path computes every token: no routed rows.
  template <class Ctx>
  static std::int64_t routed_rows(Ctx const&) {
    return 0;
  }
};

/// \brief The route, dispatch and experts stages on the working tokens W, through `Experts`.
/// The ring routes from the own tokens' gathered gate logits (stages::route_from_logits), the
/// others route the full-D tokens W.
template <class Experts, Buf W, bool Ring>
struct OnWorkTokens : Experts {
  static constexpr auto xw = detail::handle<W>();  ///< the working tokens

  /// Own tokens x -> x_work, all-gathered over the expert axes (ring: rows; EP-TP: D columns).
  template <class Ctx>
  static void gather_tokens(Ctx& c) {
    c.ws.make(buf::x_work).visit([&](auto const& x) {
      c.all_gather(c.ep(), c.ws.at(buf::x), x, Ring ? 0 : 1);
    });
  }
  template <class Ctx>
  static void route(Ctx& c) {
    if constexpr (Ring)
      stages::route_from_logits(c);
    else
      stages::route_tokens(c, c.ws.values(xw));
  }
  template <class Ctx>
  static void dispatch(Ctx& c) {
    Experts::dispatch(c, c.ws.rows(xw));
  }
  template <class Ctx>
  static void experts(Ctx& c, std::uint64_t weights_version) {
    Experts::experts(c, xw, weights_version);
  }
};

/// \brief The gathered-tokens strategy (see the file comment); Ring: ExpertRoute::Ring.
template <class Experts, bool Ring>
struct Gathered : OnWorkTokens<Experts, Ring ? Buf::x_work : Buf::x, Ring> {
  using OnWorkTokens<Experts, Ring ? Buf::x_work : Buf::x, Ring>::xw;  ///< the working tokens

  /// Its stages, top to bottom.
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t value_bytes) const {
    PlanBuilder b(lay, cfg, par, value_bytes, Ring);
    begin(b);
    b.route(Ring ? Ref(buf::x) : Ref(xw), Ring);
    if constexpr (Ring) {
      auto& st = b.stage(StageKind::gather_tokens, "moe::dist::gather_tokens", {buf::x},
                         {b.out(buf::x_work, b.work_tokens(), b.emb(), {}, !Experts::dense)});
      b.all_gather(st, "all-gather tokens (ring)", lay.ep_axes, b.T, b.D, 0);
      PlanBuilder::rows16(st, 0, b.find(Buf::x_work)->elem == Elem::bf16);
    }
    Experts::plan_forward(b, xw);
    return plan_after_experts(b);
  }
  /// Starts the plan (also the chunked ring's).
  static StepPlan& begin(PlanBuilder& b) {
    StepPlan& p = b.begin();
    auto const ep = detail::axes_text(b.lay.ep_axes);
    if (Ring) p.token_gathered[0] = b.lay.ep_axes;
    p.route_text =
        Ring ? "ring of experts: tokens all-gathered over " + ep + ", outputs reduce-scattered"
        : b.ep > 1 ? "replicated batch over " + ep + ", outputs all-reduced"
                   : std::string("local (no expert parallelism)");
    return p;
  }
  /// The stages after the experts, and the backward (also the chunked ring's). The sums y_work
  /// and dx_work are 16-bit (where the plan narrows rows) where the ring's reduce-scatter, whose
  /// bf16 wire rounds them anyway, is all that reads them: dx_work only without tensor axes (an
  /// fp32 all-reduce over tensor sums it first).
  static StepPlan plan_after_experts(PlanBuilder& b) {
    bool const narrow_y = Ring && !Experts::dense, narrow_dx = narrow_y && b.tp == 1;
    // The experts' output summed onto the owners' tokens, then split into D/tp columns.
    auto& c = b.stage(
        StageKind::combine, "moe::dist::combine", {Experts::rows_out, Buf::routing},
        {b.out(buf::y_work, b.work_tokens(), b.emb(), {}, narrow_y),
         b.out(buf::y_own, b.tokens(), b.emb()), b.out(buf::y_cols, b.tokens(), b.emb_cols())});
    stages::plan_tokens_reduce(b, c, "y", b.D, Ring);
    PlanBuilder::rows16(c, 0, b.find(Buf::y_work)->elem == Elem::bf16);
    b.reduce_scatter(c, "reduce-scatter y (tensor)", b.lay.tp_axes, b.T, b.Dc, 1);
    if (b.shared()) stages::plan_shared_forward(b);
    b.output();
    auto& d = stages::plan_gathered_experts_backward<Experts>(
        b, Ring ? "all-gather d_y (expert)" : nullptr, b.D, 0, !Experts::dense, narrow_dx);
    b.all_reduce(d, "reduce d_weights (tensor)", b.lay.tp_axes, b.Tw * b.K);
    stages::plan_tokens_reduce(b, d, "d_weights", b.K, Ring);
    b.all_reduce(d, "reduce d_x (tensor)", b.lay.tp_axes, b.Tw * b.D);
    std::size_t const before = d.collectives.size();
    stages::plan_tokens_reduce(b, d, "d_x", b.D, Ring);
    PlanBuilder::rows16(d, before, b.find(Buf::dx_work)->elem == Elem::bf16);
    if (b.shared()) stages::plan_shared_backward(b);
    return b.finish(buf::x);
  }

  /// The working tokens' outputs summed onto the own tokens, then split over tensor into y_cols.
  template <class Ctx>
  static void combine(Ctx& c) {
    auto const yo = c.ws.make(buf::y_own);
    Experts::combined(c).visit([&](auto const& yw) { stages::tokens_reduce(c, Ring, yw, yo); });
    c.reduce_scatter(c.tp(), yo, c.ws.make(buf::y_cols), 1);
  }
  template <class Ctx>
  static void output_backward(Ctx& c, typename Ctx::cview2 dy) {
    c.ws.make(buf::dy_work).visit([&](auto const& w) { stages::tokens_gather(c, Ring, dy, w); });
  }
  /// The working tokens' d_weights and dx (partial over tensor and the local experts) summed back
  /// to the tokens' owners.
  template <class Ctx>
  static void dispatch_backward(Ctx& c, typename Ctx::view2 dx) {
    auto const dxw = Experts::work_dx(c);
    auto dww = c.ws.at(buf::d_weights_work);
    c.all_reduce(c.tp(), dww);
    stages::tokens_reduce(c, Ring, dww, c.ws.make(buf::d_weights));
    if (c.tp().size() > 1) c.all_reduce(c.tp(), dxw.values());  // planned wide with tensor axes
    dxw.visit([&](auto const& v) { stages::tokens_reduce(c, Ring, v, dx); });
  }
};

}  // namespace moe::distributed
