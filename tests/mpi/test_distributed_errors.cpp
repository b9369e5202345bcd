// Bad configurations and bad inputs of DistributedMoeLayer (DESIGN.md §8): every rank raises the
// same moe:: exception, with a message that names the value and the rule, and nobody hangs --
// also when only one rank is wrong. Cases that need more ranks than the run has are skipped.
#include <moe/distributed/layer.hpp>

#include <gtest/gtest.h>
#include <moe/comm/mpi.hpp>

#include "layout_cases.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;
using Layer = moe::DistributedMoeLayer<double>;

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

moe::LayerConfig small_config() { return test_layer_config(); }

struct Outcome {
  std::string type = "none";  // exception type caught, "none" when nothing was thrown
  std::string message;
};

Outcome outcome_of(std::function<void()> const& f) {
  Outcome o;
  try {
    f();
  } catch (moe::ConfigError const& e) {
    o = {"ConfigError", e.what()};
  } catch (moe::ShapeError const& e) {
    o = {"ShapeError", e.what()};
  } catch (moe::InputError const& e) {
    o = {"InputError", e.what()};
  } catch (moe::Error const& e) {
    o = {"moe::Error", e.what()};
  } catch (std::exception const& e) {
    o = {"std::exception", e.what()};
  }
  return o;
}

std::uint64_t fnv1a(std::string const& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// This rank got `type` with every fragment in its message, and every rank got the same
/// exception with the same message.
void expect_everywhere(Outcome const& o, std::string const& type,
                       std::vector<std::string> const& fragments) {
  EXPECT_EQ(o.type, type) << o.message;
  for (auto const& f : fragments)
    EXPECT_NE(o.message.find(f), std::string::npos) << "'" << f << "' not in: " << o.message;
  std::uint64_t const mine = fnv1a(o.type + "|" + o.message);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(world_size()));
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
  for (std::size_t r = 0; r < all.size(); ++r)
    EXPECT_EQ(all[r], all[0]) << "rank " << r << " raised a different error than rank 0";
}

Outcome construct(moe::LayerConfig const& cfg, moe::ParallelConfig const& par, std::int64_t B,
                  std::int64_t S = 4) {
  return outcome_of([&] { Layer layer(MPI_COMM_WORLD, cfg, par, B, S); });
}

}  // namespace

TEST(DistributedErrors, MeshProductDiffersFromRanks) {
  int const n = world_size();
  moe::ParallelConfig par;
  par.ici_data_parallelism = 2 * n;
  expect_everywhere(construct(small_config(), par, 8), "ConfigError",
                    {"ici_*_parallelism", "data=" + std::to_string(2 * n),
                     "= " + std::to_string(2 * n) + " does not equal the communicator size " +
                         std::to_string(n)});
}

TEST(DistributedErrors, ExpertsNotDivisibleByExpertDegree) {
  int const n = world_size();
  if (n < 2) GTEST_SKIP() << "needs an expert degree > 1";
  auto cfg = small_config();
  cfg.num_experts = n + 1;
  moe::ParallelConfig par;
  par.ici_expert_parallelism = -1;
  expect_everywhere(construct(cfg, par, 8), "ConfigError",
                    {"num_experts=" + std::to_string(n + 1), "is not divisible",
                     "[expert] = " + std::to_string(n)});
}

TEST(DistributedErrors, MlpDimNotDivisibleByTensorDegree) {
  int const n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a tensor degree > 1";
  auto cfg = small_config();
  cfg.base_moe_mlp_dim = n + 1;
  moe::ParallelConfig par;
  par.ici_tensor_parallelism = -1;
  expect_everywhere(construct(cfg, par, 8), "ConfigError",
                    {"base_moe_mlp_dim=" + std::to_string(n + 1), "is not divisible",
                     "[tensor] = " + std::to_string(n)});
}

TEST(DistributedErrors, ExpertWeightsWholeOnEveryRankNeedNoExpertAxis) {
  int const n = world_size();
  if (n < 2) GTEST_SKIP() << "needs an expert degree > 1";
  for (char const* key : {"shard_exp_on_fsdp", "use_2d_fsdp_sharding"}) {
    moe::ParallelConfig par;
    par.ici_expert_parallelism = -1;
    par.set(key, "true");
    expect_everywhere(construct(small_config(), par, 8), "ConfigError",
                      {std::string(key) + "=true", "expert mesh axis of size 1",
                       "(it is " + std::to_string(n) + ")"});
  }
}

TEST(DistributedErrors, GlobalBatchNotDivisibleByItsAxes) {
  int const n = world_size();
  if (n < 2) GTEST_SKIP() << "needs a batch split > 1";
  moe::ParallelConfig par;
  par.ici_data_parallelism = -1;
  expect_everywhere(construct(small_config(), par, n + 1), "ConfigError",
                    {"global batch=" + std::to_string(n + 1), "is not divisible",
                     "[data] = " + std::to_string(n)});
}

TEST(DistributedErrors, RanksWithDifferentConfigs) {
  int const n = world_size();
  if (n < 2) GTEST_SKIP() << "needs two ranks to disagree";
  // MPMD-style launch: the last rank routes to one expert per token, the others to two.
  auto cfg = small_config();
  cfg.num_experts_per_tok = world_rank() == n - 1 ? 1 : 2;
  moe::ParallelConfig par;
  par.ici_expert_parallelism = -1;
  expect_everywhere(construct(cfg, par, 8), "ConfigError",
                    {"layer configuration (LayerConfig) differs across ranks",
                     "rank " + std::to_string(n - 1) + " has \"K=1\"", "rank 0 has \"K=2\""});
  // The batch shape must agree too.
  expect_everywhere(
      construct(small_config(), par, world_rank() == 0 ? 8 : 16), "ConfigError",
      {"global batch shape differs across ranks", "rank 1 has \"B=16\"", "rank 0 has \"B=8\""});
  // And the layout keys.
  moe::ParallelConfig ring = par;
  ring.use_ring_of_experts = world_rank() == 0;
  expect_everywhere(
      construct(small_config(), ring, 8), "ConfigError",
      {"parallel configuration (ParallelConfig) differs across ranks", "ring=0", "ring=1"});
}

