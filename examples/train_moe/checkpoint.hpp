#pragma once
/// \file
/// Checkpoints of a distributed training run: save_checkpoint and load_latest_checkpoint.
///
/// Every rank describes the tensors it holds as blocks (moe::TensorBlock: the global shape, the
/// shape of the local block and its offset) of host memory, F32 or F64, row-major. A checkpoint
/// stores the *global* tensors, so it does not depend on how they were split: a run may resume on
/// another number of ranks or with another sharding (resharding), because every rank fills its
/// blocks from the global tensors, whatever they are.
///
/// On-disk format (`dir` is the checkpoint directory; N the step, printed with at least 8 digits):
///
///     dir/step_<NNNNNNNN>/model.safetensors   every global tensor, plus the caller's metadata as
///                                             the safetensors "__metadata__" (string -> string)
///     dir/step_<NNNNNNNN>/index.json          written last (see index_text): format
///                                             "moe-checkpoint", version 1, step, file name,
///                                             bytes (file size), sha256 (64 hex digits) and
///                                             the tensors' names, dtypes and shapes
///
/// The SHA-256 is the plain digest of model.safetensors, so `sha256sum` checks it too. Temporary
/// entries of the directory start with a dot (".tmp_step_*", ".trash_step_*") and are never read.
///
/// Saving (collective). Every rank checks its blocks (dtype F32/F64, offset + local shape within
/// the global shape, data present) and the ranks compare their step, keep, directory and
/// metadata, which must be identical. The block descriptions are all-gathered, so every rank
/// builds the same plan and raises the same ConfigError when: two blocks of one tensor disagree
/// on dtype or global shape; two distinct blocks overlap partially (blocks must be identical or
/// disjoint); the blocks do not cover the whole tensor; or two copies of one block hold different
/// bytes (compared by a 64-bit hash of each copy). A rank need not hold every tensor, may hold
/// several blocks of one tensor, and a tensor may be held whole by one rank. Of identical blocks
/// only the lowest rank's copy is sent: rank 0 receives each distinct block (point-to-point, in a
/// fixed order, in pieces of at most 1 GiB), assembles the global tensors in memory (rank 0 needs
/// memory for the whole model) and writes:
///
///   1. "dir/.tmp_step_<N>.<pid>/": model.safetensors (temporary file, fsync, rename, fsync of the
///      directory), then index.json with the size and SHA-256 of the file read back from disk
///      (same atomic write);
///   2. renames the temporary directory to "dir/step_<N>" and fsyncs "dir". An existing
///      "step_<N>" (a step saved again) is swapped atomically with renameat2(RENAME_EXCHANGE);
///      where the file system cannot exchange, it is first moved aside, so a crash between the two
///      renames loses that step's old copy (never an older checkpoint);
///   3. keeps the last `keep` complete checkpoints: of the directories with a readable index and a
///      step below N, the newest keep - 1 stay and the others are renamed to ".trash_step_*" and
///      removed. Checkpoints with a step above N (left by a run that was rolled back) are never
///      deleted, and a failure to delete is a warning on stderr, not an error.
///
/// A process killed at any moment (SIGKILL, power loss after the fsyncs) thus leaves either the
/// previous checkpoints and no new "step_<N>" (only a hidden temporary directory, removed by the
/// next save), or the new checkpoint complete. Errors raise the same exception on every rank
/// (moe::ConfigError for bad arguments or blocks, moe::IoError for the file system) and remove
/// the temporary directory.
///
/// One writer per directory: a save runs under the exclusive lock of "dir/LOCK" (an fcntl lock
/// that dies with its process), taken for the save unless this process holds it already; a job
/// takes it for its whole life with CheckpointDirLock (train_moe does, before resuming). A second
/// job fails with a moe::IoError naming the holder instead of destroying the first's checkpoints.
///
/// Loading (collective). Rank 0 lists "step_<digits>" directories, newest first, and takes the
/// first that verifies: index.json parses and names this step, the file has the recorded size and
/// SHA-256, moe::io::File::read validates it, its tensors are those of the index, and every
/// tensor some rank requests exists with the requested dtype and global shape. Each rejected
/// directory is reported on stderr as "checkpoint: skipping <dir>: <reason>". The choice, the step
/// and the metadata are broadcast; rank 0 then cuts every rank's blocks out of the global tensors
/// and sends them (only rank 0 reads the file). A missing directory or no valid checkpoint returns
/// false on every rank and leaves `metadata` and `step` unchanged.
///
/// Test hook: when the environment variable MOE_CHECKPOINT_TEST_CRASH names a point of the save
/// ("model_written", "index_written", "installed", "retention"), rank 0 calls _exit(86) there.
///
/// POSIX (Linux for the atomic exchange) is required.

