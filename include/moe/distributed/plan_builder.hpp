#pragma once
/// \file
/// PlanBuilder: what every dispatch strategy writes its step plan with: this rank's sizes and
/// extents, the stages every route shares, one helper per collective (none for a group of one).

#include <moe/comm/sent_bytes.hpp>
#include <moe/comm/wire.hpp>
#include <moe/config.hpp>
#include <moe/detail/checked.hpp>
#include <moe/detail/row_caps.hpp>
#include <moe/distributed/buffers.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/error.hpp>
#include <moe/gmm/gmm.hpp>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief What a stage writes: a declared buffer or weight block, or a new buffer's declaration.
struct Out {
  Ref ref;
  bool declares = false;
  BufferDecl decl;
  Out(Ref r) : ref(r) {}  // NOLINT: implicit, as in a braced list of writes
  Out(Buf b) : ref(b) {}  // NOLINT
  template <class Role>
  Out(Handle<Role> h) : ref(h) {}                                       // NOLINT
  Out(BufferDecl d) : ref(d.id), declares(true), decl(std::move(d)) {}  // NOLINT
};

/// \brief What every dispatch strategy lists its stages with, top to bottom (see the file comment).
class PlanBuilder {
 public:
  using Axes = std::vector<std::string>;

  /// `gathered_tokens`: the experts see the expert group's tokens (the ring).
  PlanBuilder(Layout const& layout, LayerConfig const& config, ParallelConfig const& parallel,
              std::int64_t value_bytes, bool gathered_tokens)
      : lay(layout), cfg(config), par(parallel), s(value_bytes) {
    S = lay.seq_len;
    T = checked_mul(lay.block("x").local_shape[0], S, "tokens on this rank");
    D = cfg.base_emb_dim;
    K = cfg.num_experts_per_tok;
    E = cfg.num_experts;
    ep = lay.ep();
    tp = lay.tp();
    Dc = D / tp;
    Dl = lay.block("x").local_shape[2];
    L = lay.local_experts;
    F = lay.weight("wi_0").dims[2].computed;
    Tw = gathered_tokens ? checked_mul(T, ep, "tokens on the ring") : T;
    chunks = par.num_moe_emb_chunks;  // compute_layout allows it on the ring only
    // Balanced routing: T*K/E slots per expert (capacity C); each rank receives what it sends.
    sent = kept_slots(T);
    recv = par.ragged_buffer_factor > 0
               ? moe::detail::scaled_rows(checked_mul(T, K, "routed slots"),
                                          par.ragged_buffer_factor, sent)
               : sent;
    // The gathered paths run their local experts' share of the working tokens' slots.
    local = E > 0 ? checked_mul(kept_slots(Tw), L, "local rows") / E : 0;
  }

  enum class Payload { activations, logits, weights, gate, gradients };  ///< what collectives move
  /// The wire of a collective moving `p`: bf16 for what a bf16 layer holds in bf16 (precision.md).
  comm::Wire wire(Payload p) const {
    bool const f32_gate = (p == Payload::gate || p == Payload::logits) && cfg.float32_gate_logits;
    return cfg.bf16() && p != Payload::gradients && !f32_gate ? comm::Wire::bf16
                                                              : comm::Wire::native;
  }

  Layout const& lay;
  LayerConfig const& cfg;
  ParallelConfig const& par;
  std::int64_t s;  ///< bytes of one value (in memory; on the wire: wire())
  /// Tokens (own, the experts'), S, D, D / tp, x's columns here (EP-TP: D / ep), K, E, local
  /// experts, the compute block's hidden size, the group sizes.
  std::int64_t T = 0, Tw = 0, S = 1, D = 0, Dc = 0, Dl = 0, K = 0, E = 0, L = 0, F = 0, ep = 1,
               tp = 1;
  std::int64_t sent = 0, recv = 0;  ///< rows this rank sends / receives (balanced routing)
  std::int64_t local = 0;           ///< rows of the local experts on the gathered paths
  std::int64_t chunks = 0;          ///< D-chunks of the ring's token gather (0: one gather)
  bool backward = false;            ///< phase of the stages being added

