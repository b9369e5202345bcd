// layer_fwd/, layer_bwd/ and permute/ benchmarks of moe_bench.
//
// Names: layer_fwd|layer_bwd/<Policy>/E=<E>/<balanced|zipf>/T=<T>/K=<K>[/isa=<tier>] (the suffix
// with moe_bench --isa) with Policy one of Vendor,
// Tiled, OneDnn (only when moe is built with oneDNN), Auto (the label names the backend that
// runs); layer_fwd/<Policy>/E=64/<dist>/T=64/K=2 is the decode regime (<= 2 tokens per expert).
// Counters of layer_* (seconds = median over iterations of the forward, or of the backward alone):
//   gflops         GEMM FLOPs / seconds: 2*T*K*D*F x 3 (forward: wi_0, wi_1, wo) or x 6 (backward:
//                  data and weight gradients of the three)
//   dense_ratio    median over iterations of (this iteration's GFLOP/s / the dense GEMM's in the
//                  call right after it; paired, so the machine's drift between iterations cancels)
//   dense_gflops   GFLOP/s of one dense [T*K, D] x [D, F] GEMM through the fastest dense GEMM of
//                  the process (the faster of oneDNN sgemm and oneDNN's packed kernel, matmul
//                  or 1x1 convolution on pre-packed weights, else KokkosBlas), calls
//                  interleaved with the layer's
//   dense_packed   1 when that dense GEMM is oneDNN's packed kernel
//   peak_ratio     median over iterations of (GFLOP/s / an FMA burst on the GEMM threads right
//                  after the iteration, at oneDNN's ISA tier: yardsticks.hpp, PairedMachine)
//   fwd_ms         median forward milliseconds
//   bwd_over_fwd   (layer_bwd) median over iterations of backward / forward (same iteration)
//   gemms_ratio    (layer_fwd) the forward's three grouped GEMMs alone (same groups and shapes):
//                  their GFLOP/s / the dense GEMM's, paired by iteration as dense_ratio
//   fwd_over_gemms (layer_fwd) median over iterations of forward / those GEMMs alone
//   nongemm_ms     (layer_fwd) median over iterations of forward - those GEMMs alone: routing,
//                  sort, gathers, activation, combine (compare across OMP_NUM_THREADS runs)
//   threads        the execution space's concurrency (Kokkos threads)
//   ref_runs       executions of a oneDNN reference implementation during the benchmark (0)
//   weight_gbs     (decode rows) expert weight bytes touched per forward / seconds, 1e9 B/s:
//                  experts that received >= 1 token x 3 matrices x D*F*4 bytes
//   bw_ratio       (decode rows) median over iterations of (weight bytes per second / one triad
//                  pass of the GEMM threads right after the iteration: PairedMachine)
// layer_fwd_bf16/ and layer_bwd_bf16/Auto/E=8/balanced/T=4096/K=2[/shared=1] (#29): the layer with
// dtype=bfloat16 (docs/precision.md; /shared=1: a shared expert of width F too, its FLOPs
// counted, no GEMMs-alone counters), the counters of layer_fwd/bwd plus
//   over_fp32      median over iterations of (this forward or backward / the same step of a
//                  float32 layer on the same inputs, run right after it)
// layer_fwd_model/ and layer_bwd_model/<model>/EP=<ep>/<dist>/T=<tokens> (#31): one rank's slice
// of a published model's layer (see register_layer_benchmarks), the counters of layer_fwd/bwd;
// layer_fwd_bf16_model/ and layer_bwd_bf16_model/ (T=1024): the same with dtype=bfloat16 and
// over_fp32, as layer_fwd_bf16/.
// permute/ (counting sort, + row gather of x[T, D] unless sort/) counts ns_per_slot only: it does
// no FLOPs, and its timing includes the sort, so neither peak_ratio nor a bandwidth ratio applies.
//
// Routing is steered exactly: the gate is the identity on the first E input features and each
// token carries a one-hot-like pattern there, so the slots follow the requested distribution
// (balanced or Zipf-1.0) while the layer runs its full routing code. The remaining features are
// random so the expert GEMMs do real work.
#include <moe/moe.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using moe::bench::DenseYardstick;
using moe::bench::Exec;
using moe::bench::fill_uniform;
using moe::bench::median;
using moe::bench::Mem;
using moe::bench::now;

constexpr int kD = 1024;
constexpr int kF = 2816;

