#pragma once
/// \file
/// The buffers of one step of the distributed layer, named by enumerators, not strings: what the
/// step plan's stages read and write (distributed/step_plan.hpp), what the step workspace hands
/// out (distributed/workspace.hpp), and what the memory estimate counts
/// (distributed/memory.hpp). One table (kBufferInfo) gives each buffer its printed name, its
/// element type and the memory-estimate item it is counted under.
///
/// Two kinds of buffer:
///  * workspace buffers, [rows, cols], made by a stage through a typed handle (namespace buf):
///    `ws.make(buf::x_sorted, rows)` gives a View of the handle's element type, so a stage cannot
///    ask for an int buffer as values; the plan declares every one's shape (BufferDecl) and the
///    workspace checks each make against it;
///  * buffers a component keeps between steps (the router's logits, the sort's permutation, the
///    expert FFN's hidden states, ...): declared by the stage that runs the component, so that
///    the memory estimate and the index limits read them from the plan too.
///
/// Element types are roles (Elem), not C++ types: `value` is the layer's value type (today the
/// Scalar of float or double); the workspace maps each role to its type.

#include <moe/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moe::distributed {

/// \brief Element type of a buffer, by role.
enum class Elem : std::uint8_t {
  value,  ///< the layer's value type (activations, weights of the step)
  i32,    ///< 32-bit integers (expert ids, masks)
  i64,    ///< 64-bit integers (permutations, counts)
  f64     ///< host doubles (statistics)
};

/// Bytes of one element of role `e` when a value has `value_bytes` bytes.
inline std::int64_t elem_bytes(Elem e, std::int64_t value_bytes) {
  switch (e) {
    case Elem::value:
      return value_bytes;
    case Elem::i32:
      return 4;
    case Elem::i64:
    case Elem::f64:
      break;
  }
  return 8;
}

/// \brief The memory-estimate item a buffer is counted under.
enum class Item : std::uint8_t { routing, token_rows, hidden, shared };

/// Name of a memory-estimate item (as moe::estimate_layer_memory reports it).
inline char const* to_string(Item i) {
  static char const* const names[] = {"routing", "token rows", "expert hidden states",
                                      "shared expert"};
  return names[static_cast<int>(i)];
}

/// \brief The config keys an extent scales with (a bit set), for the memory estimate's advice.
enum Scale : unsigned {
  scale_tokens = 1u,    ///< per_device_batch_size, max_target_length
  scale_topk = 2u,      ///< num_experts_per_tok
  scale_emb = 4u,       ///< base_emb_dim
  scale_mlp = 8u,       ///< base_moe_mlp_dim
  scale_experts = 16u,  ///< num_experts
  scale_shared = 32u    ///< shared_experts
};

/// "per_device_batch_size, max_target_length, base_emb_dim": the keys of a Scale set.
inline std::string keys_text(unsigned keys) {
  static char const* const names[] = {"per_device_batch_size, max_target_length",
                                      "num_experts_per_tok",
                                      "base_emb_dim",
                                      "base_moe_mlp_dim",
                                      "num_experts",
                                      "shared_experts"};
  std::string s;
  for (unsigned b = 0; b < sizeof(names) / sizeof(names[0]); ++b)
    if (keys & (1u << b)) s += (s.empty() ? "" : ", ") + std::string(names[b]);
  return s;
}

/// \brief One extent of a planned buffer: its size on this rank, the keys it scales with, and
/// whether it counts routed rows (then `n` assumes balanced routing and the step's real count
/// varies with the routing).
struct Extent {
  std::int64_t n = 0;
  unsigned keys = 0;
  bool routed = false;
};

