// Pushes at wire speed (issue #21): the per-chunk compression decision
// (Options::compress), the pipelined sender and receiver (a writer thread, a
// read-ahead thread) when a stream breaks, is cut off or is refused in the
// middle, and a push against a base that reads and sends only the pages
// that differ. Counted in bytes and chunks (Stats, the stream's bytes, the
// threads of this process), never in time.
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/codec.hpp"
#include "dvr/transfer.hpp"
#include "test_support.hpp"
#include "transfer/stream.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;
constexpr std::size_t kChunk = 256u << 10;  // the stores' default chunk size

// Threads of this process (each scenario must end with as many as it began).
int thread_count() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  REQUIRE(d);
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// A thread that was just joined may still be listed in /proc/self/task for a
// moment (the kernel wakes the joiner before the task is gone). The count
// once it settles: until it equals `want` (0: until two reads 20 ms apart
// agree), at most 5 s; a thread that really stays is still counted.
int settled_thread_count(int want = 0) {
  int n = thread_count();
  for (int waited = 0; waited < 5000; waited += 20) {
    if (want && n == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    int again = thread_count();
    if (!want && again == n) break;
    n = again;
  }
  return n;
}

void block_sigpipe() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

// Text-like bytes: words from a small vocabulary (zstd: several times smaller).
Bytes text_bytes(std::size_t n, std::uint64_t seed) {
  static const char* words[] = {"alpha ", "beta ", "gamma ", "delta\n", "sigma ", "omega ", "kappa ", "lambda "};
  Bytes out;
  out.reserve(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  while (out.size() < n) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    for (const char* c = words[x % 8]; *c && out.size() < n; ++c)
      out.push_back(static_cast<unsigned char>(*c));
  }
  return out;
}

// Session "c" of four one-chunk regions: noise (incompressible), text
// (compressible), head_noise (random first 16 KiB, then zeros: the sample
// says no, the whole would shrink) and pages of the text again.
struct Mixed {
  Bytes noise = dvrtest::random_bytes(kChunk, 11);
  Bytes text = text_bytes(kChunk, 12);
  Bytes head_noise = Bytes(kChunk, 0);
  Mixed() {
    Bytes r = dvrtest::random_bytes(16384, 13);
    std::memcpy(head_noise.data(), r.data(), r.size());
  }
  void snapshot(Store& store, const std::string& name) const {
    Session s(store, "c");
    std::memcpy(s.alloc("noise", kChunk).data(), noise.data(), kChunk);
    std::memcpy(s.alloc("text", kChunk).data(), text.data(), kChunk);
    std::memcpy(s.alloc("head_noise", kChunk).data(), head_noise.data(), kChunk);
    s.snapshot(name);
  }
  // "" when session c's snapshot `name` in `store` holds these bytes.
  std::string restored_diff(Store& store, const std::string& name) const {
    Session s(store, "c");
    auto& a = s.alloc("noise", kChunk);
    auto& b = s.alloc("text", kChunk);
    auto& c = s.alloc("head_noise", kChunk);
    s.restore(name);
    if (auto d = dvrtest::diff(a.data(), noise.data(), kChunk); !d.empty()) return "noise: " + d;
    if (auto d = dvrtest::diff(b.data(), text.data(), kChunk); !d.empty()) return "text: " + d;
    if (auto d = dvrtest::diff(c.data(), head_noise.data(), kChunk); !d.empty()) return "head_noise: " + d;
    return "";
  }
};

std::string stream_of(const Store& store, const std::string& ref, const transfer::Options& o, transfer::Stats& st) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  st = transfer::send(store, ref, fd, o);
  off_t n = ::lseek(fd, 0, SEEK_END);
  std::string s(static_cast<std::size_t>(n), '\0');
  REQUIRE(::pread(fd, s.data(), s.size(), 0) == n);
  ::close(fd);
  return s;
}

transfer::Stats receive_bytes(Store& store, const std::string& bytes) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } closer{fd};
  return transfer::receive(store, fd);
}

bool contains(const std::string& hay, const Bytes& needle, std::size_t at, std::size_t n) {
  return hay.find(std::string(reinterpret_cast<const char*>(needle.data()) + at, n)) != std::string::npos;
}

