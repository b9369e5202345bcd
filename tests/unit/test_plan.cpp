// The layer plan (moe::make_plan): layouts of tests/mpi/test_distributed_layer.cpp at 1, 2 and 4
// ranks against hand-computed local shapes, collective kinds, axes and bytes; the SEMANTICS §1.13
// warning; and `moe-shard --plan` (text and JSON). Then the memory estimate and index limits
// (moe/distributed/memory.hpp, train_moe's examples/train_moe/memory.hpp): exact bytes of weights
// and gradients, activations linear in the batch, overflow and index-limit errors, the machine's
// available memory, and the estimate against the Kokkos allocations of a real layer step.
#include <moe/distributed/cost.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/distributed/memory.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/models.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "../allocation_tracker.hpp"
#include "../mpi/layout_cases.hpp"
#include "mpi_on_demand.hpp"
#include "train_moe/memory.hpp"

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

std::string sharding_json(moe::sharding::PartitionSpec const& s) {
  return moe::sharding::to_json(s);
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

/// f() throws a moe::ConfigError whose message holds every fragment of `frags`.
template <class F>
void expect_error(F&& f, Names const& frags) {
  try {
    f();
    ADD_FAILURE() << "no ConfigError";
  } catch (moe::ConfigError const& e) {
    for (auto const& s : frags)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
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

/// The step plan is a data flow: every buffer a stage reads is a step input or written by an
/// earlier stage (forward, then backward); every stage kind has its own profiling region; the
/// plan's collective list is the stages' collectives in order; forward and backward have the
/// stages of the route (ragged all-to-all: dispatch + experts + combine and their transposes).
void expect_step_dataflow(LayerPlan const& p) {
  using moe::distributed::StageKind;
  auto const& step = p.step;
  Names have = {"x",    "dy", "gate",        "gate_bias",   "wi_0",
                "wi_1", "wo", "shared_wi_0", "shared_wi_1", "shared_wo"};
  std::size_t c = 0;
  for (auto const* phase : {&step.forward, &step.backward}) {
    for (auto const& st : *phase) {
      EXPECT_EQ(st.backward, phase == &step.backward) << st.region;
      EXPECT_EQ(st.region.rfind("moe::", 0), 0u) << st.region;
      for (auto const& r : st.reads)
        EXPECT_NE(std::find(have.begin(), have.end(), to_string(r)), have.end())
            << st.region << " reads " << to_string(r) << " before any stage writes it";
      for (auto const& w : st.writes) have.push_back(to_string(w));
      for (auto const& col : st.collectives) {
        ASSERT_LT(c, p.collectives.size());
        EXPECT_EQ(p.collectives[c].what, col.what);
        EXPECT_EQ(p.collectives[c].stage, st.region);
        EXPECT_EQ(p.collectives[c].backward, st.backward);
        ++c;
      }
    }
  }
  EXPECT_EQ(c, p.collectives.size());
  auto kinds = [](std::vector<moe::distributed::Stage> const& v) {
    std::vector<StageKind> k;
    for (auto const& st : v) k.push_back(st.kind);
    return k;
  };
  auto const f = kinds(step.forward), b = kinds(step.backward);
  ASSERT_FALSE(f.empty());
  EXPECT_EQ(f.front(), StageKind::gather_weights);
  EXPECT_EQ(f.back(), StageKind::output);
  EXPECT_EQ(b.back(), StageKind::reduce_grads);
  bool const a2a = step.route == moe::ExpertRoute::RaggedA2A;
  bool const dispatch = a2a || !step.dense;
  EXPECT_EQ(std::count(f.begin(), f.end(), StageKind::dispatch), dispatch ? 1 : 0);
  EXPECT_EQ(std::count(b.begin(), b.end(), StageKind::dispatch), 1);
  // The chunked ring gathers its tokens inside the experts stage (by D-chunks).
  EXPECT_EQ(std::count(f.begin(), f.end(), StageKind::gather_tokens),
            (step.route == moe::ExpertRoute::Ring && step.emb_chunks == 0) ||
                    step.route == moe::ExpertRoute::EpTp
                ? 1
                : 0);
  EXPECT_EQ(std::count(f.begin(), f.end(), StageKind::shared_expert),
            std::count(b.begin(), b.end(), StageKind::shared_expert));
  for (auto const& w : step.weights)
    for (auto const& op : w.to_compute)
      EXPECT_TRUE(op.kind == moe::distributed::WeightOp::Kind::all_gather ||
                  op.kind == moe::distributed::WeightOp::Kind::slice)
          << w.name;
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
      {{"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, {}, 8, 0},
      {{"expert_shard_attention_option=tp", "ici_expert_parallelism=-1"}, {}, 8, 0},
      {{"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, {"sparse_matmul=false"}, 8, 0},
      {{"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=2", "ici_data_parallelism=2"},
       {},
       8,
       4},
      {{"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"},
       {},
       8,
       4},
      {{"ici_expert_parallelism=2", "use_ring_of_experts=true", "num_moe_emb_chunks=2"}, {}, 8, 2},
      {{"ici_expert_parallelism=4", "use_ring_of_experts=true", "num_moe_emb_chunks=4"}, {}, 8, 4},
      {{"ici_expert_parallelism=2", "ici_tensor_parallelism=2", "use_ring_of_experts=true",
        "num_moe_emb_chunks=8"},
       {},
       8,
       4},
      {{"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"},
       {"sparse_matmul=false"},
       8,
       0},
      {{"ici_expert_parallelism=2", "ici_tensor_parallelism=2",
        "moe_dispatch_no_expert_sharding=true"},
       {"sparse_matmul=false"},
       8,
       4},
      {{"custom_mesh_and_rule=pipeline-large-moe", "ici_expert_parallelism=-1"},
       {"sparse_matmul=false"},
       8,
       0},
      {{"ici_fsdp_parallelism=-1", "shard_exp_on_fsdp=true"}, {}, 8, 0},
      {{"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "shard_exp_on_fsdp=true"},
       {"sparse_matmul=false"},
       8,
       4},
      {{"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2", "use_2d_fsdp_sharding=true"},
       {},
       8,
       4},
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
        expect_step_dataflow(p);
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
  // The shared expert on each rank's own tokens (#30): stored split over expert on embed
  // (MaxText's `embed` rule), gathered whole, no activation moves; its gradients reduce-scattered
  // back over expert (the ranks' tokens differ).
  EXPECT_EQ(p.layout.shared, moe::SharedExpert::own);
  expect_shapes(p, "shared_wi_0", {8, 8}, {16, 8});
  EXPECT_EQ(p.tensor("shared_wi_0").sliced, (std::vector<Names>{{}, {}}));
  EXPECT_EQ(signature(p), (Names{
                              "F all-gather [expert] gather shared_wi_0",
                              "F all-gather [expert] gather shared_wi_1",
                              "F all-gather [expert] gather shared_wo",
                              "F all-reduce [expert] lb loss",
                              "F all-to-all [expert] dispatch",
                              "F all-to-all [expert] combine",
                              "B all-to-all [expert] dispatch d_y",
                              "B all-to-all [expert] combine d_x",
                              "B all-reduce [expert] reduce d_gate",
                              "B reduce-scatter [expert] reduce-scatter d_shared_wi_0",
                              "B reduce-scatter [expert] reduce-scatter d_shared_wi_1",
                              "B reduce-scatter [expert] reduce-scatter d_shared_wo",
                          }));
  // Balanced routing: T_local*K*D*bytes*(ep-1)/ep = 16*2*16*4/2.
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
  // Its bytes are those of the wire: 2 a value in a bf16 step.
  EXPECT_NE(p.notes[0].find("16*2*16*4*1/2 = 1024 bytes"), std::string::npos) << p.notes[0];
  auto const b16 = plan(2, {"ici_expert_parallelism=-1"}, {"dtype=bfloat16"});
  EXPECT_EQ(bytes_of(b16, "dispatch"), 16 * 2 * 16 * 2 / 2);
  ASSERT_FALSE(b16.notes.empty());
  EXPECT_NE(b16.notes[0].find("16*2*16*2*1/2 = 512 bytes"), std::string::npos) << b16.notes[0];
}

// The routed rows at the experts (x_local, y_local, dy_local) are 16-bit exactly where the
// hidden states are (a bf16 layer on oneDNN), and the experts' dx rows overwrite dy_local (their
// two products summed in fp32 by gmm::gmm_sum, no float buffer of their own); the chunked ring's
// rows stay float (its forward slices them by D-chunks). So are the working tokens they are
// gathered from and their output gradients (x_work on the ring, dy_work), except on EP-TP, whose
// router and shared expert read them as values; and the sums y_work and dx_work where only a
// reduce-scatter on the bf16 wire reads them (the ring, EP-TP; dx_work on the ring without
// tensor axes).
TEST(Plan, Bf16RoutedRowsAre16BitWhereTheHiddenStatesAre) {
  using moe::distributed::Buf;
  using moe::distributed::Elem;
  Names const ring = {"ici_expert_parallelism=-1", "use_ring_of_experts=true"};
  Names chunked = ring;
  chunked.push_back("num_moe_emb_chunks=2");
  struct L {
    int ranks;
    Names layout;
    bool chunks;
  };
  std::vector<L> const layouts = {
      {1, {"ici_data_parallelism=-1"}, false},
      {4, {"ici_expert_parallelism=-1"}, false},
      {4, ring, false},
      {4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, false},
      {4, chunked, true}};
  for (auto const& l : layouts)
    for (char const* dtype : {"float32", "bfloat16"}) {
      auto const p = plan(l.ranks, l.layout, {std::string("dtype=") + dtype});
      SCOPED_TRACE(p.to_text());
      auto const* h0 = p.step.find(Buf::h0);
      ASSERT_NE(h0, nullptr);
      bool const narrow = h0->elem == Elem::bf16 && !l.chunks;
      if (std::string(dtype) == "float32") {
        EXPECT_EQ(h0->elem, Elem::value);
      }
      for (Buf b : {Buf::x_local, Buf::y_local, Buf::dy_local}) {
        auto const* d = p.step.find(b);
        ASSERT_NE(d, nullptr) << to_string(b);
        EXPECT_EQ(d->elem, narrow ? Elem::bf16 : Elem::value) << to_string(b);
      }
      // Every buffer of routed rows the plan declares (on the ragged all-to-all: its sent and
      // received rows and column blocks too), and its all-to-alls, which then move them as they
      // are.
      bool const eptp = p.layout.route == moe::ExpertRoute::EpTp;
      bool const ring = p.layout.route == moe::ExpertRoute::Ring;
      int rows = 0, a2a = 0;
      for (auto const& d : p.step.buffers)
        if (moe::distributed::info(d.id).elem == Elem::rows) {
          ++rows;
          bool const tokens = d.id == Buf::x_work || d.id == Buf::dy_work;
          bool const sums = d.id == Buf::y_work || d.id == Buf::dx_work;
          bool const narrow_sum = eptp || (ring && (d.id == Buf::y_work || p.layout.tp() == 1));
          bool const want = narrow && !(tokens && eptp) && !(sums && !narrow_sum);
          EXPECT_EQ(d.elem, want ? Elem::bf16 : Elem::value) << to_string(d.id);
        }
      for (auto const* phase : {&p.step.forward, &p.step.backward})
        for (auto const& st : *phase)
          for (auto const& c : st.collectives)
            if (c.kind == "all-to-all") {
              ++a2a;
              EXPECT_EQ(c.rows16, narrow) << c.what;
            }
      bool const ragged = p.layout.route == moe::ExpertRoute::RaggedA2A;
      // Gathered and EP-TP: the routed rows, dy_work, y_work and dx_work, and x_work where the
      // tokens are gathered whole (not the chunked ring's chunks).
      bool const x_work = eptp || (ring && !l.chunks);
      EXPECT_EQ(rows, ragged ? 12 : x_work ? 7 : 6);
      EXPECT_EQ(a2a, ragged ? 4 : 0);
      // The experts' backward writes its dx rows into the rows it reads (dy_local).
      bool writes_dy_local = false;
      for (auto const& st : p.step.backward)
        writes_dy_local |= st.kind == moe::distributed::StageKind::experts &&
                           st.lists(moe::distributed::Ref(Buf::dy_local), true);
      EXPECT_TRUE(writes_dy_local);
      expect_step_dataflow(p);
    }
}

// Without tensor axes the output's column block y_cols is all of y: the caller's y stands in for
// it (no buffer of its own), on every strategy. The ragged all-to-all's backward sums dx's rows
// into dx itself then, and into dy_cols (dy's column block, no longer read) only with tensor
// axes. A bf16 layer rounds the caller's dy where it first copies it; a shared expert on the own
// tokens reads a rounded copy of it (dy_shared), which a float layer does without.
TEST(Plan, TheCallersTensorsStandInForBuffersWithoutTensorAxes) {
  using moe::distributed::Buf;
  using moe::distributed::Ref;
  using moe::distributed::StageKind;
  Names const ring = {"ici_expert_parallelism=-1", "use_ring_of_experts=true"};
  struct L {
    int ranks;
    Names layout;
    bool dense;
  };
  std::vector<L> const layouts = {
      {1, {"ici_data_parallelism=-1"}, false},
      {4, {"ici_expert_parallelism=-1"}, false},
      {4, {"ici_expert_parallelism=2", "ici_tensor_parallelism=2"}, false},
      {4, ring, false},
      {4,
       {"ici_expert_parallelism=2", "ici_tensor_parallelism=2", "use_ring_of_experts=true"},
       false},
      {4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, false},
      {4, {"ici_expert_parallelism=-1"}, true}};
  int checked = 0;
  for (auto const& l : layouts)
    for (char const* dtype : {"float32", "bfloat16"}) {
      Names layer = {std::string("dtype=") + dtype, "shared_experts=1"};
      if (l.dense) layer.push_back("sparse_matmul=false");
      auto const p = plan(l.ranks, l.layout, layer);
      SCOPED_TRACE(p.to_text());
      bool const tp1 = p.layout.tp() == 1, bf16 = std::string(dtype) == "bfloat16";
      auto const* yc = p.step.find(Buf::y_cols);
      ASSERT_NE(yc, nullptr);
      EXPECT_EQ(yc->caller, tp1 ? Buf::y : Buf::count_);
      if (p.layout.route == moe::ExpertRoute::RaggedA2A) {
        ++checked;
        auto const& st = p.step.backward;
        auto const db = std::find_if(st.begin(), st.end(),
                                     [](auto const& s) { return s.kind == StageKind::dispatch; });
        ASSERT_NE(db, st.end());
        EXPECT_EQ(db->lists(Ref(Buf::dy_cols), true), !tp1);
        EXPECT_TRUE(db->lists(Ref(Buf::dx), true));
      }
      bool const own = p.layout.shared == moe::SharedExpert::own;
      if (p.layout.route != moe::ExpertRoute::EpTp) {
        EXPECT_EQ(p.step.find(Buf::dy_shared) != nullptr, !own || bf16);
      }
      expect_step_dataflow(p);
    }
  EXPECT_EQ(checked, 4);
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
        "F all-gather [expert] all-gather logits (ring)",
        "F all-reduce [expert] lb loss",
        "F all-gather [expert] all-gather tokens (ring)",
        "F reduce-scatter [expert] reduce-scatter y (expert)",
        "B all-gather [expert] all-gather d_y (expert)",
        "B reduce-scatter [expert] reduce-scatter d_weights (expert)",
        "B reduce-scatter [expert] reduce-scatter d_x (expert)",
    };
    ASSERT_GE(s.size(), want_fwd.size());
    EXPECT_EQ(Names(s.begin(), s.begin() + long(want_fwd.size())), want_fwd);
    EXPECT_EQ(bytes_of(p, "all-gather tokens (ring)"), 16 * 16 * 4);
    // The ring routes from the own tokens' gate logits, all-gathered: T x E, not the tokens.
    EXPECT_EQ(bytes_of(p, "all-gather logits (ring)"), 16 * 8 * 4);
    EXPECT_EQ(bytes_of(p, "reduce-scatter d_weights (expert)", true), 16 * 2 * 4);
    for (auto const& c : p.collectives) EXPECT_FALSE(c.balanced) << c.what;
  }
  // In bf16, the sorted ring holds its gathered tokens and output gradients in 16 bits where its
  // routed rows are; the dense path's are values (its GEMMs read and write them so).
  auto const sorted =
      plan(2, {"ici_expert_parallelism=-1", "use_ring_of_experts=true"}, {"dtype=bfloat16"});
  auto const dense =
      plan(2, {"ici_expert_parallelism=-1"}, {"sparse_matmul=false", "dtype=bfloat16"});
  using moe::distributed::Buf;
  using moe::distributed::Elem;
  // So are its sums y_work and dx_work (no tensor axes here); EP-TP's dense path keeps all four
  // as values too.
  auto const eptp_dense = plan(4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"},
                               {"sparse_matmul=false", "dtype=bfloat16"}, 8, 2);
  for (Buf b : {Buf::x_work, Buf::dy_work, Buf::y_work, Buf::dx_work}) {
    ASSERT_NE(sorted.step.find(b), nullptr);
    ASSERT_NE(dense.step.find(b), nullptr);
    ASSERT_NE(eptp_dense.step.find(b), nullptr);
    EXPECT_EQ(sorted.step.find(b)->elem, sorted.step.find(Buf::x_local)->elem);
    EXPECT_EQ(dense.step.find(b)->elem, Elem::value);
    EXPECT_EQ(eptp_dense.step.find(b)->elem, Elem::value);
  }
}

// EP-TP: x / y split on D over expert; the full-D tokens are all-gathered on D, the partial
// outputs (routed and shared) and dx reduce-scattered on D, d_weights summed over the group.
TEST(Plan, EpTpSplitsTheTokensOnD) {
  for (auto const& p :
       {plan(4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, {}, 8, 2),
        plan(4, {"expert_shard_attention_option=tp", "ici_expert_parallelism=-1"}, {}, 8, 2)}) {
    SCOPED_TRACE(p.to_text());
    EXPECT_EQ(p.layout.route, moe::ExpertRoute::EpTp);
    EXPECT_EQ(p.layout.emb_axes, Names{"expert"});
    EXPECT_TRUE(p.layout.batch_axes.empty());
    expect_shapes(p, "x", {8, 4, 4}, {8, 4, 16});
    EXPECT_EQ(p.tensor("x").offset, (std::vector<std::int64_t>{0, 0, 8}));
    EXPECT_EQ(p.tensor("y").gathered[2], Names{"expert"});
    EXPECT_EQ(p.step.work_tokens, 32);
    EXPECT_EQ(p.step.token_cols, 4);
    auto const s = signature(p);
    auto has = [&](std::string const& r) { return std::find(s.begin(), s.end(), r) != s.end(); };
    for (char const* r : {"F all-gather [expert] all-gather tokens (ep-tp)",
                          "F reduce-scatter [expert] reduce-scatter y (ep-tp)",
                          "F reduce-scatter [expert] reduce-scatter y shared (ep-tp)",
                          "B all-gather [expert] all-gather d_y (ep-tp)",
                          "B all-reduce [expert] reduce d_weights (expert)",
                          "B reduce-scatter [expert] reduce-scatter d_x (ep-tp)",
                          "B reduce-scatter [expert] reduce-scatter d_x shared (ep-tp)"})
      EXPECT_TRUE(has(r)) << r;
    // T = 32 tokens of D/4 = 4 columns, float: 3 other ranks get 32*4*4 bytes each.
    EXPECT_EQ(bytes_of(p, "all-gather tokens (ep-tp)"), 32 * 4 * 4 * 3);
    EXPECT_EQ(bytes_of(p, "reduce-scatter d_x (ep-tp)", true), 32 * 4 * 4 * 3);
    EXPECT_EQ(bytes_of(p, "reduce d_weights (expert)", true), 2 * 32 * 2 * 4 * 3 / 4);
    // No token travels by all-to-all; the expert-rank tokens are the same, so nothing reduces
    // the expert weights' gradients over `expert`.
    for (auto const& c : p.collectives) {
      EXPECT_NE(c.kind, "all-to-all") << c.what;
      EXPECT_FALSE(c.balanced) << c.what;
    }
    EXPECT_TRUE(p.tensor("wi_0").reduced.empty());
    EXPECT_TRUE(p.tensor("shared_wi_0").reduced.empty());
  }
  // The preset stores the shared expert's hidden dim over expert (no per-step slice).
  auto const q = plan(2, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"});
  EXPECT_EQ(q.tensor("shared_wi_0").storage[1], Names{"expert"});
  EXPECT_TRUE(q.tensor("shared_wi_0").sliced[1].empty());
  // DP x EP and FSDP x EP: the batch over data / fsdp, D over expert.
  auto const dp =
      plan(4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=2", "ici_data_parallelism=2"},
           {}, 8, 3);
  EXPECT_EQ(dp.layout.batch_axes, Names{"data"});
  expect_shapes(dp, "x", {4, 4, 8}, {4, 4, 16});  // the batch stays split over data
  EXPECT_EQ(dp.tensor("x").offset, (std::vector<std::int64_t>{4, 0, 8}));
  EXPECT_EQ(dp.tensor("wi_0").reduced, Names{"data"});
  auto const fs =
      plan(4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"});
  EXPECT_EQ(fs.layout.batch_axes, Names{"fsdp"});
  EXPECT_EQ(fs.tensor("wi_0").gathered[1], Names{"fsdp"});
}

TEST(Plan, EpTpErrors) {
  expect_error(
      [] {
        plan(4, {"expert_shard_attention_option=tp", "ici_expert_parallelism=2",
                 "ici_tensor_parallelism=2"});
      },
      {"EP-TP", "tensor parallelism over [tensor]", "set those ici_* degrees to 1"});
  expect_error(
      [] {
        plan(4, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}, {"base_emb_dim=18"});
      },
      {"base_emb_dim=18", "not divisible", "[expert] = 4"});
  expect_error([] { plan(2, {"expert_shard_attention_option=context"}); },
               {"expert_shard_attention_option=context", "not supported", "context"});
}

// num_moe_emb_chunks=n: the tokens are gathered in n chunks of D/n columns inside the experts
// stage (bytes summing to the one-piece gather's); the routing (from the gathered logits), combine
// and the backward are the ring's.
TEST(Plan, ChunkedRingGathersTokensByChunks) {
  Names const ring = {"ici_expert_parallelism=-1", "use_ring_of_experts=true"};
  for (int ranks : {2, 4}) {
    for (int n : {1, 2, 4, 16}) {
      auto layout = ring;
      layout.push_back("num_moe_emb_chunks=" + std::to_string(n));
      auto const p = plan(ranks, layout);
      auto const one = plan(ranks, ring);
      SCOPED_TRACE(p.to_text());
      EXPECT_EQ(p.step.emb_chunks, n);
      EXPECT_EQ(one.step.emb_chunks, 0);
      std::int64_t const T = 32 / ranks, D = 16, E = 8, s = 4;
      EXPECT_EQ(bytes_of(p, "all-gather logits (ring)"), T * E * s * (ranks - 1));
      std::int64_t chunks = 0, seen = 0;
      for (auto const& c : p.collectives)
        if (c.what.rfind("all-gather tokens (ring, chunk ", 0) == 0) {
          EXPECT_EQ(c.what, "all-gather tokens (ring, chunk " + std::to_string(++seen) + "/" +
                                std::to_string(n) + ")");
          EXPECT_EQ(c.stage, "moe::dist::experts::chunked");
          EXPECT_EQ(c.axes, Names{"expert"});
          EXPECT_EQ(c.bytes, T * (D / n) * s * (ranks - 1));
          chunks += c.bytes;
        }
      EXPECT_EQ(seen, n);
      EXPECT_EQ(chunks, bytes_of(one, "all-gather tokens (ring)"));
      // Everything else is the unchunked ring's, in order (the logits gather first in both).
      auto sig = signature(p), sig1 = signature(one);
      for (auto* v : {&sig, &sig1})
        v->erase(std::remove_if(v->begin(), v->end(),
                                [](std::string const& x) {
                                  return x.find("all-gather tokens (ring") != std::string::npos;
                                }),
                 v->end());
      EXPECT_EQ(sig, sig1);
      EXPECT_EQ(bytes_of(one, "all-gather logits (ring)"), T * E * s * (ranks - 1));
      EXPECT_EQ(p.step_bytes(), one.step_bytes());
      expect_step_dataflow(p);
    }
  }
}

TEST(Plan, ChunkedRingErrors) {
  auto expect_error = [](Names const& layout, Names const& layer, int ranks, Names const& frags) {
    try {
      plan(ranks, layout, layer);
      ADD_FAILURE() << "no ConfigError";
    } catch (moe::ConfigError const& e) {
      for (auto const& f : frags)
        EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  };
  Names const ring = {"ici_expert_parallelism=-1", "use_ring_of_experts=true"};
  auto with = [](Names v, std::string const& kv) {
    v.push_back(kv);
    return v;
  };
  expect_error(with(ring, "num_moe_emb_chunks=3"), {}, 2,
               {"num_moe_emb_chunks=3", "does not divide base_emb_dim=16"});
  expect_error(with(ring, "num_moe_emb_chunks=32"), {}, 2,
               {"num_moe_emb_chunks=32", "does not divide base_emb_dim=16"});
  expect_error({"ici_expert_parallelism=-1", "num_moe_emb_chunks=2"}, {}, 2,
               {"num_moe_emb_chunks=2", "needs the ring of experts", "ragged_all_to_all",
                "without use_ring_of_experts"});
  expect_error(with(ring, "num_moe_emb_chunks=2"), {}, 1,
               {"num_moe_emb_chunks=2", "needs the ring of experts", "local"});
  expect_error(with(ring, "num_moe_emb_chunks=2"), {"sparse_matmul=false"}, 2,
               {"num_moe_emb_chunks=2", "dense experts"});
  expect_error({"ici_data_parallelism=-1", "num_moe_emb_chunks=2"}, {}, 2,
               {"num_moe_emb_chunks=2", "needs the ring of experts"});
  // Decode: the batch does not split over the expert axis (replicated, not the ring).
  try {
    moe::make_plan(layer_config(), parallel_config(with(ring, "num_moe_emb_chunks=2")), 2, 0, 1, 4);
    ADD_FAILURE() << "no ConfigError";
  } catch (moe::ConfigError const& e) {
    EXPECT_NE(std::string(e.what()).find("replicated"), std::string::npos) << e.what();
  }
  expect_error(with(ring, "num_moe_emb_chunks=-1"), {}, 2, {"num_moe_emb_chunks"});
  EXPECT_THROW(parallel_config({"num_moe_emb_chunks=two"}), moe::ConfigError);
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

// The shared expert under expert parallelism is chosen by what it moves and computes (#30): on
// each rank's own tokens where the tokens are split over expert (the same FLOPs as EP-as-TP and
// no activation traffic), EP-as-TP where every expert rank holds the same tokens (1/ep of the
// FLOPs); the plan lists both alternatives' bytes and FLOPs, and they agree with hand counts.
TEST(Plan, SharedExpertStrategyIsChosenByBytesAndFlops) {
  for (Names const& layout : {Names{"ici_expert_parallelism=-1"},
                              Names{"ici_expert_parallelism=-1", "use_ring_of_experts=true"}}) {
    for (int ranks : {2, 4}) {
      auto const p = plan(ranks, layout);
      SCOPED_TRACE(layout.back() + " at " + std::to_string(ranks));
      EXPECT_EQ(p.layout.shared, moe::SharedExpert::own);
      ASSERT_EQ(p.choices.size(), 1u);
      auto const& c = p.choices[0];
      EXPECT_EQ(c.what, "shared expert");
      EXPECT_EQ(c.chosen, "own tokens");
      EXPECT_EQ(c.why, "same FLOPs, fewest bytes");
      ASSERT_EQ(c.alternatives.size(), 2u);
      auto const &own = c.alternatives[0], &split = c.alternatives[1];
      EXPECT_EQ(own.flops, split.flops);
      // D=16, Fs=8, float, T = 8*4/ranks tokens; own tokens: 3 weights of 128 values all-gathered
      // from blocks of 128/ranks and their gradients reduce-scattered back.
      std::int64_t const P = ranks, T = 32 / P, w = 3 * 128 / P * (P - 1) * 4;
      EXPECT_EQ(own.bytes, 2 * w);
      // EP-as-TP: the same weight gathers, the gradients un-sliced (3 x [16, 8/P] blocks; every
      // rank then keeps its stored block, the contributions already summed), and x, y, dy, dx
      // gathered / reduce-scattered over the expert group: 4 x T x D values from every other rank.
      EXPECT_EQ(split.bytes, 2 * w + 4 * T * 16 * (P - 1) * 4);
      EXPECT_EQ(own.flops, 18.0 * T * 16 * 8);  // 3 GEMMs forward, 6 backward
    }
  }
  // Decode: every expert rank holds the same tokens: EP-as-TP computes 1/ep of the FLOPs.
  auto const d = plan(2, {"ici_expert_parallelism=-1"}, {}, 1);
  EXPECT_EQ(d.layout.shared, moe::SharedExpert::split);
  ASSERT_EQ(d.choices.size(), 1u);
  EXPECT_EQ(d.choices[0].chosen, "ep-as-tp");
  EXPECT_EQ(d.choices[0].why, "fewest FLOPs");
  EXPECT_EQ(d.choices[0].alternatives[0].flops, 2 * d.choices[0].alternatives[1].flops);
  // No choice without expert parallelism, and none on EP-TP (its rules put the hidden dim on
  // the expert axes).
  EXPECT_TRUE(plan(2, {"ici_fsdp_parallelism=-1"}).choices.empty());
  EXPECT_TRUE(plan(2, {"custom_mesh_and_rule=ep-tp", "ici_expert_parallelism=-1"}).choices.empty());
  // The text and the JSON carry the choice.
  auto const p = plan(2, {"ici_expert_parallelism=-1"});
  EXPECT_NE(p.to_text().find("shared expert: own tokens (same FLOPs, fewest bytes"),
            std::string::npos);
  auto const j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(j["choices"][0]["chosen"], "own tokens");
  EXPECT_EQ(j["choices"][0]["alternatives"][1]["name"], "ep-as-tp");
}

namespace {

/// A published model's MoE layer (models.hpp) planned on `ranks` ranks, one 4,096-token
/// sequence per rank (or one token per rank at decode), in the layout a user would pick.
struct ScaleCase {
  std::string model, layout;
  int ranks;
};
moe::LayerPlan scale_plan(ScaleCase const& c, int rank = 0) {
  moe::LayerConfig cfg;
  moe::ParallelConfig par;
  for (auto const& [k, v] : moe::model_facts(c.model).key_values())
    if (moe::LayerConfig::has_key(k))
      cfg.set(k, v);
    else
      par.set(k, v);
  int const E = cfg.num_experts, n = c.ranks;
  int const ep = std::min(n, E), rest = n / ep;
  auto set = [&](char const* k, int v) { par.set(k, std::to_string(v)); };
  std::int64_t batch = n, seq = 4096;
  if (c.layout == "ep a2a" || c.layout == "ring") {
    set("ici_expert_parallelism", ep);
    set("ici_data_parallelism", rest);
    if (c.layout == "ring") par.set("use_ring_of_experts", "true");
  } else if (c.layout == "ep + fsdp") {  // EP over min(ranks, E) / 8, FSDP over up to 8, data
    int const e = std::max(1, ep / 8), f = std::min(8, n / e);
    set("ici_expert_parallelism", e);
    set("ici_fsdp_parallelism", f);
    set("ici_data_parallelism", n / (e * f));
  } else if (c.layout == "shard-exp-on-fsdp") {
    par.set("custom_mesh_and_rule", "shard-exp-on-fsdp");
    set("ici_fsdp_parallelism", ep);
    set("ici_data_parallelism", rest);
  } else {  // "ep-tp decode": one token per rank
    par.set("custom_mesh_and_rule", "ep-tp");
    set("ici_expert_parallelism", ep);
    set("ici_data_parallelism", rest);
    seq = 1;
    batch = rest;
  }
  return moe::make_plan(cfg, par, n, rank, batch, seq);
}

std::vector<ScaleCase> scale_cases() {
  std::vector<ScaleCase> v;
  for (char const* m : {"deepseek3-671b", "qwen3-235b-a22b", "mixtral-8x22b"})
    for (int n : {8, 64, 256, 2048})
      for (char const* l : {"ep a2a", "ring", "ep + fsdp", "shard-exp-on-fsdp", "ep-tp decode"})
        v.push_back({m, l, n});
  return v;
}

}  // namespace

// Plans at cluster scale (#30, plan only): for three published models, 8 to 2,048 ranks and the
// layouts a user would pick, no FFN moves more than it must -- where a choice of strategy is
// left, the plan takes one of the fewest FLOPs and, among those, of the fewest bytes -- and on the
// expert-parallel layouts the forward moves at most 1.25 x what dispatch, combine and the weight
// gathers must (on the first and the last rank); the cost model prices every stage.
TEST(PlanAtScale, NoStrategyMovesMoreThanItMust) {
  int planned = 0;
  for (auto const& c : scale_cases()) {
    SCOPED_TRACE(c.model + " " + c.layout + " at " + std::to_string(c.ranks));
    for (int rank : {0, c.ranks - 1}) {
      auto const p = scale_plan(c, rank);
      ++planned;
      for (auto const& ch : p.choices) {
        auto const& chosen = *std::find_if(ch.alternatives.begin(), ch.alternatives.end(),
                                           [&](auto const& a) { return a.name == ch.chosen; });
        for (auto const& a : ch.alternatives) {
          EXPECT_LE(chosen.flops, a.flops) << ch.what << ": " << a.name;
          if (a.flops == chosen.flops) {
            EXPECT_LE(chosen.bytes, a.bytes) << ch.what << ": " << a.name;
          }
        }
      }
      bool const ep = c.layout == "ep a2a" || c.layout == "ring" || c.layout == "ep + fsdp";
      if (ep && p.layout.ep() > 1) {
        std::int64_t must = 0;
        for (auto const& col : p.collectives) {
          if (col.backward) continue;
          bool const weights = col.what.rfind("gather ", 0) == 0;
          bool const tokens = col.what == "dispatch" || col.what == "combine" ||
                              col.what == "all-gather tokens (ring)" ||
                              col.what == "reduce-scatter y (expert)";
          if (weights || tokens) must += col.bytes;
        }
        EXPECT_LE(double(p.bytes(false)), 1.25 * double(must)) << p.to_text();
      }
      auto const cost = moe::estimate_step_cost(p, moe::Machine::preset("h100-ib"));
      EXPECT_GT(cost.seconds, 0);
      EXPECT_EQ(cost.stages.size(), p.step.forward.size() + p.step.backward.size());
    }
  }
  EXPECT_EQ(planned, 2 * 3 * 4 * 5);
}

// The cost model against hand counts on a two-node machine: a collective inside a node runs on
// the node's links, one that spans nodes on the network; an all-to-all splits its bytes between
// them; GEMM FLOPs at the value type's throughput; the overlapped stage of the chunked ring takes
// the larger of its compute and communication.
TEST(PlanCost, StagesArePricedByTheirLinksAndFlops) {
  moe::Machine m = moe::Machine::preset("cpu-cluster");
  m.set("ranks_per_node", "2");
  m.set("intra_gbps", "10");
  m.set("inter_gbps", "1");
  m.set("intra_latency_us", "1");
  m.set("inter_latency_us", "10");
  m.set("gemm_gflops_fp32", "1");
  m.set("memory_gbps", "1000000");
  // EP over 4 ranks on 2 nodes: dispatch / combine all-to-alls span the nodes (1 of the 3 peers
  // is on this node).
  auto const p = plan(4, {"ici_expert_parallelism=-1"});
  auto const c = moe::estimate_step_cost(p, m);
  auto const& d = c.stages[2];
  ASSERT_EQ(d.region, "moe::dispatch::ragged_all_to_all");
  double const bytes = double(bytes_of(p, "dispatch"));
  EXPECT_DOUBLE_EQ(d.comm_s, std::max(bytes / 3 / 10e9, bytes * 2 / 3 / 1e9) + 3 * 10e-6);
  // The experts: 6 x n x D x F FLOPs, n = T*K = 8*2 balanced rows, at 1 GFLOP/s.
  auto const& e = c.stages[3];
  EXPECT_EQ(e.region, "moe::dist::experts");
  EXPECT_DOUBLE_EQ(e.flops, 6.0 * 16 * 16 * 8);
  EXPECT_DOUBLE_EQ(e.compute_s, e.flops / 1e9);
  // The dense path (every local expert on every token) runs each expert's forward again in its
  // backward (nn::DenseExperts keeps one expert's hidden states): 9 GEMMs, 3 x the forward's.
  auto const dense = plan(1, {}, {"sparse_matmul=false"});
  double fwd = 0, bwd = 0;
  for (auto const& st : dense.step.forward) fwd += st.region == "moe::dist::experts" ? st.flops : 0;
  for (auto const& st : dense.step.backward)
    bwd += st.region == "moe::dist::experts::backward" ? st.flops : 0;
  EXPECT_EQ(fwd, 3 * 2.0 * (32 * 8) * 16 * 8);  // 3 GEMMs of (32 tokens x 8 experts) x D x F
  EXPECT_EQ(bwd, 3 * fwd);
  // FSDP over 2 ranks of one node: the weight gathers on the node's links.
  auto const f = plan(2, {"ici_fsdp_parallelism=-1"});
  auto const fc = moe::estimate_step_cost(f, m);
  double want = 0;
  for (auto const& col : f.step.forward[0].collectives) want += double(col.bytes) / 10e9 + 1e-6;
  EXPECT_DOUBLE_EQ(fc.stages[0].comm_s, want);
  // Weights: the gather writes the gathered compute blocks (read back by the GEMMs); where the
  // GEMMs pack their weights, a grouped-GEMM stage packs its new expert weights (read, written):
  // all of them in a training step, only the gathered ones when the weights stay.
  double const expert_bytes = 3.0 * 8 * 16 * 8 * 4;  // wi_0, wi_1, wo: [E, D, F] floats
  EXPECT_GE(double(fc.stages[0].bytes_moved), 2 * expert_bytes);
  auto const experts_moved = [](moe::StepCost const& sc, char const* region) {
    for (auto const& st : sc.stages)
      if (st.region == region) return double(st.bytes_moved);
    return -1.0;
  };
  auto const dp = plan(2, {"ici_data_parallelism=-1"});
  for (char const* region : {"moe::dist::experts", "moe::dist::experts::backward"}) {
    m.packs_weights = true;
    double const trained = experts_moved(moe::estimate_step_cost(dp, m), region);
    double const stays = experts_moved(moe::estimate_step_cost(dp, m, false), region);
    EXPECT_DOUBLE_EQ(trained - stays, 2 * expert_bytes) << region;
    EXPECT_DOUBLE_EQ(experts_moved(moe::estimate_step_cost(f, m, false), region) - stays,
                     2 * expert_bytes)
        << region;  // FSDP's gathered weights are new every step
    m.packs_weights = false;
    EXPECT_EQ(experts_moved(moe::estimate_step_cost(dp, m), region), stays) << region;
  }
  // A reduction lays each gradient out for its collectives (read and written: 2 x its bytes) and
  // sums what it receives: 3 x the reduced bytes through memory (all-reduce: half of what it
  // sends is reduced).
  auto const dc = moe::estimate_step_cost(dp, m);
  auto const& bw = dp.step.backward;
  bool seen = false;
  for (std::size_t i = 0; i < bw.size(); ++i) {
    if (bw[i].region != "moe::dist::reduce_grads") continue;
    double reduced = 0;
    for (auto const& col : bw[i].collectives)
      reduced += col.kind == "all-reduce"       ? double(col.bytes) / 2
                 : col.kind == "reduce-scatter" ? double(col.bytes)
                                                : 0;
    EXPECT_GT(reduced, 0);
    double laid_out = 0;
    for (auto const& r : bw[i].reads) {
      ASSERT_EQ(r.form, moe::distributed::Ref::Form::grad);
      for (auto const& t : dp.tensors)
        if (t.name == moe::distributed::to_string(static_cast<moe::distributed::Weight>(r.id))) {
          double b = 4;
          for (auto n : t.compute_shape) b *= double(n);
          laid_out += 2 * b;
        }
    }
    EXPECT_GE(laid_out, 2 * expert_bytes);
    EXPECT_DOUBLE_EQ(double(dc.stages[dp.step.forward.size() + i].bytes_moved),
                     laid_out + 3 * reduced);
    seen = true;
  }
  EXPECT_TRUE(seen);
  // The chunked ring overlaps its chunk gathers with its GEMMs.
  auto const r =
      plan(2, {"ici_expert_parallelism=-1", "use_ring_of_experts=true", "num_moe_emb_chunks=2"});
  auto const rc = moe::estimate_step_cost(r, m);
  auto const it = std::find_if(rc.stages.begin(), rc.stages.end(), [](auto const& s) {
    return s.region == "moe::dist::experts::chunked";
  });
  ASSERT_NE(it, rc.stages.end());
  EXPECT_TRUE(it->overlapped);
  EXPECT_DOUBLE_EQ(it->seconds, std::max(it->compute_s + it->memory_s, it->comm_s));
  // Sums, the dominant stage, bad machine keys.
  double sum = 0;
  for (auto const& s : c.stages) sum += s.seconds;
  EXPECT_DOUBLE_EQ(c.seconds, sum);
  for (auto const& s : c.stages) EXPECT_LE(s.seconds, c.stages[c.dominant].seconds);
  expect_error([&] { m.set("inter_gbps", "-1"); },
               {"machine.inter_gbps='-1' must be a number > 0"});
  expect_error([&] { m.set("warp_speed", "9"); }, {"machine.warp_speed is not a machine key"});
  expect_error([&] { m.set("packs_weights", "1"); },
               {"machine.packs_weights='1' must be true or false"});
  m.set("packs_weights", "true");
  EXPECT_TRUE(m.packs_weights);
  expect_error([] { moe::Machine::preset("tpu"); }, {"machine='tpu' is not a described machine"});
}

TEST(Plan, ShardExpOnFsdpGathersTheExpertDim) {
  auto const p = plan(2, {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=-1"});
  EXPECT_EQ(p.layout.preset, "shard-exp-on-fsdp");
  expect_shapes(p, "wi_0", {4, 16, 8}, {8, 16, 8});
  EXPECT_EQ(p.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {}, {}}));
  EXPECT_EQ(bytes_of(p, "gather wi_0"), 4 * 16 * 8 * 4);
  EXPECT_EQ(bytes_of(p, "reduce-scatter d_wi_0", true), 4 * 16 * 8 * 4);
}

// moe_dispatch_no_expert_sharding on the shapes of the models MaxText's PR #4179 targets (and
// DeepSeek-V3, which it leaves alone): the key moves the dense path from the all-gather /
// reduce-scatter fallback to the expert-parallel all-to-all and touches no other spec.
struct ModelShape {
  char const* name;
  int E, K, D, F;
};
class DispatchKey : public ::testing::TestWithParam<ModelShape> {};

TEST_P(DispatchKey, ShardsTheExpertDimNotTheBatch) {
  auto const m = GetParam();
  moe::LayerConfig cfg;
  cfg.num_experts = m.E;
  cfg.num_experts_per_tok = m.K;
  cfg.base_emb_dim = m.D;
  cfg.base_moe_mlp_dim = m.F;
  moe::LayerConfig sparse = cfg;
  cfg.sparse_matmul = false;
  // 8-way expert parallelism, alone and beside 2-way FSDP.
  for (Names layout : {Names{"ici_expert_parallelism=8"},
                       Names{"ici_expert_parallelism=8", "ici_fsdp_parallelism=2"}}) {
    int const ranks = layout.size() == 1 ? 8 : 16;
    SCOPED_TRACE(layout.back());
    auto const off = parallel_config(layout);
    layout.push_back("moe_dispatch_no_expert_sharding=true");
    auto const on = parallel_config(layout);
    for (int r : {0, ranks - 1}) {
      auto const a = moe::make_plan(cfg, off, ranks, r, 2 * ranks, 16);
      auto const b = moe::make_plan(cfg, on, ranks, r, 2 * ranks, 16);
      // Unset: the joint resolution, batch double-mapping `expert`, expert dim unsharded.
      EXPECT_EQ(sharding_json(a.layout.dispatch_spec),
                "[null, [\"data\", \"fsdp\", \"fsdp_transpose\", \"expert\"], null, "
                "\"tensor\"]");
      EXPECT_EQ(a.layout.dispatch_spec, a.layout.rules.resolve(a.dispatch_logical));
      EXPECT_EQ(a.layout.route, moe::ExpertRoute::Ring);
      EXPECT_FALSE(a.warnings.empty());
      // Set: expert dim on `expert`, batch dim without it.
      EXPECT_EQ(b.layout.dispatch_spec[0], Names{"expert"});
      EXPECT_EQ(
          std::count(b.layout.dispatch_spec[1].begin(), b.layout.dispatch_spec[1].end(), "expert"),
          0);
      EXPECT_EQ(b.layout.dispatch_spec, b.dispatch_repaired);
      EXPECT_EQ(b.layout.route, moe::ExpertRoute::RaggedA2A);
      EXPECT_TRUE(b.warnings.empty()) << b.warnings[0];
      // Every other spec and block is the same either way.
      EXPECT_EQ(a.layout.token_spec, b.layout.token_spec);
      EXPECT_EQ(a.layout.batch_axes, b.layout.batch_axes);
      EXPECT_EQ(a.layout.ep_axes, b.layout.ep_axes);
      ASSERT_EQ(a.tensors.size(), b.tensors.size());
      for (std::size_t i = 0; i < a.tensors.size(); ++i) {
        auto const &ta = a.tensors[i], &tb = b.tensors[i];
        SCOPED_TRACE(ta.name);
        EXPECT_EQ(ta.spec, tb.spec);
        EXPECT_EQ(ta.local_shape, tb.local_shape);
        EXPECT_EQ(ta.offset, tb.offset);
        if (ta.name != "x" && ta.name != "y") {
          EXPECT_EQ(ta.compute_shape, tb.compute_shape);
        }
      }
      // The all-to-all path is the sparse path's, collective for collective; the fallback
      // all-gathers the tokens instead.
      auto const sb = moe::make_plan(sparse, on, ranks, r, 2 * ranks, 16);
      EXPECT_EQ(signature(b), signature(sb));
      for (std::size_t i = 0; i < b.collectives.size(); ++i)
        EXPECT_EQ(b.collectives[i].bytes, sb.collectives[i].bytes) << b.collectives[i].what;
      EXPECT_EQ(signature(sb), signature(moe::make_plan(sparse, off, ranks, r, 2 * ranks, 16)));
      auto const has = [](LayerPlan const& p, std::string const& what) {
        return std::any_of(p.collectives.begin(), p.collectives.end(),
                           [&](auto const& c) { return c.what == what; });
      };
      EXPECT_TRUE(has(b, "dispatch") && has(b, "combine"));
      EXPECT_FALSE(has(b, "all-gather tokens (ring)"));
      EXPECT_TRUE(has(a, "all-gather tokens (ring)"));
      EXPECT_FALSE(has(a, "dispatch"));
      EXPECT_NE(a.step_bytes(), b.step_bytes());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DispatchKey,
                         ::testing::Values(ModelShape{"mixtral_8x7b", 8, 2, 4096, 14336},
                                           ModelShape{"mixtral_8x22b", 8, 2, 6144, 16384},
                                           ModelShape{"deepseek3_671b", 256, 8, 7168, 2048}),
                         [](auto const& info) { return std::string(info.param.name); });

TEST(Plan, DispatchKeyLeavesOtherLayoutsAlone) {
  // Without expert parallelism, on the sparse path, on the ring and with a replicated (decode)
  // batch the key changes nothing but the printed spec in effect.
  std::vector<std::pair<Names, Names>> const same = {
      {{"ici_fsdp_parallelism=-1"}, {"sparse_matmul=false"}},
      {{"ici_expert_parallelism=-1"}, {}},
      {{"ici_expert_parallelism=-1", "use_ring_of_experts=true"}, {}},
      {{"ici_expert_parallelism=2", "ici_tensor_parallelism=2"}, {}},
  };
  for (auto const& [layout, layer] : same) {
    auto with = layout;
    with.push_back("moe_dispatch_no_expert_sharding=true");
    auto const a = plan(4, layout, layer), b = plan(4, with, layer);
    EXPECT_EQ(a.layout.route, b.layout.route) << layout[0];
    EXPECT_EQ(signature(a), signature(b)) << layout[0];
    EXPECT_EQ(a.step_bytes(), b.step_bytes()) << layout[0];
  }
  auto const a = plan(4, {"ici_expert_parallelism=-1"}, {"sparse_matmul=false"}, 1);
  auto const b = plan(4, {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"},
                      {"sparse_matmul=false"}, 1);
  EXPECT_EQ(b.layout.route, moe::ExpertRoute::Replicated);
  EXPECT_EQ(signature(a), signature(b));
  // The text and JSON name the spec in effect.
  auto const p = plan(2, {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"},
                      {"sparse_matmul=false"});
  EXPECT_NE(p.to_text().find("in effect [expert, (data,fsdp,fsdp_transpose), -, tensor]"),
            std::string::npos)
      << p.to_text();
  auto const j = nlohmann::json::parse(p.to_json());
  EXPECT_EQ(j["dispatch"]["in_effect"][0], "expert");
  EXPECT_EQ(j["expert_route"], "ragged_all_to_all");
}

TEST(Plan, ShardExpOnFsdpKeyStoresTheExpertDimUnderEmbedMoe) {
  // MaxText's kernel axes (embed_moe, None, mlp_moe): E on fsdp (embed_moe's fallback, as
  // mlp_moe holds fsdp_transpose), every expert computed on every rank.
  auto const p = plan(4, {"ici_fsdp_parallelism=-1", "shard_exp_on_fsdp=true"});
  EXPECT_EQ(p.tensor("wi_0").logical,
            (moe::sharding::LogicalAxes{"embed_moe", std::nullopt, "mlp_moe"}));
  EXPECT_EQ(p.tensor("wo").logical,
            (moe::sharding::LogicalAxes{"embed_moe", "mlp_moe", std::nullopt}));
  EXPECT_EQ(p.layout.route, moe::ExpertRoute::Local);
  expect_shapes(p, "wi_0", {2, 16, 8}, {8, 16, 8});
  expect_shapes(p, "wo", {2, 8, 16}, {8, 8, 16});
  EXPECT_EQ(p.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {}, {}}));
  EXPECT_EQ(bytes_of(p, "gather wi_0"), 2 * 16 * 8 * 4 * 3);
  EXPECT_EQ(bytes_of(p, "reduce-scatter d_wi_0", true), 2 * 16 * 8 * 4 * 3);
  // The default kernel axes gather D instead: same bytes, other dimension.
  auto const d = plan(4, {"ici_fsdp_parallelism=-1"});
  EXPECT_EQ(d.tensor("wi_0").gathered, (std::vector<Names>{{}, {"fsdp"}, {}}));
  // With fsdp_transpose the F dim is gathered over it as well; tensor slices F in compute.
  auto const t = plan(
      4, {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2", "shard_exp_on_fsdp=true"});
  expect_shapes(t, "wi_0", {4, 16, 4}, {8, 16, 8});
  EXPECT_EQ(t.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {}, {"fsdp_transpose"}}));
  auto const tp =
      plan(4, {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "shard_exp_on_fsdp=true"});
  expect_shapes(tp, "wi_0", {4, 16, 4}, {8, 16, 4});
  EXPECT_EQ(tp.layout.tp_axes, Names{"tensor"});
  EXPECT_EQ(tp.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {}, {}}));
}

TEST(Plan, TwoDimFsdpKeyShardsExpertsOnFsdpAndTheInnerDimOnFsdpTranspose) {
  // MaxText's use_2d_fsdp_sharding kernel axes (embed_moe, mlp_moe, None) for wi and wo alike.
  auto const p = plan(4, {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2",
                          "use_2d_fsdp_sharding=true"});
  expect_shapes(p, "wi_0", {4, 8, 8}, {8, 16, 8});
  expect_shapes(p, "wo", {4, 4, 16}, {8, 8, 16});
  EXPECT_EQ(p.tensor("wi_0").gathered, (std::vector<Names>{{"fsdp"}, {"fsdp_transpose"}, {}}));
  EXPECT_EQ(p.tensor("wo").gathered, (std::vector<Names>{{"fsdp"}, {"fsdp_transpose"}, {}}));
  // Each expert-weight dimension is gathered over one axis: two-stage gathering changes nothing
  // for them (the gate, on (fsdp, fsdp_transpose), is gathered in two stages).
  auto const two = plan(4, {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2",
                            "use_2d_fsdp_sharding=true", "moe_fsdp_use_two_stage_all_gather=true"});
  for (char const* w : {"wi_0", "wi_1", "wo"}) {
    auto const &a = p.step.weight(w), &b = two.step.weight(w);
    ASSERT_EQ(a.to_compute.size(), 2u) << w;
    ASSERT_EQ(b.to_compute.size(), 2u) << w;
    for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(a.to_compute[i].axes, b.to_compute[i].axes) << w;
  }
  EXPECT_EQ(two.step_bytes(), p.step_bytes());
  // shard_exp_on_fsdp wins when both are set (MaxText's if / elif).
  auto const both =
      plan(4, {"ici_fsdp_parallelism=-1", "shard_exp_on_fsdp=true", "use_2d_fsdp_sharding=true"});
  EXPECT_EQ(both.tensor("wo").logical,
            (moe::sharding::LogicalAxes{"embed_moe", "mlp_moe", std::nullopt}));
  EXPECT_EQ(both.tensor("wi_0").logical,
            (moe::sharding::LogicalAxes{"embed_moe", std::nullopt, "mlp_moe"}));
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
  // With the key set the repair is in effect: nothing to warn about.
  EXPECT_TRUE(plan(2, {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"})
                  .warnings.empty());
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
  // Every expert computed on every rank leaves no expert axis to route over.
  expect_error(
      [] {
        plan(4, {"ici_fsdp_parallelism=2", "ici_expert_parallelism=2", "shard_exp_on_fsdp=true"});
      },
      {"shard_exp_on_fsdp=true", "expert mesh axis of size 1", "(it is 2)"});
  expect_error(
      [] {
        plan(2, {"ici_expert_parallelism=-1", "use_2d_fsdp_sharding=true"});
      },
      {"use_2d_fsdp_sharding=true", "expert mesh axis of size 1"});
  // use_2d_fsdp_sharding computes wi's embedding dimension over mlp_no_fsdp (tensor).
  expect_error(
      [] {
        plan(4,
             {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "use_2d_fsdp_sharding=true"});
      },
      {"use_2d_fsdp_sharding=true", "embedding dimension over mesh axes [tensor]",
       "set those ici_* degrees to 1"});
  // The experts' dimension is stored over fsdp: E must divide.
  expect_error(
      [] {
        plan(16, {"ici_fsdp_parallelism=-1", "shard_exp_on_fsdp=true"}, {}, 16);
      },
      {"num_experts=8", "not divisible", "[fsdp] = 16"});
  // The dense all-to-all has no receive buffer to cap (MaxText's dense path has none).
  expect_error(
      [] {
        plan(2,
             {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true",
              "ragged_buffer_factor=2.0"},
             {"sparse_matmul=false"});
      },
      {"ragged_buffer_factor=2", "sparse_matmul=true"});
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
  // The plan, then the memory estimate of one training step on this rank.
  ASSERT_GE(t.out.size(), want.to_text().size());
  EXPECT_EQ(t.out.substr(0, want.to_text().size()), want.to_text());
  auto const mem = moe::estimate_layer_memory(want, want.config, true);
  EXPECT_NE(t.out.find("\nmemory per rank (estimate of one training step"), std::string::npos);
  EXPECT_NE(t.out.find(mem.to_text()), std::string::npos) << t.out;
  EXPECT_EQ(t.out.find("WARNING: ", t.out.find("\nmemory per rank")), std::string::npos);

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
  // The memory estimate as the library makes it.
  auto const p3 = moe::make_plan(layer_config({"num_experts=16"}),
                                 parallel_config({"ici_expert_parallelism=4"}), 4, 3, 8, 4);
  auto const m3 = moe::estimate_layer_memory(p3, p3.config, true);
  EXPECT_EQ(doc["memory"]["total_bytes"], m3.total());
  EXPECT_EQ(doc["memory"]["training"], true);
  EXPECT_EQ(doc["memory"]["packed_expert_weights"], moe::default_packed_weights(p3));
  EXPECT_TRUE(doc["memory"]["index_limit_error"].is_null());
  ASSERT_EQ(doc["memory"]["items"].size(), m3.items.size());
  EXPECT_EQ(doc["memory"]["items"][0]["what"], "weights");
  EXPECT_EQ(doc["memory"]["items"][0]["bytes"], m3.items[0].bytes);
  EXPECT_EQ(doc["memory"]["items"][0]["keys"][0], "num_experts");

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
  PlanFile const bad(std::string(kConfig) + "steps: 3\nbogus_key: 1\n");
  PlanFile const bare("num_experts: 8\n");
  auto check = [](std::string const& args, Names const& frags) {
    auto const r = run_shard(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_TRUE(r.out.empty()) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    for (auto const& s : frags)
      EXPECT_NE(r.err.find(s), std::string::npos) << args << ": " << r.err;
  };
  // MaxText's keys (steps) are accepted; a key of neither set is not.
  check("--plan '" + bad.path() + "'", {"unknown config key 'bogus_key'"});
  check("--plan '" + f.path() + "' bogus=1", {"unknown config key 'bogus'"});
  check("--plan '" + f.path() + "' ici_expert_parallelism=-1", {"-1", "--ranks N"});
  check("--plan '" + bare.path() + "'", {"global batch", "--batch B"});
  check("--plan '" + bare.path() + "' --batch 2", {"sequence length", "--seq S"});
  check("--plan '" + f.path() + "' num_experts=6", {"num_experts=6", "not divisible", "= 4"});
  check("--plan '" + f.path() + "' --ranks 2", {"does not equal the communicator size 2"});
  check("--plan '" + f.path() + "' --rank 4", {"--rank 4"});
  check("--plan '" + f.path() + "' --dtype half", {"--dtype half"});
  check("--preset default --mesh data=2 --ranks 2", {"only valid with --plan"});
  check("--plan '" + f.path() + "' --machine tpu", {"machine='tpu' is not a described machine"});
  check("--plan '" + f.path() + "' --machine h100-ib machine.inter_gbps=0",
        {"machine.inter_gbps='0' must be a number > 0"});
  check("--plan '" + f.path() + "' machine.warp=2", {"machine.warp is not a machine key"});
}

// --machine: the plan, the memory estimate, then the step's cost on the machine, the same as the
// library's; a machine file and machine.KEY overrides change what they name.
TEST(MoeShardPlan, MachineAddsTheCost) {
#ifndef MOE_SHARD_EXE
  GTEST_SKIP() << "moe-shard not built";
#endif
  PlanFile const f(kConfig);
  auto const want =
      moe::make_plan(layer_config(), parallel_config({"ici_expert_parallelism=4"}), 4, 0, 8, 4);
  auto const t = run_shard("--plan '" + f.path() + "' --machine h100-ib");
  ASSERT_EQ(t.status, 0) << t.err;
  auto const cost = moe::estimate_step_cost(want, moe::Machine::preset("h100-ib"));
  EXPECT_NE(t.out.find(cost.to_text()), std::string::npos) << t.out;
  PlanFile const m("preset: cpu-cluster\nranks_per_node: 4\n");
  auto const j = run_shard("--plan '" + f.path() + "' --json --machine '" + m.path() +
                           "' machine.memory_gbps=123");
  ASSERT_EQ(j.status, 0) << j.err;
  auto const js = nlohmann::json::parse(j.out);
  EXPECT_EQ(js["cost"]["machine"]["ranks_per_node"], 4);
  EXPECT_EQ(js["cost"]["machine"]["memory_gbps"], 123.0);
  EXPECT_EQ(js["cost"]["machine"]["gemm_gflops_fp32"], 4000.0);
  EXPECT_EQ(js["cost"]["stages"].size(), want.step.forward.size() + want.step.backward.size());
  EXPECT_GT(js["cost"]["step_seconds"].get<double>(), 0);
}

// ---------------------------------------------------------------------------------------------
// Memory estimate and index limits (moe/distributed/memory.hpp)

namespace {

/// Whether a layer of `dtype` runs oneDNN's bf16 kernels here (its expert weights packed as bf16,
/// its dense GEMMs on bf16 copies).
bool packs_bf16([[maybe_unused]] moe::ComputeDtype dtype) {
#if MOE_HAS_ONEDNN
  return dtype == moe::ComputeDtype::BFloat16 && moe::detail::onednn::bf16_kernels();
#else
  return false;
#endif
}

/// estimate_layer_memory of the plan test's layer (E=8, K=2, D=16, F=8, one shared expert, S=4).
moe::MemoryEstimate estimate(int ranks, Names const& layout, std::int64_t batch = 8,
                             bool training = true, bool packed = false) {
  auto const p = plan(ranks, layout, {}, batch);
  return moe::estimate_layer_memory(p, p.config, training, packed);
}

}  // namespace

TEST(MemoryEstimate, WeightsAndGradientsOfOneRank) {
  // Stored blocks = whole tensors: gate 16x8, wi_0 / wi_1 / wo 8x16x8, shared 16x8, 16x8, 8x16.
  std::int64_t const elems = 16 * 8 + 3 * 8 * 16 * 8 + 3 * 16 * 8;  // 3584
  auto const m = estimate(1, {"ici_data_parallelism=-1"});
  EXPECT_EQ(m.bytes("weights"), elems * 4);
  // The stored-block gradients only: with no op between the compute and stored blocks (one
  // rank), the backward writes the compute-block gradients straight into them.
  EXPECT_EQ(m.bytes("weight gradients"), elems * 4);
  EXPECT_EQ(m.bytes("gathered weights"), 0);
  EXPECT_EQ(m.bytes("packed expert weights"), 0);
  EXPECT_EQ(m.bytes("communication buffers"), 0);  // one rank: no collective
  // oneDNN's packed copies: the expert weights once forward, once transposed for the backward.
  auto const packed = estimate(1, {"ici_data_parallelism=-1"}, 8, true, true);
  EXPECT_EQ(packed.bytes("packed expert weights"), 2 * 3 * 8 * 16 * 8 * 4);
  auto const fwd = estimate(1, {"ici_data_parallelism=-1"}, 8, false, true);
  EXPECT_EQ(fwd.bytes("packed expert weights"), 3 * 8 * 16 * 8 * 4);
  EXPECT_EQ(fwd.bytes("weight gradients"), 0);
  // Expert hidden states of the local route: T*K = 32*2 rows of F = 8, 3 forward + 2 backward.
  EXPECT_EQ(m.bytes("expert hidden states"), 5 * 64 * 8 * 4);
  EXPECT_EQ(fwd.bytes("expert hidden states"), 3 * 64 * 8 * 4);
  // float64 doubles every value.
  auto const p8 =
      moe::make_plan(layer_config(), parallel_config({"ici_data_parallelism=-1"}), 1, 0, 8, 4, 8);
  EXPECT_EQ(moe::estimate_layer_memory(p8, p8.config, true, false).bytes("weights"), elems * 8);
  std::int64_t sum = 0;
  for (auto const& i : m.items) sum += i.bytes;
  EXPECT_EQ(m.total(), sum);
}

// dtype=bfloat16 keeps a rounded copy (fp32-held bf16 values, remade for each weight version) of
// each weight its GEMMs take in bf16 and do not round themselves: the gate always (not under
// float32_gate_logits); the routed experts' only where their grouped GEMMs are not oneDNN's
// (packed_weights), which round them as they pack them; the shared expert's, and the routed
// experts' on the dense masked path (sparse_matmul=false), only where the dense GEMMs are not
// oneDNN's bf16 kernels, which round B as they copy it (MOE_BF16_KERNELS on and off, on a CPU
// with bf16 instructions; without them only off).
TEST(MemoryEstimate, Bf16KeepsRoundedCopiesOfTheWeightsItsGemmsDoNotRound) {
  std::int64_t const gate = 16 * 8 * 4, experts = 3 * 8 * 16 * 8 * 4, shared = 3 * 16 * 8 * 4;
  std::int64_t const masters = gate + experts + shared;
  Names const one{"ici_data_parallelism=-1"};
  auto copies = [&](Names const& layer, bool packed) {
    auto const p = plan(1, one, layer);
    auto const m = moe::estimate_layer_memory(p, p.config, true, packed);
    EXPECT_EQ(m.bytes("weights"), masters) << "the fp32 masters";
    return m.bytes("bf16 weight copies");
  };
  char const* was = std::getenv("MOE_BF16_KERNELS");
  std::string const saved = was ? was : "";
  for (char const* setting : {"on", "off"}) {
    SCOPED_TRACE(std::string("MOE_BF16_KERNELS=") + setting);
    ::setenv("MOE_BF16_KERNELS", setting, 1);
    bool const kernels = packs_bf16(moe::ComputeDtype::BFloat16);
    std::int64_t const dense = kernels ? 0 : shared;  // the shared expert's, if kept
    EXPECT_EQ(copies({}, true), 0);
    EXPECT_EQ(copies({"dtype=bfloat16"}, false), masters);
    EXPECT_EQ(copies({"dtype=bfloat16"}, true), gate + dense);
    EXPECT_EQ(copies({"dtype=bfloat16", "float32_gate_logits=true"}, true), dense);
    EXPECT_EQ(copies({"dtype=bfloat16", "sparse_matmul=false"}, true),
              gate + (kernels ? 0 : experts + shared));
  }
  if (was)
    ::setenv("MOE_BF16_KERNELS", saved.c_str(), 1);
  else
    ::unsetenv("MOE_BF16_KERNELS");
}

TEST(MemoryEstimate, FsdpGathersAndScattersBlocks) {
  // Stored blocks at fsdp=4 (Plan.FsdpGathersWeightsAndReduceScattersGradients): gate [4,8],
  // wi_0 / wi_1 [8,4,8], wo [8,8,4], shared_wi_0 / shared_wi_1 [4,8], shared_wo [8,4].
  std::int64_t const stored = 32 + 3 * 256 + 3 * 32;       // 896
  std::int64_t const computed = 128 + 3 * 1024 + 3 * 128;  // 3584: whole tensors
  auto const m = estimate(4, {"ici_fsdp_parallelism=-1"});
  EXPECT_EQ(m.bytes("weights"), stored * 4);
  EXPECT_EQ(m.bytes("gathered weights"), computed * 4);
  // Stored-block gradient, compute-block gradient, the reduce-scattered block.
  EXPECT_EQ(m.bytes("weight gradients"), (stored + computed + stored) * 4);
  // The pool's all-gather unpack, reduce-scatter pack and receive buffers: the largest weight.
  EXPECT_EQ(m.bytes("communication buffers"), 3 * 1024 * 4);
  // In segments of 64 values (comm/segments.hpp): tiles of 16 of wi_0's D x F values per rank
  // (4 ranks), or 4 leading rows of wo's 4 (its D/4), gate's and shared_wi_0's receive buffer a
  // tile too (16 of D/4 x E per rank): one tile of 64 values each.
  {
    auto& seg = moe::comm::detail::segment_bytes();
    std::int64_t const saved = seg;
    seg = 64 * 4;
    auto const tiled = estimate(4, {"ici_fsdp_parallelism=-1"});
    seg = saved;
    EXPECT_EQ(tiled.bytes("communication buffers"), 3 * 64 * 4);
    EXPECT_EQ(tiled.total() - tiled.bytes("communication buffers"),
              m.total() - m.bytes("communication buffers"));
  }
  // Two-stage gathers over one axis are one stage: the same.
  EXPECT_EQ(estimate(4, {"ici_fsdp_parallelism=-1", "moe_fsdp_use_two_stage_all_gather=true"})
                .bytes("gathered weights"),
            computed * 4);
}

TEST(MemoryEstimate, ActivationsAreLinearInTheBatch) {
  for (Names const& layout : {Names{"ici_data_parallelism=-1"}, Names{"ici_expert_parallelism=-1"},
                              Names{"ici_expert_parallelism=-1", "use_ring_of_experts=true"},
                              Names{"ici_tensor_parallelism=-1"}}) {
    auto const a = estimate(2, layout, 8), b = estimate(2, layout, 16);
    for (char const* item : {"token rows", "expert hidden states", "shared expert"}) {
      EXPECT_GT(a.bytes(item), 0) << item << " " << layout[0];
      EXPECT_EQ(b.bytes(item), 2 * a.bytes(item)) << item << " " << layout[0];
    }
    // Routing: linear but for the sort's per-chunk cursors (a few hundred bytes).
    EXPECT_GT(b.bytes("routing"), 2 * a.bytes("routing") - 1024) << layout[0];
    EXPECT_LE(b.bytes("routing"), 2 * a.bytes("routing")) << layout[0];
    EXPECT_EQ(b.bytes("weights"), a.bytes("weights"));
    EXPECT_EQ(b.bytes("weight gradients"), a.bytes("weight gradients"));
  }
}

TEST(MemoryEstimate, EmbChunksCountTheirBuffers) {
  // num_moe_emb_chunks=n on the ring: x_chunks replaces x_work (same [Tw, D]); added are the own
  // tokens repacked chunk-major [T, D] and one chunk of the sorted rows [n_rows, D/n]. The own
  // gate logits [T, E] gathered into the routing's are the ring's, chunked or not.
  Names const ring{"ici_expert_parallelism=2", "use_ring_of_experts=true"};
  std::int64_t const D = 16, E = 8, K = 2, s = 4;
  auto const one = estimate(2, ring);
  for (std::int64_t nc : {2, 4}) {
    Names chunked = ring;
    chunked.push_back("num_moe_emb_chunks=" + std::to_string(nc));
    auto const p = plan(2, chunked);
    ASSERT_EQ(p.step.emb_chunks, nc);
    std::int64_t const T = p.local_tokens, rows = 2 * T * K / 2;  // Tw*K slots, half local
    auto const m = estimate(2, chunked);
    EXPECT_EQ(m.bytes("token rows") - one.bytes("token rows"), (T * D + rows * (D / nc)) * s);
    EXPECT_EQ(m.bytes("routing"), one.bytes("routing"));
    EXPECT_GE(one.bytes("routing"), T * E * s);
    EXPECT_EQ(m.bytes("expert hidden states"), one.bytes("expert hidden states"));
  }
}

TEST(MemoryEstimate, TextJsonAndKeys) {
  auto const m = estimate(2, {"ici_expert_parallelism=-1"});
  auto const j = nlohmann::json::parse(m.to_json());
  EXPECT_EQ(j["total_bytes"], m.total());
  ASSERT_EQ(j["items"].size(), m.items.size());
  for (std::size_t i = 0; i < m.items.size(); ++i) {
    EXPECT_EQ(j["items"][i]["what"], m.items[i].what);
    EXPECT_EQ(j["items"][i]["bytes"], m.items[i].bytes);
    EXPECT_FALSE(j["items"][i]["keys"].empty()) << m.items[i].what;
  }
  EXPECT_EQ(m.text().rfind(moe::format_bytes(m.total()), 0), 0u) << m.text();
  EXPECT_NE(m.to_text().find("total"), std::string::npos);
  auto const keys = m.keys_to_reduce();
  EXPECT_NE(std::find(keys.begin(), keys.end(), "per_device_batch_size"), keys.end());
  EXPECT_EQ(moe::format_bytes(512), "512 B");
  EXPECT_EQ(moe::format_bytes(3 * 1024 * 1024 / 2), "1.5 MiB");
  EXPECT_EQ(moe::format_bytes(std::int64_t(93) << 30), "93.0 GiB");
}

TEST(MemoryEstimate, CheckedArithmeticNamesTheQuantity) {
  EXPECT_EQ(moe::checked_mul(1 << 20, 1 << 20, "q"), std::int64_t(1) << 40);
  EXPECT_EQ(moe::checked_product({2, 3, 4}, "q"), 24);
  auto message = [](auto const& f) {
    try {
      f();
    } catch (moe::ConfigError const& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto const m1 =
      message([] { moe::checked_mul(std::int64_t(1) << 40, std::int64_t(1) << 30, "the answer"); });
  EXPECT_NE(m1.find("the answer = 1099511627776 x 1073741824"), std::string::npos) << m1;
  EXPECT_NE(m1.find("does not fit a 64-bit integer"), std::string::npos) << m1;
  auto const m2 = message([] {
    moe::checked_product({1 << 30, 1 << 30, 1 << 30}, "the element count of wi_0");
  });
  EXPECT_NE(m2.find("the element count of wi_0 = 1073741824 x 1073741824 x 1073741824"),
            std::string::npos)
      << m2;
  auto const m3 = message(
      [] { moe::checked_add(std::numeric_limits<std::int64_t>::max(), 1, "the total bytes"); });
  EXPECT_NE(m3.find("the total bytes"), std::string::npos) << m3;
  // A layer whose expert weights alone overflow int64 bytes: refused, not wrapped.
  moe::LayerConfig big = layer_config();
  big.num_experts = 1 << 30;
  big.base_emb_dim = 1 << 30;
  big.base_moe_mlp_dim = 1 << 30;
  big.shared_experts = 0;
  auto const p = moe::make_plan(big, parallel_config({"ici_data_parallelism=-1"}), 1, 0, 1, 1);
  auto const m4 = message([&] { moe::estimate_layer_memory(p, big, true); });
  EXPECT_NE(m4.find("the element count of"), std::string::npos) << m4;
  EXPECT_NE(m4.find("does not fit a 64-bit integer"), std::string::npos) << m4;
  EXPECT_NE(message([&] { moe::check_index_limits(p); }).find("does not fit a 64-bit integer"),
            std::string::npos);
}

namespace {
/// An execution space whose flat kernels index with 32-bit unsigned ints (as CUDA and HIP).
struct Device32 {
  using size_type = unsigned int;
  static char const* name() { return "Device32"; }
};
}  // namespace

TEST(MemoryEstimate, IndexLimits) {
  EXPECT_NO_THROW(
      moe::check_index_limits(plan(4, {"ici_expert_parallelism=2", "ici_fsdp_parallelism=2"})));
  auto const dev = moe::IndexLimits::of<Device32>();
  EXPECT_EQ(dev.max_elements, std::int64_t(UINT_MAX));
  EXPECT_EQ(moe::IndexLimits::host().max_elements, std::numeric_limits<std::int64_t>::max());
  // Expert parallelism over 2 ranks with D = 65536 and 2^15 tokens per rank: each dispatch
  // sends T*K*D/2 = 2^31 elements, more than INT_MAX. moe/comm splits such messages (MPI's int
  // counts are no limit), and host kernels index with 64 bits: accepted on the host. A device
  // whose kernels index with 32 bits cannot reach the 2^32 elements of the sorted rows: refused,
  // naming the tensor and the keys.
  moe::LayerConfig wide = layer_config();
  wide.base_emb_dim = 65536;
  wide.shared_experts = 0;
  auto const a2a = moe::make_plan(wide, parallel_config({"ici_expert_parallelism=-1"}), 2, 0,
                                  std::int64_t(1) << 13, 8);
  ASSERT_EQ(a2a.local_tokens, std::int64_t(1) << 15);
  for (auto const& c : a2a.collectives) {
    if (c.what == "dispatch") {
      EXPECT_GT(c.bytes / 4, std::int64_t(INT_MAX)) << c.bytes;
    }
  }
  EXPECT_NO_THROW(moe::check_index_limits(a2a));
  try {
    moe::check_index_limits(a2a, dev);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    std::string const m = e.what();
    EXPECT_NE(m.find("x_sorted [65536, 65536] holds 4294967296 elements"), std::string::npos) << m;
    EXPECT_NE(m.find("32-bit Device32::size_type"), std::string::npos) << m;
    EXPECT_NE(m.find("reduce per_device_batch_size, max_target_length"), std::string::npos) << m;
  }
  // More tokens on one rank than a 32-bit BLAS call takes as rows (the router's GEMM): refused
  // on every space.
  auto const tall = moe::make_plan(layer_config(), parallel_config({"ici_data_parallelism=-1"}), 1,
                                   0, std::int64_t(1) << 20, std::int64_t(1) << 11);
  try {
    moe::check_index_limits(tall);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    std::string const m = e.what();
    EXPECT_NE(m.find("tokens routed on this rank: 2147483648 rows"), std::string::npos) << m;
    EXPECT_NE(m.find("reduce per_device_batch_size, max_target_length"), std::string::npos) << m;
  }
}

TEST(MemoryEstimate, AvailableMemoryAndRequireFits) {
#ifdef __linux__
  EXPECT_GT(moe::available_memory_bytes(), 0);
#endif
  EXPECT_GE(moe::ranks_on_node(moe_test::self_comm()), 1);
  moe::MemoryEstimate m;
  m.add("activations", std::int64_t(88) << 30, "per_device_batch_size, max_target_length");
  m.add("weights", std::int64_t(3) << 29, "num_experts, base_emb_dim");
  m.add("optimizer", std::int64_t(5) << 29, "num_experts, base_emb_dim");
  m.add("weights", std::int64_t(1) << 29, "base_moe_mlp_dim");  // merged into the item
  EXPECT_EQ(m.items.size(), 3u);
  EXPECT_EQ(m.bytes("weights"), std::int64_t(2) << 30);
  EXPECT_EQ(m.items[1].keys, "num_experts, base_emb_dim, base_moe_mlp_dim");
  ::unsetenv("MOE_SKIP_MEMORY_CHECK");
  EXPECT_NO_THROW(moe::require_fits("tool", m, std::int64_t(200) << 30, 2));
  EXPECT_NO_THROW(moe::require_fits("tool", m, -1, 2));  // unknown: no check
  try {
    moe::require_fits("tool", m, std::int64_t(45) << 30, 2);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    std::string const msg = e.what();
    EXPECT_NE(msg.find("tool needs about 92.5 GiB per rank (activations 88.0 GiB, optimizer "
                       "2.5 GiB, weights 2.0 GiB) but this node has 45.0 GiB available for 2 "
                       "ranks (22.5 GiB each): reduce per_device_batch_size or "
                       "max_target_length (or set MOE_SKIP_MEMORY_CHECK=1 to run anyway)"),
              std::string::npos)
        << msg;
  }
  try {
    moe::require_fits("tool", m, std::int64_t(45) << 30, 1, "base_emb_dim");
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    std::string const msg = e.what();
    EXPECT_NE(msg.find("45.0 GiB available: reduce base_emb_dim"), std::string::npos) << msg;
  }
  ::setenv("MOE_SKIP_MEMORY_CHECK", "1", 1);
  EXPECT_NO_THROW(moe::require_fits("tool", m, 1, 1));
  ::unsetenv("MOE_SKIP_MEMORY_CHECK");
}

TEST(MemoryEstimate, TrainMoeWholeModel) {
  train::TrainConfig cfg;  // default.yml: V=16, D=64, C=4, 2 layers of E=8, F=128, K=2; float32
  cfg.dataset_type = "synthetic";
  auto const m = train::estimate_memory(cfg, 1, false);
  // Non-MoE parameters: embedding [16,64], mixing [4,64], 3 norm scales [64], output [64,16].
  std::int64_t const dense = 16 * 64 + 4 * 64 + 3 * 64 + 64 * 16;  // 2496
  std::int64_t const moe_layer = 64 * 8 + 3 * 8 * 64 * 128;        // 197120: gate + experts
  EXPECT_EQ(m.bytes("weights"), (dense + 2 * moe_layer) * 4);
  // Gradients: the dense ones + per layer the stored-block gradients (one rank: the compute-block
  // gradients are the stored ones).
  EXPECT_EQ(m.bytes("gradients"), (dense + 2 * moe_layer) * 4);
  EXPECT_EQ(m.bytes("optimizer (AdamW moments)"), 2 * (dense + 2 * moe_layer) * 4);
  // T = 8 x 64 tokens: (3N + 7) = 13 [T,D] rows, N + 2 = 4 per-token values, 3 token-id arrays.
  std::int64_t const T = 8 * 64;
  EXPECT_EQ(m.bytes("activations"), 13 * T * 64 * 4 + 4 * T * 4 + 3 * T * 4);
  EXPECT_EQ(m.bytes("logits"), 2 * T * 16 * 4);
  auto const layer = moe::estimate_layer_memory(train::layer_plan(cfg, 1), cfg.layer, true, false);
  EXPECT_EQ(m.bytes("MoE expert hidden states"), 2 * layer.bytes("expert hidden states"));
  EXPECT_EQ(m.bytes("MoE token rows"), 2 * layer.bytes("token rows"));
  // Activations double with the batch; the weights stay.
  cfg.per_device_batch_size = 16;
  auto const m2 = train::estimate_memory(cfg, 1, false);
  EXPECT_EQ(m2.bytes("activations"), 2 * m.bytes("activations"));
  EXPECT_EQ(m2.bytes("MoE expert hidden states"), 2 * m.bytes("MoE expert hidden states"));
  EXPECT_EQ(m2.bytes("weights"), m.bytes("weights"));
  // bf16 compute: the parameters, gradients and moments are the fp32 masters' as before; the
  // rounded copies of the weights (without packs: every weight's) are an item of their own.
  cfg.per_device_batch_size = 8;
  cfg.set("dtype", "bfloat16");
  ASSERT_TRUE(cfg.layer.bf16());
  auto const b = train::estimate_memory(cfg, 1, false);
  EXPECT_EQ(b.bytes("weights"), m.bytes("weights"));
  EXPECT_EQ(b.bytes("gradients"), m.bytes("gradients"));
  EXPECT_EQ(b.bytes("optimizer (AdamW moments)"), m.bytes("optimizer (AdamW moments)"));
  EXPECT_EQ(b.bytes("bf16 weight copies"), 2 * moe_layer * 4);
  // The brief's runaway configurations are refused with the keys to change.
  train::TrainConfig huge;
  huge.per_device_batch_size = 65536;
  huge.max_target_length = 65536;
  try {
    train::check_index_limits(huge, 2);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    EXPECT_NE(std::string(e.what()).find("rows on this rank exceed"), std::string::npos)
        << e.what();
  }
  train::TrainConfig wide;
  wide.layer.num_experts = 64;
  wide.layer.base_emb_dim = 4096;
  wide.layer.base_moe_mlp_dim = 16384;
  EXPECT_NO_THROW(train::check_index_limits(wide, 2));
  ::unsetenv("MOE_SKIP_MEMORY_CHECK");
  try {
    train::require_fits(train::estimate_memory(wide, 2), std::int64_t(22) << 30, 2);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (moe::ConfigError const& e) {
    std::string const msg = e.what();
    EXPECT_EQ(msg.rfind("train_moe needs about ", 0), 0u) << msg;
    EXPECT_NE(msg.find("available for 2 ranks (11.0 GiB each): reduce num_experts, base_emb_dim"),
              std::string::npos)
        << msg;
  }
}

namespace {

using moe_test::AllocationTracker;

/// A bf16 layer of 8 experts, 2 per token, widths D and F.
moe::LayerConfig bf16_layer(int D, int F) {
  moe::LayerConfig cfg;
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  cfg.base_emb_dim = D;
  cfg.base_moe_mlp_dim = F;
  cfg.dtype = moe::ComputeDtype::BFloat16;
  return cfg;
}

/// A layer's packed expert weights (bytes) against the estimate's item: equal for bf16 packs;
/// fp32 packs in oneDNN's blocked layouts take somewhat more than their values (2 % at D=1024,
/// F=2816, 31 % at D=64, F=128 on an AMX Xeon), which the estimate does not model.
void expect_packed_bytes(moe::MemoryEstimate const& est, std::int64_t packed, bool bf16) {
  if (!MOE_HAS_ONEDNN) return;
  std::int64_t const want = est.bytes("packed expert weights");
  if (bf16) {
    EXPECT_EQ(packed, want);
  } else {
    EXPECT_GE(packed, want) << "fp32 packs hold at least their values";
    EXPECT_LE(double(packed), 1.35 * double(want)) << "fp32 packs padded more than expected";
  }
}

}  // namespace

// The estimate against what a layer step really allocates: the peak of the Kokkos allocations
// of a DistributedMoeLayer (one rank) from its construction through forward and backward, with
// its gradients (oneDNN's packed copies, outside Kokkos, against the layer's pack cache),
// in float32 and in bf16 compute, whose hidden states (routed or dense experts', the shared
// expert's) are 16-bit (half the bytes), on the sparse path and the dense masked one.
TEST(MemoryEstimate, MatchesTheLayersAllocations) {
  if (Kokkos::Tools::profileLibraryLoaded()) GTEST_SKIP() << "a Kokkos Tools library is loaded";
  for (bool sparse : {true, false}) {
    std::int64_t hidden_fp32 = 0, shared_fp32 = 0, rows_fp32 = 0;
    for (auto dtype : {moe::ComputeDtype::Native, moe::ComputeDtype::BFloat16}) {
      char const* const name = dtype == moe::ComputeDtype::Native ? "float32" : "bfloat16";
      SCOPED_TRACE(std::string(name) + (sparse ? ", sparse" : ", dense"));
      moe::LayerConfig cfg = bf16_layer(64, 128);
      cfg.shared_experts = 1;
      cfg.load_balance_loss_weight = 0.01;
      cfg.sparse_matmul = sparse;
      cfg.dtype = dtype;
      moe::ParallelConfig par;
      std::int64_t const B = 16, S = 64, D = 64;
      auto const p = moe::make_plan(cfg, par, 1, 0, B, S);
      // With the GEMMs this layer runs (oneDNN's where moe has it): no rounded copy of the expert
      // weights where they round them as they pack them.
      auto const est = moe::estimate_layer_memory(p, cfg, true, moe::default_packed_weights(p));
      moe::View3<float> x("x", B, S, D), y("y", B, S, D), dy("dy", B, S, D), dx("dx", B, S, D);
      Kokkos::Random_XorShift64_Pool<> pool(7);
      Kokkos::fill_random(x, pool, -1.0f, 1.0f);
      Kokkos::fill_random(dy, pool, -1.0f, 1.0f);
      std::int64_t peak = 0, packed = 0;
      {
        AllocationTracker tracker;
        {
          moe::DistributedMoeLayer<float> layer(moe_test::self_comm(), cfg, par, B, S);
          layer.parameters().for_each(
              [&](char const*, auto const& v) { Kokkos::fill_random(v, pool, -0.1f, 0.1f); });
          moe::DistributedMoeLayer<float>::params_type grads;
          for (int step = 0; step < 2; ++step) {
            layer.forward(x, y);
            layer.backward(dy, dx, grads);
          }
          Kokkos::fence();
          packed = std::int64_t(layer.pack_cache().bytes());
        }
        peak = AllocationTracker::peak;
      }
      // oneDNN's packed expert weights (outside Kokkos): the estimate's item, at the width of
      // the kernels this CPU runs (bf16 packs where it runs oneDNN's bf16 kernels).
      if (sparse)
        expect_packed_bytes(moe::estimate_layer_memory(p, cfg, true, true), packed,
                            packs_bf16(dtype));
      // The estimate's Kokkos allocations: not the packed copies, nor the GEMMs' operand copies
      // (oneDNN-side buffers of the threads).
      std::int64_t const kokkos =
          est.total() - est.bytes("packed expert weights") - est.bytes("GEMM operand copies");
      double const ratio = double(kokkos) / double(peak);
      std::printf("%s, %s: estimate %lld bytes, Kokkos peak %lld bytes, ratio %.3f\n", name,
                  sparse ? "sparse" : "dense", static_cast<long long>(kokkos),
                  static_cast<long long>(peak), ratio);
      EXPECT_GT(ratio, 0.9) << est.to_text();
      EXPECT_LT(ratio, 1.3) << est.to_text();
      // h0, h1, act, d_act, d_h1 on T*K rows (sparse) or T rows (dense: one expert's) of F, and
      // the shared expert's h0, h1, act, d_act on T rows of its width: 16-bit with bf16 where
      // the layer's GEMMs take them (oneDNN).
      using Gmm = moe::gmm::resolve_t<moe::gmm::Auto, Kokkos::DefaultExecutionSpace, float>;
      bool const b16 = dtype == moe::ComputeDtype::BFloat16 && moe::gmm::handles_bf16<Gmm>::value;
      std::int64_t const hidden = est.bytes("expert hidden states"),
                         shared = est.bytes("shared expert");
      if (sparse) {
        EXPECT_EQ(hidden, 5 * B * S * 2 * 128 * (b16 ? 2 : 4));
      }
      // Token rows: the routed rows at the experts (x_local, y_local, dy_local on T*K rows of D)
      // and the output gradient their combine's backward reads (dy_work, T x D) 16-bit where the
      // hidden states are (the experts' dx rows overwrite dy_local). The bf16 step rounds dy
      // where it first copies it (dy_work here), and its shared expert reads a rounded copy of
      // it (dy_shared, T x D floats), with no copy of dy of the layer's own.
      std::int64_t const rows = est.bytes("token rows"), n = B * S * 2;
      if (dtype == moe::ComputeDtype::Native) {
        hidden_fp32 = hidden;
        shared_fp32 = shared;
        rows_fp32 = rows;
      } else {
        EXPECT_EQ(hidden_fp32 - hidden, b16 ? 5 * B * S * (sparse ? 2 : 1) * 128 * 2 : 0);
        EXPECT_EQ(shared_fp32 - shared, (b16 ? 4 * B * S * 128 * 2 : 0) - B * S * D * 4);
        EXPECT_EQ(rows_fp32 - rows, b16 && sparse ? 3 * n * D * 2 + B * S * D * 2 : 0);
      }
    }
  }
}

// Without tensor axes the stages write the caller's y as they go (it stands in for y_cols): a
// forward whose y is its own x (one array) gives the y of a forward into another array, since
// the layer copies x before any stage writes y. float32 and bf16, with a shared expert.
TEST(StepBuffers, ForwardIntoItsOwnInputGivesTheSameY) {
  for (auto dtype : {moe::ComputeDtype::Native, moe::ComputeDtype::BFloat16}) {
    SCOPED_TRACE(dtype == moe::ComputeDtype::Native ? "float32" : "bfloat16");
    moe::LayerConfig cfg = bf16_layer(32, 64);
    cfg.shared_experts = 1;
    cfg.dtype = dtype;
    std::int64_t const B = 4, S = 16, D = 32;
    moe::DistributedMoeLayer<float> layer(moe_test::self_comm(), cfg, moe::ParallelConfig{}, B, S);
    ASSERT_EQ(layer.step_plan().find(moe::distributed::Buf::y_cols)->caller,
              moe::distributed::Buf::y);
    Kokkos::Random_XorShift64_Pool<> pool(11);
    layer.parameters().for_each(
        [&](char const*, auto const& v) { Kokkos::fill_random(v, pool, -0.2f, 0.2f); });
    moe::View3<float> x("x", B, S, D), y("y", B, S, D), xy("xy", B, S, D);
    Kokkos::fill_random(x, pool, -1.0f, 1.0f);
    Kokkos::deep_copy(xy, x);
    layer.forward(x, y);
    layer.forward(xy, xy);
    auto const a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    auto const b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), xy);
    int differ = 0, nonzero = 0;
    for (std::int64_t i = 0; i < B; ++i)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t d = 0; d < D; ++d) {
          differ += a(i, s, d) != b(i, s, d);
          nonzero += a(i, s, d) != 0.0f;
        }
    EXPECT_EQ(differ, 0);
    EXPECT_GT(nonzero, B * S * D / 2);
  }
}

// oneDNN's packed expert weights of a bf16 layer are bf16 where this CPU runs oneDNN's bf16
// kernels (MOE_BF16_KERNELS=on, where the tier has bf16 instructions), fp32 otherwise (off): the
// estimate counts each at the width of the kernels, 2 x 3 x E x D x F values in training, and a
// layer's pack cache holds that after a step (bf16: exactly; fp32: with oneDNN's padding).
TEST(MemoryEstimate, CountsPackedWeightsAtTheWidthOfTheKernels) {
#if !MOE_HAS_ONEDNN
  GTEST_SKIP() << "without oneDNN nothing is packed";
#else
  char const* was = std::getenv("MOE_BF16_KERNELS");
  std::string const saved = was ? was : "";
  moe::LayerConfig const cfg = bf16_layer(64, 128);
  moe::ParallelConfig par;
  std::int64_t const B = 4, S = 64, D = 64;
  for (char const* setting : {"off", "on"}) {
    SCOPED_TRACE(std::string("MOE_BF16_KERNELS=") + setting);
    ::setenv("MOE_BF16_KERNELS", setting, 1);
    bool const bf16 = moe::detail::onednn::bf16_kernels();
    if (std::string(setting) == "off") {
      EXPECT_FALSE(bf16);
    }
    auto const p = moe::make_plan(cfg, par, 1, 0, B, S);
    EXPECT_EQ(moe::estimate_layer_memory(p, cfg, true, true).bytes("packed expert weights"),
              2 * 3 * 8 * 64 * 128 * (bf16 ? 2 : 4));
    EXPECT_EQ(moe::estimate_layer_memory(p, cfg, false, true).bytes("packed expert weights"),
              3 * 8 * 64 * 128 * (bf16 ? 2 : 4));
    moe::View3<float> x("x", B, S, D), y("y", B, S, D), dy("dy", B, S, D), dx("dx", B, S, D);
    Kokkos::Random_XorShift64_Pool<> pool(3);
    Kokkos::fill_random(x, pool, -1.0f, 1.0f);
    Kokkos::fill_random(dy, pool, -1.0f, 1.0f);
    moe::DistributedMoeLayer<float> layer(moe_test::self_comm(), cfg, par, B, S);
    layer.parameters().for_each(
        [&](char const*, auto const& v) { Kokkos::fill_random(v, pool, -0.1f, 0.1f); });
    moe::DistributedMoeLayer<float>::params_type grads;
    layer.forward(x, y);
    layer.backward(dy, dx, grads);
    expect_packed_bytes(moe::estimate_layer_memory(p, cfg, true, true),
                        std::int64_t(layer.pack_cache().bytes()), bf16);
  }
  if (was)
    ::setenv("MOE_BF16_KERNELS", saved.c_str(), 1);
  else
    ::unsetenv("MOE_BF16_KERNELS");
#endif
}

// The GEMMs' operand copies with bf16 compute and oneDNN, which depend on the CPU's tier. With
// bf16 instructions: the bf16 copies of the GEMMs on oneDNN's bf16 matmul
// (detail::onednn::bf16_gemm), two buffers of the calling thread at their largest use. At E=8,
// K=2, D=1024, F=2816 and T=4096 tokens on one rank (balanced routing: 1024 rows per expert) the
// routed weight gradients' copies are [F, 1024] and [1024, F]; a shared expert (H=F) adds its
// dense GEMMs, [T, F] and [T, F] in the backward (a^T.d_out's A, x^T.d_h's B). A scratch program
// measured the buffers after a step on an AMX CPU: 6.13 MB each without the shared expert (1,088
// rows in its largest group, against the estimate's balanced 1,024), 23.07 MB each with it.
// In inference only the shared expert's forward GEMMs copy ([T, F] for a.wo's A, [D, F] for
// x.w0's B). Without bf16 instructions: float copies of 16-bit operands in one buffer of the
// calling thread at its largest use, the weight gradients' [T*K, F] hidden state and [T*K, D]
// routed rows in training, a shared expert's [T, F] in inference. All are buffers of the threads
// kept from call to call. Nothing for float32 or without oneDNN.
TEST(MemoryEstimate, CountsTheGemmOperandCopies) {
  moe::LayerConfig cfg = bf16_layer(1024, 2816);
  std::int64_t const T = 4096, F = 2816;
  bool bf16_cpu = false;
#if MOE_HAS_ONEDNN
  bf16_cpu = moe::detail::onednn::bf16_kernels();
#endif
  using Gmm = moe::gmm::resolve_t<moe::gmm::Auto, Kokkos::DefaultExecutionSpace, float>;
  bool const hidden16 = moe::gmm::handles_bf16<Gmm>::value;
  for (int shared : {0, 1}) {
    cfg.shared_experts = shared;
    auto const p = moe::make_plan(cfg, moe::ParallelConfig{}, 1, 0, 4, 1024);
    std::int64_t const want = !MOE_HAS_ONEDNN ? 0
                              : bf16_cpu      ? 2 * (shared ? T * F : 1024 * F) * 2
                              : hidden16      ? T * 2 * (F + 1024) * 4
                                              : 0;
    EXPECT_EQ(moe::estimate_layer_memory(p, cfg, true, true).bytes("GEMM operand copies"), want)
        << "shared_experts=" << shared << (bf16_cpu ? ", bf16 instructions" : "");
    EXPECT_EQ(moe::estimate_layer_memory(p, cfg, true, false).bytes("GEMM operand copies"), 0);
    std::int64_t const inference = !MOE_HAS_ONEDNN ? 0
                                   : bf16_cpu      ? shared * (T * F + 1024 * F) * 2
                                   : hidden16      ? shared * T * F * 4
                                                   : 0;
    EXPECT_EQ(moe::estimate_layer_memory(p, cfg, false, true).bytes("GEMM operand copies"),
              inference)
        << "inference, shared_experts=" << shared;
  }
  cfg.dtype = moe::ComputeDtype::Native;
  auto const p = moe::make_plan(cfg, moe::ParallelConfig{}, 1, 0, 4, 1024);
  EXPECT_EQ(moe::estimate_layer_memory(p, cfg, true, true).bytes("GEMM operand copies"), 0);
}
