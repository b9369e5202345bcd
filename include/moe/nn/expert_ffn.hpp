#pragma once
/// \file
/// The routed experts' gated FFN on rows grouped by expert (three grouped GEMMs and the activation,
/// forward and backward), the shared expert's dense MLP and the dense masked path.

#include <moe/config.hpp>
#include <moe/detail/blas.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/rows.hpp>
#include <moe/detail/views.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/nn/activation.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

namespace moe::nn {

/// The hidden states of a gated FFN on n rows of width F (h0 = x.w0, h1 = x.w1, act = act(h0) *
/// h1), allocated once and reused while the shapes stay; labelled `owner`::h0, ::h1, ::act.
template <class ExecSpace, class V>
void ensure_gated(ExecSpace const& space, std::string const& owner, std::int64_t n, std::int64_t F,
                  V& h0, V& h1, V& act) {
  moe::detail::ensure(space, h0, owner + "::h0", n, F);
  moe::detail::ensure(space, h1, owner + "::h1", n, F);
  moe::detail::ensure(space, act, owner + "::act", n, F);
}

/// \brief Whether the FFNs round their activations to bf16 (LayerConfig::bf16(), docs/precision.md;
/// weight gradients stay fp32): the activations and GEMMs take bf16 inputs and outputs.
struct Bf16Rounding {
  bool bf16 = false;
  /// With bf16, the dense GEMMs (DenseMlp, DenseExperts) are handed fp32 master weights and take
  /// them rounded (moe::detail::gemm's round_b): at no cost where dense_gemms_round_weights, else
  /// through a rounded copy per call. False: the weights passed hold bf16 values already.
  bool round_weights = false;
  /// Rounds each view to bf16 when bf16 (moe::bf16 views hold bf16 values already).
  template <class ExecSpace, class... V>
  void round(ExecSpace const& space, V const&... v) const {
    auto one = [&](auto const& x) {
      if constexpr (!moe::detail::is_bf16<typename std::decay_t<decltype(x)>::value_type>)
        moe::detail::round_bf16_if(bf16, space, x);
    };
    (one(v), ...);
  }
};

/// \brief Whether a bf16 step's dense GEMMs (moe::detail::gemm with bf16 inputs: the shared
/// expert's and the dense masked path's) on ExecSpace round fp32 weights themselves at no cost:
/// oneDNN's bf16 kernels, which copy B rounded on every call anyway, where this CPU runs them
/// (onednn::bf16_kernels()). Elsewhere they would multiply a rounded copy made per call, so the
/// layer keeps a rounded copy of those weights (distributed::keeps_rounded_copy).
template <class Scalar, class ExecSpace>
bool dense_gemms_round_weights() {
#if MOE_HAS_ONEDNN
  if constexpr (std::is_same<Scalar, float>::value && moe::detail::runs_on_host<ExecSpace>())
    return moe::detail::onednn::bf16_kernels();
#endif
  return false;
}

/// Whether a bf16 step of a Scalar layer stores its hidden states as moe::bf16 (half the bytes,
/// the same values): float layers whose GEMM policy Gmm takes 16-bit rows itself on ExecSpace
/// (gmm::handles_bf16: oneDNN on the host). Elsewhere they stay Scalars holding bf16 values.
template <class Scalar, class Gmm, class ExecSpace>
inline constexpr bool stores_bf16 =
    (std::is_same<Scalar, float>::value &&
     gmm::handles_bf16<gmm::resolve_t<Gmm, ExecSpace, Scalar>>::value);

/// \brief The hidden states of a gated FFN step: h0, h1, act (kept from forward to backward) and
/// the backward's d_act, d_h1, as Scalars or, in a bf16 step where CanNarrow (stores_bf16), as
/// moe::bf16 (the same values); each FFN class uses the ones it needs.
template <class Scalar, class Mem, bool CanNarrow>
struct HiddenStates {
  View2<Scalar, Mem> h0, h1, act, d_act, d_h1;
  View2<moe::bf16, Mem> b0, b1, b_act, b_d_act, b_d_h1;  // the same in bf16 (narrow)
  bool narrow = false;

