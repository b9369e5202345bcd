#pragma once
/// \file
/// The partition plan of one distributed MoE layer (DESIGN.md §4): for one rank of a layout, the
/// mesh, how the experts are reached, the local and compute blocks of every tensor, and the
/// collectives one training step (forward + backward) runs with the bytes this rank sends. Pure:
/// no MPI call, so a plan for any rank of any mesh can be made (and printed) on one process.
///
/// The plan is built from distributed::compute_layout, the layout DistributedMoeLayer itself runs
/// on; its collective list follows the layer's step record for record (same names, kinds, axes
/// and order as DistributedMoeLayer::comm_log()). Bytes are exact where they follow from shapes.
/// Where they depend on routing -- the token all-to-alls and the tensor-axis collectives on the
/// rows they deliver -- they assume balanced routing (every expert gets T_local*K/E slots of
/// each rank), so each dispatch and each combine sends T_local*K*D*sizeof*(ep-1)/ep bytes.
///
/// It also flags the failure that motivated MaxText's `moe_dispatch_no_expert_sharding`
/// (SEMANTICS.md §1.13): a dense dispatch tensor whose batch dimension claims the `expert` axis.

#include <moe/config.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/sharding/rules.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe {

/// \brief One tensor of the plan: where it lives on this rank and what a step does to it.
struct PlanTensor {
  std::string name;               ///< x, y, gate, gate_bias, wi_0, wi_1, wo, shared_*
  sharding::LogicalAxes logical;  ///< logical names of its dimensions
  sharding::PartitionSpec spec;   ///< spec the rules resolve (size-1 axes kept)
  /// Per dimension: mesh axes (size > 1) the stored block is split over.
  std::vector<std::vector<std::string>> storage;
  /// Per dimension: axes all-gathered to form the compute block (their transpose, in the
  /// backward, is a reduce-scatter of the gradient).
  std::vector<std::vector<std::string>> gathered;
  /// Per dimension: axes the compute block is split over beyond the storage (no communication
  /// forward; an all-gather of the gradient backward).
  std::vector<std::vector<std::string>> sliced;
  /// Token axes over which the gradient's contributions are summed.
  std::vector<std::string> reduced;
  std::vector<std::int64_t> global_shape;   ///< whole tensor
  std::vector<std::int64_t> local_shape;    ///< block stored on this rank
  std::vector<std::int64_t> offset;         ///< where the stored block starts
  std::vector<std::int64_t> compute_shape;  ///< block the step computes with
};

/// \brief One collective of a training step.
struct PlanCollective {
  bool backward = false;          ///< run by the backward pass (else by the forward)
  std::string what;               ///< the layer's record name, e.g. "gather wi_0", "dispatch"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group
  std::int64_t bytes = 0;         ///< bytes this rank sends
  bool balanced = false;          ///< bytes assume balanced routing (else exact)
};

/// \brief The partition plan of one rank (see the file comment); make it with make_plan().
struct LayerPlan {
  distributed::Layout layout;  ///< mesh, axes, route and weight layouts
  int world_size = 1;
  std::size_t scalar_bytes = sizeof(float);
  std::int64_t local_tokens = 0;  ///< T_local = tokens of this rank's batch block
  LayerConfig config;
  ParallelConfig parallel;
  std::vector<PlanTensor> tensors;
  std::vector<PlanCollective> collectives;    ///< in the order one step runs them
  sharding::LogicalAxes dispatch_logical;     ///< the dense dispatch tensor's logical names
  sharding::PartitionSpec dispatch_joint;     ///< resolved jointly (MaxText's default)
  sharding::PartitionSpec dispatch_repaired;  ///< with moe_dispatch_no_expert_sharding
  std::vector<std::string> notes;             ///< assumptions behind the byte counts
  std::vector<std::string> warnings;          ///< layout problems worth fixing

