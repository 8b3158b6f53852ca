// Persistent heaps (AllocOptions::persistent), Session::base_on, the heap
// image the CRIU plugin writes and the heap snapshots it takes
// (proc_heaps.hpp), and the tracking notes a session leaves beside its heaps.
//
// The plugin runs snapshot_heaps() on a process CRIU has frozen; here the
// "process" is this test process itself (pid = getpid()), which is not writing
// while snapshot_heaps() runs, so the result must equal the heap file's bytes.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "proc/proc_heaps.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace heaps = dvr::detail::heaps;

TEST_CASE("heap: a persistent region lives in a store file and outlives its session", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 3 * 4096 + 100;
  auto want = dvrtest::random_bytes(n, 1);
  std::string path;
  {
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    CHECK(r.sdk_owned());
    path = s.heap_path("heap");
    CHECK(path == t.store() + "/heaps/job/heap");
    CHECK(heaps::store_of_heap(path) == t.store());
    std::memcpy(r.data(), want.data(), n);
    CHECK(s.heap_path("heap") == path);
    // Snapshots and restores work on it like on any region.
    s.snapshot("one");
    std::memset(r.data(), 0, n);
    s.restore("one");
    CHECK(dvrtest::diff(r.data(), want.data(), n) == "");
  }
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(static_cast<std::size_t>(st.st_size) == 4 * 4096);
  {
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    CHECK(dvrtest::diff(r.data(), want.data(), n) == "");
    // This process maps it; a path that only looks alike is not a heap.
    auto users = heaps::processes_mapping(path);
    CHECK(std::any_of(users.begin(), users.end(), [](const std::string& u) { return u.rfind(std::to_string(::getpid()) + " ", 0) == 0; }));
    CHECK(heaps::mapped_heaps(::getpid()) == std::vector<std::string>{path});
    s.alloc("plain", 4096);
    CHECK(s.heap_path("plain").empty());
    CHECK(catch_error([&] { s.heap_path("nope"); }).code == Errc::not_found);
  }
  Session s(store, "job");
  auto c = catch_error([&] { s.alloc("heap", 64 * 4096, {.persistent = true}); });
  CHECK(c.code == Errc::invalid_argument);
  CHECK(c.what.find(path) != std::string::npos);
  CHECK(heaps::store_of_heap(t.path() + "/heaps/job/heap").empty());
}

TEST_CASE("heap: base_on compares with a snapshot taken by another session object", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store(), {.chunk_size = 64 * 1024});
  const std::size_t n = 4 << 20;
  auto data = dvrtest::random_bytes(n, 2);
  {
    Session a(store, "s");
    a.track("r", data.data(), n);
    a.snapshot("a");
  }
  data[5 * 4096 + 7] ^= 0xff;  // one page changed
  data[700 * 4096] ^= 0x01;    // and another
  Session b(store, "s", {.tracking = Tracking::hash});
  b.track("r", data.data(), n);
  CHECK(catch_error([&] { b.base_on("missing"); }).code == Errc::not_found);
  b.base_on("a");
  CHECK(b.head() == "a");
  SnapshotInfo info = b.snapshot("b");
  CHECK(info.parent == "a");
  CHECK(info.stored_bytes <= 2 * 4096);
  // Restores bit-exact from a fresh session.
  std::vector<unsigned char> back(n, 0);
  Session c(store, "s");
  c.track("r", back.data(), n);
  c.restore("b");
  CHECK(dvrtest::diff(back.data(), data.data(), n) == "");
  c.restore("a");
  data[5 * 4096 + 7] ^= 0xff;
  data[700 * 4096] ^= 0x01;
  CHECK(dvrtest::diff(back.data(), data.data(), n) == "");
}

TEST_CASE("heap: the plugin's image round-trips and refuses damage", "[heap]") {
  heaps::HeapImage img;
  img.snapshot = "proc.night1";
  img.heaps.push_back({"/dev/shm/a store", "job", "heap", "/dev/shm/a store/heaps/job/heap", 1 << 20});
  img.heaps.push_back({"/dev/shm/b", "other", "h2", "/dev/shm/b/heaps/other/h2", 8192});
  std::string text = heaps::format_image(img);
  heaps::HeapImage back = heaps::parse_image(text);
  CHECK(back.snapshot == img.snapshot);
  REQUIRE(back.heaps.size() == 2);
  CHECK(back.heaps[0].store == img.heaps[0].store);
  CHECK(back.heaps[1].session == "other");
  CHECK(back.heaps[1].region == "h2");
  CHECK(back.heaps[1].path == img.heaps[1].path);
  CHECK(back.heaps[0].bytes == img.heaps[0].bytes);
  for (std::size_t cut : {std::size_t(0), std::size_t(10), text.size() / 2, text.size() - 8})
    CHECK(catch_error([&] { heaps::parse_image(text.substr(0, cut)); }).code == Errc::corrupt);
  std::string newer = text;
  newer.replace(0, 16, "dvr-criu-heaps 9");
  CHECK(catch_error([&] { heaps::parse_image(newer); }).code == Errc::unsupported);
}

