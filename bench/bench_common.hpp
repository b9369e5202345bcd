#pragma once
/// \file
/// Helpers shared by the moe_bench suites: the dense-GEMM yardstick (`dense_ratio`), the machine
/// yardsticks (`peak_ratio`, `bw_ratio`: yardsticks.hpp), MoE group size distributions, and
/// random fills.

#include "yardsticks.hpp"

#include <moe/gmm/backend/onednn.hpp>
#include <moe/models.hpp>
#include <moe/moe_config.hpp>
#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace moe::bench {

using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
template <class S>
using Mat = Kokkos::View<S**, Kokkos::LayoutRight, Mem>;
template <class S>
using Tensor = Kokkos::View<S***, Kokkos::LayoutRight, Mem>;

/// A per-process cache of Views keyed by shape. Views must die before Kokkos::finalize, so the
/// cache empties itself from a finalize hook.
template <class Key, class ViewT>
class ViewCache {
 public:
  template <class Make>
  ViewT const& get(Key const& key, Make&& make) {
    if (!hooked_) {
      Kokkos::push_finalize_hook([this] { views_.clear(); });
      hooked_ = true;
    }
    auto it = views_.find(key);
    if (it == views_.end()) it = views_.emplace(key, make()).first;
    return it->second;
  }

 private:
  std::map<Key, ViewT> views_;
  bool hooked_ = false;
};

/// The ISA tier moe_bench was asked for with --isa ("" when not given): appended to every
/// benchmark name as "/isa=<tier>" (isa_suffix()), so the runs of several tiers can be merged.
inline std::string& isa_tag() {
  static std::string tag;
  return tag;
}
inline std::string isa_suffix() { return isa_tag().empty() ? "" : "/isa=" + isa_tag(); }

/// Registration of the benchmark families (bench_gmm.cpp, bench_layer.cpp), called by main after
/// it read --isa.
void register_gmm_benchmarks();
void register_layer_benchmarks();

/// Executions of oneDNN reference implementations since construction (the ref_runs counter of
/// the rows that can run oneDNN: 0 is the only acceptable value).
class ReferenceRuns {
 public:
  ReferenceRuns() : before_(moe::gmm::onednn_stats().reference_runs) {}
  double since() const { return double(moe::gmm::onednn_stats().reference_runs - before_); }

 private:
  std::uint64_t before_;
};

/// GEMM options as a layer passes them: its own PackCache and weight version 1, so a backend
/// that packs the weights does so in the first call only. Not copyable (opt points at cache).
struct LayerGmmOptions {
  moe::gmm::PackCache cache;
  moe::gmm::GmmOptions opt;
  LayerGmmOptions() {
    opt.pack_cache = &cache;
    opt.rhs_version = 1;
  }
  LayerGmmOptions(LayerGmmOptions const&) = delete;
  LayerGmmOptions& operator=(LayerGmmOptions const&) = delete;
};

/// One rank's slice of a published model's experts under expert parallelism `ep` (#31): its
/// E/ep local experts and the rows they receive when `tokens` tokens pick K of all E experts.
struct ModelSlice {
  std::string model;
  int ep;
  moe::ModelFacts const& facts() const { return moe::model_facts(model); }
  int local_experts() const { return facts().num_experts / ep; }
  /// tokens x K x local_experts / E (balanced routing).
  std::int64_t rows(std::int64_t tokens) const {
    return tokens * facts().num_experts_per_tok * local_experts() / facts().num_experts;
  }
  /// "<model>/EP=<ep>", as the model rows name it.
  std::string label() const { return model + "/EP=" + std::to_string(ep); }
};

/// The slices of the model rows: mixtral-8x7b and qwen3-30b-a3b at EP=8, qwen3-235b-a22b at
/// EP=16, deepseek3-671b at EP=32 (shapes from moe/models.hpp).
inline std::vector<ModelSlice> const& model_slices() {
  static std::vector<ModelSlice> const s = {
      {"mixtral-8x7b", 8}, {"qwen3-30b-a3b", 8}, {"qwen3-235b-a22b", 16}, {"deepseek3-671b", 32}};
  return s;
}

/// Wall-clock seconds since some fixed point (steady clock).
inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Fills v with uniform values in [lo, hi) from a fixed seed (reproducible across runs).
template <class ViewT>
void fill_uniform(ViewT const& v, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  using S = typename ViewT::value_type;
  Kokkos::Random_XorShift64_Pool<Exec> pool(seed);
  Kokkos::fill_random(v, pool, S(lo), S(hi));
  Exec().fence();
}

/// Median of a list of timings (robust to the odd interrupted call on a shared machine).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t const h = v.size() / 2;
  return v.empty() ? 0.0 : v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

/// Median over i of scale * den[i] / num[i] (i < the shorter length; 0 when empty): the ratio of
/// two rates measured in the same iterations, e.g. num = an operation's seconds, den = a
/// yardstick's seconds, scale = operation FLOPs / yardstick FLOPs.
inline double paired_ratio(std::vector<double> const& num, std::vector<double> const& den,
                           double scale = 1.0) {
  std::vector<double> r;
  for (std::size_t i = 0; i < std::min(num.size(), den.size()); ++i)
    r.push_back(scale * den[i] / num[i]);
  return r.empty() ? 0.0 : median(r);
}

