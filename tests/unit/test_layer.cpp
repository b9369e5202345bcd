// The whole layer (moe/layer.hpp) against the plain reference: forward outputs, routing results,
// load-balance loss and bias update, and every gradient against central finite differences of
// sum(y * dy) + lb_loss, for every GMM policy (Vendor, Tiled<4,8,4>, Dense, sparse_matmul=false)
// in double and float. Then edge cases, bad input and LayerConfig::set.
#include "reference.hpp"

#include <moe/config.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/layer.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace moe_ref;
using moe_ref::kk::close;
using moe_ref::kk::LayerRun;
using moe_ref::kk::load_params;
using moe_ref::kk::run_layer;
using moe_ref::kk::to_ids;
using moe_ref::kk::to_vec;
using moe_ref::kk::to_view;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

using PolVendor = moe::Policies<moe::routing::Auto, moe::gmm::Vendor>;
using PolOneDnn = moe::Policies<moe::routing::Auto, moe::gmm::OneDnn>;
using moe_ref::kk::ForcePackedOneDnn;
using moe_ref::kk::ForcePlainOneDnn;
using PolTiled = moe::Policies<moe::routing::Auto, moe::gmm::Tiled<4, 8, 4>>;
using PolDense = moe::Policies<moe::routing::Auto, moe::gmm::Dense>;

/// One layer configuration with its data and (optional) hand-made changes to parameters.
struct LayerCase {
  std::string name;
  LayerConfig cfg;
  int B = 2, S = 4;
  std::uint64_t seed = 1;
  std::function<void(Params&)> setup;                  ///< applied after random initialisation
  std::function<void(Output const&)> check_reference;  ///< asserts the case means what it says
};

LayerConfig base(int E = 4, int K = 2, int D = 6, int F = 5) {
  LayerConfig c;
  c.num_experts = E;
  c.num_experts_per_tok = K;
  c.base_emb_dim = D;
  c.base_moe_mlp_dim = F;
  return c;
}

int count_dropped(Ids const& kept) {
  int n = 0;
  for (int k : kept) n += 1 - k;
  return n;
}

std::vector<LayerCase> layer_cases() {
  std::vector<LayerCase> v;
  auto add = [&](std::string name, LayerConfig const& cfg, int B, int S,
                 std::function<void(Params&)> setup = {},
                 std::function<void(Output const&)> check = {}) {
    v.push_back({std::move(name), cfg, B, S, 100 + v.size(), std::move(setup), std::move(check)});
  };
  add("mixtral_none", base(), 2, 4);
  {
    LayerConfig c = base();
    c.routed_score_func = ScoreFunc::Softmax;
    c.norm_topk_prob = true;
    c.load_balance_loss_weight = 0.1;
    add("mixtral_softmax_norm_lb", c, 2, 4);
  }
  {
    LayerConfig c = base();
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.05;
    c.shared_experts = 1;
    add("mixtral_sigmoid_bias_lb_shared", c, 2, 4);
  }
  {
    LayerConfig c = base(5, 2);
    c.routed_score_func = ScoreFunc::SqrtSoftplus;
    c.routed_bias = true;
    c.mlp_activation = Activation::Gelu;
    c.shared_experts = 2;
    add("mixtral_sqrtsoftplus_gelu_shared2", c, 2, 3);
  }
  {
    LayerConfig c = base(8, 3);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.n_routing_groups = 4;
    c.topk_routing_group = 2;
    c.routed_scaling_factor = 2.5;
    c.load_balance_loss_weight = 0.1;
    c.routed_bias_update_rate = 0.01;
    c.shared_experts = 1;
    add("deepseek_sigmoid_groups_lb_shared", c, 2, 4);
  }
  {
    LayerConfig c = base(6, 2);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.routed_score_func = ScoreFunc::Softmax;
    c.routed_bias = true;
    c.routed_scaling_factor = 1.5;
    c.load_balance_loss_weight = 0.2;
    add("deepseek_softmax_bias_lb", c, 2, 4);
  }
  {
    LayerConfig c = base(8, 2);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.routed_score_func = ScoreFunc::SqrtSoftplus;
    c.routed_bias = true;
    c.n_routing_groups = 2;
    c.topk_routing_group = 1;
    c.mlp_activation = Activation::Gelu;
    c.load_balance_loss_weight = 0.05;
    add("deepseek_sqrtsoftplus_groups_gelu", c, 2, 4);
  }
  {
    LayerConfig c = base(4, 2);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.routed_bias = true;
    c.routed_scaling_factor = 0.8;
    add("deepseek_none_scaling", c, 2, 4);
  }
  {
    LayerConfig c = base(4, 2);
    c.routed_score_func = ScoreFunc::Softmax;
    c.routed_bias = true;
    c.capacity_factor = 1.0;
    c.load_balance_loss_weight = 0.1;
    add(
        "capacity_drop_lb", c, 2, 8, [](Params& p) { p.gate_bias[0] = 0.8; },
        [](Output const& o) {
          EXPECT_EQ(o.r.capacity, 4);
          EXPECT_GE(count_dropped(o.r.kept), 2) << "the case must drop slots";
        });
  }
  {
    LayerConfig c = base(4, 2);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.capacity_factor = 0.75;
    c.load_balance_loss_weight = 0.1;
    c.shared_experts = 1;
    add(
        "capacity_drop_deepseek", c, 2, 8, [](Params& p) { p.gate_bias[2] = 0.3; },
        [](Output const& o) {
          EXPECT_EQ(o.r.capacity, 3);
          EXPECT_GE(count_dropped(o.r.kept), 2) << "the case must drop slots";
        });
  }
  {
    LayerConfig c = base(4, 2);
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.1;
    add(
        "expert_without_tokens", c, 2, 4, [](Params& p) { p.gate_bias[3] = -50; },
        [](Output const& o) {
          for (int e : o.r.ids) EXPECT_NE(e, 3);
        });
  }
  {
    LayerConfig c = base(4, 1);
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.1;
    add(
        "all_tokens_on_one_expert_k1", c, 2, 4, [](Params& p) { p.gate_bias[2] = 50; },
        [](Output const& o) {
          for (int e : o.r.ids) EXPECT_EQ(e, 2);
        });
  }
  {
    LayerConfig c = base(4, 2);
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.1;
    add(
        "all_tokens_on_one_expert_k2", c, 2, 4, [](Params& p) { p.gate_bias[1] = 50; },
        [](Output const& o) {
          for (std::size_t i = 0; i < o.r.ids.size(); i += 2) EXPECT_EQ(o.r.ids[i], 1);
        });
  }
  {
    LayerConfig c = base(4, 2);
    c.routed_score_func = ScoreFunc::Softmax;
    c.load_balance_loss_weight = 0.1;
    c.shared_experts = 1;
    add("single_token", c, 1, 1);
  }
  {
    LayerConfig c = base(3, 3);
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.1;
    add("k_equals_e", c, 2, 3);
  }
  {
    LayerConfig c = base(1, 1);
    c.load_balance_loss_weight = 0.1;
    c.shared_experts = 1;
    add("one_expert", c, 2, 3);
  }
  {
    LayerConfig c = base(4, 1);
    c.routed_bias = true;
    c.capacity_factor = 1.0;
    add(
        "capacity_keeps_one_slot", c, 1, 4, [](Params& p) { p.gate_bias[0] = 50; },
        [](Output const& o) {
          EXPECT_EQ(o.r.capacity, 1);
          EXPECT_EQ(o.r.kept, (Ids{1, 0, 0, 0}));
        });
  }
  {
    LayerConfig c = base(4, 2);
    c.use_random_routing = true;
    c.seed = 5;
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.load_balance_loss_weight = 0.1;
    add("random_routing", c, 2, 5);
  }
  {
    LayerConfig c = base(3, 2);
    c.use_random_routing = true;
    c.seed = 6;
    c.capacity_factor = 1.0;
    add("random_routing_capacity", c, 2, 6, {}, [](Output const& o) {
      EXPECT_GE(count_dropped(o.r.kept), 1) << "the case must drop slots";
    });
  }
  {
    // DeepSeek post-processing of randomly drawn experts: the weights are the biased gate output
    // at the drawn ids (SEMANTICS §1.3 item 5), so the bias gets a combine-weight gradient.
    LayerConfig c = base(4, 2);
    c.decoder_block = DecoderBlock::DeepSeek;
    c.use_random_routing = true;
    c.seed = 8;
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.routed_bias = true;
    c.routed_scaling_factor = 1.5;
    add("random_routing_deepseek_bias", c, 2, 4);
  }
  {
    // D = 10 and F = 6 are not multiples of the 8-deep / 4-wide tiles; groups hold ~8 rows.
    LayerConfig c = base(4, 2, 10, 6);
    c.routed_score_func = ScoreFunc::Softmax;
    c.load_balance_loss_weight = 0.05;
    add("ragged_tiles", c, 2, 8);
  }
  {
    LayerConfig c = base(5, 2);
    c.routed_score_func = ScoreFunc::Sigmoid;
    c.load_balance_loss_weight = 0.3;
    add("many_sequences_lb", c, 3, 3);
  }
  return v;
}

