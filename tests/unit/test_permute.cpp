// Sort / unsort of the routed slots (moe/permute/permute.hpp) against plain loops and
// std::stable_sort.
#include "reference.hpp"

#include <moe/bf16.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/detail/rows.hpp>
#include <moe/nn/activation.hpp>
#include <moe/permute/permute.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using namespace moe_ref;
using moe_ref::kk::close;
using moe_ref::kk::to_ids;
using moe_ref::kk::to_vec;
using moe_ref::kk::to_view;
using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using I64 = std::vector<std::int64_t>;

/// What a stable sort of the kept slots by expert id must give.
struct SortRef {
  I64 perm, inverse, offsets;
};

SortRef stable_sort_ref(Ids const& ids, Ids const& kept, int E) {
  SortRef r;
  for (std::size_t s = 0; s < ids.size(); ++s)
    if (kept[s]) r.perm.push_back(std::int64_t(s));
  std::stable_sort(r.perm.begin(), r.perm.end(),
                   [&](std::int64_t a, std::int64_t b) { return ids[a] < ids[b]; });
  r.inverse.assign(ids.size(), -1);
  for (std::size_t i = 0; i < r.perm.size(); ++i) r.inverse[r.perm[i]] = std::int64_t(i);
  r.offsets.assign(E + 1, 0);
  for (auto s : r.perm) r.offsets[ids[s] + 1] += 1;
  for (int e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  return r;
}

template <class ViewT>
I64 view_i64(ViewT const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return I64(h.data(), h.data() + h.span());
}

moe::permute::Permutation<MS> sort(Ids const& ids, Ids const& kept, int T, int K, int E,
                                   moe::permute::Permutation<MS> perm = {}) {
  auto idv = to_view<moe::View2<int, MS>>(ids, T, K);
  auto kv = to_view<moe::View2<int, MS>>(kept, T, K);
  moe::permute::sort_by_expert(Exec(), moe::View2<int const, MS>(idv),
                               moe::View2<int const, MS>(kv), E, perm);
  return perm;
}

void expect_sort(Ids const& ids, Ids const& kept, int E, moe::permute::Permutation<MS> const& p) {
  SortRef const ref = stable_sort_ref(ids, kept, E);
  EXPECT_EQ(p.rows(), std::int64_t(ref.perm.size()));
  EXPECT_EQ(view_i64(p.perm), ref.perm);
  EXPECT_EQ(view_i64(p.inverse), ref.inverse);
  ASSERT_EQ(p.groups.num_groups(), E);
  I64 host_offsets(E + 1), dev_offsets = view_i64(p.groups.offsets);
  for (int e = 0; e <= E; ++e) host_offsets[e] = p.groups.offsets_host(e);
  EXPECT_EQ(host_offsets, ref.offsets);
  EXPECT_EQ(dev_offsets, ref.offsets);
}

struct SortCase {
  int T, K, E;
  double keep_fraction;
};

TEST(PermuteSort, MatchesStdStableSort) {
  // Includes slot counts above the counting sort's chunk (max(2048, 8E) slots: several chunks,
  // chunk boundaries inside an expert's run) and more experts than fit in one small chunk.
  std::vector<SortCase> const cases = {{1, 1, 1, 1.0},     {5, 2, 4, 1.0},     {7, 3, 8, 0.7},
                                       {300, 2, 8, 1.0},   {301, 3, 5, 0.6},   {1000, 2, 3, 0.9},
                                       {200, 4, 300, 1.0}, {129, 2, 2, 0.5},   {2500, 2, 8, 0.9},
                                       {3001, 3, 5, 1.0},  {1500, 4, 300, 0.8}};
  Rng rng(11);
  for (auto const& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " K=" << c.K << " E=" << c.E);
    Ids ids(std::size_t(c.T) * c.K), kept(ids.size());
    for (auto& e : ids) e = std::min(c.E - 1, int(rng.uniform(0, c.E)));
    for (auto& k : kept) k = rng.uniform(0, 1) < c.keep_fraction ? 1 : 0;
    expect_sort(ids, kept, c.E, sort(ids, kept, c.T, c.K, c.E));
  }
}

