// Unit tests of snapshot and restore: bit-exact round trips over sizes and
// alignments, many snapshots, zero chunks, dedup, replace, the timeline.
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <cstdlib>
#include <thread>

#include <algorithm>
#include <chrono>
#include <random>

#include "base/hash.hpp"
#include "format/pack.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::SnapshotInfo;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::mode_of;
using dvrtest::TempDir;

namespace {

const std::vector<std::size_t>& region_sizes() {
  static const std::vector<std::size_t> sizes = {1, 7, 4095, 4096, 4097, 65535, 65536, 65537, 3 * 65536 + 123, (3u << 20) + 5, 4u << 20};
  return sizes;
}

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

TEST_CASE("snapshot: caller-owned buffers of many sizes at odd offsets restore bit-exact", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t cs = store.chunk_size();
  std::uint64_t seed = 100;
  for (std::size_t size : region_sizes()) {
    for (std::size_t skew : {0, 1, 3, 13}) {
      INFO("size " << size << ", buffer at malloc + " << skew);
      dvrtest::OddBuffer buf(size, skew);
      dvrtest::fill_random(buf.data(), size, ++seed);
      std::vector<unsigned char> expect(buf.data(), buf.data() + size);
      std::string session = "s" + std::to_string(size) + "-" + std::to_string(skew);
      Session s(store, session);
      s.track("r", buf.data(), size);
      SnapshotInfo info = s.snapshot("snap");
      CHECK(info.session == session);
      CHECK(info.name == "snap");
      CHECK(info.logical_bytes == size);
      CHECK(info.chunks == (size + cs - 1) / cs);
      CHECK(info.zero_chunks == 0);
      // Every chunk is new random data: at least the bytes, at most page-rounded chunks.
      CHECK(info.stored_bytes >= size);
      CHECK(info.stored_bytes <= round_up(size, 4096) + info.chunks * 4096);
      REQUIRE(info.regions.size() == 1);
      CHECK(info.regions[0].name == "r");
      CHECK(info.regions[0].size == size);
      CHECK_FALSE(info.regions[0].sdk_owned);

      dvrtest::fill_random(buf.data(), size, seed + 50000);  // scribble
      REQUIRE(diff(buf.data(), expect.data(), size) != "");
      s.restore("snap");
      CHECK(diff(buf.data(), expect.data(), size) == "");
      // Bytes just outside the region are not touched by restore.
      unsigned char guard_before = skew ? buf.data()[-1] : 0;
      buf.data()[size] = 0x5A;
      s.restore("snap");
      CHECK(buf.data()[size] == 0x5A);
      if (skew) CHECK(buf.data()[-1] == guard_before);
    }
  }
}

TEST_CASE("snapshot: SDK-owned alloc() regions are page-aligned, zeroed, and restore bit-exact", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "arena");
  std::uint64_t seed = 200;
  std::vector<std::vector<unsigned char>> expect;
  for (std::size_t size : region_sizes()) {
    INFO("size " << size);
    dvr::Region& r = s.alloc("r" + std::to_string(size), size);
    CHECK(r.sdk_owned());
    CHECK(r.size() == size);
    CHECK(reinterpret_cast<std::uintptr_t>(r.data()) % 4096 == 0);
    std::vector<unsigned char> zeros(size, 0);
    CHECK(diff(r.data(), zeros.data(), size) == "");
    dvrtest::fill_random(r.data(), size, ++seed);
    expect.emplace_back(static_cast<unsigned char*>(r.data()), static_cast<unsigned char*>(r.data()) + size);
  }
  SnapshotInfo info = s.snapshot("all");
  REQUIRE(info.regions.size() == region_sizes().size());
  for (auto& ri : info.regions)
    CHECK(ri.sdk_owned);
  for (auto* r : s.regions())
    dvrtest::fill_random(r->data(), r->size(), 7777);
  s.restore("all");
  auto regions = s.regions();
  REQUIRE(regions.size() == expect.size());
  for (std::size_t i = 0; i < regions.size(); ++i) {
    INFO("region " << regions[i]->name());
    CHECK(diff(regions[i]->data(), expect[i].data(), expect[i].size()) == "");
  }
  // as<T>() views the same bytes.
  auto& r = s.region("r65536");
  auto words = r.as<std::uint64_t>();
  CHECK(words.size() == 65536 / 8);
  CHECK(static_cast<void*>(words.data()) == r.data());
}

