#pragma once
/// \file
/// Reading and writing safetensors files: named, row-major, little-endian tensors behind a JSON
/// header. This is the on-disk format of the tools' cases, results, weights and checkpoints.
///
/// Layout of a file:
///
///     [8 bytes]  N, a little-endian uint64: the length of the header
///     [N bytes]  UTF-8 JSON object, padded with spaces:
///                {"__metadata__": {"key": "value", ...},            (optional, string -> string)
///                 "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
///     [rest]     the data buffer; offsets are relative to its first byte
///
/// Reading validates the whole header (and says which file, which tensor and which rule is broken)
/// before any tensor is used. Writing is deterministic (tensors in sorted name order, header padded
/// to a multiple of 8 bytes) and atomic (temporary file, fsync, rename, fsync of the directory).
///
/// The header is host-only and needs no Kokkos; moe/io/safetensors_view.hpp copies tensors to and
/// from Kokkos Views. The JSON header is parsed by moe's own small parser (moe/io/json.hpp, which
/// says why), so consumers need no JSON library. POSIX is required for the atomic write.

#include <moe/detail/text.hpp>
#include <moe/error.hpp>
#include <moe/io/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

namespace moe::io {

/// \brief Element types moe reads and writes. The names are safetensors' ("F32", ...).
enum class DType { F32, F64, I32, I64 };

/// The safetensors name of \p d ("F32", "F64", "I32", "I64").
inline char const* dtype_name(DType d) {
  switch (d) {
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  return "?";
}

/// Bytes per element of \p d.
inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F64:
    case DType::I64:
      return 8;
  }
  return 0;
}

