// Routing (moe/routing/router.hpp) against the plain reference: score functions, generic and
// DeepSeek top-k, weight post-processing, random routing, capacity masks, load-balance
// statistics, loss-free bias update, and the routing backward against finite differences.
#include "reference.hpp"

#include <moe/routing/router.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace moe_ref;
using moe_ref::kk::close;
using moe_ref::kk::to_ids;
using moe_ref::kk::to_vec;
using moe_ref::kk::to_view;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
template <class S>
using V2 = moe::View2<S, MS>;
template <class S>
using C2 = moe::View2<S const, MS>;

template <class Scalar>
constexpr double eps() {
  return std::is_same_v<Scalar, float> ? 1.1920929e-7 : 2.220446049250313e-16;
}

/// A named routing configuration.
struct Case {
  std::string name;
  LayerConfig cfg;
};

LayerConfig mixtral(int E, int K, ScoreFunc f, bool bias, bool norm) {
  LayerConfig c;
  c.num_experts = E;
  c.num_experts_per_tok = K;
  c.routed_score_func = f;
  c.routed_bias = bias;
  c.norm_topk_prob = norm;
  return c;
}

LayerConfig deepseek(int E, int K, ScoreFunc f, double scaling, int groups = -1, int keep = -1) {
  LayerConfig c;
  c.decoder_block = DecoderBlock::DeepSeek;
  c.num_experts = E;
  c.num_experts_per_tok = K;
  c.routed_score_func = f;
  c.routed_bias = true;
  c.routed_scaling_factor = scaling;
  c.n_routing_groups = groups;
  c.topk_routing_group = keep;
  return c;
}

char const* fname(ScoreFunc f) {
  return f == ScoreFunc::Softmax        ? "softmax"
         : f == ScoreFunc::Sigmoid      ? "sigmoid"
         : f == ScoreFunc::SqrtSoftplus ? "sqrtsoftplus"
                                        : "none";
}

std::vector<Case> routing_cases() {
  std::vector<Case> cases;
  for (ScoreFunc f :
       {ScoreFunc::None, ScoreFunc::Softmax, ScoreFunc::Sigmoid, ScoreFunc::SqrtSoftplus})
    for (bool bias : {false, true})
      for (bool norm : {false, true})
        cases.push_back(
            {std::string("mixtral_") + fname(f) + (bias ? "_bias" : "") + (norm ? "_norm" : ""),
             mixtral(8, 2, f, bias, norm)});
  cases.push_back({"mixtral_softmax_k1", mixtral(8, 1, ScoreFunc::Softmax, false, false)});
  cases.push_back({"mixtral_sigmoid_k3_bias", mixtral(6, 3, ScoreFunc::Sigmoid, true, true)});
  cases.push_back({"mixtral_none_k_eq_e", mixtral(4, 4, ScoreFunc::None, true, false)});
  cases.push_back({"mixtral_e1", mixtral(1, 1, ScoreFunc::Softmax, false, false)});
  for (ScoreFunc f :
       {ScoreFunc::None, ScoreFunc::Softmax, ScoreFunc::Sigmoid, ScoreFunc::SqrtSoftplus}) {
    cases.push_back({std::string("deepseek_") + fname(f), deepseek(8, 2, f, 2.5)});
    cases.push_back({std::string("deepseek_groups_") + fname(f), deepseek(16, 4, f, 1.5, 4, 2)});
  }
  cases.push_back({"deepseek_groups_of_two", deepseek(16, 3, ScoreFunc::Sigmoid, 1.0, 8, 3)});
  cases.push_back({"deepseek_one_group", deepseek(8, 2, ScoreFunc::Sigmoid, 1.0, 1, 1)});
  cases.push_back({"deepseek_keep_all_groups", deepseek(12, 5, ScoreFunc::Sigmoid, 0.7, 3, 3)});
  cases.push_back({"deepseek_k_eq_group", deepseek(8, 4, ScoreFunc::SqrtSoftplus, 2.0, 2, 1)});
  return cases;
}

/// What the library's routing kernels produced (as doubles).
struct LibRoute {
  Vec scores, biased, top, weights;
  Ids ids;
};

