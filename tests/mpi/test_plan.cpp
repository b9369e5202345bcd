// moe::make_plan predicts the step DistributedMoeLayer runs: for every layout of
// test_distributed_layer.cpp at this rank count, the plan's blocks are the layer's blocks and its
// collectives are the layer's comm_log() records (names, kinds, axes, stages and phases in order;
// bytes exactly, including the all-to-alls when the routing is balanced, which the inputs here
// arrange); and the memory estimate made from the plan is the peak of the layer's own Kokkos
// allocations on every rank of every layout.
#include <moe/distributed/layer.hpp>
#include <moe/distributed/memory.hpp>
#include <moe/distributed/plan.hpp>

#include <gtest/gtest.h>

#include <moe/comm/mpi.hpp>
#include "../allocation_tracker.hpp"
#include "layout_cases.hpp"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;

using Case = LayoutCase;

template <class T>
void set_all(T& c, std::vector<std::string> const& kvs) {
  for (auto const& kv : kvs) {
    auto const eq = kv.find('=');
    c.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
}

template <class V>
void fill_block(V const& v, moe::TensorBlock const& b, std::vector<double> const& global) {
  using T = typename V::non_const_value_type;
  auto const vals = take_block(global, b);
  for (std::size_t i = 0; i < vals.size(); ++i) v.data()[i] = T(vals[i]);
}

using moe_test::AllocationTracker;

/// Runs case `c` with D = `D`, F = 2D, `S` tokens per sequence: the plan against the layer's
/// comm log (`memory` false), or the memory estimate against the peak of the layer's Kokkos
/// allocations from its construction through two forward + backward steps (`memory` true).
/// Scalar float with `bf16`: the dtype=bfloat16 layer (its collectives on the bf16 wire).
template <class Scalar = double>
void run_case(Case const& c, bool memory = false, std::int64_t D = 16, std::int64_t S = 4,
              bool bf16 = false) {
  int size = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  moe::LayerConfig cfg = test_layer_config(0.05, c.layer);
  cfg.base_emb_dim = int(D);
  if (memory) cfg.base_moe_mlp_dim = int(2 * D);
  if (bf16) cfg.dtype = moe::ComputeDtype::BFloat16;
  moe::ParallelConfig par;
  set_all(par, c.layout);
  std::int64_t const B = c.batch, E = 8;
  std::unique_ptr<AllocationTracker> tracker;
  if (memory) tracker = std::make_unique<AllocationTracker>();

  auto const plan = moe::make_plan(cfg, par, size, rank, B, S, sizeof(Scalar));
  std::int64_t const before = AllocationTracker::live;
  moe::DistributedMoeLayer<Scalar> layer(MPI_COMM_WORLD, cfg, par, B, S);
  EXPECT_EQ(plan.layout.route, layer.expert_route());
  EXPECT_EQ(plan.layout.batch_axes, layer.batch_axes());
  for (auto const& t : plan.tensors) {
    auto const b = layer.block(t.name);
    EXPECT_EQ(t.global_shape, b.global_shape) << t.name;
    EXPECT_EQ(t.local_shape, b.local_shape) << t.name;
    EXPECT_EQ(t.offset, b.offset) << t.name;
  }

  // Global token g scores experts g%8 (3) and (g+4)%8 (2) far above the rest, so each contiguous
  // block of 8 tokens routes two slots to every expert and each sequence one slot per expert.
  std::mt19937_64 gen(7);
  std::normal_distribution<double> noise(0.0, 0.01);
  std::vector<double> x(std::size_t(B * S * D)), gate(std::size_t(D * E), 0.0);
  for (std::int64_t g = 0; g < B * S; ++g)
    for (std::int64_t d = 0; d < D; ++d)
      x[std::size_t(g * D + d)] =
          noise(gen) + (d == g % E ? 3.0 : 0.0) + (d == (g + E / 2) % E ? 2.0 : 0.0);
  for (std::int64_t e = 0; e < E; ++e) gate[std::size_t(e * E + e)] = 1.0;
  std::normal_distribution<double> w(0.0, 0.3);
  layer.parameters().for_each([&](char const* n, auto const& v) {
    auto const b = layer.block(n);
    std::int64_t m = 1;
    for (auto e : b.global_shape) m *= e;
    std::vector<double> global(static_cast<std::size_t>(m));
    for (auto& e : global) e = w(gen);
    if (std::string(n) == "gate") global = gate;
    if (std::string(n) == "gate_bias")
      for (auto& e : global) e *= 0.1;
    fill_block(v, b, global);
  });
  auto const xb = layer.block("x");
  std::int64_t const b_local = xb.local_shape[0], Dl = xb.local_shape[2];
  moe::View3<Scalar, Mem> lx("lx", b_local, S, Dl), ly("ly", b_local, S, Dl);
  moe::View3<Scalar, Mem> ldy("ldy", b_local, S, Dl), ldx("ldx", b_local, S, Dl);
  fill_block(lx, xb, x);
  Kokkos::deep_copy(ldy, 1.0);
  if (memory) {
    // The estimate's items for the GEMMs this layer runs (oneDNN's where moe has it: no rounded
    // copy of the expert weights, which its packing rounds) against what the layer allocated
    // beyond the caller's tensors. oneDNN's packed copies and the GEMMs' thread buffers are not
    // Kokkos allocations: not counted on either side.
    std::int64_t const callers = 4 * b_local * S * Dl * std::int64_t(sizeof(Scalar));
    typename moe::DistributedMoeLayer<Scalar>::params_type grads;
    for (int step = 0; step < 2; ++step) {
      layer.forward(lx, ly);
      layer.backward(ldy, ldx, grads);
    }
    Kokkos::fence();
    bool const onednn = moe::default_packed_weights(plan);
    auto const est = moe::estimate_layer_memory(plan, cfg, true, onednn);
    std::int64_t const kokkos =
        est.total() - est.bytes("packed expert weights") - est.bytes("GEMM operand copies");
    double const ratio = double(kokkos) / double(AllocationTracker::peak - before - callers);
    EXPECT_GT(ratio, 0.9) << "rank " << rank << "\n" << est.to_text();
    EXPECT_LT(ratio, 1.3) << "rank " << rank << "\n" << est.to_text();
    return;
  }
  layer.forward(lx, ly);
  typename moe::DistributedMoeLayer<Scalar>::params_type grads;
  layer.backward(ldy, ldx, grads);

  auto const& log = layer.comm_log().records;
  ASSERT_EQ(log.size(), plan.collectives.size()) << plan.to_text();
  for (std::size_t i = 0; i < log.size(); ++i) {
    auto const& got = log[i];
    auto const& want = plan.collectives[i];
    SCOPED_TRACE("record " + std::to_string(i) + ": " + want.what);
    EXPECT_EQ(got.what, want.what);
    EXPECT_EQ(got.kind, want.kind);
    EXPECT_EQ(got.axes, want.axes);
    EXPECT_EQ(got.stage, want.stage);
    EXPECT_EQ(got.backward, want.backward);
    if (!want.balanced || c.balanced) {
      EXPECT_EQ(got.bytes, want.bytes);
    } else {
      // Unbalanced routing: at most every slot of the expert group lands on one rank.
      EXPECT_GE(got.bytes, 0);
      EXPECT_LE(got.bytes, want.bytes * 2 * plan.layout.ep());
    }
  }
  if (c.balanced) {
    EXPECT_EQ(layer.comm_log().total_bytes(), plan.step_bytes());
  }
}

std::vector<Case> cases(int n) { return layout_cases(n); }

TEST(DistributedPlan, PredictsTheLayersCommLog) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : cases(n)) {
    SCOPED_TRACE(c.name);
    run_case(c);
  }
}

