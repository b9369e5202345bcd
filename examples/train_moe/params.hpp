#pragma once
// train_moe's parameters: each one a block of a global tensor with its gradient and AdamW
// moments (Param), initialised element-wise from its global index so that every layout starts
// from the same model, and the check that ranks holding the same block agree bitwise.

#include "data.hpp"

#include <moe/bf16.hpp>
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

/// \brief One parameter block and its gradient and AdamW moments (contiguous device memory),
/// with host mirrors for checkpoints.
///
/// A moment stored in bf16 (mu_dtype=bfloat16, or weight_dtype=bfloat16: TrainConfig::bf16_mu,
/// bf16_nu) lives in m16 / v16 (16 bits an element) and m / v are empty; its host mirror
/// m_host / v_host holds its values as Scalar only between to_host (or size_moment_mirrors) and
/// release_moment_mirrors (a checkpoint's save or load), so checkpoints keep their F32 format.
template <class Scalar>
struct Param {
  using view1 = moe::View1<Scalar, Kokkos::DefaultExecutionSpace::memory_space>;
  using host1 = typename view1::HostMirror;
  using view16 = moe::View1<moe::bf16, Kokkos::DefaultExecutionSpace::memory_space>;
  std::string name;
  moe::TensorBlock block;
  view1 p, g, m, v;
  view16 m16, v16;  ///< the moments stored in bf16 (then m, v are empty)
  host1 p_host, m_host, v_host;
  bool decay = true;
  bool bf16_weights = false;  ///< weight_dtype=bfloat16: p is kept bf16-representable
  double replicas = 1;        ///< ranks that hold this same block
  Init init;

  std::int64_t size() const { return std::int64_t(p.extent(0)); }
  /// Bytes of the two AdamW moments of this block.
  std::int64_t moment_bytes() const {
    return std::int64_t(m.span() * sizeof(Scalar) + v.span() * sizeof(Scalar) +
                        m16.span() * sizeof(moe::bf16) + v16.span() * sizeof(moe::bf16));
  }
};

/// `x` rounded to the nearest bf16 (ties to even), as Scalar.
template <class Scalar>
KOKKOS_INLINE_FUNCTION Scalar round_bf16(Scalar x) {
  return Scalar(float(moe::bf16(float(x))));
}

/// Host values of one moment: the device view's (Scalar storage: copied into its mirror) or the
/// bf16 view's, widened into `host` (allocated here).
template <class Scalar>
void moment_to_host(typename Param<Scalar>::view1 const& d,
                    typename Param<Scalar>::view16 const& d16, typename Param<Scalar>::host1& host,
                    std::string const& label) {
  if (!d16.data()) {
    Kokkos::deep_copy(host, d);
    return;
  }
  auto h16 = Kokkos::create_mirror_view(d16);
  Kokkos::deep_copy(h16, d16);
  if (host.extent(0) != d16.extent(0))
    host = typename Param<Scalar>::host1(Kokkos::view_alloc(Kokkos::WithoutInitializing, label),
                                         d16.extent(0));
  for (std::size_t i = 0; i < h16.extent(0); ++i) host(i) = Scalar(float(h16(i)));
}

/// The device moment from its host values (bf16 storage: rounded to nearest even).
template <class Scalar>
void moment_from_host(typename Param<Scalar>::view1 const& d,
                      typename Param<Scalar>::view16 const& d16,
                      typename Param<Scalar>::host1 const& host) {
  if (!d16.data()) {
    Kokkos::deep_copy(d, host);
    return;
  }
  auto h16 = Kokkos::create_mirror_view(d16);
  for (std::size_t i = 0; i < h16.extent(0); ++i) h16(i) = moe::bf16(float(host(i)));
  Kokkos::deep_copy(d16, h16);
}

/// The parameter and both moments of q into its host mirrors (see Param).
template <class Scalar>
void to_host(Param<Scalar>& q) {
  Kokkos::deep_copy(q.p_host, q.p);
  moment_to_host<Scalar>(q.m, q.m16, q.m_host, "train::mu_host." + q.name);
  moment_to_host<Scalar>(q.v, q.v16, q.v_host, "train::nu_host." + q.name);
}

/// The parameter and both moments of q from its host mirrors; with bf16 weights the parameter
/// is rounded to bf16 (a checkpoint of float32 weights resumed with weight_dtype=bfloat16).
template <class Scalar>
void from_host(Param<Scalar>& q) {
  if (q.bf16_weights)
    for (std::size_t i = 0; i < q.p_host.extent(0); ++i) q.p_host(i) = round_bf16(q.p_host(i));
  Kokkos::deep_copy(q.p, q.p_host);
  moment_from_host<Scalar>(q.m, q.m16, q.m_host);
  moment_from_host<Scalar>(q.v, q.v16, q.v_host);
}

/// Sizes the host mirrors of q's bf16 moments for a load (their values are written by it).
template <class Scalar>
void size_moment_mirrors(Param<Scalar>& q) {
  using host1 = typename Param<Scalar>::host1;
  auto const n = std::size_t(q.size());
  if (q.m16.data() && q.m_host.extent(0) != n) q.m_host = host1("train::mu_host." + q.name, n);
  if (q.v16.data() && q.v_host.extent(0) != n) q.v_host = host1("train::nu_host." + q.name, n);
}

/// Frees the host mirrors of q's bf16 moments (they exist only during a checkpoint's save or
/// load: bf16 moments keep their memory halved between checkpoints).
template <class Scalar>
void release_moment_mirrors(Param<Scalar>& q) {
  if (q.m16.data()) q.m_host = typename Param<Scalar>::host1();
  if (q.v16.data()) q.v_host = typename Param<Scalar>::host1();
}

/// Writes q's initial values (from `seed`, its name and each element's global index; bf16 weights:
/// rounded to bf16, as MaxText initialises in weight_dtype) and zeroes its moments.
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
    q.p_host(i) = q.bf16_weights ? round_bf16(Scalar(v)) : Scalar(v);
  }
  Kokkos::deep_copy(q.p, q.p_host);
  if (q.m.data()) Kokkos::deep_copy(q.m, Scalar(0));
  if (q.v.data()) Kokkos::deep_copy(q.v, Scalar(0));
  if (q.m16.data()) Kokkos::deep_copy(q.m16, moe::bf16::from_bits(0));
  if (q.v16.data()) Kokkos::deep_copy(q.v16, moe::bf16::from_bits(0));
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
