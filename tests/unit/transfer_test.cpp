// dvr::transfer, receiving crafted streams: a stream of several snapshots is
// published all or nothing, a base replaced while a stream is received is not
// used in its place, and a stream declaring huge regions costs the receiver
// nothing up front. These tests build streams record by record (docs/format.md,
// "Stream format"); round trips and damaged streams are in stream_test.cpp.
#include <atomic>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <exception>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "dvr/transfer.hpp"
#include "base/hash.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

constexpr std::size_t kStreamEndBytes = 8 + 4 + 8;  // kind, length, u32 count, XXH3-64

// The stream of `ref` as sent by transfer::send.
std::string stream_of(const Store& store, const std::string& ref, const transfer::Options& o = {}) {
  int fd = ::memfd_create("transfer-stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::send(store, ref, fd, o);
  off_t n = ::lseek(fd, 0, SEEK_END);
  std::string s(static_cast<std::size_t>(n), '\0');
  REQUIRE(::pread(fd, s.data(), s.size(), 0) == n);
  ::close(fd);
  return s;
}

void put32(std::string& b, std::uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }
void put64(std::string& b, std::uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); }
void putstr(std::string& b, const std::string& s) {
  put32(b, static_cast<std::uint32_t>(s.size()));
  b += s;
}

// One record: [u32 kind][u32 length][payload][u64 XXH3-64 of the three before].
std::string record(std::uint32_t kind, const std::string& payload) {
  std::string r;
  put32(r, kind);
  put32(r, static_cast<std::uint32_t>(payload.size()));
  r += payload;
  put64(r, detail::hash64(r.data(), r.size()));
  return r;
}

std::string stream_header() {
  std::string h("DVRSTRM\0", 8);
  put32(h, 1);
  put32(h, 0);
  return h;
}

// Receives `stream` through a pipe; `before_end` runs (on the writing
// thread) once everything but the stream-end record has been written, i.e.
// while the receiver has read and checked every snapshot but published none.
transfer::Stats receive_with_hook(Store& store, const std::string& stream, const std::function<void()>& before_end) {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  std::exception_ptr hook_failed;
  std::thread writer([&] {
    // A receiver that gives up closes its end: EPIPE here, not SIGPIPE.
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    auto write_all = [&](const char* d, std::size_t n) {
      while (n) {
        ssize_t w = ::write(p[1], d, n);
        if (w <= 0) return false;
        d += w;
        n -= static_cast<std::size_t>(w);
      }
      return true;
    };
    if (write_all(stream.data(), stream.size() - kStreamEndBytes)) {
      // Let the receiver reach the stream-end record (it blocks reading it).
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      try {
        before_end();
      } catch (...) {
        hook_failed = std::current_exception();
      }
      write_all(stream.data() + stream.size() - kStreamEndBytes, kStreamEndBytes);
    }
    ::close(p[1]);
  });
  transfer::Stats st;
  try {
    st = transfer::receive(store, p[0]);
  } catch (...) {
    ::close(p[0]);  // (a writer still writing gets EPIPE)
    writer.join();
    throw;
  }
  ::close(p[0]);
  writer.join();
  if (hook_failed) std::rethrow_exception(hook_failed);
  return st;
}

bool holds(const Store& s, const std::string& session, const std::string& name) {
  for (auto& i : s.list(session))
    if (i.name == name) return true;
  return false;
}

void snap(Store& store, const std::string& session, const std::string& region, std::vector<unsigned char>& data, const std::string& name) {
  Session s(store, session);
  s.track(region, data.data(), data.size());
  s.snapshot(name);
}

}  // namespace

