#pragma once
/// \file
/// Routing kernels, forward: policies, routing state, score functions, top-k, weight
/// post-processing, capacity masks, load-balance statistics and the routed bias. No atomics on
/// floating-point values, so results do not depend on the backend.

#include <moe/config_types.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/counting.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace moe::routing {

/// \brief Routing policy: decided from the config (`decoder_block`, `use_random_routing`).
struct Auto {};
/// \brief Routing policy: generic top-k + softmax over the K selected scores (Mixtral, Qwen).
struct TopKSoftmax {};
/// \brief Routing policy: DeepSeek (biased selection, pre-bias weights, groups, scaling).
struct DeepSeek {};
/// \brief Routing policy: experts drawn uniformly at random per (token, slot), seeded.
struct Random {};

/// \brief Whether T is a routing policy tag.
template <class T>
struct is_policy : std::bool_constant<std::is_same_v<T, Auto> || std::is_same_v<T, TopKSoftmax> ||
                                      std::is_same_v<T, DeepSeek> || std::is_same_v<T, Random>> {};

/// \brief Which selection rule and which weight post-processing run.
struct Kind {
  bool random = false;    ///< indices drawn at random
  bool deepseek = false;  ///< DeepSeek selection / post-processing, else generic
};

/// \brief The routing family a policy stands for under `cfg`; throws ConfigError when the
/// compile-time policy contradicts the config.
template <class Policy>
Kind resolve(Policy, LayerConfig const& cfg) {
  Kind k{cfg.use_random_routing, cfg.decoder_block == DecoderBlock::DeepSeek};
  if constexpr (std::is_same_v<Policy, TopKSoftmax>)
    detail::require<ConfigError>(!k.random && !k.deepseek,
                                 "routing policy TopKSoftmax needs decoder_block=mixtral and "
                                 "use_random_routing=false");
  else if constexpr (std::is_same_v<Policy, DeepSeek>)
    detail::require<ConfigError>(!k.random && k.deepseek,
                                 "routing policy DeepSeek needs decoder_block=deepseek and "
                                 "use_random_routing=false");
  else if constexpr (std::is_same_v<Policy, Random>)
    detail::require<ConfigError>(k.random, "routing policy Random needs use_random_routing=true");
  else
    static_assert(std::is_same_v<Policy, Auto>,
                  "routing policy must be Auto, TopKSoftmax, DeepSeek or Random");
  return k;
}

/// \brief Everything routing produces for T tokens, kept for the backward pass.
template <class Scalar, class MemorySpace>
struct RoutingState {
  View2<Scalar, MemorySpace> logits;      ///< [T,E] raw gate logits x . W_g
  View2<Scalar, MemorySpace> scores;      ///< [T,E] after the score function, before the bias
  View2<Scalar, MemorySpace> biased;      ///< [T,E] scores + bias (same memory as scores w/o bias)
  View2<int, MemorySpace> expert_ids;     ///< [T,K] selected experts
  View2<Scalar, MemorySpace> top_values;  ///< [T,K] selected values before post-processing
  View2<Scalar, MemorySpace> weights;     ///< [T,K] combine weights (before capacity dropping)
  View2<int, MemorySpace> kept;           ///< [T,K] 1 if the slot survives capacity, else 0
  View2<std::int64_t, MemorySpace> seq_counts;  ///< [B,E] slots per (sequence, expert) (lb loss)
  View2<Scalar, MemorySpace> seq_probs;         ///< [B,E] sum over the sequence of softmax(biased)
  View1<std::int64_t, MemorySpace> expert_counts;  ///< [E] selected slots per expert (pre-drop)
};

