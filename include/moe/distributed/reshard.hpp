#pragma once
/// \file
/// Collectives along any dimension d of a row-major tensor (viewed as [A, n, C] around d) over a
/// group of mesh axes, logging the bytes sent, on a native or bf16 wire (comm/wire.hpp).

#include <moe/comm/collectives.hpp>
#include <moe/comm/comm_log.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/comm/iall_gather.hpp>
#include <moe/comm/mesh_comm.hpp>
#include <moe/comm/segments.hpp>
#include <moe/comm/sent_bytes.hpp>
#include <moe/comm/wire.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

namespace moe::distributed {

using comm::AxisGroup;
using comm::CommLog;

namespace detail {

/// [A, n, C] split of a tensor's extents around dimension d.
struct Split {
  std::int64_t A = 1, n = 1, C = 1;
};
template <class V>
Split split_at(V const& v, int d) {
  Split s;
  for (int r = 0; r < int(V::rank); ++r)
    (r < d ? s.A : r == d ? s.n : s.C) *= std::int64_t(v.extent(r));
  return s;
}

/// Copies `rows` spans of `len` elements, src + from(i) to dst + to(i) (element offsets), as D
/// values: the one copy kernel of the reorders and the tiles.
template <class ExecSpace, class S, class D, class From, class To>
void copy_spans(ExecSpace const& space, char const* label, S const* src, D* dst, std::int64_t rows,
                std::int64_t len, From from, To to) {
  using team = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Kokkos::parallel_for(
      label, Kokkos::TeamPolicy<ExecSpace>(space, rows, Kokkos::AUTO),
      KOKKOS_LAMBDA(team const& m) {
        S const* s = src + from(std::int64_t(m.league_rank()));
        D* d = dst + to(std::int64_t(m.league_rank()));
        Kokkos::parallel_for(Kokkos::TeamThreadRange(m, len),
                             [&](std::int64_t e) { d[e] = comm::detail::WireCast<D>::from(s[e]); });
      });
}

/// A row index map as element offsets of rows of `len` elements.
template <class Map>
struct RowOffsets {
  Map map;
  std::int64_t len;
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t i) const { return map(i) * len; }
};

/// Copies `rows` rows of `len` elements, src + from(i) * len to dst + to(i) * len, as D values.
template <class ExecSpace, class S, class D, class From, class To>
void copy_rows(ExecSpace const& space, char const* label, S const* src, D* dst, std::int64_t rows,
               std::int64_t len, From from, To to) {
  copy_spans(space, label, src, dst, rows, len, RowOffsets<From>{from, len},
             RowOffsets<To>{to, len});
}

/// Row index maps between the [P, A] and [A, P] orders of P*A rows.
struct PaToAp {
  std::int64_t P, A;
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t i) const {
    return (i % A) * P + i / A;
  }
};
/// Row a*P + p of [A, P] rows: block p of each a.
struct Block {
  std::int64_t P, p;
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t a) const { return a * P + p; }
};
struct Identity {
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t i) const { return i; }
};

/// One tile of a tensor viewed as [A, P, L] (see comm::detail::Tiles): leading indices
/// [a0, a0 + r) and elements [l0, l0 + w) of each, of all P blocks, as a tile buffer [P, r, w]
/// whose row q = p * r + i is at (q) in the tensor (a copy_spans map; the buffer's: rows()).
struct Tile {
  int P;
  std::int64_t L, a0, l0, r, w;
  KOKKOS_INLINE_FUNCTION std::int64_t operator()(std::int64_t q) const {
    return ((a0 + q % r) * P + q / r) * L + l0;
  }
  RowOffsets<Identity> rows() const { return {Identity{}, w}; }
  std::int64_t elems() const { return P * r * w; }
};

/// Calls f(tile) for each tile of [A, P, L] on elements of `elem_bytes` (comm::detail::tiles).
template <class F>
void for_each_tile(std::int64_t A, std::int64_t L, int P, std::int64_t elem_bytes, F&& f) {
  auto const t = comm::detail::tiles(A, L, P, elem_bytes);
  if (t.piece() == 0) return;  // an empty tensor (alike on every rank)
  for (std::int64_t a0 = 0; a0 < A; a0 += t.rows)
    for (std::int64_t l0 = 0; l0 < L; l0 += t.cols)
      f(Tile{P, L, a0, l0, std::min(t.rows, A - a0), std::min(t.cols, L - l0)});
}

