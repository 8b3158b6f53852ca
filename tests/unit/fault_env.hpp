// A fault-injecting Env (libdvr/src/base/env.hpp) that simulates power cuts.
//
// Installed in place of the real one, it forwards every call to the system
// and keeps, for every file and directory under one root (a store), what a
// sync made durable. cut(OUT) writes the directory as a power cut at that
// moment could leave it (the model, docs/durability.md):
//  - file data: a page (4 KiB) whose content differs from what the last sync
//    covering it (fsync, fdatasync, msync of a shared mapping, for its range)
//    saw is, independently per page, lost (the durable content), kept (the
//    current content) or torn (each 512-byte sector of it old or new). This
//    covers pwrite, pwritev, write, punched holes and stores into MAP_SHARED mappings
//    alike, since it compares contents rather than logging writes.
//  - a file's size not yet synced is either the durable or the current one.
//  - namespace operations (create, mkdir, rename, link, unlink, rmdir) are
//    kept when an fsync of a directory they touch followed them; of the
//    others, a random prefix in their order survives (a journaling file
//    system commits metadata in order). A file whose directory did not
//    survive is lost with it.
// The store is then opened from OUT with the real Env: the test needs no real
// power loss. Syncs are modelled and not passed on (nothing needs to reach
// the disk for the simulation), which keeps the tests fast. Calls on paths outside the root (and file descriptors of files
// outside it) are forwarded and not counted.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/env.hpp"

namespace dvrtest {

class PowerCutEnv : public dvr::detail::Env {
 public:
  /// Models everything under `root` (which must exist; what is in it now
  /// counts as durable). `seed` drives every random choice of cut().
  PowerCutEnv(std::string root, std::uint64_t seed);
  ~PowerCutEnv() override;
  PowerCutEnv(const PowerCutEnv&) = delete;
  PowerCutEnv& operator=(const PowerCutEnv&) = delete;

  /// Calls intercepted so far on files under the root.
  std::uint64_t calls() const;
  /// Called after each counted call with its number (from 1), under the
  /// Env's lock: when it returns a path, the power is cut there (cut()).
  /// Set while no store call is in flight.
  void on_call(std::function<std::string(std::uint64_t)> f);
  /// Writes the state a power cut now could leave under the root into the
  /// new directory `out` (the store goes on: the real files are untouched).
  void cut(const std::string& out);
  /// Counts for the test's report: syncs seen, cuts made, mapped ranges
  /// synced, msyncs of memory that no intercepted mmap mapped (must stay 0).
  struct Counters {
    std::uint64_t syncs = 0, dir_syncs = 0, msyncs = 0, unknown_msyncs = 0, cuts = 0, lost_ops = 0, torn_pages = 0, lost_pages = 0;
  };
  Counters counters() const;

  int open(const char* path, int flags, mode_t mode) override;
  ssize_t write(int fd, const void* data, std::size_t len) override;
  ssize_t pwrite(int fd, const void* data, std::size_t len, off_t offset) override;
  ssize_t pwritev(int fd, const struct iovec* iov, int count, off_t offset) override;
  int ftruncate(int fd, off_t length) override;
  int fallocate(int fd, int mode, off_t offset, off_t len) override;
  int posix_fallocate(int fd, off_t offset, off_t len) override;
  int fsync(int fd) override;
  int fdatasync(int fd) override;
  int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags) override;
  void* mmap(void* addr, std::size_t len, int prot, int flags, int fd, off_t offset) override;
  int munmap(void* addr, std::size_t len) override;
  int msync(void* addr, std::size_t len, int flags) override;
  int rename(const char* from, const char* to) override;
  int link(const char* from, const char* to) override;
  int unlink(const char* path) override;
  int mkdir(const char* path, mode_t mode) override;
  int rmdir(const char* path) override;

 private:
  using Page = std::string;  // kPage bytes
  struct Inode {
    int fd = -1;                            // read-only, kept open: the content stays readable after an unlink
    std::map<std::uint64_t, Page> durable;  // page number -> content; absent: zeros
    std::uint64_t durable_size = 0;
  };
  struct Op {
    enum Kind { create, mkdir, rename, link, unlink, rmdir } kind;
    std::string a, b;  // relative paths (b: rename/link target)
    std::uint64_t ino = 0;
    bool durable = false;
  };
  struct Map {
    std::uint64_t ino;
    std::uint64_t offset;
    std::size_t len;
  };

  // Path below the root ("" for the root itself), or false when outside.
  bool rel(const char* path, std::string* out) const;
  std::uint64_t ino_of_fd(int fd) const;  // 0: not ours
  Inode* track_fd(int fd);                // registers a file under the root
  void read_pages(int fd, std::uint64_t lo, std::uint64_t hi, std::map<std::uint64_t, Page>& out) const;
  void sync_range(Inode& n, std::uint64_t lo, std::uint64_t hi, bool whole);
  void sync_dir(const std::string& dir);
  void counted();
  void cut_locked(const std::string& out);
  std::string render(Inode& n, std::uint64_t ino, const std::string& out_file);

  std::string root_;
  std::mt19937_64 rng_;
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, Inode> inodes_;  // by inode number
  std::map<std::string, std::uint64_t> initial_files_;
  std::set<std::string> initial_dirs_;
  std::vector<Op> ops_;
  std::map<std::uintptr_t, Map> maps_;
  std::uint64_t calls_ = 0;
  std::function<std::string(std::uint64_t)> on_call_;
  Counters counters_;
};

/// Installs an Env for its lifetime, then the real one again.
class EnvScope {
 public:
  explicit EnvScope(dvr::detail::Env* e) : old_(dvr::detail::set_env(e)) {}
  ~EnvScope() { dvr::detail::set_env(old_); }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  dvr::detail::Env* old_;
};

}  // namespace dvrtest
