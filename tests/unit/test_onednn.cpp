// The oneDNN backend's kernel choice (gmm::OneDnn, detail::onednn::Kernel):
//  * every chunk size of the packed mode gets a direct kernel, at the expert shapes where a 1x1
//    convolution's layout chosen at one chunk size used to fall back to oneDNN's reference
//    convolution at others (D=1024 / F=2816 both ways, the training default's 64 / 128);
//  * a forced weight layout no kernel accepts (a mismatch) is refused chunk by chunk and runs as
//    sgemm, on any CPU;
//  * a reference execution, should one ever happen, is counted and named by the warning the tools
//    print;
//  * the benchmarks' dense yardstick passes the scratchpad its user-mode descriptor asks for
//    (without it moe_bench read address 0 on every AVX-512 CPU).
// Results are checked against a double-precision reference. Every test process ends with a check
// that no reference implementation ran (OneDnnNoReference below), and the ISA tier runs
// (tests/CMakeLists.txt: ONEDNN_MAX_CPU_ISA from SSE41 to AVX512_CORE_AMX, at 1, 2 and 8 threads)
// skip with a message when the tier is above this CPU's.
#include "reference.hpp"

#include <moe/gmm/gmm.hpp>
#include <moe/moe_config.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#if MOE_HAS_ONEDNN
#include "bench_common.hpp"  // DenseYardstick, the benchmarks' dense GEMM
#endif

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

namespace moe_test {
/// Reference executions a test ran on purpose (the end-of-process check expects exactly these).
inline std::uint64_t& deliberate_reference_runs() {
  static std::uint64_t n = 0;
  return n;
}
}  // namespace moe_test

namespace {

using moe::gmm::GmmOptions;
using moe_ref::Rng;
using moe_ref::Vec;
using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;
using View2 = Kokkos::View<float**, Kokkos::LayoutRight, Mem>;
using View3 = Kokkos::View<float***, Kokkos::LayoutRight, Mem>;

/// At the end of every test process of this binary: no reference implementation ran, other than
/// the ones a test ran on purpose; prints what ran. Under MOE_ISA_TIER_TEST (the ISA tier runs),
/// skips every test when oneDNN does not run the tier ONEDNN_MAX_CPU_ISA asks for: the tier is
/// above this CPU's.
class OneDnnNoReference : public ::testing::Environment {
 public:
  void SetUp() override {
    char const* tier = std::getenv("ONEDNN_MAX_CPU_ISA");
    if (!std::getenv("MOE_ISA_TIER_TEST") || !tier) return;
    std::string want = tier;
    std::transform(want.begin(), want.end(), want.begin(),
                   [](unsigned char c) { return char(std::tolower(c)); });
    std::string const have = moe::gmm::onednn_stats().isa;
    if (!MOE_HAS_ONEDNN) GTEST_SKIP() << "moe: ISA tier skipped: moe was built without oneDNN";
    if (have != want)
      GTEST_SKIP() << "moe: ISA tier " << want << " skipped: above this CPU, whose oneDNN runs "
                   << have;
  }
  void TearDown() override {
    auto const st = moe::gmm::onednn_stats();
    if (std::getenv("MOE_ISA_TIER_TEST")) std::printf("oneDNN kernels: %s\n", st.summary().c_str());
    EXPECT_EQ(st.reference_runs, moe_test::deliberate_reference_runs()) << st.warning();
  }
};

[[maybe_unused]] auto* const no_reference =
    ::testing::AddGlobalTestEnvironment(new OneDnnNoReference);

#if MOE_HAS_ONEDNN

namespace dn = moe::detail::onednn;

/// Counter differences over a scope.
struct StatsDelta {
  moe::gmm::OneDnnStats before = moe::gmm::onednn_stats();
  std::uint64_t runs(moe::gmm::OneDnnStats const& now, std::string const& impl) const {
    auto const a = now.runs.count(impl) ? now.runs.at(impl) : 0;
    auto const b = before.runs.count(impl) ? before.runs.at(impl) : 0;
    return a - b;
  }
};

/// Sets the test hooks of detail::onednn::forced() for a scope.
struct ScopedForced {
  explicit ScopedForced(dn::Forced const& f) : saved(dn::forced()) { dn::forced() = f; }
  ~ScopedForced() { dn::forced() = saved; }
  dn::Forced saved;
};

/// matmul with weights forced into a layout no kernel takes (AB16b16a); `packed`: packed anyway,
/// so every chunk runs as sgemm on the weights in place (else the plan refuses and runs plain).
dn::Forced layout_without_a_kernel(bool packed) {
  dn::Forced f;
  if (packed) f.mode = dn::Forced::Mode::packed;
  f.any_family = false;
  f.family = dn::Family::matmul;
  f.layout = dnnl::memory::format_tag::AB16b16a;
  return f;
}

/// A grouped GEMM on random weights, checked against a double reference.
struct GmmCase {
  std::vector<std::int64_t> sizes;
  std::int64_t k, n;
  bool trans;
  std::int64_t m = 0;
  Vec x, w;  // x [m, k]; w [E, k, n] or [E, n, k]
  View2 lhs, out;
  View3 rhs;
  moe::gmm::Groups<Mem> groups;
  moe::gmm::PackCache cache;

  bool bf16 = false;       // inputs rounded to bf16 values and run with GmmOptions::bf16_inputs
  bool round_rhs = false;  // run with GmmOptions::round_rhs

  GmmCase(std::vector<std::int64_t> s, std::int64_t k_, std::int64_t n_, bool t, unsigned seed,
          bool bf16_inputs = false)
      : sizes(std::move(s)), k(k_), n(n_), trans(t), bf16(bf16_inputs) {
    for (auto v : sizes) m += v;
    Rng rng(seed);
    x = rng.vec(std::size_t(m * k), -1, 1);
    w = rng.vec(sizes.size() * std::size_t(k * n), -1, 1);
    if (bf16)
      for (Vec* v : {&x, &w})
        for (double& e : *v) e = moe::detail::round_to_bf16(e);
    std::size_t const E = sizes.size();
    lhs = moe_ref::kk::to_view<View2>(x, m, k);
    rhs = trans ? moe_ref::kk::to_view<View3>(w, E, n, k) : moe_ref::kk::to_view<View3>(w, E, k, n);
    out = View2("moe::test::onednn::out", m, n);
    groups = moe::gmm::make_groups<Mem>(sizes);
  }

