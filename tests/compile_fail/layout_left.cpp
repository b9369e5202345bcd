// Must NOT compile: moe's layers take row-major (LayoutRight) Views, and a LayoutLeft View (what
// a View declared without a layout is on CUDA and HIP) must stop the build with moe's
// static_assert naming the rule, not with pages of Kokkos conversion errors. Built only by the
// ctest `compile_fail.layout_left`, which expects the failure and moe's message.
// (tests/cxx20/check_cxx20.cpp is the twin that must compile: non-const LayoutRight Views.)
#include <moe/distributed/layer.hpp>
#include <moe/moe.hpp>

namespace moe_compile_fail {

using MS = Kokkos::DefaultExecutionSpace::memory_space;

void single_rank(moe::MoeLayer<float>& layer) {
  Kokkos::View<float***, Kokkos::LayoutLeft, MS> x("x", 1, 1, 1), y("y", 1, 1, 1);
  layer.forward(x, y);
}

void distributed(moe::DistributedMoeLayer<double>& layer) {
  Kokkos::View<double***, Kokkos::LayoutLeft, MS> dy("dy", 1, 1, 1), dx("dx", 1, 1, 1);
  moe::DistributedMoeLayer<double>::params_type grads;
  layer.backward(dy, dx, grads);
}

}  // namespace moe_compile_fail
