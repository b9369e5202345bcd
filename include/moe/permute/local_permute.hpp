#pragma once
/// \file
/// Local permute after the expert-parallel dispatch (SEMANTICS.md §1.9 items 32.6 and 34, §7.7):
/// regroups the rows a shard received by local expert, then by sender (stable). Both variants are
/// a list of (sender, local expert) blocks: the all-to-all's receive buffer (clamped to R rows
/// as RaggedAllToAll drops them), or one sender at offset_s of the globally sorted buffer.

#include <moe/bf16.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/counting.hpp>
#include <moe/detail/rows.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace moe::permute {

/// \brief Host metadata of a local permutation.
struct LocalLayout {
  int num_senders = 0;  ///< S: blocks per local expert (EP, or 1 for the replicated variant)
  int num_local = 0;    ///< L: local experts
  /// First source row of the shard's rows (0 for the all-to-all variant, offset_s otherwise).
  std::int64_t source_offset = 0;
  /// [S*L] row-major: rows of (sender i, local expert l) present in the source, after truncation.
  std::vector<std::int64_t> block_sizes;
  std::vector<std::int64_t> group_sizes;  ///< [L] rows per local expert (sum over senders)
  std::int64_t rows = 0;                  ///< rows kept: sum of group_sizes
  std::int64_t dropped = 0;               ///< rows lost to the buffer cap R
};

namespace detail {

/// Truncates the block sizes to R rows (R < 0: no cap); fills group sizes, kept and dropped.
inline void truncate_blocks(moe::permute::LocalLayout& lay, std::int64_t R) {
  std::int64_t const total =
      std::accumulate(lay.block_sizes.begin(), lay.block_sizes.end(), std::int64_t(0));
  lay.block_sizes = moe::detail::clamp_prefix(std::move(lay.block_sizes), R);
  lay.rows = std::accumulate(lay.block_sizes.begin(), lay.block_sizes.end(), std::int64_t(0));
  lay.dropped = total - lay.rows;
  lay.group_sizes.assign(lay.num_local, 0);
  for (int i = 0; i < lay.num_senders; ++i)
    for (int l = 0; l < lay.num_local; ++l)
      lay.group_sizes[l] += lay.block_sizes[std::size_t(i) * lay.num_local + l];
}

/// A layout of shard `me` of `ep`, holding L = E/ep local experts; ConfigError unless they divide,
/// ShapeError unless the group sizes G are [senders, E] and >= 0.
inline LocalLayout shard_layout(char const* who, int E, int ep, int me,
                                std::vector<std::int64_t> const& G) {
  moe::detail::require<ConfigError>(E >= 1 && ep >= 1 && E % ep == 0, who, ": num_experts=", E,
                                    " is not divisible by the expert-parallel size ", ep);
  moe::detail::require<ConfigError>(me >= 0 && me < ep, who, ": me=", me,
                                    " is not a shard index in [0, ", ep, ")");
  moe::detail::require<ShapeError>(!G.empty() && G.size() % E == 0, who, ": G has ", G.size(),
                                   " entries; it must be [senders, E] with E=", E);
  for (std::size_t k = 0; k < G.size(); ++k)
    moe::detail::require<ShapeError>(G[k] >= 0, who, ": group size [", k, "]=", G[k],
                                     " is negative; group sizes must be >= 0");
  LocalLayout lay;
  lay.num_local = E / ep;
  return lay;
}

template <class ExecSpace, class Map, class SrcView, class DstView>
void gather_by(ExecSpace const& space, char const* label, Map const& map, std::int64_t rows,
               SrcView const& src, DstView const& dst) {
  static_assert(SrcView::rank == 2 && DstView::rank == 2,
                "moe::permute: local row moves take [rows, D] views");
  using T = typename DstView::non_const_value_type;
  std::int64_t const D = dst.extent(1);
  moe::detail::require<ShapeError>(
      src.extent(1) == dst.extent(1) && static_cast<std::int64_t>(dst.extent(0)) >= rows, label,
      ": source [", src.extent(0), ",", src.extent(1), "] and destination [", dst.extent(0), ",",
      dst.extent(1), "] need equal row length and at least ", rows, " destination rows");
  std::int64_t const n = dst.extent(0);
  moe::detail::for_each_row(
      space, label, n, KOKKOS_LAMBDA(std::int64_t p, std::int64_t lane, std::int64_t lanes) {
        if (p < rows) {
          std::int64_t const q = map(p);
          for (std::int64_t d = lane; d < D; d += lanes)
            dst(p, d) = moe::detail::value_cast<T>(src(q, d));
        } else {
          for (std::int64_t d = lane; d < D; d += lanes)
            dst(p, d) = moe::detail::value_cast<T>(0.0f);
        }
      });
}

}  // namespace detail