  /// Bytes this rank sends in the forward (backward = false) or the backward pass.
  std::int64_t bytes(bool backward) const {
    std::int64_t s = 0;
    for (auto const& c : collectives)
      if (c.backward == backward) s += c.bytes;
    return s;
  }
  /// Bytes this rank sends in one training step.
  std::int64_t step_bytes() const { return bytes(false) + bytes(true); }
  /// The tensor named `name` (ConfigError when the plan has none).
  PlanTensor const& tensor(std::string const& name) const {
    for (auto const& t : tensors)
      if (t.name == name) return t;
    throw ConfigError(detail::cat("the plan has no tensor named '", name, "'"));
  }

  /// Readable multi-line text.
  std::string to_text() const;
  /// One JSON object (one line, newline-terminated).
  std::string to_json() const;
};

namespace plan_detail {

using Axes = std::vector<std::string>;
using distributed::layout_detail::contains;
using distributed::layout_detail::minus;

inline std::int64_t product(std::vector<std::int64_t> const& v) {
  std::int64_t p = 1;
  for (auto e : v) p *= e;
  return p;
}

/// The collectives of one step, in the order DistributedMoeLayer runs them.
class Schedule {
 public:
  Schedule(distributed::Layout const& lay, LayerConfig const& cfg, ParallelConfig const& par,
           std::int64_t scalar_bytes, std::vector<PlanCollective>& out)
      : lay_(lay), cfg_(cfg), par_(par), s_(scalar_bytes), out_(out) {
    T_ = lay.block("x").local_shape[0] * lay.seq_len;
    D_ = cfg.base_emb_dim;
    K_ = cfg.num_experts_per_tok;
    E_ = cfg.num_experts;
    ep_ = lay.ep();
    tp_ = lay.tp();
    Dc_ = D_ / tp_;
    Tw_ = lay.route == ExpertRoute::Ring ? T_ * ep_ : T_;
    // Balanced routing: every expert gets T*K/E of this rank's slots; per-sequence capacity
    // keeps at most C of them per expert and sequence.
    sent_ = T_ * K_;
    if (cfg.capacity_factor > 0)
      sent_ = (T_ / lay.seq_len) *
              std::min<std::int64_t>(lay.seq_len * K_, E_ * cfg.capacity(lay.seq_len));
    // Every rank of the expert group sends the same: this rank receives what it sends (capped
    // by the receive buffer).
    recv_ = sent_;
    if (par.ragged_buffer_factor > 0)
      recv_ = moe::detail::scaled_rows(T_ * K_, par.ragged_buffer_factor, recv_);
  }

  void run() {
    backward_ = false;
    gather_weights();
    if (lay_.route == ExpertRoute::Ring)
      all_gather("all-gather tokens (ring)", lay_.ep_axes, T_ * D_, s_);
    route_tokens();
    if (lay_.route == ExpertRoute::RaggedA2A)
      a2a_forward();
    else
      gathered_forward();
    backward_ = true;
    if (lay_.route == ExpertRoute::RaggedA2A)
      a2a_backward();
    else
      gathered_backward();
    reduce_grads();
  }

