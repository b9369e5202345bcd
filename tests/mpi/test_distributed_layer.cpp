// Every layout of the distributed layer gives the single-rank result: outputs, the load-balance
// loss, the bias update and every gradient (double precision, tolerance for reassociation only).
// The same in float (the oneDNN GEMM backend where moe has it, also forced into its packed-weight
// path), over two steps with the weights rewritten between them: the second step must see the
// new weights on every layout (FSDP gathers, local expert shards, replicated weights).
#include <moe/distributed/layer.hpp>
#include <moe/layer.hpp>
#include "unit/reference.hpp"

#include <gtest/gtest.h>

#include <moe/comm/mpi.hpp>
#include "layout_cases.hpp"

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;
struct Global {
  std::map<std::string, std::vector<double>> t;
  std::map<std::string, std::vector<std::int64_t>> shape;
};

std::vector<double> randn(std::size_t n, double scale, std::mt19937_64& g) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

template <class V>
void fill(V const& v, std::vector<double> const& vals) {
  ASSERT_EQ(v.span(), vals.size());
  std::copy(vals.begin(), vals.end(), v.data());
}
template <class V>
std::vector<double> values(V const& v) {
  return std::vector<double>(v.data(), v.data() + v.span());
}

void expect_close(std::vector<double> const& got, std::vector<double> const& want,
                  std::string const& what, double rel = 1e-11) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-30, err = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    err = std::max(err, std::abs(got[i] - want[i]));
  }
  EXPECT_LE(err, rel * scale + rel * 1e-3)
      << what << ": max error " << err << " (scale " << scale << ")";
}

using Case = LayoutCase;

/// How run_case calls the layers beyond the case itself.
struct Calls {
  std::int64_t batch = 0;          ///< > 0: built for the case's batch, set_batch_shape(batch, 4)
  std::uint64_t token_offset = 0;  ///< ForwardOptions::token_offset of both layers
};

