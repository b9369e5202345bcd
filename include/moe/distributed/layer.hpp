#pragma once
/// \file
/// DistributedMoeLayer: one MoE layer laid out over MPI ranks by a mesh and MaxText's logical-axis
/// rules -- data, FSDP, expert (ragged all-to-all or ring of experts), tensor parallelism, the
/// shard-exp-on-fsdp preset and EP-as-TP for the shared expert -- forward and backward.
///
/// Every layout gives the single-rank result (outputs and every gradient) up to floating-point
/// reassociation. How:
///  * Tokens: the batch dimension is split over the resolved `activation_batch` axes (ranks that
///    differ only in other axes, e.g. `tensor`, hold the same tokens). When the global batch does
///    not divide over them and `expert` is one of them, the batch is replicated over the expert
///    axis instead (decode).
///  * Weights are stored in the blocks their resolved specs give (keeping what MaxText keeps) and,
///    per step, gathered over the axes the compute spec drops (FSDP, fsdp_transpose, the fsdp part
///    of shard-exp-on-fsdp) and sliced over axes the compute spec adds (EP-as-TP for the shared
///    expert). Their gradients take the transposed path: all-gather <-> reduce-scatter, slice <->
///    all-gather; contributions of ranks that hold other tokens are summed.
///  * Routed experts: with the batch split over the expert axis the rows travel by ragged
///    all-to-all (dispatch, local permute, grouped GEMMs, reverse); with `use_ring_of_experts`,
///    a replicated batch, or the dense path the tokens are all-gathered over the expert axis and
///    the partial outputs reduce-scattered back. Tensor parallelism splits the expert hidden dim;
///    partial down-projections are reduce-scattered over `tensor`.
///  * The load-balance loss and the bias update are global: their statistics are summed over all
///    ranks that hold different tokens.

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/config.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/layer.hpp>
#include <moe/nn/expert_ffn.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>
#include <moe/routing/router.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace moe {

/// \brief One MoE layer over MPI ranks (see the file comment for the strategies).
///
/// Collective calls: the constructor, forward() and backward() are collective over `comm`;
/// every rank must call them with the same configuration (checked before the first collective:
/// a rank whose config differs gets the same ConfigError as every other rank).
///
/// \tparam Scalar float or double.
/// \tparam Policy moe::Policies<Routing, Gmm>; the partition is decided at run time by the mesh.
template <class Scalar, class Policy = DefaultPolicies,
          class ExecSpace = Kokkos::DefaultExecutionSpace>
class DistributedMoeLayer {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using params_type = Parameters<Scalar, memory_space>;
  using view1 = View1<Scalar, memory_space>;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using cview3 = View3<Scalar const, memory_space>;

  /// \brief Collective. Builds the mesh and the layout for a global batch [global_batch,
  /// seq_len, D], checks that every rank has the same configuration, allocates zero local
  /// parameter blocks.
  DistributedMoeLayer(MPI_Comm comm, LayerConfig const& cfg, ParallelConfig const& par,
                      std::int64_t global_batch, std::int64_t seq_len,
                      ExecSpace const& space = ExecSpace())
      : world_(comm), cfg_(cfg), par_(par), space_(space), B_(global_batch), S_(seq_len) {
    // One agreement per part keeps each quoted value short enough to show where ranks differ.
    comm::check_agreement(world_, "layer configuration (LayerConfig)", describe(cfg));
    comm::check_agreement(world_, "parallel configuration (ParallelConfig)", par.describe());
    comm::check_agreement(world_, "global batch shape",
                          "B=" + std::to_string(global_batch) + ";S=" + std::to_string(seq_len));
    comm::collective_guard(world_, [&] { setup_layout(); });
    mesh_comm_ = std::make_unique<comm::MeshComm>(world_, mesh_);
    make_groups();
    kind_ = routing::resolve(typename Policy::routing_policy{}, cfg_);
    router_ = routing::Router<Scalar, ExecSpace>(cfg_, kind_);
    params_ = alloc_params("moe::param::");
  }

  LayerConfig const& config() const { return cfg_; }
  ParallelConfig const& parallel_config() const { return par_; }
  sharding::Mesh const& mesh() const { return mesh_; }
  /// How the routed experts are reached on this layout.
  ExpertRoute expert_route() const { return route_; }
  /// Local parameter blocks (storage layout); see block(). The non-const access counts as a
  /// write (weights_changed()); code that keeps the reference or the views' pointers and writes
  /// through them later must call weights_changed() after each write.
  params_type& parameters() {
    weights_changed();
    return params_;
  }
  params_type const& parameters() const { return params_; }

  /// \brief Declares the local parameter blocks written (optimizer step, checkpoint load,
  /// resharding): packed copies of the expert weights are remade on the next forward. Weights
  /// gathered over FSDP axes get a new version at every gather anyway.
  void weights_changed() { ++weights_version_; }
  /// Version of the expert weights the last forward computed with.
  std::uint64_t weights_version() const { return weights_version_; }
  /// The packed copies of the expert weights kept by the GEMM backend (statistics, tests).
  gmm::PackCache const& pack_cache() const { return ffn_.pack_cache(); }

  /// \brief The block of `name` this rank holds: "x", "y", "dy", "dx" ([B,S,D]), or a parameter
  /// name (gate, gate_bias, wi_0, wi_1, wo, shared_wi_0, shared_wi_1, shared_wo; gradients have
  /// the same blocks as their parameters).
  TensorBlock block(std::string const& name) const { return layout_.block(name); }

  /// Collectives of the last forward + backward, with bytes sent by this rank.
  distributed::CommLog const& comm_log() const { return log_; }
  /// Layout of every weight (storage, gathered and sliced axes, token axes reduced).
  std::vector<distributed::WeightLayout> const& weight_layouts() const { return layout_.weights; }
  /// The whole layout (mesh, axes, route, weights); see moe::make_plan for a printable form.
  distributed::Layout const& layout() const { return layout_; }
  /// Mesh axes the batch is split over.
  std::vector<std::string> const& batch_axes() const { return batch_axes_; }

