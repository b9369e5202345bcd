#pragma once
// The layers of train_moe's language model that are not MoE layers, forward and exact backward:
// token embedding, causal per-channel token mixing, RMSNorm, and the output projection with
// softmax cross-entropy. Tokens are rows t = b * S + p of [T, D] matrices (b: sequence, p:
// position, S: sequence length); every op is a Kokkos kernel on an execution-space instance.
//
// Parameter gradients are sums over tokens computed in a fixed order (each parameter entry owned by
// one thread, tokens added in order), so they are deterministic on every backend.

#include <moe/detail/blas.hpp>
#include <moe/detail/compat.hpp>
#include <moe/detail/views.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace train {

/// \brief Forward and backward of the driver's own layers.
/// \tparam Scalar float or double.
template <class Scalar, class ExecSpace = Kokkos::DefaultExecutionSpace>
struct ModelOps {
  using memory_space = typename ExecSpace::memory_space;
  using view1 = moe::View1<Scalar, memory_space>;
  using view2 = moe::View2<Scalar, memory_space>;
  using cview1 = moe::View1<Scalar const, memory_space>;
  using cview2 = moe::View2<Scalar const, memory_space>;
  using ctokens = moe::View1<std::int32_t const, memory_space>;
  using range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  using member = typename Kokkos::TeamPolicy<ExecSpace>::member_type;

  /// Runs body(t, c) for t = 0, 1, ..., rows - 1 in order and every column c < cols. Columns are
  /// split in blocks over teams and each column is owned by one thread, so accumulations into
  /// per-column outputs are race-free and in row order (deterministic); rows are walked
  /// contiguously, which is what a host backend needs (one thread per column striding through
  /// [T, D] was several times slower).
  template <class Body>
  static void rows_in_order(ExecSpace const& space, char const* label, std::int64_t rows,
                            std::int64_t cols, Body const& body) {
    std::int64_t const W = 1024, blocks = (cols + W - 1) / W;
    Kokkos::parallel_for(
        label, Kokkos::TeamPolicy<ExecSpace>(space, blocks, Kokkos::AUTO),
        KOKKOS_LAMBDA(member const& m) {
          std::int64_t const c0 = std::int64_t(m.league_rank()) * W;
          std::int64_t const c1 = c0 + W < cols ? c0 + W : cols;
          for (std::int64_t t = 0; t < rows; ++t)
            Kokkos::parallel_for(Kokkos::TeamThreadRange(m, c0, c1),
                                 [&](std::int64_t c) { body(t, c); });
        });
  }

  // ------------------------------------------------------------------ embedding ---------------
  /// out[t, :] = table[tok[t], :]. table [V, D], tok [T], out [T, D].
  static void embedding_forward(ExecSpace const& space, cview2 table, ctokens tok, view2 out) {
    std::int64_t const D = table.extent(1);
    Kokkos::parallel_for(
        "train::embedding_forward", range(space, 0, std::int64_t(out.extent(0)) * D),
        KOKKOS_LAMBDA(std::int64_t i) {
          std::int64_t const t = i / D, d = i % D;
          out(t, d) = table(tok(t), d);
        });
  }

  /// dtable[v, :] = sum over t with tok[t] == v of dout[t, :] (overwritten).
  static void embedding_backward(ExecSpace const& space, ctokens tok, cview2 dout, view2 dtable) {
    Kokkos::deep_copy(space, dtable, Scalar(0));
    rows_in_order(
        space, "train::embedding_backward", dout.extent(0), dtable.extent(1),
        KOKKOS_LAMBDA(std::int64_t t, std::int64_t d) { dtable(tok(t), d) += dout(t, d); });
  }

  // ------------------------------------------------------------------ causal token mixing -----
  /// out[t, d] = sum_{j < C, j <= p} w[j, d] * in[t - j, d]: a learned per-channel window over the
  /// last C tokens of the same sequence (zero before its start). w [C, D], in/out [T, D].
  static void mix_forward(ExecSpace const& space, cview2 w, cview2 in, std::int64_t S, view2 out) {
    std::int64_t const C = w.extent(0), D = w.extent(1);
    Kokkos::parallel_for(
        "train::mix_forward", range(space, 0, std::int64_t(in.extent(0)) * D),
        KOKKOS_LAMBDA(std::int64_t i) {
          std::int64_t const t = i / D, d = i % D, p = t % S;
          Scalar acc = 0;
          for (std::int64_t j = 0; j < C && j <= p; ++j) acc += w(j, d) * in(t - j, d);
          out(t, d) = acc;
        });
  }

  /// din[t, d] = sum_{j < C, p + j < S} w[j, d] * dout[t + j, d];
  /// dw[j, d] = sum_{t: p >= j} dout[t, d] * in[t - j, d] (both overwritten).
  static void mix_backward(ExecSpace const& space, cview2 w, cview2 in, cview2 dout, std::int64_t S,
                           view2 din, view2 dw) {
    std::int64_t const C = w.extent(0), D = w.extent(1), T = in.extent(0);
    Kokkos::parallel_for(
        "train::mix_backward_input", range(space, 0, T * D), KOKKOS_LAMBDA(std::int64_t i) {
          std::int64_t const t = i / D, d = i % D, p = t % S;
          Scalar acc = 0;
          for (std::int64_t j = 0; j < C && p + j < S; ++j) acc += w(j, d) * dout(t + j, d);
          din(t, d) = acc;
        });
    Kokkos::deep_copy(space, dw, Scalar(0));
    rows_in_order(
        space, "train::mix_backward_weights", T, D, KOKKOS_LAMBDA(std::int64_t t, std::int64_t d) {
          std::int64_t const p = t % S;
          for (std::int64_t j = 0; j < C && j <= p; ++j) dw(j, d) += dout(t, d) * in(t - j, d);
        });
  }

