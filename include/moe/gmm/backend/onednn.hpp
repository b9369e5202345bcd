#pragma once
/// \file
/// gmm::OneDnn: grouped GEMM on the host through oneDNN, whose kernels are chosen from the CPU's
/// feature bits (so a CPU newer than the BLAS still gets its widest vector ISA).
///
/// An expert projection x[rows, k] * W[k, n] runs on a oneDNN primitive whose weights were
/// reordered ("packed") once into a blocked layout of the kernel's own, so the per-call packing
/// of a BLAS sgemm (a full read and write of each expert's weights on every call) is gone. For
/// each weight shape (k, n, as is or transposed, row strides) the backend asks oneDNN once which
/// kernel it would run (KernelPlan), trying two primitive families in turn:
///  * matmul: oneDNN's brgemm matmul (AVX-512 and newer: "brg:avx512_core") over one fixed
///    blocked weight layout (48-column blocks: KernelPlan::packed_layouts), which it accepts for
///    every row count and thread count, so one packed copy serves every chunk size;
///  * a 1x1 convolution over `rows` pixels with k input and n output channels (jit_1x1 on SSE4.1,
///    AVX and AVX2, where matmul has only its GEMM-based implementation).
/// The first family with a direct kernel (detail::onednn::direct_kernel) wins; its layout is
/// fixed, and the primitive of every chunk size is checked again when it is made: a chunk size
/// oneDNN has no direct kernel for with that layout runs as sgemm on the weights in place, never
/// on a reference implementation. (A 1x1 convolution's preferred layout on AVX-512 depends on
/// the rows and the threads, so a layout probed at one chunk size fell back to oneDNN's
/// reference convolution at others, 300-550x slower; the matmul family has no such dependence,
/// and measured as fast as the convolution with its own best layout at 16-256 rows.)
///  * Packed mode (a direct kernel, and a PackCache to keep the packed copy in; without one
///    nothing could reuse it, so the call runs plain): every expert's weights are reordered once
///    per weight version into the caller's PackCache; each group runs as row chunks (chunk_rows:
///    256, then the rest rounded up to a multiple of 16 where the rows exist, exact below 16) on
///    primitives made once per chunk size, accumulation through a sum post-op: a steady-state
///    step creates no primitive and packs nothing.
///  * Plain mode (no direct kernel for this CPU or these strides): the weights used in place, one
///    oneDNN sgemm per group, and a streaming kernel (few_rows) for groups of 2-3 rows.
/// tgmm (weight gradients: two activations, nothing to pack) is one oneDNN sgemm per group, or
/// per column block of a large group.
/// Packed-mode chunks and tgmm calls run side by side on the OpenMP threads, one call per thread
/// (oneDNN runs single-threaded inside a parallel region; its primitives are made for one
/// thread): measured on 2 Zen 3 cores this beats splitting every call over both threads by
/// 15-25 % at 32-128 rows per expert and 2-5 % at 256 and more, and by 6-13 % for tgmm. Results
/// do not depend on which thread runs a call.
/// What ran is counted: moe::gmm::onednn_stats() (primitives made, tensors packed, descriptors
/// refused, executions per implementation, reference executions).
/// Float only: oneDNN has no double GEMM on CPUs, so OneDnn with double runs as Vendor.

#include <moe/detail/hash.hpp>
#include <moe/detail/onednn.hpp>
#include <moe/gmm/backend/common.hpp>
#include <moe/gmm/backend/vendor.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moe::gmm {

/// \brief Policy: oneDNN on host execution spaces (float), with weights reordered once into
/// oneDNN's preferred layout where it has one. Auto's choice on the host when moe was configured
/// with oneDNN. Runs as Vendor on device spaces, for double, and without oneDNN.
struct OneDnn {};

template <>
struct is_policy<OneDnn> : std::true_type {};

template <class ExecSpace, class Scalar>
struct is_available<OneDnn, ExecSpace, Scalar>
    : std::integral_constant<bool, MOE_HAS_ONEDNN && std::is_same<Scalar, float>::value &&
                                       moe::detail::runs_on_host<ExecSpace>()> {};

/// \brief What the process's oneDNN GEMMs did since it started (every thread, every layer).
struct OneDnnStats {
  std::string isa;                   ///< oneDNN's instruction set ("avx2", "avx512_core", ...)
  std::uint64_t primitives = 0;      ///< oneDNN primitives made (each once, then reused)
  std::uint64_t packed_tensors = 0;  ///< weight tensors reordered into a packed layout
  /// Weight shapes (no family had a direct kernel) and chunk sizes (no direct kernel for the
  /// packed layout at that size) that ran plain, as sgemm on the weights in place
  std::uint64_t rejected = 0;
  std::uint64_t reference_runs = 0;  ///< executions of a oneDNN reference implementation: 0
  /// Executions per implementation: oneDNN's names ("brg:avx512_core", "jit_1x1:avx2") for
  /// primitives, "sgemm" for oneDNN's sgemm, "few_rows" for moe's streaming kernel.
  std::map<std::string, std::uint64_t> runs;
  std::vector<std::string> rejected_what;   ///< the latest refused descriptors (shape, impl)
  std::vector<std::string> reference_what;  ///< the latest reference executions (shape, impl)

