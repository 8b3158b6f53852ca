#include "format/manifest.hpp"

#include <bit>
#include <cstring>
#include <tuple>

#include "dvr/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "the store format is little-endian; add byte swapping for this platform");

namespace dvr::detail {
namespace {

constexpr char kMagic[8] = {'D', 'V', 'R', 'M', 'A', 'N', 'I', 'F'};
constexpr char kEndMagic[8] = {'D', 'V', 'R', 'M', 'E', 'N', 'D', '1'};
constexpr std::size_t kHeaderSize = 24;   // magic, version, flags, body length
constexpr std::size_t kTrailerSize = 16;  // checksum, end magic
constexpr std::size_t kChunkEntrySize = 32;
constexpr std::size_t kOverlayEntrySize = 24;

class Writer {
 public:
  template <class T>
  void put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.append(b, sizeof(T));
  }
  void str(const std::string& s) {
    put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    out.append(s);
  }
  std::string out;
};

class Reader {
 public:
  Reader(std::string_view in, const std::string& where) : in_(in), where_(where) {}
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    auto n = get<std::uint32_t>();
    need(n);
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  void need(std::size_t n) const {
    if (in_.size() - pos_ < n) fail("ends early (truncated)");
  }
  std::size_t remaining() const { return in_.size() - pos_; }
  [[noreturn]] void fail(const std::string& why) const {
    throw Error(Errc::corrupt, "manifest " + where_ + " is damaged: " + why +
                                   "; this snapshot cannot be restored — remove it with `dvr rm` and restore another one");
  }

 private:
  std::string_view in_;
  std::size_t pos_ = 0;
  const std::string& where_;
};

}  // namespace

std::uint64_t Manifest::logical_bytes() const {
  std::uint64_t n = 0;
  for (auto& r : regions) n += r.size;
  return n;
}

void Manifest::index() {
  first_page.assign(chunks.size() + 1, 0);
  for (std::size_t i = 0; i < chunks.size(); ++i) first_page[i + 1] = first_page[i] + (paged ? pages_in(chunks[i].length) : 0);
  first_overlay.assign(chunks.size() + 1, 0);
  std::size_t k = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    first_overlay[i] = static_cast<std::uint32_t>(k);
    while (k < overlays.size() && overlays[k].chunk == i) ++k;
  }
  first_overlay[chunks.size()] = static_cast<std::uint32_t>(k);
}

std::uint64_t manifest_checksum(std::string_view encoded) {
  std::uint64_t sum = 0;
  if (encoded.size() >= kTrailerSize) std::memcpy(&sum, encoded.data() + encoded.size() - kTrailerSize, 8);
  return sum;
}

std::string encode_manifest(const Manifest& m) {
  std::string out;
  encode_manifest(m, out);
  return out;
}

void encode_manifest(const Manifest& m, std::string& into) {
  Writer w;
  w.out = std::move(into);
  w.out.clear();
  w.out.append(kMagic, 8);
  w.put<std::uint32_t>(kManifestVersion);
  w.put<std::uint32_t>(m.flags);
  w.put<std::uint64_t>(0);  // body length, patched below
  w.put<std::int64_t>(m.time_ns);
  w.put<std::uint32_t>(m.chunk_size);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.regions.size()));
  w.put<std::uint64_t>(m.chunks.size());
  w.put<std::uint64_t>(m.logical_bytes());
  w.put<std::uint64_t>(m.stored_bytes);
  w.put<std::uint64_t>(m.chunks_read);
  w.str(m.session);
  w.str(m.name);
  w.str(m.parent);
  w.str(m.label);
  for (auto& r : m.regions) {
    w.str(r.name);
    w.put<std::uint64_t>(r.size);
    w.put<std::uint8_t>(r.sdk_owned ? 1 : 0);
    w.put<std::uint64_t>(r.first_chunk);
    w.put<std::uint64_t>(r.chunk_count);
  }
  // The tables are most of the bytes: written by memcpy into space sized once.
  const std::size_t at = w.out.size();
  w.out.resize(at + m.chunks.size() * kChunkEntrySize + 8 + m.overlays.size() * kOverlayEntrySize);
  char* out = w.out.data() + at;
  auto put = [&out](auto v) {
    std::memcpy(out, &v, sizeof v);
    out += sizeof v;
  };
  for (auto& c : m.chunks) {
    put(c.hash.lo);
    put(c.hash.hi);
    put(c.pack);
    put(c.length);
    put(c.offset);
  }
  put(static_cast<std::uint64_t>(m.overlays.size()));
  for (auto& o : m.overlays) {
    put(o.chunk);
    put(o.page);
    put(o.pack);
    put(o.offset);
  }
  w.out.reserve(w.out.size() + kTrailerSize);
  std::uint64_t body = w.out.size();
  std::memcpy(w.out.data() + 16, &body, 8);
  w.put<std::uint64_t>(hash64(w.out.data(), body));
  w.out.append(kEndMagic, 8);
  into = std::move(w.out);
}

