// Unit tests of the C API (dvr/dvr.h): the calls round-trip data like the C++
// API, every failure is a status with the C++ API's message (and never an
// exception), NULL arguments are named, and dvr_errmsg is per thread.
#include "dvr/dvr.h"

#include <sys/mman.h>

#include <functional>
#include <new>
#include <stdexcept>
#include <thread>

#include "test_support.hpp"

using dvrtest::diff;
using dvrtest::TempDir;

namespace dvr::detail {
// Defined in c_api.cpp: the guard every C call runs its body in.
dvr_status c_call(const char* function, void (*body)(void*), void* context) noexcept;
}  // namespace dvr::detail

namespace Catch {
template <>
struct StringMaker<dvr_status> {
  static std::string convert(dvr_status s) {
    static const char* const names[] = {
        "DVR_OK",   "DVR_E_NOT_FOUND",   "DVR_E_ALREADY_EXISTS", "DVR_E_CORRUPT", "DVR_E_NO_SPACE", "DVR_E_INVALID_ARGUMENT",
        "DVR_E_IO", "DVR_E_UNSUPPORTED", "DVR_E_PERMISSION",     "DVR_E_NOMEM",   "DVR_E_INTERNAL",
        "DVR_E_CANCELLED"};
    auto i = static_cast<unsigned>(s);
    return i < std::size(names) ? names[i] : "dvr_status(" + std::to_string(i) + ")";
  }
};
}  // namespace Catch

namespace {

// A store and a session "sess" in a fresh directory, closed at the end.
struct CFixture {
  TempDir dir;
  dvr_store* store = nullptr;
  dvr_session* session = nullptr;
  CFixture() {
    REQUIRE(dvr_store_open(dir.store().c_str(), &store) == DVR_OK);
    REQUIRE(dvr_session_open(store, "sess", &session) == DVR_OK);
  }
  ~CFixture() {
    dvr_session_close(session);
    dvr_store_close(store);
  }
  CFixture(const CFixture&) = delete;
  CFixture& operator=(const CFixture&) = delete;
};

std::string errmsg() { return dvr_errmsg(); }

std::string latest_of(dvr_store* store, const char* session, dvr_status* status) {
  char buf[DVR_NAME_MAX + 1];
  std::memset(buf, 'x', sizeof buf);
  *status = dvr_latest(store, session, buf, sizeof buf);
  return buf;
}

}  // namespace

TEST_CASE("c api: track, snapshot and restore round-trip caller memory bit-exact", "[c_api]") {
  CFixture f;
  auto a = dvrtest::random_bytes(3 * 65536 + 123, 7100);
  auto b = dvrtest::random_bytes(4096, 7101);
  REQUIRE(dvr_track(f.session, "a", a.data(), a.size()) == DVR_OK);
  REQUIRE(dvr_track(f.session, "b", b.data(), b.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "one", "first") == DVR_OK);
  auto a1 = a, b1 = b;
  dvrtest::fill_random(a.data(), a.size(), 7102);
  dvrtest::fill_random(b.data(), b.size(), 7103);
  REQUIRE(dvr_snapshot(f.session, "two", nullptr) == DVR_OK);
  auto a2 = a, b2 = b;
  dvrtest::fill_random(a.data(), a.size(), 7104);

  REQUIRE(dvr_restore(f.session, "one") == DVR_OK);
  CHECK(diff(a, a1) == "");
  CHECK(diff(b, b1) == "");
  REQUIRE(dvr_restore(f.session, "two") == DVR_OK);
  CHECK(diff(a, a2) == "");
  CHECK(diff(b, b2) == "");

  // The C++ API sees the same snapshots.
  auto store = dvr::Store::open(f.dir.store());
  auto one = store.info("sess", "one");
  CHECK(one.label == "first");
  CHECK(one.logical_bytes == a.size() + b.size());
  CHECK(store.info("sess", "two").parent == "one");
  CHECK(store.info("sess", "two").label == "");
}

