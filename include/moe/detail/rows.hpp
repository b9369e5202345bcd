#pragma once
/// \file
/// The launch shape of every row kernel (gathers, scatters, combines of [rows, D] buffers): host
/// spaces a work item per row, device spaces consecutive threads over consecutive columns; and of
/// the flat element kernels. On Kokkos::Serial both split their range over the rank's OpenMP
/// threads (for_each_index), the threads the GEMMs already run on.

#include <moe/detail/compat.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <climits>
#include <cstdint>
#include <type_traits>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace moe::detail {

/// \brief Whether moe splits host loops on ExecSpace over OpenMP's threads itself: Kokkos::Serial
/// (one thread by itself) in a build with OpenMP (moe with oneDNN compiles with it). A Serial rank
/// then uses its host threads (moe::apply_host_threads: cores / ranks) for its row and element
/// kernels as oneDNN does for its GEMMs, where they would leave all but one idle.
template <class ExecSpace>
constexpr bool splits_over_openmp() {
#if defined(_OPENMP) && defined(KOKKOS_ENABLE_SERIAL)
  return std::is_same<ExecSpace, Kokkos::Serial>::value;
#else
  return false;
#endif
}

/// OpenMP threads for a loop of n items worth splitting in pieces of at least `grain` items: 1
/// inside a parallel region or without OpenMP.
inline int split_threads([[maybe_unused]] std::int64_t n, [[maybe_unused]] std::int64_t grain) {
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
  std::int64_t const most = n / (grain > 0 ? grain : 1);
  int const threads = omp_get_max_threads();
  return int(most < threads ? (most > 1 ? most : 1) : threads);
#else
  return 1;
#endif
}

/// \brief Where splits_over_openmp<ExecSpace> and [0, n) holds at least 2 * grain items: runs
/// block(begin, end) on contiguous blocks of [0, n), one per OpenMP thread (at most n / grain of
/// them), inside a Kokkos Tools region named `label`, and returns true; otherwise runs nothing
/// and returns false (the caller's Kokkos kernel then does the work).
template <class ExecSpace, class Block>
bool run_blocks([[maybe_unused]] char const* label, [[maybe_unused]] std::int64_t n,
                [[maybe_unused]] std::int64_t grain, [[maybe_unused]] Block const& block) {
#if defined(_OPENMP)
  if constexpr (splits_over_openmp<ExecSpace>()) {
    int const threads = split_threads(n, grain);
    if (threads > 1) {
      Region region(label);
#pragma omp parallel num_threads(threads)
      {
        std::int64_t const t = omp_get_thread_num(), parts = omp_get_num_threads();
        block(n * t / parts, n * (t + 1) / parts);
      }
      return true;
    }
  }
#endif
  return false;
}

/// \brief Runs body(i) for every i in [0, n) on `space` (Kokkos::parallel_for, labelled), or as
/// run_blocks' contiguous blocks on OpenMP's threads: for kernels whose items write disjoint
/// elements and reduce nothing across items, so the results are the same bits on any number of
/// threads.
template <class ExecSpace, class Body>
void for_each_index(ExecSpace const& space, char const* label, std::int64_t n, std::int64_t grain,
                    Body const& body) {
  if (n <= 0) return;
  if (run_blocks<ExecSpace>(label, n, grain, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) body(i);
      }))
    return;
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, n), body);
}

/// Rows per thread below which a row kernel stays on one thread (rows of D = 1,024 floats: 64 KB).
constexpr std::int64_t row_grain = 16;
/// Elements per thread below which an element kernel stays on one thread.
constexpr std::int64_t element_grain = 1 << 15;

/// Rows per team and column lanes per row of row kernels on device spaces (8 rows x 32 lanes =
/// 256 threads per team; a row's 32 lanes are one warp, reading consecutive columns).
constexpr int device_rows_per_team = 8;
constexpr int device_row_lanes = 32;

/// \brief Runs body(i, lane, lanes) for every row i in [0, rows), the body walking columns lane,
/// lane + lanes, ...: host spaces call body(i, 0, 1), device spaces use device_row_lanes lanes.
template <class ExecSpace, class Body>
void for_each_row(ExecSpace const& space, char const* label, std::int64_t rows, Body const& body) {
  if (rows <= 0) return;
  if constexpr (runs_on_host<ExecSpace>()) {
    for_each_index(
        space, label, rows, row_grain, KOKKOS_LAMBDA(std::int64_t i) { body(i, 0, 1); });
  } else {
    using Policy = Kokkos::TeamPolicy<ExecSpace>;
    std::int64_t const league = (rows + device_rows_per_team - 1) / device_rows_per_team;
    require<ShapeError>(league <= INT_MAX, label, ": ", rows, " rows exceed the launch limit");
    Kokkos::parallel_for(
        label, Policy(space, int(league), device_rows_per_team, device_row_lanes),
        KOKKOS_LAMBDA(typename Policy::member_type const& team) {
          std::int64_t const i =
              std::int64_t(team.league_rank()) * device_rows_per_team + team.team_rank();
          if (i >= rows) return;
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, device_row_lanes),
                               [&](int lane) { body(i, lane, device_row_lanes); });
        });
  }
}

}  // namespace moe::detail
