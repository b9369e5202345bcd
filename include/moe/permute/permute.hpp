#pragma once
/// \file
/// Sort / unsort of the T*K routed slots (token t, choice k; numbered t*K + k) by expert, stable.
/// Every backward here is a gather by the other direction of the permutation, never a
/// scatter-add, so results are deterministic on every backend.

#include <moe/bf16.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/counting.hpp>
#include <moe/detail/rows.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/gmm/groups.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace moe::permute {

/// \brief Counting-sort permutation of the routed slots with per-expert groups (and its buffers).
template <class MemorySpace>
struct Permutation {
  View1<std::int64_t, MemorySpace> perm;     ///< [rows] sorted position -> slot t*K+k
  View1<std::int64_t, MemorySpace> inverse;  ///< [T*K] slot -> sorted position, -1 if dropped
  gmm::Groups<MemorySpace> groups;           ///< E groups of consecutive sorted rows
  std::int64_t rows() const { return groups.rows(); }

  /// Buffers reused from call to call (perm and inverse view the pool's storage).
  moe::detail::ScratchPool<MemorySpace> scratch;
};

/// \brief Stable counting sort of the slots by expert id, skipping slots with kept == 0: chunks
/// count their slots per expert, a scan gives each chunk its write cursors, then each chunk
/// places its slots (no atomics). One host synchronisation: the group sizes.
template <class ExecSpace, class MS>
void sort_by_expert(ExecSpace const& space, View2<int const, MS> ids, View2<int const, MS> kept,
                    int E, Permutation<MS>& out) {
  moe::detail::Region region("moe::permute::sort_by_expert");
  std::int64_t const T = ids.extent(0), K = ids.extent(1), N = T * K;
  moe::detail::CountingShape const sh{N, std::max<std::int64_t>(N, 1),
                                      moe::detail::counting_chunk<ExecSpace>(E), E};
  std::int64_t const C = sh.chunks_per_segment();
  auto cursor = out.scratch.template get<std::int64_t>("sort_cursor", sh.cursors());
  auto const inverse = out.inverse = out.scratch.template get<std::int64_t>("sort_inverse", N);
  auto const perm = out.perm = out.scratch.template get<std::int64_t>("sort_perm", N);
  moe::detail::ensure(space, out.groups.offsets, "moe::permute::offsets", E + 1);
  if (out.groups.offsets_host.extent(0) != out.groups.offsets.extent(0))
    out.groups.offsets_host = Kokkos::create_mirror_view(out.groups.offsets);
  auto offsets = out.groups.offsets;
  if (N == 0) {
    Kokkos::deep_copy(space, offsets, 0);
    Kokkos::deep_copy(out.groups.offsets_host, 0);
    return;
  }
  moe::detail::counting_cursors(space, ids, kept, sh, cursor);
  std::int64_t const last = sh.cursors() - 1;
  Kokkos::parallel_for(
      "moe::permute::offsets", Kokkos::RangePolicy<ExecSpace>(space, 0, E + 1),
      KOKKOS_LAMBDA(int e) { offsets(e) = cursor(e < E ? sh.at(0, e, 0, C) : last); });
  Kokkos::deep_copy(space, out.groups.offsets_host, offsets);
  std::int64_t const chunk = sh.chunk;
  Kokkos::parallel_for(
      "moe::permute::place", Kokkos::RangePolicy<ExecSpace>(space, 0, C),
      KOKKOS_LAMBDA(std::int64_t c) {
        std::int64_t const end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        for (std::int64_t s = c * chunk; s < end; ++s) {
          if (!kept(s / K, s % K)) {
            inverse(s) = -1;
            continue;
          }
          std::int64_t const pos = cursor(sh.at(0, ids(s / K, s % K), c, C))++;
          perm(pos) = s;
          inverse(s) = pos;
        }
      });
  moe::detail::fence(space, "moe::permute::sort_by_expert: group sizes");
  out.perm = View1<std::int64_t, MS>(out.perm.data(), std::size_t(out.groups.offsets_host(E)));
}

