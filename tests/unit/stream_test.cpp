// Streams between stores through the public API of dvr/transfer.hpp: send and
// receive through a pipe and through a file, into the same or another
// session, at every compression level; incremental sends against a base;
// and damaged streams (truncated, bad magic, a newer version, flipped bytes
// in a chunk or anywhere past the header, random bytes), each refused with
// the documented error and the receiving store exactly as before.
//
// Only the public API and the bytes of the stream are used: the stream's
// header as docs/format.md ("Stream format") gives it (8 bytes of magic, then
// the u32 version), and chunk data found by its content in an uncompressed
// stream (level 0). Nothing here depends on how the records are laid out.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dvr/transfer.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;

// The sender's session "s": an SDK-owned region, a caller buffer at an odd
// address of an odd size, and a region that is all zero.
struct Source {
  Bytes owned = dvrtest::random_bytes((3u << 20) + 123, 1);
  Bytes tracked = dvrtest::random_bytes(300001, 2);
  Bytes zero = Bytes(1u << 20, 0);
  std::uint64_t logical() const { return owned.size() + tracked.size() + zero.size(); }
};

void snapshot(Store& store, const Source& src, const std::string& name, const std::string& label = "") {
  dvrtest::OddBuffer odd(src.tracked.size(), 3);  // (memory a session tracks outlives it)
  std::memcpy(odd.data(), src.tracked.data(), src.tracked.size());
  Bytes z = src.zero;
  Session s(store, "s");
  auto& r = s.alloc("owned", src.owned.size());
  std::memcpy(r.data(), src.owned.data(), src.owned.size());
  s.track("tracked", odd.data(), odd.size());
  s.track("zero", z.data(), z.size());
  SnapshotOptions o;
  o.label = label;
  s.snapshot(name, o);
}

// Restores session/name of `store` into fresh memory: "" when it is `src`, else where it differs.
std::string restored_diff(Store& store, const std::string& session, const std::string& name, const Source& src) {
  Bytes tracked(src.tracked.size(), 0x55), zero(src.zero.size(), 0x55);
  Session s(store, session);
  auto& r = s.alloc("owned", src.owned.size());
  s.track("tracked", tracked.data(), tracked.size());
  s.track("zero", zero.data(), zero.size());
  s.restore(name);
  if (auto d = dvrtest::diff(r.data(), src.owned.data(), src.owned.size()); !d.empty()) return "owned: " + d;
  if (auto d = dvrtest::diff(tracked, src.tracked); !d.empty()) return "tracked: " + d;
  if (auto d = dvrtest::diff(zero, src.zero); !d.empty()) return "zero: " + d;
  return "";
}

// A memfd holding `bytes`, positioned at its start.
int memfd_of(const std::string& bytes) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  return fd;
}

std::string stream_of(const Store& store, const std::string& ref, const transfer::Options& o = {}, transfer::Stats* stats = nullptr) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::Stats st = transfer::send(store, ref, fd, o);
  if (stats) *stats = st;
  off_t n = ::lseek(fd, 0, SEEK_END);
  std::string s(static_cast<std::size_t>(n), '\0');
  REQUIRE(::pread(fd, s.data(), s.size(), 0) == n);
  ::close(fd);
  return s;
}

transfer::Stats receive_bytes(Store& store, const std::string& bytes, const transfer::ReceiveOptions& o = {}) {
  int fd = memfd_of(bytes);
  try {
    auto st = transfer::receive(store, fd, o);
    ::close(fd);
    return st;
  } catch (...) {
    ::close(fd);
    throw;
  }
}

// `bytes` written into a pipe by another thread (which closes it at the end)
// while this one receives from it.
transfer::Stats receive_through_pipe(Store& store, const std::string& bytes) {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  std::thread writer([&] {
    // Should the receiver stop reading and close its end: EPIPE here, not SIGPIPE.
    sigset_t pipe_signal;
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    const char* d = bytes.data();
    std::size_t n = bytes.size();
    while (n) {
      ssize_t w = ::write(p[1], d, n);
      if (w <= 0) break;  // the receiver gave up (EPIPE)
      d += w;
      n -= static_cast<std::size_t>(w);
    }
    ::close(p[1]);
  });
  try {
    auto st = transfer::receive(store, p[0]);
    writer.join();
    ::close(p[0]);
    return st;
  } catch (...) {
    ::close(p[0]);  // unblocks the writer
    writer.join();
    throw;
  }
}