  /// "avx512_core: brg:avx512_core 1200, sgemm 300; 9 primitives, 12 tensors packed, 0
  /// refused, 0 reference runs".
  std::string summary() const {
    std::string s = isa + ":";
    bool first = true;
    for (auto const& [impl, n] : runs) {
      if (n == 0) continue;
      s += (first ? " " : ", ") + impl + " " + std::to_string(n);
      first = false;
    }
    if (first) s += " no calls";
    s += "; " + std::to_string(primitives) + " primitives, " + std::to_string(packed_tensors) +
         " tensors packed, " + std::to_string(rejected) + " refused, " +
         std::to_string(reference_runs) + " reference runs";
    return s;
  }
  /// "" when no reference implementation ran; else one line naming what ran and its shape.
  std::string warning() const {
    if (reference_runs == 0) return "";
    std::string s = "warning: oneDNN ran its reference implementation " +
                    std::to_string(reference_runs) + " times (hundreds of times slower):";
    for (auto const& w : reference_what) s += " " + w + ";";
    return s;
  }
};

/// \brief The counters of the process's oneDNN GEMMs (all zero, isa "none", without oneDNN).
inline OneDnnStats onednn_stats() {
  OneDnnStats st;
#if MOE_HAS_ONEDNN
  auto& c = moe::detail::onednn::counters();
  st.isa = moe::detail::onednn::isa_name();
  st.primitives = c.primitives;
  st.packed_tensors = c.packed_tensors;
  st.rejected = c.rejected;
  st.reference_runs = c.reference_runs;
  std::lock_guard<std::mutex> lock(c.mutex);
  for (auto const& [impl, n] : c.runs) st.runs[impl] = n;
  st.rejected_what = c.rejected_what;
  st.reference_what = c.reference_what;
#else
  st.isa = "none";
#endif
  return st;
}

}  // namespace moe::gmm

#if MOE_HAS_ONEDNN

namespace moe::detail::onednn {

/// Largest row chunk of one packed call; larger chunks are multiples of 16.
inline constexpr std::int64_t max_chunk_rows = 256;
inline constexpr std::int64_t row_bucket = 16;
/// Narrowest column block a tgmm call is split into.
inline constexpr std::int64_t tgmm_min_columns = 128;

/// The primitive families a packed kernel can come from, in the order they are tried.
enum class Family { matmul, conv };

inline char const* family_name(Family f) { return f == Family::matmul ? "matmul" : "conv1x1"; }

/// Test hooks: run OneDnn in a mode, family or weight layout that oneDNN would not have chosen,
/// so every path runs on every CPU.
///  * mode plain: never pack; mode packed: pack even without a PackCache, and take the family
///    (and layout) given here without checking its probe (each chunk's kernel is still checked);
///  * family: try only this family (matmul or conv);
///  * layout: this packed weight layout instead of oneDNN's (a forced mismatch: with a layout no
///    kernel accepts, every chunk is refused and runs plain).
struct Forced {
  enum class Mode { chosen, plain, packed } mode = Mode::chosen;
  bool any_family = true;
  Family family = Family::matmul;
  dnnl::memory::format_tag layout = dnnl::memory::format_tag::undef;

