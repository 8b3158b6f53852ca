// Snapshot manifests: the region table and chunk list of one snapshot.
// Binary layout: docs/format.md, "Manifest files".
#pragma once

#include <algorithm>
#include <memory>
#include <new>
#include <utility>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/hash.hpp"

namespace dvr::detail {

// 2 added flags bit 0 and chunks_read; 3 added page hashes and overlays;
// 4 added seq and origin_time_ns (older ones decode with seq 0, origin = time).
inline constexpr std::uint32_t kManifestVersion = 4;
/// The highest commit number a manifest may carry (docs/format.md): far above
/// any real count, far below where the next one would wrap.
inline constexpr std::uint64_t kMaxSeq = std::uint64_t{1} << 48;
inline constexpr std::uint32_t kManifestTrackedWrites = 1u << 0;  // flags: taken with write-protect tracking

/// Where a chunk's bytes are. pack == 0 marks the all-zero chunk (not stored).
struct ChunkRef {
  Hash128 hash;
  std::uint32_t pack = 0;
  std::uint32_t length = 0;  // logical (= stored) length in bytes
  std::uint64_t offset = 0;  // byte offset in the pack file, page-aligned
  bool is_zero() const { return pack == 0; }
};

/// Page `page` of chunk `chunk` is stored on its own at (pack, offset), not at
/// its place in the chunk's stored bytes (format v3; see docs/format.md).
struct Overlay {
  std::uint64_t chunk = 0;
  std::uint32_t page = 0;
  std::uint32_t pack = 0;
  std::uint64_t offset = 0;
};

/// Where one page's bytes are; pack == 0: all zero, not stored. An overlay
/// with pack == 0 and offset == 0 makes a page of a stored chunk all zero.
struct PageLoc {
  std::uint32_t pack = 0;
  std::uint64_t offset = 0;
};

/// An allocator whose resize() leaves new elements of trivial types unwritten:
/// a large table is then fresh anonymous memory that costs nothing until it
/// is written (a received snapshot's page hashes fill in as its data arrives).
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0)
      ::new (static_cast<void*>(p)) U;
    else
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

/// page_hash() of every page of a snapshot, chunk after chunk.
using PageHashes = std::vector<std::uint64_t, UninitAllocator<std::uint64_t>>;

struct ManifestRegion {
  std::string name;
  std::uint64_t size = 0;
  bool sdk_owned = false;
  std::uint64_t first_chunk = 0;  // index into Manifest::chunks
  std::uint64_t chunk_count = 0;
};

struct Manifest {
  std::string session;
  std::string name;
  std::string parent;
  std::string label;
  std::int64_t time_ns = 0;         // wall-clock time of the commit in this store
  std::uint64_t seq = 0;            // commit order in this store (v4; 0: not recorded)
  std::int64_t origin_time_ns = 0;  // when the snapshot was first made (the sender's time for a received one)
  std::uint32_t chunk_size = 0;
  std::uint64_t stored_bytes = 0;
  std::uint32_t flags = 0;
  std::uint64_t chunks_read = 0;  // chunks hashed to take the snapshot
  std::vector<ManifestRegion> regions;
  std::vector<ChunkRef> chunks;

  // Format v3 ("paged"): a chunk's hash is tree_hash() of its pages' hashes.
  // page_hashes holds page_hash() of every page, chunk after chunk; it is not
  // part of the file: a snapshot computes it, StoreImpl::hydrate() reads it
  // from the page hash files (checked against the chunk hashes). Older
  // manifests have none; their chunk hashes are hash128() of the bytes.
  bool paged = true;
  PageHashes page_hashes;
  /// Pages stored apart from their chunk, sorted by (chunk, page).
  std::vector<Overlay> overlays;
  /// Derived by index(): first page hash / first overlay of chunk i (size chunks + 1).
  std::vector<std::uint64_t> first_page;
  std::vector<std::uint32_t> first_overlay;
  /// The file's checksum (set by encode and decode): tells versions apart.
  std::uint64_t checksum = 0;

  std::uint64_t logical_bytes() const;
  /// Rebuilds first_page and first_overlay from chunks and overlays.
  void index();
  std::uint32_t pages_of(std::size_t chunk) const { return static_cast<std::uint32_t>(first_page[chunk + 1] - first_page[chunk]); }
  const std::uint64_t* hashes_of(std::size_t chunk) const { return page_hashes.data() + first_page[chunk]; }
  /// page_hashes is filled (always true for older formats, which have none).
  bool hydrated() const { return !paged || page_hashes.size() == first_page.back(); }
  /// Chunks (ascending) whose page hashes could not be made to agree with
  /// their hash when hydrated: damaged, so nothing may rely on them.
  std::vector<std::size_t> untrusted;
  bool trusted(std::size_t chunk) const { return untrusted.empty() || !std::binary_search(untrusted.begin(), untrusted.end(), chunk); }
  bool has_overlays(std::size_t chunk) const { return first_overlay[chunk] != first_overlay[chunk + 1]; }
  /// True when every byte of chunk `chunk` is zero.
  bool zero_chunk(std::size_t chunk) const { return chunks[chunk].is_zero() && !has_overlays(chunk); }
};

/// Encodes `m` in format kManifestVersion (its overlays as they are: the
/// caller makes them consistent; page hashes are not part of the file).
std::string encode_manifest(const Manifest& m);
/// The same into `into`, reusing its memory (a manifest of a large session is
/// megabytes: fresh memory for each would be faulted in page by page).
void encode_manifest(const Manifest& m, std::string& into);
/// The checksum in an encoded manifest's trailer.
std::uint64_t manifest_checksum(std::string_view encoded);

/// The seq a manifest's header shows (format v4 and later), unchecked: 0 when
/// the bytes are too short, not a manifest or older. Only a hint to place a
/// damaged manifest in its session's order; never trusted otherwise.
std::uint64_t manifest_seq_hint(std::string_view bytes);

/// Parses and checks a manifest. `where` names it in errors. Throws corrupt
/// (bad magic, checksum, truncation, inconsistent tables) or unsupported (a
/// newer format version).
Manifest decode_manifest(std::string_view bytes, const std::string& where);

}  // namespace dvr::detail
