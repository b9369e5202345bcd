#pragma once
// MaxText configs as they are, for train_moe, moe-layer-run and moe-shard --plan: one loader that
// reads several YAML files in order, then `key=value` overrides (later wins, as in MaxText), and
// sorts every key into
//   - a key the tool applies itself (LayerConfig, ParallelConfig and the tool's own keys),
//   - a key of the loader: model_name (the MoE shapes of moe/models.hpp), mesh_axes,
//     logical_axis_rules, override_logical_axis_rules (the layout's rules),
//   - a MoE-related MaxText key moe does not apply (moe_keys(): mapped to a policy, accepted as a
//     no-op with the reason, or rejected with the reason unless at an accepted value),
//   - any other MaxText key (attention, data, checkpointing, ...; moe_maxtext_key_names.hpp):
//     accepted, counted in one summary line,
//   - anything else: an error naming the key and the nearest known one.
//
// MaxText's order is kept: the files (base.yml, then a model file, ...), then the keys of
// `model_name` (MaxText loads configs/models/NAME.yml on top of the config files; moe takes the
// MoE layer's keys of that file from moe::model_table()), then the key=value overrides. An
// override of a model key wins (MaxText requires override_model_config=true for that; moe accepts
// it either way). A key given twice in one file, or twice on the command line, stays an error.
//
// logical_axis_rules merge as in MaxText (pyconfig `_merge_logical_axis_rules`): the rules of a
// later file or of the overrides replace every earlier rule of the same name and are appended;
// with override_logical_axis_rules=true in that file (or on the command line) they replace the
// whole list. mesh_axes: later wins. A preset (custom_mesh_and_rule) replaces both, as in MaxText.

#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/models.hpp>
#include <moe/sharding/presets.hpp>

