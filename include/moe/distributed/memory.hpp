#pragma once
/// \file
/// Up-front memory estimate and index-limit check of one distributed MoE layer (issue #12): before
/// anything is allocated, a tool can say how many bytes a rank will need and refuse a configuration
/// that cannot fit, or whose tensors have more elements than the kernels can index, with a
/// ConfigError that names the quantity and the keys to change -- instead of being ended by the OOM
/// killer or computing on wrapped indices.
///
/// Pure, like moe::make_plan (no Kokkos, no collective): the estimate is made from a LayerPlan.
/// The report type and the checked arithmetic are in memory_estimate.hpp; the host-memory query
/// and the fit check (available_memory_bytes, require_fits), included here too, in
/// host_memory.hpp: a tool compares the estimate with the host's memory only when the layer's
/// memory space is host memory.
///
/// **The model** (estimate_layer_memory). Per rank, with s = bytes per value (4 or 8),
/// T = this rank's tokens (LayerPlan::local_tokens), D = base_emb_dim, K = num_experts_per_tok,
/// E = num_experts, tp = the tensor-parallel degree, Dc = D / tp, F = the expert hidden size of
/// the compute block (base_moe_mlp_dim / tp), L = local experts, ep = the expert-parallel degree:
///  * tokens the experts see: Tw = T * ep on the ring of experts, else T (the router routes Tw
///    rows); the shared expert sees Tg = T * ep (EP-as-TP) unless the batch is replicated;
///  * routed rows, assuming balanced routing as the plan's byte counts do: the ragged all-to-all
///    path sorts n_o = T*K own slots (per-sequence capacity: (T/S) * min(S*K, E*C)) and receives
///    n = n_o of them (capped by int(T*K*ragged_buffer_factor) when that is > 0); the gathered
///    paths (ring, replicated, local) run n = Tw*K*L/E rows on their local experts.
/// Items (every buffer the layer keeps between steps -- DistributedMoeLayer keeps them all --
/// plus the largest temporary of its collectives):
///  * weights: the stored blocks (LayerPlan tensor local_shape), s bytes per element;
///  * gathered weights: every intermediate block of the FSDP all-gathers and EP-as-TP slices
///    (one per gather stage: two stages with moe_fsdp_use_two_stage_all_gather);
///  * packed expert weights (float with oneDNN on the host): oneDNN's reordered copies of the
///    compute blocks of wi_0, wi_1, wo -- once for the forward, once more transposed for the
///    backward;
///  * weight gradients (training): the stored-block gradients, the compute-block gradients (for
///    weights whose gradient needs an op to reach its stored block) and the intermediates of their
///    reduce-scatters / un-slicing;
///  * routing: logits [Tw,E] (+ scores and biased [Tw,E] when a score function / bias is on),
///    expert ids, top values, weights and kept masks [Tw,K], the sort's perm and inverse (int64
///    per slot) and cursors, the local permutation (perm, inverse, expert id: 20 bytes per
///    received row), the load-balance statistics; training adds d_top [T,K], d_biased and d_logits
///    [T,E], d_weights [T,K];
///  * token rows: the layer's copy of x [T,D], sorted / received / permuted rows [n_o|n, D] and
///    their column blocks [*, Dc] forward and backward (or, gathered: [Tw,D] work rows);
///  * expert hidden states: h0, h1, act [n,F] forward, d_act, d_h1 [n,F] backward (dense path:
///    the same on [Tw,F] plus [Tw,D] and [Tw,L]);
///  * shared expert: its gathered input / output rows [Tg,D], hidden states [Tg,Fs/(tp*ep)] x3
///    (+1 and two [Tg,D] backward);
///  * communication buffers: the layer's scratch pool keeps one buffer per kind of collective,
///    grown to its largest use (the all-gather unpack along a non-leading dimension, the
///    reduce-scatter pack, the reduce-scatter receive buffer), plus the largest all-reduce
///    temporary (allocated and freed per call).
/// Not included: the caller's x, y, dy, dx; MPI's and the runtime's own memory (already resident
/// when a tool checks, so already outside MemAvailable); device staging buffers. Measured: within
/// 1 % of the peak of a layer step's Kokkos allocations (tests/unit/test_plan.cpp) and, with the
/// process's libraries added, of train_moe's peak resident set (the README).
///
/// **Index limits** (check_index_limits). Every extent is a 64-bit integer in moe, and messages
/// over INT_MAX elements are split by moe/comm (count_limit(): point-to-point pieces), so MPI's
/// int counts are no limit. What is: (1) rows handed to a dense GEMM (router, shared expert, the
/// Vendor grouped GEMM's per-group rows) go to a BLAS with 32-bit int dimensions, and the reshard
/// row copies launch one team per row (an int league): at most INT_MAX rows; (2) the flat
/// element-wise kernels (activations, check_finite, add_into, ...) use Kokkos::RangePolicy's
/// default index type, ExecSpace::size_type -- size_t on host spaces, but `unsigned int` on CUDA
/// and HIP, where a kernel over more than 2^32-1 elements would wrap; (3) every element and byte
/// count must fit int64 (checked multiplication throws a ConfigError naming the quantity).

