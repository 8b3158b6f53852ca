// Incremental snapshots and rollback restores (write-protect tracking), checked
// against plain copies kept by the test, in both tracking modes.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>

#include "format/manifest.hpp"
#include "format/chunks.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

struct Anon {
  explicit Anon(std::size_t n) : size(n) {
    p = static_cast<unsigned char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    REQUIRE(p != MAP_FAILED);
  }
  ~Anon() { ::munmap(p, size); }
  unsigned char* p;
  std::size_t size;
};

// One random way of changing memory: a byte, a run across pages, memcpy from
// elsewhere in the region, or dropping pages (they read back as zeros).
void mutate(std::mt19937_64& rng, unsigned char* p, std::size_t n, bool page_aligned) {
  switch (rng() % 4) {
    case 0:
      p[rng() % n] ^= static_cast<unsigned char>(1 + rng() % 255);
      break;
    case 1: {
      std::size_t at = rng() % n, len = std::min<std::size_t>(n - at, 1 + rng() % 20000);
      std::memset(p + at, static_cast<int>(rng() & 0xFF), len);
      break;
    }
    case 2: {
      std::size_t len = 1 + rng() % std::min<std::size_t>(n, 70000);
      std::size_t from = rng() % (n - len + 1), to = rng() % (n - len + 1);
      std::memmove(p + to, p + from, len);
      break;
    }
    default:
      if (page_aligned && n >= 3 * 4096) {
        std::size_t page = rng() % (n / 4096 - 2);
        REQUIRE(::madvise(p + page * 4096, 2 * 4096, MADV_DONTNEED) == 0);
      } else {
        p[rng() % n] = 0;
      }
  }
}

void random_history(Tracking mode, std::uint64_t seed) {
  TempDir dir;
  Store store = Store::open(dir.store(), {.chunk_size = 16384});
  std::mt19937_64 rng(seed);
  // An SDK-owned region, a caller buffer at an odd address, and an anonymous
  // mapping (page-aligned, so MADV_DONTNEED can be used on it).
  std::vector<unsigned char> heap(300000 + 4096);
  unsigned char* odd = heap.data() + 1 + seed % 3000;
  const std::size_t odd_size = 300000;
  Anon anon(40 * 4096 + 100);
  Session s(store, "hist", {.tracking = mode});
  auto& owned = s.alloc("owned", 200000);
  s.track("odd", odd, odd_size);
  s.track("anon", anon.p, anon.size);
  auto* own = static_cast<unsigned char*>(owned.data());
  dvrtest::fill_random(own, owned.size(), seed);
  dvrtest::fill_random(odd, odd_size, seed + 1);
  dvrtest::fill_random(anon.p, anon.size, seed + 2);
  if (mode == Tracking::hash) {
    CHECK(s.tracking("owned") == Tracking::hash);
  } else if (s.tracking("owned") == Tracking::hash) {
    WARN("write-protect tracking unavailable here: " << s.tracking_note());
  }

  struct Copy {
    std::vector<unsigned char> owned, odd, anon;
  };
  auto capture = [&] { return Copy{{own, own + owned.size()}, {odd, odd + odd_size}, {anon.p, anon.p + anon.size}}; };
  std::map<std::string, Copy> expected;
  std::vector<std::string> names;
  for (int step = 0; step < 60; ++step) {
    int action = static_cast<int>(rng() % 10);
    if (action < 5 || names.empty()) {
      for (int k = static_cast<int>(rng() % 4); k >= 0; --k) {
        switch (rng() % 3) {
          case 0:
            mutate(rng, own, owned.size(), false);
            break;
          case 1:
            mutate(rng, odd, odd_size, false);
            break;
          default:
            mutate(rng, anon.p, anon.size, true);
            break;
        }
      }
    } else if (action < 8) {
      std::string name = "s" + std::to_string(step);
      auto info = s.snapshot(name);
      CHECK(info.chunks_read <= info.chunks);
      expected[name] = capture();
      names.push_back(name);
    } else {
      const std::string& name = names[rng() % names.size()];
      s.restore(name);
      auto now = capture();
      INFO("seed " << seed << " step " << step << " restore " << name);
      REQUIRE(dvrtest::diff(now.owned, expected[name].owned) == "");
      REQUIRE(dvrtest::diff(now.odd, expected[name].odd) == "");
      REQUIRE(dvrtest::diff(now.anon, expected[name].anon) == "");
    }
  }
  // Every snapshot, restored in a fresh process-like session, is what was captured.
  Session fresh(store, "hist", {.tracking = Tracking::hash});
  std::vector<unsigned char> o2(owned.size()), d2(odd_size), a2(anon.size);
  fresh.track("owned", o2.data(), o2.size());
  fresh.track("odd", d2.data(), d2.size());
  fresh.track("anon", a2.data(), a2.size());
  for (auto& name : names) {
    fresh.restore(name);
    INFO("seed " << seed << " snapshot " << name);
    CHECK(dvrtest::diff(o2, expected[name].owned) == "");
    CHECK(dvrtest::diff(d2, expected[name].odd) == "");
    CHECK(dvrtest::diff(a2, expected[name].anon) == "");
  }
  CHECK(store.verify().ok());
}

}  // namespace

