// The layer plan (moe::make_plan): layouts of tests/mpi/test_distributed_layer.cpp at 1, 2 and 4
// ranks against hand-computed local shapes, collective kinds, axes and bytes; the SEMANTICS §1.13
// warning; and `moe-shard --plan` (text and JSON).
#include <moe/distributed/plan.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "../mpi/layout_cases.hpp"

namespace {

using moe::LayerPlan;
using Shape = std::vector<std::int64_t>;
using Names = std::vector<std::string>;

/// The layer of tests/mpi/test_distributed_layer.cpp with an lb weight of 0.05.
moe::LayerConfig layer_config(Names const& extra = {}) { return test_layer_config(0.05, extra); }

moe::ParallelConfig parallel_config(Names const& kvs) {
  moe::ParallelConfig par;
  for (auto const& kv : kvs) {
    auto const eq = kv.find('=');
    par.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return par;
}

LayerPlan plan(int ranks, Names const& layout, Names const& layer = {}, std::int64_t batch = 8,
               int rank = 0) {
  return moe::make_plan(layer_config(layer), parallel_config(layout), ranks, rank, batch, 4);
}

/// "F all-gather [fsdp] gather wi_0" per collective.
Names signature(LayerPlan const& p) {
  Names out;
  for (auto const& c : p.collectives) {
    std::string axes;
    for (auto const& a : c.axes) axes += (axes.empty() ? "" : ",") + a;
    out.push_back(std::string(c.backward ? "B " : "F ") + c.kind + " [" + axes + "] " + c.what);
  }
  return out;
}

std::int64_t bytes_of(LayerPlan const& p, std::string const& what, bool backward = false) {
  for (auto const& c : p.collectives)
    if (c.what == what && c.backward == backward) return c.bytes;
  ADD_FAILURE() << "no collective '" << what << "'";
  return -1;
}

void expect_shapes(LayerPlan const& p, std::string const& name, Shape const& local,
                   Shape const& compute) {
  auto const& t = p.tensor(name);
  EXPECT_EQ(t.local_shape, local) << name;
  EXPECT_EQ(t.compute_shape, compute) << name;
}

}  // namespace

TEST(Plan, OneRankHasNoCollectives) {
  auto const p = plan(1, {"ici_data_parallelism=-1"});
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::Local);
  EXPECT_TRUE(p.collectives.empty());
  EXPECT_EQ(p.step_bytes(), 0);
  expect_shapes(p, "x", {8, 4, 16}, {8, 4, 16});
  expect_shapes(p, "wi_0", {8, 16, 8}, {8, 16, 8});
  expect_shapes(p, "shared_wo", {8, 16}, {8, 16});
  EXPECT_TRUE(p.warnings.empty());
}

