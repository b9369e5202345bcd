#pragma once
/// \file
/// amx_bf16_peak(threads): the bf16 matrix peak of a CPU with AMX, the yardstick of moe_bench's
/// bf16 rows on such a CPU. Each thread runs independent TDPBF16PS tile multiplies (four
/// accumulator tiles of 16 x 16 floats, each a 16 x 32 bf16 by 32 x 16 bf16 product per
/// instruction: 16,384 flops) on tiles held in registers, so nothing but the AMX unit limits it.
/// 0 on CPUs without AMX-BF16, where the kernel may not grant the tile state, and in builds whose
/// compiler cannot emit AMX (device compilers, GCC < 11).

#include "yardsticks.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    !defined(__CUDACC__) && !defined(__HIPCC__) && defined(__linux__)
#define MOE_BENCH_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define MOE_BENCH_AMX 0
#endif

namespace moe::bench {
namespace detail {

#if MOE_BENCH_AMX
/// Whether CPUID reports AMX-TILE and AMX-BF16 and Linux grants this process the tile data state
/// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as oneDNN asks too).
inline bool amx_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  bool const bf16 = (d >> 22) & 1u, tile = (d >> 24) & 1u;
  if (!bf16 || !tile) return false;
  constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
  return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
}

/// The tile configuration of the burst: palette 1, tiles 0-7 of 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};

/// `iters` x 4 tile multiplies into four independent accumulators; returns a value of the result
/// (kept observable). Flops: iters x 4 x 16,384.
__attribute__((target("amx-tile,amx-bf16"))) inline float amx_burst(std::int64_t iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.bytes_per_row[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
  alignas(64) std::uint16_t ones[16 * 32];
  for (auto& v : ones) v = 0x3f80;  // bf16 1.0
  alignas(64) float out[16 * 16];
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (std::int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

}  // namespace detail

/// GFLOP/s of `threads` threads each running amx_burst (run_threads: the GEMMs' OpenMP threads),
/// best of 5 repetitions of 2^16 iterations (about 4 GFLOP per thread) after a warm-up; 0 where
/// AMX-BF16 is not usable.
inline double amx_bf16_peak(int threads) {
#if MOE_BENCH_AMX
  if (threads < 1 || !detail::amx_usable()) return 0.0;
  constexpr std::int64_t iters = std::int64_t(1) << 16;
  std::vector<float> sink(static_cast<std::size_t>(threads));
  std::vector<double> wall = detail::run_threads(threads, 6, [&](int t, int) {
    detail::amx_usable();  // the permission is the process's; asking again is harmless
    sink[std::size_t(t)] += detail::amx_burst(iters);
  });
  static std::atomic<float> observed{0};
  for (float v : sink) observed.store(observed.load() + v);
  double const best = *std::min_element(wall.begin() + 1, wall.end());
  return double(threads) * double(iters) * 4.0 * 16384.0 / best * 1e-9;
#else
  (void)threads;
  return 0.0;
#endif
}

}  // namespace moe::bench
