#pragma once
/// \file
/// A tensor as moe writes it to disk (host only; safetensors.hpp stores these in files): dtype,
/// row-major shape and little-endian bytes, with checked conversions to and from C++ types.

#include <moe/bf16.hpp>
#include <moe/detail/text.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe::io {

/// \brief Element types moe reads and writes. The names are safetensors' ("F32", ...): IEEE
/// float, double, bfloat16 and half, 32/64-bit signed integers.
enum class DType { F32, F64, I32, I64, BF16, F16 };

/// The safetensors name of \p d ("F32", "F64", "I32", "I64", "BF16", "F16").
inline char const* dtype_name(DType d) {
  static char const* const names[] = {"F32", "F64", "I32", "I64", "BF16", "F16"};
  return names[static_cast<int>(d)];
}

/// Bytes per element of \p d.
inline std::size_t dtype_size(DType d) {
  static constexpr std::size_t sizes[] = {4, 8, 4, 8, 2, 2};
  return sizes[static_cast<int>(d)];
}

/// Whether \p d holds floating values (F32, F64, BF16, F16).
inline bool is_floating(DType d) { return d != DType::I32 && d != DType::I64; }

/// Parses a safetensors dtype name; false when \p name is not one moe supports.
inline bool parse_dtype(std::string const& name, DType& out) {
  for (DType d : {DType::F32, DType::F64, DType::I32, DType::I64, DType::BF16, DType::F16}) {
    if (name != dtype_name(d)) continue;
    out = d;
    return true;
  }
  return false;
}

namespace detail {

using ::moe::detail::cat;

/// The DType that stores T as an int: 32/64-bit IEEE floats, moe::bf16 and 32/64-bit signed
/// integers (any spelling: int, long, long long, ...); -1 for other types.
template <class T>
constexpr int dtype_code() {
  constexpr bool ieee = std::is_floating_point<T>::value && std::numeric_limits<T>::is_iec559;
  constexpr bool sint = std::is_integral<T>::value && std::is_signed<T>::value;
  if (std::is_same<T, moe::bf16>::value) return static_cast<int>(DType::BF16);
  if (ieee && sizeof(T) == 4) return static_cast<int>(DType::F32);
  if (ieee && sizeof(T) == 8) return static_cast<int>(DType::F64);
  if (sint && sizeof(T) == 4) return static_cast<int>(DType::I32);
  if (sint && sizeof(T) == 8) return static_cast<int>(DType::I64);
  return -1;
}
template <class T>
inline constexpr bool has_dtype = dtype_code<T>() >= 0;
/// The DType that stores T (only where has_dtype<T>).
template <class T>
inline constexpr DType dtype_of = static_cast<DType>(dtype_code<T>());

/// The name of the integer type T in messages ("int32", "uint8", ...).
template <class T>
std::string type_label() {
  return cat(std::is_signed<T>::value ? "int" : "uint", 8 * sizeof(T));
}

inline bool host_is_little_endian() {
  std::uint16_t const one = 1;
  return *reinterpret_cast<unsigned char const*>(&one) == 1;
}

/// Reads a T stored little-endian at \p p.
template <class T>
T load_le(unsigned char const* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  auto* const b = reinterpret_cast<unsigned char*>(&v);
  if (!host_is_little_endian()) std::reverse(b, b + sizeof(T));
  return v;
}

/// Stores \p v little-endian at \p p.
template <class T>
void store_le(T v, unsigned char* p) {
  std::memcpy(p, &v, sizeof(T));
  if (!host_is_little_endian()) std::reverse(p, p + sizeof(T));
}

using moe::detail::shape_text;

/// f(), with an IoError it throws rethrown as an E whose message is \p context... then its own.
template <class E = IoError, class F, class... Context>
auto rethrow_with(F&& f, Context const&... context) -> decltype(f()) {
  try {
    return f();
  } catch (IoError const& e) {
    throw E(cat(context..., e.what()));
  }
}

/// Product of \p shape; throws IoError (prefixed by \p where) on a negative dimension or when the
/// product does not fit in int64. A zero dimension makes the product 0 whatever the others are.
inline std::int64_t checked_numel(std::vector<std::int64_t> const& shape,
                                  std::string const& where) {
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      throw IoError(cat(where, "shape ", shape_text(shape), " has a negative dimension ", shape[i],
                        " at axis ", i, "; dimensions must be >= 0"));
  }
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (n > std::numeric_limits<std::int64_t>::max() / d)
      throw IoError(
          cat(where, "shape ", shape_text(shape),
              " has more elements than fit in a 64-bit integer (shape product overflow)"));
    n *= d;
  }
  return n;
}

/// Whether the signed integer \p v is representable as the integer type T (min() is 0 if unsigned).
template <class T, class S>
bool int_fits(S v) {
  using L = std::numeric_limits<T>;
  return v < 0 ? static_cast<std::intmax_t>(v) >= static_cast<std::intmax_t>(L::min())
               : static_cast<std::uintmax_t>(v) <= static_cast<std::uintmax_t>(L::max());
}

