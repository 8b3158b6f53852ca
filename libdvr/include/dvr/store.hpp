// Memory DVR — the store: a directory that holds every snapshot.
//
// A store lives on persistent memory (a DAX file system), on a DRAM tmpfs
// (/dev/shm: survives process crashes, not reboots) or on any file system. It is
// created on first open, private to its owner (mode 0700), and safe to open from
// several processes at once: writers serialize on a lock file, readers never see
// a half-written snapshot. The on-disk format is specified in docs/format.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dvr/error.hpp"

namespace dvr {

namespace detail {
class StoreImpl;
}
class Clone;
struct CloneOptions;

/// What the store's directory is backed by, as found by asking libpmem2 for page
/// granularity and reading back what the mapping got.
enum class Medium {
  pmem,  // CACHE_LINE or BYTE granularity: data survives power loss once persisted
  dram,  // tmpfs/ramfs: survives process crashes, NOT reboots
  disk,  // any other file system: persisted with msync/fsync
};
DVR_EXPORT const char* medium_name(Medium medium) noexcept;

struct StoreOptions {
  /// Chunk size used when a new store is created (power of two, 4 KiB–16 MiB).
  /// An existing store keeps the chunk size it was created with. The chunk is
  /// the unit of deduplication between snapshots; changes within a chunk are
  /// stored page by page (docs/incremental.md), so large chunks cost little.
  std::uint32_t chunk_size = 256 * 1024;
  /// Create the store if the directory does not exist or is empty.
  bool create = true;
  /// How long a call on this handle waits for the store's lock when another
  /// process holds it (writers take it exclusively, readers shared; a
  /// snapshot holds it from its first read to its publication). Negative (the
  /// default): as long as it takes. Otherwise the call gives up after this
  /// long and throws Errc::io naming the store; nothing was changed, and the
  /// call can simply be tried again once the other process is done. 0 tries
  /// once. The CRIU plugin uses 5 s: the process it dumps is frozen and may be
  /// the one holding the lock.
  std::chrono::milliseconds lock_timeout{-1};
  /// The most threads one call on this handle runs at once (hashing,
  /// copying, checking: every pool the library starts for the store; a
  /// stream's reader or writer thread and a background snapshot's worker
  /// count one each). 0 (the default): $DVR_THREADS when set, else the
  /// number of CPUs in the affinity mask of the thread that opens the store
  /// (sched_getaffinity: an MPI rank pinned to 4 cores uses 4, not the
  /// machine's 128). Store::open throws invalid_argument for more than 1024,
  /// and for a $DVR_THREADS that is not a whole number from 1 to 1024.
  unsigned threads = 0;
};

struct RegionInfo {
  std::string name;
  std::uint64_t size = 0;
  bool sdk_owned = false;  // alloc()ed by the SDK rather than track()ed
};

/// One snapshot as recorded in its manifest.
struct SnapshotInfo {
  std::string session;
  std::string name;
  std::string parent;               // snapshot this one was taken after ("" = none)
  std::string label;                // free text given at snapshot time
  std::int64_t time_ns = 0;         // wall-clock time of the commit in this store (Unix epoch, ns;
                                    // for a received snapshot: when it arrived);
                                    // for a damaged snapshot, its file's modification time
  /// Commit order in this store: 1, 2, 3, ... every snapshot committed
  /// (taken, received, imported, replaced) gets one above every snapshot the
  /// store holds, whatever the clock says. "Newest" always means the highest
  /// seq (list order, latest(), `dvr recover`, prune, autosave and
  /// `proc dump --keep` retention). A received snapshot is numbered when it
  /// arrives. Snapshots written by a dvr older than manifest v4 record none:
  /// they are numbered 1, 2, ... within their session by (time_ns, name),
  /// below every snapshot committed since (docs/format.md, "Snapshot order").
  std::uint64_t seq = 0;
  /// When the snapshot was first made (Unix epoch, ns): time_ns for one taken
  /// in this store; for a received or imported one, the sender's origin time
  /// (kept through any number of hops). Reported, and used by the time
  /// buckets of prune; never to decide which snapshot is newest.
  std::int64_t origin_time_ns = 0;
  std::uint64_t logical_bytes = 0;  // sum of region sizes
  std::uint64_t stored_bytes = 0;   // bytes this snapshot added to the store when taken
  std::uint64_t chunks = 0;         // chunk references (including all-zero chunks)
  std::uint64_t zero_chunks = 0;    // all-zero chunks (never stored)
  std::vector<RegionInfo> regions;
  /// How it was taken: "write_protect" (only chunks with written pages were
  /// read; the rest came from the parent), or "hash" (all memory was read).
  std::string tracking;
  std::uint64_t chunks_read = 0;  // chunks hashed (whole or page by page) to take it
  /// Set when the manifest cannot be read or fails its checksum; `damage` says
  /// why. Damaged snapshots are listed so that nothing disappears silently; they
  /// cannot be restored. `dvr verify` also checks their chunk data.
  bool damaged = false;
  std::string damage;
  /// Set in what Session::snapshot() returns for a background snapshot still
  /// being written: only session, name, parent and label are known yet.
  bool pending = false;
};

/// One problem found by Store::verify().
struct VerifyProblem {
  std::string session;
  std::string snapshot;  // "" for problems not tied to a snapshot
  std::string what;      // what is wrong and what to do
};

struct DVR_EXPORT VerifyReport {
  std::uint64_t snapshots = 0;  // manifests examined
  std::uint64_t chunks = 0;     // distinct stored chunks re-hashed
  std::uint64_t bytes = 0;      // bytes re-hashed
  std::vector<VerifyProblem> problems;
  /// Not damage (ok() ignores them): loosened permissions of the store — its
  /// directory as open found it, and directories or files of it that group
  /// or others may read or write — one line each, saying what to do.
  std::vector<std::string> warnings;
  /// Names ("session/snapshot") of every damaged snapshot, sorted, once each.
  std::vector<std::string> damaged_snapshots() const;
  bool ok() const { return problems.empty(); }
};

struct GcReport {
  std::uint64_t bytes_before = 0;        // space used by pack files before gc
  std::uint64_t bytes_after = 0;         // ... and after
  std::uint64_t packs_removed = 0;       // pack files deleted because nothing referenced them
  std::uint64_t temp_files_removed = 0;  // leftovers of snapshots interrupted by a crash
};

struct StoreStats {
  std::string path;
  Medium medium = Medium::disk;
  std::uint32_t format_version = 0;
  std::uint32_t chunk_size = 0;
  std::uint64_t sessions = 0;
  std::uint64_t snapshots = 0;
  std::uint64_t logical_bytes = 0;  // sum over snapshots of their logical size
  std::uint64_t pack_bytes = 0;     // space actually used by pack files
  std::uint64_t pack_files = 0;
  /// Loosened permissions, as in VerifyReport::warnings.
  std::vector<std::string> warnings;
};

/// How one region differs between two snapshots (Store::diff).
struct RegionDiff {
  std::string name;
  std::uint64_t size_a = 0, size_b = 0;  // 0 where the region is missing
  bool only_in_a = false, only_in_b = false;
  std::uint64_t bytes_differ = 0;  // differing bytes, plus the size difference
  std::uint64_t pages_differ = 0;  // 4 KiB pages with any difference (or present in one only)
};

/// Progress callback for long operations: `done` out of `total` bytes (what
/// counts as a byte is said at each operation). The contract, for every
/// operation that takes one:
///  - It is called on the thread that called the operation, never on
///    another (worker threads only count), so it may take the GIL or touch
///    a terminal. It runs while the operation holds the store (this
///    process's use of it and, for writers, the store's writers' lock): a
///    slow callback slows the operation and waits other callers on the same
///    store, nothing else; it must not call into the same store itself.
///    (Bindings that take a lock inside the callback, such as Python's GIL,
///    must release it around every call into a store, so that another
///    thread waiting for the store never holds what the callback needs.)
///  - `done` never decreases; `total` never decreases. When the amount of
///    work is not known in advance, `total` is 0 until it is (a stream from
///    a pipe) or grows as it is learnt; otherwise done <= total.
///  - At most about ten calls a second (100 ms apart), the first no sooner
///    than 100 ms after the start (a quick operation calls it once), and,
///    when the operation succeeds, one final call with done == total.
///  - When it throws, it is not called again and the operation stops as
///    soon as it safely can, with nothing half done: a snapshot, receive, gc
///    or verify fails with the callback's exception and leaves the store as
///    it was (nothing published, no space lost); a restore rethrows it at
///    once while it is still checking the stored data (live memory not yet
///    changed), but once it has started writing live memory it finishes
///    (memory is then exactly the snapshot) and throws the exception after.
///    A send stops and the stream ends unfinished (the receiver stores
///    nothing). That is the way to cancel an operation from its callback.
using Progress = std::function<void(std::uint64_t done, std::uint64_t total)>;

/// What Store::prune() keeps, like restic's `forget --keep-*`. Each rule
/// keeps snapshots independently; a snapshot kept by any rule is kept. The
/// keep-hourly/daily/weekly/monthly rules split time into buckets (hours,
/// days, ISO weeks, months, in UTC) and keep the newest snapshot of each of
/// the newest N buckets that hold one. A policy with every field 0 keeps
/// nothing and is refused (invalid_argument): give at least one rule.
struct PrunePolicy {
  unsigned keep_last = 0;                 // the newest N snapshots
  std::chrono::seconds keep_within{0};    // snapshots taken within this long of the newest one
  unsigned keep_hourly = 0, keep_daily = 0, keep_weekly = 0, keep_monthly = 0;
};

/// What prune decided for one snapshot.
struct PruneDecision {
  SnapshotInfo snapshot;
  bool keep = false;
  /// Why: the rules that keep it ("last 3", "within 2h", "hourly
  /// 2026-12-01T13", "daily 2026-12-01", "weekly 2026-W48", "monthly
  /// 2026-12"), "kept: damaged (...)", "kept: the DVR heap of process
  /// snapshot proc/NAME", or "removed", with what still refers to it
  /// ("; an open clone keeps its data until it is closed", "; parent of X,
  /// which stays complete").
  std::string reason;
};

struct PruneReport {
  /// Every snapshot of the session, oldest first.
  std::vector<PruneDecision> decisions;
  std::uint64_t removed = 0;  // snapshots removed (would be, for a dry run)
  bool dry_run = false;
};

/// A handle to an open store. Cheap to copy; all copies share one open store.
class DVR_EXPORT Store {
 public:
  /// Opens (and, with options.create, creates) the store in `path`.
  /// Throws not_found (no such directory and create=false), invalid_argument
  /// (a non-empty directory that is not a store), unsupported (a store written
  /// by a newer dvr), permission (a store owned by another user), corrupt (a
  /// damaged superblock). A store directory open to group or others is made
  /// 0700 again, with a warning through the log sink (dvr/log.hpp) that
  /// verify() and stats() repeat.
  static Store open(const std::string& path, const StoreOptions& options = {});

