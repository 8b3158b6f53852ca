// Pack files: chunk data stored page-aligned, written through libpmem2
// (non-temporal copies, then persisted) or, on page-granularity media, with
// pwrite where that avoids a page fault per new page. Layout and write paths:
// docs/format.md, "Pack files".
//
// A pack is a sparse file; chunk data occupies ranges of it and everything
// else is free space. Which ranges are live is known only
// from the manifests (StoreImpl tracks it), so a crash can never leave a pack
// in a state that needs repair: space written by an interrupted snapshot is
// simply free again.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/hash.hpp"
#include "base/mapping.hpp"
#include "base/os.hpp"

namespace dvr::detail {

inline constexpr std::uint64_t kPackHeaderSize = kPageSize;  // one page: chunk data starts on a page
inline constexpr std::uint32_t kPackVersion = 1;
inline constexpr std::uint64_t kMaxPackSize = 4ull << 30;
/// Page hash files (docs/format.md): packs/N.hash holds page_hash() of each
/// page of pack N as it was written, 8 bytes per page, at (offset / kPageSize) * 8;
/// sparse, of this fixed size. They are a cache: every use is checked against
/// the tree hash of the chunk in its manifest.
inline constexpr std::uint64_t kHashFileSize = kMaxPackSize / kPageSize * 8;

inline std::uint64_t round_up_page(std::uint64_t n) { return (n + kPageSize - 1) & ~(kPageSize - 1); }

class PackWriter;

class Packs {
 public:
  Packs(std::string dir, std::string store_uuid);
  ~Packs();
  Packs(const Packs&) = delete;
  Packs& operator=(const Packs&) = delete;

  /// Pack ids present, ascending: packs written by the store and heap packs.
  std::vector<std::uint32_t> ids() const;
  /// The file of a pack: NNNNNNNN.pack, or NNNNNNNN.heap for a heap pack.
  std::string path_of(std::uint32_t pack) const;

  /// Heap packs (docs/format.md, "Heap packs"): packs/NNNNNNNN.heap is the
  /// heap file of a `dvr run --heap` program, sealed at a dump and linked into
  /// the store as it is. Its bytes from offset 0 are chunk data at the heap's
  /// own offsets (it has no header); nothing writes it again (the program maps
  /// it copy-on-write), so the store never places data in it and gc never
  /// punches it: it is removed whole once no snapshot references it. Known
  /// from ids() (and read()); false for packs created by the store.
  bool is_heap(std::uint32_t pack) const { return heap_ids_.count(pack) != 0; }
  std::string heap_path_of(std::uint32_t pack) const;
  /// Opens pack `pack` read-only: its pack file, or its heap pack (also one
  /// linked in since ids() last looked). `*path` receives the file's path.
  /// Throws not_found when there is neither.
  Fd open_read(std::uint32_t pack, std::string* path = nullptr);
  /// Where chunk data may start in `pack`: after the header, or at 0 in a heap pack.
  std::uint64_t data_start(std::uint32_t pack) const { return is_heap(pack) ? 0 : kPackHeaderSize; }
  /// Page hashes of data that is in a pack already (a heap stored in place):
  /// `values` for the pages from `first_page` on, written to the page hash
  /// file with the batch's (persist()), dropped with it (discard_writes()).
  void add_hashes(std::uint32_t pack, std::uint64_t first_page, std::vector<std::uint64_t> values);
  /// Apparent size of a pack file (0 if it does not exist).
  std::uint64_t size_of(std::uint32_t pack) const;

  /// Creates pack `id` with apparent size `size` (sparse), or `min_size` when a
  /// file-size limit forbids `size`. Exclusive lock held.
  void create(std::uint32_t id, std::uint64_t size, std::uint64_t min_size);
  /// Grows pack `id` to `size` bytes (sparse). Exclusive lock held.
  void grow(std::uint32_t id, std::uint64_t size);