  /// Chooses a step's storage (bf16 when `bf16` and CanNarrow) and frees the other.
  void choose(bool bf16) {
    narrow = CanNarrow && bf16;
    if (narrow)
      h0 = h1 = act = d_act = d_h1 = View2<Scalar, Mem>();
    else
      b0 = b1 = b_act = b_d_act = b_d_h1 = View2<moe::bf16, Mem>();
  }
  /// body(h0, h1, act, d_act, d_h1) on the storage chosen.
  template <class Body>
  void visit(Body&& body) {
    if constexpr (CanNarrow)
      if (narrow) return body(b0, b1, b_act, b_d_act, b_d_h1);
    body(h0, h1, act, d_act, d_h1);
  }
};

/// \brief ys = (act(xs . wi_0[g]) * (xs . wi_1[g])) . wo[g] per group g; keeps what backward needs.
/// Owns its weights' PackCache: callers pass a version that changes whenever the weights change.
/// With bf16 the weights must hold bf16 values, except where rounds_weights (oneDNN, which rounds
/// as it packs: GmmOptions::round_rhs): there the caller may pass fp32 masters as they are.
/// With bf16 where stores_bf16, the hidden states (h0, h1, act, d_act, d_h1) are moe::bf16;
/// elsewhere, and in the chunked forward (summing h0 and h1 over D-chunks), Scalars. The routed
/// rows (xs, ys, dys) are Scalars or, where stores_bf16, moe::bf16 (the caller's choice).
/// \tparam Gmm a grouped-GEMM policy (gmm::Auto, OneDnn, Vendor, Tiled<...>).
template <class Scalar, class Gmm, class ExecSpace>
class ExpertFfn : public Bf16Rounding {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using groups_type = gmm::Groups<memory_space>;
  using bview2 = View2<moe::bf16, memory_space>;

  /// xs [n,D] (kept until backward), weights [G,D,F] / [G,F,D] whose contents have version
  /// `weights_version`, ys [n,D] (rows past the groups are zeroed). xs and ys are view2 or, where
  /// stores_bf16 and bf16, bview2.
  template <class XS, class YS>
  void forward(ExecSpace const& space, Activation act, XS const& xs, groups_type const& groups,
               view3 wi_0, view3 wi_1, view3 wo, YS const& ys, std::uint64_t weights_version) {
    moe::detail::Region region("moe::expert_ffn");
    std::int64_t const n = xs.extent(0), F = wi_0.extent(2);
    start(xs, act, weights_version, bf16);
    gmm::GmmOptions const fw = options(false, false, true);
    hs_.visit([&](auto& h0, auto& h1, auto& a, auto&, auto&) {
      ensure_gated(space, "moe::ffn", n, F, h0, h1, a);
      gmm::gmm(space, Gmm{}, xs, wi_0, groups, h0, fw);
      gmm::gmm(space, Gmm{}, xs, wi_1, groups, h1, fw);
      gated_forward(space, act, n, h0, h1, a, bf16);
      gmm::gmm(space, Gmm{}, a, wo, groups, ys, fw);
    });
  }