  /// Opens default_path().
  static Store open_default(const StoreOptions& options = {});

  /// $DVR_STORE if set, else /dev/shm/dvr-<uid> (a DRAM store), else
  /// $HOME/.local/share/dvr.
  static std::string default_path();

  /// The store's directory as an absolute path: a relative `path` given to
  /// open() is taken from the working directory at that moment.
  const std::string& path() const;
  Medium medium() const;
  std::uint32_t chunk_size() const;

  /// Sessions that have at least one snapshot, sorted by name.
  std::vector<std::string> sessions() const;

  /// Snapshots of one session, oldest first in commit order (SnapshotInfo::seq,
  /// not the clock). Damaged ones are included and marked. An unknown session gives an empty list.
  std::vector<SnapshotInfo> list(const std::string& session) const;

  /// Snapshots of every session.
  std::vector<SnapshotInfo> list() const;

  /// One snapshot. Throws not_found or corrupt.
  SnapshotInfo info(const std::string& session, const std::string& snapshot) const;

  /// Deletes a snapshot. Data no other snapshot shares becomes free space:
  /// later snapshots reuse it (its memory stays allocated, which keeps them
  /// fast) and gc() returns it to the file system. Throws not_found.
  void remove(const std::string& session, const std::string& snapshot);

  /// Reclaims the space of data no snapshot references any more (removed
  /// snapshots, snapshots interrupted by a crash). Crash-safe: it only ever frees
  /// unreferenced data. Refuses (corrupt) while a manifest is unreadable, since
  /// it cannot tell what that snapshot references: remove it first.
  /// `progress`: bytes of pack files examined, out of the pack files' size
  /// (see Progress for the contract; when it throws, gc stops between two
  /// packs: what it freed is free, nothing else changed).
  GcReport gc(const Progress& progress = {});

