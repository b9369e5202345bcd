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
///    of shard-exp-on-fsdp, the expert dimension under shard_exp_on_fsdp / use_2d_fsdp_sharding)
///    and sliced over axes the compute spec adds (EP-as-TP for the shared
///    expert). Their gradients take the transposed path: all-gather <-> reduce-scatter, slice <->
///    all-gather; contributions of ranks that hold other tokens are summed.
///  * Routed experts: with the batch split over the expert axis the rows travel by ragged
///    all-to-all (dispatch, local permute, grouped GEMMs, reverse); with `use_ring_of_experts`,
///    a replicated batch, or the dense path whose dispatch spec lets the batch claim `expert`
///    (the default; `moe_dispatch_no_expert_sharding` peels it off and the dense path takes the
///    all-to-all) the tokens are all-gathered over the expert axis and the partial outputs
///    reduce-scattered back. Tensor parallelism splits the expert hidden dim;
///    partial down-projections are reduce-scattered over `tensor`.
///  * The load-balance loss and the bias update are global: their statistics are summed over all
///    ranks that hold different tokens.

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/config.hpp>
#include <moe/detail/blas.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/distributed/workspace.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/nn/expert_ffn.hpp>
#include <moe/parameters.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>
#include <moe/policies.hpp>
#include <moe/routing/router.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <utility>
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
class DistributedMoeLayer
    : public ParameterStore<Parameters<Scalar, typename ExecSpace::memory_space>> {
  using store = ParameterStore<Parameters<Scalar, typename ExecSpace::memory_space>>;
  using store::params_;
  using store::weights_version_;

 public:
  using store::weights_changed;
  using memory_space = typename ExecSpace::memory_space;
  using params_type = Parameters<Scalar, memory_space>;
  using view1 = View1<Scalar, memory_space>;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using cview3 = View3<Scalar const, memory_space>;
  using view2i = View2<int, memory_space>;

  /// \brief Collective. Builds the mesh and the layout for a global batch [global_batch,
  /// seq_len, D], checks that every rank has the same configuration, allocates zero local
  /// parameter blocks. Works on a duplicate of `comm`.
  DistributedMoeLayer(MPI_Comm comm, LayerConfig const& cfg, ParallelConfig const& par,
                      std::int64_t global_batch, std::int64_t seq_len,
                      ExecSpace const& space = ExecSpace())
      : DistributedMoeLayer(comm::Communicator(comm), cfg, par, global_batch, seq_len, space) {}

  /// \brief Collective over `comm` (shared, not duplicated); see the constructor above. On
  /// comm::Communicator::local() it is the one-rank pipeline, with no MPI call (what MoeLayer
  /// runs).
  DistributedMoeLayer(comm::Communicator comm, LayerConfig const& cfg, ParallelConfig const& par,
                      std::int64_t global_batch, std::int64_t seq_len,
                      ExecSpace const& space = ExecSpace())
      : world_(std::move(comm)), cfg_(cfg), par_(par), space_(space) {
    // One agreement per part keeps each quoted value short enough to show where ranks differ.
    comm::check_agreement(world_, "layer configuration (LayerConfig)", describe(cfg));
    comm::check_agreement(world_, "parallel configuration (ParallelConfig)", par.describe());
    plan_batch(global_batch, seq_len, false);
    router_ = routing::Router<Scalar, ExecSpace>(
        cfg_, routing::resolve(typename Policy::routing_policy{}, cfg_));
    params_ = alloc_params("moe::param::");
  }

  /// \brief Collective. Plans the step for another global batch shape [global_batch, seq_len, D]
  /// (e.g. a shorter last batch, or MoeLayer's next call): the layout, the step plan and the
  /// groups it needs. Parameters (and their blocks) stay: a shape whose layout would store
  /// another block of any parameter is a ConfigError on every rank, and nothing changes. The
  /// next backward() needs a forward() on the new shape.
  void set_batch_shape(std::int64_t global_batch, std::int64_t seq_len) {
    if (global_batch == B_ && seq_len == S_) return;
    plan_batch(global_batch, seq_len, true);
    have_forward_ = false;
  }
  /// The global batch shape the step is planned for: {global_batch, seq_len}.
  std::pair<std::int64_t, std::int64_t> batch_shape() const { return {B_, S_}; }

  LayerConfig const& config() const { return cfg_; }
  ParallelConfig const& parallel_config() const { return par_; }
  sharding::Mesh const& mesh() const { return layout_.mesh; }
  /// How the routed experts are reached on this layout.
  ExpertRoute expert_route() const { return layout_.route; }
  // parameters() (local blocks in storage layout, see block()), weights_changed() and
  // weights_version() come from ParameterStore. Gathered or sliced expert weights are new data in
  // reused buffers: every such gather is a new version.
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
  std::vector<std::string> const& batch_axes() const { return layout_.batch_axes; }

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

  /// \brief Collective. y_local = MoE(x_local), both [B/batch_parts, S, D]: runs the forward
  /// stages of step_plan() in order. opt.token_offset: global index of the global batch's first
  /// token (random routing).
  void forward(cview3 x, view3 y, ForwardOptions const& opt = {}) {
    detail::Region region("moe::dist::forward");
    token_offset_ = opt.token_offset;
    log_.records.clear();
    log_.in_backward = false;
    std::int64_t const D = plan_.token_cols, T = plan_.tokens;
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
        require_finite(cview2(x.data(), T, D), "x");
        // The router reads every gate column for every token: scanned up front (cheap, [D,E]).
        require_finite(params_.gate, block_name("gate"));
        if (cfg_.routed_bias) require_finite(params_.gate_bias, block_name("gate_bias"));
      }
    });
    // The step keeps its own copy of x: the backward reads it after the caller may have moved on.
    ws_.enter(nullptr);
    Kokkos::deep_copy(space_, ws_.make("x", T, D), cview2(x.data(), T, D));
    auto y2 = view2(y.data(), T, D);
    for (auto const& st : plan_.forward) {
      StageScope scope(*this, st);
      run_forward(st, y2);
    }
    if (cfg_.check_finite) {
      // As the single-rank layer: only a non-finite y pays for scanning the weights, and then
      // every rank names the first non-finite block it holds (block indices are local).
      bool const bad = !detail::all_finite(space_, y2);
      if (comm::any_rank(world_, bad)) {
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
  /// local x block (dx) and the local parameter blocks (grads; allocated if empty): runs the
  /// backward stages of step_plan() in order.
  void backward(cview3 dy, view3 dx, params_type& grads) {
    detail::Region region("moe::dist::backward");
    std::int64_t const D = plan_.token_cols, T = plan_.tokens;
    comm::collective_guard(world_, [&] {
      detail::require<Error>(have_forward_, "backward called without a forward");
      detail::require<ShapeError>(
          std::int64_t(dy.extent(0)) * S_ == T && dy.extent(1) == std::size_t(S_) &&
              dy.extent(2) == std::size_t(D) && dx.extent(0) == dy.extent(0) &&
              dx.extent(1) == dy.extent(1) && dx.extent(2) == dy.extent(2),
          "dy and dx must have the shape of the forward's x");
      if (grads.gate.data()) check_param_shapes(grads, "gradient");
      if (cfg_.check_finite) require_finite(cview2(dy.data(), T, D), "dy");
    });
    log_.in_backward = true;
    if (!grads.gate.data()) grads = alloc_params("moe::grad::");
    alloc_compute_grads();
    auto dy2 = cview2(dy.data(), T, D);
    auto dx2 = view2(dx.data(), T, D);
    for (auto const& st : plan_.backward) {
      StageScope scope(*this, st);
      run_backward(st, dy2, dx2, grads);
    }
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
  /// 1 where a slot of this rank's tokens survived the capacity limit, [T_local, K].
  view2i kept() const { return router_.own_rows(router_.state().kept); }
  /// Rows this rank's experts computed in the last forward: the routed slots (after capacity)
  /// that reached its local experts; 0 on the dense path, which computes every token.
  std::int64_t routed_rows() const {
    if (plan_.dense) return 0;
    return layout_.route == ExpertRoute::RaggedA2A ? disp_.lp.rows() : disp_.perm.rows();
  }
  /// True when the experts run the dense masked path (Gmm = Dense or sparse_matmul = false).
  bool dense_path() const { return plan_.dense; }

  /// The stages one step runs, with their buffers and collectives (what moe-shard --plan prints).
  distributed::StepPlan const& step_plan() const { return plan_; }

 private:
  using ivec = View1<std::int64_t const, memory_space>;

  // ------------------------------------------------------------------ stages ----------------
  /// Runs one stage: its profiling region, its buffers and its planned collectives; at the end
  /// every planned collective must have run (a mismatch is a moe::Error on every rank alike:
  /// the plan's structure does not depend on the rank).
  struct StageScope {
    StageScope(DistributedMoeLayer& l, distributed::Stage const& st)
        : layer(l), region(st.region.c_str()) {
      layer.stage_ = &st;
      layer.next_ = 0;
      layer.log_.stage = st.region;
      layer.ws_.enter(&st);
    }
    ~StageScope() noexcept(false) {
      auto const* st = layer.stage_;
      layer.stage_ = nullptr;
      layer.ws_.enter(nullptr);
      layer.log_.stage.clear();
      if (std::uncaught_exceptions() == 0 && layer.next_ != st->collectives.size())
        throw Error(detail::cat("moe internal error: stage ", st->region, " ran ", layer.next_,
                                " of its ", st->collectives.size(), " planned collectives"));
    }
    DistributedMoeLayer& layer;
    detail::Region region;
  };

  void run_forward(distributed::Stage const& st, view2 y) {
    using K = distributed::StageKind;
    bool const a2a = layout_.route == ExpertRoute::RaggedA2A;
    bool const ep_tp = layout_.route == ExpertRoute::EpTp;
    switch (st.kind) {
      case K::gather_weights:
        return gather_weights(params_, cp_);
      case K::gather_tokens:  // the expert group's tokens (ring), or full-D tokens (EP-TP)
        return all_gather_(ep_(), ws_.at("x"),
                           ws_.make("x_work", plan_.work_tokens, cfg_.base_emb_dim), ep_tp ? 1 : 0);
      case K::route:
        if (plan_.emb_chunks > 0) return route_gathered_logits(ws_.at("x"));
        return route_tokens(work_x());
      case K::dispatch:
        if (plan_.emb_chunks > 0) return local_sort();
        return a2a ? a2a_dispatch(ws_.at("x")) : local_dispatch(work_x());
      case K::experts:
        if (a2a) return a2a_experts(ws_.at("x_local"));
        if (plan_.emb_chunks > 0) return chunked_ring_experts(ws_.at("x"));
        return plan_.dense ? dense_experts(work_x()) : local_experts(ws_.at("x_local"));
      case K::combine:
        if (a2a) return a2a_combine(ws_.at("y_local_cols"));
        return ep_tp ? ep_tp_combine(ws_.at(plan_.dense ? "y_work" : "y_local"))
                     : gathered_combine(ws_.at(plan_.dense ? "y_work" : "y_local"));
      case K::shared_expert:
        return ep_tp ? ep_tp_shared_forward(ws_.at("x_work"), ws_.at("y_cols"))
                     : shared_forward(ws_.at("x"), ws_.at("y_cols"));
      case K::output:
        return all_gather_(tp_(), ws_.at("y_cols"), y, 1);
      case K::reduce_grads:
        break;
    }
    throw Error(detail::cat("moe internal error: no forward for stage ", st.region));
  }

  void run_backward(distributed::Stage const& st, cview2 dy, view2 dx, params_type& grads) {
    using K = distributed::StageKind;
    bool const a2a = layout_.route == ExpertRoute::RaggedA2A;
    bool const ep_tp = layout_.route == ExpertRoute::EpTp;
    switch (st.kind) {
      case K::output:
        if (ep_tp) return ep_tp_output_backward(dy);
        return a2a ? a2a_output_backward(dy) : gathered_output_backward(dy);
      case K::combine:
        return a2a ? a2a_combine_backward(ws_.at("dy_cols"))
                   : local_combine_backward(ws_.at("dy_work"));
      case K::experts:
        if (a2a) return a2a_experts_backward(ws_.at("dy_local_cols"));
        return plan_.dense ? dense_experts_backward(ws_.at("dy_work"))
                           : local_experts_backward(ws_.at("dy_local"));
      case K::dispatch:
        if (ep_tp) return ep_tp_dispatch_backward(dx);
        return a2a ? a2a_dispatch_backward(ws_.at("dy_local_cols"), dx)
                   : gathered_dispatch_backward(dx);
      case K::shared_expert:
        return ep_tp ? ep_tp_shared_backward(ws_.at("dy_work"), dx) : shared_backward(dy, dx);
      case K::route:
        if (ep_tp) return ep_tp_route_backward(dx);
        return router_.backward(space_, cview2(ws_.at("x")), cp_.gate, cview2(ws_.at("d_weights")),
                                router_.lb_coefficient(B_), dx, gc_.gate, gc_.gate_bias);
      case K::reduce_grads:
        return reduce_grads(gc_, grads);
      case K::gather_weights:
      case K::gather_tokens:
        break;
    }
    throw Error(detail::cat("moe internal error: no backward for stage ", st.region));
  }

  /// Tokens the router and the experts see: the expert group's (ring), the full-D tokens (EP-TP)
  /// or this rank's own.
  view2 work_x() const {
    bool const work = layout_.route == ExpertRoute::Ring || layout_.route == ExpertRoute::EpTp;
    return ws_.at(work ? "x_work" : "x");
  }

  // ------------------------------------------------------------------ collectives ------------
  /// The comm-log name of the next collective of the running stage, after checking its kind
  /// and group against the plan.
  std::string const& planned(char const* kind, std::vector<std::string> const& axes) {
    auto const& cs = stage_->collectives;
    bool const ok = next_ < cs.size() && cs[next_].kind == kind && cs[next_].axes == axes;
    if (!ok)
      throw Error(detail::cat("moe internal error: stage ", stage_->region, " runs a ", kind,
                              " over [", join(axes), "] but its plan has ",
                              next_ < cs.size()
                                  ? cs[next_].kind + " over [" + join(cs[next_].axes) + "]"
                                  : std::string("no further collective")));
    return cs[next_++].what;
  }
  template <class InV, class OutV>
  void all_gather_(distributed::AxisGroup const& g, InV const& in, OutV const& out, int d) {
    std::string const what = g.size() > 1 ? planned("all-gather", g.axes) : std::string();
    distributed::gather_dim(space_, g, in, out, d, &log_, what, &ws_.pool());
  }
  template <class InV, class OutV>
  void reduce_scatter_(distributed::AxisGroup const& g, InV const& in, OutV const& out, int d) {
    std::string const what = g.size() > 1 ? planned("reduce-scatter", g.axes) : std::string();
    distributed::reduce_scatter_dim(space_, g, in, out, d, &log_, what, &ws_.pool());
  }
  template <class V>
  void all_reduce_(distributed::AxisGroup const& g, V const& v) {
    all_reduce_(g, v, space_);
  }
  template <class V, class Space>
  void all_reduce_(distributed::AxisGroup const& g, V const& v, Space const& space) {
    std::string const what =
        g.size() > 1 && v.span() > 0 ? planned("all-reduce", g.axes) : std::string();
    distributed::all_reduce(space, g, v, &log_, what);
  }
  /// Logs an all-to-all of the ragged plan (rows a rank keeps for itself are copied, not sent).
  void log_all_to_all(bool reverse, std::int64_t cols) {
    auto const& rows = reverse ? disp_.a2a->recv_counts() : disp_.a2a->kept_send_counts();
    std::int64_t n = 0;
    for (std::size_t j = 0; j < rows.size(); ++j)
      if (int(j) != disp_.a2a->comm().rank()) n += rows[j];
    log_.add(planned("all-to-all", layout_.ep_axes), "all-to-all", layout_.ep_axes,
             n * cols * std::int64_t(sizeof(Scalar)));
  }

  // ------------------------------------------------------------------ layout ----------------
  static std::string join(std::vector<std::string> const& v) {
    return distributed::layout_detail::join(v);
  }

  /// Collective. Resolves every spec for the global batch [B, S], checks divisibility
  /// (distributed::compute_layout, a pure function of the agreed configuration, so every rank
  /// throws the same error), plans the step and makes its groups. keep_blocks: the parameter
  /// blocks must stay those already stored (set_batch_shape); nothing changes on an error.
  void plan_batch(std::int64_t B, std::int64_t S, bool keep_blocks) {
    comm::check_agreement(world_, "global batch shape",
                          "B=" + std::to_string(B) + ";S=" + std::to_string(S));
    distributed::Layout layout;
    distributed::StepPlan plan;
    comm::collective_guard(world_, [&] {
      layout = distributed::compute_layout(cfg_, par_, world_.size(), world_.rank(), B, S,
                                           std::is_same_v<typename Policy::gmm_policy, gmm::Dense>);
      if (keep_blocks)
        params_type::for_each_field(cfg_, [&](char const* n, auto) {
          auto const now = layout_.block(n), then = layout.block(n);
          detail::require<ConfigError>(
              now.local_shape == then.local_shape && now.offset == then.offset, "global batch [", B,
              ",", S, "] would store ", n, " as the block ", detail::shape_text(then.local_shape),
              " at ", detail::shape_text(then.offset), " but this layer holds ",
              detail::shape_text(now.local_shape), " at ", detail::shape_text(now.offset),
              ": make a new layer for this batch shape");
        });
      plan = distributed::make_step_plan(layout, cfg_, par_, sizeof(Scalar));
    });
    layout_ = std::move(layout);
    plan_ = std::move(plan);
    B_ = B;
    S_ = S;
    x_col0_ = layout_.block("x").offset[2];
    if (!mesh_comm_ || mesh_comm_->mesh().to_string() != layout_.mesh.to_string())
      mesh_comm_ = std::make_unique<comm::MeshComm>(world_, layout_.mesh);
    make_groups();
  }

  /// Every group the step uses, created in the same order on every rank (collective).
  void make_groups() {
    auto group = [&](std::vector<std::string> const& axes) { mesh_comm_->group(axes); };
    group(layout_.ep_axes);
    group(layout_.tp_axes);
    group(layout_.batch_axes);
    for (auto const& axes : plan_.groups()) group(axes);
    ep_g_ = &group_of(layout_.ep_axes);
    tp_g_ = &group_of(layout_.tp_axes);
    batch_g_ = &group_of(layout_.batch_axes);
  }
  /// A group make_groups() made (MeshComm's cache; the const lookup never communicates).
  distributed::AxisGroup const& group_of(std::vector<std::string> const& axes) const {
    return static_cast<comm::MeshComm const&>(*mesh_comm_).group(axes);
  }
  distributed::AxisGroup const& ep_() const { return *ep_g_; }
  distributed::AxisGroup const& tp_() const { return *tp_g_; }
  distributed::AxisGroup const& batch_() const { return *batch_g_; }

  params_type alloc_params(std::string const& prefix) const {
    return params_type::allocated(cfg_, prefix,
                                  [&](char const* n) { return block(n).local_shape; });
  }

  /// Shapes of a parameter (or gradient) set against this rank's blocks (ShapeError naming the
  /// tensor; on one local rank, in the config's terms).
  void check_param_shapes(params_type const& p, char const* what) const {
    p.check_shapes(cfg_, what, world_.is_local() ? "the config needs" : "this rank's block is",
                   [&](char const* n) { return block(n).local_shape; });
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
  /// A view of `shape` on the pool buffer of `key` (kept from step to step; keys must differ
  /// between views alive at the same time).
  template <class V>
  V shaped(std::vector<std::int64_t> const& shape, std::string const& key) {
    std::size_t n = 1;
    for (auto e : shape) n *= std::size_t(e);
    auto buf = ws_.pool().template get<Scalar>(key, n);
    if constexpr (V::rank == 1)
      return V(buf.data(), shape[0]);
    else if constexpr (V::rank == 2)
      return V(buf.data(), shape[0], shape[1]);
    else
      return V(buf.data(), shape[0], shape[1], shape[2]);
  }

  /// Runs weight ops (the plan's to_compute or to_storage) on `cur`; returns the last block.
  template <class V>
  V run_weight_ops(std::vector<distributed::WeightOp> const& ops, V cur, std::string const& key) {
    using Op = distributed::WeightOp::Kind;
    int k = 0;  // pool key of each intermediate
    for (auto const& op : ops) {
      if (op.kind == Op::all_reduce) {
        all_reduce_(group_of(op.axes), cur);
        continue;
      }
      V next = shaped<V>(op.shape, key + "#" + std::to_string(k++));
      if (op.kind == Op::all_gather)
        all_gather_(group_of(op.axes), cur, next, op.dim);
      else if (op.kind == Op::reduce_scatter)
        reduce_scatter_(group_of(op.axes), cur, next, op.dim);
      else
        distributed::slice_dim(space_, int(op.parts), int(op.index), cur, next, op.dim);
      cur = next;
    }
    return cur;
  }

  /// Stored blocks -> compute blocks (the plan's to_compute ops; the gate bias has none).
  void gather_weights(params_type const& stored, params_type& compute) {
    params_type::for_each_field(cfg_, [&](char const* n, auto m) {
      compute.*m =
          run_weight_ops(plan_.weight(n).to_compute, stored.*m, std::string("compute.") + n);
    });
    // A gathered (or sliced) expert weight is new data in a reused buffer: a new version.
    if (compute.wi_0.data() != stored.wi_0.data() || compute.wi_1.data() != stored.wi_1.data() ||
        compute.wo.data() != stored.wo.data())
      weights_changed();
  }

  /// Zeroed compute-block gradients, allocated once and reused while the shapes stay.
  void alloc_compute_grads() {
    params_type::for_each_field(cfg_, [&](char const* n, auto m) {
      auto& g = gc_.*m;
      auto const& like = cp_.*m;
      std::string const label = std::string("moe::dist::d_") + n;
      if constexpr (std::decay_t<decltype(g)>::rank == 1)
        detail::ensure(space_, g, label, like.extent(0));
      else if constexpr (std::decay_t<decltype(g)>::rank == 2)
        detail::ensure(space_, g, label, like.extent(0), like.extent(1));
      else
        detail::ensure(space_, g, label, like.extent(0), like.extent(1), like.extent(2));
      Kokkos::deep_copy(space_, g, Scalar(0));
    });
  }

  /// Compute-block gradients -> stored-block gradients (the transposes of gather_weights).
  void reduce_grads(params_type const& computed, params_type& out) {
    params_type::for_each_field(cfg_, [&](char const* n, auto m) {
      Kokkos::deep_copy(
          space_, out.*m,
          run_weight_ops(plan_.weight(n).to_storage, computed.*m, std::string("d.") + n));
    });
  }

  // ------------------------------------------------------------------ routing ---------------
  /// Routes the working tokens xw (own, or the expert group's on the ring); the load-balance
  /// loss and the bias update are global (statistics summed over the batch axes).
  void route_tokens(view2 xw) {
    // Random routing draws from the global token index: each member's rows are routed with its
    // own offset (a member's tokens are a contiguous block of the global batch).
    bool const ring = layout_.route == ExpertRoute::Ring;
    router_.forward(space_, cview2(xw), cp_.gate, cp_.gate_bias, S_, member_token_offsets(),
                    ring ? ep_().rank() : 0);
    route_statistics();
  }
  /// Global token index of the first token of each member of the routed block (random routing
  /// draws from it): the expert group's members on the ring, else this rank's block.
  std::vector<std::uint64_t> member_token_offsets() const {
    bool const ring = layout_.route == ExpertRoute::Ring;
    int const members = ring ? ep_().size() : 1;
    std::vector<std::uint64_t> offsets(std::size_t(members), 0);
    for (int m = 0; m < members; ++m)
      offsets[std::size_t(m)] =
          token_offset_ +
          std::uint64_t((ring ? member_batch_index(m) : layout_.batch_index) * plan_.tokens);
    return offsets;
  }
  /// Chunked ring: routes the expert group's tokens from their gate logits, computed on each
  /// member's own tokens (full D) and all-gathered; the tokens themselves come later by chunks.
  void route_gathered_logits(view2 x) {
    std::int64_t const T = plan_.tokens;
    auto lo = ws_.make("logits_own", T, cfg_.num_experts);
    detail::gemm(space_, "N", "N", Scalar(1), cview2(x), cp_.gate, Scalar(0), lo);
    all_gather_(ep_(), lo, router_.logits_rows(space_, plan_.work_tokens), 0);
    router_.forward_logits(space_, cp_.gate_bias, S_, member_token_offsets(), ep_().rank());
    route_statistics();
  }
  /// The global load-balance loss and bias update of the last routing (statistics summed over
  /// the batch axes).
  void route_statistics() {
    int const K = cfg_.num_experts_per_tok;
    lb_loss_ = 0;
    if (cfg_.load_balance_loss_weight > 0) {
      View1<double, Kokkos::HostSpace> v("moe::dist::lb_sum", 1);
      v(0) = router_.lb_sum();
      all_reduce_(batch_(), v, Kokkos::DefaultHostExecutionSpace());
      lb_loss_ = router_.lb_loss(v(0), B_);
    }
    bias_update_.clear();
    if (cfg_.routed_bias_update_rate > 0) {
      auto counts = router_.expert_counts();
      View1<std::int64_t, Kokkos::HostSpace> h(counts.data(), counts.size());
      all_reduce_(batch_(), h, Kokkos::DefaultHostExecutionSpace());
      bias_update_ = routing::bias_update(counts, B_ * S_ * K, cfg_.routed_bias_update_rate);
    }
  }

  /// Batch block index of the m-th member of this rank's expert group.
  std::int64_t member_batch_index(int m) const {
    // The member differs from this rank only in the expert axes: substitute its coordinates.
    std::int64_t idx = 0;
    int const rank = world_.rank();
    std::int64_t rem = m;
    auto const& ep_axes = layout_.ep_axes;
    auto const& mesh = layout_.mesh;
    std::vector<std::int64_t> ep_coord(ep_axes.size());
    for (std::size_t i = ep_axes.size(); i-- > 0;) {
      ep_coord[i] = rem % layout_.axis_size(ep_axes[i]);
      rem /= layout_.axis_size(ep_axes[i]);
    }
    for (auto const& a : layout_.batch_axes) {
      auto it = std::find(ep_axes.begin(), ep_axes.end(), a);
      std::int64_t const c = it != ep_axes.end() ? ep_coord[it - ep_axes.begin()]
                                                 : (mesh.has_axis(a) ? mesh.coord(rank, a) : 0);
      idx = idx * layout_.axis_size(a) + c;
    }
    return idx;
  }

  View2<int const, memory_space> expert_ids_() const {
    return View2<int const, memory_space>(router_.state().expert_ids);
  }
  View2<int const, memory_space> kept_() const {
    return View2<int const, memory_space>(router_.state().kept);
  }
  cview2 route_weights_() const { return cview2(router_.state().weights); }

  // ------------------------------------------------ strategy: ragged all-to-all -------------
  // Rows travel to the ranks of their experts (dispatch), are regrouped by local expert, run
  // through the grouped GEMMs, and travel back (combine) as D/tp column blocks.
  void a2a_dispatch(view2 x) {
    int const D = cfg_.base_emb_dim, E = cfg_.num_experts, K = cfg_.num_experts_per_tok;
    int const ep = ep_().size();
    std::int64_t const L = layout_.local_experts;
    auto& perm = disp_.perm;
    permute::sort_by_expert(space_, expert_ids_(), kept_(), E, perm);
    auto xs_o = ws_.make("x_sorted", perm.rows(), D);
    permute::gather_rows(space_, cview2(x), ivec(perm.perm), K, xs_o);
    auto const& off = perm.groups.offsets_host;
    std::vector<std::int64_t> sizes(E), send(ep);
    for (int e = 0; e < E; ++e) sizes[e] = off(e + 1) - off(e);
    for (int j = 0; j < ep; ++j) send[j] = off((j + 1) * L) - off(j * L);
    std::int64_t const R =
        par_.ragged_buffer_factor > 0
            ? comm::ragged_buffer_size(plan_.tokens * K, ep, E, K, par_.ragged_buffer_factor)
            : -1;
    disp_.a2a = std::make_unique<comm::RaggedAllToAll>(ep_().comm, send, R);
    log_all_to_all(false, D);
    auto xr = ws_.make("x_received", disp_.a2a->recv_total(), D);
    disp_.a2a->forward(space_, xs_o, xr);
    // Everyone's group sizes -> the local regrouping of received rows by local expert.
    View1<std::int64_t, Kokkos::HostSpace> mine("moe::dist::sizes", E),
        all("moe::dist::all_sizes", E * ep);
    std::copy(sizes.begin(), sizes.end(), mine.data());
    comm::all_gather(ep_().comm, Kokkos::DefaultHostExecutionSpace(), mine, all);
    std::vector<std::int64_t> G(all.data(), all.data() + E * ep);
    permute::make_local_permutation(space_, permute::local_layout(G, E, ep, ep_().rank(), R),
                                    disp_.lp);
    auto xs = ws_.make("x_local", disp_.lp.rows(), D);
    permute::permute_rows(space_, disp_.lp, xr, xs);
    disp_.groups.offsets = disp_.lp.group_offsets;
    disp_.groups.offsets_host = disp_.lp.group_offsets_host;
  }
  void a2a_experts(view2 xs) {
    std::int64_t const D = cfg_.base_emb_dim, n = xs.extent(0);
    auto ys = ws_.make("y_local", n, D);
    ffn_.forward(space_, cfg_.mlp_activation, xs, disp_.groups, cp_.wi_0, cp_.wi_1, cp_.wo, ys,
                 weights_version_);
    // Partial down-projections (tensor-split hidden dim) -> column blocks of D.
    auto ys_c = ws_.make("y_local_cols", n, D / tp_().size());
    reduce_scatter_(tp_(), ys, ys_c, 1);
  }
  void a2a_combine(view2 ys_c) {
    std::int64_t const Dc = ys_c.extent(1);
    auto yr_c = ws_.make("y_received_cols", disp_.a2a->recv_total(), Dc);
    permute::unpermute_rows(space_, disp_.lp, ys_c, yr_c);
    auto ys_o_c = ws_.make("y_sorted_cols", disp_.perm.rows(), Dc);
    log_all_to_all(true, Dc);
    disp_.a2a->reverse(space_, yr_c, ys_o_c);
    auto y_c = ws_.make("y_cols", plan_.tokens, Dc);
    permute::combine(space_, cview2(ys_o_c), ivec(disp_.perm.inverse), route_weights_(), false,
                     y_c);
  }
  void a2a_output_backward(cview2 dy) {
    int const tp = tp_().size();
    auto dy_c = ws_.make("dy_cols", plan_.tokens, cfg_.base_emb_dim / tp);
    distributed::slice_dim(space_, tp, tp_().rank(), dy, dy_c, 1);
  }
  void a2a_combine_backward(view2 dy_c) {
    std::int64_t const Dc = dy_c.extent(1);
    auto dys_o_c = ws_.make("dy_sorted_cols", disp_.perm.rows(), Dc);
    auto dw = ws_.make("d_weights", plan_.tokens, cfg_.num_experts_per_tok);
    permute::combine_backward(space_, cview2(dy_c), cview2(ws_.at("y_sorted_cols")),
                              ivec(disp_.perm.perm), ivec(disp_.perm.inverse), route_weights_(),
                              dys_o_c, dw);
    all_reduce_(tp_(), dw);
    auto dyr_c = ws_.make("dy_received_cols", disp_.a2a->recv_total(), Dc);
    log_all_to_all(false, Dc);
    disp_.a2a->forward(space_, dys_o_c, dyr_c);
    auto dys_c = ws_.make("dy_local_cols", disp_.lp.rows(), Dc);
    permute::permute_rows(space_, disp_.lp, dyr_c, dys_c);
  }
  void a2a_experts_backward(view2 dys_c) {
    auto dys = ws_.make("dy_local", dys_c.extent(0), cfg_.base_emb_dim);
    all_gather_(tp_(), dys_c, dys, 1);
    // dxs (partial over the tensor-split hidden dim) overwrites dys, then its column block dys_c.
    ffn_.backward(space_, dys, disp_.groups, cp_.wi_0, cp_.wi_1, cp_.wo, dys, gc_.wi_0, gc_.wi_1,
                  gc_.wo);
    reduce_scatter_(tp_(), dys, dys_c, 1);
  }
  void a2a_dispatch_backward(view2 dxs_c, view2 dx) {
    auto dxr_c = ws_.at("dy_received_cols");
    permute::unpermute_rows(space_, disp_.lp, dxs_c, dxr_c);
    auto dxs_o_c = ws_.at("dy_sorted_cols");
    log_all_to_all(true, dxs_c.extent(1));
    disp_.a2a->reverse(space_, dxr_c, dxs_o_c);
    auto dx_c = ws_.at("dy_cols");
    permute::gather_rows_backward(space_, cview2(dxs_o_c), ivec(disp_.perm.inverse),
                                  cfg_.num_experts_per_tok, false, dx_c);
    all_gather_(tp_(), dx_c, dx, 1);
  }

  // ------------------------------------ strategy: gathered tokens (ring, replicated, local) --
  // Each rank runs its local experts [e0, e0+L) on the working tokens; partial outputs (only
  // local experts, tensor-split hidden dim) are summed back onto their owners.
  void local_dispatch(view2 xw) {
    local_sort();
    auto xs = ws_.make("x_local", disp_.perm.rows(), cfg_.base_emb_dim);
    permute::gather_rows(space_, cview2(xw), ivec(disp_.perm.perm), cfg_.num_experts_per_tok, xs);
  }
  /// The working tokens' slots on local experts, sorted by local expert (disp_.perm).
  void local_sort() {
    std::int64_t const Tw = plan_.work_tokens;
    int const K = cfg_.num_experts_per_tok;
    // Local expert ids (global id - e0) and the kept mask restricted to local experts.
    auto lids = ws_.template make<int>("local_ids", Tw, K);
    auto lkept = ws_.template make<int>("local_kept", Tw, K);
    permute::local_expert_ids(space_, expert_ids_(), kept_(), int(layout_.first_expert),
                              int(layout_.local_experts), lids, lkept);
    permute::sort_by_expert(space_, View2<int const, memory_space>(lids),
                            View2<int const, memory_space>(lkept), layout_.local_experts,
                            disp_.perm);
  }
  void local_experts(view2 xs) {
    auto ys = ws_.make("y_local", xs.extent(0), cfg_.base_emb_dim);
    ffn_.forward(space_, cfg_.mlp_activation, xs, disp_.perm.groups, cp_.wi_0, cp_.wi_1, cp_.wo, ys,
                 weights_version_);
  }
  using chunk_pieces = comm::AllGatherPieces<Scalar, memory_space, memory_space>;
  /// D-chunk c of the own tokens (chunk-major `own`) and its rows of the gathered `got`.
  std::pair<view2, view2> chunk_views(view2 own, view2 got, std::int64_t c) const {
    std::int64_t const T = plan_.tokens, Tw = plan_.work_tokens, Dc = own.extent(1);
    return {view2(own.data() + c * T * Dc, T, Dc), view2(got.data() + c * Tw * Dc, Tw, Dc)};
  }
  /// Starts the all-gather of D-chunk c of the own tokens into its rows of `got`.
  auto start_chunk_gather(chunk_pieces const& pieces, view2 own, view2 got, std::int64_t c) {
    std::string const what = planned("all-gather", ep_().axes);
    auto const v = chunk_views(own, got, c);
    return distributed::start_gather_rows(space_, ep_(), pieces, v.first, v.second, &log_, what);
  }
  /// Chunked ring (num_moe_emb_chunks = nc): the expert group's tokens arrive in nc chunks of
  /// Dc = D/nc columns, each by a non-blocking all-gather started before the first grouped GEMMs
  /// of the previous chunk run (one GEMM piece per local expert, MPI progressed between pieces),
  /// so the transfer of chunk c+1 overlaps the GEMMs of chunk c. Each chunk's sorted rows go to
  /// the GEMMs and into their columns of x_local (kept for the backward).
  void chunked_ring_experts(view2 x) {
    std::int64_t const D = cfg_.base_emb_dim, T = plan_.tokens, Tw = plan_.work_tokens;
    std::int64_t const nc = plan_.emb_chunks, Dc = D / nc, n = disp_.perm.rows();
    std::int64_t const L = layout_.local_experts, F = cp_.wi_0.extent(2);
    int const K = cfg_.num_experts_per_tok;
    // Own tokens chunk-major: rows [c*T, (c+1)*T) are columns [c*Dc, (c+1)*Dc) of x.
    auto own = ws_.make("x_chunks_own", nc * T, Dc);
    distributed::detail::copy_rows(space_, "moe::dist::chunk_pack", x.data(), own.data(), T * nc,
                                   Dc, distributed::detail::Identity{},
                                   distributed::detail::PaToAp{T, nc});
    auto got = ws_.make("x_chunks", nc * Tw, Dc);
    auto xs = ws_.make("x_local", n, D);
    auto xs_c = ws_.make("x_local_chunk", n, Dc);
    auto rows = [](view2 const& v, std::int64_t r0, std::int64_t r) {
      return view2(v.data() + r0 * std::int64_t(v.extent(1)), r, v.extent(1));
    };
    // The chunks' shapes are agreed on once (one collective check, not one per chunk).
    auto const first = chunk_views(own, got, 0);
    chunk_pieces const pieces(ep_().comm, space_, first.first, first.second);
    using request = decltype(start_chunk_gather(pieces, own, got, 0));
    request next = start_chunk_gather(pieces, own, got, 0);
    ffn_.forward_begin(space_, cfg_.mlp_activation, xs, F, weights_version_);
    for (std::int64_t c = 0; c < nc; ++c) {
      request cur = std::move(next);
      cur.wait(space_);
      if (c + 1 < nc) next = start_chunk_gather(pieces, own, got, c + 1);
      permute::gather_rows(space_, cview2(rows(got, c * Tw, Tw)), ivec(disp_.perm.perm), K, xs_c);
      distributed::detail::copy_rows(space_, "moe::dist::chunk_unpack", xs_c.data(), xs.data(), n,
                                     Dc, distributed::detail::Identity{},
                                     distributed::detail::Block{nc, c});
      // Rows [c*Dc, (c+1)*Dc) of expert l's [D, F] weights: a contiguous [1, Dc, F] block.
      for (std::int64_t l = 0; l < L; ++l) {
        std::int64_t const at = (l * D + c * Dc) * F;
        ffn_.forward_chunk(space_, xs_c, disp_.perm.groups, view3(cp_.wi_0.data() + at, 1, Dc, F),
                           view3(cp_.wi_1.data() + at, 1, Dc, F), int(l));
        if (c + 1 < nc) next.test();
      }
    }
    auto ys = ws_.make("y_local", n, D);
    ffn_.forward_end(space_, disp_.perm.groups, cp_.wo, ys);
  }
  void dense_experts(view2 xw) {
    auto yw = ws_.make("y_work", xw.extent(0), cfg_.base_emb_dim);
    dense_.forward(space_, cfg_.mlp_activation, cview2(xw), expert_ids_(), kept_(),
                   route_weights_(), int(layout_.first_expert), cp_.wi_0, cp_.wi_1, cp_.wo, yw);
  }
  void gathered_combine(view2 ys) {
    std::int64_t const D = cfg_.base_emb_dim;
    view2 yw = plan_.dense ? ys : ws_.make("y_work", plan_.work_tokens, D);
    if (!plan_.dense)
      permute::combine(space_, cview2(ys), ivec(disp_.perm.inverse), route_weights_(), false, yw);
    // Sum the expert group's partial outputs onto each rank's own tokens, then split D over tensor.
    auto yo = ws_.make("y_own", plan_.tokens, D);
    tokens_reduce(yw, yo);
    auto y_c = ws_.make("y_cols", plan_.tokens, D / tp_().size());
    reduce_scatter_(tp_(), yo, y_c, 1);
  }
  void gathered_output_backward(cview2 dy) {
    auto dyw = ws_.make("dy_work", plan_.work_tokens, cfg_.base_emb_dim);
    if (layout_.route == ExpertRoute::Ring)
      all_gather_(ep_(), dy, dyw, 0);
    else
      Kokkos::deep_copy(space_, dyw, dy);
  }
  void local_combine_backward(view2 dyw) {
    auto dys = ws_.make("dy_local", disp_.perm.rows(), cfg_.base_emb_dim);
    auto dww = ws_.make("d_weights_work", plan_.work_tokens, cfg_.num_experts_per_tok);
    permute::combine_backward(space_, cview2(dyw), cview2(ws_.at("y_local")), ivec(disp_.perm.perm),
                              ivec(disp_.perm.inverse), route_weights_(), dys, dww);
  }
  void local_experts_backward(view2 dys) {
    // dxs overwrites dys.
    ffn_.backward(space_, dys, disp_.perm.groups, cp_.wi_0, cp_.wi_1, cp_.wo, dys, gc_.wi_0,
                  gc_.wi_1, gc_.wo);
  }
  void dense_experts_backward(view2 dyw) {
    auto dxw = ws_.make("dx_work", plan_.work_tokens, cfg_.base_emb_dim);
    auto dww = ws_.make("d_weights_work", plan_.work_tokens, cfg_.num_experts_per_tok);
    dense_.backward(space_, cview2(dyw), cp_.wi_0, cp_.wi_1, cp_.wo, dxw, dww, gc_.wi_0, gc_.wi_1,
                    gc_.wo);
  }
  /// dx of the working tokens, [work_tokens, D]: the dense experts' own, or the sorted rows'
  /// gradients (dy_local) scattered back to their tokens.
  view2 work_dx() {
    if (plan_.dense) return ws_.at("dx_work");
    auto dxw = ws_.make("dx_work", plan_.work_tokens, cfg_.base_emb_dim);
    permute::gather_rows_backward(space_, cview2(ws_.at("dy_local")), ivec(disp_.perm.inverse),
                                  cfg_.num_experts_per_tok, false, dxw);
    return dxw;
  }
  void gathered_dispatch_backward(view2 dx) {
    view2 dxw = work_dx();
    // ys and dxs are partial over the tensor-split hidden dim; the expert group's partial
    // d_weights / dx go back to the ranks that own the tokens.
    auto dww = ws_.at("d_weights_work");
    all_reduce_(tp_(), dww);
    tokens_reduce(dww, ws_.make("d_weights", plan_.tokens, cfg_.num_experts_per_tok));
    all_reduce_(tp_(), dxw);
    tokens_reduce(dxw, dx);
  }

  /// Working tokens -> own tokens: reduce-scatter (ring) or all-reduce (replicated) over the
  /// expert group; a copy without expert parallelism.
  void tokens_reduce(view2 work, view2 own) {
    if (layout_.route == ExpertRoute::Ring) {
      reduce_scatter_(ep_(), work, own, 0);
    } else {
      all_reduce_(ep_(), work);
      Kokkos::deep_copy(space_, own, work);
    }
  }

  // ------------------------------------------------------- strategy: EP-TP ------------------
  // The tokens are split on D over the expert axes; x_work holds the full-D tokens, the same on
  // every expert rank. Dispatch and experts are the gathered path's (local experts, routed rows
  // only); partial outputs are reduce-scattered back to this rank's D columns.
  void ep_tp_combine(view2 ys) {
    std::int64_t const D = cfg_.base_emb_dim;
    view2 yw = plan_.dense ? ys : ws_.make("y_work", plan_.tokens, D);
    if (!plan_.dense)
      permute::combine(space_, cview2(ys), ivec(disp_.perm.inverse), route_weights_(), false, yw);
    reduce_scatter_(ep_(), yw, ws_.make("y_cols", plan_.tokens, plan_.token_cols), 1);
  }
  void ep_tp_output_backward(cview2 dy) {
    all_gather_(ep_(), dy, ws_.make("dy_work", plan_.tokens, cfg_.base_emb_dim), 1);
  }
  void ep_tp_dispatch_backward(view2 dx) {
    view2 dxw = work_dx();  // EP-TP: work_tokens == tokens (full-D rows of this rank's batch)
    // Every expert rank holds the same tokens: d_weights (only the local experts' slots) summed,
    // dx (only the local experts' rows) summed and split on D.
    auto dw = ws_.make("d_weights", plan_.tokens, cfg_.num_experts_per_tok);
    Kokkos::deep_copy(space_, dw, ws_.at("d_weights_work"));
    all_reduce_(ep_(), dw);
    reduce_scatter_(ep_(), dxw, dx, 1);
  }
  /// The router's backward on the full-D tokens: dx += d_logits gate^T for this rank's D columns
  /// only (the rows of the gate this rank's columns multiply); d_gate is the full, same on every
  /// expert rank.
  void ep_tp_route_backward(view2 dx) {
    std::int64_t const E = cfg_.num_experts, Dl = plan_.token_cols;
    cview2 gate_rows(cp_.gate.data() + x_col0_ * E, Dl, E);
    router_.backward(space_, cview2(ws_.at("x_work")), gate_rows, cview2(ws_.at("d_weights")),
                     router_.lb_coefficient(B_), dx, gc_.gate, gc_.gate_bias);
  }
  /// The shared expert on the full-D tokens, hidden dim split over the expert axes: partial
  /// outputs reduce-scattered to this rank's D columns and added to y_c.
  void ep_tp_shared_forward(view2 xw, view2 y_c) {
    std::int64_t const D = cfg_.base_emb_dim, T = plan_.tokens;
    auto ysh = ws_.make("y_shared", T, D);
    Kokkos::deep_copy(space_, ysh, Scalar(0));
    shared_.forward(space_, cfg_.mlp_activation, cview2(xw), cp_.shared_wi_0, cp_.shared_wi_1,
                    cp_.shared_wo, ysh);
    scatter_cols_into(ysh, "y_shared_cols", y_c);
  }
  void ep_tp_shared_backward(view2 dyw, view2 dx) {
    std::int64_t const D = cfg_.base_emb_dim, T = plan_.tokens;
    auto dxsh = ws_.make("dx_shared", T, D);
    Kokkos::deep_copy(space_, dxsh, Scalar(0));
    shared_.backward(space_, cview2(dyw), cp_.shared_wi_0, cp_.shared_wi_1, cp_.shared_wo, dxsh,
                     gc_.shared_wi_0, gc_.shared_wi_1, gc_.shared_wo);
    scatter_cols_into(dxsh, "dx_shared_cols", dx);
  }
  /// Reduce-scatters partial full-D rows over the expert axes to this rank's D columns (the
  /// workspace buffer `cols`) and adds them to `into`.
  void scatter_cols_into(view2 full, char const* cols, view2 into) {
    auto c = ws_.make(cols, plan_.tokens, plan_.token_cols);
    reduce_scatter_(ep_(), full, c, 1);
    detail::add_into(space_, c, into);
  }

  // ------------------------------------------------------------------ shared expert ---------
  /// EP-as-TP: the shared expert runs on the expert group's tokens with its hidden dim split over
  /// tensor x expert; partial outputs go back to their tokens' owners, then to the D/tp columns
  /// of y_c (added).
  void shared_forward(view2 x, view2 y_c) {
    std::int64_t const D = cfg_.base_emb_dim, Tg = plan_.shared_tokens;
    auto xsh = ws_.make("x_shared", Tg, D);
    shared_tokens_gather(cview2(x), xsh);
    auto ysh = ws_.make("y_shared", Tg, D);
    Kokkos::deep_copy(space_, ysh, Scalar(0));
    shared_.forward(space_, cfg_.mlp_activation, cview2(xsh), cp_.shared_wi_0, cp_.shared_wi_1,
                    cp_.shared_wo, ysh);
    auto yo = ws_.make("y_own", plan_.tokens, D);
    shared_tokens_reduce(ysh, yo);
    auto ysh_c = ws_.make("y_shared_cols", plan_.tokens, D / tp_().size());
    reduce_scatter_(tp_(), yo, ysh_c, 1);
    detail::add_into(space_, ysh_c, y_c);
  }
  /// The transpose of shared_forward: dx += the shared expert's input gradient.
  void shared_backward(cview2 dy, view2 dx) {
    std::int64_t const D = cfg_.base_emb_dim, Tg = plan_.shared_tokens;
    auto dysh = ws_.make("dy_shared", Tg, D);
    shared_tokens_gather(dy, dysh);
    auto dxsh = ws_.make("dx_shared", Tg, D);
    Kokkos::deep_copy(space_, dxsh, Scalar(0));
    shared_.backward(space_, cview2(dysh), cp_.shared_wi_0, cp_.shared_wi_1, cp_.shared_wo, dxsh,
                     gc_.shared_wi_0, gc_.shared_wi_1, gc_.shared_wo);
    all_reduce_(tp_(), dxsh);
    auto yo = ws_.make("y_own", plan_.tokens, D);
    shared_tokens_reduce(dxsh, yo);
    detail::add_into(space_, yo, dx);
  }
  bool shared_spans_group() const { return plan_.shared_tokens > plan_.tokens; }
  void shared_tokens_gather(cview2 own, view2 work) {
    if (shared_spans_group())
      all_gather_(ep_(), own, work, 0);
    else
      Kokkos::deep_copy(space_, work, own);
  }
  void shared_tokens_reduce(view2 work, view2 own) {
    if (shared_spans_group()) {
      reduce_scatter_(ep_(), work, own, 0);
    } else {
      all_reduce_(ep_(), work);
      Kokkos::deep_copy(space_, own, work);
    }
  }

  // ------------------------------------------------------------------ members ------------------
  comm::Communicator world_;
  LayerConfig cfg_;
  ParallelConfig par_;
  ExecSpace space_;
  std::int64_t B_ = 0, S_ = 0;
  std::int64_t x_col0_ = 0;  // first D column of this rank's x block (EP-TP: rank x D/ep)
  std::unique_ptr<comm::MeshComm> mesh_comm_;  // the one cache of the axis groups
  distributed::AxisGroup const* ep_g_ = nullptr;
  distributed::AxisGroup const* tp_g_ = nullptr;
  distributed::AxisGroup const* batch_g_ = nullptr;
  distributed::Layout layout_;
  distributed::StepPlan plan_;
  // Components the stages run (each keeps what its own backward needs).
  routing::Router<Scalar, ExecSpace> router_;
  using gmm_policy = std::conditional_t<std::is_same_v<typename Policy::gmm_policy, gmm::Dense>,
                                        gmm::Auto, typename Policy::gmm_policy>;
  nn::ExpertFfn<Scalar, gmm_policy, ExecSpace> ffn_;
  nn::DenseMlp<Scalar, ExecSpace> shared_;
  nn::DenseExperts<Scalar, ExecSpace> dense_;
  // Parameters: stored blocks, compute blocks, compute-block gradients.
  params_type cp_, gc_;  // (params_ in ParameterStore)
  /// Where the dispatch put the rows, kept from the forward for the backward.
  struct DispatchState {
    permute::Permutation<memory_space> perm;     ///< token slots sorted by expert
    permute::LocalPermutation<memory_space> lp;  ///< received rows regrouped (all-to-all)
    gmm::Groups<memory_space> groups;            ///< local expert groups (all-to-all)
    std::unique_ptr<comm::RaggedAllToAll> a2a;   ///< the ragged exchange (all-to-all)
  } disp_;
  distributed::StepWorkspace<Scalar, memory_space> ws_;  // the step's buffers, by plan name
  distributed::Stage const* stage_ = nullptr;            // the stage running
  std::size_t next_ = 0;                                 // its next planned collective
  distributed::CommLog log_;
  bool have_forward_ = false;
  std::uint64_t token_offset_ = 0;  // ForwardOptions::token_offset of the last forward
  double lb_loss_ = 0;
  std::vector<double> bias_update_;
};

}  // namespace moe
