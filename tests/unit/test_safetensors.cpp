// Tests of moe/io/safetensors.hpp (and the Kokkos copies of moe/io/safetensors_view.hpp).
#include <moe/io/safetensors.hpp>
#include <moe/io/safetensors_view.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace fs = std::filesystem;
using moe::IoError;
using moe::io::DType;
using moe::io::File;
using moe::io::Tensor;

namespace {

/// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "moe_safetensors_XXXXXX").string();
    char* made = ::mkdtemp(&tmpl[0]);
    if (!made) throw std::runtime_error("mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  std::string file(std::string const& name) const { return (path_ / name).string(); }
  fs::path const& path() const { return path_; }
  /// Names of the entries of the directory, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> out;
    for (auto const& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  fs::path path_;
};

std::string read_bytes(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(std::string const& path, std::string const& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

/// A safetensors file image: length prefix, \p header as is, then \p data.
std::string make_file(std::string const& header, std::string const& data = "") {
  return le64(header.size()) + header + data;
}

/// Replaces the first occurrence of \p from in the header of the file at \p path by \p to and
/// fixes the length prefix (the data buffer is kept as is).
void rewrite_header(std::string const& path, std::string const& from, std::string const& to) {
  std::string const bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  std::string header = bytes.substr(8, n);
  std::size_t const at = header.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' not in header " << header;
  header.replace(at, from.size(), to);
  write_bytes(path, make_file(header, bytes.substr(8 + n)));
}

/// Expects fn() to throw moe::IoError whose message contains every one of \p parts.
void expect_io_error(std::function<void()> const& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (IoError const& e) {
    std::string const msg = e.what();
    for (std::string const& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  } catch (std::exception const& e) {
    ADD_FAILURE() << "expected moe::IoError, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected moe::IoError, nothing was thrown";
}

void expect_read_error(std::string const& path, std::initializer_list<std::string> parts) {
  expect_io_error([&] { File::read(path); }, parts);
  // Every read error names the file.
  expect_io_error([&] { File::read(path); }, {path});
}

/// The good file that the malformed-file tests corrupt. Its header is
/// {"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[3],"data_offsets":[0,24]},
///  "w":{"dtype":"F32","shape":[2,3],"data_offsets":[24,48]}}
std::string write_good_file(TempDir const& dir) {
  File f;
  f.metadata["format"] = "pt";
  f.set("w", Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, 6}));
  f.set("b", Tensor::from<std::int64_t>({3}, {7, 8, 9}));
  std::string const path = dir.file("good.safetensors");
  f.write(path);
  EXPECT_NO_THROW(File::read(path));
  return path;
}

}  // namespace

// ---- round trips --------------------------------------------------------------------------------

TEST(Safetensors, RoundTripAllDtypesScalarsAndEmptyTensors) {
  TempDir dir;
  File f;
  std::vector<float> const f32 = {1.5f, -2.25f, 3e-8f, std::numeric_limits<float>::max(), -0.0f, 6};
  std::vector<double> const f64 = {1.0 / 3.0, -1e300, 2.5, std::numeric_limits<double>::min()};
  std::vector<std::int32_t> const i32 = {0, -1, std::numeric_limits<std::int32_t>::min(),
                                         std::numeric_limits<std::int32_t>::max()};
  std::vector<std::int64_t> const i64 = {std::numeric_limits<std::int64_t>::min(), -5,
                                         std::numeric_limits<std::int64_t>::max()};
  f.set("f32", Tensor::from({2, 3}, f32));
  f.set("f64", Tensor::from({2, 1, 2}, f64));
  f.set("i32", Tensor::from({4}, i32));
  f.set("i64", Tensor::from({3, 1}, i64));
  f.set("scalar", Tensor::from<double>({}, {42.5}));
  f.set("empty", Tensor::from<float>({0}, {}));
  f.set("empty3d", Tensor::from<std::int32_t>({3, 0, 2}, {}));
  std::string const path = dir.file("all.safetensors");
  f.write(path);

  File const g = File::read(path);
  EXPECT_EQ(g.source(), path);
  EXPECT_EQ(g.names(),
            (std::vector<std::string>{"empty", "empty3d", "f32", "f64", "i32", "i64", "scalar"}));
  for (auto const& name : f.names()) {
    Tensor const& a = f.at(name);
    Tensor const& b = g.at(name);
    EXPECT_EQ(a.dtype, b.dtype) << name;
    EXPECT_EQ(a.shape, b.shape) << name;
    EXPECT_EQ(a.bytes, b.bytes) << name;
  }
  EXPECT_EQ(g.at("f32").dtype, DType::F32);
  EXPECT_EQ(g.at("f64").dtype, DType::F64);
  EXPECT_EQ(g.at("i32").dtype, DType::I32);
  EXPECT_EQ(g.at("i64").dtype, DType::I64);
  EXPECT_EQ(g.get<float>("f32"), f32);
  EXPECT_EQ(g.get<double>("f64"), f64);
  EXPECT_EQ(g.get<std::int32_t>("i32"), i32);
  EXPECT_EQ(g.get<std::int64_t>("i64"), i64);
  EXPECT_EQ(g.at("scalar").shape, std::vector<std::int64_t>{});
  EXPECT_EQ(g.at("scalar").numel(), 1);
  EXPECT_EQ(g.get<double>("scalar"), std::vector<double>{42.5});
  EXPECT_EQ(g.at("empty").numel(), 0);
  EXPECT_TRUE(g.at("empty").bytes.empty());
  EXPECT_TRUE(g.get<float>("empty").empty());
  EXPECT_EQ(g.at("empty3d").shape, (std::vector<std::int64_t>{3, 0, 2}));
  EXPECT_TRUE(g.metadata.empty());
  EXPECT_EQ(read_bytes(path).find("__metadata__"), std::string::npos);
}

TEST(Safetensors, EmptyFileRoundTrip) {
  TempDir dir;
  std::string const path = dir.file("none.safetensors");
  File().write(path);
  EXPECT_EQ(read_bytes(path), le64(8) + "{}      ");
  File const g = File::read(path);
  EXPECT_EQ(g.size(), 0u);
  EXPECT_TRUE(g.metadata.empty());
}

TEST(Safetensors, MetadataRoundTrip) {
  TempDir dir;
  File f;
  f.metadata["format"] = "pt";
  f.metadata["quote\"back\\slash"] = "line\nbreak\ttab\x01 ctrl";
  f.metadata["unicode"] = "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80";
  f.metadata["empty"] = "";
  f.set("x", Tensor::from<float>({1}, {1}));
  std::string const path = dir.file("meta.safetensors");
  f.write(path);
  File const g = File::read(path);
  EXPECT_EQ(g.metadata, f.metadata);
  EXPECT_EQ(g.get<float>("x"), std::vector<float>{1});
}

TEST(Safetensors, WriteIsDeterministic) {
  TempDir dir;
  File a, b;
  a.set("zeta", Tensor::from<float>({2}, {1, 2}));
  a.set("alpha", Tensor::from<std::int32_t>({1}, {3}));
  a.metadata["m"] = "1";
  b.metadata["m"] = "1";
  b.set("alpha", Tensor::from<std::int32_t>({1}, {3}));
  b.set("zeta", Tensor::from<float>({2}, {1, 2}));
  a.write(dir.file("a.safetensors"));
  b.write(dir.file("b.safetensors"));
  std::string const bytes = read_bytes(dir.file("a.safetensors"));
  EXPECT_EQ(bytes, read_bytes(dir.file("b.safetensors")));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_LT(bytes.find("\"alpha\""), bytes.find("\"zeta\""));
}

TEST(Safetensors, ByteExactLayout) {
  TempDir dir;
  File f;
  f.metadata["format"] = "pt";
  f.set("b", Tensor::from<float>({2}, {1.0f, -2.0f}));
  f.set("a", Tensor::from<std::int32_t>({}, {7}));
  std::string const path = dir.file("tiny.safetensors");
  f.write(path);

  // 138 bytes of JSON + 6 spaces = 144 = 0x90 bytes of header.
  std::string const header =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}"
      "      ";
  std::string expected("\x90\x00\x00\x00\x00\x00\x00\x00", 8);
  expected += header;
  expected += std::string("\x07\x00\x00\x00", 4);  // a = 7 (int32)
  expected += std::string("\x00\x00\x80\x3f", 4);  // 1.0f
  expected += std::string("\x00\x00\x00\xc0", 4);  // -2.0f
  ASSERT_EQ(header.size(), 144u);
  EXPECT_EQ(read_bytes(path), expected);
}

TEST(Safetensors, ReadsAStandardFileWrittenByAnotherTool) {
  // The shape of a file from Python's safetensors: any key order, tensors not in name order,
  // data in another order than the keys, escapes in names, whitespace, space padding.
  TempDir dir;
  std::string const header =
      "{\n  \"weight\": {\"shape\": [2, 2], \"dtype\": \"F32\", \"data_offsets\": [16, 32]},\n"
      "  \"__metadata__\": {\"format\": \"pt\"},\n"
      "  \"bias\": {\"data_offsets\": [0, 16], \"dtype\": \"F64\", \"shape\": [2]},\n"
      "  \"caf\\u00e9\\/\\ud83d\\ude00\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": "
      "[32, "
      "40]},\n"
      "  \"nothing\": {\"dtype\": \"I32\", \"shape\": [0, 4], \"data_offsets\": [40, 40]}\n"
      "}      ";
  std::string data;
  auto put = [&](auto v) {
    char raw[sizeof(v)];
    std::memcpy(raw, &v, sizeof(v));
    data.append(raw, sizeof(v));  // host is little-endian on every machine this test runs on
  };
  put(0.5);
  put(-1.5);
  for (float x : {1.0f, 2.0f, 3.0f, 4.0f}) put(x);
  put(std::int64_t{-9});
  std::string const path = dir.file("python.safetensors");
  write_bytes(path, make_file(header, data));

  File const g = File::read(path);
  EXPECT_EQ(g.names(), (std::vector<std::string>{"bias", "caf\xc3\xa9/\xf0\x9f\x98\x80", "nothing",
                                                 "weight"}));
  EXPECT_EQ(g.metadata.at("format"), "pt");
  EXPECT_EQ(g.get<double>("bias"), (std::vector<double>{0.5, -1.5}));
  EXPECT_EQ(g.get<float>("weight"), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(g.at("weight").shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(g.get<std::int64_t>("caf\xc3\xa9/\xf0\x9f\x98\x80"), std::vector<std::int64_t>{-9});
  EXPECT_EQ(g.at("nothing").numel(), 0);

  // Null metadata is accepted too.
  write_bytes(path, make_file("{\"__metadata__\":null}"));
  EXPECT_TRUE(File::read(path).metadata.empty());
}

// Public MoE checkpoints are bf16 (#29): a file with BF16 and F16 tensors written as Python's
// safetensors writes them (raw little-endian 16-bit values) reads exactly into float and double
// and as moe::bf16; moe writes them back bit for bit; floating tensors convert between the four
// floating dtypes with round-to-nearest-even (a bf16 export of float weights).
TEST(Safetensors, Bf16AndF16TensorsReadWriteAndConvert) {
  TempDir dir;
  std::string const header =
      "{\"w\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 8]},"
      " \"h\": {\"dtype\": \"F16\", \"shape\": [3], \"data_offsets\": [8, 14]}}";
  std::string data;
  // bf16: 1.0, -2.0, 0.1 (0x3dcd, rounded), -Inf; half: 1.0, 65504, smallest subnormal.
  for (std::uint16_t b : {0x3f80, 0xc000, 0x3dcd, 0xff80, 0x3c00, 0x7bff, 0x0001}) {
    data.push_back(char(b & 0xff));
    data.push_back(char(b >> 8));
  }
  std::string const path = dir.file("bf16.safetensors");
  write_bytes(path, make_file(header, data));
  File const g = File::read(path);
  EXPECT_EQ(g.at("w").dtype, moe::io::DType::BF16);
  auto const w = g.get<float>("w");
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], -2.0f);
  EXPECT_EQ(w[2], moe::detail::bf16_to_float(0x3dcd));
  EXPECT_NEAR(w[2], 0.1, 0.0005);
  EXPECT_TRUE(std::isinf(w[3]) && w[3] < 0);
  EXPECT_EQ(g.get<double>("h"), (std::vector<double>{1.0, 65504.0, std::ldexp(1.0, -24)}));
  auto const wb = g.get<moe::bf16>("w");
  EXPECT_EQ(wb[2].bits, 0x3dcd);
  EXPECT_THROW(g.get<std::int32_t>("w"), IoError);  // floating values are never integers
  // Written back: the same bytes.
  g.write(dir.file("again.safetensors"));
  File const again = File::read(dir.file("again.safetensors"));
  EXPECT_EQ(again.at("w").bytes, g.at("w").bytes);
  EXPECT_EQ(again.at("h").bytes, g.at("h").bytes);
  // Conversions: float -> bf16 / f16 rounds to nearest even; bf16 -> float is exact.
  Tensor const f = Tensor::from<float>({4}, {1.0f, 0.1f, 65520.0f, -3.0e38f});
  Tensor const b = f.as(moe::io::DType::BF16);
  EXPECT_EQ(b.dtype, moe::io::DType::BF16);
  EXPECT_EQ(b.bytes.size(), 8u);
  auto const bv = b.to_vector<moe::bf16>();
  EXPECT_EQ(bv[0].bits, 0x3f80);
  EXPECT_EQ(bv[1].bits, moe::bf16(0.1f).bits);
  Tensor const h = f.as(moe::io::DType::F16);
  auto const hv = h.to_vector<float>();
  EXPECT_EQ(hv[0], 1.0f);
  EXPECT_TRUE(std::isinf(hv[2]));  // 65520 rounds past half's largest value
  EXPECT_TRUE(std::isinf(hv[3]) && hv[3] < 0);
  EXPECT_EQ(b.as(moe::io::DType::F32).to_vector<float>()[1], float(moe::bf16(0.1f)));
  Tensor const from_bf16 = Tensor::from<moe::bf16>({2}, {moe::bf16(1.5f), moe::bf16(-0.25f)});
  EXPECT_EQ(from_bf16.to_vector<double>(), (std::vector<double>{1.5, -0.25}));
  EXPECT_THROW(Tensor::from<std::int32_t>({1}, {3}).as(moe::io::DType::BF16), IoError);
}

// ---- conversions and in-memory API
// ---------------------------------------------------------------

TEST(Safetensors, Conversions) {
  Tensor const f64 = Tensor::from<double>({3}, {0.1, -2.5, 1e10});
  std::vector<float> const as_float = f64.to_vector<float>();
  EXPECT_EQ(as_float, (std::vector<float>{0.1f, -2.5f, 1e10f}));
  Tensor const f32 = Tensor::from<float>({2}, {0.1f, 3.0f});
  EXPECT_EQ(f32.to_vector<double>(), (std::vector<double>{static_cast<double>(0.1f), 3.0}));

  Tensor const i32 = Tensor::from<std::int32_t>({3}, {-3, 0, 5});
  EXPECT_EQ(i32.to_vector<std::int64_t>(), (std::vector<std::int64_t>{-3, 0, 5}));
  EXPECT_EQ(i32.to_vector<double>(), (std::vector<double>{-3, 0, 5}));
  EXPECT_EQ(i32.to_vector<float>(), (std::vector<float>{-3, 0, 5}));

  Tensor const i64 = Tensor::from<std::int64_t>({2}, {-4, 1 << 20});
  EXPECT_EQ(i64.to_vector<std::int32_t>(), (std::vector<std::int32_t>{-4, 1 << 20}));
  EXPECT_EQ(i64.to_vector<int>(), (std::vector<int>{-4, 1 << 20}));
  Tensor const big = Tensor::from<std::int64_t>({2}, {1, std::int64_t{1} << 40});
  expect_io_error([&] { big.to_vector<std::int32_t>(); }, {"element 1", "does not fit", "int32"});
  EXPECT_EQ(big.to_vector<std::uint64_t>(),
            (std::vector<std::uint64_t>{1, std::uint64_t{1} << 40}));
  expect_io_error([&] { i32.to_vector<std::uint32_t>(); }, {"element 0", "-3", "uint32"});
  expect_io_error([&] { f32.to_vector<std::int32_t>(); }, {"F32", "int32", "never converted"});
  expect_io_error([&] { f64.to_vector<std::int64_t>(); }, {"F64", "int64"});

  // Other spellings of the same widths map to the same dtypes.
  EXPECT_EQ(Tensor::from<long long>({1}, {1}).dtype, DType::I64);
  EXPECT_EQ(Tensor::from<long>({1}, {1}).dtype, DType::I64);
  EXPECT_EQ(Tensor::from<int>({1}, {1}).dtype, DType::I32);
  EXPECT_EQ(moe::io::dtype_size(DType::F64), 8u);
  EXPECT_STREQ(moe::io::dtype_name(DType::I32), "I32");
  DType d{};
  EXPECT_TRUE(moe::io::parse_dtype("F64", d));
  EXPECT_EQ(d, DType::F64);
  EXPECT_TRUE(moe::io::parse_dtype("BF16", d));
  EXPECT_EQ(d, DType::BF16);
  EXPECT_EQ(moe::io::dtype_size(DType::F16), 2u);
  EXPECT_FALSE(moe::io::parse_dtype("F8_E4M3", d));
}

TEST(Safetensors, TensorFromChecksShape) {
  expect_io_error(
      [] {
        Tensor::from<float>({2, 3}, {1, 2, 3});
      },
      {"[2, 3]", "6 elements", "3 values"});
  expect_io_error([] { Tensor::from<float>({-1}, {}); }, {"negative"});
  expect_io_error(
      [] {
        Tensor::from<float>({std::int64_t{1} << 40, std::int64_t{1} << 40}, {});
      },
      {"overflow"});
  // A zero dimension makes the product zero whatever the others are.
  EXPECT_EQ(Tensor::from<float>({std::int64_t{1} << 62, 8, 0}, {}).numel(), 0);
}

TEST(Safetensors, SetValidatesAndAtNamesFileAndTensor) {
  TempDir dir;
  File f;
  Tensor bad = Tensor::from<float>({2}, {1, 2});
  bad.bytes.pop_back();
  expect_io_error([&] { f.set("bad", bad); }, {"'bad'", "needs 2 * 4 bytes but holds 7"});
  expect_io_error([&] { f.set("__metadata__", Tensor::from<float>({}, {1})); }, {"reserved"});
  expect_io_error([&] { f.at("missing"); }, {"in-memory", "'missing'", "no tensors"});

  f.set("w", Tensor::from<float>({1}, {1}));
  f.set("w", Tensor::from<float>({2}, {1, 2}));  // replaces
  EXPECT_EQ(f.size(), 1u);
  EXPECT_EQ(f.at("w").numel(), 2);
  std::string const path = dir.file("x.safetensors");
  f.write(path);
  File const g = File::read(path);
  EXPECT_TRUE(g.has("w"));
  EXPECT_FALSE(g.has("v"));
  expect_io_error([&] { g.at("v"); }, {path, "'v'", "it has: w"});
  expect_io_error([&] { g.get<int>("w"); }, {path, "tensor 'w'", "never converted"});
  EXPECT_TRUE(f.erase("w"));
  EXPECT_FALSE(f.erase("w"));

  // A tensor corrupted after set() is caught by write(), which then leaves nothing behind.
  File h;
  h.set("t", Tensor::from<float>({1}, {1}));
  const_cast<Tensor&>(h.at("t")).bytes.push_back(0);
  expect_io_error([&] { h.write(dir.file("h.safetensors")); }, {"h.safetensors", "'t'"});
  EXPECT_FALSE(fs::exists(dir.file("h.safetensors")));

  File u;
  u.set("bad\xff", Tensor::from<float>({}, {1}));
  expect_io_error([&] { u.write(dir.file("u.safetensors")); }, {"u.safetensors", "UTF-8"});
}

// ---- malformed files
// -------------------------------------------------------------------------------

TEST(Safetensors, RejectsShortFilesAndBadHeaderLengths) {
  TempDir dir;
  std::string const path = dir.file("bad.safetensors");
  write_bytes(path, "");
  expect_read_error(path, {"0 bytes", "8-byte header length"});
  write_bytes(path, std::string(7, '\0'));
  expect_read_error(path, {"7 bytes", "8-byte header length"});
  write_bytes(path, le64(1000) + "{}");
  expect_read_error(path, {"1000 bytes", "only 2 bytes", "truncated"});
  write_bytes(path, le64(200'000'000) + "{}");
  expect_read_error(path, {"200000000", "limit"});
  write_bytes(path, le64(0));
  expect_read_error(path, {"not valid JSON"});
  expect_read_error(dir.file("does-not-exist.safetensors"), {"cannot read", "No such file"});
  expect_read_error(dir.path().string(), {"not a regular file"});
}

TEST(Safetensors, RejectsInvalidJson) {
  TempDir dir;
  std::string const path = write_good_file(dir);
  rewrite_header(path, "{\"__metadata__\"", "{__metadata__\"");
  expect_read_error(path, {"not valid JSON", "expected a string key", "at byte 1"});

  std::string const p2 = dir.file("j.safetensors");
  for (std::string const& h :
       {std::string("{\"a\":"), std::string("{} x"), std::string("{\"a\":tru}"),
        std::string("{\"a\":\"\x01\"}"), std::string("{\"a\":\"\xc3\"}"),
        std::string("{\"a\":\"\\ud800\"}"), std::string("{\"a\":01}"), std::string("{\"a\":[1,]}"),
        std::string("\xef\xbb\xbf{}")}) {
    write_bytes(p2, make_file(h));
    expect_read_error(p2, {"not valid JSON"});
  }
  // Deep nesting is refused, not a stack overflow.
  write_bytes(p2, make_file(std::string(100000, '[') + std::string(100000, ']')));
  expect_read_error(p2, {"not valid JSON", "nesting"});
}

TEST(Safetensors, RejectsHeadersThatAreNotObjectsOfEntries) {
  TempDir dir;
  std::string const path = dir.file("bad.safetensors");
  write_bytes(path, make_file("[1, 2]  "));
  expect_read_error(path, {"an array", "not a JSON object"});
  write_bytes(path, make_file("{\"a\": 5}"));
  expect_read_error(path, {"tensor 'a'", "a number", "must be an object"});
  write_bytes(path, make_file("{\"a\": {\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
                              "\"a\": {\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[4,8]}}",
                              std::string(8, '\0')));
  expect_read_error(path, {"duplicate key \"a\""});
  write_bytes(path, make_file("{\"__metadata__\": {\"k\": 1}}"));
  expect_read_error(path, {"metadata", "'k'", "must be a string"});
  write_bytes(path, make_file("{\"__metadata__\": [\"k\"]}"));
  expect_read_error(path, {"__metadata__", "an array"});
}

TEST(Safetensors, RejectsEntriesWithMissingOrUnknownFields) {
  TempDir dir;
  std::string path = write_good_file(dir);
  rewrite_header(path, "\"dtype\":\"F32\",", "");
  expect_read_error(path, {"tensor 'w'", "no \"dtype\""});
  path = write_good_file(dir);
  rewrite_header(path, "\"shape\":[2,3],", "");
  expect_read_error(path, {"tensor 'w'", "no \"shape\""});
  path = write_good_file(dir);
  rewrite_header(path, ",\"data_offsets\":[24,48]", "");
  expect_read_error(path, {"tensor 'w'", "no \"data_offsets\""});
  path = write_good_file(dir);
  rewrite_header(path, "\"dtype\":\"F32\"", "\"dtype\":\"F32\",\"strides\":[3,1]");
  expect_read_error(path, {"tensor 'w'", "unknown key \"strides\""});
  path = write_good_file(dir);
  rewrite_header(path, "\"dtype\":\"F32\"", "\"dtype\":32");
  expect_read_error(path, {"tensor 'w'", "dtype is a number"});
}

TEST(Safetensors, RejectsUnsupportedDtypes) {
  TempDir dir;
  for (std::string const dt : {"F8_E4M3", "U16", "U8", "BOOL"}) {
    std::string const path = write_good_file(dir);
    rewrite_header(path, "\"F32\"", "\"" + dt + "\"");
    expect_read_error(path,
                      {"tensor 'w'", "unsupported dtype '" + dt + "'", "F32, F64, BF16, F16, I32"});
  }
  std::string const path = write_good_file(dir);
  rewrite_header(path, "\"F32\"", "\"float32\"");
  expect_read_error(path, {"tensor 'w'", "unknown dtype 'float32'"});
}

TEST(Safetensors, RejectsBadShapes) {
  TempDir dir;
  std::string path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[-2,3]");
  expect_read_error(path, {"tensor 'w'", "negative dimension -2", "axis 0"});
  path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[2.0,3]");
  expect_read_error(path, {"tensor 'w'", "dimension 0", "2.0", "not an integer"});
  path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[2,\"3\"]");
  expect_read_error(path, {"tensor 'w'", "dimension 1", "a string"});
  path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[99999999999999999999,3]");
  expect_read_error(path, {"tensor 'w'", "not an integer that fits in 64 bits"});
  path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[4294967296,4294967296]");
  expect_read_error(path, {"tensor 'w'", "shape product overflow"});
  path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[4611686018427387905]");  // 2^62 + 1 elements of 4 bytes
  expect_read_error(path, {"tensor 'w'", "more bytes than fit in 64 bits"});
  path = write_good_file(dir);
  rewrite_header(path, "\"shape\":[2,3]", "\"shape\":6");
  expect_read_error(path, {"tensor 'w'", "shape is a number"});
}

TEST(Safetensors, RejectsBadDataOffsets) {
  TempDir dir;
  for (std::string const bad : {"[24]", "[24,48,48]", "[-24,48]", "[24.0,48]", "\"24,48\"", "[]"}) {
    std::string const path = write_good_file(dir);
    rewrite_header(path, "[24,48]", bad);
    expect_read_error(path, {"tensor 'w'", "data_offsets must be [begin, end]"});
  }
  std::string const path = write_good_file(dir);
  rewrite_header(path, "[24,48]", "[48,24]");
  expect_read_error(path, {"tensor 'w'", "begin > end"});
}

TEST(Safetensors, RejectsTruncatedFiles) {
  TempDir dir;
  std::string const path = write_good_file(dir);
  fs::resize_file(path, fs::file_size(path) - 1);
  expect_read_error(path, {"tensor 'w'", "[24, 48]", "holds 47 bytes", "truncated"});
  // Offsets that point beyond the buffer with sizes that agree with the shape.
  std::string const p2 = write_good_file(dir);
  rewrite_header(p2, "\"shape\":[2,3],\"data_offsets\":[24,48]",
                 "\"shape\":[2,4],\"data_offsets\":[24,56]");
  expect_read_error(p2, {"tensor 'w'", "beyond the data buffer", "truncated"});
  // Cut inside the header.
  std::string const p3 = write_good_file(dir);
  fs::resize_file(p3, 20);
  expect_read_error(p3, {"only 12 bytes follow", "truncated"});
}

TEST(Safetensors, RejectsHeadersThatLieAboutSizes) {
  TempDir dir;
  std::string path = write_good_file(dir);
  rewrite_header(path, "[2,3]", "[2,2]");
  expect_read_error(path, {"tensor 'w'", "header lies about sizes", "needs 16 bytes", "span 24"});
  path = write_good_file(dir);
  rewrite_header(path, "\"I64\"", "\"I32\"");
  expect_read_error(path, {"tensor 'b'", "header lies about sizes", "needs 12 bytes"});
}

TEST(Safetensors, RejectsOverlappingTensors) {
  TempDir dir;
  std::string const path = write_good_file(dir);
  rewrite_header(path, "[24,48]", "[20,44]");
  expect_read_error(path, {"'b'", "'w'", "overlap", "[0, 24)", "[20, 44)"});
  // Zero-sized tensors may sit anywhere, including inside another tensor's bytes.
  std::string const p2 = dir.file("empty.safetensors");
  write_bytes(p2, make_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                            "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
                            std::string(8, '\0')));
  EXPECT_EQ(File::read(p2).at("z").numel(), 0);
}

TEST(Safetensors, RandomCorruptionsGiveIoErrorsOrValidFiles) {
  // Byte edits, deletions and truncations of a good file: every read either succeeds with
  // consistent tensors or throws moe::IoError; nothing else (no crash, no other exception).
  TempDir dir;
  File f;
  f.metadata["format"] = "pt";
  f.set("w", Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, 6}));
  f.set("b", Tensor::from<std::int64_t>({3}, {7, 8, 9}));
  f.set("s", Tensor::from<double>({}, {0.5}));
  f.set("e", Tensor::from<std::int32_t>({0, 2}, {}));
  std::string const good_path = dir.file("good.safetensors");
  f.write(good_path);
  std::string const good = read_bytes(good_path);
  std::string const path = dir.file("fuzz.safetensors");
  std::mt19937 rng(12345);
  char const interesting[] = "{}[]\",:-0123456789 eE.\\\xff\x00";
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(good[i]);
  std::size_t const header_end = 8 + n;
  int ok = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = good;
    int const kind = static_cast<int>(rng() % 4);
    if (kind == 0) {  // overwrite one byte of the length or the header
      char const c = (rng() % 2) ? interesting[rng() % (sizeof(interesting) - 1)]
                                 : static_cast<char>(rng() % 256);
      bytes[rng() % header_end] = c;
    } else if (kind == 1) {  // delete one header byte and fix the length prefix
      std::string header = good.substr(8, header_end - 8);
      header.erase(rng() % header.size(), 1);
      bytes = make_file(header, good.substr(header_end));
    } else if (kind == 2) {  // truncate anywhere
      bytes.resize(rng() % good.size());
    } else {  // overwrite one byte of the length prefix with anything
      bytes[rng() % 8] = static_cast<char>(rng() % 256);
    }
    write_bytes(path, bytes);
    try {
      File const g = File::read(path);
      for (auto const& kv : g.tensors()) EXPECT_NO_THROW(kv.second.validate()) << kv.first;
      ++ok;
    } catch (IoError const&) {
      ++rejected;
    } catch (std::exception const& e) {
      ADD_FAILURE() << "iteration " << iter << ": unexpected exception " << e.what();
    }
  }
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(ok, 0);  // e.g. edits inside the padding or metadata value
}

