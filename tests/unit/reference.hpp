#pragma once
/// \file
/// A plain double-precision reference of the single-rank MoE layer, written for clarity straight
/// from SEMANTICS.md (std::vector, nested loops). It is the ground truth of the unit tests and
/// deliberately uses different algorithms than the library: the expert FFN is the DENSE
/// formulation of SEMANTICS §1.6 item 18 (every expert on every token, masked combine weights),
/// top-k is a stable sort, and gradients come from central finite differences.
///
/// Part 1 (namespace moe_ref) uses no Kokkos. Part 2 (namespace moe_ref::kk, at the end) is the
/// glue the tests use to move these std::vector tensors in and out of Kokkos views and layers.

#include <moe/config.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace moe_ref {

using Vec = std::vector<double>;
using Ids = std::vector<int>;
using moe::Activation;
using moe::DecoderBlock;
using moe::LayerConfig;
using moe::ScoreFunc;

// ================================================================================================
// Random inputs
// ================================================================================================

/// Deterministic uniform numbers. Every value is rounded to float so that a float and a double
/// layer see exactly the same inputs.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  double uniform(double lo, double hi) {
    double const u = double(gen() >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
    return double(float(lo + (hi - lo) * u));
  }
  Vec vec(std::size_t n, double lo, double hi) {
    Vec v(n);
    for (auto& e : v) e = uniform(lo, hi);
    return v;
  }
};