/// Whether two views hold the same element type (a collective between 16-bit routed rows and
/// float buffers needs the bf16 wire, which converts).
template <class InV, class OutV>
inline constexpr bool same_elements =
    std::is_same<typename InV::non_const_value_type, typename OutV::non_const_value_type>::value;

/// A group of one (P = 1): out = in, no communication (returns true).
template <class ExecSpace, class InV, class OutV>
bool copy_if_alone(ExecSpace const& space, int P, InV const& in, OutV const& out) {
  if (P > 1) return false;
  if constexpr (std::is_same<typename InV::memory_space, typename OutV::memory_space>::value &&
                int(InV::rank) == int(OutV::rank)) {
    bool same = in.span_is_contiguous() && out.span_is_contiguous();
    for (unsigned r = 0; r < InV::rank; ++r) same = same && in.extent(r) == out.extent(r);
    if (same) {
      // in may be out itself (a buffer the caller's tensor stands in for): nothing to copy.
      if (static_cast<void const*>(in.data()) != static_cast<void const*>(out.data()))
        moe::detail::copy_into(space, in, out, false);  // on Serial: over the rank's threads
      return true;
    }
  }
  if constexpr (same_elements<InV, OutV>)
    Kokkos::deep_copy(space, out, in);
  else
    throw Error("moe internal error: a copy between element types needs equal contiguous views");
  return true;
}

/// The error of a collective between element types on the native wire (never planned).
inline Error mixed_native_wire() {
  return Error("moe internal error: a collective between float and bf16 rows on the native wire");
}

/// A temporary of n T's: the pool's buffer `key` when there is a pool, else a new View.
template <class T, class ExecSpace, class MS>
View1<T, MS> temporary(ExecSpace const& space, moe::detail::ScratchPool<MS>* pool, char const* key,
                       std::size_t n) {
  if (pool) return pool->template get<T>(key, n);
  return View1<T, MS>(Kokkos::view_alloc(space, Kokkos::WithoutInitializing, std::string(key)), n);
}

/// Bytes of v's values on `wire`.
template <class V>
std::int64_t bytes_of(V const& v, comm::Wire wire = comm::Wire::native) {
  return std::int64_t(v.span()) *
         comm::wire_bytes(wire, std::int64_t(sizeof(typename V::value_type)));
}

/// Records a collective in `log`, when there is one.
inline void record(CommLog* log, std::string const& what, char const* kind, AxisGroup const& g,
                   std::int64_t bytes) {
  if (log) log->add(what, kind, g.axes, bytes);
}

}  // namespace detail

