#pragma once
/// \file
/// oneDNN on the host (with MOE_HAS_ONEDNN): engine, streams, sgemm, bf16 GEMM and counted
/// primitives (Kernel). oneDNN silently falls back to reference implementations, hundreds of times
/// slower, so moe checks every descriptor before making a primitive.

#include <moe/moe_config.hpp>

#if MOE_HAS_ONEDNN

#include <moe/bf16.hpp>
#include <moe/detail/bf16_dot.hpp>
#include <moe/error.hpp>

#include <oneapi/dnnl/dnnl.hpp>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
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

/// The calling thread's own stream (threads inside a parallel region never share one).
inline dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(engine());
  return s;
}

/// A growing, 64-byte aligned buffer of at least `count` T owned by the calling thread (slot 0 to
/// 3 of each T), valid until it asks for the same slot again.
template <class T = float>
T* thread_buffer(int slot, std::size_t count) {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<T, Free> buffers[4];
  thread_local std::size_t sizes[4] = {0, 0, 0, 0};
  if (sizes[slot] < count) {
    auto* p = static_cast<T*>(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64));
    if (!p) throw std::bad_alloc();  // the old buffer and its size stay valid
    buffers[slot].reset(p);
    sizes[slot] = count;
  }
  return buffers[slot].get();
}

/// Threads a host GEMM call may use: oneDNN's OpenMP thread pool (1 without OpenMP).
inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// Runs body(i) for i in [0, n), one item per OpenMP thread; rethrows the first exception.
template <class Body>
void for_each_item(std::int64_t n, Body&& body) {
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<bool> failed{false};
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && omp_get_max_threads() > 1)
#endif
  for (std::int64_t i = 0; i < n; ++i) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  }
  if (error) std::rethrow_exception(error);
}

/// Whether an impl_info_str names a oneDNN reference implementation ("ref:any", "gemm:ref").
inline bool reference_impl(std::string const& impl) {
  return impl.rfind("ref", 0) == 0 || impl.find(":ref") != std::string::npos;
}

/// Whether an implementation is a direct kernel (brg:avx512_core, ...), not a GEMM-based one
/// ("gemm:jit": copies the weights on every call) or a reference one.
inline bool direct_kernel(std::string const& impl) {
  return impl.rfind("gemm", 0) != 0 && !reference_impl(impl);
}

/// Whether moe runs oneDNN's bf16 kernels (bf16 inputs otherwise take its fp32 kernels) at
/// oneDNN's tier here: use_bf16_kernels (bf16_dot.hpp).
inline bool bf16_kernels() {
  auto const isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  auto has = [isa](dnnl::cpu_isa i) { return (isa & unsigned(i)) == unsigned(i); };
  return use_bf16_kernels(has(dnnl::cpu_isa::avx512_core_bf16),
                          has(dnnl::cpu_isa::avx512_core_amx));
}

/// What the process's oneDNN calls did (read by moe::gmm::onednn_stats()).
struct Counters {
  /// Most descriptions kept of refusals and reference runs.
  static constexpr std::size_t max_described = 16;
  std::atomic<std::uint64_t> primitives{0};      ///< Kernels made (primitives created)
  std::atomic<std::uint64_t> packed_tensors{0};  ///< weight tensors reordered into a packed layout
  std::atomic<std::uint64_t> rejected{0};        ///< shapes / chunk sizes run plain: no kernel
  std::atomic<std::uint64_t> reference_runs{0};  ///< executions of a reference implementation
  std::mutex mutex;                              ///< guards the members below
  /// Executions per implementation name; a Kernel keeps a pointer to its (stable) node.
  std::map<std::string, std::atomic<std::uint64_t>> runs;
  std::vector<std::string> rejected_what;   ///< the latest refused descriptors, described
  std::vector<std::string> reference_what;  ///< the latest reference executions, described

  /// ++count, and `what (impl)` appended to `list` (keeping the latest max_described).
  void note(std::atomic<std::uint64_t>& count, std::vector<std::string>& list,
            std::string const& what, std::string const& impl) {
    ++count;
    std::lock_guard<std::mutex> lock(mutex);
    if (list.size() == max_described) list.erase(list.begin());
    list.push_back(what + " (" + impl + ")");
  }
};