#if MOE_HAS_ONEDNN
/// A dense C[M,N] = A[M,K] * B[K,N] (row-major, packed strides) on oneDNN's best packed kernel
/// for these M rows at the process's thread count: the first primitive family of gmm::OneDnn
/// (matmul, then 1x1 convolution) whose descriptor with oneDNN's preferred weight layout has a
/// direct kernel, B reordered once into that layout. ok() is false when neither has one. Runs
/// through moe::detail::onednn::Kernel, which passes the scratchpad the user-mode descriptor asks
/// for. bf16: A is bf16 and B is packed as bf16 (the bf16 dense yardstick; fp32 accumulation and
/// C), ok() only where oneDNN has a direct bf16 kernel.
class PackedDenseGemm {
 public:
  PackedDenseGemm(int64_t M, int64_t K, int64_t N, float const* b, bool bf16 = false)
      : M_(M), K_(K), N_(N), bf16_(bf16) {
    namespace dn = moe::detail::onednn;
    auto const dt = bf16 ? dn::DataType::bf16 : dn::DataType::f32;
    for (dn::Family f : {dn::Family::matmul, dn::Family::conv}) {
      try {
        auto const any = dn::tagged_weights(f, K, N, dnnl::memory::format_tag::any, dt);
        dn::with_pd(f, M, K, N, K, N, any, false, [&](auto const& pd) {
          if (!dn::direct_kernel(pd.impl_info_str())) return 0;
          kernel_ = std::make_unique<dn::Kernel>(pd, dn::kernel_what(f, M, K, N, false, bf16),
                                                 bf16 ? " bf16" : "");
          packed_b_ = dnnl::memory(pd.weights_desc(), dn::engine());
          return 0;
        });
      } catch (dnnl::error const&) {
      }
      if (!kernel_) continue;
      family_ = f;
      dnnl::memory user(dn::weights_desc(f, K, N, false, N), dn::engine(), const_cast<float*>(b));
      dn::Kernel pack(dnnl::reorder::primitive_desc(dn::engine(), user.get_desc(), dn::engine(),
                                                    packed_b_.get_desc(), dn::kernel_attr(false)),
                      "pack the dense yardstick's B");
      pack.run({{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, packed_b_}});
      return;
    }
  }
  bool ok() const { return kernel_ != nullptr; }
  /// "matmul (brg:avx512_core)".
  std::string name() const {
    return ok() ? std::string(moe::detail::onednn::family_name(family_)) + " (" + kernel_->impl() +
                      ")"
                : "none";
  }
  /// C = A * B; A holds M x K floats, or bf16 bits (std::uint16_t) for a bf16 yardstick.
  void run(void const* a, float* c) const {
    namespace dn = moe::detail::onednn;
    auto const dt = bf16_ ? dn::DataType::bf16 : dn::DataType::f32;
    kernel_->run(
        {{DNNL_ARG_SRC,
          dnnl::memory(dn::rows_desc(family_, M_, K_, K_, dt), dn::engine(), const_cast<void*>(a))},
         {DNNL_ARG_WEIGHTS, packed_b_},
         {DNNL_ARG_DST, dnnl::memory(dn::rows_desc(family_, M_, N_, N_), dn::engine(), c)}});
  }

 private:
  int64_t M_, K_, N_;
  bool bf16_ = false;
  moe::detail::onednn::Family family_ = moe::detail::onednn::Family::matmul;
  std::unique_ptr<moe::detail::onednn::Kernel> kernel_;
  dnnl::memory packed_b_;
};
#endif

