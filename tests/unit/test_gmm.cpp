// Grouped GEMM (moe::gmm::gmm / tgmm) against a double-precision triple loop, for every policy in
// float and double. Inputs are multiples of 1/64 in [-1, 1], exact in float, so the only error is
// the policy's own rounding, bounded by (k + 2) * eps * sum |a| |b| per output element.
// OneDnn runs three times: as it chooses on this CPU, and forced into each of its two modes
// (OneDnnPacked, OneDnnPlain below); the packed mode's weight cache is also tested for staleness.
#include "reference.hpp"

#include <moe/bf16.hpp>
#include <moe/gmm/gmm.hpp>
#include <moe/moe_config.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

/// Test policies: OneDnn forced into its packed-weight mode (convolution primitives on weights
/// reordered once and cached) or its plain mode (sgemm and the few-rows kernel on the weights in
/// place), so both run whatever this CPU's oneDNN would choose. Defined the way a new backend
/// would be: a tag, the traits, an Impl.
template <bool Packed>
struct OneDnnForced {};
using OneDnnPacked = OneDnnForced<true>;
using OneDnnPlain = OneDnnForced<false>;
template <bool P>
struct moe::gmm::is_policy<OneDnnForced<P>> : std::true_type {};
template <bool P>
struct moe::gmm::handles_bf16<OneDnnForced<P>> : moe::gmm::handles_bf16<moe::gmm::OneDnn> {};
template <bool P>
struct moe::gmm::rounds_rhs<OneDnnForced<P>> : moe::gmm::rounds_rhs<moe::gmm::OneDnn> {};
template <bool P, class E, class S>
struct moe::gmm::is_available<OneDnnForced<P>, E, S>
    : moe::gmm::is_available<moe::gmm::OneDnn, E, S> {};
template <bool P>
struct moe::gmm::detail::Impl<OneDnnForced<P>> {
  template <class... A>
  static void gmm(A const&... a) {
    moe_ref::kk::ForceOneDnnMode mode(P);
    Impl<moe::gmm::OneDnn>::gmm(a...);
  }
  template <class... A>
  static void tgmm(A const&... a) {
    moe_ref::kk::ForceOneDnnMode mode(P);
    Impl<moe::gmm::OneDnn>::tgmm(a...);
  }
};

namespace {

using moe::gmm::Dense;
using moe::gmm::GmmOptions;
using moe::gmm::OneDnn;
using moe::gmm::Tiled;
using moe::gmm::Vendor;
using Exec = Kokkos::DefaultExecutionSpace;
using Mem = Exec::memory_space;

template <class S>
using View2 = Kokkos::View<S**, Kokkos::LayoutRight, Mem>;
template <class S>
using View3 = Kokkos::View<S***, Kokkos::LayoutRight, Mem>;

std::vector<double> random_values(std::size_t count, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-64, 64);
  std::vector<double> v(count);
  for (auto& x : v) x = dist(gen) / 64.0;
  return v;
}

std::vector<int64_t> offsets_of(std::vector<int64_t> const& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (std::size_t g = 0; g < sizes.size(); ++g) off[g + 1] = off[g] + sizes[g];
  return off;
}

/// A gmm or tgmm problem in double; the reference and the bound are computed in the test.
struct Problem {
  std::vector<int64_t> sizes;  // all G groups
  int64_t m = 0, k = 0, n = 0;
  int num_local = 0;
  GmmOptions opt;
  std::vector<double> lhs;  // [m, k]
  std::vector<double> rhs;  // gmm: [G_local, k, n] or [G_local, n, k]; tgmm: dy [m, n]
  std::vector<double> out;  // initial output (garbage unless accumulate makes it meaningful)
};

Problem make_gmm_problem(std::vector<int64_t> sizes, int64_t m, int64_t k, int64_t n, int num_local,
                         GmmOptions opt, unsigned seed = 1) {
  Problem p;
  p.sizes = std::move(sizes);
  p.m = m, p.k = k, p.n = n, p.num_local = num_local, p.opt = opt;
  p.lhs = random_values(m * k, seed);
  p.rhs = random_values(num_local * k * n, seed + 1);
  p.out = random_values(m * n, seed + 2);
  return p;
}

Problem make_tgmm_problem(std::vector<int64_t> sizes, int64_t m, int64_t k, int64_t n,
                          int num_local, GmmOptions opt, unsigned seed = 1) {
  Problem p;
  p.sizes = std::move(sizes);
  p.m = m, p.k = k, p.n = n, p.num_local = num_local, p.opt = opt;
  p.lhs = random_values(m * k, seed);
  p.rhs = random_values(m * n, seed + 1);
  p.out = random_values(num_local * k * n, seed + 2);
  return p;
}

/// Expected output and the per-element error scale sum |terms| (0 where the value must be exact).
struct Expected {
  std::vector<double> value;
  std::vector<double> scale;
  int64_t depth = 0;  // length of the contraction
};

Expected reference_gmm(Problem const& p) {
  auto const off = offsets_of(p.sizes);
  Expected e;
  e.depth = p.k;
  e.value.assign(p.m * p.n, 0.0);
  e.scale.assign(p.m * p.n, 0.0);
  if (p.opt.accumulate) e.value = p.out;
  for (int g = 0; g < p.num_local; ++g) {
    int const group = p.opt.group_offset + g;
    for (int64_t r = off[group]; r < off[group + 1]; ++r)
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0, abs_sum = 0;
        for (int64_t c = 0; c < p.k; ++c) {
          double const b =
              p.opt.transpose_rhs ? p.rhs[(g * p.n + j) * p.k + c] : p.rhs[(g * p.k + c) * p.n + j];
          sum += p.lhs[r * p.k + c] * b;
          abs_sum += std::abs(p.lhs[r * p.k + c] * b);
        }
        double& v = e.value[r * p.n + j];
        e.scale[r * p.n + j] = abs_sum + (p.opt.accumulate ? std::abs(v) : 0.0);
        v = p.opt.accumulate ? v + sum : sum;
      }
  }
  return e;
}

Expected reference_tgmm(Problem const& p) {
  auto const off = offsets_of(p.sizes);
  Expected e;
  e.value.assign(p.num_local * p.k * p.n, 0.0);
  e.scale.assign(p.num_local * p.k * p.n, 0.0);
  if (p.opt.accumulate) e.value = p.out;
  for (int g = 0; g < p.num_local; ++g) {
    int const group = p.opt.group_offset + g;
    e.depth = std::max<int64_t>(e.depth, off[group + 1] - off[group]);
    for (int64_t c = 0; c < p.k; ++c)
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0, abs_sum = 0;
        for (int64_t r = off[group]; r < off[group + 1]; ++r) {
          sum += p.lhs[r * p.k + c] * p.rhs[r * p.n + j];
          abs_sum += std::abs(p.lhs[r * p.k + c] * p.rhs[r * p.n + j]);
        }
        std::size_t const idx = (g * p.k + c) * p.n + j;
        e.scale[idx] = abs_sum + (p.opt.accumulate ? std::abs(e.value[idx]) : 0.0);
        e.value[idx] = p.opt.accumulate ? e.value[idx] + sum : sum;
      }
  }
  return e;
}

