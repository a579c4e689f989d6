// Jinja lexer and parser: template source -> AST (jinja_ast.h), applying transformers' whitespace
// rules (trim_blocks, lstrip_blocks) and the "-" markers at parse time.
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "core/text/jinja_ast.h"

namespace lorapipe::jinja {
namespace {

// ---- template-level lexing: text and tags ----
struct raw_tag {
  enum class type { text, output, block, comment } t;
  std::string body;  // text, or the tag contents without delimiters and '-'/'+'
  int line;
};

result<std::vector<raw_tag>> split_template(const std::string& src) {
  std::vector<raw_tag> out;
  size_t pos = 0;
  int line = 1;
  bool strip_next = false, trim_next = false;  // from the previous tag: "-%}" / trim_blocks
  auto count_lines = [&](size_t a, size_t b) {
    for (size_t i = a; i < b && i < src.size(); ++i) line += src[i] == '\n';
  };
  for (;;) {
    // Where the data after the previous tag starts: "-" eats all whitespace, trim_blocks one newline.
    size_t data = pos;
    if (strip_next) {
      while (data < src.size() && std::isspace(static_cast<unsigned char>(src[data]))) ++data;
    } else if (trim_next) {
      if (src.compare(data, 1, "\n") == 0) data += 1;
      else if (src.compare(data, 2, "\r\n") == 0) data += 2;
    }
    count_lines(pos, data);
    size_t open = src.find('{', data);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open != std::string::npos && open + 1 >= src.size()) open = std::string::npos;
    std::string text = src.substr(data, open == std::string::npos ? std::string::npos : open - data);
    const int text_line = line;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({raw_tag::type::text, text, text_line});
      break;
    }
    count_lines(data, open);
    const char kind = src[open + 1];
    const char* close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t inner = open + 2;
    const bool minus_before = inner < src.size() && src[inner] == '-';
    const bool plus_before = inner < src.size() && src[inner] == '+';
    if (minus_before || plus_before) ++inner;
    size_t end = src.find(close, inner);
    if (end == std::string::npos) return make_error("line {}: unclosed '{{{}' tag", line, kind);
    const bool minus_after = end > inner && src[end - 1] == '-';
    std::string body = src.substr(inner, end - inner - (minus_after ? 1 : 0));
    if (minus_before) {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    } else if (kind != '{' && !plus_before) {  // lstrip_blocks
      const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
      const bool line_starting = data == 0 || src[data - 1] == '\n';
      bool blank = true;
      for (size_t k = l_pos; k < text.size(); ++k) blank = blank && std::isspace(static_cast<unsigned char>(text[k]));
      if ((l_pos > 0 || line_starting) && blank) text.erase(l_pos);
    }
    if (!text.empty()) out.push_back({raw_tag::type::text, text, text_line});
    count_lines(open, end + 2);
    strip_next = minus_after;
    trim_next = kind != '{';  // trim_blocks: block and comment tags eat the following newline
    if (kind == '#') out.push_back({raw_tag::type::comment, {}, line});
    else out.push_back({kind == '{' ? raw_tag::type::output : raw_tag::type::block, body, line});
    pos = end + 2;
  }
  return out;
}

// ---- expression lexing ----
struct tok {
  enum class t { name, number, string, op, end } type;
  std::string s;
  value num;
};

result<std::vector<tok>> lex_expr(const std::string& s, int line) {
  std::vector<tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) { ++i; continue; }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({tok::t::name, s.substr(i, j - i), {}});
      i = j;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_' ||
                              (s[j] == '.' && !is_float && j + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[j + 1]))))) {
        if (s[j] == '.') is_float = true;
        ++j;
      }
      std::string digits;
      for (size_t k = i; k < j; ++k)
        if (s[k] != '_') digits += s[k];
      errno = 0;
      char* endp = nullptr;
      value num = is_float ? value(std::strtod(digits.c_str(), &endp)) : value(static_cast<int64_t>(std::strtoll(digits.c_str(), &endp, 10)));
      if (errno == ERANGE) return make_error("line {}: number literal {} is out of range", line, digits);
      out.push_back({tok::t::number, digits, num});
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            default: v += '\\'; v += e; break;
          }
        } else v += s[j];
      }
      if (j >= s.size()) return make_error("line {}: unterminated string literal", line);
      out.push_back({tok::t::string, v, {}});
      i = j + 1;
      continue;
    }
    static const char* ops[] = {"==", "!=", "<=", ">=", "//", "**", "<", ">", "+", "-", "*", "/", "%", "~", "|", ".", ",", ":", "(", ")", "[", "]", "{", "}", "="};
    bool found = false;
    for (const char* op : ops) {
      const size_t n = std::char_traits<char>::length(op);
      if (s.compare(i, n, op) == 0) {
        out.push_back({tok::t::op, op, {}});
        i += n;
        found = true;
        break;
      }
    }
    if (!found) return make_error("line {}: unexpected character '{}' in expression", line, c);
  }
  out.push_back({tok::t::end, "", {}});
  return out;
}