/// Expert ids [T,K] (distinct within a token) drawn per slot: uniform cycling for "balanced",
/// weights 1/(e+1) for "zipf"; fixed seed.
std::vector<int> draw_ids(std::string const& dist, std::int64_t T, int K, int E) {
  std::mt19937_64 gen(77);
  std::vector<double> cdf(E);
  double total = 0;
  for (int e = 0; e < E; ++e) cdf[e] = (total += 1.0 / (e + 1));
  std::vector<int> ids(T * K);
  std::int64_t next = 0;
  for (std::int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      int e;
      do {
        if (dist == "zipf") {
          double const u = double(gen() >> 11) * 0x1.0p-53 * total;
          e = int(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          e = std::min(e, E - 1);
        } else {
          e = int(next++ % E);
        }
      } while (std::find(&ids[t * K], &ids[t * K] + k, e) != &ids[t * K] + k);
      ids[t * K + k] = e;
    }
  return ids;
}

template <class Layer>
void setup(Layer& layer, moe::View3<float, Mem> x, std::string const& dist, int E, int K) {
  auto& p = layer.parameters();
  fill_uniform(p.wi_0, 11, -0.03, 0.03);
  fill_uniform(p.wi_1, 12, -0.03, 0.03);
  fill_uniform(p.wo, 13, -0.02, 0.02);
  fill_uniform(x, 14, -1.0, 1.0);
  std::int64_t const T = x.extent(0) * x.extent(1);
  // The gate is the identity on the first E features, so the tokens need D >= E of them.
  moe::detail::require(std::int64_t(x.extent(2)) >= E, "bench setup: D=", x.extent(2), " < E=", E);
  auto ids = draw_ids(dist, T, K, E);
  auto g = Kokkos::create_mirror_view(p.gate);
  Kokkos::deep_copy(g, 0.0f);
  for (int e = 0; e < E; ++e) g(e, e) = 1.0f;
  Kokkos::deep_copy(p.gate, g);
  auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  auto x2 = moe::View2<float, Kokkos::HostSpace>(xh.data(), T, x.extent(2));
  for (std::int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) x2(t, e) = 0.0f;
    for (int k = 0; k < K; ++k) x2(t, ids[t * K + k]) = float(8 - k);  // order = k
  }
  Kokkos::deep_copy(x, xh);
}

/// A layer's shape: experts, experts per token, model and expert hidden dimensions.
struct LayerShape {
  int E, K;
  int D = kD, F = kF;
  bool bf16 = false;  ///< dtype=bfloat16
  int shared = 0;     ///< shared_experts
};

moe::LayerConfig bench_config(LayerShape const& s) {
  moe::LayerConfig cfg;
  cfg.num_experts = s.E;
  cfg.num_experts_per_tok = s.K;
  cfg.base_emb_dim = s.D;
  cfg.base_moe_mlp_dim = s.F;
  if (s.bf16) cfg.dtype = moe::ComputeDtype::BFloat16;
  cfg.shared_experts = s.shared;
  return cfg;
}

/// The forward's three grouped GEMMs alone: the same group sizes (read back from the layer's
/// routing), the same weights and operand shapes, no routing, permutation or activation. The
/// layer cannot be faster than these; `fwd_over_gemms` is what the rest of the layer adds. `bf16`:
/// as the bf16 layer runs them (GmmOptions::bf16_inputs, the hidden states stored as moe::bf16).
template <class Gmm, class Layer>
class GemmsAlone {
 public:
  GemmsAlone(Layer const& layer, int K, bool bf16)
      : p_(layer.parameters()) {  // const: no new version
    packed_.opt.bf16_inputs = bf16;
    auto ids = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.expert_ids());
    std::vector<std::int64_t> sizes(p_.wi_0.extent(0), 0);
    for (std::size_t t = 0; t < ids.extent(0); ++t)
      for (int k = 0; k < K; ++k) ++sizes[ids(t, k)];
    groups_ = moe::gmm::make_groups<Mem>(sizes);
    std::int64_t const n = groups_.rows(), D = p_.wi_0.extent(1), F = p_.wi_0.extent(2);
    xs_ = moe::View2<float, Mem>("xs", n, D);
    h_ = moe::View2<float, Mem>("h", n, F);
    a_ = moe::View2<float, Mem>("a", n, F);
    ys_ = moe::View2<float, Mem>("ys", n, D);
    fill_uniform(xs_, 21);
    fill_uniform(a_, 22);
    // The layer's storage of its hidden states (nn::ExpertFfn).
    if (bf16 && moe::gmm::handles_bf16<moe::gmm::resolve_t<Gmm, Exec, float>>::value) {
      h16_ = moe::View2<moe::bf16, Mem>("h16", n, F);
      a16_ = moe::View2<moe::bf16, Mem>("a16", n, F);
      moe::gmm::detail::convert_into(Exec(), a_, a16_, "moe::bench::narrow");
    }
  }
  void run() {
    if (h16_.data())
      run(h16_, a16_);
    else
      run(h_, a_);
  }
  /// Forgets the timings so far (the warm-up's).
  void reset() { times_.clear(); }
  /// Seconds of each run() since the last reset().
  std::vector<double> const& times() const { return times_; }

 private:
  template <class H>
  void run(H const& h, H const& a) {
    Exec space;
    double const t0 = now();
    auto const& opt = packed_.opt;  // weights packed once, as in the layer
    moe::gmm::gmm(space, Gmm{}, xs_, p_.wi_0, groups_, h, opt);
    moe::gmm::gmm(space, Gmm{}, xs_, p_.wi_1, groups_, h, opt);
    moe::gmm::gmm(space, Gmm{}, a, p_.wo, groups_, ys_, opt);
    space.fence();
    times_.push_back(now() - t0);
  }
  typename Layer::params_type const& p_;
  moe::bench::LayerGmmOptions packed_;
  moe::gmm::Groups<Mem> groups_;
  moe::View2<float, Mem> xs_, h_, a_, ys_;
  moe::View2<moe::bf16, Mem> h16_, a16_;
  std::vector<double> times_;
};

