// Fuzz target: the safetensors reader (moe::io::File::read, include/moe/io/safetensors.hpp).
//
// The input is a safetensors file image. It is read twice: as is, and with its 8-byte length
// prefix set so the header ends at the input's last '}' (so mutations inside the JSON header
// are not all refused for a stale length). The reader reads paths only, so the bytes go to a
// scratch file first. A refusal must be a moe::Error. When a read succeeds, every tensor is
// converted to float, double and several integer types (each conversion may refuse with a
// moe::Error), and the file is written back and read again, which must give the same tensors
// and metadata.

#include "fuzz_common.hpp"

#include <moe/io/safetensors.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace {

namespace io = moe::io;
using moe_fuzz::expect_moe_errors;
using moe_fuzz::require;

template <class T>
void convert(io::Tensor const& t) {
  expect_moe_errors("Tensor::to_vector", [&] {
    std::vector<T> const v = t.to_vector<T>();
    require(v.size() == static_cast<std::size_t>(t.numel()),
            "to_vector returned a vector of the wrong length");
  });
}

void check_file(io::File const& f, std::string const& again) {
  for (auto const& kv : f.tensors()) {
    io::Tensor const& t = kv.second;
    // A tensor that was read is consistent: validate() must not refuse it.
    bool const valid = expect_moe_errors("Tensor::validate", [&] { t.validate(); });
    require(valid, "a tensor read from a file fails validate(): " + kv.first);
    convert<float>(t);
    convert<double>(t);
    convert<std::int32_t>(t);
    convert<std::int64_t>(t);
    convert<std::int16_t>(t);
    convert<std::uint32_t>(t);
    convert<std::uint64_t>(t);
  }
  // What was read can be written, and reads back the same.
  io::File g;
  bool const wrote = expect_moe_errors("File::write", [&] { f.write(again); });
  require(wrote, "File::write refused a file that File::read accepted");
  bool const reread =
      expect_moe_errors("File::read (round trip)", [&] { g = io::File::read(again); });
  require(reread, "File::read refused the file File::write wrote");
  require(g.metadata == f.metadata, "the round trip changed the metadata");
  require(g.size() == f.size(), "the round trip changed the number of tensors");
  for (auto const& kv : f.tensors()) {
    require(g.has(kv.first), "the round trip lost tensor " + kv.first);
    io::Tensor const& a = kv.second;
    io::Tensor const& b = g.at(kv.first);
    require(a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes,
            "the round trip changed tensor " + kv.first);
  }
}

void read_and_check(std::string const& path, std::string const& again) {
  io::File f;
  if (expect_moe_errors("File::read", [&] { f = io::File::read(path); })) check_file(f, again);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  static std::string const path = moe_fuzz::scratch_dir() + "/input.safetensors";
  static std::string const again = moe_fuzz::scratch_dir() + "/again.safetensors";
  moe_fuzz::write_file(path, data, size);
  read_and_check(path, again);

  // Once more with the length prefix fitted to the header (up to the last '}').
  if (size > 8) {
    std::size_t last = size;
    while (last > 8 && data[last - 1] != '}') --last;
    std::uint64_t const header_len = last - 8;
    std::uint64_t given = 0;
    for (int i = 0; i < 8; ++i) given |= std::uint64_t{data[i]} << (8 * i);
    if (last > 8 && header_len != given) {
      std::vector<std::uint8_t> fixed(data, data + size);
      for (int i = 0; i < 8; ++i) fixed[i] = static_cast<std::uint8_t>(header_len >> (8 * i));
      moe_fuzz::write_file(path, fixed.data(), fixed.size());
      read_and_check(path, again);
    }
  }
  return 0;
}
