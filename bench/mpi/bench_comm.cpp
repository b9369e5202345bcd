// moe_bench_mpi: communication benchmarks, run under mpirun (every rank runs every benchmark with
// the same fixed iteration counts; only rank 0 reports).
//
//   comm/alltoallv/np=N/bytes_per_peer=B      bare MPI_Alltoallv, B bytes to every peer
//   comm/ragged_a2a/np=N/bytes_per_peer=B     RaggedAllToAll::forward with the same counts; each
//                                             iteration also times a bare MPI_Alltoallv (order
//                                             alternating), reported as vs_alltoallv =
//                                             the median over iterations of alltoallv time /
//                                             ragged time (1.0 = as fast)
//   comm/ragged_a2a_plan/np=N                 building the plan (the count exchange)
//
// Time per iteration = the slowest rank's time (MPI_Allreduce MAX), after a barrier.
// bytes_per_second = size * B / time: the bytes that arrive at one rank (self block included).
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/moe_config.hpp>

#include "../yardsticks.hpp"
#include "bench_mpi_common.hpp"

#include <benchmark/benchmark.h>
#include <Kokkos_Core.hpp>
#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Rows = Kokkos::View<float**, Kokkos::LayoutRight, Exec::memory_space>;

constexpr std::int64_t kRowElems = 1024;  // one row = 4 KiB of float
constexpr std::int64_t kRowBytes = kRowElems * sizeof(float);

/// Fixed per size, so every rank runs the same number of iterations.
int iterations_for(std::int64_t bytes_per_peer) {
  if (bytes_per_peer <= (64 << 10)) return 400;
  if (bytes_per_peer <= (1 << 20)) return 100;
  if (bytes_per_peer <= (16 << 20)) return 30;
  return 16;
}

using moe_bench_mpi::timed;

/// Buffers and counts of one message size, shared by both benchmarks.
struct Exchange {
  moe::comm::Communicator comm;
  std::int64_t rows_per_peer;
  Rows send, recv;
  std::vector<int> counts, displs;  // in floats, for the bare MPI_Alltoallv

  explicit Exchange(std::int64_t bytes_per_peer)
      : comm(MPI_COMM_WORLD), rows_per_peer(bytes_per_peer / kRowBytes) {
    int const P = comm.size();
    send = Rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "bench::send"), P * rows_per_peer,
                kRowElems);
    recv = Rows(Kokkos::view_alloc(Kokkos::WithoutInitializing, "bench::recv"), P * rows_per_peer,
                kRowElems);
    Kokkos::deep_copy(send, float(comm.rank() + 1));
    Kokkos::deep_copy(recv, 0.0f);  // touch the pages before timing
    for (int j = 0; j < P; ++j) {
      counts.push_back(static_cast<int>(rows_per_peer * kRowElems));
      displs.push_back(static_cast<int>(j * rows_per_peer * kRowElems));
    }
  }
  void alltoallv() const {
    MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_FLOAT, recv.data(), counts.data(),
                  displs.data(), MPI_FLOAT, comm.get());
  }
};

using moe_bench_mpi::median;

void report(benchmark::State& state, std::int64_t bytes_per_peer, int P) {
  state.SetBytesProcessed(state.iterations() * bytes_per_peer * P);
  state.counters["np"] = P;
  state.counters["bytes_per_peer"] = double(bytes_per_peer);
}

void bm_alltoallv(benchmark::State& state, std::int64_t bytes_per_peer) {
  Exchange x(bytes_per_peer);
  x.alltoallv();  // warm-up
  std::vector<double> t;
  for (auto _ : state) {
    t.push_back(timed(x.comm.get(), [&] { x.alltoallv(); }));
    state.SetIterationTime(t.back());
  }
  report(state, bytes_per_peer, x.comm.size());
  state.counters["median_bytes_per_second"] = double(bytes_per_peer) * x.comm.size() / median(t);
}