template <class Gmm>
void bench_layer(benchmark::State& state, bool backward, LayerShape const& shape,
                 std::string const& dist, std::int64_t T, bool decode) {
  state.SetLabel(moe::gmm::backend_name<Gmm, Exec, float>());
  using Layer = moe::MoeLayer<float, moe::Policies<moe::routing::Auto, Gmm>>;
  int const E = shape.E, K = shape.K;
  std::int64_t const D = shape.D, F = shape.F;
  Layer layer(bench_config(shape));
  std::int64_t const B = T % 4 == 0 ? 4 : 1, S = T / B;
  moe::View3<float, Mem> x("x", B, S, D), y("y", B, S, D), dx("dx", B, S, D);
  setup(layer, x, dist, E, K);
  typename Layer::params_type grads;
  Exec space;
  std::vector<double> fwd, bwd;
  moe::bench::ReferenceRuns reference_runs;
  layer.forward(x, y);  // warm-up (allocations, BLAS threads)
  if (backward) layer.backward(y, dx, grads);
  DenseYardstick dense_gemm(T * K, D, F);
  moe::bench::PairedMachine machine(decode);
  std::optional<GemmsAlone<Gmm, Layer>> gemms;
  // bf16 rows: the float32 layer on the same inputs, timed right after each iteration.
  std::optional<Layer> fp32;
  std::vector<double> fp32_times;
  typename Layer::params_type fp32_grads;
  if (shape.bf16) {
    LayerShape s32 = shape;
    s32.bf16 = false;
    fp32.emplace(bench_config(s32));
    Layer::params_type::for_each_field(layer.config(), [&](char const*, auto m) {
      Kokkos::deep_copy(fp32->parameters().*m, layer.parameters().*m);
    });
    fp32->forward(x, y);
    if (backward) fp32->backward(y, dx, fp32_grads);
  }
  if (!backward && shape.shared == 0) {  // the routed experts' GEMMs alone
    gemms.emplace(layer, K, shape.bf16);
    gemms->run();  // warm-up: packs its copy of the weights
    gemms->reset();
  }
  for (auto _ : state) {
    double const t0 = now();
    layer.forward(x, y);
    space.fence();
    double const t1 = now();
    if (backward) {
      layer.backward(y, dx, grads);
      space.fence();
    }
    double const t2 = now();
    fwd.push_back(t1 - t0);
    bwd.push_back(t2 - t1);
    state.SetIterationTime(backward ? t2 - t1 : t1 - t0);
    dense_gemm.run();
    machine.run();
    if (gemms) gemms->run();
    if (fp32) {
      double const u0 = now();
      fp32->forward(x, y);
      space.fence();
      double const u1 = now();
      if (backward) {
        fp32->backward(y, dx, fp32_grads);
        space.fence();
      }
      fp32_times.push_back(backward ? now() - u1 : u1 - u0);
    }
  }
  double const gemm_flops =  // routed (T*K rows) and shared (T rows, shared*F wide) experts
      2.0 * double(T) * double(K * F + shape.shared * F) * double(D) * (backward ? 6 : 3);
  double const seconds = median(backward ? bwd : fwd);
  double const gflops = gemm_flops / seconds * 1e-9;
  state.counters["gflops"] = gflops;
  state.counters["dense_ratio"] = dense_gemm.paired_ratio(backward ? bwd : fwd, gemm_flops);
  state.counters["dense_gflops"] = dense_gemm.gflops();
  state.counters["dense_packed"] = dense_gemm.packed();
  state.counters["peak_ratio"] = machine.peak_ratio(backward ? bwd : fwd, gemm_flops);
  if (decode) {
    // Experts that received at least one token, from the layer's routing.
    auto ids = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), layer.expert_ids());
    std::vector<char> hit(E, 0);
    for (std::size_t t = 0; t < ids.extent(0); ++t)
      for (int k = 0; k < K; ++k) hit[ids(t, k)] = 1;
    double const touched = double(std::count(hit.begin(), hit.end(), 1));
    double const bytes = touched * 3.0 * double(D) * double(F) * sizeof(float);
    state.counters["weight_gbs"] = bytes / seconds * 1e-9;
    state.counters["bw_ratio"] = machine.bw_ratio(fwd, bytes);
  }
  state.counters["fwd_ms"] = median(fwd) * 1e3;
  if (backward) state.counters["bwd_over_fwd"] = moe::bench::paired_ratio(fwd, bwd);
  if (gemms) {
    state.counters["gemms_ratio"] = dense_gemm.paired_ratio(gemms->times(), gemm_flops);
    state.counters["fwd_over_gemms"] = moe::bench::paired_ratio(gemms->times(), fwd);
    std::vector<double> rest;  // the forward's non-GEMM part, paired by iteration
    for (std::size_t i = 0; i < std::min(fwd.size(), gemms->times().size()); ++i)
      rest.push_back(fwd[i] - gemms->times()[i]);
    state.counters["nongemm_ms"] = median(rest) * 1e3;
  }
  if (fp32)
    state.counters["over_fp32"] = moe::bench::paired_ratio(fp32_times, backward ? bwd : fwd);
  state.counters["threads"] = Exec().concurrency();
  state.counters["ref_runs"] = reference_runs.since();
}

