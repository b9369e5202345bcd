// Multi-rank tests of moe/comm (run at 1, 2 and 4 ranks): Communicator, deterministic collectives
// against a serial rank-order reference, RaggedAllToAll forward/reverse with skewed and capped
// counts, and collective errors (same exception on every rank, no hang).
#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/comm/iall_gather.hpp>
#include <moe/comm/ragged_all_to_all.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>
#include <moe/comm/mpi.hpp>
#include "../allocation_tracker.hpp"

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultExecutionSpace;
using MS = Exec::memory_space;
using Vec = std::vector<std::int64_t>;
using moe::comm::Communicator;

Communicator world() { return Communicator(MPI_COMM_WORLD); }

/// Runs the body normally, then with the large-count fallback (count limit 3 elements) and host
/// staging forced, on every rank alike.
void with_both_paths(std::function<void()> const& body) {
  body();
  auto& limit = moe::comm::detail::count_limit();
  auto& staging = moe::comm::detail::force_staging();
  std::int64_t const saved = limit;
  limit = 3, staging = true;
  try {
    body();
  } catch (...) {
    limit = saved, staging = false;
    throw;
  }
  limit = saved, staging = false;
}

/// Value of element e of rank r's input: mixed magnitudes, so the sum depends on its order.
double value(int r, std::int64_t e, unsigned seed) {
  std::mt19937_64 gen(seed * 1000003ull + static_cast<unsigned>(r) * 7919ull +
                      static_cast<std::uint64_t>(e));
  double const u = double(gen() >> 11) * (1.0 / 9007199254740992.0);
  return (u - 0.5) * std::pow(10.0, double(gen() % 12) - 6.0);
}

template <class V>
void fill(V const& v, int r, unsigned seed) {
  auto h = Kokkos::create_mirror_view(v);
  auto* p = h.data();
  for (std::size_t e = 0; e < h.size(); ++e)
    p[e] = static_cast<typename V::non_const_value_type>(value(r, std::int64_t(e), seed));
  Kokkos::deep_copy(v, h);
}

template <class V>
std::vector<typename V::non_const_value_type> host(V const& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<typename V::non_const_value_type>(h.data(), h.data() + h.size());
}

