#pragma once
/// \file
/// ParallelConfig: how one MoE layer is laid out over MPI ranks, under MaxText's key names.

#include <moe/config.hpp>
#include <moe/config_table.hpp>
#include <moe/error.hpp>
#include <moe/sharding/presets.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief Mesh degrees and distributed-strategy switches (MaxText keys): the mesh is built from the
/// `ici_*` degrees (one may be -1: the rest) over the axes of the `custom_mesh_and_rule` preset.
struct ParallelConfig {
  int ici_data_parallelism = 1;
  int ici_fsdp_parallelism = 1;
  int ici_fsdp_transpose_parallelism = 1;
  int ici_expert_parallelism = 1;
  int ici_tensor_parallelism = 1;
  int ici_context_parallelism = 1;
  bool use_ring_of_experts = false;    ///< tokens all-gathered over the expert axis (the ring)
  double ragged_buffer_factor = -1.0;  ///< > 0: receive int(T*K*factor) rows, drop the rest
  bool moe_fsdp_use_two_stage_all_gather = false;  ///< gather FSDP dims one mesh axis at a time
  std::string custom_mesh_and_rule;  ///< preset of mesh axes + rules ("": the default rules)
  /// Dense path with an expert axis: peel `expert` off the dispatch batch dimension (MaxText PR
  /// #4179), so the experts stay expert-parallel.
  bool moe_dispatch_no_expert_sharding = false;
  bool shard_exp_on_fsdp = false;     ///< store the expert dimension of the expert weights on fsdp
  bool use_2d_fsdp_sharding = false;  ///< shard the expert weights on fsdp and fsdp_transpose
  std::string expert_shard_attention_option = "fsdp";  ///< fsdp (the batch), context or tp (D)
  int num_moe_emb_chunks = 0;  ///< > 0: the ring's token all-gather in this many D-chunks
  /// \brief A config file's `mesh_axes` and `logical_axis_rules` (set by the tools, not a key).
  std::optional<sharding::Preset> sharding;

  /// (key, degree) pairs of the ici_* keys, in table order.
  std::vector<std::pair<std::string, int>> ici() const {
    std::vector<std::pair<std::string, int>> out;
    for (auto const& f : table().fields())
      if (f.key.rfind("ici_", 0) == 0) out.emplace_back(f.key, table().get<int>(*this, f));
    return out;
  }

  /// The field table: every key, its type, describe() name, doc line and the rules.
  static inline ConfigTable<ParallelConfig> const& table();

  static std::vector<std::string> keys() { return table().keys(); }
  static bool has_key(std::string const& key) { return table().has_key(key); }

  /// \brief Sets one key from its text form; ConfigError for an unknown key or a bad value.
  void set(std::string const& key, std::string const& value) { table().set(*this, key, value); }

  /// \brief Checks the rules that need no communicator: at most one ici_* degree is -1, and
  /// ragged_buffer_factor is -1 (off) or > 0.
  void validate() const { table().validate(*this); }

  /// A canonical text of every field (used to check that all ranks agree).
  std::string describe() const {
    std::string d = table().describe(*this);
    if (sharding) {
      d += ";sharding=[";
      for (auto const& a : sharding->mesh_axes) d += a + ",";
      d += "]";
      for (auto const& r : sharding->rules.rules()) {
        d += "(" + r.name + ":";
        for (auto const& a : r.axes) d += a + ",";
        d += ")";
      }
    }
    return d;
  }

  /// The mesh axes and rules the layout uses: the preset custom_mesh_and_rule names (ConfigError
  /// if unknown), else `sharding` when set, else the library's default rules.
  sharding::Preset effective_preset() const {
    bool const named = !moe::detail::trim(custom_mesh_and_rule).empty();
    return sharding && !named ? *sharding : sharding::preset(custom_mesh_and_rule);
  }
};