TEST_CASE("incremental: random writes, snapshots and restores match plain copies (write_protect)", "[incremental]") {
  for (std::uint64_t seed = 1; seed <= 12; ++seed)
    random_history(Tracking::write_protect, seed);
}

TEST_CASE("incremental: random writes, snapshots and restores match plain copies (hash)", "[incremental]") {
  for (std::uint64_t seed = 101; seed <= 106; ++seed)
    random_history(Tracking::hash, seed);
}

TEST_CASE("incremental: pages of an alloc() region first written after its first snapshot are tracked, filled or not before it", "[incremental]") {
  // alloc() registers its memory for tracking without protecting it (its
  // first writes cost one fault each): the first snapshot protects it all,
  // the pages never written before it included.
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "holes");
  auto& r = s.alloc("data", 16u << 20);
  if (s.tracking("data") != Tracking::write_protect) DVR_SKIP("write-protect tracking not in use here: " << dvrtest::no_write_protect_why(s));
  auto* p = static_cast<unsigned char*>(r.data());
  const std::size_t cs = store.chunk_size();
  dvrtest::fill_random(p, 4 * cs, 11);  // chunks 0-3 written, the rest never touched
  auto first = s.snapshot("a");
  CHECK(first.chunks_read == first.chunks);
  std::vector<unsigned char> at_a(p, p + r.size());
  p[10 * cs + 7] = 1;   // a page never written before
  p[cs + 100] ^= 0xff;  // a page written before
  p[r.size() - 1] = 2;  // the last page, never written before
  auto second = s.snapshot("b");
  CHECK(second.tracking == "write_protect");
  CHECK(second.chunks_read == 3);
  CHECK(second.stored_bytes == 3 * 4096);
  std::vector<unsigned char> at_b(p, p + r.size());
  s.restore("a");
  CHECK(dvrtest::diff(p, at_a.data(), r.size()) == "");
  s.restore("b");
  CHECK(dvrtest::diff(p, at_b.data(), r.size()) == "");
  // A second region allocated after the first snapshot: its own first
  // snapshot reads it whole, the next only what was written.
  auto& r2 = s.alloc("more", 4u << 20);
  auto* q = static_cast<unsigned char*>(r2.data());
  q[5] = 5;
  auto third = s.snapshot("c");
  CHECK(third.chunks_read == (4u << 20) / cs);
  q[3 * cs] = 6;
  auto fourth = s.snapshot("d");
  CHECK(fourth.chunks_read == 1);
  s.restore("c");
  CHECK(q[3 * cs] == 0);
  CHECK(q[5] == 5);
}

