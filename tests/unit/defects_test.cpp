// Regression tests for the smaller defects of issue 20: pack headers checked,
// a superblock cut short refused, parse_pagemap's overlap check without
// wrapping, a failed import leaving the page hash files as they were, loosened
// permissions reported, SIGBUS on mapped pack reads turned into errors naming
// the pack, and stream receivers bounding what a stream makes them allocate.
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/codec.hpp"
#include "base/hash.hpp"
#include "base/os.hpp"
#include "base/sigbus.hpp"
#include "dvr/transfer.hpp"
#include "format/chunks.hpp"
#include "format/pack.hpp"
#include "proc/proc_pages.hpp"
#include "store/store_impl.hpp"
#include "test_support.hpp"
#include "transfer/stream.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;
namespace procpages = dvr::detail::procpages;

namespace {

// A store holding session "s", snapshot "a": `size` bytes of random data.
std::vector<unsigned char> snapshot_random(Store& store, std::size_t size, std::uint64_t seed, const std::string& session = "s",
                                           const std::string& name = "a") {
  std::vector<unsigned char> buf(size);
  dvrtest::fill_random(buf.data(), buf.size(), seed);
  Session s(store, session);
  s.track("data", buf.data(), buf.size());
  s.snapshot(name);
  return buf;
}

void patch_u32(const std::string& path, std::uint64_t offset, std::uint32_t v) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, &v, 4, static_cast<off_t>(offset)) == 4);
  ::close(fd);
}

std::string all_hash_files(const std::string& store) {
  std::string out;
  for (auto& e : std::filesystem::directory_iterator(store + "/packs"))
    if (e.path().extension() == ".hash") out += e.path().filename().string() + ":" + dvrtest::read_file(e.path().string());
  return out;
}

}  // namespace

// ---- a. pack headers ----------------------------------------------------------

TEST_CASE("defects: a pack header claiming a newer version or another id is refused, naming the pack", "[defects][pack]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  snapshot_random(store, 1u << 20, 1);
  const std::string pack = dvrtest::pack_path(store, 1);
  SECTION("version 2") {
    patch_u32(pack, 8, 2);
    auto report = Store::open(dir.store()).verify();
    REQUIRE_FALSE(report.ok());
    CHECK_THAT(report.problems[0].what, Catch::Contains(pack) && Catch::Contains("version 2") && Catch::Contains("upgrade"));
    std::vector<unsigned char> buf(1u << 20);
    Session s(Store::open(dir.store()), "s");
    s.track("data", buf.data(), buf.size());
    auto e = catch_error([&] { s.restore("a"); });
    CHECK(e.code == Errc::unsupported);
    CHECK_THAT(e.what, Catch::Contains(pack));
  }
  SECTION("version 0") {
    patch_u32(pack, 8, 0);
    auto report = Store::open(dir.store()).verify();
    REQUIRE_FALSE(report.ok());
    CHECK_THAT(report.problems[0].what, Catch::Contains(pack) && Catch::Contains("no pack format version"));
  }
  SECTION("another pack's id") {
    patch_u32(pack, 12, 7);
    auto report = Store::open(dir.store()).verify();
    REQUIRE_FALSE(report.ok());
    CHECK_THAT(report.problems[0].what, Catch::Contains(pack) && Catch::Contains("pack 7") && Catch::Contains("dvr verify"));
    CHECK(report.damaged_snapshots() == std::vector<std::string>{"s/a"});
  }
}

// ---- b. superblock ------------------------------------------------------------