// ================================================================================================
// Elementwise functions
// ================================================================================================

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double softplus(double x) { return std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x))); }
inline double sqrtsoftplus(double x) { return std::sqrt(softplus(x)); }
inline double silu(double x) { return x * sigmoid(x); }
/// flax.linen.gelu default (approximate=True): the tanh approximation.
inline double gelu_tanh(double x) {
  double const c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
inline double activation(Activation a, double x) {
  return a == Activation::Silu ? silu(x) : gelu_tanh(x);
}

inline Vec softmax(Vec const& v) {
  double m = -std::numeric_limits<double>::infinity();
  for (double e : v) m = std::max(m, e);
  Vec out(v.size());
  double z = 0;
  for (std::size_t i = 0; i < v.size(); ++i) z += (out[i] = std::exp(v[i] - m));
  for (auto& e : out) e /= z;
  return out;
}

/// Score function of the gate (SEMANTICS §1.2 item 4), applied to one token's E logits.
inline Vec apply_score(ScoreFunc f, Vec const& logits) {
  if (f == ScoreFunc::Softmax) return softmax(logits);
  Vec out(logits.size());
  for (std::size_t e = 0; e < logits.size(); ++e) {
    double const l = logits[e];
    out[e] = f == ScoreFunc::Sigmoid        ? sigmoid(l)
             : f == ScoreFunc::SqrtSoftplus ? sqrtsoftplus(l)
                                            : l;
  }
  return out;
}

// ================================================================================================
// Top-k selection (SEMANTICS §1.3)
// ================================================================================================

/// The K largest values' indices, largest first, ties to the lower index (lax.top_k). Only the
/// indices with allowed[i] (all when `allowed` is empty) are candidates.
inline Ids top_k(Vec const& v, int K, std::vector<bool> const& allowed = {}) {
  Ids order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  Ids out;
  for (int i : order)
    if (int(out.size()) < K && (allowed.empty() || allowed[i])) out.push_back(i);
  return out;
}

/// DeepSeek group-limited routing (item 7): group score = sum of the group's top-2 scores; the
/// `keep` best groups stay eligible, every expert of another group is excluded.
inline std::vector<bool> group_mask(Vec const& biased, int groups, int keep) {
  int const E = int(biased.size()), gs = E / groups;
  Vec gscore(groups, 0.0);
  for (int g = 0; g < groups; ++g) {
    Vec members(biased.begin() + g * gs, biased.begin() + (g + 1) * gs);
    for (int i : top_k(members, std::min(2, gs))) gscore[g] += members[i];
  }
  std::vector<bool> allowed(E, false);
  for (int g : top_k(gscore, keep))
    for (int e = g * gs; e < (g + 1) * gs; ++e) allowed[e] = true;
  return allowed;
}

/// One token's routing decision.
struct TokenRoute {
  Ids ids;         ///< [K]
  Vec top_values;  ///< [K] selected values before post-processing
  Vec weights;     ///< [K] combine weights
};

/// Weight post-processing (item 10) of the K selected values.
inline Vec post_process(LayerConfig const& cfg, Vec const& values) {
  Vec w = values;
  if (cfg.decoder_block == DecoderBlock::DeepSeek) {
    if (cfg.routed_score_func == ScoreFunc::Sigmoid ||
        cfg.routed_score_func == ScoreFunc::SqrtSoftplus) {
      double sum = 0;
      for (double v : values) sum += v;
      for (auto& e : w) e = e / (sum + 1e-20);
    }
    for (auto& e : w) e *= cfg.routed_scaling_factor;
  } else {
    w = softmax(values);
    if (cfg.norm_topk_prob) {
      double sum = 0;
      for (double v : w) sum += v;
      for (auto& e : w) e /= sum;
    }
  }
  return w;
}

/// Routes one token from its pre-bias scores and biased scores (scores + bias). `given` (random
/// routing: the layer's own draws) replaces the selection; the weights are then the biased gate
/// output gathered at those indices (item 5).
inline TokenRoute route_token(LayerConfig const& cfg, Vec const& scores, Vec const& biased,
                              int const* given = nullptr) {
  int const K = cfg.num_experts_per_tok;
  bool const deepseek = cfg.decoder_block == DecoderBlock::DeepSeek;
  TokenRoute r;
  if (given) {
    r.ids.assign(given, given + K);
    for (int e : r.ids) r.top_values.push_back(biased[e]);
  } else if (deepseek) {
    std::vector<bool> allowed;
    if (cfg.n_routing_groups != -1)
      allowed = group_mask(biased, cfg.n_routing_groups, cfg.topk_routing_group);
    r.ids = top_k(biased, K, allowed);                      // selection on biased scores
    for (int e : r.ids) r.top_values.push_back(scores[e]);  // weights from pre-bias scores
  } else {
    r.ids = top_k(biased, K);
    for (int e : r.ids) r.top_values.push_back(biased[e]);
  }
  r.weights = post_process(cfg, r.top_values);
  return r;
}

// ================================================================================================
// Capacity, load-balance loss, loss-free bias update (SEMANTICS §1.4, §1.6)
// ================================================================================================

/// C = int(max(ceil(S*K/E) * cf, cf)); -1 (no dropping) when capacity_factor <= 0.
inline std::int64_t capacity(LayerConfig const& cfg, std::int64_t S) {
  if (cfg.capacity_factor <= 0) return -1;
  double const cf = cfg.capacity_factor;
  double const base = std::ceil(double(S * cfg.num_experts_per_tok) / cfg.num_experts);
  return std::int64_t(std::max(base * cf, cf));
}

/// Per sequence, slots in (s, k) order get 1-based positions in their expert's queue; a slot is
/// kept iff C < 0 or position <= C. ids/kept/position are [B*S*K].
inline void capacity_masks(Ids const& ids, int B, int S, int K, int E, std::int64_t C, Ids& kept,
                           Ids& position) {
  kept.assign(ids.size(), 0);
  position.assign(ids.size(), 0);
  for (int b = 0; b < B; ++b) {
    std::vector<int> queue(E, 0);
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < K; ++k) {
        std::size_t const slot = (std::size_t(b) * S + s) * K + k;
        int const pos = ++queue[ids[slot]];
        position[slot] = pos;
        kept[slot] = (C < 0 || pos <= C) ? 1 : 0;
      }
  }
}

/// Switch-style load-balance loss (item 11) over B sequences of length S:
/// f[b,e] = mean_s (#slots of token s on e), P[b,e] = mean_s softmax(biased[b,s,:])[e],
/// lb = mean_{b,e}(f*P) * E^2 * weight. 0 when the weight is 0.
inline double load_balance_loss(LayerConfig const& cfg, Vec const& biased, Ids const& ids, int B,
                                int S) {
  if (cfg.load_balance_loss_weight <= 0) return 0.0;
  int const E = cfg.num_experts, K = cfg.num_experts_per_tok;
  double total = 0;
  for (int b = 0; b < B; ++b) {
    Vec f(E, 0.0), P(E, 0.0);
    for (int s = 0; s < S; ++s) {
      std::size_t const t = std::size_t(b) * S + s;
      for (int k = 0; k < K; ++k) f[ids[t * K + k]] += 1.0 / S;
      Vec const p = softmax(Vec(biased.begin() + t * E, biased.begin() + (t + 1) * E));
      for (int e = 0; e < E; ++e) P[e] += p[e] / S;
    }
    for (int e = 0; e < E; ++e) total += f[e] * P[e];
  }
  double const mean = total / (double(B) * E);
  return mean * double(E) * E * cfg.load_balance_loss_weight;
}

