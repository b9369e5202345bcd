#pragma once
/// \file
/// moe's JSON output: nlohmann::ordered_json documents printed by json_text in the one-line layout
/// of Python's json.dumps (as MaxText's JSON); invalid UTF-8 prints as U+FFFD, never throws.

#include <nlohmann/json.hpp>

#include <string>

namespace moe::detail {

using ordered_json = nlohmann::ordered_json;

/// One line of JSON in json.dumps' layout: `{"a": 1, "b": [null, "x"]}`.
inline std::string json_text(ordered_json const& j) {
  if (!j.is_structured()) return j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  std::string out(1, j.is_object() ? '{' : '[');
  for (auto const& [key, value] : j.items()) {
    if (out.size() > 1) out += ", ";
    if (j.is_object()) out += json_text(key) + ": ";
    out += json_text(value);
  }
  return out + (j.is_object() ? '}' : ']');
}

}  // namespace moe::detail
