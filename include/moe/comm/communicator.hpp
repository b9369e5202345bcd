#pragma once
/// \file
/// The communicator moe owns, MPI datatype traits, and the helpers that keep errors collective
/// (any_error, check_agreement). Calls marked "Collective" must be made by every rank of the
/// communicator, in the same order. moe never calls MPI_Init or MPI_Finalize.

#include <moe/bf16.hpp>
#include <moe/detail/hash.hpp>
#include <moe/error.hpp>

#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::comm {

/// \brief Whether T has an MPI datatype (the types moe sends, moe::bf16 as 16 raw bits).
template <class T>
inline constexpr bool has_mpi_type =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::uint64_t> ||
    std::is_same_v<T, char> || std::is_same_v<T, moe::bf16>;

/// \brief The MPI datatype of T (compile error for types without one).
template <class T>
MPI_Datatype mpi_type() {
  static_assert(has_mpi_type<T>,
                "moe::comm::mpi_type<T>: T has no MPI datatype (float, double, int32_t, int64_t, "
                "uint64_t, char and moe::bf16 have one)");
  using std::is_same_v;
  return is_same_v<T, float>           ? MPI_FLOAT
         : is_same_v<T, double>        ? MPI_DOUBLE
         : is_same_v<T, std::int32_t>  ? MPI_INT32_T
         : is_same_v<T, std::int64_t>  ? MPI_INT64_T
         : is_same_v<T, std::uint64_t> ? MPI_UINT64_T
         : is_same_v<T, moe::bf16>     ? MPI_UINT16_T  // MPI has no bf16: its 16 bits, moved as is
                                       : MPI_CHAR;
}

/// \brief Throws moe::CommError naming `call` and MPI's reason when `rc` is not MPI_SUCCESS.
inline void check_mpi(int rc, char const* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0, rank = -1;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  throw CommError(moe::detail::cat("moe::comm: ", call, " failed on world rank ", rank, ": ",
                                   len > 0 ? std::string(text, std::size_t(len)) : "(no text)",
                                   " (MPI error code ", rc, ")"));
}

/// \brief An MPI communicator owned by moe: a duplicate of the user's (so moe's messages never
/// match the user's traffic), shared by copies and freed with the last. Its error handler is
/// MPI_ERRORS_RETURN: a failed MPI call raises moe::CommError on the rank where it failed.
class Communicator {
 public:
  /// \brief Collective over `comm`: duplicates it (MPI_Comm_dup).
  /// \param comm an intra-communicator; MPI must be initialised (moe never calls MPI_Init)
  explicit Communicator(MPI_Comm comm) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    moe::detail::require<Error>(initialized && !finalized,
                                "moe::comm::Communicator: MPI is not initialised (or already "
                                "finalised); call MPI_Init before creating a communicator");
    moe::detail::require<ConfigError>(comm != MPI_COMM_NULL,
                                      "moe::comm::Communicator: the communicator is MPI_COMM_NULL; "
                                      "pass a valid communicator such as MPI_COMM_WORLD");
    MPI_Comm dup = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup");
    adopt(dup);
  }

  /// \brief A communicator of this process alone that needs no MPI: rank 0 of 1 (MoeLayer is a
  /// DistributedMoeLayer on it). any_error, collective_guard, any_rank, check_agreement, split
  /// and the collective checks complete locally; get() throws moe::Error.
  static Communicator local() { return Communicator(); }

  /// \brief This process's rank in the communicator.
  int rank() const { return rank_; }
  /// \brief Number of ranks in the communicator.
  int size() const { return size_; }
  /// \brief Whether this is a local() communicator (no MPI handle behind it).
  bool is_local() const { return !comm_; }
  /// \brief The duplicated MPI handle (owned by moe: do not free it); moe::Error on local().
  MPI_Comm get() const {
    moe::detail::require(comm_ != nullptr,
                         "moe internal error: an MPI call on moe::comm::Communicator::local(), "
                         "which has no MPI handle (only groups of one rank may run on it)");
    return *comm_;
  }

  /// \brief Collective: splits into sub-communicators of the ranks with equal `color`, ordered by
  /// (key, rank). Every rank must pass color >= 0 (checked on all ranks before splitting).
  Communicator split(int color, int key) const;

 private:
  Communicator() = default;  // local()
  struct Adopt {};
  Communicator(Adopt, MPI_Comm owned) { adopt(owned); }
  void adopt(MPI_Comm owned) {
    comm_ = std::shared_ptr<MPI_Comm>(new MPI_Comm(owned), [](MPI_Comm* comm) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      // After MPI_Finalize the handle is dead and freeing it is erroneous: only release the memory.
      if (!finalized && *comm != MPI_COMM_NULL) MPI_Comm_free(comm);
      delete comm;
    });
    check_mpi(MPI_Comm_set_errhandler(owned, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check_mpi(MPI_Comm_rank(owned, &rank_), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(owned, &size_), "MPI_Comm_size");
  }

  std::shared_ptr<MPI_Comm> comm_;
  int rank_ = 0, size_ = 1;
};