TEST(Plan, EveryLayoutOfTheLayerTestIsConsistent) {
  struct L {
    Names layout, layer;
    std::int64_t batch;
    int ranks;  // 0: any of 1, 2, 4
  };
  std::vector<L> const layouts = {
      {{"ici_data_parallelism=-1"}, {}, 8, 0},
      {{"ici_fsdp_parallelism=-1"}, {}, 8, 0},
      {{"ici_fsdp_transpose_parallelism=-1"}, {}, 8, 0},
      {{"ici_expert_parallelism=-1"}, {}, 8, 0},
      {{"ici_expert_parallelism=-1", "use_ring_of_experts=true"}, {}, 8, 0},
      {{"ici_tensor_parallelism=-1"}, {}, 8, 0},
      {{"ici_expert_parallelism=-1"},
       {"decoder_block=deepseek", "routed_score_func=sigmoid", "routed_bias=true",
        "n_routing_groups=4", "topk_routing_group=2", "routed_bias_update_rate=0.01"},
       8,
       0},
      {{"ici_expert_parallelism=-1"}, {"capacity_factor=1.0"}, 8, 0},
      {{"ici_fsdp_parallelism=-1"}, {"sparse_matmul=false"}, 8, 0},
      {{"ici_expert_parallelism=-1"}, {"sparse_matmul=false"}, 8, 0},
      {{"ici_expert_parallelism=-1"}, {}, 1, 0},
      {{"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=-1"}, {}, 8, 0},
      {{"ici_fsdp_parallelism=-1", "moe_fsdp_use_two_stage_all_gather=true"}, {}, 8, 0},
      {{"ici_expert_parallelism=2", "ici_fsdp_parallelism=2"}, {}, 8, 4},
      {{"ici_expert_parallelism=2", "ici_data_parallelism=2"}, {}, 8, 4},
      {{"ici_expert_parallelism=2", "ici_data_parallelism=2", "use_ring_of_experts=true"},
       {},
       8,
       4},
      {{"ici_expert_parallelism=2", "ici_tensor_parallelism=2"}, {}, 8, 4},
      {{"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2"}, {}, 8, 4},
      {{"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=2",
        "ici_expert_parallelism=2"},
       {},
       8,
       4},
      {{"ici_expert_parallelism=2", "ici_tensor_parallelism=2"}, {"sparse_matmul=false"}, 8, 4},
  };
  Names const kinds = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"};
  for (int n : {1, 2, 4}) {
    for (auto const& l : layouts) {
      if (l.ranks != 0 && l.ranks != n) continue;
      for (int r = 0; r < n; ++r) {
        auto const p = plan(n, l.layout, l.layer, l.batch, r);
        SCOPED_TRACE(p.to_text());
        auto parts = [&](Names const& axes) { return p.layout.parts(axes); };
        for (auto const& t : p.tensors) {
          ASSERT_EQ(t.global_shape.size(), t.logical.size()) << t.name;
          for (std::size_t d = 0; d < t.global_shape.size(); ++d) {
            EXPECT_EQ(t.local_shape[d] * parts(t.storage[d]), t.global_shape[d]) << t.name;
            EXPECT_EQ(t.compute_shape[d] * parts(t.sliced[d]),
                      t.local_shape[d] * parts(t.gathered[d]))
                << t.name;
            EXPECT_EQ(t.offset[d] % t.local_shape[d], 0) << t.name;
            EXPECT_LT(t.offset[d], t.global_shape[d]) << t.name;
          }
        }
        for (auto const& c : p.collectives) {
          EXPECT_NE(std::find(kinds.begin(), kinds.end(), c.kind), kinds.end()) << c.kind;
          EXPECT_GT(parts(c.axes), 1) << c.what;
          EXPECT_GE(c.bytes, 0) << c.what;
        }
        if (n == 1) {
          EXPECT_TRUE(p.collectives.empty());
        }
        EXPECT_EQ(p.to_text(), plan(n, l.layout, l.layer, l.batch, r).to_text());
      }
    }
  }
}

TEST(Plan, DataParallelSumsEveryGradient) {
  auto const p = plan(2, {"ici_data_parallelism=-1"});
  EXPECT_EQ(p.layout.batch_axes, Names{"data"});
  expect_shapes(p, "x", {4, 4, 16}, {4, 4, 16});
  expect_shapes(p, "wi_0", {8, 16, 8}, {8, 16, 8});
  EXPECT_EQ(p.tensor("x").offset, (Shape{0, 0, 0}));
  EXPECT_EQ(plan(2, {"ici_data_parallelism=-1"}, {}, 8, 1).tensor("x").offset, (Shape{4, 0, 0}));
  EXPECT_EQ(signature(p), (Names{
                              "F all-reduce [data] lb loss",
                              "B all-reduce [data] reduce d_gate",
                              "B all-reduce [data] reduce d_wi_0",
                              "B all-reduce [data] reduce d_wi_1",
                              "B all-reduce [data] reduce d_wo",
                              "B all-reduce [data] reduce d_shared_wi_0",
                              "B all-reduce [data] reduce d_shared_wi_1",
                              "B all-reduce [data] reduce d_shared_wo",
                          }));
  // Ring all-reduce over 2 ranks sends the buffer once: 16*8 floats.
  EXPECT_EQ(bytes_of(p, "reduce d_gate", true), 16 * 8 * 4);
  EXPECT_EQ(bytes_of(p, "reduce d_wi_0", true), 8 * 16 * 8 * 4);
  EXPECT_EQ(bytes_of(p, "lb loss"), 8);
  EXPECT_EQ(p.tensor("wi_0").reduced, Names{"data"});
}

