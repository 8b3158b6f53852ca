// The store's two locks, lock and writers.lock (docs/format.md, "Locking").
#include <fcntl.h>
#include <pwd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <optional>
#include <sstream>

#include "dvr/dvr.hpp"
#include "base/log.hpp"
#include "base/memops.hpp"
#include "base/env.hpp"
#include "format/chunks.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

StoreImpl::Lock::Lock(const StoreImpl& s, bool exclusive, Kind kind) : fd_(-1) {
  if (s.owner_pid_ != ::getpid()) {
    // A forked child shares its parent's open lock files, and flock() locks
    // belong to the open file: parent and child would both hold them
    // "exclusively". Give the child locks of its own, and make it re-read the
    // store before trusting anything cached.
    Fd fresh(::open((s.path + "/lock").c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
    if (!fresh && errno == EROFS) fresh = Fd(::open((s.path + "/lock").c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));  // a read-only store
    if (!fresh) throw_errno(errno, "cannot reopen the lock of store " + s.path + " after fork");
    s.lock_fd_ = std::move(fresh);
    s.writers_fd_ = Fd();
    s.owner_pid_ = ::getpid();
    s.forked_ = true;
  }
  if (kind == Kind::writers && !s.writers_fd_) {
    // Created on first use: stores made before it existed get it then.
    const std::string file = s.path + "/" + kWritersLockName;
    s.writers_fd_ = Fd(env().open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!s.writers_fd_) throw_errno(errno, "cannot open the writers' lock " + file + " of store " + s.path);
  }
  fd_ = kind == Kind::writers ? s.writers_fd_.get() : s.lock_fd_.get();
  const int mode = exclusive ? LOCK_EX : LOCK_SH;
  const char* which = kind == Kind::writers ? "writers' lock" : "lock";
  if (::flock(fd_, mode | LOCK_NB) == 0) return;
  if (errno != EWOULDBLOCK && errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] { return std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) + " s"; };
  DVR_LOG(info, std::string("store ") + s.path + ": waiting for its " + which + " (" + (exclusive ? "exclusive" : "shared") +
                    "), held by another process or handle");
  if (s.lock_timeout.count() >= 0) {
    // Bounded (StoreOptions::lock_timeout): the CRIU plugin runs while the
    // process it dumps is frozen, and that process may hold this lock (frozen
    // inside a snapshot).
    auto deadline = std::chrono::steady_clock::now() + s.lock_timeout;
    while (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
      if (std::chrono::steady_clock::now() >= deadline) {
        DVR_LOG(info, std::string("store ") + s.path + ": gave up waiting for its " + which + " after " + waited() + " (lock_timeout)");
        throw Error(Errc::io, "store " + s.path + " stayed locked by another process for " + std::to_string(s.lock_timeout.count()) +
                                  " ms (lock_timeout): another process is inside a snapshot, restore or gc there, or "
                                  "frozen inside one (a process being dumped); nothing was changed: try again once it "
                                  "is done, or give a longer lock_timeout");
      }
      ::usleep(2000);
    }
    DVR_LOG(info, std::string("store ") + s.path + ": got its " + which + " after " + waited());
    return;
  }
  // Unbounded: a second of polling, then one warning that says who may hold
  // it and how not to wait (a command that printed nothing while it waits
  // looks hung), then the blocking wait.
  const auto warn_at = t0 + std::chrono::seconds(1);
  while (::flock(fd_, mode | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
    if (std::chrono::steady_clock::now() >= warn_at) {
      DVR_LOG(warn, std::string("store ") + s.path + ": waiting for its " + which +
                        ", which another process holds (a send or push whose reader is slow, a snapshot, restore or gc, or a "
                        "process frozen inside one, being dumped or debugged); this waits until it is free — "
                        "`dvr --lock-timeout 10s ...` or Store(..., lock_timeout=10) gives up instead");
      while (::flock(fd_, mode) != 0) {
        if (errno != EINTR) throw_errno(errno, "cannot lock store " + s.path);
      }
      break;
    }
    ::usleep(5000);
  }
  DVR_LOG(info, std::string("store ") + s.path + ": got its " + which + " after " + waited());
}

StoreImpl::Lock::~Lock() { ::flock(fd_, LOCK_UN); }

}  // namespace dvr::detail
