// Safetensors reader and writer, written from the format spec:
// 8-byte little-endian header length N, N bytes of JSON header, then the byte buffer.
// The reader memory-maps the file and validates everything before any tensor is touched:
// header size limits, JSON shape, known dtypes, shape vs byte count, offsets in bounds,
// no overlaps and no holes. Malformed files give an error value, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/base/file_io.h"
#include "core/base/result.h"

namespace lorapipe {

enum class st_dtype { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };

const char* st_dtype_name(st_dtype t);
size_t st_dtype_size(st_dtype t);
result<st_dtype> st_dtype_from_name(const std::string& name);

struct st_tensor_info {
  std::string name;
  st_dtype dtype = st_dtype::f32;
  std::vector<int64_t> shape;
  size_t begin = 0;   // offset into the data buffer
  size_t nbytes = 0;
  int64_t numel() const;
};


class safetensors_file {
 public:
  static constexpr size_t max_header_bytes = 100u << 20;  // same limit as the reference library
  static result<safetensors_file> open(const std::filesystem::path& path);
  // Parses an in-memory image (used by open() and by the fuzz target).
  static result<safetensors_file> parse(std::shared_ptr<const std::byte> keep_alive, const std::byte* data,
                                        size_t size, const std::string& label);

  const std::vector<st_tensor_info>& tensors() const { return tensors_; }
  const st_tensor_info* find(const std::string& name) const;
  const std::byte* data(const st_tensor_info& t) const { return buffer_ + t.begin; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& label() const { return label_; }

 private:
  std::shared_ptr<const void> keep_alive_;
  const std::byte* buffer_ = nullptr;
  std::vector<st_tensor_info> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::string label_;
};

struct st_tensor_to_write {
  std::string name;
  st_dtype dtype;
  std::vector<int64_t> shape;
  const void* data;  // contiguous, nbytes = numel * dtype size
};

// Writes atomically: temp file in the same folder, fsync, rename.
status write_safetensors(const std::filesystem::path& path, const std::vector<st_tensor_to_write>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// The same, one tensor at a time: only `tensors`' names, dtypes and shapes are read (data may be
// null); bytes_of(i) gives tensor i's bytes (valid until the next call), in order, each written
// before the next is asked for, so no more than one tensor need exist at once. An error from
// bytes_of stops the write and leaves no file.
status write_safetensors_streamed(const std::filesystem::path& path, const std::vector<st_tensor_to_write>& tensors,
                                  const std::map<std::string, std::string>& metadata,
                                  const std::function<result<const void*>(size_t)>& bytes_of);


}  // namespace lorapipe
