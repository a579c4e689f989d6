// Jinja renderer: evaluates the AST (jinja_ast.h) with Python semantics, the filters, tests and methods
// chat templates use, and transformers' globals (raise_exception, strftime_now, namespace, range).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "core/text/jinja_ast.h"
#include "core/text/text_unicode.h"

namespace lorapipe::jinja {
namespace {

enum class flow { normal, brk, cont };

value make_fn(std::string name, std::function<result<value>(const call_args&)> fn) {
  return value(std::make_shared<callable_t>(callable_t{std::move(name), std::move(fn)}));
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string strip_chars(const std::string& s, const value* chars, bool left, bool right) {
  auto in_set = [&](char c) { return chars != nullptr && chars->is_string() ? chars->as_string().find(c) != std::string::npos : is_space(c); };
  size_t b = 0, e = s.size();
  if (left) while (b < e && in_set(s[b])) ++b;
  if (right) while (e > b && in_set(s[e - 1])) --e;
  return s.substr(b, e - b);
}

class renderer {
 public:
  renderer(const dict_t& globals, std::vector<std::pair<size_t, size_t>>* spans) : spans_(spans) {
    frames_.emplace_back();
    auto& g = frames_.back();
    g["raise_exception"] = make_fn("raise_exception", [](const call_args& a) -> result<value> {
      return make_error("template raised an exception: {}", a.pos.empty() ? std::string() : to_output(a.pos[0]));
    });
    g["namespace"] = make_fn("namespace", [](const call_args& a) -> result<value> {
      auto ns = std::make_shared<namespace_t>();
      if (!a.pos.empty() && a.pos[0].is_dict()) ns->attrs = a.pos[0].as_dict();
      for (const auto& [k, v] : a.kw) ns->attrs.emplace_back(k, v);
      return value(ns);
    });
    g["dict"] = make_fn("dict", [](const call_args& a) -> result<value> {
      dict_t d;
      for (const auto& [k, v] : a.kw) d.emplace_back(k, v);
      return value(std::move(d));
    });
    g["range"] = make_fn("range", [](const call_args& a) -> result<value> {
      int64_t start = 0, stop = 0, step = 1;
      for (const auto& p : a.pos)
        if (!p.is_int()) return make_error("range() arguments must be integers");
      if (a.pos.size() == 1) stop = a.pos[0].as_int();
      else if (a.pos.size() >= 2) start = a.pos[0].as_int(), stop = a.pos[1].as_int();
      if (a.pos.size() == 3) step = a.pos[2].as_int();
      if (step == 0 || a.pos.empty() || a.pos.size() > 3) return make_error("range(): bad arguments");
      const double count = (static_cast<double>(stop) - static_cast<double>(start)) / static_cast<double>(step);
      if (count > 10'000'000) return make_error("range(): more than 10M items");
      list_t l;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) l.emplace_back(i);
      return value(std::move(l));
    });
    g["strftime_now"] = make_fn("strftime_now", [](const call_args& a) -> result<value> {
      if (a.pos.empty() || !a.pos[0].is_string()) return make_error("strftime_now(format) needs a format string");
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, a.pos[0].as_string().c_str(), &tm);
      return value(std::string(buf, n));
    });
    for (const auto& [k, v] : globals) g[k] = v;
  }

