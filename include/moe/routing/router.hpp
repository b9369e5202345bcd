#pragma once
/// \file
/// The routing stage of a layer (Router), with its buffers kept between steps.

#include <moe/config_types.hpp>
#include <moe/detail/blas.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/routing/backward.hpp>
#include <moe/routing/kernels.hpp>

#include <cstdint>
#include <vector>

namespace moe::routing {

/// \brief The routing stage of a layer, forward and backward: gate GEMM, score function, bias,
/// top-k, capacity mask, load-balance statistics and expert counts. The distributed ring path
/// routes the expert group's gathered tokens as one block per member and keeps the statistics
/// and the backward to its own block.
template <class Scalar, class ExecSpace>
class Router {
 public:
  using memory_space = typename ExecSpace::memory_space;
  using view1 = View1<Scalar, memory_space>;
  using view2 = View2<Scalar, memory_space>;
  using cview1 = View1<Scalar const, memory_space>;
  using cview2 = View2<Scalar const, memory_space>;
  using state_type = RoutingState<Scalar, memory_space>;

  Router() = default;
  Router(LayerConfig const& cfg, Kind kind) : params_(cfg, kind) {}

  /// \brief Routes the rows of x [R,D] with gate [D,E] (and bias [E] when the config has a routed
  /// bias). The rows are `block_token_offsets.size()` equal blocks of whole sequences of
  /// `seq_len` tokens; block m's first token has the global index block_token_offsets[m].
  /// Statistics (lb_sum(), expert_counts()) cover block `own` only.
  void forward(ExecSpace const& space, cview2 x, cview2 gate, cview1 bias, std::int64_t seq_len,
               std::vector<std::uint64_t> const& block_token_offsets, int own) {
    moe::detail::Region region("moe::route");
    moe::detail::gemm(space, "N", "N", Scalar(1), x, gate, Scalar(0),
                      logits_rows(space, x.extent(0)));
    route_logits(space, bias, seq_len, block_token_offsets, own);
  }

  /// \brief The buffer of the raw gate logits, shaped [R,E]: fill it (e.g. all-gather rows
  /// computed elsewhere) and call forward_logits() to route those rows.
  view2 logits_rows(ExecSpace const& space, std::int64_t R) {
    moe::detail::ensure(space, st_.logits, "moe::routing::logits", R, params_.cfg.num_experts);
    return st_.logits;
  }

  /// \brief forward() from the logits already in logits_rows(): the same routing, statistics
  /// and state as forward() on rows whose x . gate are those logits.
  void forward_logits(ExecSpace const& space, cview1 bias, std::int64_t seq_len,
                      std::vector<std::uint64_t> const& block_token_offsets, int own) {
    moe::detail::Region region("moe::route");
    route_logits(space, bias, seq_len, block_token_offsets, own);
  }

  /// Everything the last forward produced, all blocks.
  state_type const& state() const { return st_; }
  /// The last forward's state restricted to block `own` (the rows whose backward this rank runs).
  state_type own_state() const {
    state_type s = st_;
    for (auto m : {&state_type::logits, &state_type::scores, &state_type::biased,
                   &state_type::top_values, &state_type::weights})
      s.*m = block(st_.*m, own_);
    for (auto m : {&state_type::expert_ids, &state_type::kept}) s.*m = block(st_.*m, own_);
    return s;
  }
  /// Rows of the own block of any [R, n] view routed by the last forward.
  template <class V>
  V own_rows(V const& v) const {
    return blocks_ <= 1 || !v.data() ? v : block(v, own_);
  }
  /// Sum over the own block's sequences and experts of seq_counts * seq_probs (the load-balance
  /// loss is weight * E * this, summed over the batch, / (B_total * S^2)); 0 without the loss.
  double lb_sum() const { return lb_sum_; }
  /// Selected slots per expert over the own block (before capacity dropping), on the host; empty
  /// unless the config has a routed bias update rate.
  std::vector<std::int64_t> expert_counts() const {
    if (params_.cfg.routed_bias_update_rate <= 0 || !st_.expert_counts.data()) return {};
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st_.expert_counts);
    return std::vector<std::int64_t>(h.data(), h.data() + h.extent(0));
  }
  /// The load-balance loss of `sum` (lb_sum(), or its sum over the ranks of a batch group) for
  /// `global_sequences` sequences: weight * E * sum / (B_total * S^2); 0 without the loss.
  double lb_loss(double sum, std::int64_t global_sequences) const {
    return params_.cfg.load_balance_loss_weight > 0
               ? params_.cfg.load_balance_loss_weight * params_.cfg.num_experts * sum /
                     (double(global_sequences) * double(seq_len_) * double(seq_len_))
               : 0.0;
  }
  /// d lb_loss / d (seq_counts * seq_probs) summed as in lb_sum(): lb_loss() of a sum of 1.
  double lb_coefficient(std::int64_t global_sequences) const {
    return lb_loss(1.0, global_sequences);
  }

