// DVR persistent heaps in whole-process snapshots: the part of the work that
// runs inside CRIU (criu-plugin/dvr_plugin.cpp) and is shared with `dvr proc`.
//
// A heap STORE/heaps/SESSION/REGION is snapshotted into its own store and
// session, as snapshot "proc.NAME" of region REGION, so it shares data with
// the application's own snapshots of it. When the application's session
// tracks writes, it leaves a tracking note beside the heap after each snapshot
// or restore (STORE/heaps/SESSION/.REGION.track): "in process P, the pages of
// this heap not written since they were write-protected equal snapshot S".
// The plugin checks the note against the process (start time, PID namespace,
// mapping, and that the range is still registered for write tracking), asks
// the kernel which pages were written (PAGEMAP_SCAN, read-only), and stores
// only those: the rest of the heap is neither read nor copied.
//
// Image file `dvr-heaps.img` (text, versioned; criu-plugin/README.md):
//   dvr-criu-heaps 1
//   snapshot <name>                                         (e.g. proc.night1)
//   heap <store>\t<session>\t<region>\t<bytes>\t<file path>  (one per heap)
//   end <number of heap lines>
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "track/heap_note.hpp"

namespace dvr::detail::heaps {

inline constexpr const char* kImageName = "dvr-heaps.img";
inline constexpr const char* kErrorName = "dvr-plugin-error.txt";

struct HeapFile {
  std::string store;    // the store holding the heap (and its snapshot)
  std::string session;  // the heap's session
  std::string region;   // the heap's region
  std::string path;     // the heap file
  std::uint64_t bytes = 0;
};

struct HeapImage {
  std::string snapshot;  // name of the heap snapshots, in each heap's session
  std::vector<HeapFile> heaps;
};

/// The store directory holding heap file `path` (STORE/heaps/SESSION/REGION
/// with STORE/DVRSTORE present), or "" when it is not a DVR heap.
std::string store_of_heap(const std::string& path);

/// Heap file `path` (STORE/heaps/SESSION/REGION) with its store, session
/// and region filled in (bytes 0). Throws invalid_argument when it is not a
/// DVR heap file, or its path holds a tab or newline.
HeapFile heap_file_of(const std::string& path);

/// DVR heap files that process `pid` maps shared (from /proc/PID/maps).
std::vector<std::string> mapped_heaps(pid_t pid);

/// Processes (other than `except`) that map `path` now: "PID (COMM)" each.
std::vector<std::string> processes_mapping(const std::string& path, pid_t except = 0);

/// True when a process other than `except` (0: none) maps the file `st`
/// writably (`shared_only`: shared and writable), or /proc cannot be read.
bool mapped_writable(const struct stat& st, pid_t except, bool shared_only);

/// How a heap was captured (for reports and tests).
struct HeapStats {
  std::uint64_t heaps_by_note = 0;  // heaps whose unwritten pages were taken from the note's snapshot
  std::uint64_t stored_bytes = 0;   // added to the stores
};

/// Snapshots the heap files mapped by process `pid` as snapshot `snapshot`
/// of each heap's own session. Where a valid tracking note exists, only the
/// pages written since are read; otherwise every page is compared with the
/// note's (or the session's newest) snapshot by hash. The process must be
/// frozen (CRIU has frozen it). pid 0: no process, compare by hash.
/// `lock_timeout`: StoreOptions::lock_timeout of the heaps' stores (the CRIU
/// plugin bounds it: the frozen process may hold a store's lock).
HeapImage snapshot_heaps(const std::vector<std::string>& files, pid_t pid, const std::string& snapshot, bool replace, HeapStats* stats = nullptr,
                         std::chrono::milliseconds lock_timeout = std::chrono::milliseconds(-1));

/// For each heap of `image` that libdvr_heap.so (`dvr run --heap`) owns in
/// frozen process `pid`: resets its write marks and leaves a tracking note
/// naming the heap snapshot just taken, so the next dump stores only the
/// pages written after this one. Heaps of SDK sessions are left alone (their
/// sessions keep their own notes). Returns how many notes were written.
std::size_t renew_shim_notes(const HeapImage& image, pid_t pid);

/// The holes of a heap file within its first `bytes` (SEEK_HOLE/SEEK_DATA),
/// as sorted byte ranges: they read zero, and reading them through a mapping
/// would allocate them.
std::vector<std::pair<std::uint64_t, std::uint64_t>> holes_of(int fd, std::uint64_t bytes);

/// The `.REGION.shim` file libdvr_heap.so keeps beside a heap it owns
/// (preload/README.md): the process and range it tracks, its control pipe
/// and, once sealed, the inode of the file it is sealed over.
struct ShimFile {
  std::uint64_t start_time = 0, pid_ns = 0, base = 0, size = 0;
  int request_fd = -1, answer_fd = -1;  // -1: a shim without a control pipe (format 1)
  std::uint64_t pipe_ino = 0;           // inode of the request pipe
  int wake_fd = -1;                     // the request pipe's read end (the shim's own)
  std::uint64_t sealed_ino = 0;         // 0: not sealed
};
std::string shim_path(const std::string& heap);
/// false when there is none or it is malformed.
bool read_shim(const std::string& heap, ShimFile& f);

/// Removes the heap snapshots an image refers to (missing ones are fine).
void remove_heaps(const HeapImage& image);

std::string format_image(const HeapImage& image);
/// Throws corrupt for anything but a complete image of a known version.
HeapImage parse_image(const std::string& text);

/// The store to take heap `h`'s snapshot from: `preferred` (the store the
/// process snapshot is restored from) when it holds it — a process snapshot
/// received from another machine brings its heap snapshots along — else the
/// heap's own store.
std::string heap_store(const HeapFile& h, const std::string& snapshot, const std::string& preferred,
                       std::chrono::milliseconds lock_timeout = std::chrono::milliseconds(-1));

/// Where a restore may write heap files (docs/migration.md, "Security
/// model"): the heap area of the store restored from (STORE/heaps) and the
/// directories the operator named (`--heap-dir DIR`, RestoreOptions::heap_dirs),
/// each as DIR/SESSION/REGION. A process snapshot's paths come from wherever
/// it was made: nothing else is written.
struct HeapPolicy {
  std::string store;              // the store restored from ("" = none: only `dirs`)
  std::vector<std::string> dirs;  // absolute directories the operator allows
};

/// Throws permission, naming the heap file and the option that allows
/// another directory, unless heap file `path` of heap session `session`
/// (region `region`, "" = not known) may be written under `policy`: a plain
/// absolute path (no "." or ".." component, no "//") exactly
/// ROOT/SESSION/REGION for a ROOT of the policy, with no symbolic link, no
/// non-directory and no other store on the way and no link or non-regular
/// file at the end; and, unless ROOT is one the operator named, its heap
/// snapshot in the store restored from (`source_store`: where it would be
/// read from). `what` begins the message ("process snapshot 'NAME'"). Reads
/// only (lstat).
void check_heap_path(const std::string& path, const std::string& session, const std::string& region, const std::string& source_store,
                     const HeapPolicy& policy, const std::string& what);

/// Puts every heap file of `image` back to its content at dump time (files
/// missing are created), taking each heap snapshot from heap_store() with
/// `policy.store` preferred. Every heap path is checked against `policy`
/// (check_heap_path) and every byte is checked before a file is changed. Throws invalid_argument when a
/// heap file exists with another size (changed behind dvr's back), corrupt /
/// not_found for a damaged or missing snapshot.
/// `lock_timeout` as for snapshot_heaps().
/// With `undo`, what the restore overwrites is saved there first, so the
/// caller can put the files back if what follows (CRIU) fails.
class HeapUndo;
void restore_heaps(const HeapImage& image, const HeapPolicy& policy, std::chrono::milliseconds lock_timeout = std::chrono::milliseconds(-1),
                   HeapUndo* undo = nullptr);

/// The environment variable that hands HeapPolicy::dirs to the CRIU plugin
/// (one directory a line), beside DVR_CRIU_STORE (HeapPolicy::store).
inline constexpr const char* kHeapDirsEnv = "DVR_CRIU_HEAP_DIRS";

/// The bytes restore_heaps() overwrote, kept in one file (`file`, removed
/// with this object): revert() puts every heap file back as it was.
class HeapUndo {
 public:
  explicit HeapUndo(std::string file);
  ~HeapUndo();
  HeapUndo(const HeapUndo&) = delete;
  HeapUndo& operator=(const HeapUndo&) = delete;
  /// Keeps [offset, offset + len) of heap file `fd` (`path`); `hole`: it
  /// reads zero and is not allocated (put back by punching it).
  void save(int fd, const std::string& path, std::uint64_t offset, std::uint64_t len, bool hole);
  /// Moves heap file `path` aside (a rename into the undo's directory), for
  /// a new file or a link to take its name; revert() moves it back.
  void set_aside(const std::string& path);
  /// Heap file `path` did not exist: the restore created it and wrote
  /// `bytes` of the snapshot into it (the rest reads zero); revert() removes it.
  void created(const std::string& path, std::uint64_t bytes);
  /// Best effort, newest first; throws nothing.
  void revert() noexcept;
  /// Heap file → bytes the restore rewrote there (pages that differed from
  /// the snapshot: written after the dump, or changed behind dvr's back).
  std::vector<std::pair<std::string, std::uint64_t>> rewritten() const;
  /// Heap files the restore created → bytes written into them.
  const std::vector<std::pair<std::string, std::uint64_t>>& created_files() const { return created_; }

 private:
  struct Piece {
    std::string path;
    std::uint64_t offset, len, at;  // at: where in the undo file (~0: was a hole)
  };
  std::string file_;
  int fd_ = -1;
  std::uint64_t used_ = 0;
  std::vector<Piece> pieces_;
  std::vector<std::pair<std::string, std::string>> aside_;  // heap file -> where it was moved
  std::vector<std::pair<std::string, std::uint64_t>> created_;  // heap files made by the restore
  void revert_pieces() noexcept;
};

}  // namespace dvr::detail::heaps
