// layer_dist/ benchmarks of moe_bench_mpi: the distributed layer's forward and backward per
// strategy, with the bytes each rank sent in that step (from the layer's comm log) next to the
// time. Every rank runs the same fixed iterations; the time is the slowest rank's.
//
//   layer_dist/<strategy>/np=N/<fwd|bwd>/E=8/T=<global tokens>/K=2
//
// EP-TP (ep_tp, and ep_tp_dense: every local expert on every token, the yardstick of expert work
// that grows with the gathered tokens) also reports the rows after its all-gather
// (gathered_rows, the same at every EP) and the rows its local experts computed
// (routed_rows_max, the most over the ranks): with EP=2 and EP=4 the second halves, the first
// stays; the time follows the routed rows.
#include <moe/distributed/layer.hpp>

#include "bench_mpi_common.hpp"

#include <benchmark/benchmark.h>
#include <moe/comm/mpi.hpp>

#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

constexpr int kD = 1024, kF = 2816, kE = 8, kK = 2;
constexpr std::int64_t kB = 8, kS = 256;  // 2048 global tokens

struct Strategy {
  std::string name;
  std::vector<std::string> keys;
  std::vector<std::string> layer = {};  ///< LayerConfig key=value
};

using moe_bench_mpi::fill;

void bm_layer(benchmark::State& state, Strategy const& s, bool backward) {
  moe::LayerConfig cfg;
  cfg.num_experts = kE;
  cfg.num_experts_per_tok = kK;
  cfg.base_emb_dim = kD;
  cfg.base_moe_mlp_dim = kF;
  for (auto const& kv : s.layer) {
    auto const eq = kv.find('=');
    cfg.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  moe::ParallelConfig par;
  for (auto const& kv : s.keys) {
    auto const eq = kv.find('=');
    par.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  moe::DistributedMoeLayer<float> layer(MPI_COMM_WORLD, cfg, par, kB, kS);
  std::uint64_t seed = 7 + 1000 * std::uint64_t(layer.block("x").offset[0]);
  layer.parameters().for_each([&](char const*, auto const& v) { fill(v, ++seed, 0.03f); });
  auto const xb = layer.block("x").local_shape;
  moe::View3<float, Mem> x("x", xb[0], xb[1], xb[2]), y("y", xb[0], xb[1], xb[2]),
      dx("dx", xb[0], xb[1], xb[2]);
  fill(x, 99 + std::uint64_t(layer.block("x").offset[0]), 1.0f);
  decltype(layer)::params_type grads;
  layer.forward(x, y);  // warm-up
  if (backward) layer.backward(y, dx, grads);
  double total = 0;
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    double const t0 = MPI_Wtime();
    layer.forward(x, y);
    double const t1 = MPI_Wtime();
    if (backward) layer.backward(y, dx, grads);
    double const t2 = MPI_Wtime();
    double dt = backward ? t2 - t1 : t1 - t0, worst = 0;
    MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    state.SetIterationTime(worst);
    total += worst;
  }
  // Bytes this rank sent in the last step's forward or backward phase.
  double const bytes = double(layer.comm_log().bytes(backward));
  int np = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &np);
  double const flops = 2.0 * kB * kS * kK * double(kD) * kF * (backward ? 6 : 3) / np;
  state.counters["gflops_per_rank"] = flops / (total / state.iterations()) * 1e-9;
  state.counters["comm_MB_per_rank"] = bytes / 1e6;
  state.counters["comm_records"] = double(layer.comm_log().records.size());
  if (layer.expert_route() == moe::ExpertRoute::EpTp) {
    // Every expert rank routes the same (gathered) tokens; its experts compute only their slots.
    auto const ids = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.expert_ids());
    auto const& lay = layer.layout();
    double rows = 0, worst = 0;
    for (std::size_t i = 0; i < ids.span(); ++i)
      rows +=
          ids.data()[i] >= lay.first_expert && ids.data()[i] < lay.first_expert + lay.local_experts;
    MPI_Allreduce(&rows, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    state.counters["gathered_rows"] = double(ids.extent(0));
    state.counters["routed_rows_max"] =
        layer.step_plan().dense ? double(ids.extent(0)) * double(lay.local_experts) : worst;
  }
}

bool register_all() {
  std::vector<Strategy> const strategies = {
      {"dp", {"ici_data_parallelism=-1"}},
      {"fsdp", {"ici_fsdp_parallelism=-1"}},
      {"ep_a2a", {"ici_expert_parallelism=-1"}},
      {"ep_ring", {"ici_expert_parallelism=-1", "use_ring_of_experts=true"}},
      {"tp", {"ici_tensor_parallelism=-1"}},
      {"shard_exp_on_fsdp", {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=-1"}},
      {"ep_tp", {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}},
      {"ep_tp_dense",
       {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"},
       {"sparse_matmul=false"}},
  };
  for (auto const& s : strategies)
    for (bool bwd : {false, true}) {
      std::string const name = "layer_dist/" + s.name + "/" + (bwd ? "bwd" : "fwd") +
                               "/E=" + std::to_string(kE) + "/T=" + std::to_string(kB * kS) +
                               "/K=" + std::to_string(kK);
      moe_bench_mpi::register_ms(name, 3, [s, bwd](benchmark::State& st) { bm_layer(st, s, bwd); });
    }
  return true;
}

[[maybe_unused]] bool const registered = register_all();

}  // namespace
