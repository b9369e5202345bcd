#pragma once
/// \file
/// Up-front memory estimate and index-limit check of one distributed MoE layer (issue #12;
/// README.md, "memory estimate"): before anything is allocated, a tool can refuse a configuration
/// that cannot fit, or whose tensors have more elements than the kernels index, with a
/// ConfigError naming the quantity and the keys to change. Pure: made from a LayerPlan, whose step
/// plan is the model (estimate_layer_memory says what it counts), so the estimate, the printed
/// plan and the running layer describe one step. Measured within 1 % of the peak of a layer
/// step's Kokkos allocations (tests/unit/test_plan.cpp).

#include <moe/config.hpp>
#include <moe/distributed/host_memory.hpp>
#include <moe/distributed/memory_estimate.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/error.hpp>
#include <moe/moe_config.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {
namespace detail {

using Shape = std::vector<std::int64_t>;

inline constexpr char const* kTokens = "per_device_batch_size, max_target_length";

/// One buffer of the layer: its item, name, shape, bytes per element, scaling keys, and whether
/// its first extent is a GEMM / launch row count.
struct Buffer {
  std::string item, name;
  Shape shape;
  std::int64_t elem_bytes = 4;
  std::string keys;
  bool rows_limited = false;
};

/// Every buffer of one DistributedMoeLayer on the plan's rank, read off its step plan
/// (estimate_layer_memory says what it counts). `extra` collects the scratch-pool maxima and the
/// largest all-reduce temporary separately (they are shared, not summed).
class LayerBuffers {
 public:
  LayerBuffers(LayerPlan const& plan, LayerConfig const& cfg, bool training, bool packed)
      : plan_(plan), training_(training), packed_(packed) {
    s_ = std::int64_t(plan.scalar_bytes);
    bf16_ = cfg.bf16();
    f32_gate_ = cfg.float32_gate_logits;
    weight_keys_ = "num_experts, base_emb_dim, base_moe_mlp_dim";
    if (cfg.shared_mlp_dim() > 0) weight_keys_ += ", shared_experts";
    weights();
    step_buffers();
    collectives();
  }

  std::vector<Buffer> const& buffers() const { return bufs_; }

 private:
  void add(char const* item, std::string name, Shape shape, std::int64_t elem_bytes,
           std::string const& keys, bool rows_limited = false) {
    bufs_.push_back({item, std::move(name), std::move(shape), elem_bytes, keys, rows_limited});
  }

  // ---- weights: stored blocks, the blocks of their gathers and slices, packed copies, gradients
  void weights() {
    for (auto const& w : plan_.layout.weights) {
      // The plan's blocks of the weight: stored on this rank, and the one the step computes with.
      auto const& t = plan_.tensor(w.name);
      Shape const& stored = t.local_shape;
      Shape const& computed = t.compute_shape;
      std::string const wkeys = w.name.rfind("shared_", 0) == 0
                                    ? "shared_experts, base_emb_dim, base_moe_mlp_dim"
                                : w.name.rfind("gate", 0) == 0 ? "num_experts, base_emb_dim"
                                                               : weight_keys_;
      add("weights", w.name, stored, s_, wkeys);
      // dtype=bfloat16: the rounded copy of the stored block the step computes from
      // (stages::gather_weights; not the gate bias, nor the gate with float32_gate_logits).
      if (bf16_ && w.name != "gate_bias" && (w.name != "gate" || !f32_gate_))
        add("weights", "bf16 " + w.name, stored, s_, wkeys);
      auto const& steps = plan_.step.weight(w.name);
      // Forward: every block of the stored -> compute ops (one per gather stage: two with
      // moe_fsdp_use_two_stage_all_gather).
      for (auto const& op : steps.to_compute) {
        bool const slice = op.kind == distributed::WeightOp::Kind::slice;
        add("gathered weights", (slice ? "sliced " : "gathered ") + w.name, op.shape, s_, wkeys);
        if (slice) launch_rows(w.name + " slice", distributed::detail::lead(op.shape, op.dim));
      }
      bool const expert = w.name == "wi_0" || w.name == "wi_1" || w.name == "wo";
      // 4 bytes a value: a bf16 layer on a CPU with bf16 kernels packs 2 (the estimate is high
      // by half the packed bytes there; the plan does not know the CPU it will run on).
      if (packed_ && expert && s_ == 4)
        for (int use = 0; use < (training_ ? 2 : 1); ++use)
          add("packed expert weights", (use ? "packed transposed " : "packed ") + w.name, computed,
              4, wkeys);
      if (!training_) continue;
      // Backward: compute-block gradient -> to_storage -> the caller's stored-block gradient
      // (written straight into it when no op lies between them).
      add("weight gradients", "d_" + w.name, stored, s_, wkeys);
      if (!steps.to_storage.empty())
        add("weight gradients", "d_" + w.name + " (compute block)", computed, s_, wkeys);
      for (auto const& op : steps.to_storage) {
        using K = distributed::WeightOp::Kind;
        if (op.kind == K::all_gather)
          add("weight gradients", "unsliced d_" + w.name, op.shape, s_, wkeys);
        else if (op.kind != K::all_reduce)
          add("weight gradients", "scattered d_" + w.name, op.shape, s_, wkeys);
      }
    }
  }