// The memory estimate (moe::estimate_layer_memory, made from the plan's records) against the
// peak of the layer's own Kokkos allocations, on every rank of every layout whose routing the
// inputs balance (the estimate assumes balanced routing), EP-TP included; at D=64, F=128 and
// 64-token sequences, so that the layer's few fixed-size allocations do not decide the ratio.
/// f(case) on every layout case and EP-TP case at this rank count (balanced_only: those whose
/// routing the inputs balance, which the memory estimate assumes).
template <class F>
void each_layout(bool balanced_only, F&& f) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  auto all = cases(n);
  for (auto const& c : ep_tp_cases(n)) all.push_back(c);
  for (auto const& c : all) {
    if (balanced_only && (!c.balanced || !c.bias_boost.empty())) continue;
    SCOPED_TRACE(c.name);
    f(c);
  }
}

TEST(DistributedPlan, MemoryEstimateMatchesTheAllocationsOfEveryLayout) {
  if (Kokkos::Tools::profileLibraryLoaded()) GTEST_SKIP() << "a Kokkos Tools library is loaded";
  each_layout(true, [](Case const& c) { run_case(c, true, 64, 64); });
}

// The dtype=bfloat16 layer: the plan's bytes (activations and weight gathers on the bf16 wire,
// gradient reductions in fp32) are the layer's, and so is the memory estimate with the wire's
// 16-bit buffers and the rounded copies of the weights and dy.
TEST(DistributedPlan, PredictsTheBf16LayersCommLog) {
  each_layout(false, [](Case const& c) { run_case<float>(c, false, 16, 4, true); });
}

TEST(DistributedPlan, Bf16MemoryEstimateMatchesTheAllocationsOfEveryLayout) {
  if (Kokkos::Tools::profileLibraryLoaded()) GTEST_SKIP() << "a Kokkos Tools library is loaded";
  each_layout(true, [](Case const& c) { run_case<float>(c, true, 64, 64, true); });
}

TEST(DistributedPlan, EpTpPredictsTheLayersCommLog) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (auto const& c : ep_tp_cases(n)) {
    SCOPED_TRACE(c.name);
    run_case(c);
  }
}

}  // namespace
