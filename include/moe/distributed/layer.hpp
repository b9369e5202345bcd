#pragma once
/// \file
/// DistributedMoeLayer: one MoE layer over MPI ranks, laid out by a mesh and logical-axis rules; it
/// runs its strategy's stages in order on a StepContext (docs/architecture.md).

#include <moe/comm/communicator.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/config.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/text.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/stages/weights.hpp>
#include <moe/distributed/step_context.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/distributed/strategy.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/parameters.hpp>
#include <moe/policies.hpp>
#include <moe/routing/router.hpp>
#include <moe/sharding/mesh.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace moe::distributed {

/// \brief One MoE layer over MPI ranks. The constructor, set_batch_shape(), forward() and
/// backward() are collective over `comm`, with the same configuration on every rank (checked).
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
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using cview3 = View3<Scalar const, memory_space>;
  using view2i = View2<int, memory_space>;

  /// \brief Collective, on a duplicate of `comm`: the layout, agreed by all ranks; zero parameters.
  DistributedMoeLayer(MPI_Comm comm, LayerConfig const& cfg, ParallelConfig const& par,
                      std::int64_t global_batch, std::int64_t seq_len,
                      ExecSpace const& space = ExecSpace())
      : DistributedMoeLayer(comm::Communicator(comm), cfg, par, global_batch, seq_len, space) {}

  /// \brief Collective over `comm`, shared (Communicator::local(): no MPI call, as in MoeLayer).
  DistributedMoeLayer(comm::Communicator comm, LayerConfig const& cfg, ParallelConfig const& par,
                      std::int64_t global_batch, std::int64_t seq_len,
                      ExecSpace const& space = ExecSpace())
      : ctx_(std::move(comm), cfg, par, space) {
    // One agreement per part keeps each quoted value short enough to show where ranks differ.
    comm::check_agreement(ctx_.world, "layer configuration (LayerConfig)", describe(cfg));
    comm::check_agreement(ctx_.world, "parallel configuration (ParallelConfig)", par.describe());
    agree_batch_shape(global_batch, seq_len);
    plan_batch(global_batch, seq_len, false);
    ctx_.router = routing::Router<Scalar, ExecSpace>(
        ctx_.cfg, routing::resolve(typename Policy::routing_policy{}, ctx_.cfg));
    params_ = alloc_params("moe::param::");
  }

  /// \brief Collective. Plans the step for another global batch shape (ConfigError, changing
  /// nothing, where a parameter's block would change); the next backward() needs a forward().
  void set_batch_shape(std::int64_t global_batch, std::int64_t seq_len) {
    // Agreed first, so that ranks given different shapes all throw rather than some returning.
    agree_batch_shape(global_batch, seq_len);
    if (global_batch == ctx_.B && seq_len == ctx_.S) return;
    plan_batch(global_batch, seq_len, true);
    have_forward_ = false;
  }
  /// Whether a forward completed since the last backward or batch shape change.
  bool has_forward() const { return have_forward_; }
  /// The global batch shape the step is planned for: {global_batch, seq_len}.
  std::pair<std::int64_t, std::int64_t> batch_shape() const { return {ctx_.B, ctx_.S}; }

  LayerConfig const& config() const { return ctx_.cfg; }
  ParallelConfig const& parallel_config() const { return ctx_.par; }
  sharding::Mesh const& mesh() const { return ctx_.layout.mesh; }
  /// How the routed experts are reached on this layout.
  ExpertRoute expert_route() const { return ctx_.layout.route; }
  /// The packed copies of the expert weights kept by the GEMM backend (statistics, tests).
  gmm::PackCache const& pack_cache() const { return ctx_.ffn.pack_cache(); }

  /// \brief The block of `name` this rank holds: "x", "y", "dy", "dx" ([B,S,D]) or a parameter.
  TensorBlock block(std::string const& name) const { return ctx_.layout.block(name); }

  /// Collectives of the last forward + backward, with bytes sent by this rank.
  distributed::CommLog const& comm_log() const { return ctx_.log; }
  /// The whole layout (mesh, axes, route, weights); see moe::make_plan for a printable form.
  distributed::Layout const& layout() const { return ctx_.layout; }
  /// Mesh axes the batch is split over.
  std::vector<std::string> const& batch_axes() const { return ctx_.layout.batch_axes; }

  /// \brief forward() and backward() for any Views converting to this layer's LayoutRight Views.
  template <class XView, class YView>
  void forward(XView const& x, YView const& y, ForwardOptions const& opt = {}) {
    forward(moe::detail::api_view<cview3>(x), moe::detail::api_view<view3>(y), opt);
  }
  template <class DyView, class DxView>
  void backward(DyView const& dy, DxView const& dx, params_type& grads) {
    backward(moe::detail::api_view<cview3>(dy), moe::detail::api_view<view3>(dx), grads);
  }

  /// \brief Collective. y_local = MoE(x_local), both [B/batch_parts, S, D]: the forward stages of
  /// step_plan(). opt.token_offset: global index of the batch's first token (random routing).
  /// y may be x itself: the layer copies x before any stage writes y.
  void forward(cview3 x, view3 y, ForwardOptions const& opt = {}) {
    moe::detail::Region region("moe::dist::forward");
    have_forward_ = false;
    ctx_.token_offset = opt.token_offset;
    ctx_.log.records.clear();
    ctx_.log.in_backward = false;
    std::int64_t const D = ctx_.plan.token_cols, T = ctx_.plan.tokens;
    comm::collective_guard(ctx_.world, [&] {
      auto const want = block("x").local_shape;
      moe::detail::require<ShapeError>(
          std::int64_t(x.extent(0)) == want[0] && std::int64_t(x.extent(1)) == want[1] &&
              std::int64_t(x.extent(2)) == want[2],
          "x is [", x.extent(0), ",", x.extent(1), ",", x.extent(2), "] but this rank's block is [",
          want[0], ",", want[1], ",", want[2], "]");
      moe::detail::require<ShapeError>(
          y.extent(0) == x.extent(0) && y.extent(1) == x.extent(1) && y.extent(2) == x.extent(2),
          "y must have the shape of x");
      check_param_shapes(params_, "parameter");
      if (ctx_.cfg.check_finite) {
        moe::detail::require_finite(ctx_.space, x, "x");
        // The router reads every gate column: scanned up front (cheap, [D,E]).
        moe::detail::require_finite(ctx_.space, params_.gate, block_name("gate"));
        if (ctx_.cfg.routed_bias)
          moe::detail::require_finite(ctx_.space, params_.gate_bias, block_name("gate_bias"));
      }
    });
    // The step keeps its own copy of x: the backward reads it after the caller may have moved on.
    ctx_.ws.enter(&ctx_.plan, nullptr);
    auto const xc = ctx_.ws.make(distributed::buf::x);
    moe::detail::copy_into(ctx_.space, cview2(x.data(), T, D), xc,
                           ctx_.cfg.bf16());  // rounded: docs/precision.md
    auto y2 = view2(y.data(), T, D);
    ctx_.ws.bind(distributed::Buf::y, y2);  // y_cols where the plan has y stand in for it
    run_phase(ctx_.plan.forward, y2, {}, {}, nullptr);
    ctx_.ws.bind(distributed::Buf::y, {});  // the caller's y is theirs again
    moe::detail::round_bf16_if(ctx_.cfg.bf16(), ctx_.space, y2);
    if (ctx_.cfg.check_finite) {
      // Only a non-finite y pays for scanning the weights; every rank names its first bad block.
      bool const bad = !moe::detail::all_finite(ctx_.space, y2);
      if (comm::any_rank(ctx_.world, bad))
        comm::collective_guard(ctx_.world, [&] {
          params_.for_each([&](char const* name, auto const& v) {
            moe::detail::require_finite(ctx_.space, v, block_name(name));
          });
          moe::detail::require<InputError>(
              !bad,
              "y holds NaN or Inf: every input and weight block is finite, so the layer "
              "overflowed");
        });
    }
    have_forward_ = true;
  }

  /// \brief Collective. Gradients of sum(y * dy) + lb_loss (over all ranks) w.r.t. the local x
  /// block (dx) and parameter blocks (grads; allocated if empty): the backward stages. dx must
  /// not share memory with dy (an InputError on every rank when they do on any): a shared expert
  /// on the own tokens reads dy after the stages before it have written dx.
  void backward(cview3 dy, view3 dx, params_type& grads) {
    moe::detail::Region region("moe::dist::backward");
    std::int64_t const D = ctx_.plan.token_cols, T = ctx_.plan.tokens;
    comm::collective_guard(ctx_.world, [&] {
      moe::detail::require<Error>(have_forward_, "backward called without a forward");
      moe::detail::require<ShapeError>(
          std::int64_t(dy.extent(0)) * ctx_.S == T && dy.extent(1) == std::size_t(ctx_.S) &&
              dy.extent(2) == std::size_t(D) && dx.extent(0) == dy.extent(0) &&
              dx.extent(1) == dy.extent(1) && dx.extent(2) == dy.extent(2),
          "dy and dx must have the shape of the forward's x");
      moe::detail::require<InputError>(
          !comm::detail::overlaps(dy, dx.data(), dx.size() * sizeof(Scalar)),
          "dx shares memory with dy: the backward reads dy after it has begun to write dx, so "
          "dx must be a separate array");
      if (grads.gate.data()) check_param_shapes(grads, "gradient");
      if (ctx_.cfg.check_finite) moe::detail::require_finite(ctx_.space, dy, "dy");
    });
    ctx_.log.in_backward = true;
    if (!grads.gate.data()) grads = alloc_params("moe::grad::");
    distributed::stages::alloc_compute_grads(ctx_, grads);
    // The stages round the caller's dy to bf16 on a bf16 layer where they first copy it.
    auto const dy2 = cview2(dy.data(), T, D);
    auto dx2 = view2(dx.data(), T, D);
    run_phase(ctx_.plan.backward, {}, dy2, dx2, &grads);
    moe::detail::round_bf16_if(ctx_.cfg.bf16(), ctx_.space, dx2);
    have_forward_ = false;
  }

  double lb_loss() const { return ctx_.lb_loss; }  ///< the last forward's global load-balance loss
  /// Loss-free bias update of the last forward (global counts), [E]; empty unless enabled.
  std::vector<double> const& bias_update() const { return ctx_.bias_update; }
  /// Experts chosen for this rank's tokens, [T_local, K].
  View2<int, memory_space> expert_ids() const {
    return ctx_.router.own_rows(ctx_.router.state().expert_ids);
  }
  /// Combine weights for this rank's tokens before capacity dropping, [T_local, K].
  view2 weights() const { return ctx_.router.own_rows(ctx_.router.state().weights); }
  /// 1 where a slot of this rank's tokens survived the capacity limit, [T_local, K].
  view2i kept() const { return ctx_.router.own_rows(ctx_.router.state().kept); }
  /// Routed slots this rank's experts computed in the last forward (0 on the dense path).
  std::int64_t routed_rows() const {
    return std::visit([&](auto const& s) { return s.routed_rows(ctx_); }, ctx_.strategy);
  }
  bool dense_path() const { return ctx_.plan.dense; }  ///< the dense masked path (Layout::dense)

  /// The stages one step runs, with their buffers and collectives (what moe-shard --plan prints).
  distributed::StepPlan const& step_plan() const { return ctx_.plan; }

 private:
  /// Runs one stage: its profiling region, its buffers, a check that its collectives all ran.
  struct StageScope {
    StageScope(DistributedMoeLayer& l, distributed::Stage const& st)
        : layer(l), region(st.region.c_str()) {
      layer.ctx_.stage = &st;
      layer.ctx_.next = 0;
      layer.ctx_.log.stage = st.region;
      layer.ctx_.ws.enter(&layer.ctx_.plan, &st);
    }
    ~StageScope() noexcept(false) {
      auto const* st = layer.ctx_.stage;
      layer.ctx_.stage = nullptr;
      layer.ctx_.ws.enter(&layer.ctx_.plan, nullptr);
      layer.ctx_.log.stage.clear();
      if (std::uncaught_exceptions() == 0 && layer.ctx_.next != st->collectives.size())
        throw Error(moe::detail::cat("moe internal error: stage ", st->region, " ran ",
                                     layer.ctx_.next, " of its ", st->collectives.size(),
                                     " planned collectives"));
    }
    DistributedMoeLayer& layer;
    moe::detail::Region region;
  };

  /// Runs the stages of one phase (y: the forward's; dy, dx, grads: the backward's).
  void run_phase(std::vector<distributed::Stage> const& phase, view2 y, cview2 dy, view2 dx,
                 params_type* grads) {
    using K = distributed::StageKind;
    std::visit(
        [&](auto const& s) {
          for (auto const& st : phase) {
            StageScope scope(*this, st);
            if (st.kind == K::gather_weights && !st.backward) {
              if (distributed::stages::gather_weights(ctx_, params_, ctx_.cp, weights_version_))
                weights_changed();
              ctx_.rounded_version = weights_version_;
            } else if (st.kind == K::output && !st.backward) {
              ctx_.all_gather(ctx_.tp(), ctx_.ws.at(distributed::buf::y_cols), y, 1);
            } else if (st.kind == K::reduce_grads && st.backward) {
              distributed::stages::reduce_grads(ctx_, ctx_.gc, *grads);
            } else {
              distributed::run_stage(s, ctx_, st, weights_version_, dy, dx);
            }
          }
        },
        ctx_.strategy);
  }

  /// Collective: every rank was given the same global batch [B, S].
  void agree_batch_shape(std::int64_t B, std::int64_t S) const {
    comm::check_agreement(ctx_.world, "global batch shape",
                          "B=" + std::to_string(B) + ";S=" + std::to_string(S));
  }
  /// Collective: plans [B, S] (keep_blocks: same parameter blocks); a ConfigError changes nothing.
  void plan_batch(std::int64_t B, std::int64_t S, bool keep_blocks) {
    distributed::Layout layout;
    distributed::Strategy strategy;
    distributed::StepPlan plan;
    comm::collective_guard(ctx_.world, [&] {
      layout =
          distributed::compute_layout(ctx_.cfg, ctx_.par, ctx_.world.size(), ctx_.world.rank(), B,
                                      S, std::is_same_v<typename Policy::gmm_policy, gmm::Dense>);
      if (keep_blocks)
        params_type::for_each_field(ctx_.cfg, [&](char const* n, auto) {
          auto const now = ctx_.layout.block(n), then = layout.block(n);
          moe::detail::require<ConfigError>(
              now.local_shape == then.local_shape && now.offset == then.offset, "global batch [", B,
              ",", S, "] would store ", n, " as the block ",
              moe::detail::shape_text(then.local_shape), " at ",
              moe::detail::shape_text(then.offset), " but this layer holds ",
              moe::detail::shape_text(now.local_shape), " at ", moe::detail::shape_text(now.offset),
              ": make a new layer for this batch shape");
        });
      strategy = distributed::choose_strategy(layout, ctx_.par);
      plan = distributed::make_step_plan(strategy, layout, ctx_.cfg, ctx_.par, sizeof(Scalar));
    });
    ctx_.layout = std::move(layout);
    ctx_.strategy = strategy;
    ctx_.plan = std::move(plan);
    ctx_.B = B;
    ctx_.S = S;
    ctx_.x_col0 = ctx_.layout.block("x").offset[2];
    if (!ctx_.mesh_comm || ctx_.mesh_comm->mesh().to_string() != ctx_.layout.mesh.to_string())
      ctx_.mesh_comm = std::make_unique<comm::MeshComm>(ctx_.world, ctx_.layout.mesh);
    // Every group the step uses, created in the same order on every rank (collective).
    auto const& lay = ctx_.layout;
    for (auto const* axes : {&lay.ep_axes, &lay.tp_axes, &lay.batch_axes})
      ctx_.mesh_comm->group(*axes);
    for (auto const& axes : ctx_.plan.groups()) ctx_.mesh_comm->group(axes);
  }

  params_type alloc_params(std::string const& prefix) const {
    return params_type::allocated(ctx_.cfg, prefix,
                                  [&](char const* n) { return block(n).local_shape; });
  }

  /// Shapes of a parameter (or gradient) set against this rank's blocks (ShapeError).
  void check_param_shapes(params_type const& p, char const* what) const {
    p.check_shapes(ctx_.cfg, what,
                   ctx_.world.is_local() ? "the config needs" : "this rank's block is",
                   [&](char const* n) { return block(n).local_shape; });
  }

  /// `name`, or "name (the block of rank r at offset [..] of [..])" when this rank stores a block.
  std::string block_name(std::string const& name) const {
    auto const b = block(name);
    if (b.local_shape == b.global_shape) return name;
    return moe::detail::cat(name, " (the block of rank ", ctx_.world.rank(), " at offset ",
                            moe::detail::shape_text(b.offset), " of ",
                            moe::detail::shape_text(b.global_shape), ")");
  }

  distributed::StepContext<Scalar, Policy, ExecSpace> ctx_;
  bool have_forward_ = false;
};

}  // namespace moe::distributed

namespace moe {
using distributed::DistributedMoeLayer;
}  // namespace moe