  // ---- the step's buffers as its stages declare them, and the rows they hand to one kernel
  void step_buffers() {
    for (auto const& d : plan_.step.buffers) {
      if (d.backward && !training_) continue;
      add(distributed::to_string(d.item), distributed::to_string(d.id), d.shape(),
          distributed::elem_bytes(d.elem, s_), distributed::keys_text(d.keys()));
    }
    if (bf16_ && training_) {  // the backward's rounded copy of dy (the caller's x block shape)
      auto const& x = plan_.tensor("x").local_shape;
      add("token rows", "bf16 dy", {x[0] * x[1], x[2]}, s_, kTokens);
    }
    for (auto const& r : plan_.step.row_limits)
      add("", r.what, {r.rows.n}, 0, distributed::keys_text(r.rows.keys), true);
  }

  // ---- the collectives' temporaries: the layer's scratch pool keeps one buffer per kind, grown
  // to its largest use; all-reduce temporaries (and an all-to-all's bf16 copies) are allocated
  // and freed per call. A collective on the bf16 wire (PlannedCollective::wire) converts into
  // 16-bit buffers of its own and reorders while converting: no value-sized temporaries.
  void collectives() {
    for (auto const* phase : {&plan_.step.forward, &plan_.step.backward}) {
      if (phase == &plan_.step.backward && !training_) break;
      for (auto const& st : *phase)
        for (auto const& c : st.collectives) {
          bool const bf16 = c.wire == comm::Wire::bf16;
          // Host statistics are not in the pool; an all-to-all sends from and receives into the
          // step's own buffers (on the bf16 wire: through 16-bit copies of both, per call).
          if (c.host) continue;
          if (c.kind == "all-to-all") {
            if (bf16) a2a_wire_ = std::max(a2a_wire_, checked_mul(c.elems, 2, "all-to-all copies"));
            continue;
          }
          if (c.kind == "all-reduce") {
            all_reduce_temp(c.elems, c.parts);
            continue;
          }
          bool const gather = c.kind == "all-gather";
          if (bf16) {
            // Gathers: this rank's block and the gathered blocks (the chunked ring's overlapped
            // gathers: two slots); reduce-scatters: the packed input and the received parts.
            std::int64_t& send = st.overlapped ? igather_send_ : wire_send_;
            std::int64_t& recv = st.overlapped ? igather_recv_ : (gather ? wire_recv_ : parts16_);
            send = std::max(send, gather ? c.elems / c.parts : c.elems);
            recv = std::max(recv, c.elems);
            if (c.lead > 1)
              launch_rows(c.what + " (row copies)", checked_mul(c.parts, c.lead, "rows of a copy"));
            continue;
          }
          if (!gather) parts_pool_ = std::max(parts_pool_, c.elems);
          if (c.lead > 1) {
            auto& pool = gather ? gather_pool_ : rs_pool_;
            pool = std::max(pool, c.elems);
            launch_rows(c.what + " (row copies)", checked_mul(c.parts, c.lead, "rows of a copy"));
          }
        }
    }
    std::string const keys = std::string(kTokens) + ", base_emb_dim, " + weight_keys_;
    if (gather_pool_ > 0)
      add("communication buffers", "all-gather unpack", {gather_pool_}, s_, keys);
    if (rs_pool_ > 0) add("communication buffers", "reduce-scatter pack", {rs_pool_}, s_, keys);
    // The reduce-scatter's receive buffer is one pool buffer for both wires: its larger use.
    if (parts_pool_ > 0 || parts16_ > 0) {
      bool const wide = parts_pool_ * s_ >= parts16_ * 2;
      add("communication buffers", "reduce-scatter receive", {wide ? parts_pool_ : parts16_},
          wide ? s_ : 2, keys);
    }
    if (wire_send_ > 0) add("communication buffers", "bf16 wire send", {wire_send_}, 2, keys);
    if (wire_recv_ > 0) add("communication buffers", "bf16 wire receive", {wire_recv_}, 2, keys);
    if (igather_send_ > 0)
      add("communication buffers", "bf16 wire send (overlapped gathers)", {2, igather_send_}, 2,
          keys);
    if (igather_recv_ > 0)
      add("communication buffers", "bf16 wire receive (overlapped gathers)", {2, igather_recv_}, 2,
          keys);
    if (a2a_wire_ > 0) add("communication buffers", "bf16 all-to-all copies", {a2a_wire_}, 2, keys);
    if (ar_temp_ > 0) add("communication buffers", "all-reduce temporaries", {ar_temp_}, s_, keys);
  }
  /// comm::all_reduce of n elements over P ranks: mine [ceil(n/P)] and, unless P divides n, a
  /// padded copy [P*ceil(n/P)]; freed on return (the largest counts).
  void all_reduce_temp(std::int64_t n, std::int64_t P) {
    if (P <= 1 || n == 0) return;
    std::int64_t const c = (n + P - 1) / P;
    std::int64_t const t = c + (c * P == n ? 0 : checked_mul(c, P, "all-reduce buffer"));
    ar_temp_ = std::max(ar_temp_, t);
  }
  void launch_rows(std::string const& what, std::int64_t rows) {
    add("", what, {rows}, 0, weight_keys_, true);
  }

