// dvr::Arena: allocation patterns, rollback of a pointer-rich graph, growth,
// collisions, reopening, sizes that wrap around, reuse of freed over-aligned
// blocks (docs/arena.md).
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory_resource>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "dvr/arena.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

// Each test case its own address, so that a failing one cannot block the next:
// slot K at 0x550000000000 + K * 4 GiB (reservations of at most 1 GiB).
//
// 0x5500'0000'0000-0x5550'0000'0000 is free in every address-space layout the
// tests run under: a plain process (the kernel maps top-down from below the
// stack, near 0x7fxx'xxxx'xxxx, and puts a PIE executable at 0x5555'5555'4000
// plus up to 1 TiB), AddressSanitizer (application memory from 0x1000'7fff'8000,
// its allocator at 0x6000'0000'0000-0x6400'0000'0000) and ThreadSanitizer,
// which reserves everything but a few ranges for itself (GCC 12's libtsan:
// 0-0x200'0000'0000, 0x5500'0000'0000-0x5a00'0000'0000, its heap, and
// 0x7a00'0000'0000 up; older ones 0x5500'0000'0000-0x5680'0000'0000 and
// 0x7e80'0000'0000 up). The library's default 0x6e0000000000, and the
// 0x5e0000000000 these tests used before, lie in TSan's reserved memory, where
// MAP_FIXED_NOREPLACE fails.
ArenaOptions at(std::uintptr_t slot, std::size_t initial = 1 << 20, std::size_t reserve = std::size_t{1} << 30) {
  ArenaOptions o;
  o.address = 0x550000000000 + slot * (std::uintptr_t{1} << 32);
  o.initial = initial;
  o.reserve = reserve;
  o.grow_step = 1 << 20;
  return o;
}

struct Node {
  std::pmr::string name;
  Node* parent = nullptr;
  std::pmr::vector<Node*> children;
  std::pmr::vector<double> payload;
  explicit Node(std::pmr::memory_resource* r) : name(r), children(r), payload(r) {}
};

struct Graph {
  std::pmr::vector<Node*> nodes;
  explicit Graph(std::pmr::memory_resource* r) : nodes(r) {}
};

// A tree of n nodes with names, payloads and parent/child pointers.
Graph* build(Arena& a, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Graph* g = make<Graph>(a, &a);
  for (int i = 0; i < n; ++i) {
    Node* x = make<Node>(a, &a);
    x->name = "node-" + std::to_string(i) + std::string(static_cast<std::size_t>(rng() % 40), 'x');
    x->payload.resize(rng() % 200);
    for (auto& v : x->payload)
      v = static_cast<double>(rng() % 1000);
    if (i > 0) {
      x->parent = g->nodes[rng() % g->nodes.size()];
      x->parent->children.push_back(x);
    }
    g->nodes.push_back(x);
  }
  return g;
}

// Walks every pointer; a checksum of everything reachable.
std::uint64_t walk(Arena& a, const Graph* g) {
  std::uint64_t sum = g->nodes.size();
  for (const Node* x : g->nodes) {
    REQUIRE(a.contains(x));
    for (char c : x->name)
      sum = sum * 31 + static_cast<unsigned char>(c);
    for (double v : x->payload)
      sum = sum * 7 + static_cast<std::uint64_t>(v);
    if (x->parent) {
      REQUIRE(a.contains(x->parent));
      bool listed = false;
      for (const Node* c : x->parent->children)
        listed = listed || c == x;
      REQUIRE(listed);
    }
    for (const Node* c : x->children) {
      REQUIRE(a.contains(c));
      REQUIRE(c->parent == x);
    }
  }
  return sum;
}

}  // namespace

