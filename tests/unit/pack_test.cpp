// Pack files (format/pack.hpp, docs/format.md "Pack files"), used directly on
// a directory of their own: creating and growing packs, writing chunk data
// through a PackWriter (reserve, copy, page hashes, finish), reading it back,
// punching it out, and the corrupt errors, naming the file, for missing,
// foreign, short, planted and out-of-range packs.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/os.hpp"
#include "format/pack.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvr::detail::kPackHeaderSize;
using dvr::detail::kPageSize;
using dvr::detail::Packs;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

const std::string kUuid = "0123456789abcdef0123456789abcdef";  // a store id: 32 characters
const std::string kOtherUuid = "fedcba9876543210fedcba9876543210";

// A packs/ directory and a Packs on it.
struct PackDir {
  TempDir tmp;
  std::string dir = tmp / "packs";
  Packs packs;
  explicit PackDir(const std::string& uuid = kUuid) : packs((dvrtest::fs::create_directory(dir), dir), uuid) {}
};

// Writes `data` at `offset` of pack `id` the way a snapshot does: one
// writer, reserve, copy, finish, end of the batch.
void put(Packs& packs, std::uint32_t id, std::uint64_t offset, const std::vector<unsigned char>& data) {
  auto w = packs.writer(id, offset, data.size());
  w.reserve(0, data.size());
  w.copy(0, data.data(), data.size(), true);
  w.finish();
  packs.end_writes();
}

std::vector<unsigned char> bytes_at(Packs& packs, std::uint32_t id, std::uint64_t offset, std::size_t len) {
  const char* p = packs.read(id, offset, len);
  return {reinterpret_cast<const unsigned char*>(p), reinterpret_cast<const unsigned char*>(p) + len};
}

// The bytes of a file at [offset, offset + len), read with pread (not through any mapping).
std::vector<unsigned char> file_range(const std::string& path, std::uint64_t offset, std::size_t len) {
  std::vector<unsigned char> out(len);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  ssize_t n = ::pread(fd, out.data(), len, static_cast<off_t>(offset));
  ::close(fd);
  REQUIRE(n == static_cast<ssize_t>(len));
  return out;
}

std::uint64_t allocated(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return static_cast<std::uint64_t>(st.st_blocks) * 512;
}

// `c` is a corrupt error whose message names `path` and contains `what`.
void check_corrupt(const dvrtest::Caught& c, const std::string& path, const std::string& what) {
  INFO(c.what);
  CHECK(c.code == Errc::corrupt);
  CHECK_THAT(c.what, Catch::Contains(path) && Catch::Contains(what));
}

}  // namespace

TEST_CASE("pack: create writes the header and a sparse file of the size asked, listed by ids()", "[pack]") {
  PackDir d;
  d.packs.create(1, 4 << 20, 1 << 20);
  d.packs.create(3, 1 << 20, 1 << 20);
  // Not packs: id 0, other names, page hash files.
  dvrtest::write_file(d.dir + "/00000000.pack", std::string(8192, 'x'));
  dvrtest::write_file(d.dir + "/notes.pack", "x");
  dvrtest::write_file(d.dir + "/00000002.hash", "x");
  CHECK(d.packs.ids() == std::vector<std::uint32_t>{1, 3});

  const std::string path = d.packs.path_of(1);
  CHECK(path == d.dir + "/00000001.pack");
  CHECK(d.packs.size_of(1) == 4u << 20);
  CHECK(d.packs.size_of(3) == 1u << 20);
  CHECK(d.packs.size_of(2) == 0);  // no such pack
  CHECK(dvrtest::mode_of(path) == 0600);
  CHECK(allocated(path) <= 64 * 1024);  // sparse: the header and little else
  CHECK_FALSE(dvrtest::fs::exists(path + ".new"));

  // The header (docs/format.md): magic, version, id, the store's id.
  auto h = file_range(path, 0, 48);
  CHECK(std::string(h.begin(), h.begin() + 8) == "DVRPACK1");
  std::uint32_t version = 0, id = 0;
  std::memcpy(&version, h.data() + 8, 4);
  std::memcpy(&id, h.data() + 12, 4);
  CHECK(version == detail::kPackVersion);
  CHECK(id == 1);
  CHECK(std::string(h.begin() + 16, h.begin() + 48) == kUuid);
  auto h3 = file_range(d.packs.path_of(3), 12, 4);
  std::memcpy(&id, h3.data(), 4);
  CHECK(id == 3);
  // The rest of the data area reads as zeros.
  auto tail = bytes_at(d.packs, 1, kPackHeaderSize, 64 * 1024);
  CHECK(std::all_of(tail.begin(), tail.end(), [](unsigned char b) { return b == 0; }));
}