/// Library routing of logits[T,E] (+ bias) under cfg: apply_score, bias add (in Scalar, as the
/// layer does), select_topk.
template <class Scalar>
LibRoute lib_route(LayerConfig const& cfg, Vec const& logits, Vec const& bias, int T,
                   std::uint64_t token_offset = 0) {
  int const E = cfg.num_experts, K = cfg.num_experts_per_tok;
  Exec space;
  auto lv = to_view<V2<Scalar>>(logits, T, E);
  V2<Scalar> sv("scores", T, E);
  moe::routing::apply_score(space, cfg.routed_score_func, C2<Scalar>(lv), sv);
  auto sh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sv);
  Vec biased(std::size_t(T) * E);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      biased[t * E + e] = double(Scalar(sh(t, e) + (bias.empty() ? Scalar(0) : Scalar(bias[e]))));
  auto bv = to_view<V2<Scalar>>(biased, T, E);
  V2<int> ids("ids", T, K);
  V2<Scalar> top("top", T, K), w("w", T, K);
  moe::routing::RouteParams const rp(cfg, moe::routing::resolve(moe::routing::Auto{}, cfg));
  moe::routing::select_topk(space, rp, token_offset, C2<Scalar>(sv), C2<Scalar>(bv), ids, top, w);
  return {to_vec(sv), biased, to_vec(top), to_vec(w), to_ids(ids)};
}

Vec row(Vec const& m, int t, int E) { return Vec(m.begin() + t * E, m.begin() + (t + 1) * E); }

template <class Scalar>
void check_variant(Case const& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name + (std::is_same_v<Scalar, float> ? " float" : " double"));
  LayerConfig const& cfg = c.cfg;
  int const T = 48, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  Rng rng(seed);
  Vec const logits = rng.vec(std::size_t(T) * E, -3, 3);
  Vec const bias = cfg.routed_bias ? rng.vec(E, -0.5, 0.5) : Vec{};
  LibRoute const lib = lib_route<Scalar>(cfg, logits, bias, T);

  // 1. score function
  Vec ref_scores;
  for (int t = 0; t < T; ++t) {
    Vec const s = apply_score(cfg.routed_score_func, row(logits, t, E));
    ref_scores.insert(ref_scores.end(), s.begin(), s.end());
  }
  EXPECT_TRUE(close(lib.scores, ref_scores, 8 * eps<Scalar>(), 8 * eps<Scalar>())) << "scores";

  // 2. selection and post-processing on the library's own scores (so float rounding of the score
  //    function cannot move a near-tie): ids exact, top values exact, weights to rounding.
  Ids ref_ids;
  Vec ref_top, ref_w;
  for (int t = 0; t < T; ++t) {
    TokenRoute const r = route_token(cfg, row(lib.scores, t, E), row(lib.biased, t, E));
    ref_ids.insert(ref_ids.end(), r.ids.begin(), r.ids.end());
    ref_top.insert(ref_top.end(), r.top_values.begin(), r.top_values.end());
    ref_w.insert(ref_w.end(), r.weights.begin(), r.weights.end());
  }
  EXPECT_EQ(lib.ids, ref_ids) << "expert ids";
  EXPECT_TRUE(close(lib.top, ref_top, 0, 0)) << "top values";
  EXPECT_TRUE(close(lib.weights, ref_w, 16 * eps<Scalar>(), 16 * eps<Scalar>())) << "weights";

  // 3. invariants that do not depend on the reference
  for (int t = 0; t < T; ++t) {
    std::set<int> distinct;
    double wsum = 0;
    for (int k = 0; k < K; ++k) {
      int const e = lib.ids[t * K + k];
      ASSERT_TRUE(e >= 0 && e < E) << "token " << t << " slot " << k << " id " << e;
      distinct.insert(e);
      wsum += lib.weights[t * K + k];
    }
    EXPECT_EQ(int(distinct.size()), K) << "token " << t << ": repeated expert";
    bool const ds = cfg.decoder_block == DecoderBlock::DeepSeek;
    bool const normalised = !ds || cfg.routed_score_func == ScoreFunc::Sigmoid ||
                            cfg.routed_score_func == ScoreFunc::SqrtSoftplus;
    if (normalised) {
      EXPECT_NEAR(wsum, ds ? cfg.routed_scaling_factor : 1.0, 1e3 * eps<Scalar>()) << "token " << t;
    }
  }

  // 4. end to end in double: the reference from the raw logits picks the same experts.
  if (std::is_same_v<Scalar, double>) {
    Ids e2e;
    for (int t = 0; t < T; ++t) {
      Vec const s = apply_score(cfg.routed_score_func, row(logits, t, E));
      Vec b = s;
      for (int e = 0; e < E; ++e) b[e] += bias.empty() ? 0.0 : bias[e];
      Ids const ids = route_token(cfg, s, b).ids;
      e2e.insert(e2e.end(), ids.begin(), ids.end());
    }
    EXPECT_EQ(lib.ids, e2e) << "end-to-end ids";
  }
}

TEST(RoutingVariants, MatchReferenceDouble) {
  std::uint64_t seed = 1000;
  for (auto const& c : routing_cases()) check_variant<double>(c, seed++);
}

