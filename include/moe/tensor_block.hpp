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

}  // namespace moe
