#pragma once
/// \file
/// gmm::OneDnn: grouped GEMM on the host through oneDNN, whose kernels are chosen from the CPU's
/// feature bits (so a CPU newer than the BLAS still gets its widest vector ISA).
///
/// An expert projection x[rows, k] * W[k, n] is a 1x1 convolution over `rows` pixels with k input
/// and n output channels: oneDNN's direct convolution kernels (jit 1x1 on AVX2 and AVX-512,
/// brgemm on newer cores) read channels-last (row-major) activations in place and take the
/// weights in a blocked layout of their own, so the weights are packed once and the per-call
/// packing of a BLAS sgemm (a full read and write of each expert's weights on every call) is
/// gone. For each weight shape (k, n, as is or transposed, row strides) the backend asks oneDNN
/// once which convolution it would run:
///  * a direct kernel (packed mode, when the call brings a PackCache: without one nothing could
///    reuse the packed copy, so the call runs plain): every expert's weights are reordered into
///    its layout once per weight version and kept in the caller's PackCache; each group runs as
///    row chunks (chunk_rows: 256, then the rest rounded up to a multiple of 16 where the rows
///    exist, exact below 16) on primitives made once per chunk size, accumulation through a sum
///    post-op: a steady-state step creates no primitive and packs nothing;
///  * a GEMM-based or reference convolution (no direct kernel for this CPU or these strides):
///    plain mode, the weights used in place, one oneDNN sgemm per group, and a streaming kernel
///    (few_rows) for groups of 2-3 rows.
/// tgmm (weight gradients: two activations, nothing to pack) is one oneDNN sgemm per group, or
/// per column block of a large group.
/// Packed-mode chunks and tgmm calls run side by side on the OpenMP threads, one call per thread
/// (oneDNN runs single-threaded inside a parallel region): measured on 2 Zen 3 cores this beats
/// splitting every call over both threads by 15-25 % at 32-128 rows per expert and 2-5 % at 256
/// and more, and by 6-13 % for tgmm. Results do not depend on which thread runs a call.
/// Float only: oneDNN has no double GEMM on CPUs, so OneDnn with double runs as Vendor.

#include <moe/detail/hash.hpp>
#include <moe/detail/onednn.hpp>
#include <moe/gmm/backend/common.hpp>
#include <moe/gmm/backend/vendor.hpp>

#include <algorithm>
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

}  // namespace moe::gmm

#if MOE_HAS_ONEDNN

namespace moe::detail::onednn {

/// Largest row chunk of one convolution call in packed mode; larger chunks are multiples of 16.
inline constexpr std::int64_t max_chunk_rows = 256;
inline constexpr std::int64_t row_bucket = 16;
/// Narrowest column block a tgmm call is split into.
inline constexpr std::int64_t tgmm_min_columns = 128;

/// Which mode OneDnn runs a weight shape in: as oneDNN's kernels decide (chosen), or forced by a
/// test so both modes run on every CPU (forced packed on a CPU without a direct kernel runs the
/// reference convolution on packed weights: slow, but the same packing and caching).
enum class Layout { chosen, plain, packed };
inline Layout& forced_layout() {
  static Layout l = Layout::chosen;
  return l;
}

/// One convolution call of packed mode: `rows` rows of a group from row c0, computed over `run`
/// rows (run > rows: the rows past the group are read, and the call writes into a thread's own
/// buffer, from which the group's rows are copied or added).
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

/// The weights of out = x * W as 1x1 convolution weights (O=n, I=k): W row-major [k, n] with row
/// stride ld, or (trans) row-major [n, k] used transposed.
inline dnnl::memory::desc weights_desc(std::int64_t k, std::int64_t n, bool trans,
                                       std::int64_t ld) {
  return dnnl::memory::desc(
      dnnl::memory::dims{n, k, 1, 1}, dnnl::memory::data_type::f32,
      trans ? dnnl::memory::dims{ld, 1, 1, 1} : dnnl::memory::dims{1, ld, 1, 1});
}

/// out[rows, n] (+)= x[rows, k] * W as a forward-inference 1x1 convolution on `weights` (a
/// concrete layout, or format_tag::any to ask oneDNN for its preferred one); accumulate adds a sum
/// post-op (out += x * W). The scratchpad is the caller's (user mode): a primitive made on one
/// thread may then run on any thread, and on several at once, each with its own scratchpad.
inline dnnl::convolution_forward::primitive_desc conv_pd(std::int64_t rows, std::int64_t k,
                                                         std::int64_t n, std::int64_t lda,
                                                         std::int64_t ldc,
                                                         dnnl::memory::desc const& weights,
                                                         bool accumulate) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  dnnl::memory::dims const unit{1, 1}, none{0, 0};
  auto const src = pixels_desc(rows, k, lda), dst = pixels_desc(rows, n, ldc);
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::convolution_forward::primitive_desc(engine(), dnnl::prop_kind::forward_inference,
                                                   dnnl::algorithm::convolution_direct, src,
                                                   weights, dst, unit, none, none, attr);
#else
  return dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference,
                                      dnnl::algorithm::convolution_direct, src, weights, dst, unit,
                                      none, none),
      attr, engine());
