// dvr-bench — Memory DVR against the physical limit, measured in the same run.
//
//   dvr-bench [--size 1G] [--repeat 5] [--json] [--store DIR] [--disk-only]
//
// All memory is pre-faulted before timing. Each figure is printed next to
// memcpy of the same bytes between two pre-faulted buffers (the limit a copy
// cannot beat on one core), or next to another peer measured in the same run:
// the first snapshot into a new store next to pwrite of the same bytes into a
// new file on the store's file system; with a store on a disk file system,
// snapshots, restores and verify next to dd conv=fsync, dd reads and xxhsum
// of the same bytes there (the disk_* figures, docs/performance.md). With
// --json, one object per line:
//   {"name":..., "value":..., "unit":"s", "peer":"memcpy", "peer_value":...,
//    "ratio":...}   ratio = peer time / our time (above 1: faster than the peer)
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "cli_util.hpp"
#include "dvr/dvr.hpp"

using namespace dvr;
using namespace dvr::cli;

namespace {

struct Figure {
  std::string name;
  double value;
  double peer_value;
  std::string note;
  std::string peer = "memcpy";
  std::string tracking;    // for the 1% figures: the tracking mode measured
  std::string json_extra;  // more ",\"key\":value" fields for the JSON line
};

// What a run creates in /dev/shm is named dvr-bench.PID.WHAT.XXXXXX. A run
// removes what runs that are gone left there (killed by a timeout or a signal
// before they cleaned up): gigabytes of tmpfs files fill memory, and then
// every allocation of every later measurement pays for reclaim.
constexpr const char* kTempRoot = "/dev/shm";

std::string temp_template(const std::string& what) {
  return std::string(kTempRoot) + "/dvr-bench." + std::to_string(::getpid()) + "." + what + ".XXXXXX";
}

void remove_leftovers_of_gone_runs() {
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(kTempRoot, ec); !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "dvr-bench.%d.", &pid) != 1 || pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // that run is still there (or not ours to judge)
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || st.st_uid != ::geteuid() || !(S_ISDIR(st.st_mode) || S_ISREG(st.st_mode))) continue;
    std::fprintf(stderr, "dvr-bench: removing %s, left by run %d, which is gone\n", it->path().c_str(), pid);
    std::error_code rm;
    std::filesystem::remove_all(it->path(), rm);
  }
}

// Private (anonymous or copied-on-write) memory of this process, in bytes.
std::uint64_t rss_anon() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "RssAnon: %llu kB", &kb) == 1) break;
  std::fclose(f);
  return kb * 1024;
}

// Writes one byte in 1% of the pages, spread evenly (every 100th page, shifted
// by `round` so successive rounds hit different pages).
void dirty_one_percent(char* p, std::size_t n, int round) {
  for (std::size_t page = static_cast<std::size_t>(round) % 100; page * 4096 < n; page += 100)
    p[page * 4096 + 17] ^= 1;
}

char* prefaulted(std::size_t n) {
  void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  std::memset(p, 1, n);
  return static_cast<char*>(p);
}

// Non-repeating, non-zero content so that no chunk deduplicates.
void fill_unique(char* p, std::size_t n, std::uint64_t seed) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < n / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w[i] = x;
  }
}

// Changes one word in every page: every chunk becomes new to the store and is
// stored whole.
void touch_every_page(char* p, std::size_t n, std::uint64_t v) {
  for (std::size_t off = 0; off + 8 <= n; off += 4096)
    std::memcpy(p + off, &v, 8);
}

// A program that writes one byte in 1% of its pages (random ones) and then
// computes for about 8 ms, tick after tick, on its own thread: its speed is
// ticks per second. pause() stops it between ticks (to take the memory at a
// known moment).
class PacedWriter {
 public:
  PacedWriter(char* p, std::size_t n) : p_(p), n_(n) {
    // Calibrate the compute part of a tick to about 8 ms.
    double t0 = seconds_now();
    compute(1u << 22);
    iterations_ = static_cast<std::uint64_t>((1u << 22) * 0.008 / std::max(seconds_now() - t0, 1e-6));
    thread_ = std::thread([this] { run(); });
  }
  ~PacedWriter() {
    stop_ = true;
    thread_.join();
  }
  void pause() {
    pause_ = true;
    while (!paused_.load())
      std::this_thread::yield();
  }
  void resume() {
    paused_ = false;
    pause_ = false;
  }
  std::uint64_t ticks() const { return ticks_.load(); }

