#pragma once
/// \file
/// The kernels behind gmm::OneDnn: row chunking, few_rows, descriptors, KernelPlan and packing.

#include <moe/detail/hash.hpp>
#include <moe/detail/onednn.hpp>
#include <moe/gmm/backend/common.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#if MOE_HAS_ONEDNN

namespace moe::detail::onednn {

/// Largest row chunk of one packed call.
inline constexpr std::int64_t max_chunk_rows = 256;
/// Rows chunk_cap() rounds a thread's share to, and the plain mode pads a group's rows to.
inline constexpr std::int64_t row_bucket = 16;
/// Narrowest column block a tgmm call is split into.
inline constexpr std::int64_t tgmm_min_columns = 128;

/// The primitive families a packed kernel can come from, in the order they are tried.
enum class Family { matmul, conv };

inline char const* family_name(Family f) { return f == Family::matmul ? "matmul" : "conv1x1"; }

/// Row-major [rows, cols] (row stride ld) as a matrix, or an image (N=1, C=cols, H=rows, W=1).
inline dnnl::memory::desc rows_desc(Family f, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                    DataType dt = DataType::f32) {
  if (f == Family::matmul) return matrix_desc(rows, cols, ld, dt);
  return dnnl::memory::desc(dnnl::memory::dims{1, cols, rows, 1}, dt,
                            dnnl::memory::dims{rows * ld, 1, ld, ld});
}

/// The family's descriptor of out[rows, n] (+)= x[rows, k] * W under kernel_attr (x of w's type;
/// out float, or bf16 with `bf16_out`), oneDNN 2.x and 3.x; throws dnnl::error when it has none.
inline dnnl::primitive_desc kernel_pd(Family f, std::int64_t rows, std::int64_t k, std::int64_t n,
                                      std::int64_t lda, std::int64_t ldc,
                                      dnnl::memory::desc const& w, bool accumulate,
                                      bool bf16_out = false) {
  auto const attr = kernel_attr(accumulate);
  auto const src = rows_desc(f, rows, k, lda, w.data_type());
  auto const dst = rows_desc(f, rows, n, ldc, bf16_out ? DataType::bf16 : DataType::f32);
  dnnl::memory::dims const unit{1, 1}, none{0, 0};
  auto const prop = dnnl::prop_kind::forward_inference;
  auto const direct = dnnl::algorithm::convolution_direct;
  if (f == Family::matmul) return matmul_pd(src, w, dst, attr);
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::convolution_forward::primitive_desc(engine(), prop, direct, src, w, dst, unit, none,
                                                   none, attr);
#else
  return dnnl::convolution_forward::primitive_desc(
      dnnl::convolution_forward::desc(prop, direct, src, w, dst, unit, none, none), attr, engine());
#endif
}

/// Test hooks: plain never packs; packed packs without a PackCache (the first allowed family
/// unchecked if none passes); `family` limits the families tried; `layout` forces a layout.
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

/// One packed call: `rows` rows of a group computed over `run` >= rows rows (via a thread buffer).
struct Chunk {
  std::int64_t rows, run;
};

/// Smallest chunk_cap(): below it, reading an expert's weights costs as much as the multiply.
inline constexpr std::int64_t min_chunk_cap = 32;

/// Rows per packed call for `total` rows on `threads` threads: max_chunk_rows, lowered to a
/// thread's share (rounded up to row_bucket, at least min_chunk_cap).
inline std::int64_t chunk_cap(std::int64_t total, int threads) {
  if (threads <= 1) return max_chunk_rows;
  std::int64_t const share = (total + threads - 1) / threads;
  std::int64_t const up = (share + row_bucket - 1) / row_bucket * row_bucket;
  return std::clamp(up, min_chunk_cap, max_chunk_rows);
}

/// Packed calls run a multiple of run_multiple rows (fewer rows as they are).
inline constexpr std::int64_t run_multiple = 4;

/// The next call when `left` rows of the group remain: at most `cap` rows, run over the next
/// multiple of run_multiple (the caller supplies the rows past the group).
inline Chunk chunk_rows(std::int64_t left, std::int64_t cap = max_chunk_rows) {
  std::int64_t const rows = std::min(left, cap);
  if (rows < run_multiple) return {rows, rows};
  return {rows, (rows + run_multiple - 1) / run_multiple * run_multiple};
}

/// Groups of 2 to few_rows_max rows run on few_rows() in the plain mode (sgemm packs per call).
inline constexpr std::int64_t few_rows_max = 3;

/// acc[r, :] += sum_{c in [c0,c1)} x[r, c] * W[c, :] for the R rows (W read once, in order).
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

/// out[r, :] (+)= sum_c x[r, c] * W[c, :] for r < rows <= few_rows_max, W [k,n] (row stride
/// ldw): each thread sums a range of W's rows, the partial sums added in thread order.
inline void few_rows(std::int64_t rows, std::int64_t k, std::int64_t n, float const* x,
                     std::int64_t ldx, float const* w, std::int64_t ldw, float* out,
                     std::int64_t ldo, bool accumulate) {
  moe::detail::require(rows >= 2 && rows <= few_rows_max, "moe internal error: few_rows on ", rows,
                       " rows (2 to ", few_rows_max, ")");
  static std::atomic<std::uint64_t>& runs = run_counter("few_rows");
  ++runs;
  // Below ~1 MB of weights a thread team costs more than it saves.
  int const threads = k * n < (std::int64_t(1) << 18) ? 1 : max_threads();
  // The team reaches it through `sums` (in the region a thread_local is each thread's own).
  static thread_local std::vector<float> partial;
  partial.assign(std::size_t(threads) * std::size_t(rows * n), 0.0f);
  float* const sums = partial.data();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static, 1) num_threads(threads)
#endif
  for (int t = 0; t < threads; ++t) {
    std::int64_t const c0 = k * t / threads, c1 = k * (t + 1) / threads;
    float* acc = sums + std::size_t(t) * std::size_t(rows * n);
    (rows == 2 ? few_rows_part<2> : few_rows_part<3>)(c0, c1, n, x, ldx, w, ldw, acc);
  }
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

/// The weights of out = x * W in the family's terms (matmul [k, n]; conv O=n, I=k): W row-major
/// [k, n] (row stride ld), or (trans) [n, k] used transposed.
inline dnnl::memory::desc weights_desc(Family f, std::int64_t k, std::int64_t n, bool trans,
                                       std::int64_t ld) {
  using dims = dnnl::memory::dims;
  if (f == Family::matmul)
    return dnnl::memory::desc(dims{k, n}, DataType::f32, trans ? dims{1, ld} : dims{ld, 1});
  return dnnl::memory::desc(dims{n, k, 1, 1}, DataType::f32,
                            trans ? dims{ld, 1, 1, 1} : dims{1, ld, 1, 1});
}

/// The family's weights [k, n] of type dt in a format tag (format_tag::any: oneDNN's choice).
inline dnnl::memory::desc tagged_weights(Family f, std::int64_t k, std::int64_t n,
                                         dnnl::memory::format_tag tag,
                                         DataType dt = DataType::f32) {
  using dims = dnnl::memory::dims;
  return dnnl::memory::desc(f == Family::matmul ? dims{k, n} : dims{n, k, 1, 1}, dt, tag);
}

/// use(kernel_pd(...)): the descriptor handed to a callback.
template <class Use>
auto with_pd(Family f, std::int64_t rows, std::int64_t k, std::int64_t n, std::int64_t lda,
             std::int64_t ldc, dnnl::memory::desc const& w, bool accumulate, Use&& use,
             bool bf16_out = false) {
  return use(kernel_pd(f, rows, k, n, lda, ldc, w, accumulate, bf16_out));
}

/// "matmul 256x1024x2816 +=" (rows x k x n; "+=" with the sum post-op; " bf16" for bf16 inputs).
inline std::string kernel_what(Family f, std::int64_t rows, std::int64_t k, std::int64_t n,
                               bool accumulate, bool bf16 = false) {
  return std::string(family_name(f)) + " " + std::to_string(rows) + "x" + std::to_string(k) + "x" +
         std::to_string(n) + (accumulate ? " +=" : "") + (bf16 ? " bf16" : "");
}

/// \brief How one weight shape runs: packed (a family, its weight layout, the reorder that packs
/// an expert, a checked kernel per chunk size) or plain. A bf16 plan takes dense bf16 rows and
/// weights packed as bf16 (fp32 accumulation), only where bf16_kernels().
class KernelPlan {
 public:
  /// Weights row-major [k, n] (or [n, k] with trans), row stride ldw; lda/ldc: of lhs and out.
  KernelPlan(std::int64_t k, std::int64_t n, bool trans, std::int64_t ldw, std::int64_t lda,
             std::int64_t ldc, bool bf16 = false)
      : k_(k), n_(n), lda_(bf16 ? k : lda), ldc_(ldc), bf16_(bf16) {
    Forced const f = forced();
    if (f.mode == Forced::Mode::plain || (bf16 && !bf16_kernels())) return;
    ScopedThreads one(1);
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
  /// Whether the kernels take bf16 rows and weights packed as bf16.
  bool bf16() const { return bf16_; }
  Family family() const { return family_; }
  dnnl::memory::desc const& packed_desc() const { return packed_desc_; }
  /// The reorder of one expert's weights into packed_desc() (packed() only).
  Kernel const& packer() const { return *packer_; }

  /// The kernel over `rows` rows, made on first use (not in a parallel region); nullptr without a
  /// direct kernel. `bf16_out` (bf16 plans): it writes dense bf16 rows [rows, n].
  Kernel const* kernel(std::int64_t rows, bool accumulate, bool bf16_out = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, fresh] = kernels_.try_emplace({rows, accumulate, bf16_out});
    if (fresh) {
      ScopedThreads one(1);
      std::string const what =
          kernel_what(family_, rows, k_, n_, accumulate, bf16_) + (bf16_out ? " to bf16" : "");
      try {
        auto const pd = kernel_pd(family_, rows, k_, n_, lda_, bf16_out ? n_ : ldc_, packed_desc_,
                                  accumulate, bf16_out);
        if (direct_kernel(pd.impl_info_str()))
          it->second = std::make_unique<Kernel>(pd, what, bf16_ ? " bf16" : "");
        else
          note_rejected(what, pd.impl_info_str());
      } catch (dnnl::error const& e) {
        note_rejected(what, std::string("no implementation: ") + e.what());
      }
    }
    return it->second.get();
  }