// Everything a refused receive must leave as it was: the listing and every
// file (name and content) under sessions/, heaps/ and tmp/.
struct StoreState {
  std::vector<std::string> snapshots;
  std::map<std::string, std::string> files;
  bool operator==(const StoreState&) const = default;
};

StoreState state_of(const Store& store) {
  StoreState st;
  for (auto& i : store.list())
    st.snapshots.push_back(i.session + "/" + i.name + " " + i.label + " " + std::to_string(i.logical_bytes) + " " + std::to_string(i.time_ns) +
                           (i.damaged ? " damaged" : ""));
  for (const char* sub : {"sessions", "heaps", "tmp"}) {
    std::string root = store.path() + "/" + sub;
    if (!dvrtest::fs::exists(root)) continue;
    for (auto& rel : dvrtest::tree(root)) {
      std::string p = root + "/" + rel;
      st.files[std::string(sub) + "/" + rel] = dvrtest::fs::is_regular_file(p) ? dvrtest::read_file(p) : "(dir)";
    }
  }
  return st;
}

std::string describe(const StoreState& s) {
  std::string out;
  for (auto& n : s.snapshots)
    out += "  " + n + "\n";
  for (auto& [f, c] : s.files)
    out += "  " + f + " (" + std::to_string(c.size()) + " bytes)\n";
  return out;
}

// Two stores: A holds s/one (and whatever the test adds), B holds an
// unrelated snapshot other/resident, so that "B is as before" compares something.
struct Pair {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  Source src;
  Source resident{dvrtest::random_bytes(200000, 7), dvrtest::random_bytes(5000, 8), Bytes(4096, 0)};
  Pair() {
    snapshot(a, src, "one", "the first");
    Session s(b, "other");
    auto& r = s.alloc("owned", resident.owned.size());
    std::memcpy(r.data(), resident.owned.data(), resident.owned.size());
    s.track("tracked", resident.tracked.data(), resident.tracked.size());
    s.track("zero", resident.zero.data(), resident.zero.size());
    s.snapshot("resident");
  }

  // Receiving `bytes` into B fails with `code`, naming the problem, and changes nothing.
  void refused(const std::string& bytes, Errc code, const std::string& context) {
    INFO(context << " (" << bytes.size() << " bytes)");
    const StoreState before = state_of(b);
    auto c = catch_error([&] { receive_bytes(b, bytes); });
    INFO(c.what);
    CHECK(c.code == code);
    CHECK(c.what.size() > 20);
    const StoreState after = state_of(b);
    INFO("before:\n" << describe(before) << "after:\n" << describe(after));
    CHECK(after == before);
  }

  // B as it was at the start: the resident snapshot intact, nothing else.
  void b_intact() {
    CHECK(b.list("s").empty());
    CHECK(b.verify().ok());
    CHECK(restored_diff(b, "other", "resident", resident) == "");
  }
};

void put_u32(std::string& s, std::size_t at, std::uint32_t v) { std::memcpy(s.data() + at, &v, 4); }
std::uint32_t get_u32(const std::string& s, std::size_t at) {
  std::uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

// Where the `len` bytes at `data` occur in `stream` (npos if they do not).
std::size_t find_in(const std::string& stream, const unsigned char* data, std::size_t len) {
  auto it = std::search(stream.begin(), stream.end(), data, data + len, [](char a, unsigned char b) { return static_cast<unsigned char>(a) == b; });
  return it == stream.end() ? std::string::npos : static_cast<std::size_t>(it - stream.begin());
}

}  // namespace

