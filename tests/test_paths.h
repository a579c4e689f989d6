// Where the tests find ../shared/data (set by CMake; overridable with LORAPIPE_TEST_DATA).
#pragma once

#include <cstdlib>
#include <filesystem>

inline std::filesystem::path test_data_dir() {
  if (const char* e = std::getenv("LORAPIPE_TEST_DATA")) return e;
  return LORAPIPE_TEST_DATA_DEFAULT;
}
