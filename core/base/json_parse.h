// JSON parsing that never throws: a discarded value on any malformed input. nlohmann's
// parse(..., allow_exceptions=false) still throws for out-of-range numbers (e.g. 1e999999), which the
// fuzzer found; every parser of user files goes through this instead.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

namespace lorapipe {

template <class J = nlohmann::json>
J parse_json_or_discarded(std::string_view text) {
  try {
    return J::parse(text, nullptr, false);
  } catch (const typename J::exception&) {
    return J(J::value_t::discarded);
  }
}

}  // namespace lorapipe
