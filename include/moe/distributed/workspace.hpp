#pragma once
/// \file
/// The buffers of one step by their typed handles (buffers.hpp), from one scratch pool: a stage
/// gets only the buffers its plan lists, in the plan's shape (routed rows may differ).

#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/buffers.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace moe::distributed {

/// A buffer of routed rows (role Rows): Values, or moe::bf16 where the plan declares it
/// Elem::bf16 and the layer can narrow (CanNarrow).
using moe::detail::RowsView;

/// \brief The [rows, cols] buffers of one step (see the file comment).
/// \tparam Value the C++ type of the role Values (the layer's value type).
/// \tparam CanNarrow whether buffers of role Rows may be moe::bf16 (the layer's GEMM policy takes
/// 16-bit rows: nn::stores_bf16); they are where the plan declares them Elem::bf16.
template <class Value, class MemorySpace, bool CanNarrow = false>
class StepWorkspace {
 public:
  using rows_t = RowsView<Value, MemorySpace, CanNarrow>;
  /// The C++ element type of a role.
  template <class Role>
  using elem_t = std::conditional_t<std::is_same_v<Role, Ints>, int, Value>;
  template <class Role>
  using view_t = View2<elem_t<Role>, MemorySpace>;

  /// The plan, and the stage now running (nullptr: outside any stage, for the step's input).
  void enter(StepPlan const* plan, Stage const* stage) {
    plan_ = plan;
    stage_ = stage;
  }

  /// The caller's tensor `caller` (an external Buf: Buf::y) for this step, [rows, cols]: the
  /// buffers the plan declares with BufferDecl::caller == `caller` are made as `v`.
  void bind(Buf caller, view_t<Values> v) { callers_[index(caller)] = v; }

  /// \brief The buffer `h` (undefined contents) with `rows` rows (-1: as declared; routed: any).
  template <class Role>
  view_t<Role> make(Handle<Role> h, std::int64_t rows = -1) {
    auto const& d = decl(h.id);
    if (rows < 0) rows = d.dims[0].n;
    check_make(h.id, d, rows);
    std::int64_t const cols = d.dims[1].n;
    if constexpr (std::is_same_v<Role, Values>)
      if (d.caller != Buf::count_) {
        auto const& v = callers_[index(d.caller)];
        moe::detail::require<Error>(
            std::int64_t(v.extent(0)) == rows && std::int64_t(v.extent(1)) == cols,
            "moe internal error: ", where(), " makes buffer ", to_string(h.id), " as the caller's ",
            to_string(d.caller), ", which is not bound in its shape");
        made_[index(h.id)] = true;
        return std::get<Views<Role>>(views_)[index(h.id)] = v;
      }
    auto buf = pool_.template get<elem_t<Role>>(to_string(h.id), std::size_t(rows * cols));
    made_[index(h.id)] = true;
    return std::get<Views<Role>>(views_)[index(h.id)] = view_t<Role>(buf.data(), rows, cols);
  }

  /// \brief The routed-rows buffer `h` as make() above, of the element the plan declares.
  rows_t make(Handle<Rows> h, std::int64_t rows = -1) {
    auto const& d = decl(h.id);
    Handle<Values> const v{h.id};
    moe::detail::require<Error>(d.caller == Buf::count_ || !narrow(h),
                                "moe internal error: 16-bit rows stand for the caller's ",
                                to_string(d.caller));
    rows_t r;
    if (!narrow(h)) {
      r.set(make(v, rows));
    } else if constexpr (CanNarrow) {
      if (rows < 0) rows = d.dims[0].n;
      check_make(h.id, d, rows);
      auto buf = pool_.template get<moe::bf16>(to_string(h.id), std::size_t(rows * d.dims[1].n));
      r.set(View2<moe::bf16, MemorySpace>(buf.data(), rows, d.dims[1].n));
      made_[index(h.id)] = true;
    }
    return rows_[index(h.id)] = r;
  }

  /// Whether the routed-rows buffer `h` is 16-bit in this step's plan (no stage access needed).
  bool narrow(Handle<Rows> h) const { return CanNarrow && decl(h.id).elem == Elem::bf16; }

  /// \brief The buffer `h` as the last make() shaped it; the running stage must list it.
  template <class Role>
  auto at(Handle<Role> h) const {
    declared(h, false);
    moe::detail::require<Error>(made_[index(h.id)], "moe internal error: step buffer '",
                                to_string(h.id), "' is read before any stage wrote it");
    if constexpr (std::is_same_v<Role, Rows>)
      return rows_[index(h.id)];
    else
      return std::get<Views<Role>>(views_)[index(h.id)];
  }

  /// The buffer `h` as rows of either width (a Values buffer: wide), for readers taking both.
  rows_t rows(Handle<Values> h) const {
    rows_t r;
    r.set(at(h));
    return r;
  }
  rows_t rows(Handle<Rows> h) const { return at(h); }
  /// The buffer `h` as Values, for readers taking only those (a Rows buffer the plan keeps wide).
  view_t<Values> values(Handle<Values> h) const { return at(h); }
  view_t<Values> values(Handle<Rows> h) const { return at(h).values(); }

  moe::detail::ScratchPool<MemorySpace>& pool() { return pool_; }  ///< the pool behind the buffers

 private:
  static constexpr std::size_t N = std::size_t(Buf::count_);
  static std::size_t index(Buf b) { return static_cast<std::size_t>(b); }
  /// The views of every buffer of one role, by Buf.
  template <class Role>
  using Views = std::array<view_t<Role>, N>;

  void check_make(Buf b, BufferDecl const& d, std::int64_t rows) const {
    declared(b, true);
    moe::detail::require<Error>(d.dims[0].routed || rows == d.dims[0].n,
                                "moe internal error: ", where(), " makes buffer ", to_string(b),
                                " with ", rows, " rows, but the plan declares ", d.dims[0].n);
  }
  std::string where() const {
    return stage_ ? "stage " + stage_->region : std::string("the step's input");
  }
  BufferDecl const& decl(Buf b) const {
    BufferDecl const* d = plan_ ? plan_->find(b) : nullptr;
    moe::detail::require<Error>(d != nullptr && d->dims.size() == 2,
                                "moe internal error: ", where(), " makes buffer ", to_string(b),
                                " that the step plan does not declare");
    return *d;
  }
  void declared(Ref r, bool write) const {
    if (!stage_) return;
    moe::detail::require<Error>(stage_->lists(r, write), "moe internal error: stage ",
                                stage_->region, " uses buffer '", to_string(r),
                                "' that its plan does not list among its ",
                                write ? "writes" : "reads or writes");
  }

  moe::detail::ScratchPool<MemorySpace> pool_;
  std::tuple<Views<Values>, Views<Ints>> views_;
  Views<Values> callers_;  ///< the caller's tensors bound for the step, by external Buf
  std::array<rows_t, N> rows_{};
  std::array<bool, N> made_{};
  StepPlan const* plan_ = nullptr;
  Stage const* stage_ = nullptr;
};

}  // namespace moe::distributed
