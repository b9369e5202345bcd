#pragma once
/// \file
/// The small JSON and UTF-8 toolkit of moe/io: a strict RFC 8259 parser (JsonParser, JsonValue),
/// integer reading (json_to_int64), string literal writing (append_json_string) and a UTF-8
/// validator (valid_utf8, utf8_sequence_length). The safetensors header
/// (moe/io/safetensors.hpp) and the checkpoint index (moe/io/checkpoint_index.hpp) are read with
/// it, so both formats share one parser and one set of rules.
///
/// Why hand-written: moe is a header-only library, and whatever its headers include, every
/// consumer must find at build time. A JSON library (nlohmann-json, ...) would become a
/// requirement of every program that includes moe, for two small, fixed formats. So the parser
/// stays here, small and strict: UTF-8 is checked, duplicate object keys are rejected, nesting is
/// limited (a hostile header cannot exhaust the stack), numbers are kept as their literal text,
/// and every error is a moe::IoError that says what and at which byte. Tools and tests may use a
/// JSON library of their own; the library proper does not.
///
/// Everything here is an implementation detail of moe/io (namespace moe::io::detail): host-only,
/// no Kokkos, no MPI.

#include <moe/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moe::io::detail {

using ::moe::detail::cat;

// ---- UTF-8 -----------------------------------------------------------------------------------

/// Length of the well-formed UTF-8 sequence starting at s[pos] (1..4), or 0 if it is malformed
/// (bad lead byte, missing continuation, overlong form, surrogate, beyond U+10FFFF).
inline std::size_t utf8_sequence_length(std::string const& s, std::size_t pos) {
  auto byte = [&](std::size_t i) -> unsigned {
    return i < s.size() ? static_cast<unsigned char>(s[i]) : 0x100u;
  };
  unsigned const b0 = byte(pos);
  if (b0 < 0x80) return 1;
  std::size_t len = 0;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 == 0xE0) {
    len = 3, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    len = 3;
  } else if (b0 == 0xED) {
    len = 3, hi = 0x9F;
  } else if (b0 == 0xF0) {
    len = 4, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    len = 4;
  } else if (b0 == 0xF4) {
    len = 4, hi = 0x8F;
  } else {
    return 0;
  }
  unsigned const b1 = byte(pos + 1);
  if (b1 < lo || b1 > hi) return 0;
  for (std::size_t i = 2; i < len; ++i) {
    unsigned const b = byte(pos + i);
    if (b < 0x80 || b > 0xBF) return 0;
  }
  return len;
}

