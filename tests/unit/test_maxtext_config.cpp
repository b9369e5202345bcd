// The MaxText config loader of the tools (examples/common/moe_maxtext_config.hpp) and the model
// table (moe/models.hpp): several files in order then overrides, later wins; nested
// logical_axis_rules merged as MaxText merges them and used by the layout; the ignored-keys
// summary; unknown, rejected and model_name errors; the README's MaxText key table.
#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/models.hpp>

#include <moe_maxtext_config.hpp>

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace mt = moe::cli::maxtext;

/// YAML files in a scratch directory, removed at the end of the test.
struct Files {
  fs::path dir;
  Files() {
    dir = fs::temp_directory_path() /
          ("moe_maxtext_test_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Files() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string write(std::string const& name, std::string const& text) const {
    auto const p = (dir / name).string();
    std::ofstream(p) << text;
    return p;
  }
};

bool layer_or_parallel(std::string const& k) {
  return moe::LayerConfig::has_key(k) || moe::ParallelConfig::has_key(k);
}

mt::Loaded load(std::vector<std::string> const& files, moe::cli::KeyValues const& overrides = {}) {
  return mt::load(files, overrides, layer_or_parallel, moe::cli::known_keys());
}

/// The loaded keys applied, as the tools apply them.
void apply(mt::Loaded const& l, moe::LayerConfig& cfg, moe::ParallelConfig& par) {
  moe::cli::apply(cfg, par, l.apply);
  l.apply_sharding(par);
}

std::string error_of(std::function<void()> const& f) {
  try {
    f();
  } catch (moe::ConfigError const& e) {
    return e.what();
  }
  return "";
}

bool has(std::string const& s, std::string const& part) {
  return s.find(part) != std::string::npos;
}

TEST(MaxTextConfig, FilesInOrderThenOverridesLaterWins) {
  Files f;
  auto const a = f.write("a.yml",
                         "num_experts: 8\nbase_emb_dim: 16\nbase_moe_mlp_dim: 32\n"
                         "capacity_factor: -1.0\nmlp_activations: [\"silu\", \"linear\"]\n");
  auto const b = f.write("b.yml", "num_experts: 4\nnum_experts_per_tok: 2\n");
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  apply(load({a, b}, {{"num_experts_per_tok", "3"}}), cfg, par);
  EXPECT_EQ(cfg.num_experts, 4);          // b after a
  EXPECT_EQ(cfg.num_experts_per_tok, 3);  // the override after the files
  EXPECT_EQ(cfg.base_emb_dim, 16);
  EXPECT_EQ(cfg.base_moe_mlp_dim, 32);
  EXPECT_EQ(cfg.capacity_factor, -1.0);  // MaxText's "no capacity limit"
  EXPECT_FALSE(par.sharding);            // no mesh_axes / rules in the files
  // The other order.
  moe::LayerConfig c2;
  moe::ParallelConfig p2;
  apply(load({b, a}), c2, p2);
  EXPECT_EQ(c2.num_experts, 8);
  // A key twice in one file, or twice on the command line, stays an error.
  auto const dup = f.write("dup.yml", "num_experts: 8\nnum_experts: 4\n");
  EXPECT_TRUE(has(error_of([&] { load({dup}); }), "sets key 'num_experts' twice (lines 1 and 2)"));
  EXPECT_TRUE(has(error_of([&] {
                    load({}, {{"num_experts", "2"}, {"num_experts", "3"}});
                  }),
                  "the command line sets key 'num_experts' twice"));
  // MaxText's digit separators.
  auto const sep = f.write("sep.yml", "base_moe_mlp_dim: 1_024\nrouted_score_func: \"1_0\"\n");
  auto const l = load({sep});
  EXPECT_EQ(l.apply[0].second, "1024");
  EXPECT_EQ(l.apply[1].second, "1_0");  // quoted: a string, left alone
}

TEST(MaxTextConfig, NestedRulesAreMergedAndReachTheLayout) {
  Files f;
  // A MaxText-shaped base: nested rules, a mesh, and non-MoE keys with nested values.
  auto const base =
      f.write("base.yml",
              "mesh_axes: ['data', 'fsdp', 'expert']\n"
              "logical_axis_rules: [\n"
              "  ['activation_batch', ['data', 'fsdp', 'expert']],\n"
              "  ['activation_embed', []],\n"
              "  ['exp', 'expert'],\n"
              "  ['embed_moe', ['fsdp']],\n"
              "]\n"
              "data_sharding: [['data', 'fsdp', 'expert']]\n"
              "num_experts: 8\nbase_emb_dim: 16\nbase_moe_mlp_dim: 32\nnum_experts_per_tok: 2\n");
  // A model file that moves the experts off the expert axis.
  auto const model = f.write("model.yml", "logical_axis_rules: [['exp', []]]\n");
  {
    auto const l = load({base});
    ASSERT_TRUE(l.sharding);
    EXPECT_EQ(l.sharding->mesh_axes, (std::vector<std::string>{"data", "fsdp", "expert"}));
    ASSERT_EQ(l.sharding->rules.size(), 4u);
    EXPECT_EQ(l.sharding->rules.rules()[2].name, "exp");
    EXPECT_EQ(l.sharding->rules.rules()[2].axes, (std::vector<std::string>{"expert"}));
    EXPECT_EQ(l.ignored_count(), 1u);  // data_sharding
  }
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  apply(load({base}, {{"ici_expert_parallelism", "2"}}), cfg, par);
  ASSERT_TRUE(par.sharding);
  auto const with_ep = moe::make_plan(cfg, par, 2, 0, 4, 2);
  EXPECT_EQ(with_ep.layout.ep_axes, (std::vector<std::string>{"expert"}));
  EXPECT_EQ(with_ep.layout.mesh.axis_names(), (std::vector<std::string>{"data", "fsdp", "expert"}));
  // Merged: the model's 'exp' rule replaces base's, the others stay (MaxText's merge).
  moe::LayerConfig c2;
  moe::ParallelConfig p2;
  auto const merged = load({base, model}, {{"ici_expert_parallelism", "2"}});
  ASSERT_EQ(merged.sharding->rules.size(), 4u);
  EXPECT_EQ(merged.sharding->rules.rules()[3].name, "exp");
  EXPECT_TRUE(merged.sharding->rules.rules()[3].axes.empty());
  apply(merged, c2, p2);
  auto const no_ep = moe::make_plan(c2, p2, 2, 0, 4, 2);
  EXPECT_TRUE(no_ep.layout.ep_axes.empty()) << "the file's rules must reach the layout";
  // override_logical_axis_rules: the model's rules replace the whole list.
  auto const repl = f.write("repl.yml",
                            "override_logical_axis_rules: true\n"
                            "logical_axis_rules: [['exp', 'expert']]\n");
  EXPECT_EQ(load({base, repl}).sharding->rules.size(), 1u);
  // Rules on the command line, as YAML text.
  auto const cl = load({base}, {{"logical_axis_rules", "[['embed_moe', []]]"}});
  EXPECT_EQ(cl.sharding->rules.size(), 4u);
  EXPECT_TRUE(cl.sharding->rules.rules()[3].axes.empty());
  // A preset replaces the files' mesh and rules (MaxText's custom_mesh_and_rule).
  moe::LayerConfig c3;
  moe::ParallelConfig p3;
  apply(load({base}, {{"custom_mesh_and_rule", "pure-fsdp"}}), c3, p3);
  EXPECT_FALSE(p3.sharding);
  EXPECT_EQ(p3.effective_preset().name, "pure-fsdp");
  // The precedence lives in ParallelConfig itself: a named preset wins over a set `sharding`,
  // whichever order a tool applies them in.
  p3.sharding = load({base}).sharding;
  ASSERT_TRUE(p3.sharding);
  EXPECT_EQ(p3.effective_preset().name, "pure-fsdp");
  p3.custom_mesh_and_rule = "";
  EXPECT_EQ(p3.effective_preset().name, "file");
  // The ranks compare describe(): the rules are part of it, only when set.
  EXPECT_TRUE(has(par.describe(), "sharding=[data,fsdp,expert,](activation_batch:"));
  EXPECT_FALSE(has(moe::ParallelConfig().describe(), "sharding"));
  // A bad rule names the file.
  auto const bad = f.write("bad.yml", "logical_axis_rules: [['exp']]\n");
  EXPECT_TRUE(has(error_of([&] { load({bad}); }), "must be a pair [name, axes]"));
}

TEST(MaxTextConfig, IgnoredKeysAreSummarisedByCategory) {
  Files f;
  auto const a = f.write("a.yml",
                         "base_num_query_heads: 32\nhead_dim: 128\ndataset_type: tfds\n"
                         "tokenizer_path: x\nenable_checkpointing: true\nprofiler: ''\n"
                         "steps: 150_001\nnum_experts: 4\nbase_moe_mlp_dim: 8\n");
  auto const b = f.write("b.yml", "head_dim: 64\nopt_type: adamw\nlearning_rate: 3.e-5\n");
  auto const l = load({a, b});
  EXPECT_EQ(l.ignored_count(), 9u);  // head_dim once
  EXPECT_EQ(l.ignored_summary(),
            "ignored MaxText keys: 9 (data 2, model 2, optimizer 2, checkpointing 1, profiler 1, "
            "training 1)");
  EXPECT_EQ(load({}, {{"num_experts", "2"}}).ignored_summary(), "");
  // A key the tool applies is not ignored (train_moe takes steps, learning_rate).
  auto const t = mt::load({a, b}, {},
                          [](std::string const& k) {
                            return layer_or_parallel(k) || k == "steps" || k == "learning_rate";
                          },
                          {});
  EXPECT_EQ(t.ignored_count(), 7u);
  EXPECT_EQ(t.apply[0], (std::pair<std::string, std::string>("steps", "150001")));
}

TEST(MaxTextConfig, UnknownAndRejectedKeys) {
  Files f;
  auto const typo = f.write("typo.yml", "num_expert: 4\n");
  auto const e = error_of([&] { load({typo}); });
  EXPECT_TRUE(has(e, "config file '" + typo + "': unknown config key 'num_expert' (value '4')"))
      << e;
  EXPECT_TRUE(has(e, "did you mean 'num_experts'")) << e;
  EXPECT_TRUE(has(error_of([&] { load({}, {{"megabloks", "true"}}); }), "did you mean 'megablox'"));
  EXPECT_TRUE(has(error_of([&] { load({}, {{"bogus_key", "1"}}); }), "unknown config key"));
  // Rejected keys: accepted at MaxText's default (and the listed values), an error otherwise.
  auto const ok = f.write("ok.yml",
                          "num_moe_token_chunks: 1\nmlp_bias: false\nmoe_expert_input_dim: -1\n"
                          "dcn_data_parallelism: -1\nnum_slices: 1\nmlp_activations_limit: -1.0\n"
                          "ici_pipeline_parallelism: 1\n");
  EXPECT_EQ(error_of([&] { load({ok}); }), "");
  auto const bias = error_of([&] { load({ok}, {{"mlp_bias", "true"}}); });
  EXPECT_TRUE(has(bias,
                  "the command line: mlp_bias=true is not supported: biases of the expert "
                  "MLPs (GPT-OSS) are not implemented (accepted: false)"))
      << bias;
  EXPECT_TRUE(has(error_of([&] {
                    load({}, {{"num_moe_token_chunks", "4"}});
                  }),
                  "num_moe_token_chunks=4 is not supported"));
  EXPECT_TRUE(has(error_of([&] { load({}, {{"dcn_expert_parallelism", "2"}}); }), "one level"));
  // A non-default value in a file, reset by a later override: accepted (the final value counts).
  auto const chunks = f.write("chunks.yml", "num_moe_token_chunks: 4\n");
  EXPECT_EQ(error_of([&] { load({chunks}, {{"num_moe_token_chunks", "1"}}); }), "");
  // Policies and no-ops take any value.
  EXPECT_EQ(error_of([&] {
              load({}, {{"megablox", "false"},
                        {"use_custom_sort_vjp", "false"},
                        {"wi_tile_fwd_batch_seq", "256"},
                        {"float32_weight_sum", "false"}});
            }),
            "");
  // decoder_block: MaxText's generic blocks take the generic path, others are refused.
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  apply(load({}, {{"decoder_block", "llama2"}}), cfg, par);
  EXPECT_EQ(cfg.decoder_block, moe::DecoderBlock::Mixtral);
  apply(load({}, {{"decoder_block", "deepseek"}}), cfg, par);
  EXPECT_EQ(cfg.decoder_block, moe::DecoderBlock::DeepSeek);
  EXPECT_TRUE(has(error_of([&] {
                    load({}, {{"decoder_block", "gpt_oss"}});
                  }),
                  "decoder_block=gpt_oss: the MoE layer of MaxText's 'gpt_oss' block"));
  EXPECT_TRUE(has(error_of([&] {
                    apply(load({}, {{"decoder_block", "mixtrall"}}), cfg, par);
                  }),
                  "mixtrall"));
  // base.yml's base_moe_mlp_dim: -1 asks for a value.
  auto const unset = f.write("unset.yml", "num_experts: 1\nbase_moe_mlp_dim: -1\n");
  EXPECT_TRUE(has(error_of([&] { load({unset}); }), "base_moe_mlp_dim=-1 is MaxText's 'not set'"));
  EXPECT_EQ(error_of([&] { load({unset}, {{"base_moe_mlp_dim", "8"}}); }), "");
  // Nested values are refused for keys the tool applies.
  auto const nested = f.write("nested.yml", "num_experts: [[1]]\n");
  EXPECT_TRUE(has(error_of([&] { load({nested}); }), "nested lists"));
}

TEST(MaxTextConfig, ModelNameGivesThePublishedShapes) {
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  apply(load({}, {{"model_name", "deepseek3-671b"}}), cfg, par);
  EXPECT_EQ(cfg.num_experts, 256);
  EXPECT_EQ(cfg.num_experts_per_tok, 8);
  EXPECT_EQ(cfg.base_emb_dim, 7168);
  EXPECT_EQ(cfg.base_moe_mlp_dim, 2048);
  EXPECT_EQ(cfg.shared_experts, 1);
  EXPECT_EQ(cfg.decoder_block, moe::DecoderBlock::DeepSeek);
  EXPECT_EQ(cfg.routed_score_func, moe::ScoreFunc::Sigmoid);
  EXPECT_TRUE(cfg.routed_bias);
  EXPECT_EQ(cfg.routed_scaling_factor, 2.5);
  EXPECT_EQ(cfg.n_routing_groups, -1);
  EXPECT_NO_THROW(cfg.validate());
  // Keys after model_name (the command line) win; config files come before it.
  Files f;
  auto const file = f.write("f.yml", "num_experts: 4\nmodel_name: mixtral-8x22b\n");
  moe::LayerConfig c2;
  moe::ParallelConfig p2;
  apply(load({file}, {{"num_experts_per_tok", "1"}}), c2, p2);
  EXPECT_EQ(c2.num_experts, 8);  // the model's keys come after the files (MaxText's order)
  EXPECT_EQ(c2.num_experts_per_tok, 1);
  EXPECT_EQ(c2.base_emb_dim, 6144);
  EXPECT_EQ(c2.base_moe_mlp_dim, 16384);
  moe::LayerConfig c3;
  moe::ParallelConfig p3;
  apply(load({}, {{"model_name", "qwen3-235b-a22b"}, {"num_experts", "64"}}), c3, p3);
  EXPECT_EQ(c3.num_experts, 64);
  EXPECT_TRUE(c3.norm_topk_prob);
  EXPECT_EQ(c3.load_balance_loss_weight, 0.001);
  EXPECT_EQ(c3.base_emb_dim, 4096);
  EXPECT_EQ(c3.decoder_block, moe::DecoderBlock::Mixtral);
  // mixtral-8x7b opts into the dispatch key (MaxText PR #4179); the other models do not.
  moe::LayerConfig c4;
  moe::ParallelConfig p4;
  apply(load({}, {{"model_name", "mixtral-8x7b"}}), c4, p4);
  EXPECT_TRUE(p4.moe_dispatch_no_expert_sharding);
  EXPECT_FALSE(p2.moe_dispatch_no_expert_sharding);
  EXPECT_FALSE(p3.moe_dispatch_no_expert_sharding);
  // "default" is MaxText's base.yml value: no model.
  EXPECT_TRUE(load({}, {{"model_name", "default"}}).apply.empty());
  auto const bad = error_of([&] { load({}, {{"model_name", "mixtral-8x7"}}); });
  EXPECT_TRUE(has(bad, "model_name=mixtral-8x7 is not a MoE model moe knows")) << bad;
  EXPECT_TRUE(has(bad, "did you mean 'mixtral-8x7b'")) << bad;
  // Every model of the table is a valid layer.
  for (auto const& m : moe::model_table()) {
    moe::LayerConfig c;
    for (auto const& [k, v] : m.key_values()) {
      if (moe::LayerConfig::has_key(k)) c.set(k, v);
    }
    EXPECT_NO_THROW(c.validate()) << m.name;
  }
}

/// The MaxText key table of README.md: the first cell of each row between the markers.
std::vector<std::string> readme_table_keys() {
  std::ifstream in(std::string(MOE_SOURCE_DIR) + "/README.md");
  std::string line;
  bool inside = false;
  std::vector<std::string> keys;
  while (std::getline(in, line)) {
    if (line.find("<!-- maxtext-keys:begin -->") != std::string::npos) inside = true;
    if (line.find("<!-- maxtext-keys:end -->") != std::string::npos) inside = false;
    if (!inside || line.rfind("| `", 0) != 0) continue;
    auto const b = line.find('`') + 1;
    keys.push_back(line.substr(b, line.find('`', b) - b));
  }
  return keys;
}

TEST(MaxTextConfig, ReadmeTableListsEveryMoeKeyAndEachIsAccepted) {
  auto const readme = readme_table_keys();
  ASSERT_FALSE(readme.empty()) << "README.md has no MaxText key table";
  std::set<std::string> const listed(readme.begin(), readme.end());
  EXPECT_EQ(listed.size(), readme.size()) << "a key is listed twice";
  for (auto const& k : mt::moe_keys())
    EXPECT_TRUE(listed.count(k.key)) << "README's MaxText key table lacks " << k.key;
  // MaxText's MoE groups are all classified.
  for (auto const& [cat, names] : mt::key_names_by_category()) {
    if (cat != "moe") continue;
    for (auto const& n : names) {
      EXPECT_TRUE(mt::find_moe_key(n)) << n << " is not classified";
    }
  }
  // Every listed key is accepted by the loader (never "unknown"), at MaxText's default for a
  // rejected key.
  for (auto const& k : readme) {
    auto const* m = mt::find_moe_key(k);
    ASSERT_TRUE(m) << k << " is in the README table but not in moe_keys()";
    std::string value = "1";
    if (m->status == mt::Status::Rejected) {
      std::string const acc = m->accepted;
      value = acc.substr(0, acc.find('|'));
    }
    if (k == "model_name") value = "mixtral-8x7b";
    if (k == "mesh_axes") value = "['data']";
    if (k == "logical_axis_rules") value = "[['exp', []]]";
    if (k == "override_logical_axis_rules" || k == "mlp_activations") value = "false";
    if (k == "mlp_activations") value = "[silu, linear]";
    if (k == "decoder_block") value = "mixtral";
    if (k == "routed_score_func") value = "sigmoid";
    if (k == "custom_mesh_and_rule") value = "pure-fsdp";
    if (k == "expert_shard_attention_option") value = "fsdp";
    moe::LayerConfig cfg;
    moe::ParallelConfig par;
    EXPECT_EQ(error_of([&] { apply(load({}, {{k, value}}), cfg, par); }), "") << k << "=" << value;
  }
}

}  // namespace
