#pragma once
/// \file
/// The default logical-axis rules (MaxText's base config) and the `custom_mesh_and_rule` presets.
/// Only the names an MoE layer and its dense neighbours use are listed (`decode_batch_moe` is left
/// out); other names resolve to unsharded. Rule order reproduces MaxText's conflicts.

#include <moe/error.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/rules.hpp>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

namespace moe::detail {

/// A rule of a preset table; with `twin`, a rule `<name>_moe` with the same axes follows it.
struct TwinRule {
  std::string name;
  sharding::DimAxes axes;
  bool twin = false;
};

inline constexpr bool moe_too = true;

inline sharding::LogicalRules rules_with_twins(std::initializer_list<TwinRule> rules) {
  sharding::LogicalRules out;
  for (auto const& r : rules) {
    out.add(r.name, r.axes);
    if (r.twin) out.add(r.name + "_moe", r.axes);
  }
  return out;
}

}  // namespace moe::detail

namespace moe::sharding {

/// \brief A mesh-and-rule set: mesh axis names in order plus the logical rules.
struct Preset {
  std::string name;                    ///< `custom_mesh_and_rule` value ("default" for base)
  std::vector<std::string> mesh_axes;  ///< mesh axis names, first axis slowest
  LogicalRules rules;                  ///< logical-axis rules, in order
};

/// \brief The library's default rules (MaxText base config, MoE-relevant names).
inline LogicalRules default_rules() {
  return detail::rules_with_twins({
      // Activations: batch rules first, claiming `expert` in the dense dispatch (SEMANTICS §1.13).
      {"activation_batch", {"data", "fsdp", "fsdp_transpose", "expert"}, detail::moe_too},
      {"activation_length", {"context", "context_usp_ulysses"}, detail::moe_too},
      {"activation_norm_length",
       {"tensor_sequence", "context", "context_usp_ulysses"},
       detail::moe_too},
      {"activation_embed", {"tensor"}, detail::moe_too},
      {"activation_mlp", {"tensor", "tensor_sequence"}, detail::moe_too},
      {"activation_exp", {"expert"}},
      // Dense / shared-expert weights: mlp first so embed falls back when mlp has fsdp_transpose.
      {"mlp", {"fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"}},
      {"mlp_no_fsdp", {"tensor", "tensor_sequence", "autoregressive"}},
      {"embed", {"fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"}},
      {"embed", {"fsdp", "context", "context_usp_ulysses", "expert"}},
      {"layers", {"stage"}},
      {"moe_layers", {}},
      // Expert weights: exp < mlp_moe < embed_moe, embed_moe falling back in the same way.
      {"exp", {"expert"}},
      {"mlp_moe", {"fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"}},
      {"embed_moe", {"fsdp", "fsdp_transpose", "context", "context_usp_ulysses"}},
      {"embed_moe", {"fsdp", "context", "context_usp_ulysses"}},
      {"exp_with_fsdp", {"fsdp"}},
  });
}

/// \brief Names accepted by preset(), "default" first.
inline std::vector<std::string> preset_names() {
  return {"default",  "pure-fsdp",         "ep-as-dp",           "ep-as-cp",
          "cp-as-ep", "shard-exp-on-fsdp", "pipeline-large-moe", "ep-tp"};
}

/// \brief `expert_shard_attention_option=tp` applied to `rules` (EP-TP: tokens split D over
/// `expert`): `expert` leaves the batch rules (`activation_batch`, `activation_batch_moe`) and
/// joins the embedding rules (`activation_embed`, `activation_embed_moe`, added when missing).
inline LogicalRules expert_shards_embed(LogicalRules const& rules) {
  LogicalRules out;
  for (auto r : rules.rules()) {
    if (r.name == "activation_batch" || r.name == "activation_batch_moe")
      r.axes.erase(std::remove(r.axes.begin(), r.axes.end(), "expert"), r.axes.end());
    if ((r.name == "activation_embed" || r.name == "activation_embed_moe") &&
        std::find(r.axes.begin(), r.axes.end(), "expert") == r.axes.end())
      r.axes.push_back("expert");
    out.add(r.name, r.axes);
  }
  for (char const* name : {"activation_embed", "activation_embed_moe"})
    if (!rules.has(name)) out.add(name, {"expert"});
  return out;
}

/// \brief The mesh-and-rule set selected by `custom_mesh_and_rule`. "" and "default" give the base
/// mesh axes with default_rules(); a named preset replaces mesh axes and rules wholesale (names it
/// has no rule for resolve to unsharded). Throws ConfigError listing the known names otherwise.
inline Preset preset(std::string const& name) {
  if (name.empty() || name == "default") return {"default", base_mesh_axes(), default_rules()};
  if (name == "pure-fsdp")
    return {name,
            {"fsdp"},
            detail::rules_with_twins({{"activation_batch", {"fsdp"}, detail::moe_too},
                                      {"embed", {"fsdp"}, detail::moe_too},
                                      {"exp_with_fsdp", {"fsdp"}}})};
  if (name == "ep-as-dp")  // expert acts as a data axis outside the MoE
    return {
        name,
        {"data", "fsdp", "fsdp_transpose", "expert"},
        detail::rules_with_twins(
            {{"activation_batch", {"data", "fsdp", "fsdp_transpose", "expert"}, detail::moe_too},
             {"activation_length", {}, detail::moe_too},
             {"activation_norm_length", {}, detail::moe_too},
             {"activation_embed", {}, detail::moe_too},
             {"activation_mlp", {}, detail::moe_too},
             {"activation_exp", {"expert"}},
             {"mlp", {"fsdp_transpose"}},
             {"embed", {"fsdp", "fsdp_transpose"}},
             {"embed", {"fsdp"}},
             {"exp", {"expert"}},
             {"mlp_moe", {"fsdp_transpose"}},
             {"embed_moe", {"fsdp"}},
             {"exp_with_fsdp", {"fsdp"}}})};
  if (name == "ep-as-cp")  // expert shards the sequence outside the MoE
    return {name,
            {"data", "stage", "fsdp", "expert"},
            detail::rules_with_twins({{"activation_batch", {"data", "fsdp"}, detail::moe_too},
                                      {"activation_length", {"expert"}},
                                      {"activation_norm_length", {"expert"}},
                                      {"activation_embed", {}},
                                      {"activation_mlp", {}},
                                      {"activation_exp", {"expert"}},
                                      {"mlp", {}},
                                      {"embed", {"fsdp", "expert"}},
                                      {"layers", {"stage"}},
                                      {"exp", {"expert"}},
                                      {"embed_moe", {"fsdp"}}})};
  if (name == "cp-as-ep")  // the EP group is the (context, expert) tuple
    return {name,
            {"data", "stage", "fsdp", "context", "expert"},
            detail::rules_with_twins({{"activation_batch", {"data", "fsdp", "expert"}},
                                      {"activation_batch_moe", {"data", "fsdp"}},
                                      {"activation_length", {"context"}},
                                      {"activation_norm_length", {"context"}},
                                      {"activation_embed", {}},
                                      {"activation_mlp", {}},
                                      {"activation_exp", {"context", "expert"}},
                                      {"mlp", {}},
                                      {"embed", {"fsdp", "context", "expert"}},
                                      {"layers", {"stage"}},
                                      {"exp", {"context", "expert"}},
                                      {"embed_moe", {"fsdp"}}})};
  if (name == "shard-exp-on-fsdp")  // expert dim stored on (expert, fsdp), embed_moe on context
    return {name,
            {"data", "stage", "fsdp", "fsdp_transpose", "context", "expert"},
            detail::rules_with_twins(
                {{"activation_batch", {"data", "fsdp", "fsdp_transpose", "expert"}},
                 {"activation_batch_moe", {"data", "fsdp", "fsdp_transpose"}},
                 {"activation_length", {"context"}, detail::moe_too},
                 {"activation_norm_length", {"context"}, detail::moe_too},
                 {"activation_embed", {}},
                 {"activation_mlp", {}, detail::moe_too},
                 {"activation_exp", {"expert"}},
                 {"mlp", {"fsdp_transpose"}},
                 {"embed", {"fsdp", "context", "expert"}},
                 {"layers", {"stage"}},
                 {"exp", {"expert", "fsdp"}},
                 {"mlp_moe", {"fsdp_transpose"}},
                 {"embed_moe", {"context"}}})};
  if (name == "pipeline-large-moe")
    return {name,
            {"data", "stage", "fsdp", "context", "tensor", "expert"},
            detail::rules_with_twins({{"activation_batch", {"data", "fsdp", "expert"}},
                                      {"activation_batch_moe", {"data", "fsdp"}},
                                      {"activation_length", {"context"}},
                                      {"activation_norm_length", {"context"}, detail::moe_too},
                                      {"activation_embed", {"tensor"}, detail::moe_too},
                                      {"activation_mlp", {"tensor"}, detail::moe_too},
                                      {"activation_exp", {"expert"}},
                                      {"mlp", {"tensor"}},
                                      {"mlp_no_fsdp", {"tensor"}},
                                      {"embed", {"fsdp", "expert"}},
                                      {"layers", {"stage"}},
                                      {"exp", {"expert"}},
                                      {"mlp_moe", {"tensor"}},
                                      {"embed_moe", {"fsdp"}},
                                      {"exp_with_fsdp", {"fsdp"}}})};
  // EP-TP (MaxText PR #3600; the rules are this library's): outside the routed experts `expert`
  // is tensor parallelism: tokens split D over it (batch over data, fsdp); routed experts and the
  // shared expert's hidden dim (`mlp`, computed TP-style) are stored over it; embed dims on fsdp.
  if (name == "ep-tp")
    return {name,
            {"data", "fsdp", "expert"},
            detail::rules_with_twins(
                {{"activation_batch", {"data", "fsdp"}, detail::moe_too},
                 {"activation_length", {}, detail::moe_too},
                 {"activation_norm_length", {}, detail::moe_too},
                 // activation_exp before the embed rules: [E, B, C, D] keeps E on `expert`.
                 {"activation_exp", {"expert"}},
                 {"activation_embed", {"expert"}, detail::moe_too},
                 {"activation_mlp", {}, detail::moe_too},
                 {"mlp", {"expert"}},
                 {"embed", {"fsdp"}},
                 {"exp", {"expert"}},
                 {"mlp_moe", {}},
                 {"embed_moe", {"fsdp"}},
                 {"exp_with_fsdp", {"fsdp"}}})};
  std::string known;
  for (auto const& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError(
      detail::cat("unknown custom_mesh_and_rule preset '", name, "'; known: ", known));
}

}  // namespace moe::sharding