  /// \brief forward() with the first two GEMMs summed over D-chunks of xs [n,D] (kept for backward,
  /// all written by forward_end()): forward_begin(), forward_chunk() for every chunk and group (any
  /// order), then forward_end(); equal to forward() up to the order of the sums.
  void forward_begin(ExecSpace const& space, Activation act, view2 xs, std::int64_t F,
                     std::uint64_t weights_version) {
    start(xs, act, weights_version, false);
    ensure_gated(space, "moe::ffn", xs.extent(0), F, hs_.h0, hs_.h1, hs_.act);
    Kokkos::deep_copy(space, hs_.h0, Scalar(0));
    Kokkos::deep_copy(space, hs_.h1, Scalar(0));
  }
  /// h0 += xs_c . wi_0_c[g], h1 += xs_c . wi_1_c[g] for the groups [g0, g0 + G) of the [G, Dc, F]
  /// blocks (one D-chunk of each expert's weights); xs_c [n, Dc] is that chunk of xs's columns.
  void forward_chunk(ExecSpace const& space, view2 xs_c, groups_type const& groups, view3 wi_0_c,
                     view3 wi_1_c, int g0) {
    moe::detail::Region region("moe::expert_ffn::chunk");
    gmm::GmmOptions o = options(false, true);
    o.group_offset = g0;
    gmm::gmm(space, Gmm{}, xs_c, wi_0_c, groups, hs_.h0, o);
    gmm::gmm(space, Gmm{}, xs_c, wi_1_c, groups, hs_.h1, o);
  }
  /// The activation and the down projection of a chunked forward: ys [n,D].
  void forward_end(ExecSpace const& space, groups_type const& groups, view3 wo, view2 ys) {
    moe::detail::Region region("moe::expert_ffn");
    gated_forward(space, act_, xs_.rows(), cview2(hs_.h0), cview2(hs_.h1), hs_.act, bf16);
    gmm::gmm(space, Gmm{}, hs_.act, wo, groups, ys, options(false, false, true));
  }

  /// From dys [n,D] (view2, or bview2 as forward's rows): dxs [n,D] (view2, or bview2 where
  /// stores_bf16: its two GEMMs are summed in fp32 and rounded once, gmm::gmm_sum; may alias dys)
  /// and the weight gradients (overwritten). The weights must be the forward's (same version).
  template <class DYS, class DXS>
  void backward(ExecSpace const& space, DYS const& dys, groups_type const& groups, view3 wi_0,
                view3 wi_1, view3 wo, DXS const& dxs, view3 d_wi_0, view3 d_wi_1, view3 d_wo) {
    moe::detail::Region region("moe::expert_ffn::backward");
    std::int64_t const n = dxs.extent(0), F = wi_0.extent(2);
    round(space, dys);  // the expert outputs' gradient (w * dy from the combine) is bf16
    xs_.visit([&](auto const& xs) {
      hs_.visit([&](auto& h0, auto& h1, auto& a, auto& da, auto& dh1) {
        moe::detail::ensure(space, da, "moe::ffn::d_act", n, F);
        moe::detail::ensure(space, dh1, "moe::ffn::d_h1", n, F);
        gmm::tgmm(space, Gmm{}, a, dys, groups, d_wo, options(false, false));
        gmm::gmm(space, Gmm{}, dys, wo, groups, da, options(true, false, true));
        // dh0 overwrites da (each element reads its own da before writing).
        gated_backward(space, act_, n, h0, h1, da, da, dh1, bf16);
        gmm::tgmm(space, Gmm{}, xs, da, groups, d_wi_0, options(false, false));
        gmm::tgmm(space, Gmm{}, xs, dh1, groups, d_wi_1, options(false, false));
        gmm::gmm_sum(space, Gmm{}, da, wi_0, dh1, wi_1, groups, dxs, options(true, false, true));
      });
    });
  }

  /// The packed copies of the weights (empty unless the GEMM backend packs).
  gmm::PackCache const& pack_cache() const { return cache_; }

  /// Whether a bf16 step's GEMMs round the weights themselves (as they pack them, once per
  /// version; a shape oneDNN runs unpacked multiplies a rounded copy per call), so that a caller
  /// holding fp32 weights keeps no rounded copy of them.
  static constexpr bool rounds_weights =
      gmm::rounds_rhs<gmm::resolve_t<Gmm, ExecSpace, Scalar>>::value;

