#pragma once
/// \file
/// Compile-time policy bundle of a MoE layer: routing, grouped GEMM and partitioning.
/// Runtime numbers (E, K, dims, capacity) live in LayerConfig; algorithms are types.

#include <moe/gmm/gmm.hpp>
#include <moe/routing/router.hpp>

#include <type_traits>

namespace moe {

namespace partition {
/// \brief Single-rank layer: no communication.
struct Local {};
}  // namespace partition

/// \brief The policies of one layer type.
/// \tparam Routing routing::Auto (from the config), TopKSoftmax, DeepSeek or Random.
/// \tparam Gmm gmm::Auto (the backend's best), OneDnn, Vendor, Tiled<TM,TK,TN> or Dense (every
///         expert on every token, masked: the reference, also what `sparse_matmul: false` runs).
/// \tparam Partition partition::Local.
template <class Routing = routing::Auto, class Gmm = gmm::Auto, class Partition = partition::Local>
struct Policies {
  using routing_policy = Routing;
  using gmm_policy = Gmm;
  using partition_policy = Partition;
  static_assert(routing::is_policy<Routing>::value,
                "Routing must be a routing policy: routing::Auto, TopKSoftmax, DeepSeek or Random");
  static_assert(gmm::is_policy<Gmm>::value,
                "Gmm must be a grouped-GEMM policy: gmm::Auto, OneDnn, Vendor, Tiled<TM,TK,TN> or "
                "Dense");
  static_assert(std::is_same_v<Partition, partition::Local>,
                "Partition must be partition::Local on one rank");
};

/// \brief Default policies: routing from the config, the backend's best grouped GEMM, one rank.
using DefaultPolicies = Policies<>;

}  // namespace moe
