// Unit tests of failures: restore errors leave live memory untouched, damaged
// packs and manifests are reported (restore, info, list, verify), names that
// could escape the store are refused, and the API's rules are enforced.
#include <sys/mman.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <set>
#include <tuple>

#include "format/manifest.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvrtest::Caught;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;

namespace {

dvr::detail::Manifest read_manifest(const Store& store, const std::string& session, const std::string& snap) {
  std::string file = dvrtest::manifest_path(store, session, snap);
  return dvr::detail::decode_manifest(dvrtest::read_file(file), file);
}

std::string pack_path(const Store& store, std::uint32_t pack) {
  char name[32];
  std::snprintf(name, sizeof name, "/packs/%08u.pack", pack);
  return store.path() + name;
}

// Flips a byte in the middle of the last stored (non-zero) chunk of a snapshot.
// Returns the pack file it damaged.
std::string damage_last_chunk(const Store& store, const std::string& session, const std::string& snap) {
  auto m = read_manifest(store, session, snap);
  for (auto it = m.chunks.rbegin(); it != m.chunks.rend(); ++it) {
    if (it->is_zero()) continue;
    REQUIRE(it->offset >= 4096);  // chunk data lives past the pack header
    std::string file = pack_path(store, it->pack);
    dvrtest::flip_byte(file, it->offset + it->length / 2);
    return file;
  }
  FAIL("snapshot " << session << "/" << snap << " has no stored chunk");
  return "";
}

void truncate_manifest(const Store& store, const std::string& session, const std::string& snap) {
  std::string file = dvrtest::manifest_path(store, session, snap);
  auto bytes = dvrtest::read_file(file);
  REQUIRE(bytes.size() > 50);
  dvrtest::write_file(file, bytes.substr(0, bytes.size() / 2));
}

// A session with two regions and a snapshot "good", whose live memory is then
// changed; `now_*` hold the changed content every failed restore must keep.
struct Fixture {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> a = dvrtest::random_bytes(3 * 65536 + 99, 900);
  std::vector<unsigned char> b = dvrtest::random_bytes(2 * 65536, 901);
  std::vector<unsigned char> good_a, good_b, now_a, now_b;
  Session s{store, "sess"};
  Fixture() {
    s.track("a", a.data(), a.size());
    s.track("b", b.data(), b.size());
    s.snapshot("good");
    good_a = a;
    good_b = b;
    dvrtest::fill_random(a.data(), a.size(), 902);
    dvrtest::fill_random(b.data(), b.size(), 903);
    now_a = a;
    now_b = b;
  }
  bool untouched() const { return a == now_a && b == now_b; }
};

}  // namespace