 private:
  /// `rounded`: the output is one the bf16 scheme rounds (GmmOptions::bf16_output when bf16).
  gmm::GmmOptions options(bool transpose, bool accumulate, bool rounded = false) {
    gmm::GmmOptions o;
    o.transpose_rhs = transpose;
    o.accumulate = accumulate;
    o.pack_cache = &cache_;
    o.rhs_version = version_;
    o.bf16_inputs = bf16;
    o.bf16_output = bf16 && rounded;
    o.round_rhs = bf16 && rounds_weights;
    return o;
  }
  /// Keeps a forward's arguments; the hidden states in bf16 when `narrow` where stores_bf16.
  template <class XS>
  void start(XS const& xs, Activation act, std::uint64_t weights_version, bool narrow) {
    xs_.set(xs);  // Scalars, or moe::bf16 where stores_bf16
    act_ = act;
    version_ = weights_version;
    hs_.choose(narrow);
  }

  static constexpr bool CanNarrow = stores_bf16<Scalar, Gmm, ExecSpace>;
  Activation act_ = Activation::Silu;
  moe::detail::RowsView<Scalar, memory_space, CanNarrow> xs_;  // the forward's rows
  HiddenStates<Scalar, memory_space, CanNarrow> hs_;
  gmm::PackCache cache_;
  std::uint64_t version_ = 0;
};

/// \brief Dense gated MLP (the shared expert): out (+)= (act(x . w0) * (x . w1)) . wo. With bf16
/// where stores_bf16 (on Auto's GEMM policy) its hidden states (h0, h1, act, d_act) are moe::bf16.
template <class Scalar, class ExecSpace>
class DenseMlp : public Bf16Rounding {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using view2 = View2<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;

  /// x [T,D] (kept until backward), w0/w1 [D,H], wo [H,D]; out [T,D] is added to.
  void forward(ExecSpace const& space, Activation act, cview2 x, view2 w0, view2 w1, view2 wo,
               view2 out) {
    moe::detail::Region region("moe::shared_expert");
    std::int64_t const T = x.extent(0), H = w0.extent(1);
    x_ = x;
    act_ = act;
    hs_.choose(bf16);
    bool const rw = bf16 && round_weights;
    hs_.visit([&](auto& h0, auto& h1, auto& a, auto&, auto&) {
      ensure_gated(space, "moe::mlp", T, H, h0, h1, a);
      moe::detail::gemm(space, "N", "N", Scalar(1), x, w0, Scalar(0), h0, bf16, rw);
      moe::detail::gemm(space, "N", "N", Scalar(1), x, w1, Scalar(0), h1, bf16, rw);
      gated_forward(space, act, T, h0, h1, a, bf16);
      moe::detail::gemm(space, "N", "N", Scalar(1), a, wo, Scalar(1), out, bf16, rw);
    });
  }

  /// From dout [T,D]: dx (+)= the input gradient, weight gradients overwritten.
  void backward(ExecSpace const& space, cview2 dout, view2 w0, view2 w1, view2 wo, view2 dx,
                view2 d_w0, view2 d_w1, view2 d_wo) {
    moe::detail::Region region("moe::shared_expert::backward");
    std::int64_t const T = x_.extent(0), H = w0.extent(1);
    bool const rw = bf16 && round_weights;
    hs_.visit([&](auto& h0, auto& h1, auto& a, auto& da, auto&) {
      moe::detail::ensure(space, da, "moe::mlp::d_act", T, H);
      moe::detail::gemm(space, "T", "N", Scalar(1), a, dout, Scalar(0), d_wo, bf16);
      moe::detail::gemm(space, "N", "T", Scalar(1), dout, wo, Scalar(0), da, bf16, rw);
      // d_h0 overwrites d_act, d_h1 overwrites the saved activation (no longer needed).
      gated_backward(space, act_, T, h0, h1, da, da, a, bf16);
      moe::detail::gemm(space, "T", "N", Scalar(1), x_, da, Scalar(0), d_w0, bf16);
      moe::detail::gemm(space, "T", "N", Scalar(1), x_, a, Scalar(0), d_w1, bf16);
      moe::detail::gemm(space, "N", "T", Scalar(1), da, w0, Scalar(1), dx, bf16, rw);
      moe::detail::gemm(space, "N", "T", Scalar(1), a, w1, Scalar(1), dx, bf16, rw);
    });
  }

