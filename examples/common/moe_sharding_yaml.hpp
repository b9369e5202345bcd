#pragma once
// Loading of MaxText-format sharding configs (`mesh_axes`, `logical_axis_rules`,
// `custom_mesh_and_rule`) for the moe command-line tools. Lives outside the library so that the
// library does not depend on yaml-cpp.
//
//   mesh_axes: ['data', 'fsdp', 'expert']
//   logical_axis_rules: [['activation_batch', ['data', 'fsdp']], ['exp', 'expert'], ['mlp', []]]
//
// A rule's axes are one axis name, a list of names, or [] / null (explicitly unsharded). Other
// keys of the file are ignored.

#include <moe/error.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

namespace moe::cli {

/// What a sharding config file says (keys it lacks are reported as absent).
struct ShardingFile {
  bool has_mesh_axes = false;
  std::vector<std::string> mesh_axes;
  bool has_rules = false;
  sharding::LogicalRules rules;
  std::string custom_mesh_and_rule;  ///< "" when absent
};

namespace detail {

inline std::string scalar(YAML::Node const& n, std::string const& where) {
  if (!n.IsScalar())
    throw ConfigError(moe::detail::cat(where, " must be a string, got a ",
                                       n.IsSequence() ? "list"
                                       : n.IsMap()    ? "mapping"
                                                      : "null"));
  return n.Scalar();
}

}  // namespace detail

/// Reads the sharding keys of a parsed YAML document; `source` names it in error messages.
inline ShardingFile parse_sharding_yaml(YAML::Node const& root, std::string const& source) {
  using detail::scalar;
  ShardingFile f;
  if (root.IsNull()) return f;
  if (!root.IsMap())
    throw ConfigError(
        moe::detail::cat(source, ": a sharding config must be a mapping of key: value"));
  if (auto const axes = root["mesh_axes"]) {
    if (!axes.IsSequence())
      throw ConfigError(moe::detail::cat(source, ": mesh_axes must be a list of axis names"));
    f.has_mesh_axes = true;
    for (std::size_t i = 0; i < axes.size(); ++i) {
      f.mesh_axes.push_back(scalar(axes[i], moe::detail::cat(source, ": mesh_axes[", i, "]")));
      for (std::size_t j = 0; j < i; ++j)
        if (f.mesh_axes[j] == f.mesh_axes[i])
          throw ConfigError(
              moe::detail::cat(source, ": mesh_axes lists '", f.mesh_axes[i], "' twice"));
    }
  }
  if (auto const rules = root["logical_axis_rules"]) {
    if (!rules.IsSequence())
      throw ConfigError(
          moe::detail::cat(source, ": logical_axis_rules must be a list of [name, axes]"));
    f.has_rules = true;
    for (std::size_t i = 0; i < rules.size(); ++i) {
      auto const where = moe::detail::cat(source, ": logical_axis_rules[", i, "]");
      auto const r = rules[i];
      if (!r.IsSequence() || r.size() != 2)
        throw ConfigError(moe::detail::cat(where, " must be a pair [name, axes]"));
      std::string const name = scalar(r[0], where + " name");
      sharding::DimAxes axes;
      auto const a = r[1];
      if (a.IsScalar()) {
        axes.push_back(a.Scalar());
      } else if (a.IsSequence()) {
        for (std::size_t k = 0; k < a.size(); ++k)
          axes.push_back(scalar(a[k], moe::detail::cat(where, " ('", name, "') axis ", k)));
      } else if (!a.IsNull()) {
        throw ConfigError(
            moe::detail::cat(where, " ('", name, "'): axes must be a name, a list of names or []"));
      }
      try {
        f.rules.add(name, axes);
      } catch (ConfigError const& e) {
        throw ConfigError(moe::detail::cat(where, ": ", e.what()));
      }
    }
  }
  if (auto const p = root["custom_mesh_and_rule"]) {
    if (!p.IsNull()) f.custom_mesh_and_rule = scalar(p, source + ": custom_mesh_and_rule");
  }
  return f;
}

/// Parses YAML text (tests, inline configs).
inline ShardingFile parse_sharding_yaml_text(std::string const& text,
                                             std::string const& source = "<text>") {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (YAML::Exception const& e) {
    throw ConfigError(moe::detail::cat(source, " is not valid YAML: ", e.what()));
  }
  return parse_sharding_yaml(root, source);
}

/// Reads a sharding config file. Throws ConfigError when it cannot be read or parsed.
inline ShardingFile load_sharding_yaml(std::string const& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (YAML::BadFile const&) {
    throw ConfigError(moe::detail::cat("cannot read sharding config file '", path, "'"));
  } catch (YAML::Exception const& e) {
    throw ConfigError(
        moe::detail::cat("sharding config file '", path, "' is not valid YAML: ", e.what()));
  }
  return parse_sharding_yaml(root, "'" + path + "'");
}

/// The mesh axes and rules in effect, MaxText-style: a preset (`preset_name`, or else the file's
/// `custom_mesh_and_rule`) replaces mesh axes and rules wholesale; otherwise the file's own
/// `mesh_axes` and `logical_axis_rules` are used as complete lists, each falling back to the
/// library default (base mesh axes, default rules) when the file lacks the key.
inline sharding::Preset effective_sharding(ShardingFile const* file,
                                           std::string const& preset_name) {
  std::string const name = !preset_name.empty() ? preset_name
                           : file               ? file->custom_mesh_and_rule
                                                : std::string();
  if (!name.empty() || !file) return sharding::preset(name);
  sharding::Preset p = sharding::preset("default");
  p.name = "file";
  if (file->has_mesh_axes) p.mesh_axes = file->mesh_axes;
  if (file->has_rules) p.rules = file->rules;
  return p;
}

}  // namespace moe::cli
