// An aged store (issue #20, item 8): 10,000 snapshots in four sessions (three
// pages each, one of them all zero), and
// a pack whose data lies past 4 GiB, sparse below it. Listing (every name once,
// the parent links a chain per session), verify, removing half and gc stay
// correct; what stays restores bit-exact, the data past 4 GiB included. The
// times of listing, verify, rm and gc are printed as one JSON line, each with
// a peer measured in the same run (reading every manifest file; hashing every
// allocated byte of the packs), for docs/performance.md.
//
// The pack past 4 GiB: StoreImpl::test_first_offset (tests only) makes the
// allocator place new data at 4 GiB + 64 MiB of a new pack, so that its
// offsets need 64 bits in the manifests, the chunk index, the live-space map,
// gc's holes and verify, without 4 GiB being written (a hole lies below).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/hash.hpp"
#include "store/reader.hpp"
#include "store/store_impl.hpp"
#include "store/writer.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

constexpr int kSessions = 4;
constexpr int kPerSession = 2500;  // 10,000 snapshots in all
constexpr std::size_t kPages = 3;
constexpr std::uint64_t kFar = (4ull << 30) + (64ull << 20);  // where the far data goes in its pack

std::string session_name(int s) { return "s" + std::to_string(s); }
std::string snap_name(int j) { return "n" + std::to_string(j); }

// The region of snapshot j of session s: page 0 the same in the whole
// session, page 1 changes every 25 snapshots, page 2 all zero.
std::vector<unsigned char> content(int s, int j) {
  std::vector<unsigned char> v(kPages * 4096, 0);
  dvrtest::fill_random(v.data(), 4096, 100 + static_cast<std::uint64_t>(s));
  dvrtest::fill_random(v.data() + 4096, 4096, 10000 + static_cast<std::uint64_t>(s) * 1000 + static_cast<std::uint64_t>(j / 25));
  return v;
}

double since(std::chrono::steady_clock::time_point t0) { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }

// Peer of listing: every manifest file read whole, nothing decoded.
std::uint64_t read_manifests(const Store& store) {
  std::uint64_t bytes = 0;
  for (auto& session : dvrtest::fs::directory_iterator(store.path() + "/sessions"))
    for (auto& f : dvrtest::fs::directory_iterator(session.path()))
      bytes += dvrtest::read_file(f.path().string()).size();
  return bytes;
}

// Peer of verify: XXH3 of every allocated byte of the pack files (holes skipped).
std::uint64_t hash_packs(const Store& store) {
  std::uint64_t bytes = 0, sum = 0;
  std::vector<char> buf(8u << 20);
  for (auto& p : dvrtest::pack_files(store)) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    off_t at = 0;
    for (;;) {
      off_t data = ::lseek(fd, at, SEEK_DATA);
      if (data < 0) break;
      off_t hole = ::lseek(fd, data, SEEK_HOLE);
      for (off_t x = data; x < hole;) {
        auto n = ::pread(fd, buf.data(), std::min<std::size_t>(buf.size(), static_cast<std::size_t>(hole - x)), x);
        REQUIRE(n > 0);
        sum ^= detail::hash64(buf.data(), static_cast<std::size_t>(n));
        bytes += static_cast<std::uint64_t>(n);
        x += n;
      }
      at = hole;
    }
    ::close(fd);
  }
  CHECK(sum != 0);
  return bytes;
}

// "" when SESSION/NAME restores to `want` (one region "r"), else where it differs.
std::string restored_diff(Store& store, const std::string& session, const std::string& name, const std::vector<unsigned char>& want) {
  Session s(store, session);
  auto& r = s.alloc("r", want.size());
  s.restore(name);
  return dvrtest::diff(r.data(), want.data(), want.size());
}

// The lowest and highest pack offsets the stored data of SESSION/NAME lies at.
std::pair<std::uint64_t, std::uint64_t> offsets_of(Store& store, const std::string& session, const std::string& name) {
  detail::SnapshotReader reader(detail::impl_of(store));
  auto m = reader.load(session, name);
  std::uint64_t lo = UINT64_MAX, hi = 0;
  for (auto& c : m.chunks)
    if (!c.is_zero()) {
      lo = std::min(lo, c.offset);
      hi = std::max(hi, c.offset + c.length);
    }
  for (auto& o : m.overlays)
    if (o.pack != 0) {
      lo = std::min(lo, o.offset);
      hi = std::max(hi, o.offset + 4096);
    }
  return {lo, hi};
}

}  // namespace