TEST_CASE("c api: a background snapshot is waited on, reports progress, and restores bit-exact", "[c_api][background]") {
  CFixture f;
  void* mem = nullptr;
  const std::size_t n = 16u << 20;
  REQUIRE(dvr_alloc(f.session, "a", n, &mem) == DVR_OK);
  dvrtest::fill_random(mem, n, 7300);
  std::vector<unsigned char> at_call(static_cast<unsigned char*>(mem), static_cast<unsigned char*>(mem) + n);
  dvr_snapshot_job* job = nullptr;
  REQUIRE(dvr_snapshot_background(f.session, "bg", "in the background", &job) == DVR_OK);
  REQUIRE(job != nullptr);
  INFO("note: " << dvr_snapshot_job_note(job));
  // Written right after the call: not in the snapshot.
  std::memset(mem, 0xEE, n / 2);
  CHECK(dvr_snapshot_job_wait(job) == DVR_OK);
  CHECK(dvr_snapshot_job_done(job) == 1);
  std::uint64_t done = 0, total = 0;
  dvr_snapshot_job_progress(job, &done, &total);
  CHECK(total == n);
  CHECK(done == total);
  CHECK(dvr_snapshot_job_stall(job) >= 0.0);
  if (dvr_snapshot_job_background(job)) CHECK(std::string(dvr_snapshot_job_note(job)).empty());
  dvr_snapshot_job_free(job);
  REQUIRE(dvr_restore(f.session, "bg") == DVR_OK);
  CHECK(diff(mem, at_call.data(), n) == "");

  job = reinterpret_cast<dvr_snapshot_job*>(1);
  CHECK(dvr_snapshot_background(f.session, "bg", nullptr, &job) == DVR_E_ALREADY_EXISTS);
  CHECK(job == nullptr);
  CHECK(errmsg().find("bg") != std::string::npos);
  CHECK(dvr_snapshot_background(f.session, "x", nullptr, nullptr) == DVR_E_INVALID_ARGUMENT);
  CHECK(dvr_snapshot_job_wait(nullptr) == DVR_E_INVALID_ARGUMENT);
  dvr_snapshot_job_free(nullptr);
}

TEST_CASE("c api: alloc gives a page-aligned, zero-filled region that snapshots, restores and untracks", "[c_api]") {
  CFixture f;
  void* p = reinterpret_cast<void*>(1);
  const std::size_t size = 5 * 4096 + 17;
  REQUIRE(dvr_alloc(f.session, "heap", size, &p) == DVR_OK);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  std::vector<unsigned char> zeros(size, 0);
  CHECK(diff(p, zeros.data(), size) == "");

  dvrtest::fill_random(p, size, 7200);
  std::vector<unsigned char> saved(static_cast<unsigned char*>(p), static_cast<unsigned char*>(p) + size);
  REQUIRE(dvr_snapshot(f.session, "filled", "") == DVR_OK);
  dvrtest::fill_random(p, size, 7201);
  REQUIRE(dvr_restore(f.session, "filled") == DVR_OK);
  CHECK(diff(p, saved.data(), size) == "");

  REQUIRE(dvr_untrack(f.session, "heap") == DVR_OK);
  CHECK(dvr_untrack(f.session, "heap") == DVR_E_NOT_FOUND);
  CHECK_THAT(errmsg(), Catch::Contains("heap"));
  // The snapshot keeps the region: it is listed with its size.
  dvr_snapshot_info* list = nullptr;
  std::size_t count = 0;
  REQUIRE(dvr_list(f.store, "sess", &list, &count) == DVR_OK);
  REQUIRE(count == 1);
  CHECK(list[0].logical_bytes == size);
  dvr_list_free(list);
}