template <class ViewT>
ViewT to_device(std::string const& label, std::vector<double> const& v, std::size_t n0,
                std::size_t n1, std::size_t n2 = 0) {
  ViewT d;
  if constexpr (ViewT::rank == 2)
    d = ViewT(label, n0, n1);
  else
    d = ViewT(label, n0, n1, n2);
  auto h = Kokkos::create_mirror_view(d);
  auto* p = h.data();
  for (std::size_t i = 0; i < v.size(); ++i) p[i] = static_cast<typename ViewT::value_type>(v[i]);
  Kokkos::deep_copy(d, h);
  return d;
}

template <class ViewT>
std::vector<double> to_host(ViewT const& d) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
  std::vector<double> v(h.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    auto const x = h.data()[i];
    if constexpr (std::is_same<decltype(x), moe::bf16 const>::value)
      v[i] = double(float(x));
    else
      v[i] = double(x);
  }
  return v;
}

template <class S>
void expect_close(std::vector<double> const& got, Expected const& e, std::string const& what) {
  ASSERT_EQ(got.size(), e.value.size()) << what;
  double const eps = std::numeric_limits<S>::epsilon();
  int failures = 0;
  for (std::size_t i = 0; i < got.size() && failures < 10; ++i) {
    double const tol = (e.depth + 2) * eps * e.scale[i];
    if (!(std::abs(got[i] - e.value[i]) <= tol)) {
      ++failures;
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << e.value[i]
                    << " (tolerance " << tol << ")";
    }
  }
}

/// p's rhs on the device: [G_local, k, n], or [G_local, n, k] with transpose_rhs.
template <class S>
View3<S> rhs_view(Problem const& p) {
  return p.opt.transpose_rhs
             ? to_device<View3<S>>("moe::gmm::test::rhs", p.rhs, p.num_local, p.n, p.k)
             : to_device<View3<S>>("moe::gmm::test::rhs", p.rhs, p.num_local, p.k, p.n);
}

/// gmm with lhs stored as TL and out as TO (S or moe::bf16); the result as doubles.
template <class Policy, class S, class TL = S, class TO = S>
std::vector<double> run_gmm(Problem const& p, bool default_instance = false) {
  auto lhs = to_device<View2<TL>>("moe::gmm::test::lhs", p.lhs, p.m, p.k);
  auto rhs = rhs_view<S>(p);
  auto out = to_device<View2<TO>>("moe::gmm::test::out", p.out, p.m, p.n);
  auto groups = moe::gmm::make_groups<Mem>(p.sizes);
  if (default_instance) {
    moe::gmm::gmm(Policy{}, lhs, rhs, groups, out, p.opt);
  } else {
    Exec space;
    moe::gmm::gmm(space, Policy{}, lhs, rhs, groups, out, p.opt);
    space.fence();
  }
  return to_host(out);
}

/// gmm_sum of a's product and b's (b: the second lhs and rhs; a's groups, out and options), the
/// lhs stored as TL and out as TO.
template <class Policy, class S, class TL = S, class TO = S>
std::vector<double> run_gmm_sum(Problem const& a, Problem const& b) {
  auto lhs_a = to_device<View2<TL>>("moe::gmm::test::lhs_a", a.lhs, a.m, a.k);
  auto lhs_b = to_device<View2<TL>>("moe::gmm::test::lhs_b", b.lhs, b.m, b.k);
  auto rhs_a = rhs_view<S>(a), rhs_b = rhs_view<S>(b);
  auto out = to_device<View2<TO>>("moe::gmm::test::out", a.out, a.m, a.n);
  auto groups = moe::gmm::make_groups<Mem>(a.sizes);
  Exec space;
  moe::gmm::gmm_sum(space, Policy{}, lhs_a, rhs_a, lhs_b, rhs_b, groups, out, a.opt);
  space.fence();
  return to_host(out);
}

/// tgmm with lhs stored as TL and dy as TD (S or moe::bf16).
template <class Policy, class S, class TL = S, class TD = S>
std::vector<double> run_tgmm(Problem const& p, bool default_instance = false) {
  auto lhs = to_device<View2<TL>>("moe::gmm::test::lhs", p.lhs, p.m, p.k);
  auto dy = to_device<View2<TD>>("moe::gmm::test::dy", p.rhs, p.m, p.n);
  auto out = to_device<View3<S>>("moe::gmm::test::out", p.out, p.num_local, p.k, p.n);
  Exec space;
  auto groups = moe::gmm::make_groups(space, p.sizes);
  if (default_instance) {
    space.fence();
    moe::gmm::tgmm(Policy{}, lhs, dy, groups, out, p.opt);
  } else {
    moe::gmm::tgmm(space, Policy{}, lhs, dy, groups, out, p.opt);
    space.fence();
  }
  return to_host(out);
}

template <class P, class S>
struct Case {
  using Policy = P;
  using Scalar = S;
};

template <class T>
std::string policy_name();
template <>
std::string policy_name<Vendor>() {
  return "Vendor";
}
template <>
std::string policy_name<Dense>() {
  return "Dense";
}
template <>
std::string policy_name<OneDnn>() {
  return "OneDnn";
}
template <>
std::string policy_name<OneDnnPacked>() {
  return "OneDnnPacked";
}
template <>
std::string policy_name<OneDnnPlain>() {
  return "OneDnnPlain";
}
template <int TM, int TK, int TN>
struct TiledName {
  static std::string get() {
    return "Tiled" + std::to_string(TM) + "x" + std::to_string(TK) + "x" + std::to_string(TN);
  }
};

template <class T>
struct PolicyName {
  static std::string get() { return policy_name<T>(); }
};
template <int TM, int TK, int TN>
struct PolicyName<Tiled<TM, TK, TN>> : TiledName<TM, TK, TN> {};

struct CaseNames {
  template <class T>
  static std::string GetName(int) {
    return PolicyName<typename T::Policy>::get() +
           (std::is_same<typename T::Scalar, float>::value ? "_float" : "_double");
  }
};

template <class T>
class Gmm : public ::testing::Test {
 protected:
  using Policy = typename T::Policy;
  using S = typename T::Scalar;

  void check_gmm(Problem const& p, std::string const& what, bool default_instance = false) {
    expect_close<S>(run_gmm<Policy, S>(p, default_instance), reference_gmm(p), what);
  }
  void check_tgmm(Problem const& p, std::string const& what, bool default_instance = false) {
    expect_close<S>(run_tgmm<Policy, S>(p, default_instance), reference_tgmm(p), what);
  }
};

using Cases = ::testing::Types<Case<OneDnn, float>, Case<OneDnn, double>, Case<OneDnnPacked, float>,
                               Case<OneDnnPlain, float>, Case<Vendor, float>, Case<Vendor, double>,
                               Case<Dense, float>, Case<Dense, double>, Case<Tiled<4, 8, 4>, float>,
                               Case<Tiled<4, 8, 4>, double>, Case<Tiled<32, 32, 32>, float>,
                               Case<Tiled<32, 32, 32>, double>, Case<Tiled<5, 3, 7>, float>,
                               Case<Tiled<5, 3, 7>, double>, Case<Tiled<64, 64, 64>, float>>;