/// The yardstick of every benchmark: one dense row-major float GEMM C[M,N] = A[M,K] * B[K,N]
/// through the fastest dense GEMM of the process (backend()), i.e. the same FLOPs as a grouped
/// GEMM whose groups cover M rows. With oneDNN on host memory two candidates are timed at
/// construction and the faster one is kept: oneDNN's sgemm, and oneDNN's packed kernel
/// (PackedDenseGemm: B packed once into the layout oneDNN prefers for M rows, the best case of
/// what gmm::OneDnn does per group); without oneDNN it is KokkosBlas::gemm (the vendor BLAS).
/// The benchmark calls run() after each of its own timed iterations, so both are measured on the
/// same machine state: on this shared machine the speed drifts by 10-20 % over seconds, and a
/// yardstick timed before or after the benchmark moved the ratio by as much.
class DenseYardstick {
 public:
  DenseYardstick(int64_t M, int64_t K, int64_t N)
      : a_("moe::bench::dense::A", M, K),
        b_("moe::bench::dense::B", K, N),
        c_("moe::bench::dense::C", M, N),
        flops_(2.0 * double(M) * double(K) * double(N)) {
    fill_uniform(a_, 1);
    fill_uniform(b_, 2);
#if MOE_HAS_ONEDNN
    if constexpr (use_onednn) {
      packed_ = std::make_unique<PackedDenseGemm>(M, K, N, b_.data());
      if (packed_->ok()) {
        // Pick the faster of the two by the median of three calls each (after one warm-up).
        std::vector<double> t[2];
        for (int rep = 0; rep < 4; ++rep)
          for (int c = 0; c < 2; ++c) {
            use_packed_ = c == 1;
            double const t0 = now();
            gemm();
            if (rep > 0) t[c].push_back(now() - t0);
          }
        use_packed_ = median(t[1]) < median(t[0]);
        return;
      }
    }
#endif
    gemm();  // warm-up: GEMM threads, first touch
  }
  /// The dense GEMM the yardstick runs: "oneDNN sgemm", "oneDNN packed matmul (brg:...)" or
  /// "KokkosBlas::gemm".
  std::string backend() const {
#if MOE_HAS_ONEDNN
    if (use_packed_) return "oneDNN packed " + packed_->name();
#endif
    return use_onednn ? "oneDNN sgemm" : "KokkosBlas::gemm";
  }
  /// What the yardstick chooses from (the benchmark context).
  static constexpr char const* candidates() {
    return use_onednn ? "fastest of oneDNN sgemm and oneDNN's packed kernel (matmul or 1x1 "
                        "convolution, weights packed once), per benchmark (counter dense_packed = "
                        "1 for the packed kernel)"
                      : "KokkosBlas::gemm";
  }
  /// 1 when the yardstick runs the packed kernel, else 0 (a benchmark counter).
  double packed() const { return use_packed_ ? 1.0 : 0.0; }
  /// One timed call.
  void run() {
    double const t0 = now();
    gemm();
    times_.push_back(now() - t0);
  }
  /// C of the last call (for tests).
  Mat<float> const& c() const { return c_; }
  Mat<float> const& a() const { return a_; }
  Mat<float> const& b() const { return b_; }
  /// GFLOP/s of the median call.
  double gflops() const { return flops_ / median(times_) * 1e-9; }
  /// Median over iterations i of (op_flops / op_seconds[i]) / (this GEMM's rate in its i-th
  /// call): each iteration is paired with the yardstick call made right after it, so a drift of
  /// the machine between iterations (10-20 % over seconds on shared hosts) cancels.
  double paired_ratio(std::vector<double> const& op_seconds, double op_flops) const {
    return moe::bench::paired_ratio(op_seconds, times_, op_flops / flops_);
  }

 private:
  static constexpr bool use_onednn =
      MOE_HAS_ONEDNN && Kokkos::SpaceAccessibility<Kokkos::HostSpace, Mem>::accessible;

  void gemm() {
#if MOE_HAS_ONEDNN
    if constexpr (use_onednn) {
      namespace dn = moe::detail::onednn;
      Exec().fence();
      if (use_packed_) {
        packed_->run(a_.data(), c_.data());
        return;
      }
      dn::sgemm('N', 'N', c_.extent(0), c_.extent(1), a_.extent(1), 1.0f, a_.data(), a_.stride(0),
                b_.data(), b_.stride(0), 0.0f, c_.data(), c_.stride(0));
      return;
    }
#endif
    KokkosBlas::gemm("N", "N", 1.0f, a_, b_, 0.0f, c_);
    Exec().fence();
  }

  Mat<float> a_, b_, c_;
#if MOE_HAS_ONEDNN
  std::unique_ptr<PackedDenseGemm> packed_;
#endif
  bool use_packed_ = false;
  double flops_;
  std::vector<double> times_;
};

/// Group sizes of `slots` routed slots (T*K) spread evenly over E experts (the first
/// slots % E experts get one more).
inline std::vector<int64_t> balanced_sizes(int64_t slots, int experts) {
  std::vector<int64_t> sizes(experts, slots / experts);
  for (int64_t e = 0; e < slots % experts; ++e) ++sizes[e];
  return sizes;
}

/// Group sizes of `slots` routed slots where each slot independently picks expert e with
/// probability proportional to 1/(e+1) (Zipf, exponent 1): expert 0 is the hottest. Sampled from
/// a fixed seed with a portable generator (std::mt19937_64 + inverse CDF), so every platform
/// gets the same sizes.
inline std::vector<int64_t> zipf_sizes(int64_t slots, int experts, uint64_t seed = 2024) {
  std::vector<double> cdf(experts);
  double total = 0;
  for (int e = 0; e < experts; ++e) cdf[e] = (total += 1.0 / (e + 1));
  std::mt19937_64 gen(seed);
  std::vector<int64_t> sizes(experts, 0);
  for (int64_t s = 0; s < slots; ++s) {
    double const u = double(gen() >> 11) * 0x1.0p-53 * total;  // uniform in [0, total)
    int e = 0;
    while (e + 1 < experts && cdf[e] <= u) ++e;
    ++sizes[e];
  }
  return sizes;
}

/// "balanced" or "zipf" sizes by name.
inline std::vector<int64_t> group_sizes(std::string const& dist, int64_t slots, int experts) {
  return dist == "zipf" ? zipf_sizes(slots, experts) : balanced_sizes(slots, experts);
}

}  // namespace moe::bench