TEST(RoutingVariants, MatchReferenceFloat) {
  std::uint64_t seed = 1000;
  for (auto const& c : routing_cases()) check_variant<float>(c, seed++);
}

TEST(RoutingVariants, MixtralWeightsAreSoftmaxOfBiasedScores) {
  // Hand-computed: scores none, bias added; top-2 of [1, 3, 2+0.5 bias, 0] = experts 1 (3) and
  // 2 (2.5); weights = softmax([3, 2.5]).
  LayerConfig cfg = mixtral(4, 2, ScoreFunc::None, true, false);
  LibRoute const r = lib_route<double>(cfg, {1, 3, 2, 0}, {0, 0, 0.5, 0}, 1);
  EXPECT_EQ(r.ids, (Ids{1, 2}));
  double const w0 = 1 / (1 + std::exp(-0.5));
  EXPECT_NEAR(r.weights[0], w0, 1e-15);
  EXPECT_NEAR(r.weights[1], 1 - w0, 1e-15);
}

TEST(RoutingVariants, DeepSeekSelectsOnBiasedWeightsFromPreBias) {
  // sigmoid scores; a large bias on expert 3 makes it selected although its score is lowest.
  LayerConfig cfg = deepseek(4, 2, ScoreFunc::Sigmoid, 2.0);
  Vec const logits = {2.0, 1.0, 0.0, -3.0};
  LibRoute const r = lib_route<double>(cfg, logits, {0, 0, 0, 10}, 1);
  EXPECT_EQ(r.ids, (Ids{3, 0}));
  double const s3 = sigmoid(-3.0), s0 = sigmoid(2.0);
  EXPECT_NEAR(r.top[0], s3, 1e-15);
  EXPECT_NEAR(r.top[1], s0, 1e-15);
  EXPECT_NEAR(r.weights[0], 2.0 * s3 / (s3 + s0), 1e-14);
  EXPECT_NEAR(r.weights[1], 2.0 * s0 / (s3 + s0), 1e-14);
}

TEST(RoutingVariants, TiesGoToTheLowerIndex) {
  LayerConfig cfg = mixtral(6, 3, ScoreFunc::None, false, false);
  LibRoute const r = lib_route<double>(cfg, {0.5, 1, 0.5, 1, 0.5, 1}, {}, 1);
  EXPECT_EQ(r.ids, (Ids{1, 3, 5}));
  LibRoute const r2 = lib_route<float>(cfg, {2, 0, 0, 0, 0, 0}, {}, 1);
  EXPECT_EQ(r2.ids, (Ids{0, 1, 2}));
}

TEST(RoutingVariants, NanScoresNeverGiveOutOfRangeIds) {
  // check_finite=false lets NaN/Inf reach the router; the ids must stay in [0,E) and distinct.
  double const nan = std::numeric_limits<double>::quiet_NaN();
  double const inf = std::numeric_limits<double>::infinity();
  int const E = 8, T = 6;
  Vec logits(std::size_t(T) * E, 0.25);
  for (int e = 0; e < E; ++e) logits[0 * E + e] = nan;  // all NaN
  logits[1 * E + 2] = nan;                              // one NaN
  logits[1 * E + 5] = 1.0;
  for (int e = 0; e < E; e += 2) logits[2 * E + e] = nan;  // half NaN
  logits[3 * E + 1] = inf;                                 // +Inf
  logits[3 * E + 4] = -inf;
  for (int e = 0; e < E; ++e) logits[4 * E + e] = -inf;  // all -Inf
  for (int e = 0; e < E; ++e) logits[5 * E + e] = e % 2 ? inf : nan;
  std::vector<Case> cases = {{"mixtral", mixtral(E, 3, ScoreFunc::None, false, false)},
                             {"mixtral_softmax", mixtral(E, 2, ScoreFunc::Softmax, true, true)},
                             {"deepseek_groups", deepseek(E, 3, ScoreFunc::Sigmoid, 1.0, 4, 2)},
                             {"deepseek", deepseek(E, 2, ScoreFunc::SqrtSoftplus, 1.0)},
                             {"random", mixtral(E, 2, ScoreFunc::None, false, false)}};
  cases.back().cfg.use_random_routing = true;
  for (auto const& c : cases) {
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE(c.name + (pass ? " float" : " double"));
      Vec const bias = c.cfg.routed_bias ? Vec(E, 0.0) : Vec{};
      LibRoute const r = pass ? lib_route<float>(c.cfg, logits, bias, T)
                              : lib_route<double>(c.cfg, logits, bias, T);
      int const K = c.cfg.num_experts_per_tok;
      for (int t = 0; t < T; ++t) {
        std::set<int> distinct;
        for (int k = 0; k < K; ++k) {
          int const e = r.ids[t * K + k];
          EXPECT_TRUE(e >= 0 && e < E) << "token " << t << " slot " << k << " id " << e;
          distinct.insert(e);
        }
        if (!c.cfg.use_random_routing) {
          EXPECT_EQ(int(distinct.size()), K) << "token " << t;
        }
      }
      if (c.name == "mixtral") {
        // NaN sorts below every number: token 1 picks 5 (1.0), then 0 and 1 (0.25, lower ids).
        EXPECT_EQ(Ids(r.ids.begin() + 3, r.ids.begin() + 6), (Ids{5, 0, 1}));
      }
    }
  }
}

