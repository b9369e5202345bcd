#pragma once
/// \file
/// gmm::OneDnn: grouped GEMM on the host through oneDNN, float only. Packed mode (a KernelPlan and
/// a PackCache): weights reordered once per version, groups run as row chunks. Plain mode: one
/// sgemm per group (few_rows for 2-3 rows). Packed chunks and tgmm calls run one per OpenMP thread.

#include <moe/detail/onednn.hpp>
#include <moe/gmm/backend/common.hpp>
#include <moe/gmm/backend/onednn_kernels.hpp>
#include <moe/gmm/backend/vendor.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::gmm {

/// \brief Policy: oneDNN on host execution spaces (float), Auto's choice there when moe has
/// oneDNN. Runs as Vendor on device spaces, for double, and without oneDNN.
struct OneDnn {};

template <>
struct is_policy<OneDnn> : std::true_type {};

template <>
struct handles_bf16<OneDnn> : std::integral_constant<bool, MOE_HAS_ONEDNN != 0> {};

template <>
struct rounds_rhs<OneDnn> : std::integral_constant<bool, MOE_HAS_ONEDNN != 0> {};

template <class ExecSpace, class Scalar>
struct is_available<OneDnn, ExecSpace, Scalar>
    : std::integral_constant<bool, MOE_HAS_ONEDNN && std::is_same<Scalar, float>::value &&
                                       moe::detail::runs_on_host<ExecSpace>()> {};

/// \brief What the process's oneDNN GEMMs did since it started (every thread, every layer).
struct OneDnnStats {
  std::string isa;                   ///< oneDNN's instruction set ("avx2", "avx512_core", ...)
  std::uint64_t primitives = 0;      ///< oneDNN primitives made (each once, then reused)
  std::uint64_t packed_tensors = 0;  ///< weight tensors reordered into a packed layout
  std::uint64_t rejected = 0;        ///< weight shapes and chunk sizes run plain: no direct kernel
  std::uint64_t reference_runs = 0;  ///< executions of a oneDNN reference implementation: 0
  /// Executions per implementation: oneDNN's names ("brg:avx512_core"), "sgemm", "few_rows".
  std::map<std::string, std::uint64_t> runs;
  std::vector<std::string> rejected_what;   ///< the latest refused descriptors (shape, impl)
  std::vector<std::string> reference_what;  ///< the latest reference executions (shape, impl)

