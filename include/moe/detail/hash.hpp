#pragma once
/// \file
/// 64-bit FNV-1a, the library's one non-cryptographic hash.

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe::detail {

/// The starting value moe has always used (one digit short of FNV's published offset basis,
/// 14695981039346656037; kept because train_moe derives parameter initialisation from it).
inline constexpr std::uint64_t fnv1a_basis = 1469598103934665603ull;

/// FNV-1a of n bytes, continuing from `h` (pass a previous result to hash several pieces).
inline std::uint64_t fnv1a(void const* data, std::size_t n, std::uint64_t h = fnv1a_basis) {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

/// FNV-1a of a string's bytes.
inline std::uint64_t fnv1a(std::string const& s) { return fnv1a(s.data(), s.size()); }

}  // namespace moe::detail
