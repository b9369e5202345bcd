#pragma once
// train_moe's checkpoints: every parameter and both AdamW moments, as blocks of the global
// tensors (moe/io/checkpoint.hpp gathers them into global tensors and cuts them out again, so a
// run resumes on any layout), with the metadata that says which model and run wrote them.

#include "config.hpp"
#include "params.hpp"

#include <moe/comm/communicator.hpp>
#include <moe/error.hpp>
#include <moe/io/checkpoint.hpp>
#include <moe/io/safetensors.hpp>
#include <moe_blocks.hpp>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

namespace train::detail {

/// The tensors of a checkpoint: params.NAME, opt_state.mu.NAME and opt_state.nu.NAME of every
/// parameter, read from and written to the parameters' host mirrors (F32 or F64: moments stored
/// in bf16 are written as the F32 values they hold and rounded back when loaded, exactly, so a
/// checkpoint resumes with any mu_dtype).
template <class Scalar>
std::vector<moe::io::BlockRef> block_refs(std::vector<Param<Scalar>>& params) {
  std::string const dt = std::is_same_v<Scalar, float> ? "F32" : "F64";
  std::vector<moe::io::BlockRef> refs;
  for (auto& q : params) refs.push_back({"params." + q.name, q.block, dt, q.p_host.data()});
  for (auto& q : params) refs.push_back({"opt_state.mu." + q.name, q.block, dt, q.m_host.data()});
  for (auto& q : params) refs.push_back({"opt_state.nu." + q.name, q.block, dt, q.v_host.data()});
  return refs;
}

/// A value a checkpoint must not hold: not finite, or a negative second moment.
struct BadValue {
  std::string tensor;  ///< its checkpoint name (params.*, opt_state.mu.*, opt_state.nu.*)
  double value = 0;
  std::size_t element = 0;  ///< in this rank's block
  bool second_moment = false;
};

/// The first bad value of the parameters' and moments' host mirrors, if any (the rule of both
/// a save and a load).
template <class Scalar>
std::optional<BadValue> first_bad_value(std::vector<Param<Scalar>> const& params) {
  for (auto const& q : params) {
    std::pair<char const*, typename Param<Scalar>::host1 const*> const tensors[] = {
        {"params.", &q.p_host}, {"opt_state.mu.", &q.m_host}, {"opt_state.nu.", &q.v_host}};
    for (auto const& [prefix, v] : tensors) {
      bool const nu = v == &q.v_host;
      for (std::size_t i = 0; i < v->extent(0); ++i)
        if (!std::isfinite(double((*v)(i))) || (nu && (*v)(i) < 0))
          return BadValue{prefix + q.name, double((*v)(i)), i, nu};
    }
  }
  return std::nullopt;
}

/// What a checkpoint of step `step` says of itself: format, step and data position, the mesh it
/// was written on, the model's architecture keys (model.*) and the run's identity (run.*).
inline std::map<std::string, std::string> checkpoint_metadata(TrainConfig const& cfg, int ranks,
                                                              std::string const& mesh,
                                                              std::int64_t step,
                                                              std::string const& data_hash) {
  std::map<std::string, std::string> md;
  md["format"] = "train_moe/1";
  md["step"] = std::to_string(step);
  md["data_position"] = std::to_string(step);  // data of step s = f(seed, s, sequence)
  md["rng"] = "counter-based (seed, step, sequence index)";
  md["mesh"] = mesh;
  md["ranks"] = std::to_string(ranks);
  for (auto const& [k, v] : cfg.model_keys()) md["model." + k] = v;
  if (!data_hash.empty()) md["data.hash"] = data_hash;
  for (auto const& [k, v] : cfg.run_identity(ranks)) md["run." + k] = v;
  return md;
}

/// Collective: saves step `step` of the parameters and moments into cfg.checkpoint_dir (keeping
/// cfg.checkpoint_keep steps); `out` (rank 0's log, may be null) gets one line.
template <class Scalar>
void save(moe::comm::Communicator const& comm, TrainConfig const& cfg,
          std::vector<Param<Scalar>>& params, std::string const& mesh, std::int64_t step,
          std::string const& data_hash, std::ostream* out) {
  for (auto& q : params) to_host(q);  // bf16 moments: widened into float mirrors for the save
  struct Release {
    std::vector<Param<Scalar>>& params;
    ~Release() {
      for (auto& q : params) release_moment_mirrors(q);
    }
  } release{params};
  // Never a non-finite checkpoint: every value is checked before anything is written, so the
  // checkpoints already in the directory (and their rotation) are untouched when one is not.
  moe::comm::collective_guard(comm, [&] {
    if (auto const bad = first_bad_value(params))
      throw moe::NumericError(moe::detail::cat("step ", step, " was not saved: ", bad->tensor,
                                               " holds ", bad->value, " at element ", bad->element,
                                               " of this rank's block; the checkpoints in '",
                                               cfg.checkpoint_dir, "' are kept as they were"));
  });
  moe::io::save_checkpoint(comm, cfg.checkpoint_dir, step, block_refs(params),
                           checkpoint_metadata(cfg, comm.size(), mesh, step, data_hash),
                           cfg.checkpoint_keep);
  if (out) *out << "saved checkpoint: step " << step << " in " << cfg.checkpoint_dir << "\n";
}

/// \brief Collective: every parameter gathered whole on rank 0, rounded to BF16 (nearest even)
/// and written there as one safetensors file at `path`, named as in the checkpoints
/// (`params.<name>`): the bf16 export for inference (export_bf16). The same error on every rank
/// when rank 0 cannot write it.
template <class Scalar>
void export_bf16(moe::comm::Communicator const& comm, std::vector<Param<Scalar>> const& params,
                 std::string const& path) {
  moe::io::File f;
  for (auto const& q : params) {
    auto const h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), q.p);
    std::vector<Scalar> const local(h.data(), h.data() + h.span());
    auto const global = moe::cli::gather_blocks<Scalar>(comm, q.block, local, q.name);
    if (comm.rank() == 0)
      f.set("params." + q.name,
            moe::io::Tensor::from<Scalar>(q.block.global_shape, global).as(moe::io::DType::BF16));
  }
  moe::comm::collective_guard(comm, [&] {
    if (comm.rank() == 0) f.write(path);
  });
}