TEST_CASE("c api: list, latest and remove", "[c_api]") {
  CFixture f;
  std::vector<unsigned char> data = dvrtest::random_bytes(200000, 7300);
  REQUIRE(dvr_track(f.session, "data", data.data(), data.size()) == DVR_OK);

  dvr_snapshot_info* list = reinterpret_cast<dvr_snapshot_info*>(1);
  std::size_t count = 99;
  dvr_status st;
  // Nothing yet: an empty list, and no latest.
  REQUIRE(dvr_list(f.store, "sess", &list, &count) == DVR_OK);
  CHECK(list == nullptr);
  CHECK(count == 0);
  CHECK(latest_of(f.store, "sess", &st) == "");
  CHECK(st == DVR_E_NOT_FOUND);
  CHECK_THAT(errmsg(), Catch::Contains("sess") && Catch::Contains("no intact snapshot"));

  REQUIRE(dvr_snapshot(f.session, "first", "label one") == DVR_OK);
  dvrtest::fill_random(data.data(), 4096, 7301);
  REQUIRE(dvr_snapshot(f.session, "second", nullptr) == DVR_OK);

  REQUIRE(dvr_list(f.store, "sess", &list, &count) == DVR_OK);
  REQUIRE(count == 2);
  CHECK(std::string(list[0].name) == "first");
  CHECK(std::string(list[0].parent) == "");
  CHECK(std::string(list[0].label) == "label one");
  CHECK(std::string(list[1].name) == "second");
  CHECK(std::string(list[1].parent) == "first");
  CHECK(std::string(list[1].label) == "");
  auto cpp = dvr::Store::open(f.dir.store()).list("sess");
  REQUIRE(cpp.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(list[i].time_ns == cpp[i].time_ns);
    CHECK(list[i].logical_bytes == data.size());
    CHECK(list[i].stored_bytes == cpp[i].stored_bytes);
    CHECK(list[i].damaged == 0);
    CHECK(std::string(list[i].damage) == "");
  }
  CHECK(list[0].time_ns > 0);
  CHECK(list[0].time_ns <= list[1].time_ns);
  CHECK(list[0].stored_bytes > 0);
  dvr_list_free(list);

  CHECK(latest_of(f.store, "sess", &st) == "second");
  CHECK(st == DVR_OK);
  // A buffer that cannot hold the name is refused, with an empty string in it.
  char small[4] = "abc";
  CHECK(dvr_latest(f.store, "sess", small, sizeof small) == DVR_E_INVALID_ARGUMENT);
  CHECK(std::string(small) == "");
  CHECK_THAT(errmsg(), Catch::Contains("name_buf") && Catch::Contains("second") && Catch::Contains("needs 7"));

  REQUIRE(dvr_remove(f.store, "sess", "second") == DVR_OK);
  CHECK(latest_of(f.store, "sess", &st) == "first");
  CHECK(dvr_remove(f.store, "sess", "second") == DVR_E_NOT_FOUND);
  CHECK_THAT(errmsg(), Catch::Contains("second"));
  REQUIRE(dvr_remove(f.store, "sess", "first") == DVR_OK);
  CHECK(latest_of(f.store, "sess", &st) == "");
  CHECK(st == DVR_E_NOT_FOUND);
  // An unknown session is an empty list, not an error.
  REQUIRE(dvr_list(f.store, "nobody", &list, &count) == DVR_OK);
  CHECK(count == 0);
}

TEST_CASE("c api: list marks a damaged snapshot and latest skips it, naming it", "[c_api]") {
  CFixture f;
  auto data = dvrtest::random_bytes(100000, 7400);
  REQUIRE(dvr_track(f.session, "data", data.data(), data.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "good", nullptr) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "bad", nullptr) == DVR_OK);
  const char* path = nullptr;
  REQUIRE(dvr_store_path(f.store, &path) == DVR_OK);
  std::string manifest = std::string(path) + "/sessions/sess/bad.snap";
  auto bytes = dvrtest::read_file(manifest);
  dvrtest::write_file(manifest, bytes.substr(0, bytes.size() / 2));

  dvr_snapshot_info* list = nullptr;
  std::size_t count = 0;
  REQUIRE(dvr_list(f.store, "sess", &list, &count) == DVR_OK);
  REQUIRE(count == 2);
  CHECK(std::string(list[1].name) == "bad");
  CHECK(list[1].damaged == 1);
  CHECK(std::string(list[1].damage) != "");
  CHECK(list[0].damaged == 0);
  dvr_list_free(list);

  dvr_status st;
  CHECK(latest_of(f.store, "sess", &st) == "good");
  CHECK(st == DVR_OK);
  CHECK(dvr_restore(f.session, "bad") == DVR_E_CORRUPT);
  CHECK_THAT(errmsg(), Catch::Contains("bad"));
  REQUIRE(dvr_remove(f.store, "sess", "good") == DVR_OK);
  CHECK(latest_of(f.store, "sess", &st) == "");
  CHECK(st == DVR_E_NOT_FOUND);
  CHECK_THAT(errmsg(), Catch::Contains("skipped") && Catch::Contains("sess/bad"));
}