namespace detail {

using moe::detail::exp;
using moe::detail::isnan;
using moe::detail::log1p;
using moe::detail::sqrt;

/// Top-k's order (as lax.top_k): larger value first, NaN below everything, ties to the lower index.
template <class S>
KOKKOS_INLINE_FUNCTION bool key_greater(S va, int ia, S vb, int ib) {
  bool const na = isnan(va), nb = isnan(vb);
  if (na != nb) return nb;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

/// One top-k step: the i < n with ok(i) that comes next after `prev` (< 0: first) in key_greater
/// order of v[i], or -1.
template <class V, class Ok>
KOKKOS_INLINE_FUNCTION int next_best(int n, V const& v, int prev, Ok const& ok) {
  int best = -1;
  for (int i = 0; i < n; ++i) {
    if (prev >= 0 && !key_greater(v[prev], prev, v[i], i)) continue;
    if (best >= 0 && !key_greater(v[i], i, v[best], best)) continue;
    if (ok(i)) best = i;
  }
  return best;
}

/// Max m and normaliser z = sum_i exp(v[i] - m) of the softmax of v[0..n), in that order.
template <class V, class S>
KOKKOS_INLINE_FUNCTION void softmax_norm(std::int64_t n, V const& v, S& m, S& z) {
  m = v[0];
  for (std::int64_t i = 1; i < n; ++i) m = v[i] > m ? v[i] : m;
  z = S(0);
  for (std::int64_t i = 0; i < n; ++i) z += exp(v[i] - m);
}

template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S x) {
  return x >= S(0) ? S(1) / (S(1) + exp(-x)) : exp(x) / (S(1) + exp(x));
}

template <class S>
KOKKOS_INLINE_FUNCTION S softplus(S x) {
  return (x > S(0) ? x : S(0)) + log1p(exp(x > S(0) ? -x : x));
}

/// SplitMix64: a counter-based hash giving reproducible random routing on every backend.
KOKKOS_INLINE_FUNCTION std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// Group score of DeepSeek group-limited routing: sum of the (up to) two best scores of group g.
template <class Row>
KOKKOS_INLINE_FUNCTION auto group_score(Row const& row, int g, int group_size) {
  using S = typename Row::non_const_value_type;
  int b1 = g * group_size, b2 = -1;
  for (int e = g * group_size + 1; e < (g + 1) * group_size; ++e) {
    if (key_greater(row(e), e, row(b1), b1)) {
      b2 = b1;
      b1 = e;
    } else if (b2 < 0 || key_greater(row(e), e, row(b2), b2)) {
      b2 = e;
    }
  }
  return row(b1) + (b2 >= 0 ? row(b2) : S(0));
}

}  // namespace detail

/// The config and routing family the routing kernels run with.
struct RouteParams {
  Kind kind;
  LayerConfig cfg;

  RouteParams() = default;
  RouteParams(LayerConfig const& c, Kind k) : kind(k), cfg(c) {}
  /// DeepSeek's score functions renormalise the selected weights by their sum.
  bool ds_normalise() const {
    return cfg.routed_score_func == ScoreFunc::Sigmoid ||
           cfg.routed_score_func == ScoreFunc::SqrtSoftplus;
  }
};

/// \brief Applies the score function to raw gate logits: scores[T,E] = score(logits).
template <class ExecSpace, class Scalar, class MS>
void apply_score(ExecSpace const& space, ScoreFunc f, View2<Scalar const, MS> logits,
                 View2<Scalar, MS> scores) {
  int const E = int(logits.extent(1));
  Kokkos::parallel_for(
      "moe::routing::score", Kokkos::RangePolicy<ExecSpace>(space, 0, logits.extent(0)),
      KOKKOS_LAMBDA(std::size_t t) {
        if (f == ScoreFunc::Softmax) {
          Scalar m, z;
          detail::softmax_norm(E, Kokkos::subview(logits, t, Kokkos::ALL()), m, z);
          for (int e = 0; e < E; ++e) scores(t, e) = detail::exp(logits(t, e) - m) / z;
        } else {
          for (int e = 0; e < E; ++e) {
            Scalar const l = logits(t, e);
            scores(t, e) = f == ScoreFunc::Sigmoid        ? detail::sigmoid(l)
                           : f == ScoreFunc::SqrtSoftplus ? detail::sqrt(detail::softplus(l))
                                                          : l;
          }
        }
      });
}

