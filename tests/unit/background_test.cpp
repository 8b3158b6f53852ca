// Background snapshots (Session::snapshot_background): exact under writers
// running alongside, then incremental snapshots and restores that see the
// writes made meanwhile; cancellation, a full store, a crash in the middle,
// and the cases taken at once.
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::SnapshotJob;
using dvr::Store;
using dvrtest::Caught;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;

namespace {

// Page-aligned private memory, unmapped at the end.
struct Pages {
  explicit Pages(std::size_t n) : size(n), p(static_cast<unsigned char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0))) {
    if (p == MAP_FAILED) throw std::runtime_error("mmap");
  }
  ~Pages() { ::munmap(p, size); }
  std::size_t size;
  unsigned char* p;
};

// Threads writing random bytes at random places of [p, p+n) until stopped.
struct Hammer {
  Hammer(unsigned char* p, std::size_t n, int threads) {
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([this, p, n, t] {
        std::uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(t + 1);
        while (!stop.load(std::memory_order_relaxed)) {
          x ^= x << 13;
          x ^= x >> 7;
          x ^= x << 17;
          std::size_t at = static_cast<std::size_t>(x % n);
          p[at] = static_cast<unsigned char>(x >> 56);
          writes.fetch_add(1, std::memory_order_relaxed);
        }
      });
    // Started: at least one write landed (on a loaded machine the threads
    // could otherwise get no CPU before the snapshot ends, writing nothing).
    for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
         writes.load() == 0 && std::chrono::steady_clock::now() < deadline;)
      std::this_thread::yield();
  }
  ~Hammer() { finish(); }
  void finish() {
    stop = true;
    for (auto& w : workers)
      if (w.joinable()) w.join();
  }
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> writes{0};
  std::vector<std::thread> workers;
};

// A background job that really ran in the background, or why not (then the
// test is skipped: this kernel or these privileges do not allow it).
#define REQUIRE_BACKGROUND(job)                                                             \
  do {                                                                                      \
    if (!(job).background() && (job).note().find("userfaultfd") != std::string::npos) {     \
      (job).wait();                                                                         \
      DVR_SKIP("background snapshots unavailable here: " << (job).note());                  \
    }                                                                                       \
    REQUIRE((job).background());                                                            \
  } while (0)

}  // namespace

TEST_CASE("background: the snapshot is the memory at the call while threads write all over it", "[background]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "bg");
  auto& a = s.alloc("a", 48u << 20);
  // A caller-owned region that starts and ends inside pages.
  std::vector<unsigned char> backing((6u << 20) + 8192);
  unsigned char* b = backing.data() + 4096 - (reinterpret_cast<std::uintptr_t>(backing.data()) % 4096) + 16;
  const std::size_t b_size = (6u << 20) + 100;
  s.track("b", b, b_size);
  dvrtest::fill_random(a.data(), a.size(), 1);
  dvrtest::fill_random(b, b_size, 2);
  std::vector<unsigned char> a0(a.as<unsigned char>().begin(), a.as<unsigned char>().end()), b0(b, b + b_size);
  const unsigned char before_b = b[-1], after_b = b[b_size];

  SnapshotJob job = s.snapshot_background("first", {.label = "under fire"});
  REQUIRE_BACKGROUND(job);
  std::uint64_t copied = 0;
  {
    Hammer ha(static_cast<unsigned char*>(a.data()), a.size(), 1), hb(b, b_size, 1);
    dvr::SnapshotInfo info = job.wait();
    ha.finish();
    hb.finish();
    CHECK(info.name == "first");
    CHECK(info.label == "under fire");
    CHECK(info.logical_bytes == a.size() + b_size);
    CHECK(ha.writes.load() > 0);
    copied = job.bytes_copied_aside();
  }
  INFO("bytes copied aside: " << copied << ", stall " << job.stall_seconds() << " s");
  CHECK(job.done());
  auto p = job.progress();
  CHECK(p.finished);
  CHECK(p.bytes_total == a.size() + b_size);
  CHECK(p.bytes_done == p.bytes_total);
  CHECK(s.head() == "first");
  CHECK(store.verify().ok());

  // What the hammers wrote meanwhile is part of the next snapshot.
  std::vector<unsigned char> a1(a.as<unsigned char>().begin(), a.as<unsigned char>().end()), b1(b, b + b_size);
  s.snapshot("second");
  dvrtest::fill_random(a.data(), a.size(), 3);
  dvrtest::fill_random(b, b_size, 4);
  s.restore("first");
  CHECK(diff(a.data(), a0.data(), a.size()) == "");
  CHECK(diff(b, b0.data(), b_size) == "");
  s.restore("second");
  CHECK(diff(a.data(), a1.data(), a.size()) == "");
  CHECK(diff(b, b1.data(), b_size) == "");
  // Nothing outside the tracked bytes was written.
  CHECK(b[-1] == before_b);
  CHECK(b[b_size] == after_b);
  // A clone sees the first snapshot too.
  dvr::Clone c = store.open_snapshot("bg", "first");
  CHECK(diff(c.region("a").data(), a0.data(), a.size()) == "");
}

