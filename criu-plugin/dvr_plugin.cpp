// dvr_criu.so — the Memory DVR plugin for CRIU 4.x (design: README.md here).
//
// CRIU records a MAP_SHARED mapping of a regular file by its path and never
// copies its pages. A process whose data lives in a DVR persistent heap
// (dvr::AllocOptions::persistent) is therefore dumped with almost no I/O,
// provided the heap file is made consistent:
//   dump:    CHECKPOINT_DEVICES runs once per task while every task is frozen;
//            the heaps the task maps are snapshotted into their own store and
//            session (SESSION/proc.NAME) — only the pages written since the
//            application's last snapshot, when its session tracks writes — and
//            listed in dvr-heaps.img in the image directory.
//   restore: init(RESTORE) runs before CRIU maps anything; every heap file is
//            put back to its content at dump time, each page checked first.
// A process with a DVR session also holds the session's userfaultfd (write
// tracking), which CRIU cannot dump: DUMP_EXT_FILE records it in
// dvr-uffd.img, and RESTORE_EXT_FILE gives the restored task a fresh one. Its
// registrations are not carried over, so the session finds its tracking lost
// and compares by hash until it tracks anew (docs/criu.md).
// restore: RESUME_DEVICES_LATE runs once per task after CRIU laid out its
//            memory, before it resumes: where `dvr proc restore` fills the
//            task's pages itself ($DVR_CRIU_FILL, image_server.hpp), the hook
//            asks it to and waits; a task it could not fill is killed before
//            it runs.
// Every other hook, and tasks mapping no heap, answer -ENOTSUP.
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <set>
#include <string>

#include "dvr/error.hpp"
#include "dvr/proc.hpp"
#include "base/os.hpp"
#include "proc/heap_seal.hpp"
#include "proc/proc_heaps.hpp"

extern "C" {
#include <criu/criu-plugin.h>
}

