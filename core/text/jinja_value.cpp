// Jinja values: truthiness, Python-style str()/repr(), json.dumps, conversion from JSON, and the
// comparisons and binary operators with Python semantics. See jinja.h and jinja_ast.h.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/text/jinja_ast.h"
#include "core/text/text_unicode.h"

namespace lorapipe::jinja {

value value::from_json(const nlohmann::ordered_json& j) { return from_json(j, 0); }

value value::from_json(const nlohmann::ordered_json& j, int depth) {
  if (depth > 256) return value(none_t{});  // deeper structures are not chat messages
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return value(none_t{});
    case nlohmann::ordered_json::value_t::boolean: return value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      list_t l;
      for (const auto& e : j) l.push_back(from_json(e, depth + 1));
      return value(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      dict_t d;
      for (auto it = j.begin(); it != j.end(); ++it) d.emplace_back(it.key(), from_json(it.value(), depth + 1));
      return value(std::move(d));
    }
    default: return value(none_t{});
  }
}

bool value::truthy() const {
  return std::visit(
      [](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, undefined_t> || std::is_same_v<T, none_t>) return false;
        else if constexpr (std::is_same_v<T, bool>) return x;
        else if constexpr (std::is_same_v<T, int64_t>) return x != 0;
        else if constexpr (std::is_same_v<T, double>) return x != 0.0;
        else if constexpr (std::is_same_v<T, std::string>) return !x.empty();
        else if constexpr (std::is_same_v<T, std::shared_ptr<list_t>> || std::is_same_v<T, std::shared_ptr<dict_t>>) return !x->empty();
        else return true;
      },
      v_);
}

const value* value::find(const std::string& key) const {
  if (is_dict()) {
    for (const auto& [k, v] : as_dict())
      if (k == key) return &v;
  } else if (is_namespace()) {
    for (const auto& [k, v] : as_namespace().attrs)
      if (k == key) return &v;
  }
  return nullptr;
}

std::string value::type_name() const {
  static const char* names[] = {"undefined", "NoneType", "bool", "int", "float", "str", "list", "dict", "Namespace", "function"};
  return names[v_.index()];
}

namespace {
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Shortest representation that round-trips, like Python's repr(float).
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string s = buf;
  const auto e = s.find('e');
  if (e != std::string::npos) {  // Python: 1e+20 -> 1e+20, 1e-05 stays two-digit exponent
    std::string mant = s.substr(0, e), ex = s.substr(e + 1);
    const char sign = ex[0] == '-' ? '-' : '+';
    if (ex[0] == '-' || ex[0] == '+') ex.erase(0, 1);
    while (ex.size() > 2 && ex[0] == '0') ex.erase(0, 1);
    if (ex.size() < 2) ex.insert(0, "0");
    return mant + "e" + sign + ex;
  }
  if (s.find('.') == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
  return s;
}

std::string string_repr(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (const unsigned char c : s) {
    if (c == static_cast<unsigned char>(q) || c == '\\') { out += '\\'; out += static_cast<char>(c); }
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7f) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out + q;
}
}  // namespace

std::string python_repr(const value& v) {
  if (v.is_string()) return string_repr(v.as_string());
  if (v.is_list()) {
    std::string s = "[";
    bool first = true;
    for (const auto& e : v.as_list()) { if (!first) s += ", "; first = false; s += python_repr(e); }
    return s + "]";
  }
  if (v.is_dict()) {
    std::string s = "{";
    bool first = true;
    for (const auto& [k, e] : v.as_dict()) { if (!first) s += ", "; first = false; s += string_repr(k) + ": " + python_repr(e); }
    return s + "}";
  }
  return to_output(v);
}

std::string to_output(const value& v) {
  if (v.is_undefined()) return "";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return float_repr(std::get<double>(v.raw()));
  if (v.is_string()) return v.as_string();
  if (v.is_namespace()) return "<Namespace>";
  if (v.is_callable()) return "<function " + v.as_callable().name + ">";
  return python_repr(v);
}

