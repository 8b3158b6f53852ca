// Time travel: parent links forming a tree, diff between snapshots, and the
// newest intact snapshot after damage.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <thread>

#include "format/chunks.hpp"
#include "format/manifest.hpp"
#include "test_support.hpp"

using namespace dvr;
namespace fs = std::filesystem;
using dvrtest::TempDir;

TEST_CASE("timeline: restoring an older snapshot and snapshotting again starts a branch", "[timeline]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto d = dvrtest::random_bytes(300000, 1);
  Session s(store, "tt");
  s.track("d", d.data(), d.size());
  s.snapshot("base");
  d[10] ^= 1;
  s.snapshot("a1");
  d[20] ^= 1;
  s.snapshot("a2");
  s.restore("base");
  d[30] ^= 1;
  s.snapshot("b1");
  CHECK(store.info("tt", "a1").parent == "base");
  CHECK(store.info("tt", "a2").parent == "a1");
  CHECK(store.info("tt", "b1").parent == "base");
  s.restore("a2");
  CHECK(d[10] != dvrtest::random_bytes(300000, 1)[10]);
  CHECK(d[30] == dvrtest::random_bytes(300000, 1)[30]);
}

TEST_CASE("timeline: diff counts differing bytes and pages per region, across sessions", "[timeline]") {
  TempDir dir;
  Store store = Store::open(dir.store(), {.chunk_size = 16384});
  auto x = dvrtest::random_bytes(100000, 2);
  auto y = dvrtest::random_bytes(50000, 3);
  Session s(store, "one");
  s.track("x", x.data(), x.size());
  s.track("y", y.data(), y.size());
  s.snapshot("a");
  x[5] ^= 1;
  x[6] ^= 1;         // same page as 5
  x[4096 * 7] ^= 1;  // another page, another chunk
  x[99999] ^= 0xFF;  // last page
  s.snapshot("b");
  auto d = store.diff("one", "a", "one", "b");
  REQUIRE(d.size() == 2);
  CHECK(d[0].name == "x");
  CHECK(d[0].bytes_differ == 4);
  CHECK(d[0].pages_differ == 3);
  CHECK(d[1].name == "y");
  CHECK(d[1].bytes_differ == 0);

  Session t(store, "two");
  auto z = dvrtest::random_bytes(4096, 4);
  t.track("x", x.data(), x.size());
  t.track("z", z.data(), z.size());
  t.snapshot("c");
  auto e = store.diff("one", "b", "two", "c");
  REQUIRE(e.size() == 3);
  CHECK(e[0].name == "x");
  CHECK(e[0].bytes_differ == 0);
  CHECK(e[1].name == "y");
  CHECK(e[1].only_in_a);
  CHECK(e[1].bytes_differ == 50000);
  CHECK(e[2].name == "z");
  CHECK(e[2].only_in_b);
  CHECK(dvrtest::catch_error([&] { store.diff("one", "a", "one", "nope"); }).code == Errc::not_found);
}

TEST_CASE("timeline: latest() skips newer damaged snapshots and names them", "[timeline]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto d = dvrtest::random_bytes(200000, 5);
  Session s(store, "rec");
  CHECK_FALSE(s.latest().has_value());
  s.track("d", d.data(), d.size());
  s.snapshot("one");
  d[100] ^= 1;
  s.snapshot("two");
  d[150000] ^= 1;
  s.snapshot("three");
  CHECK(s.latest()->name == "three");
  // "three" loses its manifest's tail; "two" gets a flipped byte in a chunk of its own.
  auto m3 = dvrtest::read_file(dvrtest::manifest_path(store, "rec", "three"));
  dvrtest::write_file(dvrtest::manifest_path(store, "rec", "three"), m3.substr(0, m3.size() - 3));
  auto m2 = detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "rec", "two")), "two");
  auto at = detail::view_of(m2, 0).location(0);  // byte 100's page, which only "two" has
  REQUIRE(at.pack != 0);
  dvrtest::flip_byte(dvrtest::pack_path(store, at.pack), at.offset + 1);
  std::vector<std::string> skipped;
  auto found = store.latest("rec", &skipped);
  REQUIRE(found.has_value());
  CHECK(found->name == "one");
  REQUIRE(skipped.size() == 2);
  CHECK(skipped[0].rfind("rec/three", 0) == 0);
  CHECK(skipped[1].rfind("rec/two", 0) == 0);
}