TEST_CASE("defects: a superblock cut to 80 or 4095 bytes, or grown past a page, is a corrupt superblock", "[defects][superblock]") {
  TempDir dir;
  { Store::open(dir.store()); }
  const std::string sb = dir.store() + "/DVRSTORE";
  const std::string whole = dvrtest::read_file(sb);
  REQUIRE(whole.size() == 4096);
  for (std::size_t size : {std::size_t{80}, std::size_t{4095}, std::size_t{4097}}) {
    INFO("size " << size);
    std::string text = whole;
    text.resize(size, '\0');
    dvrtest::write_file(sb, text);
    auto e = catch_error([&] { Store::open(dir.store()); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("corrupt superblock") && Catch::Contains(sb) && Catch::Contains(std::to_string(size) + " bytes"));
  }
  dvrtest::write_file(sb, whole);
  CHECK_NOTHROW(Store::open(dir.store()));
}

// ---- c. parse_pagemap -----------------------------------------------------------

TEST_CASE("defects: parse_pagemap refuses entries whose end wraps past 2^64, and what follows them out of order", "[defects][pagemap]") {
  auto parses = [](std::vector<procpages::Entry> entries) {
    procpages::Pagemap pm;
    pm.pages_id = 1;
    pm.entries = std::move(entries);
    std::string img = procpages::encode_pagemap(pm);
    procpages::Pagemap out;
    return procpages::parse_pagemap(img.data(), img.size(), out);
  };
  const std::uint64_t top = 0ull - 4096;  // the last page of the address space
  CHECK(parses({{0x1000, 2, true, procpages::kPePresent}, {0x10000, 1, true, procpages::kPePresent}}));
  CHECK(parses({{top, 1, true, procpages::kPePresent}}));                        // ends exactly at 2^64
  CHECK(parses({{0, 1, true, procpages::kPePresent}, {top, 1, true, procpages::kPePresent}}));
  CHECK_FALSE(parses({{top, 2, true, procpages::kPePresent}}));                  // wraps
  CHECK_FALSE(parses({{top - 4096, 1u << 20, true, procpages::kPePresent}}));    // wraps far
  // Before: vaddr + pages * 4096 wrapped to 4096, so this was accepted.
  CHECK_FALSE(parses({{top, 2, true, procpages::kPePresent}, {0x2000, 1, true, procpages::kPePresent}}));
  CHECK_FALSE(parses({{top, 1, true, procpages::kPePresent}, {0x2000, 1, true, procpages::kPePresent}}));  // out of order
  CHECK_FALSE(parses({{0x1000, 2, true, procpages::kPePresent}, {0x2000, 1, true, procpages::kPePresent}}));  // overlapping
}

// ---- d. a failed import leaves the page hash files as they were -------------------

TEST_CASE("defects: an import that fails with no_space leaves the page hash files byte for byte as before", "[defects][no_space]") {
  TempDir dir;
  Store target = Store::open(dir / "target");
  snapshot_random(target, 4u << 20, 1);
  Store source = Store::open(dir / "source");
  snapshot_random(source, 24u << 20, 2, "big", "b");
  const std::string file = dir / "big.dvr";
  {
    int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    transfer::send(source, "big/b", fd);
    ::close(fd);
  }
  const std::string before = all_hash_files(dir / "target");
  REQUIRE_FALSE(before.empty());
  dvrtest::Caught e;
  {
    dvrtest::FileSizeLimit limit(12u << 20);  // the pack cannot grow past 12 MiB: the import runs out of space midway
    int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    e = catch_error([&] { transfer::receive(target, fd); });
    ::close(fd);
  }
  REQUIRE(e.code == Errc::no_space);
  CHECK(all_hash_files(dir / "target") == before);
  CHECK(target.list("big").empty());
  CHECK(target.verify().ok());
  // And with room, the same import succeeds and is intact.
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  transfer::receive(target, fd);
  ::close(fd);
  CHECK(target.verify().ok());
}

// ---- e. loosened permissions ----------------------------------------------------------

TEST_CASE("defects: a store opened up to group and others is reported by open, verify and stats", "[defects][permissions]") {
  TempDir dir;
  {
    Store store = Store::open(dir.store());
    snapshot_random(store, 1u << 20, 1);
    CHECK(store.verify().warnings.empty());
    CHECK(store.stats().warnings.empty());
  }
  REQUIRE(::chmod(dir.store().c_str(), 0777) == 0);
  const std::string manifest = dir.store() + "/sessions/s/a.snap";
  REQUIRE(::chmod(manifest.c_str(), 0644) == 0);
  REQUIRE(::chmod((dir.store() + "/packs").c_str(), 0755) == 0);
  std::mutex mu;
  std::vector<std::string> logged;
  dvr::set_log_sink([&](LogLevel l, std::string_view m) {
    std::lock_guard<std::mutex> g(mu);
    if (l == LogLevel::warn) logged.emplace_back(m);
  });
  Store store = Store::open(dir.store());
  dvr::set_log_sink(nullptr);
  REQUIRE(logged.size() == 1);
  CHECK_THAT(logged[0], Catch::Contains(dir.store()) && Catch::Contains("0777") && Catch::Contains("0700"));
  CHECK(dvrtest::mode_of(dir.store()) == 0700);  // made private again, as before
  auto report = store.verify();
  CHECK(report.ok());  // not damage
  REQUIRE(report.warnings.size() == 3);
  CHECK(report.warnings[0] == logged[0]);
  CHECK_THAT(report.warnings[1], Catch::Contains("1 directory") && Catch::Contains(dir.store() + "/packs (mode 0755)"));
  CHECK_THAT(report.warnings[2], Catch::Contains("1 file") && Catch::Contains(manifest + " (mode 0644)") && Catch::Contains("chmod -R go="));
  CHECK(store.stats().warnings == report.warnings);
  // Made private again: only what open saw remains to say.
  REQUIRE(::chmod(manifest.c_str(), 0600) == 0);
  REQUIRE(::chmod((dir.store() + "/packs").c_str(), 0700) == 0);
  CHECK(store.verify().warnings == std::vector<std::string>{logged[0]});
  CHECK(Store::open(dir.store()).stats().warnings.empty());
}

// ---- f. SIGBUS on mapped pack reads ----------------------------------------------------

namespace {

// A real store's snapshot, its pack mapped through the store's Packs, then
// the pack truncated behind the mapping: every read of the chunks' data past
// the new end takes SIGBUS.
struct TruncatedWhileMapped {
  TempDir dir;
  Store store = Store::open(dir.store());
  std::vector<unsigned char> data = snapshot_random(store, 2u << 20, 9);
  detail::StoreImpl& si = detail::impl_of(store);
  detail::Manifest m = si.load_manifest("s", "a");
  std::string pack = dvrtest::pack_path(store, 1);
  TruncatedWhileMapped() {
    si.packs->refresh_mappings();
    for (std::size_t i = 0; i < m.chunks.size(); ++i)
      detail::map_chunk(*si.packs, detail::view_of(m, i));
    REQUIRE(::truncate(pack.c_str(), 8192) == 0);  // the header and one page left
  }
  // A chunk stored past what is left.
  std::size_t beyond() const {
    for (std::size_t i = 0; i < m.chunks.size(); ++i)
      if (m.chunks[i].pack && m.chunks[i].offset >= 8192) return i;
    FAIL("no chunk stored past the first page");
    return 0;
  }
};

void check_names_pack(const dvrtest::Caught& e, const std::string& pack) {
  CHECK((e.code == Errc::corrupt || e.code == Errc::io));
  CHECK_THAT(e.what, Catch::Contains(pack));
  CHECK_THAT(e.what, Catch::Contains("truncated") && Catch::Contains("SIGBUS"));
}

}  // namespace

TEST_CASE("defects: a pack truncated while mapped or open is a corrupt error naming it, for checks, copies and page hashes", "[defects][sigbus]") {
  TruncatedWhileMapped t;
  auto v = detail::view_of(t.m, t.beyond());
  check_names_pack(catch_error([&] { (void)detail::check_chunk(*t.si.packs, v); }), t.pack);
  // Copies read with pread (no SIGBUS): the file's end found early.
  std::vector<char> out(v.ref->length);
  for (auto& e : {catch_error([&] { detail::read_chunk(*t.si.packs, v, out.data(), "snapshot 's/a'"); }),
                  catch_error([&] { t.si.packs->copy(v.ref->pack, v.ref->offset, out.data(), out.size()); })}) {
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains(t.pack) && Catch::Contains("truncated while in use") && Catch::Contains("now ends at byte 8192"));
  }
  auto e = catch_error([&] { (void)detail::check_chunk(*t.si.packs, v); });
  CHECK(e.code == Errc::corrupt);
  // The process carries on: SIGBUS unblocked, later guarded reads work.
  detail::Packs fresh(t.dir.store() + "/packs", t.si.uuid);
  const char* page = fresh.read(1, detail::kPackHeaderSize, 4096);
  const std::string expect = dvrtest::read_file(t.pack).substr(detail::kPackHeaderSize, 4096);
  std::uint64_t h = 0;
  CHECK(detail::guarded(page, 4096, [&] { h = detail::page_hash(page, 4096); }));
  CHECK(h == detail::page_hash(expect.data(), 4096));
}

