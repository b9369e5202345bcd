// Grouped GEMM throughput of an MoE expert projection, x[T*K, D] * W[E, D, F], float32, D=1024,
// F=2816. Names: gmm/<Policy>/E=<E>/<balanced|zipf>/T=<T>/K=<K>[/isa=<tier>] (the suffix with
// moe_bench --isa), Policy one of Vendor, Tiled,
// OneDnn (only when moe is built with oneDNN), Auto; the label names the backend that runs.
// T=64/K=2 with E=64 is the decode regime (<= 2 rows per expert): weight reads, not FLOPs, bound
// it. Counters:
//   gflops       2*T*K*D*F / seconds (the expert GEMM FLOPs), seconds = median over iterations
//   dense_ratio  median over iterations of (this iteration's GFLOP/s / the dense GEMM's in the
//                call right after it): paired, so the machine's drift between iterations cancels
//   dense_gflops GFLOP/s of one dense [T*K, D] x [D, F] GEMM (same FLOPs) through the fastest
//                dense GEMM of the process (the faster of oneDNN sgemm and oneDNN's packed kernel,
//                matmul or 1x1 convolution on pre-packed weights, else KokkosBlas), median of calls
//                interleaved with the benchmark's own
//   dense_packed 1 when that dense GEMM is oneDNN's packed kernel
//   peak_ratio   median over iterations of (this iteration's GFLOP/s / an FMA burst on the GEMM
//                threads right after it, at oneDNN's ISA tier: yardsticks.hpp, PairedMachine)
//   pack_ms      packing the weights once more (the first call of a new weight version, after
//                the warm-up) minus a steady call's time; 0 for backends that do not pack
//   ref_runs     executions of a oneDNN reference implementation during the benchmark (0)
//   min_rows, max_rows  smallest and largest group
// Decode rows only:
//   weight_gbs   bytes of the weights touched / seconds, 1e9 B/s: experts with >= 1 row x D*F*4
//   bw_ratio     median over iterations of (this iteration's weight bytes per second / one triad
//                pass of the GEMM threads right after it: PairedMachine)
//
// bf16 rows (#29): gmm_bf16/OneDnn/E=<E>/<dist>/T=<T>/K=<K> run the bf16 layer's expert GEMM on
// the same shapes: x and W rounded to bf16 values, GmmOptions::bf16_inputs, so oneDNN's bf16
// kernels run where the CPU has bf16 instructions (AVX512-BF16, AMX) and its fp32 kernels on the
// same values elsewhere. Counters: gflops; over_fp32 (median over iterations of this call's time
// over the time of the fp32 call on the same values right after it: the speed-up is its
// inverse); bf16_dense_ratio (GFLOP/s over a oneDNN bf16 dense matmul of the same FLOPs, bf16 A,
// B packed once as bf16, paired; 0 without bf16 kernels); bf16_calls (packed calls that ran a
// bf16 kernel); amx_peak_ratio (CPUs with AMX: GFLOP/s over amx_bf16_peak, amx_peak.hpp); ref_runs,
// min_rows, max_rows; decode rows weight_gbs and bw_ratio on 2 bytes a weight.
//
// Model rows (#31): gmm_model/<model>/EP=<ep>/<balanced|zipf>/T=<tokens> and tgmm_model/... (the
// weight gradient, x^T dy per group) run the expert GEMMs of a published model's MoE layer
// (moe/models.hpp: mixtral-8x7b at EP=8, qwen3-30b-a3b at EP=8, qwen3-235b-a22b at EP=16,
// deepseek3-671b at EP=32) as one rank's slice: its E/EP local experts and the tokens x K x L / E
// rows they receive from `tokens` tokens, through Auto; counters gflops, dense_ratio (a dense
// GEMM of the same FLOPs), peak_ratio, local_experts, min_rows, max_rows, ref_runs.
#include "amx_peak.hpp"
#include "bench_common.hpp"

#include <moe/detail/elementwise.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/models.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
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

