#pragma once
// Shared helpers of the moe command-line tools: YAML configs with MaxText key names,
// `key=value` overrides, and one-line error reporting.

#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/threads.hpp>

#include <mpi.h>
#include <yaml-cpp/yaml.h>
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <exception>

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
        throw ConfigError(detail::cat("config key '", key, "': nested lists are not supported"));
      out += (i ? "," : "") + n[i].Scalar();
    }
    return out;
  }
  throw ConfigError(
      detail::cat("config key '", key, "' holds a mapping; expected a scalar or list"));
}

/// Reads a flat YAML mapping (MaxText config style). Throws ConfigError on unreadable files.
inline KeyValues read_yaml(std::string const& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (YAML::BadFile const&) {
    throw ConfigError(detail::cat("cannot read config file '", path, "'"));
  } catch (YAML::Exception const& e) {
    throw ConfigError(detail::cat("config file '", path, "' is not valid YAML: ", e.what()));
  }
  KeyValues kv;
  if (root.IsNull()) return kv;
  if (!root.IsMap())
    throw ConfigError(detail::cat("config file '", path, "' must be a mapping of key: value"));
  for (auto const& it : root) {
    std::string const key = it.first.as<std::string>();
    kv.emplace_back(key, yaml_to_text(it.second, key));
  }
  return kv;
}

/// Parses one `key=value` command-line override.
inline std::pair<std::string, std::string> parse_override(std::string const& arg) {
  auto const eq = arg.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(detail::cat("argument '", arg, "' is not a key=value override"));
  return {arg.substr(0, eq), arg.substr(eq + 1)};
}

/// Applies the pairs to a LayerConfig; every key must be a LayerConfig key.
inline void apply(LayerConfig& cfg, KeyValues const& kv) {
  for (auto const& [k, v] : kv) cfg.set(k, v);
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
      throw ConfigError(detail::cat("unknown config key '", k, "' (value '", v,
                                    "'): not a layer key (num_experts, base_emb_dim, ...) nor a "
                                    "parallelism key (ici_*_parallelism, use_ring_of_experts, "
                                    "ragged_buffer_factor, moe_fsdp_use_two_stage_all_gather, "
                                    "custom_mesh_and_rule)"));
  }
}

/// The message on one line (newlines become spaces), for one-line tool errors.
inline std::string one_line(std::string s) {
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

/// The whole main() of an MPI tool: initialises MPI and applies the ranks x threads rule
/// (moe/threads.hpp); with -h/--help prints `usage` on rank 0
/// (before Kokkos, which would print its own help on every rank); otherwise runs `body` inside
/// Kokkos and reports its errors the project's way: a moe::Error (raised the same on every rank)
/// prints `TOOL: error: ...` and returns 2; any other exception is not collective, so it prints
/// `TOOL: internal error: ...` and aborts every rank (exit 3). Finalises MPI; returns the exit
/// code.
template <class Body>
int tool_main(char const* tool, char const* usage, int& argc, char** argv, Body&& body) {
  MPI_Init(&argc, &argv);
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
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    try {
      rc = body();
    } catch (moe::Error const& e) {
      std::fprintf(stderr, "%s: error: %s\n", tool, one_line(e.what()).c_str());
      rc = 2;
    } catch (std::exception const& e) {
      std::fprintf(stderr, "%s: internal error: %s\n", tool, one_line(e.what()).c_str());
      std::fflush(stderr);
      if (size > 1) MPI_Abort(MPI_COMM_WORLD, 3);
      rc = 3;
    }
  }
  MPI_Finalize();
  return rc;
}

}  // namespace moe::cli