/// \brief out = in gathered along dimension d over the group, on `wire` (bf16: blocks rounded).
/// Where the blocks cannot land in out as they arrive, they are gathered a tile at a time
/// (comm/segments.hpp) through a tile-sized buffer and put in place.
template <class ExecSpace, class InV, class OutV>
void gather_dim(ExecSpace const& space, AxisGroup const& g, InV const& in, OutV const& out, int d,
                CommLog* log, std::string const& what,
                moe::detail::ScratchPool<typename OutV::memory_space>* pool = nullptr,
                comm::Wire wire = comm::Wire::native) {
  using T = typename OutV::non_const_value_type;
  using MS = typename OutV::memory_space;
  int const P = g.size();
  if (detail::copy_if_alone(space, P, in, out)) return;
  auto const s = detail::split_at(in, d);
  std::int64_t const A = s.A, L = s.n * s.C;
  detail::record(log, what, "all-gather", g,
                 comm::sent_bytes::all_gather(detail::bytes_of(in, wire), P));
  // Tiles of W: each rank's piece, contiguous in `in`, sent as it is (`as_is`) or rounded into a
  // 16-bit send buffer; all pieces received into a tile buffer, then put in place in out.
  auto tiled = [&](auto w, bool as_is) {
    using W = decltype(w);
    detail::for_each_tile(A, L, P, sizeof(W), [&](detail::Tile const& t) {
      auto const* piece = in.data() + t.a0 * L + t.l0;
      View1<W const, MS> send;
      if constexpr (std::is_same<typename InV::non_const_value_type, W>::value)
        if (as_is) send = View1<W const, MS>(piece, t.r * t.w);
      if (!send.data()) {
        auto const mine = detail::temporary<W>(space, pool, "moe::reshard::wire_send", t.r * t.w);
        comm::detail::convert(space, "moe::reshard::to_bf16", piece, mine.data(), t.r * t.w);
        send = mine;
      }
      char const* key = as_is ? "moe::reshard::gather" : "moe::reshard::wire_recv";
      auto const got = detail::temporary<W>(space, pool, key, std::size_t(t.elems()));
      comm::all_gather(g.comm, space, send, got);
      detail::copy_spans(space, "moe::reshard::gather_unpack", got.data(), out.data(), P * t.r, t.w,
                         t.rows(), t);
    });
    moe::detail::fence(space, "moe::reshard::gather_dim: unpacked");
  };
  if (wire == comm::Wire::bf16) {
    // A 16-bit out gathered along its rows (A = 1) gets in rounded into its own block and the
    // others' blocks gathered around it, in place.
    using W = moe::bf16;
    if constexpr (std::is_same<T, W>::value)
      if (A == 1) {
        View1<W, MS> const own(out.data() + std::int64_t(g.comm.rank()) * std::int64_t(in.span()),
                               in.span());
        comm::detail::convert(space, "moe::reshard::to_bf16", in.data(), own.data(),
                              std::int64_t(in.span()));
        comm::all_gather(g.comm, space, View1<W const, MS>(own),
                         View1<W, MS>(out.data(), out.span()));
        return;
      }
    return tiled(W{}, false);
  }
  if constexpr (!detail::same_elements<InV, OutV>) {
    throw detail::mixed_native_wire();
  } else {
    // Along the rows (A = 1) the blocks land in out as they arrive.
    if (A == 1)
      return comm::all_gather(g.comm, space, View1<T const, MS>(in.data(), in.span()),
                              View1<T, MS>(out.data(), out.span()));
    tiled(T{}, true);
  }
}

/// \brief An all-gather along dimension 0 in flight: test() progresses, wait() completes it.
template <class T, class MS>
class GatherRowsRequest {
 public:
  bool test() { return wire_.pending() ? wire_.test() : native_.test(); }
  template <class ExecSpace>
  void wait(ExecSpace const& space) {
    if (!wire_.pending()) return native_.wait(space);
    wire_.wait(space);
    comm::detail::convert(space, "moe::reshard::gather_rows_unpack", got_.data(), out_,
                          std::int64_t(got_.span()));
    moe::detail::fence(space, "moe::reshard::gather_rows: unpacked");
  }

  comm::AllGatherRequest<T, MS, MS> native_;
  comm::AllGatherRequest<moe::bf16, MS, MS> wire_;
  View1<moe::bf16, MS> got_;  ///< the bf16 wire: the gathered rows, converted into out_ on wait
  T* out_ = nullptr;
};

/// \brief Starts gather_dim along dimension 0 without blocking (bf16: staged in `pool` `slot`).
template <class ExecSpace, class Pieces, class InV, class OutV>
GatherRowsRequest<typename OutV::non_const_value_type, typename OutV::memory_space>
start_gather_rows(ExecSpace const& space, AxisGroup const& g, Pieces const& pieces, InV const& in,
                  OutV const& out, CommLog* log, std::string const& what,
                  comm::Wire wire = comm::Wire::native,
                  moe::detail::ScratchPool<typename OutV::memory_space>* pool = nullptr,
                  int slot = 0) {
  using T = typename OutV::non_const_value_type;
  using MS = typename OutV::memory_space;
  GatherRowsRequest<T, MS> req;
  if (g.size() > 1)
    detail::record(log, what, "all-gather", g,
                   comm::sent_bytes::all_gather(detail::bytes_of(in, wire), g.size()));
  if (wire != comm::Wire::bf16 || g.size() == 1) {
    req.native_ = pieces.start(space, in, out);
    return req;
  }
  using W = moe::bf16;
  std::string const key = "moe::reshard::igather#" + std::to_string(slot);
  auto const mine = detail::temporary<W>(space, pool, (key + " send").c_str(), in.span());
  req.got_ = detail::temporary<W>(space, pool, (key + " recv").c_str(), out.span());
  req.out_ = out.data();
  comm::detail::convert(space, "moe::reshard::to_bf16", in.data(), mine.data(),
                        std::int64_t(in.span()));
  req.wire_ = pieces.template start_wire<W, MS>(space, mine.data(), req.got_.data());
  return req;
}

