// Shared helpers for the unit tests: fresh temporary stores, deterministic test
// data, byte comparisons, catching dvr::Error with its exact code, and
// DVR_SKIP for cases that cannot run here.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <set>
#include <sstream>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "base/hash.hpp"
#include "base/os.hpp"
#include "dvr/dvr.hpp"
#include "dvr/transfer.hpp"

namespace Catch {
template <>
struct StringMaker<dvr::Errc> {
  static std::string convert(dvr::Errc c) {
    std::string n = dvr::errc_name(c);
    return n == "unknown" ? std::string("<no dvr::Error thrown>") : "Errc::" + n;
  }
};
}  // namespace Catch

/// Skips the rest of the test case: prints "SKIPPED: <reason>" on stdout and
/// returns. Catch2 2.x has no SKIP; tests/CMakeLists.txt registers every case
/// with SKIP_REGULAR_EXPRESSION "SKIPPED:", so CTest reports it as skipped
/// (with this line in `ctest -V` / --output-on-failure). `reason` may be a
/// stream expression: DVR_SKIP("no tracker: " << why). CTest's skip overrides a
/// failure, so use it before the test case's first assertion, where nothing
/// can have failed yet.
#define DVR_SKIP(reason)                                             \
  do {                                                               \
    std::ostringstream dvr_skip_reason_;                             \
    dvr_skip_reason_ << reason;                                      \
    std::cout << "SKIPPED: " << dvr_skip_reason_.str() << std::endl; \
    return;                                                          \
  } while (false)

namespace dvrtest {

namespace fs = std::filesystem;

/// Whether this binary is built with AddressSanitizer or ThreadSanitizer
/// (DVR_SANITIZE, CMakeLists.txt; GCC defines __SANITIZE_ADDRESS__ and
/// __SANITIZE_THREAD__, Clang says so through __has_feature), and its name
/// (nullptr without). A test that bounds the process's resident memory skips
/// under one where the bound would measure the sanitizer: its shadow memory,
/// allocator and metadata are resident too.
#if defined(__SANITIZE_ADDRESS__)
#define DVR_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DVR_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define DVR_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DVR_TEST_TSAN 1
#endif
#endif
#ifdef DVR_TEST_ASAN
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#ifdef DVR_TEST_TSAN
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
inline constexpr const char* kSanitizer = kAddressSanitizer ? "AddressSanitizer" : kThreadSanitizer ? "ThreadSanitizer" : nullptr;

/// Removes everything under `dir` (a test may have made parts read-only or
/// chowned them; we are the owner, or root). Errors are ignored.
inline void remove_tree(const std::string& dir) {
  std::error_code ec;
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::add, ec);
  fs::remove_all(dir, ec);
}

