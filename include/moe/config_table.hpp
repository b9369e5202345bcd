#pragma once
/// \file
/// Config field tables: one descriptor per key and the rules between the values, from which a
/// config struct's set(), keys(), describe() and validate() all come.

#include <moe/detail/parse.hpp>
#include <moe/error.hpp>

#include <algorithm>
#include <any>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace moe {

/// \brief Value type of one config field: what set() parses and what a key listing shows.
enum class FieldType {
  Int,     ///< 32-bit signed integer
  Int64,   ///< 64-bit signed integer
  UInt64,  ///< 64-bit integer >= 0 (seeds)
  Double,  ///< finite number
  Bool,    ///< true | false (also 1/0, yes/no, on/off)
  String,  ///< text (surrounding blanks and quotes are removed)
  Choice   ///< one of ConfigField::choices
};

/// Name of a FieldType in key listings.
inline char const* type_name(FieldType t) {
  static char const* const names[] = {"int",  "int64",  "uint64", "float",
                                      "bool", "string", "choice"};
  static_assert(sizeof(names) / sizeof(names[0]) == int(FieldType::Choice) + 1,
                "one name per FieldType");
  return names[static_cast<int>(t)];
}

/// \brief How describe() writes numbers: std::to_string (integers; 6 decimals for floats) or 17
/// significant digits. Booleans are 1/0 and enums their integer in both.
enum class DescribeNumbers { ToString, Precise };

/// \brief One key of a config struct `C`.
template <class C>
struct ConfigField {
  std::string key;                   ///< the canonical key (MaxText's name where it has one)
  std::vector<std::string> aliases;  ///< other keys that set the same field
  std::string tag;  ///< its name in describe(); "" when another field's text covers it
  FieldType type = FieldType::Int;
  std::vector<std::string> choices;  ///< Choice: the accepted values, as error messages list them
  std::string doc;                   ///< one line: what the value means
  std::any member;                   ///< the `T C::*` the field sets
  /// Sets the field from text (the key as given, for messages); ConfigError for a bad value.
  std::function<void(C&, std::string const& key, std::string const& value)> parse;
  /// The value in set()'s syntax: set(key, text(c)) leaves the field as it is.
  std::function<std::string(C const&)> text;
  /// The value in describe()'s form.
  std::function<std::string(C const&, DescribeNumbers)> describe;
};

/// \brief One validation rule of a config struct: `check` throws ConfigError naming the values.
template <class C>
struct ConfigRule {
  std::string key;  ///< the field the rule is about ("" for a rule over several fields)
  std::string doc;  ///< the rule in words, e.g. "must be >= 1"
  std::function<void(C const&)> check;
};

/// \brief The field table of config struct `C`, built once (a function-local static). A key or
/// member listed twice, or a rule naming no field, throws std::logic_error on first use.
template <class C>
class ConfigTable {
 public:
  /// `numbers`: how describe() writes numbers; `separator`: what it puts between fields.
  explicit ConfigTable(DescribeNumbers numbers = DescribeNumbers::ToString,
                       std::string separator = ";")
      : numbers_(numbers), separator_(std::move(separator)) {}

  /// \brief A field of type int, std::int64_t, std::uint64_t, double, bool or std::string, parsed
  /// by its type (`key=value is not an integer`, `... does not fit in 32 bits`, ...).
  template <class T>
  ConfigTable& field(std::string key, T C::*m, std::string tag, std::string doc) {
    ConfigField<C>& f = add(std::move(key), m, std::move(tag), std::move(doc));
    f.type = type_of<T>();
    f.parse = [m](C& c, std::string const& k, std::string const& v) { c.*m = parse_as<T>(k, v); };
    f.text = [m](C const& c) { return text_of(c.*m); };
    return *this;
  }

  /// \brief A field that takes one of a few values: (spelling, value) pairs, several spellings
  /// may give one value (the first is the value's canonical text). Any other text is
  /// `key=value is not supported (a | b | ...)`.
  template <class T>
  ConfigTable& choice(std::string key, T C::*m, std::string tag,
                      std::vector<std::pair<std::string, T>> spellings, std::string doc) {
    ConfigField<C>& f = add(std::move(key), m, std::move(tag), std::move(doc));
    f.type = FieldType::Choice;
    for (auto it = spellings.begin(); it != spellings.end(); ++it)  // first spelling per value
      if (std::none_of(spellings.begin(), it,
                       [&](auto const& e) { return e.second == it->second; }))
        f.choices.push_back(it->first);
    std::string const list = choice_list(f.choices);
    f.parse = [m, spellings, list](C& c, std::string const& k, std::string const& v) {
      std::string const t = detail::trim(v);
      auto const it = std::find_if(spellings.begin(), spellings.end(),
                                   [&](auto const& e) { return e.first == t; });
      if (it == spellings.end())
        throw ConfigError(detail::cat(k, "=", v, " is not supported (", list, ")"));
      c.*m = it->second;
    };
    f.text = [m, spellings](C const& c) {
      for (auto const& [s, value] : spellings)
        if (value == c.*m) return s;
      return detail::precise_text(c.*m);  // a value no spelling has (enums: their integer)
    };
    return *this;
  }

