// Unit tests of opening stores: creation, modes, reopening, foreign and newer
// directories, ownership, medium detection, and two Store objects on one path.
#include <linux/magic.h>
#include <sys/statfs.h>

#include <filesystem>

#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvr::StoreOptions;
using dvrtest::catch_error;
using dvrtest::diff;
using dvrtest::mode_of;
using dvrtest::TempDir;

TEST_CASE("store: a new store is private (directory 0700, files 0600) and has a 4 KiB superblock", "[store]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  CHECK(store.path() == dir.store());
  CHECK(mode_of(dir.store()) == 0700);
  CHECK(mode_of(dir.store() + "/DVRSTORE") == 0600);
  CHECK(mode_of(dir.store() + "/lock") == 0600);
  CHECK(mode_of(dir.store() + "/sessions") == 0700);
  CHECK(mode_of(dir.store() + "/packs") == 0700);
  CHECK(mode_of(dir.store() + "/tmp") == 0700);
  std::string sb = dvrtest::read_file(dir.store() + "/DVRSTORE");
  CHECK(sb.size() == 4096);
  CHECK_THAT(sb, Catch::Contains("chunk_size 262144"));
  CHECK(store.chunk_size() == 262144);

  auto data = dvrtest::random_bytes(100000, 1);
  Session s(store, "sess");
  s.track("r", data.data(), data.size());
  s.snapshot("one");
  CHECK(mode_of(dir.store() + "/sessions/sess") == 0700);
  CHECK(mode_of(dvrtest::manifest_path(store, "sess", "one")) == 0600);
  auto packs = dvrtest::pack_files(store);
  REQUIRE_FALSE(packs.empty());
  for (auto& p : packs) {
    INFO(p);
    CHECK(mode_of(p) == 0600);
  }
  auto st = store.stats();
  CHECK(st.format_version == 1);
  CHECK(st.chunk_size == 262144);
  CHECK(st.sessions == 1);
  CHECK(st.snapshots == 1);
  CHECK(st.logical_bytes == 100000);
  CHECK(st.pack_files == packs.size());
}

TEST_CASE("store: reopening keeps the chunk size it was created with and the snapshots", "[store]") {
  TempDir dir;
  auto data = dvrtest::random_bytes(3 * 16384 + 17, 2);
  {
    Store store = Store::open(dir.store(), {.chunk_size = 16384, .create = true});
    CHECK(store.chunk_size() == 16384);
    Session s(store, "sess");
    s.track("r", data.data(), data.size());
    auto info = s.snapshot("one");
    CHECK(info.chunks == 4);
  }
  Store again = Store::open(dir.store());  // default options ask for 256 KiB
  CHECK(again.chunk_size() == 16384);
  Store again2 = Store::open(dir.store(), {.chunk_size = 1u << 20, .create = false});
  CHECK(again2.chunk_size() == 16384);
  std::vector<unsigned char> live(data.size(), 0xEE);
  Session s(again, "sess");
  s.track("r", live.data(), live.size());
  s.restore("one");
  CHECK(diff(live.data(), data.data(), data.size()) == "");
  auto info = again.info("sess", "one");
  CHECK(info.chunks == 4);
  CHECK(info.logical_bytes == data.size());
}