namespace {
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); out += b; }
        else out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

status dump(const value& v, int indent, bool sort_keys, int depth, std::string& out) {
  const std::string nl = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * (depth + 1)), ' ') : "";
  const std::string nl_end = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * depth), ' ') : "";
  const char* item_sep = indent >= 0 ? "," : ", ";
  if (v.is_none() || v.is_undefined()) out += "null";
  else if (v.is_bool()) out += v.as_bool() ? "true" : "false";
  else if (v.is_int()) out += std::to_string(v.as_int());
  else if (v.is_float()) {
    const double d = std::get<double>(v.raw());
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : float_repr(d);
  } else if (v.is_string()) out += json_string(v.as_string());
  else if (v.is_list()) {
    if (v.as_list().empty()) { out += "[]"; return ok_status(); }
    out += "[";
    bool first = true;
    for (const auto& e : v.as_list()) {
      if (!first) out += item_sep;
      first = false;
      out += nl;
      LP_TRY(dump(e, indent, sort_keys, depth + 1, out));
    }
    out += nl_end + "]";
  } else if (v.is_dict() || v.is_namespace()) {
    dict_t d = v.is_dict() ? v.as_dict() : v.as_namespace().attrs;
    if (d.empty()) { out += "{}"; return ok_status(); }
    if (sort_keys) std::stable_sort(d.begin(), d.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    out += "{";
    bool first = true;
    for (const auto& [k, e] : d) {
      if (!first) out += item_sep;
      first = false;
      out += nl + json_string(k) + ": ";
      LP_TRY(dump(e, indent, sort_keys, depth + 1, out));
    }
    out += nl_end + "}";
  } else return make_error("tojson: {} is not JSON serializable", v.type_name());
  return ok_status();
}
}  // namespace

result<std::string> to_json(const value& v, int indent, bool sort_keys) {
  std::string out;
  LP_TRY(dump(v, indent, sort_keys, 0, out));
  return out;
}

// ---- operators and comparisons shared by the renderer (jinja_eval.cpp) ----

bool values_equal(const value& a, const value& b) {
  if (a.is_number() && b.is_number()) return a.as_number() == b.as_number();
  if ((a.is_bool() && b.is_number()) || (a.is_number() && b.is_bool())) return a.as_number() == b.as_number();
  if (a.raw().index() != b.raw().index()) return false;
  if (a.is_none() || a.is_undefined()) return true;
  if (a.is_bool()) return a.as_bool() == b.as_bool();
  if (a.is_string()) return a.as_string() == b.as_string();
  if (a.is_list()) {
    if (a.as_list().size() != b.as_list().size()) return false;
    for (size_t i = 0; i < a.as_list().size(); ++i)
      if (!values_equal(a.as_list()[i], b.as_list()[i])) return false;
    return true;
  }
  if (a.is_dict()) {
    if (a.as_dict().size() != b.as_dict().size()) return false;
    for (const auto& [k, v] : a.as_dict()) {
      const value* o = b.find(k);
      if (o == nullptr || !values_equal(v, *o)) return false;
    }
    return true;
  }
  return &a.raw() == &b.raw();
}

