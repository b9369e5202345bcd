#pragma once
/// \file
/// Ragged all-to-all of the expert-parallel (EP) dispatch and combine: MaxText's all-to-all
/// parameters as pure functions of the EP x EP traffic matrix (SEMANTICS.md §1.9 items 32-34,
/// exact vectors in §7.4-7.6), and RaggedAllToAll, the plan that moves the rows. Counts are in
/// rows; a receiver with a capacity R keeps R rows at most, lower-rank senders first.

#include <moe/comm/communicator.hpp>
#include <moe/comm/detail/exchange.hpp>
#include <moe/comm/wire.hpp>
#include <moe/detail/counting.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace moe::comm {

/// \brief The four per-peer arrays of one ragged all-to-all call, from one shard's point of view
/// (JAX's ragged_all_to_all convention: output offsets are given on the sender side).
struct AllToAllParams {
  std::vector<std::int64_t> input_offsets;   ///< where my block for peer j starts in my input
  std::vector<std::int64_t> send_sizes;      ///< rows I send to peer j
  std::vector<std::int64_t> output_offsets;  ///< where my block lands in peer j's output
  std::vector<std::int64_t> recv_sizes;      ///< rows I receive from peer j
};

namespace detail {

inline void check_matrix(char const* who, std::vector<std::int64_t> const& M, int ep, int me) {
  moe::detail::require<ConfigError>(ep >= 1, who, ": ep=", ep, " must be >= 1");
  moe::detail::require<ConfigError>(me >= 0 && me < ep, who, ": me=", me,
                                    " is not a shard index in [0, ", ep, ")");
  moe::detail::require<ShapeError>(M.size() == static_cast<std::size_t>(ep) * ep, who,
                                   ": the traffic matrix has ", M.size(),
                                   " entries; it must be ep*ep = ", std::int64_t(ep) * ep,
                                   " (row-major, M[i*ep+j] = rows shard i sends to shard j)");
  for (std::size_t k = 0; k < M.size(); ++k)
    moe::detail::require<ShapeError>(M[k] >= 0, who, ": M[", k / ep, ",", k % ep, "]=", M[k],
                                     " is negative; row counts must be >= 0");
}

inline std::vector<std::int64_t> exclusive_cumsum(std::vector<std::int64_t> const& v) {
  std::vector<std::int64_t> out(v.size());
  std::exclusive_scan(v.begin(), v.end(), out.begin(), std::int64_t(0));
  return out;
}

}  // namespace detail

/// \brief MaxText's `get_all_to_all_params` for a batch sharded over EP (§1.9 items 32.4 / 33).
/// Dispatch: send_sizes = M[me,:], input_offsets = exclusive_cumsum(M[me,:]),
/// output_offsets[j] = sum_{i<me} M[i,j], recv_sizes = M[:,me]; the combine uses M transposed.
/// \param M [ep*ep] row-major, M[i*ep+j] = rows shard i sends to shard j
inline AllToAllParams all_to_all_params(std::vector<std::int64_t> const& M, int ep, int me,
                                        bool is_dispatch) {
  detail::check_matrix("moe::comm::all_to_all_params", M, ep, me);
  auto at = [&](int i, int j) { return is_dispatch ? M[i * ep + j] : M[j * ep + i]; };
  AllToAllParams p;
  p.send_sizes.resize(ep), p.output_offsets.assign(ep, 0), p.recv_sizes.resize(ep);
  for (int j = 0; j < ep; ++j) {
    p.send_sizes[j] = at(me, j);
    p.recv_sizes[j] = at(j, me);
    for (int i = 0; i < me; ++i) p.output_offsets[j] += at(i, j);
  }
  p.input_offsets = detail::exclusive_cumsum(p.send_sizes);
  return p;
}

/// \brief Receiver-side truncation of the traffic matrix to a buffer of R rows (§1.9 item 32.4):
/// per receiver column, the prefix sums over senders are clamped to R and differenced, so
/// higher-rank senders lose their rows first.
/// \return Mt [ep*ep], Mt[i*ep+j] <= M[i*ep+j], sum_i Mt[i*ep+j] = min(R, sum_i M[i*ep+j])
inline std::vector<std::int64_t> truncate_matrix(std::vector<std::int64_t> const& M, int ep,
                                                 std::int64_t R) {
  detail::check_matrix("moe::comm::truncate_matrix", M, ep, 0);
  moe::detail::require<ConfigError>(R >= 0, "moe::comm::truncate_matrix: R=", R,
                                    " must be >= 0 (the receive buffer rows)");
  std::vector<std::int64_t> Mt(M.size()), column(static_cast<std::size_t>(ep));
  for (int j = 0; j < ep; ++j) {
    for (int i = 0; i < ep; ++i) column[i] = M[i * ep + j];
    column = moe::detail::clamp_prefix(std::move(column), R);
    for (int i = 0; i < ep; ++i) Mt[i * ep + j] = column[i];
  }
  return Mt;
}