  /// Removes the snapshots of `session` that `policy` does not keep (see
  /// PrunePolicy) and returns a decision for each snapshot. Every decision
  /// is made before anything is removed, and the removal happens under the
  /// writers' lock, so a snapshot taken meanwhile is neither lost nor
  /// counted. Damaged snapshots are never removed (reported, kept); a DVR
  /// heap snapshot (proc.NAME) is left to its process snapshot. Snapshots
  /// are self-contained (docs/format.md): removing one never breaks another,
  /// and an open clone keeps its data until it is closed; decisions say so.
  /// For session "proc" (process snapshots), each removal also removes the
  /// process snapshot's heap snapshots, as `dvr proc rm` does. The space is
  /// reused by later snapshots; gc() returns it to the file system. With
  /// dry_run, nothing changes. Throws invalid_argument (a policy that keeps
  /// nothing, a bad name), not_found (no such session in this store).
  PruneReport prune(const std::string& session, const PrunePolicy& policy, bool dry_run = false);

  /// The thread bound of this store (StoreOptions::threads, resolved).
  unsigned threads() const;

  /// Re-reads every manifest and re-hashes every stored chunk. Never throws for
  /// damage: each problem is reported with the snapshots it affects.
  /// `progress`: bytes re-hashed out of the bytes to re-hash. Also reports
  /// loosened permissions (VerifyReport::warnings), which are not damage.
  VerifyReport verify(const Progress& progress = {}) const;

