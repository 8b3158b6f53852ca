// Memory DVR — whole-process snapshots with CRIU (docs/criu.md).
//
// A process snapshot NAME is kept in the store like any other snapshot:
//   proc/NAME       the CRIU images, one region per image file. Page images are
//                   cut into chunks like any memory, so a second dump of the
//                   same job stores only the pages that changed.
//   SESSION/proc.NAME  each DVR persistent heap (AllocOptions::persistent) the
//                   process mapped, snapshotted by the CRIU plugin while the
//                   process was frozen, in the heap's own store and session
//                   (so it shares data with the application's own snapshots);
//                   CRIU itself keeps only the heap's path.
// Dumping and restoring need root (CRIU does) and CRIU 4.x; the plugin
// (criu-plugin/, dvr_criu.so) is found as described at plugin_dir().
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dvr/store.hpp"

namespace dvr::proc {

/// The session of the store that holds process snapshots' CRIU images.
inline constexpr const char* kImageSession = "proc";
/// Heap snapshots are called kHeapPrefix + NAME in each heap's session.
inline constexpr const char* kHeapPrefix = "proc.";

/// A file the dumped processes mapped (program, libraries): CRIU needs it at
/// the same path with the same content to restore them.
struct MappedFile {
  std::string path;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
};

struct HeapRef {
  std::string path;         // the heap file (STORE/heaps/SESSION/REGION)
  std::uint64_t bytes = 0;  // its size
  std::string store;        // STORE
  std::string session;      // SESSION; the snapshot is SESSION/proc.NAME
  /// The heap was sealed at the dump (`dvr run --heap`, docs/criu.md): its
  /// snapshot is the heap file itself, linked into the store, not a copy.
  bool sealed = false;
};

struct ProcInfo {
  std::string name;
  std::int64_t time_ns = 0;        // when the dump was committed in this store (arrival, for a received one)
  std::uint64_t seq = 0;           // its snapshot's commit order in the store (SnapshotInfo::seq): decides "newest"
  std::int64_t origin_time_ns = 0; // when it was dumped (the sender's time for a received one)
  pid_t pid = 0;                   // the dumped root process, as its dumper saw it
  bool own_pid_namespace = false;  // it was PID 1 of its own PID namespace (`dvr run`)
  std::string command;             // its command line
  std::string criu_version;
  bool leave_running = false;
  /// Dumped with DumpOptions::tcp_established: its established TCP
  /// connections are in the images, and restore() brings them back.
  bool tcp_established = false;
  std::uint64_t image_bytes = 0;   // bytes of CRIU images
  std::uint64_t stored_bytes = 0;  // bytes the dump added to the store (images and heaps)
  std::string parent;              // the dump its data was compared with ("" = none)
  std::vector<HeapRef> heaps;
  std::vector<MappedFile> files;  // programs and libraries the processes mapped
  std::string kernel;             // `uname -r` of the dumping host
  double seconds = 0;             // dump: time taken (0 when listed)