/// The \p n elements of type S stored little-endian at \p src as T (S = uint16_t for BF16 and F16,
/// read exactly as floats). Integer -> integer conversions are range-checked.
template <class S, class T>
std::vector<T> convert_elements(unsigned char const* src, std::size_t n, DType d) {
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same<S, std::uint16_t>::value) {
      std::uint16_t const b = load_le<std::uint16_t>(src + 2 * i);
      out[i] = static_cast<T>(d == DType::BF16 ? moe::detail::bf16_to_float(b)
                                               : moe::detail::half_bits_to_float(b));
    } else if constexpr (std::is_floating_point<T>::value || std::is_same<T, moe::bf16>::value) {
      out[i] = static_cast<T>(load_le<S>(src + i * sizeof(S)));
    } else if constexpr (std::is_integral<S>::value) {
      S const v = load_le<S>(src + i * sizeof(S));
      if (!int_fits<T>(v))
        throw IoError(cat("element ", i, " of a ", dtype_name(d), " tensor is ", v,
                          ", which does not fit in ", type_label<T>()));
      out[i] = static_cast<T>(v);
    } else {
      (void)src, (void)d;  // float -> integer: rejected before the call, never implicit
    }
  }
  return out;
}

}  // namespace detail

/// \brief One named entry of a safetensors file. A scalar has shape {} (one element); a tensor
/// with a zero dimension has no bytes.
struct Tensor {
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;  ///< numel() * dtype_size(dtype), little-endian, row-major

  /// Number of elements (1 for a scalar). Throws IoError on a negative dimension or overflow.
  std::int64_t numel() const { return detail::checked_numel(shape, ""); }

  /// Throws IoError unless the shape is valid and bytes.size() == numel() * dtype_size(dtype).
  void validate() const {
    std::int64_t const n = numel();
    std::size_t const esz = dtype_size(dtype);
    if (static_cast<std::uint64_t>(n) > std::numeric_limits<std::uint64_t>::max() / esz ||
        static_cast<std::uint64_t>(n) * esz != bytes.size()) {
      throw IoError(detail::cat("a ", dtype_name(dtype), " tensor of shape ",
                                detail::shape_text(shape), " needs ", n, " * ", esz,
                                " bytes but holds ", bytes.size()));
    }
  }

  /// The elements, in row-major order, converted to T. Float <-> double and integer -> floating
  /// conversions are plain casts, BF16 and F16 are read exactly as floats, and T = moe::bf16
  /// rounds to nearest even; integer -> integer conversions are range-checked; a floating
  /// tensor is never converted to an integer type. Violations throw IoError.
  template <class T>
  std::vector<T> to_vector() const {
    static_assert(
        (std::is_arithmetic<T>::value && !std::is_same<T, bool>::value) ||
            std::is_same<T, moe::bf16>::value,
        "Tensor::to_vector<T>: T must be moe::bf16 or an arithmetic type other than bool");
    validate();
    std::size_t const n = static_cast<std::size_t>(numel());
    constexpr bool floating_t =
        std::is_floating_point<T>::value || std::is_same<T, moe::bf16>::value;
    if (!floating_t && is_floating(dtype))
      throw IoError(detail::cat("cannot convert a ", dtype_name(dtype), " tensor to ",
                                detail::type_label<T>(),
                                " (floating values are never converted to integers; read it as "
                                "float or double)"));
    unsigned char const* const src = bytes.data();
    if (dtype == DType::F32) return detail::convert_elements<float, T>(src, n, dtype);
    if (dtype == DType::F64) return detail::convert_elements<double, T>(src, n, dtype);
    if (dtype == DType::I32) return detail::convert_elements<std::int32_t, T>(src, n, dtype);
    if (dtype == DType::I64) return detail::convert_elements<std::int64_t, T>(src, n, dtype);
    return detail::convert_elements<std::uint16_t, T>(src, n, dtype);  // BF16, F16
  }

  /// This floating tensor with its elements in the floating type \p to (F32, F64, BF16, F16),
  /// each rounded to nearest even (e.g. a BF16 copy of float weights for inference); IoError for
  /// integer tensors or an integer \p to.
  Tensor as(DType to) const {
    if (!is_floating(dtype) || !is_floating(to))
      throw IoError(detail::cat("cannot convert a ", dtype_name(dtype), " tensor to ",
                                dtype_name(to),
                                ": only floating tensors convert between floating types"));
    if (to == dtype) return *this;
    if (to == DType::F64) return Tensor::from(shape, to_vector<double>());
    if (to == DType::F32) return Tensor::from(shape, to_vector<float>());
    if (to == DType::BF16) return Tensor::from(shape, to_vector<moe::bf16>());
    auto const v = to_vector<float>();  // F16, which has no C++ element type here
    Tensor t{to, shape, std::vector<unsigned char>(v.size() * 2)};
    for (std::size_t i = 0; i < v.size(); ++i)
      detail::store_le<std::uint16_t>(moe::detail::float_to_half_bits(v[i]),
                                      t.bytes.data() + 2 * i);
    return t;
  }

  /// A tensor of dtype dtype_of<T> (F32 for float, F64 for double, I32/I64 for 32/64-bit signed
  /// integers) holding \p values in row-major order. Throws IoError if the shape is invalid or
  /// does not hold values.size() elements.
  template <class T>
  static Tensor from(std::vector<std::int64_t> shape, std::vector<T> const& values) {
    static_assert(detail::has_dtype<T>,
                  "Tensor::from<T>: T must be a 32/64-bit float, moe::bf16 or a 32/64-bit signed "
                  "integer");
    Tensor t{detail::dtype_of<T>, std::move(shape), {}};
    std::int64_t const n = t.numel();
    if (static_cast<std::uint64_t>(n) != values.size())
      throw IoError(detail::cat("Tensor::from: shape ", detail::shape_text(t.shape), " holds ", n,
                                " elements but ", values.size(), " values were given"));
    t.bytes.resize(values.size() * sizeof(T));
    for (std::size_t i = 0; i < values.size(); ++i)  // a moe::bf16 is its 16 bits
      detail::store_le<T>(values[i], t.bytes.data() + i * sizeof(T));
    return t;
  }
};
}  // namespace moe::io
