// lorapipe-cli plan (cli_plan.cpp): the project's plan printed as text or JSON, what-if questions,
// the largest fit, and --write.
#pragma once

#include <string>
#include <vector>

namespace lorapipe {

struct plan_args {
  std::string project;
  double gflops = 100;
  bool json = false, grid = false, write = false;
  std::string devices, schedule;   // overrides, as train takes them
  int probe = 0;                   // 1: --probe (cached), 2: --reprobe
  int profile = 0;                 // 1: --profile (cached), 2: --reprofile
  std::vector<std::string> what_if;
};
int cmd_plan(const plan_args& a);

}  // namespace lorapipe