TEST_CASE("arena: many small objects, large vectors, free and reuse", "[arena]") {
  TempDir t;
  Session s(Store::open(t.store()), "a");
  Arena a(s, "heap", at(1));
  std::vector<void*> small;
  for (int i = 0; i < 20000; ++i) {
    void* p = a.allocate(1 + i % 300, 8);
    REQUIRE(a.contains(p));
    REQUIRE(reinterpret_cast<std::uintptr_t>(p) % 8 == 0);
    std::memset(p, i & 0xff, 1 + i % 300);
    small.push_back(p);
  }
  const std::size_t used = a.used();
  for (int i = 0; i < 20000; i += 2)
    a.deallocate(small[i], 1 + i % 300, 8);
  CHECK(a.used() < used);
  // Freed blocks are reused before the bump pointer moves on.
  std::size_t committed = a.committed();
  for (int i = 0; i < 20000; i += 2)
    small[i] = a.allocate(1 + i % 300, 8);
  CHECK(a.used() == used);
  CHECK(a.committed() == committed);
  // Over-aligned and large allocations.
  void* al = a.allocate(100, 256);
  CHECK(reinterpret_cast<std::uintptr_t>(al) % 256 == 0);
  std::pmr::vector<std::uint64_t> big(&a);
  big.resize(3 << 20);  // 24 MiB: the arena grows
  for (std::size_t i = 0; i < big.size(); ++i)
    big[i] = i;
  CHECK(a.committed() >= (24u << 20));
  void* large = a.allocate(100000, 64);
  CHECK(reinterpret_cast<std::uintptr_t>(large) % 64 == 0);
  a.deallocate(large, 100000, 64);
  CHECK(a.allocate(90000, 64) == large);  // first fit takes the freed block
  CHECK(big[12345] == 12345);
  CHECK_THROWS_AS(a.allocate(100, 8192), std::bad_alloc);
}

TEST_CASE("arena: a rollback restores a pointer-rich graph and the allocator with it", "[arena]") {
  TempDir t;
  Session s(Store::open(t.store()), "scene");
  Arena a(s, "heap", at(2));
  Graph* g = build(a, 3000, 1);
  a.set_root(g);
  const std::uint64_t sum = walk(a, g);
  const std::size_t used = a.used();
  s.snapshot("base");

  // Mutate: new nodes, renamed ones, dropped children, freed payloads.
  Graph* g2 = build(a, 500, 2);
  for (std::size_t i = 0; i < g->nodes.size(); i += 7) {
    g->nodes[i]->name += "-changed";
    g->nodes[i]->children.reserve(g->nodes[i]->children.size() + 100);  // reallocated
    g->nodes[i]->payload = std::pmr::vector<double>(&a);
  }
  g->nodes.insert(g->nodes.end(), g2->nodes.begin(), g2->nodes.end());
  CHECK(walk(a, g) != sum);

  a.restore("base");
  CHECK(a.root_as<Graph>() == g);
  CHECK(walk(a, a.root_as<Graph>()) == sum);
  CHECK(a.used() == used);
  // The allocator's state came back too: allocating and freeing goes on sanely.
  Graph* more = build(a, 200, 3);
  CHECK(walk(a, more) != 0);
  CHECK(walk(a, g) == sum);
}

TEST_CASE("arena: restore after the arena grew, and into a smaller one", "[arena]") {
  TempDir t;
  Session s(Store::open(t.store()), "g");
  Arena a(s, "heap", at(3, 1 << 20));
  Graph* g = build(a, 100, 4);
  a.set_root(g);
  const std::uint64_t sum = walk(a, g);
  const std::size_t small = a.committed();
  s.snapshot("small");
  std::pmr::vector<char> fill(&a);
  fill.resize(40 << 20, 'z');  // grows by 40 MiB
  CHECK(a.committed() > small);
  s.snapshot("big");
  a.restore("small");
  CHECK(a.committed() == small);
  CHECK(walk(a, a.root_as<Graph>()) == sum);
  a.restore("big");
  CHECK(a.committed() > small);
  CHECK(walk(a, a.root_as<Graph>()) == sum);
  // A snapshot that cannot be restored leaves the arena as it was.
  CHECK(catch_error([&] { a.restore("missing"); }).code == Errc::not_found);
  CHECK(walk(a, a.root_as<Graph>()) == sum);
}