TEST_CASE("autosave: due only after the period, keeps the newest N, never removes named snapshots", "[timeline][autosave]") {
  using namespace std::chrono_literals;
  TempDir dir;
  Store store = Store::open(dir.store());
  auto d = dvrtest::random_bytes(100000, 9);
  Session s(store, "auto");
  s.track("d", d.data(), d.size());
  CHECK_FALSE(s.checkpoint_point().has_value());  // off by default
  CHECK(dvrtest::catch_error([&] { s.autosave(10ms, 0); }).code == Errc::invalid_argument);
  s.snapshot("named-before");
  // A period long enough that a loaded machine's pauses do not make an
  // autosave due early (the "not due" checks below), short enough to wait.
  s.autosave(400ms, 2);
  CHECK_FALSE(s.checkpoint_point().has_value());  // not due yet
  std::vector<std::string> taken;
  for (int i = 0; i < 4; ++i) {
    d[static_cast<std::size_t>(i)] ^= 1;
    std::this_thread::sleep_for(420ms);
    auto a = s.checkpoint_point();
    REQUIRE(a.has_value());
    CHECK(a->label == "autosave");
    taken.push_back(a->name);
    CHECK_FALSE(s.checkpoint_point().has_value());  // just taken: not due again
    if (i == 1) s.snapshot("named-middle");
  }
  CHECK(taken == std::vector<std::string>{"autosave-1", "autosave-2", "autosave-3", "autosave-4"});
  std::vector<std::string> names;
  for (auto& i : s.list())
    names.push_back(i.name);
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"autosave-3", "autosave-4", "named-before", "named-middle"});
  // The newest autosave restores what was saved, and a new run continues the numbering.
  s.restore("autosave-4");
  Session again(store, "auto");
  again.track("d", d.data(), d.size());
  again.autosave(1ms, 2);
  std::this_thread::sleep_for(5ms);
  CHECK(again.checkpoint_point()->name == "autosave-5");
}

