#pragma once
/// \file
/// The buffers of one step of the distributed layer, by the names the step plan gives them
/// (distributed/step_plan.hpp). Storage comes from one scratch pool kept from step to step, so a
/// steady-state step allocates nothing; a stage gets a buffer only by a name it declares (reads
/// or writes), which keeps the printed plan and the running code in step.

#include <moe/detail/scratch.hpp>
#include <moe/detail/views.hpp>
#include <moe/distributed/step_plan.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::distributed {

/// \brief Named [rows, cols] buffers of one step (see the file comment).
template <class Scalar, class MemorySpace>
class StepWorkspace {
 public:
  using view2 = View2<Scalar, MemorySpace>;

  /// The stage now running: make() and at() accept only the names it declares.
  void enter(Stage const* stage) { stage_ = stage; }

  /// \brief The buffer `name` shaped [rows, cols] (contents undefined); the running stage must
  /// list it among its writes. Step inputs (x) are made outside any stage.
  template <class T = Scalar>
  View2<T, MemorySpace> make(std::string const& name, std::int64_t rows, std::int64_t cols) {
    declared(name, true);
    auto buf = pool_.template get<T>(name, std::size_t(rows * cols));
    View2<T, MemorySpace> v(buf.data(), rows, cols);
    if constexpr (std::is_same_v<T, Scalar>) live_[name] = v;
    return v;
  }

  /// \brief The buffer `name` as the last make() shaped it; the running stage must list it
  /// among its reads or writes.
  view2 at(std::string const& name) const {
    declared(name, false);
    auto it = live_.find(name);
    moe::detail::require<Error>(it != live_.end(), "moe internal error: step buffer '", name,
                                "' is read before any stage wrote it");
    return it->second;
  }

  /// The pool behind the buffers, for the temporaries of collectives and weight gathers.
  moe::detail::ScratchPool<MemorySpace>& pool() { return pool_; }

 private:
  void declared(std::string const& name, bool write) const {
    if (!stage_) return;
    auto has = [&](std::vector<std::string> const& v) {
      return std::find(v.begin(), v.end(), name) != v.end();
    };
    moe::detail::require<Error>(has(stage_->writes) || (!write && has(stage_->reads)),
                                "moe internal error: stage ", stage_->region, " uses buffer '",
                                name, "' that its plan does not list among its ",
                                write ? "writes" : "reads or writes");
  }

  moe::detail::ScratchPool<MemorySpace> pool_;
  std::map<std::string, view2> live_;
  Stage const* stage_ = nullptr;
};

}  // namespace moe::distributed
