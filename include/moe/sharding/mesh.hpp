#pragma once
/// \file
/// Mesh: ordered named axes with sizes over the ranks (first axis slowest). The *group* of an axis
/// set A holds the ranks whose coordinates differ only on A, ordered row-major over A as given;
/// its *group index* is the row-major index of the other coordinates. Axes not in the mesh count
/// as size 1, as MaxText's unused mesh axes do.

#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace moe::sharding {

/// \brief MaxText's base mesh axes, in their order (used when a config names no `mesh_axes`).
inline std::vector<std::string> const& base_mesh_axes() {
  static std::vector<std::string> const axes(
      {"diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
       "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive"});
  return axes;
}

/// \brief The `ici_*_parallelism` config keys and the mesh axis each one sizes.
inline std::vector<std::pair<std::string, std::string>> const& ici_parallelism_keys() {
  static std::vector<std::pair<std::string, std::string>> const keys{
      {"ici_data_parallelism", "data"},
      {"ici_pipeline_parallelism", "stage"},
      {"ici_fsdp_parallelism", "fsdp"},
      {"ici_fsdp_transpose_parallelism", "fsdp_transpose"},
      {"ici_context_parallelism", "context"},
      {"ici_context_autoregressive_parallelism", "context_autoregressive"},
      {"ici_tensor_parallelism", "tensor"},
      {"ici_tensor_sequence_parallelism", "tensor_sequence"},
      {"ici_expert_parallelism", "expert"},
      {"ici_autoregressive_parallelism", "autoregressive"}};
  return keys;
}

/// \brief Ordered named axes with sizes: the pure (MPI-free) description of a device mesh.
class Mesh {
 public:
  /// \brief An empty mesh: no axes, one rank.
  Mesh() = default;

  /// \brief A mesh from explicit (name, size) pairs, first axis slowest.
  /// \param axes names must be non-empty and distinct, sizes >= 1 (ConfigError otherwise).
  explicit Mesh(std::vector<std::pair<std::string, int>> axes) : axes_(std::move(axes)) {
    std::int64_t product = 1;
    for (std::size_t i = 0; i < axes_.size(); ++i) {
      auto const& [name, size] = axes_[i];
      detail::require<ConfigError>(!name.empty(), "mesh axis ", i, " has an empty name");
      detail::require<ConfigError>(size >= 1, "mesh axis '", name, "' has size ", size,
                                   "; sizes must be >= 1");
      detail::require<ConfigError>(index(name) == static_cast<int>(i), "mesh axis '", name,
                                   "' is listed twice");  // index(): the first of that name
      product *= size;
      detail::require<ConfigError>(product <= std::numeric_limits<int>::max(), "mesh ",
                                   describe(axes_), " spans more than ",
                                   std::numeric_limits<int>::max(), " ranks");
    }
  }

  /// \brief A mesh over `axis_names` with the given sizes (others 1); at most one size may be -1,
  /// which takes what is left of `num_ranks`. Throws ConfigError unless the product is
  /// `num_ranks`, for a size of 0 or below -1, a second -1, or an axis not in `axis_names`.
  static Mesh with_fill(std::vector<std::string> const& axis_names,
                        std::vector<std::pair<std::string, int>> const& sizes, int num_ranks) {
    detail::require<ConfigError>(num_ranks >= 1, "communicator size ", num_ranks, " must be >= 1");
    std::vector<std::pair<std::string, int>> axes;
    for (auto const& n : axis_names) axes.emplace_back(n, 1);
    std::string fill_axis;
    for (auto const& [name, size] : sizes) {
      auto const it = find(axes, name);
      detail::require<ConfigError>(it != axes.end() || size == 1, "mesh axis '", name, "' (size ",
                                   size, ") is not one of the mesh axes [", join(axis_names), "]");
      detail::require<ConfigError>(size >= 1 || size == -1, "mesh axis '", name, "' has size ",
                                   size, "; sizes must be >= 1, or -1 to fill the rest");
      if (size == -1) {
        detail::require<ConfigError>(fill_axis.empty(), "mesh axes '", fill_axis, "' and '", name,
                                     "' are both -1; at most one axis may fill the rest");
        fill_axis = name;
      }
      if (it != axes.end()) it->second = size;
    }
    std::int64_t known = 1;
    for (auto const& a : axes) {
      if (a.second != -1) known *= a.second;
      detail::require<ConfigError>(known <= std::numeric_limits<int>::max(), "mesh product ",
                                   describe(axes), " does not fit in an int (communicator size ",
                                   num_ranks, ")");
    }
    if (!fill_axis.empty()) {
      std::vector<std::pair<std::string, int>> others;
      for (auto const& a : axes)
        if (a.first != fill_axis) others.push_back(a);
      detail::require<ConfigError>(num_ranks % known == 0, "mesh axis '", fill_axis,
                                   "' is -1 but the product of the other axes (", describe(others),
                                   " = ", known, ") does not divide the communicator size ",
                                   num_ranks);
      for (auto& a : axes)
        if (a.second == -1) a.second = static_cast<int>(num_ranks / known);
    } else {
      detail::require<ConfigError>(known == num_ranks, "mesh product ", describe(axes), " = ",
                                   known, " does not equal the communicator size ", num_ranks);
    }
    return Mesh(std::move(axes));
  }

