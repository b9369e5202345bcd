#pragma once
/// \file
/// The layout of one distributed MoE layer: mesh, token, expert and tensor axes, the route to the
/// experts and where every weight lives; a pure function of the configuration and the rank.

#include <moe/config.hpp>
#include <moe/distributed/parallel_config.hpp>
#include <moe/error.hpp>
#include <moe/sharding/mesh.hpp>
#include <moe/sharding/presets.hpp>
#include <moe/sharding/rules.hpp>
#include <moe/tensor_block.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moe::distributed {

/// \brief How the routed experts are reached.
enum class ExpertRoute {
  Local,       ///< no expert parallelism
  RaggedA2A,   ///< batch split over the expert axis: rows travel by ragged all-to-all
  Ring,        ///< tokens all-gathered over the expert axis, outputs reduce-scattered
  Replicated,  ///< every expert-axis rank holds the same tokens: outputs all-reduced
  EpTp  ///< tokens split on D over the expert axis: gathered on D, outputs reduce-scattered on D
};

/// \brief How the shared expert is computed under expert parallelism (same result).
enum class SharedExpert {
  none,  ///< no shared expert
  /// Own tokens, hidden dim over tensor only: the default with tokens split over the expert axes.
  own,
  /// EP-as-TP: hidden dim over tensor x expert on the expert group's tokens (replicated, EP-TP).
  split
};

/// "none", "own tokens", "ep-as-tp".
inline char const* to_string(SharedExpert s) {
  return s == SharedExpert::own ? "own tokens" : s == SharedExpert::split ? "ep-as-tp" : "none";
}

/// \brief Stable name of a route: "local", "ragged_all_to_all", "ring", "replicated", "ep_tp".
inline char const* to_string(ExpertRoute r) {
  static char const* const names[] = {"local", "ragged_all_to_all", "ring", "replicated", "ep_tp"};
  static_assert(sizeof(names) / sizeof(names[0]) == int(ExpertRoute::EpTp) + 1,
                "one name per ExpertRoute");
  return names[static_cast<int>(r)];
}

/// Layout of one dimension of one tensor.
struct DimLayout {
  std::vector<std::string> storage;  ///< mesh axes (size > 1) the stored block is split over
  std::vector<std::string> gather;   ///< storage axes the compute block spans (all-gathered)
  std::vector<std::string> slice;    ///< axes the compute block is split over beyond storage
  std::int64_t global = 0, stored = 0, computed = 0;
};

/// Layout of one weight: per dim, plus the token axes over which gradient contributions differ.
struct WeightLayout {
  std::string name;
  sharding::LogicalAxes logical;  ///< logical names of the stored tensor's dimensions
  sharding::PartitionSpec spec;   ///< storage spec as the rules resolve it (size-1 axes kept)
  std::vector<DimLayout> dims;
  std::vector<std::string> reduce;  ///< token axes whose contributions are summed (not gathered)
};

namespace detail {

inline bool contains(std::vector<std::string> const& v, std::string const& a) {
  return std::find(v.begin(), v.end(), a) != v.end();
}
/// Elements of a not in b, in a's order.
inline std::vector<std::string> minus(std::vector<std::string> const& a,
                                      std::vector<std::string> const& b) {
  std::vector<std::string> out;
  for (auto const& x : a)
    if (!contains(b, x)) out.push_back(x);
  return out;
}
/// The names of v separated by `sep`, `empty` when there is none.
inline std::string join(std::vector<std::string> const& v, char const* sep = ",",
                        char const* empty = "none") {
  std::string s;
  for (auto const& a : v) s += (s.empty() ? "" : sep) + a;
  return s.empty() ? empty : s;
}

/// Logical names of the dense-path dispatch tensor [E, B, C, D] (MaxText's `dispatch_axis`).
inline sharding::LogicalAxes dispatch_logical() {
  return {"activation_exp", "activation_batch_moe", std::nullopt, "activation_embed_moe"};
}

/// Logical axes of the expert weights (stored, computed) and the mesh axes the latter strip.
struct ExpertWeightAxes {
  sharding::LogicalAxes wi, wo, wi_compute, wo_compute;
  std::vector<std::string> strip;
};
/// MaxText's choice (layers/moe.py) under shard_exp_on_fsdp, use_2d_fsdp_sharding, or neither.
inline ExpertWeightAxes expert_weight_axes(ParallelConfig const& par) {
  using std::nullopt;
  if (par.shard_exp_on_fsdp)
    return {{"embed_moe", nullopt, "mlp_moe"},
            {"embed_moe", "mlp_moe", nullopt},
            {nullopt, nullopt, "mlp_no_fsdp"},
            {nullopt, "mlp_no_fsdp", nullopt},
            {}};
  if (par.use_2d_fsdp_sharding)
    return {{"embed_moe", "mlp_moe", nullopt},
            {"embed_moe", "mlp_moe", nullopt},
            {nullopt, "mlp_no_fsdp", nullopt},
            {nullopt, "mlp_no_fsdp", nullopt},
            {}};
  return {{"exp", "embed_moe", "mlp_moe"},
          {"exp", "mlp_moe", "embed_moe"},
          {"exp", nullopt, "mlp_no_fsdp"},
          {"exp", "mlp_no_fsdp", nullopt},
          {"fsdp"}};
}

}  // namespace detail

