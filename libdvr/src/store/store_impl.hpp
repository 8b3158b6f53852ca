// The shared state behind dvr::Store handles. Private to libdvr.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>

#include "dvr/log.hpp"
#include "dvr/store.hpp"
#include "base/flat_map.hpp"
#include "format/manifest.hpp"
#include "base/os.hpp"
#include "format/pack.hpp"
#include "store/live_space.hpp"

namespace dvr::detail {

class ProgressMeter;

inline constexpr std::uint32_t kStoreFormatVersion = 1;
inline constexpr const char* kSuperblockName = "DVRSTORE";
inline constexpr const char* kManifestSuffix = ".snap";
inline constexpr const char* kWritersLockName = "writers.lock";
inline constexpr std::uint64_t kInitialPackSize = 64ull << 20;  // packs start small, and double up to kMaxPackSize

/// Throws invalid_argument unless `name` is 1–128 characters of [A-Za-z0-9._-]
/// not starting with '.', so it can never name anything outside its directory.
void check_name(const char* kind, const std::string& name);

/// `dvr --store PATH`, PATH as shell_word(): the start of a command a
/// message suggests, for the store at PATH.
inline std::string dvr_for(const std::string& store_path) { return "dvr --store " + dvr::shell_word(store_path); }

/// " (did you mean 'X'?)" for the name in `known` closest to `want` (edit
/// distance at most a third of its length, at least 1), or "" when none is
/// close: the hint of a not_found error.
std::string did_you_mean(const std::string& want, const std::vector<std::string>& known);

/// The thread bound of a store opened with StoreOptions::threads = `requested`:
/// `requested` when not 0, else $DVR_THREADS, else affinity_cpus(). Throws
/// invalid_argument for a requested count or a $DVR_THREADS above kMaxThreads,
/// and for a $DVR_THREADS that is not a whole number from 1 to kMaxThreads.
inline constexpr unsigned kMaxThreads = 1024;
unsigned resolve_threads(unsigned requested);

bool valid_name(const std::string& name);

class StoreImpl {
 public:
  StoreImpl(const std::string& path, const StoreOptions& options);

  std::string path;
  std::string uuid;
  std::uint32_t chunk_size = 0;
  std::uint32_t format_version = 0;
  Medium medium = Medium::disk;
  /// How long Lock waits for the store lock (StoreOptions::lock_timeout;
  /// negative: as long as it takes).
  std::chrono::milliseconds lock_timeout{-1};
  /// The most threads one operation on this store runs at once
  /// (StoreOptions::threads, else $DVR_THREADS, else the CPUs of the opening
  /// thread's affinity mask): every parallel_for passes it.
  unsigned threads = 1;

  /// Serializes this process's use of the store (index, pack mappings).
  std::mutex mu;
  std::unique_ptr<Packs> packs;

  std::string sessions_dir() const { return path + "/sessions"; }
  std::string session_dir(const std::string& s) const { return sessions_dir() + "/" + s; }
  std::string manifest_path(const std::string& s, const std::string& n) const { return session_dir(s) + "/" + n + kManifestSuffix; }
  std::string tmp_dir() const { return path + "/tmp"; }
  std::string pins_dir() const { return path + "/pins"; }
  /// Manifest copies held by live clones (pins/*.snap): their data is in use.
  std::vector<std::string> pin_files() const;

  /// "session/name" for messages.
  static std::string ref(const std::string& s, const std::string& n) { return s + "/" + n; }

  /// Reads and checks a manifest, and (unless told not to) fills in its page
  /// hashes. Throws not_found or corrupt. `raw`, when given, receives the
  /// file's bytes.
  Manifest load_manifest(const std::string& session, const std::string& name, std::string* raw = nullptr, bool with_page_hashes = true) const;
  /// Fills m.page_hashes from the page hash files; where those are missing or
  /// disagree with a chunk's hash, from the stored pages themselves.
  void hydrate(Manifest& m) const;

