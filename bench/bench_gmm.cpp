// Grouped GEMM throughput of an MoE expert projection, x[T*K, D] * W[E, D, F], float32, D=1024,
// F=2816. Names: gmm/<Policy>/E=<E>/<balanced|zipf>/T=<T>/K=<K>. Counters:
//   gflops       2*T*K*D*F / seconds (the expert GEMM FLOPs), seconds = median over iterations
//   dense_ratio  gflops / GFLOP/s of one dense [T*K, D] x [D, F] BLAS GEMM (same FLOPs)
//   min_rows, max_rows  smallest and largest group
#include "bench_common.hpp"

#include <moe/gmm/gmm.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

using namespace moe::bench;

constexpr int64_t kD = 1024;
constexpr int64_t kF = 2816;

/// Inputs shared by all benchmarks of a shape, allocated and filled once per process.
Mat<float> const& activations(int64_t rows) {
  static ViewCache<int64_t, Mat<float>> cache;
  return cache.get(rows, [&] {
    Mat<float> x("moe::bench::gmm::x", rows, kD);
    fill_uniform(x, 7);
    return x;
  });
}

Tensor<float> const& weights(int experts) {
  static ViewCache<int, Tensor<float>> cache;
  return cache.get(experts, [&] {
    Tensor<float> w("moe::bench::gmm::w", experts, kD, kF);
    fill_uniform(w, 11, -0.05, 0.05);
    return w;
  });
}

Mat<float> const& outputs(int64_t rows) {
  static ViewCache<int64_t, Mat<float>> cache;
  return cache.get(rows, [&] { return Mat<float>("moe::bench::gmm::y", rows, kF); });
}

template <class Policy>
void bench_gmm(benchmark::State& state, int experts, std::string const& dist, int64_t tokens,
               int top_k) {
  int64_t const rows = tokens * top_k;
  auto const sizes = group_sizes(dist, rows, experts);
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  auto const& x = activations(rows);
  auto const& w = weights(experts);
  auto const& y = outputs(rows);
  Exec space;
  moe::gmm::gmm(space, Policy{}, x, w, groups, y);  // warm-up (BLAS threads, caches)
  space.fence();
  DenseYardstick dense_gemm(rows, kD, kF);
  std::vector<double> times;
  for (auto _ : state) {
    double const t0 = now();
    moe::gmm::gmm(space, Policy{}, x, w, groups, y);
    space.fence();
    double const dt = now() - t0;
    state.SetIterationTime(dt);
    times.push_back(dt);
    dense_gemm.run();
  }
  double const flops = 2.0 * double(rows) * double(kD) * double(kF);
  double const gflops = flops / median(times) * 1e-9;
  state.counters["gflops"] = gflops;
  double const dense = dense_gemm.gflops();
  state.counters["dense_ratio"] = gflops / dense;
  state.counters["dense_gflops"] = dense;
  state.counters["min_rows"] = double(*std::min_element(sizes.begin(), sizes.end()));
  state.counters["max_rows"] = double(*std::max_element(sizes.begin(), sizes.end()));
}

/// Host tile: of 64x64x64, 64x32x128, 64x64x128, 64x64x256 and 128x64x128 (Serial, SSE2 and
/// AVX-512 builds) the last was at or near the top on every distribution.
using CpuTiled = moe::gmm::Tiled<128, 64, 128>;

template <class Policy>
void register_policy(std::string const& name, int iterations) {
  struct Shape {
    int64_t tokens;
    int top_k;
  };
  for (int experts : {8, 64})
    for (char const* dist : {"balanced", "zipf"})
      for (Shape shape : {Shape{4096, 2}, Shape{1024, 8}}) {
        std::string const label = "gmm/" + name + "/E=" + std::to_string(experts) + "/" + dist +
                                  "/T=" + std::to_string(shape.tokens) +
                                  "/K=" + std::to_string(shape.top_k);
        std::string const d = dist;
        benchmark::RegisterBenchmark(label.c_str(),
                                     [=](benchmark::State& state) {
                                       bench_gmm<Policy>(state, experts, d, shape.tokens,
                                                         shape.top_k);
                                     })
            ->UseManualTime()
            ->Iterations(iterations)
            ->Unit(benchmark::kMillisecond);
      }
}

bool register_all() {
  register_policy<moe::gmm::Vendor>("Vendor", 5);
  register_policy<CpuTiled>("Tiled", 2);
  return true;
}

[[maybe_unused]] bool const registered = register_all();

}  // namespace
