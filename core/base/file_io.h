// Files: a read-only memory map of a whole file (RAII), whole-file reads, and atomic whole-file
// writes (temp file in the same folder, fsync, rename, fsync of the folder). Errors are values.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

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

// The same, written piece by piece (a file larger than memory): the bytes go to a temporary file in
// the target's folder, which commit() makes the file; destroyed uncommitted (an error on the way),
// the temporary is removed and the target is untouched.
class atomic_file_writer {
 public:
  static result<atomic_file_writer> open(const std::filesystem::path& path);
  atomic_file_writer(atomic_file_writer&& o) noexcept;
  atomic_file_writer& operator=(atomic_file_writer&&) = delete;
  atomic_file_writer(const atomic_file_writer&) = delete;
  ~atomic_file_writer();
  status write(const void* data, size_t n);
  status commit();  // fsync, rename over the target, fsync the folder

 private:
  atomic_file_writer(std::filesystem::path path, std::string temp, int fd) : path_(std::move(path)), temp_(std::move(temp)), fd_(fd) {}
  status fail(const char* what);  // closes and removes the temporary
  std::filesystem::path path_;
  std::string temp_;
  int fd_ = -1;
};
result<std::string> read_text_file(const std::filesystem::path& path);

}  // namespace lorapipe
