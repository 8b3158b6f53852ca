// Dumping a process tree into the store: proc::dump (dvr/proc.hpp, docs/criu.md).
//
// CRIU dumps the tree into a work directory (the plugin snapshots its DVR
// heaps meanwhile), leaving it stopped; the images become the regions of
// snapshot proc/NAME, page images as windows of the address space
// (proc_pages.hpp); only then is the tree killed (or, on failure, resumed).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/log.hpp"
#include "base/progress.hpp"
#include "base/mapping.hpp"
#include "base/os.hpp"
#include "dvr/proc.hpp"
#include "dvr/session.hpp"
#include "proc/catalog.hpp"
#include "proc/criu_runner.hpp"
#include "proc/heap_seal.hpp"
#include "proc/metadata.hpp"
#include "proc/page_stream.hpp"
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

// Refuses what cannot be dumped before anything runs.
void check_dump_request(const Store& store, pid_t pid, const std::string& name) {
  detail::check_name("process snapshot", name);
  if (name.size() > 120)
    throw Error(Errc::invalid_argument, "process snapshot name '" + name +
                                            "' is longer than 120 characters (the most for a process snapshot: its heaps' snapshots are named proc.NAME)");
  require_root("dump a process");
  if (pid <= 0 || ::kill(pid, 0) != 0) throw Error(Errc::not_found, "cannot dump process " + std::to_string(pid) + ": no such process");
  // A thread's id names no process tree CRIU can dump (it stops on an
  // internal BUG); the process it belongs to is what to dump.
  try {
    const std::string status = detail::read_file("/proc/" + std::to_string(pid) + "/status");
    const auto at = status.find("\nTgid:");
    if (at != std::string::npos) {
      const long tgid = std::strtol(status.c_str() + at + 6, nullptr, 10);
      if (tgid > 0 && tgid != pid)
        throw Error(Errc::invalid_argument, "cannot dump " + std::to_string(pid) + ": it is a thread of process " + std::to_string(tgid) +
                                                "; dump that process (`dvr proc dump " + std::to_string(tgid) + " --name " + name + "`)");
    }
  } catch (const Error& e) {
    if (e.code() == Errc::invalid_argument) throw;
  }
  // dvr inside the tree would be frozen by the CRIU it waits for: a hang.
  for (pid_t p : process_tree(pid))
    if (p == ::getpid())
      throw Error(Errc::invalid_argument, "cannot dump process " + std::to_string(pid) +
                                              ": it is dvr itself or one of its ancestors (the shell that runs dvr?), and CRIU would freeze "
                                              "dvr with it; dump a job started apart (`dvr run -- CMD` starts one)");
  for (auto& s : store.list(kImageSession))
    if (s.name == name)
      throw Error(Errc::already_exists, "process snapshot '" + name + "' exists already in store " + store.path() +
                                            "; pick another name or remove it with `dvr proc rm " + name + "`");
}

// What the metadata says of the process, as far as it is known before CRIU runs.
Meta describe(pid_t pid, const std::string& name, const std::string& criu_version, const DumpOptions& options) {
  Meta meta;
  ProcInfo& info = meta.info;
  info.name = name;
  info.pid = pid;
  info.own_pid_namespace = in_own_pid_namespace(pid);
  info.criu_version = criu_version;
  info.leave_running = options.leave_running;
  info.tcp_established = options.tcp_established;
  info.command = command_line(pid);
  info.kernel = kernel_release();
  return meta;
}

// Removes the heap snapshots the plugin took, and those of the heaps sealed
// before CRIU ran, when the dump fails.
void drop_plugin_heaps(const WorkDir& work, const heaps::HeapImage& sealed) {
  try {
    heaps::remove_heaps(heaps::parse_image(detail::read_file(work.path + "/" + heaps::kImageName)));
  } catch (const Error&) {
  }
  try {
    heaps::remove_heaps(sealed);
  } catch (const Error&) {
  }
}

