#pragma once
/// \file
/// Internals of moe/comm: host staging of device memory and the row exchanges, with their
/// large-count fallback (point-to-point pieces, so no count handed to MPI overflows int).

#include <moe/comm/communicator.hpp>
#include <moe/moe_config.hpp>

#include <moe/detail/compat.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::comm::detail {

/// Tag of moe's point-to-point pieces (matched in posting order, so one tag serves them all).
inline constexpr int exchange_tag = 0x6d6f;

/// Largest count or displacement handed to one MPI call; tests lower it (on every rank alike).
inline std::int64_t& count_limit() {
  static std::int64_t limit = INT_MAX;
  return limit;
}

/// Test hook: stage host memory through separate host buffers as if it were device memory.
inline bool& force_staging() {
  static bool force = false;
  return force;
}

/// Whether memory of MS is staged through host buffers: MPI cannot reach it (or a test says so).
template <class MS>
bool staged() {
  return !(MOE_ENABLE_GPU_AWARE_MPI != 0 ||
           Kokkos::SpaceAccessibility<Kokkos::HostSpace, MS>::accessible) ||
         force_staging();
}

using moe::detail::fence;

template <class T, class MS>
using Flat = Kokkos::View<T*, Kokkos::LayoutRight, MS, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
using HostBuffer = Kokkos::View<char*, Kokkos::HostSpace>;

/// n elements of user memory as MPI sees them: the memory itself, or a staged host copy.
template <class T, class MS>
class MpiRange {
 public:
  /// A range MPI writes to (call finish() after MPI is done); staged in `cache` (grown) if given.
  MpiRange(T* user, std::int64_t n, char const* label, HostBuffer* cache = nullptr)
      : user_(user, static_cast<std::size_t>(n)) {
    if (!staged<MS>()) return;
    std::size_t const bytes = std::max<std::size_t>(user_.size(), 1) * sizeof(T);
    buffer_ = cache && cache->extent(0) >= bytes
                  ? *cache
                  : HostBuffer(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)),
                               bytes);
    if (cache) *cache = buffer_;
  }
  /// A range MPI reads from (copied to the host buffer if staged).
  template <class ExecSpace>
  static MpiRange send(ExecSpace const& space, T const* user, std::int64_t n, char const* label,
                       HostBuffer* cache = nullptr) {
    MpiRange r(const_cast<T*>(user), n, label, cache);
    if (r.is_staged()) Kokkos::deep_copy(space, r.host(), r.user_);
    return r;
  }
  /// Copies what MPI wrote back to user memory (enqueued on `space`; fence before dropping this).
  template <class ExecSpace>
  void finish(ExecSpace const& space) const {
    if (is_staged()) Kokkos::deep_copy(space, user_, host());
  }
  T* data() const { return is_staged() ? host().data() : user_.data(); }
  bool is_staged() const { return buffer_.data() != nullptr; }

 private:
  Flat<T, Kokkos::HostSpace> host() const {
    return Flat<T, Kokkos::HostSpace>(reinterpret_cast<T*>(buffer_.data()), user_.size());
  }

  Flat<T, MS> user_;
  HostBuffer buffer_;
};

/// Row counts and displacements of one side of an all-to-all.
struct Blocks {
  std::vector<std::int64_t> counts, displs;
};

/// The non-empty blocks [displ, displ + count) of one side, sorted.
inline std::vector<std::pair<std::int64_t, std::int64_t>> sorted_blocks(Blocks const& b) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (std::size_t i = 0; i < b.counts.size(); ++i)
    if (b.counts[i] > 0) out.emplace_back(b.displs[i], b.displs[i] + b.counts[i]);
  std::sort(out.begin(), out.end());
  return out;
}

/// Whether every count and displacement (in rows) and the row length fit count_limit().
inline bool fits(std::int64_t row_elems, std::initializer_list<Blocks const*> sides) {
  std::int64_t const limit = count_limit();
  if (row_elems > limit) return false;
  for (Blocks const* b : sides)
    for (std::size_t i = 0; i < b->counts.size(); ++i)
      if (b->counts[i] > limit || b->displs[i] > limit || b->counts[i] + b->displs[i] > limit)
        return false;
  return true;
}

