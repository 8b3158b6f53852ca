// Signed streams (dvr/transfer.hpp: SigningKey, VerifyKey, Options::sign_with,
// ReceiveOptions::require_signature; docs/format.md, "Stream format"):
// key files (written, read back, never overwritten, a secret key others can
// read refused), round trips through a file, a pipe and a negotiated
// transfer, an incremental stream, and every way a receiver that requires a
// signature refuses a stream: unsigned, stripped of its signature, signed by
// another key, altered after signing with every checksum recomputed, or
// carrying another stream's signature. Nothing refused is ever visible in
// the store, and gc gives back the space its chunks were read into.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "base/hash.hpp"
#include "dvr/transfer.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

using Bytes = std::vector<unsigned char>;

constexpr std::size_t kHeader = 16;
constexpr std::size_t kSignatureBytes = 8 + 100 + 8;  // kind, length; u32 algorithm, key, signature; XXH3-64

struct Data {
  Bytes owned = dvrtest::random_bytes((2u << 20) + 777, 11);
  Bytes zero = Bytes(1u << 20, 0);
};

void snapshot(Store& store, const Data& d, const std::string& name) {
  Bytes z = d.zero;
  Session s(store, "s");
  auto& r = s.alloc("owned", d.owned.size());
  std::memcpy(r.data(), d.owned.data(), d.owned.size());
  s.track("zero", z.data(), z.size());
  s.snapshot(name);
}

// "" when s/NAME of `store` restores to `d`, else where it differs.
std::string restored_diff(Store& store, const std::string& name, const Data& d) {
  Bytes zero(d.zero.size(), 0x55);
  Session s(store, "s");
  auto& r = s.alloc("owned", d.owned.size());
  s.track("zero", zero.data(), zero.size());
  s.restore(name);
  if (auto x = dvrtest::diff(r.data(), d.owned.data(), d.owned.size()); !x.empty()) return "owned: " + x;
  if (auto x = dvrtest::diff(zero, d.zero); !x.empty()) return "zero: " + x;
  return "";
}

std::string stream_of(const Store& store, const std::string& ref, const transfer::Options& o = {}) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::send(store, ref, fd, o);
  off_t n = ::lseek(fd, 0, SEEK_END);
  std::string s(static_cast<std::size_t>(n), '\0');
  REQUIRE(::pread(fd, s.data(), s.size(), 0) == n);
  ::close(fd);
  return s;
}

transfer::Stats receive_file(Store& store, const std::string& bytes, const transfer::ReceiveOptions& o = {}) {
  int fd = ::memfd_create("stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  return transfer::receive(store, fd, o);
}

void block_sigpipe() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
}

// send | receive through a pipe, the sender on another thread.
transfer::Stats send_receive_pipe(const Store& from, const std::string& ref, const transfer::Options& so, Store& to, const transfer::ReceiveOptions& ro,
                                  transfer::Stats* sent = nullptr) {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  std::exception_ptr send_error;
  std::thread sender([&] {
    block_sigpipe();
    try {
      auto st = transfer::send(from, ref, p[1], so);
      if (sent) *sent = st;
    } catch (...) {
      send_error = std::current_exception();
    }
    ::close(p[1]);
  });
  struct Join {
    std::thread& t;
    int fd;
    ~Join() {
      ::close(fd);
      t.join();
    }
  } join{sender, p[0]};
  return transfer::receive(to, p[0], ro);
}