TYPED_TEST_SUITE(Gmm, Cases, CaseNames);

// ---------------------------------------------------------------------------------------------
// gmm

TYPED_TEST(Gmm, Plain) {
  this->check_gmm(make_gmm_problem({7, 12, 3, 20}, 42, 16, 24, 4, {}), "plain");
}

TYPED_TEST(Gmm, DefaultInstanceOverload) {
  this->check_gmm(make_gmm_problem({7, 12, 3, 20}, 42, 16, 24, 4, {}), "default instance", true);
}

TYPED_TEST(Gmm, GroupsOfOneToFiveRows) {
  // Decode-sized groups (OneDnn streams the weights for groups of 2-3 rows), with the
  // operand transposed and accumulating too; n spans more than one column block of 256.
  for (bool transpose : {false, true})
    for (bool accumulate : {false, true}) {
      GmmOptions opt;
      opt.transpose_rhs = transpose;
      opt.accumulate = accumulate;
      this->check_gmm(make_gmm_problem({1, 2, 0, 3, 4, 5, 2}, 19, 19, 300, 7, opt),
                      std::string("few rows") + (transpose ? " transposed" : "") +
                          (accumulate ? " accumulate" : ""));
    }
}

TYPED_TEST(Gmm, FewRowsOverWeightsLargeEnoughForEveryThread) {
  // 512 x 512 weights: OneDnn's plain few-rows kernel splits them over the thread team (below
  // 2^18 values it runs on one thread), and the packed mode runs exact 1-3-row convolutions.
  for (bool accumulate : {false, true}) {
    GmmOptions opt;
    opt.accumulate = accumulate;
    this->check_gmm(make_gmm_problem({2, 3, 1, 0, 2}, 8, 512, 512, 5, opt),
                    accumulate ? "few rows, large weights, accumulate" : "few rows, large weights");
  }
}

TYPED_TEST(Gmm, RowsPastAGroupAreRightWhateverTheChunking) {
  // Groups of 17, 20, 33 rows with rows after them: OneDnn's packed mode rounds a group's last
  // chunk up to 16 rows where the rows exist and runs the chunks side by side on the threads, so
  // a rounded chunk must leave the rows of later or unvisited groups alone (they are computed
  // concurrently, zeroed, or, when accumulating, never touched).
  moe_ref::kk::ScopedThreads threads(3);
  for (bool accumulate : {false, true})
    for (int offset : {0, 1}) {
      GmmOptions opt;
      opt.accumulate = accumulate;
      opt.group_offset = offset;
      this->check_gmm(make_gmm_problem({17, 20, 33, 5}, 100, 24, 40, 2, opt),
                      std::string("chunks, group_offset ") + std::to_string(offset) +
                          (accumulate ? ", accumulate" : ""));
    }
}

TYPED_TEST(Gmm, TransposeRhs) {
  GmmOptions opt;
  opt.transpose_rhs = true;
  this->check_gmm(make_gmm_problem({9, 4, 30}, 43, 19, 13, 3, opt), "transpose_rhs");
}

// bf16_output (the bf16 layer's h0, h1, expert outputs and activation gradient): on bf16-valued
// operands the visited rows come back as bf16 values, the sum rounded once: within half a bf16
// ulp of the float result, which is within the usual float error of the exact sum. OneDnnPacked
// with bf16 kernels rounds at the kernel's store, the other paths after. Rows of unvisited groups
// stay zero, and a rounded output cannot be accumulated into (moe::ConfigError).
TYPED_TEST(Gmm, Bf16OutputRoundsTheVisitedRowsOnce) {
  using S = typename TestFixture::S;
  using P = typename TestFixture::Policy;
  for (bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "transpose_rhs" : "plain");
    GmmOptions opt;
    opt.transpose_rhs = trans;
    opt.bf16_inputs = true;
    opt.bf16_output = true;
    opt.group_offset = 1;
    Problem p = make_gmm_problem({5, 9, 0, 33, 6}, 60, 40, 24, 3, opt, 7);
    for (auto* v : {&p.lhs, &p.rhs})
      for (double& e : *v) e = moe::detail::round_to_bf16(e);
    auto const got = run_gmm<P, S>(p);
    Expected const e = reference_gmm(p);
    double const eps = std::numeric_limits<S>::epsilon();
    int failures = 0;
    for (std::size_t i = 0; i < got.size() && failures < 10; ++i) {
      double const err = (e.depth + 2) * eps * e.scale[i];
      double const tol = std::ldexp(std::abs(e.value[i]) + err, -8) + err;  // u = 2^-8
      if (got[i] != moe::detail::round_to_bf16(got[i]) || !(std::abs(got[i] - e.value[i]) <= tol))
        ++failures, ADD_FAILURE() << "element " << i << " is " << got[i] << ", expected "
                                  << e.value[i] << " rounded to bf16 (tolerance " << tol << ")";
    }
    for (std::size_t i = 0; i < 5 * std::size_t(p.n); ++i) ASSERT_EQ(got[i], 0.0) << i;
  }
  auto groups = moe::gmm::make_groups<Mem>({3, 4});
  View2<S> lhs("moe::gmm::test::lhs", 7, 8), out("moe::gmm::test::out", 7, 6);
  View3<S> rhs("moe::gmm::test::rhs", 2, 8, 6);
  GmmOptions both;
  both.bf16_output = both.accumulate = true;
  try {
    moe::gmm::gmm(Exec(), P{}, lhs, rhs, groups, out, both);
    ADD_FAILURE() << "bf16_output with accumulate was accepted";
  } catch (moe::ConfigError const& err) {
    EXPECT_NE(std::string(err.what()).find("bf16_output=true with accumulate=true"),
              std::string::npos)
        << err.what();
  }
}