void bm_ragged(benchmark::State& state, std::int64_t bytes_per_peer) {
  Exchange x(bytes_per_peer);
  int const P = x.comm.size();
  moe::comm::RaggedAllToAll const plan(x.comm, std::vector<std::int64_t>(P, x.rows_per_peer));
  Exec const space;
  auto ragged = [&] { plan.forward(space, x.send, x.recv); };
  ragged(), x.alltoallv();  // warm-up
  std::vector<double> t_ragged, t_bare;
  for (auto _ : state) {
    bool const bare_first = t_ragged.size() % 2 == 0;  // alternate the order
    if (bare_first) t_bare.push_back(timed(x.comm.get(), [&] { x.alltoallv(); }));
    t_ragged.push_back(timed(x.comm.get(), ragged));
    if (!bare_first) t_bare.push_back(timed(x.comm.get(), [&] { x.alltoallv(); }));
    state.SetIterationTime(t_ragged.back());
  }
  report(state, bytes_per_peer, P);
  // Medians: robust against the odd iteration disturbed by other processes.
  double const bare = median(t_bare), mine = median(t_ragged);
  state.counters["median_bytes_per_second"] = double(bytes_per_peer) * P / mine;
  state.counters["alltoallv_median_bytes_per_second"] = double(bytes_per_peer) * P / bare;
  // Median of the per-iteration ratios: each pair ran back to back under the same load.
  std::vector<double> ratio(t_ragged.size());
  for (std::size_t i = 0; i < ratio.size(); ++i) ratio[i] = t_bare[i] / t_ragged[i];
  state.counters["vs_alltoallv"] = median(ratio);
}

void bm_plan(benchmark::State& state) {
  moe::comm::Communicator const comm(MPI_COMM_WORLD);
  std::vector<std::int64_t> counts(comm.size());
  for (int j = 0; j < comm.size(); ++j) counts[j] = (comm.rank() + 3 * j) % 17;
  for (auto _ : state) {
    state.SetIterationTime(timed(comm.get(), [&] {
      moe::comm::RaggedAllToAll const plan(comm, counts, 64);
      benchmark::DoNotOptimize(plan.recv_total());
    }));
  }
  state.counters["np"] = comm.size();
}

/// Discards everything (ranks other than 0).
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(Context const&) override { return true; }
  void ReportRuns(std::vector<Run> const&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    int rank = 0, P = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    // Only rank 0 may write --benchmark_out.
    std::vector<char*> args(argv, argv + argc);
    if (rank != 0)
      args.erase(
          std::remove_if(args.begin() + 1, args.end(),
                         [](char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
          args.end());
    int n = static_cast<int>(args.size());
    benchmark::Initialize(&n, args.data());
    if (benchmark::ReportUnrecognizedArguments(n, args.data())) {
      rc = 1;
    } else {
      std::string const np = "/np=" + std::to_string(P);
      for (std::int64_t b = 4 << 10; b <= (64 << 20); b *= 4) {
        std::string const tail = np + "/bytes_per_peer=" + std::to_string(b);
        benchmark::RegisterBenchmark(("comm/alltoallv" + tail).c_str(), bm_alltoallv, b)
            ->Iterations(iterations_for(b))
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("comm/ragged_a2a" + tail).c_str(), bm_ragged, b)
            ->Iterations(iterations_for(b))
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      }
      benchmark::RegisterBenchmark(("comm/ragged_a2a_plan" + np).c_str(), bm_plan)
          ->Iterations(400)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::AddCustomContext("mpi_ranks", std::to_string(P));
      benchmark::AddCustomContext("kokkos_version", std::to_string(KOKKOS_VERSION));
      benchmark::AddCustomContext("kokkos_execution_space", Exec::name());
      benchmark::AddCustomContext("moe_gpu_aware_mpi", std::to_string(MOE_ENABLE_GPU_AWARE_MPI));
#if defined(MOE_QUICK_BUILD)
      benchmark::AddCustomContext("warning_build", moe::bench::kQuickBuildWarning);
#endif
      NullReporter null;
      if (rank == 0)
        benchmark::RunSpecifiedBenchmarks();
      else
        benchmark::RunSpecifiedBenchmarks(&null);
      benchmark::Shutdown();
    }
  }
  MPI_Finalize();
  return rc;
}
