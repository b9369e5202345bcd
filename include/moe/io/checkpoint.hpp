#pragma once
/// \file
/// Checkpoints of a distributed run (collective): save_checkpoint and load_latest_checkpoint. Every
/// rank passes its blocks (BlockRef) of global tensors; a checkpoint stores the global tensors, so
/// a run may resume on another number of ranks or with another sharding.
///
/// Save (under "dir/LOCK"): every rank plans from the same all-gathered block descriptions, so all
/// raise the same ConfigError on bad blocks; each distinct block travels once to rank 0, which
/// writes "dir/.tmp_step_<N>.<pid>/" (the model, then the index, each atomically), renames it to
/// "step_<N>" (exchanging it with an existing one) and keeps the newest keep - 1 complete
/// checkpoints below N. A process killed at any moment leaves the old checkpoints or the new one
/// complete. Load: rank 0 takes the newest step that verify_checkpoint accepts (naming each one
/// skipped on stderr) and sends every rank its blocks. tests/data/checkpoint_v1 pins the format.

#include <moe/comm/bytes.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/hash.hpp>
#include <moe/detail/json.hpp>
#include <moe/error.hpp>
#include <moe/io/checkpoint_index.hpp>
#include <moe/io/checkpoint_lock.hpp>
#include <moe/io/detail/checkpoint_files.hpp>
#include <moe/io/json.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/io/sha256.hpp>
#include <moe/tensor_block.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <sys/stat.h>