/// Times `run` once per benchmark iteration, each followed by the dense yardstick and the FMA
/// burst (paired), and sets the counters every GEMM row reports (gflops, dense_ratio,
/// dense_gflops, dense_packed, peak_ratio) from the median time; returns the times.
template <class Run>
std::vector<double> time_paired(benchmark::State& state, Run&& run, double flops,
                                DenseYardstick& dense_gemm, PairedMachine& machine) {
  std::vector<double> times;
  for (auto _ : state) {
    double const t0 = now();
    run();
    double const dt = now() - t0;
    state.SetIterationTime(dt);
    times.push_back(dt);
    dense_gemm.run();
    machine.run();
  }
  state.counters["gflops"] = flops / median(times) * 1e-9;
  state.counters["dense_ratio"] = dense_gemm.paired_ratio(times, flops);
  state.counters["dense_gflops"] = dense_gemm.gflops();
  state.counters["dense_packed"] = dense_gemm.packed();
  state.counters["peak_ratio"] = machine.peak_ratio(times, flops);
  return times;
}

/// The counters of the groups every GEMM row reports: ref_runs, min_rows, max_rows.
void group_counters(benchmark::State& state, std::vector<int64_t> const& sizes,
                    ReferenceRuns& reference_runs) {
  state.counters["ref_runs"] = reference_runs.since();
  state.counters["min_rows"] = double(*std::min_element(sizes.begin(), sizes.end()));
  state.counters["max_rows"] = double(*std::max_element(sizes.begin(), sizes.end()));
}

template <class Policy>
void bench_gmm(benchmark::State& state, int experts, std::string const& dist, int64_t tokens,
               int top_k, bool decode) {
  state.SetLabel(moe::gmm::backend_name<Policy, Exec, float>());
  int64_t const rows = tokens * top_k;
  auto const sizes = group_sizes(dist, rows, experts);
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  auto const& x = activations(rows);
  auto const& w = weights(experts);
  auto const& y = outputs(rows);
  Exec space;
  // As in a layer: the weights come with a PackCache and a version, so a backend that packs
  // them does so in the first (warm-up) call only; pack_ms reports what that costs.
  ReferenceRuns reference_runs;
  LayerGmmOptions packed;
  auto& opt = packed.opt;
  moe::gmm::gmm(space, Policy{}, x, w, groups, y, opt);  // warm-up: threads, primitives, caches
  space.fence();
  opt.rhs_version = 2;  // a new weight version (as after an optimizer step): packs again
  double const w0 = now();
  moe::gmm::gmm(space, Policy{}, x, w, groups, y, opt);
  space.fence();
  double const repack = now() - w0;
  DenseYardstick dense_gemm(rows, kD, kF);
  PairedMachine machine(decode);
  auto const times = time_paired(
      state,
      [&] {
        moe::gmm::gmm(space, Policy{}, x, w, groups, y, opt);
        space.fence();
      },
      2.0 * double(rows) * double(kD) * double(kF), dense_gemm, machine);
  if (decode) {
    auto const touched = std::count_if(sizes.begin(), sizes.end(), [](int64_t s) { return s > 0; });
    double const bytes = double(touched) * double(kD) * double(kF) * sizeof(float);
    state.counters["weight_gbs"] = bytes / median(times) * 1e-9;
    state.counters["bw_ratio"] = machine.bw_ratio(times, bytes);
  }
  state.counters["pack_ms"] =
      packed.cache.packs() > 0 ? std::max(0.0, repack - median(times)) * 1e3 : 0.0;
  group_counters(state, sizes, reference_runs);
}

