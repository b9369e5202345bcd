#pragma once
/// \file
/// Logical-axis rules resolved into PartitionSpecs as Flax's `logical_to_mesh_axes` does for
/// MaxText (SEMANTICS.md §3.1), and MaxText's PartitionSpec utilities. Resolution never looks at
/// a mesh: axes the mesh lacks stay in resolved specs and go away with drop_size_one().

#include <moe/detail/json.hpp>
#include <moe/error.hpp>
#include <moe/sharding/mesh.hpp>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moe::sharding {

/// \brief The mesh axes one tensor dimension is split over, major to minor; empty = unsharded.
using DimAxes = std::vector<std::string>;

/// \brief Per tensor dimension, the mesh axes it is split over (a JAX PartitionSpec).
using PartitionSpec = std::vector<DimAxes>;

/// \brief Logical name of one tensor dimension; std::nullopt (Python `None`): none, unsharded.
using LogicalAxis = std::optional<std::string>;

/// \brief Logical names of a tensor's dimensions, e.g. `{"exp", std::nullopt, "mlp_no_fsdp"}`.
using LogicalAxes = std::vector<LogicalAxis>;

/// \brief One rule: dimensions named `name` are split over `axes` (empty: explicitly unsharded).
struct LogicalRule {
  std::string name;  ///< logical axis name
  DimAxes axes;      ///< mesh axes, major to minor

  friend bool operator==(LogicalRule const& a, LogicalRule const& b) {
    return a.name == b.name && a.axes == b.axes;
  }
};

/// \brief JSON string literal of `s` (quotes, backslashes and control characters escaped).
inline std::string json_string(std::string const& s) { return ::moe::detail::json_text(s); }

/// \brief A PartitionSpec as JSON, per dimension as MaxText writes it: [] -> `null`, one axis ->
/// `"axis"`, several -> `["a", "b"]`.
inline ::moe::detail::ordered_json json(PartitionSpec const& spec) {
  using J = ::moe::detail::ordered_json;
  auto out = J::array();
  for (auto const& dim : spec)
    out.push_back(dim.empty() ? J() : dim.size() == 1 ? J(dim[0]) : J(dim));
  return out;
}

/// \brief json(spec) as text, e.g. `["expert", null, ["a", "b"]]`.
inline std::string to_json(PartitionSpec const& spec) { return detail::json_text(json(spec)); }

/// \brief Ordered list of logical-axis rules (MaxText's `logical_axis_rules`). Rules sharing a
/// name are fallbacks tried in order; order across names decides which dimension gets an axis.
class LogicalRules {
 public:
  /// \brief No rules: everything resolves to unsharded.
  LogicalRules() = default;
  /// \brief Rules in the given order (validated as add() does).
  LogicalRules(std::initializer_list<LogicalRule> rules) {
    for (auto const& r : rules) add(r.name, r.axes);
  }

  /// \brief Appends a rule. Throws ConfigError for an empty name, an empty axis name or an axis
  /// listed twice in one rule.
  LogicalRules& add(std::string name, DimAxes axes) {
    detail::require<ConfigError>(!name.empty(), "logical axis rule ", rules_.size(),
                                 " has an empty name");
    for (std::size_t i = 0; i < axes.size(); ++i) {
      detail::require<ConfigError>(!axes[i].empty(), "logical axis rule '", name,
                                   "' names an empty mesh axis");
      for (std::size_t j = 0; j < i; ++j)
        detail::require<ConfigError>(axes[i] != axes[j], "logical axis rule '", name,
                                     "' lists mesh axis '", axes[i], "' twice");
    }
    rules_.push_back({std::move(name), std::move(axes)});
    return *this;
  }

  /// \brief The rules in order.
  std::vector<LogicalRule> const& rules() const { return rules_; }
  /// \brief Number of rules.
  std::size_t size() const { return rules_.size(); }
  /// \brief Whether there are no rules.
  bool empty() const { return rules_.empty(); }
  /// \brief Whether some rule has this name.
  bool has(std::string const& name) const {
    return std::any_of(rules_.begin(), rules_.end(), [&](auto const& r) { return r.name == name; });
  }
  /// \brief The axis lists of every rule named `name`, in rule order (the fallbacks).
  std::vector<DimAxes> alternatives(std::string const& name) const {
    std::vector<DimAxes> out;
    for (auto const& r : rules_)
      if (r.name == name) out.push_back(r.axes);
    return out;
  }

  /// \brief Resolves a tensor's logical names jointly (Flax `logical_to_mesh_axes`): in rule order,
  /// a rule assigns its axes to its dimension when that is unassigned and none of the axes is used
  /// yet (an empty rule assigns "unsharded"); the rest is unsharded. Throws ConfigError when a
  /// logical name occurs twice in the tensor.
  PartitionSpec resolve(LogicalAxes const& logical) const {
    check_distinct(logical);
    std::vector<bool> assigned(logical.size(), false);
    PartitionSpec spec(logical.size());
    std::vector<std::string> used;
    for (auto const& rule : rules_) {
      auto const dim = static_cast<std::size_t>(
          std::find(logical.begin(), logical.end(), LogicalAxis(rule.name)) - logical.begin());
      if (dim == logical.size() || assigned[dim]) continue;
      bool const free = std::none_of(rule.axes.begin(), rule.axes.end(), [&](auto const& a) {
        return std::find(used.begin(), used.end(), a) != used.end();
      });
      if (!free) continue;
      assigned[dim] = true;
      spec[dim] = rule.axes;
      used.insert(used.end(), rule.axes.begin(), rule.axes.end());
    }
    return spec;
  }