// Session "big": one region of `pages` random pages.
struct Big {
  Bytes data;
  explicit Big(std::size_t pages) : data(dvrtest::random_bytes(pages * 4096, 21)) {}
  void snapshot(Store& store, const std::string& name) const {
    Session s(store, "big");
    std::memcpy(s.alloc("x", data.size()).data(), data.data(), data.size());
    s.snapshot(name);
  }
};

// Runs `receiver(in_fd, out_fd)` on a thread connected to `sender(in_fd,
// out_fd)` on this one by two pipes, as dvr push connects them through ssh;
// each side closes its ends when it returns or throws. Returns what each threw.
struct Duplex {
  dvrtest::Caught sent, received;
};
template <class Sender, class Receiver>
Duplex duplex(Sender sender, Receiver receiver) {
  int to[2], from[2];
  REQUIRE(::pipe2(to, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(from, O_CLOEXEC) == 0);
  Duplex d;
  std::thread far([&] {
    block_sigpipe();
    d.received = catch_error([&] { receiver(to[0], from[1]); });
    ::close(to[0]);
    ::close(from[1]);
  });
  block_sigpipe();
  d.sent = catch_error([&] { sender(from[0], to[1]); });
  ::close(to[1]);
  ::close(from[0]);
  far.join();
  return d;
}

// dvr push of `ref` from `from` to `to` (send_negotiated | receive_negotiated
// through duplex); both sides must succeed. The sender's figures.
transfer::Stats push_negotiated(const Store& from, const std::string& ref, Store& to) {
  transfer::Stats st;
  auto r = duplex([&](int in, int out) { st = transfer::send_negotiated(from, ref, in, out); },
                  [&](int in, int out) { transfer::receive_negotiated(to, in, out); });
  REQUIRE(r.sent.what == "(returned normally)");
  REQUIRE(r.received.what == "(returned normally)");
  return st;
}

}  // namespace

TEST_CASE("pipeline: auto compresses a chunk that compresses and sends noise raw, judged on its first bytes", "[transfer][compress]") {
  TempDir d;
  Store a = Store::open(d / "a");
  Mixed m;
  m.snapshot(a, "v");
  transfer::Stats st;
  std::string s = stream_of(a, "c/v", {}, st);  // the default is auto
  CHECK(st.chunks == 3);
  CHECK(st.chunks_compressed == 1);  // text
  CHECK(st.chunks_raw == 2);         // noise, and head_noise whose first 8 KiB are random
  // What travels raw is in the stream verbatim; the text is not.
  CHECK(contains(s, m.noise, 1000, 4096));
  CHECK(contains(s, m.head_noise, 0, 16384 + 4096));
  CHECK_FALSE(contains(s, m.text, 1000, 512));
  CHECK(s.size() < 3 * kChunk - kChunk / 2);
  Store b = Store::open(d / "b");
  receive_bytes(b, s);
  CHECK(m.restored_diff(b, "v") == "");
}

TEST_CASE("pipeline: auto stops sampling a run of data that does not compress, and starts again when it does", "[transfer][compress]") {
  using transfer::internal::Compressor;
  Compressor z(transfer::Compress::automatic, 1);
  transfer::Stats st;
  auto seal = [&](const Bytes& data) {
    detail::Writer b;
    std::memcpy(Compressor::reserve(b, data.size()), data.data(), data.size());
    z.seal(b, data.size(), st);
    return b.size() - 9;  // the bytes that travel
  };
  const Bytes page_noise = dvrtest::random_bytes(4096, 21), page_text = text_bytes(4096, 22);
  // One page of noise between text pages: each text page still compressed.
  CHECK(seal(page_text) < 4096);
  CHECK(seal(page_noise) == 4096);
  CHECK(seal(page_text) < 4096);
  CHECK(z.samples() == 3);
  // 10 MiB of noise pages (a 1% push of float data): a few samples, not 2560.
  for (int i = 0; i < 2560; ++i) CHECK(seal(page_noise) == 4096);
  CHECK(z.samples() < 20);
  CHECK(st.chunks_raw == 2561);
  // Text after it: raw for at most the 4 MiB still unsampled, then compressed again.
  std::size_t raw = 0;
  for (int i = 0; i < 2048; ++i) raw += seal(page_text) == 4096 ? 1 : 0;
  CHECK(raw <= (Compressor::kMaxBackoff >> 12));
  CHECK(st.chunks_compressed == 2 + 2048 - raw);
  const std::size_t before = z.samples();
  CHECK(seal(page_text) < 4096);
  CHECK(z.samples() == before + 1);  // every chunk sampled again
}