/// Float tolerance derived from the problem: two float ulps per term of the longest chain of
/// dot products (D, then F, then the E-wide softmax and the K-term combine). Observed errors are
/// about 16 times smaller.
double float_tol(LayerConfig const& c) {
  double const eps = std::numeric_limits<float>::epsilon();
  int const n = c.base_emb_dim + std::max(c.base_moe_mlp_dim, c.shared_mlp_dim()) + c.num_experts +
                c.num_experts_per_tok;
  return 2 * eps * n;
}

class LayerVsReference : public ::testing::TestWithParam<LayerCase> {};

// gtest prints a failing parameter with this (instead of a byte dump)
[[maybe_unused]] void PrintTo(LayerCase const& c, std::ostream* os) { *os << c.name; }

/// Compares one library run with the reference forward and finite-difference gradients.
void compare(LayerConfig const& cfg, Output const& ref, Gradients const& fd, LayerRun const& run,
             bool is_float, bool dense) {
  double const ft = float_tol(cfg);
  double const fwd = is_float ? ft : 1e-10;
  EXPECT_EQ(run.ids, ref.r.ids) << "expert ids";
  EXPECT_EQ(run.kept, ref.r.kept) << "capacity mask";
  EXPECT_TRUE(close(run.weights, ref.r.weights, is_float ? ft : 1e-13, 1e-300)) << "weights";
  EXPECT_TRUE(close(run.y, ref.y, fwd, 1e-300)) << "y";
  EXPECT_NEAR(run.lb_loss, ref.r.lb_loss, (is_float ? ft : 1e-12) * (1 + ref.r.lb_loss))
      << "lb_loss";
  EXPECT_EQ(run.bias_update, ref.r.bias_update) << "bias_update";
  std::int64_t kept = 0;
  for (int k : ref.r.kept) kept += k;
  EXPECT_EQ(run.routed_rows, dense ? 0 : kept) << "routed rows";
  ASSERT_TRUE(run.has_grads);
  // double: finite differences with a 1e-6 relative step are good to ~1e-8 relative
  double const grad = is_float ? 4 * ft : 5e-8;
  double const gatol = is_float ? 1e-6 : 1e-8;
  EXPECT_TRUE(close(run.dx, fd.dx, grad, gatol)) << "dx";
  fd.dp.for_each([&](char const* name, Vec const& g) {
    bool found = false;
    run.grads.for_each([&](char const* n2, Vec const& lg) {
      if (std::string(n2) != name) return;
      found = true;
      EXPECT_TRUE(close(lg, g, grad, gatol)) << "d_" << name;
    });
    EXPECT_TRUE(found) << "library returned no gradient for " << name;
  });
}

void expect_same_run(LayerRun const& a, LayerRun const& b, double tol) {
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.kept, b.kept);
  EXPECT_TRUE(close(a.y, b.y, tol, 1e-300)) << "y";
  EXPECT_TRUE(close(a.dx, b.dx, tol, 1e-300)) << "dx";
  b.grads.for_each([&](char const* name, Vec const& g) {
    a.grads.for_each([&](char const* n2, Vec const& ga) {
      if (std::string(n2) == name) {
        EXPECT_TRUE(close(ga, g, tol, 1e-300)) << "d_" << name;
      }
    });
  });
}

template <class Scalar, class Policy>
LayerRun run_policy(LayerConfig cfg, bool sparse, Params const& p, Vec const& x, int B, int S,
                    Vec const& dy) {
  cfg.sparse_matmul = sparse;
  return run_layer<Scalar, Policy>(cfg, p, x, B, S, dy);
}