TEST(PermuteSort, ReusedPermutationIsResized) {
  Rng rng(12);
  moe::permute::Permutation<MS> p;
  for (int T : {400, 10, 57, 0, 33}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    int const K = 2, E = 6;
    Ids ids(std::size_t(T) * K), kept(ids.size(), 1);
    for (auto& e : ids) e = std::min(E - 1, int(rng.uniform(0, E)));
    for (std::size_t i = 0; i < kept.size(); i += 3) kept[i] = 0;
    p = sort(ids, kept, T, K, E, p);
    expect_sort(ids, kept, E, p);
  }
}

TEST(PermuteSort, SingleExpert) {
  int const T = 9, K = 1, E = 1;
  Ids ids(T, 0), kept(T, 1);
  kept[4] = 0;
  auto const p = sort(ids, kept, T, K, E);
  expect_sort(ids, kept, E, p);
  EXPECT_EQ(p.rows(), 8);
  EXPECT_EQ(view_i64(p.perm), (I64{0, 1, 2, 3, 5, 6, 7, 8}));
}

TEST(PermuteSort, AllSlotsOnOneExpert) {
  int const T = 300, K = 2, E = 5;
  Ids ids(std::size_t(T) * K, 3), kept(ids.size(), 1);
  auto const p = sort(ids, kept, T, K, E);
  expect_sort(ids, kept, E, p);
  for (int e = 0; e < E; ++e) EXPECT_EQ(p.groups.size(e), e == 3 ? T * K : 0) << "expert " << e;
}

TEST(PermuteSort, ZeroSlots) {
  {
    SCOPED_TRACE("T = 0");
    Ids ids, kept;
    auto const p = sort(ids, kept, 0, 2, 4);
    EXPECT_EQ(p.rows(), 0);
    expect_sort(ids, kept, 4, p);
  }
  {
    SCOPED_TRACE("every slot dropped");
    int const T = 6, K = 2, E = 3;
    Ids ids = {0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}, kept(ids.size(), 0);
    auto const p = sort(ids, kept, T, K, E);
    EXPECT_EQ(p.rows(), 0);
    EXPECT_EQ(view_i64(p.inverse), I64(ids.size(), -1));
    expect_sort(ids, kept, E, p);
  }
}

TEST(PermuteSort, DroppedSlotsHaveNoRow) {
  // Explicit small example: ids [[2,0],[0,1],[2,2]], slot 1 (t0,k1) and slot 4 (t2,k0) dropped.
  Ids const ids = {2, 0, 0, 1, 2, 2}, kept = {1, 0, 1, 1, 0, 1};
  auto const p = sort(ids, kept, 3, 2, 3);
  EXPECT_EQ(view_i64(p.perm), (I64{2, 3, 0, 5}));
  EXPECT_EQ(view_i64(p.inverse), (I64{2, -1, 0, 1, -1, 3}));
  EXPECT_EQ(view_i64(p.groups.offsets), (I64{0, 1, 2, 4}));
}

// ---- gather / combine and their backward ---------------------------------------------------

struct Fixture {
  int T, K, E, D;
  Ids ids, kept;
  SortRef ref;
  moe::permute::Permutation<MS> p;
};

Fixture make_fixture(int T, int K, int E, int D, double keep, std::uint64_t seed) {
  Rng rng(seed);
  Fixture f{T, K, E, D, {}, {}, {}, {}};
  f.ids.resize(std::size_t(T) * K);
  f.kept.resize(f.ids.size());
  for (auto& e : f.ids) e = std::min(E - 1, int(rng.uniform(0, E)));
  for (auto& k : f.kept) k = rng.uniform(0, 1) < keep ? 1 : 0;
  f.ref = stable_sort_ref(f.ids, f.kept, E);
  f.p = sort(f.ids, f.kept, T, K, E);
  return f;
}

