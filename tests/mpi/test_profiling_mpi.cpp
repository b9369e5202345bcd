// Kokkos Tools on the distributed layer: the dispatch strategy and each collective it runs are
// profiling regions named moe::..., on every rank.
#include "layout_cases.hpp"

#include <moe/distributed/layer.hpp>

#include <gtest/gtest.h>
#include <moe/comm/mpi.hpp>

#include <set>
#include <string>
#include <vector>

namespace {

std::set<std::string>& seen() {
  static std::set<std::string> s;
  return s;
}
std::set<std::string>& outermost() {
  static std::set<std::string> s;
  return s;
}
int depth = 0;
void on_push(char const* name) {
  seen().insert(name);
  if (depth++ == 0) outermost().insert(name);
}
void on_pop() { --depth; }

/// Names of the regions one forward + backward of `layout` pushes on this rank.
std::set<std::string> regions_of(std::vector<std::string> const& layout) {
  moe::LayerConfig const cfg = test_layer_config(0.01);
  moe::ParallelConfig par;
  for (auto const& kv : layout) {
    auto const eq = kv.find('=');
    par.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  std::int64_t const B = 8, S = 4, D = cfg.base_emb_dim;
  moe::DistributedMoeLayer<double> layer(MPI_COMM_WORLD, cfg, par, B, S);
  std::int64_t const b = layer.block("x").local_shape[0];
  moe::View3<double> x("x", b, S, D), y("y", b, S, D), dy("dy", b, S, D), dx("dx", b, S, D);
  Kokkos::deep_copy(x, 0.25);
  Kokkos::deep_copy(dy, 1.0);
  moe::DistributedMoeLayer<double>::params_type grads;
  seen().clear();
  outermost().clear();
  Kokkos::Tools::Experimental::set_push_region_callback(&on_push);
  Kokkos::Tools::Experimental::set_pop_region_callback(&on_pop);
  layer.forward(x, y);
  layer.backward(dy, dx, grads);
  Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
  Kokkos::Tools::Experimental::set_pop_region_callback(nullptr);
  return seen();
}

void expect_regions(std::set<std::string> const& names, std::vector<char const*> const& want) {
  for (char const* w : want) EXPECT_TRUE(names.count(w)) << "no region " << w;
  // Regions of the libraries moe calls (Kokkos Kernels' gemm) nest inside moe's own.
  for (auto const& n : outermost()) EXPECT_EQ(n.rfind("moe::", 0), 0u) << n << " is not moe::...";
}

TEST(ProfilingMpi, DispatchAndCollectivesAreNamedRegions) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) GTEST_SKIP() << "needs ranks to exchange";
  expect_regions(regions_of({"ici_expert_parallelism=-1"}),
                 {"moe::dist::forward", "moe::route", "moe::dispatch::ragged_all_to_all",
                  "moe::comm::ragged_all_to_all", "moe::comm::ragged_all_to_all::reverse",
                  "moe::expert_ffn", "moe::gmm::gmm", "moe::combine", "moe::dist::backward",
                  "moe::dispatch::ragged_all_to_all::backward", "moe::route::backward",
                  "moe::dist::reduce_grads", "moe::comm::all_reduce"});
  expect_regions(regions_of({"ici_expert_parallelism=-1", "use_ring_of_experts=true"}),
                 {"moe::dispatch::gathered", "moe::comm::all_gather", "moe::comm::reduce_scatter",
                  "moe::dispatch::gathered::backward"});
  expect_regions(
      regions_of({"ici_fsdp_parallelism=-1"}),
      {"moe::dist::gather_weights", "moe::comm::all_gather", "moe::comm::reduce_scatter"});
}

}  // namespace
