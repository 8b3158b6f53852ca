// A process snapshot names its heap files by absolute path, as the dumping
// host had them. A restore writes heap files only as DIR/SESSION/REGION in
// the heap area of the store restored from, or in a directory the operator
// names (HeapPolicy, RestoreOptions::heap_dirs); anything else is refused
// before anything is written (docs/migration.md, "Security model").
#include <sys/stat.h>
#include <unistd.h>

#include <functional>

#include "dvr/proc.hpp"
#include "base/os.hpp"
#include "proc/metadata.hpp"
#include "proc/proc_heaps.hpp"
#include "test_support.hpp"

using namespace dvr;
using dvrtest::catch_error;
using dvrtest::TempDir;
namespace heaps = dvr::detail::heaps;

namespace {

constexpr std::size_t kBytes = 4 * 4096;

// A file outside every store, with known bytes: what a crafted snapshot aims at.
struct Victim {
  std::string dir, path;
  std::string bytes = std::string(kBytes, 'V');
  explicit Victim(const std::string& base) : dir(base + "/order-victim"), path(dir + "/x") {
    ::mkdir(dir.c_str(), 0700);
    dvrtest::write_file(path, bytes);
  }
  ~Victim() {
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  }
  bool untouched() const { return dvrtest::read_file(path) == bytes; }
};

// Heap snapshot proc.p1 of session `session`, region `region` in `store`:
// a restore that were let through would write its bytes ('H').
void heap_snapshot(Store& store, const std::string& session, const std::string& region) {
  std::vector<char> data(kBytes, 'H');
  Session s(store, session);
  s.track(region, data.data(), data.size());
  s.snapshot("proc.p1");
}

heaps::HeapImage image_of(const std::string& store, const std::string& session, const std::string& region, const std::string& path) {
  heaps::HeapImage img;
  img.snapshot = "proc.p1";
  img.heaps.push_back({store, session, region, path, kBytes});
  return img;
}

// The refusal: permission, naming the path and the option.
void check_refused(const std::function<void()>& f, const std::string& path) {
  auto c = catch_error(f);
  CHECK(c.code == Errc::permission);
  CHECK_THAT(c.what, Catch::Contains(path));
  CHECK_THAT(c.what, Catch::Contains("--heap-dir"));
  CHECK_THAT(c.what, Catch::Contains("Nothing was changed"));
}

}  // namespace

TEST_CASE("heap confinement: a heap path outside the store's heap area is refused, and nothing is written", "[confine]") {
  TempDir t;
  Victim victim("/tmp");
  Store store = Store::open(t.store());
  heap_snapshot(store, "order-victim", "x");
  const heaps::HeapPolicy own{store.path(), {}};
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "order-victim", "x", victim.path), own); }, victim.path);
  CHECK(victim.untouched());

  // Under /etc: refused, nothing created.
  const std::string etc = "/etc/dvr-test-should-not-exist";
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "etc", "dvr-test-should-not-exist", etc), own); }, etc);
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "dvr-test-should-not-exist", "heap", etc + "/heap"), own); }, etc);
  CHECK_FALSE(detail::path_exists(etc));

  // '..' out of the store's own heap area.
  const std::string dotdot = store.path() + "/heaps/order-victim/../../../../tmp/order-victim/x";
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "order-victim", "x", dotdot), own); }, dotdot);
  CHECK(victim.untouched());

  // The operator names the directory: then it is written (the check, not
  // something else, stopped the writes above).
  heaps::restore_heaps(image_of(store.path(), "order-victim", "x", victim.path), {store.path(), {"/tmp"}});
  CHECK(dvrtest::read_file(victim.path) == std::string(kBytes, 'H'));
}

