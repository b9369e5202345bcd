#pragma once
/// \file
/// Machine yardsticks of moe_bench, measured in the benchmark's own process:
///   fma_peak(threads, tier) float32 FMA peak: independent FMAs on the widest vector ISA that
///                           CPUID reports within oneDNN's ISA tier of the GEMMs (AVX2 FMAs when
///                           oneDNN is capped to AVX2), on `threads` concurrent std::threads;
///   triad_bandwidth(threads) STREAM-like triad a[i] = b[i] + s * c[i] on arrays far larger than
///                           the last-level cache;
///   PairedMachine           the same two, measured briefly after every timed iteration of a
///                           benchmark (`peak_ratio`, `bw_ratio`: paired per iteration, as the
///                           dense yardstick's `dense_ratio` is);
///   gemm_threads()          the thread count of the process's dense host GEMMs: OpenMP's
///                           (oneDNN) when moe is built with oneDNN, else OpenBLAS's.
/// fma_peak and triad_bandwidth are cached per thread count (and tier) and reported in the run's
/// context (bench_main.cpp measures them before any benchmark, so that no BLAS or OpenMP pool is
/// spinning); the ratios come from the paired measurements, since on a shared VM whose vCPUs the
/// host sometimes places on one core's SMT siblings the 2-thread peak measured 117 or 235 GFLOP/s
/// in processes minutes apart.

#include <moe/moe_config.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOE_BENCH_X86 1
#else
#define MOE_BENCH_X86 0
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif
#include <moe/threads.hpp>  // OpenMP's and OpenBLAS's entry points (weak where not compiled in)
#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