/// Loss-free bias balancing (item 13): update[e] = sign(T*K/E - count[e]) * rate. Empty when the
/// rate is 0.
inline Vec bias_update(LayerConfig const& cfg, Ids const& ids) {
  if (cfg.routed_bias_update_rate <= 0) return {};
  int const E = cfg.num_experts;
  Vec count(E, 0.0);
  for (int e : ids) count[e] += 1;
  double const avg = double(ids.size()) / E;
  Vec up(E);
  for (int e = 0; e < E; ++e) {
    double const d = avg - count[e];
    up[e] = (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0) * cfg.routed_bias_update_rate;
  }
  return up;
}

// ================================================================================================
// Parameters and the whole layer
// ================================================================================================

/// The layer's trainable tensors in MaxText layouts (row-major, flattened).
struct Params {
  Vec gate;                      ///< [D,E]
  Vec gate_bias;                 ///< [E] (empty unless routed_bias)
  Vec wi_0, wi_1;                ///< [E,D,F]
  Vec wo;                        ///< [E,F,D]
  Vec shared_wi_0, shared_wi_1;  ///< [D,Fs] (empty unless shared_experts > 0)
  Vec shared_wo;                 ///< [Fs,D]

  /// f(name, tensor) for every non-empty tensor, in the library's Parameters::for_each order.
  template <class Fn>
  void for_each(Fn&& f) {
    f("gate", gate);
    if (!gate_bias.empty()) f("gate_bias", gate_bias);
    f("wi_0", wi_0);
    f("wi_1", wi_1);
    f("wo", wo);
    if (!shared_wo.empty()) {
      f("shared_wi_0", shared_wi_0);
      f("shared_wi_1", shared_wi_1);
      f("shared_wo", shared_wo);
    }
  }
  template <class Fn>
  void for_each(Fn&& f) const {
    const_cast<Params*>(this)->for_each([&](char const* n, Vec& v) { f(n, (Vec const&)v); });
  }

  /// Zero tensors of the shapes `cfg` asks for.
  static Params zeros(LayerConfig const& cfg) {
    std::size_t const D = cfg.base_emb_dim, E = cfg.num_experts, F = cfg.base_moe_mlp_dim;
    std::size_t const Fs = cfg.shared_mlp_dim();
    Params p;
    p.gate.assign(D * E, 0.0);
    if (cfg.routed_bias) p.gate_bias.assign(E, 0.0);
    p.wi_0.assign(E * D * F, 0.0);
    p.wi_1.assign(E * D * F, 0.0);
    p.wo.assign(E * F * D, 0.0);
    if (Fs > 0) {
      p.shared_wi_0.assign(D * Fs, 0.0);
      p.shared_wi_1.assign(D * Fs, 0.0);
      p.shared_wo.assign(Fs * D, 0.0);
    }
    return p;
  }

  /// Random parameters: gate logits O(gate_scale), FFN layers scaled by 1/sqrt(fan-in).
  static Params random(LayerConfig const& cfg, Rng& rng, double gate_scale = 1.0) {
    Params p = zeros(cfg);
    double const D = cfg.base_emb_dim, F = cfg.base_moe_mlp_dim;
    double const Fs = std::max(1, cfg.shared_mlp_dim());
    auto fill = [&](Vec& v, double a) {
      for (auto& e : v) e = rng.uniform(-a, a);
    };
    fill(p.gate, gate_scale * 1.7 / std::sqrt(D));
    fill(p.gate_bias, 0.3);
    fill(p.wi_0, 1.7 / std::sqrt(D));
    fill(p.wi_1, 1.7 / std::sqrt(D));
    fill(p.wo, 1.7 / std::sqrt(F));
    fill(p.shared_wi_0, 1.7 / std::sqrt(D));
    fill(p.shared_wi_1, 1.7 / std::sqrt(D));
    fill(p.shared_wo, 1.7 / std::sqrt(Fs));
    return p;
  }
};

/// Everything routing decides for T = B*S tokens (row-major [T,E] and [T,K]).
struct Routing {
  Vec logits, scores, biased;  ///< [T,E]
  Ids ids;                     ///< [T,K]
  Vec top_values, weights;     ///< [T,K]
  Ids kept, position;          ///< [T,K] capacity mask and 1-based queue position
  std::int64_t capacity = -1;  ///< C, -1 without dropping
  double lb_loss = 0;
  Vec bias_update;  ///< [E], empty unless routed_bias_update_rate > 0
};