// ---- atomic writes ----------------------------------------------------------------------------

TEST(Safetensors, AtomicWriteReplacesAndLeavesNoTemporaryFiles) {
  TempDir dir;
  std::string const path = dir.file("out.bin");
  moe::io::write_atomic(path, std::string("first version"));
  EXPECT_EQ(read_bytes(path), "first version");
  moe::io::write_atomic(path, std::string("second"));
  EXPECT_EQ(read_bytes(path), "second");
  moe::io::write_atomic(path, std::vector<moe::io::ByteSpan>{{"ab", 2}, {nullptr, 0}, {"cd", 2}});
  EXPECT_EQ(read_bytes(path), "abcd");
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"out.bin"});

  std::string const st = dir.file("w.safetensors");
  File a;
  a.set("x", Tensor::from<double>({3}, {1, 2, 3}));
  a.write(st);
  File b;
  b.set("y", Tensor::from<float>({1}, {4}));
  b.write(st);
  File const g = File::read(st);
  EXPECT_EQ(g.names(), std::vector<std::string>{"y"});
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"out.bin", "w.safetensors"}));

  // A relative path (directory ".") works too.
  fs::path const old = fs::current_path();
  fs::current_path(dir.path());
  EXPECT_NO_THROW(moe::io::write_atomic("rel.bin", std::string("r")));
  fs::current_path(old);
  EXPECT_EQ(read_bytes(dir.file("rel.bin")), "r");
}