TEST_CASE("snapshot: several regions in one session, adjacent and apart, restore together", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  // One buffer cut into three adjacent regions (their chunks are contiguous in
  // memory across region boundaries), plus a separate buffer and two alloc()s.
  std::vector<unsigned char> big(3 * cs + 3 * cs + 777 + 4096);
  dvrtest::fill_random(big.data(), big.size(), 300);
  auto lone = dvrtest::random_bytes(12345, 301);
  Session s(store, "multi");
  s.track("a", big.data(), 3 * cs);
  s.track("b", big.data() + 3 * cs, 3 * cs + 777);
  s.track("c", big.data() + 6 * cs + 777, 4096);
  s.track("lone", lone.data(), lone.size());
  auto& x = s.alloc("x", 2 * cs + 1);
  auto& y = s.alloc("y", 10);
  dvrtest::fill_random(x.data(), x.size(), 302);
  dvrtest::fill_random(y.data(), y.size(), 303);
  auto big0 = big;
  auto lone0 = lone;
  std::vector<unsigned char> x0(static_cast<unsigned char*>(x.data()), static_cast<unsigned char*>(x.data()) + x.size());
  std::vector<unsigned char> y0(static_cast<unsigned char*>(y.data()), static_cast<unsigned char*>(y.data()) + y.size());

  SnapshotInfo info = s.snapshot("t0");
  CHECK(info.logical_bytes == big.size() + lone.size() + x.size() + y.size());
  REQUIRE(info.regions.size() == 6);
  std::vector<std::string> names;
  for (auto& r : info.regions)
    names.push_back(r.name);
  CHECK(names == std::vector<std::string>{"a", "b", "c", "lone", "x", "y"});
  CHECK(info.regions[1].size == 3 * cs + 777);
  CHECK(info.regions[4].sdk_owned);
  CHECK_FALSE(info.regions[3].sdk_owned);
  CHECK(info.chunks == 3 + 4 + 1 + 1 + 3 + 1);

  dvrtest::fill_random(big.data(), big.size(), 310);
  dvrtest::fill_random(lone.data(), lone.size(), 311);
  dvrtest::fill_random(x.data(), x.size(), 312);
  dvrtest::fill_random(y.data(), y.size(), 313);
  s.restore("t0");
  CHECK(diff(big.data(), big0.data(), big.size()) == "");
  CHECK(diff(lone.data(), lone0.data(), lone.size()) == "");
  CHECK(diff(x.data(), x0.data(), x.size()) == "");
  CHECK(diff(y.data(), y0.data(), y.size()) == "");
  CHECK(store.info("multi", "t0").regions.size() == 6);
}

TEST_CASE("snapshot: 30 snapshots with different content restore bit-exact in random order", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  const std::size_t size = 5 * cs + 333;
  dvrtest::OddBuffer buf(size, 3);
  Session s(store, "timeline");
  s.track("data", buf.data(), size);
  auto& sdk = s.alloc("sdk", cs + 5);
  std::vector<std::vector<unsigned char>> expect_data, expect_sdk;
  std::mt19937_64 rng(12345);
  dvrtest::fill_random(buf.data(), size, 400);
  for (int i = 0; i < 30; ++i) {
    // Change a varying part each time: one chunk, a few bytes, the tail, or everything.
    switch (i % 4) {
      case 0:
        dvrtest::fill_random(buf.data() + (i % 5) * cs, cs, 1000 + i);
        break;
      case 1:
        buf.data()[rng() % size] ^= 0x40;
        break;
      case 2:
        dvrtest::fill_random(buf.data() + 5 * cs, 333, 2000 + i);
        break;
      case 3:
        dvrtest::fill_random(buf.data(), size, 3000 + i);
        break;
    }
    dvrtest::fill_random(sdk.data(), i % 3 == 0 ? sdk.size() : 5, 4000 + i);
    expect_data.emplace_back(buf.data(), buf.data() + size);
    auto* p = static_cast<unsigned char*>(sdk.data());
    expect_sdk.emplace_back(p, p + sdk.size());
    s.snapshot("t" + std::to_string(i), {.label = "step " + std::to_string(i)});
  }
  std::vector<int> order(30);
  for (int i = 0; i < 30; ++i)
    order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int round = 0; round < 2; ++round) {
    for (int i : order) {
      INFO("restore t" << i << " (round " << round << ")");
      s.restore("t" + std::to_string(i));
      CHECK(diff(buf.data(), expect_data[i].data(), size) == "");
      CHECK(diff(sdk.data(), expect_sdk[i].data(), sdk.size()) == "");
      CHECK(s.head() == "t" + std::to_string(i));
    }
    std::reverse(order.begin(), order.end());
  }
  auto list = s.list();
  REQUIRE(list.size() == 30);
  for (int i = 0; i < 30; ++i) {
    CHECK(list[i].name == "t" + std::to_string(i));
    CHECK(list[i].label == "step " + std::to_string(i));
  }
  CHECK(store.verify().ok());
}

