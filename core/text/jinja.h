// A Jinja2 subset for chat templates (tokenizer_config.json "chat_template"), rendering byte-identically
// to transformers' environment (trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception,
// strftime_now). Supported: {{ }}, {% if/elif/else %}, {% for %} (else, inline if, unpacking, loop.*),
// {% set %} (names, namespace attributes, blocks), {% macro %}, break/continue, {% generation %},
// comments and whitespace control; expressions with Python semantics, the common filters, tests and
// string/dict methods. Anything else is a parse error that names the construct and its line.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/base/result.h"

namespace lorapipe::jinja {

class value;
using list_t = std::vector<value>;
using dict_t = std::vector<std::pair<std::string, value>>;  // insertion order, like a Python dict
struct undefined_t {
  std::string name;  // what was looked up, for error messages
};
struct none_t {};
struct callable_t;  // builtin function, bound method or macro
struct namespace_t;

class value {
 public:
  using storage = std::variant<undefined_t, none_t, bool, int64_t, double, std::string, std::shared_ptr<list_t>,
                               std::shared_ptr<dict_t>, std::shared_ptr<namespace_t>, std::shared_ptr<callable_t>>;
  value() : v_(undefined_t{}) {}
  value(none_t n) : v_(n) {}
  value(bool b) : v_(b) {}
  value(int v) : v_(static_cast<int64_t>(v)) {}
  value(int64_t v) : v_(v) {}
  value(double v) : v_(v) {}
  value(std::string s) : v_(std::move(s)) {}
  value(const char* s) : v_(std::string(s)) {}
  value(list_t l) : v_(std::make_shared<list_t>(std::move(l))) {}
  value(dict_t d) : v_(std::make_shared<dict_t>(std::move(d))) {}
  static value undefined(std::string name) { value v; v.v_ = undefined_t{std::move(name)}; return v; }
  static value from_json(const nlohmann::ordered_json& j);
  static value from_json(const nlohmann::ordered_json& j, int depth);
  template <class T> explicit value(std::shared_ptr<T> p) : v_(std::move(p)) {}

  bool is_undefined() const { return std::holds_alternative<undefined_t>(v_); }
  bool is_none() const { return std::holds_alternative<none_t>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_number() const { return is_int() || is_float(); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<list_t>>(v_); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<dict_t>>(v_); }
  bool is_namespace() const { return std::holds_alternative<std::shared_ptr<namespace_t>>(v_); }
  bool is_callable() const { return std::holds_alternative<std::shared_ptr<callable_t>>(v_); }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_number() const { return is_int() ? static_cast<double>(as_int()) : is_bool() ? (as_bool() ? 1.0 : 0.0) : std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const list_t& as_list() const { return *std::get<std::shared_ptr<list_t>>(v_); }
  const dict_t& as_dict() const { return *std::get<std::shared_ptr<dict_t>>(v_); }
  namespace_t& as_namespace() const { return *std::get<std::shared_ptr<namespace_t>>(v_); }
  const callable_t& as_callable() const { return *std::get<std::shared_ptr<callable_t>>(v_); }
  const undefined_t& as_undefined() const { return std::get<undefined_t>(v_); }

  bool truthy() const;
  const value* find(const std::string& key) const;  // dict key lookup
  std::string type_name() const;
  const storage& raw() const { return v_; }

 private:
  storage v_;
};

struct namespace_t {
  dict_t attrs;
};

struct call_args {
  std::vector<value> pos;
  std::vector<std::pair<std::string, value>> kw;
  const value* kwarg(const std::string& k) const {
    for (const auto& [n, v] : kw)
      if (n == k) return &v;
    return nullptr;
  }
};

struct callable_t {
  std::string name;
  std::function<result<value>(const call_args&)> fn;
};

// Python str() / repr() of a value, as Jinja prints it.
std::string to_output(const value& v);
std::string python_repr(const value& v);
// Python json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys).
result<std::string> to_json(const value& v, int indent, bool sort_keys);

struct node;  // template AST (jinja_parse.cpp)

class template_program {
 public:
  static result<template_program> parse(const std::string& source);
  // globals: variables visible to the template (messages, add_generation_prompt, bos_token, ...).
  // generation_spans: [begin, end) byte ranges of the output rendered inside {% generation %} blocks.
  result<std::string> render(const dict_t& globals, std::vector<std::pair<size_t, size_t>>* generation_spans = nullptr) const;

 private:
  std::shared_ptr<const node> root_;
};

}  // namespace lorapipe::jinja
