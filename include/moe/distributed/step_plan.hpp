#pragma once
/// \file
/// The step plan of the distributed MoE layer: the stages of one training step in the order the
/// layer runs them, each with the buffers it reads and writes and the collectives it performs
/// (kind, mesh axes, predicted bytes), and for every weight the gathers and slices between its
/// stored and compute blocks. Built once from the layout by the layout's dispatch strategy
/// (distributed/strategy.hpp) with a PlanBuilder: a pure function, no MPI, no device.
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
/// A new parallel layout is a new strategy: see distributed/strategy.hpp.

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

namespace stages {
/// A stage kind the running strategy has no function for (its plan never lists it).
[[noreturn]] inline void no_stage(Stage const& st) {
  throw Error(moe::detail::cat("moe internal error: no ", st.backward ? "backward" : "forward",
                               " for stage ", st.region));
}
}  // namespace stages

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
  /// grouped GEMMs (num_moe_emb_chunks; see ChunkedRing); 0: one gather.
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
}  // namespace step_detail

/// \brief What every dispatch strategy builds its stages with: this rank's step sizes, the
/// stages every route shares (the weight gathers and gradient reductions, the router, the
/// output) and one helper per collective that plans it with its predicted bytes (a group of one
/// rank plans nothing). A strategy (distributed/strategy/) lists its stages with these, top to
/// bottom; make_step_plan() runs the layout's strategy on one.
class PlanBuilder {
 public:
  using Axes = std::vector<std::string>;

  /// `gathered_tokens`: the experts see the expert group's tokens (the ring).
  PlanBuilder(Layout const& layout, LayerConfig const& config, ParallelConfig const& parallel,
              std::int64_t scalar_bytes, bool gathered_tokens)
      : lay(layout), cfg(config), par(parallel), s(scalar_bytes) {
    T = lay.block("x").local_shape[0] * lay.seq_len;
    D = cfg.base_emb_dim;
    K = cfg.num_experts_per_tok;
    E = cfg.num_experts;
    ep = lay.ep();
    tp = lay.tp();
    Dc = D / tp;
    Dl = lay.block("x").local_shape[2];
    Tw = gathered_tokens ? T * ep : T;
    chunks = par.num_moe_emb_chunks;  // compute_layout allows it on the ring only
    // Balanced routing: every expert gets T*K/E of this rank's slots; per-sequence capacity
    // keeps at most C of them per expert and sequence. Every rank of the expert group sends the
    // same, so this rank receives what it sends (capped by the receive buffer).
    sent = T * K;
    if (cfg.capacity_factor > 0)
      sent = (T / lay.seq_len) *
             std::min<std::int64_t>(lay.seq_len * K, E * cfg.capacity(lay.seq_len));
    recv = sent;
    if (par.ragged_buffer_factor > 0)
      recv = moe::detail::scaled_rows(T * K, par.ragged_buffer_factor, recv);
  }

  Layout const& lay;
  LayerConfig const& cfg;
  ParallelConfig const& par;
  std::int64_t s;  ///< bytes of one value
  /// This rank's tokens, the tokens the experts see (the expert group's on the ring), D, its
  /// tensor column block, this rank's x columns (EP-TP: D / ep), K, E, the group sizes.
  std::int64_t T = 0, Tw = 0, D = 0, Dc = 0, Dl = 0, K = 0, E = 0, ep = 1, tp = 1;
  std::int64_t sent = 0, recv = 0;  ///< rows this rank sends / receives (balanced routing)
  std::int64_t chunks = 0;          ///< D-chunks of the ring's token gather (0: one gather)
  bool backward = false;            ///< phase of the stages being added

