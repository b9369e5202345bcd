#pragma once
// TrainConfig::table(): every key of train_moe with its short name, help text, choices and the
// rules validate() applies (config.hpp declares TrainConfig and includes this file at its end).

#include "config.hpp"

#include <moe/config.hpp>
#include <moe/error.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>

namespace train {

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

}  // namespace train