TEST_CASE("stream: send and receive through a pipe restore the snapshot bit-exact in another store", "[stream]") {
  const int level = GENERATE(0, 1, 9);
  INFO("level " << level);
  Pair t;
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  transfer::Options o;
  o.level = level;
  std::uint64_t progress_total = 0, progress_done = 0;
  o.progress = [&](std::uint64_t done, std::uint64_t total) {
    progress_done = done;
    progress_total = total;
  };
  transfer::Stats sent, got;
  std::string send_error;
  std::thread sender([&] {
    sigset_t pipe_signal;  // a receiver that gives up: EPIPE, not SIGPIPE
    sigemptyset(&pipe_signal);
    sigaddset(&pipe_signal, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
    try {
      sent = transfer::send(t.a, "s/one", p[1], o);
    } catch (const std::exception& e) {
      send_error = e.what();
    }
    ::close(p[1]);
  });
  auto received = catch_error([&] { got = transfer::receive(t.b, p[0]); });
  ::close(p[0]);
  sender.join();
  REQUIRE(send_error == "");
  REQUIRE(received.what == "(returned normally)");

  CHECK(sent.refs == std::vector<std::string>{"s/one"});
  CHECK(got.refs == std::vector<std::string>{"s/one"});
  CHECK(sent.base == "");
  CHECK(sent.logical_bytes == t.src.logical());
  CHECK(got.logical_bytes == t.src.logical());
  CHECK(got.wire_bytes == sent.wire_bytes);
  CHECK(got.chunks == sent.chunks);
  CHECK(sent.chunks == t.a.info("s", "one").chunks);
  CHECK(got.stored_bytes > 0);
  CHECK(progress_total == t.src.logical());
  CHECK(progress_done == progress_total);
  if (level == 0) {
    // Raw: all the non-zero data travels as it is (with a few bytes of framing).
    CHECK(sent.compression_ratio == Approx(1).epsilon(0.01));
    CHECK(sent.data_bytes <= sent.wire_bytes);
    CHECK(sent.wire_bytes >= t.src.owned.size() + t.src.tracked.size());
  } else {
    CHECK(sent.data_bytes >= t.src.owned.size() + t.src.tracked.size());
  }
  // The zero region costs nothing on the wire.
  CHECK(sent.wire_bytes < t.src.logical() - t.src.zero.size() / 2);

  auto info = t.b.info("s", "one");
  CHECK(info.label == "the first");
  CHECK(info.logical_bytes == t.src.logical());
  REQUIRE(info.regions.size() == 3);
  CHECK(restored_diff(t.b, "s", "one", t.src) == "");
  CHECK(t.b.verify().ok());
  CHECK(restored_diff(t.b, "other", "resident", t.resident) == "");
  // The sender's store is as it was.
  CHECK(restored_diff(t.a, "s", "one", t.src) == "");
}

TEST_CASE("stream: a stream kept in a file is received later, into another session if asked", "[stream]") {
  Pair t;
  const std::string file = t.dir / "one.stream";
  {
    int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    transfer::send(t.a, "s/one", fd);
    ::close(fd);
  }
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::ReceiveOptions ro;
  ro.session = "copy";
  auto got = transfer::receive(t.b, fd, ro);
  ::close(fd);
  CHECK(got.refs == std::vector<std::string>{"copy/one"});
  CHECK(t.b.list("s").empty());
  REQUIRE(t.b.list("copy").size() == 1);
  CHECK(restored_diff(t.b, "copy", "one", t.src) == "");
  // The same file again, now into its own session: both are there.
  fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::receive(t.b, fd);
  ::close(fd);
  CHECK(restored_diff(t.b, "s", "one", t.src) == "");
  CHECK(restored_diff(t.b, "copy", "one", t.src) == "");
  CHECK(t.b.verify().ok());
}

TEST_CASE("stream: an incremental send against a base carries only what changed", "[stream]") {
  Pair t;
  transfer::Stats full;
  const std::string first = stream_of(t.a, "s/one", {}, &full);
  receive_bytes(t.b, first);
  // Three scattered pages change.
  Source next = t.src;
  for (std::size_t page : {3u, 200u, 700u})
    next.owned[page * 4096 + 17] ^= 0x5a;
  snapshot(t.a, next, "two");

  transfer::Options o;
  o.base = "one";
  o.level = 0;
  transfer::Stats delta;
  const std::string second = stream_of(t.a, "s/two", o, &delta);
  INFO("full stream " << first.size() << " bytes, incremental " << second.size());
  CHECK(delta.base == "one");
  CHECK(delta.logical_bytes == next.logical());
  CHECK(delta.chunks_skipped > 0);
  CHECK(delta.chunks_skipped < delta.chunks);
  CHECK(delta.data_bytes <= 3 * 4096);  // only the pages that differ
  CHECK(second.size() * 20 < first.size());

  SECTION("received where the base is: exact, and the base is untouched") {
    auto got = receive_bytes(t.b, second);
    CHECK(got.base == "one");
    CHECK(got.stored_bytes <= 3 * 4096 + 4096);
    CHECK(restored_diff(t.b, "s", "two", next) == "");
    CHECK(restored_diff(t.b, "s", "one", t.src) == "");
    CHECK(t.b.verify().ok());
  }
  SECTION("received where the base is missing: not_found, nothing stored") {
    Store c = Store::open(t.dir / "c");
    auto before = state_of(c);
    auto e = catch_error([&] { receive_bytes(c, second); });
    CHECK(e.code == Errc::not_found);
    CHECK_THAT(e.what, Catch::Contains("one"));
    CHECK(state_of(c) == before);
    CHECK(c.list().empty());
  }
  SECTION("received where the base has other content: not_found, nothing stored") {
    t.b.remove("s", "one");
    Source other = t.src;
    other.owned[12345] ^= 1;
    snapshot(t.b, other, "one");
    auto before = state_of(t.b);
    auto e = catch_error([&] { receive_bytes(t.b, second); });
    INFO(e.what);
    CHECK(e.code == Errc::not_found);
    CHECK(state_of(t.b) == before);
  }
  SECTION("a base the sender does not hold: not_found, nothing written") {
    transfer::Options bad;
    bad.base = "nosuch";
    int fd = ::memfd_create("stream", MFD_CLOEXEC);
    auto e = catch_error([&] { transfer::send(t.a, "s/two", fd, bad); });
    CHECK(e.code == Errc::not_found);
    CHECK(::lseek(fd, 0, SEEK_END) == 0);
    ::close(fd);
  }
}

TEST_CASE("stream: a snapshot the receiver holds already is already_exists, and nothing changes", "[stream]") {
  Pair t;
  const std::string s = stream_of(t.a, "s/one");
  receive_bytes(t.b, s);
  t.refused(s, Errc::already_exists, "the same stream again");
  CHECK(restored_diff(t.b, "s", "one", t.src) == "");
}

TEST_CASE("stream: sending an unknown snapshot is not_found and writes nothing", "[stream]") {
  Pair t;
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  CHECK(catch_error([&] { transfer::send(t.a, "s/nosuch", fd); }).code == Errc::not_found);
  CHECK(catch_error([&] { transfer::send(t.a, "nosuch/one", fd); }).code == Errc::not_found);
  CHECK(::lseek(fd, 0, SEEK_END) == 0);
  ::close(fd);
}

TEST_CASE("stream: every kind of truncated stream is corrupt, and the receiver is unchanged", "[stream]") {
  Pair t;
  const std::string s = stream_of(t.a, "s/one", {.level = 0});
  REQUIRE(s.size() > 100000);
  const std::size_t n = s.size();
  for (std::size_t len : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{12}, std::size_t{16}, std::size_t{17},
                          std::size_t{100}, std::size_t{4096}, n / 3, n / 2, n - 4096, n - 100, n - 21, n - 20, n - 9, n - 8, n - 1})
    t.refused(s.substr(0, len), Errc::corrupt, "cut to " + std::to_string(len) + " of " + std::to_string(n) + " bytes");
  // Cut at a random place, through a pipe whose writer then closes it.
  std::mt19937_64 rng(42);
  for (int i = 0; i < 5; ++i) {
    std::size_t len = rng() % n;
    INFO("through a pipe, cut to " << len);
    auto before = state_of(t.b);
    auto c = catch_error([&] { receive_through_pipe(t.b, s.substr(0, len)); });
    CHECK(c.code == Errc::corrupt);
    CHECK(state_of(t.b) == before);
  }
  t.b_intact();
  // The whole stream is fine.
  receive_bytes(t.b, s);
  CHECK(restored_diff(t.b, "s", "one", t.src) == "");
}