/// Routing of x[B,S,D]. `given_ids` ([T,K], random routing) replaces the selection.
inline Routing route(LayerConfig const& cfg, Params const& p, Vec const& x, int B, int S,
                     Ids const* given_ids = nullptr) {
  int const D = cfg.base_emb_dim, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  int const T = B * S;
  Routing r;
  r.logits.assign(std::size_t(T) * E, 0.0);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      for (int d = 0; d < D; ++d) r.logits[t * E + e] += x[t * D + d] * p.gate[d * E + e];
  r.scores.resize(r.logits.size());
  r.biased.resize(r.logits.size());
  for (int t = 0; t < T; ++t) {
    Vec const s = apply_score(cfg.routed_score_func,
                              Vec(r.logits.begin() + t * E, r.logits.begin() + (t + 1) * E));
    for (int e = 0; e < E; ++e) {
      r.scores[t * E + e] = s[e];
      r.biased[t * E + e] = s[e] + (cfg.routed_bias ? p.gate_bias[e] : 0.0);
    }
  }
  for (int t = 0; t < T; ++t) {
    Vec const s(r.scores.begin() + t * E, r.scores.begin() + (t + 1) * E);
    Vec const bs(r.biased.begin() + t * E, r.biased.begin() + (t + 1) * E);
    TokenRoute const tr = route_token(cfg, s, bs, given_ids ? given_ids->data() + t * K : nullptr);
    r.ids.insert(r.ids.end(), tr.ids.begin(), tr.ids.end());
    r.top_values.insert(r.top_values.end(), tr.top_values.begin(), tr.top_values.end());
    r.weights.insert(r.weights.end(), tr.weights.begin(), tr.weights.end());
  }
  r.capacity = capacity(cfg, S);
  capacity_masks(r.ids, B, S, K, E, r.capacity, r.kept, r.position);
  r.lb_loss = load_balance_loss(cfg, r.biased, r.ids, B, S);
  r.bias_update = bias_update(cfg, r.ids);
  return r;
}

/// Gated FFN of one row: y = (act(x W0) * (x W1)) Wo with W0, W1 [D,H] and Wo [H,D].
inline Vec ffn(Activation act, double const* x, double const* w0, double const* w1,
               double const* wo, int D, int H) {
  Vec y(D, 0.0);
  for (int h = 0; h < H; ++h) {
    double g = 0, u = 0;
    for (int d = 0; d < D; ++d) {
      g += x[d] * w0[d * H + h];
      u += x[d] * w1[d * H + h];
    }
    double const a = activation(act, g) * u;
    for (int d = 0; d < D; ++d) y[d] += a * wo[h * D + d];
  }
  return y;
}

/// Output of the whole layer.
struct Output {
  Routing r;
  Vec y;  ///< [B,S,D]
};

/// The layer, DENSE formulation: out[t] = sum_e w_dense[t,e] * FFN_e(x[t]) over every expert,
/// w_dense[t,e] = sum_k [ids[t,k]==e] * kept[t,k] * w[t,k]; plus the shared expert.
inline Output forward(LayerConfig const& cfg, Params const& p, Vec const& x, int B, int S,
                      Ids const* given_ids = nullptr) {
  int const D = cfg.base_emb_dim, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  int const F = cfg.base_moe_mlp_dim, Fs = cfg.shared_mlp_dim();
  int const T = B * S;
  Output o;
  o.r = route(cfg, p, x, B, S, given_ids);
  o.y.assign(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t) {
    Vec wd(E, 0.0);
    for (int k = 0; k < K; ++k)
      if (o.r.kept[t * K + k]) wd[o.r.ids[t * K + k]] += o.r.weights[t * K + k];
    double const* xt = x.data() + std::size_t(t) * D;
    for (int e = 0; e < E; ++e) {
      std::size_t const in = std::size_t(e) * D * F, out = std::size_t(e) * F * D;
      Vec const ye = ffn(cfg.mlp_activation, xt, p.wi_0.data() + in, p.wi_1.data() + in,
                         p.wo.data() + out, D, F);
      for (int d = 0; d < D; ++d) o.y[t * D + d] += wd[e] * ye[d];
    }
    if (Fs > 0) {
      Vec const ys = ffn(cfg.mlp_activation, xt, p.shared_wi_0.data(), p.shared_wi_1.data(),
                         p.shared_wo.data(), D, Fs);
      for (int d = 0; d < D; ++d) o.y[t * D + d] += ys[d];
    }
  }
  return o;
}