template <class T>
bool bitwise_equal(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// ---------------------------------------------------------------------------------------------

TEST(Communicator, DuplicatesAndSplits) {
  Communicator const c = world();
  int wr = 0, ws = 0, cmp = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm_size(MPI_COMM_WORLD, &ws);
  EXPECT_EQ(c.rank(), wr);
  EXPECT_EQ(c.size(), ws);
  EXPECT_NE(c.get(), MPI_COMM_WORLD);
  MPI_Comm_compare(c.get(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);
  {
    Communicator const copy = c;  // copies share the duplicate
    EXPECT_EQ(copy.get(), c.get());
  }
  MPI_Comm_compare(c.get(), MPI_COMM_WORLD, &cmp);  // still alive after the copy died
  EXPECT_EQ(cmp, MPI_CONGRUENT);

  Communicator const half = c.split(c.rank() % 2, c.rank());
  EXPECT_EQ(half.size(), (ws + 1 - c.rank() % 2) / 2);
  EXPECT_EQ(half.rank(), c.rank() / 2);
  // A reduction on the sub-communicator sums only its members.
  Kokkos::View<double*, MS> v("v", 3);
  Kokkos::deep_copy(v, double(c.rank()));
  moe::comm::all_reduce(half, Exec(), v);
  double expect = 0;
  for (int r = c.rank() % 2; r < ws; r += 2) expect += r;
  for (double x : host(v)) EXPECT_EQ(x, expect);

  EXPECT_THROW(Communicator(MPI_COMM_NULL), moe::ConfigError);
  EXPECT_THROW(c.split(c.rank() == c.size() - 1 ? -1 : 0, 0), moe::ConfigError);
}

TEST(Collectives, AllGatherConcatenatesInRankOrder) {
  Communicator const c = world();
  int const P = c.size();
  with_both_paths([&] {
    for (std::int64_t n : {0, 1, 5}) {
      Kokkos::View<double**, Kokkos::LayoutRight, MS> in("in", n, 3), out("out", P * n, 3);
      fill(in, c.rank(), 1);
      moe::comm::all_gather(c, Exec(), in, out);
      auto const got = host(out);
      for (int r = 0; r < P; ++r)
        for (std::int64_t e = 0; e < n * 3; ++e) ASSERT_EQ(got[r * n * 3 + e], value(r, e, 1));
    }
    Kokkos::View<float***, Kokkos::LayoutRight, MS> in3("in3", 2, 2, 3), out3("out3", 2 * P, 2, 3);
    fill(in3, c.rank(), 2);
    moe::comm::all_gather(c, Exec(), in3, out3);
    auto const got3 = host(out3);
    for (int r = 0; r < P; ++r)
      for (std::int64_t e = 0; e < 12; ++e) ASSERT_EQ(got3[r * 12 + e], float(value(r, e, 2)));
    Kokkos::View<std::int64_t*, MS> ids("ids", 2), all("all", 2 * P);
    Kokkos::deep_copy(ids, std::int64_t(c.rank() + 10));
    moe::comm::all_gather(c, Exec(), ids, all);
    auto const gi = host(all);
    for (int r = 0; r < P; ++r) EXPECT_EQ(gi[2 * r + 1], r + 10);
  });
}

// An all-gather whose in is exactly this rank's block of out gathers in place (MPI_IN_PLACE, or
// no self-message on the large-count path), on every path: the result of a gather from a
// separate in. Any other overlap is a ShapeError on every rank.
TEST(Collectives, AllGatherInPlace) {
  Communicator const c = world();
  int const P = c.size();
  auto& limit = moe::comm::detail::count_limit();
  auto& staging = moe::comm::detail::force_staging();
  std::int64_t const saved = limit;
  for (int path = 0; path < 4; ++path) {
    SCOPED_TRACE("count limit " + std::string(path & 1 ? "3" : "default") +
                 (path & 2 ? ", host staging" : ""));
    limit = path & 1 ? 3 : saved, staging = (path & 2) != 0;
    for (std::int64_t n : {0, 1, 5}) {
      Kokkos::View<float**, Kokkos::LayoutRight, MS> in("in", n, 3), want("want", P * n, 3),
          out("out", P * n, 3);
      fill(in, c.rank(), 3);
      moe::comm::all_gather(c, Exec(), in, want);
      Kokkos::deep_copy(out, -1.0f);
      auto const own =
          Kokkos::subview(out, std::make_pair(c.rank() * n, (c.rank() + 1) * n), Kokkos::ALL);
      Kokkos::deep_copy(own, in);
      moe::comm::all_gather(c, Exec(), Kokkos::View<float const**, Kokkos::LayoutRight, MS>(own),
                            out);
      EXPECT_TRUE(bitwise_equal(host(out), host(want))) << "n=" << n;
    }
  }
  limit = saved, staging = false;
  if (P < 2) return;
  // Overlapping, but not this rank's block: the next rank's.
  Kokkos::View<float**, Kokkos::LayoutRight, MS> out("out", 2 * P, 3);
  int const other = (c.rank() + 1) % P;
  auto const wrong = Kokkos::subview(out, std::make_pair(2 * other, 2 * other + 2), Kokkos::ALL);
  EXPECT_THROW(moe::comm::all_gather(
                   c, Exec(), Kokkos::View<float const**, Kokkos::LayoutRight, MS>(wrong), out),
               moe::ShapeError);
}

// The non-blocking all-gather gives the blocking one's result; several may be in flight at once
// (completed in any order), test() drives them, and destroying a request that was never waited
// for is safe.
TEST(Collectives, NonBlockingAllGatherEqualsAllGather) {
  Communicator const c = world();
  int const P = c.size();
  with_both_paths([&] {
    for (std::int64_t n : {0, 1, 5}) {
      Kokkos::View<double**, Kokkos::LayoutRight, MS> a("a", n, 3), b("b", n, 2);
      Kokkos::View<double**, Kokkos::LayoutRight, MS> ga("ga", P * n, 3), gb("gb", P * n, 2);
      Kokkos::View<double**, Kokkos::LayoutRight, MS> want("want", P * n, 3);
      fill(a, c.rank(), 1);
      fill(b, c.rank(), 2);
      moe::comm::all_gather(c, Exec(), a, want);
      auto ra = moe::comm::iall_gather(c, Exec(), a, ga);
      auto rb = moe::comm::iall_gather(c, Exec(), b, gb);
      EXPECT_TRUE(ra.pending());
      while (!rb.test()) {
      }
      rb.wait(Exec());
      ra.wait(Exec());
      EXPECT_FALSE(ra.pending());
      EXPECT_TRUE(bitwise_equal(host(ga), host(want)));
      auto const gotb = host(gb);
      for (int r = 0; r < P; ++r)
        for (std::int64_t e = 0; e < n * 2; ++e) ASSERT_EQ(gotb[r * n * 2 + e], value(r, e, 2));
      // Moved, then dropped without a wait: the destructor completes it.
      auto rc = moe::comm::iall_gather(c, Exec(), a, ga);
      auto moved = std::move(rc);
      EXPECT_FALSE(rc.pending());
    }
  });
  Kokkos::View<float**, Kokkos::LayoutRight, MS> in("in", 2, 3), bad("bad", 2 * P + 1, 3);
  EXPECT_THROW(moe::comm::iall_gather(c, Exec(), in, bad), moe::ShapeError);

  // A gather in pieces agrees on the shape once: two column chunks of [4, 6], each gathered as
  // [4, 3] pieces, give the blocking gathers of the chunks.
  using V2 = Kokkos::View<double**, Kokkos::LayoutRight, MS>;
  V2 own("own", 2 * 4, 3), got("got", 2 * P * 4, 3), want0("want0", P * 4, 3),
      want1("want1", P * 4, 3);
  fill(own, c.rank(), 4);
  auto piece = [&](V2 const& v, std::int64_t k, std::int64_t rows) {
    return V2(v.data() + k * rows * 3, rows, 3);
  };
  moe::comm::all_gather(c, Exec(), piece(own, 0, 4), want0);
  moe::comm::all_gather(c, Exec(), piece(own, 1, 4), want1);
  moe::comm::AllGatherPieces<double, MS, MS> const pieces(c, Exec(), piece(own, 0, 4),
                                                          piece(got, 0, P * 4));
  auto r0 = pieces.start(Exec(), piece(own, 0, 4), piece(got, 0, P * 4));
  auto r1 = pieces.start(Exec(), piece(own, 1, 4), piece(got, 1, P * 4));
  r1.wait(Exec());
  r0.wait(Exec());
  EXPECT_TRUE(bitwise_equal(host(piece(got, 0, P * 4)), host(want0)));
  EXPECT_TRUE(bitwise_equal(host(piece(got, 1, P * 4)), host(want1)));
  // A piece that is not the agreed shape is refused before anything is posted.
  EXPECT_THROW(pieces.start(Exec(), piece(own, 0, 3), piece(got, 0, P * 3)), moe::ShapeError);
  // The agreement itself is collective: a bad shape is the same ShapeError on every rank.
  EXPECT_THROW((moe::comm::AllGatherPieces<float, MS, MS>(c, Exec(), in, bad)), moe::ShapeError);
}

template <class T>
void check_reduce_scatter(Communicator const& c, std::int64_t chunk, std::int64_t cols) {
  int const P = c.size();
  Kokkos::View<T**, Kokkos::LayoutRight, MS> in("in", P * chunk, cols), out("out", chunk, cols);
  fill(in, c.rank(), 3);
  moe::comm::reduce_scatter(c, Exec(), in, out);
  auto const first = host(out);
  // Serial reference: the sum over ranks in rank order 0, 1, ..., P-1.
  std::vector<T> ref(chunk * cols);
  std::int64_t const base = c.rank() * chunk * cols;
  for (std::int64_t e = 0; e < chunk * cols; ++e) {
    T acc = T(value(0, base + e, 3));
    for (int r = 1; r < P; ++r) acc += T(value(r, base + e, 3));
    ref[e] = acc;
  }
  EXPECT_TRUE(bitwise_equal(first, ref));
  moe::comm::reduce_scatter(c, Exec(), in, out);
  EXPECT_TRUE(bitwise_equal(host(out), first));  // repeatable bit for bit
}

TEST(Collectives, ReduceScatterSumsInRankOrder) {
  Communicator const c = world();
  with_both_paths([&] {
    check_reduce_scatter<double>(c, 4, 5);
    check_reduce_scatter<float>(c, 3, 7);
    check_reduce_scatter<double>(c, 0, 2);
  });
}

template <class T>
void check_all_reduce(Communicator const& c, std::int64_t a, std::int64_t b) {
  int const P = c.size();
  Kokkos::View<T**, Kokkos::LayoutRight, MS> v("v", a, b);
  fill(v, c.rank(), 4);
  moe::comm::all_reduce(c, Exec(), v);
  std::vector<T> ref(a * b);
  for (std::int64_t e = 0; e < a * b; ++e) {
    T acc = T(value(0, e, 4));
    for (int r = 1; r < P; ++r) acc += T(value(r, e, 4));
    ref[e] = acc;
  }
  auto const got = host(v);
  EXPECT_TRUE(bitwise_equal(got, ref));  // identical to the serial sum, hence on every rank
  fill(v, c.rank(), 4);
  moe::comm::all_reduce(c, Exec(), v);
  EXPECT_TRUE(bitwise_equal(host(v), got));
}

TEST(Collectives, AllReduceIsDeterministicAndPadsUnevenLengths) {
  Communicator const c = world();
  with_both_paths([&] {
    check_all_reduce<double>(c, 7, 3);  // 21 elements: not divisible by 2 or 4
    check_all_reduce<double>(c, 4, 4);
    check_all_reduce<float>(c, 1, 5);
    check_all_reduce<double>(c, 0, 3);
  });
  Kokkos::View<double***, Kokkos::LayoutRight, MS> v3("v3", 2, 3, 2);
  Kokkos::deep_copy(v3, 1.0);
  moe::comm::all_reduce(c, Exec(), v3);
  for (double x : host(v3)) EXPECT_EQ(x, double(c.size()));
}

// A view longer than all_reduce's segment is reduced a segment at a time, in place but for one
// segment's receive buffer and the padded remainder: the bits of the serial rank-order sum (and
// so of one segment), with temporaries of exactly detail::all_reduce_segments(...).temp elements
// (what the memory estimate counts), on every path.
TEST(Collectives, AllReduceBySegmentsKeepsTheBitsAndItsTemporariesSmall) {
  Communicator const c = world();
  int const P = c.size();
  auto& seg = moe::comm::detail::segment_bytes();
  std::int64_t const saved = seg;
  // Segments of 5 doubles (10 floats) per rank; then of one element per rank (1 byte: the least).
  for (std::int64_t bytes : {std::int64_t(5 * P * 8), std::int64_t(1)}) {
    seg = bytes;
    SCOPED_TRACE("segment bytes " + std::to_string(bytes));
    try {
      with_both_paths([&] {
        for (std::int64_t n : {std::int64_t(1), std::int64_t(5 * P), std::int64_t(23),
                               std::int64_t(5 * P * 3 + 1), std::int64_t(5 * P * 2 + P)}) {
          SCOPED_TRACE("n = " + std::to_string(n));
          check_all_reduce<double>(c, n, 1);
          check_all_reduce<float>(c, 1, n);
          Kokkos::View<double*, Kokkos::LayoutRight, MS> v("v", n);
          fill(v, c.rank(), 4);
          Kokkos::fence();
          std::int64_t peak = 0;
          {
            moe_test::AllocationTracker tracker;
            moe::comm::all_reduce(c, Exec(), v);
            peak = moe_test::AllocationTracker::peak;
          }
          // Host staging adds its host buffers; without it, exactly the estimate's elements.
          std::int64_t const temp = moe::comm::detail::all_reduce_segments(n, P, 8).temp;
          if (!moe::comm::detail::force_staging()) {
            EXPECT_EQ(peak, temp * 8);
          }
          EXPECT_GE(peak, temp * 8);
        }
      });
    } catch (...) {
      seg = saved;
      throw;
    }
  }
  seg = saved;
  // The segmentation itself: whole segments of P rows, then the remainder padded to P.
  seg = 5 * 4 * 8;
  auto const s = moe::comm::detail::all_reduce_segments(43, 4, 8);
  seg = saved;
  EXPECT_EQ(s.size, 20);
  EXPECT_EQ(s.temp, 20 + 4);  // 40 in two segments, 3 left (padded to 4)
  EXPECT_EQ(moe::comm::detail::all_reduce_segments(43, 1, 8).temp, 0);
  EXPECT_EQ(moe::comm::detail::all_reduce_segments(2, 4, 8).temp, 4 + 4);
  EXPECT_EQ(moe::comm::detail::all_reduce_segments(4096, 4, 4).temp, 4096);  // one segment
}

// ---------------------------------------------------------------------------------------------
// RaggedAllToAll

/// Row payload: rank `src`'s row `k` of its block for peer `dst`, element d.
double payload(int src, int dst, std::int64_t k, std::int64_t d) {
  return 1 + src * 1e6 + dst * 1e4 + double(k) * 10 + double(d);
}

/// Full traffic matrix M[i*P+j] (rows i sends to j), known to every rank.
using Pattern = std::function<std::int64_t(int i, int j)>;

void round_trip(Communicator const& c, Pattern const& counts, std::int64_t cap,
                std::int64_t D = 3) {
  int const P = c.size(), me = c.rank();
  Vec M(P * P);
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j) M[i * P + j] = counts(i, j);
  Vec const Mt = cap >= 0 ? moe::comm::truncate_matrix(M, P, cap) : M;
  Vec send_counts(M.begin() + me * P, M.begin() + (me + 1) * P);
  moe::comm::RaggedAllToAll const plan(c, send_counts, cap);

  // The plan is MaxText's parameters: dispatch of me, and rdispls = senders' output offsets.
  auto const p = cap >= 0 ? moe::comm::all_to_all_params_truncated(M, P, me, true, cap)
                          : moe::comm::all_to_all_params(M, P, me, true);
  EXPECT_EQ(plan.kept_send_counts(), p.send_sizes);
  EXPECT_EQ(plan.send_displs(), p.input_offsets);
  EXPECT_EQ(plan.recv_counts(), p.recv_sizes);
  for (int i = 0; i < P; ++i) {
    auto const pi = cap >= 0 ? moe::comm::all_to_all_params_truncated(M, P, i, true, cap)
                             : moe::comm::all_to_all_params(M, P, i, true);
    EXPECT_EQ(plan.recv_displs()[i], pi.output_offsets[me]);
  }
  std::int64_t kept_total = 0, recv_total = 0, dropped = 0;
  for (int j = 0; j < P; ++j) {
    kept_total += Mt[me * P + j];
    recv_total += Mt[j * P + me];
    dropped += M[me * P + j] - Mt[me * P + j];
  }
  EXPECT_EQ(plan.recv_total(), recv_total);
  EXPECT_EQ(plan.dropped_rows(), dropped);

  std::int64_t const rows = plan.send_extent();
  Kokkos::View<double**, Kokkos::LayoutRight, MS> send("send", rows + 2, D);
  auto sh = Kokkos::create_mirror_view(send);
  for (int j = 0; j < P; ++j)
    for (std::int64_t k = 0; k < M[me * P + j]; ++k)
      for (std::int64_t d = 0; d < D; ++d) sh(plan.send_displs()[j] + k, d) = payload(me, j, k, d);
  for (std::int64_t d = 0; d < D; ++d) sh(rows, d) = sh(rows + 1, d) = -5;  // unused tail
  Kokkos::deep_copy(send, sh);

  Kokkos::View<double**, Kokkos::LayoutRight, MS> recv("recv", recv_total + 3, D);
  Kokkos::deep_copy(recv, -7.0);  // garbage that must not survive
  plan.forward(Exec(), send, recv);
  auto const rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), recv);
  std::int64_t at = 0;
  for (int i = 0; i < P; ++i)
    for (std::int64_t k = 0; k < Mt[i * P + me]; ++k, ++at)
      for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(rh(at, d), payload(i, me, k, d));
  for (; at < recv_total + 3; ++at)
    for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(rh(at, d), 0.0);

  // Reverse: each received row, negated, goes back to the row it was sent from.
  Kokkos::View<double**, Kokkos::LayoutRight, MS> back("back", rows + 2, D);
  Kokkos::deep_copy(back, -9.0);
  Kokkos::parallel_for(
      "negate", Kokkos::RangePolicy<Exec>(0, recv.extent(0)), KOKKOS_LAMBDA(int r) {
        for (std::int64_t d = 0; d < D; ++d) recv(r, d) = -recv(r, d);
      });
  plan.reverse(Exec(), recv, back);
  auto const bh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), back);
  std::vector<bool> written(rows + 2, false);
  for (int j = 0; j < P; ++j)
    for (std::int64_t k = 0; k < M[me * P + j]; ++k) {
      std::int64_t const r = plan.send_displs()[j] + k;
      written[r] = true;
      bool const kept = k < Mt[me * P + j];
      for (std::int64_t d = 0; d < D; ++d)
        ASSERT_EQ(bh(r, d), kept ? -payload(me, j, k, d) : 0.0) << "row " << r << " peer " << j;
    }
  for (std::int64_t r = 0; r < rows + 2; ++r) {
    if (written[r]) continue;
    for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(bh(r, d), 0.0) << "row " << r;
  }
}