  /// Appends a stage of the current phase to `out` and returns it.
  Stage& stage(std::vector<Stage>& out, StageKind kind, std::string region, Axes reads,
               Axes writes) const {
    Stage st;
    st.kind = kind;
    st.backward = backward;
    st.region = std::move(region);
    st.reads = std::move(reads);
    st.writes = std::move(writes);
    out.push_back(std::move(st));
    return out.back();
  }
  // Collectives of a group of size 1 do not run (and are not planned).
  void all_gather(Stage& st, std::string what, Axes const& axes, std::int64_t in_elems,
                  bool balanced = false) const {
    std::int64_t const P = lay.parts(axes);
    if (P > 1)
      add(st, std::move(what), "all-gather", axes, comm::sent_bytes::all_gather(in_elems * s, P),
          balanced);
  }
  void reduce_scatter(Stage& st, std::string what, Axes const& axes, std::int64_t out_elems,
                      bool balanced = false) const {
    std::int64_t const P = lay.parts(axes);
    if (P > 1)
      add(st, std::move(what), "reduce-scatter", axes,
          comm::sent_bytes::reduce_scatter(out_elems * s, P), balanced);
  }
  /// An all-reduce of `elems` values of `es` bytes (statistics are 8-byte host values).
  void all_reduce(Stage& st, std::string what, Axes const& axes, std::int64_t elems,
                  std::int64_t es) const {
    std::int64_t const P = lay.parts(axes);
    if (P > 1 && elems > 0)
      add(st, std::move(what), "all-reduce", axes, comm::sent_bytes::all_reduce(elems * es, P));
  }
  void all_reduce(Stage& st, std::string what, Axes const& axes, std::int64_t elems) const {
    all_reduce(st, std::move(what), axes, elems, s);
  }
  /// A ragged all-to-all over the expert axes of rows x cols values (balanced routing).
  void all_to_all(Stage& st, std::string what, std::int64_t rows, std::int64_t cols) const {
    add(st, std::move(what), "all-to-all", lay.ep_axes,
        comm::sent_bytes::all_to_all_balanced(rows * cols * s, ep), true);
  }

  // ------------------------------------------------------------ the stages every route has
  /// A plan of this rank's sizes with every moved weight's ops (StepPlan::weights) and no stage
  /// yet; `shared_group`: how many ranks' tokens the shared expert sees.
  StepPlan begin(std::int64_t shared_group) const {
    StepPlan p;
    p.route = lay.route;
    // The dense path on the all-to-all (moe_dispatch_no_expert_sharding) runs the received rows
    // through the grouped GEMMs like the sparse path: no masked dense experts (Layout::dense).
    p.dense = lay.dense;
    p.tokens = T;
    p.work_tokens = Tw;
    p.token_cols = Dl;
    p.shared_tokens = T * shared_group;
    p.emb_chunks = chunks;
    for (auto const& w : lay.weights) p.weights.push_back(weight_steps(w));
    return p;
  }
  /// The forward's first stage: stored weight blocks -> compute blocks.
  void gather_weights(StepPlan& p) const {
    auto& st = stage(p.forward, StageKind::gather_weights, "moe::dist::gather_weights", {}, {});
    for (char const* n : moved()) {
      st.reads.push_back(n);
      st.writes.push_back(std::string("compute.") + n);
      auto cur = stored(lay.weight(n));
      for (auto const& o : p.weight(n).to_compute) {
        weight_collective(st, o, cur);
        cur = o.shape;
      }
    }
  }
  /// The router on the tokens `x` (this rank's or the working tokens); `logits`: the chunked
  /// ring's, whose gate logits (full D, own tokens) are all-gathered instead of the tokens.
  void route(std::vector<Stage>& f, char const* x, bool logits = false) const {
    auto& st = logits ? stage(f, StageKind::route, "moe::dist::route",
                              {"x", "compute.gate", "gate_bias"}, {"logits_own", "routing"})
                      : stage(f, StageKind::route, "moe::dist::route",
                              {x, "compute.gate", "gate_bias"}, {"routing"});
    if (logits) all_gather(st, "all-gather logits (ring)", lay.ep_axes, T * E);
    // Statistics are host doubles / int64: 8 bytes whatever the Scalar.
    if (cfg.load_balance_loss_weight > 0) all_reduce(st, "lb loss", lay.batch_axes, 1, 8);
    if (cfg.routed_bias_update_rate > 0) all_reduce(st, "bias counts", lay.batch_axes, E, 8);
  }
  /// The forward's last stage: the D/tp column blocks of y -> full y.
  void output(std::vector<Stage>& f) const {
    auto& out = stage(f, StageKind::output, "moe::dist::output", {"y_cols"}, {"y"});
    all_gather(out, "all-gather y (tensor)", lay.tp_axes, T * Dc);
  }
  /// The router's backward on the tokens `x` it routed (dx sums path + shared + router, in
  /// this order, on every route).
  void route_backward(std::vector<Stage>& b, char const* x) const {
    stage(b, StageKind::route, "moe::dist::route::backward", {x, "d_weights", "compute.gate"},
          {"dx", "d.gate", "d.gate_bias"});
  }
  /// The backward's last stage: compute-block gradients -> stored-block gradients.
  void reduce_grads(StepPlan& p) const {
    auto& st = stage(p.backward, StageKind::reduce_grads, "moe::dist::reduce_grads", {}, {});
    auto names = moved();
    if (cfg.routed_bias) names.insert(names.begin() + 1, "gate_bias");
    for (char const* n : names) {
      st.reads.push_back(std::string("d.") + n);
      st.writes.push_back(std::string("grad.") + n);
      std::vector<std::int64_t> cur;
      for (auto const& d : lay.weight(n).dims) cur.push_back(d.computed);
      for (auto const& o : p.weight(n).to_storage) {
        weight_collective(st, o, cur);
        cur = o.shape;
      }
    }
  }
  /// Whether the layer has a shared expert.
  bool shared() const { return cfg.shared_mlp_dim() > 0; }

