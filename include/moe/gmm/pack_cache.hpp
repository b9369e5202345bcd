#pragma once
/// \file
/// PackCache: where a grouped-GEMM backend (OneDnn) keeps its reordered weights between calls.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

namespace moe::gmm {

/// \brief Reordered ("packed") copies of rhs weight tensors, passed to gmm through
/// GmmOptions::pack_cache. An entry (keyed by the tensor's address, shape, scalar size and use)
/// repacks when the version differs, so whoever writes the weights must hand the next call a new
/// version (MoeLayer::weights_changed), or when a hash of sampled values differs. Not thread-safe.
class PackCache {
 public:
  /// Identity of one use of one tensor (`rounded`: the packed values are rounded to bf16).
  struct Key {
    void const* data = nullptr;
    std::int64_t e0 = 0, e1 = 0, e2 = 0;
    int scalar_bytes = 0;
    bool transposed = false;
    bool rounded = false;
    bool operator<(Key const& o) const {
      return std::tie(data, e0, e1, e2, scalar_bytes, transposed, rounded) <
             std::tie(o.data, o.e0, o.e1, o.e2, o.scalar_bytes, o.transposed, o.rounded);
    }
  };

  /// The packed object of `key` if it was made from this version and sample hash, else nullptr.
  std::shared_ptr<void> find(Key const& key, std::uint64_t version, std::uint64_t samples) {
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second.version != version || it->second.samples != samples) {
      if (it != entries_.end() && it->second.version == version) ++stale_caught_;
      return nullptr;
    }
    ++hits_;
    return it->second.packed;
  }

  /// The packed object `key` holds from any version (nullptr if none): a backend repacking a
  /// new version writes into its storage, so a weight update costs a copy, not fresh pages.
  std::shared_ptr<void> previous(Key const& key) const {
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : it->second.packed;
  }

  /// Stores the packed object of `key` (replacing an older version's).
  void put(Key const& key, std::uint64_t version, std::uint64_t samples,
           std::shared_ptr<void> packed, std::size_t bytes) {
    auto& e = entries_[key];
    bytes_ -= e.bytes;
    e = Entry{version, samples, std::move(packed), bytes};
    bytes_ += bytes;
    ++packs_;
  }

  /// Drops every packed copy.
  void clear() {
    entries_.clear();
    bytes_ = 0;
  }

  /// Tensors packed so far (each repack counts).
  std::uint64_t packs() const { return packs_; }
  /// Calls that reused a packed tensor.
  std::uint64_t hits() const { return hits_; }
  /// Repacks forced by the sample hash although the version was unchanged.
  std::uint64_t stale_caught() const { return stale_caught_; }
  /// Bytes held by the packed copies.
  std::size_t bytes() const { return bytes_; }

 private:
  struct Entry {
    std::uint64_t version = 0, samples = 0;
    std::shared_ptr<void> packed;
    std::size_t bytes = 0;
  };
  std::map<Key, Entry> entries_;
  std::uint64_t packs_ = 0, hits_ = 0, stale_caught_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace moe::gmm