namespace moe::bench {

/// The context line of a benchmark binary built with MOE_QUICK_BUILD (benchmarks at -O0).
inline constexpr char kQuickBuildWarning[] =
    "built with MOE_QUICK_BUILD=ON (-O0, the test command's build): these timings do not "
    "represent moe; build with -DMOE_QUICK_BUILD=OFF (scripts/bench.sh does) to measure";

/// Threads of the process's dense host GEMMs: omp_get_max_threads() when moe is built with
/// oneDNN (oneDNN runs on OpenMP), else OpenBLAS's thread count; the hardware's core count when
/// neither runtime is loaded.
inline int gemm_threads() {
#if MOE_HAS_ONEDNN
  if (moe::detail::have_openmp()) return std::max(1, omp_get_max_threads());
#endif
  if (openblas_get_num_threads) return std::max(1, openblas_get_num_threads());
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace detail {

inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs body(thread, rep) on `threads` threads for `reps` repetitions; the threads of a
/// repetition start together (a barrier). Returns the wall seconds of each repetition, from the
/// first thread's start to the last thread's end. The threads are OpenMP's when the benchmarks are
/// built with OpenMP (moe with oneDNN): the GEMMs' own threads, so a yardstick measured between
/// iterations does not compete with their still-spinning workers; else std::threads.
template <class Body>
std::vector<double> run_threads(int threads, int reps, Body const& body) {
  std::vector<double> start(std::size_t(threads) * reps), end(start.size());
  auto one = [&](int t, int r) {
    start[std::size_t(r) * threads + t] = seconds_now();
    body(t, r);
    end[std::size_t(r) * threads + t] = seconds_now();
  };
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
    int const t = omp_get_thread_num();
    for (int r = 0; r < reps; ++r) {
#pragma omp barrier
      if (t < threads) one(t, r);
    }
  }
#else
  std::atomic<int> arrived{0}, generation{0};
  auto barrier = [&] {
    int const g = generation.load();
    if (arrived.fetch_add(1) + 1 == threads) {
      arrived.store(0);
      generation.fetch_add(1);
    } else {
      while (generation.load() == g) std::this_thread::yield();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int r = 0; r < reps; ++r) {
        barrier();
        one(t, r);
      }
    });
  for (auto& th : pool) th.join();
#endif
  std::vector<double> wall(reps);
  for (int r = 0; r < reps; ++r) {
    auto const s = start.begin() + std::ptrdiff_t(r) * threads;
    auto const e = end.begin() + std::ptrdiff_t(r) * threads;
    wall[r] = *std::max_element(e, e + threads) - *std::min_element(s, s + threads);
  }
  return wall;
}

/// Independent FMA chains per thread: FMA latency (4-5 cycles) x 2 pipes needs 8-10 chains to
/// keep both pipes busy; 12 leaves margin and still fits AVX2's 16 registers with the operands.
constexpr int kChains = 12;
/// Multiplier and addend of acc = acc * m + c: the chains converge to c / (1 - m) = 1, so the
/// values stay normal (no denormal or overflow slow paths).
constexpr float kMul = 0.9999f, kAdd = 0.0001f;

#if MOE_BENCH_X86
__attribute__((target("avx512f"))) inline float fma_chains_avx512(std::int64_t iters) {
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(0.5f + 0.01f * j);
  __m512 const m = _mm512_set1_ps(kMul), c = _mm512_set1_ps(kAdd);
  for (std::int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  for (int j = 1; j < kChains; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  float out[16];  // (not _mm512_reduce_add_ps: GCC 12 warns inside it with -Wuninitialized)
  _mm512_storeu_ps(out, acc[0]);
  float s = 0;
  for (float v : out) s += v;
  return s;
}

__attribute__((target("avx2,fma"))) inline float fma_chains_avx2(std::int64_t iters) {
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(0.5f + 0.01f * j);
  __m256 const m = _mm256_set1_ps(kMul), c = _mm256_set1_ps(kAdd);
  for (std::int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  for (int j = 1; j < kChains; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  float out[8];
  _mm256_storeu_ps(out, acc[0]);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/// AVX without FMA (Sandy Bridge, Ivy Bridge): a multiply and an add per element (2 flops).
__attribute__((target("avx"))) inline float fma_chains_avx(std::int64_t iters) {
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(0.5f + 0.01f * j);
  __m256 const m = _mm256_set1_ps(kMul), c = _mm256_set1_ps(kAdd);
  for (std::int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_add_ps(_mm256_mul_ps(acc[j], m), c);
  for (int j = 1; j < kChains; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  float out[8];
  _mm256_storeu_ps(out, acc[0]);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/// No AVX: a multiply and an add per element (2 flops), SSE.
inline float fma_chains_sse(std::int64_t iters) {
  __m128 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm_set1_ps(0.5f + 0.01f * j);
  __m128 const m = _mm_set1_ps(kMul), c = _mm_set1_ps(kAdd);
  for (std::int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm_add_ps(_mm_mul_ps(acc[j], m), c);
  for (int j = 1; j < kChains; ++j) acc[0] = _mm_add_ps(acc[0], acc[j]);
  float out[4];
  _mm_storeu_ps(out, acc[0]);
  return out[0] + out[1] + out[2] + out[3];
}
#endif

/// Portable fallback (non-x86): scalar chains.
inline float fma_chains_scalar(std::int64_t iters) {
  float acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = 0.5f + 0.01f * j;
  for (std::int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * kMul + kAdd;
  float s = 0;
  for (int j = 0; j < kChains; ++j) s += acc[j];
  return s;
}

struct FmaKernel {
  char const* isa;
  int lanes;  ///< floats per vector
  float (*run)(std::int64_t);
};

/// The widest vector ISA that CPUID (and the OS's saved register state) reports, capped to the
/// vector width of a oneDNN ISA tier (`tier`: oneDNN's name, e.g. "avx2", "avx512_core_bf16";
/// "" for no cap): the peak that GEMM kernels of that tier can reach.
inline FmaKernel fma_kernel(std::string const& tier = "") {
#if MOE_BENCH_X86
  __builtin_cpu_init();
  auto allows = [&](char const* prefix) { return tier.empty() || tier.rfind(prefix, 0) == 0; };
  bool const avx512 = allows("avx512"), avx2 = avx512 || allows("avx2"),
             avx = avx2 || allows("avx");
  if (avx512 && __builtin_cpu_supports("avx512f")) return {"avx512f", 16, fma_chains_avx512};
  if (avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {"avx2+fma", 8, fma_chains_avx2};
  if (avx && __builtin_cpu_supports("avx")) return {"avx (mul+add)", 8, fma_chains_avx};
  return {"sse (mul+add)", 4, fma_chains_sse};
#else
  (void)tier;
  return {"scalar", 1, fma_chains_scalar};
#endif
}

/// a[i] = b[i] + s * c[i] over [lo, hi).
inline void triad(float* __restrict a, float const* __restrict b, float const* __restrict c,
                  float s, std::size_t lo, std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}

/// Bytes of the last-level cache of one CPU: the highest-level cache of cpu0 in sysfs (what
/// lscpu shows; on a VM the L3 slice this CPU reaches), else sysconf's L3 or L2 (glibc may report
/// the host package's whole L3 there), else 32 MiB.
inline std::size_t llc_bytes() {
  int best_level = 0;
  std::size_t best = 0;
  for (int i = 0; i < 16; ++i) {
    std::string const dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::size_t size = 0;
    std::string unit;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;  // "32768K": the number, then "K" (or "M"; nothing for bytes)
    if (!unit.empty() && (unit[0] == 'M' || unit[0] == 'm'))
      size <<= 20;
    else if (!unit.empty() && (unit[0] == 'K' || unit[0] == 'k'))
      size <<= 10;
    if (level > best_level) best_level = level, best = size;
  }
  if (best > 0) return best;
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 <= 0) l3 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l3 > 0 ? std::size_t(l3) : std::size_t(32) << 20;
}

}  // namespace detail

/// The FMA peak of `threads` threads.
struct FmaPeak {
  double gflops = 0;  ///< best repetition, all threads together
  int threads = 0;
  std::string isa;  ///< e.g. "avx2+fma", "avx512f"
};

/// GFLOP/s of `threads` concurrent std::threads each running 12 independent chains of vector
/// FMAs (fma_kernel(tier), 2 flops per lane per FMA) for `iters` iterations: the best of `reps`
/// repetitions (after `warmup` unmeasured ones, for the clock's ramp-up).
inline double fma_burst_gflops(int threads, std::string const& tier, std::int64_t iters, int reps,
                               int warmup) {
  namespace d = detail;
  d::FmaKernel const k = d::fma_kernel(tier);
  std::vector<float> sink(std::size_t(std::max(1, threads)));
  auto wall = d::run_threads(threads, warmup + reps, [&](int t, int) { sink[t] += k.run(iters); });
  wall.erase(wall.begin(), wall.begin() + warmup);
  // Keep the chains' results observable, so the loops cannot be dropped.
  static std::atomic<float> observed{0};
  for (float v : sink) observed.store(observed.load() + v);
  double const flops = double(threads) * double(iters) * d::kChains * k.lanes * 2.0;
  return flops / *std::min_element(wall.begin(), wall.end()) * 1e-9;
}

/// Measures (once per thread count and tier, then cached) the float32 FMA peak: fma_burst_gflops
/// on the widest ISA that CPUID reports within the oneDNN tier `tier` ("" : no cap; see
/// fma_kernel), best of 5 repetitions of 2^23 iterations each (tens of milliseconds), after one
/// warm-up repetition.
inline FmaPeak fma_peak(int threads, std::string const& tier = "") {
  static std::mutex mutex;
  static std::map<std::pair<int, std::string>, FmaPeak> cache;
  std::lock_guard<std::mutex> lock(mutex);
  threads = std::max(1, threads);
  if (auto it = cache.find({threads, tier}); it != cache.end()) return it->second;
  FmaPeak p;
  p.gflops = fma_burst_gflops(threads, tier, std::int64_t(1) << 23, 5, 1);
  p.threads = threads;
  p.isa = detail::fma_kernel(tier).isa;
  return cache[{threads, tier}] = p;
}

/// Triad bandwidth of `threads` threads.
struct TriadBandwidth {
  double gbs = 0;  ///< best repetition, 1e9 bytes per second
  int threads = 0;
  std::size_t array_bytes = 0;  ///< bytes of each of the three arrays
};

namespace detail {

/// The three float arrays of the triad, max(64 MiB, 4 x last-level cache) each, allocated once per
/// thread count (kept for the process: the paired yardstick runs a pass after every iteration) and
/// first-touched by the thread that uses each part.
class TriadArrays {
 public:
  static TriadArrays& of(int threads) {
    static std::mutex mutex;
    static std::map<int, std::unique_ptr<TriadArrays>> all;
    std::lock_guard<std::mutex> lock(mutex);
    auto& a = all[threads];
    if (!a) a.reset(new TriadArrays(threads));
    return *a;
  }
  std::size_t bytes() const { return bytes_; }
  /// Wall seconds of `reps` passes a[i] = b[i] + 3 * c[i], the threads splitting the range.
  std::vector<double> passes(int reps) {
    auto const wall = run_threads(threads_, reps, [&](int t, int) {
      auto [lo, hi] = range(t);
      triad(a_.get(), b_.get(), c_.get(), 3.0f, lo, hi);
    });
    static std::atomic<float> observed{0};
    observed.store(observed.load() + a_.get()[n_ / 2] + a_.get()[n_ - 1]);
    return wall;
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  using Array = std::unique_ptr<float, Free>;

  explicit TriadArrays(int threads)
      : threads_(threads),
        bytes_((std::max(std::size_t(64) << 20, 4 * llc_bytes()) + 4095) / 4096 * 4096),
        n_(bytes_ / sizeof(float)),
        a_(alloc()),
        b_(alloc()),
        c_(alloc()) {
    run_threads(threads_, 1, [&](int t, int) {  // first touch by the thread that uses the pages
      auto [lo, hi] = range(t);
      std::fill(a_.get() + lo, a_.get() + hi, 0.0f);
      std::fill(b_.get() + lo, b_.get() + hi, 1.0f);
      std::fill(c_.get() + lo, c_.get() + hi, 2.0f);
    });
  }
  Array alloc() const { return Array(static_cast<float*>(std::aligned_alloc(4096, bytes_))); }
  std::pair<std::size_t, std::size_t> range(int t) const {
    return {n_ * std::size_t(t) / threads_, n_ * std::size_t(t + 1) / threads_};
  }

  int threads_;
  std::size_t bytes_, n_;
  Array a_, b_, c_;
};

}  // namespace detail

/// Measures (once per thread count, then cached) the STREAM triad a[i] = b[i] + s * c[i] on the
/// three arrays of TriadArrays; best of 10 repetitions. Bytes counted per repetition: 3 arrays (2
/// read + 1 written), the STREAM convention: the write-allocate read of `a` that ordinary stores
/// cause is NOT counted (so the DRAM traffic is up to 4/3 of the figure).
inline TriadBandwidth triad_bandwidth(int threads) {
  static std::mutex mutex;
  static std::map<int, TriadBandwidth> cache;
  std::lock_guard<std::mutex> lock(mutex);
  threads = std::max(1, threads);
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  auto& arrays = detail::TriadArrays::of(threads);
  auto const wall = arrays.passes(10);
  TriadBandwidth r;
  r.gbs = 3.0 * double(arrays.bytes()) / *std::min_element(wall.begin(), wall.end()) * 1e-9;
  r.threads = threads;
  r.array_bytes = arrays.bytes();
  return cache[threads] = r;
}

/// The oneDNN ISA tier the process's GEMMs run at ("avx2", "avx512_core", ...; "" without
/// oneDNN): the cap of the FMA peak that peak_ratio divides by.
inline std::string gemm_tier() {
#if MOE_HAS_ONEDNN
  return moe::detail::onednn::isa_name();
#else
  return "";
#endif
}

/// \brief The machine yardsticks paired with a benchmark's iterations, as the dense yardstick is:
/// run() after each timed iteration measures a short FMA burst on the GEMM threads at the GEMMs'
/// tier (best of 3 repetitions of 2^20 iterations per thread after one more, ~15 ms) and, for
/// bandwidth-bound rows, one
/// triad pass over TriadArrays (~15 ms). The ratios are medians over iterations of each
/// iteration's rate over the yardstick measured right after it. A once-per-process yardstick is
/// not enough on a shared VM: its two vCPUs are at times placed on one core's SMT siblings, for
/// seconds to minutes, and processes minutes apart measured a 2-thread FMA peak of 117 and 235
/// GFLOP/s (and a triad of 24 and 51 GB/s), so a GEMM that ran after the placement changed read
/// 1.35 of "peak".
class PairedMachine {
 public:
  explicit PairedMachine(bool bandwidth)
      : threads_(gemm_threads()), tier_(gemm_tier()), bandwidth_(bandwidth) {}

  /// One measurement of each yardstick; call it right after each timed iteration.
  void run() {
    gflops_.push_back(fma_burst_gflops(threads_, tier_, std::int64_t(1) << 20, 3, 1));
    if (bandwidth_) {
      auto& arrays = detail::TriadArrays::of(threads_);
      gbs_.push_back(3.0 * double(arrays.bytes()) / arrays.passes(1).front() * 1e-9);
    }
  }
  /// Median over iterations i of (flops / seconds[i]) / (the FMA burst's FLOP/s after it).
  double peak_ratio(std::vector<double> const& seconds, double flops) const {
    return ratio(seconds, gflops_, flops * 1e-9);
  }
  /// Median over iterations i of (bytes / seconds[i]) / (the triad pass's bytes/s after it).
  double bw_ratio(std::vector<double> const& seconds, double bytes) const {
    return ratio(seconds, gbs_, bytes * 1e-9);
  }

 private:
  static double ratio(std::vector<double> const& seconds, std::vector<double> const& rates,
                      double amount) {
    std::vector<double> r;
    for (std::size_t i = 0; i < std::min(seconds.size(), rates.size()); ++i)
      r.push_back(amount / seconds[i] / rates[i]);
    if (r.empty()) return 0.0;
    std::sort(r.begin(), r.end());
    std::size_t const h = r.size() / 2;
    return r.size() % 2 ? r[h] : 0.5 * (r[h - 1] + r[h]);
  }

  int threads_;
  std::string tier_;
  bool bandwidth_;
  std::vector<double> gflops_, gbs_;
};

}  // namespace moe::bench
