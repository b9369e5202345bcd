#pragma once
/// \file
/// Text of shapes and offsets in messages, one format for every component (pure).

#include <cstdint>
#include <string>
#include <vector>

namespace moe::detail {

/// \brief "[a, b, c]": the text of a shape (or an offset) in messages.
inline std::string shape_text(std::vector<std::int64_t> const& v) {
  std::string s;
  for (auto x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return "[" + s + "]";
}

}  // namespace moe::detail