  /// A writer for [offset, offset+length) of pack `pack`, through a libpmem2
  /// mapping of the pack that is kept for later writes. Exclusive lock held.
  PackWriter writer(std::uint32_t pack, std::uint64_t offset, std::uint64_t length);

  /// Frees [offset, offset+length) of a pack (best effort: it is free space
  /// whether or not the file system takes it back now).
  void punch(std::uint32_t pack, std::uint64_t offset, std::uint64_t length);

  /// Makes durable what writers of this batch finished on a disk file system
  /// (there, PackWriter::finish() only starts the writeback): one fdatasync
  /// per pack written, and per page hash file. Call it after every writer
  /// finished and before publishing a manifest that uses their data; throws
  /// when the file system cannot write the data back. Exclusive lock held.
  void persist();

  /// Ends a batch of writers: mappings replaced or evicted meanwhile (still in
  /// use by writers of the batch until now) are released.
  void end_writes();
  /// For a batch that failed, before end_writes(): the page hash files get
  /// back what persist() overwrote, and hashes not written yet are dropped,
  /// so that they are exactly as before the batch.
  void discard_writes();

  /// Forgets which pages the write mappings have populated (after gc freed
  /// space, whose page-table entries the kernel dropped).
  void forget_populated();

  /// Drops this process's page-table entries of every read mapping (the data
  /// stays in the files and the mappings stay valid): a stream that reads a
  /// whole snapshot keeps a small resident set. Cheap; call it now and then.
  void drop_resident();

  /// Start of a read-only view of [offset, offset+length) of pack `pack`. Throws
  /// corrupt when the pack is missing, foreign, or too short. Call
  /// refresh_mappings() at the start of each operation (under the store lock).
  const char* read(std::uint32_t pack, std::uint64_t offset, std::uint64_t length);

  /// Copies [offset, offset+length) of pack `pack` into `out` with pread,
  /// touching no page of the pack's mapping (whose first touch, on a VM with
  /// shadow page tables, costs more than the copy; docs/performance.md,
  /// "Reading packs"). Bounds and errors as read(); a file shorter than when
  /// it was opened throws corrupt (truncated while in use), a failing medium
  /// io, each naming the pack.
  void copy(std::uint32_t pack, std::uint64_t offset, char* out, std::uint64_t length);

  /// The error for a pread of pack `pack` (open as `fd`) that stopped at
  /// byte `at`: io naming errno `err` when it failed, else (it read 0: the
  /// file ends there) corrupt, "truncated while in use".
  Error pread_failed(std::uint32_t pack, int fd, std::uint64_t at, int err) const;
  /// The error for a read of pack `pack` at `offset` that took SIGBUS
  /// (base/sigbus.hpp): corrupt when the file now ends before `offset` (it
  /// was truncated while mapped), else io (the medium failed); names the pack.
  Error unreadable(std::uint32_t pack, std::uint64_t offset) const;
  /// unreadable() for the fault guarded_fault_address() recorded, in a read
  /// of `len` bytes at `offset` of `pack` mapped at `at`.
  Error unreadable(std::uint32_t pack, std::uint64_t offset, const char* at) const;

  /// Maps every pack for reading (packs that cannot be mapped are skipped), so
  /// that mapped() can be used from several threads.
  void map_all();
  /// Like read(), but only looks at existing mappings and never throws:
  /// nullptr when the pack is not mapped or the range is out of bounds.
  const char* mapped(std::uint32_t pack, std::uint64_t offset, std::uint64_t length) const;
  /// copy() for a pack mapped already, from any thread (as mapped()). Its
  /// callers found the range with mapped(); should it not be mapped (or out
  /// of bounds) after all, corrupt. A short file or a failing medium throws
  /// as copy() does.
  void copy_mapped(std::uint32_t pack, std::uint64_t offset, char* out, std::uint64_t length) const;

  /// Forgets mappings of files that were deleted, replaced or resized.
  void refresh_mappings();

