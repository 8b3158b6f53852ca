// dvr-test-job — a long-running job for the whole-process snapshot tests
// (tests/proc): `dvr run` starts it, `dvr proc dump` / `restore` / `clone`
// checkpoint and bring it back, and its status file shows whether what came
// back is the same process with the same memory.
//
// The job holds a buffer of --mib MiB (anonymous memory, or a DVR persistent
// heap in `heap` mode) filled with deterministic, non-repeating bytes and
// pre-faulted, and a counter incremented every --tick-ms (10 ms). Every
// --report-ms (100 ms) it writes one line to the status file,
//
//   count=C sum=X gen=G seq=S id=I mib=M
//
// atomically (a temporary file beside it, then rename; the file is never kept
// open, since CRIU would record an open file's size and refuse to restore
// once it changed). C is the counter, X the XXH3-64 of the whole buffer
// (16 hex digits), recomputed from memory for every report, so a restored
// process proves its buffer intact, G the number of mutations applied, S the
// number of reports written, I a random 64-bit id chosen at start (a restored
// or cloned process keeps it; a restarted one would not), M the buffer size.
//
// Signals:
//   SIGUSR1  mutate: rewrite 1% of the buffer's pages (at least one), chosen
//            and filled as a function of the new generation G+1, then report.
//            Like a real program it also allocates a little on the way: each
//            mutation keeps a 12 KiB history record on the malloc heap, so the
//            memory below the buffer grows between two dumps (new pages of
//            [heap] come before the buffer in CRIU's page images).
//   SIGUSR2  if the file STATUS.redirect exists (STATUS being the path given
//            with --status, as the job was started), read a path from it and
//            write the status there from now on; then report at once. Tells a
//            clone from its original: both start out writing the same file.
//   SIGHUP   heap mode: take a snapshot of the session from inside the job,
//            named "inside-N" (N counting from 1, replacing an older one of
//            that name), then report; the status line then ends with
//            " snap=inside-N" (or " snap-error=MESSAGE" if it failed). Shows
//            whether the SDK's own write tracking still works after a restore.
//
// The buffer's content after G mutations is a pure function of (mib, G), so
// `dvr-test-job expect --mib M --gen G` prints the sum a correct buffer has.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dvr/dvr.hpp"

namespace {

const char* kUsage = R"(usage: dvr-test-job MODE [OPTIONS]

Modes:
  counter --mib M --status FILE
        anonymous buffer of M MiB (MAP_PRIVATE|MAP_ANONYMOUS)
  heap --store DIR --mib M --status FILE [--session NAME] [--region NAME]
       [--tracking hash|write_protect]
        the buffer is a DVR persistent heap: alloc(REGION, M MiB,
        {.persistent = true}) in session NAME (default "job", region "heap")
        of the store DIR, i.e. the file DIR/heaps/NAME/REGION mapped
        MAP_SHARED; the session tracks writes by hash (default: no
        userfaultfd in the process) or with write_protect
  expect --mib M --gen G [--pages]
        print the sum (as in the status line) of a buffer of M MiB after G
        mutations, and exit; with --pages instead the distinct page numbers
        mutation G rewrites, one a line

Options (counter, heap):
  --tick-ms T        counter period (default 10)
  --report-ms R      status period (default 100)
  --exit-at C        exit with --exit-code (default 0) once count reaches C
  --exit-code E

Status line: count=C sum=X gen=G seq=S id=I mib=M [snap=NAME] (see the source).
SIGUSR1: change 1% of the pages (gen+1). SIGUSR2: follow STATUS.redirect, report.
SIGHUP (heap): snapshot the session from inside as inside-N, report.
Exit status: 0 (or --exit-code), 2 usage, 3 a dvr::Error, 4 a system error.
)";

constexpr std::size_t kPage = 4096;
constexpr std::size_t kMiB = 1024 * 1024;

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::uint64_t mix(std::uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Page `page` as written by generation `gen` (0: the initial fill).
void fill_page(std::uint64_t* words, std::size_t page, std::uint64_t gen) {
  std::uint64_t seed = mix((gen << 40) ^ page);
  for (std::size_t i = 0; i < kPage / 8; ++i)
    words[i] = mix(seed + i);
}

void fill(unsigned char* buf, std::size_t pages) {
  for (std::size_t p = 0; p < pages; ++p)
    fill_page(reinterpret_cast<std::uint64_t*>(buf + p * kPage), p, 0);
}

// The pages mutation number `gen` (>= 1) rewrites: 1% of them (at least one),
// picked from gen (a page may come up twice).
std::vector<std::size_t> mutated_pages(std::size_t pages, std::uint64_t gen) {
  std::size_t n = pages / 100 > 0 ? pages / 100 : 1;
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(mix((gen << 32) ^ (i * 0x5851F42D4C957F2Dull)) % pages);
  return out;
}

void mutate(unsigned char* buf, std::size_t pages, std::uint64_t gen) {
  for (std::size_t page : mutated_pages(pages, gen))
    fill_page(reinterpret_cast<std::uint64_t*>(buf + page * kPage), page, gen);
}

std::uint64_t checksum(const unsigned char* buf, std::size_t bytes) { return XXH3_64bits(buf, bytes); }

std::atomic<int> g_usr1{0};
std::atomic<int> g_usr2{0};
std::atomic<int> g_hup{0};
extern "C" void on_hup(int) { g_hup.fetch_add(1); }
extern "C" void on_usr1(int) { g_usr1.fetch_add(1); }
extern "C" void on_usr2(int) { g_usr2.fetch_add(1); }

std::uint64_t random64() {
  std::uint64_t v = 0;
  while (::getrandom(&v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) {
    if (errno != EINTR) {
      std::perror("getrandom");
      std::exit(4);
    }
  }
  return v;
}

std::uint64_t now_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000 + static_cast<std::uint64_t>(ts.tv_nsec) / 1000000;
}

void sleep_ms(std::uint64_t ms) {
  timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1000000)};
  ::nanosleep(&ts, nullptr);  // a signal cuts it short: fine, it is handled next round
}

