#pragma once
// train_moe's optimizer: AdamW (decoupled weight decay, bias-corrected moments) on flat views,
// and the global gradient norm the updates are clipped by.

#include "config.hpp"
#include "params.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/compat.hpp>

#include <Kokkos_Core.hpp>

#include <moe/bf16.hpp>
#include <moe/error.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace train::detail {

/// \brief AdamW's moments of every parameter, each moment in one flat buffer: Scalar, or 16-bit
/// bf16 with mu_dtype / weight_dtype=bfloat16 (TrainConfig::bf16_mu, bf16_nu).
template <class Scalar>
struct Moments {
  typename Param<Scalar>::view1 m, v;       ///< unless stored in bf16
  typename Param<Scalar>::view16 m16, v16;  ///< mu_dtype / weight_dtype=bfloat16

  Moments() = default;
  /// Allocates the moments of `params` and points each at its part, with host mirrors for
  /// checkpoints (a bf16 moment has one only while a checkpoint is saved or loaded).
  Moments(TrainConfig const& cfg, std::vector<Param<Scalar>>& params) {
    using view1 = typename Param<Scalar>::view1;
    using view16 = typename Param<Scalar>::view16;
    std::int64_t n_all = 0;
    for (auto const& q : params) n_all += q.size();
    bool const mu16 = cfg.bf16_mu(), nu16 = cfg.bf16_nu();
    if (mu16)
      m16 = view16("train::adam_mu_bf16", n_all);
    else
      m = view1("train::adam_mu", n_all);
    if (nu16)
      v16 = view16("train::adam_nu_bf16", n_all);
    else
      v = view1("train::adam_nu", n_all);
    std::int64_t at = 0;
    for (auto& q : params) {
      std::int64_t const n = q.size();
      if (mu16)
        q.m16 = view16(m16.data() + at, n);
      else
        q.m = view1(m.data() + at, n), q.m_host = Kokkos::create_mirror_view(q.m);
      if (nu16)
        q.v16 = view16(v16.data() + at, n);
      else
        q.v = view1(v.data() + at, n), q.v_host = Kokkos::create_mirror_view(q.v);
      at += n;
    }
  }

  /// Bytes of both moments (bf16 ones: 2 an element).
  std::int64_t bytes() const {
    return std::int64_t((m.span() + v.span()) * sizeof(Scalar) +
                        (m16.span() + v16.span()) * sizeof(moe::bf16));
  }
};

/// Sum over i of g(i)^2 in double (free function: nvcc forbids KOKKOS_LAMBDA in private members).
/// Each work item sums 16 consecutive elements, so the running sum takes one add per 16
/// elements instead of one per element (a chain of dependent adds, not the memory, had set the
/// speed: 360 ms per step for a rank's 302 M gradients, bench/results/train_profile_qwen3.md).
template <class Exec, class V>
double sum_of_squares(Exec const& space, V const& g) {
  constexpr std::int64_t kChunk = 16;
  std::int64_t const n = std::int64_t(g.extent(0));
  auto const* p = g.data();
  double s = 0;
  Kokkos::parallel_reduce(
      "train::grad_norm", Kokkos::RangePolicy<Exec>(space, 0, (n + kChunk - 1) / kChunk),
      KOKKOS_LAMBDA(std::int64_t c, double& acc) {
        std::int64_t const end = c * kChunk + kChunk < n ? c * kChunk + kChunk : n;
        double part = 0;
        for (std::int64_t i = c * kChunk; i < end; ++i) part += double(p[i]) * double(p[i]);
        acc += part;
      },
      s);
  return s;
}

/// Coefficients of one AdamW step (c1, c2: the bias corrections 1 / (1 - b^t)).
template <class Scalar>
struct AdamW {
  Scalar b1 = 0, b2 = 0, eps = 0, rate = 0, grad_scale = 1, decay = 0, c1 = 1, c2 = 1;
};

/// A stored moment as Scalar (bf16: exact) and a Scalar into its storage (bf16: rounded to
/// nearest even).
template <class Scalar>
KOKKOS_INLINE_FUNCTION Scalar load_moment(Scalar x) {
  return x;
}
template <class Scalar>
KOKKOS_INLINE_FUNCTION Scalar load_moment(moe::bf16 x) {
  return Scalar(moe::detail::bf16_to_float(x.bits));
}
template <class Stored, class Scalar>
KOKKOS_INLINE_FUNCTION Stored store_moment(Scalar x) {
  if constexpr (std::is_same_v<Stored, moe::bf16>)
    return moe::bf16(float(x));
  else
    return x;
}