/// \brief out (one block along d) = the group's sum of in's blocks (bf16: fp32 sum, rounded once).
/// Unless in can be sent as it is in one piece, it is reduced a tile at a time (comm/segments.hpp):
/// each tile packed into a tile-sized send buffer (or, rows along dimension 0, sent from where
/// they are), its sum written into out's part of it.
template <class ExecSpace, class InV, class OutV>
void reduce_scatter_dim(ExecSpace const& space, AxisGroup const& g, InV const& in, OutV const& out,
                        int d, CommLog* log, std::string const& what,
                        moe::detail::ScratchPool<typename OutV::memory_space>* pool = nullptr,
                        comm::Wire wire = comm::Wire::native) {
  using T = typename OutV::non_const_value_type;
  using MS = typename OutV::memory_space;
  int const P = g.size();
  if (detail::copy_if_alone(space, P, in, out)) return;
  auto const s = detail::split_at(out, d);
  std::int64_t const A = s.A, L = s.n * s.C;
  detail::record(log, what, "reduce-scatter", g,
                 comm::sent_bytes::reduce_scatter(detail::bytes_of(out, wire), P));
  auto tiled = [&](auto w, char const* key) {
    using W = decltype(w);
    // Rows along dim 0 (A = 1) in the wire's type are sent as they are: in one piece, or, where
    // MPI reads them where they are (not staged), a tile of columns of the P blocks at a time.
    if constexpr (std::is_same<typename InV::non_const_value_type, W>::value)
      if (A == 1) {
        View1<W const, MS> const src(in.data(), in.span());
        View1<T, MS> const dst(out.data(), out.span());
        if (comm::detail::tiles(A, L, P, sizeof(W)).whole(A, L))
          return comm::reduce_scatter(g.comm, space, src, dst, pool);
        if (!comm::detail::staged<MS>()) {
          comm::detail::check_row_pair<ExecSpace>(g.comm, "moe::comm::reduce_scatter", src, dst,
                                                  false);
          return detail::for_each_tile(A, L, P, sizeof(W), [&](detail::Tile const& t) {
            comm::detail::reduce_scatter_rows<MS, MS>(g.comm, space, src.data() + t.l0,
                                                      dst.data() + t.l0, t.w, 1, pool, L);
          });
        }
      }
    detail::for_each_tile(A, L, P, sizeof(W), [&](detail::Tile const& t) {
      auto const buf = detail::temporary<W>(space, pool, key, std::size_t(t.elems()));
      detail::copy_spans(space, "moe::reshard::rs_pack", in.data(), buf.data(), P * t.r, t.w, t,
                         t.rows());
      comm::reduce_scatter(g.comm, space, View1<W const, MS>(buf),
                           View1<T, MS>(out.data() + t.a0 * L + t.l0, t.r * t.w), pool);
    });
  };
  if (wire == comm::Wire::bf16) return tiled(moe::bf16{}, "moe::reshard::wire_send");
  if constexpr (!detail::same_elements<InV, OutV>)
    throw detail::mixed_native_wire();
  else
    tiled(T{}, "moe::reshard::rs");
}

/// \brief out = this rank's block along d of in (no communication).
template <class ExecSpace, class InV, class OutV>
void slice_dim(ExecSpace const& space, int P, int p, InV const& in, OutV const& out, int d) {
  if (detail::copy_if_alone(space, P, in, out)) return;
  auto const s = detail::split_at(out, d);
  detail::copy_rows(space, "moe::reshard::slice", in.data(), out.data(), s.A, s.n * s.C,
                    detail::Block{P, p}, detail::Identity{});
}

/// \brief In-place sum over the group (rank order, bitwise identical on every member).
template <class ExecSpace, class V>
void all_reduce(ExecSpace const& space, AxisGroup const& g, V const& v, CommLog* log,
                std::string const& what) {
  if (g.size() == 1 || v.span() == 0) return;
  using T = typename V::non_const_value_type;
  using MS = typename V::memory_space;
  detail::record(log, what, "all-reduce", g,
                 comm::sent_bytes::all_reduce(detail::bytes_of(v), g.size()));
  comm::all_reduce(g.comm, space, View1<T, MS>(v.data(), v.span()));
}

}  // namespace moe::distributed
