#pragma once
/// \file
/// The ragged all-to-all strategy of the distributed layer (ExpertRoute::RaggedA2A): rows travel
/// to the ranks of their experts (dispatch), are regrouped by local expert, run through the
/// grouped GEMMs, and travel back (combine) as D/tp column blocks; tensor parallelism splits the
/// hidden dim, so partial outputs are reduce-scattered into column blocks before travelling back.
/// Its stages and their functions, forward and backward.

#include <moe/comm/collectives.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/stages/route.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/distributed/strategy/shared_expert.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace moe::distributed {
namespace stages {

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

}  // namespace stages

/// \brief The ragged all-to-all strategy (see the file comment).
struct RaggedA2A {
  StepPlan plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                std::int64_t scalar_bytes) const {
    PlanBuilder b(lay, cfg, par, scalar_bytes, false);
    StepPlan p = b.begin(b.ep);
    auto& f = p.forward;
    b.gather_weights(p);
    b.route(f, "x");
    auto& d = b.stage(f, StageKind::dispatch, "moe::dispatch::ragged_all_to_all", {"x", "routing"},
                      {"x_sorted", "x_received", "x_local"});
    b.all_to_all(d, "dispatch", b.sent, b.D);
    auto& e = b.stage(f, StageKind::experts, "moe::dist::experts",
                      {"x_local", "compute.wi_0", "compute.wi_1", "compute.wo"},
                      {"y_local", "y_local_cols"});
    b.reduce_scatter(e, "reduce-scatter y (tensor)", lay.tp_axes, b.recv * b.Dc, true);
    auto& c = b.stage(f, StageKind::combine, "moe::dist::combine", {"y_local_cols", "routing"},
                      {"y_received_cols", "y_sorted_cols", "y_cols"});
    b.all_to_all(c, "combine", b.recv, b.Dc);
    if (b.shared()) stages::plan_shared_forward(b, f, true);
    b.output(f);
    b.backward = true;
    auto& bw = p.backward;
    b.stage(bw, StageKind::output, "moe::dist::output::backward", {"dy"}, {"dy_cols"});
    auto& cb = b.stage(bw, StageKind::combine, "moe::dist::combine::backward",
                       {"dy_cols", "y_sorted_cols", "routing"},
                       {"dy_sorted_cols", "d_weights", "dy_received_cols", "dy_local_cols"});
    b.all_reduce(cb, "reduce d_weights (tensor)", lay.tp_axes, b.T * b.K);
    b.all_to_all(cb, "dispatch d_y", b.sent, b.Dc);
    auto& eb = b.stage(bw, StageKind::experts, "moe::dist::experts::backward",
                       {"dy_local_cols", "compute.wi_0", "compute.wi_1", "compute.wo"},
                       {"dy_local", "dy_local_cols", "d.wi_0", "d.wi_1", "d.wo"});
    b.all_gather(eb, "all-gather d_y (tensor)", lay.tp_axes, b.recv * b.Dc, true);
    b.reduce_scatter(eb, "reduce-scatter d_x (tensor)", lay.tp_axes, b.recv * b.Dc, true);
    auto& db = b.stage(bw, StageKind::dispatch, "moe::dispatch::ragged_all_to_all::backward",
                       {"dy_local_cols"}, {"dy_received_cols", "dy_sorted_cols", "dy_cols", "dx"});
    b.all_to_all(db, "combine d_x", b.recv, b.Dc);
    b.all_gather(db, "all-gather d_x (tensor)", lay.tp_axes, b.T * b.Dc);
    if (b.shared()) stages::plan_shared_backward(b, bw, true);
    b.route_backward(bw, "x");
    b.reduce_grads(p);
    return p;
  }

  template <class Ctx>
  void forward(Ctx& c, Stage const& st, std::uint64_t weights_version) const {
    switch (st.kind) {
      case StageKind::route:
        return stages::route_tokens(c, c.ws.at("x"), false);
      case StageKind::dispatch:
        return stages::a2a_dispatch(c, c.ws.at("x"));
      case StageKind::experts:
        return stages::a2a_experts(c, c.ws.at("x_local"), weights_version);
      case StageKind::combine:
        return stages::a2a_combine(c, c.ws.at("y_local_cols"));
      case StageKind::shared_expert:
        return stages::shared_forward(c, c.ws.at("x"), c.ws.at("y_cols"));
      default:
        break;
    }
    stages::no_stage(st);
  }
  template <class Ctx>
  void backward(Ctx& c, Stage const& st, typename Ctx::cview2 dy, typename Ctx::view2 dx) const {
    switch (st.kind) {
      case StageKind::output:
        return stages::a2a_output_backward(c, dy);
      case StageKind::combine:
        return stages::a2a_combine_backward(c, c.ws.at("dy_cols"));
      case StageKind::experts:
        return stages::a2a_experts_backward(c, c.ws.at("dy_local_cols"));
      case StageKind::dispatch:
        return stages::a2a_dispatch_backward(c, c.ws.at("dy_local_cols"), dx);
      case StageKind::shared_expert:
        return stages::shared_backward(c, dy, dx);
      case StageKind::route:
        return stages::route_backward(c, dx);
      default:
        break;
    }
    stages::no_stage(st);
  }
  /// The rows this rank's experts received.
  template <class Ctx>
  std::int64_t routed_rows(Ctx const& c) const {
    return c.disp.lp.rows();
  }
};

}  // namespace moe::distributed