TEST_CASE("heap confinement: symbolic links, other stores and stores inside the heap area are refused", "[confine]") {
  TempDir t;
  Victim victim(t.path());
  Store store = Store::open(t.store());
  heap_snapshot(store, "job", "x");
  const heaps::HeapPolicy own{store.path(), {}};
  const std::string heaps_dir = store.path() + "/heaps";
  REQUIRE(::mkdir(heaps_dir.c_str(), 0700) == 0);

  // STORE/heaps/job a link to the victim's directory.
  REQUIRE(::symlink(victim.dir.c_str(), (heaps_dir + "/job").c_str()) == 0);
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "job", "x", heaps_dir + "/job/x"), own); }, heaps_dir + "/job/x");
  CHECK(victim.untouched());
  REQUIRE(::unlink((heaps_dir + "/job").c_str()) == 0);

  // STORE/heaps/job/x a link to the victim.
  REQUIRE(::mkdir((heaps_dir + "/job").c_str(), 0700) == 0);
  REQUIRE(::symlink(victim.path.c_str(), (heaps_dir + "/job/x").c_str()) == 0);
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "job", "x", heaps_dir + "/job/x"), own); }, heaps_dir + "/job/x");
  CHECK(victim.untouched());
  REQUIRE(::unlink((heaps_dir + "/job/x").c_str()) == 0);

  // A store inside the heap area: STORE/heaps/inner is another store.
  Store inner = Store::open(heaps_dir + "/inner");
  check_refused([&] { heaps::restore_heaps(image_of(store.path(), "inner", "x", heaps_dir + "/inner/x"), own); }, heaps_dir + "/inner/x");
  CHECK_FALSE(detail::path_exists(heaps_dir + "/inner/x"));

  // A heap of another store (its data there too): refused unless its heap
  // directory is named.
  Store other = Store::open(t.path() + "/other");
  heap_snapshot(other, "other-job", "y");
  const std::string there = other.path() + "/heaps/other-job/y";
  check_refused([&] { heaps::restore_heaps(image_of(other.path(), "other-job", "y", there), own); }, there);
  CHECK_FALSE(detail::path_exists(there));
  heaps::restore_heaps(image_of(other.path(), "other-job", "y", there), {store.path(), {other.path() + "/heaps"}});
  CHECK(dvrtest::read_file(there) == std::string(kBytes, 'H'));

  // The legitimate case: the store's own heap area.
  heaps::restore_heaps(image_of(store.path(), "job", "x", heaps_dir + "/job/x"), own);
  CHECK(dvrtest::read_file(heaps_dir + "/job/x") == std::string(kBytes, 'H'));
  CHECK(victim.untouched());
}

TEST_CASE("heap confinement: proc restore of a crafted process snapshot naming /etc or /tmp refuses before anything runs", "[confine]") {
  TempDir t;
  Victim victim("/tmp");
  Store store = Store::open(t.store());
  heap_snapshot(store, "order-victim", "x");
  for (const std::string& path : {victim.path, std::string("/etc/dvr-test-should-not-exist/heap")}) {
    // The metadata written with its one codec, as a received proc/evil would carry it.
    proc::impl::Meta meta;
    meta.info.pid = 4242;
    meta.info.own_pid_namespace = true;
    meta.info.command = "crafted";
    const std::string session = path == victim.path ? "order-victim" : "dvr-test-should-not-exist";
    meta.info.heaps.push_back({path, kBytes, store.path(), session});
    std::string text = proc::impl::encode_meta(meta);
    {
      Session s(store, proc::kImageSession);
      s.track(proc::impl::kMetaRegion, text.data(), text.size());
      s.snapshot("evil", {.label = proc::impl::label_for(4242, "crafted"), .replace = true});
    }
    for (bool clone : {false, true}) {
      auto c = catch_error([&] { proc::restore(store, "evil", {.clone = clone}); });
      CHECK(c.code == Errc::permission);
      CHECK_THAT(c.what, Catch::Contains(path));
      CHECK_THAT(c.what, Catch::Contains("process snapshot 'evil'"));
      CHECK_THAT(c.what, Catch::Contains("--heap-dir"));
    }
  }
  CHECK(victim.untouched());
  CHECK_FALSE(detail::path_exists("/etc/dvr-test-should-not-exist"));
  // Refused before any work directory was made in the store.
  CHECK_FALSE(detail::path_exists(store.path() + "/proc-work"));
  // A relative heap directory is refused as such.
  CHECK(catch_error([&] { proc::restore(store, "evil", {.heap_dirs = {"tmp"}}); }).code == Errc::invalid_argument);
}
