#pragma once
/// \file
/// The ragged all-to-all strategy (ExpertRoute::RaggedA2A): rows travel to their experts' ranks,
/// run through the grouped GEMMs by local expert, and travel back as D/tp column blocks.

#include <moe/comm/collectives.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/stages/experts.hpp>
#include <moe/distributed/strategy/shared_expert.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>

#include <cstdint>
#include <memory>
#include <vector>

namespace moe::distributed {

/// \brief The ragged all-to-all strategy (see the file comment).
struct RaggedA2A : StageDefaults {
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t value_bytes) const {
    PlanBuilder b(lay, cfg, par, value_bytes, false);
    StepPlan& p = b.begin();
    p.route_text = "ragged all-to-all over " + detail::axes_text(lay.ep_axes);
    // Bytes of a value on the all-to-all's wire (2 on the bf16 wire).
    std::int64_t const w = comm::wire_bytes(b.wire(PlanBuilder::Payload::activations), b.s);
    p.notes.push_back(moe::detail::cat(
        "all-to-all bytes (marked ~) assume balanced routing: each dispatch and each combine "
        "sends T_local*K*D*bytes*(ep-1)/ep = ",
        b.T, "*", b.K, "*", b.D, "*", w, "*", b.ep - 1, "/", b.ep, " = ",
        b.T * b.K * b.D * w * (b.ep - 1) / b.ep,
        " bytes (D/tp columns after the tensor split), and the tensor-axis collectives on "
        "received rows assume T_local*K of them",
        cfg.capacity_factor > 0 ? "; per-sequence capacity keeps min(S*K, E*C) slots" : "",
        par.ragged_buffer_factor > 0 ? "; the receive buffer caps the rows at int(T*K*factor)"
                                     : ""));
    Extent const sent = b.sent_rows(), recv = b.recv_rows(), D = b.emb(), Dc = b.emb_cols();
    b.route(buf::x);
    auto& d =
        b.stage(StageKind::dispatch, "moe::dispatch::ragged_all_to_all", {buf::x, Buf::routing},
                {b.out(buf::x_sorted, sent, D), b.out(buf::x_received, recv, D),
                 b.out(buf::x_local, recv, D)});
    b.all_to_all(d, "dispatch", b.sent, b.D);
    b.hold_sort(sent, b.E);
    for (Buf h : {Buf::local_perm, Buf::local_inverse, Buf::local_expert_ids}) b.hold(h, {recv});
    b.row_limit("sorted rows", sent);
    b.row_limit("received rows", recv);
    auto& e = b.experts_stage({buf::x_local},
                              {b.out(buf::y_local, recv, D), b.out(buf::y_local_cols, recv, Dc)});
    b.reduce_scatter(e, "reduce-scatter y (tensor)", lay.tp_axes, b.recv, b.Dc, 1, true);
    b.hold_expert_ffn(recv);
    auto& c = b.stage(StageKind::combine, "moe::dist::combine", {buf::y_local_cols, Buf::routing},
                      {b.out(buf::y_received_cols, recv, Dc), b.out(buf::y_sorted_cols, sent, Dc),
                       b.out(buf::y_cols, b.tokens(), Dc)});
    b.all_to_all(c, "combine", b.recv, b.Dc);
    if (b.shared()) stages::plan_shared_forward(b);
    b.output();
    b.stage(StageKind::output, "moe::dist::output::backward", {Buf::dy},
            {b.out(buf::dy_cols, b.tokens(), Dc)});
    auto& cb =
        b.stage(StageKind::combine, "moe::dist::combine::backward",
                {buf::dy_cols, buf::y_sorted_cols, Buf::routing},
                {b.out(buf::dy_sorted_cols, sent, Dc), b.out(buf::d_weights, b.tokens(), b.topk()),
                 b.out(buf::dy_received_cols, recv, Dc), b.out(buf::dy_local_cols, recv, Dc)});
    b.all_reduce(cb, "reduce d_weights (tensor)", lay.tp_axes, b.T * b.K);
    b.all_to_all(cb, "dispatch d_y", b.sent, b.Dc);
    auto& eb =
        b.experts_stage({buf::dy_local_cols}, {b.out(buf::dy_local, recv, D), buf::dy_local_cols});
    b.all_gather(eb, "all-gather d_y (tensor)", lay.tp_axes, b.recv, b.Dc, 1, true);
    b.reduce_scatter(eb, "reduce-scatter d_x (tensor)", lay.tp_axes, b.recv, b.Dc, 1, true);
    b.hold_expert_ffn(recv);
    // dx's rows summed into dx itself, or (tensor axes) into its column block dy_cols first.
    std::vector<Out> dx_out = {buf::dy_received_cols, buf::dy_sorted_cols};
    if (b.tp > 1) dx_out.push_back(buf::dy_cols);
    dx_out.push_back(Buf::dx);
    auto& db = b.stage(StageKind::dispatch, "moe::dispatch::ragged_all_to_all::backward",
                       {buf::dy_local_cols}, std::move(dx_out));
    b.all_to_all(db, "combine d_x", b.recv, b.Dc);
    b.all_gather(db, "all-gather d_x (tensor)", lay.tp_axes, b.T, b.Dc, 1);
    if (b.shared()) stages::plan_shared_backward(b);
    return b.finish(buf::x);
  }

