#pragma once
/// \file
/// gmm::OneDnn: grouped GEMM on the host through oneDNN, whose kernels are chosen from the CPU's
/// feature bits (so a CPU newer than the BLAS still gets its widest vector ISA).
///
/// For each weight shape (k, n, as is or transposed) the backend asks oneDNN once which weight
/// layout its matmul prefers for a group of rows:
///  * a blocked layout (CPUs with AVX-512 / AMX brgemm kernels): every expert's weights are
///    reordered into it once per weight version and kept in the caller's PackCache, and each
///    group runs as chunks of at most 256 rows through matmul primitives made once per row
///    bucket (multiples of 16), so a steady-state step creates no primitive and packs nothing;
///  * the plain layout (e.g. AVX2, where oneDNN's matmul is its JIT sgemm): the weights are used
///    in place, one oneDNN sgemm per group (no copy, nothing that can go stale).
/// tgmm (weight gradients: two activations, nothing to pack) is one oneDNN sgemm per group.
/// Float only: oneDNN has no double GEMM on CPUs, so OneDnn with double runs as Vendor.

#include <moe/detail/hash.hpp>
#include <moe/detail/onednn.hpp>
#include <moe/gmm/backend/common.hpp>
#include <moe/gmm/backend/vendor.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace moe::gmm {

/// \brief Policy: oneDNN on host execution spaces (float), with weights reordered once into
/// oneDNN's preferred layout where it has one. Auto's choice on the host when moe was configured
/// with oneDNN. Runs as Vendor on device spaces, for double, and without oneDNN.
struct OneDnn {};

template <>
struct is_policy<OneDnn> : std::true_type {};

template <class ExecSpace, class Scalar>
struct is_available<OneDnn, ExecSpace, Scalar>
    : std::integral_constant<
          bool, MOE_HAS_ONEDNN && std::is_same<Scalar, float>::value &&
                    Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible> {};

}  // namespace moe::gmm

#if MOE_HAS_ONEDNN