// pread is interposed here (the unit tests link libdvr's objects, so this
// definition is the one they call): while g_fail_pack_reads is set, a read
// of a .pack file fails with EIO, as a failing device's would.
namespace {
std::atomic<bool> g_fail_pack_reads{false};
}  // namespace

extern "C" ssize_t pread(int fd, void* buf, std::size_t len, off_t offset) {
  if (g_fail_pack_reads.load()) {
    char target[4096];
    const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
    if (n > 5 && std::string(target, static_cast<std::size_t>(n)).ends_with(".pack")) {
      errno = EIO;
      return -1;
    }
  }
  return static_cast<ssize_t>(::syscall(SYS_pread64, fd, buf, len, offset));
}

TEST_CASE("defects: a pack that cannot be read (EIO) fails a send with an io error naming it; nothing is left half-sent", "[defects]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = snapshot_random(store, 2u << 20, 11);
  const std::string pack = dvrtest::pack_path(store, 1);
  int fd = ::memfd_create("eio-stream", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  g_fail_pack_reads = true;
  auto e = catch_error([&] { transfer::send(store, "s/a", fd); });
  g_fail_pack_reads = false;
  CHECK(e.code == Errc::io);
  CHECK_THAT(e.what, Catch::Contains("cannot read pack file " + pack) && Catch::Contains("Input/output error") && Catch::Contains("dmesg"));
  // What was written of the stream is refused by a receiver.
  Store other = Store::open(dir / "other");
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  CHECK(catch_error([&] { transfer::receive(other, fd); }).threw_dvr());
  CHECK(other.list().empty());
  // The device back: the same send goes through, bit-exact.
  REQUIRE(::ftruncate(fd, 0) == 0);
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  transfer::send(store, "s/a", fd);
  REQUIRE(::lseek(fd, 0, SEEK_SET) == 0);
  transfer::receive(other, fd);
  ::close(fd);
  std::vector<unsigned char> back(data.size());
  Session s(other, "s");
  s.track("data", back.data(), back.size());
  s.restore("a");
  CHECK(dvrtest::diff(back, data) == "");
}

TEST_CASE("defects: verify and restore of a pack truncated behind their mappings report it, no crash", "[defects][sigbus]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  auto data = snapshot_random(store, 2u << 20, 5);
  const std::string pack = dvrtest::pack_path(store, 1);
  // Cut short between operations: each operation maps the pack afresh (its
  // size changed), so this is the "truncated" error of the mapping itself;
  // the SIGBUS of a cut under a live mapping is the test above (a public
  // operation gives no point in between to cut at without timing).
  REQUIRE(::truncate(pack.c_str(), 8192) == 0);
  auto report = store.verify();
  REQUIRE_FALSE(report.ok());
  CHECK_THAT(report.problems[0].what, Catch::Contains(pack));
  std::vector<unsigned char> buf(data.size());
  Session s(store, "s");
  s.track("data", buf.data(), buf.size());
  auto e = catch_error([&] { s.restore("a"); });
  CHECK(e.code == Errc::corrupt);
  CHECK_THAT(e.what, Catch::Contains(pack));
}

TEST_CASE("defects: a SIGBUS outside a guarded read still kills the process (the handler chains to the default)", "[defects][sigbus]") {
  TempDir dir;
  const std::string file = dir / "f";
  dvrtest::write_file(file, std::string(8192, 'x'));
  {
    // The library's handler is installed by the first guarded read.
    char probe = 0;
    CHECK(detail::guarded(&probe, 1, [&] { probe = 1; }));
  }
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int fd = ::open(file.c_str(), O_RDONLY);
    void* p = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED || ::ftruncate(::open(file.c_str(), O_WRONLY), 0) != 0) ::_exit(2);
    volatile char c = static_cast<volatile char*>(p)[4096];  // SIGBUS, not in any guarded range
    (void)c;
    ::_exit(0);  // survived: the handler swallowed it
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  if (dvrtest::kSanitizer) {
    // The sanitizer's handler was there first: it reports and exits non-zero
    // (ThreadSanitizer: "BUS on unknown address", then aborts).
    CHECK((WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 2)));
  } else {
    REQUIRE(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGBUS);
  }
}