template <class Scalar>
void check_gather_combine(Fixture const& f, std::uint64_t seed) {
  using V2 = moe::View2<Scalar, MS>;
  using C2 = moe::View2<Scalar const, MS>;
  using CI = moe::View1<std::int64_t const, MS>;
  double const tol = std::is_same_v<Scalar, float> ? 1e-6 : 1e-14;
  int const T = f.T, K = f.K, D = f.D;
  std::int64_t const n = f.ref.perm.size();
  Rng rng(seed);
  Vec const x = rng.vec(std::size_t(T) * D, -1, 1);
  Vec const ys = rng.vec(std::size_t(n) * D, -1, 1);
  Vec const w = rng.vec(std::size_t(T) * K, 0, 1);
  Vec const dy = rng.vec(std::size_t(T) * D, -1, 1);
  Vec const y0 = rng.vec(std::size_t(T) * D, -1, 1);
  Exec space;
  CI perm(f.p.perm), inv(f.p.inverse);

  // gather_rows: out[i] = x[perm[i] / K]
  V2 xs("xs", n, D);
  moe::permute::gather_rows(space, C2(to_view<V2>(x, T, D)), perm, K, xs);
  Vec xs_ref(std::size_t(n) * D);
  for (std::int64_t i = 0; i < n; ++i)
    for (int d = 0; d < D; ++d) xs_ref[i * D + d] = x[(f.ref.perm[i] / K) * D + d];
  EXPECT_TRUE(close(to_vec(xs), xs_ref, 0, 0)) << "gather_rows";

  // combine, overwrite and accumulate
  auto ysv = to_view<V2>(ys, n, D);
  auto wv = to_view<V2>(w, T, K);
  Vec y_ref(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      std::int64_t const r = f.ref.inverse[t * K + k];
      if (r < 0) continue;
      for (int d = 0; d < D; ++d) y_ref[t * D + d] += double(Scalar(w[t * K + k])) * ys[r * D + d];
    }
  auto yv = to_view<V2>(y0, T, D);  // garbage that overwrite must clear
  moe::permute::combine(space, C2(ysv), inv, C2(wv), false, yv);
  EXPECT_TRUE(close(to_vec(yv), y_ref, tol, tol)) << "combine";
  auto yacc = to_view<V2>(y0, T, D);
  moe::permute::combine(space, C2(ysv), inv, C2(wv), true, yacc);
  Vec yacc_ref = y_ref;
  for (std::size_t i = 0; i < yacc_ref.size(); ++i) yacc_ref[i] += y0[i];
  EXPECT_TRUE(close(to_vec(yacc), yacc_ref, tol, tol)) << "combine accumulate";

  // combine_backward: dys[i] = w[s] dy[s/K]; dw[t,k] = <dy[t], ys[inverse]> or 0
  V2 dys("dys", n, D), dw("dw", T, K);
  Kokkos::deep_copy(dw, Scalar(7));  // dropped slots must be overwritten with 0
  auto dyv = to_view<V2>(dy, T, D);
  moe::permute::combine_backward(space, C2(dyv), C2(ysv), perm, inv, C2(wv), dys, dw);
  Vec dys_ref(std::size_t(n) * D), dw_ref(std::size_t(T) * K, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t const s = f.ref.perm[i];
    for (int d = 0; d < D; ++d) dys_ref[i * D + d] = w[s] * dy[(s / K) * D + d];
  }
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      std::int64_t const r = f.ref.inverse[t * K + k];
      if (r >= 0)
        for (int d = 0; d < D; ++d) dw_ref[t * K + k] += dy[t * D + d] * ys[r * D + d];
    }
  EXPECT_TRUE(close(to_vec(dys), dys_ref, tol, tol)) << "combine_backward rows";
  EXPECT_TRUE(close(to_vec(dw), dw_ref, tol, tol)) << "combine_backward weights";

  // adjoint identity: <combine(ys), dy> = <ys, dys>
  double lhs = 0, rhs = 0;
  Vec const yc = to_vec(yv), dysv = to_vec(dys);
  for (std::size_t i = 0; i < yc.size(); ++i) lhs += yc[i] * dy[i];
  for (std::size_t i = 0; i < dysv.size(); ++i) rhs += dysv[i] * ys[i];
  EXPECT_NEAR(lhs, rhs, 100 * tol * (1 + std::fabs(lhs))) << "combine adjoint";

  // gather_rows_backward: dx[t] = sum_k dxs[inverse[t*K+k]] over kept slots
  Vec const dxs = rng.vec(std::size_t(n) * D, -1, 1);
  Vec dx_ref(std::size_t(T) * D, 0.0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      std::int64_t const r = f.ref.inverse[t * K + k];
      if (r >= 0)
        for (int d = 0; d < D; ++d) dx_ref[t * D + d] += dxs[r * D + d];
    }
  auto dxsv = to_view<V2>(dxs, n, D);
  auto dxv = to_view<V2>(y0, T, D);
  moe::permute::gather_rows_backward(space, C2(dxsv), inv, K, false, dxv);
  EXPECT_TRUE(close(to_vec(dxv), dx_ref, tol, tol)) << "gather_rows_backward";
  auto dxacc = to_view<V2>(y0, T, D);
  moe::permute::gather_rows_backward(space, C2(dxsv), inv, K, true, dxacc);
  for (std::size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += y0[i];
  EXPECT_TRUE(close(to_vec(dxacc), dx_ref, tol, tol)) << "gather_rows_backward accumulate";

  // adjoint identity: <gather(x), dxs> = <x, gather_backward(dxs)>
  double g1 = 0, g2 = 0;
  for (std::size_t i = 0; i < xs_ref.size(); ++i) g1 += xs_ref[i] * dxs[i];
  Vec const gb = to_vec(dxv);
  for (std::size_t i = 0; i < gb.size(); ++i) g2 += x[i] * gb[i];
  EXPECT_NEAR(g1, g2, 100 * tol * (1 + std::fabs(g1))) << "gather adjoint";
}