TEST_CASE("incremental: a snapshot after a small change reads and stores only the pages written", "[incremental]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "inc");
  auto& r = s.alloc("data", 64u << 20);
  dvrtest::fill_random(r.data(), r.size(), 7);
  if (s.tracking("data") != Tracking::write_protect) DVR_SKIP("write-protect tracking not in use here: " << dvrtest::no_write_protect_why(s));
  auto first = s.snapshot("a");
  CHECK(first.chunks_read == first.chunks);
  CHECK(first.tracking == "hash");  // nothing to compare with yet
  auto* p = static_cast<unsigned char*>(r.data());
  const std::size_t cs = store.chunk_size();
  p[5] ^= 1;                          // chunk 0
  p[2 * cs + 3] ^= 1;                 // chunk 2
  std::memset(p + 5 * cs - 2, 9, 4);  // chunks 4 and 5
  auto second = s.snapshot("b");
  CHECK(second.tracking == "write_protect");
  CHECK(second.chunks_read == 4);
  // Four pages changed (the memset spans two), each stored apart from its chunk.
  CHECK(second.stored_bytes == 4 * 4096);
  CHECK(store.info("inc", "b").chunks_read == 4);
  auto third = s.snapshot("c");  // nothing written since b
  CHECK(third.chunks_read == 0);
  CHECK(third.stored_bytes == 0);
  // Rollback to a: only what differs is copied; the result is exact either way.
  std::vector<unsigned char> at_b(p, p + r.size());
  s.restore("a");
  CHECK(p[5] == static_cast<unsigned char>(at_b[5] ^ 1));
  s.restore("b");
  CHECK(dvrtest::diff(p, at_b.data(), r.size()) == "");
}

TEST_CASE("incremental: the base snapshot removed (and its space reused) never leaks into a new snapshot", "[incremental]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "gone");
  auto& r = s.alloc("data", 8u << 20);
  dvrtest::fill_random(r.data(), r.size(), 11);
  s.snapshot("base");
  std::vector<unsigned char> copy(static_cast<unsigned char*>(r.data()), static_cast<unsigned char*>(r.data()) + r.size());
  store.remove("gone", "base");
  store.gc();
  // Another session fills the freed space with other data.
  auto other = dvrtest::random_bytes(8u << 20, 12);
  Session t(store, "other");
  t.track("x", other.data(), other.size());
  t.snapshot("x");
  static_cast<unsigned char*>(r.data())[100] ^= 1;
  copy[100] ^= 1;
  s.snapshot("next");  // most chunks unchanged since "base", which is gone
  std::memset(r.data(), 0, r.size());
  s.restore("next");
  CHECK(dvrtest::diff(static_cast<unsigned char*>(r.data()), copy.data(), r.size()) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("incremental: a failed restore keeps the record of what was written", "[incremental]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "keep");
  auto& r = s.alloc("data", 1u << 20);
  auto* p = static_cast<unsigned char*>(r.data());
  dvrtest::fill_random(p, r.size(), 21);
  s.snapshot("good");
  dvrtest::fill_random(p + 100000, 5000, 22);
  s.snapshot("bad");  // its new chunk is damaged below
  auto m = dvr::detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "keep", "bad")), "bad");
  // The page holding byte 100000, wherever "bad" keeps it.
  auto at = dvr::detail::view_of(m, 100000 / m.chunk_size).location((100000 % m.chunk_size) / 4096);
  REQUIRE(at.pack != 0);
  dvrtest::flip_byte(dvrtest::pack_path(store, at.pack), at.offset + 10);
  p[7] ^= 1;       // written after "bad"
  p[100000] ^= 1;  // ... and in the damaged chunk, which a rollback to "bad" must read
  // (Where nothing was written a rollback does not read the stored copy at all:
  // live memory already holds those bytes, and `dvr verify` reports the damage.)
  std::vector<unsigned char> before(p, p + r.size());
  CHECK(dvrtest::catch_error([&] { s.restore("bad"); }).code == Errc::corrupt);
  CHECK(dvrtest::diff(p, before.data(), r.size()) == "");
  // The write to byte 7 must still be known: restoring "good" undoes it.
  s.restore("good");
  auto expect = dvrtest::random_bytes(r.size(), 21);
  CHECK(dvrtest::diff(p, expect.data(), r.size()) == "");
}