TEST_CASE("pack: grow extends a pack and never shrinks it", "[pack]") {
  PackDir d;
  d.packs.create(1, 64 * 1024, 64 * 1024);
  auto data = dvrtest::random_bytes(8192, 1);
  put(d.packs, 1, kPackHeaderSize, data);
  d.packs.grow(1, 2 << 20);
  CHECK(d.packs.size_of(1) == 2u << 20);
  d.packs.grow(1, 4096);  // smaller: nothing happens
  CHECK(d.packs.size_of(1) == 2u << 20);
  d.packs.refresh_mappings();
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, kPackHeaderSize, data.size()), data) == "");
  // The grown part can be written and read.
  auto more = dvrtest::random_bytes(1 << 20, 2);
  put(d.packs, 1, 1 << 20, more);
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, 1 << 20, more.size()), more) == "");
  auto h = file_range(d.packs.path_of(1), 0, 8);
  CHECK(std::string(h.begin(), h.end()) == "DVRPACK1");
}

TEST_CASE("pack: a writer's large and small copies are in the file after finish, and read back exactly", "[pack]") {
  PackDir d;
  d.packs.create(1, 8 << 20, 1 << 20);
  const std::string path = d.packs.path_of(1);
  const std::uint64_t before = allocated(path);
  // One extent of 2 MiB at 1 MiB: a large copy (non-temporal), then small
  // ones (flushed together by finish), at page and odd offsets.
  const std::uint64_t at = 1 << 20;
  auto big = dvrtest::random_bytes(1 << 20, 3);
  auto page = dvrtest::random_bytes(4096, 4);
  auto odd = dvrtest::random_bytes(777, 5);
  {
    auto w = d.packs.writer(1, at, 2 << 20);
    w.reserve(0, 2 << 20);
    // New space on page-granularity media: allocated by the copies (pwrite),
    // not before them (the next case follows both paths).
    CHECK(allocated(path) < before + (1u << 20));
    w.copy(0, big.data(), big.size(), true);
    w.copy(1 << 20, page.data(), page.size(), false);
    w.copy((1 << 20) + 3 * 4096 + 5, odd.data(), odd.size(), true);
    w.finish();
  }
  d.packs.end_writes();
  // Through the file itself, and through a fresh Packs (new mappings).
  CHECK(dvrtest::diff(file_range(path, at, big.size()), big) == "");
  CHECK(dvrtest::diff(file_range(path, at + (1 << 20), page.size()), page) == "");
  CHECK(dvrtest::diff(file_range(path, at + (1 << 20) + 3 * 4096 + 5, odd.size()), odd) == "");
  Packs fresh(d.dir, kUuid);
  CHECK(dvrtest::diff(bytes_at(fresh, 1, at, big.size()), big) == "");
  CHECK(dvrtest::diff(bytes_at(fresh, 1, at + (1 << 20), page.size()), page) == "");
  CHECK(dvrtest::diff(bytes_at(fresh, 1, at + (1 << 20) + 3 * 4096 + 5, odd.size()), odd) == "");
  // Bytes the writer did not copy are still zero.
  auto gap = bytes_at(fresh, 1, at + (1 << 20) + 4096, 4096);
  CHECK(std::all_of(gap.begin(), gap.end(), [](unsigned char b) { return b == 0; }));
  // Two writers of one batch, on two packs.
  d.packs.create(2, 1 << 20, 1 << 20);
  auto x = dvrtest::random_bytes(64 * 1024, 6), y = dvrtest::random_bytes(64 * 1024, 7);
  {
    auto w1 = d.packs.writer(1, 4 << 20, x.size());
    auto w2 = d.packs.writer(2, kPackHeaderSize, y.size());
    w1.reserve(0, x.size());
    w2.reserve(0, y.size());
    w1.copy(0, x.data(), x.size(), true);
    w2.copy(0, y.data(), y.size(), false);
    w1.finish();
    w2.finish();
  }
  d.packs.end_writes();
  d.packs.refresh_mappings();
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, 4 << 20, x.size()), x) == "");
  CHECK(dvrtest::diff(bytes_at(d.packs, 2, kPackHeaderSize, y.size()), y) == "");
}

