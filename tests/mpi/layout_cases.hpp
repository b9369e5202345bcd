#pragma once
// The layouts the distributed-layer tests run at the current rank count: single strategies at
// every count, their mixtures at 4 ranks. Shared by test_distributed_layer.cpp (against the
// single-rank layer), test_plan.cpp (the plan against the layer's comm log) and
// test_bf16_wire.cpp, with the helpers they all use (take_block).
#include <moe/config.hpp>
#include <moe/tensor_block.hpp>

#include <cstdint>
#include <string>
#include <vector>

/// The block [offset, offset + local) of a row-major global tensor, row-major.
inline std::vector<double> take_block(std::vector<double> const& g, moe::TensorBlock const& b) {
  std::size_t const r = b.global_shape.size();
  std::int64_t n = 1;
  for (auto e : b.local_shape) n *= e;
  std::vector<double> out;
  out.reserve(std::size_t(n));
  std::vector<std::int64_t> c(r);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t rem = i, flat = 0;
    for (std::size_t d = r; d-- > 0;) {
      c[d] = rem % b.local_shape[d];
      rem /= b.local_shape[d];
    }
    for (std::size_t d = 0; d < r; ++d) flat = flat * b.global_shape[d] + b.offset[d] + c[d];
    out.push_back(g[std::size_t(flat)]);
  }
  return out;
}

