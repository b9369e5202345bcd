#pragma once
/// \file
/// moe's JSON output: nlohmann::ordered_json documents printed by json_text in the one-line layout
/// of Python's json.dumps (as MaxText's JSON); invalid UTF-8 prints as U+FFFD, never throws.

#include <nlohmann/json.hpp>

#include <string>

namespace moe::detail {

using ordered_json = nlohmann::ordered_json;

/// Appends j to out as json_text does.
inline void append_json_text(std::string& out, ordered_json const& j) {
  if (!j.is_structured()) {
    out += j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
    return;
  }
  out += j.is_object() ? '{' : '[';
  bool first = true;
  for (auto const& [key, value] : j.items()) {
    if (!first) out += ", ";
    first = false;
    if (j.is_object())
      out += ordered_json(key).dump(-1, ' ', false, ordered_json::error_handler_t::replace) + ": ";
    append_json_text(out, value);
  }
  out += j.is_object() ? '}' : ']';
}

/// One line of JSON in json.dumps' layout: `{"a": 1, "b": [null, "x"]}`.
inline std::string json_text(ordered_json const& j) {
  std::string out;
  append_json_text(out, j);
  return out;
}

}  // namespace moe::detail