/// Step directories ("step_N") in `dir` (rank 0 looks; other ranks return "").
inline std::string step_dirs(moe::comm::Communicator const& comm, std::string const& dir) {
  std::string found;
  if (comm.rank() != 0) return found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const n = it->path().filename().string();
    if (n.size() > 5 && n.compare(0, 5, "step_") == 0 &&
        n.find_first_not_of("0123456789", 5) == std::string::npos)
      found += (found.empty() ? "" : ", ") + n;
  }
  return found;
}

/// Collective: loads the latest checkpoint of cfg.checkpoint_dir (written on any layout) into
/// the parameters and moments and returns its step; nothing when the directory holds no step
/// directory. Refuses, on every rank alike, a directory whose steps none fits this model, a
/// checkpoint of another model (naming the keys that differ) and non-finite values (naming the
/// tensor and element). Notes on `out` the run keys that differ from the checkpoint's run.
/// The caller must tell the layers that their weights changed.
template <class Scalar>
std::optional<std::int64_t> resume(moe::comm::Communicator const& comm, TrainConfig const& cfg,
                                   std::vector<Param<Scalar>>& params, std::string const& data_hash,
                                   std::ostream* out) {
  std::map<std::string, std::string> md;
  std::int64_t step = 0;
  for (auto& q : params) size_moment_mirrors(q);  // bf16 moments: the load's float mirrors
  struct Release {
    std::vector<Param<Scalar>>& params;
    ~Release() {
      for (auto& q : params) release_moment_mirrors(q);
    }
  } release{params};
  if (!moe::io::load_latest_checkpoint(comm, cfg.checkpoint_dir, block_refs(params), md, step)) {
    // Nothing loadable. Step directories that are there anyway belong to another model or are
    // damaged (the loader said why): training from scratch next to them would mix two runs.
    std::string const found = step_dirs(comm, cfg.checkpoint_dir);
    moe::comm::any_error(comm, !found.empty(),
                         "checkpoint_dir='" + cfg.checkpoint_dir + "' holds " + found +
                             " but none fits this model (see the messages above): use another "
                             "checkpoint_dir, or remove them to start from scratch",
                         moe::comm::ErrorKind::config);
    return std::nullopt;
  }
  // The same metadata on every rank: checks throw alike everywhere. Every model key and the
  // dataset's content must match, unless resume_allow_changed names them; a key the checkpoint
  // does not record (written before it was) is not compared.
  std::string mismatch, allowed, unrecorded;
  if (md.count("format") == 0 || md.at("format") != "train_moe/1")
    mismatch = " (not a train_moe checkpoint)";
  std::set<std::string> may_change;
  for (auto const& k : comma_list(cfg.resume_allow_changed)) may_change.insert(k);
  auto compare = [&](std::string const& key, std::string const& mine, bool recorded_always) {
    auto it = md.find(key == "dataset_hash" ? std::string("data.hash") : "model." + key);
    if (it == md.end() && !recorded_always) {
      unrecorded += " " + key;
      return;
    }
    std::string const theirs = it == md.end() ? std::string("?") : it->second;
    if (theirs == mine) return;
    std::string const what = " " + key + "=" + theirs + " (this run: " + mine + ")";
    (may_change.count(key) ? allowed : mismatch) += what;
  };
  std::size_t const always = cfg.architecture().size();  // recorded since train_moe/1
  auto const keys = cfg.model_keys();
  for (std::size_t i = 0; i < keys.size(); ++i) compare(keys[i].first, keys[i].second, i < always);
  if (!data_hash.empty()) compare("dataset_hash", data_hash, false);
  moe::detail::require<moe::ConfigError>(
      mismatch.empty(), "checkpoint_dir='", cfg.checkpoint_dir, "' holds step ", step,
      " of another model or dataset:", mismatch,
      "; use another checkpoint_dir, enable_checkpointing=false, or name the keys in "
      "resume_allow_changed if the change is intended");
  // The checksums prove the bytes are the ones written, not that they are usable: every value
  // is checked before training on it (finite; second moments >= 0), on every rank's blocks.
  moe::comm::collective_guard(comm, [&] {
    if (auto const bad = first_bad_value(params))
      throw moe::InputError(moe::detail::cat(
          "checkpoint step ", step, " in '", cfg.checkpoint_dir, "': ", bad->tensor, " holds ",
          bad->value, " at element ", bad->element, " of this rank's block",
          bad->second_moment ? ": second moments must be finite and >= 0"
                             : ": a checkpoint must hold finite values",
          "; use an earlier checkpoint or another checkpoint_dir"));
  });
  for (auto& q : params) from_host(q);  // bf16 moments (and weights): rounded to bf16
  if (out) {
    *out << "resumed from checkpoint: step " << step << " in " << cfg.checkpoint_dir
         << " (written on " << (md.count("mesh") ? md.at("mesh") : std::string("?")) << ")\n";
    std::string changed;
    for (auto const& [k, v] : cfg.run_identity(comm.size())) {
      auto it = md.find("run." + k);
      if (it != md.end() && it->second != v) changed += " " + k + " " + it->second + " -> " + v;
    }
    if (!changed.empty())
      *out << "note: this run differs from the checkpoint's in" << changed
           << ": it continues the training, but not the same run\n";
    if (!allowed.empty())
      *out << "note: resume_allow_changed:" << allowed
           << ": the model differs from the one the checkpoint was trained as\n";
    if (!unrecorded.empty())
      *out << "note: the checkpoint does not record" << unrecorded << ": not compared\n";
  }
  return step;
}

}  // namespace train::detail
