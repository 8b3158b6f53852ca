// Thin clones: copy-on-write views of snapshots.
#include <sys/file.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>

#include "format/manifest.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

using dvrtest::rss_anon;

TEST_CASE("clone: shows the snapshot, keeps its writes private, several at once", "[clone]") {
  TempDir dir;
  Store store = Store::open(dir.store(), {.chunk_size = 16384});
  auto a = dvrtest::random_bytes(300001, 1);
  std::vector<unsigned char> zeros(100000, 0);
  Session s(store, "c");
  s.track("a", a.data(), a.size());
  s.track("z", zeros.data(), zeros.size());
  s.snapshot("one");
  auto a_one = a;
  dvrtest::fill_random(a.data(), a.size(), 2);  // live data moves on

  Clone x = s.clone("one");
  Clone y = store.open_snapshot("c", "one", {.verify = false});
  CHECK(x.session() == "c");
  CHECK(x.snapshot() == "one");
  REQUIRE(x.regions().size() == 2);
  auto& xa = x.region("a");
  CHECK(xa.size() == a.size());
  CHECK(dvrtest::diff(static_cast<unsigned char*>(xa.data()), a_one.data(), a.size()) == "");
  CHECK(dvrtest::diff(static_cast<unsigned char*>(x.region("z").data()), zeros.data(), zeros.size()) == "");
  // Writes to one clone change neither the other clone nor the snapshot.
  std::memset(xa.data(), 0x5A, 50000);
  static_cast<unsigned char*>(x.region("z").data())[7] = 1;
  CHECK(dvrtest::diff(static_cast<unsigned char*>(y.region("a").data()), a_one.data(), a.size()) == "");
  s.restore("one");
  CHECK(dvrtest::diff(a, a_one) == "");
  CHECK(zeros[7] == 0);
  CHECK(store.verify().ok());
  CHECK(dvrtest::catch_error([&] { x.region("nope"); }).code == Errc::not_found);
  CHECK(dvrtest::catch_error([&] { s.clone("nope"); }).code == Errc::not_found);
}

TEST_CASE("clone: costs memory only for pages written", "[clone]") {
  // (AddressSanitizer's shadow of the clone stays the zero page when read:
  // the bound holds there, measured at 0.7 MB of 3.2.)
  if (dvrtest::kThreadSanitizer)
    DVR_SKIP("built with ThreadSanitizer: reading the clone makes TSan's shadow of it resident, so RssAnon measures TSan");
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t size = 64u << 20;
  auto data = dvrtest::random_bytes(size, 3);
  Session s(store, "m");
  s.track("d", data.data(), data.size());
  s.snapshot("big");
  Clone c = s.clone("big", {.verify = false});
  auto* p = static_cast<volatile unsigned char*>(c.region("d").data());
  auto before = rss_anon();
  std::uint64_t sum = 0;
  for (std::size_t off = 0; off < size; off += 4096)
    sum += p[off];  // read everything
  for (std::size_t page = 0; page < size / 4096; page += 100)
    p[page * 4096] = 1;  // write 1% of pages
  auto grown = rss_anon() - before;
  INFO("RssAnon grew by " << grown << " bytes (sum " << sum << ")");
  CHECK(grown < size / 20);                        // far from a full copy
  CHECK(grown >= (size / 4096 / 100) * 4096 / 2);  // the written pages were copied
}

TEST_CASE("clone: its data stays intact after the snapshot is removed, until the clone goes", "[clone]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(4u << 20, 4);
  auto a0 = a;
  Session s(store, "r");
  s.track("a", a.data(), a.size());
  s.snapshot("old");
  auto used = store.stats().pack_bytes;
  {
    Clone c = s.clone("old");
    store.remove("r", "old");
    store.gc();
    // New data must not land in the clone's (now unreferenced) space.
    for (int i = 0; i < 3; ++i) {
      dvrtest::fill_random(a.data(), a.size(), 10 + static_cast<std::uint64_t>(i));
      s.snapshot("new" + std::to_string(i));
    }
    CHECK(dvrtest::diff(static_cast<unsigned char*>(c.region("a").data()), a0.data(), a0.size()) == "");
  }
  // Clone gone: its pin is gone, and gc frees the old data.
  CHECK(dvrtest::tree(store.path() + "/pins").empty());
  for (int i = 0; i < 3; ++i)
    store.remove("r", "new" + std::to_string(i));
  store.gc();
  CHECK(store.stats().pack_bytes < used);
}

TEST_CASE("clone: a pin left by a crashed process is removed by gc, and damage is refused with verify", "[clone]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(1u << 20, 5);
  Session s(store, "p");
  s.track("a", a.data(), a.size());
  s.snapshot("one");
  // A pin nobody holds a lock on: what a killed process leaves behind.
  dvrtest::write_file(store.path() + "/pins/stale.snap", dvrtest::read_file(dvrtest::manifest_path(store, "p", "one")));
  store.remove("p", "one");
  auto report = store.gc();
  CHECK(report.temp_files_removed >= 1);
  CHECK(dvrtest::tree(store.path() + "/pins").empty());

  s.snapshot("two");
  auto m = detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "p", "two")), "two");
  dvrtest::flip_byte(dvrtest::pack_path(store, m.chunks[3].pack), m.chunks[3].offset + 9);
  auto e = dvrtest::catch_error([&] { s.clone("two"); });
  CHECK(e.code == Errc::corrupt);
  CHECK(e.what.find("p/two") != std::string::npos);
  CHECK(dvrtest::tree(store.path() + "/pins").empty());  // nothing left pinned by the failed clone
}

TEST_CASE("clone: the pin of a killed clone is removed by gc while another clone of the same snapshot lives", "[clone]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(1u << 20, 6);
  Session s(store, "p");
  s.track("a", a.data(), a.size());
  s.snapshot("one");
  Clone alive = s.clone("one");
  pid_t child = ::fork();
  if (child == 0) {
    Store again = Store::open(dir.store());
    Clone doomed = again.open_snapshot("p", "one");
    ::_exit(0);  // no destructor: its pin stays, its lock goes with the process
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(dvrtest::tree(store.path() + "/pins").size() == 4);  // two pins, two lock files
  store.gc();
  CHECK(dvrtest::tree(store.path() + "/pins").size() == 2);  // the live clone's
  store.remove("p", "one");
  store.gc();
  CHECK(dvrtest::diff(alive.region("a").data(), a.data(), a.size()) == "");
}
