#pragma once
/// \file
/// The partition plan of one distributed MoE layer (`moe-shard --plan`): for one rank, the mesh,
/// route, tensor blocks and step plan with the bytes it sends (pure: any rank, on one process).

#include <moe/comm/comm_log.hpp>
#include <moe/config.hpp>
#include <moe/detail/json.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/distributed/strategy.hpp>
#include <moe/error.hpp>
#include <moe/sharding/rules.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief One tensor of the plan: where it lives on this rank and what a step does to it.
struct PlanTensor {
  std::string name;               ///< x, y, gate, gate_bias, wi_0, wi_1, wo, shared_*
  sharding::LogicalAxes logical;  ///< logical names of its dimensions
  sharding::PartitionSpec spec;   ///< spec the rules resolve (size-1 axes kept)
  std::vector<std::vector<std::string>> storage;  ///< per dim: mesh axes splitting the stored block
  std::vector<std::vector<std::string>> gathered;  ///< per dim: axes gathered for the compute block
  std::vector<std::vector<std::string>> sliced;  ///< per dim: axes splitting the compute block more
  std::vector<std::string> reduced;              ///< token axes the gradient is summed over
  std::vector<std::int64_t> global_shape;        ///< whole tensor
  std::vector<std::int64_t> local_shape;         ///< block stored on this rank
  std::vector<std::int64_t> offset;              ///< where the stored block starts
  std::vector<std::int64_t> compute_shape;       ///< block the step computes with
};

/// \brief One collective of a training step.
struct PlanCollective {
  bool backward = false;          ///< run by the backward pass (else by the forward)
  std::string what;               ///< the layer's record name, e.g. "gather wi_0", "dispatch"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group
  std::int64_t bytes = 0;         ///< bytes this rank sends
  bool balanced = false;          ///< bytes assume balanced routing (else exact)
  std::string stage;              ///< the step-plan stage that runs it (its profiling region)
};

/// \brief A choice the rules leave (the shared expert under EP), with each alternative's cost.
struct PlanChoice {
  struct Alternative {
    std::string name;        ///< e.g. "own tokens", "ep-as-tp"
    std::int64_t bytes = 0;  ///< bytes this rank sends in one step for it (weights and tokens)
    double flops = 0;        ///< its GEMM FLOPs on this rank in one step
  };
  std::string what;    ///< the FFN: "shared expert"
  std::string chosen;  ///< the name of the alternative taken
  std::vector<Alternative> alternatives;
  std::string why;  ///< "same FLOPs, fewest bytes" or "fewest FLOPs"
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
  distributed::StepPlan step;                 ///< the stages the layer runs, in order
  std::vector<PlanCollective> collectives;    ///< the stages' collectives, in order
  sharding::LogicalAxes dispatch_logical;     ///< the dense dispatch tensor's logical names
  sharding::PartitionSpec dispatch_joint;     ///< resolved jointly (MaxText's default)
  sharding::PartitionSpec dispatch_repaired;  ///< with moe_dispatch_no_expert_sharding
  std::vector<PlanChoice> choices;            ///< where the rules leave a choice
  std::vector<std::string> notes;             ///< assumptions behind the byte counts
  std::vector<std::string> warnings;          ///< layout problems worth fixing

  /// Bytes this rank sends in the forward (backward = false) or the backward pass.
  std::int64_t bytes(bool backward) const { return comm::phase_bytes(collectives, backward); }
  /// Bytes this rank sends in one training step.
  std::int64_t step_bytes() const { return bytes(false) + bytes(true); }
  /// The tensor named `name` (ConfigError when the plan has none).
  PlanTensor const& tensor(std::string const& name) const {
    for (auto const& t : tensors)
      if (t.name == name) return t;
    throw ConfigError(moe::detail::cat("the plan has no tensor named '", name, "'"));
  }