/// \brief all_to_all_params with a receive buffer of R rows (ragged_buffer_factor > 0): from
/// truncate_matrix(M, ep, R), except the sender-side offsets (the dispatch's input offsets, the
/// combine's output offsets), which come from the untruncated M.
inline AllToAllParams all_to_all_params_truncated(std::vector<std::int64_t> const& M, int ep,
                                                  int me, bool is_dispatch, std::int64_t R) {
  detail::check_matrix("moe::comm::all_to_all_params_truncated", M, ep, me);
  AllToAllParams p = all_to_all_params(truncate_matrix(M, ep, R), ep, me, is_dispatch);
  auto const sender_side =
      is_dispatch ? &AllToAllParams::input_offsets : &AllToAllParams::output_offsets;
  p.*sender_side = all_to_all_params(M, ep, me, is_dispatch).*sender_side;
  return p;
}

/// \brief Parameters of the replicated-batch (decode) combine (§1.9 item 34): shard s's
/// per_shard[s] rows go to every peer, at exclusive_cumsum(per_shard)[s] (an all-gather).
inline AllToAllParams all_to_all_params_replicated(std::vector<std::int64_t> const& per_shard,
                                                   int me) {
  int const ep = static_cast<int>(per_shard.size());
  moe::detail::require<ConfigError>(me >= 0 && me < ep,
                                    "moe::comm::all_to_all_params_replicated: me=", me,
                                    " is not a shard index in [0, ", ep, ")");
  for (int j = 0; j < ep; ++j)
    moe::detail::require<ShapeError>(per_shard[j] >= 0,
                                     "moe::comm::all_to_all_params_replicated: per_shard[", j,
                                     "]=", per_shard[j], " is negative");
  using V = std::vector<std::int64_t>;
  return {V(ep, 0), V(ep, per_shard[me]), V(ep, detail::exclusive_cumsum(per_shard)[me]),
          per_shard};
}

/// \brief Rows of the dispatch receive buffer (MaxText `get_ragged_buffer_size`, §1.9 item 32.3):
/// int(tk * factor) for factor > 0, at most the dropless int(tk * min(ep, E/K)); else the latter.
/// \param tk local routed slots T*K
inline std::int64_t ragged_buffer_size(std::int64_t tk, int ep, int E, int K, double factor) {
  moe::detail::require<ConfigError>(
      tk >= 0 && ep >= 1 && E >= 1 && K >= 1, "moe::comm::ragged_buffer_size: tk=", tk, ", ep=", ep,
      ", E=", E, ", K=", K, " must satisfy tk >= 0 and ep, E, K >= 1");
  std::int64_t const dropless = std::int64_t(ep) * K <= E ? tk * ep : tk * E / K;
  return factor > 0 ? moe::detail::scaled_rows(tk, factor, dropless) : dropless;
}

/// \brief Plan of one ragged all-to-all over a communicator, built once per step and applied to
/// any number of payloads (dispatch forward, its backward, the combine). Construction, forward
/// and reverse are collective, and raise the same exception on every rank on a bad input.
class RaggedAllToAll {
 public:
  /// \brief Collective: plan for consecutive per-peer blocks (block j at sum_{k<j} counts[k]).
  /// \param send_counts [size] rows this rank holds for each peer
  /// \param recv_capacity rows this rank accepts (< 0: unlimited); beyond it, the rows of
  ///        higher-rank senders, and within a sender its last rows, are dropped
  RaggedAllToAll(Communicator const& comm, std::vector<std::int64_t> const& send_counts,
                 std::int64_t recv_capacity = -1)
      : RaggedAllToAll(comm, send_counts, detail::exclusive_cumsum(send_counts), recv_capacity) {}