/// The training objective whose gradients the layer's backward returns: sum(y * dy) + lb_loss.
inline double loss(LayerConfig const& cfg, Params const& p, Vec const& x, Vec const& dy, int B,
                   int S, Ids const* given_ids = nullptr) {
  Output const o = forward(cfg, p, x, B, S, given_ids);
  double l = o.r.lb_loss;
  for (std::size_t i = 0; i < o.y.size(); ++i) l += o.y[i] * dy[i];
  return l;
}

/// Gradients of loss() w.r.t. x and every parameter.
struct Gradients {
  Vec dx;
  Params dp;
};

/// Central finite differences with a relative step `rel` (h = rel * max(1, |v|)). Routing
/// decisions are piecewise constant, so the step must not cross a tie: fine for random inputs.
inline Gradients finite_differences(LayerConfig const& cfg, Params const& p, Vec const& x,
                                    Vec const& dy, int B, int S, Ids const* given_ids = nullptr,
                                    double rel = 1e-6) {
  Params pp = p;
  Vec xx = x;
  auto L = [&] { return loss(cfg, pp, xx, dy, B, S, given_ids); };
  auto diff = [&](Vec& v) {
    Vec g(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      double const v0 = v[i], h = rel * std::max(1.0, std::fabs(v0));
      double const vp = v0 + h, vm = v0 - h;
      v[i] = vp;
      double const lp = L();
      v[i] = vm;
      double const lm = L();
      v[i] = v0;
      g[i] = (lp - lm) / (vp - vm);
    }
    return g;
  };
  Gradients g;
  g.dp = Params::zeros(cfg);
  g.dx = diff(xx);
  pp.for_each([&](char const* name, Vec& v) {
    Vec const gv = diff(v);
    g.dp.for_each([&](char const* n2, Vec& out) {
      if (std::string(n2) == name) out = gv;
    });
  });
  return g;
}

}  // namespace moe_ref

// ================================================================================================
// Part 2: glue between the reference's vectors and Kokkos views / the library's layer.
// ================================================================================================

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>
#include <moe/layer.hpp>

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace moe_ref::kk {

/// Forces gmm::OneDnn into one of its two modes while alive, whatever this CPU's oneDNN would
/// choose: packed weights (reordered, cached, run on checked matmul or convolution kernels; a
/// chunk size without a direct kernel runs as sgemm) or plain (sgemm on the weights in place).
/// Both paths then run on every CPU. A no-op without oneDNN.
struct ForceOneDnnMode {
  explicit ForceOneDnnMode(bool packed) { set(packed ? 2 : 1); }
  ~ForceOneDnnMode() { set(0); }
  ForceOneDnnMode(ForceOneDnnMode const&) = delete;
  ForceOneDnnMode& operator=(ForceOneDnnMode const&) = delete;
  static void set([[maybe_unused]] int mode) {
#if MOE_HAS_ONEDNN
    using M = moe::detail::onednn::Forced::Mode;
    moe::detail::onednn::forced().mode = mode == 2 ? M::packed : mode == 1 ? M::plain : M::chosen;
#endif
  }
};
struct ForcePackedOneDnn : ForceOneDnnMode {
  ForcePackedOneDnn() : ForceOneDnnMode(true) {}
};
struct ForcePlainOneDnn : ForceOneDnnMode {
  ForcePlainOneDnn() : ForceOneDnnMode(false) {}
};

/// Sets the OpenMP thread count (oneDNN's pool and the OneDnn backend's side-by-side calls) for
/// a scope, so a test runs its parallel paths whatever OMP_NUM_THREADS says (no-op without
/// oneDNN, whose builds are the ones with OpenMP).
#if MOE_HAS_ONEDNN
using ScopedThreads = moe::detail::onednn::ScopedThreads;
#else
struct ScopedThreads {
  explicit ScopedThreads(int) {}
};
#endif

using MS = Kokkos::DefaultExecutionSpace::memory_space;

/// Copies a host vector (converted to T) into a new view of the given extents.
template <class ViewT, class V, class... N>
ViewT to_view(V const& v, N... n) {
  ViewT out("moe_ref::view", std::size_t(n)...);
  auto h = Kokkos::create_mirror_view(out);
  using T = typename ViewT::non_const_value_type;
  for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = T(v[i]);
  Kokkos::deep_copy(out, h);
  return out;
}

/// Copies a host vector into an existing view (extents must hold v.size() elements).
template <class ViewT, class V>
void fill_view(ViewT const& out, V const& v) {
  auto h = Kokkos::create_mirror_view(out);
  using T = typename ViewT::non_const_value_type;
  for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = T(v[i]);
  Kokkos::deep_copy(out, h);
}

/// All elements of a contiguous view as doubles (row-major).
template <class ViewT>
Vec to_vec(ViewT const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  Vec out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = double(h.data()[i]);
  return out;
}

/// All elements of an integer view.
template <class ViewT>
Ids to_ids(ViewT const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  Ids out(h.span());
  for (std::size_t i = 0; i < h.span(); ++i) out[i] = int(h.data()[i]);
  return out;
}

/// Norm-wise comparison: max_i |a_i - b_i| <= rtol * max_i |b_i| + atol, and no NaN anywhere.
/// Reports the worst entry. With MOE_REF_VERBOSE set in the environment every comparison prints
/// its worst error relative to the tolerance (to see how much margin a tolerance leaves).
inline ::testing::AssertionResult close(Vec const& a, Vec const& b, double rtol, double atol = 0) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  double scale = 0, worst = 0;
  std::size_t wi = 0;
  for (std::size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::fabs(b[i]));
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i]))
      return ::testing::AssertionFailure() << "NaN at [" << i << "]: " << a[i] << " vs " << b[i];
    double const d = std::fabs(a[i] - b[i]);
    if (d > worst) {
      worst = d;
      wi = i;
    }
  }
  double const tol = rtol * scale + atol;
  if (std::getenv("MOE_REF_VERBOSE"))
    std::printf("close: rtol %.3g worst %.3g tol %.3g ratio %.3g\n", rtol, worst, tol,
                tol > 0 ? worst / tol : 0.0);
  if (worst <= tol) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(17);
  os << "max |diff| = " << worst << " at [" << wi << "]: " << a[wi] << " vs " << b[wi]
     << " (tolerance " << tol << " = " << rtol << " * max|ref| " << scale << " + " << atol << ")";
  return ::testing::AssertionFailure() << os.str();
}