/// Parses a safetensors dtype name; false when \p name is not one moe supports.
inline bool parse_dtype(std::string const& name, DType& out) {
  static constexpr DType all[] = {DType::F32, DType::F64, DType::I32, DType::I64};
  for (DType d : all) {
    if (name == dtype_name(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

/// Largest header moe accepts (the reference implementation uses the same limit).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

namespace detail {

using ::moe::detail::cat;

// ---- element types ---------------------------------------------------------------------------

/// dtype_of<T>::value is the DType that stores T: 32/64-bit IEEE floats and 32/64-bit signed
/// integers (any spelling: int, long, long long, ...). Other types have no `value`.
template <class T, class = void>
struct dtype_of {};
template <class T>
struct dtype_of<T, std::enable_if_t<std::is_floating_point<T>::value &&
                                    std::numeric_limits<T>::is_iec559 && sizeof(T) == 4>> {
  static constexpr DType value = DType::F32;
};
template <class T>
struct dtype_of<T, std::enable_if_t<std::is_floating_point<T>::value &&
                                    std::numeric_limits<T>::is_iec559 && sizeof(T) == 8>> {
  static constexpr DType value = DType::F64;
};
template <class T>
struct dtype_of<
    T, std::enable_if_t<std::is_integral<T>::value && std::is_signed<T>::value && sizeof(T) == 4>> {
  static constexpr DType value = DType::I32;
};
template <class T>
struct dtype_of<
    T, std::enable_if_t<std::is_integral<T>::value && std::is_signed<T>::value && sizeof(T) == 8>> {
  static constexpr DType value = DType::I64;
};

template <class T, class = void>
struct has_dtype : std::false_type {};
template <class T>
struct has_dtype<T, std::void_t<decltype(dtype_of<T>::value)>> : std::true_type {};

/// A readable name of T for messages.
template <class T>
std::string type_label() {
  if (std::is_same<T, float>::value) return "float";
  if (std::is_same<T, double>::value) return "double";
  return cat(std::is_floating_point<T>::value ? "float"
             : std::is_signed<T>::value       ? "int"
                                              : "uint",
             8 * sizeof(T));
}

inline bool host_is_little_endian() {
  std::uint16_t const one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

/// Reads a T stored little-endian at \p p.
template <class T>
T load_le(unsigned char const* p) {
  unsigned char buf[sizeof(T)];
  if (host_is_little_endian()) {
    std::memcpy(buf, p, sizeof(T));
  } else {
    for (std::size_t i = 0; i < sizeof(T); ++i) buf[i] = p[sizeof(T) - 1 - i];
  }
  T v;
  std::memcpy(&v, buf, sizeof(T));
  return v;
}

/// Stores \p v little-endian at \p p.
template <class T>
void store_le(T v, unsigned char* p) {
  unsigned char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  if (host_is_little_endian()) {
    std::memcpy(p, buf, sizeof(T));
  } else {
    for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = buf[sizeof(T) - 1 - i];
  }
}

/// "[2, 3]"
using moe::detail::shape_text;

/// Product of \p shape; throws IoError (prefixed by \p where) on a negative dimension or when the
/// product does not fit in int64. A zero dimension makes the product 0 whatever the others are.
inline std::int64_t checked_numel(std::vector<std::int64_t> const& shape,
                                  std::string const& where) {
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      throw IoError(cat(where, "shape ", shape_text(shape), " has a negative dimension ", shape[i],
                        " at axis ", i, "; dimensions must be >= 0"));
    }
  }
  for (std::int64_t d : shape) {
    if (d == 0) return 0;
  }
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (n > std::numeric_limits<std::int64_t>::max() / d) {
      throw IoError(
          cat(where, "shape ", shape_text(shape),
              " has more elements than fit in a 64-bit integer (shape product overflow)"));
    }
    n *= d;
  }
  return n;
}

/// Whether the integer \p v is representable as the integer type T.
template <class T, class S>
bool int_fits(S v) {
  static_assert(std::is_integral<S>::value && std::is_signed<S>::value, "source is signed");
  if (v < 0) {
    if constexpr (!std::is_signed<T>::value) {
      return false;
    } else {
      return static_cast<std::intmax_t>(v) >=
             static_cast<std::intmax_t>(std::numeric_limits<T>::min());
    }
  }
  return static_cast<std::uintmax_t>(v) <=
         static_cast<std::uintmax_t>(std::numeric_limits<T>::max());
}

/// Converts \p n elements of type S stored little-endian at \p src into \p out.
template <class S, class T>
void convert_elements(unsigned char const* src, std::size_t n, DType d, std::vector<T>& out) {
  out.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    S const v = load_le<S>(src + i * sizeof(S));
    if constexpr (std::is_floating_point<T>::value) {
      out[i] = static_cast<T>(v);
    } else if constexpr (std::is_floating_point<S>::value) {
      // Rejected before the loop (float -> integer is never implicit).
      (void)d;
      out[i] = T{};
    } else {
      if (!int_fits<T>(v)) {
        throw IoError(cat("element ", i, " of a ", dtype_name(d), " tensor is ", v,
                          ", which does not fit in ", type_label<T>()));
      }
      out[i] = static_cast<T>(v);
    }
  }
}

inline std::string errno_text(int e) { return std::strerror(e); }

}  // namespace detail

// ---- Tensor ----------------------------------------------------------------------------------

/// \brief One named entry of a safetensors file: dtype, row-major shape and little-endian bytes.
///
/// A scalar has shape {} (one element); a tensor with a zero dimension has no bytes.
struct Tensor {
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char>
      bytes;  ///< numel() * dtype_size(dtype) bytes, little-endian, row-major

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
  /// conversions are plain casts; integer -> integer conversions are range-checked; a floating
  /// tensor is never converted to an integer type. Violations throw IoError.
  template <class T>
  std::vector<T> to_vector() const {
    static_assert(std::is_arithmetic<T>::value && !std::is_same<T, bool>::value,
                  "Tensor::to_vector<T>: T must be an arithmetic type other than bool");
    validate();
    std::size_t const n = static_cast<std::size_t>(numel());
    if (!std::is_floating_point<T>::value && (dtype == DType::F32 || dtype == DType::F64)) {
      throw IoError(detail::cat("cannot convert a ", dtype_name(dtype), " tensor to ",
                                detail::type_label<T>(),
                                " (floating values are never converted to integers; read it as "
                                "float or double)"));
    }
    std::vector<T> out;
    switch (dtype) {
      case DType::F32:
        detail::convert_elements<float>(bytes.data(), n, dtype, out);
        break;
      case DType::F64:
        detail::convert_elements<double>(bytes.data(), n, dtype, out);
        break;
      case DType::I32:
        detail::convert_elements<std::int32_t>(bytes.data(), n, dtype, out);
        break;
      case DType::I64:
        detail::convert_elements<std::int64_t>(bytes.data(), n, dtype, out);
        break;
    }
    return out;
  }

  /// A tensor of dtype dtype_of<T> (F32 for float, F64 for double, I32/I64 for 32/64-bit signed
  /// integers) holding \p values in row-major order. Throws IoError if the shape is invalid or
  /// does not hold values.size() elements.
  template <class T>
  static Tensor from(std::vector<std::int64_t> shape, std::vector<T> const& values) {
    static_assert(detail::has_dtype<T>::value,
                  "Tensor::from<T>: T must be a 32/64-bit float or a 32/64-bit signed integer");
    Tensor t;
    t.dtype = detail::dtype_of<T>::value;
    t.shape = std::move(shape);
    std::int64_t const n = t.numel();
    if (static_cast<std::uint64_t>(n) != values.size()) {
      throw IoError(detail::cat("Tensor::from: shape ", detail::shape_text(t.shape), " holds ", n,
                                " elements but ", values.size(), " values were given"));
    }
    t.bytes.resize(values.size() * sizeof(T));
    for (std::size_t i = 0; i < values.size(); ++i)
      detail::store_le<T>(values[i], t.bytes.data() + i * sizeof(T));
    return t;
  }
};

// ---- atomic write ----------------------------------------------------------------------------

/// \brief A borrowed run of bytes, one piece of a file written by write_atomic.
struct ByteSpan {
  void const* data = nullptr;
  std::size_t size = 0;
};

/// Writes the concatenation of \p pieces to \p path atomically: the bytes go to
/// "<path>.tmp.<pid>", which is fsync'ed and renamed over \p path, then the directory is fsync'ed.
/// Readers see the old file or the new one, never a mix; on failure the temporary file is removed,
/// an existing \p path is left untouched, and IoError says which step failed and why.
inline void write_atomic(std::string const& path, std::vector<ByteSpan> const& pieces) {
  using detail::cat;
  using detail::errno_text;
  if (path.empty()) throw IoError("write_atomic: the output path is empty");
  std::string const tmp = cat(path, ".tmp.", static_cast<long>(::getpid()));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) {
    int const e = errno;
    throw IoError(cat("cannot write '", path, "': cannot create the temporary file '", tmp,
                      "': ", errno_text(e)));
  }
  auto fail = [&](std::string const& step, int e) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw IoError(cat("cannot write '", path, "': ", step, " failed: ", errno_text(e)));
  };
  for (ByteSpan const& piece : pieces) {
    auto const* p = static_cast<unsigned char const*>(piece.data);
    std::size_t left = piece.size;
    while (left > 0) {
      std::size_t const chunk = std::min<std::size_t>(left, std::size_t{1} << 30);
      ssize_t const w = ::write(fd, p, chunk);
      if (w < 0) {
        int const e = errno;
        if (e == EINTR) continue;
        fail(cat("writing '", tmp, "'"), e);
      }
      p += w;
      left -= static_cast<std::size_t>(w);
    }
  }
  if (::fsync(fd) != 0) {
    int const e = errno;
    fail(cat("fsync of '", tmp, "'"), e);
  }
  int const closed = ::close(fd);
  int const close_errno = errno;
  fd = -1;
  if (closed != 0) fail(cat("closing '", tmp, "'"), close_errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int const e = errno;
    fail(cat("renaming '", tmp, "' to '", path, "'"), e);
  }
  // Make the rename durable. A directory that cannot be opened for reading (no read permission)
  // or a file system that cannot sync directories (EINVAL) is not an error: the file is in place.
  std::size_t const slash = path.find_last_of('/');
  std::string const dir =
      slash == std::string::npos ? std::string(".") : (slash == 0 ? "/" : path.substr(0, slash));
  int const dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    int const synced = ::fsync(dfd);
    int const e = errno;
    ::close(dfd);
    if (synced != 0 && e != EINVAL && e != ENOTSUP) {
      throw IoError(cat("wrote '", path, "' but the fsync of its directory '", dir,
                        "' failed: ", errno_text(e)));
    }
  }
}

