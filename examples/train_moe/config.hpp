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

inline moe::ConfigTable<TrainConfig> const& TrainConfig::table() {
  using C = TrainConfig;
  static moe::ConfigTable<C> const t = [] {
    using moe::detail::cat;
    moe::ConfigTable<C> t(moe::DescribeNumbers::Precise, "|");
    // Fields, in describe() order.
    t.field("steps", &C::steps, "steps", "optimizer steps (the run stops there)");
    t.field("per_device_batch_size", &C::per_device_batch_size, "pdbs",
            "sequences per rank; global batch = this x ranks (must be whole)");
    t.field("max_target_length", &C::max_target_length, "S",
            "tokens predicted per sequence (S; each sequence has S + 1 tokens)");
    t.field("vocab_size", &C::vocab_size, "V", "V (dataset_type=text: 256)");
    t.field("context_length", &C::context_length, "C", "window C of the causal token mixing");
    t.field("base_num_decoder_layers", &C::base_num_decoder_layers, "L", "MoE blocks");
    t.choice("dtype", &C::dtype, "dtype",
             {{"float32", std::string("float32")},
              {"float64", std::string("float64")},
              {"bfloat16", std::string("bfloat16")}},
             "float32 | float64: the whole run's type; bfloat16: the MoE layers compute in bf16 "
             "(docs/precision.md), everything else (embedding, norms, token mixing, LM head, "
             "loss, optimizer) in float32");
    {
      // train_moe's dtype shadows the layer's key: it sets the layer's compute type too (float32
      // and float64 are the layer's Native: the run's Scalar).
      auto const own = t.fields().back().parse;
      t.parse_with([own](C& c, std::string const& key, std::string const& value) {
        own(c, key, value);
        c.layer.dtype =
            c.dtype == "bfloat16" ? moe::ComputeDtype::BFloat16 : moe::ComputeDtype::Native;
      });
    }
    t.choice("weight_dtype", &C::weight_dtype, "wdtype",
             {{"float32", std::string("float32")},
              {"bfloat16", std::string("bfloat16")},
              {"float64", std::string("float64")}},
             "parameter storage (MaxText): bfloat16 keeps every parameter rounded to bf16 after "
             "each update (dtype=bfloat16 only); float64 with dtype=float64 only");
    t.choice("grad_dtype", &C::grad_dtype, "gdtype",
             {{"float32", std::string("float32")},
              {"bfloat16", std::string("bfloat16")},
              {"float64", std::string("float64")}},
             "gradient accumulation and reduction (MaxText): float32 (float64 with dtype=float64)");
    t.choice("mu_dtype", &C::mu_dtype, "mudtype",
             {{"", std::string()},
              {"float32", std::string("float32")},
              {"bfloat16", std::string("bfloat16")},
              {"float64", std::string("float64")}},
             "AdamW first-moment storage (MaxText): \"\" = weight_dtype; bfloat16: a 16-bit "
             "array (the update in float, mu rounded when stored); the second moment is stored "
             "as the weights are");
    t.field("normalization_layer_epsilon", &C::normalization_layer_epsilon, "eps",
            "RMSNorm epsilon");
    t.field("seed", &C::seed, "seed", "initialisation, data and random routing")
        .parse_with([](C& c, std::string const& key, std::string const& value) {
          c.layer.set(key, value);  // the layer's routing seed too
          c.seed = c.layer.seed;
        });
    t.field("learning_rate", &C::learning_rate, "lr", "peak learning rate");
    t.field("warmup_steps", &C::warmup_steps, "warmup",
            "warm-up steps (-1: warmup_steps_fraction of the schedule)");
    t.field("warmup_steps_fraction", &C::warmup_steps_fraction, "warmup_f",
            "warm-up as a fraction of the schedule (when warmup_steps=-1)");
    t.field("learning_rate_schedule_steps", &C::learning_rate_schedule_steps, "sched",
            "schedule length (-1: steps)");
    t.field("cosine_learning_rate_final_fraction", &C::cosine_learning_rate_final_fraction, "final",
            "final learning rate / peak");
    t.field("adam_b1", &C::adam_b1, "b1", "AdamW first moment decay");
    t.field("adam_b2", &C::adam_b2, "b2", "AdamW second moment decay");
    t.field("adam_eps", &C::adam_eps, "aeps", "AdamW epsilon");
    t.field("adam_weight_decay", &C::adam_weight_decay, "wd",
            "decoupled weight decay, not on norm scales and gate_bias")
        .alias("weight_decay");
    t.field("gradient_clipping_threshold", &C::gradient_clipping_threshold, "clip",
            "global-norm gradient clipping (0: off)")
        .alias("grad_clip");
    t.choice("dataset_type", &C::dataset_type, "data",
             {{"markov", std::string("markov")},
              {"synthetic", std::string("synthetic")},
              {"text", std::string("text")}},
             "the token source");
    t.field("dataset_path", &C::dataset_path, "path", "the file of dataset_type=text");
    t.field("markov_order", &C::markov_order, "order", "Markov source: context length");
    t.field("markov_branching", &C::markov_branching, "branch",
            "Markov source: next tokens per context");
    t.field("enable_checkpointing", &C::enable_checkpointing, "ckpt", "save and resume");
    t.field("checkpoint_period", &C::checkpoint_period, "period", "steps between checkpoints");
    t.field("checkpoint_dir", &C::checkpoint_dir, "dir", "directory of the checkpoints");
    t.field("checkpoint_keep", &C::checkpoint_keep, "keep", "checkpoints kept");
    t.field("export_bf16", &C::export_bf16, "export",
            "after the last step, the parameters as one BF16 safetensors file (inference copy)");
    t.field("log_period", &C::log_period, "log", "steps between printed lines");
    t.field("metrics_file", &C::metrics_file, "metrics", "JSON-lines metrics (rank 0)");
    t.field("save_on_signal", &C::save_on_signal, "sig",
            "signals that stop at the next step with a checkpoint (exit 75)");
    t.field("resume_allow_changed", &C::resume_allow_changed, "allow",
            "model keys (or dataset_hash) a resume may change, comma-separated");
    t.field("collective_timeout_s", &C::collective_timeout_s, "timeout",
            "longest wait in one MPI call before the job ends (0: none)");

    // Rules, in the order validate() checks them (then the layer's and the parallelism's).
    auto in01 = [](double v) { return v >= 0 && v <= 1; };
    t.at_least(&C::steps, 0);
    t.greater_than(&C::per_device_batch_size, 0.0);
    t.at_least(&C::collective_timeout_s, 0.0);
    t.at_least(&C::max_target_length, 1);
    t.at_least(&C::context_length, 1);
    t.at_least(&C::base_num_decoder_layers, 1);
    t.greater_than(&C::normalization_layer_epsilon, 0.0);
    t.at_least(&C::learning_rate, 0.0);
    t.rule(&C::warmup_steps, "must be >= 0 (or -1: use warmup_steps_fraction)",
           [](std::int64_t v) { return v >= -1; });
    t.rule(&C::warmup_steps_fraction, "must be in [0, 1]", in01);
    t.rule(&C::learning_rate_schedule_steps, "must be >= 1 (or -1: steps)",
           [](std::int64_t v) { return v == -1 || v >= 1; });
    t.rule(&C::cosine_learning_rate_final_fraction, "must be in [0, 1]", in01);
    t.rule(&C::adam_b1, "must be in [0, 1)", [](double v) { return v >= 0 && v < 1; });
    t.rule(&C::adam_b2, "must be in [0, 1)", [](double v) { return v >= 0 && v < 1; });
    t.greater_than(&C::adam_eps, 0.0);
    t.at_least(&C::adam_weight_decay, 0.0);
    t.rule(&C::gradient_clipping_threshold, "must be >= 0 (0: no clipping)",
           [](double v) { return v >= 0; });
    t.check(&C::weight_dtype, "bfloat16 needs dtype=bfloat16, float64 needs dtype=float64",
            [](C const& c) {
              auto const& w = c.weight_dtype;
              moe::detail::require<moe::ConfigError>(
                  w != "bfloat16" || c.dtype == "bfloat16",
                  "weight_dtype=bfloat16 with dtype=", c.dtype, " (bf16 weights with ",
                  c.dtype == "float64" ? "fp64" : "fp32",
                  " compute): bf16 weights need dtype=bfloat16; use weight_dtype=",
                  c.dtype == "float64" ? "float64" : "float32", " or dtype=bfloat16");
              moe::detail::require<moe::ConfigError>(
                  w != "float64" || c.dtype == "float64",
                  "weight_dtype=float64 with dtype=", c.dtype, " (fp64 weights with ",
                  c.dtype == "bfloat16" ? "bf16" : "fp32",
                  " compute): float64 weights need dtype=float64; use weight_dtype=float32 or "
                  "dtype=float64");
            });
    t.check(&C::grad_dtype, "float32 (float64 with dtype=float64)", [](C const& c) {
      moe::detail::require<moe::ConfigError>(
          c.grad_dtype != "bfloat16",
          "grad_dtype=bfloat16 is not supported: moe accumulates and reduces gradients in "
          "float32 (the weight-gradient GEMMs accumulate in fp32 and the all-reduces sum fp32); "
          "use grad_dtype=float32");
      moe::detail::require<moe::ConfigError>(
          c.grad_dtype != "float64" || c.dtype == "float64",
          "grad_dtype=float64 with dtype=", c.dtype, " (fp64 gradients with ",
          c.dtype == "bfloat16" ? "bf16" : "fp32",
          " compute): float64 gradients need dtype=float64; use grad_dtype=float32");
    });
    t.check(&C::mu_dtype, "bfloat16 needs dtype=float32 or bfloat16; float64 needs dtype=float64",
            [](C const& c) {
              moe::detail::require<moe::ConfigError>(
                  c.mu_dtype != "bfloat16" || c.dtype != "float64",
                  "mu_dtype=bfloat16 with dtype=float64 (bf16 moments with fp64 compute): a "
                  "float64 run is the reference and keeps its moments in float64; use "
                  "mu_dtype=\"\" or dtype=float32 / bfloat16");
              moe::detail::require<moe::ConfigError>(
                  c.mu_dtype != "float64" || c.dtype == "float64",
                  "mu_dtype=float64 with dtype=", c.dtype, " (fp64 moments with ",
                  c.dtype == "bfloat16" ? "bf16" : "fp32",
                  " compute): float64 moments need dtype=float64; use mu_dtype=float32");
            });
    t.check(
        "with dtype=float32 or bfloat16 (float storage), the real-valued keys stay nonzero, "
        "normal and finite in float32",
        [](C const& c) {
          if (c.dtype == "float64") return;
          for (auto const& [key, v] :
               {std::pair<char const*, double>{"learning_rate", c.learning_rate},
                {"adam_eps", c.adam_eps},
                {"adam_weight_decay", c.adam_weight_decay},
                {"normalization_layer_epsilon", c.normalization_layer_epsilon},
                {"gradient_clipping_threshold", c.gradient_clipping_threshold}}) {
            float const f = float(v);
            bool const ok = v == 0 || (std::isfinite(f) && std::isnormal(f));
            moe::detail::require<moe::ConfigError>(
                ok, key, "=", v, " becomes ", f, " in float32 (dtype=", c.dtype,
                "): give a value whose magnitude is within [", std::numeric_limits<float>::min(),
                ", ", std::numeric_limits<float>::max(), "], or dtype=float64");
          }
        });
    t.check(&C::save_on_signal, "SIGTERM, SIGINT, SIGHUP, SIGUSR1 (comma-separated) or none",
            [](C const& c) {
              moe::detail::require<moe::ConfigError>(
                  stop_signal_numbers(c.save_on_signal).has_value(), "save_on_signal='",
                  c.save_on_signal,
                  "' must list SIGTERM, SIGINT, SIGHUP or SIGUSR1, comma-separated, or be none");
            });
    t.check(&C::resume_allow_changed, "model keys or dataset_hash, comma-separated",
            [](C const& c) {
              std::set<std::string> known = {"dataset_hash"};
              std::string list;
              for (auto const& kv : c.model_keys()) known.insert(kv.first);
              for (auto const& k : known) list += (list.empty() ? "" : ", ") + k;
              for (auto const& k : comma_list(c.resume_allow_changed))
                moe::detail::require<moe::ConfigError>(
                    known.count(k) != 0, "resume_allow_changed names '", k,
                    "', which is not a model key or dataset_hash (", list, ")");
            });
    t.check(&C::dataset_path, "read only with dataset_type=text", [](C const& c) {
      moe::detail::require<moe::ConfigError>(
          c.dataset_path.empty() || c.dataset_type == "text", "dataset_path='", c.dataset_path,
          "' is read only with dataset_type=text (dataset_type=", c.dataset_type,
          "): set dataset_type=text or drop dataset_path");
    });
    t.check(&C::dataset_path, "dataset_type=text needs it", [](C const& c) {
      moe::detail::require<moe::ConfigError>(
          c.dataset_type != "text" || !c.dataset_path.empty(),
          "dataset_type=text needs dataset_path (a file whose bytes are the tokens)");
    });
    t.check(&C::vocab_size, ">= 2; 256 (or not given) with dataset_type=text", [](C const& c) {
      if (c.dataset_type == "text")
        moe::detail::require<moe::ConfigError>(
            !c.given.count("vocab_size") || c.vocab_size == 256, "vocab_size=", c.vocab_size,
            " does not fit dataset_type=text, whose tokens are bytes (vocab_size 256)");
      else
        moe::detail::require<moe::ConfigError>(c.vocab_size >= 2, "vocab_size=", c.vocab_size,
                                               " must be >= 2");
    });
    t.check(&C::markov_order, "dataset_type=markov: in [1, 8], vocab_size^markov_order <= 2^22",
            [](C const& c) {
              if (c.dataset_type != "markov") return;
              moe::detail::require<moe::ConfigError>(c.markov_order >= 1 && c.markov_order <= 8,
                                                     "markov_order=", c.markov_order,
                                                     " must be in [1, 8]");
            });
    t.check(&C::markov_branching, "dataset_type=markov: in [1, vocab_size]", [](C const& c) {
      if (c.dataset_type != "markov") return;
      moe::detail::require<moe::ConfigError>(
          c.markov_branching >= 1 && c.markov_branching <= c.vocab_size,
          "markov_branching=", c.markov_branching, " must be in [1, vocab_size=", c.vocab_size,
          "]");
    });
    t.check(&C::markov_order, "", [](C const& c) {
      if (c.dataset_type != "markov") return;
      double const contexts = std::pow(double(c.vocab_size), c.markov_order);
      moe::detail::require<moe::ConfigError>(
          contexts <= double(1 << 22), "vocab_size^markov_order = ", contexts,
          " contexts is too many for the markov source (at most 2^22)");
    });
    t.at_least(&C::checkpoint_period, 1);
    t.at_least(&C::checkpoint_keep, 1);
    t.check(&C::checkpoint_dir, "needed by enable_checkpointing=true", [](C const& c) {
      moe::detail::require<moe::ConfigError>(!c.enable_checkpointing || !c.checkpoint_dir.empty(),
                                             "enable_checkpointing=true needs a checkpoint_dir");
    });
    t.at_least(&C::log_period, 1);
    return t;
  }();
  return t;
}

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