template <class Scalar>
void gather_combine_cases() {
  struct C {
    int T, K, E, D;
    double keep;
  };
  std::vector<C> const cases = {{6, 2, 4, 5, 1.0}, {13, 3, 5, 4, 0.6}, {300, 2, 8, 3, 0.8},
                                {8, 1, 1, 4, 1.0}, {7, 2, 3, 3, 0.0},  {1, 4, 4, 2, 1.0}};
  std::uint64_t seed = 40;
  for (auto const& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "T=" << c.T << " K=" << c.K << " E=" << c.E << " keep=" << c.keep);
    auto const f = make_fixture(c.T, c.K, c.E, c.D, c.keep, seed++);
    check_gather_combine<Scalar>(f, seed++);
  }
  {
    SCOPED_TRACE("all slots on one expert");
    Fixture f = make_fixture(10, 2, 4, 3, 1.0, 99);
    f.ids.assign(f.ids.size(), 2);
    f.ref = stable_sort_ref(f.ids, f.kept, f.E);
    f.p = sort(f.ids, f.kept, f.T, f.K, f.E);
    check_gather_combine<Scalar>(f, 100);
  }
}

/// OpenMP's thread count for the object's lifetime (nothing without OpenMP).
class OmpThreads {
 public:
  explicit OmpThreads([[maybe_unused]] int n) {
#if defined(_OPENMP)
    omp_set_num_threads(n);
#endif
  }
  ~OmpThreads() {
#if defined(_OPENMP)
    omp_set_num_threads(saved_);
#endif
  }
  OmpThreads(OmpThreads const&) = delete;
  OmpThreads& operator=(OmpThreads const&) = delete;

 private:
#if defined(_OPENMP)
  int saved_ = omp_get_max_threads();
#endif
};

// On 1 thread and on 3 (the 300-token case has ~480 rows: split where splits_over_openmp).
TEST(PermuteGatherCombine, MatchLoopsDouble) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << threads << " OpenMP threads");
    OmpThreads const omp(threads);
    gather_combine_cases<double>();
  }
}
TEST(PermuteGatherCombine, MatchLoopsFloat) {
  for (int threads : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << threads << " OpenMP threads");
    OmpThreads const omp(threads);
    gather_combine_cases<float>();
  }
}