#include <moe_cli.hpp>
#include <moe_maxtext_key_names.hpp>
#include <moe_sharding_yaml.hpp>

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moe::cli::maxtext {

/// What moe does with a MoE-related MaxText key.
enum class Status {
  Implemented,  ///< the layer (or the loader) honours it
  Policy,       ///< mapped to one of moe's policies (the value picks nothing else)
  NoOp,         ///< accepted, changes nothing, for the reason given
  Rejected      ///< accepted at the listed values only; any other value is a ConfigError
};

/// Status as the README writes it.
inline char const* status_name(Status s) {
  switch (s) {
    case Status::Implemented:
      return "implemented";
    case Status::Policy:
      return "policy";
    case Status::NoOp:
      return "no-op";
    case Status::Rejected:
      return "rejected";
  }
  return "?";
}

/// \brief One MoE-related MaxText key: its status, the accepted values of a Rejected key
/// ('|'-separated, MaxText's default first; "" otherwise) and what moe does with it, or why not.
struct MoeKey {
  char const* key;
  Status status;
  char const* accepted;
  char const* what;
};

/// \brief Every MoE-related key of MaxText's config (its MoEGeneral, MoEKernels and DeepSeekMoE
/// groups, the MoE layer's shape and routing keys, the mesh degrees and the sharding rules) with
/// what moe does with it. The README's MaxText key table lists the same keys.
inline std::vector<MoeKey> const& moe_keys() {
  using S = Status;
  static char const* const kTpuKernel =
      "TPU kernel choice (Pallas / SparseCore / Mosaic); moe's kernels compute the same values";
  static char const* const kTile = "tile size of MaxText's TPU grouped GEMM; moe tiles its own";
  static char const* const kCost = "cost estimate of a SparseCore kernel for XLA's scheduler";
  static char const* const kStack =
      "decoder-stack structure (which layers are MoE); the tools model MoE layers only";
  static char const* const kDcn =
      "moe's mesh has one level (the ranks, the ici_* degrees); multi-slice DCN degrees other than "
      "MaxText's default are not implemented";
  static char const* const kIci =
      "this mesh axis has no role in the MoE layer (sequence, pipeline or decode axes are not "
      "implemented); only degree 1 is accepted";
  static std::vector<MoeKey> const t = {
      // Shapes and routing (LayerConfig).
      {"num_experts", S::Implemented, "",
       "E; MaxText's 1 means no MoE layer, moe's a 1-expert one"},
      {"num_experts_per_tok", S::Implemented, "", "K"},
      {"base_emb_dim", S::Implemented, "", "D"},
      {"base_moe_mlp_dim", S::Implemented, "",
       "F; MaxText's -1 (unset, base.yml) is an error asking for a value or model_name"},
      {"decoder_block", S::Implemented, "",
       "deepseek: DeepSeek routing; llama2, mistral, mixtral, qwen3, qwen3_moe and MaxText's other "
       "generic blocks: the generic top-k path (decoder_block=mixtral); llama4, gemma4, "
       "gemma4_small, gpt_oss, deepseek4, qwen3_next, qwen3_5, qwen3_custom_moe: rejected (their "
       "routing or expert MLP differs)"},
      {"routed_score_func", S::Implemented, "", "score function of the gate logits"},
      {"routed_bias", S::Implemented, "", "learnable gate bias"},
      {"routed_scaling_factor", S::Implemented, "", "DeepSeek weight scaling"},
      {"routed_bias_update_rate", S::Implemented, "", "DeepSeek loss-free balancing"},
      {"n_routing_groups", S::Implemented, "", "DeepSeek group-limited routing"},
      {"topk_routing_group", S::Implemented, "", "DeepSeek group-limited routing"},
      {"norm_topk_prob", S::Implemented, "", "renormalise the K weights (Qwen3)"},
      {"use_random_routing", S::Implemented, "", "uniform random experts"},
      {"capacity_factor", S::Implemented, "", "per-sequence expert capacity (-1: none)"},
      {"load_balance_loss_weight", S::Implemented, "", "Switch load-balance loss"},
      {"mlp_activations", S::Implemented, "", "[silu, linear] or [gelu, linear]"},
      {"shared_experts", S::Implemented, "", "shared expert of shared_experts x F"},
      {"sparse_matmul", S::Implemented, "", "false: the dense masked path"},
      // Parallelism (ParallelConfig).
      {"ici_data_parallelism", S::Implemented, "", "mesh degree"},
      {"ici_fsdp_parallelism", S::Implemented, "", "mesh degree"},
      {"ici_fsdp_transpose_parallelism", S::Implemented, "", "mesh degree"},
      {"ici_expert_parallelism", S::Implemented, "", "mesh degree"},
      {"ici_tensor_parallelism", S::Implemented, "", "mesh degree"},
      {"ici_context_parallelism", S::Implemented, "", "mesh degree"},
      {"use_ring_of_experts", S::Implemented, "", "ring of experts"},
      {"ragged_buffer_factor", S::Implemented, "", "expert-parallel receive buffer size"},
      {"moe_fsdp_use_two_stage_all_gather", S::Implemented, "", "one gather per FSDP axis"},
      {"custom_mesh_and_rule", S::Implemented, "", "preset of mesh axes and rules"},
      {"moe_dispatch_no_expert_sharding", S::Implemented, "",
       "dense path with an expert axis: the expert-parallel all-to-all instead of the all-gather / "
       "reduce-scatter fallback"},
      {"shard_exp_on_fsdp", S::Implemented, "",
       "expert weights stored with the expert dimension on fsdp, gathered for compute (not with an "
       "expert axis > 1)"},
      {"use_2d_fsdp_sharding", S::Implemented, "",
       "expert weights stored on fsdp and fsdp_transpose, gathered for compute (not with expert or "
       "tensor > 1)"},
      {"expert_shard_attention_option", S::Implemented, "",
       "fsdp (default); tp: EP-TP, the layer's tokens split on D over expert; context: rejected "
       "(no sequence parallelism)"},
      {"num_moe_emb_chunks", S::Implemented, "",
       "ring of experts: the token all-gather in n D-chunks, overlapped with the grouped GEMM"},
      // The loader's own.
      {"model_name", S::Implemented, "",
       "the MoE shapes of a published model (moe/models.hpp); \"default\": none"},
      {"mesh_axes", S::Implemented, "", "the mesh's axes and their order"},
      {"logical_axis_rules", S::Implemented, "", "the layout's rules, merged across files"},
      {"override_logical_axis_rules", S::Implemented, "",
       "true: a file's rules replace the earlier ones instead of merging"},
      // Policies.
      {"megablox", S::Policy, "",
       "any value: the grouped-GEMM policy (gmm::Auto: oneDNN / vendor / tiled grouped GEMM); "
       "MaxText's megablox and ragged_dot kernels compute the same grouped GEMM"},
      {"use_tokamax_gmm", S::Policy, "", "any value: the grouped-GEMM policy, as megablox"},
      {"use_gmm_v2", S::Policy, "", "any value: the grouped-GEMM policy, as megablox"},
      // No-ops.
      {"use_custom_sort_vjp", S::NoOp, "",
       "JAX custom VJP of the sort; moe's backward is written by hand and gives the same "
       "gradients"},
      {"use_ragged_sort", S::NoOp, "", kTpuKernel},
      {"ragged_sort_use_single_sparsecore", S::NoOp, "", kTpuKernel},
      {"use_gather_mosaic_kernel", S::NoOp, "", kTpuKernel},
      {"ragged_gather_fallback", S::NoOp, "", kTpuKernel},
      {"ragged_gather_reduce_fallback", S::NoOp, "", kTpuKernel},
      {"ragged_gather_cost_estimate_flops", S::NoOp, "", kCost},
      {"ragged_gather_reduce_cost_estimate_flops", S::NoOp, "", kCost},
      {"ragged_gather_cost_estimate_bytes_accessed", S::NoOp, "", kCost},
      {"ragged_gather_reduce_cost_estimate_bytes_accessed", S::NoOp, "", kCost},
      {"wi_tile_fwd_batch_seq", S::NoOp, "", kTile},
      {"wi_tile_fwd_embed_dim", S::NoOp, "", kTile},
      {"wi_tile_fwd_mlp_dim", S::NoOp, "", kTile},
      {"wi_tile_dlhs_batch_seq", S::NoOp, "", kTile},
      {"wi_tile_dlhs_embed_dim", S::NoOp, "", kTile},
      {"wi_tile_dlhs_mlp_dim", S::NoOp, "", kTile},
      {"wi_tile_drhs_batch_seq", S::NoOp, "", kTile},
      {"wi_tile_drhs_embed_dim", S::NoOp, "", kTile},
      {"wi_tile_drhs_mlp_dim", S::NoOp, "", kTile},
      {"wo_tile_fwd_batch_seq", S::NoOp, "", kTile},
      {"wo_tile_fwd_embed_dim", S::NoOp, "", kTile},
      {"wo_tile_fwd_mlp_dim", S::NoOp, "", kTile},
      {"wo_tile_dlhs_batch_seq", S::NoOp, "", kTile},
      {"wo_tile_dlhs_embed_dim", S::NoOp, "", kTile},
      {"wo_tile_dlhs_mlp_dim", S::NoOp, "", kTile},
      {"wo_tile_drhs_batch_seq", S::NoOp, "", kTile},
      {"wo_tile_drhs_embed_dim", S::NoOp, "", kTile},
      {"wo_tile_drhs_mlp_dim", S::NoOp, "", kTile},
      {"merge_gating_gmm", S::NoOp, "",
       "fuses the wi_0 and wi_1 grouped GEMMs into one TPU kernel; same values"},
      {"prefuse_moe_weights", S::NoOp, "", "storage of wi_0 and wi_1 as one array; same values"},
      {"padded_base_moe_mlp_dim", S::NoOp, "",
       "zero padding of F for MaxText's GMM v2 kernel; same values"},
      {"fuse_expert_scales", S::NoOp, "",
       "inference-time folding of per-expert scales (Gemma 4), which moe does not have"},
      {"float32_weight_sum", S::Implemented, "",
       "dtype=bfloat16: the top-k weighted sum of the experts takes fp32 routing weights "
       "(docs/precision.md); float32 and float64 runs always sum in their own type"},
      {"float32_gate_logits", S::Implemented, "",
       "dtype=bfloat16: the gate matmul and its logits stay fp32 (docs/precision.md); float32 "
       "and float64 runs compute the gate in their own type"},
      {"moe_chunk_barrier", S::NoOp, "",
       "orders the chunks of num_moe_token_chunks, which moe accepts only at 1 (no chunks)"},
      {"use_batch_split_schedule", S::NoOp, "",
       "scheduling of micro-batches to overlap communication; the values are unchanged"},
      {"batch_split_factor", S::NoOp, "", "see use_batch_split_schedule"},
      {"log_moe_bias_norms", S::NoOp, "", "MaxText's logging of router bias norms"},
      {"first_num_dense_layers", S::NoOp, "", kStack},
      {"interleave_moe_layer_step", S::NoOp, "", kStack},
      // Rejected unless at MaxText's default.
      {"num_moe_token_chunks", S::Rejected, "1",
       "chunking the ring-of-experts tokens to overlap the all-gather with the grouped GEMM is "
       "not implemented"},
      {"moe_expert_input_dim", S::Rejected, "-1",
       "the experts' input dimension is base_emb_dim; a separate one (qwen3_custom_moe) is not "
       "implemented"},
      {"mlp_bias", S::Rejected, "false", "biases of the expert MLPs (GPT-OSS) are not implemented"},
      {"mlp_activations_limit", S::Rejected, "-1",
       "clipping of the expert activations (GPT-OSS, DeepSeek-V4) is not implemented"},
      {"first_num_hash_layers", S::Rejected, "0",
       "hash routing layers (DeepSeek-V4) are not implemented"},
      {"ici_diloco_parallelism", S::Rejected, "1", kIci},
      {"ici_sequence_parallelism", S::Rejected, "1", kIci},
      {"ici_context_usp_ulysses_parallelism", S::Rejected, "1", kIci},
      {"ici_context_autoregressive_parallelism", S::Rejected, "1", kIci},
      {"ici_tensor_sequence_parallelism", S::Rejected, "1", kIci},
      {"ici_autoregressive_parallelism", S::Rejected, "1", kIci},
      {"ici_pipeline_parallelism", S::Rejected, "1", kIci},
      {"num_slices", S::Rejected, "-1|1", kDcn},
      {"dcn_diloco_parallelism", S::Rejected, "1", kDcn},
      {"dcn_data_parallelism", S::Rejected, "-1|1", kDcn},
      {"dcn_fsdp_parallelism", S::Rejected, "1", kDcn},
      {"dcn_fsdp_transpose_parallelism", S::Rejected, "1", kDcn},
      {"dcn_sequence_parallelism", S::Rejected, "1", kDcn},
      {"dcn_context_parallelism", S::Rejected, "1", kDcn},
      {"dcn_context_usp_ulysses_parallelism", S::Rejected, "1", kDcn},
      {"dcn_context_autoregressive_parallelism", S::Rejected, "1", kDcn},
      {"dcn_tensor_parallelism", S::Rejected, "1", kDcn},
      {"dcn_tensor_sequence_parallelism", S::Rejected, "1", kDcn},
      {"dcn_pipeline_parallelism", S::Rejected, "1", kDcn},
      {"dcn_expert_parallelism", S::Rejected, "1", kDcn},
      {"dcn_autoregressive_parallelism", S::Rejected, "1", kDcn},
  };
  return t;
}

/// The moe_keys() entry of `key`, or nullptr.
inline MoeKey const* find_moe_key(std::string const& key) {
  for (auto const& k : moe_keys())
    if (key == k.key) return &k;
  return nullptr;
}

/// The category of a MaxText key name (moe_maxtext_key_names.hpp), or "" when MaxText has no
/// such key.
inline std::string category_of(std::string const& key) {
  static std::map<std::string, std::string> const index = [] {
    std::map<std::string, std::string> m;
    for (auto const& [cat, names] : key_names_by_category())
      for (auto const& n : names) m.emplace(n, cat);
    return m;
  }();
  auto const it = index.find(key);
  return it == index.end() ? std::string() : it->second;
}

namespace detail {

/// The keys the loader handles itself.
inline bool is_loader_key(std::string const& k) {
  return k == "model_name" || k == "mesh_axes" || k == "logical_axis_rules" ||
         k == "override_logical_axis_rules";
}

/// A plain YAML integer with digit separators (MaxText writes `steps: 150_001`) without them.
inline std::string yaml_number(std::string s) {
  std::size_t i = (!s.empty() && (s[0] == '-' || s[0] == '+')) ? 1 : 0;
  if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) return s;
  for (std::size_t j = i; j < s.size(); ++j)
    if (!std::isdigit(static_cast<unsigned char>(s[j])) && s[j] != '_') return s;
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  return s;
}

/// One key of one source: its text form (lists joined with commas, as read_yaml) and its node.
struct Entry {
  std::string key;
  std::string text;
  YAML::Node node;      ///< null for a command-line override (parsed on demand)
  bool nested = false;  ///< the value is a mapping or holds lists (text unusable)
};

struct Source {
  std::string name;  ///< "config file 'x.yml'" or "the command line"
  bool command_line = false;
  std::vector<Entry> entries;
};

inline Entry entry_of(std::string const& key, YAML::Node const& n) {
  Entry e{key, "", n, false};
  if (n.IsNull()) return e;
  if (n.IsScalar()) {
    e.text = n.Tag() == "!" ? n.Scalar() : yaml_number(n.Scalar());
    return e;
  }
  if (n.IsSequence()) {
    for (std::size_t i = 0; i < n.size(); ++i) {
      if (!n[i].IsScalar()) {
        e.nested = true;
        e.text.clear();
        return e;
      }
      e.text += (i ? "," : "") + n[i].Scalar();
    }
    return e;
  }
  e.nested = true;
  return e;
}

inline Source read_file(std::string const& path, std::string const& what) {
  Source s{moe::detail::cat(what, " '", path, "'"), false, {}};
  for_each_yaml_key(path, what, [&](std::string const& key, YAML::Node const& value) {
    s.entries.push_back(entry_of(key, value));
  });
  return s;
}

/// The node of an entry: the file's, or an override's value parsed as YAML.
inline YAML::Node node_of(Entry const& e, Source const& s) {
  if (!s.command_line) return e.node;
  try {
    return YAML::Load(e.text);
  } catch (YAML::Exception const& ex) {
    throw ConfigError(
        moe::detail::cat("override ", e.key, "=", e.text, " is not valid YAML: ", ex.what()));
  }
}

/// Whether `value` is one of the '|'-separated `accepted` values: numbers compare as numbers,
/// booleans as booleans, null / "" / None as one value.
inline bool accepted_value(std::string value, std::string const& accepted) {
  value = moe::detail::trim(value);
  auto is_null = [](std::string const& v) { return v.empty() || v == "None" || v == "null"; };
  std::size_t start = 0;
  while (start <= accepted.size()) {
    auto const bar = accepted.find('|', start);
    std::string const a =
        accepted.substr(start, bar == std::string::npos ? std::string::npos : bar - start);
    if (a == value || (is_null(a) && is_null(value))) return true;
    try {
      if (moe::detail::parse_double("", a) == moe::detail::parse_double("", value)) return true;
    } catch (ConfigError const&) {
    }
    try {
      if (moe::detail::parse_bool("", a) == moe::detail::parse_bool("", value)) return true;
    } catch (ConfigError const&) {
    }
    if (bar == std::string::npos) break;
    start = bar + 1;
  }
  return false;
}

/// MaxText's decoder_block values as moe's routing path (see moe_keys()); a value MaxText does not
/// have is passed on, for LayerConfig to reject.
inline std::string decoder_block(std::string const& value) {
  std::string const v = moe::detail::trim(value);
  for (char const* r : {"llama4", "gemma4", "gemma4_small", "gpt_oss", "deepseek4", "qwen3_next",
                        "qwen3_5", "qwen3_custom_moe"})
    if (v == r)
      throw ConfigError(moe::detail::cat(
          "decoder_block=", v, ": the MoE layer of MaxText's '", v,
          "' block (its routing or its expert MLP) is not implemented; moe implements deepseek "
          "and the generic top-k path of MaxText's other blocks (mixtral, qwen3_moe, llama2, "
          "...)"));
  for (char const* g : {"default", "llama2", "mistral", "gemma", "gemma2", "gemma3", "gpt3",
                        "qwen2", "qwen3", "qwen3_moe", "olmo3", "envy", "simple", "simple_mlp"})
    if (v == g) return "mixtral";
  return value;
}

}  // namespace detail

