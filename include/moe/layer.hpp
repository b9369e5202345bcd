#pragma once
/// \file
/// MoeLayer: parameters, forward and backward of one Mixture-of-Experts layer on one rank.

#include <moe/config.hpp>
#include <moe/detail/blas.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/nn/activation.hpp>
#include <moe/nn/expert_ffn.hpp>
#include <moe/permute/permute.hpp>
#include <moe/policies.hpp>
#include <moe/routing/router.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace moe {

/// \brief Trainable tensors of one layer (MaxText layouts). Also used for their gradients.
template <class Scalar, class MemorySpace>
struct Parameters {
  View2<Scalar, MemorySpace> gate;       ///< [D,E] router kernel
  View1<Scalar, MemorySpace> gate_bias;  ///< [E] (allocated only with routed_bias)
  View3<Scalar, MemorySpace> wi_0;       ///< [E,D,F] gate projection of the experts
  View3<Scalar, MemorySpace> wi_1;       ///< [E,D,F] up projection of the experts
  View3<Scalar, MemorySpace> wo;         ///< [E,F,D] down projection of the experts
  View2<Scalar, MemorySpace>
      shared_wi_0;  ///< [D,Fs] shared expert (allocated with shared_experts>0)
  View2<Scalar, MemorySpace> shared_wi_1;  ///< [D,Fs]
  View2<Scalar, MemorySpace> shared_wo;    ///< [Fs,D]

  /// \brief The shape of tensor `name` under `cfg` (MaxText layouts, see the members).
  static std::vector<std::int64_t> shape(LayerConfig const& cfg, std::string const& name) {
    std::int64_t const D = cfg.base_emb_dim, E = cfg.num_experts, F = cfg.base_moe_mlp_dim;
    std::int64_t const Fs = cfg.shared_mlp_dim();
    if (name == "gate") return {D, E};
    if (name == "gate_bias") return {E};
    if (name == "wi_0" || name == "wi_1") return {E, D, F};
    if (name == "wo") return {E, F, D};
    if (name == "shared_wi_0" || name == "shared_wi_1") return {D, Fs};
    if (name == "shared_wo") return {Fs, D};
    throw ConfigError(detail::cat("moe::Parameters: no tensor named '", name, "'"));
  }

  /// Zero-filled parameters of the shapes `cfg` asks for.
  static Parameters zeros(LayerConfig const& cfg) {
    return allocated(cfg, "moe::param::", [&](char const* n) { return shape(cfg, n); });
  }

  /// \brief Zero-filled tensors named `prefix` + name, of the shapes shape_of(name) gives
  /// (e.g. one rank's blocks), for every tensor `cfg` has.
  template <class ShapeOf>
  static Parameters allocated(LayerConfig const& cfg, std::string const& prefix,
                              ShapeOf&& shape_of) {
    Parameters p;
    for_each_field(cfg, [&](char const* n, auto m) {
      using V = std::decay_t<decltype(p.*m)>;
      std::vector<std::int64_t> const s = shape_of(n);
      if constexpr (V::rank == 1)
        p.*m = V(prefix + n, s[0]);
      else if constexpr (V::rank == 2)
        p.*m = V(prefix + n, s[0], s[1]);
      else
        p.*m = V(prefix + n, s[0], s[1], s[2]);
    });
    return p;
  }

  /// \brief Calls f(name, member pointer) for every tensor `cfg` has, in for_each's order, so
  /// that code walking several parameter sets at once (stored, compute and gradient blocks)
  /// names each tensor once: `a.*m = op(b.*m)`.
  template <class F>
  static void for_each_field(LayerConfig const& cfg, F&& f) {
    f("gate", &Parameters::gate);
    if (cfg.routed_bias) f("gate_bias", &Parameters::gate_bias);
    f("wi_0", &Parameters::wi_0);
    f("wi_1", &Parameters::wi_1);
    f("wo", &Parameters::wo);
    if (cfg.shared_mlp_dim() > 0) {
      f("shared_wi_0", &Parameters::shared_wi_0);
      f("shared_wi_1", &Parameters::shared_wi_1);
      f("shared_wo", &Parameters::shared_wo);
    }
  }

