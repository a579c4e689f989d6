// Crash-safe checkpoint folders (torch-free file layer). A checkpoint is a folder
// <root>/step-<8 digits> holding arbitrary files plus manifest.json (size and sha256 of every file).
// It is built under a temporary name, every file and the folder are fsynced, and one rename commits
// it, so a reader sees a whole checkpoint or none. Loading verifies every checksum. Leftovers of a
// killed write (.tmp-*, .trash-*) are never mistaken for checkpoints and are swept when a run starts
// (a replaced checkpoint whose replacement never landed is renamed back first).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/base/result.h"

namespace lorapipe {

struct checkpoint_info {
  int64_t step = 0;
  std::filesystem::path dir;
  std::string manifest_sha256;
  int64_t bytes = 0;  // all files incl. the manifest
};

// Called at named points of a write ("checkpoint:file", "checkpoint:manifest", "checkpoint:rename",
// "checkpoint:replace" between moving an old same-step checkpoint aside and renaming the new one in);
// the kill test uses it to stop the process at exact moments.
using probe_fn = std::function<void(const char* site)>;

// fill(tmp_dir) writes the checkpoint's files; then the folder is sealed and renamed into place.
// A committed checkpoint for the same step is replaced.
result<checkpoint_info> write_checkpoint(const std::filesystem::path& root, int64_t step,
                                         const std::function<status(const std::filesystem::path&)>& fill,
                                         const probe_fn& probe = {});
// Manifest present and every listed file has its size and sha256; no unlisted files.
result<checkpoint_info> verify_checkpoint(const std::filesystem::path& dir);
// Committed checkpoints under root, oldest first (not verified).
std::vector<checkpoint_info> list_checkpoints(const std::filesystem::path& root);
// Keeps the newest `keep` checkpoints (keep <= 0: all); returns the steps removed.
result<std::vector<int64_t>> prune_checkpoints(const std::filesystem::path& root, int64_t keep);
// Moves every checkpoint newer than `step` aside (.abandoned-*: a resume from an older checkpoint
// abandons their timeline; the resumed run deletes them once it has written a checkpoint of its
// own, discard_abandoned_checkpoints); returns their steps, newest first.
result<std::vector<int64_t>> remove_checkpoints_after(const std::filesystem::path& root, int64_t step);
// A write killed while replacing step N (old one aside, new one not yet in) left step N only under
// .trash-: renames it back. Resume calls it before choosing a checkpoint.
void recover_replaced_checkpoints(const std::filesystem::path& root);
// Recovers as above, then removes leftovers of killed writes (.tmp-*, .trash-*).
void sweep_checkpoint_leftovers(const std::filesystem::path& root);
void discard_abandoned_checkpoints(const std::filesystem::path& root);

std::string checkpoint_dir_name(int64_t step);

}  // namespace lorapipe