// ---- expression parsing (Jinja precedence) ----
class expr_parser {
 public:
  expr_parser(std::vector<tok> t, int line) : t_(std::move(t)), line_(line) {}
  bool at_end() const { return t_[i_].type == tok::t::end; }
  bool is_op(const char* s) const { return t_[i_].type == tok::t::op && t_[i_].s == s; }
  bool is_name(const char* s) const { return t_[i_].type == tok::t::name && t_[i_].s == s; }
  const tok& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  tok next() { return t_[i_ < t_.size() - 1 ? i_++ : i_]; }
  status expect_op(const char* s) {
    if (!is_op(s)) return make_error("line {}: expected '{}' but found '{}'", line_, s, peek().s);
    ++i_;
    return ok_status();
  }
  result<std::string> expect_name() {
    if (peek().type != tok::t::name) return make_error("line {}: expected a name but found '{}'", line_, peek().s);
    return next().s;
  }

  result<expr_ptr> parse_expression(bool allow_cond = true) {
    if (++depth_ > max_depth) return make_error("line {}: expression nested too deeply", line_);
    struct leave {
      int& d;
      ~leave() { --d; }
    } guard{depth_};
    LP_TRY_ASSIGN(e, parse_or());
    if (allow_cond && is_name("if")) {
      ++i_;
      LP_TRY_ASSIGN(cond, parse_or());
      expr_ptr otherwise;
      if (is_name("else")) {
        ++i_;
        LP_TRY_ASSIGN(o, parse_expression());
        otherwise = o;
      }
      return make(expr::kind::cond, "", {cond, e, otherwise});
    }
    return e;
  }
  // Expression or an unparenthesised tuple ("a, b").
  result<expr_ptr> parse_tuple_or_expression() {
    LP_TRY_ASSIGN(e, parse_expression());
    if (!is_op(",")) return e;
    std::vector<expr_ptr> items{e};
    while (is_op(",")) {
      ++i_;
      if (at_end()) break;
      LP_TRY_ASSIGN(x, parse_expression());
      items.push_back(x);
    }
    return make(expr::kind::tuple, "", items);
  }