namespace moe::detail::onednn {

/// Largest row chunk of one matmul call in the blocked mode; row buckets are multiples of 16.
inline constexpr std::int64_t max_chunk_rows = 256;
inline constexpr std::int64_t row_bucket = 16;

/// Tests: treat every shape as blocked (the "packed" layout is then the plain one, copied), so
/// the packing, chunking and cache paths run on CPUs whose oneDNN prefers plain weights.
inline bool& force_packed() {
  static bool f = false;
  return f;
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
  int threads = 1;
#if defined(_OPENMP)
  threads = omp_get_max_threads();
  // Below ~1 MB of weights a thread team costs more than it saves.
  if (k * n < (std::int64_t(1) << 18)) threads = 1;
#endif
  // Reused across calls (a decode step makes one call per expert): no allocation per call.
  static thread_local std::vector<float> partial;
  partial.assign(std::size_t(threads) * std::size_t(rows * n), 0.0f);
  auto part = [&](int t) {
    std::int64_t const c0 = k * t / threads, c1 = k * (t + 1) / threads;
    float* acc = partial.data() + std::size_t(t) * std::size_t(rows * n);
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

/// How one weight shape runs: the preferred weight layout and the matmuls of the row buckets.
class MatmulPlan {
 public:
  using md = dnnl::memory::desc;
  using dims = dnnl::memory::dims;

  /// k: contraction, n: output columns, trans: rhs[g] is [n,k] (used transposed), lda/ldc: row
  /// strides of lhs and out.
  MatmulPlan(std::int64_t k, std::int64_t n, bool trans, std::int64_t lda, std::int64_t ldc)
      : k_(k), n_(n), lda_(lda), ldc_(ldc), plain_(plain_weights(k, n, trans)) {
    auto probe = make_pd(
        row_bucket, md(dims{k, n}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::any));
    packed_desc_ = probe.weights_desc();
    blocked_ = force_packed() || !(packed_desc_ == plain_);
  }

  /// Whether the weights are reordered into a layout of oneDNN's (else used in place).
  bool blocked() const { return blocked_; }
  md const& plain_desc() const { return plain_; }
  md const& packed_desc() const { return packed_desc_; }

  /// The matmul of `rows` (a multiple of row_bucket, <= max_chunk_rows), made on first use.
  dnnl::matmul const& matmul(std::int64_t rows) {
    auto it = prims_.find(rows);
    if (it == prims_.end())
      it = prims_.emplace(rows, dnnl::matmul(make_pd(rows, packed_desc_))).first;
    return it->second;
  }
  md src_desc(std::int64_t rows) const {
    return md(dims{rows, k_}, dnnl::memory::data_type::f32, dims{lda_, 1});
  }
  md dst_desc(std::int64_t rows) const {
    return md(dims{rows, n_}, dnnl::memory::data_type::f32, dims{ldc_, 1});
  }

  /// Row-major [k,n] weights, or [n,k] used transposed (strides (1, k) as a [k,n] matrix).
  static md plain_weights(std::int64_t k, std::int64_t n, bool trans) {
    return md(dims{k, n}, dnnl::memory::data_type::f32, trans ? dims{1, k} : dims{n, 1});
  }

 private:
  dnnl::matmul::primitive_desc make_pd(std::int64_t rows, md const& weights) const {
#if DNNL_VERSION_MAJOR >= 3
    return dnnl::matmul::primitive_desc(engine(), src_desc(rows), weights, dst_desc(rows));
#else
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src_desc(rows), weights, dst_desc(rows)),
                                        engine());
#endif
  }

  std::int64_t k_, n_, lda_, ldc_;
  md plain_, packed_desc_;
  bool blocked_ = false;
  std::map<std::int64_t, dnnl::matmul> prims_;
};

/// The process-wide plans, one per (k, n, trans, lda, ldc): primitives are made once.
inline MatmulPlan& plan(std::int64_t k, std::int64_t n, bool trans, std::int64_t lda,
                        std::int64_t ldc) {
  using Key = std::tuple<std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t, bool>;
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<MatmulPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& p = plans[Key{k, n, trans, lda, ldc, force_packed()}];
  if (!p) p = std::make_unique<MatmulPlan>(k, n, trans, lda, ldc);
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
std::shared_ptr<PackedTensor> packed(MatmulPlan& p, Tensor const& rhs, bool trans,
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
  auto out = std::make_shared<PackedTensor>();
  std::int64_t const ld = rhs.stride(1);
  std::int64_t const kk = trans ? rhs.extent(2) : rhs.extent(1);
  std::int64_t const nn = trans ? rhs.extent(1) : rhs.extent(2);
  dnnl::memory::desc const user(dnnl::memory::dims{kk, nn}, dnnl::memory::data_type::f32,
                                trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1});
  dnnl::reorder::primitive_desc const rpd(engine(), user, engine(), p.packed_desc());
  dnnl::reorder const reorder(rpd);
  for (std::size_t g = 0; g < rhs.extent(0); ++g) {
    dnnl::memory src(user, engine(), const_cast<float*>(rhs.data() + g * rhs.stride(0)));
    dnnl::memory dst(p.packed_desc(), engine());
    reorder.execute(stream(), src, dst);
    out->experts.push_back(dst);
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
      dn::MatmulPlan& p = dn::plan(k, n, trans, lda, ldc);
      if (!p.blocked()) {
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
        blocked_gmm(p, lhs, rhs, groups, out, opt);
      }
    }
    if (!acc) zero_outside(space, out, begin, end);
    fence(space, "moe::gmm::gmm<OneDnn>: done");
  }

