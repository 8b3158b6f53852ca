#include "format/chunks.hpp"

#include <cstring>

#include "dvr/error.hpp"
#include "base/memops.hpp"
#include "base/sigbus.hpp"
#include "format/pack.hpp"

namespace dvr::detail {

PageLoc ChunkView::location(std::uint32_t page) const {
  for (std::size_t k = 0; k < overlay_count; ++k)
    if (overlays[k].page == page) return {overlays[k].pack, overlays[k].offset};
  if (ref->is_zero()) return {0, 0};
  return {ref->pack, ref->offset + std::uint64_t{page} * kPageSize};
}

ChunkView view_of(const Manifest& m, std::size_t chunk) {
  ChunkView v;
  v.ref = &m.chunks[chunk];
  v.paged = m.paged;
  if (m.paged && m.hydrated()) v.pages = m.hashes_of(chunk);
  v.overlays = m.overlays.data() + m.first_overlay[chunk];
  v.overlay_count = m.first_overlay[chunk + 1] - m.first_overlay[chunk];
  return v;
}

OwnedChunk::OwnedChunk(const ChunkView& v) : ref(*v.ref), paged(v.paged), overlays(v.overlays, v.overlays + v.overlay_count) {
  if (v.paged) pages.assign(v.pages, v.pages + v.page_count());
}

void map_chunk(Packs& packs, const ChunkView& c) {
  if (!c.ref->is_zero()) packs.read(c.ref->pack, c.ref->offset, c.ref->length);
  for (std::size_t k = 0; k < c.overlay_count; ++k)
    if (c.overlays[k].pack != 0) packs.read(c.overlays[k].pack, c.overlays[k].offset, kPageSize);
}

namespace {

// Why the page hashes of paged chunk `c` do not vouch for it ("" when they do).
const char* page_table_problem(const ChunkView& c) {
  return tree_hash(c.pages, c.page_count()) == c.ref->hash ? "" : "the page hashes in its manifest do not match the chunk's hash";
}

// Why page `p` of paged chunk `c`, stored at `at` with its bytes at `bytes`
// (unused for a page stored as zero), is not what its manifest records ("" when it is).
std::string page_problem(const Packs& packs, const ChunkView& c, std::uint32_t p, PageLoc at, const char* bytes) {
  const std::uint32_t len = c.page_length(p);
  if (at.pack == 0) return c.pages[p] == zero_page_hash(len) ? "" : "an all-zero page has the wrong checksum in its manifest";
  std::uint64_t h = 0;
  if (!guarded(bytes, len, [&] { h = page_hash(bytes, len); })) throw packs.unreadable(at.pack, at.offset, bytes);
  if (h == c.pages[p]) return "";
  return "checksum mismatch in " + packs.path_of(at.pack) + " at offset " + std::to_string(at.offset);
}

}  // namespace

std::string check_chunk(const Packs& packs, const ChunkView& c) {
  const ChunkRef& ref = *c.ref;
  auto where = [&](PageLoc at) { return packs.path_of(at.pack) + " at offset " + std::to_string(at.offset); };
  auto bytes = [&](PageLoc at, std::uint32_t len) {
    const char* p = packs.mapped(at.pack, at.offset, len);
    if (!p) throw Error(Errc::corrupt, "cannot read " + std::to_string(len) + " bytes in " + where(at) + " (missing or short pack file)");
    return p;
  };
  if (!c.paged) {
    if (ref.is_zero()) return is_zero_chunk(ref.hash, ref.length) ? "" : "an all-zero chunk has the wrong checksum in its manifest";
    const char* from = bytes({ref.pack, ref.offset}, ref.length);
    Hash128 h{};
    if (!guarded(from, ref.length, [&] { h = hash128(from, ref.length); })) throw packs.unreadable(ref.pack, ref.offset, from);
    return h == ref.hash ? "" : "checksum mismatch in " + where({ref.pack, ref.offset});
  }
  if (const char* why = page_table_problem(c); *why) return why;
  for (std::uint32_t p = 0; p < c.page_count(); ++p) {
    PageLoc at = c.location(p);
    if (std::string why = page_problem(packs, c, p, at, at.pack ? bytes(at, c.page_length(p)) : nullptr); !why.empty()) return why;
  }
  return "";
}

// Reads are copies into the caller's buffer (Packs::copy), checked there:
// what is checked is what the caller gets.

void read_chunk(Packs& packs, const ChunkView& c, char* out, const std::string& what) {
  auto damaged = [&](const std::string& why) { throw Error(Errc::corrupt, what + " is damaged: " + why + "; run `dvr verify`"); };
  const ChunkRef& ref = *c.ref;
  if (!c.paged) {
    if (ref.is_zero()) {
      if (!is_zero_chunk(ref.hash, ref.length)) damaged("an all-zero chunk has the wrong checksum in its manifest");
      std::memset(out, 0, ref.length);
      return;
    }
    packs.copy(ref.pack, ref.offset, out, ref.length);
    if (hash128(out, ref.length) != ref.hash) damaged("checksum mismatch in " + packs.path_of(ref.pack) + " at offset " + std::to_string(ref.offset));
    return;
  }
  if (const char* why = page_table_problem(c); *why) damaged(why);
  // Pages that lie one after the other in a pack: one copy.
  const std::uint32_t n = c.page_count();
  for (std::uint32_t p = 0; p < n;) {
    const PageLoc at = c.location(p);
    std::uint64_t len = c.page_length(p);
    std::uint32_t q = p + 1;
    for (; at.pack && q < n && len == std::uint64_t{q - p} * kPageSize; ++q) {
      const PageLoc next = c.location(q);
      if (next.pack != at.pack || next.offset != at.offset + len) break;
      len += c.page_length(q);
    }
    char* to = out + std::uint64_t{p} * kPageSize;
    if (at.pack)
      packs.copy(at.pack, at.offset, to, len);
    else
      std::memset(to, 0, len);
    for (; p < q; ++p)
      if (std::string why = page_problem(packs, c, p, c.location(p), out + std::uint64_t{p} * kPageSize); !why.empty()) damaged(why);
  }
}

void read_pages(Packs& packs, const ChunkView& c, const std::uint32_t* pages, std::size_t count, char* out, const std::string& what) {
  auto damaged = [&](const std::string& why) { throw Error(Errc::corrupt, what + " is damaged: " + why + "; run `dvr verify`"); };
  if (!c.paged || !c.pages) damaged("its pages have no hashes to check them by");
  if (const char* why = page_table_problem(c); *why) damaged(why);
  for (std::size_t k = 0; k < count; ++k) {
    const std::uint32_t p = pages[k];
    const std::uint32_t len = c.page_length(p);
    const PageLoc at = c.location(p);
    if (at.pack)
      packs.copy(at.pack, at.offset, out, len);
    else
      std::memset(out, 0, len);
    if (std::string why = page_problem(packs, c, p, at, out); !why.empty()) damaged(why);
    out += len;
  }
}

}  // namespace dvr::detail