/// A contiguous datatype of one row, freed on scope exit.
struct RowType {
  RowType(MPI_Datatype elem, std::int64_t row_elems) {
    check_mpi(MPI_Type_contiguous(static_cast<int>(row_elems), elem, &type), "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&type), "MPI_Type_commit");
  }
  RowType(RowType const&) = delete;
  RowType& operator=(RowType const&) = delete;
  ~RowType() { MPI_Type_free(&type); }
  MPI_Datatype type = MPI_DATATYPE_NULL;
};

/// Blocks of an all-gather of n rows per rank: the same n rows to every peer, peer i's at i*n.
inline std::pair<Blocks, Blocks> gather_blocks(int P, std::int64_t n) {
  Blocks s{std::vector<std::int64_t>(P, n), std::vector<std::int64_t>(P, 0)}, r = s;
  for (int i = 0; i < P; ++i) r.displs[i] = i * n;
  return {s, r};
}

/// Whether this rank's block to itself already sits where it lands (an all-gather in place: the
/// send range is the rank's own block of the receive range).
template <class T>
bool self_in_place(Communicator const& comm, T const* send, Blocks const& s, T const* recv,
                   Blocks const& r, std::int64_t row_elems) {
  auto const me = static_cast<std::size_t>(comm.rank());
  return send + s.displs[me] * row_elems == recv + r.displs[me] * row_elems;
}

/// The large-count path of every exchange: every block as Irecv, then Isend, pieces of at most
/// count_limit() elements, self-messages too (for GPU-aware MPI) unless the own block is in
/// place already; returns the requests.
template <class T>
std::vector<MPI_Request> post_pieces(Communicator const& comm, T const* send, Blocks const& s,
                                     T* recv, Blocks const& r, std::int64_t row_elems) {
  std::int64_t const piece = count_limit();
  MPI_Datatype const type = mpi_type<T>();
  std::vector<MPI_Request> reqs;
  bool const skip_self = self_in_place(comm, send, s, recv, r, row_elems);
  auto post = [&](auto* buf, Blocks const& b, auto mpi_call, char const* call) {
    for (int peer = 0; peer < comm.size(); ++peer) {
      if (skip_self && peer == comm.rank()) continue;
      std::int64_t const n = b.counts[peer] * row_elems, base = b.displs[peer] * row_elems;
      for (std::int64_t off = 0; off < n; off += piece) {
        reqs.emplace_back();
        check_mpi(mpi_call(buf + base + off, static_cast<int>(std::min(n - off, piece)), type, peer,
                           exchange_tag, comm.get(), &reqs.back()),
                  call);
      }
    }
  };
  post(recv, r, MPI_Irecv, "MPI_Irecv");
  post(send, s, MPI_Isend, "MPI_Isend");
  return reqs;
}

inline void wait_all(std::vector<MPI_Request>& reqs) {
  if (!reqs.empty())
    check_mpi(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE),
              "MPI_Waitall");
  reqs.clear();
}

/// Which MPI collective the fast path uses; the large-count path is the same for all three.
enum class Pattern { alltoallv, alltoall, allgather };

/// Rows of row_elems T: s.counts[j] at s.displs[j] of send go to peer j, r.counts[i] from peer i
/// land at r.displs[i] of recv (regular for alltoall, allgather); `fast` alike on every rank.
template <class T>
void exchange_rows(Communicator const& comm, Pattern pattern, T const* send, Blocks const& s,
                   T* recv, Blocks const& r, std::int64_t row_elems, bool fast) {
  if (!fast) {
    auto reqs = post_pieces(comm, send, s, recv, r, row_elems);
    return wait_all(reqs);
  }
  if (row_elems != 1) {
    // Counts in elements of T when they fit (no derived type to build); otherwise in rows of a
    // contiguous type. Both have the same type signature, so ranks may choose differently.
    Blocks se = s, re = r;
    for (Blocks* b : {&se, &re})
      for (std::size_t i = 0; i < b->counts.size(); ++i)
        b->counts[i] *= row_elems, b->displs[i] *= row_elems;
    if (fits(1, {&se, &re})) return exchange_rows(comm, pattern, send, se, recv, re, 1, true);
  }
  std::optional<RowType> row_type;
  if (row_elems != 1) row_type.emplace(mpi_type<T>(), row_elems);
  MPI_Datatype const row = row_type ? row_type->type : mpi_type<T>();
  int const n = static_cast<int>(s.counts.empty() ? 0 : s.counts[0]);  // alltoall, allgather
  if (pattern == Pattern::alltoall)
    return check_mpi(MPI_Alltoall(send, n, row, recv, n, row, comm.get()), "MPI_Alltoall");
  if (pattern == Pattern::allgather) {
    void const* from = self_in_place(comm, send, s, recv, r, row_elems) ? MPI_IN_PLACE : send;
    return check_mpi(MPI_Allgather(from, n, row, recv, n, row, comm.get()), "MPI_Allgather");
  }
  auto ints = [](auto const& v) { return std::vector<int>(v.begin(), v.end()); };
  auto const sc = ints(s.counts), sd = ints(s.displs), rc = ints(r.counts), rd = ints(r.displs);
  check_mpi(
      MPI_Alltoallv(send, sc.data(), sd.data(), row, recv, rc.data(), rd.data(), row, comm.get()),
      "MPI_Alltoallv");
}