TEST_CASE("snapshot: all-zero chunks are counted, never stored, and restored as zeros", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  const std::size_t size = 8 * cs + 1000;  // 9 chunks, the last one partial
  std::vector<unsigned char> buf(size, 0);
  // Chunks 0, 2, 5 hold distinct random data; 1, 3, 4, 6, 7 and the tail are zero.
  for (std::size_t c : {0, 2, 5})
    dvrtest::fill_random(buf.data() + c * cs, cs, 500 + c);
  auto expect = buf;
  Session s(store, "sparse");
  s.track("r", buf.data(), size);
  SnapshotInfo info = s.snapshot("z");
  CHECK(info.chunks == 9);
  CHECK(info.zero_chunks == 6);
  CHECK(info.stored_bytes == 3 * cs);
  CHECK(store.info("sparse", "z").zero_chunks == 6);

  dvrtest::fill_random(buf.data(), size, 555);
  s.restore("z");
  CHECK(diff(buf.data(), expect.data(), size) == "");

  // A region that is entirely zero (caller-owned or a fresh alloc()) stores nothing.
  Session z(store, "allzero");
  std::vector<unsigned char> zeros(5 * cs + 9, 0);
  z.track("r", zeros.data(), zeros.size());
  auto& fresh = z.alloc("fresh", 3 * cs + 7);
  SnapshotInfo zi = z.snapshot("nothing");
  CHECK(zi.chunks == 6 + 4);
  CHECK(zi.zero_chunks == 6 + 4);
  CHECK(zi.stored_bytes == 0);
  std::fill(zeros.begin(), zeros.end(), 0xFF);
  std::memset(fresh.data(), 0xFF, fresh.size());
  z.restore("nothing");
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](unsigned char c) { return c == 0; }));
  auto* f = static_cast<unsigned char*>(fresh.data());
  CHECK(std::all_of(f, f + fresh.size(), [](unsigned char c) { return c == 0; }));
}

TEST_CASE("snapshot: identical chunks within one snapshot are stored once", "[snapshot][dedup]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  std::vector<unsigned char> buf(6 * cs);
  auto pattern = dvrtest::random_bytes(cs, 600);
  for (int i = 0; i < 6; ++i)
    std::memcpy(buf.data() + i * cs, pattern.data(), cs);
  auto expect = buf;
  Session s(store, "rep");
  s.track("r", buf.data(), buf.size());
  auto other = pattern;  // a second region holding the same chunk
  s.track("r2", other.data(), other.size());
  SnapshotInfo info = s.snapshot("one");
  CHECK(info.chunks == 7);
  CHECK(info.zero_chunks == 0);
  CHECK(info.stored_bytes == cs);
  std::fill(buf.begin(), buf.end(), 1);
  std::fill(other.begin(), other.end(), 2);
  s.restore("one");
  CHECK(diff(buf.data(), expect.data(), buf.size()) == "");
  CHECK(diff(other.data(), pattern.data(), cs) == "");
}

TEST_CASE("snapshot: a second snapshot of unchanged data stores nothing", "[snapshot][dedup]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(10 * store.chunk_size() + 4321, 700);
  Session s(store, "same");
  s.track("r", data.data(), data.size());
  auto first = s.snapshot("a");
  CHECK(first.stored_bytes >= data.size());
  auto before = store.stats().pack_bytes;
  auto second = s.snapshot("b");
  CHECK(second.stored_bytes == 0);
  CHECK(second.logical_bytes == data.size());
  CHECK(store.stats().pack_bytes == before);
  CHECK(store.info("same", "b").stored_bytes == 0);
}

TEST_CASE("snapshot: two sessions with identical data share chunks", "[snapshot][dedup]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(7 * store.chunk_size() + 11, 710);
  auto copy = data;
  Session s1(store, "one");
  s1.track("r", data.data(), data.size());
  CHECK(s1.snapshot("x").stored_bytes >= data.size());
  Session s2(store, "two");
  s2.track("other-name", copy.data(), copy.size());
  CHECK(s2.snapshot("y").stored_bytes == 0);
  std::fill(copy.begin(), copy.end(), 0);
  s2.restore("y");
  CHECK(diff(copy.data(), data.data(), data.size()) == "");
}