namespace {
// Removes every page hash file of the store (they are a cache).
void drop_page_hash_files(const Store& store) {
  for (auto& f : dvrtest::tree(store.path() + "/packs"))
    if (f.size() > 5 && f.compare(f.size() - 5, 5, ".hash") == 0) std::remove((store.path() + "/packs/" + f).c_str());
}
}  // namespace

TEST_CASE("incremental: a region tracked again under the same name is compared, not taken as unchanged", "[incremental]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "again");
  auto& first = s.alloc("r", 9000);
  std::memset(first.data(), 0xAB, first.size());
  s.snapshot("ab");
  // Fresh zero memory under the same name and size: the tracker has seen no
  // write to it, yet it differs from the base in every byte.
  s.untrack("r");
  auto& second = s.alloc("r", 9000);
  s.restore("ab");
  std::vector<unsigned char> expect(9000, 0xAB);
  CHECK(dvrtest::diff(second.data(), expect.data(), expect.size()) == "");

  std::vector<unsigned char> a(65536, 'A'), b(65536, 'B');
  s.track("t", a.data(), a.size());
  s.snapshot("with-a");
  s.untrack("t");
  s.track("t", b.data(), b.size());
  s.snapshot("with-b");  // must hold b's bytes, though no write to b was seen
  std::vector<unsigned char> c(65536, 0);
  Session t(store, "again");
  t.alloc("r", 9000);
  t.track("t", c.data(), c.size());
  t.restore("with-b");
  CHECK(dvrtest::diff(c, b) == "");
}

TEST_CASE("incremental: a chunk whose stored pages fail their hashes is never restored, even if no page looks different", "[incremental]") {
  TempDir dir;
  std::vector<unsigned char> a(1u << 20), b;
  {
    Store store = Store::open(dir.store());
    Session s(store, "s");
    auto& r = s.alloc("r", a.size());
    dvrtest::fill_random(r.data(), r.size(), 31);
    std::memset(static_cast<char*>(r.data()) + 5 * 4096, 0, 4096);  // page 5 all zero in "a"
    a.assign(static_cast<unsigned char*>(r.data()), static_cast<unsigned char*>(r.data()) + r.size());
    s.snapshot("a");
    std::memset(static_cast<char*>(r.data()) + 5 * 4096, 0x5A, 4096);
    s.snapshot("b");  // page 5 stored apart
    b.assign(static_cast<unsigned char*>(r.data()), static_cast<unsigned char*>(r.data()) + r.size());
  }
  Store store = Store::open(dir.store());
  auto m = detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "s", "b")), "b");
  auto at = detail::view_of(m, 0).location(5);
  REQUIRE(at.pack != 0);
  // The overlay page loses its bytes (all zero, like "a"'s page), and the page
  // hash cache is gone, so hashing the stored pages gives "a"'s hashes.
  std::string pack = dvrtest::read_file(dvrtest::pack_path(store, at.pack));
  std::memset(pack.data() + at.offset, 0, 4096);
  dvrtest::write_file(dvrtest::pack_path(store, at.pack), pack);
  drop_page_hash_files(store);
  Session s(store, "s");
  auto& r = s.alloc("r", a.size());
  s.restore("a");
  REQUIRE(dvrtest::diff(r.data(), a.data(), a.size()) == "");
  auto e = dvrtest::catch_error([&] { s.restore("b"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("s/b"));
  CHECK(dvrtest::diff(r.data(), a.data(), a.size()) == "");  // unchanged
  CHECK_FALSE(store.verify().ok());
}

TEST_CASE("incremental: without page hash files, snapshots with all-zero overlay pages stay intact", "[incremental]") {
  TempDir dir;
  std::vector<unsigned char> data = dvrtest::random_bytes(1u << 20, 41);
  {
    Store store = Store::open(dir.store());
    for (Tracking mode : {Tracking::write_protect, Tracking::hash}) {
      Session s(store, mode == Tracking::hash ? "h" : "w", {.tracking = mode});
      auto copy = data;
      s.track("r", copy.data(), copy.size());
      s.snapshot("a");
      std::memset(copy.data() + 3 * 4096, 0, 4096);  // becomes an all-zero overlay
      CHECK(s.snapshot("b").stored_bytes == 0);
    }
  }
  Store store = Store::open(dir.store());
  drop_page_hash_files(store);
  CHECK(store.verify().ok());
  auto want = data;
  std::memset(want.data() + 3 * 4096, 0, 4096);
  for (const char* session : {"w", "h"}) {
    Session s(store, session);
    std::vector<unsigned char> live(data.size(), 7);
    s.track("r", live.data(), live.size());
    s.restore("b");
    CHECK(dvrtest::diff(live, want) == "");
    CHECK(store.latest(session)->name == "b");
  }
}

namespace {
// KiB of this process's page tables that map files under `prefix`
// (/proc/self/smaps, Rss).
std::uint64_t mapped_kib(const std::string& prefix) {
  std::istringstream in(dvrtest::read_file("/proc/self/smaps"));
  std::uint64_t kib = 0;
  bool ours = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Rss:", 0) == 0) {
      if (ours) kib += std::stoull(line.substr(4));
    } else if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
               line.find(' ') != std::string::npos && line.find(':') > line.find(' ')) {
      ours = line.find(prefix) != std::string::npos;  // a mapping's header line
    }
  }
  return kib;
}
}  // namespace

