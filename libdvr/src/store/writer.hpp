// Writing snapshots into a store: the one path by which every producer
// (sessions, the stream receiver, the CRIU heap code, MPI through sessions
// and streams) adds data and publishes manifests. docs/format.md, "Commit".
//
//   WriteBatch      the exclusive right to add snapshots: store mutex, the
//                   exclusive store lock, a current chunk index, and the pack
//                   space taken until the manifests are published.
//   SnapshotWriter  one snapshot in a batch: the region table, then its chunks
//                   as they come (whole, zero, inherited from a base, or a
//                   base's chunk with some pages stored apart), then publish.
//   Lane            one thread's placement of new data into pack space.
//   write_snapshot  the planner for memory that is all present at once
//                   (a session's regions, a process's heap files).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "format/chunks.hpp"
#include "format/manifest.hpp"
#include "format/pack.hpp"
#include "store/store_impl.hpp"

namespace dvr::detail {

class ProgressMeter;

/// Region-relative byte ranges [begin, end), sorted and disjoint.
using ByteRanges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

/// ByteRanges of a region as per-page and per-chunk "written" marks.
struct WrittenPages {
  std::vector<char> page;   // page of the region written since the base
  std::vector<char> chunk;  // chunk holds a written page
  WrittenPages(const ByteRanges& ranges, std::uint64_t size, std::uint32_t chunk_size)
      : page(pages_in(size), 0), chunk((size + chunk_size - 1) / chunk_size, 0) {
    for (auto& [b, e] : ranges)
      for (std::uint64_t p = b / kPageSize; p * kPageSize < e && p < page.size(); ++p) {
        page[p] = 1;
        chunk[p * kPageSize / chunk_size] = 1;
      }
  }
};

/// Work estimate for parallel_for: scattered pages cost far more than their
/// bytes (a page-table walk and often a fault each), so each counts as 16 KiB.
inline constexpr std::uint64_t kPageWork = 16u << 10;

/// The patch rule (docs/incremental.md): a chunk of which some pages changed
/// keeps its base's stored bytes, with the changed pages stored apart, as long
/// as the pages stored apart afterwards (the base's overlays of that chunk
/// plus the changed pages not among them) are at most a quarter of its pages.
/// Past that the chunk is stored whole. `pages` lists the changed pages.
bool store_pages_apart(const Manifest& base, std::size_t base_chunk, const std::uint32_t* pages, std::size_t count, std::uint32_t chunk_pages);

/// The pages of `data` (`size` bytes, region `region` of `base`) whose page
/// hashes differ from the base's, as ranges; reads all of `data`, on every
/// core. `region` must be of the same size and `base` paged.
/// Whether [lo, hi) lies inside one of the sorted, disjoint `ranges`.
bool inside(const ByteRanges& ranges, std::uint64_t lo, std::uint64_t hi);
/// Whether [lo, hi) overlaps one of the sorted, disjoint `ranges`.
bool overlaps_any(const ByteRanges& ranges, std::uint64_t lo, std::uint64_t hi);

/// Pages inside `zero` (sorted byte ranges) are taken to be zero, not read.
/// `racy`: the program may be writing `data` meanwhile (see RacyReads).
ByteRanges pages_differing(unsigned threads, const Manifest& base, const ManifestRegion& region, const char* data, std::uint64_t size,
                           const ByteRanges& zero = {}, bool racy = false);

class SnapshotWriter;

/// Throws invalid_argument for bad names and already_exists when snapshot
/// `name` of `session` exists and `replace` is false (what SnapshotWriter
/// checks first; callers that start work before the batch check it early).
void check_new_snapshot(StoreImpl& store, const std::string& session, const std::string& name, bool replace);

/// The exclusive right to add snapshots to a store, from construction to
/// destruction. While it lives this thread holds the store's mutex and the
/// writers' lock (other writers and gc wait; readers do not), the
/// chunk index is current and every pack is mapped for reading; pack space
/// taken by its writers stays reserved until publish() makes it live, or is
/// given back when the batch ends without.
class WriteBatch {
 public:
  explicit WriteBatch(StoreImpl& store);
  ~WriteBatch();
  WriteBatch(const WriteBatch&) = delete;
  WriteBatch& operator=(const WriteBatch&) = delete;