  dnnl::memory::desc src_desc(std::int64_t rows) const {
    return rows_desc(family_, rows, k_, lda_, data_type());
  }
  dnnl::memory::desc dst_desc(std::int64_t rows, bool bf16_out = false) const {
    return rows_desc(family_, rows, n_, bf16_out ? n_ : ldc_,
                     bf16_out ? DataType::bf16 : DataType::f32);
  }

 private:
  /// Takes `fam` with its first packed layout that has a direct kernel at max_chunk_rows (any,
  /// unless `checked`) and a non-reference reorder; else appends why not to `refused`.
  bool choose(Family fam, bool trans, std::int64_t ldw, Forced const& f, bool checked,
              std::string& refused) {
    auto refuse = [&](std::string const& why) {
      refused += (refused.empty() ? "" : "; ") + std::string(family_name(fam)) + ": " + why;
    };
    for (auto const tag : packed_layouts(fam, f, bf16_)) {
      try {
        auto const pd = kernel_pd(fam, max_chunk_rows, k_, n_, lda_, ldc_,
                                  tagged_weights(fam, k_, n_, tag, data_type()), false);
        std::string const impl = pd.impl_info_str();
        if (checked && !direct_kernel(impl)) {
          refuse(impl);
          continue;
        }
        dnnl::reorder::primitive_desc const rpd(engine(), weights_desc(fam, k_, n_, trans, ldw),
                                                engine(), pd.weights_desc(), kernel_attr(false));
        if (!reference_impl(rpd.impl_info_str())) {
          packer_ = std::make_unique<Kernel>(rpd, std::string("pack ") + std::to_string(k_) + "x" +
                                                      std::to_string(n_) + " weights" +
                                                      (bf16_ ? " as bf16" : ""));
          family_ = fam;
          packed_desc_ = pd.weights_desc();
          return true;
        }
        refuse(std::string("packing reorder ") + rpd.impl_info_str());
      } catch (dnnl::error const& e) {
        refuse(std::string("no implementation (") + e.what() + ")");
      }
    }
    return false;
  }

