// libFuzzer targets for the input parsers (built by tests/fuzz/run.sh with clang into one binary; the
// environment's LORAPIPE_FUZZ_TARGET, 1 to 5, picks the target). Every input must end in a value or a
// clean error: a crash, sanitizer report, hang or leak is a failure.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/text/chat_template.h"
#include "core/data/instruct_dataset.h"
#include "core/project/project.h"
#include "core/base/safetensors.h"
#include "core/text/tokenizer.h"

using namespace lorapipe;
namespace fs = std::filesystem;

namespace {
// A one-token-per-character tokenizer with <s>/</s> specials (cheap to build once).
const tokenizer& char_tokenizer() {
  static std::unique_ptr<tokenizer> tok = [] {
    nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
    for (int c = 32; c < 127; ++c) vocab[std::string(1, static_cast<char>(c))] = c - 29;
    vocab["\n"] = 98;
    nlohmann::json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}, {"unk_token", "<unk>"}}},
                        {"added_tokens", {{{"id", 1}, {"content", "<s>"}, {"special", true}}, {{"id", 2}, {"content", "</s>"}, {"special", true}}}}};
    auto r = parse_hf_tokenizer(j.dump(), {});
    return std::unique_ptr<tokenizer>(std::move(*r));
  }();
  return *tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const int target = [] {
    const char* e = std::getenv("LORAPIPE_FUZZ_TARGET");
    const int t = e ? std::atoi(e) : 0;
    if (t < 1 || t > 5) {
      std::fprintf(stderr, "set LORAPIPE_FUZZ_TARGET to 1-5\n");
      std::abort();
    }
    return t;
  }();
  const std::string input(reinterpret_cast<const char*>(data), size);
  if (target == 1) {  // tokenizer.json loader, then the loaded tokenizer on text
    auto tok = parse_hf_tokenizer(input, {});
    if (tok) {
      for (const char* s : {"Hello world", "  a\n\nb  \xc3\xa9 \xf0\x9f\x99\x82 <s>x</s>", ""}) {
        auto enc = (*tok)->encode_with_offsets(s, true);
        if (enc) (void)(*tok)->decode(enc->ids);
      }
    }
  } else if (target == 2) {  // JSONL reader + records -> examples (autodetected format, skip errors)
    static const fs::path path = fs::temp_directory_path() / ("lorapipe_fuzz_" + std::to_string(::getpid()) + ".jsonl");
    std::ofstream(path, std::ios::binary | std::ios::trunc) << input;
    instruct_options o;
    o.path = path;
    o.seq_len = 32;
    o.on_error = size % 2 ? "skip" : "stop";
    o.packing = size % 3 != 0;
    o.val_fraction = 0.2;
    o.template_vars = {{"eos_token", "</s>"}};
    (void)load_instruct_dataset(o, char_tokenizer());
  } else if (target == 3) {  // chat template parser + renderer
    auto t = chat_template::parse(input);
    if (t) {
      auto msgs = nlohmann::ordered_json::parse(R"([{"role":"system","content":"s"},{"role":"user","content":"u"},{"role":"assistant","content":"a"}])");
      (void)t->render(msgs, true, {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
      (void)t->render_for_training(msgs, {});
    }
  } else if (target == 4) {  // project file parser
    (void)parse_project(input, "fuzz/project.json");
  } else {  // 5: safetensors reader (header JSON, dtypes, shapes, offsets)
    auto copy = std::shared_ptr<std::byte>(new std::byte[size + 1], std::default_delete<std::byte[]>());
    std::memcpy(copy.get(), data, size);
    auto f = safetensors_file::parse(copy, copy.get(), size, "fuzz.safetensors");
    if (f)
      for (const auto& t : f->tensors()) (void)f->data(t);
  }
  return 0;
}
