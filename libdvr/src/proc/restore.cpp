// Restoring (or cloning) a process snapshot: proc::restore (dvr/proc.hpp,
// docs/criu.md). The phases, in order:
//   1. check_host, check_conflicts: refuse what CRIU could not do here
//      (programs changed, PIDs or heaps in use), before anything changes;
//   2. ImageServer: the image files back in a work directory, but for page
//      images, which CRIU (>= 4.2, --stream) reads straight from the store's
//      pack files, every page checked against its checksum as it is served;
//   3. HeapRestore: the heaps put back (checked first), what they held kept
//      aside in case CRIU fails;
//   4. run_criu_restore: CRIU (and the plugin, which restores a clone's heaps),
//      for a clone in its own mount view and network (CloneView, netns.hpp);
//   5. the PID file, the notes, and waiting for the job unless detached.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/progress.hpp"
#include "base/mapping.hpp"
#include "base/os.hpp"
#include "dvr/clone.hpp"
#include "dvr/proc.hpp"
#include "dvr/session.hpp"
#include "proc/criu_runner.hpp"
#include "proc/image_server.hpp"
#include "proc/metadata.hpp"
#include "proc/netns.hpp"
#include "proc/heap_seal.hpp"
#include "proc/proc_heaps.hpp"
#include "proc/proc_pages.hpp"
#include "proc/processes.hpp"
#include "store/store_impl.hpp"

