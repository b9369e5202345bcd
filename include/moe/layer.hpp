#pragma once
/// \file
/// MoeLayer: one Mixture-of-Experts layer on one rank, a DistributedMoeLayer on
/// comm::Communicator::local() (no MPI call) whose plan is re-made for each new batch shape.

#include <moe/comm/communicator.hpp>
#include <moe/config.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/parameters.hpp>
#include <moe/policies.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace moe {

/// \brief One Mixture-of-Experts layer: router, sort, expert FFN (gated, grouped GEMM), unsort,
/// combine, optional shared expert; forward and backward.
///
/// y = sum_k w[t,k] * FFN_{e[t,k]}(x[t]) (+ shared FFN(x[t])); backward() returns the gradients
/// of sum(y * dy) + lb_loss, once per forward(). Move-only.
///
/// \tparam Scalar float or double; every step computes in this type.
/// \tparam Policy moe::Policies<Routing, Gmm, Partition>.
/// \tparam ExecSpace Kokkos execution space; all views live in its memory space.
template <class Scalar, class Policy = DefaultPolicies,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class MoeLayer {
  static_assert(std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>,
                "MoeLayer computes in float or double");
  using pipeline_type = DistributedMoeLayer<Scalar, Policy, ExecSpace>;

 public:
  using execution_space = ExecSpace;
  // The pipeline's types: Parameters and LayoutRight Views of Scalar in ExecSpace's memory.
  using memory_space = typename pipeline_type::memory_space;
  using params_type = typename pipeline_type::params_type;
  using view2 = typename pipeline_type::view2;
  using view3 = typename pipeline_type::view3;
  using cview2 = typename pipeline_type::cview2;
  using cview3 = typename pipeline_type::cview3;

  /// \brief Validates `cfg` (ConfigError on any broken rule) and allocates zero parameters.
  explicit MoeLayer(LayerConfig const& cfg, ExecSpace const& space = ExecSpace())
      : step_(comm::Communicator::local(), validated(cfg), ParallelConfig{}, 1, 1, space) {}

  LayerConfig const& config() const { return step_.config(); }
  /// The packed copies of the expert weights kept by the GEMM backend (statistics, tests).
  gmm::PackCache const& pack_cache() const { return step_.pack_cache(); }

  /// Trainable parameters (filled by the user); counts as a write (see ParameterStore).
  params_type& parameters() { return step_.parameters(); }
  params_type const& parameters() const { return step_.parameters(); }
  /// Declares the parameters written (ParameterStore::weights_changed()); call it after updates.
  void weights_changed() { step_.weights_changed(); }
  /// Version of the parameters' contents (increases with every weights_changed()).
  std::uint64_t weights_version() const { return step_.weights_version(); }

  /// True when this layer runs the dense masked path (Gmm = Dense or sparse_matmul = false).
  bool dense_path() const { return step_.dense_path(); }
  /// The stages one step runs on this rank, planned for the batch shape of the last forward()
  /// call ([1, 1] before the first).
  distributed::StepPlan const& step_plan() const { return step_.step_plan(); }

  /// \brief y[B,S,D] = MoE(x[B,S,D]). Checks shapes (ShapeError) and, with check_finite, that x,
  /// the gate and every expert weight a token reaches hold no NaN/Inf (InputError naming the
  /// tensor and the index). x is copied, so it may be reused (or be y) before backward(); the
  /// parameters must stay unchanged until backward().
  ///
  /// forward() and backward() take any View converting to a LayoutRight View of Scalar in this
  /// memory space (e.g. non-const x); others (LayoutLeft, ...) hit a static_assert (api_view).
  template <class XView, class YView>
  void forward(XView const& x_in, YView const& y_in, ForwardOptions const& opt = {}) {
    detail::Region region("moe::layer::forward");
    auto const x = detail::api_view<cview3>(x_in);
    auto const y = detail::api_view<view3>(y_in);
    int const D = config().base_emb_dim;
    require_shape(x, "x", D);
    require_shape(y, "y", D);
    detail::require<ShapeError>(y.extent(0) == x.extent(0) && y.extent(1) == x.extent(1), "y is [",
                                y.extent(0), ",", y.extent(1), ",", y.extent(2), "] but x is [",
                                x.extent(0), ",", x.extent(1), ",", x.extent(2),
                                "]: they must match");
    detail::require<ShapeError>(x.extent(0) > 0 && x.extent(1) > 0, "x is [", x.extent(0), ",",
                                x.extent(1), ",", x.extent(2),
                                "]: it must hold at least one token (B >= 1, S >= 1)");
    step_.set_batch_shape(std::int64_t(x.extent(0)), std::int64_t(x.extent(1)));
    step_.forward(x, y, opt);
  }

  /// \brief Gradients of sum(y * dy) + lb_loss w.r.t. x (into dx[B,S,D]) and every parameter
  /// (into grads, allocated here if empty; overwritten). dx must not share memory with dy
  /// (InputError): the backward reads dy after it has begun to write dx.
  template <class DyView, class DxView>
  void backward(DyView const& dy_in, DxView const& dx_in, params_type& grads) {
    detail::Region region("moe::layer::backward");
    auto const dy = detail::api_view<cview3>(dy_in);
    auto const dx = detail::api_view<view3>(dx_in);
    detail::require<Error>(step_.has_forward(), "MoeLayer::backward called without a forward");
    int const D = config().base_emb_dim;
    require_shape(dy, "dy", D);
    require_shape(dx, "dx", D);
    auto const [B, S] = step_.batch_shape();
    detail::require<ShapeError>(std::int64_t(dy.extent(0)) == B &&
                                    std::int64_t(dy.extent(1)) == S &&
                                    dx.extent(0) == dy.extent(0) && dx.extent(1) == dy.extent(1),
                                "dy [", dy.extent(0), ",", dy.extent(1), "] and dx [", dx.extent(0),
                                ",", dx.extent(1), "] must match the forward x [", B, ",", S, "]");
    step_.backward(dy, dx, grads);  // its checks throw before anything runs: a retry may follow
  }

  /// Experts chosen by the last forward, [T,K] (T = B*S, row-major over (b, s)).
  View2<int, memory_space> expert_ids() const { return step_.expert_ids(); }
  /// Combine weights of the last forward before capacity dropping, [T,K].
  view2 weights() const { return step_.weights(); }
  /// 1 where a slot of the last forward survived the capacity limit, [T,K].
  View2<int, memory_space> kept() const { return step_.kept(); }
  /// Load-balance loss of the last forward (0 when load_balance_loss_weight = 0).
  double lb_loss() const { return step_.lb_loss(); }
  /// Loss-free bias update of the last forward ([E], empty unless routed_bias_update_rate > 0).
  std::vector<double> const& bias_update() const { return step_.bias_update(); }
  /// Number of slots the last forward sent to the experts (after capacity dropping).
  std::int64_t routed_rows() const { return step_.routed_rows(); }

 private:
  static LayerConfig validated(LayerConfig const& cfg) {
    cfg.validate();
    return cfg;
  }

  template <class V>
  static void require_shape(V const& v, char const* name, int D) {
    detail::require<ShapeError>(v.extent(2) == std::size_t(D), name, " is [", v.extent(0), ",",
                                v.extent(1), ",", v.extent(2), "] but base_emb_dim=", D,
                                " (expected [B,S,", D, "])");
    detail::require<ShapeError>(v.span_is_contiguous(), name, " must be contiguous");
  }

  pipeline_type step_;
};

}  // namespace moe
