#pragma once
/// \file
/// gmm::Tiled<TM,TK,TN>: the portable Kokkos team kernel (the GPU path without a vendor library).

#include <moe/gmm/backend/common.hpp>

namespace moe::gmm {

/// \brief Policy: portable Kokkos team kernel. Each team computes one TM x TN output tile from
/// TM x TK and TK x TN tiles staged in team scratch; a tile never straddles two groups.
/// \tparam TM rows of an output tile (rows of lhs)
/// \tparam TK depth of one step of the contraction loop
/// \tparam TN columns of an output tile
template <int TM, int TK, int TN>
struct Tiled {
  static_assert(TM > 0 && TK > 0 && TN > 0,
                "moe::gmm::Tiled<TM,TK,TN>: every tile extent must be positive");
};

template <int TM, int TK, int TN>
struct is_policy<Tiled<TM, TK, TN>> : std::true_type {};

/// \brief The tile shape `Auto` runs on device execution spaces (one launch over every tile of
/// every group): 64 x 64 tiles of 4 x 4 micro tiles, 256 threads per team; not tuned on a GPU.
using DeviceTiled = Tiled<64, 16, 64>;

}  // namespace moe::gmm

namespace moe::gmm::detail {

// A team's threads each own UM x UN blocks of C ("micro tiles"); on host a team is one thread.

/// Bytes of one SIMD register of the host target this translation unit is compiled for.
#if defined(__AVX512F__)
constexpr int host_simd_bytes = 64;
#elif defined(__AVX__)
constexpr int host_simd_bytes = 32;
#else
constexpr int host_simd_bytes = 16;
#endif

template <class Scalar, int TMp, int TK, int TNp, int UM, int UN>
KOKKOS_INLINE_FUNCTION void micro_tile(Scalar const* As, Scalar const* Bs, Scalar* Cs, int i0,
                                       int j0) {
  // As is [TK][TMp] (k-major so a micro tile's UM values are adjacent), Bs is [TK][TNp].
  Scalar acc[UM][UN];
  for (int a = 0; a < UM; ++a)
    for (int b = 0; b < UN; ++b) acc[a][b] = Cs[(i0 + a) * TNp + j0 + b];
  for (int kk = 0; kk < TK; ++kk) {
    Scalar const* arow = As + kk * TMp + i0;
    Scalar const* brow = Bs + kk * TNp + j0;
    for (int a = 0; a < UM; ++a) {
      Scalar const av = arow[a];
      for (int b = 0; b < UN; ++b) acc[a][b] += av * brow[b];
    }
  }
  for (int a = 0; a < UM; ++a)
    for (int b = 0; b < UN; ++b) Cs[(i0 + a) * TNp + j0 + b] = acc[a][b];
}

/// Shared part of the gmm and tgmm tile kernels: scratch layout, micro-tile loop, store.
template <class ExecSpace, class Scalar, int TM, int TK, int TN>
struct TileCore {
  static constexpr bool host = moe::detail::runs_on_host<ExecSpace>();
  // Micro tiles: host 4 rows x 2 SIMD registers of accumulators (8 registers, room left for the
  // operands even with SSE's 16; wider spills and stops vectorising), device 4 x 4 per thread.
  static constexpr int un = host ? static_cast<int>(2 * host_simd_bytes / sizeof(Scalar)) : 4;
  static constexpr int UM = TM < 4 ? TM : 4;
  static constexpr int UN = TN < un ? TN : un;
  static constexpr int TMp = (TM + UM - 1) / UM * UM;  // TM, TN rounded up to micro tiles
  static constexpr int TNp = (TN + UN - 1) / UN * UN;
  static constexpr int num_micro = (TMp / UM) * (TNp / UN);
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using ScratchView = Kokkos::View<Scalar*, typename ExecSpace::scratch_memory_space,
                                   Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  static std::size_t scratch_bytes() {
    return ScratchView::shmem_size(TK * TMp) + ScratchView::shmem_size(TK * TNp) +
           ScratchView::shmem_size(TMp * TNp);
  }