#include <moe/config.hpp>
#include <moe/detail/row_caps.hpp>
#include <moe/distributed/host_memory.hpp>
#include <moe/distributed/memory_estimate.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/error.hpp>
#include <moe/moe_config.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace moe {
namespace memory_detail {

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

/// Every buffer of one DistributedMoeLayer on the plan's rank, following the layer's code path by
/// path (see the file comment). `extra` collects the scratch-pool maxima and the largest
/// all-reduce temporary separately (they are shared, not summed).
class LayerBuffers {
 public:
  LayerBuffers(LayerPlan const& plan, LayerConfig const& cfg, bool training, bool packed)
      : plan_(plan), lay_(plan.layout), cfg_(cfg), training_(training), packed_(packed) {
    s_ = std::int64_t(plan.scalar_bytes);
    T_ = plan.local_tokens;
    S_ = lay_.seq_len;
    D_ = cfg.base_emb_dim;
    K_ = cfg.num_experts_per_tok;
    E_ = cfg.num_experts;
    ep_ = lay_.ep();
    tp_ = lay_.tp();
    Dc_ = D_ / std::max<std::int64_t>(1, tp_);
    L_ = lay_.local_experts;
    Tw_ = lay_.route == ExpertRoute::Ring ? checked_mul(T_, ep_, "tokens on the ring") : T_;
    chunks_ = plan.step.emb_chunks;
    // Replicated batch and EP-TP: every expert rank already holds the group's tokens.
    Tg_ = lay_.route == ExpertRoute::Replicated || lay_.route == ExpertRoute::EpTp
              ? T_
              : checked_mul(T_, ep_, "shared-expert tokens");
    F_ = plan.tensor("wi_0").compute_shape[2];
    weight_keys_ = "num_experts, base_emb_dim, base_moe_mlp_dim";
    if (cfg.shared_mlp_dim() > 0) weight_keys_ += ", shared_experts";
    weights();
    routing_and_rows();
    if (cfg.shared_mlp_dim() > 0) shared();
    comm();
  }

  std::vector<Buffer> const& buffers() const { return bufs_; }

 private:
  void add(char const* item, std::string name, Shape shape, std::int64_t elem_bytes,
           std::string const& keys, bool rows_limited = false) {
    bufs_.push_back({item, std::move(name), std::move(shape), elem_bytes, keys, rows_limited});
  }
  /// add() for several buffers {name, shape} of one item, element size and keys.
  void add_each(char const* item, std::int64_t elem_bytes, std::string const& keys,
                std::initializer_list<std::pair<char const*, Shape>> bufs) {
    for (auto const& b : bufs) add(item, b.first, b.second, elem_bytes, keys);
  }
  /// Checked element count of a shape.
  static std::int64_t numel(Shape const& s, std::string const& what) {
    return checked_product(s, "the element count of " + what);
  }
  /// Scratch-pool maxima (one buffer per key, grown to its largest use).
  void pool_max(std::int64_t& slot, std::int64_t elems) { slot = std::max(slot, elems); }