TEST_CASE("c api: restoring an unknown snapshot is NOT_FOUND, names it, and changes nothing", "[c_api]") {
  CFixture f;
  auto a = dvrtest::random_bytes(70000, 7500);
  REQUIRE(dvr_track(f.session, "a", a.data(), a.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "there", nullptr) == DVR_OK);
  dvrtest::fill_random(a.data(), a.size(), 7501);
  auto now = a;
  CHECK(dvr_restore(f.session, "not-there") == DVR_E_NOT_FOUND);
  CHECK_THAT(errmsg(), Catch::Contains("not-there"));
  CHECK(diff(a, now) == "");
  // The message is exactly the C++ API's.
  auto cpp_store = dvr::Store::open(f.dir.store());
  dvr::Session cpp(cpp_store, "sess");
  std::vector<unsigned char> b(a.size());
  cpp.track("a", b.data(), b.size());
  auto e = dvrtest::catch_error([&] { cpp.restore("not-there"); });
  REQUIRE(e.code == dvr::Errc::not_found);
  CHECK(errmsg() == e.what);
}

TEST_CASE("c api: a snapshot or region name taken already is ALREADY_EXISTS", "[c_api]") {
  CFixture f;
  auto a = dvrtest::random_bytes(9000, 7600);
  REQUIRE(dvr_track(f.session, "a", a.data(), a.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "once", nullptr) == DVR_OK);
  CHECK(dvr_snapshot(f.session, "once", nullptr) == DVR_E_ALREADY_EXISTS);
  CHECK_THAT(errmsg(), Catch::Contains("once"));
  std::vector<unsigned char> other(100);
  CHECK(dvr_track(f.session, "a", other.data(), other.size()) == DVR_E_ALREADY_EXISTS);
  CHECK_THAT(errmsg(), Catch::Contains("'a'"));
  void* p = reinterpret_cast<void*>(1);
  CHECK(dvr_alloc(f.session, "a", 4096, &p) == DVR_E_ALREADY_EXISTS);
  CHECK(p == nullptr);
}