 private:
  expr_ptr make(expr::kind k, std::string name, std::vector<expr_ptr> args) {
    auto e = std::make_shared<expr>();
    e->k = k;
    e->name = std::move(name);
    e->args = std::move(args);
    e->line = line_;
    return e;
  }
  result<expr_ptr> parse_or() {
    LP_TRY_ASSIGN(l, parse_and());
    while (is_name("or")) {
      ++i_;
      LP_TRY_ASSIGN(r, parse_and());
      l = make(expr::kind::or_, "or", {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_and() {
    LP_TRY_ASSIGN(l, parse_not());
    while (is_name("and")) {
      ++i_;
      LP_TRY_ASSIGN(r, parse_not());
      l = make(expr::kind::and_, "and", {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_not() {
    if (is_name("not")) {
      if (++unary_depth_ > max_depth) return make_error("line {}: expression nested too deeply", line_);
      struct leave {
        int& d;
        ~leave() { --d; }
      } guard{unary_depth_};
      ++i_;
      LP_TRY_ASSIGN(e, parse_not());
      return make(expr::kind::not_, "not", {e});
    }
    return parse_compare();
  }
  result<expr_ptr> parse_compare() {
    LP_TRY_ASSIGN(l, parse_math1());
    for (;;) {
      std::string op;
      bool negate = false;
      if (peek().type == tok::t::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" || peek().s == "<=" || peek().s == ">=")) op = next().s;
      else if (is_name("in")) { ++i_; op = "in"; }
      else if (is_name("not") && peek(1).type == tok::t::name && peek(1).s == "in") { i_ += 2; op = "in"; negate = true; }
      else break;
      LP_TRY_ASSIGN(r, parse_math1());
      auto e = std::make_shared<expr>();
      e->k = expr::kind::binary;
      e->name = op;
      e->args = {l, r};
      e->negate = negate;
      e->line = line_;
      l = e;
    }
    return l;
  }
  result<expr_ptr> parse_math1() {
    LP_TRY_ASSIGN(l, parse_concat());
    while (is_op("+") || is_op("-")) {
      const std::string op = next().s;
      LP_TRY_ASSIGN(r, parse_concat());
      l = make(expr::kind::binary, op, {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_concat() {
    LP_TRY_ASSIGN(l, parse_math2());
    while (is_op("~")) {
      ++i_;
      LP_TRY_ASSIGN(r, parse_math2());
      l = make(expr::kind::binary, "~", {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_math2() {
    LP_TRY_ASSIGN(l, parse_pow());
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = next().s;
      LP_TRY_ASSIGN(r, parse_pow());
      l = make(expr::kind::binary, op, {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_pow() {
    LP_TRY_ASSIGN(l, parse_unary());
    while (is_op("**")) {
      ++i_;
      LP_TRY_ASSIGN(r, parse_unary());
      l = make(expr::kind::binary, "**", {l, r});
    }
    return l;
  }
  result<expr_ptr> parse_unary() {
    if (++unary_depth_ > max_depth) return make_error("line {}: expression nested too deeply", line_);
    struct leave {
      int& d;
      ~leave() { --d; }
    } guard{unary_depth_};
    if (is_op("-") || is_op("+")) {
      const std::string op = next().s;
      LP_TRY_ASSIGN(e, parse_unary());
      return make(expr::kind::unary, op, {e});
    }
    LP_TRY_ASSIGN(p, parse_primary());
    LP_TRY_ASSIGN(q, parse_postfix(p));
    return parse_filters_and_tests(q);
  }
  result<expr_ptr> parse_primary() {
    const tok t = next();
    if (t.type == tok::t::number) {
      auto e = make(expr::kind::literal, "", {});
      std::const_pointer_cast<expr>(e)->lit = t.num;
      return e;
    }
    if (t.type == tok::t::string) {
      std::string s = t.s;
      while (peek().type == tok::t::string) s += next().s;  // adjacent literals concatenate
      auto e = std::make_shared<expr>();
      e->k = expr::kind::literal;
      e->lit = value(s);
      return expr_ptr(e);
    }
    if (t.type == tok::t::name) {
      auto e = std::make_shared<expr>();
      e->line = line_;
      if (t.s == "true" || t.s == "True") { e->lit = value(true); return expr_ptr(e); }
      if (t.s == "false" || t.s == "False") { e->lit = value(false); return expr_ptr(e); }
      if (t.s == "none" || t.s == "None") { e->lit = value(none_t{}); return expr_ptr(e); }
      e->k = expr::kind::name;
      e->name = t.s;
      return expr_ptr(e);
    }
    if (t.type == tok::t::op && t.s == "(") {
      if (is_op(")")) { ++i_; return make(expr::kind::tuple, "", {}); }
      LP_TRY_ASSIGN(e, parse_expression());
      if (is_op(",")) {
        std::vector<expr_ptr> items{e};
        while (is_op(",")) {
          ++i_;
          if (is_op(")")) break;
          LP_TRY_ASSIGN(x, parse_expression());
          items.push_back(x);
        }
        LP_TRY(expect_op(")"));
        return make(expr::kind::tuple, "", items);
      }
      LP_TRY(expect_op(")"));
      return e;
    }
    if (t.type == tok::t::op && t.s == "[") {
      std::vector<expr_ptr> items;
      while (!is_op("]")) {
        LP_TRY_ASSIGN(x, parse_expression());
        items.push_back(x);
        if (!is_op(",")) break;
        ++i_;
      }
      LP_TRY(expect_op("]"));
      return make(expr::kind::list, "", items);
    }
    if (t.type == tok::t::op && t.s == "{") {
      std::vector<expr_ptr> items;
      while (!is_op("}")) {
        LP_TRY_ASSIGN(k, parse_expression());
        LP_TRY(expect_op(":"));
        LP_TRY_ASSIGN(v, parse_expression());
        items.push_back(k);
        items.push_back(v);
        if (!is_op(",")) break;
        ++i_;
      }
      LP_TRY(expect_op("}"));
      return make(expr::kind::dict, "", items);
    }
    return make_error("line {}: unexpected '{}' in expression", line_, t.s.empty() ? "end of tag" : t.s);
  }
  result<std::pair<std::vector<expr_ptr>, std::vector<std::pair<std::string, expr_ptr>>>> parse_call_args() {
    std::vector<expr_ptr> pos;
    std::vector<std::pair<std::string, expr_ptr>> kw;
    while (!is_op(")")) {
      if (peek().type == tok::t::name && peek(1).type == tok::t::op && peek(1).s == "=") {
        std::string k = next().s;
        ++i_;
        LP_TRY_ASSIGN(v, parse_expression());
        kw.emplace_back(k, v);
      } else {
        LP_TRY_ASSIGN(v, parse_expression());
        pos.push_back(v);
      }
      if (!is_op(",")) break;
      ++i_;
    }
    LP_TRY(expect_op(")"));
    return std::make_pair(pos, kw);
  }
  result<expr_ptr> parse_postfix(expr_ptr e) {
    for (;;) {
      if (is_op(".")) {
        ++i_;
        LP_TRY_ASSIGN(n, expect_name());
        e = make(expr::kind::attr, n, {e});
      } else if (is_op("[")) {
        ++i_;
        expr_ptr a, b, c;
        bool slice = false;
        if (!is_op(":")) { LP_TRY_ASSIGN(x, parse_expression()); a = x; }
        if (is_op(":")) {
          slice = true;
          ++i_;
          if (!is_op(":") && !is_op("]")) { LP_TRY_ASSIGN(x, parse_expression()); b = x; }
          if (is_op(":")) {
            ++i_;
            if (!is_op("]")) { LP_TRY_ASSIGN(x, parse_expression()); c = x; }
          }
        }
        LP_TRY(expect_op("]"));
        e = slice ? make(expr::kind::slice, "", {e, a, b, c}) : make(expr::kind::index, "", {e, a});
      } else if (is_op("(")) {
        ++i_;
        LP_TRY_ASSIGN(args, parse_call_args());
        auto c = std::make_shared<expr>();
        c->k = expr::kind::call;
        c->args = {e};
        c->args.insert(c->args.end(), args.first.begin(), args.first.end());
        c->kwargs = args.second;
        c->line = line_;
        e = c;
      } else return e;
    }
  }
  result<expr_ptr> parse_filters_and_tests(expr_ptr e) {
    for (;;) {
      if (is_op("|")) {
        ++i_;
        LP_TRY_ASSIGN(n, expect_name());
        auto f = std::make_shared<expr>();
        f->k = expr::kind::filter;
        f->name = n;
        f->args = {e};
        f->line = line_;
        if (is_op("(")) {
          ++i_;
          LP_TRY_ASSIGN(args, parse_call_args());
          f->args.insert(f->args.end(), args.first.begin(), args.first.end());
          f->kwargs = args.second;
        }
        LP_TRY_ASSIGN(q, parse_postfix(f));
        e = q;
      } else if (is_name("is")) {
        ++i_;
        auto t = std::make_shared<expr>();
        t->k = expr::kind::test;
        t->line = line_;
        if (is_name("not")) { ++i_; t->negate = true; }
        if (peek().type == tok::t::name) t->name = next().s;
        else if (peek().type == tok::t::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" ||
                                              peek().s == "<=" || peek().s == ">=")) t->name = next().s;
        else return make_error("line {}: expected a test name after 'is'", line_);
        t->args = {e};
        if (is_op("(")) {
          ++i_;
          LP_TRY_ASSIGN(args, parse_call_args());
          t->args.insert(t->args.end(), args.first.begin(), args.first.end());
        } else if (peek().type == tok::t::string || peek().type == tok::t::number ||
                   (peek().type == tok::t::name && !is_name("and") && !is_name("or") && !is_name("else") && !is_name("if") &&
                    !is_name("in") && !is_name("not"))) {
          LP_TRY_ASSIGN(arg, parse_primary());
          t->args.push_back(arg);
        }
        e = t;
      } else return e;
    }
  }

  static constexpr int max_depth = 200;
  std::vector<tok> t_;
  size_t i_ = 0;
  int line_;
  int depth_ = 0, unary_depth_ = 0;
};

// ---- statement parsing ----
class parser {
 public:
  explicit parser(std::vector<raw_tag> tags) : tags_(std::move(tags)) {}

  // Parses nodes until one of `stops` (block keywords) is reached; returns the stopping keyword.
  result<std::string> parse_body(std::vector<std::shared_ptr<const node>>& out, const std::vector<std::string>& stops) {
    if (++depth_ > 200) return make_error("blocks nested too deeply");
    struct leave {
      int& d;
      ~leave() { --d; }
    } guard{depth_};
    while (i_ < tags_.size()) {
      const raw_tag& t = tags_[i_];
      if (t.t == raw_tag::type::comment) { ++i_; continue; }
      if (t.t == raw_tag::type::text) {
        auto n = std::make_shared<node>();
        n->k = node::kind::text;
        n->text = t.body;
        out.push_back(n);
        ++i_;
        continue;
      }
      LP_TRY_ASSIGN(toks, lex_expr(t.body, t.line));
      expr_parser p(std::move(toks), t.line);
      if (t.t == raw_tag::type::output) {
        LP_TRY_ASSIGN(e, p.parse_tuple_or_expression());
        if (!p.at_end()) return make_error("line {}: unexpected '{}' in {{{{ }}}}", t.line, p.peek().s);
        auto n = std::make_shared<node>();
        n->k = node::kind::output;
        n->exprs = {e};
        n->line = t.line;
        out.push_back(n);
        ++i_;
        continue;
      }
      if (p.peek().type != tok::t::name) return make_error("line {}: empty or malformed block tag", t.line);
      const std::string kw = p.peek().s;
      for (const auto& s : stops)
        if (kw == s) return kw;
      p.next();
      ++i_;
      auto n = std::make_shared<node>();
      n->line = t.line;
      if (kw == "if") {
        n->k = node::kind::if_;
        LP_TRY_ASSIGN(cond, p.parse_expression());
        LP_TRY(expect_end(p, t));
        n->exprs.push_back(cond);
        for (;;) {
          auto body = std::make_shared<node>();
          LP_TRY_ASSIGN(stop, parse_body(body->body, {"elif", "else", "endif"}));
          n->body.push_back(body);
          LP_TRY(require(stop, "endif", t));
          const raw_tag& st = tags_[i_++];
          LP_TRY_ASSIGN(st_toks, lex_expr(st.body, st.line));
          expr_parser sp(std::move(st_toks), st.line);
          sp.next();
          if (stop == "elif") {
            LP_TRY_ASSIGN(c, sp.parse_expression());
            LP_TRY(expect_end(sp, st));
            n->exprs.push_back(c);
          } else if (stop == "else") {
            LP_TRY(expect_end(sp, st));
            n->has_else = true;
            auto eb = std::make_shared<node>();
            LP_TRY_ASSIGN(stop2, parse_body(eb->body, {"endif"}));
            LP_TRY(require(stop2, "endif", t));
            ++i_;
            n->body.push_back(eb);
            break;
          } else {
            LP_TRY(expect_end(sp, st));
            break;
          }
        }
      } else if (kw == "for") {
        n->k = node::kind::for_;
        for (;;) {
          LP_TRY_ASSIGN(name, p.expect_name());
          n->targets.push_back(name);
          if (!p.is_op(",")) break;
          p.next();
        }
        if (!p.is_name("in")) return make_error("line {}: expected 'in' in for loop", t.line);
        p.next();
        LP_TRY_ASSIGN(iter, p.parse_expression(false));
        n->exprs.push_back(iter);
        if (p.is_name("if")) {
          p.next();
          LP_TRY_ASSIGN(f, p.parse_expression(false));
          n->exprs.push_back(f);
        }
        if (p.is_name("recursive")) return make_error("line {}: unsupported Jinja construct 'recursive' loops", t.line);
        LP_TRY(expect_end(p, t));
        auto body = std::make_shared<node>();
        LP_TRY_ASSIGN(stop, parse_body(body->body, {"else", "endfor"}));
        LP_TRY(require(stop, "endfor", t));
        ++i_;
        n->body.push_back(body);
        if (stop == "else") {
          n->has_else = true;
          auto eb = std::make_shared<node>();
          LP_TRY_ASSIGN(stop2, parse_body(eb->body, {"endfor"}));
          LP_TRY(require(stop2, "endfor", t));
          ++i_;
          n->body.push_back(eb);
        }
      } else if (kw == "set") {
        LP_TRY_ASSIGN(name, p.expect_name());
        n->targets.push_back(name);
        if (p.is_op(".")) {
          p.next();
          LP_TRY_ASSIGN(attr, p.expect_name());
          n->text = attr;
        }
        if (p.is_op("=")) {
          p.next();
          n->k = node::kind::set;
          LP_TRY_ASSIGN(v, p.parse_tuple_or_expression());
          n->exprs.push_back(v);
          LP_TRY(expect_end(p, t));
        } else {
          LP_TRY(expect_end(p, t));
          n->k = node::kind::set_block;
          auto body = std::make_shared<node>();
          LP_TRY_ASSIGN(stop, parse_body(body->body, {"endset"}));
          LP_TRY(require(stop, "endset", t));
          ++i_;
          n->body.push_back(body);
        }
      } else if (kw == "macro") {
        n->k = node::kind::macro;
        LP_TRY_ASSIGN(name, p.expect_name());
        n->text = name;
        LP_TRY(p.expect_op("("));
        while (!p.is_op(")")) {
          LP_TRY_ASSIGN(param, p.expect_name());
          n->targets.push_back(param);
          expr_ptr def;
          if (p.is_op("=")) {
            p.next();
            LP_TRY_ASSIGN(d, p.parse_expression());
            def = d;
          }
          n->exprs.push_back(def);
          if (!p.is_op(",")) break;
          p.next();
        }
        LP_TRY(p.expect_op(")"));
        LP_TRY(expect_end(p, t));
        auto body = std::make_shared<node>();
        LP_TRY_ASSIGN(stop, parse_body(body->body, {"endmacro"}));
        LP_TRY(require(stop, "endmacro", t));
        ++i_;
        n->body.push_back(body);
      } else if (kw == "generation") {
        n->k = node::kind::generation;
        LP_TRY(expect_end(p, t));
        auto body = std::make_shared<node>();
        LP_TRY_ASSIGN(stop, parse_body(body->body, {"endgeneration"}));
        LP_TRY(require(stop, "endgeneration", t));
        ++i_;
        n->body.push_back(body);
      } else if (kw == "break" || kw == "continue") {
        n->k = kw == "break" ? node::kind::break_ : node::kind::continue_;
        LP_TRY(expect_end(p, t));
      } else {
        return make_error("line {}: unsupported Jinja construct '{{% {} %}}'", t.line, kw);
      }
      out.push_back(n);
    }
    if (!stops.empty()) return make_error("end of template: missing '{{% {} %}}'", stops.back());
    return std::string();
  }

 private:
  static status expect_end(const expr_parser& p, const raw_tag& t) {
    if (!p.at_end()) return make_error("line {}: unexpected '{}' in '{{% {} %}}'", t.line, p.peek().s, t.body);
    return ok_status();
  }
  status require(const std::string& stop, const char* want, const raw_tag& opener) {
    if (stop.empty()) return make_error("line {}: block is never closed (missing '{{% {} %}}')", opener.line, want);
    return ok_status();
  }
  std::vector<raw_tag> tags_;
  size_t i_ = 0;
  int depth_ = 0;
};

}  // namespace

result<template_program> template_program::parse(const std::string& source) {
  LP_TRY_ASSIGN(tags, split_template(source));
  parser p(std::move(tags));
  auto root = std::make_shared<node>();
  LP_TRY_ASSIGN(stop, p.parse_body(root->body, {}));
  if (!stop.empty()) return make_error("unexpected '{{% {} %}}' outside any block", stop);
  template_program t;
  t.root_ = root;
  return t;
}

}  // namespace lorapipe::jinja