  // ---- weights, their gathered / packed copies and gradients
  void weights() {
    bool const two_stage = plan_.parallel.moe_fsdp_use_two_stage_all_gather;
    for (auto const& w : lay_.weights) {
      Shape stored, computed;
      for (auto const& d : w.dims) stored.push_back(d.stored), computed.push_back(d.computed);
      std::string const wkeys = w.name.rfind("shared_", 0) == 0
                                    ? "shared_experts, base_emb_dim, base_moe_mlp_dim"
                                : w.name.rfind("gate", 0) == 0 ? "num_experts, base_emb_dim"
                                                               : weight_keys_;
      add("weights", w.name, stored, s_, wkeys);
      // Forward: to_compute (gate_bias is used as stored).
      if (w.name != "gate_bias") {
        Shape cur = stored;
        for (std::size_t d = 0; d < w.dims.size(); ++d) {
          auto const& g = w.dims[d].gather;
          if (g.empty()) continue;
          std::vector<std::vector<std::string>> stages{g};
          if (two_stage && g.size() > 1) {
            stages.clear();
            for (auto it = g.rbegin(); it != g.rend(); ++it) stages.push_back({*it});
          }
          for (auto const& st : stages) {
            std::int64_t const P = lay_.parts(st);
            std::int64_t const A = lead(cur, d);
            cur[d] = checked_mul(cur[d], P, "gathered extent of " + w.name);
            add("gathered weights", "gathered " + w.name, cur, s_, wkeys);
            if (P > 1 && A != 1) {
              pool_max(gather_pool_, numel(cur, "gathered " + w.name));
              launch_rows(w.name + " all-gather unpack", checked_mul(P, A, "rows of a copy"));
            }
          }
        }
        for (std::size_t d = 0; d < w.dims.size(); ++d) {
          auto const& sl = w.dims[d].slice;
          if (sl.empty()) continue;
          cur[d] /= lay_.parts(sl);
          add("gathered weights", "sliced " + w.name, cur, s_, wkeys);
          launch_rows(w.name + " slice", lead(cur, d));
        }
      }
      bool const expert = w.name == "wi_0" || w.name == "wi_1" || w.name == "wo";
      if (packed_ && expert && s_ == 4)
        for (int use = 0; use < (training_ ? 2 : 1); ++use)
          add("packed expert weights", (use ? "packed transposed " : "packed ") + w.name, computed,
              4, wkeys);
      if (!training_) continue;
      // Backward: compute-block gradient -> to_storage -> the caller's stored-block gradient.
      add("weight gradients", "d_" + w.name, stored, s_, wkeys);
      // (Written straight into the stored-block gradient when no op lies between them.)
      if (!plan_.step.weight(w.name).to_storage.empty())
        add("weight gradients", "d_" + w.name + " (compute block)", computed, s_, wkeys);
      std::vector<std::string> gathered;
      for (auto const& d : w.dims)
        gathered.insert(gathered.end(), d.gather.begin(), d.gather.end());
      all_reduce_temp(numel(computed, "d_" + w.name),
                      lay_.parts(distributed::layout_detail::minus(w.reduce, gathered)));
      Shape cur = computed;
      for (std::size_t d = 0; d < w.dims.size(); ++d) {
        auto const& sl = w.dims[d].slice;
        if (sl.empty()) continue;
        std::int64_t const P = lay_.parts(sl), A = lead(cur, d);
        cur[d] = checked_mul(cur[d], P, "unsliced extent of d_" + w.name);
        add("weight gradients", "unsliced d_" + w.name, cur, s_, wkeys);
        if (P > 1 && A != 1) pool_max(gather_pool_, numel(cur, "unsliced d_" + w.name));
      }
      for (std::size_t d = 0; d < w.dims.size(); ++d) {
        auto const& g = w.dims[d].gather;
        if (g.empty()) continue;
        std::int64_t const P = lay_.parts(g), A = lead(cur, d);
        Shape next = cur;
        next[d] /= P;
        add("weight gradients", "scattered d_" + w.name, next, s_, wkeys);
        auto const summed =
            distributed::layout_detail::minus(g, distributed::layout_detail::minus(g, w.reduce));
        std::int64_t const n = numel(cur, "d_" + w.name);
        if (summed.size() == g.size()) {
          if (P > 1) pool_max(parts_pool_, n);
          if (P > 1 && A != 1) pool_max(rs_pool_, n);
        } else {
          all_reduce_temp(n, lay_.parts(summed));
        }
        cur = next;
      }
    }
  }

