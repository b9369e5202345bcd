// Tests of moe/sharding (Mesh, LogicalRules, presets, spec utilities), the YAML loader of the tools
// and the moe-shard command-line tool.
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>

#include <moe_sharding_yaml.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace sh = moe::sharding;
using moe::ConfigError;
using sh::LogicalAxes;
using sh::LogicalRules;
using sh::Mesh;
using sh::PartitionSpec;

namespace {

/// Spec from text: dims separated by '|', axes by ',', "." = unsharded.
/// "expert | fsdp,context | ." -> [["expert"], ["fsdp", "context"], []].
PartitionSpec ps(std::string const& text) {
  PartitionSpec spec;
  std::size_t start = 0;
  while (true) {
    auto const bar = text.find('|', start);
    std::string dim = text.substr(start, bar == std::string::npos ? bar : bar - start);
    dim.erase(std::remove(dim.begin(), dim.end(), ' '), dim.end());
    sh::DimAxes axes;
    if (dim != ".") {
      std::size_t s = 0;
      while (true) {
        auto const c = dim.find(',', s);
        axes.push_back(dim.substr(s, c == std::string::npos ? c : c - s));
        if (c == std::string::npos) break;
        s = c + 1;
      }
    }
    spec.push_back(axes);
    if (bar == std::string::npos) break;
    start = bar + 1;
  }
  return spec;
}

LogicalAxes la(std::string const& csv) { return sh::parse_logical_axes(csv); }

#define EXPECT_SPEC(actual, expected_text) \
  EXPECT_EQ(sh::to_json(actual), sh::to_json(ps(expected_text))) << "expected " << (expected_text)

/// Runs `fn`, expects a ConfigError whose message contains every fragment.
template <class F>
void expect_config_error(F&& fn, std::vector<std::string> const& fragments) {
  try {
    fn();
    ADD_FAILURE() << "no ConfigError thrown";
  } catch (ConfigError const& e) {
    std::string const msg = e.what();
    for (auto const& f : fragments)
      EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' missing from: " << msg;
  }
}

/// Mesh over the given axes, every axis of size `size`.
Mesh uniform_mesh(std::vector<std::string> const& axes, int size) {
  std::vector<std::pair<std::string, int>> pairs;
  for (auto const& a : axes) pairs.emplace_back(a, size);
  return Mesh(pairs);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Resolution algorithm (SEMANTICS §3.1)

TEST(ShardingRules, EmbedMoeFallsBackWhenMlpMoeTookFsdpTranspose) {
  auto const rules = sh::default_rules();
  // exp < mlp_moe < embed_moe: mlp_moe takes fsdp_transpose, embed_moe's first rule is blocked.
  EXPECT_SPEC(rules.resolve(la("exp,embed_moe,mlp_moe")),
              "expert | fsdp,context,context_usp_ulysses |"
              " fsdp_transpose,tensor,tensor_sequence,autoregressive");
  // Alone, embed_moe gets its first rule.
  EXPECT_SPEC(rules.resolve(la("embed_moe,None")),
              "fsdp,fsdp_transpose,context,context_usp_ulysses | .");
  // Same mechanism for the dense weights: mlp precedes embed.
  EXPECT_SPEC(rules.resolve(la("embed,mlp")),
              "fsdp,context,context_usp_ulysses,expert |"
              " fsdp_transpose,tensor,tensor_sequence,autoregressive");
}

TEST(ShardingRules, ActivationBatchMoeClaimsExpertBeforeActivationExp) {
  auto const rules = sh::default_rules();
  EXPECT_SPEC(rules.resolve(la("activation_exp,activation_batch_moe,None,activation_embed_moe")),
              ". | data,fsdp,fsdp_transpose,expert | . | tensor");
  // With the rules the other way round the expert dim wins and the batch dim loses its only rule.
  LogicalRules swapped{{"activation_exp", {"expert"}},
                       {"activation_batch_moe", {"data", "fsdp", "fsdp_transpose", "expert"}}};
  EXPECT_SPEC(swapped.resolve(la("activation_exp,activation_batch_moe")), "expert | .");
}

TEST(ShardingRules, OrderAcrossNamesDecidesConflicts) {
  LogicalRules ab{{"a", {"x", "y"}}, {"b", {"y"}}, {"b", {"z"}}};
  EXPECT_SPEC(ab.resolve(la("a,b")), "x,y | z");
  EXPECT_SPEC(ab.resolve(la("b,a")), "z | x,y");
  LogicalRules ba{{"b", {"y"}}, {"a", {"x", "y"}}, {"b", {"z"}}};
  EXPECT_SPEC(ba.resolve(la("a,b")), ". | y");  // a's only rule needs y, which b took
}

TEST(ShardingRules, EmptyRuleAssignsUnshardedAndBlocksLaterRules) {
  LogicalRules rules{{"a", {}}, {"a", {"x"}}, {"b", {"x"}}};
  EXPECT_SPEC(rules.resolve(la("a,b")), ". | x");
  EXPECT_SPEC(rules.resolve(la("a")), ".");
  // An empty rule uses no axis, so it never blocks other names.
  LogicalRules r2{{"b", {}}, {"a", {"x"}}};
  EXPECT_SPEC(r2.resolve(la("a,b")), "x | .");
}

TEST(ShardingRules, UnknownNamesAndNoneAreUnsharded) {
  auto const rules = sh::default_rules();
  EXPECT_SPEC(rules.resolve(la("not_a_rule,None,exp")), ". | . | expert");
  EXPECT_TRUE(rules.resolve({}).empty());
  EXPECT_SPEC(LogicalRules{}.resolve(la("exp,mlp")), ". | .");
  LogicalAxes const with_none{std::nullopt, std::string("exp")};
  EXPECT_SPEC(rules.resolve(with_none), ". | expert");
}

TEST(ShardingRules, DuplicateLogicalNamesThrow) {
  auto const rules = sh::default_rules();
  expect_config_error([&] { rules.resolve(la("exp,mlp,exp")); },
                      {"'exp'", "twice", "dims 0 and 2"});
  expect_config_error([&] { rules.resolve_each_dim(la("mlp,mlp")); }, {"'mlp'", "twice"});
  // None may repeat.
  EXPECT_SPEC(rules.resolve(la("None,None")), ". | .");
}

TEST(ShardingRules, ResolutionKeepsSizeOneAxes) {
  // Resolution never looks at a mesh: size-1 (or absent) axes stay until drop_size_one.
  LogicalRules rules{{"a", {"x", "y"}}};
  Mesh const mesh({{"x", 2}, {"y", 1}});
  auto const spec = rules.resolve(la("a"));
  EXPECT_SPEC(spec, "x,y");
  EXPECT_SPEC(sh::drop_size_one(spec, mesh), "x");
}

TEST(ShardingRules, RuleValidation) {
  expect_config_error([] { LogicalRules{{"", {"x"}}}; }, {"empty name"});
  expect_config_error([] { LogicalRules{{"a", {"x", "x"}}}; }, {"'a'", "'x'", "twice"});
  expect_config_error([] { LogicalRules{{"a", {""}}}; }, {"'a'", "empty mesh axis"});
  LogicalRules r;
  r.add("a", {"x"}).add("a", {"y"});
  EXPECT_EQ(r.size(), 2u);
  EXPECT_TRUE(r.has("a"));
  EXPECT_FALSE(r.has("b"));
  EXPECT_EQ(r.alternatives("a"), (std::vector<sh::DimAxes>{{"x"}, {"y"}}));
}

TEST(ShardingRules, MergeReplacesByKeyAndAppends) {
  LogicalRules base{{"a", {"x"}}, {"b", {"y"}}, {"a", {"z"}}, {"c", {}}};
  LogicalRules over{{"a", {"w"}}, {"d", {"v"}}};
  LogicalRules const expected{{"b", {"y"}}, {"c", {}}, {"a", {"w"}}, {"d", {"v"}}};
  EXPECT_EQ(sh::merge_rules(base, over), expected);
}

TEST(ShardingRules, ParseLogicalAxes) {
  EXPECT_EQ(la("exp,None,mlp"), (LogicalAxes{"exp", std::nullopt, "mlp"}));
  EXPECT_TRUE(la("").empty());
  expect_config_error([] { la("a,,b"); }, {"'a,,b'", "empty entry"});
  expect_config_error([] { la("a,"); }, {"empty entry"});
}

// ---------------------------------------------------------------------------------------------
// Serialisation and spec utilities

TEST(ShardingSpec, JsonSerialisation) {
  EXPECT_EQ(sh::to_json(ps(". | expert | fsdp,context")),
            R"([null, "expert", ["fsdp", "context"]])");
  EXPECT_EQ(sh::to_json(PartitionSpec{}), "[]");
  EXPECT_EQ(sh::json_string("a\"b\\c\n"), R"("a\"b\\c\n")");
  EXPECT_EQ(sh::json_string(std::string(1, '\x01')), R"("\u0001")");
}

TEST(ShardingSpec, RemoveMeshAxes) {
  auto const spec = ps("expert,fsdp | fsdp | tensor,fsdp,autoregressive | .");
  EXPECT_SPEC(sh::remove_mesh_axes(spec, {"fsdp"}), "expert | . | tensor,autoregressive | .");
  EXPECT_SPEC(sh::remove_mesh_axes(spec, {"fsdp", "tensor", "expert"}),
              ". | . | autoregressive | .");
  EXPECT_SPEC(sh::remove_mesh_axes(spec, {}),
              "expert,fsdp | fsdp | tensor,fsdp,autoregressive | .");
}

TEST(ShardingSpec, DropSizeOneTreatsMissingAxesAsSizeOne) {
  Mesh const mesh({{"data", 2}, {"fsdp", 1}, {"expert", 4}});
  EXPECT_SPEC(sh::drop_size_one(ps("data,fsdp,expert | fsdp | tensor,expert | ."), mesh),
              "data,expert | . | expert | .");
}

// Port of MaxText's test_remove_expert_from_partition_spec: `expert` is peeled only from the
// requested dims; a tuple becomes a shorter tuple, a lone `expert` becomes unsharded.
TEST(ShardingSpec, RemoveExpertFromPartitionSpec) {
  auto const spec = ps("data,expert | expert | data,fsdp,expert | expert,tensor | .");
  EXPECT_SPEC(sh::remove_axis_from_dims(spec, "expert", {0}),
              "data | expert | data,fsdp,expert | expert,tensor | .");
  EXPECT_SPEC(sh::remove_axis_from_dims(spec, "expert", {1}),
              "data,expert | . | data,fsdp,expert | expert,tensor | .");
  EXPECT_SPEC(sh::remove_axis_from_dims(spec, "expert", {0, 1, 2, 3, 4}),
              "data | . | data,fsdp | tensor | .");
  EXPECT_EQ(sh::remove_axis_from_dims(spec, "expert", {}), spec);
  EXPECT_SPEC(sh::remove_expert_from_batch(spec),
              "data,expert | . | data,fsdp,expert | expert,tensor | .");
  EXPECT_SPEC(sh::remove_expert_from_batch(ps(". | data,fsdp,fsdp_transpose,expert | . | tensor")),
              ". | data,fsdp,fsdp_transpose | . | tensor");
  // Dims without expert are left alone.
  EXPECT_SPEC(sh::remove_axis_from_dims(ps("data | fsdp"), "expert", {0, 1}), "data | fsdp");
  expect_config_error([&] { sh::remove_axis_from_dims(spec, "expert", {5}); },
                      {"dimension 5", "out of range"});
  expect_config_error([&] { sh::remove_axis_from_dims(spec, "expert", {-1}); }, {"dimension -1"});
}

// SEMANTICS §1.13 item 48: the default dense dispatch tensor, joint vs
// moe_dispatch_no_expert_sharding.
TEST(ShardingSpec, DenseDispatchWithAndWithoutNoExpertSharding) {
  auto const rules = sh::default_rules();
  auto const dispatch = la("activation_exp,activation_batch_moe,None,activation_embed_moe");
  EXPECT_SPEC(sh::resolve_dispatch(rules, dispatch, false),
              ". | data,fsdp,fsdp_transpose,expert | . | tensor");
  EXPECT_SPEC(sh::resolve_dispatch(rules, dispatch, true),
              "expert | data,fsdp,fsdp_transpose | . | tensor");
  // The per-dimension step alone keeps expert on both dims.
  EXPECT_SPEC(rules.resolve_each_dim(dispatch),
              "expert | data,fsdp,fsdp_transpose,expert | . | tensor");
  // The mlp tensor of the dense path behaves the same.
  EXPECT_SPEC(sh::resolve_dispatch(
                  rules, la("activation_exp,activation_batch_moe,None,activation_mlp"), true),
              "expert | data,fsdp,fsdp_transpose | . | tensor,tensor_sequence");
  // Presets whose batch rule has no expert are unchanged by the flag.
  auto const cp = sh::preset("ep-as-cp").rules;
  EXPECT_EQ(sh::resolve_dispatch(cp, dispatch, true), sh::resolve_dispatch(cp, dispatch, false));
}

TEST(ShardingSpec, ShardCountAndUsedAxes) {
  Mesh const mesh({{"data", 2}, {"fsdp", 3}, {"expert", 4}});
  EXPECT_EQ(sh::shard_count({"data", "expert"}, mesh), 8);
  EXPECT_EQ(sh::shard_count({}, mesh), 1);
  EXPECT_EQ(sh::shard_count({"tensor"}, mesh), 1);
  EXPECT_EQ(sh::used_axes(ps("data | . | fsdp,expert")),
            (std::vector<std::string>{"data", "fsdp", "expert"}));
}

// ---------------------------------------------------------------------------------------------
// Presets and every cell of SEMANTICS §3.4 (all mesh axes of size 2, so nothing drops).

namespace {

enum class Row {
  WiStorage,
  WoStorage,
  GateKernel,
  WiInSpec,
  WoInSpec,
  XInSpec,
  Output,
  WiBias,
  DenseDispatch,
  DenseMask
};

char const* row_name(Row r) {
  switch (r) {
    case Row::WiStorage:
      return "WiStorage";
    case Row::WoStorage:
      return "WoStorage";
    case Row::GateKernel:
      return "GateKernel";
    case Row::WiInSpec:
      return "WiInSpec";
    case Row::WoInSpec:
      return "WoInSpec";
    case Row::XInSpec:
      return "XInSpec";
    case Row::Output:
      return "Output";
    case Row::WiBias:
      return "WiBias";
    case Row::DenseDispatch:
      return "DenseDispatch";
    case Row::DenseMask:
      return "DenseMask";
  }
  return "?";
}

/// The tensor of a §3.4 row, resolved as MaxText does: weight storage specs keep size-1 axes,
/// shard_map in-specs have fsdp removed, activation constraints drop size-1 axes.
PartitionSpec resolve_row(sh::Preset const& p, Mesh const& mesh, Row r) {
  auto const& rules = p.rules;
  switch (r) {
    case Row::WiStorage:
      return rules.resolve(la("exp,embed_moe,mlp_moe"));
    case Row::WoStorage:
      return rules.resolve(la("exp,mlp_moe,embed_moe"));
    case Row::GateKernel:
      return rules.resolve(la("embed_moe,None"));
    case Row::WiInSpec:
      return sh::drop_size_one(
          sh::remove_mesh_axes(rules.resolve(la("exp,None,mlp_no_fsdp")), {"fsdp"}), mesh);
    case Row::WoInSpec:
      return sh::drop_size_one(
          sh::remove_mesh_axes(rules.resolve(la("exp,mlp_no_fsdp,None")), {"fsdp"}), mesh);
    case Row::XInSpec:
      return sh::drop_size_one(rules.resolve(la("activation_batch,activation_norm_length,None")),
                               mesh);
    case Row::Output:
      return sh::drop_size_one(
          rules.resolve(la("activation_batch,activation_norm_length,activation_embed")), mesh);
    case Row::WiBias:
      return rules.resolve(la("exp,activation_mlp"));
    case Row::DenseDispatch:
      return sh::drop_size_one(
          rules.resolve(la("activation_exp,activation_batch_moe,None,activation_embed_moe")), mesh);
    case Row::DenseMask:
      return sh::drop_size_one(
          rules.resolve(la("activation_batch_moe,activation_norm_length_moe,None,None")), mesh);
  }
  return {};
}

struct Cell {
  std::string preset;
  Row row;
  std::string expected;  // ps() syntax
};

// Abbreviations as in SEMANTICS §3.4.
std::string const kFcc = "fsdp,context,context_usp_ulysses";
std::string const kFfcc = "fsdp,fsdp_transpose,context,context_usp_ulysses";
std::string const kMlp = "fsdp_transpose,tensor,tensor_sequence,autoregressive";
std::string const kTta = "tensor,tensor_sequence,autoregressive";
std::string const kBatch = "data,fsdp,fsdp_transpose,expert";
std::string const kNorm = "tensor_sequence,context,context_usp_ulysses";

std::vector<Cell> table_cells() {
  return {
      // default
      {"default", Row::WiStorage, "expert | " + kFcc + " | " + kMlp},
      {"default", Row::WoStorage, "expert | " + kMlp + " | " + kFcc},
      {"default", Row::GateKernel, kFfcc + " | ."},
      {"default", Row::WiInSpec, "expert | . | " + kTta},
      {"default", Row::WoInSpec, "expert | " + kTta + " | ."},
      {"default", Row::XInSpec, kBatch + " | " + kNorm + " | ."},
      {"default", Row::Output, kBatch + " | " + kNorm + " | tensor"},
      {"default", Row::WiBias, "expert | tensor,tensor_sequence"},
      {"default", Row::DenseDispatch, ". | " + kBatch + " | . | tensor"},
      {"default", Row::DenseMask, kBatch + " | " + kNorm + " | . | ."},
      // pure-fsdp
      {"pure-fsdp", Row::WiStorage, ". | fsdp | ."},
      {"pure-fsdp", Row::WoStorage, ". | . | fsdp"},
      {"pure-fsdp", Row::GateKernel, "fsdp | ."},
      {"pure-fsdp", Row::WiInSpec, ". | . | ."},
      {"pure-fsdp", Row::WoInSpec, ". | . | ."},
      {"pure-fsdp", Row::XInSpec, "fsdp | . | ."},
      {"pure-fsdp", Row::Output, "fsdp | . | ."},
      {"pure-fsdp", Row::WiBias, ". | ."},
      {"pure-fsdp", Row::DenseDispatch, ". | fsdp | . | ."},
      {"pure-fsdp", Row::DenseMask, "fsdp | . | . | ."},
      // ep-as-dp
      {"ep-as-dp", Row::WiStorage, "expert | fsdp | fsdp_transpose"},
      {"ep-as-dp", Row::WoStorage, "expert | fsdp_transpose | fsdp"},
      {"ep-as-dp", Row::GateKernel, "fsdp | ."},
      {"ep-as-dp", Row::WiInSpec, "expert | . | ."},
      {"ep-as-dp", Row::WoInSpec, "expert | . | ."},
      {"ep-as-dp", Row::XInSpec, kBatch + " | . | ."},
      {"ep-as-dp", Row::Output, kBatch + " | . | ."},
      {"ep-as-dp", Row::WiBias, "expert | ."},
      {"ep-as-dp", Row::DenseDispatch, ". | " + kBatch + " | . | ."},
      {"ep-as-dp", Row::DenseMask, kBatch + " | . | . | ."},
      // ep-as-cp
      {"ep-as-cp", Row::WiStorage, "expert | fsdp | ."},
      {"ep-as-cp", Row::WoStorage, "expert | . | fsdp"},
      {"ep-as-cp", Row::GateKernel, "fsdp | ."},
      {"ep-as-cp", Row::WiInSpec, "expert | . | ."},
      {"ep-as-cp", Row::WoInSpec, "expert | . | ."},
      {"ep-as-cp", Row::XInSpec, "data,fsdp | expert | ."},
      {"ep-as-cp", Row::Output, "data,fsdp | expert | ."},
      {"ep-as-cp", Row::WiBias, "expert | ."},
      {"ep-as-cp", Row::DenseDispatch, "expert | data,fsdp | . | ."},
      {"ep-as-cp", Row::DenseMask, "data,fsdp | . | . | ."},
      // cp-as-ep
      {"cp-as-ep", Row::WiStorage, "context,expert | fsdp | ."},
      {"cp-as-ep", Row::WoStorage, "context,expert | . | fsdp"},
      {"cp-as-ep", Row::GateKernel, "fsdp | ."},
      {"cp-as-ep", Row::WiInSpec, "context,expert | . | ."},
      {"cp-as-ep", Row::WoInSpec, "context,expert | . | ."},
      {"cp-as-ep", Row::XInSpec, "data,fsdp,expert | context | ."},
      {"cp-as-ep", Row::Output, "data,fsdp,expert | context | ."},
      {"cp-as-ep", Row::WiBias, "context,expert | ."},
      {"cp-as-ep", Row::DenseDispatch, "context,expert | data,fsdp | . | ."},
      {"cp-as-ep", Row::DenseMask, "data,fsdp | . | . | ."},
      // shard-exp-on-fsdp
      {"shard-exp-on-fsdp", Row::WiStorage, "expert,fsdp | context | fsdp_transpose"},
      {"shard-exp-on-fsdp", Row::WoStorage, "expert,fsdp | fsdp_transpose | context"},
      {"shard-exp-on-fsdp", Row::GateKernel, "context | ."},
      {"shard-exp-on-fsdp", Row::WiInSpec, "expert | . | ."},
      {"shard-exp-on-fsdp", Row::WoInSpec, "expert | . | ."},
      {"shard-exp-on-fsdp", Row::XInSpec, kBatch + " | context | ."},
      {"shard-exp-on-fsdp", Row::Output, kBatch + " | context | ."},
      {"shard-exp-on-fsdp", Row::WiBias, "expert,fsdp | ."},
      {"shard-exp-on-fsdp", Row::DenseDispatch, "expert | data,fsdp,fsdp_transpose | . | ."},
      {"shard-exp-on-fsdp", Row::DenseMask, "data,fsdp,fsdp_transpose | context | . | ."},
      // pipeline-large-moe
      {"pipeline-large-moe", Row::WiStorage, "expert | fsdp | tensor"},
      {"pipeline-large-moe", Row::WoStorage, "expert | tensor | fsdp"},
      {"pipeline-large-moe", Row::GateKernel, "fsdp | ."},
      {"pipeline-large-moe", Row::WiInSpec, "expert | . | tensor"},
      {"pipeline-large-moe", Row::WoInSpec, "expert | tensor | ."},
      {"pipeline-large-moe", Row::XInSpec, "data,fsdp,expert | context | ."},
      {"pipeline-large-moe", Row::Output, "data,fsdp,expert | context | tensor"},
      {"pipeline-large-moe", Row::WiBias, "expert | tensor"},
      {"pipeline-large-moe", Row::DenseDispatch, "expert | data,fsdp | . | tensor"},
      {"pipeline-large-moe", Row::DenseMask, "data,fsdp | context | . | ."},
      // ep-tp (this library's rules: MaxText's snapshot has no file for it)
      {"ep-tp", Row::WiStorage, "expert | fsdp | ."},
      {"ep-tp", Row::WoStorage, "expert | . | fsdp"},
      {"ep-tp", Row::GateKernel, "fsdp | ."},
      {"ep-tp", Row::WiInSpec, "expert | . | ."},
      {"ep-tp", Row::WoInSpec, "expert | . | ."},
      {"ep-tp", Row::XInSpec, "data,fsdp | . | ."},
      {"ep-tp", Row::Output, "data,fsdp | . | expert"},
      {"ep-tp", Row::WiBias, "expert | ."},
      {"ep-tp", Row::DenseDispatch, "expert | data,fsdp | . | ."},
      {"ep-tp", Row::DenseMask, "data,fsdp | . | . | ."},
  };
}

void PrintTo(Cell const& c, std::ostream* os) {
  *os << c.preset << " " << row_name(c.row) << ": " << c.expected;
}

class ResolvedMoeTensors : public ::testing::TestWithParam<Cell> {};

}  // namespace

TEST_P(ResolvedMoeTensors, MatchesSemanticsTable) {
  auto const& cell = GetParam();
  auto const p = sh::preset(cell.preset);
  Mesh const mesh = uniform_mesh(p.mesh_axes, 2);
  EXPECT_SPEC(resolve_row(p, mesh, cell.row), cell.expected);
}

INSTANTIATE_TEST_SUITE_P(AllPresets, ResolvedMoeTensors, ::testing::ValuesIn(table_cells()),
                         [](auto const& info) {
                           std::string n = info.param.preset + "_" + row_name(info.param.row);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(ShardingPresets, TableCoversEveryPresetAndRow) {
  std::set<std::pair<std::string, int>> seen;
  for (auto const& c : table_cells()) seen.emplace(c.preset, static_cast<int>(c.row));
  EXPECT_EQ(seen.size(), sh::preset_names().size() * 10);
}

TEST(ShardingPresets, ActivationConstraintsDropSizeOneAxes) {
  auto const p = sh::preset("default");
  std::vector<std::pair<std::string, int>> sizes;
  for (auto const& a : p.mesh_axes)
    sizes.emplace_back(a, a == "data" ? 2 : a == "fsdp" ? 4 : a == "expert" ? 2 : 1);
  Mesh const mesh(sizes);
  EXPECT_SPEC(resolve_row(p, mesh, Row::XInSpec), "data,fsdp,expert | . | .");
  EXPECT_SPEC(resolve_row(p, mesh, Row::WiInSpec), "expert | . | .");
  EXPECT_SPEC(resolve_row(p, mesh, Row::DenseDispatch), ". | data,fsdp,expert | . | .");
  // Storage specs keep size-1 axes.
  EXPECT_SPEC(resolve_row(p, mesh, Row::WiStorage), "expert | " + kFcc + " | " + kMlp);
}

TEST(ShardingPresets, MeshAxesPerPreset) {
  EXPECT_EQ(sh::preset("default").mesh_axes, sh::base_mesh_axes());
  EXPECT_EQ(sh::preset("").mesh_axes, sh::base_mesh_axes());
  EXPECT_EQ(sh::preset("").rules, sh::default_rules());
  EXPECT_EQ(sh::base_mesh_axes().size(), 12u);
  EXPECT_EQ(sh::preset("pure-fsdp").mesh_axes, (std::vector<std::string>{"fsdp"}));
  EXPECT_EQ(sh::preset("ep-as-dp").mesh_axes,
            (std::vector<std::string>{"data", "fsdp", "fsdp_transpose", "expert"}));
  EXPECT_EQ(sh::preset("ep-as-cp").mesh_axes,
            (std::vector<std::string>{"data", "stage", "fsdp", "expert"}));
  EXPECT_EQ(sh::preset("cp-as-ep").mesh_axes,
            (std::vector<std::string>{"data", "stage", "fsdp", "context", "expert"}));
  EXPECT_EQ(
      sh::preset("shard-exp-on-fsdp").mesh_axes,
      (std::vector<std::string>{"data", "stage", "fsdp", "fsdp_transpose", "context", "expert"}));
  EXPECT_EQ(sh::preset("pipeline-large-moe").mesh_axes,
            (std::vector<std::string>{"data", "stage", "fsdp", "context", "tensor", "expert"}));
  EXPECT_EQ(sh::preset("ep-tp").mesh_axes, (std::vector<std::string>{"data", "fsdp", "expert"}));
  // Every axis a preset's rules name is one of its mesh axes.
  for (auto const& name : sh::preset_names()) {
    auto const p = sh::preset(name);
    for (auto const& r : p.rules.rules())
      for (auto const& a : r.axes)
        EXPECT_NE(std::find(p.mesh_axes.begin(), p.mesh_axes.end(), a), p.mesh_axes.end())
            << name << ": rule " << r.name << " names " << a;
  }
}

TEST(ShardingPresets, ScanDimensionAndExtras) {
  EXPECT_SPEC(sh::default_rules().resolve(la("layers,moe_layers,exp_with_fsdp")),
              "stage | . | fsdp");
  EXPECT_SPEC(sh::preset("ep-as-cp").rules.resolve(la("activation_length,activation_exp")),
              "expert | .");
  EXPECT_SPEC(sh::preset("ep-as-cp").rules.resolve(la("mlp")), ".");
}

TEST(ShardingPresets, ExpertShardsEmbedMovesExpertFromBatchToEmbed) {
  auto const r = sh::expert_shards_embed(sh::default_rules());
  EXPECT_SPEC(r.resolve(la("activation_batch,activation_norm_length,activation_embed")),
              "data,fsdp,fsdp_transpose | " + kNorm + " | tensor,expert");
  EXPECT_SPEC(r.resolve(la("activation_batch_moe,activation_embed_moe")),
              "data,fsdp,fsdp_transpose | tensor,expert");
  // Weight rules are kept; a rule set without embed rules gets them.
  EXPECT_SPEC(r.resolve(la("exp,embed_moe,mlp_moe")), "expert | " + kFcc + " | " + kMlp);
  auto const f = sh::expert_shards_embed(sh::preset("pure-fsdp").rules);
  EXPECT_SPEC(f.resolve(la("activation_batch,activation_embed")), "fsdp | expert");
  // The ep-tp preset already splits the embedding over expert: applying it again changes nothing.
  EXPECT_EQ(sh::expert_shards_embed(sh::preset("ep-tp").rules), sh::preset("ep-tp").rules);
}

TEST(ShardingPresets, UnknownPresetListsKnownOnes) {
  expect_config_error([] { sh::preset("ep-as-tp"); },
                      {"'ep-as-tp'", "default", "pure-fsdp", "ep-as-dp", "ep-as-cp", "cp-as-ep",
                       "shard-exp-on-fsdp", "pipeline-large-moe", "ep-tp"});
}

// ---------------------------------------------------------------------------------------------
// Mesh (pure part)

TEST(ShardingMesh, CoordinatesAreRowMajorFirstAxisSlowest) {
  Mesh const mesh({{"data", 2}, {"fsdp", 3}, {"expert", 2}});
  EXPECT_EQ(mesh.num_ranks(), 12);
  EXPECT_EQ(mesh.num_axes(), 3);
  EXPECT_EQ(mesh.coords(0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(mesh.coords(1), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(mesh.coords(2), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(mesh.coords(7), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(mesh.coords(11), (std::vector<int>{1, 2, 1}));
  for (int r = 0; r < 12; ++r) EXPECT_EQ(mesh.rank_of(mesh.coords(r)), r);
  EXPECT_EQ(mesh.coord(7, "data"), 1);
  EXPECT_EQ(mesh.coord(7, "tensor"), 0);
  EXPECT_EQ(mesh.size("fsdp"), 3);
  EXPECT_EQ(mesh.size("tensor"), 1);
  EXPECT_EQ(mesh.index("expert"), 2);
  EXPECT_EQ(mesh.index("tensor"), -1);
  EXPECT_EQ(mesh.to_string(), "data=2 x fsdp=3 x expert=2");
  expect_config_error([&] { mesh.coords(12); }, {"rank 12", "12 ranks"});
  expect_config_error([&] { mesh.rank_of({0, 3, 0}); }, {"coordinate 3", "'fsdp'"});
  EXPECT_EQ(Mesh().num_ranks(), 1);
}

TEST(ShardingMesh, Groups) {
  Mesh const mesh({{"data", 2}, {"fsdp", 3}, {"fsdp_transpose", 2}, {"expert", 2}});
  std::vector<std::vector<std::string>> const sets{{"fsdp", "fsdp_transpose"},
                                                   {"data", "fsdp", "expert"},
                                                   {"expert", "data"},
                                                   {"fsdp"},
                                                   {},
                                                   {"data", "fsdp", "fsdp_transpose", "expert"},
                                                   {"tensor", "expert"}};
  for (auto const& axes : sets) {
    int const gs = mesh.group_size(axes);
    EXPECT_EQ(gs * mesh.num_groups(axes), mesh.num_ranks());
    std::set<int> indices;
    for (int r = 0; r < mesh.num_ranks(); ++r) {
      auto const members = mesh.group_members(r, axes);
      ASSERT_EQ(static_cast<int>(members.size()), gs);
      EXPECT_EQ(members[static_cast<std::size_t>(mesh.rank_in_group(r, axes))], r);
      int const g = mesh.group_index(r, axes);
      EXPECT_GE(g, 0);
      EXPECT_LT(g, mesh.num_groups(axes));
      indices.insert(g);
      for (int k = 0; k < gs; ++k) {
        int const m = members[static_cast<std::size_t>(k)];
        EXPECT_EQ(mesh.group_index(m, axes), g);
        EXPECT_EQ(mesh.rank_in_group(m, axes), k);
        // Members differ from r only on the group's axes.
        for (int i = 0; i < mesh.num_axes(); ++i) {
          if (std::find(axes.begin(), axes.end(), mesh.name(i)) == axes.end()) {
            EXPECT_EQ(mesh.coords(m)[static_cast<std::size_t>(i)],
                      mesh.coords(r)[static_cast<std::size_t>(i)]);
          }
        }
      }
    }
    EXPECT_EQ(static_cast<int>(indices.size()), mesh.num_groups(axes));
  }
  // Order inside a group follows the order the axes are given in.
  // rank 0 = (0,0,0,0); group {data, expert} = ranks with fsdp=0, fsdp_t=0.
  EXPECT_EQ(mesh.group_members(0, {"data", "expert"}), (std::vector<int>{0, 1, 12, 13}));
  EXPECT_EQ(mesh.group_members(0, {"expert", "data"}), (std::vector<int>{0, 12, 1, 13}));
  EXPECT_EQ(mesh.group_members(5, {"fsdp", "fsdp_transpose"}),
            (std::vector<int>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(mesh.group_index(13, {"data", "expert"}), 0);
  EXPECT_EQ(mesh.group_index(2, {"data", "expert"}), 1);  // fsdp=0, fsdp_t=1
  expect_config_error([&] { mesh.group_size({"fsdp", "fsdp"}); }, {"'fsdp'", "twice"});
}

TEST(ShardingMesh, ExplicitAxesValidation) {
  expect_config_error([] { Mesh({{"data", 2}, {"data", 2}}); }, {"'data'", "twice"});
  expect_config_error([] { Mesh({{"data", 0}}); }, {"'data'", "size 0"});
  expect_config_error([] { Mesh({{"", 2}}); }, {"empty name"});
}

TEST(ShardingMesh, FromIciDegrees) {
  auto const m = Mesh::from_ici(
      {{"ici_data_parallelism", 2}, {"ici_fsdp_parallelism", -1}, {"ici_expert_parallelism", 2}},
      16);
  EXPECT_EQ(m.axis_names(), sh::base_mesh_axes());
  EXPECT_EQ(m.size("data"), 2);
  EXPECT_EQ(m.size("fsdp"), 4);
  EXPECT_EQ(m.size("expert"), 2);
  EXPECT_EQ(m.size("tensor"), 1);
  EXPECT_EQ(m.num_ranks(), 16);
  // No -1: product must match.
  auto const m2 = Mesh::from_ici({{"ici_tensor_parallelism", 2},
                                  {"ici_context_parallelism", 2},
                                  {"ici_fsdp_transpose_parallelism", 1}},
                                 4);
  EXPECT_EQ(m2.size("tensor"), 2);
  EXPECT_EQ(m2.size("context"), 2);
  // A preset's own mesh axes.
  auto const m3 =
      Mesh::from_ici({{"ici_expert_parallelism", -1}}, 4, sh::preset("ep-as-cp").mesh_axes);
  EXPECT_EQ(m3.to_string(), "data=1 x stage=1 x fsdp=1 x expert=4");
  // Every degree 1 and the fill axis takes it all; fill gets 1 when nothing is left.
  EXPECT_EQ(
      Mesh::from_ici({{"ici_data_parallelism", 4}, {"ici_fsdp_parallelism", -1}}, 4).size("fsdp"),
      1);

  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", 2}, {"ici_expert_parallelism", 4}}, 4);
      },
      {"ici_*_parallelism", "data=2", "expert=4", "= 8", "communicator size 4"});
  expect_config_error([] { Mesh::from_ici({}, 2); }, {"= 1", "communicator size 2"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", -1}, {"ici_fsdp_parallelism", -1}}, 4);
      },
      {"'data'", "'fsdp'", "both -1"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", 3}, {"ici_fsdp_parallelism", -1}}, 4);
      },
      {"'fsdp' is -1", "= 3", "does not divide the communicator size 4"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", 0}}, 4);
      },
      {"ici_data_parallelism=0", ">= 1"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", -2}}, 4);
      },
      {"ici_data_parallelism=-2"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_bogus_parallelism", 2}}, 4);
      },
      {"'ici_bogus_parallelism'", "ici_expert_parallelism"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_tensor_parallelism", 2}}, 2, sh::preset("ep-as-dp").mesh_axes);
      },
      {"'tensor'", "not one of the mesh axes"});
  expect_config_error(
      [] {
        Mesh::from_ici({{"ici_data_parallelism", 2}, {"ici_data_parallelism", 2}}, 4);
      },
      {"'ici_data_parallelism'", "twice"});
}

// ---------------------------------------------------------------------------------------------
// YAML loader of the tools

namespace {

/// Writes `text` to a fresh temporary file, removed at scope exit.
class TempFile {
 public:
  explicit TempFile(std::string const& text) {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "moe_sharding_XXXXXX.yml").string();
    int const fd = ::mkstemps(&tmpl[0], 4);
    if (fd < 0) throw std::runtime_error("mkstemps failed");
    ::close(fd);
    path_ = tmpl;
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  std::string const& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

TEST(ShardingYaml, FlowStyle) {
  TempFile const f(R"(
base_emb_dim: 512            # other keys are ignored
mesh_axes: ['data', 'fsdp', "expert"]
logical_axis_rules: [
  ['activation_batch', ['data', 'fsdp']],
  ['exp', 'expert'],
  ['mlp', []],
  ['embed', null],
  ['embed', ['fsdp']],
]
)");
  auto const s = moe::cli::load_sharding_yaml(f.path());
  EXPECT_TRUE(s.has_mesh_axes);
  EXPECT_TRUE(s.has_rules);
  EXPECT_EQ(s.mesh_axes, (std::vector<std::string>{"data", "fsdp", "expert"}));
  LogicalRules const expected{{"activation_batch", {"data", "fsdp"}},
                              {"exp", {"expert"}},
                              {"mlp", {}},
                              {"embed", {}},
                              {"embed", {"fsdp"}}};
  EXPECT_EQ(s.rules, expected);
  EXPECT_TRUE(s.custom_mesh_and_rule.empty());
  EXPECT_SPEC(s.rules.resolve(la("activation_batch,exp,embed")), "data,fsdp | expert | .");
}

TEST(ShardingYaml, BlockStyle) {
  auto const s = moe::cli::parse_sharding_yaml_text(R"(
mesh_axes:
  - data
  - expert
logical_axis_rules:
  - - activation_batch
    - - data
      - expert
  - - exp
    - expert
  - - mlp
    - []
custom_mesh_and_rule: ep-as-cp
)");
  EXPECT_EQ(s.mesh_axes, (std::vector<std::string>{"data", "expert"}));
  LogicalRules const expected{
      {"activation_batch", {"data", "expert"}}, {"exp", {"expert"}}, {"mlp", {}}};
  EXPECT_EQ(s.rules, expected);
  EXPECT_EQ(s.custom_mesh_and_rule, "ep-as-cp");
}

TEST(ShardingYaml, EffectiveShardingPrefersPresets) {
  auto const s = moe::cli::parse_sharding_yaml_text(
      "mesh_axes: [data, expert]\nlogical_axis_rules: [[exp, expert]]\n");
  auto const own = moe::cli::effective_sharding(&s, "");
  EXPECT_EQ(own.mesh_axes, s.mesh_axes);
  EXPECT_EQ(own.rules, s.rules);
  auto const pre = moe::cli::effective_sharding(&s, "pure-fsdp");
  EXPECT_EQ(pre.mesh_axes, sh::preset("pure-fsdp").mesh_axes);
  EXPECT_EQ(pre.rules, sh::preset("pure-fsdp").rules);
  auto const in_file = moe::cli::parse_sharding_yaml_text(
      "custom_mesh_and_rule: cp-as-ep\nlogical_axis_rules: [[exp, expert]]\n");
  EXPECT_EQ(moe::cli::effective_sharding(&in_file, "").rules, sh::preset("cp-as-ep").rules);
  auto const empty = moe::cli::parse_sharding_yaml_text("base_emb_dim: 4\n");
  auto const dflt = moe::cli::effective_sharding(&empty, "");
  EXPECT_EQ(dflt.mesh_axes, sh::base_mesh_axes());
  EXPECT_EQ(dflt.rules, sh::default_rules());
  EXPECT_EQ(moe::cli::effective_sharding(nullptr, "ep-as-dp").name, "ep-as-dp");
}

TEST(ShardingYaml, Errors) {
  using moe::cli::parse_sharding_yaml_text;
  expect_config_error([] { parse_sharding_yaml_text("logical_axis_rules: [[exp]]"); },
                      {"logical_axis_rules[0]", "pair"});
  expect_config_error([] { parse_sharding_yaml_text("logical_axis_rules: [[exp, {a: 1}]]"); },
                      {"logical_axis_rules[0]", "'exp'"});
  expect_config_error([] { parse_sharding_yaml_text("logical_axis_rules: [[exp, [a, [b]]]]"); },
                      {"logical_axis_rules[0]", "axis 1", "list"});
  expect_config_error([] { parse_sharding_yaml_text("logical_axis_rules: [[exp, [a, a]]]"); },
                      {"logical_axis_rules[0]", "'a' twice"});
  expect_config_error([] { parse_sharding_yaml_text("logical_axis_rules: exp"); },
                      {"list of [name, axes]"});
  expect_config_error([] { parse_sharding_yaml_text("mesh_axes: data"); }, {"mesh_axes"});
  expect_config_error([] { parse_sharding_yaml_text("mesh_axes: [data, data]"); },
                      {"'data' twice"});
  expect_config_error([] { parse_sharding_yaml_text("[1, 2]"); }, {"mapping"});
  expect_config_error([] { parse_sharding_yaml_text("a: [1"); }, {"not valid YAML"});
  expect_config_error([] { moe::cli::load_sharding_yaml("/nonexistent/x.yml"); },
                      {"cannot read", "/nonexistent/x.yml"});
}

// ---------------------------------------------------------------------------------------------
// The moe-shard tool

namespace {

struct ToolResult {
  int status = -1;
  std::string out, err;
};

ToolResult run_tool(std::string const& args) {
#ifdef MOE_SHARD_EXE
  TempFile const err("");
  std::string const cmd =
      std::string("'") + MOE_SHARD_EXE + "' " + args + " 2>'" + err.path() + "'";
  ToolResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int const st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream in(err.path());
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return r;
#else
  (void)args;
  return {};
#endif
}

}  // namespace

TEST(MoeShardTool, PresetQuery) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  auto const r = run_tool(
      "--preset shard-exp-on-fsdp --mesh fsdp=4,expert=2,context=2 "
      "--tensor wi_0=exp,embed_moe,mlp_moe --tensor x=activation_batch,activation_norm_length,None "
      "--tensor scalar=");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out,
            "{\"mesh\": {\"data\": 1, \"stage\": 1, \"fsdp\": 4, \"fsdp_transpose\": 1, "
            "\"context\": 2, \"expert\": 2}, \"tensors\": {\"wi_0\": [[\"expert\", \"fsdp\"], "
            "\"context\", \"fsdp_transpose\"], \"x\": [[\"data\", \"fsdp\", \"fsdp_transpose\", "
            "\"expert\"], \"context\", null], \"scalar\": []}}\n");
  auto const d = run_tool(
      "--preset shard-exp-on-fsdp --mesh fsdp=4,expert=2,context=2 --drop-size-one "
      "--tensor wi_0=exp,embed_moe,mlp_moe --tensor "
      "x=activation_batch,activation_norm_length,None");
  EXPECT_EQ(d.status, 0) << d.err;
  EXPECT_NE(d.out.find("\"wi_0\": [[\"expert\", \"fsdp\"], \"context\", null]"), std::string::npos)
      << d.out;
  EXPECT_NE(d.out.find("\"x\": [[\"fsdp\", \"expert\"], \"context\", null]"), std::string::npos)
      << d.out;
}

TEST(MoeShardTool, RulesFileAndDefaults) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  TempFile const f(
      "mesh_axes: [data, fsdp, expert]\n"
      "logical_axis_rules: [[batch, [data, expert]], [exp, expert], [emb, [fsdp, expert]], "
      "[emb, fsdp]]\n");
  auto const r = run_tool("--rules '" + f.path() +
                          "' --mesh expert=4 --mesh data=2 "
                          "--tensor w=exp,emb --tensor a=batch,None,unknown");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out,
            "{\"mesh\": {\"data\": 2, \"fsdp\": 1, \"expert\": 4}, \"tensors\": {\"w\": "
            "[\"expert\", \"fsdp\"], \"a\": [[\"data\", \"expert\"], null, null]}}\n");
  // The library defaults through --preset default.
  auto const d = run_tool(
      "--preset default --mesh expert=2,fsdp=2 --drop-size-one "
      "--tensor dispatch=activation_exp,activation_batch_moe,None,"
      "activation_embed_moe");
  EXPECT_EQ(d.status, 0) << d.err;
  EXPECT_NE(d.out.find("\"dispatch\": [null, [\"fsdp\", \"expert\"], null, null]"),
            std::string::npos)
      << d.out;
}

TEST(MoeShardTool, ErrorsAreOneLineExitTwo) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  auto check = [](std::string const& args, std::string const& fragment) {
    auto const r = run_tool(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_TRUE(r.out.empty()) << args;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << args << " -> " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  check("--preset nope --mesh data=2", "known: default");
  check("--preset pure-fsdp --mesh expert=2", "'expert' is not a mesh axis");
  check("--preset default --mesh data=0", "not a positive integer");
  check("--preset default --mesh data=2 --tensor t=exp,exp", "twice");
  check("--mesh data=2 --tensor t=exp", "--rules FILE.yml or --preset NAME is required");
  check("--preset default --tensor t=exp", "--mesh");
  check("--rules /nonexistent.yml --mesh data=1", "cannot read");
  check("--preset default --mesh data=2 --bogus", "unknown flag");
  check("--plan /nonexistent/cfg.yml num_experts=4 --json",
        "--plan '/nonexistent/cfg.yml' does not exist");
}