  auto key() const { return std::make_tuple(int(mode), any_family, int(family), int(layout)); }
};
inline Forced& forced() {
  static Forced f;
  return f;
}

/// One packed call: `rows` rows of a group from row c0, computed over `run` rows (run > rows:
/// the rows past the group are read, and the call writes into a thread's own buffer, from which
/// the group's rows are copied or added).
struct Chunk {
  std::int64_t rows, run;
};

/// The next call at row c0 of m when `left` rows of the group remain: max_chunk_rows; else all
/// `left` rows over the multiple of row_bucket at or above `left` when those rows exist (c0 +
/// run <= m); else the multiple below (the rest follows exactly); all `left` when below 16
/// (exact: a decode group is not padded to 16 rows). Rounding up costs < 16 rows of FLOPs; a
/// separate call for the < 16 leftover rows would read the expert's weights again. At most 31
/// distinct run sizes, so primitives are made once each.
inline Chunk chunk_rows(std::int64_t left, std::int64_t c0, std::int64_t m) {
  if (left >= max_chunk_rows) return {max_chunk_rows, max_chunk_rows};
  if (left < row_bucket) return {left, left};
  std::int64_t const up = (left + row_bucket - 1) / row_bucket * row_bucket;
  if (c0 + up <= m) return {left, up};
  std::int64_t const down = left / row_bucket * row_bucket;
  return {down, down};
}

/// Groups of 2 to few_rows_max rows run on few_rows() in the plain mode: oneDNN's sgemm copies
/// (packs) the weights in every call, which for a handful of rows (decode) costs more than the
/// multiply; few_rows() reads each weight once, straight from memory. One row stays on sgemm,
/// whose GEMV reads the weights once too (measured on AVX2, 2 threads, 1024 x 2816: 1 row sgemm
/// 25 GB/s vs few_rows 20; 2 rows 10 vs 17; 4 rows 11 vs 10).
inline constexpr std::int64_t few_rows_max = 3;

/// acc[r, :] += sum_{c in [c0,c1)} x[r, c] * W[c, :] for the R rows: W's rows are read in memory
/// order, once, and acc (R x n) stays in cache.
template <int R>
void few_rows_part(std::int64_t c0, std::int64_t c1, std::int64_t n, float const* x,
                   std::int64_t ldx, float const* w, std::int64_t ldw, float* acc) {
  for (std::int64_t c = c0; c < c1; ++c) {
    float const* wr = w + c * ldw;
    float a[R];
    for (int r = 0; r < R; ++r) a[r] = x[r * ldx + c];
    for (int r = 0; r < R; ++r) {
      float* o = acc + r * n;
      float const ar = a[r];
      for (std::int64_t j = 0; j < n; ++j) o[j] += ar * wr[j];
    }
  }
}

/// out[r, :] (+)= sum_c x[r, c] * W[c, :] for r < rows <= few_rows_max (3), W [k,n] with row stride
/// ldw. Each OpenMP thread (oneDNN's pool, when moe is compiled with OpenMP) streams a contiguous
/// range of W's rows into its own partial sums; the partials are then added in thread order, so
/// a run is reproducible for a given thread count.
inline void few_rows(std::int64_t rows, std::int64_t k, std::int64_t n, float const* x,
                     std::int64_t ldx, float const* w, std::int64_t ldw, float* out,
                     std::int64_t ldo, bool accumulate) {
  static std::atomic<std::uint64_t>& runs = run_counter("few_rows");
  ++runs;
  // Below ~1 MB of weights a thread team costs more than it saves.
  int const threads = k * n < (std::int64_t(1) << 18) ? 1 : max_threads();
  // Reused across calls (a decode step makes one call per expert): no allocation per call.
  // The team's threads reach it through `sums` (a thread_local named inside the parallel region
  // would be each thread's own, empty buffer).
  static thread_local std::vector<float> partial;
  partial.assign(std::size_t(threads) * std::size_t(rows * n), 0.0f);
  float* const sums = partial.data();
  auto part = [&](int t) {
    std::int64_t const c0 = k * t / threads, c1 = k * (t + 1) / threads;
    float* acc = sums + std::size_t(t) * std::size_t(rows * n);
    if (rows == 1)
      few_rows_part<1>(c0, c1, n, x, ldx, w, ldw, acc);
    else if (rows == 2)
      few_rows_part<2>(c0, c1, n, x, ldx, w, ldw, acc);
    else
      few_rows_part<3>(c0, c1, n, x, ldx, w, ldw, acc);
  };
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads)
#endif
  for (int t = 0; t < threads; ++t) part(t);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo;
    for (std::int64_t j = 0; j < n; ++j) {
      float v = partial[std::size_t(r * n + j)];
      for (int t = 1; t < threads; ++t)
        v += partial[std::size_t(t) * std::size_t(rows * n) + std::size_t(r * n + j)];
      o[j] = accumulate ? o[j] + v : v;
    }
  }
}

/// Row-major [rows, ch] with row stride ld as a channels-last 1x1 image (N=1, C=ch, H=rows, W=1).
inline dnnl::memory::desc pixels_desc(std::int64_t rows, std::int64_t ch, std::int64_t ld) {
  return dnnl::memory::desc(dnnl::memory::dims{1, ch, rows, 1}, dnnl::memory::data_type::f32,
                            dnnl::memory::dims{rows * ld, 1, ld, ld});
}

/// Row-major [rows, cols] with row stride ld as a matmul operand.
inline dnnl::memory::desc matrix_desc(std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return dnnl::memory::desc(dnnl::memory::dims{rows, cols}, dnnl::memory::data_type::f32,
                            dnnl::memory::dims{ld, 1});
}

/// The activations x[rows, k] (row stride ld) as the family's source.
inline dnnl::memory::desc src_desc(Family f, std::int64_t rows, std::int64_t k, std::int64_t ld) {
  return f == Family::matmul ? matrix_desc(rows, k, ld) : pixels_desc(rows, k, ld);
}

