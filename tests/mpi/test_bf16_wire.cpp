// The bf16 wire (docs/precision.md, "Wire"): a dtype=bfloat16 layer moves its activations and
// compute weights as 16-bit bf16 and its gradient reductions in fp32.
//  - the conversions and the collectives on the bf16 wire: exact on bf16-valued floats (every
//    bit pattern: NaN, Inf, signed zeros, subnormals), rounding to nearest even otherwise; a
//    reduce-scatter sums the bf16 pieces in fp32, rank order, and rounds once;
//  - on every layout, each comm-log record of the bf16 layer is exactly half the fp32 layer's
//    bytes (all-to-alls, activation collectives, weight gathers) or equal to them (gradient
//    reductions, statistics), with the same routing in both runs;
//  - the bf16 layer on N ranks matches the bf16 layer on one rank within a bf16 tolerance (see
//    expect_bf16_close).
#include <moe/comm/collectives.hpp>
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/comm/wire.hpp>
#include <moe/distributed/layer.hpp>
#include <moe/distributed/plan.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/layer.hpp>

#include <gtest/gtest.h>

#include <moe/comm/mpi.hpp>
#include "layout_cases.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using Mem = Kokkos::DefaultExecutionSpace::memory_space;
using Exec = Kokkos::DefaultExecutionSpace;

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

/// The float of bf16 bits b.
float bf(std::uint16_t b) { return moe::detail::bf16_to_float(b); }
/// f rounded to bf16 (as a float).
float round_bf16(float f) { return bf(moe::detail::bf16_bits(f)); }

/// Whether `got` is what the bf16 wire must deliver for `sent`: the same bits where `sent` is a
/// bf16-valued float; where it is a NaN, a quiet NaN of the same sign (or the same bits: a group
/// of one rank copies).
::testing::AssertionResult same_bf16(float got, float sent) {
  std::uint32_t const g = moe::detail::float_bits(got), s = moe::detail::float_bits(sent);
  if (g == s) return ::testing::AssertionSuccess();
  if (std::isnan(sent)) {
    if (std::isnan(got) && (g >> 31) == (s >> 31) && (g & 0x00400000u))
      return ::testing::AssertionSuccess();
  } else if (g == s) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "sent bits 0x" << std::hex << s << ", got 0x" << g << std::dec;
}

/// Every bf16 bit pattern as a float.
std::vector<float> every_bf16() {
  std::vector<float> v(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) v[b] = bf(std::uint16_t(b));
  return v;
}

// ------------------------------------------------------------------ conversions and collectives

