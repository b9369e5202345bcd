#pragma once
/// \file
/// LayerConfig: the runtime hyper-parameters of one MoE layer, under MaxText's key names.

#include <moe/error.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <sstream>
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

  /// Hidden size of the shared expert (0 when there is none).
  int shared_mlp_dim() const { return shared_experts * base_moe_mlp_dim; }

  /// Per-expert, per-sequence capacity C = int(max(ceil(S*K/E) * cf, cf)) for sequence length S,
  /// saturated at 2^31-1 (more slots than any sequence routes to one expert), so a huge
  /// capacity_factor neither overflows the conversion nor C * E.
  std::int64_t capacity(std::int64_t seq_len) const {
    double const base = std::ceil(double(seq_len) * num_experts_per_tok / num_experts);
    return static_cast<std::int64_t>(
        std::min(std::max(base * capacity_factor, capacity_factor), 2147483647.0));
  }

  /// Names of every key set() accepts.
  static std::vector<std::string> keys() {
    return {"num_experts",
            "num_experts_per_tok",
            "base_emb_dim",
            "base_moe_mlp_dim",
            "decoder_block",
            "routed_score_func",
            "routed_bias",
            "routed_scaling_factor",
            "n_routing_groups",
            "topk_routing_group",
            "norm_topk_prob",
            "use_random_routing",
            "seed",
            "capacity_factor",
            "load_balance_loss_weight",
            "routed_bias_update_rate",
            "mlp_activations",
            "shared_experts",
            "sparse_matmul",
            "check_finite"};
  }

  /// True when `key` is one of keys().
  static bool has_key(std::string const& key) {
    for (auto const& k : keys())
      if (k == key) return true;
    return false;
  }

  /// \brief Sets one key from its text form (YAML scalar or `key=value` override).
  /// Lists (for `mlp_activations`) are given comma-separated, e.g. `silu,linear`.
  /// \throws ConfigError for an unknown key or a value that does not parse.
  void set(std::string const& key, std::string const& value);

  /// \brief Checks every rule between the values; throws ConfigError naming the value and the rule.
  void validate() const;
};

