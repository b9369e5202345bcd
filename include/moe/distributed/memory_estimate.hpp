#pragma once
/// \file
/// The report of an up-front memory estimate (memory.hpp): bytes per rank by item with the keys
/// that scale them; and the kernels' index limits.

#include <moe/detail/checked.hpp>
#include <moe/detail/json.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace moe::distributed {

/// \brief "1.5 GiB", "12.0 MiB", "3.2 KiB", "100 B".
inline std::string format_bytes(std::int64_t bytes) {
  char buf[64];
  static char const* const units[] = {"KiB", "MiB", "GiB", "TiB"};
  int u = 4;
  while (u > 0 && bytes < (std::int64_t(1) << (10 * u))) --u;
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", double(bytes) / double(std::int64_t(1) << (10 * u)),
                  units[u - 1]);
  return buf;
}

/// \brief One part of a memory estimate.
struct MemoryItem {
  std::string what;        ///< e.g. "weights", "expert hidden states"
  std::int64_t bytes = 0;  ///< per rank
  std::string keys;        ///< config keys that scale it, comma-separated ("a, b")
};

/// \brief Bytes one rank needs, item by item (see the file comment for the model).
struct MemoryEstimate {
  std::vector<MemoryItem> items;

  /// Sum of the items (ConfigError if it does not fit int64).
  std::int64_t total() const {
    std::int64_t t = 0;
    for (auto const& i : items) t = checked_add(t, i.bytes, "the memory estimate's total bytes");
    return t;
  }

  /// Adds `bytes` to the item `what` (made, with `keys`, if there is none; keys are merged).
  void add(std::string const& what, std::int64_t bytes, std::string const& keys) {
    for (auto& i : items)
      if (i.what == what) {
        i.bytes = checked_add(i.bytes, bytes, "bytes of " + what);
        i.keys = merge_keys(i.keys, keys);
        return;
      }
    items.push_back({what, bytes, keys});
  }

  /// Adds every item of `other`, `times` times (e.g. once per layer).
  void add(MemoryEstimate const& other, std::int64_t times = 1) {
    for (auto const& i : other.items)
      add(i.what, checked_mul(i.bytes, times, "bytes of " + i.what), i.keys);
  }

  /// The bytes of item `what` (0 when there is none).
  std::int64_t bytes(std::string const& what) const {
    for (auto const& i : items)
      if (i.what == what) return i.bytes;
    return 0;
  }

  /// Keys of the items that make up most (80 %) of the total, largest item first, each once.
  std::vector<std::string> keys_to_reduce() const {
    std::int64_t const t = total();
    std::int64_t covered = 0;
    std::string keys;
    for (auto const& i : by_size()) {
      if (i.bytes == 0) break;
      keys = merge_keys(keys, i.keys);
      covered += i.bytes;
      if (double(covered) >= 0.8 * double(t)) break;
    }
    return split_keys(keys);
  }

  /// The items of at least 1 % of the total, largest first, then "N smaller items".
  std::string breakdown() const {
    std::int64_t const t = total();
    std::string parts;
    int small = 0;
    for (auto const& i : by_size()) {
      if (i.bytes == 0) continue;
      if (double(i.bytes) < 0.01 * double(t))
        ++small;
      else
        parts += (parts.empty() ? "" : ", ") + i.what + " " + format_bytes(i.bytes);
    }
    if (small > 0)
      parts +=
          moe::detail::cat(parts.empty() ? "" : ", ", small, " smaller item", small > 1 ? "s" : "");
    return parts;
  }

  /// One line: "93.1 GiB (weights 1.2 GiB, optimizer 2.4 GiB, ...)".
  std::string text() const {
    std::string const parts = breakdown();
    return format_bytes(total()) + (parts.empty() ? "" : " (" + parts + ")");
  }

  /// Multi-line table, one item per line with its bytes and keys, then the total.
  std::string to_text() const {
    std::size_t w = 5;
    for (auto const& i : items) w = std::max(w, i.what.size());
    auto row = [w](std::string name, std::int64_t bytes) {
      name.append(w - name.size() + 2, ' ');
      std::string b = format_bytes(bytes);
      if (b.size() < 10) b.insert(0, 10 - b.size(), ' ');
      return "  " + name + b;
    };
    std::string o;
    for (auto const& i : items) o += row(i.what, i.bytes) + "  (" + i.keys + ")\n";
    return o + row("total", total()) + moe::detail::cat("  (", total(), " bytes)\n");
  }

  /// JSON object: {"total_bytes": N, "items": [{"what": ..., "bytes": N, "keys": [...]}, ...]}.
  moe::detail::ordered_json json() const {
    auto items_json = moe::detail::ordered_json::array();
    for (auto const& i : items)
      items_json.push_back({{"what", i.what}, {"bytes", i.bytes}, {"keys", split_keys(i.keys)}});
    return {{"total_bytes", total()}, {"items", items_json}};
  }
  std::string to_json() const { return moe::detail::json_text(json()); }  ///< json() as one line

  /// "a, b" -> {"a", "b"}.
  static std::vector<std::string> split_keys(std::string const& keys) {
    std::vector<std::string> out;
    std::stringstream ss(keys);
    std::string k;
    while (std::getline(ss, k, ',')) {
      auto const b = k.find_first_not_of(' ');
      if (b == std::string::npos) continue;
      k = k.substr(b, k.find_last_not_of(' ') - b + 1);
      if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
    }
    return out;
  }
  /// Union of two key lists, in order of first appearance.
  static std::string merge_keys(std::string const& a, std::string const& b) {
    std::string s;
    for (auto const& k : split_keys(a + "," + b)) s += (s.empty() ? "" : ", ") + k;
    return s;
  }

 private:
  std::vector<MemoryItem> by_size() const {
    std::vector<MemoryItem> v = items;
    std::stable_sort(v.begin(), v.end(),
                     [](MemoryItem const& a, MemoryItem const& b) { return a.bytes > b.bytes; });
    return v;
  }
};

/// \brief The kernels' index limits (see the file comment).
struct IndexLimits {
  /// Largest element count of one tensor a flat kernel may index (ExecSpace::size_type).
  std::int64_t max_elements = std::numeric_limits<std::int64_t>::max();
  std::int64_t max_rows = INT_MAX;  ///< largest GEMM operand or row-copy launch (32-bit BLAS, int)
  std::string element_index = "std::size_t";  ///< what max_elements comes from, for messages

  static IndexLimits host() { return IndexLimits{}; }  ///< host spaces: 64-bit flat indices
  /// The limits of an execution space, from the index type of its default RangePolicy.
  template <class ExecSpace>
  static IndexLimits of() {
    using I = typename ExecSpace::size_type;
    IndexLimits l;
    if (std::uint64_t(std::numeric_limits<I>::max()) <
        std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
      l.max_elements = std::int64_t(std::numeric_limits<I>::max());
      l.element_index = moe::detail::cat(sizeof(I) * 8, "-bit ", ExecSpace::name(), "::size_type");
    }
    return l;
  }
};

}  // namespace moe::distributed

namespace moe {
using distributed::format_bytes, distributed::IndexLimits, distributed::MemoryEstimate,
    distributed::MemoryItem;
}  // namespace moe