  struct Scratch {
    Scalar *a, *b, *c;
  };

  /// The team's A, B and C tiles, C zeroed.
  KOKKOS_INLINE_FUNCTION static Scratch scratch(member_type const& team, int level) {
    auto take = [&](int n) { return ScratchView(team.team_scratch(level), n).data(); };
    Scratch const s{take(TK * TMp), take(TK * TNp), take(TMp * TNp)};  // in this order
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, TMp * TNp),
                         [&](int idx) { s.c[idx] = Scalar(0); });
    team.team_barrier();  // store() may read C with no multiply() between (k == 0, empty group)
    return s;
  }

  /// Calls f(r, c, valid) for every element of an R x C block, valid = r < rv && c < cv: host
  /// backends as a vectorisable inner loop over c, devices spread over the team (coalesced on c).
  template <class F>
  KOKKOS_INLINE_FUNCTION static void stage(member_type const& team, int R, int C, int rv, int cv,
                                           F const& f) {
    if constexpr (host) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
        int const valid_cols = r < rv ? cv : 0;
        for (int c = 0; c < valid_cols; ++c) f(r, c, true);
        for (int c = valid_cols; c < C; ++c) f(r, c, false);
      });
    } else {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R * C), [&](int idx) {
        int const r = idx / C, c = idx % C;
        f(r, c, r < rv && c < cv);
      });
    }
  }

  /// Once A and B are staged: C += A * B over the micro tiles that hold part of the valid rows x
  /// cols (never the padding), between team barriers.
  KOKKOS_INLINE_FUNCTION static void multiply(member_type const& team, Scratch const& s, int rows,
                                              int cols) {
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, num_micro), [&](int t) {
      int const i0 = (t / (TNp / UN)) * UM, j0 = (t % (TNp / UN)) * UN;
      if (i0 < rows && j0 < cols) micro_tile<Scalar, TMp, TK, TNp, UM, UN>(s.a, s.b, s.c, i0, j0);
    });
    team.team_barrier();
  }

  /// out(row0 + i, col0 + j) (+)= C(i, j) for i < rows, j < cols.
  template <class Out>
  KOKKOS_INLINE_FUNCTION static void store(member_type const& team, Scratch const& s,
                                           Out const& out, int64_t row0, int rows, int64_t col0,
                                           int cols, bool accumulate) {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows * cols), [&](int idx) {
      int const i = idx / cols, j = idx % cols;
      Scalar const v = s.c[i * TNp + j];
      out(row0 + i, col0 + j) = accumulate ? out(row0 + i, col0 + j) + v : v;
    });
  }

  /// Threads per team: 1 on host, a micro tile each (at most 256) on device.
  static int team_size() { return host ? 1 : num_micro < 256 ? num_micro : 256; }
};

template <class ExecSpace, class Scalar, int TM, int TK, int TN, bool TransB, class MemL,
          class MemR, class MemO, class MemG>
struct TiledGmmKernel {
  using Core = TileCore<ExecSpace, Scalar, TM, TK, TN>;
  static constexpr int TMp = Core::TMp, TNp = Core::TNp;

  CMat<ExecSpace, Scalar, MemL> lhs;
  CTensor<ExecSpace, Scalar, MemR> rhs;
  Mat<ExecSpace, Scalar, MemO> out;
  Kokkos::View<const int64_t*, MemG> offsets;  // [G+1] of all groups
  int group_offset, num_local;
  int64_t k, n;
  int n_tiles;
  bool accumulate;
  int level;

