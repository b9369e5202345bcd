// moe-shard: resolves logical tensor axes to mesh axes with MaxText's rules (DESIGN.md §7).
//
//   moe-shard [--rules FILE.yml] [--preset NAME] --mesh axis=size,...
//             --tensor NAME=logical1,logical2,... [--tensor ...] [--drop-size-one]
//   moe-shard --plan [CFG.yml ...] [key=value ...] [--json] [--ranks N] [--rank R] [--batch B]
//             [--seq S] [--dtype float32|float64|bfloat16] [--machine NAME|MACHINE.yml]
//             [machine.KEY=VALUE ...]
//
// Prints {"mesh": {axis: size, ...}, "tensors": {NAME: [null | "axis" | ["a", "b"], ...]}}.
// A preset (--preset, or the file's custom_mesh_and_rule) replaces the file's mesh axes and rules;
// without one the file's mesh_axes / logical_axis_rules are used (base axes / default rules when
// absent). Mesh axes not given in --mesh have size 1; size-1 axes stay in the specs unless
// --drop-size-one. A dimension without a logical name is written None.
//
// --plan prints the layer's partition plan (moe::make_plan, DESIGN.md §4) as text, or as JSON with
// --json. The config is zero or more YAML files in order, then the key=value overrides, read as
// MaxText reads them (moe_maxtext_config.hpp: MaxText's base.yml and model files as they are,
// model_name=NAME for a published model's MoE shapes, the files' mesh_axes and
// logical_axis_rules as the layout's rules): LayerConfig and ParallelConfig keys plus
// per_device_batch_size and max_target_length are applied, MaxText's other keys are ignored
// (one summary line on stderr), any other key is an error. With no file, per_device_batch_size and
// max_target_length default to base.yml's (12 and 2048). The number of ranks is
// the product of the ici_* degrees (--ranks N when one is -1), the global batch
// per_device_batch_size * ranks (or --batch), the sequence length max_target_length (or --seq).
// The plan is followed by the layer's memory estimate for one rank (moe::estimate_layer_memory of
// a training step: the bytes per item and the keys that scale it; "memory" in the JSON), and a
// WARNING when a tensor exceeds the host kernels' index limits (moe::check_index_limits).
// --machine (a described machine, h100-ib or cpu-cluster, or a YAML file of `preset: NAME` and
// machine keys; machine.KEY=VALUE overrides a field) adds the step's predicted cost per stage
// (moe::estimate_step_cost; "cost" in the JSON).
//
// Errors: one line on stderr, exit code 2.
#include <moe/config.hpp>
#include <moe/distributed/cost.hpp>
#include <moe/distributed/memory.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/error.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>

#include <moe_cli.hpp>
#include <moe_maxtext_config.hpp>
#include <moe_sharding_yaml.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace sh = moe::sharding;
using moe::ConfigError;
using moe::detail::cat;

struct Args {
  std::string rules, preset;
  std::vector<std::pair<std::string, int>> mesh;
  std::vector<std::pair<std::string, sh::LogicalAxes>> tensors;
  bool drop_size_one = false;
  // --plan mode (see run_plan).
  bool plan = false;
  std::vector<std::string> plan_files;
  bool json = false;
  moe::cli::KeyValues overrides;
  int ranks = 0, rank = 0;          // 0: implied by the ici_* degrees
  std::int64_t batch = 0, seq = 0;  // 0: from the config
  std::size_t scalar_bytes = sizeof(float);
  // --dtype given: the layer's dtype (bfloat16: float values, bf16 on the wire), over the config's.
  std::optional<moe::ComputeDtype> dtype;
  std::vector<std::string> plan_flags;  // given --plan-only flags, for the error message
  std::string machine;                  // --machine: a described machine or a YAML file
  std::vector<std::pair<std::string, std::string>> machine_keys;  // machine.KEY=VALUE
};

int parse_size(std::string const& axis, std::string const& text) {
  std::size_t used = 0;
  long v = 0;
  try {
    v = std::stol(text, &used);
  } catch (std::exception const&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || v < 1 || v > (1L << 30))
    throw ConfigError(
        cat("--mesh: size '", text, "' of axis '", axis, "' is not a positive integer"));
  return static_cast<int>(v);
}

/// Splits `item` of option `flag` at its '=' into a name not yet in `seen` and its value; the
/// errors name the option, the item and the rule (`form`).
template <class Pairs>
std::pair<std::string, std::string> assignment(char const* flag, std::string const& item,
                                               char const* form, char const* what,
                                               Pairs const& seen) {
  auto const eq = item.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(cat(flag, ": '", item, "' is not ", form));
  std::string const name = item.substr(0, eq);
  for (auto const& s : seen)
    if (s.first == name) throw ConfigError(cat(flag, ": ", what, " '", name, "' is given twice"));
  return {name, item.substr(eq + 1)};
}