/// Directories `base`/dvr-unit-PID-XXXXXX that a test process left behind
/// when it died without unwinding (killed by CTest's timeout or a signal, a
/// sanitizer's fatal report, a crash) are removed by the next TempDir in
/// `base`: those of this user whose process PID is gone and that nothing
/// changed for 10 minutes (so that a live process of another PID namespace
/// sharing `base` keeps its own).
inline void remove_stale_temp_dirs(const std::string& base) {
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (auto it = fs::directory_iterator(base, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string prefix = "dvr-unit-";
    if (name.rfind(prefix, 0) != 0) continue;
    const std::size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos || dash == prefix.size() || name.size() - dash != 7) continue;
    const std::string digits = name.substr(prefix.size(), dash - prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    if (pid <= 0 || pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) continue;
    std::error_code tec;
    const auto changed = fs::last_write_time(it->path(), tec);
    if (tec || now - changed < std::chrono::minutes(10)) continue;
    remove_tree(it->path().string());
  }
}

/// A fresh directory (under /dev/shm unless `base` says otherwise), removed with
/// everything in it when the guard goes out of scope. `store()` is a path inside
/// it that does not exist yet, so tests can check nothing appears next to it.
/// Its name carries the creating process's PID (dvr-unit-PID-XXXXXX), so that
/// what a killed test process left behind is recognised and removed later
/// (remove_stale_temp_dirs, once per process and base).
class TempDir {
 public:
  explicit TempDir(const std::string& base = "/dev/shm") {
    {
      static std::mutex mu;
      static std::set<std::string> swept;
      std::lock_guard<std::mutex> guard(mu);
      if (swept.insert(base).second) remove_stale_temp_dirs(base);
    }
    std::string tmpl = base + "/dvr-unit-" + std::to_string(::getpid()) + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed in " + base);
    path_ = buf.data();
  }
  ~TempDir() { remove_tree(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string store() const { return path_ + "/store"; }
  std::string operator/(const std::string& rel) const { return path_ + "/" + rel; }

 private:
  std::string path_;
};

/// What a call threw: the dvr::Error code and message, or a sentinel code (printed
/// as "<no dvr::Error thrown>") with a description of whatever else happened.
struct Caught {
  dvr::Errc code = static_cast<dvr::Errc>(-1);
  std::string what;
  bool threw_dvr() const { return std::string(dvr::errc_name(code)) != "unknown"; }
};

template <class F>
Caught catch_error(F&& f) {
  Caught c;
  try {
    f();
    c.what = "(returned normally)";
  } catch (const dvr::Error& e) {
    c.code = e.code();
    c.what = e.what();
  } catch (const std::exception& e) {
    c.what = std::string("(threw ") + typeid(e).name() + ": " + e.what() + ")";
  } catch (...) {
    c.what = "(threw a non-std exception)";
  }
  return c;
}

/// A tmpfs of `size` (mount's size=, e.g. "8m") mounted at the new directory
/// `at` while it lives: a real file system that fills up. Needs root; false
/// (with error()) where it cannot be mounted.
class MountedTmpfs {
 public:
  MountedTmpfs(const std::string& at, const std::string& size) : at_(at) {
    fs::create_directory(at_);
    if (::mount("tmpfs", at_.c_str(), "tmpfs", 0, ("size=" + size + ",mode=0700").c_str()) == 0)
      mounted_ = true;
    else
      error_ = std::strerror(errno);
  }
  ~MountedTmpfs() {
    if (mounted_) ::umount2(at_.c_str(), MNT_DETACH);
  }
  MountedTmpfs(const MountedTmpfs&) = delete;
  MountedTmpfs& operator=(const MountedTmpfs&) = delete;
  explicit operator bool() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::string at_, error_;
  bool mounted_ = false;
};

/// A file-size limit of `bytes` for this process while it lives, standing in
/// for a full file system: growing a pack past it fails with EFBIG (SIGXFSZ is
/// ignored meanwhile), which the store reports as no_space.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(std::uint64_t bytes) {
    if (::getrlimit(RLIMIT_FSIZE, &old_) != 0) throw std::runtime_error("getrlimit failed");
    old_sigxfsz_ = ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = old_;
    lim.rlim_cur = bytes;
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) throw std::runtime_error("setrlimit failed");
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_sigxfsz_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  struct rlimit old_ {};
  void (*old_sigxfsz_)(int) = SIG_DFL;
};

/// Deterministic pseudo-random bytes (splitmix64), different for every seed.
inline void fill_random(void* dst, std::size_t len, std::uint64_t seed) {
  auto* p = static_cast<unsigned char*>(dst);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  std::size_t i = 0;
  while (i < len) {
    std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (int b = 0; b < 8 && i < len; ++b, ++i)
      p[i] = static_cast<unsigned char>(z >> (8 * b));
  }
}

inline std::vector<unsigned char> random_bytes(std::size_t len, std::uint64_t seed) {
  std::vector<unsigned char> v(len);
  fill_random(v.data(), len, seed);
  return v;
}

/// "" when the ranges are equal, else where they first differ (for CHECK output).
inline std::string diff(const void* a, const void* b, std::size_t len) {
  if (std::memcmp(a, b, len) == 0) return "";
  auto* x = static_cast<const unsigned char*>(a);
  auto* y = static_cast<const unsigned char*>(b);
  std::size_t i = 0;
  while (x[i] == y[i])
    ++i;
  return "differ first at byte " + std::to_string(i) + " of " + std::to_string(len) + " (" + std::to_string(x[i]) + " vs " + std::to_string(y[i]) +
         ")";
}

/// diff() for two whole buffers, including their sizes.
inline std::string diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  if (a.size() != b.size()) return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  return a.empty() ? std::string() : diff(a.data(), b.data(), a.size());
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

/// Flips every bit of the byte at `offset` of an existing file, in place.
inline void flip_byte(const std::string& path, std::uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  if (fd < 0) throw std::runtime_error("cannot open " + path);
  unsigned char b = 0;
  bool ok = ::pread(fd, &b, 1, static_cast<off_t>(offset)) == 1;
  b ^= 0xFF;
  ok = ok && ::pwrite(fd, &b, 1, static_cast<off_t>(offset)) == 1;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot flip byte " + std::to_string(offset) + " of " + path);
}

inline unsigned mode_of(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw std::runtime_error("cannot stat " + path);
  return st.st_mode & 07777;
}

/// Every path under `dir` (recursive), relative to it, sorted.
inline std::vector<std::string> tree(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    out.push_back(fs::relative(it->path(), dir).string());
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string manifest_path(const dvr::Store& store, const std::string& session, const std::string& snap) {
  return store.path() + "/sessions/" + session + "/" + snap + ".snap";
}

// Rewrites the manifest of session/name as format version 3 (no seq, no
// origin time): what a dvr before manifest v4 wrote.
inline void make_legacy_manifest(const dvr::Store& store, const std::string& session, const std::string& name) {
  const std::string file = manifest_path(store, session, name);
  std::string m = dvr::detail::read_file(file);
  std::uint32_t version = 0;
  std::memcpy(&version, m.data() + 8, 4);
  REQUIRE(version == 4);
  // Header 24, time 8, chunk size 4, region count 4, chunk count, logical,
  // stored, chunks read 8 each: seq and origin time follow at 72.
  m.erase(72, 16);
  version = 3;
  std::memcpy(m.data() + 8, &version, 4);
  const std::uint64_t body = m.size() - 16;
  std::memcpy(m.data() + 16, &body, 8);
  const std::uint64_t sum = dvr::detail::hash64(m.data(), body);
  std::memcpy(m.data() + body, &sum, 8);
  dvr::detail::write_file_atomic(store.path() + "/tmp", file, m);
}

/// The store's pack files (full paths), sorted.
inline std::vector<std::string> pack_files(const dvr::Store& store) {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(store.path() + "/packs"))
    if (e.path().extension() == ".pack") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// Path of pack file `id` of a store.
inline std::string pack_path(const dvr::Store& store, std::uint32_t id) {
  char name[32];
  std::snprintf(name, sizeof name, "/packs/%08u.pack", id);
  return store.path() + name;
}

/// Sum of the allocated sizes of the store's pack files.
inline std::uint64_t pack_allocated(const dvr::Store& store) {
  std::uint64_t n = 0;
  for (auto& p : pack_files(store)) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) n += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return n;
}

/// Why write-protect tracking is not in use in session `s` (for a skip message).
inline std::string no_write_protect_why(const dvr::Session& s) {
  std::string note = s.tracking_note();
  if (!note.empty()) return note;
  const char* env = std::getenv("DVR_TRACKING");
  return env && std::string(env) == "hash" ? "DVR_TRACKING=hash is set" : "hash tracking was asked for";
}

/// Private (copy-on-write or anonymous) memory of process `pid` (0: this
/// one), in bytes: RssAnon of /proc/PID/status; 0 when it cannot be read.
inline std::uint64_t rss_anon(pid_t pid = 0) {
  std::ifstream in(pid ? "/proc/" + std::to_string(pid) + "/status" : std::string("/proc/self/status"));
  std::string key;
  std::uint64_t kb = 0;
  while (in >> key) {
    if (key == "RssAnon:") {
      in >> kb;
      return kb * 1024;
    }
    in.ignore(1 << 10, '\n');
  }
  return 0;
}

/// Sends `ref` into `ch` on a thread of its own (level 0), which closes the
/// channel when done; its exception lands in `error`, and `done` is set last.
inline std::thread send_on_thread(const dvr::Store& store, const std::string& ref, dvr::transfer::Channel& ch, std::exception_ptr& error,
                                  std::atomic<bool>* done = nullptr) {
  return std::thread([&store, ref, &ch, &error, done] {
    try {
      dvr::transfer::send(store, ref, ch, {.level = 0});
    } catch (...) {
      error = std::current_exception();
    }
    ch.close();
    if (done) *done = true;
  });
}

/// A heap buffer deliberately misaligned by `skew` bytes from malloc's alignment.
class OddBuffer {
 public:
  OddBuffer(std::size_t size, std::size_t skew) : raw_(size + skew + 64), data_(raw_.data() + skew), size_(size) {}
  OddBuffer(const OddBuffer&) = delete;
  OddBuffer& operator=(const OddBuffer&) = delete;
  unsigned char* data() { return data_; }
  std::size_t size() const { return size_; }

 private:
  std::vector<unsigned char> raw_;
  unsigned char* data_;
  std::size_t size_;
};

}  // namespace dvrtest