/// One layout case: `steps` forward/backward pairs of the distributed layer against the
/// single-rank layer, in Scalar; between steps both get new expert weights, written the way
/// train_moe writes them (through the views they hold, then weights_changed()).
template <class Scalar>
void run_case(Case const& c, int steps = 1, Calls const& calls = {}) {
  using Single = moe::MoeLayer<Scalar>;
  double const rel = std::is_same<Scalar, float>::value ? 2e-4 : 1e-11;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  moe::LayerConfig const cfg = test_layer_config(0.05, c.layer);
  moe::ParallelConfig par;
  for (auto const& kv : c.layout) {
    auto eq = kv.find('=');
    par.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  std::int64_t const B = calls.batch > 0 ? calls.batch : c.batch, S = 4;
  std::int64_t const D = cfg.base_emb_dim, E = cfg.num_experts;
  std::int64_t const F = cfg.base_moe_mlp_dim, Fs = cfg.shared_mlp_dim();
  // Global tensors, the same on every rank.
  std::mt19937_64 gen(42);
  Global g;
  auto add = [&](std::string n, std::vector<std::int64_t> shape, double scale) {
    std::size_t m = 1;
    for (auto e : shape) m *= std::size_t(e);
    g.t[n] = randn(m, scale, gen);
    g.shape[n] = shape;
  };
  add("x", {B, S, D}, 1.0);
  add("dy", {B, S, D}, 1.0);
  add("gate", {D, E}, 0.5);
  if (cfg.routed_bias) {
    add("gate_bias", {E}, 0.1);
    for (std::size_t e = 0; e < c.bias_boost.size(); ++e) g.t["gate_bias"][e] += c.bias_boost[e];
  }
  add("wi_0", {E, D, F}, 0.3);
  add("wi_1", {E, D, F}, 0.3);
  add("wo", {E, F, D}, 0.3);
  if (Fs > 0) {
    add("shared_wi_0", {D, Fs}, 0.3);
    add("shared_wi_1", {D, Fs}, 0.3);
    add("shared_wo", {Fs, D}, 0.3);
  }
  moe::DistributedMoeLayer<Scalar> layer(MPI_COMM_WORLD, cfg, par, c.batch, S);
  layer.set_batch_shape(B, S);
  ASSERT_EQ(layer.batch_shape(), std::make_pair(B, S));
  auto const& params = std::as_const(layer).parameters();
  params.for_each(
      [&](char const* n, auto const& v) { fill(v, take_block(g.t[n], layer.block(n))); });
  layer.weights_changed();
  for (int step = 0; step < steps; ++step) {
    std::string const what = c.name + " step " + std::to_string(step);
    if (step > 0) {  // new expert weights, written through the views the layer holds
      for (char const* n : {"wi_0", "wi_1", "wo"})
        for (auto& e : g.t[n]) e *= -0.75;
      params.for_each(
          [&](char const* n, auto const& v) { fill(v, take_block(g.t[n], layer.block(n))); });
      layer.weights_changed();
    }
    // Reference: a new single-rank layer (nothing cached) on the whole batch.
    Single ref(cfg);
    ref.parameters().for_each([&](char const* n, auto const& v) { fill(v, g.t[n]); });
    moe::View3<Scalar, Mem> x("x", B, S, D), y("y", B, S, D), dy("dy", B, S, D), dx("dx", B, S, D);
    fill(x, g.t["x"]);
    fill(dy, g.t["dy"]);
    ref.forward(x, y, {calls.token_offset});
    typename Single::params_type rg;
    ref.backward(dy, dx, rg);

    auto const xb = layer.block("x");  // [B/batch parts, S, D] (EP-TP: D / ep columns)
    std::int64_t const bl = xb.local_shape[0], Dl = xb.local_shape[2];
    moe::View3<Scalar, Mem> lx("lx", bl, S, Dl), ly("ly", bl, S, Dl);
    moe::View3<Scalar, Mem> ldy("ldy", bl, S, Dl), ldx("ldx", bl, S, Dl);
    fill(lx, take_block(g.t["x"], xb));
    fill(ldy, take_block(g.t["dy"], xb));
    layer.forward(lx, ly, {calls.token_offset});
    typename moe::DistributedMoeLayer<Scalar>::params_type lg;
    layer.backward(ldy, ldx, lg);

    expect_close(values(ly), take_block(values(y), xb), what + " y", rel);
    expect_close(values(ldx), take_block(values(dx), xb), what + " dx", rel);
    EXPECT_NEAR(layer.lb_loss(), ref.lb_loss(), rel * std::abs(ref.lb_loss()) + 1e-15) << what;
    if (std::is_same<Scalar, double>::value) {
      EXPECT_EQ(layer.bias_update(), ref.bias_update()) << what;
    }
    rg.for_each([&](char const* n, auto const& v) {
      std::vector<double> got;
      lg.for_each([&](char const* m, auto const& w) {
        if (std::string(m) == n) got = values(w);
      });
      expect_close(got, take_block(values(v), layer.block(n)), what + " d_" + n, rel);
    });
    // Routing outputs of this rank's tokens.
    auto const ids = values(layer.weights());
    auto const all_w = values(ref.weights());
    moe::TensorBlock wb{{B, S, cfg.num_experts_per_tok},
                        {xb.local_shape[0], S, cfg.num_experts_per_tok},
                        {xb.offset[0], 0, 0}};
    expect_close(ids, take_block(all_w, wb), what + " weights", rel);
  }
}

std::vector<Case> cases(int n) { return layout_cases(n); }

TEST(DistributedLayer, EveryLayoutMatchesTheSingleRankLayer) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<double>(c, 2);
  }
}

TEST(DistributedLayer, EveryLayoutMatchesTheSingleRankLayerInFloat) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<float>(c, 2);
  }
}

// Collectives in segments of 256 bytes (comm/segments.hpp; the default is 64 MiB): every
// gather, reduce-scatter and all-reduce of every layout moves its tensors many tiles at a time,
// and the layer still matches the single-rank layer.
TEST(DistributedLayer, EveryLayoutMatchesTheSingleRankLayerInSegments) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  struct Segments {
    std::int64_t saved = moe::comm::detail::segment_bytes();
    Segments() { moe::comm::detail::segment_bytes() = 256; }
    ~Segments() { moe::comm::detail::segment_bytes() = saved; }
  } segments;
  for (auto const& c : cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<double>(c, 1);
  }
  for (auto const& c : ep_tp_cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<double>(c, 1);
  }
}

// EP-TP: the tokens split on D over the expert axis (ctest also runs these alone at 8 ranks).
TEST(DistributedLayer, EpTpMatchesTheSingleRankLayer) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : ep_tp_cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<double>(c, 2);
  }
}

TEST(DistributedLayer, EpTpMatchesTheSingleRankLayerInFloat) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : ep_tp_cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<float>(c, 2);
  }
}