  /// out (+)= x * W with the cache (packed mode where it has a kernel), version 1.
  void run(bool accumulate) {
    GmmOptions opt;
    opt.transpose_rhs = trans;
    opt.accumulate = accumulate;
    opt.pack_cache = &cache;
    opt.rhs_version = 1;
    opt.bf16_inputs = bf16;
    opt.round_rhs = round_rhs;
    Exec space;
    moe::gmm::gmm(space, moe::gmm::OneDnn{}, lhs, rhs, groups, out, opt);
    space.fence();
  }

  /// Rounds the weights to bf16 values (w and rhs).
  void round_weights() {
    for (double& e : w) e = moe::detail::round_to_bf16(e);
    std::size_t const E = sizes.size();
    rhs = trans ? moe_ref::kk::to_view<View3>(w, E, n, k) : moe_ref::kk::to_view<View3>(w, E, k, n);
  }

  /// run(false) then run(true), each checked (out = x * W, then 2 x (x * W)).
  ::testing::AssertionResult run_both(std::int64_t col_step) {
    run(false);
    if (auto r = check(1.0, col_step); !r) return r << " (overwriting)";
    run(true);
    if (auto r = check(2.0, col_step); !r) return r << " (accumulating)";
    return ::testing::AssertionSuccess();
  }

  /// Compares `times` x (x * W) with out on every row and every `col_step`-th column (and the
  /// last), in double; float error bound (k + 2) * eps * sum |terms|.
  ::testing::AssertionResult check(double times, std::int64_t col_step) const {
    auto const y = moe_ref::kk::to_vec(out);
    std::vector<std::int64_t> cols;
    for (std::int64_t j = 0; j < n; j += col_step) cols.push_back(j);
    if (cols.back() != n - 1) cols.push_back(n - 1);
    std::int64_t r0 = 0;
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      for (std::int64_t r = r0; r < r0 + sizes[g]; ++r)
        for (std::int64_t j : cols) {
          double sum = 0, mag = 0;
          for (std::int64_t c = 0; c < k; ++c) {
            double const b = trans ? w[(g * n + j) * k + c] : w[(g * k + c) * n + j];
            sum += x[r * k + c] * b;
            mag += std::fabs(x[r * k + c] * b);
          }
          double const got = y[r * n + j], want = times * sum;
          double const tol = times * (k + 2) * 1.2e-7 * mag + 1e-30;
          if (!(std::fabs(got - want) <= tol))
            return ::testing::AssertionFailure()
                   << "out[" << r << "," << j << "] = " << got << ", expected " << want
                   << " (group " << g << ", tolerance " << tol << ")";
        }
      r0 += sizes[g];
    }
    return ::testing::AssertionSuccess();
  }
};

struct Shape {
  std::int64_t k, n;
  bool trans;
  std::vector<std::int64_t> sizes;
  std::int64_t col_step;
};

void PrintTo(Shape const& s, std::ostream* os) {
  *os << "k=" << s.k << " n=" << s.n << (s.trans ? " transposed" : "") << ", " << s.sizes.size()
      << " groups";
}

std::string shape_name(::testing::TestParamInfo<Shape> const& i) {
  return "k" + std::to_string(i.param.k) + "_n" + std::to_string(i.param.n) +
         (i.param.trans ? "_transposed" : "");
}

class OneDnnChunks : public ::testing::TestWithParam<Shape> {};

// Every chunk size the groups produce (exact 1-15 rows, multiples of 16 up to 256) runs on a
// direct kernel over the one packed copy: nothing refused, nothing on a reference
// implementation, results right, overwriting and accumulating.
TEST_P(OneDnnChunks, EveryChunkSizeRunsOnADirectKernel) {
  Shape const& s = GetParam();
  GmmCase c(s.sizes, s.k, s.n, s.trans, 7);
  StatsDelta d;
  EXPECT_TRUE(c.run_both(s.col_step));
  auto const st = moe::gmm::onednn_stats();
  EXPECT_EQ(st.reference_runs - d.before.reference_runs, 0u) << st.warning();
  EXPECT_EQ(st.rejected - d.before.rejected, 0u)
      << "chunks ran plain for want of a kernel: "
      << (st.rejected_what.empty() ? "" : st.rejected_what.back()) << "; " << st.summary();
  EXPECT_EQ(c.cache.packs(), 1u) << "the weights were not packed (plain mode): " << st.summary();
  EXPECT_EQ(d.runs(st, "sgemm"), 0u) << st.summary();
}

std::vector<Shape> chunk_shapes() {
  // Groups giving the run sizes 1, 2, 3 (exact), 8, 16, 16, 32, 48, 80, 96, 128, 160, 200, 256
  // (the sizes seen to fall back at 1-56 threads) and a 256 + 45 group, whose last call runs 48
  // rows from a padded copy (its rows end lhs).
  std::vector<std::int64_t> const many{1, 2, 3, 5, 15, 16, 31, 48, 80, 96, 127, 160, 200, 256, 301};
  // D=1024, F=2816 (wi: k=D, n=F; wo and the transposed data gradient: k=F, n=D) on fewer
  // experts: 1, 3, 16, 96 and 256 + 80 rows.
  std::vector<std::int64_t> const big{1, 3, 16, 96, 336};
  return {{1024, 2816, false, big, 37}, {2816, 1024, false, big, 13}, {2816, 1024, true, big, 13},
          {64, 128, false, many, 1},    {128, 64, false, many, 1},    {128, 64, true, many, 1},
          {24, 40, false, many, 1}};
}

