#pragma once
/// \file
/// One writer per checkpoint directory: CheckpointDirLock (collective) and the process-local
/// detail::DirLock under it, an fcntl lock on "<dir>/LOCK". POSIX.

#include <moe/comm/communicator.hpp>
#include <moe/error.hpp>
#include <moe/io/detail/checkpoint_files.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moe::io {
namespace detail {

/// The lock file of a checkpoint directory.
inline constexpr char const* kLockFile = "LOCK";

/// Seconds to wait for another process's lock (its job may have just been killed); a test hook.
inline double& lock_wait_seconds() {
  static double seconds = 2.0;
  return seconds;
}

/// A directory, by device and inode (whatever path names it).
using DirKey = std::pair<std::uint64_t, std::uint64_t>;

/// The key of the existing directory \p dir; throws IoError.
inline DirKey dir_key(std::string const& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw IoError(cat("checkpoint: cannot stat the checkpoint directory '", dir,
                      "': ", std::strerror(errno)));
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

/// A lock this process holds (pid: a forked child inherits it and the table, not the lock); the
/// destructor unlocks.
struct HeldLock {
  int fd = -1;          ///< the open LOCK file the lock is on
  bool locked = false;  ///< false where the file system keeps no locks (see the warning)
  long pid = 0;
  DirKey key{};
  std::string dir;  ///< the path it was taken under
  ~HeldLock();      // held through a unique_ptr: never copied
};

/// The locks this process holds by directory, and the mutex guarding them (a second F_SETLK of the
/// same process succeeds silently, so this table is what detects it).
struct HeldLocks {
  std::mutex mutex;
  std::map<DirKey, HeldLock const*> table;

  /// This process's entry for \p key, or null; the caller holds the mutex.
  HeldLock const* find(DirKey const& key) const {
    auto const it = table.find(key);
    return it != table.end() && it->second->pid == ::getpid() ? it->second : nullptr;
  }
};
inline HeldLocks& held_locks() {
  static HeldLocks locks;
  return locks;
}

inline HeldLock::~HeldLock() {
  {  // the table points at this object, in a forked child too: no entry may outlive it
    std::lock_guard<std::mutex> const guard(held_locks().mutex);
    auto const it = held_locks().table.find(key);
    if (it != held_locks().table.end() && it->second == this) held_locks().table.erase(it);
  }
  // A forked child holds no lock: only the holder empties LOCK.
  if (pid == static_cast<long>(::getpid()) && locked && ::ftruncate(fd, 0) != 0) {
    // the lock goes anyway; the text of an unlocked LOCK means nothing
  }
  ::close(fd);
}

/// Whether this process holds the lock of the existing directory \p dir; IoError if the LOCK it
/// locked was deleted or replaced meanwhile (a second job could lock the new one).
inline bool holds_lock(std::string const& dir) {
  DirKey const key = dir_key(dir);
  int fd = -1;
  {
    std::lock_guard<std::mutex> const guard(held_locks().mutex);
    HeldLock const* held = held_locks().find(key);
    if (!held) return false;
    fd = held->fd;
  }
  struct stat mine = {}, now = {};
  std::string const path = join(dir, kLockFile);
  bool const same = ::fstat(fd, &mine) == 0 && ::stat(path.c_str(), &now) == 0 &&
                    mine.st_dev == now.st_dev && mine.st_ino == now.st_ino;
  if (!same)
    throw IoError(cat("checkpoint: '", path, "', the lock this job holds on checkpoint_dir '", dir,
                      "', was deleted or replaced while the job ran, so another job may ",
                      "be writing there too; this job saves nothing more into it: stop the other ",
                      "job, or restart this one with another checkpoint_dir"));
  return true;
}

/// Who this process is, as written into LOCK: "key=value" lines.
inline std::string holder_identity() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  std::time_t const now = std::time(nullptr);
  std::tm utc{};
  char since[32] = "?";
  if (::gmtime_r(&now, &utc)) std::strftime(since, sizeof(since), "%Y-%m-%dT%H:%M:%SZ", &utc);
  std::string text =
      cat("hostname=", host, "\npid=", static_cast<long>(::getpid()), "\nsince=", since, "\n");
  for (char const* var : {"SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "JOB_ID"}) {
    if (char const* v = std::getenv(var)) {
      text += cat("job=", var, "=", v, "\n");
      break;
    }
  }
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!cmd.empty() && cmd.back() == '\0') cmd.pop_back();
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  if (cmd.size() > 400) cmd = cmd.substr(0, 400) + "...";
  if (!cmd.empty()) text += cat("command=", cmd, "\n");
  return text;
}

/// The holder named by the text of LOCK, on one line ("hostname=h, pid=1, since=..., ...").
inline std::string describe_holder(std::string const& text, long lock_pid) {
  std::string out;
  std::istringstream lines(text);
  for (std::string line; out.size() < 1000 && std::getline(lines, line);) {
    std::replace_if(
        line.begin(), line.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; }, '?');
    if (!line.empty()) out += (out.empty() ? "" : ", ") + line;
  }
  if (!out.empty()) return out;
  if (lock_pid > 0) return cat("pid=", lock_pid, " per the lock; it has not written its name yet");
  return "unknown: LOCK names no holder";
}