TEST_CASE("incremental: a session's first restore (pages read with pread) and later ones (through the mapping) are bit-exact and refuse damage", "[incremental][cold]") {
  TempDir dir;
  const std::size_t size = 4u << 20;
  std::vector<unsigned char> a, b;
  {
    Store store = Store::open(dir.store());
    Session s(store, "s");
    auto& r = s.alloc("r", size);
    auto* p = static_cast<unsigned char*>(r.data());
    dvrtest::fill_random(p, size, 41);
    s.snapshot("a");
    a.assign(p, p + size);
    for (std::size_t at = 5; at < size; at += 20 * 4096)  // every 20th page: stored apart
      p[at] ^= 0x77;
    s.snapshot("b");
    b.assign(p, p + size);
  }
  auto scribble = [&](unsigned char* p, std::uint64_t seed) {
    for (std::size_t at = 3 * 4096 + 9; at < size; at += 20 * 4096)  // other pages, every 20th
      p[at] = static_cast<unsigned char>(p[at] + seed);
  };
  SECTION("a fresh session restores the whole snapshot, then the same pages again and again") {
    Store store = Store::open(dir.store());
    Session s(store, "s");
    auto& r = s.alloc("r", size);
    auto* p = static_cast<unsigned char*>(r.data());
    s.restore("b");  // first: every page read with pread
    REQUIRE(dvrtest::diff(p, b.data(), size) == "");
    for (std::uint64_t round = 1; round <= 3; ++round) {
      scribble(p, round);
      s.restore(round == 2 ? "a" : "b");  // later: through the mapping
      INFO("round " << round);
      CHECK(dvrtest::diff(p, (round == 2 ? a : b).data(), size) == "");
      if (round == 2) s.restore("b");
    }
  }
  SECTION("damage in a chunk stored whole is found by a fresh session's first restore, and live memory stays as it was") {
    Store store = Store::open(dir.store());
    auto m = detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "s", "a")), "a");
    REQUIRE(m.chunks.size() > 3);
    auto at = detail::view_of(m, 3).location(7);  // chunk 3, page 7: stored with its chunk
    REQUIRE(at.pack != 0);
    dvrtest::flip_byte(dvrtest::pack_path(store, at.pack), at.offset + 4000);
    Session s(store, "s");
    auto& r = s.alloc("r", size);
    auto* p = static_cast<unsigned char*>(r.data());
    std::memset(p, 0x11, size);
    std::vector<unsigned char> before(p, p + size);
    auto e = dvrtest::catch_error([&] { s.restore("a"); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("s/a") && Catch::Contains("live memory was not changed"));
    CHECK(dvrtest::diff(p, before.data(), size) == "");
  }
  SECTION("damage is found by the first restore and by a later one, and live memory stays as it was") {
    Store store = Store::open(dir.store());
    auto m = detail::decode_manifest(dvrtest::read_file(dvrtest::manifest_path(store, "s", "b")), "b");
    // A page "b" keeps apart (written after "a"), damaged on disk.
    auto at = detail::view_of(m, 0).location(20);
    REQUIRE(at.pack != 0);
    dvrtest::flip_byte(dvrtest::pack_path(store, at.pack), at.offset + 100);
    const bool later = GENERATE(false, true);
    INFO((later ? "a later restore" : "the first restore"));
    Session s(store, "s");
    auto& r = s.alloc("r", size);
    auto* p = static_cast<unsigned char*>(r.data());
    if (later) {
      s.restore("a");
      REQUIRE(dvrtest::diff(p, a.data(), size) == "");
    }
    std::vector<unsigned char> before(p, p + size);
    auto e = dvrtest::catch_error([&] { s.restore("b"); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("s/b") && Catch::Contains("live memory was not changed"));
    CHECK(dvrtest::diff(p, before.data(), size) == "");
    if (!later) {
      // The refused restore did not use up the session's first: the next
      // one still reads with pread, so the packs' mappings stay almost
      // unpopulated (a few pages: pack headers); through them, it would map
      // every page it reads (4 MiB).
      s.restore("a");
      CHECK(dvrtest::diff(p, a.data(), size) == "");
      CHECK(mapped_kib(store.path() + "/packs/") < 512);
    }
  }
}