  /// \brief forward() and backward() for any View types: LayoutRight Views of this layer's
  /// Scalar and memory space convert (e.g. non-const x); anything else, such as a LayoutLeft
  /// View, fails to compile with a static_assert naming the rule (detail::api_view).
  template <class XView, class YView>
  void forward(XView const& x, YView const& y) {
    forward(detail::api_view<cview3>(x), detail::api_view<view3>(y));
  }
  template <class DyView, class DxView>
  void backward(DyView const& dy, DxView const& dx, params_type& grads) {
    backward(detail::api_view<cview3>(dy), detail::api_view<view3>(dx), grads);
  }

  /// \brief Collective. y_local = MoE(x_local), both [B/batch_parts, S, D].
  void forward(cview3 x, view3 y) {
    detail::Region region("moe::dist::forward");
    log_.records.clear();
    log_.in_backward = false;
    std::int64_t const D = cfg_.base_emb_dim;
    comm::collective_guard(world_, [&] {
      auto const want = block("x").local_shape;
      detail::require<ShapeError>(
          std::int64_t(x.extent(0)) == want[0] && std::int64_t(x.extent(1)) == want[1] &&
              std::int64_t(x.extent(2)) == want[2],
          "x is [", x.extent(0), ",", x.extent(1), ",", x.extent(2), "] but this rank's block is [",
          want[0], ",", want[1], ",", want[2], "]");
      detail::require<ShapeError>(
          y.extent(0) == x.extent(0) && y.extent(1) == x.extent(1) && y.extent(2) == x.extent(2),
          "y must have the shape of x");
      check_param_shapes(params_, "parameter");
      if (cfg_.check_finite) {
        require_finite(cview2(x.data(), x.extent(0) * S_, D), "x");
        // The router reads every gate column for every token: scanned up front (cheap, [D,E]).
        require_finite(params_.gate, block_name("gate"));
        if (cfg_.routed_bias) require_finite(params_.gate_bias, block_name("gate_bias"));
      }
    });
    T_ = std::int64_t(x.extent(0)) * S_;
    detail::ensure(space_, x_, "moe::dist::x", T_, D);
    Kokkos::deep_copy(space_, x_, cview2(x.data(), T_, D));
    gather_weights();
    auto y2 = view2(y.data(), T_, D);
    // Tokens the experts see: own (a2a, local), or the expert group's (ring).
    if (route_ == ExpertRoute::Ring) {
      detail::ensure(space_, xw_, "moe::dist::x_work", T_ * ep_().size(), D);
      gather_dim_(ep_(), x_, xw_, 0, "all-gather tokens (ring)");
    } else {
      xw_ = x_;
    }
    route_tokens();
    if (route_ == ExpertRoute::RaggedA2A) {
      a2a_forward(y2);
    } else {
      gathered_forward(y2);
    }
    if (cfg_.check_finite) {
      // As the single-rank layer: only a non-finite y pays for scanning the weights, and then
      // every rank names the first non-finite block it holds (block indices are local).
      bool const bad = !detail::all_finite(space_, y2);
      int any = bad ? 1 : 0, worst = 0;
      comm::detail::check_mpi(MPI_Allreduce(&any, &worst, 1, MPI_INT, MPI_MAX, world_.get()),
                              "MPI_Allreduce");
      if (worst) {
        comm::collective_guard(world_, [&] {
          params_.for_each(
              [&](char const* name, auto const& v) { require_finite(v, block_name(name)); });
          detail::require<InputError>(
              !bad,
              "y holds NaN or Inf: every input and weight block is finite, so the layer "
              "overflowed");
        });
      }
    }
    have_forward_ = true;
  }

  /// \brief Collective. Gradients of sum(y * dy) + lb_loss (summed over all ranks) w.r.t. the
  /// local x block (dx) and the local parameter blocks (grads; allocated if empty).
  void backward(cview3 dy, view3 dx, params_type& grads) {
    detail::Region region("moe::dist::backward");
    std::int64_t const D = cfg_.base_emb_dim;
    comm::collective_guard(world_, [&] {
      detail::require<Error>(have_forward_, "backward called without a forward");
      detail::require<ShapeError>(
          std::int64_t(dy.extent(0)) * S_ == T_ && dy.extent(1) == std::size_t(S_) &&
              dy.extent(2) == std::size_t(D) && dx.extent(0) == dy.extent(0) &&
              dx.extent(1) == dy.extent(1) && dx.extent(2) == dy.extent(2),
          "dy and dx must have the shape of the forward's x");
      if (cfg_.check_finite) require_finite(cview2(dy.data(), T_, D), "dy");
    });
    log_.in_backward = true;
    if (!grads.gate.data()) grads = alloc_params("moe::grad::");
    auto dy2 = cview2(dy.data(), T_, D);
    auto dx2 = view2(dx.data(), T_, D);
    alloc_compute_grads();
    std::int64_t const K = cfg_.num_experts_per_tok;
    detail::ensure(space_, dw_, "moe::dist::d_weights", T_, K);
    if (route_ == ExpertRoute::RaggedA2A) {
      a2a_backward(dy2, dx2);
    } else {
      gathered_backward(dy2, dx2);
    }
    router_backward(dx2);
    reduce_grads(grads);
    have_forward_ = false;
  }

  /// Load-balance loss of the last forward: the global value, the same on every rank.
  double lb_loss() const { return lb_loss_; }
  /// Loss-free bias update of the last forward (global counts), [E]; empty unless enabled.
  std::vector<double> const& bias_update() const { return bias_update_; }
  /// Experts chosen for this rank's tokens, [T_local, K].
  View2<int, memory_space> expert_ids() const {
    return router_.own_rows(router_.state().expert_ids);
  }
  /// Combine weights for this rank's tokens before capacity dropping, [T_local, K].
  view2 weights() const { return router_.own_rows(router_.state().weights); }

