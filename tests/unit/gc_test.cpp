// Unit tests of remove() and gc(): space is really reclaimed, what remains
// restores bit-exact, leftovers are cleaned, damage makes gc refuse.
#include <cstdlib>
#include <map>
#include <memory>
#include <random>

#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;
namespace fs = std::filesystem;

TEST_CASE("gc: removing a 16 MiB snapshot and collecting frees its space, and the rest restores bit-exact", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t mib = 1 << 20;
  auto keep1 = dvrtest::random_bytes(mib + 1234, 1100);
  auto big = dvrtest::random_bytes(16 * mib, 1101);
  auto keep2 = dvrtest::random_bytes(mib / 2 + 7, 1102);
  // The big snapshot sits between the two kept ones in the pack, so its space
  // can only come back by punching a hole, not by truncating the pack.
  {
    Session s1(store, "keep");
    s1.track("r", keep1.data(), keep1.size());
    s1.snapshot("k1");
    Session sb(store, "big");
    sb.track("r", big.data(), big.size());
    CHECK(sb.snapshot("b").stored_bytes == 16 * mib);
    Session s2(store, "keep2");
    s2.track("r", keep2.data(), keep2.size());
    s2.snapshot("k2");
  }
  auto used_before = dvrtest::pack_allocated(store);
  CHECK(used_before >= 16 * mib + keep1.size() + keep2.size());

  store.remove("big", "b");
  CHECK(catch_error([&] { store.info("big", "b"); }).code == Errc::not_found);
  CHECK(store.sessions() == std::vector<std::string>{"keep", "keep2"});
  // Data stays until gc.
  CHECK(dvrtest::pack_allocated(store) == used_before);

  auto report = store.gc();
  CHECK(report.bytes_before == used_before);
  CHECK(report.bytes_after < report.bytes_before);
  CHECK(report.bytes_before - report.bytes_after >= 16 * mib);
  CHECK(report.bytes_after == dvrtest::pack_allocated(store));
  CHECK(report.bytes_after >= keep1.size() + keep2.size());
  CHECK(store.stats().pack_bytes == report.bytes_after);

  std::vector<unsigned char> live1(keep1.size()), live2(keep2.size());
  Session r1(store, "keep");
  r1.track("r", live1.data(), live1.size());
  r1.restore("k1");
  CHECK(diff(live1.data(), keep1.data(), keep1.size()) == "");
  Session r2(store, "keep2");
  r2.track("r", live2.data(), live2.size());
  r2.restore("k2");
  CHECK(diff(live2.data(), keep2.data(), keep2.size()) == "");
  CHECK(store.verify().ok());

  // A second gc finds nothing more to free.
  auto again = store.gc();
  CHECK(again.bytes_after == again.bytes_before);
  CHECK(again.packs_removed == 0);
}