TEST_P(LayerVsReference, ForwardAndGradients) {
  LayerCase const& c = GetParam();
  LayerConfig const& cfg = c.cfg;
  int const D = cfg.base_emb_dim, T = c.B * c.S;
  Rng rng(c.seed);
  Params p = Params::random(cfg, rng);
  if (c.setup) c.setup(p);
  Vec const x = rng.vec(std::size_t(T) * D, -1, 1);
  Vec const dy = rng.vec(std::size_t(T) * D, -1, 1);

  // Random routing: the reference takes the layer's own draws (checked equal across policies).
  LayerRun const vendor = run_policy<double, PolVendor>(cfg, true, p, x, c.B, c.S, dy);
  Ids const* given = cfg.use_random_routing ? &vendor.ids : nullptr;
  Output const ref = forward(cfg, p, x, c.B, c.S, given);
  if (c.check_reference) c.check_reference(ref);
  Gradients const fd = finite_differences(cfg, p, x, dy, c.B, c.S, given);

  {
    SCOPED_TRACE("double Vendor");
    compare(cfg, ref, fd, vendor, false, false);
  }
  struct Variant {
    char const* name;
    std::function<LayerRun()> run;
    bool is_float, dense;
  };
  std::vector<Variant> const variants = {
      {"double Tiled<4,8,4>",
       [&] { return run_policy<double, PolTiled>(cfg, true, p, x, c.B, c.S, dy); }, false, false},
      {"double Dense", [&] { return run_policy<double, PolDense>(cfg, true, p, x, c.B, c.S, dy); },
       false, true},
      {"double sparse_matmul=false",
       [&] { return run_policy<double, PolVendor>(cfg, false, p, x, c.B, c.S, dy); }, false, true},
      {"double OneDnn (runs as Vendor)",
       [&] { return run_policy<double, PolOneDnn>(cfg, true, p, x, c.B, c.S, dy); }, false, false},
      {"float Vendor", [&] { return run_policy<float, PolVendor>(cfg, true, p, x, c.B, c.S, dy); },
       true, false},
      {"float OneDnn", [&] { return run_policy<float, PolOneDnn>(cfg, true, p, x, c.B, c.S, dy); },
       true, false},
      {"float OneDnn packed",
       [&] {
         ForcePackedOneDnn packed;
         return run_policy<float, PolOneDnn>(cfg, true, p, x, c.B, c.S, dy);
       },
       true, false},
      {"float OneDnn plain",
       [&] {
         ForcePlainOneDnn plain;
         return run_policy<float, PolOneDnn>(cfg, true, p, x, c.B, c.S, dy);
       },
       true, false},
      {"float Tiled<4,8,4>",
       [&] { return run_policy<float, PolTiled>(cfg, true, p, x, c.B, c.S, dy); }, true, false},
      {"float Dense", [&] { return run_policy<float, PolDense>(cfg, true, p, x, c.B, c.S, dy); },
       true, true},
      {"float sparse_matmul=false",
       [&] { return run_policy<float, PolVendor>(cfg, false, p, x, c.B, c.S, dy); }, true, true},
  };
  for (auto const& v : variants) {
    SCOPED_TRACE(v.name);
    LayerRun const run = v.run();
    compare(cfg, ref, fd, run, v.is_float, v.dense);
    if (!v.is_float) {
      SCOPED_TRACE("agrees with double Vendor");
      expect_same_run(run, vendor, 1e-12);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layer, LayerVsReference, ::testing::ValuesIn(layer_cases()),
                         [](::testing::TestParamInfo<LayerCase> const& i) { return i.param.name; });

// ---- specific properties --------------------------------------------------------------------

template <class Scalar, class Policy>
LayerRun run_case(LayerCase const& c, bool sparse = true, Params* out_p = nullptr,
                  Vec* out_x = nullptr) {
  Rng rng(c.seed);
  Params p = Params::random(c.cfg, rng);
  if (c.setup) c.setup(p);
  Vec const x = rng.vec(std::size_t(c.B) * c.S * c.cfg.base_emb_dim, -1, 1);
  Vec const dy = rng.vec(x.size(), -1, 1);
  if (out_p) *out_p = p;
  if (out_x) *out_x = x;
  return run_policy<Scalar, Policy>(c.cfg, sparse, p, x, c.B, c.S, dy);
}

LayerCase find_case(std::string const& name) {
  for (auto const& c : layer_cases())
    if (c.name == name) return c;
  ADD_FAILURE() << "no case " << name;
  return {};
}

TEST(LayerEdge, ExpertWithoutTokensGetsZeroGradient) {
  LayerCase const c = find_case("expert_without_tokens");
  int const D = c.cfg.base_emb_dim, F = c.cfg.base_moe_mlp_dim;
  auto check = [&](LayerRun const& r) {
    for (int i = 0; i < D * F; ++i) {
      ASSERT_EQ(r.grads.wi_0[3 * D * F + i], 0.0);
      ASSERT_EQ(r.grads.wi_1[3 * D * F + i], 0.0);
      ASSERT_EQ(r.grads.wo[3 * F * D + i], 0.0);
    }
  };
  check(run_case<double, PolVendor>(c));
  check(run_case<double, PolTiled>(c));
  check(run_case<double, PolDense>(c));
  check(run_case<float, PolTiled>(c));
}

TEST(LayerEdge, DroppedTokensHaveNoOutputAndNoGradient) {
  // K=1, every token on expert 0, C=1: only token 0 of the sequence is kept. Tokens 1..3 have no
  // output and (no lb loss, no shared expert) no input gradient.
  LayerCase const c = find_case("capacity_keeps_one_slot");
  int const D = c.cfg.base_emb_dim;
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    LayerRun const r = variant == 0   ? run_case<double, PolVendor>(c)
                       : variant == 1 ? run_case<double, PolTiled>(c)
                       : variant == 2 ? run_case<double, PolDense>(c)
                                      : run_case<double, PolVendor>(c, false);
    EXPECT_EQ(r.kept, (Ids{1, 0, 0, 0}));
    double ymax = 0, dxmax = 0, y0 = 0;
    for (int i = D; i < 4 * D; ++i) {
      ymax = std::max(ymax, std::fabs(r.y[i]));
      dxmax = std::max(dxmax, std::fabs(r.dx[i]));
    }
    for (int i = 0; i < D; ++i) y0 = std::max(y0, std::fabs(r.y[i]));
    EXPECT_EQ(ymax, 0.0);
    EXPECT_EQ(dxmax, 0.0);
    EXPECT_GT(y0, 0.0) << "the kept token has an output";
  }
}

TEST(LayerEdge, CapacityFactorBelowOneWithZeroCapacityDropsEverything) {
  // SEMANTICS §1.6 item 19: C = int(max(ceil(S*K/E) * cf, cf)). With cf = 0.5, S = 2, K = 1,
  // E = 4: ceil(0.5) * 0.5 = 0.5 -> C = 0: no slot fits, every slot is dropped (MaxText keeps a
  // slot iff its position <= C), so the routed output is 0.
  LayerConfig cfg = base(4, 1);
  cfg.capacity_factor = 0.5;
  ASSERT_EQ(cfg.capacity(2), 0);
  Rng rng(9);
  Params const p = Params::random(cfg, rng);
  Vec const x = rng.vec(2 * 2 * std::size_t(cfg.base_emb_dim), -1, 1);
  Output const ref = forward(cfg, p, x, 2, 2);
  EXPECT_EQ(count_dropped(ref.r.kept), 4);
  for (bool sparse : {true, false}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    LayerConfig c2 = cfg;
    c2.sparse_matmul = sparse;
    LayerRun const r = run_layer<double, PolVendor>(c2, p, x, 2, 2);
    EXPECT_EQ(r.kept, Ids(4, 0)) << "every slot must be dropped when C = 0";
    EXPECT_TRUE(close(r.y, ref.y, 0, 0)) << "routed output must be 0";
  }
}

TEST(LayerEdge, DeepSeekBiasGradientComesOnlyFromLoadBalanceLoss) {
  for (double lb : {0.0, 0.2}) {
    SCOPED_TRACE(::testing::Message() << "lb weight " << lb);
    LayerCase c;
    c.cfg = base(6, 2);
    c.cfg.decoder_block = DecoderBlock::DeepSeek;
    c.cfg.routed_score_func = ScoreFunc::Sigmoid;
    c.cfg.routed_bias = true;
    c.cfg.load_balance_loss_weight = lb;
    c.seed = 77;
    for (int variant = 0; variant < 2; ++variant) {
      LayerRun const r = variant ? run_case<double, PolDense>(c) : run_case<double, PolVendor>(c);
      double mx = 0;
      for (double g : r.grads.gate_bias) mx = std::max(mx, std::fabs(g));
      if (lb == 0) {
        EXPECT_EQ(mx, 0.0) << "no lb loss: the bias only selects, it has no gradient";
      } else {
        EXPECT_GT(mx, 1e-6) << "the lb loss gives the bias a gradient";
      }
    }
  }
}

TEST(LayerEdge, ReusedLayerWithChangingShapes) {
  // One layer object, several forward/backward pairs of different batch shapes: each equals a
  // fresh layer's result (work buffers are resized, nothing leaks between calls).
  LayerConfig cfg = base(4, 2);
  cfg.routed_score_func = ScoreFunc::Softmax;
  cfg.load_balance_loss_weight = 0.1;
  cfg.capacity_factor = 1.5;
  cfg.shared_experts = 1;
  Rng rng(31);
  Params const p = Params::random(cfg, rng);
  using Layer = moe::MoeLayer<double, PolVendor>;
  using V3 = moe::View3<double, MS>;
  Layer layer(cfg);
  load_params(layer, p);
  int const D = cfg.base_emb_dim;
  for (auto [B, S] : std::vector<std::pair<int, int>>{{2, 4}, {1, 7}, {3, 2}, {2, 4}}) {
    SCOPED_TRACE(::testing::Message() << "B=" << B << " S=" << S);
    Vec const x = rng.vec(std::size_t(B) * S * D, -1, 1), dy = rng.vec(x.size(), -1, 1);
    auto xv = to_view<V3>(x, B, S, D);
    auto dyv = to_view<V3>(dy, B, S, D);
    V3 y("y", B, S, D), dx("dx", B, S, D);
    Layer::params_type g;
    layer.forward(xv, y);
    layer.backward(dyv, dx, g);
    LayerRun const fresh = run_layer<double, PolVendor>(cfg, p, x, B, S, dy);
    EXPECT_TRUE(close(to_vec(y), fresh.y, 0, 0));
    EXPECT_TRUE(close(to_vec(dx), fresh.dx, 0, 0));
    EXPECT_TRUE(close(to_vec(g.gate), fresh.grads.gate, 0, 0));
    EXPECT_TRUE(close(to_vec(g.wi_0), fresh.grads.wi_0, 0, 0));
    EXPECT_TRUE(close(to_vec(g.shared_wo), fresh.grads.shared_wo, 0, 0));
  }
}

/// Exit code of one empty-batch run: 0 = an empty result or a moe::Error, 2 = a non-finite
/// lb_loss, 3 = a non-empty output. A crash (e.g. an integer division by S = 0) is a signal.
int empty_batch_status(int B, int S, double cf, double lb) {
  LayerConfig cfg = base(4, 2);
  cfg.capacity_factor = cf;
  cfg.load_balance_loss_weight = lb;
  Rng rng(35);
  Params const p = Params::random(cfg, rng);
  try {
    LayerRun const r = run_layer<double, PolVendor>(cfg, p, Vec{}, B, S, Vec{});
    if (!std::isfinite(r.lb_loss)) return 2;
    if (!r.y.empty()) return 3;
  } catch (moe::Error const&) {
  }
  return 0;
}

TEST(LayerEdgeDeathTest, EmptyBatchNeverCrashes) {
  // B = 0 or S = 0 (no tokens): a clean moe::Error or an empty result with a finite lb_loss,
  // never a crash. Each run is in a child process so that a crash fails only this test; the
  // child runs the test binary afresh ("threadsafe"): a device runtime (CUDA) the parent has
  // initialised cannot be used in a forked child.
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  for (auto [B, S] : std::vector<std::pair<int, int>>{{0, 4}, {2, 0}})
    for (double cf : {-1.0, 2.0})
      for (double lb : {0.0, 0.1}) {
        SCOPED_TRACE(::testing::Message()
                     << "B=" << B << " S=" << S << " cf=" << cf << " lb=" << lb);
        EXPECT_EXIT(std::_Exit(empty_batch_status(B, S, cf, lb)), ::testing::ExitedWithCode(0), "");
      }
}

TEST(LayerEdge, BackwardUsesTheInputOfItsForward) {
  // forward() "keeps what backward() needs": overwriting the caller's x between forward and
  // backward must not change the gradients.
  LayerConfig cfg = base(4, 2);
  cfg.shared_experts = 1;
  Rng rng(36);
  Params const p = Params::random(cfg, rng);
  Vec const x = rng.vec(2 * 3 * 6, -1, 1), dy = rng.vec(x.size(), -1, 1);
  LayerRun const want = run_layer<double, PolVendor>(cfg, p, x, 2, 3, dy);
  for (bool sparse : {true, false}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    LayerConfig c2 = cfg;
    c2.sparse_matmul = sparse;
    using Layer = moe::MoeLayer<double, PolVendor>;
    using V3 = moe::View3<double, MS>;
    Layer layer(c2);
    load_params(layer, p);
    auto xv = to_view<V3>(x, 2, 3, 6);
    V3 y("y", 2, 3, 6), dx("dx", 2, 3, 6);
    layer.forward(xv, y);
    Kokkos::deep_copy(xv, 0.5);  // the caller reuses its buffer
    Layer::params_type g;
    layer.backward(to_view<V3>(dy, 2, 3, 6), dx, g);
    EXPECT_TRUE(close(to_vec(g.gate), want.grads.gate, 1e-12)) << "d_gate";
    EXPECT_TRUE(close(to_vec(g.wi_0), want.grads.wi_0, 1e-12)) << "d_wi_0";
    EXPECT_TRUE(close(to_vec(g.shared_wi_1), want.grads.shared_wi_1, 1e-12)) << "d_shared_wi_1";
  }
}

TEST(LayerEdge, InPlaceForwardIsCorrectOrRejected) {
  // forward(x, x): either the right answer or a moe::Error, never a silently wrong output.
  LayerConfig cfg = base(4, 2);
  cfg.shared_experts = 1;
  Rng rng(37);
  Params const p = Params::random(cfg, rng);
  Vec const x = rng.vec(2 * 3 * 6, -1, 1);
  Output const ref = forward(cfg, p, x, 2, 3);
  for (bool sparse : {true, false}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    LayerConfig c2 = cfg;
    c2.sparse_matmul = sparse;
    using V3 = moe::View3<double, MS>;
    moe::MoeLayer<double, PolVendor> layer(c2);
    load_params(layer, p);
    auto xv = to_view<V3>(x, 2, 3, 6);
    try {
      layer.forward(xv, xv);
      EXPECT_TRUE(close(to_vec(xv), ref.y, 1e-12)) << "in-place output";
    } catch (moe::Error const&) {
    }
  }
}

TEST(LayerEdge, GradientsAreOverwrittenNotAccumulated) {
  LayerConfig cfg = base(4, 2);
  Rng rng(32);
  Params const p = Params::random(cfg, rng);
  using Layer = moe::MoeLayer<double, PolTiled>;
  using V3 = moe::View3<double, MS>;
  Layer layer(cfg);
  load_params(layer, p);
  Vec const x = rng.vec(2 * 3 * 6, -1, 1), dy = rng.vec(x.size(), -1, 1);
  auto xv = to_view<V3>(x, 2, 3, 6);
  auto dyv = to_view<V3>(dy, 2, 3, 6);
  V3 y("y", 2, 3, 6), dx("dx", 2, 3, 6);
  Layer::params_type g;
  layer.forward(xv, y);
  layer.backward(dyv, dx, g);
  Vec const first = to_vec(g.wo), first_gate = to_vec(g.gate);
  layer.forward(xv, y);
  layer.backward(dyv, dx, g);
  EXPECT_EQ(to_vec(g.wo), first);
  EXPECT_EQ(to_vec(g.gate), first_gate);
}

TEST(LayerEdge, NanInputWithCheckFiniteOffKeepsIdsInRange) {
  LayerConfig cfg = base(8, 2);
  cfg.check_finite = false;
  cfg.routed_score_func = ScoreFunc::Softmax;
  Rng rng(33);
  Params p = Params::random(cfg, rng);
  Vec x = rng.vec(2 * 4 * 6, -1, 1);
  x[3] = std::numeric_limits<double>::quiet_NaN();          // token 0
  for (int d = 0; d < 6; ++d) x[6 * 2 + d] = std::nan("");  // token 2 entirely
  x[6 * 5 + 1] = std::numeric_limits<double>::infinity();   // token 5
  auto check = [&](LayerRun const& r) {
    for (int e : r.ids) EXPECT_TRUE(e >= 0 && e < 8) << e;
    EXPECT_FALSE(std::isfinite(r.y[0])) << "NaN propagates to its token";
    EXPECT_TRUE(std::isfinite(r.y[6])) << "other tokens are unaffected";
  };
  check(run_layer<double, PolVendor>(cfg, p, x, 2, 4));
  check(run_layer<float, PolTiled>(cfg, p, x, 2, 4));
  check(run_layer<double, PolDense>(cfg, p, x, 2, 4));
  // NaN in one gate column: expert 5's logit is NaN for every token (then softmax: every score)
  p.gate[5] = std::nan("");
  Vec const x2 = rng.vec(2 * 4 * 6, -1, 1);
  for (auto const& r : {run_layer<double, PolVendor>(cfg, p, x2, 2, 4),
                        run_layer<float, PolDense>(cfg, p, x2, 2, 4)})
    for (int e : r.ids) EXPECT_TRUE(e >= 0 && e < 8) << e;
}

// ---- bad input --------------------------------------------------------------------------------

template <class E, class F>
void expect_throw_with(F&& f, std::vector<std::string> const& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an exception";
  } catch (E const& e) {
    std::string const msg = e.what();
    for (auto const& part : parts)
      EXPECT_NE(msg.find(part), std::string::npos)
          << "message '" << msg << "' lacks '" << part << "'";
  } catch (std::exception const& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

TEST(LayerErrors, WrongShapesThrowShapeError) {
  using Layer = moe::MoeLayer<double, PolVendor>;
  using V3 = moe::View3<double, MS>;
  LayerConfig cfg = base(4, 2);  // D = 6
  Layer layer(cfg);
  V3 x("x", 2, 3, 6), y("y", 2, 3, 6);
  expect_throw_with<moe::ShapeError>([&] { layer.forward(V3("x", 2, 3, 5), y); }, {"x", "5", "6"});
  expect_throw_with<moe::ShapeError>([&] { layer.forward(x, V3("y", 2, 4, 6)); }, {"y", "4"});
  expect_throw_with<moe::ShapeError>([&] { layer.forward(x, V3("y", 2, 3, 7)); }, {"y", "7"});
  layer.forward(x, y);
  Layer::params_type g;
  expect_throw_with<moe::ShapeError>(
      [&] { layer.backward(V3("dy", 2, 2, 6), V3("dx", 2, 3, 6), g); }, {"dy", "2"});
  expect_throw_with<moe::ShapeError>(
      [&] { layer.backward(V3("dy", 2, 3, 6), V3("dx", 2, 3, 4), g); }, {"dx", "4"});
  // wrong parameter shape
  Layer layer2(cfg);
  layer2.parameters().wi_0 = moe::View3<double, MS>("wi_0", 4, 6, 4);
  expect_throw_with<moe::ShapeError>([&] { layer2.forward(x, y); }, {"wi_0", "4,6,4", "4,6,5"});
  Layer layer3(cfg);
  layer3.parameters().gate = moe::View2<double, MS>("gate", 6, 3);
  expect_throw_with<moe::ShapeError>([&] { layer3.forward(x, y); }, {"gate", "6,3"});
}

TEST(LayerErrors, BackwardWithoutForwardThrows) {
  using Layer = moe::MoeLayer<double, PolVendor>;
  using V3 = moe::View3<double, MS>;
  Layer layer(base(4, 2));
  Layer::params_type g;
  EXPECT_THROW(layer.backward(V3("dy", 1, 2, 6), V3("dx", 1, 2, 6), g), moe::Error);
}

TEST(LayerErrors, BackwardIntoItsOwnDyThrows) {
  // dx sharing memory with dy would give wrong gradients (a shared expert reads dy after the
  // dispatch's backward has written dx): rejected, whole or in part, before anything runs.
  using Layer = moe::MoeLayer<double, PolVendor>;
  using V3 = moe::View3<double, MS>;
  LayerConfig cfg = base(4, 2);
  cfg.shared_experts = 1;
  Layer layer(cfg);
  V3 x("x", 2, 3, 6), y("y", 2, 3, 6);
  Kokkos::deep_copy(x, 0.25);
  layer.forward(x, y);
  Layer::params_type g;
  V3 dy("dy", 2, 3, 6);
  expect_throw_with<moe::InputError>([&] { layer.backward(dy, dy, g); },
                                     {"dx shares memory with dy", "separate array"});
  // One element in common: the last of dy is the first of dx.
  moe::View1<double, MS> both("both", 2 * 2 * 3 * 6 - 1);
  V3 const dy_part(both.data(), 2, 3, 6), dx_part(both.data() + 2 * 3 * 6 - 1, 2, 3, 6);
  expect_throw_with<moe::InputError>([&] { layer.backward(dy_part, dx_part, g); },
                                     {"dx shares memory with dy"});
  // Adjacent but apart is fine, and the rejected calls left the forward to use.
  moe::View1<double, MS> apart("apart", 2 * 2 * 3 * 6);
  EXPECT_NO_THROW(
      layer.backward(V3(apart.data(), 2, 3, 6), V3(apart.data() + 2 * 3 * 6, 2, 3, 6), g));
}

TEST(LayerErrors, BadConfigsThrowConfigError) {
  struct Bad {
    std::function<void(LayerConfig&)> f;
    std::vector<std::string> parts;
  };
  std::vector<Bad> const bad = {
      {[](LayerConfig& c) { c.num_experts_per_tok = 5; }, {"num_experts_per_tok=5", "4"}},
      {[](LayerConfig& c) { c.num_experts = -3; }, {"num_experts=-3"}},
      {[](LayerConfig& c) { c.num_experts_per_tok = 0; }, {"num_experts_per_tok=0"}},
      {[](LayerConfig& c) { c.base_emb_dim = -1; }, {"base_emb_dim=-1"}},
      {[](LayerConfig& c) { c.base_moe_mlp_dim = 0; }, {"base_moe_mlp_dim=0"}},
      {[](LayerConfig& c) { c.shared_experts = -2; }, {"shared_experts=-2"}},
      {[](LayerConfig& c) { c.load_balance_loss_weight = -0.1; }, {"load_balance_loss_weight"}},
      {[](LayerConfig& c) {
         c.decoder_block = DecoderBlock::DeepSeek;
         c.num_experts = 6;
         c.n_routing_groups = 4;
         c.topk_routing_group = 2;
       },
       {"num_experts=6", "n_routing_groups=4"}},
      {[](LayerConfig& c) {
         c.decoder_block = DecoderBlock::DeepSeek;
         c.num_experts = 8;
         c.n_routing_groups = 4;
         c.topk_routing_group = 5;
       },
       {"topk_routing_group=5"}},
      {[](LayerConfig& c) {
         c.num_experts = 8;
         c.n_routing_groups = 4;
         c.topk_routing_group = 2;
       },
       {"n_routing_groups=4", "deepseek"}},
      {[](LayerConfig& c) { c.routed_scaling_factor = 0; }, {"routed_scaling_factor=0"}},
      {[](LayerConfig& c) { c.routed_bias_update_rate = 0.01; }, {"routed_bias_update_rate"}},
  };
  for (std::size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "bad config #" << i);
    LayerConfig c = base(4, 2);
    bad[i].f(c);
    expect_throw_with<moe::ConfigError>([&] { c.validate(); }, bad[i].parts);
    expect_throw_with<moe::ConfigError>([&] { moe::MoeLayer<double, PolVendor> l(c); },
                                        bad[i].parts);
    expect_throw_with<moe::ConfigError>([&] { moe::MoeLayer<float, PolDense> l(c); }, bad[i].parts);
  }
  // a routing policy that contradicts the config
  expect_throw_with<moe::ConfigError>(
      [&] {
        moe::MoeLayer<double, moe::Policies<moe::routing::DeepSeek, moe::gmm::Vendor>> l(base());
      },
      {"DeepSeek"});
}

TEST(LayerErrors, NonFiniteInputsThrowInputError) {
  using Layer = moe::MoeLayer<double, PolVendor>;
  using V3 = moe::View3<double, MS>;
  LayerConfig cfg = base(4, 2);
  cfg.routed_bias = true;
  Rng rng(34);
  Params const p = Params::random(cfg, rng);
  Vec const x = rng.vec(2 * 3 * 6, -1, 1);
  auto run = [&](Params const& pp, Vec const& xx) {
    Layer layer(cfg);
    load_params(layer, pp);
    V3 y("y", 2, 3, 6);
    layer.forward(to_view<V3>(xx, 2, 3, 6), y);
  };
  Vec xn = x;
  xn[7] = std::nan("");
  expect_throw_with<moe::InputError>([&] { run(p, xn); }, {"x", "NaN"});
  Vec xi = x;
  xi[20] = -std::numeric_limits<double>::infinity();
  expect_throw_with<moe::InputError>([&] { run(p, xi); }, {"x"});
  Params pw = p;
  pw.wi_1[11] = std::numeric_limits<double>::infinity();
  expect_throw_with<moe::InputError>([&] { run(pw, x); }, {"wi_1"});
  Params pb = p;
  pb.gate_bias[2] = std::nan("");
  expect_throw_with<moe::InputError>([&] { run(pb, x); }, {"gate_bias"});
  Params pg = p;
  pg.gate[0] = std::nan("");
  expect_throw_with<moe::InputError>([&] { run(pg, x); }, {"gate"});
  // NaN in dy
  Layer layer(cfg);
  load_params(layer, p);
  V3 y("y", 2, 3, 6), dx("dx", 2, 3, 6);
  layer.forward(to_view<V3>(x, 2, 3, 6), y);
  Layer::params_type g;
  expect_throw_with<moe::InputError>([&] { layer.backward(to_view<V3>(xn, 2, 3, 6), dx, g); },
                                     {"dy"});
}

// ---- LayerConfig::set ---------------------------------------------------------------------------

// ----------------------------------------------------------------------------------------------
// The gated activations alone: gated_forward / gated_backward in float (branch-free exp) and
// double against the textbook formulas in long double, on a grid from -100 to 100.

template <class S>
void check_activation(moe::Activation act, double rel_tol) {
  std::vector<double> xs;
  for (double x = -100; x <= 100; x += 0.0371) xs.push_back(x);
  for (double x : {0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 86.9, -86.9, 87.1, -87.1, 88.5, -88.5})
    xs.push_back(x);
  std::int64_t const n = std::int64_t(xs.size());
  moe::View2<S, MS> h0("h0", n, 1), h1("h1", n, 1), a("a", n, 1), da("da", n, 1), dh0("dh0", n, 1),
      dh1("dh1", n, 1);
  auto hh0 = Kokkos::create_mirror_view(h0), hh1 = Kokkos::create_mirror_view(h1),
       hda = Kokkos::create_mirror_view(da);
  for (std::int64_t i = 0; i < n; ++i) {
    hh0(i, 0) = S(xs[std::size_t(i)]);
    hh1(i, 0) = S(1.5);
    hda(i, 0) = S(-0.75);
  }
  Kokkos::deep_copy(h0, hh0);
  Kokkos::deep_copy(h1, hh1);
  Kokkos::deep_copy(da, hda);
  Exec space;
  moe::nn::gated_forward(space, act, n, moe::View2<S const, MS>(h0), moe::View2<S const, MS>(h1),
                         a);
  moe::nn::gated_backward(space, act, n, moe::View2<S const, MS>(h0), moe::View2<S const, MS>(h1),
                          moe::View2<S const, MS>(da), dh0, dh1);
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
  auto hd0 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dh0);
  auto hd1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dh1);
  for (std::int64_t i = 0; i < n; ++i) {
    long double const x = (long double)hh0(i, 0);  // the value the kernel saw
    // f, f' and the sums of the absolute values of their terms (the scale of the rounding error
    // where terms cancel: gelu's 1 + tanh for x << 0, silu' near its root at x = -1.28).
    long double f, df, f_scale, df_scale;
    if (act == moe::Activation::Silu) {
      long double const sg = 1.0L / (1.0L + std::exp(-x));
      f = x * sg;
      df = sg * (1.0L + x * (1.0L - sg));
      f_scale = std::fabs(f);
      df_scale = sg * (1.0L + std::fabs(x) * (1.0L - sg));
    } else {
      long double const c = 0.7978845608028654L, k = 0.044715L;
      long double const th = std::tanh(c * (x + k * x * x * x));
      long double const dth = (1.0L - th * th) * c * (1.0L + 3.0L * k * x * x);
      f = 0.5L * x * (1.0L + th);
      df = 0.5L * (1.0L + th) + 0.5L * x * dth;
      f_scale = 0.5L * std::fabs(x) * (1.0L + std::fabs(th));
      df_scale = 0.5L * (1.0L + std::fabs(th)) + 0.5L * std::fabs(x) * dth;
    }
    // Relative to that scale; absolute (1e-25) in the tiny tails below x = -57, where float silu
    // clamps exp to exp(-87) instead of going subnormal.
    auto err = [&](double got, long double want, long double scale) {
      return double(std::fabs((long double)got - want) / std::max(scale, (long double)1e-25));
    };
    SCOPED_TRACE("x = " + std::to_string(double(x)));
    EXPECT_LE(err(double(ha(i, 0)), 1.5L * f, 1.5L * f_scale), rel_tol);
    EXPECT_LE(err(double(hd1(i, 0)), -0.75L * f, 0.75L * f_scale), rel_tol);
    EXPECT_LE(err(double(hd0(i, 0)), -0.75L * 1.5L * df, 0.75L * 1.5L * df_scale), rel_tol);
  }
  // NaN is carried through, never turned into a number.
  hh0(0, 0) = std::numeric_limits<S>::quiet_NaN();
  Kokkos::deep_copy(h0, hh0);
  moe::nn::gated_forward(space, act, 1, moe::View2<S const, MS>(h0), moe::View2<S const, MS>(h1),
                         a);
  moe::nn::gated_backward(space, act, 1, moe::View2<S const, MS>(h0), moe::View2<S const, MS>(h1),
                          moe::View2<S const, MS>(da), dh0, dh1);
  Kokkos::deep_copy(ha, a);
  Kokkos::deep_copy(hd0, dh0);
  EXPECT_TRUE(std::isnan(ha(0, 0)));
  EXPECT_TRUE(std::isnan(hd0(0, 0)));
}