  StoreImpl& store() { return store_; }
  StoreImpl::AllocationScope& space() { return space_; }

  /// Publishes the writers' snapshots in order, all or nothing: on a failure
  /// the ones already published are removed again and the error is rethrown.
  /// A failure to sync the directory after a rename keeps every snapshot and
  /// is reported as an Error saying so: stored in *after_commit when given,
  /// else thrown after everything is published. Returns what was published.
  std::vector<SnapshotInfo> publish(const std::vector<SnapshotWriter*>& writers, std::exception_ptr* after_commit = nullptr);

 private:
  StoreImpl& store_;
  std::lock_guard<std::mutex> guard_;
  StoreImpl::Lock lock_;
  StoreImpl::AllocationScope space_;
};

struct WriterOptions {
  std::string label;
  std::string parent;
  /// Replace an existing snapshot of that name instead of failing.
  bool replace = false;
  /// When the snapshot was first made, for one that arrives from elsewhere
  /// (a receive: the sender's origin time); 0 (made here): its commit time.
  std::int64_t origin_time_ns = 0;
  /// The data comes from buffers of this process that it reuses and that the
  /// kernel has filled (a stream's records, a dump's windows): new space is
  /// written from them as they are. Otherwise (the caller's memory) it is
  /// copied through a buffer of the writing thread first (PackWriter::copy).
  bool own_buffers = false;
};

/// One snapshot being written in a batch. Declare the regions, seal(), then
/// give every chunk exactly once (through a Lane for new data), then
/// WriteBatch::publish().
class SnapshotWriter {
 public:
  /// Throws invalid_argument (bad names) and already_exists (unless
  /// options.replace). Replacing the head: the new version takes the old one's
  /// parent instead of becoming its own child. `reuse`, when given, lends its
  /// memory to the manifest's tables (a session's previous base: megabytes
  /// that fresh memory would fault in page by page).
  SnapshotWriter(WriteBatch& batch, const std::string& session, const std::string& name, const WriterOptions& options, Manifest* reuse = nullptr);
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  /// Appends a region to the table. After seal() too (for producers that
  /// learn their regions as the data comes), but then only while no Lane of
  /// this writer is storing: the chunk tables grow.
  void add_region(const std::string& name, std::uint64_t size, bool sdk_owned);
  /// Ends the region table: chunk slots exist from here on.
  void seal();

  /// Offers `base` (a manifest of this store) to inherit chunks from and to
  /// patch against. Accepted only when it is paged, of this store's chunk size
  /// and published exactly so (indexed with that checksum); returns whether
  /// it is used. The base must outlive the writer.
  bool use_base(const Manifest* base);
  const Manifest* base() const { return base_; }

  const Manifest& manifest() const { return m_; }
  StoreImpl& store() { return batch_.store(); }
  std::uint32_t chunk_size() const { return m_.chunk_size; }

