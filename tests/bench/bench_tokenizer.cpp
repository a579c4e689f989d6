// Tokenizer throughput: chars/s and MB/s on real corpora (Tiny Shakespeare, Moby Dick) for the Qwen3
// tokenizer.json (byte-level BPE, 151k vocab) and, side by side on the same vocabulary, lorapipe's
// tokenizer.json BPE (tok512 converted by transformers) vs Google's SentencePiece library (tok512.model).
// Usage: lorapipe_bench_tokenizer [--data ../shared/data] [--fixtures tests/fixtures] [--repeat 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/text/tokenizer.h"

using namespace lorapipe;
namespace fs = std::filesystem;
using clk = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string data = "../shared/data", fixtures = "tests/fixtures";
  int repeat = 3;
  CLI::App app{"tokenizer throughput"};
  app.add_option("--data", data);
  app.add_option("--fixtures", fixtures);
  app.add_option("--repeat", repeat);
  CLI11_PARSE(app, argc, argv);

  struct entry {
    const char* name;
    fs::path path;
  };
  const std::vector<entry> toks = {{"qwen3 tokenizer.json (byte-level BPE)", fs::path(data) / "tokenizers/qwen3/tokenizer.json"},
                                   {"tok512 tokenizer.json (lorapipe BPE)", fs::path(fixtures) / "tokenizers/tok512-metaspace/tokenizer.json"},
                                   {"tok512.model (SentencePiece library)", fs::path(data) / "tokenizers/tok512/tok512.model"},
                                   {"llama2 tokenizer.model (SentencePiece library)", fs::path(data) / "tokenizers/llama2/tokenizer.model"},
                                   {"gpt2 r50k_base.tiktoken (tiktoken BPE)", fs::path(data) / "tokenizers/gpt2/r50k_base.tiktoken"}};
  const std::vector<fs::path> corpora = {fs::path(data) / "text/tinyshakespeare.txt", fs::path(data) / "text/moby_dick.txt"};
  std::printf("%-48s %-20s %10s %12s %9s %8s\n", "tokenizer", "corpus", "tokens", "chars/s", "MB/s", "load s");
  std::vector<double> mbps(toks.size());
  for (size_t k = 0; k < toks.size(); ++k) {
    const auto t0 = clk::now();
    auto tok = load_tokenizer(toks[k].path);
    const double load_s = std::chrono::duration<double>(clk::now() - t0).count();
    if (!tok) {
      std::fprintf(stderr, "%s: %s\n", toks[k].name, tok.message().c_str());
      return 1;
    }
    for (const auto& c : corpora) {
      std::ifstream in(c, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), {});
      int64_t chars = 0;
      for (unsigned char ch : text) chars += (ch & 0xc0) != 0x80;
      double best = 1e9;
      size_t n = 0;
      for (int r = 0; r < repeat; ++r) {
        const auto a = clk::now();
        auto ids = (*tok)->encode_with_offsets(text, false);
        best = std::min(best, std::chrono::duration<double>(clk::now() - a).count());
        n = ids ? ids->ids.size() : 0;
      }
      std::printf("%-48s %-20s %10zu %12.3g %9.2f %8.3f\n", toks[k].name, c.filename().string().c_str(), n, chars / best,
                  text.size() / best / 1e6, load_s);
      mbps[k] += text.size() / best / 1e6 / corpora.size();
    }
  }
  std::printf("\nsame tok512 vocabulary: lorapipe tokenizer.json BPE / SentencePiece library throughput = %.2f\n", mbps[1] / mbps[2]);
  return 0;
}
