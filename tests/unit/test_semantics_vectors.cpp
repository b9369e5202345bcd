// The exact test vectors of SEMANTICS.md §7.1-7.3 (facts from MaxText's own tests): capacity
// masks, DeepSeek group-limited routing, loss-free bias update. Each is checked on the routing
// kernels directly, on the reference, and through the whole layer where a gate can be built
// that reproduces the routing (x = one-hot rows, so the gate logits of token t are gate row t).
#include "reference.hpp"

#include <moe/layer.hpp>
#include <moe/routing/router.hpp>

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <vector>

namespace {

using namespace moe_ref;
using moe_ref::kk::close;
using moe_ref::kk::run_layer;
using moe_ref::kk::to_ids;
using moe_ref::kk::to_vec;
using moe_ref::kk::to_view;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
template <class S>
using V2 = moe::View2<S, MS>;
template <class S>
using C2 = moe::View2<S const, MS>;

using PolVendor = moe::Policies<moe::routing::Auto, moe::gmm::Vendor>;
using PolTiled = moe::Policies<moe::routing::Auto, moe::gmm::Tiled<4, 8, 4>>;
using PolDense = moe::Policies<moe::routing::Auto, moe::gmm::Dense>;

// ---- §7.1 capacity masks: E=8, K=2, B=4, S=4, capacity_factor=2 -> C=2 ------------------------

constexpr int kB = 4, kS = 4, kK = 2, kE = 8;

// top-k indices [b][s] = (k0, k1)
constexpr int kIds[kB][kS][kK] = {{{0, 5}, {0, 4}, {1, 0}, {3, 5}},
                                  {{1, 2}, {4, 1}, {5, 0}, {7, 1}},
                                  {{6, 2}, {2, 3}, {4, 2}, {1, 2}},
                                  {{4, 1}, {0, 7}, {5, 0}, {4, 7}}};

// probability of each token's two experts, expert:value
std::map<int, double> probs(int b, int s) {
  static std::map<int, double> const p[kB][kS] = {
      {{{0, .20}, {5, .80}}, {{0, .68}, {4, .32}}, {{0, .22}, {1, .78}}, {{3, .32}, {5, .68}}},
      {{{1, .26}, {2, .74}}, {{1, .79}, {4, .21}}, {{0, .89}, {5, .11}}, {{1, .11}, {7, .89}}},
      {{{2, .26}, {6, .74}}, {{2, .88}, {3, .12}}, {{2, .17}, {4, .83}}, {{1, .35}, {2, .65}}},
      {{{1, .47}, {4, .53}}, {{0, .36}, {7, .64}}, {{0, .15}, {5, .85}}, {{4, .18}, {7, .82}}}};
  return p[b][s];
}

using BSE = std::tuple<int, int, int>;
std::set<BSE> const kDropped = {{0, 2, 0}, {1, 3, 1}, {2, 2, 2}, {2, 3, 2}};
// kept slots at capacity position c = 1 (all other kept slots sit at c = 0)
std::set<BSE> const kSecond = {{0, 1, 0}, {0, 3, 5}, {1, 1, 1}, {2, 1, 2},
                               {3, 2, 0}, {3, 3, 4}, {3, 3, 7}};

Ids vector_ids() {
  Ids ids;
  for (int b = 0; b < kB; ++b)
    for (int s = 0; s < kS; ++s)
      for (int k = 0; k < kK; ++k) ids.push_back(kIds[b][s][k]);
  return ids;
}

LayerConfig capacity_config() {
  LayerConfig cfg;
  cfg.num_experts = kE;
  cfg.num_experts_per_tok = kK;
  cfg.capacity_factor = 2.0;
  return cfg;
}

/// (b, s, e) of every slot whose kept flag is 0.
std::set<BSE> dropped_of(Ids const& ids, Ids const& kept) {
  std::set<BSE> out;
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (!kept[i]) out.insert({int(i / kK) / kS, int(i / kK) % kS, ids[i]});
  return out;
}

TEST(Semantics71, CapacityIsTwo) {
  EXPECT_EQ(capacity_config().capacity(kS), 2);
  EXPECT_EQ(capacity(capacity_config(), kS), 2);
}

TEST(Semantics71, CapacityMaskDropsExactlyTheFourSlots) {
  Ids const ids = vector_ids();
  auto idv = to_view<V2<int>>(ids, kB * kS, kK);
  V2<int> kept("kept", kB * kS, kK);
  moe::routing::capacity_mask(Exec(), C2<int>(idv), kS, capacity_config().capacity(kS), kE, kept);
  Ids const k = to_ids(kept);
  int n_dropped = 0;
  for (int v : k) n_dropped += 1 - v;
  EXPECT_EQ(n_dropped, 4);
  EXPECT_EQ(dropped_of(ids, k), kDropped);
}

TEST(Semantics71, ReferenceCombineTensor) {
  // combine[b,s,e,c] = prob * kept * [position - 1 == c]; dispatch = combine != 0.
  Ids const ids = vector_ids();
  Ids kept, pos;
  capacity_masks(ids, kB, kS, kK, kE, 2, kept, pos);
  EXPECT_EQ(dropped_of(ids, kept), kDropped);
  int const C = 2;
  std::vector<double> combine(std::size_t(kB) * kS * kE * C, 0.0), expected(combine.size(), 0.0);
  auto at = [&](int b, int s, int e, int c) {
    return ((std::size_t(b) * kS + s) * kE + e) * C + c;
  };
  for (int b = 0; b < kB; ++b)
    for (int s = 0; s < kS; ++s)
      for (int k = 0; k < kK; ++k) {
        std::size_t const slot = (std::size_t(b) * kS + s) * kK + k;
        int const e = ids[slot];
        if (kept[slot]) combine[at(b, s, e, pos[slot] - 1)] = probs(b, s).at(e);
        // the golden, written from §7.1's lists
        if (!kDropped.count({b, s, e}))
          expected[at(b, s, e, kSecond.count({b, s, e}) ? 1 : 0)] = probs(b, s).at(e);
      }
  EXPECT_EQ(combine, expected);
  int nonzero = 0;
  for (double v : combine) nonzero += v != 0;
  EXPECT_EQ(nonzero, kB * kS * kK - 4);
}

/// A layer whose routing reproduces §7.1: D = T = 16, x[t] = one-hot(t), gate[t, e] = log(p) for
/// the token's two experts and -30 elsewhere, so softmax over the top 2 gives back p.
template <class Scalar, class Policy>
void check_capacity_layer(bool sparse) {
  SCOPED_TRACE(::testing::Message() << (std::is_same_v<Scalar, float> ? "float" : "double")
                                    << (sparse ? "" : " sparse_matmul=false"));
  int const T = kB * kS, D = T, F = 3;
  LayerConfig cfg = capacity_config();
  cfg.base_emb_dim = D;
  cfg.base_moe_mlp_dim = F;
  cfg.sparse_matmul = sparse;
  Rng rng(71);
  Params p = Params::random(cfg, rng);
  Vec x(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t) {
    x[t * D + t] = 1.0;
    for (int e = 0; e < kE; ++e) p.gate[t * kE + e] = -30.0;
    for (auto const& [e, pr] : probs(t / kS, t % kS)) p.gate[t * kE + e] = std::log(pr);
  }
  auto const run = run_layer<Scalar, Policy>(cfg, p, x, kB, kS);
  Ids const ids = run.ids;
  // the layer picked each token's two experts (in descending probability order)
  for (int t = 0; t < T; ++t) {
    std::set<int> got = {ids[t * kK], ids[t * kK + 1]};
    std::set<int> want = {kIds[t / kS][t % kS][0], kIds[t / kS][t % kS][1]};
    EXPECT_EQ(got, want) << "token " << t;
  }
  EXPECT_EQ(dropped_of(ids, run.kept), kDropped);
  // y[t] = sum over the token's kept experts of p * FFN_e(x[t])
  Vec y(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t)
    for (auto const& [e, pr] : probs(t / kS, t % kS)) {
      if (kDropped.count({t / kS, t % kS, e})) continue;
      std::size_t const in = std::size_t(e) * D * F, out = std::size_t(e) * F * D;
      Vec const ye = ffn(cfg.mlp_activation, x.data() + t * D, p.wi_0.data() + in,
                         p.wi_1.data() + in, p.wo.data() + out, D, F);
      for (int d = 0; d < D; ++d) y[t * D + d] += pr * ye[d];
    }
  double const tol = std::is_same_v<Scalar, float> ? 2e-6 : 1e-13;
  EXPECT_TRUE(close(run.y, y, tol, tol)) << "layer output";
  // and the reference (its own routing from the same gate) agrees
  Output const ref = forward(cfg, p, x, kB, kS);
  EXPECT_EQ(dropped_of(ref.r.ids, ref.r.kept), kDropped);
  EXPECT_TRUE(close(ref.y, y, 1e-14, 1e-14)) << "reference output";
}

TEST(Semantics71, WholeLayerDropsTheFourSlots) {
  check_capacity_layer<double, PolVendor>(true);
  check_capacity_layer<double, PolTiled>(true);
  check_capacity_layer<double, PolDense>(true);
  check_capacity_layer<double, PolVendor>(false);
  check_capacity_layer<float, PolVendor>(true);
  check_capacity_layer<float, PolTiled>(true);
  check_capacity_layer<float, PolVendor>(false);
}

// ---- §7.2 group-limited routing: E=16, 4 groups of 4, keep 2 groups, K=4 ----------------------

constexpr int kE2 = 16, kK2 = 4;
std::array<double, 2 * kE2> const kScores = {
    0.20, 0.10, 0.05, 0.10, 0.10, 0.60, 0.30, 0.10, 0.80, 0.01, 0.01, 0.01, 0.05, 0.80, 0.20, 0.10,
    0.68, 0.20, 0.06, 0.03, 0.32, 0.10, 0.05, 0.02, 0.65, 0.20, 0.04, 0.01, 0.32, 0.10, 0.05, 0.02};
Ids const kExpected72 = {13, 5, 6, 14, 0, 8, 1, 9};

LayerConfig group_config(ScoreFunc f, double scaling) {
  LayerConfig cfg;
  cfg.decoder_block = DecoderBlock::DeepSeek;
  cfg.num_experts = kE2;
  cfg.num_experts_per_tok = kK2;
  cfg.n_routing_groups = 4;
  cfg.topk_routing_group = 2;
  cfg.routed_score_func = f;
  cfg.routed_bias = true;
  cfg.routed_scaling_factor = scaling;
  return cfg;
}

template <class Scalar>
void check_group_topk(ScoreFunc f, double scaling) {
  SCOPED_TRACE(::testing::Message() << (std::is_same_v<Scalar, float> ? "float" : "double")
                                    << " score func " << int(f) << " scaling " << scaling);
  LayerConfig const cfg = group_config(f, scaling);
  // biased = the given scores; pre-bias = scores - 0.5 (computed in Scalar)
  Vec biased(kScores.begin(), kScores.end()), pre(biased.size());
  for (std::size_t i = 0; i < pre.size(); ++i) pre[i] = double(Scalar(biased[i]) - Scalar(0.5));
  auto bv = to_view<V2<Scalar>>(biased, 2, kE2);
  auto sv = to_view<V2<Scalar>>(pre, 2, kE2);
  V2<int> ids("ids", 2, kK2);
  V2<Scalar> top("top", 2, kK2), w("w", 2, kK2);
  moe::routing::RouteParams const rp(cfg, moe::routing::resolve(moe::routing::DeepSeek{}, cfg));
  moe::routing::select_topk(Exec(), rp, 0, C2<Scalar>(sv), C2<Scalar>(bv), ids, top, w);
  EXPECT_EQ(to_ids(ids), kExpected72);
  Vec want_top;
  for (int i = 0; i < 2 * kK2; ++i) want_top.push_back(pre[(i / kK2) * kE2 + kExpected72[i]]);
  EXPECT_EQ(to_vec(top), want_top) << "weights before post-processing = pre-bias scores";
  // post-processing: sigmoid/sqrtsoftplus normalise (+1e-20), then scale
  Vec want_w;
  for (int t = 0; t < 2; ++t) {
    Vec const v(want_top.begin() + t * kK2, want_top.begin() + (t + 1) * kK2);
    Vec const pw = post_process(cfg, v);
    want_w.insert(want_w.end(), pw.begin(), pw.end());
  }
  double const tol = std::is_same_v<Scalar, float> ? 1e-6 : 1e-14;
  EXPECT_TRUE(close(to_vec(w), want_w, tol, tol)) << "weights";
  // the reference's group-limited routing gives the same vectors
  for (int t = 0; t < 2; ++t) {
    TokenRoute const r = route_token(cfg, Vec(pre.begin() + t * kE2, pre.begin() + (t + 1) * kE2),
                                     Vec(biased.begin() + t * kE2, biased.begin() + (t + 1) * kE2));
    EXPECT_EQ(r.ids, Ids(kExpected72.begin() + t * kK2, kExpected72.begin() + (t + 1) * kK2));
  }
}

TEST(Semantics72, GroupLimitedTopK) {
  check_group_topk<double>(ScoreFunc::None, 1.0);
  check_group_topk<float>(ScoreFunc::None, 1.0);
  check_group_topk<double>(ScoreFunc::Sigmoid, 2.5);
  check_group_topk<float>(ScoreFunc::SqrtSoftplus, 1.5);
}

TEST(Semantics72, ReferenceGroupScores) {
  // group scores t0: [0.30, 0.90, 0.81, 1.00] -> groups 3, 1; t1: [0.88, 0.42, 0.85, 0.42] -> 0, 2
  std::vector<bool> const m0 = group_mask(Vec(kScores.begin(), kScores.begin() + kE2), 4, 2);
  std::vector<bool> const m1 = group_mask(Vec(kScores.begin() + kE2, kScores.end()), 4, 2);
  for (int e = 0; e < kE2; ++e) {
    EXPECT_EQ(m0[e], e / 4 == 1 || e / 4 == 3) << e;
    EXPECT_EQ(m1[e], e / 4 == 0 || e / 4 == 2) << e;
  }
}

/// The whole layer: score func none, bias 0.5 on every expert, x one-hot, gate rows = scores - 0.5,
/// so biased = the given scores and the pre-bias values are scores - 0.5.
template <class Scalar, class Policy>
void check_group_layer() {
  SCOPED_TRACE((std::is_same_v<Scalar, float> ? "float" : "double"));
  int const D = 2, F = 3;
  LayerConfig cfg = group_config(ScoreFunc::None, 1.0);
  cfg.base_emb_dim = D;
  cfg.base_moe_mlp_dim = F;
  Rng rng(72);
  Params p = Params::random(cfg, rng);
  for (int t = 0; t < 2; ++t)
    for (int e = 0; e < kE2; ++e) p.gate[t * kE2 + e] = double(Scalar(kScores[t * kE2 + e] - 0.5));
  p.gate_bias.assign(kE2, 0.5);
  Vec const x = {1, 0, 0, 1};
  auto const run = run_layer<Scalar, Policy>(cfg, p, x, 1, 2);
  EXPECT_EQ(run.ids, kExpected72);
  Vec want_w;
  for (int i = 0; i < 2 * kK2; ++i) want_w.push_back(p.gate[(i / kK2) * kE2 + kExpected72[i]]);
  double const tol = std::is_same_v<Scalar, float> ? 1e-7 : 1e-15;
  EXPECT_TRUE(close(run.weights, want_w, tol, tol)) << "weights = pre-bias scores (no scaling)";
  Output const ref = forward(cfg, p, x, 1, 2);
  EXPECT_EQ(ref.r.ids, kExpected72);
  EXPECT_TRUE(close(run.y, ref.y, std::is_same_v<Scalar, float> ? 1e-5 : 1e-13)) << "output";
}

TEST(Semantics72, WholeLayerGroupLimitedRouting) {
  check_group_layer<double, PolVendor>();
  check_group_layer<double, PolDense>();
  check_group_layer<float, PolTiled>();
}

// ---- §7.3 loss-free bias update: E=4, rate 0.01 ------------------------------------------------

Ids const kIds73 = {0, 1, 3, 0, 3, 1, 1, 0, 0, 3, 2, 0, 1, 2, 2, 3};
std::vector<double> const kUpdate73 = {-0.01, 0, 0.01, 0};

TEST(Semantics73, BiasUpdate) {
  auto iv = to_view<V2<int>>(kIds73, 8, 2);
  moe::View1<std::int64_t, MS> counts("counts", 4);
  moe::routing::expert_histogram(Exec(), C2<int>(iv), counts);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), counts);
  std::vector<std::int64_t> const c(h.data(), h.data() + 4);
  EXPECT_EQ(c, (std::vector<std::int64_t>{5, 4, 3, 4}));
  EXPECT_EQ(moe::routing::bias_update(c, 16, 0.01), kUpdate73);
  LayerConfig cfg;
  cfg.num_experts = 4;
  cfg.routed_bias_update_rate = 0.01;
  EXPECT_EQ(bias_update(cfg, kIds73), kUpdate73);
}