TEST_CASE("snapshot: changing one byte stores one page", "[snapshot][dedup]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  const std::size_t size = 16 * cs + 2000;  // 16 full chunks and a 2000-byte tail
  auto data = dvrtest::random_bytes(size, 720);
  Session s(store, "onebyte");
  s.track("r", data.data(), size);
  s.snapshot("base");
  auto v0 = data;

  data[5 * cs + 17] ^= 1;
  auto v1 = data;
  CHECK(s.snapshot("mid").stored_bytes == 4096);

  data[size - 1] ^= 1;  // in the partial tail chunk
  auto v2 = data;
  auto tail = s.snapshot("tail").stored_bytes;
  CHECK(tail >= 2000);
  CHECK(tail <= 4096);

  data[0] ^= 1;
  data[cs] ^= 1;  // two chunks
  auto v3 = data;
  CHECK(s.snapshot("two").stored_bytes == 2 * 4096);

  // Going back to an earlier content stores nothing.
  std::memcpy(data.data(), v0.data(), size);
  CHECK(s.snapshot("back").stored_bytes == 0);

  for (auto& [name, v] :
       std::vector<std::pair<std::string, std::vector<unsigned char>*>>{{"base", &v0}, {"mid", &v1}, {"tail", &v2}, {"two", &v3}, {"back", &v0}}) {
    INFO(name);
    std::fill(data.begin(), data.end(), 0xAB);
    s.restore(name);
    CHECK(diff(data.data(), v->data(), size) == "");
  }
}

TEST_CASE("snapshot: an existing name is already_exists, and replace=true replaces it", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto v1 = dvrtest::random_bytes(100000, 800);
  auto live = v1;
  Session s(store, "rep");
  s.track("r", live.data(), live.size());
  s.snapshot("keep", {.label = "first"});
  dvrtest::fill_random(live.data(), live.size(), 801);
  auto v2 = live;

  auto e = catch_error([&] { s.snapshot("keep"); });
  CHECK(e.code == Errc::already_exists);
  CHECK_THAT(e.what, Catch::Contains("rep/keep"));
  // The old snapshot is intact.
  s.restore("keep");
  CHECK(diff(live.data(), v1.data(), v1.size()) == "");
  CHECK(store.info("rep", "keep").label == "first");

  std::memcpy(live.data(), v2.data(), v2.size());
  auto info = s.snapshot("keep", {.label = "second", .replace = true});
  CHECK(info.label == "second");
  auto list = s.list();
  REQUIRE(list.size() == 1);
  CHECK(list[0].name == "keep");
  CHECK(list[0].label == "second");
  std::fill(live.begin(), live.end(), 0);
  s.restore("keep");
  CHECK(diff(live.data(), v2.data(), v2.size()) == "");
  // replace on a new name just creates it.
  CHECK(s.snapshot("fresh", {.label = "", .replace = true}).name == "fresh");
  CHECK(store.verify().ok());
}

TEST_CASE("snapshot: replacing the head snapshot does not make it its own parent", "[snapshot][bug]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto live = dvrtest::random_bytes(5000, 810);
  Session s(store, "loop");
  s.track("r", live.data(), live.size());
  s.snapshot("base");
  s.snapshot("work");
  live[0] ^= 1;
  auto info = s.snapshot("work", {.label = "", .replace = true});
  // A timeline walked through parent links must end: "work" cannot have been taken after itself.
  CHECK(info.parent != "work");
  CHECK(store.info("loop", "work").parent != "work");
}

TEST_CASE("snapshot: head() and parent links follow snapshots and restores", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto live = dvrtest::random_bytes(3000, 820);
  Session s(store, "tl");
  CHECK(s.head().empty());
  s.track("r", live.data(), live.size());
  auto a = s.snapshot("a");
  CHECK(a.parent.empty());
  CHECK(s.head() == "a");
  live[1] ^= 1;
  auto b = s.snapshot("b");
  CHECK(b.parent == "a");
  CHECK(s.head() == "b");
  s.restore("a");
  CHECK(s.head() == "a");
  live[2] ^= 1;
  auto c = s.snapshot("c");
  CHECK(c.parent == "a");
  CHECK(store.info("tl", "c").parent == "a");
  CHECK(store.info("tl", "b").parent == "a");

  // A failed restore does not move head.
  CHECK(catch_error([&] { s.restore("nope"); }).code == Errc::not_found);
  CHECK(s.head() == "c");

  // A new Session object starts without a head.
  Session again(store, "tl");
  CHECK(again.head().empty());
  again.track("r", live.data(), live.size());
  CHECK(again.snapshot("d").parent.empty());
  again.restore("b");
  CHECK(again.snapshot("e").parent == "b");
}