namespace dvr::proc {

namespace {

using namespace impl;
using detail::Fd;
using detail::Mapping;
namespace heaps = detail::heaps;
namespace procpages = detail::procpages;

// Preflight: what CRIU needs from this host, compared with the dumping one:
// every program and library at the same path, with the same size and time.
void check_host(const ProcInfo& p, const std::string& name, const char* verb) {
  std::vector<std::string> differ;
  for (auto& f : p.files) {
    struct stat st {};
    if (::stat(f.path.c_str(), &st) != 0)
      differ.push_back(f.path + " is missing");
    else if (static_cast<std::uint64_t>(st.st_size) != f.size)
      differ.push_back(f.path + " is " + std::to_string(st.st_size) + " bytes here, " + std::to_string(f.size) + " where it was dumped");
    else if (st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec != f.mtime_ns)
      differ.push_back(f.path + " was modified since the dump (same size, another time stamp)");
  }
  if (differ.empty()) return;
  std::string list;
  for (std::size_t k = 0; k < differ.size() && k < 8; ++k)
    list += "\n  " + differ[k];
  if (differ.size() > 8) list += "\n  ... and " + std::to_string(differ.size() - 8) + " more";
  throw Error(Errc::unsupported, "cannot " + std::string(verb) + " '" + name +
                                     "': CRIU needs the programs and libraries it "
                                     "ran with, at the same paths, and here they differ:" +
                                     list + "\ninstall the same versions (the same packages or build) at the same paths; nothing was changed");
}

// What would clash with running processes: a clone needs a dump from a job in
// its own PID namespace; a restore needs the dumped PID (outside such a job)
// free and its heaps mapped by nobody.
void check_conflicts(const ProcInfo& p, const std::string& name, const RestoreOptions& options) {
  if (options.clone && !p.own_pid_namespace)
    throw Error(Errc::invalid_argument, "process snapshot '" + name + "' (PID " + std::to_string(p.pid) +
                                            ") was not dumped from a job in its own PID namespace, so a clone would need the "
                                            "original's PIDs; start jobs with `dvr run -- CMD` to clone them");
  if (!p.own_pid_namespace && ::kill(p.pid, 0) == 0)
    throw Error(Errc::io, "cannot restore process snapshot '" + name + "': PID " + std::to_string(p.pid) + " is in use (" + comm_of(p.pid) +
                              "); stop that process first, or start jobs with `dvr run -- CMD` so that they "
                              "restore in a PID namespace of their own (nothing was changed)");
  if (!options.clone)
    for (auto& h : p.heaps) {
      auto users = heaps::processes_mapping(h.path);
      if (!users.empty())
        throw Error(Errc::io, "cannot restore process snapshot '" + name + "': its heap file " + h.path + " is mapped by running process " +
                                  users.front() + "; stop it first, or use `dvr proc clone " + name +
                                  "` to run a copy beside it (nothing was changed)");
    }
}

// Where heap files may be written: the store's heap area and the
// directories the operator named (docs/migration.md, "Security model").
heaps::HeapPolicy heap_policy(const Store& store, const RestoreOptions& options) {
  heaps::HeapPolicy policy{store.path(), {}};
  for (auto& d : options.heap_dirs) {
    if (d.empty() || d[0] != '/' || d.find('\n') != std::string::npos)
      throw Error(Errc::invalid_argument, "heap directory '" + d + "' is not an absolute path; give --heap-dir an absolute directory");
    policy.dirs.push_back(d);
  }
  return policy;
}

// Every heap file the snapshot's metadata names, checked against the policy
// before anything is set up: the files, and the stores their data would come
// from. (restore_heaps checks the heap image itself again before writing.)
void check_heap_paths(const ProcInfo& p, const std::string& name, const heaps::HeapPolicy& policy) {
  const std::string what = "process snapshot '" + name + "'";
  for (auto& h : p.heaps) {
    heaps::check_heap_path(h.path, h.session, "", "", policy, what);
    heaps::HeapFile f{h.store, h.session, "", h.path, h.bytes};
    heaps::check_heap_path(h.path, h.session, "", heaps::heap_store(f, kHeapPrefix + name, policy.store), policy, what);
  }
}

// The PID file is opened before anything runs: failing to write it later
// would leave a job running that nobody can find.
Fd open_pidfile(const std::string& path) {
  Fd fd;
  if (path.empty()) return fd;
  fd = Fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) detail::throw_errno(errno, "cannot write PID file " + path);
  return fd;
}

// The heaps are put back here, before CRIU runs (every chunk written checked
// first; an intact heap file only read), with what they held saved on the
// side, to be put back if CRIU fails (what the job wrote since is not lost).
// The plugin then leaves them as they are. A clone's heaps are private copies
// the plugin makes in the clone's mount view: the originals are not touched.
class HeapRestore {
 public:
  HeapRestore(const WorkDir& work, bool clone, const heaps::HeapPolicy& policy) {
    if (clone) return;
    const std::string img = work.path + "/" + heaps::kImageName;
    if (!detail::path_exists(img)) return;  // the process mapped no DVR heap
    image_ = heaps::parse_image(detail::read_file(img));
    undo_.emplace(work.path + "/heaps-undo");
    try {
      heaps::restore_heaps(image_, policy, std::chrono::milliseconds(-1), &*undo_);
    } catch (...) {
      undo_->revert();
      throw;
    }
  }
  ~HeapRestore() {
    if (undo_ && !keep_) undo_->revert();
  }
  HeapRestore(const HeapRestore&) = delete;
  HeapRestore& operator=(const HeapRestore&) = delete;
  /// For CRIU's environment: the plugin finds the heaps done.
  std::vector<std::string> env() const {
    if (image_.heaps.empty()) return {};
    return {"DVR_CRIU_HEAPS_DONE=" + image_.snapshot};
  }
  /// CRIU succeeded: the restored heaps stay.
  void keep_restored() { keep_ = true; }
  /// One line per heap file the restore had to rewrite.
  std::vector<std::string> notes() const {
    std::vector<std::string> out;
    if (!undo_) return out;
    for (auto& [path, bytes] : undo_->created_files())
      out.push_back("heap " + path + ": was missing; created from the dump (" + std::to_string(bytes) + " bytes written, the rest reads zero)");
    for (auto& [path, bytes] : undo_->rewritten())
      out.push_back("heap " + path + ": " + std::to_string(bytes) +
                    " bytes differed from the dump (written after it, or changed behind dvr's back) and were put back");
    return out;
  }