TEST_CASE("heap: restoring heaps checks sizes and data before changing a file", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 16 * 4096;
  std::string path;
  std::vector<unsigned char> want(n);
  {
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    dvrtest::fill_random(r.data(), n, 3);
    std::memcpy(want.data(), r.data(), n);
    path = s.heap_path("heap");
  }
  heaps::HeapImage img = heaps::snapshot_heaps({path}, 0, "proc.p1", false);
  REQUIRE(img.heaps.size() == 1);
  CHECK(img.heaps[0].session == "job");
  CHECK(img.heaps[0].region == "heap");
  CHECK(store.info("job", "proc.p1").regions.size() == 1);
  {
    // Written after the dump; restoring puts back the dump-time bytes.
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    std::memset(r.data(), 0x5a, n);
  }
  heaps::restore_heaps(img, {store.path(), {}});
  {
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    CHECK(dvrtest::diff(r.data(), want.data(), n) == "");
  }
  // A missing file is created again.
  ::unlink(path.c_str());
  heaps::restore_heaps(img, {store.path(), {}});
  {
    Session s(store, "job");
    CHECK(dvrtest::diff(s.alloc("heap", n, {.persistent = true}).data(), want.data(), n) == "");
  }
  // Resized behind dvr's back: refused, file untouched.
  REQUIRE(::truncate(path.c_str(), 2 * n) == 0);
  auto c = catch_error([&] { heaps::restore_heaps(img, {store.path(), {}}); });
  CHECK(c.code == Errc::invalid_argument);
  CHECK(c.what.find("behind") != std::string::npos);
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK(static_cast<std::size_t>(st.st_size) == 2 * n);
  // An unknown snapshot is not_found.
  heaps::HeapImage gone = img;
  gone.snapshot = "proc.p2";
  CHECK(catch_error([&] { heaps::restore_heaps(gone, {store.path(), {}}); }).code == Errc::not_found);
}

TEST_CASE("heap: a tracking note lets a heap snapshot read only the pages written since", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 256 * 4096;
  Session s(store, "job");
  Region& r = s.alloc("heap", n, {.persistent = true});
  dvrtest::fill_random(r.data(), n, 4);
  const std::string path = s.heap_path("heap");
  heaps::TrackNote note;
  CHECK_FALSE(heaps::read_note(path, note));  // nothing snapshotted yet
  s.snapshot("app");
  const bool tracked = s.tracking("heap") == Tracking::write_protect;
  CHECK(heaps::read_note(path, note) == tracked);
  auto* bytes = static_cast<unsigned char*>(r.data());
  bytes[10 * 4096 + 1] ^= 0x55;
  bytes[200 * 4096 + 9] ^= 0xaa;
  std::vector<unsigned char> want(bytes, bytes + n);

  heaps::HeapStats stats;
  heaps::HeapImage img = heaps::snapshot_heaps({path}, ::getpid(), "proc.d1", false, &stats);
  CHECK(stats.heaps_by_note == (tracked ? 1u : 0u));
  CHECK(stats.stored_bytes <= 2 * 4096);
  CHECK(store.info("job", "proc.d1").parent == "app");
  // The heap snapshot holds the live bytes, not the application's snapshot.
  {
    std::vector<unsigned char> back(n);
    Session c(store, "job");
    c.track("heap", back.data(), n);
    c.restore("proc.d1");
    CHECK(dvrtest::diff(back.data(), want.data(), n) == "");
  }
  // The application's tracking is untouched: its next snapshot still knows
  // the two pages, and its data is exact.
  SnapshotInfo next = s.snapshot("app2");
  CHECK(next.stored_bytes <= 2 * 4096);
  CHECK(next.parent == "app");
  // A note for another process does not hold: compared by hash instead.
  heaps::HeapStats other;
  heaps::snapshot_heaps({path}, ::getppid(), "proc.d2", false, &other);
  CHECK(other.heaps_by_note == 0);
  // Untracking drops the note.
  s.untrack("heap");
  CHECK_FALSE(heaps::read_note(path, note));
}

