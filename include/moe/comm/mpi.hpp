#pragma once
/// \file
/// MPI as moe sees it: `<mpi.h>` when MOE_ENABLE_MPI (moe_config.hpp), else a one-process
/// stand-in for the MPI that moe and its tools use: one rank per communicator, collectives copy
/// the caller's contribution, messages to itself match in order on (communicator, tag), and what
/// could never complete (an unmatched receive or wait, a peer or root other than 0, a truncation)
/// is an error, not a hang. Its functions come in by a using-directive (no clash with a real MPI).

#include <moe/moe_config.hpp>

#if MOE_ENABLE_MPI

#include <mpi.h>  // NOLINT: the one place moe includes it

#else

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <vector>

using MPI_Comm = int;
using MPI_Datatype = int;  ///< the stand-in's datatype is its size in bytes
using MPI_Op = int;
using MPI_Request = int;
using MPI_Info = int;
using MPI_Errhandler = int;
struct MPI_Status {
  int MPI_SOURCE = 0, MPI_TAG = 0, MPI_ERROR = 0;
};

inline constexpr int MPI_SUCCESS = 0, MPI_ERR_RANK = 6, MPI_ERR_ROOT = 7, MPI_ERR_TRUNCATE = 15,
                     MPI_ERR_OTHER = 16, MPI_MAX_ERROR_STRING = 256;
// Handles are macros, as in MPI implementations: `Communicator(MPI_COMM_NULL)` must stay an
// expression, not declare a variable named MPI_COMM_NULL.
#define MPI_COMM_NULL (static_cast<MPI_Comm>(0))
#define MPI_COMM_WORLD (static_cast<MPI_Comm>(1))
#define MPI_COMM_SELF (static_cast<MPI_Comm>(2))
/// A send buffer that says "the data is in the receive buffer already" (one rank: nothing to copy).
#define MPI_IN_PLACE (reinterpret_cast<void*>(1))
inline constexpr int MPI_IDENT = 0, MPI_CONGRUENT = 1, MPI_SIMILAR = 2, MPI_UNEQUAL = 3;
inline constexpr int MPI_COMM_TYPE_SHARED = 1;
inline constexpr MPI_Info MPI_INFO_NULL = 0;
inline constexpr MPI_Request MPI_REQUEST_NULL = 0;
inline constexpr MPI_Errhandler MPI_ERRORS_ARE_FATAL = 1, MPI_ERRORS_RETURN = 2;
inline constexpr MPI_Datatype MPI_DATATYPE_NULL = 0;
inline constexpr MPI_Datatype MPI_CHAR = 1, MPI_BYTE = 1, MPI_INT = sizeof(int),
                              MPI_LONG = sizeof(long), MPI_FLOAT = 4, MPI_DOUBLE = 8,
                              MPI_INT32_T = 4, MPI_INT64_T = 8, MPI_UINT64_T = 8, MPI_UINT16_T = 2;
inline constexpr MPI_Op MPI_SUM = 1, MPI_MAX = 2, MPI_MIN = 3;
inline MPI_Status* const MPI_STATUS_IGNORE = nullptr;
inline MPI_Status* const MPI_STATUSES_IGNORE = nullptr;