TEST_CASE("stream: bad magic, a newer version or random bytes are refused, and the receiver is unchanged", "[stream]") {
  Pair t;
  const std::string s = stream_of(t.a, "s/one");
  REQUIRE(s.compare(0, 8, std::string("DVRSTRM\0", 8)) == 0);  // docs/format.md
  for (std::size_t at : {0, 3, 7}) {
    std::string bad = s;
    bad[at] ^= 0x20;
    t.refused(bad, Errc::corrupt, "magic byte " + std::to_string(at) + " flipped");
  }
  t.refused(std::string("DVRPACK1") + s.substr(8), Errc::corrupt, "another Memory DVR file's magic");
  const std::uint32_t version = get_u32(s, 8);
  CHECK(version >= 1);
  for (std::uint32_t newer : {version + 1, 99u, 0xFFFFFFFFu}) {
    std::string bad = s;
    put_u32(bad, 8, newer);
    t.refused(bad, Errc::unsupported, "version " + std::to_string(newer));
  }
  auto noise = dvrtest::random_bytes(64 * 1024, 9);
  t.refused(std::string(noise.begin(), noise.end()), Errc::corrupt, "random bytes");
  t.b_intact();
}

TEST_CASE("stream: a flipped byte in a chunk's data is corrupt, and nothing is published", "[stream]") {
  Pair t;
  const std::string s = stream_of(t.a, "s/one", {.level = 0});
  // Bytes of the data, found in the uncompressed stream by their content: at
  // the start, in the middle and at the end of the SDK-owned region, and in
  // the caller's buffer.
  const std::size_t owned = t.src.owned.size();
  for (std::size_t at : {std::size_t{0}, owned / 2 + 1000, owned - 64}) {
    std::size_t where = find_in(s, t.src.owned.data() + at, 64);
    REQUIRE(where != std::string::npos);
    std::string bad = s;
    bad[where + 31] ^= 0x01;
    t.refused(bad, Errc::corrupt, "a bit of region 'owned' at byte " + std::to_string(at + 31));
  }
  std::size_t where = find_in(s, t.src.tracked.data() + 4096, 64);
  REQUIRE(where != std::string::npos);
  std::string bad = s;
  bad[where] ^= 0xFF;
  t.refused(bad, Errc::corrupt, "a byte of region 'tracked'");
  t.b_intact();
}