  static constexpr unsigned tok = scale_tokens, slot = scale_tokens | scale_topk;
  Extent tokens() const { return {T, tok}; }
  Extent work_tokens() const { return {Tw, tok}; }
  Extent emb() const { return {D, scale_emb}; }
  Extent emb_cols() const { return {Dc, scale_emb}; }    ///< D / tp
  Extent token_cols() const { return {Dl, scale_emb}; }  ///< x's columns on this rank
  Extent topk() const { return {K, scale_topk}; }
  Extent experts() const { return {E, scale_experts}; }
  Extent sent_rows() const { return {sent, slot, true}; }
  Extent recv_rows() const { return {recv, slot, true}; }
  Extent local_rows() const { return {local, slot, true}; }
  Extent mlp() const { return {F, scale_mlp}; }
  /// Whether the shared expert gathers the expert group's tokens (EP-as-TP over the EP axes).
  bool shared_spans() const {
    return lay.shared == SharedExpert::split &&
           (lay.route == ExpertRoute::RaggedA2A || lay.route == ExpertRoute::Ring);
  }
  Extent shared_tokens() const { return {plan_.shared_tokens, tok}; }  ///< shared-expert tokens

  /// Slots kept of `tokens` tokens' T*K under per-sequence capacity (all without a capacity).
  std::int64_t kept_slots(std::int64_t tokens) const {
    std::int64_t const slots = checked_mul(tokens, K, "routed slots");
    if (cfg.capacity_factor <= 0 || S <= 0) return slots;
    return checked_mul(tokens / S,
                       std::min<std::int64_t>(checked_mul(S, K, "slots per sequence"),
                                              checked_mul(E, cfg.capacity(S), "capacity")),
                       "kept slots");
  }

  /// The declaration of workspace buffer `h` [rows, cols] in the current phase (under `item`);
  /// a buffer of role Rows of rows_elem(), or (`narrow` false: its readers take only values) wide.
  template <class Role>
  BufferDecl out(Handle<Role> h, Extent rows, Extent cols, std::optional<Item> item = {},
                 bool narrow = true) const {
    Elem const e = info(h.id).elem != Elem::rows ? info(h.id).elem
                   : narrow                      ? rows_elem()
                                                 : Elem::value;
    return {h.id, {rows, cols}, e, item.value_or(info(h.id).item), backward};
  }

  /// The stages of the current phase.
  std::vector<Stage>& phase() { return backward ? plan_.backward : plan_.forward; }
  /// Appends a stage of the current phase; the first stage that declares a buffer declares it.
  Stage& stage(StageKind kind, std::string region, std::vector<Ref> reads,
               std::vector<Out> writes) {
    Stage st{kind, backward, std::move(region), std::move(reads), {}, {}, 0, false};
    for (auto& w : writes) {
      st.writes.push_back(w.ref);
      if (w.declares) declare(std::move(w.decl));
    }
    phase().push_back(std::move(st));
    return phase().back();
  }
  /// The declaration of buffer `b` so far (nullptr: none yet).
  BufferDecl const* find(Buf b) const { return plan_.find(b); }
  /// Declares a buffer a component keeps between steps, made by the current phase's last stage.
  void hold(Buf b, std::vector<Extent> dims) {
    declare({b, std::move(dims), info(b).elem, info(b).item, backward});
  }
  /// A row count handed to one GEMM or kernel launch (checked against the index limits).
  void row_limit(std::string what, Extent rows) {
    plan_.row_limits.push_back({std::move(what), rows});
  }
  /// The sort of `slots` by expert over `keys` experts (permute::sort_by_expert).
  void hold_sort(Extent slots, std::int64_t keys) {
    std::int64_t const chunk = std::max<std::int64_t>(2048, 8 * keys);
    for (Buf b : {Buf::sort_perm, Buf::sort_inverse}) hold(b, {slots});
    hold(Buf::sort_cursors, {{(slots.n + chunk - 1) / chunk + 1, slots.keys}, {keys, 0}});
  }
  /// FLOPs of a [rows, k] x [k, n] GEMM.
  static double gemm(double rows, double k, double n) { return 2 * rows * k * n; }
  /// FLOPs of the gated FFN (three D x F GEMMs) on `rows` rows; the backward's are twice that.
  double ffn_flops(double rows, double F_) const { return (backward ? 6 : 3) * gemm(rows, D, F_); }