  /// \brief Throws ShapeError "`what` name is [..] but `needs` [..]" for the first tensor `cfg`
  /// has whose extents are not want(name) (e.g. Parameters::shape, or one rank's block).
  template <class Want>
  void check_shapes(LayerConfig const& cfg, char const* what, char const* needs,
                    Want&& want) const {
    for_each_field(cfg, [&](char const* n, auto m) {
      auto const& v = this->*m;
      std::vector<std::int64_t> const w = want(n);
      std::int64_t numel = 1;
      bool ok = w.size() == std::size_t(v.rank);
      for (std::size_t r = 0; ok && r < w.size(); ++r) {
        ok = std::int64_t(v.extent(r)) == w[r];
        numel *= w[r];
      }
      if (ok && (v.data() != nullptr || numel == 0)) return;
      // The message is built only for the failing tensor (this check runs every step).
      std::string got, exp;
      for (std::size_t r = 0; r < w.size(); ++r) {
        if (r > 0) {
          got += ',';
          exp += ',';
        }
        got += std::to_string(v.extent(r));
        exp += std::to_string(w[r]);
      }
      throw ShapeError(detail::cat(what, " ", n, " is [", got, "] but ", needs, " [", exp, "]"));
    });
  }

  /// Calls f(name, view) for every allocated tensor, in a fixed order (MaxText names).
  template <class F>
  void for_each(F&& f) const {
    f("gate", gate);
    if (gate_bias.data()) f("gate_bias", gate_bias);
    f("wi_0", wi_0);
    f("wi_1", wi_1);
    f("wo", wo);
    if (shared_wo.data()) {
      f("shared_wi_0", shared_wi_0);
      f("shared_wi_1", shared_wi_1);
      f("shared_wo", shared_wo);
    }
  }
};

/// \brief A layer's parameters with a version that counts writes; MoeLayer and
/// DistributedMoeLayer expose it. The non-const parameters() counts as a write (it calls
/// weights_changed()); code that keeps the reference (or the views' pointers) and writes through
/// it later must call weights_changed() after each write.
template <class Params>
class ParameterStore {
 public:
  /// Trainable parameters (filled by the user, e.g. from a checkpoint); counts as a write.
  Params& parameters() {
    weights_changed();
    return params_;
  }
  Params const& parameters() const { return params_; }

  /// \brief Declares the parameters written (optimizer step, checkpoint load, resharding): the
  /// next forward repacks the expert weights for GEMM backends that keep packed copies
  /// (gmm::OneDnn on CPUs with blocked kernels). Cheap; call it after every update.
  void weights_changed() { ++weights_version_; }
  /// Version of the parameters' contents (increases with every weights_changed()).
  std::uint64_t weights_version() const { return weights_version_; }

 protected:
  Params params_;
  std::uint64_t weights_version_ = 0;
};

/// \brief Per-call options of MoeLayer::forward.
struct ForwardOptions {
  /// Global index of this call's first token: random routing draws from (seed, token, slot).
  std::uint64_t token_offset = 0;
};

