#pragma once
/// \file
/// ParallelConfig: how one MoE layer is laid out over MPI ranks, under MaxText's key names.

#include <moe/config.hpp>
#include <moe/error.hpp>

#include <string>
#include <utility>
#include <vector>

namespace moe {

/// \brief Mesh degrees and distributed-strategy switches (MaxText keys).
///
/// The mesh is built from the `ici_*` degrees (one may be -1: it fills the rest) over the axes of
/// the `custom_mesh_and_rule` preset (MaxText's base axes when empty); logical-axis rules decide
/// which tensor dimension lands on which axis.
struct ParallelConfig {
  int ici_data_parallelism = 1;
  int ici_fsdp_parallelism = 1;
  int ici_fsdp_transpose_parallelism = 1;
  int ici_expert_parallelism = 1;
  int ici_tensor_parallelism = 1;
  int ici_context_parallelism = 1;
  /// Ring of experts: all-gather tokens over the expert axis, reduce-scatter the outputs.
  bool use_ring_of_experts = false;
  /// > 0: the expert-parallel receive buffer holds int(T*K*factor) rows; later rows are dropped.
  double ragged_buffer_factor = -1.0;
  /// Gather FSDP-sharded weight dims one mesh axis at a time (one collective per axis).
  bool moe_fsdp_use_two_stage_all_gather = false;
  /// Preset of mesh axes + rules ("" = the library's default rules).
  std::string custom_mesh_and_rule;

  /// (key, degree) pairs of the ici_* keys.
  std::vector<std::pair<std::string, int>> ici() const {
    return {{"ici_data_parallelism", ici_data_parallelism},
            {"ici_fsdp_parallelism", ici_fsdp_parallelism},
            {"ici_fsdp_transpose_parallelism", ici_fsdp_transpose_parallelism},
            {"ici_expert_parallelism", ici_expert_parallelism},
            {"ici_tensor_parallelism", ici_tensor_parallelism},
            {"ici_context_parallelism", ici_context_parallelism}};
  }

  static std::vector<std::string> keys() {
    return {"ici_data_parallelism",   "ici_fsdp_parallelism",   "ici_fsdp_transpose_parallelism",
            "ici_expert_parallelism", "ici_tensor_parallelism", "ici_context_parallelism",
            "use_ring_of_experts",    "ragged_buffer_factor",   "moe_fsdp_use_two_stage_all_gather",
            "custom_mesh_and_rule"};
  }
  static bool has_key(std::string const& key) {
    for (auto const& k : keys())
      if (k == key) return true;
    return false;
  }

  /// \brief Sets one key from its text form; ConfigError for an unknown key or a bad value.
  void set(std::string const& key, std::string const& value) {
    using namespace detail;
    auto degree = [&]() {
      long long const v = parse_int(key, value);
      if (v != -1 && (v < 1 || v > 1 << 20))
        throw ConfigError(cat(key, "=", value, " must be -1 (fill) or a positive degree"));
      return int(v);
    };
    if (key == "ici_data_parallelism")
      ici_data_parallelism = degree();
    else if (key == "ici_fsdp_parallelism")
      ici_fsdp_parallelism = degree();
    else if (key == "ici_fsdp_transpose_parallelism")
      ici_fsdp_transpose_parallelism = degree();
    else if (key == "ici_expert_parallelism")
      ici_expert_parallelism = degree();
    else if (key == "ici_tensor_parallelism")
      ici_tensor_parallelism = degree();
    else if (key == "ici_context_parallelism")
      ici_context_parallelism = degree();
    else if (key == "use_ring_of_experts")
      use_ring_of_experts = parse_bool(key, value);
    else if (key == "ragged_buffer_factor")
      ragged_buffer_factor = parse_double(key, value);
    else if (key == "moe_fsdp_use_two_stage_all_gather")
      moe_fsdp_use_two_stage_all_gather = parse_bool(key, value);
    else if (key == "custom_mesh_and_rule")
      custom_mesh_and_rule = trim(value);
    else
      throw ConfigError(
          cat("unknown config key '", key, "' (value ", value, ")", did_you_mean(key, keys())));
  }

  /// \brief Checks the rules between values that need no communicator (every tool calls it, so
  /// one config is accepted or rejected the same everywhere): at most one ici_* degree is -1,
  /// and ragged_buffer_factor is -1 (off) or > 0. The mesh checks its product against the ranks.
  void validate() const {
    using detail::cat;
    std::string fill;
    for (auto const& [k, v] : ici())
      if (v == -1) {
        if (!fill.empty())
          throw ConfigError(cat(fill, "=-1 and ", k,
                                "=-1: at most one ici_*_parallelism degree may be -1 (fill the "
                                "rest of the ranks); give the other a degree"));
        fill = k;
      }
    if (!(ragged_buffer_factor == -1.0 || ragged_buffer_factor > 0))
      throw ConfigError(
          cat("ragged_buffer_factor=", ragged_buffer_factor, " must be > 0 (or -1: no limit)"));
  }

  /// A canonical text of every field (used to check that all ranks agree).
  std::string describe() const {
    std::string s;
    for (auto const& [k, v] : ici()) s += k + "=" + std::to_string(v) + ";";
    s += "ring=" + std::to_string(use_ring_of_experts) +
         ";rbf=" + std::to_string(ragged_buffer_factor) +
         ";two_stage=" + std::to_string(moe_fsdp_use_two_stage_all_gather) +
         ";preset=" + custom_mesh_and_rule;
    return s;
  }
};

/// A canonical text of every LayerConfig field (used to check that all ranks agree).
inline std::string describe(LayerConfig const& c) {
  auto n = [](auto v) { return std::to_string(v); };
  return "E=" + n(c.num_experts) + ";K=" + n(c.num_experts_per_tok) + ";D=" + n(c.base_emb_dim) +
         ";F=" + n(c.base_moe_mlp_dim) + ";block=" + n(int(c.decoder_block)) +
         ";score=" + n(int(c.routed_score_func)) + ";bias=" + n(c.routed_bias) +
         ";scale=" + n(c.routed_scaling_factor) + ";groups=" + n(c.n_routing_groups) + "/" +
         n(c.topk_routing_group) + ";norm=" + n(c.norm_topk_prob) +
         ";random=" + n(c.use_random_routing) + ";seed=" + n(c.seed) +
         ";cf=" + n(c.capacity_factor) + ";lb=" + n(c.load_balance_loss_weight) +
         ";rate=" + n(c.routed_bias_update_rate) + ";act=" + n(int(c.mlp_activation)) +
         ";shared=" + n(c.shared_experts) + ";sparse=" + n(c.sparse_matmul) +
         ";finite=" + n(c.check_finite);
}

}  // namespace moe