TEST(Activation, SiluFloatMatchesReference) {
  check_activation<float>(moe::Activation::Silu, 2e-6);
}
TEST(Activation, GeluFloatMatchesReference) {
  check_activation<float>(moe::Activation::Gelu, 2e-6);
}
TEST(Activation, SiluDoubleMatchesReference) {
  check_activation<double>(moe::Activation::Silu, 1e-13);
}
TEST(Activation, GeluDoubleMatchesReference) {
  check_activation<double>(moe::Activation::Gelu, 1e-13);
}

/// A float [n, 1] view rounded into moe::bf16, and back (exact).
moe::View2<moe::bf16, MS> to_bf16(moe::View2<float, MS> const& v) {
  auto const h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  moe::View2<moe::bf16, MS> b("bf16", v.extent(0), 1);
  auto const hb = Kokkos::create_mirror_view(b);
  for (std::size_t i = 0; i < v.extent(0); ++i) hb(i, 0) = moe::bf16(h(i, 0));
  Kokkos::deep_copy(b, hb);
  return b;
}
moe::View2<float, MS> to_float(moe::View2<moe::bf16, MS> const& b) {
  auto const hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  moe::View2<float, MS> v("float", b.extent(0), 1);
  auto const h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < b.extent(0); ++i) h(i, 0) = float(hb(i, 0));
  Kokkos::deep_copy(v, h);
  return v;
}