 private:
  heaps::HeapImage image_;
  std::optional<heaps::HeapUndo> undo_;
  bool keep_ = false;
};

// Restored processes become our children when we wait for them.
struct Subreaper {
  bool on;
  explicit Subreaper(bool want) : on(want && ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0) {}
  ~Subreaper() {
    if (on) ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  }
  Subreaper(const Subreaper&) = delete;
  Subreaper& operator=(const Subreaper&) = delete;
};

// Runs `criu restore` of the images in `work`, detached, writing the restored
// root's PID to `pidfile`; with `stream`, CRIU reads them from `images`
// (--stream) instead of files. Throws when CRIU fails (nothing of it is left
// running then), with the damage `images` met if that is why.
void run_criu_restore(const Store& store, const std::string& name, [[maybe_unused]] const ProcInfo& p, [[maybe_unused]] const RestoreOptions& options,
                      const std::string& criu, const std::string& plugin, const WorkDir& work, const std::string& pidfile, const char* verb,
                      ImageServer& images, bool stream, CloneView& view, const std::vector<std::string>& env) {
  // A clone's network first: nothing else is started when it cannot be made.
  const std::function<bool()> in_child = view.in_child();
  std::vector<std::string> argv = {criu,        "restore", "-D", work.path, "-o", "restore.log", "-v2", "--libdir", plugin, "--restore-detached",
                                   "--pidfile", pidfile};
  // Established TCP connections (dumped with --tcp-established) come back
  // connected; a clone closes them (the original still holds them) unless
  // asked for them. Either way CRIU lifts the dump's nftables lock.
  if (options.tcp_established || (p.tcp_established && !options.clone))
    argv.insert(argv.end(), {"--tcp-established", "--network-lock", "nftables"});
  else if (p.tcp_established)
    argv.insert(argv.end(), {"--tcp-close", "--network-lock", "nftables"});
  if (stream) {
    argv.push_back("--stream");
    images.start();
  }
  std::string out;
  std::vector<std::string> criu_env = env;
  criu_env.push_back("DVR_CRIU_STORE=" + store.path());
  for (auto& e : images.criu_env())
    criu_env.push_back(e);
  std::string heap_dirs;
  for (auto& d : options.heap_dirs)
    heap_dirs += d + "\n";
  if (!heap_dirs.empty()) criu_env.push_back(std::string(heaps::kHeapDirsEnv) + "=" + heap_dirs);
  // Progress while CRIU runs: page image bytes handed to it, reported on
  // this thread; an exception of the callback waits until CRIU is done.
  detail::ProgressMeter meter(options.progress, images.page_image_bytes());
  meter.defer();
  meter.advance_to(images.page_bytes_done());  // written before CRIU started (older CRIU)
  std::function<void()> tick;
  if (meter) tick = [&] {
    meter.advance_to(images.page_bytes_done());
    meter.poll();
  };
  int rc = run_capture(argv, criu_env, &out, in_child, tick);
  std::exception_ptr served = images.stop();
  if (rc == 0 && (served || !images.all_filled())) {
    // CRIU finished but a process's memory was not filled (the plugin killed
    // what it could not fill): nothing of the tree may run.
    try {
      signal_tree(process_tree(static_cast<pid_t>(std::stol(detail::read_file(pidfile)))), SIGKILL);
    } catch (const std::exception&) {
      // no PID file: CRIU restored nothing that runs
    }
    if (!served) served = std::make_exception_ptr(Error(Errc::io, "CRIU restored the processes without asking dvr to fill their memory (is the DVR plugin " + plugin + " CRIU's?)"));
    rc = -1;
  }
  if (rc == 0) {
    meter.advance_to(images.page_bytes_done());
    meter.finish();  // rethrows a deferred exception of the callback: the process runs
    return;
  }
  auto [plugin_error, errors, log] = criu_failure(work, "restore.log", "restore-" + name + ".log");
  // What serving met: damage it found, or anything when CRIU says nothing
  // itself; not a pipe CRIU closed when CRIU failed on its own and says why
  // (that is only its consequence).
  if (served) {
    try {
      std::rethrow_exception(served);
    } catch (const Error& e) {
      if (e.code() == Errc::corrupt || rc == -1 || (plugin_error.empty() && errors.empty()))
        throw Error(e.code(), "cannot " + std::string(verb) + ": " + e.what() + " (CRIU stopped; nothing of it is left running)");
    }
  }
  if (rc == 126)
    throw Error(Errc::io, "cannot " + std::string(verb) + ": could not set up the clone's private mounts and network (" + out +
                              "); nothing of it is left running");
  if (!plugin_error.empty()) throw Error(Errc::io, "cannot restore process snapshot '" + name + "': " + plugin_error);
  throw Error(Errc::io, "CRIU could not restore process snapshot '" + name + "' (exit " + std::to_string(rc) +
                            "):" + (errors.empty() ? "\n  " + out : errors) + criu_hint(errors) + "\nfull log: " + log +
                            "\n(nothing of it is left running; `dvr proc check` checks CRIU and the kernel)");
}

// What differs from the dumping host without stopping the restore.
std::vector<std::string> host_notes(const ProcInfo& p, const std::string& version) {
  std::vector<std::string> notes;
  if (!p.kernel.empty() && p.kernel != kernel_release()) notes.push_back("dumped on kernel " + p.kernel + ", restored on " + kernel_release());
  if (!p.criu_version.empty() && p.criu_version != version) notes.push_back("dumped with CRIU " + p.criu_version + ", restored with " + version);
  return notes;
}

pid_t read_restored_pid(const std::string& pidfile, const std::string& name) {
  try {
    return static_cast<pid_t>(std::stol(detail::read_file(pidfile)));
  } catch (const std::exception&) {
    throw Error(Errc::io, "CRIU restored process snapshot '" + name + "' but wrote no PID file");
  }
}

// Writes the restored root's PID to the caller's PID file; when that fails,
// the restored tree is killed (nobody could find it) and this throws.
void write_user_pidfile(const Fd& fd, const std::string& path, pid_t pid) {
  if (!fd) return;
  std::string text = std::to_string(pid) + "\n";
  try {
    detail::write_all(fd.get(), text.data(), text.size(), path);
  } catch (const Error&) {
    signal_tree(process_tree(pid), SIGKILL);
    throw;
  }
}

// While a restore waits for its job: SIGINT, SIGTERM and SIGHUP sent to the
// waiting process (Ctrl-C, `timeout`) go on to the job, as they would reach
// a program run in the foreground, instead of ending the wait and leaving
// the job running detached.
std::atomic<pid_t> g_waited_job{0};
extern "C" void forward_to_job(int sig) {
  const pid_t job = g_waited_job.load();
  if (job > 0) ::kill(job, sig);
}

class ForwardSignals {
 public:
  explicit ForwardSignals(pid_t job) {
    g_waited_job = job;
    struct sigaction sa {};
    sa.sa_handler = forward_to_job;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (std::size_t k = 0; k < kSignals.size(); ++k)
      ::sigaction(kSignals[k], &sa, &old_[k]);
  }
  ~ForwardSignals() {
    for (std::size_t k = 0; k < kSignals.size(); ++k)
      ::sigaction(kSignals[k], &old_[k], nullptr);
    g_waited_job = 0;
  }
  ForwardSignals(const ForwardSignals&) = delete;
  ForwardSignals& operator=(const ForwardSignals&) = delete;