TEST(RaggedAllToAll, RoundTripSkewedCounts) {
  Communicator const c = world();
  int const P = c.size();
  with_both_paths([&] {
    round_trip(
        c, [](int i, int j) { return std::int64_t((3 * i + 5 * j + i * j) % 7); }, -1);
    round_trip(
        c, [](int, int j) { return j == 0 ? std::int64_t(9) : 0; }, -1);  // all to rank 0
    round_trip(
        c, [&](int, int j) { return j == P - 1 ? 0 : std::int64_t(j + 2); }, -1);
    round_trip(
        c, [](int i, int j) { return i == 0 ? 0 : std::int64_t(i + j + 1); }, -1);
    round_trip(
        c, [](int, int) { return std::int64_t(0); }, -1);  // zero rows overall
    round_trip(
        c, [](int i, int j) { return std::int64_t(i + j + 1); }, -1, 1);  // D = 1
  });
}

TEST(RaggedAllToAll, CappedBufferDropsExactlyTheTruncatedRows) {
  Communicator const c = world();
  with_both_paths([&] {
    auto const skew = [](int i, int j) { return std::int64_t((2 * i + 3 * j) % 5 + 1); };
    for (std::int64_t cap : {0, 1, 3, 5, 8, 100}) round_trip(c, skew, cap);
    round_trip(
        c, [](int, int j) { return j == 0 ? std::int64_t(4) : 0; }, 6);
  });
}