  status render(const node& n, std::string& out, flow& f) {
    // Budgets keep hostile templates (endless macros, huge loops) from hanging or exhausting memory.
    if (++steps_ > 20'000'000) return make_error("line {}: template too expensive (more than 20M steps)", n.line);
    if (out.size() > (256u << 20)) return make_error("line {}: template output larger than 256 MiB", n.line);
    switch (n.k) {
      case node::kind::sequence:
        for (const auto& c : n.body) {
          LP_TRY(render(*c, out, f));
          if (f != flow::normal) return ok_status();
        }
        return ok_status();
      case node::kind::text: out += n.text; return ok_status();
      case node::kind::output: {
        LP_TRY_ASSIGN(v, eval(*n.exprs[0]));
        out += to_output(v);
        return ok_status();
      }
      case node::kind::if_:
        for (size_t i = 0; i < n.exprs.size(); ++i) {
          LP_TRY_ASSIGN(c, eval(*n.exprs[i]));
          if (c.truthy()) return render(*n.body[i], out, f);
        }
        if (n.has_else) return render(*n.body.back(), out, f);
        return ok_status();
      case node::kind::for_: return render_for(n, out, f);
      case node::kind::set: {
        LP_TRY_ASSIGN(v, eval(*n.exprs[0]));
        return assign(n, std::move(v));
      }
      case node::kind::set_block: {
        std::string s;
        flow inner = flow::normal;
        LP_TRY(render(*n.body[0], s, inner));
        return assign(n, value(std::move(s)));
      }
      case node::kind::macro: {
        auto body = n.body[0];
        const node* def = &n;
        frames_.back()[n.text] = make_fn(n.text, [this, body, def](const call_args& a) -> result<value> {
          if (frames_.size() > 256) return make_error("macro {}: recursion too deep", def->text);
          frames_.emplace_back();
          for (size_t i = 0; i < def->targets.size(); ++i) {
            value v = value::undefined(def->targets[i]);
            if (i < a.pos.size()) v = a.pos[i];
            else if (const value* kv = a.kwarg(def->targets[i])) v = *kv;
            else if (def->exprs[i]) {
              auto d = eval(*def->exprs[i]);
              if (!d) { frames_.pop_back(); return make_error("{}", d.message()); }
              v = *d;
            }
            frames_.back()[def->targets[i]] = v;
          }
          std::string s;
          flow inner = flow::normal;
          auto st = render(*body, s, inner);
          frames_.pop_back();
          if (!st) return make_error("{}", st.message());
          return value(std::move(s));
        });
        return ok_status();
      }
      case node::kind::break_: f = flow::brk; return ok_status();
      case node::kind::continue_: f = flow::cont; return ok_status();
      case node::kind::generation: {
        const size_t begin = out.size();
        LP_TRY(render(*n.body[0], out, f));
        if (spans_ != nullptr) spans_->emplace_back(begin, out.size());
        return ok_status();
      }
    }
    return ok_status();
  }

 private:
  status assign(const node& n, value v) {
    if (!n.text.empty()) {  // {% set ns.attr = v %}
      value* target = lookup_mut(n.targets[0]);
      if (target == nullptr || !target->is_namespace())
        return make_error("line {}: cannot assign attribute on non-namespace object '{}'", n.line, n.targets[0]);
      auto& attrs = target->as_namespace().attrs;
      for (auto& [k, e] : attrs)
        if (k == n.text) { e = std::move(v); return ok_status(); }
      attrs.emplace_back(n.text, std::move(v));
      return ok_status();
    }
    frames_.back()[n.targets[0]] = std::move(v);
    return ok_status();
  }

  value* lookup_mut(const std::string& name) {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }

  status render_for(const node& n, std::string& out, flow& f) {
    LP_TRY_ASSIGN(seq, eval(*n.exprs[0]));
    LP_TRY_ASSIGN(all, iterate(seq));
    std::vector<value> items;
    if (n.exprs.size() > 1) {  // {% for x in xs if cond %}
      for (auto& item : all) {
        frames_.emplace_back();
        bind_targets(n, item);
        auto c = eval(*n.exprs[1]);
        frames_.pop_back();
        if (!c) return make_error("{}", c.message());
        if (c->truthy()) items.push_back(item);
      }
    } else items = std::move(all);
    if (items.empty()) {
      if (n.has_else) return render(*n.body[1], out, f);
      return ok_status();
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      frames_.emplace_back();
      bind_targets(n, items[static_cast<size_t>(i)]);
      dict_t loop{{"index", value(i + 1)}, {"index0", value(i)}, {"revindex", value(len - i)}, {"revindex0", value(len - i - 1)},
                  {"first", value(i == 0)}, {"last", value(i == len - 1)}, {"length", value(len)},
                  {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : value::undefined("previtem")},
                  {"nextitem", i + 1 < len ? items[static_cast<size_t>(i + 1)] : value::undefined("nextitem")}};
      loop.emplace_back("cycle", make_fn("cycle", [i](const call_args& a) -> result<value> {
        if (a.pos.empty()) return make_error("loop.cycle() needs arguments");
        return a.pos[static_cast<size_t>(i) % a.pos.size()];
      }));
      frames_.back()["loop"] = value(std::move(loop));
      flow inner = flow::normal;
      auto st = render(*n.body[0], out, inner);
      frames_.pop_back();
      LP_TRY(st);
      if (inner == flow::brk) break;
    }
    (void)f;
    return ok_status();
  }