TEST_CASE("autosave: announced in the store's job registry, failures and all, for dvr serve", "[timeline][autosave][jobs]") {
  using namespace std::chrono_literals;
  TempDir dir;
  Store store = Store::open(dir.store());
  auto d = dvrtest::random_bytes(100000, 19);
  auto records = [&] { return dvr::read_jobs(store.path()); };
  {
    Session s(store, "auto");
    s.track("d", d.data(), d.size());
    CHECK(records().empty());  // nothing before autosave is on
    s.autosave(20ms, 3);
    auto r = records();
    REQUIRE(r.size() == 1);
    CHECK(r[0].pid == ::getpid());
    CHECK(r[0].kind == "autosave");
    CHECK(r[0].session == "auto");
    CHECK(r[0].interval_s == Approx(0.02));
    CHECK(r[0].last_dump.empty());
    CHECK(r[0].started_ns > 0);
    CHECK(r[0].command.find("dvr-unit-tests") != std::string::npos);
    CHECK(dvr::job_alive(r[0]));
    CHECK(fs::exists(store.path() + "/run/" + std::to_string(::getpid()) + ".autosave.auto.json"));

    std::this_thread::sleep_for(25ms);
    REQUIRE(s.checkpoint_point()->name == "autosave-1");
    r = records();
    REQUIRE(r.size() == 1);
    CHECK(r[0].last_dump == "auto/autosave-1");
    CHECK(r[0].last_dump_ns >= r[0].started_ns);
    CHECK(r[0].last_error.empty());

    // A failed autosave (its name taken meanwhile by another writer of the
    // session) is the record's last error, and the exception still reaches
    // the program; the next point takes the next number and clears it.
    {
      auto other = dvrtest::random_bytes(4096, 20);
      Session aside(store, "auto");
      aside.track("d", other.data(), other.size());
      aside.snapshot("autosave-2");
    }
    std::this_thread::sleep_for(25ms);
    CHECK(dvrtest::catch_error([&] { s.checkpoint_point(); }).code == Errc::already_exists);
    r = records();
    REQUIRE(r.size() == 1);
    CHECK(r[0].last_error.find("autosave-2") != std::string::npos);
    CHECK(r[0].last_dump == "auto/autosave-1");
    std::this_thread::sleep_for(25ms);
    REQUIRE(s.checkpoint_point()->name == "autosave-3");
    r = records();
    REQUIRE(r.size() == 1);
    CHECK(r[0].last_error.empty());
    CHECK(r[0].last_dump == "auto/autosave-3");

    // Turned off: the record goes.
    s.autosave(0ms, 0);
    CHECK(records().empty());
    // On again, and the session ends cleanly: it goes with the session.
    s.autosave(1h, 1);
    CHECK(records().size() == 1);
  }
  CHECK(records().empty());
  {
    // Ends after a failed autosave: the record stays (autosave_failed) until
    // it is removed (dvr serve's dismiss).
    Session s(store, "auto");
    s.track("d", d.data(), d.size());
    // autosave() continues after the highest autosave-N of the session: take
    // that next number from aside once it is on.
    std::uint64_t highest = 0;
    for (auto& i : s.list())
      if (i.name.rfind("autosave-", 0) == 0) highest = std::max<std::uint64_t>(highest, std::stoull(i.name.substr(9)));
    s.autosave(1ms, 2);
    {
      Session aside(store, "auto");
      aside.track("d", d.data(), d.size());
      aside.snapshot("autosave-" + std::to_string(highest + 1));
    }
    std::this_thread::sleep_for(3ms);
    CHECK(dvrtest::catch_error([&] { s.checkpoint_point(); }).code == Errc::already_exists);
  }
  auto left = records();
  REQUIRE(left.size() == 1);
  CHECK_FALSE(left[0].last_error.empty());
  dvr::remove_job(store.path(), left[0]);
  CHECK(records().empty());
}

TEST_CASE("jobs: records are read only from files named for them, bad session names are refused", "[jobs]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  dvr::JobRecord r;
  r.pid = ::getpid();
  r.start_ticks = dvr::process_start_ticks(r.pid);
  r.kind = "run";
  r.command = "job";
  dvr::write_job(store.path(), r);
  dvr::JobRecord a = r;
  a.kind = "autosave";
  a.session = "s.1";
  dvr::write_job(store.path(), a);
  a.session = "../escape";
  CHECK(dvrtest::catch_error([&] { dvr::write_job(store.path(), a); }).code == Errc::invalid_argument);
  CHECK_FALSE(fs::exists(store.path() + "/escape.json"));
  auto all = dvr::read_jobs(store.path());
  REQUIRE(all.size() == 2);
  CHECK(all[0].kind == "run");
  CHECK(all[1].session == "s.1");
  CHECK(dvr::process_command(r.pid).find("dvr-unit-tests") != std::string::npos);
  // A record that speaks for another process or session than its file name
  // says, damaged JSON, and a link are skipped.
  const std::string run = store.path() + "/run/";
  fs::copy_file(run + std::to_string(r.pid) + ".json", run + "1.json");
  fs::copy_file(run + std::to_string(r.pid) + ".autosave.s.1.json", run + std::to_string(r.pid) + ".autosave.other.json");
  std::ofstream(run + "2.json") << "{not json";
  fs::create_symlink(run + std::to_string(r.pid) + ".json", run + "3.json");
  CHECK(dvr::read_jobs(store.path()).size() == 2);
  // An ended process's record is not alive.
  dvr::JobRecord gone = r;
  gone.start_ticks += 1;
  CHECK_FALSE(dvr::job_alive(gone));
  CHECK(dvr::job_alive(r));
  dvr::remove_job(store.path(), r);
  dvr::remove_job(store.path(), all[1]);
  CHECK(dvr::read_jobs(store.path()).empty());
}