  /// Copies the page hashes stored for `pages` pages at `offset` of `pack`
  /// into `out`. false (out unchanged) when the pack has no page hash file.
  bool stored_hashes(std::uint32_t pack, std::uint64_t offset, std::size_t pages, std::uint64_t* out);

 private:
  struct ReadMap {
    Mapping map;  // the whole pack file, read-only
    std::uint64_t ino = 0;
    std::uint64_t start = kPackHeaderSize;  // data_start()
    Fd fd;                                  // the file mapped, for copy()
    const char* addr() const { return map.bytes(); }
    std::uint64_t size() const { return map.size(); }
  };
  friend class PackWriter;

 public:
  struct WriteMap;  // opaque outside pack.cpp

 private:
  std::string dir_;
  std::string uuid_;
  struct HashMap {
    Fd fd;
    Mapping map;  // kHashFileSize bytes
    std::uint64_t* addr() const { return static_cast<std::uint64_t*>(map.data()); }
    bool writable = false;
    std::uint64_t ino = 0;
    std::atomic<bool> dirty{false};  // written on disk, not synced yet (persist())
    HashMap() = default;
    HashMap(HashMap&& o) noexcept : fd(std::move(o.fd)), map(std::move(o.map)), writable(o.writable), ino(o.ino), dirty(o.dirty.load()) {}
  };
  // The page hash file of `pack`, mapped (writable: created if missing);
  // nullptr when it cannot be. Throws corrupt for a file planted in its place.
  HashMap* hash_map(std::uint32_t pack, bool writable);
  std::string hash_path_of(std::uint32_t pack) const;
  // Throws corrupt (or unsupported) unless pack file `path` (fd, `size`
  // bytes) has the header of pack `pack` of this store.
  void check_header(int fd, std::uint64_t size, const std::string& path, std::uint32_t pack) const;
  mutable std::set<std::uint32_t> heap_ids_;  // heap packs seen by ids() and read()
  std::map<std::uint32_t, HashMap> hash_maps_;
  std::map<std::uint32_t, ReadMap> reads_;
  std::map<std::uint32_t, std::unique_ptr<WriteMap>> writes_;
  std::vector<std::unique_ptr<WriteMap>> retired_;
  std::uint64_t write_clock_ = 0;
  // Page hashes set by writers (PackWriter::set_hashes), written to the page
  // hash files only by persist(), when the batch's data is all written; what
  // they overwrote is kept until the batch ends (discard_writes()).
  struct PendingHash {
    std::uint32_t pack = 0;
    std::uint64_t first = 0;  // page index in the pack
    std::vector<std::uint64_t> values;
  };
  std::mutex pending_mu_;
  std::vector<PendingHash> pending_hashes_;  // guarded by pending_mu_ (writers finish on several threads)
  std::vector<PendingHash> undo_hashes_;
  void write_hashes();
  void sync_hashes(HashMap& h, const PendingHash& run);
  // One fdatasync per page hash file written through its fd (a disk store);
  // a failure is a warning: the files are a checked cache.
  void sync_hash_files();
};

/// Writes chunk data into one extent of a pack, from one thread; finish()
/// makes everything copied persistent. Offsets are relative to the extent.
class PackWriter {
 public:
  /// Makes [rel, rel+len) writable. Space this pack's write mapping holds
  /// already is reserved on the file system (throws no_space, leaving it free
  /// space) and its page tables populated; new space on page-granularity
  /// media (tmpfs, disk) is left to the copies, which write it with pwrite.
  void reserve(std::uint64_t rel, std::uint64_t len);
  /// Copies into a reserved range. Into new space on page-granularity media:
  /// pwrite (throws no_space when the file system is full); with `bounce`,
  /// the source is first copied into a buffer of the calling thread, 256 KiB
  /// at a time, and written from there (write_bounced says why). Otherwise
  /// through the mapping: large copies non-temporal and flushed as they go,
  /// small ones flushed together by finish(). Either way the copy is complete
  /// when it returns (the source may change after); finish() completes
  /// persistence.
  void copy(std::uint64_t rel, const void* src, std::size_t len, bool bounce);
  /// The same for several sources that land one after the other from rel
  /// (`pieces` is consumed): into new space one pwritev, or with `bounce`
  /// gathered into that buffer, one pwrite per 256 KiB; not one per source
  /// (scattered pages of an incremental snapshot: fewer calls, and fewer
  /// turns at the file's lock for the other lanes).
  void copy(std::uint64_t rel, std::vector<struct iovec>& pieces, std::uint64_t len, bool bounce);
  /// Records the page hashes of the pages copied at rel (page-aligned); they
  /// reach the page hash file at Packs::persist().
  void set_hashes(std::uint64_t rel, const std::uint64_t* hashes, std::size_t count);
  /// Makes everything copied persistent (throws when the file system cannot
  /// write it back). On a disk file system it only starts the writeback of
  /// what was written with pwrite: Packs::persist() completes it, once for
  /// all writers of the batch.
  void finish();
  /// After finish(): drops this process's page-table entries of the extent
  /// (the data stays in the file), so that a long stream of writes keeps a
  /// small resident set; later writes to it populate them again.
  void release();
  /// The bytes at rel as written (through the pack's write mapping, which
  /// stays mapped until Packs::end_writes()).
  const char* written(std::uint64_t rel) const { return base_ + rel; }