  /// The element of hidden states: bf16 where nn::stores_bf16 holds for Auto on the default space.
  Elem hidden_elem() const {
    using Gmm = gmm::resolve_t<gmm::Auto, Kokkos::DefaultExecutionSpace, float>;
    return gmm::handles_bf16<Gmm>::value && cfg.bf16() && s == 4 ? Elem::bf16 : Elem::value;
  }
  /// The element of the buffers of role Rows (x_local, y_local, dy_local at the experts, the
  /// ragged all-to-all's rows and column blocks between the sort and them, the working tokens
  /// x_work and dy_work of the sorted gathered paths, and their sums y_work and dx_work where a
  /// strategy lets them narrow): hidden_elem(), except on the chunked ring (its forward slices
  /// float rows).
  Elem rows_elem() const { return chunks == 0 ? hidden_elem() : Elem::value; }
  /// Whether the routed rows are 16-bit (the all-to-alls then move them as they are).
  bool narrow_rows() const { return rows_elem() == Elem::bf16; }
  /// Declares hidden states a component keeps, of hidden_elem().
  void hold_hidden(Buf b, std::vector<Extent> dims) {
    declare({b, std::move(dims), hidden_elem(), info(b).item, backward});
  }
  /// The grouped expert FFN's FLOPs and hidden states on `rows` rows (the chunked forward's float).
  void hold_expert_ffn(Extent rows) {
    phase().back().flops = ffn_flops(double(rows.n), double(F));
    Elem const e = chunks == 0 ? hidden_elem() : Elem::value;
    for (Buf b : backward ? std::vector<Buf>{Buf::d_act, Buf::d_h1}
                          : std::vector<Buf>{Buf::h0, Buf::h1, Buf::act})
      declare({b, {rows, mlp()}, e, Item::hidden, backward});
  }

  /// A stage running the routed experts (reads their compute blocks, writes their gradients).
  Stage& experts_stage(std::vector<Ref> reads, std::vector<Out> writes,
                       char const* region = nullptr) {
    if (!region) region = backward ? "moe::dist::experts::backward" : "moe::dist::experts";
    return ffn_stage(StageKind::experts, region, {Weight::wi_0, Weight::wi_1, Weight::wo},
                     std::move(reads), std::move(writes));
  }
  /// A shared-expert stage on `rows` tokens `x`, as experts_stage with the shared weights.
  Stage& shared_stage(Ref x, Extent rows, std::vector<Out> writes) {
    auto& st = ffn_stage(
        StageKind::shared_expert,
        backward ? "moe::dist::shared_expert::backward" : "moe::dist::shared_expert",
        {Weight::shared_wi_0, Weight::shared_wi_1, Weight::shared_wo}, {x}, std::move(writes));
    // The shared MLP's hidden states (nn::DenseMlp) and the rows it hands to its GEMMs.
    Extent const Fs{lay.weight("shared_wi_0").dims[1].computed, scale_mlp | scale_shared};
    st.flops = ffn_flops(double(rows.n), double(Fs.n));
    if (!backward) row_limit("shared-expert tokens", rows);
    for (Buf b : backward ? std::vector<Buf>{Buf::shared_d_act}
                          : std::vector<Buf>{Buf::shared_h0, Buf::shared_h1, Buf::shared_act})
      hold_hidden(b, {rows, Fs});
    return st;
  }

  // A group of size 1 plans nothing. Token collectives move [rows, cols] blocks along dim 0 or 1.
  /// All-gather of `rows` x `cols` input blocks along `dim` (of activations unless `p` says).
  void all_gather(Stage& st, std::string what, Axes const& axes, std::int64_t rows,
                  std::int64_t cols, int dim, bool balanced = false,
                  Payload p = Payload::activations) const {
    blocks(st, std::move(what), true, axes, lay.parts(axes), rows * cols, dim == 1 ? rows : 1,
           balanced, wire(p));
  }
  /// Reduce-scatter into `rows` x `cols` output blocks along `dim` (of activations).
  void reduce_scatter(Stage& st, std::string what, Axes const& axes, std::int64_t rows,
                      std::int64_t cols, int dim, bool balanced = false) const {
    blocks(st, std::move(what), false, axes, lay.parts(axes), rows * cols, dim == 1 ? rows : 1,
           balanced, wire(Payload::activations));
  }
  /// An all-reduce of `elems` values (`host`: 8-byte host statistics), on the native wire.
  void all_reduce(Stage& st, std::string what, Axes const& axes, std::int64_t elems,
                  bool host = false) const {
    std::int64_t const P = lay.parts(axes), bytes = host ? 8 : s;
    if (P > 1 && elems > 0) {
      add(st, std::move(what), "all-reduce", axes, comm::sent_bytes::all_reduce(elems * bytes, P),
          false, P, elems, 1, comm::Wire::native, bytes);
      st.collectives.back().host = host;
    }
  }
  /// Marks the collective planned on `st` since it had `before` of them (none where its group is
  /// of one) as moving 16-bit rows at both ends, where `narrow` (PlannedCollective::rows16).
  static void rows16(Stage& st, std::size_t before, bool narrow) {
    if (narrow && st.collectives.size() > before) st.collectives.back().rows16 = true;
  }
  /// A ragged all-to-all over the expert axes of rows x cols routed rows (balanced routing).
  void all_to_all(Stage& st, std::string what, std::int64_t rows, std::int64_t cols) const {
    comm::Wire const w = wire(Payload::activations);
    add(st, std::move(what), "all-to-all", lay.ep_axes,
        comm::sent_bytes::all_to_all_balanced(rows * cols * comm::wire_bytes(w, s), ep), true, ep,
        rows * cols, 1, w);
    st.collectives.back().rows16 = narrow_rows();
  }

