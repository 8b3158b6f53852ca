#include "fault_env.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dvrtest {

namespace {

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kSector = 512;

std::string parent_of(const std::string& rel) {
  auto slash = rel.find_last_of('/');
  return slash == std::string::npos ? std::string() : rel.substr(0, slash);
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("PowerCutEnv: " + what + ": " + std::strerror(errno)); }

bool all_zero(const char* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (p[i]) return false;
  return true;
}

void write_exact(int fd, const char* p, std::size_t n, off_t off) {
  while (n > 0) {
    ssize_t k = ::pwrite(fd, p, n, off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) fail("cannot write a post-cut file");
    p += k;
    n -= static_cast<std::size_t>(k);
    off += k;
  }
}

}  // namespace

PowerCutEnv::PowerCutEnv(std::string root, std::uint64_t seed) : root_(std::move(root)), rng_(seed) {
  while (root_.size() > 1 && root_.back() == '/')
    root_.pop_back();
  // What is there now counts as durable.
  std::function<void(const std::string&)> walk = [&](const std::string& rel_dir) {
    initial_dirs_.insert(rel_dir);
    std::string dir = rel_dir.empty() ? root_ : root_ + "/" + rel_dir;
    DIR* d = ::opendir(dir.c_str());
    if (!d) fail("cannot list " + dir);
    std::vector<std::string> names;
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
    ::closedir(d);
    for (auto& name : names) {
      std::string r = rel_dir.empty() ? name : rel_dir + "/" + name;
      struct stat st {};
      if (::lstat((root_ + "/" + r).c_str(), &st) != 0) fail("cannot stat " + r);
      if (S_ISDIR(st.st_mode)) {
        walk(r);
      } else if (S_ISREG(st.st_mode)) {
        int fd = ::open((root_ + "/" + r).c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) fail("cannot open " + r);
        Inode* n = track_fd(fd);
        ::close(fd);
        sync_range(*n, 0, UINT64_MAX, true);
        initial_files_[r] = static_cast<std::uint64_t>(st.st_ino);
      }
    }
  };
  walk("");
}

PowerCutEnv::~PowerCutEnv() {
  for (auto& [ino, n] : inodes_)
    if (n.fd >= 0) ::close(n.fd);
}

std::uint64_t PowerCutEnv::calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

void PowerCutEnv::on_call(std::function<std::string(std::uint64_t)> f) {
  std::lock_guard<std::mutex> lock(mu_);
  on_call_ = std::move(f);
}

PowerCutEnv::Counters PowerCutEnv::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

bool PowerCutEnv::rel(const char* path, std::string* out) const {
  std::string p = path;
  if (p == root_) {
    *out = "";
    return true;
  }
  if (p.size() <= root_.size() + 1 || p.compare(0, root_.size(), root_) != 0 || p[root_.size()] != '/') return false;
  p = p.substr(root_.size() + 1);
  // Normalise "a//b" and "a/./b" (no "..": the store never writes one).
  std::string norm;
  std::size_t i = 0;
  while (i < p.size()) {
    std::size_t j = p.find('/', i);
    if (j == std::string::npos) j = p.size();
    std::string part = p.substr(i, j - i);
    if (!part.empty() && part != ".") norm += (norm.empty() ? "" : "/") + part;
    i = j + 1;
  }
  *out = norm;
  return true;
}

std::uint64_t PowerCutEnv::ino_of_fd(int fd) const {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  auto ino = static_cast<std::uint64_t>(st.st_ino);
  return inodes_.count(ino) ? ino : 0;
}

PowerCutEnv::Inode* PowerCutEnv::track_fd(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("cannot stat a new file");
  auto ino = static_cast<std::uint64_t>(st.st_ino);
  auto it = inodes_.find(ino);
  if (it != inodes_.end()) return &it->second;
  Inode n;
  // Our own read-only descriptor of the same inode: readable after an unlink.
  n.fd = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_CLOEXEC);
  if (n.fd < 0) fail("cannot reopen a new file");
  return &inodes_.emplace(ino, std::move(n)).first->second;
}

void PowerCutEnv::read_pages(int fd, std::uint64_t lo, std::uint64_t hi, std::map<std::uint64_t, Page>& out) const {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("cannot stat a modelled file");
  hi = std::min<std::uint64_t>(hi, static_cast<std::uint64_t>(st.st_size));
  std::uint64_t pos = lo / kPage * kPage;
  Page buf(kPage, '\0');
  while (pos < hi) {
    off_t data = ::lseek(fd, static_cast<off_t>(pos), SEEK_DATA);
    if (data < 0) break;  // ENXIO: only a hole remains
    off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) hole = static_cast<off_t>(hi);
    std::uint64_t from = static_cast<std::uint64_t>(data) / kPage * kPage;
    std::uint64_t to = std::min<std::uint64_t>(static_cast<std::uint64_t>(hole), hi);
    for (std::uint64_t p = from; p < to; p += kPage) {
      std::fill(buf.begin(), buf.end(), '\0');
      ssize_t k = ::pread(fd, buf.data(), kPage, static_cast<off_t>(p));
      if (k < 0) fail("cannot read a modelled file");
      if (!all_zero(buf.data(), kPage)) out[p / kPage] = buf;
    }
    pos = std::max(to, pos + 1);
    pos = (pos + kPage - 1) / kPage * kPage;
  }
}