#endif
}

/// A convolution primitive and the scratchpad it needs (bytes; 0 for none).
struct Conv {
  dnnl::convolution_forward prim;
  dnnl::memory::desc scratch;

  explicit Conv(dnnl::convolution_forward::primitive_desc const& pd)
      : prim(pd), scratch(pd.scratchpad_desc()) {}

  /// Runs on the calling thread, with that thread's stream and scratchpad.
  void run(dnnl::memory const& src, dnnl::memory const& weights, dnnl::memory const& dst) const {
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
    if (std::size_t const bytes = scratch.get_size())
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   dnnl::memory(scratch, engine(), thread_buffer(1, (bytes + 3) / 4)));
    prim.execute(thread_stream(), args);
    thread_stream().wait();
  }
};

/// Whether a convolution implementation name (impl_info_str) is a direct kernel with a weight
/// layout of its own, rather than oneDNN's GEMM-based ("gemm:...") or reference ("ref:...") one.
inline bool direct_kernel(std::string const& impl) {
  return impl.rfind("gemm", 0) != 0 && impl.rfind("ref", 0) != 0;
}

/// How one weight shape runs: the mode, the packed weight layout, the convolution per chunk size.
class ConvPlan {
 public:
  /// k: contraction, n: output columns, lda/ldc: row strides of lhs and out. (Whether the
  /// weights are used transposed matters only to the reorder that packs them.)
  ConvPlan(std::int64_t k, std::int64_t n, std::int64_t lda, std::int64_t ldc)
      : k_(k), n_(n), lda_(lda), ldc_(ldc) {
    dnnl::memory::desc const any(dnnl::memory::dims{n, k, 1, 1}, dnnl::memory::data_type::f32,
                                 dnnl::memory::format_tag::any);
    auto const probe = conv_pd(row_bucket, k, n, lda, ldc, any, false);
    packed_desc_ = probe.weights_desc();
    Layout const forced = forced_layout();
    packed_ = forced == Layout::packed ||
              (forced == Layout::chosen && direct_kernel(probe.impl_info_str()));
  }

  /// Whether the weights are reordered into the convolution's layout (else used in place).
  bool packed() const { return packed_; }
  dnnl::memory::desc const& packed_desc() const { return packed_desc_; }

  /// The convolution over `rows` rows (a chunk_rows() run), made on first use.
  Conv const& conv(std::int64_t rows, bool accumulate) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = prims_[{rows, accumulate}];
    if (!slot)
      slot = std::make_unique<Conv>(conv_pd(rows, k_, n_, lda_, ldc_, packed_desc_, accumulate));
    return *slot;
  }
  /// The reorder of one expert's weights (weights_desc(k, n, trans, ld)) into packed_desc(),
  /// made on first use.
  dnnl::reorder const& packer(bool trans, std::int64_t ld) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = packers_[{trans, ld}];
    if (!slot)
      slot = std::make_unique<dnnl::reorder>(dnnl::reorder::primitive_desc(
          engine(), weights_desc(k_, n_, trans, ld), engine(), packed_desc_));
    return *slot;
  }
  dnnl::memory::desc src_desc(std::int64_t rows) const { return pixels_desc(rows, k_, lda_); }
  dnnl::memory::desc dst_desc(std::int64_t rows) const { return pixels_desc(rows, n_, ldc_); }

 private:
  std::int64_t k_, n_, lda_, ldc_;
  dnnl::memory::desc packed_desc_;
  bool packed_ = false;
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, bool>, std::unique_ptr<Conv>> prims_;
  std::map<std::pair<bool, std::int64_t>, std::unique_ptr<dnnl::reorder>> packers_;
};