TEST(RaggedAllToAll, RowsOfAnyTrailingShape) {
  Communicator const c = world();
  int const P = c.size(), me = c.rank();
  Vec counts(P);
  for (int j = 0; j < P; ++j) counts[j] = (me + j) % 3;
  moe::comm::RaggedAllToAll const plan(c, counts);
  Kokkos::View<float***, Kokkos::LayoutRight, MS> send("send", plan.send_extent(), 2, 2);
  Kokkos::View<float***, Kokkos::LayoutRight, MS> recv("recv", plan.recv_total(), 2, 2);
  Kokkos::View<float***, Kokkos::LayoutRight, MS> back("back", plan.send_extent(), 2, 2);
  fill(send, me, 5);
  plan.forward(Exec(), send, recv);
  plan.reverse(Exec(), recv, back);
  EXPECT_TRUE(bitwise_equal(host(back), host(send)));
}

TEST(RaggedAllToAll, ExplicitDisplacementsReplicatedCombine) {
  // Replicated batch (§1.9 item 34): shard s sends its per_shard[s] rows to every peer; the
  // result is the all-gather of every shard's rows, at exclusive_cumsum(per_shard)[s].
  Communicator const c = world();
  int const P = c.size(), me = c.rank();
  Vec per_shard(P);
  for (int s = 0; s < P; ++s) per_shard[s] = 6 + s % 2;
  auto const p = moe::comm::all_to_all_params_replicated(per_shard, me);
  moe::comm::RaggedAllToAll const plan(c, p.send_sizes, p.input_offsets);
  EXPECT_EQ(plan.recv_counts(), p.recv_sizes);
  Kokkos::View<double**, Kokkos::LayoutRight, MS> mine("mine", per_shard[me], 2);
  fill(mine, me, 6);
  Kokkos::View<double**, Kokkos::LayoutRight, MS> all("all", plan.recv_total(), 2);
  plan.forward(Exec(), mine, all);
  auto const got = host(all);
  for (int s = 0; s < P; ++s) {
    auto const ps = moe::comm::all_to_all_params_replicated(per_shard, s);
    EXPECT_EQ(plan.recv_displs()[s], ps.output_offsets[me]);
    for (std::int64_t e = 0; e < per_shard[s] * 2; ++e)
      ASSERT_EQ(got[plan.recv_displs()[s] * 2 + e], value(s, e, 6));
  }
  // Overlapping blocks cannot be reversed when there is more than one peer.
  if (P > 1) {
    EXPECT_THROW(plan.reverse(Exec(), all, mine), moe::ShapeError);
  }
}