// ---- heap snapshots the plugin takes, and tracking notes -----------------------

namespace {

constexpr std::size_t kPage = 4096;

// The bytes of snapshot `snap` of region `region` (of `size` bytes) in session `session`.
std::vector<unsigned char> snapshot_bytes(Store& store, const std::string& session, const std::string& snap, const std::string& region,
                                          std::size_t size) {
  std::vector<unsigned char> back(size);
  Session c(store, session, SessionOptions{.tracking = Tracking::hash});
  c.track(region, back.data(), size);
  c.restore(snap);
  return back;
}

std::vector<unsigned char> file_bytes(const std::string& path) {
  std::string s = dvrtest::read_file(path);
  return {s.begin(), s.end()};
}

bool has_snapshot(const Store& store, const std::string& session, const std::string& name) {
  for (auto& i : store.list(session))
    if (i.name == name) return true;
  return false;
}

}  // namespace

// The note shortcut relies on every write to the heap going through the one
// write-tracked mapping of the noting process. Writes through any other
// mapping do not show in that mapping's PAGEMAP_SCAN: the plugin must not take
// those pages from the note's (older) snapshot, which would leave stale heap
// data in the process snapshot (written_by_note() in proc_heaps.cpp checks
// that the noted mapping is the file's only one).
TEST_CASE("heap: writes through another mapping of a heap are not taken from the tracking note's snapshot", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 64 * kPage;
  Session app(store, "job", SessionOptions{.tracking = Tracking::write_protect});
  Region& r = app.alloc("heap", n, {.persistent = true});
  if (app.tracking("heap") != Tracking::write_protect)
    DVR_SKIP("write-protect tracking not in use here (" << dvrtest::no_write_protect_why(app) << "): no tracking note to test");
  dvrtest::fill_random(r.data(), n, 11);
  const std::string path = app.heap_path("heap");
  app.snapshot("app");
  heaps::TrackNote note;
  REQUIRE(heaps::read_note(path, note));
  auto* bytes = static_cast<unsigned char*>(r.data());

  SECTION("a forked child writes through the mapping it inherited") {
    // E.g. a Python multiprocessing worker (fork) filling a shared heap: the
    // child's copy of the mapping has no userfaultfd registration.
    pid_t child = ::fork();
    if (child == 0) {
      bytes[5 * kPage + 7] ^= 0x5a;
      bytes[40 * kPage] ^= 0xa5;
      ::_exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE(WIFEXITED(status));
  }
  SECTION("a second session of the process maps the same heap and writes through it") {
    // Registering the second mapping re-publishes the note for it, and the
    // first mapping's writes are invisible to the second's tracking.
    Session other(store, "job", SessionOptions{.tracking = Tracking::write_protect});
    Region& r2 = other.alloc("heap", n, {.persistent = true});
    other.snapshot("app-b");
    REQUIRE(heaps::read_note(path, note));
    REQUIRE(note.data == reinterpret_cast<std::uintptr_t>(r2.data()));
    bytes[5 * kPage + 7] ^= 0x5a;  // through the first session's mapping
    std::vector<unsigned char> want = file_bytes(path);
    heaps::HeapStats stats;
    heaps::snapshot_heaps({path}, ::getpid(), "proc.d1", false, &stats);
    CHECK(dvrtest::diff(snapshot_bytes(store, "job", "proc.d1", "heap", n), want) == "");
    return;
  }
  // write(2) to the heap file is not covered, as for the session's own
  // incremental snapshots: a heap is written through its mapping
  // (criu-plugin/README.md, "Limits").
  std::vector<unsigned char> want = file_bytes(path);
  REQUIRE(dvrtest::diff(bytes, want.data(), n) == "");  // the mapping sees it too
  heaps::HeapStats stats;
  heaps::snapshot_heaps({path}, ::getpid(), "proc.d1", false, &stats);
  INFO("heaps captured by the note: " << stats.heaps_by_note);
  CHECK(dvrtest::diff(snapshot_bytes(store, "job", "proc.d1", "heap", n), want) == "");
}

// A snapshot re-arms the tracker and then replaces the note, "best effort":
// when the new note cannot be written (no space, EMFILE, ...), the old one,
// naming the previous snapshot, must not be used with write marks that were
// just cleared, or every page written between the two snapshots would be
// taken from the older one. (The same state exists, for any process, between
// re-arming and publishing the notes in Session::snapshot()/restore(), where
// a CRIU freeze can catch it.)
TEST_CASE("heap: a tracking note that could not be replaced after a snapshot does not make heap snapshots stale", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 64 * kPage;
  Session app(store, "job", SessionOptions{.tracking = Tracking::write_protect});
  Region& r = app.alloc("heap", n, {.persistent = true});
  if (app.tracking("heap") != Tracking::write_protect)
    DVR_SKIP("write-protect tracking not in use here (" << dvrtest::no_write_protect_why(app) << "): no tracking note to test");
  dvrtest::fill_random(r.data(), n, 12);
  const std::string path = app.heap_path("heap");
  app.snapshot("s1");
  auto* bytes = static_cast<unsigned char*>(r.data());
  bytes[3 * kPage] ^= 0x77;  // written between s1 and s2
  // The next note cannot be written (here: its temporary name is taken by a
  // directory; in life: a full file system or no file descriptor left).
  const std::string tmp = heaps::note_path(path) + ".tmp" + std::to_string(::getpid());
  REQUIRE(::mkdir(tmp.c_str(), 0700) == 0);
  app.snapshot("s2");
  ::rmdir(tmp.c_str());
  std::vector<unsigned char> want = file_bytes(path);
  heaps::HeapStats stats;
  heaps::snapshot_heaps({path}, ::getpid(), "proc.d1", false, &stats);
  heaps::TrackNote note;
  INFO("note left beside the heap names snapshot '" << (heaps::read_note(path, note) ? note.snapshot : "(none)") << "'");
  CHECK(dvrtest::diff(snapshot_bytes(store, "job", "proc.d1", "heap", n), want) == "");
}

// snapshot_heaps() bases the heap snapshot on the note's snapshot, which may
// have been removed since (`dvr rm job/s1`, a retention policy, `dvr gc` of a
// damaged one). That must not fail the whole `dvr proc dump` (base_on throws
// not_found): the documented behaviour is to fall back to comparing by hash.
TEST_CASE("heap: a tracking note naming a removed snapshot falls back to hashing", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 16 * kPage;
  Session app(store, "job", SessionOptions{.tracking = Tracking::write_protect});
  Region& r = app.alloc("heap", n, {.persistent = true});
  if (app.tracking("heap") != Tracking::write_protect)
    DVR_SKIP("write-protect tracking not in use here (" << dvrtest::no_write_protect_why(app) << "): no tracking note to test");
  dvrtest::fill_random(r.data(), n, 13);
  const std::string path = app.heap_path("heap");
  app.snapshot("s1");
  heaps::TrackNote note;
  REQUIRE(heaps::read_note(path, note));
  store.remove("job", "s1");
  std::vector<unsigned char> want = file_bytes(path);
  auto c = catch_error([&] { heaps::snapshot_heaps({path}, ::getpid(), "proc.d1", false); });
  CHECK(c.what == "(returned normally)");
  if (c.what == "(returned normally)") CHECK(dvrtest::diff(snapshot_bytes(store, "job", "proc.d1", "heap", n), want) == "");
}

// snapshot_heaps() commits one snapshot per (store, session). When a later
// group fails, the earlier groups' "proc.NAME" snapshots must not stay in
// their stores: the plugin writes no dvr-heaps.img then (it throws first), so
// `dvr proc dump`'s cleanup could not find them, the failed dump would leave
// data in the store, and the next dump under that NAME would fail in the
// plugin with "already exists".
TEST_CASE("heap: heap snapshots that fail part way leave no heap snapshot behind", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 8 * kPage;
  Session a(store, "a", SessionOptions{.tracking = Tracking::hash});
  Region& ra = a.alloc("heap", n, {.persistent = true});
  dvrtest::fill_random(ra.data(), n, 14);
  const std::string good = a.heap_path("heap");
  // A second heap, of another session, that cannot be snapshotted (emptied
  // behind the SDK's back; any failure of the second group will do).
  dvrtest::fs::create_directories(t.store() + "/heaps/b");
  const std::string bad = t.store() + "/heaps/b/heap";
  dvrtest::write_file(bad, "");
  auto c = catch_error([&] { heaps::snapshot_heaps({good, bad}, 0, "proc.d1", false); });
  REQUIRE(c.threw_dvr());
  CHECK_FALSE(has_snapshot(store, "a", "proc.d1"));
}

// CRIU may freeze a process while its session holds the store's lock
// (Session::snapshot() holds it exclusively from before hashing until after
// publish_notes(); restore() holds it shared). The plugin's snapshot_heaps()
// must not wait forever for that lock, or `dvr proc dump` hangs with the
// whole tree frozen. Here the application thread is parked inside
// publish_notes() (the note's temporary file is a FIFO nobody reads), exactly
// where a freeze can catch it, and a child process plays the plugin.
TEST_CASE("heap: heap snapshots do not wait forever for a store lock the frozen process holds", "[heap]") {
  TempDir t;
  const std::size_t n = 16 * kPage;
  Store store = Store::open(t.store());
  Session app(store, "job", SessionOptions{.tracking = Tracking::write_protect});
  Region& r = app.alloc("heap", n, {.persistent = true});
  if (app.tracking("heap") != Tracking::write_protect)
    DVR_SKIP("write-protect tracking not in use here (" << dvrtest::no_write_protect_why(app) << "): no tracking note to test");
  dvrtest::fill_random(r.data(), n, 15);
  const std::string path = app.heap_path("heap");
  const std::string fifo = heaps::note_path(path) + ".tmp" + std::to_string(::getpid());
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::thread writer([&] { app.snapshot("s1"); });  // blocks opening the FIFO, store lock held
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const pid_t self = ::getpid();
  pid_t plugin = ::fork();
  if (plugin == 0) {
    try {
      heaps::snapshot_heaps({path}, self, "proc.d1", false);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  bool finished = false;
  for (int i = 0; i < 600 && !finished; ++i) {  // 30 s (a loaded machine)
    int status = 0;
    finished = ::waitpid(plugin, &status, WNOHANG) == plugin;
    if (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!finished) {
    ::kill(plugin, SIGKILL);
    ::waitpid(plugin, nullptr, 0);
  }
  // Let the application thread go: read the FIFO so its open() returns.
  int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  writer.join();
  if (rd >= 0) ::close(rd);
  ::unlink(heaps::note_path(path).c_str());  // (it became the FIFO)
  CHECK(finished);
}

// The heap of `dvr run --heap` is a large sparse file mostly made of holes:
// snapshotting or restoring it must not read the holes through a mapping
// (which would allocate every one of them in tmpfs).
TEST_CASE("heap: a sparse heap file is snapshotted and restored without filling its holes", "[heap]") {
  TempDir t;
  Store store = Store::open(t.store());
  const std::size_t n = 64ull << 20, page = 4096;
  const std::string dir = t.store() + "/heaps/job";
  const std::string path = dir + "/heap";
  REQUIRE(::mkdir((t.store() + "/heaps").c_str(), 0700) == 0);
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  auto blocks = [&] {
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    return static_cast<std::uint64_t>(st.st_blocks) * 512;
  };
  auto put = [&](std::size_t off, int byte) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(n)) == 0);
    std::vector<char> p(page, static_cast<char>(byte));
    REQUIRE(::pwrite(fd, p.data(), page, static_cast<off_t>(off)) == static_cast<ssize_t>(page));
    ::close(fd);
  };
  put(0, 1);
  put(40ull << 20, 2);
  heaps::HeapStats stats;
  heaps::HeapImage img = heaps::snapshot_heaps({path}, 0, "proc.p1", false, &stats);
  // Two pages written: only the two chunks holding them are read (and so
  // allocated) and stored; the other 63.5 MiB stay holes.
  const std::uint64_t two_chunks = 2ull * store.chunk_size();
  CHECK(blocks() <= two_chunks);
  CHECK(stats.stored_bytes <= two_chunks);
  // Damage behind the snapshot's back: a page changed, one filled in a hole.
  put(0, 7);
  put(20ull << 20, 9);
  heaps::restore_heaps(img, {store.path(), {}});
  CHECK(blocks() <= two_chunks);  // the filled hole is a hole again; the rest untouched
  std::vector<char> got(page);
  int fd = ::open(path.c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  auto byte_at = [&](std::size_t off) {
    REQUIRE(::pread(fd, got.data(), page, static_cast<off_t>(off)) == static_cast<ssize_t>(page));
    return got[page / 2];
  };
  CHECK(byte_at(0) == 1);
  CHECK(byte_at(40ull << 20) == 2);
  CHECK(byte_at(20ull << 20) == 0);
  ::close(fd);
  // A second heap snapshot of the unchanged file stores (almost) nothing.
  heaps::HeapStats again;
  heaps::snapshot_heaps({path}, 0, "proc.p2", false, &again);
  CHECK(again.stored_bytes <= 4 * page);
  CHECK(blocks() <= two_chunks);
}
