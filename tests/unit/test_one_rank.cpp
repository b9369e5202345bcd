// The single-rank layer is the one-rank case of the distributed step pipeline: MoeLayer runs the
// Local step plan of a DistributedMoeLayer on comm::Communicator::local(), which needs no MPI.
// ctest runs each test in its own process, and nothing here starts MPI: an MPI call would abort
// the process (and the local communicator has no handle to call MPI with: get() throws).
#include "../mpi/layout_cases.hpp"
#include "reference.hpp"

#include <moe/comm/communicator.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/layer.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Layer = moe::MoeLayer<double>;
using V3 = moe::View3<double>;
using moe::distributed::StageKind;

/// The layer of these tests: one shared expert, capacity, load-balance loss.
moe::LayerConfig config() { return test_layer_config(0.01, {"capacity_factor=1.0"}); }

/// Deterministic weights (the reference's random parameters).
void init(Layer& layer) {
  moe_ref::Rng rng(1);
  moe_ref::kk::load_params(layer, moe_ref::Params::random(layer.config(), rng));
}

/// Deterministic tokens [B, S, D] in [-1, 1).
V3 tokens(int B, int S, int D, std::uint64_t seed) {
  moe_ref::Rng rng(seed);
  return moe_ref::kk::to_view<V3>(rng.vec(std::size_t(B) * S * D, -1, 1), B, S, D);
}

TEST(LocalCommunicator, CollectivesOfOneRankCompleteWithoutMpi) {
  auto const c = moe::comm::Communicator::local();
  EXPECT_TRUE(c.is_local());
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.rank(), 0);
  EXPECT_THROW(c.get(), moe::Error);
  auto const s = c.split(3, 7);
  EXPECT_TRUE(s.is_local());
  EXPECT_EQ(s.size(), 1);
  EXPECT_THROW(c.split(-1, 0), moe::ConfigError);
  moe::comm::check_agreement(c, "value", "a=1");  // one rank agrees with itself
  EXPECT_TRUE(moe::comm::any_rank(c, true));
  EXPECT_FALSE(moe::comm::any_rank(c, false));
  // collective_guard throws the rank's own exception: same type, same message.
  try {
    moe::comm::collective_guard(c, [] { throw moe::ShapeError("x is [3] but needs [4]"); });
    ADD_FAILURE() << "no exception";
  } catch (moe::ShapeError const& e) {
    EXPECT_STREQ(e.what(), "x is [3] but needs [4]");
  }
  EXPECT_THROW(moe::comm::collective_guard(c, [] { throw std::runtime_error("other"); }),
               moe::Error);
  moe::comm::collective_guard(c, [] {});
  // A mesh of one rank over it, and its groups.
  moe::comm::MeshComm mesh(c, moe::sharding::Mesh({{"data", 1}, {"expert", 1}}));
  auto const& g = mesh.group({"expert"});
  EXPECT_EQ(g.size(), 1);
  EXPECT_TRUE(g.comm.is_local());
}

TEST(OneRankPipeline, MoeLayerRunsTheLocalStepPlanWithoutCollectives) {
  Layer layer(config());
  init(layer);
  int const B = 2, S = 3, D = layer.config().base_emb_dim;
  V3 const x = tokens(B, S, D, 100), dy = tokens(B, S, D, 101);
  V3 y("y", B, S, D), dx("dx", B, S, D);
  layer.forward(x, y);
  Layer::params_type g;
  layer.backward(dy, dx, g);
  auto const& plan = layer.step_plan();
  EXPECT_EQ(plan.route, moe::ExpertRoute::Local);
  EXPECT_FALSE(plan.dense);
  EXPECT_EQ(plan.tokens, B * S);
  EXPECT_EQ(plan.work_tokens, B * S);
  auto kinds = [](std::vector<moe::distributed::Stage> const& stages) {
    std::vector<StageKind> k;
    for (auto const& st : stages) {
      k.push_back(st.kind);
      EXPECT_TRUE(st.collectives.empty()) << st.region << " plans a collective on one rank";
    }
    return k;
  };
  EXPECT_EQ(kinds(plan.forward),
            (std::vector<StageKind>{StageKind::gather_weights, StageKind::route,
                                    StageKind::dispatch, StageKind::experts, StageKind::combine,
                                    StageKind::shared_expert, StageKind::output}));
  EXPECT_EQ(kinds(plan.backward),
            (std::vector<StageKind>{StageKind::output, StageKind::combine, StageKind::experts,
                                    StageKind::dispatch, StageKind::shared_expert, StageKind::route,
                                    StageKind::reduce_grads}));
  // The dense path is the same pipeline with the dense experts.
  moe::MoeLayer<double, moe::Policies<moe::routing::Auto, moe::gmm::Dense>> dense(layer.config());
  dense.forward(x, y);
  EXPECT_TRUE(dense.dense_path());
  EXPECT_TRUE(dense.step_plan().dense);
  EXPECT_EQ(dense.routed_rows(), 0);
}