 private:
  // ------------------------------------------------------------------ layout ----------------
  std::int64_t axis_size(std::string const& a) const { return layout_.axis_size(a); }
  std::int64_t parts(std::vector<std::string> const& axes) const { return layout_.parts(axes); }
  /// Row-major index of this rank over `axes` (in the given order).
  std::int64_t shard_index(std::vector<std::string> const& axes) const {
    return layout_.shard_index(axes);
  }
  static bool contains(std::vector<std::string> const& v, std::string const& a) {
    return distributed::layout_detail::contains(v, a);
  }
  static std::vector<std::string> minus(std::vector<std::string> const& a,
                                        std::vector<std::string> const& b) {
    return distributed::layout_detail::minus(a, b);
  }
  static std::string join(std::vector<std::string> const& v) {
    return distributed::layout_detail::join(v);
  }

  distributed::WeightLayout const& weight(std::string const& name) const {
    return layout_.weight(name);
  }

  /// Resolves every spec, checks divisibility (distributed::compute_layout, a pure function of
  /// the agreed configuration, so every rank throws the same error) and keeps what the step uses.
  void setup_layout() {
    layout_ = distributed::compute_layout(cfg_, par_, world_.size(), world_.rank(), B_, S_,
                                          std::is_same_v<typename Policy::gmm_policy, gmm::Dense>);
    mesh_ = layout_.mesh;
    rules_ = layout_.rules;
    batch_axes_ = layout_.batch_axes;
    ep_axes_ = layout_.ep_axes;
    tp_axes_ = layout_.tp_axes;
    batch_parts_ = layout_.batch_parts;
    batch_index_ = layout_.batch_index;
    route_ = layout_.route;
    L_ = layout_.local_experts;
    e0_ = layout_.first_expert;
  }

  void make_groups() {
    auto group = [&](std::vector<std::string> const& axes) { mesh_comm_->group(axes); };
    // Every group any rank may need, created in the same order everywhere (collective).
    group(ep_axes_);
    group(tp_axes_);
    group(batch_axes_);
    for (auto const& w : layout_.weights) {
      for (auto const& d : w.dims) {
        group(d.gather);
        group(d.slice);
        if (par_.moe_fsdp_use_two_stage_all_gather)
          for (auto const& a : d.gather) group({a});
        group(minus(d.gather, minus(d.gather, w.reduce)));  // gathered axes that also reduce
      }
      std::vector<std::string> gathered;
      for (auto const& d : w.dims)
        for (auto const& a : d.gather) gathered.push_back(a);
      group(minus(w.reduce, gathered));
    }
    ep_g_ = &group_of(ep_axes_);
    tp_g_ = &group_of(tp_axes_);
    batch_g_ = &group_of(batch_axes_);
  }

  distributed::AxisGroup const& ep_() const { return *ep_g_; }
  distributed::AxisGroup const& tp_() const { return *tp_g_; }
  distributed::AxisGroup const& batch_() const { return *batch_g_; }

  /// A group make_groups() made (MeshComm's cache; the const lookup never communicates).
  distributed::AxisGroup const& group_of(std::vector<std::string> const& axes) const {
    return static_cast<comm::MeshComm const&>(*mesh_comm_).group(axes);
  }

  params_type alloc_params(std::string const& prefix) const {
    params_type p;
    auto shape = [&](char const* n) { return block(n).local_shape; };
    auto v2 = [&](char const* n) {
      auto s = shape(n);
      return view2(prefix + n, s[0], s[1]);
    };
    auto v3 = [&](char const* n) {
      auto s = shape(n);
      return view3(prefix + n, s[0], s[1], s[2]);
    };
    p.gate = v2("gate");
    if (cfg_.routed_bias) p.gate_bias = view1(prefix + "gate_bias", cfg_.num_experts);
    p.wi_0 = v3("wi_0");
    p.wi_1 = v3("wi_1");
    p.wo = v3("wo");
    if (cfg_.shared_mlp_dim() > 0) {
      p.shared_wi_0 = v2("shared_wi_0");
      p.shared_wi_1 = v2("shared_wi_1");
      p.shared_wo = v2("shared_wo");
    }
    return p;
  }

  void check_param_shapes(params_type const& p, char const* what) const {
    p.for_each([&](char const* name, auto const& v) {
      auto const want = block(name).local_shape;
      bool ok = v.data() != nullptr || v.span() == 0;
      for (std::size_t r = 0; r < want.size(); ++r) ok = ok && std::int64_t(v.extent(r)) == want[r];
      if (!ok)
        throw ShapeError(
            detail::cat(what, " ", name, " has a block of the wrong shape on this rank"));
    });
  }

  /// `name`, or "name (rank r's block at offset [..] of [..])" when this rank stores a block of
  /// it, so that an index in a message can be found in the global tensor.
  std::string block_name(std::string const& name) const {
    auto const b = block(name);
    if (b.local_shape == b.global_shape) return name;
    return detail::cat(name, " (the block of rank ", world_.rank(), " at offset ",
                       detail::shape_text(b.offset), " of ", detail::shape_text(b.global_shape),
                       ")");
  }

  template <class V>
  void require_finite(V const& v, std::string const& name) const {
    detail::require_finite(space_, v, name);
  }