#include <moe/comm/communicator.hpp>
#include <moe/distributed/layout.hpp>
#include <moe/error.hpp>
#include <moe/io/safetensors.hpp>

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace train {

/// \brief One block of a global tensor held by this rank, in host memory, row-major.
struct BlockRef {
  std::string name;        ///< tensor name (the same on every rank holding a block of it)
  moe::TensorBlock block;  ///< global shape, local shape and offset of the block
  std::string dtype;       ///< "F32" (float) or "F64" (double)
  void* data = nullptr;    ///< numel(local_shape) elements; read by save, written by load
};

namespace ckpt_detail {

using moe::detail::cat;
namespace fs = std::filesystem;
namespace io = moe::io;

inline constexpr int kTag = 0x636b;  // "ck"
/// Largest MPI message in bytes (1 GiB; a test hook, which must be the same on every rank).
inline std::size_t& piece_bytes() {
  static std::size_t bytes = std::size_t{1} << 30;
  return bytes;
}
inline constexpr char const* kModelFile = "model.safetensors";
inline constexpr char const* kIndexFile = "index.json";

// ---- SHA-256 (FIPS 180-4) ---------------------------------------------------------------------

class Sha256 {
 public:
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

  /// The digest as 64 lowercase hex digits; the object is spent afterwards.
  std::string hex_digest() {
    std::uint64_t const bits = total_ * 8;
    unsigned char pad[72] = {0x80};
    std::size_t const pad_len = (fill_ < 56 ? 56 - fill_ : 120 - fill_);
    for (int i = 0; i < 8; ++i) pad[pad_len + i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(pad, pad_len + 8);
    static char const hex[] = "0123456789abcdef";
    std::string out;
    for (std::uint32_t w : h_) {
      for (int s = 28; s >= 0; s -= 4) out += hex[(w >> s) & 0xF];
    }
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
    for (int i = 0; i < 16; ++i) {
      w[i] = std::uint32_t(p[4 * i]) << 24 | std::uint32_t(p[4 * i + 1]) << 16 |
             std::uint32_t(p[4 * i + 2]) << 8 | std::uint32_t(p[4 * i + 3]);
    }
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

inline std::string sha256_hex(void const* data, std::size_t n) {
  Sha256 s;
  s.update(data, n);
  return s.hex_digest();
}

/// SHA-256 of the file \p path (streamed); its size goes to \p size. Throws IoError.
inline std::string file_sha256(std::string const& path, std::uint64_t& size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw moe::IoError(cat("cannot open '", path, "': ", std::strerror(errno)));
  Sha256 s;
  std::vector<char> buf(std::size_t{1} << 20);
  size = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    std::streamsize const got = in.gcount();
    if (got <= 0) break;
    s.update(buf.data(), static_cast<std::size_t>(got));
    size += static_cast<std::uint64_t>(got);
  }
  if (in.bad()) throw moe::IoError(cat("error while reading '", path, "'"));
  return s.hex_digest();
}

/// A fast 64-bit hash of a block's bytes, to check that copies of a block agree.
inline std::uint64_t block_hash(void const* data, std::size_t n) {
  auto const* p = static_cast<unsigned char const*>(data);
  std::uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  auto mix = [&](std::uint64_t v) {
    h ^= v;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t v;
    std::memcpy(&v, p + i, 8);
    mix(v);
  }
  std::uint64_t tail = 0;
  for (std::size_t k = 0; i < n; ++i, ++k) tail |= std::uint64_t(p[i]) << (8 * k);
  mix(tail);
  return h;
}

// ---- blocks ------------------------------------------------------------------------------------

/// One block as every rank sees it after the all-gather.
struct Desc {
  int rank = 0;
  std::size_t index = 0;  ///< position in that rank's block list
  std::string name;
  io::DType dtype = io::DType::F32;
  std::vector<std::int64_t> global, local, offset;
  std::uint64_t hash = 0;
  std::int64_t numel = 0;  ///< elements of the local block
};

inline std::string shape_str(std::vector<std::int64_t> const& s) {
  return io::detail::shape_str(s);
}

/// Checks one block of this rank; throws ConfigError. Fills the description (hash included when
/// \p with_hash).
inline Desc describe(BlockRef const& b, std::size_t i, int rank, bool with_hash) {
  std::string const what = cat("checkpoint: block ", i, " ('", b.name, "') of rank ", rank, ": ");
  Desc d;
  d.rank = rank;
  d.index = i;
  d.name = b.name;
  moe::detail::require<moe::ConfigError>(!b.name.empty(), what, "the tensor name is empty");
  moe::detail::require<moe::ConfigError>(b.name != "__metadata__", what,
                                         "the name \"__metadata__\" is reserved");
  moe::detail::require<moe::ConfigError>(io::detail::valid_utf8(b.name), what,
                                         "the name is not valid UTF-8");
  moe::detail::require<moe::ConfigError>(
      io::parse_dtype(b.dtype, d.dtype) && (d.dtype == io::DType::F32 || d.dtype == io::DType::F64),
      what, "dtype '", b.dtype, "' is not supported (use \"F32\" or \"F64\")");
  auto const& t = b.block;
  moe::detail::require<moe::ConfigError>(
      t.local_shape.size() == t.global_shape.size() && t.offset.size() == t.global_shape.size(),
      what, "global shape ", shape_str(t.global_shape), ", local shape ", shape_str(t.local_shape),
      " and offset ", shape_str(t.offset), " must have the same number of dimensions");
  for (std::size_t a = 0; a < t.global_shape.size(); ++a) {
    std::int64_t const g = t.global_shape[a], l = t.local_shape[a], o = t.offset[a];
    moe::detail::require<moe::ConfigError>(
        g >= 0 && l >= 0 && o >= 0 && l <= g && o <= g - l, what, "the block (offset ",
        shape_str(t.offset), ", shape ", shape_str(t.local_shape),
        ") does not lie within the global shape ", shape_str(t.global_shape), " (axis ", a, ")");
  }
  std::int64_t global_numel = 0;
  try {
    global_numel = io::detail::checked_numel(t.global_shape, "");
  } catch (moe::IoError const& e) {
    throw moe::ConfigError(cat(what, e.what()));
  }
  std::int64_t const esz = static_cast<std::int64_t>(io::dtype_size(d.dtype));
  moe::detail::require<moe::ConfigError>(global_numel <= INT64_MAX / esz, what,
                                         "the global tensor is too large");
  d.global = t.global_shape;
  d.local = t.local_shape;
  d.offset = t.offset;
  d.numel = io::detail::checked_numel(t.local_shape, "");
  moe::detail::require<moe::ConfigError>(d.numel == 0 || b.data != nullptr, what,
                                         "data is null but the block has ", d.numel, " elements");
  if (with_hash && d.numel > 0) {
    d.hash = block_hash(b.data, static_cast<std::size_t>(d.numel * esz));
  }
  return d;
}

inline std::size_t nbytes(Desc const& d) {
  return static_cast<std::size_t>(d.numel) * io::dtype_size(d.dtype);
}

class Writer {
 public:
  void i64(std::int64_t v) {
    char b[8];
    std::memcpy(b, &v, 8);
    s_.append(b, 8);
  }
  void str(std::string const& v) {
    i64(static_cast<std::int64_t>(v.size()));
    s_ += v;
  }
  void vec(std::vector<std::int64_t> const& v) {
    i64(static_cast<std::int64_t>(v.size()));
    for (std::int64_t x : v) i64(x);
  }
  std::string const& text() const { return s_; }

 private:
  std::string s_;
};

class Reader {
 public:
  explicit Reader(std::string const& s) : s_(s) {}
  std::int64_t i64() {
    need(8);
    std::int64_t v;
    std::memcpy(&v, s_.data() + pos_, 8);
    pos_ += 8;
    return v;
  }
  std::string str() {
    std::size_t const n = count();
    need(n);
    std::string v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  std::vector<std::int64_t> vec() {
    std::vector<std::int64_t> v(count());
    for (auto& x : v) x = i64();
    return v;
  }
  std::size_t count() {
    std::int64_t const n = i64();
    if (n < 0 || static_cast<std::uint64_t>(n) > s_.size()) fail();
    return static_cast<std::size_t>(n);
  }

 private:
  void need(std::size_t n) const {
    if (n > s_.size() - pos_) fail();
  }
  [[noreturn]] static void fail() { throw moe::Error("checkpoint: corrupt block description"); }
  std::string const& s_;
  std::size_t pos_ = 0;
};

inline std::string encode(std::vector<Desc> const& descs) {
  Writer w;
  w.i64(static_cast<std::int64_t>(descs.size()));
  for (Desc const& d : descs) {
    w.str(d.name);
    w.str(io::dtype_name(d.dtype));
    w.vec(d.global);
    w.vec(d.local);
    w.vec(d.offset);
    w.i64(static_cast<std::int64_t>(d.hash));
  }
  return w.text();
}

inline std::vector<std::vector<Desc>> decode(std::vector<std::string> const& texts) {
  std::vector<std::vector<Desc>> out(texts.size());
  for (std::size_t r = 0; r < texts.size(); ++r) {
    Reader rd(texts[r]);
    std::size_t const n = rd.count();
    for (std::size_t i = 0; i < n; ++i) {
      Desc d;
      d.rank = static_cast<int>(r);
      d.index = i;
      d.name = rd.str();
      io::parse_dtype(rd.str(), d.dtype);
      d.global = rd.vec();
      d.local = rd.vec();
      d.offset = rd.vec();
      d.hash = static_cast<std::uint64_t>(rd.i64());
      d.numel = io::detail::checked_numel(d.local, "");
      out[r].push_back(std::move(d));
    }
  }
  return out;
}

inline std::string encode_map(std::map<std::string, std::string> const& m) {
  Writer w;
  w.i64(static_cast<std::int64_t>(m.size()));
  for (auto const& kv : m) {
    w.str(kv.first);
    w.str(kv.second);
  }
  return w.text();
}

/// A readable, unambiguous text of a metadata map (for the agreement check).
inline std::string map_text(std::map<std::string, std::string> const& m) {
  std::string s = "{";
  for (auto const& kv : m) {
    if (s.size() > 1) s += ", ";
    io::detail::append_json_string(s, kv.first);
    s += ": ";
    io::detail::append_json_string(s, kv.second);
  }
  return s + "}";
}

inline std::map<std::string, std::string> decode_map(std::string const& s) {
  Reader rd(s);
  std::map<std::string, std::string> m;
  std::size_t const n = rd.count();
  for (std::size_t i = 0; i < n; ++i) {
    std::string k = rd.str();
    m[k] = rd.str();
  }
  return m;
}

/// The dtype and global shape of one tensor, agreed by every block of it.
struct TensorSpec {
  io::DType dtype = io::DType::F32;
  std::vector<std::int64_t> global;
  int rank = 0;  ///< first rank describing it (for messages)
};

/// Every tensor named by some block, checked for agreement; throws ConfigError (the same on every
/// rank, since every rank sees the same descriptions).
inline std::map<std::string, TensorSpec> tensor_specs(std::vector<std::vector<Desc>> const& all) {
  std::map<std::string, TensorSpec> specs;
  for (auto const& rank_descs : all) {
    for (Desc const& d : rank_descs) {
      auto it = specs.find(d.name);
      if (it == specs.end()) {
        specs.emplace(d.name, TensorSpec{d.dtype, d.global, d.rank});
        continue;
      }
      TensorSpec const& s = it->second;
      moe::detail::require<moe::ConfigError>(
          s.dtype == d.dtype && s.global == d.global, "checkpoint: tensor '", d.name, "' is ",
          io::dtype_name(s.dtype), " ", shape_str(s.global), " on rank ", s.rank, " but ",
          io::dtype_name(d.dtype), " ", shape_str(d.global), " on rank ", d.rank,
          "; every block of a tensor must give the same dtype and global shape");
    }
  }
  return specs;
}

/// One distinct block of a tensor to save, and the rank that sends it (the lowest holding it).
struct Piece {
  Desc const* owner = nullptr;
};

struct TensorPlan {
  TensorSpec spec;
  std::vector<Piece> pieces;  ///< disjoint, covering the tensor
};

/// The save plan: for each tensor (sorted by name) the distinct non-empty blocks and their
/// owners. Throws ConfigError on partial overlaps, gaps and copies that differ.
inline std::map<std::string, TensorPlan> save_plan(std::vector<std::vector<Desc>> const& all) {
  std::map<std::string, TensorPlan> plan;
  for (auto& kv : tensor_specs(all)) plan[kv.first].spec = kv.second;
  for (auto const& rank_descs : all) {
    for (Desc const& d : rank_descs) {
      if (d.numel == 0) continue;
      TensorPlan& tp = plan[d.name];
      bool same = false;
      for (Piece const& p : tp.pieces) {
        Desc const& o = *p.owner;
        if (o.offset == d.offset && o.local == d.local) {
          moe::detail::require<moe::ConfigError>(
              o.hash == d.hash, "checkpoint: tensor '", d.name, "': the copies of the block at ",
              "offset ", shape_str(d.offset), " shape ", shape_str(d.local), " on rank ", o.rank,
              " and rank ", d.rank, " differ; copies of a block must be identical");
          same = true;
          break;
        }
        bool overlap = true;
        for (std::size_t a = 0; a < d.offset.size(); ++a) {
          overlap = overlap && d.offset[a] < o.offset[a] + o.local[a] &&
                    o.offset[a] < d.offset[a] + d.local[a];
        }
        moe::detail::require<moe::ConfigError>(
            !overlap, "checkpoint: tensor '", d.name, "': the block at offset ",
            shape_str(o.offset), " shape ", shape_str(o.local), " (rank ", o.rank,
            ") and the block at offset ", shape_str(d.offset), " shape ", shape_str(d.local),
            " (rank ", d.rank, ") overlap partially; blocks must be identical or disjoint");
      }
      if (!same) tp.pieces.push_back(Piece{&d});
    }
  }
  for (auto const& kv : plan) {
    std::int64_t covered = 0;
    for (Piece const& p : kv.second.pieces) covered += p.owner->numel;
    std::int64_t const total = io::detail::checked_numel(kv.second.spec.global, "");
    moe::detail::require<moe::ConfigError>(
        covered == total, "checkpoint: tensor '", kv.first, "' ", shape_str(kv.second.spec.global),
        ": the ranks' blocks cover ", covered, " of its ", total,
        " elements; every element must be held by at least one rank");
  }
  return plan;
}

/// Copies between a row-major global tensor and a row-major block of it (at \p offset).
inline void copy_box(unsigned char* global, std::vector<std::int64_t> const& gshape,
                     unsigned char* local, std::vector<std::int64_t> const& lshape,
                     std::vector<std::int64_t> const& offset, std::size_t esz, bool to_global) {
  std::size_t const n = gshape.size();
  auto copy = [to_global](unsigned char* g, unsigned char* l, std::size_t bytes) {
    if (to_global) {
      std::memcpy(g, l, bytes);
    } else {
      std::memcpy(l, g, bytes);
    }
  };
  if (n == 0) {
    copy(global, local, esz);
    return;
  }
  for (std::int64_t l : lshape) {
    if (l == 0) return;
  }
  std::vector<std::int64_t> stride(n, 1);
  for (std::size_t a = n - 1; a > 0; --a) stride[a - 1] = stride[a] * gshape[a];
  std::size_t const row = static_cast<std::size_t>(lshape[n - 1]) * esz;
  std::vector<std::int64_t> idx(n, 0);  // idx[n-1] stays 0
  unsigned char* l = local;
  while (true) {
    std::int64_t g = 0;
    for (std::size_t a = 0; a < n; ++a) g += (offset[a] + idx[a]) * stride[a];
    copy(global + static_cast<std::size_t>(g) * esz, l, row);
    l += row;
    std::size_t a = n - 1;
    while (a > 0) {
      --a;
      if (++idx[a] < lshape[a]) break;
      idx[a] = 0;
      if (a == 0) return;
    }
    if (n == 1) return;
  }
}

/// Converts elements between host and little-endian order (a no-op on little-endian hosts).
inline void swap_to_le(unsigned char* p, std::size_t bytes, std::size_t esz) {
  if (io::detail::host_is_little_endian()) return;
  for (std::size_t i = 0; i + esz <= bytes; i += esz) std::reverse(p + i, p + i + esz);
}

// ---- MPI helpers -------------------------------------------------------------------------------

inline void check(int rc, char const* call) { moe::comm::detail::check_mpi(rc, call); }

inline std::vector<std::string> all_gather_strings(moe::comm::Communicator const& comm,
                                                   std::string const& mine) {
  int const P = comm.size();
  std::int64_t const len = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lens(static_cast<std::size_t>(P));
  check(MPI_Allgather(&len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, comm.get()),
        "MPI_Allgather");
  std::int64_t total = 0;
  for (std::int64_t l : lens) total += l;
  if (total > INT_MAX) {  // the same decision on every rank
    throw moe::ConfigError("checkpoint: the block descriptions exceed 2 GiB");
  }
  std::vector<int> counts(static_cast<std::size_t>(P)), displs(static_cast<std::size_t>(P));
  for (int r = 0, at = 0; r < P; ++r) {
    counts[r] = static_cast<int>(lens[r]);
    displs[r] = at;
    at += counts[r];
  }
  std::string buf(static_cast<std::size_t>(total), '\0');
  check(MPI_Allgatherv(mine.data(), static_cast<int>(len), MPI_CHAR, &buf[0], counts.data(),
                       displs.data(), MPI_CHAR, comm.get()),
        "MPI_Allgatherv");
  std::vector<std::string> out(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) out[r] = buf.substr(displs[r], counts[r]);
  return out;
}

inline void bcast_bytes(moe::comm::Communicator const& comm, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  for (std::size_t done = 0; done < n;) {
    std::size_t const k = std::min(piece_bytes(), n - done);
    check(MPI_Bcast(c + done, static_cast<int>(k), MPI_BYTE, 0, comm.get()), "MPI_Bcast");
    done += k;
  }
}

/// Collective: rank 0's string on every rank (any length).
inline std::string bcast_string(moe::comm::Communicator const& comm, std::string s) {
  std::int64_t len = static_cast<std::int64_t>(s.size());
  check(MPI_Bcast(&len, 1, MPI_INT64_T, 0, comm.get()), "MPI_Bcast");
  s.resize(static_cast<std::size_t>(len));
  if (len > 0) bcast_bytes(comm, &s[0], s.size());
  return s;
}

inline void send_bytes(moe::comm::Communicator const& comm, int dest, void const* p,
                       std::size_t n) {
  auto const* c = static_cast<char const*>(p);
  for (std::size_t done = 0; done < n;) {
    std::size_t const k = std::min(piece_bytes(), n - done);
    check(MPI_Send(c + done, static_cast<int>(k), MPI_BYTE, dest, kTag, comm.get()), "MPI_Send");
    done += k;
  }
}

inline void recv_bytes(moe::comm::Communicator const& comm, int src, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  for (std::size_t done = 0; done < n;) {
    std::size_t const k = std::min(piece_bytes(), n - done);
    check(
        MPI_Recv(c + done, static_cast<int>(k), MPI_BYTE, src, kTag, comm.get(), MPI_STATUS_IGNORE),
        "MPI_Recv");
    done += k;
  }
}

// ---- files -------------------------------------------------------------------------------------

inline void crash_point(char const* name) {
  char const* want = std::getenv("MOE_CHECKPOINT_TEST_CRASH");
  if (want && std::strcmp(want, name) == 0) ::_exit(86);
}

inline std::string step_name(std::int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

inline std::string join(std::string const& dir, std::string const& name) {
  return (fs::path(dir) / name).string();
}

/// fsync of a directory; file systems that cannot sync directories are not an error.
inline void sync_dir(std::string const& dir) {
  int const fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  int const rc = ::fsync(fd);
  int const e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL && e != ENOTSUP) {
    throw moe::IoError(
        cat("checkpoint: fsync of the directory '", dir, "' failed: ", std::strerror(e)));
  }
}

/// "step_<digits>" directories of \p dir, newest first. Throws IoError if \p dir cannot be listed.
inline std::vector<std::pair<std::int64_t, std::string>> list_steps(std::string const& dir) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  if (ec) {
    throw moe::IoError(
        cat("checkpoint: cannot list the checkpoint directory '", dir, "': ", ec.message()));
  }
  for (; it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    std::error_code dec;
    if (!it->is_directory(dec)) continue;
    out.emplace_back(std::stoll(name.substr(5)), it->path().string());
  }
  if (ec) {
    throw moe::IoError(
        cat("checkpoint: cannot list the checkpoint directory '", dir, "': ", ec.message()));
  }
  std::sort(out.begin(), out.end(), [](auto const& a, auto const& b) {
    return a.first != b.first ? a.first > b.first : a.second > b.second;
  });
  return out;
}

struct IndexEntry {
  std::string name;
  io::DType dtype = io::DType::F32;
  std::vector<std::int64_t> shape;
};

struct Index {
  std::int64_t step = 0;
  std::string file;
  std::int64_t bytes = 0;
  std::string sha256;
  std::vector<IndexEntry> tensors;
};

inline std::string index_text(std::int64_t step, std::uint64_t bytes, std::string const& sha,
                              io::File const& file) {
  std::string s = cat("{\n  \"format\": \"moe-checkpoint\",\n  \"version\": 1,\n  \"step\": ", step,
                      ",\n  \"file\": \"", kModelFile, "\",\n  \"bytes\": ", bytes,
                      ",\n  \"sha256\": \"", sha, "\",\n  \"tensors\": [");
  bool first = true;
  for (auto const& kv : file.tensors()) {
    s += first ? "\n    {\"name\": " : ",\n    {\"name\": ";
    first = false;
    io::detail::append_json_string(s, kv.first);
    s += cat(", \"dtype\": \"", io::dtype_name(kv.second.dtype),
             "\", \"shape\": ", shape_str(kv.second.shape), "}");
  }
  s += first ? "]\n}\n" : "\n  ]\n}\n";
  return s;
}

/// Reads and checks "<step dir>/index.json"; throws IoError with the reason.
inline Index read_index(std::string const& step_dir) {
  using io::detail::JsonValue;
  std::string const path = join(step_dir, kIndexFile);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw moe::IoError(cat("no readable ", kIndexFile, " (", std::strerror(errno),
                           "): the checkpoint is incomplete"));
  }
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  JsonValue const root = io::detail::JsonParser(text, cat(kIndexFile, ": ")).parse_document();
  auto member = [&](JsonValue const& obj, char const* key,
                    JsonValue::Kind kind) -> JsonValue const& {
    for (std::size_t i = 0; i < obj.keys.size(); ++i) {
      if (obj.keys[i] == key && obj.items[i].kind == kind) return obj.items[i];
    }
    throw moe::IoError(cat(kIndexFile, " has no \"", key, "\" of the right type"));
  };
  auto integer = [&](JsonValue const& v, char const* what) {
    std::int64_t x = 0;
    if (!io::detail::json_to_int64(v, x) || x < 0)
      throw moe::IoError(cat(kIndexFile, ": \"", what, "\" is not a non-negative integer"));
    return x;
  };
  if (root.kind != JsonValue::Kind::Object)
    throw moe::IoError(cat(kIndexFile, " is not an object"));
  if (member(root, "format", JsonValue::Kind::String).text != "moe-checkpoint" ||
      integer(member(root, "version", JsonValue::Kind::Number), "version") != 1) {
    throw moe::IoError(cat(kIndexFile, " is not a version 1 moe-checkpoint index"));
  }
  Index ix;
  ix.step = integer(member(root, "step", JsonValue::Kind::Number), "step");
  ix.file = member(root, "file", JsonValue::Kind::String).text;
  ix.bytes = integer(member(root, "bytes", JsonValue::Kind::Number), "bytes");
  ix.sha256 = member(root, "sha256", JsonValue::Kind::String).text;
  for (JsonValue const& t : member(root, "tensors", JsonValue::Kind::Array).items) {
    if (t.kind != JsonValue::Kind::Object)
      throw moe::IoError(cat(kIndexFile, ": bad tensor entry"));
    IndexEntry e;
    e.name = member(t, "name", JsonValue::Kind::String).text;
    if (!io::parse_dtype(member(t, "dtype", JsonValue::Kind::String).text, e.dtype))
      throw moe::IoError(cat(kIndexFile, ": tensor '", e.name, "' has an unknown dtype"));
    for (JsonValue const& d : member(t, "shape", JsonValue::Kind::Array).items)
      e.shape.push_back(integer(d, "shape"));
    ix.tensors.push_back(std::move(e));
  }
  return ix;
}

/// Verifies the checkpoint in \p step_dir (named for step \p step) against the requested tensors;
/// returns its model file or throws IoError with the reason it is unusable.
inline io::File verify(std::string const& step_dir, std::int64_t step,
                       std::map<std::string, TensorSpec> const& requested) {
  Index const ix = read_index(step_dir);
  if (ix.step != step) {
    throw moe::IoError(
        cat(kIndexFile, " is for step ", ix.step, " but the directory is for step ", step));
  }
  if (ix.file != kModelFile)
    throw moe::IoError(cat(kIndexFile, " names the file '", ix.file, "', not '", kModelFile, "'"));
  std::string const model = join(step_dir, kModelFile);
  struct stat st {};
  if (::stat(model.c_str(), &st) != 0)
    throw moe::IoError(cat("cannot stat ", kModelFile, ": ", std::strerror(errno)));
  if (static_cast<std::int64_t>(st.st_size) != ix.bytes) {
    throw moe::IoError(cat(kModelFile, " is ", st.st_size, " bytes but ", kIndexFile, " records ",
                           ix.bytes, " (truncated or replaced)"));
  }
  std::uint64_t size = 0;
  std::string const sha = file_sha256(model, size);
  if (sha != ix.sha256) {
    throw moe::IoError(cat("checksum mismatch: ", kModelFile, " has SHA-256 ", sha, " but ",
                           kIndexFile, " records ", ix.sha256, " (corrupted)"));
  }
  io::File file = io::File::read(model);
  bool same = ix.tensors.size() == file.size();
  for (IndexEntry const& e : ix.tensors) {
    same = same && file.has(e.name) && file.at(e.name).dtype == e.dtype &&
           file.at(e.name).shape == e.shape;
  }
  if (!same) throw moe::IoError(cat(kIndexFile, " and ", kModelFile, " list different tensors"));
  for (auto const& kv : requested) {
    if (!file.has(kv.first)) {
      throw moe::IoError(
          cat("it has no tensor '", kv.first, "' (requested by rank ", kv.second.rank, ")"));
    }
    io::Tensor const& t = file.at(kv.first);
    if (t.dtype != kv.second.dtype || t.shape != kv.second.global) {
      throw moe::IoError(cat("tensor '", kv.first, "' is ", io::dtype_name(t.dtype), " ",
                             shape_str(t.shape), " but ", io::dtype_name(kv.second.dtype), " ",
                             shape_str(kv.second.global), " was requested"));
    }
  }
  return file;
}

inline void warn(std::string const& msg) { std::cerr << ("checkpoint: warning: " + msg + "\n"); }

/// Removes leftovers of interrupted saves (".tmp_step_*", ".trash_step_*").
inline void remove_leftovers(std::string const& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    if (name.rfind(".tmp_step_", 0) == 0 || name.rfind(".trash_step_", 0) == 0)
      stale.push_back(it->path());
  }
  for (fs::path const& p : stale) {
    std::error_code rec;
    fs::remove_all(p, rec);
    if (rec) warn(cat("cannot remove '", p.string(), "': ", rec.message()));
  }
}

/// Renames the complete temporary directory \p tmp to \p final_dir (replacing an existing one).
inline void install(std::string const& dir, std::string const& tmp, std::string const& final_dir) {
  struct stat st {};
  if (::lstat(final_dir.c_str(), &st) != 0) {
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
      throw moe::IoError(cat("checkpoint: cannot rename '", tmp, "' to '", final_dir,
                             "': ", std::strerror(errno)));
    }
    sync_dir(dir);
    return;
  }
  std::string old = tmp;  // where the replaced checkpoint ends up
  bool exchanged = false;
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    exchanged = true;
  } else if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    throw moe::IoError(cat("checkpoint: cannot exchange '", tmp, "' and '", final_dir,
                           "': ", std::strerror(errno)));
  }