/// The output out[rows, n] (row stride ld) as the family's destination.
inline dnnl::memory::desc dst_desc(Family f, std::int64_t rows, std::int64_t n, std::int64_t ld) {
  return f == Family::matmul ? matrix_desc(rows, n, ld) : pixels_desc(rows, n, ld);
}

/// The weights of out = x * W in the family's terms (matmul: [k, n]; 1x1 convolution: O=n,
/// I=k): W row-major [k, n] with row stride ld, or (trans) row-major [n, k] used transposed.
inline dnnl::memory::desc weights_desc(Family f, std::int64_t k, std::int64_t n, bool trans,
                                       std::int64_t ld) {
  using dims = dnnl::memory::dims;
  auto const f32 = dnnl::memory::data_type::f32;
  if (f == Family::matmul)
    return dnnl::memory::desc(dims{k, n}, f32, trans ? dims{1, ld} : dims{ld, 1});
  return dnnl::memory::desc(dims{n, k, 1, 1}, f32, trans ? dims{ld, 1, 1, 1} : dims{1, ld, 1, 1});
}

/// The family's weights [k, n] in a format tag (format_tag::any: oneDNN's choice).
inline dnnl::memory::desc tagged_weights(Family f, std::int64_t k, std::int64_t n,
                                         dnnl::memory::format_tag tag) {
  using dims = dnnl::memory::dims;
  return dnnl::memory::desc(f == Family::matmul ? dims{k, n} : dims{n, k, 1, 1},
                            dnnl::memory::data_type::f32, tag);
}

/// User scratchpad (a primitive may then run on any thread, several at once, each with its own
/// scratchpad: Kernel passes it) and, to accumulate (out += x * W), a sum post-op.
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

/// Calls use(pd) with the family's primitive descriptor of out[rows, n] (+)= x[rows, k] * W,
/// weights `w` (a concrete layout, or format_tag::any), row strides lda and ldc; returns what use
/// returns. Throws dnnl::error when oneDNN has no implementation at all.
template <class Use>
auto with_pd(Family f, std::int64_t rows, std::int64_t k, std::int64_t n, std::int64_t lda,
             std::int64_t ldc, dnnl::memory::desc const& w, bool accumulate, Use&& use) {
  auto const attr = kernel_attr(accumulate);
  auto const src = src_desc(f, rows, k, lda);
  auto const dst = dst_desc(f, rows, n, ldc);
  if (f == Family::matmul) {
#if DNNL_VERSION_MAJOR >= 3
    return use(dnnl::matmul::primitive_desc(engine(), src, w, dst, attr));
#else
    return use(dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, w, dst), attr, engine()));
#endif
  }
  dnnl::memory::dims const unit{1, 1}, none{0, 0};
#if DNNL_VERSION_MAJOR >= 3
  return use(dnnl::convolution_forward::primitive_desc(engine(), dnnl::prop_kind::forward_inference,
                                                       dnnl::algorithm::convolution_direct, src, w,
                                                       dst, unit, none, none, attr));
#else
  return use(dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference,
                                      dnnl::algorithm::convolution_direct, src, w, dst, unit, none,
                                      none),
      attr, engine()));
#endif
}

/// "matmul 256x1024x2816 +=" (rows x k x n; "+=" with the sum post-op).
inline std::string kernel_what(Family f, std::int64_t rows, std::int64_t k, std::int64_t n,
                               bool accumulate) {
  return std::string(family_name(f)) + " " + std::to_string(rows) + "x" + std::to_string(k) + "x" +
         std::to_string(n) + (accumulate ? " +=" : "");
}

/// \brief How one weight shape runs: packed (a family, its fixed weight layout, the reorder that
/// packs an expert into it, a checked kernel per chunk size) or plain.
///
/// Made once per shape (plan()), for one thread (ScopedThreads(1): the calls run side by side,
/// one per thread), so nothing depends on the process's thread count.
class KernelPlan {
 public:
  /// k: contraction, n: output columns, trans/ldw: how the weights are stored (row-major [k, n],
  /// or [n, k] used transposed, row stride ldw), lda/ldc: row strides of lhs and out.
  KernelPlan(std::int64_t k, std::int64_t n, bool trans, std::int64_t ldw, std::int64_t lda,
             std::int64_t ldc)
      : k_(k), n_(n), lda_(lda), ldc_(ldc) {
    Forced const f = forced();
    if (f.mode == Forced::Mode::plain) return;
    ScopedThreads one(1);
    // A forced packed mode takes the first allowed family unchecked when none passes the check.
    std::string refused;  // why each family was not taken (a refusal only if none is)
    for (bool checked : {true, false}) {
      if (!checked && f.mode != Forced::Mode::packed) break;
      for (Family fam : {Family::matmul, Family::conv})
        if ((f.any_family || fam == f.family) && choose(fam, trans, ldw, f, checked, refused))
          return;
    }
    note_rejected("the weights " + std::to_string(k) + "x" + std::to_string(n) +
                      (trans ? "^T" : "") + " (plain mode)",
                  refused);
  }

