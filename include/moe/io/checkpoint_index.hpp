#pragma once
/// \file
/// One step of a checkpoint on disk (no MPI: a tool can check one offline). "step_<N>" (N with at
/// least 8 digits) holds model.safetensors (every global tensor, the saver's metadata as
/// "__metadata__") and index.json, written last, so a directory without it is incomplete:
///
///     {"format": "moe-checkpoint", "version": 1, "step": N, "file": "model.safetensors",
///      "bytes": <its size>, "sha256": "<its plain SHA-256, 64 lowercase hex digits>",
///      "tensors": [{"name": "<name>", "dtype": "F32", "shape": [2, 3]}, ...]}  (sorted by name)

#include <moe/error.hpp>
#include <moe/io/json.hpp>
#include <moe/io/safetensors.hpp>
#include <moe/io/sha256.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <sys/stat.h>

namespace moe::io {

/// \brief Name of the model file in a step directory.
inline constexpr char const* kCheckpointModelFile = "model.safetensors";
/// \brief Name of the index file in a step directory.
inline constexpr char const* kCheckpointIndexFile = "index.json";

/// \brief The directory name of step \p step: "step_" and at least 8 digits ("step_00000012").
inline std::string checkpoint_step_name(std::int64_t step) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return buf;
}

/// \brief One tensor listed by a checkpoint index.
struct CheckpointIndexEntry {
  std::string name;                 ///< tensor name
  DType dtype = DType::F32;         ///< element type
  std::vector<std::int64_t> shape;  ///< global shape
};

/// \brief The content of a step's index.json (format "moe-checkpoint", version 1).
struct CheckpointIndex {
  std::int64_t step = 0;                      ///< the step the checkpoint is of
  std::string file;                           ///< the model file's name (kCheckpointModelFile)
  std::int64_t bytes = 0;                     ///< the model file's size
  std::string sha256;                         ///< the model file's SHA-256, 64 lowercase hex digits
  std::vector<CheckpointIndexEntry> tensors;  ///< the model file's tensors, by name
};

/// \brief The dtype and global shape a loader wants for one tensor.
struct TensorSpec {
  DType dtype = DType::F32;          ///< element type
  std::vector<std::int64_t> global;  ///< global shape
  int rank = 0;                      ///< the (first) rank that wants it, named in messages
};

/// \brief The text of index.json for step \p step whose model file is \p bytes long, has the
/// SHA-256 \p sha256 and holds the tensors of \p file. Deterministic.
inline std::string checkpoint_index_text(std::int64_t step, std::uint64_t bytes,
                                         std::string const& sha256, File const& file) {
  using ::moe::detail::cat;
  std::string s = cat("{\n  \"format\": \"moe-checkpoint\",\n  \"version\": 1,\n  \"step\": ", step,
                      ",\n  \"file\": \"", kCheckpointModelFile, "\",\n  \"bytes\": ", bytes,
                      ",\n  \"sha256\": \"", sha256, "\",\n  \"tensors\": [");
  for (auto const& kv : file.tensors()) {
    s += s.back() == '[' ? "\n    {\"name\": " : ",\n    {\"name\": ";
    detail::append_json_string(s, kv.first);
    s += cat(", \"dtype\": \"", dtype_name(kv.second.dtype),
             "\", \"shape\": ", detail::shape_text(kv.second.shape), "}");
  }
  s += s.back() == '[' ? "]\n}\n" : "\n  ]\n}\n";
  return s;
}