/// permute/: the counting sort (+ the row gather of x[T,1024] unless sort_only).
void bench_permute(benchmark::State& state, int E, std::string const& dist, std::int64_t TK,
                   bool sort_only) {
  int const K = 2;
  std::int64_t const T = TK / K;
  auto ids_h = draw_ids(dist, T, K, E);
  moe::View2<int, Mem> ids("ids", T, K), kept("kept", T, K);
  auto ih = Kokkos::create_mirror_view(ids);
  std::copy(ids_h.begin(), ids_h.end(), ih.data());
  Kokkos::deep_copy(ids, ih);
  Kokkos::deep_copy(kept, 1);
  moe::View2<float, Mem> x("x", T, kD), xs("xs", TK, kD);
  fill_uniform(x, 3);
  moe::permute::Permutation<Mem> perm;
  Exec space;
  for (auto _ : state) {
    double const t0 = now();
    moe::permute::sort_by_expert(space, moe::View2<int const, Mem>(ids),
                                 moe::View2<int const, Mem>(kept), E, perm);
    if (!sort_only)
      moe::permute::gather_rows(space, moe::View2<float const, Mem>(x),
                                moe::View1<std::int64_t const, Mem>(perm.perm), K, xs);
    space.fence();
    state.SetIterationTime(now() - t0);
  }
  state.SetItemsProcessed(state.iterations() * TK);
  state.counters["ns_per_slot"] =
      benchmark::Counter(double(TK) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                                benchmark::Counter::kInvert);
  state.counters["threads"] = Exec().concurrency();
}

}  // namespace