 private:
  Activation act_ = Activation::Silu;
  cview2 x_;
  HiddenStates<Scalar, memory_space, stores_bf16<Scalar, gmm::Auto, ExecSpace>> hs_;
};

/// \brief The dense masked path (MaxText's sparse_matmul = false), the sparse paths' reference:
/// experts [e0, e0+L) on every token, weighted by the routing weights of the kept slots on them.
/// With bf16 where stores_bf16 (on Auto's GEMM policy) its hidden states (one expert's h0, h1,
/// act, d_act, d_h1) are moe::bf16.
template <class Scalar, class ExecSpace>
class DenseExperts : public Bf16Rounding {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using iview2 = View2<int const, memory_space>;

  /// y = sum_l wd[:,l] * FFN_l(x) with wd[t,l] = sum_k w[t,k] kept[t,k] [ids[t,k] == e0 + l].
  /// x [T,D] and the routing views are kept until backward.
  void forward(ExecSpace const& space, Activation act, cview2 x, iview2 ids, iview2 kept, cview2 w,
               int e0, view3 wi_0, view3 wi_1, view3 wo, view2 y) {
    moe::detail::Region region("moe::expert_ffn::dense");
    x_ = x;
    ids_ = ids;
    kept_ = kept;
    act_ = act;
    e0_ = e0;
    hs_.choose(bf16);
    std::int64_t const T = x.extent(0), D = x.extent(1);
    int const L = int(wi_0.extent(0)), K = int(ids.extent(1));
    moe::detail::ensure(space, wd_, "moe::dense::weights", T, L);
    auto wd = wd_;
    Kokkos::parallel_for(
        "moe::dense::weights", Kokkos::RangePolicy<ExecSpace>(space, 0, T),
        KOKKOS_LAMBDA(std::int64_t t) {
          for (int l = 0; l < L; ++l) wd(t, l) = Scalar(0);
          for (int k = 0; k < K; ++k) {
            int const l = ids(t, k) - e0;
            if (kept(t, k) && l >= 0 && l < L) wd(t, l) += w(t, k);
          }
        });
    Kokkos::deep_copy(space, y, Scalar(0));
    for (int l = 0; l < L; ++l) {
      expert(space, l, wi_0, wi_1, wo);
      auto ye = ye_;
      moe::detail::for_each_row(
          space, "moe::dense::combine", T,
          KOKKOS_LAMBDA(std::int64_t t, std::int64_t lane, std::int64_t lanes) {
            for (std::int64_t d = lane; d < D; d += lanes) y(t, d) += wd(t, l) * ye(t, d);
          });
    }
  }