  // ------------------------------------------------------------------ RMSNorm -----------------
  /// y[t, :] = x[t, :] * inv[t] * g, inv[t] = 1 / sqrt(mean_d x[t, d]^2 + eps).
  static void rms_forward(ExecSpace const& space, cview2 x, cview1 g, double eps, view2 y,
                          view1 inv) {
    std::int64_t const D = x.extent(1);
    double const e = double(Scalar(eps));  // the epsilon of the dtype, as before
    Kokkos::parallel_for(
        "train::rms_forward", range(space, 0, std::int64_t(x.extent(0))),
        KOKKOS_LAMBDA(std::int64_t t) {
          // In double: a float32 sum of squares overflows for |x| above ~1e19 / sqrt(D), and the
          // row would normalise to 0 (the model silently dead).
          double ss = 0;
          for (std::int64_t d = 0; d < D; ++d) ss += double(x(t, d)) * double(x(t, d));
          double const r = 1.0 / moe::detail::sqrt(ss / double(D) + e);
          inv(t) = Scalar(r);
          for (std::int64_t d = 0; d < D; ++d) y(t, d) = Scalar(double(x(t, d)) * r * double(g(d)));
        });
  }

  /// dx[t, d] (= or +=) r g[d] dy[t, d] - r^3 x[t, d] / D * sum_e dy[t, e] g[e] x[t, e];
  /// dg[d] = sum_t dy[t, d] x[t, d] r[t] (overwritten).
  static void rms_backward(ExecSpace const& space, cview2 x, cview1 g, cview1 inv, cview2 dy,
                           view2 dx, bool accumulate, view1 dg) {
    std::int64_t const D = x.extent(1), T = x.extent(0);
    Kokkos::parallel_for(
        "train::rms_backward_input", range(space, 0, T), KOKKOS_LAMBDA(std::int64_t t) {
          // In double, like the forward: r^3 underflows float32 for |x| above ~1e13.
          double const r = double(inv(t));
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += double(dy(t, d)) * double(g(d)) * double(x(t, d));
          double const c = r * r * r * dot / double(D);
          for (std::int64_t d = 0; d < D; ++d) {
            Scalar const v = Scalar(r * double(g(d)) * double(dy(t, d)) - c * double(x(t, d)));
            dx(t, d) = accumulate ? dx(t, d) + v : v;
          }
        });
    Kokkos::deep_copy(space, dg, Scalar(0));
    rows_in_order(
        space, "train::rms_backward_scale", T, D,
        KOKKOS_LAMBDA(std::int64_t t, std::int64_t d) { dg(d) += dy(t, d) * x(t, d) * inv(t); });
  }

  // ------------------------------------------------------------------ output + cross-entropy --
  /// logits [T, V] = z [T, D] * W [D, V].
  static void project(ExecSpace const& space, cview2 z, cview2 W, view2 logits) {
    moe::detail::gemm(space, "N", "N", Scalar(1), z, W, Scalar(0), logits);
  }

  /// Per token: loss[t] = logsumexp(logits[t]) - logits[t, tgt[t]] and
  /// dlogits[t] = scale * (softmax(logits[t]) - onehot(tgt[t])), the gradient of
  /// scale * sum_t loss[t].
  static void cross_entropy(ExecSpace const& space, cview2 logits, ctokens tgt, double scale,
                            view1 loss, view2 dlogits) {
    std::int64_t const V = logits.extent(1);
    Scalar const s = Scalar(scale);
    Kokkos::parallel_for(
        "train::cross_entropy", range(space, 0, std::int64_t(logits.extent(0))),
        KOKKOS_LAMBDA(std::int64_t t) {
          Scalar m = logits(t, 0);
          for (std::int64_t v = 1; v < V; ++v) m = moe::detail::max(m, logits(t, v));
          Scalar sum = 0;
          for (std::int64_t v = 0; v < V; ++v) sum += moe::detail::exp(logits(t, v) - m);
          Scalar const lse = m + moe::detail::log(sum);
          loss(t) = lse - logits(t, tgt(t));
          for (std::int64_t v = 0; v < V; ++v)
            dlogits(t, v) =
                s * (moe::detail::exp(logits(t, v) - lse) - (v == tgt(t) ? Scalar(1) : Scalar(0)));
        });
  }

  /// dW [D, V] = z^T dlogits (overwritten); dz [T, D] = dlogits W^T (overwritten).
  static void project_backward(ExecSpace const& space, cview2 z, cview2 W, cview2 dlogits, view2 dz,
                               view2 dW) {
    moe::detail::gemm(space, "T", "N", Scalar(1), z, dlogits, Scalar(0), dW);
    moe::detail::gemm(space, "N", "T", Scalar(1), dlogits, W, Scalar(0), dz);
  }

  /// a += b (same shape, contiguous).
  static void add_into(ExecSpace const& space, cview2 b, view2 a) {
    std::int64_t const D = a.extent(1);
    Kokkos::parallel_for(
        "train::residual_add", range(space, 0, std::int64_t(a.extent(0)) * D),
        KOKKOS_LAMBDA(std::int64_t i) { a(i / D, i % D) += b(i / D, i % D); });
  }
};

}  // namespace train