// An output path that is a symbolic link is written through: the file it names is replaced
// atomically and the link stays a link (#32: never replacing the link), through a chain of links
// and a relative target too; a dangling link creates the file it names; a loop is an IoError.
TEST(Safetensors, AtomicWriteGoesThroughSymbolicLinks) {
  TempDir dir;
  fs::create_directory(dir.file("data"));
  std::string const target = dir.file("data/result.bin");
  write_bytes(target, "old");
  fs::create_symlink("data/result.bin", dir.file("link"));  // relative to the link's directory
  fs::create_symlink(dir.file("link"), dir.file("link2"));   // a chain
  moe::io::write_atomic(dir.file("link2"), std::string("new"));
  EXPECT_TRUE(fs::is_symlink(dir.file("link2")));
  EXPECT_TRUE(fs::is_symlink(dir.file("link")));
  EXPECT_EQ(read_bytes(target), "new");
  EXPECT_EQ(moe::io::resolve_links(dir.file("link2")), dir.file("data/result.bin"));
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"data", "link", "link2"}));
  EXPECT_EQ(fs::directory_iterator(dir.file("data"))->path().filename(), "result.bin");

  fs::create_symlink("data/created.bin", dir.file("dangling"));
  File f;
  f.set("x", Tensor::from<float>({1}, {5}));
  f.write(dir.file("dangling"));
  EXPECT_TRUE(fs::is_symlink(dir.file("dangling")));
  EXPECT_EQ(File::read(dir.file("data/created.bin")).names(), std::vector<std::string>{"x"});

  fs::create_symlink(dir.file("loop_b"), dir.file("loop_a"));
  fs::create_symlink(dir.file("loop_a"), dir.file("loop_b"));
  expect_io_error([&] { moe::io::write_atomic(dir.file("loop_a"), std::string("x")); },
                  {"more than 40 symbolic links"});
}