/// write_atomic of one string of bytes.
inline void write_atomic(std::string const& path, std::string const& bytes) {
  write_atomic(path, std::vector<ByteSpan>{{bytes.data(), bytes.size()}});
}

// ---- File ------------------------------------------------------------------------------------

/// \brief The tensors of a safetensors file by name (kept sorted), plus its string metadata.
class File {
 public:
  /// String metadata ("__metadata__" in the header).
  std::map<std::string, std::string> metadata;

  /// Reads and validates \p path. Throws IoError naming the file, the tensor and the broken rule
  /// for: a file shorter than 8 bytes, a header length beyond the file or above kMaxHeaderBytes,
  /// a header that is not a JSON object, an entry without dtype/shape/data_offsets or with an
  /// unknown key, an unsupported dtype, negative or non-integer dimensions, a shape whose product
  /// overflows, data_offsets that are not [begin, end] with begin <= end, a byte range beyond the
  /// data buffer (truncated file), a byte range whose size is not numel * dtype size, overlapping
  /// tensors, non-string metadata values.
  static File read(std::string const& path);

  /// Writes the file atomically (see write_atomic). Deterministic: tensors in sorted name order,
  /// data in that order with no gaps, "__metadata__" first and only when non-empty, header padded
  /// with spaces to a multiple of 8 bytes.
  void write(std::string const& path) const;