inline Counters& counters() {
  static Counters c;
  return c;
}

/// The execution counter of an implementation name.
inline std::atomic<std::uint64_t>& run_counter(std::string const& impl) {
  auto& c = counters();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.runs.try_emplace(impl, 0).first->second;
}

/// Records a refused descriptor (`what`: operation and shape, `impl`: what oneDNN offered).
inline void note_rejected(std::string const& what, std::string const& impl) {
  auto& c = counters();
  c.note(c.rejected, c.rejected_what, what, impl);
}

/// Sets the thread's OpenMP thread count for a scope (oneDNN sizes a primitive by it).
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) { set(n); }
  ~ScopedThreads() { set(saved_); }
  ScopedThreads(ScopedThreads const&) = delete;
  ScopedThreads& operator=(ScopedThreads const&) = delete;

 private:
  static void set([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
  }
  int const saved_ = max_threads();
};

/// \brief One oneDNN primitive (user scratchpad): runs on any thread, counted by implementation.
class Kernel {
 public:
  /// `what`: the operation and shape ("matmul 256x1024x2816"); runs count as impl + `counted_as`.
  template <class PrimitiveDesc>
  Kernel(PrimitiveDesc const& pd, std::string what, std::string const& counted_as = "")
      : prim_(pd.get()),
        scratch_(pd.scratchpad_desc()),
        impl_(pd.impl_info_str()),
        what_(std::move(what)),
        runs_(&run_counter(impl_ + counted_as)) {
    ++counters().primitives;
  }

  std::string const& impl() const { return impl_; }

  /// Runs on the calling thread's stream, with that thread's scratchpad, and waits.
  void run(std::unordered_map<int, dnnl::memory> args) const {
    if (std::size_t const bytes = scratch_.get_size())
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   dnnl::memory(scratch_, engine(), thread_buffer(1, (bytes + 3) / 4)));
    ++*runs_;
    if (reference_impl(impl_)) {
      auto& c = counters();
      c.note(c.reference_runs, c.reference_what, what_, impl_);
    }
    prim_.execute(thread_stream(), args);
    thread_stream().wait();
  }

 private:
  dnnl::primitive prim_;
  dnnl::memory::desc scratch_;
  std::string impl_, what_;
  std::atomic<std::uint64_t>* runs_;
};

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
  static std::atomic<std::uint64_t>& runs = run_counter("sgemm");
  ++runs;
  dnnl_status_t const st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  moe::detail::require<Error>(st == dnnl_success, "moe: dnnl_sgemm failed with oneDNN status ",
                              static_cast<int>(st));
}

using DataType = dnnl::memory::data_type;

/// Row-major [rows, cols] with row stride ld as a matmul operand.
inline dnnl::memory::desc matrix_desc(std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                      DataType dt = DataType::f32) {
  return dnnl::memory::desc(dnnl::memory::dims{rows, cols}, dt, dnnl::memory::dims{ld, 1});
}

/// The bf16 bits of a value: a float rounded (bf16_bits), a moe::bf16 as it is.
inline std::uint16_t bits_of(float x) { return moe::detail::bf16_bits(x); }
inline std::uint16_t bits_of(moe::bf16 x) { return x.bits; }

#if defined(__SSE2__)
/// The bf16 bits of 8 moe::bf16 values.
inline __m128i bf16_bits8(moe::bf16 const* x) {
  return _mm_loadu_si128(reinterpret_cast<__m128i const*>(x));
}
/// The bf16 bits (round to nearest even, NaN quieted: bf16_bits) of 8 floats, as 8 x 16 bits.
inline __m128i bf16_bits8(float const* x) {
  auto const one = [](__m128i u) {
    __m128i const lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i const rounded =
        _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
    __m128i const quiet = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x0040));
    __m128i const nan =
        _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    // Select, then move 0..0xffff into signed range for the saturating pack.
    __m128i const v = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
    return _mm_sub_epi32(v, _mm_set1_epi32(0x8000));
  };
  __m128i const lo = one(_mm_castps_si128(_mm_loadu_ps(x)));
  __m128i const hi = one(_mm_castps_si128(_mm_loadu_ps(x + 4)));
  return _mm_xor_si128(_mm_packs_epi32(lo, hi), _mm_set1_epi16(short(0x8000)));
}
#endif

