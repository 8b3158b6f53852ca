// Unit tests of retention (Store::prune): the keep-* rules on fabricated
// times, dry runs, what depends on what (clones, parents, heaps, damage),
// and errors.
#include <map>

#include "dvr/clone.hpp"
#include "store/retention.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::PruneDecision;
using dvr::PrunePolicy;
using dvr::Session;
using dvr::SnapshotInfo;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;
using namespace std::chrono_literals;

namespace {

constexpr std::int64_t kSec = 1000000000;
// 2026-12-01T00:00:00Z, a Tuesday.
constexpr std::int64_t kDec1 = 1796083200;

SnapshotInfo snap(const std::string& name, std::int64_t unix_seconds, const std::string& parent = "") {
  SnapshotInfo s;
  s.session = "s";
  s.name = name;
  s.parent = parent;
  s.time_ns = unix_seconds * kSec;
  return s;
}

// name -> (keep, reason)
std::map<std::string, std::pair<bool, std::string>> by_name(const std::vector<PruneDecision>& ds) {
  std::map<std::string, std::pair<bool, std::string>> out;
  for (auto& d : ds)
    out[d.snapshot.name] = {d.keep, d.reason};
  return out;
}

std::vector<std::string> kept(const std::vector<PruneDecision>& ds) {
  std::vector<std::string> out;
  for (auto& d : ds)
    if (d.keep) out.push_back(d.snapshot.name);
  return out;
}

}  // namespace

TEST_CASE("prune: keep_last keeps the newest N, whatever order they come in", "[prune]") {
  std::vector<SnapshotInfo> in = {snap("c", kDec1 + 30), snap("a", kDec1 + 10), snap("e", kDec1 + 50), snap("b", kDec1 + 20), snap("d", kDec1 + 40)};
  auto ds = dvr::detail::decide_prune(in, {.keep_last = 2});
  REQUIRE(ds.size() == 5);
  CHECK(ds.front().snapshot.name == "a");  // oldest first
  CHECK(kept(ds) == std::vector<std::string>{"d", "e"});
  auto m = by_name(ds);
  CHECK(m["e"].second == "last 2");
  CHECK(m["a"].second == "removed");
}

TEST_CASE("prune: keep_daily keeps the newest of each of the newest N days (UTC)", "[prune]") {
  std::vector<SnapshotInfo> in;
  for (int day = 0; day < 5; ++day) {
    in.push_back(snap("d" + std::to_string(day) + "-morning", kDec1 + day * 86400 + 8 * 3600));
    in.push_back(snap("d" + std::to_string(day) + "-evening", kDec1 + day * 86400 + 20 * 3600));
  }
  auto ds = dvr::detail::decide_prune(in, {.keep_daily = 3});
  CHECK(kept(ds) == std::vector<std::string>{"d2-evening", "d3-evening", "d4-evening"});
  auto m = by_name(ds);
  CHECK(m["d4-evening"].second == "daily 2026-12-05");
  CHECK(m["d2-evening"].second == "daily 2026-12-03");
  CHECK(m["d4-morning"].second == "removed");
}

TEST_CASE("prune: hourly, weekly and monthly buckets, and reasons of several rules", "[prune]") {
  std::vector<SnapshotInfo> in = {
      snap("nov-15", kDec1 - 16 * 86400),            // 2026-11-15, ISO week 46
      snap("nov-30", kDec1 - 86400 + 3600),          // 2026-11-30 01:00, week 49 (a Monday)
      snap("dec-01-a", kDec1 + 3600),                // 2026-12-01 01:00
      snap("dec-01-b", kDec1 + 3600 + 1800),         // 2026-12-01 01:30
      snap("dec-01-c", kDec1 + 2 * 3600 + 60),       // 2026-12-01 02:01
  };
  auto m = by_name(dvr::detail::decide_prune(in, {.keep_hourly = 2}));
  CHECK(m["dec-01-c"].second == "hourly 2026-12-01T02");
  CHECK(m["dec-01-b"].second == "hourly 2026-12-01T01");
  CHECK_FALSE(m["dec-01-a"].first);
  m = by_name(dvr::detail::decide_prune(in, {.keep_weekly = 2}));
  CHECK(m["dec-01-c"].second == "weekly 2026-W49");
  CHECK_FALSE(m["nov-30"].first);  // the same week as dec-01-c
  CHECK(m["nov-15"].second == "weekly 2026-W46");
  m = by_name(dvr::detail::decide_prune(in, {.keep_monthly = 5}));
  CHECK(m["dec-01-c"].second == "monthly 2026-12");
  CHECK(m["nov-30"].second == "monthly 2026-11");
  CHECK_FALSE(m["nov-15"].first);
  m = by_name(dvr::detail::decide_prune(in, {.keep_last = 1, .keep_daily = 1, .keep_monthly = 1}));
  CHECK(m["dec-01-c"].second == "last 1, daily 2026-12-01, monthly 2026-12");
}