// 16-bit operands (the bf16 layer's hidden states): gmm reading lhs and writing out as moe::bf16,
// and tgmm reading lhs and dy as moe::bf16, give bit for bit what the float operands holding the
// same values give (bf16_output for a bf16 out), on every policy: the bf16 kernels read and write
// them as they are, every float path through widened copies. Shapes over several row chunks, a
// group past the others' rows, an empty group, group_offset, both weight layouts; the values are
// also held to the double reference. A bf16 out cannot be accumulated into (moe::ConfigError).
TYPED_TEST(Gmm, Bf16StoredOperandsGiveTheFloatOperandsResults) {
  using S = typename TestFixture::S;
  using P = typename TestFixture::Policy;
  using moe::bf16;
  auto bf16_values = [](Problem& p) {
    for (auto* v : {&p.lhs, &p.rhs, &p.out})
      for (double& e : *v) e = moe::detail::round_to_bf16(e);
  };
  // (rows in group 1, n): one chunk; several chunks and, for tgmm, column blocks.
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{3, 40}, {300, 272}})
    for (bool trans : {false, true})
      for (bool bf16_inputs : {true, false}) {
        SCOPED_TRACE(std::string(trans ? "transpose_rhs" : "plain") + ", " + std::to_string(rows) +
                     " rows in group 1, n " + std::to_string(n) +
                     (bf16_inputs ? "" : ", bf16_inputs=false"));
        GmmOptions opt;
        opt.transpose_rhs = trans;
        opt.bf16_inputs = bf16_inputs;
        opt.group_offset = 1;
        Problem p = make_gmm_problem({5, rows, 0, 40, 17}, rows + 70, 48, n, 3, opt, 11);
        bf16_values(p);
        auto const fl = run_gmm<P, S, S, S>(p);
        EXPECT_EQ((run_gmm<P, S, bf16, S>(p)), fl) << "bf16 lhs, float out";
        expect_close<S>(fl, reference_gmm(p), "float operands");
        p.opt.bf16_output = true;
        auto const rounded = run_gmm<P, S, S, S>(p);
        EXPECT_EQ((run_gmm<P, S, bf16, bf16>(p)), rounded) << "bf16 lhs, bf16 out";
        EXPECT_EQ((run_gmm<P, S, S, bf16>(p)), rounded) << "float lhs, bf16 out";
        p.opt.bf16_output = false;  // a bf16 out rounds without being asked
        EXPECT_EQ((run_gmm<P, S, S, bf16>(p)), rounded) << "bf16 out without bf16_output";

        Problem t = make_tgmm_problem({5, rows, 0, 40, 17}, rows + 70, 48, n, 3, opt, 12);
        bf16_values(t);
        auto const tf = run_tgmm<P, S, S, S>(t);
        expect_close<S>(tf, reference_tgmm(t), "tgmm, float operands");
        EXPECT_EQ((run_tgmm<P, S, bf16, bf16>(t)), tf) << "tgmm, bf16 lhs and dy";
        EXPECT_EQ((run_tgmm<P, S, bf16, S>(t)), tf) << "tgmm, bf16 lhs";
        EXPECT_EQ((run_tgmm<P, S, S, bf16>(t)), tf) << "tgmm, bf16 dy";
        t.opt.accumulate = true;
        EXPECT_EQ((run_tgmm<P, S, bf16, bf16>(t)), (run_tgmm<P, S, S, S>(t)))
            << "tgmm accumulating, bf16 lhs and dy";
      }
  // Strided operands (row strides past their columns): bf16 and float subviews agree.
  {
    GmmOptions opt;
    opt.bf16_inputs = opt.bf16_output = true;
    opt.pack_cache = nullptr;
    Problem p = make_gmm_problem({20, 45}, 65, 24, 32, 2, opt, 13);
    bf16_values(p);
    auto const wide_in = to_device<View2<S>>("moe::gmm::test::lhs", {}, 65, 40);
    auto const wide_out = to_device<View2<S>>("moe::gmm::test::out", {}, 65, 48);
    auto lhs = Kokkos::subview(wide_in, Kokkos::ALL, std::pair<int64_t, int64_t>(0, 24));
    auto out = Kokkos::subview(wide_out, Kokkos::ALL, std::pair<int64_t, int64_t>(0, 32));
    auto const wide_in16 = to_device<View2<bf16>>("moe::gmm::test::lhs", {}, 65, 40);
    auto const wide_out16 = to_device<View2<bf16>>("moe::gmm::test::out", {}, 65, 48);
    auto lhs16 = Kokkos::subview(wide_in16, Kokkos::ALL, std::pair<int64_t, int64_t>(0, 24));
    auto out16 = Kokkos::subview(wide_out16, Kokkos::ALL, std::pair<int64_t, int64_t>(0, 32));
    auto const host = Kokkos::create_mirror_view(Kokkos::HostSpace(), wide_in);
    auto const host16 = Kokkos::create_mirror_view(Kokkos::HostSpace(), wide_in16);
    for (int64_t r = 0; r < 65; ++r)
      for (int64_t c = 0; c < 24; ++c) {
        host(r, c) = S(p.lhs[std::size_t(r * 24 + c)]);
        host16(r, c) = bf16(float(p.lhs[std::size_t(r * 24 + c)]));
      }
    Kokkos::deep_copy(wide_in, host);
    Kokkos::deep_copy(wide_in16, host16);
    auto const rhs = to_device<View3<S>>("moe::gmm::test::rhs", p.rhs, 2, 24, 32);
    auto const groups = moe::gmm::make_groups<Mem>(p.sizes);
    moe::gmm::gmm(Exec(), P{}, lhs, rhs, groups, out, opt);
    moe::gmm::gmm(Exec(), P{}, lhs16, rhs, groups, out16, opt);
    Kokkos::fence();
    auto const a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), wide_out);
    auto const b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), wide_out16);
    int failures = 0;
    for (int64_t r = 0; r < 65 && failures < 10; ++r)
      for (int64_t c = 0; c < 48; ++c)
        if (double(float(b(r, c))) != double(c < 32 ? a(r, c) : S(0)))
          ++failures, ADD_FAILURE() << "strided: out(" << r << ", " << c << ") is "
                                    << float(b(r, c)) << ", float operands give " << a(r, c);
  }
  auto groups = moe::gmm::make_groups<Mem>({3, 4});
  View2<bf16> lhs("moe::gmm::test::lhs", 7, 8), out("moe::gmm::test::out", 7, 6);
  View3<S> rhs("moe::gmm::test::rhs", 2, 8, 6);
  GmmOptions acc;
  acc.accumulate = true;
  try {
    moe::gmm::gmm(Exec(), P{}, lhs, rhs, groups, out, acc);
    ADD_FAILURE() << "a bf16 out with accumulate was accepted";
  } catch (moe::ConfigError const& err) {
    EXPECT_NE(std::string(err.what()).find("out holds moe::bf16 with accumulate=true"),
              std::string::npos)
        << err.what();
  }
}

TYPED_TEST(Gmm, GroupOffsetZeroesRowsOfOtherGroups) {
  GmmOptions opt;
  opt.group_offset = 2;
  // Groups 2 and 3 of 5 are visited; the initial output is random, so zeroing is checked exactly.
  this->check_gmm(make_gmm_problem({5, 6, 7, 8, 9}, 35, 11, 10, 2, opt), "group_offset");
  opt.transpose_rhs = true;
  this->check_gmm(make_gmm_problem({5, 6, 7, 8, 9}, 35, 11, 10, 2, opt),
                  "group_offset + transpose_rhs");
}

TYPED_TEST(Gmm, AccumulateAddsToVisitedRowsOnly) {
  GmmOptions opt;
  opt.accumulate = true;
  this->check_gmm(make_gmm_problem({10, 0, 13}, 30, 17, 9, 3, opt), "accumulate");
  opt.group_offset = 1;
  this->check_gmm(make_gmm_problem({4, 10, 13, 2}, 30, 17, 9, 2, opt), "accumulate + offset");
  opt.transpose_rhs = true;
  this->check_gmm(make_gmm_problem({4, 10, 13, 2}, 30, 17, 9, 2, opt),
                  "accumulate + offset + transpose_rhs");
}

TYPED_TEST(Gmm, RowsPastSumOfGroupSizesAreZeroed) {
  this->check_gmm(make_gmm_problem({6, 5}, 20, 8, 12, 2, {}), "rows past sum");
}