  KOKKOS_INLINE_FUNCTION void operator()(typename Core::member_type const& team) const {
    // Tiles run group by group, n-tile by n-tile, then over the group's m-tiles (its rhs panel
    // stays in cache). The team finds its group by walking the group sizes (no allocation).
    int64_t local = team.league_rank(), m_tiles = 0;
    int g = 0;
    for (; g < num_local; ++g) {
      m_tiles = (offsets(group_offset + g + 1) - offsets(group_offset + g) + TM - 1) / TM;
      if (local < m_tiles * n_tiles) break;
      local -= m_tiles * n_tiles;
    }
    int const nt = static_cast<int>(local / m_tiles);
    int64_t const mt = local % m_tiles;
    int64_t const row0 = offsets(group_offset + g) + mt * TM;
    int64_t const row_end = offsets(group_offset + g + 1);
    int const rows = static_cast<int>(row_end - row0 < TM ? row_end - row0 : TM);
    int64_t const col0 = int64_t(nt) * TN;
    int const cols = static_cast<int>(n - col0 < TN ? n - col0 : TN);

    auto const s = Core::scratch(team, level);
    for (int64_t k0 = 0; k0 < k; k0 += TK) {
      int const kc = static_cast<int>(k - k0 < TK ? k - k0 : TK);
      Core::stage(team, TMp, TK, rows, kc, [&](int i, int kk, bool valid) {
        s.a[kk * TMp + i] = valid ? lhs(row0 + i, k0 + kk) : Scalar(0);
      });
      if (TransB) {
        Core::stage(team, TNp, TK, cols, kc, [&](int j, int kk, bool valid) {
          s.b[kk * TNp + j] = valid ? rhs(g, col0 + j, k0 + kk) : Scalar(0);
        });
      } else {
        Core::stage(team, TK, TNp, kc, cols, [&](int kk, int j, bool valid) {
          s.b[kk * TNp + j] = valid ? rhs(g, k0 + kk, col0 + j) : Scalar(0);
        });
      }
      Core::multiply(team, s, rows, cols);
    }
    Core::store(team, s, out, row0, rows, col0, cols, accumulate);
  }
};

template <class ExecSpace, class Scalar, int TM, int TK, int TN, class MemL, class MemD, class MemO,
          class MemG>
struct TiledTgmmKernel {
  using Core = TileCore<ExecSpace, Scalar, TM, TK, TN>;
  static constexpr int TMp = Core::TMp, TNp = Core::TNp;

  CMat<ExecSpace, Scalar, MemL> lhs;
  CMat<ExecSpace, Scalar, MemD> dy;
  Tensor<ExecSpace, Scalar, MemO> out;
  Kokkos::View<const int64_t*, MemG> offsets;
  int group_offset;
  int64_t k, n;
  int k_tiles, n_tiles;
  bool accumulate;
  int level;

  KOKKOS_INLINE_FUNCTION void operator()(typename Core::member_type const& team) const {
    int64_t const t = team.league_rank();
    int const g = static_cast<int>(t / (int64_t(k_tiles) * n_tiles));
    int const rest = static_cast<int>(t % (int64_t(k_tiles) * n_tiles));
    int64_t const kcol0 = int64_t(rest / n_tiles) * TM;
    int64_t const col0 = int64_t(rest % n_tiles) * TN;
    int const kcols = static_cast<int>(k - kcol0 < TM ? k - kcol0 : TM);
    int const cols = static_cast<int>(n - col0 < TN ? n - col0 : TN);
    int64_t const r_begin = offsets(group_offset + g), r_end = offsets(group_offset + g + 1);

    auto const s = Core::scratch(team, level);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += TK) {
      int const rc = static_cast<int>(r_end - r0 < TK ? r_end - r0 : TK);
      // The contraction runs over the group's rows.
      Core::stage(team, TK, TMp, rc, kcols, [&](int kk, int i, bool valid) {
        s.a[kk * TMp + i] = valid ? lhs(r0 + kk, kcol0 + i) : Scalar(0);
      });
      Core::stage(team, TK, TNp, rc, cols, [&](int kk, int j, bool valid) {
        s.b[kk * TNp + j] = valid ? dy(r0 + kk, col0 + j) : Scalar(0);
      });
      Core::multiply(team, s, kcols, cols);
    }
    auto out_g = Kokkos::subview(out, g, Kokkos::ALL, Kokkos::ALL);
    Core::store(team, s, out_g, kcol0, kcols, col0, cols, accumulate);
  }
};

