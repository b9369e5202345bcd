#pragma once
// Helpers of the fuzz targets: per-process scratch files, the error contract, findings.

#include <moe/error.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <signal.h>
#include <unistd.h>

namespace moe_fuzz {

/// A directory of this process for scratch files (/dev/shm/moe_fuzz_<pid> when there is a
/// /dev/shm), removed at exit.
inline std::string const& scratch_dir() {
  struct Dir {
    std::filesystem::path path;
    Dir() {
      std::error_code ec;
      std::filesystem::path base = std::filesystem::is_directory("/dev/shm", ec)
                                       ? std::filesystem::path("/dev/shm")
                                       : std::filesystem::temp_directory_path();
      // Directories of processes that died without cleaning up (a sanitizer report, a
      // timeout) are removed.
      std::string const prefix = "moe_fuzz_";
      for (auto const& e : std::filesystem::directory_iterator(base, ec)) {
        std::string const name = e.path().filename().string();
        if (name.rfind(prefix, 0) != 0) continue;
        long const pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
        if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
          std::error_code ignored;
          std::filesystem::remove_all(e.path(), ignored);
        }
      }
      path = base / (prefix + std::to_string(::getpid()));
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static Dir const dir;
  static std::string const text = dir.path.string();
  return text;
}

/// Reports a finding and aborts, so that libFuzzer (or the replay main) saves the input.
[[noreturn]] inline void finding(std::string const& what) {
  std::fprintf(stderr, "\n==== fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::error_code ec;
  std::filesystem::remove_all(scratch_dir(), ec);
  std::abort();
}

/// Checks an invariant of a successful parse.
inline void require(bool ok, std::string const& what) {
  if (!ok) finding(what);
}

/// Runs \p body; a moe::Error is the expected way to refuse bad input, any other std::exception
/// (a std::out_of_range, a YAML::Exception, ...) is a finding. Returns true if nothing was thrown.
template <class Body>
bool expect_moe_errors(char const* step, Body&& body) {
  try {
    body();
    return true;
  } catch (moe::Error const&) {
    return false;
  } catch (std::exception const& e) {
    finding(std::string(step) + " threw a non-moe exception: " + e.what());
  }
}

/// Writes \p size bytes to \p path (replacing it).
inline void write_file(std::string const& path, std::uint8_t const* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(data), static_cast<std::streamsize>(size));
  if (!out) finding("cannot write the scratch file " + path);
}

}  // namespace moe_fuzz