// Writes `text` to `path` atomically. The temporary name is random (from the
// kernel, so a clone and its original never pick the same one) and the file is
// closed before it is renamed into place. A failure is reported, not fatal:
// the test sees a stale status.
//
// The text is written into an unnamed file (O_TMPFILE) that gets its
// temporary name only right before it is closed: a dump that freezes the job
// while it writes then holds a deleted file, whose content CRIU keeps,
// instead of an open file under the temporary name, which is renamed away
// while a --leave-running original goes on, so that its restore would fail
// ("Can't open file ...tmp-..."). The window left is one syscall, between
// linkat and close.
void write_status(const std::string& path, const std::string& text) {
  char suffix[40];
  std::snprintf(suffix, sizeof suffix, ".tmp-%016" PRIx64, random64());
  const std::string tmp = path + suffix;
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  bool named = false;
  int fd = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) {  // a file system without O_TMPFILE: named from the start
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    named = true;
  }
  if (fd < 0) {
    std::fprintf(stderr, "dvr-test-job: cannot create %s: %s\n", tmp.c_str(), std::strerror(errno));
    return;
  }
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  if (ok && !named) {
    const std::string self = "/proc/self/fd/" + std::to_string(fd);
    ok = ::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) == 0;
  }
  ok = (::close(fd) == 0) && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "dvr-test-job: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    ::unlink(tmp.c_str());
  }
}

std::optional<std::string> read_redirect(const std::string& file) {
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\r' || line.back() == ' '))
    line.pop_back();
  if (line.empty()) return std::nullopt;
  return line;
}

struct Options {
  std::string mode;
  std::size_t mib = 0;
  bool have_mib = false;
  std::string status;
  std::string store;
  std::string session = "job";
  std::string region = "heap";
  dvr::Tracking tracking = dvr::Tracking::hash;
  std::uint64_t gen = 0;
  bool have_gen = false;
  bool pages = false;
  std::uint64_t tick_ms = 10;
  std::uint64_t report_ms = 100;
  std::optional<std::uint64_t> exit_at;
  int exit_code = 0;
};

std::uint64_t parse_u64(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0 || v[0] == '-') throw UsageError(flag + " needs a non-negative integer, got '" + v + "'");
  return x;
}

Options parse(int argc, char** argv) {
  if (argc < 2) throw UsageError("no mode given");
  Options o;
  o.mode = argv[1];
  if (o.mode != "counter" && o.mode != "heap" && o.mode != "expect") throw UsageError("unknown mode '" + o.mode + "'");
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--mib") {
      o.mib = parse_u64(a, value());
      o.have_mib = true;
    } else if (a == "--status") {
      o.status = value();
    } else if (a == "--store") {
      o.store = value();
    } else if (a == "--session") {
      o.session = value();
    } else if (a == "--region") {
      o.region = value();
    } else if (a == "--tracking") {
      std::string t = value();
      if (t == "hash")
        o.tracking = dvr::Tracking::hash;
      else if (t == "write_protect")
        o.tracking = dvr::Tracking::write_protect;
      else
        throw UsageError("--tracking must be hash or write_protect, got '" + t + "'");
    } else if (a == "--gen") {
      o.gen = parse_u64(a, value());
      o.have_gen = true;
    } else if (a == "--pages") {
      o.pages = true;
    } else if (a == "--tick-ms") {
      o.tick_ms = parse_u64(a, value());
    } else if (a == "--report-ms") {
      o.report_ms = parse_u64(a, value());
    } else if (a == "--exit-at") {
      o.exit_at = parse_u64(a, value());
    } else if (a == "--exit-code") {
      o.exit_code = static_cast<int>(parse_u64(a, value()) & 0xff);
    } else {
      throw UsageError("unknown option '" + a + "'");
    }
  }
  if (!o.have_mib || o.mib == 0) throw UsageError("--mib M (M >= 1) is required");
  if (o.mode == "expect") {
    if (!o.have_gen) throw UsageError("expect needs --gen G");
    return o;
  }
  if (o.status.empty()) throw UsageError("--status FILE is required");
  if (o.mode == "heap" && o.store.empty()) throw UsageError("heap needs --store DIR");
  if (o.tick_ms == 0 || o.report_ms == 0) throw UsageError("--tick-ms and --report-ms must be at least 1");
  return o;
}

