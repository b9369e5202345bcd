#pragma once
/// \file
/// Machine yardsticks of moe_bench, measured in the benchmark's own process:
///   fma_peak(threads, tier) float32 FMA peak: independent FMAs on the widest vector ISA that
///                           CPUID reports within oneDNN's ISA tier of the GEMMs (AVX2 FMAs when
///                           oneDNN is capped to AVX2), on `threads` concurrent std::threads
///                           (`peak_ratio`);
///   triad_bandwidth(threads) STREAM-like triad a[i] = b[i] + s * c[i] on arrays far larger than
///                           the last-level cache (`bw_ratio`);
///   gemm_threads()          the thread count of the process's dense host GEMMs: OpenMP's
///                           (oneDNN) when moe is built with oneDNN, else OpenBLAS's.
/// Both measurements are cached per thread count (and tier), so each runs once per process (call
/// them before the benchmarks start, as bench_main.cpp does, so that no BLAS or OpenMP pool is
/// spinning). Unlike the dense yardstick (interleaved with every iteration), they are not
/// re-measured: on a shared VM whose vCPUs the host sometimes places on one core's SMT siblings,
/// the 2-thread peak measured 100 or 200 GFLOP/s in runs minutes apart, so compare peak_ratio
/// across runs only together with the run's fma_peak context entry.

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

#include <moe/threads.hpp>  // OpenMP's and OpenBLAS's entry points (weak where not compiled in)
#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

namespace moe::bench {

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

namespace yardstick_detail {

inline double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Runs body(thread, rep) on `threads` std::threads for `reps` repetitions; the threads of a
/// repetition start together (a barrier). Returns the wall seconds of each repetition, from the
/// first thread's start to the last thread's end.
template <class Body>
std::vector<double> run_threads(int threads, int reps, Body const& body) {
  std::vector<double> start(std::size_t(threads) * reps), end(start.size());
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
        start[std::size_t(r) * threads + t] = seconds_now();
        body(t, r);
        end[std::size_t(r) * threads + t] = seconds_now();
      }
    });
  for (auto& th : pool) th.join();
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

}  // namespace yardstick_detail

/// The FMA peak of `threads` threads.
struct FmaPeak {
  double gflops = 0;  ///< best repetition, all threads together
  int threads = 0;
  std::string isa;  ///< e.g. "avx2+fma", "avx512f"
};

/// Measures (once per thread count and tier, then cached) the float32 FMA peak: each of
/// `threads` concurrent std::threads runs 12 independent chains of vector FMAs on the widest ISA
/// that CPUID reports within the oneDNN tier `tier` ("" : no cap; see fma_kernel) (2 flops per
/// lane per FMA); best of 5 repetitions of ~2^23 iterations each (tens of milliseconds), after
/// one warm-up repetition (clock ramp-up).
inline FmaPeak fma_peak(int threads, std::string const& tier = "") {
  namespace d = yardstick_detail;
  static std::mutex mutex;
  static std::map<std::pair<int, std::string>, FmaPeak> cache;
  std::lock_guard<std::mutex> lock(mutex);
  threads = std::max(1, threads);
  if (auto it = cache.find({threads, tier}); it != cache.end()) return it->second;
  d::FmaKernel const k = d::fma_kernel(tier);
  std::int64_t const iters = std::int64_t(1) << 23;
  int const reps = 6;
  std::vector<float> sink(threads);
  auto wall = d::run_threads(threads, reps, [&](int t, int) { sink[t] += k.run(iters); });
  wall.erase(wall.begin());  // warm-up
  double const flops = double(threads) * double(iters) * d::kChains * k.lanes * 2.0;
  FmaPeak p;
  p.gflops = flops / *std::min_element(wall.begin(), wall.end()) * 1e-9;
  p.threads = threads;
  p.isa = k.isa;
  // Keep the chains' results observable, so the loops cannot be dropped.
  static std::atomic<float> observed{0};
  for (float s : sink) observed.store(observed.load() + s);
  return cache[{threads, tier}] = p;
}

/// Triad bandwidth of `threads` threads.
struct TriadBandwidth {
  double gbs = 0;  ///< best repetition, 1e9 bytes per second
  int threads = 0;
  std::size_t array_bytes = 0;  ///< bytes of each of the three arrays
};

/// Measures (once per thread count, then cached) the STREAM triad a[i] = b[i] + s * c[i] on three
/// float arrays of max(64 MiB, 4 x last-level cache) each. The threads split the index range and
/// each first-touches its own part; best of 10 repetitions. Bytes counted per repetition: 3
/// arrays (2 read + 1 written), the STREAM convention: the write-allocate read of `a` that
/// ordinary stores cause is NOT counted (so the DRAM traffic is up to 4/3 of the figure).
inline TriadBandwidth triad_bandwidth(int threads) {
  namespace d = yardstick_detail;
  static std::mutex mutex;
  static std::map<int, TriadBandwidth> cache;
  std::lock_guard<std::mutex> lock(mutex);
  threads = std::max(1, threads);
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  std::size_t const bytes =
      (std::max(std::size_t(64) << 20, 4 * d::llc_bytes()) + 4095) / 4096 * 4096;
  std::size_t const n = bytes / sizeof(float);
  auto alloc = [&] { return static_cast<float*>(std::aligned_alloc(4096, bytes)); };
  float *a = alloc(), *b = alloc(), *c = alloc();
  auto range = [&](int t) {
    return std::make_pair(n * std::size_t(t) / threads, n * std::size_t(t + 1) / threads);
  };
  d::run_threads(threads, 1, [&](int t, int) {  // first touch by the thread that uses the pages
    auto [lo, hi] = range(t);
    std::fill(a + lo, a + hi, 0.0f);
    std::fill(b + lo, b + hi, 1.0f);
    std::fill(c + lo, c + hi, 2.0f);
  });
  auto const wall = d::run_threads(threads, 10, [&](int t, int) {
    auto [lo, hi] = range(t);
    d::triad(a, b, c, 3.0f, lo, hi);
  });
  static std::atomic<float> observed{0};
  observed.store(observed.load() + a[n / 2] + a[n - 1]);
  std::free(a);
  std::free(b);
  std::free(c);
  TriadBandwidth r;
  r.gbs = 3.0 * double(bytes) / *std::min_element(wall.begin(), wall.end()) * 1e-9;
  r.threads = threads;
  r.array_bytes = bytes;
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

/// GFLOP/s as a fraction of the FMA peak of the GEMM threads (gemm_threads()) at the GEMMs' ISA
/// tier (gemm_tier()): at ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 CPU, the AVX2 peak.
inline double peak_ratio(double gflops) {
  return gflops / fma_peak(gemm_threads(), gemm_tier()).gflops;
}

/// Bytes per second (1e9) as a fraction of the triad bandwidth of the GEMM threads.
inline double bw_ratio(double gbs) { return gbs / triad_bandwidth(gemm_threads()).gbs; }

}  // namespace moe::bench