  /// Whether the weights are reordered into a packed layout (else used in place).
  bool packed() const { return packer_ != nullptr; }
  Family family() const { return family_; }
  dnnl::memory::desc const& packed_desc() const { return packed_desc_; }
  /// The reorder of one expert's weights into packed_desc() (packed() only).
  Kernel const& packer() const { return *packer_; }

  /// The kernel over `rows` rows (a chunk_rows() run), made and checked on first use; nullptr
  /// when oneDNN has no direct kernel for this run size with the packed layout (the chunk then
  /// runs plain). Not to be called inside a parallel region (call it while listing the calls).
  Kernel const* kernel(std::int64_t rows, bool accumulate) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, fresh] = kernels_.try_emplace({rows, accumulate});
    if (fresh) {
      ScopedThreads one(1);
      std::string const what = kernel_what(family_, rows, k_, n_, accumulate);
      try {
        it->second = with_pd(family_, rows, k_, n_, lda_, ldc_, packed_desc_, accumulate,
                             [&](auto const& pd) -> std::unique_ptr<Kernel> {
                               std::string const impl = pd.impl_info_str();
                               if (direct_kernel(impl)) return std::make_unique<Kernel>(pd, what);
                               note_rejected(what, impl);
                               return nullptr;
                             });
      } catch (dnnl::error const& e) {
        note_rejected(what, std::string("no implementation: ") + e.what());
      }
    }
    return it->second.get();
  }

  dnnl::memory::desc src_desc(std::int64_t rows) const {
    return onednn::src_desc(family_, rows, k_, lda_);
  }
  dnnl::memory::desc dst_desc(std::int64_t rows) const {
    return onednn::dst_desc(family_, rows, n_, ldc_);
  }

 private:
  /// Takes `fam` when it has a direct kernel at max_chunk_rows with the first of its layouts
  /// (packed_layouts()) that has one, unless `checked` is false, and a reorder into that layout
  /// that is not a reference one. Appends why not to `refused` otherwise.
  bool choose(Family fam, bool trans, std::int64_t ldw, Forced const& f, bool checked,
              std::string& refused) {
    auto refuse = [&](std::string const& why) {
      refused += (refused.empty() ? "" : "; ") + std::string(family_name(fam)) + ": " + why;
      return false;
    };
    for (auto const tag : packed_layouts(fam, f)) {
      try {
        auto const [impl, layout] =
            with_pd(fam, max_chunk_rows, k_, n_, lda_, ldc_, tagged_weights(fam, k_, n_, tag),
                    false, [](auto const& pd) {
                      return std::make_pair(std::string(pd.impl_info_str()), pd.weights_desc());
                    });
        if (checked && !direct_kernel(impl)) {
          refuse(impl);
          continue;
        }
        dnnl::reorder::primitive_desc const rpd(engine(), weights_desc(fam, k_, n_, trans, ldw),
                                                engine(), layout, kernel_attr(false));
        if (reference_impl(rpd.impl_info_str())) {
          refuse(std::string("packing reorder ") + rpd.impl_info_str());
          continue;
        }
        packer_ = std::make_unique<Kernel>(
            rpd, std::string("pack ") + std::to_string(k_) + "x" + std::to_string(n_) + " weights");
        family_ = fam;
        packed_desc_ = layout;
        return true;
      } catch (dnnl::error const& e) {
        refuse(std::string("no implementation (") + e.what() + ")");
      }
    }
    return false;
  }

  /// The weight layouts to try for a family, best first: the forced one; else for matmul the
  /// 48-column blocks (BA16a48b), then oneDNN's own choice (format_tag::any, 64-column blocks for
  /// f32). Measured on 1 thread of a Zen 4 core (AVX-512) over the expert shapes of Mixtral,
  /// Qwen3 and DeepSeek-V3 (k x n from 768 x 2048 to 7168 x 2048 both ways): 48 columns run 1-3
  /// rows at 19-25 GB/s of weights against 12-16 for 64 (the decode regime, where a row chunk
  /// streams the expert's weights once), and 16-256 rows within 2 % of 64 (110-114 GFLOP/s); 32
  /// columns streamed faster still (23-28 GB/s) but lost 16 % at 256 rows on 1024 x 2816.
  static std::vector<dnnl::memory::format_tag> packed_layouts(Family fam, Forced const& f) {
    using tag = dnnl::memory::format_tag;
    if (f.layout != tag::undef) return {f.layout};
    if (fam == Family::matmul) return {tag::BA16a48b, tag::any};
    return {tag::any};
  }

  std::int64_t k_, n_, lda_, ldc_;
  Family family_ = Family::matmul;
  dnnl::memory::desc packed_desc_;
  std::unique_ptr<Kernel> packer_;
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, bool>, std::unique_ptr<Kernel>> kernels_;
};