namespace moe::comm::serial_mpi {

/// 0: before MPI_Init, 1: initialised, 2: finalised (one per program).
inline int state = 0;
/// The next new communicator handle (duplicates and splits).
inline MPI_Comm next_comm = 3;
/// Error handlers set per communicator (MPI_ERRORS_ARE_FATAL where none was set).
inline std::map<MPI_Comm, MPI_Errhandler> handlers;

/// A message to itself not yet matched: a send or a receive; `request` completes when it
/// matches (0: a blocking send, buffered).
struct Pending {
  MPI_Comm comm = 0;
  int tag = 0;
  char const* data = nullptr;  // an unmatched Isend's buffer (valid until its wait)
  std::vector<char> copy;      // an unmatched MPI_Send's bytes
  char* into = nullptr;        // an unmatched receive's buffer
  long long bytes = 0;
  MPI_Request request = 0;
};
inline std::deque<Pending> sends, recvs;
inline std::set<MPI_Request> open_requests;
inline MPI_Request next_request = 1;
inline bool is_open(MPI_Request r) { return r != MPI_REQUEST_NULL && open_requests.count(r); }

inline int copy(void* to, void const* from, long long n) {
  if (to != from && from != MPI_IN_PLACE && n > 0) std::memmove(to, from, std::size_t(n));
  return MPI_SUCCESS;
}
/// Delivers a send to a receive: MPI_ERR_TRUNCATE when it does not fit.
inline int deliver(char const* from, long long bytes, char* into, long long room) {
  return bytes > room ? MPI_ERR_TRUNCATE : copy(into, from, bytes);
}
inline std::deque<Pending>::iterator match(std::deque<Pending>& q, MPI_Comm comm, int tag) {
  return std::find_if(q.begin(), q.end(),
                      [&](Pending const& p) { return p.comm == comm && p.tag == tag; });
}
/// Removes the just matched entry `it` of `q` and completes both sides' requests; returns `rc`.
inline int matched(std::deque<Pending>& q, std::deque<Pending>::iterator it, MPI_Request* req,
                   int rc) {
  open_requests.erase(it->request);
  q.erase(it);
  if (req) *req = MPI_REQUEST_NULL;
  return rc;
}
/// Queues an unmatched side `p` in `q`, with a new open request in `*req` when it has one.
inline int queue(std::deque<Pending>& q, Pending p, MPI_Request* req) {
  if (req) {
    p.request = *req = next_request++;
    open_requests.insert(p.request);
  }
  q.push_back(std::move(p));
  return MPI_SUCCESS;
}
/// Writes `value` to `*out` and succeeds: most calls of one process do nothing else.
template <class T, class V>
int put(T* out, V value) {
  *out = static_cast<T>(value);
  return MPI_SUCCESS;
}

/// The MPI functions of the stand-in (its state and helpers above stay out of the global scope).
namespace functions {

inline int MPI_Init(int*, char***) { return put(&state, 1); }
inline int MPI_Initialized(int* flag) { return put(flag, state >= 1); }
inline int MPI_Finalize() { return put(&state, 2); }
inline int MPI_Finalized(int* flag) { return put(flag, state == 2); }
[[noreturn]] inline int MPI_Abort(MPI_Comm, int code) {
  std::fflush(nullptr);
  std::_Exit(code);
}
inline double MPI_Wtime() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}
inline int MPI_Error_string(int code, char* text, int* len) {
  char const* what =
      code == MPI_SUCCESS        ? "no error"
      : code == MPI_ERR_RANK     ? "invalid rank (one process: rank 0 only; moe built without MPI)"
      : code == MPI_ERR_ROOT     ? "invalid root (one process: rank 0 only; moe built without MPI)"
      : code == MPI_ERR_TRUNCATE ? "message truncated"
                                 : "a message to itself that nothing can match would wait for "
                                   "ever (one process; moe built without MPI)";
  return put(len, std::snprintf(text, MPI_MAX_ERROR_STRING, "%s", what));
}

inline int MPI_Comm_size(MPI_Comm, int* size) { return put(size, 1); }
inline int MPI_Comm_rank(MPI_Comm, int* rank) { return put(rank, 0); }
inline int MPI_Comm_dup(MPI_Comm, MPI_Comm* out) { return put(out, next_comm++); }
inline int MPI_Comm_split(MPI_Comm, int color, int, MPI_Comm* out) {
  return put(out, color < 0 ? MPI_COMM_NULL : next_comm++);  // MPI_UNDEFINED (< 0): no group
}
inline int MPI_Comm_split_type(MPI_Comm, int, int, MPI_Info, MPI_Comm* out) {
  return put(out, next_comm++);
}
inline int MPI_Comm_free(MPI_Comm* comm) { return put(comm, MPI_COMM_NULL); }
inline int MPI_Comm_compare(MPI_Comm a, MPI_Comm b, int* result) {
  return put(result, a == b ? MPI_IDENT : MPI_CONGRUENT);  // one-process groups are all equal
}
inline int MPI_Comm_set_errhandler(MPI_Comm comm, MPI_Errhandler h) {
  return put(&handlers[comm], h);
}
inline int MPI_Comm_get_errhandler(MPI_Comm comm, MPI_Errhandler* h) {
  return put(h, handlers.count(comm) ? handlers.at(comm) : MPI_ERRORS_ARE_FATAL);
}
inline int MPI_Errhandler_free(MPI_Errhandler* h) { return put(h, 0); }

inline int MPI_Type_contiguous(int count, MPI_Datatype old, MPI_Datatype* out) {
  return put(out, count * old);
}
inline int MPI_Type_commit(MPI_Datatype*) { return MPI_SUCCESS; }
inline int MPI_Type_free(MPI_Datatype* t) { return put(t, MPI_DATATYPE_NULL); }

inline int MPI_Barrier(MPI_Comm) { return MPI_SUCCESS; }
inline int MPI_Bcast(void*, int, MPI_Datatype, int root, MPI_Comm) {
  return root == 0 ? MPI_SUCCESS : MPI_ERR_ROOT;
}
inline int MPI_Allreduce(void const* send, void* recv, int count, MPI_Datatype t, MPI_Op,
                         MPI_Comm) {
  return copy(recv, send, 1LL * count * t);
}
inline int MPI_Allgather(void const* send, int scount, MPI_Datatype st, void* recv, int,
                         MPI_Datatype, MPI_Comm) {
  return copy(recv, send, 1LL * scount * st);
}
inline int MPI_Allgatherv(void const* send, int scount, MPI_Datatype st, void* recv, int const*,
                          int const* displs, MPI_Datatype rt, MPI_Comm) {
  return copy(static_cast<char*>(recv) + 1LL * displs[0] * rt, send, 1LL * scount * st);
}
inline constexpr auto& MPI_Alltoall = MPI_Allgather;  // one rank: the same copy
inline int MPI_Alltoallv(void const* send, int const* scounts, int const* sdispls, MPI_Datatype st,
                         void* recv, int const*, int const* rdispls, MPI_Datatype rt, MPI_Comm) {
  return copy(static_cast<char*>(recv) + 1LL * rdispls[0] * rt,
              static_cast<char const*>(send) + 1LL * sdispls[0] * st, 1LL * scounts[0] * st);
}
inline int MPI_Iallgather(void const* send, int scount, MPI_Datatype st, void* recv, int,
                          MPI_Datatype, MPI_Comm, MPI_Request* req) {
  *req = MPI_REQUEST_NULL;  // complete at once
  return copy(recv, send, 1LL * scount * st);
}
/// A request still open when waited on can never complete (an error, not a hang).
inline int MPI_Wait(MPI_Request* req, MPI_Status*) {
  return is_open(*req) ? MPI_ERR_OTHER : put(req, MPI_REQUEST_NULL);
}
inline int MPI_Waitall(int n, MPI_Request* reqs, MPI_Status*) {
  for (int i = 0; i < n; ++i)
    if (int const rc = MPI_Wait(&reqs[i], nullptr); rc != MPI_SUCCESS) return rc;
  return MPI_SUCCESS;
}
inline int MPI_Testall(int n, MPI_Request* reqs, int* flag, MPI_Status*) {
  *flag = std::none_of(reqs, reqs + n, is_open);
  return *flag ? MPI_Waitall(n, reqs, nullptr) : MPI_SUCCESS;
}

// A null `req` is the blocking call: an unmatched send is buffered, an unmatched receive fails.
inline int MPI_Isend(void const* buf, int n, MPI_Datatype t, int dest, int tag, MPI_Comm comm,
                     MPI_Request* req) {
  if (dest != 0) return MPI_ERR_RANK;
  auto const* from = static_cast<char const*>(buf);
  long long const bytes = 1LL * n * t;
  auto r = match(recvs, comm, tag);
  if (r != recvs.end()) return matched(recvs, r, req, deliver(from, bytes, r->into, r->bytes));
  Pending p{comm, tag, req ? from : nullptr, {}, nullptr, bytes};
  if (!req) p.copy.assign(from, from + bytes);
  return queue(sends, std::move(p), req);
}
inline int MPI_Irecv(void* buf, int n, MPI_Datatype t, int src, int tag, MPI_Comm comm,
                     MPI_Request* req) {
  if (src != 0) return MPI_ERR_RANK;
  auto* into = static_cast<char*>(buf);
  long long const room = 1LL * n * t;
  auto s = match(sends, comm, tag);
  if (s != sends.end())
    return matched(sends, s, req,
                   deliver(s->data ? s->data : s->copy.data(), s->bytes, into, room));
  if (!req) return MPI_ERR_OTHER;  // a blocking receive nothing was sent to: waits for ever
  return queue(recvs, Pending{comm, tag, nullptr, {}, into, room}, req);
}
inline int MPI_Send(void const* buf, int n, MPI_Datatype t, int dest, int tag, MPI_Comm comm) {
  return MPI_Isend(buf, n, t, dest, tag, comm, nullptr);
}
inline int MPI_Recv(void* buf, int n, MPI_Datatype t, int src, int tag, MPI_Comm comm,
                    MPI_Status*) {
  return MPI_Irecv(buf, n, t, src, tag, comm, nullptr);
}

}  // namespace functions
}  // namespace moe::comm::serial_mpi

// The stand-in's functions, visible as MPI's are (and clashing with a real <mpi.h>).
using namespace moe::comm::serial_mpi::functions;  // NOLINT(google-build-using-namespace)

#endif  // MOE_ENABLE_MPI