  void bind_targets(const node& n, const value& item) {
    if (n.targets.size() == 1) {
      frames_.back()[n.targets[0]] = item;
      return;
    }
    for (size_t k = 0; k < n.targets.size(); ++k)
      frames_.back()[n.targets[k]] = item.is_list() && k < item.as_list().size() ? item.as_list()[k] : value::undefined(n.targets[k]);
  }

  result<value> eval(const expr& e);
  result<value> get_attr(const value& obj, const std::string& name, int line);
  result<value> get_item(const value& obj, const value& key, int line);
  result<value> apply_filter(const std::string& name, const value& v, const call_args& a, int line);
  result<bool> apply_test(const std::string& name, const value& v, const std::vector<value>& args, int line);

  std::vector<std::unordered_map<std::string, value>> frames_;
  std::vector<std::pair<size_t, size_t>>* spans_;
  int64_t steps_ = 0;
};

result<value> renderer::get_attr(const value& obj, const std::string& name, int line) {
  if (obj.is_undefined()) return make_error("line {}: '{}' is undefined (reading .{})", line, obj.as_undefined().name, name);
  if (obj.is_dict() || obj.is_namespace()) {
    if (const value* v = obj.find(name)) return *v;
  }
  if (obj.is_string()) {
    const std::string s = obj.as_string();
    auto str_method = [&](auto fn) { return make_fn(name, fn); };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return str_method([s, name](const call_args& a) -> result<value> {
        const value* chars = a.pos.empty() ? nullptr : &a.pos[0];
        return value(strip_chars(s, chars, name != "rstrip", name != "lstrip"));
      });
    if (name == "startswith" || name == "endswith")
      return str_method([s, name](const call_args& a) -> result<value> {
        if (a.pos.empty()) return make_error("{}() needs an argument", name);
        std::vector<std::string> cands;
        if (a.pos[0].is_string()) cands.push_back(a.pos[0].as_string());
        else if (a.pos[0].is_list())
          for (const auto& c : a.pos[0].as_list()) if (c.is_string()) cands.push_back(c.as_string());
        for (const auto& c : cands) {
          if (name == "startswith" && s.compare(0, c.size(), c) == 0) return value(true);
          if (name == "endswith" && s.size() >= c.size() && s.compare(s.size() - c.size(), c.size(), c) == 0) return value(true);
        }
        return value(false);
      });
    if (name == "split" || name == "rsplit")
      return str_method([s](const call_args& a) -> result<value> {
        list_t parts;
        const value* sep = a.pos.empty() ? a.kwarg("sep") : &a.pos[0];
        int64_t maxsplit = a.pos.size() > 1 && a.pos[1].is_int() ? a.pos[1].as_int() : -1;
        if (sep == nullptr || sep->is_none()) {
          size_t i = 0;
          while (i < s.size()) {
            while (i < s.size() && is_space(s[i])) ++i;
            if (i >= s.size()) break;
            size_t j = i;
            if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) j = s.size();
            else while (j < s.size() && !is_space(s[j])) ++j;
            parts.emplace_back(strip_chars(s.substr(i, j - i), nullptr, false, true));
            i = j;
          }
          return value(std::move(parts));
        }
        if (!sep->is_string() || sep->as_string().empty()) return make_error("split(): empty separator");
        const std::string& d = sep->as_string();
        size_t pos = 0;
        for (size_t f; (f = s.find(d, pos)) != std::string::npos && (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit); pos = f + d.size())
          parts.emplace_back(s.substr(pos, f - pos));
        parts.emplace_back(s.substr(pos));
        return value(std::move(parts));
      });
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
      return str_method([s, name, this](const call_args&) -> result<value> { return apply_filter(name, value(s), {}, 0); });
    if (name == "replace")
      return str_method([s, this](const call_args& a) -> result<value> { return apply_filter("replace", value(s), a, 0); });
    if (name == "find" || name == "count")
      return str_method([s, name](const call_args& a) -> result<value> {
        if (a.pos.empty() || !a.pos[0].is_string()) return make_error("{}() needs a string", name);
        const auto& sub = a.pos[0].as_string();
        if (name == "find") { auto p = s.find(sub); return value(p == std::string::npos ? int64_t{-1} : static_cast<int64_t>(p)); }
        int64_t n = 0;
        if (!sub.empty()) for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return value(n);
      });
    if (name == "join")
      return str_method([s](const call_args& a) -> result<value> {
        if (a.pos.empty()) return make_error("join() needs an iterable");
        LP_TRY_ASSIGN(items, iterate(a.pos[0]));
        std::string out;
        for (size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + to_output(items[i]);
        return value(out);
      });
  }
  if (obj.is_dict()) {
    const value self = obj;
    if (name == "items" || name == "keys" || name == "values")
      return make_fn(name, [self, name](const call_args&) -> result<value> {
        list_t l;
        for (const auto& [k, v] : self.as_dict()) {
          if (name == "items") l.emplace_back(list_t{value(k), v});
          else if (name == "keys") l.emplace_back(k);
          else l.push_back(v);
        }
        return value(std::move(l));
      });
    if (name == "get")
      return make_fn(name, [self](const call_args& a) -> result<value> {
        if (a.pos.empty() || !a.pos[0].is_string()) return value(none_t{});
        if (const value* v = self.find(a.pos[0].as_string())) return *v;
        return a.pos.size() > 1 ? a.pos[1] : value(none_t{});
      });
  }
  return value::undefined(name);
}

result<value> renderer::get_item(const value& obj, const value& key, int line) {
  if (obj.is_undefined()) return make_error("line {}: '{}' is undefined (indexing it)", line, obj.as_undefined().name);
  if (obj.is_dict() || obj.is_namespace()) {
    if (key.is_string()) {
      if (const value* v = obj.find(key.as_string())) return *v;
      return value::undefined(key.as_string());
    }
    return value::undefined(to_output(key));
  }
  if ((obj.is_list() || obj.is_string()) && key.is_int()) {
    if (obj.is_list()) {
      const auto& l = obj.as_list();
      int64_t i = key.as_int();
      if (i < 0) i += static_cast<int64_t>(l.size());
      if (i < 0 || i >= static_cast<int64_t>(l.size())) return value::undefined("[" + std::to_string(key.as_int()) + "]");
      return l[static_cast<size_t>(i)];
    }
    LP_TRY_ASSIGN(chars, iterate(obj));
    int64_t i = key.as_int();
    if (i < 0) i += static_cast<int64_t>(chars.size());
    if (i < 0 || i >= static_cast<int64_t>(chars.size())) return value::undefined("[" + std::to_string(key.as_int()) + "]");
    return chars[static_cast<size_t>(i)];
  }
  if (key.is_string()) return get_attr(obj, key.as_string(), line);
  return make_error("line {}: cannot index {} with {}", line, obj.type_name(), key.type_name());
}

result<value> renderer::eval(const expr& e) {
  switch (e.k) {
    case expr::kind::literal: return e.lit;
    case expr::kind::name: {
      if (value* v = lookup_mut(e.name)) return *v;
      return value::undefined(e.name);
    }
    case expr::kind::list:
    case expr::kind::tuple: {
      list_t l;
      for (const auto& x : e.args) {
        LP_TRY_ASSIGN(v, eval(*x));
        l.push_back(v);
      }
      return value(std::move(l));
    }
    case expr::kind::dict: {
      dict_t d;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        LP_TRY_ASSIGN(k, eval(*e.args[i]));
        LP_TRY_ASSIGN(v, eval(*e.args[i + 1]));
        d.emplace_back(to_output(k), v);
      }
      return value(std::move(d));
    }
    case expr::kind::attr: {
      LP_TRY_ASSIGN(obj, eval(*e.args[0]));
      return get_attr(obj, e.name, e.line);
    }
    case expr::kind::index: {
      LP_TRY_ASSIGN(obj, eval(*e.args[0]));
      LP_TRY_ASSIGN(key, eval(*e.args[1]));
      return get_item(obj, key, e.line);
    }
    case expr::kind::slice: {
      LP_TRY_ASSIGN(obj, eval(*e.args[0]));
      int64_t parts[3] = {0, 0, 1};
      bool given[3] = {false, false, false};
      for (int k = 0; k < 3; ++k)
        if (e.args[static_cast<size_t>(k + 1)]) {
          LP_TRY_ASSIGN(v, eval(*e.args[static_cast<size_t>(k + 1)]));
          if (v.is_none()) continue;
          if (!v.is_int()) return make_error("line {}: slice indices must be integers", e.line);
          parts[k] = v.as_int();
          given[k] = true;
        }
      std::vector<value> items;
      if (obj.is_list()) items = obj.as_list();
      else if (obj.is_string()) { LP_TRY_ASSIGN(c, iterate(obj)); items = c; }
      else return make_error("line {}: cannot slice {}", e.line, obj.type_name());
      const int64_t n = static_cast<int64_t>(items.size()), step = parts[2];
      if (step == 0) return make_error("line {}: slice step cannot be zero", e.line);
      auto norm = [&](int64_t i, bool is_given, int64_t def) {
        if (!is_given) return def;
        if (i < 0) i += n;
        return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
      };
      const int64_t start = norm(parts[0], given[0], step > 0 ? 0 : n - 1), stop = norm(parts[1], given[1], step > 0 ? n : -1);
      list_t out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(items[static_cast<size_t>(i)]);
      if (obj.is_string()) {
        std::string s;
        for (const auto& c : out) s += c.as_string();
        return value(s);
      }
      return value(std::move(out));
    }
    case expr::kind::call: {
      LP_TRY_ASSIGN(fn, eval(*e.args[0]));
      call_args a;
      for (size_t i = 1; i < e.args.size(); ++i) {
        LP_TRY_ASSIGN(v, eval(*e.args[i]));
        a.pos.push_back(v);
      }
      for (const auto& [k, x] : e.kwargs) {
        LP_TRY_ASSIGN(v, eval(*x));
        a.kw.emplace_back(k, v);
      }
      if (!fn.is_callable()) {
        if (fn.is_undefined()) return make_error("line {}: '{}' is undefined (called as a function)", e.line, fn.as_undefined().name);
        return make_error("line {}: '{}' object is not callable", e.line, fn.type_name());
      }
      auto r = fn.as_callable().fn(a);
      if (!r) return make_error("line {}: {}", e.line, r.message());
      return r;
    }
    case expr::kind::filter: {
      LP_TRY_ASSIGN(v, eval(*e.args[0]));
      call_args a;
      for (size_t i = 1; i < e.args.size(); ++i) {
        LP_TRY_ASSIGN(x, eval(*e.args[i]));
        a.pos.push_back(x);
      }
      for (const auto& [k, x] : e.kwargs) {
        LP_TRY_ASSIGN(xv, eval(*x));
        a.kw.emplace_back(k, xv);
      }
      return apply_filter(e.name, v, a, e.line);
    }
    case expr::kind::test: {
      LP_TRY_ASSIGN(v, eval(*e.args[0]));
      std::vector<value> args;
      for (size_t i = 1; i < e.args.size(); ++i) {
        LP_TRY_ASSIGN(x, eval(*e.args[i]));
        args.push_back(x);
      }
      LP_TRY_ASSIGN(r, apply_test(e.name, v, args, e.line));
      return value(e.negate ? !r : r);
    }
    case expr::kind::unary: {
      LP_TRY_ASSIGN(v, eval(*e.args[0]));
      if (!v.is_number()) return make_error("line {}: bad operand type for unary {}: '{}'", e.line, e.name, v.type_name());
      if (e.name == "+") return v;
      return v.is_int() ? value(-v.as_int()) : value(-v.as_number());
    }
    case expr::kind::binary: {
      LP_TRY_ASSIGN(a, eval(*e.args[0]));
      LP_TRY_ASSIGN(b, eval(*e.args[1]));
      LP_TRY_ASSIGN(r, binary_op(e.name, a, b, e.line));
      if (e.negate) return value(!r.truthy());
      return r;
    }
    case expr::kind::cond: {
      LP_TRY_ASSIGN(c, eval(*e.args[0]));
      if (c.truthy()) return eval(*e.args[1]);
      if (e.args[2]) return eval(*e.args[2]);
      return value::undefined("else");
    }
    case expr::kind::and_: {
      LP_TRY_ASSIGN(a, eval(*e.args[0]));
      if (!a.truthy()) return a;
      return eval(*e.args[1]);
    }
    case expr::kind::or_: {
      LP_TRY_ASSIGN(a, eval(*e.args[0]));
      if (a.truthy()) return a;
      return eval(*e.args[1]);
    }
    case expr::kind::not_: {
      LP_TRY_ASSIGN(a, eval(*e.args[0]));
      return value(!a.truthy());
    }
  }
  return make_error("line {}: bad expression", e.line);
}

