// The write tracker (userfaultfd async write-protect + PAGEMAP_SCAN).
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "test_support.hpp"
#include "base/pagemap.hpp"
#include "track/dirty.hpp"

using dvr::detail::AddrRange;
using dvr::detail::WriteTracker;

namespace {
struct Pages {
  explicit Pages(std::size_t n) : size(n * 4096) {
    p = static_cast<char*>(::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  }
  ~Pages() { ::munmap(p, size); }
  AddrRange range() const { return {reinterpret_cast<std::uintptr_t>(p), reinterpret_cast<std::uintptr_t>(p) + size}; }
  std::uintptr_t page(std::size_t i) const { return reinterpret_cast<std::uintptr_t>(p) + i * 4096; }
  char* p;
  std::size_t size;
};
}  // namespace

TEST_CASE("tracker: reports exactly the pages written, once, and keeps watching", "[dirty]") {
  std::string why;
  auto t = WriteTracker::open(&why);
  if (!t) DVR_SKIP("write tracking unavailable here: " << why);
  Pages mem(64);
  std::memset(mem.p, 1, mem.size);  // populated before tracking starts
  REQUIRE(t->add(mem.range(), &why));
  std::vector<AddrRange> w;
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w.empty());

  mem.p[3 * 4096 + 17] = 2;                         // one byte
  std::memset(mem.p + 10 * 4096 + 4000, 3, 200);    // straddles pages 10 and 11
  std::memcpy(mem.p + 40 * 4096, mem.p, 3 * 4096);  // pages 40-42
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{{mem.page(3), mem.page(4)}, {mem.page(10), mem.page(12)}, {mem.page(40), mem.page(43)}});

  w.clear();
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w.empty());  // collecting protects again
  mem.p[3 * 4096] = 9;
  w.clear();
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{{mem.page(3), mem.page(4)}});
  t->remove(mem.range());
}

TEST_CASE("tracker: never-touched pages and MADV_DONTNEED are never missed", "[dirty]") {
  std::string why;
  auto t = WriteTracker::open(&why);
  if (!t) DVR_SKIP("write tracking unavailable here: " << why);
  Pages mem(32);  // not populated at all
  REQUIRE(t->add(mem.range(), &why));
  std::vector<AddrRange> w;
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w.empty());
  mem.p[5 * 4096] = 1;  // first touch of a never-populated page
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{{mem.page(5), mem.page(6)}});

  // Dropping pages changes their content (to zeros) without a write: they must
  // be reported too, whether touched afterwards or not.
  std::memset(mem.p, 7, mem.size);
  w.clear();
  REQUIRE(t->collect(mem.range(), w));
  w.clear();
  REQUIRE(::madvise(mem.p + 8 * 4096, 4 * 4096, MADV_DONTNEED) == 0);
  volatile char read_back = mem.p[9 * 4096];
  (void)read_back;
  mem.p[11 * 4096] = 1;
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{{mem.page(8), mem.page(12)}});
}

TEST_CASE("tracker: memory registered unprotected counts as written until protected, then even its holes are watched", "[dirty]") {
  std::string why;
  auto t = WriteTracker::open(&why);
  if (!t) DVR_SKIP("write tracking unavailable here: " << why);
  Pages mem(32);  // not populated at all
  REQUIRE(t->add(mem.range(), &why, false));
  std::memset(mem.p, 1, 4 * 4096);  // pages 0-3: one fault each, no protection to resolve
  std::vector<AddrRange> w;
  REQUIRE(t->written(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{mem.range()});  // unknown yet: everything, holes too
  w.clear();
  REQUIRE(t->reprotect(mem.range()));  // what a snapshot does after it is taken
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w.empty());
  mem.p[20 * 4096] = 1;  // a page that was a hole when protected
  mem.p[2 * 4096 + 9] = 2;
  mem.p[31 * 4096 + 4095] = 3;
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{{mem.page(2), mem.page(3)}, {mem.page(20), mem.page(21)}, {mem.page(31), mem.page(32)}});
  t->remove(mem.range());
}

TEST_CASE("tracker: reprotect forgets our own writes, and unmapped memory is reported as untracked", "[dirty]") {
  std::string why;
  auto t = WriteTracker::open(&why);
  if (!t) DVR_SKIP("write tracking unavailable here: " << why);
  Pages mem(16);
  REQUIRE(t->add(mem.range(), &why));
  std::memset(mem.p, 1, mem.size);
  REQUIRE(t->reprotect(mem.range()));
  std::vector<AddrRange> w;
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w.empty());
  REQUIRE(t->unprotect(mem.range()));
  REQUIRE(t->collect(mem.range(), w));
  CHECK(w == std::vector<AddrRange>{mem.range()});  // unprotected pages count as written

  // The same address range mapped again is no longer registered: collect must
  // say so instead of reporting "nothing written".
  void* again = ::mmap(mem.p, mem.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  REQUIRE(again == mem.p);
  mem.p[0] = 1;
  w.clear();
  CHECK_FALSE(t->collect(mem.range(), w));
}

TEST_CASE("dirty: present_ranges lists exactly the pages that have a page-table entry", "[dirty][pagemap]") {
  Pages m(64);
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> none;
  if (!dvr::detail::present_ranges(m.page(0), m.page(64), none)) DVR_SKIP("PAGEMAP_SCAN is unavailable here (Linux 6.7+)");
  CHECK(none.empty());  // never touched
  for (std::size_t i : {3u, 4u, 5u, 20u, 63u})
    m.p[i * 4096] = 1;
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> got;
  REQUIRE(dvr::detail::present_ranges(m.page(0), m.page(64), got));
  const std::vector<std::pair<std::uintptr_t, std::uintptr_t>> want{{m.page(3), m.page(6)}, {m.page(20), m.page(21)}, {m.page(63), m.page(64)}};
  CHECK(got == want);
  // A part of the range: only what lies in it.
  got.clear();
  REQUIRE(dvr::detail::present_ranges(m.page(4), m.page(21), got));
  CHECK(got == std::vector<std::pair<std::uintptr_t, std::uintptr_t>>{{m.page(4), m.page(6)}, {m.page(20), m.page(21)}});
}
