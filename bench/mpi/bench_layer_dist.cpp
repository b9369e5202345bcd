// layer_dist/ benchmarks of moe_bench_mpi: the distributed layer's forward and backward per
// strategy, with the bytes each rank sent in that step (from the layer's comm log) next to the
// time. Every rank runs the same fixed iterations; the time is the slowest rank's.
//
// The cost model's prediction of the same phase (#30, part 3), on a machine measured in the same
// process with every rank running at once (measured_machine: the three dense float GEMMs of the
// experts' FFN at its shape, a triad pass, an all-gather and a one-value all-reduce over the world,
// all ranks on one node; oneDNN's packing of the weights where the grouped GEMM is oneDNN's):
// `predicted_ms` (the slowest rank's) and `measured_over_predicted`. The layer runs on the same
// weights every iteration, so the prediction is the layer's without an optimizer step
// (weights_updated=false).
//
//   layer_dist/<strategy>/<fwd|bwd>/E=8/T=<global tokens>/K=2
//
// <strategy>_bf16 (ep_a2a_bf16, fsdp_bf16, ep_ring_bf16): the same layouts with dtype=bfloat16,
// whose all-to-alls, activation collectives and weight gathers move 16-bit bf16
// (docs/precision.md, "Wire"): comm_MB_per_rank is half the fp32 row's but for the gradient
// reductions (fp32).
//
// EP-TP (ep_tp, and ep_tp_dense: every local expert on every token, the yardstick of expert work
// that grows with the gathered tokens) also reports the rows after its all-gather
// (gathered_rows, the same at every EP) and the rows its local experts computed
// (routed_rows_max, the most over the ranks): with EP=2 and EP=4 the second halves, the first
// stays; the time follows the routed rows.
#include <moe/detail/blas.hpp>
#include <moe/distributed/cost.hpp>
#include <moe/distributed/layer.hpp>

#include "../yardsticks.hpp"
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

constexpr int kD = 1024, kF = 2816, kE = 8, kK = 2;
constexpr std::int64_t kB = 8, kS = 256;  // 2048 global tokens

struct Strategy {
  std::string name;
  std::vector<std::string> keys;
  std::vector<std::string> layer = {};  ///< LayerConfig key=value
};

using moe_bench_mpi::fill;

/// This machine as the cost model sees it, measured once per process with every rank running at
/// once (see the file comment): the slowest rank's rates.
moe::Machine const& measured_machine() {
  static moe::Machine const m = [] {
    int np = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &np);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    moe::Machine out = moe::Machine::preset("cpu-cluster");
    out.name = "this machine (measured)";
    out.ranks_per_node = np;
    auto slowest = [](double v) {  // the smallest rate over the ranks
      double r = 0;
      MPI_Allreduce(&v, &r, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      return r;
    };
    // GEMM: the three products of a training step's expert FFN at the experts' shape, each best
    // of 3 with every rank at once: forward [1024, D] x [D, F], the input gradient
    // [1024, F] x [F, D] (the weights transposed), the weight gradient [D, 1024] x [1024, F]
    // (the activations transposed); their FLOPs over their summed times.
    std::int64_t const rows = 1024;
    moe::View2<float, Mem> x("x", rows, kD), w("w", kD, kF), h("h", rows, kF), dx("dx", rows, kD),
        dw("dw", kD, kF);
    fill(x, 1, 1.0f);
    fill(w, 2, 0.03f);
    fill(h, 3, 1.0f);
    double seconds = 0;
    for (int product = 0; product < 3; ++product) {
      double best = 1e30;
      for (int r = 0; r < 4; ++r) {
        double const t = moe_bench_mpi::timed(MPI_COMM_WORLD, [&] {
          if (product == 0) moe::detail::gemm(Exec(), "N", "N", 1.0f, x, w, 0.0f, h);
          if (product == 1) moe::detail::gemm(Exec(), "N", "T", 1.0f, h, w, 0.0f, dx);
          if (product == 2) moe::detail::gemm(Exec(), "T", "N", 1.0f, x, h, 0.0f, dw);
          Kokkos::fence();
        });
        if (r > 0) best = std::min(best, t);
      }
      seconds += best;
    }
    out.gemm_gflops_fp32 = slowest(3 * 2.0 * double(rows) * kD * kF / seconds * 1e-9);
    out.gemm_gflops_fp64 = out.gemm_gflops_fp32 / 2;
    // Memory: a triad pass on this rank's threads, all ranks at once.
    MPI_Barrier(MPI_COMM_WORLD);
    out.memory_gbps =
        slowest(moe::bench::triad_bandwidth(Kokkos::DefaultHostExecutionSpace().concurrency()).gbs);
    // The grouped GEMM the layer runs (Auto): oneDNN's packs its weights on the host.
    out.packs_weights = moe::detail::runs_on_host<Exec>() && MOE_HAS_ONEDNN;
    // Links: an all-gather of 32 MB blocks (bytes sent: a block to every other rank; the size of
    // the FSDP weight gathers, larger than the last-level cache) and the latency of a one-value
    // all-reduce (2(P-1) steps).
    if (np > 1) {
      std::vector<float> send(std::size_t(8) << 20), recv(send.size() * std::size_t(np));
      double t = 1e30;
      for (int r = 0; r < 4; ++r)
        t = std::min(t, moe_bench_mpi::timed(MPI_COMM_WORLD, [&] {
                       MPI_Allgather(send.data(), int(send.size()), MPI_FLOAT, recv.data(),
                                     int(send.size()), MPI_FLOAT, MPI_COMM_WORLD);
                     }));
      out.intra_gbps = slowest(double(send.size()) * 4 * (np - 1) / t * 1e-9);
      out.inter_gbps = out.intra_gbps;
      double one = 1, sum = 0, lat = 1e30;
      for (int r = 0; r < 20; ++r)
        lat = std::min(lat, moe_bench_mpi::timed(MPI_COMM_WORLD, [&] {
                         MPI_Allreduce(&one, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
                       }));
      out.intra_latency_us = out.inter_latency_us = std::max(1e-3, lat * 1e6 / (2.0 * (np - 1)));
    }
    return out;
  }();
  return m;
}

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
  // The cost model's prediction of this phase on the measured machine (the slowest rank's).
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  auto const plan = moe::make_plan(cfg, par, np, rank, kB, kS);
  // The same weights every iteration: only the gathered or sliced compute blocks are new.
  auto const cost = moe::estimate_step_cost(plan, measured_machine(), /*weights_updated=*/false);
  double mine = backward ? cost.seconds - cost.forward_seconds() : cost.forward_seconds(), pred = 0;
  MPI_Allreduce(&mine, &pred, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  state.counters["predicted_ms"] = pred * 1e3;
  state.counters["measured_over_predicted"] = total / state.iterations() / pred;
  state.counters["machine_gemm_gflops"] = measured_machine().gemm_gflops_fp32;
  state.counters["machine_link_gbps"] = measured_machine().intra_gbps;
  state.counters["machine_memory_gbps"] = measured_machine().memory_gbps;
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
      {"fsdp_bf16", {"ici_fsdp_parallelism=-1"}, {"dtype=bfloat16"}},
      {"ep_a2a", {"ici_expert_parallelism=-1"}},
      {"ep_a2a_bf16", {"ici_expert_parallelism=-1"}, {"dtype=bfloat16"}},
      {"ep_ring", {"ici_expert_parallelism=-1", "use_ring_of_experts=true"}},
      {"ep_ring_bf16",
       {"ici_expert_parallelism=-1", "use_ring_of_experts=true"},
       {"dtype=bfloat16"}},
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