 private:
  void add(std::string what, char const* kind, Axes const& axes, std::int64_t bytes,
           bool balanced = false) {
    out_.push_back({backward_, std::move(what), kind, axes, bytes, balanced});
  }
  // Byte counts as distributed::gather_dim / reduce_scatter_dim / all_reduce log them.
  void all_gather(std::string what, Axes const& axes, std::int64_t in_elems, std::int64_t es,
                  bool balanced = false) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1) add(std::move(what), "all-gather", axes, in_elems * es * (P - 1), balanced);
  }
  void reduce_scatter(std::string what, Axes const& axes, std::int64_t out_elems, std::int64_t es,
                      bool balanced = false) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1) add(std::move(what), "reduce-scatter", axes, out_elems * es * (P - 1), balanced);
  }
  void all_reduce(std::string what, Axes const& axes, std::int64_t elems, std::int64_t es) {
    std::int64_t const P = lay_.parts(axes);
    if (P > 1 && elems > 0) add(std::move(what), "all-reduce", axes, 2 * elems * es * (P - 1) / P);
  }
  void all_to_all(std::string what, std::int64_t rows, std::int64_t cols) {
    add(std::move(what), "all-to-all", lay_.ep_axes, rows * cols * s_ * (ep_ - 1) / ep_, true);
  }

  // -------- weights
  static std::vector<std::int64_t> stored(distributed::WeightLayout const& w) {
    std::vector<std::int64_t> v;
    for (auto const& d : w.dims) v.push_back(d.stored);
    return v;
  }
  static std::vector<std::int64_t> computed(distributed::WeightLayout const& w) {
    std::vector<std::int64_t> v;
    for (auto const& d : w.dims) v.push_back(d.computed);
    return v;
  }
  void to_compute(std::string const& name) {
    auto const& w = lay_.weight(name);
    auto cur = stored(w);
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& g = w.dims[d].gather;
      if (g.empty()) continue;
      std::vector<Axes> stages{g};
      if (par_.moe_fsdp_use_two_stage_all_gather && g.size() > 1) {
        stages.clear();
        for (auto it = g.rbegin(); it != g.rend(); ++it) stages.push_back({*it});
      }
      for (auto const& st : stages) {
        all_gather("gather " + name, st, product(cur), s_);
        cur[d] *= lay_.parts(st);
      }
    }
  }
  void gather_weights() {
    to_compute("gate");
    for (char const* n : {"wi_0", "wi_1", "wo"}) to_compute(n);
    if (cfg_.shared_mlp_dim() > 0)
      for (char const* n : {"shared_wi_0", "shared_wi_1", "shared_wo"}) to_compute(n);
  }
  void to_storage(std::string const& name) {
    auto const& w = lay_.weight(name);
    Axes gathered;
    for (auto const& d : w.dims) gathered.insert(gathered.end(), d.gather.begin(), d.gather.end());
    auto cur = computed(w);
    all_reduce("reduce d_" + name, minus(w.reduce, gathered), product(cur), s_);
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& sl = w.dims[d].slice;
      if (sl.empty()) continue;
      all_gather("unslice d_" + name, sl, product(cur), s_);
      cur[d] *= lay_.parts(sl);
    }
    for (std::size_t d = 0; d < w.dims.size(); ++d) {
      auto const& g = w.dims[d].gather;
      if (g.empty()) continue;
      auto const summed = minus(g, minus(g, w.reduce));
      auto next = cur;
      next[d] /= lay_.parts(g);
      if (summed.size() == g.size())
        reduce_scatter("reduce-scatter d_" + name, g, product(next), s_);
      else
        all_reduce("reduce d_" + name, summed, product(cur), s_);
      cur = next;
    }
  }
  void reduce_grads() {
    to_storage("gate");
    if (cfg_.routed_bias) to_storage("gate_bias");
    for (char const* n : {"wi_0", "wi_1", "wo"}) to_storage(n);
    if (cfg_.shared_mlp_dim() > 0)
      for (char const* n : {"shared_wi_0", "shared_wi_1", "shared_wo"}) to_storage(n);
  }

  // -------- routing statistics
  void route_tokens() {
    if (cfg_.load_balance_loss_weight > 0) all_reduce("lb loss", lay_.batch_axes, 1, 8);
    if (cfg_.routed_bias_update_rate > 0) all_reduce("bias counts", lay_.batch_axes, E_, 8);
  }

  // -------- ragged all-to-all path
  void a2a_forward() {
    all_to_all("dispatch", sent_, D_);
    reduce_scatter("reduce-scatter y (tensor)", lay_.tp_axes, recv_ * Dc_, s_, true);
    all_to_all("combine", recv_, Dc_);
    finish_output();
  }
  void a2a_backward() {
    all_reduce("reduce d_weights (tensor)", lay_.tp_axes, T_ * K_, s_);
    all_to_all("dispatch d_y", sent_, Dc_);
    all_gather("all-gather d_y (tensor)", lay_.tp_axes, recv_ * Dc_, s_, true);
    reduce_scatter("reduce-scatter d_x (tensor)", lay_.tp_axes, recv_ * Dc_, s_, true);
    all_to_all("combine d_x", recv_, Dc_);
    all_gather("all-gather d_x (tensor)", lay_.tp_axes, T_ * Dc_, s_);
    shared_backward();
  }

  // -------- token-gathering paths (ring, replicated, local)
  void tokens_reduce(std::string const& what, std::int64_t own_elems, std::int64_t work_elems) {
    if (lay_.route == ExpertRoute::Ring)
      reduce_scatter("reduce-scatter " + what + " (expert)", lay_.ep_axes, own_elems, s_);
    else
      all_reduce("reduce " + what + " (expert)", lay_.ep_axes, work_elems, s_);
  }
  void gathered_forward() {
    tokens_reduce("y", T_ * D_, Tw_ * D_);
    reduce_scatter("reduce-scatter y (tensor)", lay_.tp_axes, T_ * Dc_, s_);
    finish_output();
  }
  void gathered_backward() {
    if (lay_.route == ExpertRoute::Ring)
      all_gather("all-gather d_y (expert)", lay_.ep_axes, T_ * D_, s_);
    all_reduce("reduce d_weights (tensor)", lay_.tp_axes, Tw_ * K_, s_);
    tokens_reduce("d_weights", T_ * K_, Tw_ * K_);
    all_reduce("reduce d_x (tensor)", lay_.tp_axes, Tw_ * D_, s_);
    tokens_reduce("d_x", T_ * D_, Tw_ * D_);
    shared_backward();
  }

  // -------- shared expert (EP-as-TP) and the output columns
  std::int64_t shared_group() const { return lay_.route == ExpertRoute::Replicated ? 1 : ep_; }
  void shared_tokens_reduce(std::string const& what) {
    if (shared_group() > 1)
      reduce_scatter("reduce-scatter " + what + " (expert)", lay_.ep_axes, T_ * D_, s_);
    else
      all_reduce("reduce " + what + " (expert)", lay_.ep_axes, T_ * D_, s_);
  }
  void finish_output() {
    if (cfg_.shared_mlp_dim() > 0) {
      if (shared_group() > 1)
        all_gather("all-gather x (shared, expert)", lay_.ep_axes, T_ * D_, s_);
      shared_tokens_reduce("y shared");
      reduce_scatter("reduce-scatter y shared (tensor)", lay_.tp_axes, T_ * Dc_, s_);
    }
    all_gather("all-gather y (tensor)", lay_.tp_axes, T_ * Dc_, s_);
  }
  void shared_backward() {
    if (cfg_.shared_mlp_dim() == 0) return;
    if (shared_group() > 1)
      all_gather("all-gather d_y (shared, expert)", lay_.ep_axes, T_ * D_, s_);
    all_reduce("reduce d_x shared (tensor)", lay_.tp_axes, T_ * shared_group() * D_, s_);
    shared_tokens_reduce("d_x shared");
  }

  distributed::Layout const& lay_;
  LayerConfig const& cfg_;
  ParallelConfig const& par_;
  std::int64_t s_;
  std::vector<PlanCollective>& out_;
  bool backward_ = false;
  std::int64_t T_ = 0, Tw_ = 0, D_ = 0, Dc_ = 0, K_ = 0, E_ = 0, ep_ = 1, tp_ = 1;
  std::int64_t sent_ = 0, recv_ = 0;
};