namespace {

namespace heaps = dvr::detail::heaps;

// The tasks are frozen while the plugin works, and one may hold a store's
// lock (frozen inside a snapshot): wait a while for it, never forever
// (StoreOptions::lock_timeout of every store the plugin opens).
constexpr std::chrono::milliseconds kLockTimeout{5000};

int g_stage = -1;
heaps::HeapImage g_image;          // what this dump recorded so far
std::set<std::string> g_recorded;  // heap files already in g_image

// The reason for a failure, where `dvr proc` finds it (and on CRIU's stderr).
void report(const std::string& what) {
  std::fprintf(stderr, "dvr plugin: %s\n", what.c_str());
  int dir = criu_get_image_dir();
  if (dir < 0) return;
  int fd = ::openat(dir, heaps::kErrorName, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  (void)!::write(fd, what.data(), what.size());
  ::close(fd);
}

std::string read_image() {
  int dir = criu_get_image_dir();
  if (dir < 0) throw dvr::Error(dvr::Errc::io, "CRIU gave the plugin no image directory");
  int fd = ::openat(dir, heaps::kImageName, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return "";
    throw dvr::Error(dvr::Errc::io, std::string("cannot open ") + heaps::kImageName);
  }
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0)
    text.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return text;
}

void write_image() {
  int dir = criu_get_image_dir();
  if (dir < 0) throw dvr::Error(dvr::Errc::io, "CRIU gave the plugin no image directory");
  int fd = ::openat(dir, heaps::kImageName, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw dvr::Error(dvr::Errc::io, std::string("cannot create ") + heaps::kImageName);
  std::string text = heaps::format_image(g_image);
  dvr::detail::write_all(fd, text.data(), text.size(), heaps::kImageName);
  ::close(fd);
}

int dvr_init(int stage) {
  g_stage = stage;
  if (stage != CR_PLUGIN_STAGE__RESTORE) return 0;
  try {
    std::string text = read_image();
    if (text.empty()) return 0;                         // the process mapped no DVR heap
    const char* store = std::getenv("DVR_CRIU_STORE");  // the store dvr proc restores from
    heaps::HeapImage image = heaps::parse_image(text);
    // `dvr proc restore` put the heaps back itself (keeping what they held,
    // should CRIU fail); a clone's, in its own mount view, are made here.
    const char* done = std::getenv("DVR_CRIU_HEAPS_DONE");
    if (done && image.snapshot == done) return 0;
    // Confined like `dvr proc restore` (proc_heaps.hpp, HeapPolicy): the store
    // restored from and the directories its operator named.
    heaps::HeapPolicy policy{store ? store : "", {}};
    if (const char* dirs = std::getenv(heaps::kHeapDirsEnv)) {
      std::string all = dirs;
      for (std::size_t at = 0, nl; at < all.size(); at = nl + 1) {
        nl = all.find('\n', at);
        if (nl == std::string::npos) nl = all.size();
        if (nl > at) policy.dirs.push_back(all.substr(at, nl - at));
      }
    }
    heaps::restore_heaps(image, policy, kLockTimeout);
    return 0;
  } catch (const std::exception& e) {
    report(std::string("cannot restore the DVR heaps: ") + e.what());
    return -1;
  }
}

void dvr_exit(int, int) {}

constexpr const char* kUffdImage = "dvr-uffd.img";
std::set<int> g_uffd_ids;    // dump: file ids recorded as userfaultfds
bool g_uffd_loaded = false;  // restore: g_uffd_ids read from the image

bool is_userfaultfd(int fd) {
  char link[64], target[128];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = 0;
  return std::string(target) == "anon_inode:[userfaultfd]";
}

int dvr_dump_ext_file(int fd, int id) {
  if (!is_userfaultfd(fd)) return -ENOTSUP;
  try {
    g_uffd_ids.insert(id);
    std::string text = "dvr-criu-uffd 1\n";
    for (int i : g_uffd_ids)
      text += "id " + std::to_string(i) + "\n";
    int dir = criu_get_image_dir();
    int out = dir < 0 ? -1 : ::openat(dir, kUffdImage, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) throw dvr::Error(dvr::Errc::io, std::string("cannot create ") + kUffdImage);
    dvr::detail::write_all(out, text.data(), text.size(), kUffdImage);
    ::close(out);
    return 0;
  } catch (const std::exception& e) {
    report(std::string("cannot record a DVR userfaultfd: ") + e.what());
    return -1;
  }
}

int dvr_restore_ext_file(int id) {
  if (!g_uffd_loaded) {
    g_uffd_loaded = true;
    int dir = criu_get_image_dir();
    int fd = dir < 0 ? -1 : ::openat(dir, kUffdImage, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      char buf[4096];
      ssize_t n = ::read(fd, buf, sizeof buf - 1);
      ::close(fd);
      std::string text(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
      std::size_t at = 0;
      while ((at = text.find("\nid ", at)) != std::string::npos) {
        at += 4;
        g_uffd_ids.insert(std::atoi(text.c_str() + at));
      }
    }
  }
  if (!g_uffd_ids.count(id)) return -ENOTSUP;
  // Same flags and API handshake as libdvr's tracker, nothing registered.
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | 1 /* UFFD_USER_MODE_ONLY */));
  if (fd < 0) fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0) {
    report("cannot create a userfaultfd for the restored DVR session: " + std::string(std::strerror(errno)));
    return -1;
  }
  struct uffdio_api api {};
  api.api = UFFD_API;
  api.features = (1ull << 15) | (1ull << 13);  // WP_ASYNC, WP_UNPOPULATED
  if (::ioctl(fd, UFFDIO_API, &api) != 0) {
    api.features = 0;
    api.api = UFFD_API;
    (void)::ioctl(fd, UFFDIO_API, &api);
  }
  return fd;
}

