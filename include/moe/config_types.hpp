#pragma once
/// \file
/// LayerConfig and its enums without the parsing, for headers that only read a LayerConfig;
/// moe/config.hpp adds the field table (keys, set(), describe(), validate()).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace moe {

/// \brief Score function applied to the gate logits (`routed_score_func`).
enum class ScoreFunc { None, Softmax, Sigmoid, SqrtSoftplus };

/// \brief Expert activation of the gated FFN (`mlp_activations[0]`; the second entry is `linear`).
enum class Activation { Silu, Gelu };

/// \brief Routing family selected by `decoder_block`.
enum class DecoderBlock {
  Mixtral,  ///< generic top-k: weights = softmax over the K selected (biased) scores
  DeepSeek  ///< selection on biased scores, weights from pre-bias scores, groups, scaling
};

/// \brief Compute type of activations and matmul inputs (`dtype`, MaxText's meaning).
enum class ComputeDtype {
  Native,   ///< float32 / float64: everything in the layer's Scalar
  BFloat16  ///< bf16 activations and matmul inputs, fp32 accumulation (docs/precision.md)
};

template <class C>
class ConfigTable;

/// \brief Runtime configuration of one MoE layer. Field names are MaxText's config keys.
///
/// Fill it field by field or with set(key, value) (the YAML/CLI path); call validate() (the layer
/// does) to check every rule. Shapes that come from the data (batch, sequence) are not here.
struct LayerConfig {
  int num_experts = 8;          ///< E
  int num_experts_per_tok = 2;  ///< K (1 <= K <= E)
  int base_emb_dim = 64;        ///< D, model / MoE input dim
  int base_moe_mlp_dim = 128;   ///< F, expert hidden dim
  DecoderBlock decoder_block = DecoderBlock::Mixtral;
  ScoreFunc routed_score_func = ScoreFunc::None;
  bool routed_bias = false;            ///< learnable gate bias [E] added after the score function
  double routed_scaling_factor = 1.0;  ///< DeepSeek: weights are multiplied by it
  int n_routing_groups = -1;        ///< DeepSeek group-limited routing: number of groups (-1: off)
  int topk_routing_group = -1;      ///< DeepSeek: groups kept per token
  bool norm_topk_prob = false;      ///< generic path: renormalise the K weights to sum 1
  bool use_random_routing = false;  ///< experts drawn uniformly at random (seeded by `seed`)
  std::uint64_t seed = 0;           ///< seed of random routing
  double capacity_factor = -1.0;    ///< > 0: per-sequence expert capacity, drop the rest
  double load_balance_loss_weight = 0.0;         ///< Switch-style load-balance loss weight (0: off)
  double routed_bias_update_rate = 0.0;          ///< DeepSeek loss-free balancing rate (0: off)
  Activation mlp_activation = Activation::Silu;  ///< key `mlp_activations`
  int shared_experts = 0;     ///< shared expert of hidden size shared_experts * base_moe_mlp_dim
  bool sparse_matmul = true;  ///< false: dense masked path (every expert on every token)
  bool check_finite = true;   ///< reject NaN/Inf in x, dy and every weight a token reaches
  ComputeDtype dtype = ComputeDtype::Native;  ///< `dtype`: see ComputeDtype
  bool float32_weight_sum = true;             ///< bf16: the top-k combine takes fp32 weights
  bool float32_gate_logits = false;  ///< bf16: the gate matmul in fp32 (x, gate and logits)

  /// True when activations and matmul inputs are bf16 (dtype=bfloat16).
  bool bf16() const { return dtype == ComputeDtype::BFloat16; }

  /// Hidden size of the shared expert (0 when there is none).
  int shared_mlp_dim() const { return shared_experts * base_moe_mlp_dim; }

  /// Per-expert, per-sequence capacity C = int(max(ceil(S*K/E) * cf, cf)) for sequence length S,
  /// saturated at 2^31-1 so that a huge capacity_factor overflows neither int64 nor C * E.
  std::int64_t capacity(std::int64_t seq_len) const {
    double const base = std::ceil(double(seq_len) * num_experts_per_tok / num_experts);
    return static_cast<std::int64_t>(
        std::min(std::max(base * capacity_factor, capacity_factor), 2147483647.0));
  }

  /// The field table (moe/config.hpp defines it and the four below): every key, its type,
  /// describe() name, doc line and the rules.
  static inline ConfigTable<LayerConfig> const& table();

  /// Names of every key set() accepts.
  static inline std::vector<std::string> keys();

  /// True when `key` is one of keys().
  static inline bool has_key(std::string const& key);

  /// \brief Sets one key from its text form (YAML scalar or `key=value` override).
  /// Lists (for `mlp_activations`) are given comma-separated, e.g. `silu,linear`.
  /// \throws ConfigError for an unknown key or a value that does not parse.
  inline void set(std::string const& key, std::string const& value);

  /// \brief Checks every rule between the values; throws ConfigError naming the value and the rule.
  inline void validate() const;
};

}  // namespace moe
