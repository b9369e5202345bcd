#pragma once
// Shared helpers of the moe command-line tools: YAML configs with MaxText key names,
// `key=value` overrides, and one-line error reporting.

#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/io/atomic_write.hpp>
#include <moe/threads.hpp>

#include <yaml-cpp/yaml.h>
#include <Kokkos_Core.hpp>
#include <moe/comm/mpi.hpp>

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <new>

#include <string>
#include <utility>
#include <vector>

namespace moe::cli {

/// Ordered (key, value) pairs of a flat config. Lists are joined with commas: [silu, linear] ->
/// "silu,linear"; null -> "".
using KeyValues = std::vector<std::pair<std::string, std::string>>;

inline std::string yaml_to_text(YAML::Node const& n, std::string const& key) {
  if (n.IsNull()) return "";
  if (n.IsScalar()) return n.Scalar();
  if (n.IsSequence()) {
    std::string out;
    for (std::size_t i = 0; i < n.size(); ++i) {
      if (!n[i].IsScalar())
        throw ConfigError(
            moe::detail::cat("config key '", key, "': nested lists are not supported"));
      out += (i ? "," : "") + n[i].Scalar();
    }
    return out;
  }
  throw ConfigError(
      moe::detail::cat("config key '", key, "' holds a mapping; expected a scalar or list"));
}

/// \brief Checks an input path up front: it exists, is a regular file (not a directory) and can
/// be opened for reading. ConfigError naming `what` (the flag or key, e.g. "--in" or
/// "dataset_path") and the path otherwise.
inline void require_input_file(std::string const& what, std::string const& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) throw ConfigError(moe::detail::cat(what, " is empty: give a file path"));
  auto const st = fs::status(path, ec);
  if (!fs::exists(st)) throw ConfigError(moe::detail::cat(what, " '", path, "' does not exist"));
  if (fs::is_directory(st))
    throw ConfigError(moe::detail::cat(what, " '", path, "' is a directory; expected a file"));
  if (!fs::is_regular_file(st))
    throw ConfigError(moe::detail::cat(what, " '", path, "' is not a regular file"));
  std::ifstream probe(path, std::ios::binary);
  if (!probe)
    throw ConfigError(moe::detail::cat(what, " '", path, "' cannot be opened for reading"));
}

namespace detail {

/// The directory a new file `path` would be created in ("." for a bare name).
inline std::filesystem::path parent_dir(std::string const& path) {
  auto const parent = std::filesystem::path(path).parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}

/// Whether two paths name the same file: the same inode when both exist, else the same
/// normalised absolute path (links resolved as far as they exist).
inline bool same_file(std::string const& a, std::string const& b) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec) && !ec;
  auto const ca = fs::weakly_canonical(fs::absolute(a, ec), ec);
  auto const cb = fs::weakly_canonical(fs::absolute(b, ec), ec);
  return !ec && ca == cb;
}

}  // namespace detail

/// \brief Checks an output path up front, before anything is computed or written: not a
/// directory, its directory exists and is writable, an existing file is writable, and it is not
/// the same file (through links too) as any of the `inputs` ({flag or key, path}). A symbolic
/// link is an output for the file it names (written through, the link kept; its directory is the
/// one checked). ConfigError naming `what` and the path otherwise.
inline void require_output_file(std::string const& what, std::string const& path,
                                std::vector<std::pair<std::string, std::string>> const& inputs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) throw ConfigError(moe::detail::cat(what, " is empty: give a file path"));
  auto const st = fs::status(path, ec);
  if (fs::is_directory(st))
    throw ConfigError(moe::detail::cat(what, " '", path, "' is a directory; expected a file path"));
  // A FIFO would block the writer in open(), a device would be written to (or, through rename,
  // replaced): only regular files (or a symlink to one, written through) are outputs.
  if (fs::exists(st) && !fs::is_regular_file(st))
    throw ConfigError(moe::detail::cat(
        what, " '", path, "' is ",
        fs::is_fifo(st)
            ? "a FIFO"
            : (fs::is_character_file(st) || fs::is_block_file(st) ? "a device" : "a special file"),
        "; expected a regular file path"));
  if (fs::exists(st) && ::access(path.c_str(), W_OK) != 0)
    throw ConfigError(moe::detail::cat(what, " '", path, "' exists and is not writable"));
  // A symbolic link is written through (moe::io::write_atomic): the directory that matters is the
  // one of the file the link names, which the link keeps naming.
  auto const dir = detail::parent_dir(moe::io::resolve_links(path));
  if (!fs::is_directory(dir, ec))
    throw ConfigError(
        moe::detail::cat(what, " '", path, "': directory '", dir.string(), "' does not exist"));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw ConfigError(
        moe::detail::cat(what, " '", path, "': directory '", dir.string(), "' is not writable"));
  for (auto const& [flag, in] : inputs)
    if (!in.empty() && detail::same_file(path, in))
      throw ConfigError(moe::detail::cat(what, " '", path, "' is the same file as ", flag, " '", in,
                                         "': writing it would destroy that input; choose another ",
                                         what));
}