  /// Chunk `chunk` is chunk `base_chunk` of the base (same length), with its
  /// overlays.
  void inherit(std::size_t chunk, std::size_t base_chunk);
  /// Chunk `chunk` is all zero.
  void zero(std::size_t chunk);
  /// Chunk `chunk` is `ref`, a chunk stored whole (no pages apart) by a
  /// snapshot that is published and indexed in this batch, given without its
  /// page hashes (a manifest loaded without them): for a snapshot that
  /// repeats another's chunk table, such as a sealed heap that has not
  /// changed. The published manifest then holds no page hashes in memory
  /// (readers take them from the page hash files).
  void unchanged(std::size_t chunk, const ChunkRef& ref);
  /// Chunk `chunk` is stored already, whole, at `offset` of heap pack `pack`
  /// (a sealed heap file linked into the store: Packs::is_heap), with these
  /// page hashes: nothing is copied, and it counts as stored by this
  /// snapshot. Safe from several threads for distinct chunks.
  void in_place(std::size_t chunk, std::uint32_t pack, std::uint64_t offset, const std::uint64_t* page_hashes);
  /// Chunk `chunk` will be patched from `base_chunk` (Lane::put_patch) with at
  /// most `changed` new pages. Call for every patched chunk before any Lane
  /// stores into it (it sizes the overlay table, so that lanes allocate
  /// nothing).
  void plan_patch(std::size_t chunk, std::size_t base_chunk, std::uint32_t changed);

  /// Chunk `chunk` will be stored as the zero chunk with at most `present`
  /// pages stored apart (Lane::put_sparse). Call for every such chunk before
  /// any Lane stores into it.
  void plan_sparse(std::size_t chunk, std::uint32_t present);

  /// New data written is unmapped from this process as each block of pack
  /// space is complete (always so for lanes of transient sources): for
  /// producers that write more than should stay resident (a CRIU page stream).
  void release_written(bool on) { release_written_ = on; }

  /// How the snapshot was taken (SnapshotInfo::tracking, chunks_read).
  void set_provenance(bool tracked_writes, std::uint64_t chunks_read);

  /// The manifest as published (valid after WriteBatch::publish()).
  Manifest& published() { return m_; }

  /// One thread's placement of new data: hashes, deduplicates against the
  /// store and this lane's own chunks, and copies what is new into blocks of
  /// pack space taken as needed (growing, so that a small snapshot takes
  /// little space). Lanes of one writer may run on several threads at once.
  class Lane {
   public:
    /// `expected`: bytes this lane may store at most (sizes its blocks).
    /// `stable_sources`: the source bytes stay valid and unchanged until
    /// finish() (live memory), so copies may be merged and deferred and
    /// duplicates compared with the source; otherwise (a receive buffer
    /// reused for the next chunk) every copy is made before put_* returns.
    /// Blocks written from unstable sources are unmapped as they are complete
    /// (a stream writes each once) unless `keep_mapped` (memory that may
    /// change while it is read: the next snapshot reuses the space).
    Lane(SnapshotWriter& writer, std::uint64_t expected, bool stable_sources, bool keep_mapped = false);
    ~Lane();
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;

    /// Stores chunk `chunk` from `data` (its full length): all zero, a copy
    /// the store or this lane holds already, or new data.
    void put_whole(std::size_t chunk, const char* data);
    /// Patches chunk `chunk` (planned with plan_patch) from its base: of the
    /// pages in `pages` (ascending), those whose bytes `page_at(p)` differ
    /// from the base's are stored apart. When the result is a chunk the store
    /// holds whole, that copy is used instead; `chunk_data`, when not null,
    /// holds the whole chunk's bytes for that comparison (else it is skipped).
    template <class PageAt>
    void put_patch(std::size_t chunk, const std::uint32_t* pages, std::size_t count, PageAt page_at, const char* chunk_data);
    /// Stores chunk `chunk` (planned with plan_sparse), all zero but for the
    /// pages in `pages` (ascending) of the chunk's bytes `data`, as the zero
    /// chunk with those pages stored apart (one page each; none for a page
    /// that is all zero): memory of which only a few pages are present (a
    /// CRIU window) costs those pages, not whole chunks.
    void put_sparse(std::size_t chunk, const std::uint32_t* pages, std::size_t count, const char* data);
    /// Completes every copy of this lane and makes it persistent. Must be
    /// called (on this lane's thread) before the batch publishes.
    void finish();
    /// Bytes of pack space this lane filled.
    std::uint64_t stored() const { return stored_; }

