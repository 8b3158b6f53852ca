#include "format/manifest.hpp"

#include <cstring>
#include <tuple>

#include "base/codec.hpp"
#include "dvr/error.hpp"

namespace dvr::detail {
namespace {

constexpr char kMagic[8] = {'D', 'V', 'R', 'M', 'A', 'N', 'I', 'F'};
constexpr char kEndMagic[8] = {'D', 'V', 'R', 'M', 'E', 'N', 'D', '1'};
constexpr std::size_t kHeaderSize = 24;   // magic, version, flags, body length
constexpr std::size_t kTrailerSize = 16;  // checksum, end magic
constexpr std::size_t kChunkEntrySize = 32;
constexpr std::size_t kOverlayEntrySize = 24;

// What a damaged manifest's error says to do.
constexpr const char* kAdvice = "this snapshot cannot be restored — remove it with `dvr rm` and restore another one";

Reader manifest_reader(std::string_view bytes, const std::string& where) { return Reader(bytes, "manifest " + where, kAdvice); }

}  // namespace

std::uint64_t Manifest::logical_bytes() const {
  std::uint64_t n = 0;
  for (auto& r : regions)
    n += r.size;
  return n;
}

void Manifest::index() {
  first_page.assign(chunks.size() + 1, 0);
  for (std::size_t i = 0; i < chunks.size(); ++i)
    first_page[i + 1] = first_page[i] + (paged ? pages_in(chunks[i].length) : 0);
  first_overlay.assign(chunks.size() + 1, 0);
  std::size_t k = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    first_overlay[i] = static_cast<std::uint32_t>(k);
    while (k < overlays.size() && overlays[k].chunk == i)
      ++k;
  }
  first_overlay[chunks.size()] = static_cast<std::uint32_t>(k);
}

std::uint64_t manifest_checksum(std::string_view encoded) {
  return encoded.size() >= kTrailerSize ? decode_fixed<std::uint64_t>(encoded.data() + encoded.size() - kTrailerSize) : 0;
}

std::string encode_manifest(const Manifest& m) {
  std::string out;
  encode_manifest(m, out);
  return out;
}

void encode_manifest(const Manifest& m, std::string& into) {
  Writer w(std::move(into));
  w.bytes(kMagic, 8);
  w.u32(kManifestVersion);
  w.u32(m.flags);
  w.u64(0);  // body length, patched below
  w.i64(m.time_ns);
  w.u32(m.chunk_size);
  w.u32(static_cast<std::uint32_t>(m.regions.size()));
  w.u64(m.chunks.size());
  w.u64(m.logical_bytes());
  w.u64(m.stored_bytes);
  w.u64(m.chunks_read);
  w.u64(m.seq);
  w.i64(m.origin_time_ns);
  w.str(m.session);
  w.str(m.name);
  w.str(m.parent);
  w.str(m.label);
  for (auto& r : m.regions) {
    w.str(r.name);
    w.u64(r.size);
    w.u8(r.sdk_owned ? 1 : 0);
    w.u64(r.first_chunk);
    w.u64(r.chunk_count);
  }
  // The tables are most of the bytes: written into space sized once.
  char* out = w.extend(m.chunks.size() * kChunkEntrySize + 8 + m.overlays.size() * kOverlayEntrySize);
  for (auto& c : m.chunks) {
    out = encode_fixed(out, c.hash.lo);
    out = encode_fixed(out, c.hash.hi);
    out = encode_fixed(out, c.pack);
    out = encode_fixed(out, c.length);
    out = encode_fixed(out, c.offset);
  }
  out = encode_fixed(out, static_cast<std::uint64_t>(m.overlays.size()));
  for (auto& o : m.overlays) {
    out = encode_fixed(out, o.chunk);
    out = encode_fixed(out, o.page);
    out = encode_fixed(out, o.pack);
    out = encode_fixed(out, o.offset);
  }
  w.out.reserve(w.out.size() + kTrailerSize);
  const std::uint64_t body = w.out.size();
  encode_fixed(w.out.data() + 16, body);
  w.u64(hash64(w.out.data(), body));
  w.bytes(kEndMagic, 8);
  into = std::move(w.out);
}

std::uint64_t manifest_seq_hint(std::string_view bytes) {
  // Header 24, time 8, chunk size 4, region count 4, chunk count, logical,
  // stored, chunks read 8 each: seq at 72.
  constexpr std::size_t kSeqAt = 72;
  if (bytes.size() < kSeqAt + 8 || std::memcmp(bytes.data(), kMagic, 8) != 0 || decode_fixed<std::uint32_t>(bytes.data() + 8) < 4) return 0;
  const auto seq = decode_fixed<std::uint64_t>(bytes.data() + kSeqAt);
  return seq > kMaxSeq ? 0 : seq;
}