TEST(Safetensors, UnwritableDestinationThrowsAndLeavesNothing) {
  TempDir dir;
  File f;
  f.set("x", Tensor::from<float>({1}, {1}));

  std::string const missing = dir.file("no-such-dir/out.safetensors");
  expect_io_error([&] { f.write(missing); }, {missing, "temporary file", "No such file"});

  write_bytes(dir.file("plain"), "x");
  std::string const under_file = dir.file("plain/out.safetensors");
  expect_io_error([&] { f.write(under_file); }, {under_file, "Not a directory"});

  // The target exists and is a directory: the rename fails, the temporary file is removed and the
  // directory is left alone.
  fs::create_directory(dir.file("target"));
  expect_io_error([&] { f.write(dir.file("target")); }, {"target", "renaming"});
  EXPECT_TRUE(fs::is_directory(dir.file("target")));
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"plain", "target"}));

  expect_io_error([&] { moe::io::write_atomic("", std::string("x")); }, {"empty"});

  // Permission bits do not stop root, so this part only runs for other users.
  if (::geteuid() != 0) {
    fs::create_directory(dir.file("ro"));
    fs::permissions(dir.file("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    expect_io_error([&] { f.write(dir.file("ro/out.safetensors")); },
                    {"ro/out.safetensors", "Permission denied"});
    fs::permissions(dir.file("ro"), fs::perms::owner_all);
    EXPECT_TRUE(fs::is_empty(dir.file("ro")));
  }
}

