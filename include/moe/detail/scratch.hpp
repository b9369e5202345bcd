#pragma once
/// \file
/// Named scratch buffers reused from call to call, so that per-step temporaries (gathered weight
/// blocks, pack buffers, receive buffers of reductions) are allocated and first touched once
/// instead of every step.

#include <moe/detail/views.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <map>
#include <string>

namespace moe::detail {

/// \brief Buffers kept under a key and grown, never shrunk, on demand.
///
/// get<T>(key, n) returns an unmanaged view of n elements of T on the buffer of `key`. A later get
/// of the same key may reallocate it, which invalidates the views handed out before; distinct
/// keys never alias. The contents are unspecified (not initialised). Not thread-safe: one pool
/// per object that uses it (e.g. per layer).
template <class MemorySpace>
class ScratchPool {
 public:
  template <class T>
  View1<T, MemorySpace> get(std::string const& key, std::size_t n) {
    static_assert(alignof(T) <= alignof(Word), "moe::detail::ScratchPool: over-aligned type");
    std::size_t const words = (n * sizeof(T) + sizeof(Word) - 1) / sizeof(Word);
    auto& buf = bufs_[key];
    if (buf.extent(0) < words) {
      buf = Buffer();  // release before allocating the bigger one
      buf = Buffer(Kokkos::view_alloc(Kokkos::WithoutInitializing, "moe::scratch::" + key), words);
    }
    return View1<T, MemorySpace>(reinterpret_cast<T*>(buf.data()), n);
  }

  /// Bytes held by the pool.
  std::size_t bytes() const {
    std::size_t s = 0;
    for (auto const& kb : bufs_) s += kb.second.extent(0) * sizeof(Word);
    return s;
  }

 private:
  using Word = double;  // storage unit: 8 bytes, 8-aligned
  using Buffer = Kokkos::View<Word*, MemorySpace>;
  std::map<std::string, Buffer> bufs_;
};

}  // namespace moe::detail