 private:
  using Kind = WeightOp::Kind;
  void add(Stage& st, std::string what, char const* kind, Axes const& axes, std::int64_t bytes,
           bool balanced = false) const {
    st.collectives.push_back({std::move(what), kind, axes, bytes, balanced});
  }
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
    o.parts = lay.parts(axes);
    if (kind == WeightOp::Kind::slice) o.index = lay.shard_index(axes);
    o.axes = std::move(axes);
    o.shape = std::move(shape);
    o.what = std::move(what);
    return o;
  }
  WeightSteps weight_steps(WeightLayout const& w) const {
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
      if (par.moe_fsdp_use_two_stage_all_gather && g.size() > 1) {
        parts.clear();
        for (auto it = g.rbegin(); it != g.rend(); ++it) parts.push_back({*it});
      }
      for (auto const& a : parts) {
        cur[d] *= lay.parts(a);
        ws.to_compute.push_back(op(Kind::all_gather, int(d), a, cur, "gather " + w.name));
      }
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& sl = w.dims[d].slice;
      if (sl.empty()) continue;
      cur[d] /= lay.parts(sl);
      ws.to_compute.push_back(op(Kind::slice, int(d), sl, cur, ""));
    }
    // compute gradient -> stored gradient: the transpose. Sum over the token axes that differ
    // and were not gathered, undo the slices (all-gather), then the gathers (reduce-scatter, or
    // a sum over the gathered axes that also reduce plus a slice).
    Axes gathered;
    for (auto const& d : w.dims) gathered.insert(gathered.end(), d.gather.begin(), d.gather.end());
    auto const reduce = step_detail::minus(w.reduce, gathered);
    if (lay.parts(reduce) > 1)
      ws.to_storage.push_back(op(Kind::all_reduce, -1, reduce, cur, "reduce d_" + w.name));
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& sl = w.dims[d].slice;
      if (sl.empty()) continue;
      cur[d] *= lay.parts(sl);
      ws.to_storage.push_back(op(Kind::all_gather, int(d), sl, cur, "unslice d_" + w.name));
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& g = w.dims[d].gather;
      if (g.empty()) continue;
      auto const summed = step_detail::minus(g, step_detail::minus(g, w.reduce));
      cur[d] /= lay.parts(g);
      if (summed.size() == g.size()) {
        ws.to_storage.push_back(
            op(Kind::reduce_scatter, int(d), g, cur, "reduce-scatter d_" + w.name));
      } else {
        if (lay.parts(summed) > 1) {
          auto before = cur;
          before[d] *= lay.parts(g);
          ws.to_storage.push_back(op(Kind::all_reduce, -1, summed, before, "reduce d_" + w.name));
        }
        ws.to_storage.push_back(op(Kind::slice, int(d), g, cur, ""));
      }
    }
    return ws;
  }
  /// Planned collective of a weight op (none for a slice).
  void weight_collective(Stage& st, WeightOp const& o,
                         std::vector<std::int64_t> const& before) const {
    if (o.kind == Kind::slice) return;
    std::int64_t const in = step_detail::product(before), out = step_detail::product(o.shape);
    if (o.kind == Kind::all_gather)
      add(st, o.what, "all-gather", o.axes, comm::sent_bytes::all_gather(in * s, o.parts));
    else if (o.kind == Kind::reduce_scatter)
      add(st, o.what, "reduce-scatter", o.axes, comm::sent_bytes::reduce_scatter(out * s, o.parts));
    else
      add(st, o.what, "all-reduce", o.axes, comm::sent_bytes::all_reduce(in * s, o.parts));
  }
  std::vector<char const*> moved() const {
    // gate_bias stays replicated: it is never gathered, only its gradient is summed.
    std::vector<char const*> n{"gate", "wi_0", "wi_1", "wo"};
    if (shared())
      for (char const* w : {"shared_wi_0", "shared_wi_1", "shared_wo"}) n.push_back(w);
    return n;
  }
};

}  // namespace moe::distributed
