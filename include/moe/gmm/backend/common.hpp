#pragma once
/// \file
/// What the grouped-GEMM backends share: operand view types, zeroing, bf16 copies, shape checks,
/// and the primary `Impl` template each backend specialises for its policy tag.

#include <moe/bf16.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/elementwise.hpp>
#include <moe/error.hpp>
#include <moe/gmm/groups.hpp>
#include <moe/gmm/policy.hpp>

#include <Kokkos_Core.hpp>

#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace moe::gmm::detail {

/// The operand types of every backend: unmanaged row-major views (Mat 2-D, Tensor 3-D).
template <class T, class Exec, class Mem>
using Unmanaged = Kokkos::View<T, Kokkos::LayoutRight, Kokkos::Device<Exec, Mem>,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class Exec, class Scalar, class Mem>
using CMat = Unmanaged<const Scalar**, Exec, Mem>;
template <class Exec, class Scalar, class Mem>
using Mat = Unmanaged<Scalar**, Exec, Mem>;
template <class Exec, class Scalar, class Mem>
using CTensor = Unmanaged<const Scalar***, Exec, Mem>;
template <class Exec, class Scalar, class Mem>
using Tensor = Unmanaged<Scalar***, Exec, Mem>;
using Rows = std::pair<int64_t, int64_t>;

using moe::detail::fence;
using moe::detail::require;

using moe::detail::convert_into;
using moe::detail::is_bf16;
using moe::detail::widened;

/// Runs run(a', b') on S views of two 2-D operands (bf16 ones through S copies). With `BWritten`
/// (gmm's out) a bf16 b's copy starts uninitialised and is narrowed into b after.
template <class S, bool BWritten, class ExecSpace, class A, class B, class Run>
void via_float(ExecSpace const& space, A const& a, B const& b, Run&& run) {
  auto const wa = widened<S>(space, a);
  auto const wb = widened<S>(space, b, !BWritten);
  run(wa, wb);
  if constexpr (BWritten && is_bf16<typename B::value_type>)
    convert_into(space, wb, b, "moe::gmm::narrow");
  fence(space, "moe::gmm: float copies used");  // before they are freed
}

/// Zeroes out's rows [begin, end) (any row stride).
template <class ExecSpace, class Scalar, class Mem>
void zero_rows(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, int64_t begin,
               int64_t end, char const* label) {
  int64_t const cols = out.extent(1);
  if (end > begin && cols > 0)
    Kokkos::parallel_for(
        label,
        Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<int64_t>>(space, begin * cols, end * cols),
        KOKKOS_LAMBDA(int64_t idx) { out(idx / cols, idx % cols) = Scalar(0); });
}

/// out = 0 on a 2-D block.
template <class ExecSpace, class Scalar, class Mem>
void zero(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, char const* label) {
  zero_rows(space, out, 0, out.extent(0), label);
}

/// Zeroes the rows of out outside [begin, end) (rows of no visited group).
template <class ExecSpace, class Scalar, class Mem>
void zero_outside(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, int64_t begin,
                  int64_t end) {
  zero_rows(space, out, 0, begin, "moe::gmm::zero_unvisited_rows");
  zero_rows(space, out, end, int64_t(out.extent(0)), "moe::gmm::zero_unvisited_rows");
}

/// out[r, :] rounded to bf16 for rows r in [begin, end) (bf16_output on the float paths).
template <class ExecSpace, class Scalar, class Mem>
void round_rows(ExecSpace const& space, Mat<ExecSpace, Scalar, Mem> const& out, int64_t begin,
                int64_t end) {
  int64_t const n = out.extent(1), ld = out.stride(0);
  Scalar* const p = out.data();
  if (end > begin && n > 0)
    Kokkos::parallel_for(
        "moe::gmm::round_rows", Kokkos::RangePolicy<ExecSpace>(space, 0, (end - begin) * n),
        KOKKOS_LAMBDA(int64_t i) {
          Scalar& v = p[(begin + i / n) * ld + i % n];
          v = moe::detail::round_to_bf16(v);
        });
}

inline void check_blas_extent(char const* what, char const* name, int64_t value) {
  require<ShapeError>(value <= INT_MAX, what, ": ", name, "=", value,
                      " exceeds the 32-bit BLAS limit ", INT_MAX,
                      "; use the Tiled policy or split the problem");
}

/// The shape checks gmm and tgmm share (`local`: rhs or out, whose extent(0) is G_local).
template <class Mem>
void check_groups(char const* what, char const* local, std::size_t g_local, int64_t m,
                  Groups<Mem> const& groups, GmmOptions const& opt) {
  require<ShapeError>(g_local <= INT_MAX, what, ": ", local, ".extent(0)=", g_local,
                      " groups is more than ", INT_MAX);
  int const num_local = static_cast<int>(g_local);
  require<ShapeError>(
      groups.offsets.extent(0) == groups.offsets_host.extent(0) && groups.offsets.extent(0) >= 1,
      what, ": groups.offsets.extent(0)=", groups.offsets.extent(0),
      " and groups.offsets_host.extent(0)=", groups.offsets_host.extent(0),
      " must be equal and >= 1; build Groups with moe::gmm::make_groups");
  require<ShapeError>(opt.group_offset >= 0, what, ": group_offset=", opt.group_offset,
                      " must be >= 0");
  require<ShapeError>(static_cast<int64_t>(opt.group_offset) + num_local <= groups.num_groups(),
                      what, ": group_offset=", opt.group_offset, " + G_local=", num_local,
                      " exceeds the number of groups G=", groups.num_groups());
  require<ShapeError>(m >= groups.rows(), what, ": lhs.extent(0)=", m,
                      " is smaller than the number of grouped rows ", groups.rows(),
                      " (sum of group sizes); lhs needs a row for each");
}