// docs/migration.md: "A broken ... stream, a snapshot that exists already ...:
// each is an error naming the problem, and the receiving store is exactly as
// before." So when the second snapshot of a stream cannot be stored (here:
// the receiving store holds its name already), the first must not be
// published either (for a process snapshot: heap snapshots without
// proc/NAME, which would also block every retry with "exists already").
TEST_CASE("transfer: a stream of several snapshots is published all or nothing", "[transfer]") {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  auto d1 = dvrtest::random_bytes(300000, 1), d2 = dvrtest::random_bytes(200000, 2);
  snap(a, "heapish", "h", d1, "proc.night");
  snap(a, "other", "r", d2, "night");
  // A two-snapshot stream as a process snapshot travels: the first one's
  // records, then the second's, then the stream end.
  std::string s1 = stream_of(a, "heapish/proc.night"), s2 = stream_of(a, "other/night");
  std::string end;
  put32(end, 2);
  std::string stream = s1.substr(0, s1.size() - kStreamEndBytes) + s2.substr(16, s2.size() - 16 - kStreamEndBytes) + record(8, end);

  auto d3 = dvrtest::random_bytes(1000, 3);
  snap(b, "other", "r", d3, "night");
  auto c = catch_error([&] { receive_with_hook(b, stream, [] {}); });
  CHECK(c.code == Errc::already_exists);
  // Nothing of the refused stream may be left behind, and no pack space.
  CHECK_FALSE(holds(b, "heapish", "proc.night"));
  CHECK(b.list("other").size() == 1);
  CHECK(b.verify().ok());

  // Damage in the second snapshot: the first is not published either.
  Store e = Store::open(dir / "e");
  std::string damaged = stream;
  damaged[s1.size() - kStreamEndBytes + 200] ^= 0x5a;  // inside the second snapshot's records
  auto c2 = catch_error([&] { receive_with_hook(e, damaged, [] {}); });
  CHECK(c2.threw_dvr());
  CHECK(e.list().empty());
}

// Pack space is handed out in whole pages, and every stored chunk starts on a
// page (docs/format.md). A received snapshot whose regions end inside a page
// (like the MPI heat example's 40-byte "meta" next to its grid) once sized the
// receiver's pack blocks by its bytes: the blocks after the first began off a
// page, and the published manifest was refused as damaged ("chunk offset ...
// is impossible") on every `dvr receive` and partner copy.
TEST_CASE("transfer: a received snapshot whose regions end inside a page is intact", "[transfer]") {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  const std::vector<std::size_t> sizes = {40, 5000, 3 * (256u << 10) + (16u << 10) + 12, 100, 1u << 20};
  std::vector<std::vector<unsigned char>> data;
  {
    Session s(a, "s");
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      data.push_back(dvrtest::random_bytes(sizes[k], 20 + k));
      s.track("r" + std::to_string(k), data[k].data(), data[k].size());
    }
    s.snapshot("one");
  }
  for (int level : {0, 1}) {
    INFO("zstd level " << level);
    transfer::Options o;
    o.level = level;
    Store into = level ? b : Store::open(dir / "c");
    receive_with_hook(into, stream_of(a, "s/one", o), [] {});
    auto listed = into.list("s");
    REQUIRE(listed.size() == 1);
    INFO(listed[0].damage);
    CHECK_FALSE(listed[0].damaged);
    CHECK(into.verify().ok());
    std::vector<std::vector<unsigned char>> back;
    Session r(into, "s");
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      back.emplace_back(sizes[k], 0);
      r.track("r" + std::to_string(k), back[k].data(), back[k].size());
    }
    r.restore("one");
    for (std::size_t k = 0; k < sizes.size(); ++k)
      CHECK(dvrtest::diff(back[k], data[k]) == "");
  }
}

