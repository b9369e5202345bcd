#pragma once
/// \file
/// Collectives along any dimension of a row-major tensor (viewed as [A, n, C] around dimension d),
/// over a group of mesh axes, with a log of every byte moved. Built on moe::comm (rank-order
/// deterministic) and used by the distributed layer for weight gathers and gradient reductions.

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/views.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace moe::distributed {

/// \brief One collective a step ran: what, over which mesh axes, and the bytes this rank sent.
struct CommRecord {
  std::string what;               ///< e.g. "gather wi_0", "dispatch", "reduce-scatter d_wo"
  std::string kind;               ///< all-gather | reduce-scatter | all-reduce | all-to-all
  std::vector<std::string> axes;  ///< mesh axes of the group
  std::int64_t bytes = 0;         ///< bytes this rank sends
  bool backward = false;          ///< run by backward() (else by forward())
};

/// \brief The records of one forward + backward step.
struct CommLog {
  std::vector<CommRecord> records;
  bool in_backward = false;  ///< phase that add() tags new records with
  void add(std::string what, std::string kind, std::vector<std::string> axes, std::int64_t bytes) {
    records.push_back({std::move(what), std::move(kind), std::move(axes), bytes, in_backward});
  }
  /// Bytes this rank sent in the forward (backward = false) or backward phase.
  std::int64_t bytes(bool backward) const {
    std::int64_t s = 0;
    for (auto const& r : records)
      if (r.backward == backward) s += r.bytes;
    return s;
  }
  std::int64_t total_bytes() const { return bytes(false) + bytes(true); }
};

/// \brief A communicator over an ordered group of mesh axes (size 1: every call is a no-op).
struct AxisGroup {
  std::vector<std::string> axes;  ///< ordered as in the tensor spec (row-major shard index)
  comm::Communicator comm;
  int size() const { return comm.size(); }
  int rank() const { return comm.rank(); }
};

namespace detail {

/// [A, n, C] split of a tensor's extents around dimension d.
struct Split {
  std::int64_t A = 1, n = 1, C = 1;
};
template <class V>
Split split_at(V const& v, int d) {
  Split s;
  for (int r = 0; r < int(V::rank); ++r) {
    std::int64_t const e = std::int64_t(v.extent(r));
    if (r < d)
      s.A *= e;
    else if (r == d)
      s.n = e;
    else
      s.C *= e;
  }
  return s;
}

template <class V>
std::int64_t bytes_of(V const& v) {
  return std::int64_t(v.span()) * std::int64_t(sizeof(typename V::value_type));
}

}  // namespace detail

/// \brief out = in gathered along dimension d over the group (block p at offset p*n along d).
template <class ExecSpace, class InV, class OutV>
void gather_dim(ExecSpace const& space, AxisGroup const& g, InV const& in, OutV const& out, int d,
                CommLog* log, std::string const& what) {
  using T = typename OutV::non_const_value_type;
  using MS = typename OutV::memory_space;
  int const P = g.size();
  if (P == 1) {
    Kokkos::deep_copy(space, out, in);
    return;
  }
  auto const s = detail::split_at(in, d);
  if (log) log->add(what, "all-gather", g.axes, detail::bytes_of(in) * (P - 1));
  View1<T const, MS> src(in.data(), in.span());
  if (s.A == 1) {
    comm::all_gather(g.comm, space, src, View1<T, MS>(out.data(), out.span()));
    return;
  }
  View1<T, MS> buf(Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::reshard::gather"),
                   out.span());
  comm::all_gather(g.comm, space, src, buf);
  T* o = out.data();
  T const* b = buf.data();
  std::int64_t const A = s.A, n = s.n, C = s.C, block = A * n * C;
  Kokkos::parallel_for(
      "moe::reshard::gather_unpack", Kokkos::RangePolicy<ExecSpace>(space, 0, P * block),
      KOKKOS_LAMBDA(std::int64_t i) {
        // buf is [P, A, n, C]; out is [A, P, n, C]
        std::int64_t const p = i / block, r = i % block;
        std::int64_t const a = r / (n * C), rest = r % (n * C);
        o[(a * P + p) * n * C + rest] = b[i];
      });
}

/// \brief out (one block along d) = sum over the group of in's blocks along d (rank order).
template <class ExecSpace, class InV, class OutV>
void reduce_scatter_dim(ExecSpace const& space, AxisGroup const& g, InV const& in, OutV const& out,
                        int d, CommLog* log, std::string const& what) {
  using T = typename OutV::non_const_value_type;
  using MS = typename OutV::memory_space;
  int const P = g.size();
  if (P == 1) {
    Kokkos::deep_copy(space, out, in);
    return;
  }
  auto const s = detail::split_at(out, d);
  if (log) log->add(what, "reduce-scatter", g.axes, detail::bytes_of(out) * (P - 1));
  View1<T, MS> dst(out.data(), out.span());
  if (s.A == 1) {
    comm::reduce_scatter(g.comm, space, View1<T const, MS>(in.data(), in.span()), dst);
    return;
  }
  View1<T, MS> buf(Kokkos::view_alloc(space, Kokkos::WithoutInitializing, "moe::reshard::rs"),
                   in.span());
  T* b = buf.data();
  T const* src = in.data();
  std::int64_t const A = s.A, n = s.n, C = s.C, block = A * n * C;
  Kokkos::parallel_for(
      "moe::reshard::rs_pack", Kokkos::RangePolicy<ExecSpace>(space, 0, P * block),
      KOKKOS_LAMBDA(std::int64_t i) {
        std::int64_t const p = i / block, r = i % block;
        std::int64_t const a = r / (n * C), rest = r % (n * C);
        b[i] = src[(a * P + p) * n * C + rest];
      });
  comm::reduce_scatter(g.comm, space, View1<T const, MS>(buf.data(), buf.span()), dst);
}

/// \brief out = this rank's block along d of in (no communication).
template <class ExecSpace, class InV, class OutV>
void slice_dim(ExecSpace const& space, int P, int p, InV const& in, OutV const& out, int d) {
  using T = typename OutV::non_const_value_type;
  if (P == 1) {
    Kokkos::deep_copy(space, out, in);
    return;
  }
  auto const s = detail::split_at(out, d);
  T* o = out.data();
  T const* src = in.data();
  std::int64_t const n = s.n, C = s.C;
  Kokkos::parallel_for(
      "moe::reshard::slice", Kokkos::RangePolicy<ExecSpace>(space, 0, s.A * n * C),
      KOKKOS_LAMBDA(std::int64_t i) {
        std::int64_t const a = i / (n * C), rest = i % (n * C);
        o[i] = src[(a * P + p) * n * C + rest];
      });
}

/// \brief In-place sum over the group (rank order, bitwise identical on every member).
template <class ExecSpace, class V>
void all_reduce(ExecSpace const& space, AxisGroup const& g, V const& v, CommLog* log,
                std::string const& what) {
  if (g.size() == 1 || v.span() == 0) return;
  using T = typename V::non_const_value_type;
  using MS = typename V::memory_space;
  if (log)
    log->add(what, "all-reduce", g.axes, 2 * detail::bytes_of(v) * (g.size() - 1) / g.size());
  comm::all_reduce(g.comm, space, View1<T, MS>(v.data(), v.span()));
}

}  // namespace moe::distributed