  /// Session directories with valid names, unsorted.
  std::vector<std::string> session_names() const;
  /// Loosened permissions (docs/format.md, "Permissions"): the store
  /// directory's mode as open found it (open makes it 0700 again), and every
  /// directory or file of the store that group or others may read, write or
  /// enter now. One line each (at most a few per kind, then a count), saying
  /// what to do; empty when the store is private. For verify() and stats().
  std::vector<std::string> permission_warnings() const;
  std::string loosened_at_open;  // the warning open logged, or ""
  /// Snapshot names of a session, unsorted (from the directory).
  std::vector<std::string> snapshot_names(const std::string& session) const;
  /// Whether session/name has a manifest (damaged or not, any kind of
  /// file), without reading it: whether snapshot_names would list it.
  /// Throws invalid_argument for a bad session name; false for a bad
  /// snapshot name.
  bool has_manifest(const std::string& session, const std::string& name) const;

  /// Publishes `m` atomically (replacing an existing one of that name) and
  /// sets m.checksum.
  void publish_manifest(Manifest& m);
  /// True when the published manifest of m.session/m.name is `m` (its
  /// checksum matches): then `m` may be used instead of reading it again.
  bool manifest_unchanged(const Manifest& m) const;
  /// True when the index holds this version of session/name: then every
  /// location it references is in use and unchanged. Call after refresh_index().
  bool manifest_indexed(const std::string& session, const std::string& name, std::uint64_t checksum) const;

  /// Brings the chunk index and the map of live pack space up to date with
  /// every published manifest (new, replaced and removed ones). Call with the
  /// exclusive lock held.
  void refresh_index(bool full = false);
  /// Location of a chunk stored whole with this hash that holds exactly the
  /// `length` bytes at `data`, or nullptr. The bytes are compared: a hash match
  /// alone could be a collision, and a damaged copy must not make a snapshot
  /// of intact memory unrestorable. Thread-safe after Packs::map_all().
  const ChunkRef* find_chunk(const Hash128& h, const char* data, std::uint32_t length) const;
  /// Registers a manifest just published as `file` (saves re-reading it).
  void index_published(const std::string& file, const Manifest& m);
  /// The sequence number of the next snapshot committed (docs/format.md,
  /// "Snapshot order"): one above the highest seq of any manifest present
  /// (pins included) and above the count of manifests that record none
  /// (written before manifest v4; Store::list numbers those 1, 2, ... within
  /// their session). Recovered from the manifests themselves, so nothing can
  /// go stale. Call after refresh_index() with the writers' lock held.
  std::uint64_t next_seq() const;

  struct Placement {
    std::uint32_t pack = 0;
    std::uint64_t offset = 0;
  };
  /// Finds `length` contiguous bytes of free pack space (space no published
  /// manifest references and no allocation in flight uses: removed snapshots,
  /// interrupted writes), growing the newest pack or creating one when no free
  /// range is large enough. Call after refresh_index() with the exclusive lock
  /// held, through an AllocationScope.
  /// `writer`: which of a snapshot's concurrent writers asks (0, 1, ...).
  /// On memory media each grows packs of its own ((id - 1) % threads ==
  /// writer % threads), because tmpfs copies into one file one writer at a time.
  Placement allocate(std::uint64_t length, std::optional<Placement> hint = std::nullopt, unsigned writer = 0);
  /// For tests only (tests/unit/aged_store_test.cpp; nothing public sets it):
  /// new data goes at or beyond this offset of a pack, and packs may grow to
  /// it plus kMaxPackSize, so that data lies past 4 GiB in a sparse pack
  /// without 4 GiB being written below it. 0: from the pack's header on.
  std::uint64_t test_first_offset = 0;

  /// The pack space handed out while one snapshot is written. take() may be
  /// called from several threads; everything taken counts as occupied until
  /// the scope ends (after the manifest is published, or on failure, when the
  /// space is simply free again).
  class AllocationScope {
   public:
    explicit AllocationScope(StoreImpl& store) : store_(store) {}
    ~AllocationScope();
    AllocationScope(const AllocationScope&) = delete;
    AllocationScope& operator=(const AllocationScope&) = delete;
    /// Space for writer `writer` (Lane::index), right after the last block
    /// that writer took when that is free.
    std::pair<Placement, PackWriter> take(std::uint64_t length, unsigned writer = 0);
    /// The snapshot was published: the space taken is now live.
    void commit() { committed_ = true; }

