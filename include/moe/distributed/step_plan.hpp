#pragma once
/// \file
/// The step plan of the distributed MoE layer: the stages of one training step in the order the
/// layer runs them, each with the buffers it reads and writes and the collectives it performs
/// (kind, mesh axes, predicted bytes), and for every weight the gathers and slices between its
/// stored and compute blocks. Built once from the layout (a pure function: no MPI, no Kokkos).
///
/// One plan, three users:
///  * DistributedMoeLayer executes it: forward() and backward() walk the stages in order, take
///    the record name of every collective from the plan and check its kind and axes against it
///    (moe::Error on a mismatch), and hand out buffers only by the names a stage declares.
///  * moe::make_plan (plan.hpp) prints it (`moe-shard --plan`), for any rank of any mesh.
///  * The comm log records what actually ran; tests/mpi/test_plan.cpp checks log = plan.
///
/// A stage's collectives are predicted exactly where the bytes follow from shapes. Where they
/// depend on routing (the token all-to-alls and the tensor-axis collectives on the rows they
/// deliver) they assume balanced routing and are marked `balanced`.
///
/// Adding a parallel layout = a new ExpertRoute in layout.hpp, its stages here (a dispatch
/// strategy: dispatch, experts, combine and their transposes), its stage functions in a header of
/// distributed/stages/ with their cases in the layer's run_forward / run_backward, plus a case in
/// tests/mpi/layout_cases.hpp.

#include <moe/comm/sent_bytes.hpp>
#include <moe/config.hpp>
#include <moe/detail/row_caps.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief One collective of a step: the layer's comm-log record name, kind, group and bytes.
struct PlannedCollective {
  std::string what;               ///< comm-log record name, e.g. "gather wi_0", "dispatch"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group (size > 1)
  std::int64_t bytes = 0;         ///< bytes this rank sends (predicted)
  bool balanced = false;          ///< bytes assume balanced routing (else exact)
};

/// What a stage does; the layer runs one function per kind and phase.
enum class StageKind {
  gather_weights,  ///< stored weight blocks -> compute blocks (FSDP all-gathers, EP-as-TP slices)
  gather_tokens,   ///< own tokens -> the expert group's tokens (ring) or full-D tokens (EP-TP)
  route,           ///< gate logits, top-k, capacity; load-balance and bias statistics
  dispatch,        ///< routed rows to the ranks and rows of their experts
  experts,         ///< grouped expert FFN (or the dense masked experts)
  combine,         ///< expert outputs back to their tokens, weighted, summed
  shared_expert,   ///< the always-on shared MLP (EP-as-TP: hidden dim over tensor x expert)
  output,          ///< column blocks of y -> full y (tensor axes)
  reduce_grads     ///< compute-block gradients -> stored-block gradients (backward only)
};

/// Name of a stage kind as printed by the plan (in the order of StageKind).
inline char const* to_string(StageKind k) {
  static char const* const names[] = {"gather weights", "gather tokens", "route",
                                      "dispatch",       "experts",       "combine",
                                      "shared expert",  "output",        "reduce gradients"};
  static_assert(sizeof(names) / sizeof(names[0]) == int(StageKind::reduce_grads) + 1,
                "one name per StageKind");
  return names[static_cast<int>(k)];
}

/// \brief One stage of a step. Buffer names are the keys of the layer's step workspace;
/// "compute.<w>" is the compute block of weight w, "d.<w>" its gradient.
struct Stage {
  StageKind kind = StageKind::route;
  bool backward = false;
  std::string region;  ///< Kokkos profiling region the layer opens for it, e.g. moe::dist::route
  std::vector<std::string> reads, writes;
  std::vector<PlannedCollective> collectives;  ///< in the order the stage runs them
};

/// \brief One move of a weight block between its stored and compute forms.
struct WeightOp {
  enum class Kind { all_gather, slice, all_reduce, reduce_scatter };
  Kind kind = Kind::all_gather;
  int dim = -1;                     ///< dimension gathered, sliced or scattered (-1: all_reduce)
  std::vector<std::string> axes;    ///< mesh axes of the group (slice: the axes sliced over)
  std::int64_t parts = 1;           ///< product of the axes' sizes
  std::int64_t index = 0;           ///< slice: this rank's block index over `axes`
  std::vector<std::int64_t> shape;  ///< shape of the block after the op
  std::string what;                 ///< comm-log record name ("" for a slice: no communication)
};

