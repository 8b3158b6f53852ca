// Persistent heaps (AllocOptions::persistent), Session::base_on, and the heap
// image the CRIU plugin writes (proc_heaps.hpp).
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>

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
    CHECK(std::any_of(users.begin(), users.end(),
                      [](const std::string& u) { return u.rfind(std::to_string(::getpid()) + " ", 0) == 0; }));
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
  data[5 * 4096 + 7] ^= 0xff;   // one page changed
  data[700 * 4096] ^= 0x01;     // and another
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
  heaps::restore_heaps(img);
  {
    Session s(store, "job");
    Region& r = s.alloc("heap", n, {.persistent = true});
    CHECK(dvrtest::diff(r.data(), want.data(), n) == "");
  }
  // A missing file is created again.
  ::unlink(path.c_str());
  heaps::restore_heaps(img);
  {
    Session s(store, "job");
    CHECK(dvrtest::diff(s.alloc("heap", n, {.persistent = true}).data(), want.data(), n) == "");
  }
  // Resized behind dvr's back: refused, file untouched.
  REQUIRE(::truncate(path.c_str(), 2 * n) == 0);
  auto c = catch_error([&] { heaps::restore_heaps(img); });
  CHECK(c.code == Errc::invalid_argument);
  CHECK(c.what.find("behind") != std::string::npos);
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK(static_cast<std::size_t>(st.st_size) == 2 * n);
  // An unknown snapshot is not_found.
  heaps::HeapImage gone = img;
  gone.snapshot = "proc.p2";
  CHECK(catch_error([&] { heaps::restore_heaps(gone); }).code == Errc::not_found);
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