   private:
    PageLoc place(const char* from, std::uint64_t len, const std::uint64_t* hashes);
    void flush();
    void close_block();
    bool changed_page(std::size_t chunk, std::uint32_t p, const char* now, std::uint64_t* hashes);
    void apply_patch(std::size_t chunk, const std::vector<std::uint32_t>& changed, const char* const* now);

    SnapshotWriter& w_;
    unsigned index_;  // which of the writer's lanes: where it takes new space
    bool stable_;
    bool keep_mapped_;
    std::uint64_t left_, block_size_, step_;
    struct Block {
      StoreImpl::Placement at;
      std::uint64_t length = 0, used = 0, reserved = 0;
      std::optional<PackWriter> writer;
    } block_;
    // Copies not made yet (stable sources only): `len` bytes at dst, from
    // `pieces` (one per contiguous source; the destination is contiguous).
    struct Run {
      std::uint64_t dst = 0;
      std::uint64_t len = 0;
      std::vector<struct iovec> pieces;
    } run_;
    std::uint64_t stored_ = 0;
    // Whole chunks this lane stored: hash -> chunk (compared before reuse).
    std::unordered_map<Hash128, std::pair<std::size_t, const char*>, Hash128Hasher> mine_;
    std::vector<std::uint32_t> changed_;
    std::vector<const char*> changed_at_;
  };

 private:
  friend class WriteBatch;
  void assemble();  // overlays in chunk order, tables indexed, stored bytes

