// Exact vectors of the expert-parallel all-to-all parameters, receive-buffer sizes, truncation and
// local permute (SEMANTICS.md §7.4-7.7), plus hand-computed truncation cases (the one prefix-clamp
// rule, moe::detail::clamp_prefix, both use).
#include <moe/comm/ragged_all_to_all.hpp>
#include <moe/detail/counting.hpp>
#include <moe/detail/scratch.hpp>
#include <moe/permute/local_permute.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

using moe::comm::AllToAllParams;
using Vec = std::vector<std::int64_t>;

// §7.4 traffic matrix: row = sender shard, column = receiver shard.
Vec const kM = {1, 2, 0, 3, 4, 0, 1, 2, 0, 3, 2, 1, 2, 1, 4, 0};

void expect_params(AllToAllParams const& p, Vec const& in, Vec const& send, Vec const& out,
                   Vec const& recv) {
  EXPECT_EQ(p.input_offsets, in);
  EXPECT_EQ(p.send_sizes, send);
  EXPECT_EQ(p.output_offsets, out);
  EXPECT_EQ(p.recv_sizes, recv);
}

TEST(CommParams, ShardedBatchDispatchExactVectors) {
  Vec const in[4] = {{0, 1, 3, 3}, {0, 4, 4, 5}, {0, 0, 3, 5}, {0, 2, 3, 7}};
  Vec const send[4] = {{1, 2, 0, 3}, {4, 0, 1, 2}, {0, 3, 2, 1}, {2, 1, 4, 0}};
  Vec const out[4] = {{0, 0, 0, 0}, {1, 2, 0, 3}, {5, 2, 1, 5}, {5, 5, 3, 6}};
  Vec const recv[4] = {{1, 4, 0, 2}, {2, 0, 3, 1}, {0, 1, 2, 4}, {3, 2, 1, 0}};
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(s);
    expect_params(moe::comm::all_to_all_params(kM, 4, s, true), in[s], send[s], out[s], recv[s]);
  }
}

TEST(CommParams, ShardedBatchCombineIsTheTransposedDispatch) {
  // Hand-computed from M^T: shard 0 and shard 2.
  expect_params(moe::comm::all_to_all_params(kM, 4, 0, false), {0, 1, 5, 5}, {1, 4, 0, 2},
                {0, 0, 0, 0}, {1, 2, 0, 3});
  expect_params(moe::comm::all_to_all_params(kM, 4, 2, false), {0, 0, 1, 3}, {0, 1, 2, 4},
                {3, 4, 3, 3}, {0, 3, 2, 1});
  // Every row goes back where it came from: the combine of s is the dispatch with roles swapped.
  for (int s = 0; s < 4; ++s)
    for (int j = 0; j < 4; ++j) {
      auto const c = moe::comm::all_to_all_params(kM, 4, s, false);
      auto const ds = moe::comm::all_to_all_params(kM, 4, s, true);
      auto const dj = moe::comm::all_to_all_params(kM, 4, j, true);
      EXPECT_EQ(c.send_sizes[j], ds.recv_sizes[j]);
      EXPECT_EQ(c.recv_sizes[j], ds.send_sizes[j]);
      EXPECT_EQ(c.output_offsets[j], dj.input_offsets[s]);
      EXPECT_EQ(c.input_offsets[j], dj.output_offsets[s]);
    }
}

TEST(CommParams, ReplicatedBatchExactVectors) {
  Vec const counts = {6, 7, 6, 7};
  Vec const starts = {0, 6, 13, 19};
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(s);
    expect_params(moe::comm::all_to_all_params_replicated(counts, s), Vec(4, 0), Vec(4, counts[s]),
                  Vec(4, starts[s]), counts);
  }
}

TEST(CommParams, RaggedBufferSizeExactValues) {
  using moe::comm::ragged_buffer_size;
  EXPECT_EQ(ragged_buffer_size(32768, 4, 256, 8, 1.0), 32768);
  EXPECT_EQ(ragged_buffer_size(32768, 4, 256, 8, 2.0), 65536);
  EXPECT_EQ(ragged_buffer_size(32768, 4, 256, 8, -1), 131072);
  EXPECT_EQ(ragged_buffer_size(32768, 128, 256, 8, -1), 1048576);
  EXPECT_EQ(ragged_buffer_size(32768, 4, 256, 8, 1.5), 49152);
  EXPECT_EQ(ragged_buffer_size(1000, 4, 256, 8, 0.0), 4000);  // factor <= 0: dropless
  // E/K is a real quotient: E=6, K=4, EP=2 -> min(2, 1.5) = 1.5 (not 1).
  EXPECT_EQ(ragged_buffer_size(100, 2, 6, 4, -1), 150);
  EXPECT_EQ(ragged_buffer_size(101, 2, 6, 4, -1), 151);  // int(151.5)
  EXPECT_THROW(ragged_buffer_size(-1, 4, 8, 2, -1), moe::ConfigError);
}