// Runs once per task of the tree, all of them frozen.
int dvr_checkpoint_devices(int pid) {
  if (g_stage != CR_PLUGIN_STAGE__DUMP) return -ENOTSUP;
  try {
    std::vector<std::string> files;
    for (auto& f : heaps::mapped_heaps(pid))
      if (!g_recorded.count(f)) files.push_back(f);
    if (files.empty()) return -ENOTSUP;
    if (!g_image.heaps.empty()) {
      report("task " + std::to_string(pid) + " maps DVR heaps that an earlier task of the tree does not (" + files.front() +
             "); heaps spread over several processes of one tree are not supported yet");
      return -1;
    }
    const char* name = std::getenv("DVR_CRIU_NAME");
    std::string snapshot =
        std::string(dvr::proc::kHeapPrefix) +
        (name && *name ? std::string(name)
                       : "criu-" + std::to_string(pid) + "-" + std::to_string(std::chrono::system_clock::now().time_since_epoch().count()));
    // Heaps `dvr proc dump` sealed and snapshotted before CRIU ran
    // (heap_seal.hpp): recorded as they are; the others are snapshotted here.
    const char* sealed_env = std::getenv(heaps::kSealedEnv);
    std::vector<heaps::HeapFile> sealed;
    std::vector<std::string> to_copy;
    for (auto& h : heaps::parse_sealed(sealed_env ? sealed_env : ""))
      if (std::find(files.begin(), files.end(), h.path) != files.end()) sealed.push_back(h);
    for (auto& f : files)
      if (std::none_of(sealed.begin(), sealed.end(), [&](const heaps::HeapFile& h) { return h.path == f; })) to_copy.push_back(f);
    g_image.snapshot = snapshot;
    if (!to_copy.empty()) {
      g_image = heaps::snapshot_heaps(to_copy, pid, snapshot, false, nullptr, kLockTimeout);
      // Heaps of `dvr run --heap`: the next dump stores what is written after this one.
      heaps::renew_shim_notes(g_image, pid);
    }
    g_image.heaps.insert(g_image.heaps.end(), sealed.begin(), sealed.end());
    g_recorded.insert(files.begin(), files.end());
    write_image();
    return 0;
  } catch (const std::exception& e) {
    report(std::string("cannot snapshot the DVR heaps of task ") + std::to_string(pid) + ": " + e.what());
    return -1;
  }
}

int g_fill = -1;          // the connection to dvr's page-fill socket
bool g_fill_failed = false;  // once one task could not be filled, no later one is asked

bool fill_round_trip(int pid, const char* path) {
  if (g_fill < 0) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (std::strlen(path) >= sizeof addr.sun_path) return false;
    std::strcpy(addr.sun_path, path);
    g_fill = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (g_fill < 0 || ::connect(g_fill, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return false;
  }
  std::int32_t p = pid, status = -1;
  if (::send(g_fill, &p, sizeof p, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof p)) return false;
  return ::recv(g_fill, &status, sizeof status, MSG_WAITALL) == static_cast<ssize_t>(sizeof status) && status == 0;
}

// Runs once per restored task, every task stopped before it resumes.
int dvr_resume_devices_late(int pid) {
  const char* path = std::getenv("DVR_CRIU_FILL");
  if (!path || !*path) return -ENOTSUP;
  if (!g_fill_failed && fill_round_trip(pid, path)) return 0;
  if (!g_fill_failed) report("dvr could not fill the memory of restored task " + std::to_string(pid) + "; the task was killed before it ran");
  g_fill_failed = true;
  ::kill(pid, SIGKILL);
  return -1;
}

}  // namespace

extern "C" {
CR_PLUGIN_REGISTER("dvr", dvr_init, dvr_exit)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__CHECKPOINT_DEVICES, dvr_checkpoint_devices)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__DUMP_EXT_FILE, dvr_dump_ext_file)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESTORE_EXT_FILE, dvr_restore_ext_file)
CR_PLUGIN_REGISTER_HOOK(CR_PLUGIN_HOOK__RESUME_DEVICES_LATE, dvr_resume_devices_late)
}
