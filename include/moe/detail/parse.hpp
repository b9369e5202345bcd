#pragma once
/// \file
/// Text helpers of the config tables: trimming, the nearest key to a misspelt one, parsing values
/// (errors name the key), and the exact text of a value.

#include <moe/error.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace moe::detail {

inline std::string trim(std::string s) {
  auto const b = s.find_first_not_of(" \t\r\n\"'");
  auto const e = s.find_last_not_of(" \t\r\n\"'");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

inline std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

/// \brief The candidate closest to `name` when it is a plausible misspelling (case-insensitive
/// Levenshtein distance at most max(1, |name|/4), or equal ignoring case), else "".
inline std::string nearest(std::string const& name, std::vector<std::string> const& candidates) {
  std::string const a = lower(name);
  std::string best;
  std::size_t best_d = std::max<std::size_t>(1, a.size() / 4) + 1;
  for (auto const& cand : candidates) {
    std::string const b = lower(cand);
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        std::size_t const up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
        diag = up;
      }
    }
    if (row[b.size()] < best_d) best_d = row[b.size()], best = cand;
  }
  return best;
}

/// \brief " (did you mean 'x'?)" for the nearest() candidate, or "" when none is close.
inline std::string did_you_mean(std::string const& name,
                                std::vector<std::string> const& candidates) {
  std::string const n = nearest(name, candidates);
  return n.empty() ? std::string() : cat(" (did you mean '", n, "'?)");
}

inline long long parse_int(std::string const& key, std::string const& v) {
  std::string const t = trim(v);
  std::size_t pos = 0;
  long long r = 0;
  try {
    r = std::stoll(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (t.empty() || pos != t.size()) throw ConfigError(cat(key, "=", v, " is not an integer"));
  return r;
}

inline double parse_double(std::string const& key, std::string const& v) {
  std::string const t = trim(v);
  std::size_t pos = 0;
  double r = 0;
  try {
    r = std::stod(t, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  if (t.empty() || pos != t.size() || !std::isfinite(r))
    throw ConfigError(cat(key, "=", v, " is not a finite number"));
  return r;
}

inline bool parse_bool(std::string const& key, std::string const& v) {
  std::string const t = lower(trim(v));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  throw ConfigError(cat(key, "=", v, " is not a boolean (true or false)"));
}

inline std::vector<std::string> split_list(std::string const& v) {
  std::string t = trim(v);
  if (!t.empty() && t.front() == '[') t = t.substr(1);
  if (!t.empty() && t.back() == ']') t.pop_back();
  std::vector<std::string> out;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(trim(item));
  return out;
}

/// T in a non-deduced context (C++20's std::type_identity_t).
template <class T>
using type_identity_t = typename std::enable_if<true, T>::type;
template <class T>
inline constexpr bool always_false = false;

/// `v` with 17 significant digits (doubles round-trip exactly); enums as their integer.
template <class T>
std::string precise_text(T const& v) {
  std::ostringstream os;
  os.precision(17);
  if constexpr (std::is_enum_v<T>)
    os << static_cast<long long>(v);
  else
    os << v;
  return os.str();
}

}  // namespace moe::detail