TEST_CASE("aged: 10,000 snapshots and data past 4 GiB list, verify, collect and restore exactly", "[aged]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  // The 10,000 snapshots are written 500 to a write batch (as a stream of
  // several snapshots is received): every batch re-reads the keys of every
  // manifest in the store (StoreImpl::refresh_index), so 10,000 batches of
  // one snapshot would cost time quadratic in the store's size (measured: 75
  // ms a snapshot at 3,000 manifests on this loaded machine). Each snapshot
  // names the one before it in its session as its parent, as a session does.
  auto t0 = std::chrono::steady_clock::now();
  {
    constexpr int kBatch = 500 / kSessions;  // snapshots per session and batch
    std::vector<std::vector<unsigned char>> data(kSessions);
    for (int j0 = 0; j0 < kPerSession; j0 += kBatch) {
      detail::WriteBatch batch(detail::impl_of(store));
      std::vector<std::unique_ptr<detail::SnapshotWriter>> writers;
      for (int s = 0; s < kSessions; ++s)
        for (int j = j0; j < std::min(kPerSession, j0 + kBatch); ++j) {
          auto& d = data[static_cast<std::size_t>(s)];
          if (j % 25 == 0) d = content(s, j);
          writers.push_back(std::make_unique<detail::SnapshotWriter>(
              batch, session_name(s), snap_name(j), detail::WriterOptions{.label = "", .parent = j ? snap_name(j - 1) : ""}));
          detail::RegionSource src;
          src.name = "r";
          src.data = reinterpret_cast<const char*>(d.data());
          src.size = d.size();
          src.sdk_owned = true;
          detail::write_snapshot(*writers.back(), {src}, nullptr, false);
        }
      std::vector<detail::SnapshotWriter*> w;
      for (auto& x : writers)
        w.push_back(x.get());
      batch.publish(w);
    }
  }
  const double create_s = since(t0);

  // Data past 4 GiB: 3 MiB of noise, then the same with a few pages changed
  // (stored apart, past 4 GiB too).
  std::vector<unsigned char> far = dvrtest::random_bytes(3u << 20, 77), far2 = far;
  for (std::size_t page : {1u, 100u, 700u})
    far2[page * 4096 + 5] ^= 0xA5;
  detail::impl_of(store).test_first_offset = kFar;
  {
    Session s(store, "far");
    auto& r = s.alloc("r", far.size());
    std::memcpy(r.data(), far.data(), far.size());
    s.snapshot("one");
    std::memcpy(r.data(), far2.data(), far2.size());
    s.snapshot("two");
  }
  detail::impl_of(store).test_first_offset = 0;
  for (const char* n : {"one", "two"}) {
    auto [lo, hi] = offsets_of(store, "far", n);
    INFO("far/" << n << " lies at " << lo << " to " << hi);
    CHECK(lo >= kFar);
    CHECK(hi > (4ull << 30));
  }
  {
    // The newest pack grew past 4 GiB: the 10,000 snapshots' data below, a
    // hole, the far data above it. Its apparent size is past 4 GiB, little of
    // it is allocated.
    auto packs = dvrtest::pack_files(store);
    REQUIRE(!packs.empty());
    struct stat st {};
    REQUIRE(::stat(packs.back().c_str(), &st) == 0);
    CHECK(static_cast<std::uint64_t>(st.st_size) > kFar);
    CHECK(static_cast<std::uint64_t>(st.st_blocks) * 512 < (512ull << 20));
  }

  // Listing: exactly the 10,002 names, each once; per session the parent
  // links are one chain (what `dvr log` draws).
  t0 = std::chrono::steady_clock::now();
  std::vector<SnapshotInfo> all = store.list();
  const double list_s = since(t0);
  t0 = std::chrono::steady_clock::now();
  const std::uint64_t manifest_bytes = read_manifests(store);
  const double peer_list_s = since(t0);
  CHECK(all.size() == kSessions * kPerSession + 2);
  {
    std::set<std::string> names;
    for (auto& i : all) {
      CHECK_FALSE(i.damaged);
      names.insert(i.session + "/" + i.name);
    }
    CHECK(names.size() == all.size());
    for (int s = 0; s < kSessions; ++s)
      for (int j : {0, 1, kPerSession / 2, kPerSession - 1})
        CHECK(names.count(session_name(s) + "/" + snap_name(j)) == 1);
    for (int s = 0; s < kSessions; ++s) {
      auto list = store.list(session_name(s));
      REQUIRE(list.size() == kPerSession);
      std::map<std::string, std::string> parent;
      for (auto& i : list)
        parent[i.name] = i.parent;
      int roots = 0;
      for (int j = 0; j < kPerSession; ++j) {
        const std::string& p = parent[snap_name(j)];
        if (p.empty()) ++roots;
        else CHECK(p == snap_name(j - 1));
      }
      CHECK(roots == 1);
    }
  }

  t0 = std::chrono::steady_clock::now();
  VerifyReport v = store.verify();
  const double verify_s = since(t0);
  t0 = std::chrono::steady_clock::now();
  const std::uint64_t pack_bytes = hash_packs(store);
  const double peer_verify_s = since(t0);
  CHECK(v.ok());
  CHECK(v.snapshots == all.size());
  CHECK(restored_diff(store, "far", "one", far) == "");
  CHECK(restored_diff(store, "far", "two", far2) == "");

  // Remove every other snapshot of each session (and far/one), then gc.
  t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < kSessions; ++s)
    for (int j = 0; j < kPerSession; j += 2)
      store.remove(session_name(s), snap_name(j));
  store.remove("far", "one");
  const double rm_s = since(t0);
  t0 = std::chrono::steady_clock::now();
  GcReport g = store.gc();
  const double gc_s = since(t0);
  CHECK(g.bytes_after <= g.bytes_before);

  all = store.list();
  CHECK(all.size() == kSessions * kPerSession / 2 + 1);
  for (auto& i : all)
    CHECK((i.session == "far" || std::stoi(i.name.substr(1)) % 2 == 1));
  t0 = std::chrono::steady_clock::now();
  v = store.verify();
  const double verify2_s = since(t0);
  CHECK(v.ok());
  CHECK(v.snapshots == all.size());
  // What stays is bit-exact: the far snapshot (its base removed, its data
  // past 4 GiB kept by gc) and snapshots spread over every session.
  CHECK(restored_diff(store, "far", "two", far2) == "");
  CHECK(offsets_of(store, "far", "two").first >= kFar);
  for (int s = 0; s < kSessions; ++s)
    for (int j : {1, 25, 27, 1249, 1251, kPerSession - 1}) {
      INFO(session_name(s) << "/" << snap_name(j));
      CHECK(restored_diff(store, session_name(s), snap_name(j), content(s, j)) == "");
    }
  // A new snapshot after all that goes below 4 GiB again, into freed space.
  {
    Session s(store, "after");
    auto& r = s.alloc("r", 4096 * 4);
    std::memset(r.data(), 7, 4096 * 4);
    s.snapshot("x");
    CHECK(offsets_of(store, "after", "x").second < (4ull << 30));
  }

  // The figures, in the benchmarks' convention (bench/check_json.py): ratio
  // = peer_value / value for a cost; no peer: null.
  auto figure = [](const char* name, double value, const char* peer, double peer_value) {
    if (peer)
      std::printf("{\"name\": \"%s\", \"value\": %.6g, \"unit\": \"s\", \"peer\": \"%s\", \"peer_value\": %.6g, \"ratio\": %.6g}\n", name, value,
                  peer, peer_value, value > 0 ? peer_value / value : 0.0);
    else
      std::printf("{\"name\": \"%s\", \"value\": %.6g, \"unit\": \"s\", \"peer\": null, \"peer_value\": null, \"ratio\": null}\n", name, value);
  };
  figure("aged_store_write_10000_snapshots_in_20_batches", create_s, nullptr, 0);
  figure("aged_store_list_10002", list_s, "reading every manifest file", peer_list_s);
  figure("aged_store_verify_10002", verify_s, "XXH3 of every allocated pack byte", peer_verify_s);
  figure("aged_store_rm_5001", rm_s, nullptr, 0);
  figure("aged_store_gc_after_rm", gc_s, nullptr, 0);
  figure("aged_store_verify_5002_after_gc", verify2_s, "XXH3 of every allocated pack byte", peer_verify_s);
  std::printf("{\"test\": \"aged_store\", \"manifest_bytes\": %llu, \"pack_bytes_allocated\": %llu, \"gc_bytes_before\": %llu, \"gc_bytes_after\": %llu, \"far_offset\": %llu}\n",
              static_cast<unsigned long long>(manifest_bytes), static_cast<unsigned long long>(pack_bytes),
              static_cast<unsigned long long>(g.bytes_before), static_cast<unsigned long long>(g.bytes_after), static_cast<unsigned long long>(kFar));
}