// ---- random routing ---------------------------------------------------------------------------

Ids random_ids(int T, int K, int E, std::uint64_t seed, std::uint64_t offset = 0) {
  LayerConfig cfg = mixtral(E, K, ScoreFunc::None, false, false);
  cfg.use_random_routing = true;
  cfg.seed = seed;
  Vec const logits(std::size_t(T) * E, 0.0);
  return lib_route<double>(cfg, logits, {}, T, offset).ids;
}

TEST(RoutingRandom, UniformWithinFivePercent) {
  // SEMANTICS §7.8: 12 x 1024 tokens, K = 2, E = 8: each expert within +-5% of the uniform share.
  int const T = 12 * 1024, K = 2, E = 8;
  for (std::uint64_t seed : {0ull, 1ull, 1234567ull}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    Ids const ids = random_ids(T, K, E, seed);
    std::vector<int> count(E, 0);
    for (int e : ids) {
      ASSERT_TRUE(e >= 0 && e < E) << e;
      ++count[e];
    }
    double const share = double(T) * K / E;
    for (int e = 0; e < E; ++e) EXPECT_NEAR(count[e], share, 0.05 * share) << "expert " << e;
    // i.i.d. per slot: two slots of a token coincide with probability 1/E.
    int dup = 0;
    for (int t = 0; t < T; ++t) dup += ids[t * K] == ids[t * K + 1];
    EXPECT_NEAR(dup, double(T) / E, 0.15 * T / E) << "duplicates within a token";
  }
}

TEST(RoutingRandom, ReproducibleAndSeeded) {
  int const T = 500, K = 3, E = 6;
  Ids const a = random_ids(T, K, E, 42), b = random_ids(T, K, E, 42), c = random_ids(T, K, E, 43);
  EXPECT_EQ(a, b) << "same seed, same draws";
  int differ = 0;
  for (std::size_t i = 0; i < a.size(); ++i) differ += a[i] != c[i];
  EXPECT_GT(differ, int(a.size()) / 2) << "another seed must give other draws";
  // A token's experts depend on its global index only: offset o, token t == offset 0, token t+o.
  Ids const shifted = random_ids(T - 100, K, E, 42, 100);
  EXPECT_EQ(shifted, Ids(a.begin() + 100 * K, a.end()));
}

TEST(RoutingRandom, WeightsAreSoftmaxOfGatheredScores) {
  LayerConfig cfg = mixtral(5, 2, ScoreFunc::Sigmoid, true, false);
  cfg.use_random_routing = true;
  cfg.seed = 9;
  int const T = 40, E = 5, K = 2;
  Rng rng(77);
  Vec const logits = rng.vec(std::size_t(T) * E, -2, 2), bias = rng.vec(E, -1, 1);
  for (int pass = 0; pass < 2; ++pass) {
    LibRoute const r =
        pass ? lib_route<float>(cfg, logits, bias, T) : lib_route<double>(cfg, logits, bias, T);
    Vec ref_w;
    for (int t = 0; t < T; ++t) {
      TokenRoute const tr =
          route_token(cfg, row(r.scores, t, E), row(r.biased, t, E), r.ids.data() + t * K);
      ref_w.insert(ref_w.end(), tr.weights.begin(), tr.weights.end());
    }
    EXPECT_TRUE(close(r.weights, ref_w, pass ? 1e-6 : 1e-15, pass ? 1e-6 : 1e-15));
  }
}

// ---- capacity masks ---------------------------------------------------------------------------