Manifest decode_manifest(std::string_view bytes, const std::string& where) {
  Reader r(bytes, where);
  if (bytes.size() < kHeaderSize + kTrailerSize) r.fail("only " + std::to_string(bytes.size()) + " bytes (truncated)");
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) r.fail("not a manifest (bad magic)");
  std::uint32_t version;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::uint64_t body;
  std::memcpy(&body, bytes.data() + 16, 8);
  // The checksum is checked before the version, so that a damaged version
  // field reads as damage, not as "written by a newer dvr".
  bool intact = body == bytes.size() - kTrailerSize && std::memcmp(bytes.data() + body + 8, kEndMagic, 8) == 0;
  if (intact) {
    std::uint64_t sum;
    std::memcpy(&sum, bytes.data() + body, 8);
    intact = sum == hash64(bytes.data(), body);
  }
  if (version > kManifestVersion) {
    std::string msg = "manifest " + where + " has format version " + std::to_string(version) +
                      ", newer than this dvr understands (" + std::to_string(kManifestVersion) + ")";
    if (intact) throw Error(Errc::unsupported, msg + "; upgrade dvr");
    r.fail("checksum mismatch (" + msg + ", or the header is damaged)");
  }
  if (body != bytes.size() - kTrailerSize)
    r.fail("length " + std::to_string(bytes.size()) + " does not match its header (truncated or extended)");
  if (std::memcmp(bytes.data() + body + 8, kEndMagic, 8) != 0) r.fail("end marker missing");
  if (!intact) r.fail("checksum mismatch");

  Reader in(bytes.substr(0, body), where);
  in.need(kHeaderSize);
  Manifest m;
  for (std::size_t i = 0; i < 12; ++i) in.get<std::uint8_t>();
  m.flags = in.get<std::uint32_t>();
  in.get<std::uint64_t>();
  m.time_ns = in.get<std::int64_t>();
  m.chunk_size = in.get<std::uint32_t>();
  auto region_count = in.get<std::uint32_t>();
  auto chunk_count = in.get<std::uint64_t>();
  auto logical = in.get<std::uint64_t>();
  m.stored_bytes = in.get<std::uint64_t>();
  m.chunks_read = version >= 2 ? in.get<std::uint64_t>() : chunk_count;
  m.session = in.str();
  m.name = in.str();
  m.parent = in.str();
  m.label = in.str();
  if (m.chunk_size == 0 || (m.chunk_size & (m.chunk_size - 1)) != 0) in.fail("bad chunk size");
  for (std::uint32_t i = 0; i < region_count; ++i) {
    ManifestRegion reg;
    reg.name = in.str();
    reg.size = in.get<std::uint64_t>();
    reg.sdk_owned = in.get<std::uint8_t>() != 0;
    reg.first_chunk = in.get<std::uint64_t>();
    reg.chunk_count = in.get<std::uint64_t>();
    m.regions.push_back(std::move(reg));
  }
  if (chunk_count > in.remaining() / kChunkEntrySize || (version < 3 && in.remaining() != chunk_count * kChunkEntrySize))
    in.fail("chunk table size does not match its count");
  m.chunks.resize(chunk_count);
  for (auto& c : m.chunks) {
    c.hash.lo = in.get<std::uint64_t>();
    c.hash.hi = in.get<std::uint64_t>();
    c.pack = in.get<std::uint32_t>();
    c.length = in.get<std::uint32_t>();
    c.offset = in.get<std::uint64_t>();
  }
  m.paged = version >= 3;
  if (m.paged) {
    auto overlay_count = in.get<std::uint64_t>();
    if (overlay_count > in.remaining() / kOverlayEntrySize || in.remaining() != overlay_count * kOverlayEntrySize)
      in.fail("overlay table size does not match its count");
    m.overlays.resize(overlay_count);
    for (std::size_t k = 0; k < m.overlays.size(); ++k) {
      auto& o = m.overlays[k];
      o.chunk = in.get<std::uint64_t>();
      o.page = in.get<std::uint32_t>();
      o.pack = in.get<std::uint32_t>();
      o.offset = in.get<std::uint64_t>();
      bool zero_page = o.pack == 0 && o.offset == 0;  // the page is all zero, not stored
      if (o.chunk >= chunk_count || o.page >= pages_in(m.chunks[o.chunk].length) ||
          (!zero_page && (o.pack == 0 || o.offset < 4096 || o.offset % 4096 != 0 || o.offset > (1ull << 62))))
        in.fail("overlay " + std::to_string(k) + " is impossible");
      if (k > 0 && std::tie(m.overlays[k - 1].chunk, m.overlays[k - 1].page) >= std::tie(o.chunk, o.page))
        in.fail("overlay table is not in order");
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
      // Stored chunks start on a page after the pack header (docs/format.md).
      if (!c.is_zero() && (c.offset < 4096 || c.offset % 4096 != 0 || c.offset > (1ull << 62)))
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
