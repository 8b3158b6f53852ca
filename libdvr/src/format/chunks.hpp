// Reading and checking one chunk of a snapshot, whatever its format: a chunk
// of a v1/v2 manifest is checked as a whole against hash128 of its bytes; a
// chunk of a v3 manifest page by page against its page hashes, with pages
// that are stored apart (overlays) read from where they are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "format/manifest.hpp"

namespace dvr::detail {

class Packs;

/// One chunk of a manifest with everything needed to read and check it.
struct ChunkView {
  const ChunkRef* ref = nullptr;
  bool paged = false;
  const std::uint64_t* pages = nullptr;  // page hashes (paged and hydrated only)
  const Overlay* overlays = nullptr;
  std::size_t overlay_count = 0;

  std::uint32_t page_count() const { return pages_in(ref->length); }
  std::uint32_t page_length(std::uint32_t p) const {
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(kPageSize, ref->length - std::uint64_t{p} * kPageSize));
  }
  PageLoc location(std::uint32_t page) const;
  bool all_zero() const { return ref->is_zero() && overlay_count == 0; }
};

ChunkView view_of(const Manifest& m, std::size_t chunk);

/// A copy of a chunk's view that owns its page hashes and overlays (to check
/// chunks collected from many manifests).
struct OwnedChunk {
  ChunkRef ref;
  bool paged = false;
  std::vector<std::uint64_t> pages;
  std::vector<Overlay> overlays;
  explicit OwnedChunk(const ChunkView& v);
  ChunkView view() const { return {&ref, paged, pages.data(), overlays.data(), overlays.size()}; }
};

/// Maps the pack ranges chunk `c` is stored in, so that check_chunk() can run
/// on any thread. Throws what Packs::read throws (missing, short or foreign
/// pack file: corrupt; unreadable: io or permission).
void map_chunk(Packs& packs, const ChunkView& c);

/// Why the stored bytes of `c` are not what its manifest records ("" when
/// they are). Thread-safe; call map_chunk() first.
std::string check_chunk(const Packs& packs, const ChunkView& c);

/// Copies the chunk's bytes (ref->length of them) into `out` (Packs::copy:
/// pread, not the pack's mapping) and checks them there: what is checked is
/// what the caller gets. Throws corrupt, naming `what`, when they fail their
/// checksum; what Packs::copy throws for a pack it cannot read.
void read_chunk(Packs& packs, const ChunkView& c, char* out, const std::string& what);

/// Copies only the pages `pages[0..count)` (ascending) of a chunk of a
/// paged, hydrated manifest into `out`, back to back, checking each there
/// against its page hash (and the page hashes against the chunk's hash): a
/// sender of what differs reads nothing else. Throws corrupt, naming `what`.
void read_pages(Packs& packs, const ChunkView& c, const std::uint32_t* pages, std::size_t count, char* out, const std::string& what);

}  // namespace dvr::detail