namespace {
sigjmp_buf g_user_jump;
volatile sig_atomic_t g_user_handler_ran = 0;
void user_handler(int, siginfo_t*, void*) {
  g_user_handler_ran = 1;
  siglongjmp(g_user_jump, 1);
}
}  // namespace

// Run in a fresh process (the test below execs this binary for it): an
// application's SIGBUS handler installed before the library's still gets
// the faults that are not the library's.
TEST_CASE("defects child: a handler installed before the library's gets the other SIGBUSes", "[.][defects-sigbus-child]") {
  struct sigaction sa {};
  sa.sa_sigaction = user_handler;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  REQUIRE(::sigaction(SIGBUS, &sa, nullptr) == 0);
  TruncatedWhileMapped t;  // its guarded reads install the library's handler after ours
  auto v = detail::view_of(t.m, t.beyond());
  check_names_pack(catch_error([&] { (void)detail::check_chunk(*t.si.packs, v); }), t.pack);
  CHECK(g_user_handler_ran == 0);  // the library's own fault was not passed on
  const char* p = t.si.packs->mapped(v.ref->pack, v.ref->offset, v.ref->length);
  REQUIRE(p);
  if (sigsetjmp(g_user_jump, 1) == 0) {
    volatile char c = p[0];  // outside any guarded read
    (void)c;
  }
  CHECK(g_user_handler_ran == 1);
}