/// \brief Everything about one rank's share of the layer that follows from the configuration.
struct Layout {
  sharding::Mesh mesh;
  std::string preset;  ///< name of the mesh-and-rule set in effect
  sharding::LogicalRules rules;
  int rank = 0;
  std::int64_t global_batch = 0, seq_len = 0, emb_dim = 0;
  sharding::LogicalAxes token_logical;  ///< logical names of x / y [B, S, D]
  sharding::PartitionSpec token_spec;   ///< x / y spec as the rules resolve it
  std::vector<std::string> batch_axes;  ///< mesh axes (size > 1) the batch is split over
  std::vector<std::string> ep_axes;     ///< expert-parallel axes (size > 1)
  std::vector<std::string> tp_axes;     ///< tensor axes splitting the expert hidden dim
  std::vector<std::string> emb_axes;    ///< mesh axes D of x / y is split over (EP-TP: ep_axes)
  std::int64_t batch_parts = 1, batch_index = 0;
  std::int64_t local_experts = 0, first_expert = 0;  ///< L = E / ep and this rank's first expert
  ExpertRoute route = ExpertRoute::Local;
  SharedExpert shared = SharedExpert::none;  ///< how the shared expert is computed
  bool dense = false;                     ///< dense masked experts (never on the ragged all-to-all)
  sharding::PartitionSpec dispatch_spec;  ///< the dense-path dispatch tensor as MaxText resolves it
  std::vector<WeightLayout> weights;

  /// Product of the sizes of `axes`.
  std::int64_t parts(std::vector<std::string> const& axes) const {
    std::int64_t p = 1;
    for (auto const& a : axes) p *= mesh.size(a);
    return p;
  }
  /// Row-major index of this rank over `axes` (in the given order).
  std::int64_t shard_index(std::vector<std::string> const& axes) const {
    std::int64_t idx = 0;
    for (auto const& a : axes) idx = idx * mesh.size(a) + mesh.coord(rank, a);
    return idx;
  }
  /// The axes of size > 1, in order.
  std::vector<std::string> big(std::vector<std::string> const& axes) const {
    std::vector<std::string> out;
    for (auto const& a : axes)
      if (mesh.size(a) > 1) out.push_back(a);
    return out;
  }
  std::int64_t ep() const { return parts(ep_axes); }  ///< expert-parallel degree
  std::int64_t tp() const { return parts(tp_axes); }  ///< tensor-parallel degree

  /// Layout of the weight `name` (ConfigError when the layer has no such tensor).
  WeightLayout const& weight(std::string const& name) const {
    for (auto const& w : weights)
      if (w.name == name) return w;
    throw ConfigError(moe::detail::cat("no tensor named '", name, "' in this layer"));
  }

  /// \brief The block of `name` this rank holds: "x", "y", "dy", "dx" ([B,S,D]) or a weight.
  TensorBlock block(std::string const& name) const {
    if (name == "x" || name == "y" || name == "dx" || name == "dy") {
      std::int64_t const b = global_batch / batch_parts, d = emb_dim / parts(emb_axes);
      return {{global_batch, seq_len, emb_dim},
              {b, seq_len, d},
              {batch_index * b, 0, shard_index(emb_axes) * d}};
    }
    TensorBlock tb;
    for (auto const& d : weight(name).dims) {
      tb.global_shape.push_back(d.global);
      tb.local_shape.push_back(d.stored);
      tb.offset.push_back(shard_index(d.storage) * d.stored);
    }
    return tb;
  }
};