TEST_CASE("pack: new space is written with pwrite, reused space through the mapping, and both read back exactly through every view", "[pack]") {
  PackDir d;
  d.packs.create(1, 8 << 20, 1 << 20);
  const std::string path = d.packs.path_of(1);
  {
    dvr::detail::Fd fd = dvr::detail::open_or_throw(path, O_RDONLY);
    if (dvr::detail::byte_persistent(fd.get(), path)) DVR_SKIP("the test directory is PMem: all copies go through libpmem2 there");
  }
  const std::uint64_t before = allocated(path);
  const std::uint64_t at = 1 << 20, len = 2 << 20;
  auto first = dvrtest::random_bytes(len, 30);
  auto page = dvrtest::random_bytes(4096, 31);
  {
    auto w = d.packs.writer(1, at, len);
    w.reserve(0, len);
    CHECK(allocated(path) < before + (1u << 20));  // nothing allocated up front
    w.copy(0, first.data(), 1 << 20, true);        // a large copy
    CHECK(allocated(path) >= before + (1u << 20)); // allocated as it was written
    w.copy(1 << 20, page.data(), page.size(), false);  // a small one
    w.copy((1 << 20) + 4096, first.data() + (1 << 20) + 4096, len - (1 << 20) - 4096, true);
    std::memcpy(first.data() + (1 << 20), page.data(), page.size());
    // The writer's own mapping sees what pwrite wrote (a MAP_SHARED view of the file).
    CHECK(dvrtest::diff(w.written(0), first.data(), len) == "");
    w.finish();
  }
  d.packs.end_writes();
  CHECK(dvrtest::diff(file_range(path, at, len), first) == "");
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, at, len), first) == "");
  // The same space again (a removed snapshot's): now it exists in the file,
  // so it is reserved up front and written through the mapping.
  auto second = dvrtest::random_bytes(len, 32);
  {
    auto w = d.packs.writer(1, at, len);
    w.reserve(0, len);
    w.copy(0, second.data(), len, true);
    w.finish();
  }
  d.packs.end_writes();
  CHECK(allocated(path) >= before + len);
  CHECK(dvrtest::diff(file_range(path, at, len), second) == "");
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, at, len), second) == "");
  Packs fresh(d.dir, kUuid);
  CHECK(dvrtest::diff(bytes_at(fresh, 1, at, len), second) == "");
  // Punched (gc), it is new space again: pwrite, nothing allocated up front.
  d.packs.punch(1, at, len);
  const std::uint64_t punched = allocated(path);
  {
    auto w = d.packs.writer(1, at, len);
    w.reserve(0, len);
    CHECK(allocated(path) < punched + (1u << 20));
    w.copy(0, first.data(), len, true);
    w.finish();
  }
  d.packs.end_writes();
  d.packs.refresh_mappings();
  CHECK(dvrtest::diff(file_range(path, at, len), first) == "");
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, at, len), first) == "");
}