// The bf16 scheme's casts fused into the activation (gated_forward / gated_backward with bf16) give
// the bits of the unfused sequence they replace: round h0 and h1, the activation, round a; round
// da, the backward, round dh0 and dh1. Both activations, float and double, values that are not
// bf16 (so every cast rounds), NaN and the clamped tails included; in float also on 16-bit
// storage (moe::bf16 views in and out, as the bf16 layer's hidden states).
template <class S>
void check_fused_bf16_casts(moe::Activation act) {
  std::int64_t const n = 4001;
  moe_ref::Rng rng(31);
  auto const v0 = rng.vec(std::size_t(n), -40, 40), v1 = rng.vec(std::size_t(n), -3, 3),
             vd = rng.vec(std::size_t(n), -2, 2);
  auto view = [&](moe_ref::Vec const& v) {
    return moe_ref::kk::to_view<moe::View2<S, MS>>(v, n, 1);
  };
  moe::View2<S, MS> h0 = view(v0), h1 = view(v1), da = view(vd);
  Kokkos::deep_copy(Kokkos::subview(h0, 0, 0), std::numeric_limits<S>::quiet_NaN());
  using C = moe::View2<S const, MS>;
  Exec space;
  moe::View2<S, MS> a("a", n, 1), dh0("dh0", n, 1), dh1("dh1", n, 1);
  moe::nn::gated_forward(space, act, n, C(h0), C(h1), a, true);
  moe::nn::gated_backward(space, act, n, C(h0), C(h1), C(da), dh0, dh1, true);
  // The unfused sequence on rounded copies.
  moe::View2<S, MS> r0("r0", n, 1), r1("r1", n, 1), rd("rd", n, 1), ra("ra", n, 1),
      rdh1("rdh1", n, 1);
  Kokkos::deep_copy(r0, h0);
  Kokkos::deep_copy(r1, h1);
  Kokkos::deep_copy(rd, da);
  for (auto const& v : {r0, r1, rd}) moe::detail::round_bf16(space, v);
  moe::nn::gated_forward(space, act, n, C(r0), C(r1), ra);
  moe::detail::round_bf16(space, ra);
  moe::nn::gated_backward(space, act, n, C(r0), C(r1), C(rd), rd, rdh1);  // dh0 into rd
  moe::detail::round_bf16(space, rd);
  moe::detail::round_bf16(space, rdh1);
  space.fence();
  auto bits_equal = [&](moe::View2<S, MS> const& x, moe::View2<S, MS> const& y, char const* what) {
    auto const hx = moe_ref::kk::to_vec(x), hy = moe_ref::kk::to_vec(y);
    for (std::size_t i = 0; i < hx.size(); ++i)
      if (!(hx[i] == hy[i] || (std::isnan(hx[i]) && std::isnan(hy[i]))))
        return ::testing::AssertionFailure()
               << what << "[" << i << "] fused " << hx[i] << ", unfused " << hy[i];
    return ::testing::AssertionSuccess();
  };
  EXPECT_TRUE(bits_equal(a, ra, "a"));
  EXPECT_TRUE(bits_equal(dh0, rd, "dh0"));
  EXPECT_TRUE(bits_equal(dh1, rdh1, "dh1"));
  if constexpr (std::is_same<S, float>::value) {
    // The same on 16-bit storage (the bf16 layer's hidden states): h0, h1, da held as moe::bf16
    // (the rounded values), a, dh0 (into da) and dh1 written as moe::bf16.
    using B = moe::View2<moe::bf16, MS>;
    B const b0 = to_bf16(h0), b1 = to_bf16(h1), bd = to_bf16(da), ba("ba", n, 1),
            bdh1("bdh1", n, 1);
    moe::nn::gated_forward(space, act, n, b0, b1, ba, true);
    moe::nn::gated_backward(space, act, n, b0, b1, bd, bd, bdh1, true);
    EXPECT_TRUE(bits_equal(to_float(ba), ra, "a (bf16 storage)"));
    EXPECT_TRUE(bits_equal(to_float(bd), rd, "dh0 (bf16 storage)"));
    EXPECT_TRUE(bits_equal(to_float(bdh1), rdh1, "dh1 (bf16 storage)"));
  }
}

