#include "base/os.hpp"
#include "base/env.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace dvr::detail {

void throw_errno(int err, const std::string& what) {
  std::string msg = what + ": " + std::strerror(err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      throw Error(Errc::no_space, msg + " — the store's file system is full; free space, remove snapshots and run `dvr gc`, or use a larger store");
    case EFBIG:
      throw Error(
          Errc::no_space,
          msg + " — the file-size limit (ulimit -f) or the file system's maximum file size was reached; raise the limit or use another store");
    case ENOENT:
      throw Error(Errc::not_found, msg);
    case EACCES:
    case EPERM:
      throw Error(Errc::permission, msg + " — check the owner and mode of the store directory");
    case EOPNOTSUPP:
      throw Error(Errc::unsupported, msg);
    default:
      throw Error(Errc::io, msg);
  }
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd open_or_throw(const std::string& path, int flags, mode_t mode) {
  int fd = env().open(path.c_str(), flags | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, mode);
  if (fd < 0) {
    if (errno == ELOOP) throw Error(Errc::corrupt, path + " is a symbolic link; a store holds none — remove it (someone may have planted it)");
    throw_errno(errno, "cannot open " + path);
  }
  Fd owned(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno(errno, "cannot stat " + path);
  bool want_dir = (flags & O_DIRECTORY) != 0;
  if (want_dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))
    throw Error(Errc::corrupt,
                path + " is not a " + (want_dir ? "directory" : "regular file") + "; a store holds only files and directories it made — remove it");
  // Back to blocking mode for regular I/O.
  int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return owned;
}

void require_real_dir(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) throw_errno(errno, "cannot open " + path);
  if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode))
    throw Error(Errc::corrupt, path + " is not a real directory (a symbolic link or a file); a store never holds one there — remove it");
  if (st.st_uid != ::geteuid())
    throw Error(Errc::permission, path + " is owned by uid " + std::to_string(st.st_uid) + ", not by you; the store is not private");
}

void write_all(int fd, const void* data, std::size_t len, const std::string& path) {
  FileSizeSignalGuard guard;
  auto p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = env().write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "cannot write " + path);
    }
    p += n;
    len -= static_cast<std::size_t>(n);
  }
}

void write_all_at(int fd, const void* data, std::size_t len, std::uint64_t offset, const std::string& what) {
  FileSizeSignalGuard guard;
  auto p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = env().pwrite(fd, p, len, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "cannot write " + what);
    }
    p += n;
    offset += static_cast<std::uint64_t>(n);
    len -= static_cast<std::size_t>(n);
  }
}

void write_all_at(int fd, std::vector<struct iovec>& pieces, std::uint64_t offset, const std::string& what) {
  FileSizeSignalGuard guard;
  std::size_t first = 0;
  while (first < pieces.size()) {
    if (pieces[first].iov_len == 0) {
      ++first;
      continue;
    }
    int count = static_cast<int>(std::min<std::size_t>(pieces.size() - first, IOV_MAX));
    ssize_t n = env().pwritev(fd, pieces.data() + first, count, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "cannot write " + what);
    }
    offset += static_cast<std::uint64_t>(n);
    for (auto left = static_cast<std::size_t>(n); left > 0;) {
      std::size_t take = std::min(left, pieces[first].iov_len);
      pieces[first].iov_base = static_cast<char*>(pieces[first].iov_base) + take;
      pieces[first].iov_len -= take;
      left -= take;
      if (pieces[first].iov_len == 0) ++first;
    }
  }
}

