// Safetensors reader/writer: see safetensors.h.
#include "core/base/safetensors.h"

#include "core/base/file_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/base/json_parse.h"

namespace lorapipe {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
struct dtype_row {
  st_dtype t;
  const char* name;
  size_t size;
};
constexpr dtype_row dtype_table[] = {
    {st_dtype::f64, "F64", 8},  {st_dtype::f32, "F32", 4}, {st_dtype::f16, "F16", 2}, {st_dtype::bf16, "BF16", 2},
    {st_dtype::i64, "I64", 8},  {st_dtype::i32, "I32", 4}, {st_dtype::i16, "I16", 2}, {st_dtype::i8, "I8", 1},
    {st_dtype::u8, "U8", 1},    {st_dtype::boolean, "BOOL", 1},
};

}  // namespace

const char* st_dtype_name(st_dtype t) {
  for (const auto& r : dtype_table)
    if (r.t == t) return r.name;
  return "?";
}
size_t st_dtype_size(st_dtype t) {
  for (const auto& r : dtype_table)
    if (r.t == t) return r.size;
  return 0;
}
result<st_dtype> st_dtype_from_name(const std::string& name) {
  for (const auto& r : dtype_table)
    if (name == r.name) return r.t;
  return make_error("unsupported dtype '{}'", name);
}

int64_t st_tensor_info::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}


result<safetensors_file> safetensors_file::open(const fs::path& path) {
  LP_TRY_ASSIGN(m, mapped_file::open(path));
  std::shared_ptr<const std::byte> keep(m, m->data());
  return parse(keep, m->data(), m->size(), path.string());
}

result<safetensors_file> safetensors_file::parse(std::shared_ptr<const std::byte> keep_alive, const std::byte* data,
                                                 size_t size, const std::string& label) {
  if (size < 8) return make_error("{}: not a safetensors file (only {} bytes)", label, size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(data[i]);
  if (n > max_header_bytes) return make_error("{}: header length {} exceeds the {} byte limit", label, n, max_header_bytes);
  if (n > size - 8) return make_error("{}: truncated (header needs {} bytes, file has {})", label, n + 8, size);
  if (n < 2) return make_error("{}: header too small", label);
  const char* h = reinterpret_cast<const char*>(data + 8);
  json header = parse_json_or_discarded(std::string_view(h, static_cast<size_t>(n)));
  if (header.is_discarded()) return make_error("{}: header is not valid JSON", label);
  if (!header.is_object()) return make_error("{}: header is not a JSON object", label);

  safetensors_file f;
  f.label_ = label;
  f.keep_alive_ = keep_alive;
  f.buffer_ = data + 8 + n;
  const size_t buffer_size = size - 8 - n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return make_error("{}: __metadata__ is not an object", label);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return make_error("{}: __metadata__.{} is not a string", label, m.key());
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return make_error("{}: entry '{}' is not an object", label, name);
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return make_error("{}: tensor '{}' has no dtype string", label, name);
    if (sh == v.end() || !sh->is_array()) return make_error("{}: tensor '{}' has no shape array", label, name);
    if (off == v.end() || !off->is_array() || off->size() != 2)
      return make_error("{}: tensor '{}' needs data_offsets [begin, end]", label, name);
    st_tensor_info t;
    t.name = name;
    auto d = st_dtype_from_name(dt->get<std::string>());
    if (!d) return make_error("{}: tensor '{}': {}", label, name, d.message());
    t.dtype = *d;
    uint64_t numel = 1;
    for (const auto& s : *sh) {
      if (!s.is_number_unsigned()) return make_error("{}: tensor '{}' has a non-integer or negative dimension", label, name);
      uint64_t dim = s.get<uint64_t>();
      if (dim > 0 && numel > std::numeric_limits<uint64_t>::max() / dim / 8)
        return make_error("{}: tensor '{}' shape overflows", label, name);
      numel *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const auto& o : *off)
      if (!o.is_number_unsigned()) return make_error("{}: tensor '{}' has invalid data_offsets", label, name);
    uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e) return make_error("{}: tensor '{}' has data_offsets begin > end", label, name);
    if (e > buffer_size)
      return make_error("{}: tensor '{}' data [{}, {}) lies outside the {}-byte buffer (truncated file?)", label, name, b,
                        e, buffer_size);
    uint64_t expect = numel * st_dtype_size(t.dtype);
    if (e - b != expect)
      return make_error("{}: tensor '{}' is {} {} values ({} bytes) but its data_offsets span {} bytes", label, name,
                        numel, st_dtype_name(t.dtype), expect, e - b);
    t.begin = b;
    t.nbytes = e - b;
    f.tensors_.push_back(std::move(t));
  }
  // No overlaps and no holes: sorted by offset, each tensor starts where the previous ended.
  std::vector<const st_tensor_info*> order;
  for (const auto& t : f.tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin || (a->begin == b->begin && a->nbytes < b->nbytes); });
  size_t pos = 0;
  for (const auto* t : order) {
    if (t->begin < pos) return make_error("{}: tensor '{}' overlaps another tensor", label, t->name);
    if (t->begin > pos) return make_error("{}: hole in the data buffer before tensor '{}'", label, t->name);
    pos = t->begin + t->nbytes;
  }
  if (pos != buffer_size)
    return make_error("{}: data buffer has {} bytes but tensors cover {}", label, buffer_size, pos);
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_[f.tensors_[i].name] = i;
  return f;
}

const st_tensor_info* safetensors_file::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}


status write_safetensors_streamed(const fs::path& path, const std::vector<st_tensor_to_write>& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  const std::function<result<const void*>(size_t)>& bytes_of) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  std::vector<size_t> sizes;
  for (const auto& t : tensors) {
    size_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<size_t>(d);
    size_t nb = numel * st_dtype_size(t.dtype);
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nb}}};
    offset += nb;
    sizes.push_back(nb);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // align the buffer to 8 bytes
  std::string head;
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) head.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  head += h;
  LP_TRY_ASSIGN(file, atomic_file_writer::open(path));
  LP_TRY(file.write(head.data(), head.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    LP_TRY_ASSIGN(bytes, bytes_of(i));
    LP_TRY(file.write(bytes, sizes[i]));
  }
  return file.commit();
}

status write_safetensors(const fs::path& path, const std::vector<st_tensor_to_write>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  return write_safetensors_streamed(path, tensors, metadata, [&](size_t i) -> result<const void*> { return tensors[i].data; });
}

}  // namespace lorapipe