 private:
  static constexpr std::array<int, 3> kSignals{SIGINT, SIGTERM, SIGHUP};
  std::array<struct sigaction, 3> old_{};
};

// The exit status of our (subreaped) child `pid`, 128+N for signal N.
int wait_for(pid_t pid) {
  ForwardSignals forward(pid);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno == EINTR) continue;
    throw Error(Errc::io, "cannot wait for restored process " + std::to_string(pid) + ": " + std::strerror(errno));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

RestoreResult restore(Store& store, const std::string& name, const RestoreOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  const char* verb = options.clone ? "clone a process" : "restore a process";
  detail::check_name("process snapshot", name);
  ProcInfo p = info(store, name);
  // Where its heaps would go, first: a snapshot from elsewhere names paths of
  // its own choosing, refused here whatever else this host has or lacks.
  const heaps::HeapPolicy policy = heap_policy(store, options);
  check_heap_paths(p, name, policy);
  require_root(verb);
  const auto [criu, version] = criu_or_throw(verb);
  const std::string plugin = plugin_or_throw(options.plugin_dir, verb);
  check_host(p, name, verb);
  check_conflicts(p, name, options);
  CloneView view(store, name, p, options);  // a clone's namespaces, checked
  Fd user_pidfile = open_pidfile(options.pidfile);

  clean_stale_work(store.path());
  std::optional<WorkDir> work(std::in_place, store.path(), "restore-" + name);
  // CRIU >= 4.2 reads page images straight from the store; older ones read
  // files written here first.
  const bool stream = streams_pages(version);
  // CRIU >= 4.2 that streams: dvr writes the processes' pages into them
  // itself where the host allows it (faster than CRIU reading a pipe).
  std::optional<ImageServer> images(std::in_place, store, name, work->path, stream && ImageServer::fill_supported());
  if (!stream) images->write_page_images();
  HeapRestore heaps_back(*work, options.clone, policy);
  const bool wait = !options.detach && !options.clone;
  Subreaper subreaper(wait);
  const std::string pidfile = work->path + "/restored.pid";
  try {
    run_criu_restore(store, name, p, options, criu, plugin, *work, pidfile, verb, *images, stream, view, heaps_back.env());
  } catch (...) {
    images.reset();  // the store's lock, before the heaps' backup is removed
    throw;
  }
  images.reset();
  heaps_back.keep_restored();
  view.keep();

  RestoreResult r;
  r.notes = host_notes(p, version);
  for (auto& n : heaps_back.notes())
    r.notes.push_back(n);
  r.pid = read_restored_pid(pidfile, name);
  // The heaps' libdvr_heap.so learn at once that they were restored (who
  // they are now), rather than at their next look.
  std::vector<std::string> heap_paths;
  for (auto& h : p.heaps)
    heap_paths.push_back(h.path);
  heaps::wake_shims(heap_paths, process_tree(r.pid));
  view.report(r);
  r.seconds = since(t0);
  write_user_pidfile(user_pidfile, options.pidfile, r.pid);
  work.reset();  // the images are not needed while the job runs
  if (wait) r.exit_status = wait_for(r.pid);
  return r;
}

}  // namespace dvr::proc
