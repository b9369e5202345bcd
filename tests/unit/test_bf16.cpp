// moe::bf16 and the IEEE half conversions (moe/bf16.hpp) bit-exactly against a plain reference
// written in double arithmetic: every class of value (normals, subnormals, +-0, +-Inf, NaN,
// values that round to Inf, ties to even both ways) over every bf16 / half upper part with
// lower parts that sit on, just below and just above the rounding boundaries; and the
// conversions in Kokkos kernels on the default execution space.
#include <moe/bf16.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// The value of a binary format with `frac` fraction bits, exponent bias `bias`, `exp_bits`
/// exponent bits, from its bits (finite values only), in double.
double decode(std::uint32_t b, int frac, int exp_bits, int bias) {
  std::uint32_t const e = (b >> frac) & ((1u << exp_bits) - 1u), m = b & ((1u << frac) - 1u);
  double const sign = (b >> (frac + exp_bits)) & 1u ? -1.0 : 1.0;
  if (e == 0) return sign * std::ldexp(double(m), 1 - bias - frac);
  return sign * std::ldexp(double(m | (1u << frac)), int(e) - bias - frac);
}

/// Round-to-nearest-even of the finite float `f` to a format with `frac` fraction bits,
/// `exp_bits` exponent bits and bias `bias`, by search over the format's finite values: the
/// nearest one, ties to the even bit pattern, and Inf when |f| >= max + half a spacing at the
/// top (rounding with an unbounded exponent). Returns the bits.
std::uint32_t reference_round(float f, int frac, int exp_bits, int bias) {
  double const v = f;
  std::uint32_t const sign_bit = 1u << (frac + exp_bits);
  std::uint32_t const inf = ((1u << exp_bits) - 1u) << frac;
  std::uint32_t const sign = std::signbit(f) ? sign_bit : 0u;
  double const a = std::fabs(v);
  if (std::isinf(f)) return sign | inf;
  // Largest finite value and the spacing at the top: |v| >= max + spacing / 2 overflows.
  double const max = decode(inf - 1u, frac, exp_bits, bias);
  double const top = std::ldexp(1.0, (1 << exp_bits) - 2 - bias - frac);
  if (a >= max + top / 2) return sign | inf;
  // Binary search for the largest pattern whose value is <= a (magnitudes are monotone in the
  // bits), then compare with its successor.
  std::uint32_t lo = 0, hi = inf - 1u;
  while (lo < hi) {
    std::uint32_t const mid = (lo + hi + 1u) / 2u;
    if (decode(mid, frac, exp_bits, bias) <= a)
      lo = mid;
    else
      hi = mid - 1u;
  }
  if (lo == inf - 1u) return sign | lo;  // a in [max, max + top/2): rounds down to max
  double const below = decode(lo, frac, exp_bits, bias),
               above = decode(lo + 1u, frac, exp_bits, bias);
  std::uint32_t r = lo;
  if (a - below > above - a || (a - below == above - a && (lo & 1u))) r = lo + 1u;
  return sign | r;
}

/// Floats whose upper bits take every value of the target format's width, with lower parts on,
/// next to and between the rounding boundaries (and a few more), NaNs left out.
std::vector<float> probe_floats(int dropped_bits) {
  std::uint32_t const half = 1u << (dropped_bits - 1), full = (1u << dropped_bits) - 1u;
  std::vector<std::uint32_t> const lows = {0u, 1u, half - 1u, half, half + 1u, full, half / 3u};
  std::vector<float> out;
  for (std::uint32_t up = 0; up < (1u << (32 - dropped_bits)); ++up)
    for (std::uint32_t low : lows) {
      float const f = from_bits((up << dropped_bits) | low);
      if (!std::isnan(f)) out.push_back(f);
    }
  return out;
}

/// b = bf16(f) and back = float(b) in a kernel of the default execution space (a free function:
/// nvcc takes no extended lambda in a test body, a private member function).
void convert_in_kernel(Kokkos::View<float*> f, Kokkos::View<moe::bf16*> b,
                       Kokkos::View<float*> back) {
  Kokkos::parallel_for(
      "test_bf16", Kokkos::RangePolicy<>(0, f.extent(0)), KOKKOS_LAMBDA(std::int64_t i) {
        b(i) = moe::bf16(f(i));
        back(i) = float(b(i));
      });
}

}  // namespace

