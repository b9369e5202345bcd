#pragma once
// train_moe's up-front memory estimate (issue #12): the bytes one rank needs for the whole model,
// computed from the configuration before anything is allocated, and the check that refuses a
// configuration that cannot fit with the estimate, the machine's available memory and the keys to
// change (moe::require_fits). MOE_SKIP_MEMORY_CHECK=1 in the environment skips the comparison.
//
// The model follows run_training (train.hpp) buffer by buffer, with s = bytes per value (dtype),
// T = tokens of this rank (the layer's x block: per_device_batch_size x ranks / batch parts x
// max_target_length), V = vocab, D = base_emb_dim, C = context_length, N = base_num_decoder_layers:
//  * weights: the replicated non-MoE parameters (embedding [V,D], token mixing [C,D], N + 1 norm
//    scales [D], output projection [D,V]) + N x the MoE layer's stored blocks;
//  * gradients: the same for the non-MoE parameters + N x the MoE layer's weight gradients;
//  * optimizer: AdamW's two moments of every parameter this rank stores (host mirrors alias
//    them on host spaces; a moment stored in bf16, mu_dtype / weight_dtype=bfloat16, takes 2
//    bytes an element and is widened into a float mirror only while a checkpoint is written);
//  * activations: the driver's [T,D] buffers (embedded, N + 1 residuals, N normed, N MoE outputs,
//    the final norm, 4 backward rows: 3N + 7 in all), N + 1 inverse RMS [T], token losses, the
//    token ids; logits and their gradient [T,V];
//  * each MoE layer keeps its own buffers: N x moe::estimate_layer_memory (routing, token rows,
//    expert hidden states, shared expert, gathered and packed weights, communication buffers);
//  * the all-reduce of the non-MoE gradients over the batch axes, the dataset (markov tables or
//    the text file), rank 0's assembled checkpoint (3 copies of every global parameter, with
//    enable_checkpointing), and the closing expert-GEMM yardstick (at most ~512 MiB);
//  * dropless routing over expert-parallel ranks: 10 % of the routed buffers (token rows, expert
//    hidden states) for the rank that receives more than the balanced share;
//  * a fixed 32 MiB for what the running process adds (oneDNN's kernels, MPI's buffers, ...).
// Not included: the process's code, MPI and runtime libraries, which are already resident when
// the check runs (and so already missing from MemAvailable). train_moe's summary prints the
// estimate beside the peak resident set less the resident set at the start.

#include "config.hpp"

#include <moe/distributed/memory.hpp>
#include <moe/distributed/plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace train {

/// \brief The global batch of `cfg` on `ranks` ranks (per_device_batch_size x ranks), or the
/// ConfigError run_training gives when that is not a whole number of sequences.
inline std::int64_t global_batch(TrainConfig const& cfg, int ranks) {
  double const b = cfg.per_device_batch_size * double(ranks);
  moe::detail::require<moe::ConfigError>(
      std::isfinite(b) && std::abs(b - std::round(b)) < 1e-9 && std::round(b) >= 1 && b < 9.0e18,
      "per_device_batch_size=", cfg.per_device_batch_size, " x ", ranks, " ranks = ", b,
      " must be a whole number of sequences (the global batch)");
  return std::int64_t(std::llround(b));
}

/// \brief The plan of rank 0 of the MoE layers of `cfg` on `ranks` ranks (moe::make_plan; throws
/// the ConfigError the layer would).
inline moe::LayerPlan layer_plan(TrainConfig const& cfg, int ranks) {
  return moe::make_plan(cfg.layer, cfg.par, ranks, 0, global_batch(cfg, ranks),
                        cfg.max_target_length, cfg.dtype == "float64" ? 8 : 4);
}