   private:
    StoreImpl& store_;
    std::mutex mu_;
    bool committed_ = false;
    std::vector<std::optional<Placement>> next_;  // per writer
  };

  /// A stored range a manifest uses: a chunk, or a page stored apart.
  struct Ref {
    std::uint64_t offset = 0;
    std::uint32_t pack = 0;
    std::uint32_t length = 0;
  };
  /// The ranges `m` uses (a location shared by several chunks appears once per chunk).
  static std::vector<Ref> refs_of(const Manifest& m);

  /// Marks that stored data was freed (gc): every process rebuilds its index.
  void bump_epoch();

  /// The store's change counter, STORE/changes (docs/format.md, "Change
  /// counter"): every change to what sessions/ and pins/ hold adds one, so
  /// that refresh_index() re-reads the manifests only when something
  /// changed. A publish counts before its rename (under writers.lock, which
  /// every refresh holds, so no refresh sees the count without the file, and
  /// a crash between the two costs one needless re-read); a removal and a
  /// new pin count after their unlink or rename (a refresh that misses one
  /// sees the count go up next time). Incremented under an flock of the
  /// file, so no increment is lost. `own`: this handle's index already
  /// reflects the change (it indexes its publish itself, or drops a removed
  /// manifest itself), so when nobody else changed the store since its last
  /// refresh, the index stays current without a re-read. Throws io when the
  /// counter cannot be kept (then a publish or pin must not happen; a
  /// removal that happened is only seen late, which frees its space late).
  void count_change(bool own);
  /// Forgets manifest `file` in the index (its uses and dedup entries), as a
  /// re-read would after it was removed.
  void forget_indexed(const std::string& file);
  /// Gives back the space of replaced manifests (see retired_) once no
  /// reader can still use it: when the exclusive `lock` can be had without
  /// waiting. Called as a WriteBatch begins, under `mu`: this handle holds
  /// no data lock then (every one is taken under `mu`), so the try cannot
  /// convert a lock of its own.
  void release_retired();

  /// flock on one of the store's lock files (docs/format.md, "Locks").
  /// Kind::data (`lock`): shared while stored data is read, exclusive while
  /// data may be freed (remove, gc). Kind::writers (`writers.lock`):
  /// exclusive while snapshots are written (WriteBatch) or space is reclaimed
  /// (gc), so that one process at a time allocates pack space; readers do not
  /// wait for writers. Order: writers before data.
  class Lock {
   public:
    enum class Kind { data, writers };
    Lock(const StoreImpl& s, bool exclusive, Kind kind = Kind::data);
    ~Lock();
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;

   private:
    int fd_;
  };

 private:
  void create_or_check(const StoreOptions& options);
  std::string read_epoch() const;