  /// From dy: dx (overwritten), d_weights [T,K] (0 for slots not on these experts or dropped)
  /// and the weight gradients (overwritten). Recomputes each expert's activations.
  void backward(ExecSpace const& space, cview2 dy, view3 wi_0, view3 wi_1, view3 wo, view2 dx,
                view2 d_weights, view3 d_wi_0, view3 d_wi_1, view3 d_wo) {
    moe::detail::Region region("moe::expert_ffn::dense::backward");
    std::int64_t const T = x_.extent(0), D = x_.extent(1), F = wi_0.extent(2);
    int const L = int(wi_0.extent(0)), K = int(ids_.extent(1)), e0 = e0_;
    moe::detail::ensure(space, dye_, "moe::dense::d_y_expert", T, D);
    moe::detail::ensure(space, dwd_, "moe::dense::d_weights", T, L);
    bool const rw = bf16 && round_weights;
    Kokkos::deep_copy(space, dx, Scalar(0));
    auto wd = wd_, dwd = dwd_, dye = dye_;
    auto ids = ids_, kept = kept_;
    for (int l = 0; l < L; ++l) {
      expert(space, l, wi_0, wi_1, wo);
      auto ye = ye_;  // allocated by expert()
      Kokkos::parallel_for(
          "moe::dense::combine_backward", Kokkos::RangePolicy<ExecSpace>(space, 0, T),
          KOKKOS_LAMBDA(std::int64_t t) {
            Scalar acc = 0;
            for (std::int64_t d = 0; d < D; ++d) {
              acc += dy(t, d) * ye(t, d);
              dye(t, d) = wd(t, l) * dy(t, d);
            }
            dwd(t, l) = acc;
          });
      round(space, dye_);
      hs_.visit([&](auto& h0, auto& h1, auto& a, auto& da, auto& dh1) {
        moe::detail::ensure(space, da, "moe::dense::d_act", T, F);
        moe::detail::ensure(space, dh1, "moe::dense::d_h1", T, F);
        moe::detail::gemm(space, "T", "N", Scalar(1), a, dye_, Scalar(0), sub(d_wo, l), bf16);
        moe::detail::gemm(space, "N", "T", Scalar(1), dye_, sub(wo, l), Scalar(0), da, bf16, rw);
        gated_backward(space, act_, T, h0, h1, da, da, dh1, bf16);
        moe::detail::gemm(space, "T", "N", Scalar(1), x_, da, Scalar(0), sub(d_wi_0, l), bf16);
        moe::detail::gemm(space, "T", "N", Scalar(1), x_, dh1, Scalar(0), sub(d_wi_1, l), bf16);
        moe::detail::gemm(space, "N", "T", Scalar(1), da, sub(wi_0, l), Scalar(1), dx, bf16, rw);
        moe::detail::gemm(space, "N", "T", Scalar(1), dh1, sub(wi_1, l), Scalar(1), dx, bf16, rw);
      });
    }
    Kokkos::parallel_for(
        "moe::dense::weight_grad", Kokkos::RangePolicy<ExecSpace>(space, 0, T),
        KOKKOS_LAMBDA(std::int64_t t) {
          for (int k = 0; k < K; ++k) {
            int const l = ids(t, k) - e0;
            d_weights(t, k) = kept(t, k) && l >= 0 && l < L ? dwd(t, l) : Scalar(0);
          }
        });
  }

 private:
  /// Expert l on every token: h0, h1, a = act(h0) * h1, ye = a . wo[l].
  void expert(ExecSpace const& space, int l, view3 wi_0, view3 wi_1, view3 wo) {
    std::int64_t const T = x_.extent(0), D = x_.extent(1), F = wi_0.extent(2);
    moe::detail::ensure(space, ye_, "moe::dense::y_expert", T, D);
    bool const rw = bf16 && round_weights;
    hs_.visit([&](auto& h0, auto& h1, auto& a, auto&, auto&) {
      ensure_gated(space, "moe::dense", T, F, h0, h1, a);
      moe::detail::gemm(space, "N", "N", Scalar(1), x_, sub(wi_0, l), Scalar(0), h0, bf16, rw);
      moe::detail::gemm(space, "N", "N", Scalar(1), x_, sub(wi_1, l), Scalar(0), h1, bf16, rw);
      gated_forward(space, act_, T, h0, h1, a, bf16);
      moe::detail::gemm(space, "N", "N", Scalar(1), a, sub(wo, l), Scalar(0), ye_, bf16, rw);
    });
    round(space, ye_);
  }
  /// Expert l's [D, F] or [F, D] block of a weight tensor.
  static auto sub(view3 const& v, int l) { return Kokkos::subview(v, l, Kokkos::ALL, Kokkos::ALL); }

  Activation act_ = Activation::Silu;
  int e0_ = 0;
  cview2 x_;
  iview2 ids_, kept_;
  view2 wd_, ye_, dye_, dwd_;
  HiddenStates<Scalar, memory_space, stores_bf16<Scalar, gmm::Auto, ExecSpace>> hs_;
};

}  // namespace moe::nn