TEST(CommParams, ClampPrefixHandComputed) {
  using moe::detail::clamp_prefix;
  // sizes 3, 2, 4, 1: prefix sums 0, 3, 5, 9, 10.
  Vec const sizes = {3, 2, 4, 1};
  // R = 6: clamped 0, 3, 5, 6, 6 -> the third block is cut to 1 row, the fourth keeps none.
  EXPECT_EQ(clamp_prefix(sizes, 6), (Vec{3, 2, 1, 0}));
  // R = 5 ends exactly on a block boundary.
  EXPECT_EQ(clamp_prefix(sizes, 5), (Vec{3, 2, 0, 0}));
  // R = 1 cuts the first block.
  EXPECT_EQ(clamp_prefix(sizes, 1), (Vec{1, 0, 0, 0}));
  EXPECT_EQ(clamp_prefix(sizes, 0), (Vec{0, 0, 0, 0}));
  // R >= the total keeps everything; R < 0 means no cap.
  EXPECT_EQ(clamp_prefix(sizes, 10), sizes);
  EXPECT_EQ(clamp_prefix(sizes, 1000), sizes);
  EXPECT_EQ(clamp_prefix(sizes, -1), sizes);
  // Empty blocks keep nothing and do not move the cut: prefix sums 0, 0, 5, 5, 7 clamped to 4.
  EXPECT_EQ(clamp_prefix({0, 5, 0, 2}, 4), (Vec{0, 4, 0, 0}));
  EXPECT_EQ(clamp_prefix({}, 3), Vec{});
}

TEST(CommParams, TruncateMatrixHandComputed) {
  // Per receiver column, prefix sums over senders clamped to R=4:
  // col 0 [1,4,0,2] -> cumsum [1,5,5,7] -> [1,4,4,4] -> [1,3,0,0]
  // col 1 [2,0,3,1] -> [2,2,5,6] -> [2,2,4,4] -> [2,0,2,0]
  // col 2 [0,1,2,4] -> [0,1,3,7] -> [0,1,3,4] -> [0,1,2,1]
  // col 3 [3,2,1,0] -> [3,5,6,6] -> [3,4,4,4] -> [3,1,0,0]
  EXPECT_EQ(moe::comm::truncate_matrix(kM, 4, 4),
            (Vec{1, 2, 0, 3, 3, 0, 1, 1, 0, 2, 2, 0, 0, 0, 1, 0}));
  EXPECT_EQ(moe::comm::truncate_matrix(kM, 4, 7), kM);  // the largest column sum is 7
  EXPECT_EQ(moe::comm::truncate_matrix(kM, 4, 0), Vec(16, 0));
  // R=5: col 0 -> [1,4,0,0]; col 1 -> [2,0,3,0]; col 2 -> [0,1,2,2]; col 3 -> [3,2,0,0].
  EXPECT_EQ(moe::comm::truncate_matrix(kM, 4, 5),
            (Vec{1, 2, 0, 3, 4, 0, 1, 2, 0, 3, 2, 0, 0, 0, 2, 0}));
}

TEST(CommParams, TruncatedParamsHandComputed) {
  // R=4, Mt as above. Dispatch of shard 1: input offsets from M, the rest from Mt.
  expect_params(moe::comm::all_to_all_params_truncated(kM, 4, 1, true, 4), {0, 4, 4, 5},
                {3, 0, 1, 1}, {1, 2, 0, 3}, {2, 0, 2, 0});
  // Combine of shard 1: input offsets / sizes from Mt, output offsets from M.
  expect_params(moe::comm::all_to_all_params_truncated(kM, 4, 1, false, 4), {0, 2, 2, 4},
                {2, 0, 2, 0}, {1, 4, 0, 2}, {3, 0, 1, 1});
  // Dispatch of shard 3 (the highest sender loses most): Mt[3,:] = [0,0,1,0].
  expect_params(moe::comm::all_to_all_params_truncated(kM, 4, 3, true, 4), {0, 2, 3, 7},
                {0, 0, 1, 0}, {4, 4, 3, 4}, {3, 1, 0, 0});
  // A cap no column reaches changes nothing.
  for (int s = 0; s < 4; ++s) {
    auto const a = moe::comm::all_to_all_params_truncated(kM, 4, s, true, 100);
    auto const b = moe::comm::all_to_all_params(kM, 4, s, true);
    expect_params(a, b.input_offsets, b.send_sizes, b.output_offsets, b.recv_sizes);
  }
}