/// \brief Sorted copy of the token rows: out[i] = x[perm[i] / K]  (the K-fold replication).
/// out may be moe::bf16 rows (each value rounded to nearest even: exact on bf16 values).
template <class ExecSpace, class Scalar, class MS, class O>
void gather_rows(ExecSpace const& space, View2<Scalar const, MS> x,
                 View1<std::int64_t const, MS> perm, int K, View2<O, MS> out) {
  moe::detail::Region region("moe::permute::gather");
  std::int64_t const D = x.extent(1), n = perm.extent(0);
  // Rows come in expert order, scattered over x: prefetch the source row a few iterations ahead.
  constexpr std::int64_t ahead = 8;
  moe::detail::for_each_row(
      space, "moe::permute::gather_rows", n,
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t lane, std::int64_t lanes) {
        if (lane == 0 && i + ahead < n && D > 0) moe::detail::prefetch(&x(perm(i + ahead) / K, 0));
        std::int64_t const t = perm(i) / K;
        for (std::int64_t d = lane; d < D; d += lanes)
          out(i, d) = moe::detail::value_cast<O>(x(t, d));
      });
}

namespace detail {
/// out[t] (+)= sum_k w[t,k] * src[inverse[t*K+k]] over the kept slots, in k order (a gather by
/// the inverse permutation); an empty w weighs every slot 1 (exact). src may be moe::bf16 rows,
/// and so may out (each sum rounded once to nearest even: the float out's bits, rounded).
template <class ExecSpace, class Scalar, class MS, class S, class O>
void gather_slots(ExecSpace const& space, char const* label, View2<S const, MS> src,
                  View1<std::int64_t const, MS> inverse, View2<Scalar const, MS> w, std::int64_t K,
                  bool accumulate, View2<O, MS> out) {
  std::int64_t const D = out.extent(1), T = out.extent(0);
  bool const weighted = w.data() != nullptr;
  constexpr std::int64_t ahead = 4;  // tokens: their src rows are scattered (see gather_rows)
  // Each sum in a register, in k order, J of the lane's columns at a time (d0 + j * step), and
  // written once: J large on host spaces (one lane; the loops over j vectorise), small on device
  // spaces (the registers of one thread).
  constexpr bool host = moe::detail::runs_on_host<ExecSpace>();
  constexpr std::int64_t J = host ? 64 : 8;
  moe::detail::for_each_row(
      space, label, T, KOKKOS_LAMBDA(std::int64_t t, std::int64_t lane, std::int64_t lanes) {
        if (lane == 0 && t + ahead < T && D > 0)
          for (std::int64_t k = 0; k < K; ++k) {
            std::int64_t const r = inverse((t + ahead) * K + k);
            if (r >= 0) moe::detail::prefetch(&src(r, 0));
          }
        std::int64_t const step = host ? 1 : lanes;
        for (std::int64_t d0 = lane; d0 < D; d0 += J * step) {
          std::int64_t const left = (D - d0 + step - 1) / step;
          std::int64_t const m = left < J ? left : J;
          Scalar acc[J];
          for (std::int64_t j = 0; j < m; ++j)
            acc[j] =
                accumulate ? moe::detail::value_cast<Scalar>(out(t, d0 + j * step)) : Scalar(0);
          for (std::int64_t k = 0; k < K; ++k) {
            std::int64_t const r = inverse(t * K + k);
            if (r < 0) continue;
            Scalar const wk = weighted ? w(t, k) : Scalar(1);
            for (std::int64_t j = 0; j < m; ++j)
              acc[j] += wk * moe::detail::value_cast<Scalar>(src(r, d0 + j * step));
          }
          for (std::int64_t j = 0; j < m; ++j)
            out(t, d0 + j * step) = moe::detail::value_cast<O>(acc[j]);
        }
      });
}
}  // namespace detail

