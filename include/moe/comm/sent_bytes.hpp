#pragma once
/// \file
/// Bytes one rank sends in each collective moe runs, as functions of the buffer sizes: the one
/// formula that the comm log records and the step plan (distributed/step_plan.hpp) predicts.

#include <cstdint>

namespace moe::comm::sent_bytes {

/// All-gather over P ranks of an input block of `in_bytes`: every other rank gets the block.
constexpr std::int64_t all_gather(std::int64_t in_bytes, std::int64_t P) {
  return P > 1 ? in_bytes * (P - 1) : 0;
}

/// Reduce-scatter over P ranks into an output block of `out_bytes`: every other rank's block.
constexpr std::int64_t reduce_scatter(std::int64_t out_bytes, std::int64_t P) {
  return P > 1 ? out_bytes * (P - 1) : 0;
}

/// All-reduce over P ranks of `bytes` (ring algorithm: a reduce-scatter and an all-gather).
constexpr std::int64_t all_reduce(std::int64_t bytes, std::int64_t P) {
  return P > 1 ? 2 * bytes * (P - 1) / P : 0;
}

/// All-to-all over P ranks of `bytes` spread evenly over the destinations: all but the own share.
constexpr std::int64_t all_to_all_balanced(std::int64_t bytes, std::int64_t P) {
  return P > 1 ? bytes * (P - 1) / P : 0;
}

}  // namespace moe::comm::sent_bytes
