// Kokkos Tools: every stage of a layer step is a profiling region named moe::..., seen through
// the region callbacks a tool (or a profiler connector) registers.
#include "../mpi/layout_cases.hpp"

#include <moe/layer.hpp>

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace {

std::vector<std::string>& pushed() {
  static std::vector<std::string> v;
  return v;
}
int& depth() {
  static int d = 0;
  return d;
}
std::vector<std::string>& outermost() {
  static std::vector<std::string> v;
  return v;
}
void on_push(char const* name) {
  pushed().emplace_back(name);
  if (depth() == 0) outermost().emplace_back(name);
  ++depth();
}
void on_pop() { --depth(); }

/// Registers the two callbacks for its lifetime (and removes them after, so other tests run
/// without a tool).
struct RegionRecorder {
  RegionRecorder() {
    pushed().clear();
    outermost().clear();
    depth() = 0;
    Kokkos::Tools::Experimental::set_push_region_callback(&on_push);
    Kokkos::Tools::Experimental::set_pop_region_callback(&on_pop);
  }
  ~RegionRecorder() {
    Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
    Kokkos::Tools::Experimental::set_pop_region_callback(nullptr);
  }
  std::set<std::string> names() const { return {pushed().begin(), pushed().end()}; }
};

TEST(Profiling, EveryStageOfAStepIsANamedRegion) {
  // The distributed tests' layer (one shared expert), dropping and with the load-balance loss,
  // so every stage runs.
  moe::LayerConfig const cfg = test_layer_config(0.01, {"capacity_factor=1.0"});
  moe::MoeLayer<double> layer(cfg);
  int const B = 2, S = 4, D = cfg.base_emb_dim;
  moe::View3<double> x("x", B, S, D), y("y", B, S, D), dy("dy", B, S, D), dx("dx", B, S, D);
  Kokkos::deep_copy(x, 0.5);
  Kokkos::deep_copy(dy, 1.0);
  moe::MoeLayer<double>::params_type grads;
  std::set<std::string> names;
  {
    RegionRecorder rec;
    layer.forward(x, y);
    layer.backward(dy, dx, grads);
    EXPECT_EQ(depth(), 0) << "every pushed region is popped";
    names = rec.names();
  }
  for (char const* want :
       {"moe::layer::forward", "moe::route", "moe::routing::capacity_mask",
        "moe::routing::lb_statistics", "moe::permute::sort_by_expert", "moe::permute::gather",
        "moe::expert_ffn", "moe::gmm::gmm", "moe::combine", "moe::shared_expert",
        "moe::layer::backward", "moe::combine::backward", "moe::expert_ffn::backward",
        "moe::gmm::tgmm", "moe::permute::gather::backward", "moe::route::backward",
        "moe::shared_expert::backward"})
    EXPECT_TRUE(names.count(want)) << "no region " << want;
  // Regions of the libraries moe calls (Kokkos Kernels' gemm) nest inside moe's own.
  for (auto const& n : outermost()) EXPECT_EQ(n.rfind("moe::", 0), 0u) << n << " is not moe::...";
  // Without a tool nothing is recorded (the callbacks are gone).
  pushed().clear();
  layer.forward(x, y);
  EXPECT_TRUE(pushed().empty());
}

}  // namespace