  /// \brief with_fill() from MaxText's `ici_*_parallelism` (key, degree) pairs (keys of
  /// ici_parallelism_keys(); unknown keys throw ConfigError) over the axes `mesh_axes`.
  static Mesh from_ici(std::vector<std::pair<std::string, int>> const& ici, int num_ranks,
                       std::vector<std::string> const& mesh_axes = base_mesh_axes()) {
    std::vector<std::pair<std::string, int>> sizes;
    auto const& keys = ici_parallelism_keys();
    for (auto const& [key, degree] : ici) {
      auto const it = find(keys, key);
      if (it == keys.end()) {
        std::vector<std::string> known;
        for (auto const& k : keys) known.push_back(k.first);
        throw ConfigError(detail::cat("unknown parallelism key '", key, "'; known: ", join(known)));
      }
      detail::require<ConfigError>(find(sizes, it->second) == sizes.end(), "parallelism key '", key,
                                   "' is given twice");
      detail::require<ConfigError>(degree >= 1 || degree == -1, key, "=", degree,
                                   " must be >= 1, or -1 to fill the rest");
      sizes.emplace_back(it->second, degree);
    }
    try {
      return with_fill(mesh_axes, sizes, num_ranks);
    } catch (ConfigError const& e) {
      throw ConfigError(detail::cat("ici_*_parallelism: ", e.what()));
    }
  }

  /// \brief Number of axes.
  int num_axes() const { return static_cast<int>(axes_.size()); }
  /// \brief The (name, size) pairs in mesh order.
  std::vector<std::pair<std::string, int>> const& axes() const { return axes_; }
  /// \brief The axis names in mesh order.
  std::vector<std::string> axis_names() const {
    std::vector<std::string> out;
    for (auto const& a : axes_) out.push_back(a.first);
    return out;
  }
  /// \brief Name of axis i.
  std::string const& name(int i) const { return axes_.at(static_cast<std::size_t>(i)).first; }
  /// \brief Size of axis i.
  int size(int i) const { return axes_.at(static_cast<std::size_t>(i)).second; }
  /// \brief Position of the named axis, -1 when the mesh has no such axis.
  int index(std::string const& axis) const {
    auto const it = find(axes_, axis);
    return it == axes_.end() ? -1 : static_cast<int>(it - axes_.begin());
  }
  /// \brief Size of the named axis; 1 for an axis the mesh does not have.
  int size(std::string const& axis) const {
    int const i = index(axis);
    return i < 0 ? 1 : axes_[static_cast<std::size_t>(i)].second;
  }
  /// \brief Number of ranks the mesh spans (product of the sizes).
  int num_ranks() const {
    std::int64_t p = 1;
    for (auto const& a : axes_) p *= a.second;
    return static_cast<int>(p);
  }