TEST_CASE("pack: scattered sources written into new space through the thread's buffer, or as they are, land exactly", "[pack]") {
  PackDir d;
  d.packs.create(1, 16 << 20, 1 << 20);
  const std::string path = d.packs.path_of(1);
  {
    dvr::detail::Fd fd = dvr::detail::open_or_throw(path, O_RDONLY);
    if (dvr::detail::byte_persistent(fd.get(), path)) DVR_SKIP("the test directory is PMem: all copies go through libpmem2 there");
  }
  // Sources of odd and page sizes, one longer than the 256 KiB buffer, one
  // ending exactly where the buffer fills, two adjacent in memory: the
  // bounced write splits and joins them at the buffer's edges.
  auto src = dvrtest::random_bytes(4 << 20, 40);
  const std::vector<std::pair<std::size_t, std::size_t>> parts = {
      {0, 4096}, {4096, 4096}, {3 << 20, 777}, {1 << 20, 300 << 10}, {2 << 20, (256 << 10) - 4096 - 4096 - 777 - (300 << 10) + (512 << 10)},
      {100, 5}, {(3 << 20) + 8192, 256 << 10}, {12345, 4096 * 3 + 1}};
  std::vector<unsigned char> want;
  for (auto& [at, n] : parts)
    want.insert(want.end(), src.begin() + static_cast<std::ptrdiff_t>(at), src.begin() + static_cast<std::ptrdiff_t>(at + n));
  for (bool bounce : {true, false}) {
    INFO("through the thread's buffer: " << bounce);
    const std::uint64_t at = bounce ? (1 << 20) : (8 << 20);
    std::vector<struct iovec> pieces;
    for (auto& [from, n] : parts)
      pieces.push_back({src.data() + from, n});
    {
      auto w = d.packs.writer(1, at, 4 << 20);
      w.reserve(0, want.size());
      w.copy(0, pieces, want.size(), bounce);
      // The sources may change as soon as copy() returns.
      std::fill(src.begin(), src.end(), 0xee);
      w.finish();
    }
    d.packs.end_writes();
    d.packs.refresh_mappings();
    CHECK(dvrtest::diff(file_range(path, at, want.size()), want) == "");
    CHECK(dvrtest::diff(bytes_at(d.packs, 1, at, want.size()), want) == "");
    src = dvrtest::random_bytes(4 << 20, 40);
  }
}

TEST_CASE("pack: writers outside a pack, or reservations outside their extent, are refused", "[pack]") {
  PackDir d;
  d.packs.create(1, 1 << 20, 1 << 20);
  // Over the header, past the end, and in a pack that does not exist.
  auto header = catch_error([&] { d.packs.writer(1, 0, 4096); });
  CHECK(header.code == Errc::io);
  CHECK_THAT(header.what, Catch::Contains(d.packs.path_of(1)));
  auto past = catch_error([&] { d.packs.writer(1, (1 << 20) - 4096, 8192); });
  CHECK(past.code == Errc::io);
  CHECK_THAT(past.what, Catch::Contains(d.packs.path_of(1)));
  auto missing = catch_error([&] { d.packs.writer(9, kPackHeaderSize, 4096); });
  CHECK(missing.code == Errc::not_found);
  CHECK_THAT(missing.what, Catch::Contains(d.packs.path_of(9)));
  auto w = d.packs.writer(1, kPackHeaderSize, 8192);
  CHECK(catch_error([&] { w.reserve(4096, 8192); }).code == Errc::io);
  w.reserve(0, 0);  // nothing to reserve
  d.packs.end_writes();
  // The header is intact.
  auto h = file_range(d.packs.path_of(1), 0, 8);
  CHECK(std::string(h.begin(), h.end()) == "DVRPACK1");
}