TEST_CASE("snapshot: label, time and sizes are recorded, and list() is ordered by time", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto live = dvrtest::random_bytes(70000, 830);
  Session s(store, "meta");
  s.track("r", live.data(), live.size());
  auto now = [] { return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count(); };
  std::int64_t t0 = now();
  // Names in reverse alphabetical order, so name order differs from time order.
  std::vector<std::string> names = {"zz", "yy", "mm", "bb", "aa"};
  for (auto& n : names) {
    live[0] = static_cast<unsigned char>(n[0]);
    s.snapshot(n, {.label = "label of " + n + " with spaces / and ünïcödé"});
  }
  std::int64_t t1 = now();
  auto list = s.list();
  REQUIRE(list.size() == names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    INFO(i);
    CHECK(list[i].name == names[i]);
    CHECK(list[i].session == "meta");
    CHECK(list[i].label == "label of " + names[i] + " with spaces / and ünïcödé");
    CHECK(list[i].time_ns >= t0);
    CHECK(list[i].time_ns <= t1);
    CHECK(list[i].logical_bytes == 70000);
    CHECK_FALSE(list[i].damaged);
    CHECK(list[i].damage.empty());
    if (i) CHECK(list[i].time_ns >= list[i - 1].time_ns);
  }
  CHECK(store.list("meta").size() == names.size());
  auto info = store.info("meta", "mm");
  CHECK(info.label == list[2].label);
  CHECK(info.time_ns == list[2].time_ns);
  CHECK(info.parent == "yy");
}

