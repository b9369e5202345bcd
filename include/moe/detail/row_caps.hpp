#pragma once
/// \file
/// What a buffer with room for a limited number of rows keeps (pure host arithmetic).

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moe::detail {

/// \brief min(cap, int(rows * factor)) for factor > 0, without overflow for a huge factor.
inline std::int64_t scaled_rows(std::int64_t rows, double factor, std::int64_t cap) {
  double const want = static_cast<double>(rows) * factor;
  return want < static_cast<double>(cap) ? static_cast<std::int64_t>(want) : cap;
}

/// \brief What a buffer of `R` rows keeps of blocks of `sizes` (>= 0) rows taken in order:
/// kept[k] = min(R, S[k+1]) - min(R, S[k]) with S the prefix sums; R < 0 means no cap. Both the
/// ragged all-to-all and the local permute truncate with it, so the two drop the same rows.
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