  /// \brief Backward of the own block: d_weights [T,K] (and the load-balance term, lb_coef) ->
  /// d logits -> dx (+= d_logits gate^T), dgate (= x^T d_logits, overwritten) and, with a routed
  /// bias, dbias (column sums of d biased, overwritten). x is the own block's input rows.
  void backward(ExecSpace const& space, cview2 x, cview2 gate, cview2 d_weights, double lb_coef,
                view2 dx, view2 dgate, view1 dbias) {
    moe::detail::Region region("moe::route::backward");
    std::int64_t const T = x.extent(0);
    int const E = params_.cfg.num_experts, K = params_.cfg.num_experts_per_tok;
    moe::detail::ensure(space, d_top_, "moe::routing::d_top", T, K);
    moe::detail::ensure(space, d_biased_, "moe::routing::d_biased", T, E);
    moe::detail::ensure(space, d_logits_, "moe::routing::d_logits", T, E);
    route_backward(space, params_, own_state(), d_weights, seq_len_, lb_coef, d_top_, d_biased_,
                   d_logits_);
    moe::detail::round_bf16_if(bf16_logits(), space, d_logits_);
    moe::detail::gemm(space, "T", "N", Scalar(1), x, d_logits_, Scalar(0), dgate);
    moe::detail::gemm(space, "N", "T", Scalar(1), d_logits_, gate, Scalar(1), dx);
    if (params_.cfg.routed_bias) column_sums(space, cview2(d_biased_), dbias, scratch_);
  }

 private:
  void route_logits(ExecSpace const& space, cview1 bias, std::int64_t seq_len,
                    std::vector<std::uint64_t> const& block_token_offsets, int own) {
    std::int64_t const R = st_.logits.extent(0);
    int const E = params_.cfg.num_experts, K = params_.cfg.num_experts_per_tok;
    blocks_ = int(block_token_offsets.size());
    own_ = own;
    seq_len_ = seq_len;
    // bf16 (docs/precision.md): bf16 logits unless float32_gate_logits; scores on in fp32.
    moe::detail::round_bf16_if(bf16_logits(), space, st_.logits);
    if (params_.cfg.routed_score_func == ScoreFunc::None) {
      st_.scores = st_.logits;
    } else {
      moe::detail::ensure(space, st_.scores, "moe::routing::scores", R, E);
      apply_score(space, params_.cfg.routed_score_func, cview2(st_.logits), st_.scores);
    }
    if (params_.cfg.routed_bias) {
      moe::detail::ensure(space, st_.biased, "moe::routing::biased", R, E);
      add_bias(space, cview2(st_.scores), bias, st_.biased);
    } else {
      st_.biased = st_.scores;
    }
    moe::detail::ensure(space, st_.expert_ids, "moe::routing::expert_ids", R, K);
    moe::detail::ensure(space, st_.top_values, "moe::routing::top_values", R, K);
    moe::detail::ensure(space, st_.weights, "moe::routing::weights", R, K);
    moe::detail::ensure(space, st_.kept, "moe::routing::kept", R, K);
    for (int m = 0; m < blocks_; ++m)
      select_topk(space, params_, block_token_offsets[std::size_t(m)], cview2(block(st_.scores, m)),
                  cview2(block(st_.biased, m)), block(st_.expert_ids, m), block(st_.top_values, m),
                  block(st_.weights, m));
    // bf16: the combine takes bf16 routing weights unless float32_weight_sum.
    moe::detail::round_bf16_if(params_.cfg.bf16() && !params_.cfg.float32_weight_sum, space,
                               st_.weights);
    using iview2 = View2<int const, memory_space>;
    capacity_mask(space, iview2(st_.expert_ids), seq_len,
                  params_.cfg.capacity_factor > 0 ? params_.cfg.capacity(seq_len) : -1, E, st_.kept,
                  scratch_);
    iview2 const own_ids = block(st_.expert_ids, own_);
    lb_sum_ = 0;
    if (params_.cfg.load_balance_loss_weight > 0) {
      std::int64_t const b_own = block_rows() / seq_len;
      moe::detail::ensure(space, st_.seq_counts, "moe::routing::seq_counts", b_own, E);
      moe::detail::ensure(space, st_.seq_probs, "moe::routing::seq_probs", b_own, E);
      lb_sum_ = lb_statistics(space, cview2(block(st_.biased, own_)), own_ids, seq_len,
                              st_.seq_counts, st_.seq_probs, scratch_);
    }
    if (params_.cfg.routed_bias_update_rate > 0) {
      moe::detail::ensure(space, st_.expert_counts, "moe::routing::expert_counts", E);
      expert_histogram(space, own_ids, st_.expert_counts);
    }
  }

  /// The gate matmul's output is bf16 (dtype=bfloat16 without float32_gate_logits).
  bool bf16_logits() const { return params_.cfg.bf16() && !params_.cfg.float32_gate_logits; }
  std::int64_t block_rows() const {
    return blocks_ > 0 ? std::int64_t(st_.logits.extent(0)) / blocks_ : 0;
  }
  /// Rows of block m of a [R, n] view.
  template <class V>
  V block(V const& v, int m) const {
    std::int64_t const rows = block_rows();
    return V(v.data() + m * rows * std::int64_t(v.extent(1)), rows, v.extent(1));
  }

  RouteParams params_;  // the config (cfg) and routing family
  state_type st_;
  moe::detail::ScratchPool<memory_space> scratch_;  // statistics buffers, kept between steps
  view2 d_top_, d_biased_, d_logits_;
  int blocks_ = 1, own_ = 0;
  std::int64_t seq_len_ = 1;
  double lb_sum_ = 0;
};

}  // namespace moe::routing