// ---------------------------------------------------------------------------------------------
// Collective errors: the same exception on every rank, no hang.

/// Checks that `what` is the same on every rank (by hashing; a mismatch throws).
void expect_same_everywhere(Communicator const& c, std::string const& what) {
  EXPECT_NO_THROW(moe::comm::check_agreement(c, "exception message", what));
}

TEST(CollectiveErrors, CheckAgreementNamesTheFirstDisagreeingRank) {
  Communicator const c = world();
  int const P = c.size();
  EXPECT_NO_THROW(moe::comm::check_agreement(c, "layer configuration", "num_experts=8"));
  std::string const mine = c.rank() == P - 1 ? "num_experts=6" : "num_experts=8";
  if (P == 1) {
    EXPECT_NO_THROW(moe::comm::check_agreement(c, "layer configuration", mine));
    return;
  }
  std::string msg;
  try {
    moe::comm::check_agreement(c, "layer configuration", mine);
    ADD_FAILURE() << "no exception";
  } catch (moe::ConfigError const& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rank " + std::to_string(P - 1) + " has \"num_experts=6\""), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("rank 0 has \"num_experts=8\""), std::string::npos) << msg;
  expect_same_everywhere(c, msg);
}

TEST(CollectiveErrors, AnyErrorRaisesTheLowestFailingRanksMessageEverywhere) {
  Communicator const c = world();
  int const P = c.size();
  EXPECT_NO_THROW(moe::comm::any_error(c, false, "fine"));
  int const lowest = P == 1 ? 0 : 1;  // ranks >= 1 fail (rank 0 too when alone)
  bool const fail = c.rank() >= lowest;
  std::string msg;
  try {
    moe::comm::any_error(c, fail,
                         "num_experts=" + std::to_string(6 + c.rank()) + " is not divisible",
                         moe::comm::ErrorKind::config);
    ADD_FAILURE() << "no exception";
  } catch (moe::ConfigError const& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "num_experts=" + std::to_string(6 + lowest) + " is not divisible [rank " +
                     std::to_string(lowest) + " of " + std::to_string(P) + "]");
  expect_same_everywhere(c, msg);

  // collective_guard keeps the type of the lowest failing rank's exception.
  try {
    moe::comm::collective_guard(c, [&] {
      if (c.rank() == P - 1) throw moe::ShapeError("x has the wrong shape");
    });
    ADD_FAILURE() << "no exception";
  } catch (moe::ShapeError const& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg.rfind("x has the wrong shape", 0), 0u) << msg;
  expect_same_everywhere(c, msg);
  EXPECT_NO_THROW(moe::comm::collective_guard(c, [] {}));
}