  // ------------------------------------------------------------------ weights ---------------
  /// Compute block of a stored weight: gather over `gather` axes, slice over `slice` axes.
  template <class V>
  V to_compute(distributed::WeightLayout const& w, V const& stored) {
    // All gathers first, then the slices: a gather must combine blocks cut the same way.
    V cur = stored;
    int k = 0;  // pool key of each intermediate
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& dl = w.dims[d];
      if (dl.gather.empty()) continue;
      std::vector<std::vector<std::string>> stages{dl.gather};
      if (par_.moe_fsdp_use_two_stage_all_gather && dl.gather.size() > 1) {
        // one collective per axis, minor axis first, so blocks stay in row-major order
        stages.clear();
        for (auto it = dl.gather.rbegin(); it != dl.gather.rend(); ++it) stages.push_back({*it});
      }
      for (auto const& st : stages) {
        auto const& g = group_of(st);
        V next = grown(cur, d, g.size(), "gathered_" + w.name + "#" + std::to_string(k++));
        gather_dim_(g, cur, next, int(d), "gather " + w.name);
        cur = next;
      }
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& dl = w.dims[d];
      if (dl.slice.empty()) continue;
      std::int64_t const P = parts(dl.slice);
      V next = grown(cur, d, 1, "sliced_" + w.name + "#" + std::to_string(k++), P);
      distributed::slice_dim(space_, int(P), int(shard_index(dl.slice)), cur, next, int(d));
      cur = next;
    }
    return cur;
  }

  /// A view like v with dimension d multiplied by mul and divided by div, on the pool buffer of
  /// `key` (kept from step to step; keys must differ between views alive at the same time).
  template <class V>
  V grown(V const& v, std::size_t d, std::int64_t mul, std::string const& key,
          std::int64_t div = 1) {
    std::size_t ext[3] = {v.extent(0), V::rank > 1 ? v.extent(1) : 1,
                          V::rank > 2 ? v.extent(2) : 1};
    ext[d] = ext[d] * mul / div;
    auto buf = pool_.template get<Scalar>(key, ext[0] * ext[1] * ext[2]);
    if constexpr (V::rank == 1)
      return V(buf.data(), ext[0]);
    else if constexpr (V::rank == 2)
      return V(buf.data(), ext[0], ext[1]);
    else
      return V(buf.data(), ext[0], ext[1], ext[2]);
  }

  template <class InV, class OutV>
  void gather_dim_(distributed::AxisGroup const& g, InV const& in, OutV const& out, int d,
                   std::string const& what) {
    distributed::gather_dim(space_, g, in, out, d, &log_, what, &pool_);
  }
  template <class InV, class OutV>
  void reduce_scatter_dim_(distributed::AxisGroup const& g, InV const& in, OutV const& out, int d,
                           std::string const& what) {
    distributed::reduce_scatter_dim(space_, g, in, out, d, &log_, what, &pool_);
  }

  void gather_weights() {
    detail::Region region("moe::dist::gather_weights");
    cp_.gate = to_compute(weight("gate"), params_.gate);
    if (cfg_.routed_bias) cp_.gate_bias = params_.gate_bias;
    cp_.wi_0 = to_compute(weight("wi_0"), params_.wi_0);
    cp_.wi_1 = to_compute(weight("wi_1"), params_.wi_1);
    cp_.wo = to_compute(weight("wo"), params_.wo);
    // A gathered (or sliced) expert weight is new data in a reused buffer: a new version.
    if (cp_.wi_0.data() != params_.wi_0.data() || cp_.wi_1.data() != params_.wi_1.data() ||
        cp_.wo.data() != params_.wo.data())
      weights_changed();
    if (cfg_.shared_mlp_dim() > 0) {
      cp_.shared_wi_0 = to_compute(weight("shared_wi_0"), params_.shared_wi_0);
      cp_.shared_wi_1 = to_compute(weight("shared_wi_1"), params_.shared_wi_1);
      cp_.shared_wo = to_compute(weight("shared_wo"), params_.shared_wo);
    }
  }

  /// Zeroed compute-block gradients, allocated once and reused while the shapes stay.
  void alloc_compute_grads() {
    auto zeroed = [&](auto& g, auto const& like, char const* label) {
      if constexpr (std::decay_t<decltype(g)>::rank == 1)
        detail::ensure(space_, g, label, like.extent(0));
      else if constexpr (std::decay_t<decltype(g)>::rank == 2)
        detail::ensure(space_, g, label, like.extent(0), like.extent(1));
      else
        detail::ensure(space_, g, label, like.extent(0), like.extent(1), like.extent(2));
      Kokkos::deep_copy(space_, g, Scalar(0));
    };
    zeroed(gc_.gate, cp_.gate, "moe::dist::d_gate");
    if (cfg_.routed_bias) zeroed(gc_.gate_bias, cp_.gate_bias, "moe::dist::d_gate_bias");
    zeroed(gc_.wi_0, cp_.wi_0, "moe::dist::d_wi_0");
    zeroed(gc_.wi_1, cp_.wi_1, "moe::dist::d_wi_1");
    zeroed(gc_.wo, cp_.wo, "moe::dist::d_wo");
    if (cfg_.shared_mlp_dim() > 0) {
      zeroed(gc_.shared_wi_0, cp_.shared_wi_0, "moe::dist::d_shared_wi_0");
      zeroed(gc_.shared_wi_1, cp_.shared_wi_1, "moe::dist::d_shared_wi_1");
      zeroed(gc_.shared_wo, cp_.shared_wo, "moe::dist::d_shared_wo");
    }
  }

  /// Compute-block gradient -> stored-block gradient: sum over the token axes that differ,
  /// transposing the gathers (reduce-scatter) and the slices (all-gather).
  template <class V>
  void to_storage(distributed::WeightLayout const& w, V const& computed, V const& out) {
    std::vector<std::string> gathered;
    for (auto const& d : w.dims)
      for (auto const& a : d.gather) gathered.push_back(a);
    V cur = computed;
    int k = 0;  // pool key of each intermediate
    distributed::all_reduce(space_, group_of(minus(w.reduce, gathered)), cur, &log_,
                            "reduce d_" + w.name);
    // The transpose of to_compute: undo the slices (all-gather), then the gathers.
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& dl = w.dims[d];
      if (dl.slice.empty()) continue;
      auto const& g = group_of(dl.slice);
      V next = grown(cur, d, g.size(), "unsliced_d_" + w.name + "#" + std::to_string(k++));
      gather_dim_(g, cur, next, int(d), "unslice d_" + w.name);
      cur = next;
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& dl = w.dims[d];
      if (dl.gather.empty()) continue;
      auto const summed = minus(dl.gather, minus(dl.gather, w.reduce));
      std::int64_t const P = parts(dl.gather);
      V next = grown(cur, d, 1, "scattered_d_" + w.name + "#" + std::to_string(k++), P);
      if (summed.size() == dl.gather.size()) {
        reduce_scatter_dim_(group_of(dl.gather), cur, next, int(d), "reduce-scatter d_" + w.name);
      } else {
        distributed::all_reduce(space_, group_of(summed), cur, &log_, "reduce d_" + w.name);
        distributed::slice_dim(space_, int(P), int(shard_index(dl.gather)), cur, next, int(d));
      }
      cur = next;
    }
    Kokkos::deep_copy(space_, out, cur);
  }

  void reduce_grads(params_type& g) {
    detail::Region region("moe::dist::reduce_grads");
    to_storage(weight("gate"), gc_.gate, g.gate);
    if (cfg_.routed_bias) to_storage(weight("gate_bias"), gc_.gate_bias, g.gate_bias);
    to_storage(weight("wi_0"), gc_.wi_0, g.wi_0);
    to_storage(weight("wi_1"), gc_.wi_1, g.wi_1);
    to_storage(weight("wo"), gc_.wo, g.wo);
    if (cfg_.shared_mlp_dim() > 0) {
      to_storage(weight("shared_wi_0"), gc_.shared_wi_0, g.shared_wi_0);
      to_storage(weight("shared_wi_1"), gc_.shared_wi_1, g.shared_wi_1);
      to_storage(weight("shared_wo"), gc_.shared_wo, g.shared_wo);
    }
  }

  // ------------------------------------------------------------------ routing ---------------
  void route_tokens() {
    int const K = cfg_.num_experts_per_tok;
    // Random routing draws from the global token index: each member's rows are routed with its
    // own offset (a member's tokens are a contiguous block of the global batch).
    bool const ring = route_ == ExpertRoute::Ring;
    int const members = ring ? ep_().size() : 1;
    std::vector<std::uint64_t> offsets(std::size_t(members), 0);
    for (int m = 0; m < members; ++m)
      offsets[std::size_t(m)] = std::uint64_t((ring ? member_batch_index(m) : batch_index_) * T_);
    router_.forward(space_, cview2(xw_), cp_.gate, cp_.gate_bias, S_, offsets,
                    ring ? ep_().rank() : 0);
    // Global load-balance loss over this rank's own sequences, summed over the batch axes.
    lb_loss_ = 0;
    if (cfg_.load_balance_loss_weight > 0) {
      View1<double, Kokkos::HostSpace> v("moe::dist::lb_sum", 1);
      v(0) = router_.lb_sum();
      distributed::all_reduce(Kokkos::DefaultHostExecutionSpace(), batch_(), v, &log_, "lb loss");
      lb_loss_ = router_.lb_loss(v(0), B_);
    }
    bias_update_.clear();
    if (cfg_.routed_bias_update_rate > 0) {
      auto counts = router_.expert_counts();
      View1<std::int64_t, Kokkos::HostSpace> h(counts.data(), counts.size());
      distributed::all_reduce(Kokkos::DefaultHostExecutionSpace(), batch_(), h, &log_,
                              "bias counts");
      bias_update_ = routing::bias_update(counts, B_ * S_ * K, cfg_.routed_bias_update_rate);
    }
  }

  /// Batch block index of the m-th member of this rank's expert group.
  std::int64_t member_batch_index(int m) const {
    // The member differs from this rank only in the expert axes: substitute its coordinates.
    std::int64_t idx = 0;
    int const rank = world_.rank();
    std::int64_t rem = m;
    std::vector<std::int64_t> ep_coord(ep_axes_.size());
    for (std::size_t i = ep_axes_.size(); i-- > 0;) {
      ep_coord[i] = rem % axis_size(ep_axes_[i]);
      rem /= axis_size(ep_axes_[i]);
    }
    for (auto const& a : batch_axes_) {
      auto it = std::find(ep_axes_.begin(), ep_axes_.end(), a);
      std::int64_t const c = it != ep_axes_.end() ? ep_coord[it - ep_axes_.begin()]
                                                  : (mesh_.has_axis(a) ? mesh_.coord(rank, a) : 0);
      idx = idx * axis_size(a) + c;
    }
    return idx;
  }

  /// d_weights -> gate logits -> dx (+=) and the gate / bias gradients (compute blocks).
  void router_backward(view2 dx) {
    router_.backward(space_, cview2(x_), cp_.gate, cview2(dw_), router_.lb_coefficient(B_), dx,
                     gc_.gate, gc_.gate_bias);
  }

  // ------------------------------------------------------------ ragged all-to-all path ------
  /// Rows the dispatch plan (reverse: its reverse) moves from this rank to other ranks; rows a
  /// rank keeps for itself are copied, not sent, and are not counted in the comm log.
  std::int64_t a2a_rows_to_others(bool reverse) const {
    auto const& rows = reverse ? a2a_->recv_counts() : a2a_->kept_send_counts();
    std::int64_t n = 0;
    for (std::size_t j = 0; j < rows.size(); ++j)
      if (int(j) != a2a_->comm().rank()) n += rows[j];
    return n;
  }
  void a2a_forward(view2 y) {
    detail::Region region("moe::dispatch::ragged_all_to_all");
    int const D = cfg_.base_emb_dim, E = cfg_.num_experts, K = cfg_.num_experts_per_tok;
    int const ep = ep_().size(), tp = tp_().size();
    permute::sort_by_expert(space_, View2<int const, memory_space>(router_.state().expert_ids),
                            View2<int const, memory_space>(router_.state().kept), E, perm_);
    std::int64_t const n_o = perm_.rows();
    detail::ensure(space_, xs_o_, "moe::dist::x_sorted", n_o, D);
    permute::gather_rows(space_, cview2(x_), View1<std::int64_t const, memory_space>(perm_.perm), K,
                         xs_o_);
    auto const& off = perm_.groups.offsets_host;
    std::vector<std::int64_t> sizes(E), send(ep);
    for (int e = 0; e < E; ++e) sizes[e] = off(e + 1) - off(e);
    for (int j = 0; j < ep; ++j) send[j] = off((j + 1) * L_) - off(j * L_);
    std::int64_t const R =
        par_.ragged_buffer_factor > 0
            ? comm::ragged_buffer_size(T_ * K, ep, E, K, par_.ragged_buffer_factor)
            : -1;
    a2a_ = std::make_unique<comm::RaggedAllToAll>(ep_().comm, send, R);
    log_.add("dispatch", "all-to-all", ep_axes_,
             a2a_rows_to_others(false) * D * std::int64_t(sizeof(Scalar)));
    detail::ensure(space_, xr_, "moe::dist::x_received", a2a_->recv_total(), D);
    a2a_->forward(space_, xs_o_, xr_);
    // Everyone's group sizes -> the local regrouping of received rows by local expert.
    View1<std::int64_t, Kokkos::HostSpace> mine("moe::dist::sizes", E),
        all("moe::dist::all_sizes", E * ep);
    std::copy(sizes.begin(), sizes.end(), mine.data());
    comm::all_gather(ep_().comm, Kokkos::DefaultHostExecutionSpace(), mine, all);
    std::vector<std::int64_t> G(all.data(), all.data() + E * ep);
    permute::make_local_permutation(space_, permute::local_layout(G, E, ep, ep_().rank(), R), lp_);
    std::int64_t const n = lp_.rows();
    detail::ensure(space_, xs_, "moe::dist::x_local", n, D);
    permute::permute_rows(space_, lp_, xr_, xs_);
    groups_local_.offsets = lp_.group_offsets;
    groups_local_.offsets_host = lp_.group_offsets_host;
    detail::ensure(space_, ys_, "moe::dist::y_local", n, D);
    ffn_.forward(space_, cfg_.mlp_activation, xs_, groups_local_, cp_.wi_0, cp_.wi_1, cp_.wo, ys_,
                 weights_version_);
    // Partial down-projections (tensor-split hidden dim) -> column blocks of D.
    std::int64_t const Dc = D / tp;
    detail::ensure(space_, ys_c_, "moe::dist::y_local_cols", n, Dc);
    reduce_scatter_dim_(tp_(), ys_, ys_c_, 1, "reduce-scatter y (tensor)");
    detail::ensure(space_, yr_c_, "moe::dist::y_received_cols", a2a_->recv_total(), Dc);
    permute::unpermute_rows(space_, lp_, ys_c_, yr_c_);
    detail::ensure(space_, ys_o_c_, "moe::dist::y_sorted_cols", n_o, Dc);
    log_.add("combine", "all-to-all", ep_axes_,
             a2a_rows_to_others(true) * Dc * std::int64_t(sizeof(Scalar)));
    a2a_->reverse(space_, yr_c_, ys_o_c_);
    detail::ensure(space_, y_c_, "moe::dist::y_cols", T_, Dc);
    permute::combine(space_, cview2(ys_o_c_),
                     View1<std::int64_t const, memory_space>(perm_.inverse),
                     cview2(router_.state().weights), false, y_c_);
    finish_output(y);
  }

  void a2a_backward(cview2 dy, view2 dx) {
    detail::Region region("moe::dispatch::ragged_all_to_all::backward");
    int const D = cfg_.base_emb_dim, K = cfg_.num_experts_per_tok, tp = tp_().size();
    std::int64_t const Dc = D / tp, n_o = perm_.rows(), n = lp_.rows();
    // This rank's column block of dy.
    detail::ensure(space_, dy_c_, "moe::dist::dy_cols", T_, Dc);
    distributed::slice_dim(space_, tp, tp_().rank(), dy, dy_c_, 1);
    detail::ensure(space_, dys_o_c_, "moe::dist::dy_sorted_cols", n_o, Dc);
    permute::combine_backward(space_, cview2(dy_c_), cview2(ys_o_c_),
                              View1<std::int64_t const, memory_space>(perm_.perm),
                              View1<std::int64_t const, memory_space>(perm_.inverse),
                              cview2(router_.state().weights), dys_o_c_, dw_);
    distributed::all_reduce(space_, tp_(), dw_, &log_, "reduce d_weights (tensor)");
    detail::ensure(space_, dyr_c_, "moe::dist::dy_received_cols", a2a_->recv_total(), Dc);
    log_.add("dispatch d_y", "all-to-all", ep_axes_,
             a2a_rows_to_others(false) * Dc * std::int64_t(sizeof(Scalar)));
    a2a_->forward(space_, dys_o_c_, dyr_c_);
    detail::ensure(space_, dys_c_, "moe::dist::dy_local_cols", n, Dc);
    permute::permute_rows(space_, lp_, dyr_c_, dys_c_);
    detail::ensure(space_, dys_, "moe::dist::dy_local", n, D);
    gather_dim_(tp_(), dys_c_, dys_, 1, "all-gather d_y (tensor)");
    // dxs (partial over the tensor-split hidden dim) overwrites dys.
    ffn_.backward(space_, dys_, groups_local_, cp_.wi_0, cp_.wi_1, cp_.wo, dys_, gc_.wi_0, gc_.wi_1,
                  gc_.wo);
    reduce_scatter_dim_(tp_(), dys_, dys_c_, 1, "reduce-scatter d_x (tensor)");
    permute::unpermute_rows(space_, lp_, dys_c_, dyr_c_);
    log_.add("combine d_x", "all-to-all", ep_axes_,
             a2a_rows_to_others(true) * Dc * std::int64_t(sizeof(Scalar)));
    a2a_->reverse(space_, dyr_c_, dys_o_c_);
    permute::gather_rows_backward(space_, cview2(dys_o_c_),
                                  View1<std::int64_t const, memory_space>(perm_.inverse), K, false,
                                  dy_c_);
    gather_dim_(tp_(), dy_c_, dx, 1, "all-gather d_x (tensor)");
    shared_backward(dy, dx);
  }

  // ------------------------------------------------ token-gathering paths (ring, replicated) --
  /// Local experts [e0, e0+L) on the working tokens; yw [Tw, D] partial over the expert group
  /// (only local experts) and the tensor-split hidden dim.
  void gathered_forward(view2 y) {
    detail::Region region("moe::dispatch::gathered");
    int const D = cfg_.base_emb_dim;
    std::int64_t const Tw = xw_.extent(0);
    detail::ensure(space_, yw_, "moe::dist::y_work", Tw, D);
    if (dense()) {
      dense_forward();
    } else {
      local_ids();
      int const K = cfg_.num_experts_per_tok;
      permute::sort_by_expert(space_, View2<int const, memory_space>(lids_),
                              View2<int const, memory_space>(lkept_), L_, perm_);
      std::int64_t const n = perm_.rows();
      detail::ensure(space_, xs_, "moe::dist::x_local", n, D);
      detail::ensure(space_, ys_, "moe::dist::y_local", n, D);
      permute::gather_rows(space_, cview2(xw_), View1<std::int64_t const, memory_space>(perm_.perm),
                           K, xs_);
      ffn_.forward(space_, cfg_.mlp_activation, xs_, perm_.groups, cp_.wi_0, cp_.wi_1, cp_.wo, ys_,
                   weights_version_);
      permute::combine(space_, cview2(ys_), View1<std::int64_t const, memory_space>(perm_.inverse),
                       cview2(router_.state().weights), false, yw_);
    }
    // Sum the expert group's partial outputs onto each rank's own tokens, then split D over tensor.
    detail::ensure(space_, yo_, "moe::dist::y_own", T_, D);
    tokens_reduce(yw_, yo_, "y");
    detail::ensure(space_, y_c_, "moe::dist::y_cols", T_, D / tp_().size());
    reduce_scatter_dim_(tp_(), yo_, y_c_, 1, "reduce-scatter y (tensor)");
    finish_output(y);
  }

  void gathered_backward(cview2 dy, view2 dx) {
    detail::Region region("moe::dispatch::gathered::backward");
    int const D = cfg_.base_emb_dim, K = cfg_.num_experts_per_tok;
    std::int64_t const Tw = xw_.extent(0);
    detail::ensure(space_, dyw_, "moe::dist::dy_work", Tw, D);
    tokens_gather(dy, dyw_, "d_y");
    detail::ensure(space_, dww_, "moe::dist::d_weights_work", Tw, K);
    detail::ensure(space_, dxw_, "moe::dist::dx_work", Tw, D);
    if (dense()) {
      dense_backward();
    } else {
      std::int64_t const n = perm_.rows();
      View1<std::int64_t const, memory_space> perm(perm_.perm), inv(perm_.inverse);
      detail::ensure(space_, dys_, "moe::dist::dy_local", n, D);
      permute::combine_backward(space_, cview2(dyw_), cview2(ys_), perm, inv,
                                cview2(router_.state().weights), dys_, dww_);
      ffn_.backward(space_, dys_, perm_.groups, cp_.wi_0, cp_.wi_1, cp_.wo, dys_, gc_.wi_0,
                    gc_.wi_1, gc_.wo);
      permute::gather_rows_backward(space_, cview2(dys_), inv, K, false, dxw_);
    }
    // ys and dxs are partial over the tensor-split hidden dim; the expert group's partial
    // d_weights / dx go back to the ranks that own the tokens.
    distributed::all_reduce(space_, tp_(), dww_, &log_, "reduce d_weights (tensor)");
    tokens_reduce(dww_, dw_, "d_weights");
    distributed::all_reduce(space_, tp_(), dxw_, &log_, "reduce d_x (tensor)");
    tokens_reduce(dxw_, dx, "d_x");
    shared_backward(dy, dx);
  }

  /// Working tokens -> own tokens: reduce-scatter (ring) or all-reduce (replicated) over the
  /// expert group; a copy without expert parallelism.
  void tokens_reduce(view2 work, view2 own, char const* what) {
    if (route_ == ExpertRoute::Ring) {
      reduce_scatter_dim_(ep_(), work, own, 0, std::string("reduce-scatter ") + what + " (expert)");
    } else {
      distributed::all_reduce(space_, ep_(), work, &log_,
                              std::string("reduce ") + what + " (expert)");
      Kokkos::deep_copy(space_, own, work);
    }
  }
  /// Own tokens -> working tokens (the transpose of tokens_reduce).
  void tokens_gather(cview2 own, view2 work, char const* what) {
    if (route_ == ExpertRoute::Ring)
      gather_dim_(ep_(), own, work, 0, std::string("all-gather ") + what + " (expert)");
    else
      Kokkos::deep_copy(space_, work, own);
  }

  bool dense() const {
    return std::is_same_v<typename Policy::gmm_policy, gmm::Dense> || !cfg_.sparse_matmul;
  }

  /// Local expert ids (global id - e0) and the kept mask restricted to local experts.
  void local_ids() {
    std::int64_t const Tw = xw_.extent(0);
    int const K = cfg_.num_experts_per_tok;
    int const e0 = int(e0_), L = int(L_);
    detail::ensure(space_, lids_, "moe::dist::local_ids", Tw, K);
    detail::ensure(space_, lkept_, "moe::dist::local_kept", Tw, K);
    permute::local_expert_ids(space_, View2<int const, memory_space>(router_.state().expert_ids),
                              View2<int const, memory_space>(router_.state().kept), e0, L, lids_,
                              lkept_);
  }

  void dense_forward() {
    dense_.forward(space_, cfg_.mlp_activation, cview2(xw_),
                   View2<int const, memory_space>(router_.state().expert_ids),
                   View2<int const, memory_space>(router_.state().kept),
                   cview2(router_.state().weights), int(e0_), cp_.wi_0, cp_.wi_1, cp_.wo, yw_);
  }

  void dense_backward() {
    dense_.backward(space_, cview2(dyw_), cp_.wi_0, cp_.wi_1, cp_.wo, dxw_, dww_, gc_.wi_0,
                    gc_.wi_1, gc_.wo);
  }

  // ------------------------------------------------------------------ shared + output ----------
  /// y = all-gather over tensor of (expert column block + shared column block).
  void finish_output(view2 y) {
    int const D = cfg_.base_emb_dim;
    if (cfg_.shared_mlp_dim() > 0) {
      // EP-as-TP: the shared expert runs on the expert group's tokens with its hidden dim split
      // over tensor x expert; partial outputs go back to their tokens' owners, then to D columns.
      std::int64_t const Tg = T_ * shared_group();
      detail::ensure(space_, xsh_, "moe::dist::x_shared", Tg, D);
      shared_tokens_gather(cview2(x_), xsh_, "x");
      detail::ensure(space_, ysh_, "moe::dist::y_shared", Tg, D);
      Kokkos::deep_copy(space_, ysh_, Scalar(0));
      shared_.forward(space_, cfg_.mlp_activation, cview2(xsh_), cp_.shared_wi_0, cp_.shared_wi_1,
                      cp_.shared_wo, ysh_);
      detail::ensure(space_, yo_, "moe::dist::y_own", T_, D);
      shared_tokens_reduce(ysh_, yo_, "y shared");
      detail::ensure(space_, ysh_c_, "moe::dist::y_shared_cols", T_, D / tp_().size());
      reduce_scatter_dim_(tp_(), yo_, ysh_c_, 1, "reduce-scatter y shared (tensor)");
      detail::add_into(space_, ysh_c_, y_c_);
    }
    gather_dim_(tp_(), y_c_, y, 1, "all-gather y (tensor)");
  }

  int shared_group() const { return route_ == ExpertRoute::Replicated ? 1 : ep_().size(); }
  void shared_tokens_gather(cview2 own, view2 work, char const* what) {
    if (shared_group() > 1)
      gather_dim_(ep_(), own, work, 0, std::string("all-gather ") + what + " (shared, expert)");
    else
      Kokkos::deep_copy(space_, work, own);
  }
  void shared_tokens_reduce(view2 work, view2 own, char const* what) {
    if (shared_group() > 1) {
      reduce_scatter_dim_(ep_(), work, own, 0, std::string("reduce-scatter ") + what + " (expert)");
    } else {
      distributed::all_reduce(space_, ep_(), work, &log_,
                              std::string("reduce ") + what + " (expert)");
      Kokkos::deep_copy(space_, own, work);
    }
  }

  void shared_backward(cview2 dy, view2 dx) {
    if (cfg_.shared_mlp_dim() == 0) return;
    int const D = cfg_.base_emb_dim;
    std::int64_t const Tg = T_ * shared_group();
    detail::ensure(space_, dysh_, "moe::dist::dy_shared", Tg, D);
    shared_tokens_gather(dy, dysh_, "d_y");
    detail::ensure(space_, dxsh_, "moe::dist::dx_shared", Tg, D);
    Kokkos::deep_copy(space_, dxsh_, Scalar(0));
    shared_.backward(space_, cview2(dysh_), cp_.shared_wi_0, cp_.shared_wi_1, cp_.shared_wo, dxsh_,
                     gc_.shared_wi_0, gc_.shared_wi_1, gc_.shared_wo);
    distributed::all_reduce(space_, tp_(), dxsh_, &log_, "reduce d_x shared (tensor)");
    detail::ensure(space_, yo_, "moe::dist::y_own", T_, D);
    shared_tokens_reduce(dxsh_, yo_, "d_x shared");
    detail::add_into(space_, yo_, dx);
  }

  // ------------------------------------------------------------------ members ------------------
  comm::Communicator world_;
  LayerConfig cfg_;
  ParallelConfig par_;
  ExecSpace space_;
  std::int64_t B_ = 0, S_ = 0, T_ = 0;
  sharding::Mesh mesh_;
  sharding::LogicalRules rules_;
  std::unique_ptr<comm::MeshComm> mesh_comm_;  // the one cache of the axis groups
  distributed::AxisGroup const* ep_g_ = nullptr;
  distributed::AxisGroup const* tp_g_ = nullptr;
  distributed::AxisGroup const* batch_g_ = nullptr;
  std::vector<std::string> batch_axes_, ep_axes_, tp_axes_;
  std::int64_t batch_parts_ = 1, batch_index_ = 0, L_ = 0, e0_ = 0;
  ExpertRoute route_ = ExpertRoute::Local;
  distributed::Layout layout_;
  routing::Kind kind_;
  routing::Router<Scalar, ExecSpace> router_;
  params_type params_, cp_, gc_;       // stored blocks, compute blocks, compute-block gradients
  std::uint64_t weights_version_ = 0;  // of the compute blocks of the expert weights
  distributed::CommLog log_;
  moe::detail::ScratchPool<memory_space> pool_;  // per-step temporaries, kept between steps

  bool have_forward_ = false;
  double lb_loss_ = 0;
  std::vector<double> bias_update_;
  permute::Permutation<memory_space> perm_;
  permute::LocalPermutation<memory_space> lp_;
  gmm::Groups<memory_space> groups_local_;
  std::unique_ptr<comm::RaggedAllToAll> a2a_;
  using gmm_policy = std::conditional_t<std::is_same_v<typename Policy::gmm_policy, gmm::Dense>,
                                        gmm::Auto, typename Policy::gmm_policy>;
  nn::ExpertFfn<Scalar, gmm_policy, ExecSpace> ffn_;
  nn::DenseMlp<Scalar, ExecSpace> shared_;
  nn::DenseExperts<Scalar, ExecSpace> dense_;
  View2<int, memory_space> lids_, lkept_;
  view2 x_, xw_, xs_o_, xr_, xs_, ys_, ys_c_, yr_c_, ys_o_c_, y_c_, yw_, yo_, xsh_, ysh_, ysh_c_;
  view2 dw_, dy_c_, dys_o_c_, dyr_c_, dys_c_, dys_, dyw_, dww_, dxw_;
  view2 dysh_, dxsh_;
};

}  // namespace moe
