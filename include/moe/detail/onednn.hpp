#pragma once
/// \file
/// oneDNN on the host: the CPU engine and stream of the process, dense float GEMM through
/// oneDNN's sgemm (JIT kernels chosen from the CPUID feature bits), and what oneDNN runs on this
/// CPU. Compiled only when moe was configured with oneDNN (MOE_HAS_ONEDNN).

#include <moe/moe_config.hpp>

#if MOE_HAS_ONEDNN

#include <moe/error.hpp>

#include <oneapi/dnnl/dnnl.hpp>

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace moe::detail::onednn {

/// The process's oneDNN CPU engine.
inline dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

/// The process's in-order CPU stream (host primitives run synchronously on the calling thread).
inline dnnl::stream& stream() {
  static dnnl::stream s(engine());
  return s;
}

/// The calling thread's own stream (a thread running primitives inside a parallel region uses
/// its own stream, never another thread's).
inline dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(engine());
  return s;
}

/// A buffer of at least `count` floats owned by the calling thread (slot 0 or 1: two buffers
/// per thread); it only grows, so a steady-state step allocates nothing. Valid until the same
/// thread asks for the same slot again.
inline float* thread_buffer(int slot, std::size_t count) {
  thread_local std::vector<float> buffers[2];
  auto& b = buffers[slot];
  if (b.size() < count) b.resize(count);
  return b.data();
}

/// Threads a host GEMM call may use: oneDNN's OpenMP thread pool (1 without OpenMP).
inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// Runs body(i) for every i in [0, n), each call on one OpenMP thread, in dynamic order (item
/// i+1 may start before item i ends). oneDNN calls made inside run single-threaded (oneDNN runs
/// sequentially inside a parallel region), so the items of independent experts run side by
/// side instead of every call splitting one expert over all threads. Items must write disjoint
/// memory. An exception thrown by an item is rethrown here after the loop (items not yet
/// started are skipped).
template <class Body>
void for_each_item(std::int64_t n, Body&& body) {
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> failed{false};
  auto guarded = [&](std::int64_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && omp_get_max_threads() > 1)
#endif
  for (std::int64_t i = 0; i < n; ++i) guarded(i);
  if (error) std::rethrow_exception(error);
}

/// Throws moe::Error naming the call when a oneDNN C call fails.
inline void check(dnnl_status_t st, char const* what) {
  moe::detail::require<Error>(st == dnnl_success, what, " failed with oneDNN status ",
                              static_cast<int>(st));
}

/// Row-major C[M,N] = alpha * op(A) * op(B) + beta * C with op "N" or "T" per operand.
inline void sgemm(char ta, char tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  float const* A, std::int64_t lda, float const* B, std::int64_t ldb, float beta,
                  float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // C = beta * C (the BLAS meaning of an empty contraction)
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j)
        C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  check(dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), "moe: dnnl_sgemm");
}

/// Name of the instruction set oneDNN dispatches to on this CPU (e.g. "avx2", "avx512_core").
inline std::string isa_name() {
  switch (static_cast<int>(dnnl::get_effective_cpu_isa())) {
    case static_cast<int>(dnnl::cpu_isa::sse41):
      return "sse41";
    case static_cast<int>(dnnl::cpu_isa::avx):
      return "avx";
    case static_cast<int>(dnnl::cpu_isa::avx2):
      return "avx2";
    case static_cast<int>(dnnl::cpu_isa::avx2_vnni):
      return "avx2_vnni";
    case static_cast<int>(dnnl::cpu_isa::avx512_core):
      return "avx512_core";
    case static_cast<int>(dnnl::cpu_isa::avx512_core_vnni):
      return "avx512_core_vnni";
    case static_cast<int>(dnnl::cpu_isa::avx512_core_bf16):
      return "avx512_core_bf16";
    case static_cast<int>(dnnl::cpu_isa::avx512_core_amx):
      return "avx512_core_amx";
    default:
      return "isa#" + std::to_string(static_cast<int>(dnnl::get_effective_cpu_isa()));
  }
}

/// "oneDNN 2.6.3 avx2".
inline std::string describe() {
  auto const* v = dnnl::version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch) + " " + isa_name();
}

}  // namespace moe::detail::onednn

#endif  // MOE_HAS_ONEDNN
