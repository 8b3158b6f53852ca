// Heap packs (docs/format.md, "Heap packs"): a sealed heap file linked into a
// store as packs/NNNNNNNN.heap and described in place by a snapshot
// (write_in_place, store/writer.hpp). Checked here without CRIU: the snapshot
// reads back bit-exact, holes and zero chunks cost nothing, new data never
// goes into a heap pack, gc neither punches one nor keeps one nobody
// references, damage is found, and a reference below a pack's header is
// still refused in ordinary packs.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/mapping.hpp"
#include "base/os.hpp"
#include "dvr/dvr.hpp"
#include "format/manifest.hpp"
#include "proc/heap_seal.hpp"
#include "proc/proc_heaps.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"
#include "test_support.hpp"

namespace {

using namespace dvr::detail;

constexpr std::uint64_t kPage = 4096, kHeap = 16u << 20;

// A sparse "heap file" of kHeap bytes: random data at [1 MiB, 5 MiB), a page
// of data at 9 MiB, an allocated all-zero range at [12 MiB, 13 MiB), holes
// elsewhere.
std::vector<unsigned char> make_heap_file(const std::string& path) {
  std::vector<unsigned char> want(kHeap, 0);
  auto data = dvrtest::random_bytes(4 << 20, 5);
  std::memcpy(want.data() + (1 << 20), data.data(), data.size());
  auto page = dvrtest::random_bytes(kPage, 6);
  std::memcpy(want.data() + (9 << 20), page.data(), kPage);
  Fd fd = open_or_throw(path, O_RDWR | O_CREAT, 0600);
  REQUIRE(::ftruncate(fd.get(), kHeap) == 0);
  write_all_at(fd.get(), want.data() + (1 << 20), 4 << 20, 1 << 20, path);
  write_all_at(fd.get(), page.data(), kPage, 9 << 20, path);
  std::vector<unsigned char> zeros(1 << 20, 0);
  write_all_at(fd.get(), zeros.data(), zeros.size(), 12 << 20, path);
  return want;
}

// Links `file` into the store as heap pack `id` and publishes snapshot
// SESSION/NAME of it, in place.
dvr::SnapshotInfo seal_in_place(dvr::Store& store, const std::string& file, std::uint32_t id, const std::string& session, const std::string& name) {
  StoreImpl& si = impl_of(store);
  REQUIRE(::link(file.c_str(), si.packs->heap_path_of(id).c_str()) == 0);
  WriteBatch batch(si);
  SnapshotWriter w(batch, session, name, {.label = "a sealed heap"});
  w.add_region("heap", kHeap, false);
  w.seal();
  Fd fd = open_or_throw(si.packs->heap_path_of(id), O_RDONLY);
  w.set_provenance(false, write_in_place(w, 0, id, fd.get(), heaps::holes_of(fd.get(), kHeap)));
  return batch.publish({&w}).front();
}

std::vector<unsigned char> read_back(dvr::Store& store, const std::string& session, const std::string& name) {
  dvr::Clone c = store.open_snapshot(session, name);
  REQUIRE(c.regions().size() == 1);
  const auto* p = static_cast<const unsigned char*>(c.regions()[0]->data());
  return {p, p + c.regions()[0]->size()};
}

}  // namespace

TEST_CASE("heap packs: a sealed file described in place reads back bit-exact and costs its non-zero chunks", "[store][heap-pack]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  const std::string file = dir / "heapfile";
  const auto want = make_heap_file(file);
  auto info = seal_in_place(store, file, 7, "h", "s1");
  // Only the 4 MiB of data and the chunk holding the lone page count; holes
  // and the allocated zero megabyte are zero chunks.
  CHECK(info.stored_bytes == (4u << 20) + store.chunk_size());
  CHECK(read_back(store, "h", "s1") == want);
  CHECK(store.verify().ok());
  StoreImpl& si = impl_of(store);
  const Manifest m = si.load_manifest("h", "s1");
  CHECK(heaps::in_place_pack(m, "heap", kHeap, *si.packs) == 7);
  CHECK(heaps::in_place_pack(m, "heap", kHeap - kPage, *si.packs) == 0);  // no such region
  bool offset_zero_or_low = false;
  for (auto& c : m.chunks)
    offset_zero_or_low = offset_zero_or_low || (!c.is_zero() && c.offset < kPage * 2 + (1 << 20));
  CHECK(offset_zero_or_low);  // the data at 1 MiB is referenced at 1 MiB: no header before it
}

TEST_CASE("heap packs: a heap file cut short while it is hashed fails the snapshot by name, and nothing is published",
          "[store][heap-pack]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  const std::string file = dir / "heapfile";
  make_heap_file(file);
  StoreImpl& si = impl_of(store);
  REQUIRE(::link(file.c_str(), si.packs->heap_path_of(7).c_str()) == 0);
  {
    WriteBatch batch(si);
    SnapshotWriter w(batch, "h", "cut", {.label = "a sealed heap"});
    w.add_region("heap", kHeap, false);
    w.seal();
    Fd fd = open_or_throw(si.packs->heap_path_of(7), O_RDWR);
    const auto holes = heaps::holes_of(fd.get(), kHeap);  // taken while whole, as a dump does
    REQUIRE(::ftruncate(fd.get(), 3 << 20) == 0);           // then cut in the middle of the data
    try {
      write_in_place(w, 0, 7, fd.get(), holes);
      FAIL("a heap file cut short was hashed without an error");
    } catch (const dvr::Error& e) {
      CHECK(e.code() == dvr::Errc::corrupt);
      CHECK_THAT(e.what(), Catch::Matchers::Contains(si.packs->heap_path_of(7)) && Catch::Matchers::Contains("truncated while in use"));
    }
  }
  CHECK(store.list("h").empty());
}