std::string sum_hex(std::uint64_t sum) {
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, sum);
  return buf;
}

int run_expect(const Options& o) {
  const std::size_t bytes = o.mib * kMiB, pages = bytes / kPage;
  if (o.pages) {
    if (o.gen == 0) throw UsageError("--pages needs --gen G >= 1");
    std::vector<std::size_t> list = mutated_pages(pages, o.gen);
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
    for (std::size_t p : list)
      std::printf("%zu\n", p);
    return 0;
  }
  std::vector<unsigned char> buf(bytes);
  fill(buf.data(), pages);
  for (std::uint64_t g = 1; g <= o.gen; ++g)
    mutate(buf.data(), pages, g);
  std::printf("%s\n", sum_hex(checksum(buf.data(), bytes)).c_str());
  return 0;
}

int run_job(const Options& o) {
  const std::size_t bytes = o.mib * kMiB, pages = bytes / kPage;

  // The buffer. In heap mode the session (and the store) stay open for the
  // job's life, as an application using the SDK would keep them.
  std::unique_ptr<dvr::Session> session;
  unsigned char* buf = nullptr;
  if (o.mode == "heap") {
    // Hash tracking by default: no userfaultfd in the process (nothing is
    // snapshotted from inside; the point is the heap file CRIU sees mapped).
    session = std::make_unique<dvr::Session>(dvr::Store::open(o.store), o.session, dvr::SessionOptions{.tracking = o.tracking});
    buf = static_cast<unsigned char*>(session->alloc(o.region, bytes, dvr::AllocOptions{.persistent = true}).data());
  } else {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("dvr-test-job: mmap");
      return 4;
    }
    buf = static_cast<unsigned char*>(p);
  }
  fill(buf, pages);  // every page written: pre-faulted

  struct sigaction sa {};
  sa.sa_handler = on_usr1;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, nullptr);
  sa.sa_handler = on_usr2;
  ::sigaction(SIGUSR2, &sa, nullptr);
  sa.sa_handler = on_hup;
  ::sigaction(SIGHUP, &sa, nullptr);

  const std::uint64_t id = random64();
  const std::string redirect_file = o.status + ".redirect";
  std::string status_path = o.status;
  std::uint64_t count = 0, gen = 0, seq = 0, snaps = 0;
  std::vector<std::unique_ptr<unsigned char[]>> history;  // one record per mutation
  std::string snap_note;                                  // " snap=NAME" after a snapshot from inside
  std::uint64_t next_report = 0;                          // report at once
  for (;;) {
    bool report_now = false;
    if (g_usr1.exchange(0) > 0) {
      mutate(buf, pages, ++gen);
      constexpr std::size_t kRecord = 3 * kPage;  // below malloc's mmap threshold: from [heap]
      history.push_back(std::make_unique<unsigned char[]>(kRecord));
      std::memset(history.back().get(), static_cast<int>(gen & 0xff) | 1, kRecord);
      report_now = true;
    }
    if (g_hup.exchange(0) > 0 && session) {
      const std::string name = "inside-" + std::to_string(++snaps);
      try {
        session->snapshot(name, dvr::SnapshotOptions{.label = "dvr-test-job", .replace = true});
        snap_note = " snap=" + name;
      } catch (const dvr::Error& e) {
        snap_note = " snap-error=";
        for (const char* c = e.what(); *c; ++c)
          snap_note += (*c == ' ' || *c == '\n') ? '_' : *c;
      }
      report_now = true;
    }
    if (g_usr2.exchange(0) > 0) {
      if (auto to = read_redirect(redirect_file)) status_path = *to;
      report_now = true;
    }
    const std::uint64_t now = now_ms();
    if (report_now || now >= next_report) {
      char line[256];
      std::snprintf(line, sizeof line, "count=%" PRIu64 " sum=%s gen=%" PRIu64 " seq=%" PRIu64 " id=%016" PRIx64 " mib=%zu", count,
                    sum_hex(checksum(buf, bytes)).c_str(), gen, ++seq, id, o.mib);
      write_status(status_path, line + snap_note + "\n");
      next_report = now + o.report_ms;
    }
    if (o.exit_at && count >= *o.exit_at) return o.exit_code;
    sleep_ms(o.tick_ms);
    ++count;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o = parse(argc, argv);
    return o.mode == "expect" ? run_expect(o) : run_job(o);
  } catch (const UsageError& e) {
    std::cerr << "dvr-test-job: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const dvr::Error& e) {
    std::cerr << "error " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "dvr-test-job: " << e.what() << "\n";
    return 4;
  }
}