/// \brief Reads and checks "<step_dir>/index.json": valid JSON, format "moe-checkpoint" version 1,
/// every member present with its type, non-negative integers, known dtypes.
/// \throws moe::IoError with the reason (a missing file says the checkpoint is incomplete)
inline CheckpointIndex read_checkpoint_index(std::string const& step_dir) {
  using detail::JsonValue;
  using K = JsonValue::Kind;
  using ::moe::detail::cat;
  std::string const path = (std::filesystem::path(step_dir) / kCheckpointIndexFile).string();
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw IoError(cat("no readable ", kCheckpointIndexFile, " (", std::strerror(errno),
                      "): the checkpoint is incomplete"));
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  JsonValue const root = detail::parse_json(text, cat(kCheckpointIndexFile, ": "));
  auto member = [&](JsonValue const& obj, char const* key, K kind) -> JsonValue const& {
    for (std::size_t i = 0; i < obj.keys.size(); ++i)
      if (obj.keys[i] == key && obj.items[i].kind == kind) return obj.items[i];
    throw IoError(cat(kCheckpointIndexFile, " has no \"", key, "\" of the right type"));
  };
  auto integer = [&](JsonValue const& v, char const* what) {
    std::int64_t x = 0;
    if (!detail::json_to_int64(v, x) || x < 0)
      throw IoError(cat(kCheckpointIndexFile, ": \"", what, "\" is not a non-negative integer"));
    return x;
  };
  auto count = [&](char const* key) { return integer(member(root, key, K::Number), key); };
  if (root.kind != K::Object) throw IoError(cat(kCheckpointIndexFile, " is not an object"));
  if (member(root, "format", K::String).text != "moe-checkpoint" || count("version") != 1)
    throw IoError(cat(kCheckpointIndexFile, " is not a version 1 moe-checkpoint index"));
  CheckpointIndex ix;
  ix.step = count("step");
  ix.file = member(root, "file", K::String).text;
  ix.bytes = count("bytes");
  ix.sha256 = member(root, "sha256", K::String).text;
  for (JsonValue const& t : member(root, "tensors", K::Array).items) {
    if (t.kind != K::Object) throw IoError(cat(kCheckpointIndexFile, ": bad tensor entry"));
    CheckpointIndexEntry e;
    e.name = member(t, "name", K::String).text;
    if (!parse_dtype(member(t, "dtype", K::String).text, e.dtype))
      throw IoError(cat(kCheckpointIndexFile, ": tensor '", e.name, "' has an unknown dtype"));
    for (JsonValue const& d : member(t, "shape", K::Array).items)
      e.shape.push_back(integer(d, "shape"));
    ix.tensors.push_back(std::move(e));
  }
  return ix;
}

/// \brief The model file of the step directory \p step_dir (of step \p step), checked against its
/// index (step, file name, size, SHA-256, tensors) and \p requested (each tensor, dtype and shape).
/// \throws moe::IoError with the reason the checkpoint is unusable
inline File verify_checkpoint(std::string const& step_dir, std::int64_t step,
                              std::map<std::string, TensorSpec> const& requested) {
  using ::moe::detail::cat;
  CheckpointIndex const ix = read_checkpoint_index(step_dir);
  if (ix.step != step)
    throw IoError(cat(kCheckpointIndexFile, " is for step ", ix.step,
                      " but the directory is for step ", step));
  if (ix.file != kCheckpointModelFile)
    throw IoError(cat(kCheckpointIndexFile, " names the file '", ix.file, "', not '",
                      kCheckpointModelFile, "'"));
  std::string const model = (std::filesystem::path(step_dir) / kCheckpointModelFile).string();
  struct stat st {};
  if (::stat(model.c_str(), &st) != 0)
    throw IoError(cat("cannot stat ", kCheckpointModelFile, ": ", std::strerror(errno)));
  if (static_cast<std::int64_t>(st.st_size) != ix.bytes)
    throw IoError(cat(kCheckpointModelFile, " is ", st.st_size, " bytes but ", kCheckpointIndexFile,
                      " records ", ix.bytes, " (truncated or replaced)"));
  std::uint64_t size = 0;
  std::string const sha = file_sha256(model, size);
  if (sha != ix.sha256)
    throw IoError(cat("checksum mismatch: ", kCheckpointModelFile, " has SHA-256 ", sha, " but ",
                      kCheckpointIndexFile, " records ", ix.sha256, " (corrupted)"));
  File file = File::read(model);
  bool same = ix.tensors.size() == file.size();
  for (CheckpointIndexEntry const& e : ix.tensors)
    same = same && file.has(e.name) && file.at(e.name).dtype == e.dtype &&
           file.at(e.name).shape == e.shape;
  if (!same)
    throw IoError(
        cat(kCheckpointIndexFile, " and ", kCheckpointModelFile, " list different tensors"));
  for (auto const& kv : requested) {
    if (!file.has(kv.first))
      throw IoError(
          cat("it has no tensor '", kv.first, "' (requested by rank ", kv.second.rank, ")"));
    Tensor const& t = file.at(kv.first);
    if (t.dtype != kv.second.dtype || t.shape != kv.second.global)
      throw IoError(cat("tensor '", kv.first, "' is ", dtype_name(t.dtype), " ",
                        detail::shape_text(t.shape), " but ", dtype_name(kv.second.dtype), " ",
                        detail::shape_text(kv.second.global), " was requested"));
  }
  return file;
}

}  // namespace moe::io