  /// \brief Resolves every dimension on its own (the first step of the
  /// `moe_dispatch_no_expert_sharding` repair; one mesh axis may then serve several dimensions).
  PartitionSpec resolve_each_dim(LogicalAxes const& logical) const {
    check_distinct(logical);
    PartitionSpec spec;
    for (auto const& name : logical) spec.push_back(resolve({name})[0]);
    return spec;
  }

  friend bool operator==(LogicalRules const& a, LogicalRules const& b) {
    return a.rules_ == b.rules_;
  }
  friend bool operator!=(LogicalRules const& a, LogicalRules const& b) { return !(a == b); }

 private:
  static void check_distinct(LogicalAxes const& logical) {
    for (std::size_t i = 0; i < logical.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (logical[i] && logical[j] == logical[i])
          throw ConfigError(detail::cat("logical axis '", *logical[i], "' appears twice (dims ", j,
                                        " and ", i, ") in tensor ", describe(logical),
                                        "; each logical name may name one dimension"));
  }
  static std::string describe(LogicalAxes const& logical) {
    std::string s = "(";
    for (std::size_t i = 0; i < logical.size(); ++i)
      s += (i ? ", " : "") + (logical[i] ? *logical[i] : std::string("None"));
    return s + ")";
  }

  std::vector<LogicalRule> rules_;
};

/// \brief MaxText's merge of model/CLI rules into base rules: every base rule whose name some
/// override rule has is removed, then the overrides are appended in their order.
inline LogicalRules merge_rules(LogicalRules const& base, LogicalRules const& overrides) {
  LogicalRules out;
  for (auto const& r : base.rules())
    if (!overrides.has(r.name)) out.add(r.name, r.axes);
  for (auto const& r : overrides.rules()) out.add(r.name, r.axes);
  return out;
}

/// \brief Parses comma-separated logical names; `None` is a dimension without a logical name.
/// "" is a zero-dimensional tensor. Throws ConfigError for an empty entry ("a,,b").
inline LogicalAxes parse_logical_axes(std::string const& csv) {
  LogicalAxes out;
  if (csv.empty()) return out;
  for (std::size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
    comma = csv.find(',', start);
    std::string const item = csv.substr(start, comma == std::string::npos ? comma : comma - start);
    detail::require<ConfigError>(!item.empty(), "logical axes '", csv,
                                 "' have an empty entry; write None for an unnamed dimension");
    out.push_back(item == "None" ? LogicalAxis() : LogicalAxis(item));
  }
  return out;
}

/// \brief Removes `axes` from every dimension (MaxText `remove_mesh_axes_from_partition_spec`).
inline PartitionSpec remove_mesh_axes(PartitionSpec spec, std::vector<std::string> const& axes) {
  for (auto& dim : spec)
    for (auto const& a : axes) dim.erase(std::remove(dim.begin(), dim.end(), a), dim.end());
  return spec;
}

/// \brief Removes the axes of size 1 in `mesh` (axes the mesh does not have count as size 1), as
/// MaxText does for activation constraints (`remove_size_one_mesh_axis`).
inline PartitionSpec drop_size_one(PartitionSpec spec, Mesh const& mesh) {
  for (auto& dim : spec)
    dim.erase(
        std::remove_if(dim.begin(), dim.end(), [&](auto const& a) { return mesh.size(a) == 1; }),
        dim.end());
  return spec;
}

/// \brief Removes `axis` from the listed dimensions only (a tuple shrinks, a lone axis becomes
/// unsharded); other dimensions keep it. Throws ConfigError for a dimension out of range.
inline PartitionSpec remove_axis_from_dims(PartitionSpec spec, std::string const& axis,
                                           std::vector<int> const& dims) {
  for (int const d : dims) {
    detail::require<ConfigError>(d >= 0 && d < static_cast<int>(spec.size()), "dimension ", d,
                                 " is out of range for the partition spec ", to_json(spec),
                                 " of rank ", spec.size());
    auto& dim = spec[static_cast<std::size_t>(d)];
    dim.erase(std::remove(dim.begin(), dim.end(), axis), dim.end());
  }
  return spec;
}

/// \brief MaxText's `remove_expert_from_partition_spec`: strips `expert` from dimension batch_dim.
inline PartitionSpec remove_expert_from_batch(PartitionSpec spec, int batch_dim = 1) {
  return remove_axis_from_dims(std::move(spec), "expert", {batch_dim});
}

/// \brief Spec of the dense dispatch/MLP tensors `(activation_exp, activation_batch_moe, ...)`:
/// resolved jointly, or (`moe_dispatch_no_expert_sharding`) per dimension without batch `expert`.
inline PartitionSpec resolve_dispatch(LogicalRules const& rules, LogicalAxes const& logical,
                                      bool moe_dispatch_no_expert_sharding) {
  if (!moe_dispatch_no_expert_sharding) return rules.resolve(logical);
  return remove_expert_from_batch(rules.resolve_each_dim(logical), 1);
}

/// \brief Number of shards of one dimension: product of its axes' sizes (missing axes count 1).
inline std::int64_t shard_count(DimAxes const& dim, Mesh const& mesh) {
  std::int64_t n = 1;
  for (auto const& a : dim) n *= mesh.size(a);
  return n;
}

/// \brief Every mesh axis the spec uses, in dimension order.
inline std::vector<std::string> used_axes(PartitionSpec const& spec) {
  std::vector<std::string> out;
  for (auto const& dim : spec) out.insert(out.end(), dim.begin(), dim.end());
  return out;
}

}  // namespace moe::sharding
