#pragma once
/// \file
/// View aliases used across moe: everything is LayoutRight (row-major, as MaxText's tensors).

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>

namespace moe {

template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using View1 = Kokkos::View<T*, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using View2 = Kokkos::View<T**, Kokkos::LayoutRight, MemorySpace>;
template <class T, class MemorySpace = Kokkos::DefaultExecutionSpace::memory_space>
using View3 = Kokkos::View<T***, Kokkos::LayoutRight, MemorySpace>;

namespace detail {

/// Allocates an uninitialised view with a moe:: label on the given execution space instance.
template <class ViewT, class ExecSpace, class... Extents>
ViewT alloc(ExecSpace const& space, std::string const& label, Extents... n) {
  return ViewT(Kokkos::view_alloc(space, Kokkos::WithoutInitializing, label),
               static_cast<std::size_t>(n)...);
}

/// Allocates a zero-filled view with a moe:: label on the given execution space instance.
template <class ViewT, class ExecSpace, class... Extents>
ViewT zeros(ExecSpace const& space, std::string const& label, Extents... n) {
  ViewT v(Kokkos::view_alloc(space, Kokkos::WithoutInitializing, label),
          static_cast<std::size_t>(n)...);
  Kokkos::deep_copy(space, v, typename ViewT::non_const_value_type{});
  return v;
}

/// (Re)allocates v without initialising when its extents differ from the requested ones.
template <class ViewT, class ExecSpace, class... Extents>
void ensure(ExecSpace const& space, ViewT& v, std::string const& label, Extents... n) {
  std::size_t const want[] = {static_cast<std::size_t>(n)...};
  std::size_t total = 1;
  for (std::size_t w : want) total *= w;
  bool same = v.data() != nullptr || total == 0;
  for (unsigned r = 0; r < sizeof...(n); ++r) same = same && v.extent(r) == want[r];
  if (!same) v = alloc<ViewT>(space, label, n...);
}

/// 2-D row-major view over the same memory as a contiguous 3-D view [A,B,C] -> [A*B, C].
template <class T, class MS>
View2<T, MS> flatten(View3<T, MS> const& v) {
  return View2<T, MS>(v.data(), v.extent(0) * v.extent(1), v.extent(2));
}

}  // namespace detail
}  // namespace moe