// Runs `criu dump`, which leaves the tree stopped (or running), not killed,
// so that it goes on if storing its images fails. With `stream`, CRIU sends
// the pages to it (--page-server) instead of writing page images, and this
// thread serves it while CRIU runs on another. When CRIU fails, the stream is
// dropped, the tree is resumed, the plugin's heap snapshots are removed, and
// this throws. Returns what failed serving the stream while CRIU succeeded
// (null: nothing), for the caller to handle as a failure to store.
std::exception_ptr run_criu_dump(const std::string& criu, const std::string& plugin, pid_t pid, const std::string& name, const DumpOptions& options,
                                 const WorkDir& work, const std::vector<pid_t>& tree, std::optional<PageStream>& stream,
                                 const heaps::HeapImage& sealed) {
  std::vector<std::string> argv = {criu,  "dump",     "-t",   std::to_string(pid),
                                   "-D",  work.path,  "-o",   "dump.log",
                                   "-v2", "--libdir", plugin, options.leave_running ? "--leave-running" : "--leave-stopped"};
  // Established connections: CRIU locks each with an nftables table of its
  // own (in-process libnftables; no iptables binary needed), which stays
  // until the restore unlocks it, so the peers see no reset in between.
  if (options.tcp_established) argv.insert(argv.end(), {"--tcp-established", "--network-lock", "nftables"});
  std::string out;
  int rc = 0;
  std::exception_ptr served;
  // The heaps sealed before: the plugin records them without snapshotting them again.
  std::vector<std::string> env = {"DVR_CRIU_NAME=" + name};
  if (!sealed.heaps.empty()) env.push_back(std::string(heaps::kSealedEnv) + "=" + heaps::format_sealed(sealed.heaps));
  if (stream) {
    const int sk = stream->criu_socket();
    argv.insert(argv.end(), {"--page-server", "--ps-socket", std::to_string(sk)});
    std::thread runner([&] {
      rc = run_capture(argv, env, &out, [sk] { return ::fcntl(sk, F_SETFD, 0) == 0; });
      stream->close_criu_socket();  // CRIU is gone: serve() sees the end of the stream
    });
    try {
      stream->serve();
    } catch (...) {
      served = std::current_exception();
    }
    runner.join();
  } else {
    rc = run_capture(argv, env, &out);
  }
  if (rc == 0) return served;
  stream.reset();  // gives the store back before the heap snapshots are removed
  auto [plugin_error, errors, log] = criu_failure(work, "dump.log", "dump-" + name + ".log");
  drop_plugin_heaps(work, sealed);
  if (!options.leave_running) signal_tree(tree, SIGCONT);  // CRIU resumes it on failure; make sure
  if (!plugin_error.empty()) throw Error(Errc::io, "cannot dump process " + std::to_string(pid) + ": " + plugin_error);
  throw Error(Errc::io, "CRIU could not dump process " + std::to_string(pid) + " (exit " + std::to_string(rc) +
                            "):" + (errors.empty() ? "\n  " + out : errors) + criu_hint(errors) + "\nfull log: " + log +
                            "\n(`dvr proc check` checks CRIU and the kernel; a job started with `dvr run` dumps most reliably)");
}

// The image files of a dump, tracked as the regions of snapshot proc/NAME;
// what they are tracked from (mappings of the files, windows) lives as long.
struct Images {
  struct File {
    std::string region;
    const void* data;
    std::uint64_t size;
  };
  std::vector<Mapping> maps;
  std::vector<File> files;  // image files stored whole, mapped
  std::vector<std::unique_ptr<procpages::Windows>> windows;

  void* map_file(const std::string& path, std::uint64_t n, int fd) {
    // Writable (private: nothing reaches the file) because a tracked region
    // must be; only read here.
    maps.push_back(Mapping::file(fd, n, PROT_READ | PROT_WRITE, MAP_PRIVATE, "CRIU image " + path));
    return maps.back().data();
  }
};

