// Power cuts at random points of every way data gets into a disk store: with
// PowerCutEnv (fault_env.hpp) in place of the real OS layer, a round creates a
// store on /var/tmp and runs a full snapshot, incremental snapshots (1% of the
// pages changed), rm + gc, a receive of a stream, an ingestion of a process's
// pages (the page server CRIU dumps to, played by the test) and a snapshot
// into the space gc freed. Before each operation a few call numbers within its
// call count are drawn; after each such call the Env writes the directory a
// power cut there could leave (unsynced data lost, kept or torn per page and
// sector, sizes reverted, directory operations not followed by an fsync of
// their directory dropped; the model is docs/durability.md), and once more
// right after the operation returned. Each post-cut store is then opened with
// the real Env and must hold every snapshot whose commit had returned,
// restoring bit-exact; the snapshot of the operation that was cut is either
// there and bit-exact or absent; a snapshot whose removal had returned stays
// removed; nothing else is listed; verify is clean; and (one in four) after
// a gc, a new snapshot taken in it restores bit-exact, and so do the others.
//
// DVR_POWERCUT_TRIALS sets the number of cut points (default 1000; 200 in a
// sanitizer build).
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "dvr/proc.hpp"
#include "dvr/transfer.hpp"
#include "fault_env.hpp"
#include "proc/page_stream.hpp"
#include "proc/proc_pages.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

constexpr std::size_t kPage = 4096;

// Region name -> content of one snapshot.
using Content = std::map<std::string, std::vector<unsigned char>>;
using ContentPtr = std::shared_ptr<const Content>;

// What must (or may) be found after a cut.
struct Expect {
  std::string image;                            // the post-cut directory
  std::string op;                               // the operation cut
  std::map<std::string, ContentPtr> committed;  // "session/name": commit returned
  std::map<std::string, ContentPtr> maybe;      // in flight: there and exact, or absent
  std::set<std::string> removed;                // removal returned: must be absent
  bool store_exists = false;                    // the store's creation returned
};

// CRIU's side of the page-server protocol (as in page_stream_test.cpp).
struct Psi {
  std::uint32_t cmd;
  std::uint64_t nr_pages;
  std::uint64_t vaddr;
  std::uint64_t dst_id;
};

void send_all(int sk, const void* p, std::size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n) {
    ssize_t k = ::send(sk, c, n, MSG_NOSIGNAL);
    if (k <= 0) throw std::runtime_error("send failed");
    c += k;
    n -= static_cast<std::size_t>(k);
  }
}

template <class T>
T answer(int sk) {
  T v{};
  if (::recv(sk, &v, sizeof v, MSG_WAITALL) != sizeof v) throw std::runtime_error("no answer");
  return v;
}

// One dump of `pages` at `vaddr` into proc/`name`: the test plays CRIU.
SnapshotInfo ingest(Store& store, const std::string& name, const std::string& parent, std::uint64_t vaddr, const std::vector<unsigned char>& pages) {
  proc::impl::PageStream ps(store, name, parent, "process 1: job");
  int fd = ::dup(ps.criu_socket());
  ps.close_criu_socket();
  std::thread criu([&] {
    try {
      Psi open{4, 0, 0, 1ull << 8 | 1};
      send_all(fd, &open, sizeof open);
      (void)answer<char>(fd);
      Psi add{6u | (4u << 16), pages.size() / kPage, vaddr, 0};
      send_all(fd, &add, sizeof add);
      send_all(fd, pages.data(), pages.size());
      Psi close{0x1024, 0, 0, 0};
      send_all(fd, &close, sizeof close);
      (void)answer<std::int32_t>(fd);
    } catch (const std::exception&) {
      // The stream failed on dvr's side (the power was cut): it reports why.
    }
    ::close(fd);
  });
  try {
    ps.serve();
  } catch (...) {
    criu.join();
    throw;
  }
  criu.join();
  if (ps.error()) std::rethrow_exception(ps.error());
  return ps.finish({});
}

ContentPtr content_of(Session& s) {
  auto c = std::make_shared<Content>();
  for (Region* r : s.regions()) {
    auto* p = static_cast<const unsigned char*>(r->data());
    (*c)[r->name()] = std::vector<unsigned char>(p, p + r->size());
  }
  return c;
}