  /// Blocked layout: packed weights, chunks of <= 256 rows on bucketed matmuls. A chunk reads
  /// and writes lhs/out in place when its bucket fits inside them and the call does not
  /// accumulate; otherwise it goes through a small scratch (copy in, multiply, copy or add out).
  template <class E, class ML, class MR, class MO, class Mem>
  static void blocked_gmm(moe::detail::onednn::MatmulPlan& p, CMat<E, float, ML> const& lhs,
                          CTensor<E, float, MR> const& rhs, moe::gmm::Groups<Mem> const& groups,
                          Mat<E, float, MO> const& out, moe::gmm::GmmOptions const& opt) {
    namespace dn = moe::detail::onednn;
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), k = lhs.extent(1), n = out.extent(1);
    std::int64_t const lda = lhs.stride(0), ldc = out.stride(0);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    bool const acc = opt.accumulate;
    auto const pk = dn::packed(p, rhs, opt.transpose_rhs, opt);
    std::vector<float> src_scratch, dst_scratch;
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r1 = off(go + g + 1);
      for (std::int64_t c0 = off(go + g); c0 < r1; c0 += dn::max_chunk_rows) {
        std::int64_t const rows = std::min(dn::max_chunk_rows, r1 - c0);
        std::int64_t const b = (rows + dn::row_bucket - 1) / dn::row_bucket * dn::row_bucket;
        bool const direct = !acc && c0 + b <= m;
        float const* src = lhs.data() + c0 * lda;
        float* dst = out.data() + c0 * ldc;
        if (!direct) {
          src_scratch.assign(std::size_t(b * lda), 0.0f);
          dst_scratch.resize(std::size_t(b * ldc));
          for (std::int64_t r = 0; r < rows; ++r)
            std::memcpy(src_scratch.data() + r * lda, lhs.data() + (c0 + r) * lda,
                        sizeof(float) * std::size_t(k));
          src = src_scratch.data();
          dst = dst_scratch.data();
        }
        dnnl::memory s(p.src_desc(b), dn::engine(), const_cast<float*>(src));
        dnnl::memory d(p.dst_desc(b), dn::engine(), dst);
        p.matmul(b).execute(dn::stream(), {{DNNL_ARG_SRC, s},
                                           {DNNL_ARG_WEIGHTS, pk->experts[std::size_t(g)]},
                                           {DNNL_ARG_DST, d}});
        if (!direct) {
          dn::stream().wait();
          for (std::int64_t r = 0; r < rows; ++r) {
            float* o = out.data() + (c0 + r) * ldc;
            float const* v = dst_scratch.data() + r * ldc;
            if (acc)
              for (std::int64_t j = 0; j < n; ++j) o[j] += v[j];
            else
              std::memcpy(o, v, sizeof(float) * std::size_t(n));
          }
        }
      }
    }
    dn::stream().wait();
  }

  template <class E, class ML, class MD, class MO, class Mem>
  static void run_tgmm(E const& space, CMat<E, float, ML> const& lhs, CMat<E, float, MD> const& dy,
                       moe::gmm::Groups<Mem> const& groups, Tensor<E, float, MO> const& out,
                       moe::gmm::GmmOptions const& opt) {
    int const num_local = out.extent(0);
    std::int64_t const k = out.extent(1), n = out.extent(2);
    auto const& off = groups.offsets_host;
    if (k == 0 || n == 0) return;
    fence(space, "moe::gmm::tgmm<OneDnn>: operands ready");
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r0 = off(opt.group_offset + g), r1 = off(opt.group_offset + g + 1);
      float* c = out.data() + g * out.stride(0);
      if (r1 == r0) {
        if (!opt.accumulate)
          zero(space, Mat<E, float, MO>(Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL)),
               "moe::gmm::tgmm::zero_empty_group");
        continue;
      }
      moe::detail::onednn::sgemm('T', 'N', k, n, r1 - r0, 1.0f, lhs.data() + r0 * lhs.stride(0),
                                 lhs.stride(0), dy.data() + r0 * dy.stride(0), dy.stride(0),
                                 opt.accumulate ? 1.0f : 0.0f, c, out.stride(1));
    }
    fence(space, "moe::gmm::tgmm<OneDnn>: done");
  }
#endif
};

}  // namespace moe::detail::gmm_impl