#endif
  if (!exchanged) {
    old = join(dir, cat(".trash_", fs::path(final_dir).filename().string(), ".",
                        static_cast<long>(::getpid())));
    if (::rename(final_dir.c_str(), old.c_str()) != 0) {
      throw moe::IoError(
          cat("checkpoint: cannot move '", final_dir, "' aside: ", std::strerror(errno)));
    }
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
      int const e = errno;
      ::rename(old.c_str(), final_dir.c_str());  // put the old one back
      throw moe::IoError(
          cat("checkpoint: cannot rename '", tmp, "' to '", final_dir, "': ", std::strerror(e)));
    }
  }
  sync_dir(dir);
  std::error_code ec;
  fs::remove_all(old, ec);
  if (ec) warn(cat("cannot remove the replaced checkpoint '", old, "': ", ec.message()));
}

/// Keeps the checkpoint of \p step and the keep - 1 newest complete ones before it.
inline void retain(std::string const& dir, std::int64_t step, int keep) {
  std::vector<std::pair<std::int64_t, std::string>> steps;
  try {
    steps = list_steps(dir);
  } catch (moe::IoError const& e) {
    warn(e.what());
    return;
  }
  int kept = 1;  // the new checkpoint
  for (auto const& [s, path] : steps) {
    if (s >= step) continue;
    try {
      if (read_index(path).step != s) continue;
    } catch (std::exception const&) {
      continue;  // incomplete: not counted, not deleted
    }
    if (kept < keep) {
      ++kept;
      continue;
    }
    std::string const trash = join(dir, cat(".trash_", fs::path(path).filename().string(), ".",
                                            static_cast<long>(::getpid())));
    if (::rename(path.c_str(), trash.c_str()) != 0) {
      warn(cat("cannot remove the old checkpoint '", path, "': ", std::strerror(errno)));
      continue;
    }
    crash_point("retention");
    std::error_code ec;
    fs::remove_all(trash, ec);
    if (ec) warn(cat("cannot remove '", trash, "': ", ec.message()));
  }
  try {
    sync_dir(dir);
  } catch (moe::IoError const& e) {
    warn(e.what());
  }
}