  bool has(std::string const& name) const { return tensors_.count(name) != 0; }

  /// The tensor \p name; throws IoError naming the file and the tensor when there is none.
  Tensor const& at(std::string const& name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      std::string have;
      std::size_t shown = 0;
      for (auto const& kv : tensors_) {
        if (shown == 16) {
          have += ", ...";
          break;
        }
        have += (shown++ ? ", " : "") + kv.first;
      }
      throw IoError(detail::cat(
          where(), " has no tensor '", name, "'",
          tensors_.empty() ? " (it has no tensors)" : detail::cat(" (it has: ", have, ")")));
    }
    return it->second;
  }

  /// at(name).to_vector<T>(), with the file and the tensor named in any error.
  template <class T>
  std::vector<T> get(std::string const& name) const {
    Tensor const& t = at(name);
    try {
      return t.to_vector<T>();
    } catch (IoError const& e) {
      throw IoError(detail::cat(where(), ": tensor '", name, "': ", e.what()));
    }
  }

  /// Adds or replaces \p name. Throws IoError if the tensor is inconsistent (see
  /// Tensor::validate) or the name is "__metadata__".
  void set(std::string const& name, Tensor t) {
    if (name == "__metadata__") {
      throw IoError(
          "a tensor cannot be named \"__metadata__\" (the name is reserved for metadata)");
    }
    try {
      t.validate();
    } catch (IoError const& e) {
      throw IoError(detail::cat("cannot set tensor '", name, "': ", e.what()));
    }
    tensors_[name] = std::move(t);
  }

  /// Removes \p name; false if there was no such tensor.
  bool erase(std::string const& name) { return tensors_.erase(name) != 0; }

  /// Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (auto const& kv : tensors_) out.push_back(kv.first);
    return out;
  }

  std::size_t size() const { return tensors_.size(); }
  std::map<std::string, Tensor> const& tensors() const { return tensors_; }

  /// The path this File was read from; empty for a File built in memory.
  std::string const& source() const { return source_; }

 private:
  std::string where() const {
    return source_.empty() ? std::string("in-memory safetensors file")
                           : detail::cat("safetensors file '", source_, "'");
  }

  std::map<std::string, Tensor> tensors_;
  std::string source_;
};