TEST(RoutingCapacity, MasksMatchReference) {
  int const B = 3, S = 10, K = 2, E = 4;
  Rng rng(5);
  Ids ids(std::size_t(B) * S * K);
  for (auto& e : ids) e = std::min(E - 1, int(rng.uniform(0, E)));
  for (std::int64_t C : {1, 2, 3, 5, 20, -1}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    Ids ref_kept, pos;
    capacity_masks(ids, B, S, K, E, C, ref_kept, pos);
    auto idv = to_view<V2<int>>(ids, B * S, K);
    V2<int> kept("kept", B * S, K);
    Kokkos::deep_copy(kept, 7);
    moe::routing::capacity_mask(Exec(), C2<int>(idv), S, C, E, kept);
    EXPECT_EQ(to_ids(kept), ref_kept);
    int dropped = 0;
    for (int k : ref_kept) dropped += 1 - k;
    if (C >= 0 && C <= 3) {
      EXPECT_GT(dropped, 0) << "the case must drop something";
    } else if (C < 0 || C >= S * K) {
      EXPECT_EQ(dropped, 0);
    }
  }
}

TEST(RoutingCapacity, SequencesLongerThanACountingChunk) {
  // S*K = 4400 slots per sequence: two or three counting chunks per sequence on a host space, so
  // a queue position runs across chunk boundaries (and across sequences, which restart at 0).
  int const B = 3, S = 2200, K = 2, E = 5;
  Rng rng(9);
  Ids ids(std::size_t(B) * S * K);
  for (auto& e : ids) e = std::min(E - 1, int(rng.uniform(0, E) * rng.uniform(0.5, 1.0)));
  for (std::int64_t C : {0, 1, 300, 700, 1200, 5000}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    Ids ref_kept, pos;
    capacity_masks(ids, B, S, K, E, C, ref_kept, pos);
    auto idv = to_view<V2<int>>(ids, B * S, K);
    V2<int> kept("kept", B * S, K);
    moe::detail::ScratchPool<MS> scratch;
    for (int rep = 0; rep < 2; ++rep) {  // the second call reuses the scratch buffers
      Kokkos::deep_copy(kept, 7);
      moe::routing::capacity_mask(Exec(), C2<int>(idv), S, C, E, kept, scratch);
      EXPECT_EQ(to_ids(kept), ref_kept);
    }
  }
}

TEST(RoutingCapacity, CapacityFormula) {
  // C = int(max(ceil(S*K/E) * cf, cf))
  struct F {
    double cf;
    int S, K, E;
    std::int64_t C;
  };
  for (F const f : {F{2.0, 4, 2, 8, 2}, F{1.5, 5, 2, 4, 4}, F{1.0, 7, 1, 3, 3}, F{3.0, 1, 1, 16, 3},
                    F{1.25, 16, 2, 8, 5}, F{0.5, 3, 1, 8, 0}, F{0.9, 64, 2, 8, 14}}) {
    LayerConfig cfg;
    cfg.capacity_factor = f.cf;
    cfg.num_experts = f.E;
    cfg.num_experts_per_tok = f.K;
    EXPECT_EQ(cfg.capacity(f.S), f.C) << "cf=" << f.cf << " S=" << f.S;
    EXPECT_EQ(capacity(cfg, f.S), f.C) << "reference, cf=" << f.cf << " S=" << f.S;
  }
}

// ---- load-balance statistics and bias update --------------------------------------------------

template <class Scalar>
void check_lb(std::uint64_t seed) {
  SCOPED_TRACE((std::is_same_v<Scalar, float> ? "float" : "double"));
  int const B = 3, S = 7, E = 6, K = 2, T = B * S;
  LayerConfig cfg = mixtral(E, K, ScoreFunc::Sigmoid, true, false);
  cfg.load_balance_loss_weight = 0.37;
  Rng rng(seed);
  Vec const biased = rng.vec(std::size_t(T) * E, -2, 2);
  Ids ids;
  for (int t = 0; t < T; ++t) {
    Ids const i = top_k(row(biased, t, E), K);
    ids.insert(ids.end(), i.begin(), i.end());
  }
  auto bv = to_view<V2<Scalar>>(biased, T, E);
  auto iv = to_view<V2<int>>(ids, T, K);
  V2<std::int64_t> counts("counts", B, E);
  V2<Scalar> probs("probs", B, E);
  double const sum =
      moe::routing::lb_statistics(Exec(), C2<Scalar>(bv), C2<int>(iv), S, counts, probs);
  Ids ref_counts(std::size_t(B) * E, 0);
  Vec ref_probs(std::size_t(B) * E, 0.0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) ref_counts[(t / S) * E + ids[t * K + k]] += 1;
    Vec const p = softmax(row(biased, t, E));
    for (int e = 0; e < E; ++e) ref_probs[(t / S) * E + e] += p[e];
  }
  EXPECT_EQ(to_ids(counts), ref_counts);
  EXPECT_TRUE(close(to_vec(probs), ref_probs, 16 * eps<Scalar>()));
  // documented: loss = weight * E * sum / (B * S^2)
  double const lb = cfg.load_balance_loss_weight * E * sum / (double(B) * S * S);
  EXPECT_NEAR(lb, load_balance_loss(cfg, biased, ids, B, S), 64 * eps<Scalar>());
  EXPECT_GT(lb, 0.0);
}