TYPED_TEST(Gmm, EmptyGroups) {
  this->check_gmm(make_gmm_problem({0, 5, 0, 0, 4, 0}, 9, 10, 6, 6, {}), "empty groups");
  this->check_gmm(make_gmm_problem({0, 0, 0}, 4, 10, 6, 3, {}), "all groups empty");
  GmmOptions opt;
  opt.group_offset = 1;
  this->check_gmm(make_gmm_problem({3, 0, 0, 4}, 7, 10, 6, 2, opt), "visited groups empty");
}

TYPED_TEST(Gmm, AllRowsInOneGroup) {
  this->check_gmm(make_gmm_problem({37}, 37, 21, 18, 1, {}), "one group");
  this->check_gmm(make_gmm_problem({0, 37, 0}, 37, 21, 18, 3, {}), "one non-empty group");
}

TYPED_TEST(Gmm, SingleRow) {
  this->check_gmm(make_gmm_problem({1}, 1, 7, 5, 1, {}), "single row");
  this->check_gmm(make_gmm_problem({0, 1}, 1, 1, 1, 2, {}), "1x1x1");
}

TYPED_TEST(Gmm, RaggedSizesNotMultiplesOfTiles) {
  this->check_gmm(make_gmm_problem({33, 65, 7, 1}, 110, 37, 45, 4, {}), "ragged");
  GmmOptions opt;
  opt.transpose_rhs = true;
  this->check_gmm(make_gmm_problem({33, 65, 7, 1}, 110, 37, 45, 4, opt), "ragged transposed");
}

TYPED_TEST(Gmm, ExactMultiplesOfTiles) {
  this->check_gmm(make_gmm_problem({64, 32, 96}, 192, 64, 128, 3, {}), "tile multiples");
}

TYPED_TEST(Gmm, EmptyContractionGivesZeros) {
  this->check_gmm(make_gmm_problem({3, 4}, 8, 0, 5, 2, {}), "k = 0");
  GmmOptions opt;
  opt.accumulate = true;
  this->check_gmm(make_gmm_problem({3, 4}, 8, 0, 5, 2, opt), "k = 0, accumulate");
}

TYPED_TEST(Gmm, NonFiniteRowsOutsideVisitedGroupsDoNotLeak) {
  // Rows of unvisited groups and rows past the grouped ones hold NaN / Inf in lhs (as a padded
  // or uninitialised buffer may); visited rows must stay exact and the others exactly zero.
  GmmOptions opt;
  opt.group_offset = 1;
  auto p = make_gmm_problem({3, 5, 2, 7, 4}, 26, 9, 20, 3, opt);
  auto const off = offsets_of(p.sizes);
  double const bad[] = {std::numeric_limits<double>::quiet_NaN(),
                        std::numeric_limits<double>::infinity()};
  for (int64_t r = 0; r < p.m; ++r)
    if (r < off[1] || r >= off[4])
      for (int64_t c = 0; c < p.k; ++c) p.lhs[r * p.k + c] = bad[(r + c) % 2];
  this->check_gmm(p, "non-finite rows outside the visited groups");
}

TYPED_TEST(Gmm, SubviewOperands) {
  using S = typename TestFixture::S;
  using Policy = typename TestFixture::Policy;
  // Row blocks and column slices of larger row-major arrays (row stride != extent(1)).
  auto p = make_gmm_problem({4, 6}, 12, 9, 7, 2, {});
  auto big_lhs = to_device<View2<S>>("moe::gmm::test::big_lhs", random_values(20 * 15, 9), 20, 15);
  auto big_out = to_device<View2<S>>("moe::gmm::test::big_out", random_values(20 * 11, 8), 20, 11);
  auto lhs = Kokkos::subview(big_lhs, std::make_pair(3, 15), std::make_pair(2, 11));
  auto out = Kokkos::subview(big_out, std::make_pair(5, 17), std::make_pair(1, 8));
  auto h = Kokkos::create_mirror_view(big_lhs);
  Kokkos::deep_copy(h, big_lhs);
  for (int r = 0; r < 12; ++r)
    for (int c = 0; c < 9; ++c) p.lhs[r * 9 + c] = h(r + 3, c + 2);
  auto out_before = to_host(big_out);
  auto rhs = to_device<View3<S>>("moe::gmm::test::rhs", p.rhs, 2, 9, 7);
  moe::gmm::gmm(Exec(), Policy{}, lhs, rhs, moe::gmm::make_groups<Mem>(p.sizes), out);
  auto all = to_host(big_out);
  std::vector<double> got;
  for (int r = 0; r < 20; ++r)
    for (int c = 0; c < 11; ++c) {
      if (r >= 5 && r < 17 && c >= 1 && c < 8)
        got.push_back(all[r * 11 + c]);
      else
        EXPECT_EQ(all[r * 11 + c], out_before[r * 11 + c])
            << "outside the subview: " << r << "," << c;
    }
  expect_close<S>(got, reference_gmm(p), "subviews");
}

// ---------------------------------------------------------------------------------------------
// tgmm

TYPED_TEST(Gmm, TgmmPlain) {
  this->check_tgmm(make_tgmm_problem({7, 12, 3, 20}, 42, 16, 24, 4, {}), "tgmm plain");
}

TYPED_TEST(Gmm, TgmmDefaultInstanceOverload) {
  this->check_tgmm(make_tgmm_problem({7, 12, 3, 20}, 42, 16, 24, 4, {}), "tgmm default", true);
}

TYPED_TEST(Gmm, TgmmGroupOffset) {
  GmmOptions opt;
  opt.group_offset = 1;
  this->check_tgmm(make_tgmm_problem({5, 6, 7, 8}, 26, 11, 10, 2, opt), "tgmm group_offset");
}

TYPED_TEST(Gmm, TgmmAccumulate) {
  GmmOptions opt;
  opt.accumulate = true;
  this->check_tgmm(make_tgmm_problem({10, 0, 13}, 23, 17, 9, 3, opt), "tgmm accumulate");
  opt.group_offset = 2;
  this->check_tgmm(make_tgmm_problem({4, 10, 13, 2}, 29, 17, 9, 2, opt), "tgmm accumulate+off");
}

TYPED_TEST(Gmm, TgmmEmptyGroupGivesZeroBlock) {
  // The initial output is random: an empty group's block must come back exactly zero.
  this->check_tgmm(make_tgmm_problem({0, 5, 0, 4, 0}, 9, 10, 6, 5, {}), "tgmm empty groups");
  this->check_tgmm(make_tgmm_problem({0, 0}, 3, 4, 5, 2, {}), "tgmm all empty");
}

TYPED_TEST(Gmm, TgmmRowsPastSumAreIgnored) {
  this->check_tgmm(make_tgmm_problem({6, 5}, 20, 8, 12, 2, {}), "tgmm rows past sum");
}

TYPED_TEST(Gmm, TgmmOneGroupSingleRowAndRagged) {
  this->check_tgmm(make_tgmm_problem({37}, 37, 21, 18, 1, {}), "tgmm one group");
  this->check_tgmm(make_tgmm_problem({1}, 1, 7, 5, 1, {}), "tgmm single row");
  this->check_tgmm(make_tgmm_problem({33, 65, 7, 1}, 106, 37, 45, 4, {}), "tgmm ragged");
  this->check_tgmm(make_tgmm_problem({64, 32}, 96, 64, 64, 2, {}), "tgmm tile multiples");
}

