#pragma once
/// \file
/// Up-front memory estimate and index-limit check of one distributed MoE layer, read off a
/// LayerPlan, so that a tool can refuse a configuration before allocating (README.md).

#include <moe/comm/segments.hpp>
#include <moe/config.hpp>
#include <moe/distributed/host_memory.hpp>
#include <moe/distributed/memory_estimate.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/error.hpp>
#include <moe/moe_config.hpp>
#if MOE_HAS_ONEDNN
#include <moe/detail/onednn.hpp>
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {
namespace detail {

using Shape = std::vector<std::int64_t>;

inline constexpr char const* kTokens = "per_device_batch_size, max_target_length";

/// One buffer of the layer; `rows_limited`: its first extent is a GEMM / launch row count.
struct Buffer {
  std::string item, name;
  Shape shape;
  std::int64_t elem_bytes = 4;
  std::string keys;
  bool rows_limited = false;
};

/// Every buffer of one DistributedMoeLayer on the plan's rank (estimate_layer_memory says which).
class LayerBuffers {
 public:
  LayerBuffers(LayerPlan const& plan, LayerConfig const& cfg, bool training, bool packed)
      : plan_(plan), cfg_(cfg), training_(training), packed_(packed) {
    if (cfg.shared_mlp_dim() > 0) weight_keys_ += ", shared_experts";
    weights();
    step_buffers();
    collectives();
    gemm_copies(plan.layout.dense);
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
      auto const& t = plan_.tensor(w.name);
      Shape const& stored = t.local_shape;
      Shape const& computed = t.compute_shape;
      std::string const wkeys = w.name.rfind("shared_", 0) == 0
                                    ? "shared_experts, base_emb_dim, base_moe_mlp_dim"
                                : w.name.rfind("gate", 0) == 0 ? "num_experts, base_emb_dim"
                                                               : weight_keys_;
      add("weights", w.name, stored, s_, wkeys);
      // dtype=bfloat16: the rounded copy of the stored block (stages::gather_weights), none of
      // the weights that oneDNN's packing or its bf16 kernels round.
      bool const onednn = packed_ && s_ == 4;
      if (distributed::keeps_rounded_copy(cfg_, plan_.step, w.name, onednn,
                                          onednn && bf16_kernels_))
        add("bf16 weight copies", "bf16 " + w.name, stored, s_, wkeys);
      auto const& steps = plan_.step.weight(w.name);
      for (auto const& op : steps.to_compute) {
        bool const slice = op.kind == distributed::WeightOp::Kind::slice;
        add("gathered weights", (slice ? "sliced " : "gathered ") + w.name, op.shape, s_, wkeys);
        if (slice) launch_rows(w.name + " slice", distributed::detail::lead(op.shape, op.dim));
      }
      if (onednn && (w.name == "wi_0" || w.name == "wi_1" || w.name == "wo"))
        for (int use = 0; use < (training_ ? 2 : 1); ++use)
          add("packed expert weights", (use ? "packed transposed " : "packed ") + w.name, computed,
              pack_bytes(), wkeys);
      if (!training_) continue;
      // Backward: compute-block gradient (unless written straight into the caller's) -> ops.
      add("weight gradients", "d_" + w.name, stored, s_, wkeys);
      if (!steps.to_storage.empty())
        add("weight gradients", "d_" + w.name + " (compute block)", computed, s_, wkeys);
      using K = distributed::WeightOp::Kind;
      for (auto const& op : steps.to_storage)
        if (op.kind != K::all_reduce)
          add("weight gradients",
              (op.kind == K::all_gather ? "unsliced d_" : "scattered d_") + w.name, op.shape, s_,
              wkeys);
    }
  }

  // ---- the step's buffers as its stages declare them, and the rows they hand to one kernel
  void step_buffers() {
    for (auto const& d : plan_.step.buffers) {
      // The caller's tensors (y for y_cols without tensor axes) are not the layer's memory.
      if ((d.backward && !training_) || d.caller != distributed::Buf::count_) continue;
      add(distributed::to_string(d.item), distributed::to_string(d.id), d.shape(),
          distributed::elem_bytes(d.elem, s_), distributed::keys_text(d.keys()));
    }
    for (auto const& r : plan_.step.row_limits)
      add("", r.what, {r.rows.n}, 0, distributed::keys_text(r.rows.keys), true);
  }

  // ---- the collectives' temporaries at their largest use (the bf16 wire: 16-bit buffers)
  void collectives() {
    for (auto const* phase : {&plan_.step.forward, &plan_.step.backward})
      for (auto const& st : *phase)
        for (auto const& c : st.collectives) {
          bool const bf16 = c.wire == comm::Wire::bf16, gather = c.kind == "all-gather";
          // Host statistics are not in the pool; an all-to-all uses the step's buffers.
          if (c.host || (st.backward && !training_)) continue;
          if (c.kind == "all-to-all" && bf16 && !c.rows16)
            a2a_wire_ = std::max(a2a_wire_, checked_mul(c.elems, 2, "all-to-all copies"));
          // comm::all_reduce's: a segment's receive buffer and the padded last segment.
          if (c.kind == "all-reduce")
            ar_temp_ = std::max(ar_temp_,
                                comm::detail::all_reduce_segments(c.elems, int(c.parts), s_).temp);
          if (c.kind == "all-to-all" || c.kind == "all-reduce") continue;
          // Gathers and reduce-scatters along a dimension: [A, P, L] moved a tile at a time
          // (comm::detail::tiles) through tile buffers, but for rows along dimension 0 in the
          // wire's type (native, or rows16), which go as they are: a gather with no buffer (in
          // place, for rows16), a reduce-scatter into a receive buffer of the whole, or of a
          // tile where it takes more than one (where MPI reads the memory: staged device memory
          // is packed into a tile buffer too, which the estimate leaves out).
          std::int64_t const A = c.lead, L = c.elems / std::max<std::int64_t>(1, c.parts * A);
          auto const t = comm::detail::tiles(A, L, int(c.parts), bf16 ? 2 : s_);
          std::int64_t const piece = t.piece(), tile = checked_mul(piece, c.parts, "a tile");
          bool const as_is = A == 1 && (!bf16 || c.rows16);
          auto grow = [](std::int64_t& v, std::int64_t n) { v = std::max(v, n); };
          if (st.overlapped) {
            // Overlapped gathers (along the rows, bf16): own and gathered blocks, two slots.
            if (bf16 && !c.rows16) {
              grow(igather_send_, c.elems / c.parts);
              grow(igather_recv_, c.elems);
            }
          } else if (gather) {
            if (!as_is) {
              if (bf16) grow(wire_send_, piece);
              grow(bf16 ? wire_recv_ : gather_pool_, tile);
            }
          } else {
            grow(bf16 ? parts16_ : parts_pool_, as_is && t.whole(A, L) ? c.elems : tile);
            if (!as_is) grow(bf16 ? wire_send_ : rs_pool_, tile);
          }
          if (c.lead > 1)
            launch_rows(c.what + " (row copies)", checked_mul(c.parts, c.lead, "rows of a copy"));
        }
    std::string const keys = std::string(kTokens) + ", base_emb_dim, " + weight_keys_;
    auto comm = [&](char const* name, Shape shape, std::int64_t elem_bytes) {
      if (shape.back() > 0) add("communication buffers", name, std::move(shape), elem_bytes, keys);
    };
    comm("all-gather unpack", {gather_pool_}, s_);
    comm("reduce-scatter pack", {rs_pool_}, s_);
    // The reduce-scatter's receive buffer is one pool buffer for both wires: its larger use.
    bool const wide = parts_pool_ * s_ >= parts16_ * 2;
    comm("reduce-scatter receive", {wide ? parts_pool_ : parts16_}, wide ? s_ : 2);
    comm("bf16 wire send", {wire_send_}, 2);
    comm("bf16 wire receive", {wire_recv_}, 2);
    comm("bf16 wire send (overlapped gathers)", {2, igather_send_}, 2);
    comm("bf16 wire receive (overlapped gathers)", {2, igather_recv_}, 2);
    comm("bf16 all-to-all copies", {a2a_wire_}, 2);
    comm("all-reduce temporaries", {ar_temp_}, s_);
  }
  // ---- dtype=bfloat16 with oneDNN (float, host): the GEMMs' operand copies per this CPU's tier,
  // buffers of the calling thread kept from call to call (oneDNN-side, not Kokkos allocations):
  // bf16_gemm's two buffers at their largest use; or below the bf16 tiers one float buffer, at
  // its largest use: the routed weight gradients' copies of their 16-bit operands (a hidden
  // state and, where the routed rows are 16-bit, a block of them), or the copy of one 16-bit
  // hidden state for the shared expert's and the dense path's GEMMs.
  void gemm_copies(bool dense) {
    if (!bf16_ || !packed_ || s_ != 4) return;
    auto const* h = plan_.step.find(distributed::Buf::h0);
    auto const* hs = plan_.step.find(distributed::Buf::shared_h0);
    auto const& w = plan_.tensor("wi_0").compute_shape;  // [L, D, F]
    std::string const keys = std::string(kTokens) + ", " + weight_keys_;
#if MOE_HAS_ONEDNN
    if (!bf16_kernels_) {
      // The routed GEMMs copy in training only (each weight gradient's tgmm widens its two 16-bit
      // operands: a hidden state [rows, F] and, where the routed rows are 16-bit, a row block
      // [rows, D]), the dense path's GEMMs a hidden state in its forward.
      using distributed::Elem;
      auto size = [](auto const* d) { return d->dims[0].n * d->dims[1].n; };
      std::int64_t routed = 0, shared = 0;
      if (h && h->elem == Elem::bf16 && (training_ || dense)) {
        routed = size(h);
        auto const* xl = plan_.step.find(distributed::Buf::x_local);
        if (!dense && xl && xl->elem == Elem::bf16) routed += size(xl);
      }
      if (hs && hs->elem == Elem::bf16) shared = size(hs);
      if (routed > 0 || shared > 0)
        add("GEMM operand copies",
            routed >= shared ? "float copies of the routed GEMMs' 16-bit operands"
                             : "float copy of a hidden state",
            {std::max(routed, shared)}, 4, keys);
      return;
    }
#endif
    std::int64_t a = 0, b = 0;  // values in the copies of op(A) [M, Kp] and op(B) [Kp, N up to 64]
    auto gemm = [&](std::int64_t M, std::int64_t K, std::int64_t N, std::int64_t pad = 1) {
      std::int64_t const Kp = (K + pad - 1) / pad * pad;
      a = std::max(a, checked_mul(M, Kp, "a bf16 GEMM copy"));
      b = std::max(b, checked_mul(Kp, (N + 63) / 64 * 64, "a bf16 GEMM copy"));
    };
    // A gated MLP on T rows, D -> H -> D: x.w0, a.wo, and in the backward a^T.d_out, x^T.d_h.
    auto mlp = [&](std::int64_t T, std::int64_t D, std::int64_t H) {
      gemm(T, D, H);
      gemm(T, H, D);
      if (!training_) return;
      gemm(H, T, D);
      gemm(D, T, H);
    };
    if (h) {
      std::int64_t const rows = h->dims[0].n;
      if (dense)
        mlp(rows, w[1], w[2]);
      else if (training_ && w[0] > 0)
        for (int t = 0; t < 2; ++t)  // x^T d_h ([D, F]) and act^T d_y ([F, D])
          gemm(w[1 + t], (rows + w[0] - 1) / w[0], w[2 - t], 32);
    }
    if (hs) {
      auto const& s = plan_.tensor("shared_wi_0").compute_shape;  // [D, H]
      mlp(hs->dims[0].n, s[0], s[1]);
    }
    if (a > 0) add("GEMM operand copies", "bf16 copy of op(A)", {a}, 2, keys);
    if (b > 0) add("GEMM operand copies", "bf16 copy of op(B)", {b}, 2, keys);
  }

  /// Bytes of one packed weight value: 2 where the layer runs oneDNN's bf16 kernels, else 4.
  std::int64_t pack_bytes() const { return bf16_kernels_ ? 2 : 4; }
  /// Whether a bf16 layer runs oneDNN's bf16 kernels on the CPU making the estimate (its tier,
  /// ONEDNN_MAX_CPU_ISA and MOE_BF16_KERNELS included): the width of its packs and operand copies.
  static bool runs_bf16_kernels([[maybe_unused]] bool bf16) {
#if MOE_HAS_ONEDNN
    return bf16 && moe::detail::onednn::bf16_kernels();
#else
    return false;
#endif
  }

  void launch_rows(std::string const& what, std::int64_t rows) {
    add("", what, {rows}, 0, weight_keys_, true);
  }

  LayerPlan const& plan_;
  LayerConfig const& cfg_;
  bool training_, packed_, bf16_ = cfg_.bf16();
  bool bf16_kernels_ = runs_bf16_kernels(bf16_);
  std::int64_t s_ = std::int64_t(plan_.scalar_bytes);
  std::int64_t gather_pool_ = 0, rs_pool_ = 0, parts_pool_ = 0, ar_temp_ = 0;  // values
  // bf16 wire buffers, in 16-bit values
  std::int64_t wire_send_ = 0, wire_recv_ = 0, parts16_ = 0, igather_send_ = 0, igather_recv_ = 0,
               a2a_wire_ = 0;
  std::string weight_keys_ = "num_experts, base_emb_dim, base_moe_mlp_dim";
  std::vector<Buffer> bufs_;
};

}  // namespace detail

