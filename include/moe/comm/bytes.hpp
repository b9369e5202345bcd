#pragma once
/// \file
/// Host bytes of any length between ranks (e.g. what a checkpoint moves), in pieces of at most
/// detail::count_limit() bytes: point-to-point (one private tag: a send and its receive are posted
/// in the same order, with the same length), broadcast, and all-gather of one string per rank.

#include <moe/comm/communicator.hpp>
#include <moe/comm/detail/exchange.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace moe::comm {
namespace detail {

/// Tag of send_bytes / recv_bytes, distinct from exchange_tag.
inline constexpr int bytes_tag = 0x636b;

/// Calls call(p, k) for consecutive pieces [p, p + k) of at most count_limit() of n bytes.
template <class Byte, class Call>
void for_pieces(Byte* data, std::size_t n, Call&& call) {
  auto const piece = static_cast<std::size_t>(std::max<std::int64_t>(1, count_limit()));
  for (std::size_t done = 0; done < n; done += piece)
    call(data + done, static_cast<int>(std::min(piece, n - done)));
}

}  // namespace detail

/// \brief Sends \p n bytes at \p data to rank \p dest (blocking; matched by recv_bytes).
inline void send_bytes(Communicator const& comm, int dest, void const* data, std::size_t n) {
  detail::for_pieces(static_cast<char const*>(data), n, [&](char const* p, int k) {
    check_mpi(MPI_Send(p, k, MPI_BYTE, dest, detail::bytes_tag, comm.get()), "MPI_Send");
  });
}

/// \brief Receives \p n bytes from rank \p src into \p data (blocking; matches send_bytes).
inline void recv_bytes(Communicator const& comm, int src, void* data, std::size_t n) {
  detail::for_pieces(static_cast<char*>(data), n, [&](char* p, int k) {
    check_mpi(MPI_Recv(p, k, MPI_BYTE, src, detail::bytes_tag, comm.get(), MPI_STATUS_IGNORE),
              "MPI_Recv");
  });
}

/// \brief Collective: \p root's \p n bytes at \p data, into \p data on every rank (same \p n).
inline void broadcast_bytes(Communicator const& comm, int root, void* data, std::size_t n) {
  detail::for_pieces(static_cast<char*>(data), n, [&](char* p, int k) {
    check_mpi(MPI_Bcast(p, k, MPI_BYTE, root, comm.get()), "MPI_Bcast");
  });
}

/// \brief Collective: \p root's \p bytes, of any length, on every rank (the others' argument is
/// ignored). Unlike the error path's detail::broadcast_string, nothing is cut.
inline std::string broadcast_bytes(Communicator const& comm, int root, std::string bytes) {
  std::int64_t len = static_cast<std::int64_t>(bytes.size());
  check_mpi(MPI_Bcast(&len, 1, MPI_INT64_T, root, comm.get()), "MPI_Bcast");
  bytes.resize(static_cast<std::size_t>(len));
  if (len > 0) broadcast_bytes(comm, root, &bytes[0], bytes.size());
  return bytes;
}

/// \brief Collective: every rank's \p mine, indexed by rank, on every rank.
/// \throws moe::ConfigError on every rank when the strings of all ranks together exceed 2 GiB
///         (MPI_Allgatherv's displacements are int); \p what names them in the message
inline std::vector<std::string> all_gather_bytes(Communicator const& comm, std::string const& mine,
                                                 std::string const& what) {
  int const P = comm.size();
  std::int64_t const len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lens(static_cast<std::size_t>(P));
  check_mpi(MPI_Allgather(&len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, comm.get()),
            "MPI_Allgather");
  std::int64_t const total = std::accumulate(lens.begin(), lens.end(), std::int64_t(0));
  if (total > INT_MAX) throw ConfigError(moe::detail::cat(what, " exceed 2 GiB"));
  std::vector<int> counts(lens.begin(), lens.end()), displs(static_cast<std::size_t>(P));
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), 0);
  std::string buf(static_cast<std::size_t>(total), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), static_cast<int>(len), MPI_CHAR, &buf[0], counts.data(),
                           displs.data(), MPI_CHAR, comm.get()),
            "MPI_Allgatherv");
  std::vector<std::string> out(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) out[r] = buf.substr(displs[r], counts[r]);
  return out;
}

}  // namespace moe::comm