// ---- one writer per directory ------------------------------------------------------------------

inline constexpr char const* kLockFile = "LOCK";

/// Seconds a lock held by another process is waited for before giving up: a job killed a moment
/// ago may not have released it yet. A test hook (only rank 0 reads it).
inline double& lock_wait_seconds() {
  static double seconds = 2.0;
  return seconds;
}

/// Creates \p dir and its parents when missing (fsyncing the parent of a new one). Throws IoError.
inline void make_dir(std::string const& dir) {
  std::error_code ec;
  bool const created = fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec)) {
    throw moe::IoError(cat("checkpoint: cannot create the checkpoint directory '", dir,
                           "': ", ec ? ec.message() : std::string("not a directory")));
  }
  if (created) sync_dir(fs::absolute(dir, ec).parent_path().string());
}

/// A directory, by device and inode (whatever path names it).
using DirKey = std::pair<std::uint64_t, std::uint64_t>;

inline DirKey dir_key(std::string const& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    throw moe::IoError(cat("checkpoint: cannot stat the checkpoint directory '", dir,
                           "': ", std::strerror(errno)));
  }
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

/// A lock this process holds: the process (a forked child inherits the table, not the lock) and
/// the path it was taken under.
struct HeldLock {
  long pid = 0;
  std::string dir;
};