  /// Another key for the last field (e.g. a short name).
  ConfigTable& alias(std::string name) {
    require_unused(name);
    last().aliases.push_back(std::move(name));
    return *this;
  }

  /// Replaces how the last field is parsed (the field's own type checks are then `f`'s job).
  ConfigTable& parse_with(
      std::function<void(C&, std::string const& key, std::string const& value)> f) {
    last().parse = std::move(f);
    return *this;
  }

  /// Replaces the last field's value text in describe().
  ConfigTable& describe_with(std::function<std::string(C const&, DescribeNumbers)> f) {
    last().describe = std::move(f);
    return *this;
  }

  /// \brief Rule `ok(value)` on field `m`, else `key=value <must>`. Rules run in the order added.
  template <class T, class Pred>
  ConfigTable& rule(T C::*m, std::string must, Pred ok) {
    std::string const key = field_of(m).key;
    rules_.push_back({key, must, [m, key, must, ok](C const& c) {
                        if (!ok(c.*m)) throw ConfigError(detail::cat(key, "=", c.*m, " ", must));
                      }});
    return *this;
  }
  /// `key=value must be >= min`.
  template <class T>
  ConfigTable& at_least(T C::*m, detail::type_identity_t<T> min) {
    return rule(m, detail::cat("must be >= ", min), [min](T const& v) { return v >= min; });
  }
  /// `key=value must be > min`.
  template <class T>
  ConfigTable& greater_than(T C::*m, detail::type_identity_t<T> min) {
    return rule(m, detail::cat("must be > ", min), [min](T const& v) { return v > min; });
  }
  /// A rule about field `m` that may read the others; `check` throws ConfigError itself.
  template <class T>
  ConfigTable& check(T C::*m, std::string doc, std::function<void(C const&)> check) {
    rules_.push_back({field_of(m).key, std::move(doc), std::move(check)});
    return *this;
  }
  /// A rule over several fields; `check` throws ConfigError itself.
  ConfigTable& check(std::string doc, std::function<void(C const&)> check) {
    rules_.push_back({std::string(), std::move(doc), std::move(check)});
    return *this;
  }

  /// Every field, in table order.
  std::vector<ConfigField<C>> const& fields() const { return fields_; }

  /// The field `key` (or one of its aliases) names, or nullptr.
  ConfigField<C> const* find(std::string const& key) const {
    for (auto const& f : fields_)
      if (f.key == key || std::find(f.aliases.begin(), f.aliases.end(), key) != f.aliases.end())
        return &f;
    return nullptr;
  }
  /// The field of member `m`; std::logic_error when the table has none.
  template <class T>
  ConfigField<C> const& field_of(T C::*m) const {
    for (auto const& f : fields_)
      if (auto const* p = std::any_cast<T C::*>(&f.member); p && *p == m) return f;
    throw std::logic_error("config table: a rule names a member that is not a field");
  }
  /// The value of field `f` (whose member has type T) in `c`.
  template <class T>
  T const& get(C const& c, ConfigField<C> const& f) const {
    return c.*std::any_cast<T C::*>(f.member);
  }