Manifest decode_manifest(std::string_view bytes, const std::string& where) {
  const Reader r = manifest_reader(bytes, where);
  if (bytes.size() < kHeaderSize + kTrailerSize) r.fail("only " + std::to_string(bytes.size()) + " bytes (truncated)");
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) r.fail("not a manifest (bad magic)");
  const auto version = decode_fixed<std::uint32_t>(bytes.data() + 8);
  const auto body = decode_fixed<std::uint64_t>(bytes.data() + 16);
  // The checksum is checked before the version, so that a damaged version
  // field reads as damage, not as "written by a newer dvr".
  bool intact = body == bytes.size() - kTrailerSize && std::memcmp(bytes.data() + body + 8, kEndMagic, 8) == 0;
  if (intact) intact = decode_fixed<std::uint64_t>(bytes.data() + body) == hash64(bytes.data(), body);
  if (version > kManifestVersion) {
    std::string msg = "manifest " + where + " has format version " + std::to_string(version) + ", newer than this dvr understands (" +
                      std::to_string(kManifestVersion) + ")";
    if (intact) throw Error(Errc::unsupported, msg + "; upgrade dvr");
    r.fail("checksum mismatch (" + msg + ", or the header is damaged)");
  }
  if (body != bytes.size() - kTrailerSize) r.fail("length " + std::to_string(bytes.size()) + " does not match its header (truncated or extended)");
  if (std::memcmp(bytes.data() + body + 8, kEndMagic, 8) != 0) r.fail("end marker missing");
  if (!intact) r.fail("checksum mismatch");

  Reader in = manifest_reader(bytes.substr(0, body), where);
  in.need(kHeaderSize);
  Manifest m;
  in.skip(12);  // magic and version: checked above
  m.flags = in.u32();
  in.skip(8);  // body length: checked above
  m.time_ns = in.i64();
  m.chunk_size = in.u32();
  const auto region_count = in.u32();
  const auto chunk_count = in.u64();
  const auto logical = in.u64();
  m.stored_bytes = in.u64();
  m.chunks_read = version >= 2 ? in.u64() : chunk_count;
  if (version >= 4) {
    m.seq = in.u64();
    // One number per commit: anything near 2^64 was forged (its checksum is
    // no authentication) and would make the next number wrap to 0.
    if (m.seq > kMaxSeq) in.fail("its commit number " + std::to_string(m.seq) + " is beyond any real count of snapshots");
    m.origin_time_ns = in.i64();
  } else {
    m.origin_time_ns = m.time_ns;  // made here, as far as anyone can tell
  }
  m.session = in.str();
  m.name = in.str();
  m.parent = in.str();
  m.label = in.str();
  if (m.chunk_size == 0 || (m.chunk_size & (m.chunk_size - 1)) != 0) in.fail("bad chunk size");
  for (std::uint32_t i = 0; i < region_count; ++i) {
    ManifestRegion reg;
    reg.name = in.str();
    reg.size = in.u64();
    reg.sdk_owned = in.u8() != 0;
    reg.first_chunk = in.u64();
    reg.chunk_count = in.u64();
    m.regions.push_back(std::move(reg));
  }
  if (chunk_count > in.remaining() / kChunkEntrySize || (version < 3 && in.remaining() != chunk_count * kChunkEntrySize))
    in.fail("chunk table size does not match its count");
  m.chunks.resize(chunk_count);
  for (auto& c : m.chunks) {
    c.hash = in.hash();
    c.pack = in.u32();
    c.length = in.u32();
    c.offset = in.u64();
  }
  m.paged = version >= 3;
  if (m.paged) {
    const auto overlay_count = in.u64();
    if (overlay_count > in.remaining() / kOverlayEntrySize || in.remaining() != overlay_count * kOverlayEntrySize)
      in.fail("overlay table size does not match its count");
    m.overlays.resize(overlay_count);
    for (std::size_t k = 0; k < m.overlays.size(); ++k) {
      auto& o = m.overlays[k];
      o.chunk = in.u64();
      o.page = in.u32();
      o.pack = in.u32();
      o.offset = in.u64();
      bool zero_page = o.pack == 0 && o.offset == 0;  // the page is all zero, not stored
      if (o.chunk >= chunk_count || o.page >= pages_in(m.chunks[o.chunk].length) ||
          (!zero_page && (o.pack == 0 || o.offset < kPageSize || o.offset % kPageSize != 0 || o.offset > (1ull << 62))))
        in.fail("overlay " + std::to_string(k) + " is impossible");
      if (k > 0 && std::tie(m.overlays[k - 1].chunk, m.overlays[k - 1].page) >= std::tie(o.chunk, o.page)) in.fail("overlay table is not in order");
    }
  }
  // Tables must describe exactly the regions' bytes.
  std::uint64_t next = 0;
  for (auto& reg : m.regions) {
    if (reg.first_chunk != next || reg.chunk_count > chunk_count - next) in.fail("region table inconsistent");
    std::uint64_t expect = (reg.size + m.chunk_size - 1) / m.chunk_size;
    if (reg.chunk_count != expect) in.fail("region '" + reg.name + "' has a wrong chunk count");
    for (std::uint64_t i = 0; i < reg.chunk_count; ++i) {
      std::uint64_t len = std::min<std::uint64_t>(m.chunk_size, reg.size - i * m.chunk_size);
      auto& c = m.chunks[reg.first_chunk + i];
      if (c.length != len) in.fail("chunk length inconsistent in region '" + reg.name + "'");
      // Stored chunks start on a page: after the pack header, or from 0 in a
      // heap pack, which the reader checks when it maps the pack (docs/format.md).
      if (!c.is_zero() && (c.offset % kPageSize != 0 || c.offset > (1ull << 62)))
        in.fail("chunk offset " + std::to_string(c.offset) + " is impossible in region '" + reg.name + "'");
    }
    next += reg.chunk_count;
  }
  if (next != chunk_count) in.fail("chunks not covered by regions");
  if (logical != m.logical_bytes()) in.fail("logical size inconsistent");
  m.checksum = manifest_checksum(bytes);
  m.index();
  return m;
}

}  // namespace dvr::detail