TEST_CASE("stream: a flipped byte anywhere past the header is refused, never published", "[stream]") {
  Pair t;
  const std::string s = stream_of(t.a, "s/one");
  std::mt19937_64 rng(7);
  const std::size_t header = 16;  // magic and version (docs/format.md); flipped above
  std::vector<std::size_t> spots;
  for (std::size_t i = header; i < header + 64 && i < s.size(); ++i)
    spots.push_back(i);  // the first record
  for (std::size_t i = s.size() - 64; i < s.size(); ++i)
    spots.push_back(i);  // the last ones
  for (int i = 0; i < 60; ++i)
    spots.push_back(header + rng() % (s.size() - header));
  const StoreState before = state_of(t.b);
  for (std::size_t at : spots) {
    std::string bad = s;
    bad[at] ^= static_cast<char>(1u << (rng() % 8));
    INFO("byte " << at << " of " << s.size());
    auto c = catch_error([&] { receive_bytes(t.b, bad); });
    INFO(c.what);
    CHECK((c.code == Errc::corrupt || c.code == Errc::unsupported));
    REQUIRE(state_of(t.b) == before);
  }
  t.b_intact();
}

TEST_CASE("stream: a snapshot whose data is damaged in the sender's store is not sent", "[stream]") {
  Pair t;
  // Damage the sender's copy of some of its data: a byte of the SDK-owned region in a pack.
  bool flipped = false;
  for (auto& pack : dvrtest::pack_files(t.a)) {
    std::string bytes = dvrtest::read_file(pack);
    std::size_t at = find_in(bytes, t.src.owned.data() + 8192, 64);
    if (at == std::string::npos) continue;
    dvrtest::flip_byte(pack, at + 5);
    flipped = true;
    break;
  }
  REQUIRE(flipped);
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  auto c = catch_error([&] { transfer::send(t.a, "s/one", fd); });
  CHECK(c.code == Errc::corrupt);
  CHECK_THAT(c.what, Catch::Contains("one"));
  // Whatever was written before the damage was found does not make a snapshot.
  off_t n = ::lseek(fd, 0, SEEK_END);
  std::string partial(static_cast<std::size_t>(n), '\0');
  if (n > 0) REQUIRE(::pread(fd, partial.data(), partial.size(), 0) == n);
  ::close(fd);
  if (n > 0) t.refused(partial, Errc::corrupt, "what the refused send wrote");
  t.b_intact();
}

