#pragma once
/// \file
/// Internals of moe/io/checkpoint.hpp: the file-system steps of a save and the listing of steps.
/// POSIX; Linux for renameat2(RENAME_EXCHANGE).

#include <moe/error.hpp>
#include <moe/io/atomic_write.hpp>
#include <moe/io/checkpoint_index.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moe::io::detail {

namespace fs = std::filesystem;

/// Test hook at a named point of a save (rank 0): _exit(86) when MOE_CHECKPOINT_TEST_CRASH names
/// it (a killed job), an IoError when MOE_CHECKPOINT_TEST_FAIL does.
inline void crash_point(char const* name) {
  char const* want = std::getenv("MOE_CHECKPOINT_TEST_CRASH");
  if (want && std::strcmp(want, name) == 0) ::_exit(86);
  char const* fail = std::getenv("MOE_CHECKPOINT_TEST_FAIL");
  if (fail && std::strcmp(fail, name) == 0)
    throw IoError(cat("checkpoint: a write failed at ", name, " (MOE_CHECKPOINT_TEST_FAIL)"));
}

/// "<dir>/<name>".
inline std::string join(std::string const& dir, std::string const& name) {
  return (fs::path(dir) / name).string();
}

/// A problem that does not fail the save, on stderr.
inline void warn(std::string const& msg) { std::cerr << ("checkpoint: warning: " + msg + "\n"); }

/// Removes \p path and everything in it; a failure is a warning that starts with \p what.
inline void remove_or_warn(std::string const& path, char const* what = "cannot remove '") {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) warn(cat(what, path, "': ", ec.message()));
}

/// The temporary directory of a save (path set once made), removed when the save fails.
struct TempDir {
  std::string path;
  TempDir() = default;
  TempDir(TempDir const&) = delete;
  TempDir& operator=(TempDir const&) = delete;
  ~TempDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
  /// The directory was installed: nothing to remove.
  void dismiss() { path.clear(); }
};

/// "<dir>/.<prefix><name>.<pid>": a hidden entry of this process's save, never read.
inline std::string hidden_path(std::string const& dir, char const* prefix,
                               std::string const& name) {
  return join(dir, cat(".", prefix, name, ".", static_cast<long>(::getpid())));
}

/// fsync of a directory; file systems that cannot sync directories are not an error.
inline void sync_dir(std::string const& dir) {
  if (int const e = fsync_dir(dir))
    throw IoError(cat("checkpoint: fsync of the directory '", dir, "' failed: ", std::strerror(e)));
}

/// "step_<digits>" directories of \p dir, newest first. Throws IoError if \p dir cannot be listed.
inline std::vector<std::pair<std::int64_t, std::string>> list_steps(std::string const& dir) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    std::error_code dec;
    if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18 ||
        !std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        !it->is_directory(dec))
      continue;
    out.emplace_back(std::stoll(name.substr(5)), it->path().string());
  }
  if (ec)
    throw IoError(
        cat("checkpoint: cannot list the checkpoint directory '", dir, "': ", ec.message()));
  std::sort(out.begin(), out.end(), std::greater<>());  // newest step first, then by path
  return out;
}

/// Removes leftovers of interrupted saves (".tmp_step_*", ".trash_step_*").
inline void remove_leftovers(std::string const& dir) {
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    if (name.rfind(".tmp_step_", 0) == 0 || name.rfind(".trash_step_", 0) == 0)
      stale.push_back(it->path());
  }
  for (fs::path const& p : stale) remove_or_warn(p.string());
}

/// Renames the complete temporary directory \p tmp to \p final_dir (replacing an existing one).
inline void install(std::string const& dir, std::string const& tmp, std::string const& final_dir) {
  struct stat st {};
  std::string old;  // where the replaced checkpoint ends up; empty when there is none
  if (::lstat(final_dir.c_str(), &st) == 0) {
#ifdef RENAME_EXCHANGE
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      old = tmp;
    } else if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
      throw IoError(cat("checkpoint: cannot exchange '", tmp, "' and '", final_dir,
                        "': ", std::strerror(errno)));
    }
#endif
    if (old.empty()) {  // no exchange: move the old one aside first
      old = hidden_path(dir, "trash_", fs::path(final_dir).filename().string());
      if (::rename(final_dir.c_str(), old.c_str()) != 0)
        throw IoError(
            cat("checkpoint: cannot move '", final_dir, "' aside: ", std::strerror(errno)));
    }
  }
  if (old != tmp && ::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    int const e = errno;
    if (!old.empty()) ::rename(old.c_str(), final_dir.c_str());  // put the old one back
    throw IoError(
        cat("checkpoint: cannot rename '", tmp, "' to '", final_dir, "': ", std::strerror(e)));
  }
  sync_dir(dir);
  if (!old.empty()) remove_or_warn(old, "cannot remove the replaced checkpoint '");
}

/// Keeps the checkpoint of \p step and the keep - 1 newest complete ones before it.
inline void retain(std::string const& dir, std::int64_t step, int keep) {
  std::vector<std::pair<std::int64_t, std::string>> steps;
  try {
    steps = list_steps(dir);
  } catch (IoError const& e) {
    warn(e.what());
    return;
  }
  int kept = 1;  // the new checkpoint
  for (auto const& [s, path] : steps) {
    if (s >= step) continue;
    try {
      if (read_checkpoint_index(path).step != s) continue;
    } catch (std::exception const&) {
      continue;  // incomplete: not counted, not deleted
    }
    if (kept++ < keep) continue;
    std::string const trash = hidden_path(dir, "trash_", fs::path(path).filename().string());
    if (::rename(path.c_str(), trash.c_str()) != 0) {
      warn(cat("cannot remove the old checkpoint '", path, "': ", std::strerror(errno)));
      continue;
    }
    crash_point("retention");
    remove_or_warn(trash);
  }
  if (int const e = fsync_dir(dir))
    warn(cat("checkpoint: fsync of the directory '", dir, "' failed: ", std::strerror(e)));
}

/// Creates \p dir and its parents when missing (fsyncing the parent of a new one). Throws IoError.
inline void make_dir(std::string const& dir) {
  std::error_code ec;
  bool const created = fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec))
    throw IoError(cat("checkpoint: cannot create the checkpoint directory '", dir,
                      "': ", ec ? ec.message() : std::string("not a directory")));
  if (created) sync_dir(fs::absolute(dir, ec).parent_path().string());
}

}  // namespace moe::io::detail