TEST(Activation, FusedBf16CastsGiveTheUnfusedBits) {
  for (auto act : {moe::Activation::Silu, moe::Activation::Gelu}) {
    check_fused_bf16_casts<float>(act);
    check_fused_bf16_casts<double>(act);
  }
}

TEST(ConfigSet, UnknownKeyNamesTheKey) {
  LayerConfig c;
  expect_throw_with<moe::ConfigError>([&] { c.set("num_expert", "8"); }, {"num_expert"});
  expect_throw_with<moe::ConfigError>([&] { c.set("capacity", "1.0"); }, {"capacity"});
}

TEST(ConfigSet, BadValuesNameKeyAndValue) {
  std::vector<std::pair<std::string, std::string>> const bad = {
      {"num_experts", "eight"},          {"num_experts", "3.5"},
      {"num_experts_per_tok", ""},       {"base_emb_dim", "99999999999"},
      {"routed_bias", "maybe"},          {"norm_topk_prob", "2"},
      {"capacity_factor", "nan"},        {"capacity_factor", "1.0x"},
      {"routed_scaling_factor", "inf"},  {"routed_score_func", "relu"},
      {"decoder_block", "llama4"},       {"mlp_activations", "relu,linear"},
      {"mlp_activations", "silu,gelu"},  {"seed", "-4"},
      {"load_balance_loss_weight", "a"}, {"sparse_matmul", "yes please"},
  };
  for (auto const& kv : bad) {
    std::string const& k = kv.first;  // not a structured binding: the lambda below captures it
    std::string const& v = kv.second;
    SCOPED_TRACE(k + "=" + v);
    LayerConfig c;
    std::vector<std::string> parts = {k};
    if (!v.empty()) parts.push_back(v);
    expect_throw_with<moe::ConfigError>([&] { c.set(k, v); }, parts);
  }
}

TEST(ConfigSet, ParsesEveryKey) {
  LayerConfig c;
  c.set("num_experts", "16");
  c.set("num_experts_per_tok", " 4 ");
  c.set("base_emb_dim", "32");
  c.set("base_moe_mlp_dim", "48");
  c.set("decoder_block", "deepseek");
  c.set("routed_score_func", "sqrtsoftplus");
  c.set("routed_bias", "True");
  c.set("routed_scaling_factor", "2.5");
  c.set("n_routing_groups", "4");
  c.set("topk_routing_group", "2");
  c.set("norm_topk_prob", "false");
  c.set("use_random_routing", "false");
  c.set("seed", "12");
  c.set("capacity_factor", "1.25");
  c.set("load_balance_loss_weight", "0.01");
  c.set("routed_bias_update_rate", "0.001");
  c.set("mlp_activations", "[gelu, linear]");
  c.set("shared_experts", "1");
  c.set("sparse_matmul", "false");
  c.set("check_finite", "0");
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.base_emb_dim, 32);
  EXPECT_EQ(c.base_moe_mlp_dim, 48);
  EXPECT_EQ(c.decoder_block, DecoderBlock::DeepSeek);
  EXPECT_EQ(c.routed_score_func, ScoreFunc::SqrtSoftplus);
  EXPECT_TRUE(c.routed_bias);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.n_routing_groups, 4);
  EXPECT_EQ(c.topk_routing_group, 2);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.seed, 12u);
  EXPECT_EQ(c.capacity_factor, 1.25);
  EXPECT_EQ(c.load_balance_loss_weight, 0.01);
  EXPECT_EQ(c.routed_bias_update_rate, 0.001);
  EXPECT_EQ(c.mlp_activation, Activation::Gelu);
  EXPECT_EQ(c.shared_experts, 1);
  EXPECT_FALSE(c.sparse_matmul);
  EXPECT_FALSE(c.check_finite);
  EXPECT_NO_THROW(c.validate());
  c.set("routed_score_func", "");
  EXPECT_EQ(c.routed_score_func, ScoreFunc::None);
  c.set("mlp_activations", "silu");
  EXPECT_EQ(c.mlp_activation, Activation::Silu);
  for (auto const& k : LayerConfig::keys()) EXPECT_TRUE(LayerConfig::has_key(k)) << k;
  EXPECT_FALSE(LayerConfig::has_key("num_expert"));
}