// Page images go in as windows of the address space (proc_pages.hpp), so
// that what did not change is at the same place as in the previous dump.
// Those it cannot lay out are left to track_image_files(). (A dump through a
// PageStream has no page images: it lays them out itself.)
void track_page_images(Images& img, Session& session, const WorkDir& work, Meta& meta) {
  for (auto& f : detail::list_dir(work.path)) {
    if (f.rfind("pagemap-", 0) != 0) continue;
    std::string p = work.path + "/" + f;
    Fd fd = detail::open_or_throw(p, O_RDONLY);
    std::uint64_t n = detail::file_size(fd.get(), p);
    procpages::Pagemap pm;
    if (n == 0 || !procpages::parse_pagemap(static_cast<const char*>(img.map_file(p, n, fd.get())), n, pm)) continue;
    std::string pages = "pages-" + std::to_string(pm.pages_id) + ".img", pp = work.path + "/" + pages;
    if (!detail::path_exists(pp)) continue;
    Fd pfd = detail::open_or_throw(pp, O_RDONLY);
    std::uint64_t size = detail::file_size(pfd.get(), pp);
    auto w = std::make_unique<procpages::Windows>();
    if (size == 0 || !w->build(pm, pfd.get(), size, false, nullptr)) continue;  // stored as it is
    for (auto& win : w->windows())
      session.track(procpages::window_region(pm.pages_id, win.start), win.base, procpages::kWindow);
    img.windows.push_back(std::move(w));
    meta.paged_images.push_back({pages, f, size});
    meta.info.image_bytes += size;
  }
}

// Every other image file is a region of its own; the plugin's heap image
// also tells the metadata which heaps were snapshotted. CRIU writes some
// empty images: they are recorded by name (restore recreates them).
void track_image_files(Images& img, const WorkDir& work, Meta& meta) {
  ProcInfo& info = meta.info;
  for (auto& f : detail::list_dir(work.path)) {
    if (f == "dump.log" || f == heaps::kErrorName) continue;
    if (std::any_of(meta.paged_images.begin(), meta.paged_images.end(), [&](const PagedImage& g) { return g.pages == f; })) continue;
    std::string p = work.path + "/" + f;
    Fd fd = detail::open_or_throw(p, O_RDONLY);
    std::uint64_t n = detail::file_size(fd.get(), p);
    if (f == heaps::kImageName) info.heaps.clear();
    if (n == 0) continue;
    void* data = img.map_file(p, n, fd.get());
    info.image_bytes += n;
    if (f == heaps::kImageName) {
      heaps::HeapImage hi = heaps::parse_image(std::string(static_cast<const char*>(data), n));
      for (auto& h : hi.heaps)
        info.heaps.push_back({h.path, h.bytes, h.store, h.session});
    }
    img.files.push_back({f, data, n});
  }
  for (auto& f : detail::list_dir(work.path)) {
    if (f == "dump.log") continue;
    struct stat st {};
    if (::stat((work.path + "/" + f).c_str(), &st) == 0 && st.st_size == 0) meta.empty_images.push_back(f);
  }
}

// The newest intact earlier dump of the same command ("" = none): the new
// one is compared with it page by page, so what did not change is not
// stored again.
std::string newest_dump_of(const Store& store, const std::string& name, const std::string& command) {
  std::string base;
  for (auto& si : store.list(kImageSession)) {  // oldest first (commit order): the last one found is the newest
    if (si.damaged || si.name == name || command_of_label(si.label) != command) continue;
    base = si.name;
  }
  return base;
}

// The images become snapshot proc/NAME, with the metadata; fills in what
// the metadata learns on the way and what the snapshot took.
void store_images(Store& store, const std::string& name, const WorkDir& work, Meta& meta, const Progress& progress) {
  ProcInfo& info = meta.info;
  Images img;
  Session session(store, kImageSession, SessionOptions{.tracking = Tracking::hash});
  track_page_images(img, session, work, meta);
  track_image_files(img, work, meta);
  for (auto& f : img.files)
    session.track(f.region, const_cast<void*>(f.data), f.size);
  std::string text = encode_meta(meta);
  session.track(kMetaRegion, text.data(), text.size());
  if (!info.parent.empty()) session.base_on(info.parent);
  SnapshotInfo si = session.snapshot(name, {.label = label_for(info.pid, info.command), .progress = progress});
  info.time_ns = si.time_ns;
  info.seq = si.seq;
  info.origin_time_ns = si.origin_time_ns;
  info.stored_bytes = si.stored_bytes + account_heaps(store, info);
}

