// Caller-owned regions that do not start on a page boundary (a numpy array
// starts 16 bytes past one): each region page then spans two memory pages.
// Snapshots and restores are bit-exact at several head offsets and sizes, in
// both tracking modes; restores, clones and received snapshots never write a
// byte outside the region; and a rollback after scattered writes copies only
// the memory pages written (the neighbouring ones are made read-only: a write
// into them would kill the test).

#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>

#include "dvr/transfer.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;
constexpr std::size_t kPage = 4096;
constexpr unsigned char kGuard = 0xA5;

// Anonymous memory holding a region `head` bytes past a page boundary, with a
// guard page before that boundary and guard bytes up to a whole page after
// the region's end (at least one page of them).
class Placed {
 public:
  Placed(std::size_t head, std::size_t size) : head_(head), size_(size) {
    length_ = kPage + (head + size + kPage - 1) / kPage * kPage + kPage;
    void* p = ::mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    base_ = static_cast<unsigned char*>(p);
    std::memset(base_, kGuard, length_);
  }
  ~Placed() { ::munmap(base_, length_); }
  Placed(const Placed&) = delete;
  Placed& operator=(const Placed&) = delete;

  unsigned char* data() const { return base_ + kPage + head_; }
  std::size_t size() const { return size_; }
  // Every byte outside the region, before and after it.
  Bytes guards() const {
    Bytes g(base_, data());
    g.insert(g.end(), data() + size_, base_ + length_);
    return g;
  }
  void set_guards(unsigned char v) {
    std::memset(base_, v, kPage + head_);
    std::memset(data() + size_, v, length_ - kPage - head_ - size_);
  }
  // The memory page holding region byte `offset`.
  unsigned char* page_of(std::size_t offset) const {
    return reinterpret_cast<unsigned char*>(reinterpret_cast<std::uintptr_t>(data() + offset) & ~(kPage - 1));
  }

 private:
  std::size_t head_, size_, length_;
  unsigned char* base_ = nullptr;
};

Bytes bytes_of(const unsigned char* p, std::size_t n) { return Bytes(p, p + n); }

// Flips one byte in every `stride`-th memory page of the region (and its
// first and last byte), deterministically from `seed`.
void scatter(Placed& mem, std::size_t stride, unsigned seed) {
  unsigned char* p = mem.data();
  std::size_t first = kPage - reinterpret_cast<std::uintptr_t>(p) % kPage;  // first byte of the second memory page
  for (std::size_t off = first + (seed % stride) * kPage; off < mem.size(); off += stride * kPage)
    p[off + (seed * 37) % std::min(kPage, mem.size() - off)] ^= static_cast<unsigned char>(1 + seed);
  p[0] ^= 0x10;
  p[mem.size() - 1] ^= 0x20;
}

const char* mode_name(Tracking t) { return t == Tracking::hash ? "hash" : "write_protect"; }

}  // namespace

TEST_CASE("unaligned: snapshots and restores are exact and never write outside the region", "[unaligned]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  const std::size_t sizes[] = {100, kPage - 1, 3 * kPage + 7, cs - 16, 2 * cs + 5 * kPage + 123};
  int n = 0;
  for (Tracking mode : {Tracking::write_protect, Tracking::hash})
    for (std::size_t head : {std::size_t{1}, std::size_t{16}, kPage - 1})
      for (std::size_t size : sizes) {
        INFO("tracking " << mode_name(mode) << ", head " << head << ", size " << size);
        Placed mem(head, size);
        dvrtest::fill_random(mem.data(), size, 100 + head + size);
        Session s(store, "u" + std::to_string(n++), {.tracking = mode});
        s.track("data", mem.data(), size);
        std::map<std::string, Bytes> expect;
        auto snap = [&](const std::string& name) {
          s.snapshot(name);
          expect[name] = bytes_of(mem.data(), size);
        };
        snap("s0");
        scatter(mem, 3, 1);
        snap("s1");  // incremental: scattered writes
        scatter(mem, 5, 2);
        snap("s2");
        // The application writes next to the region (its allocator's
        // header, the next object): restores must leave that alone.
        mem.set_guards(0x5A);
        const Bytes guards = mem.guards();
        for (const char* name : {"s0", "s2", "s1", "s1", "s2", "s0"}) {
          INFO("restore " << name);
          scatter(mem, 4, 3);  // written since: rolled back too
          s.restore(name);
          CHECK(dvrtest::diff(bytes_of(mem.data(), size), expect[name]) == "");
          CHECK(dvrtest::diff(mem.guards(), guards) == "");
        }
        // A clone shows exactly the region's bytes.
        Clone c = s.clone("s1");
        Region& cr = c.region("data");
        REQUIRE(cr.size() == size);
        CHECK(dvrtest::diff(cr.data(), expect["s1"].data(), size) == "");
      }
  CHECK(store.verify().ok());
}