// ---- Kokkos Views
// --------------------------------------------------------------------------------

TEST(Safetensors, ViewsRoundTripInRowMajorOrder) {
  using Host = Kokkos::HostSpace;
  Kokkos::View<double**, Kokkos::LayoutLeft, Host> left("left", 2, 3);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) left(i, j) = 10 * i + j;
  Tensor const t = moe::io::to_tensor(left);
  EXPECT_EQ(t.dtype, DType::F64);
  EXPECT_EQ(t.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{0, 1, 2, 10, 11, 12}));

  auto right = moe::io::to_view<Kokkos::View<float**>>(t, "right");
  ASSERT_EQ(right.extent(0), 2u);
  ASSERT_EQ(right.extent(1), 3u);
  auto host = Kokkos::create_mirror_view_and_copy(Host(), right);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(host(i, j), static_cast<float>(10 * i + j));

  auto fixed = moe::io::to_view<Kokkos::View<double* [3]>>(t, "fixed");  // default memory space
  EXPECT_EQ(Kokkos::create_mirror_view_and_copy(Host(), fixed)(1, 2), 12.0);
  EXPECT_THROW(moe::io::to_view<Kokkos::View<double* [4]>>(t, "fixed4"), moe::ShapeError);
  EXPECT_THROW(moe::io::to_view<Kokkos::View<double*>>(t, "rank1"), moe::ShapeError);

  Kokkos::View<double**> wrong("wrong", 3, 2);
  EXPECT_THROW(moe::io::copy_to_view(t, wrong, "t"), moe::ShapeError);
  Kokkos::View<int**> ints("ints", 2, 3);
  EXPECT_THROW(moe::io::copy_to_view(t, ints, "t"), IoError);  // floating -> integer

  Kokkos::View<double> scalar("scalar");
  Kokkos::deep_copy(scalar, 2.5);
  Tensor const s = moe::io::to_tensor(scalar);
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.to_vector<double>(), std::vector<double>{2.5});
  auto back = moe::io::to_view<Kokkos::View<double>>(s, "back");
  auto back_host = Kokkos::create_mirror_view_and_copy(Host(), back);
  EXPECT_EQ(back_host(), 2.5);

  Kokkos::View<std::int32_t*> ids("ids", 0);
  Tensor const empty = moe::io::to_tensor(ids);
  EXPECT_EQ(empty.dtype, DType::I32);
  EXPECT_EQ(empty.shape, std::vector<std::int64_t>{0});
}

