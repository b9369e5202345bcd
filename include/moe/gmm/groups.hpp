#pragma once
/// \file
/// What every grouped-GEMM backend takes: the row partition into groups and the call options.

#include <moe/error.hpp>
#include <moe/gmm/pack_cache.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <vector>

namespace moe::gmm {

/// \brief Row partition of the lhs into consecutive groups, as CSR offsets. The host copy lets a
/// launch size its grid and slice its operands without reading device memory.
template <class MemorySpace>
struct Groups {
  Kokkos::View<int64_t*, MemorySpace> offsets;  ///< [G+1] exclusive cumsum of the group sizes
  typename Kokkos::View<int64_t*, MemorySpace>::HostMirror offsets_host;  ///< its host copy

  /// \brief Number of groups G.
  int num_groups() const {
    return offsets_host.extent(0) == 0 ? 0 : static_cast<int>(offsets_host.extent(0) - 1);
  }
  /// \brief Number of grouped rows: the sum of the group sizes.
  int64_t rows() const { return num_groups() == 0 ? 0 : offsets_host(num_groups()); }
  /// \brief Size of group g.
  int64_t size(int g) const { return offsets_host(g + 1) - offsets_host(g); }
};

}  // namespace moe::gmm

namespace moe::gmm::detail {

/// The Groups of `sizes`, copied to the device on `space` (none: a blocking copy).
template <class MemorySpace, class... Alloc>
Groups<MemorySpace> host_groups(std::vector<int64_t> const& sizes, Alloc const&... space) {
  Groups<MemorySpace> groups;
  groups.offsets = Kokkos::View<int64_t*, MemorySpace>(
      Kokkos::view_alloc(space..., Kokkos::WithoutInitializing, "moe::gmm::Groups::offsets"),
      sizes.size() + 1);
  groups.offsets_host = Kokkos::create_mirror_view(groups.offsets);
  groups.offsets_host(0) = 0;
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    moe::detail::require<ShapeError>(sizes[g] >= 0, "moe::gmm::make_groups: group size sizes[", g,
                                     "]=", sizes[g], " is negative; group sizes must be >= 0");
    groups.offsets_host(g + 1) = groups.offsets_host(g) + sizes[g];
  }
  Kokkos::deep_copy(space..., groups.offsets, groups.offsets_host);
  return groups;
}

}  // namespace moe::gmm::detail

namespace moe::gmm {

/// \brief Builds Groups from host group sizes (each >= 0, else moe::ShapeError); the copy to the
/// device runs on `space` and may still be in flight when this returns.
template <class ExecSpace, class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
Groups<typename ExecSpace::memory_space> make_groups(ExecSpace const& space,
                                                     std::vector<int64_t> const& sizes) {
  return moe::gmm::detail::host_groups<typename ExecSpace::memory_space>(sizes, space);
}

/// \brief Builds Groups in MemorySpace from host group sizes (each >= 0, else moe::ShapeError);
/// returns after the device copy is complete.
template <class MemorySpace>
Groups<MemorySpace> make_groups(std::vector<int64_t> const& sizes) {
  return moe::gmm::detail::host_groups<MemorySpace>(sizes);
}

/// \brief Builds Groups from device offsets and their host mirror, both already filled by the
/// caller (e.g. from an exchanged count vector). Only the host copy is read.
/// \throws moe::ShapeError if the extents differ, offsets_host(0) != 0, or offsets decrease
template <class MemorySpace>
Groups<MemorySpace> make_groups(
    Kokkos::View<int64_t*, MemorySpace> const& offsets,
    typename Kokkos::View<int64_t*, MemorySpace>::HostMirror const& offsets_host) {
  moe::detail::require<ShapeError>(
      offsets.extent(0) == offsets_host.extent(0) && offsets.extent(0) >= 1,
      "moe::gmm::make_groups: offsets.extent(0)=", offsets.extent(0),
      " and offsets_host.extent(0)=", offsets_host.extent(0),
      " must be equal and >= 1 (G+1 CSR offsets)");
  moe::detail::require<ShapeError>(offsets_host(0) == 0,
                                   "moe::gmm::make_groups: offsets_host(0)=", offsets_host(0),
                                   " must be 0");
  for (std::size_t g = 1; g < offsets_host.extent(0); ++g)
    moe::detail::require<ShapeError>(offsets_host(g) >= offsets_host(g - 1),
                                     "moe::gmm::make_groups: offsets_host(", g,
                                     ")=", offsets_host(g), " < offsets_host(", g - 1,
                                     ")=", offsets_host(g - 1), "; group sizes must be >= 0");
  return Groups<MemorySpace>{offsets, offsets_host};
}

/// \brief Options shared by gmm and tgmm.
struct GmmOptions {
  /// rhs is [G_local, n, k] and used transposed (dX = dY * W^T). gmm only.
  bool transpose_rhs = false;
  /// rhs[g] (gmm) or out[g] (tgmm) belongs to group group_offset + g.
  int group_offset = 0;
  /// out += result (rows of visited groups only) instead of out = result.
  bool accumulate = false;
  /// Where a backend that reorders rhs (OneDnn) keeps the reordered copy between calls; nullptr:
  /// the weights are used in place. gmm only.
  PackCache* pack_cache = nullptr;
  /// Version of rhs's contents for pack_cache: a call with the same rhs and version may reuse a
  /// packed copy, so it must change whenever rhs is written (see PackCache).
  std::uint64_t rhs_version = 0;
  /// The operands (gmm: lhs and rhs; tgmm: lhs and dy) hold bf16 values: OneDnn then runs bf16
  /// kernels where the CPU has them (gmm: with pack_cache), rounding other values first.
  bool bf16_inputs = false;
  /// out's visited rows are rounded to bf16 (as moe::detail::round_to_bf16) before the call
  /// returns. gmm only, not with accumulate.
  bool bf16_output = false;
  /// The product takes rhs rounded to bf16 (as moe::detail::round_to_bf16): a caller holding
  /// fp32 master weights needs no rounded copy of its own. Backends where gmm::rounds_rhs (OneDnn)
  /// round while packing (a bf16 pack rounds anyway; an fp32 pack is rounded in place, and its
  /// PackCache entry is kept apart from the unrounded one); elsewhere gmm rounds a copy of rhs on
  /// every call. The same bits as rounding rhs first, except that oneDNN's bf16 packing reads
  /// float subnormals as zero (docs/precision.md). gmm only.
  bool round_rhs = false;
};

}  // namespace moe::gmm