TEST(CommParams, BadArgumentsThrow) {
  EXPECT_THROW(moe::comm::all_to_all_params(Vec(15, 1), 4, 0, true), moe::ShapeError);
  EXPECT_THROW(moe::comm::all_to_all_params(kM, 4, 4, true), moe::ConfigError);
  EXPECT_THROW(moe::comm::all_to_all_params(Vec{1, -1, 0, 0}, 2, 0, true), moe::ShapeError);
  EXPECT_THROW(moe::comm::truncate_matrix(kM, 4, -1), moe::ConfigError);
  EXPECT_THROW(moe::comm::all_to_all_params_replicated(Vec{1, 2}, 2), moe::ConfigError);
  EXPECT_THROW(moe::permute::local_layout(Vec(6, 1), 6, 4, 0), moe::ConfigError);
  EXPECT_THROW(moe::permute::local_layout(Vec(7, 1), 8, 4, 0), moe::ShapeError);
  EXPECT_THROW(moe::permute::local_layout(Vec(8, 1), 8, 4, 4), moe::ConfigError);
}

// ---------------------------------------------------------------------------------------------
// local permute

using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;

template <class V>
Vec to_vec(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  Vec out(h.extent(0));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = h(i);
  return out;
}

Vec repeat_ids(Vec const& sizes) {
  Vec out;
  for (std::size_t l = 0; l < sizes.size(); ++l)
    for (std::int64_t r = 0; r < sizes[l]; ++r) out.push_back(std::int64_t(l));
  return out;
}

/// Rows [n, D=2] with row r = (r, -r), plus `extra` garbage rows.
moe::View2<double, MS> numbered_rows(std::int64_t n, std::int64_t extra = 0) {
  moe::View2<double, MS> v("rows", n + extra, 2);
  auto h = Kokkos::create_mirror_view(v);
  for (std::int64_t r = 0; r < n + extra; ++r) h(r, 0) = double(r), h(r, 1) = -double(r);
  Kokkos::deep_copy(v, h);
  return v;
}

/// First column of a row view, as integers (row numbers), and checks the second column.
Vec row_numbers(moe::View2<double, MS> const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  Vec out(h.extent(0));
  for (std::size_t r = 0; r < out.size(); ++r) {
    EXPECT_EQ(h(r, 1), -h(r, 0));
    out[r] = static_cast<std::int64_t>(h(r, 0));
  }
  return out;
}

TEST(LocalPermute, NoOffsetExactVectors) {
  // §7.7 first bullet: E=8, EP=4 (L=2), group sizes 0..7 from one sender.
  Vec const g = {0, 1, 2, 3, 4, 5, 6, 7};
  Exec space;
  for (int s = 0; s < 4; ++s) {
    SCOPED_TRACE(s);
    auto const lp = moe::permute::local_permute(space, g, 8, 4, s);
    Vec const sizes = {g[2 * s], g[2 * s + 1]};
    std::int64_t const n = sizes[0] + sizes[1];
    Vec arange(n);
    std::iota(arange.begin(), arange.end(), 0);
    EXPECT_EQ(lp.rows(), n);
    EXPECT_EQ(lp.layout.group_sizes, sizes);
    EXPECT_EQ(to_vec(lp.perm), arange);
    EXPECT_EQ(to_vec(lp.inverse), arange);
    EXPECT_EQ(to_vec(lp.expert_ids), repeat_ids(sizes));
    EXPECT_EQ(to_vec(lp.group_offsets), (Vec{0, sizes[0], n}));
    auto const x = numbered_rows(n);
    moe::View2<double, MS> sorted("sorted", n + 3, 2);
    Kokkos::deep_copy(sorted, 7.0);
    moe::permute::permute_rows(space, lp, x, sorted);
    Vec expect = arange;
    expect.insert(expect.end(), 3, 0);  // rows beyond rows() are zeroed
    EXPECT_EQ(row_numbers(sorted), expect);
  }
}