// A writer of the receiving store (another process or Store handle) that
// comes while a stream arrives waits until the received snapshots are
// published: it cannot take their names, nor replace or remove the base the
// stream is relative to, in the middle.
TEST_CASE("transfer: a writer waits while a stream arrives, and the received snapshot holds what was sent", "[transfer]") {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  const std::size_t size = 4 << 20;  // 16 chunks of 256 KiB
  auto live = dvrtest::random_bytes(size, 10);
  {
    Session s(a, "s");
    s.track("r", live.data(), live.size());
    s.snapshot("base");
    live[5 * 4096 + 7] ^= 0xff;  // one page of one chunk changes
    s.snapshot("next");
  }
  const auto sent = live;
  {
    std::string full = stream_of(a, "s/base");
    int fd = ::memfd_create("full", MFD_CLOEXEC);
    REQUIRE(::write(fd, full.data(), full.size()) == static_cast<ssize_t>(full.size()));
    ::lseek(fd, 0, SEEK_SET);
    transfer::receive(b, fd);
    ::close(fd);
  }
  transfer::Options o;
  o.base = "base";
  std::string delta = stream_of(a, "s/next", o);

  std::thread other;
  std::atomic<bool> replaced{false};
  std::string other_error;
  auto other_data = dvrtest::random_bytes(size, 99);
  auto st = receive_with_hook(b, delta, [&] {
    // The receiver holds the writers' lock by now, unless a loaded machine
    // kept it from running: wait until it does (a probe that cannot take it).
    const std::string writers = dir / "b/writers.lock";
    bool held = false;
    for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30); !held && std::chrono::steady_clock::now() < deadline;) {
      int fd = ::open(writers.c_str(), O_RDWR | O_CLOEXEC);
      held = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
      if (fd >= 0) ::close(fd);  // (a probe that took the lock lets it go)
      if (!held) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!held) throw std::runtime_error("the receiver did not take the writers' lock " + writers + " within 30 s");
    other = std::thread([&] {
      try {
        Store b2 = Store::open(dir / "b");
        Session s(b2, "s");
        s.track("r", other_data.data(), other_data.size());
        s.snapshot("base", {.replace = true});  // waits for the receive
        replaced = true;
      } catch (const std::exception& e) {
        other_error = e.what();
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    CHECK_FALSE(replaced.load());  // still waiting: the receive holds the writers' lock
  });
  other.join();
  CHECK(other_error == "");
  CHECK(replaced.load());
  CHECK(st.refs == std::vector<std::string>{"s/next"});
  std::vector<unsigned char> got(size);
  Session r(b, "s");
  r.track("r", got.data(), got.size());
  r.restore("next");
  CHECK(dvrtest::diff(got, sent) == "");
  r.restore("base");
  CHECK(dvrtest::diff(got, other_data) == "");
  CHECK(b.verify().ok());
}

// A ~120-byte snapshot record may declare one 128 GiB region (allowed: up to
// 2^46 bytes a region, 2^20 regions) with 4 KiB chunks. Bookkeeping sized for
// every declared chunk up front (a byte and a 16-byte hash each) would make
// the receiver write 544 MiB before a single chunk arrives, and a few 1 TiB
// regions would exhaust the machine, contrary to "untouched parts of it cost
// nothing". The receiver's peak RSS must stay small.
TEST_CASE("transfer: a stream declaring a huge region does not make the receiver allocate for it", "[transfer]") {
  // (Measured: 88 MiB under AddressSanitizer, for a stream of 101 bytes.)
  if (dvrtest::kSanitizer)
    DVR_SKIP("built with " << dvrtest::kSanitizer << ": its shadow memory and allocator are resident too, so peak RSS measures the sanitizer");
  TempDir dir;
  std::string rec;
  putstr(rec, "s");
  putstr(rec, "n");
  putstr(rec, "");
  putstr(rec, "");
  put64(rec, 0);
  put32(rec, 4096);  // chunk size
  rec.push_back(1);  // paged
  put32(rec, 1);     // one region
  putstr(rec, "r");
  put64(rec, std::uint64_t{1} << 37);
  rec.push_back(0);
  putstr(rec, "");  // no base
  put64(rec, 0);
  put64(rec, 0);
  const std::string stream = stream_header() + record(1, rec);  // and then the stream ends
  const std::string store_path = dir / "b";
  { Store::open(store_path); }

  int p[2];
  REQUIRE(::pipe(p) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(p[0]);
    ::alarm(60);
    auto status_kb = [](const char* key) -> long {
      std::ifstream in("/proc/self/status");
      for (std::string line; std::getline(in, line);)
        if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
      return -1;
    };
    { std::ofstream("/proc/self/clear_refs") << "5"; }  // reset the peak to now
    long before = status_kb("VmRSS:");
    try {
      Store b = Store::open(store_path);
      int fd = ::memfd_create("s", 0);
      if (::write(fd, stream.data(), stream.size()) != static_cast<ssize_t>(stream.size())) ::_exit(3);
      ::lseek(fd, 0, SEEK_SET);
      transfer::receive(b, fd);
    } catch (...) {
    }
    long grew = status_kb("VmHWM:") - before;
    if (::write(p[1], &grew, sizeof grew) != sizeof grew) ::_exit(4);
    ::_exit(0);
  }
  ::close(p[1]);
  long grew_kb = -1;
  REQUIRE(::read(p[0], &grew_kb, sizeof grew_kb) == sizeof grew_kb);
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  INFO("receiver's peak RSS grew by " << grew_kb / 1024 << " MiB for a " << stream.size() << "-byte stream");
  CHECK(grew_kb >= 0);
  CHECK(grew_kb < 64 * 1024);
}