result<bool> renderer::apply_test(const std::string& name, const value& v, const std::vector<value>& args, int line) {
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "mapping") return v.is_dict();
  if (name == "sequence") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "callable") return v.is_callable();
  if (name == "odd" || name == "even") {
    if (!v.is_int()) return make_error("line {}: test '{}' needs an integer", line, name);
    return (v.as_int() % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    if (!v.is_int() || args.empty() || !args[0].is_int() || args[0].as_int() == 0) return make_error("line {}: bad divisibleby", line);
    return v.as_int() % args[0].as_int() == 0;
  }
  static const std::vector<std::pair<const char*, const char*>> cmp = {
      {"equalto", "=="}, {"eq", "=="}, {"==", "=="}, {"sameas", "=="}, {"ne", "!="}, {"!=", "!="}, {"lt", "<"}, {"<", "<"},
      {"lessthan", "<"}, {"gt", ">"}, {">", ">"}, {"greaterthan", ">"}, {"le", "<="}, {"<=", "<="}, {"ge", ">="}, {">=", ">="}, {"in", "in"}};
  for (const auto& [n, op] : cmp)
    if (name == n) {
      if (args.empty()) return make_error("line {}: test '{}' needs an argument", line, name);
      LP_TRY_ASSIGN(r, binary_op(op, v, args[0], line));
      return r.truthy();
    }
  return make_error("line {}: unsupported Jinja test '{}'", line, name);
}