TEST(Bf16Wire, ConversionIsExactOnEveryBf16AndRoundsToNearestEven) {
  using moe::comm::detail::WireCast;
  auto const all = every_bf16();
  moe::View1<float, Mem> src("src", all.size()), back("back", all.size());
  moe::View1<moe::bf16, Mem> wire("wire", all.size());
  std::copy(all.begin(), all.end(), src.data());
  moe::comm::detail::convert(Exec(), "test::to_bf16", src.data(), wire.data(),
                             std::int64_t(all.size()));
  moe::comm::detail::convert(Exec(), "test::from_bf16", wire.data(), back.data(),
                             std::int64_t(all.size()));
  Exec().fence();
  for (std::size_t b = 0; b < all.size(); ++b) {
    ASSERT_TRUE(same_bf16(back(b), all[b])) << "pattern 0x" << std::hex << b;
    if (!std::isnan(all[b])) {
      ASSERT_EQ(wire(b).bits, std::uint16_t(b));
    }
  }
  // Signed zeros, infinities and subnormals among them, by name.
  for (float f : {0.0f, -0.0f, INFINITY, -INFINITY, bf(0x0001), bf(0x807f)})
    EXPECT_TRUE(same_bf16(float(WireCast<moe::bf16>::from(f)), f)) << f;
  // Not bf16-valued: to nearest, ties to even.
  EXPECT_EQ(float(WireCast<moe::bf16>::from(1.0f + 0x1p-8f)), 1.0f);                // tie: even
  EXPECT_EQ(float(WireCast<moe::bf16>::from(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);  // tie: even
  EXPECT_EQ(float(WireCast<moe::bf16>::from(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);
  EXPECT_EQ(double(WireCast<double>::from(moe::bf16::from_bits(0x3fc0))), 1.5);
}

moe::distributed::AxisGroup world_group() {
  return moe::distributed::AxisGroup{{"world"}, moe::comm::Communicator(MPI_COMM_WORLD)};
}

// gather_dim on the bf16 wire: every pattern arrives exactly, along dimension 1 too (the
// reorder runs while converting); the log shows 2 bytes a value.
TEST(Bf16Wire, AllGatherMovesEveryPatternExactly) {
  int const P = world_size(), me = world_rank();
  auto const all = every_bf16();
  std::int64_t const rows = 256, cols = 256;  // [rows, cols] per rank, gathered along dim 1
  moe::View2<float, Mem> in("in", rows, cols), out("out", rows, P * cols);
  for (std::int64_t i = 0; i < rows * cols; ++i)
    in.data()[i] = all[std::size_t((i + me * 7) % 65536)];
  auto const g = world_group();
  moe::distributed::CommLog log;
  moe::distributed::gather_dim(Exec(), g, in, out, 1, &log, "test gather", nullptr,
                               moe::comm::Wire::bf16);
  for (int p = 0; p < P; ++p)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        ASSERT_TRUE(
            same_bf16(out(r, p * cols + c), all[std::size_t((r * cols + c + p * 7) % 65536)]))
            << "rank " << p << " row " << r << " col " << c;
  if (P > 1) {
    ASSERT_EQ(log.records.size(), 1u);
    EXPECT_EQ(log.records[0].bytes, rows * cols * 2 * (P - 1));
  }
}

// reduce_scatter_dim on the bf16 wire: each rank's pieces are rounded to bf16, summed in fp32 in
// rank order and the sum rounded once; along dimension 1 (packed while converting).
TEST(Bf16Wire, ReduceScatterSumsBf16PiecesInFp32AndRoundsOnce) {
  int const P = world_size(), me = world_rank();
  std::int64_t const rows = 5, cols = 6;  // output block [rows, cols]; input [rows, P * cols]
  auto value = [](int rank, std::int64_t r, std::int64_t c) {
    return float(std::sin(1.0 + rank * 0.37 + r * 1.3 + c * 0.71) * (1 + c));
  };
  moe::View2<float, Mem> in("in", rows, P * cols), out("out", rows, cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < P * cols; ++c) in(r, c) = value(me, r, c);
  auto const g = world_group();
  moe::distributed::CommLog log;
  moe::distributed::reduce_scatter_dim(Exec(), g, in, out, 1, &log, "test rs", nullptr,
                                       moe::comm::Wire::bf16);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float want = 0;
      for (int p = 0; p < P; ++p) want += round_bf16(value(p, r, me * cols + c));
      // One rank: no communication, the block is copied as it is.
      EXPECT_EQ(out(r, c), P > 1 ? round_bf16(want) : value(0, r, c)) << r << "," << c;
    }
  if (P > 1) {
    ASSERT_EQ(log.records.size(), 1u);
    EXPECT_EQ(log.records[0].bytes, rows * cols * 2 * (P - 1));
  }
}

// The ragged all-to-all on the bf16 wire: forward delivers each row rounded to bf16 (exactly
// when it is bf16-valued), reverse brings rows back, the gaps zeroed.
TEST(Bf16Wire, RaggedAllToAllMovesRowsAsBf16) {
  int const P = world_size(), me = world_rank();
  moe::comm::Communicator comm(MPI_COMM_WORLD);
  std::int64_t const cols = 3;
  std::vector<std::int64_t> send(static_cast<std::size_t>(P));
  std::int64_t total = 0;
  for (int j = 0; j < P; ++j) total += send[std::size_t(j)] = (me + j) % 3;
  moe::comm::RaggedAllToAll a2a(comm, send);
  moe::View2<float, Mem> src("src", total, cols), recv("recv", a2a.recv_total() + 1, cols),
      back("back", total, cols);
  for (std::int64_t i = 0; i < total * cols; ++i)
    src.data()[i] = (i % 2 ? round_bf16(float(me + 0.1 * i)) : float(me + 0.1 * i));
  Kokkos::deep_copy(recv, 7.0f);
  a2a.forward(Exec(), src, recv, moe::comm::Wire::bf16);
  // Rows from peer i: its (i + me) % 3 rows for me, values i + 0.1 * k rounded.
  std::int64_t at = 0;
  for (int i = 0; i < P; ++i) {
    std::int64_t first = 0;  // where peer i's block for me starts in its send buffer
    for (int j = 0; j < me; ++j) first += (i + j) % 3;
    for (std::int64_t r = 0; r < (i + me) % 3; ++r, ++at)
      for (std::int64_t c = 0; c < cols; ++c)
        EXPECT_EQ(recv(at, c), round_bf16(float(i + 0.1 * double((first + r) * cols + c))));
  }
  for (std::int64_t c = 0; c < cols; ++c) EXPECT_EQ(recv(at, c), 0.0f) << "the row after";
  a2a.reverse(Exec(), recv, back, moe::comm::Wire::bf16);
  for (std::int64_t i = 0; i < total * cols; ++i)
    EXPECT_EQ(back.data()[i], round_bf16(src.data()[i])) << i;
}

/// A bf16 View holding `v` rounded.
template <class V>
moe::View2<moe::bf16, Mem> to_bf16(V const& v) {
  moe::View2<moe::bf16, Mem> w("w", v.extent(0), v.extent(1));
  for (std::size_t i = 0; i < v.span(); ++i) w.data()[i] = moe::bf16(v.data()[i]);
  return w;
}
/// Whether the bf16 `got` holds `want` (a float) rounded to bf16, element by element.
template <class V, class W>
::testing::AssertionResult holds_rounded(V const& got, W const& want) {
  if (got.span() != want.span()) return ::testing::AssertionFailure() << "sizes differ";
  for (std::size_t i = 0; i < got.span(); ++i)
    if (moe::detail::float_bits(float(got.data()[i])) !=
        moe::detail::float_bits(round_bf16(want.data()[i])))
      return ::testing::AssertionFailure()
             << "element " << i << ": " << float(got.data()[i]) << " against " << want.data()[i];
  return ::testing::AssertionSuccess();
}

// A bf16 step's routed rows are 16-bit in memory on the ragged all-to-all path (x_sorted,
// x_received, the column blocks): its exchanges and tensor-axis collectives between 16-bit rows,
// and from float rows into 16-bit ones, give exactly the float rows' results on the bf16 wire,
// rounded to bf16 (which they already are wherever the values travelled).
TEST(Bf16Wire, CollectivesOn16BitRowsGiveTheBitsOfFloatRows) {
  using moe::comm::Wire;
  int const P = world_size(), me = world_rank();
  auto const g = world_group();
  auto value = [&](std::int64_t i) { return float(std::sin(0.3 + me * 0.77 + i * 0.131) * 3); };
  std::int64_t const rows = 7, cols = 5;
  // Reduce-scatter along dim 1: from 16-bit rows and from float rows into 16-bit blocks.
  moe::View2<float, Mem> in("in", rows, P * cols), out("out", rows, cols);
  for (std::size_t i = 0; i < in.span(); ++i) in.data()[i] = value(std::int64_t(i));
  auto const in16 = to_bf16(in);
  moe::View2<moe::bf16, Mem> out16("out16", rows, cols), out16f("out16f", rows, cols);
  moe::distributed::reduce_scatter_dim(Exec(), g, in, out, 1, nullptr, "rs", nullptr, Wire::bf16);
  moe::distributed::reduce_scatter_dim(Exec(), g, in16, out16, 1, nullptr, "rs", nullptr,
                                       Wire::bf16);
  moe::distributed::reduce_scatter_dim(Exec(), g, in, out16f, 1, nullptr, "rs", nullptr,
                                       Wire::bf16);
  Exec().fence();
  // From 16-bit pieces: the float rows' pieces are rounded on the wire (one rank: copied).
  EXPECT_TRUE(holds_rounded(out16, out));
  EXPECT_TRUE(holds_rounded(out16f, out));
  // All-gather along dim 1 between 16-bit rows.
  moe::View2<float, Mem> gin("gin", rows, cols), gout("gout", rows, P * cols);
  for (std::size_t i = 0; i < gin.span(); ++i) gin.data()[i] = value(std::int64_t(i) + 1000);
  moe::View2<moe::bf16, Mem> gout16("gout16", rows, P * cols);
  moe::distributed::gather_dim(Exec(), g, gin, gout, 1, nullptr, "ag", nullptr, Wire::bf16);
  moe::distributed::gather_dim(Exec(), g, to_bf16(gin), gout16, 1, nullptr, "ag", nullptr,
                               Wire::bf16);
  Exec().fence();
  EXPECT_TRUE(holds_rounded(gout16, gout));
  // All-gather along dim 0 (the ring's tokens and d_y) into 16-bit rows, from float rows (rounded
  // on the wire) and from 16-bit rows: the own block converted into place and the others'
  // received around it, with no send or receive buffer of the pool's.
  moe::View2<float, Mem> rout("rout", P * rows, cols);
  moe::View2<moe::bf16, Mem> rout16("rout16", P * rows, cols), rout16b("rout16b", P * rows, cols);
  moe::detail::ScratchPool<Mem> pool;
  moe::distributed::gather_dim(Exec(), g, gin, rout, 0, nullptr, "ag", nullptr, Wire::bf16);
  moe::distributed::gather_dim(Exec(), g, gin, rout16, 0, nullptr, "ag", &pool, Wire::bf16);
  moe::distributed::gather_dim(Exec(), g, to_bf16(gin), rout16b, 0, nullptr, "ag", &pool,
                               Wire::bf16);
  Exec().fence();
  EXPECT_TRUE(holds_rounded(rout16, rout));
  EXPECT_TRUE(holds_rounded(rout16b, rout));
  EXPECT_EQ(pool.bytes(), 0u);
  // Reduce-scatter along dim 0 (the ring's y and d_x) from 16-bit rows, sent as they are: the
  // float rows' result (they are rounded on the wire; one rank: copied).
  moe::View2<float, Mem> sin("sin", P * rows, cols), sout("sout", rows, cols),
      sout16("sout16", rows, cols);
  for (std::size_t i = 0; i < sin.span(); ++i) sin.data()[i] = value(std::int64_t(i) + 3000);
  moe::distributed::reduce_scatter_dim(Exec(), g, sin, sout, 0, nullptr, "rs", nullptr, Wire::bf16);
  moe::distributed::reduce_scatter_dim(Exec(), g, to_bf16(sin), sout16, 0, nullptr, "rs", nullptr,
                                       Wire::bf16);
  Exec().fence();
  EXPECT_TRUE(holds_rounded(sout16, sout));
  // The ragged all-to-all moves 16-bit rows as they are, on either wire, forward and reverse.
  moe::comm::Communicator comm(MPI_COMM_WORLD);
  std::vector<std::int64_t> send(static_cast<std::size_t>(P));
  std::int64_t total = 0;
  for (int j = 0; j < P; ++j) total += send[std::size_t(j)] = (2 * me + j) % 3 + 1;
  moe::comm::RaggedAllToAll a2a(comm, send);
  moe::View2<float, Mem> src("src", total, cols), recv("recv", a2a.recv_total() + 1, cols),
      back("back", total, cols);
  for (std::size_t i = 0; i < src.span(); ++i) src.data()[i] = value(std::int64_t(i) + 2000);
  a2a.forward(Exec(), src, recv, Wire::bf16);
  a2a.reverse(Exec(), recv, back, Wire::bf16);
  for (Wire w : {Wire::bf16, Wire::native}) {
    moe::View2<moe::bf16, Mem> recv16("recv16", a2a.recv_total() + 1, cols),
        back16("back16", total, cols);
    Kokkos::deep_copy(recv16, moe::bf16(7.0f));
    a2a.forward(Exec(), to_bf16(src), recv16, w);
    EXPECT_TRUE(holds_rounded(recv16, recv)) << "forward, wire " << int(w);
    a2a.reverse(Exec(), recv16, back16, w);
    EXPECT_TRUE(holds_rounded(back16, back)) << "reverse, wire " << int(w);
  }
}

// ------------------------------------------------------------------ the layer on every layout

using Tensors = std::map<std::string, std::vector<double>>;

template <class V>
void fill(V const& v, std::vector<double> const& vals) {
  ASSERT_EQ(v.span(), vals.size());
  for (std::size_t i = 0; i < vals.size(); ++i) v.data()[i] = float(vals[i]);
}
template <class V>
std::vector<double> values(V const& v) {
  return std::vector<double>(v.data(), v.data() + v.span());
}

/// The global tensors of a case (test_distributed_layer.cpp's shapes and scales), every value
/// rounded to bf16: the inputs are what a bf16 model holds, so no run rounds them differently.
Tensors global_tensors(LayoutCase const& c, moe::LayerConfig const& cfg, std::int64_t B,
                       std::int64_t S) {
  std::int64_t const D = cfg.base_emb_dim, E = cfg.num_experts, F = cfg.base_moe_mlp_dim,
                     Fs = cfg.shared_mlp_dim();
  std::mt19937_64 gen(42);
  Tensors t;
  auto add = [&](std::string const& n, std::int64_t m, double scale) {
    std::normal_distribution<double> d(0.0, scale);
    auto& v = t[n];
    v.resize(std::size_t(m));
    for (auto& e : v) e = round_bf16(float(d(gen)));
  };
  add("x", B * S * D, 1.0);
  add("dy", B * S * D, 1.0);
  add("gate", D * E, 0.5);
  if (cfg.routed_bias) {
    add("gate_bias", E, 0.1);
    for (std::size_t e = 0; e < c.bias_boost.size(); ++e) t["gate_bias"][e] += c.bias_boost[e];
  }
  add("wi_0", E * D * F, 0.3);
  add("wi_1", E * D * F, 0.3);
  add("wo", E * F * D, 0.3);
  if (Fs > 0) {
    add("shared_wi_0", D * Fs, 0.3);
    add("shared_wi_1", D * Fs, 0.3);
    add("shared_wo", Fs * D, 0.3);
  }
  return t;
}

/// One forward + backward of a layer: its outputs on this rank's block, its comm log.
struct Step {
  std::vector<double> y, dx, weights;
  std::map<std::string, std::vector<double>> grads;
  std::map<std::string, moe::TensorBlock> blocks;  ///< this rank's block of each parameter
  double lb_loss = 0;
  std::vector<moe::comm::CommRecord> log;
};

moe::ParallelConfig parallel_of(LayoutCase const& c) {
  moe::ParallelConfig par;
  for (auto const& kv : c.layout) {
    auto const eq = kv.find('=');
    par.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return par;
}

/// The distributed layer of `c` with `cfg` on MPI_COMM_WORLD; outputs of this rank's block.
Step run_distributed(LayoutCase const& c, moe::LayerConfig const& cfg, Tensors& t,
                     moe::TensorBlock* x_block = nullptr) {
  std::int64_t const B = c.batch, S = 4;
  moe::DistributedMoeLayer<float> layer(MPI_COMM_WORLD, cfg, parallel_of(c), B, S);
  layer.parameters().for_each(
      [&](char const* n, auto const& v) { fill(v, take_block(t[n], layer.block(n))); });
  layer.weights_changed();
  auto const xb = layer.block("x");
  if (x_block) *x_block = xb;
  std::int64_t const bl = xb.local_shape[0], Dl = xb.local_shape[2];
  moe::View3<float, Mem> x("x", bl, S, Dl), y("y", bl, S, Dl), dy("dy", bl, S, Dl),
      dx("dx", bl, S, Dl);
  fill(x, take_block(t["x"], xb));
  fill(dy, take_block(t["dy"], xb));
  layer.forward(x, y);
  moe::DistributedMoeLayer<float>::params_type g;
  layer.backward(dy, dx, g);
  Step s;
  s.y = values(y);
  s.dx = values(dx);
  s.weights = values(layer.weights());
  s.lb_loss = layer.lb_loss();
  g.for_each([&](char const* n, auto const& v) {
    s.grads[n] = values(v);
    s.blocks[n] = layer.block(n);
  });
  s.log = layer.comm_log().records;
  return s;
}

/// |got - want| <= c * 2^-8 * (|want| + rms(want)) elementwise: c roundings' worth of bf16
/// relative error, with the tensor's RMS as the floor for the elements near zero. The bf16 layer
/// on N ranks sums in another order than on one rank (tensor-split partial sums, reduce-scatters
/// of bf16 pieces), so a value may round to a neighbouring bf16 at several cast points.
void expect_bf16_close(std::vector<double> const& got, std::vector<double> const& want,
                       std::string const& what, double c) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double ss = 0;
  for (double w : want) ss += w * w;
  double const rms = want.empty() ? 0 : std::sqrt(ss / double(want.size()));
  std::size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const bound = c * std::ldexp(1.0, -8) * (std::abs(want[i]) + rms) + 1e-30;
    double const ratio = std::abs(got[i] - want[i]) / bound;
    if (!(ratio <= 1)) ++bad;
    if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements outside the bound; worst at " << worst << ": got " << got[worst]
                     << ", want " << want[worst] << " (" << worst_ratio << " x the bound, rms "
                     << rms << ")";
}

/// Names of the weight-gradient reductions (to_storage ops) and of the weight gathers
/// (to_compute ops) of a plan, and which weight each gather moves.
struct WeightOps {
  std::set<std::string> grads;
  std::map<std::string, std::string> gathers;  // record name -> weight
};
WeightOps weight_ops(moe::distributed::StepPlan const& plan) {
  WeightOps w;
  for (auto const& ws : plan.weights) {
    for (auto const& op : ws.to_storage)
      if (!op.what.empty()) w.grads.insert(op.what);
    for (auto const& op : ws.to_compute)
      if (!op.what.empty()) w.gathers[op.what] = ws.name;
  }
  return w;
}

/// The bf16 layer's comm log against the fp32 layer's on case `c`, with `extra` settings: the
/// same records in the same order, each half the fp32 bytes or (gradient reductions,
/// statistics; the gate's gather under float32_gate_logits) the same bytes.
void expect_halved_bytes(LayoutCase c, std::vector<std::string> const& extra) {
  c.layer.insert(c.layer.end(), extra.begin(), extra.end());
  moe::LayerConfig const f32 = test_layer_config(0.05, c.layer);
  moe::LayerConfig bf = f32;
  bf.dtype = moe::ComputeDtype::BFloat16;
  Tensors t = global_tensors(c, f32, c.batch, 4);
  Step const a = run_distributed(c, f32, t), b = run_distributed(c, bf, t);
  auto const plan = moe::make_plan(bf, parallel_of(c), world_size(), world_rank(), c.batch, 4);
  auto const ops = weight_ops(plan.step);
  ASSERT_EQ(a.log.size(), b.log.size());
  for (std::size_t i = 0; i < a.log.size(); ++i) {
    auto const &r32 = a.log[i], &r16 = b.log[i];
    SCOPED_TRACE("record " + std::to_string(i) + ": " + r32.what);
    ASSERT_EQ(r32.what, r16.what);
    ASSERT_EQ(r32.kind, r16.kind);
    ASSERT_EQ(r32.axes, r16.axes);
    ASSERT_EQ(r32.backward, r16.backward);
    bool const gradient = r32.kind == "all-reduce" || ops.grads.count(r32.what) > 0;
    auto const gather = ops.gathers.find(r32.what);
    bool const gate = gather != ops.gathers.end() && gather->second == "gate";
    bool const logits = r32.what.find("logits") != std::string::npos;
    bool const fp32 = gradient || ((gate || logits) && bf.float32_gate_logits);
    if (fp32)
      EXPECT_EQ(r16.bytes, r32.bytes);
    else
      EXPECT_EQ(2 * r16.bytes, r32.bytes);
  }
}

std::vector<LayoutCase> every_case(int n) {
  auto all = layout_cases(n);
  for (auto const& c : ep_tp_cases(n)) all.push_back(c);
  return all;
}

/// A 3-d tensor of shape `ext`, element i holding f(i) as T (a float rounded to bf16 for bf16).
template <class T, class F>
Kokkos::View<T***, Kokkos::LayoutRight, Mem> tensor3(std::int64_t const (&ext)[3], F f) {
  Kokkos::View<T***, Kokkos::LayoutRight, Mem> v("t", ext[0], ext[1], ext[2]);
  for (std::size_t i = 0; i < v.span(); ++i) v.data()[i] = T(f(std::int64_t(i)));
  return v;
}

/// The bits of v's elements as floats.
template <class V>
std::vector<std::uint32_t> bits_of(V const& v) {
  Exec().fence();
  std::vector<std::uint32_t> b(v.span());
  for (std::size_t i = 0; i < v.span(); ++i) b[i] = moe::detail::float_bits(float(v.data()[i]));
  return b;
}

// gather_dim and reduce_scatter_dim move a tensor larger than a segment (comm/segments.hpp) a
// tile at a time: whole leading rows per tile, or columns of one row, through tile-sized buffers
// of the scratch pool (rows along dimension 0 sent from where they are, unless staged). Along
// each dimension of a 3-d tensor, on both wires, from float rows and 16-bit ones, with and
// without host staging: the bits of the collective in one tile, with pool buffers of at most
// two tiles.
TEST(Reshard, TiledCollectivesGiveTheBitsOfWholeOnesInTileSizedBuffers) {
  using moe::comm::Wire;
  int const P = world_size(), me = world_rank();
  auto const g = world_group();
  // Mixed magnitudes, so that a sum in another order would show.
  auto value = [&](std::int64_t i) {
    return float(std::sin(0.7 + me * 1.31 + double(i) * 0.173) * std::pow(10.0, double(i % 7) - 3));
  };
  auto& seg = moe::comm::detail::segment_bytes();
  std::int64_t const saved = seg, saved_limit = moe::comm::detail::count_limit();
  auto restore = [&] {
    seg = saved;
    moe::comm::detail::force_staging() = false;
    moe::comm::detail::count_limit() = saved_limit;
  };
  std::int64_t const block[3] = {3, 5, 4};
  auto run = [&](auto in_elem, auto out_elem, Wire wire, int d, bool gather) {
    using In = decltype(in_elem);
    using Out = decltype(out_elem);
    std::int64_t in_ext[3] = {block[0], block[1], block[2]},
                 out_ext[3] = {block[0], block[1], block[2]};
    (gather ? out_ext : in_ext)[d] *= P;
    auto const in = tensor3<In>(in_ext, value);
    std::int64_t A = 1, L = 1;
    for (int r = 0; r < 3; ++r) (r < d ? A : L) *= block[r];
    std::int64_t const eb = wire == Wire::bf16 ? 2 : std::int64_t(sizeof(Out));
    std::vector<std::uint32_t> whole;
    // One tile; two leading rows a tile (where there are rows to split); 3 columns; 1 column;
    // then with host staging and the large-count path (count limit 3).
    for (int i = 0; i < 8; ++i) {
      std::int64_t const sizes[4] = {saved, 2 * P * L * eb, 3 * P * eb, 1};
      seg = sizes[i % 4];
      moe::comm::detail::force_staging() = i >= 4;
      moe::comm::detail::count_limit() = i >= 4 ? 3 : saved_limit;
      std::int64_t const bytes = seg;
      auto const t = moe::comm::detail::tiles(A, L, P, eb);
      SCOPED_TRACE(std::string(i >= 4 ? "staged, " : "") + "segment bytes " +
                   std::to_string(bytes) + ": tiles of " + std::to_string(t.rows) + " x " +
                   std::to_string(t.cols));
      auto const out = tensor3<Out>(out_ext, [](std::int64_t) { return 0.0f; });
      moe::detail::ScratchPool<Mem> pool;
      if (gather)
        moe::distributed::gather_dim(Exec(), g, in, out, d, nullptr, "ag", &pool, wire);
      else
        moe::distributed::reduce_scatter_dim(Exec(), g, in, out, d, nullptr, "rs", &pool, wire);
      auto const got = bits_of(out);
      if (whole.empty()) {
        whole = got;
      } else {
        EXPECT_EQ(got, whole);
      }
      // A send (or pack) and a receive buffer of at most one tile each, in 8-byte words (without
      // tiles, 60 * P elements each).
      std::size_t const tile = std::size_t(P * t.piece() * eb);
      EXPECT_LE(pool.bytes(), 2 * (tile + 8));
    }
    restore();
  };
  try {
    for (int d = 0; d < 3; ++d) {
      SCOPED_TRACE("dimension " + std::to_string(d));
      for (bool gather : {true, false}) {
        SCOPED_TRACE(gather ? "gather" : "reduce-scatter");
        run(float{}, float{}, Wire::native, d, gather);
        run(double{}, double{}, Wire::native, d, gather);
        run(float{}, float{}, Wire::bf16, d, gather);
        run(moe::bf16{}, float{}, Wire::bf16, d, gather);
        run(float{}, moe::bf16{}, Wire::bf16, d, gather);
        run(moe::bf16{}, moe::bf16{}, Wire::bf16, d, gather);
      }
    }
  } catch (...) {
    restore();
    throw;
  }
}

// Routing is the same in both runs: the inputs are bf16-valued and the gate logits fp32
// (float32_gate_logits), or the routing is random (drawn from the token index) with the gate
// and its logits on the bf16 wire.
TEST(Bf16Wire, EveryLayoutHalvesTheBytesOfActivationsAndWeightGathers) {
  for (auto const& c : every_case(world_size())) {
    SCOPED_TRACE(c.name);
    expect_halved_bytes(c, {"float32_gate_logits=true"});
    expect_halved_bytes(c, {"use_random_routing=true", "seed=3"});
  }
}

TEST(Bf16Wire, EveryLayoutMatchesTheSingleRankBf16Layer) {
  for (auto const& c : every_case(world_size())) {
    SCOPED_TRACE(c.name);
    moe::LayerConfig cfg = test_layer_config(0.05, c.layer);
    cfg.dtype = moe::ComputeDtype::BFloat16;
    std::int64_t const B = c.batch, S = 4, D = cfg.base_emb_dim;
    Tensors t = global_tensors(c, cfg, B, S);
    moe::TensorBlock xb;
    Step const got = run_distributed(c, cfg, t, &xb);

    moe::MoeLayer<float> ref(cfg);
    ref.parameters().for_each([&](char const* n, auto const& v) { fill(v, t[n]); });
    moe::View3<float, Mem> x("x", B, S, D), y("y", B, S, D), dy("dy", B, S, D), dx("dx", B, S, D);
    fill(x, t["x"]);
    fill(dy, t["dy"]);
    ref.forward(x, y);
    moe::MoeLayer<float>::params_type rg;
    ref.backward(dy, dx, rg);

    expect_bf16_close(got.y, take_block(values(y), xb), "y", 8);
    expect_bf16_close(got.dx, take_block(values(dx), xb), "dx", 16);
    EXPECT_NEAR(got.lb_loss, ref.lb_loss(), 8 * std::ldexp(1.0, -8) * std::abs(ref.lb_loss()));
    moe::TensorBlock wb{{B, S, cfg.num_experts_per_tok},
                        {xb.local_shape[0], S, cfg.num_experts_per_tok},
                        {xb.offset[0], 0, 0}};
    expect_bf16_close(got.weights, take_block(values(ref.weights()), wb), "routing weights", 8);
    rg.for_each([&](char const* n, auto const& v) {
      auto const it = got.grads.find(n);
      ASSERT_NE(it, got.grads.end()) << n;
      expect_bf16_close(it->second, take_block(values(v), got.blocks.at(n)), std::string("d_") + n,
                        16);
    });
  }
}

}  // namespace