  /// Counts and sizes, and loosened permissions (StoreStats::warnings).
  StoreStats stats() const;

  /// Compares two snapshots (of any sessions) region by region, byte by byte
  /// where their chunks differ. Both snapshots' data is checked against its
  /// checksums. Throws not_found or corrupt.
  std::vector<RegionDiff> diff(const std::string& session_a, const std::string& snapshot_a, const std::string& session_b,
                               const std::string& snapshot_b) const;

  /// The newest snapshot of `session` (the highest SnapshotInfo::seq: committed
  /// last in this store, whatever the clock said) whose manifest and data are
  /// intact (every chunk re-hashed), or no value when there is none. Newer damaged snapshots
  /// are skipped and listed in *skipped ("session/name: why") if given. After a
  /// crash this names the snapshot to restore.
  std::optional<SnapshotInfo> latest(const std::string& session, std::vector<std::string>* skipped = nullptr) const;

  /// A thin, copy-on-write clone of a snapshot (see dvr/clone.hpp). Throws
  /// not_found, or corrupt when options.verify finds damage (nothing mapped).
  Clone open_snapshot(const std::string& session, const std::string& snapshot, const CloneOptions& options) const;
  Clone open_snapshot(const std::string& session, const std::string& snapshot) const;

 protected:
  /// The shared state (private to libdvr; its own layers reach it).
  std::shared_ptr<detail::StoreImpl> impl_;

 private:
  explicit Store(std::shared_ptr<detail::StoreImpl> impl) : impl_(std::move(impl)) {}
};

/// Splits a snapshot reference "SESSION/NAME" ("proc/NAME" for a process
/// snapshot) into {SESSION, NAME}. Throws invalid_argument unless it is two
/// non-empty parts around one '/' (the parts are checked as names where used).
DVR_EXPORT std::pair<std::string, std::string> split_ref(const std::string& ref);

/// Whether `name` is a valid session or snapshot name: 1 to 128 characters of
/// [A-Za-z0-9._-], not starting with '.' (so it never names anything outside
/// its directory). The rule every call of the library checks names by.
DVR_EXPORT bool is_valid_name(const std::string& name) noexcept;

}  // namespace dvr