/// \brief This process's lock of a checkpoint directory: an fcntl write lock on all of
/// "<dir>/LOCK" (whose text names the holder). Closing *any* descriptor of the file drops it, so
/// LOCK is opened nowhere else; a new LOCK would be another file, which a second job could lock.
class DirLock {
 public:
  DirLock() = default;

  /// Locks the existing directory \p dir, waiting up to lock_wait_seconds() for another holder:
  /// IoError names that holder (or says LOCK cannot be opened); ConfigError if this process has it.
  explicit DirLock(std::string const& dir) {
    DirKey const key = dir_key(dir);
    long const self = static_cast<long>(::getpid());
    std::lock_guard<std::mutex> const guard(held_locks().mutex);
    if (HeldLock const* held = held_locks().find(key))
      throw ConfigError(cat("checkpoint_dir '", dir,
                            "' is already locked by this process (pid=", self, ", as '", held->dir,
                            "'): one writer per checkpoint directory; release that lock "
                            "first, or use another checkpoint_dir"));
    std::string const path = join(dir, kLockFile);
    std::string const identity = holder_identity();
    int const fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      throw IoError(
          cat("checkpoint: cannot open the lock file '", path, "': ", std::strerror(errno)));
    auto const deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(std::max(0.0, lock_wait_seconds()));
    struct flock whole {};  // a write lock on the whole file (l_start = l_len = 0)
    whole.l_type = F_WRLCK;
    whole.l_whence = SEEK_SET;
    bool locked = false;
    for (;;) {
      if (::fcntl(fd, F_SETLK, &whole) == 0) {
        locked = true;
        break;
      }
      int const e = errno;
      if (e == EINTR) continue;
      if (e != EACCES && e != EAGAIN) {
        // ENOLCK, EOPNOTSUPP, ...: no locks on this file system; warned once per directory.
        static std::set<DirKey> warned;
        if (warned.insert(key).second)
          warn(cat("cannot lock '", path, "' (", std::strerror(e), "): this file system keeps no ",
                   "fcntl locks, so nothing stops another job from writing into '", dir, "'"));
        break;
      }
      if (std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      // Held by another process: read who (closing fd drops nothing: this process holds none).
      std::string text(4096, '\0');
      ssize_t const got = ::pread(fd, &text[0], text.size(), 0);
      text.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
      struct flock probe = whole;
      long lock_pid = 0;
      if (::fcntl(fd, F_GETLK, &probe) == 0 && probe.l_type != F_UNLCK)
        lock_pid = static_cast<long>(probe.l_pid);
      ::close(fd);
      throw IoError(cat("checkpoint_dir '", dir, "' is in use by another job (",
                        describe_holder(text, lock_pid),
                        "); two jobs must not share a checkpoint directory: wait for it to "
                        "finish, or set checkpoint_dir to another directory"));
    }
    if (locked && (::ftruncate(fd, 0) != 0 ||
                   ::pwrite(fd, identity.data(), identity.size(), 0) != ssize_t(identity.size())))
      warn(cat("cannot write the holder into '", path, "': ", std::strerror(errno)));
    held_.reset(new HeldLock{fd, locked, self, key, dir});
    held_locks().table[key] = held_.get();
  }

  /// Whether this object holds a lock (false once released or moved from).
  bool held() const { return held_ != nullptr; }

  /// Unlocks (LOCK is emptied first, so that it names nobody, and stays).
  void release() noexcept { held_.reset(); }

 private:
  std::unique_ptr<HeldLock> held_;
};

}  // namespace detail

/// \brief One writer per checkpoint directory: the lock a job takes on the directory it saves
/// into, held while the object lives. A job holds it for its whole run, from before it resumes, so
/// that no other job rotates away a checkpoint it loads (save_checkpoint alone locks one save; a
/// load locks nothing). Collective: creates the directory when missing; rank 0 takes
/// detail::DirLock. Another holder (after lock_wait_seconds(), 2 s) makes every rank throw the same
/// moe::IoError naming it; a lock this process holds already (by any path), moe::ConfigError.
class CheckpointDirLock {
 public:
  /// Holds nothing.
  CheckpointDirLock() = default;

  /// Collective: locks \p dir (the same on every rank); see the class comment for the errors.
  CheckpointDirLock(moe::comm::Communicator const& comm, std::string const& dir) : dir_(dir) {
    moe::comm::collective_guard(comm, [&] {
      moe::detail::require<ConfigError>(!dir.empty(),
                                        "checkpoint: the checkpoint directory is empty");
    });
    moe::comm::check_agreement(comm, "checkpoint directory", dir);
    moe::comm::collective_guard(comm, [&] {
      if (comm.rank() != 0) return;
      detail::make_dir(dir);
      lock_ = detail::DirLock(dir);
    });
  }

  /// The directory (empty when default-constructed).
  std::string const& dir() const { return dir_; }

  /// Whether this rank holds the lock: true on rank 0 of a locked directory, false elsewhere.
  bool held() const { return lock_.held(); }

  /// Releases the lock (not collective); the destructor does it too.
  void release() noexcept { lock_.release(); }

 private:
  std::string dir_;
  detail::DirLock lock_;
};

}  // namespace moe::io
