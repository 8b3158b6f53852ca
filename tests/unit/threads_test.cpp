// Unit tests of the thread bound: StoreOptions::threads, $DVR_THREADS, the
// default from the CPU affinity mask, and every pool honouring it.
#include <dirent.h>
#include <sched.h>

#include <thread>

#include "base/memops.hpp"
#include "store/store_impl.hpp"
#include "test_support.hpp"

using dvr::Errc;
using dvr::Session;
using dvr::Store;
using dvrtest::catch_error;
using dvrtest::TempDir;

namespace {

// Sets (or unsets) an environment variable for the guard's life.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~EnvGuard() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// This process's threads now (/proc/self/task).
std::size_t task_count() {
  std::size_t n = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// The distinct threads parallel_for ran fn on.
std::set<std::thread::id> threads_used(unsigned bound, std::size_t count, std::size_t work) {
  std::mutex mu;
  std::set<std::thread::id> ids;
  dvr::detail::parallel_for(bound, count, work, [&](std::size_t, std::size_t) {
    std::lock_guard<std::mutex> g(mu);
    ids.insert(std::this_thread::get_id());
  });
  return ids;
}

}  // namespace

TEST_CASE("threads: parallel_for runs on exactly as many threads as the bound allows", "[threads]") {
  const std::size_t big = std::size_t{1} << 30;  // enough work for any number of threads
  CHECK(threads_used(1, 100, big).size() == 1);
  CHECK(threads_used(1, 100, big).count(std::this_thread::get_id()) == 1);  // on the caller
  CHECK(threads_used(3, 100, big).size() == 3);
  CHECK(threads_used(7, 100, big).size() == 7);  // more than the CPUs when asked
  CHECK(threads_used(8, 3, big).size() == 3);    // not more than the slices
  CHECK(threads_used(8, 100, 8u << 20).size() == 1);  // too little work to pay for threads
}

TEST_CASE("threads: StoreOptions::threads and DVR_THREADS set the bound, with clear errors for bad values", "[threads]") {
  TempDir dir;
  EnvGuard unset("DVR_THREADS", nullptr);
  CHECK(Store::open(dir.store(), {.threads = 3}).threads() == 3);
  {
    EnvGuard env("DVR_THREADS", "5");
    CHECK(Store::open(dir.store()).threads() == 5);
    CHECK(Store::open(dir.store(), {.threads = 2}).threads() == 2);  // the option wins
  }
  for (const char* bad : {"abc", "0", "-1", "99999", "1025", "2x", " 4"}) {
    EnvGuard env("DVR_THREADS", bad);
    auto e = catch_error([&] { Store::open(dir.store()); });
    CHECK(e.code == Errc::invalid_argument);
    CHECK_THAT(e.what, Catch::Contains("DVR_THREADS='" + std::string(bad) + "'"));
    CHECK_THAT(e.what, Catch::Contains("1 to 1024"));
  }
  {
    EnvGuard env("DVR_THREADS", "");  // empty: the default
    CHECK(Store::open(dir.store()).threads() == dvr::detail::affinity_cpus());
  }
  auto e = catch_error([&] { Store::open(dir.store(), {.threads = 5000}); });
  CHECK(e.code == Errc::invalid_argument);
  CHECK_THAT(e.what, Catch::Contains("5000"));
}

TEST_CASE("threads: the default is the CPUs of the affinity mask, not the machine's", "[threads]") {
  TempDir dir;
  EnvGuard unset("DVR_THREADS", nullptr);
  cpu_set_t saved;
  CPU_ZERO(&saved);
  REQUIRE(::sched_getaffinity(0, sizeof saved, &saved) == 0);
  CHECK(Store::open(dir.store()).threads() == static_cast<unsigned>(CPU_COUNT(&saved)));
  // Pinned to one CPU (as an MPI launcher pins a rank): one thread.
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c)
    if (CPU_ISSET(c, &saved)) first = c;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  REQUIRE(::sched_setaffinity(0, sizeof one, &one) == 0);
  const unsigned pinned = Store::open(dir.store()).threads();
  REQUIRE(::sched_setaffinity(0, sizeof saved, &saved) == 0);
  CHECK(pinned == 1);
}

TEST_CASE("threads: a snapshot, verify and restore never run more threads than the store's bound", "[threads]") {
  TempDir dir;
  auto data = dvrtest::random_bytes(96u << 20, 2301);
  for (unsigned bound : {1u, 2u, 3u}) {
    CAPTURE(bound);
    Store store = Store::open(dir.store(), {.threads = bound});
    Session s(store, "t" + std::to_string(bound));
    s.track("r", data.data(), data.size());
    const std::size_t before = task_count();
    std::size_t most = before;
    // The callback runs on the calling thread while the workers run: it
    // sees every thread the operation started.
    auto sample = [&](std::uint64_t, std::uint64_t) { most = std::max(most, task_count()); };
    s.snapshot("a", {.progress = sample});
    store.verify(sample);
    data[1] ^= 1;
    s.restore("a", dvr::RestoreOptions{.progress = sample});
    CHECK(most <= before + (bound > 1 ? bound : 0));  // one thread: the caller does the work
    CHECK(task_count() == before);                     // and they are gone afterwards
  }
}