 private:
  friend class Packs;
  PackWriter(Packs::WriteMap* map, std::uint64_t offset, std::uint64_t length, std::uint64_t* hashes, int hash_fd, Packs* packs,
             std::uint32_t pack);
  void reserve_hashes(std::uint64_t rel, std::uint64_t len);
  void start_writeback(std::uint64_t offset, std::uint64_t len);  // absolute offset in the pack
  // "N bytes at offset O of PACK", for errors about [rel, rel + len).
  std::string range_name(std::uint64_t rel, std::uint64_t len) const;
  // After a pwrite(v) of [rel, rel + len): unsynced until finish(), writeback started on disk.
  void wrote_by_fd(std::uint64_t rel, std::uint64_t len);
  // Writes pieces[0..count) (len bytes in all) into new space at rel with
  // pwrite, through a bounce buffer of the calling thread: a kernel reading
  // memory of the process it has never read before can cost far more than
  // the copy (pack.cpp).
  void write_bounced(std::uint64_t rel, const struct iovec* pieces, std::size_t count, std::uint64_t len);
  void flush_writeback();
  static constexpr std::uint64_t kWriteback = 8u << 20;  // bytes gathered per writeback request
  std::uint64_t writeback_lo_ = 0, writeback_hi_ = 0;     // written, writeback not started yet
  bool by_fd(std::uint64_t rel, std::uint64_t len) const;  // overlaps space written with pwrite
  Packs::WriteMap* map_;
  std::uint64_t offset_, length_;
  char* base_;
  void* memcpy_;
  static constexpr std::size_t kSmallCopy = 64u << 10;
  std::uint64_t unflushed_lo_ = UINT64_MAX, unflushed_hi_ = 0;  // small copies not flushed yet
  std::uint64_t* hashes_;  // the pack's page hash file while there is room to write hashes, else nullptr
  int hash_fd_;
  Packs* packs_;
  std::uint32_t pack_;
  std::vector<Packs::PendingHash> pending_;  // hashes set, handed to packs_ by finish()
  std::vector<std::pair<std::uint64_t, std::uint64_t>> by_fd_;  // reserved ranges written with pwrite, ascending
  bool unsynced_ = false;                                       // pwrites not yet persisted
};

/// True when libpmem2, asked for PAGE granularity on `fd` (a file of at least
/// 4096 bytes, named `file`), reports CACHE_LINE or BYTE: real persistent
/// memory, where data survives power loss once flushed.
bool byte_persistent(int fd, const std::string& file);

}  // namespace dvr::detail
