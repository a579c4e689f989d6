// Internal: the Jinja template AST shared by the parser (jinja_parse.cpp) and the renderer
// (jinja_eval.cpp). Not part of the public interface (see jinja.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/text/jinja.h"

namespace lorapipe::jinja {

struct expr;
using expr_ptr = std::shared_ptr<const expr>;

struct expr {
  enum class kind { literal, name, list, tuple, dict, attr, index, slice, call, filter, test, unary, binary, cond, and_, or_, not_ };
  kind k = kind::literal;
  value lit;                     // literal
  std::string name;              // name, attr, filter, test, unary/binary operator
  std::vector<expr_ptr> args;    // operands / call args / list items / dict k,v pairs / slice a,b,c (null = absent)
  std::vector<std::pair<std::string, expr_ptr>> kwargs;
  bool negate = false;           // "is not", "not in"
  int line = 0;
};

struct node {
  enum class kind { sequence, text, output, if_, for_, set, set_block, macro, break_, continue_, generation };
  kind k = kind::sequence;
  std::string text;                       // text; set/macro name; ns attribute after '.'
  std::vector<std::string> targets;       // for-loop names, set target (name[, attr]), macro params
  std::vector<expr_ptr> exprs;            // output; if conditions; for iterable(, filter); set value; macro defaults
  std::vector<std::shared_ptr<const node>> body;  // children: sequence; if branches (one per condition, + else); for body, else
  bool has_else = false;
  int line = 0;
};

// Python semantics used by the renderer (jinja_value.cpp).
bool values_equal(const value& a, const value& b);
result<int> compare(const value& a, const value& b);
result<std::vector<value>> iterate(const value& v);  // list items, dict keys, string characters
int64_t length_of(const value& v);
// Binary operators: == != < > <= >= in ~ + - * / // % ** ("line" for error messages).
result<value> binary_op(const std::string& op, const value& a, const value& b, int line);

}  // namespace lorapipe::jinja