void PowerCutEnv::sync_range(Inode& n, std::uint64_t lo, std::uint64_t hi, bool whole) {
  struct stat st {};
  if (::fstat(n.fd, &st) != 0) fail("cannot stat a modelled file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (whole) {
    lo = 0;
    hi = std::max<std::uint64_t>(size, n.durable.empty() ? 0 : (n.durable.rbegin()->first + 1) * kPage);
  }
  const std::uint64_t plo = lo / kPage, phi = hi == UINT64_MAX ? UINT64_MAX : (hi + kPage - 1) / kPage;
  n.durable.erase(n.durable.lower_bound(plo), phi == UINT64_MAX ? n.durable.end() : n.durable.lower_bound(phi));
  std::map<std::uint64_t, Page> now;
  read_pages(n.fd, plo * kPage, phi == UINT64_MAX ? UINT64_MAX : phi * kPage, now);
  for (auto& [p, data] : now)
    n.durable[p] = std::move(data);
  if (whole) n.durable_size = size;
}

void PowerCutEnv::sync_dir(const std::string& dir) {
  ++counters_.dir_syncs;
  for (auto& op : ops_) {
    bool touches = parent_of(op.a) == dir || ((op.kind == Op::rename || op.kind == Op::link) && parent_of(op.b) == dir);
    if (touches) op.durable = true;
  }
}

void PowerCutEnv::counted() {
  ++calls_;
  if (!on_call_) return;
  std::string out = on_call_(calls_);
  if (!out.empty()) cut_locked(out);
}

int PowerCutEnv::open(const char* path, int flags, mode_t mode) {
  std::string r;
  if (!rel(path, &r)) return ::open(path, flags, mode);
  struct stat before {};
  const bool existed = ::lstat(path, &before) == 0;
  int fd = ::open(path, flags, mode);
  if (fd < 0) return fd;
  int err = errno;
  struct stat st {};
  std::lock_guard<std::mutex> lock(mu_);
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    const auto ino = static_cast<std::uint64_t>(st.st_ino);
    const bool known = inodes_.count(ino) != 0;
    Inode* n = track_fd(fd);
    if (!existed && (flags & O_CREAT)) {
      ops_.push_back({Op::create, r, "", ino, false});
    } else if (!known) {
      // A file made by someone else meanwhile: what it holds counts as durable.
      sync_range(*n, 0, UINT64_MAX, true);
    }
  }
  counted();
  errno = err;
  return fd;
}

#define DVR_COUNTED_FD_CALL(call)          \
  auto rc = call;                          \
  int err = errno;                         \
  {                                        \
    std::lock_guard<std::mutex> lock(mu_); \
    if (ino_of_fd(fd)) counted();          \
  }                                        \
  errno = err;                             \
  return rc

ssize_t PowerCutEnv::write(int fd, const void* data, std::size_t len) { DVR_COUNTED_FD_CALL(::write(fd, data, len)); }
ssize_t PowerCutEnv::pwrite(int fd, const void* data, std::size_t len, off_t offset) { DVR_COUNTED_FD_CALL(::pwrite(fd, data, len, offset)); }
ssize_t PowerCutEnv::pwritev(int fd, const struct iovec* iov, int count, off_t offset) { DVR_COUNTED_FD_CALL(::pwritev(fd, iov, count, offset)); }
int PowerCutEnv::ftruncate(int fd, off_t length) { DVR_COUNTED_FD_CALL(::ftruncate(fd, length)); }
int PowerCutEnv::fallocate(int fd, int mode, off_t offset, off_t len) { DVR_COUNTED_FD_CALL(::fallocate(fd, mode, offset, len)); }
int PowerCutEnv::posix_fallocate(int fd, off_t offset, off_t len) { DVR_COUNTED_FD_CALL(::posix_fallocate(fd, offset, len)); }
int PowerCutEnv::sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags) {
  (void)offset, (void)nbytes, (void)flags;
  DVR_COUNTED_FD_CALL(::fcntl(fd, F_GETFD) < 0 ? -1 : 0);  // starts writeback only: nothing to model, nothing to wait for
}

#undef DVR_COUNTED_FD_CALL