// A layer built for one global batch and re-planned for another (set_batch_shape: twice the
// batch), called with a token offset: random routing draws from the global token index, so the
// offset must reach every layout's routing the way it reaches the single-rank layer's.
TEST(DistributedLayer, NewBatchShapeAndTokenOffsetMatchTheSingleRankLayer) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto c : cases(n)) {
    SCOPED_TRACE(c.name);
    c.layer.push_back("use_random_routing=true");
    c.layer.push_back("seed=11");
    run_case<double>(c, 1, Calls{2 * c.batch, 1000});
  }
}

// A batch shape whose layout does not divide is the same ConfigError on every rank, and the
// layer keeps its plan: the next step on the old shape still runs.
TEST(DistributedLayer, BadNewBatchShapeThrowsAndKeepsThePlan) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n < 2) GTEST_SKIP() << "needs 2 or more ranks";
  moe::LayerConfig const cfg = test_layer_config();
  moe::ParallelConfig par;
  par.ici_data_parallelism = -1;
  std::int64_t const B = 2 * n, S = 4, D = cfg.base_emb_dim;
  moe::DistributedMoeLayer<double> layer(MPI_COMM_WORLD, cfg, par, B, S);
  try {
    layer.set_batch_shape(n + 1, S);
    ADD_FAILURE() << "no ConfigError for a batch of " << n + 1 << " over " << n << " ranks";
  } catch (moe::ConfigError const& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(n + 1)), std::string::npos) << e.what();
  }
  EXPECT_EQ(layer.batch_shape(), std::make_pair(B, S));
  moe::View3<double, Mem> x("x", 2, S, D), y("y", 2, S, D);
  Kokkos::deep_copy(x, 0.25);
  layer.forward(x, y);
}

TEST(DistributedLayer, EveryLayoutMatchesTheSingleRankLayerWithPackedWeights) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  moe_ref::kk::ForcePackedOneDnn packed;
  for (auto const& c : cases(n)) {
    SCOPED_TRACE(c.name);
    run_case<float>(c, 2);
  }
}

}  // namespace

namespace {

// ragged_buffer_factor = 1 at 2 ranks with every token routed to the first expert shard: rank 0
// receives 2*T*K rows but keeps T*K, its own (lower-rank senders first), so rank 0's tokens get
// the full output and rank 1's tokens only the shared expert's.
TEST(DistributedLayer, RaggedBufferFactorDropsTheHigherRankSendersRows) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 2) GTEST_SKIP() << "needs exactly 2 ranks";
  moe::LayerConfig cfg = test_layer_config();
  cfg.routed_bias = true;
  moe::ParallelConfig par;
  par.ici_expert_parallelism = 2;
  par.ragged_buffer_factor = 1.0;
  std::int64_t const B = 8, S = 4, D = 16, E = 8, F = 8;
  std::mt19937_64 gen(7);
  std::map<std::string, std::vector<double>> t;
  t["x"] = randn(B * S * D, 1.0, gen);
  t["gate"] = randn(D * E, 0.5, gen);
  t["gate_bias"] = {50, 40, 0, 0, 0, 0, 0, 0};
  t["wi_0"] = randn(E * D * F, 0.3, gen);
  t["wi_1"] = randn(E * D * F, 0.3, gen);
  t["wo"] = randn(E * F * D, 0.3, gen);
  t["shared_wi_0"] = randn(D * F, 0.3, gen);
  t["shared_wi_1"] = randn(D * F, 0.3, gen);
  t["shared_wo"] = randn(F * D, 0.3, gen);
  auto reference = [&](bool routed) {
    moe::MoeLayer<double> ref(cfg);
    ref.parameters().for_each([&](char const* name, auto const& v) {
      std::vector<double> vals = t[name];
      if (!routed && std::string(name) == "wo") std::fill(vals.begin(), vals.end(), 0.0);
      fill(v, vals);
    });
    moe::View3<double, Mem> x("x", B, S, D), y("y", B, S, D);
    fill(x, t["x"]);
    ref.forward(x, y);
    return values(y);
  };
  moe::DistributedMoeLayer<double> layer(MPI_COMM_WORLD, cfg, par, B, S);
  layer.parameters().for_each(
      [&](char const* name, auto const& v) { fill(v, take_block(t[name], layer.block(name))); });
  auto const xb = layer.block("x");
  moe::View3<double, Mem> lx("lx", xb.local_shape[0], S, D), ly("ly", xb.local_shape[0], S, D);
  fill(lx, take_block(t["x"], xb));
  layer.forward(lx, ly);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  expect_close(values(ly), take_block(reference(rank == 0), xb), "capped y");
}

}  // namespace
