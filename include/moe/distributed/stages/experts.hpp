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

/// The experts' backward from the routed rows `dyr`: dxs (float; may be dyr's own float view)
/// and the compute-block weight gradients.
template <class Ctx, class Rows, class Groups>
void experts_backward(Ctx& ctx, Rows const& dyr, typename Ctx::view2 dxs, Groups const& groups) {
  dyr.visit([&](auto const& dys) {
    ctx.ffn.backward(ctx.space, dys, groups, ctx.cp.wi_0, ctx.cp.wi_1, ctx.cp.wo, dxs, ctx.gc.wi_0,
                     ctx.gc.wi_1, ctx.gc.wo);
  });
}

/// The float view the experts' dx rows go to: dy_local's own (float rows), else dx_local.
template <class Ctx>
typename Ctx::view2 experts_dx_rows(Ctx& ctx, bool make) {
  if (!ctx.ws.narrow(buf::dy_local)) return ctx.ws.at(buf::dy_local).wide;
  return make ? ctx.ws.make(buf::dx_local, ctx.ws.at(buf::dy_local).rows())
              : ctx.ws.at(buf::dx_local);
}

}  // namespace moe::distributed::stages