namespace detail {

inline std::string trim(std::string s) {
  auto const b = s.find_first_not_of(" \t\r\n\"'");
  auto const e = s.find_last_not_of(" \t\r\n\"'");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

/// \brief "[a, b, c]": the text of a shape (or an offset) in messages.
inline std::string shape_text(std::vector<std::int64_t> const& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

/// \brief min(cap, int(rows * factor)) for factor > 0, computed so that no huge factor
/// overflows the conversion (the ragged receive buffer's row count).
inline std::int64_t scaled_rows(std::int64_t rows, double factor, std::int64_t cap) {
  double const want = static_cast<double>(rows) * factor;
  return want < static_cast<double>(cap) ? static_cast<std::int64_t>(want) : cap;
}

/// \brief The candidate closest to `name` when it is a plausible misspelling (case-insensitive
/// Levenshtein distance at most max(1, |name|/4), or equal ignoring case), else "".
inline std::string nearest(std::string const& name, std::vector<std::string> const& candidates) {
  auto lower = [](std::string s) {
    for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  std::string const a = lower(name);
  std::string best;
  std::size_t best_d = std::max<std::size_t>(1, a.size() / 4) + 1;
  for (auto const& cand : candidates) {
    std::string const b = lower(cand);
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        std::size_t const up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    if (row[b.size()] < best_d) best_d = row[b.size()], best = cand;
  }
  return best;
}

/// \brief " (did you mean 'x'?)" for the nearest() candidate, or "" when none is close.
inline std::string did_you_mean(std::string const& name,
                                std::vector<std::string> const& candidates) {
  std::string const n = nearest(name, candidates);
  return n.empty() ? std::string() : cat(" (did you mean '", n, "'?)");
}

inline long long parse_int(std::string const& key, std::string const& v) {
  std::string const t = trim(v);
  std::size_t pos = 0;
  long long r = 0;
  try {
    r = std::stoll(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (t.empty() || pos != t.size()) throw ConfigError(cat(key, "=", v, " is not an integer"));
  return r;
}

inline double parse_double(std::string const& key, std::string const& v) {
  std::string const t = trim(v);
  std::size_t pos = 0;
  double r = 0;
  try {
    r = std::stod(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (t.empty() || pos != t.size() || !std::isfinite(r))
    throw ConfigError(cat(key, "=", v, " is not a finite number"));
  return r;
}

inline bool parse_bool(std::string const& key, std::string const& v) {
  std::string t = trim(v);
  for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  throw ConfigError(cat(key, "=", v, " is not a boolean (true or false)"));
}

inline std::vector<std::string> split_list(std::string const& v) {
  std::string t = trim(v);
  if (!t.empty() && t.front() == '[') t = t.substr(1);
  if (!t.empty() && t.back() == ']') t.pop_back();
  std::vector<std::string> out;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(trim(item));
  return out;
}

}  // namespace detail

inline void LayerConfig::set(std::string const& key, std::string const& value) {
  using namespace detail;
  auto as_int = [&] {
    long long const r = parse_int(key, value);
    if (r < -2147483647LL || r > 2147483647LL)
      throw ConfigError(cat(key, "=", value, " does not fit in 32 bits"));
    return static_cast<int>(r);
  };
  if (key == "num_experts")
    num_experts = as_int();
  else if (key == "num_experts_per_tok")
    num_experts_per_tok = as_int();
  else if (key == "base_emb_dim")
    base_emb_dim = as_int();
  else if (key == "base_moe_mlp_dim")
    base_moe_mlp_dim = as_int();
  else if (key == "decoder_block") {
    std::string const t = trim(value);
    if (t == "mixtral")
      decoder_block = DecoderBlock::Mixtral;
    else if (t == "deepseek")
      decoder_block = DecoderBlock::DeepSeek;
    else
      throw ConfigError(cat("decoder_block=", value, " is not supported (mixtral | deepseek)"));
  } else if (key == "routed_score_func") {
    std::string const t = trim(value);
    if (t.empty() || t == "none" || t == "None" || t == "null")
      routed_score_func = ScoreFunc::None;
    else if (t == "softmax")
      routed_score_func = ScoreFunc::Softmax;
    else if (t == "sigmoid")
      routed_score_func = ScoreFunc::Sigmoid;
    else if (t == "sqrtsoftplus")
      routed_score_func = ScoreFunc::SqrtSoftplus;
    else
      throw ConfigError(cat("routed_score_func=", value,
                            " is not supported (\"\" | softmax | sigmoid | sqrtsoftplus)"));
  } else if (key == "routed_bias")
    routed_bias = parse_bool(key, value);
  else if (key == "routed_scaling_factor")
    routed_scaling_factor = parse_double(key, value);
  else if (key == "n_routing_groups")
    n_routing_groups = as_int();
  else if (key == "topk_routing_group")
    topk_routing_group = as_int();
  else if (key == "norm_topk_prob")
    norm_topk_prob = parse_bool(key, value);
  else if (key == "use_random_routing")
    use_random_routing = parse_bool(key, value);
  else if (key == "seed") {
    long long const r = parse_int(key, value);
    if (r < 0) throw ConfigError(cat("seed=", value, " must be >= 0"));
    seed = static_cast<std::uint64_t>(r);
  } else if (key == "capacity_factor")
    capacity_factor = parse_double(key, value);
  else if (key == "load_balance_loss_weight")
    load_balance_loss_weight = parse_double(key, value);
  else if (key == "routed_bias_update_rate")
    routed_bias_update_rate = parse_double(key, value);
  else if (key == "mlp_activations") {
    auto const items = split_list(value);
    if (items.empty() || items.size() > 2 || (items.size() == 2 && items[1] != "linear"))
      throw ConfigError(
          cat("mlp_activations=", value, " is not supported ([silu, linear] | [gelu, linear])"));
    if (items[0] == "silu")
      mlp_activation = Activation::Silu;
    else if (items[0] == "gelu")
      mlp_activation = Activation::Gelu;
    else
      throw ConfigError(cat("mlp_activations=", value, ": activation '", items[0],
                            "' is not supported (silu | gelu)"));
  } else if (key == "shared_experts")
    shared_experts = as_int();
  else if (key == "sparse_matmul")
    sparse_matmul = parse_bool(key, value);
  else if (key == "check_finite")
    check_finite = parse_bool(key, value);
  else
    throw ConfigError(cat("unknown config key '", key, "' (value ", value, ")",
                          detail::did_you_mean(key, keys())));
}

inline void LayerConfig::validate() const {
  using detail::cat;
  auto req = [](bool ok, auto const&... msg) {
    if (!ok) throw ConfigError(cat(msg...));
  };
  req(num_experts >= 1, "num_experts=", num_experts, " must be >= 1");
  req(num_experts_per_tok >= 1, "num_experts_per_tok=", num_experts_per_tok, " must be >= 1");
  req(num_experts_per_tok <= num_experts, "num_experts_per_tok=", num_experts_per_tok,
      " must be <= num_experts=", num_experts);
  req(base_emb_dim >= 1, "base_emb_dim=", base_emb_dim, " must be >= 1");
  req(base_moe_mlp_dim >= 1, "base_moe_mlp_dim=", base_moe_mlp_dim, " must be >= 1");
  req(shared_experts >= 0, "shared_experts=", shared_experts, " must be >= 0");
  req(load_balance_loss_weight >= 0, "load_balance_loss_weight=", load_balance_loss_weight,
      " must be >= 0");
  req(routed_bias_update_rate >= 0, "routed_bias_update_rate=", routed_bias_update_rate,
      " must be >= 0");
  if (n_routing_groups != -1) {
    req(decoder_block == DecoderBlock::DeepSeek, "n_routing_groups=", n_routing_groups,
        " (group-limited routing) requires decoder_block=deepseek");
    req(n_routing_groups >= 1 && n_routing_groups <= 64, "n_routing_groups=", n_routing_groups,
        " must be -1 or in [1, 64]");
    req(num_experts % n_routing_groups == 0, "num_experts=", num_experts,
        " is not divisible by n_routing_groups=", n_routing_groups);
    req(topk_routing_group >= 1 && topk_routing_group <= n_routing_groups,
        "topk_routing_group=", topk_routing_group,
        " must be in [1, n_routing_groups=", n_routing_groups, "]");
    req(long(topk_routing_group) * (num_experts / n_routing_groups) >= num_experts_per_tok,
        "topk_routing_group=", topk_routing_group, " groups of ", num_experts / n_routing_groups,
        " experts hold fewer than num_experts_per_tok=", num_experts_per_tok, " experts");
  } else {
    req(topk_routing_group == -1, "topk_routing_group=", topk_routing_group,
        " is set but n_routing_groups=-1 (group-limited routing is off)");
  }
  if (routed_bias_update_rate > 0) {
    req(decoder_block == DecoderBlock::DeepSeek && routed_bias,
        "routed_bias_update_rate=", routed_bias_update_rate,
        " (loss-free balancing) requires decoder_block=deepseek and routed_bias=true");
  }
  req(routed_scaling_factor > 0, "routed_scaling_factor=", routed_scaling_factor, " must be > 0");
}

}  // namespace moe