TYPED_TEST(Gmm, TgmmHotGroupSplitIntoColumnBlocks) {
  // With several threads OneDnn splits a group holding more than half a thread's share of the
  // rows into column blocks (multiples of 16, at least 128 wide): 300 columns give blocks
  // [0, 144) and [144, 300); the other groups run whole, side by side.
  moe_ref::kk::ScopedThreads threads(3);
  this->check_tgmm(make_tgmm_problem({90, 0, 7, 23}, 125, 20, 300, 4, {}), "tgmm hot group");
  GmmOptions opt;
  opt.accumulate = true;
  opt.group_offset = 1;
  this->check_tgmm(make_tgmm_problem({3, 90, 7, 23}, 125, 20, 300, 3, opt),
                   "tgmm hot group, accumulate + offset");
}

TYPED_TEST(Gmm, TgmmEmptyExtents) {
  this->check_tgmm(make_tgmm_problem({3, 4}, 7, 0, 5, 2, {}), "tgmm k = 0");
  this->check_tgmm(make_tgmm_problem({3, 4}, 7, 5, 0, 2, {}), "tgmm n = 0");
}

// ---------------------------------------------------------------------------------------------
// Shape validation

template <class F>
void expect_shape_error(F&& f, std::string const& needle) {
  try {
    f();
    ADD_FAILURE() << "expected moe::ShapeError mentioning '" << needle << "'";
  } catch (moe::ShapeError const& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not mention '" << needle << "'";
  }
}

TYPED_TEST(Gmm, BadShapesThrow) {
  using S = typename TestFixture::S;
  using P = typename TestFixture::Policy;
  auto groups = moe::gmm::make_groups<Mem>({3, 4, 5});  // 12 rows, 3 groups
  View2<S> lhs("moe::gmm::test::lhs", 12, 8), out("moe::gmm::test::out", 12, 6);
  View3<S> rhs("moe::gmm::test::rhs", 3, 8, 6);
  Exec space;
  EXPECT_NO_THROW(moe::gmm::gmm(space, P{}, lhs, rhs, groups, out));

  View2<S> short_lhs("moe::gmm::test::short_lhs", 11, 8), short_out("moe::gmm::test::so", 11, 6);
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, short_lhs, rhs, groups, short_out); },
                     "lhs.extent(0)=11");
  View3<S> rhs_k("moe::gmm::test::rhs_k", 3, 7, 6);
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs_k, groups, out); },
                     "rhs.extent(1)=7");
  GmmOptions tr;
  tr.transpose_rhs = true;
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs, groups, out, tr); },
                     "rhs.extent(2)=6");
  View2<S> wide_out("moe::gmm::test::wide_out", 12, 7);
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs, groups, wide_out); },
                     "out is [12,7]");
  View2<S> tall_out("moe::gmm::test::tall_out", 13, 6);
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs, groups, tall_out); },
                     "out is [13,6]");
  GmmOptions off;
  off.group_offset = 1;
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs, groups, out, off); },
                     "group_offset=1 + G_local=3");
  off.group_offset = -1;
  View3<S> rhs1("moe::gmm::test::rhs1", 1, 8, 6);
  expect_shape_error([&] { moe::gmm::gmm(space, P{}, lhs, rhs1, groups, out, off); },
                     "group_offset=-1");

  // tgmm
  View2<S> dy("moe::gmm::test::dy", 12, 6);
  View3<S> dw("moe::gmm::test::dw", 3, 8, 6);
  EXPECT_NO_THROW(moe::gmm::tgmm(space, P{}, lhs, dy, groups, dw));
  View2<S> short_dy("moe::gmm::test::short_dy", 11, 6);
  expect_shape_error([&] { moe::gmm::tgmm(space, P{}, lhs, short_dy, groups, dw); },
                     "dy.extent(0)=11");
  expect_shape_error([&] { moe::gmm::tgmm(space, P{}, short_lhs, short_dy, groups, dw); },
                     "lhs.extent(0)=11");
  View3<S> dw_bad("moe::gmm::test::dw_bad", 3, 6, 8);
  expect_shape_error([&] { moe::gmm::tgmm(space, P{}, lhs, dy, groups, dw_bad); },
                     "out is [3,6,8]");
  View3<S> dw4("moe::gmm::test::dw4", 4, 8, 6);
  expect_shape_error([&] { moe::gmm::tgmm(space, P{}, lhs, dy, groups, dw4); },
                     "G_local=4 exceeds the number of groups G=3");
  space.fence();
}

TEST(GmmGroups, MakeGroupsBuildsOffsets) {
  auto groups = moe::gmm::make_groups<Mem>({3, 0, 5});
  EXPECT_EQ(groups.num_groups(), 3);
  EXPECT_EQ(groups.rows(), 8);
  EXPECT_EQ(groups.size(0), 3);
  EXPECT_EQ(groups.size(1), 0);
  EXPECT_EQ(groups.size(2), 5);
  auto dev = to_host(groups.offsets);
  EXPECT_EQ(dev, (std::vector<double>{0, 3, 3, 8}));
  auto none = moe::gmm::make_groups(Exec(), {});
  EXPECT_EQ(none.num_groups(), 0);
  EXPECT_EQ(none.rows(), 0);
}

TEST(GmmGroups, NegativeSizeThrows) {
  expect_shape_error([] { moe::gmm::make_groups<Mem>({3, -1, 5}); }, "sizes[1]=-1");
  expect_shape_error([] { moe::gmm::make_groups(Exec(), {-2}); }, "sizes[0]=-2");
}

TEST(GmmGroups, FromOffsetsValidates) {
  Kokkos::View<int64_t*, Mem> off("moe::gmm::test::offsets", 4);
  auto h = Kokkos::create_mirror_view(off);
  h(0) = 0, h(1) = 2, h(2) = 2, h(3) = 7;
  Kokkos::deep_copy(off, h);
  auto groups = moe::gmm::make_groups<Mem>(off, h);
  EXPECT_EQ(groups.num_groups(), 3);
  EXPECT_EQ(groups.rows(), 7);
  h(2) = 1;
  expect_shape_error([&] { moe::gmm::make_groups<Mem>(off, h); }, "offsets_host(2)=1");
  h(2) = 2, h(0) = 1;
  expect_shape_error([&] { moe::gmm::make_groups<Mem>(off, h); }, "offsets_host(0)=1");
}

// ---------------------------------------------------------------------------------------------
// All policies give the same numbers on one larger, skewed problem.