INSTANTIATE_TEST_SUITE_P(Shapes, OneDnnChunks, ::testing::ValuesIn(chunk_shapes()), shape_name);

// The row cap of a packed call: 256 on one thread, else a thread's even share of all rows
// (multiple of 16, 32 to 256); and one 256-row group at this process's thread count runs as that
// many calls, all on a direct kernel (before, it was one call: one thread busy, the rest idle).
TEST(OneDnnKernels, FewLargeGroupsGiveEveryThreadACall) {
  EXPECT_EQ(dn::chunk_cap(256, 1), 256);
  EXPECT_EQ(dn::chunk_cap(256, 2), 128);
  EXPECT_EQ(dn::chunk_cap(2048, 2), 256);
  EXPECT_EQ(dn::chunk_cap(2048, 16), 128);
  EXPECT_EQ(dn::chunk_cap(250, 3), 96);
  EXPECT_EQ(dn::chunk_cap(100, 8), 32);
  EXPECT_EQ(dn::chunk_rows(256, 96).rows, 96);
  EXPECT_EQ(dn::chunk_rows(64, 96).run, 64);
  // Calls run a multiple of 4 rows (fewer than 4 as they are), never a larger bucket.
  EXPECT_EQ(dn::chunk_rows(3, 96).run, 3);
  EXPECT_EQ(dn::chunk_rows(13, 96).run, 16);
  EXPECT_EQ(dn::chunk_rows(19, 96).run, 20);
  EXPECT_EQ(dn::chunk_rows(95, 96).run, 96);

  GmmCase c({256}, 128, 192, false, 11);
  c.run(false);  // packs the weights (a reorder run)
  StatsDelta d;  // the second run: the multiplies alone
  c.run(false);
  EXPECT_TRUE(c.check(1.0, 1));
  auto const st = moe::gmm::onednn_stats();
  EXPECT_EQ(c.cache.packs(), 1u) << "the weights were not packed (plain mode): " << st.summary();
  std::uint64_t calls = 0;
  for (auto const& [impl, n] : st.runs) calls += d.runs(st, impl);
  std::int64_t const cap = dn::chunk_cap(256, dn::max_threads());
  EXPECT_EQ(calls, std::uint64_t((256 + cap - 1) / cap))
      << dn::max_threads() << " threads, cap " << cap << ": " << st.summary();
  EXPECT_EQ(d.runs(st, "sgemm"), 0u) << st.summary();
}

// bf16 inputs (the bf16 layer's GEMMs): where oneDNN has bf16 kernels (AVX512-BF16, AMX) every
// packed call runs one on a bf16 pack of the weights; elsewhere the fp32 kernels run on the same
// values. Either way the result is the fp32 sum of exact products (a product of two bf16 values
// is exact in fp32), checked against double, overwriting and accumulating, at the layer's shapes
// both ways and on every chunk size.
TEST(OneDnnKernels, Bf16InputsRunBf16KernelsWhereTheCpuHasThem) {
  std::vector<std::int64_t> const many{1, 2, 3, 5, 15, 16, 31, 48, 80, 96, 127, 160, 200, 256, 301};
  std::vector<std::int64_t> const big{1, 3, 16, 96, 336};
  bool const native = dn::bf16_kernels();
  for (Shape const& s : std::vector<Shape>{
           {1024, 2816, false, big, 37}, {2816, 1024, true, big, 13}, {64, 128, false, many, 1}}) {
    SCOPED_TRACE("k=" + std::to_string(s.k) + " n=" + std::to_string(s.n) +
                 (s.trans ? " transposed" : ""));
    GmmCase c(s.sizes, s.k, s.n, s.trans, 9, true);
    StatsDelta d;
    EXPECT_TRUE(c.run_both(s.col_step));
    auto const st = moe::gmm::onednn_stats();
    std::uint64_t const bf16_calls = st.bf16_runs() - d.before.bf16_runs();
    EXPECT_EQ(c.cache.packs(), 1u) << st.summary();
    EXPECT_EQ(st.rejected - d.before.rejected, 0u) << st.summary();
    EXPECT_EQ(d.runs(st, "sgemm"), 0u) << st.summary();
    if (native)
      EXPECT_GT(bf16_calls, 0u) << "oneDNN " << st.isa << " has bf16 kernels: " << st.summary();
    else
      EXPECT_EQ(bf16_calls, 0u) << "oneDNN " << st.isa << " has no bf16 kernels: " << st.summary();
  }
}

// The weight gradient (tgmm) with bf16 inputs: one bf16 kernel call per non-empty group on bf16
// copies where the CPU has bf16 kernels (the rows padded to a multiple of tgmm_bf16_rows), sgemm
// elsewhere; fp32 results against double either way, overwriting and accumulating, with an empty
// group, groups of 1 and 31 rows (padded), and a group large enough to be split into column
// blocks on 2 or more threads (the sgemm path).
TEST(OneDnnKernels, Bf16WeightGradientRunsBf16KernelsWhereTheCpuHasThem) {
  std::vector<std::int64_t> const sizes{0, 1, 31, 96, 700};
  std::int64_t const k = 160, n = 288;
  std::int64_t m = 0;
  for (auto v : sizes) m += v;
  Rng rng(13);
  Vec x = rng.vec(std::size_t(m * k), -1, 1), dy = rng.vec(std::size_t(m * n), -1, 1);
  for (Vec* v : {&x, &dy})
    for (double& e : *v) e = moe::detail::round_to_bf16(e);
  auto const lhs = moe_ref::kk::to_view<View2>(x, m, k);
  auto const dyv = moe_ref::kk::to_view<View2>(dy, m, n);
  View3 out("moe::test::onednn::tgmm_out", sizes.size(), k, n);
  auto const groups = moe::gmm::make_groups<Mem>(sizes);
  StatsDelta d;
  for (bool accumulate : {false, true}) {
    GmmOptions opt;
    opt.accumulate = accumulate;
    opt.bf16_inputs = true;
    Exec space;
    moe::gmm::tgmm(space, moe::gmm::OneDnn{}, lhs, dyv, groups, out, opt);
    space.fence();
    auto const got = moe_ref::kk::to_vec(out);
    double const times = accumulate ? 2.0 : 1.0;
    std::int64_t r0 = 0;
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      for (std::int64_t c = 0; c < k; c += 7)
        for (std::int64_t j = 0; j < n; j += 5) {
          double sum = 0, mag = 0;
          for (std::int64_t r = r0; r < r0 + sizes[g]; ++r) {
            sum += x[r * k + c] * dy[r * n + j];
            mag += std::fabs(x[r * k + c] * dy[r * n + j]);
          }
          double const v = got[(g * k + c) * n + j];
          ASSERT_NEAR(v, times * sum, times * (sizes[g] + 2) * 1.2e-7 * mag + 1e-30)
              << "group " << g << " [" << c << "," << j << "], accumulate " << accumulate;
        }
      r0 += sizes[g];
    }
  }
  auto const st = moe::gmm::onednn_stats();
  std::uint64_t const bf16_calls = st.bf16_runs() - d.before.bf16_runs();
  EXPECT_EQ(st.rejected - d.before.rejected, 0u) << st.summary();
  if (dn::bf16_kernels()) {
    EXPECT_EQ(bf16_calls, 8u) << st.summary();  // 4 groups, twice
    EXPECT_EQ(d.runs(st, "sgemm"), 0u) << st.summary();
  } else {
    EXPECT_EQ(bf16_calls, 0u) << st.summary();
  }
}