void parse_mesh(std::string const& spec, Args& a) {
  std::size_t start = 0;
  while (start <= spec.size()) {
    auto const comma = spec.find(',', start);
    auto const [axis, size] = assignment(
        "--mesh",
        spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start),
        "axis=size", "axis", a.mesh);
    a.mesh.emplace_back(axis, parse_size(axis, size));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
}

void parse_tensor(std::string const& spec, Args& a) {
  auto const [name, axes] =
      assignment("--tensor", spec, "NAME=logical1,logical2,...", "name", a.tensors);
  try {
    a.tensors.emplace_back(name, sh::parse_logical_axes(axes));
  } catch (ConfigError const& e) {
    throw ConfigError(cat("--tensor ", name, ": ", e.what()));
  }
}

void usage() {
  std::puts(
      "usage: moe-shard [--rules FILE.yml] [--preset NAME] --mesh axis=size,...\n"
      "                 --tensor NAME=logical1,logical2,... [--tensor ...] [--drop-size-one]\n"
      "       moe-shard --plan [CFG.yml ...] [key=value ...] [--json] [--ranks N] [--rank R]\n"
      "                 [--batch B] [--seq S] [--dtype float32|float64|bfloat16]\n"
      "                 [--machine h100-ib|cpu-cluster|MACHINE.yml] [machine.KEY=VALUE ...]\n"
      "A dimension without a logical name is written None. --rules is optional with --preset.\n"
      "--plan: the config files (MaxText's base.yml and model files as they are), then the\n"
      "overrides, later wins; model_name=NAME gives a published model's MoE shapes. Ranks default\n"
      "to the product of the ici_* degrees. --machine adds the step's predicted cost (FLOPs, "
      "bytes,\n"
      "time per stage) on a described machine; machine.KEY=VALUE overrides its fields.");
}

Args parse_args(int argc, char** argv) {
  Args a;
  bool have_mesh = false;
  for (int i = 1; i < argc; ++i) {
    std::string const s = argv[i];
    auto value = [&](char const* flag) {
      if (i + 1 >= argc) throw ConfigError(cat(flag, " needs a value"));
      return std::string(argv[++i]);
    };
    if (s == "--rules")
      a.rules = value("--rules");
    else if (s == "--preset")
      a.preset = value("--preset");
    else if (s == "--mesh") {
      parse_mesh(value("--mesh"), a);
      have_mesh = true;
    } else if (s == "--tensor")
      parse_tensor(value("--tensor"), a);
    else if (s == "--drop-size-one")
      a.drop_size_one = true;
    else if (s == "--plan")
      a.plan = true;
    else if (s == "--json")
      a.json = true;
    else if (s == "--ranks" || s == "--rank" || s == "--batch" || s == "--seq") {
      long long const v = moe::detail::parse_int(s, value(s.c_str()));
      long long const lo = s == "--rank" ? 0 : 1;
      long long const hi = s == "--rank" || s == "--ranks" ? (1LL << 30) : (1LL << 50);
      if (v < lo || v > hi) throw ConfigError(cat(s, " ", v, " must be in [", lo, ", ", hi, "]"));
      if (s == "--ranks")
        a.ranks = int(v);
      else if (s == "--rank")
        a.rank = int(v);
      else if (s == "--batch")
        a.batch = v;
      else
        a.seq = v;
      a.plan_flags.push_back(s);
    } else if (s == "--dtype") {
      std::string const t = value("--dtype");
      if (t == "float32" || t == "float")
        a.scalar_bytes = 4, a.dtype = moe::ComputeDtype::Native;
      else if (t == "float64" || t == "double")
        a.scalar_bytes = 8, a.dtype = moe::ComputeDtype::Native;
      else if (t == "bfloat16" || t == "bf16")
        a.scalar_bytes = 4, a.dtype = moe::ComputeDtype::BFloat16;
      else
        throw ConfigError(cat("--dtype ", t, " is not one of float32|float64|bfloat16"));
      a.plan_flags.push_back(s);
    } else if (s == "--machine") {
      a.machine = value("--machine");
      a.plan_flags.push_back(s);
    } else if (s == "-h" || s == "--help") {
      usage();
      std::exit(0);
    } else if (s.rfind("--", 0) == 0)
      throw ConfigError(cat("unknown flag '", s, "'"));
    else if (s.rfind("machine.", 0) == 0 && s.find('=') != std::string::npos)
      a.machine_keys.emplace_back(s.substr(8, s.find('=') - 8), s.substr(s.find('=') + 1));
    else if (s.find('=') != std::string::npos)
      a.overrides.push_back(moe::cli::parse_override(s));
    else if (a.plan)
      a.plan_files.push_back(s);  // read in order, then the overrides
    else
      throw ConfigError(cat("unexpected argument '", s, "'"));
  }
  if (a.plan) return a;
  if (!a.overrides.empty() || a.json || !a.plan_flags.empty())
    throw ConfigError(cat("key=value overrides, --json", a.plan_flags.empty() ? "" : ", ",
                          a.plan_flags.empty() ? "" : a.plan_flags.front(),
                          " are only valid with --plan"));
  if (a.rules.empty() && a.preset.empty())
    throw ConfigError("--rules FILE.yml or --preset NAME is required");
  if (!have_mesh) throw ConfigError("--mesh axis=size,... is required");
  return a;
}