TEST(Plan, FsdpGathersWeightsAndReduceScattersGradients) {
  auto const p = plan(4, {"ici_fsdp_parallelism=-1"});
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::Local);
  expect_shapes(p, "x", {2, 4, 16}, {2, 4, 16});
  expect_shapes(p, "gate", {4, 8}, {16, 8});
  // mlp_moe takes fsdp_transpose first, so embed_moe falls back to (fsdp, context, ...).
  expect_shapes(p, "wi_0", {8, 4, 8}, {8, 16, 8});
  expect_shapes(p, "wo", {8, 8, 4}, {8, 8, 16});
  expect_shapes(p, "shared_wi_0", {4, 8}, {16, 8});
  expect_shapes(p, "shared_wo", {8, 4}, {8, 16});
  EXPECT_EQ(p.tensor("wi_0").gathered, (std::vector<Names>{{}, {"fsdp"}, {}}));
  Names want;
  for (auto n : {"gate", "wi_0", "wi_1", "wo", "shared_wi_0", "shared_wi_1", "shared_wo"})
    want.push_back(std::string("F all-gather [fsdp] gather ") + n);
  want.push_back("F all-reduce [fsdp] lb loss");
  for (auto n : {"gate", "wi_0", "wi_1", "wo", "shared_wi_0", "shared_wi_1", "shared_wo"})
    want.push_back(std::string("B reduce-scatter [fsdp] reduce-scatter d_") + n);
  EXPECT_EQ(signature(p), want);
  EXPECT_EQ(bytes_of(p, "gather wi_0"), 8 * 4 * 8 * 4 * 3);  // stored block to 3 peers
  EXPECT_EQ(bytes_of(p, "reduce-scatter d_wo", true), 8 * 8 * 4 * 4 * 3);
  EXPECT_EQ(bytes_of(p, "lb loss"), 2 * 8 * 3 / 4);
}

TEST(Plan, RaggedAllToAll) {
  auto const p = plan(2, {"ici_expert_parallelism=-1"});
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::RaggedA2A);
  EXPECT_EQ(p.layout.local_experts, 4);
  EXPECT_EQ(plan(2, {"ici_expert_parallelism=-1"}, {}, 8, 1).layout.first_expert, 4);
  expect_shapes(p, "x", {4, 4, 16}, {4, 4, 16});
  expect_shapes(p, "wi_0", {4, 16, 8}, {4, 16, 8});
  expect_shapes(p, "gate", {16, 8}, {16, 8});
  // EP-as-TP shared expert: stored split over expert on embed, computed split on the hidden dim.
  expect_shapes(p, "shared_wi_0", {8, 8}, {16, 4});
  EXPECT_EQ(p.tensor("shared_wi_0").sliced, (std::vector<Names>{{}, {"expert"}}));
  EXPECT_EQ(signature(p), (Names{
                              "F all-gather [expert] gather shared_wi_0",
                              "F all-gather [expert] gather shared_wi_1",
                              "F all-gather [expert] gather shared_wo",
                              "F all-reduce [expert] lb loss",
                              "F all-to-all [expert] dispatch",
                              "F all-to-all [expert] combine",
                              "F all-gather [expert] all-gather x (shared, expert)",
                              "F reduce-scatter [expert] reduce-scatter y shared (expert)",
                              "B all-to-all [expert] dispatch d_y",
                              "B all-to-all [expert] combine d_x",
                              "B all-gather [expert] all-gather d_y (shared, expert)",
                              "B reduce-scatter [expert] reduce-scatter d_x shared (expert)",
                              "B all-reduce [expert] reduce d_gate",
                              "B all-gather [expert] unslice d_shared_wi_0",
                              "B all-gather [expert] unslice d_shared_wi_1",
                              "B all-gather [expert] unslice d_shared_wo",
                          }));
  // Balanced routing: T_local*K*D*sizeof*(ep-1)/ep = 16*2*16*4/2.
  EXPECT_EQ(bytes_of(p, "dispatch"), 16 * 2 * 16 * 4 / 2);
  EXPECT_EQ(bytes_of(p, "combine"), 16 * 2 * 16 * 4 / 2);
  for (auto const& c : p.collectives) EXPECT_EQ(c.balanced, c.kind == "all-to-all") << c.what;
  // At 4 ranks: 3/4 of the 8*2 slots leave the rank.
  auto const q = plan(4, {"ici_expert_parallelism=-1"});
  EXPECT_EQ(bytes_of(q, "dispatch d_y", true), 8 * 2 * 16 * 4 * 3 / 4);
  expect_shapes(q, "wo", {2, 8, 16}, {2, 8, 16});
  // A note states the balanced-routing assumption.
  ASSERT_FALSE(p.notes.empty());
  EXPECT_NE(p.notes[0].find("balanced routing"), std::string::npos) << p.notes[0];
  EXPECT_NE(p.notes[0].find("(ep-1)/ep"), std::string::npos) << p.notes[0];
}