inline std::string axes_text(Axes const& a) {
  if (a.empty()) return "-";
  std::string s;
  for (auto const& x : a) s += (s.empty() ? "" : ",") + x;
  return s;
}
inline std::string list_text(Axes const& a) {
  std::string s;
  for (auto const& x : a) s += (s.empty() ? "" : ", ") + x;
  return s;
}
using moe::detail::shape_text;
/// [a, (b,c), -] : one entry per dimension.
inline std::string spec_text(sharding::PartitionSpec const& spec) {
  std::string s = "[";
  for (std::size_t i = 0; i < spec.size(); ++i) {
    s += i ? ", " : "";
    if (spec[i].empty())
      s += "-";
    else if (spec[i].size() == 1)
      s += spec[i][0];
    else
      s += "(" + axes_text(spec[i]) + ")";
  }
  return s + "]";
}
inline std::string logical_text(sharding::LogicalAxes const& l) {
  std::string s = "(";
  for (std::size_t i = 0; i < l.size(); ++i) s += (i ? ", " : "") + (l[i] ? *l[i] : "None");
  return s + ")";
}
/// Per-dimension axes, e.g. "dim 1 over fsdp; dim 2 over fsdp_transpose" ("-" when none).
inline std::string per_dim_text(std::vector<Axes> const& dims) {
  std::string s;
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (!dims[d].empty())
      s += (s.empty() ? "" : "; ") + std::string("dim ") + std::to_string(d) + " over " +
           axes_text(dims[d]);
  return s.empty() ? "-" : s;
}
inline std::string pad(std::string s, std::size_t n) {
  if (s.size() < n) s.append(n - s.size(), ' ');
  return s;
}