/// a[c, r] = bf16(x[r, c]) for r < rows, 0 for rows <= r < kp (c < k): x [rows, k] (row stride
/// ldx) transposed into [k, kp] bf16, with SSE2 in 8 x 8 blocks.
template <class T>
void bf16_transposed(T const* x, std::int64_t ldx, std::int64_t rows, std::int64_t k,
                     std::int64_t kp, std::uint16_t* a) {
  std::int64_t c8 = 0, r8 = 0;  // the blocked part: columns [0, c8), rows [0, r8)
#if defined(__SSE2__)
  c8 = k / 8 * 8, r8 = rows / 8 * 8;
  for (std::int64_t r0 = 0; r0 < r8; r0 += 8)
    for (std::int64_t c0 = 0; c0 < c8; c0 += 8) {
      __m128i v[8], w[8];
      for (int i = 0; i < 8; ++i) v[i] = bf16_bits8(x + (r0 + i) * ldx + c0);
      for (int i = 0; i < 4; ++i) {  // 16-bit pairs, then 32-bit, then 64-bit
        w[2 * i] = _mm_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
        w[2 * i + 1] = _mm_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          v[4 * i + 2 * j] = _mm_unpacklo_epi32(w[4 * i + j], w[4 * i + j + 2]);
          v[4 * i + 2 * j + 1] = _mm_unpackhi_epi32(w[4 * i + j], w[4 * i + j + 2]);
        }
      for (int i = 0; i < 4; ++i) {
        __m128i const lo = _mm_unpacklo_epi64(v[i], v[i + 4]);
        __m128i const hi = _mm_unpackhi_epi64(v[i], v[i + 4]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a + (c0 + 2 * i) * kp + r0), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a + (c0 + 2 * i + 1) * kp + r0), hi);
      }
    }
#endif
  for (std::int64_t c = 0; c < k; ++c)
    for (std::int64_t r = c < c8 ? r8 : 0; r < kp; ++r)
      a[c * kp + r] = r < rows ? bits_of(x[r * ldx + c]) : std::uint16_t(0);
}

/// out[r, c] = bf16(x[r, c]) for r < rows, c < cols, and 0 for the other r < padded, c < ldo
/// (x with row stride ldx; ldo >= cols).
template <class T>
void bf16_rows(T const* x, std::int64_t ldx, std::int64_t rows, std::int64_t cols,
               std::int64_t padded, std::uint16_t* out, std::int64_t ldo) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[r * ldo + c] = bits_of(x[r * ldx + c]);
    std::fill(out + r * ldo + cols, out + (r + 1) * ldo, std::uint16_t(0));
  }
  std::fill(out + rows * ldo, out + padded * ldo, std::uint16_t(0));
}

/// y[j] = float(b[j]) for j < n (exact), with SSE2 by non-temporal stores (half the traffic).
inline void widen_bf16_streaming(std::uint16_t const* b, std::int64_t n, float* y) {
  std::int64_t j = 0;
#if defined(__SSE2__)
  for (; j < n && reinterpret_cast<std::uintptr_t>(y + j) % 16 != 0; ++j)
    y[j] = moe::detail::bf16_to_float(b[j]);
  for (; j + 4 <= n; j += 4) {
    __m128i const h = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(b + j));
    _mm_stream_ps(y + j, _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h)));
  }
  _mm_sfence();  // the streamed stores visible before any later store (e.g. a thread's join)
#endif
  for (; j < n; ++j) y[j] = moe::detail::bf16_to_float(b[j]);
}

/// out [rows, ldo] = bf16 of op(x) in the first cols columns, zeros in the rest, on all threads:
/// x [rows, cols] (row stride ld), or with `trans` [cols, rows].
template <class T>
void bf16_copy(bool trans, std::int64_t rows, std::int64_t cols, T const* x, std::int64_t ld,
               std::uint16_t* out, std::int64_t ldo) {
  constexpr std::int64_t block = 64;
  for_each_item((rows + block - 1) / block, [&](std::int64_t b) {
    std::int64_t const r0 = b * block, r1 = std::min(rows, r0 + block);
    if (trans)
      bf16_transposed(x + r0, ld, cols, r1 - r0, ldo, out + r0 * ldo);
    else
      bf16_rows(x + r0 * ld, ld, r1 - r0, cols, r1 - r0, out + r0 * ldo, ldo);
  });
}