/// \brief What the loader read: the keys for the tool, the sharding of the files, the ignored
/// MaxText keys.
struct Loaded {
  /// The keys the tool applies, each once with its final value, in MaxText's order (files,
  /// model_name's keys, overrides; a key where its final value came from).
  KeyValues apply;
  /// The files' mesh_axes / logical_axis_rules (default mesh axes or rules for the one absent),
  /// when any source had one of them.
  std::optional<sharding::Preset> sharding;
  std::string model_name;  ///< "" when none (or "default")
  /// Ignored MaxText keys (distinct names) by category.
  std::map<std::string, std::vector<std::string>> ignored;

  /// Number of distinct ignored keys.
  std::size_t ignored_count() const {
    std::size_t n = 0;
    for (auto const& [cat, keys] : ignored) n += keys.size();
    return n;
  }

  /// `ignored MaxText keys: N (category n, ...)`, the categories by count (then name); "" when
  /// nothing was ignored.
  std::string ignored_summary() const {
    if (ignored.empty()) return "";
    std::vector<std::pair<std::string, std::size_t>> cats;
    for (auto const& [cat, keys] : ignored) cats.emplace_back(cat, keys.size());
    std::stable_sort(cats.begin(), cats.end(),
                     [](auto const& a, auto const& b) { return a.second > b.second; });
    std::string s = moe::detail::cat("ignored MaxText keys: ", ignored_count(), " (");
    for (std::size_t i = 0; i < cats.size(); ++i)
      s += moe::detail::cat(i ? ", " : "", cats[i].first, " ", cats[i].second);
    return s + ")";
  }