// ---- --plan: the layer's partition plan (moe::make_plan).
int run_plan(Args const& a) {
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  // Without a config file the plan is MaxText's with base.yml: its per_device_batch_size and
  // max_target_length (a file or an override replaces them).
  double per_device_batch = a.plan_files.empty() ? 12.0 : 0;
  std::int64_t max_target_length = a.plan_files.empty() ? 2048 : 0;
  auto const tool_has_key = [](std::string const& key) {
    return moe::LayerConfig::has_key(key) || moe::ParallelConfig::has_key(key) ||
           key == "per_device_batch_size" || key == "max_target_length";
  };
  auto tool_keys = moe::cli::known_keys();
  tool_keys.push_back("per_device_batch_size");
  tool_keys.push_back("max_target_length");
  auto const loaded =
      moe::cli::maxtext::load(a.plan_files, a.overrides, tool_has_key, tool_keys, "--plan");
  for (auto const& [key, value] : loaded.apply) {
    if (moe::LayerConfig::has_key(key)) {
      cfg.set(key, value);
    } else if (moe::ParallelConfig::has_key(key)) {
      par.set(key, value);
    } else if (key == "per_device_batch_size") {
      per_device_batch = moe::detail::parse_double(key, value);
      if (per_device_batch <= 0)
        throw ConfigError(cat("per_device_batch_size=", value, " must be > 0"));
    } else {
      max_target_length = moe::detail::parse_int(key, value);
      if (max_target_length < 1)
        throw ConfigError(cat("max_target_length=", value, " must be >= 1"));
    }
  }
  loaded.apply_sharding(par);
  if (a.dtype) cfg.dtype = *a.dtype;
  int ranks = a.ranks;
  if (ranks == 0) {
    std::int64_t product = 1;
    for (auto const& [key, degree] : par.ici()) {
      if (degree == -1)
        throw ConfigError(cat(key,
                              "=-1 fills the rest of the ranks, so the config does not imply "
                              "a number of ranks; give --ranks N"));
      product *= degree;
      if (product > (1 << 30))
        throw ConfigError(cat("the ici_* degrees multiply to more than 2^30 ranks"));
    }
    ranks = int(product);
  }
  std::int64_t batch = a.batch;
  if (batch == 0) {
    if (per_device_batch <= 0)
      throw ConfigError(
          "the global batch is unknown: set per_device_batch_size in the config or give --batch B");
    double const b = per_device_batch * ranks;
    batch = std::int64_t(std::llround(b));
    if (batch < 1 || std::abs(b - double(batch)) > 1e-9 * b)
      throw ConfigError(cat("per_device_batch_size=", per_device_batch, " x ", ranks,
                            " ranks = ", b, " is not a whole global batch >= 1; give --batch B"));
  }
  std::int64_t seq = a.seq != 0 ? a.seq : max_target_length;
  if (seq == 0)
    throw ConfigError(
        "the sequence length is unknown: set max_target_length in the config or give --seq S");
  if (a.rank >= ranks)
    throw ConfigError(cat("--rank ", a.rank, " is outside [0, ", ranks, ") for ", ranks, " ranks"));
  auto const plan = moe::make_plan(cfg, par, ranks, a.rank, batch, seq, a.scalar_bytes);
  // The cost model, on a described machine (--machine) with its fields overridden.
  std::unique_ptr<moe::StepCost> cost;
  if (!a.machine.empty() || !a.machine_keys.empty()) {
    moe::Machine m;
    std::vector<std::pair<std::string, std::string>> keys;
    if (a.machine.size() > 4 && (a.machine.rfind(".yml") == a.machine.size() - 4 ||
                                 a.machine.rfind(".yaml") == a.machine.size() - 5)) {
      // A YAML file: `preset: NAME` (optional, h100-ib by default) and machine keys.
      for (auto const& [k, v] : moe::cli::read_yaml(a.machine, "--machine"))
        if (k == "preset")
          m = moe::Machine::preset(v);
        else
          keys.emplace_back(k, v);
      m.name = a.machine;
    } else if (!a.machine.empty()) {
      m = moe::Machine::preset(a.machine);
    }
    for (auto const& kv : a.machine_keys) keys.push_back(kv);
    for (auto const& [k, v] : keys) m.set(k, v);
    cost = std::make_unique<moe::StepCost>(moe::estimate_step_cost(plan, m));
  }
  // The memory estimate of one training step on this rank, and the index limits of host kernels.
  bool const packed = moe::default_packed_weights(plan);
  auto const memory = moe::estimate_layer_memory(plan, cfg, true, packed);
  std::string limit_error;
  try {
    moe::check_index_limits(plan);
  } catch (ConfigError const& e) {
    limit_error = e.what();
  }
  std::string out;
  if (a.json) {
    // The plan's object with one more member: "memory".
    auto j = plan.json();
    auto mem = moe::detail::ordered_json{{"training", true}, {"packed_expert_weights", packed}};
    auto const memory_json = memory.json();
    for (auto const& [k, v] : memory_json.items()) mem[k] = v;
    mem["index_limit_error"] = limit_error.empty() ? moe::detail::ordered_json(nullptr)
                                                   : moe::detail::ordered_json(limit_error);
    j["memory"] = mem;
    if (cost) j["cost"] = cost->json();
    out = moe::detail::json_text(j) + "\n";
  } else {
    out = plan.to_text();
    out +=
        cat("\nmemory per rank (estimate of one training step: buffers the layer keeps, its "
            "gradients, ",
            packed ? "oneDNN's packed expert weights, " : "",
            "balanced routing; the caller's x, y, dy, dx not included; keys that scale each "
            "item):\n",
            memory.to_text());
    if (!limit_error.empty()) out += "WARNING: " + limit_error + "\n";
    if (cost) out += "\n" + cost->to_text();
  }
  moe::cli::maxtext::print_ignored(loaded, "moe-shard", true);  // stderr: --json stays JSON
  std::fputs(out.c_str(), stdout);
  return 0;
}

