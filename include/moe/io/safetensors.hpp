#pragma once
/// \file
/// Reading and writing safetensors files (host-only; safetensors_view.hpp copies to and from
/// Views): an 8-byte little-endian header length N, then N bytes of JSON padded with spaces,
///     {"__metadata__": {"key": "value", ...},   (optional)
///      "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
/// then the data buffer the offsets count from. Reading validates the whole header first
/// (json.hpp's strict parser); writing is deterministic and atomic (atomic_write.hpp).

#include <moe/detail/text.hpp>
#include <moe/error.hpp>
#include <moe/io/atomic_write.hpp>
#include <moe/io/json.hpp>
#include <moe/io/tensor.hpp>

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
#include <utility>
#include <vector>

#include <sys/stat.h>

namespace moe::io {

/// Largest header moe accepts (the reference implementation uses the same limit).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// \brief The tensors of a safetensors file by name (kept sorted), plus its string metadata.
class File {
 public:
  /// String metadata ("__metadata__" in the header).
  std::map<std::string, std::string> metadata;

  /// Reads and validates \p path: any broken rule of the format (a truncated file, a bad entry,
  /// sizes that disagree, overlapping tensors, ...) throws IoError naming the file and the tensor.
  static File read(std::string const& path);

  /// Writes the file atomically (see write_atomic). Deterministic: tensors in sorted name order,
  /// data in that order with no gaps, "__metadata__" first and only when non-empty, header padded
  /// with spaces to a multiple of 8 bytes.
  void write(std::string const& path) const;

  bool has(std::string const& name) const { return tensors_.count(name) != 0; }

  /// The tensor \p name; throws IoError naming the file and the tensor when there is none.
  Tensor const& at(std::string const& name) const {
    auto it = tensors_.find(name);
    if (it != tensors_.end()) return it->second;
    std::string have;
    it = tensors_.begin();
    for (int i = 0; i < 16 && it != tensors_.end(); ++i, ++it) have += (i ? ", " : "") + it->first;
    if (it != tensors_.end()) have += ", ...";
    throw IoError(detail::cat(
        where(), " has no tensor '", name, "'",
        tensors_.empty() ? " (it has no tensors)" : detail::cat(" (it has: ", have, ")")));
  }

  /// at(name).to_vector<T>(), with the file and the tensor named in any error.
  template <class T>
  std::vector<T> get(std::string const& name) const {
    Tensor const& t = at(name);
    return detail::rethrow_with([&] { return t.to_vector<T>(); }, where(), ": tensor '", name,
                                "': ");
  }

  /// Adds or replaces \p name. Throws IoError if the tensor is inconsistent (see
  /// Tensor::validate) or the name is "__metadata__".
  void set(std::string const& name, Tensor t) {
    if (name == "__metadata__")
      throw IoError(
          "a tensor cannot be named \"__metadata__\" (the name is reserved for metadata)");
    detail::rethrow_with([&] { t.validate(); }, "cannot set tensor '", name, "': ");
    tensors_[name] = std::move(t);
  }

  /// Removes \p name; false if there was no such tensor.
  bool erase(std::string const& name) { return tensors_.erase(name) != 0; }

  /// Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
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
  using K = JsonValue::Kind;
  std::string const file = cat("safetensors file '", path, "'");

