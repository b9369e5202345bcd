// Main of moe_bench (one process, no MPI): Kokkos, then Google Benchmark, with the run's context
// recorded in the output: Kokkos version and backend, git hash, the vector ISA moe's own loops were
// compiled for (compiled_isa), BLAS threads, config and core type, the CPU model and its native
// oneDNN ISA tier, oneDNN's version and the tier it runs, the dense yardstick's GEMM, and the
// machine yardsticks measured here before any benchmark runs (fma_peak at the tier,
// triad_bandwidth: the denominators of peak_ratio and bw_ratio). A "warning_blas_core" entry
// appears when OpenBLAS runs kernels for an older ISA than CPUID reports.
//
//   moe_bench [--isa=native|sse41|avx|avx2|avx512_core|avx512_core_vnni|avx512_core_bf16|
//              avx512_core_amx] [Google Benchmark flags]
//
// --isa caps oneDNN (as ONEDNN_MAX_CPU_ISA does) for the whole process, appends "/isa=<tier>" to
// every benchmark name, and measures the FMA peak at that tier; a tier above the CPU's is refused.
// oneDNN fixes its tier once per process, so tiers are compared by running moe_bench once per
// tier (scripts/bench.sh --isa-tiers). After the run, the kernels oneDNN ran go to stderr, with a
// warning naming the shape if a reference implementation ever ran (the OneDnn rows also count
// them: ref_runs).
#include <moe/moe_config.hpp>

#include <benchmark/benchmark.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "amx_peak.hpp"
#include "bench_common.hpp"
#include "yardsticks.hpp"

#include <moe/gmm/gmm.hpp>
#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

// OpenBLAS entry points, resolved only when the BLAS in use is OpenBLAS.
extern "C" int openblas_get_num_threads(void) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));
extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace {

std::string env_or(char const* name, char const* fallback) {
  char const* v = std::getenv(name);
  return v ? v : fallback;
}

/// Vector ISA levels, oldest first.
enum IsaLevel { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3, kUnknown = -1 };
char const* const kIsaNames[] = {"sse", "avx", "avx2", "avx512f"};

/// The widest level CPUID (and the OS) reports.
IsaLevel cpu_isa_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  if (__builtin_cpu_supports("avx")) return kAvx;
  return kSse;
#else
  return kUnknown;
#endif
}

/// The ISA level of an OpenBLAS x86 core type (openblas_get_corename()); kUnknown for other
/// names (other architectures, cores this table does not know).
IsaLevel blas_core_level(std::string core) {
  std::transform(core.begin(), core.end(), core.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  for (char const* n : {"skylakex", "cooperlake", "sapphirerapids"})
    if (core == n) return kAvx512;
  for (char const* n : {"haswell", "zen", "excavator"})
    if (core == n) return kAvx2;
  for (char const* n : {"sandybridge", "bulldozer", "piledriver", "steamroller"})
    if (core == n) return kAvx;
  for (char const* n :
       {"katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
        "nehalem", "atom", "athlon", "opteron", "opteron_sse3", "barcelona", "bobcat", "nano"})
    if (core == n) return kSse;
  return kUnknown;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

#if MOE_HAS_ONEDNN
char const* const kBlasUsers =
    ": host float GEMMs run on oneDNN, any GEMM left on this BLAS (e.g. double) is slowed";
#else
char const* const kBlasUsers = ": the Vendor rows and the dense yardstick run on it, slowed";
#endif

/// The CPU's model name (/proc/cpuinfo), "unknown" elsewhere.
std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      auto const colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown";
}

/// The widest oneDNN ISA tier the CPU has (its /proc/cpuinfo flags), whatever the process caps
/// oneDNN to: "avx512_core_amx", ..., "sse41"; "unknown" elsewhere.
std::string native_tier() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      std::set<std::string> flags;
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) flags.insert(w);
      auto has = [&](std::initializer_list<char const*> names) {
        for (char const* n : names)
          if (!flags.count(n)) return false;
        return true;
      };
      bool const core = has({"avx512f", "avx512bw", "avx512vl", "avx512dq"});
      if (core && has({"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}))
        return "avx512_core_amx";
      if (core && has({"avx512_bf16", "avx512_vnni"})) return "avx512_core_bf16";
      if (core && has({"avx512_vnni"})) return "avx512_core_vnni";
      if (core) return "avx512_core";
      if (has({"avx2", "fma"})) return "avx2";
      if (has({"avx"})) return "avx";
      if (has({"sse4_1"})) return "sse41";
      return "below sse41";
    }
  return "unknown";
}

/// Machine yardsticks and GEMM backends (measures the FMA peak and the triad bandwidth).
void add_machine_context() {
  int const threads = moe::bench::gemm_threads();
  benchmark::AddCustomContext("gemm_threads", std::to_string(threads));
#if MOE_HAS_ONEDNN
  benchmark::AddCustomContext("onednn", moe::detail::onednn::describe());
  benchmark::AddCustomContext(
      "isa", moe::bench::isa_tag().empty() ? "native (not capped)" : moe::bench::isa_tag());
#else
  benchmark::AddCustomContext("onednn", "not built (MOE_HAS_ONEDNN=0)");
#endif
  benchmark::AddCustomContext("dense_yardstick", moe::bench::DenseYardstick::candidates());
  benchmark::AddCustomContext("cpu", cpu_model() + ", native oneDNN tier " + native_tier());
  auto const peak = moe::bench::fma_peak(threads, moe::bench::gemm_tier());
  benchmark::AddCustomContext("fma_peak", fixed(peak.gflops, 1) + " GFLOP/s, " +
                                              std::to_string(peak.threads) + " threads, " +
                                              peak.isa);
  if (double const amx = moe::bench::amx_bf16_peak(threads); amx > 0)
    benchmark::AddCustomContext("amx_bf16_peak", fixed(amx, 1) + " GFLOP/s, " +
                                                     std::to_string(threads) +
                                                     " threads, TDPBF16PS tile multiplies");
  auto const triad = moe::bench::triad_bandwidth(threads);
  benchmark::AddCustomContext(
      "triad_bandwidth", fixed(triad.gbs, 1) + " GB/s, " + std::to_string(triad.threads) +
                             " threads, 3 x " + std::to_string(triad.array_bytes >> 20) + " MiB");
  if (!openblas_get_corename) {
    benchmark::AddCustomContext("blas_core", "OpenBLAS not loaded in this process");
  } else {
    std::string const core = openblas_get_corename();
    benchmark::AddCustomContext("blas_core", core);
    IsaLevel const cpu = cpu_isa_level(), blas = blas_core_level(core);
    if (cpu != kUnknown && blas != kUnknown && blas < cpu)
      benchmark::AddCustomContext("warning_blas_core",
                                  "OpenBLAS runs " + core + " kernels (" + kIsaNames[blas] +
                                      ") but the CPU reports " + kIsaNames[cpu] + kBlasUsers);
  }
}

void add_context() {
  benchmark::AddCustomContext("kokkos_version", std::to_string(KOKKOS_VERSION));
  benchmark::AddCustomContext("kokkos_execution_space", Kokkos::DefaultExecutionSpace::name());
  benchmark::AddCustomContext("kokkos_concurrency",
                              std::to_string(Kokkos::DefaultExecutionSpace().concurrency()));
  benchmark::AddCustomContext("moe_version", std::to_string(MOE_VERSION));
  // The vector ISA moe's own loops (routing, sort, gathers, activation, combine) were compiled
  // for: -march decides it, not the CPU the benchmark runs on (oneDNN picks its own at run time).
  benchmark::AddCustomContext("compiled_isa",
#if defined(__AVX512F__)
                              "avx512f"
#elif defined(__AVX2__)
                              "avx2"
#elif defined(__AVX__)
                              "avx"
#else
                              "sse2 or below"
#endif
  );
#ifdef MOE_GIT_HASH
  benchmark::AddCustomContext("moe_git_hash", MOE_GIT_HASH);
#endif
  benchmark::AddCustomContext("OPENBLAS_NUM_THREADS", env_or("OPENBLAS_NUM_THREADS", "unset"));
  if (openblas_get_num_threads)
    benchmark::AddCustomContext("blas_threads", std::to_string(openblas_get_num_threads()));
  if (openblas_get_config) benchmark::AddCustomContext("blas_config", openblas_get_config());
  add_machine_context();
#if defined(MOE_QUICK_BUILD)
  benchmark::AddCustomContext("warning_build", moe::bench::kQuickBuildWarning);
#endif
}

}  // namespace