  WriteBatch& batch_;
  Manifest m_;
  const Manifest* base_ = nullptr;
  bool sealed_ = false;
  bool release_written_ = false;
  bool own_buffers_ = false;  // WriterOptions::own_buffers
  // Per chunk: where it came from, and for patched chunks their overlay slots.
  enum class From : std::uint8_t { none, whole, zero, inherit, patch, unchanged };
  bool without_hashes_ = false;  // some chunk came by unchanged(): page_hashes is not valid
  std::vector<From> from_;
  std::vector<std::size_t> base_chunk_;
  std::vector<std::size_t> ov_from_;
  std::vector<std::uint32_t> ov_count_;
  std::vector<Overlay> patched_;
  std::atomic<std::uint64_t> stored_{0};
  std::atomic<unsigned> lanes_{0};  // lanes made so far (numbers them)
};

/// One region of memory that is all present while a snapshot is written.
struct RegionSource {
  std::string name;
  const char* data = nullptr;
  std::uint64_t size = 0;
  bool sdk_owned = false;
  /// Byte ranges that may differ from the base's region of the same name and
  /// size; no value: unknown (everything is read and hashed).
  std::optional<ByteRanges> written;
  /// Sorted byte ranges known to read zero without being read (holes of a
  /// heap file: touching them through a mapping would allocate them).
  ByteRanges zero;
};

/// For memory that may change while it is read (a background snapshot): the
/// writer asks before and after reading each chunk. `r` numbers the regions
/// given to write_regions, `j` the chunk within the region.
class ChunkGuard {
 public:
  virtual ~ChunkGuard() = default;
  /// Chunk j of region r will not be read (inherited from the base, or known
  /// zero).
  virtual void skip(std::size_t r, std::uint64_t j) = 0;
  /// Before chunk j of region r is read: the bytes to read, either `live` or
  /// a copy of the chunk as it was (valid until the batch ends). May throw
  /// (cancelled): nothing is published then.
  virtual const char* begin(std::size_t r, std::uint64_t j, const char* live) = 0;
  /// After it was stored from what begin() returned: when that was live
  /// memory and may have changed meanwhile, a copy of the chunk as it was,
  /// to store it again from there; else nullptr.
  virtual const char* again(std::size_t r, std::uint64_t j) = 0;
  /// The chunk is stored for good; `bytes` of region memory were read.
  virtual void done(std::size_t r, std::uint64_t j, std::uint64_t bytes) = 0;
};

/// Writes memory as snapshot `name` of `session` in one pass on every core:
/// chunks without written pages are inherited from `base` (when the writer
/// accepts it), chunks with a few are patched, the rest are hashed and stored
/// whole. `tracked` says that `written` came from write tracking (recorded in
/// the manifest). The snapshot is not published: call batch.publish().
/// With a `guard`, every chunk read goes through it (and each copy is made
/// before the next chunk is read). With a `progress` meter, its total grows
/// by the bytes to read and each chunk read adds its bytes; when the meter
/// stops (its callback threw) the writing stops and the exception propagates
/// (nothing is published).
void write_snapshot(SnapshotWriter& writer, const std::vector<RegionSource>& regions, const Manifest* base, bool tracked,
                    ChunkGuard* guard = nullptr, ProgressMeter* progress = nullptr);

/// The same for regions appended to the table of a writer already sealed
/// (write_snapshot is seal(), use_base(), then this): `base` is used only
/// when it is the writer's base(). Returns the chunks read; no provenance is
/// set. Lets a producer write a snapshot a few regions at a time, holding
/// only those in memory (a CRIU page stream).
std::uint64_t write_regions(SnapshotWriter& writer, const std::vector<RegionSource>& regions, const Manifest* base,
                            ChunkGuard* guard = nullptr, ProgressMeter* progress = nullptr);

/// Writes region `region` of a sealed writer from heap pack `pack` (a sealed
/// heap file, open for reading as `fd`), which holds the region at its own
/// offsets: chunk j at offset j * chunk_size. Chunks inside `holes` (sorted
/// byte ranges of the file that read zero) or all zero are recorded as zero;
/// chunks that the writer's base holds at that very place of that pack, with
/// no pages stored apart, are inherited without being read; the others are
/// hashed on every core and recorded where they are. Nothing is copied: the
/// snapshot costs the hashing (each chunk read with pread) and its manifest.
/// Returns the chunks read. Throws what Packs::pread_failed says when the
/// file cannot be read (an I/O error, or truncated meanwhile).
std::uint64_t write_in_place(SnapshotWriter& writer, std::size_t region, std::uint32_t pack, int fd, const ByteRanges& holes);

// ---- template -----------------------------------------------------------------

template <class PageAt>
void SnapshotWriter::Lane::put_patch(std::size_t chunk, const std::uint32_t* pages, std::size_t count, PageAt page_at, const char* chunk_data) {
  left_ -= std::min<std::uint64_t>(left_, count * kPageSize);
  changed_.clear();
  changed_at_.clear();
  std::uint64_t* hashes = w_.m_.page_hashes.data() + w_.m_.first_page[chunk];
  ChunkView was = view_of(*w_.base_, w_.base_chunk_[chunk]);
  w_.m_.chunks[chunk] = *was.ref;
  std::copy_n(was.pages, was.page_count(), hashes);
  for (std::size_t x = 0; x < count; ++x) {
    const char* now = page_at(pages[x]);
    if (changed_page(chunk, pages[x], now, hashes)) {
      changed_.push_back(pages[x]);
      changed_at_.push_back(now);
    }
  }
  w_.m_.chunks[chunk].hash = tree_hash(hashes, was.page_count());
  // Back to content stored whole before (a trial undone by hand, say): point
  // at that copy, after comparing the bytes.
  if (!changed_.empty() && chunk_data) {
    if (const ChunkRef* known = w_.store().find_chunk(w_.m_.chunks[chunk].hash, chunk_data, w_.m_.chunks[chunk].length)) {
      w_.m_.chunks[chunk].pack = known->pack;
      w_.m_.chunks[chunk].offset = known->offset;
      w_.ov_count_[chunk] = 0;
      w_.from_[chunk] = SnapshotWriter::From::whole;
      return;
    }
  }
  apply_patch(chunk, changed_, changed_at_.data());
}

}  // namespace dvr::detail
