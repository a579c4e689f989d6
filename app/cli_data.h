// lorapipe-cli data inspect (see cli_data.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "core/base/result.h"

namespace lorapipe {
// The report as text (trained tokens marked with [[ ]], or green when `color`), or JSON.
result<std::string> data_inspect_report(const std::string& project_path, int64_t examples, bool as_json, bool color);
}  // namespace lorapipe
