#pragma once
/// \file
/// Atomic file writes (POSIX): write_atomic, and resolve_links for the path it writes through.

#include <moe/error.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moe::io {

namespace detail {
using moe::detail::cat;

/// fsync of the directory \p dir (makes renames in it durable): 0, or the errno of a failed fsync.
/// A directory that cannot be opened or synced (EINVAL, ENOTSUP) is not an error.
inline int fsync_dir(std::string const& dir) {
  int const fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 0;
  int const rc = ::fsync(fd);
  int const e = errno;
  ::close(fd);
  return rc != 0 && e != EINVAL && e != ENOTSUP ? e : 0;
}

}  // namespace detail

/// \brief \p path, or where its chain of symbolic links leads (a relative target is taken from
/// the link's directory; the target need not exist). IoError for more than 40 links (a loop).
inline std::string resolve_links(std::string path) {
  for (int hops = 0; hops <= 40; ++hops) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
    std::string target(std::size_t(st.st_size > 0 ? st.st_size : 255) + 1, '\0');
    ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
    if (n < 0)
      throw IoError(
          detail::cat("cannot read the symbolic link '", path, "': ", std::strerror(errno)));
    target.resize(std::size_t(n));
    if (!target.empty() && target[0] != '/')  // from the link's directory (npos + 1 == 0: none)
      target = path.substr(0, path.find_last_of('/') + 1) + target;
    path = target;
  }
  throw IoError(detail::cat("'", path, "': more than 40 symbolic links in a row (a loop?)"));
}

/// \brief A borrowed run of bytes, one piece of a file written by write_atomic.
struct ByteSpan {
  void const* data = nullptr;
  std::size_t size = 0;
};

/// Writes the concatenation of \p pieces to \p link atomically: to "<path>.tmp.<pid>", fsync'ed and
/// renamed over the path (resolve_links: a link stays, the file it names is replaced), then the
/// directory is fsync'ed. Readers see the old file or the new one; on failure the temporary file
/// is removed and IoError says which step failed and why.
inline void write_atomic(std::string const& link, std::vector<ByteSpan> const& pieces) {
  using detail::cat;
  if (link.empty()) throw IoError("write_atomic: the output path is empty");
  std::string const path = resolve_links(link);
  std::string const tmp = cat(path, ".tmp.", static_cast<long>(::getpid()));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0)
    throw IoError(cat("cannot write '", path, "': cannot create the temporary file '", tmp,
                      "': ", std::strerror(errno)));
  // Takes errno as an argument, before any allocation could change it.
  auto fail = [&](int e, auto const&... step) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw IoError(cat("cannot write '", path, "': ", step..., " failed: ", std::strerror(e)));
  };
  for (ByteSpan const& piece : pieces) {
    auto const* p = static_cast<unsigned char const*>(piece.data);
    std::size_t left = piece.size;
    while (left > 0) {
      ssize_t const w = ::write(fd, p, std::min<std::size_t>(left, std::size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail(errno, "writing '", tmp, "'");
      p += w;
      left -= static_cast<std::size_t>(w);
    }
  }
  if (::fsync(fd) != 0) fail(errno, "fsync of '", tmp, "'");
  if (::close(std::exchange(fd, -1)) != 0) fail(errno, "closing '", tmp, "'");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(errno, "renaming '", tmp, "' to '", path, "'");
  std::size_t const slash = path.find_last_of('/');
  std::string const dir =
      slash == std::string::npos ? std::string(".") : (slash == 0 ? "/" : path.substr(0, slash));
  if (int const e = detail::fsync_dir(dir))
    throw IoError(cat("wrote '", path, "' but the fsync of its directory '", dir,
                      "' failed: ", std::strerror(e)));
}

/// write_atomic of one string of bytes.
inline void write_atomic(std::string const& path, std::string const& bytes) {
  write_atomic(path, std::vector<ByteSpan>{{bytes.data(), bytes.size()}});
}
}  // namespace moe::io