/// \brief Every buffer of a step (see the file comment): the step's input x, the workspace
/// buffers, and what the layer's components keep. `routing`, `y`, `dy`, `dx` name the router's
/// state and the caller's tensors in stage reads and writes; they are not buffers of the step.
enum class Buf : std::uint8_t {
  // tensors of the caller and the router's state (names in reads / writes only)
  y,
  dy,
  dx,
  routing,
  // workspace buffers
  x,
  x_work,
  x_chunks_own,
  x_chunks,
  x_sorted,
  x_received,
  x_local,
  x_local_chunk,
  y_local,
  y_local_cols,
  y_received_cols,
  y_sorted_cols,
  y_cols,
  y_work,
  y_own,
  dy_cols,
  dy_sorted_cols,
  dy_received_cols,
  dy_local_cols,
  dy_local,
  dy_work,
  dx_work,
  d_weights,
  d_weights_work,
  logits_own,
  local_ids,
  local_kept,
  x_shared,
  y_shared,
  y_shared_cols,
  dy_shared,
  dx_shared,
  dx_shared_cols,
  // kept by components: the router
  logits,
  scores,
  biased_scores,
  expert_ids,
  kept,
  top_values,
  weights,
  seq_counts,
  seq_probs,
  lb_softmax,
  capacity_cursors,
  d_top,
  d_biased,
  d_logits,
  // the sort by expert and the local regrouping of received rows
  sort_perm,
  sort_inverse,
  sort_cursors,
  local_perm,
  local_inverse,
  local_expert_ids,
  // the expert FFN (grouped or dense) and the shared expert
  h0,
  h1,
  act,
  d_act,
  d_h1,
  dense_weights,
  y_expert,
  dy_expert,
  d_dense_weights,
  shared_h0,
  shared_h1,
  shared_act,
  shared_d_act,
  count_  ///< (the number of buffers)
};

/// What kind of buffer an enumerator is.
enum class BufKind : std::uint8_t { external, workspace, held };

/// \brief A buffer's printed name, element role, kind and default memory-estimate item.
struct BufInfo {
  char const* name;
  Elem elem;
  BufKind kind;
  Item item;
};

namespace detail {
constexpr BufInfo ws(char const* n, Item i = Item::token_rows, Elem e = Elem::value) {
  return {n, e, BufKind::workspace, i};
}
constexpr BufInfo held(char const* n, Item i, Elem e = Elem::value) {
  return {n, e, BufKind::held, i};
}
constexpr BufInfo ext(char const* n) {
  return {n, Elem::value, BufKind::external, Item::token_rows};
}
}  // namespace detail

/// The one table of buffers, in the order of Buf.
inline constexpr BufInfo kBufferInfo[] = {
    detail::ext("y"),
    detail::ext("dy"),
    detail::ext("dx"),
    detail::ext("routing"),
    detail::ws("x"),
    detail::ws("x_work"),
    detail::ws("x_chunks_own"),
    detail::ws("x_chunks"),
    detail::ws("x_sorted"),
    detail::ws("x_received"),
    detail::ws("x_local"),
    detail::ws("x_local_chunk"),
    detail::ws("y_local"),
    detail::ws("y_local_cols"),
    detail::ws("y_received_cols"),
    detail::ws("y_sorted_cols"),
    detail::ws("y_cols"),
    detail::ws("y_work"),
    detail::ws("y_own"),
    detail::ws("dy_cols"),
    detail::ws("dy_sorted_cols"),
    detail::ws("dy_received_cols"),
    detail::ws("dy_local_cols"),
    detail::ws("dy_local"),
    detail::ws("dy_work"),
    detail::ws("dx_work"),
    detail::ws("d_weights", Item::routing),
    detail::ws("d_weights_work"),
    detail::ws("logits_own", Item::routing),
    detail::ws("local_ids", Item::routing, Elem::i32),
    detail::ws("local_kept", Item::routing, Elem::i32),
    detail::ws("x_shared", Item::shared),
    detail::ws("y_shared", Item::shared),
    detail::ws("y_shared_cols", Item::shared),
    detail::ws("dy_shared", Item::shared),
    detail::ws("dx_shared", Item::shared),
    detail::ws("dx_shared_cols", Item::shared),
    detail::held("logits", Item::routing),
    detail::held("scores", Item::routing),
    detail::held("biased scores", Item::routing),
    detail::held("expert_ids", Item::routing, Elem::i32),
    detail::held("kept", Item::routing, Elem::i32),
    detail::held("top_values", Item::routing),
    detail::held("weights", Item::routing),
    detail::held("seq_counts", Item::routing, Elem::i64),
    detail::held("seq_probs", Item::routing),
    detail::held("lb softmax", Item::routing, Elem::f64),
    detail::held("capacity cursors", Item::routing, Elem::i64),
    detail::held("d_top", Item::routing),
    detail::held("d_biased", Item::routing),
    detail::held("d_logits", Item::routing),
    detail::held("sort perm", Item::routing, Elem::i64),
    detail::held("sort inverse", Item::routing, Elem::i64),
    detail::held("sort cursors", Item::routing, Elem::i64),
    detail::held("local perm", Item::routing, Elem::i64),
    detail::held("local inverse", Item::routing, Elem::i64),
    detail::held("local expert ids", Item::routing, Elem::i32),
    detail::held("h0", Item::hidden),
    detail::held("h1", Item::hidden),
    detail::held("act", Item::hidden),
    detail::held("d_act", Item::hidden),
    detail::held("d_h1", Item::hidden),
    detail::held("dense weights", Item::hidden),
    detail::held("y_expert", Item::hidden),
    detail::held("dy_expert", Item::hidden),
    detail::held("d_dense_weights", Item::hidden),
    detail::held("shared h0", Item::shared),
    detail::held("shared h1", Item::shared),
    detail::held("shared act", Item::shared),
    detail::held("shared d_act", Item::shared),
};
static_assert(sizeof(kBufferInfo) / sizeof(kBufferInfo[0]) == std::size_t(Buf::count_),
              "one kBufferInfo row per Buf");