TEST_CASE("background: writes after a background snapshot are tracked for the next incremental one and for restore", "[background]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "inc");
  auto& a = s.alloc("a", 32u << 20);
  auto* bytes = static_cast<unsigned char*>(a.data());
  dvrtest::fill_random(bytes, a.size(), 10);
  s.snapshot("base");
  // Rewrite more than a quarter: the next one runs in the background.
  dvrtest::fill_random(bytes, a.size() / 2, 11);
  std::vector<unsigned char> at_call(bytes, bytes + a.size());
  SnapshotJob job = s.snapshot_background("half");
  REQUIRE_BACKGROUND(job);
  // Scattered writes while it runs, and after it is done.
  for (std::size_t off = 4096 * 3 + 5; off < a.size(); off += 4096 * 37)
    bytes[off] ^= 0x5A;
  job.wait();
  for (std::size_t off = 4096 * 11 + 9; off < a.size(); off += 4096 * 53)
    bytes[off] ^= 0xA5;
  std::vector<unsigned char> later(bytes, bytes + a.size());
  dvr::SnapshotInfo third = s.snapshot("later");
  CHECK(third.tracking == "write_protect");
  dvrtest::fill_random(bytes, a.size(), 12);
  s.restore("half");
  CHECK(diff(bytes, at_call.data(), a.size()) == "");
  // Rollback from "half" to "later" copies only what differs: still exact.
  s.restore("later");
  CHECK(diff(bytes, later.data(), a.size()) == "");
  // Writes since that restore, then a restore of the same snapshot.
  bytes[12345] ^= 1;
  s.restore("later");
  CHECK(diff(bytes, later.data(), a.size()) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("background: little changed, hash tracking, or an empty session: taken at once, and said why", "[background]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "once");
  auto& a = s.alloc("a", 8u << 20);
  dvrtest::fill_random(a.data(), a.size(), 20);
  s.snapshot("base");
  static_cast<unsigned char*>(a.data())[100] ^= 1;
  SnapshotJob job = s.snapshot_background("small-change");
  CHECK(job.done());
  CHECK_FALSE(job.background());
  CHECK(job.note().find("quicker") != std::string::npos);
  CHECK(job.wait().name == "small-change");
  CHECK(s.head() == "small-change");
  CHECK(s.background().name() == "small-change");

  Session h(store, "hashed", {.tracking = dvr::Tracking::hash});
  auto& big = h.alloc("big", 1u << 20);
  dvrtest::fill_random(big.data(), big.size(), 21);
  SnapshotJob hj = h.snapshot_background("x");
  CHECK_FALSE(hj.background());
  CHECK(hj.note().find("not write-tracked") != std::string::npos);
  CHECK(hj.wait().logical_bytes == big.size());

  Session empty(store, "empty");
  CHECK(catch_error([&] { empty.snapshot_background("x"); }).code == Errc::invalid_argument);
  CHECK(catch_error([&] { s.snapshot_background("base"); }).code == Errc::already_exists);
  CHECK(catch_error([&] { s.snapshot_background("bad/name"); }).code == Errc::invalid_argument);
  CHECK(catch_error([&] { SnapshotJob().wait(); }).code == Errc::invalid_argument);
}

TEST_CASE("background: snapshot(..., {.background = true}) returns pending info, and restore and the next snapshot wait for it", "[background]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "wait");
  auto& a = s.alloc("a", 24u << 20);
  dvrtest::fill_random(a.data(), a.size(), 30);
  std::vector<unsigned char> a0(a.as<unsigned char>().begin(), a.as<unsigned char>().end());
  dvr::SnapshotInfo info = s.snapshot("one", {.background = true});
  SnapshotJob job = s.background();
  REQUIRE(job);
  REQUIRE_BACKGROUND(job);
  CHECK(info.pending);
  CHECK(info.name == "one");
  CHECK(info.session == "wait");
  dvrtest::fill_random(a.data(), a.size(), 31);
  std::vector<unsigned char> a1(a.as<unsigned char>().begin(), a.as<unsigned char>().end());
  // The next snapshot waits for this one and takes it as its parent.
  dvr::SnapshotInfo two = s.snapshot("two");
  CHECK(job.done());
  CHECK(two.parent == "one");
  s.restore("one");
  CHECK(diff(a.data(), a0.data(), a.size()) == "");
  s.restore("two");
  CHECK(diff(a.data(), a1.data(), a.size()) == "");
}

TEST_CASE("background: cancelled, nothing is published and the session carries on", "[background]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "cancel");
  auto& a = s.alloc("a", 64u << 20);
  auto* bytes = static_cast<unsigned char*>(a.data());
  dvrtest::fill_random(bytes, a.size(), 40);
  s.snapshot("base");
  dvrtest::fill_random(bytes, a.size(), 41);
  SnapshotJob job = s.snapshot_background("stopped");
  REQUIRE_BACKGROUND(job);
  job.cancel();
  auto e = catch_error([&] { job.wait(); });
  if (e.code != Errc::cancelled) {
    // It may have been done before the request arrived.
    REQUIRE(e.what == "(returned normally)");
    WARN("the background snapshot finished before it could be cancelled");
  } else {
    CHECK(e.what.find("cancel") != std::string::npos);
    CHECK(catch_error([&] { store.info("cancel", "stopped"); }).code == Errc::not_found);
    CHECK(s.head() == "base");
  }
  // Writes after the cancel still count: an incremental snapshot then, and
  // restores, are exact.
  bytes[777] ^= 3;
  std::vector<unsigned char> now(bytes, bytes + a.size());
  s.snapshot("after");
  dvrtest::fill_random(bytes, a.size(), 42);
  s.restore("after");
  CHECK(diff(bytes, now.data(), a.size()) == "");
  CHECK(store.verify().ok());

  // Ending the session cancels a running one.
  dvrtest::fill_random(bytes, a.size(), 43);
  SnapshotJob orphan;
  {
    Session t(store, "ended");
    t.track("a", bytes, a.size());
    orphan = t.snapshot_background("never");
  }
  CHECK(orphan.done());
  if (orphan.background()) {
    auto oe = catch_error([&] { orphan.wait(); });
    CHECK((oe.code == Errc::cancelled || oe.what == "(returned normally)"));
  }
  CHECK(store.verify().ok());
}

TEST_CASE("background: a store that fills up fails the job with no_space and publishes nothing", "[background][no_space]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "full");
  Pages big(80u << 20);
  for (std::size_t off = 0; off < big.size; off += 64 << 10) {
    big.p[off] = 1;
    std::memcpy(big.p + off + 8, &off, sizeof off);
  }
  s.track("big", big.p, big.size);
  auto e = [&] {
    dvrtest::FileSizeLimit limit(32u << 20);
    SnapshotJob job = s.snapshot_background("too-big");
    return catch_error([&] { job.wait(); });
  }();
  INFO(e.what);
  CHECK(e.code == Errc::no_space);
  CHECK(catch_error([&] { store.info("full", "too-big"); }).code == Errc::not_found);
  CHECK(s.head() == "");
  CHECK(store.verify().ok());
  // With room again, it works, and memory written since is in it.
  big.p[5] ^= 1;
  std::vector<unsigned char> now(big.p, big.p + big.size);
  SnapshotJob again = s.snapshot_background("fits");
  again.wait();
  std::memset(big.p, 0, big.size);
  s.restore("fits");
  CHECK(diff(big.p, now.data(), big.size) == "");
}

TEST_CASE("background: a process killed in the middle of a background snapshot leaves nothing half-visible", "[background][crash]") {
  TempDir dir;
  {
    Store store = Store::open(dir.store());
    Session s(store, "crash");
    auto& a = s.alloc("a", 4u << 20);
    dvrtest::fill_random(a.data(), a.size(), 50);
    s.snapshot("kept");
  }
  int killed_midway = 0;
  for (int trial = 0; trial < 6; ++trial) {
    int pipefd[2];
    REQUIRE(::pipe(pipefd) == 0);
    pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ::close(pipefd[0]);
      try {
        Store store = Store::open(dir.store());
        Session s(store, "crash");
        Pages mem(128u << 20);
        for (std::size_t off = 0; off < mem.size; off += 4096)
          std::memcpy(mem.p + off, &off, sizeof off);
        dvrtest::fill_random(mem.p, 1u << 20, static_cast<std::uint64_t>(trial));
        s.track("a", mem.p, mem.size);
        SnapshotJob job = s.snapshot_background("torn-" + std::to_string(trial));
        char c = job.background() ? 'b' : 'o';
        [[maybe_unused]] ssize_t n = ::write(pipefd[1], &c, 1);
        for (std::size_t off = 0;; off = (off + 4096 * 7) % mem.size)
          mem.p[off] ^= 1;  // until killed
      } catch (...) {
      }
      ::_exit(1);
    }
    ::close(pipefd[1]);
    char c = 0;
    REQUIRE(::read(pipefd[0], &c, 1) == 1);
    ::close(pipefd[0]);
    ::usleep(static_cast<useconds_t>(1000 * (trial * 15)));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (c == 'o') DVR_SKIP("background snapshots unavailable in the child");
    Store store = Store::open(dir.store());
    bool published = false;
    for (auto& info : store.list("crash")) {
      CHECK_FALSE(info.damaged);
      if (info.name == "torn-" + std::to_string(trial)) published = true;
    }
    killed_midway += published ? 0 : 1;
    auto report = store.verify();
    INFO("trial " << trial << ": " << (report.problems.empty() ? "" : report.problems[0].what));
    CHECK(report.ok());
  }
  CHECK(killed_midway > 0);
  Store store = Store::open(dir.store());
  CHECK(store.info("crash", "kept").logical_bytes == 4u << 20);
}

TEST_CASE("background: a persistent heap region is snapshotted in the background too", "[background][heap]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "heap");
  auto& h = s.alloc("h", 16u << 20, {.persistent = true});
  auto* bytes = static_cast<unsigned char*>(h.data());
  dvrtest::fill_random(bytes, h.size(), 60);
  std::vector<unsigned char> at_call(bytes, bytes + h.size());
  SnapshotJob job = s.snapshot_background("p");
  if (!job.background() && job.note().find("cannot be protected") != std::string::npos) {
    job.wait();
    DVR_SKIP("shared memory cannot be write-protected synchronously here: " << job.note());
  }
  REQUIRE_BACKGROUND(job);
  for (std::size_t off = 0; off < h.size(); off += 4096 * 3)
    bytes[off] = 0xFF;
  job.wait();
  std::vector<unsigned char> later(bytes, bytes + h.size());
  s.snapshot("q");
  dvrtest::fill_random(bytes, h.size(), 61);
  s.restore("p");
  CHECK(diff(bytes, at_call.data(), h.size()) == "");
  s.restore("q");
  CHECK(diff(bytes, later.data(), h.size()) == "");
}

TEST_CASE("background: on a full tmpfs the job fails with no_space while the program writes, nothing is published", "[background][no_space]") {
  // A real full file system, not a file-size limit: a tmpfs of 8 MiB.
  TempDir dir;
  const std::string mnt = dir / "mnt";
  dvrtest::MountedTmpfs tmpfs(mnt, "8m");
  if (!tmpfs) DVR_SKIP("cannot mount a tmpfs here (" << tmpfs.error() << "): needs root");
  {
    Store store = Store::open(mnt + "/store");
    Session s(store, "full");
    auto small = dvrtest::random_bytes(1u << 20, 70);
    const auto small0 = small;
    s.track("small", small.data(), small.size());
    s.snapshot("before");
    Pages big(12u << 20);  // more than the tmpfs holds
    dvrtest::fill_random(big.p, big.size, 71);
    s.track("big", big.p, big.size);
    SnapshotJob job = s.snapshot_background("too-big");
    REQUIRE_BACKGROUND(job);
    Caught e;
    {
      Hammer h(big.p, big.size, 1);
      e = catch_error([&] { job.wait(); });
    }
    INFO(e.what);
    CHECK(e.code == Errc::no_space);
    CHECK(catch_error([&] { store.info("full", "too-big"); }).code == Errc::not_found);
    CHECK(s.head() == "before");
    s.untrack("big");
    dvrtest::fill_random(small.data(), small.size(), 72);
    s.restore("before");
    CHECK(diff(small, small0) == "");
    CHECK(store.verify().ok());
  }
}

TEST_CASE("background: memory the program discards while it is read fails the job, and nothing wrong is published", "[background][discard]") {
  // madvise(MADV_DONTNEED) zaps pages without a write: no fault, no copy
  // aside. The snapshot read after the zap would hold zeros (or mix them with
  // the old bytes and fail its checksum): the job fails instead. A job that
  // read everything before the zap publishes the memory of the call.
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "bg");
  const std::size_t n = 64u << 20;
  auto& a = s.alloc("a", n);
  int failed = 0;
  for (int round = 0; round < 3; ++round) {
    std::memset(a.data(), 0xAA, n);
    const std::string name = "r" + std::to_string(round);
    SnapshotJob job = s.snapshot_background(name);
    REQUIRE_BACKGROUND(job);
    const std::size_t at = round == 0 ? 0 : n / 2;
    REQUIRE(::madvise(static_cast<char*>(a.data()) + at, round == 0 ? n : (1u << 20), MADV_DONTNEED) == 0);
    Caught c = catch_error([&] { job.wait(); });
    if (c.threw_dvr()) {
      ++failed;
      CHECK(c.code == Errc::io);
      CHECK(c.what.find("discarded memory of region 'a'") != std::string::npos);
      CHECK(c.what.find("nothing was published") != std::string::npos);
      CHECK(catch_error([&] { store.info("bg", name); }).code == Errc::not_found);
      continue;
    }
    // Read before the zap: the memory of the call, whole.
    std::memset(a.data(), 0x11, n);
    s.restore(name);
    auto bytes = a.as<unsigned char>();
    CHECK(std::count(bytes.begin(), bytes.end(), 0xAA) == static_cast<long>(n));
  }
  INFO("rounds whose job failed: " << failed);
  CHECK(failed >= 1);  // the zap right after the call lands while the job reads
  CHECK(store.verify().ok());
  // The session goes on: the next snapshot is whole and restores.
  std::memset(a.data(), 0x5C, n);
  s.snapshot("after");
  std::memset(a.data(), 0, n);
  s.restore("after");
  auto bytes = a.as<unsigned char>();
  CHECK(std::count(bytes.begin(), bytes.end(), 0x5C) == static_cast<long>(n));
}