 private:
  std::uint64_t compute(std::uint64_t k) {
    std::uint64_t x = 88172645463325252ull;
    for (std::uint64_t i = 0; i < k; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
    sink_ += x;
    return x;
  }
  void run() {
    std::uint64_t x = 0x2545F4914F6CDD1Dull;
    const std::size_t pages = n_ / 4096;
    while (!stop_.load()) {
      if (pause_.load()) {
        paused_ = true;
        while (pause_.load() && !stop_.load())
          std::this_thread::yield();
        continue;
      }
      for (std::size_t k = 0; k < pages / 100; ++k) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p_[(x % pages) * 4096 + (x >> 52)] ^= 1;
      }
      compute(iterations_);
      ticks_.fetch_add(1);
    }
  }
  char* p_;
  std::size_t n_;
  std::uint64_t iterations_ = 0;
  std::atomic<bool> stop_{false}, pause_{false}, paused_{false};
  std::atomic<std::uint64_t> ticks_{0}, sink_{0};
  std::thread thread_;
};

// The writer's ticks per second over `seconds`.
double ticks_per_second(const PacedWriter& w, double seconds) {
  std::uint64_t k0 = w.ticks();
  double t0 = seconds_now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return static_cast<double>(w.ticks() - k0) / (seconds_now() - t0);
}

// Whether snapshot `name` of session `session` holds exactly `expect`.
bool snapshot_equals(Store& store, const std::string& session, const std::string& name, const char* expect, std::size_t n) {
  Clone c = store.open_snapshot(session, name);
  return std::memcmp(c.region("data").data(), expect, n) == 0;
}

// A new, empty file on the file system of directory `dir`: unnamed where the
// file system allows (O_TMPFILE), else named and unlinked at once.
int new_file_in(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  std::string path = dir + "/.dvr-bench-peer-XXXXXX";
  fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot create a file in " + dir + ": " + std::strerror(errno));
  ::unlink(path.c_str());
  return fd;
}

// The peer of a first snapshot: `n` bytes written with pwrite (1 MiB calls)
// into the new file `fd`, then fdatasync (what makes them durable; a no-op on
// tmpfs). Seconds.
double pwrite_peer(int fd, const char* data, std::size_t n) {
  constexpr std::size_t kCall = 1u << 20;
  double t0 = seconds_now();
  for (std::size_t off = 0; off < n;) {
    ssize_t w = ::pwrite(fd, data + off, std::min(kCall, n - off), static_cast<off_t>(off));
    if (w <= 0) throw std::runtime_error(std::string("pwrite peer: ") + std::strerror(w < 0 ? errno : ENOSPC));
    off += static_cast<std::size_t>(w);
  }
  if (::fdatasync(fd) != 0) throw std::runtime_error(std::string("pwrite peer: fdatasync: ") + std::strerror(errno));
  return seconds_now() - t0;
}

