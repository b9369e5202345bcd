#pragma once
/// \file
/// SHA-256 (FIPS 180-4) of bytes and of files as lowercase hex, as `sha256sum` prints it: the
/// checksum a checkpoint index records for its model file. Host-only.

#include <moe/error.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace moe::io {

/// \brief An incremental SHA-256: feed bytes with update(), in pieces of any size, then read
/// hex_digest() once.
class Sha256 {
 public:
  /// \brief Adds \p n bytes at \p data to the message.
  void update(void const* data, std::size_t n) {
    auto const* p = static_cast<unsigned char const*>(data);
    total_ += n;
    if (fill_ > 0) {
      std::size_t const take = std::min(n, sizeof(buf_) - fill_);
      std::memcpy(buf_ + fill_, p, take);
      fill_ += take, p += take, n -= take;
      if (fill_ < sizeof(buf_)) return;
      compress(buf_);
      fill_ = 0;
    }
    for (; n >= 64; p += 64, n -= 64) compress(p);
    std::memcpy(buf_, p, n);
    fill_ = n;
  }

  /// \brief The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex_digest() {
    std::uint64_t const bits = total_ * 8;
    unsigned char pad[72] = {0x80};
    std::size_t const pad_len = (fill_ < 56 ? 56 - fill_ : 120 - fill_);
    for (int i = 0; i < 8; ++i) pad[pad_len + i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(pad, pad_len + 8);
    static char const hex[] = "0123456789abcdef";
    std::string out;
    for (std::uint32_t w : h_)
      for (int s = 28; s >= 0; s -= 4) out += hex[(w >> s) & 0xF];
    return out;
  }

 private:
  static std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void compress(unsigned char const* p) {
    static constexpr std::uint32_t K[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = std::uint32_t(p[4 * i]) << 24 | std::uint32_t(p[4 * i + 1]) << 16 |
             std::uint32_t(p[4 * i + 2]) << 8 | std::uint32_t(p[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      std::uint32_t const s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      std::uint32_t const s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
                  h = h_[7];
    for (int i = 0; i < 64; ++i) {
      std::uint32_t const t1 =
          h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
      std::uint32_t const t2 =
          (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
  }

  std::uint32_t h_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned char buf_[64] = {};
  std::size_t fill_ = 0;
  std::uint64_t total_ = 0;
};

/// \brief SHA-256 of the \p n bytes at \p data, as 64 lowercase hex digits.
inline std::string sha256_hex(void const* data, std::size_t n) {
  Sha256 s;
  s.update(data, n);
  return s.hex_digest();
}

/// \brief SHA-256 of the file \p path, read in pieces of 1 MiB, as 64 lowercase hex digits.
/// \param size set to the number of bytes read (the file's size)
/// \throws moe::IoError when the file cannot be opened or read
inline std::string file_sha256(std::string const& path, std::uint64_t& size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(::moe::detail::cat("cannot open '", path, "': ", std::strerror(errno)));
  Sha256 s;
  std::vector<char> buf(std::size_t{1} << 20);
  size = 0;
  while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
    s.update(buf.data(), static_cast<std::size_t>(in.gcount()));
    size += static_cast<std::uint64_t>(in.gcount());
  }
  if (in.bad()) throw IoError(::moe::detail::cat("error while reading '", path, "'"));
  return s.hex_digest();
}

}  // namespace moe::io