namespace moe::io {

/// \brief One block of a global tensor held by this rank, in host memory, row-major.
struct BlockRef {
  std::string name;        ///< tensor name (the same on every rank holding a block of it)
  moe::TensorBlock block;  ///< global shape, local shape and offset of the block
  std::string dtype;       ///< "F32" (float) or "F64" (double)
  void* data = nullptr;    ///< numel(local_shape) elements; read by save, written by load
};

namespace detail {

using ::moe::detail::require;

/// One block as every rank sees it after the all-gather.
struct Desc {
  int rank = 0;
  std::size_t index = 0;  ///< position in that rank's block list
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> global, local, offset;
  std::uint64_t hash = 0;  ///< moe::detail::fnv1a of the block's bytes (saves only)
  std::int64_t numel = 0;  ///< elements of the local block
  std::size_t nbytes() const { return static_cast<std::size_t>(numel) * dtype_size(dtype); }
};

/// This rank's blocks, each checked (ConfigError), as the JSON array sent to the other ranks:
/// [name, dtype, global, local, offset, hash] each (hash 0 without \p with_hash).
inline std::string encode(std::vector<BlockRef> const& blocks, int rank, bool with_hash) {
  nlohmann::json j = nlohmann::json::array();
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    BlockRef const& b = blocks[i];
    std::string const what = cat("checkpoint: block ", i, " ('", b.name, "') of rank ", rank, ": ");
    DType dtype = DType::F32;
    require<ConfigError>(!b.name.empty(), what, "the tensor name is empty");
    require<ConfigError>(b.name != "__metadata__", what, "the name \"__metadata__\" is reserved");
    require<ConfigError>(valid_utf8(b.name), what, "the name is not valid UTF-8");
    require<ConfigError>(
        parse_dtype(b.dtype, dtype) && (dtype == DType::F32 || dtype == DType::F64), what,
        "dtype '", b.dtype, "' is not supported (use \"F32\" or \"F64\")");
    auto const& t = b.block;
    require<ConfigError>(
        t.local_shape.size() == t.global_shape.size() && t.offset.size() == t.global_shape.size(),
        what, "global shape ", shape_text(t.global_shape), ", local shape ",
        shape_text(t.local_shape), " and offset ", shape_text(t.offset),
        " must have the same number of dimensions");
    for (std::size_t a = 0; a < t.global_shape.size(); ++a) {
      std::int64_t const g = t.global_shape[a], l = t.local_shape[a], o = t.offset[a];
      require<ConfigError>(g >= 0 && l >= 0 && o >= 0 && l <= g && o <= g - l, what,
                           "the block (offset ", shape_text(t.offset), ", shape ",
                           shape_text(t.local_shape), ") does not lie within the global shape ",
                           shape_text(t.global_shape), " (axis ", a, ")");
    }
    std::int64_t const global_numel =
        rethrow_with<ConfigError>([&] { return checked_numel(t.global_shape, ""); }, what);
    std::int64_t const esz = static_cast<std::int64_t>(dtype_size(dtype));
    require<ConfigError>(global_numel <= INT64_MAX / esz, what, "the global tensor is too large");
    std::int64_t const numel = checked_numel(t.local_shape, "");
    require<ConfigError>(numel == 0 || b.data != nullptr, what, "data is null but the block has ",
                         numel, " elements");
    std::uint64_t const hash =
        with_hash && numel > 0 ? ::moe::detail::fnv1a(b.data, std::size_t(numel * esz)) : 0;
    j.push_back({b.name, dtype_name(dtype), t.global_shape, t.local_shape, t.offset, hash});
  }
  return j.dump();
}

/// Every rank's descriptions from the all-gathered texts; moe::Error if one is corrupt.
inline std::vector<std::vector<Desc>> decode(std::vector<std::string> const& texts) {
  std::vector<std::vector<Desc>> out(texts.size());
  try {
    for (std::size_t r = 0; r < texts.size(); ++r) {
      nlohmann::json const doc = nlohmann::json::parse(texts[r]);
      for (nlohmann::json const& e : doc.get_ref<nlohmann::json::array_t const&>()) {
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

/// Every tensor named by some block, checked for agreement (ConfigError, the same on every rank).
inline std::map<std::string, TensorSpec> tensor_specs(std::vector<std::vector<Desc>> const& all) {
  std::map<std::string, TensorSpec> specs;
  for (auto const& rank_descs : all) {
    for (Desc const& d : rank_descs) {
      auto const [it, added] = specs.emplace(d.name, TensorSpec{d.dtype, d.global, d.rank});
      if (added) continue;
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
  /// Disjoint blocks covering the tensor, each described by the lowest rank holding it.
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
      for (Desc const* o : tp.pieces) {
        if (o->offset == d.offset && o->local == d.local) {
          require<ConfigError>(o->hash == d.hash, "checkpoint: tensor '", d.name,
                               "': the copies of the block at ", "offset ", shape_text(d.offset),
                               " shape ", shape_text(d.local), " on rank ", o->rank, " and rank ",
                               d.rank, " differ; copies of a block must be identical");
          same = true;
          break;
        }
        bool overlap = true;
        for (std::size_t a = 0; a < d.offset.size(); ++a)
          overlap = overlap && d.offset[a] < o->offset[a] + o->local[a] &&
                    o->offset[a] < d.offset[a] + d.local[a];
        require<ConfigError>(!overlap, "checkpoint: tensor '", d.name, "': the block at offset ",
                             shape_text(o->offset), " shape ", shape_text(o->local), " (rank ",
                             o->rank, ") and the block at offset ", shape_text(d.offset), " shape ",
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
    std::memcpy(to_global ? at : local, to_global ? local : at, row);
    std::size_t a = n > 0 ? n - 1 : 0;  // next row: count up over the axes before the last
    while (a-- > 0 && ++idx[a] == lshape[a]) idx[a] = 0;
  }
}

/// Converts elements between host and little-endian order (a no-op on little-endian hosts).
inline void swap_to_le(unsigned char* p, std::size_t bytes, std::size_t esz) {
  if (host_is_little_endian()) return;
  for (std::size_t i = 0; i + esz <= bytes; i += esz) std::reverse(p + i, p + i + esz);
}

}  // namespace detail

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
  namespace cd = detail;
  using moe::detail::cat;
  using moe::detail::require;
  std::string mine;
  moe::comm::collective_guard(comm, [&] {
    require<moe::ConfigError>(!dir.empty(), "checkpoint: the checkpoint directory is empty");
    require<moe::ConfigError>(step >= 0, "checkpoint: step ", step, " is negative");
    require<moe::ConfigError>(keep >= 1, "checkpoint: keep = ", keep,
                              "; at least the new checkpoint must be kept (keep >= 1)");
    for (auto const& kv : metadata)
      require<moe::ConfigError>(detail::valid_utf8(kv.first) && detail::valid_utf8(kv.second),
                                "checkpoint: metadata key '", kv.first,
                                "' or its value is not valid UTF-8");
    mine = cd::encode(blocks, comm.rank(), true);
  });
  moe::comm::check_agreement(comm, "checkpoint directory, step and keep",
                             cat(dir, "\n", step, "\n", keep));
  moe::comm::check_agreement(comm, "checkpoint metadata",
                             moe::detail::json_text(moe::detail::ordered_json(metadata)));
  std::vector<std::vector<cd::Desc>> const all =
      cd::decode(moe::comm::all_gather_bytes(comm, mine, "checkpoint: the block descriptions"));
  std::map<std::string, cd::TensorPlan> plan;
  moe::comm::collective_guard(comm, [&] { plan = cd::save_plan(all); });

  // Rank 0: the directory, the temporary directory and the global tensors.
  bool const root = comm.rank() == 0;
  std::string const tmp = cd::hidden_path(dir, "tmp_", checkpoint_step_name(step));
  std::map<std::string, Tensor> tensors;
  cd::DirLock save_lock;  // for this save, when this process does not hold the lock already
  cd::TempDir tmp_dir;    // rank 0: removed on every error path of the save
  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    cd::make_dir(dir);
    if (!cd::holds_lock(dir)) save_lock = cd::DirLock(dir);
    cd::remove_leftovers(dir);
    if (::mkdir(tmp.c_str(), 0777) != 0)
      throw moe::IoError(cat("checkpoint: cannot create '", tmp,
                             "' in the checkpoint directory: ", std::strerror(errno)));
    tmp_dir.path = tmp;
    cd::crash_point("tmp_made");
    try {
      for (auto const& kv : plan) {
        Tensor& t = tensors[kv.first];
        t.dtype = kv.second.spec.dtype;
        t.shape = kv.second.spec.global;
        t.bytes.resize(static_cast<std::size_t>(detail::checked_numel(t.shape, "")) *
                       dtype_size(t.dtype));
      }
    } catch (...) {
      tensors.clear();
      throw;
    }
  });

  // Every distinct block travels from its owner to rank 0, in plan order.
  std::vector<unsigned char> buf;
  for (auto const& kv : plan) {
    for (cd::Desc const* p : kv.second.pieces) {
      cd::Desc const& d = *p;
      std::size_t const esz = dtype_size(d.dtype);
      void* const data = d.rank == comm.rank() ? blocks[d.index].data : nullptr;
      if (root) {
        auto* src = static_cast<unsigned char*>(data);
        if (d.rank != 0) {
          buf.resize(d.nbytes());
          moe::comm::recv_bytes(comm, d.rank, buf.data(), buf.size());
          src = buf.data();
        }
        cd::copy_box(tensors[kv.first].bytes.data(), d.global, src, d.local, d.offset, esz, true);
      } else if (d.rank == comm.rank()) {
        moe::comm::send_bytes(comm, 0, data, d.nbytes());
      }
    }
  }
  buf = std::vector<unsigned char>();

  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    cd::crash_point("gathered");
    {
      File file;
      file.metadata = metadata;
      for (auto& kv : tensors) {
        cd::swap_to_le(kv.second.bytes.data(), kv.second.bytes.size(), dtype_size(kv.second.dtype));
        file.set(kv.first, std::move(kv.second));
      }
      tensors.clear();
      std::string const model = cd::join(tmp, kCheckpointModelFile);
      file.write(model);
      cd::crash_point("model_written");
      std::uint64_t size = 0;
      std::string const sha = file_sha256(model, size);
      write_atomic(cd::join(tmp, kCheckpointIndexFile),
                   checkpoint_index_text(step, size, sha, file));
      cd::crash_point("index_written");
      cd::install(dir, tmp, cd::join(dir, checkpoint_step_name(step)));
      tmp_dir.dismiss();
      cd::crash_point("installed");
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
  namespace cd = detail;
  namespace fs = std::filesystem;
  using moe::detail::cat;
  std::string mine;
  moe::comm::collective_guard(comm, [&] {
    moe::detail::require<moe::ConfigError>(!dir.empty(),
                                           "checkpoint: the checkpoint directory is empty");
    mine = cd::encode(blocks, comm.rank(), false);
  });
  moe::comm::check_agreement(comm, "checkpoint directory", dir);
  std::vector<std::vector<cd::Desc>> const all =
      cd::decode(moe::comm::all_gather_bytes(comm, mine, "checkpoint: the block descriptions"));
  std::map<std::string, TensorSpec> specs;
  moe::comm::collective_guard(comm, [&] { specs = cd::tensor_specs(all); });

  bool const root = comm.rank() == 0;
  File file;
  std::string chosen_text = "null";  // rank 0: the step and metadata of the checkpoint taken
  moe::comm::collective_guard(comm, [&] {
    if (!root) return;
    std::error_code ec;
    bool const exists = fs::exists(dir, ec);
    if (ec)
      throw moe::IoError(
          cat("checkpoint: cannot access the checkpoint directory '", dir, "': ", ec.message()));
    if (!exists) return;
    if (!fs::is_directory(dir, ec))
      throw moe::IoError(cat("checkpoint: '", dir, "' is not a directory"));
    for (auto const& [s, path] : cd::list_steps(dir)) {
      try {
        file = verify_checkpoint(path, s, specs);
        chosen_text = nlohmann::json{{"step", s}, {"metadata", file.metadata}}.dump();
        return;
      } catch (std::exception const& e) {
        std::cerr << ("checkpoint: skipping " + path + ": " + e.what() + "\n");
      }
    }
  });
  auto const chosen = nlohmann::json::parse(moe::comm::broadcast_bytes(comm, 0, chosen_text));
  if (chosen.is_null()) return false;

  // Rank 0 cuts every block out of the global (little-endian) tensors in host order: its own by
  // copy, the others' by message.
  if (root) {
    std::vector<unsigned char> buf;
    for (auto const& rank_descs : all) {
      for (cd::Desc const& d : rank_descs) {
        if (d.numel == 0) continue;
        std::size_t const esz = dtype_size(d.dtype);
        if (d.rank != 0) buf.resize(d.nbytes());
        auto* const dst =
            d.rank == 0 ? static_cast<unsigned char*>(blocks[d.index].data) : buf.data();
        auto* const src = const_cast<unsigned char*>(file.at(d.name).bytes.data());
        cd::copy_box(src, d.global, dst, d.local, d.offset, esz, false);
        cd::swap_to_le(dst, d.nbytes(), esz);
        if (d.rank != 0) moe::comm::send_bytes(comm, d.rank, dst, d.nbytes());
      }
    }
  } else {
    for (cd::Desc const& d : all[static_cast<std::size_t>(comm.rank())])
      if (d.numel > 0) moe::comm::recv_bytes(comm, 0, blocks[d.index].data, d.nbytes());
  }
  metadata = chosen["metadata"].get<std::map<std::string, std::string>>();
  step = chosen["step"].get<std::int64_t>();
  return true;
}

}  // namespace moe::io