  LayerPlan const& plan_;
  bool training_, packed_, bf16_ = false, f32_gate_ = false;
  std::int64_t s_ = 4;
  std::int64_t gather_pool_ = 0, rs_pool_ = 0, parts_pool_ = 0, ar_temp_ = 0;  // values
  // bf16 wire buffers, in 16-bit values
  std::int64_t wire_send_ = 0, wire_recv_ = 0, parts16_ = 0, igather_send_ = 0, igather_recv_ = 0,
               a2a_wire_ = 0;
  std::string weight_keys_;
  std::vector<Buffer> bufs_;
};

}  // namespace detail

/// \brief Whether oneDNN keeps packed copies of the expert weights by default: float values and
/// moe built with oneDNN (host GEMMs). Pass false for device spaces.
inline bool default_packed_weights(LayerPlan const& plan) {
  return MOE_HAS_ONEDNN != 0 && plan.scalar_bytes == 4;
}

/// \brief Bytes one DistributedMoeLayer needs on the plan's rank, read off its step plan: the
/// weights' stored blocks and the blocks of their stored -> compute ops, oneDNN's packed copies of
/// the expert weights, in training the gradients, every buffer of StepPlan::buffers (backward ones
/// only in training), and the collectives' temporaries by their largest use. Not counted: the
/// caller's x, y, dy, dx; MPI's and the runtime's own memory; device staging buffers.
/// \param training forward + backward (gradients, backward buffers); false: forward only
/// \param packed_weights count oneDNN's packed copies of the expert weights (float, host)
/// \throws ConfigError naming the quantity when an element or byte count does not fit int64.
inline MemoryEstimate estimate_layer_memory(LayerPlan const& plan, LayerConfig const& cfg,
                                            bool training, bool packed_weights) {
  detail::LayerBuffers const lb(plan, cfg, training, packed_weights);
  MemoryEstimate est;
  for (char const* item :
       {"weights", "gathered weights", "packed expert weights", "weight gradients", "routing",
        "token rows", "expert hidden states", "shared expert", "communication buffers"}) {
    std::int64_t bytes = 0;
    std::string keys;
    for (auto const& b : lb.buffers()) {
      if (b.item != item) continue;
      std::int64_t const n = checked_product(b.shape, "the element count of " + b.name);
      bytes = checked_add(bytes, checked_mul(n, b.elem_bytes, "the bytes of " + b.name),
                          std::string("the bytes of ") + item);
      keys = MemoryEstimate::merge_keys(keys, b.keys);
    }
    if (bytes > 0) est.add(item, bytes, keys);
  }
  return est;
}

/// \brief estimate_layer_memory with default_packed_weights(plan).
inline MemoryEstimate estimate_layer_memory(LayerPlan const& plan, LayerConfig const& cfg,
                                            bool training) {
  return estimate_layer_memory(plan, cfg, training, default_packed_weights(plan));
}

/// \brief Refuses (ConfigError naming the tensor, its size, the limit and the keys to reduce) a
/// plan whose tensors on this rank exceed the kernels' index limits: more rows than a 32-bit BLAS
/// call or a kernel launch takes, more elements than one flat kernel of the execution space
/// indexes, or counts that do not fit int64. MPI counts are no limit (moe/comm splits larger
/// messages). Pure; the same on every rank of a symmetric layout.
inline void check_index_limits(LayerPlan const& plan,
                               IndexLimits const& limits = IndexLimits::host()) {
  detail::LayerBuffers const lb(plan, plan.config, true, false);
  using moe::detail::shape_text;
  for (auto const& b : lb.buffers()) {
    std::int64_t const n = checked_product(b.shape, "the element count of " + b.name);
    if (b.rows_limited) {
      if (b.shape[0] > limits.max_rows)
        throw ConfigError(moe::detail::cat(
            b.name, ": ", b.shape[0], " rows on this rank exceed the ", limits.max_rows,
            " rows that one 32-bit BLAS call or kernel launch takes; reduce ", b.keys,
            " (or spread the batch over more ranks)"));
      continue;
    }
    if (n > limits.max_elements)
      throw ConfigError(moe::detail::cat(b.name, " ", shape_text(b.shape), " holds ", n,
                                         " elements on this rank, more than the ",
                                         limits.max_elements, " that a kernel indexed by ",
                                         limits.element_index, " reaches; reduce ", b.keys));
    checked_mul(n, std::max<std::int64_t>(b.elem_bytes, 8), "the bytes of " + b.name);
  }
}

}  // namespace moe::distributed

namespace moe {
using distributed::check_index_limits, distributed::default_packed_weights,
    distributed::estimate_layer_memory;
}  // namespace moe