// Syncs are modelled, not performed: the simulated cut needs no real
// durability, and the tests run many times faster without waiting for a disk.
int PowerCutEnv::fsync(int fd) {
  int rc = ::fcntl(fd, F_GETFD) < 0 ? -1 : 0;
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  struct stat st {};
  if (rc == 0 && ::fstat(fd, &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      char buf[4096];
      ssize_t k = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf - 1);
      std::string r;
      if (k > 0) {
        buf[k] = '\0';
        if (rel(buf, &r)) {
          sync_dir(r);
          counted();
        }
      }
    } else if (std::uint64_t ino = ino_of_fd(fd)) {
      ++counters_.syncs;
      sync_range(inodes_.at(ino), 0, UINT64_MAX, true);
      counted();
    }
  } else if (ino_of_fd(fd)) {
    counted();
  }
  errno = err;
  return rc;
}

int PowerCutEnv::fdatasync(int fd) {
  int rc = ::fcntl(fd, F_GETFD) < 0 ? -1 : 0;
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (std::uint64_t ino = ino_of_fd(fd)) {
    if (rc == 0) {
      ++counters_.syncs;
      sync_range(inodes_.at(ino), 0, UINT64_MAX, true);  // fdatasync syncs the size too when it changed
    }
    counted();
  }
  errno = err;
  return rc;
}

void* PowerCutEnv::mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t offset) {
  void* p = ::mmap(addr, len, prot, flags, fd, offset);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (std::uint64_t ino = fd >= 0 ? ino_of_fd(fd) : 0) {
    if (p != MAP_FAILED && (flags & MAP_SHARED) && (prot & PROT_WRITE))
      maps_[reinterpret_cast<std::uintptr_t>(p)] = Map{ino, static_cast<std::uint64_t>(offset), len};
    counted();
  }
  errno = err;
  return p;
}

int PowerCutEnv::munmap(void* addr, std::size_t len) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = maps_.find(reinterpret_cast<std::uintptr_t>(addr));
    if (it != maps_.end()) {
      maps_.erase(it);
      counted();
    }
  }
  return ::munmap(addr, len);
}

int PowerCutEnv::msync(void* addr, std::size_t len, int flags) {
  int rc = 0;
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  auto a = reinterpret_cast<std::uintptr_t>(addr);
  auto it = maps_.upper_bound(a);
  if (it == maps_.begin() || a >= std::prev(it)->first + std::prev(it)->second.len) {
    ++counters_.unknown_msyncs;
  } else {
    --it;
    ++counters_.msyncs;
    if (rc == 0 && (flags & MS_SYNC)) {
      const std::uint64_t off = it->second.offset + (a - it->first);
      sync_range(inodes_.at(it->second.ino), off, off + len, false);
    }
    counted();
  }
  errno = err;
  return rc;
}

int PowerCutEnv::rename(const char* from, const char* to) {
  std::string a, b;
  if (!rel(from, &a) || !rel(to, &b)) return ::rename(from, to);
  struct stat st {};
  const bool had = ::lstat(from, &st) == 0;
  if (had && S_ISDIR(st.st_mode)) throw std::runtime_error("PowerCutEnv: renaming a directory (" + a + ") is not modelled");
  int rc = ::rename(from, to);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (rc == 0 && had) ops_.push_back({Op::rename, a, b, static_cast<std::uint64_t>(st.st_ino), false});
  counted();
  errno = err;
  return rc;
}

int PowerCutEnv::link(const char* from, const char* to) {
  std::string a, b;
  if (!rel(from, &a) || !rel(to, &b)) return ::link(from, to);
  struct stat st {};
  const bool had = ::lstat(from, &st) == 0;
  int rc = ::link(from, to);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (rc == 0 && had) ops_.push_back({Op::link, a, b, static_cast<std::uint64_t>(st.st_ino), false});
  counted();
  errno = err;
  return rc;
}

int PowerCutEnv::unlink(const char* path) {
  std::string a;
  if (!rel(path, &a)) return ::unlink(path);
  struct stat st {};
  const bool had = ::lstat(path, &st) == 0;
  int rc = ::unlink(path);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (rc == 0 && had) ops_.push_back({Op::unlink, a, "", static_cast<std::uint64_t>(st.st_ino), false});
  counted();
  errno = err;
  return rc;
}

int PowerCutEnv::mkdir(const char* path, mode_t mode) {
  std::string a;
  if (!rel(path, &a)) return ::mkdir(path, mode);
  int rc = ::mkdir(path, mode);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (rc == 0) ops_.push_back({Op::mkdir, a, "", 0, false});
  counted();
  errno = err;
  return rc;
}