/// The directories whose lock this process holds (fcntl locks belong to the process: a second
/// F_SETLK of the same process succeeds silently, so the table is what detects it).
inline std::map<DirKey, HeldLock>& held_locks() {
  static std::map<DirKey, HeldLock> table;
  return table;
}
inline std::mutex& held_locks_mutex() {
  static std::mutex m;
  return m;
}

/// Whether this process holds the lock of \p dir (an existing directory).
inline bool holds_lock(std::string const& dir) {
  DirKey const key = dir_key(dir);
  std::lock_guard<std::mutex> const guard(held_locks_mutex());
  auto const it = held_locks().find(key);
  return it != held_locks().end() && it->second.pid == static_cast<long>(::getpid());
}

/// Who this process is, as written into LOCK: "key=value" lines.
inline std::string holder_identity() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  std::time_t const now = std::time(nullptr);
  std::tm utc{};
  char since[32] = "?";
  if (::gmtime_r(&now, &utc)) std::strftime(since, sizeof(since), "%Y-%m-%dT%H:%M:%SZ", &utc);
  std::string text =
      cat("hostname=", host, "\npid=", static_cast<long>(::getpid()), "\nsince=", since, "\n");
  for (char const* var : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "JOB_ID"}) {
    if (char const* v = std::getenv(var)) {
      text += cat("job=", var, "=", v, "\n");
      break;
    }
  }
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!cmd.empty() && cmd.back() == '\0') cmd.pop_back();
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  if (cmd.size() > 400) cmd = cmd.substr(0, 400) + "...";
  if (!cmd.empty()) text += cat("command=", cmd, "\n");
  return text;
}

