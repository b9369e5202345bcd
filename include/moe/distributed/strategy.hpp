#pragma once
/// \file
/// The dispatch strategies (distributed/strategy/, one per route): choose_strategy() picks one,
/// make_step_plan() lists its stages, run_stage() runs one (docs/architecture.md).

#include <moe/config.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/plan_builder.hpp>
#include <moe/distributed/strategy/chunked_ring.hpp>
#include <moe/distributed/strategy/ep_tp.hpp>
#include <moe/distributed/strategy/gathered.hpp>
#include <moe/distributed/strategy/ragged_a2a.hpp>

#include <cstddef>
#include <cstdint>
#include <variant>

namespace moe::distributed {

/// One of the dispatch strategies (see the file comment).
using Strategy =
    std::variant<RaggedA2A, Gathered<SortedExperts, false>, Gathered<DenseExperts, false>,
                 Gathered<SortedExperts, true>, Gathered<DenseExperts, true>, ChunkedRing,
                 EpTp<SortedExperts>, EpTp<DenseExperts>>;

/// The strategy of a layout (its route, dense path and token chunking).
inline Strategy choose_strategy(Layout const& lay, ParallelConfig const& par) {
  switch (lay.route) {  // a switch, so that a new route without a strategy is a warning
    case ExpertRoute::RaggedA2A:
      return RaggedA2A{};
    case ExpertRoute::EpTp:
      if (lay.dense) return EpTp<DenseExperts>{};
      return EpTp<SortedExperts>{};
    case ExpertRoute::Ring:
      if (par.num_moe_emb_chunks > 0) return ChunkedRing{};
      if (lay.dense) return Gathered<DenseExperts, true>{};
      return Gathered<SortedExperts, true>{};
    case ExpertRoute::Replicated:
    case ExpertRoute::Local:
      break;
  }
  if (lay.dense) return Gathered<DenseExperts, false>{};
  return Gathered<SortedExperts, false>{};
}

/// Runs stage `st` of strategy S (dy, dx: the backward's; the shared stages are the layer's).
template <class S, class Ctx>
void run_stage(S const&, Ctx& c, Stage const& st, std::uint64_t weights_version,
               typename Ctx::cview2 dy, typename Ctx::view2 dx) {
  bool const bw = st.backward;
  switch (st.kind) {
    case StageKind::gather_tokens:  // forward only
      if (!bw) return S::gather_tokens(c);
      break;
    case StageKind::route:
      return bw ? S::route_backward(c, dx) : S::route(c);
    case StageKind::dispatch:
      return bw ? S::dispatch_backward(c, dx) : S::dispatch(c);
    case StageKind::experts:
      return bw ? S::experts_backward(c) : S::experts(c, weights_version);
    case StageKind::combine:
      return bw ? S::combine_backward(c) : S::combine(c);
    case StageKind::shared_expert:
      return bw ? S::shared_backward(c, dy, dx) : S::shared_forward(c);
    case StageKind::output:  // the forward's is the layer's
      if (bw) return S::output_backward(c, dy);
      break;
    default:  // gather_weights, reduce_grads: the layer's
      break;
  }
  stages::no_stage(st);  // a kind this phase has no function for
}

/// \brief The step plan of `strategy` on the rank `lay` describes (pure: no MPI, no device).
/// \param scalar_bytes size of one value (4: float, 8: double) for the byte counts
inline StepPlan make_step_plan(Strategy const& strategy, Layout const& lay, LayerConfig const& cfg,
                               ParallelConfig const& par, std::size_t scalar_bytes) {
  return std::visit(
      [&](auto const& s) { return s.plan(lay, cfg, par, std::int64_t(scalar_bytes)); }, strategy);
}
/// \brief The step plan of the layout's own strategy (choose_strategy).
inline StepPlan make_step_plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                               std::size_t scalar_bytes) {
  return make_step_plan(choose_strategy(lay, par), lay, cfg, par, scalar_bytes);
}

}  // namespace moe::distributed
