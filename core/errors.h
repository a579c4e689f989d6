// Typed exceptions for failures of devices and libraries (CUDA, NCCL, SQLite, LibTorch).
// They are thrown by check macros and caught at one boundary (CLI main, GUI run thread).
#pragma once

#include <stdexcept>
#include <string>

namespace lorapipe {

struct lorapipe_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct config_error : lorapipe_error {
  using lorapipe_error::lorapipe_error;
};
struct device_error : lorapipe_error {
  using lorapipe_error::lorapipe_error;
};
struct out_of_memory_error : device_error {
  using device_error::device_error;
};

}  // namespace lorapipe