TEST_CASE("c api: every NULL argument is INVALID_ARGUMENT with a message naming it", "[c_api]") {
  CFixture f;
  char byte = 0;
  void* p = nullptr;
  const char* path = nullptr;
  dvr_store* store = nullptr;
  dvr_session* session = nullptr;
  dvr_snapshot_info* list = nullptr;
  std::size_t count = 0;
  char buf[DVR_NAME_MAX + 1];
  struct Case {
    const char* call;
    const char* arg;
    dvr_status status;
  };
  const Case cases[] = {
      {"dvr_store_open", "out", dvr_store_open(f.dir.store().c_str(), nullptr)},
      {"dvr_store_path", "store", dvr_store_path(nullptr, &path)},
      {"dvr_store_path", "out", dvr_store_path(f.store, nullptr)},
      {"dvr_session_open", "store", dvr_session_open(nullptr, "s", &session)},
      {"dvr_session_open", "name", dvr_session_open(f.store, nullptr, &session)},
      {"dvr_session_open", "out", dvr_session_open(f.store, "s", nullptr)},
      {"dvr_track", "session", dvr_track(nullptr, "r", &byte, 1)},
      {"dvr_track", "region", dvr_track(f.session, nullptr, &byte, 1)},
      {"dvr_track", "data", dvr_track(f.session, "r", nullptr, 1)},
      {"dvr_alloc", "session", dvr_alloc(nullptr, "r", 1, &p)},
      {"dvr_alloc", "region", dvr_alloc(f.session, nullptr, 1, &p)},
      {"dvr_alloc", "out", dvr_alloc(f.session, "r", 1, nullptr)},
      {"dvr_untrack", "session", dvr_untrack(nullptr, "r")},
      {"dvr_untrack", "region", dvr_untrack(f.session, nullptr)},
      {"dvr_snapshot", "session", dvr_snapshot(nullptr, "n", nullptr)},
      {"dvr_snapshot", "name", dvr_snapshot(f.session, nullptr, "label")},
      {"dvr_restore", "session", dvr_restore(nullptr, "n")},
      {"dvr_restore", "name", dvr_restore(f.session, nullptr)},
      {"dvr_list", "store", dvr_list(nullptr, "sess", &list, &count)},
      {"dvr_list", "session", dvr_list(f.store, nullptr, &list, &count)},
      {"dvr_list", "out", dvr_list(f.store, "sess", nullptr, &count)},
      {"dvr_list", "count", dvr_list(f.store, "sess", &list, nullptr)},
      {"dvr_latest", "store", dvr_latest(nullptr, "sess", buf, sizeof buf)},
      {"dvr_latest", "session", dvr_latest(f.store, nullptr, buf, sizeof buf)},
      {"dvr_latest", "name_buf", dvr_latest(f.store, "sess", nullptr, 10)},
      {"dvr_remove", "store", dvr_remove(nullptr, "sess", "n")},
      {"dvr_remove", "session", dvr_remove(f.store, nullptr, "n")},
      {"dvr_remove", "snapshot", dvr_remove(f.store, "sess", nullptr)},
  };
  // (All ran before these checks; the messages are checked one call at a time below.)
  for (const Case& c : cases) {
    INFO(c.call << "(" << c.arg << " = NULL)");
    CHECK(c.status == DVR_E_INVALID_ARGUMENT);
  }
  auto message_of = [](dvr_status st) {
    CHECK(st == DVR_E_INVALID_ARGUMENT);
    return errmsg();
  };
  CHECK(message_of(dvr_store_open(f.dir.store().c_str(), nullptr)) == "dvr_store_open: out is NULL");
  CHECK(message_of(dvr_store_path(nullptr, &path)) == "dvr_store_path: store is NULL");
  CHECK(message_of(dvr_session_open(f.store, nullptr, &session)) == "dvr_session_open: name is NULL");
  CHECK(message_of(dvr_track(f.session, "r", nullptr, 1)) == "dvr_track: data is NULL");
  CHECK(message_of(dvr_track(f.session, nullptr, &byte, 1)) == "dvr_track: region is NULL");
  CHECK(message_of(dvr_alloc(f.session, "r", 1, nullptr)) == "dvr_alloc: out is NULL");
  CHECK(message_of(dvr_untrack(f.session, nullptr)) == "dvr_untrack: region is NULL");
  CHECK(message_of(dvr_snapshot(f.session, nullptr, "label")) == "dvr_snapshot: name is NULL");
  CHECK(message_of(dvr_restore(nullptr, "n")) == "dvr_restore: session is NULL");
  CHECK(message_of(dvr_list(f.store, "sess", &list, nullptr)) == "dvr_list: count is NULL");
  CHECK(message_of(dvr_latest(f.store, "sess", nullptr, 10)) == "dvr_latest: name_buf is NULL");
  CHECK(message_of(dvr_remove(f.store, "sess", nullptr)) == "dvr_remove: snapshot is NULL");
  // Outputs are cleared on failure; nothing was created.
  CHECK(session == nullptr);
  CHECK(p == nullptr);
  CHECK(list == nullptr);
  CHECK(count == 0);
  CHECK(store == nullptr);
  CHECK(path == nullptr);
  // NULL handles are fine for the close and free calls.
  dvr_store_close(nullptr);
  dvr_session_close(nullptr);
  dvr_list_free(nullptr);
}