/// The holder named by the text of LOCK, on one line ("hostname=h, pid=1, since=..., ...").
inline std::string describe_holder(std::string const& text, long lock_pid) {
  std::string out;
  std::size_t at = 0;
  while (at < text.size() && out.size() < 1000) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    at = end + 1;
    for (char& c : line) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
    if (!line.empty()) out += (out.empty() ? "" : ", ") + line;
  }
  if (!out.empty()) return out;
  if (lock_pid > 0) return cat("pid=", lock_pid, " per the lock; it has not written its name yet");
  return "unknown: LOCK names no holder";
}

/// \brief The exclusive lock of a checkpoint directory, held by this process (rank-local).
///
/// An fcntl (POSIX record) write lock on all of "<dir>/LOCK", whose text names the holder. The
/// kernel drops the lock when the process ends, however it ends (SIGKILL included), so a dead
/// job never leaves a stale lock; the text of an unlocked LOCK means nothing. fcntl locks belong
/// to the process and closing *any* descriptor of the file drops them: LOCK is opened nowhere
/// else, and a table of the directories locked by this process makes a second lock of the same
/// directory (by any path) an error instead of a silent success. Never delete LOCK while a job
/// runs: a new LOCK is another file, which a second job could lock.
class DirLock {
 public:
  DirLock() = default;

  /// Locks the existing directory \p dir, waiting up to lock_wait_seconds() for another holder.
  /// \throws moe::IoError when another process holds it (the message names the holder) or LOCK
  ///         cannot be opened; moe::ConfigError when this process already holds it
  explicit DirLock(std::string const& dir) {
    DirKey const key = dir_key(dir);
    long const self = static_cast<long>(::getpid());
    std::lock_guard<std::mutex> const guard(held_locks_mutex());
    auto const it = held_locks().find(key);
    if (it != held_locks().end() && it->second.pid == self) {
      throw moe::ConfigError(cat("checkpoint_dir '", dir,
                                 "' is already locked by this process (pid=", self, ", as '",
                                 it->second.dir,
                                 "'): one writer per checkpoint directory; release that lock "
                                 "first, or use another checkpoint_dir"));
    }
    std::string const path = join(dir, kLockFile);
    std::string const identity = holder_identity();
    int const fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw moe::IoError(
          cat("checkpoint: cannot open the lock file '", path, "': ", std::strerror(errno)));
    }
    auto const deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(std::max(0.0, lock_wait_seconds()));
    bool locked = false;
    for (;;) {
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      fl.l_start = 0;
      fl.l_len = 0;  // the whole file
      if (::fcntl(fd, F_SETLK, &fl) == 0) {
        locked = true;
        break;
      }
      int const e = errno;
      if (e == EINTR) continue;
      if (e != EACCES && e != EAGAIN) {
        // ENOLCK, EOPNOTSUPP, ...: the file system keeps no locks. Not fatal (checkpoints still
        // work), but nothing keeps a second job out; said once per directory and process.
        static std::set<DirKey> warned;
        if (warned.insert(key).second) {
          warn(cat("cannot lock '", path, "' (", std::strerror(e), "): this file system keeps no ",
                   "fcntl locks, so nothing stops another job from writing into '", dir, "'"));
        }
        break;
      }
      if (std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      // Held by another process: read who (the same descriptor; this process holds no lock on
      // the file, so closing it drops nothing).
      std::string text(4096, '\0');
      ssize_t const got = ::pread(fd, &text[0], text.size(), 0);
      text.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
      struct flock probe {};
      probe.l_type = F_WRLCK;
      probe.l_whence = SEEK_SET;
      long lock_pid = 0;
      if (::fcntl(fd, F_GETLK, &probe) == 0 && probe.l_type != F_UNLCK)
        lock_pid = static_cast<long>(probe.l_pid);
      ::close(fd);
      throw moe::IoError(cat("checkpoint_dir '", dir, "' is in use by another job (",
                             describe_holder(text, lock_pid),
                             "); two jobs must not share a checkpoint directory: wait for it to "
                             "finish, or set checkpoint_dir to another directory"));
    }
    if (locked) {
      ssize_t const size = static_cast<ssize_t>(identity.size());
      bool const written =
          ::ftruncate(fd, 0) == 0 && ::pwrite(fd, identity.data(), identity.size(), 0) == size;
      if (!written) warn(cat("cannot write the holder into '", path, "': ", std::strerror(errno)));
    }
    held_locks()[key] = HeldLock{self, dir};
    fd_ = fd;
    locked_ = locked;
    pid_ = self;
    key_ = key;
  }

