#pragma once
// Helpers shared by the moe_bench_mpi sources: reproducible fills, the slowest rank's time,
// medians and the registration of a benchmark timed by hand in milliseconds.
#include <benchmark/benchmark.h>
#include <Kokkos_Core.hpp>
#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace moe_bench_mpi {

/// Fills v with uniform values in [-scale, scale) from `seed` (host generator: the same values
/// on every backend and every run).
template <class V>
void fill(V const& v, std::uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  auto h = Kokkos::create_mirror_view(v);
  for (std::size_t i = 0; i < h.span(); ++i) h.data()[i] = u(g);
  Kokkos::deep_copy(v, h);
}

/// The slowest rank's time of `f` (all ranks of `comm` start together).
template <class F>
double timed(MPI_Comm comm, F&& f) {
  MPI_Barrier(comm);
  double const t0 = MPI_Wtime();
  f();
  double dt = MPI_Wtime() - t0, worst = 0;
  MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
  return worst;
}

/// The median of a list of timings (the mean of the middle two for an even count; 0 if empty).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t const h = v.size() / 2;
  return v.empty() ? 0.0 : v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

/// Registers `run` (called with the benchmark::State) as `name`, timed by hand (manual time),
/// reported in milliseconds over a fixed number of iterations (every rank runs the same count).
template <class Run>
void register_ms(std::string const& name, int iterations, Run run) {
  benchmark::RegisterBenchmark(name.c_str(), std::move(run))
      ->UseManualTime()
      ->Iterations(iterations)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace moe_bench_mpi