TEST(CollectiveErrors, BadShapesOnOneRankFailEverywhere) {
  Communicator const c = world();
  int const P = c.size(), me = c.rank();
  bool const odd_one = me == P - 1;
  auto const expect_shape_error = [&](std::function<void()> const& f) {
    std::string msg;
    try {
      f();
      ADD_FAILURE() << "no exception";
    } catch (moe::ShapeError const& e) {
      msg = e.what();
    }
    expect_same_everywhere(c, msg);
  };
  // all_gather with a different row count on the last rank.
  Kokkos::View<double**, Kokkos::LayoutRight, MS> in("in", odd_one ? 3 : 2, 2),
      out("out", P * 2, 2);
  if (P > 1) expect_shape_error([&] { moe::comm::all_gather(c, Exec(), in, out); });
  // reduce_scatter with an output that does not fit.
  Kokkos::View<double**, Kokkos::LayoutRight, MS> rs_in("rs_in", 2 * P, 2),
      rs_out("rs_out", odd_one ? 3 : 2, 2);
  expect_shape_error([&] { moe::comm::reduce_scatter(c, Exec(), rs_in, rs_out); });
  // all_reduce with a different length on the last rank.
  Kokkos::View<double*, MS> ar("ar", odd_one ? 5 : 4);
  if (P > 1) expect_shape_error([&] { moe::comm::all_reduce(c, Exec(), ar); });
  // A plan with the wrong number of counts on the last rank.
  expect_shape_error([&] { moe::comm::RaggedAllToAll const bad(c, Vec(odd_one ? P + 1 : P, 1)); });
  // Forward with a receive buffer that is too small on the last rank.
  moe::comm::RaggedAllToAll const plan(c, Vec(P, 2));
  Kokkos::View<double**, Kokkos::LayoutRight, MS> s("s", 2 * P, 4), r("r", odd_one ? 1 : 2 * P, 4);
  expect_shape_error([&] { plan.forward(Exec(), s, r); });
  // Forward with a different row length on the last rank.
  Kokkos::View<double**, Kokkos::LayoutRight, MS> s5("s5", 2 * P, odd_one ? 5 : 4),
      r5("r5", 2 * P, odd_one ? 5 : 4);
  if (P > 1) expect_shape_error([&] { plan.forward(Exec(), s5, r5); });
  // After all that, the communicator still works.
  Kokkos::View<double*, MS> ok("ok", 3);
  Kokkos::deep_copy(ok, 1.0);
  moe::comm::all_reduce(c, Exec(), ok);
  for (double x : host(ok)) EXPECT_EQ(x, double(P));
}

}  // namespace

TEST(CollectiveErrors, AFailedMpiCallIsACommErrorNotAnAbort) {
  // moe's communicators return MPI errors (MPI_ERRORS_RETURN): an invalid root is refused by
  // MPI's argument check on every rank and comes back as moe::CommError naming the call.
  Communicator const c = world();
  int v = 0;
  std::string msg;
  try {
    moe::comm::check_mpi(MPI_Bcast(&v, 1, MPI_INT, c.size() + 5, c.get()), "MPI_Bcast");
    ADD_FAILURE() << "no exception";
  } catch (moe::CommError const& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("MPI_Bcast failed on world rank"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MPI error code"), std::string::npos) << msg;
  // The user's communicator keeps its own handler.
  MPI_Errhandler h;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &h);
  EXPECT_EQ(h, MPI_ERRORS_ARE_FATAL);
  MPI_Errhandler_free(&h);
}