/// What one library forward (+ optional backward) produced, converted to doubles.
struct LayerRun {
  Vec y;
  Ids ids, kept;
  Vec weights;
  double lb_loss = 0;
  std::vector<double> bias_update;
  std::int64_t routed_rows = 0;
  bool has_grads = false;
  Vec dx;
  Params grads;
};

/// Copies reference parameters into a layer's parameter views (by name).
template <class LayerT>
void load_params(LayerT& layer, Params const& p) {
  layer.parameters().for_each([&](char const* name, auto const& view) {
    bool found = false;
    p.for_each([&](char const* n2, Vec const& v) {
      if (std::string(n2) == name) {
        EXPECT_EQ(v.size(), view.span()) << name;
        if (v.size() == view.span()) fill_view(view, v);
        found = true;
      }
    });
    EXPECT_TRUE(found) << "reference has no tensor " << name;
  });
}

/// Runs MoeLayer<Scalar, Policy> on (params, x[B,S,D]); with a non-empty dy also the backward.
template <class Scalar, class Policy>
LayerRun run_layer(LayerConfig const& cfg, Params const& p, Vec const& x, int B, int S,
                   Vec const& dy = {}) {
  using Layer = moe::MoeLayer<Scalar, Policy>;
  using V3 = moe::View3<Scalar, MS>;
  int const D = cfg.base_emb_dim;
  Layer layer(cfg);
  load_params(layer, p);
  auto xv = to_view<V3>(x, B, S, D);
  V3 yv("moe_ref::y", B, S, D);
  layer.forward(xv, yv);
  LayerRun r;
  r.y = to_vec(yv);
  r.ids = to_ids(layer.expert_ids());
  r.kept = to_ids(layer.kept());
  r.weights = to_vec(layer.weights());
  r.lb_loss = layer.lb_loss();
  r.bias_update = layer.bias_update();
  r.routed_rows = layer.routed_rows();
  if (!dy.empty()) {
    auto dyv = to_view<V3>(dy, B, S, D);
    V3 dxv("moe_ref::dx", B, S, D);
    typename Layer::params_type g;
    layer.backward(dyv, dxv, g);
    r.has_grads = true;
    r.dx = to_vec(dxv);
    r.grads = Params::zeros(cfg);
    g.for_each([&](char const* name, auto const& view) {
      r.grads.for_each([&](char const* n2, Vec& out) {
        if (std::string(n2) == name) out = to_vec(view);
      });
    });
  }
  return r;
}

}  // namespace moe_ref::kk