/// \brief Layout of the all-to-all variant for shard `me` of `ep` (local experts me*L.. with
/// L = E/ep): G [S*E], G[i*E+e] = rows sender i routed to expert e; R receive rows (< 0: no cap).
inline LocalLayout local_layout(std::vector<std::int64_t> const& G, int E, int ep, int me,
                                std::int64_t R = -1) {
  char const* who = "moe::permute::local_layout";
  LocalLayout lay = detail::shard_layout(who, E, ep, me, G);
  lay.num_senders = static_cast<int>(G.size() / E);
  for (int i = 0; i < lay.num_senders; ++i)
    for (int l = 0; l < lay.num_local; ++l)
      lay.block_sizes.push_back(G[std::size_t(i) * E + std::size_t(me) * lay.num_local + l]);
  detail::truncate_blocks(lay, R);
  return lay;
}

/// \brief Layout of the replicated-batch variant (MaxText `local_permute(is_offset=True)`) from
/// the [E] group sizes of the globally sorted buffer; R rows kept (< 0: all), later experts first.
inline LocalLayout local_layout_replicated(std::vector<std::int64_t> const& global_group_sizes,
                                           int ep, int me, std::int64_t R = -1) {
  char const* who = "moe::permute::local_layout_replicated";
  LocalLayout lay =
      detail::shard_layout(who, int(global_group_sizes.size()), ep, me, global_group_sizes);
  lay.num_senders = 1;
  for (int e = 0; e < me * lay.num_local; ++e) lay.source_offset += global_group_sizes[e];
  lay.block_sizes.assign(global_group_sizes.begin() + std::size_t(me) * lay.num_local,
                         global_group_sizes.begin() + std::size_t(me + 1) * lay.num_local);
  detail::truncate_blocks(lay, R);
  return lay;
}

/// \brief A local permutation on the device, with its host layout.
/// \tparam MemorySpace where the index views live
template <class MemorySpace>
struct LocalPermutation {
  LocalLayout layout;
  /// [rows] sorted row p -> source row (an index into the received / global buffer).
  View1<std::int64_t, MemorySpace> perm;
  /// [rows] packed source row q (source row - layout.source_offset) -> sorted row.
  View1<std::int64_t, MemorySpace> inverse;
  View1<int, MemorySpace> expert_ids;  ///< [rows] local expert (0..L-1) of each sorted row
  View1<std::int64_t, MemorySpace> group_offsets;  ///< [L+1] the GMM's group offsets
  typename View1<std::int64_t, MemorySpace>::HostMirror group_offsets_host;  ///< its host copy

  /// \brief Rows kept (the valid prefix of the sorted buffer).
  std::int64_t rows() const { return layout.rows; }

  /// Buffers reused when make_local_permutation refills this object.
  moe::detail::ScratchPool<MemorySpace> scratch;
  View1<std::int64_t, Kokkos::HostSpace> seg_host;
};

/// \brief Builds the permutation of a layout into `lp`, reusing lp's buffers.
template <class ExecSpace>
void make_local_permutation(ExecSpace const& space, LocalLayout const& layout,
                            LocalPermutation<typename ExecSpace::memory_space>& lp) {
  int const S = layout.num_senders, L = layout.num_local, nb = S * L;
  lp.layout = layout;
  std::int64_t const rows = layout.rows;
  // Per block in sorted (local expert major) order b = l*S + i: its first sorted row seg(b) (the
  // total at nb) and its first source row seg(nb + 1 + b); source blocks are k = i*L + l.
  auto seg = lp.scratch.template get<std::int64_t>("segments", 2 * nb + 1);
  moe::detail::ensure(Kokkos::DefaultHostExecutionSpace(), lp.seg_host,
                      "moe::permute::local::segments", 2 * nb + 1);
  auto const& seg_host = lp.seg_host;
  std::int64_t run = layout.source_offset;
  for (int k = 0; k < nb; ++k)
    seg_host(nb + 1 + k % L * S + k / L) = run, run += layout.block_sizes[k];
  run = 0;
  for (int b = 0; b < nb; ++b) seg_host(b) = run, run += layout.block_sizes[b % S * L + b / S];
  seg_host(nb) = run;
  Kokkos::deep_copy(space, seg, seg_host);

  moe::detail::ensure(space, lp.group_offsets, "moe::permute::local::group_offsets", L + 1);
  if (lp.group_offsets_host.extent(0) != lp.group_offsets.extent(0))
    lp.group_offsets_host = Kokkos::create_mirror_view(lp.group_offsets);
  for (int l = 0; l <= L; ++l) lp.group_offsets_host(l) = seg_host(l * S);  // block l*S: expert l
  Kokkos::deep_copy(space, lp.group_offsets, lp.group_offsets_host);

  auto const perm = lp.perm = lp.scratch.template get<std::int64_t>("perm", rows);
  auto const inverse = lp.inverse = lp.scratch.template get<std::int64_t>("inverse", rows);
  auto const ids = lp.expert_ids = lp.scratch.template get<int>("expert_ids", rows);
  std::int64_t const base = layout.source_offset;
  Kokkos::parallel_for(
      "moe::permute::local::build",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, rows),
      KOKKOS_LAMBDA(std::int64_t p) {
        // Last block whose first sorted row is <= p: it is non-empty and holds p.
        int lo = 0, hi = nb;  // invariant: seg(lo) <= p < seg(hi)
        while (hi - lo > 1) {
          int const mid = (lo + hi) / 2;
          if (seg(mid) <= p)
            lo = mid;
          else
            hi = mid;
        }
        std::int64_t const src = seg(nb + 1 + lo) + (p - seg(lo));
        perm(p) = src;
        inverse(src - base) = p;
        ids(p) = lo / S;
      });
  // The host stages (seg_host, group_offsets_host) are rewritten by the next call.
  moe::detail::fence(space, "moe::permute::local: permutation built");
}