  /// \brief Collective: plan with explicit block displacements (in rows) in the send buffer.
  /// Blocks may overlap (e.g. the replicated-batch combine), but then reverse() is not available.
  RaggedAllToAll(Communicator const& comm, std::vector<std::int64_t> const& send_counts,
                 std::vector<std::int64_t> const& send_displs, std::int64_t recv_capacity = -1)
      : comm_(comm), send_{send_counts, send_displs} {
    int const P = comm_.size();
    auto const negative = [](std::int64_t x) { return x < 0; };
    bool const bad = send_counts.size() != std::size_t(P) || send_displs.size() != std::size_t(P) ||
                     std::any_of(send_counts.begin(), send_counts.end(), negative) ||
                     std::any_of(send_displs.begin(), send_displs.end(), negative);
    // Counts and the capacity flag in one MPI_Alltoall; a rank with bad input sends -1 counts.
    std::vector<std::int64_t> out(2 * P), in(2 * P);
    for (int j = 0; j < P; ++j) {
      out[2 * j] = bad ? -1 : send_counts[j];
      out[2 * j + 1] = recv_capacity >= 0 ? 1 : 0;
    }
    check_mpi(MPI_Alltoall(out.data(), 2, MPI_INT64_T, in.data(), 2, MPI_INT64_T, comm_.get()),
              "MPI_Alltoall");
    bool any_capped = false;
    recv_.counts.resize(P);
    for (int i = 0; i < P; ++i) {
      if (in[2 * i] < 0)
        detail::rethrow_from(
            comm_, i, ErrorKind::shape,
            moe::detail::cat("moe::comm::RaggedAllToAll: send_counts (", send_counts.size(),
                             " entries) and send_displs (", send_displs.size(),
                             " entries) must have one non-negative entry per rank (", P, ")"));
      recv_.counts[i] = in[2 * i];
      any_capped = any_capped || in[2 * i + 1] != 0;
    }
    kept_ = send_counts;
    if (any_capped) {
      // Each receiver truncates its column and tells every sender how many rows it keeps.
      recv_.counts = moe::detail::clamp_prefix(std::move(recv_.counts), recv_capacity);
      check_mpi(MPI_Alltoall(recv_.counts.data(), 1, MPI_INT64_T, kept_.data(), 1, MPI_INT64_T,
                             comm_.get()),
                "MPI_Alltoall");
    }
    recv_.displs = detail::exclusive_cumsum(recv_.counts);
    recv_total_ = std::accumulate(recv_.counts.begin(), recv_.counts.end(), std::int64_t(0));
    for (int j = 0; j < P; ++j)
      send_extent_ = std::max(send_extent_, send_.displs[j] + send_.counts[j]);
    // The reverse writes every block back: that needs blocks that do not overlap.
    auto const blocks = detail::sorted_blocks(send_);
    for (std::size_t b = 1; b < blocks.size(); ++b)
      reversible_ = reversible_ && blocks[b - 1].second <= blocks[b].first;
  }

  /// \brief The plan's communicator.
  Communicator const& comm() const { return comm_; }
  /// \brief Rows this rank holds for each peer.
  std::vector<std::int64_t> const& send_counts() const { return send_.counts; }
  /// \brief Where each peer's block starts in the send buffer (rows).
  std::vector<std::int64_t> const& send_displs() const { return send_.displs; }
  /// \brief Leading rows of each block that are sent (the rest are dropped by the receiver's cap).
  std::vector<std::int64_t> const& kept_send_counts() const { return kept_; }
  /// \brief Rows arriving from each peer.
  std::vector<std::int64_t> const& recv_counts() const { return recv_.counts; }
  /// \brief Where each peer's rows start in the receive buffer (exclusive cumsum of the counts).
  std::vector<std::int64_t> const& recv_displs() const { return recv_.displs; }
  /// \brief Rows arriving in total: the receive buffer needs at least this many.
  std::int64_t recv_total() const { return recv_total_; }
  /// \brief Rows the send buffer needs: max over peers of displacement + count.
  std::int64_t send_extent() const { return send_extent_; }
  /// \brief Rows of this rank's blocks that the receivers dropped.
  std::int64_t dropped_rows() const {
    return std::accumulate(send_.counts.begin(), send_.counts.end(), std::int64_t(0)) -
           std::accumulate(kept_.begin(), kept_.end(), std::int64_t(0));
  }

  /// \brief Collective: sends each peer's block of `send` to it; the rows arrive packed in peer
  /// order in `recv`, whose rows beyond recv_total() are set to zero.
  /// \param send [>= send_extent(), ...] rows of any trailing shape (the same on every rank)
  /// \param recv [>= recv_total(), ...] same trailing shape; must not overlap `send`
  template <class ExecSpace, class SendView, class RecvView>
  void forward(ExecSpace const& space, SendView const& send, RecvView const& recv,
               Wire wire = Wire::native) const {
    moe::detail::Region region("moe::comm::ragged_all_to_all");
    apply(space, "moe::comm::RaggedAllToAll::forward", false, send, {kept_, send_.displs}, recv,
          recv_, send_extent_, recv_total_, wire);
  }

  /// \brief Collective: the reverse of forward: rows of `in` (laid out as forward's receive
  /// buffer) go back into the rows they were sent from. Rows of `out` that receive nothing
  /// (dropped rows, gaps, rows beyond send_extent()) are set to zero.
  /// \param in  [>= recv_total(), ...]
  /// \param out [>= send_extent(), ...] same trailing shape; must not overlap `in`
  template <class ExecSpace, class InView, class OutView>
  void reverse(ExecSpace const& space, InView const& in, OutView const& out,
               Wire wire = Wire::native) const {
    moe::detail::Region region("moe::comm::ragged_all_to_all::reverse");
    apply(space, "moe::comm::RaggedAllToAll::reverse", true, in, recv_, out, {kept_, send_.displs},
          recv_total_, send_extent_, wire);
  }

