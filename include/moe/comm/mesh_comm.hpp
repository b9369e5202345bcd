#pragma once
/// \file
/// MeshComm: a sharding::Mesh (moe/sharding/mesh.hpp) laid over a moe communicator, and the one
/// cache of the communicators of its axis groups (AxisGroup).

#include <moe/comm/communicator.hpp>
#include <moe/error.hpp>
#include <moe/sharding/mesh.hpp>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moe::comm {

/// \brief A communicator over an ordered group of mesh axes (size 1: every call is a no-op).
struct AxisGroup {
  std::vector<std::string> axes;  ///< ordered as in the tensor spec (row-major shard index)
  Communicator comm;              ///< ranks ordered row-major over `axes` (see sharding::Mesh)
  int size() const { return comm.size(); }
  int rank() const { return comm.rank(); }
};

/// \brief A sharding::Mesh laid over a communicator: this rank's coordinates and the cached
/// communicators of its axis groups (made by group(axes) only); copies share those made so far.
class MeshComm {
 public:
  /// \brief Collective: lays `mesh` over a duplicate of `comm`.
  MeshComm(MPI_Comm comm, sharding::Mesh mesh) : MeshComm(Communicator(comm), std::move(mesh)) {}

  /// \brief Collective: lays `mesh` over `comm` (shared, not duplicated). All ranks agree on the
  /// mesh, and its size must equal the communicator's: either failure is the same ConfigError on
  /// every rank, before any other communication.
  MeshComm(Communicator comm, sharding::Mesh mesh)
      : comm_(std::move(comm)), mesh_(std::move(mesh)) {
    check_agreement(comm_, "mesh", canonical(mesh_));
    moe::detail::require<ConfigError>(mesh_.num_ranks() == comm_.size(), "mesh product ",
                                      mesh_.to_string(), " = ", mesh_.num_ranks(),
                                      " does not equal the communicator size ", comm_.size());
    coords_ = mesh_.coords(comm_.rank());
  }

  /// \brief The mesh.
  sharding::Mesh const& mesh() const { return mesh_; }
  /// \brief The parent communicator (rank order = mesh rank order).
  Communicator const& comm() const { return comm_; }
  /// \brief This rank in comm().
  int rank() const { return comm_.rank(); }
  /// \brief This rank's coordinates, mesh order.
  std::vector<int> const& coords() const { return coords_; }
  /// \brief This rank's coordinate on the named axis (0 for an axis the mesh does not have).
  int coord(std::string const& axis) const { return mesh_.coord(comm_.rank(), axis); }

  /// \brief The group of `axes` containing this rank (see sharding::Mesh: ordered row-major over
  /// `axes` as given; axes the mesh lacks count as size 1). Collective over comm() the first time
  /// this ordered list is requested (every rank must make the same first requests in the same
  /// order; a disagreement, or an axis named twice, is the same ConfigError on every rank); later
  /// calls return the cached group, which lives as long as this MeshComm.
  AxisGroup const& group(std::vector<std::string> const& axes) {
    if (auto it = groups_.find(axes); it != groups_.end()) return it->second;
    check_agreement(comm_, "axis list of a first MeshComm::group request", describe(axes));
    // Every rank now holds the same list, so a repeated axis throws the same error everywhere.
    int const color = mesh_.group_index(comm_.rank(), axes);
    int const key = mesh_.rank_in_group(comm_.rank(), axes);
    return groups_.emplace(axes, AxisGroup{axes, comm_.split(color, key)}).first->second;
  }

  /// \brief The cached group of `axes` (not collective); moe::Error when it was never made.
  AxisGroup const& group(std::vector<std::string> const& axes) const {
    auto it = groups_.find(axes);
    if (it == groups_.end())
      throw Error(moe::detail::cat("moe::comm::MeshComm::group: the group of the axes ",
                                   describe(axes), " on mesh ", mesh_.to_string(),
                                   " was never made; request it first with the (collective) "
                                   "non-const group() on every rank"));
    return it->second;
  }

  /// \brief Whether the group of `axes` (this ordered list) has been made.
  bool has_group(std::vector<std::string> const& axes) const {
    return groups_.find(axes) != groups_.end();
  }

 private:
  /// "[fsdp, expert]", "[]" for the empty list.
  static std::string describe(std::vector<std::string> const& axes) {
    std::string s = "[";
    for (std::size_t i = 0; i < axes.size(); ++i) s += (i ? ", " : "") + axes[i];
    return s + "]";
  }
  /// "data=2;fsdp=4": key=value fields, so a disagreement quotes the differing axis.
  static std::string canonical(sharding::Mesh const& m) {
    std::string s;
    for (std::size_t i = 0; i < m.axes().size(); ++i)
      s += (i ? ";" : "") + m.axes()[i].first + "=" + std::to_string(m.axes()[i].second);
    return s;
  }

  Communicator comm_;
  sharding::Mesh mesh_;
  std::vector<int> coords_;
  std::map<std::vector<std::string>, AxisGroup> groups_;
};

}  // namespace moe::comm
