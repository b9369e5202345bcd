#pragma once
// TrainConfig: every key of train_moe (MaxText names where MaxText has one), with the defaults of
// default.yml, parsing of `key=value` text, and validation.

#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace train {

/// The items of a comma-separated list ("" and "none": none).
inline std::vector<std::string> comma_list(std::string const& text) {
  std::vector<std::string> out;
  if (text.empty() || text == "none") return out;
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t const comma = std::min(text.find(',', at), text.size());
    out.push_back(text.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

/// The signals save_on_signal may name.
inline constexpr std::pair<char const*, int> kStopSignals[] = {
    {"SIGTERM", SIGTERM}, {"SIGINT", SIGINT}, {"SIGHUP", SIGHUP}, {"SIGUSR1", SIGUSR1}};

/// The signals a save_on_signal value names (SIGTERM, SIGINT, SIGHUP, SIGUSR1, comma-separated;
/// "none" or "" for none); nothing if it names anything else.
inline std::optional<std::vector<int>> stop_signal_numbers(std::string const& text) {
  std::vector<int> out;
  for (auto const& name : comma_list(text)) {
    auto const it = std::find_if(std::begin(kStopSignals), std::end(kStopSignals),
                                 [&](auto const& s) { return name == s.first; });
    if (it == std::end(kStopSignals)) return std::nullopt;
    out.push_back(it->second);
  }
  return out;
}

/// "SIGTERM" for SIGTERM, ... ("signal N" for a signal save_on_signal cannot name).
inline std::string signal_name(int sig) {
  for (auto const& [name, number] : kStopSignals)
    if (number == sig) return name;
  return "signal " + std::to_string(sig);
}

/// \brief The configuration of one training run.
///
/// Keys: the driver's own (below), every moe::LayerConfig key (num_experts, base_emb_dim, ...)
/// and every moe::ParallelConfig key (ici_*_parallelism, use_ring_of_experts, ...). The field
/// defaults equal examples/train_moe/default.yml.
struct TrainConfig {
  moe::LayerConfig layer = default_layer();
  moe::ParallelConfig par = default_par();

  // Run and model shape.
  std::int64_t steps = 400;             ///< optimizer steps
  double per_device_batch_size = 8;     ///< global batch = this x number of ranks (MaxText)
  std::int64_t max_target_length = 64;  ///< S, tokens per sequence the model predicts
  int vocab_size = 16;                  ///< V (dataset_type=text: 256)
  int context_length = 4;               ///< C, window of the causal token mixing
  int base_num_decoder_layers = 2;      ///< residual MoE blocks
  /// float32 | float64 | bfloat16 (the MoE layers' compute; everything else float32)
  std::string dtype = "float32";
  std::string weight_dtype = "float32";  ///< parameters: float32 | bfloat16 | float64
  std::string grad_dtype = "float32";    ///< gradients: float32 (float64 with dtype=float64)
  std::string mu_dtype;                  ///< AdamW first moment: "" (weight_dtype) | ...
  double normalization_layer_epsilon = 1e-5;
  std::uint64_t seed = 0;  ///< initialisation, data and random routing

  // Optimizer: AdamW with linear warm-up and cosine decay, global-norm clipping.
  double learning_rate = 3e-3;                     ///< peak learning rate
  std::int64_t warmup_steps = -1;                  ///< >= 0: warm-up steps (else the fraction)
  double warmup_steps_fraction = 0.1;              ///< warm-up as a fraction of the schedule
  std::int64_t learning_rate_schedule_steps = -1;  ///< schedule length (-1: steps)
  double cosine_learning_rate_final_fraction = 0.1;
  double adam_b1 = 0.9, adam_b2 = 0.95, adam_eps = 1e-8;
  double adam_weight_decay = 0.01;           ///< alias weight_decay; not on norms and biases
  double gradient_clipping_threshold = 1.0;  ///< alias grad_clip; 0 turns clipping off

  // Data.
  std::string dataset_type = "markov";  ///< markov | synthetic | text
  std::string dataset_path;             ///< the file of dataset_type=text
  int markov_order = 2;
  int markov_branching = 3;

  // Checkpoints.
  bool enable_checkpointing = false;
  std::int64_t checkpoint_period = 100;
  std::string checkpoint_dir = "checkpoints";
  int checkpoint_keep = 3;
  /// After the last step, every parameter gathered whole and rounded to BF16 into this
  /// safetensors file (an inference copy; checkpoints keep F32). Empty: none.
  std::string export_bf16;

  // Logging.
  std::int64_t log_period = 10;
  std::string metrics_file;

  // Preemption.
  /// Signals that stop the run at the next step boundary with a checkpoint (comma-separated
  /// subset of SIGTERM, SIGINT, SIGHUP, SIGUSR1; "none": each of them ends the run at once).
  std::string save_on_signal = "SIGTERM,SIGINT,SIGHUP,SIGUSR1";
  /// Model keys (and `dataset_hash`) a resume may find changed (comma-separated); any other
  /// difference from the checkpoint is refused.
  std::string resume_allow_changed;
  /// Longest wait of one rank in one MPI call, seconds (0: no limit): longer, and train_moe ends
  /// the job naming the call and the ranks that are elsewhere (kExitWatchdog).
  double collective_timeout_s = 600;

  /// Keys given explicitly through set() (their canonical names).
  std::set<std::string> given;

  static moe::LayerConfig default_layer() {
    moe::LayerConfig c;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.base_emb_dim = 64;
    c.base_moe_mlp_dim = 128;
    c.load_balance_loss_weight = 0.01;
    return c;
  }
  static moe::ParallelConfig default_par() {
    moe::ParallelConfig p;
    p.ici_expert_parallelism = -1;
    return p;
  }

  /// \brief The table of the driver's own keys (LayerConfig and ParallelConfig keys are accepted
  /// too, through their tables): parsing, describe() and the rules of validate().
  static inline moe::ConfigTable<TrainConfig> const& table();

  /// The driver's own keys (and aliases); LayerConfig and ParallelConfig keys are accepted too.
  static std::vector<std::string> own_keys() { return table().keys(); }

  /// Every key set() accepts: own_keys(), then LayerConfig's and ParallelConfig's not among them
  /// (`seed` is the driver's: it sets the layer's routing seed too).
  static std::vector<std::string> all_keys() {
    auto k = own_keys();
    for (auto const& v : {moe::LayerConfig::keys(), moe::ParallelConfig::keys()})
      for (auto const& key : v)
        if (std::find(k.begin(), k.end(), key) == k.end()) k.push_back(key);
    return k;
  }

  /// \brief Sets one key from its text form. ConfigError naming the key for an unknown key or a
  /// value that does not parse. `seed` sets the driver's seed and the layer's routing seed.
  ///
  /// Only one ici_*_parallelism degree can be -1 (fill): setting one to -1 turns the default's
  /// -1 (ici_expert_parallelism, unless the user set it) into 1, so `ici_fsdp_parallelism=-1`
  /// alone switches the default layout to FSDP; two -1s the user gave are an error (validate()).
  void set(std::string const& key, std::string const& value) {
    using namespace moe::detail;
    std::string canonical = key;
    if (auto const* f = table().find(key)) {
      f->parse(*this, key, value);
      canonical = f->key;
    } else if (moe::LayerConfig::has_key(key)) {
      layer.set(key, value);
    } else if (moe::ParallelConfig::has_key(key)) {
      // A -1 the user gave stays (two given -1s are rejected by validate(), as in every tool);
      // only the default's -1 yields to the user's.
      if (key.rfind("ici_", 0) == 0 && trim(value) == "-1")
        for (auto const& [name, degree] : par.ici())
          if (degree == -1 && name != key && !given.count(name)) par.set(name, "1");
      par.set(key, value);
    } else {
      throw moe::ConfigError(cat("unknown config key '", key, "' (value '", value,
                                 "'): train_moe takes its own keys (steps, "
                                 "per_device_batch_size, max_target_length, vocab_size, ...; see "
                                 "the README), the layer keys (num_experts, base_emb_dim, ...) and "
                                 "the parallelism keys (ici_*_parallelism, use_ring_of_experts, "
                                 "custom_mesh_and_rule, ...)",
                                 did_you_mean(key, all_keys())));
    }
    given.insert(canonical);
  }

  /// Applies ordered (key, value) pairs.
  void apply(std::vector<std::pair<std::string, std::string>> const& kv) {
    for (auto const& [k, v] : kv) set(k, v);
  }

  /// Warm-up steps in effect.
  std::int64_t warmup() const {
    if (warmup_steps >= 0) return warmup_steps;
    return std::int64_t(std::llround(warmup_steps_fraction * double(schedule_steps())));
  }
  /// Length of the learning-rate schedule in effect.
  std::int64_t schedule_steps() const {
    return learning_rate_schedule_steps > 0 ? learning_rate_schedule_steps : steps;
  }
  /// Vocabulary in effect (dataset_type=text: 256 bytes).
  int vocab() const { return dataset_type == "text" ? 256 : vocab_size; }
  /// The AdamW first moment's storage in effect (mu_dtype, or weight_dtype when it is "").
  std::string const& mu_storage() const { return mu_dtype.empty() ? weight_dtype : mu_dtype; }
  /// Whether the parameters are kept rounded to bf16 after every update (weight_dtype=bfloat16).
  bool bf16_weights() const { return weight_dtype == "bfloat16"; }
  /// Whether AdamW's first moment is stored as 16-bit moe::bf16 (mu_dtype, MaxText's meaning).
  bool bf16_mu() const { return mu_storage() == "bfloat16"; }
  /// \brief Whether AdamW's second moment is stored as 16-bit moe::bf16. MaxText stores nu in
  /// the parameters' dtype (base.yml: "nu_dtype is always inherited from weights"; optax's
  /// mu_dtype casts mu only): with weight_dtype=bfloat16 that is bf16.
  bool bf16_nu() const { return bf16_weights(); }

  /// \brief Checks every value and rule (the table's, then the layer's and the parallelism's);
  /// ConfigError naming the key.
  void validate() const {
    table().validate(*this);
    layer.validate();
    par.validate();
  }

  /// The model-defining keys (a checkpoint must match them) as (key, value) text.
  std::vector<std::pair<std::string, std::string>> architecture() const {
    auto n = [](auto v) { return std::to_string(v); };
    return {{"vocab_size", n(vocab())},
            {"context_length", n(context_length)},
            {"base_num_decoder_layers", n(base_num_decoder_layers)},
            {"base_emb_dim", n(layer.base_emb_dim)},
            {"base_moe_mlp_dim", n(layer.base_moe_mlp_dim)},
            {"num_experts", n(layer.num_experts)},
            {"shared_experts", n(layer.shared_experts)},
            {"routed_bias", n(layer.routed_bias)},
            {"dtype", dtype}};
  }
  /// architecture() and every other layer key that changes what the model computes (routing,
  /// activations, capacity, ...; not seed, check_finite, sparse_matmul and the two training
  /// rates): the keys a resume compares. A checkpoint that does not record one of the keys after
  /// the first nine (written before they were recorded) is not compared on it.
  std::vector<std::pair<std::string, std::string>> model_keys() const {
    auto keys = architecture();
    std::set<std::string> skip = {"seed", "check_finite", "sparse_matmul",
                                  "load_balance_loss_weight", "routed_bias_update_rate"};
    for (auto const& [k, v] : keys) skip.insert(k);
    for (auto const& f : moe::LayerConfig::table().fields())
      if (skip.count(f.key) == 0) keys.emplace_back(f.key, f.text(layer));
    return keys;
  }
  /// Keys that make a resumed run the continuation of the same run (a difference is reported).
  std::vector<std::pair<std::string, std::string>> run_identity(int ranks) const {
    auto n = [](auto v) { return std::to_string(v); };
    return {{"seed", n(seed)},
            {"dataset_type", dataset_type},
            {"dataset_path", dataset_path},
            {"markov_order", n(markov_order)},
            {"markov_branching", n(markov_branching)},
            {"max_target_length", n(max_target_length)},
            {"global_batch", n(per_device_batch_size * ranks)},
            {"learning_rate", n(learning_rate)},
            {"schedule_steps", n(schedule_steps())},
            {"warmup", n(warmup())},
            {"weight_dtype", weight_dtype},
            {"mu_dtype", mu_storage()}};
  }

  /// A canonical text of every field (ranks must agree on it).
  std::string describe() const {
    return moe::describe(layer) + "|" + par.describe() + "|" + table().describe(*this);
  }
};

/// Learning rate of step `step` (0-based): linear warm-up to learning_rate over warmup() steps,
/// then cosine decay to cosine_learning_rate_final_fraction x learning_rate at schedule_steps().
inline double learning_rate_at(TrainConfig const& c, std::int64_t step) {
  std::int64_t const W = c.warmup(), N = c.schedule_steps();
  if (step < W) return c.learning_rate * double(step + 1) / double(W);
  double const span = double(std::max<std::int64_t>(1, N - W));
  double const progress = std::min(1.0, double(step - W) / span);
  double const f = c.cosine_learning_rate_final_fraction;
  return c.learning_rate * (f + (1 - f) * 0.5 * (1 + std::cos(3.141592653589793 * progress)));
}

}  // namespace train

#include "config_table.hpp"  // TrainConfig::table(): every key, its default and its rules
