// The bf16 scheme (docs/precision.md): a MoeLayer<float> with dtype=bfloat16 against the same
// layer computed in float64 without rounding (itself checked against moe_ref in test_layer.cpp),
// forward and every gradient, within the bf16 bound of docs/precision.md; that the rounding
// really happens where the scheme says (outputs and routing weights are bf16 values, the
// float32_* keys change what is rounded); the rounded copy of the weights follows every new
// weights version and is not remade otherwise; the keys and their errors.
#include "reference.hpp"

#include <moe/config.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/layer.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace moe_ref;
using moe_ref::kk::LayerRun;
using moe_ref::kk::run_layer;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using Pol = moe::DefaultPolicies;
using PolDense = moe::Policies<moe::routing::Auto, moe::gmm::Dense>;

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
                   : run_layer<float, Pol>(cfg, p, x, B, S, dy);
  return k.dense ? run_layer<double, PolDense>(cfg, p, x, B, S, dy)
                 : run_layer<double, Pol>(cfg, p, x, B, S, dy);
}

}  // namespace

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
                                : run_layer<float, Pol>(f32, p, x, B, S, dy);
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
  LayerRun const w32 = run_layer<float, Pol>(k.cfg, p, x, B, S);
  EXPECT_LT(count_bf16(w32.weights), w32.weights.size() / 2);
  LayerConfig w16 = k.cfg;
  w16.float32_weight_sum = false;
  LayerRun const r16 = run_layer<float, Pol>(w16, p, x, B, S);
  EXPECT_EQ(count_bf16(r16.weights), r16.weights.size());
  EXPECT_NE(r16.y, w32.y);
  // float32_gate_logits: fp32 gate and logits change the scores, so the weights.
  LayerConfig g32 = k.cfg;
  g32.float32_gate_logits = true;
  LayerRun const rg = run_layer<float, Pol>(g32, p, x, B, S);
  EXPECT_NE(rg.weights, w32.weights);
}

TEST(Bf16Scheme, RoundedWeightsFollowEveryNewVersionOnly) {
  using Layer = moe::MoeLayer<float>;
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
  Vec const want = run_layer<float, Pol>(cfg, p2, x, B, S).y;
  EXPECT_EQ(moe_ref::kk::to_vec(y), want);
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
