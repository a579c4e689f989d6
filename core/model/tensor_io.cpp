// safetensors <-> torch: see tensor_io.h.
#include "core/model/tensor_io.h"

#include <torch/types.h>  // not <torch/torch.h>: its nn/optim/data/jit parts cost ~20 s a file
#include <torch/utils.h>

namespace lorapipe {

result<at::ScalarType> scalar_type_of(st_dtype t) {
  switch (t) {
    case st_dtype::f64: return at::kDouble;
    case st_dtype::f32: return at::kFloat;
    case st_dtype::f16: return at::kHalf;
    case st_dtype::bf16: return at::kBFloat16;
    case st_dtype::i64: return at::kLong;
    case st_dtype::i32: return at::kInt;
    case st_dtype::i16: return at::kShort;
    case st_dtype::i8: return at::kChar;
    case st_dtype::u8: return at::kByte;
    case st_dtype::boolean: return at::kBool;
  }
  return make_error("unknown dtype");
}

result<st_dtype> st_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return st_dtype::f64;
    case at::kFloat: return st_dtype::f32;
    case at::kHalf: return st_dtype::f16;
    case at::kBFloat16: return st_dtype::bf16;
    case at::kLong: return st_dtype::i64;
    case at::kInt: return st_dtype::i32;
    case at::kShort: return st_dtype::i16;
    case at::kChar: return st_dtype::i8;
    case at::kByte: return st_dtype::u8;
    case at::kBool: return st_dtype::boolean;
    default: return make_error("dtype {} cannot be stored in safetensors", c10::toString(t));
  }
}

result<at::ScalarType> parse_dtype_name(const std::string& s) {
  if (s == "float32" || s == "f32" || s == "fp32" || s == "float") return at::kFloat;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "float16" || s == "f16" || s == "fp16" || s == "half") return at::kHalf;
  return make_error("unknown dtype '{}' (expected float32, bfloat16 or float16)", s);
}

const char* dtype_hf_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: return "float32";
  }
}

result<at::Tensor> read_tensor(const safetensors_file& f, const st_tensor_info& t, at::ScalarType to) {
  LP_TRY_ASSIGN(st, scalar_type_of(t.dtype));
  // The mmap is read-only: from_blob wraps it, then .to()/.clone() copies out.
  auto view = torch::from_blob(const_cast<std::byte*>(f.data(t)), t.shape, torch::TensorOptions().dtype(st));
  if (to == at::ScalarType::Undefined || to == st) return view.clone();
  return view.to(to);
}

status write_tensors_streamed(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& like,
                              const std::map<std::string, std::string>& metadata,
                              const std::function<result<at::Tensor>(size_t)>& tensor_of) {
  std::vector<st_tensor_to_write> out;
  for (const auto& [name, t] : like) {
    LP_TRY_ASSIGN(dt, st_dtype_of(t.scalar_type()));
    out.push_back({name, dt, t.sizes().vec(), nullptr});
  }
  at::Tensor held;  // the tensor being written
  return write_safetensors_streamed(path, out, metadata, [&](size_t i) -> result<const void*> {
    held = at::Tensor();  // written: let it go before the next is made
    LP_TRY_ASSIGN(t, tensor_of(i));
    if (t.scalar_type() != like[i].second.scalar_type() || t.sizes() != like[i].second.sizes())
      return make_error("{}: {} is {} {}, the header says {} {}", path.string(), like[i].first, c10::toString(t.scalar_type()),
                        fmt::join(t.sizes(), "x"), c10::toString(like[i].second.scalar_type()), fmt::join(like[i].second.sizes(), "x"));
    held = t.detach().to(at::kCPU).contiguous();
    return static_cast<const void*>(held.data_ptr());
  });
}

status write_tensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::map<std::string, std::string>& metadata) {
  return write_tensors_streamed(path, tensors, metadata, [&](size_t i) -> result<at::Tensor> { return tensors[i].second; });
}

}  // namespace lorapipe
