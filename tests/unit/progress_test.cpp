// Unit tests of progress callbacks (dvr::Progress's contract in store.hpp):
// called on the calling thread, done never decreasing, a final call with
// done == total, and a callback that throws cancels without damage.
#include <sys/wait.h>

#include <thread>

#include "base/memops.hpp"
#include "base/progress.hpp"
#include "dvr/proc.hpp"
#include "dvr/transfer.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::TempDir;
namespace fs = std::filesystem;

namespace {

struct Call {
  std::uint64_t done, total;
  std::thread::id thread;
};

// Records every call; checks the contract's invariants afterwards.
struct Recorder {
  std::vector<Call> calls;
  dvr::Progress callback() {
    return [this](std::uint64_t done, std::uint64_t total) { calls.push_back({done, total, std::this_thread::get_id()}); };
  }
  // Monotonic, on this thread, bounded by total where known, final call last.
  void check_contract(std::uint64_t expected_total) const {
    REQUIRE(!calls.empty());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CHECK(calls[i].thread == std::this_thread::get_id());
      if (calls[i].total) CHECK(calls[i].done <= calls[i].total);
      if (i) {
        CHECK(calls[i].done >= calls[i - 1].done);
        CHECK(calls[i].total >= calls[i - 1].total);
      }
    }
    CHECK(calls.back().done == calls.back().total);
    CHECK(calls.back().total == expected_total);
    // Only the last call has done == total (a final call, once).
    for (std::size_t i = 0; i + 1 < calls.size(); ++i)
      CHECK((calls[i].done < calls[i].total || calls[i].total == 0));
  }
};

}  // namespace

TEST_CASE("progress: the meter calls back at most every 100 ms, never decreasing, with one final call", "[progress]") {
  Recorder rec;
  dvr::Progress cb = rec.callback();
  const auto t0 = std::chrono::steady_clock::now();
  {
    dvr::detail::ProgressMeter meter(cb, 1000000);
    for (int i = 0; i < 1000000; ++i)
      meter.add(1);
    meter.finish();
    meter.finish();  // a second finish calls nothing
  }
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  rec.check_contract(1000000);
  // Calls before the final one are at least 100 ms apart, the first 100 ms in.
  const auto most = static_cast<std::size_t>(elapsed / dvr::detail::ProgressMeter::kInterval);
  CHECK(rec.calls.size() <= most + 1);
}

TEST_CASE("progress: a total learnt late is raised to done at the final call", "[progress]") {
  Recorder rec;
  dvr::Progress cb = rec.callback();
  dvr::detail::ProgressMeter meter(cb);  // total unknown (0)
  meter.add(4096);
  meter.advance_to(100);  // never lowers done
  meter.finish();
  REQUIRE(rec.calls.size() == 1);
  CHECK(rec.calls[0].done == 4096);
  CHECK(rec.calls[0].total == 4096);
}

TEST_CASE("progress: parallel_for with a meter runs on worker threads and reports on the calling thread", "[progress][threads]") {
  Recorder rec;
  dvr::Progress cb = rec.callback();
  dvr::detail::ProgressMeter meter(cb, 400);
  std::mutex mu;
  std::set<std::thread::id> ran_on;
  dvr::detail::parallel_for(4, 400, std::size_t{1} << 30, [&](std::size_t b, std::size_t e) {
    {
      std::lock_guard<std::mutex> g(mu);
      ran_on.insert(std::this_thread::get_id());
    }
    for (std::size_t i = b; i < e; ++i)
      meter.add(1);
  }, &meter);
  meter.finish();
  CHECK(ran_on.size() == 4);
  CHECK(ran_on.count(std::this_thread::get_id()) == 0);
  rec.check_contract(400);
}