/// exchange_rows between user memory of SrcMS and DstMS, complete on return; staged where MPI
/// cannot reach it (`cache`: a send and a receive buffer kept between calls). `who`: label prefix.
template <class SrcMS, class DstMS, class T, class ExecSpace>
void exchange_staged(Communicator const& comm, ExecSpace const& space, std::string const& who,
                     Pattern pattern, T const* src, Blocks const& s, std::int64_t n_src, T* dst,
                     Blocks const& r, std::int64_t n_dst, std::int64_t row, bool fast,
                     HostBuffer* cache = nullptr) {
  fence(space, (who + ": input ready").c_str());
  auto const send = MpiRange<T, SrcMS>::send(space, src, n_src, (who + "::send").c_str(), cache);
  MpiRange<T, DstMS> const recv(dst, n_dst, (who + "::recv").c_str(), cache ? cache + 1 : nullptr);
  if (send.is_staged()) fence(space, (who + ": staged").c_str());
  exchange_rows(comm, pattern, send.data(), s, recv.data(), r, row, fast);
  recv.finish(space);
  if (recv.is_staged()) fence(space, (who + ": unstaged").c_str());
}

/// Shape of a contiguous LayoutRight view as rows: extent(0) rows of row_elems elements.
template <class View>
std::pair<std::int64_t, std::int64_t> rows_of(View const& v) {
  std::int64_t row = 1;
  for (unsigned d = 1; d < View::rank; ++d) row *= static_cast<std::int64_t>(v.extent(d));
  return {static_cast<std::int64_t>(v.extent(0)), row};
}

/// Whether the elements of `a` and the b_bytes bytes at b_begin share memory.
template <class View>
bool overlaps(View const& a, void const* b_begin, std::size_t b_bytes) {
  auto const* a0 = reinterpret_cast<char const*>(a.data());
  auto const* b0 = static_cast<char const*>(b_begin);
  std::size_t const a_bytes = a.size() * sizeof(typename View::value_type);
  return a_bytes > 0 && b_bytes > 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

/// "[2,3]": the extents of a view, for messages.
template <class View>
std::string shape_of(View const& v) {
  std::string s = "[";
  for (unsigned d = 0; d < View::rank; ++d) s += (d ? "," : "") + std::to_string(v.extent(d));
  return s + "]";
}

/// Compile-time contract shared by the public entry points.
template <class ExecSpace, class View>
constexpr void check_view_type() {
  static_assert(Kokkos::is_view<View>::value, "moe::comm: expected a Kokkos::View");
  static_assert(View::rank >= 1 && View::rank <= 3, "moe::comm: views of rank 1 to 3 only");
  // A View declared without a layout is LayoutLeft on CUDA and HIP: fine at rank 1.
  static_assert(
      std::is_same_v<typename View::array_layout, Kokkos::LayoutRight> ||
          (View::rank == 1 && std::is_same_v<typename View::array_layout, Kokkos::LayoutLeft>),
      "moe::comm: views must be LayoutRight (row-major, contiguous); rank-1 views may "
      "also be LayoutLeft");
  static_assert(has_mpi_type<typename View::non_const_value_type>,
                "moe::comm: the value type needs an MPI datatype (float, double, int32_t, "
                "int64_t)");
  static_assert(Kokkos::SpaceAccessibility<ExecSpace, typename View::memory_space>::accessible,
                "moe::comm: the views must be accessible from the execution space");
}

}  // namespace moe::comm::detail