TEST(Plan, RingAndDenseGatherTokens) {
  for (auto const& p : {plan(2, {"ici_expert_parallelism=-1", "use_ring_of_experts=true"}),
                        plan(2, {"ici_expert_parallelism=-1"}, {"sparse_matmul=false"})}) {
    EXPECT_EQ(p.layout.route, moe::ExpertRoute::Ring);
    expect_shapes(p, "x", {4, 4, 16}, {8, 4, 16});
    EXPECT_EQ(p.tensor("x").gathered[0], Names{"expert"});
    auto const s = signature(p);
    Names const want_fwd = {
        "F all-gather [expert] gather shared_wi_0",
        "F all-gather [expert] gather shared_wi_1",
        "F all-gather [expert] gather shared_wo",
        "F all-gather [expert] all-gather tokens (ring)",
        "F all-reduce [expert] lb loss",
        "F reduce-scatter [expert] reduce-scatter y (expert)",
        "F all-gather [expert] all-gather x (shared, expert)",
        "F reduce-scatter [expert] reduce-scatter y shared (expert)",
        "B all-gather [expert] all-gather d_y (expert)",
        "B reduce-scatter [expert] reduce-scatter d_weights (expert)",
        "B reduce-scatter [expert] reduce-scatter d_x (expert)",
    };
    ASSERT_GE(s.size(), want_fwd.size());
    EXPECT_EQ(Names(s.begin(), s.begin() + long(want_fwd.size())), want_fwd);
    EXPECT_EQ(bytes_of(p, "all-gather tokens (ring)"), 16 * 16 * 4);
    EXPECT_EQ(bytes_of(p, "reduce-scatter d_weights (expert)", true), 16 * 2 * 4);
    for (auto const& c : p.collectives) EXPECT_FALSE(c.balanced) << c.what;
  }
}

TEST(Plan, TensorParallel) {
  auto const p = plan(2, {"ici_tensor_parallelism=-1"});
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::Local);
  EXPECT_EQ(p.layout.tp_axes, Names{"tensor"});
  EXPECT_TRUE(p.layout.batch_axes.empty());
  expect_shapes(p, "x", {8, 4, 16}, {8, 4, 16});
  expect_shapes(p, "wi_0", {8, 16, 4}, {8, 16, 4});
  expect_shapes(p, "wo", {8, 4, 16}, {8, 4, 16});
  auto const s = signature(p);
  EXPECT_EQ(s.front(), "F reduce-scatter [tensor] reduce-scatter y (tensor)");
  EXPECT_NE(std::find(s.begin(), s.end(), "F all-gather [tensor] all-gather y (tensor)"), s.end());
  EXPECT_NE(std::find(s.begin(), s.end(), "B all-reduce [tensor] reduce d_x (tensor)"), s.end());
  // [T=32, D/tp=8] floats to the one peer.
  EXPECT_EQ(bytes_of(p, "all-gather y (tensor)"), 32 * 8 * 4);
}

TEST(Plan, DecodeReplicatesTheBatchOverExperts) {
  auto const p = plan(2, {"ici_expert_parallelism=-1"}, {}, 1);
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::Replicated);
  EXPECT_TRUE(p.layout.batch_axes.empty());
  expect_shapes(p, "x", {1, 4, 16}, {1, 4, 16});
  auto const s = signature(p);
  EXPECT_NE(std::find(s.begin(), s.end(), "F all-reduce [expert] reduce y (expert)"), s.end());
  EXPECT_EQ(bytes_of(p, "reduce y (expert)"), 4 * 16 * 4);
}

