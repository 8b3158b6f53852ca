// Unit tests of the write path of stores on a disk file system: data written
// with pwrite, its writeback started as it goes, and made durable by one
// fdatasync per pack at publish (Packs::persist), before the manifest.
//
// fdatasync is interposed here (the unit tests link libdvr's objects
// statically, so this definition is the one they call): it counts calls per
// file and can fail them with EIO, as a failing device would.
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;

namespace {

struct SyncLog {
  std::mutex mu;
  std::map<std::string, int> calls;  // path -> fdatasync calls
  std::vector<std::string> order;    // paths, in call order
  std::string fail_suffix;           // fail fdatasync of files ending in it with EIO
  std::atomic<bool> on{false};
};
SyncLog& sync_log() {
  static SyncLog log;
  return log;
}

std::string path_of_fd(int fd) {
  char buf[4096];
  ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

bool ends_with(const std::string& s, const std::string& tail) { return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0; }

// Counts and optionally fails fdatasync calls while alive.
class WatchSyncs {
 public:
  explicit WatchSyncs(std::string fail_suffix = "") {
    SyncLog& l = sync_log();
    std::lock_guard<std::mutex> g(l.mu);
    l.calls.clear();
    l.order.clear();
    l.fail_suffix = std::move(fail_suffix);
    l.on = true;
  }
  ~WatchSyncs() { sync_log().on = false; }
  WatchSyncs(const WatchSyncs&) = delete;
  WatchSyncs& operator=(const WatchSyncs&) = delete;
  // Calls on files whose path ends in `suffix`.
  int calls(const std::string& suffix) const {
    SyncLog& l = sync_log();
    std::lock_guard<std::mutex> g(l.mu);
    int n = 0;
    for (auto& [p, c] : l.calls)
      if (ends_with(p, suffix)) n += c;
    return n;
  }
  std::vector<std::string> order() const {
    std::lock_guard<std::mutex> g(sync_log().mu);
    return sync_log().order;
  }
};

}  // namespace

extern "C" int fdatasync(int fd) {
  using Fn = int (*)(int);
  static Fn real = reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, "fdatasync"));
  SyncLog& l = sync_log();
  if (l.on.load()) {
    std::string path = path_of_fd(fd);
    std::lock_guard<std::mutex> g(l.mu);
    ++l.calls[path];
    l.order.push_back(path);
    if (!l.fail_suffix.empty() && ends_with(path, l.fail_suffix)) {
      errno = EIO;
      return -1;
    }
  }
  return real(fd);
}

// fsync calls are only logged (in `order`, as "fsync PATH"): manifests are
// written to a temporary file that is fsynced, then renamed.
extern "C" int fsync(int fd) {
  using Fn = int (*)(int);
  static Fn real = reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, "fsync"));
  SyncLog& l = sync_log();
  if (l.on.load()) {
    std::string path = path_of_fd(fd);
    std::lock_guard<std::mutex> g(l.mu);
    l.order.push_back("fsync " + path);
  }
  return real(fd);
}

TEST_CASE("disk store: a large snapshot syncs its pack once, at publish, and reads back exactly", "[disk_write]") {
  TempDir dir("/var/tmp");
  Store store = Store::open(dir.store());
  REQUIRE(store.medium() == dvr::Medium::disk);
  // 200 MiB: lanes take blocks of up to 64 MiB, each of which used to end in
  // an fdatasync of its own.
  const std::size_t size = 200u << 20;
  auto live = dvrtest::random_bytes(size, 2100);
  const auto a0 = live;
  Session s(store, "disk");
  s.track("r", live.data(), size);
  int pack_syncs = 0, hash_syncs = 0;
  {
    WatchSyncs watch;
    CHECK(s.snapshot("a").stored_bytes >= size);
    pack_syncs = watch.calls(".pack");
    hash_syncs = watch.calls(".hash");
  }
  CHECK(pack_syncs == 1);
  CHECK(hash_syncs == 1);
  // Reused space (a removed snapshot's) is written with pwrite as well.
  dvrtest::fill_random(live.data(), size, 2101);
  const auto b0 = live;
  s.snapshot("b");
  store.remove("disk", "a");
  dvrtest::fill_random(live.data(), size, 2102);
  const auto c0 = live;
  {
    WatchSyncs watch;
    s.snapshot("c");
    CHECK(watch.calls(".pack") == 1);
  }
  CHECK(store.verify().ok());
  Store again = Store::open(dir.store());
  Session t(again, "disk");
  t.track("r", live.data(), size);
  t.restore("b");
  CHECK(diff(live, b0) == "");
  t.restore("c");
  CHECK(diff(live, c0) == "");
}