TEST(RoutingLoadBalance, StatisticsMatchReference) {
  check_lb<double>(61);
  check_lb<float>(62);
}

TEST(RoutingLoadBalance, UniformRouterGivesWeightTimesK) {
  // f sums to K over experts; with p uniform (1/E), lb = weight * E * sum_e f/E = weight * K.
  LayerConfig cfg = mixtral(4, 2, ScoreFunc::None, false, false);
  cfg.load_balance_loss_weight = 0.5;
  Vec const biased(8 * 4, 0.3);
  Ids const ids = {0, 1, 2, 3, 0, 0, 1, 1, 2, 3, 3, 2, 1, 0, 0, 3};
  EXPECT_NEAR(load_balance_loss(cfg, biased, ids, 2, 4), 0.5 * 2, 1e-15);
  auto bv = to_view<V2<double>>(biased, 8, 4);
  auto iv = to_view<V2<int>>(ids, 8, 2);
  V2<std::int64_t> counts("counts", 2, 4);
  V2<double> probs("probs", 2, 4);
  double const sum =
      moe::routing::lb_statistics(Exec(), C2<double>(bv), C2<int>(iv), 4, counts, probs);
  EXPECT_NEAR(0.5 * 4 * sum / (2.0 * 4 * 4), 1.0, 1e-15);
}

TEST(RoutingBiasUpdate, MatchesReference) {
  struct U {
    int T, K, E;
    std::uint64_t seed;
  };
  for (U const u : {U{37, 3, 6, 1}, U{16, 2, 8, 2}, U{5, 1, 7, 3}, U{100, 4, 16, 4}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << u.T << " K=" << u.K << " E=" << u.E);
    LayerConfig cfg = deepseek(u.E, u.K, ScoreFunc::Sigmoid, 1.0);
    cfg.routed_bias_update_rate = 0.003;
    Rng rng(u.seed);
    Ids ids(std::size_t(u.T) * u.K);
    for (auto& e : ids) e = std::min(u.E - 1, int(rng.uniform(0, u.E)));
    auto iv = to_view<V2<int>>(ids, u.T, u.K);
    moe::View1<std::int64_t, MS> counts("counts", u.E);
    moe::routing::expert_histogram(Exec(), C2<int>(iv), counts);
    auto ch = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), counts);
    std::vector<std::int64_t> cv(ch.data(), ch.data() + u.E);
    std::vector<std::int64_t> ref_counts(u.E, 0);
    for (int e : ids) ++ref_counts[e];
    EXPECT_EQ(cv, ref_counts);
    std::vector<double> const up = moe::routing::bias_update(cv, std::int64_t(u.T) * u.K, 0.003);
    EXPECT_EQ(up, bias_update(cfg, ids));
  }
}

TEST(RoutingBiasUpdate, ExactlyAverageGetsZero) {
  // T*K/E is an integer: experts at exactly the average get 0 (no floating-point sign flip).
  std::vector<double> const up = moe::routing::bias_update({3, 3, 2, 4, 3, 3}, 18, 0.01);
  EXPECT_EQ(up, (std::vector<double>{0, 0, 0.01, -0.01, 0, 0}));
  // avg = 10/3: counts 3 and 4 straddle it.
  std::vector<double> const up2 = moe::routing::bias_update({3, 4, 3}, 10, 0.5);
  EXPECT_EQ(up2, (std::vector<double>{0.5, -0.5, 0.5}));
}

// ---- routing backward vs finite differences ----------------------------------------------------

/// J(logits, bias) = sum_{t,k} w[t,k] g[t,k] + lb(biased): the routing part of the layer's loss.
double routing_objective(LayerConfig const& cfg, Vec const& logits, Vec const& bias, Vec const& g,
                         int B, int S, Ids const* given) {
  int const E = cfg.num_experts, K = cfg.num_experts_per_tok, T = B * S;
  Vec biased(std::size_t(T) * E);
  Ids ids;
  double J = 0;
  for (int t = 0; t < T; ++t) {
    Vec const s = apply_score(cfg.routed_score_func, row(logits, t, E));
    Vec b = s;
    for (int e = 0; e < E; ++e) biased[t * E + e] = b[e] += bias.empty() ? 0.0 : bias[e];
    TokenRoute const r = route_token(cfg, s, b, given ? given->data() + t * K : nullptr);
    for (int k = 0; k < K; ++k) J += r.weights[k] * g[t * K + k];
    ids.insert(ids.end(), r.ids.begin(), r.ids.end());
  }
  return J + load_balance_loss(cfg, biased, ids, B, S);
}