namespace {
// A child process writes `value` over [p, p+n) and exits.
void child_writes(unsigned char* p, std::size_t n, int value) {
  pid_t c = ::fork();
  REQUIRE(c >= 0);
  if (c == 0) {
    std::memset(p, value, n);
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(c, &status, 0) == c);
  REQUIRE(WIFEXITED(status));
}
}  // namespace

TEST_CASE("incremental: shared memory written by a child process is in the next snapshot, and a restore puts it back", "[incremental][shared]") {
  // Write tracking sees this process's page tables only: a MAP_SHARED
  // region is compared by hashing, and a persistent heap (MAP_SHARED, ours)
  // from the first fork() on.
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t n = 256 * 1024;
  Session s(store, "sh");
  auto* shared = static_cast<unsigned char*>(::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  REQUIRE(shared != MAP_FAILED);
  std::memset(shared, 0xAA, n);
  s.track("shm", shared, n);
  CHECK(s.tracking("shm") == Tracking::hash);
  Region& heap = s.alloc("heap", n, {.persistent = true});
  auto* h = static_cast<unsigned char*>(heap.data());
  std::memset(h, 0xAA, n);
  s.snapshot("one");
  s.snapshot("one-again");  // the heap's tracking is synced: the next one reads what was written since

  child_writes(shared, n, 0xEE);
  child_writes(h, n, 0xBB);
  s.snapshot("two");
  CHECK(s.tracking("heap") == Tracking::hash);
  s.restore("one");
  CHECK(std::count(shared, shared + n, 0xAA) == static_cast<long>(n));
  CHECK(std::count(h, h + n, 0xAA) == static_cast<long>(n));
  s.restore("two");
  CHECK(std::count(shared, shared + n, 0xEE) == static_cast<long>(n));
  CHECK(std::count(h, h + n, 0xBB) == static_cast<long>(n));
  s.untrack("shm");
  ::munmap(shared, n);
}