/// The 16-bit bits of v's values (float views holding bf16 values, or moe::bf16 views).
template <class V>
std::vector<std::uint16_t> bf16_bits_of(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  std::vector<std::uint16_t> b(h.span());
  for (std::size_t i = 0; i < b.size(); ++i) {
    if constexpr (std::is_same_v<typename V::non_const_value_type, moe::bf16>)
      b[i] = h.data()[i].bits;
    else
      b[i] = moe::bf16(float(h.data()[i])).bits;
  }
  return b;
}

// 16-bit routed rows (a bf16 layer's x_local, y_local, dy_local): each kernel gives the bits of
// its float path on bf16-valued floats, rounded where the float path's caller rounds.
TEST(PermuteGatherCombine, Bf16RowsGiveTheBitsOfTheFloatPath) {
  using V2 = moe::View2<float, MS>;
  using C2 = moe::View2<float const, MS>;
  using B2 = moe::View2<moe::bf16, MS>;
  using CB2 = moe::View2<moe::bf16 const, MS>;
  using CI = moe::View1<std::int64_t const, MS>;
  Exec space;
  // D = 37: one short block of columns per row; 130: whole blocks of the 16-bit sums and a tail.
  for (auto const& run : {std::pair{1, 37}, std::pair{3, 37}, std::pair{2, 130}}) {
    OmpThreads const omp(run.first);
    auto const f = make_fixture(300, 2, 8, run.second, 0.8, 7);
    int const T = f.T, K = f.K, D = f.D;
    std::int64_t const n = f.p.rows();
    Rng rng(8);
    auto rounded = [&](std::size_t count) {
      Vec v = rng.vec(count, -3, 3);
      for (auto& e : v) e = double(moe::detail::round_to_bf16(float(e)));
      return v;
    };
    auto const x = to_view<V2>(rounded(std::size_t(T) * D), T, D);
    auto const ys = to_view<V2>(rounded(std::size_t(n) * D), n, D);
    auto const dxs = to_view<V2>(rounded(std::size_t(n) * D), n, D);
    auto const w = to_view<V2>(rng.vec(std::size_t(T) * K, 0, 1), T, K);
    auto const dy = to_view<V2>(rng.vec(std::size_t(T) * D, -1, 1), T, D);
    auto narrow = [&](V2 const& v) {
      B2 b("b", v.extent(0), v.extent(1));
      moe::detail::copy_into(space, v, b, false);
      return b;
    };
    auto const ys16 = narrow(ys), dxs16 = narrow(dxs);
    CI perm(f.p.perm), inv(f.p.inverse);

    V2 xs("xs", n, D);
    B2 xs16("xs16", n, D);
    moe::permute::gather_rows(space, C2(x), perm, K, xs);
    moe::permute::gather_rows(space, C2(x), perm, K, xs16);
    EXPECT_EQ(bf16_bits_of(xs16), bf16_bits_of(xs)) << "gather_rows";

    V2 y("y", T, D), y16("y16", T, D);
    moe::permute::combine(space, C2(ys), inv, C2(w), false, y);
    moe::permute::combine(space, CB2(ys16), inv, C2(w), false, y16);
    EXPECT_EQ(to_vec(y16), to_vec(y)) << "combine";

    V2 dys("dys", n, D), dw("dw", T, K), dw16("dw16", T, K);
    B2 dys16("dys16", n, D);
    moe::permute::combine_backward(space, C2(dy), C2(ys), perm, inv, C2(w), dys, dw);
    moe::permute::combine_backward(space, C2(dy), CB2(ys16), perm, inv, C2(w), dys16, dw16);
    EXPECT_EQ(bf16_bits_of(dys16), bf16_bits_of(dys)) << "combine_backward rows, rounded";
    EXPECT_EQ(to_vec(dw16), to_vec(dw)) << "combine_backward weights";
    // A 16-bit dy too (a bf16 layer's dy_work: bf16 values), widened exactly.
    auto const dyb = to_view<V2>(rounded(std::size_t(T) * D), T, D);
    auto const dyb16 = narrow(dyb);
    moe::permute::combine_backward(space, C2(dyb), C2(ys), perm, inv, C2(w), dys, dw);
    moe::permute::combine_backward(space, CB2(dyb16), CB2(ys16), perm, inv, C2(w), dys16, dw16);
    EXPECT_EQ(bf16_bits_of(dys16), bf16_bits_of(dys)) << "combine_backward rows, 16-bit dy";
    EXPECT_EQ(to_vec(dw16), to_vec(dw)) << "combine_backward weights, 16-bit dy";
    // gather_rows from 16-bit tokens (the ring's x_work) into either width.
    auto const x16 = narrow(x);
    V2 xsw("xsw", n, D);
    moe::permute::gather_rows(space, CB2(x16), perm, K, xsw);
    moe::permute::gather_rows(space, CB2(x16), perm, K, xs16);
    EXPECT_EQ(to_vec(xsw), to_vec(xs)) << "gather_rows from 16-bit rows";
    EXPECT_EQ(bf16_bits_of(xs16), bf16_bits_of(xs)) << "gather_rows 16-bit to 16-bit";

    V2 dx("dx", T, D), dx16("dx16", T, D);
    moe::permute::gather_rows_backward(space, C2(dxs), inv, K, false, dx);
    moe::permute::gather_rows_backward(space, CB2(dxs16), inv, K, false, dx16);
    EXPECT_EQ(to_vec(dx16), to_vec(dx)) << "gather_rows_backward";
    // Into 16-bit rows (the ring's y_work and dx_work): the float sums, rounded once.
    B2 yb("yb", T, D), dxb("dxb", T, D);
    moe::permute::combine(space, CB2(ys16), inv, C2(w), false, yb);
    moe::permute::gather_rows_backward(space, CB2(dxs16), inv, K, false, dxb);
    EXPECT_EQ(bf16_bits_of(yb), bf16_bits_of(y)) << "combine into 16-bit rows";
    EXPECT_EQ(bf16_bits_of(dxb), bf16_bits_of(dx)) << "gather_rows_backward into 16-bit rows";
  }
}