TEST_CASE("heap packs: new data never goes into one, gc never punches one, and drops it once no snapshot uses it", "[store][heap-pack][gc]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  const std::string file = dir / "heapfile";
  const auto want = make_heap_file(file);
  seal_in_place(store, file, 1, "h", "s1");
  struct stat before {};
  REQUIRE(::stat(file.c_str(), &before) == 0);
  // Other snapshots: their data goes into packs of their own, never into the
  // heap pack's holes, even when removed snapshots left room elsewhere.
  dvr::Session s(store, "other");
  std::vector<unsigned char> mem = dvrtest::random_bytes(8 << 20, 9);
  s.track("m", mem.data(), mem.size());
  for (int i = 0; i < 4; ++i) {
    dvrtest::fill_random(mem.data(), mem.size(), 20 + static_cast<std::uint64_t>(i));
    s.snapshot("o" + std::to_string(i));
  }
  store.remove("other", "o1");
  dvrtest::fill_random(mem.data(), mem.size(), 99);
  s.snapshot("o9");
  StoreImpl& si = impl_of(store);
  for (auto& name : {"o0", "o2", "o3", "o9"})
    for (auto& c : si.load_manifest("other", name).chunks)
      REQUIRE(c.pack != 1);
  store.gc();
  struct stat after {};
  REQUIRE(::stat(file.c_str(), &after) == 0);
  CHECK(after.st_blocks == before.st_blocks);  // nothing punched
  CHECK(read_back(store, "h", "s1") == want);
  CHECK(dvrtest::read_file(file) == std::string(want.begin(), want.end()));
  // Unreferenced, the heap pack goes; the file keeps its other name and bytes.
  store.remove("h", "s1");
  store.gc();
  CHECK_FALSE(path_exists(si.packs->heap_path_of(1)));
  CHECK(dvrtest::read_file(file) == std::string(want.begin(), want.end()));
  CHECK(store.verify().ok());
}

TEST_CASE("heap packs: a changed byte is damage that verify names; a snapshot repeating the chunk table reads nothing", "[store][heap-pack]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  const std::string file = dir / "heapfile";
  make_heap_file(file);
  seal_in_place(store, file, 3, "h", "s1");
  // A second snapshot of the unchanged file: the first's chunk table, unread.
  StoreImpl& si = impl_of(store);
  {
    const Manifest base = si.load_manifest("h", "s1", nullptr, false);
    WriteBatch batch(si);
    SnapshotWriter w(batch, "h", "s2", {.parent = "s1"});
    w.add_region("heap", kHeap, false);
    w.seal();
    for (std::size_t j = 0; j < base.chunks.size(); ++j)
      if (base.chunks[j].is_zero())
        w.zero(j);
      else
        w.unchanged(j, base.chunks[j]);
    auto info = batch.publish({&w}).front();
    CHECK(info.stored_bytes == 0);
    CHECK(w.published().page_hashes.empty());  // taken from the page hash files by whoever needs them
  }
  CHECK(read_back(store, "h", "s2") == read_back(store, "h", "s1"));
  dvrtest::flip_byte(file, (2 << 20) + 17);
  auto report = store.verify();
  CHECK_FALSE(report.ok());
  CHECK(report.damaged_snapshots() == std::vector<std::string>{"h/s1", "h/s2"});
  CHECK_THROWS_AS(store.open_snapshot("h", "s1"), dvr::Error);
}

TEST_CASE("heap packs: a chunk below an ordinary pack's header is refused when read, not trusted", "[store][heap-pack]") {
  dvrtest::TempDir dir;
  dvr::Store store = dvr::Store::open(dir.store());
  dvr::Session s(store, "s");
  std::vector<unsigned char> mem = dvrtest::random_bytes(1 << 20, 4);
  s.track("m", mem.data(), mem.size());
  s.snapshot("a");
  StoreImpl& si = impl_of(store);
  Manifest m = si.load_manifest("s", "a");
  for (auto& c : m.chunks)
    if (!c.is_zero()) c.offset = 0;  // where the pack's header is
  si.publish_manifest(m);
  try {
    store.open_snapshot("s", "a");
    FAIL("a chunk at offset 0 of an ordinary pack was read");
  } catch (const dvr::Error& e) {
    CHECK(e.code() == dvr::Errc::corrupt);
    // Said as it is (not "it ends at byte N but a chunk needs bytes [0, ...)").
    CHECK_THAT(e.what(), Catch::Contains("points into its header") && !Catch::Contains("ends at byte"));
  }
}