// ---- Channels: a stream between two threads of one process (dvr::mpi) ------

namespace {

// Everything `send` puts into a channel, taken by this thread (each buffer
// given back as soon as it is copied out, as dvr::mpi's loop does once a
// message is sent); `sizes` gets each buffer's size.
// The taker starts after `delay`.
std::string taken_from(const std::function<void(transfer::Channel&)>& send, std::vector<std::size_t>* sizes = nullptr,
                       std::size_t limit = std::size_t{16} << 20, std::chrono::milliseconds delay = std::chrono::milliseconds(0)) {
  transfer::Channel ch(limit);
  std::string send_error;
  std::thread sender([&] {
    try {
      send(ch);
    } catch (const std::exception& e) {
      send_error = e.what();
    }
    ch.close();
  });
  std::this_thread::sleep_for(delay);
  std::string all, buf;
  while (ch.take(buf)) {
    if (sizes) sizes->push_back(buf.size());
    all += buf;
  }
  CHECK(ch.ended());
  sender.join();
  CHECK(send_error == "");
  return all;
}

// `bytes` put into a channel by another thread in pieces of the given sizes
// (cycled; records are cut anywhere), then closed, while this one receives.
transfer::Stats receive_from_channel(Store& store, const std::string& bytes, const std::vector<std::size_t>& pieces,
                                     const transfer::ReceiveOptions& o = {}) {
  transfer::Channel ch(64 << 10);
  std::thread putter([&] {
    std::size_t at = 0;
    try {
      for (std::size_t k = 0; at < bytes.size(); ++k) {
        const std::size_t n = std::min(pieces[k % pieces.size()], bytes.size() - at);
        std::string b = ch.reuse();
        b.assign(bytes, at, n);
        ch.put(std::move(b));
        at += n;
      }
    } catch (const Error&) {
      // the receiver stopped reading (abandoned): the rest is not needed
    }
    ch.close();
  });
  try {
    auto st = transfer::receive(store, ch, o);
    ch.abandon();
    putter.join();
    return st;
  } catch (...) {
    ch.abandon();
    putter.join();
    throw;
  }
}

}  // namespace