// The bf16 copies the bf16 kernels read (dn::bf16_copy, plain and transposed: in blocks of 64
// rows; the transposed one in 8 x 8 register blocks with SSE2, edges element-wise): every element
// has the bits of dn's scalar rounding (round to nearest even; bf16_bits, tested bit-exactly on
// every class of value in test_bf16.cpp) of its source, the padding columns are zero, at sizes
// that end mid-block, on any CPU (the kernels that read them run only on bf16 CPUs). The sources
// mix uniform values with NaNs (payloads, both signs), infinities, signed zeros, subnormals, ties
// and a float that rounds up to infinity.
TEST(OneDnnKernels, Bf16CopiesRoundAndTransposeExactly) {
  Rng rng(5);
  float const special[] = {std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::quiet_NaN(),
                           moe::detail::bits_float(0x7f800001u),  // signalling NaN
                           moe::detail::bits_float(0xffa12345u),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           0.0f,
                           -0.0f,
                           std::numeric_limits<float>::denorm_min(),
                           -1.5e-39f,
                           1.0f + std::ldexp(1.0f, -8),      // a tie: down to 1 (even)
                           1.0f + 3 * std::ldexp(1.0f, -8),  // a tie: up (to even)
                           -(1.0f + std::ldexp(1.0f, -8)),
                           std::numeric_limits<float>::max()};  // rounds up to infinity
  for (auto [rows, cols] : {std::make_pair(1, 1), std::make_pair(70, 33), std::make_pair(129, 65),
                            std::make_pair(16, 24)})
    for (bool trans : {false, true}) {
      std::int64_t const ld = (trans ? rows : cols) + 3;  // a row stride past the last column
      std::int64_t const ldo = cols + 5;                  // the copy's padded rows
      std::vector<float> x(std::size_t((trans ? cols : rows) * ld));
      for (float& v : x)
        v = rng.uniform(0, 1) < 0.2 ? special[std::size_t(rng.uniform(0, 14)) % 14]
                                    : float(rng.uniform(-3, 3));
      std::vector<std::uint16_t> out(std::size_t(rows * ldo), 0xffff);
      dn::bf16_copy(trans, rows, cols, x.data(), ld, out.data(), ldo);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < ldo; ++c) {
          float const v = c >= cols ? 0.0f
                          : trans   ? x[std::size_t(c * ld + r)]
                                    : x[std::size_t(r * ld + c)];
          ASSERT_EQ(out[std::size_t(r * ldo + c)], moe::detail::bf16_bits(v))
              << rows << "x" << cols << (trans ? " transposed" : "") << " [" << r << "," << c
              << "] of " << v;
        }
    }
}

// The dense GEMM of the shared expert and the dense path (moe::detail::gemm) with bf16 inputs:
// oneDNN's bf16 kernels where the CPU has them, sgemm on the same values elsewhere; every
// transposition, overwriting and accumulating, fp32 results against double either way.
TEST(OneDnnKernels, Bf16DenseGemmRunsBf16KernelsWhereTheCpuHasThem) {
  std::int64_t const M = 70, N = 90;
  Rng rng(21);
  StatsDelta d;
  int calls = 0;
  // K = 128: an untransposed B is written in the kernels' blocked layout (dn::bf16_blocked, N
  // padded to 64 columns) where they take it; K = 130 is copied plain.
  for (std::int64_t const K : {130, 128})
    for (char const* ta : {"N", "T"})
      for (char const* tb : {"N", "T"})
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(std::string(ta) + tb + (accumulate ? " +=" : "") +
                       " K=" + std::to_string(K));
          bool const tA = ta[0] == 'T', tB = tb[0] == 'T';
          Vec a = rng.vec(std::size_t(M * K), -1, 1), b = rng.vec(std::size_t(K * N), -1, 1);
          Vec c = rng.vec(std::size_t(M * N), -1, 1);
          for (Vec* v : {&a, &b})
            for (double& e : *v) e = moe::detail::round_to_bf16(e);
          for (double& e : c) e = float(e);
          auto const A = moe_ref::kk::to_view<View2>(a, tA ? K : M, tA ? M : K);
          auto const B = moe_ref::kk::to_view<View2>(b, tB ? N : K, tB ? K : N);
          auto const C = moe_ref::kk::to_view<View2>(c, M, N);
          moe::detail::gemm(Exec(), ta, tb, 1.0f, A, B, accumulate ? 1.0f : 0.0f, C, true);
          ++calls;
          auto const got = moe_ref::kk::to_vec(C);
          for (std::int64_t i = 0; i < M; ++i)
            for (std::int64_t j = 0; j < N; ++j) {
              double sum = accumulate ? c[i * N + j] : 0.0, mag = std::fabs(sum);
              for (std::int64_t l = 0; l < K; ++l) {
                double const p =
                    (tA ? a[l * M + i] : a[i * K + l]) * (tB ? b[j * K + l] : b[l * N + j]);
                sum += p;
                mag += std::fabs(p);
              }
              ASSERT_NEAR(got[i * N + j], sum, (K + 2) * 1.2e-7 * mag + 1e-30) << i << "," << j;
            }
        }
  auto const st = moe::gmm::onednn_stats();
  std::uint64_t const bf16_calls = st.bf16_runs() - d.before.bf16_runs();
  if (dn::bf16_kernels()) {
    EXPECT_EQ(bf16_calls, std::uint64_t(calls)) << st.summary();
    EXPECT_EQ(d.runs(st, "sgemm"), 0u) << st.summary();
  } else {
    EXPECT_EQ(bf16_calls, 0u) << st.summary();
    EXPECT_EQ(d.runs(st, "sgemm"), std::uint64_t(calls)) << st.summary();
  }
}