// Each call may bring another batch shape: the step is planned again, and the result is that of
// a new layer on that shape (bitwise: the same operations in the same order).
TEST(OneRankPipeline, EveryBatchShapeIsPlannedAgain) {
  Layer layer(config());
  init(layer);
  int const D = layer.config().base_emb_dim;
  for (auto const& bs : std::vector<std::pair<int, int>>{{2, 3}, {1, 5}, {3, 1}, {2, 3}}) {
    int const B = bs.first, S = bs.second;
    SCOPED_TRACE(::testing::Message() << "[" << B << "," << S << "]");
    V3 const x = tokens(B, S, D, 10 * B + S), dy = tokens(B, S, D, 20 * B + S);
    V3 y("y", B, S, D), dx("dx", B, S, D);
    layer.forward(x, y);
    EXPECT_EQ(layer.step_plan().tokens, B * S);
    Layer::params_type g;
    layer.backward(dy, dx, g);
    Layer fresh(config());
    init(fresh);
    V3 y1("y1", B, S, D), dx1("dx1", B, S, D);
    fresh.forward(x, y1);
    Layer::params_type g1;
    fresh.backward(dy, dx1, g1);
    EXPECT_EQ(moe_ref::kk::to_vec(y), moe_ref::kk::to_vec(y1));
    EXPECT_EQ(moe_ref::kk::to_vec(dx), moe_ref::kk::to_vec(dx1));
    EXPECT_EQ(moe_ref::kk::to_vec(g.wi_0), moe_ref::kk::to_vec(g1.wi_0));
    EXPECT_EQ(moe_ref::kk::to_vec(g.gate), moe_ref::kk::to_vec(g1.gate));
    EXPECT_EQ(layer.lb_loss(), fresh.lb_loss());
  }
  // A backward must match the last forward's shape.
  V3 x("x", 1, 2, D), y("y", 1, 2, D), dy("dy", 2, 3, D), dx("dx", 2, 3, D);
  layer.forward(x, y);
  Layer::params_type g;
  EXPECT_THROW(layer.backward(dy, dx, g), moe::ShapeError);
}

TEST(OneRankPipeline, WrongGradientShapesThrowShapeError) {
  Layer layer(config());
  init(layer);
  int const D = layer.config().base_emb_dim;
  V3 const x = tokens(1, 4, D, 5);
  V3 y("y", 1, 4, D), dx("dx", 1, 4, D);
  layer.forward(x, y);
  Layer::params_type g = Layer::params_type::zeros(layer.config());
  g.wo = moe::View3<double>("wo", 8, 7, D);
  try {
    layer.backward(y, dx, g);
    ADD_FAILURE() << "no ShapeError";
  } catch (moe::ShapeError const& e) {
    std::string const msg = e.what();
    for (char const* part : {"gradient wo", "[8,7,16]", "the config needs [8,8,16]"})
      EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
  }
  // The checks threw before anything ran: the forward is still there to differentiate.
  Layer::params_type ok;
  EXPECT_NO_THROW(layer.backward(y, dx, ok));
  EXPECT_THROW(layer.backward(y, dx, ok), moe::Error) << "one backward per forward";
}

}  // namespace