/// \brief Bytes one rank of train_moe needs for `cfg` on `ranks` ranks (see the file comment).
/// \param packed_weights count oneDNN's packed expert weights (moe::default_packed_weights)
/// \throws moe::ConfigError for a configuration the layer refuses, or naming the quantity whose
///         element or byte count does not fit int64.
inline moe::MemoryEstimate estimate_memory(TrainConfig const& cfg, int ranks, bool packed_weights) {
  using moe::checked_add;
  using moe::checked_mul;
  using moe::checked_product;
  auto const plan = layer_plan(cfg, ranks);
  std::int64_t const s = std::int64_t(plan.scalar_bytes);
  std::int64_t const T = plan.local_tokens, S = cfg.max_target_length;
  std::int64_t const V = cfg.vocab(), D = cfg.layer.base_emb_dim, C = cfg.context_length;
  std::int64_t const N = cfg.base_num_decoder_layers;
  std::string const tok = "per_device_batch_size, max_target_length";
  auto bytes = [&](std::vector<std::int64_t> const& shape, std::int64_t elem,
                   std::string const& what) {
    return checked_mul(checked_product(shape, "the element count of " + what), elem,
                       "the bytes of " + what);
  };

  moe::MemoryEstimate layer = moe::estimate_layer_memory(plan, cfg.layer, true, packed_weights);
  moe::MemoryEstimate est;
  // Parameters: the non-MoE ones are replicated, the MoE layers' are their stored blocks.
  std::int64_t const dense_elems = checked_add(
      checked_add(checked_product({V, D}, "embedding [V,D]"), checked_product({C, D}, "mixing"),
                  "dense parameters"),
      checked_add(checked_product({N + 1, D}, "norm scales"),
                  checked_product({D, V}, "output projection [D,V]"), "dense parameters"),
      "dense parameters");
  std::int64_t const dense = checked_mul(dense_elems, s, "bytes of the dense parameters");
  std::string const dense_keys = "vocab_size, base_emb_dim";
  std::int64_t const moe_weights = checked_mul(layer.bytes("weights"), N, "bytes of MoE weights");
  std::string const wkeys = "num_experts, base_emb_dim, base_moe_mlp_dim, base_num_decoder_layers";
  // The keys of the parameters: the MoE layers' and, when they weigh (10 % or more), the
  // vocabulary's; the larger part first.
  std::string const pkeys = dense > moe_weights ? moe::MemoryEstimate::merge_keys(dense_keys, wkeys)
                            : dense * 10 >= moe_weights
                                ? moe::MemoryEstimate::merge_keys(wkeys, dense_keys)
                                : wkeys;
  est.add("weights", checked_add(dense, moe_weights, "bytes of the weights"), pkeys);
  est.add("gradients",
          checked_add(dense, checked_mul(layer.bytes("weight gradients"), N, "MoE gradients"),
                      "bytes of the gradients"),
          pkeys);
  // AdamW's moments: each in the parameters' bytes, or 2 bytes an element when stored in bf16
  // (mu_dtype=bfloat16; both with weight_dtype=bfloat16).
  std::int64_t const params_bytes = checked_add(dense, moe_weights, "parameters");
  std::int64_t const moment16 = params_bytes / s * 2;
  std::int64_t const mu_bytes = cfg.bf16_mu() ? moment16 : params_bytes;
  std::int64_t const nu_bytes = cfg.bf16_nu() ? moment16 : params_bytes;
  est.add("optimizer (AdamW moments)", checked_add(mu_bytes, nu_bytes, "AdamW moments"),
          moe::MemoryEstimate::merge_keys(pkeys, "mu_dtype, weight_dtype"));
  for (char const* item : {"bf16 weight copies", "gathered weights", "packed expert weights"})
    if (layer.bytes(item) > 0) est.add(item, checked_mul(layer.bytes(item), N, item), wkeys);

  // The driver's activations.
  std::int64_t const rows = checked_add(checked_mul(3, N, "rows"), 7, "rows");
  std::int64_t act = bytes({rows, T, D}, s, "the [T,D] activations");
  act = checked_add(act, bytes({N + 2, T}, s, "the per-token values"), "activations");
  act = checked_add(act, bytes({3, T}, 4, "the token ids"), "activations");
  est.add("activations", act, tok + ", base_emb_dim, base_num_decoder_layers");
  est.add("logits", bytes({2, T, V}, s, "the logits [T,V]"), tok + ", vocab_size");
  // The GEMMs' operand copies are buffers of the threads, kept from call to call and used by
  // every layer in turn: counted once, not per layer.
  for (auto const& i : layer.items)
    if (i.what == "GEMM operand copies") est.add(i.what, i.bytes, i.keys);
  for (char const* item :
       {"routing", "token rows", "expert hidden states", "shared expert", "communication buffers"})
    if (layer.bytes(item) > 0) {
      std::string keys;
      for (auto const& i : layer.items)
        if (i.what == item) keys = i.keys;
      est.add(std::string(std::strcmp(item, "communication buffers") == 0 ? "" : "MoE ") + item,
              checked_mul(layer.bytes(item), N, item), keys + ", base_num_decoder_layers");
    }
  // The all-reduce of the dense gradients over the batch axes (freed after each step).
  std::int64_t const bp = plan.layout.batch_parts;
  if (bp > 1) {
    std::int64_t const c = (dense_elems + bp - 1) / bp;
    est.add("communication buffers",
            checked_mul(checked_add(c, c * bp == dense_elems ? 0 : c * bp, "all-reduce"), s,
                        "all-reduce"),
            dense_keys);
  }
  // Data.
  std::int64_t data = 0;
  if (cfg.dataset_type == "text") {
    std::error_code ec;
    auto const size = std::filesystem::file_size(cfg.dataset_path, ec);
    if (!ec) data = std::int64_t(size);
  } else if (cfg.dataset_type == "markov") {
    double const contexts = std::pow(double(cfg.vocab_size), cfg.markov_order);
    data = std::int64_t(contexts * (12.0 * cfg.markov_branching + 32.0));
  }
  if (data > 0) est.add("dataset", data, "dataset_path, vocab_size, markov_order");
  // Rank 0 assembles every global parameter, mu and nu to write a checkpoint.
  if (cfg.enable_checkpointing) {
    std::int64_t global = dense_elems;
    for (auto const& t : plan.tensors)
      if (t.name != "x" && t.name != "y")
        global = checked_add(
            global, checked_mul(checked_product(t.global_shape, "global " + t.name), N, t.name),
            "global parameters");
    est.add("checkpoint (rank 0)", checked_mul(checked_mul(global, s, "checkpoint"), 3, "ckpt"),
            wkeys);
    // bf16 moments are widened into float mirrors while a checkpoint is saved or loaded.
    int const widened = (cfg.bf16_mu() ? 1 : 0) + (cfg.bf16_nu() ? 1 : 0);
    if (widened > 0)
      est.add("checkpoint (bf16 moments widened)",
              checked_mul(params_bytes, widened, "bf16 moments widened"), pkeys);
  }
  // The expert-GEMM yardstick after the last step (Trainer::expert_gemm_seconds).
  {
    double const E = cfg.layer.num_experts, F = cfg.layer.base_moe_mlp_dim;
    double const tokens = cfg.per_device_batch_size * double(S);
    double const grows = std::round(tokens) * cfg.layer.num_experts_per_tok;
    double const per_expert = double(s) * (6.0 * double(D) * F + 3.0 * grows / E * double(D + F));
    double const Ec = std::max(1.0, std::min(E, std::floor(512.0 * 1024 * 1024 / per_expert)));
    double const b = Ec * per_expert;
    if (b < 9.0e18) est.add("expert GEMM yardstick", std::int64_t(b), wkeys);
  }
  // Dropless routing over expert-parallel ranks: the rank whose experts are hottest receives more
  // than the balanced rows the layer's estimate assumes. 10 % of the routed buffers (measured:
  // 4 % on the hotter rank of a qwen3-30b-a3b layer at EP=2, a freshly initialised router).
  if (cfg.layer.capacity_factor <= 0 && plan.layout.local_experts < cfg.layer.num_experts) {
    std::int64_t const routed =
        checked_add(est.bytes("MoE token rows"), est.bytes("MoE expert hidden states"), "rows");
    if (routed > 0)
      est.add("routing imbalance (dropless)", routed / 10,
              "num_experts_per_tok, per_device_batch_size, max_target_length");
  }
  // What the process adds once it runs, beside its buffers: oneDNN's kernels (code, scratch),
  // MPI's and OpenMP's buffers, allocator slack. Measured 21-26 MiB above the other items (peak
  // resident set less the start's; 1 and 2 ranks; the default model and a qwen3-30b-a3b layer).
  est.add("runtime (kernel code and scratch, MPI, allocator)", std::int64_t(32) << 20, "");
  return est;
}

