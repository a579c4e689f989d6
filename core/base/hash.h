// SHA-256 as lowercase hex, of a buffer or of a whole file (read in 1 MiB chunks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "core/base/result.h"

namespace lorapipe {

std::string sha256_hex(const void* data, size_t n);
result<std::string> sha256_file(const std::filesystem::path& path, int64_t* bytes = nullptr);

}  // namespace lorapipe
