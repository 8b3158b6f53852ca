// Thin wrappers over the POSIX calls the store uses. Every failure becomes a
// dvr::Error that names the file and says what to do.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dvr/error.hpp"

namespace dvr::detail {

/// Throws the Error matching `err` (ENOSPC/EFBIG/EDQUOT → no_space, ENOENT →
/// not_found, EACCES/EPERM → permission, else io). `what` names the operation
/// and the file.
[[noreturn]] void throw_errno(int err, const std::string& what);

/// An owned file descriptor.
/// A file could not be mapped because this process is out of address space
/// or memory (ENOMEM: a `ulimit -v`, a batch system's limit): a fault of this
/// run, not of the store, so a verify stops with it instead of reporting
/// every snapshot whose chunks it could not map as unreadable.
struct OutOfAddressSpace : Error {
  explicit OutOfAddressSpace(const std::string& what)
      : Error(Errc::io, what + ": Cannot allocate memory (ENOMEM)" +
                            " — this process ran out of address space or memory (a `ulimit -v` or a batch system's memory limit?); "
                            "nothing is known to be wrong with the store: raise the limit and try again") {}
};

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_ = -1;
};

/// Opens a file of the store: never follows a symbolic link in the last
/// component, never blocks on a FIFO, and (unless O_DIRECTORY is asked for)
/// accepts only a regular file — a planted link or device cannot make dvr read
/// or write outside the store.
Fd open_or_throw(const std::string& path, int flags, mode_t mode = 0600);

/// Throws unless `path` is a real directory (not a symbolic link) owned by us.
void require_real_dir(const std::string& path);
void write_all(int fd, const void* data, std::size_t len, const std::string& path);
/// pwrite / pread of exactly `len` bytes at `offset` (a short read is corrupt: the file ends early).
void write_all_at(int fd, const void* data, std::size_t len, std::uint64_t offset, const std::string& what);
void read_exact_at(int fd, void* data, std::size_t len, std::uint64_t offset, const std::string& what);
/// pread at `offset` until `len` bytes, the end of the file or an error,
/// resumed after short reads and EINTR: the bytes read; `err` the failed
/// read's errno, 0 when none failed (all read, or the file ended).
std::size_t read_at_most(int fd, void* data, std::size_t len, std::uint64_t offset, int& err);
/// pwritev of every byte of `pieces` (consumed: short writes advance them) to
/// the range starting at `offset`, in calls of at most IOV_MAX buffers.
void write_all_at(int fd, std::vector<struct iovec>& pieces, std::uint64_t offset, const std::string& what);
void fsync_or_throw(int fd, const std::string& path);
void fsync_dir(const std::string& dir);
std::string read_file(const std::string& path);
std::uint64_t file_size(int fd, const std::string& path);
/// Bytes of storage the file occupies (st_blocks * 512), 0 if it is gone.
std::uint64_t file_allocated(const std::string& path);
bool path_exists(const std::string& path);
/// Names in `dir` (no "." or ".."); empty if `dir` does not exist.
std::vector<std::string> list_dir(const std::string& dir);
/// mkdir with mode 0700; fine if it exists already.
void make_private_dir(const std::string& dir);

/// Writes `data` to `final_path` atomically: a temporary file in `tmp_dir` is
/// written, fsynced and renamed over `final_path`, then the directory is fsynced.
/// A crash leaves either the old file (or none) or the complete new one.
void write_file_atomic(const std::string& tmp_dir, const std::string& final_path, std::string_view data);

/// While alive, a write beyond RLIMIT_FSIZE fails with EFBIG (reported as
/// no_space) in this thread instead of killing the process with SIGXFSZ: the
/// signal is blocked, and one raised meanwhile is consumed on destruction.
/// Guards nest: one inside another of the same thread costs nothing, so a
/// loop of many small writes can hold one for all of them.
class FileSizeSignalGuard {
 public:
  FileSizeSignalGuard();
  ~FileSizeSignalGuard();
  FileSizeSignalGuard(const FileSizeSignalGuard&) = delete;
  FileSizeSignalGuard& operator=(const FileSizeSignalGuard&) = delete;

 private:
  bool active_ = false;
};

/// A random 128-bit value as 32 hex digits.
std::string random_hex();

std::int64_t now_ns();
/// Replaces the clock now_ns() reads (nullptr: the system clock again). For
/// unit tests that step the clock back without touching the machine's.
using ClockFn = std::int64_t (*)();
void set_clock_for_testing(ClockFn clock);

}  // namespace dvr::detail
