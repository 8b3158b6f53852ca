// The order of snapshots (docs/format.md, "Snapshot order"): a per-store
// sequence number assigned at commit decides "newest", never the wall
// clock. The clock is stepped through detail::set_clock_for_testing (the
// machine's clock is never touched).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

#include "base/hash.hpp"
#include "base/os.hpp"
#include "dvr/transfer.hpp"
#include "store/retention.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::TempDir;

namespace {

constexpr std::int64_t kHour = 3600ll * 1000000000;
constexpr std::int64_t kT0 = 1796169600ll * 1000000000;  // 2026-12-02T00:00:00Z

std::atomic<std::int64_t> g_now{kT0};
std::int64_t test_clock() { return g_now.load(); }

// Installs the test clock for one test case; the system clock again after.
struct SteppedClock {
  SteppedClock() {
    g_now = kT0;
    detail::set_clock_for_testing(test_clock);
  }
  ~SteppedClock() { detail::set_clock_for_testing(nullptr); }
  void set(std::int64_t t) { g_now = t; }
};

SnapshotInfo take(Store& store, const std::string& session, const std::string& name, const std::string& label = "") {
  std::vector<char> data(8192, static_cast<char>(name.size() + name[0]));
  Session s(store, session);
  s.track("data", data.data(), data.size());
  return s.snapshot(name, {.label = label});
}

std::vector<std::string> names(const std::vector<SnapshotInfo>& snaps) {
  std::vector<std::string> out;
  for (auto& s : snaps)
    out.push_back(s.name);
  return out;
}

// Moves `ref` of `from` into `to` through a stream (what send | receive,
// export | import and pull do).
void transfer_one(const Store& from, const std::string& ref, Store& to) {
  int fd = ::memfd_create("order-stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::send(from, ref, fd);
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  transfer::receive(to, fd);
  ::close(fd);
}

}  // namespace

TEST_CASE("order: after the clock steps back, newest is the last committed (list, latest, prune)", "[order]") {
  TempDir t;
  SteppedClock clock;
  Store store = Store::open(t.store());
  clock.set(kT0 + 5 * kHour);
  SnapshotInfo a = take(store, "s", "a");
  clock.set(kT0 + 6 * kHour);
  SnapshotInfo b = take(store, "s", "b");
  clock.set(kT0 + 1 * kHour);  // NTP, or a VM restored: five hours back
  SnapshotInfo c = take(store, "s", "c");
  CHECK(a.seq == 1);
  CHECK(b.seq == 2);
  CHECK(c.seq == 3);
  CHECK(c.time_ns == kT0 + 1 * kHour);
  CHECK(c.origin_time_ns == c.time_ns);  // made here
  CHECK(names(store.list("s")) == std::vector<std::string>{"a", "b", "c"});
  auto latest = store.latest("s");
  REQUIRE(latest);
  CHECK(latest->name == "c");
  CHECK(store.info("s", "c").seq == 3);

  // The next number is recovered from the manifests by any handle.
  Store again = Store::open(t.store());
  SnapshotInfo d = take(again, "other", "d");
  CHECK(d.seq == 4);  // per store, not per session

  PruneReport dry = store.prune("s", {.keep_last = 1}, true);
  REQUIRE(dry.decisions.size() == 3);
  CHECK(dry.decisions.back().snapshot.name == "c");
  CHECK(dry.decisions.back().keep);
  CHECK_FALSE(dry.decisions[0].keep);
  CHECK_FALSE(dry.decisions[1].keep);
  store.prune("s", {.keep_last = 1});
  CHECK(names(store.list("s")) == std::vector<std::string>{"c"});
}

TEST_CASE("order: the time rules of prune read origin times and keep one snapshot per bucket after a clock step", "[order]") {
  // Fabricated: seq decides which is the newest of a bucket; a bucket that
  // recurs after a step back is still counted once.
  auto snap = [](const std::string& name, std::uint64_t seq, std::int64_t t) {
    SnapshotInfo s;
    s.session = "s";
    s.name = name;
    s.seq = seq;
    s.time_ns = t;
    s.origin_time_ns = t;
    return s;
  };
  std::vector<SnapshotInfo> in = {snap("x1", 1, kT0 + 30 * kHour), snap("x2", 2, kT0 + 2 * kHour), snap("x3", 3, kT0 + 31 * kHour),
                                  snap("x4", 4, kT0 + 3 * kHour)};
  auto ds = detail::decide_prune(in, {.keep_daily = 1});
  REQUIRE(ds.size() == 4);
  // Oldest first by seq; the newest (x4, day 1) is the daily one kept.
  CHECK(ds[3].snapshot.name == "x4");
  CHECK(ds[3].keep);
  CHECK_FALSE(ds[0].keep);
  CHECK_FALSE(ds[1].keep);
  CHECK_FALSE(ds[2].keep);
  auto two = detail::decide_prune(in, {.keep_daily = 3});
  // Day 1 (x4) and day 2 (x3, the newest of day 2); x2 and x1 fall in those
  // days again and start no new bucket, though a third one is allowed.
  CHECK(two[3].keep);
  CHECK(two[2].keep);
  CHECK_FALSE(two[1].keep);
  CHECK_FALSE(two[0].keep);
}

TEST_CASE("order: a received snapshot keeps its origin time, is ordered by its arrival, and is outranked by what is taken after", "[order]") {
  TempDir t;
  SteppedClock clock;
  Store a = Store::open(t.path() + "/a");
  Store b = Store::open(t.path() + "/b");
  Store c = Store::open(t.path() + "/c");
  clock.set(kT0);
  SnapshotInfo made = take(a, "job", "remote");
  clock.set(kT0 + 2 * kHour);
  SnapshotInfo local = take(b, "job", "local");
  clock.set(kT0 + 3 * kHour);
  transfer_one(a, "job/remote", b);
  SnapshotInfo got = b.info("job", "remote");
  CHECK(got.origin_time_ns == made.origin_time_ns);  // when it was made, there
  CHECK(got.origin_time_ns == kT0);
  CHECK(got.time_ns == kT0 + 3 * kHour);  // when it arrived here
  CHECK(got.seq > local.seq);             // newest here in arrival order
  CHECK(b.latest("job")->name == "remote");

  // Taken here after it arrived, with the clock stepped back before its
  // arrival time: newer all the same.
  clock.set(kT0 + 1 * kHour);
  SnapshotInfo after = take(b, "job", "after");
  CHECK(after.time_ns < got.time_ns);
  CHECK(after.seq > got.seq);
  CHECK(b.latest("job")->name == "after");
  CHECK(names(b.list("job")) == std::vector<std::string>{"local", "remote", "after"});

  // A second hop keeps the first origin.
  clock.set(kT0 + 9 * kHour);
  transfer_one(b, "job/remote", c);
  CHECK(c.info("job", "remote").origin_time_ns == kT0);
  CHECK(c.info("job", "remote").time_ns == kT0 + 9 * kHour);
}

TEST_CASE("order: manifests without a seq (before v4) open, numbered by time and name below every new one", "[order]") {
  TempDir t;
  SteppedClock clock;
  Store store = Store::open(t.store());
  clock.set(kT0 + 2 * kHour);
  take(store, "s", "p");
  clock.set(kT0 + 1 * kHour);
  take(store, "s", "q");
  clock.set(kT0 + 3 * kHour);
  take(store, "s", "r");
  for (auto n : {"p", "q", "r"})
    dvrtest::make_legacy_manifest(store, "s", n);
  Store old = Store::open(t.store());
  auto listed = old.list("s");
  CHECK(names(listed) == std::vector<std::string>{"q", "p", "r"});  // by their times
  REQUIRE(listed.size() == 3);
  CHECK(listed[0].seq == 1);
  CHECK(listed[1].seq == 2);
  CHECK(listed[2].seq == 3);
  CHECK(listed[1].origin_time_ns == listed[1].time_ns);
  CHECK(old.info("s", "p").seq == 2);
  // A new snapshot with the clock before all of them is still the newest.
  clock.set(kT0);
  SnapshotInfo s = take(old, "s", "new");
  CHECK(s.seq == 4);
  CHECK(old.latest("s")->name == "new");
  CHECK(names(old.list("s")) == std::vector<std::string>{"q", "p", "r", "new"});
  CHECK(old.verify().ok());
}
