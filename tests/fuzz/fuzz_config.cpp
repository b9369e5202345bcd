// Fuzz target: the YAML / key=value config layer of the tools (examples/common/moe_cli.hpp) and
// of train_moe (examples/train_moe/config.hpp).
//
// The input is a YAML document, optionally followed by a line "#overrides" (a YAML comment) and
// key=value lines, one override per line (empty lines are skipped). The document goes through
// moe::cli::read_yaml (from a scratch file: it reads paths only), each line through
// moe::cli::parse_override; then, as moe-layer-run does, the pairs are applied to a LayerConfig +
// ParallelConfig (moe::cli::apply) and LayerConfig::validate and ParallelConfig::validate run, and,
// as train_moe does, they are applied to a train::TrainConfig and TrainConfig::validate runs. A
// refusal must be a moe::Error; a config that validates must give sane derived values (capacity,
// receive buffer rows, learning rates).

#include "fuzz_common.hpp"

#include <moe/comm/ragged_all_to_all.hpp>
#include <moe_cli.hpp>
#include <train_moe/config.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using moe_fuzz::expect_moe_errors;
using moe_fuzz::require;

void layer_path(moe::cli::KeyValues const& file, moe::cli::KeyValues const& overrides) {
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  bool const ok = expect_moe_errors("LayerConfig apply/validate", [&] {
    moe::cli::apply(cfg, par, file);
    moe::cli::apply(cfg, par, overrides);
    cfg.validate();
    par.validate();
  });
  if (!ok) return;
  (void)moe::describe(cfg);
  (void)par.describe();
  // The sizes the layer derives from the config: the router's per-sequence capacity when
  // capacity_factor > 0, the expert-parallel receive buffer when ragged_buffer_factor > 0.
  for (std::int64_t seq_len : {1, 64, 4096}) {
    if (cfg.capacity_factor > 0)
      require(cfg.capacity(seq_len) >= 0, "LayerConfig::capacity is negative");
    if (par.ragged_buffer_factor > 0) {
      std::int64_t const tk = seq_len * cfg.num_experts_per_tok;
      std::int64_t const rows = moe::comm::ragged_buffer_size(
          tk, 2, cfg.num_experts, cfg.num_experts_per_tok, par.ragged_buffer_factor);
      require(rows >= 0, "moe::comm::ragged_buffer_size is negative");
    }
  }
}

void train_path(moe::cli::KeyValues const& file, moe::cli::KeyValues const& overrides) {
  train::TrainConfig cfg;
  bool const ok = expect_moe_errors("TrainConfig apply/validate", [&] {
    cfg.apply(file);
    cfg.apply(overrides);
    cfg.validate();
  });
  if (!ok) return;
  (void)cfg.describe();
  (void)cfg.architecture();
  (void)cfg.run_identity(2);
  require(cfg.vocab() >= 2, "TrainConfig::vocab() < 2 after validate()");
  for (std::int64_t step : {std::int64_t{0}, cfg.warmup(), cfg.schedule_steps()}) {
    double const lr = train::learning_rate_at(cfg, step);
    require(std::isfinite(lr) && lr >= 0, "learning_rate_at is not finite and >= 0");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  static std::string const path = moe_fuzz::scratch_dir() + "/config.yml";
  std::string const text(reinterpret_cast<char const*>(data), size);
  std::string const marker = "#overrides\n";
  std::size_t cut = text.rfind(marker, 0) == 0 ? 0 : text.find("\n" + marker);
  std::string yaml = text, rest;
  if (cut != std::string::npos) {
    if (text[cut] == '\n') ++cut;
    yaml = text.substr(0, cut);
    rest = text.substr(cut + marker.size());
  }
  moe_fuzz::write_file(path, reinterpret_cast<std::uint8_t const*>(yaml.data()), yaml.size());

  moe::cli::KeyValues file, overrides;
  if (!expect_moe_errors("moe::cli::read_yaml", [&] { file = moe::cli::read_yaml(path); }))
    return 0;
  if (cut != std::string::npos) {
    std::size_t begin = 0;
    while (begin <= rest.size()) {
      std::size_t end = rest.find('\n', begin);
      if (end == std::string::npos) end = rest.size();
      std::string const line = rest.substr(begin, end - begin);
      begin = end + 1;
      if (line.empty()) continue;
      if (!expect_moe_errors("moe::cli::parse_override",
                             [&] { overrides.push_back(moe::cli::parse_override(line)); }))
        return 0;
    }
  }
  if (!expect_moe_errors("moe::cli::require_unique_keys",
                         [&] { moe::cli::require_unique_keys(overrides, "the command line"); }))
    return 0;
  layer_path(file, overrides);
  train_path(file, overrides);
  return 0;
}