template <class L, class R, class O, class Mem>
void check_gmm(L const& lhs, R const& rhs, Groups<Mem> const& groups, O const& out,
               GmmOptions const& opt) {
  char const* what = "moe::gmm::gmm";
  int64_t const m = lhs.extent(0), k = lhs.extent(1);
  int64_t const rk = opt.transpose_rhs ? rhs.extent(2) : rhs.extent(1);
  int64_t const n = opt.transpose_rhs ? rhs.extent(1) : rhs.extent(2);
  check_groups(what, "rhs", rhs.extent(0), m, groups, opt);
  require<ShapeError>(rk == k, what, ": lhs is [", m, ",", k, "] but rhs is [", rhs.extent(0), ",",
                      rhs.extent(1), ",", rhs.extent(2), "]; rhs.extent(",
                      opt.transpose_rhs ? 2 : 1, ")=", rk, " must equal lhs.extent(1)=", k,
                      opt.transpose_rhs ? " (transpose_rhs)" : "");
  bool const out16 = is_bf16<typename O::value_type>;
  require<ConfigError>(
      !((opt.bf16_output || out16) && opt.accumulate), what,
      out16 ? ": out holds moe::bf16 with accumulate=true; a bf16 output cannot be summed into "
              "(sum into a float output and round the sum instead)"
            : ": bf16_output=true with accumulate=true; a rounded output cannot be summed into "
              "(round the sum instead)");
  require<ShapeError>(out.extent(0) == lhs.extent(0) && int64_t(out.extent(1)) == n, what,
                      ": out is [", out.extent(0), ",", out.extent(1),
                      "] but must be [lhs.extent(0), n] = [", m, ",", n, "]");
}

template <class L, class D, class O, class Mem>
void check_tgmm(L const& lhs, D const& dy, Groups<Mem> const& groups, O const& out,
                GmmOptions const& opt) {
  char const* what = "moe::gmm::tgmm";
  int64_t const m = lhs.extent(0), k = lhs.extent(1), n = dy.extent(1);
  check_groups(what, "out", out.extent(0), m, groups, opt);
  require<ShapeError>(int64_t(dy.extent(0)) == m, what, ": dy.extent(0)=", dy.extent(0),
                      " must equal lhs.extent(0)=", m);
  require<ShapeError>(int64_t(out.extent(1)) == k && int64_t(out.extent(2)) == n, what,
                      ": out is [", out.extent(0), ",", out.extent(1), ",", out.extent(2),
                      "] but must be [G_local, ", k, ", ", n,
                      "] = [G_local, lhs.extent(1), dy.extent(1)]");
}

/// Whether a policy's Impl has gmm_sum(): the sum of two products written into 16-bit rows
/// without a float copy of them (gmm::gmm_sum makes one for the others).
template <class Policy>
struct sums_rows16 : std::false_type {};

/// A policy's implementation: static gmm() and tgmm() on unmanaged row-major operands.
template <class Policy>
struct Impl {
  static_assert(!std::is_same<Policy, Policy>::value,
                "moe::gmm: no implementation for this Policy; moe::gmm::is_policy lists the tags");
};

template <class ExecSpace, class... Views>
constexpr void view_checks() {
  static_assert(Kokkos::is_execution_space<ExecSpace>::value,
                "moe::gmm: the first argument must be a Kokkos execution space instance");
  static_assert((Kokkos::is_view<Views>::value && ...), "moe::gmm: operands must be Kokkos::Views");
  static_assert((std::is_same<typename Views::array_layout, Kokkos::LayoutRight>::value && ...),
                "moe::gmm: operands must be LayoutRight (row-major) Views");
  static_assert(
      (Kokkos::SpaceAccessibility<ExecSpace, typename Views::memory_space>::accessible && ...),
      "moe::gmm: operands must be accessible from the execution space");
}

/// Whether an element type (const or not) is S or moe::bf16.
template <class T, class S>
inline constexpr bool row_element = std::is_same<std::remove_const_t<T>, S>::value || is_bf16<T>;

/// The compile-time rules of gmm (`Rhs` = rhs [G,k,n], out [m,n]) and tgmm (`Rhs` = dy [m,n],
/// out [G,k,n]): the weights (gmm's rhs, tgmm's out) hold S, the row operands S or moe::bf16.
template <class Policy, class ExecSpace, class Lhs, class Rhs, class Out, unsigned OutRank>
constexpr void static_checks() {
  static_assert(is_policy<Policy>::value, "moe::gmm: Policy is not a grouped-GEMM policy tag");
  view_checks<ExecSpace, Lhs, Rhs, Out>();
  static_assert(Lhs::rank == 2 && Rhs::rank == 5 - OutRank && Out::rank == OutRank,
                "moe::gmm: lhs must be rank 2, rhs rank 3 and out rank 2 (gmm), dy rank 2 and out "
                "rank 3 (tgmm)");
  using S = typename std::conditional_t<OutRank == 2, Rhs, Out>::non_const_value_type;
  static_assert(std::is_floating_point<S>::value,
                "moe::gmm: the weights (gmm's rhs, tgmm's out) must be float or double");
  static_assert(row_element<typename Lhs::value_type, S> &&
                    row_element<typename Rhs::value_type, S> &&
                    row_element<typename Out::value_type, S>,
                "moe::gmm: lhs, dy and out must hold the weights' scalar type or moe::bf16");
  static_assert(!std::is_const<typename Out::value_type>::value,
                "moe::gmm: out must be writable (non-const)");
}

}  // namespace moe::gmm::detail
