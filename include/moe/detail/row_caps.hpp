#pragma once
/// \file
/// What a buffer with room for a limited number of rows keeps (pure host arithmetic, no Kokkos or
/// MPI, so the step plan can use it): the ragged all-to-all's receive buffer, sized by
/// scaled_rows() under ragged_buffer_factor, keeps the rows that clamp_prefix() says.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moe::detail {

/// \brief min(cap, int(rows * factor)) for factor > 0, computed so that no huge factor
/// overflows the conversion: the row count of a receive buffer scaled by ragged_buffer_factor.
inline std::int64_t scaled_rows(std::int64_t rows, double factor, std::int64_t cap) {
  double const want = static_cast<double>(rows) * factor;
  return want < static_cast<double>(cap) ? static_cast<std::int64_t>(want) : cap;
}

/// \brief What a buffer of `R` rows keeps of blocks of `sizes` rows taken in order: the prefix
/// sums of `sizes` clamped to R, differenced.
///
/// kept[k] = min(R, S[k+1]) - min(R, S[k]) with S[k] = sizes[0] + ... + sizes[k-1]: earlier
/// blocks keep all their rows, the block that crosses R keeps what is left, later blocks keep
/// none. R < 0 means no cap (kept == sizes). Sizes must be >= 0. This one rule is the receiver's
/// truncation of the ragged all-to-all (per receiver, over senders in rank order) and the local
/// permute's (over (sender, local expert) blocks, row-major), so the two drop the same rows.
/// \return kept, with sum(kept) = min(R, sum(sizes)) (sum(sizes) when R < 0)
inline std::vector<std::int64_t> clamp_prefix(std::vector<std::int64_t> sizes, std::int64_t R) {
  std::int64_t before = 0;
  for (auto& b : sizes) {
    std::int64_t const after = R >= 0 ? std::min(R, before + b) : before + b;
    b = after - before;
    before = after;
  }
  return sizes;
}

}  // namespace moe::detail