// ---- packed expert weights follow every write ----------------------------------------------

/// A float layer with OneDnn forced into its packed path: after each way of writing the weights,
/// the next forward and backward equal those of a fresh layer built with the new weights.
TEST(LayerPackedWeights, NextForwardSeesEveryWrite) {
  ForcePackedOneDnn packed;
  LayerConfig cfg = base(4, 2, 8, 6);
  cfg.shared_experts = 1;
  Rng rng(77);
  Params p = Params::random(cfg, rng);
  int const B = 2, S = 5, D = cfg.base_emb_dim;
  Vec const x = rng.vec(std::size_t(B) * S * D, -1, 1), dy = rng.vec(x.size(), -1, 1);
  using Layer = moe::MoeLayer<float, PolOneDnn>;
  using V3 = moe::View3<float, MS>;
  Layer layer(cfg);
  load_params(layer, p);
  auto const xv = to_view<V3>(x, B, S, D);
  auto const dyv = to_view<V3>(dy, B, S, D);
  auto check = [&](char const* what) {
    SCOPED_TRACE(what);
    V3 y("y", B, S, D), dx("dx", B, S, D);
    Layer::params_type g;
    layer.forward(xv, y);
    layer.backward(dyv, dx, g);
    LayerRun const fresh = run_layer<float, PolOneDnn>(cfg, p, x, B, S, dy);
    EXPECT_TRUE(close(to_vec(y), fresh.y, 1e-6, 1e-6));
    EXPECT_TRUE(close(to_vec(dx), fresh.dx, 1e-6, 1e-6));
    EXPECT_TRUE(close(to_vec(g.wi_0), fresh.grads.wi_0, 1e-6, 1e-6));
  };
  // Writes new expert weights through a host copy into the views `params` refers to.
  auto write = [&](Layer::params_type const& params, double scale) {
    for (auto* v : {&p.wi_0, &p.wi_1, &p.wo})
      for (auto& e : *v) e *= scale;
    moe_ref::kk::fill_view(params.wi_0, p.wi_0);
    moe_ref::kk::fill_view(params.wi_1, p.wi_1);
    moe_ref::kk::fill_view(params.wo, p.wo);
  };
  check("first forward");
  check("same weights again");
  std::uint64_t const packs = layer.pack_cache().packs();
  bool const packing = MOE_HAS_ONEDNN;  // without oneDNN nothing is packed, results still hold
  EXPECT_EQ(packs > 0, packing);
  check("third forward");
  EXPECT_EQ(layer.pack_cache().packs(), packs) << "unchanged weights must not be repacked";

  write(layer.parameters(), 0.5);  // non-const access: a write
  check("after writing through parameters()");

  Layer::params_type const& kept = std::as_const(layer).parameters();
  write(kept, -1.5);  // an optimizer holding the views, then declaring the update
  layer.weights_changed();
  check("after weights_changed()");
  EXPECT_EQ(layer.pack_cache().stale_caught(), 0u);

  write(kept, 0.25);  // the same without declaring it: the sampled values catch it
  check("after an undeclared write");
  EXPECT_EQ(layer.pack_cache().stale_caught() > 0, packing);
}

}  // namespace

// ------------------------------------------------------------------ the bf16 scheme
// (docs/precision.md): a float layer with dtype=bfloat16 against the same layer computed in
// float64 without rounding, forward and every gradient, within the bf16 bound of
// docs/precision.md; that the rounding really happens where the scheme says (outputs and routing
// weights are bf16 values, the float32_* keys change what is rounded); the rounded copy of the
// weights follows every new weights version and is not remade otherwise; the keys and their
// errors. In this file so that it reuses its layer instantiations (compile time).

namespace bf16_scheme {

// The names and layer types of the file's anonymous namespace: float on PolOneDnn (Vendor
// without oneDNN), the float64 reference on PolVendor, and the dense path (PolDense).

constexpr double kU = 1.0 / 256;  // bf16's unit roundoff, 2^-8

bool is_bf16(double v) {
  float const f = float(v);
  return double(f) == v && moe::detail::bf16_to_float(moe::detail::bf16_bits(f)) == f;
}
std::size_t count_bf16(Vec const& v) {
  return std::size_t(std::count_if(v.begin(), v.end(), is_bf16));
}

/// |got - ref| <= c * u * (|ref| + rms(ref)) for every element (docs/precision.md); reports the
/// worst ratio of error to bound.
::testing::AssertionResult within_bf16(Vec const& got, Vec const& ref, double c, char const* what) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  double ss = 0;
  for (double r : ref) ss += r * r;
  double const rms = ref.empty() ? 0 : std::sqrt(ss / double(ref.size()));
  double worst = 0;
  std::size_t wi = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return ::testing::AssertionFailure() << what << ": not finite";
    double const r = std::fabs(got[i] - ref[i]) / (c * kU * (std::fabs(ref[i]) + rms));
    if (r > worst) worst = r, wi = i;
  }
  std::printf("bf16 %-12s worst error / bound %.3f\n", what, worst);
  if (worst <= 1) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": element " << wi << " is " << got[wi] << ", the float64 value " << ref[wi]
         << ": " << worst << " x the bound " << c << " u (|ref| + rms " << rms << ")";
}

struct Case {
  char const* name;
  LayerConfig cfg;
  bool dense = false;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  LayerConfig c;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.base_emb_dim = 32;
  c.base_moe_mlp_dim = 48;
  c.use_random_routing = true;  // the selection cannot flip under rounding
  c.seed = 5;
  out.push_back({"random", c});
  LayerConfig s = c;
  s.shared_experts = 1;
  s.mlp_activation = Activation::Gelu;
  out.push_back({"shared+gelu", s});
  out.push_back({"dense", c, true});
  LayerConfig m = c;  // softmax top-k; the inputs below route alike in bf16 and float64
  m.use_random_routing = false;
  m.routed_score_func = ScoreFunc::Softmax;
  m.load_balance_loss_weight = 0.01;
  out.push_back({"softmax", m});
  LayerConfig d = m;
  d.decoder_block = DecoderBlock::DeepSeek;
  d.routed_score_func = ScoreFunc::Sigmoid;
  d.routed_bias = true;
  d.n_routing_groups = 2;
  d.topk_routing_group = 1;
  d.routed_scaling_factor = 2.5;
  out.push_back({"deepseek", d});
  return out;
}

LayerRun run(Case const& k, bool bf16, Params const& p, Vec const& x, Vec const& dy, int B, int S) {
  LayerConfig cfg = k.cfg;
  cfg.dtype = bf16 ? moe::ComputeDtype::BFloat16 : moe::ComputeDtype::Native;
  if (bf16)
    return k.dense ? run_layer<float, PolDense>(cfg, p, x, B, S, dy)
                   : run_layer<float, PolOneDnn>(cfg, p, x, B, S, dy);
  return k.dense ? run_layer<double, PolDense>(cfg, p, x, B, S, dy)
                 : run_layer<double, PolVendor>(cfg, p, x, B, S, dy);
}

TEST(Bf16Scheme, RoundKernelIsTheScalarConversion) {
  std::vector<float> vals = {0.0f,
                             -0.0f,
                             1.0f,
                             1.00390625f,
                             1.005859375f,
                             -3.14159f,
                             1e-40f,
                             -1e-39f,
                             3.4e38f,
                             std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
  moe::View1<float, MS> v("v", vals.size());
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < vals.size(); ++i) h(i) = vals[i];
  Kokkos::deep_copy(v, h);
  moe::detail::round_bf16(Exec(), v);
  Kokkos::deep_copy(h, v);
  for (std::size_t i = 0; i < vals.size(); ++i) {
    float const want = float(moe::bf16(vals[i]));
    if (std::isnan(want))
      EXPECT_TRUE(std::isnan(h(i))) << i;
    else
      EXPECT_EQ(moe::detail::float_bits(h(i)), moe::detail::float_bits(want)) << vals[i];
  }
}

