// emb_chunks/ benchmarks of moe_bench_mpi: how much of the ring's token all-gather the chunked
// ring forward (num_moe_emb_chunks) hides behind the grouped GEMM.
//
//   emb_chunks/ring_fwd/chunks=C/D=<D>/F=<F>     (np counter: the ranks, all on the expert axis)
//
// Each iteration times, in this order and each after a barrier (slowest rank's time):
//   allgather  the ring's blocking token all-gather alone (moe::comm::all_gather of this rank's
//              [T_local, D] tokens over the expert group = all ranks)
//   gemm       the first two grouped GEMMs alone on the rows one rank's local experts receive
//              (balanced routing: T*K/ep rows over L = E/ep experts; x . wi_0 and x . wi_1)
//   unchunked  the ring forward, one blocking gather (num_moe_emb_chunks=0)
//   chunked    the ring forward with num_moe_emb_chunks=C (the same weights and tokens)
// and reports the medians over iterations (ms) and
//   overlap_fraction = (t_unchunked - t_chunked) / t_allgather
// the share of the gather's time the chunking hid (1 = all of it; 0 = none; negative = the
// chunking cost more than it hid). At most (C-1)/C can be hidden: chunk 1 is waited for before
// any GEMM can start. The shape keeps the GEMM longer than the transfer (small F, large D).
#include <moe/comm/collectives.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/gmm/gmm.hpp>

#include "bench_mpi_common.hpp"

#include <benchmark/benchmark.h>
#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

constexpr int kE = 8, kK = 2;
constexpr std::int64_t kB = 8, kS = 256;  // 2048 global tokens

using moe_bench_mpi::fill;
using moe_bench_mpi::timed;

using moe_bench_mpi::median;

using Layer = moe::DistributedMoeLayer<float>;

std::unique_ptr<Layer> make_layer(int D, int F, int chunks) {
  moe::LayerConfig cfg;
  cfg.num_experts = kE;
  cfg.num_experts_per_tok = kK;
  cfg.base_emb_dim = D;
  cfg.base_moe_mlp_dim = F;
  moe::ParallelConfig par;
  par.ici_expert_parallelism = -1;
  par.use_ring_of_experts = true;
  par.num_moe_emb_chunks = chunks;
  auto layer = std::make_unique<Layer>(MPI_COMM_WORLD, cfg, par, kB, kS);
  std::uint64_t seed = 7 + 1000 * std::uint64_t(layer->block("x").offset[0]);
  layer->parameters().for_each([&](char const*, auto const& v) { fill(v, ++seed, 0.03f); });
  return layer;
}

void bm_emb_chunks(benchmark::State& state, int D, int F, int chunks) {
  int np = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &np);
  if (np < 2) {
    state.SkipWithError("the ring of experts needs at least 2 ranks");
    return;
  }
  state.counters["np"] = np;
  auto one = make_layer(D, F, 0);
  auto chunked = make_layer(D, F, chunks);
  auto const xb = one->block("x").local_shape;
  moe::View3<float, Mem> x("x", xb[0], xb[1], xb[2]), y("y", xb[0], xb[1], xb[2]);
  fill(x, 99 + std::uint64_t(one->block("x").offset[0]), 1.0f);
  // The gather alone: this rank's tokens to every rank.
  std::int64_t const T = xb[0] * xb[1];
  moe::comm::Communicator comm(MPI_COMM_WORLD);
  moe::View2<float, Mem> own("own", T, D), all("all", T * np, D);
  Kokkos::deep_copy(own, 1.0f);
  // The first GEMMs alone: balanced rows on L local experts.
  std::int64_t const L = kE / np, n = T * np * kK / np;
  std::vector<std::int64_t> sizes(std::size_t(L), n / L);
  sizes.back() += n - (n / L) * L;
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  moe::View2<float, Mem> xs("xs", n, D), h0("h0", n, F), h1("h1", n, F);
  moe::View3<float, Mem> w0("w0", L, D, F), w1("w1", L, D, F);
  fill(xs, 5, 1.0f);
  fill(w0, 6, 0.03f);
  fill(w1, 7, 0.03f);
  auto gemms = [&] {
    moe::gmm::gmm(Exec(), moe::gmm::Auto{}, xs, w0, groups, h0);
    moe::gmm::gmm(Exec(), moe::gmm::Auto{}, xs, w1, groups, h1);
    Kokkos::fence();
  };
  // Warm-up (packs weights, sizes buffers).
  one->forward(x, y);
  chunked->forward(x, y);
  gemms();
  std::vector<double> tg, tm, t0, tc;
  for (auto _ : state) {
    double const a = timed(MPI_COMM_WORLD, [&] { moe::comm::all_gather(comm, Exec(), own, all); });
    double const g = timed(MPI_COMM_WORLD, gemms);
    double const u = timed(MPI_COMM_WORLD, [&] { one->forward(x, y); });
    double const c = timed(MPI_COMM_WORLD, [&] { chunked->forward(x, y); });
    tg.push_back(a);
    tm.push_back(g);
    t0.push_back(u);
    tc.push_back(c);
    state.SetIterationTime(c);
  }
  double const ag = median(tg), u = median(t0), c = median(tc);
  state.counters["t_allgather_ms"] = ag * 1e3;
  state.counters["t_gemm_ms"] = median(tm) * 1e3;
  state.counters["t_unchunked_ms"] = u * 1e3;
  state.counters["t_chunked_ms"] = c * 1e3;
  state.counters["overlap_fraction"] = ag > 0 ? (u - c) / ag : 0.0;
  state.counters["max_hideable"] = double(chunks - 1) / chunks;
  state.counters["gather_MB_per_rank"] =
      double(moe::comm::sent_bytes::all_gather(T * D * std::int64_t(sizeof(float)), np)) / 1e6;
}

bool register_all() {
  struct Shape {
    int D, F;
  };
  // MPI is not initialised yet: the rank count goes into the np counter, not the name.
  for (Shape s : {Shape{4096, 64}, Shape{1024, 512}})
    for (int chunks : {2, 4}) {
      std::string const name = "emb_chunks/ring_fwd/chunks=" + std::to_string(chunks) +
                               "/D=" + std::to_string(s.D) + "/F=" + std::to_string(s.F);
      moe_bench_mpi::register_ms(
          name, 9, [s, chunks](benchmark::State& st) { bm_emb_chunks(st, s.D, s.F, chunks); });
    }
  return true;
}

[[maybe_unused]] bool const registered = register_all();

}  // namespace
