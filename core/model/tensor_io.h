// Bridges safetensors files and LibTorch tensors: read a stored tensor into a torch tensor (copied out
// of the mmap), and write a list of named torch tensors as a safetensors file (whole, or made one at
// a time).
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/base/result.h"
#include "core/base/safetensors.h"

namespace lorapipe {

result<at::ScalarType> scalar_type_of(st_dtype t);
result<st_dtype> st_dtype_of(at::ScalarType t);
result<at::ScalarType> parse_dtype_name(const std::string& s);  // "float32", "bf16", "bfloat16", "f16", ...
const char* dtype_hf_name(at::ScalarType t);                    // "float32", "bfloat16", "float16"

// Copies the tensor out of the file and converts it to `to` (or keeps its dtype when `to` is Undefined).
result<at::Tensor> read_tensor(const safetensors_file& f, const st_tensor_info& t, at::ScalarType to);

status write_tensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::map<std::string, std::string>& metadata = {});
// The same, one tensor at a time (write_safetensors_streamed): `like` gives each tensor's name, dtype
// and shape (meta tensors will do); tensor_of(i) makes tensor i, which must match them.
status write_tensors_streamed(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& like,
                              const std::map<std::string, std::string>& metadata,
                              const std::function<result<at::Tensor>(size_t)>& tensor_of);

}  // namespace lorapipe