TEST(LocalPermute, TwoSendersRegroupByExpertStably) {
  // EP=2, E=4, L=2. Sender 0 routed [1,2,3,0], sender 1 [2,1,1,1] to experts 0..3.
  Vec const G = {1, 2, 3, 0, 2, 1, 1, 1};
  Exec space;
  // Shard 0 receives s0:(e0 r0)(e1 r1 r2) s1:(e0 r3 r4)(e1 r5) -> e0: 0,3,4  e1: 1,2,5.
  auto const lp = moe::permute::local_permute(space, G, 4, 2, 0);
  EXPECT_EQ(lp.layout.block_sizes, (Vec{1, 2, 2, 1}));
  EXPECT_EQ(lp.layout.group_sizes, (Vec{3, 3}));
  EXPECT_EQ(to_vec(lp.perm), (Vec{0, 3, 4, 1, 2, 5}));
  EXPECT_EQ(to_vec(lp.inverse), (Vec{0, 3, 4, 1, 2, 5}));
  EXPECT_EQ(to_vec(lp.expert_ids), (Vec{0, 0, 0, 1, 1, 1}));
  auto const x = numbered_rows(6);
  moe::View2<double, MS> sorted("sorted", 6, 2), back("back", 6, 2);
  moe::permute::permute_rows(space, lp, x, sorted);
  EXPECT_EQ(row_numbers(sorted), (Vec{0, 3, 4, 1, 2, 5}));
  moe::permute::unpermute_rows(space, lp, sorted, back);
  EXPECT_EQ(row_numbers(back), (Vec{0, 1, 2, 3, 4, 5}));

  // Truncated to R=4: blocks [1,2,2,1] -> prefix [1,3,5,6] clamped [1,3,4,4] -> [1,2,1,0].
  // Received s0:(e0 r0)(e1 r1 r2) s1:(e0 r3) -> e0: 0,3  e1: 1,2.
  auto const lt = moe::permute::local_permute(space, G, 4, 2, 0, 4);
  EXPECT_EQ(lt.layout.block_sizes, (Vec{1, 2, 1, 0}));
  EXPECT_EQ(lt.layout.group_sizes, (Vec{2, 2}));
  EXPECT_EQ(lt.layout.dropped, 2);
  EXPECT_EQ(to_vec(lt.perm), (Vec{0, 3, 1, 2}));
  EXPECT_EQ(to_vec(lt.inverse), (Vec{0, 2, 3, 1}));
  EXPECT_EQ(to_vec(lt.expert_ids), (Vec{0, 0, 1, 1}));
  moe::View2<double, MS> back4("back4", 6, 2);
  moe::View2<double, MS> sorted4("sorted4", 4, 2);
  moe::permute::permute_rows(space, lt, x, sorted4);
  moe::permute::unpermute_rows(space, lt, sorted4, back4);
  EXPECT_EQ(row_numbers(back4), (Vec{0, 1, 2, 3, 0, 0}));

  // Shard 1 (experts 2,3): blocks [[3,0],[1,1]] -> already in local order.
  auto const l1 = moe::permute::local_permute(space, G, 4, 2, 1);
  EXPECT_EQ(to_vec(l1.perm), (Vec{0, 1, 2, 3, 4}));
  EXPECT_EQ(to_vec(l1.expert_ids), (Vec{0, 0, 0, 0, 1}));
  EXPECT_EQ(l1.layout.group_sizes, (Vec{4, 1}));
}

TEST(LocalPermute, TruncationAgreesWithTruncateMatrix) {
  std::mt19937 gen(7);
  int const ep = 4, E = 8, L = 2;
  for (int trial = 0; trial < 20; ++trial) {
    Vec G(ep * E);
    for (auto& g : G) g = gen() % 5;
    Vec M(ep * ep, 0);
    for (int i = 0; i < ep; ++i)
      for (int e = 0; e < E; ++e) M[i * ep + e / L] += G[i * E + e];
    std::int64_t const R = gen() % 25;
    auto const Mt = moe::comm::truncate_matrix(M, ep, R);
    for (int me = 0; me < ep; ++me) {
      auto const lay = moe::permute::local_layout(G, E, ep, me, R);
      for (int i = 0; i < ep; ++i)
        EXPECT_EQ(lay.block_sizes[i * L] + lay.block_sizes[i * L + 1], Mt[i * ep + me]);
    }
  }
}