// Runs `args` (stdout and stderr to /dev/null unless `out` is given, which
// gets stdout); seconds from fork to exit. Throws when it fails.
double run_timed(const std::vector<std::string>& args, std::string* out = nullptr) {
  int pipefd[2] = {-1, -1};
  if (out && ::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe: " + std::string(std::strerror(errno)));
  std::vector<char*> argv;
  for (auto& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  double t0 = seconds_now();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    int null = ::open("/dev/null", O_WRONLY);
    ::dup2(out ? pipefd[1] : null, 1);
    ::dup2(null, 2);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  if (out) {
    ::close(pipefd[1]);
    char buf[4096];
    ssize_t r;
    while ((r = ::read(pipefd[0], buf, sizeof buf)) > 0)
      out->append(buf, static_cast<std::size_t>(r));
    ::close(pipefd[0]);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  double t = seconds_now() - t0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error(args[0] + " failed (status " + std::to_string(status) + ")");
  return t;
}

// Drops the page cache of every regular file under `path` (clean pages only:
// the files were synced), so that the next read comes from the device.
void drop_cache(const std::string& path) {
  std::error_code ec;
  auto drop = [](const std::filesystem::path& p) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  if (std::filesystem::is_regular_file(path, ec)) {
    drop(path);
    return;
  }
  for (auto& e : std::filesystem::recursive_directory_iterator(path, ec))
    if (e.is_regular_file(ec)) drop(e.path());
}

// The files under `dir` whose names end in `suffix`, sorted.
std::vector<std::string> files_ending(const std::string& dir, const std::string& suffix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::string p = e.path().string();
    if (p.size() >= suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

template <class F>
double best_of(int repeat, F&& f) {
  double best = 1e30;
  for (int i = 0; i < repeat; ++i) {
    double t0 = seconds_now();
    f(i);
    best = std::min(best, seconds_now() - t0);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t size = 1ull << 30;
  int repeat = 5;
  bool json = false;
  std::string store_dir;
  std::uint32_t chunk_size = StoreOptions{}.chunk_size;
  std::uint64_t background_large = 0;
  bool disk_only = false;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--size")
        size = parse_size(value());
      else if (a == "--repeat")
        repeat = std::max(1, std::stoi(value()));
      else if (a == "--json")
        json = true;
      else if (a == "--store")
        store_dir = value();
      else if (a == "--chunk-size")
        chunk_size = static_cast<std::uint32_t>(parse_size(value()));
      else if (a == "--disk-only")
        disk_only = true;
      else if (a == "--background-large")
        background_large = parse_size(value());
      else if (a == "-h" || a == "--help") {
        std::cout << "usage: dvr-bench [--size 1G] [--repeat 5] [--json] [--store DIR] [--chunk-size 256K] [--background-large 8G] [--disk-only]\n"
                     "  --store DIR              the store to measure (default: a new one in /dev/shm); on a disk file system the\n"
                     "                           figures disk_* compare it with dd and xxhsum of the same bytes on that file system\n"
                     "  --background-large SIZE  also measure the caller's stall of a background snapshot of SIZE\n"
                     "  --disk-only              only the full snapshot, restore and the disk_* figures\n";
        return 0;
      } else
        throw std::invalid_argument("unknown argument '" + a + "'");
    }
  } catch (const std::exception& e) {
    std::cerr << "dvr-bench: " << e.what() << "\n";
    return 2;
  }

  remove_leftovers_of_gone_runs();
  bool own_store = store_dir.empty();
  if (own_store) {
    std::string tmpl = temp_template("store");
    if (!::mkdtemp(tmpl.data())) {
      std::perror("dvr-bench: mkdtemp");
      return 1;
    }
    store_dir = tmpl;
  }
  std::vector<Figure> figures;
  int status = 0;
  try {
    Store store = Store::open(store_dir, StoreOptions{.chunk_size = chunk_size});
    // What an earlier run left in a store of the caller's (its sessions only).
    for (const char* own : {"bench", "bench-hash", "bench-large"})
      for (auto& info : store.list(own))
        store.remove(own, info.name);
    const std::size_t n = size;
    char* data = prefaulted(n);
    char* scratch = prefaulted(n);
    fill_unique(data, n, 42);

    // The limit: memcpy of the same bytes between pre-faulted buffers.
    double memcpy_s = best_of(repeat, [&](int) { std::memcpy(scratch, data, n); });
    if (std::memcmp(scratch, data, n) != 0) throw std::runtime_error("memcpy check failed");

    Session s(store, "bench");
    s.track("data", data, n);

    // Full snapshots: every chunk gets new content first, so nothing dedups.
    // Like an autosave with retention, each round removes the previous
    // snapshot; the store reuses that space for the next one (no gc between).
    // Round 0 writes into a new store: its pages are allocated on first touch,
    // which this VM makes slow, so it is reported on its own ("cold").
    // Its peer: pwrite of the same bytes into a new file beside the store (the
    // same file system), just before. The file is kept until the snapshot is
    // taken, so that neither writes into memory the other just freed.
    std::string last;
    double cold_s = 0, snap_s = 1e30;
    touch_every_page(data, n, 0xABCDEF00ull);
    dvrbench::let_kernel_read(kTempRoot, data, n);
    int peer_fd = new_file_in(store_dir);
    const double pwrite_s = pwrite_peer(peer_fd, data, n);
    // Two rounds more than needed: space written with pwrite in the first
    // rounds is mapped (populated) at its first reuse, so the steady state
    // starts with the fifth round.
    const int rounds = std::max(repeat, 4) + 2;
    for (int i = 0; i < rounds; ++i) {
      touch_every_page(data, n, 0xABCDEF00ull + static_cast<std::uint64_t>(i));
      last = "full-" + std::to_string(i);
      double t0 = seconds_now();
      SnapshotInfo info = s.snapshot(last);
      double t = seconds_now() - t0;
      if (info.stored_bytes < n) throw std::runtime_error("full snapshot deduplicated unexpectedly");
      if (i == 0) {
        cold_s = t;
        ::close(peer_fd);
      } else {
        snap_s = std::min(snap_s, t);
      }
      if (i > 0) store.remove("bench", "full-" + std::to_string(i - 1));
    }
    figures.push_back({"snapshot_full", snap_s, memcpy_s, "all chunks new, into reused store space: hash + NT copy + persist + commit"});
    figures.push_back({"pwrite_new_file", pwrite_s, memcpy_s, "pwrite (1 MiB calls) + fdatasync of the same bytes into a new file on the store's file system"});
    figures.push_back({"snapshot_full_cold", cold_s, pwrite_s,
                       "all chunks new, into a new store (new pack space on the file system); " + json_number(memcpy_s / cold_s) + "x memcpy",
                       "pwrite_new_file", "", ",\"memcpy_ratio\":" + json_number(memcpy_s / cold_s)});

    // A first snapshot of memory the kernel has never read (a program's
    // freshly computed data) into a new store beside this one, against pwrite
    // of other such memory, filled the same way, into a new file on the same
    // file system. On these VMs the kernel's first read of a page costs more
    // than the copy; the store copies caller memory through a small buffer
    // of its own first (docs/performance.md, "Writing new space").
    {
      char* fresh_peer = prefaulted(n);
      char* fresh_ours = prefaulted(n);
      fill_unique(fresh_peer, n, 7);
      fill_unique(fresh_ours, n, 8);
      int fd = new_file_in(store_dir);
      const double peer_s = pwrite_peer(fd, fresh_peer, n);
      ::close(fd);
      std::string beside = own_store ? temp_template("fresh") : store_dir + ".dvr-bench-fresh.XXXXXX";
      if (!::mkdtemp(beside.data())) throw std::runtime_error("cannot create " + beside + ": " + std::strerror(errno));
      double fresh_s = 0;
      try {
        Store fs = Store::open(beside, StoreOptions{.chunk_size = chunk_size});
        Session f(fs, "bench-fresh");
        f.track("data", fresh_ours, n);
        double t0 = seconds_now();
        f.snapshot("fresh");
        fresh_s = seconds_now() - t0;
      } catch (...) {
        std::filesystem::remove_all(beside);
        throw;
      }
      std::filesystem::remove_all(beside);
      ::munmap(fresh_peer, n);
      ::munmap(fresh_ours, n);
      figures.push_back({"pwrite_fresh_memory", peer_s, memcpy_s,
                         "pwrite (1 MiB calls) + fdatasync of memory the kernel has not read before, into a new file on the store's file system"});
      figures.push_back({"snapshot_first_fresh", fresh_s, peer_s, "all chunks new, from memory the kernel has not read before, into a new store", "pwrite_fresh_memory"});
    }

    double t0 = seconds_now();
    SnapshotInfo same = s.snapshot("unchanged");
    double dedup_s = seconds_now() - t0;
    figures.push_back({"snapshot_unchanged", dedup_s, memcpy_s, "same data again: " + std::to_string(same.stored_bytes) + " bytes added"});

    std::memcpy(scratch, data, n);  // expected content of `last`

    double restore_s = 1e30;
    for (int i = 0; i < repeat; ++i) {
      fill_unique(data, n, 1000 + static_cast<std::uint64_t>(i));  // ruin the live data
      double t = seconds_now();
      s.restore(last);
      restore_s = std::min(restore_s, seconds_now() - t);
      if (std::memcmp(scratch, data, n) != 0) throw std::runtime_error("restore was not bit-exact");
    }
    figures.push_back({"restore_full", restore_s, memcpy_s, "verify every chunk's hash, then non-temporal copy back"});

    // 1% of the pages written, scattered: an incremental snapshot, then a
    // rollback to it after another 1% was written. Peers: the full snapshot and
    // the full restore above. Measured with write-protect tracking (when the
    // kernel allows it) and with tracking off (hash).
    const std::string wp_mode = tracking_name(s.tracking("data"));
    double first_inc_s = 0;  // snapshot_1pct of the first mode measured, the peer of snapshot_1pct_after_100
    for (Tracking mode : disk_only ? std::vector<Tracking>{} : std::vector<Tracking>{Tracking::write_protect, Tracking::hash}) {
      std::optional<Session> hashed;
      if (mode == Tracking::hash) {
        hashed.emplace(store, "bench-hash", SessionOptions{.tracking = Tracking::hash});
        hashed->track("data", data, n);
      }
      Session& t = mode == Tracking::hash ? *hashed : s;
      const std::string label = mode == Tracking::hash ? "hash" : wp_mode;
      if (mode == Tracking::write_protect && wp_mode != "write_protect") continue;  // same as hash; reported below
      t.snapshot("inc-base", {.replace = true});
      double inc_s = 1e30, back_s = 1e30;
      std::uint64_t read = 0, added = 0;
      for (int i = 0; i < repeat; ++i) {
        dirty_one_percent(data, n, 2 * i);
        std::string name = "inc-" + std::to_string(i);
        double t0 = seconds_now();
        SnapshotInfo info = t.snapshot(name, {.replace = true});
        inc_s = std::min(inc_s, seconds_now() - t0);
        read = info.chunks_read;
        added = info.stored_bytes;
        std::memcpy(scratch, data, n);
        dirty_one_percent(data, n, 2 * i + 1);
        t0 = seconds_now();
        t.restore(name);
        back_s = std::min(back_s, seconds_now() - t0);
        if (std::memcmp(scratch, data, n) != 0) throw std::runtime_error("rollback was not bit-exact");
      }
      figures.push_back(
          {"snapshot_1pct_" + label, inc_s, snap_s,
           std::to_string(read) + " of " + std::to_string(n / store.chunk_size()) + " chunks read, " + std::to_string(added / 4096) + " pages stored",
           "snapshot_full", label, ",\"stored_bytes\":" + std::to_string(added) + ",\"chunks_read\":" + std::to_string(read)});
      figures.push_back({"restore_1pct_" + label, back_s, restore_s, "rollback after 1% of pages were written", "restore_full", label});
      if (first_inc_s == 0) first_inc_s = inc_s;
    }

    // A long history (a notebook after 100 cells): the same 1% snapshot with
    // 100 earlier 1% snapshots kept. Finding space for new data must not cost
    // more as the store fills. Peer: the snapshot_1pct above, taken while the
    // session held a handful of snapshots.
    if (!disk_only) {
      constexpr int kKept = 100;
      std::vector<std::string> taken;
      for (int i = 0; i < kKept; ++i) {
        dirty_one_percent(data, n, 1000 + i);
        taken.push_back("hist-" + std::to_string(i));
        s.snapshot(taken.back());
      }
      double deep_s = 1e30;
      for (int i = 0; i < repeat; ++i) {
        dirty_one_percent(data, n, 2000 + i);
        taken.push_back("deep-" + std::to_string(i));
        double t0 = seconds_now();
        s.snapshot(taken.back());
        deep_s = std::min(deep_s, seconds_now() - t0);
      }
      figures.push_back({"snapshot_1pct_after_100", deep_s, first_inc_s,
                         "1% of pages written, with 100 earlier 1% snapshots kept", "snapshot_1pct_" + wp_mode, wp_mode});
      for (auto& name : taken)
        store.remove("bench", name);
    }

    // A thin clone of the last full snapshot: time to open it (no checksum
    // pass), and the private memory it costs after reading everything and
    // writing 1% of its pages. Peer: the full restore (the copy it avoids).
    if (!disk_only) {
      std::uint64_t anon0 = rss_anon();
      double t0 = seconds_now();
      Clone c = s.clone(last, {.verify = false});
      double open_s = seconds_now() - t0;
      auto* p = static_cast<volatile char*>(c.region("data").data());
      std::uint64_t sum = 0;
      for (std::size_t off = 0; off < n; off += 4096)
        sum += static_cast<unsigned char>(p[off]);
      (void)sum;  // the reads above go through a volatile pointer: they happen
      dirty_one_percent(const_cast<char*>(p), n, 0);
      double grown = static_cast<double>(rss_anon() - anon0);
      figures.push_back({"clone_open", open_s, restore_s,
                         "then read all, write 1% of pages: private memory +" + format_bytes(grown) + " (" +
                             json_number(100.0 * grown / static_cast<double>(n)) + "% of the snapshot)",
                         "restore_full", "",
                         ",\"private_growth_bytes\":" + std::to_string(static_cast<std::uint64_t>(grown)) +
                             ",\"private_growth_fraction\":" + json_number(grown / static_cast<double>(n))});
    }

    // Background snapshots (Session::snapshot_background) of all-new data:
    // the caller's stall, the total time and the speed of a program writing
    // 1% of its pages per tick meanwhile. Peers: the blocking full snapshot
    // of the same bytes above, and the program's own speed just before.
    if (!disk_only) {
      auto full_round = [&](const std::string& name, std::uint64_t seed) {
        touch_every_page(data, n, seed);
        std::memcpy(scratch, data, n);  // the memory at the call
        double t0 = seconds_now();
        SnapshotJob job = s.snapshot_background(name);
        if (!job.background()) throw std::runtime_error("background snapshot taken at once: " + job.note());
        job.wait();
        double total = seconds_now() - t0;
        if (!snapshot_equals(store, "bench", name, scratch, n)) throw std::runtime_error("background snapshot was not bit-exact");
        return std::make_pair(job.stall_seconds(), total);
      };
      std::string prev = last;
      double stall_s = 1e30, total_s = 1e30;
      // Two more rounds, as for snapshot_full: the steady state of reused space.
      for (int i = 0; i < repeat + 2; ++i) {
        std::string name = "bg-" + std::to_string(i);
        auto [st, tt] = full_round(name, 0xB0000000ull + static_cast<std::uint64_t>(i));
        stall_s = std::min(stall_s, st);
        total_s = std::min(total_s, tt);
        store.remove("bench", prev);
        prev = name;
      }
      figures.push_back({"background_stall", stall_s, snap_s, "caller blocked while every region is write-protected (target <= 5 ms at 1 GiB)",
                         "snapshot_full"});
      figures.push_back({"background_total", total_s, snap_s, "call to published, bit-exact (target: ratio >= 0.67, i.e. <= 1.5x)",
                         "snapshot_full"});

      // A program writing 1% of its pages per ~10 ms tick, while a background
      // snapshot runs; the snapshot is checked against the memory at the call.
      touch_every_page(data, n, 0xC0000000ull);
      PacedWriter writer(data, n);
      double own = ticks_per_second(writer, 1.0);
      writer.pause();
      std::memcpy(scratch, data, n);
      std::uint64_t k0 = writer.ticks();
      double t0 = seconds_now();
      SnapshotJob job = s.snapshot_background("bg-writer");
      writer.resume();
      job.wait();
      double snapshot_s = seconds_now() - t0;
      // A small snapshot can end before the writer's first tick does (64 MiB:
      // about 20 ms against a tick slowed past that by the snapshot's
      // threads): the window then runs on to the end of that tick, so the
      // figure is the time of the ticks that overlapped the snapshot, never a
      // division by zero ticks.
      for (double limit = seconds_now() + 30; writer.ticks() == k0 && seconds_now() < limit;)
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      double during_s = seconds_now() - t0;
      if (writer.ticks() == k0) throw std::runtime_error("the paced writer finished no tick in 30 s after the background snapshot");
      double during = static_cast<double>(writer.ticks() - k0) / during_s;
      std::uint64_t aside = job.bytes_copied_aside();
      if (!snapshot_equals(store, "bench", "bg-writer", scratch, n)) throw std::runtime_error("background snapshot under a writer was not bit-exact");
      store.remove("bench", prev);
      figures.push_back({"background_writer_speed", 1.0 / during, 1.0 / own,
                         "seconds per tick of a program writing 1% of its pages per tick (~10 ms) while the snapshot runs (" + json_number(snapshot_s) +
                             " s; ticks counted over " + json_number(during_s) + " s, " + std::to_string(aside) + " bytes copied aside first); peer: the same program just before; bit-exact (target: ratio >= 0.8)",
                         "own_speed", "", ",\"bytes_copied_aside\":" + std::to_string(aside) + ",\"exact\":true"});
    }
    if (background_large && !disk_only) {
      // The stall at a larger size, in a session of its own.
      char* big = prefaulted(background_large);
      fill_unique(big, background_large, 77);
      Session l(store, "bench-large");
      l.track("data", big, background_large);
      double t0 = seconds_now();
      l.snapshot("blocking");
      double blocking_s = seconds_now() - t0;
      store.remove("bench-large", "blocking");  // room for the next one
      touch_every_page(big, background_large, 78);
      SnapshotJob job = l.snapshot_background("bg");
      if (!job.background()) throw std::runtime_error("background snapshot taken at once: " + job.note());
      job.wait();
      figures.push_back({"background_stall_" + format_bytes(static_cast<double>(background_large)), job.stall_seconds(), blocking_s,
                         "caller blocked, " + json_number(job.stall_seconds() * 1e3 / (static_cast<double>(background_large) / (1u << 30))) +
                             " ms per GiB (target <= 1 ms per GiB at 8 GiB); peer: a blocking first snapshot of it",
                         "snapshot_first", "", ",\"region_bytes\":" + std::to_string(background_large)});
      store.remove("bench-large", "bg");
      ::munmap(big, background_large);
    }

    if (store.medium() == Medium::disk) {
      // A disk store against the tools that move the same bytes through the
      // same file system, measured alternately in this run (docs/performance.md,
      // "Disk stores"):
      //   snapshot into new space   vs dd bs=4M conv=fsync into a new file
      //   snapshot into reused space vs the same dd over an existing file (notrunc)
      //   restore (cold, hot)        vs dd reading that file to /dev/null
      //   verify (cold, hot)         vs xxhsum -H2 of the packs
      // "cold": the files' pages dropped from the page cache first, so every
      // byte comes from the device. The source of dd is a tmpfs copy of the bytes.
      char* disk = prefaulted(n);
      std::memcpy(disk, data, n);
      touch_every_page(disk, n, 0xD15C0000ull);
      std::memcpy(scratch, disk, n);
      std::string src = temp_template("src");
      int src_fd = ::mkostemp(src.data(), O_CLOEXEC);
      if (src_fd < 0) throw std::runtime_error("cannot create a tmpfs file for dd's input");
      struct Cleanup {
        std::vector<std::string> paths;
        ~Cleanup() {
          std::error_code ec;
          for (auto& p : paths)
            std::filesystem::remove_all(p, ec);
        }
      } cleanup;
      cleanup.paths.push_back(src);
      (void)pwrite_peer(src_fd, disk, n);
      ::close(src_fd);
      const std::string dd_file = store_dir + "/.dvr-bench-dd";
      cleanup.paths.push_back(dd_file);
      const std::string bs = "bs=4M";
      double dd_new_s = 1e30, new_s = 1e30, dd_over_s = 1e30;
      std::optional<Store> fresh;
      std::optional<Session> fs;
      std::string fresh_dir;
      for (int i = 0; i < repeat; ++i) {
        ::unlink(dd_file.c_str());
        ::sync();
        dd_new_s = std::min(dd_new_s, run_timed({"dd", "if=" + src, "of=" + dd_file, bs, "conv=fsync", "status=none"}));
        fs.reset();
        fresh.reset();
        if (!fresh_dir.empty()) std::filesystem::remove_all(fresh_dir);
        fresh_dir = store_dir + "/.dvr-bench-new-" + std::to_string(i);
        cleanup.paths.push_back(fresh_dir);
        ::sync();
        fresh.emplace(Store::open(fresh_dir, StoreOptions{.chunk_size = chunk_size}));
        fs.emplace(*fresh, "disk");
        fs->track("data", disk, n);
        double t0 = seconds_now();
        fs->snapshot("full");
        new_s = std::min(new_s, seconds_now() - t0);
        ::sync();
        dd_over_s = std::min(dd_over_s, run_timed({"dd", "if=" + src, "of=" + dd_file, bs, "conv=fsync,notrunc", "status=none"}));
      }
      figures.push_back({"disk_snapshot_new", new_s, dd_new_s, "full snapshot into a new store on this file system (target: ratio >= 0.9)", "dd_fsync_new"});
      figures.push_back({"dd_fsync_new", dd_new_s, memcpy_s, "dd bs=4M conv=fsync of the same bytes (from tmpfs) into a new file"});
      figures.push_back({"disk_snapshot_reused", snap_s, dd_over_s, "snapshot_full above: into reused store space (target: ratio >= 0.9)",
                         "dd_fsync_over"});
      figures.push_back({"dd_fsync_over", dd_over_s, memcpy_s, "the same dd over the existing file (conv=fsync,notrunc)"});

      // Cold: as a new process would find it. The store is closed first (pages
      // a process has mapped stay in the page cache), then opened again.
      auto close_and_drop = [&](bool drop) {
        fs.reset();
        fresh.reset();
        if (drop) drop_cache(fresh_dir);
      };
      auto reopen = [&](bool drop) {
        close_and_drop(drop);
        fresh.emplace(Store::open(fresh_dir));
        fs.emplace(*fresh, "disk");
        fs->track("data", disk, n);
      };
      double restore_cold = 1e30, dd_cold = 1e30, restore_hot = 1e30, dd_hot = 1e30;
      for (int i = 0; i < repeat; ++i) {
        for (bool cold : {true, false}) {
          fill_unique(disk, n, 500 + static_cast<std::uint64_t>(i));  // ruin the live data
          reopen(cold);
          double t0 = seconds_now();
          fs->restore("full");
          double t = seconds_now() - t0;
          if (std::memcmp(scratch, disk, n) != 0) throw std::runtime_error("restore from the disk store was not bit-exact");
          double& best = cold ? restore_cold : restore_hot;
          best = std::min(best, t);
          if (cold) drop_cache(dd_file);
          double d = run_timed({"dd", "if=" + dd_file, "of=/dev/null", bs, "status=none"});
          double& dd_best = cold ? dd_cold : dd_hot;
          dd_best = std::min(dd_best, d);
        }
      }
      figures.push_back({"disk_restore_cold", restore_cold, dd_cold, "full restore, pack pages dropped from the page cache first (target: ratio >= 0.9)",
                         "dd_read_cold"});
      figures.push_back({"dd_read_cold", dd_cold, memcpy_s, "dd bs=4M of the same bytes in one file to /dev/null, its pages dropped first"});
      figures.push_back({"disk_restore_hot", restore_hot, dd_hot, "full restore, packs in the page cache", "dd_read_hot"});
      figures.push_back({"dd_read_hot", dd_hot, memcpy_s, "the same dd with the file in the page cache"});

      std::vector<std::string> xxh{"xxhsum", "-H2"};
      for (auto& f : files_ending(fresh_dir + "/packs", ".pack"))
        xxh.push_back(f);
      std::uint64_t pack_bytes = 0;
      for (std::size_t k = 2; k < xxh.size(); ++k)
        pack_bytes += std::filesystem::file_size(xxh[k]);
      double verify_cold = 1e30, xxh_cold = 1e30, verify_hot = 1e30, xxh_hot = 1e30;
      bool have_xxhsum = ::access("/usr/bin/xxhsum", X_OK) == 0;
      for (int i = 0; i < repeat; ++i) {
        for (bool cold : {true, false}) {
          reopen(cold);
          double t0 = seconds_now();
          VerifyReport report = fresh->verify();
          double t = seconds_now() - t0;
          if (!report.problems.empty()) throw std::runtime_error("verify of the disk store found problems");
          double& best = cold ? verify_cold : verify_hot;
          best = std::min(best, t);
          if (!have_xxhsum) continue;
          if (cold) close_and_drop(true);
          double x = run_timed(xxh);
          double& xxh_best = cold ? xxh_cold : xxh_hot;
          xxh_best = std::min(xxh_best, x);
        }
      }
      const std::string packs_note = " (" + format_bytes(static_cast<double>(pack_bytes)) + " of pack files)";
      if (have_xxhsum) {
        figures.push_back({"disk_verify_cold", verify_cold, xxh_cold,
                           "verify every chunk, packs dropped from the page cache first (target: ratio >= 0.8)", "xxhsum_cold"});
        figures.push_back({"xxhsum_cold", xxh_cold, memcpy_s, "xxhsum -H2 (XXH128) of the store's pack files, dropped first" + packs_note});
        figures.push_back({"disk_verify_hot", verify_hot, xxh_hot, "verify every chunk, packs in the page cache", "xxhsum_hot"});
        figures.push_back({"xxhsum_hot", xxh_hot, memcpy_s, "the same xxhsum with the packs in the page cache" + packs_note});
      } else {
        // No peer to time: the verify figures stand next to memcpy, and no
        // xxhsum figure is printed rather than one of 0 s.
        std::cerr << "dvr-bench: xxhsum not found (Debian package xxhash): disk_verify_* are compared with memcpy, "
                     "not with xxhsum; `bash install-deps.sh` installs it\n";
        figures.push_back({"disk_verify_cold", verify_cold, memcpy_s,
                           "verify every chunk, packs dropped from the page cache first (xxhsum missing: its target needs it)"});
        figures.push_back({"disk_verify_hot", verify_hot, memcpy_s, "verify every chunk, packs in the page cache (xxhsum missing)"});
      }
      fs.reset();
      fresh.reset();
      ::munmap(disk, n);
    }

    if (json) {
      std::cout << "{\"name\":\"memcpy\",\"value\":" << json_number(memcpy_s)
                << ",\"unit\":\"s\",\"peer\":\"memcpy\",\"peer_value\":" << json_number(memcpy_s) << ",\"ratio\":1,\"bytes\":" << n
                << ",\"medium\":\"" << medium_name(store.medium()) << "\"}\n";
      for (auto& f : figures)
        std::cout << "{\"name\":" << json_string(f.name) << ",\"value\":" << json_number(f.value)
                  << ",\"unit\":\"s\",\"peer\":" << json_string(f.peer) << ",\"peer_value\":" << json_number(f.peer_value)
                  << ",\"ratio\":" << json_number(f.peer_value / f.value) << ",\"bytes\":" << n
                  << (f.tracking.empty() ? std::string() : ",\"tracking\":" + json_string(f.tracking)) << f.json_extra << "}\n";
    } else {
      std::printf("dvr-bench: %s of pre-faulted memory, store %s (%s), best of %d\n\n", format_bytes(static_cast<double>(n)).c_str(),
                  store.path().c_str(), medium_name(store.medium()), repeat);
      std::printf("  tracking: %s%s\n\n", wp_mode.c_str(), s.tracking_note().empty() ? "" : (" (" + s.tracking_note() + ")").c_str());
      std::printf("  %-28s %10s %10s   %s\n", "figure", "time", "GB/s", "ratio to peer (peer time / ours)");
      std::printf("  %-28s %10s %10.2f   1.00x memcpy (the limit)\n", "memcpy", format_seconds(memcpy_s).c_str(),
                  static_cast<double>(n) / memcpy_s / 1e9);
      for (auto& f : figures)
        std::printf("  %-28s %10s %10.2f   %6.2fx %-14s %s\n", f.name.c_str(), format_seconds(f.value).c_str(),
                    static_cast<double>(n) / f.value / 1e9, f.peer_value / f.value, f.peer.c_str(), f.note.c_str());
    }
  } catch (const std::exception& e) {
    std::cerr << "dvr-bench: " << e.what() << "\n";
    status = 1;
  }
  if (own_store) std::filesystem::remove_all(store_dir);
  return status;
}