  // Identity of a manifest file's current version (a replaced manifest is a
  // new file: another inode, size or modification time).
  struct FileKey {
    std::uint64_t ino = 0, size = 0;
    std::int64_t mtime_ns = 0;
    std::uint64_t checksum = 0;
    bool operator==(const FileKey&) const = default;
  };
  struct Indexed {
    FileKey key;
    std::vector<Ref> refs;  // stored chunks and overlay pages
    std::uint64_t seq = 0;  // the manifest's seq (0: a manifest older than v4)
  };
  struct Live {
    std::uint64_t length = 0;
    std::uint32_t refs = 0;  // manifests referencing this location
    bool indexed = false;    // `hash` is in index_ for this location
    Hash128 hash;
  };
  bool range_free(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const;
  // Counts the uses of `m` (and indexes its whole chunks for dedup); returns
  // what drop_refs() needs to take them back.
  std::vector<Ref> add_refs(const Manifest& m);
  void drop_refs(const std::vector<Ref>& refs);
  // The uses of a manifest that was replaced (published over, by this handle
  // or another process): a reader that loaded the old version before the
  // rename may still be reading its chunks under the shared `lock` (a
  // removal waits for the exclusive lock; a replace does not), so its space
  // stays in use until release_retired() finds no reader left.
  std::vector<std::vector<Ref>> retired_;
  void retire(std::vector<Ref>&& refs) { retired_.push_back(std::move(refs)); }
  static std::uint64_t location_key(std::uint32_t pack, std::uint64_t offset) { return std::uint64_t{pack} << 32 | offset / kPageSize; }
  static bool key_of(const std::string& file, FileKey& key);

  mutable Fd lock_fd_;
  mutable Fd writers_fd_;                                                  // writers.lock, opened on first use
  mutable pid_t owner_pid_ = 0;                                            // process that opened lock_fd_
  mutable bool forked_ = false;                                            // used from a forked child: re-read everything
  std::unordered_map<Hash128, ChunkRef, Hash128Hasher> index_;             // hash -> a live location
  FlatMap<Live> uses_;                                                     // location_key(pack, offset) -> use
  LiveSpace live_{kPackHeaderSize};                                        // pack space in use (page-rounded), gaps by size
  std::map<std::string, Indexed> indexed_;                                 // manifest path -> its chunks
  std::set<std::string> unreadable_;                                       // manifests that failed to decode
  // While a manifest is unreadable its data cannot be told from free space;
  // new data then goes only to a pack created after it was seen.
  std::uint32_t quarantine_pack_ = 0;
  struct InFlight {
    std::uint32_t pack;
    std::uint64_t offset, length;
  };
  std::vector<InFlight> in_flight_;
  std::string encoded_;  // publish_manifest()'s buffer, kept for the next one
  std::string index_epoch_;
  // The change counter as of the index (none: unknown, re-read at the next
  // refresh), and the counter file, opened on first use.
  std::optional<std::uint64_t> seen_changes_;
  // change_counter() of this store.
  std::optional<std::uint64_t> changes(bool bump) const;
};

SnapshotInfo info_from_manifest(const Manifest& m);

/// "Older first" in a store's commit order: by seq, then (for manifests that
/// record none, and damaged ones) time_ns, then name (docs/format.md,
/// "Snapshot order"). Every newest/oldest decision uses it.
bool committed_before(const SnapshotInfo& a, const SnapshotInfo& b);
/// Sorts `snaps` (one session's) with committed_before and gives the ones
/// that record no seq (legacy manifests; damaged ones whose header shows
/// none) theirs: 1, 2, ... in (time_ns, name) order, below every recorded one.
void order_snapshots(std::vector<SnapshotInfo>& snaps);

/// Unlinks the manifest of session/snapshot (Store::remove without its
/// locks: call with the mutex and the exclusive data lock held). Throws
/// not_found naming the store.
void remove_manifest(StoreImpl& store, const std::string& session, const std::string& snapshot);

/// The change counter of the store at `store_path` (StoreImpl::count_change):
/// its value, adding one when `bump` (then the value before); nullopt when
/// the file cannot be opened, locked, read or written (errno says why).
std::optional<std::uint64_t> change_counter(const std::string& store_path, bool bump);

/// Checks chunks[i] of `m` for every i in `which` (mapping them first, then
/// hashing on every core). Returns the lowest position in `which` that fails
/// with *why set, or SIZE_MAX when all pass. Throws what Packs::read throws.
/// With a `progress` meter, each chunk checked adds its length.
std::size_t first_damaged(unsigned threads, Packs& packs, const Manifest& m, const std::vector<std::size_t>& which, std::string* why,
                          ProgressMeter* progress = nullptr);

/// The implementation behind a Store handle (Store::impl_ is protected: a
/// pointer to it is taken through a class derived from Store).
inline StoreImpl& impl_of(const Store& store) {
  struct Access : Store {
    static std::shared_ptr<StoreImpl> Store::*member() { return &Access::impl_; }
  };
  return *(store.*Access::member());
}

}  // namespace dvr::detail