result<int> compare(const value& a, const value& b) {
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    const double x = a.as_number(), y = b.as_number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string() ? -1 : a.as_string() > b.as_string() ? 1 : 0;
  return make_error("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name());
}

result<std::vector<value>> iterate(const value& v) {
  if (v.is_list()) return v.as_list();
  if (v.is_dict()) {
    std::vector<value> keys;
    for (const auto& [k, e] : v.as_dict()) keys.emplace_back(k);
    return keys;
  }
  if (v.is_string()) {
    std::vector<value> chars;
    const auto& s = v.as_string();
    for (size_t i = 0; i < s.size();) {
      const size_t b = i;
      i += utf8_len(static_cast<unsigned char>(s[i]));
      chars.emplace_back(s.substr(b, i - b));
    }
    return chars;
  }
  if (v.is_undefined()) return std::vector<value>{};
  return make_error("'{}' object is not iterable", v.type_name());
}

int64_t length_of(const value& v) {
  if (v.is_string()) {
    int64_t n = 0;
    for (unsigned char c : v.as_string()) n += (c & 0xc0) != 0x80;
    return n;
  }
  if (v.is_list()) return static_cast<int64_t>(v.as_list().size());
  if (v.is_dict()) return static_cast<int64_t>(v.as_dict().size());
  return 0;
}


result<value> binary_op(const std::string& op, const value& a, const value& b, int line) {
  if (op == "==") return value(values_equal(a, b));
  if (op == "!=") return value(!values_equal(a, b));
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    auto c = compare(a, b);
    if (!c) return make_error("line {}: {}", line, c.message());
    return value(op == "<" ? *c < 0 : op == ">" ? *c > 0 : op == "<=" ? *c <= 0 : *c >= 0);
  }
  if (op == "in") {
    if (b.is_string() && a.is_string()) return value(b.as_string().find(a.as_string()) != std::string::npos);
    if (b.is_list()) {
      for (const auto& e : b.as_list())
        if (values_equal(e, a)) return value(true);
      return value(false);
    }
    if (b.is_dict()) return value(a.is_string() && b.find(a.as_string()) != nullptr);
    if (b.is_undefined()) return make_error("line {}: '{}' is undefined (right of 'in')", line, b.as_undefined().name);
    return make_error("line {}: argument of type '{}' is not iterable", line, b.type_name());
  }
  if (op == "~") return value(to_output(a) + to_output(b));
  if (op == "+") {
    if (a.is_string() && b.is_string()) return value(a.as_string() + b.as_string());
    if (a.is_list() && b.is_list()) {
      list_t l = a.as_list();
      l.insert(l.end(), b.as_list().begin(), b.as_list().end());
      return value(std::move(l));
    }
  }
  if (op == "*" && a.is_string() && b.is_int()) {
    if (static_cast<double>(a.as_string().size()) * static_cast<double>(b.as_int()) > 64e6)
      return make_error("line {}: string repetition larger than 64 MB", line);
    std::string s;
    for (int64_t i = 0; i < b.as_int(); ++i) s += a.as_string();
    return value(s);
  }
  const bool num = (a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool());
  if (!num) {
    if (a.is_undefined() || b.is_undefined())
      return make_error("line {}: '{}' is undefined (operand of '{}')", line, (a.is_undefined() ? a : b).as_undefined().name, op);
    return make_error("line {}: unsupported operand type(s) for {}: '{}' and '{}'", line, op, a.type_name(), b.type_name());
  }
  const bool ints = (a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool());
  const int64_t x = ints ? static_cast<int64_t>(a.as_number()) : 0, y = ints ? static_cast<int64_t>(b.as_number()) : 0;
  const double dx = a.as_number(), dy = b.as_number();
  if (op == "+") return ints ? value(x + y) : value(dx + dy);
  if (op == "-") return ints ? value(x - y) : value(dx - dy);
  if (op == "*") return ints ? value(x * y) : value(dx * dy);
  if (op == "**") return ints && y >= 0 ? value(static_cast<int64_t>(std::llround(std::pow(dx, dy)))) : value(std::pow(dx, dy));
  if (dy == 0) return make_error("line {}: division by zero", line);
  if (op == "/") return value(dx / dy);
  if (op == "//") return ints ? value(static_cast<int64_t>(std::floor(dx / dy))) : value(std::floor(dx / dy));
  if (op == "%") {
    if (ints) { int64_t m = x % y; if (m != 0 && ((m < 0) != (y < 0))) m += y; return value(m); }
    return value(dx - dy * std::floor(dx / dy));
  }
  return make_error("line {}: unknown operator {}", line, op);
}

}  // namespace lorapipe::jinja
