#pragma once
/// \file
/// Internals of moe/io/checkpoint.hpp: the blocks the ranks describe, how the descriptions travel
/// (a small binary encoding), the agreement of the blocks of each tensor, the save plan (which
/// rank sends which distinct block) and the copies between a global tensor and a block.

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

/// One rank's descriptions as text, the form they travel in between ranks (never stored): a
/// JSON array of [name, dtype, global, local, offset, hash]; rank and index are implied by the
/// position. Names are valid UTF-8 (describe checks them).
inline std::string encode(std::vector<Desc> const& descs) {
  nlohmann::json j = nlohmann::json::array();
  for (Desc const& d : descs)
    j.push_back({d.name, dtype_name(d.dtype), d.global, d.local, d.offset, d.hash});
  return j.dump();
}

/// Every rank's descriptions from the all-gathered texts (texts[r] is rank r's); a text encode
/// did not write throws moe::Error.
inline std::vector<std::vector<Desc>> decode(std::vector<std::string> const& texts) {
  std::vector<std::vector<Desc>> out(texts.size());
  try {
    for (std::size_t r = 0; r < texts.size(); ++r) {
      for (nlohmann::json const& e :
           nlohmann::json::parse(texts[r]).get<nlohmann::json::array_t>()) {
        Desc d;
        d.rank = static_cast<int>(r);
        d.index = out[r].size();
        d.name = e.at(0).get<std::string>();
        parse_dtype(e.at(1).get<std::string>(), d.dtype);
        d.global = e.at(2).get<std::vector<std::int64_t>>();
        d.local = e.at(3).get<std::vector<std::int64_t>>();
        d.offset = e.at(4).get<std::vector<std::int64_t>>();
        d.hash = e.at(5).get<std::uint64_t>();
        d.numel = checked_numel(d.local, "");
        out[r].push_back(std::move(d));
      }
    }
  } catch (nlohmann::json::exception const&) {
    throw Error("checkpoint: corrupt block description");
  }
  return out;
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

/// One tensor to save: its dtype and global shape, and the pieces it is assembled from.
struct TensorPlan {
  TensorSpec spec;
  /// Disjoint blocks covering the tensor, each the description of the rank that sends it (the
  /// lowest holding it).
  std::vector<Desc const*> pieces;
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
      for (Desc const* p : tp.pieces) {
        Desc const& o = *p;
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
      if (!same) tp.pieces.push_back(&d);
    }
  }
  for (auto const& kv : plan) {
    std::int64_t covered = 0;
    for (Desc const* p : kv.second.pieces) covered += p->numel;
    std::int64_t const total = checked_numel(kv.second.spec.global, "");
    require<ConfigError>(covered == total, "checkpoint: tensor '", kv.first, "' ",
                         shape_text(kv.second.spec.global), ": the ranks' blocks cover ", covered,
                         " of its ", total,
                         " elements; every element must be held by at least one rank");
  }
  return plan;
}

/// Copies between a row-major global tensor and a non-empty row-major block of it (at \p offset),
/// one row of the block (its last axis) at a time.
inline void copy_box(unsigned char* global, std::vector<std::int64_t> const& gshape,
                     unsigned char* local, std::vector<std::int64_t> const& lshape,
                     std::vector<std::int64_t> const& offset, std::size_t esz, bool to_global) {
  std::size_t const n = gshape.size();
  std::size_t const row = static_cast<std::size_t>(n == 0 ? 1 : lshape[n - 1]) * esz;
  std::int64_t rows = 1;
  for (std::size_t a = 0; a + 1 < n; ++a) rows *= lshape[a];
  std::vector<std::int64_t> idx(n, 0);  // the row's index in the block; idx[n-1] stays 0
  for (std::int64_t r = 0; r < rows; ++r, local += row) {
    std::int64_t g = 0;  // the row's first element in the global tensor
    for (std::size_t a = 0; a < n; ++a) g = g * gshape[a] + offset[a] + idx[a];
    unsigned char* const at = global + static_cast<std::size_t>(g) * esz;
    if (to_global) {
      std::memcpy(at, local, row);
    } else {
      std::memcpy(local, at, row);
    }
    std::size_t a = n > 0 ? n - 1 : 0;  // next row: count up over the axes before the last
    while (a-- > 0 && ++idx[a] == lshape[a]) idx[a] = 0;
  }
}

/// Converts elements between host and little-endian order (a no-op on little-endian hosts).
inline void swap_to_le(unsigned char* p, std::size_t bytes, std::size_t esz) {
  if (host_is_little_endian()) return;
  for (std::size_t i = 0; i + esz <= bytes; i += esz) std::reverse(p + i, p + i + esz);
}

}  // namespace moe::io::detail