/// \brief The ops of one weight: stored -> compute (forward), gradient compute -> stored.
struct WeightSteps {
  std::string name;
  std::vector<WeightOp> to_compute;  ///< all gathers first, then the slices
  std::vector<WeightOp> to_storage;  ///< reduce over token axes, undo slices, then the gathers
};

/// \brief The stages of one step of one rank (see the file comment); make it with
/// make_step_plan().
struct StepPlan {
  ExpertRoute route = ExpertRoute::Local;
  bool dense = false;            ///< dense masked experts (no sort, no grouped GEMM; Layout::dense)
  std::int64_t tokens = 0;       ///< T: tokens of this rank's batch block
  std::int64_t work_tokens = 0;  ///< tokens the experts see (ring: T x ep)
  std::int64_t token_cols = 0;   ///< columns of x / y on this rank: D (EP-TP: D / ep)
  std::int64_t shared_tokens = 0;  ///< tokens the shared expert sees (EP-as-TP: T x ep)
  /// > 0: the ring forward gathers the tokens in this many D-chunks, overlapped with the first
  /// grouped GEMMs (num_moe_emb_chunks; see Builder::chunked_ring_forward); 0: one gather.
  std::int64_t emb_chunks = 0;
  std::vector<WeightSteps> weights;  ///< weights that are moved, in gather order
  std::vector<Stage> forward, backward;

  /// The ops of weight `name` (moe::Error when the plan has none).
  WeightSteps const& weight(std::string const& name) const {
    for (auto const& w : weights)
      if (w.name == name) return w;
    throw Error(moe::detail::cat("the step plan has no weight named '", name, "'"));
  }
  /// Every axis group the step communicates over, in first-use order (the same on every rank).
  std::vector<std::vector<std::string>> groups() const {
    std::vector<std::vector<std::string>> out;
    auto add = [&out](std::vector<std::string> const& a) {
      if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
    };
    for (auto const* phase : {&forward, &backward})
      for (auto const& st : *phase)
        for (auto const& c : st.collectives) add(c.axes);
    for (auto const& w : weights) {
      for (auto const& op : w.to_compute)
        if (op.kind != WeightOp::Kind::slice) add(op.axes);
      for (auto const& op : w.to_storage)
        if (op.kind != WeightOp::Kind::slice) add(op.axes);
    }
    return out;
  }
};

/// Comm-log name of the gather of D-chunk c (0-based) of n on the chunked ring.
inline std::string chunk_gather_name(std::int64_t c, std::int64_t n) {
  return "all-gather tokens (ring, chunk " + std::to_string(c + 1) + "/" + std::to_string(n) + ")";
}

namespace step_detail {

using Axes = std::vector<std::string>;
using layout_detail::minus;

inline std::int64_t product(std::vector<std::int64_t> const& v) {
  std::int64_t p = 1;
  for (auto e : v) p *= e;
  return p;
}

/// The builder: one method per dispatch strategy, stage by stage.
class Builder {
 public:
  Builder(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par, std::int64_t es)
      : lay_(lay), cfg_(cfg), par_(par), s_(es) {
    T_ = lay.block("x").local_shape[0] * lay.seq_len;
    D_ = cfg.base_emb_dim;
    K_ = cfg.num_experts_per_tok;
    E_ = cfg.num_experts;
    ep_ = lay.ep();
    tp_ = lay.tp();
    Dc_ = D_ / tp_;
    Dl_ = lay.block("x").local_shape[2];
    Tw_ = lay.route == ExpertRoute::Ring ? T_ * ep_ : T_;
    shared_group_ =
        lay.route == ExpertRoute::Replicated || lay.route == ExpertRoute::EpTp ? 1 : ep_;
    chunks_ = par.num_moe_emb_chunks;  // compute_layout allows it on the ring only
    // Balanced routing: every expert gets T*K/E of this rank's slots; per-sequence capacity
    // keeps at most C of them per expert and sequence. Every rank of the expert group sends the
    // same, so this rank receives what it sends (capped by the receive buffer).
    sent_ = T_ * K_;
    if (cfg.capacity_factor > 0)
      sent_ = (T_ / lay.seq_len) *
              std::min<std::int64_t>(lay.seq_len * K_, E_ * cfg.capacity(lay.seq_len));
    recv_ = sent_;
    if (par.ragged_buffer_factor > 0)
      recv_ = moe::detail::scaled_rows(T_ * K_, par.ragged_buffer_factor, recv_);
  }