TEST_CASE("stream: send into a Channel puts the same stream as into a file, and receive from one stores it bit-exact", "[stream][channel]") {
  Pair t;
  const std::string by_fd = stream_of(t.a, "s/one", {.level = 0});
  std::vector<std::size_t> sizes;
  const std::string by_channel = taken_from([&](transfer::Channel& ch) { transfer::send(t.a, "s/one", ch, {.level = 0}); }, &sizes);
  CHECK(by_channel == by_fd);
  REQUIRE(sizes.size() > 2);
  // Each buffer is one record (a chunk's at most: the chunk size plus its
  // framing) or small records gathered (at most 256 KiB).
  const std::size_t chunk = t.a.chunk_size();
  for (std::size_t n : sizes) {
    CHECK(n > 0);
    CHECK(n <= std::max<std::size_t>(chunk + 64, 256 << 10));
  }

  SECTION("received in pieces that cut records anywhere") {
    const std::vector<std::size_t> pieces = GENERATE(std::vector<std::size_t>{1, 7, 4096, 100000}, std::vector<std::size_t>{1 << 20});
    auto got = receive_from_channel(t.b, by_channel, pieces);
    CHECK(got.refs == std::vector<std::string>{"s/one"});
    CHECK(got.wire_bytes == by_channel.size());
    CHECK(restored_diff(t.b, "s", "one", t.src) == "");
    CHECK(t.b.verify().ok());
  }
  SECTION("cut short (the sender closed the channel early): corrupt, nothing stored") {
    for (std::size_t len : {std::size_t{0}, std::size_t{16}, by_channel.size() / 2, by_channel.size() - 1}) {
      INFO("cut to " << len << " of " << by_channel.size());
      const StoreState before = state_of(t.b);
      auto c = catch_error([&] { receive_from_channel(t.b, by_channel.substr(0, len), {65536}); });
      CHECK(c.code == Errc::corrupt);
      CHECK(state_of(t.b) == before);
    }
    t.b_intact();
  }
}

TEST_CASE("stream: an incremental send into a Channel gathers its small records and arrives exact", "[stream][channel]") {
  Pair t;
  receive_bytes(t.b, stream_of(t.a, "s/one"));
  // One page changed in every 64 KiB: many small page records.
  Source next = t.src;
  for (std::size_t at = 5; at < next.owned.size(); at += 65536)
    next.owned[at] ^= 0x3c;
  snapshot(t.a, next, "two");
  transfer::Options o;
  o.base = "one";
  o.level = 0;
  const std::string by_fd = stream_of(t.a, "s/two", o);
  std::vector<std::size_t> sizes;
  // A channel of 1 byte and a taker that starts late: the writer's thread
  // hands over what it took first and then waits, while every other record
  // is queued behind it; those go out gathered once the taker starts.
  const std::string by_channel =
      taken_from([&](transfer::Channel& ch) { transfer::send(t.a, "s/two", ch, o); }, &sizes, 1, std::chrono::milliseconds(300));
  CHECK(by_channel == by_fd);
  INFO(sizes.size() << " buffers for " << by_channel.size() << " bytes");
  CHECK(sizes.size() <= 4);  // ~50 pages in ~16 records, gathered, not a buffer each
  auto got = receive_from_channel(t.b, by_channel, {8192});
  CHECK(got.base == "one");
  CHECK(restored_diff(t.b, "s", "two", next) == "");
  CHECK(restored_diff(t.b, "s", "one", t.src) == "");
}