/// The process-wide plans, one per (k, n, trans, lda, ldc, forced layout): primitives are made
/// once. (trans is part of the key so that a shape's plain and transposed weights, which the
/// PackCache keeps apart, never share a mode decision made under another forced layout.)
inline ConvPlan& plan(std::int64_t k, std::int64_t n, bool trans, std::int64_t lda,
                      std::int64_t ldc) {
  using Key = std::tuple<std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t, Layout>;
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<ConvPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& p = plans[Key{k, n, trans, lda, ldc, forced_layout()}];
  if (!p) p = std::make_unique<ConvPlan>(k, n, lda, ldc);
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
std::shared_ptr<PackedTensor> packed(ConvPlan& p, Tensor const& rhs, bool trans,
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
  dnnl::memory::desc const user = weights_desc(kk, nn, trans, ld);
  dnnl::reorder const& reorder = p.packer(trans, ld);
  bool const fresh = out->experts.empty();
  for (std::size_t g = 0; g < rhs.extent(0); ++g) {
    dnnl::memory src(user, engine(), const_cast<float*>(rhs.data() + g * rhs.stride(0)));
    if (fresh) out->experts.emplace_back(p.packed_desc(), engine());
    reorder.execute(stream(), src, out->experts[g]);
  }
  stream().wait();
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
      dn::ConvPlan& p = dn::plan(k, n, trans, lda, ldc);
      // Packing pays only when the packed copy is kept for later calls: without a cache the
      // call runs plain (unless a test forces the packed mode).
      bool const pack = p.packed() && (opt.pack_cache || dn::forced_layout() == dn::Layout::packed);
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

  /// Packed layout: each group as row chunks (chunk_rows) on the plan's convolutions, reading
  /// lhs in place. The calls are listed first (primitives are made here, once per run size),
  /// then run side by side on the threads (for_each_item), each call on one thread: a chunk
  /// rounded up past its group writes into the thread's own buffer and copies (or, when
  /// accumulating, adds) its group's rows, so no call writes rows of another.
  template <class E, class ML, class MR, class MO, class Mem>
  static void packed_gmm(moe::detail::onednn::ConvPlan& p, CMat<E, float, ML> const& lhs,
                         CTensor<E, float, MR> const& rhs, moe::gmm::Groups<Mem> const& groups,
                         Mat<E, float, MO> const& out, moe::gmm::GmmOptions const& opt) {
    namespace dn = moe::detail::onednn;
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), n = out.extent(1);
    std::int64_t const lda = lhs.stride(0), ldc = out.stride(0);
    bool const acc = opt.accumulate;
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    auto const pk = dn::packed(p, rhs, opt.transpose_rhs, opt);
    struct Call {
      int g;
      std::int64_t c0;
      dn::Chunk chunk;
      dn::Conv const* conv;
    };
    std::vector<Call> calls;
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r1 = off(go + g + 1);
      for (std::int64_t c0 = off(go + g); c0 < r1;) {
        dn::Chunk const c = dn::chunk_rows(r1 - c0, c0, m);
        calls.push_back({g, c0, c, &p.conv(c.run, acc && c.run == c.rows)});
        c0 += c.rows;
      }
    }
    float const* const x = lhs.data();
    float* const y = out.data();
    dn::for_each_item(std::int64_t(calls.size()), [&](std::int64_t i) {
      Call const& c = calls[std::size_t(i)];
      bool const spill = c.chunk.run != c.chunk.rows;
      float* const dst =
          spill ? dn::thread_buffer(0, std::size_t(c.chunk.run * ldc)) : y + c.c0 * ldc;
      c.conv->run(
          dnnl::memory(p.src_desc(c.chunk.run), dn::engine(), const_cast<float*>(x + c.c0 * lda)),
          pk->experts[std::size_t(c.g)], dnnl::memory(p.dst_desc(c.chunk.run), dn::engine(), dst));
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