TEST(Bf16Scheme, LayerMatchesFloat64WithinTheBf16Bound) {
  int const B = 2, S = 8;
  for (auto const& k : cases()) {
    SCOPED_TRACE(k.name);
    Rng rng(11);
    Params const p = Params::random(k.cfg, rng, 2.0);
    Vec const x = rng.vec(std::size_t(B * S * k.cfg.base_emb_dim), -1, 1);
    Vec const dy = rng.vec(x.size(), -1, 1);
    LayerRun const bf = run(k, true, p, x, dy, B, S);
    LayerRun const ref = run(k, false, p, x, dy, B, S);
    // The bound speaks of the same routing: these inputs route alike (asserted, so that a
    // change of inputs that flips a near tie says so instead of failing on the bound).
    ASSERT_EQ(bf.ids, ref.ids);
    ASSERT_EQ(bf.kept, ref.kept);
    EXPECT_TRUE(within_bf16(bf.y, ref.y, 8, "y"));
    EXPECT_TRUE(within_bf16(bf.dx, ref.dx, 16, "dx"));
    ref.grads.for_each([&](char const* n, Vec const& g) {
      bf.grads.for_each([&](char const* n2, Vec const& gb) {
        if (std::string(n) == n2) {
          EXPECT_TRUE(within_bf16(gb, g, 16, n));
        }
      });
    });
    // Rounded where the scheme says: y and dx are bf16 values; the weight gradients (fp32
    // accumulation) are not; and bf16 is not fp32 (the float32 layer differs from it).
    EXPECT_EQ(count_bf16(bf.y), bf.y.size());
    EXPECT_EQ(count_bf16(bf.dx), bf.dx.size());
    EXPECT_LT(count_bf16(bf.grads.wi_0), bf.grads.wi_0.size() / 2);
    LayerConfig f32 = k.cfg;
    LayerRun const fl = k.dense ? run_layer<float, PolDense>(f32, p, x, B, S, dy)
                                : run_layer<float, PolOneDnn>(f32, p, x, B, S, dy);
    EXPECT_LT(count_bf16(fl.y), fl.y.size() / 2);
    double dmax = 0;
    for (std::size_t i = 0; i < fl.y.size(); ++i)
      dmax = std::max(dmax, std::fabs(fl.y[i] - bf.y[i]));
    EXPECT_GT(dmax, 0.0);
  }
}

TEST(Bf16Scheme, Float32KeysChooseWhatIsRounded) {
  int const B = 1, S = 8;
  Case k = cases()[3];  // softmax top-k
  k.cfg.dtype = moe::ComputeDtype::BFloat16;
  Rng rng(3);
  Params const p = Params::random(k.cfg, rng, 2.0);
  Vec const x = rng.vec(std::size_t(B * S * k.cfg.base_emb_dim), -1, 1);
  // float32_weight_sum (default true): the routing weights stay fp32; false: bf16.
  LayerRun const w32 = run_layer<float, PolOneDnn>(k.cfg, p, x, B, S);
  EXPECT_LT(count_bf16(w32.weights), w32.weights.size() / 2);
  LayerConfig w16 = k.cfg;
  w16.float32_weight_sum = false;
  LayerRun const r16 = run_layer<float, PolOneDnn>(w16, p, x, B, S);
  EXPECT_EQ(count_bf16(r16.weights), r16.weights.size());
  EXPECT_NE(r16.y, w32.y);
  // float32_gate_logits: fp32 gate and logits change the scores, so the weights.
  LayerConfig g32 = k.cfg;
  g32.float32_gate_logits = true;
  LayerRun const rg = run_layer<float, PolOneDnn>(g32, p, x, B, S);
  EXPECT_NE(rg.weights, w32.weights);
}

TEST(Bf16Scheme, RoundedWeightsFollowEveryNewVersionOnly) {
  using Layer = moe::MoeLayer<float, PolOneDnn>;
  LayerConfig cfg = cases()[0].cfg;
  cfg.dtype = moe::ComputeDtype::BFloat16;
  int const B = 1, S = 4, D = cfg.base_emb_dim;
  Rng rng(7);
  Params const p1 = Params::random(cfg, rng), p2 = Params::random(cfg, rng);
  Vec const x = rng.vec(std::size_t(B * S * D), -1, 1);
  using V3 = moe::View3<float, MS>;
  auto xv = moe_ref::kk::to_view<V3>(x, B, S, D);
  V3 y("y", B, S, D);
  Layer layer(cfg);
  moe_ref::kk::load_params(layer, p1);
  layer.forward(xv, y);
  auto const v1 = layer.weights_version();
  layer.forward(xv, y);  // same weights: the rounded copy is kept, no new version
  EXPECT_EQ(layer.weights_version(), v1);
  moe_ref::kk::load_params(layer, p2);  // a write: the next forward rounds p2
  layer.forward(xv, y);
  EXPECT_GT(layer.weights_version(), v1);
  Vec const want = run_layer<float, PolOneDnn>(cfg, p2, x, B, S).y;
  EXPECT_EQ(moe_ref::kk::to_vec(y), want);
}

// The routed rows in 16 bits (x_local, y_local, dy_local of a layer on oneDNN): the expert FFN
// gives the bits it gives on float rows holding the same bf16 values (its outputs rounded), and
// the same dx rows and weight gradients, on groups of several sizes (empty, few-row, chunked).
TEST(Bf16Scheme, ExpertFfnOn16BitRowsGivesTheBitsOfFloatRows) {
  using Ffn = moe::nn::ExpertFfn<float, moe::gmm::Auto, Exec>;
  if constexpr (!moe::nn::stores_bf16<float, moe::gmm::Auto, Exec>) {
    GTEST_SKIP() << "16-bit rows need the oneDNN GEMM policy";
  } else {
    using V2 = moe::View2<float, MS>;
    using V3 = moe::View3<float, MS>;
    using B2 = moe::View2<moe::bf16, MS>;
    Exec space;
    int const D = 32, F = 48;
    std::vector<std::int64_t> const sizes = {5, 0, 1, 70};
    int const G = int(sizes.size());
    std::int64_t n = 0;
    for (auto r : sizes) n += r;
    auto const groups = moe::gmm::make_groups(space, sizes);
    Rng rng(21);
    auto rounded = [&](std::size_t count) {
      Vec v = rng.vec(count, -1, 1);
      for (auto& e : v) e = double(moe::detail::round_to_bf16(float(e)));
      return v;
    };
    auto const wi_0 = to_view<V3>(rounded(std::size_t(G * D * F)), G, D, F);
    auto const wi_1 = to_view<V3>(rounded(std::size_t(G * D * F)), G, D, F);
    auto const wo = to_view<V3>(rounded(std::size_t(G * F * D)), G, F, D);
    auto const xs = to_view<V2>(rounded(std::size_t(n * D)), n, D);
    auto const dys = to_view<V2>(rounded(std::size_t(n * D)), n, D);
    auto narrow = [&](V2 const& v) {
      B2 b("b", v.extent(0), v.extent(1));
      moe::detail::copy_into(space, v, b, false);
      return b;
    };
    auto widen = [&](B2 const& b) {
      V2 v("v", b.extent(0), b.extent(1));
      moe::detail::copy_into(space, b, v, false);
      return to_vec(v);
    };
    Ffn wide, half;
    wide.bf16 = half.bf16 = true;
    V2 ys("ys", n, D);
    B2 ys16("ys16", n, D);
    wide.forward(space, moe::Activation::Silu, xs, groups, wi_0, wi_1, wo, ys, 1);
    half.forward(space, moe::Activation::Silu, narrow(xs), groups, wi_0, wi_1, wo, ys16, 1);
    EXPECT_EQ(widen(ys16), to_vec(ys)) << "y rows";
    V3 g0("g0", G, D, F), g1("g1", G, D, F), go("go", G, F, D);
    V3 h0("h0", G, D, F), h1("h1", G, D, F), ho("ho", G, F, D);
    V2 dxs("dxs", n, D);
    auto const dys16 = narrow(dys);
    wide.backward(space, dys, groups, wi_0, wi_1, wo, dys, g0, g1, go);  // dx overwrites dy
    half.backward(space, dys16, groups, wi_0, wi_1, wo, dxs, h0, h1, ho);
    EXPECT_EQ(to_vec(dxs), to_vec(dys)) << "dx rows";
    EXPECT_EQ(to_vec(h0), to_vec(g0)) << "d wi_0";
    EXPECT_EQ(to_vec(h1), to_vec(g1)) << "d wi_1";
    EXPECT_EQ(to_vec(ho), to_vec(go)) << "d wo";
  }
}

TEST(Bf16Scheme, DtypeKey) {
  LayerConfig c;
  EXPECT_FALSE(c.bf16());
  c.set("dtype", "bfloat16");
  EXPECT_TRUE(c.bf16());
  c.set("dtype", "float64");
  EXPECT_FALSE(c.bf16());
  c.set("float32_weight_sum", "false");
  c.set("float32_gate_logits", "true");
  EXPECT_FALSE(c.float32_weight_sum);
  EXPECT_TRUE(c.float32_gate_logits);
  try {
    c.set("dtype", "float16");
    FAIL() << "dtype=float16 was accepted";
  } catch (moe::ConfigError const& e) {
    EXPECT_NE(std::string(e.what()).find("dtype=float16 is not supported (float32 | bfloat16)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace bf16_scheme