#if MOE_HAS_ONEDNN
void bench_gmm_bf16(benchmark::State& state, int experts, std::string const& dist, int64_t tokens,
                    int top_k, bool decode) {
  namespace dn = moe::detail::onednn;
  int64_t const rows = tokens * top_k;
  auto const sizes = group_sizes(dist, rows, experts);
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  Mat<float> x("moe::bench::gmm_bf16::x", rows, kD);
  Tensor<float> w("moe::bench::gmm_bf16::w", experts, kD, kF);
  Exec space;
  Kokkos::deep_copy(space, x, activations(rows));
  Kokkos::deep_copy(space, w, weights(experts));
  moe::detail::round_bf16(space, x);
  moe::detail::round_bf16(space, w);
  space.fence();
  auto const& y = outputs(rows);
  using moe::gmm::OneDnn;
  ReferenceRuns reference_runs;
  LayerGmmOptions bf16, fp32;
  bf16.opt.bf16_inputs = true;
  for (auto* o : {&bf16.opt, &fp32.opt}) {  // warm-up: primitives, the packed weights
    moe::gmm::gmm(space, OneDnn{}, x, w, groups, y, *o);
    space.fence();
  }
  // The bf16 dense yardstick: A as bf16 bits, B packed as bf16 (where oneDNN has bf16 kernels).
  std::vector<std::uint16_t> a(std::size_t(rows * kD));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = moe::detail::bf16_bits(x.data()[i]);
  std::vector<float> c(std::size_t(rows * kF));
  std::unique_ptr<PackedDenseGemm> dense;
  if (dn::bf16_kernels()) {
    dense = std::make_unique<PackedDenseGemm>(rows, kD, kF, w.data(), true);
    if (!dense->ok()) dense.reset();
  }
  PairedMachine machine(decode);
  std::uint64_t const bf16_before = moe::gmm::onednn_stats().bf16_runs();
  std::vector<double> times, fp32_times, dense_times;
  auto timed = [&](auto&& f) {
    double const t0 = now();
    f();
    return now() - t0;
  };
  for (auto _ : state) {
    double const dt = timed([&] {
      moe::gmm::gmm(space, OneDnn{}, x, w, groups, y, bf16.opt);
      space.fence();
    });
    state.SetIterationTime(dt);
    times.push_back(dt);
    fp32_times.push_back(timed([&] {
      moe::gmm::gmm(space, OneDnn{}, x, w, groups, y, fp32.opt);
      space.fence();
    }));
    if (dense) dense_times.push_back(timed([&] { dense->run(a.data(), c.data()); }));
    machine.run();
  }
  double const flops = 2.0 * double(rows) * double(kD) * double(kF);
  state.SetLabel(std::string("OneDnn bf16 inputs: ") +
                 (dense ? "bf16 kernels, dense " + dense->name() : "fp32 kernels (no bf16 ones)"));
  state.counters["gflops"] = flops / median(times) * 1e-9;
  state.counters["over_fp32"] = paired_ratio(fp32_times, times);
  state.counters["bf16_dense_ratio"] = dense ? paired_ratio(times, dense_times) : 0.0;
  state.counters["bf16_calls"] = double(moe::gmm::onednn_stats().bf16_runs() - bf16_before);
  static double const amx_peak = amx_bf16_peak(gemm_threads());
  if (amx_peak > 0) state.counters["amx_peak_ratio"] = flops / median(times) * 1e-9 / amx_peak;
  if (decode) {
    auto const touched = std::count_if(sizes.begin(), sizes.end(), [](int64_t s) { return s > 0; });
    double const bytes = double(touched) * double(kD) * double(kF) * 2.0;
    state.counters["weight_gbs"] = bytes / median(times) * 1e-9;
    state.counters["bw_ratio"] = machine.bw_ratio(times, bytes);
  }
  group_counters(state, sizes, reference_runs);
}

void register_bf16_rows() {
  struct Shape {
    int64_t tokens;
    int top_k;
    bool decode;
  };
  for (int experts : {8, 64})
    for (char const* dist : {"balanced", "zipf"})
      for (Shape shape : {Shape{4096, 2, false}, Shape{64, 2, true}}) {
        if (shape.decode && experts != 64) continue;
        std::string const label = "gmm_bf16/OneDnn/E=" + std::to_string(experts) + "/" + dist +
                                  "/T=" + std::to_string(shape.tokens) +
                                  "/K=" + std::to_string(shape.top_k) + isa_suffix();
        std::string const d = dist;
        benchmark::RegisterBenchmark(label.c_str(),
                                     [=](benchmark::State& state) {
                                       bench_gmm_bf16(state, experts, d, shape.tokens, shape.top_k,
                                                      shape.decode);
                                     })
            ->UseManualTime()
            ->Iterations(shape.decode ? 6 : 3)
            ->Unit(benchmark::kMillisecond);
      }
}
#endif

/// Host tile: of 64x64x64, 64x32x128, 64x64x128, 64x64x256 and 128x64x128 (Serial, SSE2 and
/// AVX-512 builds) the last was at or near the top on every distribution.
using CpuTiled = moe::gmm::Tiled<128, 64, 128>;