TEST(Bf16, RoundsToNearestEvenOnEveryClassOfValue) {
  std::int64_t n = 0;
  for (float f : probe_floats(16)) {
    std::uint32_t const want = reference_round(f, 7, 8, 127);
    ASSERT_EQ(moe::bf16(f).bits, want) << "float bits 0x" << std::hex << bits_of(f);
    ++n;
  }
  EXPECT_GT(n, 400000);
  // Named cases.
  EXPECT_EQ(moe::bf16(1.0f).bits, 0x3f80u);
  EXPECT_EQ(moe::bf16(from_bits(0x3f808000u)).bits, 0x3f80u);  // tie, even below
  EXPECT_EQ(moe::bf16(from_bits(0x3f818000u)).bits, 0x3f82u);  // tie, odd: up to even
  EXPECT_EQ(moe::bf16(from_bits(0x3f808001u)).bits, 0x3f81u);  // just past the tie
  EXPECT_EQ(moe::bf16(-0.0f).bits, 0x8000u);
  EXPECT_EQ(moe::bf16(0.0f).bits, 0x0000u);
  EXPECT_EQ(moe::bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);  // rounds to Inf
  EXPECT_EQ(moe::bf16(from_bits(0x7f7f7fffu)).bits, 0x7f7fu);  // stays the largest finite
  EXPECT_EQ(moe::bf16(-std::numeric_limits<float>::infinity()).bits, 0xff80u);
  EXPECT_EQ(moe::bf16(std::numeric_limits<float>::denorm_min()).bits, 0x0000u);
  EXPECT_EQ(moe::bf16(from_bits(0x00018000u)).bits, 0x0002u);  // subnormal tie, odd: up
}

TEST(Bf16, NanStaysNanAndEveryBf16RoundTrips) {
  for (std::uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xffc12345u, 0x7fffffffu, 0xff800001u}) {
    moe::bf16 const b(from_bits(nan));
    EXPECT_TRUE(std::isnan(float(b))) << std::hex << nan;
    EXPECT_EQ(b.bits & 0x8000u, (nan >> 16) & 0x8000u) << "sign kept";
    EXPECT_TRUE(b.bits & 0x0040u) << "quiet";
  }
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    float const f = float(moe::bf16::from_bits(std::uint16_t(b)));
    EXPECT_EQ(bits_of(f), b << 16);
    if (!std::isnan(f)) {
      ASSERT_EQ(moe::bf16(f).bits, b) << std::hex << b;
    }
  }
}

TEST(Half, RoundsToNearestEvenAndDecodesExactly) {
  for (float f : probe_floats(13)) {
    // Floats below half's range are probed through their upper 19 bits: every exponent.
    std::uint32_t const want = reference_round(f, 10, 5, 15);
    ASSERT_EQ(moe::detail::float_to_half_bits(f), want)
        << "float bits 0x" << std::hex << bits_of(f);
  }
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    float const f = moe::detail::half_bits_to_float(std::uint16_t(h));
    bool const nan = ((h >> 10) & 0x1fu) == 0x1fu && (h & 0x3ffu);
    if (nan) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
      continue;
    }
    if (((h >> 10) & 0x1fu) != 0x1fu) {
      ASSERT_EQ(double(f), decode(h, 10, 5, 15)) << std::hex << h;
    }
    ASSERT_EQ(moe::detail::float_to_half_bits(f), h) << std::hex << h;
  }
  EXPECT_EQ(moe::detail::float_to_half_bits(65504.0f), 0x7bffu);
  EXPECT_EQ(moe::detail::float_to_half_bits(65520.0f), 0x7c00u);  // tie at the top: Inf
  EXPECT_EQ(moe::detail::float_to_half_bits(std::ldexp(1.0f, -25)), 0x0000u);  // tie: to 0
  EXPECT_EQ(moe::detail::float_to_half_bits(std::ldexp(1.5f, -25)), 0x0001u);
}

// The conversions inside kernels of the default execution space (a device where there is one)
// give the host's bits.
TEST(Bf16, ConvertsTheSameInKernels) {
  auto const host = probe_floats(16);
  std::int64_t const n = std::int64_t(host.size());
  Kokkos::View<float*> f("f", n);
  Kokkos::View<moe::bf16*> b("b", n);
  Kokkos::View<float*> back("back", n);
  auto fh = Kokkos::create_mirror_view(f);
  for (std::int64_t i = 0; i < n; ++i) fh(i) = host[std::size_t(i)];
  Kokkos::deep_copy(f, fh);
  convert_in_kernel(f, b, back);
  auto bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  auto backh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bh(i).bits, moe::bf16(host[std::size_t(i)]).bits) << i;
    ASSERT_EQ(bits_of(backh(i)), std::uint32_t(bh(i).bits) << 16) << i;
  }
}