template <class S>
void policies_agree() {
  std::vector<int64_t> sizes = {150, 3, 0, 61, 17, 1, 40};
  GmmOptions opt;
  auto p = make_gmm_problem(sizes, 280, 96, 80, 7, opt, 11);
  auto const vendor = run_gmm<Vendor, S>(p);
  Expected e = reference_gmm(p);
  e.value = vendor;  // compare every policy against Vendor with twice the reference tolerance
  for (auto& s : e.scale) s *= 2;
  expect_close<S>(run_gmm<Dense, S>(p), e, "Dense vs Vendor");
  expect_close<S>(run_gmm<Tiled<4, 8, 4>, S>(p), e, "Tiled<4,8,4> vs Vendor");
  expect_close<S>(run_gmm<Tiled<32, 32, 32>, S>(p), e, "Tiled<32,32,32> vs Vendor");
  expect_close<S>(run_gmm<Tiled<64, 64, 64>, S>(p), e, "Tiled<64,64,64> vs Vendor");
  expect_close<S>(run_gmm<moe::gmm::Auto, S>(p), e, "Auto vs Vendor");
  expect_close<S>(run_gmm<OneDnn, S>(p), e, "OneDnn vs Vendor");
  expect_close<S>(run_gmm<OneDnnPacked, S>(p), e, "OneDnn (packed) vs Vendor");
  expect_close<S>(run_gmm<OneDnnPlain, S>(p), e, "OneDnn (plain) vs Vendor");

  auto t = make_tgmm_problem(sizes, 280, 96, 80, 7, opt, 12);
  auto const tvendor = run_tgmm<Vendor, S>(t);
  Expected te = reference_tgmm(t);
  te.value = tvendor;
  for (auto& s : te.scale) s *= 2;
  expect_close<S>(run_tgmm<Dense, S>(t), te, "tgmm Dense vs Vendor");
  expect_close<S>(run_tgmm<Tiled<4, 8, 4>, S>(t), te, "tgmm Tiled<4,8,4> vs Vendor");
  expect_close<S>(run_tgmm<Tiled<32, 32, 32>, S>(t), te, "tgmm Tiled<32,32,32> vs Vendor");
  expect_close<S>(run_tgmm<Tiled<64, 64, 64>, S>(t), te, "tgmm Tiled<64,64,64> vs Vendor");
  expect_close<S>(run_tgmm<OneDnn, S>(t), te, "tgmm OneDnn vs Vendor");
}

TEST(GmmPolicies, AgreeFloat) { policies_agree<float>(); }
TEST(GmmPolicies, AgreeDouble) { policies_agree<double>(); }

// ---------------------------------------------------------------------------------------------
// Traits: Auto resolves per (space, scalar); unavailable policies fall back to Vendor.

TEST(GmmPolicies, AutoResolvesToTheAvailableBackend) {
  using moe::gmm::resolve_t;
  static_assert(std::is_same_v<resolve_t<Vendor, Exec, float>, Vendor>);
  static_assert(std::is_same_v<resolve_t<OneDnn, Exec, double>, Vendor>,
                "oneDNN has no double GEMM: OneDnn<double> runs as Vendor");
  constexpr bool host = Kokkos::SpaceAccessibility<Exec, Kokkos::HostSpace>::accessible;
  bool const onednn = MOE_HAS_ONEDNN && host;
  using Fallback = std::conditional_t<host, Vendor, moe::gmm::DeviceTiled>;
  EXPECT_EQ((std::is_same_v<resolve_t<moe::gmm::Auto, Exec, float>, OneDnn>), onednn);
  EXPECT_EQ((std::is_same_v<resolve_t<moe::gmm::Auto, Exec, double>, Fallback>), true);
  EXPECT_EQ(std::string(moe::gmm::backend_name<moe::gmm::Auto, Exec, float>()), onednn ? "OneDnn"
                                                                                : host ? "Vendor"
                                                                                       : "Tiled");
  // Device spaces: one launch per grouped GEMM, not one vendor GEMM per expert.
#if defined(KOKKOS_ENABLE_CUDA)
  static_assert(
      std::is_same_v<resolve_t<moe::gmm::Auto, Kokkos::Cuda, float>, moe::gmm::DeviceTiled>);
#endif
#if defined(KOKKOS_ENABLE_HIP)
  static_assert(
      std::is_same_v<resolve_t<moe::gmm::Auto, Kokkos::HIP, float>, moe::gmm::DeviceTiled>);
#endif
  static_assert(
      std::is_same_v<resolve_t<moe::gmm::Auto, Kokkos::DefaultHostExecutionSpace, double>, Vendor>);
}

// round_rhs (a bf16 layer's fp32 master weights, with no rounded copy of its own): the product
// of unrounded weights with round_rhs is bit for bit the product of the same weights rounded to
// bf16 first, on every policy (OneDnn rounds as it packs, or a copy per group in its plain mode;
// the others get a rounded copy of rhs), in both weight layouts, overwriting and accumulating, with
// groups of 2-3 rows (the plain mode's few-rows kernel), several chunks, an empty group and
// group_offset, with and without bf16_inputs (the bf16 or the fp32 packs) and a pack cache.
TYPED_TEST(Gmm, RoundRhsGivesTheBitsOfRoundedWeights) {
  using S = typename TestFixture::S;
  using P = typename TestFixture::Policy;
  std::mt19937 gen(31);
  std::uniform_int_distribution<int> fine(-65536, 65536);  // 17 significant bits: few are bf16
  for (bool trans : {false, true})
    for (bool accumulate : {false, true})
      for (bool bf16_inputs : {true, false})
        for (bool cached : {false, true}) {
          SCOPED_TRACE(std::string(trans ? "transpose_rhs" : "plain") +
                       (accumulate ? ", accumulate" : "") + (bf16_inputs ? ", bf16_inputs" : "") +
                       (cached ? ", pack cache" : ""));
          moe::gmm::PackCache cache;
          GmmOptions opt;
          opt.transpose_rhs = trans;
          opt.accumulate = accumulate;
          opt.bf16_inputs = bf16_inputs;
          opt.group_offset = 1;
          opt.pack_cache = cached ? &cache : nullptr;
          opt.rhs_version = 1;
          Problem p = make_gmm_problem({5, 2, 0, 3, 40, 17}, 80, 40, 36, 4, opt, 17);
          for (double& e : p.rhs) e = fine(gen) / 65536.0;
          Problem rounded = p;
          int changed = 0;
          for (double& e : rounded.rhs) {
            double const r = moe::detail::round_to_bf16(e);
            changed += r != e;
            e = r;
          }
          ASSERT_GT(changed, int(p.rhs.size()) / 2) << "the weights must not be bf16 values";
          auto const want = run_gmm<P, S>(rounded);
          p.opt.round_rhs = true;
          cache.clear();
          EXPECT_EQ((run_gmm<P, S>(p)), want);
        }
}