template <class Scalar>
void check_route_backward(Case const& c, std::uint64_t seed) {
  SCOPED_TRACE(c.name + (std::is_same_v<Scalar, float> ? " float" : " double"));
  LayerConfig const& cfg = c.cfg;
  int const B = 2, S = 5, T = B * S, E = cfg.num_experts, K = cfg.num_experts_per_tok;
  Rng rng(seed);
  Vec logits = rng.vec(std::size_t(T) * E, -2, 2);
  Vec bias = cfg.routed_bias ? rng.vec(E, -0.4, 0.4) : Vec{};
  Vec const g = rng.vec(std::size_t(T) * K, -1, 1);
  Exec space;

  // library forward pieces
  moe::routing::RoutingState<Scalar, MS> st;
  st.logits = to_view<V2<Scalar>>(logits, T, E);
  st.scores = V2<Scalar>("scores", T, E);
  moe::routing::apply_score(space, cfg.routed_score_func, C2<Scalar>(st.logits), st.scores);
  auto sh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st.scores);
  Vec biased(std::size_t(T) * E);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      biased[t * E + e] = double(Scalar(sh(t, e) + (bias.empty() ? Scalar(0) : Scalar(bias[e]))));
  st.biased = to_view<V2<Scalar>>(biased, T, E);
  st.expert_ids = V2<int>("ids", T, K);
  st.top_values = V2<Scalar>("top", T, K);
  st.weights = V2<Scalar>("w", T, K);
  moe::routing::RouteParams const rp(cfg, moe::routing::resolve(moe::routing::Auto{}, cfg));
  moe::routing::select_topk(space, rp, 0, C2<Scalar>(st.scores), C2<Scalar>(st.biased),
                            st.expert_ids, st.top_values, st.weights);
  st.seq_counts = V2<std::int64_t>("counts", B, E);
  st.seq_probs = V2<Scalar>("probs", B, E);
  moe::routing::lb_statistics(space, C2<Scalar>(st.biased), C2<int>(st.expert_ids), S,
                              st.seq_counts, st.seq_probs);
  Ids const lib_ids = to_ids(st.expert_ids);
  double const lb_coef = cfg.load_balance_loss_weight * E / (double(B) * S * S);

  V2<Scalar> d_top("d_top", T, K), d_biased("d_biased", T, E), d_logits("d_logits", T, E);
  moe::routing::route_backward(space, rp, st, C2<Scalar>(to_view<V2<Scalar>>(g, T, K)), S, lb_coef,
                               d_top, d_biased, d_logits);
  moe::View1<Scalar, MS> d_bias("d_bias", E);
  moe::routing::column_sums(space, C2<Scalar>(d_biased), d_bias);

  // finite differences of the reference objective
  Ids const* given = cfg.use_random_routing ? &lib_ids : nullptr;
  auto J = [&] { return routing_objective(cfg, logits, bias, g, B, S, given); };
  auto fd = [&](Vec& v) {
    Vec out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      double const v0 = v[i], h = 1e-6 * std::max(1.0, std::fabs(v0));
      v[i] = v0 + h;
      double const jp = J();
      v[i] = v0 - h;
      double const jm = J();
      v[i] = v0;
      out[i] = (jp - jm) / (2 * h);
    }
    return out;
  };
  if (!cfg.use_random_routing) {
    // the reference selects the same experts from the double logits
    Ids ref_ids;
    for (int t = 0; t < T; ++t) {
      Vec const s = apply_score(cfg.routed_score_func, row(logits, t, E));
      Vec b = s;
      for (int e = 0; e < E; ++e) b[e] += bias.empty() ? 0.0 : bias[e];
      Ids const i = route_token(cfg, s, b).ids;
      ref_ids.insert(ref_ids.end(), i.begin(), i.end());
    }
    ASSERT_EQ(lib_ids, ref_ids);
  }
  Vec const fd_logits = fd(logits);
  double const rtol = std::is_same_v<Scalar, float> ? 2e-5 : 1e-7;
  EXPECT_TRUE(close(to_vec(d_logits), fd_logits, rtol, 1e-9)) << "d_logits";
  if (!bias.empty()) {
    Vec const fd_bias = fd(bias);
    EXPECT_TRUE(close(to_vec(d_bias), fd_bias, rtol, 1e-9)) << "d_bias";
  }
}