/// \brief AdamW on flat arrays of n elements (decoupled weight decay, bias-corrected moments):
/// raw pointers and one load / one store per array and element, so the loop vectorises.
///
/// Mu, Nu: the moments' storage, Scalar or moe::bf16 (mu_dtype / weight_dtype=bfloat16): the
/// update is computed in Scalar from the stored moments and the new moments are rounded when
/// stored (optax's mu_dtype: the update uses the unrounded moment). RoundWeights
/// (weight_dtype=bfloat16): the new parameter is rounded to bf16.
template <bool RoundWeights, class Exec, class Scalar, class Mu, class Nu>
void adamw_update(Exec const& space, AdamW<Scalar> const& a, std::int64_t n, Scalar* p,
                  Scalar const* g, Mu* mu, Nu* nu) {
  Scalar const b1 = a.b1, b2 = a.b2, eps = a.eps, rate = a.rate, gs = a.grad_scale, wd = a.decay,
               c1 = a.c1, c2 = a.c2;
  Kokkos::parallel_for(
      "train::adamw", Kokkos::RangePolicy<Exec>(space, 0, n), KOKKOS_LAMBDA(std::int64_t i) {
        Scalar const gi = gs * g[i];
        Scalar const m = b1 * load_moment<Scalar>(mu[i]) + (Scalar(1) - b1) * gi;
        Scalar const v = b2 * load_moment<Scalar>(nu[i]) + (Scalar(1) - b2) * gi * gi;
        Scalar const u = m * c1 / (moe::detail::sqrt(v * c2) + eps);
        Scalar const w = p[i];
        mu[i] = store_moment<Mu>(m);
        nu[i] = store_moment<Nu>(v);
        Scalar const w1 = w - rate * (u + wd * w);
        if constexpr (RoundWeights)
          p[i] = round_bf16(w1);
        else
          p[i] = w1;
      });
}

/// AdamW on one parameter block, with its moments' storage and weight rounding (Param).
template <class Exec, class Scalar>
void adamw_update(Exec const& space, AdamW<Scalar> const& a, Param<Scalar>& q) {
  Scalar* p = q.p.data();
  Scalar const* g = q.g.data();
  std::int64_t const n = q.size();
  auto run = [&](auto* mu, auto* nu) {
    if (q.bf16_weights)
      adamw_update<true>(space, a, n, p, g, mu, nu);
    else
      adamw_update<false>(space, a, n, p, g, mu, nu);
  };
  if constexpr (std::is_same_v<Scalar, float>) {
    if (q.m16.data() && q.v16.data()) return run(q.m16.data(), q.v16.data());
    if (q.m16.data()) return run(q.m16.data(), q.v.data());
    if (q.v16.data()) return run(q.m.data(), q.v16.data());
  } else {
    moe::detail::require<moe::Error>(!q.m16.data() && !q.v16.data() && !q.bf16_weights,
                                     "train: bf16 optimizer state needs a float run");
  }
  run(q.m.data(), q.v.data());
}

/// Collective: the global gradient norm, every block counted once (its sum of squares divided
/// by the ranks holding it).
template <class Exec, class Scalar>
double global_grad_norm(Exec const& space, moe::comm::Communicator const& comm,
                        std::vector<Param<Scalar>> const& params) {
  moe::View1<double, Kokkos::HostSpace> sq("train::grad_norm_sq", 1);
  for (auto const& q : params) sq(0) += sum_of_squares(space, q.g) / q.replicas;
  moe::comm::all_reduce(comm, Kokkos::DefaultHostExecutionSpace(), sq);
  return std::sqrt(sq(0));
}

/// Step t (1-based) of AdamW on every parameter: learning rate `lr`, gradients scaled by
/// `grad_scale` (the clipping factor), cfg's betas, epsilon and weight decay (parameters with
/// decay == false get none).
template <class Exec, class Scalar>
void adamw_step(Exec const& space, TrainConfig const& cfg, std::vector<Param<Scalar>>& params,
                double lr, double grad_scale, std::int64_t t) {
  AdamW<Scalar> a;
  a.b1 = Scalar(cfg.adam_b1);
  a.b2 = Scalar(cfg.adam_b2);
  a.eps = Scalar(cfg.adam_eps);
  a.rate = Scalar(lr);
  a.grad_scale = Scalar(grad_scale);
  a.c1 = Scalar(1.0 / (1.0 - std::pow(cfg.adam_b1, double(t))));
  a.c2 = Scalar(1.0 / (1.0 - std::pow(cfg.adam_b2, double(t))));
  for (auto& q : params) {
    a.decay = q.decay ? Scalar(cfg.adam_weight_decay) : Scalar(0);
    adamw_update(space, a, q);
  }
}

}  // namespace train::detail
