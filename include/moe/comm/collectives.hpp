#pragma once
/// \file
/// Deterministic collectives on Kokkos views: all_gather, reduce_scatter (sum), all_reduce (sum).
/// MPI only moves data; every sum is computed locally in rank order, so results are bitwise
/// reproducible and all_reduce's identical on every rank. Views: rank 1 to 3, LayoutRight,
/// contiguous, dim 0 the rows; a bad shape on any rank is the same ShapeError on all of them.

#include <moe/comm/communicator.hpp>
#include <moe/comm/detail/exchange.hpp>
#include <moe/comm/segments.hpp>
#include <moe/comm/wire.hpp>
#include <moe/detail/scratch.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace moe::comm {
namespace detail {

/// all_gather of n rows per rank (row elements each) into P*n rows; shapes already agreed.
template <class InMS, class OutMS, class T, class ExecSpace>
void all_gather_rows(Communicator const& comm, ExecSpace const& space, T const* in, T* out,
                     std::int64_t n, std::int64_t row) {
  int const P = comm.size();
  auto const [s, r] = gather_blocks(P, n);
  exchange_staged<InMS, OutMS>(comm, space, "moe::comm::all_gather", Pattern::allgather, in, s,
                               n * row, out, r, P * n * row, row, fits(row, {&s, &r}));
}

/// reduce_scatter of P chunks of c rows into c rows (shapes agreed): rank j sums the P chunks j
/// in rank order. T: the type moved (moe::bf16: summed in fp32, rounded once), U: the output's
/// type. Chunk i of `in` starts at row i * stride (0: i * c, the chunks contiguous).
template <class InMS, class OutMS, class T, class U, class ExecSpace>
void reduce_scatter_rows(Communicator const& comm, ExecSpace const& space, T const* in, U* out,
                         std::int64_t c, std::int64_t row,
                         moe::detail::ScratchPool<OutMS>* pool = nullptr, std::int64_t stride = 0) {
  int const P = comm.size();
  std::int64_t const chunk = c * row, step = stride > 0 ? stride : c;
  char const* parts_label = "moe::comm::reduce_scatter::parts";
  auto const parts = pool ? pool->template get<T>(parts_label, std::size_t(P * chunk))
                          : moe::detail::alloc<View1<T, OutMS>>(space, parts_label, P * chunk);
  Blocks const r = gather_blocks(P, c).second;  // chunk i at i*c
  Blocks s = r;
  for (int i = 0; i < P; ++i) s.displs[std::size_t(i)] = i * step;
  exchange_staged<InMS, OutMS>(
      comm, space, "moe::comm::reduce_scatter", step == c ? Pattern::alltoall : Pattern::alltoallv,
      in, s, ((P - 1) * step + c) * row, parts.data(), r, P * chunk, row, fits(row, {&s, &r}));
  Kokkos::parallel_for(
      "moe::comm::reduce_scatter::sum",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, chunk),
      KOKKOS_LAMBDA(std::int64_t e) {
        using Acc = wire_acc_t<T>;
        Acc acc = WireCast<Acc>::from(parts(e));
        for (int i = 1; i < P; ++i) acc += WireCast<Acc>::from(parts(i * chunk + e));
        out[e] = WireCast<U>::from(WireCast<T>::from(acc));
      });
  // `parts` (and a staging buffer) are released on return: their users must be done.
  fence(space, "moe::comm::reduce_scatter: summed");
}

/// Collective checks of all_gather (`gather`) and reduce_scatter; returns (c, elements per row).
template <class ExecSpace, class InView, class OutView>
std::pair<std::int64_t, std::int64_t> check_row_pair(Communicator const& comm, char const* what,
                                                     InView const& in, OutView const& out,
                                                     bool gather) {
  check_view_type<ExecSpace, InView>();
  check_view_type<ExecSpace, OutView>();
  using T = typename OutView::non_const_value_type;
  using In = typename InView::non_const_value_type;
  static_assert((std::is_same_v<In, T> ||
                 std::is_same_v<In, moe::bf16>)&&!std::is_const_v<typename OutView::value_type> &&
                    int(InView::rank) == int(OutView::rank),
                "moe::comm: in and out need the same value type and rank, out writable");
  auto const [in_rows, in_row] = rows_of(in);
  auto const [out_rows, out_row] = rows_of(out);
  std::int64_t const c = gather ? in_rows : out_rows, n = gather ? out_rows : in_rows;
  int const P = comm.size();
  // An all-gather may be in place: in is exactly this rank's block of out.
  auto const address = [](void const* p) { return reinterpret_cast<std::uintptr_t>(p); };
  bool const in_place =
      gather && std::is_same_v<In, T> &&
      address(in.data()) == address(out.data()) + std::uintptr_t(comm.rank()) *
                                                      std::uintptr_t(c * out_row) * sizeof(T);
  bool const bad = !in.span_is_contiguous() || !out.span_is_contiguous() || n != P * c ||
                   out_row != in_row ||
                   (!in_place && overlaps(in, out.data(), out.size() * sizeof(T)));
  char const* rule = gather ? "out must be [size*n, ...] with the trailing extents of in, both "
                              "contiguous and not overlapping (or in exactly this rank's block "
                              "of out)"
                            : "in must be [size*c, ...] and out [c, ...] with the same trailing "
                              "extents, both contiguous and not overlapping";
  std::string const msg = bad ? moe::detail::cat(what, ": in ", shape_of(in), " and out ",
                                                 shape_of(out), " do not fit ", P, " ranks; ", rule)
                              : std::string();
  collective_check(comm, what, bad, msg, ErrorKind::shape,
                   {{"rows of in", in_rows}, {"elements per row", in_row}});
  return {c, gather ? in_row : out_row};
}

}  // namespace detail