TEST_CASE("pack: a missing, foreign, short, planted or out-of-range pack is corrupt, naming the file", "[pack]") {
  PackDir d;
  d.packs.create(1, 1 << 20, 1 << 20);
  put(d.packs, 1, kPackHeaderSize, dvrtest::random_bytes(4096, 8));

  SECTION("missing") {
    check_corrupt(catch_error([&] { d.packs.read(7, kPackHeaderSize, 4096); }), d.packs.path_of(7), "missing");
  }
  SECTION("not a pack: no magic") {
    dvrtest::write_file(d.packs.path_of(2), std::string(3 * 4096, 'z'));
    check_corrupt(catch_error([&] { d.packs.read(2, kPackHeaderSize, 4096); }), d.packs.path_of(2), "no valid header");
  }
  SECTION("shorter than its header") {
    std::string head = dvrtest::read_file(d.packs.path_of(1)).substr(0, 100);
    dvrtest::write_file(d.packs.path_of(2), head);
    check_corrupt(catch_error([&] { d.packs.read(2, kPackHeaderSize, 1); }), d.packs.path_of(2), "no valid header");
  }
  SECTION("another store's pack") {
    PackDir other(kOtherUuid);
    other.packs.create(2, 1 << 20, 1 << 20);
    dvrtest::fs::copy_file(other.packs.path_of(2), d.packs.path_of(2));
    check_corrupt(catch_error([&] { d.packs.read(2, kPackHeaderSize, 4096); }), d.packs.path_of(2), "another store");
    // A Packs without a store id (32 characters) does not compare it.
    Packs any(d.dir, "");
    CHECK_NOTHROW(any.read(2, kPackHeaderSize, 4096));
  }
  SECTION("a symbolic link planted in its place") {
    REQUIRE(::symlink(d.packs.path_of(1).c_str(), d.packs.path_of(2).c_str()) == 0);
    check_corrupt(catch_error([&] { d.packs.read(2, kPackHeaderSize, 4096); }), d.packs.path_of(2), "symbolic link");
  }
  SECTION("a reference past its end, or into its header") {
    check_corrupt(catch_error([&] { d.packs.read(1, (1 << 20) - 4096, 8192); }), d.packs.path_of(1), "truncated");
    check_corrupt(catch_error([&] { d.packs.read(1, (2 << 20), 1); }), d.packs.path_of(1), "truncated");
    check_corrupt(catch_error([&] { d.packs.read(1, 0, 4096); }), d.packs.path_of(1), "bad");
    CHECK_NOTHROW(d.packs.read(1, (1 << 20) - 4096, 4096));  // the last page is fine
  }
  SECTION("cut short after it was mapped") {
    CHECK_NOTHROW(d.packs.read(1, 512 * 1024, 4096));
    REQUIRE(::truncate(d.packs.path_of(1).c_str(), 256 * 1024) == 0);
    d.packs.refresh_mappings();
    check_corrupt(catch_error([&] { d.packs.read(1, 512 * 1024, 4096); }), d.packs.path_of(1), "truncated");
    CHECK_NOTHROW(d.packs.read(1, kPackHeaderSize, 4096));
  }
}

TEST_CASE("pack: refresh_mappings notices a pack replaced or deleted behind its back", "[pack]") {
  PackDir d;
  d.packs.create(1, 1 << 20, 1 << 20);
  auto first = dvrtest::random_bytes(4096, 9);
  put(d.packs, 1, kPackHeaderSize, first);
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, kPackHeaderSize, 4096), first) == "");
  // Another pack file renamed over it (as another store object could do).
  PackDir other;
  other.packs.create(1, 1 << 20, 1 << 20);
  auto second = dvrtest::random_bytes(4096, 10);
  put(other.packs, 1, kPackHeaderSize, second);
  REQUIRE(::rename(other.packs.path_of(1).c_str(), d.packs.path_of(1).c_str()) == 0);
  d.packs.refresh_mappings();
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, kPackHeaderSize, 4096), second) == "");
  // And gone.
  REQUIRE(::unlink(d.packs.path_of(1).c_str()) == 0);
  d.packs.refresh_mappings();
  check_corrupt(catch_error([&] { d.packs.read(1, kPackHeaderSize, 4096); }), d.packs.path_of(1), "missing");
}