TEST_CASE("snapshot: untrack() forgets a region, and snapshots and restores follow the live set", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(5000, 840);
  auto a0 = a;
  Session s(store, "ut");
  s.track("a", a.data(), a.size());
  auto& sdk = s.alloc("sdk", 9000);
  dvrtest::fill_random(sdk.data(), sdk.size(), 841);
  s.snapshot("both");
  REQUIRE(s.regions().size() == 2);

  s.untrack("sdk");
  CHECK(s.regions().size() == 1);
  CHECK(catch_error([&] { s.region("sdk"); }).code == Errc::not_found);
  auto e = catch_error([&] { s.untrack("sdk"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("sdk"));
  auto only = s.snapshot("only-a");
  REQUIRE(only.regions.size() == 1);
  CHECK(only.regions[0].name == "a");

  // Restoring "both" needs the untracked region back.
  a[0] ^= 1;
  auto a1 = a;
  e = catch_error([&] { s.restore("both"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("sdk"));
  CHECK(diff(a.data(), a1.data(), a.size()) == "");
  // alloc() it again under the same name and size: now it restores.
  auto& again = s.alloc("sdk", 9000);
  s.restore("both");
  CHECK(diff(a.data(), a0.data(), a.size()) == "");
  std::vector<unsigned char> sdk_expect(9000);
  dvrtest::fill_random(sdk_expect.data(), 9000, 841);
  CHECK(diff(again.data(), sdk_expect.data(), 9000) == "");
  // And the same memory can be tracked under a new name once untracked.
  s.untrack("a");
  CHECK(s.track("a2", a.data(), a.size()).name() == "a2");
}

TEST_CASE("snapshot: restore leaves regions the snapshot does not record untouched", "[snapshot]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(4000, 850);
  auto a0 = a;
  Session s(store, "partial");
  s.track("a", a.data(), a.size());
  s.snapshot("just-a");
  auto b = dvrtest::random_bytes(4000, 851);
  auto b0 = b;
  s.track("b", b.data(), b.size());
  dvrtest::fill_random(a.data(), a.size(), 852);
  s.restore("just-a");
  CHECK(diff(a.data(), a0.data(), a.size()) == "");
  CHECK(diff(b.data(), b0.data(), b.size()) == "");
}

TEST_CASE("snapshot: a snapshot the store cannot hold is no_space, and nothing is published, earlier ones stay intact", "[snapshot][no_space]") {
  // The file-size limit stands in for a full file system: growing a pack past
  // it fails with EFBIG, which the store reports as no_space.
  TempDir dir;
  Store store = Store::open(dir.store());
  auto small = dvrtest::random_bytes(300000, 1700);
  auto small0 = small;
  Session s(store, "full");
  s.track("small", small.data(), small.size());
  s.snapshot("before");
  auto used = store.stats().pack_bytes;

  const std::size_t big_size = 80u << 20;
  struct Mapping {
    void* p;
    std::size_t n;
    ~Mapping() { ::munmap(p, n); }
  } big{::mmap(nullptr, big_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), big_size};
  REQUIRE(big.p != MAP_FAILED);
  // One distinct non-zero byte per chunk: every chunk must be stored, 80 MiB
  // in all, more than the file-size limit below allows.
  for (std::size_t off = 0; off < big_size; off += 64 << 10) {
    static_cast<unsigned char*>(big.p)[off] = 1;
    std::memcpy(static_cast<unsigned char*>(big.p) + off + 8, &off, sizeof off);
  }
  s.track("big", big.p, big_size);

  auto e = [&] {
    // Below what one writer stores of the 80 MiB whatever the thread bound
    // (on tmpfs each writer grows a pack of its own), and below a new pack's
    // first size.
    dvrtest::FileSizeLimit limit(32u << 20);
    return catch_error([&] { s.snapshot("too-big"); });
  }();

  INFO(e.what);
  CHECK(e.code == Errc::no_space);
  CHECK(catch_error([&] { store.info("full", "too-big"); }).code == Errc::not_found);
  CHECK(s.list().size() == 1);
  CHECK(s.head() == "before");
  CHECK(store.stats().pack_bytes <= used + (8u << 20));
  s.untrack("big");
  dvrtest::fill_random(small.data(), small.size(), 1701);
  s.restore("before");
  CHECK(diff(small, small0) == "");
  CHECK(store.verify().ok());
  // With room again, the same snapshot works.
  s.track("big", big.p, big_size);
  CHECK(s.snapshot("too-big").logical_bytes == big_size + small.size());
}

TEST_CASE("snapshot: new pack space (pwrite) and reused space (the mapping) read back exactly on tmpfs and on disk, with their page hashes",
          "[snapshot][pack_space]") {
  for (const std::string base : {"/dev/shm", "/var/tmp"}) {
    INFO("store under " << base);
    TempDir dir(base);
    const std::size_t size = (6u << 20) + 777, pages = (size + 4095) / 4096;
    auto live = dvrtest::random_bytes(size, 1800);
    const auto a0 = live;
    {
      Store store = Store::open(dir.store());
      Session s(store, "space");
      s.track("r", live.data(), size);
      CHECK(s.snapshot("a").stored_bytes >= size);  // into a new pack: every page new to the file system
      CHECK(store.verify().ok());
      dvrtest::fill_random(live.data(), size, 1801);
      s.restore("a");
      CHECK(diff(live, a0) == "");
      {
        dvr::Clone c = s.clone("a");
        CHECK(diff(c.region("r").data(), a0.data(), size) == "");
      }
      // While "a" lives, "c" goes to new space as well; "d" then reuses the
      // space "a" leaves, which this process wrote before: on tmpfs through
      // the mapping (on disk every copy is a pwrite).
      dvrtest::fill_random(live.data(), size, 1802);
      const auto c0 = live;
      s.snapshot("c");
      store.remove("space", "a");
      dvrtest::fill_random(live.data(), size, 1803);
      const auto d0 = live;
      s.snapshot("d");
      CHECK(store.verify().ok());
      s.restore("c");
      CHECK(diff(live, c0) == "");
      s.restore("d");
      CHECK(diff(live, d0) == "");
      store.remove("space", "c");
      store.remove("space", "d");
      store.gc();
      live = a0;
      s.snapshot("a");  // into space gc gave back: new again
    }
    // The page hash files hold the hash of every page written (in some order:
    // lanes place chunks side by side), read back by a new Store.
    Store store = Store::open(dir.store());
    std::vector<std::uint64_t> expect(pages), got;
    dvr::detail::hash_pages(reinterpret_cast<const char*>(a0.data()), size, expect.data());
    const auto packs = dvrtest::pack_files(store);
    REQUIRE(packs.size() == 1);
    dvr::detail::Packs reader(dvrtest::fs::path(packs[0]).parent_path().string(), "");
    const std::size_t span = static_cast<std::size_t>(reader.size_of(1) / 4096) - 1;
    std::vector<std::uint64_t> stored(span);
    REQUIRE(reader.stored_hashes(1, dvr::detail::kPackHeaderSize, span, stored.data()));
    for (std::uint64_t h : stored)
      if (h) got.push_back(h);
    std::sort(expect.begin(), expect.end());
    std::sort(got.begin(), got.end());
    CHECK(got == expect);
    // And a snapshot hashed against them stores just the three pages changed.
    Session s(store, "space", {.tracking = dvr::Tracking::hash});
    s.track("r", live.data(), size);
    s.base_on("a");
    for (std::size_t page : {3u, 700u, 1500u})
      live[page * 4096 + 9] ^= 0x5a;
    const auto b0 = live;
    CHECK(s.snapshot("b").stored_bytes == 3 * 4096);
    dvrtest::fill_random(live.data(), size, 1804);
    s.restore("b");
    CHECK(diff(live, b0) == "");
    s.restore("a");
    CHECK(diff(live, a0) == "");
    CHECK(store.verify().ok());
  }
}

TEST_CASE("snapshot: on tmpfs each writer grows a pack of its own; the data reads back exactly, and gc and a store with fewer threads carry on",
          "[snapshot][pack_space]") {
  for (const std::string base : {"/dev/shm", "/var/tmp"}) {
    INFO("store under " << base);
    TempDir dir(base);
    const std::size_t size = 96u << 20;
    auto live = dvrtest::random_bytes(size, 1850);
    const auto a0 = live;
    const bool memory = base == "/dev/shm";
    {
      Store store = Store::open(dir.store(), dvr::StoreOptions{.threads = 2});
      Session s(store, "lanes");
      s.track("r", live.data(), size);
      CHECK(s.snapshot("a").stored_bytes >= size);
      // tmpfs: two writers, each appending to a pack of its own (which ids
      // depends on which writer came first), each holding about half; a disk
      // file system: one pack grows.
      auto packs = dvrtest::pack_files(store);
      CHECK(packs.size() == (memory ? 2u : 1u));
      for (auto& pack : packs) {
        struct stat st {};
        REQUIRE(::stat(pack.c_str(), &st) == 0);
        CHECK(static_cast<std::uint64_t>(st.st_blocks) * 512 >= size / packs.size() - (8u << 20));
      }
      CHECK(store.verify().ok());
      dvrtest::fill_random(live.data(), size, 1851);
      const auto b0 = live;
      s.snapshot("b");  // new space again, in the same packs
      CHECK(dvrtest::pack_files(store).size() == packs.size());
      s.restore("a");
      CHECK(diff(live, a0) == "");
      s.restore("b");
      CHECK(diff(live, b0) == "");
      store.remove("lanes", "a");
      store.gc();
      CHECK(store.verify().ok());
      s.restore("b");
      CHECK(diff(live, b0) == "");
    }
    // One thread: its writer reuses the space "a" left in both packs and
    // grows pack 1 only; everything reads back.
    Store store = Store::open(dir.store(), dvr::StoreOptions{.threads = 1});
    Session s(store, "lanes");
    s.track("r", live.data(), size);
    s.base_on("b");
    dvrtest::fill_random(live.data(), size, 1852);
    const auto c0 = live;
    s.snapshot("c");
    CHECK(dvrtest::pack_files(store).size() == (memory ? 2u : 1u));
    s.restore("b");
    dvrtest::fill_random(live.data(), size, 1853);
    s.restore("c");
    CHECK(diff(live, c0) == "");
    CHECK(store.verify().ok());
  }
}

TEST_CASE("snapshot: on a full tmpfs a snapshot is no_space, nothing is published, its space is given back and earlier ones stay intact",
          "[snapshot][no_space]") {
  // A real full file system (the pwrite of new pack space fails with ENOSPC),
  // not a file-size limit: a tmpfs of 8 MiB mounted for this case.
  TempDir dir;
  const std::string mnt = dir / "mnt";
  dvrtest::MountedTmpfs tmpfs(mnt, "8m");
  if (!tmpfs) DVR_SKIP("cannot mount a tmpfs here (" << tmpfs.error() << "): needs root");
  {
    Store store = Store::open(mnt + "/store");
    auto small = dvrtest::random_bytes(1u << 20, 1900);
    const auto small0 = small;
    Session s(store, "full");
    s.track("small", small.data(), small.size());
    s.snapshot("before");
    auto big = dvrtest::random_bytes(12u << 20, 1901);  // more than the tmpfs holds
    s.track("big", big.data(), big.size());
    auto e = catch_error([&] { s.snapshot("too-big"); });
    INFO(e.what);
    CHECK(e.code == Errc::no_space);
    CHECK_THAT(e.what, Catch::Contains("full") && Catch::Contains(mnt));
    CHECK(catch_error([&] { store.info("full", "too-big"); }).code == Errc::not_found);
    CHECK(s.list().size() == 1);
    // The space it had written is free again at once, not at the next gc.
    struct statfs st {};
    REQUIRE(::statfs(mnt.c_str(), &st) == 0);
    CHECK(static_cast<std::uint64_t>(st.f_bavail) * st.f_bsize >= (5u << 20));
    s.untrack("big");
    dvrtest::fill_random(small.data(), small.size(), 1902);
    s.restore("before");
    CHECK(diff(small, small0) == "");
    CHECK(store.verify().ok());
    // With room again, a snapshot of new data works.
    auto more = dvrtest::random_bytes(2u << 20, 1903);
    const auto more0 = more;
    s.track("more", more.data(), more.size());
    s.snapshot("after");
    dvrtest::fill_random(more.data(), more.size(), 1904);
    s.restore("after");
    CHECK(diff(more, more0) == "");
  }
}

namespace {

// Snapshots, restores (checked), optional removes and gcs in one session;
// returns "" or what went wrong. Runs on its own thread (no Catch macros).
std::string thread_work(Store store, int id, bool remove_old) {
  try {
    const std::size_t size = 300000 + 4096 * static_cast<std::size_t>(id);
    std::vector<unsigned char> live(size);
    Session s(store, "thread" + std::to_string(id));
    s.track("r", live.data(), size);
    std::vector<std::vector<unsigned char>> kept;
    for (int i = 0; i < 15; ++i) {
      dvrtest::fill_random(live.data(), size, 10000u * static_cast<unsigned>(id) + static_cast<unsigned>(i));
      s.snapshot("v" + std::to_string(i));
      kept.push_back(live);
      if (remove_old && i >= 3) store.remove(s.name(), "v" + std::to_string(i - 3));
      if (i % 5 == 4) store.gc();
      int back = i >= 3 ? i - 2 : 0;
      s.restore("v" + std::to_string(back));
      if (live != kept[static_cast<std::size_t>(back)]) return "v" + std::to_string(back) + " restored wrong bytes";
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("snapshot: three threads sharing one Store object (snapshot, restore, remove, gc) do not disturb each other", "[snapshot][threads]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::string failures[3];
  std::vector<std::thread> threads;
  for (int id = 0; id < 3; ++id)
    threads.emplace_back([&, id] { failures[id] = thread_work(store, id, true); });
  for (auto& t : threads)
    t.join();
  for (auto& f : failures)
    CHECK(f == "");
  CHECK(store.verify().ok());
  CHECK(store.list().size() == 9);
}

TEST_CASE("snapshot: two threads with their own Store objects on one path (snapshot, restore, gc) do not disturb each other", "[snapshot][threads]") {
  // Separate Store objects lock through separate descriptors, like separate
  // processes. (No removes here: see the [reuse] tests for those.)
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  std::string failures[2];
  std::thread t0([&] { failures[0] = thread_work(a, 0, false); });
  std::thread t1([&] { failures[1] = thread_work(b, 1, false); });
  t0.join();
  t1.join();
  for (auto& f : failures)
    CHECK(f == "");
  CHECK(a.verify().ok());
  CHECK(b.list().size() == 30);
}

TEST_CASE("store: open_default() honours $DVR_STORE", "[store]") {
  TempDir dir;
  const char* old = std::getenv("DVR_STORE");
  std::string saved = old ? old : "";
  ::setenv("DVR_STORE", dir.store().c_str(), 1);
  std::string path;
  auto e = catch_error([&] { path = Store::open_default().path(); });
  std::string def = Store::default_path();
  if (old)
    ::setenv("DVR_STORE", saved.c_str(), 1);
  else
    ::unsetenv("DVR_STORE");
  CHECK(e.what == "(returned normally)");
  CHECK(path == dir.store());
  CHECK(def == dir.store());
  CHECK(mode_of(dir.store()) == 0700);
}