  // ---- routing, token rows, expert hidden states
  void routing_and_rows() {
    std::int64_t const i4 = 4, i8 = 8;
    bool const a2a = lay_.route == ExpertRoute::RaggedA2A;
    std::string const tk = kTokens, tke = tk + ", num_experts", tkk = tk + ", num_experts_per_tok",
                      tkd = tk + ", num_experts_per_tok, base_emb_dim",
                      tkf = tk + ", num_experts_per_tok, base_moe_mlp_dim";
    std::int64_t const R = Tw_;  // rows the router routes
    rows_check("tokens routed on this rank", R);
    add("routing", "logits", {R, E_}, s_, tke);
    if (chunks_ > 0) add("routing", "logits_own", {T_, E_}, s_, tke);  // gathered into logits
    if (cfg_.routed_score_func != ScoreFunc::None) add("routing", "scores", {R, E_}, s_, tke);
    if (cfg_.routed_bias) add("routing", "biased scores", {R, E_}, s_, tke);
    add("routing", "expert_ids", {R, K_}, i4, tkk);
    add("routing", "kept", {R, K_}, i4, tkk);
    add("routing", "top_values", {R, K_}, s_, tkk);
    add("routing", "weights", {R, K_}, s_, tkk);
    std::int64_t const seqs = S_ > 0 ? T_ / S_ : 0;
    if (cfg_.load_balance_loss_weight > 0) {
      add("routing", "seq_counts", {seqs, E_}, i8, tke);
      add("routing", "seq_probs", {seqs, E_}, s_, tke);
      add("routing", "lb softmax", {2, T_}, 8, tk);
    }
    if (cfg_.capacity_factor > 0) add("routing", "capacity cursors", {2, seqs, E_}, i8, tke);
    if (training_) {
      add("routing", "d_top", {T_, K_}, s_, tkk);
      add("routing", "d_biased", {T_, E_}, s_, tke);
      add("routing", "d_logits", {T_, E_}, s_, tke);
      add("routing", "d_weights", {T_, K_}, s_, tkk);
    }
    // Slots: own (a2a) or the working tokens' (gathered paths), capacity applied per sequence.
    std::int64_t const slots_tokens = a2a ? T_ : Tw_;
    std::int64_t slots = checked_mul(slots_tokens, K_, "routed slots");
    std::int64_t kept = slots;
    if (cfg_.capacity_factor > 0 && S_ > 0)
      kept = checked_mul(slots_tokens / S_,
                         std::min<std::int64_t>(checked_mul(S_, K_, "slots per sequence"),
                                                checked_mul(E_, cfg_.capacity(S_), "capacity")),
                         "kept slots");

    if (lay_.dense) {  // (never on the all-to-all, which sorts the rows it delivers)
      dense_rows();
      return;
    }
    // Counting sort over the slots (perm, inverse: int64 per slot; cursors per chunk and key).
    int const keys = a2a ? int(E_) : int(L_);
    std::int64_t const chunk = std::max<std::int64_t>(2048, 8 * std::int64_t(keys));
    add("routing", "sort perm", {slots}, i8, tkk);
    add("routing", "sort inverse", {slots}, i8, tkk);
    add("routing", "sort cursors", {(slots + chunk - 1) / chunk + 1, keys}, i8, tkk);
    if (a2a) {
      std::int64_t const n_o = kept;
      std::int64_t n = n_o;
      if (plan_.parallel.ragged_buffer_factor > 0)
        n = moe::detail::scaled_rows(checked_mul(T_, K_, "routed slots"),
                                     plan_.parallel.ragged_buffer_factor, n);
      rows_check("sorted rows", n_o, true);
      rows_check("received rows", checked_mul(n, tp_, "received rows x tensor"), true);
      add("routing", "local perm", {n}, i8, tkk);
      add("routing", "local inverse", {n}, i8, tkk);
      add("routing", "local expert ids", {n}, i4, tkk);
      add_each("token rows", s_, tkd,
               {{"x", {T_, D_}},
                {"x_sorted", {n_o, D_}},
                {"x_received", {n, D_}},
                {"x_local", {n, D_}},
                {"y_local", {n, D_}},
                {"y_local_cols", {n, Dc_}},
                {"y_received_cols", {n, Dc_}},
                {"y_sorted_cols", {n_o, Dc_}},
                {"y_cols", {T_, Dc_}}});
      if (training_)
        add_each("token rows", s_, tkd,
                 {{"dy_cols", {T_, Dc_}},
                  {"dy_sorted_cols", {n_o, Dc_}},
                  {"dy_received_cols", {n, Dc_}},
                  {"dy_local_cols", {n, Dc_}},
                  {"dy_local", {n, D_}}});
      hidden(n, tkf);
      if (tp_ > 1) {
        std::int64_t const nd = numel({n, D_}, "local rows");
        pool_max(rs_pool_, nd);
        pool_max(parts_pool_, nd);
        if (training_) pool_max(gather_pool_, nd);
        pool_max(gather_pool_, numel({T_, D_}, "y"));
        if (training_) all_reduce_temp(numel({T_, K_}, "d_weights"), tp_);
      }
      return;
    }
    // Gathered paths: the local experts' share of the working tokens' slots (balanced routing).
    std::int64_t const n = E_ > 0 ? checked_mul(kept, L_, "local rows") / E_ : 0;
    rows_check("sorted rows", n, true);
    add("routing", "local expert ids", {Tw_, K_}, i4, tkk);
    add("routing", "local kept", {Tw_, K_}, i4, tkk);
    gathered_rows();
    add("token rows", "x_local", {n, D_}, s_, tkd);
    if (chunks_ > 0) add("token rows", "x_local_chunk", {n, D_ / chunks_}, s_, tkd);
    add("token rows", "y_local", {n, D_}, s_, tkd);
    if (training_) add("token rows", "dy_local", {n, D_}, s_, tkd);
    hidden(n, tkf);
  }