  StepPlan build() {
    StepPlan p;
    p.route = lay_.route;
    // The dense path on the all-to-all (moe_dispatch_no_expert_sharding) runs the received rows
    // through the grouped GEMMs like the sparse path: no masked dense experts.
    p.dense = lay_.dense;
    p.tokens = T_;
    p.work_tokens = Tw_;
    p.token_cols = Dl_;
    p.shared_tokens = T_ * shared_group_;
    p.emb_chunks = chunks_;
    weights(p);
    bool const a2a = lay_.route == ExpertRoute::RaggedA2A;
    bool const ep_tp = lay_.route == ExpertRoute::EpTp;
    bool const shared = cfg_.shared_mlp_dim() > 0;
    // ---- forward
    p.forward.push_back(gather_weights(p));
    if (lay_.route == ExpertRoute::Ring && chunks_ == 0) {
      auto& st =
          stage(p.forward, StageKind::gather_tokens, "moe::dist::gather_tokens", {"x"}, {"x_work"});
      all_gather(st, "all-gather tokens (ring)", lay_.ep_axes, T_ * D_);
    }
    if (ep_tp) ep_tp_gather(p.forward);
    p.forward.push_back(route());
    if (a2a)
      a2a_forward(p.forward);
    else if (ep_tp)
      ep_tp_forward(p.forward);
    else if (chunks_ > 0)
      chunked_ring_forward(p.forward);
    else
      gathered_forward(p.forward);
    if (shared) ep_tp ? ep_tp_shared_forward(p.forward) : shared_forward(p.forward);
    auto& out = stage(p.forward, StageKind::output, "moe::dist::output", {"y_cols"}, {"y"});
    all_gather(out, "all-gather y (tensor)", lay_.tp_axes, T_ * Dc_);
    backward_ = true;
    // ---- backward: the routed path in reverse, then the shared expert and the router (so that
    // dx sums path + shared + router in this order on every layout), then the weight gradients.
    if (a2a)
      a2a_backward(p.backward);
    else if (ep_tp)
      ep_tp_backward(p.backward);
    else
      gathered_backward(p.backward);
    if (shared) ep_tp ? ep_tp_shared_backward(p.backward) : shared_backward(p.backward);
    // (EP-TP: the router's dx for this rank's D columns, from the full-D tokens.)
    stage(p.backward, StageKind::route, "moe::dist::route::backward",
          {ep_tp ? "x_work" : "x", "d_weights", "compute.gate"}, {"dx", "d.gate", "d.gate_bias"});
    p.backward.push_back(reduce_grads(p));
    return p;
  }