inline ConfigTable<ParallelConfig> const& ParallelConfig::table() {
  using C = ParallelConfig;
  static ConfigTable<C> const t = [] {
    using moe::detail::cat;
    ConfigTable<C> t(DescribeNumbers::ToString, ";");
    // A mesh degree: a positive integer, or -1 (fill the ranks the other axes leave).
    auto degree = [&t](char const* key, int C::*m, char const* axis) {
      t.field(key, m, key,
              cat("degree of the ", axis, " mesh axis (-1: the ranks the others leave)"))
          .parse_with([m](C& c, std::string const& k, std::string const& v) {
            long long const d = moe::detail::parse_int(k, v);
            if (d != -1 && (d < 1 || d > 1 << 20))
              throw ConfigError(cat(k, "=", v, " must be -1 (fill) or a positive degree"));
            c.*m = int(d);
          });
    };
    degree("ici_data_parallelism", &C::ici_data_parallelism, "data");
    degree("ici_fsdp_parallelism", &C::ici_fsdp_parallelism, "fsdp");
    degree("ici_fsdp_transpose_parallelism", &C::ici_fsdp_transpose_parallelism, "fsdp_transpose");
    degree("ici_expert_parallelism", &C::ici_expert_parallelism, "expert");
    degree("ici_tensor_parallelism", &C::ici_tensor_parallelism, "tensor");
    degree("ici_context_parallelism", &C::ici_context_parallelism, "context");
    t.field("use_ring_of_experts", &C::use_ring_of_experts, "ring",
            "ring of experts: all-gather tokens over the expert axis, reduce-scatter the outputs");
    t.field("ragged_buffer_factor", &C::ragged_buffer_factor, "rbf",
            "> 0: the expert-parallel receive buffer holds int(T*K*factor) rows, later rows are "
            "dropped (-1: no limit)");
    t.field("moe_fsdp_use_two_stage_all_gather", &C::moe_fsdp_use_two_stage_all_gather, "two_stage",
            "gather FSDP-sharded weight dims one mesh axis at a time");
    t.field("custom_mesh_and_rule", &C::custom_mesh_and_rule, "preset",
            "preset of mesh axes and logical-axis rules (\"\": the library's default rules)");
    t.field("moe_dispatch_no_expert_sharding", &C::moe_dispatch_no_expert_sharding, "no_exp_batch",
            "dense path with an expert axis: expert-parallel all-to-all instead of the all-gather "
            "/ reduce-scatter fallback");
    t.field("shard_exp_on_fsdp", &C::shard_exp_on_fsdp, "exp_on_fsdp",
            "store the expert dimension of the expert weights on fsdp too");
    t.field("use_2d_fsdp_sharding", &C::use_2d_fsdp_sharding, "fsdp2d",
            "shard the expert weights on fsdp and fsdp_transpose");
    t.choice("expert_shard_attention_option", &C::expert_shard_attention_option, "exp_attn",
             {{"fsdp", "fsdp"}, {"context", "context"}, {"tp", "tp"}},
             "what the expert axis shards outside the routed experts: fsdp (the batch), context, "
             "or tp (the embedding dimension of the layer's input and output)");
    t.field("num_moe_emb_chunks", &C::num_moe_emb_chunks, "emb_chunks",
            "> 0: overlap the ring's token all-gather with the grouped GEMM in this many chunks of "
            "the embedding dimension (0: off)");

    // Rules, in the order validate() checks them.
    t.check("at most one ici_*_parallelism degree is -1", [](C const& c) {
      std::string fill;
      for (auto const& [k, v] : c.ici())
        if (v == -1) {
          if (!fill.empty())
            throw ConfigError(cat(fill, "=-1 and ", k,
                                  "=-1: at most one ici_*_parallelism degree may be -1 (fill the "
                                  "rest of the ranks); give the other a degree"));
          fill = k;
        }
    });
    t.at_least(&C::num_moe_emb_chunks, 0);
    t.rule(&C::ragged_buffer_factor, "must be > 0 (or -1: no limit)",
           [](double v) { return v == -1.0 || v > 0; });
    return t;
  }();
  return t;
}

}  // namespace moe::distributed

namespace moe {
using distributed::ParallelConfig;
}  // namespace moe