TEST_CASE("unaligned: a rollback writes only the memory pages written since", "[unaligned]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  for (std::size_t head : {std::size_t{1}, std::size_t{16}, kPage - 1}) {
    INFO("head " << head);
    const std::size_t size = 2 * cs + 10 * kPage + 99;
    Placed mem(head, size);
    dvrtest::fill_random(mem.data(), size, 7 + head);
    Session s(store, "roll" + std::to_string(head), {.tracking = Tracking::write_protect});
    s.track("data", mem.data(), size);
    if (s.tracking("data") != Tracking::write_protect) DVR_SKIP("write-protect tracking unavailable: " << s.tracking_note());
    s.snapshot("base");
    const Bytes base = bytes_of(mem.data(), size);
    // Written: memory pages holding region bytes 5 pages in and one chunk in
    // (a chunk boundary of the region's pages falls inside that memory page).
    for (std::size_t off : {5 * kPage, cs}) {
      unsigned char* page = mem.page_of(off);
      page[100] ^= 1;
      // Their neighbours were not written: a restore that wrote into them
      // (whole region pages) would fault here.
      REQUIRE(::mprotect(page - kPage, kPage, PROT_READ) == 0);
      REQUIRE(::mprotect(page + kPage, kPage, PROT_READ) == 0);
    }
    s.restore("base");
    for (std::size_t off : {5 * kPage, cs}) {
      unsigned char* page = mem.page_of(off);
      REQUIRE(::mprotect(page - kPage, 3 * kPage, PROT_READ | PROT_WRITE) == 0);
    }
    CHECK(dvrtest::diff(bytes_of(mem.data(), size), base) == "");
    // Tracking survived, and the next rollback is still exact.
    CHECK(s.tracking("data") == Tracking::write_protect);
    scatter(mem, 7, 4);
    s.restore("base");
    CHECK(dvrtest::diff(bytes_of(mem.data(), size), base) == "");
  }
}

TEST_CASE("unaligned: a sent and received snapshot restores exactly into memory aligned otherwise", "[unaligned]") {
  TempDir dir;
  Store a = Store::open(dir.path() + "/a");
  Store b = Store::open(dir.path() + "/b");
  const std::size_t size = 3 * a.chunk_size() + 17 * kPage + 5;
  Placed mem(16, size);
  dvrtest::fill_random(mem.data(), size, 9);
  Session s(a, "net");
  s.track("data", mem.data(), size);
  s.snapshot("one");
  scatter(mem, 3, 5);
  s.snapshot("two");
  const Bytes two = bytes_of(mem.data(), size);

  int fd = ::memfd_create("unaligned-stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::send(a, "net/two", fd);
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  transfer::receive(b, fd);
  ::close(fd);
  CHECK(b.verify().ok());

  for (std::size_t head : {std::size_t{1}, kPage - 1}) {
    INFO("received, restored at head " << head);
    Placed other(head, size);
    const Bytes guards = other.guards();
    Session r(b, "net");
    r.track("data", other.data(), size);
    r.restore("two");
    CHECK(dvrtest::diff(bytes_of(other.data(), size), two) == "");
    CHECK(dvrtest::diff(other.guards(), guards) == "");
  }
}
