#pragma once
/// \file
/// Whether bf16 kernels without AMX pay on this CPU: the AVX512-BF16 dot product (VDPBF16PS) is
/// twice fp32 FMA's rate on some CPUs and half of it on others (one zmm every other cycle on an
/// AMX Xeon capped to that tier), so it is measured once per process, and MOE_BF16_KERNELS
/// (auto | on | off) overrides the choice.

#include <moe/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace moe::detail {

/// FLOP/s of one thread running `iters` x 12 independent zmm VDPBF16PS (`bf16`, 64 FLOP each)
/// or VFMADD231PS (32 FLOP each); 0 where this compiler or target cannot emit them. Executes
/// the instruction: call only on a CPU that has it.
inline double zmm_loop_flops(bool bf16, long iters = 100000) {
#if defined(__x86_64__) && defined(__GNUC__)
  auto const t0 = std::chrono::steady_clock::now();
  long n = iters;
#define MOE_ZMM12(op)                                                      \
  op " %%zmm12, %%zmm13, %%zmm0\n\t" op " %%zmm12, %%zmm13, %%zmm1\n\t" op \
     " %%zmm12, %%zmm13, %%zmm2\n\t" op " %%zmm12, %%zmm13, %%zmm3\n\t" op \
     " %%zmm12, %%zmm13, %%zmm4\n\t" op " %%zmm12, %%zmm13, %%zmm5\n\t" op \
     " %%zmm12, %%zmm13, %%zmm6\n\t" op " %%zmm12, %%zmm13, %%zmm7\n\t" op \
     " %%zmm12, %%zmm13, %%zmm8\n\t" op " %%zmm12, %%zmm13, %%zmm9\n\t" op \
     " %%zmm12, %%zmm13, %%zmm10\n\t" op " %%zmm12, %%zmm13, %%zmm11\n\t"
#define MOE_ZMM_LOOP(op)                                                                         \
  __asm__ volatile(                                                                              \
      "vpxord %%zmm12, %%zmm12, %%zmm12\n\tvpxord %%zmm13, %%zmm13, %%zmm13\n\t"                 \
      "1:\n\t" MOE_ZMM12(op) "dec %0\n\tjnz 1b\n\tvzeroupper"                                    \
      : "+r"(n)                                                                                  \
      :                                                                                          \
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
        "xmm11", "xmm12", "xmm13", "cc")
  if (bf16)
    MOE_ZMM_LOOP("vdpbf16ps");
  else
    MOE_ZMM_LOOP("vfmadd231ps");
#undef MOE_ZMM_LOOP
#undef MOE_ZMM12
  double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s > 0 ? double(iters) * 12 * (bf16 ? 64 : 32) / s : 0;
#else
  (void)bf16;
  (void)iters;
  return 0;
#endif
}

/// The rule: bf16 kernels pay where the dot product runs at least 0.9 of FMA's FLOP rate (at
/// equal compute they still read half the bytes); unknown rates (0) count as paying.
inline bool bf16_dot_pays(double dot_flops, double fma_flops) {
  return dot_flops <= 0 || fma_flops <= 0 || dot_flops >= 0.9 * fma_flops;
}

/// The best of three alternating runs of each loop (about 3 ms once per process), and the rule.
/// Call only on a CPU with AVX512-BF16.
inline bool bf16_dot_pays_here() {
  static bool const pays = [] {
    double dot = 0, fma = 0;
    for (int i = 0; i < 3; ++i) {
      fma = std::max(fma, zmm_loop_flops(false));
      dot = std::max(dot, zmm_loop_flops(true));
    }
    return bf16_dot_pays(dot, fma);
  }();
  return pays;
}

/// MOE_BF16_KERNELS: "auto" (or unset) measures, "on" runs bf16 kernels wherever oneDNN has them,
/// "off" never (fp32 kernels on the bf16 values). Another value is a moe::ConfigError.
enum class Bf16Kernels { automatic, on, off };
inline Bf16Kernels bf16_kernels_setting() {
  char const* v = std::getenv("MOE_BF16_KERNELS");  // read per call (no allocation): tests set it
  if (!v || std::strcmp(v, "auto") == 0) return Bf16Kernels::automatic;
  if (std::strcmp(v, "on") == 0) return Bf16Kernels::on;
  if (std::strcmp(v, "off") == 0) return Bf16Kernels::off;
  throw ConfigError(std::string("MOE_BF16_KERNELS=") + v + " is not one of auto, on, off");
}

/// Whether bf16 inputs run bf16 kernels, given what the GEMM library's tier has (AVX512-BF16,
/// AMX): never without bf16 instructions; else as MOE_BF16_KERNELS says, "auto" taking them
/// with AMX, and without it where bf16_dot_pays_here().
inline bool use_bf16_kernels(bool bf16_instructions, bool amx) {
  if (!bf16_instructions) return false;
  switch (bf16_kernels_setting()) {
    case Bf16Kernels::on:
      return true;
    case Bf16Kernels::off:
      return false;
    default:
      return amx || bf16_dot_pays_here();
  }
}

}  // namespace moe::detail
