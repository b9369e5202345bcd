// Built with -std=c++20 in every build of the test suite (Kokkos 5 requires C++20): the whole
// public API, single-rank and distributed, compiles under both standards. Never run.
#include <moe/distributed/layer.hpp>
#include <moe/io/checkpoint.hpp>
#include <moe/moe.hpp>

namespace moe_cxx20 {

void instantiate() {
  moe::LayerConfig cfg;
  moe::MoeLayer<float> layer(cfg);
  moe::View3<float> x("x", 1, 1, 1), y("y", 1, 1, 1);
  layer.forward(x, y);
  moe::MoeLayer<float>::params_type g;
  layer.backward(x, y, g);
  moe::DistributedMoeLayer<double> dist(MPI_COMM_WORLD, moe::LayerConfig{}, moe::ParallelConfig{},
                                        1, 1);
  moe::View3<double> xd("x", 1, 1, 1), yd("y", 1, 1, 1);
  dist.forward(xd, yd);
  moe::DistributedMoeLayer<double>::params_type gd;
  dist.backward(xd, yd, gd);
}

}  // namespace moe_cxx20