/// The table row of `b`.
constexpr BufInfo const& info(Buf b) { return kBufferInfo[static_cast<std::size_t>(b)]; }
/// The printed name of `b` (as the plan shows it).
inline char const* to_string(Buf b) { return info(b).name; }

/// \brief The weights of the layer (Parameters' fields, MaxText's names).
enum class Weight : std::uint8_t {
  gate,
  gate_bias,
  wi_0,
  wi_1,
  wo,
  shared_wi_0,
  shared_wi_1,
  shared_wo
};
/// MaxText's name of a weight.
inline char const* to_string(Weight w) {
  static char const* const names[] = {"gate", "gate_bias",   "wi_0",        "wi_1",
                                      "wo",   "shared_wi_0", "shared_wi_1", "shared_wo"};
  return names[static_cast<int>(w)];
}

/// \brief What a stage reads or writes: a buffer of the step, or a block of a weight (stored,
/// compute, its compute-block gradient, its stored-block gradient), printed as the plan shows it:
/// "x_sorted", "wi_0", "compute.wi_0", "d.wi_0", "grad.wi_0".
struct Ref {
  enum class Form : std::uint8_t { buffer, stored, compute, grad, stored_grad };
  Form form = Form::buffer;
  std::uint8_t id = 0;  ///< a Buf (form buffer) or a Weight

  constexpr Ref() = default;
  constexpr Ref(Buf b) : form(Form::buffer), id(static_cast<std::uint8_t>(b)) {}  // NOLINT
  constexpr Ref(Form f, Weight w) : form(f), id(static_cast<std::uint8_t>(w)) {}

  friend constexpr bool operator==(Ref a, Ref b) { return a.form == b.form && a.id == b.id; }
  friend constexpr bool operator!=(Ref a, Ref b) { return !(a == b); }
};
/// A weight's stored block, compute block, compute-block gradient, stored-block gradient.
constexpr Ref stored(Weight w) { return {Ref::Form::stored, w}; }
constexpr Ref compute(Weight w) { return {Ref::Form::compute, w}; }
constexpr Ref grad(Weight w) { return {Ref::Form::grad, w}; }
constexpr Ref stored_grad(Weight w) { return {Ref::Form::stored_grad, w}; }

/// The printed name of a reference.
inline std::string to_string(Ref r) {
  if (r.form == Ref::Form::buffer) return to_string(static_cast<Buf>(r.id));
  static char const* const prefix[] = {"", "", "compute.", "d.", "grad."};
  return prefix[static_cast<int>(r.form)] + std::string(to_string(static_cast<Weight>(r.id)));
}

// ------------------------------------------------------------------ typed handles ----------