  /// The weight layouts to try, best first: the forced one; for fp32 matmul 48-column blocks
  /// (faster than oneDNN's 64 on few rows), then oneDNN's choice.
  static std::vector<dnnl::memory::format_tag> packed_layouts(Family fam, Forced const& f,
                                                              bool bf16) {
    using tag = dnnl::memory::format_tag;
    if (f.layout != tag::undef) return {f.layout};
    if (fam == Family::matmul && !bf16) return {tag::BA16a48b, tag::any};
    return {tag::any};
  }
  DataType data_type() const { return bf16_ ? DataType::bf16 : DataType::f32; }
  std::int64_t k_, n_, lda_, ldc_;
  bool bf16_ = false;
  Family family_ = Family::matmul;
  dnnl::memory::desc packed_desc_;
  std::unique_ptr<Kernel> packer_;
  std::mutex mutex_;
  std::map<std::tuple<std::int64_t, bool, bool>, std::unique_ptr<Kernel>> kernels_;
};

/// The process-wide plan of a weight shape and storage (and test hooks); bf16: for bf16 inputs.
inline KernelPlan& plan(std::int64_t k, std::int64_t n, bool trans, std::int64_t ldw,
                        std::int64_t lda, std::int64_t ldc, bool bf16 = false) {
  using Key = std::tuple<std::int64_t, std::int64_t, bool, std::int64_t, std::int64_t, std::int64_t,
                         bool, decltype(forced().key())>;
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<KernelPlan>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto& p = plans[Key{k, n, trans, ldw, bf16 ? k : lda, ldc, bf16, forced().key()}];
  if (!p) p = std::make_unique<KernelPlan>(k, n, trans, ldw, lda, ldc, bf16);
  return *p;
}

/// tgmm with bf16 inputs pads each group's rows to a multiple of this (few kernels as sizes vary).
inline constexpr std::int64_t tgmm_bf16_rows = 32;

/// Every expert of one rhs tensor in the plan's packed layout.
using PackedTensor = std::vector<dnnl::memory>;

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

/// The packed copy of rhs for `p`: the cache's if it holds this version, else reordered (cached).
/// Its values are rounded to bf16 in a bf16 plan (the reorder rounds to nearest even, reading float
/// subnormals as zero) and, with opt.round_rhs, in an fp32 plan (rounded in place after it).
template <class Tensor>
std::shared_ptr<PackedTensor> packed(KernelPlan& p, Tensor const& rhs, bool trans,
                                     moe::gmm::GmmOptions const& opt) {
  std::int64_t const e0 = rhs.extent(0), e1 = rhs.extent(1), e2 = rhs.extent(2);
  bool const round_fp32 = opt.round_rhs && !p.bf16();
  moe::gmm::PackCache::Key const key{
      rhs.data(), e0, e1, e2, p.bf16() ? 2 : int(sizeof(float)), trans, p.bf16() || opt.round_rhs};
  std::uint64_t const samples = opt.pack_cache ? sample_hash(rhs) : 0;
  if (opt.pack_cache)
    if (auto hit = opt.pack_cache->find(key, opt.rhs_version, samples))
      return std::static_pointer_cast<PackedTensor>(hit);
  // A new version is written into the old copy's storage (fresh pages cost more than the reorder).
  std::shared_ptr<PackedTensor> out;
  if (opt.pack_cache) out = std::static_pointer_cast<PackedTensor>(opt.pack_cache->previous(key));
  if (!out || out->size() != rhs.extent(0) ||
      (!out->empty() && !(out->front().get_desc() == p.packed_desc())))
    out = std::make_shared<PackedTensor>();
  dnnl::memory::desc const user =
      weights_desc(p.family(), trans ? e2 : e1, trans ? e1 : e2, trans, rhs.stride(1));
  bool const fresh = out->empty();
  for (std::size_t g = 0; g < rhs.extent(0); ++g) {
    dnnl::memory src(user, engine(), const_cast<float*>(rhs.data() + g * rhs.stride(0)));
    if (fresh) out->emplace_back(p.packed_desc(), engine());
    p.packer().run({{DNNL_ARG_FROM, src}, {DNNL_ARG_TO, (*out)[g]}});
  }
  if (round_fp32)  // an fp32 layout holds floats only (padding zeros stay zeros)
    for_each_item(e0, [&](std::int64_t g) {
      auto* const v = static_cast<float*>((*out)[std::size_t(g)].get_data_handle());
      std::size_t const count = p.packed_desc().get_size() / sizeof(float);
      for (std::size_t i = 0; i < count; ++i) v[i] = moe::detail::round_to_bf16(v[i]);
    });
  ++counters().packed_tensors;
  if (opt.pack_cache)
    opt.pack_cache->put(key, opt.rhs_version, samples, out,
                        p.packed_desc().get_size() * rhs.extent(0));
  return out;
}

}  // namespace moe::detail::onednn

#endif  // MOE_HAS_ONEDNN