// "" when `ref` in `store` restores exactly `want`, else what differs.
std::string compare(Store& store, const std::string& ref, const Content& want) {
  auto slash = ref.find('/');
  Clone c = store.open_snapshot(ref.substr(0, slash), ref.substr(slash + 1));
  for (auto& [name, bytes] : want) {
    Region& r = c.region(name);
    if (r.size() != bytes.size())
      return ref + ": region " + name + " has " + std::to_string(r.size()) + " bytes, not " + std::to_string(bytes.size());
    std::string d = dvrtest::diff(r.data(), bytes.data(), bytes.size());
    if (!d.empty()) return ref + ": region " + name + ": " + d;
  }
  return "";
}

// Checks one post-cut store; "" when it holds, else the first violation.
std::string check_or_throw(const Expect& e, std::uint64_t seed, bool go_on) {
  const std::string where = " (cut during " + e.op + ", image " + e.image + ")";
  const std::string path = e.image + "/store";
  std::optional<Store> opened;
  try {
    opened.emplace(Store::open(path, {.create = false}));
  } catch (const Error& err) {
    if (!e.store_exists && e.committed.empty()) return "";  // never created, nothing promised
    return std::string("the store does not open: ") + err.what() + where;
  }
  Store& store = *opened;
  std::set<std::string> listed;
  for (auto& s : store.list())
    listed.insert(s.session + "/" + s.name);
  for (auto& [ref, c] : e.committed) {
    if (!listed.count(ref)) return "committed snapshot " + ref + " is missing" + where;
    if (auto d = compare(store, ref, *c); !d.empty()) return "committed snapshot differs: " + d + where;
  }
  for (auto& ref : listed) {
    if (e.committed.count(ref)) continue;
    if (e.removed.count(ref)) return "removed snapshot " + ref + " is back" + where;
    auto m = e.maybe.find(ref);
    if (m == e.maybe.end()) return "snapshot " + ref + " was never taken" + where;
    if (auto d = compare(store, ref, *m->second); !d.empty()) return "half-visible snapshot: " + d + where;
  }
  VerifyReport v = store.verify();
  if (!v.ok()) return "verify: " + v.problems[0].session + "/" + v.problems[0].snapshot + ": " + v.problems[0].what + where;
  if (!go_on) return "";
  // The store goes on: gc, then a new snapshot restores exactly, old ones too.
  store.gc();
  Session s(store, "after");
  Region& r = s.alloc("x", 64 * kPage);
  dvrtest::fill_random(r.data(), r.size(), seed);
  s.snapshot("one");
  if (auto d = compare(store, "after/one", *content_of(s)); !d.empty()) return "a snapshot after recovery differs: " + d + where;
  for (auto& [ref, c] : e.committed)
    if (auto d = compare(store, ref, *c); !d.empty()) return "after a new snapshot, " + d + where;
  v = store.verify();
  if (!v.ok()) return "verify after a new snapshot: " + v.problems[0].what + where;
  return "";
}

std::string check(const Expect& e, std::uint64_t seed, bool go_on) {
  try {
    return check_or_throw(e, seed, go_on);
  } catch (const std::exception& err) {  // a snapshot that does not open or restore, a store that fails
    return std::string(err.what()) + " (cut during " + e.op + ", image " + e.image + ")";
  }
}

std::uint64_t trials_wanted() {
  const char* t = std::getenv("DVR_POWERCUT_TRIALS");
  if (!t || !*t) return dvrtest::kSanitizer ? 200 : 1000;  // a sanitizer makes every cut several times slower
  char* end = nullptr;
  unsigned long long n = std::strtoull(t, &end, 10);
  if (*end || n == 0) throw std::invalid_argument(std::string("DVR_POWERCUT_TRIALS='") + t + "' is not a positive whole number");
  return n;
}

}  // namespace