// round_b (a layer's fp32 master weights as B, with no rounded copy of its own): the dense GEMM
// gives bit for bit the product of B rounded to bf16 first, on oneDNN's bf16 kernels (which round
// B as they copy it) and with MOE_BF16_KERNELS=off on sgemm over a rounded copy; every
// transposition, overwriting and accumulating, a bf16-stored A, alpha != 1 and K off the blocked
// layout. Also in double (Kokkos Kernels over a rounded copy).
TEST(OneDnnKernels, DenseGemmRoundBGivesTheBitsOfARoundedB) {
  std::int64_t const M = 20, N = 90;
  Rng rng(29);
  char const* was = std::getenv("MOE_BF16_KERNELS");
  std::string const saved = was ? was : "";
  for (char const* setting : {"on", "off"}) {
    ::setenv("MOE_BF16_KERNELS", setting, 1);
    for (std::int64_t const K : {130, 128})
      for (char const* ta : {"N", "T"})
        for (char const* tb : {"N", "T"})
          for (float const beta : {0.0f, 1.0f}) {
            SCOPED_TRACE(std::string("MOE_BF16_KERNELS=") + setting + " " + ta + tb +
                         (beta != 0.0f ? " +=" : "") + " K=" + std::to_string(K));
            bool const tA = ta[0] == 'T', tB = tb[0] == 'T';
            Vec a = rng.vec(std::size_t(M * K), -1, 1), b = rng.vec(std::size_t(K * N), -1, 1);
            Vec const c = rng.vec(std::size_t(M * N), -1, 1);
            for (double& e : a) e = moe::detail::round_to_bf16(e);
            Vec rb = b;
            for (double& e : rb) e = moe::detail::round_to_bf16(e);
            auto const A = moe_ref::kk::to_view<View2>(a, tA ? K : M, tA ? M : K);
            auto const masters = moe_ref::kk::to_view<View2>(b, tB ? N : K, tB ? K : N);
            auto const rounded = moe_ref::kk::to_view<View2>(rb, tB ? N : K, tB ? K : N);
            for (float const alpha : {1.0f, 0.5f}) {
              auto const got = moe_ref::kk::to_view<View2>(c, M, N);
              auto const want = moe_ref::kk::to_view<View2>(c, M, N);
              moe::detail::gemm(Exec(), ta, tb, alpha, A, masters, beta, got, true, true);
              moe::detail::gemm(Exec(), ta, tb, alpha, A, rounded, beta, want, true);
              EXPECT_EQ(moe_ref::kk::to_vec(got), moe_ref::kk::to_vec(want)) << "alpha " << alpha;
            }
            using B16 = Kokkos::View<moe::bf16**, Kokkos::LayoutRight, Mem>;
            B16 A16("a16", A.extent(0), A.extent(1));
            for (std::size_t i = 0; i < A.span(); ++i) A16.data()[i] = moe::bf16(A.data()[i]);
            auto const got = moe_ref::kk::to_view<View2>(c, M, N);
            auto const want = moe_ref::kk::to_view<View2>(c, M, N);
            moe::detail::gemm(Exec(), ta, tb, 1.0f, A16, masters, beta, got, true, true);
            moe::detail::gemm(Exec(), ta, tb, 1.0f, A16, rounded, beta, want, true);
            EXPECT_EQ(moe_ref::kk::to_vec(got), moe_ref::kk::to_vec(want)) << "bf16-stored A";
          }
  }
  if (was)
    ::setenv("MOE_BF16_KERNELS", saved.c_str(), 1);
  else
    ::unsetenv("MOE_BF16_KERNELS");
  using D2 = Kokkos::View<double**, Kokkos::LayoutRight, Mem>;
  Vec const a = rng.vec(std::size_t(M * 64), -1, 1), b = rng.vec(std::size_t(64 * N), -1, 1);
  Vec rb = b;
  for (double& e : rb) e = moe::detail::round_to_bf16(e);
  auto const A = moe_ref::kk::to_view<D2>(a, M, 64);
  D2 got("got", M, N), want("want", M, N);
  moe::detail::gemm(Exec(), "N", "N", 1.0, A, moe_ref::kk::to_view<D2>(b, 64, N), 0.0, got, true,
                    true);
  moe::detail::gemm(Exec(), "N", "N", 1.0, A, moe_ref::kk::to_view<D2>(rb, 64, N), 0.0, want);
  EXPECT_EQ(moe_ref::kk::to_vec(got), moe_ref::kk::to_vec(want)) << "double";
  EXPECT_NE(moe_ref::kk::to_vec(got), moe_ref::kk::to_vec([&] {
              D2 raw("raw", M, N);
              moe::detail::gemm(Exec(), "N", "N", 1.0, A, moe_ref::kk::to_view<D2>(b, 64, N), 0.0,
                                raw);
              return raw;
            }()))
      << "the unrounded product differs (the test can fail)";
}