/// \brief Checks a directory the tool will write into (created when missing): an existing path
/// must be a writable directory; a missing one needs a writable parent directory. ConfigError
/// naming `what` and the path otherwise.
inline void require_output_dir(std::string const& what, std::string const& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) throw ConfigError(moe::detail::cat(what, " is empty: give a directory"));
  auto const st = fs::status(path, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st))
      throw ConfigError(moe::detail::cat(what, " '", path, "' is a file; expected a directory"));
    if (::access(path.c_str(), W_OK | X_OK) != 0)
      throw ConfigError(moe::detail::cat(what, " '", path, "' is not writable"));
    return;
  }
  // A missing directory is created with its missing parents: the nearest existing ancestor
  // must be a writable directory.
  fs::path p = fs::absolute(path, ec);
  while (!p.empty() && !fs::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  if (!fs::is_directory(p, ec))
    throw ConfigError(
        moe::detail::cat(what, " '", path, "': '", p.string(), "' is not a directory"));
  if (::access(p.c_str(), W_OK | X_OK) != 0)
    throw ConfigError(moe::detail::cat(what, " '", path, "' cannot be created: '", p.string(),
                                       "' is not writable"));
}

/// \brief Throws ConfigError when a key appears twice in `kv` (one config file, or the
/// command-line overrides): a later value silently replacing an earlier one hides mistakes.
/// \param source where the pairs come from, for the message ("config file 'a.yml'")
inline void require_unique_keys(KeyValues const& kv, std::string const& source) {
  for (std::size_t i = 0; i < kv.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (kv[i].first == kv[j].first)
        throw ConfigError(moe::detail::cat(source, " sets key '", kv[i].first, "' twice ('",
                                           kv[j].second, "', then '", kv[i].second,
                                           "'): give each key once"));
}

/// \brief Walks a YAML mapping file (MaxText config style): the file is checked first
/// (require_input_file), then `f(key, value node)` runs for each top-level key in file order. A
/// key given twice is an error naming both lines; ConfigError on unreadable or invalid files, a
/// file that is not a mapping, or a key that is not a plain scalar. An empty file has no keys.
template <class F>
void for_each_yaml_key(std::string const& path, std::string const& what, F&& f) {
  require_input_file(what, path);
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (YAML::BadFile const&) {
    throw ConfigError(moe::detail::cat("cannot read ", what, " '", path, "'"));
  } catch (YAML::Exception const& e) {
    throw ConfigError(moe::detail::cat(what, " '", path, "' is not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return;
  if (!root.IsMap())
    throw ConfigError(moe::detail::cat(what, " '", path, "' must be a mapping of key: value"));
  std::vector<std::pair<std::string, int>> seen;  // key, line
  for (auto const& it : root) {
    int const line = it.first.Mark().line + 1;
    std::string key;
    try {
      key = it.first.as<std::string>();
    } catch (YAML::Exception const&) {
      throw ConfigError(
          moe::detail::cat(what, " '", path, "' line ", line, ": a key must be a plain scalar"));
    }
    for (auto const& [k, l] : seen)
      if (k == key)
        throw ConfigError(moe::detail::cat(what, " '", path, "' sets key '", key, "' twice (lines ",
                                           l, " and ", line, "): give each key once"));
    seen.emplace_back(key, line);
    f(key, it.second);
  }
}

/// \brief Reads a flat YAML mapping (for_each_yaml_key) as (key, text) pairs: lists are joined
/// with commas, nested lists and mappings are refused.
inline KeyValues read_yaml(std::string const& path, std::string const& what = "config file") {
  KeyValues kv;
  for_each_yaml_key(path, what, [&](std::string const& key, YAML::Node const& value) {
    kv.emplace_back(key, yaml_to_text(value, key));
  });
  return kv;
}

/// Parses one `key=value` command-line override.
inline std::pair<std::string, std::string> parse_override(std::string const& arg) {
  auto const eq = arg.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(moe::detail::cat("argument '", arg, "' is not a key=value override"));
  return {arg.substr(0, eq), arg.substr(eq + 1)};
}

/// Applies the pairs to a LayerConfig; every key must be a LayerConfig key.
inline void apply(LayerConfig& cfg, KeyValues const& kv) {
  for (auto const& [k, v] : kv) cfg.set(k, v);
}

/// Every LayerConfig and ParallelConfig key.
inline std::vector<std::string> known_keys() {
  auto k = LayerConfig::keys();
  for (auto const& p : ParallelConfig::keys()) k.push_back(p);
  return k;
}

/// Applies the pairs to the struct that has each key: LayerConfig keys (num_experts, ...) or
/// ParallelConfig keys (ici_*_parallelism, use_ring_of_experts, custom_mesh_and_rule, ...).
/// A key neither knows raises ConfigError naming it.
inline void apply(LayerConfig& cfg, ParallelConfig& par, KeyValues const& kv) {
  for (auto const& [k, v] : kv) {
    if (LayerConfig::has_key(k))
      cfg.set(k, v);
    else if (ParallelConfig::has_key(k))
      par.set(k, v);
    else
      throw ConfigError(
          moe::detail::cat("unknown config key '", k, "' (value '", v,
                           "'): not a layer key (num_experts, base_emb_dim, ...) nor a "
                           "parallelism key (ici_*_parallelism, use_ring_of_experts, "
                           "ragged_buffer_factor, moe_fsdp_use_two_stage_all_gather, "
                           "custom_mesh_and_rule)",
                           moe::detail::did_you_mean(k, known_keys())));
  }
}

/// The message on one line (newlines become spaces), for one-line tool errors.
inline std::string one_line(std::string s) {
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

/// Whether an exception that is not a moe::Error says that memory ran out (std::bad_alloc, or
/// Kokkos's allocation failure, a std::runtime_error whose text says it failed to allocate).
inline bool is_out_of_memory(std::exception const& e) {
  if (dynamic_cast<std::bad_alloc const*>(&e)) return true;
  std::string const w = e.what();
  return w.find("failed to allocate") != std::string::npos ||
         w.find("Failed to allocate") != std::string::npos ||
         w.find("Allocation of") != std::string::npos;
}

/// The whole main() of an MPI tool: ignores SIGXFSZ (writes past a file-size limit fail with
/// EFBIG and are reported), initialises MPI and applies the ranks x threads rule
/// (moe/threads.hpp); with -h/--help prints `usage` on rank 0
/// (before Kokkos, which would print its own help on every rank); otherwise runs `body` inside
/// Kokkos and reports its errors the project's way:
/// - a moe::Error raised the same on every rank (the collective checks) prints
///   `TOOL: error: ...` on every rank and returns 2;
/// - a moe::CommError (an MPI call failed on this rank) and an allocation failure are not
///   collective: the failing rank prints `TOOL: error: ...` and ends the whole job with
///   MPI_Abort(2), so no rank waits forever in a collective;
/// - any other exception prints `TOOL: internal error: ...` and aborts every rank (exit 3).
/// Finalises MPI; returns the exit code. `thread_multiple` asks MPI for MPI_THREAD_MULTIPLE (a
/// tool with a thread of its own that calls MPI: train_moe's watchdog; it checks what it got
/// with MPI_Query_thread).
template <class Body>
int tool_main(char const* tool, char const* usage, int& argc, char** argv, Body&& body,
              bool thread_multiple = false) {
  // Past a file-size limit a write fails with EFBIG, which the writers report naming the file
  // (and clean up after), instead of SIGXFSZ killing the process mid-file.
  std::signal(SIGXFSZ, SIG_IGN);
#if MOE_ENABLE_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, thread_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_SINGLE,
                  &provided);
#else
  (void)thread_multiple;
  MPI_Init(&argc, &argv);
#endif
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  apply_host_threads(MPI_COMM_WORLD);
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "-h" || std::string(argv[i]) == "--help") {
      if (rank == 0) std::fputs(usage, stdout);
      MPI_Finalize();
      return 0;
    }
  int rc = 0;
  auto abort_job = [&](int code) {
    std::fflush(stdout);
    std::fflush(stderr);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
    return code;
  };
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    try {
      rc = body();
    } catch (moe::CommError const& e) {
      std::fprintf(stderr, "%s: error: %s\n", tool, one_line(e.what()).c_str());
      rc = abort_job(2);
    } catch (moe::Error const& e) {
      std::fprintf(stderr, "%s: error: %s\n", tool, one_line(e.what()).c_str());
      rc = 2;
    } catch (std::exception const& e) {
      if (is_out_of_memory(e)) {
        std::fprintf(stderr,
                     "%s: error: out of memory on rank %d of %d: %s; use fewer tokens per rank "
                     "(batch, sequence length) or smaller dimensions, or more ranks\n",
                     tool, rank, size, one_line(e.what()).c_str());
        rc = abort_job(2);
      } else {
        std::fprintf(stderr, "%s: internal error: %s\n", tool, one_line(e.what()).c_str());
        rc = abort_job(3);
      }
    }
  }
  MPI_Finalize();
  return rc;
}

}  // namespace moe::cli