inline std::string json_strings(Axes const& a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + sharding::json_string(a[i]);
  return s + "]";
}
inline std::string json_ints(std::vector<std::int64_t> const& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string json_logical(sharding::LogicalAxes const& l) {
  std::string s = "[";
  for (std::size_t i = 0; i < l.size(); ++i)
    s += (i ? ", " : "") + (l[i] ? sharding::json_string(*l[i]) : std::string("null"));
  return s + "]";
}
inline std::string json_per_dim(std::vector<Axes> const& dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + json_strings(dims[i]);
  return s + "]";
}

}  // namespace plan_detail

/// \brief The partition plan of `rank` of `world_size` ranks for a global batch
/// [global_batch, seq_len, base_emb_dim] (pure; no MPI call).
///
/// Throws the ConfigError the layer's constructor would throw for the same arguments. The plan is
/// the one of the default GEMM policies: a layer built with gmm::Dense runs like
/// sparse_matmul=false (tokens gathered over the expert axes, as the ring does).
/// \param scalar_bytes size of one value (4: float, 8: double) for the byte counts
inline LayerPlan make_plan(LayerConfig const& cfg, ParallelConfig const& par, int world_size,
                           int rank, std::int64_t global_batch, std::int64_t seq_len,
                           std::size_t scalar_bytes = sizeof(float)) {
  using plan_detail::contains;
  detail::require<ConfigError>(scalar_bytes == 4 || scalar_bytes == 8,
                               "scalar_bytes=", scalar_bytes, " must be 4 (float) or 8 (double)");
  LayerPlan p;
  p.layout = distributed::compute_layout(cfg, par, world_size, rank, global_batch, seq_len);
  auto const& lay = p.layout;
  p.world_size = world_size;
  p.scalar_bytes = scalar_bytes;
  p.config = cfg;
  p.parallel = par;
  p.local_tokens = lay.block("x").local_shape[0] * seq_len;

  // Tokens: split over the batch axes; the ring gathers them over the expert axes to compute.
  for (char const* name : {"x", "y"}) {
    PlanTensor t;
    t.name = name;
    t.logical = lay.token_logical;
    t.spec = lay.token_spec;
    t.storage = {lay.batch_axes, {}, {}};
    t.gathered = {{}, {}, {}};
    t.sliced = {{}, {}, {}};
    auto const b = lay.block(name);
    t.global_shape = b.global_shape;
    t.local_shape = b.local_shape;
    t.offset = b.offset;
    t.compute_shape = b.local_shape;
    if (lay.route == ExpertRoute::Ring) {
      t.gathered[0] = lay.ep_axes;
      t.compute_shape[0] *= lay.ep();
    }
    p.tensors.push_back(std::move(t));
  }
  for (auto const& w : lay.weights) {
    PlanTensor t;
    t.name = w.name;
    t.logical = w.logical;
    t.spec = w.spec;
    t.reduced = w.reduce;
    auto const b = lay.block(w.name);
    t.global_shape = b.global_shape;
    t.local_shape = b.local_shape;
    t.offset = b.offset;
    for (auto const& d : w.dims) {
      t.storage.push_back(d.storage);
      t.gathered.push_back(d.gather);
      t.sliced.push_back(d.slice);
      t.compute_shape.push_back(d.computed);
    }
    p.tensors.push_back(std::move(t));
  }

  plan_detail::Schedule(lay, cfg, par, std::int64_t(scalar_bytes), p.collectives).run();

  std::int64_t const ep = lay.ep();
  if (lay.route == ExpertRoute::RaggedA2A)
    p.notes.push_back(detail::cat(
        "all-to-all bytes (marked ~) assume balanced routing: each dispatch and each combine "
        "sends T_local*K*D*sizeof*(ep-1)/ep = ",
        p.local_tokens, "*", cfg.num_experts_per_tok, "*", cfg.base_emb_dim, "*", scalar_bytes, "*",
        ep - 1, "/", ep, " = ",
        p.local_tokens * cfg.num_experts_per_tok * cfg.base_emb_dim * std::int64_t(scalar_bytes) *
            (ep - 1) / ep,
        " bytes (D/tp columns after the tensor split), and the tensor-axis collectives on "
        "received rows assume T_local*K of them",
        cfg.capacity_factor > 0 ? "; per-sequence capacity keeps min(S*K, E*C) slots" : "",
        par.ragged_buffer_factor > 0 ? "; the receive buffer caps the rows at int(T*K*factor)"
                                     : ""));
  p.notes.push_back(
      "all-reduce bytes are 2*(P-1)/P of the buffer (ring algorithm); count exchanges and error "
      "checks (a few integers per collective call) are not listed");

  // SEMANTICS §1.13: the dense dispatch tensor resolved jointly lets the batch dimension claim
  // `expert` (activation_batch_moe precedes activation_exp), leaving the expert dimension
  // unsharded.
  p.dispatch_logical = {"activation_exp", "activation_batch_moe", std::nullopt,
                        "activation_embed_moe"};
  p.dispatch_joint = sharding::resolve_dispatch(lay.rules, p.dispatch_logical, false);
  p.dispatch_repaired = sharding::resolve_dispatch(lay.rules, p.dispatch_logical, true);
  int const expert_size = lay.mesh.size("expert");
  if (expert_size > 1 && contains(p.dispatch_joint[1], "expert") &&
      lay.big(p.dispatch_joint[0]).empty())
    p.warnings.push_back(detail::cat(
        "dense dispatch tensor ", plan_detail::logical_text(p.dispatch_logical),
        " resolves jointly to ", sharding::to_json(p.dispatch_joint),
        ": its batch dimension claims mesh axis 'expert' (size ", expert_size,
        ") and its expert dimension is unsharded, so the dense-path dispatch (sparse_matmul=false)"
        " would become an all-gather + reduce-scatter over 'expert' instead of splitting the "
        "experts (SEMANTICS 1.13); moe_dispatch_no_expert_sharding=true (resolve each dimension "
        "on its own, then strip 'expert' from the batch dimension) fixes it: ",
        sharding::to_json(p.dispatch_repaired)));
  return p;
}