 private:
  Stage& stage(std::vector<Stage>& out, StageKind kind, std::string region, Axes reads,
               Axes writes) const {
    Stage st;
    st.kind = kind;
    st.backward = backward_;
    st.region = std::move(region);
    st.reads = std::move(reads);
    st.writes = std::move(writes);
    out.push_back(std::move(st));
    return out.back();
  }
  void add(Stage& st, std::string what, char const* kind, Axes const& axes, std::int64_t bytes,
           bool balanced = false) {
    st.collectives.push_back({std::move(what), kind, axes, bytes, balanced});
  }
  // Collectives of a group of size 1 do not run (and are not planned).
  void all_gather(Stage& st, std::string what, Axes const& axes, std::int64_t in_elems,
                  bool balanced = false) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1)
      add(st, std::move(what), "all-gather", axes, comm::sent_bytes::all_gather(in_elems * s_, P),
          balanced);
  }
  void reduce_scatter(Stage& st, std::string what, Axes const& axes, std::int64_t out_elems,
                      bool balanced = false) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1)
      add(st, std::move(what), "reduce-scatter", axes,
          comm::sent_bytes::reduce_scatter(out_elems * s_, P), balanced);
  }
  void all_reduce(Stage& st, std::string what, Axes const& axes, std::int64_t elems,
                  std::int64_t es) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1 && elems > 0)
      add(st, std::move(what), "all-reduce", axes, comm::sent_bytes::all_reduce(elems * es, P));
  }
  void all_to_all(Stage& st, std::string what, std::int64_t rows, std::int64_t cols) {
    add(st, std::move(what), "all-to-all", lay_.ep_axes,
        comm::sent_bytes::all_to_all_balanced(rows * cols * s_, ep_), true);
  }

  // ---------------------------------------------------------------- weights
  static std::vector<std::int64_t> stored(WeightLayout const& w) {
    std::vector<std::int64_t> v;
    for (auto const& d : w.dims) v.push_back(d.stored);
    return v;
  }
  WeightOp op(WeightOp::Kind kind, int dim, Axes axes, std::vector<std::int64_t> shape,
              std::string what) const {
    WeightOp o;
    o.kind = kind;
    o.dim = dim;
    o.parts = lay_.parts(axes);
    if (kind == WeightOp::Kind::slice) o.index = lay_.shard_index(axes);
    o.axes = std::move(axes);
    o.shape = std::move(shape);
    o.what = std::move(what);
    return o;
  }
  WeightSteps weight_steps(WeightLayout const& w) const {
    using K = WeightOp::Kind;
    WeightSteps ws;
    ws.name = w.name;
    // stored -> compute: all gathers first (a gather combines blocks cut the same way), then
    // the slices; two-stage gathers run one axis at a time, minor axis first, so blocks stay in
    // row-major order.
    auto cur = stored(w);
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& g = w.dims[d].gather;
      if (g.empty()) continue;
      std::vector<Axes> parts{g};
      if (par_.moe_fsdp_use_two_stage_all_gather && g.size() > 1) {
        parts.clear();
        for (auto it = g.rbegin(); it != g.rend(); ++it) parts.push_back({*it});
      }
      for (auto const& a : parts) {
        cur[d] *= lay_.parts(a);
        ws.to_compute.push_back(op(K::all_gather, int(d), a, cur, "gather " + w.name));
      }
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& sl = w.dims[d].slice;
      if (sl.empty()) continue;
      cur[d] /= lay_.parts(sl);
      ws.to_compute.push_back(op(K::slice, int(d), sl, cur, ""));
    }
    // compute gradient -> stored gradient: the transpose. Sum over the token axes that differ
    // and were not gathered, undo the slices (all-gather), then the gathers (reduce-scatter, or
    // a sum over the gathered axes that also reduce plus a slice).
    Axes gathered;
    for (auto const& d : w.dims) gathered.insert(gathered.end(), d.gather.begin(), d.gather.end());
    auto const reduce = minus(w.reduce, gathered);
    if (lay_.parts(reduce) > 1)
      ws.to_storage.push_back(op(K::all_reduce, -1, reduce, cur, "reduce d_" + w.name));
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& sl = w.dims[d].slice;
      if (sl.empty()) continue;
      cur[d] *= lay_.parts(sl);
      ws.to_storage.push_back(op(K::all_gather, int(d), sl, cur, "unslice d_" + w.name));
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& g = w.dims[d].gather;
      if (g.empty()) continue;
      auto const summed = minus(g, minus(g, w.reduce));
      cur[d] /= lay_.parts(g);
      if (summed.size() == g.size()) {
        ws.to_storage.push_back(
            op(K::reduce_scatter, int(d), g, cur, "reduce-scatter d_" + w.name));
      } else {
        if (lay_.parts(summed) > 1) {
          auto before = cur;
          before[d] *= lay_.parts(g);
          ws.to_storage.push_back(op(K::all_reduce, -1, summed, before, "reduce d_" + w.name));
        }
        ws.to_storage.push_back(op(K::slice, int(d), g, cur, ""));
      }
    }
    return ws;
  }
  void weights(StepPlan& p) const {
    for (auto const& w : lay_.weights) p.weights.push_back(weight_steps(w));
  }
  /// Planned collective of a weight op (none for a slice).
  void weight_collective(Stage& st, WeightOp const& o, std::vector<std::int64_t> const& before) {
    using K = WeightOp::Kind;
    if (o.kind == K::slice) return;
    std::int64_t const in = product(before), out = product(o.shape);
    if (o.kind == K::all_gather)
      add(st, o.what, "all-gather", o.axes, comm::sent_bytes::all_gather(in * s_, o.parts));
    else if (o.kind == K::reduce_scatter)
      add(st, o.what, "reduce-scatter", o.axes,
          comm::sent_bytes::reduce_scatter(out * s_, o.parts));
    else
      add(st, o.what, "all-reduce", o.axes, comm::sent_bytes::all_reduce(in * s_, o.parts));
  }
  std::vector<char const*> moved() const {
    // gate_bias stays replicated: it is never gathered, only its gradient is summed.
    std::vector<char const*> n{"gate", "wi_0", "wi_1", "wo"};
    if (cfg_.shared_mlp_dim() > 0)
      for (char const* s : {"shared_wi_0", "shared_wi_1", "shared_wo"}) n.push_back(s);
    return n;
  }
  Stage gather_weights(StepPlan const& p) {
    std::vector<Stage> one;
    auto& st = stage(one, StageKind::gather_weights, "moe::dist::gather_weights", {}, {});
    for (char const* n : moved()) {
      st.reads.push_back(n);
      st.writes.push_back(std::string("compute.") + n);
      auto const& ws = p.weight(n);
      auto cur = stored(lay_.weight(n));
      for (auto const& o : ws.to_compute) {
        weight_collective(st, o, cur);
        cur = o.shape;
      }
    }
    return st;
  }
  Stage reduce_grads(StepPlan const& p) {
    std::vector<Stage> one;
    auto& st = stage(one, StageKind::reduce_grads, "moe::dist::reduce_grads", {}, {});
    auto names = moved();
    if (cfg_.routed_bias) names.insert(names.begin() + 1, "gate_bias");
    for (char const* n : names) {
      st.reads.push_back(std::string("d.") + n);
      st.writes.push_back(std::string("grad.") + n);
      auto const& ws = p.weight(n);
      std::vector<std::int64_t> cur;
      for (auto const& d : lay_.weight(n).dims) cur.push_back(d.computed);
      for (auto const& o : ws.to_storage) {
        weight_collective(st, o, cur);
        cur = o.shape;
      }
    }
    return st;
  }

  // ---------------------------------------------------------------- routing
  Stage route() {
    std::vector<Stage> one;
    bool const work = lay_.route == ExpertRoute::Ring || lay_.route == ExpertRoute::EpTp;
    if (chunks_ > 0) {
      // Chunked ring: each rank's gate logits (full D, own tokens) are gathered instead of its
      // tokens, which arrive later by chunks; the routing is that of the gathered tokens.
      auto& st = stage(one, StageKind::route, "moe::dist::route",
                       {"x", "compute.gate", "gate_bias"}, {"logits_own", "routing"});
      all_gather(st, "all-gather logits (ring)", lay_.ep_axes, T_ * E_);
    } else {
      stage(one, StageKind::route, "moe::dist::route",
            {work ? "x_work" : "x", "compute.gate", "gate_bias"}, {"routing"});
    }
    auto& st = one.back();
    // Statistics are host doubles / int64: 8 bytes whatever the Scalar.
    if (cfg_.load_balance_loss_weight > 0) all_reduce(st, "lb loss", lay_.batch_axes, 1, 8);
    if (cfg_.routed_bias_update_rate > 0) all_reduce(st, "bias counts", lay_.batch_axes, E_, 8);
    return st;
  }

  // ---------------------------------------------------------------- ragged all-to-all
  // Rows travel to the ranks of their experts and back; tensor parallelism splits the hidden dim,
  // so partial outputs are reduce-scattered into D/tp column blocks before travelling back.
  void a2a_forward(std::vector<Stage>& f) {
    auto& d = stage(f, StageKind::dispatch, "moe::dispatch::ragged_all_to_all", {"x", "routing"},
                    {"x_sorted", "x_received", "x_local"});
    all_to_all(d, "dispatch", sent_, D_);
    auto& e = stage(f, StageKind::experts, "moe::dist::experts",
                    {"x_local", "compute.wi_0", "compute.wi_1", "compute.wo"},
                    {"y_local", "y_local_cols"});
    reduce_scatter(e, "reduce-scatter y (tensor)", lay_.tp_axes, recv_ * Dc_, true);
    auto& c = stage(f, StageKind::combine, "moe::dist::combine", {"y_local_cols", "routing"},
                    {"y_received_cols", "y_sorted_cols", "y_cols"});
    all_to_all(c, "combine", recv_, Dc_);
  }
  void a2a_backward(std::vector<Stage>& b) {
    stage(b, StageKind::output, "moe::dist::output::backward", {"dy"}, {"dy_cols"});
    auto& c = stage(b, StageKind::combine, "moe::dist::combine::backward",
                    {"dy_cols", "y_sorted_cols", "routing"},
                    {"dy_sorted_cols", "d_weights", "dy_received_cols", "dy_local_cols"});
    all_reduce(c, "reduce d_weights (tensor)", lay_.tp_axes, T_ * K_, s_);
    all_to_all(c, "dispatch d_y", sent_, Dc_);
    auto& e = stage(b, StageKind::experts, "moe::dist::experts::backward",
                    {"dy_local_cols", "compute.wi_0", "compute.wi_1", "compute.wo"},
                    {"dy_local", "dy_local_cols", "d.wi_0", "d.wi_1", "d.wo"});
    all_gather(e, "all-gather d_y (tensor)", lay_.tp_axes, recv_ * Dc_, true);
    reduce_scatter(e, "reduce-scatter d_x (tensor)", lay_.tp_axes, recv_ * Dc_, true);
    auto& d = stage(b, StageKind::dispatch, "moe::dispatch::ragged_all_to_all::backward",
                    {"dy_local_cols"}, {"dy_received_cols", "dy_sorted_cols", "dy_cols", "dx"});
    all_to_all(d, "combine d_x", recv_, Dc_);
    all_gather(d, "all-gather d_x (tensor)", lay_.tp_axes, T_ * Dc_);
  }

  // ---------------------------------------------------------------- token-gathering paths
  // Ring, replicated batch, or no expert parallelism: each rank runs its local experts on the
  // working tokens; partial outputs are summed back onto their owners (reduce-scatter on the
  // ring, all-reduce when replicated), then split into D/tp columns.
  void tokens_reduce(Stage& st, std::string const& what, std::int64_t cols) {
    if (lay_.route == ExpertRoute::Ring)
      reduce_scatter(st, "reduce-scatter " + what + " (expert)", lay_.ep_axes, T_ * cols);
    else
      all_reduce(st, "reduce " + what + " (expert)", lay_.ep_axes, Tw_ * cols, s_);
  }
  /// Dispatch and experts on the working tokens xw: sort the rows routed to the local experts and
  /// run the grouped GEMMs on them (or the dense masked experts on every token).
  void local_experts_forward(std::vector<Stage>& f, std::string const& xw) {
    if (!lay_.dense) {
      stage(f, StageKind::dispatch, "moe::dispatch::gathered", {xw, "routing"},
            {"local_ids", "local_kept", "x_local"});
      stage(f, StageKind::experts, "moe::dist::experts",
            {"x_local", "compute.wi_0", "compute.wi_1", "compute.wo"}, {"y_local"});
    } else {
      stage(f, StageKind::experts, "moe::dist::experts",
            {xw, "routing", "compute.wi_0", "compute.wi_1", "compute.wo"}, {"y_work"});
    }
  }
  void gathered_forward(std::vector<Stage>& f) {
    local_experts_forward(f, lay_.route == ExpertRoute::Ring ? "x_work" : "x");
    auto& c = stage(f, StageKind::combine, "moe::dist::combine",
                    {lay_.dense ? "y_work" : "y_local", "routing"}, {"y_work", "y_own", "y_cols"});
    tokens_reduce(c, "y", D_);
    reduce_scatter(c, "reduce-scatter y (tensor)", lay_.tp_axes, T_ * Dc_);
  }
  // Ring with num_moe_emb_chunks = n (MaxText's moe_emb_chunking): routing comes from the
  // gathered logits (route()); the dispatch sorts the expert group's slots; one overlapped stage
  // gathers the tokens in n chunks of D/n columns (non-blocking, chunk i+1 in flight while the
  // first grouped GEMMs of chunk i accumulate), then runs the activation and the down
  // projection. The chunk gathers send exactly the bytes of the one-piece gather; combine and
  // the whole backward are those of the ring (gathered_backward).
  void chunked_ring_forward(std::vector<Stage>& f) {
    stage(f, StageKind::dispatch, "moe::dispatch::gathered", {"routing"},
          {"local_ids", "local_kept"});
    auto& e = stage(f, StageKind::experts, "moe::dist::experts::chunked",
                    {"x", "routing", "compute.wi_0", "compute.wi_1", "compute.wo"},
                    {"x_chunks_own", "x_chunks", "x_local_chunk", "x_local", "y_local"});
    for (std::int64_t c = 0; c < chunks_; ++c)
      all_gather(e, chunk_gather_name(c, chunks_), lay_.ep_axes, T_ * (D_ / chunks_));
    auto& c = stage(f, StageKind::combine, "moe::dist::combine", {"y_local", "routing"},
                    {"y_work", "y_own", "y_cols"});
    tokens_reduce(c, "y", D_);
    reduce_scatter(c, "reduce-scatter y (tensor)", lay_.tp_axes, T_ * Dc_);
  }
  /// The backward of the experts on gathered tokens: dy gathered over the expert axes as
  /// `gather_dy` (n elements per rank; none when the tokens were not gathered), the experts'
  /// transposes, then the stage that sends d_weights and dx back, whose collectives the caller
  /// adds.
  Stage& gathered_experts_backward(std::vector<Stage>& b, char const* gather_dy, std::int64_t n) {
    auto& o = stage(b, StageKind::output, "moe::dist::output::backward", {"dy"}, {"dy_work"});
    if (gather_dy) all_gather(o, gather_dy, lay_.ep_axes, n);
    local_experts_backward(b);
    return stage(b, StageKind::dispatch, "moe::dispatch::gathered::backward",
                 {lay_.dense ? "dx_work" : "dy_local", "d_weights_work"},
                 {"dx_work", "d_weights", "dx"});
  }
  void gathered_backward(std::vector<Stage>& b) {
    bool const ring = lay_.route == ExpertRoute::Ring;
    // The transpose of routing on gathered tokens: the expert group's partial d_weights and dx
    // (partial over the tensor-split hidden dim too) go back to the ranks that own the tokens.
    auto& d = gathered_experts_backward(b, ring ? "all-gather d_y (expert)" : nullptr, T_ * D_);
    all_reduce(d, "reduce d_weights (tensor)", lay_.tp_axes, Tw_ * K_, s_);
    tokens_reduce(d, "d_weights", K_);
    all_reduce(d, "reduce d_x (tensor)", lay_.tp_axes, Tw_ * D_, s_);
    tokens_reduce(d, "d_x", D_);
  }

  /// The transposes of local_experts_forward, from dy_work.
  void local_experts_backward(std::vector<Stage>& b) {
    if (!lay_.dense) {
      stage(b, StageKind::combine, "moe::dist::combine::backward",
            {"dy_work", "y_local", "routing"}, {"dy_local", "d_weights_work"});
      stage(b, StageKind::experts, "moe::dist::experts::backward",
            {"dy_local", "compute.wi_0", "compute.wi_1", "compute.wo"},
            {"dy_local", "d.wi_0", "d.wi_1", "d.wo"});
    } else {
      stage(b, StageKind::experts, "moe::dist::experts::backward",
            {"dy_work", "compute.wi_0", "compute.wi_1", "compute.wo"},
            {"dx_work", "d_weights_work", "d.wi_0", "d.wi_1", "d.wo"});
    }
  }

  // ---------------------------------------------------------------- EP-TP
  // The tokens are split on D over the expert axes (the expert axis acts as tensor parallelism
  // outside the routed experts): every expert rank all-gathers its D columns into the full-D
  // tokens (the same on every expert rank), routes them, runs only its local experts on only the
  // rows routed to them (sorted, grouped GEMMs: the work grows with the routed rows, not with the
  // gathered tokens), and reduce-scatters the partial outputs back to D columns. The transposes:
  // dy all-gathered on D, dx reduce-scattered on D, d_weights summed over the expert group.
  void ep_tp_gather(std::vector<Stage>& f) {
    auto& st = stage(f, StageKind::gather_tokens, "moe::dist::gather_tokens", {"x"}, {"x_work"});
    all_gather(st, "all-gather tokens (ep-tp)", lay_.ep_axes, T_ * Dl_);
  }
  void ep_tp_forward(std::vector<Stage>& f) {
    local_experts_forward(f, "x_work");
    auto& c = stage(f, StageKind::combine, "moe::dist::combine",
                    {lay_.dense ? "y_work" : "y_local", "routing"}, {"y_work", "y_cols"});
    reduce_scatter(c, "reduce-scatter y (ep-tp)", lay_.ep_axes, T_ * Dl_);
  }
  void ep_tp_backward(std::vector<Stage>& b) {
    auto& d = gathered_experts_backward(b, "all-gather d_y (ep-tp)", T_ * Dl_);
    all_reduce(d, "reduce d_weights (expert)", lay_.ep_axes, T_ * K_, s_);
    reduce_scatter(d, "reduce-scatter d_x (ep-tp)", lay_.ep_axes, T_ * Dl_);
  }

  // The shared expert on the full-D tokens with its hidden dim split over the expert axes: its
  // partial outputs are reduce-scattered on D like the routed ones.
  void ep_tp_shared_forward(std::vector<Stage>& f) {
    auto& st = stage(f, StageKind::shared_expert, "moe::dist::shared_expert",
                     {"x_work", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
                     {"y_shared", "y_shared_cols", "y_cols"});
    reduce_scatter(st, "reduce-scatter y shared (ep-tp)", lay_.ep_axes, T_ * Dl_);
  }
  void ep_tp_shared_backward(std::vector<Stage>& b) {
    auto& st = stage(
        b, StageKind::shared_expert, "moe::dist::shared_expert::backward",
        {"dy_work", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
        {"dx_shared", "dx_shared_cols", "dx", "d.shared_wi_0", "d.shared_wi_1", "d.shared_wo"});
    reduce_scatter(st, "reduce-scatter d_x shared (ep-tp)", lay_.ep_axes, T_ * Dl_);
  }

  // ---------------------------------------------------------------- shared expert (EP-as-TP)
  // On the expert group's tokens with its hidden dim split over tensor x expert: partial outputs
  // go back to their tokens' owners, then to D/tp columns added to the routed output.
  void shared_tokens_reduce(Stage& st, std::string const& what) {
    if (shared_group_ > 1)
      reduce_scatter(st, "reduce-scatter " + what + " (expert)", lay_.ep_axes, T_ * D_);
    else
      all_reduce(st, "reduce " + what + " (expert)", lay_.ep_axes, T_ * D_, s_);
  }
  void shared_forward(std::vector<Stage>& f) {
    auto& st = stage(f, StageKind::shared_expert, "moe::dist::shared_expert",
                     {"x", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
                     {"x_shared", "y_shared", "y_own", "y_shared_cols", "y_cols"});
    if (shared_group_ > 1) all_gather(st, "all-gather x (shared, expert)", lay_.ep_axes, T_ * D_);
    shared_tokens_reduce(st, "y shared");
    reduce_scatter(st, "reduce-scatter y shared (tensor)", lay_.tp_axes, T_ * Dc_);
  }
  void shared_backward(std::vector<Stage>& b) {
    auto& st = stage(
        b, StageKind::shared_expert, "moe::dist::shared_expert::backward",
        {"dy", "compute.shared_wi_0", "compute.shared_wi_1", "compute.shared_wo"},
        {"dy_shared", "dx_shared", "y_own", "dx", "d.shared_wi_0", "d.shared_wi_1", "d.shared_wo"});
    if (shared_group_ > 1) all_gather(st, "all-gather d_y (shared, expert)", lay_.ep_axes, T_ * D_);
    all_reduce(st, "reduce d_x shared (tensor)", lay_.tp_axes, T_ * shared_group_ * D_, s_);
    shared_tokens_reduce(st, "d_x shared");
  }

  Layout const& lay_;
  LayerConfig const& cfg_;
  ParallelConfig const& par_;
  std::int64_t s_;
  std::int64_t T_ = 0, Tw_ = 0, D_ = 0, Dc_ = 0, Dl_ = 0, K_ = 0, E_ = 0, ep_ = 1, tp_ = 1;
  std::int64_t shared_group_ = 1, sent_ = 0, recv_ = 0;
  std::int64_t chunks_ = 0;  ///< D-chunks of the ring's token gather (0: one gather)
  bool backward_ = false;    ///< phase of the stages being added
};

}  // namespace step_detail

/// \brief The step plan of the rank `lay` describes (pure; see the file comment).
/// \param scalar_bytes size of one value (4: float, 8: double) for the byte counts
inline StepPlan make_step_plan(Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
                               std::size_t scalar_bytes) {
  return step_detail::Builder(lay, cfg, par, std::int64_t(scalar_bytes)).build();
}

}  // namespace moe::distributed