// Where bf16 inputs take bf16 kernels: never without bf16 instructions; MOE_BF16_KERNELS on /
// off forces the choice; auto takes them with AMX, and without it where the CPU's VDPBF16PS
// runs at least 0.9 of VFMADD231PS's FLOP rate (measured; on an AMX Xeon capped to AVX512-BF16
// it runs 0.5); another value is refused naming it.
TEST(Bf16Kernels, WhereBf16InputsTakeBf16Kernels) {
  namespace d = moe::detail;
  EXPECT_FALSE(d::bf16_dot_pays(112e9, 226e9));
  EXPECT_TRUE(d::bf16_dot_pays(204e9, 226e9));
  EXPECT_TRUE(d::bf16_dot_pays(452e9, 226e9));
  EXPECT_TRUE(d::bf16_dot_pays(0, 226e9));  // not measurable here: as oneDNN's tier says
  char const* was = std::getenv("MOE_BF16_KERNELS");
  std::string const saved = was ? was : "";
  for (char const* v : {"on", "off", "auto"}) {
    SCOPED_TRACE(v);
    ::setenv("MOE_BF16_KERNELS", v, 1);
    for (bool amx : {false, true}) EXPECT_FALSE(d::use_bf16_kernels(false, amx));
    if (std::string(v) != "auto") {
      EXPECT_EQ(d::use_bf16_kernels(true, false), std::string(v) == "on");
      EXPECT_EQ(d::use_bf16_kernels(true, true), std::string(v) == "on");
    } else {
      EXPECT_TRUE(d::use_bf16_kernels(true, true));
#if defined(__x86_64__) && defined(__GNUC__)
      if (__builtin_cpu_supports("avx512bf16")) {
        double const dot = d::zmm_loop_flops(true), fma = d::zmm_loop_flops(false);
        std::printf("one thread: VDPBF16PS %.1f GFLOP/s, VFMADD231PS %.1f GFLOP/s (%.2f)\n",
                    dot * 1e-9, fma * 1e-9, dot / fma);
        EXPECT_GT(dot, 0.0);
        EXPECT_GT(fma, 0.0);
        EXPECT_EQ(d::use_bf16_kernels(true, false), d::bf16_dot_pays_here());
      }
#endif
    }
  }
  ::setenv("MOE_BF16_KERNELS", "sometimes", 1);
  try {
    d::use_bf16_kernels(true, false);
    ADD_FAILURE() << "MOE_BF16_KERNELS=sometimes was accepted";
  } catch (moe::ConfigError const& e) {
    EXPECT_NE(std::string(e.what()).find("MOE_BF16_KERNELS=sometimes is not one of auto, on, off"),
              std::string::npos)
        << e.what();
  }
  if (was)
    ::setenv("MOE_BF16_KERNELS", saved.c_str(), 1);
  else
    ::unsetenv("MOE_BF16_KERNELS");
}

// The dense GEMMs on operands stored as moe::bf16 (the shared expert's 16-bit hidden states):
// bit for bit the results of the same values held in floats with bf16 inputs, a bf16 C equal
// to the float C rounded once. Each way the shared expert calls it (h0 = x.w0 into bf16, a.wo
// and a^T.d_out reading bf16 A, x^T.d_h reading bf16 B, d_h.w^T accumulating into float), all
// four operands' storage combinations otherwise, and alpha != 1 (float copies on any CPU).
TEST(OneDnnKernels, Bf16StoredDenseGemmGivesTheFloatOperandsBits) {
  using B16 = Kokkos::View<moe::bf16**, Kokkos::LayoutRight, Mem>;
  std::int64_t const M = 70, N = 90, K = 128;
  Rng rng(23);
  auto narrow = [](View2 const& v) {
    B16 b("b16", v.extent(0), v.extent(1));
    for (std::size_t i = 0; i < v.span(); ++i) b.data()[i] = moe::bf16(v.data()[i]);
    return b;
  };
  auto bits = [](float x) { return moe::detail::bf16_bits(x); };
  StatsDelta d;
  int bf16_calls = 0;
  for (int stored = 1; stored < 8; ++stored)  // bit 0: A, bit 1: B, bit 2: C stored as bf16
    for (char const* ta : {"N", "T"})
      for (char const* tb : {"N", "T"})
        for (float alpha : {1.0f, 0.5f})
          for (bool accumulate : {false, true}) {
            bool const a16 = stored & 1, b16 = stored & 2, c16 = stored & 4;
            if (c16 && accumulate) continue;  // the layer never accumulates into bf16
            SCOPED_TRACE(std::string(ta) + tb + " stored " + std::to_string(stored) + " alpha " +
                         std::to_string(alpha) + (accumulate ? " +=" : ""));
            bool const tA = ta[0] == 'T', tB = tb[0] == 'T';
            Vec a = rng.vec(std::size_t(M * K), -1, 1), b = rng.vec(std::size_t(K * N), -1, 1);
            Vec c = rng.vec(std::size_t(M * N), -1, 1);
            for (Vec* v : {&a, &b})
              for (double& e : *v) e = moe::detail::round_to_bf16(e);
            auto const A = moe_ref::kk::to_view<View2>(a, tA ? K : M, tA ? M : K);
            auto const B = moe_ref::kk::to_view<View2>(b, tB ? N : K, tB ? K : N);
            auto const C = moe_ref::kk::to_view<View2>(c, M, N);
            auto const C2 = moe_ref::kk::to_view<View2>(c, M, N);
            float const beta = accumulate ? 1.0f : 0.0f;
            moe::detail::gemm(Exec(), ta, tb, alpha, A, B, beta, C, true);  // floats
            auto const A16 = narrow(A), B16v = narrow(B), C16 = narrow(C2);
            auto run = [&](auto const& x, auto const& y) {
              if (c16)
                moe::detail::gemm(Exec(), ta, tb, alpha, x, y, beta, C16, true);
              else
                moe::detail::gemm(Exec(), ta, tb, alpha, x, y, beta, C2, true);
            };
            if (a16 && b16)
              run(A16, B16v);
            else if (a16)
              run(A16, B);
            else if (b16)
              run(A, B16v);
            else
              run(A, B);
            bf16_calls += alpha == 1.0f ? 2 : 0;
            Exec().fence();
            for (std::int64_t i = 0; i < M * N; ++i) {
              float const want = C.data()[i];
              if (c16)
                ASSERT_EQ(C16.data()[i].bits, bits(want)) << "element " << i << ": " << want;
              else
                ASSERT_EQ(C2.data()[i], want) << "element " << i;
            }
          }
  auto const st = moe::gmm::onednn_stats();
  EXPECT_EQ(st.bf16_runs() - d.before.bf16_runs(),
            std::uint64_t(dn::bf16_kernels() ? bf16_calls : 0))
      << st.summary();
}