  /// "avx512_core: brg:avx512_core 1200, sgemm 300; 9 primitives, 12 tensors packed, ...".
  std::string summary() const {
    std::string calls;
    for (auto const& [impl, n] : runs)
      if (n > 0) calls += (calls.empty() ? " " : ", ") + impl + " " + std::to_string(n);
    return isa + ":" + (calls.empty() ? " no calls" : calls) + "; " + std::to_string(primitives) +
           " primitives, " + std::to_string(packed_tensors) + " tensors packed, " +
           std::to_string(rejected) + " refused, " + std::to_string(reference_runs) +
           " reference runs";
  }
  /// Executions of bf16 kernels (counted under "<implementation> bf16").
  std::uint64_t bf16_runs() const {
    std::uint64_t n = 0;
    for (auto const& [impl, count] : runs)
      if (impl.size() > 5 && impl.compare(impl.size() - 5, 5, " bf16") == 0) n += count;
    return n;
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

namespace moe::gmm::detail {

#if MOE_HAS_ONEDNN
namespace dn = moe::detail::onednn;

/// f[r * ld + j] = float(x[r * ld + j]) for r < rows, j < cols (bf16 widened exactly).
template <class T>
void widen_rows(T const* x, std::int64_t ld, std::int64_t rows, std::int64_t cols, float* f) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) f[r * ld + j] = float(x[r * ld + j]);
}

template <>
struct sums_rows16<moe::gmm::OneDnn> : std::true_type {};

// bf16 row operands: the bf16 kernels take them as they are, the float paths widened copies.
template <>
struct Impl<moe::gmm::OneDnn> {
  template <class E, class TL, class TO, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, TL, ML> const& lhs, CTensor<E, float, MR> const& rhs,
                  Groups<Mem> const& groups, Mat<E, TO, MO> const& out, GmmOptions const& opt) {
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), k = lhs.extent(1), n = out.extent(1);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    std::int64_t const begin = off(go), end = off(go + num_local);
    bool const acc = opt.accumulate, trans = opt.transpose_rhs;
    fence(space, "moe::gmm::gmm<OneDnn>: operands ready");
    if (k == 0 && !acc) {
      zero_rows(space, out, begin, end, "moe::gmm::zero_rows");
    } else if (k > 0 && n > 0 && end > begin) {
      std::int64_t const lda = lhs.stride(0), ldc = out.stride(0), ldw = rhs.stride(1);
      if (dn::KernelPlan* const p = packed_plan(lhs, rhs, out, opt)) {
        packed_gmm(*p, lhs, rhs, groups, out, opt);
      } else if (opt.round_rhs) {
        // The plain layout reads rhs in place: it multiplies a rounded copy (packing nothing).
        GmmOptions inner = opt;
        inner.round_rhs = false;
        inner.pack_cache = nullptr;
        auto const rounded = moe::detail::rounded_copy(space, rhs);
        gmm(space, lhs, CTensor<E, float, MR>(rounded), groups, out, inner);
        fence(space, "moe::gmm::gmm<OneDnn>: rounded weights used");  // before they are freed
        return;
      } else if constexpr (is_bf16<TL> || is_bf16<TO>) {
        GmmOptions inner = opt;
        inner.bf16_output = opt.bf16_output && !is_bf16<TO>;  // narrowing rounds
        via_float<float, true>(space, lhs, out, [&](auto const& l, auto const& o) {
          gmm(space, CMat<E, float, typename E::memory_space>(l), rhs, groups,
              Mat<E, float, typename E::memory_space>(o), inner);
        });
        return;
      } else {
        // Plain layout: one sgemm per group, rows padded to the bucket as in Vendor.
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
        if (opt.bf16_output) round_rows(space, out, begin, end);
      }
    }
    if (!acc) zero_outside(space, out, begin, end);
    fence(space, "moe::gmm::gmm<OneDnn>: done");
  }

  /// The plan of the packed mode for lhs * rhs -> out, or nullptr (the plain mode). Packing pays
  /// only when the packed copy is kept (a cache, or a test forcing it). bf16 inputs take the bf16
  /// plan where the CPU has bf16 kernels, else the fp32 one.
  template <class E, class TL, class TO, class ML, class MR, class MO>
  static dn::KernelPlan* packed_plan(CMat<E, TL, ML> const& lhs, CTensor<E, float, MR> const& rhs,
                                     Mat<E, TO, MO> const& out, GmmOptions const& opt) {
    std::int64_t const k = lhs.extent(1), n = out.extent(1);
    std::int64_t const lda = lhs.stride(0), ldc = out.stride(0), ldw = rhs.stride(1);
    bool const trans = opt.transpose_rhs;
    bool const keep = opt.pack_cache || dn::forced().mode == dn::Forced::Mode::packed;
    bool const bf16 = keep && opt.bf16_inputs && dn::bf16_kernels();
    dn::KernelPlan* p = &dn::plan(k, n, trans, ldw, lda, ldc, bf16);
    if (bf16 && !p->packed()) p = &dn::plan(k, n, trans, ldw, lda, ldc);
    return keep && p->packed() ? p : nullptr;
  }

  /// The second product of gmm_sum's packed mode (lhs_b, rhs_b).
  template <class E, class TL, class ML, class MR>
  struct Second {
    CMat<E, TL, ML> lhs;
    CTensor<E, float, MR> rhs;
  };

  /// gmm::gmm_sum into 16-bit rows in the packed mode (the plan gmm would take is packed, and both
  /// products share it): each chunk's two products summed in a thread buffer, as gmm and then gmm
  /// with accumulate sum them into float rows, and narrowed. False (nothing done) elsewhere.
  template <class E, class TL, class ML, class MR, class MO, class Mem>
  static bool gmm_sum(E const& space, CMat<E, TL, ML> const& lhs_a,
                      CTensor<E, float, MR> const& rhs_a, CMat<E, TL, ML> const& lhs_b,
                      CTensor<E, float, MR> const& rhs_b, Groups<Mem> const& groups,
                      Mat<E, moe::bf16, MO> const& out, GmmOptions const& opt) {
    std::int64_t const k = lhs_a.extent(1), n = out.extent(1);
    auto const& off = groups.offsets_host;
    std::int64_t const begin = off(opt.group_offset),
                       end = off(opt.group_offset + int(rhs_a.extent(0)));
    if (k == 0 || n == 0 || end == begin || std::int64_t(lhs_b.extent(1)) != k ||
        lhs_b.stride(0) != lhs_a.stride(0) || rhs_b.stride(0) != rhs_a.stride(0) ||
        rhs_b.stride(1) != rhs_a.stride(1))
      return false;
    dn::KernelPlan* const p = packed_plan(lhs_a, rhs_a, out, opt);
    if (!p) return false;
    fence(space, "moe::gmm::gmm_sum<OneDnn>: operands ready");
    Second<E, TL, ML, MR> const second{lhs_b, rhs_b};
    packed_gmm(*p, lhs_a, rhs_a, groups, out, opt, &second);
    zero_outside(space, out, begin, end);
    fence(space, "moe::gmm::gmm_sum<OneDnn>: done");
    return true;
  }

  /// Packed layout: each group as row chunks (at most chunk_cap rows), run longest first, one per
  /// thread. A chunk run past its group writes to a thread buffer; one without a direct kernel runs
  /// as sgemm. bf16 rows are widened, float results narrowed per chunk where needed. With `second`
  /// (gmm_sum; a bf16 out, no accumulate) each chunk adds its second product to its first in
  /// thread buffer 3, with the kernels and arithmetic of two calls into float rows.
  template <class E, class TL, class TO, class ML, class MR, class MO, class Mem>
  static void packed_gmm(moe::detail::onednn::KernelPlan& p, CMat<E, TL, ML> const& lhs,
                         CTensor<E, float, MR> const& rhs, Groups<Mem> const& groups,
                         Mat<E, TO, MO> const& out, GmmOptions const& opt,
                         Second<E, TL, ML, MR> const* second = nullptr) {
    int const num_local = rhs.extent(0);
    std::int64_t const m = lhs.extent(0), k = lhs.extent(1), n = out.extent(1);
    std::int64_t const lda = lhs.stride(0), ldc = out.stride(0);
    bool const acc = opt.accumulate, trans = opt.transpose_rhs;
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    auto const pk = dn::packed(p, rhs, trans, opt);
    auto const pk_b = second ? dn::packed(p, second->rhs, trans, opt) : nullptr;
    struct Call {
      int g;
      std::int64_t c0;
      dn::Chunk chunk;
      dn::Kernel const* kernel;  // null: sgemm on the weights in place
      std::int64_t run_b;        // the second product's (gmm_sum)
      dn::Kernel const* kernel_b;
    };
    std::vector<Call> calls;
    bool const rounded = opt.bf16_output || is_bf16<TO>;
    bool const to_bf16 = !second && rounded && p.bf16();  // never with acc (check_gmm)
    std::int64_t const cap = dn::chunk_cap(off(go + num_local) - off(go), dn::max_threads());
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r1 = off(go + g + 1);
      for (std::int64_t c0 = off(go + g); c0 < r1;) {
        dn::Chunk c = dn::chunk_rows(r1 - c0, cap);
        dn::Kernel const* kernel = p.kernel(c.run, acc && c.run == c.rows, to_bf16);
        // The second product accumulates, as a second gmm call with accumulate would.
        dn::Kernel const* kernel_b = second ? p.kernel(c.run, c.run == c.rows) : nullptr;
        std::int64_t const run_b = kernel_b ? c.run : c.rows;
        if (!kernel) c.run = c.rows;
        calls.push_back({g, c0, c, kernel, run_b, kernel_b});
        c0 += c.rows;
      }
    }
    // A chunk with no kernel runs sgemm on the weights in place: with round_rhs, on one rounded
    // copy made before the chunks run.
    using Rounded = moe::detail::rounded_copy_t<CTensor<E, float, MR>>;
    auto weights = [&](CTensor<E, float, MR> const& r, Rounded& copy, bool needed) {
      if (!opt.round_rhs || !needed) return r;
      copy = moe::detail::rounded_copy(E(), r);
      fence(E(), "moe::gmm::gmm<OneDnn>: rounded weights made");
      return CTensor<E, float, MR>(copy);
    };
    Rounded rounded_a, rounded_b;
    CTensor<E, float, MR> const w =
        weights(rhs, rounded_a,
                std::any_of(calls.begin(), calls.end(), [](Call const& c) { return !c.kernel; }));
    CTensor<E, float, MR> const w_b =
        second ? weights(second->rhs, rounded_b,
                         std::any_of(calls.begin(), calls.end(),
                                     [](Call const& c) { return !c.kernel_b; }))
               : w;
    // Longest first: the threads take calls as they free up, so the last ones are short.
    std::stable_sort(calls.begin(), calls.end(),
                     [](Call const& a, Call const& b) { return a.chunk.run > b.chunk.run; });
    TO* const y = out.data();
    dn::for_each_item(std::int64_t(calls.size()), [&](std::int64_t i) {
      Call const& c = calls[std::size_t(i)];
      std::int64_t const rows = c.chunk.rows, run = c.chunk.run;
      // The chunk's rows of `from` as floats zero-padded to `count` rows: in place, or in thread
      // buffer 2.
      auto float_rows = [&](TL const* from, std::int64_t count) -> float const* {
        if constexpr (!is_bf16<TL>)
          if (c.c0 + count <= m) return from;
        float* const f = dn::thread_buffer(2, std::size_t(count * lda));
        widen_rows(from, lda, rows, k, f);
        std::fill(f + rows * lda, f + count * lda, 0.0f);
        return f;
      };
      // The kernel's source: the chunk's rows of `from` padded to `count` rows, as the plan takes
      // them (bf16 rows dense, row stride k: bf16 lhs rows in place where they are so).
      auto kernel_rows = [&](TL const* from, std::int64_t count) -> void const* {
        if (!p.bf16()) return float_rows(from, count);
        if constexpr (is_bf16<TL>)
          if (count == rows && lda == k) return from;
        auto* const b = dn::thread_buffer<std::uint16_t>(2, std::size_t(count * k));
        dn::bf16_rows(from, lda, rows, k, count, b, k);
        return b;
      };
      auto run_kernel = [&](dn::Kernel const& kernel, dn::PackedTensor const& packs,
                            void const* src, std::int64_t count, bool bf16_dst, void* dst) {
        kernel.run(
            {{DNNL_ARG_SRC, dnnl::memory(p.src_desc(count), dn::engine(), const_cast<void*>(src))},
             {DNNL_ARG_WEIGHTS, packs[std::size_t(c.g)]},
             {DNNL_ARG_DST, dnnl::memory(p.dst_desc(count, bf16_dst), dn::engine(), dst)}});
      };
      TL const* const in = lhs.data() + c.c0 * lda;
      if (second) {  // gmm_sum: both products into the chunk's float sum, then narrowed
        float* const sum = dn::thread_buffer(3, std::size_t(std::max(run, c.run_b) * ldc));
        if (c.kernel)
          run_kernel(*c.kernel, *pk, kernel_rows(in, run), run, false, sum);
        else
          dn::sgemm('N', trans ? 'T' : 'N', rows, n, k, 1.0f, float_rows(in, rows), lda,
                    w.data() + c.g * w.stride(0), w.stride(1), 0.0f, sum, ldc);
        TL const* const in_b = second->lhs.data() + c.c0 * lda;
        if (!c.kernel_b) {
          dn::sgemm('N', trans ? 'T' : 'N', rows, n, k, 1.0f, float_rows(in_b, rows), lda,
                    w_b.data() + c.g * w_b.stride(0), w_b.stride(1), 1.0f, sum, ldc);
        } else if (c.run_b == rows) {  // the accumulating kernel, on the sum
          run_kernel(*c.kernel_b, *pk_b, kernel_rows(in_b, rows), rows, false, sum);
        } else {  // past the group: into thread buffer 0, then added
          float* const part = dn::thread_buffer(0, std::size_t(c.run_b * ldc));
          run_kernel(*c.kernel_b, *pk_b, kernel_rows(in_b, c.run_b), c.run_b, false, part);
          for (std::int64_t r = 0; r < rows; ++r)
            for (std::int64_t j = 0; j < n; ++j) sum[r * ldc + j] += part[r * ldc + j];
        }
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t j = 0; j < n; ++j) y[(c.c0 + r) * ldc + j] = TO(sum[r * ldc + j]);
        return;
      }
      // Float results [rows, n] (row stride ldc) into out: added, copied or rounded.
      auto store = [&](float const* from) {
        for (std::int64_t r = 0; r < rows; ++r) {
          float const* f = from + r * ldc;
          TO* to = y + (c.c0 + r) * ldc;
          if constexpr (is_bf16<TO>) {
            for (std::int64_t j = 0; j < n; ++j) to[j] = moe::bf16(f[j]);
          } else if (rounded) {
            for (std::int64_t j = 0; j < n; ++j) to[j] = moe::detail::round_to_bf16(f[j]);
          } else if (to != f) {
            if (acc)
              for (std::int64_t j = 0; j < n; ++j) to[j] += f[j];
            else
              std::copy(f, f + n, to);
          }
        }
      };
      // Float results [run, ldc], or bf16 ones [run, n] from a bf16 kernel: into out's rows when
      // of its type and inside it, else into the thread's buffer 0.
      bool const float_out = !to_bf16 || !c.kernel;
      bool const in_place = run == rows && (float_out ? !is_bf16<TO> : (is_bf16<TO> && ldc == n));
      void* const dst = in_place ? static_cast<void*>(y + c.c0 * ldc)
                        : float_out
                            ? static_cast<void*>(dn::thread_buffer(0, std::size_t(run * ldc)))
                            : dn::thread_buffer<std::uint16_t>(0, std::size_t(run * n));
      if (!c.kernel) {
        dn::sgemm('N', trans ? 'T' : 'N', rows, n, k, 1.0f, float_rows(in, rows), lda,
                  w.data() + c.g * w.stride(0), w.stride(1), acc && !is_bf16<TO> ? 1.0f : 0.0f,
                  static_cast<float*>(dst), ldc);
        return store(static_cast<float const*>(dst));
      }
      run_kernel(*c.kernel, *pk, kernel_rows(in, run), run, to_bf16, dst);
      if (float_out) return store(static_cast<float const*>(dst));
      auto const* const b = static_cast<std::uint16_t const*>(dst);
      if (!in_place)
        for (std::int64_t r = 0; r < rows; ++r) {
          if constexpr (is_bf16<TO>)
            std::copy(b + r * n, b + (r + 1) * n,
                      reinterpret_cast<std::uint16_t*>(y + (c.c0 + r) * ldc));
          else
            dn::widen_bf16_streaming(b + r * n, n, y + (c.c0 + r) * ldc);
        }
    });
  }

  /// bf16 inputs on bf16 kernels: a bf16_gemm per group on all threads (rows padded to a multiple
  /// of tgmm_bf16_rows). Else one single-threaded sgemm per (group, column block), a large group
  /// split into 16-column multiples so no thread idles; 16-bit operands widened first into one
  /// buffer of the calling thread, kept from call to call (float copies made per call took fresh
  /// pages every call).
  template <class E, class TL, class TD, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, TL, ML> const& lhs, CMat<E, TD, MD> const& dy,
                   Groups<Mem> const& groups, Tensor<E, float, MO> const& out,
                   GmmOptions const& opt) {
    int const num_local = out.extent(0);
    std::int64_t const k = out.extent(1), n = out.extent(2);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    if (k == 0 || n == 0) return;
    fence(space, "moe::gmm::tgmm<OneDnn>: operands ready");
    std::int64_t const total = off(go + num_local) - off(go);
    int const threads = dn::max_threads();
    std::int64_t const share = std::max<std::int64_t>(1, total / (2 * threads));
    std::int64_t const lda = lhs.stride(0), ldd = dy.stride(0), ldo = out.stride(1);
    struct Call {
      int g;
      std::int64_t n0, n1;
    };
    std::vector<Call> calls;
    for (int g = 0; g < num_local; ++g) {
      std::int64_t const r0 = off(go + g), rows = off(go + g + 1) - r0;
      float* const o = out.data() + g * out.stride(0);
      if (rows == 0) {
        if (!opt.accumulate)
          zero(space, Mat<E, float, MO>(Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL)),
               "moe::gmm::tgmm::zero_empty_group");
        continue;
      }
      std::int64_t const padded =
          (rows + dn::tgmm_bf16_rows - 1) / dn::tgmm_bf16_rows * dn::tgmm_bf16_rows;
      if (opt.bf16_inputs &&
          dn::bf16_gemm('T', 'N', k, n, rows, lhs.data() + r0 * lda, lda, dy.data() + r0 * ldd, ldd,
                        opt.accumulate, o, ldo, padded))
        continue;
      std::int64_t const blocks =
          threads == 1 ? 1
                       : std::max<std::int64_t>(
                             1, std::min((rows + share - 1) / share, n / dn::tgmm_min_columns));
      for (std::int64_t b = 0; b < blocks; ++b)
        calls.push_back(
            {g, n * b / blocks / 16 * 16, b + 1 == blocks ? n : n * (b + 1) / blocks / 16 * 16});
    }
    fence(space, "moe::gmm::tgmm<OneDnn>: empty groups zeroed");
    // The rows the calls read as floats: 16-bit operands widened (all threads) into one buffer
    // of the calling thread, lhs then dy, kept from call to call (the memory estimate's "GEMM
    // operand copies"); float ones in place. Row r of lhs at a0 + (r - begin) * la, of dy at
    // d0 + (r - begin) * ld.
    std::int64_t const begin = off(go), visited = off(go + num_local) - begin;
    float const* a0 = nullptr;
    float const* d0 = nullptr;
    std::int64_t la = lda, ld = ldd;
    if constexpr (!is_bf16<TL>) a0 = lhs.data() + begin * lda;
    if constexpr (!is_bf16<TD>) d0 = dy.data() + begin * ldd;
    if constexpr (is_bf16<TL> || is_bf16<TD>) {
      if (!calls.empty()) {
        float* const f = dn::thread_buffer(
            2, std::size_t(visited * ((is_bf16<TL> ? k : 0) + (is_bf16<TD> ? n : 0))));
        using Buffer = Mat<E, float, Kokkos::HostSpace>;
        auto const rows = std::make_pair(begin, begin + visited);
        float* next = f;
        if constexpr (is_bf16<TL>) {
          convert_into(space, Kokkos::subview(lhs, rows, Kokkos::ALL), Buffer(next, visited, k),
                       "moe::gmm::widen");
          a0 = next, la = k, next += visited * k;
        }
        if constexpr (is_bf16<TD>) {
          convert_into(space, Kokkos::subview(dy, rows, Kokkos::ALL), Buffer(next, visited, n),
                       "moe::gmm::widen");
          d0 = next, ld = n;
        }
        fence(space, "moe::gmm::tgmm<OneDnn>: float copies made");
      }
    }
    dn::for_each_item(std::int64_t(calls.size()), [&](std::int64_t i) {
      Call const& c = calls[std::size_t(i)];
      std::int64_t const r0 = off(go + c.g) - begin, rows = off(go + c.g + 1) - off(go + c.g);
      dn::sgemm('T', 'N', k, c.n1 - c.n0, rows, 1.0f, a0 + r0 * la, la, d0 + r0 * ld + c.n0, ld,
                opt.accumulate ? 1.0f : 0.0f, out.data() + c.g * out.stride(0) + c.n0, ldo);
    });
    fence(space, "moe::gmm::tgmm<OneDnn>: done");
  }
};
#else
// Without oneDNN the tag runs as Vendor (so code naming Impl<OneDnn> still compiles).
template <>
struct Impl<moe::gmm::OneDnn> : Impl<moe::gmm::Vendor> {};
#endif

}  // namespace moe::gmm::detail
