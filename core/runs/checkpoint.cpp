// Crash-safe checkpoint folders: see checkpoint.h.
#include "core/runs/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/base/hash.h"
#include "core/base/json_parse.h"
#include "core/base/safetensors.h"

namespace lorapipe {
namespace fs = std::filesystem;

namespace {

constexpr const char* manifest_name = "manifest.json";


status fsync_path(const fs::path& p, bool dir) {
  const int fd = ::open(p.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return make_error("{}: cannot open to fsync: {}", p.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) return make_error("{}: fsync failed: {}", p.string(), std::strerror(e));
  return ok_status();
}

bool parse_step_dir(const std::string& name, int64_t& step) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return false;
  step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    step = step * 10 + (name[i] - '0');
  }
  return true;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }




result<checkpoint_info> write_checkpoint(const fs::path& root, int64_t step,
                                         const std::function<status(const fs::path&)>& fill, const probe_fn& probe) {
  auto at = [&](const char* site) {
    if (probe) probe(site);
  };
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return make_error("{}: cannot create the checkpoint folder: {}", root.string(), ec.message());
  const fs::path final_dir = root / checkpoint_dir_name(step);
  const fs::path tmp = root / fmt::format(".tmp-{}-{}", checkpoint_dir_name(step), ::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  if (ec) return make_error("{}: cannot create {}: {}", root.string(), tmp.string(), ec.message());
  // Until the rename commits it, any early return removes the temporary folder.
  struct remove_unless_committed {
    fs::path dir;
    bool committed = false;
    ~remove_unless_committed() {
      std::error_code e2;
      if (!committed) fs::remove_all(dir, e2);
    }
  } guard{tmp};
  LP_TRY(fill(tmp));
  // Seal: hash and fsync every file, then the manifest, then the folder.
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  std::vector<fs::path> names;
  for (const auto& e : fs::directory_iterator(tmp, ec)) names.push_back(e.path());
  std::sort(names.begin(), names.end());
  int64_t total = 0;
  for (const auto& p : names) {
    if (!fs::is_regular_file(p, ec)) return make_error("{}: unexpected entry {} in a checkpoint", root.string(), p.filename().string());
    LP_TRY(fsync_path(p, false));
    int64_t n = 0;
    LP_TRY_ASSIGN(h, sha256_file(p, &n));
    total += n;
    files[p.filename().string()] = {{"bytes", n}, {"sha256", h}};
    at("checkpoint:file");
  }
  const std::string manifest =
      nlohmann::ordered_json{{"format", "lorapipe-checkpoint"}, {"version", 1}, {"step", step}, {"files", files}}.dump(2) + "\n";
  LP_TRY(write_file_atomic(tmp / manifest_name, manifest));
  at("checkpoint:manifest");
  LP_TRY(fsync_path(tmp, true));
  at("checkpoint:rename");
  // Same step written again (a resumed run): move the old one aside, rename the new one in, then delete
  // the old one, so that a kill at any moment leaves one whole step-N (or, between the renames, the
  // previous checkpoint to resume from and the old step-N under .trash-, swept later).
  fs::path replaced;
  if (fs::exists(final_dir, ec)) {
    replaced = root / fmt::format(".trash-{}-{}", checkpoint_dir_name(step), ::getpid());
    fs::remove_all(replaced, ec);
    fs::rename(final_dir, replaced, ec);
    if (ec) return make_error("{}: cannot move the old checkpoint aside: {}", final_dir.string(), ec.message());
    at("checkpoint:replace");
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    const std::string why = ec.message();
    if (!replaced.empty()) fs::rename(replaced, final_dir, ec);  // put the old one back
    return make_error("{}: cannot commit checkpoint: {}", final_dir.string(), why);
  }
  guard.committed = true;
  if (auto st = fsync_path(root, true); !st) return st.err();
  if (!replaced.empty()) fs::remove_all(replaced, ec);
  return checkpoint_info{step, final_dir, sha256_hex(manifest.data(), manifest.size()),
                         total + static_cast<int64_t>(manifest.size())};
}

result<checkpoint_info> verify_checkpoint(const fs::path& dir) {
  const std::string label = dir.string();
  int64_t step = 0;
  if (!parse_step_dir(dir.filename().string(), step)) return make_error("{}: not a checkpoint folder (step-NNNNNNNN)", label);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return make_error("{}: checkpoint not found", label);
  auto text = read_text_file(dir / manifest_name);
  if (!text) return make_error("{}: corrupted checkpoint: {}", label, text.message());
  auto j = parse_json_or_discarded(*text);
  if (j.is_discarded() || !j.is_object() || !j.contains("files") || !j["files"].is_object() || !j.contains("step") ||
      !j["step"].is_number_integer())
    return make_error("{}: corrupted checkpoint: manifest.json is not a valid manifest", label);
  if (j["step"].get<int64_t>() != step)
    return make_error("{}: corrupted checkpoint: manifest is for step {}", label, j["step"].get<int64_t>());
  int64_t total = static_cast<int64_t>(text->size());
  std::map<std::string, bool> listed;
  for (auto it = j["files"].begin(); it != j["files"].end(); ++it) {
    const auto& f = it.value();
    if (!f.is_object() || !f.contains("sha256") || !f["sha256"].is_string() || !f.contains("bytes"))
      return make_error("{}: corrupted checkpoint: bad manifest entry {}", label, it.key());
    if (it.key().find('/') != std::string::npos || it.key() == manifest_name || it.key() == "..")
      return make_error("{}: corrupted checkpoint: bad file name {}", label, it.key());
    listed[it.key()] = true;
    int64_t n = 0;
    auto h = sha256_file(dir / it.key(), &n);
    if (!h) return make_error("{}: corrupted checkpoint: {} is missing", label, it.key());
    if (*h != f["sha256"].get<std::string>() || !f["bytes"].is_number_integer() || n != f["bytes"].get<int64_t>())
      return make_error("{}: corrupted checkpoint: {} does not match its sha256 in manifest.json", label, it.key());
    total += n;
  }
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename() != manifest_name && !listed.count(e.path().filename().string()))
      return make_error("{}: corrupted checkpoint: unexpected file {}", label, e.path().filename().string());
  return checkpoint_info{step, dir, sha256_hex(text->data(), text->size()), total};
}

std::vector<checkpoint_info> list_checkpoints(const fs::path& root) {
  std::vector<checkpoint_info> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    int64_t step = 0;
    if (e.is_directory(ec) && parse_step_dir(e.path().filename().string(), step)) out.push_back({step, e.path(), {}, 0});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

namespace {
// Rename first: a kill during the recursive delete leaves a .trash folder, never a partial step-N.
status remove_checkpoint_dir(const fs::path& root, const fs::path& dir) {
  std::error_code ec;
  const fs::path trash = root / fmt::format(".trash-{}-{}", dir.filename().string(), ::getpid());
  fs::rename(dir, trash, ec);
  if (ec) return make_error("{}: cannot remove checkpoint: {}", dir.string(), ec.message());
  fs::remove_all(trash, ec);
  return ok_status();
}
}  // namespace

result<std::vector<int64_t>> prune_checkpoints(const fs::path& root, int64_t keep) {
  std::vector<int64_t> removed;
  if (keep <= 0) return removed;
  auto all = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    LP_TRY(remove_checkpoint_dir(root, all[i].dir));
    removed.push_back(all[i].step);
  }
  return removed;
}

result<std::vector<int64_t>> remove_checkpoints_after(const fs::path& root, int64_t step) {
  std::vector<int64_t> removed;
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend() && it->step > step; ++it) {  // newest first
    // Aside, not deleted: the next checkpoint write sweeps them (until then they can be renamed back).
    std::error_code ec;
    const fs::path aside = root / fmt::format(".abandoned-{}-{}", it->dir.filename().string(), ::getpid());
    fs::rename(it->dir, aside, ec);
    if (ec) return make_error("{}: cannot move the abandoned checkpoint aside: {}", it->dir.string(), ec.message());
    removed.push_back(it->step);
  }
  if (!removed.empty())
    if (auto st = fsync_path(root, true); !st) return st.err();
  return removed;
}

void recover_replaced_checkpoints(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<fs::path> aside;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.path().filename().string().rfind(".trash-step-", 0) == 0) aside.push_back(e.path());
  for (const auto& p : aside) {
    // .trash-step-NNNNNNNN-PID: a whole checkpoint moved aside; if its step-N is missing, the write
    // that was replacing it was killed between the two renames.
    const std::string name = p.filename().string().substr(7);
    const auto dash = name.rfind('-');
    int64_t step = 0;
    if (dash == std::string::npos || !parse_step_dir(name.substr(0, dash), step)) continue;
    const fs::path dir = root / checkpoint_dir_name(step);
    if (!fs::exists(dir, ec)) fs::rename(p, dir, ec);  // a committed checkpoint; resume verifies it
  }
}

void sweep_checkpoint_leftovers(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  recover_replaced_checkpoints(root);
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".trash-", 0) == 0) stale.push_back(e.path());
  }
  for (const auto& p : stale) fs::remove_all(p, ec);
}

void discard_abandoned_checkpoints(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(root, ec))
    if (e.path().filename().string().rfind(".abandoned-", 0) == 0) stale.push_back(e.path());
  for (const auto& p : stale) fs::remove_all(p, ec);
}

}  // namespace lorapipe