  /// \brief Gives `par` the files' sharding when they have one and `par` names no preset. A
  /// preset would win anyway (ParallelConfig::effective_preset); leaving `sharding` unset then
  /// keeps describe() that of the preset alone.
  void apply_sharding(ParallelConfig& par) const {
    if (sharding && moe::detail::trim(par.custom_mesh_and_rule).empty()) par.sharding = sharding;
  }
};

/// \brief Reads `files` in order, then `overrides` (key=value pairs of the command line), and
/// sorts every key (see the file comment). ConfigError for an unknown key (the nearest known one
/// suggested), a rejected key at a value it does not accept, an unknown model_name, a bad
/// mesh_axes / logical_axis_rules, or a key given twice in one source.
/// \param tool_has_key whether the tool applies a key itself (LayerConfig, ParallelConfig, its own)
/// \param tool_keys the tool's keys, for the suggestion of an unknown key
/// \param what how the tool names its config files in messages ("config file", "--plan", ...)
inline Loaded load(std::vector<std::string> const& files, KeyValues const& overrides,
                   std::function<bool(std::string const&)> const& tool_has_key,
                   std::vector<std::string> const& tool_keys,
                   std::string const& what = "config file") {
  using namespace detail;
  std::vector<Source> sources;
  for (auto const& f : files) sources.push_back(read_file(f, what));
  require_unique_keys(overrides, "the command line");
  Source cl{"the command line", true, {}};
  for (auto const& [k, v] : overrides) cl.entries.push_back(Entry{k, v, YAML::Node(), false});
  sources.push_back(std::move(cl));

  Loaded out;
  std::map<std::string, std::pair<std::string, std::string>> rejected;  // key -> (value, source)
  std::string model_name;
  bool has_mesh = false, has_rules = false;
  std::vector<std::string> mesh_axes;
  sharding::LogicalRules rules;
  std::vector<KeyValues> per_source(sources.size());
  for (std::size_t si = 0; si < sources.size(); ++si) {
    auto const& s = sources[si];
    // override_logical_axis_rules of this source decides how its rules combine.
    bool override_rules = false;
    for (auto const& e : s.entries)
      if (e.key == "override_logical_axis_rules")
        override_rules = moe::detail::parse_bool(e.key, e.text);
    for (auto const& e : s.entries) {
      auto const& k = e.key;
      if (is_loader_key(k)) {
        if (k == "model_name") {
          model_name = moe::detail::trim(e.text);
        } else if (k == "mesh_axes" || k == "logical_axis_rules") {
          YAML::Node one;
          one[k] = node_of(e, s);
          auto const f = parse_sharding_yaml(one, s.name);
          if (k == "mesh_axes") {
            has_mesh = true;
            mesh_axes = f.mesh_axes;
          } else {
            rules =
                (override_rules || !has_rules) ? f.rules : sharding::merge_rules(rules, f.rules);
            has_rules = true;
          }
        }
        continue;
      }
      if (tool_has_key(k)) {
        if (e.nested)
          throw ConfigError(
              moe::detail::cat(s.name, ": key '", k,
                               "' holds a mapping or nested lists; expected a scalar or a "
                               "list"));
        per_source[si].emplace_back(k, k == "decoder_block" ? decoder_block(e.text) : e.text);
        continue;
      }
      if (auto const* m = find_moe_key(k)) {
        if (m->status == Status::Rejected) {
          if (e.nested)
            throw ConfigError(moe::detail::cat(s.name, ": key '", k, "' must be a scalar"));
          rejected[k] = {e.text, s.name};
        }
        continue;  // Implemented keys of another tool, policies and no-ops: nothing to apply
      }
      std::string const cat = category_of(k);
      if (!cat.empty()) {
        auto& keys = out.ignored[cat];
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
        continue;
      }
      std::vector<std::string> known = tool_keys;
      for (auto const& mk : moe_keys()) known.push_back(mk.key);
      for (auto const& [c, names] : key_names_by_category())
        known.insert(known.end(), names.begin(), names.end());
      throw ConfigError(moe::detail::cat(
          s.name, ": unknown config key '", k, "'", e.nested ? "" : " (value '" + e.text + "')",
          ": not a key of this tool nor of MaxText's config", moe::detail::did_you_mean(k, known)));
    }
  }
  for (auto const& [k, vs] : rejected) {
    auto const* m = find_moe_key(k);
    if (!accepted_value(vs.first, m->accepted)) {
      std::string acc = m->accepted;
      std::replace(acc.begin(), acc.end(), '|', ' ');
      throw ConfigError(moe::detail::cat(vs.second, ": ", k, "=", vs.first,
                                         " is not supported: ", m->what, " (accepted: ", acc, ")"));
    }
  }
  // MaxText's order: the files, then the model's keys, then the command line.
  for (std::size_t si = 0; si + 1 < sources.size(); ++si)
    out.apply.insert(out.apply.end(), per_source[si].begin(), per_source[si].end());
  if (!model_name.empty() && model_name != "default") {
    out.model_name = model_name;
    for (auto const& kv : model_facts(model_name).key_values())
      if (tool_has_key(kv.first)) out.apply.push_back(kv);
  }
  out.apply.insert(out.apply.end(), per_source.back().begin(), per_source.back().end());
  // Later wins: each key once, with its last value, where it came last (an earlier value is
  // never parsed, so base.yml's dtype: bfloat16 yields to dtype=float32 on the command line).
  KeyValues last;
  for (std::size_t i = 0; i < out.apply.size(); ++i) {
    bool later = false;
    for (std::size_t j = i + 1; j < out.apply.size() && !later; ++j)
      later = out.apply[j].first == out.apply[i].first;
    if (!later) last.push_back(out.apply[i]);
  }
  out.apply = std::move(last);
  // MaxText's base.yml leaves base_moe_mlp_dim at -1 (no MoE layer while num_experts is 1).
  for (auto it = out.apply.rbegin(); it != out.apply.rend(); ++it)
    if (it->first == "base_moe_mlp_dim") {
      if (moe::detail::trim(it->second) == "-1")
        throw ConfigError(
            "base_moe_mlp_dim=-1 is MaxText's 'not set' (base.yml: no MoE layer while num_experts "
            "is 1): give base_moe_mlp_dim (and num_experts, ...) or model_name=NAME (" +
            model_names_text() + ")");
      break;
    }
  if (has_mesh || has_rules) {
    ShardingFile file;
    file.has_mesh_axes = has_mesh;
    file.mesh_axes = mesh_axes;
    file.has_rules = has_rules;
    file.rules = rules;
    out.sharding = effective_sharding(&file, "");
  }
  return out;
}

/// \brief Prints `TOOL: ignored MaxText keys: ...` on stderr when `print` (rank 0) and keys were
/// ignored.
inline void print_ignored(Loaded const& l, char const* tool, bool print) {
  std::string const s = l.ignored_summary();
  if (print && !s.empty()) std::fprintf(stderr, "%s: %s\n", tool, s.c_str());
}

}  // namespace moe::cli::maxtext