TEST_CASE("defects: an application's own SIGBUS handler still gets the SIGBUSes that are not the library's", "[defects][sigbus]") {
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int devnull = ::open("/dev/null", O_WRONLY);
    ::dup2(devnull, 1);
    ::execl("/proc/self/exe", "dvr-unit-tests", "[defects-sigbus-child]", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// ---- g. streams that claim more than they carry -----------------------------------------

namespace {

using namespace dvr::transfer::internal;

// A stream of one snapshot, session "z" name "zeros": one region of `size`
// bytes in chunks of `chunk`, every chunk a zero record (the first `records`
// of them; all when records == SIZE_MAX), and its end.
std::string zero_stream(std::uint64_t size, std::uint32_t chunk, std::uint64_t records = UINT64_MAX) {
  TempDir tmp;
  const std::string file = tmp / "s";
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  {
    RecordWriter w(fd);
    char head[16] = {};
    std::memcpy(head, kMagic, 8);
    std::memcpy(head + 8, &kVersion, 4);
    w.raw(head, 16);
    detail::Writer s;
    s.str("z");
    s.str("zeros");
    s.str("");
    s.str("");
    s.u64(0);
    s.u32(chunk);
    s.u8(1);
    s.u32(1);
    s.str("mem");
    s.u64(size);
    s.u8(0);
    s.str("");
    s.hash(detail::Hash128{});
    w.record(kSnapshot, s.out);
    const std::uint64_t chunks = (size + chunk - 1) / chunk;
    detail::Writer fp;
    fp.u32(chunk);
    fp.u8(1);
    fp.str("mem");
    fp.u64(size);
    for (std::uint64_t j = 0; j < chunks && j < records; ++j) {
      const std::uint32_t len = static_cast<std::uint32_t>(std::min<std::uint64_t>(chunk, size - j * chunk));
      std::vector<std::uint64_t> pages(detail::pages_in(len));
      for (std::size_t p = 0; p < pages.size(); ++p)
        pages[p] = detail::zero_page_hash(std::min<std::uint64_t>(4096, len - p * 4096));
      detail::Hash128 h = detail::tree_hash(pages.data(), pages.size());
      detail::Writer z;
      z.u32(0);
      z.u64(j);
      z.hash(h);
      z.u32(len);
      w.record(kZero, z.out);
      fp.hash(h);
    }
    detail::Writer end;
    end.hash(detail::hash128(fp.out.data(), fp.out.size()));
    end.u64(chunks);
    w.record(kSnapshotEnd, end.out);
    detail::Writer se;
    se.u32(1);
    w.record(kStreamEnd, se.out);
    w.finish();
  }
  ::close(fd);
  return dvrtest::read_file(file);
}

dvrtest::Caught receive_bytes(Store& store, const std::string& bytes, const transfer::ReceiveOptions& options = {}, bool as_pipe = false) {
  TempDir tmp;
  if (as_pipe) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::thread feed([&] {
      detail::write_all(fds[1], bytes.data(), bytes.size(), "pipe");
      ::close(fds[1]);
    });
    auto e = catch_error([&] { transfer::receive(store, fds[0], options); });
    ::close(fds[0]);
    feed.join();
    return e;
  }
  const std::string file = tmp / "in";
  dvrtest::write_file(file, bytes);
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  auto e = catch_error([&] { transfer::receive(store, fd, options); });
  ::close(fd);
  return e;
}

}  // namespace

TEST_CASE("defects: a stream of zero chunks is stored without hashing zero memory, and restores as zeros", "[defects][stream]") {
  TempDir dir;
  // Stream chunks of 1 MiB into a store of 64 KiB chunks (cut), and of 4 KiB
  // into one of 64 KiB (joined): zero chunks either way, the region ending
  // inside a chunk.
  for (std::uint32_t stream_chunk : {1u << 20, 4096u}) {
    INFO("stream chunk " << stream_chunk);
    Store store = Store::open(dir / ("st" + std::to_string(stream_chunk)), StoreOptions{.chunk_size = 64u << 10});
    const std::uint64_t size = (8u << 20) + 12288;
    auto e = receive_bytes(store, zero_stream(size, stream_chunk));
    REQUIRE(e.what == "(returned normally)");
    auto info = store.info("z", "zeros");
    CHECK(info.logical_bytes == size);
    CHECK(info.stored_bytes == 0);
    CHECK(store.verify().ok());
    std::vector<unsigned char> buf(size, 0xab);
    Session s(store, "z");
    s.track("mem", buf.data(), buf.size());
    s.restore("zeros");
    CHECK(std::all_of(buf.begin(), buf.end(), [](unsigned char c) { return c == 0; }));
  }
}

TEST_CASE("defects: a short stream claiming a huge snapshot is refused before the receiver allocates or hashes for it", "[defects][stream]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  const std::uint64_t huge = 1ull << 45;  // 32 TiB in 16 MiB chunks: 2 M chunks
  SECTION("from a file: it cannot carry the chunks it declares") {
    auto e = receive_bytes(store, zero_stream(huge, 16u << 20, 3));
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("declares 2097152 chunks") && Catch::Contains("bytes of the stream follow"));
  }
  SECTION("from a pipe: its manifest would not fit, or the caller's limit") {
    auto e = receive_bytes(store, zero_stream(huge, 16u << 20, 3), {}, true);
    CHECK(e.code == Errc::no_space);
    CHECK_THAT(e.what, Catch::Contains("nothing was stored"));
    transfer::ReceiveOptions o;
    o.max_logical_bytes = 32u << 20;
    auto l = receive_bytes(store, zero_stream(64u << 20, 16u << 20), o, true);
    CHECK(l.code == Errc::invalid_argument);
    CHECK_THAT(l.what, Catch::Contains("max_logical_bytes") && Catch::Contains("z/zeros"));
    o.max_logical_bytes = 64u << 20;
    CHECK(receive_bytes(store, zero_stream(64u << 20, 16u << 20), o, true).what == "(returned normally)");
  }
  CHECK(store.verify().ok());
}