TEST_CASE("c api: bad names, size 0, overlap and a restore into a resized region are INVALID_ARGUMENT", "[c_api]") {
  CFixture f;
  auto a = dvrtest::random_bytes(8192, 7700);
  dvr_session* s = reinterpret_cast<dvr_session*>(1);
  CHECK(dvr_session_open(f.store, "../escape", &s) == DVR_E_INVALID_ARGUMENT);
  CHECK(s == nullptr);
  CHECK_THAT(errmsg(), Catch::Contains("session name '../escape' is not valid"));
  CHECK(dvr_track(f.session, "a/b", a.data(), a.size()) == DVR_E_INVALID_ARGUMENT);
  CHECK_THAT(errmsg(), Catch::Contains("region name 'a/b'"));
  CHECK(dvr_track(f.session, "a", a.data(), 0) == DVR_E_INVALID_ARGUMENT);
  CHECK_THAT(errmsg(), Catch::Contains("size 0"));
  void* p = nullptr;
  CHECK(dvr_alloc(f.session, "z", 0, &p) == DVR_E_INVALID_ARGUMENT);

  // A snapshot of no regions is refused.
  CHECK(dvr_snapshot(f.session, "empty", nullptr) == DVR_E_INVALID_ARGUMENT);

  REQUIRE(dvr_track(f.session, "a", a.data(), a.size()) == DVR_OK);
  CHECK(dvr_track(f.session, "inside", a.data() + 100, 10) == DVR_E_INVALID_ARGUMENT);
  CHECK_THAT(errmsg(), Catch::Contains("overlaps"));
  CHECK(dvr_snapshot(f.session, ".hidden", nullptr) == DVR_E_INVALID_ARGUMENT);
  CHECK(dvr_snapshot(f.session, std::string(DVR_NAME_MAX + 1, 'n').c_str(), nullptr) == DVR_E_INVALID_ARGUMENT);
  CHECK(dvr_snapshot(f.session, std::string(DVR_NAME_MAX, 'n').c_str(), nullptr) == DVR_OK);
  CHECK(dvr_restore(f.session, "a b") == DVR_E_INVALID_ARGUMENT);
  CHECK(dvr_remove(f.store, "sess", "x/y") == DVR_E_INVALID_ARGUMENT);
  dvr_snapshot_info* list = nullptr;
  std::size_t count = 0;
  CHECK(dvr_list(f.store, "bad session", &list, &count) == DVR_E_INVALID_ARGUMENT);
  char buf[DVR_NAME_MAX + 1];
  CHECK(dvr_latest(f.store, "", buf, sizeof buf) == DVR_E_INVALID_ARGUMENT);

  // The region "a" has another size now than in the snapshot: restore refuses
  // and leaves memory alone.
  REQUIRE(dvr_snapshot(f.session, "sized", nullptr) == DVR_OK);
  REQUIRE(dvr_untrack(f.session, "a") == DVR_OK);
  REQUIRE(dvr_track(f.session, "a", a.data(), a.size() / 2) == DVR_OK);
  dvrtest::fill_random(a.data(), a.size(), 7701);
  auto now = a;
  CHECK(dvr_restore(f.session, "sized") == DVR_E_INVALID_ARGUMENT);
  CHECK_THAT(errmsg(), Catch::Contains("'a'"));
  CHECK(diff(a, now) == "");
}