/// Takes --isa=TIER out of argv and caps oneDNN to it; false (with a message) for an unknown tier
/// or one above the CPU's.
bool apply_isa_argument(int& argc, char** argv) {
  std::string tier;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a.rfind("--isa=", 0) == 0)
      tier = a.substr(6);
    else
      argv[out++] = argv[i];
  }
  argc = out;
  if (tier.empty()) return true;
#if MOE_HAS_ONEDNN
  static std::map<std::string, dnnl::cpu_isa> const tiers{
      {"native", dnnl::cpu_isa::all},
      {"sse41", dnnl::cpu_isa::sse41},
      {"avx", dnnl::cpu_isa::avx},
      {"avx2", dnnl::cpu_isa::avx2},
      {"avx512_core", dnnl::cpu_isa::avx512_core},
      {"avx512_core_vnni", dnnl::cpu_isa::avx512_core_vnni},
      {"avx512_core_bf16", dnnl::cpu_isa::avx512_core_bf16},
      {"avx512_core_amx", dnnl::cpu_isa::avx512_core_amx}};
  auto const it = tiers.find(tier);
  if (it == tiers.end()) {
    std::fprintf(stderr,
                 "moe_bench: --isa=%s is not one of native, sse41, avx, avx2, avx512_core, "
                 "avx512_core_vnni, avx512_core_bf16, avx512_core_amx\n",
                 tier.c_str());
    return false;
  }
  if (dnnl::set_max_cpu_isa(it->second) != dnnl::status::success) {
    std::fprintf(stderr, "moe_bench: oneDNN refused --isa=%s (set before any oneDNN call)\n",
                 tier.c_str());
    return false;
  }
  std::string const runs = moe::detail::onednn::isa_name();
  if (tier != "native" && runs != tier) {
    std::fprintf(stderr, "moe_bench: --isa=%s is above this CPU (%s), whose oneDNN runs %s\n",
                 tier.c_str(), cpu_model().c_str(), runs.c_str());
    return false;
  }
  moe::bench::isa_tag() = tier;
  return true;
#else
  std::fprintf(stderr, "moe_bench: --isa=%s needs moe built with oneDNN\n", tier.c_str());
  return false;
#endif
}

int main(int argc, char** argv) {
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    benchmark::Initialize(&argc, argv);
    if (!apply_isa_argument(argc, argv) || benchmark::ReportUnrecognizedArguments(argc, argv)) {
      rc = 1;
    } else {
      moe::bench::register_gmm_benchmarks();
      moe::bench::register_layer_benchmarks();
      add_context();
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
      auto const kernels = moe::gmm::onednn_stats();
      std::fprintf(stderr, "moe_bench: oneDNN kernels: %s\n", kernels.summary().c_str());
      if (kernels.reference_runs > 0)
        std::fprintf(stderr, "moe_bench: %s\n", kernels.warning().c_str());
    }
  }
  return rc;
}