template <class Policy>
void register_policy(std::string const& name, int iterations) {
  struct Shape {
    int64_t tokens;
    int top_k;
    bool decode;
  };
  for (int experts : {8, 64})
    for (char const* dist : {"balanced", "zipf"}) {
      std::vector<Shape> shapes{{4096, 2, false}, {1024, 8, false}};
      if (experts == 64) shapes.push_back({64, 2, true});  // decode: 128 slots on 64 experts
      for (Shape shape : shapes) {
        std::string const label = "gmm/" + name + "/E=" + std::to_string(experts) + "/" + dist +
                                  "/T=" + std::to_string(shape.tokens) +
                                  "/K=" + std::to_string(shape.top_k) + isa_suffix();
        std::string const d = dist;
        benchmark::RegisterBenchmark(label.c_str(),
                                     [=](benchmark::State& state) {
                                       bench_gmm<Policy>(state, experts, d, shape.tokens,
                                                         shape.top_k, shape.decode);
                                     })
            ->UseManualTime()
            ->Iterations(shape.decode ? 2 * iterations : iterations)
            ->Unit(benchmark::kMillisecond);
      }
    }
}

/// gmm (forward: x[rows, D] x W[L, D, F]) or tgmm (weight gradient: x^T dy per group, [L, D, F])
/// of a model slice through the Auto policy (what the layer runs); counters as bench_gmm's.
void bench_model(benchmark::State& state, ModelSlice const& m, std::string const& dist,
                 int64_t tokens, bool weight_gradient) {
  using moe::gmm::Auto;
  auto const& f = m.facts();
  int const L = m.local_experts();
  int64_t const D = f.base_emb_dim, F = f.base_moe_mlp_dim;
  int64_t const rows = m.rows(tokens);
  state.SetLabel(moe::gmm::backend_name<Auto, Exec, float>());
  auto const sizes = group_sizes(dist, rows, L);
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  Mat<float> x("moe::bench::model::x", rows, D), y("moe::bench::model::y", rows, F);
  Tensor<float> w("moe::bench::model::w", L, D, F);
  fill_uniform(x, 7);
  fill_uniform(y, 9);
  fill_uniform(w, 11, -0.05, 0.05);
  Exec space;
  ReferenceRuns reference_runs;
  LayerGmmOptions packed;
  auto const& opt = packed.opt;
  auto run = [&] {
    if (weight_gradient)
      moe::gmm::tgmm(space, Auto{}, x, y, groups, w, opt);
    else
      moe::gmm::gmm(space, Auto{}, x, w, groups, y, opt);
    space.fence();
  };
  run();  // warm-up: threads, primitives, the packed weights of version 1
  DenseYardstick dense_gemm(rows, D, F);
  PairedMachine machine(false);
  time_paired(state, run, 2.0 * double(rows) * double(D) * double(F), dense_gemm, machine);
  state.counters["local_experts"] = L;
  group_counters(state, sizes, reference_runs);
}

/// gmm_model/<model>/EP=<ep>/<dist>/T=<tokens> and tgmm_model/...: the expert GEMMs of today's
/// MoE shapes (moe/models.hpp), one rank's slice each.
void register_model_rows() {
  for (bool weight_gradient : {false, true})
    for (auto const& m : model_slices())
      for (char const* dist : {"balanced", "zipf"})
        for (int64_t tokens : {1024, 4096}) {
          std::string const label = std::string(weight_gradient ? "tgmm_model/" : "gmm_model/") +
                                    m.label() + "/" + dist + "/T=" + std::to_string(tokens) +
                                    isa_suffix();
          std::string const d = dist;
          benchmark::RegisterBenchmark(
              label.c_str(),
              [=](benchmark::State& state) { bench_model(state, m, d, tokens, weight_gradient); })
              ->UseManualTime()
              ->Iterations(3)
              ->Unit(benchmark::kMillisecond);
        }
}

}  // namespace

void moe::bench::register_gmm_benchmarks() {
  register_policy<moe::gmm::Vendor>("Vendor", 5);
  register_policy<CpuTiled>("Tiled", 2);
  if (moe::gmm::is_available<moe::gmm::OneDnn, Exec, float>::value)
    register_policy<moe::gmm::OneDnn>("OneDnn", 3);
#if MOE_HAS_ONEDNN
  register_bf16_rows();
#endif
  register_policy<moe::gmm::Auto>("Auto", 2);  // = OneDnn or Vendor: checks the resolution
  register_model_rows();
}
