// Files: a read-only memory map of a whole file (RAII), whole-file reads, and atomic whole-file
// writes (temp file in the same folder, fsync, rename, fsync of the folder). Errors are values.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

#include "core/base/result.h"

namespace lorapipe {

// Read-only memory map of a whole file (RAII).
class mapped_file {
 public:
  static result<std::shared_ptr<mapped_file>> open(const std::filesystem::path& path);
  ~mapped_file();
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  mapped_file(const std::byte* d, size_t n) : data_(d), size_(n) {}
  const std::byte* data_;
  size_t size_;
};

// Atomic whole-file write of text/bytes (temp file, fsync, rename, fsync dir).
status write_file_atomic(const std::filesystem::path& path, const std::string& bytes);
result<std::string> read_text_file(const std::filesystem::path& path);

}  // namespace lorapipe