TEST_CASE("c api: store open failures are INVALID_ARGUMENT, IO, UNSUPPORTED and CORRUPT", "[c_api]") {
  TempDir dir;
  dvr_store* store = reinterpret_cast<dvr_store*>(1);

  // A directory with files but no store: invalid_argument.
  REQUIRE(::mkdir((dir / "junk").c_str(), 0700) == 0);
  dvrtest::write_file(dir / "junk/file", "x");
  CHECK(dvr_store_open((dir / "junk").c_str(), &store) == DVR_E_INVALID_ARGUMENT);
  CHECK(store == nullptr);
  CHECK_THAT(errmsg(), Catch::Contains("is not a Memory DVR store"));
  CHECK(dvr_store_open("", &store) == DVR_E_INVALID_ARGUMENT);

  // A path through a regular file: an OS error (ENOTDIR), io.
  CHECK(dvr_store_open((dir / "junk/file/store").c_str(), &store) == DVR_E_IO);
  CHECK_THAT(errmsg(), Catch::Contains("junk/file/store"));

  // A store written by a newer format: unsupported.
  REQUIRE(dvr_store_open(dir.store().c_str(), &store) == DVR_OK);
  dvr_store_close(store);
  std::string sb_path = dir.store() + "/DVRSTORE";
  std::string sb = dvrtest::read_file(sb_path);
  auto at = sb.find("format 1\n");
  REQUIRE(at != std::string::npos);
  std::string newer = sb;
  newer.replace(at, 9, "format 99\n");
  dvrtest::write_file(sb_path, newer);
  CHECK(dvr_store_open(dir.store().c_str(), &store) == DVR_E_UNSUPPORTED);
  CHECK_THAT(errmsg(), Catch::Contains("upgrade"));
  // ... and a superblock without a format version: corrupt.
  std::string broken = sb;
  broken.replace(at, 9, "formax 1\n");
  dvrtest::write_file(sb_path, broken);
  CHECK(dvr_store_open(dir.store().c_str(), &store) == DVR_E_CORRUPT);
  dvrtest::write_file(sb_path, sb);
  CHECK(dvr_store_open(dir.store().c_str(), &store) == DVR_OK);
  dvr_store_close(store);
}

TEST_CASE("c api: a store owned by another user is PERMISSION", "[c_api]") {
  if (::geteuid() != 0) DVR_SKIP("not root: cannot chown a store to another user");
  TempDir dir;
  dvr_store* store = nullptr;
  REQUIRE(dvr_store_open(dir.store().c_str(), &store) == DVR_OK);
  dvr_store_close(store);
  store = reinterpret_cast<dvr_store*>(1);
  REQUIRE(::chown(dir.store().c_str(), 12345, 12345) == 0);
  CHECK(dvr_store_open(dir.store().c_str(), &store) == DVR_E_PERMISSION);
  CHECK_THAT(errmsg(), Catch::Contains("12345"));
  CHECK(store == nullptr);
}