/// The process-wide plans, one per weight shape and storage (k, n, trans, ldw, lda, ldc) and
/// test hook state: kernels are made once.
inline KernelPlan& plan(std::int64_t k, std::int64_t n, bool trans, std::int64_t ldw,
                        std::int64_t lda, std::int64_t ldc) {
  using Key = std::tuple<std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t, std::int64_t,
                         decltype(forced().key())>;
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<KernelPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& p = plans[Key{k, n, trans, ldw, lda, ldc, forced().key()}];
  if (!p) p = std::make_unique<KernelPlan>(k, n, trans, ldw, lda, ldc);
  return *p;
}

/// Every expert of one rhs tensor in the plan's packed layout.
struct PackedTensor {
  std::vector<dnnl::memory> experts;
};

/// Hash of 16 sampled values per expert of rhs (the PackCache's guard against unversioned writes).
template <class Tensor>
std::uint64_t sample_hash(Tensor const& rhs) {
  std::uint64_t h = fnv1a_basis;
  std::int64_t const per = std::int64_t(rhs.extent(1)) * std::int64_t(rhs.extent(2));
  if (per == 0) return h;
  for (std::size_t g = 0; g < rhs.extent(0); ++g)
    for (std::int64_t i = 0; i < 16; ++i) {
      std::int64_t const flat = i * (per - 1) / 15;
      auto const v = rhs(g, flat / rhs.extent(2), flat % rhs.extent(2));
      h = fnv1a(&v, sizeof(v), h);
    }
  return h;
}

/// The packed copy of rhs for `p`: from the cache when it holds this version, else reordered now
/// (and stored when a cache was given).
template <class Tensor>
std::shared_ptr<PackedTensor> packed(KernelPlan& p, Tensor const& rhs, bool trans,
                                     moe::gmm::GmmOptions const& opt) {
  moe::gmm::PackCache::Key const key{rhs.data(),
                                     std::int64_t(rhs.extent(0)),
                                     std::int64_t(rhs.extent(1)),
                                     std::int64_t(rhs.extent(2)),
                                     int(sizeof(float)),
                                     trans};
  std::uint64_t const samples = opt.pack_cache ? sample_hash(rhs) : 0;
  if (opt.pack_cache)
    if (auto hit = opt.pack_cache->find(key, opt.rhs_version, samples))
      return std::static_pointer_cast<PackedTensor>(hit);
  // A new version of a tensor packed before is written into the old copy's storage (first
  // touch of fresh pages costs several times the reorder itself).
  std::shared_ptr<PackedTensor> out;
  if (opt.pack_cache) out = std::static_pointer_cast<PackedTensor>(opt.pack_cache->previous(key));
  if (!out || out->experts.size() != rhs.extent(0) ||
      (!out->experts.empty() && !(out->experts.front().get_desc() == p.packed_desc())))
    out = std::make_shared<PackedTensor>();
  std::int64_t const ld = rhs.stride(1);
  std::int64_t const kk = trans ? rhs.extent(2) : rhs.extent(1);
  std::int64_t const nn = trans ? rhs.extent(1) : rhs.extent(2);
  dnnl::memory::desc const user = weights_desc(p.family(), kk, nn, trans, ld);
  bool const fresh = out->experts.empty();
  for (std::size_t g = 0; g < rhs.extent(0); ++g) {
    dnnl::memory src(user, engine(), const_cast<float*>(rhs.data() + g * rhs.stride(0)));
    if (fresh) out->experts.emplace_back(p.packed_desc(), engine());
    p.packer().run({{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, out->experts[g]}});
  }
  ++counters().packed_tensors;
  if (opt.pack_cache)
    opt.pack_cache->put(key, opt.rhs_version, samples, out,
                        p.packed_desc().get_size() * rhs.extent(0));
  return out;
}

}  // namespace moe::detail::onednn

#endif  // MOE_HAS_ONEDNN

namespace moe::detail::gmm_impl {

template <>
struct Impl<moe::gmm::OneDnn> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  moe::gmm::Groups<Mem> const& groups, Mat<E, S, MO> const& out,
                  moe::gmm::GmmOptions const& opt) {
#if MOE_HAS_ONEDNN
    if constexpr (moe::gmm::is_available<moe::gmm::OneDnn, E, S>::value) {
      run_gmm(space, lhs, rhs, groups, out, opt);
      return;
    }
#endif
    Impl<moe::gmm::Vendor>::gmm(space, lhs, rhs, groups, out, opt);
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   moe::gmm::Groups<Mem> const& groups, Tensor<E, S, MO> const& out,
                   moe::gmm::GmmOptions const& opt) {
#if MOE_HAS_ONEDNN
    if constexpr (moe::gmm::is_available<moe::gmm::OneDnn, E, S>::value) {
      run_tgmm(space, lhs, dy, groups, out, opt);
      return;
    }
#endif
    Impl<moe::gmm::Vendor>::tgmm(space, lhs, dy, groups, out, opt);
  }