TEST(Plan, ShardExpOnFsdpGathersTheExpertDim) {
  auto const p = plan(2, {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=-1"});
  EXPECT_EQ(p.layout.preset, "shard-exp-on-fsdp");
  expect_shapes(p, "wi_0", {4, 16, 8}, {8, 16, 8});
  EXPECT_EQ(p.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {}, {}}));
  EXPECT_EQ(bytes_of(p, "gather wi_0"), 4 * 16 * 8 * 4);
  EXPECT_EQ(bytes_of(p, "reduce-scatter d_wi_0", true), 4 * 16 * 8 * 4);
}

TEST(Plan, FourRankMixes) {
  auto const ep_tp = plan(4, {"ici_expert_parallelism=2", "ici_tensor_parallelism=2"});
  EXPECT_EQ(ep_tp.layout.route, moe::ExpertRoute::RaggedA2A);
  expect_shapes(ep_tp, "wi_0", {4, 16, 4}, {4, 16, 4});
  expect_shapes(ep_tp, "x", {4, 4, 16}, {4, 4, 16});
  auto const s = signature(ep_tp);
  for (auto const& want : {"F all-to-all [expert] dispatch",
                           "F reduce-scatter [tensor] "
                           "reduce-scatter y (tensor)",
                           "B all-gather [tensor] all-gather d_y (tensor)"})
    EXPECT_NE(std::find(s.begin(), s.end(), want), s.end()) << want;
  // Combine moves D/tp columns: 16*2*(16/2)*4/2.
  EXPECT_EQ(bytes_of(ep_tp, "combine"), 16 * 2 * 8 * 4 / 2);
  EXPECT_EQ(bytes_of(ep_tp, "dispatch"), 16 * 2 * 16 * 4 / 2);

  // Two-stage gathers: one collective per axis, minor axis first.
  auto const one = plan(4, {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2"});
  auto const two = plan(4, {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2",
                            "moe_fsdp_use_two_stage_all_gather=true"});
  expect_shapes(one, "gate", {4, 8}, {16, 8});
  EXPECT_EQ(signature(one)[0], "F all-gather [fsdp,fsdp_transpose] gather gate");
  EXPECT_EQ(signature(two)[0], "F all-gather [fsdp_transpose] gather gate");
  EXPECT_EQ(signature(two)[1], "F all-gather [fsdp] gather gate");
  EXPECT_EQ(bytes_of(one, "gather gate"), 4 * 8 * 4 * 3);
  EXPECT_EQ(two.collectives[0].bytes + two.collectives[1].bytes, 4 * 8 * 4 * 1 + 8 * 8 * 4 * 1);
  expect_shapes(one, "wi_0", {8, 8, 4}, {8, 16, 8});

  auto const ep_dp = plan(4, {"ici_expert_parallelism=2", "ici_data_parallelism=2"});
  EXPECT_EQ(ep_dp.layout.batch_axes, (Names{"data", "expert"}));
  EXPECT_EQ(ep_dp.tensor("wi_0").reduced, Names{"data"});
  auto const sd = signature(ep_dp);
  EXPECT_NE(std::find(sd.begin(), sd.end(), "B all-reduce [data] reduce d_wi_0"), sd.end());
}

TEST(Plan, DispatchWarningOfSemantics113) {
  auto const p = plan(2, {"ici_expert_parallelism=-1"});
  ASSERT_EQ(p.warnings.size(), 1u);
  auto const& w = p.warnings[0];
  for (auto frag : {"'expert'", "all-gather + reduce-scatter", "moe_dispatch_no_expert_sharding",
                    "[null, [\"data\", \"fsdp\", \"fsdp_transpose\", \"expert\"], null, "
                    "\"tensor\"]",
                    "[\"expert\", [\"data\", \"fsdp\", \"fsdp_transpose\"], null, \"tensor\"]"})
    EXPECT_NE(w.find(frag), std::string::npos) << frag << " in " << w;
  EXPECT_NE(p.to_text().find("WARNING: dense dispatch"), std::string::npos);
  // No expert parallelism: nothing to warn about.
  EXPECT_TRUE(plan(2, {"ici_data_parallelism=-1"}).warnings.empty());
  EXPECT_TRUE(plan(4, {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"}).warnings.empty());
  // A preset whose activation_batch_moe leaves `expert` to the expert dimension.
  auto const ok = plan(2, {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_expert_parallelism=-1"});
  EXPECT_TRUE(ok.warnings.empty()) << ok.warnings[0];
  EXPECT_EQ(ok.dispatch_joint[0], Names{"expert"});
}

TEST(Plan, ErrorsAreTheLayersErrors) {
  auto expect_error = [](auto f, Names const& frags) {
    try {
      f();
      ADD_FAILURE() << "no ConfigError";
    } catch (moe::ConfigError const& e) {
      for (auto const& s : frags)
        EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
    }
  };
  expect_error([] { plan(2, {"ici_data_parallelism=4"}); },
               {"mesh product", "does not equal the communicator size 2"});
  expect_error([] { plan(4, {"ici_expert_parallelism=-1"}, {"num_experts=6"}); },
               {"num_experts=6", "not divisible", "[expert] = 4"});
  expect_error([] { plan(2, {"ici_tensor_parallelism=-1"}, {"base_moe_mlp_dim=3"}); },
               {"base_moe_mlp_dim=3", "[tensor] = 2"});
  expect_error([] { plan(4, {"ici_data_parallelism=-1"}, {}, 6); },
               {"global batch=6", "[data] = 4"});
  expect_error([] { plan(2, {"ici_data_parallelism=-1"}, {}, 8, 2); }, {"rank 2"});
  expect_error([] { moe::make_plan(layer_config(), moe::ParallelConfig(), 1, 0, 8, 4, 2); },
               {"scalar_bytes=2"});
}

TEST(Plan, JsonAndTextAgree) {
  auto const p = plan(4, {"ici_expert_parallelism=2", "ici_fsdp_parallelism=2"}, {}, 8, 3);
  auto const j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(j["rank"], 3);
  EXPECT_EQ(j["expert_route"], "ragged_all_to_all");
  EXPECT_EQ(j["mesh"]["expert"], 2);
  EXPECT_EQ(j["mesh"]["fsdp"], 2);
  EXPECT_EQ(j["tensors"]["wi_0"]["local_shape"], (Shape{4, 8, 8}));
  EXPECT_EQ(j["tensors"]["wi_0"]["spec"][0], "expert");
  EXPECT_EQ(j["collectives"].size(), p.collectives.size());
  std::int64_t sum = 0;
  for (auto const& c : j["collectives"]) sum += c["bytes"].get<std::int64_t>();
  EXPECT_EQ(j["bytes"]["step"], sum);
  EXPECT_EQ(sum, p.step_bytes());
  auto const text = p.to_text();
  EXPECT_NE(text.find("mesh (default): fsdp=2 x expert=2"), std::string::npos) << text;
  EXPECT_NE(text.find(std::string("step ") + std::to_string(p.step_bytes())), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// moe-shard --plan

namespace {

class PlanFile {
 public:
  explicit PlanFile(std::string const& text) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "moe_plan_XXXXXX.yml").string();
    int const fd = ::mkstemps(&tmpl[0], 4);
    if (fd < 0) throw std::runtime_error("mkstemps failed");
    ::close(fd);
    path_ = tmpl;
    std::ofstream(path_) << text;
  }
  ~PlanFile() { std::remove(path_.c_str()); }
  std::string const& path() const { return path_; }

 private:
  std::string path_;
};

struct ShardRun {
  int status = -1;
  std::string out, err;
};

ShardRun run_shard(std::string const& args) {
  ShardRun r;
#ifdef MOE_SHARD_EXE
  PlanFile const err("");
  std::string const cmd =
      std::string("'") + MOE_SHARD_EXE + "' " + args + " 2>'" + err.path() + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int const st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream in(err.path());
  r.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
#else
  (void)args;
#endif
  return r;
}

char const* const kConfig =
    "num_experts: 8\n"
    "num_experts_per_tok: 2\n"
    "base_emb_dim: 16\n"
    "base_moe_mlp_dim: 8\n"
    "shared_experts: 1\n"
    "load_balance_loss_weight: 0.05\n"
    "mlp_activations: [silu, linear]\n"
    "ici_expert_parallelism: 4\n"
    "per_device_batch_size: 2\n"
    "max_target_length: 4\n";

}  // namespace

TEST(MoeShardPlan, TextAndJson) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  PlanFile const f(kConfig);
  auto const t = run_shard("--plan '" + f.path() + "'");
  ASSERT_EQ(t.status, 0) << t.err;
  EXPECT_NE(t.out.find("rank 0 of 4, global batch [8, 4, 16]"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("expert route: ragged all-to-all over expert"), std::string::npos);
  EXPECT_NE(t.out.find("WARNING: dense dispatch"), std::string::npos);
  EXPECT_NE(t.out.find("balanced routing"), std::string::npos);
  // The same plan as the library's (8 sequences over 4 ranks).
  auto const want =
      moe::make_plan(layer_config(), parallel_config({"ici_expert_parallelism=4"}), 4, 0, 8, 4);
  EXPECT_EQ(t.out, want.to_text());

  auto const j = run_shard("--plan '" + f.path() + "' --json --rank 3 num_experts=16");
  ASSERT_EQ(j.status, 0) << j.err;
  auto const doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["rank"], 3);
  EXPECT_EQ(doc["world_size"], 4);
  EXPECT_EQ(doc["first_expert"], 12);
  EXPECT_EQ(doc["tensors"]["wi_0"]["local_shape"], (Shape{4, 16, 8}));
  EXPECT_EQ(doc["warnings"].size(), 1u);
  bool dispatch = false;
  for (auto const& c : doc["collectives"])
    if (c["what"] == "dispatch") {
      dispatch = true;
      EXPECT_EQ(c["kind"], "all-to-all");
      EXPECT_EQ(c["axes"], Names{"expert"});
      EXPECT_EQ(c["bytes"], 8 * 2 * 16 * 4 * 3 / 4);
      EXPECT_EQ(c["balanced_routing"], true);
    }
  EXPECT_TRUE(dispatch);

  // --ranks for a -1 degree, explicit batch / sequence, float64.
  auto const r = run_shard("--plan '" + f.path() +
                           "' ici_expert_parallelism=-1 --ranks 2 --batch 6 --seq 3 --dtype "
                           "float64 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  auto const d = nlohmann::json::parse(r.out);
  EXPECT_EQ(d["world_size"], 2);
  EXPECT_EQ(d["tensors"]["x"]["local_shape"], (Shape{3, 3, 16}));
  EXPECT_EQ(d["scalar_bytes"], 8);
}

TEST(MoeShardPlan, Errors) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  PlanFile const f(kConfig);
  PlanFile const bad(std::string(kConfig) + "logical_axis_rules: []\nsteps: 3\n");
  PlanFile const bare("num_experts: 8\n");
  auto check = [](std::string const& args, Names const& frags) {
    auto const r = run_shard(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_TRUE(r.out.empty()) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (auto const& s : frags)
      EXPECT_NE(r.err.find(s), std::string::npos) << args << ": " << r.err;
  };
  check("--plan '" + bad.path() + "'", {"unknown config keys 'logical_axis_rules', 'steps'"});
  check("--plan '" + f.path() + "' bogus=1", {"unknown config key 'bogus'"});
  check("--plan '" + f.path() + "' ici_expert_parallelism=-1", {"-1", "--ranks N"});
  check("--plan '" + bare.path() + "'", {"global batch", "--batch B"});
  check("--plan '" + bare.path() + "' --batch 2", {"sequence length", "--seq S"});
  check("--plan '" + f.path() + "' num_experts=6", {"num_experts=6", "not divisible", "= 4"});
  check("--plan '" + f.path() + "' --ranks 2", {"does not equal the communicator size 2"});
  check("--plan '" + f.path() + "' --rank 4", {"--rank 4"});
  check("--plan '" + f.path() + "' --dtype half", {"--dtype half"});
  check("--preset default --mesh data=2 --ranks 2", {"only valid with --plan"});
}
