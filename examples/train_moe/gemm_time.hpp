#pragma once
// How much of train_moe's step is expert GEMMs: GemmClock times the GEMMs inside the MoE layers
// (Kokkos Tools region callbacks), expert_gemm_seconds times one rank's share of them run alone,
// the yardstick the step time is compared with.

#include "metrics.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/config_types.hpp>
#include <moe/detail/views.hpp>
#include <moe/gmm/gmm.hpp>

#include <Kokkos_Core.hpp>
#include <Kokkos_Random.hpp>

#include <moe/comm/mpi.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace train::detail {

/// Time spent in GEMMs (the library's "moe::gmm::*" and "moe::gemm" profiling regions, and
/// Kokkos Kernels' "KokkosBlas::gemm") while `active`, through Kokkos Tools region callbacks.
struct GemmClock {
  static inline bool active = false;
  static inline bool installed = false;
  static inline double seconds = 0;
  static inline double t0 = 0;
  static inline int depth = 0;            // open GEMM regions
  static inline std::vector<char> stack;  // per open region: 0 other, 1 GEMM, 2 timed GEMM

  static void push(char const* name) {
    bool const gemm = std::strncmp(name, "moe::gmm::", 10) == 0 ||
                      std::strcmp(name, "moe::gemm") == 0 ||
                      std::strncmp(name, "KokkosBlas::gemm", 16) == 0;
    char kind = 0;
    if (gemm) {
      kind = 1;
      if (depth++ == 0 && active) {
        kind = 2;
        t0 = now();
      }
    }
    stack.push_back(kind);
  }
  static void pop() {
    if (stack.empty()) return;
    char const kind = stack.back();
    stack.pop_back();
    if (kind == 0) return;
    --depth;
    if (kind == 2) seconds += now() - t0;
  }
  /// Installs the callbacks unless a Kokkos Tools library is loaded; returns whether it did.
  static bool install() {
    if (Kokkos::Tools::profileLibraryLoaded()) return false;
    Kokkos::Tools::Experimental::set_push_region_callback(&push);
    Kokkos::Tools::Experimental::set_pop_region_callback(&pop);
    installed = true;
    stack.clear();
    depth = 0;
    return true;
  }
  static void uninstall() {
    if (!installed) return;
    Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
    Kokkos::Tools::Experimental::set_pop_region_callback(nullptr);
    installed = false;
  }
};

/// \brief The yardstick of the step time: seconds of the routed-expert GEMMs of one device's
/// share of a step, run alone, as on one rank: `rows` = tokens per device x K rows spread evenly
/// over all E experts, for each of the `layers` MoE layers the 3 GEMMs of the forward and the 6
/// of the backward (gmm/tgmm of ExpertFfn, the layers' Auto policy), on random data; median of 3
/// after a warm-up. Every rank measures at the same time, so each has the CPU share it had during
/// the steps; the figure is rank 0's. Scratch of about 512 MB at most (one expert's worth if that
/// is more): the experts are timed in chunks. Collective.
template <class Scalar>
double expert_gemm_seconds(moe::comm::Communicator const& comm, moe::LayerConfig const& lc,
                           std::int64_t rows, int layers, std::uint64_t seed) {
  namespace mg = moe::gmm;
  using Exec = Kokkos::DefaultExecutionSpace;
  std::int64_t const E = lc.num_experts, D = lc.base_emb_dim, F = lc.base_moe_mlp_dim;
  // Bounded memory: the experts are timed in chunks of Ec that fit kBudget bytes (weights,
  // their gradients and the chunk's activations); with balanced rows every chunk is the same
  // work, so one chunk is timed and scaled by E / Ec.
  constexpr double kBudget = 512.0 * 1024 * 1024;
  double const per_expert =
      double(sizeof(Scalar)) *
      (6.0 * double(D) * double(F) + 3.0 * double(rows) / double(E) * double(D + F));
  std::int64_t const Ec =
      std::max<std::int64_t>(1, std::min<std::int64_t>(E, std::int64_t(kBudget / per_expert)));
  std::int64_t const rows_c = std::max<std::int64_t>(1, (rows * Ec + E / 2) / E);
  std::vector<std::int64_t> sizes(std::size_t(Ec), rows_c / Ec);
  for (std::int64_t e = 0; e < rows_c % Ec; ++e) ++sizes[std::size_t(e)];
  auto const groups = mg::make_groups<typename Exec::memory_space>(sizes);
  using v2 = moe::View2<Scalar, typename Exec::memory_space>;
  using v3 = moe::View3<Scalar, typename Exec::memory_space>;
  v2 xs("train::yard::xs", rows_c, D), dys("train::yard::dys", rows_c, D),
      dxs("train::yard::dxs", rows_c, D);
  v2 h0("train::yard::h0", rows_c, F), h1("train::yard::h1", rows_c, F),
      a("train::yard::a", rows_c, F);
  v3 w0("train::yard::w0", Ec, D, F), w1("train::yard::w1", Ec, D, F),
      wo("train::yard::wo", Ec, F, D);
  v3 g0("train::yard::g0", Ec, D, F), g1("train::yard::g1", Ec, D, F),
      go("train::yard::go", Ec, F, D);
  Kokkos::Random_XorShift64_Pool<Exec> pool(seed + 1);
  for (auto const* v : {&xs, &dys}) Kokkos::fill_random(*v, pool, Scalar(-1), Scalar(1));
  for (auto const* v : {&h0, &h1, &a}) Kokkos::fill_random(*v, pool, Scalar(-1), Scalar(1));
  for (auto const* v : {&w0, &w1, &wo}) Kokkos::fill_random(*v, pool, Scalar(-0.1), Scalar(0.1));
  Exec space;
  mg::GmmOptions tr, tr_acc;
  tr.transpose_rhs = tr_acc.transpose_rhs = true;
  tr_acc.accumulate = true;
  auto one_layer = [&] {
    mg::gmm(space, mg::Auto{}, xs, w0, groups, h0);  // forward
    mg::gmm(space, mg::Auto{}, xs, w1, groups, h1);
    mg::gmm(space, mg::Auto{}, a, wo, groups, dxs);
    mg::tgmm(space, mg::Auto{}, a, dys, groups, go);  // backward
    mg::gmm(space, mg::Auto{}, dys, wo, groups, a, tr);
    mg::tgmm(space, mg::Auto{}, xs, a, groups, g0);
    mg::tgmm(space, mg::Auto{}, xs, h1, groups, g1);
    mg::gmm(space, mg::Auto{}, a, w0, groups, dxs, tr);
    mg::gmm(space, mg::Auto{}, h1, w1, groups, dxs, tr_acc);
  };
  std::vector<double> times;
  for (int r = 0; r < 4; ++r) {
    moe::comm::check_mpi(MPI_Barrier(comm.get()), "MPI_Barrier");
    double const t0 = now();
    for (int l = 0; l < layers; ++l) one_layer();
    moe::detail::fence(space, "train::expert_gemm_seconds");
    if (r > 0) times.push_back(now() - t0);  // r = 0 warms up (BLAS threads, first touch)
  }
  std::sort(times.begin(), times.end());
  moe::View1<double, Kokkos::HostSpace> t("train::yard::t", 1);
  t(0) = comm.rank() == 0 ? times[1] * double(E) / double(Ec) : 0.0;
  moe::comm::all_reduce(comm, Kokkos::DefaultHostExecutionSpace(), t);
  return t(0);
}

}  // namespace train::detail