TEST_CASE("progress: a callback that throws in parallel_for stops the workers and its exception is rethrown", "[progress][threads]") {
  dvr::Progress cb = [](std::uint64_t, std::uint64_t) { throw std::runtime_error("stop here"); };
  dvr::detail::ProgressMeter meter(cb, 0);
  std::atomic<bool> saw_stop{false};
  auto run = [&] {
    dvr::detail::parallel_for(2, 2, std::size_t{1} << 30, [&](std::size_t, std::size_t) {
      // Work that goes on until the meter says stop (the callback threw).
      while (!meter.stopped()) {
        meter.add(1);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      saw_stop = true;
    }, &meter);
  };
  CHECK_THROWS_WITH(run(), "stop here");
  CHECK(saw_stop.load());
  CHECK(meter.stopped());
}

TEST_CASE("progress: a snapshot reports the bytes it reads, then a final call", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(48u << 20, 2201);
  Session s(store, "p");
  s.track("r", data.data(), data.size());
  Recorder rec;
  auto info = s.snapshot("a", {.progress = rec.callback()});
  rec.check_contract(data.size());  // the first snapshot reads everything
  CHECK(info.logical_bytes == data.size());

  // An incremental one reads only what changed: with write tracking the
  // chunks with written pages, otherwise everything again.
  data[5] ^= 1;
  Recorder again;
  auto b = s.snapshot("b", {.progress = again.callback()});
  REQUIRE(!again.calls.empty());
  CHECK(again.calls.back().done == again.calls.back().total);
  if (b.tracking == "write_protect")
    CHECK(again.calls.back().total <= store.chunk_size());
  else
    CHECK(again.calls.back().total == data.size());
}

TEST_CASE("progress: a snapshot whose callback throws publishes nothing and the callback is not called again", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(32u << 20, 2202);
  auto copy = data;
  Session s(store, "p");
  s.track("r", data.data(), data.size());
  int calls = 0;
  // Throws at its first call, whether that comes while reading or as the
  // final call before the commit.
  auto throwing = [&](std::uint64_t, std::uint64_t) {
    ++calls;
    throw std::runtime_error("cancelled by the user");
  };
  CHECK_THROWS_WITH(s.snapshot("a", {.progress = throwing}), "cancelled by the user");
  CHECK(calls == 1);
  CHECK(store.list("p").empty());
  CHECK(diff(data, copy) == "");
  // The store and the session go on as before.
  auto info = s.snapshot("a");
  CHECK(info.logical_bytes == data.size());
  std::fill(data.begin(), data.end(), 0);
  s.restore("a");
  CHECK(diff(data, copy) == "");
  CHECK(store.verify().ok());
}

TEST_CASE("progress: a restore reports checking then copying, twice the bytes copied", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(24u << 20, 2203);
  auto copy = data;
  Session s(store, "p");
  s.track("r", data.data(), data.size());
  s.snapshot("a");
  dvrtest::fill_random(data.data(), data.size(), 2204);  // everything differs
  Recorder rec;
  s.restore("a", dvr::RestoreOptions{.progress = rec.callback()});
  CHECK(diff(data, copy) == "");
  rec.check_contract(2 * data.size());
  // The one-argument overload still works, with no callback.
  dvrtest::fill_random(data.data(), data.size(), 2205);
  s.restore("a");
  CHECK(diff(data, copy) == "");
}

TEST_CASE("progress: a restore whose callback throws leaves memory whole: untouched while checking, the snapshot once copying", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = dvrtest::random_bytes(32u << 20, 2206);
  const auto snap = data;
  Session s(store, "p");
  s.track("r", data.data(), data.size());
  s.snapshot("a");
  dvrtest::fill_random(data.data(), data.size(), 2207);
  const auto changed = data;
  std::uint64_t thrown_at = 0, total = 0;
  int calls = 0;
  auto throwing = [&](std::uint64_t done, std::uint64_t t) {
    ++calls;
    thrown_at = done;
    total = t;
    throw std::runtime_error("stop the restore");
  };
  CHECK_THROWS_WITH(s.restore("a", dvr::RestoreOptions{.progress = throwing}), "stop the restore");
  CHECK(calls == 1);
  REQUIRE(total == 2 * data.size());
  if (thrown_at < total / 2) {
    CHECK(diff(data, changed) == "");  // while checking: live memory not touched
  } else if (thrown_at > total / 2) {
    CHECK(diff(data, snap) == "");  // once copying: the restore completed first
  } else {
    CHECK((diff(data, changed) == "" || diff(data, snap) == ""));  // the boundary: one or the other, whole
  }
  // Either way the session restores normally afterwards.
  s.restore("a");
  CHECK(diff(data, snap) == "");
}

TEST_CASE("progress: gc reports the pack space it goes through, and verify the bytes it re-hashes", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(8u << 20, 2208);
  auto b = dvrtest::random_bytes(8u << 20, 2209);
  {
    Session s(store, "p");
    s.track("a", a.data(), a.size());
    s.snapshot("one");
    Session t(store, "q");
    t.track("b", b.data(), b.size());
    t.snapshot("two");
  }
  Recorder ver;
  auto report = store.verify(ver.callback());
  CHECK(report.ok());
  ver.check_contract(report.bytes);
  store.remove("q", "two");
  Recorder rec;
  auto gc = store.gc(rec.callback());
  rec.check_contract(gc.bytes_before);
  CHECK(gc.bytes_after < gc.bytes_before);
}

TEST_CASE("progress: a gc whose callback throws frees only unreferenced data", "[progress]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto a = dvrtest::random_bytes(4u << 20, 2210);
  const auto one = a;
  Session s(store, "p");
  s.track("a", a.data(), a.size());
  s.snapshot("one");
  dvrtest::fill_random(a.data(), a.size(), 2215);
  s.snapshot("two");
  store.remove("p", "two");
  CHECK_THROWS_WITH(store.gc([](std::uint64_t, std::uint64_t) { throw std::runtime_error("enough"); }), "enough");
  CHECK(store.verify().ok());
  std::fill(a.begin(), a.end(), 0);
  s.restore("one");
  CHECK(diff(a, one) == "");
  CHECK(store.gc().bytes_after > 0);  // a gc after it completes
}

namespace {

// Exports session/name of `from` into a file; returns its path.
std::string export_to_file(const Store& from, const std::string& ref, const std::string& path, dvr::Progress progress = {}) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  dvr::transfer::Options o;
  o.progress = std::move(progress);
  dvr::transfer::send(from, ref, fd, o);
  ::close(fd);
  return path;
}

}  // namespace