// gmm_sum (a gated FFN's input gradient into 16-bit rows): out = lhs_a . rhs_a + lhs_b . rhs_b
// is bit for bit gmm of the first product, then gmm of the second with accumulate into scalar
// rows, rounded after where it rounds (bf16_output, or a moe::bf16 out), on every policy: both
// weight layouts, groups of 2-3 rows, several chunks, a group whose rows are not a multiple of
// the packed runs, an empty group, group_offset (the rows of other groups zeroed), bf16 inputs
// with and without a pack cache and round_rhs; and it never accumulates (moe::ConfigError).
TYPED_TEST(Gmm, SumOfTwoProductsGivesTheBitsOfTwoCalls) {
  using S = typename TestFixture::S;
  using P = typename TestFixture::Policy;
  using moe::bf16;
  for (bool trans : {false, true})
    for (bool b16 : {true, false})
      for (bool cached : {false, true}) {
        SCOPED_TRACE(std::string(trans ? "transpose_rhs" : "plain") + (b16 ? ", bf16" : "") +
                     (cached ? ", pack cache, round_rhs" : ""));
        moe::gmm::PackCache cache;
        GmmOptions opt;
        opt.transpose_rhs = trans;
        opt.group_offset = 1;
        opt.bf16_inputs = opt.bf16_output = b16;
        opt.pack_cache = cached ? &cache : nullptr;
        opt.rhs_version = 1;
        opt.round_rhs = b16 && cached;
        std::vector<int64_t> const sizes{5, 2, 0, 3, 301, 17};
        Problem a = make_gmm_problem(sizes, 338, 48, 40, 4, opt, 41);
        Problem b = make_gmm_problem(sizes, 338, 48, 40, 4, opt, 43);
        if (b16)
          for (Problem* p : {&a, &b})
            for (double& e : p->lhs) e = moe::detail::round_to_bf16(e);
        // The two calls, the second accumulating into the first's scalar rows.
        Problem first = a;
        first.opt.bf16_output = false;
        Problem second = b;
        second.opt = first.opt;
        second.opt.accumulate = true;
        second.out = run_gmm<P, S>(first);
        cache.clear();
        auto want = run_gmm<P, S>(second);
        if (b16)
          for (double& e : want) e = moe::detail::round_to_bf16(e);
        if (!b16) {
          Expected ref = reference_gmm(a);
          Expected const ref_b = reference_gmm(b);
          for (std::size_t i = 0; i < ref.value.size(); ++i) {
            ref.value[i] += ref_b.value[i];
            ref.scale[i] += ref_b.scale[i];
          }
          expect_close<S>(want, ref, "the two calls");
        }
        cache.clear();
        EXPECT_EQ((run_gmm_sum<P, S>(a, b)), want) << "scalar rows";
        if (b16) {
          cache.clear();
          EXPECT_EQ((run_gmm_sum<P, S, bf16, bf16>(a, b)), want) << "bf16 lhs, bf16 out";
          cache.clear();
          EXPECT_EQ((run_gmm_sum<P, S, S, bf16>(a, b)), want) << "scalar lhs, bf16 out";
        }
      }
  GmmOptions acc;
  acc.accumulate = true;
  Problem p = make_gmm_problem({3, 4}, 7, 8, 8, 2, acc, 3);
  EXPECT_THROW((run_gmm_sum<P, S>(p, p)), moe::ConfigError);
  GmmOptions plain;
  Problem a = make_gmm_problem({3, 4}, 7, 8, 8, 2, plain, 5);
  Problem one = make_gmm_problem({3, 4}, 7, 8, 8, 1, plain, 7);
  EXPECT_THROW((run_gmm_sum<P, S>(a, one)), moe::ShapeError) << "one rhs_b per group";
  // A second product of another contraction length (its own k) sums as well.
  Problem longer = make_gmm_problem({3, 4}, 7, 12, 8, 2, plain, 9);
  Expected ref = reference_gmm(a);
  Expected const ref_b = reference_gmm(longer);
  for (std::size_t i = 0; i < ref.value.size(); ++i) {
    ref.value[i] += ref_b.value[i];
    ref.scale[i] += ref_b.scale[i];
  }
  expect_close<S>(run_gmm_sum<P, S>(a, longer), ref, "second product with k=12");
}

// ---------------------------------------------------------------------------------------------
// The packed-weight cache: reused while the version holds, repacked when it changes, and a
// write that forgot the version is still caught by the sampled values.

struct CacheRun {
  View2<float> lhs, out;
  View3<float> rhs;
  moe::gmm::Groups<Mem> groups;
  moe::gmm::PackCache cache;
  Problem p;

  explicit CacheRun(bool transpose) {
    GmmOptions opt;
    opt.transpose_rhs = transpose;
    p = make_gmm_problem({40, 0, 17, 300, 1}, 360, 24, 40, 5, opt, 21);
    lhs = to_device<View2<float>>("moe::gmm::test::lhs", p.lhs, p.m, p.k);
    rhs = transpose ? to_device<View3<float>>("moe::gmm::test::rhs", p.rhs, 5, p.n, p.k)
                    : to_device<View3<float>>("moe::gmm::test::rhs", p.rhs, 5, p.k, p.n);
    out = View2<float>("moe::gmm::test::out", p.m, p.n);
    groups = moe::gmm::make_groups<Mem>(p.sizes);
  }
  /// gmm with the cache at `version`; checks the result against the reference of p.rhs.
  void run(std::uint64_t version, std::string const& what) {
    GmmOptions opt = p.opt;
    opt.pack_cache = &cache;
    opt.rhs_version = version;
    Exec space;
    moe::gmm::gmm(space, OneDnnPacked{}, lhs, rhs, groups, out, opt);
    space.fence();
    expect_close<float>(to_host(out), reference_gmm(p), what);
  }
  /// Writes new weights (every value scaled by `f`, exact in float) into the same tensor.
  void rescale_weights(double f) {
    for (auto& v : p.rhs) v *= f;
    auto h = Kokkos::create_mirror_view(rhs);
    for (std::size_t i = 0; i < p.rhs.size(); ++i) h.data()[i] = float(p.rhs[i]);
    Kokkos::deep_copy(rhs, h);
  }
};

class GmmPackCache : public ::testing::TestWithParam<bool> {};

TEST_P(GmmPackCache, ReusedWhileVersionHoldsRepackedWhenItChanges) {
  if (!MOE_HAS_ONEDNN) GTEST_SKIP() << "moe was built without oneDNN";
  CacheRun r(GetParam());
  r.run(1, "first call");
  EXPECT_EQ(r.cache.packs(), 1u);
  r.run(1, "same version");
  EXPECT_EQ(r.cache.packs(), 1u) << "a second call with the same version must reuse the pack";
  EXPECT_EQ(r.cache.hits(), 1u);
  EXPECT_GT(r.cache.bytes(), 0u);
  r.rescale_weights(0.5);  // optimizer step / FSDP gather / checkpoint load: new contents
  r.run(2, "after the weights changed (new version)");
  EXPECT_EQ(r.cache.packs(), 2u);
  EXPECT_EQ(r.cache.stale_caught(), 0u);
}

TEST_P(GmmPackCache, UnversionedWriteIsCaughtBySampledValues) {
  if (!MOE_HAS_ONEDNN) GTEST_SKIP() << "moe was built without oneDNN";
  CacheRun r(GetParam());
  r.run(7, "first call");
  r.rescale_weights(-2.0);  // written without a new version
  r.run(7, "after an unversioned write");
  EXPECT_EQ(r.cache.packs(), 2u);
  EXPECT_EQ(r.cache.stale_caught(), 1u);
}

TEST_P(GmmPackCache, ClearDropsEveryPack) {
  if (!MOE_HAS_ONEDNN) GTEST_SKIP() << "moe was built without oneDNN";
  CacheRun r(GetParam());
  r.run(3, "first call");
  r.cache.clear();
  EXPECT_EQ(r.cache.bytes(), 0u);
  r.run(3, "after clear");
  EXPECT_EQ(r.cache.packs(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Transpose, GmmPackCache, ::testing::Bool(),
                         [](auto const& info) { return info.param ? "transposed" : "plain"; });

}  // namespace