TEST_CASE("defects: a write past the file-size limit is EFBIG inside a file-size guard, nested ones too, and the signal is left as it was",
          "[defects][no_space]") {
  // In a child: SIGXFSZ keeps its default action (it would kill the child).
  if (dvrtest::kThreadSanitizer)
    DVR_SKIP("built with ThreadSanitizer: its runtime blocks and holds signals around fork, so the child's signal mask and "
             "pending set are not the program's (the same steps in a program of their own built with it pass)");
  TempDir dir;
  const std::string path = dir / "f";
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    struct rlimit lim {};
    ::getrlimit(RLIMIT_FSIZE, &lim);
    lim.rlim_cur = 8192;
    if (fd < 0 || ::setrlimit(RLIMIT_FSIZE, &lim) != 0) ::_exit(10);
    char page[4096] = {1};
    int code = 0;
    {
      detail::FileSizeSignalGuard outer;
      {
        detail::FileSizeSignalGuard inner;  // nested: costs nothing, undoes nothing
        if (::pwrite(fd, page, sizeof page, 16384) != -1 || errno != EFBIG) code = 11;
      }
      // Still guarded after the inner guard is gone.
      if (::pwrite(fd, page, sizeof page, 32768) != -1 || errno != EFBIG) code = 12;
    }
    sigset_t now, pending;
    ::pthread_sigmask(SIG_BLOCK, nullptr, &now);
    ::sigpending(&pending);
    if (sigismember(&now, SIGXFSZ)) code = 13;      // unblocked again
    if (sigismember(&pending, SIGXFSZ)) code = 14;  // and the signals raised consumed
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("child status " << status);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