  DirLock(DirLock&& o) noexcept { swap(o); }
  DirLock& operator=(DirLock&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  DirLock(DirLock const&) = delete;
  DirLock& operator=(DirLock const&) = delete;
  ~DirLock() { release(); }

  /// Whether this object holds a lock (false once released or moved from).
  bool held() const { return fd_ >= 0; }

  /// Unlocks (LOCK is emptied first, so that it names nobody, and stays).
  void release() noexcept {
    if (fd_ < 0) return;
    if (pid_ == static_cast<long>(::getpid())) {  // not in a forked child, which holds nothing
      {
        std::lock_guard<std::mutex> const guard(held_locks_mutex());
        auto const it = held_locks().find(key_);
        if (it != held_locks().end() && it->second.pid == pid_) held_locks().erase(it);
      }
      if (locked_ && ::ftruncate(fd_, 0) != 0) {
        // the lock goes anyway; the text of an unlocked LOCK means nothing
      }
    }
    ::close(fd_);
    fd_ = -1;
  }

 private:
  void swap(DirLock& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(locked_, o.locked_);
    std::swap(pid_, o.pid_);
    std::swap(key_, o.key_);
  }

  int fd_ = -1;
  bool locked_ = false;  ///< false where the file system keeps no locks (see the warning)
  long pid_ = 0;
  DirKey key_{};
};

}  // namespace ckpt_detail

/// \brief One writer per checkpoint directory: the exclusive lock a job takes on the directory it
/// will save into, held for as long as the object lives (normally the job's lifetime).
///
/// Collective. Creates the directory when missing (as save_checkpoint does), then rank 0 takes an
/// fcntl write lock on "<dir>/LOCK" and writes its identity into it (hostname, pid, start time in
/// UTC, the batch job id when SLURM_JOB_ID, PBS_JOBID, LSB_JOBID, FLUX_JOB_ID or JOB_ID is set,
/// and the command line). When another process holds it (after a grace of
/// ckpt_detail::lock_wait_seconds(), 2 s, for a job killed a moment ago), every rank throws the
/// same moe::IoError, "checkpoint_dir '<dir>' is in use by another job (hostname=..., pid=...,
/// since=..., command=...); two jobs must not share a checkpoint directory: ...", before the job
/// has read or written anything there; when this process already holds it (by any path),
/// moe::ConfigError. The kernel releases the lock when the holding process ends, however it ends,
/// so a job killed with SIGKILL leaves no stale lock; a normal end (or release()) also empties
/// LOCK. The file LOCK stays in the directory; never delete it while a job runs.
///
/// Who takes it: a job that will save into the directory, before it resumes from it (train_moe
/// does, when enable_checkpointing is set), so that it never loads a checkpoint another job is
/// rotating away, and a second job fails within seconds. save_checkpoint also takes the lock for
/// the time of one save when this process does not hold it already, so savers that never took it
/// still cannot write at the same time (but only a lock held for the whole job keeps another job
/// from pruning the checkpoints between saves). load_latest_checkpoint takes no lock: a read-only
/// use (inspecting a directory, resharding into another one) may read a directory a job is
/// writing; it never sees a partial checkpoint, but the writer's retention may remove the one it is
/// reading (it is then skipped with a message, or the load fails).
///
/// fcntl locks depend on the file system: local file systems and NFS (v4, or v3 with lockd) keep
/// them across hosts; where the file system keeps none (some FUSE or Lustre mounts without
/// flock), the lock cannot be taken and a warning on stderr says so, and nothing stops a second
/// job. A lock is per process: a forked child does not inherit it.
class CheckpointDirLock {
 public:
  /// Holds nothing.
  CheckpointDirLock() = default;

  /// Collective: locks \p dir (the same on every rank) for this job. Throws the same moe::IoError
  /// or moe::ConfigError on every rank (see the class comment).
  CheckpointDirLock(moe::comm::Communicator const& comm, std::string const& dir) : dir_(dir) {
    moe::comm::collective_guard(comm, [&] {
      moe::detail::require<moe::ConfigError>(!dir.empty(),
                                             "checkpoint: the checkpoint directory is empty");
    });
    moe::comm::check_agreement(comm, "checkpoint directory", dir);
    moe::comm::collective_guard(comm, [&] {
      if (comm.rank() != 0) return;
      ckpt_detail::make_dir(dir);
      lock_ = ckpt_detail::DirLock(dir);
    });
  }

  /// The directory (empty when default-constructed).
  std::string const& dir() const { return dir_; }

  /// Whether this rank holds the lock: true on rank 0 of a locked directory, false elsewhere.
  bool held() const { return lock_.held(); }

  /// Releases the lock (not collective); the destructor does it too.
  void release() noexcept { lock_.release(); }

 private:
  std::string dir_;
  ckpt_detail::DirLock lock_;
};

