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

status write_file_atomic(const fs::path& path, const std::string& bytes) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::string tmpl = (dir / ("." + path.filename().string() + ".tmpXXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) return make_error("{}: cannot create a temporary file in {}: {}", path.string(), dir.string(), errno_text());
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0) {
      if (errno == EINTR) continue;
      auto e = errno_text();
      ::close(fd);
      ::unlink(name.data());
      return make_error("{}: write failed: {}", path.string(), e);
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    auto e = errno_text();
    ::unlink(name.data());
    return make_error("{}: fsync/close failed: {}", path.string(), e);
  }
  ::chmod(name.data(), 0644);
  if (::rename(name.data(), path.c_str()) != 0) {
    auto e = errno_text();
    ::unlink(name.data());
    return make_error("{}: rename failed: {}", path.string(), e);
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return ok_status();
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