/// User scratchpad (Kernel passes each thread's own) and, to accumulate, a sum post-op.
inline dnnl::primitive_attr kernel_attr(bool accumulate) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  return attr;
}

/// The matmul primitive descriptor of dst = src * wei under `attr` (oneDNN 2.x and 3.x).
inline dnnl::matmul::primitive_desc matmul_pd(dnnl::memory::desc const& src,
                                              dnnl::memory::desc const& wei,
                                              dnnl::memory::desc const& dst,
                                              dnnl::primitive_attr const& attr) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul::primitive_desc(engine(), src, wei, dst, attr);
#else
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, wei, dst), attr, engine());
#endif
}

/// bf16 weights [K, N]: dense, or (`blocked`) in the layout oneDNN's bf16 matmul kernels read.
inline dnnl::memory::desc bf16_weights_desc(std::int64_t K, std::int64_t N, bool blocked) {
  if (!blocked) return matrix_desc(K, N, N, DataType::bf16);
  return dnnl::memory::desc(dnnl::memory::dims{K, N}, DataType::bf16,
                            dnnl::memory::format_tag::BA16a64b2a);
}

/// out = x [rows, cols] (row stride ldx) as bf16 in the blocked [kp, np] layout (32 x 64 blocks,
/// column blocks outermost, rows paired; zeros past rows and cols), on all threads.
template <class T>
void bf16_blocked(T const* x, std::int64_t ldx, std::int64_t rows, std::int64_t cols,
                  std::int64_t kp, std::int64_t np, std::uint16_t* out) {
  std::int64_t const kblocks = kp / 32, nblocks = np / 64;
  for_each_item(kblocks * nblocks, [&](std::int64_t i) {
    std::int64_t const nb = i / kblocks, kb = i % kblocks;
    std::uint16_t* const block = out + (nb * kblocks + kb) * 32 * 64;
    for (std::int64_t p = 0; p < 16; ++p) {
      std::int64_t const r = kb * 32 + 2 * p, c0 = nb * 64;
      T const* x0 = r < rows ? x + r * ldx : nullptr;
      T const* x1 = r + 1 < rows ? x + (r + 1) * ldx : nullptr;
      std::uint16_t* const o = block + p * 128;
      std::int64_t j = 0;
#if defined(__SSE2__)
      if (x0 && x1)
        for (; j + 8 <= 64 && c0 + j + 8 <= cols; j += 8) {
          __m128i const v0 = bf16_bits8(x0 + c0 + j), v1 = bf16_bits8(x1 + c0 + j);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * j), _mm_unpacklo_epi16(v0, v1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 2 * j + 8), _mm_unpackhi_epi16(v0, v1));
        }
#endif
      for (; j < 64; ++j) {
        bool const in = c0 + j < cols;
        o[2 * j] = x0 && in ? bits_of(x0[c0 + j]) : std::uint16_t(0);
        o[2 * j + 1] = x1 && in ? bits_of(x1[c0 + j]) : std::uint16_t(0);
      }
    }
  });
}