TEST_CASE("power cut: snapshots, incremental snapshots, gc, receive and process pages survive a cut anywhere", "[powercut]") {
  const std::uint64_t wanted = trials_wanted();
  TempDir dir("/var/tmp");
  const auto started = std::chrono::steady_clock::now();

  // A stream to receive, made with the real Env.
  const std::string stream = dir / "stream";
  auto remote = std::make_shared<Content>();
  {
    Store src = Store::open(dir / "src");
    Session s(src, "remote");
    Region& r = s.alloc("r", 64 * kPage);
    dvrtest::fill_random(r.data(), r.size(), 77);
    s.snapshot("r1");
    (*remote)["r"] = std::vector<unsigned char>(static_cast<unsigned char*>(r.data()), static_cast<unsigned char*>(r.data()) + r.size());
    int fd = ::open(stream.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    transfer::send(src, "remote/r1", fd);
    ::close(fd);
  }
  // A process's pages: 128 at the start of one window.
  const std::uint64_t vaddr = 0x7f0000000000;
  const auto pages = dvrtest::random_bytes(128 * kPage, 91);
  auto job = std::make_shared<Content>();
  (*job)[detail::procpages::window_region(1, vaddr)] = std::vector<unsigned char>(detail::procpages::kWindow, 0);
  std::memcpy((*job)[detail::procpages::window_region(1, vaddr)].data(), pages.data(), pages.size());

  std::map<std::string, std::uint64_t> calls_of;  // operation -> intercepted calls (last round)
  std::uint64_t cuts = 0, rounds = 0, images_failed = 0, checked = 0;
  dvrtest::PowerCutEnv::Counters total;
  std::string first_failure;
  for (std::uint64_t round = 0; cuts < wanted; ++round) {
    ++rounds;
    const std::string root = dir / ("round-" + std::to_string(round));
    REQUIRE(::mkdir(root.c_str(), 0700) == 0);
    std::mt19937_64 rng(round * 7919 + 1);
    std::vector<Expect> images;
    Expect state;  // what holds between operations
    {
      dvrtest::PowerCutEnv env(root, round);
      dvrtest::EnvScope scope(&env);
      std::uint64_t image_no = 0;
      // Runs `op` with cut points drawn within its call count (measured the
      // round before; every call of it in round 0 is a candidate at 1/4).
      auto run = [&](const std::string& name, const std::map<std::string, ContentPtr>& maybe, auto&& op) {
        const std::uint64_t start = env.calls();
        std::set<std::uint64_t> at;
        auto known = calls_of.find(name);
        const std::uint64_t n = known == calls_of.end() ? 0 : known->second;
        const std::uint64_t draws = n == 0 ? 0 : std::min<std::uint64_t>(n, 4);
        while (at.size() < draws)
          at.insert(start + 1 + rng() % n);
        Expect during = state;
        during.op = name;
        during.maybe = maybe;
        for (auto& [ref, c] : maybe)
          during.committed.erase(ref);  // a removal in flight
        env.on_call([&](std::uint64_t k) -> std::string {
          const bool pick = n == 0 ? rng() % 4 == 0 : at.count(k) != 0;
          if (!pick) return "";
          during.image = root + "-cut-" + std::to_string(image_no++);
          images.push_back(during);
          return during.image;
        });
        op();
        env.on_call(nullptr);
        calls_of[name] = env.calls() - start;
      };
      auto cut_now = [&](const std::string& after) {
        Expect e = state;
        e.op = "nothing (right after " + after + " returned)";
        e.image = root + "-cut-" + std::to_string(image_no++);
        env.cut(e.image);
        images.push_back(e);
      };

      std::optional<Store> store;
      run("store creation", {}, [&] { store.emplace(Store::open(root + "/store")); });
      state.store_exists = true;
      cut_now("store creation");
      Session s(*store, "s");
      Region& a = s.alloc("a", 192 * kPage);
      Region& b = s.alloc("b", 64 * kPage);
      dvrtest::fill_random(a.data(), a.size(), round * 3 + 1);
      dvrtest::fill_random(b.data(), b.size(), round * 3 + 2);
      auto change = [&](std::uint64_t seed) {  // 1% of the pages, at least one per region
        std::mt19937_64 g(seed);
        for (Region* r : {&a, &b}) {
          const std::size_t n = r->size() / kPage;
          for (std::size_t p = 0; p < n; ++p)
            if (g() % 100 == 0) dvrtest::fill_random(static_cast<char*>(r->data()) + p * kPage, kPage, g());
          dvrtest::fill_random(static_cast<char*>(r->data()) + g() % n * kPage, kPage, g());
        }
      };
      auto snapshot = [&](const std::string& name) {
        auto c = content_of(s);
        run("snapshot " + name, {{"s/" + name, c}}, [&] { s.snapshot(name); });
        state.committed["s/" + name] = c;
        cut_now("snapshot " + name);
      };
      snapshot("full");
      change(round * 5 + 1);
      snapshot("inc1");
      change(round * 5 + 2);
      snapshot("inc2");
      {
        auto c = state.committed["s/full"];
        run("rm s/full", {{"s/full", c}}, [&] { store->remove("s", "full"); });
        state.committed.erase("s/full");
        state.removed.insert("s/full");
        cut_now("rm");
        run("gc", {}, [&] { store->gc(); });
        cut_now("gc");
      }
      run("receive", {{"remote/r1", remote}}, [&] {
        int fd = ::open(stream.c_str(), O_RDONLY | O_CLOEXEC);
        REQUIRE(fd >= 0);
        transfer::receive(*store, fd);
        ::close(fd);
      });
      state.committed["remote/r1"] = remote;
      cut_now("receive");
      run("process pages", {{"proc/job", job}}, [&] { ingest(*store, "job", "", vaddr, pages); });
      state.committed["proc/job"] = job;
      cut_now("process pages");
      change(round * 5 + 3);
      dvrtest::fill_random(b.data(), b.size(), round * 3 + 4);  // new data, into the space gc freed
      snapshot("inc3");
      auto c = env.counters();
      total.syncs += c.syncs;
      total.dir_syncs += c.dir_syncs;
      total.msyncs += c.msyncs;
      total.unknown_msyncs += c.unknown_msyncs;
      total.lost_ops += c.lost_ops;
      total.lost_pages += c.lost_pages;
      total.torn_pages += c.torn_pages;
      total.cuts += c.cuts;
    }
    for (auto& e : images) {
      std::string why = check(e, round, ++checked % 4 == 0);
      if (!why.empty()) {
        ++images_failed;
        if (first_failure.empty()) first_failure = why;
        if (images_failed <= 10) std::cout << "power cut: " << why << std::endl;
      }
      dvrtest::remove_tree(e.image);
    }
    dvrtest::remove_tree(root);
    cuts += images.size();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::cout << "power cut: " << cuts << " cut points in " << rounds << " rounds, " << secs << " s; " << total.syncs << " file syncs, "
            << total.dir_syncs << " directory syncs, " << total.msyncs << " msyncs modelled; after the cuts " << total.lost_pages << " pages lost, "
            << total.torn_pages << " torn, " << total.lost_ops << " directory operations dropped" << std::endl;
  CHECK(total.unknown_msyncs == 0);  // every msync was of a mapping the Env saw made
  CHECK(total.lost_pages > 0);       // the cuts did drop and tear data
  CHECK(total.torn_pages > 0);
  CHECK(total.lost_ops > 0);
  INFO(first_failure);
  CHECK(images_failed == 0);
}

TEST_CASE("power cut env: synced data and names survive, unsynced writes are lost, kept or torn per sector", "[powercut]") {
  TempDir dir("/var/tmp");
  const std::string root = dir.path();
  REQUIRE(::mkdir((root + "/d").c_str(), 0700) == 0);
  dvrtest::PowerCutEnv env(root, 5);
  auto page = [](char c) { return std::string(kPage, c); };
  const std::string f = root + "/d/f", g = root + "/d/g";
  int fd = env.open(f.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  const std::string a = page('a') + page('a');
  REQUIRE(env.pwrite(fd, a.data(), a.size(), 0) == static_cast<ssize_t>(a.size()));
  REQUIRE(env.fsync(fd) == 0);
  int dfd = ::open((root + "/d").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  REQUIRE(dfd >= 0);
  REQUIRE(env.fsync(dfd) == 0);  // f and its content are durable now
  const std::string b = page('b');
  REQUIRE(env.pwrite(fd, b.data(), b.size(), 0) == static_cast<ssize_t>(b.size()));  // page 0: not synced
  void* m = env.mmap(nullptr, 2 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(m != MAP_FAILED);
  std::memset(static_cast<char*>(m) + kPage, 'c', kPage);  // page 1: through the mapping, then msync'ed
  REQUIRE(env.msync(static_cast<char*>(m) + kPage, kPage, MS_SYNC) == 0);
  int gfd = env.open(g.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);  // its name is never synced
  REQUIRE(gfd >= 0);
  REQUIRE(env.pwrite(gfd, b.data(), b.size(), 0) == static_cast<ssize_t>(b.size()));
  REQUIRE(env.fsync(gfd) == 0);

  int old_page = 0, new_page = 0, torn = 0, g_there = 0;
  for (int i = 0; i < 64; ++i) {
    const std::string out = root + "/cut-" + std::to_string(i);
    env.cut(out);
    const std::string got = dvrtest::read_file(out + "/d/f");
    REQUIRE(got.size() == 2 * kPage);
    CHECK(got.substr(kPage) == page('c'));  // msync'ed through the mapping: durable
    const std::string p0 = got.substr(0, kPage);
    if (p0 == page('a')) {
      ++old_page;
    } else if (p0 == page('b')) {
      ++new_page;
    } else {
      ++torn;
      for (std::size_t s = 0; s < kPage; s += 512) {  // torn at sector granularity: each sector old or new, whole
        const std::string sector = p0.substr(s, 512);
        CHECK((sector == std::string(512, 'a') || sector == std::string(512, 'b')));
      }
    }
    if (dvrtest::fs::exists(out + "/d/g")) {
      ++g_there;
      CHECK(dvrtest::read_file(out + "/d/g") == b);  // its data was synced
    }
    dvrtest::remove_tree(out);
  }
  CHECK(old_page > 0);
  CHECK(new_page > 0);
  CHECK(torn > 0);
  CHECK(g_there > 0);
  CHECK(g_there < 64);
  CHECK(env.counters().unknown_msyncs == 0);
  CHECK(env.counters().msyncs == 1);
  REQUIRE(env.munmap(m, 2 * kPage) == 0);
  ::close(fd);
  ::close(gfd);
  ::close(dfd);
}

TEST_CASE("power cut: a new store is synced into its parents, below a symbolic link and at a relative path too", "[powercut]") {
  TempDir dir("/var/tmp");
  REQUIRE(::mkdir((dir / "real").c_str(), 0700) == 0);
  REQUIRE(::symlink((dir / "real").c_str(), (dir / "link").c_str()) == 0);
  {
    dvrtest::PowerCutEnv env(dir.path(), 3);
    dvrtest::EnvScope scope(&env);
    Store::open(dir / "real/a/store");
    // Everything the call made is there after any cut right after it returned.
    for (int i = 0; i < 16; ++i) {
      const std::string out = dir / ("cut-" + std::to_string(i));
      env.cut(out);
      CHECK(dvrtest::fs::exists(out + "/real/a/store/DVRSTORE"));
      CHECK(dvrtest::fs::is_directory(out + "/real/a/store/packs"));
      CHECK(dvrtest::fs::is_directory(out + "/real/a/store/sessions"));
      CHECK(dvrtest::fs::is_directory(out + "/real/a/store/tmp"));
      dvrtest::remove_tree(out);
    }
    CHECK(env.counters().lost_ops == 0);  // nothing was left unsynced to drop
  }
  // Parents outside the store may be links: syncing them follows the link.
  auto linked = dvrtest::catch_error([&] { Store::open(dir / "link/new/store"); });
  CHECK(linked.what == "(returned normally)");
  CHECK(dvrtest::fs::is_directory(dir / "real/new/store/packs"));
  char cwd[4096];
  REQUIRE(::getcwd(cwd, sizeof cwd) != nullptr);
  REQUIRE(::chdir(dir.path().c_str()) == 0);
  auto relative = dvrtest::catch_error([] { Store::open("rel/store"); });
  REQUIRE(::chdir(cwd) == 0);
  CHECK(relative.what == "(returned normally)");
  CHECK(dvrtest::fs::is_directory(dir / "rel/store/sessions"));
}