TEST_CASE("pack: map_all maps every readable pack for mapped(), which never throws", "[pack]") {
  PackDir d;
  d.packs.create(1, 1 << 20, 1 << 20);
  d.packs.create(2, 1 << 20, 1 << 20);
  auto data = dvrtest::random_bytes(8192, 11);
  put(d.packs, 2, 64 * 1024, data);
  dvrtest::write_file(d.packs.path_of(3), std::string(8192, 'z'));  // damaged: skipped
  Packs fresh(d.dir, kUuid);
  CHECK(fresh.mapped(2, 64 * 1024, data.size()) == nullptr);  // not mapped yet
  CHECK_NOTHROW(fresh.map_all());
  const char* p = fresh.mapped(2, 64 * 1024, data.size());
  REQUIRE(p != nullptr);
  CHECK(dvrtest::diff(p, data.data(), data.size()) == "");
  CHECK(fresh.mapped(1, kPackHeaderSize, 4096) != nullptr);
  CHECK(fresh.mapped(3, kPackHeaderSize, 4096) == nullptr);   // the damaged one
  CHECK(fresh.mapped(4, kPackHeaderSize, 4096) == nullptr);   // none such
  CHECK(fresh.mapped(2, (1 << 20) - 4096, 8192) == nullptr);  // past the end
  CHECK(fresh.mapped(2, 0, 4096) == nullptr);                 // the header
}

TEST_CASE("pack: punch frees space, and the space can be written again", "[pack]") {
  PackDir d;
  d.packs.create(1, 4 << 20, 1 << 20);
  const std::string path = d.packs.path_of(1);
  auto data = dvrtest::random_bytes(2 << 20, 12);
  put(d.packs, 1, 1 << 20, data);
  const std::uint64_t full = allocated(path);
  REQUIRE(full >= (2u << 20));
  d.packs.punch(1, 1 << 20, 1 << 20);  // the first half of the data
  CHECK(allocated(path) + (1u << 20) <= full);
  CHECK(d.packs.size_of(1) == 4u << 20);  // the apparent size stays
  d.packs.refresh_mappings();
  auto hole = bytes_at(d.packs, 1, 1 << 20, 1 << 20);
  CHECK(std::all_of(hole.begin(), hole.end(), [](unsigned char b) { return b == 0; }));
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, 2 << 20, 1 << 20).data(), data.data() + (1 << 20), 1 << 20) == "");
  // The same writer mapping writes there again (its pages are populated anew).
  auto again = dvrtest::random_bytes(1 << 20, 13);
  put(d.packs, 1, 1 << 20, again);
  CHECK(dvrtest::diff(file_range(path, 1 << 20, 1 << 20), again) == "");
  CHECK(dvrtest::diff(bytes_at(d.packs, 1, 1 << 20, 1 << 20), again) == "");
  // Punching a pack that does not exist is no error (it is free space either way).
  CHECK_NOTHROW(d.packs.punch(9, 4096, 4096));
  // forget_populated() (after gc freed space) keeps later writes working.
  d.packs.punch(1, 1 << 20, 1 << 20);
  d.packs.forget_populated();
  put(d.packs, 1, 1 << 20, data);
  CHECK(dvrtest::diff(file_range(path, 1 << 20, 2 << 20), data) == "");
}

