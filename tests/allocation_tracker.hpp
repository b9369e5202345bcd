#pragma once
// Live and peak bytes of Kokkos allocations, through the Kokkos Tools data callbacks: the tests
// that hold moe's memory estimate, and a collective's temporaries, to what Kokkos allocated.
#include <Kokkos_Core.hpp>

#include <cstdint>

namespace moe_test {

/// Counts every Kokkos allocation and deallocation while it lives (one at a time).
struct AllocationTracker {
  static inline std::int64_t live = 0, peak = 0;
  static void on_alloc(Kokkos_Profiling_SpaceHandle, char const*, void const*, std::uint64_t n) {
    live += std::int64_t(n);
    peak = live > peak ? live : peak;
  }
  static void on_free(Kokkos_Profiling_SpaceHandle, char const*, void const*, std::uint64_t n) {
    live -= std::int64_t(n);
  }
  AllocationTracker() {
    live = peak = 0;
    Kokkos::Tools::Experimental::set_allocate_data_callback(&on_alloc);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(&on_free);
  }
  ~AllocationTracker() {
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
  }
  AllocationTracker(AllocationTracker const&) = delete;
  AllocationTracker& operator=(AllocationTracker const&) = delete;
};

}  // namespace moe_test
