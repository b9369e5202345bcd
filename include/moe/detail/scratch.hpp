#pragma once
/// \file
/// Named scratch buffers reused from call to call (per-step temporaries allocated once).

#include <moe/detail/views.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <map>
#include <string>

namespace moe::detail {

/// \brief Buffers kept under a key and grown, never shrunk, on demand: get<T>(key, n) is an
/// uninitialised view of n T on the buffer of `key`, valid until the next get of the same key
/// (distinct keys never alias). Not thread-safe: one pool per object that uses it.
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
