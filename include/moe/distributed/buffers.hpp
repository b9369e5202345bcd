#pragma once
/// \file
/// The buffers of one step (Buf), their table (kBufferInfo) and typed handles (`buf::x_sorted`);
/// held buffers are what components keep between steps.

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
  f64,    ///< host doubles (statistics)
  bf16,   ///< moe::bf16 (the expert FFN's hidden states on a float layer computing in bf16)
  rows    ///< rows the plan may narrow to bf16: the routed rows (at the experts, on the
          ///< all-to-all), the gathered paths' working tokens, their output gradients and sums
};

/// Bytes of one element of role `e` when a value has `value_bytes` bytes.
inline std::int64_t elem_bytes(Elem e, std::int64_t value_bytes) {
  return e == Elem::value || e == Elem::rows ? value_bytes
         : e == Elem::i32                    ? 4
         : e == Elem::bf16                   ? 2
                                             : 8;
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

/// \brief One extent of a planned buffer; `routed`: routed rows (`n` assumes balanced routing).
struct Extent {
  std::int64_t n = 0;
  unsigned keys = 0;
  bool routed = false;
};

enum class BufKind : std::uint8_t { external, workspace, held };  ///< what kind of buffer a Buf is

// The buffers, one list per kind: they make Buf, kBufferInfo and the handles of namespace buf.
// clang-format off
// The caller's tensors and the router's state (names in stage reads and writes only):
#define MOE_EXTERNAL_BUFFERS(X) X(y) X(dy) X(dx) X(routing)
// Workspace buffers: X(name, element role, memory-estimate item).
#define MOE_WORKSPACE_BUFFERS(X)        \
  X(x, value, token_rows)               \
  X(x_work, rows, token_rows)           \
  X(x_chunks_own, value, token_rows)    \
  X(x_chunks, value, token_rows)        \
  X(x_sorted, rows, token_rows)         \
  X(x_received, rows, token_rows)       \
  X(x_local, rows, token_rows)          \
  X(x_local_chunk, value, token_rows)   \
  X(y_local, rows, token_rows)          \
  X(y_local_cols, rows, token_rows)     \
  X(y_received_cols, rows, token_rows)  \
  X(y_sorted_cols, rows, token_rows)    \
  X(y_cols, value, token_rows)          \
  X(y_work, rows, token_rows)           \
  X(y_own, value, token_rows)           \
  X(dy_cols, rows, token_rows)          \
  X(dy_sorted_cols, rows, token_rows)   \
  X(dy_received_cols, rows, token_rows) \
  X(dy_local_cols, rows, token_rows)    \
  X(dy_local, rows, token_rows)         \
  X(dy_work, rows, token_rows)          \
  X(dx_work, rows, token_rows)          \
  X(d_weights, value, routing)          \
  X(d_weights_work, value, token_rows)  \
  X(logits_own, value, routing)         \
  X(local_ids, i32, routing)            \
  X(local_kept, i32, routing)           \
  X(x_shared, value, shared)            \
  X(y_shared, value, shared)            \
  X(y_shared_cols, value, shared)       \
  X(dy_shared, value, shared)           \
  X(dx_shared, value, shared)           \
  X(dx_shared_cols, value, shared)
// Kept by components: X(name, printed name, element role, item).
#define MOE_HELD_BUFFERS(X)                             \
  X(logits, "logits", value, routing)                   \
  X(scores, "scores", value, routing)                   \
  X(biased_scores, "biased scores", value, routing)     \
  X(expert_ids, "expert_ids", i32, routing)             \
  X(kept, "kept", i32, routing)                         \
  X(top_values, "top_values", value, routing)           \
  X(weights, "weights", value, routing)                 \
  X(seq_counts, "seq_counts", i64, routing)             \
  X(seq_probs, "seq_probs", value, routing)             \
  X(lb_softmax, "lb softmax", f64, routing)             \
  X(capacity_cursors, "capacity cursors", i64, routing) \
  X(d_top, "d_top", value, routing)                     \
  X(d_biased, "d_biased", value, routing)               \
  X(d_logits, "d_logits", value, routing)               \
  X(sort_perm, "sort perm", i64, routing)               \
  X(sort_inverse, "sort inverse", i64, routing)         \
  X(sort_cursors, "sort cursors", i64, routing)         \
  X(local_perm, "local perm", i64, routing)             \
  X(local_inverse, "local inverse", i64, routing)       \
  X(local_expert_ids, "local expert ids", i32, routing) \
  X(h0, "h0", value, hidden)                            \
  X(h1, "h1", value, hidden)                            \
  X(act, "act", value, hidden)                          \
  X(d_act, "d_act", value, hidden)                      \
  X(d_h1, "d_h1", value, hidden)                        \
  X(dense_weights, "dense weights", value, hidden)      \
  X(y_expert, "y_expert", value, hidden)                \
  X(dy_expert, "dy_expert", value, hidden)              \
  X(d_dense_weights, "d_dense_weights", value, hidden)  \
  X(shared_h0, "shared h0", value, shared)              \
  X(shared_h1, "shared h1", value, shared)              \
  X(shared_act, "shared act", value, shared)            \
  X(shared_d_act, "shared d_act", value, shared)
// clang-format on

/// \brief Every buffer of a step: external names, workspace buffers (x first), held buffers.
enum class Buf : std::uint8_t {
#define MOE_ENUMERATOR(name, ...) name,
  MOE_EXTERNAL_BUFFERS(MOE_ENUMERATOR) MOE_WORKSPACE_BUFFERS(MOE_ENUMERATOR)
      MOE_HELD_BUFFERS(MOE_ENUMERATOR)
#undef MOE_ENUMERATOR
          count_  ///< (the number of buffers)
};

/// \brief A buffer's printed name, element role, kind and memory-estimate item.
struct BufInfo {
  char const* name;
  Elem elem;
  BufKind kind;
  Item item;
};

/// The one table of buffers, in the order of Buf.
inline constexpr BufInfo kBufferInfo[] = {
#define MOE_EXTERNAL_ROW(name) {#name, Elem::value, BufKind::external, Item::token_rows},
#define MOE_WORKSPACE_ROW(name, elem, item) {#name, Elem::elem, BufKind::workspace, Item::item},
#define MOE_HELD_ROW(name, text, elem, item) {text, Elem::elem, BufKind::held, Item::item},
    MOE_EXTERNAL_BUFFERS(MOE_EXTERNAL_ROW) MOE_WORKSPACE_BUFFERS(MOE_WORKSPACE_ROW)
        MOE_HELD_BUFFERS(MOE_HELD_ROW)
#undef MOE_EXTERNAL_ROW
#undef MOE_WORKSPACE_ROW
#undef MOE_HELD_ROW
};
static_assert(sizeof(kBufferInfo) / sizeof(kBufferInfo[0]) == std::size_t(Buf::count_),
              "one kBufferInfo row per Buf");

/// The table row of `b`.
constexpr BufInfo const& info(Buf b) { return kBufferInfo[static_cast<std::size_t>(b)]; }
inline char const* to_string(Buf b) { return info(b).name; }  ///< the printed name of `b`

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

/// \brief What a stage reads or writes: a buffer, or a weight's stored block, compute block or
/// their gradients ("x_sorted", "wi_0", "compute.wi_0", "d.wi_0", "grad.wi_0").
struct Ref {
  enum class Form : std::uint8_t { buffer, stored, compute, grad, stored_grad };
  Form form = Form::buffer;
  std::uint8_t id = 0;  ///< a Buf (form buffer) or a Weight

  constexpr Ref() = default;
  constexpr Ref(Buf b) : form(Form::buffer), id(static_cast<std::uint8_t>(b)) {}  // NOLINT
  constexpr Ref(Form f, Weight w) : form(f), id(static_cast<std::uint8_t>(w)) {}

  friend constexpr bool operator==(Ref a, Ref b) { return a.form == b.form && a.id == b.id; }
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

/// Element roles of workspace buffers, as types (the workspace maps each to a C++ type).
struct Values {};  ///< the layer's value type
struct Ints {};    ///< int
struct Rows {};    ///< rows of Elem::rows: the value type, or moe::bf16 where the plan narrows them

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
  static_assert(
      info(B).elem == Elem::value || info(B).elem == Elem::i32 || info(B).elem == Elem::rows,
      "workspace buffers hold values, ints or routed rows");
  if constexpr (info(B).elem == Elem::i32)
    return Handle<Ints>{B};
  else if constexpr (info(B).elem == Elem::rows)
    return Handle<Rows>{B};
  else
    return Handle<Values>{B};
}
}  // namespace detail

/// The workspace buffers' handles, one per Buf of kind workspace.
namespace buf {
#define MOE_HANDLE(name, ...) inline constexpr auto name = detail::handle<Buf::name>();
MOE_WORKSPACE_BUFFERS(MOE_HANDLE)
#undef MOE_HANDLE
}  // namespace buf
#undef MOE_EXTERNAL_BUFFERS
#undef MOE_WORKSPACE_BUFFERS
#undef MOE_HELD_BUFFERS

/// \brief A buffer of the step as the plan declares it, with the phase that first makes it.
struct BufferDecl {
  Buf id = Buf::x;
  std::vector<Extent> dims;
  Elem elem = Elem::value;
  Item item = Item::token_rows;
  bool backward = false;
  /// Buf::count_: a buffer of the workspace. An external Buf (Buf::y): the caller's tensor of
  /// that name stands in for the buffer in this step (the same shape; no memory of its own).
  Buf caller = Buf::count_;

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

/// \brief A row count the step hands to one 32-bit BLAS call or kernel launch.
struct RowLimit {
  std::string what;
  Extent rows;
};

}  // namespace moe::distributed
