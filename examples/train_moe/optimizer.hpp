#pragma once
// train_moe's optimizer: AdamW (decoupled weight decay, bias-corrected moments) on flat views,
// and the global gradient norm the updates are clipped by.

#include "config.hpp"
#include "params.hpp"

#include <moe/comm/collectives.hpp>
#include <moe/comm/communicator.hpp>
#include <moe/detail/compat.hpp>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace train::detail {

/// Sum over i of g(i)^2 in double (free function: nvcc forbids KOKKOS_LAMBDA in private members).
template <class Exec, class V>
double sum_of_squares(Exec const& space, V const& g) {
  double s = 0;
  Kokkos::parallel_reduce(
      "train::grad_norm", Kokkos::RangePolicy<Exec>(space, 0, g.extent(0)),
      KOKKOS_LAMBDA(std::int64_t i, double& acc) { acc += double(g(i)) * double(g(i)); }, s);
  return s;
}

/// Coefficients of one AdamW step (c1, c2: the bias corrections 1 / (1 - b^t)).
template <class Scalar>
struct AdamW {
  Scalar b1 = 0, b2 = 0, eps = 0, rate = 0, grad_scale = 1, decay = 0, c1 = 1, c2 = 1;
};

/// AdamW on flat views (decoupled weight decay, bias-corrected moments): raw pointers and one
/// load / one store per array and element, so the loop vectorises.
template <class Exec, class Scalar, class V>
void adamw_update(Exec const& space, AdamW<Scalar> const& a, V const& param, V const& grad,
                  V const& mom1, V const& mom2) {
  Scalar* p = param.data();
  Scalar const* g = grad.data();
  Scalar* mu = mom1.data();
  Scalar* nu = mom2.data();
  Scalar const b1 = a.b1, b2 = a.b2, eps = a.eps, rate = a.rate, gs = a.grad_scale, wd = a.decay,
               c1 = a.c1, c2 = a.c2;
  Kokkos::parallel_for(
      "train::adamw", Kokkos::RangePolicy<Exec>(space, 0, param.extent(0)),
      KOKKOS_LAMBDA(std::int64_t i) {
        Scalar const gi = gs * g[i];
        Scalar const m = b1 * mu[i] + (Scalar(1) - b1) * gi;
        Scalar const v = b2 * nu[i] + (Scalar(1) - b2) * gi * gi;
        Scalar const u = m * c1 / (moe::detail::sqrt(v * c2) + eps);
        Scalar const w = p[i];
        mu[i] = m;
        nu[i] = v;
        p[i] = w - rate * (u + wd * w);
      });
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
    adamw_update(space, a, q.p, q.g, q.m, q.v);
  }
}

}  // namespace train::detail