TEST_CASE("pipeline: --compress=zstd compresses every chunk that shrinks, none compresses nothing", "[transfer][compress]") {
  TempDir d;
  Store a = Store::open(d / "a");
  Mixed m;
  m.snapshot(a, "v");
  SECTION("zstd") {
    transfer::Stats st;
    std::string s = stream_of(a, "c/v", {.compress = transfer::Compress::zstd}, st);
    CHECK(st.chunks_compressed == 2);  // text and head_noise (mostly zero)
    CHECK(st.chunks_raw == 1);         // noise: zstd tried, it did not shrink
    CHECK(contains(s, m.noise, 1000, 4096));
    CHECK_FALSE(contains(s, m.head_noise, 0, 16384 + 4096));
    Store b = Store::open(d / "b");
    receive_bytes(b, s);
    CHECK(m.restored_diff(b, "v") == "");
  }
  SECTION("none") {
    transfer::Stats st;
    std::string s = stream_of(a, "c/v", {.compress = transfer::Compress::none}, st);
    CHECK(st.chunks_compressed == 0);
    CHECK(st.chunks_raw == 3);
    CHECK(contains(s, m.text, 1000, 4096));
    CHECK(s.size() > 3 * kChunk);
    Store b = Store::open(d / "b");
    receive_bytes(b, s);
    CHECK(m.restored_diff(b, "v") == "");
  }
  SECTION("level 0 means none, whatever compress says") {
    transfer::Stats st;
    stream_of(a, "c/v", {.compress = transfer::Compress::zstd, .level = 0}, st);
    CHECK(st.chunks_compressed == 0);
  }
}

TEST_CASE("pipeline: parse_compress takes auto, zstd and none and names the option and the values otherwise", "[transfer][compress]") {
  CHECK(transfer::parse_compress("auto") == transfer::Compress::automatic);
  CHECK(transfer::parse_compress("zstd") == transfer::Compress::zstd);
  CHECK(transfer::parse_compress("none") == transfer::Compress::none);
  for (auto c : {transfer::Compress::automatic, transfer::Compress::zstd, transfer::Compress::none})
    CHECK(transfer::parse_compress(transfer::to_string(c)) == c);
  auto c = catch_error([] { transfer::parse_compress("fast", "--compress"); });
  CHECK(c.code == Errc::invalid_argument);
  CHECK_THAT(c.what, Catch::Contains("--compress") && Catch::Contains("auto, zstd or none") && Catch::Contains("'fast'"));
}