/// \brief One Mixture-of-Experts layer: router, sort, expert FFN (gated, grouped GEMM), unsort,
/// combine, optional shared expert; forward and backward.
///
/// forward() keeps what backward() needs, so call them in pairs (backward may be called once per
/// forward). y = sum_k w[t,k] * FFN_{e[t,k]}(x[t]) (+ shared FFN(x[t])). backward() returns the
/// gradients of sum(y * dy) + lb_loss.
///
/// \tparam Scalar float or double; every step computes in this type.
/// \tparam Policy moe::Policies<Routing, Gmm, Partition>.
/// \tparam ExecSpace Kokkos execution space; all views live in its memory space.
template <class Scalar, class Policy = DefaultPolicies,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class MoeLayer : public ParameterStore<Parameters<Scalar, typename ExecSpace::memory_space>> {
  using store = ParameterStore<Parameters<Scalar, typename ExecSpace::memory_space>>;
  using store::params_;
  using store::weights_version_;
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "MoeLayer computes in float or double");

 public:
  using execution_space = ExecSpace;
  using memory_space = typename ExecSpace::memory_space;
  using params_type = Parameters<Scalar, memory_space>;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using cview3 = View3<Scalar const, memory_space>;

  /// \brief Validates `cfg` (ConfigError on any broken rule) and allocates zero parameters.
  explicit MoeLayer(LayerConfig const& cfg, ExecSpace const& space = ExecSpace())
      : cfg_(validated(cfg)),
        space_(space),
        kind_(routing::resolve(typename Policy::routing_policy{}, cfg_)),
        router_(cfg_, kind_) {
    params_ = params_type::zeros(cfg_);
  }

  LayerConfig const& config() const { return cfg_; }
  /// The packed copies of the expert weights kept by the GEMM backend (statistics, tests).
  gmm::PackCache const& pack_cache() const { return ffn_.pack_cache(); }

  /// True when this layer runs the dense masked path (Gmm = Dense or sparse_matmul = false).
  bool dense_path() const {
    return std::is_same_v<typename Policy::gmm_policy, gmm::Dense> || !cfg_.sparse_matmul;
  }

  /// \brief forward() and backward() for any View types: LayoutRight Views of this layer's
  /// Scalar and memory space convert (e.g. non-const x); anything else, such as a LayoutLeft
  /// View, fails to compile with a static_assert naming the rule (detail::api_view).
  template <class XView, class YView>
  void forward(XView const& x, YView const& y, ForwardOptions const& opt = {}) {
    forward(detail::api_view<cview3>(x), detail::api_view<view3>(y), opt);
  }
  template <class DyView, class DxView>
  void backward(DyView const& dy, DxView const& dx, params_type& grads) {
    backward(detail::api_view<cview3>(dy), detail::api_view<view3>(dx), grads);
  }

  /// \brief y[B,S,D] = MoE(x[B,S,D]). Checks shapes (ShapeError) and, with check_finite, that x,
  /// the gate and every expert weight a token reaches hold no NaN/Inf (InputError naming the
  /// tensor and the index). x is copied, so it may be reused (or be y) before backward(); the
  /// parameters must stay unchanged until backward().
  void forward(cview3 x, view3 y, ForwardOptions const& opt = {}) {
    detail::Region region("moe::layer::forward");
    int const D = cfg_.base_emb_dim;
    require_shape(x, "x", D);
    require_shape(y, "y", D);
    detail::require<ShapeError>(y.extent(0) == x.extent(0) && y.extent(1) == x.extent(1), "y is [",
                                y.extent(0), ",", y.extent(1), ",", y.extent(2), "] but x is [",
                                x.extent(0), ",", x.extent(1), ",", x.extent(2),
                                "]: they must match");
    detail::require<ShapeError>(x.extent(0) > 0 && x.extent(1) > 0, "x is [", x.extent(0), ",",
                                x.extent(1), ",", x.extent(2),
                                "]: it must hold at least one token (B >= 1, S >= 1)");
    check_parameters(params_, "parameter");
    if (cfg_.check_finite) {
      require_finite(x, "x");
      require_finite(params_.gate, "gate");
      if (cfg_.routed_bias) require_finite(params_.gate_bias, "gate_bias");
    }
    B_ = x.extent(0);
    S_ = x.extent(1);
    std::int64_t const T = B_ * S_;
    // An owned copy: backward() needs x, and y may alias x (forward(x, x) works).
    detail::ensure(space_, x_copy_, "moe::layer::x", T, D);
    Kokkos::deep_copy(space_, x_copy_, cview2(x.data(), T, D));
    x_ = x_copy_;
    auto y2 = view2(y.data(), T, D);
    route(opt);
    if (dense_path()) {
      dense_forward(y2);
    } else {
      sparse_forward(y2);
    }
    shared_forward(y2);
    // Expert weights are checked through their effect: a NaN/Inf weight that any token reaches
    // makes y non-finite, and only then are all parameters scanned to name the culprit. This
    // keeps the check O(T*D) per call instead of a full pass over E*D*F weights.
    if (cfg_.check_finite && !detail::all_finite(space_, y)) {
      params_.for_each([&](char const* name, auto const& v) { require_finite(v, name); });
      require_finite(y, "y (all inputs and weights are finite: the layer overflowed)");
    }
    have_forward_ = true;
  }

  /// \brief Gradients of sum(y * dy) + lb_loss w.r.t. x (into dx[B,S,D]) and every parameter
  /// (into grads, allocated here if empty; overwritten).
  void backward(cview3 dy, view3 dx, params_type& grads) {
    detail::Region region("moe::layer::backward");
    detail::require<Error>(have_forward_, "MoeLayer::backward called without a forward");
    int const D = cfg_.base_emb_dim;
    require_shape(dy, "dy", D);
    require_shape(dx, "dx", D);
    detail::require<ShapeError>(
        std::int64_t(dy.extent(0)) == B_ && std::int64_t(dy.extent(1)) == S_ &&
            dx.extent(0) == dy.extent(0) && dx.extent(1) == dy.extent(1),
        "dy [", dy.extent(0), ",", dy.extent(1), "] and dx [", dx.extent(0), ",", dx.extent(1),
        "] must match the forward x [", B_, ",", S_, "]");
    if (cfg_.check_finite) require_finite(dy, "dy");
    if (!grads.gate.data()) grads = params_type::zeros(cfg_);
    check_parameters(grads, "gradient");
    std::int64_t const T = B_ * S_;
    auto dy2 = cview2(dy.data(), T, D);
    auto dx2 = view2(dx.data(), T, D);
    int const K = cfg_.num_experts_per_tok;
    detail::ensure(space_, dw_, "moe::layer::d_weights", T, K);
    if (dense_path()) {
      dense_backward(dy2, dx2, grads);
    } else {
      sparse_backward(dy2, dx2, grads);
    }
    // Router backward: combine-weight gradient and load-balance term -> gate logits -> x, gate.
    router_.backward(space_, x_, params_.gate, cview2(dw_), router_.lb_coefficient(B_), dx2,
                     grads.gate, grads.gate_bias);
    shared_backward(dy2, dx2, grads);
    have_forward_ = false;
  }

  /// Experts chosen by the last forward, [T,K] (T = B*S, row-major over (b, s)).
  View2<int, memory_space> expert_ids() const { return router_.state().expert_ids; }
  /// Combine weights of the last forward before capacity dropping, [T,K].
  view2 weights() const { return router_.state().weights; }
  /// 1 where a slot of the last forward survived the capacity limit, [T,K].
  View2<int, memory_space> kept() const { return router_.state().kept; }
  /// Load-balance loss of the last forward (0 when load_balance_loss_weight = 0).
  double lb_loss() const { return lb_loss_; }
  /// Loss-free bias update of the last forward ([E], empty unless routed_bias_update_rate > 0).
  std::vector<double> const& bias_update() const { return bias_update_; }
  /// Number of slots the last forward sent to the experts (after capacity dropping).
  std::int64_t routed_rows() const { return dense_path() ? 0 : perm_.rows(); }

 private:
  static LayerConfig validated(LayerConfig const& cfg) {
    cfg.validate();
    return cfg;
  }

  template <class V>
  void require_shape(V const& v, char const* name, int D) const {
    detail::require<ShapeError>(v.extent(2) == std::size_t(D), name, " is [", v.extent(0), ",",
                                v.extent(1), ",", v.extent(2), "] but base_emb_dim=", D,
                                " (expected [B,S,", D, "])");
    detail::require<ShapeError>(v.span_is_contiguous(), name, " must be contiguous");
  }

  template <class V>
  void require_finite(V const& v, std::string const& name) const {
    detail::require_finite(space_, v, name);
  }

  /// Shapes of a parameter set against the config (ShapeError naming the tensor).
  void check_parameters(params_type const& p, char const* what) const {
    p.check_shapes(cfg_, what, "the config needs",
                   [&](char const* n) { return params_type::shape(cfg_, n); });
  }

  void route(ForwardOptions const& opt) {
    std::int64_t const T = B_ * S_;
    int const K = cfg_.num_experts_per_tok;
    router_.forward(space_, x_, params_.gate, params_.gate_bias, S_, {opt.token_offset}, 0);
    lb_loss_ = router_.lb_loss(router_.lb_sum(), B_);
    bias_update_.clear();
    if (cfg_.routed_bias_update_rate > 0)
      bias_update_ =
          routing::bias_update(router_.expert_counts(), T * K, cfg_.routed_bias_update_rate);
  }

  // ---- sparse path: sort, grouped GEMMs, unsort -------------------------------------------
  using gmm_policy = std::conditional_t<std::is_same_v<typename Policy::gmm_policy, gmm::Dense>,
                                        gmm::Auto, typename Policy::gmm_policy>;

  void sparse_forward(view2 y) {
    int const D = cfg_.base_emb_dim, K = cfg_.num_experts_per_tok;
    permute::sort_by_expert(space_, View2<int const, memory_space>(router_.state().expert_ids),
                            View2<int const, memory_space>(router_.state().kept), cfg_.num_experts,
                            perm_);
    std::int64_t const n = perm_.rows();
    detail::ensure(space_, xs_, "moe::layer::x_sorted", n, D);
    detail::ensure(space_, ys_, "moe::layer::y_sorted", n, D);
    permute::gather_rows(space_, x_, View1<std::int64_t const, memory_space>(perm_.perm), K, xs_);
    ffn_.forward(space_, cfg_.mlp_activation, xs_, perm_.groups, params_.wi_0, params_.wi_1,
                 params_.wo, ys_, weights_version_);
    permute::combine(space_, cview2(ys_), View1<std::int64_t const, memory_space>(perm_.inverse),
                     cview2(router_.state().weights), false, y);
  }

  void sparse_backward(cview2 dy, view2 dx, params_type& g) {
    int const D = cfg_.base_emb_dim, K = cfg_.num_experts_per_tok;
    std::int64_t const n = perm_.rows();
    View1<std::int64_t const, memory_space> perm(perm_.perm), inv(perm_.inverse);
    detail::ensure(space_, dys_, "moe::layer::d_y_sorted", n, D);
    permute::combine_backward(space_, dy, cview2(ys_), perm, inv, cview2(router_.state().weights),
                              dys_, dw_);
    // dxs overwrites dys.
    ffn_.backward(space_, dys_, perm_.groups, params_.wi_0, params_.wi_1, params_.wo, dys_, g.wi_0,
                  g.wi_1, g.wo);
    permute::gather_rows_backward(space_, cview2(dys_), inv, K, false, dx);
  }

  // ---- dense path: every expert on every token, masked combine weights ---------------------
  void dense_forward(view2 y) {
    dense_.forward(space_, cfg_.mlp_activation, x_,
                   View2<int const, memory_space>(router_.state().expert_ids),
                   View2<int const, memory_space>(router_.state().kept),
                   cview2(router_.state().weights), 0, params_.wi_0, params_.wi_1, params_.wo, y);
  }

  void dense_backward(cview2 dy, view2 dx, params_type& g) {
    dense_.backward(space_, dy, params_.wi_0, params_.wi_1, params_.wo, dx, dw_, g.wi_0, g.wi_1,
                    g.wo);
  }

  // ---- shared expert -----------------------------------------------------------------------
  void shared_forward(view2 y) {
    if (cfg_.shared_mlp_dim() == 0) return;
    shared_.forward(space_, cfg_.mlp_activation, x_, params_.shared_wi_0, params_.shared_wi_1,
                    params_.shared_wo, y);
  }

  void shared_backward(cview2 dy, view2 dx, params_type& g) {
    if (cfg_.shared_mlp_dim() == 0) return;
    shared_.backward(space_, dy, params_.shared_wi_0, params_.shared_wi_1, params_.shared_wo, dx,
                     g.shared_wi_0, g.shared_wi_1, g.shared_wo);
  }

  LayerConfig cfg_;
  ExecSpace space_;
  routing::Kind kind_;
  routing::Router<Scalar, ExecSpace> router_;

  // state of the last forward
  bool have_forward_ = false;
  std::int64_t B_ = 0, S_ = 0;
  view2 x_copy_;
  cview2 x_;
  permute::Permutation<memory_space> perm_;
  double lb_loss_ = 0;
  std::vector<double> bias_update_;
  nn::ExpertFfn<Scalar, gmm_policy, ExecSpace> ffn_;
  nn::DenseMlp<Scalar, ExecSpace> shared_;
  nn::DenseExperts<Scalar, ExecSpace> dense_;
  view2 xs_, ys_;
  // backward work space
  view2 dw_, dys_;
};

}  // namespace moe