// The cap splits a group by the thread count, the result does not depend on it: the same group
// on 1, 2, 3 and 8 threads (one 256-row call; 2 x 128; 96 + 96 + 64; 8 x 32) gives the same
// bits, at the layer's shapes (wi: k=D=1024, n=F; wo: k=F=2816, n=D).
TEST(OneDnnKernels, ResultsDoNotDependOnTheThreadCount) {
  for (auto [k, n] : {std::make_pair(1024, 352), std::make_pair(2816, 128)}) {
    SCOPED_TRACE("k=" + std::to_string(k) + " n=" + std::to_string(n));
    Vec one;
    for (int threads : {1, 2, 3, 8}) {
      moe_ref::kk::ScopedThreads scoped(threads);
      GmmCase c({256}, k, n, false, 5);
      c.run(false);
      auto const y = moe_ref::kk::to_vec(c.out);
      if (threads == 1)
        one = y;
      else
        EXPECT_TRUE(y == one) << threads << " threads (cap " << dn::chunk_cap(256, threads)
                              << ") differ from 1 thread";
    }
  }
}

// A packed layout no kernel accepts, forced on each family (and the probe's check skipped, as a
// layout picked for other rows or threads would have passed it): every chunk's kernel is refused
// and runs as sgemm on the weights in place. Proves the per-chunk check on any CPU.
TEST(OneDnnKernels, ForcedLayoutMismatchIsRefusedChunkByChunk) {
  for (auto [family, layout] :
       {std::make_pair(dn::Family::matmul, dnnl::memory::format_tag::AB16b16a),
        std::make_pair(dn::Family::conv, dnnl::memory::format_tag::OIhw16o16i)}) {
    SCOPED_TRACE(dn::family_name(family));
    dn::Forced f;
    f.mode = dn::Forced::Mode::packed;
    f.any_family = false;
    f.family = family;
    f.layout = layout;
    ScopedForced forced(f);
    GmmCase c({1, 3, 16, 40, 0, 21}, 24, 40, false, 3);
    StatsDelta d;
    c.run(false);
    EXPECT_TRUE(c.check(1.0, 1));
    c.run(true);
    EXPECT_TRUE(c.check(2.0, 1));
    auto const st = moe::gmm::onednn_stats();
    EXPECT_EQ(st.reference_runs - d.before.reference_runs, 0u) << st.warning();
    EXPECT_EQ(c.cache.packs(), 1u) << "the forced layout was packed";
    // Run sizes 1, 3, 16, 40 (32 + 8 where the cap is 32) and 24 (the 21-row group rounds up
    // past lhs's end), each once overwriting and once accumulating where exact.
    EXPECT_GE(st.rejected - d.before.rejected, 4u) << st.summary();
    EXPECT_GE(d.runs(st, "sgemm"), 10u) << "every chunk ran as sgemm: " << st.summary();
    ASSERT_FALSE(st.rejected_what.empty());
  }
}

// GmmOptions::round_rhs on the packed mode's paths that read the weights in place: a chunk with
// no kernel (a forced layout no kernel accepts) runs as sgemm on a rounded copy of the weights
// made for the call, and gives the bits of the weights rounded first, overwriting and accumulating,
// on both weight layouts; and an fp32 pack made for round_rhs is kept apart from the unrounded pack
// of the same tensor and version (the second call packs again and gives the unrounded product).
TEST(OneDnnKernels, RoundRhsRoundsTheWeightsOnEveryPackedPath) {
  for (bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "transposed" : "plain");
    {
      ScopedForced forced(layout_without_a_kernel(true));
      StatsDelta d;
      GmmCase masters({1, 3, 16, 40, 0, 21}, 24, 40, trans, 3),
          rounded({1, 3, 16, 40, 0, 21}, 24, 40, trans, 3);
      masters.round_rhs = true;
      rounded.round_weights();
      for (bool acc : {false, true}) {
        masters.run(acc);
        rounded.run(acc);
        EXPECT_EQ(moe_ref::kk::to_vec(masters.out), moe_ref::kk::to_vec(rounded.out))
            << "a chunk without a kernel, " << (acc ? "accumulating" : "overwriting");
      }
      EXPECT_GE(d.runs(moe::gmm::onednn_stats(), "sgemm"), 20u)
          << "every chunk ran as sgemm: " << moe::gmm::onednn_stats().summary();
    }
    GmmCase c({5, 0, 17, 40}, 24, 48, trans, 4);
    c.round_rhs = true;
    c.run(false);
    std::uint64_t const packs = c.cache.packs();
    c.round_rhs = false;
    EXPECT_TRUE(c.run_both(1)) << "after a rounded pack of the same tensor and version";
    if (packs > 0) {
      EXPECT_EQ(c.cache.packs(), packs + 1) << "the unrounded weights packed apart";
    }
  }
}

