#pragma once
/// \file
/// View aliases used across moe: everything is LayoutRight (row-major, as MaxText's tensors).

#include <moe/bf16.hpp>
#include <moe/error.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

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

/// (Re)allocates v without initialising when its extents differ from the requested ones.
template <class ViewT, class ExecSpace, class... Extents>
void ensure(ExecSpace const& space, ViewT& v, std::string const& label, Extents... n) {
  std::size_t const want[] = {static_cast<std::size_t>(n)...};
  bool same = v.data() != nullptr || v.size() == 0;  // an empty view may have no data
  for (unsigned r = 0; r < sizeof...(n); ++r) same = same && v.extent(r) == want[r];
  if (!same) v = alloc<ViewT>(space, label, n...);
}

/// \brief The View type `Expected` of a public entry point, made from the caller's View; anything
/// not convertible stops the build with a static_assert naming the rule (not pages of errors).
template <class Expected, class Given>
Expected api_view(Given const& v) {
  static_assert(Kokkos::is_view<Given>::value, "moe: this argument must be a Kokkos::View");
  if constexpr (Kokkos::is_view<Given>::value) {
    constexpr bool rank_ok = unsigned(Given::rank) == unsigned(Expected::rank);
    constexpr bool layout_ok =
        std::is_same_v<typename Given::array_layout, Kokkos::LayoutRight> || Given::rank <= 1;
    constexpr bool value_ok = std::is_same_v<typename Given::non_const_value_type,
                                             typename Expected::non_const_value_type> &&
                              (std::is_const_v<typename Expected::value_type> ||
                               !std::is_const_v<typename Given::value_type>);
    constexpr bool space_ok =
        std::is_same_v<typename Given::memory_space, typename Expected::memory_space>;
    static_assert(rank_ok, "moe: the View has the wrong rank for this argument (see its doc)");
    static_assert(layout_ok,
                  "moe: Views passed to moe must be Kokkos::LayoutRight (row-major, like "
                  "MaxText's tensors); a View declared without a layout is LayoutLeft on CUDA "
                  "and HIP: declare it with Kokkos::LayoutRight or deep_copy into one");
    static_assert(value_ok,
                  "moe: the View's value type must be the layer's Scalar (and not const where "
                  "moe writes the result)");
    static_assert(
        space_ok,
        "moe: the View must live in the layer's memory space (create_mirror_view_and_copy "
        "it there first)");
    if constexpr (rank_ok && layout_ok && value_ok && space_ok) return Expected(v);
  }
  return Expected();
}

}  // namespace detail
namespace detail {
/// \brief Rows held as Value or, where CanNarrow, as moe::bf16 (the same values in half the
/// bytes): a bf16 step's routed rows, whose width is chosen at run time.
template <class Value, class MemorySpace, bool CanNarrow>
struct RowsView {
  View2<Value, MemorySpace> wide;
  View2<moe::bf16, MemorySpace> narrow;
  bool is_narrow = false;

  /// Holds `v` (a View2 of Value, or of moe::bf16 where CanNarrow), dropping the other width.
  template <class V>
  void set(V const& v) {
    static_assert(std::is_same<V, View2<Value, MemorySpace>>::value ||
                      (CanNarrow && std::is_same<V, View2<moe::bf16, MemorySpace>>::value),
                  "moe::detail::RowsView: rows of Value, or of moe::bf16 where CanNarrow");
    *this = RowsView();
    if constexpr (std::is_same<V, View2<Value, MemorySpace>>::value) {
      wide = v;
    } else {
      narrow = v;
      is_narrow = true;
    }
  }
  std::int64_t rows() const { return std::int64_t(is_narrow ? narrow.extent(0) : wide.extent(0)); }
  /// The rows as Value, for a reader that takes only Value rows (where the plan keeps them wide).
  View2<Value, MemorySpace> const& values() const {
    if (is_narrow) throw Error("moe internal error: 16-bit rows read as the layer's value type");
    return wide;
  }
  /// body(v) on the view in use: View2<Value> or (narrow) View2<moe::bf16>.
  template <class Body>
  decltype(auto) visit(Body&& body) const {
    if constexpr (CanNarrow)
      if (is_narrow) return body(narrow);
    return body(wide);
  }
  /// body(mine, its) on the views in use here and in `other`, which must be of the same width:
  /// a copy, permutation or collective between two buffers of routed rows.
  template <class Body>
  decltype(auto) visit_with(RowsView const& other, Body&& body) const {
    if (is_narrow != other.is_narrow)
      throw Error("moe internal error: two buffers of routed rows differ in width");
    if constexpr (CanNarrow)
      if (is_narrow) return body(narrow, other.narrow);
    return body(wide, other.wide);
  }
};
}  // namespace detail

}  // namespace moe