TEST_CASE("prune: keep_within counts back from the newest snapshot", "[prune]") {
  std::vector<SnapshotInfo> in = {snap("old", kDec1), snap("edge", kDec1 + 3600), snap("new", kDec1 + 3 * 3600)};
  auto m = by_name(dvr::detail::decide_prune(in, {.keep_within = 2h}));
  CHECK(m["new"].second == "within 2h");
  CHECK(m["edge"].second == "within 2h");  // exactly 2 h older: still within
  CHECK(m["old"].second == "removed");
  CHECK(dvr::detail::format_duration(90s) == "1m30s");
  CHECK(dvr::detail::format_duration(36h) == "1d12h");
}

TEST_CASE("prune: a policy that keeps nothing is refused", "[prune]") {
  auto e = catch_error([] { dvr::detail::decide_prune({snap("a", kDec1)}, PrunePolicy{}); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("keeps nothing"));
  CHECK(catch_error([] { dvr::detail::check_policy({.keep_within = -1s}); }).code == Errc::invalid_argument);
}

TEST_CASE("prune: damaged snapshots and DVR heap snapshots are kept and not counted", "[prune]") {
  auto bad = snap("broken", kDec1 + 50);
  bad.damaged = true;
  bad.damage = "bad checksum";
  std::vector<SnapshotInfo> in = {snap("a", kDec1 + 10), snap("b", kDec1 + 20), snap("proc.job", kDec1 + 30), bad};
  auto m = by_name(dvr::detail::decide_prune(in, {.keep_last = 1}));
  CHECK(m["b"].second == "last 1");  // the newest intact one, not the damaged one
  CHECK(m["broken"].first);
  CHECK_THAT(m["broken"].second, Catch::StartsWith("kept: damaged (bad checksum)"));
  CHECK(m["proc.job"].first);
  CHECK_THAT(m["proc.job"].second, Catch::Contains("process snapshot proc/job"));
  CHECK(m["a"].second == "removed");
}

TEST_CASE("prune: removed snapshots say what refers to them", "[prune]") {
  std::vector<SnapshotInfo> in = {snap("base", kDec1), snap("mid", kDec1 + 10, "base"), snap("top", kDec1 + 20, "mid")};
  dvr::detail::PruneContext cx;
  cx.cloned = {"base"};
  auto m = by_name(dvr::detail::decide_prune(in, {.keep_last = 1}, cx));
  CHECK(m["top"].first);
  CHECK(m["mid"].second == "removed; parent of top, which stays complete (a snapshot holds all its data)");
  CHECK(m["base"].second == "removed; an open clone keeps its data until it is closed");
}

namespace {

// Snapshots s1..sN of session `s` of changing data; returns the
// data of each.
std::vector<std::vector<unsigned char>> take(Session& s, std::vector<unsigned char>& live, int n) {
  std::vector<std::vector<unsigned char>> out;
  for (int i = 1; i <= n; ++i) {
    dvrtest::fill_random(live.data(), live.size(), 2500 + i);
    s.snapshot("s" + std::to_string(i));
    out.push_back(live);
  }
  return out;
}

std::vector<std::string> names(const std::vector<SnapshotInfo>& list) {
  std::vector<std::string> out;
  for (auto& i : list)
    out.push_back(i.name);
  return out;
}

}  // namespace

TEST_CASE("prune: a dry run changes nothing, the real one removes what it said, and the rest restores", "[prune]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> live(3u << 20);
  Session s(store, "s");
  s.track("r", live.data(), live.size());
  auto versions = take(s, live, 5);

  auto dry = store.prune("s", {.keep_last = 2}, true);
  CHECK(dry.dry_run);
  CHECK(dry.removed == 3);
  REQUIRE(dry.decisions.size() == 5);
  CHECK(names(store.list("s")).size() == 5);

  auto real = store.prune("s", {.keep_last = 2});
  CHECK_FALSE(real.dry_run);
  CHECK(real.removed == 3);
  for (std::size_t i = 0; i < 5; ++i) {
    CHECK(real.decisions[i].snapshot.name == dry.decisions[i].snapshot.name);
    CHECK(real.decisions[i].keep == dry.decisions[i].keep);
    CHECK(real.decisions[i].reason == dry.decisions[i].reason);
  }
  CHECK(names(store.list("s")) == std::vector<std::string>{"s4", "s5"});
  // s4's parent s3 is gone: s4 is complete all the same.
  CHECK(real.decisions[2].reason == "removed; parent of s4, which stays complete (a snapshot holds all its data)");
  s.restore("s4");
  CHECK(diff(live, versions[3]) == "");
  s.restore("s5");
  CHECK(diff(live, versions[4]) == "");
  CHECK(store.verify().ok());
  auto gc = store.gc();  // the removed snapshots' data (3 MiB each, all different) goes
  CHECK(gc.bytes_before - gc.bytes_after >= 3 * live.size());
  // The session goes on: the next snapshot is incremental to s5 as before.
  live[0] ^= 1;
  CHECK(s.snapshot("s6").parent == "s5");
}

TEST_CASE("prune: a snapshot with an open clone is removed, says so, and the clone keeps its data", "[prune]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> live(2u << 20);
  Session s(store, "s");
  s.track("r", live.data(), live.size());
  auto versions = take(s, live, 3);
  dvr::Clone c = store.open_snapshot("s", "s1");
  auto report = store.prune("s", {.keep_last = 1});
  auto m = by_name(report.decisions);
  CHECK(m["s1"].second == "removed; an open clone keeps its data until it is closed");
  CHECK(m["s2"].second == "removed; parent of s3, which stays complete (a snapshot holds all its data)");
  store.gc();
  auto& r = c.region("r");
  CHECK(diff(r.data(), versions[0].data(), versions[0].size()) == "");
}

TEST_CASE("prune: an unknown session is not_found naming it and the store, and bad names are refused", "[prune]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto e = catch_error([&] { store.prune("nosuch", {.keep_last = 1}); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains("'nosuch'"));
  CHECK_THAT(e.what, Catch::Contains(dir.store()));
  CHECK(catch_error([&] { store.prune("../x", {.keep_last = 1}); }).code == Errc::invalid_argument);
  CHECK(catch_error([&] { store.prune("nosuch", {}); }).code == Errc::invalid_argument);  // the policy first
}

TEST_CASE("prune: a damaged snapshot is never removed", "[prune]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> live(1u << 20);
  Session s(store, "s");
  s.track("r", live.data(), live.size());
  take(s, live, 3);
  dvrtest::flip_byte(dvrtest::manifest_path(store, "s", "s1"), 40);
  auto m = by_name(store.prune("s", {.keep_last = 1}).decisions);
  CHECK(m["s1"].first);
  CHECK_THAT(m["s1"].second, Catch::StartsWith("kept: damaged ("));
  CHECK(m["s2"].second == "removed; parent of s3, which stays complete (a snapshot holds all its data)");
  auto left = names(store.list("s"));  // (a damaged one is listed by its file's time: the flip made it newest)
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{"s1", "s3"});
}

TEST_CASE("prune: process snapshots without readable metadata are kept, named as such", "[prune]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> live(1u << 20);
  // Snapshots in the proc session that are not process snapshots (no
  // metadata): prune cannot tell their heaps, so it keeps them.
  Session s(store, "proc");
  s.track("r", live.data(), live.size());
  take(s, live, 2);
  auto report = store.prune("proc", {.keep_last = 1});
  CHECK(report.removed == 0);
  auto m = by_name(report.decisions);
  for (const char* n : {"s1", "s2"}) {
    CHECK(m[n].first);
    CHECK_THAT(m[n].second, Catch::StartsWith("kept: its process metadata could not be read"));
    CHECK_THAT(m[n].second, Catch::Contains(std::string("`dvr proc info ") + n + "`"));
  }
  CHECK(names(store.list("proc")).size() == 2);
}