std::vector<Case> backward_cases() {
  std::vector<Case> cases;
  auto add = [&](std::string name, LayerConfig c, double lb) {
    c.load_balance_loss_weight = lb;
    cases.push_back({std::move(name), c});
  };
  add("mixtral_none", mixtral(8, 2, ScoreFunc::None, false, false), 0.0);
  add("mixtral_none_lb", mixtral(8, 2, ScoreFunc::None, false, false), 0.3);
  add("mixtral_softmax_norm_lb", mixtral(8, 3, ScoreFunc::Softmax, false, true), 0.2);
  add("mixtral_sigmoid_bias_lb", mixtral(6, 2, ScoreFunc::Sigmoid, true, false), 0.5);
  add("mixtral_sqrtsoftplus_bias_norm", mixtral(6, 2, ScoreFunc::SqrtSoftplus, true, true), 0.1);
  add("mixtral_k1_lb", mixtral(4, 1, ScoreFunc::Softmax, true, false), 0.4);
  add("deepseek_sigmoid", deepseek(8, 2, ScoreFunc::Sigmoid, 2.5), 0.0);
  add("deepseek_sigmoid_lb", deepseek(8, 3, ScoreFunc::Sigmoid, 2.5), 0.3);
  add("deepseek_softmax_lb", deepseek(8, 2, ScoreFunc::Softmax, 1.5), 0.2);
  add("deepseek_sqrtsoftplus_groups_lb", deepseek(16, 4, ScoreFunc::SqrtSoftplus, 1.2, 4, 2), 0.25);
  add("deepseek_none", deepseek(6, 2, ScoreFunc::None, 0.8), 0.1);
  LayerConfig rnd = mixtral(6, 2, ScoreFunc::Sigmoid, true, false);
  rnd.use_random_routing = true;
  rnd.seed = 3;
  add("random_sigmoid_bias_lb", rnd, 0.2);
  return cases;
}

TEST(RoutingBackward, MatchesFiniteDifferencesDouble) {
  std::uint64_t seed = 500;
  for (auto const& c : backward_cases()) check_route_backward<double>(c, seed++);
}

TEST(RoutingBackward, MatchesFiniteDifferencesFloat) {
  std::uint64_t seed = 500;
  for (auto const& c : backward_cases()) check_route_backward<float>(c, seed++);
}

TEST(RoutingBackward, DeepSeekBiasGetsOnlyLoadBalanceGradient) {
  // DeepSeek weights come from pre-bias scores: without the lb loss the bias gradient is 0;
  // with Mixtral (weights from biased scores) it is not.
  for (bool ds : {true, false}) {
    SCOPED_TRACE(ds ? "deepseek" : "mixtral");
    LayerConfig cfg = ds ? deepseek(6, 2, ScoreFunc::Sigmoid, 1.0)
                         : mixtral(6, 2, ScoreFunc::Sigmoid, true, false);
    int const S = 6, T = 6, E = 6, K = 2;
    Rng rng(8);
    Vec const logits = rng.vec(std::size_t(T) * E, -2, 2), bias = rng.vec(E, -0.3, 0.3);
    Vec const g = rng.vec(std::size_t(T) * K, -1, 1);
    Exec space;
    moe::routing::RoutingState<double, MS> st;
    st.logits = to_view<V2<double>>(logits, T, E);
    st.scores = V2<double>("scores", T, E);
    moe::routing::apply_score(space, cfg.routed_score_func, C2<double>(st.logits), st.scores);
    Vec const s = to_vec(st.scores);
    Vec b(s.size());
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) b[t * E + e] = s[t * E + e] + bias[e];
    st.biased = to_view<V2<double>>(b, T, E);
    st.expert_ids = V2<int>("ids", T, K);
    st.top_values = V2<double>("top", T, K);
    st.weights = V2<double>("w", T, K);
    moe::routing::RouteParams const rp(cfg, moe::routing::resolve(moe::routing::Auto{}, cfg));
    moe::routing::select_topk(space, rp, 0, C2<double>(st.scores), C2<double>(st.biased),
                              st.expert_ids, st.top_values, st.weights);
    V2<double> d_top("d_top", T, K), d_biased("d_biased", T, E), d_logits("d_logits", T, E);
    moe::routing::route_backward(space, rp, st, C2<double>(to_view<V2<double>>(g, T, K)), S, 0.0,
                                 d_top, d_biased, d_logits);
    moe::View1<double, MS> d_bias("d_bias", E);
    moe::routing::column_sums(space, C2<double>(d_biased), d_bias);
    double mx = 0;
    for (double v : to_vec(d_bias)) mx = std::max(mx, std::fabs(v));
    if (ds) {
      EXPECT_EQ(mx, 0.0);
    } else {
      EXPECT_GT(mx, 1e-3);
    }
  }
}

}  // namespace