std::size_t read_at_most(int fd, void* data, std::size_t len, std::uint64_t offset, int& err) {
  auto p = static_cast<char*>(data);
  std::size_t got = 0;
  err = 0;
  while (got < len) {
    const ssize_t n = ::pread(fd, p + got, len - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  return got;
}

void read_exact_at(int fd, void* data, std::size_t len, std::uint64_t offset, const std::string& what) {
  int err = 0;
  const std::size_t got = read_at_most(fd, data, len, offset, err);
  if (err != 0) throw_errno(err, "cannot read " + what);
  if (got < len) throw Error(Errc::corrupt, what + " ends early, at byte " + std::to_string(offset + got));
}

void fsync_or_throw(int fd, const std::string& path) {
  if (env().fsync(fd) != 0) throw_errno(errno, "cannot fsync " + path);
}

void fsync_dir(const std::string& dir) {
  Fd fd = open_or_throw(dir, O_RDONLY | O_DIRECTORY);
  fsync_or_throw(fd.get(), dir);
}

std::string read_file(const std::string& path) {
  Fd fd = open_or_throw(path, O_RDONLY);
  // Read straight into a string of the file's size (one more byte, to see
  // the end in the same pass); it grows if the file does, or was said to be
  // empty (/proc files).
  struct stat st {};
  std::size_t cap = ::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0 ? static_cast<std::size_t>(st.st_size) + 1 : 65536;
  std::string out(cap, '\0');
  std::size_t len = 0;
  for (;;) {
    if (len == out.size()) out.resize(out.size() * 2);
    ssize_t n = ::read(fd.get(), out.data() + len, out.size() - len);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "cannot read " + path);
    }
    if (n == 0) break;
    len += static_cast<std::size_t>(n);
  }
  out.resize(len);
  return out;
}

std::uint64_t file_size(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno(errno, "cannot stat " + path);
  return static_cast<std::uint64_t>(st.st_size);
}

std::uint64_t file_allocated(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_blocks) * 512;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
  DIR* d = dfd >= 0 ? ::fdopendir(dfd) : nullptr;
  if (!d) {
    int err = errno;
    if (dfd >= 0) ::close(dfd);
    if (err == ENOENT) return names;
    throw_errno(err, "cannot list " + dir);
  }
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (!e) {
      int err = errno;
      ::closedir(d);
      if (err != 0) throw_errno(err, "cannot list " + dir);  // a partial listing must never pass for a complete one
      break;
    }
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    names.emplace_back(e->d_name);
  }
  return names;
}

void make_private_dir(const std::string& dir) {
  if (env().mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) throw_errno(errno, "cannot create directory " + dir);
}

void write_file_atomic(const std::string& tmp_dir, const std::string& final_path, std::string_view data) {
  std::string tmp = tmp_dir + "/" + random_hex() + ".tmp";
  {
    Fd fd = open_or_throw(tmp, O_WRONLY | O_CREAT | O_EXCL, 0600);
    try {
      write_all(fd.get(), data.data(), data.size(), tmp);
      fsync_or_throw(fd.get(), tmp);
    } catch (...) {
      env().unlink(tmp.c_str());
      throw;
    }
  }
  if (env().rename(tmp.c_str(), final_path.c_str()) != 0) {
    int err = errno;
    env().unlink(tmp.c_str());
    throw_errno(err, "cannot publish " + final_path);
  }
  fsync_dir(final_path.substr(0, final_path.find_last_of('/')));
}

namespace {
thread_local unsigned t_file_size_guards = 0;  // FileSizeSignalGuards alive in this thread
}

FileSizeSignalGuard::FileSizeSignalGuard() {
  // Inside another guard of this thread: that one has done it (a write of
  // each page would otherwise cost four more system calls).
  if (t_file_size_guards++ > 0) return;
  sigset_t set, old;
  sigemptyset(&set);
  sigaddset(&set, SIGXFSZ);
  // Only take over when the application has not blocked it itself and it is
  // not already pending (then its own handling stays in charge).
  if (pthread_sigmask(SIG_BLOCK, &set, &old) != 0) return;
  sigset_t pending;
  sigpending(&pending);
  if (sigismember(&old, SIGXFSZ) || sigismember(&pending, SIGXFSZ)) {
    if (!sigismember(&old, SIGXFSZ)) pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    return;
  }
  active_ = true;
}

FileSizeSignalGuard::~FileSizeSignalGuard() {
  --t_file_size_guards;
  if (!active_) return;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGXFSZ);
  timespec zero{0, 0};
  while (sigtimedwait(&set, nullptr, &zero) == SIGXFSZ) {
  }
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

std::string random_hex() {
  unsigned char b[16];
  std::size_t got = 0;
  while (got < sizeof b) {
    ssize_t n = ::getrandom(b + got, sizeof b - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "getrandom");
    }
    got += static_cast<std::size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : b) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

namespace {
std::atomic<ClockFn> g_test_clock{nullptr};
}  // namespace

std::int64_t now_ns() {
  if (ClockFn clock = g_test_clock.load(std::memory_order_relaxed)) return clock();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void set_clock_for_testing(ClockFn clock) { g_test_clock.store(clock, std::memory_order_relaxed); }

}  // namespace dvr::detail
