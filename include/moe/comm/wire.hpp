#pragma once
/// \file
/// The wire type of a collective: what one value is sent as. Native: the value type itself; bf16:
/// moe::bf16, for a `dtype=bfloat16` layer (docs/precision.md, "Wire"): converted to bf16, moved,
/// and converted back (exact); a reduction of bf16 pieces sums them in fp32 and rounds once.

#include <moe/bf16.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

namespace moe::comm {

/// \brief What a collective's values travel as (see the file comment).
enum class Wire { native, bf16 };

/// Bytes of one value on the wire when a value has `value_bytes` bytes.
constexpr std::int64_t wire_bytes(Wire w, std::int64_t value_bytes) {
  return w == Wire::bf16 ? std::int64_t(sizeof(moe::bf16)) : value_bytes;
}

namespace detail {

/// Conversions between value and wire types: to bf16 rounds to nearest even, from bf16 is exact.
template <class D>
struct WireCast {
  template <class S>
  KOKKOS_INLINE_FUNCTION static D from(S s) {
    return moe::detail::value_cast<D>(s);
  }
};

/// The type sums of wire values of type W are accumulated in: fp32 for bf16, W otherwise.
template <class W>
using wire_acc_t = std::conditional_t<std::is_same_v<W, moe::bf16>, float, W>;

/// dst[i] = src[i] converted (see WireCast), i < n, on `space`.
template <class ExecSpace, class S, class D>
void convert(ExecSpace const& space, char const* label, S const* src, D* dst, std::int64_t n) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(space, 0, n),
      KOKKOS_LAMBDA(std::int64_t i) { dst[i] = WireCast<D>::from(src[i]); });
}

}  // namespace detail

}  // namespace moe::comm
