#pragma once
/// \file
/// Routing kernels, backward (deterministic like routing/kernels.hpp): route_backward() and the
/// fixed-order column sums that give the routed bias its gradient.

#include <moe/detail/counting.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/routing/kernels.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace moe::routing {

/// \brief Backward of routing (the transpose of the weights' post-processing, top-k and score
/// function). Inputs: d_weights[T,K] (gradient w.r.t. the combine weights; 0 for dropped slots)
/// and, when lb_coef != 0, the load-balance term: d lb / d p[t,e] = lb_coef * counts[b(t), e].
/// Outputs: d_logits[T,E] (gradient w.r.t. the raw gate logits) and d_biased[T,E] (gradient
/// w.r.t. scores + bias; its column sums are the bias gradient).
template <class ExecSpace, class Scalar, class MS>
void route_backward(ExecSpace const& space, RouteParams const& p,
                    RoutingState<Scalar, MS> const& st, View2<Scalar const, MS> d_weights,
                    std::int64_t seq_len, double lb_coef, View2<Scalar, MS> d_top,
                    View2<Scalar, MS> d_biased, View2<Scalar, MS> d_logits) {
  int const E = p.cfg.num_experts, K = p.cfg.num_experts_per_tok;
  bool const deepseek = p.kind.deepseek;
  // DeepSeek takes its top values from the pre-bias scores, except under random routing, which
  // gathers the biased gate output.
  bool const from_scores = deepseek && !p.kind.random;
  ScoreFunc const f = p.cfg.routed_score_func;
  bool const ds_normalise = p.ds_normalise(), norm = p.cfg.norm_topk_prob;
  Scalar const scaling = Scalar(p.cfg.routed_scaling_factor);
  Scalar const coef = Scalar(lb_coef);
  auto logits = st.logits, scores = st.scores, biased = st.biased, top = st.top_values,
       w = st.weights;
  auto ids = st.expert_ids;
  auto counts = st.seq_counts;
  Kokkos::parallel_for(
      "moe::routing::route_backward", Kokkos::RangePolicy<ExecSpace>(space, 0, biased.extent(0)),
      KOKKOS_LAMBDA(std::size_t t) {
        // 1. post-processing backward: d_weights -> d_top (w.r.t. the selected values)
        if (deepseek) {
          Scalar sum = 0;
          for (int k = 0; k < K; ++k) sum += top(t, k);
          Scalar const den = sum + Scalar(1e-20);
          Scalar dot = 0;
          for (int k = 0; k < K; ++k) dot += d_weights(t, k) * scaling * top(t, k);
          for (int k = 0; k < K; ++k) {
            Scalar const du = d_weights(t, k) * scaling;
            d_top(t, k) = ds_normalise ? du / den - dot / (den * den) : du;
          }
        } else {
          // w = softmax(top) [/ sum]; undo the renormalisation, then the softmax.
          Scalar s = 0, m, z;
          detail::softmax_norm(K, Kokkos::subview(top, t, Kokkos::ALL()), m, z);
          auto sm = [&](int k) { return detail::exp(top(t, k) - m) / z; };
          for (int k = 0; k < K; ++k) s += sm(k);
          Scalar dn = 0;
          if (norm)
            for (int k = 0; k < K; ++k) dn += d_weights(t, k) * w(t, k);
          Scalar dot = 0;
          for (int k = 0; k < K; ++k) {
            Scalar const dpre = norm ? (d_weights(t, k) - dn) / s : d_weights(t, k);
            d_top(t, k) = dpre;  // temporarily
            dot += dpre * sm(k);
          }
          for (int k = 0; k < K; ++k) d_top(t, k) = sm(k) * (d_top(t, k) - dot);
        }
        // 2. d_biased = lb part + (generic: the selected values' gradient)
        Scalar pm = 0, pz = 0, pdot = 0;
        std::int64_t const b = std::int64_t(t) / seq_len;
        if (coef != Scalar(0)) {
          detail::softmax_norm(E, Kokkos::subview(biased, t, Kokkos::ALL()), pm, pz);
          for (int e = 0; e < E; ++e)
            pdot += coef * Scalar(counts(b, e)) * detail::exp(biased(t, e) - pm) / pz;
        }
        for (int e = 0; e < E; ++e) {
          Scalar g = 0;
          if (coef != Scalar(0)) {
            Scalar const pe = detail::exp(biased(t, e) - pm) / pz;
            g = pe * (coef * Scalar(counts(b, e)) - pdot);
          }
          if (!from_scores)
            for (int k = 0; k < K; ++k)
              if (ids(t, k) == e) g += d_top(t, k);
          d_biased(t, e) = g;
        }
        // 3. d_scores = d_biased (+ DeepSeek: the selected pre-bias values' gradient), then the
        //    score function's backward into d_logits.
        auto dscore = [&](int e) {
          Scalar g = d_biased(t, e);
          if (from_scores)
            for (int k = 0; k < K; ++k)
              if (ids(t, k) == e) g += d_top(t, k);
          return g;
        };
        if (f == ScoreFunc::Softmax) {
          Scalar dot = 0;
          for (int e = 0; e < E; ++e) dot += dscore(e) * scores(t, e);
          for (int e = 0; e < E; ++e) d_logits(t, e) = scores(t, e) * (dscore(e) - dot);
        } else {
          for (int e = 0; e < E; ++e) {
            Scalar const s = scores(t, e), g = dscore(e);
            if (f == ScoreFunc::Sigmoid) {
              d_logits(t, e) = g * s * (Scalar(1) - s);
            } else if (f == ScoreFunc::SqrtSoftplus) {
              // s = sqrt(softplus(l)); ds/dl = sigmoid(l) / (2 s)
              Scalar const sg = detail::sigmoid(logits(t, e));
              d_logits(t, e) = s > Scalar(0) ? g * sg / (Scalar(2) * s) : Scalar(0);
            } else {
              d_logits(t, e) = g;
            }
          }
        }
      });
}

/// \brief Column sums of a [T,E] view in a fixed order (the bias gradient): out[e] = sum_t m(t,e).
template <class ExecSpace, class Scalar, class MS, class Pool = moe::detail::ScratchPool<MS>>
void column_sums(ExecSpace const& space, View2<Scalar const, MS> m, View1<Scalar, MS> out,
                 Pool&& scratch = Pool()) {
  std::int64_t const T = m.extent(0);
  int const E = int(m.extent(1));
  auto value = KOKKOS_LAMBDA(std::int64_t t, int e) { return m(t, e); };
  auto store = KOKKOS_LAMBDA(std::int64_t, int e, double v) { out(e) = Scalar(v); };
  std::int64_t const rows = std::min<std::int64_t>(256, std::max<std::int64_t>(T, 1));
  auto partial = scratch.template get<double>("column_partial", ((T + rows - 1) / rows) * E);
  if (T == 0) {
    Kokkos::deep_copy(space, out, Scalar(0));
    return;
  }
  moe::detail::segment_column_sums(space, T, E, T, value, partial, store);
}

}  // namespace moe::routing