TEST_CASE("pipeline: a push after a 1 percent change reads and sends only the pages that differ", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a"), b = Store::open(d / "b");
  Big big(4096);  // 16 MiB, 64 chunks
  big.snapshot(a, "v0");
  auto full = duplex([&](int in, int out) { transfer::send_negotiated(a, "big/v0", in, out); },
                     [&](int in, int out) { transfer::receive_negotiated(b, in, out); });
  REQUIRE(full.sent.what == "(returned normally)");
  REQUIRE(full.received.what == "(returned normally)");
  // Every 100th page changes (one byte): 41 pages, scattered over 41 chunks.
  std::size_t changed = 0;
  for (std::size_t p = 0; p < 4096; p += 100, ++changed)
    big.data[p * 4096 + 7] ^= 1;
  big.snapshot(a, "v1");
  transfer::Stats first, second;
  auto again = duplex([&](int in, int out) { second = transfer::send_negotiated(a, "big/v1", in, out); },
                      [&](int in, int out) { transfer::receive_negotiated(b, in, out); });
  REQUIRE(again.sent.what == "(returned normally)");
  REQUIRE(again.received.what == "(returned normally)");
  CHECK(second.base == "v0");
  CHECK(second.read_bytes == changed * 4096);  // not a byte more of the store is read
  CHECK(second.data_bytes == changed * 4096);
  CHECK(second.chunks == 64);
  CHECK(second.chunks_skipped == 64 - changed);
  // Per changed page: its bytes, its index, and a record's head and hash.
  CHECK(second.wire_bytes < changed * (4096 + 96) + 1024);
  // The first push read everything once.
  Store c = Store::open(d / "c");
  auto whole = duplex([&](int in, int out) { first = transfer::send_negotiated(a, "big/v1", in, out); },
                      [&](int in, int out) { transfer::receive_negotiated(c, in, out); });
  REQUIRE(whole.sent.what == "(returned normally)");
  CHECK(first.read_bytes == big.data.size());
  // And what arrived is the snapshot, bit for bit.
  Session s(b, "big");
  auto& r = s.alloc("x", big.data.size());
  s.restore("v1");
  CHECK(dvrtest::diff(r.data(), big.data.data(), big.data.size()) == "");
}

TEST_CASE("pipeline: the newest base both sides hold intact is chosen; a damaged manifest on either side is passed over", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a"), b = Store::open(d / "b");
  Big big(512);  // 2 MiB, 8 chunks
  for (int v = 0; v <= 4; ++v) {
    big.data[static_cast<std::size_t>(v) * 4096 * 64 + 11] ^= 1;  // one page of chunk v changes
    big.snapshot(a, "v" + std::to_string(v));
  }
  auto push = [&](const std::string& ref) { return push_negotiated(a, ref, b); };
  CHECK(push("big/v0").base == "");
  CHECK(push("big/v1").base == "v0");
  CHECK(push("big/v2").base == "v1");
  // The sender's v2 and the receiver's v1 damaged: v3 is not there, v2 is
  // not offered, v1 is not accepted: v0 is the base.
  const std::string a_v2 = d / "a/sessions/big/v2.snap", b_v1 = d / "b/sessions/big/v1.snap";
  dvrtest::flip_byte(a_v2, std::filesystem::file_size(a_v2) / 2);
  dvrtest::flip_byte(b_v1, std::filesystem::file_size(b_v1) / 2);
  transfer::Stats st = push("big/v4");
  CHECK(st.base == "v0");
  CHECK(st.chunks_skipped == 8 - 4);  // chunks 1-4 changed since v0
  Session s(b, "big");
  auto& r = s.alloc("x", big.data.size());
  s.restore("v4");
  CHECK(dvrtest::diff(r.data(), big.data.data(), big.data.size()) == "");
  // The damaged manifest on the receiving side is left as it was, reported.
  bool reported = false;
  for (auto& i : b.list("big"))
    reported = reported || (i.name == "v1" && i.damaged);
  CHECK(reported);
}

TEST_CASE("pipeline: the sender offers its 32 newest snapshots as bases, newest by commit order, not by name", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a"), b = Store::open(d / "b"), c = Store::open(d / "c");
  Big big(128);  // 512 KiB
  for (int v = 0; v < 40; ++v) {
    big.data[static_cast<std::size_t>(v) * 4096 + 5] ^= 1;
    big.snapshot(a, "v" + std::to_string(v));
  }
  auto push = [&](const std::string& ref, Store& to) { return push_negotiated(a, ref, to); };
  CHECK(push("big/v8", b).base == "");
  CHECK(push("big/v0", c).base == "");
  // Offered for v39: v38 down to v7 (by name, v8 would sort after v39 and v0 before v1).
  CHECK(push("big/v39", b).base == "v8");
  CHECK(push("big/v39", c).base == "");  // v0 is not among the 32 newest
  Session s(c, "big");
  auto& r = s.alloc("x", big.data.size());
  s.restore("v39");
  CHECK(dvrtest::diff(r.data(), big.data.data(), big.data.size()) == "");
}

