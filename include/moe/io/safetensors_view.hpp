#pragma once
/// \file
/// Copies between safetensors tensors (moe/io/safetensors.hpp) and Kokkos Views of any rank,
/// layout and memory space. Tensors are row-major; Views may use any layout: elements are matched
/// by index, not by memory order. Device data is staged through a host mirror.

#include <Kokkos_Core.hpp>
#include <moe/io/safetensors.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::io {
namespace detail {

template <class V, std::size_t R, std::size_t... I>
typename V::reference_type view_element(V const& v, std::array<std::size_t, R> const& idx,
                                        std::index_sequence<I...>) {
  (void)idx;  // unused for rank 0
  return v(idx[I]...);
}

/// Calls f(element reference) for every element of the host view \p v, last index fastest.
template <class V, class F>
void for_each_row_major(V const& v, F&& f) {
  constexpr std::size_t R = static_cast<std::size_t>(V::rank);
  std::array<std::size_t, R> idx{};
  for (std::size_t flat = 0; flat < v.size(); ++flat) {
    f(view_element(v, idx, std::make_index_sequence<R>{}));
    for (std::size_t d = R; d-- > 0 && ++idx[d] == v.extent(d);) idx[d] = 0;  // next index
  }
}

/// The extents of a View of any rank (0 included) as a shape.
template <class V>
std::vector<std::int64_t> view_shape(V const& v) {
  std::vector<std::int64_t> shape(static_cast<std::size_t>(V::rank));
  for (std::size_t d = 0; d < shape.size(); ++d) shape[d] = static_cast<std::int64_t>(v.extent(d));
  return shape;
}

template <class V, std::size_t... I>
V make_view(std::string const& label, std::vector<std::int64_t> const& shape,
            std::index_sequence<I...>) {
  return V(label, static_cast<std::size_t>(shape[I])...);
}

}  // namespace detail

/// A Tensor holding a copy of \p v (shape = the view's extents, dtype from its value type).
template <class View>
Tensor to_tensor(View const& v) {
  using T = std::remove_const_t<typename View::value_type>;
  static_assert(detail::has_dtype<T>,
                "to_tensor: the View's value type must be a 32/64-bit float or signed integer");
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<T> values;
  values.reserve(v.size());
  detail::for_each_row_major(host, [&](T const& x) { values.push_back(x); });
  return Tensor::from(detail::view_shape(v), values);
}

/// Copies \p t into \p v, converting elements as Tensor::to_vector does. \p v must already have
/// the tensor's shape (ShapeError otherwise); \p what names the tensor in messages.
template <class View>
void copy_to_view(Tensor const& t, View const& v, std::string const& what = "tensor") {
  using T = typename View::non_const_value_type;
  static_assert(std::is_same<typename View::value_type, T>::value,
                "copy_to_view: the destination View must not be const");
  if (t.shape != detail::view_shape(v))
    throw ShapeError(detail::cat(what, " has shape ", detail::shape_text(t.shape),
                                 " but the View '", v.label(), "' has extents ",
                                 detail::shape_text(detail::view_shape(v))));
  std::vector<T> const values = detail::rethrow_with([&] { return t.to_vector<T>(); }, what, ": ");
  auto host = Kokkos::create_mirror_view(v);
  std::size_t i = 0;
  detail::for_each_row_major(host, [&](T& x) { x = values[i++]; });
  Kokkos::deep_copy(v, host);
}

/// A new View of type \p View (label \p label) holding a copy of \p t. The View's rank must be the
/// tensor's rank and any compile-time extents must match (ShapeError otherwise).
template <class View>
View to_view(Tensor const& t, std::string const& label) {
  constexpr std::size_t R = static_cast<std::size_t>(View::rank);
  constexpr std::size_t RD = static_cast<std::size_t>(View::rank_dynamic);
  if (t.shape.size() != R)
    throw ShapeError(detail::cat(label, " has shape ", detail::shape_text(t.shape), " (rank ",
                                 t.shape.size(), ") but the View type has rank ", R));
  detail::rethrow_with([&] { t.validate(); }, label, ": ");
  View v = detail::make_view<View>(label, t.shape, std::make_index_sequence<RD>{});
  copy_to_view(t, v, label);
  return v;
}

}  // namespace moe::io