  /// Starts the plan: this rank's sizes, every moved weight's ops, the step's input x [T, Dl] and
  /// the forward's first stage, gather_weights.
  StepPlan& begin() {
    StepPlan& p = plan_;
    p.route = lay.route;
    p.dense = lay.dense;
    p.tokens = T;
    p.work_tokens = Tw;
    p.token_cols = Dl;
    p.shared_tokens = checked_mul(T, shared_spans() ? ep : 1, "shared-expert tokens");
    p.emb_chunks = chunks;
    for (auto const& w : lay.weights) p.weights.push_back(weight_steps(w));
    declare(out(buf::x, tokens(), token_cols()));
    weight_stage(false);
    return p;
  }
  /// The router on the tokens `x` (`logits`: the ring's, all-gathering the own tokens' gate
  /// logits).
  void route(Ref x, bool logits = false) {
    std::vector<Out> writes{Buf::routing};
    if (logits) writes.insert(writes.begin(), out(buf::logits_own, tokens(), experts()));
    auto& st = stage(StageKind::route, "moe::dist::route",
                     {x, compute(Weight::gate), stored(Weight::gate_bias)}, std::move(writes));
    if (logits)
      all_gather(st, "all-gather logits (ring)", lay.ep_axes, T, E, 0, false, Payload::logits);
    st.flops = gemm(logits ? T : Tw, D, E);  // the gate
    if (cfg.load_balance_loss_weight > 0) all_reduce(st, "lb loss", lay.batch_axes, 1, true);
    if (cfg.routed_bias_update_rate > 0) all_reduce(st, "bias counts", lay.batch_axes, E, true);
    // What routing::Router keeps.
    Extent const R = work_tokens(), seqs{S > 0 ? T / S : 0, tok};
    row_limit("tokens routed on this rank", R);
    hold(Buf::logits, {R, experts()});
    if (cfg.routed_score_func != ScoreFunc::None) hold(Buf::scores, {R, experts()});
    if (cfg.routed_bias) hold(Buf::biased_scores, {R, experts()});
    for (Buf b : {Buf::expert_ids, Buf::kept, Buf::top_values, Buf::weights}) hold(b, {R, topk()});
    if (cfg.load_balance_loss_weight > 0) {
      for (Buf b : {Buf::seq_counts, Buf::seq_probs}) hold(b, {seqs, experts()});
      hold(Buf::lb_softmax, {{2, 0}, tokens()});
    }
    if (cfg.capacity_factor > 0) hold(Buf::capacity_cursors, {{2, 0}, seqs, experts()});
  }
  /// The forward's last stage: y's D/tp column blocks -> full y. Later stages are the backward's.
  /// Without tensor axes y_cols is all of y: the caller's y stands in for it (BufferDecl::caller),
  /// so the combine and the shared expert write y itself and the output stage has nothing to do.
  void output() {
    auto& o = stage(StageKind::output, "moe::dist::output", {buf::y_cols}, {Buf::y});
    all_gather(o, "all-gather y (tensor)", lay.tp_axes, T, Dc, 1);
    if (tp == 1) {
      BufferDecl* yc = plan_.find(buf::y_cols.id);
      moe::detail::require<Error>(yc && yc->shape() == std::vector<std::int64_t>{T, Dl},
                                  "moe internal error: y_cols is not y's local block");
      yc->caller = Buf::y;
    }
    backward = true;
  }
  /// The backward's last stages, then moves the plan out: the router's backward on the tokens `x`
  /// it routed, and the gradient reduction.
  StepPlan finish(Ref x) {
    auto& st = stage(StageKind::route, "moe::dist::route::backward",
                     {x, buf::d_weights, compute(Weight::gate)},
                     {Buf::dx, grad(Weight::gate), grad(Weight::gate_bias)});
    st.flops = 2 * gemm(T, D, E);  // dx += d_logits gate^T, d_gate = x^T d_logits
    hold(Buf::d_top, {tokens(), topk()});
    for (Buf b : {Buf::d_biased, Buf::d_logits}) hold(b, {tokens(), experts()});
    weight_stage(true);
    return std::move(plan_);
  }
  bool shared() const { return cfg.shared_mlp_dim() > 0; }  ///< whether there is a shared expert

