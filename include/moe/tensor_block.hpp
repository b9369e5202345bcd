#pragma once
/// \file
/// moe::TensorBlock: the block of a global tensor one rank holds. Shared by the distributed layout
/// (which computes blocks) and the checkpoint format (which stores them); pure.

#include <cstdint>
#include <vector>

namespace moe {

/// \brief The block of a global tensor one rank holds: global[offset + i] for i < local_shape.
struct TensorBlock {
  std::vector<std::int64_t> global_shape, local_shape, offset;
};

/// \brief Number of elements of a row-major shape (1 for a scalar; no overflow check: see
/// moe::io's checked sizes for shapes read from files).
inline std::int64_t numel(std::vector<std::int64_t> const& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace moe
