#pragma once
/// \file
/// The routed experts' stages on routed rows (workspace role Rows: float, or 16-bit where the plan
/// narrows them), shared by the sorted strategies.

#include <moe/detail/views.hpp>
#include <moe/distributed/buffers.hpp>

#include <cstdint>

namespace moe::distributed::stages {

/// The const view of a [rows, D] view (float or moe::bf16 rows).
template <class V>
auto const_rows(V const& v) {
  return View2<typename V::value_type const, typename V::memory_space>(v);
}

/// ys = the experts' FFN of xs, on the routed rows `xr` and `yr` (both of one width).
template <class Ctx, class Rows, class Groups>
void experts_forward(Ctx& ctx, Rows const& xr, Rows const& yr, Groups const& groups,
                     std::uint64_t weights_version) {
  xr.visit_with(yr, [&](auto const& xs, auto const& ys) {
    ctx.ffn.forward(ctx.space, ctx.cfg.mlp_activation, xs, groups, ctx.cp.wi_0, ctx.cp.wi_1,
                    ctx.cp.wo, ys, weights_version);
  });
}

/// The experts' backward from the routed rows `dyr`: their dx rows overwrite dyr (float rows, or
/// 16-bit ones: the two products summed in fp32 and rounded once), and the compute-block weight
/// gradients.
template <class Ctx, class Rows, class Groups>
void experts_backward(Ctx& ctx, Rows const& dyr, Groups const& groups) {
  dyr.visit([&](auto const& dys) {
    ctx.ffn.backward(ctx.space, dys, groups, ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, dys, ctx.gc.wi_0,
                     ctx.gc.wi_1, ctx.gc.wo);
  });
}

}  // namespace moe::distributed::stages