int run_resolve(Args const& a) {
  std::unique_ptr<moe::cli::ShardingFile> file;
  if (!a.rules.empty())
    file = std::make_unique<moe::cli::ShardingFile>(moe::cli::load_sharding_yaml(a.rules));
  sh::Preset const p = moe::cli::effective_sharding(file.get(), a.preset);

  std::vector<std::pair<std::string, int>> sizes;
  for (auto const& axis : p.mesh_axes) sizes.emplace_back(axis, 1);
  for (auto const& [axis, size] : a.mesh) {
    bool found = false;
    for (auto& s : sizes)
      if (s.first == axis) {
        s.second = size;
        found = true;
      }
    if (!found) {
      std::string known;
      for (auto const& n : p.mesh_axes) known += (known.empty() ? "" : ", ") + n;
      throw ConfigError(
          cat("--mesh: axis '", axis, "' is not a mesh axis of ", p.name, " (", known, ")"));
    }
  }
  sh::Mesh const mesh(sizes);

  moe::detail::ordered_json doc;
  auto& mesh_json = doc["mesh"] = moe::detail::ordered_json::object();
  for (int i = 0; i < mesh.num_axes(); ++i) mesh_json[mesh.name(i)] = mesh.size(i);
  auto& tensors = doc["tensors"] = moe::detail::ordered_json::object();
  for (auto const& [name, logical] : a.tensors) {
    sh::PartitionSpec spec = p.rules.resolve(logical);
    if (a.drop_size_one) spec = sh::drop_size_one(std::move(spec), mesh);
    tensors[name] = sh::json(spec);
  }
  std::string const out = moe::detail::json_text(doc) + "\n";
  std::fputs(out.c_str(), stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args const a = parse_args(argc, argv);
    return a.plan ? run_plan(a) : run_resolve(a);
  } catch (std::exception const& e) {
    std::string msg = e.what();
    for (char& c : msg)
      if (c == '\n' || c == '\r') c = ' ';
    std::fprintf(stderr, "moe-shard: error: %s\n", msg.c_str());
    return 2;
  }
}
