#pragma once
/// \file
/// Weight stages of the distributed layer: stored blocks -> compute blocks, and compute-block
/// gradients -> stored-block gradients (the plan's ops), on buffers kept between steps.

#include <moe/detail/elementwise.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/reshard.hpp>
#include <moe/distributed/step_plan.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::distributed::stages {

/// A view of `shape` on the pool buffer of `key` (distinct keys for views alive together).
template <class V, class Ctx>
V shaped(Ctx& ctx, std::vector<std::int64_t> const& shape, std::string const& key) {
  auto buf = ctx.ws.pool().template get<typename Ctx::scalar_type>(
      key, std::size_t(detail::product(shape)));
  if constexpr (V::rank == 1)
    return V(buf.data(), shape[0]);
  else if constexpr (V::rank == 2)
    return V(buf.data(), shape[0], shape[1]);
  else
    return V(buf.data(), shape[0], shape[1], shape[2]);
}

/// Runs weight ops (the plan's to_compute or to_storage) on `cur`; returns the last block.
template <class Ctx, class V>
V run_weight_ops(Ctx& ctx, std::vector<WeightOp> const& ops, V cur, std::string const& key) {
  using Op = WeightOp::Kind;
  int k = 0;  // pool key of each intermediate
  for (auto const& op : ops) {
    if (op.kind == Op::all_reduce) {
      ctx.all_reduce(ctx.group_of(op.axes), cur);
      continue;
    }
    V next = shaped<V>(ctx, op.shape, key + "#" + std::to_string(k++));
    if (op.kind == Op::all_gather)
      ctx.all_gather(ctx.group_of(op.axes), cur, next, op.dim);
    else if (op.kind == Op::reduce_scatter)
      ctx.reduce_scatter(ctx.group_of(op.axes), cur, next, op.dim);
    else
      distributed::slice_dim(ctx.space, int(op.parts), int(op.index), cur, next, op.dim);
    cur = next;
  }
  return cur;
}

/// Stored blocks -> compute blocks (bf16: from rounded copies, remade for a new `version`, where
/// keeps_rounded_copy); true when an expert weight's compute block is new data in a reused buffer.
template <class Ctx>
bool gather_weights(Ctx& ctx, typename Ctx::params_type const& stored,
                    typename Ctx::params_type& compute, std::uint64_t version) {
  bool const reround = ctx.cfg.bf16() && ctx.rounded_version != version;
  bool fresh = reround;
  constexpr bool experts_round = std::decay_t<decltype(ctx.ffn)>::rounds_weights;
  Ctx::params_type::for_each_field(ctx.cfg, [&](char const* n, auto m) {
    auto src = stored.*m;
    std::string const name = n;
    if (keeps_rounded_copy(ctx.cfg, ctx.plan, name, experts_round, ctx.shared.round_weights)) {
      std::vector<std::int64_t> shape;
      for (unsigned d = 0; d < src.rank; ++d) shape.push_back(std::int64_t(src.extent(d)));
      auto copy = shaped<std::decay_t<decltype(src)>>(ctx, shape, "bf16." + name);
      if (reround) {
        Kokkos::deep_copy(ctx.space, copy, src);
        moe::detail::round_bf16(ctx.space, copy);
      }
      src = copy;
    }
    compute.*m = run_weight_ops(ctx, ctx.plan.weight(n).to_compute, src, "compute." + name);
    bool const expert = name == "wi_0" || name == "wi_1" || name == "wo";
    fresh = fresh || (expert && (compute.*m).data() != src.data());  // gathered or sliced
  });
  return fresh;
}

/// The compute-block gradients: `out`'s own where no op lies between, else zeroed kept buffers.
template <class Ctx>
void alloc_compute_grads(Ctx& ctx, typename Ctx::params_type& out) {
  using Scalar = typename Ctx::scalar_type;
  Ctx::params_type::for_each_field(ctx.cfg, [&](char const* n, auto m) {
    auto& g = ctx.gc.*m;
    if (ctx.plan.weight(n).to_storage.empty()) {
      g = out.*m;
      return;
    }
    if (g.data() == (out.*m).data()) g = {};  // it was the output block on an earlier plan
    auto const& like = ctx.cp.*m;
    std::string const label = std::string("moe::dist::d_") + n;
    if constexpr (std::decay_t<decltype(g)>::rank == 1)
      moe::detail::ensure(ctx.space, g, label, like.extent(0));
    else if constexpr (std::decay_t<decltype(g)>::rank == 2)
      moe::detail::ensure(ctx.space, g, label, like.extent(0), like.extent(1));
    else
      moe::detail::ensure(ctx.space, g, label, like.extent(0), like.extent(1), like.extent(2));
    Kokkos::deep_copy(ctx.space, g, Scalar(0));
  });
}

/// Compute-block gradients -> stored-block gradients (the transposes of gather_weights).
template <class Ctx>
void reduce_grads(Ctx& ctx, typename Ctx::params_type const& computed,
                  typename Ctx::params_type& out) {
  Ctx::params_type::for_each_field(ctx.cfg, [&](char const* n, auto m) {
    auto const& ops = ctx.plan.weight(n).to_storage;
    if (ops.empty()) return;
    Kokkos::deep_copy(ctx.space, out.*m,
                      run_weight_ops(ctx, ops, computed.*m, std::string("d.") + n));
  });
}

}  // namespace moe::distributed::stages