TEST_CASE("disk store: the pack data is synced before the manifest that names it is written", "[disk_write]") {
  TempDir dir("/var/tmp");
  Store store = Store::open(dir.store());
  auto live = dvrtest::random_bytes(8u << 20, 2110);
  Session s(store, "order");
  s.track("r", live.data(), live.size());
  WatchSyncs watch;
  s.snapshot("a");
  const auto order = watch.order();
  // The manifest is written to a temporary file, fsynced and renamed (the
  // commit point): the pack's one fdatasync comes before it.
  std::size_t pack_at = SIZE_MAX, pack_calls = 0, manifest_at = SIZE_MAX;
  for (std::size_t i = 0; i < order.size(); ++i) {
    INFO(i << ": " << order[i]);
    if (order[i].rfind("fsync ", 0) != 0 && ends_with(order[i], ".pack")) pack_at = i, ++pack_calls;
    if (order[i].rfind("fsync ", 0) == 0 && ends_with(order[i], ".tmp")) manifest_at = std::min(manifest_at, i);
  }
  CHECK(pack_calls == 1);
  REQUIRE(manifest_at != SIZE_MAX);
  CHECK(pack_at < manifest_at);
  CHECK(store.info("order", "a").stored_bytes >= live.size());
}

TEST_CASE("disk store: a pack fdatasync that fails fails the snapshot with io, publishes nothing and gives the space back", "[disk_write]") {
  TempDir dir("/var/tmp");
  Store store = Store::open(dir.store());
  auto live = dvrtest::random_bytes(16u << 20, 2120);
  const auto a0 = live;
  Session s(store, "eio");
  s.track("r", live.data(), live.size());
  s.snapshot("before");
  const auto used = store.stats().pack_bytes;
  dvrtest::fill_random(live.data(), live.size(), 2121);
  auto e = [&] {
    WatchSyncs failing(".pack");
    return catch_error([&] { s.snapshot("lost"); });
  }();
  INFO(e.what);
  CHECK(e.code == Errc::io);
  CHECK_THAT(e.what, Catch::Contains("cannot persist") && Catch::Contains(".pack"));
  CHECK(catch_error([&] { store.info("eio", "lost"); }).code == Errc::not_found);
  CHECK(s.list().size() == 1);
  CHECK(s.head() == "before");
  // Its space was punched out again at once.
  CHECK(store.stats().pack_bytes <= used + (1u << 20));
  s.restore("before");
  CHECK(diff(live, a0) == "");
  CHECK(store.verify().ok());
  // The device works again: the same snapshot is taken.
  dvrtest::fill_random(live.data(), live.size(), 2122);
  const auto b0 = live;
  s.snapshot("lost");
  dvrtest::fill_random(live.data(), live.size(), 2123);
  s.restore("lost");
  CHECK(diff(live, b0) == "");
}

TEST_CASE("disk store: restore and verify read a store whose pages left the page cache exactly", "[disk_write]") {
  TempDir dir("/var/tmp");
  const std::size_t size = (48u << 20) + 4096 * 3 + 11;
  auto live = dvrtest::random_bytes(size, 2130);
  const auto a0 = live;
  {
    Store store = Store::open(dir.store());
    Session s(store, "cold");
    s.track("r", live.data(), size);
    s.snapshot("a");
  }
  // Dropped from the page cache (they are clean once synced): restore and
  // verify read every page from the device.
  for (auto& p : dvrtest::fs::recursive_directory_iterator(dir.store()))
    if (p.is_regular_file()) {
      int fd = ::open(p.path().c_str(), O_RDONLY | O_CLOEXEC);
      REQUIRE(fd >= 0);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  Store store = Store::open(dir.store());
  CHECK(store.verify().ok());
  Session s(store, "cold");
  s.track("r", live.data(), size);
  dvrtest::fill_random(live.data(), size, 2131);
  s.restore("a");
  CHECK(diff(live, a0) == "");
}
