// What this program is and what it runs on: the lorapipe version, the LibTorch it was built with,
// the CUDA it was compiled against, the CUDA runtime and driver it finds, and the GPUs it sees. For
// `lorapipe-cli --version`, the GUI's About box and every run's record. Never throws.
#pragma once

#include <cstdint>
#include <string>

namespace lorapipe {

struct build_info {
  std::string lorapipe;      // "0.1.0" (CMake's project version)
  std::string libtorch;      // TORCH_VERSION of the headers built against
  std::string sqlite;        // the SQLite library loaded
  std::string compiler;
  int cuda_compiled = 0;     // CUDART_VERSION built against (13000 = 13.0); 0 = no CUDA in this build
  int cuda_runtime = 0;      // the libcudart loaded; 0 = none
  int cuda_driver = 0;       // the driver's CUDA version; 0 = no driver
  int64_t cuda_devices = 0;  // GPUs visible
};

build_info describe_build();
// The lorapipe version alone (no CUDA query: cheap at every GUI start).
std::string lorapipe_version();

// "13.0" from 13000; "none" for 0.
std::string cuda_version_text(int v);
// The lines `--version` prints; the first is "PROGRAM (lorapipe) VERSION" (GNU style, which help2man
// reads), or "lorapipe VERSION" when program is empty.
std::string build_info_text(const build_info& b, const std::string& program = "");
// {"lorapipe", "libtorch", "sqlite", "compiler", "cuda_compiled", ...} as one JSON object.
std::string build_info_json(const build_info& b);

}  // namespace lorapipe
