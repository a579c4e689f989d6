// SHA-256 of bytes and files (OpenSSL EVP). See hash.h.
#include "core/base/hash.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include <openssl/evp.h>

namespace lorapipe {
namespace fs = std::filesystem;

namespace {
struct md_ctx_deleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using md_ctx = std::unique_ptr<EVP_MD_CTX, md_ctx_deleter>;

std::string to_hex(const unsigned char* d, unsigned n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < n; ++i) {
    s.push_back(digits[d[i] >> 4]);
    s.push_back(digits[d[i] & 15]);
  }
  return s;
}
}  // namespace

std::string sha256_hex(const void* data, size_t n) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  EVP_Digest(data, n, out, &len, EVP_sha256(), nullptr);
  return to_hex(out, len);
}
result<std::string> sha256_file(const fs::path& path, int64_t* bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open: {}", path.string(), std::strerror(errno));
  md_ctx ctx(EVP_MD_CTX_new());
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  std::vector<char> buf(1 << 20);
  int64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = in.gcount();
    if (got > 0) EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(got));
    total += got;
  }
  if (in.bad()) return make_error("{}: read error", path.string());
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  EVP_DigestFinal_ex(ctx.get(), out, &len);
  if (bytes != nullptr) *bytes = total;
  return to_hex(out, len);
}

}  // namespace lorapipe