 private:
  template <class ExecSpace, class SrcView, class DstView>
  void apply(ExecSpace const& space, char const* who, bool is_reverse, SrcView const& src,
             detail::Blocks const& s, DstView const& dst, detail::Blocks const& r,
             std::int64_t src_rows_needed, std::int64_t dst_rows_needed, Wire wire) const {
    detail::check_view_type<ExecSpace, SrcView>();
    detail::check_view_type<ExecSpace, DstView>();
    using T = typename DstView::non_const_value_type;
    static_assert(std::is_same_v<typename SrcView::non_const_value_type, T> &&
                      !std::is_const_v<typename DstView::value_type>,
                  "moe::comm::RaggedAllToAll: source and destination need the same value type, "
                  "the destination writable");
    using SrcMS = typename SrcView::memory_space;
    using DstMS = typename DstView::memory_space;
    // Plain locals, not structured bindings: `row` is captured by a lambda below (nvcc).
    std::int64_t const src_rows = detail::rows_of(src).first, row = detail::rows_of(src).second;
    auto const [dst_rows, dst_row] = detail::rows_of(dst);
    std::string msg;
    if (!src.span_is_contiguous() || !dst.span_is_contiguous())
      msg = moe::detail::cat(who, ": the views must be contiguous");
    else if (src_rows < src_rows_needed || dst_rows < dst_rows_needed || dst_row != row)
      msg = moe::detail::cat(who, ": source has ", src_rows, " rows of ", row,
                             " elements and destination ", dst_rows, " rows of ", dst_row,
                             "; the plan needs at least ", src_rows_needed, " and ",
                             dst_rows_needed, " rows of equal length");
    else if (detail::overlaps(src, dst.data(), dst.size() * sizeof(T)))
      msg = moe::detail::cat(who, ": source and destination overlap");
    else if (is_reverse && !reversible_)
      msg = moe::detail::cat(who,
                             ": the plan's send blocks overlap, so rows cannot be sent back "
                             "to them; build the plan with disjoint blocks");
    bool const slow = !detail::fits(row, {&s, &r});
    bool const any_slow = detail::collective_check(comm_, who, !msg.empty(), msg, ErrorKind::shape,
                                                   {{"elements per row", row}}, slow);

    std::int64_t const n_src = src_rows_needed * row, n_dst = dst_rows_needed * row;
    auto move = [&](auto const* from, auto* to) {
      detail::exchange_staged<SrcMS, DstMS>(comm_, space, "moe::comm::RaggedAllToAll",
                                            detail::Pattern::alltoallv, from, s, n_src, to, r,
                                            n_dst, row, !any_slow, stage_);
    };
    // Rows already 16-bit travel as they are; wider rows on the bf16 wire through 16-bit copies.
    if (wire == Wire::bf16 && !std::is_same_v<T, bf16>) {
      using moe::detail::alloc;
      auto const s16 = alloc<View1<bf16, SrcMS>>(space, "moe::comm::RaggedAllToAll::s16", n_src);
      auto const d16 = alloc<View1<bf16, DstMS>>(space, "moe::comm::RaggedAllToAll::d16", n_dst);
      detail::convert(space, "moe::comm::RaggedAllToAll::to_bf16", src.data(), s16.data(), n_src);
      move(s16.data(), d16.data());
      detail::convert(space, "moe::comm::RaggedAllToAll::from_bf16", d16.data(), dst.data(), n_dst);
      detail::fence(space, "moe::comm::RaggedAllToAll: converted");
    } else {
      move(src.data(), dst.data());
    }
    // The gaps before each block and after the last (the empty block at dst_rows) are zeroed.
    auto blocks = detail::sorted_blocks(r);
    blocks.emplace_back(dst_rows, dst_rows);
    std::int64_t at = 0;
    for (auto const& b : blocks) {
      std::size_t const gap = b.first > at ? static_cast<std::size_t>((b.first - at) * row) : 0;
      if (gap) Kokkos::deep_copy(space, detail::Flat<T, DstMS>(dst.data() + at * row, gap), T(0));
      at = std::max(at, b.second);
    }
  }

  Communicator comm_;
  detail::Blocks send_, recv_;
  std::vector<std::int64_t> kept_;
  std::int64_t recv_total_ = 0, send_extent_ = 0;
  bool reversible_ = true;
  /// Host staging buffers (send, receive) reused across applications (not thread-safe).
  mutable detail::HostBuffer stage_[2];
};

}  // namespace moe::comm