void moe::bench::register_layer_benchmarks() {
  struct Shape {
    std::int64_t T;
    int K;
    bool decode;
  };
  for (bool bwd : {false, true})
    for (int E : {8, 64})
      for (char const* dist : {"balanced", "zipf"}) {
        std::vector<Shape> shapes{{4096, 2, false}, {1024, 8, false}};
        if (E == 64 && !bwd) shapes.push_back({64, 2, true});  // decode: 128 slots, 64 experts
        for (Shape s : shapes) {
          std::string const d = dist;
          auto add = [&](std::string const& policy, auto gmm_tag, int iters) {
            using G = decltype(gmm_tag);
            std::string const name = std::string(bwd ? "layer_bwd/" : "layer_fwd/") + policy +
                                     "/E=" + std::to_string(E) + "/" + d +
                                     "/T=" + std::to_string(s.T) + "/K=" + std::to_string(s.K) +
                                     moe::bench::isa_suffix();
            benchmark::RegisterBenchmark(
                name.c_str(),
                [=](benchmark::State& st) {
                  bench_layer<G>(st, bwd, LayerShape{E, s.K}, d, s.T, s.decode);
                })
                ->UseManualTime()
                ->Iterations(iters)
                ->Unit(benchmark::kMillisecond);
          };
          add("Vendor", moe::gmm::Vendor{}, 5);
          add("Tiled", moe::gmm::Tiled<64, 64, 64>{}, 1);
          if (moe::gmm::is_available<moe::gmm::OneDnn, Exec, float>::value)
            add("OneDnn", moe::gmm::OneDnn{}, 5);
          add("Auto", moe::gmm::Auto{}, 5);  // = OneDnn or Vendor: a check of the resolution
        }
      }
  // bf16 rows (#29): the shape, beside layer_fwd|layer_bwd/Auto/E=8/balanced/T=4096/K=2.
  // With /shared=1: a shared expert of width F as well (DeepSeek's layout; its dense GEMMs).
  for (int shared : {0, 1})
    for (bool bwd : {false, true}) {
      std::string const name = std::string(bwd ? "layer_bwd_bf16/" : "layer_fwd_bf16/") +
                               "Auto/E=8/balanced/T=4096/K=2" + (shared ? "/shared=1" : "") +
                               moe::bench::isa_suffix();
      LayerShape shape{8, 2};
      shape.bf16 = true;
      shape.shared = shared;
      benchmark::RegisterBenchmark(name.c_str(),
                                   [=](benchmark::State& st) {
                                     bench_layer<moe::gmm::Auto>(st, bwd, shape, "balanced", 4096,
                                                                 false);
                                   })
          ->UseManualTime()
          ->Iterations(5)
          ->Unit(benchmark::kMillisecond);
    }
  // Model rows (#31): layer_fwd_model|layer_bwd_model/<model>/EP=<ep>/<dist>/T=<tokens>, one
  // rank's slice of a published model's MoE layer as a one-rank layer: its E/EP local experts at
  // the model's D and F, receiving the rows tokens x K x (E/EP) / E that `tokens` tokens send them
  // (as gmm_model's rows), from rows / K' tokens routed over the local experts with K' = min(K,
  // max(1, E/EP/2)) (so Zipf stays possible). The routed experts only (no shared expert, no
  // all-to-all); gflops and the ratios count the rows' GEMM FLOPs, as layer_fwd/layer_bwd.
  // The bf16 model rows (layer_fwd_bf16_model/...: dtype=bfloat16, with over_fp32) at T=1,024.
  for (bool bf16 : {false, true})
    for (bool bwd : {false, true})
      for (auto const& m : moe::bench::model_slices())
        for (char const* dist : {"balanced", "zipf"})
          for (std::int64_t tokens : {1024, 4096}) {
            if (bf16 && tokens != 1024) continue;
            auto const& f = m.facts();
            int const L = m.local_experts();
            int const K = std::min(f.num_experts_per_tok, std::max(1, L / 2));
            std::int64_t const rows = m.rows(tokens);
            LayerShape shape{L, K, f.base_emb_dim, f.base_moe_mlp_dim};
            shape.bf16 = bf16;
            std::string const d = dist;
            std::string const name = std::string(bwd ? "layer_bwd" : "layer_fwd") +
                                     (bf16 ? "_bf16_model/" : "_model/") + m.label() + "/" + d +
                                     "/T=" + std::to_string(tokens) + moe::bench::isa_suffix();
            benchmark::RegisterBenchmark(name.c_str(),
                                         [=](benchmark::State& st) {
                                           bench_layer<moe::gmm::Auto>(st, bwd, shape, d, rows / K,
                                                                       false);
                                         })
                ->UseManualTime()
                ->Iterations(3)
                ->Unit(benchmark::kMillisecond);
          }
  for (bool sort_only : {false, true})
    for (int E : {8, 64, 256})
      for (char const* dist : {"balanced", "zipf"})
        for (int lg = 12; lg <= 18; lg += 2) {
          std::string const d = dist;
          std::int64_t const TK = std::int64_t(1) << lg;
          std::string const name = std::string(sort_only ? "permute/sort/" : "permute/") +
                                   "E=" + std::to_string(E) + "/" + d + "/TK=" + std::to_string(TK);
          benchmark::RegisterBenchmark(
              name.c_str(), [=](benchmark::State& st) { bench_permute(st, E, d, TK, sort_only); })
              ->UseManualTime()
              ->Iterations(lg >= 16 ? 5 : 20)
              ->Unit(benchmark::kMicrosecond);
        }
}