  /// Every key set() accepts: each field's key, then its aliases, in table order.
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (auto const& f : fields_) {
      k.push_back(f.key);
      k.insert(k.end(), f.aliases.begin(), f.aliases.end());
    }
    return k;
  }
  bool has_key(std::string const& key) const { return find(key) != nullptr; }

  /// Sets `key` from text; ConfigError for a bad value or an unknown key (naming the nearest).
  void set(C& c, std::string const& key, std::string const& value) const {
    ConfigField<C> const* f = find(key);
    if (!f)
      throw ConfigError(detail::cat("unknown config key '", key, "' (value ", value, ")",
                                    detail::did_you_mean(key, keys())));
    f->parse(c, key, value);
  }

  /// The canonical text of every field: `tag=value` joined by the separator, in table order.
  std::string describe(C const& c) const {
    std::string s;
    for (auto const& f : fields_) {
      if (f.tag.empty()) continue;
      if (!s.empty()) s += separator_;
      s += f.tag + "=" + f.describe(c, numbers_);
    }
    return s;
  }

  /// Runs every rule in order; the first that fails throws its ConfigError.
  void validate(C const& c) const {
    for (auto const& r : rules_) r.check(c);
  }

  /// \brief One line per key: `key (alias a): type, default <text of defaults> -- doc; rules`.
  std::string listing(C const& defaults) const {
    std::string s;
    for (auto const& f : fields_) {
      s += f.key;
      for (auto const& a : f.aliases) s += " (alias " + a + ")";
      s += std::string(": ") + type_name(f.type);
      if (f.type == FieldType::Choice) s += " (" + choice_list(f.choices) + ")";
      s += ", default " + quoted(f.text(defaults)) + " -- " + f.doc;
      for (auto const& r : rules_)
        if (r.key == f.key && !r.doc.empty()) s += "; " + r.doc;
      s += "\n";
    }
    return s;
  }

 private:
  DescribeNumbers numbers_;
  std::string separator_;
  std::vector<ConfigField<C>> fields_;
  std::vector<ConfigRule<C>> rules_;

  static std::string quoted(std::string const& s) { return s.empty() ? "\"\"" : s; }

  /// "a | b | \"\"": the accepted values of a choice, as messages and listings show them.
  static std::string choice_list(std::vector<std::string> const& choices) {
    std::string list;
    for (auto const& c : choices) list += (list.empty() ? "" : " | ") + quoted(c);
    return list;
  }

  ConfigField<C>& last() {
    if (fields_.empty()) throw std::logic_error("config table: no field to modify yet");
    return fields_.back();
  }

  void require_unused(std::string const& key) const {
    if (key.empty()) throw std::logic_error("config table: empty key");
    if (find(key)) throw std::logic_error("config table: key '" + key + "' is listed twice");
  }

  template <class T>
  ConfigField<C>& add(std::string key, T C::*m, std::string tag, std::string doc) {
    require_unused(key);
    for (auto const& f : fields_) {
      if (auto const* p = std::any_cast<T C::*>(&f.member); p && *p == m)
        throw std::logic_error("config table: keys '" + f.key + "' and '" + key +
                               "' set the same member");
      if (!tag.empty() && f.tag == tag)
        throw std::logic_error("config table: describe() name '" + tag + "' is used twice");
    }
    ConfigField<C>& f = fields_.emplace_back();
    f.key = std::move(key);
    f.tag = std::move(tag);
    f.doc = std::move(doc);
    f.member = m;
    f.describe = [m](C const& c, DescribeNumbers n) { return describe_of(c.*m, n); };
    return f;
  }

  template <class T>
  static constexpr FieldType type_of() {
    if constexpr (std::is_same_v<T, bool>)
      return FieldType::Bool;
    else if constexpr (std::is_same_v<T, int>)
      return FieldType::Int;
    else if constexpr (std::is_same_v<T, std::int64_t>)
      return FieldType::Int64;
    else if constexpr (std::is_same_v<T, std::uint64_t>)
      return FieldType::UInt64;
    else if constexpr (std::is_same_v<T, double>)
      return FieldType::Double;
    else if constexpr (std::is_same_v<T, std::string>)
      return FieldType::String;
    else
      static_assert(detail::always_false<T>,
                    "config fields are int, std::int64_t, std::uint64_t, double, bool or "
                    "std::string (use choice() for enums)");
  }

  template <class T>
  static T parse_as(std::string const& key, std::string const& value) {
    constexpr FieldType t = type_of<T>();
    if constexpr (t == FieldType::Bool) {
      return detail::parse_bool(key, value);
    } else if constexpr (t == FieldType::Int) {
      long long const r = detail::parse_int(key, value);
      if (r < -2147483647LL || r > 2147483647LL)
        throw ConfigError(detail::cat(key, "=", value, " does not fit in 32 bits"));
      return static_cast<int>(r);
    } else if constexpr (t == FieldType::Int64) {
      return static_cast<std::int64_t>(detail::parse_int(key, value));
    } else if constexpr (t == FieldType::UInt64) {
      long long const r = detail::parse_int(key, value);
      if (r < 0) throw ConfigError(detail::cat(key, "=", value, " must be >= 0"));
      return static_cast<std::uint64_t>(r);
    } else if constexpr (t == FieldType::Double) {
      return detail::parse_double(key, value);
    } else {
      return detail::trim(value);
    }
  }

  template <class T>
  static std::string text_of(T const& v) {
    if constexpr (std::is_same_v<T, bool>)
      return v ? "true" : "false";
    else if constexpr (std::is_same_v<T, std::string>)
      return v;
    else if constexpr (std::is_floating_point_v<T>)
      return detail::precise_text(v);
    else
      return std::to_string(v);
  }

  template <class T>
  static std::string describe_of(T const& v, DescribeNumbers n) {
    if constexpr (std::is_same_v<T, std::string>)
      return v;
    else if (n == DescribeNumbers::Precise)
      return detail::precise_text(v);
    else  // enums as their integer
      return std::to_string(std::conditional_t<std::is_enum_v<T>, int, T>(v));
  }
};

}  // namespace moe