namespace {

/// A valid layer over every rank (expert parallel) and this rank's x block filled with ones.
struct Step {
  moe::ParallelConfig par;
  Layer layer;
  std::int64_t b = 0;
  Step() : par(make_par()), layer(MPI_COMM_WORLD, small_config(), par, 8, 4) {
    b = layer.block("x").local_shape[0];
  }
  static moe::ParallelConfig make_par() {
    moe::ParallelConfig p;
    p.ici_expert_parallelism = -1;
    return p;
  }
  moe::View3<double, Mem> view(std::int64_t rows, double value = 1.0) const {
    moe::View3<double, Mem> v("v", rows, 4, 16);
    Kokkos::deep_copy(v, value);
    return v;
  }
};

}  // namespace

TEST(DistributedErrors, NanInXOnOneRank) {
  int const n = world_size();
  Step s;
  auto x = s.view(s.b), y = s.view(s.b);
  if (world_rank() == n - 1) x(s.b - 1, 3, 5) = std::numeric_limits<double>::quiet_NaN();
  expect_everywhere(outcome_of([&] { s.layer.forward(x, y); }), "InputError",
                    {"x holds NaN or Inf", "must be finite",
                     "[rank " + std::to_string(n - 1) + " of " + std::to_string(n) + "]"});
}

TEST(DistributedErrors, NanInDyOnOneRank) {
  int const n = world_size();
  Step s;
  auto x = s.view(s.b), y = s.view(s.b), dy = s.view(s.b), dx = s.view(s.b);
  s.layer.forward(x, y);
  if (world_rank() == 0) dy(0, 0, 0) = std::numeric_limits<double>::infinity();
  Layer::params_type grads;
  expect_everywhere(outcome_of([&] { s.layer.backward(dy, dx, grads); }), "InputError",
                    {"dy holds NaN or Inf", "[rank 0 of " + std::to_string(n) + "]"});
}

TEST(DistributedErrors, DxSharingDyOnOneRank) {
  int const n = world_size();
  Step s;
  auto x = s.view(s.b), y = s.view(s.b), dy = s.view(s.b), dx = s.view(s.b);
  s.layer.forward(x, y);
  Layer::params_type grads;
  auto const alias = world_rank() == n - 1 ? dy : dx;
  expect_everywhere(outcome_of([&] { s.layer.backward(dy, alias, grads); }), "InputError",
                    {"dx shares memory with dy",
                     "[rank " + std::to_string(n - 1) + " of " + std::to_string(n) + "]"});
  // Rejected before anything ran: the forward is still there for a backward with its own dx.
  EXPECT_EQ(outcome_of([&] { s.layer.backward(dy, dx, grads); }).type, "none");
}

/// Sets element [0,...,0] (+ `flat`) of this rank's block of parameter `name` to `bad`.
void poison_param(Layer& layer, std::string const& name, std::int64_t flat, double bad) {
  layer.parameters().for_each([&](char const* n, auto const& v) {
    if (name != n) return;
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    h.data()[flat] = bad;
    Kokkos::deep_copy(v, h);
  });
}

TEST(DistributedErrors, NanInGateOnOneRankIsNamedUpFront) {
  int const n = world_size();
  Step s;
  auto x = s.view(s.b), y = s.view(s.b);
  // The gate is replicated on the expert-parallel layout: a NaN in the last rank's copy.
  if (world_rank() == n - 1) poison_param(s.layer, "gate", 9, std::nan(""));
  expect_everywhere(outcome_of([&] { s.layer.forward(x, y); }), "InputError",
                    {"gate holds NaN or Inf at [1,1]",
                     "[rank " + std::to_string(n - 1) + " of " + std::to_string(n) + "]"});
}

TEST(DistributedErrors, InfInAnExpertWeightIsNamed) {
  int const n = world_size();
  Step s;
  auto x = s.view(s.b), y = s.view(s.b);
  // Zero weights and equal tokens route every token to experts 0 and 1 (ties go to the lower
  // index), which rank 0 holds: its Inf reaches y (0 * Inf) and the message names wo.
  if (world_rank() == 0) poison_param(s.layer, "wo", 3, std::numeric_limits<double>::infinity());
  auto const o = outcome_of([&] { s.layer.forward(x, y); });
  expect_everywhere(o, "InputError",
                    {"wo", "holds NaN or Inf", "[rank 0 of " + std::to_string(n) + "]"});
  if (n > 1) {
    EXPECT_NE(o.message.find("the block of rank 0"), std::string::npos) << o.message;
  }
}

TEST(DistributedErrors, WrongXShapeOnOneRank) {
  int const n = world_size();
  Step s;
  std::int64_t const rows = world_rank() == n - 1 ? s.b + 1 : s.b;
  auto x = s.view(rows), y = s.view(rows);
  expect_everywhere(outcome_of([&] { s.layer.forward(x, y); }), "ShapeError",
                    {"x is [" + std::to_string(s.b + 1) + ",4,16]",
                     "but this rank's block is [" + std::to_string(s.b) + ",4,16]",
                     "[rank " + std::to_string(n - 1) + " of " + std::to_string(n) + "]"});
  // The layer is still usable after a rejected call.
  auto good = s.view(s.b), out = s.view(s.b);
  EXPECT_EQ(outcome_of([&] { s.layer.forward(good, out); }).type, "none");
}