/// \brief Unpermute and combine: y[t] (+)= sum_k w[t,k] * ys[inverse[t*K+k]] (kept slots, k order).
/// ys may be moe::bf16 rows (widened exactly), and so may y (each sum rounded once).
template <class ExecSpace, class Scalar, class MS, class S, class O>
void combine(ExecSpace const& space, View2<S const, MS> ys, View1<std::int64_t const, MS> inverse,
             View2<Scalar const, MS> w, bool accumulate, View2<O, MS> y) {
  moe::detail::Region region("moe::combine");
  detail::gather_slots(space, "moe::permute::combine", ys, inverse, w, w.extent(1), accumulate, y);
}

/// \brief Backward of combine. dys[i] = w[s] * dy[s / K] for the slot s = perm[i] (a gather),
/// and dw[t,k] = <dy[t], ys[inverse[t*K+k]]> (0 for dropped slots): the router gradient. dy, ys
/// and dys may be moe::bf16 rows (dy and ys widened exactly, w * dy rounded to nearest even into
/// dys).
template <class ExecSpace, class Scalar, class MS, class G, class S, class O>
void combine_backward(ExecSpace const& space, View2<G const, MS> dy, View2<S const, MS> ys,
                      View1<std::int64_t const, MS> perm, View1<std::int64_t const, MS> inverse,
                      View2<Scalar const, MS> w, View2<O, MS> dys, View2<Scalar, MS> dw) {
  moe::detail::Region region("moe::combine::backward");
  std::int64_t const D = dy.extent(1), K = w.extent(1);
  moe::detail::for_each_row(
      space, "moe::permute::combine_backward_rows", perm.extent(0),
      KOKKOS_LAMBDA(std::int64_t i, std::int64_t lane, std::int64_t lanes) {
        std::int64_t const s = perm(i), t = s / K;
        Scalar const ws = w(t, s % K);
        for (std::int64_t d = lane; d < D; d += lanes)
          dys(i, d) = moe::detail::value_cast<O>(ws * moe::detail::value_cast<Scalar>(dy(t, d)));
      });
  // A float dot product is summed in double: each product of two floats is exact there, so no
  // compiler's choice to fuse (or not) the multiply and the add changes the result, and float and
  // 16-bit ys (the same values) give the same bits in every build.
  using Acc = std::conditional_t<std::is_same<Scalar, float>::value, double, Scalar>;
  moe::detail::for_each_index(
      space, "moe::permute::combine_backward_weights", std::int64_t(dy.extent(0)),
      moe::detail::row_grain, KOKKOS_LAMBDA(std::int64_t t) {
        for (std::int64_t k = 0; k < K; ++k) {
          std::int64_t const r = inverse(t * K + k);
          Acc acc = 0;
          if (r >= 0)
            for (std::int64_t d = 0; d < D; ++d)
              acc += Acc(moe::detail::value_cast<Scalar>(dy(t, d))) *
                     Acc(moe::detail::value_cast<Scalar>(ys(r, d)));
          dw(t, k) = Scalar(acc);
        }
      });
}

/// \brief Backward of gather_rows: dx[t] (+)= sum_k dxs[inverse[t*K+k]] over kept slots, in k
/// order (a gather by the inverse permutation, not a scatter-add). dxs may be moe::bf16 rows, and
/// so may dx (each sum in float, rounded once).
template <class ExecSpace, class MS, class S, class O>
void gather_rows_backward(ExecSpace const& space, View2<S const, MS> dxs,
                          View1<std::int64_t const, MS> inverse, int K, bool accumulate,
                          View2<O, MS> dx) {
  using Scalar = std::conditional_t<std::is_same<O, moe::bf16>::value, float, O>;
  moe::detail::Region region("moe::permute::gather::backward");
  detail::gather_slots(space, "moe::permute::gather_rows_backward", dxs, inverse,
                       View2<Scalar const, MS>(), K, accumulate, dx);
}

}  // namespace moe::permute