/// \brief Selects K experts per token from `biased` and computes their combine weights (DeepSeek
/// from the pre-bias `scores`). Random routing draws from (seed, token_offset + t, slot), so a
/// token's experts do not depend on the layout.
template <class ExecSpace, class Scalar, class MS>
void select_topk(ExecSpace const& space, RouteParams const& p, std::uint64_t token_offset,
                 View2<Scalar const, MS> scores, View2<Scalar const, MS> biased, View2<int, MS> ids,
                 View2<Scalar, MS> top_values, View2<Scalar, MS> weights) {
  int const E = p.cfg.num_experts, K = p.cfg.num_experts_per_tok;
  int const G = p.cfg.n_routing_groups, TG = p.cfg.topk_routing_group;
  bool const deepseek = p.kind.deepseek, random = p.kind.random, ds_normalise = p.ds_normalise();
  bool const norm = p.cfg.norm_topk_prob;
  Scalar const scaling = Scalar(p.cfg.routed_scaling_factor);
  std::uint64_t const seed = p.cfg.seed;
  Kokkos::parallel_for(
      "moe::routing::select_topk", Kokkos::RangePolicy<ExecSpace>(space, 0, biased.extent(0)),
      KOKKOS_LAMBDA(std::size_t t) {
        auto row = Kokkos::subview(biased, t, Kokkos::ALL());
        int const gsize = G > 0 ? E / G : E;
        // Group-limited routing: bit g of `allowed` is set for the TG best groups (G <= 64).
        std::uint64_t allowed = G > 0 ? 0 : ~std::uint64_t(0);
        Scalar group[64];
        for (int g = 0; g < G; ++g) group[g] = detail::group_score(row, g, gsize);
        for (int j = 0, g = -1; G > 0 && j < TG; ++j) {
          g = detail::next_best(G, group, g, [](int) { return true; });
          allowed |= std::uint64_t(1) << g;
        }
        auto eligible = [&](int e) { return G <= 0 || ((allowed >> (e / gsize)) & 1u); };
        for (int k = 0, e = -1; k < K; ++k) {
          if (random)
            e = int(
                detail::splitmix64(seed ^ detail::splitmix64((token_offset + t) * 0x100000001B3ULL +
                                                             std::uint64_t(k))) %
                std::uint64_t(E));
          else
            e = detail::next_best(E, row, e, eligible);
          if (e < 0) e = 0;  // unreachable for valid configs; keeps indices in range
          ids(t, k) = e;
          top_values(t, k) = deepseek && !random ? scores(t, e) : row(e);
        }
        if (deepseek) {
          Scalar sum = 0;
          for (int k = 0; k < K; ++k) sum += top_values(t, k);
          for (int k = 0; k < K; ++k) {
            Scalar w = top_values(t, k);
            if (ds_normalise) w = w / (sum + Scalar(1e-20));
            weights(t, k) = w * scaling;
          }
        } else {
          Scalar m, z;
          detail::softmax_norm(K, Kokkos::subview(top_values, t, Kokkos::ALL()), m, z);
          Scalar s = 0;
          for (int k = 0; k < K; ++k) {
            weights(t, k) = detail::exp(top_values(t, k) - m) / z;
            s += weights(t, k);
          }
          if (norm)
            for (int k = 0; k < K; ++k) weights(t, k) /= s;
        }
      });
}

/// \brief Capacity mask (MaxText's per-sequence capacity): in (s, k) order within a sequence, a
/// slot is kept iff its 1-based position in its expert's queue is <= capacity (< 0: keep all),
/// from counting cursors. `scratch` keeps buffers between calls (a new pool if omitted).
template <class ExecSpace, class MS, class Pool = moe::detail::ScratchPool<MS>>
void capacity_mask(ExecSpace const& space, View2<int const, MS> ids, std::int64_t seq_len,
                   std::int64_t capacity, int E, View2<int, MS> kept, Pool&& scratch = Pool()) {
  moe::detail::Region region("moe::routing::capacity_mask");
  std::int64_t const T = ids.extent(0), K = ids.extent(1);
  if (capacity < 0) {
    Kokkos::deep_copy(space, kept, 1);
    return;
  }
  std::int64_t const seg = seq_len * K;
  moe::detail::CountingShape const sh{T * K, seg,
                                      std::min(seg, moe::detail::counting_chunk<ExecSpace>(E)), E};
  std::int64_t const G = sh.segments(), C = sh.chunks_per_segment(), chunk = sh.chunk;
  auto cursor = scratch.template get<std::int64_t>("capacity_cursor", sh.cursors());
  auto base = scratch.template get<std::int64_t>("capacity_base", G * E);
  moe::detail::counting_cursors(space, ids, View2<int const, MS>(), sh, cursor);
  Kokkos::parallel_for(
      "moe::routing::capacity_base", Kokkos::RangePolicy<ExecSpace>(space, 0, G * E),
      KOKKOS_LAMBDA(std::int64_t i) { base(i) = cursor(sh.at(i / E, int(i % E), 0, C)); });
  Kokkos::parallel_for(
      "moe::routing::capacity_mask", Kokkos::RangePolicy<ExecSpace>(space, 0, G * C),
      KOKKOS_LAMBDA(std::int64_t gc) {
        std::int64_t const g = gc / C, c = gc % C;
        std::int64_t const begin = g * seg + c * chunk;
        std::int64_t const end = moe::detail::min(begin + chunk, (g + 1) * seg);
        for (std::int64_t s = begin; s < end; ++s) {
          int const e = ids(s / K, s % K);
          std::int64_t const pos = cursor(sh.at(g, e, c, C))++ - base(g * E + e);
          kept(s / K, s % K) = pos < capacity ? 1 : 0;
        }
      });
}