// moe/io/json.hpp on its own: the rules moe adds to nlohmann-json's parser, and the writers.
namespace {

moe::io::detail::JsonValue parse_json(std::string const& text) {
  return moe::io::detail::parse_json(text, "t: ");
}

std::string json_error(std::string const& text) {
  try {
    parse_json(text);
  } catch (IoError const& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Json, ReadsATreeInFileOrderWithExactIntegers) {
  using Kind = moe::io::detail::JsonValue::Kind;
  auto const v = parse_json(
      "{\"z\": [9007199254740993, -9223372036854775808, 18446744073709551615, 1.5e3, -0],"
      " \"a\": {\"s\": \"\\u00e9\\ud83d\\ude00\", \"t\": true, \"n\": null}}");
  ASSERT_EQ(v.kind, Kind::Object);
  ASSERT_EQ(v.keys, (std::vector<std::string>{"z", "a"}));
  auto const& z = v.items[0];
  ASSERT_EQ(z.items.size(), 5u);
  std::int64_t x = 0;
  ASSERT_TRUE(moe::io::detail::json_to_int64(z.items[0], x));
  EXPECT_EQ(x, 9007199254740993);  // 2^53 + 1: not rounded through a double
  ASSERT_TRUE(moe::io::detail::json_to_int64(z.items[1], x));
  EXPECT_EQ(x, std::numeric_limits<std::int64_t>::min());
  EXPECT_FALSE(moe::io::detail::json_to_int64(z.items[2], x));  // beyond int64
  EXPECT_EQ(z.items[2].text, "18446744073709551615");
  EXPECT_FALSE(moe::io::detail::json_to_int64(z.items[3], x));  // not an integer literal
  EXPECT_EQ(z.items[3].text, "1.5e3");
  ASSERT_TRUE(moe::io::detail::json_to_int64(z.items[4], x));
  EXPECT_EQ(x, 0);
  auto const& a = v.items[1];
  EXPECT_EQ(a.items[0].text, "\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(a.items[1].kind, Kind::Bool);
  EXPECT_TRUE(a.items[1].boolean);
  EXPECT_EQ(a.items[2].kind, Kind::Null);
}

TEST(Json, RefusesWhatTheFormatsForbidNamingTheByte) {
  // Duplicate keys at any depth, at the closing quote of the second one (byte 17).
  std::string const dup = json_error("{\"a\": {\"k\": 1, \"k\": 2}}");
  EXPECT_NE(dup.find("duplicate key \"k\""), std::string::npos) << dup;
  EXPECT_NE(dup.find("at byte 17"), std::string::npos) << dup;
  // 64 levels are fine, 65 are not (and 100000 do not exhaust the stack).
  EXPECT_NO_THROW(parse_json(std::string(64, '[') + std::string(64, ']')));
  std::string const deep = json_error(std::string(65, '[') + std::string(65, ']'));
  EXPECT_NE(deep.find("nesting deeper than 64"), std::string::npos) << deep;
  EXPECT_NE(deep.find("at byte 64"), std::string::npos) << deep;
  std::string const bom = json_error("\xef\xbb\xbf{}");
  EXPECT_NE(bom.find("byte-order mark"), std::string::npos) << bom;
  std::string const bad = json_error("{\"a\": [1, 2,]}");
  EXPECT_NE(bad.find("t: header is not valid JSON"), std::string::npos) << bad;
  EXPECT_NE(bad.find("at byte 12"), std::string::npos) << bad;
  std::string const cut = json_error("{\"a\": [1, 2");
  EXPECT_NE(cut.find("ended early"), std::string::npos) << cut;
  for (std::string const& t : {std::string("{\"a\":\"\xed\xa0\x80\"}"),  // a surrogate as UTF-8
                               std::string("{\"a\":\"\xc0\xaf\"}"),      // overlong
                               std::string("{\"a\":\"\xf4\x90\x80\x80\"}")})  // beyond U+10FFFF
    EXPECT_NE(json_error(t).find("not valid JSON"), std::string::npos) << json_error(t);
}

TEST(Json, WritesStringsAndChecksUtf8) {
  std::string out;
  moe::io::detail::append_json_string(out, std::string("a\"b\\c\n\x01\xc3\xa9", 9));
  EXPECT_EQ(out, "\"a\\\"b\\\\c\\n\\u0001\xc3\xa9\"");
  EXPECT_TRUE(moe::io::detail::valid_utf8("plain \xc3\xa9 \xf0\x9f\x98\x80"));
  EXPECT_FALSE(moe::io::detail::valid_utf8("\xc3"));
  EXPECT_FALSE(moe::io::detail::valid_utf8("\xed\xa0\x80"));
  EXPECT_FALSE(moe::io::detail::valid_utf8("\xc0\xaf"));
}
