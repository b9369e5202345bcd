#pragma once
/// \file
/// Internals of moe/io/checkpoint.hpp: the blocks the ranks describe, how the descriptions travel
/// (a small binary encoding), the agreement of the blocks of each tensor, the save plan (which
/// rank sends which distinct block) and the copies between a global tensor and a block.

#include <moe/detail/hash.hpp>
#include <moe/error.hpp>
#include <moe/io/checkpoint_index.hpp>
#include <moe/io/json.hpp>
#include <moe/io/safetensors.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace moe::io::detail {

using ::moe::detail::require;

// ---- blocks ------------------------------------------------------------------------------------

/// One block as every rank sees it after the all-gather.
struct Desc {
  int rank = 0;
  std::size_t index = 0;  ///< position in that rank's block list
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> global, local, offset;
  std::uint64_t hash = 0;  ///< moe::detail::fnv1a of the block's bytes (saves only)
  std::int64_t numel = 0;  ///< elements of the local block
};

/// Bytes of the local block of \p d.
inline std::size_t nbytes(Desc const& d) {
  return static_cast<std::size_t>(d.numel) * dtype_size(d.dtype);
}

/// The encoding the descriptions travel in between ranks (never stored): int64s in host order,
/// strings and vectors prefixed by their length.
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

/// Reads what Writer wrote; a short or inconsistent text throws moe::Error.
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
  [[noreturn]] static void fail() { throw Error("checkpoint: corrupt block description"); }
  std::string const& s_;
  std::size_t pos_ = 0;
};

/// One rank's descriptions as text (rank and index are implied by the position).
inline std::string encode(std::vector<Desc> const& descs) {
  Writer w;
  w.i64(static_cast<std::int64_t>(descs.size()));
  for (Desc const& d : descs) {
    w.str(d.name);
    w.str(dtype_name(d.dtype));
    w.vec(d.global);
    w.vec(d.local);
    w.vec(d.offset);
    w.i64(static_cast<std::int64_t>(d.hash));
  }
  return w.text();
}

/// Every rank's descriptions from the all-gathered texts (texts[r] is rank r's).
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
      parse_dtype(rd.str(), d.dtype);
      d.global = rd.vec();
      d.local = rd.vec();
      d.offset = rd.vec();
      d.hash = static_cast<std::uint64_t>(rd.i64());
      d.numel = checked_numel(d.local, "");
      out[r].push_back(std::move(d));
    }
  }
  return out;
}

/// A metadata map as text (broadcast by a load).
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
    append_json_string(s, kv.first);
    s += ": ";
    append_json_string(s, kv.second);
  }
  return s + "}";
}

/// The map encode_map wrote.
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
      require<ConfigError>(s.dtype == d.dtype && s.global == d.global, "checkpoint: tensor '",
                           d.name, "' is ", dtype_name(s.dtype), " ", shape_text(s.global),
                           " on rank ", s.rank, " but ", dtype_name(d.dtype), " ",
                           shape_text(d.global), " on rank ", d.rank,
                           "; every block of a tensor must give the same dtype and global shape");
    }
  }
  return specs;
}

/// One distinct block of a tensor to save, and the rank that sends it (the lowest holding it).
struct Piece {
  Desc const* owner = nullptr;
};

/// One tensor to save: its dtype and global shape, and the pieces it is assembled from.
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
          require<ConfigError>(o.hash == d.hash, "checkpoint: tensor '", d.name,
                               "': the copies of the block at ", "offset ", shape_text(d.offset),
                               " shape ", shape_text(d.local), " on rank ", o.rank, " and rank ",
                               d.rank, " differ; copies of a block must be identical");
          same = true;
          break;
        }
        bool overlap = true;
        for (std::size_t a = 0; a < d.offset.size(); ++a) {
          overlap = overlap && d.offset[a] < o.offset[a] + o.local[a] &&
                    o.offset[a] < d.offset[a] + d.local[a];
        }
        require<ConfigError>(!overlap, "checkpoint: tensor '", d.name, "': the block at offset ",
                             shape_text(o.offset), " shape ", shape_text(o.local), " (rank ",
                             o.rank, ") and the block at offset ", shape_text(d.offset), " shape ",
                             shape_text(d.local), " (rank ", d.rank,
                             ") overlap partially; blocks must be identical or disjoint");
      }
      if (!same) tp.pieces.push_back(Piece{&d});
    }
  }
  for (auto const& kv : plan) {
    std::int64_t covered = 0;
    for (Piece const& p : kv.second.pieces) covered += p.owner->numel;
    std::int64_t const total = checked_numel(kv.second.spec.global, "");
    require<ConfigError>(covered == total, "checkpoint: tensor '", kv.first, "' ",
                         shape_text(kv.second.spec.global), ": the ranks' blocks cover ", covered,
                         " of its ", total,
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
  if (host_is_little_endian()) return;
  for (std::size_t i = 0; i + esz <= bytes; i += esz) std::reverse(p + i, p + i + esz);
}

}  // namespace moe::io::detail
