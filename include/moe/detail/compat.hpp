#pragma once
/// \file
/// The few Kokkos spellings that differ between Kokkos 3.4 (Debian's Trilinos build) and 4.x.

#include <Kokkos_Core.hpp>

#include <string>
#include <type_traits>
#include <utility>

namespace moe::detail {

#if KOKKOS_VERSION >= 40000
namespace kmath = ::Kokkos;
#else
namespace kmath = ::Kokkos::Experimental;
#endif

/// Device-safe math, spelled the same on every Kokkos version (moe::detail::exp(x), ...).
using kmath::exp;
using kmath::isfinite;
using kmath::isnan;
using kmath::log;
using kmath::log1p;
using kmath::sqrt;
using kmath::tanh;

/// Whether ExecSpace runs on the host (Serial, OpenMP, Threads): kernels take their host shape
/// there. Device spaces cannot reach host memory, even where the host can reach theirs (UVM).
template <class ExecSpace>
constexpr bool runs_on_host() {
  return Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
}

/// Hint that *p will be read soon (a software prefetch on host CPUs, nothing in device code).
KOKKOS_INLINE_FUNCTION void prefetch([[maybe_unused]] void const* p) {
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__) && \
    !defined(__HIP_DEVICE_COMPILE__) && !defined(__SYCL_DEVICE_ONLY__)
  __builtin_prefetch(p);
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T max(T a, T b) {
  return a < b ? b : a;
}
template <class T>
KOKKOS_INLINE_FUNCTION T min(T a, T b) {
  return b < a ? b : a;
}

/// Whether ExecSpace has labelled fences (Kokkos 3.6+).
template <class ExecSpace, class = void>
struct has_labelled_fence : std::false_type {};
template <class ExecSpace>
struct has_labelled_fence<
    ExecSpace, std::void_t<decltype(std::declval<ExecSpace const&>().fence(std::string()))>>
    : std::true_type {};

/// space.fence(label) where Kokkos has labelled fences (3.6+), space.fence() on Kokkos 3.4.
template <class ExecSpace>
void fence(ExecSpace const& space, char const* label) {
  if constexpr (has_labelled_fence<ExecSpace>::value)
    space.fence(label);
  else
    (void)label, space.fence();
}

/// A Kokkos Tools profiling region (named `moe::...`) for the object's lifetime.
class Region {
 public:
  explicit Region(char const* name) { Kokkos::Profiling::pushRegion(name); }
  ~Region() { Kokkos::Profiling::popRegion(); }
  Region(Region const&) = delete;
  Region& operator=(Region const&) = delete;
};

}  // namespace moe::detail