inline File File::read(std::string const& path) {
  using detail::cat;
  using detail::JsonValue;
  std::string const file = cat("safetensors file '", path, "'");

  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    int const e = errno;
    throw IoError(cat("cannot read ", file, ": ", detail::errno_text(e)));
  }
  if (!S_ISREG(st.st_mode)) throw IoError(cat("cannot read ", file, ": not a regular file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int const e = errno;
    throw IoError(cat("cannot read ", file, ": ", detail::errno_text(e)));
  }
  std::uint64_t const file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8) {
    throw IoError(cat(file, " is ", file_size,
                      " bytes long; a safetensors file starts with an 8-byte header length"));
  }
  unsigned char len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    throw IoError(cat("cannot read the header length of ", file));
  }
  std::uint64_t const header_len = detail::load_le<std::uint64_t>(len_bytes);
  if (header_len > kMaxHeaderBytes) {
    throw IoError(cat(file, " declares a header of ", header_len, " bytes, more than the limit of ",
                      kMaxHeaderBytes, " (not a safetensors file?)"));
  }
  if (header_len > file_size - 8) {
    throw IoError(cat(file, " declares a header of ", header_len, " bytes but only ", file_size - 8,
                      " bytes follow the length field (truncated file?)"));
  }
  std::string header(static_cast<std::size_t>(header_len), '\0');
  if (header_len > 0 && !in.read(&header[0], static_cast<std::streamsize>(header_len))) {
    throw IoError(cat("cannot read the header of ", file));
  }
  std::uint64_t const buffer_size = file_size - 8 - header_len;

  JsonValue const root = detail::JsonParser(header, file + ": ").parse_document();
  if (root.kind != JsonValue::Kind::Object) {
    throw IoError(
        cat(file, ": the header is ", detail::json_kind_name(root.kind), ", not a JSON object"));
  }

  struct Entry {
    std::string name;
    Tensor tensor;
    std::uint64_t begin = 0, end = 0;
  };
  std::vector<Entry> entries;
  File out;
  out.source_ = path;

  for (std::size_t k = 0; k < root.keys.size(); ++k) {
    std::string const& name = root.keys[k];
    JsonValue const& info = root.items[k];
    if (name == "__metadata__") {
      if (info.kind == JsonValue::Kind::Null) continue;
      if (info.kind != JsonValue::Kind::Object) {
        throw IoError(cat(file, ": \"__metadata__\" is ", detail::json_kind_name(info.kind),
                          "; it must be an object of string values"));
      }
      for (std::size_t m = 0; m < info.keys.size(); ++m) {
        if (info.items[m].kind != JsonValue::Kind::String) {
          throw IoError(cat(file, ": metadata value of key '", info.keys[m], "' is ",
                            detail::json_kind_name(info.items[m].kind), "; it must be a string"));
        }
        out.metadata[info.keys[m]] = info.items[m].text;
      }
      continue;
    }
    std::string const ctx = cat(file, ": tensor '", name, "': ");
    if (info.kind != JsonValue::Kind::Object) {
      throw IoError(cat(ctx, "entry is ", detail::json_kind_name(info.kind),
                        "; it must be an object with dtype, shape and data_offsets"));
    }
    JsonValue const* dtype = nullptr;
    JsonValue const* shape = nullptr;
    JsonValue const* offsets = nullptr;
    for (std::size_t f = 0; f < info.keys.size(); ++f) {
      std::string const& key = info.keys[f];
      if (key == "dtype") {
        dtype = &info.items[f];
      } else if (key == "shape") {
        shape = &info.items[f];
      } else if (key == "data_offsets") {
        offsets = &info.items[f];
      } else {
        throw IoError(cat(ctx, "unknown key \"", key,
                          "\" (an entry has exactly dtype, shape and data_offsets)"));
      }
    }
    if (!dtype) throw IoError(cat(ctx, "entry has no \"dtype\""));
    if (!shape) throw IoError(cat(ctx, "entry has no \"shape\""));
    if (!offsets) throw IoError(cat(ctx, "entry has no \"data_offsets\""));

    Entry e;
    e.name = name;
    if (dtype->kind != JsonValue::Kind::String) {
      throw IoError(
          cat(ctx, "dtype is ", detail::json_kind_name(dtype->kind), "; it must be a string"));
    }
    if (!parse_dtype(dtype->text, e.tensor.dtype)) {
      static char const* const known[] = {"BOOL", "U8",  "I8",   "F8_E5M2", "F8_E4M3", "I16",
                                          "U16",  "F16", "BF16", "U32",     "U64"};
      bool const is_known =
          std::find_if(std::begin(known), std::end(known),
                       [&](char const* other) { return dtype->text == other; }) != std::end(known);
      throw IoError(cat(ctx, is_known ? "unsupported dtype '" : "unknown dtype '", dtype->text,
                        "' (moe reads F32, F64, I32 and I64)"));
    }
    if (shape->kind != JsonValue::Kind::Array) {
      throw IoError(cat(ctx, "shape is ", detail::json_kind_name(shape->kind),
                        "; it must be an array of integers"));
    }
    for (std::size_t a = 0; a < shape->items.size(); ++a) {
      std::int64_t d = 0;
      if (!detail::json_to_int64(shape->items[a], d)) {
        throw IoError(cat(ctx, "dimension ", a, " of the shape (",
                          shape->items[a].kind == JsonValue::Kind::Number
                              ? shape->items[a].text
                              : std::string(detail::json_kind_name(shape->items[a].kind)),
                          ") is not an integer that fits in 64 bits"));
      }
      e.tensor.shape.push_back(d);
    }
    std::int64_t const numel = detail::checked_numel(e.tensor.shape, ctx);
    std::uint64_t const esz = dtype_size(e.tensor.dtype);
    if (static_cast<std::uint64_t>(numel) > std::numeric_limits<std::uint64_t>::max() / esz) {
      throw IoError(cat(ctx, "shape ", detail::shape_text(e.tensor.shape), " of ",
                        dtype_name(e.tensor.dtype), " needs more bytes than fit in 64 bits"));
    }
    std::uint64_t const nbytes = static_cast<std::uint64_t>(numel) * esz;

    std::int64_t range[2] = {0, 0};
    bool ok = offsets->kind == JsonValue::Kind::Array && offsets->items.size() == 2;
    for (std::size_t i = 0; ok && i < 2; ++i)
      ok = detail::json_to_int64(offsets->items[i], range[i]) && range[i] >= 0;
    if (!ok) {
      throw IoError(cat(ctx, "data_offsets must be [begin, end], two non-negative integers"));
    }
    if (range[0] > range[1]) {
      throw IoError(cat(ctx, "data_offsets [", range[0], ", ", range[1],
                        "] has begin > end; it must be [begin, end] with begin <= end"));
    }
    e.begin = static_cast<std::uint64_t>(range[0]);
    e.end = static_cast<std::uint64_t>(range[1]);
    if (e.end - e.begin != nbytes) {
      throw IoError(cat(ctx, "header lies about sizes: shape ", detail::shape_text(e.tensor.shape),
                        " of ", dtype_name(e.tensor.dtype), " needs ", nbytes,
                        " bytes but data_offsets [", e.begin, ", ", e.end, "] span ",
                        e.end - e.begin));
    }
    if (e.end > buffer_size) {
      throw IoError(cat(ctx, "data_offsets [", e.begin, ", ", e.end,
                        "] reach beyond the data buffer, which holds ", buffer_size,
                        " bytes (truncated file?)"));
    }
    entries.push_back(std::move(e));
  }

  // Overlap check on the non-empty ranges, in buffer order (which is also the order to read in).
  std::sort(entries.begin(), entries.end(), [](Entry const& a, Entry const& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  Entry const* prev = nullptr;
  for (Entry const& e : entries) {
    if (e.begin == e.end) continue;
    if (prev && e.begin < prev->end) {
      throw IoError(cat(file, ": tensors '", prev->name, "' (bytes [", prev->begin, ", ", prev->end,
                        ")) and '", e.name, "' (bytes [", e.begin, ", ", e.end,
                        ")) overlap; every tensor needs its own bytes"));
    }
    prev = &e;
  }

  for (Entry& e : entries) {
    std::uint64_t const n = e.end - e.begin;
    e.tensor.bytes.resize(static_cast<std::size_t>(n));
    if (n > 0) {
      in.seekg(static_cast<std::streamoff>(8 + header_len + e.begin));
      if (!in.read(reinterpret_cast<char*>(e.tensor.bytes.data()),
                   static_cast<std::streamsize>(n))) {
        throw IoError(cat(file, ": tensor '", e.name, "': could not read its ", n,
                          " bytes (file changed while reading?)"));
      }
    }
    out.tensors_.emplace(std::move(e.name), std::move(e.tensor));
  }
  return out;
}

inline void File::write(std::string const& path) const {
  using detail::cat;
  std::string const file = cat("safetensors file '", path, "'");
  for (auto const& kv : metadata) {
    if (!detail::valid_utf8(kv.first) || !detail::valid_utf8(kv.second)) {
      throw IoError(cat("cannot write ", file, ": metadata key '", kv.first,
                        "' or its value is not valid UTF-8"));
    }
  }
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (auto const& kv : metadata) {
      if (!first) header += ',';
      first = false;
      detail::append_json_string(header, kv.first);
      header += ':';
      detail::append_json_string(header, kv.second);
    }
    header += '}';
  }
  std::uint64_t offset = 0;
  bool first = metadata.empty();
  for (auto const& kv : tensors_) {
    std::string const& name = kv.first;
    Tensor const& t = kv.second;
    if (!detail::valid_utf8(name)) {
      throw IoError(cat("cannot write ", file, ": tensor name '", name, "' is not valid UTF-8"));
    }
    try {
      t.validate();
    } catch (IoError const& e) {
      throw IoError(cat("cannot write ", file, ": tensor '", name, "': ", e.what()));
    }
    if (!first) header += ',';
    first = false;
    detail::append_json_string(header, name);
    header += cat(":{\"dtype\":\"", dtype_name(t.dtype), "\",\"shape\":[");
    for (std::size_t a = 0; a < t.shape.size(); ++a) header += cat(a ? "," : "", t.shape[a]);
    header += cat("],\"data_offsets\":[", offset, ",", offset + t.bytes.size(), "]}");
    offset += t.bytes.size();
  }
  header += '}';
  while (header.size() % 8 != 0) header += ' ';
  if (header.size() > kMaxHeaderBytes) {
    throw IoError(cat("cannot write ", file, ": the header would be ", header.size(),
                      " bytes, more than the limit of ", kMaxHeaderBytes));
  }

  std::string prefix(8, '\0');
  detail::store_le<std::uint64_t>(header.size(), reinterpret_cast<unsigned char*>(&prefix[0]));
  std::vector<ByteSpan> pieces;
  pieces.reserve(tensors_.size() + 2);
  pieces.push_back({prefix.data(), prefix.size()});
  pieces.push_back({header.data(), header.size()});
  for (auto const& kv : tensors_)
    pieces.push_back({kv.second.bytes.data(), kv.second.bytes.size()});
  write_atomic(path, pieces);
}

}  // namespace moe::io
