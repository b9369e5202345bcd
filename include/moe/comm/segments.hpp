#pragma once
/// \file
/// How the reductions and the gathers along a dimension split a large tensor into segments:
/// what they run and what the memory estimate (distributed/memory.hpp) counts as their
/// temporaries. No Kokkos, no MPI.
///
/// Each segment is its own collective. Sums are elementwise and taken in rank order, so the
/// segments change no bit of a result, only the size of the temporaries (a segment's, not the
/// tensor's) and the number of MPI calls.

#include <algorithm>
#include <cstdint>

namespace moe::comm::detail {

/// Largest segment a reduction or gather moves at once, all ranks' pieces together, in bytes of
/// what it moves (64 MiB; tests lower it, on every rank alike).
inline std::int64_t& segment_bytes() {
  static std::int64_t bytes = std::int64_t(64) << 20;
  return bytes;
}

/// Elements of `elem_bytes` in a segment over P ranks: at least one per rank.
inline std::int64_t segment_elems(int P, std::int64_t elem_bytes) {
  return std::max<std::int64_t>(P, segment_bytes() / elem_bytes);
}

/// How all_reduce splits n elements of `elem_bytes` over P ranks: the first n - n % P in
/// segments of `size` (the last may be shorter, all multiples of P), then the n % P left, if
/// any, in a zero-padded copy of P elements.
struct AllReduceSegments {
  std::int64_t size = 0;  ///< elements of a full segment, a multiple of P
  std::int64_t temp = 0;  ///< elements of the temporaries: receive buffer, padded remainder
};

inline AllReduceSegments all_reduce_segments(std::int64_t n, int P, std::int64_t elem_bytes) {
  AllReduceSegments s;
  if (P <= 1 || n <= 0) return s;
  s.size = segment_elems(P, elem_bytes) / P * P;
  std::int64_t const rest = n % P == 0 ? 0 : P;
  s.temp = std::max(std::min(n - n % P, s.size), rest) + rest;
  return s;
}

/// The tiles of a tensor viewed as [A, P, L] (the gathered or scattered dimension split into
/// its P blocks, L elements each per leading index a) that a gather or reduce-scatter along that
/// dimension moves at once: `rows` leading indices whole (L elements) when P * L fits a segment,
/// else `cols` elements of one index. Either way each rank's piece of a tile is contiguous, in
/// the tensor and in the rank's block, and a tile has at most a segment's elements over P ranks.
struct Tiles {
  std::int64_t rows = 0;  ///< leading indices per tile
  std::int64_t cols = 0;  ///< elements per leading index and rank (L, or fewer with rows = 1)
  /// Elements of one rank's piece of the largest tile.
  std::int64_t piece() const { return rows * cols; }
  /// Whether one tile is the whole tensor.
  bool whole(std::int64_t A, std::int64_t L) const { return rows >= A && cols >= L; }
};

inline Tiles tiles(std::int64_t A, std::int64_t L, int P, std::int64_t elem_bytes) {
  Tiles t;
  if (A <= 0 || L <= 0) return t;
  std::int64_t const S = segment_elems(P, elem_bytes);
  if (std::int64_t(P) * L <= S) {
    t.rows = std::min(A, S / (std::int64_t(P) * L));
    t.cols = L;
  } else {
    t.rows = 1;
    t.cols = S / P;
  }
  return t;
}

}  // namespace moe::comm::detail