  /// \brief Coordinates of `rank` on every axis, mesh order, first axis slowest.
  std::vector<int> coords(int rank) const {
    check_rank(rank);
    std::vector<int> c(axes_.size());
    for (std::size_t i = axes_.size(); i-- > 0;) {
      c[i] = rank % axes_[i].second;
      rank /= axes_[i].second;
    }
    return c;
  }
  /// \brief Coordinate of `rank` on the named axis (0 for an axis the mesh does not have).
  int coord(int rank, std::string const& axis) const {
    check_rank(rank);
    int const i = index(axis);
    return i < 0 ? 0 : coords(rank)[static_cast<std::size_t>(i)];
  }
  /// \brief The rank at the given coordinates (inverse of coords()).
  int rank_of(std::vector<int> const& coords) const {
    detail::require<ConfigError>(coords.size() == axes_.size(), "coordinates have ", coords.size(),
                                 " entries but the mesh has ", axes_.size(), " axes");
    int r = 0;
    for (std::size_t i = 0; i < axes_.size(); ++i) {
      detail::require<ConfigError>(coords[i] >= 0 && coords[i] < axes_[i].second, "coordinate ",
                                   coords[i], " is out of range for mesh axis '", axes_[i].first,
                                   "' of size ", axes_[i].second);
      r = r * axes_[i].second + coords[i];
    }
    return r;
  }

  /// \brief Number of ranks in one group of the axis set (product of the sizes of `axes`).
  int group_size(std::vector<std::string> const& axes) const {
    check_group(axes);
    std::int64_t p = 1;
    for (auto const& a : axes) p *= size(a);
    return static_cast<int>(p);
  }
  /// \brief Number of distinct groups of the axis set (num_ranks() / group_size(axes)).
  int num_groups(std::vector<std::string> const& axes) const {
    return num_ranks() / group_size(axes);
  }
  /// \brief Position of `rank` inside its group of `axes`: row-major over `axes` in given order.
  int rank_in_group(int rank, std::vector<std::string> const& axes) const {
    check_group(axes);
    check_rank(rank);
    int r = 0;
    for (auto const& a : axes) r = r * size(a) + coord(rank, a);
    return r;
  }
  /// \brief Which group of `axes` contains `rank`: row-major over the other axes, mesh order.
  int group_index(int rank, std::vector<std::string> const& axes) const {
    check_group(axes);
    auto const c = coords(rank);
    int g = 0;
    for (std::size_t i = 0; i < axes_.size(); ++i)
      if (std::find(axes.begin(), axes.end(), axes_[i].first) == axes.end())
        g = g * axes_[i].second + c[i];
    return g;
  }
  /// \brief Global ranks of the group of `axes` that contains `rank`, ordered by rank_in_group.
  std::vector<int> group_members(int rank, std::vector<std::string> const& axes) const {
    int const n = group_size(axes);  // checks the axes first
    auto const base = coords(rank);
    std::vector<int> out(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) {
      auto c = base;
      int rest = k;
      for (std::size_t j = axes.size(); j-- > 0;) {
        if (int const i = index(axes[j]); i >= 0) c[static_cast<std::size_t>(i)] = rest % size(i);
        rest /= size(axes[j]);
      }
      out[static_cast<std::size_t>(k)] = rank_of(c);
    }
    return out;
  }

  /// \brief "data=2 x fsdp=4" (size-1 axes included), "(no axes)" for an empty mesh.
  std::string to_string() const { return axes_.empty() ? "(no axes)" : describe(axes_); }

  friend bool operator==(Mesh const& a, Mesh const& b) { return a.axes_ == b.axes_; }
  friend bool operator!=(Mesh const& a, Mesh const& b) { return !(a == b); }

 private:
  /// The first (name, value) pair of `v` named `name`, or v.end().
  template <class Pairs>
  static auto find(Pairs& v, std::string const& name) -> decltype(v.begin()) {
    return std::find_if(v.begin(), v.end(), [&](auto const& p) { return p.first == name; });
  }
  static std::string join(std::vector<std::string> const& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s;
  }
  static std::string describe(std::vector<std::pair<std::string, int>> const& axes) {
    std::string s;
    for (std::size_t i = 0; i < axes.size(); ++i)
      s += (i ? " x " : "") + axes[i].first + "=" + std::to_string(axes[i].second);
    return s.empty() ? "1" : s;
  }
  void check_rank(int rank) const {
    detail::require<ConfigError>(rank >= 0 && rank < num_ranks(), "rank ", rank,
                                 " is outside the mesh ", to_string(), " of ", num_ranks(),
                                 " ranks");
  }
  static void check_group(std::vector<std::string> const& axes) {
    for (std::size_t i = 0; i < axes.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        detail::require<ConfigError>(axes[i] != axes[j], "axis group lists mesh axis '", axes[i],
                                     "' twice");
  }

  std::vector<std::pair<std::string, int>> axes_;
};

}  // namespace moe::sharding