  /// Token buffers of the gathered paths (ring, replicated, local, dense).
  void gathered_rows() {
    std::string const tkd = std::string(kTokens) + ", base_emb_dim";
    bool const ep_tp = lay_.route == ExpertRoute::EpTp;
    add("token rows", "x", {T_, ep_tp ? D_ / ep_ : D_}, s_, tkd);
    // num_moe_emb_chunks: the expert group's tokens arrive chunk-major into x_chunks (in place of
    // x_work), gathered from the own tokens repacked chunk-major.
    if (chunks_ > 0) {
      add("token rows", "x_chunks_own", {T_, D_}, s_, tkd);
      add("token rows", "x_chunks", {Tw_, D_}, s_, tkd);
    } else if (lay_.route == ExpertRoute::Ring || ep_tp) {
      add("token rows", "x_work", {Tw_, D_}, s_, tkd);
    }
    add_each("token rows", s_, tkd,
             {{"y_work", {Tw_, D_}}, {"y_own", {T_, D_}}, {"y_cols", {T_, Dc_}}});
    if (training_)
      add_each("token rows", s_, tkd,
               {{"dy_work", {Tw_, D_}}, {"d_weights_work", {Tw_, K_}}, {"dx_work", {Tw_, D_}}});
    sum_temporaries(numel({Tw_, D_}, "work rows"), lay_.route == ExpertRoute::Ring);
    if (tp_ > 1) pool_max(gather_pool_, numel({T_, D_}, "y"));
  }

  void dense_rows() {
    std::string const tkd = std::string(kTokens) + ", base_emb_dim",
                      tkf = std::string(kTokens) + ", base_moe_mlp_dim",
                      tke = std::string(kTokens) + ", num_experts";
    rows_check("dense expert rows", Tw_);
    gathered_rows();
    add("expert hidden states", "dense weights", {Tw_, L_}, s_, tke);
    for (char const* n : {"h0", "h1", "act"}) add("expert hidden states", n, {Tw_, F_}, s_, tkf);
    add("expert hidden states", "y_expert", {Tw_, D_}, s_, tkd);
    if (training_) {
      add("expert hidden states", "dy_expert", {Tw_, D_}, s_, tkd);
      for (char const* n : {"d_act", "d_h1"}) add("expert hidden states", n, {Tw_, F_}, s_, tkf);
      add("expert hidden states", "d_dense_weights", {Tw_, L_}, s_, tke);
    }
  }