// The same after a dump whose pages went to `stream`: the other image files
// and the metadata join the windows stream wrote, and it publishes them.
void store_streamed_images(Store& store, PageStream& stream, const WorkDir& work, Meta& meta) {
  ProcInfo& info = meta.info;
  meta.paged_images = stream.paged_images();
  info.image_bytes += stream.page_bytes();
  Images img;
  track_image_files(img, work, meta);
  std::vector<detail::RegionSource> files;
  for (auto& f : img.files)
    files.push_back({f.region, static_cast<const char*>(f.data), f.size, false, std::nullopt});
  std::string text = encode_meta(meta);
  files.push_back({kMetaRegion, text.data(), text.size(), false, std::nullopt});
  SnapshotInfo si = stream.finish(files);
  info.time_ns = si.time_ns;
  info.seq = si.seq;
  info.origin_time_ns = si.origin_time_ns;
  info.stored_bytes = si.stored_bytes + account_heaps(store, info);
}

}  // namespace

ProcInfo dump(Store& store, pid_t pid, const std::string& name, const DumpOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  check_dump_request(store, pid, name);
  const auto [criu, version] = criu_or_throw("dump a process");
  const std::string plugin = plugin_or_throw(options.plugin_dir, "dump a process");
  Meta meta = describe(pid, name, version, options);

  clean_stale_work(store.path());
  WorkDir work(store.path(), "dump-" + name);
  const std::vector<pid_t> tree = process_tree(pid);
  meta.info.files = mapped_files(tree);
  meta.info.parent = newest_dump_of(store, name, meta.info.command);
  // The heaps of `dvr run --heap` programs: sealed and stored in place now,
  // while the program runs (heap_seal.hpp); the plugin copies the others.
  std::vector<std::string> not_sealed;
  const heaps::HeapImage sealed{
      std::string(kHeapPrefix) + name,
      heaps::seal_heaps(store, tree, std::string(kHeapPrefix) + name, meta.info.parent.empty() ? "" : kHeapPrefix + meta.info.parent, &not_sealed)};
  for (auto& why : not_sealed)
    DVR_LOG(warn, "dvr proc dump " + name + ": " + why);
  // CRIU 4.2 sends the pages straight to the store; older ones write page
  // images first.
  std::optional<PageStream> stream;
  // Progress: pages as CRIU streams them (total unknown until it is done).
  detail::ProgressMeter meter(options.progress);
  if (streams_pages(version)) {
    stream.emplace(store, name, meta.info.parent, label_for(meta.info.pid, meta.info.command));
    stream->set_progress(&meter);
  }
  std::exception_ptr served = run_criu_dump(criu, plugin, pid, name, options, work, tree, stream, sealed);
  try {
    if (served) std::rethrow_exception(served);
    if (stream) {
      if (stream->error() == nullptr) meter.finish();  // before the commit: a callback that throws stores nothing
      store_streamed_images(store, *stream, work, meta);
    } else {
      store_images(store, name, work, meta, options.progress);
    }
  } catch (const Error& e) {
    stream.reset();  // gives the store back before the heap snapshots are removed
    drop_plugin_heaps(work, sealed);
    if (options.leave_running) throw;
    signal_tree(tree, SIGCONT);
    throw Error(e.code(), std::string(e.what()) + " (the process was not stopped: it keeps running)");
  } catch (...) {
    // Not a dvr::Error (a progress callback's own exception): the same
    // cleanup, and it propagates as it is.
    stream.reset();
    drop_plugin_heaps(work, sealed);
    if (!options.leave_running) signal_tree(tree, SIGCONT);
    throw;
  }
  // Stored: now the job is stopped for good (dump without --leave-running).
  if (!options.leave_running) {
    signal_tree(tree, SIGKILL);
    // Returned once the job is gone: a restore right after must find its
    // ports and sockets free.
    wait_exited(tree, std::chrono::seconds(10));
  }
  meta.info.seconds = since(t0);
  return std::move(meta.info);
}

}  // namespace dvr::proc