TEST_CASE("restore errors: unknown snapshot is not_found and changes nothing", "[errors]") {
  Fixture f;
  auto e = catch_error([&] { f.s.restore("missing"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("missing"));
  CHECK(f.untouched());
  CHECK(f.s.head() == "good");
  e = catch_error([&] { f.store.info("sess", "missing"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("sess/missing"));
}

TEST_CASE("restore errors: unknown session is not_found and changes nothing", "[errors]") {
  Fixture f;
  Session ghost(f.store, "ghost");
  ghost.track("a", f.a.data(), f.a.size());
  auto e = catch_error([&] { ghost.restore("good"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("ghost"));
  CHECK(f.untouched());
  CHECK(catch_error([&] { f.store.info("ghost", "good"); }).code == Errc::not_found);
}

TEST_CASE("restore errors: a region whose size changed is invalid_argument and changes nothing", "[errors]") {
  Fixture f;
  std::vector<unsigned char> bigger(f.a.size() + 1, 0x33);
  auto bigger0 = bigger;
  Session s2(f.store, "sess");
  s2.track("b", f.b.data(), f.b.size());  // right size, listed first
  s2.track("a", bigger.data(), bigger.size());
  auto e = catch_error([&] { s2.restore("good"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("'a'"));
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK_THAT(e.what, Catch::Contains(std::to_string(f.a.size())));
  CHECK(f.untouched());
  CHECK(diff(bigger, bigger0) == "");
  // Smaller is refused too.
  Session s3(f.store, "sess");
  s3.track("a", f.a.data(), f.a.size() - 1);
  s3.track("b", f.b.data(), f.b.size());
  CHECK(catch_error([&] { s3.restore("good"); }).code == Errc::invalid_argument);
  CHECK(f.untouched());
}

TEST_CASE("restore errors: a region missing from the session is invalid_argument and changes nothing", "[errors]") {
  Fixture f;
  Session s2(f.store, "sess");
  s2.track("a", f.a.data(), f.a.size());  // "b" is missing
  auto e = catch_error([&] { s2.restore("good"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("'b'"));
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK(f.untouched());
}

TEST_CASE("restore errors: corrupt chunk data is detected before any byte changes", "[errors]") {
  Fixture f;
  // Damage the last chunk of the last region, so a restore that wrote as it
  // checked would already have changed region "a".
  std::string pack = damage_last_chunk(f.store, "sess", "good");
  CHECK_THAT(pack, Catch::EndsWith("/packs/00000001.pack"));
  auto e = catch_error([&] { f.s.restore("good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK(f.untouched());
  CHECK(f.s.head() == "good");

  // Store::info reads only the manifest, which is fine.
  CHECK_FALSE(f.store.info("sess", "good").damaged);
  auto report = f.store.verify();
  CHECK_FALSE(report.ok());
  CHECK(report.damaged_snapshots() == std::vector<std::string>{"sess/good"});
  REQUIRE(report.problems.size() >= 1);
  CHECK(report.problems[0].session == "sess");
  CHECK(report.problems[0].snapshot == "good");
  CHECK_THAT(report.problems[0].what, Catch::Contains("'b'"));
}

TEST_CASE("restore errors: damage in the first chunk is found too", "[errors]") {
  Fixture f;
  auto m = read_manifest(f.store, "sess", "good");
  REQUIRE_FALSE(m.chunks.empty());
  REQUIRE_FALSE(m.chunks[0].is_zero());
  dvrtest::flip_byte(pack_path(f.store, m.chunks[0].pack), m.chunks[0].offset);
  auto e = catch_error([&] { f.s.restore("good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK_THAT(e.what, Catch::Contains("'a'"));
  CHECK(f.untouched());
}

TEST_CASE("restore errors: a missing pack file is corrupt and changes nothing", "[errors]") {
  Fixture f;
  for (auto& p : dvrtest::pack_files(f.store))
    REQUIRE(::unlink(p.c_str()) == 0);
  auto e = catch_error([&] { f.s.restore("good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK(f.untouched());
  CHECK(f.store.verify().damaged_snapshots() == std::vector<std::string>{"sess/good"});
}

TEST_CASE("restore errors: a truncated pack file is corrupt and changes nothing", "[errors]") {
  Fixture f;
  auto m = read_manifest(f.store, "sess", "good");
  std::uint64_t last_end = 0;
  for (auto& c : m.chunks)
    if (!c.is_zero()) last_end = std::max<std::uint64_t>(last_end, c.offset + c.length);
  REQUIRE(last_end > 8192);
  std::string pack = pack_path(f.store, m.chunks.back().pack);
  REQUIRE(::truncate(pack.c_str(), static_cast<off_t>(last_end - 100)) == 0);
  auto e = catch_error([&] { f.s.restore("good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK(f.untouched());
  CHECK(f.store.verify().damaged_snapshots() == std::vector<std::string>{"sess/good"});
}

TEST_CASE("restore errors: a truncated manifest is corrupt for restore and info, damaged in list()", "[errors]") {
  Fixture f;
  truncate_manifest(f.store, "sess", "good");
  auto e = catch_error([&] { f.s.restore("good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));
  CHECK(f.untouched());

  e = catch_error([&] { f.store.info("sess", "good"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("sess/good"));

  auto list = f.store.list("sess");
  REQUIRE(list.size() == 1);
  CHECK(list[0].name == "good");
  CHECK(list[0].session == "sess");
  CHECK(list[0].damaged);
  CHECK_FALSE(list[0].damage.empty());
  REQUIRE(f.store.list().size() == 1);
  CHECK(f.store.list()[0].damaged);
  CHECK(f.store.sessions() == std::vector<std::string>{"sess"});

  auto report = f.store.verify();
  CHECK(report.damaged_snapshots() == std::vector<std::string>{"sess/good"});
  // An empty manifest file is just as damaged.
  dvrtest::write_file(dvrtest::manifest_path(f.store, "sess", "good"), "");
  CHECK(catch_error([&] { f.store.info("sess", "good"); }).code == Errc::corrupt);
  CHECK(f.store.list("sess").at(0).damaged);
}

TEST_CASE("restore errors: a manifest copied under another name is corrupt", "[errors]") {
  Fixture f;
  std::string from = dvrtest::manifest_path(f.store, "sess", "good");
  std::string to = dvrtest::manifest_path(f.store, "sess", "alias");
  dvrtest::write_file(to, dvrtest::read_file(from));
  auto e = catch_error([&] { f.s.restore("alias"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("alias"));
  CHECK(f.untouched());
}

TEST_CASE("verify: clean on a healthy store, and names every damaged snapshot of both kinds", "[errors][verify]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  auto data = dvrtest::random_bytes(4 * cs + 10, 950);
  Session s(store, "v");
  s.track("r", data.data(), data.size());
  s.snapshot("ok1");
  s.snapshot("ok1-again");  // shares every chunk with ok1
  std::vector<std::string> names = {"badchunk", "badmanifest", "ok2"};
  for (std::size_t i = 0; i < names.size(); ++i) {
    dvrtest::fill_random(data.data(), data.size(), 960 + i);
    s.snapshot(names[i]);
  }
  std::vector<unsigned char> other = dvrtest::random_bytes(cs, 970);
  Session t(store, "w");
  t.track("r", other.data(), other.size());
  t.snapshot("ok3");

  std::vector<std::pair<std::uint64_t, std::uint64_t>> seen;
  auto clean = store.verify([&](std::uint64_t done, std::uint64_t total) { seen.emplace_back(done, total); });
  CHECK(clean.ok());
  CHECK(clean.problems.empty());
  CHECK(clean.damaged_snapshots().empty());
  CHECK(clean.snapshots == 6);
  CHECK(clean.chunks == 4 * 5 + 1);  // distinct stored chunks: ok1, badchunk, badmanifest, ok2 (5 each), ok3 (1)
  CHECK(clean.bytes == 4 * data.size() + cs);
  // Progress: totals are the bytes to re-hash, and the end is reported.
  REQUIRE_FALSE(seen.empty());
  std::uint64_t most = 0;
  for (auto& [done, total] : seen) {
    CHECK(total == clean.bytes);
    CHECK(done <= total);
    most = std::max(most, done);
  }
  CHECK(most == clean.bytes);

  damage_last_chunk(store, "v", "badchunk");
  truncate_manifest(store, "v", "badmanifest");
  auto report = store.verify();
  CHECK_FALSE(report.ok());
  CHECK(report.damaged_snapshots() == std::vector<std::string>{"v/badchunk", "v/badmanifest"});
  std::set<std::string> mentioned;
  for (auto& p : report.problems) {
    INFO(p.session << "/" << p.snapshot << ": " << p.what);
    CHECK_FALSE(p.what.empty());
    mentioned.insert(p.snapshot);
  }
  CHECK(mentioned == std::set<std::string>{"badchunk", "badmanifest"});
  // The healthy ones still restore.
  std::vector<unsigned char> live(data.size());
  Session r(store, "v");
  r.track("r", live.data(), live.size());
  r.restore("ok2");
  CHECK(diff(live, data) == "");
  // Removing the damaged snapshots makes verify clean again.
  store.remove("v", "badchunk");
  store.remove("v", "badmanifest");
  CHECK(store.verify().ok());
}

TEST_CASE("restore errors: a crafted chunk reference outside its pack is rejected without a stray read", "[errors][bug]") {
  // A manifest with a valid checksum (checksums are not signatures: a snapshot
  // received from another machine can say anything) whose chunk offset points
  // past the end of the address range. offset + length wraps around 2^64, so
  // a bounds check written as `offset + length > size` passes.
  Fixture f;
  auto m = read_manifest(f.store, "sess", "good");
  std::size_t victim = m.chunks.size() - 1;
  REQUIRE_FALSE(m.chunks[victim].is_zero());
  std::string file = dvrtest::manifest_path(f.store, "sess", "good");

  SECTION("offset inside the pack header") {
    m.chunks[victim].offset = 0;
    dvrtest::write_file(file, dvr::detail::encode_manifest(m));
    CHECK(catch_error([&] { f.s.restore("good"); }).code == Errc::corrupt);
    CHECK(f.untouched());
  }
  SECTION("offset past the end of the pack") {
    m.chunks[victim].offset = 1ull << 40;
    dvrtest::write_file(file, dvr::detail::encode_manifest(m));
    CHECK(catch_error([&] { f.s.restore("good"); }).code == Errc::corrupt);
    CHECK(f.untouched());
  }
  SECTION("a pack that does not exist") {
    m.chunks[victim].pack = 999;
    dvrtest::write_file(file, dvr::detail::encode_manifest(m));
    auto e = catch_error([&] { f.s.restore("good"); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("sess/good"));
    CHECK(f.untouched());
  }
  SECTION("offset + length wraps around 2^64") {
    m.chunks[victim].offset = ~0ull - m.chunks[victim].length + 2;
    dvrtest::write_file(file, dvr::detail::encode_manifest(m));
    // Run the restore in a child: the bug makes it read memory before the pack
    // mapping, which may crash.
    int pipefd[2];
    REQUIRE(::pipe(pipefd) == 0);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // Die of the signal itself instead of running Catch's handler in the child.
      ::signal(SIGSEGV, SIG_DFL);
      ::signal(SIGBUS, SIG_DFL);
      ::close(pipefd[0]);
      auto e = catch_error([&] { f.s.restore("good"); });
      std::string out = std::string(dvr::errc_name(e.code)) + "\n" + e.what;
      if (::write(pipefd[1], out.data(), out.size()) < 0) _exit(3);
      _exit(0);
    }
    ::close(pipefd[1]);
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;)
      out.append(buf, static_cast<std::size_t>(n));
    ::close(pipefd[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    INFO("child said: " << out);
    INFO("child killed by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
    REQUIRE_FALSE(WIFSIGNALED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK_THAT(out, Catch::StartsWith("corrupt\n"));
    // Rejected as a bad reference, not by hashing bytes read from outside the pack.
    CHECK_THAT(out, !Catch::Contains("checksum"));
  }
}

// ---------------------------------------------------------------- names

namespace {

std::vector<std::string> bad_names() {
  return {
      "",
      "a/b",
      "/abs",
      "..",
      ".",
      "../x",
      "../../x",
      ".hidden",
      std::string(129, 'n'),
      "with space",
      std::string("nul\0byte", 8),
      std::string("\0", 1),
      "tab\there",
      "new\nline",
      "back\\slash",
      "star*",
      "\xc3\xbc"  // "ü" in UTF-8
  };
}

}  // namespace

TEST_CASE("names: bad session, snapshot and region names are invalid_argument and create nothing", "[errors][names]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(1000, 980);
  Session good(store, "good");
  good.track("r", data.data(), data.size());
  good.snapshot("snap");
  auto outside_before = dvrtest::tree(dir.path());

  for (auto& bad : bad_names()) {
    INFO("name '" << bad << "' (" << bad.size() << " bytes)");
    auto e = catch_error([&] { Session s(store, bad); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains("session"));

    std::vector<unsigned char> buf(100);
    Session s(store, "names");
    e = catch_error([&] { s.track(bad, buf.data(), buf.size()); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK(catch_error([&] { s.alloc(bad, 4096); }).code == Errc::invalid_argument);
    CHECK(s.regions().empty());

    s.track("ok", buf.data(), buf.size());
    e = catch_error([&] { s.snapshot(bad); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains("snapshot"));
    CHECK(catch_error([&] { s.snapshot(bad, {.label = "", .replace = true}); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { good.restore(bad); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { store.info("good", bad); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { store.info(bad, "snap"); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { store.remove("good", bad); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { store.remove(bad, "snap"); }).code == Errc::invalid_argument);
    CHECK(catch_error([&] { store.list(bad); }).code == Errc::invalid_argument);
  }
  // Nothing appeared anywhere: not next to the store, not inside it.
  CHECK(dvrtest::tree(dir.path()) == outside_before);
  CHECK(store.sessions() == std::vector<std::string>{"good"});
  CHECK(store.list().size() == 1);
  CHECK(store.verify().ok());
  // The good snapshot was not removed by a name like "../good/snap".
  CHECK(catch_error([&] { store.remove("good", "../good/snap"); }).code == Errc::invalid_argument);
  CHECK(store.info("good", "snap").name == "snap");
}

TEST_CASE("names: the longest and oddest valid names work end to end", "[errors][names]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::string longest(128, 'x');
  auto data = dvrtest::random_bytes(3000, 990);
  auto data0 = data;
  for (std::string name : {longest, std::string("a..b"), std::string("A-Z_a-z.0-9"), std::string("-dash"), std::string("x.")}) {
    INFO(name);
    Session s(store, name);
    s.track(name, data.data(), data.size());
    s.snapshot(name);
    dvrtest::fill_random(data.data(), data.size(), 991);
    s.restore(name);
    CHECK(diff(data, data0) == "");
    CHECK(store.info(name, name).regions.at(0).name == name);
  }
  CHECK(store.sessions().size() == 5);
}

// ---------------------------------------------------------------- API rules

TEST_CASE("api: track() refuses overlapping regions with invalid_argument", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> buf(10000);
  Session s(store, "ov");
  s.track("mid", buf.data() + 1000, 1000);  // [1000, 2000)
  struct Case {
    const char* what;
    std::size_t off, len;
  };
  for (auto c : {Case{"same range", 1000, 1000}, Case{"overlaps the start", 500, 501}, Case{"overlaps the end", 1999, 100},
                 Case{"contains it", 0, 5000}, Case{"inside it", 1500, 1}, Case{"one byte at its end", 1999, 1}}) {
    INFO(c.what);
    auto e = catch_error([&] { s.track("new", buf.data() + c.off, c.len); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains("mid"));
    CHECK_THAT(e.what, Catch::Contains("new"));
  }
  CHECK(s.regions().size() == 1);
  // Adjacent on both sides is fine.
  s.track("before", buf.data(), 1000);
  s.track("after", buf.data() + 2000, 1000);
  CHECK(s.regions().size() == 3);
  // Memory of an alloc()ed region cannot be tracked again.
  auto& sdk = s.alloc("sdk", 8192);
  CHECK(catch_error([&] { s.track("alias", static_cast<char*>(sdk.data()) + 100, 10); }).code == Errc::invalid_argument);
  // Overlap is per session: another session may track the same memory.
  Session other(store, "ov2");
  CHECK(other.track("mid", buf.data() + 1000, 1000).size() == 1000);
}

TEST_CASE("api: a region that wraps around the address space is invalid_argument", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> a(100);
  Session s(store, "wrap");
  auto e = catch_error([&] { s.track("r", a.data(), SIZE_MAX); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK(s.regions().empty());
}

TEST_CASE("api: duplicate region names are already_exists", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> a(100), b(100);
  Session s(store, "dup");
  s.track("r", a.data(), a.size());
  auto e = catch_error([&] { s.track("r", b.data(), b.size()); });
  CHECK(e.code == Errc::already_exists);
  CHECK_THAT(e.what, Catch::Contains("'r'"));
  CHECK(catch_error([&] { s.alloc("r", 4096); }).code == Errc::already_exists);
  s.alloc("sdk", 4096);
  CHECK(catch_error([&] { s.track("sdk", b.data(), b.size()); }).code == Errc::already_exists);
  CHECK(catch_error([&] { s.alloc("sdk", 4096); }).code == Errc::already_exists);
  CHECK(s.regions().size() == 2);
  CHECK(s.region("r").data() == a.data());
}

TEST_CASE("api: size 0 and null pointers are invalid_argument", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> a(100);
  Session s(store, "zero");
  auto e = catch_error([&] { s.track("r", a.data(), 0); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("'r'"));
  CHECK(catch_error([&] { s.alloc("r", 0); }).code == Errc::invalid_argument);
  CHECK(catch_error([&] { s.track("r", nullptr, 100); }).code == Errc::invalid_argument);
  CHECK(s.regions().empty());
}

TEST_CASE("api: a snapshot with no regions is invalid_argument and publishes nothing", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "empty");
  auto e = catch_error([&] { s.snapshot("nothing"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("empty"));
  CHECK(store.sessions().empty());
  CHECK(catch_error([&] { store.info("empty", "nothing"); }).code == Errc::not_found);
  CHECK(s.head().empty());
  // After untracking the last region, likewise.
  std::vector<unsigned char> a(10, 1);
  s.track("r", a.data(), a.size());
  s.untrack("r");
  CHECK(catch_error([&] { s.snapshot("nothing"); }).code == Errc::invalid_argument);
  CHECK(store.list("empty").empty());
}

TEST_CASE("api: region() finds regions by name, regions() keeps track order", "[errors][api]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> a(10), b(20);
  Session s(store, "lookup");
  CHECK(s.name() == "lookup");
  CHECK(s.store().path() == store.path());
  s.track("b", b.data(), b.size());
  s.track("a", a.data(), a.size());
  auto rs = s.regions();
  REQUIRE(rs.size() == 2);
  CHECK(rs[0]->name() == "b");
  CHECK(rs[1]->name() == "a");
  CHECK(s.region("a").size() == 10);
  CHECK(s.region("a").data() == a.data());
  CHECK_FALSE(s.region("a").sdk_owned());
  auto e = catch_error([&] { s.region("c"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("'c'"));
}

TEST_CASE("api: errc_name gives stable names", "[errors][api]") {
  CHECK(std::string(dvr::errc_name(Errc::not_found)) == "not_found");
  CHECK(std::string(dvr::errc_name(Errc::already_exists)) == "already_exists");
  CHECK(std::string(dvr::errc_name(Errc::corrupt)) == "corrupt");
  CHECK(std::string(dvr::errc_name(Errc::no_space)) == "no_space");
  CHECK(std::string(dvr::errc_name(Errc::invalid_argument)) == "invalid_argument");
  CHECK(std::string(dvr::errc_name(Errc::io)) == "io");
  CHECK(std::string(dvr::errc_name(Errc::unsupported)) == "unsupported");
  CHECK(std::string(dvr::errc_name(Errc::permission)) == "permission");
  CHECK_FALSE(std::string(dvr::version()).empty());
}

TEST_CASE("an unknown snapshot or session names the store and the closest name", "[errors]") {
  TempDir dir;
  Store store = Store::open(dir.path() + "/s");
  Session s(store, "sweep");
  std::vector<char> buf(8192, 1);
  s.track("a", buf.data(), buf.size());
  s.snapshot("loaded");
  s.snapshot("trial-1");
  auto e = catch_error([&] { store.info("sweep", "loadd"); });
  CHECK(e.code == Errc::not_found);
  const std::string msg = e.what;
  CHECK(msg.find("(did you mean 'loaded'?)") != std::string::npos);
  CHECK(msg.find("`dvr --store " + store.path() + " ls sweep`") != std::string::npos);
  auto e2 = catch_error([&] { store.info("swep", "loaded"); });
  CHECK(e2.what.find("no session 'swep'") != std::string::npos);
  CHECK(e2.what.find("(did you mean 'sweep'?)") != std::string::npos);
  // Nothing close: no guess.
  auto e3 = catch_error([&] { store.info("sweep", "zzzzzzzz"); });
  CHECK(e3.what.find("did you mean") == std::string::npos);
}

TEST_CASE("errors: memory that is not mapped read-write cannot be tracked (a later snapshot or restore would crash)", "[errors][track]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "ro");
  const std::size_t n = 4 * 4096;
  auto* ro = static_cast<char*>(::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  auto* none = static_cast<char*>(::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  auto* gone = static_cast<char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  REQUIRE((ro != MAP_FAILED && none != MAP_FAILED && gone != MAP_FAILED));
  REQUIRE(::munmap(gone + 2 * 4096, 2 * 4096) == 0);  // half of it unmapped
  static const char text[8192] = "read-only data of the program";
  for (auto [name, p, len] : {std::tuple<const char*, const void*, std::size_t>{"ro", ro, n}, {"none", none, n}, {"gone", gone, n},
                              {"const", text, sizeof text}}) {
    INFO(name);
    Caught c = catch_error([&] { s.track(name, const_cast<void*>(p), len); });
    CHECK(c.code == Errc::invalid_argument);
    CHECK(c.what.find("not all mapped readable and writable") != std::string::npos);
  }
  CHECK(s.regions().empty());
  s.track("ok", gone, 2 * 4096);  // the part still mapped
  s.snapshot("one");
  ::munmap(ro, n);
  ::munmap(none, n);
  s.untrack("ok");
  ::munmap(gone, 2 * 4096);
}
