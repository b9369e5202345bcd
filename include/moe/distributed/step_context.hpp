#pragma once
/// \file
/// StepContext: the state the stages of the distributed layer share, and its planned collectives.

#include <moe/comm/communicator.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/config.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/distributed/strategy.hpp>
#include <moe/distributed/workspace.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/nn/expert_ffn.hpp>
#include <moe/parameters.hpp>
#include <moe/permute/local_permute.hpp>
#include <moe/permute/permute.hpp>
#include <moe/routing/router.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::distributed {

/// Where the dispatch put the rows, kept from the forward for the backward.
template <class MemorySpace>
struct DispatchState {
  permute::Permutation<MemorySpace> perm;     ///< token slots sorted by expert
  permute::LocalPermutation<MemorySpace> lp;  ///< received rows regrouped (all-to-all)
  gmm::Groups<MemorySpace> groups;            ///< local expert groups (all-to-all)
  std::unique_ptr<comm::RaggedAllToAll> a2a;  ///< the ragged exchange (all-to-all)
};

/// \brief What the stages of one DistributedMoeLayer share (the layer plans the step into it).
template <class Scalar, class Policy, class ExecSpace>
struct StepContext {
  using scalar_type = Scalar;
  using memory_space = typename ExecSpace::memory_space;
  using params_type = Parameters<Scalar, memory_space>;
  using view2 = View2<Scalar, memory_space>;
  using view3 = View3<Scalar, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using ivec = View1<std::int64_t const, memory_space>;
  using gmm_policy = std::conditional_t<std::is_same_v<typename Policy::gmm_policy, gmm::Dense>,
                                        gmm::Auto, typename Policy::gmm_policy>;

  StepContext(comm::Communicator comm, LayerConfig const& c, ParallelConfig const& p,
              ExecSpace const& s)
      : world(std::move(comm)), cfg(c), par(p), space(s) {
    ffn.bf16 = shared.bf16 = dense.bf16 = c.bf16();
    shared.round_weights = dense.round_weights = nn::dense_gemms_round_weights<Scalar, ExecSpace>();
  }

  comm::Communicator world;
  LayerConfig cfg;
  ParallelConfig par;
  ExecSpace space;
  std::int64_t B = 0, S = 0;
  std::int64_t x_col0 = 0;  // first D column of this rank's x block (EP-TP: rank x D/ep)
  std::unique_ptr<comm::MeshComm> mesh_comm;  // the one cache of the axis groups
  Layout layout;
  Strategy strategy;  // chosen from the layout with the plan (choose_strategy)
  StepPlan plan;
  // Components the stages run (each keeps what its own backward needs).
  routing::Router<Scalar, ExecSpace> router;
  nn::ExpertFfn<Scalar, gmm_policy, ExecSpace> ffn;
  nn::DenseMlp<Scalar, ExecSpace> shared;
  nn::DenseExperts<Scalar, ExecSpace> dense;
  // Parameters: compute blocks, compute-block gradients (the stored blocks are the layer's).
  params_type cp, gc;
  std::uint64_t rounded_version = ~std::uint64_t(0);  ///< stored version of the bf16 copies
  DispatchState<memory_space> disp;
  // The step's buffers, by plan name (routed rows 16-bit where the plan and the ffn allow).
  StepWorkspace<Scalar, memory_space, nn::stores_bf16<Scalar, gmm_policy, ExecSpace>> ws;
  Stage const* stage = nullptr;  // the stage running
  std::size_t next = 0;          // its next planned collective
  CommLog log;
  std::uint64_t token_offset = 0;  // ForwardOptions::token_offset of the last forward
  double lb_loss = 0;
  std::vector<double> bias_update;

  /// A group the layer made (MeshComm's cache; the const lookup never communicates).
  AxisGroup const& group_of(std::vector<std::string> const& axes) const {
    return static_cast<comm::MeshComm const&>(*mesh_comm).group(axes);
  }
  /// The expert, tensor and batch groups.
  AxisGroup const& ep() const { return group_of(layout.ep_axes); }
  AxisGroup const& tp() const { return group_of(layout.tp_axes); }
  AxisGroup const& batch() const { return group_of(layout.batch_axes); }

  using civ2 = View2<int const, memory_space>;
  civ2 expert_ids() const { return civ2(router.state().expert_ids); }
  civ2 kept() const { return civ2(router.state().kept); }
  cview2 route_weights() const { return cview2(router.state().weights); }
  /// The sort by expert (disp.perm) and its inverse, as the permute kernels take them.
  ivec perm() const { return ivec(disp.perm.perm); }
  ivec inverse() const { return ivec(disp.perm.inverse); }

  // Each runs on its planned collective's wire; a group of one plans none.
  /// The next collective of the running stage, checked against the plan's kind and group.
  PlannedCollective const& planned(char const* kind, std::vector<std::string> const& axes) {
    auto const& cs = stage->collectives;
    if (next >= cs.size() || cs[next].kind != kind || cs[next].axes != axes)
      throw Error(moe::detail::cat(
          "moe internal error: stage ", stage->region, " runs a ", kind, " over [",
          detail::join(axes), "] but its plan has ",
          next < cs.size() ? cs[next].kind + " over [" + detail::join(cs[next].axes) + "]"
                           : std::string("no further collective")));
    return cs[next++];
  }
  /// planned(kind, g.axes), or (a group of one; `skip`) none: an unlogged collective, native wire.
  PlannedCollective const& planned_in(char const* kind, AxisGroup const& g, bool skip = false) {
    static PlannedCollective const none;
    return g.size() > 1 && !skip ? planned(kind, g.axes) : none;
  }
  template <class InV, class OutV>
  void all_gather(AxisGroup const& g, InV const& in, OutV const& out, int d) {
    auto const& c = planned_in("all-gather", g);
    distributed::gather_dim(space, g, in, out, d, &log, c.what, &ws.pool(), c.wire);
  }
  template <class InV, class OutV>
  void reduce_scatter(AxisGroup const& g, InV const& in, OutV const& out, int d) {
    auto const& c = planned_in("reduce-scatter", g);
    distributed::reduce_scatter_dim(space, g, in, out, d, &log, c.what, &ws.pool(), c.wire);
  }
  template <class V>
  void all_reduce(AxisGroup const& g, V const& v) {
    all_reduce(g, v, space);
  }
  template <class V, class Space>
  void all_reduce(AxisGroup const& g, V const& v, Space const& exec) {
    distributed::all_reduce(exec, g, v, &log, planned_in("all-reduce", g, v.span() == 0).what);
  }
  /// The ragged exchange of the step (disp.a2a), forward or reverse, logged with the bytes sent.
  template <class SrcV, class DstV>
  void all_to_all(bool reverse, SrcV const& src, DstV const& dst) {
    auto const& c = planned("all-to-all", layout.ep_axes);
    auto const& rows = reverse ? disp.a2a->recv_counts() : disp.a2a->kept_send_counts();
    std::int64_t n = 0;
    for (std::size_t j = 0; j < rows.size(); ++j)
      if (int(j) != disp.a2a->comm().rank()) n += rows[j];
    std::int64_t const cols = comm::detail::rows_of(src).second;
    log.add(c.what, "all-to-all", layout.ep_axes,
            n * cols * comm::wire_bytes(c.wire, std::int64_t(sizeof(Scalar))));
    if (reverse)
      disp.a2a->reverse(space, src, dst, c.wire);
    else
      disp.a2a->forward(space, src, dst, c.wire);
  }
};

}  // namespace moe::distributed