/// The layer every distributed test runs (and tests/unit/test_plan.cpp plans): E=8, K=2, D=16,
/// F=8, one shared expert, the given load-balance loss weight, then `extra` key=value settings.
inline moe::LayerConfig test_layer_config(double load_balance_loss_weight = 0,
                                          std::vector<std::string> const& extra = {}) {
  moe::LayerConfig cfg;
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  cfg.base_emb_dim = 16;
  cfg.base_moe_mlp_dim = 8;
  cfg.shared_experts = 1;
  cfg.load_balance_loss_weight = load_balance_loss_weight;
  for (auto const& kv : extra) {
    auto const eq = kv.find('=');
    cfg.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return cfg;
}

struct LayoutCase {
  std::string name;
  std::vector<std::string> layout;      // ParallelConfig key=value
  std::vector<std::string> layer;       // extra LayerConfig key=value
  std::int64_t batch = 8;               // global batch
  std::vector<double> bias_boost = {};  // added to gate_bias[e] (skews routing)
  bool balanced = true;                 // the plan test's inputs route T*K/E slots to every expert
};

inline std::vector<LayoutCase> layout_cases(int n) {
  std::vector<LayoutCase> v = {
      {"dp", {"ici_data_parallelism=-1"}, {}},
      {"fsdp", {"ici_fsdp_parallelism=-1"}, {}},
      {"fsdp_transpose", {"ici_fsdp_transpose_parallelism=-1"}, {}},
      {"ep_a2a", {"ici_expert_parallelism=-1"}, {}},
      {"ep_ring", {"ici_expert_parallelism=-1", "use_ring_of_experts=true"}, {}},
      {"tp", {"ici_tensor_parallelism=-1"}, {}},
      {"ep_deepseek",
       {"ici_expert_parallelism=-1"},
       {"decoder_block=deepseek", "routed_score_func=sigmoid", "routed_bias=true",
        "n_routing_groups=4", "topk_routing_group=2", "routed_bias_update_rate=0.01",
        "routed_scaling_factor=2.0"}},
      {"ep_capacity", {"ici_expert_parallelism=-1"}, {"capacity_factor=1.0"}},
      {"ep_random",
       {"ici_expert_parallelism=-1"},
       {"use_random_routing=true", "seed=5"},
       8,
       {},
       false},
      {"dense_fsdp", {"ici_fsdp_parallelism=-1"}, {"sparse_matmul=false"}},
      {"dense_ep", {"ici_expert_parallelism=-1"}, {"sparse_matmul=false"}},
      {"decode_replicated", {"ici_expert_parallelism=-1"}, {}, 1},
      {"shard_exp_on_fsdp",
       {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=-1"},
       {}},
      {"two_stage", {"ici_fsdp_parallelism=-1", "moe_fsdp_use_two_stage_all_gather=true"}, {}},
      // Skewed routing: every token picks experts 0 and 1 (the first expert shard gets all rows,
      // the others none; experts 2..7 get no tokens), or only the last shard receives rows.
      {"ep_all_to_first_experts",
       {"ici_expert_parallelism=-1"},
       {"routed_bias=true"},
       8,
       {50.0, 40.0}},
      {"ring_all_to_first_experts",
       {"ici_expert_parallelism=-1", "use_ring_of_experts=true"},
       {"routed_bias=true"},
       8,
       {50.0, 40.0}},
      {"ep_all_to_last_experts",
       {"ici_expert_parallelism=-1"},
       {"routed_bias=true"},
       8,
       {0, 0, 0, 0, 0, 0, 50.0, 40.0}},
      // The dense path with `expert` peeled off the dispatch batch dimension: all-to-all.
      {"dense_ep_no_exp_batch",
       {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"},
       {"sparse_matmul=false"}},
      {"dense_ep_no_exp_batch_skewed",
       {"ici_expert_parallelism=-1", "moe_dispatch_no_expert_sharding=true"},
       {"sparse_matmul=false", "routed_bias=true"},
       8,
       {50.0, 40.0}},
      // A preset whose activation_batch_moe leaves out `expert`: its dense dispatch spec is
      // expert-parallel without the key.
      {"dense_ep_pipeline_preset",
       {"custom_mesh_and_rule=pipeline-large-moe", "ici_expert_parallelism=-1"},
       {"sparse_matmul=false"}},
      // MaxText's shard_exp_on_fsdp / use_2d_fsdp_sharding kernel axes.
      {"shard_exp_on_fsdp_key", {"ici_fsdp_parallelism=-1", "shard_exp_on_fsdp=true"}, {}},
      {"fsdp_2d", {"ici_fsdp_parallelism=-1", "use_2d_fsdp_sharding=true"}, {}},
  };
  // A receive cap large enough for every row (MaxText allows the cap only with EP > 1).
  if (n > 1) {
    v.push_back({"ep_ragged_buffer_no_drop",
                 {"ici_expert_parallelism=-1", "ragged_buffer_factor=8.0"},
                 {}});
    // The ring's token gather in D-chunks overlapped with the grouped GEMM (needs EP > 1).
    std::vector<LayoutCase> chunks = {
        {"ring_emb_chunks2",
         {"ici_expert_parallelism=-1", "use_ring_of_experts=true", "num_moe_emb_chunks=2"},
         {}},
        {"ring_emb_chunks4_deepseek",
         {"ici_expert_parallelism=-1", "use_ring_of_experts=true", "num_moe_emb_chunks=4"},
         {"decoder_block=deepseek", "routed_score_func=sigmoid", "routed_bias=true",
          "n_routing_groups=4", "topk_routing_group=2", "routed_bias_update_rate=0.01"}},
        {"ring_emb_chunks2_all_to_first_experts",
         {"ici_expert_parallelism=-1", "use_ring_of_experts=true", "num_moe_emb_chunks=2"},
         {"routed_bias=true"},
         8,
         {50.0, 40.0}},
        {"ring_emb_chunks4_random",
         {"ici_expert_parallelism=-1", "use_ring_of_experts=true", "num_moe_emb_chunks=4"},
         {"use_random_routing=true", "seed=5"},
         8,
         {},
         false},
    };
    v.insert(v.end(), chunks.begin(), chunks.end());
  }
  if (n == 4) {
    std::vector<LayoutCase> mix = {
        {"ep2_fsdp2", {"ici_expert_parallelism=2", "ici_fsdp_parallelism=2"}, {}},
        {"ep2_dp2", {"ici_expert_parallelism=2", "ici_data_parallelism=2"}, {}},
        {"ring2_dp2",
         {"ici_expert_parallelism=2", "ici_data_parallelism=2", "use_ring_of_experts=true"},
         {}},
        {"ep2_tp2", {"ici_expert_parallelism=2", "ici_tensor_parallelism=2"}, {}},
        {"fsdp2_fsdpt2", {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2"}, {}},
        {"fsdp2_fsdpt2_two_stage",
         {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2",
          "moe_fsdp_use_two_stage_all_gather=true"},
         {}},
        {"shard_exp_on_fsdp_ep",
         {"custom_mesh_and_rule=shard-exp-on-fsdp", "ici_fsdp_parallelism=2",
          "ici_expert_parallelism=2"},
         {}},
        {"dense_ep2_tp2",
         {"ici_expert_parallelism=2", "ici_tensor_parallelism=2"},
         {"sparse_matmul=false"}},
        {"ring2_dp2_emb_chunks4",
         {"ici_expert_parallelism=2", "ici_data_parallelism=2", "use_ring_of_experts=true",
          "num_moe_emb_chunks=4"},
         {}},
        {"ring2_tp2_emb_chunks2",
         {"ici_expert_parallelism=2", "ici_tensor_parallelism=2", "use_ring_of_experts=true",
          "num_moe_emb_chunks=2"},
         {"capacity_factor=1.0"}},
        {"ep2_tp2_capacity_half",
         {"ici_expert_parallelism=2", "ici_tensor_parallelism=2"},
         {"capacity_factor=0.5"}},
        {"dense_ep2_tp2_no_exp_batch",
         {"ici_expert_parallelism=2", "ici_tensor_parallelism=2",
          "moe_dispatch_no_expert_sharding=true"},
         {"sparse_matmul=false"}},
        {"dense_ep2_fsdp2_no_exp_batch_capacity",
         {"ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
          "moe_dispatch_no_expert_sharding=true"},
         {"sparse_matmul=false", "capacity_factor=1.0"}},
        {"dense_ep2_dp2_no_exp_batch_deepseek",
         {"ici_expert_parallelism=2", "ici_data_parallelism=2",
          "moe_dispatch_no_expert_sharding=true"},
         {"sparse_matmul=false", "decoder_block=deepseek", "routed_score_func=sigmoid",
          "routed_bias=true", "n_routing_groups=4", "topk_routing_group=2",
          "routed_bias_update_rate=0.01"}},
        {"shard_exp_on_fsdp_key_fsdp2_fsdpt2",
         {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2", "shard_exp_on_fsdp=true"},
         {}},
        {"shard_exp_on_fsdp_key_fsdp2_tp2_dense",
         {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "shard_exp_on_fsdp=true"},
         {"sparse_matmul=false"}},
        {"fsdp2_fsdpt2_2d",
         {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2",
          "use_2d_fsdp_sharding=true"},
         {}},
        {"fsdp2_fsdpt2_2d_two_stage",
         {"ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=2", "use_2d_fsdp_sharding=true",
          "moe_fsdp_use_two_stage_all_gather=true"},
         {}},
    };
    v.insert(v.end(), mix.begin(), mix.end());
  }
  return v;
}

/// EP-TP layouts (the tokens split on D over the expert axis): every count has the single
/// strategy (the preset, expert_shard_attention_option=tp on the default rules, the dense path,
/// skewed routing with the load-balance loss and a routed bias); 4 and 8 ranks add DP x EP and
/// FSDP x EP mixtures. Run by their own tests (the 8-rank ctest registration runs only those).
inline std::vector<LayoutCase> ep_tp_cases(int n) {
  std::vector<std::string> const preset = {"custom_mesh_and_rule=ep-tp"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.begin(), preset.begin(), preset.end());
    return v;
  };
  std::vector<LayoutCase> v = {
      {"ep_tp", with({"ici_expert_parallelism=-1"}), {}},
      {"ep_tp_option", {"expert_shard_attention_option=tp", "ici_expert_parallelism=-1"}, {}},
      {"ep_tp_dense", with({"ici_expert_parallelism=-1"}), {"sparse_matmul=false"}},
      {"ep_tp_deepseek",
       with({"ici_expert_parallelism=-1"}),
       {"decoder_block=deepseek", "routed_score_func=sigmoid", "routed_bias=true",
        "n_routing_groups=4", "topk_routing_group=2", "routed_bias_update_rate=0.01",
        "routed_scaling_factor=2.0", "load_balance_loss_weight=0.01"}},
      {"ep_tp_capacity", with({"ici_expert_parallelism=-1"}), {"capacity_factor=1.0"}},
      {"ep_tp_all_to_first_experts",
       with({"ici_expert_parallelism=-1"}),
       {"routed_bias=true"},
       8,
       {50.0, 40.0}},
  };
  if (n == 4) {
    std::vector<LayoutCase> mix = {
        {"ep_tp2_dp2", with({"ici_expert_parallelism=2", "ici_data_parallelism=2"}), {}},
        {"ep_tp2_fsdp2", with({"ici_expert_parallelism=2", "ici_fsdp_parallelism=2"}), {}},
        {"ep_tp2_fsdp2_option",
         {"expert_shard_attention_option=tp", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"},
         {}},
    };
    v.insert(v.end(), mix.begin(), mix.end());
  }
  if (n == 8) {
    std::vector<LayoutCase> mix = {
        {"ep_tp4_dp2", with({"ici_expert_parallelism=4", "ici_data_parallelism=2"}), {}},
        {"ep_tp2_fsdp2_dp2",
         with({"ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_data_parallelism=2"}),
         {}},
    };
    v.insert(v.end(), mix.begin(), mix.end());
  }
  return v;
}