template <class Scalar, class Policy>
void check_bias_update_layer() {
  SCOPED_TRACE((std::is_same_v<Scalar, float> ? "float" : "double"));
  int const T = 8, D = T, E = 4, K = 2;
  LayerConfig cfg;
  cfg.decoder_block = DecoderBlock::DeepSeek;
  cfg.num_experts = E;
  cfg.num_experts_per_tok = K;
  cfg.routed_score_func = ScoreFunc::Sigmoid;
  cfg.routed_bias = true;
  cfg.routed_bias_update_rate = 0.01;
  cfg.base_emb_dim = D;
  cfg.base_moe_mlp_dim = 2;
  Rng rng(73);
  Params p = Params::random(cfg, rng);
  Vec x(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t) {
    x[t * D + t] = 1.0;
    for (int e = 0; e < E; ++e) p.gate[t * E + e] = -2.0;
    p.gate[t * E + kIds73[t * K]] = 2.0;
    p.gate[t * E + kIds73[t * K + 1]] = 1.0;
  }
  p.gate_bias.assign(E, 0.0);
  auto const run = run_layer<Scalar, Policy>(cfg, p, x, 2, 4);
  EXPECT_EQ(run.ids, kIds73);
  EXPECT_EQ(run.bias_update, kUpdate73);
}

TEST(Semantics73, WholeLayerBiasUpdate) {
  check_bias_update_layer<double, PolVendor>();
  check_bias_update_layer<float, PolDense>();
}

}  // namespace