/// Element roles of workspace buffers, as types (the workspace maps each to a C++ type).
struct Values {};  ///< the layer's value type
struct Ints {};    ///< int

/// \brief A workspace buffer, typed by its element role: what a stage makes and reads.
template <class Role>
struct Handle {
  Buf id;
  constexpr operator Ref() const { return Ref(id); }  // NOLINT: a handle is a reference
};

namespace detail {
/// The handle of workspace buffer B, typed by its row in kBufferInfo.
template <Buf B>
constexpr auto handle() {
  static_assert(info(B).kind == BufKind::workspace, "only workspace buffers have handles");
  static_assert(info(B).elem == Elem::value || info(B).elem == Elem::i32,
                "workspace buffers hold values or ints");
  if constexpr (info(B).elem == Elem::i32)
    return Handle<Ints>{B};
  else
    return Handle<Values>{B};
}
}  // namespace detail

/// The workspace buffers' handles, one per Buf of kind workspace.
namespace buf {
#define MOE_BUFFER_HANDLE(name) inline constexpr auto name = detail::handle<Buf::name>();
MOE_BUFFER_HANDLE(x)
MOE_BUFFER_HANDLE(x_work)
MOE_BUFFER_HANDLE(x_chunks_own)
MOE_BUFFER_HANDLE(x_chunks)
MOE_BUFFER_HANDLE(x_sorted)
MOE_BUFFER_HANDLE(x_received)
MOE_BUFFER_HANDLE(x_local)
MOE_BUFFER_HANDLE(x_local_chunk)
MOE_BUFFER_HANDLE(y_local)
MOE_BUFFER_HANDLE(y_local_cols)
MOE_BUFFER_HANDLE(y_received_cols)
MOE_BUFFER_HANDLE(y_sorted_cols)
MOE_BUFFER_HANDLE(y_cols)
MOE_BUFFER_HANDLE(y_work)
MOE_BUFFER_HANDLE(y_own)
MOE_BUFFER_HANDLE(dy_cols)
MOE_BUFFER_HANDLE(dy_sorted_cols)
MOE_BUFFER_HANDLE(dy_received_cols)
MOE_BUFFER_HANDLE(dy_local_cols)
MOE_BUFFER_HANDLE(dy_local)
MOE_BUFFER_HANDLE(dy_work)
MOE_BUFFER_HANDLE(dx_work)
MOE_BUFFER_HANDLE(d_weights)
MOE_BUFFER_HANDLE(d_weights_work)
MOE_BUFFER_HANDLE(logits_own)
MOE_BUFFER_HANDLE(local_ids)
MOE_BUFFER_HANDLE(local_kept)
MOE_BUFFER_HANDLE(x_shared)
MOE_BUFFER_HANDLE(y_shared)
MOE_BUFFER_HANDLE(y_shared_cols)
MOE_BUFFER_HANDLE(dy_shared)
MOE_BUFFER_HANDLE(dx_shared)
MOE_BUFFER_HANDLE(dx_shared_cols)
#undef MOE_BUFFER_HANDLE
}  // namespace buf

// ------------------------------------------------------------------ declarations -----------

/// \brief A buffer of the step as the plan declares it: its extents (workspace buffers have two,
/// rows and cols), element role, memory-estimate item, and the phase whose stage first makes it
/// (backward buffers are not needed for a forward-only step).
struct BufferDecl {
  Buf id = Buf::x;
  std::vector<Extent> dims;
  Elem elem = Elem::value;
  Item item = Item::token_rows;
  bool backward = false;

  /// Extents on this rank (balanced routing where an extent is `routed`).
  std::vector<std::int64_t> shape() const {
    std::vector<std::int64_t> s;
    for (auto const& d : dims) s.push_back(d.n);
    return s;
  }
  /// The config keys its size scales with.
  unsigned keys() const {
    unsigned k = 0;
    for (auto const& d : dims) k |= d.keys;
    return k;
  }
};

/// \brief A row count the step hands to one 32-bit BLAS call or kernel launch (the memory
/// estimate's index limits): what it is, and how many rows this rank has.
struct RowLimit {
  std::string what;
  Extent rows;
};

}  // namespace moe::distributed
