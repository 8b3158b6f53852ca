// The store's operating-system layer: every call that changes what is on
// disk, or makes it durable, goes through one Env (in the spirit of LevelDB's
// Env). The process-wide Env is the real one (plain system calls); the unit
// tests swap in one that records what was written since each sync and, at a
// simulated power cut, drops or tears what no sync covered
// (tests/unit/fault_env.hpp, docs/durability.md).
//
// Each member has the system call's signature and its result convention (-1
// with errno set; posix_fallocate returns the error number), so a call site
// reads `env().pwrite(...)` where it read `::pwrite(...)`. Calls are per
// file, extent or chunk, never per page: the virtual call costs nothing that
// shows. Only persistence-relevant calls are here (reads, stat and locks go
// to the system directly); PMem persistence through libpmem2 (CPU cache
// flushes, not system calls) is outside it.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>

namespace dvr::detail {

class Env {
 public:
  virtual ~Env();
  virtual int open(const char* path, int flags, mode_t mode);
  virtual ssize_t write(int fd, const void* data, std::size_t len);
  virtual ssize_t pwrite(int fd, const void* data, std::size_t len, off_t offset);
  /// pwritev(2): several buffers into one contiguous range of the file.
  virtual ssize_t pwritev(int fd, const struct iovec* iov, int count, off_t offset);
  virtual int ftruncate(int fd, off_t length);
  /// fallocate(2) (punching holes, KEEP_SIZE).
  virtual int fallocate(int fd, int mode, off_t offset, off_t len);
  /// posix_fallocate(3): returns 0 or the error number (errno is not set).
  virtual int posix_fallocate(int fd, off_t offset, off_t len);
  virtual int fsync(int fd);
  virtual int fdatasync(int fd);
  /// sync_file_range(2): starts writeback only; it makes nothing durable.
  virtual int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags);
  /// mmap(2) of a file (MAP_SHARED writes reach the file, made durable by msync).
  virtual void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t offset);
  virtual int munmap(void* addr, std::size_t len);
  virtual int msync(void* addr, std::size_t len, int flags);
  virtual int rename(const char* from, const char* to);
  virtual int link(const char* from, const char* to);
  virtual int unlink(const char* path);
  virtual int mkdir(const char* path, mode_t mode);
  virtual int rmdir(const char* path);
};

namespace env_detail {
extern Env* current;
}

/// The Env in use: the real one unless a test installed another.
inline Env& env() { return *env_detail::current; }

/// Installs `e` (nullptr: the real Env again) and returns the one it
/// replaces. For tests only, and only while no store call is in flight.
Env* set_env(Env* e);

/// The real Env (plain system calls), e.g. for a test Env to forward to.
Env& real_env();

}  // namespace dvr::detail
