#pragma once
/// \file
/// Non-blocking all_gather on Kokkos views: iall_gather returns an AllGatherRequest that test()
/// drives and wait() completes. Most MPIs progress it only inside MPI calls: to overlap it with
/// computation, call test() between pieces of the work.

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/comm/detail/exchange.hpp>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace moe::comm {

/// \brief One all-gather in flight (see iall_gather). Move-only; destroying a request that was
/// not waited for waits for it (MPI must not write into freed memory), without unstaging.
template <class T, class InMS, class OutMS>
class AllGatherRequest {
 public:
  AllGatherRequest() = default;
  AllGatherRequest(AllGatherRequest&& o) noexcept { *this = std::move(o); }
  AllGatherRequest& operator=(AllGatherRequest&& o) noexcept {
    if (this != &o) {
      abandon();
      reqs_ = std::exchange(o.reqs_, {});
      send_ = std::exchange(o.send_, std::nullopt);
      recv_ = std::exchange(o.recv_, std::nullopt);
    }
    return *this;
  }
  ~AllGatherRequest() { abandon(); }

  /// \brief Lets MPI progress the gather; true once it has completed (then wait() only unstages).
  bool test() {
    if (reqs_.empty()) return true;
    int flag = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE),
              "MPI_Testall");
    if (flag) reqs_.clear();
    return flag != 0;
  }

  /// \brief Completes the gather: `out` holds every rank's block when this returns (fenced).
  template <class ExecSpace>
  void wait(ExecSpace const& space) {
    if (!pending()) return;
    detail::wait_all(reqs_);
    recv_->finish(space);
    if (recv_->is_staged()) detail::fence(space, "moe::comm::iall_gather: unstaged");
    send_.reset();
    recv_.reset();
  }

  /// Whether the gather was started and not yet waited for.
  bool pending() const { return send_.has_value(); }

  /// Internal (see AllGatherPieces): starts gathering n rows of `row` elements per rank.
  template <class ExecSpace>
  AllGatherRequest(Communicator const& comm, ExecSpace const& space, T const* in, T* out,
                   std::int64_t n, std::int64_t row) {
    int const P = comm.size();
    std::int64_t const count = n * row, limit = detail::count_limit();
    detail::fence(space, "moe::comm::iall_gather: input ready");
    send_.emplace(
        detail::MpiRange<T, InMS>::send(space, in, count, "moe::comm::iall_gather::send"));
    recv_.emplace(out, P * count, "moe::comm::iall_gather::recv");
    if (send_->is_staged()) detail::fence(space, "moe::comm::iall_gather: staged");
    T const* s = send_->data();
    T* r = recv_->data();
    MPI_Datatype const type = mpi_type<T>();
    if (count <= limit && P * count <= limit) {
      reqs_.resize(1);
      int const c = static_cast<int>(count);
      check_mpi(MPI_Iallgather(s, c, type, r, c, type, comm.get(), reqs_.data()), "MPI_Iallgather");
    } else {  // large counts: point-to-point pieces of at most count_limit() elements
      auto const [sb, rb] = detail::gather_blocks(P, n);
      reqs_ = detail::post_pieces(comm, s, sb, r, rb, row);
    }
  }

 private:
  void abandon() noexcept {
    if (!reqs_.empty())
      MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
    reqs_.clear();
  }

  std::vector<MPI_Request> reqs_;
  std::optional<detail::MpiRange<T, InMS>> send_;
  std::optional<detail::MpiRange<T, OutMS>> recv_;
};

/// \brief The agreed shape of an all-gather started in pieces (e.g. one per D-chunk of the
/// tokens): checked collectively once, from the first piece's views; each piece locally.
template <class T, class InMS, class OutMS>
class AllGatherPieces {
 public:
  /// Collective. `in` [n, ...] and `out` [size*n, ...] as in iall_gather.
  template <class ExecSpace, class InView, class OutView>
  AllGatherPieces(Communicator const& comm, ExecSpace const&, InView const& in, OutView const& out)
      : comm_(&comm) {
    std::tie(n_, row_) =
        detail::check_row_pair<ExecSpace>(comm, "moe::comm::iall_gather", in, out, true);
  }

  /// \brief Starts gathering every rank's piece `in` into `out` (see iall_gather).
  template <class ExecSpace, class InView, class OutView>
  AllGatherRequest<T, InMS, OutMS> start(ExecSpace const& space, InView const& in,
                                         OutView const& out) const {
    moe::detail::require<ShapeError>(
        detail::rows_of(in) == std::pair(n_, row_) &&
            detail::rows_of(out) == std::pair(comm_->size() * n_, row_) &&
            in.span_is_contiguous() && out.span_is_contiguous(),
        "moe::comm::AllGatherPieces: a piece in ", detail::shape_of(in), " / out ",
        detail::shape_of(out), " differs from the agreed ", n_, " rows of ", row_, " elements");
    return AllGatherRequest<T, InMS, OutMS>(*comm_, space, in.data(), out.data(), n_, row_);
  }

  /// \brief Starts gathering a piece already converted to its wire type W (comm/wire.hpp): `in`
  /// holds the agreed n rows of the piece as W, `out` receives size*n such rows.
  template <class W, class MS, class ExecSpace>
  AllGatherRequest<W, MS, MS> start_wire(ExecSpace const& space, W const* in, W* out) const {
    return AllGatherRequest<W, MS, MS>(*comm_, space, in, out, n_, row_);
  }

 private:
  Communicator const* comm_;
  std::int64_t n_ = 0, row_ = 0;
};

/// \brief Collective: starts all_gather(comm, space, in, out); `out` is defined once the request's
/// wait() returns, and until then `in` must stay unchanged and `out` untouched.
template <class ExecSpace, class InView, class OutView>
auto iall_gather(Communicator const& comm, ExecSpace const& space, InView const& in,
                 OutView const& out) {
  moe::detail::Region region("moe::comm::iall_gather");
  return AllGatherPieces<typename OutView::non_const_value_type, typename InView::memory_space,
                         typename OutView::memory_space>(comm, space, in, out)
      .start(space, in, out);
}

}  // namespace moe::comm