/// The launch of `league` teams of Core's shape; `level`: the scratch level that holds its tiles.
template <class Core, class ExecSpace>
Kokkos::TeamPolicy<ExecSpace> tile_policy(ExecSpace const& space, int64_t league, int& level,
                                          char const* what) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  std::size_t const bytes = Core::scratch_bytes();
  require<ShapeError>(league <= INT_MAX, what, ": ", league, " tiles exceed the launch limit ",
                      INT_MAX, "; use larger tiles");
  level = bytes <= std::size_t(Policy::scratch_size_max(0)) ? 0 : 1;
  require<ShapeError>(bytes <= std::size_t(Policy::scratch_size_max(level)), what,
                      ": the tiles need ", bytes, " bytes of team scratch, more than the ",
                      Policy::scratch_size_max(level), " available; use smaller TM, TK or TN");
  return Policy(space, int(league), Core::team_size())
      .set_scratch_size(level, Kokkos::PerTeam(bytes));
}

template <int TM, int TK, int TN>
struct Impl<moe::gmm::Tiled<TM, TK, TN>> {
  template <class E, class S, class ML, class MR, class MO, class Mem>
  static void gmm(E const& space, CMat<E, S, ML> const& lhs, CTensor<E, S, MR> const& rhs,
                  Groups<Mem> const& groups, Mat<E, S, MO> const& out, GmmOptions const& opt) {
    char const* what = "moe::gmm::gmm<Tiled>";
    int const num_local = rhs.extent(0);
    int64_t const n = out.extent(1);
    auto const& off = groups.offsets_host;
    int const go = opt.group_offset;
    if (!opt.accumulate) zero_outside(space, out, off(go), off(go + num_local));
    if (n == 0 || off(go + num_local) == off(go)) return;

    int64_t m_tiles = 0;
    for (int g = 0; g < num_local; ++g) m_tiles += (off(go + g + 1) - off(go + g) + TM - 1) / TM;
    int64_t const n_tiles = (n + TN - 1) / TN;
    require<ShapeError>(n_tiles <= INT_MAX, what, ": n=", n, " is too large");

    int level = 0;
    auto policy = tile_policy<TileCore<E, S, TM, TK, TN>>(space, m_tiles * n_tiles, level, what);
    int64_t const k = lhs.extent(1);
    auto launch = [&](auto trans) {
      TiledGmmKernel<E, S, TM, TK, TN, decltype(trans)::value, ML, MR, MO, Mem> kernel{
          lhs, rhs, out, groups.offsets, go, num_local, k, n, int(n_tiles), opt.accumulate, level};
      Kokkos::parallel_for("moe::gmm::gmm<Tiled>", policy, kernel);
    };
    opt.transpose_rhs ? launch(std::true_type{}) : launch(std::false_type{});
  }

  template <class E, class S, class ML, class MD, class MO, class Mem>
  static void tgmm(E const& space, CMat<E, S, ML> const& lhs, CMat<E, S, MD> const& dy,
                   Groups<Mem> const& groups, Tensor<E, S, MO> const& out, GmmOptions const& opt) {
    char const* what = "moe::gmm::tgmm<Tiled>";
    int const num_local = out.extent(0);
    int64_t const k = out.extent(1), n = out.extent(2);
    if (num_local == 0 || k == 0 || n == 0) return;
    int64_t const k_tiles = (k + TM - 1) / TM, n_tiles = (n + TN - 1) / TN;
    require<ShapeError>(k_tiles * n_tiles <= INT_MAX, what, ": k=", k, " x n=", n, " is too large");
    int level = 0;
    auto policy =
        tile_policy<TileCore<E, S, TM, TK, TN>>(space, num_local * k_tiles * n_tiles, level, what);
    int const kt = static_cast<int>(k_tiles), nt = static_cast<int>(n_tiles);
    TiledTgmmKernel<E, S, TM, TK, TN, ML, MD, MO, Mem> kernel{
        lhs, dy, out, groups.offsets, opt.group_offset, k, n, kt, nt, opt.accumulate, level};
    Kokkos::parallel_for("moe::gmm::tgmm<Tiled>", policy, kernel);
  }
};

}  // namespace moe::gmm::detail