/// \brief Which moe exception a collective error is re-thrown as.
enum class ErrorKind : int { error = 1, config = 2, shape = 3, input = 4, io = 5, numeric = 6 };

namespace detail {

/// Longest message carried from the failing rank to the others.
inline constexpr std::size_t max_message = 1 << 16;

[[noreturn]] inline void throw_kind(ErrorKind kind, std::string const& msg) {
  if (kind == ErrorKind::config) throw ConfigError(msg);
  if (kind == ErrorKind::shape) throw ShapeError(msg);
  if (kind == ErrorKind::input) throw InputError(msg);
  if (kind == ErrorKind::io) throw IoError(msg);
  if (kind == ErrorKind::numeric) throw NumericError(msg);
  throw Error(msg);
}

/// Collective: broadcasts a string from `root` (its value on other ranks is ignored).
inline std::string broadcast_string(Communicator const& comm, int root, std::string const& s) {
  std::string out = comm.rank() == root ? s.substr(0, max_message) : std::string();
  auto len = static_cast<std::int64_t>(out.size());
  check_mpi(MPI_Bcast(&len, 1, MPI_INT64_T, root, comm.get()), "MPI_Bcast");
  out.resize(static_cast<std::size_t>(len));
  if (len > 0)
    check_mpi(MPI_Bcast(&out[0], static_cast<int>(len), MPI_CHAR, root, comm.get()), "MPI_Bcast");
  return out;
}

/// Collective, once every rank knows that `root` failed: throws its exception everywhere.
[[noreturn]] inline void rethrow_from(Communicator const& comm, int root, ErrorKind kind,
                                      std::string const& msg) {
  int k = static_cast<int>(kind);
  check_mpi(MPI_Bcast(&k, 1, MPI_INT, root, comm.get()), "MPI_Bcast");
  std::string const text = broadcast_string(comm, root, msg);
  throw_kind(static_cast<ErrorKind>(k),
             moe::detail::cat(text, " [rank ", root, " of ", comm.size(), "]"));
}

/// Collective, one MPI_Allreduce: every rank throws the lowest failing rank's error if any rank
/// failed, else a ShapeError if an `agree` value differs across ranks; returns the OR of `flag`.
inline bool collective_check(Communicator const& comm, char const* who, bool local_failed,
                             std::string const& msg, ErrorKind kind,
                             std::vector<std::pair<char const*, std::int64_t>> const& agree,
                             bool flag = false) {
  if (comm.is_local()) {  // one rank, no MPI: its own checks decide
    if (local_failed) throw_kind(kind, msg);
    return flag;
  }
  std::vector<std::int64_t> v{-static_cast<std::int64_t>(local_failed ? comm.rank() : comm.size()),
                              flag ? 1 : 0};
  for (auto const& a : agree) v.push_back(a.second), v.push_back(-a.second);
  std::vector<std::int64_t> r(v.size());
  check_mpi(MPI_Allreduce(v.data(), r.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_MAX,
                          comm.get()),
            "MPI_Allreduce");
  int const lowest = static_cast<int>(-r[0]);
  if (lowest < comm.size()) rethrow_from(comm, lowest, kind, msg);
  for (std::size_t i = 0; i < agree.size(); ++i) {
    std::int64_t const hi = r[2 + 2 * i], lo = -r[3 + 2 * i];
    if (hi != lo)
      throw ShapeError(moe::detail::cat(who, ": ", agree[i].first, " differs across ranks (from ",
                                        lo, " to ", hi, "); every rank must pass the same value"));
  }
  return r[1] != 0;
}

/// The first difference of two canonical texts: the first differing field of each when both
/// have the same keys, else the text around the first differing character.
inline std::pair<std::string, std::string> first_difference(std::string const& a,
                                                            std::string const& b) {
  auto fields = [](std::string const& text) {  // pieces between ';' or '|': "E=8;K=2|steps=10"
    std::vector<std::string> out(1);
    for (char c : text)
      if (c == ';' || c == '|')
        out.emplace_back();
      else
        out.back() += c;
    return out;
  };
  auto const fa = fields(a), fb = fields(b);
  auto key = [](std::string const& f) { return f.substr(0, f.find('=')); };
  if (fa.size() == fb.size())
    for (std::size_t i = 0; i < fa.size(); ++i)
      if (fa[i] != fb[i] && key(fa[i]) == key(fb[i]) && fa[i].find('=') != std::string::npos)
        return {fa[i], fb[i]};
  auto const p = static_cast<std::size_t>(
      std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
  std::size_t const from = p > 40 ? p - 40 : 0;
  auto piece = [&](std::string const& s) {
    std::string const out = s.substr(from, 120);  // from <= p <= s.size()
    return (from > 0 ? "..." : "") + out + (from + out.size() < s.size() ? "..." : "");
  };
  return {piece(a), piece(b)};
}

}  // namespace detail

/// \brief Collective: when any rank has `local_failed`, every rank throws the lowest failing
/// rank's exception (`kind`, `msg` suffixed " [rank r of N]"); else returns on every rank.
inline void any_error(Communicator const& comm, bool local_failed, std::string const& msg,
                      ErrorKind kind = ErrorKind::error) {
  detail::collective_check(comm, "moe::comm::any_error", local_failed, msg, kind, {});
}

/// \brief Collective: whether `flag` is true on any rank.
inline bool any_rank(Communicator const& comm, bool flag) {
  return detail::collective_check(comm, "moe::comm::any_rank", false, "", ErrorKind::error, {},
                                  flag);
}

/// \brief Collective: runs the purely local `f()` on every rank; if it throws on any rank, every
/// rank throws the exception of the lowest failing rank (same type for moe exceptions, moe::Error
/// otherwise, same message). `f` must not call collectives itself.
template <class F>
void collective_guard(Communicator const& comm, F&& f) {
  try {
    f();
  } catch (std::exception const& e) {  // any_error throws on every rank
    return any_error(comm, true, e.what(),
                     dynamic_cast<ConfigError const*>(&e)    ? ErrorKind::config
                     : dynamic_cast<ShapeError const*>(&e)   ? ErrorKind::shape
                     : dynamic_cast<InputError const*>(&e)   ? ErrorKind::input
                     : dynamic_cast<IoError const*>(&e)      ? ErrorKind::io
                     : dynamic_cast<NumericError const*>(&e) ? ErrorKind::numeric
                                                             : ErrorKind::error);
  } catch (...) {
    return any_error(comm, true, "unknown exception");
  }
  any_error(comm, false, "");
}

/// \brief Collective: checks that `value` (a canonical text of a configuration or a shape) is the
/// same on every rank; else every rank throws the same ConfigError naming `what` (e.g. "layer
/// configuration"), the first rank that differs from rank 0 and the first difference.
inline void check_agreement(Communicator const& comm, std::string const& what,
                            std::string const& value) {
  if (comm.size() == 1) return;  // one rank agrees with itself
  std::uint64_t const mine = moe::detail::fnv1a(value);
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
  check_mpi(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm.get()),
            "MPI_Allgather");
  int const first = static_cast<int>(
      std::find_if(all.begin(), all.end(), [&](auto h) { return h != all[0]; }) - all.begin());
  if (first == comm.size()) return;
  std::string const v0 = detail::broadcast_string(comm, 0, value);
  std::string const vr = detail::broadcast_string(comm, first, value);
  auto const [dr, d0] = detail::first_difference(vr, v0);
  throw ConfigError(moe::detail::cat(
      "moe::comm::check_agreement: the ", what, " differs across ranks: rank ", first, " has \"",
      dr, "\" but rank 0 has \"", d0, "\"; every rank must be given the same ", what));
}

inline Communicator Communicator::split(int color, int key) const {
  any_error(*this, color < 0,
            moe::detail::cat("moe::comm::Communicator::split: color=", color,
                             " is negative; every rank needs a color >= 0"),
            ErrorKind::config);
  if (is_local()) return *this;  // the only split of one rank without MPI: itself
  MPI_Comm out = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(get(), color, key, &out), "MPI_Comm_split");
  return Communicator(Adopt{}, out);
}

}  // namespace moe::comm