TEST_CASE("gc: data shared with a remaining snapshot is kept", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t cs = store.chunk_size();
  auto data = dvrtest::random_bytes(20 * cs, 1110);
  auto v0 = data;
  Session s(store, "shared");
  s.track("r", data.data(), data.size());
  s.snapshot("first");
  // Every other chunk changes in every page, so it is stored whole again.
  for (std::size_t i = 0; i < 10; ++i)
    for (std::size_t p = 0; p < cs; p += 4096)
      data[i * 2 * cs + p] ^= 0x55;
  auto v1 = data;
  CHECK(s.snapshot("second").stored_bytes == 10 * cs);
  store.remove("shared", "first");
  auto report = store.gc();
  // The 10 chunks unique to "first" are freed; the 20 that "second" uses stay
  // (plus at most a pack header and a little slack).
  CHECK(report.bytes_before - report.bytes_after >= 10 * cs);
  CHECK(report.bytes_after >= 20 * cs);
  CHECK(report.bytes_after <= 20 * cs + 64 * 1024);
  std::fill(data.begin(), data.end(), 0);
  s.restore("second");
  CHECK(diff(data.data(), v1.data(), data.size()) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("gc: after removing everything, packs go and new snapshots work (no stale dedup)", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(8 * store.chunk_size() + 5, 1120);
  auto v0 = data;
  Session s(store, "all");
  s.track("r", data.data(), data.size());
  s.snapshot("a");
  s.snapshot("b");
  store.remove("all", "a");
  store.remove("all", "b");
  CHECK(store.sessions().empty());
  CHECK(store.list().empty());
  auto report = store.gc();
  CHECK(report.bytes_after < report.bytes_before);
  CHECK(report.bytes_after <= 64 * 1024);  // at most pack headers remain
  // The same Store object snapshots the same data again: it must be stored
  // anew, not deduplicated against the freed chunks.
  auto info = s.snapshot("c");
  CHECK(info.stored_bytes >= data.size());
  std::fill(data.begin(), data.end(), 0);
  s.restore("c");
  CHECK(diff(data.data(), v0.data(), data.size()) == "");
  CHECK(store.verify().ok());
  // And a fresh Store object agrees.
  Store other = Store::open(dir.store());
  Session o(other, "all");
  std::vector<unsigned char> live(data.size());
  o.track("r", live.data(), live.size());
  o.restore("c");
  CHECK(diff(live.data(), v0.data(), live.size()) == "");
}

TEST_CASE("gc: leftover files in STORE/tmp are removed and counted", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(10000, 1130);
  Session s(store, "t");
  s.track("r", data.data(), data.size());
  s.snapshot("a");
  dvrtest::write_file(dir.store() + "/tmp/0123456789abcdef0123456789abcdef.tmp", "half a manifest");
  dvrtest::write_file(dir.store() + "/tmp/leftover", std::string(10000, 'x'));
  // A pack file half-created by a crash (written as NNNNNNNN.pack.new, then renamed).
  dvrtest::write_file(dir.store() + "/packs/00000009.pack.new", std::string(4096, 'p'));
  auto report = store.gc();
  CHECK(report.temp_files_removed == 3);
  CHECK(dvrtest::tree(dir.store() + "/tmp") == std::vector<std::string>{});
  CHECK_FALSE(fs::exists(dir.store() + "/packs/00000009.pack.new"));
  CHECK(report.bytes_after == report.bytes_before);
  std::fill(data.begin(), data.end(), 0);
  s.restore("a");
  CHECK(diff(data, dvrtest::random_bytes(10000, 1130)) == "");
  CHECK(store.gc().temp_files_removed == 0);
}

TEST_CASE("gc: refuses with corrupt while a manifest is damaged, naming it, and works after it is removed", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(4 * store.chunk_size(), 1140);
  auto b = dvrtest::random_bytes(4 * store.chunk_size(), 1141);
  Session s(store, "g");
  s.track("r", a.data(), a.size());
  s.snapshot("fine");
  std::memcpy(a.data(), b.data(), b.size());
  s.snapshot("broken");
  s.snapshot("gone");
  store.remove("g", "gone");
  std::string file = dvrtest::manifest_path(store, "g", "broken");
  auto bytes = dvrtest::read_file(file);
  dvrtest::write_file(file, bytes.substr(0, bytes.size() - 1));

  auto used = dvrtest::pack_allocated(store);
  auto e = catch_error([&] { store.gc(); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("g/broken"));
  CHECK(dvrtest::pack_allocated(store) == used);

  // remove works on a damaged snapshot; then gc can run and frees its chunks.
  store.remove("g", "broken");
  auto report = store.gc();
  CHECK(report.bytes_before - report.bytes_after >= b.size());
  std::vector<unsigned char> live(a.size());
  Session r(store, "g");
  r.track("r", live.data(), live.size());
  r.restore("fine");
  CHECK(diff(live, dvrtest::random_bytes(4 * store.chunk_size(), 1140)) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("remove: unknown snapshot or session is not_found and removes nothing", "[gc]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(1000, 1150);
  Session s(store, "r");
  s.track("r", data.data(), data.size());
  s.snapshot("keep");
  auto e = catch_error([&] { store.remove("r", "nope"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("r/nope"));
  e = catch_error([&] { store.remove("nosession", "keep"); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("nosession"));
  CHECK(store.list("r").size() == 1);
  store.remove("r", "keep");
  CHECK(catch_error([&] { store.remove("r", "keep"); }).code == Errc::not_found);
  CHECK(store.list("r").empty());
  CHECK(store.sessions().empty());
  // The name is free again.
  CHECK(s.snapshot("keep").name == "keep");
}

// ------------------------------------------------- reuse of freed space
// Space no manifest references may be handed to new snapshots (before or after
// gc). These tests check that this never touches data a snapshot still needs.

namespace {

std::vector<unsigned char> restored(Store& store, const std::string& session, const std::string& snap, std::size_t size) {
  std::vector<unsigned char> live(size, 0xA5);
  Session s(store, session);
  s.track("r", live.data(), live.size());
  s.restore(snap);
  return live;
}

}  // namespace

TEST_CASE("reuse: after remove (no gc), new snapshots keep every remaining snapshot intact", "[gc][reuse]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t size = 2 * 1024 * 1024 + 4096 * 3 + 5;
  std::map<std::string, std::vector<unsigned char>> expect;
  Session s(store, "s");
  std::vector<unsigned char> live(size);
  s.track("r", live.data(), size);
  std::uint64_t seed = 1200;
  auto take = [&](const std::string& name) {
    dvrtest::fill_random(live.data(), size, ++seed);
    s.snapshot(name);
    expect[name] = live;
  };
  take("a");
  take("b");
  take("c");
  store.remove("s", "b");
  expect.erase("b");
  take("d");  // may land where "b" was
  take("e");
  store.remove("s", "a");
  expect.erase("a");
  store.remove("s", "d");
  expect.erase("d");
  take("f");
  take("g");
  for (auto& [name, bytes] : expect) {
    INFO(name);
    CHECK(diff(restored(store, "s", name, size).data(), bytes.data(), size) == "");
  }
  CHECK(store.verify().ok());
  auto gc = store.gc();
  CHECK(gc.bytes_after <= gc.bytes_before);
  for (auto& [name, bytes] : expect) {
    INFO(name << " after gc");
    CHECK(diff(restored(store, "s", name, size).data(), bytes.data(), size) == "");
  }
  CHECK(store.verify().ok());
}

TEST_CASE("reuse: data of a snapshot whose manifest is unreadable is never overwritten", "[gc][reuse]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t size = 1024 * 1024;
  auto x = dvrtest::random_bytes(size, 1300);
  auto y = dvrtest::random_bytes(size, 1301);
  auto z = dvrtest::random_bytes(size, 1302);
  std::vector<unsigned char> live = y;
  Session s(store, "s");
  s.track("r", live.data(), size);
  s.snapshot("y");  // first: its space will be free after remove
  std::memcpy(live.data(), x.data(), size);
  s.snapshot("x");
  store.remove("s", "y");

  // The manifest of "x" becomes unreadable (say, a bad sector that a later
  // repair fixes); meanwhile a new snapshot is taken.
  std::string file = dvrtest::manifest_path(store, "s", "x");
  std::string good = dvrtest::read_file(file);
  dvrtest::write_file(file, std::string(good.size(), 'J'));
  std::memcpy(live.data(), z.data(), size);
  s.snapshot("z");
  dvrtest::fill_random(live.data(), size, 1303);
  s.snapshot("z2");

  dvrtest::write_file(file, good);
  CHECK(diff(restored(store, "s", "x", size).data(), x.data(), size) == "");
  CHECK(diff(restored(store, "s", "z", size).data(), z.data(), size) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("reuse: chunks shared with another session survive removal of the snapshot that stored them", "[gc][reuse]") {
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  const std::size_t size = 1024 * 1024 + 77;
  auto x = dvrtest::random_bytes(size, 1400);
  auto live = x;
  {
    Session sa(a, "first");
    sa.track("r", live.data(), size);
    sa.snapshot("orig");
  }
  {
    Session sb(b, "second");
    sb.track("r", live.data(), size);
    CHECK(sb.snapshot("dedup").stored_bytes == 0);  // points at the chunks "orig" stored
  }
  a.remove("first", "orig");
  // a writes new data of the same size: the chunks "dedup" needs are still live.
  {
    Session sa(a, "first");
    dvrtest::fill_random(live.data(), size, 1401);
    sa.track("r", live.data(), size);
    sa.snapshot("new");
    dvrtest::fill_random(live.data(), size, 1402);
    sa.snapshot("newer");
  }
  CHECK(diff(restored(b, "second", "dedup", size).data(), x.data(), size) == "");
  CHECK(diff(restored(a, "second", "dedup", size).data(), x.data(), size) == "");
  a.gc();
  CHECK(diff(restored(b, "second", "dedup", size).data(), x.data(), size) == "");
  CHECK(b.verify().ok());
}

TEST_CASE("reuse: replace frees the old content, and snapshotting the old content again stores and restores it", "[gc][reuse]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::size_t size = 512 * 1024 + 3;
  auto x = dvrtest::random_bytes(size, 1500);
  auto y = dvrtest::random_bytes(size, 1501);
  auto live = x;
  Session s(store, "s");
  s.track("r", live.data(), size);
  s.snapshot("a");
  std::memcpy(live.data(), y.data(), size);
  s.snapshot("a", {.label = "", .replace = true});
  CHECK(diff(restored(store, "s", "a", size).data(), y.data(), size) == "");
  std::memcpy(live.data(), x.data(), size);
  s.snapshot("b");  // x again: its old chunks were freed by the replace
  std::memcpy(live.data(), y.data(), size);
  CHECK(s.snapshot("c").stored_bytes == 0);  // y is still live in "a"
  CHECK(diff(restored(store, "s", "b", size).data(), x.data(), size) == "");
  CHECK(diff(restored(store, "s", "a", size).data(), y.data(), size) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("reuse: a Store whose index predates another Store's remove-and-reuse does not dedup against overwritten data", "[gc][reuse][bug]") {
  // Store b learns where the chunks of x1 are. Store a removes x1 and reuses
  // that space for y. When b snapshots x again it must not point at the space
  // that now holds y: the snapshot would be published as fine (stored_bytes 0)
  // and could never be restored.
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  const std::size_t n = 4 * a.chunk_size();
  auto x = dvrtest::random_bytes(n, 1600);
  auto y = dvrtest::random_bytes(n, 1601);
  std::vector<unsigned char> live(n, 7);
  Session sa(a, "s"), sb(b, "s");
  sa.track("r", live.data(), n);
  sb.track("r", live.data(), n);
  live = x;
  sa.snapshot("x1");
  std::fill(live.begin(), live.end(), 7);
  sb.snapshot("sevens");  // b's index now knows x1's chunks
  a.remove("s", "x1");
  live = y;
  sa.snapshot("y");  // may reuse x1's space
  live = x;
  sb.snapshot("x2");
  auto report = a.verify();
  CHECK(report.damaged_snapshots() == std::vector<std::string>{});
  std::fill(live.begin(), live.end(), 0);
  auto e = catch_error([&] { sb.restore("x2"); });
  INFO(e.what);
  CHECK_FALSE(e.threw_dvr());
  CHECK(diff(live, x) == "");
  sa.restore("y");
  CHECK(diff(live, y) == "");
}

TEST_CASE("reuse: a Store with an outdated view of reused space does not overwrite live data", "[gc][reuse][bug]") {
  // Store b indexes x1 (one 4 KiB chunk at some offset L). Store a removes x1
  // and puts a 64 KiB chunk of y at L. When b next writes, it must know that
  // all 64 KiB at L are taken, not just the 4 KiB x1 had there.
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  const std::size_t cs = a.chunk_size();
  auto x = dvrtest::random_bytes(4096, 1650);
  auto y = dvrtest::random_bytes(cs, 1651);
  auto w = dvrtest::random_bytes(cs, 1652);
  {
    Session s(a, "small");
    auto live = x;
    s.track("r", live.data(), live.size());
    s.snapshot("x1");
  }
  {
    Session s(b, "zeros");  // writes nothing, but makes b read x1's manifest
    std::vector<unsigned char> zeros(4096, 0);
    s.track("r", zeros.data(), zeros.size());
    CHECK(s.snapshot("z").stored_bytes == 0);
  }
  a.remove("small", "x1");
  {
    Session s(a, "big");
    auto live = y;
    s.track("r", live.data(), live.size());
    s.snapshot("y");
  }
  {
    Session s(b, "other");
    auto live = w;
    s.track("r", live.data(), live.size());
    s.snapshot("w");
  }
  CHECK(a.verify().damaged_snapshots() == std::vector<std::string>{});
  CHECK(diff(restored(a, "big", "y", cs), y) == "");
  CHECK(diff(restored(b, "other", "w", cs), w) == "");
}

TEST_CASE("reuse: random snapshot/replace/remove/gc/restore through two Store objects matches a model", "[gc][reuse]") {
  TempDir dir;
  Store stores[2] = {Store::open(dir.store(), {.chunk_size = 4096, .create = true}), Store::open(dir.store())};
  REQUIRE(stores[1].chunk_size() == 4096);
  const std::string session_names[2] = {"p", "q"};
  const std::size_t sizes[2] = {40 * 4096 + 100, 17 * 4096};
  // live[store][session]: the memory each Session object tracks.
  std::vector<unsigned char> live[2][2];
  std::unique_ptr<Session> sessions[2][2];
  for (int st = 0; st < 2; ++st)
    for (int se = 0; se < 2; ++se) {
      live[st][se].assign(sizes[se], 0);
      sessions[st][se] = std::make_unique<Session>(stores[st], session_names[se]);
      sessions[st][se]->track("r", live[st][se].data(), sizes[se]);
    }
  std::map<std::pair<int, std::string>, std::vector<unsigned char>> model;  // (session, snapshot) -> content
  std::vector<std::vector<unsigned char>> history[2];                       // earlier contents, to re-create dedup
  // DVR_UNIT_SEED picks another sequence (for hunting bugs); the default is fixed.
  const char* seed_env = std::getenv("DVR_UNIT_SEED");
  std::uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 20240601;
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  int next_name = 0, restores = 0, gcs = 0, removes = 0;
  for (int step = 0; step < 300; ++step) {
    int st = static_cast<int>(pick(2)), se = static_cast<int>(pick(2));
    auto& mem = live[st][se];
    auto& sess = *sessions[st][se];
    std::size_t op = pick(10);
    INFO("step " << step << " op " << op << " store " << st << " session " << session_names[se]);
    if (op <= 3 || model.empty()) {  // snapshot (sometimes replacing)
      switch (pick(4)) {
        case 0:
          dvrtest::fill_random(mem.data(), mem.size(), rng());
          break;
        case 1:
          for (int k = 0; k < 3; ++k)
            mem[pick(mem.size())] ^= 0x11;
          break;
        case 2:
          if (!history[se].empty()) mem = history[se][pick(history[se].size())];
          break;
        case 3:
          std::memset(mem.data() + pick(mem.size() / 2), 0, mem.size() / 3);
          break;
      }
      std::string name;
      bool replace = false;
      std::vector<std::string> mine;
      for (auto& [k, v] : model)
        if (k.first == se) mine.push_back(k.second);
      if (!mine.empty() && pick(4) == 0) {
        name = mine[pick(mine.size())];
        replace = true;
      } else {
        name = "s" + std::to_string(next_name++);
      }
      sess.snapshot(name, {.label = "", .replace = replace});
      model[{se, name}] = mem;
      history[se].push_back(mem);
    } else if (op <= 5) {  // restore something of this session
      std::vector<std::string> mine;
      for (auto& [k, v] : model)
        if (k.first == se) mine.push_back(k.second);
      if (mine.empty()) continue;
      std::string name = mine[pick(mine.size())];
      dvrtest::fill_random(mem.data(), mem.size(), rng());
      sess.restore(name);
      ++restores;
      INFO("restored " << session_names[se] << "/" << name);
      REQUIRE(diff(mem.data(), model[{se, name}].data(), mem.size()) == "");
    } else if (op <= 8) {  // remove
      auto it = model.begin();
      std::advance(it, static_cast<long>(pick(model.size())));
      stores[st].remove(session_names[it->first.first], it->first.second);
      model.erase(it);
      ++removes;
    } else {
      stores[st].gc();
      ++gcs;
    }
  }
  INFO(restores << " restores, " << removes << " removes, " << gcs << " gcs, " << model.size() << " snapshots left");
  CHECK(restores > 20);
  for (int st = 0; st < 2; ++st) {
    auto report = stores[st].verify();
    CHECK(report.ok());
    CHECK(report.snapshots == model.size());
  }
  for (auto& [key, content] : model) {
    INFO(session_names[key.first] << "/" << key.second);
    auto& mem = live[1][key.first];
    sessions[1][key.first]->restore(key.second);
    CHECK(diff(mem.data(), content.data(), mem.size()) == "");
  }
}
