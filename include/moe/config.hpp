#pragma once
/// \file
/// LayerConfig's field table (parsing, keys, describe(), validation); the struct: config_types.hpp.

#include <moe/config_table.hpp>
#include <moe/config_types.hpp>
#include <moe/detail/text.hpp>
#include <moe/error.hpp>

#include <string>
#include <vector>

namespace moe {

inline ConfigTable<LayerConfig> const& LayerConfig::table() {
  using C = LayerConfig;
  static ConfigTable<C> const t = [] {
    auto req = [](bool ok, auto const&... msg) { detail::require<ConfigError>(ok, msg...); };
    ConfigTable<C> t(DescribeNumbers::ToString, ";");
    // Fields, in describe() order (the ranks compare that text; tests quote `K=1`, `cf=1.5`).
    t.field("num_experts", &C::num_experts, "E", "E, routed experts");
    t.field("num_experts_per_tok", &C::num_experts_per_tok, "K", "K, experts per token");
    t.field("base_emb_dim", &C::base_emb_dim, "D", "D, model / MoE input dim");
    t.field("base_moe_mlp_dim", &C::base_moe_mlp_dim, "F", "F, expert hidden size");
    t.choice("decoder_block", &C::decoder_block, "block",
             {{"mixtral", DecoderBlock::Mixtral}, {"deepseek", DecoderBlock::DeepSeek}},
             "mixtral: generic top-k, softmax over the K values; deepseek: selection on biased "
             "scores, weights from pre-bias scores, groups, scaling");
    t.choice("routed_score_func", &C::routed_score_func, "score",
             {{"", ScoreFunc::None},
              {"none", ScoreFunc::None},
              {"None", ScoreFunc::None},
              {"null", ScoreFunc::None},
              {"softmax", ScoreFunc::Softmax},
              {"sigmoid", ScoreFunc::Sigmoid},
              {"sqrtsoftplus", ScoreFunc::SqrtSoftplus}},
             "score function applied to the gate logits");
    t.field("routed_bias", &C::routed_bias, "bias",
            "learnable gate bias added after the score function");
    t.field("routed_scaling_factor", &C::routed_scaling_factor, "scale",
            "DeepSeek: weights x factor");
    t.field("n_routing_groups", &C::n_routing_groups, "groups",
            "DeepSeek group-limited routing: number of groups (-1: off)")
        .describe_with([](C const& c, DescribeNumbers) {
          return std::to_string(c.n_routing_groups) + "/" + std::to_string(c.topk_routing_group);
        });
    t.field("topk_routing_group", &C::topk_routing_group, "",  // in describe() as groups=N/k
            "DeepSeek group-limited routing: groups kept per token (-1: off)");
    t.field("norm_topk_prob", &C::norm_topk_prob, "norm",
            "generic path: renormalise the K weights to sum 1");
    t.field("use_random_routing", &C::use_random_routing, "random",
            "uniform random experts, drawn from (seed, global token, slot)");
    t.field("seed", &C::seed, "seed", "seed of random routing");
    t.field("capacity_factor", &C::capacity_factor, "cf",
            "> 0: per-sequence capacity int(max(ceil(S*K/E)*cf, cf)), later (s,k) slots dropped "
            "(-1: no limit)");
    t.field("load_balance_loss_weight", &C::load_balance_loss_weight, "lb",
            "Switch-style load-balance loss weight (0: off)");
    t.field("routed_bias_update_rate", &C::routed_bias_update_rate, "rate",
            "DeepSeek loss-free balancing rate: bias += sign(T*K/E - count)*rate (0: off)");
    t.choice("mlp_activations", &C::mlp_activation, "act",
             {{"[silu, linear]", Activation::Silu}, {"[gelu, linear]", Activation::Gelu}},
             "expert activation: [silu, linear] (SwiGLU) or [gelu, linear] (GeGLU, tanh gelu)")
        .parse_with([req](C& c, std::string const& key, std::string const& value) {
          auto const items = detail::split_list(value);
          req(!items.empty() && items.size() <= 2 && (items.size() == 1 || items[1] == "linear"),
              key, "=", value, " is not supported ([silu, linear] | [gelu, linear])");
          req(items[0] == "silu" || items[0] == "gelu", key, "=", value, ": activation '", items[0],
              "' is not supported (silu | gelu)");
          c.mlp_activation = items[0] == "silu" ? Activation::Silu : Activation::Gelu;
        });
    t.field("shared_experts", &C::shared_experts, "shared",
            "shared expert of hidden size shared_experts x base_moe_mlp_dim");
    t.field("sparse_matmul", &C::sparse_matmul, "sparse",
            "false: dense masked path (every expert on every token)");
    t.field("check_finite", &C::check_finite, "finite",
            "reject NaN/Inf in x, dy, the gate and every weight a token reaches");
    t.choice("dtype", &C::dtype, "dtype",
             {{"float32", ComputeDtype::Native},
              {"float64", ComputeDtype::Native},
              {"bfloat16", ComputeDtype::BFloat16}},
             "float32 | float64: compute in the layer's Scalar; bfloat16: bf16 activations and "
             "matmul inputs, fp32 accumulation and routing (docs/precision.md)");
    t.field("float32_weight_sum", &C::float32_weight_sum, "f32sum",
            "dtype=bfloat16: the top-k weighted sum takes fp32 routing weights");
    t.field("float32_gate_logits", &C::float32_gate_logits, "f32gate",
            "dtype=bfloat16: the gate matmul and its logits stay fp32");

    // Rules, in the order validate() checks them.
    t.at_least(&C::num_experts, 1);
    t.at_least(&C::num_experts_per_tok, 1);
    t.check(&C::num_experts_per_tok, "must be <= num_experts", [req](C const& c) {
      req(c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok=", c.num_experts_per_tok,
          " must be <= num_experts=", c.num_experts);
    });
    t.at_least(&C::base_emb_dim, 1);
    t.at_least(&C::base_moe_mlp_dim, 1);
    t.at_least(&C::shared_experts, 0);
    t.at_least(&C::load_balance_loss_weight, 0.0);
    t.at_least(&C::routed_bias_update_rate, 0.0);
    t.check(
        &C::n_routing_groups,
        "-1 or in [1, 64], dividing num_experts; needs decoder_block=deepseek", [req](C const& c) {
          if (c.n_routing_groups == -1) return;
          int const g = c.n_routing_groups, k = c.topk_routing_group;
          req(c.decoder_block == DecoderBlock::DeepSeek, "n_routing_groups=", g,
              " (group-limited routing) requires decoder_block=deepseek");
          req(g >= 1 && g <= 64, "n_routing_groups=", g, " must be -1 or in [1, 64]");
          req(c.num_experts % g == 0, "num_experts=", c.num_experts,
              " is not divisible by n_routing_groups=", g);
          req(k >= 1 && k <= g, "topk_routing_group=", k, " must be in [1, n_routing_groups=", g,
              "]");
          req(long(k) * (c.num_experts / g) >= c.num_experts_per_tok, "topk_routing_group=", k,
              " groups of ", c.num_experts / g,
              " experts hold fewer than num_experts_per_tok=", c.num_experts_per_tok, " experts");
        });
    t.check(&C::topk_routing_group,
            "in [1, n_routing_groups], holding >= K experts; -1 when n_routing_groups=-1",
            [req](C const& c) {
              req(c.n_routing_groups != -1 || c.topk_routing_group == -1,
                  "topk_routing_group=", c.topk_routing_group,
                  " is set but n_routing_groups=-1 (group-limited routing is off)");
            });
    t.check(&C::routed_bias_update_rate, "> 0 needs decoder_block=deepseek and routed_bias=true",
            [req](C const& c) {
              req(c.routed_bias_update_rate <= 0 ||
                      (c.decoder_block == DecoderBlock::DeepSeek && c.routed_bias),
                  "routed_bias_update_rate=", c.routed_bias_update_rate,
                  " (loss-free balancing) requires decoder_block=deepseek and routed_bias=true");
            });
    t.greater_than(&C::routed_scaling_factor, 0.0);
    return t;
  }();
  return t;
}

inline std::vector<std::string> LayerConfig::keys() { return table().keys(); }

inline bool LayerConfig::has_key(std::string const& key) { return table().has_key(key); }

inline void LayerConfig::set(std::string const& key, std::string const& value) {
  table().set(*this, key, value);
}

inline void LayerConfig::validate() const { table().validate(*this); }

/// A canonical text of every LayerConfig field (used to check that all ranks agree).
inline std::string describe(LayerConfig const& c) { return LayerConfig::table().describe(c); }

}  // namespace moe
