#pragma once
/// \file
/// The launch shape of every row kernel (gathers, scatters, combines of [rows, D] buffers): host
/// spaces a work item per row, device spaces consecutive threads over consecutive columns.

#include <moe/detail/compat.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <climits>
#include <cstdint>

namespace moe::detail {

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
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, rows),
        KOKKOS_LAMBDA(std::int64_t i) { body(i, 0, 1); });
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