/// \brief The all-to-all variant: local_layout + make_local_permutation.
template <class ExecSpace>
LocalPermutation<typename ExecSpace::memory_space> local_permute(ExecSpace const& space,
                                                                 std::vector<std::int64_t> const& G,
                                                                 int E, int ep, int me,
                                                                 std::int64_t R = -1) {
  LocalPermutation<typename ExecSpace::memory_space> lp;
  make_local_permutation(space, local_layout(G, E, ep, me, R), lp);
  return lp;
}

/// \brief The replicated-batch variant: local_layout_replicated + make_local_permutation.
template <class ExecSpace>
LocalPermutation<typename ExecSpace::memory_space> local_permute_replicated(
    ExecSpace const& space, std::vector<std::int64_t> const& global_group_sizes, int ep, int me,
    std::int64_t R = -1) {
  LocalPermutation<typename ExecSpace::memory_space> lp;
  make_local_permutation(space, local_layout_replicated(global_group_sizes, ep, me, R), lp);
  return lp;
}

/// \brief dst[p] = src[perm[p]] for the rows() kept rows; later rows of dst are zeroed.
template <class ExecSpace, class MS, class SrcView, class DstView>
void permute_rows(ExecSpace const& space, LocalPermutation<MS> const& lp, SrcView const& src,
                  DstView const& dst) {
  std::int64_t const need = lp.layout.source_offset + lp.rows();
  moe::detail::require<ShapeError>(static_cast<std::int64_t>(src.extent(0)) >= need,
                                   "moe::permute::permute_rows: the source has ", src.extent(0),
                                   " rows; the permutation reads rows up to ", need);
  detail::gather_by(space, "moe::permute::local::permute_rows", lp.perm, lp.rows(), src, dst);
}

/// \brief Inverse (and backward) of permute_rows: dst[q] = src[inverse[q]] for the rows() kept
/// rows, q = source row - layout.source_offset; later rows of dst are zeroed.
template <class ExecSpace, class MS, class SrcView, class DstView>
void unpermute_rows(ExecSpace const& space, LocalPermutation<MS> const& lp, SrcView const& src,
                    DstView const& dst) {
  moe::detail::require<ShapeError>(static_cast<std::int64_t>(src.extent(0)) >= lp.rows(),
                                   "moe::permute::unpermute_rows: the source has ", src.extent(0),
                                   " rows; the permutation has ", lp.rows());
  detail::gather_by(space, "moe::permute::local::unpermute_rows", lp.inverse, lp.rows(), src, dst);
}

/// \brief Local expert ids of the dense (dropping) expert-parallel path: for a shard holding
/// experts [e0, e0 + L), local(t,k) = ids(t,k) - e0 when the expert is local (else 0) and
/// local_kept(t,k) = 1 iff the expert is local and the slot was kept.
template <class ExecSpace, class MS>
void local_expert_ids(ExecSpace const& space, View2<int const, MS> ids, View2<int const, MS> kept,
                      int e0, int L, View2<int, MS> local, View2<int, MS> local_kept) {
  int const K = int(ids.extent(1));
  Kokkos::parallel_for(
      "moe::permute::local_expert_ids", Kokkos::RangePolicy<ExecSpace>(space, 0, ids.extent(0)),
      KOKKOS_LAMBDA(std::int64_t t) {
        for (int k = 0; k < K; ++k) {
          int const l = ids(t, k) - e0;
          bool const mine = l >= 0 && l < L;
          local(t, k) = mine ? l : 0;
          local_kept(t, k) = mine && kept(t, k) ? 1 : 0;
        }
      });
}

}  // namespace moe::permute