int PowerCutEnv::rmdir(const char* path) {
  std::string a;
  if (!rel(path, &a)) return ::rmdir(path);
  int rc = ::rmdir(path);
  int err = errno;
  std::lock_guard<std::mutex> lock(mu_);
  if (rc == 0) ops_.push_back({Op::rmdir, a, "", 0, false});
  counted();
  errno = err;
  return rc;
}

std::string PowerCutEnv::render(Inode& n, std::uint64_t, const std::string& out_file) {
  struct stat st {};
  if (::fstat(n.fd, &st) != 0) fail("cannot stat a modelled file");
  const auto cur_size = static_cast<std::uint64_t>(st.st_size);
  std::uint64_t size = cur_size;
  if (cur_size != n.durable_size && rng_() % 2 == 0) size = n.durable_size;
  std::map<std::uint64_t, Page> now;
  read_pages(n.fd, 0, UINT64_MAX, now);
  std::set<std::uint64_t> pages;
  for (auto& [p, d] : now)
    pages.insert(p);
  for (auto& [p, d] : n.durable)
    pages.insert(p);
  int fd = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) fail("cannot create " + out_file);
  const Page zeros(kPage, '\0');
  Page mixed(kPage, '\0');
  for (std::uint64_t p : pages) {
    if (p * kPage >= size) break;
    auto o = n.durable.find(p);
    auto c = now.find(p);
    const Page& old_page = o == n.durable.end() ? zeros : o->second;
    const Page& new_page = c == now.end() ? zeros : c->second;
    const Page* pick = &old_page;
    if (old_page != new_page) {
      switch (rng_() % 3) {
        case 0:
          pick = &old_page;
          ++counters_.lost_pages;
          break;
        case 1:
          pick = &new_page;
          break;
        default:
          for (std::uint64_t s = 0; s < kPage; s += kSector)
            std::memcpy(mixed.data() + s, (rng_() % 2 ? new_page : old_page).data() + s, kSector);
          pick = &mixed;
          ++counters_.torn_pages;
      }
    }
    if (!all_zero(pick->data(), kPage))
      write_exact(fd, pick->data(), static_cast<std::size_t>(std::min<std::uint64_t>(kPage, size - p * kPage)), static_cast<off_t>(p * kPage));
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) fail("cannot size " + out_file);
  ::close(fd);
  return out_file;
}

void PowerCutEnv::cut(const std::string& out) {
  std::lock_guard<std::mutex> lock(mu_);
  cut_locked(out);
}

void PowerCutEnv::cut_locked(const std::string& out) {
  ++counters_.cuts;
  // Which namespace operations survive.
  std::size_t pending = 0;
  for (auto& op : ops_)
    pending += !op.durable;
  const std::size_t keep = static_cast<std::size_t>(rng_() % (pending + 1));
  std::map<std::string, std::uint64_t> files = initial_files_;
  std::set<std::string> dirs = initial_dirs_;
  std::size_t rank = 0;
  for (auto& op : ops_) {
    if (!op.durable && rank++ >= keep) {
      ++counters_.lost_ops;
      continue;
    }
    switch (op.kind) {
      case Op::create:
        files[op.a] = op.ino;
        break;
      case Op::mkdir:
        dirs.insert(op.a);
        break;
      case Op::rename: {
        auto it = files.find(op.a);
        if (it != files.end() && it->second == op.ino) files.erase(it);
        files[op.b] = op.ino;
        break;
      }
      case Op::link:
        files[op.b] = op.ino;
        break;
      case Op::unlink: {
        auto it = files.find(op.a);
        if (it != files.end() && it->second == op.ino) files.erase(it);
        break;
      }
      case Op::rmdir:
        dirs.erase(op.a);
        break;
    }
  }
  // A directory (or file) whose parent did not survive is lost with it.
  auto reachable = [&](const std::string& r) {
    for (std::string p = parent_of(r); !p.empty(); p = parent_of(p))
      if (!dirs.count(p)) return false;
    return true;
  };
  if (::mkdir(out.c_str(), 0700) != 0) fail("cannot create " + out);
  std::vector<std::string> ordered(dirs.begin(), dirs.end());
  std::sort(ordered.begin(), ordered.end(), [](const std::string& x, const std::string& y) { return x.size() < y.size(); });
  for (auto& d : ordered)
    if (!d.empty() && reachable(d) && ::mkdir((out + "/" + d).c_str(), 0700) != 0) fail("cannot create " + out + "/" + d);
  std::map<std::uint64_t, std::string> rendered;
  for (auto& [r, ino] : files) {
    if (!reachable(r)) continue;
    std::string path = out + "/" + r;
    auto done = rendered.find(ino);
    if (done != rendered.end()) {
      if (::link(done->second.c_str(), path.c_str()) != 0) fail("cannot link " + path);
      continue;
    }
    rendered[ino] = render(inodes_.at(ino), ino, path);
  }
}

}  // namespace dvrtest