#if MOE_HAS_ONEDNN
  template <class E, class ML, class MR, class MO, class Mem>
  static void run_gmm(E const& space, CMat<E, float, ML> const& lhs,
                      CTensor<E, float, MR> const& rhs, moe::gmm::Groups<Mem> const& groups,
                      Mat<E, float, MO> const& out, moe::gmm::GmmOptions const& opt) {
    namespace dn = moe::detail::onednn;
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), k = lhs.extent(1), n = out.extent(1);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    std::int64_t const begin = off(go), end = off(go + num_local);
    bool const acc = opt.accumulate, trans = opt.transpose_rhs;
    fence(space, "moe::gmm::gmm<OneDnn>: operands ready");
    if (n > 0 && end > begin && k == 0) {
      if (!acc)
        zero(space, Mat<E, float, MO>(Kokkos::subview(out, Rows(begin, end), Kokkos::ALL)),
             "moe::gmm::zero_rows");
    } else if (n > 0 && end > begin) {
      std::int64_t const lda = lhs.stride(0), ldc = out.stride(0), ldw = rhs.stride(1);
      dn::KernelPlan& p = dn::plan(k, n, trans, ldw, lda, ldc);
      // Packing pays only when the packed copy is kept for later calls: without a cache the
      // call runs plain (unless a test forces the packed mode).
      bool const pack =
          p.packed() && (opt.pack_cache || dn::forced().mode == dn::Forced::Mode::packed);
      if (!pack) {
        // Plain layout: one sgemm per group on the weights in place. Rows are padded to the
        // bucket as in Vendor (the extra rows belong to later groups or are zeroed below).
        std::int64_t const pad = acc ? 1 : dn::row_bucket;
        for (int g = 0; g < num_local; ++g) {
          std::int64_t const r0 = off(go + g), r1 = off(go + g + 1);
          if (r1 == r0) continue;
          if (!trans && r1 - r0 >= 2 && r1 - r0 <= dn::few_rows_max) {
            dn::few_rows(r1 - r0, k, n, lhs.data() + r0 * lda, lda, rhs.data() + g * rhs.stride(0),
                         ldw, out.data() + r0 * ldc, ldc, acc);
            continue;
          }
          std::int64_t const padded = r0 + (r1 - r0 + pad - 1) / pad * pad;
          std::int64_t const stop = padded <= m ? padded : r1;
          dn::sgemm('N', trans ? 'T' : 'N', stop - r0, n, k, 1.0f, lhs.data() + r0 * lda, lda,
                    rhs.data() + g * rhs.stride(0), ldw, acc ? 1.0f : 0.0f, out.data() + r0 * ldc,
                    ldc);
        }
      } else {
        packed_gmm(p, lhs, rhs, groups, out, opt);
      }
    }
    if (!acc) zero_outside(space, out, begin, end);
    fence(space, "moe::gmm::gmm<OneDnn>: done");
  }

  /// Packed layout: each group as row chunks (chunk_rows) on the plan's kernels, reading lhs in
  /// place. The calls are listed first (kernels are made and checked here, once per run size),
  /// then run side by side on the threads (for_each_item), each call on one thread: a chunk
  /// rounded up past its group writes into the thread's own buffer and copies (or, when
  /// accumulating, adds) its group's rows, so no call writes rows of another. A chunk whose run
  /// size has no direct kernel (KernelPlan::kernel() is null) runs as sgemm on the weights in
  /// place, over its own rows only.
  template <class E, class ML, class MR, class MO, class Mem>
  static void packed_gmm(moe::detail::onednn::KernelPlan& p, CMat<E, float, ML> const& lhs,
                         CTensor<E, float, MR> const& rhs, moe::gmm::Groups<Mem> const& groups,
                         Mat<E, float, MO> const& out, moe::gmm::GmmOptions const& opt) {
    namespace dn = moe::detail::onednn;
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), k = lhs.extent(1), n = out.extent(1);
    std::int64_t const lda = lhs.stride(0), ldc = out.stride(0), ldw = rhs.stride(1);
    bool const acc = opt.accumulate, trans = opt.transpose_rhs;
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    auto const pk = dn::packed(p, rhs, trans, opt);
    struct Call {
      int g;
      std::int64_t c0;
      dn::Chunk chunk;
      dn::Kernel const* kernel;  // null: sgemm on the weights in place
    };
    std::vector<Call> calls;
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r1 = off(go + g + 1);
      for (std::int64_t c0 = off(go + g); c0 < r1;) {
        dn::Chunk c = dn::chunk_rows(r1 - c0, c0, m);
        dn::Kernel const* kernel = p.kernel(c.run, acc && c.run == c.rows);
        if (!kernel) c.run = c.rows;
        calls.push_back({g, c0, c, kernel});
        c0 += c.rows;
      }
    }
    float const* const x = lhs.data();
    float* const y = out.data();
    dn::for_each_item(std::int64_t(calls.size()), [&](std::int64_t i) {
      Call const& c = calls[std::size_t(i)];
      if (!c.kernel) {
        dn::sgemm('N', trans ? 'T' : 'N', c.chunk.rows, n, k, 1.0f, x + c.c0 * lda, lda,
                  rhs.data() + c.g * rhs.stride(0), ldw, acc ? 1.0f : 0.0f, y + c.c0 * ldc, ldc);
        return;
      }
      bool const spill = c.chunk.run != c.chunk.rows;
      float* const dst =
          spill ? dn::thread_buffer(0, std::size_t(c.chunk.run * ldc)) : y + c.c0 * ldc;
      dnnl::memory const src(p.src_desc(c.chunk.run), dn::engine(),
                             const_cast<float*>(x + c.c0 * lda));
      dnnl::memory const out_rows(p.dst_desc(c.chunk.run), dn::engine(), dst);
      c.kernel->run({{DNNL_ARG_SRC, src},
                     {DNNL_ARG_WEIGHTS, pk->experts[std::size_t(c.g)]},
                     { DNNL_ARG_DST,
                       out_rows }});
      if (spill)
        for (std::int64_t r = 0; r < c.chunk.rows; ++r) {
          float const* from = dst + r * ldc;
          float* to = y + (c.c0 + r) * ldc;
          if (acc)
            for (std::int64_t j = 0; j < n; ++j) to[j] += from[j];
          else
            std::copy(from, from + n, to);
        }
    });
  }

  /// Weight gradients, one oneDNN sgemm per (group, block of output columns), the calls side by
  /// side on the threads (for_each_item; each sgemm single-threaded). A group is split into
  /// column blocks when its rows exceed half a thread's share of all rows, so one hot expert
  /// does not leave the other threads idle; blocks are multiples of 16 columns.
  template <class E, class ML, class MD, class MO, class Mem>
  static void run_tgmm(E const& space, CMat<E, float, ML> const& lhs, CMat<E, float, MD> const& dy,
                       moe::gmm::Groups<Mem> const& groups, Tensor<E, float, MO> const& out,
                       moe::gmm::GmmOptions const& opt) {
    namespace dn = moe::detail::onednn;
    int const num_local = out.extent(0);
    std::int64_t const k = out.extent(1), n = out.extent(2);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    if (k == 0 || n == 0) return;
    fence(space, "moe::gmm::tgmm<OneDnn>: operands ready");
    std::int64_t const total = off(go + num_local) - off(go);
    int const threads = dn::max_threads();
    std::int64_t const share = std::max<std::int64_t>(1, total / (2 * threads));
    struct Call {
      int g;
      std::int64_t n0, n1;
    };
    std::vector<Call> calls;
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const rows = off(go + g + 1) - off(go + g);
      if (rows == 0) {
        if (!opt.accumulate)
          zero(space, Mat<E, float, MO>(Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL)),
               "moe::gmm::tgmm::zero_empty_group");
        continue;
      }
      std::int64_t const blocks =
          threads == 1 ? 1
                       : std::max<std::int64_t>(
                             1, std::min((rows + share - 1) / share, n / dn::tgmm_min_columns));
      for (std::int64_t b = 0; b < blocks; ++b)
        calls.push_back(
            {g, n * b / blocks / 16 * 16, b + 1 == blocks ? n : n * (b + 1) / blocks / 16 * 16});
    }
    fence(space, "moe::gmm::tgmm<OneDnn>: empty groups zeroed");
    std::int64_t const lda = lhs.stride(0), ldd = dy.stride(0), ldo = out.stride(1);
    dn::for_each_item(std::int64_t(calls.size()), [&](std::int64_t i) {
      Call const& c = calls[std::size_t(i)];
      std::int64_t const r0 = off(go + c.g), r1 = off(go + c.g + 1);
      dn::sgemm('T', 'N', k, c.n1 - c.n0, r1 - r0, 1.0f, lhs.data() + r0 * lda, lda,
                dy.data() + r0 * ldd + c.n0, ldd, opt.accumulate ? 1.0f : 0.0f,
                out.data() + c.g * out.stride(0) + c.n0, ldo);
    });
    fence(space, "moe::gmm::tgmm<OneDnn>: done");
  }
#endif
};

}  // namespace moe::detail::gmm_impl
