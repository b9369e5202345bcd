#pragma once
// TrainConfig: every key of train_moe (MaxText names where MaxText has one), with the defaults of
// default.yml, parsing of `key=value` text, and validation.

#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace train {

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
  std::string dtype = "float32";        ///< float32 | float64
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

  // Logging.
  std::int64_t log_period = 10;
  std::string metrics_file;

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

  /// The driver's own keys (LayerConfig and ParallelConfig keys are accepted too).
  static std::vector<std::string> own_keys() {
    return {"steps",
            "per_device_batch_size",
            "max_target_length",
            "vocab_size",
            "context_length",
            "base_num_decoder_layers",
            "dtype",
            "normalization_layer_epsilon",
            "learning_rate",
            "warmup_steps",
            "warmup_steps_fraction",
            "learning_rate_schedule_steps",
            "cosine_learning_rate_final_fraction",
            "adam_b1",
            "adam_b2",
            "adam_eps",
            "adam_weight_decay",
            "weight_decay",
            "gradient_clipping_threshold",
            "grad_clip",
            "dataset_type",
            "dataset_path",
            "markov_order",
            "markov_branching",
            "enable_checkpointing",
            "checkpoint_period",
            "checkpoint_dir",
            "checkpoint_keep",
            "log_period",
            "metrics_file"};
  }

  /// Every key set() accepts: own_keys(), LayerConfig's and ParallelConfig's.
  static std::vector<std::string> all_keys() {
    auto k = own_keys();
    for (auto const& v : {moe::LayerConfig::keys(), moe::ParallelConfig::keys()})
      k.insert(k.end(), v.begin(), v.end());
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
    auto as_i64 = [&] { return std::int64_t(parse_int(key, value)); };
    auto as_int = [&] {
      long long const r = parse_int(key, value);
      if (r < -2147483647LL || r > 2147483647LL)
        throw moe::ConfigError(cat(key, "=", value, " does not fit in 32 bits"));
      return int(r);
    };
    auto as_double = [&] { return parse_double(key, value); };
    std::string canonical = key;
    if (key == "steps")
      steps = as_i64();
    else if (key == "per_device_batch_size")
      per_device_batch_size = as_double();
    else if (key == "max_target_length")
      max_target_length = as_i64();
    else if (key == "vocab_size")
      vocab_size = as_int();
    else if (key == "context_length")
      context_length = as_int();
    else if (key == "base_num_decoder_layers")
      base_num_decoder_layers = as_int();
    else if (key == "dtype") {
      dtype = trim(value);
      if (dtype != "float32" && dtype != "float64")
        throw moe::ConfigError(cat("dtype=", value, " is not supported (float32 | float64)"));
    } else if (key == "normalization_layer_epsilon")
      normalization_layer_epsilon = as_double();
    else if (key == "learning_rate")
      learning_rate = as_double();
    else if (key == "warmup_steps")
      warmup_steps = as_i64();
    else if (key == "warmup_steps_fraction")
      warmup_steps_fraction = as_double();
    else if (key == "learning_rate_schedule_steps")
      learning_rate_schedule_steps = as_i64();
    else if (key == "cosine_learning_rate_final_fraction")
      cosine_learning_rate_final_fraction = as_double();
    else if (key == "adam_b1")
      adam_b1 = as_double();
    else if (key == "adam_b2")
      adam_b2 = as_double();
    else if (key == "adam_eps")
      adam_eps = as_double();
    else if (key == "adam_weight_decay" || key == "weight_decay") {
      adam_weight_decay = as_double();
      canonical = "adam_weight_decay";
    } else if (key == "gradient_clipping_threshold" || key == "grad_clip") {
      gradient_clipping_threshold = as_double();
      canonical = "gradient_clipping_threshold";
    } else if (key == "dataset_type") {
      dataset_type = trim(value);
      if (dataset_type != "markov" && dataset_type != "synthetic" && dataset_type != "text")
        throw moe::ConfigError(
            cat("dataset_type=", value, " is not supported (markov | synthetic | text)"));
    } else if (key == "dataset_path")
      dataset_path = trim(value);
    else if (key == "markov_order")
      markov_order = as_int();
    else if (key == "markov_branching")
      markov_branching = as_int();
    else if (key == "enable_checkpointing")
      enable_checkpointing = parse_bool(key, value);
    else if (key == "checkpoint_period")
      checkpoint_period = as_i64();
    else if (key == "checkpoint_dir")
      checkpoint_dir = trim(value);
    else if (key == "checkpoint_keep")
      checkpoint_keep = as_int();
    else if (key == "log_period")
      log_period = as_i64();
    else if (key == "metrics_file")
      metrics_file = trim(value);
    else if (key == "seed") {
      layer.set(key, value);
      seed = layer.seed;
    } else if (moe::LayerConfig::has_key(key))
      layer.set(key, value);
    else if (moe::ParallelConfig::has_key(key)) {
      // A -1 the user gave stays (two given -1s are rejected by validate(), as in every tool);
      // only the default's -1 yields to the user's.
      if (key.rfind("ici_", 0) == 0 && trim(value) == "-1")
        for (auto const& [name, degree] : par.ici())
          if (degree == -1 && name != key && !given.count(name)) par.set(name, "1");
      par.set(key, value);
    } else
      throw moe::ConfigError(cat("unknown config key '", key, "' (value '", value,
                                 "'): train_moe takes its own keys (steps, "
                                 "per_device_batch_size, max_target_length, vocab_size, ...; see "
                                 "the README), the layer keys (num_experts, base_emb_dim, ...) and "
                                 "the parallelism keys (ici_*_parallelism, use_ring_of_experts, "
                                 "custom_mesh_and_rule, ...)",
                                 did_you_mean(key, all_keys())));
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

  /// \brief Checks every value and rule; ConfigError naming the key.
  void validate() const {
    using moe::detail::cat;
    auto req = [](bool ok, auto const&... msg) {
      if (!ok) throw moe::ConfigError(cat(msg...));
    };
    req(steps >= 0, "steps=", steps, " must be >= 0");
    req(per_device_batch_size > 0, "per_device_batch_size=", per_device_batch_size, " must be > 0");
    req(max_target_length >= 1, "max_target_length=", max_target_length, " must be >= 1");
    req(context_length >= 1, "context_length=", context_length, " must be >= 1");
    req(base_num_decoder_layers >= 1, "base_num_decoder_layers=", base_num_decoder_layers,
        " must be >= 1");
    req(normalization_layer_epsilon > 0,
        "normalization_layer_epsilon=", normalization_layer_epsilon, " must be > 0");
    req(learning_rate >= 0, "learning_rate=", learning_rate, " must be >= 0");
    req(warmup_steps >= -1, "warmup_steps=", warmup_steps, " must be >= 0 (or -1: use ",
        "warmup_steps_fraction)");
    req(warmup_steps_fraction >= 0 && warmup_steps_fraction <= 1,
        "warmup_steps_fraction=", warmup_steps_fraction, " must be in [0, 1]");
    req(learning_rate_schedule_steps == -1 || learning_rate_schedule_steps >= 1,
        "learning_rate_schedule_steps=", learning_rate_schedule_steps,
        " must be >= 1 (or -1: steps)");
    req(cosine_learning_rate_final_fraction >= 0 && cosine_learning_rate_final_fraction <= 1,
        "cosine_learning_rate_final_fraction=", cosine_learning_rate_final_fraction,
        " must be in [0, 1]");
    req(adam_b1 >= 0 && adam_b1 < 1, "adam_b1=", adam_b1, " must be in [0, 1)");
    req(adam_b2 >= 0 && adam_b2 < 1, "adam_b2=", adam_b2, " must be in [0, 1)");
    req(adam_eps > 0, "adam_eps=", adam_eps, " must be > 0");
    req(adam_weight_decay >= 0, "adam_weight_decay=", adam_weight_decay, " must be >= 0");
    req(gradient_clipping_threshold >= 0,
        "gradient_clipping_threshold=", gradient_clipping_threshold,
        " must be >= 0 (0: no clipping)");
    if (dataset_type == "text") {
      req(!dataset_path.empty(), "dataset_type=text needs dataset_path (a file whose bytes are ",
          "the tokens)");
      req(!given.count("vocab_size") || vocab_size == 256, "vocab_size=", vocab_size,
          " does not fit dataset_type=text, whose tokens are bytes (vocab_size 256)");
    } else {
      req(vocab_size >= 2, "vocab_size=", vocab_size, " must be >= 2");
    }
    if (dataset_type == "markov") {
      req(markov_order >= 1 && markov_order <= 8, "markov_order=", markov_order,
          " must be in [1, 8]");
      req(markov_branching >= 1 && markov_branching <= vocab_size,
          "markov_branching=", markov_branching, " must be in [1, vocab_size=", vocab_size, "]");
      req(std::pow(double(vocab_size), markov_order) <= double(1 << 22), "vocab_size^markov_order",
          " = ", std::pow(double(vocab_size), markov_order),
          " contexts is too many for the markov source (at most 2^22)");
    }
    req(checkpoint_period >= 1, "checkpoint_period=", checkpoint_period, " must be >= 1");
    req(checkpoint_keep >= 1, "checkpoint_keep=", checkpoint_keep, " must be >= 1");
    req(!enable_checkpointing || !checkpoint_dir.empty(),
        "enable_checkpointing=true needs a checkpoint_dir");
    req(log_period >= 1, "log_period=", log_period, " must be >= 1");
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
            {"warmup", n(warmup())}};
  }

  /// A canonical text of every field (ranks must agree on it).
  std::string describe() const {
    std::string s = moe::describe(layer) + "|" + par.describe();
    auto add = [&](char const* k, auto const& v) {
      std::ostringstream os;
      os.precision(17);
      os << v;
      s += std::string("|") + k + "=" + os.str();
    };
    add("steps", steps), add("pdbs", per_device_batch_size), add("S", max_target_length);
    add("V", vocab_size), add("C", context_length), add("L", base_num_decoder_layers);
    add("dtype", dtype), add("eps", normalization_layer_epsilon), add("seed", seed);
    add("lr", learning_rate), add("warmup", warmup_steps), add("warmup_f", warmup_steps_fraction);
    add("sched", learning_rate_schedule_steps), add("final", cosine_learning_rate_final_fraction);
    add("b1", adam_b1), add("b2", adam_b2), add("aeps", adam_eps), add("wd", adam_weight_decay);
    add("clip", gradient_clipping_threshold), add("data", dataset_type), add("path", dataset_path);
    add("order", markov_order), add("branch", markov_branching);
    add("ckpt", enable_checkpointing), add("period", checkpoint_period);
    add("dir", checkpoint_dir), add("keep", checkpoint_keep), add("log", log_period);
    add("metrics", metrics_file);
    return s;
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