// gmm_sum into 16-bit rows where oneDNN's packed mode has no kernel for a chunk (a forced layout
// mismatch: both products of every chunk run as sgemm into the chunk's float sum): the bits of
// gmm, then gmm with accumulate into float rows, rounded after; on both weight layouts, with
// round_rhs (the rounded copies such chunks multiply).
TEST(OneDnnKernels, GmmSumIntoBf16RowsOnChunksWithoutAKernel) {
  for (bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "transposed" : "plain");
    ScopedForced forced(layout_without_a_kernel(true));
    StatsDelta d;
    std::vector<std::int64_t> const sizes{1, 3, 16, 40, 0, 21};
    GmmCase a(sizes, 24, 40, trans, 3, true), b(sizes, 24, 40, trans, 5, true);
    a.round_rhs = true;
    a.run(false);
    GmmOptions opt;
    opt.transpose_rhs = trans;
    opt.accumulate = true;
    opt.bf16_inputs = opt.round_rhs = true;
    Exec space;
    moe::gmm::gmm(space, moe::gmm::OneDnn{}, b.lhs, b.rhs, a.groups, a.out, opt);
    space.fence();
    Vec want = moe_ref::kk::to_vec(a.out);
    for (double& e : want) e = moe::detail::round_to_bf16(e);
    Kokkos::View<moe::bf16**, Kokkos::LayoutRight, Mem> out16("moe::test::onednn::out16", a.m, a.n);
    opt.accumulate = false;
    opt.bf16_output = true;
    opt.pack_cache = &a.cache;
    opt.rhs_version = 1;
    moe::gmm::gmm_sum(space, moe::gmm::OneDnn{}, a.lhs, a.rhs, b.lhs, b.rhs, a.groups, out16, opt);
    space.fence();
    auto const h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), out16);
    Vec got(want.size());
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = float(h.data()[i]);
    EXPECT_EQ(got, want);
    EXPECT_GE(d.runs(moe::gmm::onednn_stats(), "sgemm"), 20u)
        << "every chunk ran as sgemm: " << moe::gmm::onednn_stats().summary();
  }
}

// The same layout without the forced mode: the plan's probe refuses it and the shape runs plain.
TEST(OneDnnKernels, ForcedLayoutWithoutAKernelIsRefusedAtThePlan) {
  ScopedForced forced(layout_without_a_kernel(false));
  GmmCase c({5, 0, 17, 40}, 24, 48, true, 4);
  StatsDelta d;
  c.run(false);
  EXPECT_TRUE(c.check(1.0, 1));
  auto const st = moe::gmm::onednn_stats();
  EXPECT_EQ(c.cache.packs(), 0u) << "plain mode packs nothing";
  EXPECT_GE(st.rejected - d.before.rejected, 1u) << st.summary();
  EXPECT_EQ(st.reference_runs - d.before.reference_runs, 0u) << st.warning();
}

// Should a reference implementation ever run, it is counted and the warning the tools print names
// the operation and its shape.
TEST(OneDnnKernels, AReferenceExecutionIsCountedAndNamed) {
  std::int64_t const rows = 4, k = 24, n = 40;
  auto const w = dn::tagged_weights(dn::Family::matmul, k, n, dnnl::memory::format_tag::AB16b16a);
  auto kernel = dn::with_pd(dn::Family::matmul, rows, k, n, k, n, w, false, [&](auto const& pd) {
    return std::make_unique<dn::Kernel>(pd, dn::kernel_what(dn::Family::matmul, rows, k, n, false));
  });
  if (!dn::reference_impl(kernel->impl()))
    GTEST_SKIP() << "this oneDNN has a kernel for the AB16b16a layout: " << kernel->impl();
  Rng rng(9);
  Vec const a = rng.vec(std::size_t(rows * k), -1, 1), b = rng.vec(std::size_t(k * n), -1, 1);
  std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), cf(std::size_t(rows * n));
  dnnl::memory user(dn::weights_desc(dn::Family::matmul, k, n, false, n), dn::engine(), bf.data());
  dnnl::memory packed(w, dn::engine());
  dn::Kernel(dnnl::reorder::primitive_desc(dn::engine(), user.get_desc(), dn::engine(), w), "pack")
      .run({{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, packed}});
  StatsDelta d;
  kernel->run({{DNNL_ARG_SRC, dnnl::memory(dn::matrix_desc(rows, k, k), dn::engine(), af.data())},
               {DNNL_ARG_WEIGHTS, packed},
               {DNNL_ARG_DST, dnnl::memory(dn::matrix_desc(rows, n, n), dn::engine(), cf.data())}});
  ++moe_test::deliberate_reference_runs();
  auto const st = moe::gmm::onednn_stats();
  EXPECT_EQ(st.reference_runs - d.before.reference_runs, 1u);
  EXPECT_NE(st.warning().find("matmul 4x24x40"), std::string::npos) << st.warning();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (std::int64_t c = 0; c < k; ++c) want += a[r * k + c] * b[c * n + j];
      EXPECT_NEAR(cf[r * n + j], want, 1e-5) << r << "," << j;
    }
}

// Regression: the benchmarks' dense yardstick ran a user-scratchpad primitive without its
// scratchpad, which read address 0 on every AVX-512 CPU (moe_bench's SIGSEGV). It now runs
// through Kernel and computes C = A * B.
TEST(OneDnnKernels, DenseYardstickRunsWithItsScratchpad) {
  for (auto [M, K, N] : {std::make_tuple(64, 64, 128), std::make_tuple(200, 96, 48)}) {
    moe::bench::DenseYardstick y(M, K, N);
    y.run();
    Exec().fence();
    Vec const a = moe_ref::kk::to_vec(y.a()), b = moe_ref::kk::to_vec(y.b());
    Vec const c = moe_ref::kk::to_vec(y.c());
    Vec want(std::size_t(M * N), 0.0);
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < N; ++j)
        for (int i = 0; i < K; ++i) want[r * N + j] += a[r * K + i] * b[i * N + j];
    EXPECT_TRUE(moe_ref::kk::close(c, want, 1e-5)) << y.backend();
  }
}

#endif  // MOE_HAS_ONEDNN

}  // namespace