/// \brief Collective. Saves step \p step into \p dir (see the file comment for the format and the
/// guarantees) and keeps the last \p keep complete checkpoints.
/// \param blocks this rank's blocks; together the ranks' blocks must cover every tensor, and
///        copies of a block must be identical
/// \param metadata stored in the file; must be the same on every rank
/// \param keep number of complete checkpoints kept (>= 1), the new one included
/// \throws moe::ConfigError (bad arguments or blocks), moe::IoError (file system), the same on
///         every rank
inline void save_checkpoint(moe::comm::Communicator const& comm, std::string const& dir,
                            std::int64_t step, std::vector<BlockRef> const& blocks,
                            std::map<std::string, std::string> const& metadata, int keep) {
  namespace cd = ckpt_detail;
  namespace fs = std::filesystem;
  namespace io = moe::io;
  using moe::detail::cat;
  using moe::detail::require;
  std::string mine;
  moe::comm::collective_guard(comm, [&] {
    require<moe::ConfigError>(!dir.empty(), "checkpoint: the checkpoint directory is empty");
    require<moe::ConfigError>(step >= 0, "checkpoint: step ", step, " is negative");
    require<moe::ConfigError>(keep >= 1, "checkpoint: keep = ", keep,
                              "; at least the new checkpoint must be kept (keep >= 1)");
    for (auto const& kv : metadata) {
      require<moe::ConfigError>(
          io::detail::valid_utf8(kv.first) && io::detail::valid_utf8(kv.second),
          "checkpoint: metadata key '", kv.first, "' or its value is not valid UTF-8");
    }
    std::vector<cd::Desc> descs;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      descs.push_back(cd::describe(blocks[i], i, comm.rank(), true));
    mine = cd::encode(descs);
  });
  moe::comm::check_agreement(comm, "checkpoint directory, step and keep",
                             cat(dir, "\n", step, "\n", keep));
  moe::comm::check_agreement(comm, "checkpoint metadata", cd::map_text(metadata));
  std::vector<std::vector<cd::Desc>> const all = cd::decode(cd::all_gather_strings(comm, mine));
  std::map<std::string, cd::TensorPlan> plan;
  moe::comm::collective_guard(comm, [&] { plan = cd::save_plan(all); });

  // Rank 0: the directory, the temporary directory and the global tensors.
  bool const root = comm.rank() == 0;
  std::string const tmp =
      cd::join(dir, cat(".tmp_", cd::step_name(step), ".", static_cast<long>(::getpid())));
  std::map<std::string, io::Tensor> tensors;
  cd::DirLock save_lock;  // for this save, when this process does not hold the lock already
  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    cd::make_dir(dir);
    if (!cd::holds_lock(dir)) save_lock = cd::DirLock(dir);
    cd::remove_leftovers(dir);
    if (::mkdir(tmp.c_str(), 0777) != 0) {
      throw moe::IoError(cat("checkpoint: cannot create '", tmp,
                             "' in the checkpoint directory: ", std::strerror(errno)));
    }
    try {
      for (auto const& kv : plan) {
        io::Tensor& t = tensors[kv.first];
        t.dtype = kv.second.spec.dtype;
        t.shape = kv.second.spec.global;
        t.bytes.resize(static_cast<std::size_t>(io::detail::checked_numel(t.shape, "")) *
                       io::dtype_size(t.dtype));
      }
    } catch (...) {
      tensors.clear();
      ::rmdir(tmp.c_str());
      throw;
    }
  });

  // Every distinct block travels from its owner to rank 0, in plan order.
  std::vector<unsigned char> buf;
  for (auto const& kv : plan) {
    for (cd::Piece const& p : kv.second.pieces) {
      cd::Desc const& d = *p.owner;
      std::size_t const esz = io::dtype_size(d.dtype);
      void* const data = d.rank == comm.rank() ? blocks[d.index].data : nullptr;
      if (root) {
        auto* src = static_cast<unsigned char*>(data);
        if (d.rank != 0) {
          buf.resize(cd::nbytes(d));
          cd::recv_bytes(comm, d.rank, buf.data(), buf.size());
          src = buf.data();
        }
        cd::copy_box(tensors[kv.first].bytes.data(), d.global, src, d.local, d.offset, esz, true);
      } else if (d.rank == comm.rank()) {
        cd::send_bytes(comm, 0, data, cd::nbytes(d));
      }
    }
  }
  buf = std::vector<unsigned char>();

  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    try {
      io::File file;
      file.metadata = metadata;
      for (auto& kv : tensors) {
        cd::swap_to_le(kv.second.bytes.data(), kv.second.bytes.size(),
                       io::dtype_size(kv.second.dtype));
        file.set(kv.first, std::move(kv.second));
      }
      tensors.clear();
      std::string const model = cd::join(tmp, cd::kModelFile);
      file.write(model);
      cd::crash_point("model_written");
      std::uint64_t size = 0;
      std::string const sha = cd::file_sha256(model, size);
      io::write_atomic(cd::join(tmp, cd::kIndexFile), cd::index_text(step, size, sha, file));
      cd::crash_point("index_written");
      cd::install(dir, tmp, cd::join(dir, cd::step_name(step)));
      cd::crash_point("installed");
    } catch (...) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      throw;
    }
    cd::retain(dir, step, keep);
  });
}

/// \brief Collective. Loads the newest complete, verified checkpoint of \p dir into \p blocks
/// (any blocking: the checkpoint holds global tensors) and sets \p metadata and \p step.
/// \return false on every rank, with metadata and step unchanged, when there is none
/// \throws moe::ConfigError (bad blocks, ranks disagreeing on a tensor), moe::IoError (the
///         directory cannot be listed), the same on every rank
inline bool load_latest_checkpoint(moe::comm::Communicator const& comm, std::string const& dir,
                                   std::vector<BlockRef> const& blocks,
                                   std::map<std::string, std::string>& metadata,
                                   std::int64_t& step) {
  namespace cd = ckpt_detail;
  namespace fs = std::filesystem;
  namespace io = moe::io;
  using moe::detail::cat;
  std::string mine;
  moe::comm::collective_guard(comm, [&] {
    moe::detail::require<moe::ConfigError>(!dir.empty(),
                                           "checkpoint: the checkpoint directory is empty");
    std::vector<cd::Desc> descs;
    for (std::size_t i = 0; i < blocks.size(); ++i)
      descs.push_back(cd::describe(blocks[i], i, comm.rank(), false));
    mine = cd::encode(descs);
  });
  moe::comm::check_agreement(comm, "checkpoint directory", dir);
  std::vector<std::vector<cd::Desc>> const all = cd::decode(cd::all_gather_strings(comm, mine));
  std::map<std::string, cd::TensorSpec> specs;
  moe::comm::collective_guard(comm, [&] { specs = cd::tensor_specs(all); });

  bool const root = comm.rank() == 0;
  io::File file;
  std::int64_t found[2] = {0, 0};  // found, step
  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    std::error_code ec;
    bool const exists = fs::exists(dir, ec);
    if (ec) {
      throw moe::IoError(
          cat("checkpoint: cannot access the checkpoint directory '", dir, "': ", ec.message()));
    }
    if (!exists) return;
    if (!fs::is_directory(dir, ec))
      throw moe::IoError(cat("checkpoint: '", dir, "' is not a directory"));
    for (auto const& [s, path] : cd::list_steps(dir)) {
      try {
        file = cd::verify(path, s, specs);
        found[0] = 1, found[1] = s;
        return;
      } catch (std::exception const& e) {
        std::cerr << ("checkpoint: skipping " + path + ": " + e.what() + "\n");
      }
    }
  });
  cd::check(MPI_Bcast(found, 2, MPI_INT64_T, 0, comm.get()), "MPI_Bcast");
  if (!found[0]) return false;
  std::string const meta = cd::bcast_string(comm, root ? cd::encode_map(file.metadata) : "");

  // Rank 0 cuts every block out of the global tensors: its own by copy, the others' by message.
  if (root) {
    std::map<std::string, std::vector<unsigned char>> native;  // big-endian hosts only
    auto global_of = [&](cd::Desc const& d) -> unsigned char* {
      io::Tensor const& t = file.at(d.name);
      auto* p = const_cast<unsigned char*>(t.bytes.data());
      if (io::detail::host_is_little_endian()) return p;
      auto it = native.find(d.name);
      if (it == native.end()) {
        it = native.emplace(d.name, t.bytes).first;
        cd::swap_to_le(it->second.data(), it->second.size(), io::dtype_size(t.dtype));
      }
      return it->second.data();
    };
    std::vector<unsigned char> buf;
    for (auto const& rank_descs : all) {
      for (cd::Desc const& d : rank_descs) {
        if (d.numel == 0) continue;
        std::size_t const esz = io::dtype_size(d.dtype);
        if (d.rank == 0) {
          cd::copy_box(global_of(d), d.global, static_cast<unsigned char*>(blocks[d.index].data),
                       d.local, d.offset, esz, false);
          continue;
        }
        buf.resize(cd::nbytes(d));
        cd::copy_box(global_of(d), d.global, buf.data(), d.local, d.offset, esz, false);
        cd::send_bytes(comm, d.rank, buf.data(), buf.size());
      }
    }
  } else {
    for (cd::Desc const& d : all[static_cast<std::size_t>(comm.rank())]) {
      if (d.numel > 0) cd::recv_bytes(comm, 0, blocks[d.index].data, cd::nbytes(d));
    }
  }
  metadata = cd::decode_map(meta);
  step = found[1];
  return true;
}

}  // namespace train