/// \brief Load-balance statistics: counts[b,e] = slots of sequence b on expert e, probs[b,e] = sum
/// over the sequence of softmax(biased); returns sum_b sum_e counts*probs (host). Integer atomics
/// and fixed-order column sums: the same result on every backend and thread count.
template <class ExecSpace, class Scalar, class MS, class Pool = moe::detail::ScratchPool<MS>>
double lb_statistics(ExecSpace const& space, View2<Scalar const, MS> biased,
                     View2<int const, MS> ids, std::int64_t seq_len, View2<std::int64_t, MS> counts,
                     View2<Scalar, MS> probs, Pool&& scratch = Pool()) {
  moe::detail::Region region("moe::routing::lb_statistics");
  std::int64_t const T = biased.extent(0), E = biased.extent(1), K = ids.extent(1);
  std::int64_t const B = T / seq_len;
  // Per token: max and normaliser of softmax(biased(t, :)).
  auto mz = scratch.template get<double>("lb_softmax", 2 * T);
  Kokkos::parallel_for(
      "moe::routing::lb_softmax", Kokkos::RangePolicy<ExecSpace>(space, 0, T),
      KOKKOS_LAMBDA(std::int64_t t) {
        Scalar m, z;
        detail::softmax_norm(E, Kokkos::subview(biased, t, Kokkos::ALL()), m, z);
        mz(2 * t) = double(m);
        mz(2 * t + 1) = double(z);
      });
  Kokkos::deep_copy(space, counts, 0);
  Kokkos::parallel_for(
      "moe::routing::lb_counts", Kokkos::RangePolicy<ExecSpace>(space, 0, T * K),
      KOKKOS_LAMBDA(std::int64_t s) {
        Kokkos::atomic_add(&counts(s / K / seq_len, ids(s / K, s % K)), std::int64_t(1));
      });
  auto softmax = KOKKOS_LAMBDA(std::int64_t t, int e) {
    return detail::exp(biased(t, e) - Scalar(mz(2 * t))) / Scalar(mz(2 * t + 1));
  };
  auto store = KOKKOS_LAMBDA(std::int64_t b, int e, double v) { probs(b, e) = Scalar(v); };
  std::int64_t const rows = std::min<std::int64_t>(256, seq_len);
  auto partial = scratch.template get<double>("lb_partial", B * ((seq_len + rows - 1) / rows) * E);
  moe::detail::segment_column_sums(space, T, int(E), seq_len, softmax, partial, store);
  auto per_seq = scratch.template get<double>("lb_per_seq", B);
  Kokkos::parallel_for(
      "moe::routing::lb_per_seq", Kokkos::RangePolicy<ExecSpace>(space, 0, B),
      KOKKOS_LAMBDA(std::int64_t b) {
        double acc = 0;
        for (std::int64_t e = 0; e < E; ++e) acc += double(counts(b, e)) * double(probs(b, e));
        per_seq(b) = acc;
      });
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), per_seq);
  double total = 0;  // fixed order: bitwise reproducible on every backend
  for (std::int64_t b = 0; b < B; ++b) total += h(b);
  return total;
}

/// \brief Selected slots per expert over all T*K slots (before capacity dropping).
template <class ExecSpace, class MS>
void expert_histogram(ExecSpace const& space, View2<int const, MS> ids,
                      View1<std::int64_t, MS> counts) {
  Kokkos::deep_copy(space, counts, 0);
  std::int64_t const K = ids.extent(1);
  Kokkos::parallel_for(
      "moe::routing::expert_histogram",
      Kokkos::RangePolicy<ExecSpace>(space, 0, std::int64_t(ids.extent(0)) * K),
      KOKKOS_LAMBDA(std::int64_t s) {
        Kokkos::atomic_add(&counts(ids(s / K, s % K)), std::int64_t(1));
      });
}

/// \brief Loss-free bias update: update[e] = sign(T*K/E - count[e]) * rate (host, exact).
inline std::vector<double> bias_update(std::vector<std::int64_t> const& counts,
                                       std::int64_t total_slots, double rate) {
  std::int64_t const E = std::int64_t(counts.size());
  std::vector<double> up(counts.size());
  for (std::int64_t e = 0; e < E; ++e) {
    // compare count*E with T*K exactly in integers: avg - count = (T*K - count*E) / E
    std::int64_t const diff = total_slots - counts[e] * E;
    up[e] = diff > 0 ? rate : diff < 0 ? -rate : 0.0;
  }
  return up;
}

/// \brief scores + bias -> biased ([T,E] + [E]).
template <class ExecSpace, class Scalar, class MS>
void add_bias(ExecSpace const& space, View2<Scalar const, MS> scores, View1<Scalar const, MS> bias,
              View2<Scalar, MS> biased) {
  std::int64_t const E = scores.extent(1);
  Kokkos::parallel_for(
      "moe::routing::add_bias",
      Kokkos::RangePolicy<ExecSpace>(space, 0, std::int64_t(scores.extent(0)) * E),
      KOKKOS_LAMBDA(std::int64_t i) { biased(i / E, i % E) = scores(i / E, i % E) + bias(i % E); });
}

}  // namespace moe::routing
