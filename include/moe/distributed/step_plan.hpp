#pragma once
/// \file
/// The step plan of the distributed layer (docs/architecture.md): the stages of one step with
/// their buffers and collectives, and each weight's ops; sizes assume balanced routing.

#include <moe/comm/wire.hpp>
#include <moe/distributed/buffers.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief One collective of a step.
struct PlannedCollective {
  std::string what;               ///< comm-log record name, e.g. "gather wi_0", "dispatch"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group (size > 1)
  std::int64_t bytes = 0;         ///< bytes this rank sends (predicted)
  bool balanced = false;          ///< sizes assume balanced routing (else exact)
  std::int64_t parts = 1;         ///< ranks in the group
  std::int64_t elems = 0;  ///< values of the whole buffer (all-gather output, reduce-scatter input)
  std::int64_t lead = 1;   ///< extents before the gathered dim (> 1: parts * lead row copies)
  std::int64_t elem_bytes = 0;  ///< bytes of one value on the wire
  bool host = false;            ///< a statistic reduced on the host (not in the layer's pool)
  comm::Wire wire = comm::Wire::native;  ///< what the values travel as (PlanBuilder::wire)
  /// 16-bit rows at both ends: an all-to-all moves them as they are (no copies to and from the
  /// wire), an all-gather of rows receives into them, a reduce-scatter of rows sends them.
  bool rows16 = false;
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

/// \brief One stage of a step: kind, profiling region, what it reads and writes, collectives.
struct Stage {
  StageKind kind = StageKind::route;
  bool backward = false;
  std::string region;  ///< Kokkos profiling region the layer opens for it, e.g. moe::dist::route
  std::vector<Ref> reads, writes;
  std::vector<PlannedCollective> collectives;  ///< in the order the stage runs them
  double flops = 0;  ///< floating-point operations of its GEMMs on this rank (balanced routing)
  bool overlapped = false;  ///< its collectives run under its compute (chunked ring)

  /// Whether it writes `r` (or, `write` false, reads it).
  bool lists(Ref r, bool write) const {
    auto has = [r](std::vector<Ref> const& v) {
      return std::find(v.begin(), v.end(), r) != v.end();
    };
    return has(writes) || (!write && has(reads));
  }
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

/// \brief The stages of one step of one rank (see the file comment): make_step_plan().
struct StepPlan {
  ExpertRoute route = ExpertRoute::Local;
  bool dense = false;            ///< dense masked experts (no sort, no grouped GEMM; Layout::dense)
  std::int64_t tokens = 0;       ///< T: tokens of this rank's batch block
  std::int64_t work_tokens = 0;  ///< tokens the experts see (ring: T x ep)
  std::int64_t token_cols = 0;   ///< columns of x / y on this rank: D (EP-TP: D / ep)
  std::int64_t shared_tokens = 0;  ///< tokens the shared expert sees (EP-as-TP: T x ep)
  bool shared_spans() const { return shared_tokens > tokens; }  ///< on the group's tokens
  std::int64_t emb_chunks = 0;  ///< > 0: the ring gathers the tokens in this many D-chunks
  std::string route_text;       ///< how the routed experts are reached, in words (the strategy's)
  std::vector<std::vector<std::string>> token_gathered{{}, {}, {}};  ///< gathered axes per x dim
  std::vector<WeightSteps> weights;  ///< weights that are moved, in gather order
  std::vector<Stage> forward, backward;
  std::vector<BufferDecl> buffers;   ///< every buffer, in the order the stages first make it
  std::vector<RowLimit> row_limits;  ///< row counts handed to one GEMM or kernel launch
  std::vector<std::string> notes;    ///< assumptions of the strategy's byte counts

  /// The ops of weight `name` (moe::Error when the plan has none).
  WeightSteps const& weight(std::string const& name) const {
    for (auto const& w : weights)
      if (w.name == name) return w;
    throw Error(moe::detail::cat("the step plan has no weight named '", name, "'"));
  }
  /// The declaration of buffer `b` (nullptr when the step has no such buffer).
  BufferDecl const* find(Buf b) const {
    for (auto const& d : buffers)
      if (d.id == b) return &d;
    return nullptr;
  }
  BufferDecl* find(Buf b) { return const_cast<BufferDecl*>(std::as_const(*this).find(b)); }
  /// Every axis group the step communicates over, in first-use order (the same on every rank).
  std::vector<std::vector<std::string>> groups() const {
    std::vector<std::vector<std::string>> out;
    auto add = [&out](std::vector<std::string> const& a) {
      if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
    };
    for (auto const* phase : {&forward, &backward})
      for (auto const& st : *phase)
        for (auto const& c : st.collectives) add(c.axes);
    for (auto const& w : weights)
      for (auto const* ops : {&w.to_compute, &w.to_storage})
        for (auto const& op : *ops)
          if (op.kind != WeightOp::Kind::slice) add(op.axes);
    return out;
  }
};

/// \brief Whether a bf16 step keeps a rounded copy of the stored weight `name`, remade for each
/// weight version (stages::gather_weights): of each weight its GEMMs take in bf16 (all but
/// gate_bias, and gate under float32_gate_logits) that they do not round themselves. The routed
/// experts' (wi_0, wi_1, wo) on the sparse path are rounded where `experts_round`: their grouped
/// GEMMs round them as they pack them (nn::ExpertFfn::rounds_weights: oneDNN on the host); the
/// shared expert's, and the routed experts' on the dense masked path, where `dense_round`: their
/// dense GEMMs copy them rounded on every call (nn::dense_gemms_round_weights: oneDNN's bf16
/// kernels). The gate's GEMM reads its weights as they are.
inline bool keeps_rounded_copy(LayerConfig const& cfg, StepPlan const& plan,
                               std::string const& name, bool experts_round, bool dense_round) {
  if (!cfg.bf16() || name == "gate_bias" || (name == "gate" && cfg.float32_gate_logits))
    return false;
  if (name == "gate") return true;
  bool const expert = name == "wi_0" || name == "wi_1" || name == "wo";
  return !(expert && !plan.dense ? experts_round : dense_round);
}

namespace detail {
/// "a,b" ("-" when empty): mesh axes as the plan prints them.
inline std::string axes_text(std::vector<std::string> const& a) { return join(a, ",", "-"); }
/// Product of the extents of `s` before dimension d.
inline std::int64_t lead(std::vector<std::int64_t> const& s, int d) {
  std::int64_t a = 1;
  for (int i = 0; i < d; ++i) a *= s[std::size_t(i)];
  return a;
}
inline std::int64_t product(std::vector<std::int64_t> const& v) { return lead(v, int(v.size())); }
}  // namespace detail

}  // namespace moe::distributed
