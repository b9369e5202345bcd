#pragma once
/// \file
/// Checked int64 arithmetic for sizes computed from a configuration: overflow is a ConfigError.

#include <moe/error.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace moe {

/// \brief a * b, or a ConfigError naming `what` when the product does not fit int64 (a, b >= 0).
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string const& what) {
  detail::require<ConfigError>(a >= 0 && b >= 0, what, ": negative factor (", a, " x ", b, ")");
  if (a != 0 && b > std::numeric_limits<std::int64_t>::max() / a)
    throw ConfigError(detail::cat(what, " = ", a, " x ", b,
                                  " does not fit a 64-bit integer (at most ",
                                  std::numeric_limits<std::int64_t>::max(), ")"));
  return a * b;
}

/// \brief a + b, or a ConfigError naming `what` when the sum does not fit int64 (a, b >= 0).
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string const& what) {
  detail::require<ConfigError>(a >= 0 && b >= 0, what, ": negative term (", a, " + ", b, ")");
  if (b > std::numeric_limits<std::int64_t>::max() - a)
    throw ConfigError(detail::cat(what, " = ", a, " + ", b,
                                  " does not fit a 64-bit integer (at most ",
                                  std::numeric_limits<std::int64_t>::max(), ")"));
  return a + b;
}

/// \brief Product of `factors` (element count of a shape), checked: ConfigError naming `what`
/// and the whole shape when it does not fit int64.
inline std::int64_t checked_product(std::vector<std::int64_t> const& factors,
                                    std::string const& what) {
  std::int64_t p = 1;
  for (auto f : factors) {
    detail::require<ConfigError>(f >= 0, what, ": negative extent ", f);
    if (f != 0 && p > std::numeric_limits<std::int64_t>::max() / f) {
      std::string shape;
      for (auto g : factors) shape += (shape.empty() ? "" : " x ") + std::to_string(g);
      throw ConfigError(detail::cat(what, " = ", shape, " does not fit a 64-bit integer (at most ",
                                    std::numeric_limits<std::int64_t>::max(), ")"));
    }
    p *= f;
  }
  return p;
}

}  // namespace moe