TEST_CASE("progress: send reports logical bytes, import the bytes of the file it reads", "[progress]") {
  TempDir dir;
  Store from = Store::open(dir / "from");
  auto data = dvrtest::random_bytes(20u << 20, 2211);
  Session s(from, "m");
  s.track("r", data.data(), data.size());
  s.snapshot("x");
  Recorder sent;
  const std::string file = export_to_file(from, "m/x", dir / "x.dvr", sent.callback());
  sent.check_contract(data.size());

  Store to = Store::open(dir / "to");
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  Recorder got;
  auto st = dvr::transfer::receive(to, fd, {.progress = got.callback()});
  ::close(fd);
  got.check_contract(fs::file_size(file));
  for (auto& c : got.calls)
    CHECK(c.total == fs::file_size(file));  // known from the start: a regular file
  CHECK(st.refs == std::vector<std::string>{"m/x"});
  CHECK(to.info("m", "x").logical_bytes == data.size());
}

TEST_CASE("progress: receiving from a pipe reports total 0 until the final call", "[progress]") {
  TempDir dir;
  Store from = Store::open(dir / "from");
  auto data = dvrtest::random_bytes(12u << 20, 2212);
  Session s(from, "m");
  s.track("r", data.data(), data.size());
  s.snapshot("x");
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  std::thread writer([&] {
    dvr::transfer::send(from, "m/x", p[1]);
    ::close(p[1]);
  });
  Store to = Store::open(dir / "to");
  Recorder got;
  auto st = dvr::transfer::receive(to, p[0], {.progress = got.callback()});
  writer.join();
  ::close(p[0]);
  REQUIRE(!got.calls.empty());
  for (std::size_t i = 0; i + 1 < got.calls.size(); ++i)
    CHECK(got.calls[i].total == 0);
  CHECK(got.calls.back().done == st.wire_bytes);
  CHECK(got.calls.back().total == st.wire_bytes);
}

TEST_CASE("progress: an import whose callback throws stores nothing", "[progress]") {
  TempDir dir;
  Store from = Store::open(dir / "from");
  auto data = dvrtest::random_bytes(8u << 20, 2213);
  Session s(from, "m");
  s.track("r", data.data(), data.size());
  s.snapshot("x");
  const std::string file = export_to_file(from, "m/x", dir / "x.dvr");
  Store to = Store::open(dir / "to");
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  auto throwing = [](std::uint64_t, std::uint64_t) { throw std::runtime_error("no import"); };
  CHECK_THROWS_WITH(dvr::transfer::receive(to, fd, {.progress = throwing}), "no import");
  ::close(fd);
  CHECK(to.list().empty());
  CHECK(to.gc().bytes_after == 0);  // nothing of it kept its space either
}

TEST_CASE("progress: a send whose callback throws leaves the stream unfinished and the receiver stores nothing", "[progress]") {
  TempDir dir;
  Store from = Store::open(dir / "from");
  auto data = dvrtest::random_bytes(8u << 20, 2214);
  Session s(from, "m");
  s.track("r", data.data(), data.size());
  s.snapshot("x");
  const std::string path = dir / "x.dvr";
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  dvr::transfer::Options o;
  o.progress = [](std::uint64_t, std::uint64_t) { throw std::runtime_error("no send"); };
  CHECK_THROWS_WITH(dvr::transfer::send(from, "m/x", fd, o), "no send");
  ::close(fd);
  Store to = Store::open(dir / "to");
  fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  CHECK(catch_error([&] { dvr::transfer::receive(to, fd); }).code == Errc::corrupt);
  ::close(fd);
  CHECK(to.list().empty());
}

