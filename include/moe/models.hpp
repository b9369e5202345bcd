#pragma once
/// \file
/// The MoE shapes of published models, by MaxText's `model_name` (what configs/models/X.yml sets
/// of the MoE layer's keys), checked against MaxText's model files. Where MaxText and the model's
/// release differ the table follows MaxText: deepseek3-671b has no group-limited routing, and
/// MaxText's `qwen3_moe` block routes with the generic top-k path (decoder_block=mixtral).

#include <moe/config_table.hpp>
#include <moe/error.hpp>

#include <string>
#include <utility>
#include <vector>

namespace moe {

/// \brief The MoE layer of one published model, under MaxText's key names.
struct ModelFacts {
  std::string name;               ///< MaxText's model_name
  int num_experts;                ///< E
  int num_experts_per_tok;        ///< K
  int base_emb_dim;               ///< D
  int base_moe_mlp_dim;           ///< F
  int shared_experts;             ///< shared expert hidden size = this x F
  std::string decoder_block;      ///< moe's routing path: mixtral (generic top-k) or deepseek
  std::string routed_score_func;  ///< "" (softmax over the K values) | sigmoid | ...
  bool routed_bias;
  int n_routing_groups;  ///< -1: no group-limited routing
  int topk_routing_group;
  double routed_scaling_factor;
  bool norm_topk_prob;
  std::string mlp_activations;      ///< "[silu, linear]"
  double load_balance_loss_weight;  ///< < 0: the model file does not set it
  /// ParallelConfig key the model opts into (mixtral-8x7b, as MaxText PR #4179 set it; issue
  /// #14). Only the dense path with an expert axis is affected.
  bool moe_dispatch_no_expert_sharding;

  /// The (key, value) pairs `model_name=name` sets, in LayerConfig / ParallelConfig text form.
  std::vector<std::pair<std::string, std::string>> key_values() const {
    using detail::cat;
    std::vector<std::pair<std::string, std::string>> kv = {
        {"num_experts", cat(num_experts)},
        {"num_experts_per_tok", cat(num_experts_per_tok)},
        {"base_emb_dim", cat(base_emb_dim)},
        {"base_moe_mlp_dim", cat(base_moe_mlp_dim)},
        {"shared_experts", cat(shared_experts)},
        {"decoder_block", decoder_block},
        {"routed_score_func", routed_score_func},
        {"routed_bias", routed_bias ? "true" : "false"},
        {"n_routing_groups", cat(n_routing_groups)},
        {"topk_routing_group", cat(topk_routing_group)},
        {"routed_scaling_factor", cat(routed_scaling_factor)},
        {"norm_topk_prob", norm_topk_prob ? "true" : "false"},
        {"mlp_activations", mlp_activations},
    };
    if (load_balance_loss_weight >= 0)
      kv.emplace_back("load_balance_loss_weight", cat(load_balance_loss_weight));
    if (moe_dispatch_no_expert_sharding) kv.emplace_back("moe_dispatch_no_expert_sharding", "true");
    return kv;
  }
};

/// \brief Every model of the table, in a fixed order.
inline std::vector<ModelFacts> const& model_table() {
  // clang-format off
  static std::vector<ModelFacts> const t = {
      // name             E    K  D     F      sh block       score      bias   grp tkg scale norm   act               lb     noexp
      {"mixtral-8x7b",    8,   2, 4096, 14336, 0, "mixtral",  "",        false, -1, -1, 1.0, false, "[silu, linear]", -1,    true},
      {"mixtral-8x22b",   8,   2, 6144, 16384, 0, "mixtral",  "",        false, -1, -1, 1.0, false, "[silu, linear]", -1,    false},
      {"deepseek3-671b",  256, 8, 7168, 2048,  1, "deepseek", "sigmoid", true,  -1, -1, 2.5, false, "[silu, linear]", -1,    false},
      {"qwen3-30b-a3b",   128, 8, 2048, 768,   0, "mixtral",  "",        false, -1, -1, 1.0, true,  "[silu, linear]", -1,    false},
      {"qwen3-30b-a3b-base", 128, 8, 2048, 768, 0, "mixtral", "",        false, -1, -1, 1.0, true,  "[silu, linear]", -1,    false},
      {"qwen3-235b-a22b", 128, 8, 4096, 1536,  0, "mixtral",  "",        false, -1, -1, 1.0, true,  "[silu, linear]", 0.001, false},
      {"qwen3-480b-a35b", 160, 8, 6144, 2560,  0, "mixtral",  "",        false, -1, -1, 1.0, true,  "[silu, linear]", -1,    false},
  };
  // clang-format on
  return t;
}

/// \brief The known model names, comma-separated (for messages).
inline std::string model_names_text() {
  std::string known;
  for (auto const& m : model_table()) known += (known.empty() ? "" : ", ") + m.name;
  return known;
}

/// \brief The facts of model `name`; else ConfigError listing the known names (and the nearest).
inline ModelFacts const& model_facts(std::string const& name) {
  std::vector<std::string> names;
  for (auto const& m : model_table()) {
    if (m.name == name) return m;
    names.push_back(m.name);
  }
  throw ConfigError(detail::cat("model_name=", name, " is not a MoE model moe knows (",
                                model_names_text(), ")", detail::did_you_mean(name, names)));
}

}  // namespace moe