  std::string to_text() const;             ///< readable multi-line text
  moe::detail::ordered_json json() const;  ///< the plan as one JSON object
  /// json() as one line of text, newline-terminated.
  std::string to_json() const { return moe::detail::json_text(json()) + "\n"; }
};

namespace detail {

using Axes = std::vector<std::string>;

inline std::string list_text(Axes const& a) { return join(a, ", ", ""); }  ///< "a, b" ("": none)
using moe::detail::shape_text;
/// [a, (b,c), -] : one entry per dimension.
inline std::string spec_text(sharding::PartitionSpec const& spec) {
  std::string s = "[";
  for (std::size_t i = 0; i < spec.size(); ++i)
    s += (i ? ", " : "") +
         (spec[i].size() > 1 ? "(" + axes_text(spec[i]) + ")" : axes_text(spec[i]));
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
/// The printed names of stage reads or writes.
inline Axes names(std::vector<distributed::Ref> const& refs) {
  Axes out;
  for (auto r : refs) out.push_back(distributed::to_string(r));
  return out;
}
inline std::string pad(std::string s, std::size_t n) {
  return s.size() < n ? s + std::string(n - s.size(), ' ') : s;
}

/// A logical-axes list as JSON: each name, or null for an unnamed dimension.
inline moe::detail::ordered_json json_logical(sharding::LogicalAxes const& l) {
  auto j = moe::detail::ordered_json::array();
  for (auto const& name : l) j.push_back(name ? moe::detail::ordered_json(*name) : nullptr);
  return j;
}

/// What the shared expert of `step` moves (with its weights' collectives) and computes.
inline PlanChoice::Alternative shared_expert_cost(StepPlan const& step, char const* name) {
  PlanChoice::Alternative a{name, 0, 0};
  for (auto const* phase : {&step.forward, &step.backward})
    for (auto const& st : *phase) {
      bool const shared = st.kind == StageKind::shared_expert;
      if (shared) a.flops += st.flops;
      for (auto const& c : st.collectives)
        if (shared || c.what.find("shared_") != std::string::npos) a.bytes += c.bytes;
    }
  return a;
}

/// The shared expert's strategy against the other (none without one, without EP, or on EP-TP).
inline std::vector<PlanChoice> shared_expert_choice(LayerConfig const& cfg,
                                                    ParallelConfig const& par, int world_size,
                                                    std::size_t scalar_bytes, Layout const& lay) {
  if (lay.shared == SharedExpert::none || lay.ep() == 1 || lay.route == ExpertRoute::EpTp)
    return {};
  PlanChoice c;
  c.what = "shared expert";
  c.chosen = to_string(lay.shared);
  for (SharedExpert mode : {SharedExpert::own, SharedExpert::split}) {
    Layout const other = mode == lay.shared
                             ? lay
                             : compute_layout(cfg, par, world_size, lay.rank, lay.global_batch,
                                              lay.seq_len, false, mode);
    c.alternatives.push_back(
        shared_expert_cost(make_step_plan(other, cfg, par, scalar_bytes), to_string(mode)));
  }
  c.why = c.alternatives[0].flops == c.alternatives[1].flops ? "same FLOPs, fewest bytes"
                                                             : "fewest FLOPs";
  return {c};
}

}  // namespace detail

/// \brief The partition plan of `rank` of `world_size` ranks for a global batch
/// [global_batch, seq_len, D] (pure, default GEMM policies; the layer's ConfigErrors).
/// \param scalar_bytes size of one value (4: float, 8: double) for the byte counts
inline LayerPlan make_plan(LayerConfig const& cfg, ParallelConfig const& par, int world_size,
                           int rank, std::int64_t global_batch, std::int64_t seq_len,
                           std::size_t scalar_bytes = sizeof(float)) {
  moe::detail::require<ConfigError>(scalar_bytes == 4 || scalar_bytes == 8,
                                    "scalar_bytes=", scalar_bytes,
                                    " must be 4 (float) or 8 (double)");
  LayerPlan p;
  p.layout = distributed::compute_layout(cfg, par, world_size, rank, global_batch, seq_len);
  auto const& lay = p.layout;
  p.world_size = world_size;
  p.scalar_bytes = scalar_bytes;
  p.config = cfg;
  p.parallel = par;
  p.local_tokens = lay.block("x").local_shape[0] * seq_len;
  p.step = distributed::make_step_plan(lay, cfg, par, scalar_bytes);

  auto tensor = [&lay](std::string name, sharding::LogicalAxes logical,
                       sharding::PartitionSpec spec) {
    auto const b = lay.block(name);
    return PlanTensor{std::move(name), std::move(logical), std::move(spec), {}, {}, {}, {},
                      b.global_shape,  b.local_shape,      b.offset,        {}};
  };
  // Tokens: split over the batch axes; gathered over the axes the strategy names.
  for (char const* name : {"x", "y"}) {
    PlanTensor t = tensor(name, lay.token_logical, lay.token_spec);
    t.storage = {lay.batch_axes, {}, lay.emb_axes};
    t.gathered = p.step.token_gathered;
    t.sliced = {{}, {}, {}};
    t.compute_shape = t.local_shape;
    for (std::size_t d = 0; d < 3; ++d) t.compute_shape[d] *= lay.parts(t.gathered[d]);
    p.tensors.push_back(std::move(t));
  }
  for (auto const& w : lay.weights) {
    PlanTensor t = tensor(w.name, w.logical, w.spec);
    t.reduced = w.reduce;
    for (auto const& d : w.dims) {
      t.storage.push_back(d.storage);
      t.gathered.push_back(d.gather);
      t.sliced.push_back(d.slice);
      t.compute_shape.push_back(d.computed);
    }
    p.tensors.push_back(std::move(t));
  }

  for (auto const* phase : {&p.step.forward, &p.step.backward})
    for (auto const& st : *phase)
      for (auto const& c : st.collectives)
        p.collectives.push_back(
            {st.backward, c.what, c.kind, c.axes, c.bytes, c.balanced, st.region});

  p.choices = detail::shared_expert_choice(cfg, par, world_size, scalar_bytes, lay);
  p.notes = p.step.notes;  // the strategy's, then the plan's
  p.notes.push_back(
      "all-reduce bytes are 2*(P-1)/P of the buffer (ring algorithm); count exchanges and error "
      "checks (a few integers per collective call) are not listed");

  // SEMANTICS §1.13: resolved jointly, the dispatch tensor's batch dimension may claim `expert`.
  p.dispatch_logical = detail::dispatch_logical();
  p.dispatch_joint = sharding::resolve_dispatch(lay.rules, p.dispatch_logical, false);
  p.dispatch_repaired = sharding::resolve_dispatch(lay.rules, p.dispatch_logical, true);
  int const expert_size = lay.mesh.size("expert");
  if (!par.moe_dispatch_no_expert_sharding && expert_size > 1 &&
      detail::contains(p.dispatch_joint[1], "expert") && lay.big(p.dispatch_joint[0]).empty())
    p.warnings.push_back(moe::detail::cat(
        "dense dispatch tensor ", detail::logical_text(p.dispatch_logical), " resolves jointly to ",
        sharding::to_json(p.dispatch_joint),
        ": its batch dimension claims mesh axis 'expert' (size ", expert_size,
        ") and its expert dimension is unsharded, so the dense-path dispatch (sparse_matmul=false)"
        " would become an all-gather + reduce-scatter over 'expert' instead of splitting the "
        "experts (SEMANTICS 1.13); moe_dispatch_no_expert_sharding=true (resolve each dimension "
        "on its own, then strip 'expert' from the batch dimension; the dense path then runs the "
        "expert-parallel all-to-all) fixes it: ",
        sharding::to_json(p.dispatch_repaired)));
  return p;
}

inline std::string LayerPlan::to_text() const {
  using namespace detail;
  auto const& lay = layout;
  std::string o;
  auto line = [&o](auto const&... a) { o += moe::detail::cat(a...) + "\n"; };
  line("MoE layer plan: rank ", lay.rank, " of ", world_size, ", global batch [", lay.global_batch,
       ", ", lay.seq_len, ", ", lay.emb_dim, "] (B, S, D), ",
       scalar_bytes == 8 ? "float64" : "float32", " values",
       config.bf16() ? " (dtype=bfloat16: activations and weight gathers move as "
                       "bf16, gradient reductions as fp32)"
                     : "");
  Axes big, one;
  for (auto const& [name, size] : lay.mesh.axes())
    if (size > 1)
      big.push_back(moe::detail::cat(name, "=", size));
    else
      one.push_back(name);
  line("mesh (", lay.preset, "): ", join(big, " x ", "every axis of size 1"),
       one.empty() ? "" : "; size 1: " + list_text(one));
  line("batch axes: ", axes_text(lay.batch_axes), " (", lay.global_batch, " / ", lay.batch_parts,
       " = ", lay.global_batch / lay.batch_parts, " sequences per rank, T_local = ", local_tokens,
       " tokens)");
  line("expert route: ", step.route_text, "; E=", config.num_experts,
       ", K=", config.num_experts_per_tok, ", experts ", lay.first_expert, "..",
       lay.first_expert + lay.local_experts - 1, " on this rank (", lay.local_experts, " local)");
  line("tensor axes: ", axes_text(lay.tp_axes));
  line("");
  line("tensors (spec: as the rules resolve it, - = unsharded; local: block stored here; compute:");
  line("block the step computes with):");
  for (auto const& t : tensors) {
    line("  ", pad(t.name, 12), logical_text(t.logical), " spec ", spec_text(t.spec));
    line("  ", pad("", 12), "global ", shape_text(t.global_shape), "  local ",
         shape_text(t.local_shape), " at ", shape_text(t.offset), "  compute ",
         shape_text(t.compute_shape));
    line("  ", pad("", 12), "stored split: ", per_dim_text(t.storage),
         " | all-gathered: ", per_dim_text(t.gathered), " | sliced: ", per_dim_text(t.sliced),
         " | gradient summed over: ", axes_text(t.reduced));
  }
  line("");
  line("step: the stages the layer runs, in order (reads -> writes), each with its collectives");
  line("(bytes this rank sends; ~ = assumes balanced routing):");
  for (bool bw : {false, true}) {
    line(bw ? "  backward:" : "  forward:");
    int i = 0;
    for (auto const& st : bw ? step.backward : step.forward) {
      line("    ", ++i, ". ", pad(distributed::to_string(st.kind), 18), list_text(names(st.reads)),
           " -> ", list_text(names(st.writes)));
      for (auto const& c : st.collectives)
        line("         ", pad(c.kind, 15), pad("[" + axes_text(c.axes) + "]", 20), pad(c.what, 34),
             c.balanced ? "~" : " ", c.bytes, " B");
    }
  }
  line("  bytes: forward ", bytes(false), ", backward ", bytes(true), ", step ", step_bytes());
  Axes seen, kinds;  // the bytes of each kind, in order of first use
  for (auto const& c : collectives) {
    if (contains(seen, c.kind)) continue;
    seen.push_back(c.kind);
    std::int64_t b = 0;
    for (auto const& o : collectives) b += o.kind == c.kind ? o.bytes : 0;
    kinds.push_back(c.kind + " " + std::to_string(b));
  }
  if (!kinds.empty()) line("  by kind: " + list_text(kinds));
  for (auto const& c : choices) {
    std::string alts;
    for (auto const& a : c.alternatives)
      alts += moe::detail::cat(alts.empty() ? "" : "; ", a.name, ": ", a.bytes, " B, ", a.flops,
                               " FLOP");
    line("  ", c.what, ": ", c.chosen, " (", c.why, "; per step ", alts, ")");
  }
  line("");
  line("dense dispatch ", logical_text(dispatch_logical), ": joint ", spec_text(dispatch_joint),
       ", with moe_dispatch_no_expert_sharding ", spec_text(dispatch_repaired), "; in effect ",
       spec_text(layout.dispatch_spec));
  for (auto const& n : notes) line("note: " + n);
  for (auto const& w : warnings) line("WARNING: " + w);
  return o;
}

inline moe::detail::ordered_json LayerPlan::json() const {
  using detail::json_logical;
  using moe::detail::ordered_json;
  auto const& lay = layout;
  ordered_json o;
  o["rank"] = lay.rank;
  o["world_size"] = world_size;
  o["global_batch"] = lay.global_batch;
  o["seq_len"] = lay.seq_len;
  o["emb_dim"] = lay.emb_dim;
  o["scalar_bytes"] = scalar_bytes;
  o["local_tokens"] = local_tokens;
  o["preset"] = lay.preset;
  auto& mesh = o["mesh"] = ordered_json::object();
  for (int i = 0; i < lay.mesh.num_axes(); ++i) mesh[lay.mesh.name(i)] = lay.mesh.size(i);
  o["expert_route"] = to_string(lay.route);
  o["batch_axes"] = lay.batch_axes;
  o["expert_axes"] = lay.ep_axes;
  o["tensor_axes"] = lay.tp_axes;
  o["num_experts"] = config.num_experts;
  o["local_experts"] = lay.local_experts;
  o["first_expert"] = lay.first_expert;
  auto& ts = o["tensors"] = ordered_json::object();
  for (auto const& t : tensors)
    ts[t.name] = {{"logical", json_logical(t.logical)},
                  {"spec", sharding::json(t.spec)},
                  {"storage", t.storage},
                  {"global_shape", t.global_shape},
                  {"local_shape", t.local_shape},
                  {"offset", t.offset},
                  {"compute_shape", t.compute_shape},
                  {"gathered", t.gathered},
                  {"sliced", t.sliced},
                  {"reduced", t.reduced}};
  auto& cs = o["collectives"] = ordered_json::array();
  for (auto const& c : collectives)
    cs.push_back({{"phase", c.backward ? "backward" : "forward"},
                  {"what", c.what},
                  {"kind", c.kind},
                  {"axes", c.axes},
                  {"bytes", c.bytes},
                  {"balanced_routing", c.balanced},
                  {"stage", c.stage}});
  auto& ss = o["stages"] = ordered_json::array();
  for (auto const* phase : {&step.forward, &step.backward})
    for (auto const& st : *phase)
      ss.push_back({{"phase", st.backward ? "backward" : "forward"},
                    {"kind", distributed::to_string(st.kind)},
                    {"region", st.region},
                    {"reads", detail::names(st.reads)},
                    {"writes", detail::names(st.writes)},
                    {"collectives", st.collectives.size()},
                    {"flops", st.flops}});
  o["bytes"] = {{"forward", bytes(false)}, {"backward", bytes(true)}, {"step", step_bytes()}};
  o["dispatch"] = {{"logical", json_logical(dispatch_logical)},
                   {"joint", sharding::json(dispatch_joint)},
                   {"repaired", sharding::json(dispatch_repaired)},
                   {"in_effect", sharding::json(layout.dispatch_spec)}};
  auto& ch = o["choices"] = ordered_json::array();
  for (auto const& c : choices) {
    auto alts = ordered_json::array();
    for (auto const& a : c.alternatives)
      alts.push_back({{"name", a.name}, {"bytes", a.bytes}, {"flops", a.flops}});
    ch.push_back({{"ffn", c.what}, {"chosen", c.chosen}, {"why", c.why}, {"alternatives", alts}});
  }
  o["notes"] = notes;
  o["warnings"] = warnings;
  return o;
}

}  // namespace moe::distributed

namespace moe {
using distributed::LayerPlan, distributed::make_plan, distributed::PlanChoice,
    distributed::PlanCollective, distributed::PlanTensor;
}  // namespace moe
