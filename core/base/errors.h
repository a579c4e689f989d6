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
// SQLite failures (run database): carries the SQLite result code; SQLITE_BUSY/LOCKED = locked.
struct database_error : lorapipe_error {
  database_error(const std::string& what, int code_) : lorapipe_error(what), code(code_) {}
  int code;
  bool locked() const { return (code & 0xff) == 5 || (code & 0xff) == 6; }
};

}  // namespace lorapipe