/// \brief Row-major C[M,N] = op(A) * op(B) (+ C with `accumulate`) on oneDNN's bf16 kernels on
/// all threads: operands (float or moe::bf16) copied to bf16, fp32 accumulation, C float or
/// moe::bf16 (rounded by the kernel), the contraction padded to `pad_k` > K. Returns false,
/// having done nothing, without a bf16 non-reference kernel or for a bf16 C with `accumulate`.
template <class TA, class TB, class TC>
bool bf16_gemm(char ta, char tb, std::int64_t M, std::int64_t N, std::int64_t K, TA const* A,
               std::int64_t lda, TB const* B, std::int64_t ldb, bool accumulate, TC* C,
               std::int64_t ldc, std::int64_t pad_k = 0) {
  constexpr bool c16 = std::is_same<TC, moe::bf16>::value;
  if (M == 0 || N == 0 || K == 0 || (c16 && accumulate) || !bf16_kernels()) return false;
  std::int64_t const Kp = std::max(K, pad_k);
  bool blocked = tb == 'N' && Kp % 32 == 0;
  auto const c_desc = matrix_desc(M, N, ldc, c16 ? DataType::bf16 : DataType::f32);
  using Key =
      std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, int, bool, bool>;
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<Kernel>> kernels;
  // The kernel with B dense or (`b`) blocked, made once; nullptr where oneDNN has only a
  // reference one (a refusal unless blocked: B is then copied plain).
  auto kernel_for = [&](bool b) {
    std::lock_guard<std::mutex> lock(mutex);
    auto [it, fresh] = kernels.try_emplace(Key{M, N, Kp, ldc, accumulate, max_threads(), b, c16});
    if (!fresh) return it->second.get();
    std::string const what = "gemm " + std::to_string(M) + "x" + std::to_string(Kp) + "x" +
                             std::to_string(N) + (accumulate ? " +=" : "") +
                             (c16 ? " bf16 out" : " bf16");
    try {
      auto const pd = matmul_pd(matrix_desc(M, Kp, Kp, DataType::bf16), bf16_weights_desc(Kp, N, b),
                                c_desc, kernel_attr(accumulate));
      if (!reference_impl(pd.impl_info_str()))
        it->second = std::make_unique<Kernel>(pd, what, " bf16");
      else if (!b)
        note_rejected(what, pd.impl_info_str());
    } catch (dnnl::error const& e) {
      if (!b) note_rejected(what, std::string("no implementation: ") + e.what());
    }
    return it->second.get();
  };
  Kernel const* kernel = blocked ? kernel_for(true) : nullptr;
  if (!kernel) blocked = false, kernel = kernel_for(false);
  if (!kernel) return false;
  std::int64_t const Np = blocked ? (N + 63) / 64 * 64 : N;
  auto* const a = thread_buffer<std::uint16_t>(0, std::size_t(M * Kp));
  auto* const b = thread_buffer<std::uint16_t>(1, std::size_t(Kp * Np));
  bf16_copy(ta == 'T', M, K, A, lda, a, Kp);
  if (blocked) {
    bf16_blocked(B, ldb, K, N, Kp, Np, b);
  } else {
    bf16_copy(tb == 'T', K, N, B, ldb, b, N);
    std::fill(b + K * N, b + Kp * N, std::uint16_t(0));
  }
  kernel->run({{DNNL_ARG_SRC, dnnl::memory(matrix_desc(M, Kp, Kp, DataType::bf16), engine(), a)},
               {DNNL_ARG_WEIGHTS, dnnl::memory(bf16_weights_desc(Kp, N, blocked), engine(), b)},
               {DNNL_ARG_DST, dnnl::memory(c_desc, engine(), C)}});
  return true;
}

/// Name of the instruction set oneDNN dispatches to on this CPU (e.g. "avx2", "avx512_core").
inline std::string isa_name() {
  using isa = dnnl::cpu_isa;
  static std::pair<isa, char const*> const names[] = {{isa::sse41, "sse41"},
                                                      {isa::avx, "avx"},
                                                      {isa::avx2, "avx2"},
                                                      {isa::avx2_vnni, "avx2_vnni"},
                                                      {isa::avx512_core, "avx512_core"},
                                                      {isa::avx512_core_vnni, "avx512_core_vnni"},
                                                      {isa::avx512_core_bf16, "avx512_core_bf16"},
                                                      {isa::avx512_core_amx, "avx512_core_amx"}};
  isa const mine = dnnl::get_effective_cpu_isa();
  for (auto const& [i, name] : names)
    if (i == mine) return name;
  return "isa#" + std::to_string(static_cast<int>(mine));
}

/// "oneDNN 2.6.3 avx2".
inline std::string describe() {
  auto const* v = dnnl::version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch) + " " + isa_name();
}

}  // namespace moe::detail::onednn

#endif  // MOE_HAS_ONEDNN
