#pragma once
/// \file
/// Parallel skeletons of the routing bookkeeping (a stable counting sort's count + scan,
/// per-segment column sums), deterministic on every backend.

#include <moe/detail/compat.hpp>
#include <moe/detail/row_caps.hpp>
#include <moe/detail/views.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace moe::detail {

/// Slots per chunk of the counting passes: long on host spaces, short on devices; never below the
/// number of keys, so the scan stays O(T*K).
template <class ExecSpace>
std::int64_t counting_chunk(int keys) {
  return runs_on_host<ExecSpace>() ? std::max<std::int64_t>(2048, 8 * std::int64_t(keys))
                                   : std::max<std::int64_t>(64, keys);
}

/// \brief A counting pass: N slots in segments of `seg`, chunks of `chunk` per segment, E keys.
struct CountingShape {
  std::int64_t N = 0, seg = 1, chunk = 1;
  int E = 1;
  std::int64_t segments() const { return seg > 0 ? N / seg : 0; }
  std::int64_t chunks_per_segment() const { return seg > 0 ? (seg + chunk - 1) / chunk : 0; }
  /// Entries of the cursor view: one per (segment, key, chunk), plus the total.
  std::int64_t cursors() const { return segments() * E * chunks_per_segment() + 1; }
  KOKKOS_INLINE_FUNCTION std::int64_t at(std::int64_t g, int e, std::int64_t c,
                                         std::int64_t C) const {
    return (g * E + e) * C + c;
  }
};

/// \brief Count + exclusive scan of a stable counting sort of the slots s = t*K + k of `keys`
/// [T,K] (keys in [0, E)), skipping slots whose `mask` is 0 (an empty mask keeps every slot).
/// cursor[sh.at(g, e, c, C)] is then the sorted position of the first slot of key e in chunk c of
/// segment g (cursor[last]: slots counted); a placing pass takes positions with cursor[...]++.
template <class ExecSpace, class MS>
void counting_cursors(ExecSpace const& space, View2<int const, MS> keys, View2<int const, MS> mask,
                      CountingShape const& sh, View1<std::int64_t, MS> cursor) {
  std::int64_t const K = keys.extent(1), N = sh.N, seg = sh.seg, chunk = sh.chunk;
  std::int64_t const C = sh.chunks_per_segment(), G = sh.segments(), last = sh.cursors() - 1;
  int const E = sh.E;
  bool const masked = mask.data() != nullptr;
  Kokkos::parallel_for(
      "moe::count_keys", Kokkos::RangePolicy<ExecSpace>(space, 0, G * C),
      KOKKOS_LAMBDA(std::int64_t gc) {
        std::int64_t const g = gc / C, c = gc % C;
        for (int e = 0; e < E; ++e) cursor(sh.at(g, e, c, C)) = 0;
        std::int64_t const begin = g * seg + c * chunk;
        std::int64_t const end = moe::detail::min(begin + chunk, (g + 1) * seg);
        for (std::int64_t s = begin; s < end && s < N; ++s)
          if (!masked || mask(s / K, s % K)) cursor(sh.at(g, keys(s / K, s % K), c, C)) += 1;
      });
  Kokkos::parallel_scan(
      "moe::scan_keys", Kokkos::RangePolicy<ExecSpace>(space, 0, last + 1),
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t & acc, bool final) {
        std::int64_t const v = i < last ? cursor(i) : 0;
        if (final) cursor(i) = acc;
        acc += v;
      });
}

/// \brief out(g, e) = sum over the rows t of segment g (rows [g*seg, (g+1)*seg)) of f(t, e), in
/// double, in order within chunks of `rows_per_chunk` rows, then over the chunks (the result
/// depends on seg and f only). `partial`: scratch of segments * chunks * E doubles.
template <class ExecSpace, class MS, class F, class Out>
void segment_column_sums(ExecSpace const& space, std::int64_t T, int E, std::int64_t seg,
                         F const& f, View1<double, MS> partial, Out const& out,
                         std::int64_t rows_per_chunk = 256) {
  std::int64_t const G = seg > 0 ? T / seg : 0;
  std::int64_t const R = std::max<std::int64_t>(1, std::min(rows_per_chunk, seg));
  std::int64_t const C = seg > 0 ? (seg + R - 1) / R : 0;
  Kokkos::parallel_for(
      "moe::column_sums_partial", Kokkos::RangePolicy<ExecSpace>(space, 0, G * C * E),
      KOKKOS_LAMBDA(std::int64_t i) {
        std::int64_t const e = i % E, gc = i / E, g = gc / C, c = gc % C;
        std::int64_t const begin = g * seg + c * R;
        std::int64_t const end = moe::detail::min(begin + R, (g + 1) * seg);
        double acc = 0;
        for (std::int64_t t = begin; t < end; ++t) acc += double(f(t, int(e)));
        partial(i) = acc;
      });
  Kokkos::parallel_for(
      "moe::column_sums", Kokkos::RangePolicy<ExecSpace>(space, 0, G * E),
      KOKKOS_LAMBDA(std::int64_t i) {
        std::int64_t const e = i % E, g = i / E;
        double acc = 0;
        for (std::int64_t c = 0; c < C; ++c) acc += partial((g * C + c) * E + e);
        out(g, int(e), acc);
      });
}

}  // namespace moe::detail