  auto cannot_read = [&](std::string const& why) {
    return IoError(cat("cannot read ", file, ": ", why));
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw cannot_read(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw cannot_read("not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw cannot_read(std::strerror(errno));
  std::uint64_t const file_size = static_cast<std::uint64_t>(st.st_size);
  if (file_size < 8)
    throw IoError(cat(file, " is ", file_size,
                      " bytes long; a safetensors file starts with an 8-byte header length"));
  unsigned char len_bytes[8];
  if (!in.read(reinterpret_cast<char*>(len_bytes), 8))
    throw IoError(cat("cannot read the header length of ", file));
  std::uint64_t const header_len = detail::load_le<std::uint64_t>(len_bytes);
  if (header_len > kMaxHeaderBytes)
    throw IoError(cat(file, " declares a header of ", header_len, " bytes, more than the limit of ",
                      kMaxHeaderBytes, " (not a safetensors file?)"));
  if (header_len > file_size - 8)
    throw IoError(cat(file, " declares a header of ", header_len, " bytes but only ", file_size - 8,
                      " bytes follow the length field (truncated file?)"));
  std::string header(static_cast<std::size_t>(header_len), '\0');
  if (header_len > 0 && !in.read(&header[0], static_cast<std::streamsize>(header_len)))
    throw IoError(cat("cannot read the header of ", file));
  std::uint64_t const buffer_size = file_size - 8 - header_len;

  JsonValue const root = detail::parse_json(header, file + ": ");
  // Throws "<what> is <kind of v><rule>" unless v is of \p kind.
  auto expect = [](JsonValue const& v, K kind, std::string const& what, char const* rule) {
    if (v.kind != kind) throw IoError(cat(what, " is ", detail::json_kind_name(v.kind), rule));
  };
  expect(root, K::Object, file + ": the header", ", not a JSON object");

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
      if (info.kind == K::Null) continue;
      expect(info, K::Object, file + ": \"__metadata__\"",
             "; it must be an object of string values");
      for (std::size_t m = 0; m < info.keys.size(); ++m) {
        expect(info.items[m], K::String, cat(file, ": metadata value of key '", info.keys[m], "'"),
               "; it must be a string");
        out.metadata[info.keys[m]] = info.items[m].text;
      }
      continue;
    }
    std::string const ctx = cat(file, ": tensor '", name, "': ");
    expect(info, K::Object, ctx + "entry",
           "; it must be an object with dtype, shape and data_offsets");
    static char const* const kFields[] = {"dtype", "shape", "data_offsets"};
    JsonValue const* fields[3] = {};
    for (std::size_t f = 0; f < info.keys.size(); ++f) {
      auto const k = std::find(std::begin(kFields), std::end(kFields), info.keys[f]);
      if (k == std::end(kFields))
        throw IoError(cat(ctx, "unknown key \"", info.keys[f],
                          "\" (an entry has exactly dtype, shape and data_offsets)"));
      fields[k - std::begin(kFields)] = &info.items[f];
    }
    for (std::size_t f = 0; f < 3; ++f)
      if (!fields[f]) throw IoError(cat(ctx, "entry has no \"", kFields[f], "\""));
    JsonValue const &dtype = *fields[0], &shape = *fields[1], &offsets = *fields[2];

    Entry e;
    e.name = name;
    expect(dtype, K::String, ctx + "dtype", "; it must be a string");
    if (!parse_dtype(dtype.text, e.tensor.dtype)) {
      static char const* const known[] = {"BOOL", "U8",  "I8",  "F8_E5M2", "F8_E4M3",
                                          "I16",  "U16", "U32", "U64"};
      bool const is_known =
          std::find(std::begin(known), std::end(known), dtype.text) != std::end(known);
      throw IoError(cat(ctx, is_known ? "unsupported dtype '" : "unknown dtype '", dtype.text,
                        "' (moe reads F32, F64, BF16, F16, I32 and I64)"));
    }
    expect(shape, K::Array, ctx + "shape", "; it must be an array of integers");
    for (std::size_t a = 0; a < shape.items.size(); ++a) {
      std::int64_t d = 0;
      if (!detail::json_to_int64(shape.items[a], d))
        throw IoError(cat(ctx, "dimension ", a, " of the shape (",
                          shape.items[a].kind == K::Number
                              ? shape.items[a].text
                              : std::string(detail::json_kind_name(shape.items[a].kind)),
                          ") is not an integer that fits in 64 bits"));
      e.tensor.shape.push_back(d);
    }
    std::int64_t const numel = detail::checked_numel(e.tensor.shape, ctx);
    std::uint64_t const esz = dtype_size(e.tensor.dtype);
    if (static_cast<std::uint64_t>(numel) > std::numeric_limits<std::uint64_t>::max() / esz)
      throw IoError(cat(ctx, "shape ", detail::shape_text(e.tensor.shape), " of ",
                        dtype_name(e.tensor.dtype), " needs more bytes than fit in 64 bits"));
    std::uint64_t const nbytes = static_cast<std::uint64_t>(numel) * esz;

    std::int64_t range[2] = {0, 0};
    bool ok = offsets.kind == K::Array && offsets.items.size() == 2;
    for (std::size_t i = 0; ok && i < 2; ++i)
      ok = detail::json_to_int64(offsets.items[i], range[i]) && range[i] >= 0;
    if (!ok)
      throw IoError(cat(ctx, "data_offsets must be [begin, end], two non-negative integers"));
    if (range[0] > range[1])
      throw IoError(cat(ctx, "data_offsets [", range[0], ", ", range[1],
                        "] has begin > end; it must be [begin, end] with begin <= end"));
    e.begin = static_cast<std::uint64_t>(range[0]);
    e.end = static_cast<std::uint64_t>(range[1]);
    if (e.end - e.begin != nbytes)
      throw IoError(cat(ctx, "header lies about sizes: shape ", detail::shape_text(e.tensor.shape),
                        " of ", dtype_name(e.tensor.dtype), " needs ", nbytes,
                        " bytes but data_offsets [", e.begin, ", ", e.end, "] span ",
                        e.end - e.begin));
    if (e.end > buffer_size)
      throw IoError(cat(ctx, "data_offsets [", e.begin, ", ", e.end,
                        "] reach beyond the data buffer, which holds ", buffer_size,
                        " bytes (truncated file?)"));
    entries.push_back(std::move(e));
  }

  // In buffer order: the non-empty ranges must not overlap.
  std::sort(entries.begin(), entries.end(), [](Entry const& a, Entry const& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  Entry const* prev = nullptr;
  for (Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (prev && e.begin < prev->end)
      throw IoError(cat(file, ": tensors '", prev->name, "' (bytes [", prev->begin, ", ", prev->end,
                        ")) and '", e.name, "' (bytes [", e.begin, ", ", e.end,
                        ")) overlap; every tensor needs its own bytes"));
    prev = &e;
  }
  for (Entry& e : entries) {
    std::uint64_t const n = e.end - e.begin;
    e.tensor.bytes.resize(static_cast<std::size_t>(n));
    in.seekg(static_cast<std::streamoff>(8 + header_len + e.begin));
    if (n > 0 &&
        !in.read(reinterpret_cast<char*>(e.tensor.bytes.data()), static_cast<std::streamsize>(n)))
      throw IoError(cat(file, ": tensor '", e.name, "': could not read its ", n,
                        " bytes (file changed while reading?)"));
    out.tensors_.emplace(std::move(e.name), std::move(e.tensor));
  }
  return out;
}

inline void File::write(std::string const& path) const {
  using detail::cat;
  std::string const file = cat("safetensors file '", path, "'");
  for (auto const& kv : metadata) {
    if (!detail::valid_utf8(kv.first) || !detail::valid_utf8(kv.second))
      throw IoError(cat("cannot write ", file, ": metadata key '", kv.first,
                        "' or its value is not valid UTF-8"));
  }
  // The metadata (sorted by key, valid UTF-8) as nlohmann-json prints it compactly.
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + nlohmann::json(metadata).dump();
  std::uint64_t offset = 0;
  for (auto const& kv : tensors_) {
    std::string const& name = kv.first;
    Tensor const& t = kv.second;
    if (!detail::valid_utf8(name))
      throw IoError(cat("cannot write ", file, ": tensor name '", name, "' is not valid UTF-8"));
    detail::rethrow_with([&] { t.validate(); }, "cannot write ", file, ": tensor '", name, "': ");
    if (header.size() > 1) header += ',';
    detail::append_json_string(header, name);
    header += cat(":{\"dtype\":\"", dtype_name(t.dtype), "\",\"shape\":[");
    for (std::size_t a = 0; a < t.shape.size(); ++a) header += cat(a ? "," : "", t.shape[a]);
    header += cat("],\"data_offsets\":[", offset, ",", offset + t.bytes.size(), "]}");
    offset += t.bytes.size();
  }
  header += '}';
  while (header.size() % 8 != 0) header += ' ';
  if (header.size() > kMaxHeaderBytes)
    throw IoError(cat("cannot write ", file, ": the header would be ", header.size(),
                      " bytes, more than the limit of ", kMaxHeaderBytes));

  std::string prefix(8, '\0');
  detail::store_le<std::uint64_t>(header.size(), reinterpret_cast<unsigned char*>(&prefix[0]));
  std::vector<ByteSpan> pieces{{prefix.data(), prefix.size()}, {header.data(), header.size()}};
  pieces.reserve(tensors_.size() + 2);
  for (auto const& kv : tensors_)
    pieces.push_back({kv.second.bytes.data(), kv.second.bytes.size()});
  write_atomic(path, pieces);
}

}  // namespace moe::io