inline std::string LayerPlan::to_text() const {
  using namespace plan_detail;
  auto const& lay = layout;
  std::string o;
  auto line = [&o](std::string const& s) { o += s + "\n"; };
  line(detail::cat("MoE layer plan: rank ", lay.rank, " of ", world_size, ", global batch [",
                   lay.global_batch, ", ", lay.seq_len, ", ", lay.emb_dim, "] (B, S, D), ",
                   scalar_bytes == 8 ? "float64" : "float32", " values"));
  Axes big, one;
  for (auto const& [name, size] : lay.mesh.axes())
    if (size > 1)
      big.push_back(detail::cat(name, "=", size));
    else
      one.push_back(name);
  std::string mesh;
  for (auto const& a : big) mesh += (mesh.empty() ? "" : " x ") + a;
  if (mesh.empty()) mesh = "every axis of size 1";
  line(detail::cat("mesh (", lay.preset, "): ", mesh,
                   one.empty() ? "" : "; size 1: " + list_text(one)));
  line(detail::cat("batch axes: ", axes_text(lay.batch_axes), " (", lay.global_batch, " / ",
                   lay.batch_parts, " = ", lay.global_batch / lay.batch_parts,
                   " sequences per rank, T_local = ", local_tokens, " tokens)"));
  std::string route;
  switch (lay.route) {
    case ExpertRoute::Local:
      route = "local (no expert parallelism)";
      break;
    case ExpertRoute::RaggedA2A:
      route = "ragged all-to-all over " + axes_text(lay.ep_axes);
      break;
    case ExpertRoute::Ring:
      route = "ring of experts: tokens all-gathered over " + axes_text(lay.ep_axes) +
              ", outputs reduce-scattered";
      break;
    case ExpertRoute::Replicated:
      route = "replicated batch over " + axes_text(lay.ep_axes) + ", outputs all-reduced";
      break;
  }
  line(detail::cat("expert route: ", route, "; E=", config.num_experts,
                   ", K=", config.num_experts_per_tok, ", experts ", lay.first_expert, "..",
                   lay.first_expert + lay.local_experts - 1, " on this rank (", lay.local_experts,
                   " local)"));
  line(detail::cat("tensor axes: ", axes_text(lay.tp_axes)));
  line("");
  line("tensors (spec: as the rules resolve it, - = unsharded; local: block stored here; compute:");
  line("block the step computes with):");
  for (auto const& t : tensors) {
    line(detail::cat("  ", pad(t.name, 12), logical_text(t.logical), " spec ", spec_text(t.spec)));
    line(detail::cat("  ", pad("", 12), "global ", shape_text(t.global_shape), "  local ",
                     shape_text(t.local_shape), " at ", shape_text(t.offset), "  compute ",
                     shape_text(t.compute_shape)));
    line(detail::cat("  ", pad("", 12), "stored split: ", per_dim_text(t.storage),
                     " | all-gathered: ", per_dim_text(t.gathered), " | sliced: ",
                     per_dim_text(t.sliced), " | gradient summed over: ", axes_text(t.reduced)));
  }
  line("");
  line("collectives of one training step (bytes this rank sends; ~ = assumes balanced routing):");
  for (bool bw : {false, true}) {
    line(bw ? "  backward:" : "  forward:");
    bool any = false;
    for (auto const& c : collectives) {
      if (c.backward != bw) continue;
      any = true;
      line(detail::cat("    ", pad(c.kind, 15), pad("[" + axes_text(c.axes) + "]", 20),
                       pad(c.what, 34), c.balanced ? "~" : " ", c.bytes, " B"));
    }
    if (!any) line("    (none)");
  }
  line(detail::cat("  bytes: forward ", bytes(false), ", backward ", bytes(true), ", step ",
                   step_bytes()));
  std::vector<std::pair<std::string, std::int64_t>> by_kind;
  for (auto const& c : collectives) {
    auto it = std::find_if(by_kind.begin(), by_kind.end(),
                           [&](auto const& k) { return k.first == c.kind; });
    if (it == by_kind.end())
      by_kind.emplace_back(c.kind, c.bytes);
    else
      it->second += c.bytes;
  }
  std::string kinds;
  for (auto const& [k, b] : by_kind)
    kinds += (kinds.empty() ? "" : ", ") + k + " " + std::to_string(b);
  if (!kinds.empty()) line("  by kind: " + kinds);
  line("");
  line(detail::cat("dense dispatch ", logical_text(dispatch_logical), ": joint ",
                   spec_text(dispatch_joint), ", with moe_dispatch_no_expert_sharding ",
                   spec_text(dispatch_repaired)));
  for (auto const& n : notes) line("note: " + n);
  for (auto const& w : warnings) line("WARNING: " + w);
  return o;
}

