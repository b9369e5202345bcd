#pragma once
/// \file
/// Parameters (MaxText's names and layouts), ParameterStore (counts their writes) and
/// ForwardOptions, shared by MoeLayer and DistributedMoeLayer.

#include <moe/config.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>
#include <moe/tensor_block.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace moe {

/// \brief Trainable tensors of one layer (MaxText layouts). Also used for their gradients.
template <class Scalar, class MemorySpace>
struct Parameters {
  View2<Scalar, MemorySpace> gate;         ///< [D,E] router kernel
  View1<Scalar, MemorySpace> gate_bias;    ///< [E] (allocated only with routed_bias)
  View3<Scalar, MemorySpace> wi_0;         ///< [E,D,F] gate projection of the experts
  View3<Scalar, MemorySpace> wi_1;         ///< [E,D,F] up projection of the experts
  View3<Scalar, MemorySpace> wo;           ///< [E,F,D] down projection of the experts
  View2<Scalar, MemorySpace> shared_wi_0;  ///< [D,Fs] shared expert (with shared_experts > 0)
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

  /// \brief Calls f(name, member pointer) for every tensor `cfg` has, in for_each's order: code
  /// walking several parameter sets at once names each tensor once (`a.*m = op(b.*m)`).
  template <class F>
  static void for_each_field(LayerConfig const& cfg, F&& f) {
    for_each_member(cfg.routed_bias, cfg.shared_mlp_dim() > 0, f);
  }

  /// \brief Throws ShapeError "`what` name is [..] but `needs` [..]" for the first tensor `cfg`
  /// has whose extents are not want(name) (e.g. Parameters::shape, or one rank's block).
  template <class Want>
  void check_shapes(LayerConfig const& cfg, char const* what, char const* needs,
                    Want&& want) const {
    for_each_field(cfg, [&](char const* n, auto m) {
      auto const& v = this->*m;
      std::vector<std::int64_t> const w = want(n);
      bool ok = w.size() == std::size_t(v.rank);
      for (std::size_t r = 0; ok && r < w.size(); ++r) ok = std::int64_t(v.extent(r)) == w[r];
      if (ok && (v.data() != nullptr || numel(w) == 0)) return;
      // The message is built only for the failing tensor (this check runs every step).
      std::string got, exp;
      for (std::size_t r = 0; r < w.size(); ++r) {
        got += (r > 0 ? "," : "") + std::to_string(v.extent(r));
        exp += (r > 0 ? "," : "") + std::to_string(w[r]);
      }
      throw ShapeError(detail::cat(what, " ", n, " is [", got, "] but ", needs, " [", exp, "]"));
    });
  }

  /// Calls f(name, view) for every allocated tensor, in a fixed order (MaxText names).
  template <class F>
  void for_each(F&& f) const {
    for_each_member(gate_bias.data() != nullptr, shared_wo.data() != nullptr,
                    [&](char const* n, auto m) { f(n, this->*m); });
  }

 private:
  /// f(name, member pointer) for every tensor, gate_bias only with `bias`, shared_* with `shared`.
  template <class F>
  static void for_each_member(bool bias, bool shared, F&& f) {
    f("gate", &Parameters::gate);
    if (bias) f("gate_bias", &Parameters::gate_bias);
    f("wi_0", &Parameters::wi_0);
    f("wi_1", &Parameters::wi_1);
    f("wo", &Parameters::wo);
    if (shared) {
      f("shared_wi_0", &Parameters::shared_wi_0);
      f("shared_wi_1", &Parameters::shared_wi_1);
      f("shared_wo", &Parameters::shared_wo);
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

/// \brief Per-call options of MoeLayer::forward and DistributedMoeLayer::forward.
struct ForwardOptions {
  /// Global index of the first token of the call's (global) batch: random routing draws from
  /// (seed, token, slot), so a driver that feeds batch after batch passes the tokens seen so far.
  std::uint64_t token_offset = 0;
};

}  // namespace moe
