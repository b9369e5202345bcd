#pragma once
/// \file
/// moe::bf16: bfloat16 (the upper half of an IEEE float) as a plain 16-bit struct, so it lives in
/// Kokkos Views on every backend (Kokkos 3.4 has none). float -> bf16 rounds to nearest even (as
/// JAX and PyTorch), overflowing to +-Inf and keeping NaN quiet; bf16 -> float is exact. The same
/// for IEEE half on the host: detail::float_to_half_bits and detail::half_bits_to_float.

#include <Kokkos_Macros.hpp>

#include <cstdint>
#include <type_traits>

namespace moe {

namespace detail {

/// The bits of a float (a union read: a bit_cast every host and device compiler accepts).
KOKKOS_INLINE_FUNCTION std::uint32_t float_bits(float f) {
  union {
    float f;
    std::uint32_t u;
  } v{f};
  return v.u;
}
KOKKOS_INLINE_FUNCTION float bits_float(std::uint32_t u) {
  union {
    std::uint32_t u;
    float f;
  } v{u};
  return v.f;
}

/// float -> bf16 bits, round to nearest, ties to even (see the file comment). Both outcomes are
/// computed and one selected (no early return), so loops that round vectorise.
KOKKOS_INLINE_FUNCTION std::uint16_t bf16_bits(float f) {
  std::uint32_t const u = float_bits(f);
  // Adding 0x7fff plus the lowest kept bit rounds to nearest with ties to even; a carry out of
  // the fraction steps the exponent (up to Inf, exactly where rounding overflows).
  std::uint32_t const rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  std::uint32_t const quiet_nan = (u >> 16) | 0x0040u;  // NaN: quiet, sign and upper payload kept
  return std::uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/// bf16 bits -> float, exact.
KOKKOS_INLINE_FUNCTION float bf16_to_float(std::uint16_t b) {
  return bits_float(std::uint32_t(b) << 16);
}

/// x rounded to the nearest bf16 (through float, ties to even), kept in x's type: the bf16
/// scheme's cast of a value held in float or double.
template <class T>
KOKKOS_INLINE_FUNCTION T round_to_bf16(T x) {
  return T(bf16_to_float(bf16_bits(float(x))));
}

/// float -> IEEE half bits, round to nearest, ties to even (host; see the file comment).
inline std::uint16_t float_to_half_bits(float f) {
  std::uint32_t const u = float_bits(f);
  std::uint32_t const sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return std::uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x47800000u) return std::uint16_t(sign | 0x7c00u);  // >= 65536 (and Inf): Inf
  if (a < 0x38800000u) {
    // Below 2^-14: a subnormal half in units of 2^-24, i.e. the float's significand m (24 bits
    // with the hidden one) shifted right by 126 - e, rounded to nearest even.
    if (a < 0x33000000u) return std::uint16_t(sign);  // below 2^-25: rounds to 0 (2^-25 ties to 0)
    std::uint32_t const e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
    std::uint32_t const shift = 126u - e;
    std::uint32_t const q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return std::uint16_t(sign | (q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit fraction to 10 bits; a carry
  // steps the exponent, up to Inf.
  std::uint32_t const r = a - 0x38000000u;
  return std::uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

/// IEEE half bits -> float, exact (host).
inline float half_bits_to_float(std::uint16_t h) {
  std::uint32_t const sign = std::uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu,
                      m = h & 0x3ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));  // Inf, NaN
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_float(sign);
  // Subnormal: m * 2^-24, normalised.
  int shift = 0;
  std::uint32_t mm = m;
  while (!(mm & 0x400u)) mm <<= 1, ++shift;
  return bits_float(sign | ((113u - std::uint32_t(shift)) << 23) | ((mm & 0x3ffu) << 13));
}

}  // namespace detail

/// \brief bfloat16 storage (see the file comment): construct from a float (rounded to nearest
/// even), convert to float (exact). Arithmetic is done in float.
struct bf16 {
  std::uint16_t bits;  ///< the raw bits (trivial type: Views of bf16 need no initialisation)

  bf16() = default;
  KOKKOS_INLINE_FUNCTION explicit bf16(float f) : bits(detail::bf16_bits(f)) {}
  KOKKOS_INLINE_FUNCTION explicit operator float() const { return detail::bf16_to_float(bits); }
  /// The bf16 whose bits are `b`.
  KOKKOS_INLINE_FUNCTION static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }
};
static_assert(sizeof(bf16) == 2, "moe::bf16 is 16 bits");

namespace detail {
/// s as a D: to bf16 rounds to nearest even, from bf16 is exact; bf16 converts through float, and
/// any other pair as D(s).
template <class D, class S>
KOKKOS_INLINE_FUNCTION D value_cast(S s) {
  constexpr bool via_float =
      !std::is_same<S, D>::value && (std::is_same<S, bf16>::value || std::is_same<D, bf16>::value);
  return D(std::conditional_t<via_float, float, D>(s));
}
}  // namespace detail

}  // namespace moe