inline std::string LayerPlan::to_json() const {
  using namespace plan_detail;
  using sharding::json_string;
  auto const& lay = layout;
  std::string o = "{";
  o += detail::cat("\"rank\": ", lay.rank, ", \"world_size\": ", world_size,
                   ", \"global_batch\": ", lay.global_batch, ", \"seq_len\": ", lay.seq_len,
                   ", \"emb_dim\": ", lay.emb_dim, ", \"scalar_bytes\": ", scalar_bytes,
                   ", \"local_tokens\": ", local_tokens, ", \"preset\": ", json_string(lay.preset),
                   ", \"mesh\": {");
  for (int i = 0; i < lay.mesh.num_axes(); ++i)
    o += detail::cat(i ? ", " : "", json_string(lay.mesh.name(i)), ": ", lay.mesh.size(i));
  o += detail::cat("}, \"expert_route\": ", json_string(to_string(lay.route)),
                   ", \"batch_axes\": ", json_strings(lay.batch_axes),
                   ", \"expert_axes\": ", json_strings(lay.ep_axes),
                   ", \"tensor_axes\": ", json_strings(lay.tp_axes),
                   ", \"num_experts\": ", config.num_experts,
                   ", \"local_experts\": ", lay.local_experts,
                   ", \"first_expert\": ", lay.first_expert, ", \"tensors\": {");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto const& t = tensors[i];
    o += detail::cat(
        i ? ", " : "", json_string(t.name), ": {\"logical\": ", json_logical(t.logical),
        ", \"spec\": ", sharding::to_json(t.spec), ", \"storage\": ", json_per_dim(t.storage),
        ", \"global_shape\": ", json_ints(t.global_shape),
        ", \"local_shape\": ", json_ints(t.local_shape), ", \"offset\": ", json_ints(t.offset),
        ", \"compute_shape\": ", json_ints(t.compute_shape),
        ", \"gathered\": ", json_per_dim(t.gathered), ", \"sliced\": ", json_per_dim(t.sliced),
        ", \"reduced\": ", json_strings(t.reduced), "}");
  }
  o += "}, \"collectives\": [";
  for (std::size_t i = 0; i < collectives.size(); ++i) {
    auto const& c = collectives[i];
    o += detail::cat(i ? ", " : "", "{\"phase\": ", c.backward ? "\"backward\"" : "\"forward\"",
                     ", \"what\": ", json_string(c.what), ", \"kind\": ", json_string(c.kind),
                     ", \"axes\": ", json_strings(c.axes), ", \"bytes\": ", c.bytes,
                     ", \"balanced_routing\": ", c.balanced ? "true" : "false", "}");
  }
  o += detail::cat("], \"bytes\": {\"forward\": ", bytes(false), ", \"backward\": ", bytes(true),
                   ", \"step\": ", step_bytes(),
                   "}, \"dispatch\": {\"logical\": ", json_logical(dispatch_logical),
                   ", \"joint\": ", sharding::to_json(dispatch_joint),
                   ", \"repaired\": ", sharding::to_json(dispatch_repaired),
                   "}, \"notes\": ", json_strings(notes),
                   ", \"warnings\": ", json_strings(warnings), "}\n");
  return o;
}

}  // namespace moe