 private:
  using Kind = WeightOp::Kind;
  /// gather_weights (the weights' to_compute ops) or (`grads`) reduce_grads (to_storage).
  void weight_stage(bool grads) {
    auto& st = grads ? stage(StageKind::reduce_grads, "moe::dist::reduce_grads", {}, {})
                     : stage(StageKind::gather_weights, "moe::dist::gather_weights", {}, {});
    auto names = moved();
    if (grads && cfg.routed_bias) names.insert(names.begin() + 1, Weight::gate_bias);
    for (Weight n : names) {
      st.reads.push_back(grads ? grad(n) : stored(n));
      st.writes.push_back(grads ? stored_grad(n) : compute(n));
      auto cur = shape(lay.weight(to_string(n)), grads ? &DimLayout::computed : &DimLayout::stored);
      auto const& ws = plan_.weight(to_string(n));
      Payload const p = grads               ? Payload::gradients
                        : n == Weight::gate ? Payload::gate
                                            : Payload::weights;
      for (auto const& o : grads ? ws.to_storage : ws.to_compute) {
        weight_collective(st, o, cur, p);
        cur = o.shape;
      }
    }
  }
  Stage& ffn_stage(StageKind kind, char const* region, std::initializer_list<Weight> weights,
                   std::vector<Ref> reads, std::vector<Out> writes) {
    for (Weight w : weights) {
      reads.push_back(compute(w));
      if (backward) writes.push_back(grad(w));
    }
    return stage(kind, region, std::move(reads), std::move(writes));
  }
  void declare(BufferDecl d) {
    if (auto const* have = plan_.find(d.id)) {
      moe::detail::require<Error>(have->shape() == d.shape() && have->elem == d.elem,
                                  "moe internal error: the plan declares buffer ", to_string(d.id),
                                  " twice, with two shapes or element types");
      return;
    }
    plan_.buffers.push_back(std::move(d));
  }
  /// Plans a collective; `elem_bytes` 0: a value on `w` (host statistics pass their own).
  void add(Stage& st, std::string what, char const* kind, Axes const& axes, std::int64_t bytes,
           bool balanced, std::int64_t parts, std::int64_t elems, std::int64_t lead,
           comm::Wire w = comm::Wire::native, std::int64_t elem_bytes = 0) const {
    st.collectives.push_back({std::move(what), kind, axes, bytes, balanced, parts, elems, lead,
                              elem_bytes ? elem_bytes : comm::wire_bytes(w, s), false, w});
  }
  /// An all-gather (`gather`) or reduce-scatter over P ranks of `block` values per rank.
  void blocks(Stage& st, std::string what, bool gather, Axes const& axes, std::int64_t P,
              std::int64_t block, std::int64_t lead, bool balanced, comm::Wire w) const {
    namespace sent = comm::sent_bytes;
    std::int64_t const b = block * comm::wire_bytes(w, s);
    if (P > 1)
      add(st, std::move(what), gather ? "all-gather" : "reduce-scatter", axes,
          gather ? sent::all_gather(b, P) : sent::reduce_scatter(b, P), balanced, P, block * P,
          lead, w);
  }
  /// The weight's stored or computed block shape.
  static std::vector<std::int64_t> shape(WeightLayout const& w, std::int64_t DimLayout::*m) {
    std::vector<std::int64_t> v;
    for (auto const& d : w.dims) v.push_back(d.*m);
    return v;
  }
  WeightOp op(Kind kind, int dim, Axes const& axes, std::vector<std::int64_t> shape,
              std::string what) const {
    std::int64_t const index = kind == Kind::slice ? lay.shard_index(axes) : 0;
    return {kind, dim, axes, lay.parts(axes), index, std::move(shape), std::move(what)};
  }
  WeightSteps weight_steps(WeightLayout const& w) const {
    using detail::minus;
    WeightSteps ws;
    ws.name = w.name;
    // f(d, axes) for every dimension d whose member m (gather or slice axes) is not empty.
    auto each = [&w](Axes DimLayout::*m, auto f) {
      for (std::size_t d = 0; d < w.dims.size(); ++d)
        if (!(w.dims[d].*m).empty()) f(int(d), w.dims[d].*m);
    };
    // stored -> compute: the gathers, then the slices; two-stage gathers go one axis at a time,
    // minor axis first (the blocks stay in row-major order).
    auto cur = shape(w, &DimLayout::stored);
    each(&DimLayout::gather, [&](int d, Axes const& g) {
      auto gather = [&](Axes const& a) {
        cur[d] *= lay.parts(a);
        ws.to_compute.push_back(op(Kind::all_gather, d, a, cur, "gather " + w.name));
      };
      if (!par.moe_fsdp_use_two_stage_all_gather) return gather(g);
      for (auto it = g.rbegin(); it != g.rend(); ++it) gather({*it});
    });
    each(&DimLayout::slice, [&](int d, Axes const& sl) {
      cur[d] /= lay.parts(sl);
      ws.to_compute.push_back(op(Kind::slice, d, sl, cur, ""));
    });
    // The transpose: sum over the reduce axes not gathered, undo the slices (all-gather), then the
    // gathers (reduce-scatter, or sum over the gathered axes that also reduce, then slice).
    Axes gathered;
    for (auto const& d : w.dims) gathered.insert(gathered.end(), d.gather.begin(), d.gather.end());
    auto const reduce = minus(w.reduce, gathered);
    if (lay.parts(reduce) > 1)
      ws.to_storage.push_back(op(Kind::all_reduce, -1, reduce, cur, "reduce d_" + w.name));
    each(&DimLayout::slice, [&](int d, Axes const& sl) {
      cur[d] *= lay.parts(sl);
      ws.to_storage.push_back(op(Kind::all_gather, d, sl, cur, "unslice d_" + w.name));
    });
    each(&DimLayout::gather, [&](int d, Axes const& g) {
      auto const summed = minus(g, minus(g, w.reduce));
      cur[d] /= lay.parts(g);
      if (summed.size() == g.size()) {
        ws.to_storage.push_back(op(Kind::reduce_scatter, d, g, cur, "reduce-scatter d_" + w.name));
        return;
      }
      if (lay.parts(summed) > 1) {
        auto before = cur;
        before[d] *= lay.parts(g);
        ws.to_storage.push_back(op(Kind::all_reduce, -1, summed, before, "reduce d_" + w.name));
      }
      ws.to_storage.push_back(op(Kind::slice, d, g, cur, ""));
    });
    return ws;
  }
  /// Planned collective of a weight op moving `p` (none for a slice).
  void weight_collective(Stage& st, WeightOp const& o, std::vector<std::int64_t> const& before,
                         Payload p) const {
    std::int64_t const in = detail::product(before), lead = detail::lead(before, o.dim);
    if (o.kind == Kind::all_gather)
      blocks(st, o.what, true, o.axes, o.parts, in, lead, false, wire(p));
    else if (o.kind == Kind::reduce_scatter)
      blocks(st, o.what, false, o.axes, o.parts, detail::product(o.shape), lead, false, wire(p));
    else if (o.kind == Kind::all_reduce)
      add(st, o.what, "all-reduce", o.axes, comm::sent_bytes::all_reduce(in * s, o.parts), false,
          o.parts, in, 1);
  }
  std::vector<Weight> moved() const {  // gate_bias is never gathered, only its gradient summed
    std::vector<Weight> n{Weight::gate, Weight::wi_0, Weight::wi_1, Weight::wo};
    if (shared())
      for (Weight w : {Weight::shared_wi_0, Weight::shared_wi_1, Weight::shared_wo}) n.push_back(w);
    return n;
  }

  StepPlan plan_;
};

}  // namespace moe::distributed