/// \brief estimate_memory with oneDNN's packed weights counted as moe::default_packed_weights.
inline moe::MemoryEstimate estimate_memory(TrainConfig const& cfg, int ranks) {
  return estimate_memory(cfg, ranks, MOE_HAS_ONEDNN != 0 && cfg.dtype != "float64");
}

/// \brief Refuses the driver's index limits (moe::check_index_limits of its MoE layers, and its
/// own [T,V] logits, a BLAS GEMM of T rows).
inline void check_index_limits(TrainConfig const& cfg, int ranks,
                               moe::IndexLimits const& limits = moe::IndexLimits::host()) {
  auto const plan = layer_plan(cfg, ranks);
  moe::check_index_limits(plan, limits);
  std::int64_t const T = plan.local_tokens, V = cfg.vocab();
  std::int64_t const n = moe::checked_product({T, V}, "the element count of the logits [T,V]");
  moe::detail::require<moe::ConfigError>(
      n <= limits.max_elements, "the logits [", T, ", ", V, "] hold ", n,
      " elements on this rank, more than the ", limits.max_elements, " that a kernel indexed by ",
      limits.element_index, " reaches; reduce per_device_batch_size, max_target_length");
}

/// \brief moe::require_fits for train_moe: ConfigError "train_moe needs about X per rank (...)
/// but this node has Y available for R ranks (Z each): reduce ...", unless the estimate fits,
/// `available` is unknown (< 0) or MOE_SKIP_MEMORY_CHECK is set.
inline void require_fits(moe::MemoryEstimate const& est, std::int64_t available, int ranks_on_node,
                         std::string const& keys_hint = "") {
  moe::require_fits("train_moe", est, available, ranks_on_node, keys_hint);
}

}  // namespace train