/// Whether \p s is well-formed UTF-8 (see utf8_sequence_length).
inline bool valid_utf8(std::string const& s) {
  for (std::size_t i = 0; i < s.size();) {
    std::size_t const n = utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

/// Appends the code point \p cp (at most U+10FFFF, not a surrogate) to \p out as UTF-8.
inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// ---- JSON ------------------------------------------------------------------------------------

/// A parsed JSON value. Objects keep their keys in file order.
struct JsonValue {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  std::string text;  ///< String: the decoded UTF-8 value; Number: the literal as written
  std::vector<JsonValue> items;   ///< Array: the elements; Object: the values
  std::vector<std::string> keys;  ///< Object: the keys, parallel to items
};

/// The kind of a JSON value as a message says it ("null", "a boolean", "an object", ...).
inline char const* json_kind_name(JsonValue::Kind k) {
  switch (k) {
    case JsonValue::Kind::Null:
      return "null";
    case JsonValue::Kind::Bool:
      return "a boolean";
    case JsonValue::Kind::Number:
      return "a number";
    case JsonValue::Kind::String:
      return "a string";
    case JsonValue::Kind::Array:
      return "an array";
    case JsonValue::Kind::Object:
      return "an object";
  }
  return "?";
}

/// A strict RFC 8259 parser (UTF-8 checked, duplicate object keys rejected, nesting limited so a
/// hostile header cannot exhaust the stack). Errors are IoErrors that start with \p where.
class JsonParser {
 public:
  JsonParser(std::string const& text, std::string where) : s_(text), where_(std::move(where)) {}

  JsonValue parse_document() {
    skip_ws();
    JsonValue v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected content after the JSON value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(std::string const& what) const {
    throw IoError(
        cat(where_, "header is not valid JSON: ", what, " (at byte ", pos_, " of the header)"));
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }

  void skip_ws() {
    while (!at_end() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  void expect(char c) {
    if (at_end()) fail(cat("expected '", c, "' but the header ended"));
    if (s_[pos_] != c) fail(cat("expected '", c, "'"));
    ++pos_;
  }

  void expect_word(char const* word) {
    std::size_t const n = std::strlen(word);
    if (s_.compare(pos_, n, word) != 0) fail("invalid literal");
    pos_ += n;
  }

  JsonValue parse_value(int depth) {
    if (depth > kMaxDepth) fail(cat("nesting deeper than ", kMaxDepth, " levels"));
    if (at_end()) fail("expected a value but the header ended");
    JsonValue v;
    char const c = s_[pos_];
    if (c == '{') {
      v.kind = JsonValue::Kind::Object;
      parse_object(v, depth);
    } else if (c == '[') {
      v.kind = JsonValue::Kind::Array;
      parse_array(v, depth);
    } else if (c == '"') {
      v.kind = JsonValue::Kind::String;
      v.text = parse_string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = JsonValue::Kind::Number;
      v.text = parse_number();
    } else if (c == 't') {
      expect_word("true");
      v.kind = JsonValue::Kind::Bool;
      v.boolean = true;
    } else if (c == 'f') {
      expect_word("false");
      v.kind = JsonValue::Kind::Bool;
    } else if (c == 'n') {
      expect_word("null");
    } else {
      fail("expected a value");
    }
    return v;
  }

  void parse_object(JsonValue& v, int depth) {
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return;
    }
    std::set<std::string> seen;
    while (true) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::size_t const key_pos = pos_;
      std::string key = parse_string();
      if (!seen.insert(key).second) {
        pos_ = key_pos;
        fail(cat("duplicate key \"", key, "\""));
      }
      skip_ws();
      expect(':');
      skip_ws();
      v.items.push_back(parse_value(depth + 1));
      v.keys.push_back(std::move(key));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      return;
    }
  }

  void parse_array(JsonValue& v, int depth) {
    expect('[');
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      return;
    }
    while (true) {
      skip_ws();
      v.items.push_back(parse_value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect(']');
      return;
    }
  }

  std::string parse_number() {
    std::size_t const start = pos_;
    auto digits = [&] {
      std::size_t const from = pos_;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (digits() == 0) {
      fail("invalid number");
    }
    if (peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("invalid number: no digits after '.'");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (digits() == 0) fail("invalid number: no digits in the exponent");
    }
    return s_.substr(start, pos_ - start);
  }

  std::uint32_t parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char const c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<std::uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<std::uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<std::uint32_t>(c - 'A' + 10);
      } else {
        --pos_;
        fail("invalid hex digit in a \\u escape");
      }
    }
    return v;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      unsigned char const c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("unescaped control character in a string");
      if (c == '\\') {
        ++pos_;
        if (at_end()) fail("unterminated escape");
        char const e = s_[pos_++];
        switch (e) {
          case '"':
            out += '"';
            break;
          case '\\':
            out += '\\';
            break;
          case '/':
            out += '/';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {
            std::uint32_t cp = parse_hex4();
            if (cp >= 0xDC00 && cp <= 0xDFFF) fail("lone low surrogate in a \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (s_.compare(pos_, 2, "\\u") != 0) fail("high surrogate not followed by \\u");
              pos_ += 2;
              std::uint32_t const lo = parse_hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) fail("high surrogate not followed by a low one");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            append_utf8(out, cp);
            break;
          }
          default:
            --pos_;
            fail(cat("invalid escape '\\", e, "'"));
        }
        continue;
      }
      std::size_t const n = utf8_sequence_length(s_, pos_);
      if (n == 0) fail("invalid UTF-8");
      out.append(s_, pos_, n);
      pos_ += n;
    }
  }

  std::string const& s_;
  std::string where_;
  std::size_t pos_ = 0;
};

/// Reads the JSON number \p v as an int64; false if it is not an integer literal or out of range.
inline bool json_to_int64(JsonValue const& v, std::int64_t& out) {
  if (v.kind != JsonValue::Kind::Number) return false;
  std::string const& t = v.text;
  bool const neg = !t.empty() && t[0] == '-';
  std::uint64_t mag = 0;
  std::uint64_t const limit =
      static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) + (neg ? 1 : 0);
  for (std::size_t i = neg ? 1 : 0; i < t.size(); ++i) {
    if (t[i] < '0' || t[i] > '9') return false;  // fraction or exponent
    std::uint64_t const digit = static_cast<std::uint64_t>(t[i] - '0');
    if (mag > (limit - digit) / 10) return false;
    mag = mag * 10 + digit;
  }
  if (neg) {
    out = mag == 0
              ? 0
              : (mag - 1 == static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())
                     ? std::numeric_limits<std::int64_t>::min()
                     : -static_cast<std::int64_t>(mag));
  } else {
    out = static_cast<std::int64_t>(mag);
  }
  return true;
}

/// Appends \p s as a JSON string literal (control characters escaped, UTF-8 passed through).
inline void append_json_string(std::string& out, std::string const& s) {
  static char const hex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    unsigned char const c = static_cast<unsigned char>(ch);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      out += "\\u00";
      out += hex[c >> 4];
      out += hex[c & 0xF];
    } else {
      out += ch;
    }
  }
  out += '"';
}

}  // namespace moe::io::detail