TEST_CASE("pack: stored_hashes returns the page hashes a writer set, and nothing where there are none", "[pack]") {
  PackDir d;
  d.packs.create(1, 4 << 20, 1 << 20);
  const std::size_t pages = 8;
  auto data = dvrtest::random_bytes(pages * kPageSize, 14);
  std::vector<std::uint64_t> hashes(pages);
  detail::hash_pages(reinterpret_cast<const char*>(data.data()), data.size(), hashes.data());
  const std::uint64_t at = 64 * 1024;
  {
    auto w = d.packs.writer(1, at, data.size());
    w.reserve(0, data.size());
    w.copy(0, data.data(), data.size(), true);
    w.set_hashes(0, hashes.data(), pages);
    w.finish();
  }
  d.packs.persist();  // the page hashes reach the file with the batch's data
  d.packs.end_writes();
  CHECK(dvrtest::fs::exists(d.dir + "/00000001.hash"));
  Packs fresh(d.dir, kUuid);
  std::vector<std::uint64_t> got(pages, 0);
  REQUIRE(fresh.stored_hashes(1, at, pages, got.data()));
  CHECK(got == hashes);
  // Part of them, from the third page.
  std::vector<std::uint64_t> part(3, 0);
  REQUIRE(fresh.stored_hashes(1, at + 2 * kPageSize, 3, part.data()));
  CHECK(part == std::vector<std::uint64_t>(hashes.begin() + 2, hashes.begin() + 5));
  // Pages nobody wrote have no hash (0), a misaligned offset gives none.
  std::vector<std::uint64_t> none(2, 7);
  REQUIRE(fresh.stored_hashes(1, 1 << 20, 2, none.data()));
  CHECK(none == std::vector<std::uint64_t>{0, 0});
  std::vector<std::uint64_t> untouched(1, 7);
  CHECK_FALSE(fresh.stored_hashes(1, at + 100, 1, untouched.data()));
  CHECK(untouched[0] == 7);
  // No hash file (a pack written before they existed): false, out unchanged.
  REQUIRE(::unlink((d.dir + "/00000001.hash").c_str()) == 0);
  Packs without(d.dir, kUuid);
  CHECK_FALSE(without.stored_hashes(1, at, 1, untouched.data()));
  CHECK(untouched[0] == 7);
  // A link planted in its place is corrupt, naming it.
  REQUIRE(::symlink("/etc/passwd", (d.dir + "/00000001.hash").c_str()) == 0);
  Packs planted(d.dir, kUuid);
  check_corrupt(catch_error([&] { planted.stored_hashes(1, at, 1, untouched.data()); }), d.dir + "/00000001.hash", "symbolic link");
}

TEST_CASE("pack: pieces written with one pwritev land one after another; a write the file system stops midway is no_space", "[pack]") {
  TempDir dir;
  const std::string path = dir / "pieces";
  dvr::detail::Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
  REQUIRE(fd.get() >= 0);
  // Three sources from different places (a page, 10 bytes, two pages), and an
  // empty one, which is skipped.
  std::vector<unsigned char> a = dvrtest::random_bytes(4096, 1), b = dvrtest::random_bytes(10, 2), c = dvrtest::random_bytes(8192, 3);
  std::vector<struct iovec> pieces{{a.data(), a.size()}, {b.data(), 0}, {b.data(), b.size()}, {c.data(), c.size()}};
  dvr::detail::write_all_at(fd.get(), pieces, 100, "the test file");
  std::vector<unsigned char> want(100, 0);
  want.insert(want.end(), a.begin(), a.end());
  want.insert(want.end(), b.begin(), b.end());
  want.insert(want.end(), c.begin(), c.end());
  std::string got = dvrtest::read_file(path);
  REQUIRE(got.size() == want.size());
  CHECK(std::memcmp(got.data(), want.data(), want.size()) == 0);
  // More than a file-size limit lets through: the kernel writes up to the
  // limit (a short write), the rest fails with EFBIG, reported as no_space;
  // what was written is the sources' prefix.
  const std::string second = dir / "limited";
  dvr::detail::Fd fd2(::open(second.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
  REQUIRE(fd2.get() >= 0);
  std::vector<struct iovec> again{{a.data(), a.size()}, {b.data(), b.size()}, {c.data(), c.size()}};
  dvrtest::Caught e;
  {
    dvrtest::FileSizeLimit limit(6000);
    e = catch_error([&] { dvr::detail::write_all_at(fd2.get(), again, 0, "the limited file"); });
  }
  CHECK(e.code == Errc::no_space);
  CHECK(e.what.find("the limited file") != std::string::npos);
  got = dvrtest::read_file(second);
  REQUIRE(got.size() == 6000);
  CHECK(std::memcmp(got.data(), want.data() + 100, 6000) == 0);
}
