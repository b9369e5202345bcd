#pragma once
/// \file
/// JSON in moe/io (host-only) on nlohmann-json: the strict reader (parse_json -> JsonValue) of the
/// safetensors header and the checkpoint index, and helpers. nlohmann-json's SAX interface lexes
/// (RFC 8259, UTF-8 checked, no recursion); on top, for untrusted files: duplicate keys are
/// rejected, nesting is limited to 64 levels, no byte-order mark, integers keep their exact
/// decimal text (never rounded through a double), and errors are IoErrors naming the byte.

#include <moe/error.hpp>

#include <nlohmann/json.hpp>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace moe::io::detail {

using ::moe::detail::cat;

/// Whether \p s is well-formed UTF-8 (no overlong forms, surrogates or code points > U+10FFFF).
inline bool valid_utf8(std::string const& s) {
  try {
    (void)nlohmann::json(s).dump();
  } catch (nlohmann::json::type_error const&) {
    return false;
  }
  return true;
}

/// Appends \p s as a JSON string literal (control characters escaped, UTF-8 passed through;
/// invalid UTF-8 becomes U+FFFD: callers check names with valid_utf8 first).
inline void append_json_string(std::string& out, std::string const& s) {
  out += nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// A parsed JSON value. Objects keep their keys in file order.
struct JsonValue {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  /// String: the decoded UTF-8 value; Number: an integer's exact decimal value, or the literal
  /// as written for a number with a fraction or exponent (or beyond 64 bits)
  std::string text;
  std::vector<JsonValue> items;   ///< Array: the elements; Object: the values
  std::vector<std::string> keys;  ///< Object: the keys, parallel to items
};

/// The kind of a JSON value as a message says it ("null", "a boolean", "an object", ...).
inline char const* json_kind_name(JsonValue::Kind k) {
  static char const* const names[] = {"null",     "a boolean", "a number",
                                      "a string", "an array",  "an object"};
  return names[static_cast<int>(k)];
}

/// parse_json's SAX handler: builds the tree; false stops the parse (duplicate key, too deep).
class JsonTreeBuilder {
 public:
  static constexpr int kMaxDepth = 64;
  using json = nlohmann::json;

  JsonValue root;
  std::string error;                         ///< why parsing stopped ("" if it did not)
  std::size_t error_at = std::string::npos;  ///< byte offset of a syntax error (npos: not located)

  bool null() { return leaf(JsonValue::Kind::Null); }
  bool boolean(bool b) { return leaf(JsonValue::Kind::Bool, {}, b); }
  bool number_integer(json::number_integer_t i) { return number(std::to_string(i)); }
  bool number_unsigned(json::number_unsigned_t u) { return number(std::to_string(u)); }
  bool number_float(json::number_float_t, json::string_t const& literal) { return number(literal); }
  bool string(json::string_t& s) { return leaf(JsonValue::Kind::String, std::move(s)); }
  bool binary(json::binary_t&) { return stop("binary data"); }
  bool start_object(std::size_t) { return open(JsonValue::Kind::Object); }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(JsonValue::Kind::Array); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    if (!open_.back().second.insert(k).second) return stop(cat("duplicate key \"", k, "\""));
    pending_key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t position, std::string const& /*last_token*/,
                   json::exception const& e) {
    error_at = position > 0 ? position - 1 : 0;
    error = describe(e.what());
    return false;
  }

 private:
  /// nlohmann-json's message, less its "[json.exception.parse_error.101] parse error at line 1,
  /// column N: " prefix; a missing object key is said as moe always said it.
  static std::string describe(std::string what) {
    auto const colon = what.find(": ");
    if (what.rfind("[json.exception", 0) == 0 && colon != std::string::npos)
      what = what.substr(colon + 2);
    if (what.find("while parsing object key") != std::string::npos)
      return cat("expected a string key (", what, ")");
    if (what.find("unexpected end of input") != std::string::npos)
      return cat("the header ended early (", what, ")");
    return what;
  }
  bool stop(std::string why) {
    error = std::move(why);
    return false;
  }
  bool number(std::string text) { return leaf(JsonValue::Kind::Number, std::move(text)); }
  /// A new value of \p kind: the root, or the last of the open container (under the pending key).
  JsonValue* place(JsonValue::Kind kind) {
    JsonValue* v = &root;
    if (!open_.empty()) {
      JsonValue& parent = *open_.back().first;
      if (parent.kind == JsonValue::Kind::Object) parent.keys.push_back(std::move(pending_key_));
      v = &parent.items.emplace_back();
    }
    v->kind = kind;
    return v;
  }
  bool leaf(JsonValue::Kind kind, std::string text = {}, bool b = false) {
    JsonValue* const v = place(kind);
    v->boolean = b;
    v->text = std::move(text);
    return true;
  }
  bool open(JsonValue::Kind kind) {
    if (int(open_.size()) >= kMaxDepth)
      return stop(cat("nesting deeper than ", kMaxDepth, " levels"));
    open_.emplace_back(place(kind), std::set<std::string>());
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }

  // The open containers, outermost first, with the keys seen in each. A pointer stays valid while
  // its container is open: a parent's items only grow by its last child, the only one still open.
  std::vector<std::pair<JsonValue*, std::set<std::string>>> open_;
  std::string pending_key_;
};

/// A char iterator recording how far nlohmann-json has read, to locate errors the handler raises.
struct CountingCharIterator {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = char const*;
  using reference = char const&;

  char const* p = nullptr;
  char const* begin = nullptr;
  std::size_t* read = nullptr;  ///< bytes consumed so far (shared by the copies)

  reference operator*() const {
    *read = std::size_t(p - begin) + 1;
    return *p;
  }
  CountingCharIterator& operator++() {
    ++p;
    return *this;
  }
  friend bool operator==(CountingCharIterator const& a, CountingCharIterator const& b) {
    return a.p == b.p;
  }
  friend bool operator!=(CountingCharIterator const& a, CountingCharIterator const& b) {
    return a.p != b.p;
  }
};

/// Parses \p text strictly (see the file comment); IoErrors start with \p where and name the byte.
inline JsonValue parse_json(std::string const& text, std::string const& where) {
  auto fail = [&](std::string const& what, std::size_t at) {
    return IoError(
        cat(where, "header is not valid JSON: ", what, " (at byte ", at, " of the header)"));
  };
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) throw fail("a byte-order mark is not allowed", 0);
  JsonTreeBuilder h;
  std::size_t read = 0;
  char const* const b = text.data();
  CountingCharIterator const first{b, b, &read}, last{b + text.size(), b, &read};
  if (nlohmann::json::sax_parse(first, last, &h, nlohmann::json::input_format_t::json, true))
    return std::move(h.root);
  std::size_t const last_read = read > 0 ? read - 1 : 0;
  if (h.error.empty()) throw fail("invalid JSON", last_read);
  throw fail(h.error, h.error_at != std::string::npos ? h.error_at : last_read);
}

/// Reads the JSON number \p v as an int64; false if it is not an integer literal or out of range.
inline bool json_to_int64(JsonValue const& v, std::int64_t& out) {
  if (v.kind != JsonValue::Kind::Number) return false;
  char const* const end = v.text.data() + v.text.size();
  std::int64_t x = 0;
  auto const r = std::from_chars(v.text.data(), end, x);  // stops at a fraction or exponent
  if (r.ec != std::errc() || r.ptr != end) return false;
  out = x;
  return true;
}

}  // namespace moe::io::detail