TEST_CASE("c api: damaged chunk data is CORRUPT on restore, and live memory stays", "[c_api]") {
  CFixture f;
  auto a = dvrtest::random_bytes(300000, 7800);
  REQUIRE(dvr_track(f.session, "a", a.data(), a.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(f.session, "snap", nullptr) == DVR_OK);
  auto store = dvr::Store::open(f.dir.store());
  for (auto& pack : dvrtest::pack_files(store)) {
    auto size = std::filesystem::file_size(pack);
    for (std::uint64_t off = 4096; off < size; off += 4096)
      dvrtest::flip_byte(pack, off + 7);
  }
  dvrtest::fill_random(a.data(), a.size(), 7801);
  auto now = a;
  CHECK(dvr_restore(f.session, "snap") == DVR_E_CORRUPT);
  CHECK_THAT(errmsg(), Catch::Contains("snap"));
  CHECK(diff(a, now) == "");
}

TEST_CASE("c api: a region too large to map is NO_SPACE", "[c_api]") {
  CFixture f;
  void* p = reinterpret_cast<void*>(1);
  CHECK(dvr_alloc(f.session, "huge", std::size_t(1) << 60, &p) == DVR_E_NO_SPACE);
  CHECK(p == nullptr);
  CHECK_THAT(errmsg(), Catch::Contains("huge"));
}

TEST_CASE("c api: the guard turns every exception into a status and a message", "[c_api]") {
  auto run = [](std::function<void()> f) {
    return dvr::detail::c_call(
        "dvr_probe", [](void* c) { (*static_cast<std::function<void()>*>(c))(); }, &f);
  };
  using dvr::Errc;
  const std::pair<Errc, dvr_status> codes[] = {
      {Errc::not_found, DVR_E_NOT_FOUND},
      {Errc::already_exists, DVR_E_ALREADY_EXISTS},
      {Errc::corrupt, DVR_E_CORRUPT},
      {Errc::no_space, DVR_E_NO_SPACE},
      {Errc::invalid_argument, DVR_E_INVALID_ARGUMENT},
      {Errc::io, DVR_E_IO},
      {Errc::unsupported, DVR_E_UNSUPPORTED},
      {Errc::permission, DVR_E_PERMISSION},
      {Errc::cancelled, DVR_E_CANCELLED},
  };
  for (auto [code, status] : codes) {
    std::string text = std::string("message for ") + dvr::errc_name(code);
    CHECK(run([&] { throw dvr::Error(code, text); }) == status);
    CHECK(errmsg() == text);
  }
  CHECK(run([] { throw std::bad_alloc(); }) == DVR_E_NOMEM);
  CHECK(errmsg() == "dvr_probe: out of memory");
  CHECK(run([] { throw std::logic_error("a bug"); }) == DVR_E_INTERNAL);
  CHECK_THAT(errmsg(), Catch::StartsWith("dvr_probe: ") && Catch::Contains("a bug"));
  CHECK(run([] { throw 42; }) == DVR_E_INTERNAL);
  CHECK_THAT(errmsg(), Catch::StartsWith("dvr_probe: ") && Catch::Contains("unknown type"));
  // Success leaves the last message in place.
  CHECK(run([] {}) == DVR_OK);
  CHECK_THAT(errmsg(), Catch::Contains("unknown type"));
}

TEST_CASE("c api: dvr_errmsg is per thread", "[c_api]") {
  CFixture f;
  CHECK(dvr_restore(f.session, "main-thread-miss") == DVR_E_NOT_FOUND);
  std::string in_fresh_thread = "(not run)", in_other_thread = "(not run)";
  dvr_status open_status = DVR_E_INTERNAL, other_status = DVR_OK;
  // Catch's assertions are not thread-safe: the thread only records.
  std::thread([&] {
    in_fresh_thread = errmsg();
    dvr_session* sess = nullptr;
    open_status = dvr_session_open(f.store, "other", &sess);
    other_status = dvr_restore(sess, "other-thread-miss");
    in_other_thread = errmsg();
    dvr_session_close(sess);
  }).join();
  CHECK(in_fresh_thread == "");
  CHECK(open_status == DVR_OK);
  CHECK(other_status == DVR_E_NOT_FOUND);
  CHECK_THAT(in_other_thread, Catch::Contains("other-thread-miss"));
  CHECK_THAT(errmsg(), Catch::Contains("main-thread-miss"));
  CHECK_THAT(errmsg(), !Catch::Contains("other-thread-miss"));
}

TEST_CASE("c api: a NULL path opens the default store ($DVR_STORE), and a session outlives its store handle", "[c_api]") {
  TempDir dir;
  const char* old = std::getenv("DVR_STORE");
  std::string saved = old ? old : "";
  ::setenv("DVR_STORE", dir.store().c_str(), 1);
  dvr_store* store = nullptr;
  dvr_status st = dvr_store_open(nullptr, &store);
  if (old)
    ::setenv("DVR_STORE", saved.c_str(), 1);
  else
    ::unsetenv("DVR_STORE");
  REQUIRE(st == DVR_OK);
  const char* path = nullptr;
  REQUIRE(dvr_store_path(store, &path) == DVR_OK);
  CHECK(std::string(path) == dir.store());

  dvr_session* session = nullptr;
  REQUIRE(dvr_session_open(store, "kept", &session) == DVR_OK);
  dvr_store_close(store);
  auto a = dvrtest::random_bytes(5000, 7900);
  auto a0 = a;
  REQUIRE(dvr_track(session, "a", a.data(), a.size()) == DVR_OK);
  REQUIRE(dvr_snapshot(session, "s", nullptr) == DVR_OK);
  dvrtest::fill_random(a.data(), a.size(), 7901);
  REQUIRE(dvr_restore(session, "s") == DVR_OK);
  CHECK(diff(a, a0) == "");
  dvr_session_close(session);
  CHECK(dvr::Store::open(dir.store()).list("kept").size() == 1);
}

TEST_CASE("c api: dvr_version is the library's version", "[c_api]") {
  CHECK(std::string(dvr_version()) == dvr::version());
  CHECK_THAT(std::string(dvr_version()), Catch::Matches("[0-9]+\\.[0-9]+\\.[0-9]+"));
}