// moe::detail::for_each_index on Kokkos::Serial: contiguous blocks, one per OpenMP thread, each
// index once; short ranges and calls from inside a parallel region stay on their thread.
TEST(HostThreads, ForEachIndexSplitsContiguousBlocksOverOpenMpThreads) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP: host loops run on Kokkos alone";
#else
  // The host space (the host lambdas below cannot run on a device space).
  using Host = Kokkos::DefaultHostExecutionSpace;
  if (!moe::detail::splits_over_openmp<Host>())
    GTEST_SKIP() << "the host execution space is not Kokkos::Serial: Kokkos runs its loops";
  OmpThreads const omp(3);
  auto owners = [](std::int64_t n, std::int64_t grain) {
    std::vector<int> owner(std::size_t(n), -1), visits(std::size_t(n), 0);
    moe::detail::for_each_index(Host(), "test", n, grain, [&](std::int64_t i) {
      owner[std::size_t(i)] = omp_get_thread_num();
      ++visits[std::size_t(i)];
    });
    for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(visits[std::size_t(i)], 1) << "index " << i;
    return owner;
  };
  std::vector<int> const split = owners(1000, 10);
  for (int t = 0; t < 3; ++t)  // block t: [1000 t / 3, 1000 (t + 1) / 3)
    for (std::int64_t i = 1000 * t / 3; i < 1000 * (t + 1) / 3; ++i)
      ASSERT_EQ(split[std::size_t(i)], t) << "index " << i;
  std::vector<int> const one = owners(15, 10);  // under 2 * grain: one thread
  for (int o : one) EXPECT_EQ(o, 0);
  std::vector<int> const two = owners(25, 10);  // 2 pieces of at least the grain
  EXPECT_EQ(two.front(), 0);
  EXPECT_EQ(two.back(), 1);
  // Inside a parallel region every caller runs its whole range on its own thread.
  std::vector<std::vector<int>> nested(2, std::vector<int>(200, -1));
#pragma omp parallel num_threads(2)
  {
    int const me = omp_get_thread_num();
    moe::detail::for_each_index(Host(), "test", 200, 10, [&](std::int64_t i) {
      nested[std::size_t(me)][std::size_t(i)] = omp_get_thread_num();
    });
  }
  for (int me = 0; me < 2; ++me)
    for (int o : nested[std::size_t(me)]) EXPECT_EQ(o, me);