TEST_CASE("pipeline: with manifests older than format 4 in the session, bases are offered in Store::list's order", "[transfer][pipeline]") {
  // Store::list puts the manifests that record no commit number (format < 4)
  // first and numbers them 1, 2, ...; those numbers equal real ones here, and
  // must not reorder the offer: o2 is older than s1 and s2.
  TempDir d;
  Store a = Store::open(d / "a"), b = Store::open(d / "b");
  Big big(16);
  for (auto name : {"s1", "s2", "o1", "o2"}) {
    big.data[static_cast<std::size_t>(name[1] - '0') * 4096 + static_cast<std::size_t>(name[0])] ^= 1;
    big.snapshot(a, name);
  }
  dvrtest::make_legacy_manifest(a, "big", "o1");
  dvrtest::make_legacy_manifest(a, "big", "o2");
  Store old = Store::open(d / "a");
  std::vector<std::string> listed;
  for (auto& i : old.list("big"))
    listed.push_back(i.name + ":" + std::to_string(i.seq));
  REQUIRE(listed == std::vector<std::string>{"o1:1", "o2:2", "s1:1", "s2:2"});
  big.data[7] ^= 1;
  big.snapshot(old, "x");
  CHECK(push_negotiated(old, "big/o2", b).base == "");
  CHECK(push_negotiated(old, "big/s1", b).base == "o2");
  // Offered for x: s2, s1, o2, o1; b holds s1 and o2 and takes the first.
  CHECK(push_negotiated(old, "big/x", b).base == "s1");
  Session s(b, "big");
  auto& r = s.alloc("x", big.data.size());
  s.restore("x");
  CHECK(dvrtest::diff(r.data(), big.data.data(), big.data.size()) == "");
}

TEST_CASE("pipeline: a damaged chunk in the middle of the sender's store stops both ends, nothing published, no thread left", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a"), b = Store::open(d / "b");
  Big big(2048);  // 8 MiB, 32 chunks
  big.snapshot(a, "v0");
  // Damage chunk 20 in the sender's pack.
  bool flipped = false;
  for (auto& pack : dvrtest::pack_files(a)) {
    std::string bytes = dvrtest::read_file(pack);
    auto at = bytes.find(std::string(reinterpret_cast<const char*>(big.data.data()) + 20 * kChunk + 4096, 64));
    if (at == std::string::npos) continue;
    dvrtest::flip_byte(pack, at + 3);
    flipped = true;
  }
  REQUIRE(flipped);
  const int threads = settled_thread_count();
  auto r = duplex([&](int in, int out) { transfer::send_negotiated(a, "big/v0", in, out); },
                  [&](int in, int out) { transfer::receive_negotiated(b, in, out); });
  CHECK(r.sent.code == Errc::corrupt);
  CHECK_THAT(r.sent.what, Catch::Contains("big/v0") && Catch::Contains("damaged"));
  CHECK(r.received.code == Errc::corrupt);
  CHECK_THAT(r.received.what, Catch::Contains("truncated"));
  CHECK(b.list("big").empty());
  CHECK(settled_thread_count(threads) == threads);
}

TEST_CASE("pipeline: a stream cut anywhere and fed through a pipe is corrupt, and the reader thread ends", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a");
  Big big(1024);
  big.snapshot(a, "v0");
  transfer::Stats st;
  std::string s = stream_of(a, "big/v0", {.compress = transfer::Compress::none}, st);
  const int threads = settled_thread_count();
  for (std::size_t cut : {std::size_t{16}, std::size_t{20}, std::size_t{1000}, s.size() / 2, s.size() - 40, s.size() - 1}) {
    INFO("cut at " << cut << " of " << s.size());
    Store b = Store::open(d / ("b" + std::to_string(cut)));
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    std::thread writer([&] {
      block_sigpipe();
      const char* at = s.data();
      std::size_t n = cut;
      while (n) {
        ssize_t w = ::write(p[1], at, std::min<std::size_t>(n, 65536));
        if (w <= 0) break;
        at += w;
        n -= static_cast<std::size_t>(w);
      }
      ::close(p[1]);
    });
    auto c = catch_error([&] { transfer::receive(b, p[0]); });
    ::close(p[0]);
    writer.join();
    CHECK(c.code == Errc::corrupt);
    CHECK_THAT(c.what, Catch::Contains("truncated") || Catch::Contains("damaged"));
    CHECK(b.list("big").empty());
    CHECK(settled_thread_count(threads) == threads);
  }
}

