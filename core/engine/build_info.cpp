// build_info: see build_info.h.
#include "core/engine/build_info.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sqlite3.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include "offload/device.h"

#ifndef LORAPIPE_VERSION
#error "LORAPIPE_VERSION must be defined by the build (core/CMakeLists.txt)"
#endif

namespace lorapipe {

std::string lorapipe_version() { return LORAPIPE_VERSION; }

build_info describe_build() {
  build_info b;
  b.lorapipe = LORAPIPE_VERSION;
  b.libtorch = TORCH_VERSION;
  b.sqlite = sqlite3_libversion();
  b.compiler = __VERSION__;
  const cuda_versions v = cuda_version_info();
  b.cuda_compiled = v.compiled;
  b.cuda_runtime = v.runtime;
  b.cuda_driver = v.driver;
  try {
    b.cuda_devices = static_cast<int64_t>(torch::cuda::device_count());
  } catch (...) {
    b.cuda_devices = 0;
  }
  return b;
}

std::string cuda_version_text(int v) { return v <= 0 ? std::string("none") : fmt::format("{}.{}", v / 1000, v % 1000 / 10); }

std::string build_info_text(const build_info& b, const std::string& program) {
  return fmt::format(
      "{} {}\nLibTorch {}\nCUDA {} (compiled), runtime {}, driver {}, {} GPU(s) visible\nSQLite {}\ncompiler {}\n",
      program.empty() ? std::string("lorapipe") : program + " (lorapipe)", b.lorapipe, b.libtorch, cuda_version_text(b.cuda_compiled), cuda_version_text(b.cuda_runtime),
      cuda_version_text(b.cuda_driver), b.cuda_devices, b.sqlite, b.compiler);
}

std::string build_info_json(const build_info& b) {
  nlohmann::json j = {{"lorapipe", b.lorapipe},
                      {"libtorch", b.libtorch},
                      {"sqlite", b.sqlite},
                      {"compiler", b.compiler},
                      {"cuda_compiled", cuda_version_text(b.cuda_compiled)},
                      {"cuda_runtime", cuda_version_text(b.cuda_runtime)},
                      {"cuda_driver", cuda_version_text(b.cuda_driver)},
                      {"cuda_devices", b.cuda_devices}};
  return j.dump();
}

}  // namespace lorapipe