/// \brief Collective: concatenates every rank's `in` along dim 0, in rank order, into `out`.
/// \param in  [n, ...] on every rank (same shape everywhere)
/// \param out [size*n, ...]; must not overlap `in`, unless `in` is exactly this rank's block of
/// it (rows [rank*n, (rank+1)*n)): then the gather is in place and sends that block as it is
template <class ExecSpace, class InView, class OutView>
void all_gather(Communicator const& comm, ExecSpace const& space, InView const& in,
                OutView const& out) {
  moe::detail::Region region("moe::comm::all_gather");
  auto const [n, row] =
      detail::check_row_pair<ExecSpace>(comm, "moe::comm::all_gather", in, out, true);
  detail::all_gather_rows<typename InView::memory_space, typename OutView::memory_space>(
      comm, space, in.data(), out.data(), n, row);
}

/// \brief Collective: sums the ranks' `in` [size*c, ...] elementwise, in rank order, and gives
/// rank r rows [r*c, (r+1)*c) of the sum. `in` may hold moe::bf16 (the bf16 wire) with `out` of
/// a value type: summed in fp32, rounded to bf16 once.
/// \param out [c, ...]; must not overlap `in`
/// \param pool keeps the receive buffer (size*c rows) between calls; nullptr: allocated per call
template <class ExecSpace, class InView, class OutView>
void reduce_scatter(Communicator const& comm, ExecSpace const& space, InView const& in,
                    OutView const& out,
                    moe::detail::ScratchPool<typename OutView::memory_space>* pool = nullptr) {
  moe::detail::Region region("moe::comm::reduce_scatter");
  auto const [c, row] =
      detail::check_row_pair<ExecSpace>(comm, "moe::comm::reduce_scatter", in, out, false);
  detail::reduce_scatter_rows<typename InView::memory_space, typename OutView::memory_space>(
      comm, space, in.data(), out.data(), c, row, pool);
}

/// \brief Collective: replaces `v` (contiguous, the same shape on every rank) by the elementwise
/// sum over ranks, in rank order: the same bits on every rank. Each segment of `v` (see
/// detail::all_reduce_segments) is reduce-scattered into this rank's block of it, then gathered
/// in place; the temporaries are one segment's receive buffer and, where the rank count does
/// not divide the length, a zero-padded copy of the size-mod-ranks elements left at the end.
template <class ExecSpace, class View>
void all_reduce(Communicator const& comm, ExecSpace const& space, View const& v) {
  moe::detail::Region region("moe::comm::all_reduce");
  detail::check_view_type<ExecSpace, View>();
  using T = typename View::non_const_value_type;
  using MS = typename View::memory_space;
  static_assert(!std::is_const_v<typename View::value_type>,
                "moe::comm::all_reduce: the view is reduced in place and must be writable");
  std::int64_t const N = static_cast<std::int64_t>(v.size());
  bool const bad = !v.span_is_contiguous();
  std::string const msg = bad ? moe::detail::cat("moe::comm::all_reduce: the view ",
                                                 detail::shape_of(v), " is not contiguous")
                              : std::string();
  detail::collective_check(comm, "moe::comm::all_reduce", bad, msg, ErrorKind::shape,
                           {{"number of elements", N}});
  int const P = comm.size();
  if (P == 1 || N == 0) return;
  moe::detail::ScratchPool<MS> pool;  // the receive buffer, shared by the segments
  // Sums n elements at data (P divides n): rank r's block reduced in place, then gathered.
  auto const reduce = [&](T* data, std::int64_t n) {
    std::int64_t const c = n / P;
    // The reduce-scatter has received every piece before it writes the sum over its own block.
    T* const mine = data + std::int64_t(comm.rank()) * c;
    detail::reduce_scatter_rows<MS, MS>(comm, space, data, mine, c, 1, &pool);
    detail::all_gather_rows<MS, MS>(comm, space, mine, data, c, 1);
  };
  std::int64_t const head = N - N % P, size = detail::all_reduce_segments(N, P, sizeof(T)).size;
  for (std::int64_t off = 0; off < head; off += size)
    reduce(v.data() + off, std::min(size, head - off));
  if (head == N) return detail::fence(space, "moe::comm::all_reduce: done");
  // The N % P elements left: reduced in a zero-padded copy of P elements.
  detail::Flat<T, MS> const rest(v.data() + head, static_cast<std::size_t>(N - head));
  auto const padded = moe::detail::alloc<View1<T, MS>>(space, "moe::comm::all_reduce::padded", P);
  auto const first = std::make_pair(std::int64_t(0), N - head);
  Kokkos::deep_copy(space, padded, T(0));
  Kokkos::deep_copy(space, Kokkos::subview(padded, first), rest);
  reduce(padded.data(), P);
  Kokkos::deep_copy(space, rest, Kokkos::subview(padded, first));
  detail::fence(space, "moe::comm::all_reduce: done");
}

}  // namespace moe::comm