  template <class Ctx>
  static void route(Ctx& c) {
    stages::route_tokens(c, c.ws.at(buf::x));
  }
  // The rows between the sort and the experts, and back, are routed rows (role Rows): 16-bit
  // where the plan narrows them, which the bf16 wire would round them to anyway.
  template <class Ctx>
  static void dispatch(Ctx& ctx) {
    int const E = ctx.cfg.num_experts, K = ctx.cfg.num_experts_per_tok;
    int const ep = ctx.ep().size();
    std::int64_t const L = ctx.layout.local_experts;
    auto& perm = ctx.disp.perm;
    permute::sort_by_expert(ctx.space, ctx.expert_ids(), ctx.kept(), E, perm);
    auto const xs_o = ctx.ws.make(buf::x_sorted, perm.rows());
    xs_o.visit([&](auto const& xs) {
      permute::gather_rows(ctx.space, cview2_t<Ctx>(ctx.ws.at(buf::x)), ctx.perm(), K, xs);
    });
    auto const& off = perm.groups.offsets_host;
    View1<std::int64_t, Kokkos::HostSpace> mine("moe::dist::sizes", E),
        all("moe::dist::all_sizes", E * ep);
    std::vector<std::int64_t> send(ep);
    for (int e = 0; e < E; ++e) mine(e) = off(e + 1) - off(e);
    for (int j = 0; j < ep; ++j) send[j] = off((j + 1) * L) - off(j * L);
    std::int64_t const R =
        ctx.par.ragged_buffer_factor > 0
            ? comm::ragged_buffer_size(ctx.plan.tokens * K, ep, E, K, ctx.par.ragged_buffer_factor)
            : -1;
    ctx.disp.a2a = std::make_unique<comm::RaggedAllToAll>(ctx.ep().comm, send, R);
    auto const xr = ctx.ws.make(buf::x_received, ctx.disp.a2a->recv_total());
    all_to_all(ctx, false, xs_o, xr);
    // Everyone's group sizes -> the received rows regrouped by local expert.
    comm::all_gather(ctx.ep().comm, Kokkos::DefaultHostExecutionSpace(), mine, all);
    std::vector<std::int64_t> G(all.data(), all.data() + E * ep);
    permute::make_local_permutation(ctx.space, permute::local_layout(G, E, ep, ctx.ep().rank(), R),
                                    ctx.disp.lp);
    permute_rows(ctx, false, xr, ctx.ws.make(buf::x_local, ctx.disp.lp.rows()));
    ctx.disp.groups.offsets = ctx.disp.lp.group_offsets;
    ctx.disp.groups.offsets_host = ctx.disp.lp.group_offsets_host;
  }
  template <class Ctx>
  static void experts(Ctx& ctx, std::uint64_t weights_version) {
    auto const xr = ctx.ws.at(buf::x_local);
    std::int64_t const n = xr.rows();
    auto const yr = ctx.ws.make(buf::y_local, n);
    stages::experts_forward(ctx, xr, yr, ctx.disp.groups, weights_version);
    yr.visit_with(ctx.ws.make(buf::y_local_cols, n), [&](auto const& ys, auto const& ys_c) {
      ctx.reduce_scatter(ctx.tp(), ys, ys_c, 1);
    });
  }
  template <class Ctx>
  static void combine(Ctx& ctx) {
    auto const yr_c = ctx.ws.make(buf::y_received_cols, ctx.disp.a2a->recv_total());
    permute_rows(ctx, true, ctx.ws.at(buf::y_local_cols), yr_c);
    auto const ys_o_c = ctx.ws.make(buf::y_sorted_cols, ctx.disp.perm.rows());
    all_to_all(ctx, true, yr_c, ys_o_c);
    ys_o_c.visit([&](auto const& ys) {
      permute::combine(ctx.space, stages::const_rows(ys), ctx.inverse(), ctx.route_weights(), false,
                       ctx.ws.make(buf::y_cols));
    });
  }
  /// dy's D/tp columns, rounded to bf16 on a bf16 layer (as 16-bit rows where the plan narrows
  /// them): the first copy of the caller's dy.
  template <class Ctx>
  static void output_backward(Ctx& ctx, typename Ctx::cview2 dy) {
    ctx.ws.make(buf::dy_cols).visit([&](auto const& c) {
      distributed::slice_dim(ctx.space, ctx.tp().size(), ctx.tp().rank(), dy, c, 1);
      stages::round_if_wide(ctx, c);
    });
  }
  template <class Ctx>
  static void combine_backward(Ctx& ctx) {
    auto const dys_o_c = ctx.ws.make(buf::dy_sorted_cols, ctx.disp.perm.rows());
    auto dw = ctx.ws.make(buf::d_weights);
    ctx.ws.at(buf::y_sorted_cols).visit_with(dys_o_c, [&](auto const& ys, auto const& dys) {
      ctx.ws.at(buf::dy_cols).visit([&](auto const& dyc) {
        permute::combine_backward(ctx.space, stages::const_rows(dyc), stages::const_rows(ys),
                                  ctx.perm(), ctx.inverse(), ctx.route_weights(), dys, dw);
      });
    });
    ctx.all_reduce(ctx.tp(), dw);
    auto const dyr_c = ctx.ws.make(buf::dy_received_cols, ctx.disp.a2a->recv_total());
    all_to_all(ctx, false, dys_o_c, dyr_c);
    permute_rows(ctx, false, dyr_c, ctx.ws.make(buf::dy_local_cols, ctx.disp.lp.rows()));
  }
  template <class Ctx>
  static void experts_backward(Ctx& ctx) {
    auto const dys_c = ctx.ws.at(buf::dy_local_cols);
    auto const dyr = ctx.ws.make(buf::dy_local, dys_c.rows());
    dys_c.visit_with(dyr,
                     [&](auto const& c, auto const& dys) { ctx.all_gather(ctx.tp(), c, dys, 1); });
    // dxs (partial over tensor) overwrites dys, then goes to its column block dys_c.
    stages::experts_backward(ctx, dyr, ctx.disp.groups);
    dyr.visit_with(
        dys_c, [&](auto const& dxs, auto const& c) { ctx.reduce_scatter(ctx.tp(), dxs, c, 1); });
  }
  template <class Ctx>
  static void dispatch_backward(Ctx& ctx, typename Ctx::view2 dx) {
    auto const dxr_c = ctx.ws.at(buf::dy_received_cols);
    permute_rows(ctx, true, ctx.ws.at(buf::dy_local_cols), dxr_c);
    auto const dxs_o_c = ctx.ws.at(buf::dy_sorted_cols);
    all_to_all(ctx, true, dxr_c, dxs_o_c);
    // Each token's K rows summed (fp32) into dx, or with tensor axes into its column block
    // dy_cols (no longer read; 16-bit where narrowed, which the bf16 wire of the gather that
    // follows would round them to anyway), then gathered into dx.
    auto sum_into = [&](auto const& out) {
      dxs_o_c.visit([&](auto const& dxs) {
        permute::gather_rows_backward(ctx.space, stages::const_rows(dxs), ctx.inverse(),
                                      ctx.cfg.num_experts_per_tok, false, out);
      });
    };
    if (ctx.tp().size() == 1) return sum_into(dx);
    ctx.ws.at(buf::dy_cols).visit([&](auto const& dx_c) {
      sum_into(dx_c);
      ctx.all_gather(ctx.tp(), dx_c, dx, 1);
    });
  }
  /// The rows this rank's experts received.
  template <class Ctx>
  std::int64_t routed_rows(Ctx const& c) const {
    return c.disp.lp.rows();
  }

 private:
  /// The ragged exchange (forward, or `reverse`) between two buffers of routed rows.
  template <class Ctx, class Rows>
  static void all_to_all(Ctx& ctx, bool reverse, Rows const& src, Rows const& dst) {
    src.visit_with(dst, [&](auto const& s, auto const& d) { ctx.all_to_all(reverse, s, d); });
  }
  /// The received rows regrouped by local expert (or back: `inverse`), routed rows to routed rows.
  template <class Ctx, class Rows>
  static void permute_rows(Ctx& ctx, bool inverse, Rows const& src, Rows const& dst) {
    src.visit_with(dst, [&](auto const& s, auto const& d) {
      if (inverse)
        permute::unpermute_rows(ctx.space, ctx.disp.lp, s, d);
      else
        permute::permute_rows(ctx.space, ctx.disp.lp, s, d);
    });
  }
};

}  // namespace moe::distributed