TEST_CASE("stream: a Channel holds its putter while full, and a taker that abandons it fails the send", "[stream][channel]") {
  SECTION("flow control and the end") {
    transfer::Channel ch(4096);
    CHECK_FALSE(ch.full());
    ch.put(std::string(10000, 'a'));  // an empty channel takes any buffer
    CHECK(ch.full());
    ch.put(std::string());  // nothing: dropped, never waits
    std::atomic<bool> returned{false};
    std::thread putter([&] {
      ch.put(std::string(100, 'b'));
      returned = true;
      ch.close();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK_FALSE(returned.load());  // waits while full
    std::string got;
    CHECK_FALSE(ch.ended());
    REQUIRE(ch.take(got));
    CHECK(got == std::string(10000, 'a'));
    REQUIRE(ch.take(got));  // the first is given back, for reuse()
    CHECK(got == std::string(100, 'b'));
    putter.join();
    CHECK(returned.load());
    CHECK_FALSE(ch.take(got));
    CHECK(ch.ended());
    CHECK(ch.reuse().capacity() >= 10000);  // the buffer given back
  }
  SECTION("take without waiting") {
    transfer::Channel ch;
    std::string got;
    CHECK_FALSE(ch.take(got, false));
    CHECK_FALSE(ch.ended());
    ch.put("x");
    CHECK(ch.take(got, false));
    CHECK(got == "x");
    ch.close();
    CHECK_FALSE(ch.take(got, false));
    CHECK(ch.ended());
  }
  SECTION("after its taker abandons it, take returns at once and every put throws") {
    transfer::Channel ch;
    ch.abandon();
    std::string got;
    CHECK_FALSE(ch.take(got));  // would wait for a putter otherwise
    CHECK_THROWS_AS(ch.put(std::string()), dvr::Error);
    CHECK_THROWS_AS(ch.put("x"), dvr::Error);
  }
  SECTION("a send whose taker abandons the channel is io, and says why") {
    Pair t;
    transfer::Channel ch(64 << 10);
    std::thread taker([&] {
      std::string b;
      ch.take(b);
      ch.abandon();
    });
    auto c = catch_error([&] { transfer::send(t.a, "s/one", ch, {.level = 0}); });
    taker.join();
    CHECK(ch.abandoned());
    CHECK(c.code == Errc::io);
    CHECK_THAT(c.what, Catch::Contains("stopped reading"));
  }
}

namespace {
// An 8 MiB snapshot of noise, "big/one", in `store`.
void big_snapshot(Store& store) {
  Session s(store, "big");
  auto& r = s.alloc("owned", 8u << 20);
  auto bytes = dvrtest::random_bytes(r.size(), 31);
  std::memcpy(r.data(), bytes.data(), bytes.size());
  s.snapshot("one");
}
}  // namespace

TEST_CASE("stream: a send into a Channel writes its next records into the buffers its taker gave back", "[stream][channel]") {
  Pair t;
  big_snapshot(t.a);
  transfer::Channel ch;
  // A buffer given back before the send starts: it lives in the channel
  // until the sender takes it, so its address can show up in what is taken
  // only if the sender wrote records into it.
  std::string marked;
  marked.reserve(1u << 20);
  const char* const mark = marked.data();
  ch.give_back(std::move(marked));
  std::exception_ptr error;
  std::thread sender = dvrtest::send_on_thread(t.a, "big/one", ch, error);
  std::set<const char*> seen;
  std::size_t taken = 0, again = 0;
  bool mark_used = false;
  std::string stream;
  for (std::string buf; ch.take(buf);) {  // each take() gives the previous buffer back
    stream += buf;
    ++taken;
    mark_used = mark_used || buf.data() == mark;
    if (!seen.insert(buf.data()).second) ++again;
  }
  sender.join();
  if (error) std::rethrow_exception(error);
  INFO(taken << " buffers taken, " << again << " of them at an address taken before");
  CHECK(mark_used);
  Store c = Store::open(t.dir / "c");
  receive_from_channel(c, stream, {1 << 20});
  std::vector<unsigned char> live(8u << 20, 0);
  Session back(c, "big");
  back.track("owned", live.data(), live.size());
  back.restore("one");
  CHECK(live == dvrtest::random_bytes(live.size(), 31));
}

TEST_CASE("stream: a receive from a Channel that fails abandons it, so its sender stops instead of waiting", "[stream][channel]") {
  Pair t;
  big_snapshot(t.a);
  receive_bytes(t.b, stream_of(t.a, "big/one", {.level = 0}));
  // Again into the same store: already_exists at the stream's first item,
  // with most of the 8 MiB still to come.
  transfer::Channel ch(64u << 10);
  std::atomic<bool> sender_done{false};
  std::exception_ptr send_error;
  std::thread sender = dvrtest::send_on_thread(t.a, "big/one", ch, send_error, &sender_done);
  auto c = catch_error([&] { transfer::receive(t.b, ch); });
  CHECK(c.code == Errc::already_exists);
  CHECK(ch.abandoned());
  // The sender's next put fails: it ends on its own (were it left waiting,
  // this would abandon it after 20 s and fail).
  for (int i = 0; i < 2000 && !sender_done; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const bool ended_on_its_own = sender_done.load();
  if (!ended_on_its_own) ch.abandon();
  sender.join();
  CHECK(ended_on_its_own);
  REQUIRE(send_error);
  auto e = catch_error([&] { std::rethrow_exception(send_error); });
  CHECK(e.code == Errc::io);
  CHECK_THAT(e.what, Catch::Contains("stopped reading"));
}