TEST(LocalPermute, OffsetVariantBothPatterns) {
  // §7.7 second bullet, EP=4, L=2: shard s takes rows [offset_s, offset_s + n_s) of the globally
  // sorted buffer; local counts are its slice; local ids are global ids mod L.
  Exec space;
  for (Vec const& g : {Vec{0, 1, 2, 3, 4, 5, 6, 7}, Vec{0, 0, 1, 1, 2, 0, 2, 2}}) {
    std::int64_t const total = std::accumulate(g.begin(), g.end(), std::int64_t(0));
    Vec const global_ids = repeat_ids(g);
    auto const x = numbered_rows(total);
    std::int64_t offset = 0;
    for (int s = 0; s < 4; ++s) {
      SCOPED_TRACE(s);
      auto const lp = moe::permute::local_permute_replicated(space, g, 4, s);
      std::int64_t const n = g[2 * s] + g[2 * s + 1];
      EXPECT_EQ(lp.layout.source_offset, offset);
      EXPECT_EQ(lp.rows(), n);
      EXPECT_EQ(lp.layout.group_sizes, (Vec{g[2 * s], g[2 * s + 1]}));
      Vec slice(n), local_ids(n), arange(n);
      for (std::int64_t r = 0; r < n; ++r) {
        slice[r] = offset + r;
        local_ids[r] = global_ids[offset + r] % 2;
        arange[r] = r;
      }
      EXPECT_EQ(to_vec(lp.perm), slice);
      EXPECT_EQ(to_vec(lp.inverse), arange);
      EXPECT_EQ(to_vec(lp.expert_ids), local_ids);
      moe::View2<double, MS> sorted("sorted", total, 2), back("back", n, 2);
      moe::permute::permute_rows(space, lp, x, sorted);
      Vec expect = slice;
      expect.insert(expect.end(), total - n, 0);
      EXPECT_EQ(row_numbers(sorted), expect);
      moe::permute::unpermute_rows(space, lp, sorted, back);
      EXPECT_EQ(row_numbers(back), slice);
      offset += n;
    }
  }
  // Expected offsets spelled out: pattern 1 -> 0, 1, 6, 15; pattern 2 -> 0, 0, 2, 4.
  EXPECT_EQ(moe::permute::local_layout_replicated({0, 1, 2, 3, 4, 5, 6, 7}, 4, 3).source_offset,
            15);
  EXPECT_EQ(moe::permute::local_layout_replicated({0, 0, 1, 1, 2, 0, 2, 2}, 4, 3).source_offset, 4);
}

TEST(LocalPermute, ShapeChecks) {
  Exec space;
  auto const lp = moe::permute::local_permute(space, Vec{1, 2, 3, 0, 2, 1, 1, 1}, 4, 2, 0);
  moe::View2<double, MS> small("small", 5, 2), ok("ok", 6, 2), wide("wide", 6, 3);
  EXPECT_THROW(moe::permute::permute_rows(space, lp, small, ok), moe::ShapeError);
  EXPECT_THROW(moe::permute::permute_rows(space, lp, ok, small), moe::ShapeError);
  EXPECT_THROW(moe::permute::permute_rows(space, lp, ok, wide), moe::ShapeError);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// ScratchPool: the buffers the collectives and the distributed layer keep from step to step.
namespace {

TEST(ScratchPool, ReusesGrowsAndKeepsKeysApart) {
  using MS = Kokkos::DefaultExecutionSpace::memory_space;
  moe::detail::ScratchPool<MS> pool;
  auto a = pool.get<float>("a", 100);
  EXPECT_EQ(a.extent(0), 100u);
  auto a2 = pool.get<float>("a", 50);  // smaller: the same memory
  EXPECT_EQ(a2.data(), a.data());
  EXPECT_EQ(a2.extent(0), 50u);
  auto b = pool.get<double>("b", 100);  // another key: disjoint memory
  auto const* a_lo = reinterpret_cast<char const*>(a.data());
  auto const* b_lo = reinterpret_cast<char const*>(b.data());
  EXPECT_TRUE(b_lo >= a_lo + 100 * sizeof(float) || a_lo >= b_lo + 100 * sizeof(double));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % alignof(double), 0u);
  auto big = pool.get<float>("a", 1000);  // grows; the key keeps one buffer
  EXPECT_EQ(big.extent(0), 1000u);
  Kokkos::deep_copy(big, 1.0f);  // the whole requested span is usable
  EXPECT_GE(pool.bytes(), 1000 * sizeof(float) + 100 * sizeof(double));
  EXPECT_LT(pool.bytes(), 1000 * sizeof(float) + 100 * sizeof(double) + 64);
}

}  // namespace