  void hidden(std::int64_t n, std::string const& keys) {
    for (char const* name : {"h0", "h1", "act"})
      add("expert hidden states", name, {n, F_}, s_, keys);
    if (training_)
      for (char const* name : {"d_act", "d_h1"})
        add("expert hidden states", name, {n, F_}, s_, keys);
  }

  void shared() {
    std::string const keys = std::string(kTokens) + ", shared_experts, base_emb_dim";
    std::int64_t const Fs = plan_.tensor("shared_wi_0").compute_shape[1];
    rows_check("shared-expert tokens", Tg_);
    add_each("shared expert", s_, keys, {{"x_shared", {Tg_, D_}}, {"y_shared", {Tg_, D_}}});
    if (lay_.route == ExpertRoute::RaggedA2A) add("shared expert", "y_own", {T_, D_}, s_, keys);
    add_each(
        "shared expert", s_, keys,
        {{"y_shared_cols", {T_, Dc_}}, {"h0", {Tg_, Fs}}, {"h1", {Tg_, Fs}}, {"act", {Tg_, Fs}}});
    if (training_)
      add_each("shared expert", s_, keys,
               {{"d_act", {Tg_, Fs}}, {"dy_shared", {Tg_, D_}}, {"dx_shared", {Tg_, D_}}});
    sum_temporaries(numel({Tg_, D_}, "shared rows"), Tg_ != T_);
  }

  void comm() {
    std::string const keys = std::string(kTokens) + ", base_emb_dim, " + weight_keys_;
    if (gather_pool_ > 0)
      add("communication buffers", "all-gather unpack", {gather_pool_}, s_, keys);
    if (rs_pool_ > 0) add("communication buffers", "reduce-scatter pack", {rs_pool_}, s_, keys);
    if (parts_pool_ > 0)
      add("communication buffers", "reduce-scatter receive", {parts_pool_}, s_, keys);
    if (ar_temp_ > 0) add("communication buffers", "all-reduce temporaries", {ar_temp_}, s_, keys);
  }

  /// Temporaries of summing n elements of partial outputs over the expert group (a
  /// reduce-scatter's receive buffer when they are the group's gathered tokens, else an
  /// all-reduce) and, with tensor parallelism, of y's reduce-scatter and the backward's sums.
  void sum_temporaries(std::int64_t n, bool scattered) {
    if (scattered)
      pool_max(parts_pool_, n);
    else
      all_reduce_temp(n, ep_);
    if (tp_ > 1) {
      pool_max(rs_pool_, numel({T_, D_}, "y"));
      pool_max(parts_pool_, numel({T_, D_}, "y"));
      if (training_) all_reduce_temp(n, tp_);
    }
  }
  /// comm::all_reduce of n elements over P ranks: mine [ceil(n/P)] and, unless P divides n, a
  /// padded copy [P*ceil(n/P)]; freed on return (the largest counts).
  void all_reduce_temp(std::int64_t n, std::int64_t P) {
    if (P <= 1 || n == 0) return;
    std::int64_t const c = (n + P - 1) / P;
    std::int64_t const t = c + (c * P == n ? 0 : checked_mul(c, P, "all-reduce buffer"));
    ar_temp_ = std::max(ar_temp_, t);
  }
  static std::int64_t lead(Shape const& s, std::size_t d) {
    std::int64_t a = 1;
    for (std::size_t i = 0; i < d; ++i) a = checked_mul(a, s[i], "leading extents");
    return a;
  }
  /// A row count that must fit max_rows (slots: the rows scale with num_experts_per_tok too).
  void rows_check(std::string const& what, std::int64_t rows, bool slots = false) {
    add("", what, {rows}, 0, std::string(kTokens) + (slots ? ", num_experts_per_tok" : ""), true);
  }
  void launch_rows(std::string const& what, std::int64_t rows) {
    add("", what, {rows}, 0, weight_keys_, true);
  }