TEST_CASE("arena: an address range in use is refused with a clear error", "[arena]") {
  TempDir t;
  Session s(Store::open(t.store()), "c");
  ArenaOptions o = at(4);
  Arena a(s, "one", o);
  auto c = catch_error([&] { Arena b(s, "two", o); });
  CHECK(c.code == Errc::already_exists);
  CHECK(c.what.find("already in use") != std::string::npos);
  // Something else mapped there.
  ArenaOptions o2 = at(5);
  void* m = ::mmap(reinterpret_cast<void*>(o2.address + (1 << 20)), 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  REQUIRE(m != MAP_FAILED);
  CHECK(catch_error([&] { Arena b(s, "three", o2); }).code == Errc::already_exists);
  ::munmap(m, 4096);
  // Bad options and a taken region name.
  ArenaOptions bad = at(6);
  bad.initial = 100;
  CHECK(catch_error([&] { Arena b(s, "four", bad); }).code == Errc::invalid_argument);
  CHECK(catch_error([&] { Arena b(s, "one", at(7)); }).code == Errc::already_exists);
}

TEST_CASE("arena: plain data reopens in a new arena at the same address", "[arena]") {
  TempDir t;
  Store store = Store::open(t.store());
  std::uint64_t sum = 0;
  {
    Session s(store, "p");
    Arena a(s, "heap", at(8));
    Graph* g = build(a, 1000, 5);
    a.set_root(g);
    sum = walk(a, g);
    std::pmr::vector<char> grow(&a);
    grow.resize(3 << 20);
    s.snapshot("saved");
  }
  // As a new process would: a fresh session and arena, then restore().
  Session s(store, "p");
  Arena a(s, "heap", at(8));
  CHECK(a.root() == nullptr);
  a.restore("saved");
  CHECK(walk(a, a.root_as<Graph>()) == sum);
  // It goes on allocating where the saved one left off.
  CHECK(walk(a, build(a, 50, 6)) != 0);
}

// do_allocate() rounds the size up to 16 and adds it to the block's start:
// for sizes near SIZE_MAX both wrap around, and the end would land below the
// committed limit (no growth, no bad_alloc, a "block" of 2^64 - 4096 bytes
// returned and the bump pointer moved backwards over live blocks).
TEST_CASE("arena: sizes that wrap around are refused instead of returning a block", "[arena]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "scene");
  ArenaOptions o = at(9);
  Arena arena(s, "heap", o);
  void* first = arena.allocate(64, 16);
  std::memset(first, 0x5a, 64);
  const std::size_t used = arena.used();

  auto huge = [&](std::size_t n) {
    try {
      (void)arena.allocate(n, 16);
      return false;
    } catch (const std::bad_alloc&) {
      return true;
    }
  };
  CHECK(huge(SIZE_MAX - 4095));
  CHECK(huge(SIZE_MAX));
  CHECK(arena.used() == used);
  // The arena still hands out fresh memory after the refusals.
  void* next = arena.allocate(64, 16);
  CHECK(next != first);
  CHECK(reinterpret_cast<std::uintptr_t>(next) >= reinterpret_cast<std::uintptr_t>(first) + 64);
}

// Small blocks with an alignment above 16 go back on their size class's free
// list when freed, and must be taken from it again: otherwise a steady
// allocate/free loop of over-aligned small objects (alignas(64) structs, SIMD
// buffers in pmr containers) grows the arena without bound while used() stays
// constant, until the reservation is full and bad_alloc is thrown.
TEST_CASE("arena: freed over-aligned small blocks are reused", "[arena]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  Session s(store, "scene");
  ArenaOptions o = at(10);
  Arena arena(s, "heap", o);
  bool aligned = true;
  for (int i = 0; i < 100000; ++i) {
    void* p = arena.allocate(64, 64);
    aligned = aligned && reinterpret_cast<std::uintptr_t>(p) % 64 == 0;
    arena.deallocate(p, 64, 64);
  }
  CHECK(aligned);
  CHECK(arena.used() == 0);
  // Without reuse: 100000 x 64 B = 6.1 MiB of bump allocations for one live block.
  CHECK(arena.committed() == o.initial);
}