/// \brief The layout of `rank` of `world_size` ranks for a global batch [global_batch, seq_len, D]:
/// every spec resolved and every divisibility checked (ConfigError naming the value and the rule).
/// \param dense_gmm the GEMM policy runs every expert densely (gmm::Dense), as sparse_matmul=false
/// \param shared the shared expert's strategy (SharedExpert::none: the default choice)
inline Layout compute_layout(LayerConfig const& cfg, ParallelConfig const& par, int world_size,
                             int rank, std::int64_t global_batch, std::int64_t seq_len,
                             bool dense_gmm = false, SharedExpert shared = SharedExpert::none) {
  using detail::contains;
  using detail::join;
  using detail::minus;
  using moe::detail::require;
  cfg.validate();
  par.validate();
  // Accepted by the parser, not built: refused, never ignored.
  require<ConfigError>(par.expert_shard_attention_option != "context",
                       "expert_shard_attention_option=context is not supported: it splits the "
                       "sequence over the expert axis, and the MoE layer has no sequence "
                       "(context) parallelism; use fsdp or tp");
  Layout lay;
  auto const pre = par.effective_preset();  // the file's mesh_axes / rules, or the preset
  lay.mesh = sharding::Mesh::from_ici(par.ici(), world_size, pre.mesh_axes);
  require<ConfigError>(rank >= 0 && rank < world_size, "rank ", rank, " is outside [0, ",
                       world_size, ")");
  lay.preset = pre.name;
  // expert_shard_attention_option=tp: the expert axis splits the tokens' embedding dim (EP-TP).
  lay.rules = par.expert_shard_attention_option == "tp" ? sharding::expert_shards_embed(pre.rules)
                                                        : pre.rules;
  lay.rank = rank;
  lay.global_batch = global_batch;
  lay.seq_len = seq_len;
  lay.emb_dim = cfg.base_emb_dim;
  auto const E = cfg.num_experts, D = cfg.base_emb_dim, F = cfg.base_moe_mlp_dim;
  auto resolve = [&](sharding::LogicalAxes const& l) { return lay.rules.resolve(l); };
  auto dimaxes = [&](sharding::PartitionSpec const& s, int d) { return lay.big(s[d]); };
  auto parts = [&](std::vector<std::string> const& axes) { return lay.parts(axes); };
  lay.token_logical = {"activation_batch", "activation_norm_length", "activation_embed"};
  auto const xs = lay.token_spec = resolve(lay.token_logical);
  require<ConfigError>(dimaxes(xs, 1).empty(), "the sequence dimension resolves to mesh axes [",
                       join(dimaxes(xs, 1)),
                       "]: sequence (context) parallelism is not supported by the MoE "
                       "layer; set those ici_* degrees to 1");
  lay.batch_axes = dimaxes(xs, 0);
  auto const emb_over = dimaxes(xs, 2);  // the tensor axes there are ignored, as ever
  auto const ew = detail::expert_weight_axes(par);
  auto const wi_st = resolve(ew.wi), wo_st = resolve(ew.wo);
  auto const wi_cp = sharding::remove_mesh_axes(resolve(ew.wi_compute), ew.strip);
  auto const wo_cp = sharding::remove_mesh_axes(resolve(ew.wo_compute), ew.strip);
  if (par.shard_exp_on_fsdp || par.use_2d_fsdp_sharding) {
    // The compute specs leave the expert dimension whole (MaxText's validate_shard_expert_on_fsdp).
    char const* const key =
        par.shard_exp_on_fsdp ? "shard_exp_on_fsdp=true" : "use_2d_fsdp_sharding=true";
    auto const expert = lay.mesh.size("expert");
    require<ConfigError>(expert == 1, key, " needs an expert mesh axis of size 1 (it is ", expert,
                         "): the expert weights are computed with every expert on every rank "
                         "(in-spec ",
                         sharding::to_json(wi_cp), "), so no expert axis is left to route over");
    // use_2d_fsdp_sharding: the tensor axis would split wi's embedding dimension.
    require<ConfigError>(par.shard_exp_on_fsdp || dimaxes(wi_cp, 1).empty(), key,
                         " splits wi's embedding dimension over mesh axes [",
                         join(dimaxes(wi_cp, 1)), "] (in-spec ", sharding::to_json(wi_cp),
                         ") while the layer's input keeps it whole; set those ici_* degrees to 1");
  }
  lay.ep_axes = dimaxes(wi_cp, 0);
  lay.tp_axes = dimaxes(wi_cp, 2);
  auto const& ep_axes = lay.ep_axes;
  auto const ep_st = dimaxes(wi_st, 0);
  require<ConfigError>(
      ep_st.size() >= ep_axes.size() && std::equal(ep_axes.begin(), ep_axes.end(), ep_st.begin()),
      "the expert dimension is stored over [", join(ep_st), "] but computed over [", join(ep_axes),
      "]: the compute axes must lead the storage axes");
  std::int64_t const ep = parts(ep_axes);
  auto divisible = [&](std::int64_t n, char const* key, std::vector<std::string> const& axes) {
    require<ConfigError>(n % parts(axes) == 0, key, "=", n,
                         " is not divisible by the product of mesh axes [", join(axes),
                         "] = ", parts(axes));
  };
  divisible(E, "num_experts", ep_st);
  divisible(D, "base_emb_dim", dimaxes(wi_st, 1));
  divisible(D, "base_emb_dim", dimaxes(wo_st, 2));
  divisible(F, "base_moe_mlp_dim", dimaxes(wi_st, 2));
  divisible(F, "base_moe_mlp_dim", lay.tp_axes);
  divisible(D, "base_emb_dim", lay.tp_axes);  // partial outputs are reduce-scattered over D
  // EP-TP: the tokens' embedding dim resolves to expert axes, which must be all of them.
  lay.emb_axes = minus(emb_over, minus(emb_over, ep_axes));
  if (!lay.emb_axes.empty()) {
    require<ConfigError>(lay.emb_axes == ep_axes,
                         "the embedding dimension of the tokens resolves to the expert axes [",
                         join(lay.emb_axes), "] but the experts are split over [", join(ep_axes),
                         "]: EP-TP needs them to be the same");
    require<ConfigError>(lay.tp_axes.empty(), "EP-TP (the tokens' embedding dimension over [",
                         join(ep_axes), "]) does not compose with tensor parallelism over [",
                         join(lay.tp_axes), "]: set those ici_* degrees to 1");
    divisible(D, "base_emb_dim", lay.emb_axes);
  }
  // A batch that does not divide over its axes is replicated over the expert axes (decode).
  auto& batch_axes = lay.batch_axes;
  std::int64_t const bp = parts(batch_axes);
  auto const all_ep_in_batch = [&] {
    return std::all_of(ep_axes.begin(), ep_axes.end(),
                       [&](auto const& a) { return contains(batch_axes, a); });
  };
  if (global_batch % bp != 0 && !ep_axes.empty() && all_ep_in_batch() &&
      global_batch % (bp / ep) == 0)
    batch_axes = minus(batch_axes, ep_axes);
  require<ConfigError>(global_batch >= 1 && seq_len >= 1, "global batch ", global_batch,
                       " and sequence length ", seq_len, " must be >= 1");
  require<ConfigError>(global_batch % parts(batch_axes) == 0, "global batch=", global_batch,
                       " is not divisible by the product of its mesh axes [", join(batch_axes),
                       "] = ", parts(batch_axes));
  lay.batch_parts = parts(batch_axes);
  lay.batch_index = lay.shard_index(batch_axes);
  lay.dense = dense_gmm || !cfg.sparse_matmul;
  lay.dispatch_spec = sharding::resolve_dispatch(lay.rules, detail::dispatch_logical(),
                                                 par.moe_dispatch_no_expert_sharding);
  // The dense path is expert-parallel when its dispatch spec puts only the experts on EP axes.
  bool const dense_a2a = lay.big(lay.dispatch_spec[0]) == ep_axes &&
                         std::none_of(ep_axes.begin(), ep_axes.end(), [&](auto const& a) {
                           return contains(lay.dispatch_spec[1], a);
                         });
  lay.route = ep == 1                                                ? ExpertRoute::Local
              : !lay.emb_axes.empty()                                ? ExpertRoute::EpTp
              : !all_ep_in_batch()                                   ? ExpertRoute::Replicated
              : par.use_ring_of_experts || (lay.dense && !dense_a2a) ? ExpertRoute::Ring
                                                                     : ExpertRoute::RaggedA2A;
  if (par.num_moe_emb_chunks > 0) {
    // MaxText's validate_num_moe_emb_chunks.
    require<ConfigError>(par.use_ring_of_experts && lay.route == ExpertRoute::Ring && !lay.dense,
                         "num_moe_emb_chunks=", par.num_moe_emb_chunks,
                         " needs the ring of experts with the grouped GEMM "
                         "(use_ring_of_experts=true, expert parallelism > 1 over the batch, "
                         "sparse_matmul=true); this layout reaches its experts by ",
                         to_string(lay.route), lay.dense ? " (dense experts)" : "",
                         par.use_ring_of_experts ? "" : " without use_ring_of_experts");
    require<ConfigError>(D % par.num_moe_emb_chunks == 0,
                         "num_moe_emb_chunks=", par.num_moe_emb_chunks,
                         " does not divide base_emb_dim=", D);
  }
  require<ConfigError>(
      !(par.ragged_buffer_factor > 0 && (lay.route != ExpertRoute::RaggedA2A || lay.dense)),
      "ragged_buffer_factor=", par.ragged_buffer_factor,
      " needs the ragged all-to-all path (expert parallelism without "
      "use_ring_of_experts, sparse_matmul=true)");
  if (lay.route == ExpertRoute::RaggedA2A) lay.dense = false;
  auto make = [&](std::string name, sharding::LogicalAxes logical,
                  sharding::PartitionSpec const& st, sharding::PartitionSpec const& cp,
                  std::vector<std::int64_t> shape, std::vector<std::string> reduce) {
    WeightLayout w{std::move(name), std::move(logical), st, {}, std::move(reduce)};
    for (std::size_t d = 0; d < shape.size(); ++d) {
      DimLayout dl;
      dl.storage = lay.big(st[d]);
      auto const compute = lay.big(cp[d]);
      dl.gather = minus(dl.storage, compute);
      dl.slice = minus(compute, dl.storage);
      dl.global = shape[d];
      require<ConfigError>(shape[d] % parts(dl.storage) == 0, w.name, " dimension ", d, " (",
                           shape[d], ") is not divisible by the product of mesh axes [",
                           join(dl.storage), "] = ", parts(dl.storage));
      dl.stored = shape[d] / parts(dl.storage);
      std::int64_t const spanned = dl.stored * parts(dl.gather);
      require<ConfigError>(spanned % parts(dl.slice) == 0, w.name, " dimension ", d, " (", spanned,
                           " after the gather) is not divisible by [", join(dl.slice),
                           "] = ", parts(dl.slice));
      dl.computed = spanned / parts(dl.slice);
      w.dims.push_back(dl);
    }
    lay.weights.push_back(std::move(w));
  };
  auto const expert_reduce = minus(batch_axes, ep_axes);
  for (char const* name : {"wi_0", "wi_1"})
    make(name, ew.wi, wi_st, wi_cp, {E, D, F}, expert_reduce);
  make("wo", ew.wo, wo_st, wo_cp, {E, F, D}, expert_reduce);
  sharding::LogicalAxes const gate_l = {cfg.shared_experts > 0 ? "embed_moe" : "embed",
                                        std::nullopt};
  make("gate", gate_l, resolve(gate_l), {{}, {}}, {D, E}, batch_axes);
  if (cfg.routed_bias) make("gate_bias", {std::nullopt}, {{}}, {{}}, {E}, batch_axes);
  int const Fs = cfg.shared_mlp_dim();
  if (Fs > 0) {
    // SharedExpert: EP-as-TP where the expert ranks hold the same tokens (1/ep of the FLOPs).
    bool const same_tokens = lay.route == ExpertRoute::Replicated || lay.route == ExpertRoute::EpTp;
    lay.shared = shared != SharedExpert::none ? shared
                 : same_tokens && ep > 1      ? SharedExpert::split
                                              : SharedExpert::own;
    require<ConfigError>(lay.route != ExpertRoute::EpTp || lay.shared == SharedExpert::split,
                         "EP-TP computes the shared expert with its hidden dim over the expert "
                         "axes (ep-as-tp)");
    auto hidden = lay.tp_axes;
    if (lay.shared == SharedExpert::split)
      for (auto const& a : ep_axes) hidden.push_back(a);
    sharding::PartitionSpec const cp_in = {{}, hidden}, cp_out = {hidden, {}};
    // Gradients differ over every batch axis, but the expert axes when EP-as-TP gathered tokens.
    auto const sh_reduce =
        lay.shared == SharedExpert::own || same_tokens ? batch_axes : minus(batch_axes, ep_axes);
    sharding::LogicalAxes const in_l = {"embed", "mlp"}, out_l = {"mlp", "embed"};
    for (char const* name : {"shared_wi_0", "shared_wi_1"})
      make(name, in_l, resolve(in_l), cp_in, {D, Fs}, sh_reduce);
    make("shared_wo", out_l, resolve(out_l), cp_out, {Fs, D}, sh_reduce);
  }
  lay.local_experts = E / ep;
  lay.first_expert = lay.shard_index(ep_axes) * lay.local_experts;
  return lay;
}

}  // namespace moe::distributed

namespace moe {
using distributed::ExpertRoute, distributed::SharedExpert, distributed::to_string;
}  // namespace moe
