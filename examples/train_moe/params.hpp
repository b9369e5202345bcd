#pragma once
// train_moe's parameters: each one a block of a global tensor with its gradient and AdamW
// moments (Param), initialised element-wise from its global index so that every layout starts
// from the same model, and the check that ranks holding the same block agree bitwise.

#include "data.hpp"

#include <moe/comm/communicator.hpp>
#include <moe/detail/hash.hpp>
#include <moe/detail/views.hpp>
#include <moe/tensor_block.hpp>

#include <Kokkos_Core.hpp>

#include <moe/comm/mpi.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace train::detail {

using moe::numel;  // elements of a row-major shape (moe/tensor_block.hpp)

/// Row-major index in the global tensor of the local element i of block b.
inline std::int64_t global_index(moe::TensorBlock const& b, std::int64_t i) {
  std::size_t const r = b.local_shape.size();
  std::int64_t coord[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (std::size_t d = r; d-- > 0;) {
    coord[d] = i % b.local_shape[d];
    i /= b.local_shape[d];
  }
  std::int64_t g = 0;
  for (std::size_t d = 0; d < r; ++d) g = g * b.global_shape[d] + b.offset[d] + coord[d];
  return g;
}

/// How a parameter is initialised (element-wise, from its global index: layout-independent).
struct Init {
  enum Kind { Normal, Ones, Zeros, Window } kind = Normal;
  double std = 1;        ///< Normal: N(0, std^2); Window: row 0 is 1, rows j > 0 N(0, std^2)
  std::int64_t row = 1;  ///< Window: elements per row
};

/// One parameter block and its gradient and AdamW moments (contiguous device memory), with host
/// mirrors for checkpoints.
template <class Scalar>
struct Param {
  using view1 = moe::View1<Scalar, Kokkos::DefaultExecutionSpace::memory_space>;
  using host1 = typename view1::HostMirror;
  std::string name;
  moe::TensorBlock block;
  view1 p, g, m, v;
  host1 p_host, m_host, v_host;
  bool decay = true;
  double replicas = 1;  ///< ranks that hold this same block
  Init init;
};

/// Writes q's initial values (from `seed`, its name and each element's global index) and zeroes
/// its moments.
template <class Scalar>
void initialise(Param<Scalar>& q, std::uint64_t seed) {
  std::uint64_t const id = moe::detail::fnv1a(q.name);
  std::int64_t const n = q.p_host.extent(0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t const g = global_index(q.block, i);
    double v = 0;
    switch (q.init.kind) {
      case Init::Ones:
        v = 1;
        break;
      case Init::Zeros:
        v = 0;
        break;
      case Init::Window:
        v = g < q.init.row ? 1.0 : q.init.std * CounterRng(seed, id, std::uint64_t(g)).normal();
        break;
      default:
        v = q.init.std * CounterRng(seed, id, std::uint64_t(g)).normal();
    }
    q.p_host(i) = Scalar(v);
  }
  Kokkos::deep_copy(q.p, q.p_host);
  Kokkos::deep_copy(q.m, Scalar(0));
  Kokkos::deep_copy(q.v, Scalar(0));
}

/// Collective: whether every parameter block is bitwise identical on the ranks that hold it
/// (refreshes the host mirrors of the values).
template <class Scalar>
bool replicas_consistent(moe::comm::Communicator const& comm, std::vector<Param<Scalar>>& params) {
  using moe::detail::fnv1a;
  std::vector<std::uint64_t> mine;
  for (auto& q : params) {
    Kokkos::deep_copy(q.p_host, q.p);
    std::uint64_t key = fnv1a(q.name);
    key = fnv1a(q.block.offset.data(), q.block.offset.size() * sizeof(std::int64_t), key);
    mine.push_back(key);
    mine.push_back(fnv1a(q.p_host.data(), q.p_host.extent(0) * sizeof(Scalar)));
  }
  std::vector<std::uint64_t> all(mine.size() * std::size_t(comm.size()));
  moe::comm::check_mpi(MPI_Allgather(mine.data(), int(mine.size()), MPI_UINT64_T, all.data(),
                                     int(mine.size()), MPI_UINT64_T, comm.get()),
                       "MPI_Allgather");
  std::map<std::uint64_t, std::uint64_t> seen;
  for (std::size_t i = 0; i < all.size(); i += 2) {
    auto [it, fresh] = seen.emplace(all[i], all[i + 1]);
    if (!fresh && it->second != all[i + 1]) return false;
  }
  return true;
}

}  // namespace train::detail