TEST_CASE("progress: an incremental push and pull report on each side's calling thread, and an incremental import too", "[progress]") {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  auto data = dvrtest::random_bytes(16u << 20, 2216);
  Session s(a, "m");
  s.track("r", data.data(), data.size());
  s.snapshot("v0");
  for (std::size_t p = 0; p < data.size(); p += 100 * 4096)
    data[p] ^= 1;
  s.snapshot("v1");
  {
    int fd = ::open((dir / "v0.dvr").c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    dvr::transfer::send(a, "m/v0", fd);
    REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
    dvr::transfer::receive(b, fd);
    ::close(fd);
  }
  // Push m/v1 against v0, which b holds: only what differs travels.
  int to[2], from[2];
  REQUIRE(::pipe2(to, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(from, O_CLOEXEC) == 0);
  std::vector<Call> received;
  std::thread::id receiver_thread;
  std::thread far([&] {
    receiver_thread = std::this_thread::get_id();
    dvr::transfer::ReceiveOptions ro;
    ro.progress = [&](std::uint64_t done, std::uint64_t total) { received.push_back({done, total, std::this_thread::get_id()}); };
    dvr::transfer::receive_negotiated(b, to[0], from[1], ro);
    ::close(to[0]);
    ::close(from[1]);
  });
  Recorder sent;
  dvr::transfer::Options o;
  o.progress = sent.callback();
  auto st = dvr::transfer::send_negotiated(a, "m/v1", from[0], to[1], o);
  ::close(to[1]);
  ::close(from[0]);
  far.join();
  CHECK(st.base == "v0");
  CHECK(st.chunks_skipped > 0);
  sent.check_contract(data.size());  // skipped chunks count as sent
  REQUIRE(!received.empty());
  for (auto& c : received)
    CHECK(c.thread == receiver_thread);
  CHECK(received.back().done == received.back().total);
  CHECK(received.back().total > 0);
  CHECK(b.info("m", "v1").logical_bytes == data.size());

  // The same as a file (export --base, import): progress over the file's bytes.
  Store c = Store::open(dir / "c");
  {
    int fd = ::open((dir / "v0.dvr").c_str(), O_RDONLY | O_CLOEXEC);
    dvr::transfer::receive(c, fd);
    ::close(fd);
  }
  const std::string file = dir / "v1.dvr";
  {
    int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    dvr::transfer::Options inc;
    inc.base = "v0";
    dvr::transfer::send(a, "m/v1", fd, inc);
    ::close(fd);
  }
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  Recorder imported;
  dvr::transfer::receive(c, fd, {.progress = imported.callback()});
  ::close(fd);
  imported.check_contract(fs::file_size(file));
  CHECK(fs::file_size(file) < data.size() / 4);  // incremental: a fraction of the snapshot
}

TEST_CASE("progress: a process dump and its restore report through CRIU, on the calling thread", "[progress][proc]") {
  if (::geteuid() != 0) DVR_SKIP("process snapshots need root");
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) DVR_SKIP("cannot tell where this test binary is");
  const std::string plugin = fs::path(std::string(self, static_cast<std::size_t>(n))).parent_path().parent_path() / "criu-plugin";
  if (!fs::exists(plugin + "/dvr_criu.so")) DVR_SKIP("no CRIU plugin built at " << plugin);
  TempDir dir;
  Store store = Store::open(dir.store());
  // A job that holds some memory: 32 MiB written, then sleeps.
  const pid_t pid = dvr::proc::run({"/usr/bin/python3", "-c", "import time; b = bytearray(32 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep(600)"});
  // Until its memory is written (RssAnon of 32 MiB: the array, most of it,
  // and the interpreter's own), however slowly a loaded machine starts it.
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
       dvrtest::rss_anon(pid) < (32u << 20) && std::chrono::steady_clock::now() < deadline;)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Recorder dumped;
  dvr::proc::DumpOptions o;
  o.plugin_dir = plugin;
  o.progress = dumped.callback();
  dvr::proc::ProcInfo info;
  try {
    info = dvr::proc::dump(store, pid, "job", o);
  } catch (const dvr::Error& e) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    DVR_SKIP("CRIU cannot dump here: " << e.what());
  }
  ::waitpid(pid, nullptr, 0);  // the dump stopped it for good
  CHECK(info.name == "job");
  REQUIRE(!dumped.calls.empty());
  for (std::size_t i = 0; i < dumped.calls.size(); ++i) {
    CHECK(dumped.calls[i].thread == std::this_thread::get_id());
    if (i) CHECK(dumped.calls[i].done >= dumped.calls[i - 1].done);
  }
  CHECK(dumped.calls.back().done == dumped.calls.back().total);
  CHECK(dumped.calls.back().total >= (16u << 20));  // the job's pages went through it

  Recorder restored;
  dvr::proc::RestoreOptions r;
  r.plugin_dir = plugin;
  r.detach = true;
  r.progress = restored.callback();
  auto res = dvr::proc::restore(store, "job", r);
  CHECK(res.pid > 0);
  ::kill(res.pid, SIGKILL);
  REQUIRE(!restored.calls.empty());
  for (auto& c : restored.calls)
    CHECK(c.thread == std::this_thread::get_id());
  CHECK(restored.calls.back().done == restored.calls.back().total);
  CHECK(restored.calls.back().total > 0);
}