/// \brief Whether oneDNN keeps packed copies of the expert weights by default (float, host GEMMs).
inline bool default_packed_weights(LayerPlan const& plan) {
  return MOE_HAS_ONEDNN != 0 && plan.scalar_bytes == 4;
}

/// \brief Bytes one DistributedMoeLayer needs on the plan's rank: weight blocks, gradients, step
/// buffers, collective temporaries (not the caller's x, y, dy, dx, nor MPI's or the runtime's).
/// \param training forward + backward (gradients, backward buffers); false: forward only
/// \param packed_weights the GEMMs are oneDNN's (float, host): count their packed copies of the
/// expert weights, and (bf16) no rounded copy of the weights that oneDNN rounds (the packing, and
/// on a CPU with bf16 kernels the dense GEMMs: distributed::keeps_rounded_copy)
/// \throws ConfigError naming the quantity when an element or byte count does not fit int64.
inline MemoryEstimate estimate_layer_memory(LayerPlan const& plan, LayerConfig const& cfg,
                                            bool training, bool packed_weights) {
  detail::LayerBuffers const lb(plan, cfg, training, packed_weights);
  MemoryEstimate est;
  for (char const* item :
       {"weights", "bf16 weight copies", "gathered weights", "packed expert weights",
        "weight gradients", "routing", "token rows", "expert hidden states", "shared expert",
        "communication buffers", "GEMM operand copies"}) {
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

/// \brief ConfigError (naming tensor, size, limit, keys) where this rank exceeds `limits`.
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