#endif
}

// The kernels that split over OpenMP threads write the same bits on 1, 2, 3 and 5 threads:
// the bf16 activation forward and backward, the rounding copy, and the first non-finite index.
TEST(HostThreads, ElementKernelsGiveTheSameBitsOnAnyNumberOfThreads) {
  using V = moe::View2<float, MS>;
  using B = moe::View2<moe::bf16, MS>;
  std::int64_t const rows = 37, F = 3001;  // n = 111,037: above 2 * element_grain
  Rng rng(7);
  Vec const h0 = rng.vec(std::size_t(rows * F), -6, 6), h1 = rng.vec(std::size_t(rows * F), -2, 2);
  Vec const da = rng.vec(std::size_t(rows * F), -1, 1);
  auto bits = [](auto const& v) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    std::vector<unsigned char> b(h.span() * sizeof(typename decltype(h)::value_type));
    std::memcpy(b.data(), h.data(), b.size());
    return b;
  };
  using Run = std::vector<std::vector<unsigned char>>;
  auto run = [&](int threads) {
    OmpThreads const omp(threads);
    Exec space;
    V f0 = to_view<V>(h0, rows, F), f1 = to_view<V>(h1, rows, F), fd = to_view<V>(da, rows, F);
    B b0("b0", rows, F), b1("b1", rows, F), ba("ba", rows, F), bd0("bd0", rows, F),
        bd1("bd1", rows, F);
    moe::detail::convert_into(space, f0, b0, "test");
    moe::detail::convert_into(space, f1, b1, "test");
    moe::nn::gated_forward(space, moe::Activation::Silu, rows, b0, b1, ba, true);
    moe::nn::gated_backward(space, moe::Activation::Gelu, rows, b0, b1, ba, bd0, bd1, true);
    V fa("fa", rows, F), g0("g0", rows, F), g1("g1", rows, F), r("r", rows, F);
    moe::nn::gated_forward(space, moe::Activation::Gelu, rows, f0, f1, fa, false);
    moe::nn::gated_backward(space, moe::Activation::Silu, rows, f0, f1, fd, g0, g1, false);
    moe::detail::copy_into(space, f0, r, true);
    return Run{bits(b0), bits(ba), bits(bd0), bits(bd1), bits(fa), bits(g0), bits(g1), bits(r)};
  };
  Run const one = run(1);
  for (int threads : {2, 3, 5}) {
    Run const many = run(threads);
    for (std::size_t k = 0; k < one.size(); ++k)
      EXPECT_TRUE(many[k] == one[k]) << "output " << k << " on " << threads << " threads";
  }
  // first_nonfinite: the least index over the blocks, whichever thread scans it.
  V probe = to_view<V>(h0, rows, F);
  auto h = Kokkos::create_mirror_view(probe);
  Kokkos::deep_copy(h, probe);
  std::int64_t const n = rows * F, inf_at = n / 2 + 5, nan_at = n - 3;
  h.data()[nan_at] = std::numeric_limits<float>::quiet_NaN();
  Kokkos::deep_copy(probe, h);
  for (int threads : {1, 2, 3, 5}) {
    OmpThreads const omp(threads);
    EXPECT_EQ(moe::detail::first_nonfinite(Exec(), probe), nan_at) << threads << " threads";
  }
  h.data()[inf_at] = -std::numeric_limits<float>::infinity();
  Kokkos::deep_copy(probe, h);
  for (int threads : {1, 2, 3, 5}) {
    OmpThreads const omp(threads);
    EXPECT_EQ(moe::detail::first_nonfinite(Exec(), probe), inf_at) << threads << " threads";
    EXPECT_FALSE(moe::detail::all_finite(Exec(), probe));
  }
  Kokkos::deep_copy(probe, to_view<V>(h0, rows, F));
  OmpThreads const omp(3);
  EXPECT_EQ(moe::detail::first_nonfinite(Exec(), probe), n);
}

}  // namespace