// push: send_negotiated | receive_negotiated over two pipes.
transfer::Stats negotiated(const Store& from, const std::string& ref, const transfer::Options& so, Store& to, const transfer::ReceiveOptions& ro) {
  int up[2], down[2];
  REQUIRE(::pipe2(up, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(down, O_CLOEXEC) == 0);
  std::exception_ptr recv_error;
  transfer::Stats got;
  std::thread receiver([&] {
    block_sigpipe();
    try {
      got = transfer::receive_negotiated(to, up[0], down[1], ro);
    } catch (...) {
      recv_error = std::current_exception();
    }
    ::close(up[0]);
    ::close(down[1]);
  });
  block_sigpipe();
  std::exception_ptr send_error;
  try {
    transfer::send_negotiated(from, ref, down[0], up[1], so);
  } catch (...) {
    send_error = std::current_exception();
  }
  ::close(up[1]);
  ::close(down[0]);
  receiver.join();
  if (recv_error) std::rethrow_exception(recv_error);
  if (send_error) std::rethrow_exception(send_error);
  return got;
}

std::uint32_t get_u32(const std::string& s, std::size_t at) {
  std::uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

// The offsets of the stream's records: [u32 kind][u32 length][payload][u64].
std::vector<std::size_t> records(const std::string& s) {
  std::vector<std::size_t> at;
  for (std::size_t p = kHeader; p + 16 <= s.size(); p += 16 + get_u32(s, p + 4))
    at.push_back(p);
  return at;
}

// Recomputes the XXH3-64 of the record at `at` (what a forger does after editing it).
void reseal(std::string& s, std::size_t at) {
  const std::uint32_t n = get_u32(s, at + 4);
  const std::uint64_t h = detail::hash64(s.data() + at, 8 + n);
  std::memcpy(s.data() + at + 8 + n, &h, 8);
}

// What a refused receive must leave as it was: the listing and the manifests.
std::vector<std::string> listing(const Store& store) {
  std::vector<std::string> out;
  for (auto& i : store.list())
    out.push_back(i.session + "/" + i.name + " " + std::to_string(i.logical_bytes));
  if (dvrtest::fs::exists(store.path() + "/sessions"))
    for (auto& f : dvrtest::tree(store.path() + "/sessions"))
      out.push_back("file " + f);
  return out;
}

struct Keys {
  transfer::SigningKey alice = transfer::SigningKey::generate();
  transfer::SigningKey mallory = transfer::SigningKey::generate();
};

// A and B: A holds s/one; B holds other/resident (so that "as before" compares something).
struct Pair {
  TempDir dir;
  Store a = Store::open(dir / "a");
  Store b = Store::open(dir / "b");
  Data d;
  Pair() {
    snapshot(a, d, "one");
    Data r{dvrtest::random_bytes(300000, 5), Bytes(4096, 0)};
    Session s(b, "other");
    auto& x = s.alloc("owned", r.owned.size());
    std::memcpy(x.data(), r.owned.data(), r.owned.size());
    s.snapshot("resident");
  }

  // Receiving `bytes` into B with `ro` fails with `code` and a message
  // containing `says`; B lists and holds the same as before, and gc gives
  // back whatever pack space the refused stream's chunks were read into.
  void refused(const std::string& bytes, const transfer::ReceiveOptions& ro, Errc code, const std::string& says, const std::string& context) {
    INFO(context);
    b.gc();
    const auto before = listing(b);
    const std::uint64_t space = b.stats().pack_bytes;
    auto c = catch_error([&] { receive_file(b, bytes, ro); });
    INFO(c.what);
    CHECK(c.code == code);
    CHECK_THAT(c.what, Catch::Contains(says));
    CHECK_THAT(c.what, Catch::Contains("nothing was stored"));
    CHECK(listing(b) == before);
    b.gc();
    CHECK(b.stats().pack_bytes <= space);
    CHECK(b.verify().ok());
  }
};

transfer::ReceiveOptions requiring(const transfer::VerifyKey& k) {
  transfer::ReceiveOptions ro;
  ro.require_signature = {k};
  return ro;
}

transfer::Options signed_by(const transfer::SigningKey& k) {
  transfer::Options o;
  o.sign_with = k;
  return o;
}

}  // namespace

TEST_CASE("sign: key files are written once, read back, and a secret key others can read is refused", "[sign]") {
  TempDir dir;
  const std::string prefix = dir / "alice";
  transfer::SigningKey k = transfer::SigningKey::generate();
  k.save(prefix);
  CHECK(dvrtest::mode_of(prefix + ".key") == 0600);
  CHECK(dvrtest::mode_of(prefix + ".pub") == 0644);
  const std::string pub = dvrtest::read_file(prefix + ".pub"), key = dvrtest::read_file(prefix + ".key");
  CHECK(pub.rfind("dvr ed25519 public key v1\n", 0) == 0);
  CHECK(key.rfind("dvr ed25519 secret key v1\n", 0) == 0);
  CHECK_THAT(pub, Catch::Contains(k.fingerprint()));
  REQUIRE(k.fingerprint().size() == 8 + 32);
  CHECK(k.fingerprint().rfind("ed25519:", 0) == 0);

  // Read back: the same key (its signatures verify with the public file).
  transfer::SigningKey again = transfer::SigningKey::load(prefix + ".key");
  transfer::VerifyKey vk = transfer::VerifyKey::load(prefix + ".pub");
  CHECK(again.public_key() == k.public_key());
  CHECK(vk == k.public_key());
  const std::string msg = "a message";
  auto sig = again.sign(msg.data(), msg.size());
  CHECK(vk.verify(msg.data(), msg.size(), sig));
  sig[5] ^= 1;
  CHECK_FALSE(vk.verify(msg.data(), msg.size(), sig));
  CHECK(transfer::VerifyKey::parse(vk.to_text()) == vk);

  // Never overwritten: either file existing refuses the whole save.
  auto e = catch_error([&] { transfer::SigningKey::generate().save(prefix); });
  CHECK(e.code == Errc::already_exists);
  CHECK_THAT(e.what, Catch::Contains(prefix + ".key"));
  CHECK(dvrtest::read_file(prefix + ".key") == key);
  dvrtest::write_file(dir / "half.pub", "x");
  e = catch_error([&] { transfer::SigningKey::generate().save(dir / "half"); });
  CHECK(e.code == Errc::already_exists);
  CHECK_FALSE(dvrtest::fs::exists(dir / "half.key"));
  CHECK(dvrtest::tree(dir.path()) == std::vector<std::string>{"alice.key", "alice.pub", "half.pub"});

  // A secret key that others may read is refused, naming the fix.
  ::chmod((prefix + ".key").c_str(), 0640);
  e = catch_error([&] { transfer::SigningKey::load(prefix + ".key"); });
  CHECK(e.code == Errc::permission);
  CHECK_THAT(e.what, Catch::Contains("chmod 600 " + prefix + ".key"));
  ::chmod((prefix + ".key").c_str(), 0600);

  // The wrong kind of file, or not a key file: named, with what to give.
  e = catch_error([&] { transfer::SigningKey::load(prefix + ".pub"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("public key file"));
  e = catch_error([&] { transfer::VerifyKey::load(prefix + ".key"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("PREFIX.pub"));
  dvrtest::write_file(dir / "junk", "hello\n");
  e = catch_error([&] { transfer::VerifyKey::load(dir / "junk"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains("dvr keygen"));
  dvrtest::write_file(dir / "bad.pub", "dvr ed25519 public key v1\nAAAA\n");
  e = catch_error([&] { transfer::VerifyKey::load(dir / "bad.pub"); });
  CHECK(e.code == Errc::corrupt);
  CHECK(catch_error([&] { transfer::VerifyKey::load(dir / "nosuch.pub"); }).code == Errc::not_found);
}

TEST_CASE("sign: a signed stream is received through a file, a pipe and a negotiated transfer, bit-exact", "[sign]") {
  Keys k;
  Pair t;
  transfer::Stats sent;
  SECTION("a file, required key") {
    const std::string s = stream_of(t.a, "s/one", signed_by(k.alice));
    auto got = receive_file(t.b, s, requiring(k.alice.public_key()));
    CHECK(got.signed_by == k.alice.fingerprint());
    CHECK(got.wire_bytes == s.size());
  }
  SECTION("a file, any of several keys") {
    transfer::ReceiveOptions ro;
    ro.require_signature = {k.mallory.public_key(), k.alice.public_key()};
    CHECK(receive_file(t.b, stream_of(t.a, "s/one", signed_by(k.alice)), ro).signed_by == k.alice.fingerprint());
  }
  SECTION("a file, to a receiver that requires nothing") {
    CHECK(receive_file(t.b, stream_of(t.a, "s/one", signed_by(k.alice))).signed_by == k.alice.fingerprint());
  }
  SECTION("a pipe") {
    auto got = send_receive_pipe(t.a, "s/one", signed_by(k.alice), t.b, requiring(k.alice.public_key()), &sent);
    CHECK(got.signed_by == k.alice.fingerprint());
    CHECK(sent.signed_by == k.alice.fingerprint());
    CHECK(got.wire_bytes == sent.wire_bytes);
  }
  SECTION("a negotiated transfer (push, pull)") {
    CHECK(negotiated(t.a, "s/one", signed_by(k.alice), t.b, requiring(k.alice.public_key())).signed_by == k.alice.fingerprint());
  }
  CHECK(restored_diff(t.b, "one", t.d) == "");
  CHECK(t.b.verify().ok());
}

TEST_CASE("sign: what an older receiver reads of a signed stream is the unsigned stream", "[sign]") {
  // Receivers before signatures ignore the header's flags and stop reading
  // at the stream-end record: they read exactly the unsigned stream's
  // records, and never the signature after them.
  Keys k;
  Pair t;
  const std::string plain = stream_of(t.a, "s/one");
  const std::string sig = stream_of(t.a, "s/one", signed_by(k.alice));
  REQUIRE(sig.size() == plain.size() + kSignatureBytes);
  CHECK(get_u32(plain, 12) == 0);
  CHECK(get_u32(sig, 12) == 1);  // flags: signed
  CHECK(sig.compare(0, 12, plain, 0, 12) == 0);
  CHECK(sig.compare(kHeader, plain.size() - kHeader, plain, kHeader, plain.size() - kHeader) == 0);
  CHECK(get_u32(sig, plain.size()) == 9);  // the signature record
  // ... and this receiver, without the flag, stores it as such.
  std::string cut = sig.substr(0, plain.size());
  cut[12] = 0;
  CHECK(receive_file(t.b, cut).signed_by.empty());
  CHECK(restored_diff(t.b, "one", t.d) == "");
}

TEST_CASE("sign: an incremental stream is signed, and received against its base", "[sign]") {
  Keys k;
  Pair t;
  receive_file(t.b, stream_of(t.a, "s/one", signed_by(k.alice)), requiring(k.alice.public_key()));
  Data next = t.d;
  for (std::size_t page : {2u, 300u})
    next.owned[page * 4096 + 9] ^= 0x33;
  snapshot(t.a, next, "two");
  transfer::Options o = signed_by(k.alice);
  o.base = "one";
  const std::string full = stream_of(t.a, "s/two", signed_by(k.alice));
  const std::string delta = stream_of(t.a, "s/two", o);
  CHECK(delta.size() * 10 < full.size());
  auto got = receive_file(t.b, delta, requiring(k.alice.public_key()));
  CHECK(got.base == "one");
  CHECK(got.signed_by == k.alice.fingerprint());
  CHECK(restored_diff(t.b, "two", next) == "");
  CHECK(restored_diff(t.b, "one", t.d) == "");
  // The same delta, altered: refused against the base too.
  std::string bad = delta;
  bad[bad.size() - kSignatureBytes - 30] ^= 1;
  t.b.remove("s", "two");
  t.refused(bad, requiring(k.alice.public_key()), Errc::corrupt, "", "an incremental stream with a flipped byte");
}

TEST_CASE("sign: a receiver that requires a signature refuses every other stream, and nothing becomes visible", "[sign]") {
  Keys k;
  Pair t;
  const auto alice = requiring(k.alice.public_key());
  const std::string good = stream_of(t.a, "s/one", signed_by(k.alice));
  const std::vector<std::size_t> at = records(good);
  REQUIRE(at.size() > 4);
  REQUIRE(get_u32(good, at.back()) == 9);

  t.refused(stream_of(t.a, "s/one"), alice, Errc::permission, "not signed", "an unsigned stream");
  // The signature stripped (flag cleared, record cut off): an unsigned stream.
  std::string stripped = good.substr(0, at.back());
  stripped[12] = 0;
  t.refused(stripped, alice, Errc::permission, "not signed", "the signature stripped");
  // The flag kept, the signature record cut off: truncated.
  t.refused(good.substr(0, at.back()), alice, Errc::corrupt, "", "the signature record cut off");
  t.refused(good.substr(0, good.size() - 1), alice, Errc::corrupt, "", "the signature record cut short");

  t.refused(stream_of(t.a, "s/one", signed_by(k.mallory)), alice, Errc::permission, k.mallory.fingerprint(), "signed by another key");

  // A byte flipped in the middle: refused (here the record's checksum finds it first).
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  t.refused(flipped, alice, Errc::corrupt, "", "a byte flipped in the middle");

  // Altered after signing, with every checksum recomputed: the snapshot's
  // name changed in its record (it would be published as s/evl): only the
  // signature tells.
  std::string renamed = good;
  const std::size_t snap = at.front();
  REQUIRE(get_u32(renamed, snap) == 1);  // the snapshot record: str session, str name
  const std::size_t name_at = snap + 8 + 4 + get_u32(renamed, snap + 8) + 4;
  REQUIRE(renamed.compare(name_at, 3, "one") == 0);
  renamed.replace(name_at, 3, "evl");
  reseal(renamed, snap);
  t.refused(renamed, alice, Errc::corrupt, "fails its signature by key " + k.alice.fingerprint(), "renamed, checksums recomputed");
  // ... and also by a receiver that requires nothing (a signature that does not verify is damage).
  t.refused(renamed, {}, Errc::corrupt, "fails its signature", "renamed, to a receiver that requires nothing");

  // Another stream's signature (a valid one, by the right key) on this stream.
  Data other = t.d;
  other.owned[5] ^= 1;
  snapshot(t.a, other, "evl");
  const std::string theirs = stream_of(t.a, "s/evl", signed_by(k.alice));
  std::string spliced = renamed.substr(0, at.back()) + theirs.substr(theirs.size() - kSignatureBytes);
  t.refused(spliced, alice, Errc::corrupt, "fails its signature", "another stream's signature");

  // A signed stream through a pipe, altered: refused as from a file.
  {
    const auto before = listing(t.b);
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    std::thread w([&] {
      block_sigpipe();
      const char* d = renamed.data();
      std::size_t n = renamed.size();
      while (n) {
        ssize_t x = ::write(p[1], d, n);
        if (x <= 0) break;
        d += x;
        n -= static_cast<std::size_t>(x);
      }
      ::close(p[1]);
    });
    auto c = catch_error([&] { transfer::receive(t.b, p[0], alice); });
    ::close(p[0]);
    w.join();
    CHECK(c.code == Errc::corrupt);
    CHECK(listing(t.b) == before);
  }
  // A negotiated transfer signed by another key: refused on the receiving side.
  {
    const auto before = listing(t.b);
    auto c = catch_error([&] { negotiated(t.a, "s/one", signed_by(k.mallory), t.b, alice); });
    INFO(c.what);
    CHECK(c.code == Errc::permission);
    CHECK(listing(t.b) == before);
  }

  // After all that, the genuine stream is stored.
  CHECK(receive_file(t.b, good, alice).signed_by == k.alice.fingerprint());
  CHECK(restored_diff(t.b, "one", t.d) == "");
  CHECK(t.b.list("s").size() == 1);
}
