// Files: read-only memory maps, whole-file reads and atomic (crash-safe) writes. See file_io.h.
#include "core/base/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

namespace lorapipe {
namespace fs = std::filesystem;

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

result<std::shared_ptr<mapped_file>> mapped_file::open(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error("{}: cannot open: {}", path.string(), errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    auto e = errno_text();
    ::close(fd);
    return make_error("{}: cannot stat: {}", path.string(), e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return make_error("{}: not a regular file", path.string());
  }
  size_t n = static_cast<size_t>(st.st_size);
  const std::byte* p = nullptr;
  if (n > 0) {
    void* m = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      auto e = errno_text();
      ::close(fd);
      return make_error("{}: mmap failed: {}", path.string(), e);
    }
    p = static_cast<const std::byte*>(m);
  }
  ::close(fd);
  return std::shared_ptr<mapped_file>(new mapped_file(p, n));
}

mapped_file::~mapped_file() {
  if (data_ != nullptr && size_ > 0) ::munmap(const_cast<std::byte*>(data_), size_);
}

result<atomic_file_writer> atomic_file_writer::open(const fs::path& path) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::string tmpl = (dir / ("." + path.filename().string() + ".tmpXXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkostemp(name.data(), O_CLOEXEC);  // not inherited by a program another thread starts
  if (fd < 0) return make_error("{}: cannot create a temporary file in {}: {}", path.string(), dir.string(), errno_text());
  return atomic_file_writer(path, std::string(name.data()), fd);
}

atomic_file_writer::atomic_file_writer(atomic_file_writer&& o) noexcept
    : path_(std::move(o.path_)), temp_(std::move(o.temp_)), fd_(std::exchange(o.fd_, -1)) {}

atomic_file_writer::~atomic_file_writer() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(temp_.c_str());
  }
}

status atomic_file_writer::fail(const char* what) {
  auto e = errno_text();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
  return make_error("{}: {} failed: {}", path_.string(), what, e);
}

status atomic_file_writer::write(const void* data, size_t n) {
  if (fd_ < 0) return make_error("{}: write after the file was closed", path_.string());
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return fail("write");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return ok_status();
}

status atomic_file_writer::commit() {
  if (fd_ < 0) return make_error("{}: commit after the file was closed", path_.string());
  if (::fsync(fd_) != 0) return fail("fsync");
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    auto e = errno_text();
    ::unlink(temp_.c_str());
    return make_error("{}: close failed: {}", path_.string(), e);
  }
  ::chmod(temp_.c_str(), 0644);
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    auto e = errno_text();
    ::unlink(temp_.c_str());
    return make_error("{}: rename failed: {}", path_.string(), e);
  }
  const fs::path dir = path_.parent_path().empty() ? fs::path(".") : path_.parent_path();
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return ok_status();
}

status write_file_atomic(const fs::path& path, const std::string& bytes) {
  LP_TRY_ASSIGN(f, atomic_file_writer::open(path));
  LP_TRY(f.write(bytes.data(), bytes.size()));
  return f.commit();
}

result<std::string> read_text_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return make_error("{}: file not found", path.string());
  if (fs::is_directory(path, ec)) return make_error("{}: is a directory, expected a file", path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open: {}", path.string(), errno_text());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return make_error("{}: read error", path.string());
  return ss.str();
}

}  // namespace lorapipe
