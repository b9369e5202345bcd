// A consumer of the installed package: one forward + backward of a tiny layer.
#include <moe/moe.hpp>

#include <cmath>
#include <cstdio>

int main(int argc, char** argv) {
  Kokkos::ScopeGuard guard(argc, argv);
  moe::LayerConfig cfg;
  cfg.num_experts = 4;
  cfg.num_experts_per_tok = 2;
  cfg.base_emb_dim = 8;
  cfg.base_moe_mlp_dim = 16;
  moe::MoeLayer<float> layer(cfg);
  auto& p = layer.parameters();
  p.for_each([](char const*, auto const& v) {
    auto h = Kokkos::create_mirror_view(v);
    for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = 0.1f * float((i * 7) % 11) - 0.5f;
    Kokkos::deep_copy(v, h);
  });
  moe::View3<float> x("x", 1, 3, 8), y("y", 1, 3, 8), dx("dx", 1, 3, 8);
  Kokkos::deep_copy(x, 1.0f);
  layer.forward(x, y);
  decltype(layer)::params_type grads;
  layer.backward(y, dx, grads);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
  bool ok = true;
  for (std::size_t i = 0; i < h.span(); ++i) ok = ok && std::isfinite(h.data()[i]);
  std::printf("consumer: moe %d.%d.%d (Kokkos %d.%d.%d), y[0]=%g %s\n", MOE_VERSION_MAJOR,
              MOE_VERSION_MINOR, MOE_VERSION_PATCH, KOKKOS_VERSION / 10000,
              KOKKOS_VERSION / 100 % 100, KOKKOS_VERSION % 100, double(h(0, 0, 0)),
              ok ? "ok" : "NOT FINITE");
  return ok ? 0 : 1;
}