  /// Received or imported from elsewhere (dumped at another time than it was
  /// committed here): the heap stores its metadata names are the sender's,
  /// so its heap snapshots are counted and removed in this store only.
  bool received() const { return origin_time_ns != time_ns; }
};

struct DumpOptions {
  bool leave_running = false;  // keep the process running after the dump
  /// Dump established TCP connections too (CRIU's --tcp-established, with
  /// its nftables network lock): the peers' packets are dropped from the
  /// dump until the restore, which brings the connections back with their
  /// sequence numbers and queues, so clients stay connected. Without it, a
  /// job holding a connected TCP socket cannot be dumped (listening sockets
  /// need nothing). The snapshot records it (ProcInfo::tcp_established).
  bool tcp_established = false;
  std::string plugin_dir;  // "" = plugin_dir()
  /// Bytes of the process's memory stored so far (see dvr::Progress). With
  /// CRIU >= 4.2 (pages streamed to dvr): the pages received from CRIU, with
  /// total 0 while CRIU runs (it decides what to dump), then the final call;
  /// with older CRIU: the image files stored after CRIU wrote them, out of
  /// their size. When it throws, the dump fails with nothing stored and the
  /// process goes on running (as for any failed dump).
  Progress progress;
};

struct RestoreOptions {
  /// Return once the process runs (its PID is returned). Otherwise restore()
  /// waits until the restored process exits and returns its exit status;
  /// meanwhile SIGINT, SIGTERM and SIGHUP of the calling process are passed
  /// on to it (the caller's own handlers are put back afterwards).
  bool detach = false;
  /// Restore beside a running original: a fresh PID namespace (the dump must
  /// come from a job in its own PID namespace, see run()), a private copy
  /// of every DVR heap, so the clone and the original do not share memory,
  /// and a mount namespace of its own in which each directory holding the
  /// job's Unix sockets is covered by a tmpfs with the directory's other
  /// entries bound back: the clone binds its own sockets there and never
  /// unlinks or takes over the original's (docs/criu.md).
  bool clone = false;
  /// A clone's network: "" = the host's, as the original's (a TCP port the
  /// original listens on is then taken: CRIU fails with "Address already in
  /// use"); "new" = a network namespace of its own, with lo up and a veth
  /// pair to the host (the clone's end eth0 at `ip`, the host's dvrXXXXXXXX
  /// at `host_ip`), which goes when the clone exits; otherwise an existing
  /// namespace: a name of `ip netns` (/run/netns/NAME) or a path
  /// (/proc/PID/ns/net), left as it is. CRIU runs inside it, so a socket the
  /// job listened on at 0.0.0.0:PORT listens there, reachable from the host
  /// at ip's address; one at 127.0.0.1 only from inside (nsenter -t PID -n).
  std::string net;
  /// With net "new": the clone's IPv4 address, ADDR/PREFIX (e.g.
  /// "10.213.0.2/24", prefix 1 to 30); "" = a /30 of 10.213.0.0/16 that no
  /// interface or route of the host uses (the clone .2, the host .1).
  std::string ip;
  /// With ip: the host end's address (ADDR, in ip's network); "" = the
  /// network's first host address other than ip's.
  std::string host_ip;
  std::string pidfile;     // write the restored root's PID there
  std::string plugin_dir;  // "" = plugin_dir()
  /// Directories, besides the heap area of the store restored from
  /// (STORE/heaps), in which the restore may write the snapshot's DVR heap
  /// files (each as DIR/SESSION/REGION; absolute paths). A process snapshot
  /// names its heap files by absolute path; one that names a path anywhere
  /// else (another store's heaps, "..", a symbolic link on the way, /etc/...)
  /// is refused with Errc::permission before anything is written, naming the
  /// path. Give the heap directory of another store here (`--heap-dir DIR`)
  /// to restore a snapshot whose heaps lived there (two stores on one host).
  std::vector<std::string> heap_dirs;
  /// Restore established TCP connections (CRIU's --tcp-established). A
  /// restore does so by itself for a snapshot dumped with them
  /// (ProcInfo::tcp_established); a clone restores them closed (--tcp-close:
  /// the original still holds them) unless this is set.
  bool tcp_established = false;
  /// Bytes of page images handed to CRIU (with CRIU older than 4.2: written
  /// for it before it starts), out of the snapshot's page images, reported
  /// while CRIU runs (see dvr::Progress). CRIU cannot be stopped halfway, so
  /// an exception of the callback is deferred: it is not called again, the
  /// restore completes (the process runs; its PID is in `pidfile` when
  /// given) and then the exception propagates.
  Progress progress;
};

struct RestoreResult {
  pid_t pid = 0;        // the restored root process
  int exit_status = 0;  // when not detached: its exit status (128+N for signal N)
  double seconds = 0;   // time until it ran
  /// What differs from the dumping host without stopping the restore (another
  /// kernel or CRIU version), one line each.
  std::vector<std::string> notes;
  /// A clone with RestoreOptions::net: "new" or the existing namespace's
  /// path; for "new" also the clone's address (ADDR/PREFIX), the host end's
  /// and the host end's interface. "" otherwise.
  std::string net, ip, host_ip, host_if;
};

/// One capability `dvr proc check` checks or probes.
struct Capability {
  std::string name;      // "root", "criu", "kernel", "plugin", "inet sockets", "tcp listen", ...
  bool ok = false;       // it works here
  bool required = true;  // false: dvr works without it, doing less (detail says what)
  bool checked = true;   // false: not checked (a capability it depends on is missing, or a quick check)
  std::string detail;    // what was found; or what is missing and what to do about it
};

/// What `dvr proc check` reports.
struct Preflight {
  bool ok = false;                       // every required capability works
  std::string criu;                      // path of the criu binary ("" = not found)
  std::string criu_version;              // e.g. "4.2.1"
  std::string plugin;                    // path of dvr_criu.so ("" = not found)
  std::vector<std::string> problems;     // the detail of each required capability checked and missing
  std::vector<Capability> capabilities;  // everything checked, in order
};

/// The directory holding dvr_criu.so: $DVR_CRIU_PLUGIN_DIR if set, else
/// criu-plugin/ beside the running program (a build tree), else
/// ../LIBDIR/dvr/criu next to it (an installed tree: `cmake --install`).
/// "" if none holds it.
DVR_EXPORT std::string plugin_dir();

/// Checks what dvr proc depends on: root, the criu binary ($DVR_CRIU or criu
/// on PATH, version 4 or newer), the kernel (`criu check`), the plugin, inet
/// sockets (CRIU >= 4.2 on Linux >= 6.16), and probes CRIU for real: a tiny
/// child process listening on TCP 127.0.0.1, then one holding an
/// established connection too (--tcp-established), each dumped and restored
/// in a private temporary directory and asked to answer afterwards. Also
/// reports what is optional (page streaming, write tracking). `quick` skips
/// `criu check` and the probes.
DVR_EXPORT Preflight preflight(const std::string& plugin_dir = "", bool quick = false);

/// Dumps the process tree rooted at `pid` into `store` as process snapshot
/// `name`. Without options.leave_running the tree is killed once dumped.
/// Throws not_found (no such process), already_exists, unsupported (CRIU or
/// plugin missing), io (CRIU failed: the message quotes its errors and names
/// its log). On failure nothing is added to the store and the process runs on.
DVR_EXPORT ProcInfo dump(Store& store, pid_t pid, const std::string& name, const DumpOptions& options = {});

/// Restores process snapshot `name`. Every byte is checked against its
/// checksum before CRIU starts. A preflight compares this host with the
/// dumping one first: every program and library the processes mapped must be
/// at the same path with the same size and modification time, else
/// unsupported lists what differs (a snapshot moved to another machine needs
/// the same binaries). Throws not_found, corrupt, io (its PIDs are in use, or
/// its heaps are mapped by a running process: stop the original or use
/// clone; or CRIU failed: no process of the snapshot is left running),
/// unsupported.
DVR_EXPORT RestoreResult restore(Store& store, const std::string& name, const RestoreOptions& options = {});

/// Process snapshots, oldest first.
DVR_EXPORT std::vector<ProcInfo> list(const Store& store);
/// One process snapshot. Throws not_found, corrupt.
DVR_EXPORT ProcInfo info(const Store& store, const std::string& name);
/// Removes a process snapshot and its heap snapshot. Throws not_found.
DVR_EXPORT void remove(Store& store, const std::string& name);

/// The process snapshot whose heap snapshot SESSION/NAME is (NAME is
/// kHeapPrefix + its name and it lists a heap of SESSION in this store), or
/// "" when none is: what removing SESSION/NAME alone would break.
DVR_EXPORT std::string heap_owner(const Store& store, const std::string& session, const std::string& name);

/// Throws invalid_argument, naming the process snapshot and `dvr proc rm`,
/// when SESSION/NAME is a heap snapshot a process snapshot still uses
/// (heap_owner): what remove_snapshot() refuses, for checking a list first.
DVR_EXPORT void check_removable(const Store& store, const std::string& session, const std::string& name);

/// Removes SESSION/NAME as `dvr rm` does: a process snapshot (session
/// kImageSession) with its heap snapshots, as remove() (one whose metadata
/// is damaged alone); a heap snapshot that a process snapshot still uses is
/// refused (invalid_argument naming it and `dvr proc rm`); anything else as
/// Store::remove. Throws not_found, invalid_argument.
DVR_EXPORT void remove_snapshot(Store& store, const std::string& session, const std::string& name);

struct RunOptions {
  std::string output;  // stdout and stderr of the job ("" = /dev/null)
  std::string cwd;     // working directory ("" = the caller's)
  /// > 0: the program's heap lives in a DVR persistent heap of this many
  /// bytes (rounded up to pages), `dvr run --heap` (docs/criu.md, "Unmodified
  /// programs"): its malloc family, C++ new and its own private anonymous
  /// mmap take memory from heap_path(heap_store, heap_session), mapped
  /// MAP_SHARED at kHeapAddress, so a dump stores only the pages written
  /// since the last one and CRIU copies none of them.
  std::uint64_t heap_bytes = 0;
  std::string heap_store;    // the store holding the heap (required with heap_bytes)
  std::string heap_session;  // the heap's session there (required with heap_bytes; must not have a heap yet)
};
/// Where `dvr run --heap` maps a program's heap (the same in every job: a
/// restored or cloned job keeps its addresses).
inline constexpr std::uint64_t kHeapAddress = 0x200000000000ull;
/// The heap file of `dvr run --heap` job with heap session `session`.
DVR_EXPORT std::string heap_path(const std::string& store, const std::string& session);
/// The preloaded library `dvr run --heap` uses: DVR_HEAP_PRELOAD, else
/// preload/libdvr_heap.so beside the running program (a build tree), else
/// <prefix>/lib/dvr/libdvr_heap.so. "" when none is there.
DVR_EXPORT std::string heap_preload();
/// Starts argv as PID 1 of a new PID namespace, in a session of its own, with
/// stdin from /dev/null: a job that can be dumped, restored and cloned without
/// PID clashes. Returns its PID as the caller sees it; the job is not the
/// caller's child. Needs root (or CAP_SYS_ADMIN).
/// The kernel drops signals at their default disposition sent to a
/// namespace's PID 1, so the job gets libdvr_init.so preloaded (found like
/// heap_preload(); $DVR_INIT_PRELOAD another file, set empty: none): as PID 1
/// it ends on SIGTERM, SIGINT, SIGHUP and SIGQUIT with status 128+N unless
/// the program handles or ignores them itself (a statically linked program
/// still ignores them).
/// With options.heap_bytes, returns once the heap is in place. Throws
/// unsupported for a statically linked or setuid program (the loader
/// preloads nothing into them) or when libdvr_heap.so is missing,
/// already_exists when the session has a heap, io when the program could not
/// set its heap up (the reason from the program).
DVR_EXPORT pid_t run(const std::vector<std::string>& argv, const RunOptions& options = {});

}  // namespace dvr::proc