  LayerPlan const& plan_;
  distributed::Layout const& lay_;
  LayerConfig const& cfg_;
  bool training_, packed_;
  std::int64_t s_ = 4, T_ = 0, S_ = 1, D_ = 0, K_ = 0, E_ = 0, ep_ = 1, tp_ = 1, Dc_ = 0, L_ = 0;
  std::int64_t Tw_ = 0, Tg_ = 0, F_ = 0, chunks_ = 0;
  std::int64_t gather_pool_ = 0, rs_pool_ = 0, parts_pool_ = 0, ar_temp_ = 0;
  std::string weight_keys_;
  std::vector<Buffer> bufs_;
};

}  // namespace memory_detail

/// \brief Whether oneDNN keeps packed copies of the expert weights by default: float values and
/// moe built with oneDNN (host GEMMs). Pass false for device spaces.
inline bool default_packed_weights(LayerPlan const& plan) {
  return MOE_HAS_ONEDNN != 0 && plan.scalar_bytes == 4;
}

/// \brief Bytes one DistributedMoeLayer needs on the plan's rank (see the file comment for the
/// model and what it leaves out). Buffers the layer keeps from step to step are counted whole;
/// collective temporaries by their largest use.
/// \param training forward + backward (gradients, backward buffers); false: forward only
/// \param packed_weights count oneDNN's packed copies of the expert weights (float, host)
/// \throws ConfigError naming the quantity when an element or byte count does not fit int64.
inline MemoryEstimate estimate_layer_memory(LayerPlan const& plan, LayerConfig const& cfg,
                                            bool training, bool packed_weights) {
  memory_detail::LayerBuffers const lb(plan, cfg, training, packed_weights);
  MemoryEstimate est;
  for (char const* item :
       {"weights", "gathered weights", "packed expert weights", "weight gradients", "routing",
        "token rows", "expert hidden states", "shared expert", "communication buffers"}) {
    std::int64_t bytes = 0;
    std::string keys;
    bool any = false;
    for (auto const& b : lb.buffers()) {
      if (b.item != item) continue;
      any = true;
      std::int64_t const n = checked_product(b.shape, "the element count of " + b.name);
      bytes = checked_add(bytes, checked_mul(n, b.elem_bytes, "the bytes of " + b.name),
                          std::string("the bytes of ") + item);
      keys = MemoryEstimate::merge_keys(keys, b.keys);
    }
    if (any && bytes > 0) est.add(item, bytes, keys);
  }
  return est;
}

/// \brief estimate_layer_memory with default_packed_weights(plan).
inline MemoryEstimate estimate_layer_memory(LayerPlan const& plan, LayerConfig const& cfg,
                                            bool training) {
  return estimate_layer_memory(plan, cfg, training, default_packed_weights(plan));
}

/// \brief Refuses (ConfigError naming the tensor, its size, the limit and the keys to reduce) a
/// plan whose tensors on this rank exceed the kernels' index limits (see the file comment):
/// more rows than a 32-bit BLAS call or a kernel launch takes, more elements than one flat kernel
/// of the execution space indexes, or counts that do not fit int64. MPI counts are no limit
/// (moe/comm splits larger messages). Pure; the same on every rank of a symmetric layout.
inline void check_index_limits(LayerPlan const& plan,
                               IndexLimits const& limits = IndexLimits::host()) {
  memory_detail::LayerBuffers const lb(plan, plan.config, true, false);
  using moe::detail::shape_text;
  for (auto const& b : lb.buffers()) {
    std::int64_t const n = checked_product(b.shape, "the element count of " + b.name);
    if (b.rows_limited) {
      if (b.shape[0] > limits.max_rows)
        throw ConfigError(
            detail::cat(b.name, ": ", b.shape[0], " rows on this rank exceed the ", limits.max_rows,
                        " rows that one 32-bit BLAS call or kernel launch takes; reduce ", b.keys,
                        " (or spread the batch over more ranks)"));
      continue;
    }
    if (n > limits.max_elements)
      throw ConfigError(detail::cat(b.name, " ", shape_text(b.shape), " holds ", n,
                                    " elements on this rank, more than the ", limits.max_elements,
                                    " that a kernel indexed by ", limits.element_index,
                                    " reaches; reduce ", b.keys));
    checked_mul(n, std::max<std::int64_t>(b.elem_bytes, 8), "the bytes of " + b.name);
  }
}

// ------------------------------------------------------------------ the machine ---------------

}  // namespace moe