TEST_CASE("pipeline: a receiver that refuses in the middle of a stream is reported by the sender with its message", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a");
  Big big(8192);  // 32 MiB: far more than the pipes and the writer's queue hold
  big.snapshot(a, "v0");
  const int threads = settled_thread_count();
  std::uint64_t read_before_refusing = 0;
  // A far side that speaks the negotiation (docs/format.md), reads 1 MiB of
  // the stream, then refuses with a message and closes, while the sender is
  // still writing.
  auto r = duplex([&](int in, int out) { transfer::send_negotiated(a, "big/v0", in, out); },
                  [&](int in, int out) {
                    char magic[8];
                    REQUIRE(::read(in, magic, 8) == 8);
                    std::uint32_t n = 0;
                    REQUIRE(::read(in, &n, 4) == 4);
                    std::string hello(n, '\0');
                    REQUIRE(::read(in, hello.data(), n) == static_cast<ssize_t>(n));
                    std::string answer = "none\n";
                    std::uint32_t len = static_cast<std::uint32_t>(answer.size());
                    REQUIRE(::write(out, &len, 4) == 4);
                    REQUIRE(::write(out, answer.data(), answer.size()) == static_cast<ssize_t>(answer.size()));
                    std::vector<char> buf(65536);
                    while (read_before_refusing < (1u << 20)) {
                      ssize_t got = ::read(in, buf.data(), buf.size());
                      REQUIRE(got > 0);
                      read_before_refusing += static_cast<std::uint64_t>(got);
                    }
                    std::string refusal = "error the receiving store is full (test)";
                    len = static_cast<std::uint32_t>(refusal.size());
                    REQUIRE(::write(out, &len, 4) == 4);
                    REQUIRE(::write(out, refusal.data(), refusal.size()) == static_cast<ssize_t>(refusal.size()));
                  });
  CHECK(r.received.what == "(returned normally)");
  CHECK(read_before_refusing >= (1u << 20));
  CHECK(r.sent.code == Errc::io);
  CHECK_THAT(r.sent.what, Catch::Contains("the receiver failed") && Catch::Contains("the receiving store is full (test)"));
  CHECK(settled_thread_count(threads) == threads);
}

TEST_CASE("pipeline: a real receiver whose store fills up in the middle tells the sender why", "[transfer][pipeline]") {
  TempDir d;
  dvrtest::MountedTmpfs small(d / "small", "6m");
  if (!small) DVR_SKIP("cannot mount a small tmpfs here: " << small.error());
  Store a = Store::open(d / "a"), b = Store::open(d / "small/b");
  Big big(4096);  // 16 MiB of random pages into 6 MiB
  big.snapshot(a, "v0");
  const int threads = settled_thread_count();
  auto r = duplex([&](int in, int out) { transfer::send_negotiated(a, "big/v0", in, out, {.compress = transfer::Compress::none}); },
                  [&](int in, int out) { transfer::receive_negotiated(b, in, out); });
  CHECK(r.received.code == Errc::no_space);
  CHECK(r.sent.code == Errc::io);
  CHECK_THAT(r.sent.what, Catch::Contains("the receiver failed"));
  CHECK(b.list("big").empty());
  CHECK(settled_thread_count(threads) == threads);
}

TEST_CASE("pipeline: a receiver that closes its end at once makes the sender fail, not hang", "[transfer][pipeline]") {
  TempDir d;
  Store a = Store::open(d / "a");
  Big big(4096);
  big.snapshot(a, "v0");
  const int threads = settled_thread_count();
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  ::close(p[0]);
  block_sigpipe();
  auto c = catch_error([&] { transfer::send(a, "big/v0", p[1]); });
  ::close(p[1]);
  CHECK(c.code == Errc::io);
  CHECK_THAT(c.what, Catch::Contains("closed the connection"));
  CHECK(settled_thread_count(threads) == threads);
}