result<value> renderer::apply_filter(const std::string& name, const value& v, const call_args& a, int line) {
  auto arg = [&](size_t i, const char* kw) -> const value* {
    if (i < a.pos.size()) return &a.pos[i];
    return a.kwarg(kw);
  };
  if (name == "trim" || name == "strip") {
    if (!v.is_string()) return make_error("line {}: trim needs a string, got {}", line, v.type_name());
    return value(strip_chars(v.as_string(), arg(0, "chars"), true, true));
  }
  if (name == "length" || name == "count") {
    if (!(v.is_string() || v.is_list() || v.is_dict())) return make_error("line {}: object of type '{}' has no len()", line, v.type_name());
    return value(length_of(v));
  }
  if (name == "tojson") {
    const value* ind = arg(0, "indent");
    const value* sk = a.kwarg("sort_keys");
    auto j = to_json(v, ind != nullptr && ind->is_int() ? static_cast<int>(ind->as_int()) : -1, sk != nullptr && sk->truthy());
    if (!j) return make_error("line {}: {}", line, j.message());
    return value(*j);
  }
  if (name == "string") return value(to_output(v));
  if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") {
    if (name == "safe") return v;
    std::string out;
    for (char c : to_output(v)) {
      switch (c) {
        case '&': out += "&amp;"; break;
        case '<': out += "&lt;"; break;
        case '>': out += "&gt;"; break;
        case '"': out += "&#34;"; break;
        case '\'': out += "&#39;"; break;
        default: out += c;
      }
    }
    return value(out);
  }
  if (name == "upper" || name == "lower") {
    if (!v.is_string()) return make_error("line {}: {} needs a string", line, name);
    std::string s = v.as_string();
    if (name == "lower") s = lowercase_utf8(s);
    else for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return value(s);
  }
  if (name == "capitalize" || name == "title") {
    if (!v.is_string()) return make_error("line {}: {} needs a string", line, name);
    std::string s = v.as_string();
    bool start = true;
    for (size_t i = 0; i < s.size(); ++i) {
      auto& c = s[i];
      const bool alpha = std::isalpha(static_cast<unsigned char>(c));
      if (name == "capitalize") c = static_cast<char>(i == 0 ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
      else {
        c = static_cast<char>(start && alpha ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        start = !alpha;
      }
    }
    return value(s);
  }
  if (name == "default" || name == "d") {
    const value* b = arg(1, "boolean");
    const bool use_default = v.is_undefined() || (b != nullptr && b->truthy() && !v.truthy());
    if (!use_default) return v;
    const value* dv = arg(0, "default_value");
    return dv != nullptr ? *dv : value("");
  }
  if (name == "first" || name == "last") {
    LP_TRY_ASSIGN(items, iterate(v));
    if (items.empty()) return value::undefined(name);
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") { LP_TRY_ASSIGN(items, iterate(v)); return value(list_t(items.begin(), items.end())); }
  if (name == "reverse") {
    if (v.is_string()) { LP_TRY_ASSIGN(c, iterate(v)); std::string s; for (auto it = c.rbegin(); it != c.rend(); ++it) s += it->as_string(); return value(s); }
    LP_TRY_ASSIGN(items, iterate(v));
    std::reverse(items.begin(), items.end());
    return value(list_t(items.begin(), items.end()));
  }
  if (name == "items") {
    if (!v.is_dict()) return make_error("line {}: items needs a mapping", line);
    list_t l;
    for (const auto& [k, x] : v.as_dict()) l.emplace_back(list_t{value(k), x});
    return value(std::move(l));
  }
  if (name == "join") {
    LP_TRY_ASSIGN(items, iterate(v));
    const value* sep = arg(0, "d");
    const value* attr = a.kwarg("attribute");
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      value x = items[i];
      if (attr != nullptr && attr->is_string()) { LP_TRY_ASSIGN(y, get_attr(x, attr->as_string(), line)); x = y; }
      out += (i > 0 && sep != nullptr ? to_output(*sep) : "") + to_output(x);
    }
    return value(out);
  }
  if (name == "replace") {
    if (!v.is_string() || a.pos.size() < 2 || !a.pos[0].is_string()) return make_error("line {}: replace(old, new) needs strings", line);
    const std::string& from = a.pos[0].as_string();
    const std::string to = to_output(a.pos[1]);
    int64_t limit = a.pos.size() > 2 && a.pos[2].is_int() ? a.pos[2].as_int() : -1;
    std::string s = v.as_string(), out;
    if (from.empty()) return value(s);
    size_t pos = 0;
    for (size_t f; limit != 0 && (f = s.find(from, pos)) != std::string::npos; pos = f + from.size(), --limit) out += s.substr(pos, f - pos) + to;
    return value(out + s.substr(pos));
  }
  if (name == "int") {
    if (v.is_number()) return value(static_cast<int64_t>(v.as_number()));
    if (v.is_string()) { try { return value(static_cast<int64_t>(std::stoll(v.as_string()))); } catch (...) {} }
    const value* dv = arg(0, "default");
    return dv != nullptr ? *dv : value(int64_t{0});
  }
  if (name == "float") {
    if (v.is_number()) return value(v.as_number());
    if (v.is_string()) { try { return value(std::stod(v.as_string())); } catch (...) {} }
    return value(0.0);
  }
  if (name == "abs") { if (!v.is_number()) return make_error("line {}: abs needs a number", line); return v.is_int() ? value(static_cast<int64_t>(std::llabs(v.as_int()))) : value(std::fabs(v.as_number())); }
  if (name == "round") {
    const value* prec = arg(0, "precision");
    const double p = std::pow(10.0, prec != nullptr && prec->is_int() ? static_cast<double>(prec->as_int()) : 0.0);
    return value(std::nearbyint(v.as_number() * p) / p);
  }
  if (name == "unique") {
    LP_TRY_ASSIGN(items, iterate(v));
    list_t out;
    for (const auto& x : items)
      if (std::none_of(out.begin(), out.end(), [&](const value& y) { return values_equal(x, y); })) out.push_back(x);
    return value(std::move(out));
  }
  if (name == "map") {
    LP_TRY_ASSIGN(items, iterate(v));
    list_t out;
    const value* attr = a.kwarg("attribute");
    for (const auto& x : items) {
      if (attr != nullptr && attr->is_string()) { LP_TRY_ASSIGN(y, get_attr(x, attr->as_string(), line)); out.push_back(y); }
      else if (!a.pos.empty() && a.pos[0].is_string()) { LP_TRY_ASSIGN(y, apply_filter(a.pos[0].as_string(), x, {}, line)); out.push_back(y); }
      else return make_error("line {}: map needs attribute= or a filter name", line);
    }
    return value(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    LP_TRY_ASSIGN(items, iterate(v));
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep_if = name == "select" || name == "selectattr";
    size_t k = 0;
    std::string attr;
    if (by_attr) {
      if (a.pos.empty() || !a.pos[0].is_string()) return make_error("line {}: {} needs an attribute name", line, name);
      attr = a.pos[k++].as_string();
    }
    std::string test = k < a.pos.size() && a.pos[k].is_string() ? a.pos[k++].as_string() : std::string();
    std::vector<value> targs(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(k, a.pos.size())), a.pos.end());
    list_t out;
    for (const auto& x : items) {
      value subject = x;
      if (by_attr) { LP_TRY_ASSIGN(y, get_attr(x, attr, line)); subject = y; }
      bool ok = subject.truthy();
      if (!test.empty()) { LP_TRY_ASSIGN(r, apply_test(test, subject, targs, line)); ok = r; }
      if (ok == keep_if) out.push_back(x);
    }
    return value(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_dict()) return make_error("line {}: dictsort needs a mapping", line);
    dict_t d = v.as_dict();
    std::stable_sort(d.begin(), d.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    list_t out;
    for (const auto& [k, x] : d) out.emplace_back(list_t{value(k), x});
    return value(std::move(out));
  }
  if (name == "indent") {
    const value* w = arg(0, "width");
    const value* first = arg(1, "first");
    const std::string pad(w != nullptr && w->is_int() ? static_cast<size_t>(w->as_int()) : 4, ' ');
    const std::string s = to_output(v);
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
      out += s[i];
      if (s[i] == '\n' && i + 1 < s.size() && s[i + 1] != '\n') out += pad;
    }
    return value(first != nullptr && first->truthy() ? pad + out : out);
  }
  return make_error("line {}: unsupported Jinja filter '{}'", line, name);
}

}  // namespace

result<std::string> template_program::render(const dict_t& globals, std::vector<std::pair<size_t, size_t>>* generation_spans) const {
  renderer r(globals, generation_spans);
  std::string out;
  flow f = flow::normal;
  LP_TRY(r.render(*root_, out, f));
  return out;
}

}  // namespace lorapipe::jinja