TEST_CASE("store: chunk sizes that are not powers of two in [4 KiB, 16 MiB] are refused", "[store]") {
  for (std::uint32_t cs : {0u, 1000u, 2048u, 3u * 4096u, 32u << 20}) {
    TempDir dir;
    INFO("chunk size " << cs);
    auto e = catch_error([&] { Store::open(dir.store(), {.chunk_size = cs, .create = true}); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains(std::to_string(cs)));
  }
  for (std::uint32_t cs : {4096u, 16u << 20}) {
    TempDir dir;
    CHECK(Store::open(dir.store(), {.chunk_size = cs, .create = true}).chunk_size() == cs);
  }
}

TEST_CASE("store: an empty existing directory becomes a store, and a trailing slash is ignored", "[store]") {
  TempDir dir;
  REQUIRE(::mkdir(dir.store().c_str(), 0700) == 0);
  Store a = Store::open(dir.store() + "/");
  CHECK(a.path() == dir.store());
  Store b = Store::open(dir.store());
  CHECK(b.chunk_size() == a.chunk_size());
}

TEST_CASE("store: a relative path is made absolute from the working directory at open", "[store]") {
  TempDir dir;
  struct Cwd {  // back to where the test was, however it ends
    std::string old = std::filesystem::current_path().string();
    ~Cwd() { std::filesystem::current_path(old); }
  } cwd;
  std::filesystem::current_path(dir.path());
  auto data = dvrtest::random_bytes(5000, 4);
  std::string path;
  {
    Store a = Store::open("store//");
    path = a.path();
    Session s(a, "s");
    s.track("r", data.data(), data.size());
    s.snapshot("one");
  }
  std::filesystem::current_path("/");
  CHECK(path == dir.store());  // what CRIU, its plugin and the heap shim can open from anywhere
  Store b = Store::open(dir.store());
  REQUIRE(b.list("s").size() == 1);
  CHECK(b.list("s")[0].name == "one");
}

TEST_CASE("store: a non-empty directory that is not a store is refused with invalid_argument", "[store]") {
  TempDir dir;
  REQUIRE(::mkdir(dir.store().c_str(), 0700) == 0);
  dvrtest::write_file(dir.store() + "/notes.txt", "my precious data");
  auto e = catch_error([&] { Store::open(dir.store()); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains(dir.store()));
  CHECK(dvrtest::read_file(dir.store() + "/notes.txt") == "my precious data");

  // A file where the store should be.
  dvrtest::write_file(dir / "plainfile", "x");
  e = catch_error([&] { Store::open(dir / "plainfile"); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("plainfile"));
}

TEST_CASE("store: a failed open of a foreign directory leaves it exactly as it was", "[store][bug]") {
  // errors.hpp: "A call that throws has changed nothing the caller can see." A
  // mistyped --store pointing at, say, a home directory must not chmod it to
  // 0700 nor leave a "lock" file in it.
  TempDir dir;
  REQUIRE(::mkdir(dir.store().c_str(), 0755) == 0);
  REQUIRE(::chmod(dir.store().c_str(), 0755) == 0);
  dvrtest::write_file(dir.store() + "/notes.txt", "my precious data");
  auto before = dvrtest::tree(dir.store());
  auto e = catch_error([&] { Store::open(dir.store()); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK(dvrtest::tree(dir.store()) == before);
  CHECK(mode_of(dir.store()) == 0755);
}

TEST_CASE("store: a refused new store leaves nothing behind", "[store][bug]") {
  // A bad chunk size is refused, but only after the directory (and its lock
  // file) were created; "a call that throws has changed nothing".
  TempDir dir;
  auto e = catch_error([&] { Store::open(dir.store(), {.chunk_size = 1000, .create = true}); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK(dvrtest::tree(dir.path()) == std::vector<std::string>{});
  // create=false on an existing empty directory: not_found, and still empty.
  TempDir dir2;
  REQUIRE(::mkdir(dir2.store().c_str(), 0700) == 0);
  e = catch_error([&] { Store::open(dir2.store(), {.chunk_size = 64 * 1024, .create = false}); });
  CHECK(e.code == Errc::not_found);
  CHECK(dvrtest::tree(dir2.store()) == std::vector<std::string>{});
}

TEST_CASE("store: a store written by a newer format is unsupported and says to upgrade", "[store]") {
  TempDir dir;
  { Store::open(dir.store()); }
  std::string sb_path = dir.store() + "/DVRSTORE";
  std::string sb = dvrtest::read_file(sb_path);
  auto at = sb.find("format 1\n");
  REQUIRE(at != std::string::npos);
  sb.replace(at, 9, "format 99\n");
  sb.resize(4096, '\0');
  dvrtest::write_file(sb_path, sb);
  auto e = catch_error([&] { Store::open(dir.store()); });
  CHECK(e.code == Errc::unsupported);
  CHECK_THAT(e.what, Catch::Contains("upgrade", Catch::CaseSensitive::No));
  CHECK_THAT(e.what, Catch::Contains("99"));
  CHECK_THAT(e.what, Catch::Contains(dir.store()));
}

TEST_CASE("store: a damaged superblock is refused with a clear code", "[store]") {
  TempDir dir;
  { Store::open(dir.store()); }
  std::string sb_path = dir.store() + "/DVRSTORE";
  const std::string good = dvrtest::read_file(sb_path);
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string sb = good;
    auto at = sb.find(from);
    REQUIRE(at != std::string::npos);
    sb.replace(at, from.size(), to);
    sb.resize(4096, '\0');
    dvrtest::write_file(sb_path, sb);
  };
  SECTION("not a superblock at all") {
    dvrtest::write_file(sb_path, std::string(4096, 'x'));
    auto e = catch_error([&] { Store::open(dir.store()); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains("DVRSTORE"));
  }
  SECTION("no format line") {
    edit("format 1\n", "");
    CHECK(catch_error([&] { Store::open(dir.store()); }).code == Errc::corrupt);
  }
  SECTION("chunk size not a power of two") {
    edit("chunk_size 262144", "chunk_size 262145");
    auto e = catch_error([&] { Store::open(dir.store()); });
    CHECK(e.code == Errc::corrupt);
    CHECK_THAT(e.what, Catch::Contains("DVRSTORE"));
  }
  SECTION("uuid missing") {
    edit("uuid ", "uuix ");
    CHECK(catch_error([&] { Store::open(dir.store()); }).code == Errc::corrupt);
  }
}

TEST_CASE("store: open with create=false on a missing directory is not_found and creates nothing", "[store]") {
  TempDir dir;
  auto e = catch_error([&] { Store::open(dir.store(), {.chunk_size = 64 * 1024, .create = false}); });
  CHECK(e.code == Errc::not_found);
  CHECK_THAT(e.what, Catch::Contains(dir.store()));
  CHECK(dvrtest::tree(dir.path()).empty());
  // Also for a missing parent.
  e = catch_error([&] { Store::open(dir / "a/b/c", {.chunk_size = 64 * 1024, .create = false}); });
  CHECK(e.code == Errc::not_found);
  CHECK(dvrtest::tree(dir.path()).empty());
}

TEST_CASE("store: missing parent directories are created", "[store]") {
  TempDir dir;
  Store s = Store::open(dir / "x/y/store");
  CHECK(mode_of(dir / "x/y/store") == 0700);
  CHECK(s.path() == dir / "x/y/store");
}

TEST_CASE("store: a group/other-accessible store directory is tightened to 0700", "[store]") {
  TempDir dir;
  SECTION("new empty directory") {
    REQUIRE(::mkdir(dir.store().c_str(), 0755) == 0);
    REQUIRE(::chmod(dir.store().c_str(), 0755) == 0);
    Store::open(dir.store());
    CHECK(mode_of(dir.store()) == 0700);
  }
  SECTION("existing store") {
    { Store::open(dir.store()); }
    REQUIRE(::chmod(dir.store().c_str(), 0777) == 0);
    Store::open(dir.store());
    CHECK(mode_of(dir.store()) == 0700);
  }
}

TEST_CASE("store: a store owned by another user is refused with permission", "[store]") {
  if (::geteuid() != 0) DVR_SKIP("not root: cannot chown a store to another user");
  TempDir dir;
  { Store::open(dir.store()); }
  REQUIRE(::chown(dir.store().c_str(), 12345, 12345) == 0);
  auto e = catch_error([&] { Store::open(dir.store()); });
  CHECK(e.code == Errc::permission);
  CHECK_THAT(e.what, Catch::Contains(dir.store()));
  CHECK_THAT(e.what, Catch::Contains("12345"));
  // Also when the directory is new (empty) but someone else's.
  TempDir dir2;
  REQUIRE(::mkdir(dir2.store().c_str(), 0700) == 0);
  REQUIRE(::chown(dir2.store().c_str(), 12345, 12345) == 0);
  CHECK(catch_error([&] { Store::open(dir2.store()); }).code == Errc::permission);
  CHECK(dvrtest::tree(dir2.store()).empty());
}

TEST_CASE("store: medium is dram under /dev/shm and disk on a non-tmpfs /tmp", "[store]") {
  TempDir shm("/dev/shm");
  Store a = Store::open(shm.store());
  CHECK(a.medium() == dvr::Medium::dram);
  CHECK(std::string(dvr::medium_name(a.medium())) == "dram");
  CHECK(a.stats().medium == dvr::Medium::dram);

  TempDir tmp("/tmp");
  Store b = Store::open(tmp.store());
  struct statfs fs {};
  REQUIRE(::statfs("/tmp", &fs) == 0);
  bool tmpfs = static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC || static_cast<unsigned long>(fs.f_type) == RAMFS_MAGIC;
  if (tmpfs) {
    CHECK(b.medium() == dvr::Medium::dram);
  } else {
    // A DAX file system would say pmem; /tmp on an ordinary disk says disk.
    CHECK(b.medium() != dvr::Medium::dram);
    if (b.medium() != dvr::Medium::pmem) CHECK(std::string(dvr::medium_name(b.medium())) == "disk");
  }
  CHECK_FALSE(std::string(dvr::medium_name(b.medium())).empty());
  CHECK(std::string(dvr::medium_name(dvr::Medium::pmem)) == "pmem");
}

TEST_CASE("store: Store copies share one open store", "[store]") {
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = a;  // NOLINT: copy on purpose
  auto data = dvrtest::random_bytes(5000, 3);
  Session s(b, "sess");
  s.track("r", data.data(), data.size());
  s.snapshot("one");
  REQUIRE(a.list("sess").size() == 1);
  CHECK(a.list("sess")[0].name == "one");
}

TEST_CASE("store: two Store objects on one path see, restore and dedup each other's snapshots", "[store]") {
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  const std::size_t cs = a.chunk_size();
  auto data = dvrtest::random_bytes(8 * cs + 100, 4);

  Session sa(a, "alpha");
  sa.track("r", data.data(), data.size());
  auto i1 = sa.snapshot("one");
  CHECK(i1.stored_bytes >= data.size());

  // b sees it, restores it, and dedups against it.
  REQUIRE(b.sessions() == std::vector<std::string>{"alpha"});
  std::vector<unsigned char> live(data.size(), 0);
  Session sb(b, "beta");
  sb.track("r", live.data(), live.size());
  Session sb_alpha(b, "alpha");
  sb_alpha.track("r", live.data(), live.size());
  sb_alpha.restore("one");
  CHECK(diff(live.data(), data.data(), data.size()) == "");
  auto i2 = sb.snapshot("copy");
  CHECK(i2.stored_bytes == 0);

  // New data written through b is restorable through a, and the other way round.
  std::vector<unsigned char> more = dvrtest::random_bytes(data.size(), 5);
  std::memcpy(live.data(), more.data(), more.size());
  auto i3 = sb.snapshot("more");
  CHECK(i3.stored_bytes >= more.size());
  std::fill(data.begin(), data.end(), 0x11);
  Session sa_beta(a, "beta");
  sa_beta.track("r", data.data(), data.size());
  sa_beta.restore("more");
  CHECK(diff(data.data(), more.data(), more.size()) == "");
  // a dedups against what b wrote.
  CHECK(sa_beta.snapshot("more-again").stored_bytes == 0);
  CHECK(a.list().size() == 4);
  CHECK(b.list().size() == 4);
  CHECK(a.verify().ok());
}

TEST_CASE("store: a snapshot replaced while another Store object reads it keeps its space until that read is done", "[store][replace]") {
  // Two Store objects stand for two processes (each has its own lock files
  // open). A reader (restore, send, verify) holds the shared lock; a replace
  // does not wait for it (a removal does), so the replaced version's space
  // must not be reused while that reader may still read it. The reader here
  // is a send into a channel nobody takes from yet: it stops after its
  // queue's worth (16 MiB) of the 64 MiB, holding the lock.
  TempDir dir;
  const std::size_t size = 64u << 20;
  auto old_a = dvrtest::random_bytes(size, 21);
  {
    Store s = Store::open(dir.store());
    Session first(s, "s");
    first.track("r", old_a.data(), old_a.size());
    first.snapshot("a");
  }
  Store reader = Store::open(dir.store());
  Store writer = Store::open(dir.store());
  dvr::transfer::Channel ch(64 << 10);
  std::exception_ptr send_error;
  std::thread sender = dvrtest::send_on_thread(reader, "s/a", ch, send_error);
  std::string head;
  REQUIRE(ch.take(head));  // the sender has begun: it holds the lock and read "a"'s manifest
  std::string stream = head;

  // "a" is replaced and as much new data written, which would land in the
  // old "a"'s space if it were free.
  auto other = dvrtest::random_bytes(4096, 22);
  Session replacing(writer, "s");
  replacing.track("r", other.data(), other.size());
  replacing.snapshot("a", {.replace = true});
  auto fresh = dvrtest::random_bytes(size, 23);
  Session filling(writer, "w");
  filling.track("big", fresh.data(), fresh.size());
  filling.snapshot("c");

  for (std::string buf; ch.take(buf);)
    stream += buf;
  sender.join();
  if (send_error) std::rethrow_exception(send_error);
  // What was sent is the old "a", whole.
  TempDir elsewhere;
  Store copy = Store::open(elsewhere.store());
  dvr::transfer::Channel in;
  in.put(std::move(stream));
  in.close();
  dvr::transfer::receive(copy, in);
  std::vector<unsigned char> live(size, 0x33);
  Session check(copy, "s");
  check.track("r", live.data(), live.size());
  check.restore("a");
  CHECK(diff(live.data(), old_a.data(), size) == "");
  CHECK(reader.info("s", "a").logical_bytes == other.size());

  // Once no reader is left, the replaced version's space is reused: a
  // snapshot of as much new data does not grow the packs by its size.
  const std::uint64_t before = writer.stats().pack_bytes;
  auto more = dvrtest::random_bytes(size, 24);
  std::memcpy(fresh.data(), more.data(), size);
  filling.snapshot("d");
  const std::uint64_t after = writer.stats().pack_bytes;
  CHECK(after < before + size / 2);
  std::vector<unsigned char> back(size, 0);
  Session verify_w(reader, "w");
  verify_w.track("big", back.data(), back.size());
  verify_w.restore("d");
  CHECK(diff(back.data(), more.data(), size) == "");
  CHECK(reader.verify().ok());
}

TEST_CASE("store: data freed by gc in one Store object is not reused by another's dedup index", "[store][gc]") {
  TempDir dir;
  Store a = Store::open(dir.store());
  Store b = Store::open(dir.store());
  auto x = dvrtest::random_bytes(6 * a.chunk_size(), 6);
  auto y = dvrtest::random_bytes(6 * a.chunk_size(), 7);

  // b learns the chunks of x (its index now points at them).
  Session sb(b, "s");
  sb.track("r", x.data(), x.size());
  sb.snapshot("x1");
  // a removes every snapshot of x and reclaims the space; then fills it with y.
  a.remove("s", "x1");
  auto gc = a.gc();
  CHECK(gc.bytes_after < gc.bytes_before);
  Session sa(a, "t");
  sa.track("r", y.data(), y.size());
  sa.snapshot("y1");
  // b snapshots x again: it must store x anew, not point at freed space.
  auto info = sb.snapshot("x2");
  CHECK(info.stored_bytes >= x.size());
  std::vector<unsigned char> live(x.size(), 0);
  Session check(a, "s");
  check.track("r", live.data(), live.size());
  check.restore("x2");
  CHECK(diff(live.data(), x.data(), x.size()) == "");
  Session check_y(b, "t");
  check_y.track("r", live.data(), live.size());
  check_y.restore("y1");
  CHECK(diff(live.data(), y.data(), y.size()) == "");
  CHECK(a.verify().ok());
  CHECK(b.verify().ok());
}

TEST_CASE("store: sessions() lists sessions with snapshots, sorted, and list() covers all of them", "[store]") {
  TempDir dir;
  Store store = Store::open(dir.store());
  CHECK(store.sessions().empty());
  CHECK(store.list().empty());
  CHECK(store.list("nobody").empty());
  auto data = dvrtest::random_bytes(1000, 8);
  for (std::string name : {"zeta", "alpha", "mid"}) {
    Session s(store, name);
    s.track("r", data.data(), data.size());
    s.snapshot("a");
    s.snapshot("b");
  }
  Session empty(store, "empty");  // no snapshot: not listed
  empty.track("r", data.data(), data.size());
  CHECK(store.sessions() == std::vector<std::string>{"alpha", "mid", "zeta"});
  auto all = store.list();
  REQUIRE(all.size() == 6);
  std::set<std::string> seen;
  for (auto& i : all)
    seen.insert(i.session + "/" + i.name);
  CHECK(seen == std::set<std::string>{"alpha/a", "alpha/b", "mid/a", "mid/b", "zeta/a", "zeta/b"});
  CHECK(empty.list().empty());
}
